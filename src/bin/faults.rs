//! The fault-injection lab (lesson 10): the failures people meet on real clusters, each provoked
//! on purpose on this CPU, with what every rank is told and how long it took to be told.
//!
//!   cargo run --release --bin faults                 # every scenario, one after another (about 20 s)
//!   cargo run --release --bin faults -- --only order # one of: kill, order, stall, corrupt, fp16, oom, deadlock
//!   cargo run --release --bin faults -- --json       # one JSON object per scenario
//!
//! Each scenario runs real ranks (threads, or processes where a process must die) with the
//! library's own collectives and checkpoints; nothing is simulated except the fault itself. The
//! lesson's "Fault-injection lab" explains each line and its fix; TROUBLESHOOTING.md has the same
//! failures in `train`, and their NCCL equivalents.

use clap::Parser;
use serde_json::json;
use shardlab::checkpoint::{self, SaveOptions};
use shardlab::comm::{DataPath, Fault};
use shardlab::data::{synthetic_corpus, DistributedSampler};
use shardlab::ddp::{self, DataParallel};
use shardlab::prelude::*;
use std::time::{Duration, Instant};

const ALL: [&str; 7] = ["kill", "order", "stall", "corrupt", "fp16", "oom", "deadlock"];

#[derive(Parser, Debug)]
#[command(
    about = "Lesson 10's fault-injection lab: provoke the failures of real clusters and read what each rank is told"
)]
struct Args {
    /// Run only this scenario (kill, order, stall, corrupt, fp16, oom, deadlock).
    #[arg(long)]
    only: Option<String>,
    /// One JSON object per scenario instead of the text.
    #[arg(long)]
    json: bool,
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

/// The ranks' results as lines: `Ok` values as they are, errors as their first line.
fn lines<T>(r: Result<Vec<Result<T, String>>, LaunchError>, ok: impl Fn(T) -> String) -> Vec<String> {
    match r {
        Ok(v) => v.into_iter().map(|x| x.map_or_else(|e| first_line(e), &ok)).collect(),
        Err(e) => e.to_string().lines().map(str::to_string).collect(),
    }
}

fn cfg(timeout_s: f64) -> CommConfig {
    CommConfig::default().with_timeout(Duration::from_secs_f64(timeout_s))
}

/// Rank 2 of 3 process ranks SIGKILLs itself half-way through sending its part of an all-reduce
/// of 16 MiB (the library's test fault: no message, no clean-up, as the OOM killer does it).
fn kill() -> Outcome {
    let mut c = cfg(30.0);
    c.fault = Some(Fault { rank: 2, seq: 2, after_bytes: 4 << 20, kill: true });
    c.transport = DataPath::Tcp;
    let t0 = Instant::now();
    let opts = SpawnOptions::new(3, Backend::Tcp)
        .launch(Launch::Processes)
        .config(c)
        .child_args(vec!["--only".into(), "kill".into()]);
    let r = spawn_with(opts, |pg| {
        let mut t = Tensor::ones([4 << 20], (Kind::Float, Device::Cpu)); // 16 MiB
        pg.all_reduce(&mut t, ReduceOp::Sum)?; // collective #1 (the barrier after rendezvous is #0)
        pg.all_reduce(&mut t, ReduceOp::Sum)?; // #2: rank 2 dies in it
        Ok("finished".to_string())
    });
    let ranks = match r {
        Ok(v) => v,
        Err(e) => e.to_string().lines().map(str::to_string).collect(),
    };
    Outcome {
        name: "kill",
        fault: "rank 2 of 3 SIGKILLed half-way through an all-reduce of 16 MiB".into(),
        ranks,
        seconds: t0.elapsed().as_secs_f64(),
    }
}

/// Two ranks call two collectives in different orders (rank-dependent code).
fn order() -> Outcome {
    let t0 = Instant::now();
    let r = spawn_with(SpawnOptions::new(2, Backend::Tcp).launch(Launch::Threads).config(cfg(30.0)), |pg| {
        let mut a = Tensor::ones([1000], (Kind::Float, Device::Cpu));
        let res = if pg.rank() == 0 {
            pg.all_reduce(&mut a, ReduceOp::Sum).and_then(|_| pg.broadcast(&mut a, 0))
        } else {
            pg.broadcast(&mut a, 0).and_then(|_| pg.all_reduce(&mut a, ReduceOp::Sum))
        };
        Ok(res.map(|_| "finished".to_string()).map_err(|e| e.to_string()))
    });
    Outcome {
        name: "order",
        fault: "rank 0 all-reduces then broadcasts; rank 1 broadcasts then all-reduces".into(),
        ranks: lines(r, |s| s),
        seconds: t0.elapsed().as_secs_f64(),
    }
}

/// Rank 1 stalls for 5 s between collectives (a hung data loader, a debugger, a slow disk) under a
/// 2 s timeout.
fn stall() -> Outcome {
    let t0 = Instant::now();
    let r = spawn_with(SpawnOptions::new(2, Backend::Tcp).launch(Launch::Threads).config(cfg(2.0)), |pg| {
        let mut a = Tensor::ones([1000], (Kind::Float, Device::Cpu));
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_secs(5));
        }
        Ok(pg.all_reduce(&mut a, ReduceOp::Sum).map(|_| "finished".to_string()).map_err(|e| e.to_string()))
    });
    Outcome {
        name: "stall",
        fault: "rank 1 silent for 5 s, SHARDLAB_TIMEOUT_S=2".into(),
        ranks: lines(r, |s| s),
        seconds: t0.elapsed().as_secs_f64(),
    }
}

fn tiny_ddp(pg: &ProcessGroup) -> anyhow::Result<Box<dyn DataParallel + '_>> {
    let m = Gpt::new(GptConfig::tiny(), 5)?;
    Ok(ddp::wrap(pg, Box::new(m), ddp::Variant::Bucketed, ddp::DEFAULT_BUCKET_CAP_BYTES)?)
}

/// A checkpoint saved by 2 ranks; one byte of rank 0's file flipped on disk (a bad disk, a
/// truncated copy); the load.
fn corrupt() -> Outcome {
    let dir = std::env::temp_dir().join(format!("shardlab-faults-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.clone();
    let saved = spawn(2, Backend::Local, move |pg| {
        let dp = tiny_ddp(pg)?;
        let o = AdamW::new(AdamWConfig::default());
        checkpoint::save(&*dp, &o, &d, 1, json!({}), &SaveOptions::default())?;
        Ok(())
    });
    let file = dir.join(checkpoint::step_dir_name(1)).join("rank-00000.safetensors");
    let flipped = saved.map_err(|e| e.to_string()).and_then(|_| {
        let mut bytes = std::fs::read(&file).map_err(|e| e.to_string())?;
        let k = bytes.len() - 3;
        bytes[k] ^= 0x40;
        std::fs::write(&file, &bytes).map_err(|e| e.to_string())
    });
    let t0 = Instant::now();
    let d = dir.clone();
    let ranks = match flipped {
        Err(e) => vec![format!("could not prepare the checkpoint: {e}")],
        Ok(()) => lines(
            spawn(2, Backend::Local, move |pg| {
                let mut dp = tiny_ddp(pg)?;
                let mut o = AdamW::new(AdamWConfig::default());
                Ok(checkpoint::load(&mut *dp, &mut o, &d)
                    .map(|r| format!("loaded step {}", r.step))
                    .map_err(|e| format!("{e:#}")))
            })
            .map(|v| v.into_iter().collect()),
            |s| s,
        ),
    };
    let _ = std::fs::remove_dir_all(&dir);
    let shown = format!("{}/", dir.display());
    let ranks = ranks.into_iter().map(|l| l.replace(&shown, "DIR/")).collect();
    Outcome {
        name: "corrupt",
        fault: "one byte of rank 0's checkpoint file flipped on disk".into(),
        ranks,
        seconds: t0.elapsed().as_secs_f64(),
    }
}

/// fp16 training whose loss scale starts far too high (2³⁰; PyTorch starts at 2¹⁶): the scaled
/// gradients overflow fp16, the scaler skips the step and halves the scale until they fit.
fn fp16() -> Outcome {
    let t0 = Instant::now();
    let r = spawn(2, Backend::Local, |pg| {
        let m = Gpt::new(GptConfig::tiny(), 5)?.with_precision(Precision::Fp16);
        let mut dp = ddp::wrap(pg, Box::new(m), ddp::Variant::Bucketed, ddp::DEFAULT_BUCKET_CAP_BYTES)?;
        let mut o = AdamW::new(AdamWConfig::default());
        let mut scaler = GradScaler::new(2f64.powi(30));
        let s = DistributedSampler::new(16, 8, pg.rank(), pg.world_size(), 3)?;
        let data = synthetic_corpus(4000, 7);
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
            if !out.skipped {
                let first =
                    skipped.first().map_or(String::new(), |e| format!("scale 2^{e} → 2^{}, ", skipped.last().unwrap()));
                return Ok(format!(
                    "steps 0–{} skipped (gradients inf or NaN; {first}halved each time), step {step} taken at scale 2^{exp}, loss {:.3}",
                    step.saturating_sub(1),
                    out.loss
                ));
            }
            skipped.push(exp);
        }
        Ok(format!("{} steps skipped, none taken", skipped.len()))
    });
    Outcome {
        name: "fp16",
        fault: "fp16 training with the loss scale at 2^30".into(),
        ranks: lines(r.map(|v| v.into_iter().map(Ok).collect()), |s| s)
            .into_iter()
            .enumerate()
            .map(|(r, l)| format!("rank {r}: {l}"))
            .collect(),
        seconds: t0.elapsed().as_secs_f64(),
    }
}

/// A micro-batch too large for the memory a rank may use: rank 1 of 2 (processes) caps its
/// address space 1 GiB above what it uses, then allocates the activations of a 2048-row batch.
fn oom() -> Outcome {
    let t0 = Instant::now();
    let opts = SpawnOptions::new(2, Backend::Tcp)
        .launch(Launch::Processes)
        .config(cfg(30.0))
        .child_args(vec!["--only".into(), "oom".into()]);
    let r = spawn_with(opts, |pg| {
        let mut a = Tensor::ones([1000], (Kind::Float, Device::Cpu));
        pg.all_reduce(&mut a, ReduceOp::Sum)?;
        if pg.rank() == 1 {
            cap_address_space(1 << 30)?;
            // One block's activations for 2048 rows of 1024 tokens at width 768, fp32: (B, T, 4C).
            let act = Tensor::f_zeros([2048, 1024, 4 * 768], (Kind::Float, Device::Cpu));
            if let Err(e) = act {
                anyhow::bail!("{}", first_line(e));
            }
        }
        pg.all_reduce(&mut a, ReduceOp::Sum)?;
        Ok("finished".to_string())
    });
    let ranks = match r {
        Ok(v) => v,
        Err(e) => e.to_string().lines().map(str::to_string).collect(),
    };
    Outcome {
        name: "oom",
        fault: "rank 1 of 2 capped at 1 GiB more than it uses, then a 24 GiB activation".into(),
        ranks,
        seconds: t0.elapsed().as_secs_f64(),
    }
}

/// `setrlimit(RLIMIT_AS)`: this process may map at most `extra` bytes more than it has mapped.
fn cap_address_space(extra: u64) -> anyhow::Result<()> {
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let pages: u64 = statm.split_whitespace().next().unwrap_or("0").parse()?;
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    let lim = libc::rlimit { rlim_cur: pages * page + extra, rlim_max: libc::RLIM_INFINITY };
    anyhow::ensure!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) } == 0, "setrlimit failed");
    Ok(())
}

/// Two pipeline neighbours that both send first, 8 MiB each over TCP (a socket holds less, so a
/// send waits for its receiver), under a 3 s timeout; then the same with rank 1 receiving first.
fn deadlock() -> Outcome {
    let t0 = Instant::now();
    let run = |fixed: bool| {
        let mut c = cfg(3.0);
        c.transport = DataPath::Tcp;
        spawn_with(SpawnOptions::new(2, Backend::Tcp).launch(Launch::Threads).config(c), move |pg| {
            let mine = Tensor::ones([2 << 20], (Kind::Float, Device::Cpu)); // 8 MiB
            let mut theirs = Tensor::zeros([2 << 20], (Kind::Float, Device::Cpu));
            let peer = 1 - pg.rank();
            let res = if fixed && pg.rank() == 1 {
                pg.recv(&mut theirs, peer).and_then(|_| pg.send(&mine, peer))
            } else {
                pg.send(&mine, peer).and_then(|_| pg.recv(&mut theirs, peer))
            };
            Ok(res.map(|_| "exchanged".to_string()).map_err(|e| e.to_string()))
        })
    };
    let mut ranks = lines(run(false), |s| s);
    ranks.extend(lines(run(true), |s| s).into_iter().map(|l| format!("fixed (rank 1 receives first): {l}")));
    Outcome {
        name: "deadlock",
        fault: "ranks 0 and 1 both send 8 MiB to each other first, SHARDLAB_TIMEOUT_S=3".into(),
        ranks,
        seconds: t0.elapsed().as_secs_f64(),
    }
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let which: Vec<&str> = match &a.only {
        Some(o) => {
            anyhow::ensure!(ALL.contains(&o.as_str()), "--only {o}: one of {}", ALL.join(", "));
            vec![ALL.iter().copied().find(|n| n == o).unwrap()]
        }
        None => ALL.to_vec(),
    };
    for name in which {
        let o = match name {
            "kill" => kill(),
            "order" => order(),
            "stall" => stall(),
            "corrupt" => corrupt(),
            "fp16" => fp16(),
            "oom" => oom(),
            _ => deadlock(),
        };
        if is_spawned_child() {
            continue;
        }
        if a.json {
            println!("{}", json!({"scenario": o.name, "fault": o.fault, "ranks": o.ranks, "seconds": o.seconds}));
        } else {
            println!("{} — {} ({:.1} s):", o.name, o.fault, o.seconds);
            for l in &o.ranks {
                println!("    {l}");
            }
        }
    }
    Ok(())
}
