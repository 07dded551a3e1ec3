//! Training the GPT with tensor parallelism from a job (`train --tp N`, lesson 12): the world
//! of n ranks as a (n/t) × t mesh — data parallel over its rows, tensor parallel within each row
//! ([`TpGpt::train_step`] with the dp group). Every rank of a tp group reads the same rows; the
//! global batch is `batch_size × n` rows, as for the data-parallel strategies, so a run with
//! `--tp` trains on exactly what DDP on the same ranks would (the same losses within f32
//! rounding: `tests/tp.rs`).
//!
//! What is not combined with it yet: mixed precision, gradient accumulation, activation
//! checkpointing, distributed checkpoints, offload, GPUs and ZeRO on the dp dimension — each
//! refused with the reason on every rank before any computes.

use super::{GptJob, RunSummary};
use crate::comm::DeviceMesh;
use crate::data::DistributedSampler;
use crate::memory::MemoryStats;
use crate::model::Model;
use crate::optim::{AdamW, Optimizer};
use crate::tp::TpGpt;
use crate::trainer::{Strategy, TrainContext};
use serde_json::json;
use std::time::Instant;

/// What `--tp` cannot be combined with yet, as an error (the same on every rank).
fn unsupported(job: &GptJob, ctx: &TrainContext, t: usize) -> Option<String> {
    let s = ctx.scaling();
    let n = ctx.world_size();
    if t == 0 || n % t != 0 {
        return Some(format!("--tp {t} does not divide the world of {n} ranks into tensor-parallel groups"));
    }
    if s.sequence_parallel && job.model.block_size % t as i64 != 0 {
        return Some(format!(
            "--sequence-parallel: a sequence of {} tokens does not split over --tp {t}",
            job.model.block_size
        ));
    }
    let no = |what: &str| Some(format!("--tp is not combined with {what} yet (lesson 12, \"What is not done yet\")"));
    match () {
        _ if s.strategy != Strategy::Ddp => no(&format!(
            "--strategy {}: the data-parallel dimension averages gradients as DDP does; use --strategy ddp",
            format!("{:?}", s.strategy).to_lowercase()
        )),
        _ if s.precision != crate::precision::Precision::Fp32 => no("mixed precision"),
        _ if job.accum != 1 => no("gradient accumulation"),
        _ if s.activation_checkpointing != crate::stages::Checkpointing::None => no("activation checkpointing"),
        _ if job.checkpoint.dir.is_some() || job.checkpoint.resume.is_some() => no("distributed checkpoints"),
        _ if s.offload => no("offload"),
        _ if s.device != crate::device::DeviceChoice::Cpu || s.use_gpu => no("GPUs"),
        _ => None,
    }
}

/// The per-worker loop of a tensor-parallel job (called by [`GptJob::run`] when the scaling
/// config asks for `tensor_parallel > 1`). Returns this rank's summary.
pub fn run(job: &GptJob, ctx: &mut TrainContext, t: usize) -> anyhow::Result<RunSummary> {
    if let Some(e) = unsupported(job, ctx, t) {
        anyhow::bail!(e);
    }
    let n = ctx.world_size();
    let mesh = DeviceMesh::new(ctx.group(), &[n / t, t], &["dp", "tp"])?;
    let (tp, dp) = (mesh.group("tp"), mesh.group("dp"));
    let data = job.data.load()?;
    let full = job.build_model()?;
    let params = full.num_params();
    let mut m = TpGpt::from_gpt(&full, tp)
        .map_err(|e| anyhow::anyhow!("--tp {t}: {e}"))?
        .with_sequence_parallel(ctx.scaling().sequence_parallel);
    drop(full); // every rank built the whole model from the seed and keeps its slices
    let mut opt = AdamW::new(job.optim);
    let sampler =
        DistributedSampler::new(job.model.block_size as usize, job.batch_size * n, mesh.coord("dp"), n / t, job.seed)?;
    let tokens_per_step = (job.batch_size * n) as f64 * job.model.block_size as f64;
    let (mut step_s, mut losses) = (Vec::new(), Vec::new());
    // Bytes this rank sends, over the world and its two mesh groups (each its own communicator).
    let sent = |ctx: &TrainContext| ctx.group().stats().bytes_sent + tp.stats().bytes_sent + dp.stats().bytes_sent;
    let sent0 = sent(ctx);
    crate::bench::reset_peak_rss();
    let warmup = job.warmup.min(job.steps.saturating_sub(1));
    for step in 0..job.steps {
        crate::launch::injected_failure("step", ctx.rank(), step)?;
        let batch = sampler.batch(&data, step);
        ctx.group().barrier()?;
        let t0 = Instant::now();
        let lr = job.schedule().lr(step);
        let dp_group = (n / t > 1).then_some(dp);
        let (loss, norm) = m
            .train_step(tp, dp_group, &mut opt, lr, job.grad_clip, &batch)
            .map_err(|e| anyhow::anyhow!("step {step}: {e}"))?;
        let dt = t0.elapsed().as_secs_f64();
        anyhow::ensure!(
            loss.is_finite(),
            "step {step}: the loss is {loss} (learning rate {lr} too high?); the last losses: {:.4?}. Its gradients were \
             finite, so the step was applied",
            &losses[losses.len().saturating_sub(4)..]
        );
        losses.push(loss);
        if step >= warmup {
            step_s.push(dt);
        }
        ctx.report(json!({"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "step_s": dt,
                          "tokens_per_s": tokens_per_step / dt}))?;
    }
    if let Some(p) = &job.save {
        let full = m.unshard(tp, &m.params())?;
        if ctx.rank() == 0 {
            let gpt = crate::model::Gpt::new(job.model, job.seed)?;
            tch::no_grad(|| gpt.parameters().iter().zip(&full).for_each(|(p, f)| p.shallow_clone().copy_(f)));
            gpt.save_safetensors(p)?;
        }
    }
    let steps = job.steps.max(1) as f64;
    let sent_per_step = (sent(ctx) - sent0) as f64 / steps;
    let median = crate::bench::median(&mut step_s);
    // Gradients live only during a step (returned, clipped, applied): the last step's, measured.
    let memory = MemoryStats {
        params: m.param_bytes(),
        grads: m.last_grad_bytes,
        optim: opt.state_bytes(),
        ..Default::default()
    };
    Ok(RunSummary {
        strategy: format!(
            "{}tp{t}{}",
            if n / t > 1 { format!("ddp{}×", n / t) } else { String::new() },
            if ctx.scaling().sequence_parallel { "+sp" } else { "" }
        ),
        variant: None,
        world_size: n,
        params,
        tokens_per_step,
        measured_steps: step_s.len(),
        median_step_s: median,
        tokens_per_s: tokens_per_step / median,
        final_loss: *losses.last().unwrap_or(&f64::NAN),
        losses,
        memory,
        bytes_sent_per_step: sent_per_step,
        peak_rss_bytes: crate::bench::peak_rss_bytes(),
        precision: crate::precision::Precision::Fp32,
        // No DDP timings (TP's all-reduces are not timed apart from compute), no GPU, no
        // checkpoints: their defaults.
        ..Default::default()
    })
}
