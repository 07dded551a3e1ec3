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
    /// Also run PyTorch 2.11 (`benches/torch_gpt.py train --checkpointing …`: torch.utils.checkpoint
    /// per block, use_reentrant=False) on the same model, data, threads and measurement.
    #[arg(long)]
    compare_pytorch: bool,
    #[arg(long)]
    json: bool,
}

/// The model's activation bytes per block for `b` sequences: (kept with its graph, kept by a
/// recomputed block: its input).
fn model_bytes(cfg: &GptConfig, b: f64) -> (f64, f64) {
    let (s, h, a) = (cfg.block_size as f64, cfg.n_embd as f64, cfg.n_head as f64);
    (68.0 * s * b * h + 4.0 * a * s * b, 4.0 * s * b * h)
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
    let corpus = job::TempCorpus::new("lesson09", 200_000)?;
    // Both implementations get every core of this machine (one process, no ranks to share with).
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Memory runs: every allocation of 64 KiB or more gets its own mapping, returned to the kernel
    // when freed, so the peak RSS is the peak of live bytes. With shardlab's default (freed memory
    // kept for reuse, see launch::keep_freed_memory) the heap also holds the holes that tensors
    // freed between long-lived ones leave behind: more RSS than live bytes (fragmentation), faster
    // steps. Timing runs use the default.
    const EXACT: [(&str, &str); 2] = [("SHARDLAB_MALLOC_DEFAULT", "1"), ("MALLOC_MMAP_THRESHOLD_", "65536")];
    let job = |model: GptConfig, batch: usize, timing: bool| GptJob {
        model,
        batch_size: batch,
        accum: 1,
        steps: if timing { a.timing_steps } else { a.steps },
        warmup: if timing { 2 } else { 1 },
        optim: AdamWConfig::default(),
        lr_schedule: None,
        grad_clip: None,
        data: DataSource::File(corpus.path.clone()),
        seed: 1,
        init: None,
        save: None,
        checkpoint: Default::default(),
        eval: Default::default(),
    };
    // One run: (peak RSS bytes, median step seconds, final loss), in a fresh process.
    let run = |pytorch: bool, model: GptConfig, batch: usize, policy: Checkpointing, timing: bool| {
        let env: &[(&str, &str)] = if timing { &[] } else { &EXACT };
        let j = job(model, batch, timing);
        if pytorch {
            let opts = job::PyTorchOptions { threads, checkpointing: policy, env, ..Default::default() };
            let r = job::pytorch_train_with(&j, "single", 1, &opts)?;
            let f = |k: &str| r[k].as_f64().ok_or_else(|| anyhow::anyhow!("no {k} in PyTorch's summary"));
            anyhow::Ok((f("peak_rss_bytes")?, f("step_s_median")?, f("final_loss")?))
        } else {
            let one = OneRun {
                job: j,
                strategy: Strategy::Single,
                world_size: 1,
                backend: Backend::Local,
                variant: Variant::Bucketed,
                bucket_cap_bytes: 0,
                threads: Some(threads as i32),
                checkpointing: policy,
                reshard_after_forward: true,
                precision: shardlab::precision::Precision::Fp32,
                reduce_dtype: shardlab::precision::Precision::Fp32,
                offload: false,
                device: Default::default(),
                tp: 1,
                pp: Default::default(),
            };
            let r: RunSummary = job::run_isolated_with_env(&one, env)?;
            anyhow::Ok((r.peak_rss_bytes.unwrap_or(0) as f64, r.median_step_s, r.final_loss))
        }
    };
    let b = a.batch_size as f64;
    let l = a.n_layer as f64;
    let deeper = GptConfig { n_layer: 2 * a.n_layer, ..cfg };
    let imps: &[bool] = if a.compare_pytorch { &[false, true] } else { &[false] };
    let mut rows = Vec::new();
    for &pytorch in imps {
        let name = if pytorch { "pytorch" } else { "shardlab" };
        let mut base_s = None;
        for &policy in &policies {
            let peak = |c: GptConfig, batch: usize| run(pytorch, c, batch, policy, false).map(|r| r.0);
            let total = peak(cfg, 2 * a.batch_size)? - peak(cfg, a.batch_size)?; // activations of B sequences, L blocks
            let total_2l = peak(deeper, 2 * a.batch_size)? - peak(deeper, a.batch_size)?;
            let per_block = (total_2l - total) / l; // what one more block keeps
            let (layer, input) = model_bytes(&cfg, b);
            let n = cfg.n_layer as usize + 2;
            let recomputed = (0..n).filter(|&st| policy.recomputes(st, n)).count() as f64;
            let model_block = ((l - recomputed) * layer + recomputed * input) / l;
            let (_, step_s, loss) = run(pytorch, cfg, 2 * a.batch_size, policy, true)?; // default allocator
            let base = *base_s.get_or_insert(step_s);
            let row = json!({
                "impl": name,
                "policy": policy.to_string(),
                "activation_bytes": total,
                "per_block_bytes_measured": per_block,
                "per_block_bytes_model": model_block,
                "measured_over_model": per_block / model_block,
                "step_s": step_s,
                "time_over_none": step_s / base,
                "final_loss": loss,
            });
            if a.json {
                println!("{row}");
            }
            rows.push((name, policy, total, per_block, model_block, step_s, base, loss));
        }
    }
    if !a.json {
        println!(
            "GPT {} blocks, h = {}, a = {}, s = {}, B = {} sequences, {threads} threads; activations from the peak RSS of \
             fresh processes at B and 2B sequences, L and 2L blocks",
            cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, a.batch_size
        );
        println!(
            "{:<9} {:<9} {:>15} {:>13} {:>9} {:>6} {:>12} {:>9} {:>11}",
            "impl",
            "policy",
            "activations MB",
            "per block MB",
            "model MB",
            "ratio",
            "step (2B) s",
            "vs first",
            "final loss"
        );
        for (name, policy, total, per_block, model, step_s, base, loss) in rows {
            println!(
                "{:<9} {:<9} {:>15.1} {:>13.2} {:>9.2} {:>6.2} {:>12.3} {:>8.2}× {:>11.4}",
                name,
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
        println!("(within an implementation the final losses agree: recomputing changes no gradient)");
    }
    Ok(())
}
