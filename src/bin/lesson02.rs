//! Lesson 02 demo — point-to-point & broadcast.
//!
//!   cargo run --release --bin lesson02 -- --world-size 4 --backend tcp --sizes 4K,1M,16M
//!
//! 1. ping-pong between ranks 0 and 1 with send/recv: latency and bandwidth of one link;
//! 2. broadcast with the naive, binomial-tree and chain algorithms at each size;
//! 3. weight sync: each rank starts with different random weights; after broadcasting rank 0's,
//!    every rank's checksum is the same.

use anyhow::Result;
use clap::Parser;
use serde::{Deserialize, Serialize};
use shardlab::bench::{self, BenchRecord, Iters};
use shardlab::comm::OpKind;
use shardlab::prelude::*;

#[derive(Parser, Debug)]
#[command(about = "Lesson 02: send/recv, broadcast algorithms, identical initial weights")]
struct Args {
    #[arg(long, default_value_t = 4)]
    world_size: usize,
    #[arg(long, value_enum, default_value = "tcp")]
    backend: Backend,
    #[arg(long, default_value = "4K,1M,16M")]
    sizes: String,
    #[arg(long)]
    json: bool,
}

#[derive(Serialize, Deserialize, Debug, Default)]
struct Report {
    pingpong: Vec<(u64, f64)>,
    broadcast: Vec<BenchRecord>,
    checksums_before: Vec<String>,
    checksums_after: Vec<String>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.world_size >= 2, "--world-size must be at least 2 (ping-pong needs two ranks)");
    let sizes: Vec<u64> =
        args.sizes.split(',').map(bench::parse_size).collect::<Result<_, _>>().map_err(anyhow::Error::msg)?;
    let impl_name = format!("shardlab-{:?}", args.backend).to_lowercase();
    let reports = spawn(args.world_size, args.backend, |pg| {
        let mut rep = Report::default();
        // 1. ping-pong: rank 0 sends, rank 1 sends back; half the round trip is one message.
        for &b in &sizes {
            rep.pingpong.push((b, bench::pingpong(pg, b, 20)?));
        }
        // 2. broadcast algorithms.
        for algo in [Algo::Naive, Algo::Tree, Algo::Ring] {
            for &b in &sizes {
                rep.broadcast.push(bench::measure(pg, &impl_name, OpKind::Broadcast, algo, b, 2, Iters::Auto)?);
            }
        }
        // 3. identical initial weights.
        let mut params = shardlab::params::random_params(&[4096, 4096, 512], 1000 + pg.rank() as i64);
        let before = shardlab::params::checksum(&params);
        shardlab::params::broadcast_params(pg, &mut params, 0)?;
        let after = shardlab::params::checksum(&params);
        rep.checksums_before.push(format!("{before:016x}"));
        rep.checksums_after.push(format!("{after:016x}"));
        Ok(rep)
    })?;
    let r0 = &reports[0];
    if args.json {
        for (b, t) in &r0.pingpong {
            println!(
                "{}",
                serde_json::json!({"test": "pingpong", "bytes": b, "one_way_s": t, "GBps": *b as f64 / t / 1e9})
            );
        }
        for r in &r0.broadcast {
            println!("{}", serde_json::to_string(r)?);
        }
        for (rank, rep) in reports.iter().enumerate() {
            println!(
                "{}",
                serde_json::json!({"test": "weights", "rank": rank, "checksum_before": rep.checksums_before[0], "checksum_after": rep.checksums_after[0]})
            );
        }
        return Ok(());
    }
    println!("ping-pong between ranks 0 and 1 ({impl_name}):");
    for (b, t) in &r0.pingpong {
        println!("  {:>6}  one way {:>10.1} µs  {:>7.3} GB/s", bench::fmt_size(*b), t * 1e6, *b as f64 / t / 1e9);
    }
    println!("\nbroadcast from rank 0 to {} ranks (slowest rank's median):", args.world_size);
    println!("  {:>6} {:>12} {:>12} {:>12}", "bytes", "naive", "tree", "chain");
    for (i, b) in sizes.iter().enumerate() {
        let t = |k: usize| r0.broadcast[k * sizes.len() + i].time_s * 1e6;
        println!("  {:>6} {:>9.1} µs {:>9.1} µs {:>9.1} µs", bench::fmt_size(*b), t(0), t(1), t(2));
    }
    println!("\nweights: checksum per rank before and after broadcasting rank 0's:");
    for (rank, rep) in reports.iter().enumerate() {
        println!("  rank {rank}: {} -> {}", rep.checksums_before[0], rep.checksums_after[0]);
    }
    let same = reports.iter().all(|r| r.checksums_after == r0.checksums_after);
    println!("  all ranks identical after the broadcast: {same}");
    Ok(())
}
