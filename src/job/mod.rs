//! A GPT training job: what to train ([`GptJob`]: data, model, optimizer, steps, checkpoints) and
//! what a run reports ([`RunSummary`]). Split by concern:
//!
//! * [`step_loop`] — the per-worker loop every `train` run goes through ([`GptJob::run`]), and
//!   [`mesh_run`] — the loop of a layout with tensor or pipeline parallelism, on the
//!   [engine](crate::engine);
//! * [`elastic`] — the supervisor that restarts a failed job from its checkpoints ([`GptJob::fit_elastic`]);
//! * [`isolated`] — one run described completely and run in a fresh process ([`OneRun`],
//!   [`run_isolated`]), as the lesson bins' measurements and benchmarks do;
//! * [`eval`] — periodic evaluation on both splits and the best val loss's checkpoint;
//! * [`restore`] — a trained model back from a checkpoint of any layout, for inference;
//! * [`pytorch`] — the same job run by PyTorch (`benches/torch_gpt.py`), for like-for-like comparisons.

pub mod elastic;
pub mod eval;
pub mod isolated;
pub mod mesh_run;
pub mod pytorch;
pub mod restore;
pub mod step_loop;

pub use elastic::{Attempt, Elastic};
pub use eval::{EvalConfig, EvalPoint};
pub use isolated::{run_isolated, run_isolated_with_env, run_one_if_asked, scaling, OneRun, TempCorpus};
pub use pytorch::{pytorch_train, pytorch_train_with, PyTorchOptions};

use crate::data::{synthetic_corpus, DistributedSampler, Tokens};
use crate::ddp::DdpStats;
use crate::model::{Gpt, GptConfig};
use crate::optim::{AdamWConfig, LrSchedule};
use crate::trainer::{ScalingConfig, Trainer};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Where the tokens come from.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum DataSource {
    /// A token file (little-endian u16 ids); no held-out split.
    File(PathBuf),
    /// A folder in nanoGPT's layout: `train.bin`, `val.bin` and `meta.json` (its vocabulary;
    /// [`crate::corpus`], `cargo run --release --bin data -- shakespeare`).
    Dir(PathBuf),
    /// The synthetic arithmetic corpus: this many tokens from this seed (and, held out, a tenth as
    /// many from another seed).
    Synthetic { tokens: usize, seed: u64 },
}

impl DataSource {
    /// `path` as a source: a folder is nanoGPT's layout, a file a token file.
    pub fn from_path(path: PathBuf) -> DataSource {
        if path.is_dir() {
            DataSource::Dir(path)
        } else {
            DataSource::File(path)
        }
    }
    /// The tokens trained on.
    pub fn load(&self) -> anyhow::Result<Tokens> {
        match self {
            DataSource::File(p) => Tokens::read(p),
            DataSource::Dir(d) => Tokens::read(d.join("train.bin")),
            DataSource::Synthetic { tokens, seed } => Ok(synthetic_corpus(*tokens, *seed)),
        }
    }
    /// The held-out tokens (nanoGPT's `val` split), if the source has them.
    pub fn load_val(&self) -> anyhow::Result<Option<Tokens>> {
        match self {
            DataSource::File(_) => Ok(None),
            DataSource::Dir(d) => Tokens::read(d.join("val.bin")).map(Some),
            // Another seed: sums the model has not seen in this order (the format is the same).
            DataSource::Synthetic { tokens, seed } => {
                Ok(Some(synthetic_corpus((*tokens / 10).max(1024), seed ^ 0x7661_6c5f_7370_6c74)))
            }
        }
    }
    /// The vocabulary the source declares (`meta.json`'s `vocab_size`), if any.
    pub fn vocab_size(&self) -> anyhow::Result<Option<usize>> {
        match self {
            // nanoGPT's layouts without a vocabulary file (openwebtext's GPT-2 ids) have none.
            DataSource::Dir(d) if !d.join("meta.json").exists() => Ok(None),
            DataSource::Dir(d) => Ok(Some(crate::corpus::Meta::read(d)?.vocab_size)),
            _ => Ok(None),
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
    /// Periodic evaluation on both splits (nanoGPT's `estimate_loss`); off by default.
    #[serde(default)]
    pub eval: EvalConfig,
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
    /// The global gradient norm of every step, before clipping (`None` on a step fp16's loss
    /// scaler skipped: not finite, which JSON cannot carry).
    #[serde(default)]
    pub grad_norms: Vec<Option<f64>>,
    /// Communication seconds (per rank, all steps), the part not hidden behind compute, and the
    /// hidden fraction.
    pub comm_s: f64,
    pub exposed_comm_s: f64,
    pub hidden_comm_fraction: f64,
    /// The data-parallel strategy's counters over the training steps (evaluations' forwards,
    /// ZeRO-3's gathers for them, taken out).
    pub ddp: DdpStats,
    /// Bytes this rank holds (rank 0), counted from its tensors.
    pub memory: crate::zero::MemoryStats,
    /// Communication bytes this rank sent over the run, per step.
    pub bytes_sent_per_step: f64,
    /// Peak resident set size of rank 0's process during the training steps and evaluations
    /// (an evaluation holds no more than a step: the same micro-batches, forward only or with its
    /// gradients dropped; meaningful when ranks are processes).
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
    /// Every evaluation of the run (`eval.interval > 0`), in order.
    #[serde(default)]
    pub evals: Vec<EvalPoint>,
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
        if let Some(v) = self.data.vocab_size()? {
            anyhow::ensure!(
                self.model.vocab_size >= v as i64,
                "the data's vocabulary has {v} tokens (meta.json) but the model's vocab_size is {}",
                self.model.vocab_size
            );
        }
        self.data.load()?.check(self.model.vocab_size, self.model.block_size)?;
        self.eval.check(self)
    }

    /// The learning-rate schedule in force (constant `optim.lr` unless one is set).
    pub fn schedule(&self) -> LrSchedule {
        self.lr_schedule.unwrap_or(LrSchedule::constant(self.optim.lr))
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
