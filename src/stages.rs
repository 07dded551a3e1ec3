//! The stage runner: one forward and backward through a [`Model`]'s stages, with hooks, used by
//! every strategy (single, DDP, ZeRO/FSDP) and by activation checkpointing.
//!
//! Forward runs stage by stage; each stage's input is the previous stage's output detached into a
//! fresh leaf, so each stage has its own graph. Backward runs from the last stage to the first:
//! stage `s`'s objective is `sum(out_s · g)`, where `g` is the gradient the backward of stage
//! `s+1` left on its input leaf (the last stage's objective is the loss times `scale`); by the
//! chain rule this gives the same gradients as one `loss.backward()`. `Tensor::run_backward`
//! *returns* the stage's parameter gradients, and [`StageHooks::grads`] decides where they go
//! (into `.grad` for replicated strategies, into a unit's flat buffer for ZeRO).
//!
//! A stage is *recomputed* when the checkpoint policy ([`Checkpointing`]) or the strategy
//! ([`StageHooks::must_recompute`], ZeRO-3 resharding after forward) asks: its forward runs
//! without a graph, keeping only its input (s·b·h values), and runs again with a graph just before
//! its backward. Same operations on the same values: the gradients are bitwise those of no
//! recompute, at the price of one more forward of that stage.
//!
//! ```text
//! begin
//! for s in 0..n:     pre_forward(s)  forward(s) [no graph if recomputed]  post_forward(s)
//! for s in n-1..=0:  pre_backward(s) [forward(s) again if recomputed]  backward(s) → grads(s, …)  post_backward(s)
//! end
//! ```

use crate::comm::{CommError, CommResult};
use crate::model::{Batch, Model};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// Which stages keep no graph in forward and are recomputed in backward (activation
/// checkpointing). Only the middle stages — the transformer blocks — are ever checkpointed: the
/// first (embeddings) and last (head and loss) keep their graphs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Checkpointing {
    /// Keep every block's activations (no recompute).
    #[default]
    None,
    /// Recompute every block: keep only each block's input.
    Full,
    /// Recompute one block in every K (blocks 0, K, 2K, …): ⌈L/K⌉ of L blocks, full at K = 1.
    /// Block 0 is always recomputed, so a K at or above the number of blocks recomputes block 0
    /// alone — not the same as `None`.
    Every(usize),
}

impl Checkpointing {
    /// Whether stage `s` of a model with `n` stages is recomputed under this policy.
    pub fn recomputes(&self, s: usize, n: usize) -> bool {
        let block = s > 0 && s + 1 < n;
        match *self {
            Checkpointing::None => false,
            Checkpointing::Full => block,
            Checkpointing::Every(k) => block && (s - 1) % k.max(1) == 0,
        }
    }
}

impl std::str::FromStr for Checkpointing {
    type Err = String;
    /// `none`, `full` or `every:K` (K ≥ 1).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Checkpointing::None),
            "full" => Ok(Checkpointing::Full),
            _ => match s.strip_prefix("every:").map(str::parse::<usize>) {
                Some(Ok(k)) if k >= 1 => Ok(Checkpointing::Every(k)),
                _ => Err(format!("activation checkpointing is none, full or every:K with K >= 1, not {s:?}")),
            },
        }
    }
}

impl std::fmt::Display for Checkpointing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Checkpointing::None => write!(f, "none"),
            Checkpointing::Full => write!(f, "full"),
            Checkpointing::Every(k) => write!(f, "every:{k}"),
        }
    }
}

/// What a strategy does around the stages. Every hook but [`grads`](Self::grads) defaults to
/// nothing.
pub trait StageHooks {
    /// Before the first stage's forward (ZeRO-3: gather the root unit).
    fn begin(&mut self) -> CommResult<()> {
        Ok(())
    }
    /// Must stage `s` be recomputed whatever the checkpoint policy (ZeRO-3 resharding after
    /// forward: its unit is released after forward, and autograd's saved views would otherwise
    /// keep it alive)?
    fn must_recompute(&self, _s: usize) -> bool {
        false
    }
    /// Before stage `s`'s forward (ZeRO-3: gather its unit, start the next one's gather).
    fn pre_forward(&mut self, _s: usize) -> CommResult<()> {
        Ok(())
    }
    /// After stage `s`'s forward; `recomputed`: it kept no graph (ZeRO-3 resharding after forward:
    /// release its unit).
    fn post_forward(&mut self, _s: usize, _recomputed: bool) -> CommResult<()> {
        Ok(())
    }
    /// Before stage `s`'s backward, and before its recompute (ZeRO-3: gather its unit again).
    fn pre_backward(&mut self, _s: usize) -> CommResult<()> {
        Ok(())
    }
    /// The gradients stage `s`'s backward produced for the parameters it uses (`uses`: their
    /// indices, [`Model::stage_uses`]`[s]`; a gradient is undefined where the stage did not use
    /// the parameter). A tied parameter gets one call per stage that uses it: add them up.
    fn grads(&mut self, s: usize, uses: &[usize], grads: Vec<Tensor>) -> CommResult<()>;
    /// After stage `s`'s backward: every parameter whose first use is `s` has its final gradient
    /// (DDP: all-reduce the buckets now complete; ZeRO: reduce-scatter finished units).
    fn post_backward(&mut self, _s: usize) -> CommResult<()> {
        Ok(())
    }
    /// After the first stage's backward (ZeRO-3: release the root unit).
    fn end(&mut self) -> CommResult<()> {
        Ok(())
    }
}

/// One forward and backward of `model` on `batch` with the loss scaled by `scale`; `params` are
/// the model's parameters ([`Model::parameters`] order). Returns the unscaled loss.
pub fn forward_backward(
    model: &dyn Model,
    params: &[Tensor],
    batch: &Batch,
    scale: f64,
    policy: Checkpointing,
    hooks: &mut dyn StageHooks,
) -> CommResult<f64> {
    let n = model.num_stages();
    let uses = model.stage_uses();
    if n == 0 {
        return Err(CommError::InvalidArgument("a model needs at least one stage".into()));
    }
    hooks.begin()?;
    // ---- forward: each stage its own graph, or none if it is recomputed ----
    let recompute: Vec<bool> = (0..n).map(|s| policy.recomputes(s, n) || hooks.must_recompute(s)).collect();
    let mut inputs: Vec<Tensor> = Vec::with_capacity(n);
    let mut outputs: Vec<Tensor> = Vec::with_capacity(n);
    for s in 0..n {
        hooks.pre_forward(s)?;
        // (b, t, h) f32 activations between blocks: a leaf of its own, so the stage's graph ends here.
        let xin = if s == 0 { Tensor::new() } else { outputs[s - 1].detach().set_requires_grad(true) };
        let y = if recompute[s] {
            tch::no_grad(|| model.stage_forward(s, &xin, batch))
        } else {
            model.stage_forward(s, &xin, batch)
        };
        inputs.push(xin);
        outputs.push(y);
        hooks.post_forward(s, recompute[s])?;
    }
    let loss = outputs[n - 1].double_value(&[]);
    // ---- backward, last stage first ----
    let mut g_next = Tensor::new();
    for s in (0..n).rev() {
        hooks.pre_backward(s)?;
        let mut out = outputs.pop().expect("one output per stage");
        let input = inputs.pop().expect("one input per stage");
        if recompute[s] {
            out = model.stage_forward(s, &input, batch); // the same forward, now with a graph
        }
        let obj = if s == n - 1 { out * scale } else { (out * &g_next).sum(Kind::Float) };
        let mut wrt: Vec<Tensor> = uses[s].iter().map(|&i| params[i].shallow_clone()).collect();
        if s > 0 {
            wrt.push(input.shallow_clone());
        }
        let mut grads = Tensor::run_backward(&[obj], &wrt, false, false);
        if s > 0 {
            g_next = grads.pop().expect("the input's gradient");
        }
        drop(wrt);
        hooks.grads(s, &uses[s], grads)?;
        hooks.post_backward(s)?;
    }
    hooks.end()?;
    Ok(loss)
}

/// The forward of every stage under `no_grad`, between the strategy's forward hooks (evaluation:
/// no graph, no backward hook, nothing to reduce), then [`StageHooks::end`]. Returns the loss.
/// What a hook gathered and kept (ZeRO-3 without resharding after forward) is the caller's to free.
pub fn forward_only(model: &dyn Model, batch: &Batch, hooks: &mut dyn StageHooks) -> CommResult<f64> {
    let n = model.num_stages();
    if n == 0 {
        return Err(CommError::InvalidArgument("a model needs at least one stage".into()));
    }
    hooks.begin()?;
    let mut x = Tensor::new();
    for s in 0..n {
        hooks.pre_forward(s)?;
        x = tch::no_grad(|| model.stage_forward(s, &x, batch));
        hooks.post_forward(s, true)?;
    }
    hooks.end()?;
    Ok(x.double_value(&[]))
}

/// Hooks that add each stage's gradients into the parameters' `.grad` (as `loss.backward()`
/// does), then call `on_stage_done(s)` — the replicated strategies' hooks.
pub struct AccumulateGrads<F: FnMut(usize) -> CommResult<()>> {
    grads: Vec<Tensor>,
    on_stage_done: F,
}

impl<F: FnMut(usize) -> CommResult<()>> AccumulateGrads<F> {
    /// For `params` (each gets a `.grad` if it has none).
    pub fn new(params: &[Tensor], on_stage_done: F) -> Self {
        AccumulateGrads { grads: crate::model::grads(params), on_stage_done }
    }
}

impl<F: FnMut(usize) -> CommResult<()>> StageHooks for AccumulateGrads<F> {
    fn grads(&mut self, _s: usize, uses: &[usize], grads: Vec<Tensor>) -> CommResult<()> {
        for (&i, g) in uses.iter().zip(&grads) {
            if g.defined() {
                let _ = self.grads[i].g_add_(g);
            }
        }
        Ok(())
    }
    fn post_backward(&mut self, s: usize) -> CommResult<()> {
        (self.on_stage_done)(s)
    }
}

/// Forward, then backward one stage at a time from the last to the first, scaling the loss by
/// `scale` (1/accumulation steps), adding the gradients into the parameters' `.grad`. After stage
/// `s`'s backward, every parameter whose first use is stage `s` has its final gradient for this
/// batch and `on_stage_done(s)` is called.
///
/// How: the output of each stage is detached into a fresh leaf that requires grad and fed to the
/// next stage, so each stage has its own graph. Backward of stage `s` is `sum(out_s · g)` where
/// `g` is the gradient that stage `s+1`'s backward left on its input leaf — by the chain rule the
/// same parameter gradients as one monolithic `loss.backward()`. Returns the (unscaled) loss value.
/// This is [`forward_backward`] with no checkpointing and the replicated
/// strategies' hooks.
pub fn staged_backward(model: &dyn Model, batch: &Batch, scale: f64, mut on_stage_done: impl FnMut(usize)) -> f64 {
    let params = model.parameters();
    let mut hooks = AccumulateGrads::new(&params, |s| {
        on_stage_done(s);
        Ok(())
    });
    forward_backward(model, &params, batch, scale, Checkpointing::None, &mut hooks).expect("these hooks cannot fail")
}
