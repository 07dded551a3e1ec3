//! Lesson 14 demo — the capstone: a character-level GPT on Shakespeare with everything the course
//! built, a killed rank survived, and the model writing.
//!
//! ```text
//! cargo run --release --bin data -- shakespeare        # once: data/shakespeare_char (5.1 M characters)
//! cargo run --release --bin lesson14 -- corpus         # size, vocabulary, val plays, the unigram baseline
//! cargo run --release --bin lesson14 -- train          # the recommended run (~11 min), samples as it learns
//! cargo run --release --bin lesson14 -- layouts        # one seed under single, DDP × 2, ZeRO-3 × 2, tp 2, pp 2
//! cargo run --release --bin lesson14 -- killed         # a rank SIGKILLed mid-run, --max-restarts 1
//! cargo run --release --bin lesson14 -- decode         # decode tokens/s with and without the KV cache
//! cargo run --release --bin lesson14 -- fit            # which layout of 4 ranks fits a memory budget
//! ```
//!
//! `--quick` runs each on practice text made here (`corpus::practice_documents`) with a tiny GPT,
//! in seconds — what CI and the notebook run; `--json` prints one JSON object per line. Every
//! part calls the library: the job is a [`GptJob`] as `train` builds it, sampling is
//! [`Gpt::generate`], restarts are [`GptJob::fit_elastic`].

use clap::{Parser, Subcommand};
use serde_json::json;
use shardlab::corpus::{build_char_layout, practice_documents, unigram_cross_entropy, Meta};
use shardlab::data::Tokens;
use shardlab::engine::{fit, DataDim};
use shardlab::job::{self, CheckpointConfig, DataSource, Elastic, EvalConfig, GptJob};
use shardlab::model::{Gpt, Sampling};
use shardlab::pipeline::PipelineConfig;
use shardlab::prelude::*;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Lesson 14: a character-level GPT on Shakespeare with every parallelism, a killed rank, samples")]
struct Args {
    #[command(subcommand)]
    part: Part,
    /// Practice text and a tiny GPT (seconds) instead of data/shakespeare_char and the recommended run.
    #[arg(long, global = true)]
    quick: bool,
    /// The corpus folder (nanoGPT's layout).
    #[arg(long, global = true, default_value = "data/shakespeare_char")]
    data: PathBuf,
    /// Where runs keep their checkpoints (a fresh temporary folder if not given).
    #[arg(long, global = true)]
    dir: Option<PathBuf>,
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Subcommand, Debug, Clone, Copy, PartialEq)]
enum Part {
    Corpus,
    Train,
    Layouts,
    Killed,
    Decode,
    Fit,
}

/// The recommended run (lesson 14, "The recommended run"), or the quick one.
fn job(data: &Path, quick: bool, vocab: i64) -> GptJob {
    let (model, steps, batch, every, iters) = if quick {
        (GptConfig { vocab_size: vocab, block_size: 32, n_layer: 2, n_head: 2, n_embd: 64 }, 300, 12, 100, 4)
    } else {
        (GptConfig { vocab_size: vocab, block_size: 64, n_layer: 4, n_head: 4, n_embd: 128 }, 8000, 12, 500, 20)
    };
    GptJob {
        model,
        batch_size: batch,
        accum: 1,
        steps,
        warmup: 5,
        optim: AdamWConfig { lr: 1e-3, ..AdamWConfig::default() },
        lr_schedule: Some(LrSchedule { max_lr: 1e-3, min_lr: 1e-4, warmup_iters: steps / 80, decay_iters: steps }),
        grad_clip: Some(1.0),
        data: DataSource::Dir(data.to_path_buf()),
        seed: 1337,
        init: None,
        save: None,
        checkpoint: Default::default(),
        eval: EvalConfig { interval: every, iters },
    }
}

/// The data folder: data/shakespeare_char (made by `data shakespeare`), or practice text.
fn corpus(a: &Args, root: &Path) -> anyhow::Result<PathBuf> {
    if !a.quick {
        anyhow::ensure!(
            a.data.join("meta.json").is_file(),
            "{} is not there: run `cargo run --release --bin data -- shakespeare` first (or add --quick)",
            a.data.display()
        );
        return Ok(a.data.clone());
    }
    let out = root.join("practice_char");
    if !out.exists() && !is_spawned_child() {
        build_char_layout(
            &practice_documents(10, 80, 7),
            &out,
            "practice text (shardlab::corpus::practice_documents)",
        )?;
    }
    Ok(out)
}

fn emit(a: &Args, v: serde_json::Value, text: String) {
    if a.json {
        println!("{v}");
    } else {
        println!("{text}");
    }
}

fn sample(model: &Gpt, meta: &Meta, prompt: &str, n: usize) -> anyhow::Result<String> {
    let vocab = meta.vocab()?;
    let ids: Vec<i64> = vocab.encode(prompt)?.into_iter().map(i64::from).collect();
    let out = model.generate(&ids, n, Sampling { temperature: 0.8, top_k: Some(200) }, 1337, true);
    vocab.decode(&out.iter().map(|&i| i as u16).collect::<Vec<_>>())
}

fn main() -> anyhow::Result<()> {
    job::run_one_if_asked();
    let a = Args::parse();
    let root = a.dir.clone().unwrap_or_else(|| {
        // Rank processes (the `killed` part) find their driver's folder by its pid.
        let pid = std::env::var("SHARDLAB_LESSON14_PID").unwrap_or_else(|_| std::process::id().to_string());
        std::env::temp_dir().join(format!("shardlab-lesson14-{pid}"))
    });
    if !is_spawned_child() {
        std::env::set_var("SHARDLAB_LESSON14_PID", std::process::id().to_string());
        std::fs::create_dir_all(&root)?;
    }
    let data = corpus(&a, &root)?;
    let meta = Meta::read(&data)?;
    let base = job(&data, a.quick, meta.vocab_size as i64);
    let prompt = if a.quick { "thou " } else { "ROMEO:" };
    match a.part {
        Part::Corpus => {
            let (train, val) = (Tokens::read(data.join("train.bin"))?, Tokens::read(data.join("val.bin"))?);
            let unigram = unigram_cross_entropy(&train.0, &val.0, meta.vocab_size);
            let v = json!({"train_tokens": train.len(), "val_tokens": val.len(), "vocab_size": meta.vocab_size,
                           "val_documents": meta.val_documents, "train_documents": meta.train_documents.len(),
                           "unigram_val_loss": unigram, "uniform_val_loss": (meta.vocab_size as f64).ln(),
                           "itos": meta.itos.concat()});
            emit(&a, v, format!(
                "{}: {} training and {} validation characters (u16 ids), a vocabulary of {}: {:?}\nvalidation (whole plays, never trained on): {}\n\
                 baselines on val: uniform ln {} = {:.3}; character unigram (train's frequencies) {:.3} nats per character",
                data.display(), train.len(), val.len(), meta.vocab_size, meta.itos.concat(),
                meta.val_documents.join(", "), meta.vocab_size, (meta.vocab_size as f64).ln(), unigram
            ));
        }
        Part::Train => {
            // Checkpoints at every evaluation: the samples below come from them.
            let ck = root.join("train");
            let _ = std::fs::remove_dir_all(&ck);
            let mut j = base.clone();
            j.checkpoint =
                CheckpointConfig { dir: Some(ck.clone()), every: j.eval.interval, at_end: true, ..Default::default() };
            let threads = if a.quick { 1 } else { 2 };
            let s = ScalingConfig {
                num_workers: 1,
                strategy: Strategy::Single,
                threads_per_worker: Some(threads),
                ..ScalingConfig::default()
            };
            let t0 = Instant::now();
            let r = j.fit(s, !a.json, false)?;
            let wall = t0.elapsed().as_secs_f64();
            for p in &r.evals {
                emit(
                    &a,
                    json!({"eval": p}),
                    format!(
                        "after {:>5} steps ({:>6.1} s): train loss {:.4}, val loss {:.4}",
                        p.step, p.elapsed_s, p.train_loss, p.val_loss
                    ),
                );
            }
            // Samples: the untrained model, early, the middle, the end.
            let n = if a.quick { 120 } else { 300 };
            let mut points = vec![0, j.eval.interval, j.steps / 2 / j.eval.interval * j.eval.interval, j.steps];
            points.dedup();
            for step in points {
                let model = if step == 0 {
                    Gpt::new(j.model, j.seed)?
                } else {
                    job::restore::load_gpt(&ck.join(shardlab::checkpoint::step_dir_name(step)))?.model
                };
                let text = sample(&model, &meta, prompt, n)?;
                emit(&a, json!({"sample_step": step, "text": text}), format!("\n--- after {step} steps ---\n{text}"));
            }
            let best = job::restore::load_gpt(&ck.join("best"))?;
            emit(
                &a,
                json!({"summary": true, "wall_s": wall, "tokens_per_s": r.tokens_per_s, "params": r.params,
                            "final_val_loss": r.evals.last().map(|p| p.val_loss), "best_step": best.step}),
                format!(
                    "\n{} steps in {wall:.0} s ({:.0} tokens/s, {} parameters); the best val loss's checkpoint: {}\n\
                     write with it: cargo run --release --bin sample -- --from {} --start {prompt:?}{}",
                    j.steps,
                    r.tokens_per_s,
                    r.params,
                    best.path.display(),
                    ck.join("best").display(),
                    if a.quick && a.dir.is_none() {
                        " (a --quick run's folder goes on exit: give --dir to keep it)"
                    } else {
                        ""
                    }
                ),
            );
        }
        Part::Layouts => {
            // One seed, one global batch of 12 rows, five layouts of 1 or 2 ranks.
            let mut j = base.clone();
            // Tensor parallelism splits the vocabulary: padded to a multiple of 8 (as nanoGPT pads
            // GPT-2's 50257 to 50304), for every layout alike; the padding ids never occur.
            j.model.vocab_size = (j.model.vocab_size + 7) / 8 * 8;
            j.steps = if a.quick { 20 } else { 200 };
            j.lr_schedule = Some(LrSchedule { max_lr: 1e-3, min_lr: 1e-4, warmup_iters: 2, decay_iters: j.steps });
            j.eval = EvalConfig { interval: j.steps / 2, iters: 2 };
            let pp2 = PipelineConfig { stages: 2, micro_batches: 4, ..PipelineConfig::default() };
            let two = |strategy| ScalingConfig {
                num_workers: 2,
                strategy,
                threads_per_worker: Some(1),
                ..ScalingConfig::default()
            };
            let layouts = [
                (
                    "single",
                    ScalingConfig {
                        num_workers: 1,
                        strategy: Strategy::Single,
                        threads_per_worker: Some(1),
                        ..ScalingConfig::default()
                    },
                    12,
                ),
                ("ddp × 2", two(Strategy::Ddp), 6),
                ("zero3 × 2", two(Strategy::Zero3), 6),
                ("tp 2", ScalingConfig { tensor_parallel: 2, ..two(Strategy::Ddp) }, 6),
                ("pp 2", ScalingConfig { pipeline: pp2, ..two(Strategy::Ddp) }, 6),
            ];
            let mut single: Vec<f64> = Vec::new();
            for (name, s, rows) in layouts {
                let r = GptJob { batch_size: rows, ..j.clone() }.fit(s, false, false)?;
                if single.is_empty() {
                    single = r.losses.clone();
                }
                let diff = r.losses.iter().zip(&single).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
                emit(&a, json!({"layout": name, "losses": r.losses, "tokens_per_s": r.tokens_per_s, "max_loss_diff": diff,
                                "evals": r.evals, "bytes_sent_per_step": r.bytes_sent_per_step}),
                     format!("{name:<10} final loss {:.4}, val loss {:.4}, {:>6.0} tokens/s, largest loss difference from one process {diff:.1e}",
                             r.final_loss, r.evals.last().map_or(f64::NAN, |p| p.val_loss), r.tokens_per_s));
            }
        }
        Part::Killed => {
            // DDP on 2 processes, a checkpoint every `every` steps; the same run again with rank 1
            // SIGKILLed before step `kill`, restarted once from the latest checkpoint.
            let (steps, every) = if a.quick { (12, 4) } else { (300, 50) };
            let kill = steps / 2 + 1;
            let mut j = GptJob { steps, batch_size: 6, ..base.clone() };
            j.lr_schedule = Some(LrSchedule { max_lr: 1e-3, min_lr: 1e-4, warmup_iters: 2, decay_iters: steps });
            j.eval = EvalConfig::default();
            let s = ScalingConfig {
                num_workers: 2,
                strategy: Strategy::Ddp,
                backend: Backend::Tcp,
                launch: Some(Launch::Processes),
                ..ScalingConfig::default()
            };
            let run = |tag: &str| -> GptJob {
                let d = root.join(tag);
                GptJob {
                    save: Some(d.join("final.safetensors")),
                    checkpoint: CheckpointConfig { dir: Some(d.join("ck")), every, ..Default::default() },
                    ..j.clone()
                }
            };
            if !is_spawned_child() {
                for t in ["straight", "killed"] {
                    let _ = std::fs::remove_dir_all(root.join(t));
                }
                std::env::remove_var("SHARDLAB_FAIL_AT");
            }
            let (straight, _) = run("straight").fit_elastic(s.clone(), &Elastic::default(), false, false)?;
            if !is_spawned_child() {
                std::env::set_var("SHARDLAB_FAIL_AT", format!("step:1:{kill}"));
            }
            let (killed, attempts) =
                run("killed").fit_elastic(s, &Elastic { max_restarts: 1, ..Elastic::default() }, false, false)?;
            std::env::remove_var("SHARDLAB_FAIL_AT");
            let w = |t: &str| -> anyhow::Result<Vec<(String, tch::Tensor)>> {
                let mut v = tch::Tensor::read_safetensors(root.join(t).join("final.safetensors"))?;
                v.sort_by(|x, y| x.0.cmp(&y.0));
                Ok(v)
            };
            let bitwise = w("straight")?.iter().zip(&w("killed")?).all(|((n, x), (m, y))| n == m && x.equal(y));
            let resumed_at = attempts.last().and_then(|x| x.resume.as_ref()).map(|p| p.display().to_string());
            // The restarted generation trained the steps from its checkpoint on.
            let resumed_step = steps as usize - killed.losses.len();
            emit(&a, json!({"straight": straight.losses, "killed": killed.losses, "restarts": attempts.len() - 1,
                            "resumed_from": resumed_at, "resumed_at_step": resumed_step, "killed_before_step": kill, "bitwise_equal": bitwise}),
                 format!("rank 1 SIGKILLed before step {kill}; {} restart(s), resumed at step {resumed_step} from {}; final weights bitwise equal to the uninterrupted run's: {bitwise}",
                         attempts.len() - 1, resumed_at.as_deref().unwrap_or("the start")));
            anyhow::ensure!(bitwise, "the restarted run's weights differ from the uninterrupted run's");
        }
        Part::Decode => {
            // The recommended model's shape (or the quick one) and nanoGPT's shakespeare_char shape,
            // random weights (decode speed does not depend on them), a 1-token prompt.
            tch::set_num_threads(1);
            let mut shapes = vec![(if a.quick { "tiny" } else { "recommended" }, base.model)];
            if !a.quick {
                shapes.push((
                    "nanoGPT shakespeare_char",
                    GptConfig {
                        vocab_size: meta.vocab_size as i64,
                        block_size: 256,
                        n_layer: 6,
                        n_head: 6,
                        n_embd: 384,
                    },
                ));
            }
            for (name, cfg) in shapes {
                let m = Gpt::new(cfg, 1)?;
                let n = cfg.block_size as usize - 1;
                let time = |cached| {
                    let t = Instant::now();
                    let out = m.generate(&[0], n, Sampling { temperature: 0.8, top_k: Some(200) }, 1, cached);
                    (out, n as f64 / t.elapsed().as_secs_f64())
                };
                let ((with, fast), (without, slow)) = (time(true), time(false));
                anyhow::ensure!(with == without, "the cache changed the tokens drawn");
                emit(&a, json!({"shape": name, "config": cfg, "tokens": n, "cached_tokens_per_s": fast, "uncached_tokens_per_s": slow}),
                     format!("{name} ({cfg:?}): {n} tokens, {fast:.0} tokens/s with the KV cache, {slow:.0} without ({:.1}×), the same tokens", fast / slow));
            }
        }
        Part::Fit => fit_part(&a, &base)?,
    }
    // The temporary folder goes, except a training run's checkpoints (to sample from).
    if a.dir.is_none() && !is_spawned_child() && (a.part != Part::Train || a.quick) {
        let _ = std::fs::remove_dir_all(&root);
    }
    Ok(())
}

/// Which layout of 4 ranks fits a budget: every layout's model-state bytes per rank as the planner
/// counts them ([`fit`]) against what rank 0 holds after a step, counted from its tensors; then
/// the planner's choice for budgets from DDP's 16 bytes a parameter down to below ZeRO-3's.
fn fit_part(a: &Args, base: &GptJob) -> anyhow::Result<()> {
    let (world, batch) = (4, 12);
    // Tensor parallelism over 2 and 4 splits the vocabulary: padded to a multiple of 4 (84 is one
    // already; the practice text's is not), the padding ids never occurring.
    let mut base = base.clone();
    base.model.vocab_size = (base.model.vocab_size + 3) / 4 * 4;
    let cfg = base.model;
    let p = cfg.num_params() as f64;
    emit(
        a,
        json!({"model": cfg, "params": cfg.num_params(), "world": world, "batch": batch}),
        format!("{cfg:?}: {} parameters, {world} ranks, a global batch of {batch} rows\n\
                 layout            planned rank 0   planned largest   held by rank 0 (measured)   + a step's transient = peak", cfg.num_params()),
    );
    for (dims, data) in fit::layouts(&cfg, world, world) {
        let name = dims.name(data, false);
        let planned = fit::rank_state_bytes(&cfg, dims, data).map_err(anyhow::Error::msg)?;
        let largest = planned.iter().copied().fold(0.0, f64::max);
        let strategy = match data {
            DataDim::Replicate => Strategy::Ddp,
            DataDim::Zero(shardlab::zero::Stage::One) => Strategy::Zero1,
            DataDim::Zero(shardlab::zero::Stage::Two) => Strategy::Zero2,
            DataDim::Zero(shardlab::zero::Stage::Three) => Strategy::Zero3,
        };
        let s = ScalingConfig {
            num_workers: world,
            strategy,
            tensor_parallel: dims.tp,
            pipeline: PipelineConfig { stages: dims.pp, micro_batches: dims.pp, ..PipelineConfig::default() },
            threads_per_worker: Some(1),
            ..ScalingConfig::default()
        };
        let j = GptJob { steps: 2, warmup: 0, batch_size: batch / world, eval: EvalConfig::default(), ..base.clone() };
        let r = j.fit(s, false, false)?;
        let held = r.memory.model_states();
        emit(
            a,
            json!({"layout": name, "planned_rank0": planned[0], "planned_largest": largest, "held_rank0": held,
                   "peak_transient_rank0": r.memory.peak_transient, "peak_rank0": held + r.memory.peak_transient}),
            format!(
                "{name:<16} {:>12.0} B {:>15.0} B {:>15} B ({:+.2} %) {:>12} B = {:>9} B",
                planned[0],
                largest,
                held,
                100.0 * (held as f64 - planned[0]) / planned[0],
                r.memory.peak_transient,
                held + r.memory.peak_transient
            ),
        );
    }
    // Budgets between the strategies' totals over 4 replicas: 16P (DDP), 11P (ZeRO-1), 7P (ZeRO-2),
    // 4P (ZeRO-3), and below; then at most 2 replicas, and 1 (a limit `train` does not have: it
    // scales the global batch with the world; Megatron and torchtitan split a fixed one).
    for (budget, max_dp) in
        [(16.0, world), (15.0, world), (10.0, world), (5.0, world), (3.9, world), (5.0, 2), (7.5, 2), (4.5, 1)]
    {
        let bytes = budget * p;
        let v = match fit::choose(&cfg, world, max_dp, bytes) {
            Ok((dims, data, need)) => {
                let name = dims.name(data, false);
                emit(a, json!({"budget_bytes": bytes, "max_dp": max_dp, "chosen": name, "bytes": need}),
                     format!("budget {bytes:>11.0} B ({budget:>4} bytes a parameter), at most {max_dp} replica{}: {name} ({need:.0} B on its largest rank)", if max_dp == 1 { "" } else { "s" }));
                continue;
            }
            Err(e) => e,
        };
        emit(
            a,
            json!({"budget_bytes": bytes, "max_dp": max_dp, "error": v}),
            format!(
                "budget {bytes:>11.0} B ({budget:>4} bytes a parameter), at most {max_dp} replica{}: {v}",
                if max_dp == 1 { "" } else { "s" }
            ),
        );
    }
    Ok(())
}
