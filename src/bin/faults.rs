//! The fault-injection lab (lesson 10): the failures people meet on real clusters, each provoked
//! on purpose on this CPU, with what every rank is told and how long after the faulty operation
//! began it was told.
//!
//!   cargo run --release --bin faults                 # every scenario, one after another (about 12 s)
//!   cargo run --release --bin faults -- --only order # one of: kill, order, stall, corrupt, fp16, oom, deadlock
//!   cargo run --release --bin faults -- --json       # one JSON object per scenario
//!
//! Each scenario runs real ranks with the library's own collectives and checkpoints; only the fault
//! itself is staged. Ranks are threads, or processes where a process must die (`kill`) or must have
//! a memory cap of its own (`oom`): those re-run this program with `--only NAME`. Each rank's line
//! ends with the seconds from the start of its faulty operation to its outcome. The lesson's
//! "Fault-injection lab" explains each line and its fix; TROUBLESHOOTING.md has some of them in
//! `train`, and their NCCL equivalents.

use clap::Parser;
use serde_json::json;
use shardlab::checkpoint::{self, SaveOptions};
use shardlab::comm::{DataPath, Fault};
use shardlab::data::{synthetic_corpus, DistributedSampler};
use shardlab::ddp::{self, DataParallel};
use shardlab::prelude::*;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(
    about = "Lesson 10's fault-injection lab: provoke the failures of real clusters and read what each rank is told"
)]
struct Args {
    /// Run only this scenario.
    #[arg(long, value_enum)]
    only: Option<Scenario>,
    /// One JSON object per scenario instead of the text.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Scenario {
    /// A rank SIGKILLed in the middle of an all-reduce.
    Kill,
    /// Two ranks call collectives in different orders.
    Order,
    /// A rank silent for longer than the timeout.
    Stall,
    /// A flipped byte in a checkpoint file.
    Corrupt,
    /// fp16 with a loss scale far too high: the scaler's skips.
    Fp16,
    /// A rank out of memory under a cap.
    Oom,
    /// Two ranks that both send first.
    Deadlock,
}

/// What one scenario did: the fault, each rank's outcome (its error's first line, or "ok: …")
/// and the seconds from the start of the faulty operation to the last rank's outcome.
struct Outcome {
    name: &'static str,
    fault: String,
    ranks: Vec<String>,
    seconds: f64,
}

fn first_line(e: impl std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// A rank's error as one line that starts with the seconds since `t0`, the start of its faulty
/// operation (`[0.02 s] …`), for the launcher to report.
fn timed<T>(t0: Instant, r: Result<T, impl std::fmt::Display>) -> anyhow::Result<T> {
    r.map_err(|e| anyhow::anyhow!("[{:.2} s] {}", t0.elapsed().as_secs_f64(), first_line(e)))
}

/// One line per rank, in rank order: what each returned, or its error's first line.
fn lines(r: Result<Vec<String>, LaunchError>) -> Vec<String> {
    match r {
        Ok(v) => v.into_iter().enumerate().map(|(rank, l)| format!("rank {rank}: {l}")).collect(),
        Err(e) => e
            .failures
            .iter()
            .map(|(rank, m)| {
                let m = first_line(m);
                format!("rank {rank}: {}", m.strip_prefix(&format!("rank {rank}: ")).unwrap_or(&m))
            })
            .collect(),
    }
}

fn cfg(timeout_s: f64) -> CommConfig {
    CommConfig::default().with_timeout(Duration::from_secs_f64(timeout_s))
}

fn threads(n: usize, c: CommConfig) -> SpawnOptions {
    SpawnOptions::new(n, Backend::Tcp).launch(Launch::Threads).config(c)
}

fn outcome(name: &'static str, fault: &str, ranks: Vec<String>, t0: Instant) -> Outcome {
    Outcome { name, fault: fault.to_string(), ranks, seconds: t0.elapsed().as_secs_f64() }
}

/// Rank 2 of 3 process ranks SIGKILLs itself after sending 4 MiB of its part of an all-reduce of
/// 16 MiB (the library's test fault: no message, no clean-up, as the OOM killer does it).
fn kill() -> Outcome {
    let mut c = cfg(30.0);
    c.fault = Some(Fault { rank: 2, seq: 2, after_bytes: 4 << 20, kill: true });
    c.transport = DataPath::Tcp;
    let t = Instant::now();
    let only = vec!["--only".to_string(), "kill".to_string()];
    let opts = SpawnOptions::new(3, Backend::Tcp).launch(Launch::Processes).config(c).child_args(only);
    let r = spawn_with(opts, |pg| {
        let mut x = Tensor::ones([4 << 20], (Kind::Float, Device::Cpu)); // 16 MiB
        pg.all_reduce(&mut x, ReduceOp::Sum)?; // collective #1 (the barrier after rendezvous is #0)
        let t0 = Instant::now();
        timed(t0, pg.all_reduce(&mut x, ReduceOp::Sum))?; // #2: rank 2 dies in it
        Ok("finished (the fault did not happen)".to_string())
    });
    outcome("kill", "rank 2 of 3 SIGKILLed after sending 4 MiB of its part of a 16 MiB all-reduce", lines(r), t)
}

/// Two ranks call two collectives in different orders (rank-dependent code).
fn order() -> Outcome {
    let t = Instant::now();
    let r = spawn_with(threads(2, cfg(30.0)), |pg| {
        let mut x = Tensor::ones([1000], (Kind::Float, Device::Cpu));
        let t0 = Instant::now();
        if pg.rank() == 0 {
            timed(t0, pg.all_reduce(&mut x, ReduceOp::Sum).and_then(|_| pg.broadcast(&mut x, 0)))?;
        } else {
            timed(t0, pg.broadcast(&mut x, 0).and_then(|_| pg.all_reduce(&mut x, ReduceOp::Sum)))?;
        }
        Ok("finished (the fault did not happen)".to_string())
    });
    outcome("order", "rank 0 all-reduces then broadcasts; rank 1 broadcasts then all-reduces", lines(r), t)
}

/// Rank 1 stalls for 5 s between collectives (a hung data loader, a debugger, a slow disk) under a
/// 2 s timeout.
fn stall() -> Outcome {
    let t = Instant::now();
    let r = spawn_with(threads(2, cfg(2.0)), |pg| {
        let mut x = Tensor::ones([1000], (Kind::Float, Device::Cpu));
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_secs(5));
        }
        let t0 = Instant::now();
        timed(t0, pg.all_reduce(&mut x, ReduceOp::Sum))?;
        Ok("finished (the fault did not happen)".to_string())
    });
    outcome("stall", "rank 1 silent for 5 s before its all-reduce, SHARDLAB_TIMEOUT_S=2", lines(r), t)
}

fn tiny_ddp(pg: &ProcessGroup) -> anyhow::Result<Box<dyn DataParallel + '_>> {
    let m = Gpt::new(GptConfig::tiny(), 5)?;
    Ok(ddp::wrap(pg, Box::new(m), ddp::Variant::Bucketed, ddp::DEFAULT_BUCKET_CAP_BYTES)?)
}

/// A checkpoint saved by 2 ranks; one byte of rank 0's file flipped on disk (a bad disk, a
/// damaged copy); the load.
fn corrupt() -> Outcome {
    let t = Instant::now();
    let dir = std::env::temp_dir().join(format!("shardlab-faults-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.clone();
    let saved = spawn(2, Backend::Local, move |pg| {
        let o = AdamW::new(AdamWConfig::default());
        checkpoint::save(&*tiny_ddp(pg)?, &o, &d, 1, json!({}), &SaveOptions::default())?;
        Ok(())
    });
    // A byte near the end of rank 0's file: inside its last piece's data.
    let file = dir.join(checkpoint::step_dir_name(1)).join("rank-00000.safetensors");
    let flipped = saved.map_err(|e| e.to_string()).and_then(|_| {
        let mut bytes = std::fs::read(&file).map_err(|e| e.to_string())?;
        let k = bytes.len() - 3;
        bytes[k] ^= 0x40;
        std::fs::write(&file, &bytes).map_err(|e| e.to_string())
    });
    let d = dir.clone();
    let ranks = match flipped {
        Err(e) => vec![format!("could not prepare the checkpoint: {e}")],
        Ok(()) => lines(spawn(2, Backend::Local, move |pg| {
            let (mut dp, mut o) = (tiny_ddp(pg)?, AdamW::new(AdamWConfig::default()));
            let t0 = Instant::now();
            let own = format!("rank {}: ", pg.rank());
            let loaded = checkpoint::load(&mut *dp, &mut o, &d).map_err(|e| {
                let m = format!("{e:#}");
                m.strip_prefix(&own).unwrap_or(&m).to_string()
            });
            let r = timed(t0, loaded)?;
            Ok(format!("loaded step {} (the fault did not happen)", r.step))
        })),
    };
    let _ = std::fs::remove_dir_all(&dir);
    let shown = format!("{}/", dir.display());
    let ranks = ranks.into_iter().map(|l| l.replace(&shown, "DIR/")).collect();
    outcome("corrupt", "one byte of rank 0's checkpoint file flipped on disk, then the load", ranks, t)
}

/// fp16 training whose loss scale starts far too high (2³⁰; PyTorch starts at 2¹⁶): the scaled
/// gradients overflow fp16, the scaler skips the step and halves the scale until they fit.
fn fp16() -> Outcome {
    let t = Instant::now();
    let r = spawn(2, Backend::Local, |pg| {
        let m = Gpt::new(GptConfig::tiny(), 5)?.with_precision(Precision::Fp16);
        let mut dp = ddp::wrap(pg, Box::new(m), ddp::Variant::Bucketed, ddp::DEFAULT_BUCKET_CAP_BYTES)?;
        let mut o = AdamW::new(AdamWConfig::default());
        let mut scaler = GradScaler::new(2f64.powi(30));
        let s = DistributedSampler::new(16, 8, pg.rank(), pg.world_size(), 3)?;
        let data = synthetic_corpus(4000, 7);
        let t0 = Instant::now();
        let mut skipped = Vec::new();
        for step in 0..24 {
            let out = ddp::train_step_scaled(
                &mut *dp,
                &mut o,
                &s.batch(&data, step),
                1,
                StepConfig::lr(1e-3),
                Some(&mut scaler),
            )?;
            let exp = out.loss_scale.unwrap_or(f64::NAN).log2() as i64;
            if out.skipped {
                skipped.push(exp);
                continue;
            }
            let secs = t0.elapsed().as_secs_f64();
            return Ok(match (skipped.first(), skipped.last()) {
                (Some(a), Some(b)) => format!(
                    "[{secs:.2} s] steps 0–{} skipped (gradients inf or NaN; scale 2^{a} → 2^{b}, halved each time), step \
                     {step} taken at scale 2^{exp}, loss {:.3}",
                    skipped.len() - 1,
                    out.loss
                ),
                _ => format!("step 0 taken at scale 2^{exp}, nothing skipped (the fault did not happen)"),
            });
        }
        Ok(format!("{} steps skipped, none taken", skipped.len()))
    });
    outcome("fp16", "fp16 training with the loss scale at 2^30", lines(r), t)
}

/// A micro-batch too large for the memory a rank may use: rank 1 of 2 (processes: the cap is the
/// process's) caps its address space 1 GiB above what it has mapped, then allocates one block's
/// activations for a far too large batch.
fn oom() -> Outcome {
    let t = Instant::now();
    let only = vec!["--only".to_string(), "oom".to_string()];
    let opts = SpawnOptions::new(2, Backend::Tcp).launch(Launch::Processes).config(cfg(30.0)).child_args(only);
    let r = spawn_with(opts, |pg| {
        let mut x = Tensor::ones([1000], (Kind::Float, Device::Cpu));
        pg.all_reduce(&mut x, ReduceOp::Sum)?;
        let t0 = Instant::now();
        if pg.rank() == 1 {
            cap_address_space(1 << 30)?;
            // (B, T, 4C) for 2048 rows of 1024 tokens at width 768, f32: 24 GiB.
            let _activations = timed(t0, Tensor::f_zeros([2048, 1024, 4 * 768], (Kind::Float, Device::Cpu)))?;
        }
        timed(t0, pg.all_reduce(&mut x, ReduceOp::Sum))?;
        Ok("finished (the fault did not happen)".to_string())
    });
    outcome("oom", "rank 1 of 2 capped at 1 GiB more than it has mapped, then a 24 GiB activation", lines(r), t)
}

/// `setrlimit(RLIMIT_AS)`: this process may map at most `extra` bytes more than it has mapped
/// (within the hard limit it already has).
fn cap_address_space(extra: u64) -> anyhow::Result<()> {
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let pages: u64 = statm.split_whitespace().next().unwrap_or("0").parse()?;
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    anyhow::ensure!(
        unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) } == 0,
        "getrlimit: {}",
        std::io::Error::last_os_error()
    );
    lim.rlim_cur = (pages * page + extra).min(lim.rlim_max);
    anyhow::ensure!(
        unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) } == 0,
        "setrlimit: {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

/// Two pipeline neighbours that both send first, 8 MiB each over TCP sockets (each holds about 2
/// MiB, so a send waits for its receiver), under a 3 s timeout; then the same with rank 1
/// receiving first.
fn deadlock() -> Outcome {
    let t = Instant::now();
    // The sockets' buffers as the library sets them (SHARDLAB_SOCK_BUF could make them hold 8 MiB).
    std::env::remove_var("SHARDLAB_SOCK_BUF");
    let run = |fixed: bool| {
        let mut c = cfg(3.0);
        c.transport = DataPath::Tcp;
        lines(spawn_with(threads(2, c), move |pg| {
            let mine = Tensor::ones([2 << 20], (Kind::Float, Device::Cpu)); // 8 MiB
            let mut theirs = Tensor::zeros([2 << 20], (Kind::Float, Device::Cpu));
            let peer = 1 - pg.rank();
            let t0 = Instant::now();
            if fixed && pg.rank() == 1 {
                timed(t0, pg.recv(&mut theirs, peer).and_then(|_| pg.send(&mine, peer)))?;
            } else {
                timed(t0, pg.send(&mine, peer).and_then(|_| pg.recv(&mut theirs, peer)))?;
            }
            let s = t0.elapsed().as_secs_f64();
            Ok(if fixed { format!("[{s:.2} s] exchanged") } else { "exchanged (the fault did not happen)".into() })
        }))
    };
    let mut ranks = run(false);
    ranks.extend(run(true).into_iter().map(|l| format!("fixed, rank 1 receives first: {l}")));
    outcome("deadlock", "ranks 0 and 1 both send 8 MiB to each other first, SHARDLAB_TIMEOUT_S=3", ranks, t)
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let all = [
        Scenario::Kill,
        Scenario::Order,
        Scenario::Stall,
        Scenario::Corrupt,
        Scenario::Fp16,
        Scenario::Oom,
        Scenario::Deadlock,
    ];
    // In a rank process (kill, oom) the scenario's spawn call runs the rank and exits.
    for which in a.only.map_or(all.to_vec(), |o| vec![o]) {
        let o = match which {
            Scenario::Kill => kill(),
            Scenario::Order => order(),
            Scenario::Stall => stall(),
            Scenario::Corrupt => corrupt(),
            Scenario::Fp16 => fp16(),
            Scenario::Oom => oom(),
            Scenario::Deadlock => deadlock(),
        };
        if a.json {
            println!("{}", json!({"scenario": o.name, "fault": o.fault, "ranks": o.ranks, "seconds": o.seconds}));
        } else {
            println!("{} — {} ({:.1} s in all):", o.name, o.fault, o.seconds);
            for l in &o.ranks {
                println!("    {l}");
            }
        }
    }
    Ok(())
}
