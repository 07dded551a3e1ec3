//! Lesson 06 — the FSDP round trip: reference answers.
//! Same signatures as `lessons/06_fsdp_round_trip/exercise.rs`; graded by `tests/lesson06.rs`.

use shardlab::prelude::*;
use shardlab::zero::round_trip::{Gathered, UnitStack};
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

/// Exercise 4 — the FSDP round trip of one training step over a stack of units. `shards[i]` is
/// this rank's shard of unit i's flat parameters; `stack` computes a unit's forward and backward
/// on its full flat parameters and hands out the buffers to gather them into. Gather each unit
/// before its forward and again before its backward (units in reverse), always prefetching the
/// next unit's gather; drop each gathered unit right after its compute; return this rank's shard
/// of every unit's gradient, averaged over ranks.
pub fn fsdp_round_trip(pg: &ProcessGroup, shards: &[Tensor], stack: &dyn UnitStack) -> CommResult<Vec<Tensor>> {
    let units = stack.num_units();
    // Start unit u's all-gather into a fresh buffer; the buffer counts as gathered from now on.
    let start = |u: usize| -> CommResult<(Gathered, Work<Tensor>)> {
        let buf = stack.buffer(u);
        let work = pg.all_gather_async(buf.out(), shards[u].shallow_clone())?;
        Ok((buf, work))
    };
    // Forward: units 0, 1, …, each gathered while the one before computes.
    let mut next = if units > 0 { Some(start(0)?) } else { None };
    for u in 0..units {
        let (buf, work) = next.take().expect("started one unit ahead");
        drop(work.wait()?); // the buffer is filled; the returned handle is the same memory
        if u + 1 < units {
            next = Some(start(u + 1)?); // prefetch
        }
        stack.forward(u, &buf);
        drop(buf); // release: between its forward and its backward the rank holds only the shard
    }
    // Backward: units in reverse, re-gathered, again one ahead; each gradient reduce-scattered.
    let mut grads: Vec<Tensor> = Vec::with_capacity(units);
    let mut next = if units > 0 { Some(start(units - 1)?) } else { None };
    for u in (0..units).rev() {
        let (buf, work) = next.take().expect("started one unit ahead");
        drop(work.wait()?);
        if u > 0 {
            next = Some(start(u - 1)?); // prefetch
        }
        let full_grad = stack.backward(u, &buf);
        drop(buf);
        grads.push(reduce_scatter_grads(pg, &full_grad)?);
    }
    grads.reverse();
    Ok(grads)
}
