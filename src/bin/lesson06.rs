//! Lesson 06 demo — the FSDP round trip, measured: what each rank holds, what moves, how much of
//! the all-gather time prefetching hides; and the speed next to DDP and PyTorch's FSDP2.
//!
//!   cargo run --release --bin lesson06                      # FSDP vs DDP, 2 ranks
//!   cargo run --release --bin lesson06 -- --compare-pytorch # + PyTorch FSDP2 and DDP, like for like
//!
//! The PyTorch comparison pairs equal work: shardlab ZeRO-3 resharding after forward (it
//! recomputes every block in backward) with FSDP2 plus per-block activation checkpointing, and
//! both without resharding (no recompute, one all-gather per block per step); DDP with DDP.
//!
//! Model: the benchmark GPT (4 layers, width 256, 4.2 M params), batch 8 per rank, 1 thread per
//! rank, TCP processes. Units: one per block plus the root (embeddings, ln_f).

use anyhow::Context;
use clap::Parser;
use serde_json::json;
use shardlab::ddp::Variant;
use shardlab::job::{self, GptJob, OneRun, RunSummary};
use shardlab::prelude::*;

#[derive(Parser, Debug)]
#[command(about = "Lesson 06: FSDP (ZeRO-3) vs DDP — memory, traffic, prefetch overlap, speed")]
struct Args {
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    #[arg(long, default_value_t = 12)]
    steps: u64,
    #[arg(long, default_value_t = 3)]
    warmup: u64,
    /// Also run PyTorch FSDP2 and DDP (benches/torch_gpt.py), interleaved, medians.
    #[arg(long)]
    compare_pytorch: bool,
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    #[arg(long)]
    json: bool,
}

fn mb(b: f64) -> f64 {
    b / 1e6
}

fn main() -> anyhow::Result<()> {
    job::run_one_if_asked();
    let a = Args::parse();
    anyhow::ensure!(a.world_size >= 1 && a.steps > a.warmup, "need --world-size ≥ 1 and --steps > --warmup");
    let cfg = GptConfig::bench();
    let corpus = job::TempCorpus::new("lesson06", 1_000_000)?;
    let job = GptJob::benchmark(cfg, corpus.path.clone(), a.steps, a.warmup);
    let one = |strategy| OneRun {
        job: job.clone(),
        strategy,
        world_size: a.world_size,
        backend: Backend::Tcp,
        variant: Variant::Bucketed,
        bucket_cap_bytes: shardlab::ddp::DEFAULT_BUCKET_CAP_BYTES,
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
    let runs: Vec<(Strategy, RunSummary)> = [Strategy::Ddp, Strategy::Zero3]
        .into_iter()
        .map(|s| Ok((s, job::run_isolated(&one(s))?)))
        .collect::<anyhow::Result<_>>()?;
    let psi = cfg.num_params() as f64;
    if !a.json {
        println!(
            "GPT {} params, {} ranks over TCP, batch 8/rank, {} steps ({} warm-up); rank 0's view:",
            cfg.num_params(),
            a.world_size,
            a.steps,
            a.warmup
        );
        println!(
            "{:<6} {:>9} {:>9} {:>9} {:>12} {:>10} {:>12} {:>10} {:>9}",
            "", "params MB", "grads MB", "AdamW MB", "transient MB", "sent MB/st", "gather ms/st", "hidden", "step ms"
        );
    }
    for (s, r) in &runs {
        let m = r.memory;
        let per = |x: f64| 1e3 * x / a.steps as f64;
        let hidden = if r.ddp.gather_s > 0.0 { 1.0 - r.ddp.gather_exposed_s / r.ddp.gather_s } else { 0.0 };
        let row = json!({"strategy": format!("{s:?}").to_lowercase(), "params_bytes": m.params, "grads_bytes": m.grads,
                "optim_bytes": m.optim, "peak_transient_bytes": m.peak_transient, "bytes_sent_per_step": r.bytes_sent_per_step,
                "gather_s": r.ddp.gather_s, "gather_exposed_s": r.ddp.gather_exposed_s, "median_step_s": r.median_step_s,
                "tokens_per_s": r.tokens_per_s, "final_loss": r.final_loss});
        if a.json {
            println!("{row}");
        } else {
            println!(
                "{:<6} {:>9.1} {:>9.1} {:>9.1} {:>12.1} {:>10.1} {:>12.1} {:>9.0}% {:>9.1}",
                format!("{s:?}").to_lowercase(),
                mb(m.params as f64),
                mb(m.grads as f64),
                mb(m.optim as f64),
                mb(m.peak_transient as f64),
                mb(r.bytes_sent_per_step),
                per(r.ddp.gather_s),
                100.0 * hidden.clamp(0.0, 1.0),
                r.median_step_s * 1e3
            );
        }
    }
    if !a.json {
        let n = a.world_size as f64;
        println!(
            "ZeRO model (fp32, K = 8): DDP 16Ψ = {:.1} MB, FSDP 16Ψ/N = {:.1} MB of model states per rank;",
            mb(16.0 * psi),
            mb(16.0 * psi / n)
        );
        println!("traffic per rank (ring): DDP 2(N−1)/N·4Ψ = {:.1} MB, FSDP 3(N−1)/N·4Ψ = {:.1} MB per step (less the root's second gather)", mb(2.0 * (n - 1.0) / n * 4.0 * psi), mb(3.0 * (n - 1.0) / n * 4.0 * psi));
        println!("final loss: DDP {:.6}, FSDP {:.6} (same training)", runs[0].1.final_loss, runs[1].1.final_loss);
    }
    if a.compare_pytorch {
        // Like for like: the same work on both sides. ZeRO-3 resharding after forward recomputes
        // every block (libtorch's saved views would pin a freed unit), so it is paired with FSDP2
        // plus per-block torch.utils.checkpoint; without resharding neither side recomputes and
        // both gather once per block.
        let ours = |reshard: bool, strategy: Strategy| OneRun { reshard_after_forward: reshard, ..one(strategy) };
        let theirs = |reshard: bool, ckpt: Checkpointing| job::PyTorchOptions {
            reshard_after_forward: reshard,
            checkpointing: ckpt,
            ..Default::default()
        };
        struct Pair {
            name: &'static str,
            ours: OneRun,
            strategy: &'static str,
            theirs: job::PyTorchOptions<'static>,
        }
        let pairs = [
            Pair {
                name: "FSDP, reshard + recompute",
                ours: ours(true, Strategy::Zero3),
                strategy: "fsdp",
                theirs: theirs(true, Checkpointing::Full),
            },
            Pair {
                name: "FSDP, no reshard",
                ours: ours(false, Strategy::Zero3),
                strategy: "fsdp",
                theirs: theirs(false, Checkpointing::None),
            },
            Pair { name: "DDP", ours: one(Strategy::Ddp), strategy: "ddp", theirs: theirs(true, Checkpointing::None) },
        ];
        let mut tok: Vec<[Vec<f64>; 2]> = pairs.iter().map(|_| Default::default()).collect();
        let mut sent = vec![0.0; pairs.len()];
        for _ in 0..a.repeats {
            for (k, p) in pairs.iter().enumerate() {
                let r = job::run_isolated(&p.ours)?;
                tok[k][0].push(r.tokens_per_s);
                sent[k] = r.bytes_sent_per_step;
                let py = job::pytorch_train_with(&job, p.strategy, a.world_size, &p.theirs)?;
                tok[k][1].push(py["tokens_per_s"].as_f64().context("tokens_per_s")?);
            }
        }
        let med: Vec<[f64; 2]> =
            tok.iter_mut().map(|[o, t]| [shardlab::bench::median(o), shardlab::bench::median(t)]).collect();
        if a.json {
            for ((p, m), s) in pairs.iter().zip(&med).zip(&sent) {
                println!(
                    "{}",
                    json!({"compare": "pytorch", "config": p.name, "repeats": a.repeats, "world_size": a.world_size,
                           "shardlab_tokens_per_s": m[0], "pytorch_tokens_per_s": m[1], "ratio": m[0] / m[1],
                           "shardlab_bytes_sent_per_step": s})
                );
            }
        } else {
            println!(
                "\nshardlab vs PyTorch 2.11, like for like (median of {} interleaved runs, tokens/s, {} ranks, 1 thread each):",
                a.repeats, a.world_size
            );
            println!("{:<27} {:>10} {:>10} {:>7} {:>17}", "", "shardlab", "PyTorch", "ratio", "sent MB/step (ours)");
            for ((p, m), s) in pairs.iter().zip(&med).zip(&sent) {
                println!("{:<27} {:>10.0} {:>10.0} {:>6.2}× {:>17.1}", p.name, m[0], m[1], m[0] / m[1], mb(*s));
            }
            println!(
                "PyTorch's traffic follows the same ring formulas: FSDP with resharding 3(N−1)/N·4Ψ per step, without \
                 2(N−1)/N·4Ψ, DDP 2(N−1)/N·4Ψ."
            );
        }
    }
    Ok(())
}
