//! Lesson 07 — ZeRO stages 1/2/3: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 07`. Hints: `cargo grade 07 --hint K`.
#![allow(unused_variables, unused_imports)]

use shardlab::prelude::*;

/// Exercise 1 — the ZeRO paper's per-device model-state bytes for `params` parameters on `dp`
/// devices, 16-bit weights and gradients (2 bytes each) and `k` bytes of optimizer state per
/// parameter. `stage` 0 is plain data parallelism, 1–3 the ZeRO stages.
pub fn zero_bytes_per_device(params: f64, dp: f64, k: f64, stage: u8) -> f64 {
    // TODO: return the model-state bytes one device holds at this stage (README, "Where the bytes
    // go"; hints: `cargo grade 07 --hint 1`).
    todo!()
}

/// Exercise 2 — one AdamW step (step number `t`, counting from 1) on a shard: parameters `p`,
/// gradient `g`, moments `m` and `v`, all 1-D and updated in place; `wd` is the weight decay of
/// every element (0 where not decayed). Same arithmetic as `torch.optim.AdamW`.
#[allow(clippy::too_many_arguments)]
pub fn adamw_shard_step(
    p: &mut Tensor,
    g: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    wd: &Tensor,
    t: i32,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
) {
    // TODO: one AdamW step on p, m and v in place, exactly libtorch's (decoupled weight decay,
    // bias correction): README, "Why AdamW on a shard is libtorch's AdamW" (hints:
    // `cargo grade 07 --hint 2`).
    todo!()
}

/// Exercise 3 — the end of a ZeRO-1/2 step: every rank has updated its own shard (`shard`, its
/// slice of the padded flat parameters); put everyone's updated shards into `flat` (the full
/// flat parameters, same on every rank afterwards).
pub fn all_gather_params(pg: &ProcessGroup, flat: &mut Tensor, shard: &Tensor) -> CommResult<()> {
    // TODO: leave every rank's updated shard, in rank order, in `flat` on every rank, with one
    // collective; `shard` is a view into `flat` (hints: `cargo grade 07 --hint 3`).
    todo!()
}

/// Exercise 4 — a whole ZeRO-1 optimizer step on one flat parameter vector (padded to a multiple
/// of the world size). `grad` is this rank's full flat gradient from its own backward; `flat` the
/// full flat parameters, the same on every rank; `m`, `v` this rank's AdamW moments and `wd` the
/// weight decay of each element of its shard; `t` the step number, from 1. Afterwards every rank's
/// `flat` holds the parameters after one AdamW step on the gradient averaged over ranks.
#[allow(clippy::too_many_arguments)]
pub fn zero1_step(
    pg: &ProcessGroup,
    flat: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    wd: &Tensor,
    t: i32,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
) -> CommResult<()> {
    // TODO: leave in every rank's `flat` the parameters after one AdamW step on the gradient
    // averaged over ranks, each rank stepping only its own shard, with one reduce_scatter and one
    // all_gather (README; hints: `cargo grade 07 --hint 4`).
    todo!()
}
