//! `train` — the course's nanoGPT `train.py`: train the GPT with a parallel strategy and report
//! loss and throughput.
//!
//! ```text
//! cargo run --release --bin train -- --strategy ddp --world-size 2 --steps 30
//! cargo run --release --bin train -- --strategy single --steps 200 --save out.safetensors
//! cargo run --release --bin train -- --eval-only --init out.safetensors --data val.bin
//! ```
//!
//! Data: `--data FILE` (little-endian u16 token ids, nanoGPT's `train.bin` format) or the
//! synthetic arithmetic corpus (`--synthetic-tokens N`, the default). With `--json` every line is
//! one JSON object: one per step, the last a summary (`strategy`, `world_size`, `params`,
//! `tokens_per_s` — all ranks together, median over the steps after warm-up — and `final_loss`).

use anyhow::{bail, Context};
use clap::Parser;
use serde_json::json;
use shardlab::data::{synthetic_corpus, DistributedSampler, Tokens};
use shardlab::ddp::{self, Variant};
use shardlab::prelude::*;
use shardlab::trainer::{ScalingConfig, Strategy, Trainer};
use std::time::Instant;

#[derive(Parser, Debug, Clone)]
#[command(about = "Train the course's GPT (nanoGPT names) single-process or data parallel")]
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
    /// DDP bucket cap in MiB (PyTorch's bucket_cap_mb).
    #[arg(long, default_value_t = 25.0)]
    bucket_mb: f64,
    #[arg(long, default_value_t = 4)]
    n_layer: i64,
    #[arg(long, default_value_t = 4)]
    n_head: i64,
    #[arg(long, default_value_t = 256)]
    n_embd: i64,
    #[arg(long, default_value_t = 128)]
    block_size: i64,
    #[arg(long, default_value_t = 4096)]
    vocab_size: i64,
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
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    #[arg(long, default_value_t = 0.1)]
    weight_decay: f64,
    /// Token file (little-endian u16 ids).
    #[arg(long)]
    data: Option<std::path::PathBuf>,
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
    #[arg(long)]
    json: bool,
}

impl Args {
    fn gpt(&self) -> GptConfig {
        GptConfig {
            vocab_size: self.vocab_size,
            block_size: self.block_size,
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_embd: self.n_embd,
        }
    }
    fn tokens(&self) -> anyhow::Result<Tokens> {
        match &self.data {
            Some(p) => Tokens::read(p),
            None => Ok(synthetic_corpus(self.synthetic_tokens, self.seed)),
        }
    }
    fn model(&self) -> anyhow::Result<Gpt> {
        let m = Gpt::new(self.gpt(), self.seed)?;
        if let Some(p) = &self.init {
            m.load_safetensors(p)?;
        }
        Ok(m)
    }
}

fn eval(args: &Args) -> anyhow::Result<()> {
    if let Some(t) = args.threads {
        tch::set_num_threads(t);
    }
    let data = args.tokens()?;
    let t = args.block_size as usize;
    data.check(args.vocab_size, args.block_size)?;
    let model = args.model()?;
    let offsets = data.eval_offsets(t);
    let mut total = 0.0;
    tch::no_grad(|| {
        for chunk in offsets.chunks(16) {
            let b = data.windows(chunk, t);
            total += model.loss(&b).double_value(&[]) * chunk.len() as f64;
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
    let args = Args::parse();
    if let Some(p) = &args.write_corpus {
        synthetic_corpus(args.synthetic_tokens, args.seed).write(p)?;
        println!("wrote {} synthetic tokens to {}", args.synthetic_tokens, p.display());
        return Ok(());
    }
    args.gpt().validate()?;
    if args.eval_only {
        return eval(&args);
    }
    if args.steps <= args.warmup {
        bail!("--steps ({}) must be larger than --warmup ({})", args.steps, args.warmup);
    }
    if args.strategy == Strategy::Single && args.world_size != 1 {
        bail!("--strategy single runs one process; use --strategy ddp for --world-size {}", args.world_size);
    }
    if args.accum < 1 || args.accum as usize > args.batch_size {
        bail!("--accum must be in 1..={} (the per-rank batch)", args.batch_size);
    }
    // Fail before starting workers on data that does not fit the model.
    if !shardlab::launch::is_spawned_child() {
        args.tokens()?.check(args.vocab_size, args.block_size).context("the training data")?;
    }
    let scaling = ScalingConfig {
        num_workers: args.world_size,
        backend: if args.strategy == Strategy::Single { Backend::Local } else { args.backend },
        strategy: args.strategy,
        variant: args.variant,
        bucket_cap_bytes: (args.bucket_mb * 1024.0 * 1024.0) as usize,
        threads_per_worker: args.threads,
        ..ScalingConfig::default()
    };
    let params = args.gpt().num_params();
    let tokens_per_step = (args.batch_size * args.world_size) as f64 * args.block_size as f64;
    let a = args.clone();
    let fit = Trainer::new(scaling).progress(args.steps).json_lines(args.json).fit(move |ctx| {
        let data = a.tokens()?;
        let model = a.model()?;
        let opt_cfg = AdamWConfig { lr: a.lr, weight_decay: a.weight_decay, ..AdamWConfig::default() };
        let mut opt = opt_cfg.build(&model)?;
        let mut dp = ctx.prepare_model(Box::new(model))?;
        let (rank, n) = (ctx.rank(), ctx.world_size());
        let sampler = DistributedSampler::new(a.block_size as usize, a.batch_size * n, rank, n, a.seed)?;
        let mut step_s = Vec::new();
        let mut last = f64::NAN;
        for step in 0..a.steps {
            let batch = sampler.batch(&data, step);
            ctx.group().barrier()?;
            let t0 = Instant::now();
            let local = ddp::train_step(&mut *dp, &mut opt, &batch, a.accum)?;
            let dt = t0.elapsed().as_secs_f64();
            // The global batch's loss: the mean of the ranks' (equal-sized) local means.
            let mut l = Tensor::from_slice(&[local]);
            ctx.group().all_reduce(&mut l, ReduceOp::Avg)?;
            last = l.double_value(&[0]);
            if step >= a.warmup {
                step_s.push(dt);
            }
            ctx.report(json!({"step": step, "loss": last, "step_s": dt, "tokens_per_s": tokens_per_step / dt}))?;
        }
        let st = dp.stats();
        if rank == 0 {
            if let Some(p) = &a.save {
                shardlab::model::save_safetensors(dp.model(), p)?;
            }
        }
        let mut v = step_s.clone();
        let median = shardlab::bench::median(&mut v);
        Ok(json!({"median_step_s": median, "final_loss": last, "ddp": st}))
    })?;
    let r0 = &fit.results[0];
    let median = r0["median_step_s"].as_f64().unwrap_or(f64::NAN);
    let st: DdpStats = serde_json::from_value(r0["ddp"].clone()).unwrap_or_default();
    let summary = json!({
        "summary": true,
        "strategy": format!("{:?}", args.strategy).to_lowercase(),
        "variant": if args.strategy == Strategy::Ddp { Some(format!("{:?}", args.variant).to_lowercase()) } else { None },
        "world_size": args.world_size,
        "backend": format!("{:?}", args.backend).to_lowercase(),
        "params": params,
        "tokens_per_step": tokens_per_step,
        "median_step_s": median,
        "tokens_per_s": tokens_per_step / median,
        "final_loss": r0["final_loss"],
        "comm_s": st.comm_s,
        "exposed_comm_s": st.exposed_s,
        "hidden_comm_fraction": st.hidden_fraction(),
    });
    if args.json {
        println!("{summary}");
    } else {
        println!(
            "{} × {} ({}): {} params, final loss {:.4}, {:.0} tokens/s (median step {:.1} ms), comm {:.2} s of which {:.0}% hidden",
            args.strategy.to_string_lossy(),
            args.world_size,
            summary["variant"].as_str().unwrap_or("-"),
            params,
            r0["final_loss"].as_f64().unwrap_or(f64::NAN),
            tokens_per_step / median,
            median * 1e3,
            st.comm_s,
            100.0 * st.hidden_fraction()
        );
        if let Some(p) = &args.save {
            println!("saved {}", p.display());
        }
    }
    Ok(())
}

trait Lossy {
    fn to_string_lossy(&self) -> String;
}
impl Lossy for Strategy {
    fn to_string_lossy(&self) -> String {
        format!("{self:?}").to_lowercase()
    }
}
