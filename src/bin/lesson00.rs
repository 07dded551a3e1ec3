//! Lesson 00 — the map: the same GPT under every strategy the course builds, measured side by side.
//!
//! ```text
//! cargo run --release --bin lesson00                       # 2 ranks, the benchmark GPT, 6 steps each
//! cargo run --release --bin lesson00 -- --world-size 4 --steps 10 --json
//! ```
//!
//! Each strategy runs in a fresh process tree (`shardlab::job::run_isolated`): ranks are processes
//! on this machine, one libtorch thread each. "held" is counted from the tensors rank 0 keeps
//! between steps (parameters, gradients, AdamW state); "model" is the ZeRO model's figure for fp32
//! AdamW (`shardlab::memory`); "sent" is the bytes rank 0's group really sent per step; "exposed" is
//! the communication time per step not hidden behind compute (for the pipeline, its bubble).
//! Lessons 12–13 add the tp and pp rows: tensor and pipeline parallelism over all the ranks.

use clap::Parser;
use serde_json::json;
use shardlab::ddp::Variant;
use shardlab::job::{self, DataSource, GptJob, OneRun};
use shardlab::memory::{model_state_bytes_with, K_FP32_ADAM};
use shardlab::prelude::*;

#[derive(Parser, Debug)]
#[command(about = "Lesson 00: the same GPT under every strategy — memory per rank, bytes per step, speed")]
struct Args {
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    /// Training steps per strategy (the first two are warm-up).
    #[arg(long, default_value_t = 6)]
    steps: u64,
    /// Sequences per rank per step.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// One JSON object per strategy.
    #[arg(long)]
    json: bool,
}

/// Parameters pipeline rank 0 holds when the GPT's stages are cut over `p` ranks.
fn rank0_params(cfg: &GptConfig, p: usize) -> anyhow::Result<f64> {
    let mine = shardlab::pipeline::train::params_of_ranks(cfg, p).map_err(anyhow::Error::msg)?.swap_remove(0);
    let shapes = cfg.param_shapes();
    Ok(mine.iter().map(|&k| shapes[k].1.iter().product::<i64>() as f64).sum())
}

fn main() -> anyhow::Result<()> {
    job::run_one_if_asked();
    let a = Args::parse();
    anyhow::ensure!(a.world_size >= 1 && a.steps >= 1, "need --world-size ≥ 1 and --steps ≥ 1");
    let cfg = GptConfig::bench();
    let psi = cfg.num_params() as f64;
    let n = a.world_size as f64;
    let zero = model_state_bytes_with(psi, n, 4.0, 4.0, K_FP32_ADAM);
    let job = GptJob {
        model: cfg,
        batch_size: a.batch_size,
        accum: 1,
        steps: a.steps,
        warmup: 2,
        optim: AdamWConfig::default(),
        lr_schedule: None,
        grad_clip: None,
        data: DataSource::Synthetic { tokens: 1_000_000, seed: 1 },
        seed: 1,
        init: None,
        save: None,
        checkpoint: Default::default(),
        eval: Default::default(),
    };
    if !a.json {
        println!(
            "GPT {} params (Ψ; {} layers × {}), fp32 AdamW, batch {}/rank × {} tokens, {} rank(s) as processes, \
             {} steps each; rank 0's figures:\n",
            cfg.num_params(),
            cfg.n_layer,
            cfg.n_embd,
            a.batch_size,
            cfg.block_size,
            a.world_size,
            a.steps
        );
        println!(
            "{:<8} {:>9} {:>9} {:>8} {:>11} {:>10} {:>12} {:>11}  {}",
            "strategy", "held MB", "model MB", "RSS MB", "sent MB/st", "tokens/s", "exposed ms", "final loss", "lesson"
        );
    }
    let rows = [
        (Strategy::Single, 1, 1, 1, "04 (one process, whole batch)", psi * 16.0),
        (Strategy::Ddp, a.world_size, 1, 1, "04–05", zero.ddp),
        (Strategy::Zero1, a.world_size, 1, 1, "07", zero.zero1),
        (Strategy::Zero2, a.world_size, 1, 1, "07", zero.zero2),
        (Strategy::Zero3, a.world_size, 1, 1, "06–07 (= FSDP)", zero.zero3),
        // Tensor parallel over all the ranks (Megatron): every matrix split, the same rows on each.
        (Strategy::Ddp, a.world_size, a.world_size, 1, "12", psi * 16.0 / a.world_size as f64),
        // One pipeline over all the ranks: the stages cut over them, 1F1B, 4 micro-batches. The
        // model: 16 bytes per parameter of rank 0's stages.
        (Strategy::Ddp, a.world_size, 1, a.world_size, "13", 16.0 * rank0_params(&cfg, a.world_size)?),
    ];
    for (strategy, world_size, tp, pp, lesson, model) in rows {
        // One process takes the whole global batch: the same work per step as the N ranks together.
        let job = GptJob { batch_size: a.batch_size * a.world_size / world_size, ..job.clone() };
        let r = job::run_isolated(&OneRun {
            job,
            strategy,
            world_size,
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
            tp,
            pp: shardlab::pipeline::PipelineConfig { stages: pp, ..Default::default() },
        })?;
        let name = match () {
            _ if tp > 1 => "tp".to_string(),
            _ if pp > 1 => "pp".to_string(),
            _ => format!("{strategy:?}").to_lowercase(),
        };
        // TP's all-reduces sit inside every layer and are not timed apart from compute; a
        // pipeline's cost is its idle time, the bubble.
        let exposed_ms = r.exposed_comm_s / a.steps as f64 * 1e3;
        let exposed = match &r.pipeline {
            Some(p) => format!("bubble {:.0}%", 100.0 * p.bubble),
            None if tp > 1 => "-".to_string(),
            None => format!("{exposed_ms:.1}"),
        };
        if a.json {
            println!(
                "{}",
                json!({"strategy": name, "world_size": world_size, "params": psi,
                "held_bytes": r.memory.model_states(), "zero_model_bytes": model, "peak_rss_bytes": r.peak_rss_bytes,
                "bytes_sent_per_step": r.bytes_sent_per_step, "tokens_per_s": r.tokens_per_s,
                "exposed_comm_ms_per_step": (tp == 1 && pp == 1).then_some(exposed_ms),
                "bubble": r.pipeline.as_ref().map(|p| p.bubble),
                "final_loss": r.final_loss, "measured_steps": r.measured_steps})
            );
        } else {
            println!(
                "{:<8} {:>9.1} {:>9.1} {:>8.0} {:>11.1} {:>10.0} {:>12} {:>11.4}  {}",
                name,
                r.memory.model_states() as f64 / 1e6,
                model / 1e6,
                r.peak_rss_bytes.unwrap_or(0) as f64 / 1e6,
                r.bytes_sent_per_step / 1e6,
                r.tokens_per_s,
                exposed,
                r.final_loss,
                lesson
            );
        }
    }
    if !a.json {
        println!(
            "\nheld: parameters + gradients + AdamW state rank 0 keeps between steps (counted from its tensors);\n\
             model: the ZeRO model for fp32 (DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N;\n\
             tp 16Ψ/N, its replicated LayerNorms, biases and position table aside; pp 16 bytes × rank 0's parameters,\n\
             the embeddings and the first blocks, the tied wte also on the last rank; tp's and pp's gradients live only\n\
             in the step: held counts the last step's);\n\
             RSS: rank 0's process peak resident memory during the steps (model states, activations, buffers,\n\
             libtorch's own; single: the one process, with the whole batch);\n\
             sent: bytes rank 0 sent per step; exposed: communication per step not hidden behind compute (pp: its\n\
             idle fraction of the pipelined forward and backward instead, the bubble).\n\
             The same model and data under every strategy: the final losses agree (the course proves it in tests)."
        );
    }
    Ok(())
}
