//! Start a job: `spawn(world_size, backend, f)` runs `f` on every rank and returns every rank's
//! result, like `torch.multiprocessing.spawn`.
//!
//! * `Backend::Local` — ranks are threads of this process.
//! * `Backend::Tcp` — ranks are child processes: the current executable is started again with
//!   RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK set (as torchrun would). The child runs
//!   `main` again up to the same `spawn` call, which then runs `f` for its rank, hands the result
//!   (serialised as JSON) back to the parent and exits. Keep work you don't want repeated in the
//!   children after the `spawn` call, or skip it with [`is_spawned_child`].
//!
//! A `Tcp` job's ranks authenticate every connection with the job's secret (see
//! [`crate::comm::auth`]): `spawn` uses `config.secret` (`SHARDLAB_SECRET`) if set, else generates
//! a fresh random one per job and hands it to its ranks (thread ranks share the config; child
//! processes get it in `SHARDLAB_SECRET`, never in the serialised config).
//!
//! A rank that panics, returns an error or exits becomes an error for the caller naming the rank;
//! the other ranks notice through the communication layer (their peer is gone) and fail too.

mod process;

use crate::comm::auth::Secret;
use crate::comm::{Backend, CommConfig, ProcessGroup, TcpInit};
use process::{run_child, run_external, run_processes};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const ENV_CHILD: &str = "SHARDLAB_SPAWN_CHILD";
const ENV_RESULT: &str = "SHARDLAB_SPAWN_RESULT";
const ENV_CONFIG: &str = "SHARDLAB_SPAWN_CONFIG";

static SPAWN_CALLS: AtomicUsize = AtomicUsize::new(0);

/// How to run the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum Launch {
    /// Threads of this process.
    Threads,
    /// Child processes running this executable again.
    Processes,
}

/// Options of [`spawn_with`].
#[derive(Clone, Debug)]
pub struct SpawnOptions {
    pub world_size: usize,
    pub backend: Backend,
    /// Default: threads for `Local`, processes for `Tcp`. (`Tcp` over threads is allowed: handy in tests.)
    pub launch: Launch,
    pub config: CommConfig,
    /// libtorch intra-op threads per rank (default 1 when several ranks share the machine,
    /// `SHARDLAB_NUM_THREADS` overrides).
    pub threads_per_rank: Option<i32>,
    /// How long survivors may take to fail after one rank failed before they are killed.
    pub grace: Duration,
    /// Arguments for the child processes (default: this process's own). Tests pass
    /// `["--exact", "<test name>", "--nocapture"]` so a child re-runs only the calling test.
    pub child_args: Option<Vec<String>>,
    /// Extra environment variables for child processes.
    pub env: Vec<(String, String)>,
    /// MASTER_PORT of a `Tcp` job (default: a port that is free when the job starts).
    pub master_port: Option<u16>,
}

impl SpawnOptions {
    pub fn new(world_size: usize, backend: Backend) -> Self {
        let config = CommConfig::default();
        SpawnOptions {
            world_size,
            backend,
            launch: if backend == Backend::Local { Launch::Threads } else { Launch::Processes },
            grace: config.timeout + Duration::from_secs(5),
            config,
            threads_per_rank: None,
            child_args: None,
            env: Vec::new(),
            master_port: None,
        }
    }
    pub fn launch(mut self, l: Launch) -> Self {
        self.launch = l;
        self
    }
    pub fn child_args(mut self, args: Vec<String>) -> Self {
        self.child_args = Some(args);
        self
    }
    pub fn config(mut self, c: CommConfig) -> Self {
        self.grace = c.timeout + Duration::from_secs(5);
        self.config = c;
        self
    }
    /// Rank 0's store listens on this port (the default is a free one).
    pub fn master_port(mut self, port: u16) -> Self {
        self.master_port = Some(port);
        self
    }
}

/// Why a launch failed: one line per rank that did not succeed.
#[derive(Debug, thiserror::Error)]
#[error("{}", .failures.iter().map(|(r, m)| format!("rank {r}: {m}")).collect::<Vec<_>>().join("\n"))]
pub struct LaunchError {
    pub failures: Vec<(usize, String)>,
}

impl LaunchError {
    fn one(msg: impl Into<String>) -> Self {
        LaunchError { failures: vec![(0, msg.into())] }
    }
}

/// True inside a rank process started by [`spawn`].
pub fn is_spawned_child() -> bool {
    std::env::var_os(ENV_CHILD).is_some()
}

/// Set by the `launch` bin in the rank processes it starts; set it yourself (to anything) in ranks
/// that `srun` starts directly. torchrun's ranks are recognised by its TORCHELASTIC_RUN_ID.
pub const ENV_LAUNCHER: &str = "SHARDLAB_LAUNCHER";

/// Whether this process is one rank of a job that another launcher started (the `launch` bin,
/// torchrun, srun with `SHARDLAB_LAUNCHER` set): then [`spawn`] starts no processes, it joins the
/// group the environment describes and runs only this process's rank.
pub fn external_launch() -> bool {
    !is_spawned_child()
        && (std::env::var_os(ENV_LAUNCHER).is_some() || std::env::var_os("TORCHELASTIC_RUN_ID").is_some())
}

/// This process's global rank when [`external_launch`] (from RANK, or SLURM_PROCID).
pub fn external_rank() -> Option<usize> {
    external_launch().then(|| TcpInit::from_env().ok().map(|i| i.rank)).flatten()
}

/// In a worker process started by the `k`-th process spawn of its driver, make the next spawn
/// call of this process count as the `k`-th, so that it runs its rank there. For drivers that
/// spawn again after a failure (an elastic restart): the worker of a later generation reaches
/// that generation's spawn as its first. No-op outside worker processes.
pub fn align_spawn_call_with_driver() {
    if let Some(k) = std::env::var(ENV_CHILD).ok().and_then(|t| t.parse::<usize>().ok()) {
        SPAWN_CALLS.store(k, Ordering::SeqCst);
    }
}

/// Fault injection for tests and demos: `SHARDLAB_FAIL_AT=POINT:RANK:STEP[:GENERATION]` makes rank
/// RANK fail at POINT (`step`: before training step STEP; `save`: in the save of step STEP, after
/// writing its file and before the commit) in elastic generation GENERATION (default 0). A worker
/// process kills itself with SIGKILL (a crash: no message, no cleanup); a worker thread returns an error.
pub fn injected_failure(point: &str, rank: usize, step: u64) -> anyhow::Result<()> {
    let Ok(spec) = std::env::var("SHARDLAB_FAIL_AT") else { return Ok(()) };
    let parts: Vec<&str> = spec.split(':').collect();
    let generation: u64 = std::env::var(ENV_GENERATION).ok().and_then(|g| g.parse().ok()).unwrap_or(0);
    let hit = parts.len() >= 3
        && parts[0] == point
        && parts[1].parse() == Ok(rank)
        && parts[2].parse() == Ok(step)
        && parts.get(3).map_or(0, |g| g.parse().unwrap_or(u64::MAX)) == generation;
    if !hit {
        return Ok(());
    }
    if is_spawned_child() {
        eprintln!("shardlab: SHARDLAB_FAIL_AT={spec}: rank {rank} kills itself at {point} {step}");
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
    anyhow::bail!("rank {rank}: injected failure at {point} {step} (SHARDLAB_FAIL_AT={spec})")
}

/// The elastic generation this process runs in (set by the supervisor, [`crate::job::GptJob::fit_elastic`]).
pub const ENV_GENERATION: &str = "SHARDLAB_GENERATION";

/// Run `f` on `world_size` ranks of `backend` and collect the results in rank order.
pub fn spawn<R, F>(world_size: usize, backend: Backend, f: F) -> Result<Vec<R>, LaunchError>
where
    R: Serialize + DeserializeOwned + Send,
    F: Fn(&ProcessGroup) -> anyhow::Result<R> + Send + Sync,
{
    spawn_with(SpawnOptions::new(world_size, backend), f)
}

fn set_threads(opts: &SpawnOptions, ranks_here: usize) {
    keep_freed_memory();
    let n = std::env::var("SHARDLAB_NUM_THREADS").ok().and_then(|v| v.parse().ok()).or(opts.threads_per_rank);
    match n {
        Some(n) => tch::set_num_threads(n),
        None if ranks_here > 1 => tch::set_num_threads(1),
        None => {}
    }
}

/// Make glibc's malloc keep freed memory for reuse instead of returning every large block to the
/// kernel (the default for blocks over 128 KiB–32 MiB): a training step allocates and frees the
/// same activation and gradient tensors every step, and with the default each reallocation is
/// fresh pages that the kernel must fault in and zero. The process's memory then stays at its
/// peak, as with PyTorch's caching allocators. Set `SHARDLAB_MALLOC_DEFAULT=1` to keep glibc's
/// defaults. Called by every rank.
pub fn keep_freed_memory() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        if std::env::var_os("SHARDLAB_MALLOC_DEFAULT").is_none() {
            // SAFETY: mallopt only changes allocator parameters; it is safe to call at any time.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
                libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
            }
        }
    });
}

/// [`spawn`] with options.
pub fn spawn_with<R, F>(opts: SpawnOptions, f: F) -> Result<Vec<R>, LaunchError>
where
    R: Serialize + DeserializeOwned + Send,
    F: Fn(&ProcessGroup) -> anyhow::Result<R> + Send + Sync,
{
    let call = SPAWN_CALLS.fetch_add(1, Ordering::SeqCst);
    if let Ok(target) = std::env::var(ENV_CHILD) {
        return run_child(call, &target, &opts, f);
    }
    if external_launch() {
        return run_external(call, &opts, f);
    }
    if opts.world_size == 0 {
        return Err(LaunchError::one("world_size must be at least 1"));
    }
    match (opts.backend, opts.launch) {
        (Backend::Local, Launch::Processes) => {
            Err(LaunchError::one("the local backend runs ranks as threads; use Backend::Tcp for processes"))
        }
        (Backend::Local, Launch::Threads) => {
            let pgs = ProcessGroup::local_world(opts.world_size, opts.config.clone())
                .map_err(|e| LaunchError::one(e.to_string()))?;
            set_threads(&opts, opts.world_size);
            run_threads(pgs.into_iter().map(Ok).collect(), &f)
        }
        (Backend::Tcp, Launch::Threads) => {
            let port = tcp_port(&opts)?;
            set_threads(&opts, opts.world_size);
            let inits: Vec<TcpInit> =
                (0..opts.world_size).map(|r| TcpInit::loopback(r, opts.world_size, port)).collect();
            let cfg = with_secret(&opts.config)?;
            std::thread::scope(|s| {
                let hs: Vec<_> = inits.iter().map(|i| s.spawn(|| ProcessGroup::init_tcp(i, cfg.clone()))).collect();
                let pgs: Vec<_> = hs
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| Err(crate::comm::CommError::Io("init panicked".into()))))
                    .collect();
                run_threads(pgs, &f)
            })
        }
        (Backend::Tcp | Backend::Nccl, Launch::Processes) => run_processes(call, &opts),
        (Backend::Nccl, Launch::Threads) => {
            Err(LaunchError::one("the nccl backend runs ranks as processes (one GPU each); use Launch::Processes"))
        }
    }
}

fn tcp_port(opts: &SpawnOptions) -> Result<u16, LaunchError> {
    match opts.master_port {
        Some(p) => Ok(p),
        None => free_port().map_err(LaunchError::one),
    }
}

/// `cfg` with a secret: the one it has (from `SHARDLAB_SECRET`, say), else a fresh random one for
/// this job — its ranks are all started from here, so they can share it. A malformed
/// `SHARDLAB_SECRET` is an error, not replaced.
fn with_secret(cfg: &CommConfig) -> Result<CommConfig, LaunchError> {
    let mut cfg = cfg.clone();
    if cfg.secret.is_none() {
        let e = |e: crate::comm::CommError| LaunchError::one(e.to_string());
        cfg.secret = Some(match Secret::from_env().map_err(e)? {
            Some(s) => s,
            None => Secret::generate().map_err(e)?,
        });
    }
    Ok(cfg)
}

/// A port that is free right now on loopback (the kernel picks it).
pub fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

fn run_threads<R, F>(pgs: Vec<crate::comm::CommResult<ProcessGroup>>, f: &F) -> Result<Vec<R>, LaunchError>
where
    R: Send,
    F: Fn(&ProcessGroup) -> anyhow::Result<R> + Send + Sync,
{
    let results: Vec<Result<R, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = pgs
            .into_iter()
            .enumerate()
            .map(|(r, pg)| {
                std::thread::Builder::new()
                    .name(format!("rank-{r}"))
                    .spawn_scoped(s, move || {
                        let pg = pg.map_err(|e| e.to_string())?;
                        run_rank(&pg, f)
                    })
                    .expect("spawn rank thread")
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|p| Err(format!("panicked: {}", panic_text(&*p))))).collect()
    });
    collect(results)
}

/// Run one rank's work, then the end-of-job check; a rank that fails tells the others why.
fn run_rank<R, F>(pg: &ProcessGroup, f: &F) -> Result<R, String>
where
    F: Fn(&ProcessGroup) -> anyhow::Result<R>,
{
    match f(pg) {
        Ok(v) => pg.finish().map(|_| v).map_err(|e| e.to_string()),
        Err(e) => {
            let msg = format!("{e:#}");
            pg.abort(&msg);
            Err(msg)
        }
    }
}

fn collect<R>(results: Vec<Result<R, String>>) -> Result<Vec<R>, LaunchError> {
    let mut ok = Vec::new();
    let mut failures = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(v) => ok.push(v),
            Err(m) => failures.push((r, m)),
        }
    }
    if failures.is_empty() {
        Ok(ok)
    } else {
        Err(LaunchError { failures })
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(non-string panic)".into())
}
