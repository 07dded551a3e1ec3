//! Lesson 04 — toy DDP: reference answers.
//! Same signatures as `lessons/04_toy_ddp/exercise.rs`; graded by `tests/lesson04.rs`.

use shardlab::model::{Batch, Model};
use shardlab::prelude::*;
use std::ops::Range;

/// Exercise 1 — the rows of a global batch of `global_batch` rows that `rank` of `world_size`
/// trains on: equal, disjoint, contiguous shares in rank order (rank 0 first). The global batch
/// is a multiple of the world size.
pub fn shard_rows(global_batch: usize, rank: usize, world_size: usize) -> Range<usize> {
    let b = global_batch / world_size;
    rank * b..(rank + 1) * b
}

/// Exercise 2 — make every rank start from rank 0's weights: overwrite each parameter, in place,
/// with rank 0's values.
pub fn sync_initial_weights(pg: &ProcessGroup, params: &mut [Tensor]) -> CommResult<()> {
    tch::no_grad(|| params.iter_mut().try_for_each(|p| pg.broadcast(p, 0)))
}

/// Exercise 3 — after backward, replace every parameter's gradient with the average of that
/// gradient over all ranks (in place, so the optimizer sees it).
pub fn average_gradients(pg: &ProcessGroup, params: &[Tensor]) -> CommResult<()> {
    let n = pg.world_size() as f64;
    for p in params {
        let mut g = p.grad(); // same shape as p, f32
        pg.all_reduce(&mut g, ReduceOp::Sum)?;
        let _ = g.divide_scalar_(n);
    }
    Ok(())
}

/// Exercise 4 — one step of data-parallel training: forward and backward on this rank's rows of
/// the `global` batch, average the gradients, `opt.step()`, `opt.zero_grad()`. Returns this
/// rank's loss.
pub fn ddp_step(pg: &ProcessGroup, model: &dyn Model, opt: &mut tch::nn::Optimizer, global: &Batch) -> CommResult<f64> {
    let rows = shard_rows(global.len() as usize, pg.rank(), pg.world_size());
    let local = global.rows(rows.start as i64, rows.end as i64);
    let loss = model.loss(&local);
    loss.backward();
    average_gradients(pg, &model.parameters())?;
    opt.step();
    opt.zero_grad();
    Ok(loss.double_value(&[]))
}
