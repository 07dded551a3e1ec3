//! `collectives` — nccl-tests for shardlab: time all_reduce, broadcast, all_gather and
//! reduce_scatter over a range of sizes, optionally side by side with PyTorch's own Gloo backend.
//!
//!   cargo run --release --bin collectives -- --backend tcp --world-size 2 \
//!       --ops all_reduce,broadcast,all_gather,reduce_scatter --sizes 4K,64K,1M,16M,64M --json
//!   cargo run --release --bin collectives -- --world-size 4 --compare-gloo --limits
//!
//! bytes = the full tensor (all_reduce, broadcast), the full gathered output (all_gather), the full
//! input (reduce_scatter); time = the slowest rank's median after warm-up; busbw as nccl-tests.

use anyhow::{bail, Context, Result};
use clap::Parser;
use shardlab::bench::{self, BenchRecord, Iters};
use shardlab::comm::{Algo, OpKind};
use shardlab::prelude::*;

#[derive(Parser, Debug)]
#[command(about = "Benchmark shardlab's collectives (and PyTorch Gloo's) like nccl-tests")]
struct Args {
    /// local: ranks are threads; tcp: ranks are processes talking over loopback TCP.
    #[arg(long, value_enum, default_value = "tcp")]
    backend: Backend,
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    /// Comma-separated: all_reduce,broadcast,all_gather,reduce_scatter.
    #[arg(long, default_value = "all_reduce,broadcast,all_gather,reduce_scatter")]
    ops: String,
    /// Comma-separated sizes in bytes, K/M/G suffixes (KiB/MiB/GiB).
    #[arg(long, default_value = "4K,64K,1M,16M,64M")]
    sizes: String,
    /// `default` (ring for all_reduce/all_gather/reduce_scatter, tree for broadcast), `all`, or a
    /// comma list of naive,ring,tree (each op runs those it supports).
    #[arg(long, default_value = "default")]
    algos: String,
    /// Timed iterations per point: `auto` (≈0.3 s each, 5..200) or a number.
    #[arg(long, default_value = "auto")]
    iters: String,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Also run PyTorch's Gloo backend (benches/gloo_collectives.py) on the same points and show the ratio.
    #[arg(long)]
    compare_gloo: bool,
    /// Also measure the ceilings: one loopback TCP stream and memcpy.
    #[arg(long)]
    limits: bool,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

fn algos_for(spec: &str, op: OpKind) -> Result<Vec<Algo>> {
    let supported = Algo::supported(op);
    Ok(match spec {
        "default" => vec![match op {
            OpKind::Broadcast => Algo::Tree,
            _ => Algo::Ring,
        }],
        "all" => supported.to_vec(),
        list => {
            let mut v = Vec::new();
            for name in list.split(',') {
                let a = <Algo as clap::ValueEnum>::from_str(name.trim(), true)
                    .map_err(|_| anyhow::anyhow!("unknown algorithm {name:?}"))?;
                if supported.contains(&a) {
                    v.push(a);
                }
            }
            v
        }
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.world_size == 0 {
        bail!("--world-size must be at least 1");
    }
    let ops: Vec<OpKind> = args
        .ops
        .split(',')
        .map(|s| {
            bench::op_from_name(s.trim())
                .with_context(|| format!("unknown op {s:?} (all_reduce, broadcast, all_gather, reduce_scatter)"))
        })
        .collect::<Result<_>>()?;
    let sizes: Vec<u64> =
        args.sizes.split(',').map(bench::parse_size).collect::<Result<_, _>>().map_err(anyhow::Error::msg)?;
    let iters = match args.iters.as_str() {
        "auto" => Iters::Auto,
        k => Iters::Fixed(k.parse().context("--iters takes `auto` or a number")?),
    };
    let mut plan = Vec::new();
    for &op in &ops {
        for algo in algos_for(&args.algos, op)? {
            for &b in &sizes {
                plan.push((op, algo, b));
            }
        }
    }
    let impl_name = format!("shardlab-{}", if args.backend == Backend::Tcp { "tcp" } else { "local" });
    let (warmup, json, total) = (args.warmup, args.json, plan.len() as u64);
    let records = spawn(args.world_size, args.backend, |pg| {
        let bar = (pg.rank() == 0).then(|| {
            let b = indicatif::ProgressBar::new(total);
            b.set_style(indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").unwrap());
            b
        });
        let mut out = Vec::new();
        for &(op, algo, bytes) in &plan {
            if let Some(b) = &bar {
                b.set_message(format!("{} {} {}", op.name(), algo.name(), bench::fmt_size(bytes)));
            }
            out.push(bench::measure(pg, &impl_name, op, algo, bytes, warmup, iters)?);
            if let Some(b) = &bar {
                b.inc(1);
            }
        }
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        Ok(if pg.rank() == 0 { out } else { Vec::new() })
    })?;
    let mut rows: Vec<BenchRecord> = records.into_iter().next().unwrap_or_default();

    if args.compare_gloo {
        rows.extend(run_gloo(&args)?);
    }
    if args.limits {
        let tcp = bench::loopback_tcp_throughput(1 << 30)?;
        let mem = bench::memcpy_throughput(256 << 20, 8);
        rows.push(BenchRecord {
            impl_: "limit".into(),
            op: "tcp_stream".into(),
            algo: "-".into(),
            world_size: 1,
            bytes: 1 << 30,
            median_s: (1u64 << 30) as f64 / tcp,
            algbw_gbps: tcp / 1e9,
            busbw_gbps: tcp / 1e9,
            iters: 1,
        });
        rows.push(BenchRecord {
            impl_: "limit".into(),
            op: "memcpy".into(),
            algo: "-".into(),
            world_size: 1,
            bytes: 256 << 20,
            median_s: (256u64 << 20) as f64 / mem,
            algbw_gbps: mem / 1e9,
            busbw_gbps: mem / 1e9,
            iters: 8,
        });
    }
    if json {
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
    } else {
        print_table(&rows);
    }
    Ok(())
}

fn run_gloo(args: &Args) -> Result<Vec<BenchRecord>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let py = root.join(".venv/bin/python");
    let script = root.join("benches/gloo_collectives.py");
    if !py.exists() {
        bail!("{} not found: run `bash .ci/setup` first", py.display());
    }
    let out = std::process::Command::new(py)
        .arg(script)
        .args([
            "--world-size",
            &args.world_size.to_string(),
            "--ops",
            &args.ops,
            "--sizes",
            &args.sizes,
            "--iters",
            &args.iters,
            "--warmup",
            &args.warmup.to_string(),
            "--json",
        ])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running the Gloo benchmark")?;
    if !out.status.success() {
        bail!("the Gloo benchmark failed ({})", out.status);
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.trim_start().starts_with('{'))
        .map(|l| serde_json::from_str(l).with_context(|| format!("bad line from the Gloo benchmark: {l}")))
        .collect()
}

fn print_table(rows: &[BenchRecord]) {
    println!(
        "{:<15} {:<15} {:<6} {:>5} {:>8} {:>12} {:>11} {:>11} {:>9}",
        "impl", "op", "algo", "n", "bytes", "median_us", "algbw_GB/s", "busbw_GB/s", "vs_gloo"
    );
    for r in rows {
        let gloo = rows
            .iter()
            .find(|g| g.impl_ == "gloo" && g.op == r.op && g.world_size == r.world_size && g.bytes == r.bytes);
        let ratio = match gloo {
            Some(g) if r.impl_ != "gloo" && r.impl_ != "limit" => format!("{:.2}x", r.busbw_gbps / g.busbw_gbps),
            _ => String::new(),
        };
        println!(
            "{:<15} {:<15} {:<6} {:>5} {:>8} {:>12.1} {:>11.3} {:>11.3} {:>9}",
            r.impl_,
            r.op,
            r.algo,
            r.world_size,
            bench::fmt_size(r.bytes),
            r.median_s * 1e6,
            r.algbw_gbps,
            r.busbw_gbps,
            ratio
        );
    }
}
