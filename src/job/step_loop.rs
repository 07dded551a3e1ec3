//! The per-worker loop of a [`GptJob`]: what every rank of a `train` run does, step after step,
//! inside the [`Trainer`](crate::trainer::Trainer).
//!
//! Every step: this rank's rows of the global batch ([`DistributedSampler`]), a barrier (so step
//! times measure the slowest rank), [`train_step`](crate::ddp::train_step), and the global loss
//! (average of the ranks' equal-sized local means). Each step is reported to the driver.

use super::{GptJob, RunSummary};
use crate::comm::ReduceOp;
use crate::data::DistributedSampler;
use crate::ddp;
use crate::model::Model;
use crate::optim::StepConfig;
use crate::trainer::{Strategy, TrainContext};
use serde_json::json;
use std::time::Instant;
use tch::Tensor;

impl GptJob {
    /// The per-worker loop (call inside [`Trainer::fit`](crate::trainer::Trainer::fit)). Returns this rank's summary.
    pub fn run(&self, ctx: &mut TrainContext) -> anyhow::Result<RunSummary> {
        anyhow::ensure!(
            !ctx.scaling().sequence_parallel || ctx.scaling().tensor_parallel > 1,
            "sequence parallelism splits over the tensor-parallel group: it needs tensor_parallel > 1 (--tp)"
        );
        if ctx.scaling().pipeline.stages != 1 || ctx.scaling().tensor_parallel != 1 {
            return super::mesh_run::run(self, ctx);
        }
        // The checkpoint folders are this job's until it ends, however it ends.
        let release = crate::checkpoint::FolderRelease::new(
            self.checkpoint.dir.iter().flat_map(|d| [d.clone(), super::eval::best_dir(d)]).collect(),
            ctx.group().job(),
        );
        let data = self.data.load()?;
        let model = self.build_model()?;
        let params = model.num_params();
        let device = ctx.device()?;
        let (mut dp, mut opt) = ctx.prepare(Box::new(model), &self.optim)?;
        let (rank, n) = (ctx.rank(), ctx.world_size());
        // fp16 needs dynamic loss scaling (PyTorch's GradScaler rules); bf16 and fp32 do not.
        let mut scaler = ctx.scaler();
        let (mut start, mut resumed) = (0, None);
        let (mut save_s, mut save_bytes, mut load_s, mut load_bytes) = (0.0, 0, 0.0, 0);
        if let Some(from) = &self.checkpoint.resume {
            let r = crate::checkpoint::load(&mut *dp, &mut opt, from)?;
            (load_s, load_bytes) = (r.seconds, r.bytes);
            self.check_resumable(&r.extra, n)?;
            if let (Some(s), Some(saved)) = (scaler.as_mut(), r.extra.get("scaler").filter(|v| !v.is_null())) {
                *s = serde_json::from_value(saved.clone())?;
            }
            start = r.step;
            resumed = Some(r.extra);
            anyhow::ensure!(
                start <= self.steps,
                "the checkpoint is at step {start}, past this run's {} steps (to train on, ask for more --steps with \
                 the same LR schedule: --lr-decay-iters)",
                self.steps
            );
        }
        let sampler = DistributedSampler::new(self.model.block_size as usize, self.batch_size * n, rank, n, self.seed)?;
        let mut evals = super::eval::Evaluator::new(self, rank, n, n)?;
        if let Some(ev) = evals.as_mut() {
            ev.carry_best(resumed.as_ref(), self.checkpoint.dir.as_deref(), rank == 0)?;
        }
        let tokens_per_step = (self.batch_size * n) as f64 * self.model.block_size as f64;
        let (mut step_s, mut losses, mut norms) = (Vec::new(), Vec::new(), Vec::new());
        let sent0 = ctx.group().stats().bytes_sent;
        // Bytes the evaluations sent, and the strategy's timings during them (ZeRO's gathers for
        // the forward): not training's.
        let (mut eval_sent, mut eval_stats) = (0, crate::stats::DdpStats::default());
        // Peak RSS from here on: the training steps, not the construction of the full model.
        crate::bench::reset_peak_rss();
        // A run shorter than its warm-up still runs: it times its last step.
        let warmup = (start + self.warmup).min(self.steps.saturating_sub(1));
        for step in start..=self.steps {
            // After `step` updates: evaluate (not again at a resumed run's first step, which the
            // run that saved it evaluated), then save — so a checkpoint's best val loss includes
            // its own step's evaluation.
            let again = step == start && start > 0 && start < self.steps;
            if let Some(ev) = evals.as_mut().filter(|e| e.due(step, self.steps) && !again) {
                let (before, stats_before) = (ctx.group().stats().bytes_sent, dp.stats());
                let accum = self.accum;
                let (p, best) = ev.evaluate(step, &data, |b| {
                    super::eval::data_parallel_loss(&mut *dp, &b.to_device(device), accum)
                })?;
                ctx.report(ev.line(&p))?;
                if let (true, Some(dir)) = (best && step > 0, &self.checkpoint.dir) {
                    let extra = json!({"job": self, "strategy": ctx.scaling().strategy, "world_size": n,
                                       "precision": ctx.scaling().precision, "scaler": scaler,
                                       "loss": losses.last(), "val_loss": p.val_loss, "best_val_loss": ev.best,
                                       "best_step": ev.best_step});
                    super::eval::save_best(&*dp, &opt, dir, step, extra)?;
                }
                eval_sent += ctx.group().stats().bytes_sent - before;
                eval_stats = eval_stats.plus(&dp.stats().since(&stats_before));
            }
            if let (Some(dir), true) = (&self.checkpoint.dir, step > start) {
                let every = self.checkpoint.every > 0 && step % self.checkpoint.every == 0;
                if every || (step == self.steps && self.checkpoint.at_end) {
                    let extra = json!({"job": self, "strategy": ctx.scaling().strategy, "world_size": n,
                                       "precision": ctx.scaling().precision, "scaler": scaler, "loss": losses.last(),
                                       "best_val_loss": evals.as_ref().map(|e| e.best),
                                       "best_step": evals.as_ref().and_then(|e| e.best_step)});
                    let opts =
                        crate::checkpoint::SaveOptions { keep_last: self.checkpoint.keep_last, ..Default::default() };
                    let r = crate::checkpoint::save(&*dp, &opt, dir, step, extra, &opts)
                        .map_err(|e| anyhow::anyhow!("after step {}: saving the checkpoint: {e:#}", step - 1))?;
                    save_s += r.seconds;
                    save_bytes += r.bytes;
                }
            }
            if step == self.steps {
                break;
            }
            crate::launch::injected_failure("step", rank, step)?;
            let batch = sampler.batch(&data, step).to_device(device);
            ctx.group().barrier()?;
            let t0 = Instant::now();
            let cfg = StepConfig { lr: self.schedule().lr(step), grad_clip: self.grad_clip };
            let out =
                ddp::train_step_scaled(&mut *dp, &mut opt, &batch, self.accum, cfg, scaler.as_mut()).map_err(|e| {
                    anyhow::anyhow!(
                        "step {step}: {e} (learning rate {}; the last losses: {:.4?})",
                        cfg.lr,
                        &losses[losses.len().saturating_sub(4)..]
                    )
                })?;
            let local = out.loss;
            if let tch::Device::Cuda(i) = device {
                tch::Cuda::synchronize(i as i64); // kernels are asynchronous: time them to their end
            }
            let dt = t0.elapsed().as_secs_f64();
            let mut l = Tensor::from_slice(&[local]);
            ctx.group().all_reduce(&mut l, ReduceOp::Avg)?;
            let loss = l.double_value(&[0]);
            // Every rank holds the same averaged loss, so every rank stops here together. (A
            // non-finite loss gives non-finite gradients, which the step refuses or, with fp16's
            // loss scaler, skips: no weight took this step's update.)
            anyhow::ensure!(
                loss.is_finite(),
                "step {step}: the loss is {loss} — the forward overflowed or training diverged (learning rate {} \
                 too high?{}); the last losses: {:.4?}. The step was not applied; nothing was saved",
                cfg.lr,
                if out.skipped {
                    "; fp16 activations out of range, which loss scaling cannot fix: try bf16"
                } else {
                    ""
                },
                &losses[losses.len().saturating_sub(4)..]
            );
            losses.push(loss);
            norms.push(out.grad_norm.is_finite().then_some(out.grad_norm));
            if step >= warmup {
                step_s.push(dt);
            }
            let mut line = json!({"step": step, "loss": loss, "lr": cfg.lr, "grad_norm": out.grad_norm, "step_s": dt,
                                  "tokens_per_s": tokens_per_step / dt});
            if let Some(s) = out.loss_scale {
                line["loss_scale"] = json!(s);
                line["skipped"] = json!(out.skipped);
            }
            ctx.report(line)?;
        }
        // The job's saves are over: its checkpoint folders are free for the next job.
        drop(release);
        if let Some(p) = &self.save {
            // Sharded strategies hold pieces: every rank takes part in gathering the full weights.
            let full = dp.full_parameters()?;
            if rank == 0 {
                crate::model::write_state_dict(dp.model().state_dict_of(full), p)?;
            }
        }
        let sent_per_step =
            (ctx.group().stats().bytes_sent - sent0 - eval_sent) as f64 / (self.steps - start).max(1) as f64;
        let median = crate::bench::median(&mut step_s);
        let st = dp.stats().since(&eval_stats);
        let strategy = ctx.scaling().strategy;
        Ok(RunSummary {
            strategy: format!("{strategy:?}").to_lowercase(),
            variant: (strategy == Strategy::Ddp).then(|| format!("{:?}", ctx.scaling().variant).to_lowercase()),
            memory: dp.memory(&opt),
            world_size: n,
            params,
            tokens_per_step,
            measured_steps: step_s.len(),
            median_step_s: median,
            tokens_per_s: tokens_per_step / median,
            final_loss: *losses.last().unwrap_or(&f64::NAN),
            losses,
            grad_norms: norms,
            comm_s: st.comm_s,
            exposed_comm_s: st.exposed_s,
            hidden_comm_fraction: st.hidden_fraction(),
            ddp: st,
            bytes_sent_per_step: sent_per_step,
            peak_rss_bytes: crate::bench::peak_rss_bytes(),
            cuda: match ctx.device()? {
                tch::Device::Cuda(i) => crate::device::cuda_info(i),
                _ => None,
            },
            checkpoint_save_s: save_s,
            checkpoint_bytes_written: save_bytes,
            resume_load_s: load_s,
            resume_bytes_read: load_bytes,
            precision: ctx.scaling().precision,
            skipped_steps: scaler.map_or(0, |s| s.skipped),
            pipeline: None,
            evals: evals.map(|e| e.points).unwrap_or_default(),
        })
    }

    /// A checkpoint's job state against this job: the model must be the same, and so must the
    /// seed (or the resumed run would not continue the saved one).
    pub(super) fn check_resumable(&self, extra: &serde_json::Value, world_size: usize) -> anyhow::Result<()> {
        let Some(saved) = extra.get("job") else { return Ok(()) };
        let saved: GptJob = serde_json::from_value(saved.clone())?;
        let mut diffs = Vec::new();
        let saved_ranks = extra.get("world_size").and_then(|w| w.as_u64()).unwrap_or(1) as usize;
        let mut same = |what: &str, a: String, b: String| {
            if a != b {
                diffs.push(format!("{what}: {a} in the checkpoint, {b} here"));
            }
        };
        same("accum", saved.accum.to_string(), self.accum.to_string());
        same("optim", format!("{:?}", saved.optim), format!("{:?}", self.optim));
        same("lr_schedule", format!("{:?}", saved.schedule()), format!("{:?}", self.schedule()));
        same("grad_clip", format!("{:?}", saved.grad_clip), format!("{:?}", self.grad_clip));
        same("data", format!("{:?}", saved.data), format!("{:?}", self.data));
        let global = |j: &GptJob, n: usize| format!("{} rows", j.batch_size * n);
        same("global batch", global(&saved, saved_ranks), global(self, world_size));
        let (a, b) = (serde_json::to_value(saved.model)?, serde_json::to_value(self.model)?);
        for (k, v) in a.as_object().into_iter().flatten() {
            if b.get(k) != Some(v) {
                diffs.push(format!("model.{k}: {v} in the checkpoint, {} here", b[k]));
            }
        }
        if saved.seed != self.seed {
            diffs.push(format!("seed: {} in the checkpoint, {} here", saved.seed, self.seed));
        }
        anyhow::ensure!(diffs.is_empty(), "the checkpoint was saved by another job:\n  {}", diffs.join("\n  "));
        Ok(())
    }
}
