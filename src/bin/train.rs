//! `train` — the course's nanoGPT `train.py`: train the GPT with a parallel strategy and report
//! loss and throughput.
//!
//! ```text
//! cargo run --release --bin train -- --strategy ddp --world-size 2 --steps 30
//! cargo run --release --bin train -- --strategy single --steps 200 --save out.safetensors
//! cargo run --release --bin train -- --strategy ddp --world-size 4 --tp 2 --steps 30   # dp 2 × tp 2 (lesson 12)
//! cargo run --release --bin train -- --tp 2 --pp 2 --strategy zero3 --world-size 8    # dp 2 × tp 2 × pp 2 (lesson 13)
//! cargo run --release --bin launch -- --nproc-per-node 2 -- train --strategy ddp --steps 30   # ranks started by `launch`
//! cargo run --release --bin train -- --data data/shakespeare_char --eval-interval 100 --checkpoint-dir ck  # lesson 14
//! cargo run --release --bin train -- --eval-only --init out.safetensors --data val.bin
//! ```
//!
//! Data: `--data DIR` (nanoGPT's layout: `train.bin`, `val.bin` and `meta.json`, whose
//! `vocab_size` the model takes; `cargo run --release --bin data -- shakespeare` writes one),
//! `--data FILE` (little-endian u16 token ids, nanoGPT's `train.bin` format, no val split) or the
//! synthetic arithmetic corpus (`--synthetic-tokens N`, the default). `--eval-interval N` evaluates
//! both splits every N steps and after the last (`--eval-iters` batches each, nanoGPT's
//! `estimate_loss`): `train_loss` and `val_loss` lines, and with `--checkpoint-dir` the best val
//! loss's checkpoint in its `best/` folder. Learning rate and clipping
//! as nanoGPT's: `--lr` (peak), `--warmup-iters`, `--lr-decay-iters`, `--min-lr`, `--grad-clip`
//! (1.0; 0 = off). With `--json` every line is one JSON object: one per step (`loss`, `lr`,
//! `grad_norm` — the global norm before clipping — and timings), the last a summary (`strategy`, `world_size`, `params`,
//! `tokens_per_s` — all ranks together, median over the steps after warm-up — and `final_loss`).

use anyhow::bail;
use clap::Parser;
use serde_json::json;
use shardlab::data::synthetic_corpus;
use shardlab::ddp::Variant;
use shardlab::job::{self, DataSource, GptJob};
use shardlab::prelude::*;

#[derive(Parser, Debug, Clone)]
#[command(about = "Train the course's GPT (nanoGPT names) single-process, data, tensor or pipeline parallel")]
struct Args {
    #[arg(long, value_enum, default_value = "single")]
    strategy: Strategy,
    #[arg(long, default_value_t = 1)]
    world_size: usize,
    #[arg(long, value_enum, default_value = "tcp")]
    backend: Backend,
    /// DDP implementation.
    #[arg(long, value_enum, default_value = "bucketed")]
    variant: Variant,
    /// Tensor parallelism (lesson 12): groups of this many ranks split every matrix of the GPT
    /// (Megatron-LM); the world is (world-size / tp) data-parallel replicas of tp ranks each
    /// (with --pp, world-size / (tp × pp) replicas of tp × pp ranks: each pipeline rank's stages
    /// split over tp ranks). --strategy ddp or zero1/2/3 runs on the data dimension; 1: none.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// With --tp: sequence parallelism (Korthikanti et al. 2022): LayerNorms and residuals on
    /// T/tp tokens per rank, all-gather and reduce-scatter in place of the activations' all-reduces.
    #[arg(long)]
    sequence_parallel: bool,
    /// Pipeline parallelism (lesson 13): the GPT's stages (embeddings, blocks, head) cut over this
    /// many ranks, each building only its own; the world is (world-size / pp) data-parallel
    /// replicas of pp ranks each (with --tp, see --tp). --strategy ddp or zero1/2/3 runs on the
    /// data dimension; 1: none.
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// With --pp: micro-batches per replica's batch (--batch-size × --pp rows, × --tp with --tp;
    /// default 4); more shrink the bubble, (pp − 1)/(micro-batches + pp − 1).
    #[arg(long)]
    micro_batches: Option<usize>,
    /// With --pp: the schedule, gpipe or 1f1b (default).
    #[arg(long, value_enum)]
    schedule: Option<shardlab::pipeline::Schedule>,
    /// DDP bucket cap in MiB (PyTorch's bucket_cap_mb).
    #[arg(long, default_value_t = 25.0)]
    bucket_mb: f64,
    /// ZeRO/FSDP: transformer blocks per unit (FSDP's wrapping policy): larger units, fewer and
    /// larger all-gathers and reduce-scatters, more memory in flight.
    #[arg(long, default_value_t = 1)]
    unit_blocks: usize,
    /// Activation checkpointing: none, full (recompute every block in backward) or every:K (one
    /// block in K). Gradients are identical; memory falls, one more forward per recomputed block.
    #[arg(long, default_value = "none")]
    activation_checkpointing: Checkpointing,
    /// Save a distributed checkpoint (every rank its own shards) into this folder: every
    /// --save-every steps and after the last step.
    #[arg(long)]
    checkpoint_dir: Option<std::path::PathBuf>,
    /// Steps between checkpoints (0: only after the last step).
    #[arg(long, default_value_t = 0)]
    save_every: u64,
    /// Keep only the newest K checkpoints.
    #[arg(long)]
    keep_last: Option<usize>,
    /// Continue from a checkpoint: a step-N folder, or a checkpoint folder (its latest). Any
    /// strategy, layout (--tp, --pp) and world size can resume any checkpoint of the same model.
    #[arg(long)]
    resume: Option<std::path::PathBuf>,
    /// Elastic: when a rank dies or fails, restart every rank from the latest checkpoint, up to
    /// this many times (torchrun's --max-restarts; needs --checkpoint-dir and --save-every).
    #[arg(long, default_value_t = 0)]
    max_restarts: u32,
    /// Elastic: after a failure, go on with fewer ranks (as if the failed rank's machine were
    /// gone): the most the global batch splits over, the same global batch, down to
    /// --min-world-size ranks.
    #[arg(long)]
    shrink_on_failure: bool,
    /// Elastic with --shrink-on-failure: never fewer ranks than this.
    #[arg(long, default_value_t = 1)]
    min_world_size: usize,
    /// ZeRO-3/FSDP: keep each gathered unit from its forward to its backward (one all-gather per
    /// unit per step instead of two, no recompute; the full parameters stay alive meanwhile).
    #[arg(long)]
    no_reshard_after_forward: bool,
    /// Compute precision: fp32, bf16 (matrix multiplies in bfloat16, fp32 master weights, residual
    /// stream and loss) or fp16 (the same in float16, with dynamic loss scaling). Under ZeRO/FSDP
    /// every parameter (LayerNorm gains, biases, embeddings too) is gathered in it, as FSDP2's
    /// param_dtype does.
    #[arg(long, value_enum, default_value = "fp32")]
    precision: Precision,
    /// ZeRO/FSDP: the precision gradients are reduced in (fp32, or bf16/fp16: half the bytes).
    #[arg(long, value_enum, default_value = "fp32")]
    reduce_dtype: Precision,
    /// ZeRO/FSDP: CPU offload (ZeRO-Offload) — f32 master shards and AdamW state in host memory,
    /// the step on the CPU, gradient shards copied down and parameters copied up (lesson 11).
    #[arg(long)]
    offload: bool,
    #[arg(long, default_value_t = 4)]
    n_layer: i64,
    #[arg(long, default_value_t = 4)]
    n_head: i64,
    #[arg(long, default_value_t = 256)]
    n_embd: i64,
    #[arg(long, default_value_t = 128)]
    block_size: i64,
    /// The model's vocabulary (default: the data's meta.json vocab_size, else 4096).
    #[arg(long)]
    vocab_size: Option<i64>,
    /// Sequences per rank per step (nanoGPT's batch_size).
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Gradient accumulation: micro-batches per step (the batch is cut into this many).
    #[arg(long, default_value_t = 1)]
    accum: i64,
    #[arg(long, default_value_t = 50)]
    steps: u64,
    /// Steps left out of the throughput median.
    #[arg(long, default_value_t = 5)]
    warmup: u64,
    /// Peak learning rate (nanoGPT's learning_rate).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Learning-rate warm-up: linear from lr/(warmup_iters+1) to lr over this many steps (nanoGPT's warmup_iters).
    #[arg(long, default_value_t = 0)]
    warmup_iters: u64,
    /// Cosine decay from lr to --min-lr ends at this step (nanoGPT's lr_decay_iters; default: --steps).
    #[arg(long)]
    lr_decay_iters: Option<u64>,
    /// The rate the cosine decays to (nanoGPT's min_lr; default: --lr, i.e. no decay).
    #[arg(long)]
    min_lr: Option<f64>,
    /// Clip the global gradient norm to this before each step; 0 turns clipping off (nanoGPT's grad_clip).
    #[arg(long, default_value_t = 1.0)]
    grad_clip: f64,
    #[arg(long, default_value_t = 0.1)]
    weight_decay: f64,
    /// The data: a folder in nanoGPT's layout (train.bin, val.bin, meta.json: `cargo run
    /// --release --bin data -- shakespeare` writes data/shakespeare_char), or a token file
    /// (little-endian u16 ids, no val split).
    #[arg(long)]
    data: Option<std::path::PathBuf>,
    /// Evaluate every N steps (and after the last): the mean loss of --eval-iters batches of each
    /// split, train_loss and val_loss (nanoGPT's eval_interval); with --checkpoint-dir, the best
    /// val loss's checkpoint is kept in CHECKPOINT_DIR/best. 0: never.
    #[arg(long, default_value_t = 0)]
    eval_interval: u64,
    /// Batches per split per evaluation (nanoGPT's eval_iters).
    #[arg(long, default_value_t = 20)]
    eval_iters: usize,
    /// Size of the synthetic corpus when no --data is given.
    #[arg(long, default_value_t = 1_000_000)]
    synthetic_tokens: usize,
    /// Write the synthetic corpus to this file and exit.
    #[arg(long)]
    write_corpus: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Start from these weights (safetensors, nanoGPT names).
    #[arg(long)]
    init: Option<std::path::PathBuf>,
    /// Save the final weights here (safetensors, nanoGPT names).
    #[arg(long)]
    save: Option<std::path::PathBuf>,
    /// Only evaluate: mean cross-entropy over the data's consecutive non-overlapping windows.
    #[arg(long)]
    eval_only: bool,
    /// libtorch intra-op threads per rank (default 1 when ranks share the machine).
    #[arg(long)]
    threads: Option<i32>,
    /// One JSON object per line.
    /// Where each rank computes: cuda puts rank r on cuda:LOCAL_RANK (an error without a GPU);
    /// auto: a GPU if libtorch sees one.
    #[arg(long, value_enum, default_value = "cpu")]
    device: shardlab::device::DeviceChoice,
    /// Peak dense TFLOP/s of one device in the run's precision: the summary then reports MFU
    /// (data-sheet figures for GPUs: `shardlab::flops::peak_tflops`).
    #[arg(long)]
    peak_tflops: Option<f64>,
    #[arg(long)]
    json: bool,
}

impl Args {
    fn data(&self) -> DataSource {
        match &self.data {
            Some(p) => DataSource::from_path(p.clone()),
            None => DataSource::Synthetic { tokens: self.synthetic_tokens, seed: self.seed },
        }
    }
    /// --vocab-size, else the data's, else 4096.
    fn vocab_size(&self) -> anyhow::Result<i64> {
        let from_data = self.data().vocab_size()?.map(|v| v as i64);
        Ok(self.vocab_size.or(from_data).unwrap_or(4096))
    }
    fn job(&self) -> GptJob {
        GptJob {
            model: GptConfig {
                // (A meta.json that cannot be read: 0 here, and the check's own error names the file.)
                vocab_size: self.vocab_size().unwrap_or(0),
                block_size: self.block_size,
                n_layer: self.n_layer,
                n_head: self.n_head,
                n_embd: self.n_embd,
            },
            batch_size: self.batch_size,
            accum: self.accum,
            steps: self.steps,
            warmup: self.warmup,
            optim: AdamWConfig { lr: self.lr, weight_decay: self.weight_decay, ..AdamWConfig::default() },
            lr_schedule: Some(LrSchedule {
                max_lr: self.lr,
                min_lr: self.min_lr.unwrap_or(self.lr),
                warmup_iters: self.warmup_iters,
                decay_iters: self.lr_decay_iters.unwrap_or(self.steps),
            }),
            grad_clip: (self.grad_clip != 0.0).then_some(self.grad_clip),
            data: self.data(),
            seed: self.seed,
            init: self.init.clone(),
            save: self.save.clone(),
            checkpoint: job::CheckpointConfig {
                dir: self.checkpoint_dir.clone(),
                every: self.save_every,
                at_end: self.checkpoint_dir.is_some(),
                keep_last: self.keep_last,
                resume: self.resume.clone(),
            },
            eval: job::EvalConfig { interval: self.eval_interval, iters: self.eval_iters },
        }
    }
}

/// Mean cross-entropy over every complete consecutive window of the data (no sampling).
fn eval(args: &Args) -> anyhow::Result<()> {
    if let Some(t) = args.threads {
        tch::set_num_threads(t);
    }
    let job = args.job();
    // A folder's held-out split; a token file is evaluated whole.
    let data = match job.data.load_val()? {
        Some(val) if matches!(job.data, DataSource::Dir(_)) => val,
        _ => job.data.load()?,
    };
    let t = job.model.block_size as usize;
    data.check(job.model.vocab_size, job.model.block_size)?;
    let model = job.build_model()?;
    let offsets = data.eval_offsets(t);
    let mut total = 0.0;
    tch::no_grad(|| {
        for chunk in offsets.chunks(16) {
            total += model.loss(&data.windows(chunk, t)).double_value(&[]) * chunk.len() as f64;
        }
    });
    let loss = total / offsets.len() as f64;
    if args.json {
        println!("{}", json!({"eval_loss": loss, "windows": offsets.len(), "tokens": offsets.len() * t}));
    } else {
        println!("eval_loss {loss:.6} over {} windows of {t} tokens", offsets.len());
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    if shardlab::launch::external_launch() {
        // One rank of a job started by `launch`, torchrun or srun: the launcher sets the world size.
        let w = shardlab::comm::TcpInit::from_env()?.world_size;
        if args.world_size != 1 && args.world_size != w {
            bail!("--world-size {} but the launcher started WORLD_SIZE={w} ranks", args.world_size);
        }
        args.world_size = w;
    }
    if let Some(p) = &args.write_corpus {
        synthetic_corpus(args.synthetic_tokens, args.seed).write(p)?;
        println!("wrote {} synthetic tokens to {}", args.synthetic_tokens, p.display());
        return Ok(());
    }
    args.vocab_size()?; // an unreadable meta.json: its own error
    args.job().model.validate()?;
    if args.eval_only {
        return eval(&args);
    }
    if args.strategy == Strategy::Single && args.world_size != 1 {
        bail!("--strategy single runs one process; use --strategy ddp for --world-size {}", args.world_size);
    }
    anyhow::ensure!(
        !args.sequence_parallel || args.tp > 1,
        "--sequence-parallel splits over the --tp group: give --tp"
    );
    anyhow::ensure!(
        args.pp != 1 || (args.micro_batches.is_none() && args.schedule.is_none()),
        "--micro-batches and --schedule shape a pipeline: give --pp too"
    );
    anyhow::ensure!(
        (args.tp == 1 && args.pp == 1) || !args.shrink_on_failure,
        "--shrink-on-failure with --tp or --pp is not built yet (the shrunk world must still divide into tp × pp \
         ranks); --max-restarts restarts at the same size"
    );
    let mut scaling = job::scaling(
        args.strategy,
        args.world_size,
        args.backend,
        args.variant,
        (args.bucket_mb * 1024.0 * 1024.0) as usize,
    );
    scaling.threads_per_worker = args.threads;
    anyhow::ensure!(args.unit_blocks >= 1, "--unit-blocks must be at least 1");
    scaling.blocks_per_unit = args.unit_blocks;
    scaling.reshard_after_forward = !args.no_reshard_after_forward;
    scaling.activation_checkpointing = args.activation_checkpointing;
    scaling.precision = args.precision;
    scaling.reduce_dtype = args.reduce_dtype;
    scaling.offload = args.offload;
    scaling.device = args.device;
    scaling.tensor_parallel = args.tp;
    scaling.sequence_parallel = args.sequence_parallel;
    let d = shardlab::pipeline::PipelineConfig::default();
    scaling.pipeline = shardlab::pipeline::PipelineConfig {
        stages: args.pp,
        micro_batches: args.micro_batches.unwrap_or(d.micro_batches),
        schedule: args.schedule.unwrap_or(d.schedule),
    };
    let s = if args.max_restarts > 0 || args.shrink_on_failure {
        let elastic = job::Elastic {
            max_restarts: args.max_restarts,
            min_world_size: args.min_world_size,
            shrink_on_failure: args.shrink_on_failure,
        };
        let (s, attempts) = args.job().fit_elastic(scaling, &elastic, !args.json, args.json)?;
        for a in attempts.iter().filter(|a| a.error.is_some()) {
            eprintln!(
                "generation {} ({} ranks) failed: {}",
                a.generation,
                a.world_size,
                a.error.as_deref().unwrap_or_default().lines().next().unwrap_or_default()
            );
        }
        if attempts.len() > 1 {
            let last = attempts.last().expect("one attempt at least");
            eprintln!(
                "restarted {} time(s); generation {} ran on {} ranks from {}",
                attempts.len() - 1,
                last.generation,
                last.world_size,
                last.resume.as_deref().map_or("the start".into(), |p| p.display().to_string())
            );
        }
        s
    } else {
        args.job().fit(scaling, !args.json, args.json)?
    };
    if shardlab::launch::external_rank().is_some_and(|r| r != 0) {
        return Ok(()); // under a launcher every rank returns here; rank 0 reports
    }
    // Model FLOPs utilisation, when the device's peak is known (lesson 11).
    let flops_per_token = shardlab::flops::flops_per_token(&args.job().model);
    // The peak: --peak-tflops, or the table's figure for the GPU the run used.
    let peak = args
        .peak_tflops
        .or_else(|| s.cuda.as_ref().and_then(|c| shardlab::flops::peak_tflops(&c.name, args.precision)));
    // MFU is per device: ranks sharing a GPU (the tcp backend allows it) share its peak. Ranks per
    // machine (LOCAL_WORLD_SIZE under a launcher, all of them otherwise) over the GPUs it has.
    let devices = if s.cuda.is_some() {
        let local = std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.parse().ok()).unwrap_or(s.world_size).max(1);
        s.world_size.div_ceil(local) * local.min(shardlab::device::cuda_devices().max(1))
    } else {
        s.world_size
    };
    let mfu = peak.map(|p| shardlab::flops::mfu(s.tokens_per_s, flops_per_token, devices, p));
    if args.json {
        let mut v = serde_json::to_value(&s)?;
        v["summary"] = json!(true);
        v["flops_per_token"] = json!(flops_per_token);
        v["mfu"] = json!(mfu);
        v["peak_tflops"] = json!(peak);
        v["mfu_devices"] = json!(devices);
        v.as_object_mut().map(|o| o.remove("losses"));
        println!("{v}");
    } else {
        println!(
            "{} × {}{} {}: {} params, final loss {:.4}, {:.0} tokens/s (median step {:.1} ms); {}",
            s.strategy,
            s.world_size,
            s.variant.as_deref().map(|v| format!(" ({v})")).unwrap_or_default(),
            s.precision.name(),
            s.params,
            s.final_loss,
            s.tokens_per_s,
            s.median_step_s * 1e3,
            if let Some(p) = &s.pipeline {
                // Sends and receives sit between every stage: the idle time is what is measured.
                format!(
                    "{:.2} MB sent per step by rank 0, bubble {:.0}%, at most {} micro-batches held",
                    s.bytes_sent_per_step / 1e6,
                    100.0 * p.bubble,
                    p.peak_in_flight
                )
            } else if args.tp > 1 {
                // TP's all-reduces sit inside every layer: no overlap is measured, the bytes are.
                format!("{:.2} MB sent per step by rank 0", s.bytes_sent_per_step / 1e6)
            } else {
                format!("communication {:.2} s, {:.0}% hidden", s.comm_s, 100.0 * s.hidden_comm_fraction)
            }
        );
        if let Some(c) = &s.cuda {
            println!(
                "{}: {:.2} GiB in use on the device after the last step (of {:.0} GiB; cudaMemGetInfo, all processes)",
                c.name,
                c.used_bytes as f64 / (1u64 << 30) as f64,
                c.total_bytes as f64 / (1u64 << 30) as f64
            );
        }
        if s.memory.offloaded > 0 {
            println!(
                "offload: model states {:.3} MB on the device, {:.3} MB in host memory; {:.3} MB down, {:.3} MB up per step",
                s.memory.model_states() as f64 / 1e6,
                s.memory.offloaded as f64 / 1e6,
                s.ddp.d2h_bytes as f64 / 1e6 / s.losses.len().max(1) as f64,
                s.ddp.h2d_bytes as f64 / 1e6 / s.losses.len().max(1) as f64
            );
            if s.cuda.is_none() {
                println!("(on the CPU, \"device\" and host memory are the same RAM: the split is bookkeeping, the copies are memcpy)");
            }
        }
        if let (Some(m), Some(p)) = (mfu, peak) {
            println!(
                "MFU {:.2}% ({:.3e} model FLOPs per token × {:.0} tokens/s over {devices} device(s) × {p} TFLOP/s)",
                100.0 * m,
                flops_per_token,
                s.tokens_per_s,
            );
        }
        if s.measured_steps < 5 {
            println!(
                "(throughput from {} timed step(s) after warm-up: rough; run more --steps than --warmup {} for a median)",
                s.measured_steps, args.warmup
            );
        }
        if s.skipped_steps > 0 {
            println!("fp16: {} step(s) skipped by the loss scaler (gradient overflow)", s.skipped_steps);
        }
        if let Some(last) = s.evals.last() {
            let best = s.evals.iter().map(|e| e.val_loss).fold(f64::INFINITY, f64::min);
            println!(
                "after {} steps: train loss {:.4}, val loss {:.4} (best this run {best:.4}; {} batches of {} rows per split)",
                last.step,
                last.train_loss,
                last.val_loss,
                args.eval_iters,
                args.batch_size * s.world_size
            );
        }
        if let Some(p) = &args.save {
            println!("saved {}", p.display());
        }
    }
    Ok(())
}
