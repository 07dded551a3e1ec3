//! The communication layer: a Gloo-style [`ProcessGroup`] with point-to-point and collective
//! operations on CPU tensors, over two backends:
//!
//! * [`Backend::Local`] — ranks are threads of one process (shared memory); notebooks and fast tests.
//! * [`Backend::Tcp`] — ranks are processes on one or several machines, rendezvous through a TCP
//!   store at MASTER_ADDR:MASTER_PORT exactly as torchrun sets it up.
//!
//! Every operation is checked across ranks (kind, order, dtype, size, root, algorithm travel in each
//! frame's header) and every failure — bad arguments, a dead or silent peer, ranks that disagree —
//! becomes a [`CommError`] on every rank instead of a hang. After a failure the group is poisoned:
//! later calls return the same error. Data that no operation asked for is caught when the next
//! operation reads it, or by [`ProcessGroup::finish`] (which [`crate::launch::spawn`] runs after
//! every rank's work).
//!
//! ```no_run
//! use shardlab::prelude::*;
//! let out = spawn(4, Backend::Local, |pg| {
//!     let mut t = Tensor::from_slice(&[pg.rank() as f32]);
//!     pg.all_reduce(&mut t, ReduceOp::Sum)?;           // t = [0+1+2+3]
//!     Ok(t.double_value(&[0]))
//! }).unwrap();
//! assert_eq!(out, vec![6.0; 4]);
//! ```

pub mod algo;
pub mod auth;
pub mod dtype;
pub mod error;
pub(crate) mod frame;
pub(crate) mod local;
pub mod store;
pub(crate) mod tcp;
pub(crate) mod transport;

pub use algo::{binomial_tree, segment};
pub use dtype::{DType, ReduceOp};
pub use error::{CommError, CommResult};
pub use frame::OpKind;

use algo::{Counters, Ctx};
use frame::{BufPool, OpDesc};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tch::Tensor;
use transport::Transport;

/// Which backend carries the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
pub enum Backend {
    /// Ranks are threads of one process; frames move through shared memory.
    Local,
    /// Ranks are processes (possibly on several machines) connected by TCP.
    Tcp,
}

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
    /// Algorithms implemented for `op`.
    pub fn supported(op: OpKind) -> &'static [Algo] {
        match op {
            OpKind::Broadcast => &[Algo::Naive, Algo::Tree, Algo::Ring, Algo::Direct],
            OpKind::AllReduce | OpKind::AllGather | OpKind::ReduceScatter => &[Algo::Naive, Algo::Ring, Algo::Direct],
            OpKind::Barrier | OpKind::Send => &[Algo::Naive],
        }
    }
}

/// Tunables of a process group. `CommConfig::default()` reads the `SHARDLAB_*` environment
/// variables named on each field.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CommConfig {
    /// How long to wait for a peer's next frame before failing (`SHARDLAB_TIMEOUT_S`, default 300).
    pub timeout: Duration,
    /// How long ranks may take to find each other (`SHARDLAB_RDZV_TIMEOUT_S`, default 60).
    pub rendezvous_timeout: Duration,
    /// Largest frame payload; big messages are split and pipelined (`SHARDLAB_CHUNK_BYTES`, default 1 MiB).
    pub chunk_bytes: usize,
    /// Ranks of other jobs are refused (`SHARDLAB_JOB_ID`, else `TORCHELASTIC_RUN_ID`, else "shardlab").
    pub job_id: String,
    /// Address rank 0's store listens on (`SHARDLAB_STORE_BIND`, default 127.0.0.1; use 0.0.0.0
    /// when ranks run on several machines).
    pub store_bind: String,
    /// Default algorithm per operation.
    pub all_reduce_algo: Algo,
    pub broadcast_algo: Algo,
    pub all_gather_algo: Algo,
    pub reduce_scatter_algo: Algo,
    /// The job's shared secret, which every TCP connection of the job proves it knows
    /// (`SHARDLAB_SECRET`, 64 hex digits). `None`: [`crate::launch::spawn`] generates one;
    /// `init_tcp` without one derives it from the job id on loopback-only jobs (with a warning)
    /// and refuses otherwise — see [`auth`]. Its `Debug` is redacted.
    #[serde(default)]
    pub secret: Option<auth::Secret>,
    /// How process ranks on the same machine move data (`SHARDLAB_TRANSPORT`, default `auto`).
    #[serde(default)]
    pub transport: DataPath,
    /// Bytes of each of a rank's two shared-memory exchange buffers, used by the direct
    /// algorithms (`SHARDLAB_SHM_EXCHANGE`, default 8 MiB); larger messages go in chunks. Ranks
    /// chunk by the smallest buffer of the group.
    #[serde(default = "default_exchange")]
    pub shm_exchange_bytes: usize,
    /// A failure to inject, for the failure tests (`None` in real jobs).
    #[doc(hidden)]
    #[serde(default)]
    pub fault: Option<Fault>,
}

/// How the `tcp` backend moves data between process ranks on the same machine. Ranks on different
/// machines always use TCP; the control connections (aborts, goodbyes) are TCP everywhere.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum DataPath {
    /// Shared memory between ranks on one machine when both can, else TCP.
    #[default]
    Auto,
    /// TCP sockets only (loopback between ranks on one machine).
    Tcp,
    /// Shared memory between ranks on one machine, or a rendezvous error saying why not.
    Shm,
}

/// A failure to inject (failure tests only): rank `rank` fails after it has sent `after_bytes`
/// payload bytes in collective number `seq` (0-based, counting every collective of the group,
/// the barrier that ends rendezvous included) — in the middle of a frame when `after_bytes`
/// falls inside one. `kill`: the process SIGKILLs itself; else the rank aborts (its process
/// stays alive). TCP backend only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fault {
    pub rank: usize,
    pub seq: u64,
    pub after_bytes: usize,
    pub kill: bool,
}

/// Lock a mutex whose data stays valid even if a holder panicked (buffers, flags, the poison
/// slot): a panic in one operation must not turn every later call into a panic.
pub(crate) fn relock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn env_num<T: std::str::FromStr>(name: &str) -> Option<T> {
    let v = std::env::var(name).ok()?;
    match v.trim().parse() {
        Ok(x) => Some(x),
        Err(_) => {
            eprintln!("shardlab: ignoring {name}={v:?} (not a number)");
            None
        }
    }
}

/// Seconds from the environment: finite, positive and at most a day, else the default.
fn env_secs(name: &str, default: f64) -> Duration {
    match env_num::<f64>(name) {
        Some(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => Duration::from_secs_f64(s),
        Some(s) => {
            eprintln!("shardlab: ignoring {name}={s} (must be in (0, 86400] seconds)");
            Duration::from_secs_f64(default)
        }
        None => Duration::from_secs_f64(default),
    }
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            timeout: env_secs("SHARDLAB_TIMEOUT_S", 300.0),
            rendezvous_timeout: env_secs("SHARDLAB_RDZV_TIMEOUT_S", 60.0),
            chunk_bytes: env_num("SHARDLAB_CHUNK_BYTES").unwrap_or(1 << 20),
            job_id: std::env::var("SHARDLAB_JOB_ID")
                .or_else(|_| std::env::var("TORCHELASTIC_RUN_ID"))
                .unwrap_or_else(|_| "shardlab".into()),
            store_bind: std::env::var("SHARDLAB_STORE_BIND").unwrap_or_else(|_| "127.0.0.1".into()),
            all_reduce_algo: Algo::Auto,
            broadcast_algo: Algo::Auto,
            all_gather_algo: Algo::Auto,
            reduce_scatter_algo: Algo::Auto,
            secret: auth::Secret::from_env().ok().flatten(),
            transport: match std::env::var("SHARDLAB_TRANSPORT").as_deref() {
                Ok("tcp") => DataPath::Tcp,
                Ok("shm") => DataPath::Shm,
                Ok("auto") | Err(_) => DataPath::Auto,
                Ok(other) => {
                    eprintln!("shardlab: ignoring SHARDLAB_TRANSPORT={other:?} (auto, tcp or shm)");
                    DataPath::Auto
                }
            },
            shm_exchange_bytes: env_num("SHARDLAB_SHM_EXCHANGE").unwrap_or_else(default_exchange),
            fault: None,
        }
    }
}

fn default_exchange() -> usize {
    8 << 20
}

impl CommConfig {
    /// Same config with another peer timeout (tests use short ones).
    pub fn with_timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self.rendezvous_timeout = self.rendezvous_timeout.min(t.max(Duration::from_secs(1)) * 4);
        self
    }
    fn validate(&self) -> CommResult<()> {
        if !(4096..=1 << 30).contains(&self.shm_exchange_bytes) {
            return Err(CommError::InvalidArgument(format!(
                "shm_exchange_bytes must be between 4096 and 1 GiB (got {})",
                self.shm_exchange_bytes
            )));
        }
        if self.chunk_bytes < 8 || self.chunk_bytes > frame::MAX_FRAME {
            return Err(CommError::InvalidArgument(format!(
                "chunk_bytes must be between 8 and {} (got {})",
                frame::MAX_FRAME,
                self.chunk_bytes
            )));
        }
        let day = Duration::from_secs(86_400);
        if self.timeout.is_zero()
            || self.timeout > day
            || self.rendezvous_timeout.is_zero()
            || self.rendezvous_timeout > day
        {
            return Err(CommError::InvalidArgument("timeouts must be positive and at most a day".into()));
        }
        Ok(())
    }
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
}

struct State {
    seq: u64,
    p2p_sent: Vec<u64>,
    p2p_recv: Vec<u64>,
}

struct Inner {
    t: Box<dyn Transport>,
    rank: usize,
    n: usize,
    backend: Backend,
    cfg: CommConfig,
    state: Mutex<State>,
    pending: AtomicUsize,
    counters: Counters,
    pool: Arc<BufPool>,
}

type Job = Box<dyn FnOnce(&Inner) + Send>;

/// A group of `world_size` ranks that communicate; each rank holds its own `ProcessGroup`.
///
/// Collectives must be called by every rank in the same order with matching arguments (as in
/// torch.distributed); any disagreement is detected and reported on every rank.
pub struct ProcessGroup {
    inner: Arc<Inner>,
    worker: Mutex<Option<(crossbeam_channel::Sender<Job>, std::thread::JoinHandle<()>)>>,
    local_rank: usize,
    local_world_size: usize,
    _store: Option<store::StoreServer>,
}

/// Handle of an operation started with one of the `*_async` methods; [`Work::wait`] blocks until it
/// is done and hands back the tensor the operation wrote (`T`).
///
/// The `*_async` methods take their tensors by value, so safe code cannot touch them while the
/// communication thread reads and writes their memory: the output comes back from `wait`, the
/// input is dropped when the operation is done. (A `shallow_clone` made *before* the call still
/// aliases the storage — that is an explicit choice of the caller, and it must not be written
/// through until `wait` returns.) A `Work` dropped without `wait` lets the operation finish in
/// the background; its tensors are freed then.
#[must_use = "wait on the Work to get the result (and to see its error)"]
pub struct Work<T = ()> {
    rx: crossbeam_channel::Receiver<(CommResult<()>, Instant, Instant)>,
    out: T,
}

/// When an asynchronous operation actually ran on the communication thread.
#[derive(Clone, Copy, Debug)]
pub struct WorkTiming {
    pub started: Instant,
    pub finished: Instant,
}

impl<T> Work<T> {
    /// Block until the operation finished; its result (the tensor it wrote) or its error.
    pub fn wait(self) -> CommResult<T> {
        self.wait_timed().map(|(out, _)| out)
    }
    /// [`wait`](Self::wait), also saying when the operation started and finished on the
    /// communication thread (to measure how much communication overlapped compute).
    pub fn wait_timed(self) -> CommResult<(T, WorkTiming)> {
        match self.rx.recv() {
            Ok((r, started, finished)) => r.map(|_| (self.out, WorkTiming { started, finished })),
            Err(_) => Err(CommError::Io("communication thread stopped".into())),
        }
    }
    /// True once the operation finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        !self.rx.is_empty()
    }
}

struct OpSpec {
    op: OpKind,
    dtype: DType,
    numel: usize,
    root: usize,
    reduce: Option<ReduceOp>,
    algo: Algo,
    peer: Option<usize>,
}

impl Inner {
    /// Run one operation on this thread: checks, sequence number, the algorithm, and on any
    /// failure poison the group and tell the peers.
    fn exec(&self, spec: OpSpec, body: impl FnOnce(&Ctx) -> CommResult<()>) -> CommResult<()> {
        let mut st = self.state.lock().map_err(|_| {
            let e = CommError::Io(format!(
                "rank {}: an earlier operation panicked inside the communication layer; this group is unusable ({} refused)",
                self.rank,
                spec.op.name()
            ));
            self.t.abort(&e);
            e
        })?;
        if let Some(e) = self.t.poisoned() {
            return Err(e);
        }
        let res = (|| {
            if !Algo::supported(spec.op).contains(&spec.algo) {
                return Err(CommError::InvalidArgument(format!(
                    "{} has no {:?} algorithm (supported: {:?})",
                    spec.op.name(),
                    spec.algo,
                    Algo::supported(spec.op)
                )));
            }
            if spec.reduce == Some(ReduceOp::Avg) && spec.dtype == DType::I64 {
                return Err(CommError::InvalidArgument(format!(
                    "{}: Avg is not defined for i64 tensors",
                    spec.op.name()
                )));
            }
            let seq = match (spec.op, spec.peer) {
                (OpKind::Send, Some(p)) => {
                    let c = if spec.root == self.rank { &mut st.p2p_sent[p] } else { &mut st.p2p_recv[p] };
                    *c += 1;
                    *c - 1
                }
                _ => {
                    st.seq += 1;
                    st.seq - 1
                }
            };
            let es = spec.dtype.size();
            let desc = OpDesc {
                op: spec.op,
                seq,
                dtype: spec.dtype,
                numel: spec.numel as u64,
                root: spec.root as u32,
                reduce: spec.reduce,
                algo: spec.algo as u8,
            };
            let ctx = Ctx {
                t: &*self.t,
                rank: self.rank,
                n: self.n,
                desc,
                timeout: self.cfg.timeout,
                chunk: (self.cfg.chunk_bytes / es).max(1) * es,
                counters: &self.counters,
                pool: &self.pool,
            };
            body(&ctx)
        })();
        match &res {
            Err(e) => self.t.abort(e),
            Ok(()) if spec.op == OpKind::Send => _ = self.counters.p2p.fetch_add(1, Ordering::Relaxed),
            Ok(()) => _ = self.counters.collectives.fetch_add(1, Ordering::Relaxed),
        }
        res
    }

    fn check_rank(&self, what: &str, r: usize) -> CommResult<()> {
        if r >= self.n {
            let e = CommError::InvalidArgument(format!("{what} rank {r} is out of range for world size {}", self.n));
            self.t.abort(&e);
            return Err(e);
        }
        Ok(())
    }
}

impl ProcessGroup {
    fn new(
        t: Box<dyn Transport>,
        backend: Backend,
        cfg: CommConfig,
        local: (usize, usize),
        store: Option<store::StoreServer>,
    ) -> Self {
        let (rank, n) = (t.rank(), t.world_size());
        ProcessGroup {
            inner: Arc::new(Inner {
                t,
                rank,
                n,
                backend,
                cfg,
                state: Mutex::new(State { seq: 0, p2p_sent: vec![0; n], p2p_recv: vec![0; n] }),
                pending: AtomicUsize::new(0),
                counters: Counters::default(),
                pool: BufPool::new(),
            }),
            worker: Mutex::new(None),
            local_rank: local.0,
            local_world_size: local.1,
            _store: store,
        }
    }

    /// `world_size` ranks as threads of this process: returns one group per rank; move each into
    /// its own thread (see [`crate::launch::spawn`] which does this for you).
    pub fn local_world(world_size: usize, cfg: CommConfig) -> CommResult<Vec<ProcessGroup>> {
        if world_size == 0 {
            return Err(CommError::InvalidArgument("world_size must be at least 1".into()));
        }
        cfg.validate()?;
        Ok(local::local_world(world_size)
            .into_iter()
            .enumerate()
            .map(|(r, t)| ProcessGroup::new(Box::new(t), Backend::Local, cfg.clone(), (r, world_size), None))
            .collect())
    }

    /// Join a TCP group: rank 0 hosts the store at `master_addr:master_port`, every rank connects
    /// to it, publishes its data address and connects to every other rank.
    pub fn init_tcp(init: &TcpInit, mut cfg: CommConfig) -> CommResult<ProcessGroup> {
        let (rank, n) = (init.rank, init.world_size);
        if n == 0 {
            return Err(CommError::InvalidArgument("WORLD_SIZE must be at least 1".into()));
        }
        if rank >= n {
            return Err(CommError::InvalidArgument(format!("RANK {rank} is out of range for WORLD_SIZE {n}")));
        }
        cfg.validate()?;
        let secret = auth::job_secret(&cfg, rank, &init.master_addr, init.master_port)?;
        cfg.secret = Some(secret.clone());
        let master = format!("{}:{}", init.master_addr, init.master_port);
        let server = if rank == 0 {
            let ip: std::net::IpAddr = cfg.store_bind.parse().map_err(|_| {
                CommError::InvalidArgument(format!("SHARDLAB_STORE_BIND {:?} is not an IP address", cfg.store_bind))
            })?;
            Some(store::StoreServer::bind(std::net::SocketAddr::new(ip, init.master_port), &cfg.job_id, &secret)?)
        } else {
            None
        };
        let mut client = store::StoreClient::connect(&master, &cfg.job_id, &secret, cfg.rendezvous_timeout)?;
        if client.add(&format!("joined/{rank}"), 1)? > 1 {
            return Err(CommError::Rendezvous(format!("two processes joined as RANK {rank}")));
        }
        let ip = client.local_ip()?;
        let t = tcp::TcpTransport::connect(rank, n, &mut client, ip, &cfg)?;
        let pg = ProcessGroup::new(Box::new(t), Backend::Tcp, cfg, (init.local_rank, init.local_world_size), server);
        pg.barrier()?;
        // Every rank is through the rendezvous (and has mapped its peers' shared memory).
        pg.inner.t.group_formed();
        // The store serves nobody from now on.
        if let Some(s) = &pg._store {
            s.close();
        }
        Ok(pg)
    }

    /// Join a TCP group described by the environment, as torchrun sets it: RANK, WORLD_SIZE,
    /// MASTER_ADDR (default 127.0.0.1), MASTER_PORT (default 29500), LOCAL_RANK, LOCAL_WORLD_SIZE.
    ///
    /// Like torchrun, when several ranks share the machine (LOCAL_WORLD_SIZE > 1) libtorch gets one
    /// intra-op thread per rank unless `SHARDLAB_NUM_THREADS` or `OMP_NUM_THREADS` says otherwise.
    pub fn from_env(cfg: CommConfig) -> CommResult<ProcessGroup> {
        let init = TcpInit::from_env()?;
        if let Some(n) = env_num::<i32>("SHARDLAB_NUM_THREADS") {
            tch::set_num_threads(n);
        } else if init.local_world_size > 1 && std::env::var_os("OMP_NUM_THREADS").is_none() {
            tch::set_num_threads(1);
        }
        ProcessGroup::init_tcp(&init, cfg)
    }

    pub fn rank(&self) -> usize {
        self.inner.rank
    }
    pub fn world_size(&self) -> usize {
        self.inner.n
    }
    /// Rank among the processes of this machine (LOCAL_RANK).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }
    pub fn backend(&self) -> Backend {
        self.inner.backend
    }
    /// How this rank's data moves: "local" (threads), "tcp", "shm" (shared memory with every
    /// peer) or "shm+tcp" (shared memory on this machine, TCP to the others).
    pub fn data_path(&self) -> &'static str {
        self.inner.t.data_path()
    }
    pub fn config(&self) -> &CommConfig {
        &self.inner.cfg
    }
    /// Payload bytes sent and received by this rank so far, and operations completed.
    pub fn stats(&self) -> CommStats {
        CommStats {
            bytes_sent: self.inner.counters.sent.load(Ordering::Relaxed),
            bytes_received: self.inner.counters.received.load(Ordering::Relaxed),
            collectives: self.inner.counters.collectives.load(Ordering::Relaxed),
            p2p: self.inner.counters.p2p.load(Ordering::Relaxed),
        }
    }

    /// Run `f` in order with the operations already queued by `*_async` calls.
    fn run(&self, f: impl FnOnce(&Inner) -> CommResult<()> + Send + 'static) -> CommResult<()> {
        if self.inner.pending.load(Ordering::SeqCst) == 0 {
            f(&self.inner)
        } else {
            self.submit(f, ()).wait()
        }
    }

    /// Queue `f` on the communication thread; `out` is handed back by [`Work::wait`].
    fn submit<T>(&self, f: impl FnOnce(&Inner) -> CommResult<()> + Send + 'static, out: T) -> Work<T> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.inner.pending.fetch_add(1, Ordering::SeqCst);
        let job: Job = Box::new(move |inner: &Inner| {
            let started = Instant::now();
            // A panic inside an operation must not kill the communication thread silently:
            // it becomes this operation's error, and the peers are told.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(inner))).unwrap_or_else(|_| {
                let e = CommError::Io(format!("rank {}: an asynchronous operation panicked", inner.rank));
                inner.t.abort(&e);
                Err(e)
            });
            inner.pending.fetch_sub(1, Ordering::SeqCst);
            let _ = tx.send((r, started, Instant::now()));
        });
        let mut w = relock(&self.worker);
        let (jobs, _) = w.get_or_insert_with(|| {
            let (jtx, jrx) = crossbeam_channel::unbounded::<Job>();
            let inner = self.inner.clone();
            let h = std::thread::Builder::new()
                .name(format!("shardlab-comm-{}", self.inner.rank))
                .spawn(move || {
                    for job in jrx {
                        job(&inner)
                    }
                })
                .expect("spawn communication thread");
            (jtx, h)
        });
        // If the thread were gone, the job (and its sender) is dropped and `wait` reports it.
        let _ = jobs.send(job);
        Work { rx, out }
    }

    /// Wait until every rank reached the barrier.
    pub fn barrier(&self) -> CommResult<()> {
        self.run(|i| {
            let spec = OpSpec {
                op: OpKind::Barrier,
                dtype: DType::I64,
                numel: 0,
                root: 0,
                reduce: None,
                algo: Algo::Naive,
                peer: None,
            };
            i.exec(spec, algo::barrier)
        })
    }

    /// End-of-job check, called by [`crate::launch::spawn`] after the rank's work: a barrier, a
    /// check that no data arrived that nobody asked for (ranks that ran different collectives —
    /// a wrong broadcast root on one rank, say — leave such data behind), and a second barrier
    /// so that a rank that finds some makes every rank fail.
    pub fn finish(&self) -> CommResult<()> {
        self.barrier()?;
        self.run(|i| {
            // The closing barrier's frames, which fast peers may already have sent, are expected.
            let seq = relock(&i.state).seq;
            let next = OpDesc {
                op: OpKind::Barrier,
                seq,
                dtype: DType::I64,
                numel: 0,
                root: 0,
                reduce: None,
                algo: Algo::Naive as u8,
            };
            match i.t.stray(&next) {
                Some(e) => {
                    i.t.abort(&e);
                    Err(e)
                }
                None => Ok(()),
            }
        })?;
        self.barrier()
    }

    /// Give up on the group: every rank's next (or current) operation fails with `reason`.
    pub fn abort(&self, reason: &str) {
        self.inner.t.abort(&CommError::Aborted { by: self.rank(), reason: reason.to_string() });
    }

    /// Send `t` to rank `dst`, which must call [`recv`](Self::recv) with a tensor of the same
    /// dtype and size. Returns once the data left this rank.
    pub fn send(&self, t: &Tensor, dst: usize) -> CommResult<()> {
        self.inner.check_rank("send: destination", dst)?;
        if dst == self.rank() {
            return Err(self.fail(CommError::InvalidArgument("send: cannot send to self".into())));
        }
        let tb = dtype::TensorBytes::of(t, "send").map_err(|e| self.fail(e))?;
        let me = self.rank();
        self.run(move |i| {
            let spec = OpSpec {
                op: OpKind::Send,
                dtype: tb.dtype,
                numel: tb.numel,
                root: me,
                reduce: None,
                algo: Algo::Naive,
                peer: Some(dst),
            };
            i.exec(spec, |c| algo::send(c, dst, tb.bytes()))
        })
    }

    /// Receive into `t` what rank `src` sends with [`send`](Self::send).
    pub fn recv(&self, t: &mut Tensor, src: usize) -> CommResult<()> {
        self.inner.check_rank("recv: source", src)?;
        if src == self.rank() {
            return Err(self.fail(CommError::InvalidArgument("recv: cannot receive from self".into())));
        }
        let tb = dtype::TensorBytes::of(t, "recv").map_err(|e| self.fail(e))?;
        self.run(move |i| {
            let spec = OpSpec {
                op: OpKind::Send,
                dtype: tb.dtype,
                numel: tb.numel,
                root: src,
                reduce: None,
                algo: Algo::Naive,
                peer: Some(src),
            };
            i.exec(spec, |c| algo::recv(c, src, tb.bytes_mut()))
        })
    }

    /// The algorithm `algo` stands for in this group (`Auto`: the best it has).
    pub fn resolve(&self, op: OpKind, algo: Algo) -> Algo {
        match algo {
            Algo::Auto if self.inner.t.shared_buffers().is_some() => Algo::Direct,
            Algo::Auto if op == OpKind::Broadcast => Algo::Tree,
            Algo::Auto => Algo::Ring,
            a => a,
        }
    }

    fn fail(&self, e: CommError) -> CommError {
        self.inner.t.abort(&e);
        e
    }

    fn broadcast_job(
        &self,
        t: &Tensor,
        root: usize,
        algo: Algo,
    ) -> CommResult<impl FnOnce(&Inner) -> CommResult<()> + Send + 'static> {
        self.inner.check_rank("broadcast: root", root)?;
        let algo = self.resolve(OpKind::Broadcast, algo);
        let tb = dtype::TensorBytes::of(t, "broadcast").map_err(|e| self.fail(e))?;
        let keep = t.shallow_clone();
        Ok(move |i: &Inner| {
            let _keep = keep;
            let spec = OpSpec {
                op: OpKind::Broadcast,
                dtype: tb.dtype,
                numel: tb.numel,
                root,
                reduce: None,
                algo,
                peer: None,
            };
            i.exec(spec, |c| match algo {
                Algo::Naive => algo::broadcast_naive(c, tb.bytes_mut(), root),
                Algo::Ring => algo::broadcast_ring(c, tb.bytes_mut(), root),
                Algo::Direct => algo::broadcast_direct(c, tb.bytes_mut(), root),
                _ => algo::broadcast_tree(c, tb.bytes_mut(), root),
            })
        })
    }

    /// Copy `root`'s `t` into every rank's `t` (default algorithm: binomial tree).
    pub fn broadcast(&self, t: &mut Tensor, root: usize) -> CommResult<()> {
        self.broadcast_with(t, root, self.inner.cfg.broadcast_algo)
    }
    pub fn broadcast_with(&self, t: &mut Tensor, root: usize, algo: Algo) -> CommResult<()> {
        let job = self.broadcast_job(t, root, algo)?;
        self.run(job)
    }
    /// Non-blocking [`broadcast`](Self::broadcast): `t` comes back from [`Work::wait`].
    pub fn broadcast_async(&self, t: Tensor, root: usize) -> CommResult<Work<Tensor>> {
        Ok(self.submit(self.broadcast_job(&t, root, self.inner.cfg.broadcast_algo)?, t))
    }

    fn all_reduce_job(
        &self,
        t: &Tensor,
        op: ReduceOp,
        algo: Algo,
    ) -> CommResult<impl FnOnce(&Inner) -> CommResult<()> + Send + 'static> {
        let tb = dtype::TensorBytes::of(t, "all_reduce").map_err(|e| self.fail(e))?;
        let algo = self.resolve(OpKind::AllReduce, algo);
        let keep = t.shallow_clone();
        Ok(move |i: &Inner| {
            let _keep = keep;
            let spec = OpSpec {
                op: OpKind::AllReduce,
                dtype: tb.dtype,
                numel: tb.numel,
                root: 0,
                reduce: Some(op),
                algo,
                peer: None,
            };
            i.exec(spec, |c| match algo {
                Algo::Naive => algo::all_reduce_naive(c, tb.bytes_mut(), op),
                Algo::Direct => algo::all_reduce_direct(c, tb.bytes_mut(), op),
                _ => algo::all_reduce_ring(c, tb.bytes_mut(), op),
            })
        })
    }

    /// Reduce `t` over all ranks in place: afterwards every rank holds the same result.
    pub fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> CommResult<()> {
        self.all_reduce_with(t, op, self.inner.cfg.all_reduce_algo)
    }
    pub fn all_reduce_with(&self, t: &mut Tensor, op: ReduceOp, algo: Algo) -> CommResult<()> {
        let job = self.all_reduce_job(t, op, algo)?;
        self.run(job)
    }
    /// Non-blocking [`all_reduce`](Self::all_reduce): returns at once; the reduced `t` comes
    /// back from [`Work::wait`].
    pub fn all_reduce_async(&self, t: Tensor, op: ReduceOp) -> CommResult<Work<Tensor>> {
        Ok(self.submit(self.all_reduce_job(&t, op, self.inner.cfg.all_reduce_algo)?, t))
    }

    fn pair(&self, what: &str, big: &Tensor, small: &Tensor) -> CommResult<(dtype::TensorBytes, dtype::TensorBytes)> {
        let b = dtype::TensorBytes::of(big, what).map_err(|e| self.fail(e))?;
        let s = dtype::TensorBytes::of(small, what).map_err(|e| self.fail(e))?;
        if b.dtype != s.dtype {
            return Err(self.fail(CommError::InvalidArgument(format!(
                "{what}: input and output dtypes differ ({} vs {})",
                b.dtype.name(),
                s.dtype.name()
            ))));
        }
        if b.numel != s.numel * self.world_size() {
            return Err(self.fail(CommError::InvalidArgument(format!(
                "{what}: the large tensor must have world_size × {} = {} elements, it has {}",
                s.numel,
                s.numel * self.world_size(),
                b.numel
            ))));
        }
        let (bp, sp) = (b.bytes().as_ptr() as usize, s.bytes().as_ptr() as usize);
        if b.len > 0 && s.len > 0 && bp < sp + s.len && sp < bp + b.len {
            return Err(self.fail(CommError::InvalidArgument(format!(
                "{what}: input and output share memory; pass separate tensors (in-place is not supported yet)"
            ))));
        }
        Ok((b, s))
    }

    fn all_gather_job(
        &self,
        out: &Tensor,
        input: &Tensor,
        algo: Algo,
    ) -> CommResult<impl FnOnce(&Inner) -> CommResult<()> + Send + 'static> {
        let (o, x) = self.pair("all_gather", out, input)?;
        let algo = self.resolve(OpKind::AllGather, algo);
        let keep = (out.shallow_clone(), input.shallow_clone());
        Ok(move |i: &Inner| {
            let _keep = keep;
            let spec = OpSpec {
                op: OpKind::AllGather,
                dtype: x.dtype,
                numel: x.numel,
                root: 0,
                reduce: None,
                algo,
                peer: None,
            };
            i.exec(spec, |c| match algo {
                Algo::Naive => algo::all_gather_naive(c, o.bytes_mut(), x.bytes()),
                Algo::Direct => algo::all_gather_direct(c, o.bytes_mut(), x.bytes()),
                _ => algo::all_gather_ring(c, o.bytes_mut(), x.bytes()),
            })
        })
    }

    /// Concatenate every rank's `input` (rank order) into `out`, which has world_size × input's
    /// elements — torch's `all_gather_into_tensor`.
    pub fn all_gather(&self, out: &mut Tensor, input: &Tensor) -> CommResult<()> {
        self.all_gather_with(out, input, self.inner.cfg.all_gather_algo)
    }
    pub fn all_gather_with(&self, out: &mut Tensor, input: &Tensor, algo: Algo) -> CommResult<()> {
        let job = self.all_gather_job(out, input, algo)?;
        self.run(job)
    }
    /// Non-blocking [`all_gather`](Self::all_gather): `out` comes back from [`Work::wait`];
    /// `input` is dropped when the operation is done.
    pub fn all_gather_async(&self, out: Tensor, input: Tensor) -> CommResult<Work<Tensor>> {
        Ok(self.submit(self.all_gather_job(&out, &input, self.inner.cfg.all_gather_algo)?, out))
    }

    fn reduce_scatter_job(
        &self,
        out: &Tensor,
        input: &Tensor,
        op: ReduceOp,
        algo: Algo,
    ) -> CommResult<impl FnOnce(&Inner) -> CommResult<()> + Send + 'static> {
        let (x, o) = self.pair("reduce_scatter", input, out)?;
        let algo = self.resolve(OpKind::ReduceScatter, algo);
        let keep = (out.shallow_clone(), input.shallow_clone());
        Ok(move |i: &Inner| {
            let _keep = keep;
            let spec = OpSpec {
                op: OpKind::ReduceScatter,
                dtype: x.dtype,
                numel: x.numel,
                root: 0,
                reduce: Some(op),
                algo,
                peer: None,
            };
            i.exec(spec, |c| match algo {
                Algo::Naive => algo::reduce_scatter_naive(c, o.bytes_mut(), x.bytes(), op),
                Algo::Direct => algo::reduce_scatter_direct(c, o.bytes_mut(), x.bytes(), op),
                _ => algo::reduce_scatter_ring(c, o.bytes_mut(), x.bytes(), op),
            })
        })
    }

    /// Reduce `input` (world_size blocks) over all ranks and give rank r block r in `out` —
    /// torch's `reduce_scatter_tensor`.
    pub fn reduce_scatter(&self, out: &mut Tensor, input: &Tensor, op: ReduceOp) -> CommResult<()> {
        self.reduce_scatter_with(out, input, op, self.inner.cfg.reduce_scatter_algo)
    }
    pub fn reduce_scatter_with(&self, out: &mut Tensor, input: &Tensor, op: ReduceOp, algo: Algo) -> CommResult<()> {
        let job = self.reduce_scatter_job(out, input, op, algo)?;
        self.run(job)
    }
    /// Non-blocking [`reduce_scatter`](Self::reduce_scatter): `out` comes back from
    /// [`Work::wait`]; `input` is dropped when the operation is done.
    pub fn reduce_scatter_async(&self, out: Tensor, input: Tensor, op: ReduceOp) -> CommResult<Work<Tensor>> {
        Ok(self.submit(self.reduce_scatter_job(&out, &input, op, self.inner.cfg.reduce_scatter_algo)?, out))
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // Crashing: tell the others first (queued work then fails fast on the poison).
        // Otherwise let queued async work finish, then say goodbye.
        let panicking = std::thread::panicking();
        if panicking {
            self.inner
                .t
                .abort(&CommError::Aborted { by: self.rank(), reason: format!("rank {} panicked", self.rank()) });
        }
        if let Some((jobs, h)) = self.worker.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            drop(jobs);
            let _ = h.join();
        }
        if !panicking && self.inner.t.poisoned().is_none() {
            self.inner.t.leave();
        }
    }
}

/// Where and who a TCP rank is — what torchrun puts in the environment.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TcpInit {
    pub rank: usize,
    pub world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub local_rank: usize,
    pub local_world_size: usize,
}

impl TcpInit {
    /// Read RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE.
    pub fn from_env() -> CommResult<Self> {
        fn var<T: std::str::FromStr>(name: &str, default: Option<T>) -> CommResult<T> {
            match std::env::var(name) {
                Ok(v) => v
                    .trim()
                    .parse()
                    .map_err(|_| CommError::InvalidArgument(format!("{name}={v:?} is not a valid number"))),
                Err(_) => default.ok_or_else(|| {
                    CommError::InvalidArgument(format!("{name} is not set (expected as torchrun sets it)"))
                }),
            }
        }
        let rank = var("RANK", None)?;
        let world_size = var("WORLD_SIZE", None)?;
        Ok(TcpInit {
            rank,
            world_size,
            master_addr: std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into()),
            master_port: var("MASTER_PORT", Some(29500))?,
            local_rank: var("LOCAL_RANK", Some(rank))?,
            local_world_size: var("LOCAL_WORLD_SIZE", Some(world_size))?,
        })
    }
}
