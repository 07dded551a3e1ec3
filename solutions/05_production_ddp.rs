//! Lesson 05 — production DDP: reference answers.
//! Same signatures as `lessons/05_production_ddp/exercise.rs`; graded by `tests/lesson05.rs`.

use shardlab::ddp::DataParallel;
use shardlab::model::Batch;
use shardlab::prelude::*;

/// Exercise 1 — bucket assignment. Parameters have `sizes[i]` gradient bytes, in registration
/// order. Walk them from the *last* to the first and pack them greedily into buckets of at most
/// `cap` bytes: start a new bucket when the next parameter would overflow the current one. A
/// parameter larger than `cap` gets a bucket of its own. Each bucket lists parameter indices in
/// the order visited.
pub fn assign_buckets(sizes: &[usize], cap: usize) -> Vec<Vec<usize>> {
    let mut buckets = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut bytes = 0;
    for i in (0..sizes.len()).rev() {
        if !current.is_empty() && bytes + sizes[i] > cap {
            buckets.push(std::mem::take(&mut current));
            bytes = 0;
        }
        current.push(i);
        bytes += sizes[i];
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    buckets
}

/// Exercise 2 — when is a bucket ready? Backward runs the stages from last to first, and a
/// parameter's gradient is final once the backward of `param_stages[i]` (the first stage that
/// uses it) has run. Return the stage after whose backward every gradient in `bucket` is final.
pub fn bucket_ready_stage(bucket: &[usize], param_stages: &[usize]) -> usize {
    bucket.iter().map(|&i| param_stages[i]).min().expect("a bucket is never empty")
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
    let rows = batch.len();
    let parts = shardlab::ddp::micro_batches(rows, accum);
    let mut loss = 0.0;
    for (i, &(lo, hi)) in parts.iter().enumerate() {
        let share = (hi - lo) as f64 / rows as f64;
        let last = i + 1 == parts.len();
        dp.set_require_sync(last);
        let l = dp.backward(&batch.rows(lo, hi), share);
        dp.set_require_sync(true);
        loss += l? * share;
    }
    opt.step();
    opt.zero_grad();
    Ok(loss)
}
