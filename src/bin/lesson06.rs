//! Lesson 06 demo — the FSDP round trip, measured: what each rank holds, what moves, how much of
//! the all-gather time prefetching hides; and the speed next to DDP and PyTorch's FSDP2.
//!
//!   cargo run --release --bin lesson06                      # FSDP vs DDP, 2 ranks
//!   cargo run --release --bin lesson06 -- --compare-pytorch # + PyTorch FSDP2 (fully_shard per block)
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
    };
    let runs: Vec<(Strategy, RunSummary)> = [Strategy::Ddp, Strategy::Fsdp]
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
        let mut m: [Vec<f64>; 4] = Default::default();
        for _ in 0..a.repeats {
            m[0].push(job::run_isolated(&one(Strategy::Fsdp))?.tokens_per_s);
            m[1].push(
                job::pytorch_train(&job, "fsdp", a.world_size)?["tokens_per_s"].as_f64().context("tokens_per_s")?,
            );
            m[2].push(job::run_isolated(&one(Strategy::Ddp))?.tokens_per_s);
            m[3].push(job::pytorch_train(&job, "ddp", a.world_size)?["tokens_per_s"].as_f64().context("tokens_per_s")?);
        }
        let med: Vec<f64> = m.iter_mut().map(|v| shardlab::bench::median(v)).collect();
        let v = json!({"compare": "pytorch", "repeats": a.repeats, "world_size": a.world_size,
                "fsdp_tokens_per_s": {"shardlab": med[0], "pytorch": med[1], "ratio": med[0] / med[1]},
                "ddp_tokens_per_s": {"shardlab": med[2], "pytorch": med[3], "ratio": med[2] / med[3]},
                "shardlab_fsdp_over_ddp": med[0] / med[2]});
        if a.json {
            println!("{v}");
        } else {
            println!(
                "\nshardlab vs PyTorch 2.11 (median of {} interleaved runs, tokens/s, {} ranks, 1 thread each):",
                a.repeats, a.world_size
            );
            println!("{:<26} {:>10} {:>10} {:>7}", "", "shardlab", "PyTorch", "ratio");
            println!("{:<26} {:>10.0} {:>10.0} {:>6.2}×", "FSDP (ZeRO-3 / FSDP2)", med[0], med[1], med[0] / med[1]);
            println!("{:<26} {:>10.0} {:>10.0} {:>6.2}×", "DDP", med[2], med[3], med[2] / med[3]);
            println!("shardlab FSDP / shardlab DDP: {:.2}", med[0] / med[2]);
        }
    }
    Ok(())
}
