//! Ring algorithms: every rank sends to the next one while receiving from the previous one
//! (both directions at once: [`Transport::exchange`](crate::comm::transport::Transport)), so
//! every link carries the same share and none is the bottleneck — bandwidth-optimal for large
//! messages, n−1 (all_reduce: 2(n−1)) steps of latency.

use super::{segment, Ctx};
use crate::comm::dtype::{self, ReduceOp};
use crate::comm::error::CommResult;
use crate::comm::transport::Recv;
use std::ops::Range;
use std::sync::atomic::Ordering;

/// What to do with data arriving in a ring step.
#[derive(Clone, Copy)]
enum Apply<'b> {
    /// Land it in place (all-gather phases).
    Copy,
    /// `dst ⊕= data` (reduce-scatter phase of all_reduce).
    Reduce(ReduceOp),
    /// `dst = base ⊕ data` (reduce_scatter, which must not touch its input).
    ReduceFrom(ReduceOp, &'b [u8]),
}

impl Ctx<'_> {
    /// One ring step inside one buffer: send `buf[send]` to the next rank while receiving
    /// `recv.len()` bytes from the previous one into `buf[recv]` (the ranges are disjoint).
    fn ring_step(&self, buf: &mut [u8], send: Range<usize>, recv: Range<usize>, apply: Apply) -> CommResult<()> {
        if send.end <= recv.start {
            let (lo, hi) = buf.split_at_mut(recv.start);
            self.ring_exchange(&lo[send], &mut hi[..recv.len()], apply)
        } else {
            let (lo, hi) = buf.split_at_mut(send.start);
            self.ring_exchange(&hi[..send.len()], &mut lo[recv], apply)
        }
    }

    /// Send `send` to the next rank while filling `dst` from the previous one; both directions
    /// move at once, chunk by chunk.
    fn ring_exchange(&self, send: &[u8], dst: &mut [u8], apply: Apply) -> CommResult<()> {
        let (next, prev) = ((self.rank + 1) % self.n, (self.rank + self.n - 1) % self.n);
        let (dt, total) = (self.desc.dtype, dst.len());
        self.counters.sent.fetch_add(send.len() as u64, Ordering::Relaxed);
        let res = match apply {
            Apply::Copy => {
                let r = Recv { peer: prev, total, dst: Some(dst), on_data: &mut |_, _| Ok(()) };
                self.t.exchange(&self.desc, next, send, self.chunk, r, self.timeout)
            }
            Apply::Reduce(op) | Apply::ReduceFrom(op, _) => {
                let base = match apply {
                    Apply::ReduceFrom(_, base) => Some(base),
                    _ => None,
                };
                let mut on = |off: usize, b: &[u8]| {
                    let d = &mut dst[off..off + b.len()];
                    if let Some(base) = base {
                        d.copy_from_slice(&base[off..off + b.len()]);
                    }
                    dtype::reduce_into(dt, op, d, b);
                    Ok(())
                };
                let r = Recv { peer: prev, total, dst: None, on_data: &mut on };
                self.t.exchange(&self.desc, next, send, self.chunk, r, self.timeout)
            }
        };
        res?;
        self.received(total);
        Ok(())
    }
}

/// Pipelined chain: root → root+1 → … → root−1; each rank forwards every chunk as it lands.
/// Every rank sends (at most) B once, so no link or CPU carries more than B — best for large
/// messages when links or cores are the limit; n−1 hops of latency for small ones.
pub(crate) fn broadcast(c: &Ctx, buf: &mut [u8], root: usize) -> CommResult<()> {
    let v = (c.rank + c.n - root) % c.n;
    let next = (v + 1 < c.n).then_some((c.rank + 1) % c.n);
    if v == 0 {
        return match next {
            Some(k) => c.send(k, buf),
            None => Ok(()),
        };
    }
    c.recv_forward((c.rank + c.n - 1) % c.n, buf, &mut |_, b| next.map_or(Ok(()), |k| c.send(k, b)))
}

pub(crate) fn all_reduce(c: &Ctx, buf: &mut [u8], op: ReduceOp) -> CommResult<()> {
    let (n, r, es, dt) = (c.n, c.rank, c.desc.dtype.size(), c.desc.dtype);
    let numel = buf.len() / es;
    let seg = |i: usize| segment(numel, n, i % n, es);
    if c.premultiplied(op) {
        dtype::premultiply(dt, buf, None, n);
    }
    // Reduce-scatter: after n−1 steps rank r holds the full reduction of segment r+1.
    for s in 0..n - 1 {
        c.ring_step(buf, seg(r + n - s), seg(r + 2 * n - s - 1), Apply::Reduce(op))?;
    }
    if c.post_divides(op) {
        dtype::divide(dt, &mut buf[seg(r + 1)], n);
    }
    // All-gather: pass the finished segments around the ring.
    for s in 0..n - 1 {
        c.ring_step(buf, seg(r + 1 + n - s), seg(r + n - s), Apply::Copy)?;
    }
    Ok(())
}

pub(crate) fn all_gather(c: &Ctx, out: &mut [u8], input: &[u8]) -> CommResult<()> {
    let (n, r, m) = (c.n, c.rank, input.len());
    if out[r * m..].as_ptr() != input.as_ptr() {
        out[r * m..(r + 1) * m].copy_from_slice(input);
    }
    let blk = |i: usize| (i % n) * m..(i % n + 1) * m;
    for s in 0..n - 1 {
        c.ring_step(out, blk(r + n - s), blk(r + 2 * n - s - 1), Apply::Copy)?;
    }
    Ok(())
}

pub(crate) fn reduce_scatter(c: &Ctx, out: &mut [u8], input: &[u8], op: ReduceOp) -> CommResult<()> {
    let (n, r, m, dt) = (c.n, c.rank, out.len(), c.desc.dtype);
    let blk = |i: usize| (i % n) * m..(i % n + 1) * m;
    let scaled = c.premultiplied_copy(input, op);
    let input: &[u8] = scaled.as_ref().map_or(input, |b| b.bytes());
    // Step s sends the partial sum of block r−s−1 and receives block r−s−2; partial sums live in
    // two scratch buffers (never in `input`, which the caller keeps), the last step lands in `out`.
    let mut cur = c.pool.get(m);
    let mut next = c.pool.get(m);
    cur.bytes_mut().copy_from_slice(&input[blk(r + n - 1)]);
    for s in 0..n - 1 {
        let rb = blk(r + 2 * n - s - 2);
        let last = s == n - 2;
        let dst: &mut [u8] = if last { &mut *out } else { next.bytes_mut() };
        c.ring_exchange(cur.bytes(), dst, Apply::ReduceFrom(op, &input[rb]))?;
        if !last {
            std::mem::swap(&mut cur, &mut next);
        }
    }
    if n == 1 {
        out.copy_from_slice(input);
    }
    if c.post_divides(op) {
        dtype::divide(dt, out, n);
    }
    Ok(())
}
