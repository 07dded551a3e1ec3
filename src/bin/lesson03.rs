//! Lesson 03 demo — the all-reduce family: naive vs ring, next to the α-β model.
//!
//!   cargo run --release --bin lesson03 -- --world-size 4 --backend tcp --sizes 4K,64K,1M,16M
//!
//! Fits α (latency of one small message) and β (seconds per byte of one link) with a ping-pong
//! between ranks 0 and 1, then measures all_reduce, all_gather and reduce_scatter with the naive
//! and the ring algorithm and prints each measurement next to the model's prediction.
//! For the comparison with PyTorch's Gloo, see `cargo run --release --bin collectives -- --compare-gloo`.

use anyhow::Result;
use clap::Parser;
use shardlab::bench::{self, BenchRecord, Iters};
use shardlab::comm::OpKind;
use shardlab::prelude::*;

#[derive(Parser, Debug)]
#[command(about = "Lesson 03: naive vs ring collectives against the α-β model")]
struct Args {
    #[arg(long, default_value_t = 4)]
    world_size: usize,
    #[arg(long, value_enum, default_value = "tcp")]
    backend: Backend,
    #[arg(long, default_value = "4K,64K,1M,16M")]
    sizes: String,
    #[arg(long)]
    json: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.world_size >= 2, "--world-size must be at least 2");
    let sizes: Vec<u64> =
        args.sizes.split(',').map(bench::parse_size).collect::<Result<_, _>>().map_err(anyhow::Error::msg)?;
    let impl_name = format!("shardlab-{:?}", args.backend).to_lowercase();
    let ops = [OpKind::AllReduce, OpKind::AllGather, OpKind::ReduceScatter];
    let out = spawn(args.world_size, args.backend, |pg| {
        let alpha = bench::pingpong(pg, 4, 50)?;
        let big = 16u64 << 20;
        let beta = (bench::pingpong(pg, big, 5)? - alpha).max(1e-12) / big as f64;
        let mut rows: Vec<BenchRecord> = Vec::new();
        for op in ops {
            for algo in [Algo::Naive, Algo::Ring] {
                for &b in &sizes {
                    rows.push(bench::measure(pg, &impl_name, op, algo, b, 2, Iters::Auto)?);
                }
            }
        }
        Ok((alpha, beta, rows))
    })?;
    let (alpha, beta, rows) = &out[0];
    let n = args.world_size;
    let op_of = |name: &str| ops.into_iter().find(|o| o.name() == name).unwrap();
    let algo_of = |name: &str| if name == "naive" { Algo::Naive } else { Algo::Ring };
    if args.json {
        println!("{}", serde_json::json!({"alpha_s": alpha, "beta_s_per_byte": beta, "link_GBps": 1.0 / beta / 1e9}));
        for r in rows {
            let model = bench::model_time(op_of(&r.op), algo_of(&r.algo), n, r.bytes as f64, *alpha, *beta);
            let mut v = serde_json::to_value(r)?;
            v["model_s"] = serde_json::json!(model);
            println!("{v}");
        }
        return Ok(());
    }
    println!(
        "α = {:.1} µs per message, β = 1/{:.2} GB/s per link (ping-pong between ranks 0 and 1)\n",
        alpha * 1e6,
        1.0 / beta / 1e9
    );
    println!("{:<15} {:<6} {:>7} {:>13} {:>13} {:>11}", "op", "algo", "bytes", "measured_us", "model_us", "busbw_GB/s");
    for r in rows {
        let model = bench::model_time(op_of(&r.op), algo_of(&r.algo), n, r.bytes as f64, *alpha, *beta);
        println!(
            "{:<15} {:<6} {:>7} {:>13.1} {:>13.1} {:>11.3}",
            r.op,
            r.algo,
            bench::fmt_size(r.bytes),
            r.time_s * 1e6,
            model * 1e6,
            r.busbw_gbps
        );
    }
    Ok(())
}
