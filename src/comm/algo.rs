//! The collective algorithms, written once over [`Transport`] and used by every backend.
//!
//! Cost model for a message of B bytes on n ranks (α = per-message latency, β = seconds per byte):
//!   naive all_reduce (reduce to rank 0, then send back)  2(n−1)·(α + B·β) at the root
//!   ring all_reduce (reduce-scatter + all-gather)         2(n−1)·α + 2·(n−1)/n·B·β per rank
//!   binomial-tree broadcast                                ⌈log2 n⌉·(α + B·β), pipelined in chunks
//! Large messages travel as frames of at most `chunk` bytes, so the next hop can start on chunk
//! k while chunk k+1 is still on the wire (pipelining).
//!
//! Reductions combine with `dtype::reduce_into` (integer sums wrap; Max/Min propagate NaN).
//! `ReduceOp::Avg` is a sum plus a division by n, placed per dtype (see
//! `dtype::avg_premultiplies`): bf16/f16 scale every rank's contribution by 1/n before anything
//! is sent — on every rank, the naive algorithms' non-roots included — and f32/f64 divide the
//! finished sum once.

use super::dtype::{self, ReduceOp};
use super::error::{CommError, CommResult};
use super::frame::{BufPool, OpDesc};
use super::transport::{Exchange, Recv, Transport};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Bytes this rank put on and took off the wire, and operations it completed.
#[derive(Default, Debug)]
pub(crate) struct Counters {
    pub sent: AtomicU64,
    pub received: AtomicU64,
    pub collectives: AtomicU64,
    pub p2p: AtomicU64,
}

/// Everything an algorithm needs for one operation.
pub(crate) struct Ctx<'a> {
    pub t: &'a dyn Transport,
    pub rank: usize,
    pub n: usize,
    pub desc: OpDesc,
    pub timeout: Duration,
    /// Frame payload size in bytes (a multiple of the element size).
    pub chunk: usize,
    pub counters: &'a Counters,
    pub pool: &'a Arc<BufPool>,
}

/// What to do with data arriving in a ring step.
#[derive(Clone, Copy)]
pub(crate) enum Apply<'b> {
    /// Land it in place (all-gather phases).
    Copy,
    /// `dst ⊕= data` (reduce-scatter phase of all_reduce).
    Reduce(ReduceOp),
    /// `dst = base ⊕ data` (reduce_scatter, which must not touch its input).
    ReduceFrom(ReduceOp, &'b [u8]),
}

impl Ctx<'_> {
    /// Send `bytes` to `peer` as frames of at most `chunk` bytes (one empty frame if empty).
    pub fn send(&self, peer: usize, bytes: &[u8]) -> CommResult<()> {
        self.counters.sent.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.t.send(peer, &self.desc, bytes, self.chunk, self.timeout)
    }
    fn received(&self, n: usize) {
        self.counters.received.fetch_add(n as u64, Ordering::Relaxed);
    }
    /// Receive exactly `dst.len()` bytes from `peer` into `dst`.
    pub fn recv_into(&self, peer: usize, dst: &mut [u8]) -> CommResult<()> {
        let total = dst.len();
        self.t.recv(&self.desc, Recv { peer, total, dst: Some(dst), on_data: &mut |_, _| Ok(()) }, self.timeout)?;
        self.received(total);
        Ok(())
    }
    /// Receive `dst.len()` bytes from `peer`, combining them into `dst` with `op`.
    pub fn recv_reduce(&self, peer: usize, dst: &mut [u8], op: ReduceOp) -> CommResult<()> {
        let (dt, total) = (self.desc.dtype, dst.len());
        let mut on = |off: usize, b: &[u8]| {
            dtype::reduce_into(dt, op, &mut dst[off..off + b.len()], b);
            Ok(())
        };
        self.t.recv(&self.desc, Recv { peer, total, dst: None, on_data: &mut on }, self.timeout)?;
        self.received(total);
        Ok(())
    }

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

/// Byte range of segment `i` when `numel` elements are split over `n` ranks as evenly as possible.
pub fn segment(numel: usize, n: usize, i: usize, esize: usize) -> Range<usize> {
    let (a, b) = (numel * i / n, numel * (i + 1) / n);
    a * esize..b * esize
}

/// Parent and children of relative rank `v` (= (rank − root) mod n) in a binomial broadcast tree.
/// Children are listed biggest subtree first.
pub fn binomial_tree(v: usize, n: usize) -> (Option<usize>, Vec<usize>) {
    let (parent, mask) =
        if v == 0 { (None, n.next_power_of_two()) } else { (Some(v - (v & v.wrapping_neg())), v & v.wrapping_neg()) };
    let mut children = Vec::new();
    let mut m = mask >> 1;
    while m > 0 {
        if v + m < n {
            children.push(v + m);
        }
        m >>= 1;
    }
    (parent, children)
}

// ---------------------------------------------------------------- barrier, p2p

pub(crate) fn barrier(c: &Ctx) -> CommResult<()> {
    if c.rank == 0 {
        (1..c.n).try_for_each(|p| c.recv_into(p, &mut []))?;
        (1..c.n).try_for_each(|p| c.send(p, &[]))
    } else {
        c.send(0, &[])?;
        c.recv_into(0, &mut [])
    }
}

// ---------------------------------------------------------------- broadcast

pub(crate) fn broadcast_naive(c: &Ctx, buf: &mut [u8], root: usize) -> CommResult<()> {
    if c.rank == root {
        (0..c.n).filter(|p| *p != root).try_for_each(|p| c.send(p, buf))
    } else {
        c.recv_into(root, buf)
    }
}

pub(crate) fn broadcast_tree(c: &Ctx, buf: &mut [u8], root: usize) -> CommResult<()> {
    let v = (c.rank + c.n - root) % c.n;
    let (parent, children) = binomial_tree(v, c.n);
    let children: Vec<usize> = children.into_iter().map(|k| (k + root) % c.n).collect();
    let Some(pv) = parent else {
        // Root: chunk by chunk to every child, so the first chunk is travelling down the tree
        // while the rest is still being sent.
        if buf.is_empty() {
            return children.iter().try_for_each(|&k| c.send(k, buf));
        }
        return buf.chunks(c.chunk).try_for_each(|ch| children.iter().try_for_each(|&k| c.send(k, ch)));
    };
    // Forward each frame down the tree as soon as it has landed (pipelining).
    let total = buf.len();
    let mut forward = |_: usize, b: &[u8]| children.iter().try_for_each(|&k| c.send(k, b));
    c.t.recv(&c.desc, Recv { peer: (pv + root) % c.n, total, dst: Some(buf), on_data: &mut forward }, c.timeout)?;
    c.received(total);
    Ok(())
}

/// Pipelined chain: root → root+1 → … → root−1; each rank forwards every chunk as it lands.
/// Every rank sends (at most) B once, so no link or CPU carries more than B — best for large
/// messages when links or cores are the limit; n−1 hops of latency for small ones.
pub(crate) fn broadcast_ring(c: &Ctx, buf: &mut [u8], root: usize) -> CommResult<()> {
    let v = (c.rank + c.n - root) % c.n;
    let next = (v + 1 < c.n).then_some((c.rank + 1) % c.n);
    if v == 0 {
        return match next {
            Some(k) => c.send(k, buf),
            None => Ok(()),
        };
    }
    let total = buf.len();
    let mut forward = |_: usize, b: &[u8]| next.map_or(Ok(()), |k| c.send(k, b));
    c.t.recv(
        &c.desc,
        Recv { peer: (c.rank + c.n - 1) % c.n, total, dst: Some(buf), on_data: &mut forward },
        c.timeout,
    )?;
    c.received(total);
    Ok(())
}

// ---------------------------------------------------------------- all_reduce

/// Avg on bf16/f16 with more than one rank: scale each contribution by 1/n first.
fn premultiplied(c: &Ctx, op: ReduceOp) -> bool {
    op == ReduceOp::Avg && c.n > 1 && dtype::avg_premultiplies(c.desc.dtype)
}

/// Avg on f32/f64: divide the finished sum by n.
fn post_divides(c: &Ctx, op: ReduceOp) -> bool {
    op == ReduceOp::Avg && !dtype::avg_premultiplies(c.desc.dtype)
}

pub(crate) fn all_reduce_naive(c: &Ctx, buf: &mut [u8], op: ReduceOp) -> CommResult<()> {
    if premultiplied(c, op) {
        dtype::premultiply(c.desc.dtype, buf, None, c.n); // buf is overwritten by the result anyway
    }
    if c.rank != 0 {
        c.send(0, buf)?;
        return c.recv_into(0, buf);
    }
    // buf: (numel,) — rank 0 receives n−1 full copies and sends n−1 back: 2(n−1)·B through one link.
    (1..c.n).try_for_each(|p| c.recv_reduce(p, buf, op))?;
    if post_divides(c, op) {
        dtype::divide(c.desc.dtype, buf, c.n);
    }
    (1..c.n).try_for_each(|p| c.send(p, buf))
}

pub(crate) fn all_reduce_ring(c: &Ctx, buf: &mut [u8], op: ReduceOp) -> CommResult<()> {
    let (n, r, es, dt) = (c.n, c.rank, c.desc.dtype.size(), c.desc.dtype);
    let numel = buf.len() / es;
    let seg = |i: usize| segment(numel, n, i % n, es);
    if premultiplied(c, op) {
        dtype::premultiply(dt, buf, None, n);
    }
    // Reduce-scatter: after n−1 steps rank r holds the full reduction of segment r+1.
    for s in 0..n - 1 {
        c.ring_step(buf, seg(r + n - s), seg(r + 2 * n - s - 1), Apply::Reduce(op))?;
    }
    if post_divides(c, op) {
        dtype::divide(dt, &mut buf[seg(r + 1)], n);
    }
    // All-gather: pass the finished segments around the ring.
    for s in 0..n - 1 {
        c.ring_step(buf, seg(r + 1 + n - s), seg(r + n - s), Apply::Copy)?;
    }
    Ok(())
}

// ---------------------------------------------------------------- all_gather

/// `out` holds n blocks of `input.len()` bytes; block i ends up with rank i's input.
pub(crate) fn all_gather_naive(c: &Ctx, out: &mut [u8], input: &[u8]) -> CommResult<()> {
    let m = input.len();
    if c.rank != 0 {
        c.send(0, input)?;
        return c.recv_into(0, out);
    }
    out[..m].copy_from_slice(input);
    (1..c.n).try_for_each(|p| c.recv_into(p, &mut out[p * m..(p + 1) * m]))?;
    (1..c.n).try_for_each(|p| c.send(p, out))
}

pub(crate) fn all_gather_ring(c: &Ctx, out: &mut [u8], input: &[u8]) -> CommResult<()> {
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

// ---------------------------------------------------------------- reduce_scatter

/// `input` holds n blocks of `out.len()` bytes; `out` receives the reduction of every rank's block r.
pub(crate) fn reduce_scatter_naive(c: &Ctx, out: &mut [u8], input: &[u8], op: ReduceOp) -> CommResult<()> {
    let m = out.len();
    // Premultiply into scratch: the caller's input must stay untouched.
    let scaled = premultiplied(c, op).then(|| {
        let mut b = c.pool.get(input.len());
        dtype::premultiply(c.desc.dtype, b.bytes_mut(), Some(input), c.n);
        b
    });
    let input: &[u8] = scaled.as_ref().map_or(input, |b| b.bytes());
    if c.rank != 0 {
        c.send(0, input)?;
        return c.recv_into(0, out);
    }
    let mut acc = c.pool.get(input.len());
    let acc = acc.bytes_mut();
    acc.copy_from_slice(input);
    (1..c.n).try_for_each(|p| c.recv_reduce(p, acc, op))?;
    if post_divides(c, op) {
        dtype::divide(c.desc.dtype, acc, c.n);
    }
    (1..c.n).try_for_each(|p| c.send(p, &acc[p * m..(p + 1) * m]))?;
    out.copy_from_slice(&acc[..m]);
    Ok(())
}

pub(crate) fn reduce_scatter_ring(c: &Ctx, out: &mut [u8], input: &[u8], op: ReduceOp) -> CommResult<()> {
    let (n, r, m, dt) = (c.n, c.rank, out.len(), c.desc.dtype);
    let blk = |i: usize| (i % n) * m..(i % n + 1) * m;
    // Premultiply into scratch: the caller's input must stay untouched.
    let scaled = premultiplied(c, op).then(|| {
        let mut b = c.pool.get(input.len());
        dtype::premultiply(dt, b.bytes_mut(), Some(input), n);
        b
    });
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
    if post_divides(c, op) {
        dtype::divide(dt, out, n);
    }
    Ok(())
}

// ---------------------------------------------------------------- direct (shared memory)
//
// Every rank on one machine: a rank puts its part into its shared exchange buffer, syncs, and
// reads its peers' parts straight out of theirs. Per chunk of at most one buffer:
//   all_reduce      put (all but own segment) · sync · reduce own segment from every peer's copy
//                   · put it · sync · copy the other finished segments from their owners
//   reduce_scatter  put every block but own · sync · reduce own block from every peer's copy
//   all_gather      put input · sync · copy every peer's input
//   broadcast       root puts · sync · the others copy
// Each byte that moves is copied once (a ring over sockets or shared-memory rings copies it
// twice); the volume each rank reads is the ring's, 2(n−1)/n·B for all_reduce.

fn exchange<'a>(c: &Ctx<'a>) -> CommResult<&'a dyn Exchange> {
    c.t.shared_buffers().ok_or_else(|| {
        CommError::InvalidArgument(format!(
            "{}: the direct algorithm needs every rank on one machine, sharing memory (this group's data path is {})",
            c.desc.op.name(),
            c.t.data_path()
        ))
    })
}

/// Chunks of at most `cap` bytes (whole elements; one empty chunk for an empty buffer).
fn chunks(len: usize, cap: usize, es: usize) -> impl Iterator<Item = Range<usize>> {
    let step = (cap / es).max(1) * es;
    (0..len.div_ceil(step).max(1)).map(move |k| k * step..((k + 1) * step).min(len))
}

impl Ctx<'_> {
    fn moved(&self, sent: usize, received: usize) {
        self.counters.sent.fetch_add(sent as u64, Ordering::Relaxed);
        self.received(received);
    }
}

pub(crate) fn all_reduce_direct(c: &Ctx, buf: &mut [u8], op: ReduceOp) -> CommResult<()> {
    let x = exchange(c)?;
    let (n, r, es, dt) = (c.n, c.rank, c.desc.dtype.size(), c.desc.dtype);
    if premultiplied(c, op) {
        dtype::premultiply(dt, buf, None, n);
    }
    for ch in chunks(buf.len(), x.capacity(), es) {
        let part = &mut buf[ch];
        let numel = part.len() / es;
        let seg = |i: usize| segment(numel, n, i, es);
        let mine = seg(r);
        x.begin();
        x.put(&c.desc, 0, &part[..mine.start])?; // peers reduce their segments from these
        x.put(&c.desc, mine.end, &part[mine.end..])?;
        x.sync(&c.desc, c.timeout)?;
        for p in (0..n).filter(|&p| p != r) {
            dtype::reduce_into(dt, op, &mut part[mine.clone()], x.theirs(p, mine.start, mine.len()));
        }
        if post_divides(c, op) {
            dtype::divide(dt, &mut part[mine.clone()], n);
        }
        x.put(&c.desc, mine.start, &part[mine.clone()])?;
        x.sync(&c.desc, c.timeout)?;
        for q in (0..n).filter(|&q| q != r) {
            let s = seg(q);
            part[s.clone()].copy_from_slice(x.theirs(q, s.start, s.len()));
        }
        // Peers read our other segments once and our finished one n−1 times; we read theirs alike.
        let moved = part.len() - mine.len() + (n - 1) * mine.len();
        c.moved(moved, moved);
    }
    Ok(())
}

pub(crate) fn reduce_scatter_direct(c: &Ctx, out: &mut [u8], input: &[u8], op: ReduceOp) -> CommResult<()> {
    let x = exchange(c)?;
    let (n, r, m, es, dt) = (c.n, c.rank, out.len(), c.desc.dtype.size(), c.desc.dtype);
    let scaled = premultiplied(c, op).then(|| {
        let mut b = c.pool.get(input.len());
        dtype::premultiply(dt, b.bytes_mut(), Some(input), n);
        b
    });
    let input: &[u8] = scaled.as_ref().map_or(input, |b| b.bytes());
    // input: n blocks of m bytes; a chunk takes the same slice [a, b) of every block.
    for ch in chunks(m, x.capacity() / n, es) {
        let len = ch.len();
        x.begin();
        for q in (0..n).filter(|&q| q != r) {
            x.put(&c.desc, q * len, &input[q * m + ch.start..q * m + ch.end])?;
        }
        x.sync(&c.desc, c.timeout)?;
        let dst = &mut out[ch.clone()];
        dst.copy_from_slice(&input[r * m + ch.start..r * m + ch.end]);
        for p in (0..n).filter(|&p| p != r) {
            dtype::reduce_into(dt, op, dst, x.theirs(p, r * len, len));
        }
        if post_divides(c, op) {
            dtype::divide(dt, dst, n);
        }
        c.moved((n - 1) * len, (n - 1) * len);
    }
    Ok(())
}

pub(crate) fn all_gather_direct(c: &Ctx, out: &mut [u8], input: &[u8]) -> CommResult<()> {
    let x = exchange(c)?;
    let (n, r, m) = (c.n, c.rank, input.len());
    for ch in chunks(m, x.capacity(), c.desc.dtype.size()) {
        let len = ch.len();
        x.begin();
        x.put(&c.desc, 0, &input[ch.clone()])?;
        x.sync(&c.desc, c.timeout)?;
        out[r * m + ch.start..r * m + ch.end].copy_from_slice(&input[ch.clone()]);
        for q in (0..n).filter(|&q| q != r) {
            out[q * m + ch.start..q * m + ch.end].copy_from_slice(x.theirs(q, 0, len));
        }
        c.moved((n - 1) * len, (n - 1) * len);
    }
    Ok(())
}

pub(crate) fn broadcast_direct(c: &Ctx, buf: &mut [u8], root: usize) -> CommResult<()> {
    let x = exchange(c)?;
    for ch in chunks(buf.len(), x.capacity(), c.desc.dtype.size()) {
        let len = ch.len();
        x.begin();
        if c.rank == root {
            x.put(&c.desc, 0, &buf[ch])?;
            x.sync(&c.desc, c.timeout)?;
            c.moved((c.n - 1) * len, 0);
        } else {
            x.sync(&c.desc, c.timeout)?;
            buf[ch].copy_from_slice(x.theirs(root, 0, len));
            c.moved(0, len);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- point to point

pub(crate) fn send(c: &Ctx, peer: usize, buf: &[u8]) -> CommResult<()> {
    c.send(peer, buf)
}

pub(crate) fn recv(c: &Ctx, peer: usize, buf: &mut [u8]) -> CommResult<()> {
    c.recv_into(peer, buf)
}
