//! [`ProcessGroup`]: the public API of one rank. Each method checks what every backend shares
//! (ranks in range, no send to self), asks the backend for the operation (which checks its
//! tensors at once) and runs it — blocking calls in order with the queued asynchronous ones,
//! `*_async` calls on the communication thread ([`Worker`]). Any error at call time aborts the
//! group, so the peers fail fast too.

use super::algo::Algo;
use super::backend::{CommBackend, CommStats, Pending};
use super::config::{Backend, CommConfig};
use super::dtype::ReduceOp;
use super::error::{CommError, CommResult};
use super::family::Family;
use super::frame::OpKind;
use super::store::StoreServer;
use super::work::{Work, Worker};
use std::sync::Arc;
use tch::{Device, Tensor};

/// A group of `world_size` ranks that communicate; each rank holds its own `ProcessGroup`.
///
/// Collectives must be called by every rank in the same order with matching arguments (as in
/// torch.distributed); any disagreement is detected and reported on every rank.
pub struct ProcessGroup {
    backend: Arc<dyn CommBackend>,
    worker: Worker,
    /// This rank's groups: the one made by rendezvous and its subgroups, which fail together.
    family: Arc<Family>,
    kind: Backend,
    cfg: CommConfig,
    local_rank: usize,
    local_world_size: usize,
    /// Rank 0 of a TCP group hosts the rendezvous store (closed once the group is formed).
    pub(super) store: Option<StoreServer>,
    /// Subgroups ([`ProcessGroup::split`], lesson 12): how many splits this group has made (every
    /// rank calls them in the same order, so the count names a split on every rank) ...
    pub(super) splits: std::sync::atomic::AtomicU64,
    /// ... and this group's identity among the local worlds of this process (threads).
    pub(super) uid: u64,
    /// TCP: the address this rank's peers reach it at (a subgroup's store listens there).
    pub(super) data_ip: Option<std::net::IpAddr>,
}

impl ProcessGroup {
    pub(super) fn new(
        backend: Arc<dyn CommBackend>,
        kind: Backend,
        cfg: CommConfig,
        (local_rank, local_world_size): (usize, usize),
        store: Option<StoreServer>,
    ) -> Self {
        let family = Family::new(backend.rank());
        family.join(&backend);
        let worker = Worker::new(backend.clone(), family.clone());
        ProcessGroup {
            backend,
            worker,
            family,
            kind,
            cfg,
            local_rank,
            local_world_size,
            store,
            splits: std::sync::atomic::AtomicU64::new(0),
            uid: 0,
            data_ip: None,
        }
    }

    pub fn rank(&self) -> usize {
        self.backend.rank()
    }
    /// The job this group belongs to within this process (its rank's first group and every
    /// subgroup made from it share one token).
    pub fn job(&self) -> super::JobToken {
        self.family.token()
    }
    pub fn world_size(&self) -> usize {
        self.backend.world_size()
    }
    /// Rank among the processes of this machine (LOCAL_RANK).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }
    pub fn backend(&self) -> Backend {
        self.kind
    }
    /// How this rank's data moves: "local" (threads), "tcp", "shm" (shared memory with every
    /// peer) or "shm+tcp" (shared memory on this machine, TCP to the others).
    pub fn data_path(&self) -> &'static str {
        self.backend.data_path()
    }
    pub fn config(&self) -> &CommConfig {
        &self.cfg
    }
    /// Payload bytes sent and received by this rank so far, and operations completed.
    pub fn stats(&self) -> CommStats {
        self.backend.stats()
    }
    /// The algorithm `algo` stands for in this group (`Auto`: the best it has).
    pub fn resolve(&self, op: OpKind, algo: Algo) -> Algo {
        self.backend.resolve(op, algo)
    }

    /// Make this group (new, no operation run yet) one of `family`'s: a subgroup fails with
    /// the group it was split from (`family.rs`).
    pub(super) fn in_family(mut self, family: &Arc<Family>) -> Self {
        family.join(&self.backend);
        self.worker = Worker::new(self.backend.clone(), family.clone());
        self.family = family.clone();
        self
    }
    pub(super) fn family(&self) -> &Arc<Family> {
        &self.family
    }

    /// Tell every rank about a call-time error: it is this call's error on every rank (and
    /// this rank's other groups fail too).
    fn fail(&self, e: CommError) -> CommError {
        self.backend.abort(&e);
        self.family.fire(&e);
        e
    }
    /// Run what the backend made of a blocking call: its call-time error (after aborting the
    /// group, so every rank fails fast), or the operation, in order after the queued ones.
    fn run(&self, op: CommResult<Pending>) -> CommResult<()> {
        self.worker.run(op.map_err(|e| self.fail(e))?)
    }
    /// The same for an `*_async` call: the operation is queued; `out` comes back from
    /// [`Work::wait`].
    fn start<T>(&self, op: CommResult<Pending>, out: T) -> CommResult<Work<T>> {
        Ok(self.worker.submit(op.map_err(|e| self.fail(e))?, out))
    }
    fn check_rank(&self, what: &str, r: usize) -> CommResult<()> {
        if r >= self.world_size() {
            let e = format!("{what} rank {r} is out of range for world size {}", self.world_size());
            return Err(self.fail(CommError::InvalidArgument(e)));
        }
        Ok(())
    }

    /// Wait until every rank reached the barrier.
    pub fn barrier(&self) -> CommResult<()> {
        self.run(self.backend.barrier())
    }

    /// End-of-job check, called by [`crate::launch::spawn`] after the rank's work: a barrier, a
    /// check that no data arrived that nobody asked for (ranks that ran different collectives —
    /// a wrong broadcast root on one rank, say — leave such data behind), and a second barrier
    /// so that a rank that finds some makes every rank fail.
    pub fn finish(&self) -> CommResult<()> {
        self.barrier()?;
        self.run(self.backend.check_stray())?;
        self.barrier()
    }

    /// Give up on the group: every rank's next (or current) operation fails with `reason`, in
    /// this group and in this rank's other groups (the one it was split from, its subgroups).
    pub fn abort(&self, reason: &str) {
        self.fail(CommError::Aborted { by: self.rank(), reason: reason.to_string() });
    }

    /// Send `t` to rank `dst`, which must call [`recv`](Self::recv) with a tensor of the same
    /// dtype and size. Returns once the data left this rank.
    ///
    /// A message sits between the same collectives of this group on both ranks: a `send` before
    /// a collective received after it (or the other way round) is a [`CommError::Mismatch`] on
    /// every data path, whether or not the message would fit the link (Gloo would buffer it,
    /// NCCL would hang). Caught where a rank can see it: the receiver finds the message waiting
    /// when its collective starts or stalls, or a receiver finds its sender in a collective over
    /// shared memory. A receiver waiting in `recv` while its sender waits in a collective that
    /// does not read from it (a broadcast leaf over frames) is released by the timeout only.
    pub fn send(&self, t: &Tensor, dst: usize) -> CommResult<()> {
        self.check_rank("send: destination", dst)?;
        if dst == self.rank() {
            return Err(self.fail(CommError::InvalidArgument("send: cannot send to self".into())));
        }
        if let Some(d) = self.stage_to(&[t]) {
            return self.run(self.backend.send(&to(t, d), dst));
        }
        self.run(self.backend.send(t, dst))
    }

    /// Receive into `t` what rank `src` sends with [`send`](Self::send).
    pub fn recv(&self, t: &mut Tensor, src: usize) -> CommResult<()> {
        self.check_rank("recv: source", src)?;
        if src == self.rank() {
            return Err(self.fail(CommError::InvalidArgument("recv: cannot receive from self".into())));
        }
        if let Some(d) = self.stage_to(&[t]) {
            let mut h = to(t, d);
            self.run(self.backend.recv(&mut h, src))?;
            copy_back(t, &h);
            return Ok(());
        }
        self.run(self.backend.recv(t, src))
    }

    /// Copy `root`'s `t` into every rank's `t` (default algorithm: binomial tree).
    pub fn broadcast(&self, t: &mut Tensor, root: usize) -> CommResult<()> {
        self.broadcast_with(t, root, self.cfg.broadcast_algo)
    }
    pub fn broadcast_with(&self, t: &mut Tensor, root: usize, algo: Algo) -> CommResult<()> {
        self.check_rank("broadcast: root", root)?;
        if let Some(d) = self.stage_to(&[t]) {
            let mut h = to(t, d);
            self.run(self.backend.broadcast(&mut h, root, algo))?;
            copy_back(t, &h);
            return Ok(());
        }
        self.run(self.backend.broadcast(t, root, algo))
    }
    /// Non-blocking [`broadcast`](Self::broadcast): `t` comes back from [`Work::wait`].
    pub fn broadcast_async(&self, mut t: Tensor, root: usize) -> CommResult<Work<Tensor>> {
        self.check_rank("broadcast: root", root)?;
        if let Some(d) = self.stage_to(&[&t]) {
            let mut h = to(&t, d);
            let w = self.start(self.backend.broadcast(&mut h, root, self.cfg.broadcast_algo), h.shallow_clone())?;
            return Ok(w.replace_out(t, move |t: &mut Tensor| copy_back(t, &h)));
        }
        self.start(self.backend.broadcast(&mut t, root, self.cfg.broadcast_algo), t)
    }

    /// Reduce `t` over all ranks in place: afterwards every rank holds the same result.
    pub fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> CommResult<()> {
        self.all_reduce_with(t, op, self.cfg.all_reduce_algo)
    }
    pub fn all_reduce_with(&self, t: &mut Tensor, op: ReduceOp, algo: Algo) -> CommResult<()> {
        if let Some(d) = self.stage_to(&[t]) {
            let mut h = to(t, d);
            self.run(self.backend.all_reduce(&mut h, op, algo))?;
            copy_back(t, &h);
            return Ok(());
        }
        self.run(self.backend.all_reduce(t, op, algo))
    }
    /// Non-blocking [`all_reduce`](Self::all_reduce): returns at once; the reduced `t` comes
    /// back from [`Work::wait`].
    pub fn all_reduce_async(&self, mut t: Tensor, op: ReduceOp) -> CommResult<Work<Tensor>> {
        if let Some(d) = self.stage_to(&[&t]) {
            let mut h = to(&t, d);
            let w = self.start(self.backend.all_reduce(&mut h, op, self.cfg.all_reduce_algo), h.shallow_clone())?;
            return Ok(w.replace_out(t, move |t: &mut Tensor| copy_back(t, &h)));
        }
        self.start(self.backend.all_reduce(&mut t, op, self.cfg.all_reduce_algo), t)
    }

    /// Concatenate every rank's `input` (rank order) into `out`, which has world_size × input's
    /// elements — torch's `all_gather_into_tensor`.
    pub fn all_gather(&self, out: &mut Tensor, input: &Tensor) -> CommResult<()> {
        self.all_gather_with(out, input, self.cfg.all_gather_algo)
    }
    pub fn all_gather_with(&self, out: &mut Tensor, input: &Tensor, algo: Algo) -> CommResult<()> {
        if let Some(d) = self.stage_to(&[out, input]) {
            let (mut h, i) = (to(out, d), to(input, d));
            self.run(self.backend.all_gather(&mut h, &i, algo))?;
            copy_back(out, &h);
            return Ok(());
        }
        self.run(self.backend.all_gather(out, input, algo))
    }
    /// Non-blocking [`all_gather`](Self::all_gather): `out` comes back from [`Work::wait`];
    /// `input` is dropped when the operation is done.
    pub fn all_gather_async(&self, mut out: Tensor, input: Tensor) -> CommResult<Work<Tensor>> {
        if let Some(d) = self.stage_to(&[&out, &input]) {
            let (mut h, i) = (output_on(&out, d), to(&input, d));
            let w = self.start(self.backend.all_gather(&mut h, &i, self.cfg.all_gather_algo), h.shallow_clone())?;
            return Ok(w.replace_out(out, move |t: &mut Tensor| copy_back(t, &h)));
        }
        self.start(self.backend.all_gather(&mut out, &input, self.cfg.all_gather_algo), out)
    }

    /// Reduce `input` (world_size blocks) over all ranks and give rank r block r in `out` —
    /// torch's `reduce_scatter_tensor`.
    pub fn reduce_scatter(&self, out: &mut Tensor, input: &Tensor, op: ReduceOp) -> CommResult<()> {
        self.reduce_scatter_with(out, input, op, self.cfg.reduce_scatter_algo)
    }
    pub fn reduce_scatter_with(&self, out: &mut Tensor, input: &Tensor, op: ReduceOp, algo: Algo) -> CommResult<()> {
        if let Some(d) = self.stage_to(&[out, input]) {
            let (mut h, i) = (to(out, d), to(input, d));
            self.run(self.backend.reduce_scatter(&mut h, &i, op, algo))?;
            copy_back(out, &h);
            return Ok(());
        }
        self.run(self.backend.reduce_scatter(out, input, op, algo))
    }
    /// Non-blocking [`reduce_scatter`](Self::reduce_scatter): `out` comes back from
    /// [`Work::wait`]; `input` is dropped when the operation is done.
    pub fn reduce_scatter_async(&self, mut out: Tensor, input: Tensor, op: ReduceOp) -> CommResult<Work<Tensor>> {
        if let Some(d) = self.stage_to(&[&out, &input]) {
            let (mut h, i) = (output_on(&out, d), to(&input, d));
            let w = self
                .start(self.backend.reduce_scatter(&mut h, &i, op, self.cfg.reduce_scatter_algo), h.shallow_clone())?;
            return Ok(w.replace_out(out, move |t: &mut Tensor| copy_back(t, &h)));
        }
        self.start(self.backend.reduce_scatter(&mut out, &input, op, self.cfg.reduce_scatter_algo), out)
    }
}

/// Tensors on the wrong side for the backend: CUDA tensors through the CPU backends (local, tcp)
/// and CPU tensors through NCCL (a loss, a flag) run on a copy where the backend wants them
/// ([`super::staging`]: pinned host memory from a GPU; an output-only tensor gets an empty buffer
/// there, nothing copied across), and a tensor the operation writes is copied back afterwards (a blocking call: before it returns; an `*_async` one: in `Work::wait`,
/// on the waiting thread).
fn to(t: &Tensor, device: Device) -> Tensor {
    super::staging::stage(t, device)
}

/// Where an output-only tensor (all-gather's, reduce-scatter's) is written: itself when the
/// backend can write it in place, else an uninitialised buffer there (its old contents would be
/// overwritten: no copy across).
fn output_on(t: &Tensor, device: Device) -> Tensor {
    super::staging::output_buffer(t, device)
}

/// Copy the staged result back into the caller's tensor.
fn copy_back(dst: &mut Tensor, staged: &Tensor) {
    super::staging::unstage(dst, staged)
}

impl ProcessGroup {
    /// Where `tensors` must be copied for this group's backend; `None`: used where they are.
    fn stage_to(&self, tensors: &[&Tensor]) -> Option<Device> {
        let wrong = |t: &&Tensor| {
            t.defined()
                && match self.kind {
                    Backend::Nccl => t.device() == Device::Cpu,
                    _ => t.device() != Device::Cpu,
                }
        };
        tensors.iter().any(wrong).then(|| match self.kind {
            Backend::Nccl => Device::Cuda(self.local_rank % crate::device::cuda_devices().max(1)),
            _ => Device::Cpu,
        })
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // Crashing: tell the others first (queued work then fails fast on the poison).
        // Otherwise let queued async work finish, then say goodbye.
        let panicking = std::thread::panicking();
        if panicking {
            let rank = self.rank();
            self.backend.abort(&CommError::Aborted { by: rank, reason: format!("rank {rank} panicked") });
        }
        self.worker.stop();
        if !panicking && self.backend.poisoned().is_none() {
            self.backend.leave();
        }
    }
}
