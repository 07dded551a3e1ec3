//! Lesson 01 demo — process groups & rendezvous.
//!
//!   cargo run --release --bin lesson01 -- --world-size 4 --backend tcp
//!   cargo run --release --bin lesson01 -- --world-size 3 --missing-rank 2      # a rank never joins
//!
//! Starts `world_size` ranks (threads for `local`, processes for `tcp`), has each report who it is,
//! times the barrier, and with `--missing-rank` shows what the others see when one rank never comes.

use anyhow::Result;
use clap::Parser;
use serde::{Deserialize, Serialize};
use shardlab::bench::median;
use shardlab::prelude::*;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(about = "Lesson 01: ranks, rendezvous and barriers")]
struct Args {
    #[arg(long, default_value_t = 4)]
    world_size: usize,
    #[arg(long, value_enum, default_value = "tcp")]
    backend: Backend,
    /// Barriers to time per rank.
    #[arg(long, default_value_t = 200)]
    barriers: usize,
    /// Start every rank but this one (tcp, threads) and show the rendezvous error the others get.
    #[arg(long)]
    missing_rank: Option<usize>,
    /// Rendezvous timeout for --missing-rank, seconds.
    #[arg(long, default_value_t = 2.0)]
    timeout: f64,
    #[arg(long)]
    json: bool,
}

#[derive(Serialize, Deserialize, Debug)]
struct RankReport {
    rank: usize,
    local_rank: usize,
    world_size: usize,
    pid: u32,
    backend: String,
    barrier_median_us: f64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(missing) = args.missing_rank {
        return missing_rank(&args, missing);
    }
    let t = Instant::now();
    let reports = spawn(args.world_size, args.backend, |pg| {
        pg.barrier()?; // everybody is up
        let mut times = Vec::with_capacity(args.barriers);
        for _ in 0..args.barriers {
            let t = Instant::now();
            pg.barrier()?;
            times.push(t.elapsed().as_secs_f64());
        }
        Ok(RankReport {
            rank: pg.rank(),
            local_rank: pg.local_rank(),
            world_size: pg.world_size(),
            pid: std::process::id(),
            backend: format!("{:?}", pg.backend()).to_lowercase(),
            barrier_median_us: median(&mut times) * 1e6,
        })
    })?;
    let wall = t.elapsed();
    if args.json {
        for r in &reports {
            println!("{}", serde_json::to_string(r)?);
        }
        println!(
            "{}",
            serde_json::json!({"summary": true, "world_size": args.world_size, "backend": format!("{:?}", args.backend).to_lowercase(), "start_to_finish_s": wall.as_secs_f64()})
        );
    } else {
        println!(
            "{:>4} {:>10} {:>6} {:>8} {:>8} {:>16}",
            "rank", "local_rank", "world", "pid", "backend", "barrier_median"
        );
        for r in &reports {
            println!(
                "{:>4} {:>10} {:>6} {:>8} {:>8} {:>13.1} µs",
                r.rank, r.local_rank, r.world_size, r.pid, r.backend, r.barrier_median_us
            );
        }
        println!("started, met and finished {} ranks in {:.1} ms", args.world_size, wall.as_secs_f64() * 1e3);
    }
    Ok(())
}

/// Every rank but `missing` joins over TCP (as threads, so we can watch them all).
fn missing_rank(args: &Args, missing: usize) -> Result<()> {
    anyhow::ensure!(missing < args.world_size, "--missing-rank must be below --world-size");
    let port = shardlab::launch::free_port().map_err(anyhow::Error::msg)?;
    // The ranks are started by hand here (not by `spawn`), so they share a secret we make for them.
    let secret = Some(shardlab::comm::auth::Secret::generate()?);
    let cfg = CommConfig { rendezvous_timeout: Duration::from_secs_f64(args.timeout), secret, ..CommConfig::default() };
    let t = Instant::now();
    let results: Vec<(usize, String)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..args.world_size)
            .filter(|&r| r != missing)
            .map(|rank| {
                let cfg = cfg.clone();
                s.spawn(move || {
                    let init = TcpInit::loopback(rank, args.world_size, port);
                    let msg = match ProcessGroup::init_tcp(&init, cfg) {
                        Ok(_) => "joined (unexpected!)".to_string(),
                        Err(e) => e.to_string(),
                    };
                    (rank, msg)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, msg) in &results {
        if args.json {
            println!("{}", serde_json::json!({"rank": rank, "error": msg}));
        } else {
            println!("rank {rank}: {msg}");
        }
    }
    if !args.json {
        println!("every present rank gave up after {:.1} s instead of hanging", t.elapsed().as_secs_f64());
    }
    Ok(())
}
