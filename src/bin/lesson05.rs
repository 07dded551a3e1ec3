//! Lesson 05 demo — production DDP: buckets and overlap, measured; and the speed comparison with
//! PyTorch's DDP.
//!
//!   cargo run --release --bin lesson05                      # naive vs bucketed (several caps), 2 ranks
//!   cargo run --release --bin lesson05 -- --compare-pytorch # + shardlab vs PyTorch, single and DDP
//!
//! Model: the benchmark GPT (4 layers, 4 heads, width 256, block 128, vocab 4096, 4.2 M params),
//! batch 8 per rank, 1 intra-op thread per rank, the synthetic corpus. Each configuration runs in
//! a fresh process of this program (`job::run_isolated`), so every run starts its own ranks.
//! For each DDP run: median step time, how long the gradient all-reduces ran, how long the
//! training thread waited for them after backward (exposed), and the hidden fraction.

use anyhow::Context;
use clap::Parser;
use serde_json::json;
use shardlab::ddp::{assign_buckets, Variant};
use shardlab::job::{self, GptJob, OneRun};
use shardlab::prelude::*;

fn pt(job: &GptJob, strategy: &str, n: usize) -> anyhow::Result<f64> {
    job::pytorch_train(job, strategy, n)?["tokens_per_s"].as_f64().context("no tokens_per_s in PyTorch's summary")
}

#[derive(Parser, Debug)]
#[command(about = "Lesson 05: naive vs bucketed+overlapped DDP, and shardlab vs PyTorch DDP")]
struct Args {
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    #[arg(long, value_enum, default_value = "tcp")]
    backend: Backend,
    #[arg(long, default_value_t = 12)]
    steps: u64,
    #[arg(long, default_value_t = 3)]
    warmup: u64,
    /// Variants to run: naive, bucketed or both.
    #[arg(long, default_value = "both")]
    variant: String,
    /// Bucket caps (MiB) for the bucketed variant.
    #[arg(long, default_value = "25,4,1,0.25")]
    bucket_mb: String,
    /// Also run shardlab and PyTorch (benches/torch_gpt.py) single-process and DDP, interleaved.
    #[arg(long)]
    compare_pytorch: bool,
    /// Bucket cap (MiB) of shardlab's DDP in the PyTorch comparison (PyTorch's default: 25).
    #[arg(long, default_value_t = 25.0)]
    compare_bucket_mb: f64,
    /// Repeats of the comparison (medians are reported).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Smaller model (2 layers, width 128) for a quick look.
    #[arg(long)]
    small: bool,
    #[arg(long)]
    json: bool,
}

fn main() -> anyhow::Result<()> {
    job::run_one_if_asked();
    let a = Args::parse();
    anyhow::ensure!(a.world_size >= 1 && a.steps > a.warmup, "need --world-size ≥ 1 and --steps > --warmup");
    let cfg = if a.small {
        GptConfig { vocab_size: 4096, block_size: 128, n_layer: 2, n_head: 4, n_embd: 128 }
    } else {
        GptConfig::bench()
    };
    let corpus = job::TempCorpus::new("lesson05", 1_000_000)?;
    let job = GptJob::benchmark(cfg, corpus.path.clone(), a.steps, a.warmup);
    let one = |strategy, n, variant, cap: usize| OneRun {
        job: job.clone(),
        strategy,
        world_size: n,
        backend: a.backend,
        variant,
        bucket_cap_bytes: cap,
        threads: Some(1),
        checkpointing: Checkpointing::None,
        reshard_after_forward: true,
        precision: shardlab::precision::Precision::Fp32,
        reduce_dtype: shardlab::precision::Precision::Fp32,
        offload: false,
        device: Default::default(),
        tp: 1,
        pp: Default::default(),
    };
    let sizes: Vec<usize> = cfg.param_shapes().iter().map(|(_, s)| 4 * s.iter().product::<i64>() as usize).collect();
    let mut rows = Vec::new();
    let mut configs: Vec<(Variant, f64)> = Vec::new();
    if a.variant == "naive" || a.variant == "both" {
        configs.push((Variant::Naive, 0.0));
    }
    if a.variant == "bucketed" || a.variant == "both" {
        for mb in a.bucket_mb.split(',') {
            configs.push((Variant::Bucketed, mb.trim().parse().context("--bucket-mb: numbers in MiB")?));
        }
    }
    if !a.json {
        println!(
            "DDP on {} ranks ({:?}), GPT {} params ({:.1} MB of f32 gradients), batch 8/rank, {} steps ({} warm-up):",
            a.world_size,
            a.backend,
            cfg.num_params(),
            sizes.iter().sum::<usize>() as f64 / 1e6,
            a.steps,
            a.warmup
        );
        println!(
            "{:<10} {:>8} {:>8} {:>10} {:>10} {:>12} {:>12} {:>8}",
            "variant", "cap MiB", "buckets", "step ms", "tokens/s", "comm ms/step", "exposed ms", "hidden"
        );
    }
    for (variant, mb) in configs {
        let cap = (mb * 1024.0 * 1024.0) as usize;
        let buckets = if variant == Variant::Naive { sizes.len() } else { assign_buckets(&sizes, cap.max(1)).len() };
        let s = job::run_isolated(&one(Strategy::Ddp, a.world_size, variant, cap))?;
        let per = |x: f64| 1e3 * x / a.steps as f64;
        let row = json!({"variant": format!("{variant:?}").to_lowercase(), "bucket_mb": mb, "messages": buckets,
            "median_step_s": s.median_step_s, "tokens_per_s": s.tokens_per_s, "comm_s": s.comm_s,
            "exposed_comm_s": s.exposed_comm_s, "hidden_comm_fraction": s.hidden_comm_fraction, "world_size": a.world_size});
        if a.json {
            println!("{row}");
        } else {
            println!(
                "{:<10} {:>8} {:>8} {:>10.1} {:>10.0} {:>12.1} {:>12.1} {:>7.0}%",
                format!("{variant:?}").to_lowercase(),
                if variant == Variant::Naive { "-".into() } else { format!("{mb}") },
                buckets,
                s.median_step_s * 1e3,
                s.tokens_per_s,
                per(s.comm_s),
                per(s.exposed_comm_s),
                100.0 * s.hidden_comm_fraction
            );
        }
        rows.push(row);
    }
    if a.compare_pytorch {
        let cap = (a.compare_bucket_mb * 1024.0 * 1024.0) as usize;
        let mut m: [Vec<f64>; 4] = Default::default();
        for _ in 0..a.repeats {
            m[0].push(job::run_isolated(&one(Strategy::Single, 1, Variant::Bucketed, cap))?.tokens_per_s);
            m[1].push(pt(&job, "single", 1)?);
            m[2].push(job::run_isolated(&one(Strategy::Ddp, a.world_size, Variant::Bucketed, cap))?.tokens_per_s);
            m[3].push(pt(&job, "ddp", a.world_size)?);
        }
        let med: Vec<f64> = m.iter_mut().map(|v| shardlab::bench::median(v)).collect();
        let cmp = json!({"compare": "pytorch", "repeats": a.repeats, "world_size": a.world_size,
            "single_tokens_per_s": {"shardlab": med[0], "pytorch": med[1], "ratio": med[0] / med[1]},
            "ddp_tokens_per_s": {"shardlab": med[2], "pytorch": med[3], "ratio": med[2] / med[3]},
            "scaling": {"shardlab": med[2] / med[0], "pytorch": med[3] / med[1]},
            "shardlab_bucket_mb": a.compare_bucket_mb});
        if a.json {
            println!("{cmp}");
        } else {
            println!(
                "\nshardlab vs PyTorch 2.11 (median of {} interleaved runs, tokens/s, 1 thread per rank):",
                a.repeats
            );
            println!("{:<28} {:>10} {:>10} {:>7}", "", "shardlab", "PyTorch", "ratio");
            println!("{:<28} {:>10.0} {:>10.0} {:>6.2}×", "single process (eager)", med[0], med[1], med[0] / med[1]);
            println!(
                "{:<28} {:>10.0} {:>10.0} {:>6.2}×",
                format!("DDP, {} ranks (Gloo for PT)", a.world_size),
                med[2],
                med[3],
                med[2] / med[3]
            );
            println!(
                "{:<28} {:>9.2}× {:>9.2}×",
                format!("scaling {}-rank / single", a.world_size),
                med[2] / med[0],
                med[3] / med[1]
            );
        }
    }
    Ok(())
}
