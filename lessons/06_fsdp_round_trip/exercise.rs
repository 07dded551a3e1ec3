//! Lesson 06 — the FSDP round trip: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 06`. Hints are in this lesson's README.
#![allow(unused_variables, unused_imports)]

use shardlab::prelude::*;
use std::ops::Range;

/// Exercise 1 — pad and shard. A unit of `numel` elements is padded to the next multiple of
/// `world_size` and cut into equal shards. Returns `(padded, rank's range of flat elements)`.
pub fn pad_and_shard(numel: i64, world_size: usize, rank: usize) -> (i64, Range<i64>) {
    // TODO: shard = ceil(numel / world_size); padded = shard × world_size; rank r owns
    // r·shard .. (r+1)·shard.
    todo!()
}

/// Exercise 2 — materialise a unit: all-gather every rank's `shard` (1-D, equal sizes) into a
/// new flat buffer of `shard.numel() × world_size` elements, rank 0's shard first.
pub fn gather_unit(pg: &ProcessGroup, shard: &Tensor) -> CommResult<Tensor> {
    // TODO: allocate the full buffer (shard.numel() × world_size elements, same kind) and fill it
    // with pg.all_gather(&mut full, shard).
    todo!()
}

/// Exercise 3 — after a unit's backward: from this rank's full flat gradient (padded, every rank
/// the same length), return this rank's shard of the gradient *averaged over all ranks*.
pub fn reduce_scatter_grads(pg: &ProcessGroup, full_grad: &Tensor) -> CommResult<Tensor> {
    // TODO: allocate a shard-sized output and pg.reduce_scatter(&mut out, full_grad, ReduceOp::Avg).
    todo!()
}
