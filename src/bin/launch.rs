//! `launch` — start the ranks of a job on this machine, one node of a multi-node job: torchrun's
//! `--nnodes --node-rank --nproc-per-node --master-addr --master-port`, for shardlab programs
//! (lesson 11).
//!
//!   cargo run --release --bin launch -- --nproc-per-node 4 -- train --strategy zero3 --world-size 4
//!
//! Two machines (run one launcher on each; the same secret everywhere):
//!
//!   export SHARDLAB_SECRET=$(openssl rand -hex 32)                     # once, copied to both
//!   launch --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 -- train --world-size 16 …
//!   launch --nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr 10.0.0.1 -- train --world-size 16 …
//!
//! Under Slurm (`srun --ntasks-per-node=1 launch --nproc-per-node 8 -- train …`) the node count,
//! node rank and master address default to SLURM_NNODES, SLURM_NODEID and the first host of the
//! step's node list (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST). (Or let srun start every rank itself, `--ntasks-per-node=8`, with
//! `SHARDLAB_LAUNCHER=srun` exported: the ranks read SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID.)
//!
//! Each rank process gets RANK (node_rank × nproc_per_node + local rank), WORLD_SIZE, LOCAL_RANK,
//! LOCAL_WORLD_SIZE, GROUP_RANK (the node rank), GROUP_WORLD_SIZE, TORCHELASTIC_RESTART_COUNT (0),
//! OMP_NUM_THREADS (unless set: the cores over the ranks of this machine), MASTER_ADDR,
//! MASTER_PORT, SHARDLAB_LAUNCHER and SHARDLAB_JOB_ID; the program's `spawn` then joins that group instead of starting processes.
//! When a rank fails, the others get `--grace-s` seconds to fail on their own (their collectives
//! do), then SIGTERM (a chance to abort their communicators and flush), then SIGKILL after
//! `--term-s`; the launcher exits with the first failure's code. SIGTERM or SIGINT to the
//! launcher is forwarded to every rank, SIGKILL after `--term-s` (torchrun's behaviour); and the
//! ranks die with the launcher even if it is SIGKILLed (`PR_SET_PDEATHSIG`), so no rank outlives
//! it holding its GPU.

use clap::Parser;
use shardlab::comm::auth::{Secret, SECRET_ENV};
use shardlab::comm::first_host;
use shardlab::launch::ENV_LAUNCHER;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(about = "Start this node's ranks of a (multi-node) job, like torchrun")]
struct Args {
    /// Machines in the job [default: SLURM_NNODES, else 1].
    #[arg(long)]
    nnodes: Option<usize>,
    /// This machine's index, 0..nnodes [default: SLURM_NODEID, else 0].
    #[arg(long)]
    node_rank: Option<usize>,
    /// Ranks on this machine (one per GPU on GPU machines).
    #[arg(long, default_value_t = 1)]
    nproc_per_node: usize,
    /// The address of node 0, where global rank 0 hosts the store [default: the first host of
    /// SLURM_STEP_NODELIST or SLURM_JOB_NODELIST, else 127.0.0.1].
    #[arg(long)]
    master_addr: Option<String>,
    #[arg(long, default_value_t = 29500)]
    master_port: u16,
    /// Seconds the other ranks get to fail on their own after one failed, before they are killed.
    #[arg(long, default_value_t = 30.0)]
    grace_s: f64,
    /// Seconds between the SIGTERM a rank gets (after a failure, or forwarded from the launcher)
    /// and its SIGKILL.
    #[arg(long, default_value_t = 10.0)]
    term_s: f64,
    /// The program (a path, or the name of a bin next to this one) and its arguments.
    #[arg(required = true, last = true)]
    command: Vec<String>,
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// `train` → the `train` next to this executable, if there is one; else the name as given.
fn program(name: &str) -> PathBuf {
    let p = PathBuf::from(name);
    if p.components().count() == 1 {
        if let Some(sibling) = std::env::current_exe().ok().and_then(|e| e.parent().map(|d| d.join(name))) {
            if sibling.is_file() {
                return sibling;
            }
        }
    }
    p
}

fn describe(s: &ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(9)) => "killed (SIGKILL)".into(),
        (None, Some(sig)) => format!("signal {sig}"),
        _ => format!("{s}"),
    }
}

/// The signal the launcher received (SIGTERM, SIGINT), 0 while none.
static SIGNALLED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNALLED.store(sig, Ordering::SeqCst);
}

/// Send `sig` to a child that has not been reaped yet (its pid is still its own).
fn signal(c: &std::process::Child, sig: libc::c_int) {
    // SAFETY: kill(2) on the pid of a child this process has not waited for.
    unsafe { libc::kill(c.id() as libc::pid_t, sig) };
}

fn main() -> anyhow::Result<()> {
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t);
    }
    let a = Args::parse();
    let nnodes = a.nnodes.or_else(|| env_usize("SLURM_NNODES")).unwrap_or(1);
    let node_rank = a.node_rank.or_else(|| env_usize("SLURM_NODEID")).unwrap_or(0);
    let master_addr = a
        .master_addr
        .clone()
        .or_else(|| {
            ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]
                .iter()
                .find_map(|n| std::env::var(n).ok())
                .and_then(|l| first_host(&l))
        })
        .unwrap_or_else(|| "127.0.0.1".into());
    anyhow::ensure!(nnodes >= 1 && a.nproc_per_node >= 1, "--nnodes and --nproc-per-node must be at least 1");
    anyhow::ensure!(node_rank < nnodes, "--node-rank {node_rank} is out of range for --nnodes {nnodes}");
    let world = nnodes * a.nproc_per_node;
    // The job's secret: generated here for a one-machine job; several machines must share one.
    let secret = match std::env::var(SECRET_ENV) {
        Ok(s) => s,
        Err(_) if nnodes == 1 => Secret::generate()?.to_hex(),
        Err(_) => anyhow::bail!(
            "{SECRET_ENV} is not set: a job on {nnodes} machines needs one secret shared by all of them. \
             Generate it once (`openssl rand -hex 32`) and export the same value on every machine"
        ),
    };
    let job_id = std::env::var("SHARDLAB_JOB_ID").unwrap_or_else(|_| format!("launch-{master_addr}-{}", a.master_port));
    let loopback =
        master_addr.parse::<std::net::IpAddr>().map(|ip| ip.is_loopback()).unwrap_or(master_addr == "localhost");
    let exe = program(&a.command[0]);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let omp_threads = (cores / a.nproc_per_node).max(1);
    let mut children = Vec::new();
    for local in 0..a.nproc_per_node {
        let rank = node_rank * a.nproc_per_node + local;
        let mut cmd = Command::new(&exe);
        cmd.args(&a.command[1..])
            .env_remove("SHARDLAB_SPAWN_CHILD")
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", a.nproc_per_node.to_string())
            .env("GROUP_RANK", node_rank.to_string())
            .env("GROUP_WORLD_SIZE", nnodes.to_string())
            // No restarts from this launcher (`train --max-restarts` restarts inside the job).
            .env("TORCHELASTIC_RESTART_COUNT", "0")
            .env("MASTER_ADDR", &master_addr)
            .env("MASTER_PORT", a.master_port.to_string())
            .env(ENV_LAUNCHER, "launch")
            .env("SHARDLAB_JOB_ID", &job_id)
            .env(SECRET_ENV, &secret)
            .stdin(std::process::Stdio::null());
        // SAFETY: prctl in the child between fork and exec: async-signal-safe, no allocation.
        // The rank gets SIGKILL when the launcher dies, however it dies.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        if std::env::var_os("OMP_NUM_THREADS").is_none() {
            // As torchrun: ranks sharing a machine do not each take every core (it sets 1; we give
            // each its share).
            cmd.env("OMP_NUM_THREADS", omp_threads.to_string());
        }
        if rank == 0 && !loopback && std::env::var_os("SHARDLAB_STORE_BIND").is_none() {
            // Other machines must reach rank 0's store.
            cmd.env("SHARDLAB_STORE_BIND", "0.0.0.0");
        }
        match cmd.spawn() {
            Ok(c) => children.push((rank, c)),
            Err(e) => {
                for (_, mut c) in children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                anyhow::bail!("cannot start rank {rank} ({}): {e}", exe.display());
            }
        }
    }
    // Wait for every rank. After the first failure the others get the grace period to fail on
    // their own; then (or at once, on a signal to the launcher) SIGTERM, and SIGKILL `term_s` later.
    let mut status: Vec<Option<ExitStatus>> = vec![None; children.len()];
    let mut first_failure: Option<(Instant, usize)> = None;
    let mut termed: Option<Instant> = None;
    let mut killed = false;
    while status.iter().any(|s| s.is_none()) {
        for (k, (rank, c)) in children.iter_mut().enumerate() {
            if status[k].is_none() {
                if let Ok(Some(s)) = c.try_wait() {
                    if !s.success() && first_failure.is_none() && termed.is_none() {
                        eprintln!(
                            "launch: rank {rank} failed ({}); the others have {:.0} s to stop",
                            describe(&s),
                            a.grace_s
                        );
                        first_failure = Some((Instant::now(), k));
                    }
                    status[k] = Some(s);
                }
            }
        }
        let live = |status: &[Option<ExitStatus>]| status.iter().filter(|s| s.is_none()).count();
        let sig = SIGNALLED.load(Ordering::SeqCst);
        let overdue = first_failure.is_some_and(|(t, _)| t.elapsed() > Duration::from_secs_f64(a.grace_s));
        if termed.is_none() && (sig != 0 || overdue) && live(&status) > 0 {
            let why = if sig != 0 { format!("the launcher got signal {sig}") } else { "after the failure".into() };
            eprintln!("launch: SIGTERM to the {} running rank(s) ({why}); SIGKILL in {:.0} s", live(&status), a.term_s);
            for (k, (_, c)) in children.iter().enumerate() {
                if status[k].is_none() {
                    signal(c, libc::SIGTERM);
                }
            }
            termed = Some(Instant::now());
        }
        if !killed && termed.is_some_and(|t| t.elapsed() > Duration::from_secs_f64(a.term_s)) {
            for (k, (rank, c)) in children.iter_mut().enumerate() {
                if status[k].is_none() {
                    eprintln!("launch: killing rank {rank} (still running {:.0} s after SIGTERM)", a.term_s);
                    let _ = c.kill();
                }
            }
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let sig = SIGNALLED.load(Ordering::SeqCst);
    if first_failure.is_none() && sig != 0 {
        // Stopped by a signal: exit as the shell expects of a process it signalled.
        std::process::exit(128 + sig);
    }
    match first_failure {
        None => Ok(()),
        Some((_, k)) => {
            let s = status[k].expect("waited");
            std::process::exit(s.code().unwrap_or(128 + s.signal().unwrap_or(1)));
        }
    }
}
