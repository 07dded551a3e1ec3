//! Direct algorithms (every rank on one machine, sharing memory): a rank puts its part into its
//! shared exchange buffer, syncs, and reads its peers' parts straight out of theirs. Per chunk
//! of at most one buffer:
//!
//! ```text
//! all_reduce      put (all but own segment) · sync · reduce own segment from every peer's copy
//!                 · put it · sync · copy the other finished segments from their owners
//! reduce_scatter  put every block but own · sync · reduce own block from every peer's copy
//! all_gather      put input · sync · copy every peer's input
//! broadcast       root puts · sync · the others copy
//! ```
//!
//! Each byte that moves is copied once (a ring over sockets or shared-memory rings copies it
//! twice); the volume each rank reads is the ring's, 2(n−1)/n·B for all_reduce.

use super::{segment, Ctx};
use crate::comm::dtype::{self, ReduceOp};
use crate::comm::error::{CommError, CommResult};
use crate::comm::transport::Exchange;
use std::ops::Range;

/// The group's exchange buffers, or why the direct algorithms cannot run in it.
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

pub(crate) fn all_reduce(c: &Ctx, buf: &mut [u8], op: ReduceOp) -> CommResult<()> {
    let x = exchange(c)?;
    let (n, r, es, dt) = (c.n, c.rank, c.desc.dtype.size(), c.desc.dtype);
    if c.premultiplied(op) {
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
        if c.post_divides(op) {
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

pub(crate) fn reduce_scatter(c: &Ctx, out: &mut [u8], input: &[u8], op: ReduceOp) -> CommResult<()> {
    let x = exchange(c)?;
    let (n, r, m, es, dt) = (c.n, c.rank, out.len(), c.desc.dtype.size(), c.desc.dtype);
    let scaled = c.premultiplied_copy(input, op);
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
        if c.post_divides(op) {
            dtype::divide(dt, dst, n);
        }
        c.moved((n - 1) * len, (n - 1) * len);
    }
    Ok(())
}

pub(crate) fn all_gather(c: &Ctx, out: &mut [u8], input: &[u8]) -> CommResult<()> {
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

pub(crate) fn broadcast(c: &Ctx, buf: &mut [u8], root: usize) -> CommResult<()> {
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
