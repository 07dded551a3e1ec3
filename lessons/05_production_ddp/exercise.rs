//! Lesson 05 — production DDP: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 05`. Hints: `cargo grade 05 --hint K`.
#![allow(unused_variables, unused_imports)]

use shardlab::ddp::DataParallel;
use shardlab::model::Batch;
use shardlab::prelude::*;

/// Exercise 1 — bucket assignment. Parameters have `sizes[i]` gradient bytes, in registration
/// order. Walk them from the *last* to the first and pack them greedily into buckets of at most
/// `cap` bytes: start a new bucket when the next parameter would overflow the current one. A
/// parameter larger than `cap` gets a bucket of its own. Each bucket lists parameter indices in
/// the order visited.
pub fn assign_buckets(sizes: &[usize], cap: usize) -> Vec<Vec<usize>> {
    // TODO: return the buckets of parameter indices, last parameter first, each at most `cap`
    // bytes unless it holds one larger parameter alone (README; hints: `cargo grade 05 --hint 1`).
    todo!()
}

/// Exercise 2 — when is a bucket ready? Backward runs the stages from last to first, and a
/// parameter's gradient is final once the backward of `param_stages[i]` (the first stage that
/// uses it) has run. Return the stage after whose backward every gradient in `bucket` is final.
pub fn bucket_ready_stage(bucket: &[usize], param_stages: &[usize]) -> usize {
    // TODO: return the stage after whose backward every gradient in `bucket` is final (hints:
    // `cargo grade 05 --hint 2`).
    todo!()
}

/// Exercise 3 — gradient accumulation. Cut this rank's `batch` into `accum` micro-batches
/// (`shardlab::ddp::micro_batches`), run `dp.backward` on each with the loss scaled by the
/// micro-batch's share of the rows, synchronising gradients only on the last one (the others
/// inside `no_sync`); then `opt.step()` and `opt.zero_grad()`. Returns the batch's mean loss.
pub fn accumulate_step(
    dp: &mut dyn DataParallel,
    opt: &mut tch::nn::Optimizer,
    batch: &Batch,
    accum: i64,
) -> CommResult<f64> {
    // TODO: one optimizer step on this batch's gradient, built from `accum` micro-batches and
    // synced across ranks once; return the batch's mean loss (hints: `cargo grade 05 --hint 3`).
    todo!()
}
