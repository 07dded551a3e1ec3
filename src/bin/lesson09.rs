//! Lesson 09 demo — activation checkpointing, measured: for each policy, the activation memory of
//! a training step and its time, next to the model of what each block keeps.
//!
//!   cargo run --release --bin lesson09                       # an 8-block GPT, sequences of 256
//!   cargo run --release --bin lesson09 -- --policies none,full --json
//!
//! Activation memory is measured, not computed: every configuration trains in a fresh process and
//! reports its peak RSS. Running it at two batch sizes, B and 2B, the difference of the two peaks
//! is the activation memory of B sequences (weights, gradients, optimizer state and libtorch
//! itself are the same in both runs and cancel). Doing that at two depths, L and 2L blocks, the
//! difference per added block is what one block keeps — the embeddings, the head and the
//! backward's working set do not grow with depth and cancel too.
//!
//! The model of what a block keeps (fp32, this GPT: flash attention, no dropout): 17 values of
//! s·b·h saved for backward — 68·s·b·h bytes — plus the attention's log-sum-exp (4·a·s·b); a
//! recomputed block keeps only its input (4·s·b·h), and one block at a time is rebuilt during
//! backward (that part does not grow with depth).

use clap::Parser;
use serde_json::json;
use shardlab::ddp::Variant;
use shardlab::job::{self, DataSource, GptJob, OneRun, RunSummary};
use shardlab::prelude::*;

#[derive(Parser, Debug)]
#[command(about = "Lesson 09: activation checkpointing — activation memory and step time per policy")]
struct Args {
    #[arg(long, default_value_t = 8)]
    n_layer: i64,
    #[arg(long, default_value_t = 128)]
    n_embd: i64,
    #[arg(long, default_value_t = 4)]
    n_head: i64,
    #[arg(long, default_value_t = 256)]
    block_size: i64,
    /// B: the smaller of the two batch sizes (sequences per step).
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Steps of each memory run.
    #[arg(long, default_value_t = 3)]
    steps: u64,
    /// Steps of each timing run (the first 2 are left out of the median).
    #[arg(long, default_value_t = 10)]
    timing_steps: u64,
    /// Comma-separated: none, full, every:K.
    #[arg(long, default_value = "none,every:2,full")]
    policies: String,
    #[arg(long)]
    json: bool,
}

/// The model's activation bytes for `b` sequences: (kept without recompute per block, kept by a
/// recomputed block, total under `policy`).
fn model_bytes(cfg: &GptConfig, b: f64, policy: Checkpointing) -> (f64, f64, f64) {
    let (s, h, a, l) = (cfg.block_size as f64, cfg.n_embd as f64, cfg.n_head as f64, cfg.n_layer as usize);
    let layer = 68.0 * s * b * h + 4.0 * a * s * b;
    let input = 4.0 * s * b * h;
    let n = l + 2;
    let recomputed = (0..n).filter(|&st| policy.recomputes(st, n)).count() as f64;
    let total = (l as f64 - recomputed) * layer + recomputed * input + if recomputed > 0.0 { layer } else { 0.0 };
    (layer, input, total)
}

fn main() -> anyhow::Result<()> {
    job::run_one_if_asked();
    let a = Args::parse();
    anyhow::ensure!(
        a.steps >= 2 && a.timing_steps >= 3 && a.batch_size >= 1,
        "need --steps ≥ 2, --timing-steps ≥ 3 and --batch-size ≥ 1"
    );
    let policies: Vec<Checkpointing> =
        a.policies.split(',').map(|p| p.trim().parse()).collect::<Result<_, String>>().map_err(anyhow::Error::msg)?;
    // A small vocabulary: the head's logits (b·s·V) are the same under every policy and would hide
    // the blocks' activations.
    let cfg =
        GptConfig { vocab_size: 64, block_size: a.block_size, n_layer: a.n_layer, n_head: a.n_head, n_embd: a.n_embd };
    cfg.validate()?;
    // Memory runs: every allocation of 64 KiB or more gets its own mapping, returned to the kernel
    // when freed, so the peak RSS is the peak of live bytes. With shardlab's default (freed memory
    // kept for reuse, see launch::keep_freed_memory) the heap also holds the holes that tensors
    // freed between long-lived ones leave behind: more RSS than live bytes (fragmentation), faster
    // steps. Timing runs use the default.
    const EXACT: [(&str, &str); 2] = [("SHARDLAB_MALLOC_DEFAULT", "1"), ("MALLOC_MMAP_THRESHOLD_", "65536")];
    let run =
        |model: GptConfig, batch: usize, policy: Checkpointing, env: &[(&str, &str)]| -> anyhow::Result<RunSummary> {
            let job = GptJob {
                model,
                batch_size: batch,
                accum: 1,
                steps: a.steps,
                warmup: 1,
                optim: AdamWConfig::default(),
                lr_schedule: None,
                grad_clip: None,
                data: DataSource::Synthetic { tokens: 200_000, seed: 1 },
                seed: 1,
                init: None,
                save: None,
            };
            job::run_isolated_with_env(
                &OneRun {
                    job,
                    strategy: Strategy::Single,
                    world_size: 1,
                    backend: Backend::Local,
                    variant: Variant::Bucketed,
                    bucket_cap_bytes: 0,
                    threads: None,
                    checkpointing: policy,
                },
                env,
            )
        };
    let b = a.batch_size as f64;
    let l = a.n_layer as f64;
    let deeper = GptConfig { n_layer: 2 * a.n_layer, ..cfg };
    let mut rows = Vec::new();
    let mut base_s = None;
    for &policy in &policies {
        let rss = |c: GptConfig, batch: usize| -> anyhow::Result<(f64, RunSummary)> {
            let r = run(c, batch, policy, &EXACT)?;
            Ok((r.peak_rss_bytes.unwrap_or(0) as f64, r))
        };
        let (p_b, _) = rss(cfg, a.batch_size)?;
        let (p_2b, exact) = rss(cfg, 2 * a.batch_size)?;
        let (q_b, _) = rss(deeper, a.batch_size)?;
        let (q_2b, _) = rss(deeper, 2 * a.batch_size)?;
        let total = p_2b - p_b; // activations of B sequences, L blocks
        let per_block = ((q_2b - q_b) - total) / l; // what one more block keeps
        let (layer, input, _) = model_bytes(&cfg, b, Checkpointing::None);
        let n = cfg.n_layer as usize + 2;
        let recomputed = (0..n).filter(|&st| policy.recomputes(st, n)).count() as f64;
        let model_block = ((l - recomputed) * layer + recomputed * input) / l;
        let r = run(cfg, 2 * a.batch_size, policy, &[])?; // timing, default allocator
        let step_s = r.median_step_s;
        let base = *base_s.get_or_insert(step_s);
        let row = json!({
            "policy": policy.to_string(),
            "activation_bytes": total,
            "per_block_bytes_measured": per_block,
            "per_block_bytes_model": model_block,
            "measured_over_model": per_block / model_block,
            "step_s": step_s,
            "time_over_first": step_s / base,
            "peak_rss_default_allocator": r.peak_rss_bytes,
            "peak_rss_exact_allocator": exact.peak_rss_bytes,
            "final_loss": r.final_loss,
        });
        if a.json {
            println!("{row}");
        }
        rows.push((policy, total, per_block, model_block, step_s, base, r.final_loss));
    }
    if !a.json {
        println!(
            "GPT {} blocks, h = {}, a = {}, s = {}, B = {} sequences; peak RSS of fresh processes at B and 2B, L and 2L blocks",
            cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, a.batch_size
        );
        println!(
            "{:<9} {:>16} {:>17} {:>14} {:>6} {:>11} {:>9} {:>11}",
            "policy", "activations MB", "per block MB", "model MB", "ratio", "step (2B) s", "vs first", "final loss"
        );
        for (policy, total, per_block, model, step_s, base, loss) in rows {
            println!(
                "{:<9} {:>16.1} {:>17.2} {:>14.2} {:>6.2} {:>11.3} {:>8.2}× {:>11.4}",
                policy.to_string(),
                total / 1e6,
                per_block / 1e6,
                model / 1e6,
                per_block / model,
                step_s,
                step_s / base,
                loss
            );
        }
        println!("(the final losses agree: recomputing changes no gradient)");
    }
    Ok(())
}
