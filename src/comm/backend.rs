//! The backend seam: what a [`ProcessGroup`](super::ProcessGroup) asks of whatever runs its
//! collectives. The group owns the public API, the argument checks every backend shares (ranks
//! in range, no send to self), the default algorithms of its [`CommConfig`](super::CommConfig)
//! and the asynchronous machinery (the communication thread and [`Work`](super::Work)); a
//! [`CommBackend`] implements whole operations on tensors.
//!
//! Two implementations: the host backend (`host.rs`): CPU tensors, the algorithms of `algo/`
//! over a byte transport (`local.rs`: threads; `tcp/`: processes and machines); and the NCCL
//! backend (`nccl/`, lesson 11), following the design below.

use super::algo::Algo;
use super::dtype::ReduceOp;
use super::error::{CommError, CommResult};
use super::frame::OpKind;
use serde::{Deserialize, Serialize};
use tch::Tensor;

/// Runs the operations of one rank of a process group.
///
/// # Contract
///
/// * **Call time.** Each operation method checks its arguments at once and returns a
///   [`Pending`] (or the error: the group then aborts, so every rank fails fast). The group has
///   already checked that rank arguments are in range and that nobody sends to itself.
///   `algo` is what the caller asked for (possibly [`Algo::Auto`]); a backend that does not
///   implement it for this operation returns [`CommError::InvalidArgument`] naming the
///   operation.
/// * **Run time.** The returned [`Pending`] owns everything it needs: tensors it reads or writes
///   are kept alive by their own handles (`Tensor::shallow_clone`), since the caller may drop
///   its handle first (`*_async` with its input). Outputs are written through those handles.
/// * **Order.** The group runs the operations of a rank one at a time, in call order. Every rank
///   must call the same collectives in the same order; a backend that can detect ranks that
///   disagree (kind, order, dtype, size, root, algorithm) reports it as
///   [`CommError::Mismatch`] on every rank.
/// * **Failure.** Any failure of a running operation aborts the group: [`abort`](Self::abort)
///   has told the peers (their current or next operation fails) and [`poisoned`](Self::poisoned)
///   returns the error from then on.
///
/// # Asynchronous operations
///
/// The host backend's [`Pending`]s are [`deferred`](Pending::deferred): the work happens when
/// the group runs them — inline for a blocking call, on the group's communication thread for
/// an `*_async` call. A backend with native asynchrony returns [`Pending::in_flight`] instead:
/// the work was already started when the method returned (on the backend's own queue or
/// stream), and the group waits for it in `Work::wait` (a blocking call waits at once) without
/// ever starting a communication thread. A backend uses one kind or the other.
///
/// # An NCCL backend
///
/// NCCL implements whole collectives on device memory, so it fills this trait directly and
/// never touches the byte transports:
///
/// * **Rendezvous** through our store: rank 0 creates the NCCL unique id, puts it in the
///   authenticated [`store`](super::store) that `init_tcp` already runs (`set("nccl/id", …)`),
///   every rank `get`s it and calls `ncclCommInitRank(world_size, id, rank)` on its device.
/// * **Tensors** are CUDA tensors on the communicator's device; the call-time checks are
///   device, contiguity, dtype (f32, f64, bf16, f16, i64 map to NCCL types) and sizes — a CPU
///   tensor is an `InvalidArgument` naming the operation, as a CUDA tensor is for the host.
/// * **Streams**: each method makes the backend's communication stream wait on an event of the
///   caller's current stream (so the kernel sees the finished producer of the data), enqueues
///   `ncclAllReduce` etc. there, records a completion event and returns
///   `Pending::in_flight(work)`; `work.is_done()` queries the event, `work.wait()` waits on it
///   (and keeps the tensors alive until then).
/// * **Algorithms**: NCCL picks its own; `resolve` keeps [`Algo::Auto`], and any other `algo` is
///   an `InvalidArgument` ("all_reduce: the nccl backend chooses its own algorithm").
/// * **Failures**: NCCL does not check that ranks agree (a mismatch hangs until the timeout);
///   `abort` is `ncclCommAbort` and `poisoned` what `ncclCommGetAsyncError` reported;
///   `check_stray` has nothing to look at; `leave` is `ncclCommDestroy`; `data_path` "nccl";
///   `stats` counts the bytes each algorithm moves by its formula.
pub trait CommBackend: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// How this rank's data moves ("local", "tcp", "shm", "shm+tcp").
    fn data_path(&self) -> &'static str;
    /// Payload bytes sent and received by this rank so far, and operations completed.
    fn stats(&self) -> CommStats;
    /// The algorithm `algo` stands for in this group for `op` (`Auto`: the best it has).
    fn resolve(&self, op: OpKind, algo: Algo) -> Algo;

    /// Wait until every rank reached the barrier.
    fn barrier(&self) -> CommResult<Pending>;
    /// Send `t` to rank `dst` (≠ this rank), which receives it with `recv`.
    fn send(&self, t: &Tensor, dst: usize) -> CommResult<Pending>;
    /// Receive into `t` what rank `src` (≠ this rank) sends.
    fn recv(&self, t: &mut Tensor, src: usize) -> CommResult<Pending>;
    /// Copy `root`'s `t` into every rank's `t`.
    fn broadcast(&self, t: &mut Tensor, root: usize, algo: Algo) -> CommResult<Pending>;
    /// Reduce `t` over all ranks in place.
    fn all_reduce(&self, t: &mut Tensor, op: ReduceOp, algo: Algo) -> CommResult<Pending>;
    /// Concatenate every rank's `input` (rank order) into `out` (world_size × input's elements).
    fn all_gather(&self, out: &mut Tensor, input: &Tensor, algo: Algo) -> CommResult<Pending>;
    /// Reduce `input` (world_size blocks) over all ranks; rank r gets block r in `out`.
    fn reduce_scatter(&self, out: &mut Tensor, input: &Tensor, op: ReduceOp, algo: Algo) -> CommResult<Pending>;

    /// End-of-job check, run by `ProcessGroup::finish` between two barriers: data that arrived
    /// but that no operation asked for (the ranks ran different collectives) is a
    /// [`CommError::Mismatch`].
    fn check_stray(&self) -> CommResult<Pending>;
    /// The error that broke this group, if any.
    fn poisoned(&self) -> Option<CommError>;
    /// Give up: poison this rank's group with `err` and tell every peer (best effort, never
    /// blocks for long).
    fn abort(&self, err: &CommError);
    /// Clean shutdown after the rank's work: tell the peers that nothing more will come.
    fn leave(&self);
}

/// Bytes this rank has sent and received through its group (payload only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommStats {
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Collective calls completed (barrier, broadcast, all_reduce, all_gather, reduce_scatter).
    pub collectives: u64,
    /// Point-to-point calls completed (each send and each recv).
    pub p2p: u64,
    /// Completed calls per operation, indexed by `OpKind as usize` (read it with [`CommStats::calls`]).
    pub per_op: [u64; 7],
}

impl CommStats {
    /// How many `op` calls completed (`OpKind::P2p` counts each send and each recv).
    pub fn calls(&self, op: super::OpKind) -> u64 {
        self.per_op[op as usize]
    }
    /// What happened between `before` and `self` (both from the same group).
    pub fn since(&self, before: &CommStats) -> CommStats {
        let mut per_op = [0; 7];
        for (i, c) in per_op.iter_mut().enumerate() {
            *c = self.per_op[i].saturating_sub(before.per_op[i]);
        }
        CommStats {
            bytes_sent: self.bytes_sent.saturating_sub(before.bytes_sent),
            bytes_received: self.bytes_received.saturating_sub(before.bytes_received),
            collectives: self.collectives.saturating_sub(before.collectives),
            p2p: self.p2p.saturating_sub(before.p2p),
            per_op,
        }
    }
    /// The operations that ran, e.g. `"2 all_reduce, 1 broadcast, 4 send/recv"` (for error messages).
    pub fn describe_calls(&self) -> String {
        use super::OpKind::*;
        let v: Vec<String> = [Barrier, Broadcast, AllReduce, AllGather, ReduceScatter, P2p]
            .into_iter()
            .filter(|&op| self.calls(op) > 0)
            .map(|op| format!("{} {}", self.calls(op), op.name()))
            .collect();
        if v.is_empty() {
            "no communication".into()
        } else {
            v.join(", ")
        }
    }
}

/// An operation a backend has checked and accepted (see [`CommBackend`]).
#[must_use = "a Pending does nothing until the group runs it"]
pub struct Pending(pub(super) Op);

pub(super) enum Op {
    Deferred(Box<dyn FnOnce() -> CommResult<()> + Send>),
    InFlight(Box<dyn InFlight>),
}

impl Pending {
    /// Work still to do: `run` does the whole operation when the group calls it (in call order,
    /// on the caller's thread or on the group's communication thread).
    pub fn deferred(run: impl FnOnce() -> CommResult<()> + Send + 'static) -> Self {
        Pending(Op::Deferred(Box::new(run)))
    }
    /// Work the backend already started by itself (native asynchrony, see [`CommBackend`]).
    pub fn in_flight(op: impl InFlight + 'static) -> Self {
        Pending(Op::InFlight(Box::new(op)))
    }
}

/// An operation running on its own (an NCCL kernel on the backend's stream, say).
pub trait InFlight: Send + Sync {
    /// Whether it finished (successfully or not), without blocking.
    fn is_done(&self) -> bool;
    /// Block until it finished; its result.
    fn wait(self: Box<Self>) -> CommResult<()>;
}
