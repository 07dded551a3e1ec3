//! The host backend: CPU tensors, moved by the algorithms of `algo/` over a byte
//! [`Transport`] (`local.rs`: threads of one process; `tcp/`: processes and machines).
//!
//! An operation goes through two steps:
//!
//! 1. **call time** (the `CommBackend` methods): check the tensors (CPU, contiguous, supported
//!    dtype, sizes), resolve and check the algorithm, describe the operation ([`OpDesc`]: kind,
//!    dtype, size, origin, reduction, algorithm) and return a [`Pending`] that runs step 2;
//! 2. **run time** ([`Host::exec`]): give the operation its sequence number, run the algorithm
//!    with a [`Ctx`] holding the description — which every frame repeats, so ranks that
//!    disagree are caught at the first byte they exchange — and on any failure poison the group
//!    and tell the peers.

use super::algo::{self, direct, naive, ring, tree, Algo, Counters, Ctx};
use super::backend::{CommBackend, CommStats, Pending};
use super::config::CommConfig;
use super::dtype::{DType, ReduceOp, TensorBytes};
use super::error::{CommError, CommResult};
use super::frame::{BufPool, OpDesc, OpKind};
use super::relock;
use super::transport::{message_first_error, sent_before, Transport};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tch::Tensor;

/// The host backend of one rank (a handle: the operations it returns share its state).
pub(crate) struct HostBackend(Arc<Host>);

struct Host {
    t: Box<dyn Transport>,
    rank: usize,
    n: usize,
    timeout: Duration,
    chunk_bytes: usize,
    /// Held while an operation runs (a panic inside one poisons it: the group is unusable).
    seq: Mutex<Seq>,
    counters: Counters,
    pool: Arc<BufPool>,
}

/// Sequence numbers: every frame carries its operation's, so a frame of another operation is
/// never taken for one of this.
struct Seq {
    /// Collectives of the group, in call order.
    collectives: u64,
    /// Messages sent to / received from each peer.
    sent: Vec<u64>,
    received: Vec<u64>,
}

impl Seq {
    /// The number of `desc`; `peer`: the other rank of a send/recv.
    fn next(&mut self, desc: &OpDesc, peer: Option<usize>, me: usize) -> u64 {
        let c = match (desc.op, peer) {
            (OpKind::P2p, Some(p)) if desc.origin as usize == me => &mut self.sent[p],
            (OpKind::P2p, Some(p)) => &mut self.received[p],
            _ => &mut self.collectives,
        };
        *c += 1;
        *c - 1
    }
}

impl HostBackend {
    pub fn new(t: Box<dyn Transport>, cfg: &CommConfig) -> Self {
        let (rank, n) = (t.rank(), t.world_size());
        HostBackend(Arc::new(Host {
            t,
            rank,
            n,
            timeout: cfg.timeout,
            chunk_bytes: cfg.chunk_bytes,
            seq: Mutex::new(Seq { collectives: 0, sent: vec![0; n], received: vec![0; n] }),
            counters: Counters::default(),
            pool: BufPool::new(),
        }))
    }

    /// Every rank has joined (after rendezvous' barrier): drop what only joining needed.
    pub fn group_formed(&self) {
        self.0.t.group_formed();
    }

    /// `algo` resolved, if this backend has it for `op`.
    fn algo(&self, op: OpKind, algo: Algo) -> CommResult<Algo> {
        let algo = self.resolve(op, algo);
        if !Algo::supported(op).contains(&algo) {
            return Err(CommError::InvalidArgument(format!(
                "{} has no {algo:?} algorithm (supported: {:?})",
                op.name(),
                Algo::supported(op)
            )));
        }
        if algo == Algo::Direct && self.0.t.shared_buffers().is_none() {
            return Err(CommError::InvalidArgument(format!(
                "{}: the direct algorithm needs every rank on one machine, sharing memory (this group's data path is {})",
                op.name(),
                self.0.t.data_path()
            )));
        }
        Ok(algo)
    }

    /// The input and output of all_gather / reduce_scatter: `big` has world_size × `small`'s
    /// elements, of the same dtype, in separate memory.
    fn pair(&self, what: &str, big: &Tensor, small: &Tensor) -> CommResult<(TensorBytes, TensorBytes)> {
        let (b, s) = (TensorBytes::of(big, what)?, TensorBytes::of(small, what)?);
        if b.dtype != s.dtype {
            return Err(CommError::InvalidArgument(format!(
                "{what}: input and output dtypes differ ({} vs {})",
                b.dtype.name(),
                s.dtype.name()
            )));
        }
        if b.numel != s.numel * self.0.n {
            return Err(CommError::InvalidArgument(format!(
                "{what}: the large tensor must have world_size × {} = {} elements, it has {}",
                s.numel,
                s.numel * self.0.n,
                b.numel
            )));
        }
        let (bp, sp) = (b.bytes().as_ptr() as usize, s.bytes().as_ptr() as usize);
        if b.len > 0 && s.len > 0 && bp < sp + s.len && sp < bp + b.len {
            return Err(CommError::InvalidArgument(format!(
                "{what}: input and output share memory; pass separate tensors (in-place is not supported yet)"
            )));
        }
        Ok((b, s))
    }

    /// The operation `desc` (`peer`: the other rank of a send/recv), to run `body` later.
    fn deferred(
        &self,
        desc: OpDesc,
        peer: Option<usize>,
        body: impl FnOnce(&Ctx) -> CommResult<()> + Send + 'static,
    ) -> Pending {
        let host = self.0.clone();
        Pending::deferred(move || host.exec(desc, peer, body))
    }
}

/// `op` on `dtype`, if it is defined there.
fn reduction(what: OpKind, op: ReduceOp, dtype: DType) -> CommResult<ReduceOp> {
    if op == ReduceOp::Avg && dtype == DType::I64 {
        return Err(CommError::InvalidArgument(format!("{}: Avg is not defined for i64 tensors", what.name())));
    }
    Ok(op)
}

impl Host {
    /// Run one operation on this thread: its sequence number, the algorithm, the counters, and
    /// on any failure poison the group and tell the peers.
    fn exec(&self, desc: OpDesc, peer: Option<usize>, body: impl FnOnce(&Ctx) -> CommResult<()>) -> CommResult<()> {
        let mut seq = self.seq.lock().map_err(|_| {
            let e = CommError::Io(format!(
                "rank {}: an earlier operation panicked inside the communication layer; this group is unusable ({} refused)",
                self.rank,
                desc.op.name()
            ));
            self.t.abort(&e);
            e
        })?;
        if let Some(e) = self.t.poisoned() {
            return Err(e);
        }
        let after = if desc.op == OpKind::P2p { seq.collectives } else { 0 };
        let desc = OpDesc { seq: seq.next(&desc, peer, self.rank), after, ..desc };
        let es = desc.dtype.size();
        let ctx = Ctx {
            t: &*self.t,
            rank: self.rank,
            n: self.n,
            desc,
            timeout: self.timeout,
            chunk: (self.chunk_bytes / es).max(1) * es,
            counters: &self.counters,
            pool: &self.pool,
        };
        // A panic inside an operation (a bug) must not leave the peers waiting or a half-written
        // frame behind: it becomes this operation's error, and the group is aborted.
        let run = || self.message_first(&desc).map_or_else(|| body(&ctx), Err);
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or_else(|_| {
            Err(CommError::Io(format!("rank {}: {} panicked inside the communication layer", self.rank, desc)))
        });
        if res.is_ok() {
            self.counters.per_op[desc.op as usize].fetch_add(1, Ordering::Relaxed);
        }
        match &res {
            Err(e) => self.t.abort(e),
            Ok(()) if desc.op == OpKind::P2p => _ = self.counters.p2p.fetch_add(1, Ordering::Relaxed),
            Ok(()) => _ = self.counters.collectives.fetch_add(1, Ordering::Relaxed),
        }
        res
    }
}

impl Host {
    /// A collective that starts while a peer's point-to-point message, sent before the peer
    /// entered this collective, waits unread: this rank receives it after — the ranks called
    /// send/recv and collectives in different orders. (Unchecked, the message would pass on some
    /// data paths and hang both ranks on others, where it does not fit the link.)
    ///
    /// Cost: one non-blocking peek per peer link at the start of each collective. Measured on the
    /// 2-core CI machine with `collectives --transport tcp --ops all_reduce --sizes 8 --iters 3000
    /// --method barrier`, against a build without this check, medians of 18 alternating runs:
    /// 2 ranks 58.0 / 55.3 µs (+5%), 4 ranks 193 / 184 µs (+4%); single runs spread over ±20%, so
    /// the cost is at most a few µs per small collective and nothing at 64 KiB and up. Kept.
    fn message_first(&self, desc: &OpDesc) -> Option<CommError> {
        if desc.op == OpKind::P2p {
            return None;
        }
        let (p, theirs) = self.t.first_message().filter(|(_, m)| sent_before(m, desc))?;
        Some(message_first_error(self.rank, desc, p, &theirs))
    }
}

impl CommBackend for HostBackend {
    fn rank(&self) -> usize {
        self.0.rank
    }
    fn world_size(&self) -> usize {
        self.0.n
    }
    fn data_path(&self) -> &'static str {
        self.0.t.data_path()
    }
    fn stats(&self) -> CommStats {
        let c = &self.0.counters;
        CommStats {
            bytes_sent: c.sent.load(Ordering::Relaxed),
            bytes_received: c.received.load(Ordering::Relaxed),
            collectives: c.collectives.load(Ordering::Relaxed),
            p2p: c.p2p.load(Ordering::Relaxed),
            per_op: std::array::from_fn(|i| c.per_op[i].load(Ordering::Relaxed)),
        }
    }
    fn resolve(&self, op: OpKind, algo: Algo) -> Algo {
        match algo {
            Algo::Auto if self.0.t.shared_buffers().is_some() => Algo::Direct,
            Algo::Auto if op == OpKind::Broadcast => Algo::Tree,
            Algo::Auto => Algo::Ring,
            a => a,
        }
    }

    fn barrier(&self) -> CommResult<Pending> {
        Ok(self.deferred(OpDesc::new(OpKind::Barrier, DType::I64, 0), None, algo::barrier))
    }
    fn send(&self, t: &Tensor, dst: usize) -> CommResult<Pending> {
        let b = TensorBytes::of(t, "send")?;
        let desc = OpDesc { origin: self.0.rank as u32, ..OpDesc::new(OpKind::P2p, b.dtype, b.numel) };
        Ok(self.deferred(desc, Some(dst), move |c| c.send(dst, b.bytes())))
    }
    fn recv(&self, t: &mut Tensor, src: usize) -> CommResult<Pending> {
        let b = TensorBytes::of(t, "recv")?;
        let desc = OpDesc { origin: src as u32, ..OpDesc::new(OpKind::P2p, b.dtype, b.numel) };
        Ok(self.deferred(desc, Some(src), move |c| c.recv_into(src, b.bytes_mut())))
    }
    fn broadcast(&self, t: &mut Tensor, root: usize, algo: Algo) -> CommResult<Pending> {
        let b = TensorBytes::of(t, "broadcast")?;
        let algo = self.algo(OpKind::Broadcast, algo)?;
        let desc = OpDesc { origin: root as u32, algo: algo as u8, ..OpDesc::new(OpKind::Broadcast, b.dtype, b.numel) };
        Ok(self.deferred(desc, None, move |c| match algo {
            Algo::Naive => naive::broadcast(c, b.bytes_mut(), root),
            Algo::Ring => ring::broadcast(c, b.bytes_mut(), root),
            Algo::Direct => direct::broadcast(c, b.bytes_mut(), root),
            _ => tree::broadcast(c, b.bytes_mut(), root),
        }))
    }
    fn all_reduce(&self, t: &mut Tensor, op: ReduceOp, algo: Algo) -> CommResult<Pending> {
        let b = TensorBytes::of(t, "all_reduce")?;
        let algo = self.algo(OpKind::AllReduce, algo)?;
        let op = reduction(OpKind::AllReduce, op, b.dtype)?;
        let desc = OpDesc { reduce: Some(op), algo: algo as u8, ..OpDesc::new(OpKind::AllReduce, b.dtype, b.numel) };
        Ok(self.deferred(desc, None, move |c| match algo {
            Algo::Naive => naive::all_reduce(c, b.bytes_mut(), op),
            Algo::Direct => direct::all_reduce(c, b.bytes_mut(), op),
            _ => ring::all_reduce(c, b.bytes_mut(), op),
        }))
    }
    fn all_gather(&self, out: &mut Tensor, input: &Tensor, algo: Algo) -> CommResult<Pending> {
        let (o, x) = self.pair("all_gather", out, input)?;
        let algo = self.algo(OpKind::AllGather, algo)?;
        let desc = OpDesc { algo: algo as u8, ..OpDesc::new(OpKind::AllGather, x.dtype, x.numel) };
        Ok(self.deferred(desc, None, move |c| match algo {
            Algo::Naive => naive::all_gather(c, o.bytes_mut(), x.bytes()),
            Algo::Direct => direct::all_gather(c, o.bytes_mut(), x.bytes()),
            _ => ring::all_gather(c, o.bytes_mut(), x.bytes()),
        }))
    }
    fn reduce_scatter(&self, out: &mut Tensor, input: &Tensor, op: ReduceOp, algo: Algo) -> CommResult<Pending> {
        let (x, o) = self.pair("reduce_scatter", input, out)?;
        let algo = self.algo(OpKind::ReduceScatter, algo)?;
        let op = reduction(OpKind::ReduceScatter, op, x.dtype)?;
        let desc =
            OpDesc { reduce: Some(op), algo: algo as u8, ..OpDesc::new(OpKind::ReduceScatter, x.dtype, x.numel) };
        Ok(self.deferred(desc, None, move |c| match algo {
            Algo::Naive => naive::reduce_scatter(c, o.bytes_mut(), x.bytes(), op),
            Algo::Direct => direct::reduce_scatter(c, o.bytes_mut(), x.bytes(), op),
            _ => ring::reduce_scatter(c, o.bytes_mut(), x.bytes(), op),
        }))
    }

    fn check_stray(&self) -> CommResult<Pending> {
        let host = self.0.clone();
        Ok(Pending::deferred(move || {
            // The closing barrier's frames, which fast peers may already have sent, are expected.
            let seq = relock(&host.seq).collectives;
            let next = OpDesc { seq, ..OpDesc::new(OpKind::Barrier, DType::I64, 0) };
            match host.t.stray(&next) {
                Some(e) => {
                    host.t.abort(&e);
                    Err(e)
                }
                None => Ok(()),
            }
        }))
    }
    fn poisoned(&self) -> Option<CommError> {
        self.0.t.poisoned()
    }
    fn abort(&self, err: &CommError) {
        self.0.t.abort(err);
    }
    fn leave(&self) {
        self.0.t.leave();
    }
}
