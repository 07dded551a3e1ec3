//! What a process group is configured with: the [`Backend`] that carries the bytes, the
//! [`CommConfig`] tunables (read from `SHARDLAB_*` environment variables), the same-machine
//! [`DataPath`], and the [`Fault`] the failure tests inject.

use super::algo::Algo;
use super::auth;
use super::error::{CommError, CommResult};
use super::frame;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Which backend carries the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
pub enum Backend {
    /// Ranks are threads of one process; frames move through shared memory.
    Local,
    /// Ranks are processes (possibly on several machines) connected by TCP.
    Tcp,
    /// Ranks are processes, one GPU each, whose collectives NCCL runs on device memory (lesson
    /// 11); the rendezvous is the tcp backend's store. CPU tensors are staged through the GPU.
    Nccl,
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
    /// and refuses otherwise — see [`auth`]. Its `Debug` is redacted and serialising a config
    /// leaves it out (a logged config must not leak it; `spawn` hands it to its child processes
    /// in `SHARDLAB_SECRET`).
    #[serde(default, skip_serializing)]
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
/// stays alive). TCP backend only. Subgroups inherit it: the same rank, at its rank in the
/// subgroup, fails at the subgroup's collective number `seq` too (whichever comes first).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fault {
    pub rank: usize,
    pub seq: u64,
    pub after_bytes: usize,
    pub kill: bool,
}

/// A number from the environment variable `name`; unset or unparsable (with a warning): `None`.
pub(crate) fn env_num<T: std::str::FromStr>(name: &str) -> Option<T> {
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
    pub(crate) fn validate(&self) -> CommResult<()> {
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
