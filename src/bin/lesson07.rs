//! Lesson 07 demo — ZeRO stages 1/2/3, measured: the bytes each rank holds in parameters,
//! gradients and optimizer state (counted from its tensors), its peak RSS, and the traffic per
//! step, next to the ZeRO model.
//!
//!   cargo run --release --bin lesson07                  # 2 ranks, a 60 M-parameter GPT
//!   cargo run --release --bin lesson07 -- --world-size 4
//!
//! Training here is fp32 with AdamW: 4 bytes of weights, 4 of gradients and K = 8 of optimizer
//! state (m and v; no separate master copy) per parameter, so the ZeRO model reads
//! DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N.

use clap::Parser;
use serde_json::json;
use shardlab::ddp::Variant;
use shardlab::job::{self, DataSource, GptJob, OneRun};
use shardlab::prelude::*;

#[derive(Parser, Debug)]
#[command(about = "Lesson 07: ZeRO stages 1/2/3 — memory per rank and traffic, measured vs the model")]
struct Args {
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    #[arg(long, default_value_t = 8)]
    n_layer: i64,
    #[arg(long, default_value_t = 768)]
    n_embd: i64,
    #[arg(long, default_value_t = 3)]
    steps: u64,
    #[arg(long)]
    json: bool,
}

fn main() -> anyhow::Result<()> {
    job::run_one_if_asked();
    let a = Args::parse();
    anyhow::ensure!(a.world_size >= 1 && a.steps >= 2, "need --world-size ≥ 1 and --steps ≥ 2");
    let cfg = GptConfig { vocab_size: 4096, block_size: 64, n_layer: a.n_layer, n_head: 12, n_embd: a.n_embd };
    cfg.validate()?;
    let psi = cfg.num_params() as f64;
    let n = a.world_size as f64;
    let job = GptJob {
        model: cfg,
        batch_size: 2,
        accum: 1,
        steps: a.steps,
        warmup: 1,
        optim: AdamWConfig::default(),
        lr_schedule: None,
        grad_clip: None,
        data: DataSource::Synthetic { tokens: 100_000, seed: 1 },
        seed: 1,
        init: None,
        save: None,
        checkpoint: Default::default(),
        eval: Default::default(),
    };
    let strategies = [Strategy::Ddp, Strategy::Zero1, Strategy::Zero2, Strategy::Zero3];
    // The ZeRO model for fp32 AdamW (4-byte weights and gradients, K = 8), from shardlab::memory.
    let zero = shardlab::memory::model_state_bytes_with(psi, n, 4.0, 4.0, shardlab::memory::K_FP32_ADAM);
    let model_bytes = |s: Strategy| match s {
        Strategy::Ddp => zero.ddp,
        Strategy::Zero1 => zero.zero1,
        Strategy::Zero2 => zero.zero2,
        _ => zero.zero3,
    };
    if !a.json {
        println!(
            "GPT {} params (Ψ), {} ranks (TCP processes), fp32 AdamW; rank 0, after {} steps:",
            cfg.num_params(),
            a.world_size,
            a.steps
        );
        println!(
            "{:<6} {:>9} {:>9} {:>9} {:>11} {:>11} {:>12} {:>9} {:>11}",
            "", "params MB", "grads MB", "AdamW MB", "states MB", "model MB", "transient MB", "RSS MB", "sent MB/st"
        );
    }
    for s in strategies {
        let r = job::run_isolated(&OneRun {
            job: job.clone(),
            strategy: s,
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
        })?;
        let m = r.memory;
        let rss = r.peak_rss_bytes.unwrap_or(0) as f64;
        if a.json {
            println!(
                "{}",
                json!({"strategy": format!("{s:?}").to_lowercase(), "params": psi, "world_size": a.world_size,
                "params_bytes": m.params, "grads_bytes": m.grads, "optim_bytes": m.optim, "model_state_bytes": m.model_states(),
                "zero_model_bytes": model_bytes(s), "peak_transient_bytes": m.peak_transient, "peak_rss_bytes": rss,
                "bytes_sent_per_step": r.bytes_sent_per_step, "final_loss": r.final_loss})
            );
        } else {
            println!(
                "{:<6} {:>9.1} {:>9.1} {:>9.1} {:>11.1} {:>11.1} {:>12.1} {:>9.0} {:>11.1}",
                format!("{s:?}").to_lowercase(),
                m.params as f64 / 1e6,
                m.grads as f64 / 1e6,
                m.optim as f64 / 1e6,
                m.model_states() as f64 / 1e6,
                model_bytes(s) / 1e6,
                m.peak_transient as f64 / 1e6,
                rss / 1e6,
                r.bytes_sent_per_step / 1e6
            );
        }
    }
    if !a.json {
        println!("model MB: the ZeRO model's model states (DDP 16Ψ, ZeRO-1 8Ψ+8Ψ/N, ZeRO-2 4Ψ+12Ψ/N, ZeRO-3 16Ψ/N); states MB: counted from the tensors each rank keeps.");
        println!("RSS: the whole rank process (libtorch, activations, buffers), peak over the run.");
    }
    Ok(())
}
