//! The host backend's collective algorithms, written once over `Transport` (so the same code
//! runs between threads and over TCP or shared memory), one family per file:
//!
//! * `naive` — everything through rank 0 (or the root);
//! * `ring` — reduce-scatter and/or all-gather around the ranks (broadcast: a pipelined chain);
//! * `tree` — binomial-tree broadcast;
//! * `direct` — every rank reads its peers' data straight out of their shared memory.
//!
//! Each is a function `(c: &Ctx, buffers…) -> CommResult<()>`; `Ctx` says who this rank is
//! and carries the operation's description, which every frame repeats (see `frame`).
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

pub(crate) mod direct;
pub(crate) mod naive;
pub(crate) mod ring;
pub(crate) mod tree;

pub use tree::binomial_tree;

use super::dtype::{self, ReduceOp};
use super::error::CommResult;
use super::frame::{Buf, BufPool, OpDesc, OpKind};
use super::transport::{Recv, Transport};
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Collective algorithms, selectable per call so lessons can compare them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[repr(u8)]
pub enum Algo {
    /// Everything through rank 0 (or the root): simple, and the root's link is the bottleneck.
    Naive = 1,
    /// Ring: reduce-scatter and/or all-gather around the ranks, bandwidth-optimal (for broadcast:
    /// a pipelined chain).
    Ring = 2,
    /// Binomial tree (broadcast): ⌈log2 n⌉ rounds, pipelined in chunks.
    Tree = 3,
    /// Every rank reads its peers' data straight out of their shared memory (process ranks that
    /// all run on one machine): one copy per byte that moves, no frames.
    Direct = 4,
    /// The best this group has: `Direct` when every rank shares memory, else `Ring` (broadcast:
    /// `Tree`). Resolved when the call is made; never on the wire.
    Auto = 5,
}

impl Algo {
    pub fn name(self) -> &'static str {
        match self {
            Algo::Naive => "naive",
            Algo::Ring => "ring",
            Algo::Tree => "tree",
            Algo::Direct => "direct",
            Algo::Auto => "auto",
        }
    }
    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Algo::Naive,
            2 => Algo::Ring,
            3 => Algo::Tree,
            4 => Algo::Direct,
            _ => return None,
        })
    }
    /// Algorithms the host backend implements for `op` (`Direct` only where every rank shares
    /// memory).
    pub fn supported(op: OpKind) -> &'static [Algo] {
        match op {
            OpKind::Broadcast => &[Algo::Naive, Algo::Tree, Algo::Ring, Algo::Direct],
            OpKind::AllReduce | OpKind::AllGather | OpKind::ReduceScatter => &[Algo::Naive, Algo::Ring, Algo::Direct],
            OpKind::Barrier | OpKind::P2p => &[Algo::Naive],
        }
    }
}

/// Bytes this rank put on and took off the wire, and operations it completed.
#[derive(Default, Debug)]
pub(crate) struct Counters {
    pub sent: AtomicU64,
    pub received: AtomicU64,
    pub collectives: AtomicU64,
    pub p2p: AtomicU64,
    /// Completed calls per operation, indexed by `OpKind as usize`.
    pub per_op: [AtomicU64; 7],
}

/// Everything an algorithm needs for one operation.
pub(crate) struct Ctx<'a> {
    pub t: &'a dyn Transport,
    pub rank: usize,
    pub n: usize,
    /// What runs (with its sequence number): every frame of it carries this, every receiver
    /// checks it.
    pub desc: OpDesc,
    pub timeout: Duration,
    /// Frame payload size in bytes (a multiple of the element size).
    pub chunk: usize,
    pub counters: &'a Counters,
    pub pool: &'a Arc<BufPool>,
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
    /// Bytes moved without frames (the direct algorithms).
    fn moved(&self, sent: usize, received: usize) {
        self.counters.sent.fetch_add(sent as u64, Ordering::Relaxed);
        self.received(received);
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
    /// Receive `total` bytes from `peer` into `buf`, calling `forward` with each piece as it
    /// lands (pipelined broadcasts pass it on).
    fn recv_forward(
        &self,
        peer: usize,
        buf: &mut [u8],
        forward: &mut dyn FnMut(usize, &[u8]) -> CommResult<()>,
    ) -> CommResult<()> {
        let total = buf.len();
        self.t.recv(&self.desc, Recv { peer, total, dst: Some(buf), on_data: forward }, self.timeout)?;
        self.received(total);
        Ok(())
    }

    /// Avg on bf16/f16 with more than one rank: scale each contribution by 1/n first.
    fn premultiplied(&self, op: ReduceOp) -> bool {
        op == ReduceOp::Avg && self.n > 1 && dtype::avg_premultiplies(self.desc.dtype)
    }
    /// Avg on f32/f64: divide the finished sum by n.
    fn post_divides(&self, op: ReduceOp) -> bool {
        op == ReduceOp::Avg && !dtype::avg_premultiplies(self.desc.dtype)
    }
    /// `input` scaled by 1/n in scratch memory when `op` premultiplies (the caller's input must
    /// stay untouched); `None`: use `input` as it is.
    fn premultiplied_copy(&self, input: &[u8], op: ReduceOp) -> Option<Buf> {
        self.premultiplied(op).then(|| {
            let mut b = self.pool.get(input.len());
            dtype::premultiply(self.desc.dtype, b.bytes_mut(), Some(input), self.n);
            b
        })
    }
}

/// Byte range of segment `i` when `numel` elements are split over `n` ranks as evenly as possible.
pub fn segment(numel: usize, n: usize, i: usize, esize: usize) -> Range<usize> {
    let (a, b) = (numel * i / n, numel * (i + 1) / n);
    a * esize..b * esize
}

/// Everyone reports to rank 0, which then releases everyone.
pub(crate) fn barrier(c: &Ctx) -> CommResult<()> {
    if c.rank == 0 {
        (1..c.n).try_for_each(|p| c.recv_into(p, &mut []))?;
        (1..c.n).try_for_each(|p| c.send(p, &[]))
    } else {
        c.send(0, &[])?;
        c.recv_into(0, &mut [])
    }
}
