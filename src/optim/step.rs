//! The one optimizer step every layout takes (single process, DDP, ZeRO/FSDP, tensor and
//! pipeline parallelism, and their products), after its gradients are averaged over the data
//! dimension:
//!
//! 1. each rank looks at what it holds: whether its optimizer accepts its slots (and the clip is
//!    a norm), Σ g² over the gradients it *counts*, and whether any gradient it holds is not
//!    finite;
//! 2. one all-reduce per mesh dimension of one small f64 vector `[Σ g², refused by rank…,
//!    non-finite on rank…]` (1 + 2·world numbers) makes that the same on every rank;
//! 3. a refusal anywhere, or a non-finite norm or gradient anywhere, stops the step on every rank
//!    at once — no weight changes, the gradients are cleared, and every rank says which ranks and
//!    why (or, with fp16's loss scaler, every rank skips the step);
//! 4. else the gradients are clipped to the global norm (PyTorch's `clip_grad_norm_`), the
//!    optimizer updates what the rank holds, and the gradients are cleared.
//!
//! *Counted*: each gradient element of the model counts once in the global norm, wherever it is
//! held. A replicated gradient (DDP's averaged gradient on every rank, a tensor-parallel
//! LayerNorm's on every tensor rank, the tied embedding on a pipeline's first and last stage) is
//! counted on one of its holders; a shard or a split slice on its owner. Non-finite values are
//! looked for in every gradient held, counted or not: a NaN on one replica alone stops every rank.
//!
//! The dtype rule: each gradient is squared in its own dtype (f32 for every master gradient here)
//! and summed in f64; the per-rank sums are added in f64 in the all-reduce.

use super::{check_grad_clip, clip_coef, Decay, Optimizer};
use crate::comm::{CommError, CommResult, ProcessGroup, ReduceOp};
use tch::{Device, Kind, Tensor};

/// What a rank holds for the step: its optimizer slots, their gradients (undefined: no gradient,
/// the slot is skipped), their weight-decay rule, and whether each gradient counts in the global
/// norm on this rank (see the module docs).
pub struct Held {
    pub params: Vec<Tensor>,
    pub grads: Vec<Tensor>,
    pub decay: Vec<Decay>,
    pub counted: Vec<bool>,
}

impl Held {
    /// Slots whose gradients all count on this rank (a shard each rank owns alone, or a single
    /// process) or none of them (a replica other than the counting one): `counted` for all.
    pub fn uniform(params: Vec<Tensor>, grads: Vec<Tensor>, decay: Vec<Decay>, counted: bool) -> Held {
        let counted = vec![counted; params.len()];
        Held { params, grads, decay, counted }
    }

    /// Whole parameters with their gradients (nanoGPT's decay rule by shape), all counted or not.
    pub fn whole(params: Vec<Tensor>, grads: Vec<Tensor>, counted: bool) -> Held {
        let decay = params.iter().map(|p| Decay::for_shape(&p.size())).collect();
        Held::uniform(params, grads, decay, counted)
    }

    /// Zero every defined gradient in place (they are the caller's tensors: `.grad`, shards).
    pub fn clear_grads(&self) {
        tch::no_grad(|| {
            for g in self.grads.iter().filter(|g| g.defined()) {
                let _ = g.shallow_clone().zero_();
            }
        });
    }
}

/// What a non-finite gradient does to the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NonFinite {
    /// Every rank returns the same error (fp32, bf16: a NaN means something is wrong).
    Fail,
    /// Every rank skips the step (fp16 with a loss scaler: an overflow is expected now and then).
    Skip,
}

/// What the step did, the same on every rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stepped {
    /// The global gradient norm before clipping (not finite on a skipped step).
    pub norm: f64,
    /// The step was skipped ([`NonFinite::Skip`]); no weight changed.
    pub skipped: bool,
}

/// The step described in the module docs, on this rank's `held` slots, over `dims`: the groups
/// of the mesh dimensions that together hold the model, outermost first (`[dp]` for DDP and ZeRO,
/// `[dp, tp]`, `[dp, pp]`…; empty for one process). A rank's place in the messages is its
/// row-major index over `dims` (its global rank on a mesh laid out in that order).
///
/// `refusal` is a reason this rank already has not to step (a backward inside `no_sync`, say); it
/// is agreed on like the optimizer's own refusal. Errors from the all-reduce itself (a peer lost)
/// are returned as they are; every other outcome is the same on every rank.
pub fn optimizer_step(
    dims: &[&ProcessGroup],
    opt: &mut dyn Optimizer,
    held: &Held,
    lr: f64,
    grad_clip: Option<f64>,
    non_finite: NonFinite,
    refusal: Option<String>,
) -> CommResult<Stepped> {
    let world: usize = dims.iter().map(|g| g.world_size()).product();
    let me = dims.iter().fold(0, |acc, g| acc * g.world_size() + g.rank());
    let n = held.params.len();
    let refusal = refusal
        .or_else(|| check_grad_clip(grad_clip).err())
        .or_else(|| {
            (held.grads.len() != n || held.decay.len() != n || held.counted.len() != n).then(|| {
                format!(
                    "{n} slots but {} gradients, {} decay rules and {} counted flags",
                    held.grads.len(),
                    held.decay.len(),
                    held.counted.len()
                )
            })
        })
        .or_else(|| opt.check(&held.params, &held.grads, &held.decay).err().map(|e| format!("the optimizer: {e}")));

    // 1. What this rank holds: Σ g² (f64) of each gradient, one read for all of them.
    let defined: Vec<(usize, &Tensor)> =
        held.grads.iter().enumerate().filter(|(_, g)| g.defined() && g.numel() > 0).collect();
    let (mut counted_sq, mut all_sq) = (0.0, 0.0);
    if refusal.is_none() && !defined.is_empty() {
        let sums: Vec<Tensor> = defined.iter().map(|(_, g)| g.detach().square().sum(Kind::Double)).collect();
        let sums = Vec::<f64>::try_from(Tensor::stack(&sums, 0).to_device(Device::Cpu)).expect("f64 sums");
        for ((i, _), s) in defined.iter().zip(sums) {
            all_sq += s;
            if held.counted[*i] {
                counted_sq += s;
            }
        }
    }
    // 2. Agree: [Σ g², refused by rank r…, non-finite on rank r…], summed over every dimension.
    let mut v = vec![0f64; 1 + 2 * world];
    v[0] = counted_sq;
    v[1 + me] = refusal.is_some() as u8 as f64;
    v[1 + world + me] = !all_sq.is_finite() as u8 as f64;
    let mut agreed = Tensor::from_slice(&v); // on the host (NCCL stages it through the GPU)
    for g in dims.iter().rev() {
        g.all_reduce(&mut agreed, ReduceOp::Sum)?; // a group of one sends nothing
    }
    let v = Vec::<f64>::try_from(&agreed).expect("f64 vector");
    let ranks = |from: usize| -> Vec<usize> { (0..world).filter(|r| v[from + r] != 0.0).collect() };
    let (refusing, non_finite_on) = (ranks(1), ranks(1 + world));
    let norm = v[0].sqrt();

    // 3. Stop on every rank together.
    if !refusing.is_empty() {
        held.clear_grads();
        let why = refusal.map_or_else(String::new, |r| format!(": {r}"));
        return Err(CommError::Step(format!(
            "rank {me}: the step was refused by rank(s) {refusing:?}{why}; no weight changed and the gradients \
             were cleared"
        )));
    }
    if !non_finite_on.is_empty() || !norm.is_finite() {
        held.clear_grads();
        if non_finite == NonFinite::Skip {
            return Ok(Stepped { norm: f64::INFINITY, skipped: true });
        }
        return Err(CommError::Step(format!(
            "rank {me}: gradients not finite on rank(s) {non_finite_on:?} (the global gradient norm is {norm}): a NaN \
             or an overflow in forward or backward; the update was not applied and the gradients were cleared"
        )));
    }
    // 4. Clip, update, clear.
    if let Some(max) = grad_clip {
        let c = clip_coef(norm, max);
        if c < 1.0 {
            tch::no_grad(|| {
                held.grads.iter().filter(|g| g.defined()).for_each(|g| _ = g.shallow_clone().g_mul_scalar_(c))
            });
        }
    }
    if let Err(e) = opt.step(lr, &held.params, &held.grads, &held.decay) {
        // Its check passed on every rank, so this is not expected; the others may have stepped.
        let m = format!("rank {me}: the optimizer failed after every rank agreed to step: {e}");
        dims.iter().for_each(|g| g.abort(&m));
        return Err(CommError::Step(m));
    }
    held.clear_grads();
    Ok(Stepped { norm, skipped: false })
}
