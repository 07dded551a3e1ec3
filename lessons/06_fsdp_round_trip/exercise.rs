//! Lesson 06 — the FSDP round trip: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 06`. Hints: `cargo grade 06 --hint K`.
#![allow(unused_variables, unused_imports)]

use shardlab::prelude::*;
use shardlab::zero::round_trip::{Gathered, UnitStack};
use std::ops::Range;

/// Exercise 1 — pad and shard. A unit of `numel` elements is padded to the next multiple of
/// `world_size` and cut into equal shards. Returns `(padded, rank's range of flat elements)`.
pub fn pad_and_shard(numel: i64, world_size: usize, rank: usize) -> (i64, Range<i64>) {
    // TODO: find how many elements each of the world_size equal shards needs so that together they
    // cover all numel elements, the padded size that makes, and which contiguous slice of it
    // belongs to this rank (README, "Flatten, pad, shard").
    todo!()
}

/// Exercise 2 — materialise a unit: all-gather every rank's `shard` (1-D, equal sizes) into a
/// new flat buffer of `shard.numel() × world_size` elements, rank 0's shard first.
pub fn gather_unit(pg: &ProcessGroup, shard: &Tensor) -> CommResult<Tensor> {
    // TODO: allocate the output buffer yourself, then fill it with the one collective of lesson 03
    // that gives every rank every rank's input, in rank order.
    todo!()
}

/// Exercise 3 — after a unit's backward: from this rank's full flat gradient (padded, every rank
/// the same length), return this rank's shard of the gradient *averaged over all ranks*.
pub fn reduce_scatter_grads(pg: &ProcessGroup, full_grad: &Tensor) -> CommResult<Tensor> {
    // TODO: allocate an output the size of one shard, then fill it with the one collective that
    // combines every rank's gradient and leaves each rank only its own block. Average, not sum.
    todo!()
}

/// Exercise 4 — the FSDP round trip of one training step over a stack of units. `shards[i]` is
/// this rank's shard of unit i's flat parameters; `stack` computes a unit's forward and backward
/// on its full flat parameters and hands out the buffers to gather them into. Gather each unit
/// before its forward and again before its backward (units in reverse), always prefetching the
/// next unit's gather; drop each gathered unit right after its compute; return this rank's shard
/// of every unit's gradient, averaged over ranks.
pub fn fsdp_round_trip(pg: &ProcessGroup, shards: &[Tensor], stack: &dyn UnitStack) -> CommResult<Vec<Tensor>> {
    // TODO: forward over the units in order, then backward in reverse. Before computing a unit,
    // have its parameters gathered into a buffer from `stack.buffer` and the *next* unit's gather
    // already started (asynchronously); release each unit as soon as its compute is done. After
    // each unit's backward, turn its gradient into this rank's averaged shard (exercise 3 helps).
    // The README's exercise 4 says what is graded.
    todo!()
}
