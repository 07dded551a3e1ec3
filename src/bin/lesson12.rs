//! Lesson 12 demo — tensor parallelism: a GPT trained with its matrices split over t = 1, 2 and 4
//! TCP rank processes (Megatron-LM's layout: attention by heads, the MLP column → row, the
//! vocabulary split in the embedding, the tied head and the loss), measured next to one process.
//!
//!   cargo run --release --bin lesson12                 # t = 1, 2, 4; 5 AdamW steps each
//!   cargo run --release --bin lesson12 -- --steps 10
//!   cargo run --release --bin lesson12 -- --json       # one JSON object per line (the notebook)
//!   cargo run --release --bin lesson12 -- --compare-pytorch  # + train --tp 2 vs PyTorch's DTensor TP on Gloo
//!
//! Measured per t: the loss of every step next to one process's (the GPT's own forward and
//! autograd), the all-reduces and bytes each rank sent per step (the group's counters), the
//! parameter and AdamW-state bytes a rank holds (its tensors), the step time; then the
//! vocab-parallel loss's bytes against all-gathering the logits, both really sent.
//!
//! `--compare-pytorch` also trains the benchmark GPT with tensor parallelism over 2 processes,
//! shardlab's `train --tp 2` against PyTorch 2.11's `torch.distributed.tensor.parallel` on Gloo
//! (`benches/torch_gpt.py train --strategy tp`: the blocks column → row as here, the embeddings
//! and the tied head replicated), and tokens/s of each next to its DDP on the same 2 ranks.

use anyhow::Context;
use clap::Parser;
use serde_json::json;
use shardlab::data::synthetic_corpus;
use shardlab::engine::{parallelize, DataDim, ParallelDims, Plan};
use shardlab::job::{self, GptJob, OneRun};
use shardlab::optim::{clip_coef, global_norm, Decay};
use shardlab::prelude::*;
use shardlab::tp::vocab_parallel_cross_entropy;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Lesson 12: tensor parallelism — a GPT split over 1, 2 and 4 ranks, measured")]
struct Args {
    /// AdamW steps per run (the first is a warm-up for the timing).
    #[arg(long, default_value_t = 5)]
    steps: u64,
    #[arg(long)]
    json: bool,
    /// Also train the benchmark GPT with `--tp 2` against PyTorch's DTensor TP (and both DDPs),
    /// tokens/s, median of 3 interleaved runs (needs `bash .ci/setup`).
    #[arg(long)]
    compare_pytorch: bool,
}

const WORLD: usize = 4;
const ROWS: usize = 8;
const LR: f64 = 1e-3;

fn cfg() -> GptConfig {
    GptConfig { vocab_size: 2048, block_size: 64, n_layer: 4, n_head: 4, n_embd: 256 }
}

/// The synthetic corpus's 13 ids spread over the vocabulary (id·157: 0 … 1884), so that every
/// tensor-parallel rank's slice of the embedding and the head holds some of them.
fn batch(step: u64) -> Batch {
    // Built once per process, not per step.
    static TOKENS: std::sync::OnceLock<Tokens> = std::sync::OnceLock::new();
    let tokens = TOKENS.get_or_init(|| Tokens(synthetic_corpus(50_000, 3).0.iter().map(|t| t * 157).collect()));
    DistributedSampler::new(64, ROWS, 0, 1, 5).expect("sampler").batch(tokens, step)
}

/// One run at tensor-parallel size t, as rank 0 of its group saw it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Run {
    t: usize,
    losses: Vec<f64>,
    step_ms: f64,
    all_reduces: u64,
    bytes_sent: u64,
    param_bytes: u64,
    adam_bytes: u64,
}

/// The vocab-parallel loss against gathering the logits, at group size t.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Vocab {
    t: usize,
    loss_sent: u64,
    gather_sent: u64,
}

fn train(pg: &ProcessGroup, steps: u64) -> anyhow::Result<Run> {
    // The whole group is one tensor-parallel replica: the engine's layout 1 × 1 × t.
    let dims = ParallelDims { pp: 1, dp: 1, tp: pg.world_size() };
    let plan = Plan::new(dims, DataDim::Replicate);
    let mut m = parallelize(pg, &plan, &cfg(), &|_| Gpt::new(cfg(), 9))?;
    let mut opt = AdamW::new(AdamWConfig { lr: LR, ..Default::default() });
    let (mut losses, mut times, mut comm) = (vec![], vec![], None);
    for step in 0..steps {
        let b = batch(step);
        pg.barrier()?;
        let (t0, before) = (Instant::now(), m.mesh().group("tp").stats());
        let out = m.train_step(&b, &mut opt, LR, Some(1.0))?;
        times.push(t0.elapsed().as_secs_f64());
        comm.get_or_insert(m.mesh().group("tp").stats().since(&before));
        losses.push(out.loss);
    }
    let c = comm.unwrap_or_default();
    let later = &times[1.min(times.len() - 1)..];
    Ok(Run {
        t: pg.world_size(),
        losses,
        step_ms: later.iter().sum::<f64>() / later.len() as f64 * 1e3,
        all_reduces: c.calls(OpKind::AllReduce),
        bytes_sent: c.bytes_sent,
        param_bytes: m.memory(&opt).params,
        adam_bytes: opt.state_bytes(),
    })
}

/// The head's logits for one batch, (B·T, V/t) of this rank, through both roads to the loss.
fn vocab(pg: &ProcessGroup) -> anyhow::Result<Vocab> {
    let (n, v) = (ROWS as i64 * 64, cfg().vocab_size);
    let vl = v / pg.world_size() as i64;
    let logits = (Tensor::arange(n * vl, (Kind::Float, Device::Cpu)) * (0.37 + pg.rank() as f64)).sin().view([n, vl]);
    let targets = batch(0).y.view([-1]);
    let before = pg.stats();
    let _ = vocab_parallel_cross_entropy(pg, &logits, &targets)?;
    let loss_sent = pg.stats().since(&before).bytes_sent;
    let before = pg.stats();
    let mut all = Tensor::zeros([n * v], (Kind::Float, Device::Cpu));
    pg.all_gather(&mut all, &logits.reshape([-1]))?;
    Ok(Vocab { t: pg.world_size(), loss_sent, gather_sent: pg.stats().since(&before).bytes_sent })
}

/// One process, no tensor parallelism: the GPT's own forward, autograd and the same AdamW.
fn one_process(steps: u64) -> anyhow::Result<Vec<f64>> {
    let gpt = Gpt::new(cfg(), 9)?;
    let mut opt = AdamW::new(AdamWConfig { lr: LR, ..Default::default() });
    let mut losses = vec![];
    for step in 0..steps {
        let params = gpt.parameters();
        zero_grads(&params);
        let loss = gpt.loss(&batch(step));
        loss.backward();
        let grads: Vec<Tensor> = params.iter().map(|p| p.grad()).collect();
        let k = clip_coef(global_norm(&grads), 1.0);
        let grads: Vec<Tensor> = grads.iter().map(|g| g * k).collect();
        let decay: Vec<Decay> = params.iter().map(|p| Decay::for_shape(&p.size())).collect();
        opt.step(LR, &params, &grads, &decay).map_err(anyhow::Error::msg)?;
        losses.push(loss.double_value(&[]));
    }
    Ok(losses)
}

fn main() -> anyhow::Result<()> {
    job::run_one_if_asked();
    let a = Args::parse();
    anyhow::ensure!(a.steps >= 2, "--steps must be at least 2 (the first is a warm-up)");
    let steps = a.steps;
    // The processes first (a spawned rank re-runs main up to here). One world of 4; for each t the
    // first t ranks form a group (new_group) and train while the others wait at the barrier.
    // TCP between the processes and the ring algorithm, so that the bytes counted are bytes
    // written to sockets (shared memory's direct algorithm counts a ring-equivalent volume).
    let comm = CommConfig { transport: DataPath::Tcp, ..CommConfig::default() };
    let per_rank = spawn_with(SpawnOptions::new(WORLD, Backend::Tcp).config(comm), move |pg| {
        let mut out: (Vec<Run>, Vec<Vocab>) = (vec![], vec![]);
        for t in [1usize, 2, 4] {
            let members: Vec<usize> = (0..t).collect();
            if let Some(g) = pg.new_group(&members)? {
                let run = train(&g, steps)?;
                let voc = if t > 1 { Some(vocab(&g)?) } else { None };
                if g.rank() == 0 {
                    out.0.push(run);
                    out.1.extend(voc);
                }
            }
            pg.barrier()?;
        }
        Ok(out)
    })?;
    let (runs, vocabs) = per_rank.into_iter().next().expect("rank 0");
    let reference = one_process(steps)?;
    let c = cfg();
    let full_bytes = shardlab::memory::held_bytes(Gpt::new(c, 9)?.parameters().iter());
    let (b, t_len) = (ROWS as u64, c.block_size as u64);
    // Payload all-reduced per step: (4L + 2)·B·T·C + 3·B·T floats, whatever t is; the optimizer
    // step adds its own 1 + 2t f64 (the norm, a refusal and a non-finite flag per rank).
    let payload = ((4 * c.n_layer as u64 + 2) * b * t_len * c.n_embd as u64 + 3 * b * t_len) * 4;
    let step_bytes = |t: usize| 8 * (1 + 2 * t as u64);
    if !a.json {
        println!(
            "A GPT ({} layers, {} heads, width {}, vocabulary {}; {:.2}M parameters), {} rows × {} tokens, AdamW lr {LR}, clip 1.0,",
            c.n_layer,
            c.n_head,
            c.n_embd,
            c.vocab_size,
            c.num_params() as f64 / 1e6,
            ROWS,
            c.block_size
        );
        println!("{steps} steps, tensor-parallel over t rank processes, all-reduces over TCP (ring); rank 0 of each group shown:\n");
        println!(
            "  {:>2} {:>12} {:>13} {:>12} {:>16} {:>10} {:>10} {:>9}",
            "t", "final loss", "max |Δ loss|", "all-reduces", "MB sent/step", "param MB", "AdamW MB", "step ms"
        );
    }
    for r in &runs {
        let worst = r.losses.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        anyhow::ensure!(worst < 1e-4, "t={}: the losses differ from one process's by {worst}", r.t);
        // A ring all-reduce sends 2(t−1)/t of the payload per rank.
        let ring = 2.0 * (r.t as f64 - 1.0) / r.t as f64 * (payload + step_bytes(r.t)) as f64;
        if a.json {
            println!(
                "{}",
                json!({"section": "train", "t": r.t, "losses": r.losses, "reference": reference, "max_loss_diff": worst,
                       "step_ms": r.step_ms, "all_reduces": r.all_reduces, "bytes_sent": r.bytes_sent, "ring_formula_bytes": ring,
                       "payload_bytes": payload + step_bytes(r.t), "param_bytes": r.param_bytes, "adam_bytes": r.adam_bytes, "full_param_bytes": full_bytes})
            );
        } else {
            println!(
                "  {:>2} {:>12.6} {:>13.1e} {:>12} {:>16} {:>10.2} {:>10.2} {:>9.1}",
                r.t,
                r.losses.last().unwrap_or(&f64::NAN),
                worst,
                r.all_reduces,
                format!("{:.2} ({:.2})", r.bytes_sent as f64 / 1e6, ring / 1e6),
                r.param_bytes as f64 / 1e6,
                r.adam_bytes as f64 / 1e6,
                r.step_ms
            );
        }
    }
    if !a.json {
        println!(
            "\n  one process (the GPT's own forward and autograd): final loss {:.6}; parameters {:.2} MB",
            reference.last().unwrap_or(&f64::NAN),
            full_bytes as f64 / 1e6
        );
        println!(
            "  all-reduces per step: 4L + 5 = {} for the model and the loss, + 1 for the global norm; MB sent in",
            4 * c.n_layer + 5
        );
        println!(
            "  brackets: a ring's 2(t−1)/t of the {:.2} MB all-reduced — the same payload whatever t is.",
            payload as f64 / 1e6
        );
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        println!(
            "  (Step times: {WORLD} processes share {cores} core(s) here; the lesson explains why TP only pays with fast links.)\n"
        );
        println!(
            "The loss without the logits, for one batch ({} × {} positions, vocabulary {}):",
            ROWS, 64, c.vocab_size
        );
        println!("  {:>2} {:>22} {:>26}", "t", "vocab-parallel: sent", "all-gather logits: sent");
    }
    for v in &vocabs {
        if a.json {
            println!(
                "{}",
                json!({"section": "vocab", "t": v.t, "loss_sent": v.loss_sent, "gather_sent": v.gather_sent})
            );
        } else {
            println!(
                "  {:>2} {:>22} {:>26}",
                v.t,
                format!("{:.1} KB", v.loss_sent as f64 / 1e3),
                format!("{:.1} KB", v.gather_sent as f64 / 1e3)
            );
        }
    }
    if a.compare_pytorch {
        compare_pytorch(a.json)?;
    }
    Ok(())
}

/// shardlab's `train --tp 2` and DDP on 2 ranks against PyTorch's DTensor TP and DDP (Gloo), the
/// benchmark GPT, 12 steps (3 untimed), the same global batch of 16 rows of 128 tokens: tokens/s,
/// median of 3 interleaved runs.
fn compare_pytorch(json_out: bool) -> anyhow::Result<()> {
    let corpus = job::TempCorpus::new("lesson12", 1_000_000)?;
    let job = GptJob::benchmark(GptConfig::bench(), corpus.path.clone(), 12, 3);
    let ours = |tp: usize| -> anyhow::Result<f64> {
        let r = job::run_isolated(&OneRun {
            job: job.clone(),
            strategy: Strategy::Ddp,
            world_size: 2,
            backend: Backend::Tcp,
            variant: shardlab::ddp::Variant::Bucketed,
            bucket_cap_bytes: shardlab::ddp::DEFAULT_BUCKET_CAP_BYTES,
            threads: Some(1),
            checkpointing: Checkpointing::None,
            reshard_after_forward: true,
            precision: Precision::Fp32,
            reduce_dtype: Precision::Fp32,
            offload: false,
            device: Default::default(),
            tp,
            pp: Default::default(),
        })?;
        Ok(r.tokens_per_s)
    };
    let theirs = |strategy: &str| -> anyhow::Result<f64> {
        job::pytorch_train(&job, strategy, 2)?["tokens_per_s"].as_f64().context("no tokens_per_s in PyTorch's summary")
    };
    let mut m: [Vec<f64>; 4] = Default::default();
    for _ in 0..3 {
        m[0].push(ours(2)?);
        m[1].push(theirs("tp")?);
        m[2].push(ours(1)?);
        m[3].push(theirs("ddp")?);
    }
    let med: Vec<f64> = m.iter_mut().map(|v| shardlab::bench::median(v)).collect();
    if json_out {
        println!(
            "{}",
            json!({"section": "pytorch", "world_size": 2,
                   "tp_tokens_per_s": {"shardlab": med[0], "pytorch": med[1]},
                   "ddp_tokens_per_s": {"shardlab": med[2], "pytorch": med[3]}})
        );
    } else {
        println!(
            "
shardlab vs PyTorch 2.11 on 2 processes (tokens/s, median of 3 interleaved runs, 1 thread each):"
        );
        println!("{:<44} {:>10} {:>10} {:>7}", "", "shardlab", "PyTorch", "ratio");
        for (name, i) in [("tensor parallel, t = 2 (DTensor on Gloo for PT)", 0), ("DDP, 2 ranks (Gloo for PT)", 2)] {
            println!("{name:<44} {:>10.0} {:>10.0} {:>6.2}×", med[i], med[i + 1], med[i] / med[i + 1]);
        }
        println!(
            "(PyTorch's TP keeps the embeddings and the tied head whole on both ranks, so each computes all\n\
             the logits; shardlab's splits the vocabulary. Its blocks are split as shardlab's.)"
        );
    }
    Ok(())
}
