//! The backend itself: [`NcclBackend`], one rank's NCCL communicator with its own CUDA stream;
//! each operation is ordered after libtorch's stream by an event, enqueued on ours, and handed
//! back as a `Running` operation whose completion event `Work::wait` polls (with the
//! communicator's asynchronous error and the group's timeout).

use super::ffi::{cuda, nccl_type, Comm, Event, Lib, Stream, UniqueId};
use super::wait::{wait_for, Completion, Polled};
use crate::comm::backend::{CommBackend, CommStats, InFlight, Pending};
use crate::comm::dtype::{DType, ReduceOp};
use crate::comm::error::{CommError, CommResult};
use crate::comm::frame::OpKind;
use crate::comm::Algo;
use std::ffi::{c_int, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tch::Tensor;

/// The communicator handle, `None` once aborted or destroyed (NCCL frees it then): every use
/// takes the read lock, abort and destroy the write lock.
struct Handle(std::sync::RwLock<Option<usize>>);

impl Handle {
    fn get(&self) -> Option<Comm> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).map(|c| c as Comm)
    }
    /// Abort (or destroy) it once; later calls do nothing.
    fn end(&self, lib: &Lib, destroy: bool) {
        let mut g = self.0.write().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = g.take() {
            unsafe {
                if destroy {
                    (lib.comm_destroy)(c as Comm);
                } else {
                    (lib.comm_abort)(c as Comm);
                }
            }
        }
    }
}

/// One rank's NCCL communicator.
pub struct NcclBackend {
    lib: &'static Lib,
    comm: Arc<Handle>,
    stream: Stream,
    rank: usize,
    world: usize,
    device: usize,
    timeout: Duration,
    poison: Arc<Mutex<Option<CommError>>>,
    sent: AtomicU64,
    calls: [AtomicU64; 7],
}

// The communicator and stream handles are used from the rank's threads one operation at a time
// (the group's contract); NCCL allows that.
unsafe impl Send for NcclBackend {}
unsafe impl Sync for NcclBackend {}

impl NcclBackend {
    /// Join the communicator `id` as `rank` of `world` on CUDA device `device`.
    pub fn new(id: UniqueId, rank: usize, world: usize, device: usize, timeout: Duration) -> CommResult<Self> {
        let lib = Lib::get()?;
        cuda(unsafe { (lib.set_device)(device as c_int) }, "cudaSetDevice")?;
        let mut stream: Stream = std::ptr::null_mut();
        cuda(unsafe { (lib.stream_create)(&mut stream, 1) }, "cudaStreamCreateWithFlags")?; // non-blocking
        let mut comm: Comm = std::ptr::null_mut();
        lib.check(unsafe { (lib.comm_init_rank)(&mut comm, world as c_int, id, rank as c_int) }, "ncclCommInitRank")?;
        Ok(NcclBackend {
            lib,
            comm: Arc::new(Handle(std::sync::RwLock::new(Some(comm as usize)))),
            stream,
            rank,
            world,
            device,
            timeout,
            poison: Arc::new(Mutex::new(None)),
            sent: AtomicU64::new(0),
            calls: Default::default(),
        })
    }

    /// Check a tensor at call time: a contiguous CUDA tensor on our device, of a dtype NCCL has.
    fn check_tensor(&self, t: &Tensor, what: &str) -> CommResult<(DType, usize)> {
        if !t.defined() {
            return Err(CommError::InvalidArgument(format!("{what}: tensor is undefined")));
        }
        if t.device() != tch::Device::Cuda(self.device) {
            return Err(CommError::InvalidArgument(format!(
                "{what}: tensor is on {:?}; this nccl group moves tensors on cuda:{}",
                t.device(),
                self.device
            )));
        }
        if !t.is_contiguous() {
            return Err(CommError::InvalidArgument(format!("{what}: tensor is not contiguous")));
        }
        let d = DType::from_kind(t.kind())?;
        Ok((d, t.numel()))
    }

    fn no_algo(&self, what: &str, algo: Algo) -> CommResult<()> {
        match algo {
            Algo::Auto => Ok(()),
            a => Err(CommError::InvalidArgument(format!(
                "{what}: the nccl backend chooses its own algorithm, not {a:?}"
            ))),
        }
    }

    /// Order after the caller's stream, enqueue `launch` on ours, and hand back the completion.
    fn enqueue(
        &self,
        op: OpKind,
        bytes: u64,
        keep: Vec<Tensor>,
        launch: impl FnOnce(Comm, Stream) -> c_int,
        what: &str,
    ) -> CommResult<Pending> {
        if let Some(e) = crate::comm::relock(&self.poison).clone() {
            return Err(e);
        }
        let lib = self.lib;
        // Events and the legacy stream belong to the calling thread's current device.
        cuda(unsafe { (lib.set_device)(self.device as c_int) }, "cudaSetDevice")?;
        let guard = self.comm.0.read().unwrap_or_else(|p| p.into_inner());
        let Some(comm) = guard.map(|c| c as Comm) else {
            return Err(CommError::Io(format!("{what}: the NCCL communicator was aborted")));
        };
        let mut ready: Event = std::ptr::null_mut();
        cuda(unsafe { (lib.event_create)(&mut ready, 2) }, "cudaEventCreateWithFlags")?; // no timing
                                                                                         // The legacy default stream (0): where libtorch put the kernels that made the input.
        cuda(unsafe { (lib.event_record)(ready, std::ptr::null_mut()) }, "cudaEventRecord")?;
        cuda(unsafe { (lib.stream_wait_event)(self.stream, ready, 0) }, "cudaStreamWaitEvent")?;
        unsafe { (lib.event_destroy)(ready) };
        lib.check(launch(comm, self.stream), what)?;
        drop(guard);
        let mut done: Event = std::ptr::null_mut();
        cuda(unsafe { (lib.event_create)(&mut done, 2) }, "cudaEventCreateWithFlags")?;
        cuda(unsafe { (lib.event_record)(done, self.stream) }, "cudaEventRecord")?;
        self.calls[op as usize].fetch_add(1, Ordering::Relaxed);
        self.sent.fetch_add(bytes, Ordering::Relaxed);
        Ok(Pending::in_flight(Running {
            lib,
            done,
            comm: self.comm.clone(),
            keep,
            deadline: Instant::now() + self.timeout,
            timeout: self.timeout,
            poison: self.poison.clone(),
            what: what.to_string(),
            finished: false,
        }))
    }
}

/// An enqueued NCCL operation.
struct Running {
    lib: &'static Lib,
    done: Event,
    comm: Arc<Handle>,
    /// The tensors it reads and writes, alive until it finished.
    #[allow(dead_code)]
    keep: Vec<Tensor>,
    deadline: Instant,
    timeout: Duration,
    poison: Arc<Mutex<Option<CommError>>>,
    what: String,
    /// Waited for (the event is destroyed then).
    finished: bool,
}

unsafe impl Send for Running {}
unsafe impl Sync for Running {}

impl InFlight for Running {
    fn is_done(&self) -> bool {
        unsafe { (self.lib.event_query)(self.done) != 600 } // cudaErrorNotReady
    }
    fn wait(mut self: Box<Self>) -> CommResult<()> {
        self.finish()
    }
}

impl Completion for Running {
    fn query(&self) -> Polled {
        match unsafe { (self.lib.event_query)(self.done) } {
            0 => Polled::Done,
            600 => Polled::Pending, // cudaErrorNotReady
            e => Polled::Failed(e),
        }
    }
    fn async_error(&self) -> Result<Option<String>, ()> {
        let c = self.comm.get().ok_or(())?;
        let mut err = 0;
        unsafe { (self.lib.comm_get_async_error)(c, &mut err) };
        Ok((err != 0).then(|| unsafe { CStr::from_ptr((self.lib.error_string)(err)) }.to_string_lossy().into_owned()))
    }
    fn abort(&self) {
        self.comm.end(self.lib, false);
    }
}

impl Running {
    /// Wait until the operation finished, failed, or ran out of time (`wait.rs`: then poison the
    /// group and abort the communicator).
    fn finish(&mut self) -> CommResult<()> {
        if self.finished {
            return Ok(());
        }
        let r = wait_for(self, &self.poison, self.deadline, self.timeout, &self.what);
        unsafe { (self.lib.event_destroy)(self.done) };
        self.finished = true;
        r
    }
}

impl Drop for Running {
    /// A `Work` dropped without `wait`: the kernel may still read or write the tensors, so they
    /// stay alive until it finished (or the communicator is aborted).
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

impl Drop for NcclBackend {
    /// The communicator (aborted if the group did not leave cleanly) and the stream it ran on
    /// (CUDA frees it once the work enqueued there has finished): a subgroup made and dropped
    /// leaks neither.
    fn drop(&mut self) {
        self.comm.end(self.lib, false);
        unsafe { (self.lib.stream_destroy)(self.stream) };
    }
}

impl CommBackend for NcclBackend {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn data_path(&self) -> &'static str {
        "nccl"
    }
    fn stats(&self) -> CommStats {
        let mut per_op = [0; 7];
        for (i, c) in self.calls.iter().enumerate() {
            per_op[i] = c.load(Ordering::Relaxed);
        }
        let p2p = per_op[OpKind::P2p as usize];
        CommStats {
            bytes_sent: self.sent.load(Ordering::Relaxed),
            bytes_received: 0,
            collectives: per_op.iter().sum::<u64>() - p2p,
            p2p,
            per_op,
        }
    }
    fn resolve(&self, _op: OpKind, _algo: Algo) -> Algo {
        Algo::Auto
    }
    fn barrier(&self) -> CommResult<Pending> {
        // A one-element all-reduce on the device, as torch's NCCL barrier does.
        let t = Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cuda(self.device)));
        let p = t.data_ptr();
        let f = self.lib.all_reduce;
        self.enqueue(OpKind::Barrier, 0, vec![t], |comm, s| unsafe { f(p, p, 1, 7, 0, comm, s) }, "barrier")
    }
    fn send(&self, t: &Tensor, dst: usize) -> CommResult<Pending> {
        let (d, n) = self.check_tensor(t, "send")?;
        let (p, f) = (t.data_ptr(), self.lib.send);
        let bytes = (n * d.size()) as u64;
        self.enqueue(
            OpKind::P2p,
            bytes,
            vec![t.shallow_clone()],
            |comm, s| unsafe { f(p, n, nccl_type(d), dst as c_int, comm, s) },
            "send",
        )
    }
    fn recv(&self, t: &mut Tensor, src: usize) -> CommResult<Pending> {
        let (d, n) = self.check_tensor(t, "recv")?;
        let (p, f) = (t.data_ptr(), self.lib.recv);
        self.enqueue(
            OpKind::P2p,
            0,
            vec![t.shallow_clone()],
            |comm, s| unsafe { f(p, n, nccl_type(d), src as c_int, comm, s) },
            "recv",
        )
    }
    fn broadcast(&self, t: &mut Tensor, root: usize, algo: Algo) -> CommResult<Pending> {
        self.no_algo("broadcast", algo)?;
        let (d, n) = self.check_tensor(t, "broadcast")?;
        let (p, f) = (t.data_ptr(), self.lib.broadcast);
        let bytes = if root == self.rank { (n * d.size()) as u64 } else { 0 };
        self.enqueue(
            OpKind::Broadcast,
            bytes,
            vec![t.shallow_clone()],
            |comm, s| unsafe { f(p, p, n, nccl_type(d), root as c_int, comm, s) },
            "broadcast",
        )
    }
    fn all_reduce(&self, t: &mut Tensor, op: ReduceOp, algo: Algo) -> CommResult<Pending> {
        self.no_algo("all_reduce", algo)?;
        let (d, n) = self.check_tensor(t, "all_reduce")?;
        if op == ReduceOp::Avg && d == DType::I64 {
            return Err(CommError::InvalidArgument("all_reduce: Avg needs a floating-point dtype".into()));
        }
        let (p, f, o) = (t.data_ptr(), self.lib.all_reduce, self.lib.reduce_op(op, "all_reduce")?);
        // A ring all-reduce sends 2(N−1)/N of the buffer per rank.
        let bytes = (2 * (self.world - 1) * n * d.size() / self.world.max(1)) as u64;
        self.enqueue(
            OpKind::AllReduce,
            bytes,
            vec![t.shallow_clone()],
            |comm, s| unsafe { f(p, p, n, nccl_type(d), o, comm, s) },
            "all_reduce",
        )
    }
    fn all_gather(&self, out: &mut Tensor, input: &Tensor, algo: Algo) -> CommResult<Pending> {
        self.no_algo("all_gather", algo)?;
        let (d, n) = self.check_tensor(input, "all_gather input")?;
        let (d2, m) = self.check_tensor(out, "all_gather output")?;
        if d2 != d || m != n * self.world {
            return Err(CommError::InvalidArgument(format!(
                "all_gather: the output must have world_size × {n} elements of the input's dtype (got {m} of {d2:?})"
            )));
        }
        let (i, o, f) = (input.data_ptr(), out.data_ptr(), self.lib.all_gather);
        let bytes = ((self.world - 1) * n * d.size()) as u64;
        self.enqueue(
            OpKind::AllGather,
            bytes,
            vec![input.shallow_clone(), out.shallow_clone()],
            |comm, s| unsafe { f(i, o, n, nccl_type(d), comm, s) },
            "all_gather",
        )
    }
    fn reduce_scatter(&self, out: &mut Tensor, input: &Tensor, op: ReduceOp, algo: Algo) -> CommResult<Pending> {
        self.no_algo("reduce_scatter", algo)?;
        let (d, n) = self.check_tensor(input, "reduce_scatter input")?;
        let (d2, m) = self.check_tensor(out, "reduce_scatter output")?;
        if d2 != d || n != m * self.world {
            return Err(CommError::InvalidArgument(format!(
                "reduce_scatter: the input must have world_size × {m} elements of the output's dtype (got {n} of {d:?})"
            )));
        }
        let (i, o, f) = (input.data_ptr(), out.data_ptr(), self.lib.reduce_scatter);
        let rop = self.lib.reduce_op(op, "reduce_scatter")?;
        let bytes = ((self.world - 1) * m * d.size()) as u64;
        self.enqueue(
            OpKind::ReduceScatter,
            bytes,
            vec![input.shallow_clone(), out.shallow_clone()],
            |comm, s| unsafe { f(i, o, m, nccl_type(d), rop, comm, s) },
            "reduce_scatter",
        )
    }
    fn check_stray(&self) -> CommResult<Pending> {
        Ok(Pending::deferred(|| Ok(()))) // NCCL keeps no frames to look at
    }
    fn poisoned(&self) -> Option<CommError> {
        crate::comm::relock(&self.poison).clone()
    }
    fn abort(&self, err: &CommError) {
        crate::comm::relock(&self.poison).get_or_insert_with(|| err.clone());
        // Local only: NCCL has no message to its peers; their operations fail on NCCL's own
        // error or on the group's timeout.
        self.comm.end(self.lib, false);
    }
    fn leave(&self) {
        // ncclCommDestroy synchronises with the peers' destroys: only a healthy group does it.
        if crate::comm::relock(&self.poison).is_some() {
            self.comm.end(self.lib, false);
        } else {
            self.comm.end(self.lib, true);
        }
    }
}
