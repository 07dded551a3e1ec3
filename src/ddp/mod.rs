//! Data parallelism (DDP): every rank holds the whole model, trains on its own slice of the
//! global batch, and averages gradients with an all-reduce before the optimizer step — so all
//! ranks take the same step, the one a single process would take on the whole batch.
//!
//! Two variants side by side (`--variant` in the bins):
//! * [`DdpNaive`] (lesson 04): full backward, then one blocking all-reduce per parameter.
//! * [`DdpBucketed`] (lesson 05): gradients packed into size-capped buckets in reverse
//!   registration order; each bucket's all-reduce starts, asynchronously, as soon as the staged
//!   backward has finished every gradient in it, so communication overlaps the rest of backward.
//!
//! Both support gradient accumulation: inside [`DataParallel::no_sync`] backward only accumulates
//! locally; the next synchronised backward all-reduces the accumulated sum (PyTorch's `no_sync()`).

mod bucketed;
mod naive;

pub use bucketed::{assign_buckets, DdpBucketed};
pub use naive::{average_gradients, DdpNaive};

use crate::comm::{CommError, CommResult, ProcessGroup};
use crate::memory::{held_bytes, MemoryStats};
use crate::model::{Batch, Model};
use crate::optim::{self, Held, NonFinite, Optimizer, StepConfig, Stepped};
use crate::precision::GradScaler;
use crate::stages::{forward_backward, AccumulateGrads, Checkpointing};
pub use crate::stats::DdpStats;
use serde::{Deserialize, Serialize};

/// Which DDP implementation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum Variant {
    /// One blocking all-reduce per parameter after the whole backward.
    Naive,
    /// Size-capped buckets, all-reduced asynchronously during a staged backward.
    Bucketed,
}

/// Default bucket cap: PyTorch DDP's `bucket_cap_mb=25`.
pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 * 1024 * 1024;

/// A model wrapped for data-parallel training.
pub trait DataParallel {
    /// The wrapped model.
    fn model(&self) -> &dyn Model;
    /// The group gradients are averaged over.
    fn group(&self) -> &ProcessGroup;
    /// Forward and backward on this rank's `batch` with the loss scaled by `scale`; unless inside
    /// [`no_sync`](Self::no_sync), gradients are then averaged over the group. Returns the
    /// unscaled local loss.
    fn backward(&mut self, batch: &Batch, scale: f64) -> CommResult<f64>;
    /// The local mean loss of this rank's `batch`, forward alone (evaluation: no graph, no
    /// gradient, nothing reduced; a sharded strategy gathers what the forward needs and frees it
    /// after). Replicated strategies: the model's forward under `no_grad`.
    fn eval_loss(&mut self, batch: &Batch) -> CommResult<f64> {
        Ok(tch::no_grad(|| self.model().loss(batch)).double_value(&[]))
    }
    /// Turn gradient synchronisation off (`false`) or back on.
    fn set_require_sync(&mut self, on: bool);
    /// Whether the last backward ran inside `no_sync` or failed, leaving gradients that were never
    /// (all) averaged (a step now would be wrong). Default: never (single process).
    fn unsynced(&self) -> bool {
        false
    }
    /// Activation checkpointing for the following backward passes (lesson 09): which blocks keep
    /// no graph in forward and are recomputed in backward.
    fn set_checkpointing(&mut self, policy: Checkpointing);
    /// Timings and volumes so far.
    fn stats(&self) -> DdpStats;
    /// The gradients this rank holds for the next step, after a synchronised backward: the
    /// parameters' `.grad` (replicated strategies, averaged, whole) or this rank's gradient shards
    /// (ZeRO). A loss scaler unscales these ([`GradScaler::unscale`](crate::precision::GradScaler::unscale)).
    fn grads(&self) -> Vec<tch::Tensor> {
        crate::model::grads(&self.model().parameters())
    }
    /// This rank's optimizer slots, in the order [`step`](Self::step) passes them to the optimizer,
    /// and which parameter elements each holds — what a checkpoint saves and restores
    /// ([`crate::checkpoint`]). Replicated strategies: one slot per parameter, the parameter itself.
    fn slots(&self) -> Vec<Slot> {
        self.model()
            .parameters()
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                let n = p.numel() as i64;
                Slot { master: p, pieces: vec![(i, 0..n, 0..n)], replicated: true }
            })
            .collect()
    }
    /// The shape of every parameter (`named_parameters` order), whatever this rank holds of it
    /// (ZeRO-3's parameters are empty between steps).
    fn param_shapes(&self) -> Vec<Vec<i64>> {
        self.model().parameters().iter().map(|p| p.size()).collect()
    }
    /// After the slots' masters were overwritten (a checkpoint loaded into them): bring every
    /// copy derived from them up to date (ZeRO-1/2: all-gather the shards into the whole
    /// parameters). A collective for sharded strategies. Default: nothing to do.
    fn masters_loaded(&mut self) -> CommResult<()> {
        Ok(())
    }
    /// Copies of the full parameters, in `named_parameters` order, on every rank (a collective
    /// for sharded strategies: call it on all ranks).
    fn full_parameters(&self) -> CommResult<Vec<tch::Tensor>> {
        Ok(self.model().parameters().iter().map(|p| p.detach().copy()).collect())
    }
    /// Bytes this rank holds in parameters, gradients and `opt`'s state, measured from the tensors
    /// it keeps ([`held_bytes`](crate::memory::held_bytes)). Replicated strategies: the full model
    /// and its gradients (kept, zeroed, between steps).
    fn memory(&self, opt: &dyn Optimizer) -> MemoryStats {
        let params = self.model().parameters();
        let grads: Vec<tch::Tensor> = params.iter().map(|p| p.grad()).collect();
        MemoryStats {
            params: held_bytes(&params),
            grads: held_bytes(&grads),
            optim: opt.state_bytes(),
            peak_transient: 0,
            offloaded: 0,
        }
    }
    /// The optimizer step after the (synchronised) backward, [`optimizer_step`](crate::optim::optimizer_step)
    /// over the group: the global L2 norm of the gradients (returned, the same on every rank; the
    /// averaged gradients are replicated, so rank 0's count), the gradients scaled down to
    /// `grad_clip` if set and the norm is above it (PyTorch's `clip_grad_norm_`), then `opt` at
    /// learning rate `lr` on every parameter (replicated strategies) or every unit's shard (ZeRO);
    /// then the gradients are zeroed. Refused — an error on every rank, no weight changed, the
    /// gradients cleared — when any rank's gradients are not finite (a NaN or an overflow in
    /// backward), any rank's `opt` does not accept its slots, or the last backward ran inside
    /// `no_sync`.
    fn step(&mut self, opt: &mut dyn Optimizer, lr: f64, grad_clip: Option<f64>) -> CommResult<f64> {
        Ok(self.step_with(opt, lr, grad_clip, NonFinite::Fail)?.norm)
    }

    /// [`step`](Self::step), choosing what a non-finite gradient does: an error on every rank
    /// ([`NonFinite::Fail`]) or a step every rank skips ([`NonFinite::Skip`], fp16's loss scaler).
    fn step_with(
        &mut self,
        opt: &mut dyn Optimizer,
        lr: f64,
        grad_clip: Option<f64>,
        non_finite: NonFinite,
    ) -> CommResult<Stepped> {
        let refusal = self.unsynced().then(|| NO_SYNC_REFUSAL.to_string());
        let pg = self.group();
        let params = self.model().parameters();
        let grads: Vec<tch::Tensor> = params.iter().map(|p| p.grad()).collect();
        let held = Held::whole(params, grads, pg.rank() == 0);
        optim::optimizer_step(&[pg], opt, &held, lr, grad_clip, non_finite, refusal)
    }

    /// Run `f` without gradient synchronisation (PyTorch's `with ddp.no_sync():`), on a concrete
    /// wrapper type; through a `Box<dyn DataParallel>` call `set_require_sync(false)` and, before
    /// the last micro-batch, `set_require_sync(true)` (what [`train_step`] does).
    fn no_sync<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R
    where
        Self: Sized,
    {
        self.set_require_sync(false);
        let r = f(self);
        self.set_require_sync(true);
        r
    }
}

/// One optimizer slot of a rank: the f32 master tensor the optimizer steps (a parameter, or a
/// ZeRO unit's shard) and the parameter elements it holds.
pub struct Slot {
    /// The master values (a parameter with its shape, or a flat shard).
    pub master: tch::Tensor,
    /// `(parameter index, flat range within the parameter, flat range within the slot)`.
    pub pieces: Vec<(usize, std::ops::Range<i64>, std::ops::Range<i64>)>,
    /// Every rank holds this slot whole (replicated strategies).
    pub replicated: bool,
}

/// Why a step after a backward inside `no_sync` (or a failed one) is refused.
pub const NO_SYNC_REFUSAL: &str = "the last backward ran without gradient synchronisation (no_sync), or failed: its \
     gradients were never (all) averaged. The step is refused and the gradients cleared: run the step's micro-batches \
     again, the last one with synchronisation on";

/// Build the DDP wrapper `variant` around `model`: rank 0's parameters are broadcast to every
/// rank first, as PyTorch DDP does at construction.
pub fn wrap<'a>(
    pg: &'a ProcessGroup,
    model: Box<dyn Model + 'a>,
    variant: Variant,
    bucket_cap_bytes: usize,
) -> CommResult<Box<dyn DataParallel + 'a>> {
    Ok(match variant {
        Variant::Naive => Box::new(DdpNaive::new(pg, model)?),
        Variant::Bucketed => Box::new(DdpBucketed::new(pg, model, bucket_cap_bytes)?),
    })
}

/// Row ranges of the `accum` micro-batches a batch of `rows` rows is cut into (sizes differ by at
/// most one; `accum` must be in 1..=rows).
pub fn micro_batches(rows: i64, accum: i64) -> Vec<(i64, i64)> {
    assert!(accum >= 1 && accum <= rows.max(1), "accumulation steps must be in 1..={rows}, got {accum}");
    (0..accum).map(|i| (rows * i / accum, rows * (i + 1) / accum)).collect()
}

/// What one optimizer step reports.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepOutput {
    /// This rank's mean loss over its batch.
    pub loss: f64,
    /// The global gradient norm before clipping (as llm.c and nanoGPT print it); with a loss
    /// scaler, of the unscaled gradients (infinite on a skipped step).
    pub grad_norm: f64,
    /// The learning rate the step used.
    pub lr: f64,
    /// With a loss scaler (fp16): the scale this step's backward used, and whether the step was
    /// skipped because some rank's gradients overflowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    #[serde(default)]
    pub skipped: bool,
}

/// One optimizer step of data-parallel training on this rank's `batch`, cut into `accum`
/// micro-batches: backward under `no_sync` for all but the last, each loss scaled by its share of
/// the rows (so the accumulated gradient is that of the batch mean), then the optimizer step at
/// `cfg.lr` with the gradients clipped to `cfg.grad_clip` if set ([`DataParallel::step`]).
pub fn train_step(
    dp: &mut dyn DataParallel,
    opt: &mut dyn Optimizer,
    batch: &Batch,
    accum: i64,
    cfg: StepConfig,
) -> CommResult<StepOutput> {
    let rows = batch.len();
    if accum < 1 || accum > rows {
        return Err(CommError::InvalidArgument(format!(
            "gradient accumulation over {accum} micro-batches needs 1..={rows} (the rows of this rank's batch)"
        )));
    }
    train_step_scaled(dp, opt, batch, accum, cfg, None)
}

/// [`train_step`] with dynamic loss scaling when `scaler` is given (fp16, lesson 08), PyTorch's
/// `scaler.scale(loss).backward(); scaler.unscale_(opt); clip; scaler.step(opt); scaler.update()`:
/// every backward runs on the loss times the scale S; then the gradients are divided by S
/// ([`GradScaler::unscale`]) and the step's agreed non-finite check
/// ([`DataParallel::step_with`] with [`NonFinite::Skip`]) looks for inf/NaN on every rank at once:
/// on an overflow anywhere every rank clears its gradients and skips the step (`skipped`, a
/// non-finite `grad_norm`), else the step is taken; then the scale is updated (halved on overflow,
/// doubled after `growth_interval` clean steps).
pub fn train_step_scaled(
    dp: &mut dyn DataParallel,
    opt: &mut dyn Optimizer,
    batch: &Batch,
    accum: i64,
    cfg: StepConfig,
    scaler: Option<&mut GradScaler>,
) -> CommResult<StepOutput> {
    let rows = batch.len();
    if accum < 1 || accum > rows {
        return Err(CommError::InvalidArgument(format!(
            "gradient accumulation over {accum} micro-batches needs 1..={rows} (the rows of this rank's batch)"
        )));
    }
    if scaler.is_none() && dp.model().precision() == crate::precision::Precision::Fp16 {
        // The same on every rank (the model's precision is the job's), before any computes.
        return Err(CommError::InvalidArgument(format!(
            "rank {}: an fp16 model needs a loss scaler — its small gradients flush to zero in fp16 and its large \
             ones overflow: pass a GradScaler to train_step_scaled (TrainContext::scaler gives one), or compute in bf16",
            dp.group().rank()
        )));
    }
    let s = scaler.as_ref().map_or(1.0, |sc| sc.scale());
    let mut loss = 0.0;
    let parts = micro_batches(rows, accum);
    for (i, &(lo, hi)) in parts.iter().enumerate() {
        let share = (hi - lo) as f64 / rows as f64;
        dp.set_require_sync(i + 1 == parts.len());
        let r = dp.backward(&batch.rows(lo, hi), share * s);
        dp.set_require_sync(true);
        loss += r? * share;
    }
    let Some(scaler) = scaler else {
        let grad_norm = dp.step(opt, cfg.lr, cfg.grad_clip)?;
        return Ok(StepOutput { loss, grad_norm, lr: cfg.lr, loss_scale: None, skipped: false });
    };
    scaler.unscale(&dp.grads());
    let st = dp.step_with(opt, cfg.lr, cfg.grad_clip, NonFinite::Skip)?;
    scaler.update(st.skipped);
    Ok(StepOutput { loss, grad_norm: st.norm, lr: cfg.lr, loss_scale: Some(s), skipped: st.skipped })
}

/// No data parallelism: one process on the stage runner, the gradients of a plain `loss.backward()`
/// (the reference every strategy must match).
pub struct Single<'a> {
    pg: &'a ProcessGroup,
    model: Box<dyn Model + 'a>,
    stats: DdpStats,
    checkpointing: Checkpointing,
}

impl<'a> Single<'a> {
    /// Wrap `model`; the group must have one rank.
    pub fn new(pg: &'a ProcessGroup, model: Box<dyn Model + 'a>) -> CommResult<Self> {
        if pg.world_size() != 1 {
            return Err(crate::comm::CommError::InvalidArgument(format!(
                "the single-process strategy runs on one rank, this group has {}",
                pg.world_size()
            )));
        }
        Ok(Single { pg, model, stats: DdpStats::default(), checkpointing: Checkpointing::None })
    }
}

impl DataParallel for Single<'_> {
    fn model(&self) -> &dyn Model {
        &*self.model
    }
    fn group(&self) -> &ProcessGroup {
        self.pg
    }
    fn backward(&mut self, batch: &Batch, scale: f64) -> CommResult<f64> {
        let t0 = std::time::Instant::now();
        let params = self.model.parameters();
        let mut hooks = AccumulateGrads::new(&params, |_| Ok(()));
        let v = forward_backward(&*self.model, &params, batch, scale, self.checkpointing, &mut hooks)?;
        self.stats.compute_s += t0.elapsed().as_secs_f64();
        Ok(v)
    }
    fn set_require_sync(&mut self, _on: bool) {}
    fn set_checkpointing(&mut self, policy: Checkpointing) {
        self.checkpointing = policy;
    }
    fn stats(&self) -> DdpStats {
        self.stats
    }
}
