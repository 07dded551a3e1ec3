//! The `nccl` backend (lesson 11): whole collectives on CUDA memory by NVIDIA's NCCL, behind the
//! same [`CommBackend`] seam as the host backend (see that trait's docs for the design).
//!
//! NCCL and the CUDA runtime are loaded at run time (`dlopen`), never linked: the crate builds
//! and tests on machines without them. A process whose binary links libtorch_cuda.so already has
//! both loaded (PyTorch's wheel ships `libnccl.so.2` in nvidia-nccl-cu13 and libtorch_cuda needs
//! it), and we take those; otherwise `SHARDLAB_NCCL_LIB` may name the library file.
//!
//! Point-to-point: each `send`/`recv` is its own NCCL call, so a pair of ranks must order them
//! (one sends first, the other receives first); both sending first deadlocks, where the host
//! backends buffer a send. The collectives have no such caveat.
//!
//! Not yet: non-blocking communicator creation (`ncclCommInitRankConfig`), so `init_nccl` and
//! NCCL's first connection set-up are not bounded by the rendezvous timeout; an abort is local
//! (NCCL has no message to its peers: theirs fail on NCCL's error or on the group's timeout).
//!
//! Ordering: libtorch computes on the device's legacy default stream. Each operation records an
//! event there, makes the backend's own stream wait for it (the kernels that produced the input
//! have run), enqueues the NCCL kernel on the backend's stream and records a completion event;
//! `Work::wait` polls that event, the communicator's asynchronous error and the group's timeout
//! (on a timeout or an error it aborts the communicator, as torch's NCCL watchdog does).

use super::backend::{CommBackend, CommStats, InFlight, Pending};
use super::dtype::{DType, ReduceOp};
use super::error::{CommError, CommResult};
use super::frame::OpKind;
use super::Algo;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tch::Tensor;

type Comm = *mut c_void;
type Stream = *mut c_void;
type Event = *mut c_void;

/// NCCL's 128-byte unique id: rank 0 makes it, every rank needs it to join the communicator.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId(pub [u8; 128]);

/// The functions we use, from libnccl.so.2 and libcudart.
#[allow(clippy::type_complexity)]
pub struct Lib {
    get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> c_int,
    comm_abort: unsafe extern "C" fn(Comm) -> c_int,
    comm_destroy: unsafe extern "C" fn(Comm) -> c_int,
    comm_get_async_error: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> c_int,
    reduce_scatter: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, Stream) -> c_int,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int,
    set_device: unsafe extern "C" fn(c_int) -> c_int,
    stream_create: unsafe extern "C" fn(*mut Stream, c_uint) -> c_int,
    event_create: unsafe extern "C" fn(*mut Event, c_uint) -> c_int,
    event_record: unsafe extern "C" fn(Event, Stream) -> c_int,
    event_query: unsafe extern "C" fn(Event) -> c_int,
    event_destroy: unsafe extern "C" fn(Event) -> c_int,
    stream_wait_event: unsafe extern "C" fn(Stream, Event, c_uint) -> c_int,
}

// Function pointers into loaded libraries (never unloaded).
unsafe impl Send for Lib {}
unsafe impl Sync for Lib {}

fn open(names: &[String]) -> Result<*mut c_void, String> {
    for n in names {
        let c = CString::new(n.as_str()).map_err(|e| e.to_string())?;
        // Already loaded (by libtorch_cuda) first, then the dynamic linker's search.
        for flags in [libc::RTLD_NOW | libc::RTLD_NOLOAD, libc::RTLD_NOW | libc::RTLD_LOCAL] {
            let h = unsafe { libc::dlopen(c.as_ptr(), flags) };
            if !h.is_null() {
                return Ok(h);
            }
        }
    }
    Err(format!("none of {names:?} could be loaded"))
}

fn sym<T: Copy>(h: *mut c_void, name: &str) -> Result<T, String> {
    let c = CString::new(name).expect("symbol name");
    let p = unsafe { libc::dlsym(h, c.as_ptr()) };
    if p.is_null() {
        return Err(format!("symbol {name} not found"));
    }
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    Ok(unsafe { std::mem::transmute_copy(&p) })
}

impl Lib {
    fn load() -> Result<Lib, String> {
        let mut nccl = vec!["libnccl.so.2".to_string(), "libnccl.so".to_string()];
        if let Ok(p) = std::env::var("SHARDLAB_NCCL_LIB") {
            nccl.insert(0, p);
        }
        let n = open(&nccl).map_err(|e| format!("NCCL: {e} (set SHARDLAB_NCCL_LIB to libnccl.so.2's path)"))?;
        let cudart: Vec<String> = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"].map(String::from).to_vec();
        let c = open(&cudart).map_err(|e| format!("the CUDA runtime: {e}"))?;
        Ok(Lib {
            get_version: sym(n, "ncclGetVersion")?,
            get_unique_id: sym(n, "ncclGetUniqueId")?,
            comm_init_rank: sym(n, "ncclCommInitRank")?,
            comm_abort: sym(n, "ncclCommAbort")?,
            comm_destroy: sym(n, "ncclCommDestroy")?,
            comm_get_async_error: sym(n, "ncclCommGetAsyncError")?,
            error_string: sym(n, "ncclGetErrorString")?,
            all_reduce: sym(n, "ncclAllReduce")?,
            broadcast: sym(n, "ncclBroadcast")?,
            all_gather: sym(n, "ncclAllGather")?,
            reduce_scatter: sym(n, "ncclReduceScatter")?,
            send: sym(n, "ncclSend")?,
            recv: sym(n, "ncclRecv")?,
            set_device: sym(c, "cudaSetDevice")?,
            stream_create: sym(c, "cudaStreamCreateWithFlags")?,
            event_create: sym(c, "cudaEventCreateWithFlags")?,
            event_record: sym(c, "cudaEventRecord")?,
            event_query: sym(c, "cudaEventQuery")?,
            event_destroy: sym(c, "cudaEventDestroy")?,
            stream_wait_event: sym(c, "cudaStreamWaitEvent")?,
        })
    }

    /// NCCL and the CUDA runtime, loaded once per process.
    pub fn get() -> CommResult<&'static Lib> {
        static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
        LIB.get_or_init(Lib::load).as_ref().map_err(|e| CommError::InvalidArgument(format!("nccl backend: {e}")))
    }

    /// NCCL's version code (e.g. 22803 for 2.28.3).
    pub fn version(&self) -> CommResult<i32> {
        let mut v = 0;
        self.check(unsafe { (self.get_version)(&mut v) }, "ncclGetVersion")?;
        Ok(v)
    }

    /// A fresh unique id (rank 0's job).
    pub fn unique_id(&self) -> CommResult<UniqueId> {
        let mut id = UniqueId([0; 128]);
        self.check(unsafe { (self.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
        Ok(id)
    }

    fn check(&self, r: c_int, what: &str) -> CommResult<()> {
        if r == 0 {
            return Ok(());
        }
        let msg = unsafe { CStr::from_ptr((self.error_string)(r)) }.to_string_lossy().into_owned();
        Err(CommError::Io(format!("{what}: NCCL error {r}: {msg}")))
    }
}

/// Rank 0's NCCL unique id, handed to every rank through the job's authenticated store under
/// `key` (lesson 11; one key per communicator: a subgroup or a restarted generation has its own).
/// Rank 0 calls `make` (ncclGetUniqueId) and publishes `id:` followed by the 128 bytes; if `make`
/// fails it publishes `error:` and the reason, so every rank fails at once with it instead of
/// waiting out `timeout`. The others wait up to `timeout` for the value. Rank 0 returns its own id.
pub fn share_unique_id(
    store: &mut super::store::StoreClient,
    rank: usize,
    key: &str,
    make: impl FnOnce() -> CommResult<UniqueId>,
    timeout: Duration,
) -> CommResult<UniqueId> {
    if rank == 0 {
        return match make() {
            Ok(id) => {
                store.set(key, &[&b"id:"[..], &id.0[..]].concat())?;
                Ok(id)
            }
            Err(e) => {
                store.set(key, format!("error:{e}").as_bytes())?;
                Err(e)
            }
        };
    }
    let v = store.get(key, timeout)?.ok_or_else(|| {
        CommError::Rendezvous(format!("rank {rank}: rank 0 did not publish the NCCL id ({key}) within {timeout:?}"))
    })?;
    if let Some(why) = v.strip_prefix(b"error:") {
        return Err(CommError::Rendezvous(format!(
            "rank {rank}: rank 0 could not make the NCCL id: {}",
            String::from_utf8_lossy(why)
        )));
    }
    match v.strip_prefix(b"id:").map(<[u8; 128]>::try_from) {
        Some(Ok(id)) => Ok(UniqueId(id)),
        _ => Err(CommError::Protocol(format!(
            "rank {rank}: {key} in the store is not an NCCL id (`id:` and 128 bytes; {} bytes)",
            v.len()
        ))),
    }
}

fn cuda(r: c_int, what: &str) -> CommResult<()> {
    if r == 0 {
        Ok(())
    } else {
        Err(CommError::Io(format!("{what}: CUDA error {r}")))
    }
}

/// NCCL's data type for ours.
fn nccl_type(d: DType) -> c_int {
    match d {
        DType::I64 => 4,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::BF16 => 9,
    }
}

fn nccl_op(op: ReduceOp) -> c_int {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Avg => 4,
    }
}

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
        if let Some(e) = super::relock(&self.poison).clone() {
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

impl Running {
    /// Poll until the operation finished, failed, or ran out of time (then abort the communicator).
    fn finish(&mut self) -> CommResult<()> {
        if self.finished {
            return Ok(());
        }
        let fail = |me: &Self, e: CommError| {
            me.comm.end(me.lib, false);
            super::relock(&me.poison).get_or_insert(e).clone()
        };
        let mut spins = 0u32;
        let r = loop {
            // A poisoned group first: an aborted kernel's event completes too, on half-done data.
            if let Some(e) = super::relock(&self.poison).clone() {
                break Err(e);
            }
            match unsafe { (self.lib.event_query)(self.done) } {
                0 => break Ok(()),
                600 => {}
                e => break Err(fail(self, CommError::Io(format!("{}: CUDA error {e} while waiting", self.what)))),
            }
            let mut async_err = 0;
            match self.comm.get() {
                Some(c) => unsafe {
                    (self.lib.comm_get_async_error)(c, &mut async_err);
                },
                None => break Err(CommError::Io(format!("{}: the NCCL communicator was aborted", self.what))),
            }
            if async_err != 0 {
                let msg = unsafe { CStr::from_ptr((self.lib.error_string)(async_err)) }.to_string_lossy().into_owned();
                break Err(fail(self, CommError::Io(format!("{}: NCCL reported {msg} (a peer failed?)", self.what))));
            }
            if Instant::now() > self.deadline {
                break Err(fail(
                    self,
                    CommError::Io(format!(
                        "{}: not finished within the group's timeout ({:?}); NCCL communicator aborted (a rank died, \
                         or the ranks called different collectives?)",
                        self.what, self.timeout
                    )),
                ));
            }
            // Spin briefly (most operations finish within microseconds of their kernel), then sleep.
            spins += 1;
            if spins < 200 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        };
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
        let (p, f) = (t.data_ptr(), self.lib.all_reduce);
        // A ring all-reduce sends 2(N−1)/N of the buffer per rank.
        let bytes = (2 * (self.world - 1) * n * d.size() / self.world.max(1)) as u64;
        self.enqueue(
            OpKind::AllReduce,
            bytes,
            vec![t.shallow_clone()],
            |comm, s| unsafe { f(p, p, n, nccl_type(d), nccl_op(op), comm, s) },
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
        let bytes = ((self.world - 1) * m * d.size()) as u64;
        self.enqueue(
            OpKind::ReduceScatter,
            bytes,
            vec![input.shallow_clone(), out.shallow_clone()],
            |comm, s| unsafe { f(i, o, m, nccl_type(d), nccl_op(op), comm, s) },
            "reduce_scatter",
        )
    }
    fn check_stray(&self) -> CommResult<Pending> {
        Ok(Pending::deferred(|| Ok(()))) // NCCL keeps no frames to look at
    }
    fn poisoned(&self) -> Option<CommError> {
        super::relock(&self.poison).clone()
    }
    fn abort(&self, err: &CommError) {
        super::relock(&self.poison).get_or_insert_with(|| err.clone());
        // Local only: NCCL has no message to its peers; their operations fail on NCCL's own
        // error or on the group's timeout.
        self.comm.end(self.lib, false);
    }
    fn leave(&self) {
        // ncclCommDestroy synchronises with the peers' destroys: only a healthy group does it.
        if super::relock(&self.poison).is_some() {
            self.comm.end(self.lib, false);
        } else {
            self.comm.end(self.lib, true);
        }
    }
}
