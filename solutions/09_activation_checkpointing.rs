//! Lesson 09 — activation checkpointing: reference answers.
//! Same signatures as `lessons/09_activation_checkpointing/exercise.rs`; graded by `tests/lesson09.rs`.

use shardlab::model::{Batch, Model};
use shardlab::prelude::*;

/// Exercise 1 — the checkpointed forward. Run `model`'s stages in order on `batch` (stage 0 reads
/// the batch: pass it an undefined `Tensor::new()`; stage s > 0 reads stage s−1's output). Stage
/// s's input must be a fresh leaf that requires grad (the previous output, detached), so that each
/// stage has its own graph. Where `recompute[s]` is true, run the stage **without** a graph: it
/// keeps nothing but its input. Returns every stage's `(input, output)`.
pub fn checkpointed_forward(model: &dyn Model, batch: &Batch, recompute: &[bool]) -> Vec<(Tensor, Tensor)> {
    let mut kept: Vec<(Tensor, Tensor)> = Vec::with_capacity(model.num_stages());
    for s in 0..model.num_stages() {
        let input = match kept.last() {
            None => Tensor::new(),
            Some((_, prev)) => prev.detach().set_requires_grad(true),
        };
        let output = if recompute[s] {
            tch::no_grad(|| model.stage_forward(s, &input, batch))
        } else {
            model.stage_forward(s, &input, batch)
        };
        kept.push((input, output));
    }
    kept
}

/// Exercise 2 — the checkpointed backward. From `kept` (exercise 1's result, same `recompute`),
/// run the stages' backward from last to first, adding every parameter's gradient into its
/// `.grad` exactly as `loss.backward()` would (a parameter may be used by two stages: the tied
/// embedding). A recomputed stage runs its forward again, with a graph, just before its backward.
/// The last stage's output is the loss: back-propagate `scale × loss`. Returns the loss value.
pub fn checkpointed_backward(
    model: &dyn Model,
    batch: &Batch,
    recompute: &[bool],
    mut kept: Vec<(Tensor, Tensor)>,
    scale: f64,
) -> f64 {
    let n = model.num_stages();
    let params = model.parameters();
    let uses = model.stage_uses();
    let loss = kept[n - 1].1.double_value(&[]);
    let mut g_next = Tensor::new();
    for s in (0..n).rev() {
        let (input, mut out) = kept.pop().expect("one pair per stage");
        if recompute[s] {
            out = model.stage_forward(s, &input, batch);
        }
        let obj = if s == n - 1 { out * scale } else { (out * &g_next).sum(Kind::Float) };
        let mut wrt: Vec<Tensor> = uses[s].iter().map(|&i| params[i].shallow_clone()).collect();
        if s > 0 {
            wrt.push(input);
        }
        let mut grads = Tensor::run_backward(&[obj], &wrt, false, false);
        if s > 0 {
            g_next = grads.pop().expect("the input's gradient");
        }
        shardlab::model::ensure_grads(&params);
        for (&i, g) in uses[s].iter().zip(&grads) {
            if g.defined() {
                let _ = params[i].grad().g_add_(g);
            }
        }
    }
    loss
}

/// Exercise 3 — the peak, on the backward's timeline. Blocks `0..recompute.len()` each keep
/// `layer_bytes` of activations for backward when they keep their graph, and only their input,
/// `input_bytes`, when `recompute[i]`. At the start of backward every block's kept bytes are alive.
/// Backward then runs the blocks from last to first and frees each block's bytes once its
/// backward is done; a recomputed block first rebuilds its graph, so while it runs, the blocks
/// before it plus its own full `layer_bytes` are alive. Return the largest total alive at any
/// moment.
pub fn peak_activation_bytes(recompute: &[bool], layer_bytes: u64, input_bytes: u64) -> u64 {
    let kept = |i: usize| if recompute[i] { input_bytes } else { layer_bytes };
    let mut alive: u64 = (0..recompute.len()).map(kept).sum();
    let mut peak = alive;
    for j in (0..recompute.len()).rev() {
        alive -= kept(j); // blocks after j are already freed; j's own bytes are counted below
        if recompute[j] {
            peak = peak.max(alive + layer_bytes);
        }
    }
    peak
}

/// Exercise 4 — fit a budget. For a model of `layers` blocks, return the policy whose peak
/// (exercise 3) fits in `budget` with the fewest recomputed blocks — the least extra time: `None`
/// (no checkpointing) if that fits, else the `Every(k)` (k in 2..=layers; it recomputes blocks 0,
/// k, 2k, …) or `Full` that fits with the fewest recomputed blocks — ties broken by the lower peak,
/// then the smaller k;
/// `Option::None` if even full checkpointing does not fit.
pub fn policy_for_budget(layers: u64, layer_bytes: u64, input_bytes: u64, budget: u64) -> Option<Checkpointing> {
    let n = layers as usize;
    let mask = |p: Checkpointing| (0..n).map(|b| p.recomputes(b + 1, n + 2)).collect::<Vec<bool>>();
    let mut candidates = vec![Checkpointing::None, Checkpointing::Full];
    candidates.extend((2..=n).map(Checkpointing::Every));
    candidates
        .into_iter()
        .map(|p| {
            let m = mask(p);
            (m.iter().filter(|&&r| r).count(), peak_activation_bytes(&m, layer_bytes, input_bytes), p)
        })
        .filter(|&(_, peak, _)| peak <= budget)
        .min_by_key(|&(r, peak, _)| (r, peak))
        .map(|(_, _, p)| p)
}
