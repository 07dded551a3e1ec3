//! Lesson 03 — the all-reduce family: reference answers.
//! Same signatures as `lessons/03_allreduce_family/exercise.rs`; graded by `tests/lesson03.rs`.

use shardlab::prelude::*;
use std::ops::Range;

/// Exercise 1 — split `numel` elements into `n` contiguous segments, as evenly as possible
/// (sizes differ by at most one), in order, covering everything.
pub fn ring_segments(numel: usize, n: usize) -> Vec<Range<usize>> {
    (0..n).map(|i| numel * i / n..numel * (i + 1) / n).collect()
}

/// Exercise 2 — the ring schedule. At `step` (0..n−1) of the reduce-scatter phase
/// (`gather == false`) or the all-gather phase (`gather == true`), which segment does `rank`
/// send to rank+1 and which does it receive from rank−1? Returns `(send, recv)`.
///
/// After the reduce-scatter phase rank r must hold the complete sum of segment (r+1) mod n, and
/// after the all-gather phase every rank holds every complete segment.
pub fn ring_schedule(rank: usize, n: usize, step: usize, gather: bool) -> (usize, usize) {
    if gather {
        ((rank + 1 + n - step) % n, (rank + n - step) % n)
    } else {
        ((rank + n - step) % n, (rank + 2 * n - step - 1) % n)
    }
}

/// Exercise 3 — ring all-reduce (sum) of the 1-D tensor `t` with nothing but `pg.send` and
/// `pg.recv`: a reduce-scatter phase (add what you receive into your segment) then an all-gather
/// phase (copy it). A send returns once its bytes fit in the kernel's socket buffers, so a large
/// send waits for its receiver: order them so that a ring of sends cannot deadlock.
pub fn ring_all_reduce(pg: &ProcessGroup, t: &mut Tensor) -> CommResult<()> {
    let (r, n) = (pg.rank(), pg.world_size());
    let segs = ring_segments(t.numel(), n);
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let view = |i: usize| t.narrow(0, segs[i].start as i64, segs[i].len() as i64);
    for gather in [false, true] {
        for step in 0..n.saturating_sub(1) {
            let (s, rv) = ring_schedule(r, n, step, gather);
            let mut incoming = Tensor::empty([segs[rv].len() as i64], (t.kind(), Device::Cpu));
            // Even ranks send first, odd ranks receive first: at least one rank of every ring is
            // receiving, so the chain of blocking sends always drains.
            if r % 2 == 0 {
                pg.send(&view(s), next)?;
                pg.recv(&mut incoming, prev)?;
            } else {
                pg.recv(&mut incoming, prev)?;
                pg.send(&view(s), next)?;
            }
            let mut dst = view(rv);
            if gather {
                dst.copy_(&incoming);
            } else {
                dst += &incoming;
            }
        }
    }
    Ok(())
}

/// Exercise 4 — the α-β cost model of all-reduce on `n` ranks for `bytes` bytes, α seconds per
/// message, β seconds per byte: naive (everything to rank 0 and back) and ring. Returns
/// `(naive_seconds, ring_seconds)`.
pub fn all_reduce_cost(n: usize, bytes: f64, alpha: f64, beta: f64) -> (f64, f64) {
    if n <= 1 {
        return (0.0, 0.0);
    }
    let nf = n as f64;
    (2.0 * (nf - 1.0) * (alpha + bytes * beta), 2.0 * (nf - 1.0) * alpha + 2.0 * (nf - 1.0) / nf * bytes * beta)
}
