//! Lesson 06 — the FSDP round trip: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 06`. Hints: `cargo grade 06 --hint K`.
#![allow(unused_variables, unused_imports)]

use shardlab::prelude::*;
use shardlab::zero::round_trip::{Gathered, UnitStack};
use std::ops::Range;

/// Exercise 1 — pad and shard. A unit of `numel` elements is padded to the next multiple of
/// `world_size` and cut into equal shards. Returns `(padded, rank's range of flat elements)`.
pub fn pad_and_shard(numel: i64, world_size: usize, rank: usize) -> (i64, Range<i64>) {
    // TODO: return (the smallest multiple of world_size that is at least numel, this rank's equal,
    // contiguous slice of it) (README, "Flatten, pad, shard"; hints: `cargo grade 06 --hint 1`).
    todo!()
}

/// Exercise 2 — materialise a unit: all-gather every rank's `shard` (1-D, equal sizes) into a
/// new flat buffer of `shard.numel() × world_size` elements, rank 0's shard first.
pub fn gather_unit(pg: &ProcessGroup, shard: &Tensor) -> CommResult<Tensor> {
    // TODO: return a new 1-D tensor of shard.numel() × world_size elements holding every rank's
    // shard in rank order, made by one collective (hints: `cargo grade 06 --hint 2`).
    todo!()
}

/// Exercise 3 — after a unit's backward: from this rank's full flat gradient (padded, every rank
/// the same length), return this rank's shard of the gradient *averaged over all ranks*.
pub fn reduce_scatter_grads(pg: &ProcessGroup, full_grad: &Tensor) -> CommResult<Tensor> {
    // TODO: return this rank's shard (full_grad.numel() / world_size elements) of the gradient
    // averaged over all ranks, made by one collective (hints: `cargo grade 06 --hint 3`).
    todo!()
}

/// Exercise 4 — the FSDP round trip of one training step over a stack of units. `shards[i]` is
/// this rank's shard of unit i's flat parameters; `stack` computes a unit's forward and backward
/// on its full flat parameters and hands out the buffers to gather them into. Gather each unit
/// before its forward and again before its backward (units in reverse), always prefetching the
/// next unit's gather; drop each gathered unit right after its compute; return this rank's shard
/// of every unit's gradient, averaged over ranks.
pub fn fsdp_round_trip(pg: &ProcessGroup, shards: &[Tensor], stack: &dyn UnitStack) -> CommResult<Vec<Tensor>> {
    // TODO: one step's forward and backward on gathered units, each unit's next one already
    // gathering as it computes, at most two held at once; return this rank's averaged gradient
    // shard of every unit, in unit order (README, exercise 4; hints: `cargo grade 06 --hint 4`).
    todo!()
}
