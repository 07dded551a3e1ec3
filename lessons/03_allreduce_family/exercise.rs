//! Lesson 03 — the all-reduce family: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 03`. Hints: `cargo grade 03 --hint K`.
#![allow(unused_variables, unused_imports)]

use shardlab::prelude::*;
use std::ops::Range;

/// Exercise 1 — split `numel` elements into `n` contiguous segments, as evenly as possible
/// (sizes differ by at most one), in order, covering everything.
pub fn ring_segments(numel: usize, n: usize) -> Vec<Range<usize>> {
    // TODO: return n contiguous ranges that cover 0..numel in order, sizes differing by at most one
    // (hints: `cargo grade 03 --hint 1`).
    todo!()
}

/// Exercise 2 — the ring schedule. At `step` (0..n−1) of the reduce-scatter phase
/// (`gather == false`) or the all-gather phase (`gather == true`), which segment does `rank`
/// send to rank+1 and which does it receive from rank−1? Returns `(send, recv)`.
///
/// After the reduce-scatter phase rank r must hold the complete sum of segment (r+1) mod n, and
/// after the all-gather phase every rank holds every complete segment.
pub fn ring_schedule(rank: usize, n: usize, step: usize, gather: bool) -> (usize, usize) {
    // TODO: return (segment sent to rank+1, segment received from rank−1) at this step of this
    // phase; what you receive is what your left neighbour sends (hints: `cargo grade 03 --hint 2`).
    todo!()
}

/// Exercise 3 — ring all-reduce (sum) of the 1-D tensor `t` with nothing but `pg.send` and
/// `pg.recv`: a reduce-scatter phase (add what you receive into your segment) then an all-gather
/// phase (copy it). A send returns once its bytes fit in the kernel's socket buffers, so a large
/// send waits for its receiver: order them so that a ring of sends cannot deadlock.
pub fn ring_all_reduce(pg: &ProcessGroup, t: &mut Tensor) -> CommResult<()> {
    // TODO: leave in `t` on every rank the sum of every rank's `t`, with only `pg.send` and
    // `pg.recv` along the schedule of exercises 1 and 2, and no deadlock when large sends block
    // (README, "Deadlock"; hints: `cargo grade 03 --hint 3`).
    todo!()
}

/// Exercise 4 — the α-β cost model of all-reduce on `n` ranks for `bytes` bytes, α seconds per
/// message, β seconds per byte: naive (everything to rank 0 and back) and ring. Returns
/// `(naive_seconds, ring_seconds)`.
pub fn all_reduce_cost(n: usize, bytes: f64, alpha: f64, beta: f64) -> (f64, f64) {
    // TODO: return (naive seconds, ring seconds) from the cost-model table in the README (hints:
    // `cargo grade 03 --hint 4`).
    todo!()
}
