//! Lesson 13 demo — pipeline parallelism: the GPipe and 1F1B diagrams on an idealised pipeline,
//! the bubble against (p − 1)/(m + p − 1), then one pipelined step of a GPT on 4 rank processes,
//! measured.
//!
//!   cargo run --release --bin lesson13                       # GPipe and 1F1B at m = 4 and 8
//!   cargo run --release --bin lesson13 -- --micro-batches 16 --schedule 1f1b
//!   cargo run --release --bin lesson13 -- --json             # one JSON object per line (the notebook)
//!
//! Each rank builds only the parameters of its stages (`Gpt::new_only`). Measured: the parameter
//! bytes each rank holds, each rank's compute slots (from after the receive an operation waited
//! for to before its send), its idle fraction of the step (the bubble), the most micro-batches
//! whose activations it held, and the step's loss next to one process's on the same batch.

use clap::Parser;
use serde_json::json;
use shardlab::data::synthetic_corpus;
use shardlab::pipeline::{self, pipeline_step, Op, Schedule};
use shardlab::prelude::*;

#[derive(Parser, Debug)]
#[command(about = "Lesson 13: pipeline parallelism — schedules, the bubble, a pipelined GPT step measured")]
struct Args {
    /// Micro-batches per step (default: 4 and 8).
    #[arg(long)]
    micro_batches: Option<usize>,
    /// One schedule (default: both).
    #[arg(long, value_enum)]
    schedule: Option<Schedule>,
    #[arg(long)]
    json: bool,
}

const P: usize = 4;
const ROWS: usize = 32;

fn cfg() -> GptConfig {
    // 4 blocks: 6 stages (embeddings, 4 blocks, head) on 4 ranks: 2, 2, 1, 1.
    GptConfig { vocab_size: 512, block_size: 64, n_layer: 4, n_head: 4, n_embd: 128 }
}

fn batch() -> Batch {
    DistributedSampler::new(64, ROWS, 0, 1, 5).expect("sampler").batch(&synthetic_corpus(50_000, 3), 0)
}

/// Per configuration, per rank: (bubble, peak in flight, step s, loss, slots).
type Measured = Vec<(Schedule, usize, Vec<(f64, usize, f64, f64, Vec<(f64, f64, usize, bool)>)>)>;

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let ms: Vec<usize> = a.micro_batches.map_or(vec![4, 8], |m| vec![m]);
    let kinds: Vec<Schedule> = a.schedule.map_or(vec![Schedule::GPipe, Schedule::OneFOneB], |k| vec![k]);
    for &m in &ms {
        anyhow::ensure!(m >= 1 && ROWS % m == 0, "--micro-batches must divide the batch of {ROWS} rows");
    }
    // The processes first (a spawned rank re-runs main up to here).
    let configs: Vec<(Schedule, usize)> = kinds.iter().flat_map(|&k| ms.iter().map(move |&m| (k, m))).collect();
    let runs = configs.clone();
    let per_rank = spawn_with(SpawnOptions::new(P, Backend::Tcp), move |pg| {
        // Only this rank's stages' parameters: the same values as the whole model's (same seed).
        let mine = pipeline::train::params_of_ranks(&cfg(), P).map_err(anyhow::Error::msg)?.swap_remove(pg.rank());
        let gpt = Gpt::new_only(cfg(), 9, |i| mine.contains(&i))?;
        let held = shardlab::memory::held_bytes(gpt.parameters().iter());
        let mut out = Vec::new();
        for &(kind, m) in &runs {
            pipeline_step(pg, &gpt, kind, &batch(), m, cfg().n_embd)?; // warm-up: allocations, first touches
            let s = pipeline_step(pg, &gpt, kind, &batch(), m, cfg().n_embd)?;
            let slots: Vec<(f64, f64, usize, bool)> = s
                .slots
                .iter()
                .map(|x| match x.op {
                    Op::Forward(i) => (x.start, x.end, i, true),
                    Op::Backward(i) => (x.start, x.end, i, false),
                })
                .collect();
            out.push((s.bubble(), s.peak_in_flight, s.step_s, s.loss, slots));
        }
        Ok((held, out))
    })?;
    let held: Vec<u64> = per_rank.iter().map(|r| r.0).collect();
    let per_rank: Vec<_> = per_rank.into_iter().map(|r| r.1).collect();
    let measured: Measured = configs
        .iter()
        .enumerate()
        .map(|(c, &(k, m))| (k, m, per_rank.iter().map(|r| r[c].clone()).collect()))
        .collect();
    let whole = Gpt::new(cfg(), 9)?;
    let reference = whole.loss(&batch()).double_value(&[]);
    let whole_bytes = shardlab::memory::held_bytes(whole.parameters().iter());

    // 1. The diagrams of an idealised pipeline (t_b = 2·t_f).
    if !a.json {
        println!(
            "Idealised pipeline, p = {P}, m = 8, a backward twice a forward (digits: forwards, letters: backwards):"
        );
        for kind in [Schedule::GPipe, Schedule::OneFOneB] {
            let t = pipeline::simulate(kind, P, 8, 1.0, 2.0);
            println!("{kind:?}:\n{}", pipeline::ascii_diagram(&t, 1.0));
        }
    }
    // 2. The bubble against m.
    if !a.json {
        println!("Bubble (idle fraction of a step) at p = {P}, both schedules alike:");
        println!(
            "  {:>4} {:>10} {:>10} {:>13} {:>22}",
            "m", "formula", "simulated", "step, in t_f", "stage 0 holds: GPipe/1F1B"
        );
    }
    for m in [1, 2, 4, 8, 16, 32] {
        let formula = pipeline::bubble_fraction(P, m);
        let (g, o) = (
            pipeline::simulate(Schedule::GPipe, P, m, 1.0, 2.0),
            pipeline::simulate(Schedule::OneFOneB, P, m, 1.0, 2.0),
        );
        let sim = o.bubble(0);
        let (span, held) = (o.makespan(), (g.peak_in_flight(0), o.peak_in_flight(0)));
        if a.json {
            println!(
                "{}",
                json!({"section": "bubble", "p": P, "m": m, "formula": formula, "simulated": sim, "step_t_f": span,
                       "stage0_holds_gpipe": held.0, "stage0_holds_1f1b": held.1})
            );
        } else {
            println!("  {m:>4} {formula:>10.4} {sim:>10.4} {span:>13} {:>22}", format!("{} / {}", held.0, held.1));
        }
    }
    // 2b. Interleaved 1F1B (simulated here; `pipeline::interleaved_step` runs it on real ranks): v chunks per rank,
    // each 1/v of a stage's work.
    if !a.json {
        println!("\nInterleaved 1F1B at p = {P}, m = 8: v model chunks per rank (v = 1 is 1F1B):");
        println!(
            "  {:>2} {:>10} {:>10} {:>13} {:>24}",
            "v", "formula", "simulated", "step, in t_f", "stage 0 holds (stages)"
        );
    }
    for v in [1, 2, 4] {
        let plans: Vec<Vec<pipeline::ChunkOp>> =
            (0..P).map(|r| pipeline::interleaved(P, v, 8, r)).collect::<Result<_, _>>().map_err(anyhow::Error::msg)?;
        let t = pipeline::simulate_chunks(&plans, v, 1.0 / v as f64, 2.0 / v as f64).map_err(anyhow::Error::msg)?;
        let formula = pipeline::interleaved_bubble_fraction(P, v, 8);
        // Each chunk holds 1/v of a stage's activations.
        let holds = t.peak_in_flight(0) as f64 / v as f64;
        if a.json {
            println!(
                "{}",
                json!({"section": "interleaved", "p": P, "m": 8, "v": v, "formula": formula, "simulated": t.bubble(0),
                       "step_t_f": t.makespan(), "stage0_holds": holds})
            );
        } else {
            println!("  {v:>2} {formula:>10.4} {:>10.4} {:>13.2} {holds:>24}", t.bubble(0), t.makespan());
        }
        if v == 2 && !a.json {
            println!("{}", pipeline::ascii_diagram(&t, 0.5));
        }
    }
    // 3. Measured.
    let c = cfg();
    if !a.json {
        println!(
            "\nMeasured: one step of a GPT ({} layers, width {}, {} rows × {} tokens) on {P} TCP rank processes, stages {:?}:",
            c.n_layer,
            c.n_embd,
            ROWS,
            c.block_size,
            pipeline::partition(c.n_layer as usize + 2, P).map_err(anyhow::Error::msg)?
        );
        let mb: Vec<String> = held.iter().map(|&b| format!("{:.3}", b as f64 / 1e6)).collect();
        println!(
            "  parameters held per rank (MB, from its tensors): {} — the whole model {:.3} MB (ranks 0 and {} both hold the tied wte)",
            mb.join(" "),
            whole_bytes as f64 / 1e6,
            P - 1
        );
        println!(
            "  {:<9} {:>3} {:>9} {:>28} {:>16} {:>12}",
            "schedule", "m", "formula", "bubble per rank (measured)", "held per rank", "step ms"
        );
    }
    if a.json {
        println!("{}", json!({"section": "params", "p": P, "held_bytes": held, "whole_model_bytes": whole_bytes}));
    }
    for (kind, m, ranks) in &measured {
        let loss_ok = ranks.iter().all(|r| (r.3 - reference).abs() < 1e-5);
        anyhow::ensure!(loss_ok, "{kind:?} m={m}: the pipelined loss differs from one process's {reference}");
        if a.json {
            println!(
                "{}",
                json!({"section": "measured", "schedule": kind, "m": m, "p": P, "formula": pipeline::bubble_fraction(P, *m),
                       "bubble": ranks.iter().map(|r| r.0).collect::<Vec<_>>(), "peak_in_flight": ranks.iter().map(|r| r.1).collect::<Vec<_>>(),
                       "step_s": ranks.iter().map(|r| r.2).fold(0.0, f64::max), "loss": ranks[0].3, "reference_loss": reference,
                       "slots": ranks.iter().map(|r| &r.4).collect::<Vec<_>>()})
            );
        } else {
            let bubbles: Vec<String> = ranks.iter().map(|r| format!("{:.2}", r.0)).collect();
            let held: Vec<String> = ranks.iter().map(|r| r.1.to_string()).collect();
            println!(
                "  {:<9} {m:>3} {:>9.3} {:>28} {:>16} {:>12.1}",
                format!("{kind:?}"),
                pipeline::bubble_fraction(P, *m),
                bubbles.join(" "),
                held.join(" "),
                ranks.iter().map(|r| r.2).fold(0.0, f64::max) * 1e3
            );
        }
    }
    if !a.json {
        println!("  every step's loss = one process's on the same batch ({reference:.6})");
        println!(
            "  The measured bubble also holds what the formula leaves out: stages of unequal cost (rank 1's two blocks are\n  \
             the heaviest; the embeddings and the head are lighter), send and receive time, and the cores 4 processes share."
        );
    }
    Ok(())
}
