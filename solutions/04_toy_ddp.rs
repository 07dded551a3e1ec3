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
/// with rank 0's values, in as few broadcasts as buckets of at most `bucket_bytes` allow (packing
/// consecutive parameters; a larger one alone).
pub fn sync_initial_weights(pg: &ProcessGroup, params: &mut [Tensor], bucket_bytes: usize) -> CommResult<()> {
    let bytes = |p: &Tensor| p.numel() * p.kind().elt_size_in_bytes();
    let mut start = 0;
    while start < params.len() {
        // Greedy: extend the bucket while the next parameter still fits.
        let (mut end, mut size) = (start + 1, bytes(&params[start]));
        while end < params.len() && size + bytes(&params[end]) <= bucket_bytes {
            size += bytes(&params[end]);
            end += 1;
        }
        // (Σ numel,) of the bucket's parameters, one message from rank 0.
        let mut flat = Tensor::cat(&params[start..end].iter().map(|p| p.detach().reshape([-1])).collect::<Vec<_>>(), 0);
        pg.broadcast(&mut flat, 0)?;
        tch::no_grad(|| {
            let mut offset = 0;
            for p in &mut params[start..end] {
                let n = p.numel() as i64;
                p.copy_(&flat.narrow(0, offset, n).view_as(p));
                offset += n;
            }
        });
        start = end;
    }
    Ok(())
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
