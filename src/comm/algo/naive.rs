//! Everything through one rank: rank 0 (the root for broadcast) receives every contribution and
//! sends every result. Simple and latency-friendly for tiny messages; the root's link carries
//! 2(n−1)·B and is the bottleneck for large ones.

use super::Ctx;
use crate::comm::dtype::{self, ReduceOp};
use crate::comm::error::CommResult;

/// The root sends the whole buffer to every other rank.
pub(crate) fn broadcast(c: &Ctx, buf: &mut [u8], root: usize) -> CommResult<()> {
    if c.rank == root {
        (0..c.n).filter(|p| *p != root).try_for_each(|p| c.send(p, buf))
    } else {
        c.recv_into(root, buf)
    }
}

pub(crate) fn all_reduce(c: &Ctx, buf: &mut [u8], op: ReduceOp) -> CommResult<()> {
    if c.premultiplied(op) {
        dtype::premultiply(c.desc.dtype, buf, None, c.n); // buf is overwritten by the result anyway
    }
    if c.rank != 0 {
        c.send(0, buf)?;
        return c.recv_into(0, buf);
    }
    // buf: (numel,) — rank 0 receives n−1 full copies and sends n−1 back: 2(n−1)·B through one link.
    (1..c.n).try_for_each(|p| c.recv_reduce(p, buf, op))?;
    if c.post_divides(op) {
        dtype::divide(c.desc.dtype, buf, c.n);
    }
    (1..c.n).try_for_each(|p| c.send(p, buf))
}

/// `out` holds n blocks of `input.len()` bytes; block i ends up with rank i's input.
pub(crate) fn all_gather(c: &Ctx, out: &mut [u8], input: &[u8]) -> CommResult<()> {
    let m = input.len();
    if c.rank != 0 {
        c.send(0, input)?;
        return c.recv_into(0, out);
    }
    out[..m].copy_from_slice(input);
    (1..c.n).try_for_each(|p| c.recv_into(p, &mut out[p * m..(p + 1) * m]))?;
    (1..c.n).try_for_each(|p| c.send(p, out))
}

/// `input` holds n blocks of `out.len()` bytes; `out` receives the reduction of every rank's block r.
pub(crate) fn reduce_scatter(c: &Ctx, out: &mut [u8], input: &[u8], op: ReduceOp) -> CommResult<()> {
    let m = out.len();
    let scaled = c.premultiplied_copy(input, op);
    let input: &[u8] = scaled.as_ref().map_or(input, |b| b.bytes());
    if c.rank != 0 {
        c.send(0, input)?;
        return c.recv_into(0, out);
    }
    let mut acc = c.pool.get(input.len());
    let acc = acc.bytes_mut();
    acc.copy_from_slice(input);
    (1..c.n).try_for_each(|p| c.recv_reduce(p, acc, op))?;
    if c.post_divides(op) {
        dtype::divide(c.desc.dtype, acc, c.n);
    }
    (1..c.n).try_for_each(|p| c.send(p, &acc[p * m..(p + 1) * m]))?;
    out.copy_from_slice(&acc[..m]);
    Ok(())
}
