//! Training the GPT with pipeline parallelism from a job (`train --pp N`, lesson 13): the world
//! of n ranks as an (n/p) × p mesh — data parallel over its rows, a p-stage pipeline within each.
//! Each rank builds only the parameters of its stages ([`stage_model`]: [`Gpt::new_only`]) and
//! runs [`train_step`] (the pipelined forward and backward, then the one optimizer step) on its
//! replica's rows.
//!
//! The global batch is `batch_size × n` rows, as for the data-parallel strategies: each replica
//! (a pipeline of p ranks) takes `batch_size × p` of them, cut into `micro_batches`. So a run with
//! `--pp` trains on what DDP on the same ranks would (the same losses within f32 rounding:
//! `tests/pipeline.rs`).
//!
//! What is not combined with it yet: `--tp` (3-D parallelism), mixed precision, gradient
//! accumulation (micro-batches are pipeline parallelism's accumulation), activation
//! checkpointing, distributed checkpoints, offload, GPUs and ZeRO on the dp dimension — each
//! refused with the reason on every rank before any computes.

use super::{GptJob, RunSummary};
use crate::comm::{DeviceMesh, ProcessGroup};
use crate::data::DistributedSampler;
use crate::memory::MemoryStats;
use crate::model::{Gpt, Model};
use crate::optim::{AdamW, Optimizer};
use crate::pipeline::train::{params_of_ranks, train_step};
use crate::pipeline::PipelineConfig;
use crate::trainer::{Strategy, TrainContext};
use serde_json::json;
use std::time::Instant;
use tch::{Kind, Tensor};

/// Rank `rank`'s model of a `p`-stage pipeline: the GPT of `job` (its seed, or its `init`
/// weights) with only the parameters of this rank's stages materialised.
pub fn stage_model(job: &GptJob, p: usize, rank: usize) -> anyhow::Result<Gpt> {
    let mine = params_of_ranks(&job.model, p).map_err(anyhow::Error::msg)?.swap_remove(rank);
    let keep = |i: usize| mine.binary_search(&i).is_ok();
    if job.init.is_some() {
        let m = job.build_model()?; // loaded whole from the file, then cut down
        m.keep_only(keep);
        Ok(m)
    } else {
        Gpt::new_only(job.model, job.seed, keep)
    }
}

/// What `--pp` cannot be combined with yet, as an error (the same on every rank).
fn unsupported(job: &GptJob, ctx: &TrainContext, pc: &PipelineConfig) -> Option<String> {
    let s = ctx.scaling();
    let (n, p, m) = (ctx.world_size(), pc.stages, pc.micro_batches);
    let stages = job.model.n_layer as usize + 2;
    if p == 0 || n % p != 0 {
        return Some(format!("--pp {p} does not divide the world of {n} ranks into pipelines"));
    }
    if p > stages {
        return Some(format!(
            "--pp {p}: the GPT has {stages} stages (embeddings, {} blocks, head): more pipeline ranks than stages",
            job.model.n_layer
        ));
    }
    let rows = job.batch_size * p;
    if m == 0 || rows % m != 0 {
        return Some(format!(
            "--micro-batches {m} does not divide a pipeline's {rows} rows (--batch-size {} × --pp {p})",
            job.batch_size
        ));
    }
    let no = |what: &str| Some(format!("--pp is not combined with {what} yet (lesson 13, \"What is not done yet\")"));
    match () {
        _ if s.tensor_parallel != 1 => no("--tp (3-D parallelism)"),
        _ if s.strategy != Strategy::Ddp => no(&format!(
            "--strategy {}: the data-parallel dimension averages gradients as DDP does; use --strategy ddp",
            format!("{:?}", s.strategy).to_lowercase()
        )),
        _ if s.precision != crate::precision::Precision::Fp32 => no("mixed precision"),
        _ if job.accum != 1 => no("gradient accumulation (raise --micro-batches instead)"),
        _ if s.activation_checkpointing != crate::stages::Checkpointing::None => no("activation checkpointing"),
        _ if job.checkpoint.dir.is_some() || job.checkpoint.resume.is_some() => no("distributed checkpoints"),
        _ if s.offload => no("offload"),
        _ if s.device != crate::device::DeviceChoice::Cpu || s.use_gpu => no("GPUs"),
        _ => None,
    }
}

/// The per-worker loop of a pipeline-parallel job (called by [`GptJob::run`] when the scaling
/// config asks for `pipeline.stages > 1`). Returns this rank's summary.
pub fn run(job: &GptJob, ctx: &mut TrainContext) -> anyhow::Result<RunSummary> {
    let pc = ctx.scaling().pipeline;
    if let Some(e) = unsupported(job, ctx, &pc) {
        anyhow::bail!(e);
    }
    let (n, p) = (ctx.world_size(), pc.stages);
    let mesh = DeviceMesh::new(ctx.group(), &[n / p, p], &["dp", "pp"])?;
    let (pp, dp) = (mesh.group("pp"), mesh.group("dp"));
    let data = job.data.load()?;
    let model = stage_model(job, p, pp.rank())?;
    let params = job.model.num_params();
    let mut opt = AdamW::new(job.optim);
    let sampler =
        DistributedSampler::new(job.model.block_size as usize, job.batch_size * n, mesh.coord("dp"), n / p, job.seed)?;
    let tokens_per_step = (job.batch_size * n) as f64 * job.model.block_size as f64;
    let (mut step_s, mut losses, mut bubbles) = (Vec::new(), Vec::new(), Vec::new());
    let mut peak_in_flight = 0;
    // Bytes this rank sends, over the world and its two mesh groups (each its own communicator).
    let sent = |ctx: &TrainContext| ctx.group().stats().bytes_sent + pp.stats().bytes_sent + dp.stats().bytes_sent;
    let sent0 = sent(ctx);
    let mut grad_bytes = 0;
    crate::bench::reset_peak_rss();
    let warmup = job.warmup.min(job.steps.saturating_sub(1));
    for step in 0..job.steps {
        crate::launch::injected_failure("step", ctx.rank(), step)?;
        let batch = sampler.batch(&data, step);
        ctx.group().barrier()?;
        let t0 = Instant::now();
        let lr = job.schedule().lr(step);
        let dp_group = (n / p > 1).then_some(dp);
        let (st, norm) = train_step(pp, dp_group, &model, &pc, &mut opt, lr, job.grad_clip, &batch)
            .map_err(|e| anyhow::anyhow!("step {step}: {e}"))?;
        let dt = t0.elapsed().as_secs_f64();
        let loss = st.loss;
        anyhow::ensure!(
            loss.is_finite(),
            "step {step}: the loss is {loss} (learning rate {lr} too high?); the last losses: {:.4?}. Its gradients were \
             finite, so the step was applied",
            &losses[losses.len().saturating_sub(4)..]
        );
        losses.push(loss);
        grad_bytes = crate::memory::held_bytes(st.grads.values());
        peak_in_flight = peak_in_flight.max(st.peak_in_flight);
        if step >= warmup {
            step_s.push(dt);
            bubbles.push(st.bubble());
        }
        ctx.report(json!({"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "step_s": dt,
                          "tokens_per_s": tokens_per_step / dt, "bubble": st.bubble()}))?;
    }
    if let Some(path) = job.save.as_ref().filter(|_| mesh.coord("dp") == 0) {
        save_whole(&model, pp, path)?;
    }
    let steps = job.steps.max(1) as f64;
    let sent_per_step = (sent(ctx) - sent0) as f64 / steps;
    let median = crate::bench::median(&mut step_s);
    let memory = MemoryStats {
        params: crate::memory::held_bytes(model.parameters().iter()),
        grads: grad_bytes,
        optim: opt.state_bytes(),
        ..Default::default()
    };
    Ok(RunSummary {
        strategy: if n / p > 1 { format!("ddp{}×pp{p}", n / p) } else { format!("pp{p}") },
        variant: Some(format!("{:?}, {} micro-batches", pc.schedule, pc.micro_batches)),
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
        pipeline: Some(crate::job::PipelineStats { bubble: crate::bench::median(&mut bubbles), peak_in_flight }),
        ..Default::default()
    })
}

/// Gather the whole model onto pp rank 0 of the first replica and write it there (nanoGPT's keys,
/// `lm_head.weight` the tied wte): every other rank of that pipeline sends the parameters it is
/// the lowest user of, and the last rank also its copy of the tied wte, which must equal rank 0's
/// (they got the same gradients and updates). Call on the first replica's ranks only. An error
/// aborts the group.
fn save_whole(model: &Gpt, pp: &ProcessGroup, path: &std::path::Path) -> anyhow::Result<()> {
    let (p, r) = (pp.world_size(), pp.rank());
    let fail = |e: String| {
        pp.abort(&format!("rank {r}: saving the pipeline's model: {e}"));
        anyhow::anyhow!("saving the pipeline's model: {e}")
    };
    let owned = params_of_ranks(&model.cfg, p).map_err(fail)?;
    let lowest = |k: usize| owned.iter().position(|o| o.contains(&k)).expect("every parameter has a stage");
    let mine = model.parameters();
    let shapes = model.cfg.param_shapes();
    let empty = |k: usize| Tensor::zeros(shapes[k].1.as_slice(), (Kind::Float, tch::Device::Cpu));
    let mut full = Vec::new();
    for k in 0..mine.len() {
        let q = lowest(k);
        if r == 0 && q == 0 {
            full.push(mine[k].detach().copy());
        } else if r == 0 {
            let mut t = empty(k);
            pp.recv(&mut t, q).map_err(|e| fail(e.to_string()))?;
            full.push(t);
        } else if r == q {
            pp.send(&mine[k], 0).map_err(|e| fail(e.to_string()))?;
        }
    }
    // The tied wte: the last rank's copy against rank 0's.
    if p > 1 && r == p - 1 {
        pp.send(&mine[0], 0).map_err(|e| fail(e.to_string()))?;
    } else if p > 1 && r == 0 {
        let mut other = empty(0);
        pp.recv(&mut other, p - 1).map_err(|e| fail(e.to_string()))?;
        if !other.equal(&full[0]) {
            let d = (&other - &full[0]).abs().max().double_value(&[]);
            return Err(fail(format!("the two copies of the tied wte differ by up to {d}")));
        }
    }
    if r == 0 {
        crate::model::write_state_dict(model.state_dict_of(full), path)?;
    }
    Ok(())
}
