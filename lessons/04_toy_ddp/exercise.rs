//! Lesson 04 — toy DDP: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 04`. Hints: `cargo grade 04 --hint K`.
#![allow(unused_variables, unused_imports)]

use shardlab::model::{Batch, Model};
use shardlab::prelude::*;
use std::ops::Range;

/// Exercise 1 — the rows of a global batch of `global_batch` rows that `rank` of `world_size`
/// trains on: equal, disjoint, contiguous shares in rank order (rank 0 first). The global batch
/// is a multiple of the world size.
pub fn shard_rows(global_batch: usize, rank: usize, world_size: usize) -> Range<usize> {
    // TODO: return this rank's rows: equal, contiguous shares in rank order that together cover
    // 0..global_batch (hints: `cargo grade 04 --hint 1`).
    todo!()
}

/// Exercise 2 — make every rank start from rank 0's weights: overwrite each parameter, in place,
/// with rank 0's values, in as few broadcasts as buckets of at most `bucket_bytes` allow (packing
/// consecutive parameters; a larger one alone).
pub fn sync_initial_weights(pg: &ProcessGroup, params: &mut [Tensor], bucket_bytes: usize) -> CommResult<()> {
    // TODO: overwrite every parameter in place with rank 0's values, one broadcast per bucket of
    // consecutive parameters of at most `bucket_bytes` (hints: `cargo grade 04 --hint 2`).
    todo!()
}

/// Exercise 3 — after backward, replace every parameter's gradient with the average of that
/// gradient over all ranks (in place, so the optimizer sees it).
pub fn average_gradients(pg: &ProcessGroup, params: &[Tensor]) -> CommResult<()> {
    // TODO: leave every parameter's gradient holding its average over all ranks, in place
    // (hints: `cargo grade 04 --hint 3`).
    todo!()
}

/// Exercise 4 — one step of data-parallel training: forward and backward on this rank's rows of
/// the `global` batch, average the gradients, `opt.step()`, `opt.zero_grad()`. Returns this
/// rank's loss.
pub fn ddp_step(pg: &ProcessGroup, model: &dyn Model, opt: &mut tch::nn::Optimizer, global: &Batch) -> CommResult<f64> {
    // TODO: train on this rank's rows of `global` only; the optimizer must see gradients averaged
    // over all ranks and take exactly one step, leaving no gradient behind for the next call;
    // return this rank's loss on its rows (hints: `cargo grade 04 --hint 4`).
    todo!()
}
