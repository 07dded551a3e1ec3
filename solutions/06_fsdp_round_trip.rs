//! Lesson 06 — the FSDP round trip: reference answers.
//! Same signatures as `lessons/06_fsdp_round_trip/exercise.rs`; graded by `tests/lesson06.rs`.

use shardlab::prelude::*;
use std::ops::Range;

/// Exercise 1 — pad and shard. A unit of `numel` elements is padded to the next multiple of
/// `world_size` and cut into equal shards. Returns `(padded, rank's range of flat elements)`.
pub fn pad_and_shard(numel: i64, world_size: usize, rank: usize) -> (i64, Range<i64>) {
    let n = world_size as i64;
    let shard = (numel + n - 1) / n;
    (shard * n, rank as i64 * shard..(rank as i64 + 1) * shard)
}

/// Exercise 2 — materialise a unit: all-gather every rank's `shard` (1-D, equal sizes) into a
/// new flat buffer of `shard.numel() × world_size` elements, rank 0's shard first.
pub fn gather_unit(pg: &ProcessGroup, shard: &Tensor) -> CommResult<Tensor> {
    let mut full = Tensor::zeros([shard.numel() as i64 * pg.world_size() as i64], (shard.kind(), Device::Cpu));
    pg.all_gather(&mut full, shard)?;
    Ok(full)
}

/// Exercise 3 — after a unit's backward: from this rank's full flat gradient (padded, every rank
/// the same length), return this rank's shard of the gradient *averaged over all ranks*.
pub fn reduce_scatter_grads(pg: &ProcessGroup, full_grad: &Tensor) -> CommResult<Tensor> {
    let shard = full_grad.numel() as i64 / pg.world_size() as i64;
    let mut out = Tensor::zeros([shard], (full_grad.kind(), Device::Cpu));
    pg.reduce_scatter(&mut out, full_grad, ReduceOp::Avg)?;
    Ok(out)
}
