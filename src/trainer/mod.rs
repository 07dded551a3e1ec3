//! The Trainer: run a per-worker training loop on every rank, Ray Train style.
//!
//! <!-- listing: examples/trainer_fit.rs (compiled and run by tests/docs.rs) -->
//! ```no_run
//! use serde_json::json;
//! use shardlab::ddp::train_step;
//! use shardlab::prelude::*;
//!
//! let scaling = ScalingConfig {
//!     num_workers: 2,
//!     backend: Backend::Tcp,
//!     strategy: Strategy::Ddp,
//!     variant: Variant::Bucketed,
//!     bucket_cap_bytes: 4 << 20,
//!     ..ScalingConfig::default()
//! };
//! let fit = Trainer::new(scaling).progress(20).fit(|ctx| {
//!     let data = synthetic_corpus(1_000_000, 1);
//!     let model = Gpt::new(GptConfig::bench(), 0)?;
//!     // DDP: rank 0's weights broadcast; the AdamW is ours, stepped by train_step.
//!     let (mut dp, mut opt) = ctx.prepare(Box::new(model), &AdamWConfig::default())?;
//!     let n = ctx.world_size();
//!     let sampler = DistributedSampler::new(128, 8 * n, ctx.rank(), n, 0)?;
//!     let schedule = LrSchedule { max_lr: 1e-3, min_lr: 1e-4, warmup_iters: 2, decay_iters: 20 };
//!     for step in 0..20u64 {
//!         let cfg = StepConfig { lr: schedule.lr(step), grad_clip: Some(1.0) };
//!         let out = train_step(&mut *dp, &mut opt, &sampler.batch(&data, step), 1, cfg)?;
//!         // This rank's local loss; the gradient norm is global (the same on every rank).
//!         ctx.report(json!({"step": step, "loss": out.loss, "grad_norm": out.grad_norm}))?;
//!     }
//!     Ok(dp.stats().hidden_fraction())
//! })?;
//! println!("rank 0 reported {} times; rank 1 hid {:.0}%", fit.reports.len(), 100.0 * fit.results[1]);
//! ```
//!
//! * [`ScalingConfig`] — how many workers, which backend and strategy (Ray's `ScalingConfig`).
//! * [`Trainer::fit`] — starts the workers (threads or processes, see [`crate::launch`]), runs the
//!   loop on each, returns every worker's result and the metrics rank 0 reported.
//! * [`TrainContext::prepare`] — wraps the model for the strategy (Ray's `prepare_model`) and
//!   builds its AdamW.
//! * [`TrainContext::report`] — streams a metrics object to the driver (Ray's `train.report`):
//!   each rank appends JSON lines to its own file in a job folder; the driver follows rank 0's,
//!   drives an indicatif progress bar and, on request, echoes the lines to stdout.

use crate::comm::ProcessGroup;
use crate::ddp::{self, DataParallel};
use crate::launch::{is_spawned_child, spawn_with, SpawnOptions};
use crate::model::Model;
use crate::optim::{AdamW, AdamWConfig};
use crate::precision::Precision;
use serde::Serialize;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Duration;

mod config;

pub use config::{ScalingConfig, Strategy};

const ENV_REPORT_DIR: &str = "SHARDLAB_REPORT_DIR";

/// What a worker's loop sees.
pub struct TrainContext<'a> {
    pg: &'a ProcessGroup,
    scaling: &'a ScalingConfig,
    report: Option<std::fs::File>,
}

impl<'a> TrainContext<'a> {
    pub fn rank(&self) -> usize {
        self.pg.rank()
    }
    pub fn world_size(&self) -> usize {
        self.pg.world_size()
    }
    /// The worker's process group.
    pub fn group(&self) -> &'a ProcessGroup {
        self.pg
    }
    pub fn scaling(&self) -> &ScalingConfig {
        self.scaling
    }
    /// Wrap `model` for the configured strategy (every strategy broadcasts rank 0's weights to
    /// all ranks first; ZeRO/FSDP then shard them).
    /// This worker's device: `cuda:LOCAL_RANK` when the scaling config asks for CUDA.
    pub fn device(&self) -> anyhow::Result<tch::Device> {
        let choice = if self.scaling.use_gpu { crate::device::DeviceChoice::Cuda } else { self.scaling.device };
        crate::device::resolve(choice, self.pg.local_rank())
    }
    pub fn prepare_model(&self, mut model: Box<dyn Model + 'a>) -> anyhow::Result<Box<dyn DataParallel + 'a>> {
        model.set_precision(self.scaling.precision)?;
        // Built on the CPU (the same initial weights everywhere), then moved to this rank's device
        // before the wrapper builds its buffers next to the parameters.
        model.set_device(self.device()?)?;
        let (reduce, precision) = (self.scaling.reduce_dtype, self.scaling.precision);
        anyhow::ensure!(
            reduce == Precision::Fp32 || self.scaling.strategy.zero_stage().is_some(),
            "reduce_dtype {reduce:?} is a ZeRO/FSDP option; {:?} reduces the fp32 gradients it holds",
            self.scaling.strategy
        );
        anyhow::ensure!(
            reduce != Precision::Fp16 || precision == Precision::Fp16,
            "reduce_dtype fp16 needs fp16 compute, whose loss scaler keeps the gradients inside fp16's range; \
             with {precision:?} compute reduce in fp32 or bf16"
        );
        anyhow::ensure!(
            !self.scaling.offload || self.scaling.strategy.zero_stage().is_some(),
            "CPU offload moves ZeRO/FSDP's master shards and optimizer to the host; {:?} has none (use zero1-3 or fsdp)",
            self.scaling.strategy
        );
        let mut dp: Box<dyn DataParallel + 'a> = match (self.scaling.strategy, self.scaling.strategy.zero_stage()) {
            (Strategy::Single, _) => Box::new(ddp::Single::new(self.pg, model)?),
            (Strategy::Ddp, _) => ddp::wrap(self.pg, model, self.scaling.variant, self.scaling.bucket_cap_bytes)?,
            (_, Some(stage)) => Box::new(
                crate::zero::Zero::with_blocks_per_unit(self.pg, model, stage, self.scaling.blocks_per_unit)?
                    .reshard_after_forward(self.scaling.reshard_after_forward)
                    .reduce_dtype(self.scaling.reduce_dtype)
                    .offload(self.scaling.offload),
            ),
            (s, None) => anyhow::bail!("strategy {s:?} has no wrapper"),
        };
        dp.set_checkpointing(self.scaling.activation_checkpointing);
        Ok(dp)
    }
    /// Wrap `model` for the configured strategy and build its AdamW (like `deepspeed.initialize`).
    /// The optimizer is the caller's: pass it to [`train_step`](crate::ddp::train_step) or
    /// [`DataParallel::step`]; it sees whole parameters (replicated strategies) or this rank's
    /// shards (ZeRO/FSDP).
    pub fn prepare(
        &self,
        model: Box<dyn Model + 'a>,
        optim: &AdamWConfig,
    ) -> anyhow::Result<(Box<dyn DataParallel + 'a>, AdamW)> {
        Ok((self.prepare_model(model)?, AdamW::new(*optim)))
    }
    /// The loss scaler the configured precision needs: fp16's dynamic scaling (PyTorch's
    /// `GradScaler` rules), none for fp32 and bf16. Pass it to
    /// [`train_step_scaled`](crate::ddp::train_step_scaled); a step of an fp16 model without one
    /// is refused.
    pub fn scaler(&self) -> Option<crate::precision::GradScaler> {
        (self.scaling.precision == Precision::Fp16).then(crate::precision::GradScaler::default)
    }
    /// Send a metrics object (anything serialisable to a JSON object) to the driver.
    pub fn report(&mut self, metrics: impl Serialize) -> anyhow::Result<()> {
        if let Some(f) = self.report.as_mut() {
            let line = serde_json::to_string(&metrics)?;
            writeln!(f, "{line}")?;
            f.flush()?;
        }
        Ok(())
    }
}

/// What [`Trainer::fit`] returns.
#[derive(Debug)]
pub struct FitResult<R> {
    /// Each worker's return value, in rank order.
    pub results: Vec<R>,
    /// Every metrics object rank 0 reported, in order.
    pub reports: Vec<serde_json::Value>,
}

/// Runs a training loop on every worker.
pub struct Trainer {
    scaling: ScalingConfig,
    total_steps: Option<u64>,
    json: bool,
}

impl Trainer {
    pub fn new(scaling: ScalingConfig) -> Self {
        Trainer { scaling, total_steps: None, json: false }
    }
    /// Show a progress bar over `steps` reports (each report with a `"step"` field advances it).
    pub fn progress(mut self, steps: u64) -> Self {
        self.total_steps = Some(steps);
        self
    }
    /// Echo rank 0's reports to stdout as JSON lines (and no progress bar).
    pub fn json_lines(mut self, on: bool) -> Self {
        self.json = on;
        self
    }

    /// Start the workers, run `f` on each, wait for all. A worker's error fails the fit (every
    /// rank's failure is listed).
    pub fn fit<R, F>(&self, f: F) -> anyhow::Result<FitResult<R>>
    where
        R: Serialize + serde::de::DeserializeOwned + Send,
        F: Fn(&mut TrainContext) -> anyhow::Result<R> + Send + Sync,
    {
        self.check()?;
        let s = &self.scaling;
        let mut opts = SpawnOptions::new(s.num_workers, s.backend).config(s.comm.clone());
        if let Some(l) = s.launch {
            opts = opts.launch(l);
        }
        opts.threads_per_rank = s.threads_per_worker;
        opts.child_args = s.child_args.clone();
        let dir = match std::env::var(ENV_REPORT_DIR) {
            Ok(d) if is_spawned_child() => PathBuf::from(d),
            _ => {
                let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos();
                let d = std::env::temp_dir().join(format!("shardlab-fit-{}-{nanos}", std::process::id()));
                std::fs::create_dir_all(&d)?;
                d
            }
        };
        opts.env.push((ENV_REPORT_DIR.into(), dir.to_string_lossy().into_owned()));
        let work = |pg: &ProcessGroup| {
            let report = std::fs::File::create(dir.join(format!("rank{}.jsonl", pg.rank())))?;
            let mut ctx = TrainContext { pg, scaling: s, report: Some(report) };
            f(&mut ctx)
        };
        if is_spawned_child() {
            // A worker process: runs its rank and exits inside spawn_with.
            let results = spawn_with(opts, work)?;
            return Ok(FitResult { results, reports: vec![] });
        }
        let rank0 = dir.join("rank0.jsonl");
        let out = std::thread::scope(|sc| {
            let h = sc.spawn(|| spawn_with(opts, work));
            let mut follower = Follower::new(rank0, self.total_steps, self.json);
            while !h.is_finished() {
                follower.poll();
                std::thread::sleep(Duration::from_millis(50));
            }
            follower.poll();
            follower.finish();
            (h.join().map_err(|_| anyhow::anyhow!("the launcher thread panicked")), follower.reports)
        });
        let _ = std::fs::remove_dir_all(&dir);
        let (joined, reports) = out;
        let results = joined??;
        Ok(FitResult { results, reports })
    }
}

/// Follows rank 0's report file: progress bar or JSON lines.
struct Follower {
    path: PathBuf,
    reader: Option<std::io::BufReader<std::fs::File>>,
    partial: String,
    bar: Option<indicatif::ProgressBar>,
    json: bool,
    reports: Vec<serde_json::Value>,
}

impl Follower {
    fn new(path: PathBuf, total: Option<u64>, json: bool) -> Self {
        let bar = match total {
            Some(n) if !json => {
                let b = indicatif::ProgressBar::new(n);
                b.set_style(
                    indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps {elapsed_precise} {msg}")
                        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
                );
                Some(b)
            }
            _ => None,
        };
        Follower { path, reader: None, partial: String::new(), bar, json, reports: Vec::new() }
    }
    fn poll(&mut self) {
        if self.reader.is_none() {
            self.reader = std::fs::File::open(&self.path).ok().map(std::io::BufReader::new);
        }
        let Some(r) = self.reader.as_mut() else { return };
        loop {
            let mut buf = String::new();
            match r.read_line(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    self.partial.push_str(&buf);
                    if !self.partial.ends_with('\n') {
                        continue; // the writer is mid-line; the rest comes with a later poll
                    }
                    let line = std::mem::take(&mut self.partial);
                    if let Ok(v) = serde_json::from_str::<serde_json::Value>(line.trim()) {
                        if self.json {
                            println!("{}", line.trim());
                        }
                        if let (Some(b), Some(step)) = (&self.bar, v.get("eval_step").and_then(|s| s.as_u64())) {
                            let f = |k: &str| v.get(k).and_then(|x| x.as_f64()).unwrap_or(f64::NAN);
                            let msg = format!(
                                "step {step}: train loss {:.4}, val loss {:.4}",
                                f("train_loss"),
                                f("val_loss")
                            );
                            if b.is_hidden() {
                                println!("{msg}"); // not a terminal: no bar to print above
                            } else {
                                b.println(msg);
                            }
                        } else if let Some(b) = &self.bar {
                            if let Some(step) = v.get("step").and_then(|s| s.as_u64()) {
                                b.set_position(step + 1);
                            }
                            let msg: Vec<String> = ["loss", "tokens_per_s"]
                                .iter()
                                .filter_map(|k| v.get(*k).and_then(|x| x.as_f64()).map(|x| format!("{k} {x:.4}")))
                                .collect();
                            b.set_message(msg.join("  "));
                        }
                        self.reports.push(v);
                    }
                }
            }
        }
    }
    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish();
        }
    }
}
