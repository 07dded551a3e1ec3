//! The per-worker loop of a job whose layout has tensor or pipeline parallelism (`train --tp N`,
//! `--pp N`, or both — 3-D parallelism, each pipeline rank's stages split over its tensor-parallel
//! group — on their own or with DDP or ZeRO over the data dimension): the layout
//! ([`ParallelDims`]: pp × dp × tp ranks), [`parallelize`], then
//! [`Engine::train_step_accum`](crate::engine::Engine::train_step_accum) per step.
//!
//! Every rank of a replica (a tp group, a pipeline, or both) reads the same rows: the global batch
//! is `batch_size × n` rows, as for the data-parallel strategies, each of the `dp` replicas taking
//! `batch_size × n/dp` of them. So a run with `--tp` or `--pp` trains on what DDP on the same ranks
//! would: the same losses within f32 rounding (`tests/engine.rs`, `tests/tp.rs`,
//! `tests/pipeline.rs`).
//!
//! Gradient accumulation (`--accum`) cuts each replica's rows into micro-batches run through the
//! piece one after another ([`Engine::train_step_accum`](crate::engine::Engine::train_step_accum)); under pipeline parallelism each is a
//! whole pipelined step of `--micro-batches`.
//!
//! Distributed checkpoints (`--checkpoint-dir`, `--resume`) save what each rank holds with its
//! place in the whole model ([`crate::checkpoint`]; the engine is a
//! [`Holder`](crate::checkpoint::Holder)), so a run resumes at any layout from a checkpoint of any
//! other — or of the data-parallel strategies, and they from one of these.
//!
//! `--precision bf16` computes the matrix multiplies in bf16 as `torch.autocast` does (fp32
//! parameters, gradients and optimizer state); fp16 is refused (it needs a loss scaler).
//!
//! What is not combined with tensor or pipeline parallelism yet — fp16, offload, GPUs,
//! and `every:K` activation checkpointing
//! with `--pp` but no `--tp` ([`parallelize`]) — is refused with the reason on every rank before
//! any computes. Elastic restarts work at the same size; shrinking on failure is refused
//! ([`GptJob::fit_elastic`]).

use super::{GptJob, PipelineStats, RunSummary};
use crate::data::DistributedSampler;
use crate::engine::{parallelize, DataDim, ParallelDims, Plan};
use crate::model::Gpt;
use crate::optim::AdamW;
use crate::trainer::{Strategy, TrainContext};
use crate::zero::Stage;
use serde_json::json;
use std::time::Instant;

/// What tensor or pipeline parallelism cannot be combined with yet, as an error (the same on
/// every rank).
fn unsupported(job: &GptJob, ctx: &TrainContext, dims: &ParallelDims) -> Option<String> {
    let s = ctx.scaling();
    let which = match (dims.tp > 1, dims.pp > 1) {
        (true, true) => "--tp with --pp",
        (true, false) => "--tp",
        _ => "--pp",
    };
    if dims.pp > 1 {
        let (p, m) = (dims.pp, s.pipeline.micro_batches);
        let stages = job.model.n_layer as usize + 2;
        if p > stages {
            return Some(format!(
                "--pp {p}: the GPT has {stages} stages (embeddings, {} blocks, head): more pipeline ranks than stages",
                job.model.n_layer
            ));
        }
        let rows = job.batch_size * ctx.world_size() / dims.dp;
        let a = job.accum.max(1) as usize;
        if m == 0 || rows % (m * a) != 0 {
            return Some(format!(
                "--micro-batches {m}{} does not divide a pipeline's {rows} rows (--batch-size {} × {} ranks per replica)",
                if a > 1 { format!(" × --accum {a}") } else { String::new() },
                job.batch_size,
                dims.pp * dims.tp
            ));
        }
    }
    if dims.tp > 1 && s.sequence_parallel && job.model.block_size % dims.tp as i64 != 0 {
        return Some(format!(
            "--sequence-parallel: a sequence of {} tokens does not split over --tp {}",
            job.model.block_size, dims.tp
        ));
    }
    let no =
        |what: &str| Some(format!("{which} is not combined with {what} yet (lessons 12–13, \"What is not done yet\")"));
    match () {
        _ if s.strategy == Strategy::Single && dims.dp > 1 => {
            Some(format!("--strategy single runs one replica, but the layout has {} (use ddp or zero1/2/3)", dims.dp))
        }
        _ if s.precision == crate::precision::Precision::Fp16 => Some(format!(
            "{which} computes in fp32 or bf16: fp16 needs a loss scaler, which the engine does not run (use --precision bf16)"
        )),
        _ if s.reduce_dtype != crate::precision::Precision::Fp32 => no("--reduce-dtype (gradients are reduced in fp32)"),
        _ if s.offload => no("offload"),
        _ if s.device != crate::device::DeviceChoice::Cpu || s.use_gpu => no("GPUs"),
        _ => None,
    }
}

/// The data dimension's wrapper for `strategy`.
pub fn data_dim(strategy: Strategy) -> DataDim {
    match strategy {
        Strategy::Single | Strategy::Ddp => DataDim::Replicate,
        Strategy::Zero1 => DataDim::Zero(Stage::One),
        Strategy::Zero2 => DataDim::Zero(Stage::Two),
        Strategy::Zero3 => DataDim::Zero(Stage::Three),
    }
}

/// The per-worker loop (called by [`GptJob::run`] when the scaling config asks for
/// `tensor_parallel > 1` or `pipeline.stages > 1`). Returns this rank's summary.
pub fn run(job: &GptJob, ctx: &mut TrainContext) -> anyhow::Result<RunSummary> {
    // The checkpoint folders are this job's until it ends, however it ends.
    let release = crate::checkpoint::FolderRelease::new(
        job.checkpoint.dir.iter().flat_map(|d| [d.clone(), super::eval::best_dir(d)]).collect(),
        ctx.group().job(),
    );
    let s = ctx.scaling().clone();
    let n = ctx.world_size();
    let dims = ParallelDims::new(n, s.tensor_parallel, s.pipeline.stages).map_err(anyhow::Error::msg)?;
    if let Some(e) = unsupported(job, ctx, &dims) {
        anyhow::bail!(e);
    }
    let plan = Plan {
        dims,
        data: data_dim(s.strategy),
        sequence_parallel: s.sequence_parallel,
        pipeline: s.pipeline,
        activation_checkpointing: s.activation_checkpointing,
        precision: s.precision,
    };
    let build = |keep: &dyn Fn(usize) -> bool| -> anyhow::Result<Gpt> {
        if job.init.is_some() {
            let m = job.build_model()?; // loaded whole from the file, then cut down
            m.keep_only(keep);
            Ok(m)
        } else {
            Gpt::new_only(job.model, job.seed, keep)
        }
    };
    let mut engine = parallelize(ctx.group(), &plan, &job.model, &build)?;
    let data = job.data.load()?;
    let mut opt = AdamW::new(job.optim);
    let (mut start, mut resumed) = (0, None);
    let (mut save_s, mut save_bytes, mut load_s, mut load_bytes) = (0.0, 0, 0.0, 0);
    if let Some(from) = &job.checkpoint.resume {
        let r = crate::checkpoint::load(&mut engine, &mut opt, from)?;
        (load_s, load_bytes) = (r.seconds, r.bytes);
        job.check_resumable(&r.extra, n)?;
        start = r.step;
        resumed = Some(r.extra);
        anyhow::ensure!(
            start <= job.steps,
            "the checkpoint is at step {start}, past this run's {} steps (to train on, ask for more --steps with the \
             same LR schedule: --lr-decay-iters)",
            job.steps
        );
    }
    let dp = engine.mesh().coord("dp");
    let sampler = DistributedSampler::new(job.model.block_size as usize, job.batch_size * n, dp, dims.dp, job.seed)?;
    let mut evals = super::eval::Evaluator::new(job, dp, dims.dp, n)?;
    if let Some(ev) = evals.as_mut() {
        ev.carry_best(resumed.as_ref(), job.checkpoint.dir.as_deref(), ctx.rank() == 0)?;
    }
    let layout = dims.name(plan.data, s.sequence_parallel);
    let tokens_per_step = (job.batch_size * n) as f64 * job.model.block_size as f64;
    let (mut step_s, mut losses, mut norms, mut bubbles) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut peak_in_flight = 0;
    // Bytes this rank sends, over the world and the mesh's groups (each its own communicator).
    let sent = |ctx: &TrainContext, e: &crate::engine::Engine| ctx.group().stats().bytes_sent + e.bytes_sent();
    let sent0 = sent(ctx, &engine);
    // Bytes the evaluations sent (forward and backward of every evaluation batch): not training traffic.
    let mut eval_sent = 0;
    crate::bench::reset_peak_rss();
    let warmup = (start + job.warmup).min(job.steps.saturating_sub(1));
    for step in start..=job.steps {
        // After `step` updates: evaluate (not again at a resumed run's first step), then save.
        let again = step == start && start > 0 && start < job.steps;
        if let Some(ev) = evals.as_mut().filter(|e| e.due(step, job.steps) && !again) {
            let before = sent(ctx, &engine);
            let (p, best) = ev.evaluate(step, &data, |b| engine.eval_loss(b, job.accum))?;
            ctx.report(ev.line(&p))?;
            if let (true, Some(dir)) = (best && step > 0, &job.checkpoint.dir) {
                let extra = json!({"job": job, "strategy": s.strategy, "world_size": n, "layout": layout,
                                   "precision": s.precision, "scaler": null, "loss": losses.last(),
                                   "val_loss": p.val_loss, "best_val_loss": ev.best, "best_step": ev.best_step});
                super::eval::save_best(&engine, &opt, dir, step, extra)?;
            }
            eval_sent += sent(ctx, &engine) - before;
        }
        if let (Some(dir), true) = (&job.checkpoint.dir, step > start) {
            let every = job.checkpoint.every > 0 && step % job.checkpoint.every == 0;
            if every || (step == job.steps && job.checkpoint.at_end) {
                let extra = json!({"job": job, "strategy": s.strategy, "world_size": n, "layout": layout,
                                   "precision": s.precision, "scaler": null, "loss": losses.last(),
                                   "best_val_loss": evals.as_ref().map(|e| e.best),
                                   "best_step": evals.as_ref().and_then(|e| e.best_step)});
                let opts = crate::checkpoint::SaveOptions { keep_last: job.checkpoint.keep_last, ..Default::default() };
                let r = crate::checkpoint::save(&engine, &opt, dir, step, extra, &opts)
                    .map_err(|e| anyhow::anyhow!("after step {}: saving the checkpoint: {e:#}", step - 1))?;
                save_s += r.seconds;
                save_bytes += r.bytes;
            }
        }
        if step == job.steps {
            break;
        }
        crate::launch::injected_failure("step", ctx.rank(), step)?;
        let batch = sampler.batch(&data, step);
        ctx.group().barrier()?;
        let t0 = Instant::now();
        let lr = job.schedule().lr(step);
        let out = engine
            .train_step_accum(&batch, job.accum, &mut opt, lr, job.grad_clip)
            .map_err(|e| anyhow::anyhow!("step {step}: {e}"))?;
        let dt = t0.elapsed().as_secs_f64();
        let loss = out.loss;
        anyhow::ensure!(
            loss.is_finite(),
            "step {step}: the loss is {loss} (learning rate {lr} too high?); the last losses: {:.4?}. Its gradients were \
             finite, so the step was applied",
            &losses[losses.len().saturating_sub(4)..]
        );
        losses.push(loss);
        norms.push(out.norm.is_finite().then_some(out.norm));
        let mut line = json!({"step": step, "loss": loss, "lr": lr, "grad_norm": out.norm, "step_s": dt,
                              "tokens_per_s": tokens_per_step / dt});
        if let Some((bubble, peak)) = out.pipeline {
            peak_in_flight = peak_in_flight.max(peak);
            line["bubble"] = json!(bubble);
            if step >= warmup {
                bubbles.push(bubble);
            }
        }
        if step >= warmup {
            step_s.push(dt);
        }
        ctx.report(line)?;
    }
    // The job's saves are over: its checkpoint folders are free for the next job.
    drop(release);
    if let Some(p) = &job.save {
        let full = engine.full_parameters()?;
        if let Some(full) = full.filter(|_| ctx.rank() == 0) {
            let names = Gpt::new_only(job.model, job.seed, |_| false)?;
            crate::model::write_state_dict(crate::model::Model::state_dict_of(&names, full), p)?;
        }
    }
    let sent_per_step = (sent(ctx, &engine) - sent0 - eval_sent) as f64 / (job.steps - start).max(1) as f64;
    let median = crate::bench::median(&mut step_s);
    Ok(RunSummary {
        strategy: layout,
        evals: evals.map(|e| e.points).unwrap_or_default(),
        variant: (dims.pp > 1)
            .then(|| format!("{:?}, {} micro-batches", s.pipeline.schedule, s.pipeline.micro_batches)),
        world_size: n,
        params: job.model.num_params(),
        tokens_per_step,
        measured_steps: step_s.len(),
        median_step_s: median,
        tokens_per_s: tokens_per_step / median,
        final_loss: *losses.last().unwrap_or(&f64::NAN),
        losses,
        grad_norms: norms,
        memory: engine.memory(&opt),
        bytes_sent_per_step: sent_per_step,
        peak_rss_bytes: crate::bench::peak_rss_bytes(),
        precision: s.precision,
        pipeline: (dims.pp > 1).then(|| PipelineStats { bubble: crate::bench::median(&mut bubbles), peak_in_flight }),
        checkpoint_save_s: save_s,
        checkpoint_bytes_written: save_bytes,
        resume_load_s: load_s,
        resume_bytes_read: load_bytes,
        // No DDP timings (the pieces' collectives are not timed apart from compute), no GPU: their
        // defaults.
        ..Default::default()
    })
}
