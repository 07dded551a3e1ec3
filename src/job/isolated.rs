//! One run described completely ([`OneRun`]) and run in a fresh process of the current bin
//! ([`run_isolated`]), so every measurement starts from a clean process (memory, threads, ports);
//! the benchmark job of lessons 05–06 and a temporary corpus file for it.

use super::{DataSource, GptJob, RunSummary};
use crate::comm::Backend;
use crate::data::synthetic_corpus;
use crate::ddp::Variant;
use crate::model::GptConfig;
use crate::optim::AdamWConfig;
use crate::trainer::{ScalingConfig, Strategy};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

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
            eval: Default::default(),
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
