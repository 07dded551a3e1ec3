//! A GPT training job — data, model, optimizer and the per-worker loop — as the `train` bin and
//! the lesson bins run it through the [`Trainer`](crate::trainer::Trainer).
//!
//! Every step: this rank's rows of the global batch ([`DistributedSampler`]), a barrier (so step
//! times measure the slowest rank), [`train_step`](crate::ddp::train_step), and the global loss
//! (average of the ranks' equal-sized local means). Each step is reported to the driver.

use crate::comm::{Backend, ReduceOp};
use crate::data::{synthetic_corpus, DistributedSampler, Tokens};
use crate::ddp::{self, DdpStats, Variant};
use crate::model::{Gpt, GptConfig, Model};
use crate::optim::{AdamWConfig, LrSchedule, StepConfig};
use crate::trainer::{ScalingConfig, Strategy, TrainContext, Trainer};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;
use tch::Tensor;

/// Where the tokens come from.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum DataSource {
    /// A token file (little-endian u16 ids).
    File(PathBuf),
    /// The synthetic arithmetic corpus: this many tokens from this seed.
    Synthetic { tokens: usize, seed: u64 },
}

impl DataSource {
    pub fn load(&self) -> anyhow::Result<Tokens> {
        match self {
            DataSource::File(p) => Tokens::read(p),
            DataSource::Synthetic { tokens, seed } => Ok(synthetic_corpus(*tokens, *seed)),
        }
    }
}

/// Everything a GPT training run needs besides the scaling.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GptJob {
    pub model: GptConfig,
    /// Sequences per rank per step.
    pub batch_size: usize,
    /// Micro-batches per step (gradient accumulation).
    pub accum: i64,
    pub steps: u64,
    /// Steps left out of the throughput median (a run of `steps <= warmup` leaves out all but its
    /// last step, and says so in [`RunSummary::measured_steps`]).
    pub warmup: u64,
    pub optim: AdamWConfig,
    /// Learning rate per step (nanoGPT's warm-up + cosine); `None`: `optim.lr` at every step.
    pub lr_schedule: Option<LrSchedule>,
    /// Clip the global gradient norm to this (nanoGPT's `grad_clip`); `None`: no clipping.
    pub grad_clip: Option<f64>,
    pub data: DataSource,
    /// Model init and batch sampling seed.
    pub seed: u64,
    /// Start from these weights (safetensors, nanoGPT names).
    pub init: Option<PathBuf>,
    /// Rank 0 writes the final weights here.
    pub save: Option<PathBuf>,
    /// Distributed checkpoints (lesson 10): where, how often, and what to resume from.
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
}

/// Distributed checkpoints of a job ([`crate::checkpoint`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CheckpointConfig {
    /// The folder of step-N checkpoints (and its `latest` pointer).
    pub dir: Option<PathBuf>,
    /// Save every this many steps (0: only where asked by `at_end`).
    pub every: u64,
    /// Also save after the last step.
    pub at_end: bool,
    /// Keep only the newest K checkpoints.
    pub keep_last: Option<usize>,
    /// Start from this checkpoint (a step-N folder, or a folder of them: its latest).
    pub resume: Option<PathBuf>,
}

/// What a finished run reports (rank 0's view; every rank holds the same weights).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RunSummary {
    pub strategy: String,
    pub variant: Option<String>,
    pub world_size: usize,
    pub params: i64,
    pub tokens_per_step: f64,
    /// Steps timed (after warm-up): throughput from fewer than a handful is rough.
    pub measured_steps: usize,
    pub median_step_s: f64,
    /// All ranks together, median over the steps after warm-up.
    pub tokens_per_s: f64,
    pub final_loss: f64,
    /// Global loss of every step.
    pub losses: Vec<f64>,
    /// Communication seconds (per rank, all steps), the part not hidden behind compute, and the
    /// hidden fraction.
    pub comm_s: f64,
    pub exposed_comm_s: f64,
    pub hidden_comm_fraction: f64,
    pub ddp: DdpStats,
    /// Bytes this rank holds (rank 0), counted from its tensors.
    pub memory: crate::zero::MemoryStats,
    /// Communication bytes this rank sent over the run, per step.
    pub bytes_sent_per_step: f64,
    /// Peak resident set size of rank 0's process during the training steps (meaningful when
    /// ranks are processes).
    pub peak_rss_bytes: Option<u64>,
    /// On a GPU: rank 0's device (name, bytes in use on it, capacity) after the last step.
    #[serde(default)]
    pub cuda: Option<crate::device::CudaInfo>,
    /// The compute precision, and the steps fp16's loss scaler skipped.
    #[serde(default)]
    pub precision: crate::precision::Precision,
    #[serde(default)]
    pub skipped_steps: u64,
    /// Distributed checkpoints (rank 0): seconds and bytes of its saves, and of the resume's load.
    #[serde(default)]
    pub checkpoint_save_s: f64,
    #[serde(default)]
    pub checkpoint_bytes_written: u64,
    #[serde(default)]
    pub resume_load_s: f64,
    #[serde(default)]
    pub resume_bytes_read: u64,
    /// Under pipeline parallelism (rank 0): its measured bubble and activations held.
    #[serde(default)]
    pub pipeline: Option<PipelineStats>,
}

/// What a pipeline rank measured (`train --pp`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PipelineStats {
    /// Idle fraction of the step (1 − compute / step time), median over the timed steps.
    pub bubble: f64,
    /// The most micro-batches whose activations the rank held at once.
    pub peak_in_flight: usize,
}

impl GptJob {
    /// Build the model: fresh init from `seed`, or the `init` weights.
    pub fn build_model(&self) -> anyhow::Result<Gpt> {
        let m = Gpt::new(self.model, self.seed)?;
        if let Some(p) = &self.init {
            m.load_safetensors(p)?;
        }
        Ok(m)
    }

    /// Check the job against its data before any worker starts.
    pub fn check(&self, world_size: usize) -> anyhow::Result<()> {
        self.model.validate()?;
        anyhow::ensure!(self.steps >= 1, "steps must be at least 1");
        anyhow::ensure!(
            self.accum >= 1 && self.accum as usize <= self.batch_size,
            "accumulation steps must be in 1..={} (the per-rank batch)",
            self.batch_size
        );
        self.schedule().validate().map_err(anyhow::Error::msg)?;
        if let Some(c) = self.grad_clip {
            anyhow::ensure!(c.is_finite() && c > 0.0, "the gradient clip must be a positive norm, got {c}");
        }
        DistributedSampler::new(self.model.block_size as usize, self.batch_size * world_size, 0, world_size, 0)?;
        self.data.load()?.check(self.model.vocab_size, self.model.block_size)
    }

    /// The learning-rate schedule in force (constant `optim.lr` unless one is set).
    pub fn schedule(&self) -> LrSchedule {
        self.lr_schedule.unwrap_or(LrSchedule::constant(self.optim.lr))
    }

    /// The per-worker loop (call inside [`Trainer::fit`]). Returns this rank's summary.
    pub fn run(&self, ctx: &mut TrainContext) -> anyhow::Result<RunSummary> {
        anyhow::ensure!(
            !ctx.scaling().sequence_parallel || ctx.scaling().tensor_parallel > 1,
            "sequence parallelism splits over the tensor-parallel group: it needs tensor_parallel > 1 (--tp)"
        );
        if ctx.scaling().pipeline.stages != 1 {
            return crate::pipeline::train::run(self, ctx);
        }
        if ctx.scaling().tensor_parallel != 1 {
            return crate::tp::train::run(self, ctx, ctx.scaling().tensor_parallel);
        }
        let data = self.data.load()?;
        let model = self.build_model()?;
        let params = model.num_params();
        let device = ctx.device()?;
        let (mut dp, mut opt) = ctx.prepare(Box::new(model), &self.optim)?;
        let (rank, n) = (ctx.rank(), ctx.world_size());
        // fp16 needs dynamic loss scaling (PyTorch's GradScaler rules); bf16 and fp32 do not.
        let mut scaler =
            (ctx.scaling().precision == crate::precision::Precision::Fp16).then(crate::precision::GradScaler::default);
        let mut start = 0;
        let (mut save_s, mut save_bytes, mut load_s, mut load_bytes) = (0.0, 0, 0.0, 0);
        if let Some(from) = &self.checkpoint.resume {
            let r = crate::checkpoint::load(&mut *dp, &mut opt, from)?;
            (load_s, load_bytes) = (r.seconds, r.bytes);
            self.check_resumable(&r.extra, n)?;
            if let (Some(s), Some(saved)) = (scaler.as_mut(), r.extra.get("scaler").filter(|v| !v.is_null())) {
                *s = serde_json::from_value(saved.clone())?;
            }
            start = r.step;
            anyhow::ensure!(
                start <= self.steps,
                "the checkpoint is at step {start}, past this run's {} steps (to train on, ask for more --steps with \
                 the same LR schedule: --lr-decay-iters)",
                self.steps
            );
        }
        let sampler = DistributedSampler::new(self.model.block_size as usize, self.batch_size * n, rank, n, self.seed)?;
        let tokens_per_step = (self.batch_size * n) as f64 * self.model.block_size as f64;
        let (mut step_s, mut losses) = (Vec::new(), Vec::new());
        let sent0 = ctx.group().stats().bytes_sent;
        // Peak RSS from here on: the training steps, not the construction of the full model.
        crate::bench::reset_peak_rss();
        // A run shorter than its warm-up still runs: it times its last step.
        let warmup = (start + self.warmup).min(self.steps.saturating_sub(1));
        for step in start..self.steps {
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
            let last = step + 1 == self.steps;
            if let Some(dir) = &self.checkpoint.dir {
                let every = self.checkpoint.every > 0 && (step + 1) % self.checkpoint.every == 0;
                if every || (last && self.checkpoint.at_end) {
                    let extra = json!({"job": self, "strategy": ctx.scaling().strategy, "world_size": n,
                                       "precision": ctx.scaling().precision, "scaler": scaler, "loss": loss});
                    let opts =
                        crate::checkpoint::SaveOptions { keep_last: self.checkpoint.keep_last, ..Default::default() };
                    let r = crate::checkpoint::save(&*dp, &opt, dir, step + 1, extra, &opts)
                        .map_err(|e| anyhow::anyhow!("step {step}: saving the checkpoint: {e:#}"))?;
                    save_s += r.seconds;
                    save_bytes += r.bytes;
                }
            }
        }
        if let Some(p) = &self.save {
            // Sharded strategies hold pieces: every rank takes part in gathering the full weights.
            let full = dp.full_parameters()?;
            if rank == 0 {
                crate::model::write_state_dict(dp.model().state_dict_of(full), p)?;
            }
        }
        let sent_per_step = (ctx.group().stats().bytes_sent - sent0) as f64 / (self.steps - start).max(1) as f64;
        let median = crate::bench::median(&mut step_s);
        let st = dp.stats();
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
        })
    }

    /// A checkpoint's job state against this job: the model must be the same, and so must the
    /// seed (or the resumed run would not continue the saved one).
    fn check_resumable(&self, extra: &serde_json::Value, world_size: usize) -> anyhow::Result<()> {
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

    /// Run under a supervisor, like torchrun's `--max-restarts` (lesson 10): when a rank dies or
    /// fails, the launcher stops the others (their collectives fail), and the job starts again —
    /// a new generation: new processes, a new rendezvous (port and secret), so no rank of the old
    /// generation can join — from the latest committed checkpoint in `checkpoint.dir`. With
    /// `shrink_on_failure` the new generation has fewer ranks (the largest count, down to
    /// `min_world_size`, that the global batch splits over: [`Elastic::after_failure`]), the
    /// same global batch, and resharding happens on load. Gives up after `max_restarts`.
    pub fn fit_elastic(
        &self,
        scaling: ScalingConfig,
        elastic: &Elastic,
        progress: bool,
        json_lines: bool,
    ) -> anyhow::Result<(RunSummary, Vec<Attempt>)> {
        let dir = self.checkpoint.dir.clone().ok_or_else(|| {
            anyhow::anyhow!(
                "an elastic run restarts from its checkpoints: give it a checkpoint folder (--checkpoint-dir)"
            )
        })?;
        anyhow::ensure!(self.checkpoint.every > 0, "an elastic run needs checkpoints during training (--save-every)");
        if crate::launch::is_spawned_child() {
            // A worker of generation g: the supervisor put g's job and scaling in the environment
            // (whatever elastic run this process reached first, it runs its driver's current one).
            let (job, scaling): (GptJob, ScalingConfig) = serde_json::from_str(&std::env::var(ENV_ELASTIC)?)?;
            crate::launch::align_spawn_call_with_driver();
            let s = job.fit(scaling, false, false)?;
            return Ok((s, vec![]));
        }
        let mut attempts: Vec<Attempt> = Vec::new();
        let (mut world_size, mut batch_size) = (scaling.num_workers, self.batch_size);
        // The variables that tell workers their generation live as long as this run.
        struct Unset;
        impl Drop for Unset {
            fn drop(&mut self) {
                std::env::remove_var(crate::launch::ENV_GENERATION);
                std::env::remove_var(ENV_ELASTIC);
            }
        }
        let _unset = Unset;
        for generation in 0..=elastic.max_restarts {
            // From the latest checkpoint of this run's folder, else where the run itself started.
            let resume = match crate::checkpoint::try_committed(&dir)?.last() {
                Some(_) if generation > 0 => Some(dir.clone()),
                _ => self.checkpoint.resume.clone(),
            };
            let attempt = Attempt { generation, world_size, batch_size, resume, error: None };
            let job = attempt.job(self);
            let s = ScalingConfig { num_workers: world_size, ..scaling.clone() };
            std::env::set_var(crate::launch::ENV_GENERATION, generation.to_string());
            std::env::set_var(ENV_ELASTIC, serde_json::to_string(&(&job, &s))?);
            let r = job.fit(s, progress, json_lines);
            attempts.push(attempt);
            match r {
                Ok(s) => return Ok((s, attempts)),
                Err(e) => {
                    attempts.last_mut().expect("pushed").error = Some(format!("{e:#}"));
                    match elastic.after_failure(generation, world_size, batch_size) {
                        Ok((w, b)) => (world_size, batch_size) = (w, b),
                        Err(why) => anyhow::bail!("{why}; generation {generation} failed with: {e:#}"),
                    }
                }
            }
        }
        unreachable!("the loop returns")
    }

    /// Check, then run on `scaling`'s workers; rank 0's summary.
    pub fn fit(&self, scaling: ScalingConfig, progress: bool, json_lines: bool) -> anyhow::Result<RunSummary> {
        if !crate::launch::is_spawned_child() {
            self.check(scaling.num_workers)?;
        }
        let mut t = Trainer::new(scaling).json_lines(json_lines);
        if progress {
            t = t.progress(self.steps);
        }
        let mut fit = t.fit(|ctx| self.run(ctx))?;
        Ok(fit.results.remove(0))
    }
}

/// Restart policy of [`GptJob::fit_elastic`].
#[derive(Clone, Debug, Default)]
pub struct Elastic {
    /// Restarts after the first attempt before giving up (torchrun's `--max-restarts`).
    pub max_restarts: u32,
    /// Never go below this many ranks when shrinking.
    pub min_world_size: usize,
    /// After a failure, continue with fewer ranks (the failed rank's machine is gone): the largest
    /// count below the failed one that the global batch splits over.
    pub shrink_on_failure: bool,
}

impl Elastic {
    /// After generation `generation` (0-based) failed at `world_size` ranks of `batch_size` rows:
    /// the world size and rows per rank of the next generation, or why the run gives up. It gives
    /// up once `max_restarts` restarts are spent. Without `shrink_on_failure` it restarts at the
    /// same size; with it, at the largest world size below the failed one, and at least
    /// `min_world_size` (and 1), over which the global batch splits evenly — the same global
    /// batch, so the run goes on training the same thing.
    pub fn after_failure(
        &self,
        generation: u32,
        world_size: usize,
        batch_size: usize,
    ) -> Result<(usize, usize), String> {
        if generation >= self.max_restarts {
            return Err(format!("gave up after {} restart(s) (--max-restarts)", self.max_restarts));
        }
        if !self.shrink_on_failure {
            return Ok((world_size, batch_size));
        }
        let global = world_size * batch_size;
        let lowest = self.min_world_size.max(1);
        (lowest..world_size).rev().find(|w| global % w == 0).map(|w| (w, global / w)).ok_or_else(|| {
            format!(
                "cannot go on with fewer than {world_size} ranks: the global batch of {global} rows splits over \
                 none of {lowest}..{world_size} ranks (--min-world-size {})",
                self.min_world_size
            )
        })
    }
}

/// One generation of an elastic run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Attempt {
    pub generation: u32,
    pub world_size: usize,
    /// Rows per rank (the global batch stays the same when the world shrinks).
    pub batch_size: usize,
    /// The checkpoint folder it resumed from (its latest), if any.
    pub resume: Option<PathBuf>,
    /// How it ended, if it failed.
    pub error: Option<String>,
}

impl Attempt {
    fn job(&self, base: &GptJob) -> GptJob {
        let mut j = base.clone();
        j.batch_size = self.batch_size;
        j.checkpoint.resume = self.resume.clone();
        j
    }
}

const ENV_ELASTIC: &str = "SHARDLAB_ELASTIC_ATTEMPT";

/// A [`ScalingConfig`] for `strategy` on `world_size` workers (single: one local worker).
pub fn scaling(
    strategy: Strategy,
    world_size: usize,
    backend: Backend,
    variant: Variant,
    bucket_cap_bytes: usize,
) -> ScalingConfig {
    ScalingConfig {
        num_workers: world_size,
        backend: if strategy == Strategy::Single { Backend::Local } else { backend },
        strategy,
        variant,
        bucket_cap_bytes,
        ..ScalingConfig::default()
    }
}

/// One training run described completely, so that a bin can run it in a fresh process of itself
/// ([`run_isolated`]): every measurement starts from a clean process (memory, threads, ports).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OneRun {
    pub job: GptJob,
    pub strategy: Strategy,
    pub world_size: usize,
    pub backend: Backend,
    pub variant: Variant,
    pub bucket_cap_bytes: usize,
    /// libtorch intra-op threads per rank.
    pub threads: Option<i32>,
    /// Activation checkpointing (lesson 09).
    #[serde(default)]
    pub checkpointing: crate::stages::Checkpointing,
    /// ZeRO-3/FSDP: free each block's parameters after its forward (and recompute it in backward).
    #[serde(default = "yes")]
    pub reshard_after_forward: bool,
    /// Compute precision and (ZeRO) gradient-reduction precision (lesson 08).
    #[serde(default)]
    pub precision: crate::precision::Precision,
    #[serde(default)]
    pub reduce_dtype: crate::precision::Precision,
    /// ZeRO/FSDP CPU offload (lesson 11).
    #[serde(default)]
    pub offload: bool,
    /// Where the ranks compute (lesson 11).
    #[serde(default)]
    pub device: crate::device::DeviceChoice,
    /// Tensor-parallel group size (lesson 12); 1: none.
    #[serde(default = "one")]
    pub tp: usize,
    /// Pipeline parallelism (lesson 13); 1 stage: none.
    #[serde(default)]
    pub pp: crate::pipeline::PipelineConfig,
}

fn one() -> usize {
    1
}

fn yes() -> bool {
    true
}

const RUN_ONE_FLAG: &str = "--run-one";

/// Call first thing in `main` of a bin that uses [`run_isolated`]: if this process was started
/// to run one configuration, run it, print its summary as JSON and exit.
pub fn run_one_if_asked() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) != Some(RUN_ONE_FLAG) {
        return;
    }
    let result = (|| -> anyhow::Result<()> {
        let r: OneRun = serde_json::from_str(args.get(2).map(String::as_str).unwrap_or(""))?;
        let mut s = scaling(r.strategy, r.world_size, r.backend, r.variant, r.bucket_cap_bytes);
        s.threads_per_worker = r.threads;
        s.activation_checkpointing = r.checkpointing;
        s.reshard_after_forward = r.reshard_after_forward;
        s.precision = r.precision;
        s.reduce_dtype = r.reduce_dtype;
        s.offload = r.offload;
        s.device = r.device;
        s.tensor_parallel = r.tp;
        s.pipeline = r.pp;
        let out = r.job.fit(s, false, false)?;
        println!("{}", serde_json::to_string(&out)?);
        Ok(())
    })();
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1)
        }
    }
}

/// Run `r` in a fresh process of the current executable (whose `main` calls
/// [`run_one_if_asked`]) and return rank 0's summary.
pub fn run_isolated(r: &OneRun) -> anyhow::Result<RunSummary> {
    run_isolated_with_env(r, &[])
}

/// [`run_isolated`] with extra environment variables for the fresh process (e.g. the allocator's).
pub fn run_isolated_with_env(r: &OneRun, env: &[(&str, &str)]) -> anyhow::Result<RunSummary> {
    use anyhow::Context;
    let exe = std::env::current_exe()?;
    let out = std::process::Command::new(exe)
        .arg(RUN_ONE_FLAG)
        .arg(serde_json::to_string(r)?)
        .envs(env.iter().copied())
        .output()?;
    anyhow::ensure!(out.status.success(), "run failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap_or_default()).context("parsing a run's summary")
}

/// Run `benches/torch_gpt.py train` (PyTorch 2.11 from `.venv`) with the same shape, batch,
/// steps and data; its summary (`tokens_per_s`, …). `strategy`: single, ddp or fsdp.
pub fn pytorch_train(job: &GptJob, strategy: &str, world_size: usize) -> anyhow::Result<serde_json::Value> {
    pytorch_train_with(job, strategy, world_size, &PyTorchOptions::default())
}

/// Options of [`pytorch_train_with`].
#[derive(Clone, Debug)]
pub struct PyTorchOptions<'a> {
    /// `torch.set_num_threads` per process (default 1: ranks share the machine).
    pub threads: usize,
    /// `none`, `full` or `every:K`: `torch.utils.checkpoint.checkpoint(block, x,
    /// use_reentrant=False)` around the chosen blocks (blocks 0, K, 2K, …), as shardlab's policy.
    pub checkpointing: crate::stages::Checkpointing,
    /// Extra environment variables for the Python process (e.g. the allocator's).
    pub env: &'a [(&'a str, &'a str)],
    /// fsdp: FSDP2's `reshard_after_forward` for the blocks (default true, as FSDP2's).
    pub reshard_after_forward: bool,
    /// fp32, or bf16/fp16 under `torch.autocast("cpu", dtype=…)` (fp16 with a `GradScaler`).
    pub precision: crate::precision::Precision,
}

impl Default for PyTorchOptions<'_> {
    fn default() -> Self {
        PyTorchOptions {
            threads: 1,
            checkpointing: crate::stages::Checkpointing::None,
            env: &[],
            reshard_after_forward: true,
            precision: crate::precision::Precision::Fp32,
        }
    }
}

/// [`pytorch_train`] with options; the summary also carries `peak_rss_bytes` (rank 0's process).
pub fn pytorch_train_with(
    job: &GptJob,
    strategy: &str,
    world_size: usize,
    opts: &PyTorchOptions,
) -> anyhow::Result<serde_json::Value> {
    use anyhow::Context;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let py = root.join(".venv/bin/python");
    anyhow::ensure!(py.exists(), "{} is missing: run `bash .ci/setup`", py.display());
    let DataSource::File(data) = &job.data else { anyhow::bail!("the PyTorch comparison needs a token file") };
    let c = job.model;
    let out = std::process::Command::new(py)
        .args(["-W", "ignore"])
        .arg(root.join("benches/torch_gpt.py"))
        .args(["--n-layer", &c.n_layer.to_string(), "--n-head", &c.n_head.to_string()])
        .args(["--n-embd", &c.n_embd.to_string(), "--block-size", &c.block_size.to_string()])
        .args(["--vocab-size", &c.vocab_size.to_string(), "--threads", &opts.threads.to_string()])
        .args(["train", "--strategy", strategy, "--checkpointing", &opts.checkpointing.to_string()])
        .args(["--world-size", &world_size.to_string(), "--batch-size", &job.batch_size.to_string()])
        .args([
            "--steps",
            &job.steps.to_string(),
            "--warmup",
            &job.warmup.to_string(),
            "--lr",
            &job.optim.lr.to_string(),
        ])
        .arg("--data")
        .arg(data)
        .args(if opts.reshard_after_forward { &[][..] } else { &["--no-reshard-after-forward"][..] })
        .args(["--precision", opts.precision.name()])
        .envs(opts.env.iter().copied())
        .output()?;
    anyhow::ensure!(out.status.success(), "PyTorch run failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default())
        .context("parsing PyTorch's summary")
}

impl GptJob {
    /// The speed-comparison job of lessons 05–06: batch 8 per rank, no accumulation, default
    /// AdamW, seed 1, reading `data` (a token file PyTorch's reference reads too).
    pub fn benchmark(model: GptConfig, data: PathBuf, steps: u64, warmup: u64) -> Self {
        GptJob {
            model,
            batch_size: 8,
            accum: 1,
            steps,
            warmup,
            optim: AdamWConfig::default(),
            lr_schedule: None,
            grad_clip: None,
            data: DataSource::File(data),
            seed: 1,
            init: None,
            save: None,
            checkpoint: Default::default(),
        }
    }
}

/// A synthetic-corpus token file in the temp folder, removed when dropped (also on errors).
pub struct TempCorpus {
    pub path: PathBuf,
}

impl TempCorpus {
    /// Write `tokens` tokens of the synthetic corpus (seed 1) to a file named after `tag` and this process.
    pub fn new(tag: &str, tokens: usize) -> anyhow::Result<Self> {
        let path = std::env::temp_dir().join(format!("shardlab-{tag}-{}.bin", std::process::id()));
        synthetic_corpus(tokens, 1).write(&path)?;
        Ok(TempCorpus { path })
    }
}

impl Drop for TempCorpus {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
