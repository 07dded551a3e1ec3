//! Lesson 08 demo — mixed precision, measured: the loss curves of fp32, bf16 and fp16 training on
//! the same model and data, the bytes each rank holds and sends for every strategy in fp32 and
//! bf16, and (`--compare-pytorch`) tokens/s next to PyTorch's `torch.autocast`.
//!
//!   cargo run --release --bin lesson08                      # parity over 200 steps, memory per strategy
//!   cargo run --release --bin lesson08 -- --steps 400 --json
//!   cargo run --release --bin lesson08 -- --compare-pytorch # + tokens/s vs PyTorch (autocast, GradScaler)
//!
//! Precisions (shardlab's `--precision`, PyTorch's recipe): fp32 everywhere; bf16 = the matrix
//! multiplies (linear layers, attention, logits) in bfloat16 with fp32 master weights, gradients,
//! optimizer state, residual stream, LayerNorm and loss; fp16 = the same in float16 with dynamic
//! loss scaling. ZeRO/FSDP gather the parameters in the compute precision and keep an fp32 master
//! shard; gradients are reduced in fp32 unless `reduce_dtype` says bf16.
//!
//! Every configuration runs in a fresh process of this binary. Memory is measured from the tensors
//! a rank holds after a step (`DataParallel::memory`); bytes sent from the process group's counters.

use clap::Parser;
use serde_json::json;
use shardlab::ddp::Variant;
use shardlab::job::{self, DataSource, GptJob, OneRun, RunSummary};
use shardlab::precision::Precision;
use shardlab::prelude::*;

#[derive(Parser, Debug)]
#[command(about = "Lesson 08: mixed precision — loss parity, memory and bytes per rank, speed")]
struct Args {
    /// Steps of the loss-parity runs (one process each, same data and init).
    #[arg(long, default_value_t = 200)]
    steps: u64,
    #[arg(long, default_value_t = 2)]
    n_layer: i64,
    #[arg(long, default_value_t = 64)]
    n_embd: i64,
    #[arg(long, default_value_t = 4)]
    n_head: i64,
    #[arg(long, default_value_t = 64)]
    block_size: i64,
    /// Sequences per rank per step.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Ranks of the memory table.
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    /// Peak learning rate (warm-up over the first tenth of the steps, cosine decay to a tenth).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Also time PyTorch 2.11 (`benches/torch_gpt.py train --precision …`: torch.autocast("cpu"),
    /// GradScaler for fp16) on the same model, data and threads, single process and DDP.
    #[arg(long)]
    compare_pytorch: bool,
    /// Steps of each timing run (the first 3 are left out of the median).
    #[arg(long, default_value_t = 15)]
    timing_steps: u64,
    /// Timing runs of each implementation and configuration, alternated; the best is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    #[arg(long)]
    json: bool,
}

const PRECISIONS: [Precision; 3] = [Precision::Fp32, Precision::Bf16, Precision::Fp16];

fn main() -> anyhow::Result<()> {
    job::run_one_if_asked();
    let a = Args::parse();
    anyhow::ensure!(a.steps >= 10 && a.timing_steps >= 5, "need --steps ≥ 10 and --timing-steps ≥ 5");
    anyhow::ensure!(a.world_size >= 1, "--world-size must be at least 1");
    let cfg =
        GptConfig { vocab_size: 64, block_size: a.block_size, n_layer: a.n_layer, n_head: a.n_head, n_embd: a.n_embd };
    cfg.validate()?;
    let corpus = job::TempCorpus::new("lesson08", 400_000)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let job = |steps: u64, warmup: u64| GptJob {
        model: cfg,
        batch_size: a.batch_size,
        accum: 1,
        steps,
        warmup,
        optim: AdamWConfig { lr: a.lr, ..AdamWConfig::default() },
        lr_schedule: Some(LrSchedule {
            max_lr: a.lr,
            min_lr: a.lr / 10.0,
            warmup_iters: steps / 10,
            decay_iters: steps,
        }),
        grad_clip: Some(1.0),
        data: DataSource::File(corpus.path.clone()),
        seed: 1,
        init: None,
        save: None,
        checkpoint: Default::default(),
        eval: Default::default(),
    };
    let ours = |strategy: Strategy, n: usize, p: Precision, reduce: Precision, job: GptJob| {
        job::run_isolated(&OneRun {
            job,
            strategy,
            world_size: n,
            backend: if n == 1 { Backend::Local } else { Backend::Tcp },
            variant: Variant::Bucketed,
            bucket_cap_bytes: shardlab::ddp::DEFAULT_BUCKET_CAP_BYTES,
            threads: Some((cores / n).max(1) as i32),
            checkpointing: Checkpointing::None,
            reshard_after_forward: true,
            precision: p,
            reduce_dtype: reduce,
            offload: false,
            device: Default::default(),
            tp: 1,
            pp: Default::default(),
        })
    };

    // ---- 1. loss parity: one process, same init, same batches ----
    let mut curves: Vec<(Precision, RunSummary)> = Vec::new();
    for p in PRECISIONS {
        curves.push((p, ours(Strategy::Single, 1, p, Precision::Fp32, job(a.steps, 1))?));
    }
    let fp32 = curves[0].1.losses.clone();
    let tail = (a.steps as usize / 4).max(1);
    let mut parity = Vec::new();
    for (p, r) in &curves {
        let gaps: Vec<f64> = r.losses.iter().zip(&fp32).map(|(x, y)| x - y).collect();
        let max_gap = gaps.iter().fold(0f64, |m, g| m.max(g.abs()));
        let tail_gap = gaps[gaps.len() - tail..].iter().sum::<f64>() / tail as f64;
        let row = json!({"table": "parity", "precision": p.name(), "final_loss": r.final_loss,
                         "max_abs_gap": max_gap, "mean_gap_last_quarter": tail_gap,
                         "skipped_steps": r.skipped_steps, "losses": r.losses});
        if a.json {
            println!("{row}");
        }
        parity.push((p, r.final_loss, max_gap, tail_gap, r.skipped_steps));
    }

    // ---- 2. bytes per rank: every strategy in fp32 and bf16 ----
    let n = a.world_size;
    let psi = cfg.num_params() as f64;
    let mut mem = Vec::new();
    let mut cases =
        vec![(Strategy::Ddp, Precision::Fp32, Precision::Fp32), (Strategy::Ddp, Precision::Bf16, Precision::Fp32)];
    for st in [Strategy::Zero1, Strategy::Zero2, Strategy::Zero3] {
        cases.push((st, Precision::Fp32, Precision::Fp32));
        cases.push((st, Precision::Bf16, Precision::Fp32));
    }
    cases.push((Strategy::Zero3, Precision::Bf16, Precision::Bf16));
    for (st, p, reduce) in cases {
        let r = ours(st, n, p, reduce, job(4, 1))?;
        let m = r.memory;
        let row = json!({"table": "memory", "strategy": format!("{st:?}").to_lowercase(), "world_size": n,
                         "precision": p.name(), "reduce_dtype": reduce.name(), "params": psi,
                         "params_bytes": m.params, "grads_bytes": m.grads, "optim_bytes": m.optim,
                         "model_state_bytes_per_param": (m.params + m.grads + m.optim) as f64 / psi,
                         "peak_transient_bytes": m.peak_transient, "bytes_sent_per_step": r.bytes_sent_per_step});
        if a.json {
            println!("{row}");
        }
        mem.push((st, p, reduce, m, r.bytes_sent_per_step));
    }

    // ---- 3. speed next to PyTorch ----
    let mut speed = Vec::new();
    if a.compare_pytorch {
        // The speed benchmark of lessons 05–07 (constant learning rate, no clipping), as PyTorch's reference runs it.
        let j = GptJob::benchmark(cfg, corpus.path.clone(), a.timing_steps, 3);
        let j = GptJob { batch_size: a.batch_size, ..j };
        for (strategy, ranks) in [(Strategy::Single, 1usize), (Strategy::Ddp, 2)] {
            for p in PRECISIONS {
                if strategy == Strategy::Ddp && p == Precision::Fp16 {
                    continue;
                }
                let opts = job::PyTorchOptions { threads: (cores / ranks).max(1), precision: p, ..Default::default() };
                let name = if strategy == Strategy::Single { "single" } else { "ddp" };
                // Alternate the two, `reps` times, and keep each one's best run: steps of a few
                // milliseconds on a shared machine vary by tens of percent from run to run.
                let (mut mine_best, mut t) = (0f64, 0f64);
                for _ in 0..a.reps {
                    mine_best = mine_best.max(ours(strategy, ranks, p, Precision::Fp32, j.clone())?.tokens_per_s);
                    let theirs = job::pytorch_train_with(&j, name, ranks, &opts)?;
                    t = t.max(theirs["tokens_per_s"].as_f64().unwrap_or(f64::NAN));
                }
                let row = json!({"table": "speed", "strategy": name, "world_size": ranks, "precision": p.name(),
                                 "shardlab_tokens_per_s": mine_best, "pytorch_tokens_per_s": t,
                                 "ratio": mine_best / t});
                if a.json {
                    println!("{row}");
                }
                speed.push((name, ranks, p, mine_best, t));
            }
        }
    }

    if a.json {
        return Ok(());
    }
    println!(
        "GPT {} blocks, h = {}, a = {}, s = {}, vocab {}, Ψ = {} parameters; {} sequences per rank per step",
        cfg.n_layer,
        cfg.n_embd,
        cfg.n_head,
        cfg.block_size,
        cfg.vocab_size,
        cfg.num_params(),
        a.batch_size
    );
    println!("\nLoss parity over {} steps (one process, same init and batches; gap = loss − fp32's loss):", a.steps);
    println!("{:<6} {:>11} {:>10} {:>22} {:>8}", "", "final loss", "max |gap|", "mean gap, last quarter", "skipped");
    for (p, fin, max_gap, tail_gap, skipped) in &parity {
        println!("{:<6} {:>11.4} {:>10.4} {:>22.4} {:>8}", p.name(), fin, max_gap, tail_gap, skipped);
    }
    let every = (a.steps as usize / 8).max(1);
    print!("{:>6}", "step");
    for (p, _) in &curves {
        print!(" {:>8}", p.name());
    }
    println!();
    for k in (0..a.steps as usize).step_by(every).chain([a.steps as usize - 1]) {
        print!("{k:>6}");
        for (_, r) in &curves {
            print!(" {:>8.4}", r.losses[k]);
        }
        println!();
    }
    println!("\nBytes per rank at N = {n}, measured from the tensors held after a step (per parameter, Ψ = {psi}):");
    println!(
        "{:<7} {:<5} {:<7} {:>7} {:>7} {:>7} {:>7} {:>16} {:>15}",
        "", "prec", "reduce", "params", "grads", "optim", "total", "peak transient", "sent/step MB"
    );
    for (st, p, reduce, m, sent) in &mem {
        let per = |b: u64| b as f64 / psi;
        println!(
            "{:<7} {:<5} {:<7} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>14.2} Ψ {:>15.3}",
            format!("{st:?}").to_lowercase(),
            p.name(),
            reduce.name(),
            per(m.params),
            per(m.grads),
            per(m.optim),
            per(m.params + m.grads + m.optim),
            per(m.peak_transient),
            sent / 1e6
        );
    }
    if !speed.is_empty() {
        println!(
            "\nTokens/s, shardlab vs PyTorch 2.11 (same model, data, threads; median step after 3; best of {} alternated runs):",
            a.reps
        );
        println!("{:<8} {:>2} {:<5} {:>10} {:>10} {:>7}", "", "N", "prec", "shardlab", "PyTorch", "ratio");
        for (name, ranks, p, mine, theirs) in &speed {
            println!(
                "{:<8} {:>2} {:<5} {:>10.0} {:>10.0} {:>6.2}×",
                name,
                ranks,
                p.name(),
                mine,
                theirs,
                mine / theirs
            );
        }
    }
    Ok(())
}
