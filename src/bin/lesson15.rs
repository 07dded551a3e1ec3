//! Lesson 15 demo — scaling out on paper: what a layout costs on thousands of GPUs, from the
//! course's own schedules in virtual time (`shardlab::sim`).
//!
//! ```text
//! cargo run --release --bin lesson15 -- alpha-beta   # all-reduces here, fitted to 2α + B/β
//! cargo run --release --bin lesson15 -- hierarchy    # one all-reduce on 8 to 16,384 A100s: the NIC bound, ring or tree
//! cargo run --release --bin lesson15 -- bubble       # the pipeline's bubble, plain and interleaved
//! cargo run --release --bin lesson15 -- tp           # tensor parallelism inside a node and across two
//! cargo run --release --bin lesson15 -- scaling      # a 70B GPT on 8 to 16,384 H100s: the best layout of each
//! cargo run --release --bin lesson15 -- validate     # Megatron-LM's published runs, predicted
//! ```
//!
//! `--json` prints one JSON object per line; `scaling --svg FILE` draws the curve. The simulator
//! checked against `train` on this machine is `cargo run --release --bin plan -- --validate --gpu
//! this-machine` (about 2 minutes here). Every part calls the library.

use clap::{Parser, Subcommand};
use serde_json::json;
use shardlab::bench::{self, Iters, Method, Timing};
use shardlab::comm::{Algo, Backend, OpKind};
use shardlab::memory::Recompute;
use shardlab::pipeline::{interleaved, interleaved_bubble_fraction, schedule, simulate_chunks, ChunkOp, Schedule};
use shardlab::plot::LineChart;
use shardlab::precision::Precision;
use shardlab::sim::{calibrate, collective, profile, search, simulate_step, validate, Coll, Layout, Model, Placement};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(about = "Lesson 15: a cluster simulator — step time, tokens/s, MFU and memory for thousands of GPUs")]
struct Args {
    #[command(subcommand)]
    part: Part,
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Subcommand, Debug)]
enum Part {
    /// All-reduces between two process ranks here, fitted to t = 2(n − 1)·α + 2(n − 1)/n · B/β.
    AlphaBeta,
    /// One all-reduce on 8 to 16,384 A100s: within a node, across nodes (the NIC bound), small
    /// messages at scale (the tree).
    Hierarchy,
    /// The bubble of 8 pipeline ranks, plain and interleaved, and GPT-175B's step with each.
    Bubble,
    /// A 70B GPT on H100s with tensor parallelism inside a node and across two.
    Tp,
    /// A 70B GPT on 8 to 16,384 H100s: the fastest layout that fits at each size.
    Scaling {
        /// Draw tokens/s against GPUs here (SVG).
        #[arg(long)]
        svg: Option<PathBuf>,
    },
    /// Narayanan et al. 2021, Table 1: published TFLOP/s per GPU against the simulator's.
    Validate,
}

/// A 70B GPT as the course's model counts it (GeLU MLP; Llama 2 70B's depth and width, the MLP
/// widened to keep its 70 billion parameters): 80 layers, 8,192 wide, 64 heads, sequences of 4,096.
fn gpt_70b() -> Model {
    Model { layers: 80, hidden: 8192, heads: 64, ffn: 36864, seq: 4096, vocab: 32000 }
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    match a.part {
        Part::AlphaBeta => alpha_beta(a.json),
        Part::Hierarchy => hierarchy(a.json),
        Part::Bubble => bubble(a.json),
        Part::Tp => tp(a.json),
        Part::Scaling { svg } => scaling(a.json, svg),
        Part::Validate => published(a.json),
    }
}

fn alpha_beta(json: bool) -> anyhow::Result<()> {
    const SIZES: [u64; 6] = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20];
    let timing = Timing { warmup: 3, iters: Iters::Auto, method: Method::NcclTests };
    // The children this starts run only the closure (lesson 01's spawn).
    let times = shardlab::launch::spawn(2, Backend::Tcp, move |pg| {
        SIZES
            .iter()
            .map(|&b| Ok(bench::measure_with(pg, "shardlab", OpKind::AllReduce, Algo::Auto, b, timing)?.time_s))
            .collect::<anyhow::Result<Vec<f64>>>()
    })?;
    let points: Vec<(f64, f64)> = SIZES.iter().zip(&times[0]).map(|(b, t)| (*b as f64, *t)).collect();
    let (alpha, beta) = calibrate::fit_all_reduce(&points, 2).map_err(anyhow::Error::msg)?;
    if !json {
        println!(
            "all-reduce between 2 process ranks here (shared memory), fitted: α {:.1} µs, β {:.2} GB/s",
            alpha * 1e6,
            beta / 1e9
        );
        println!("{:>10} {:>12} {:>12} {:>8}", "bytes", "measured", "α-β model", "error");
    }
    for (b, t) in points {
        let model = 2.0 * alpha + b / beta;
        if json {
            println!(
                "{}",
                json!({"bytes": b, "measured_s": t, "model_s": model, "alpha_s": alpha, "beta_bytes_per_s": beta})
            );
        } else {
            println!(
                "{:>10} {:>9.1} µs {:>9.1} µs {:>+7.1}%",
                bench::fmt_size(b as u64),
                t * 1e6,
                model * 1e6,
                100.0 * (model / t - 1.0)
            );
        }
    }
    Ok(())
}

fn hierarchy(json: bool) -> anyhow::Result<()> {
    let a100 = profile("a100-80gb").map_err(anyhow::Error::msg)?;
    if !json {
        println!(
            "all-reduce on A100-80GB nodes (8 GPUs, NVLink {:.0} GB/s and one {:.0} GB/s NIC each, per direction):",
            a100.intra.bytes_per_s / 1e9,
            a100.inter.bytes_per_s / 1e9
        );
        println!("{:>6} {:>9} {:>6} {:>10} {:>12} {:>12}", "GPUs", "per node", "nodes", "bus GB/s", "1 GiB", "4 KiB");
    }
    let groups = [(8, 8), (8, 1), (16, 8), (64, 8), (1024, 8), (16384, 8)];
    for (n, per_node) in groups {
        let at = Placement { size: n, per_node };
        let bw = collective::bus_bandwidth(&a100, at);
        let big = collective::time(&a100, Coll::AllReduce, 1073741824.0, at);
        let small = collective::time(&a100, Coll::AllReduce, 4096.0, at);
        if json {
            println!(
                "{}",
                json!({"gpus": n, "per_node": per_node, "nodes": at.nodes(), "bus_bytes_per_s": bw, "gib_s": big, "four_kib_s": small})
            );
        } else {
            println!(
                "{n:>6} {per_node:>9} {:>6} {:>10.0} {:>9.2} ms {:>9.1} µs",
                at.nodes(),
                bw / 1e9,
                big * 1e3,
                small * 1e6
            );
        }
    }
    if !json {
        let ring = 2.0 * 16383.0 * a100.inter.alpha;
        println!("(a ring of 16,384 would pay 2(n − 1)·α = {:.0} ms of latency alone for 4 KiB; NCCL's tree pays 2·log₂ of the nodes)", ring * 1e3);
    }
    Ok(())
}

fn bubble(json: bool) -> anyhow::Result<()> {
    let p = 8;
    if !json {
        println!("the bubble of {p} pipeline ranks (1F1B, a backward twice a forward), simulated and by formula:");
        println!("{:>6} {:>3} {:>10} {:>10}", "m", "v", "simulated", "formula");
    }
    for m in [8, 16, 32, 64] {
        for v in [1, 2, 4] {
            let plans: Vec<Vec<ChunkOp>> = if v == 1 {
                (0..p)
                    .map(|r| {
                        schedule(Schedule::OneFOneB, p, m, r).into_iter().map(|op| ChunkOp { chunk: 0, op }).collect()
                    })
                    .collect()
            } else {
                (0..p).map(|r| interleaved(p, v, m, r)).collect::<Result<_, _>>().map_err(anyhow::Error::msg)?
            };
            // A chunk is 1/v of a rank's layers: its forward 1/v, its backward 2/v.
            let t = simulate_chunks(&plans, v, 1.0 / v as f64, 2.0 / v as f64).map_err(anyhow::Error::msg)?;
            let simulated = t.bubble(0);
            let formula = interleaved_bubble_fraction(p, v, m);
            if json {
                println!(
                    "{}",
                    json!({"stages": p, "micro_batches": m, "chunks": v, "simulated": simulated, "formula": formula})
                );
            } else {
                println!("{m:>6} {v:>3} {:>9.1}% {:>9.1}%", 100.0 * simulated, 100.0 * formula);
            }
        }
    }
    // GPT-175B on 1,024 A100s, tp 8 × pp 16: interleaving against its extra messages.
    let a100 = profile("a100-80gb").map_err(anyhow::Error::msg)?;
    let model = Model::gpt(96, 12288, 96);
    for v in [1, 2, 3] {
        let mut l = Layout::new(8, 8, 16);
        l.global_batch = 512;
        l.interleave = v;
        l.recompute = Recompute::Full;
        l.precision = Precision::Fp16;
        let pr = simulate_step(&model, &a100, &l).map_err(anyhow::Error::msg)?;
        if json {
            println!("{}", json!({"model": "gpt-175b", "interleave": v, "step_s": pr.step_s, "split": pr.split}));
        } else {
            println!(
                "GPT-175B, 1,024 A100s, tp 8 × pp 16 × dp 8, 64 micro-batches, v = {v}: step {:.2} s, bubble {:.2} s, pp sends {:.2} s, {:.0} TFLOP/s a GPU",
                pr.step_s, pr.split.bubble, pr.split.pp_comm, pr.megatron_tflops_per_gpu
            );
        }
    }
    Ok(())
}

fn tp(json: bool) -> anyhow::Result<()> {
    let h100 = profile("h100-80gb").map_err(anyhow::Error::msg)?;
    let model = gpt_70b();
    // 64 GPUs, 8 nodes: tp 8 × pp 8 keeps every tp group in a node; tp 16 × pp 4 spans two.
    for (tp, pp) in [(4, 16), (8, 8), (16, 4)] {
        let mut l = Layout::new(1, tp, pp);
        l.global_batch = 64;
        l.sequence_parallel = true;
        l.recompute = Recompute::Selective;
        let p = simulate_step(&model, &h100, &l).map_err(anyhow::Error::msg)?;
        if json {
            println!(
                "{}",
                json!({"tp": tp, "pp": pp, "step_s": p.step_s, "mfu": p.mfu, "split": p.split, "memory_bytes": p.memory.total})
            );
        } else {
            println!(
                "70B on 64 H100s, tp {tp:>2} × pp {pp:>2}: step {:.2} s, tp comm {:.2} s, bubble {:.2} s, MFU {:.1}%, {:.0} GB a GPU",
                p.step_s, p.split.tp_comm, p.split.bubble, 100.0 * p.mfu, p.memory.total / 1e9
            );
        }
    }
    Ok(())
}

fn scaling(json: bool, svg: Option<PathBuf>) -> anyhow::Result<()> {
    let h100 = profile("h100-80gb").map_err(anyhow::Error::msg)?;
    let model = gpt_70b();
    let batch = 1024;
    if !json {
        println!(
            "GPT {:.1}B on H100-80GB, {batch} sequences of {} tokens a step; the fastest layout that fits:",
            model.params() / 1e9,
            model.seq
        );
    }
    let mut points = Vec::new();
    for gpus in [8, 64, 512, 4096, 16384] {
        let t0 = std::time::Instant::now();
        let (found, tried) = search(&model, &h100, gpus, batch, Precision::Bf16).map_err(anyhow::Error::msg)?;
        let took = t0.elapsed().as_secs_f64();
        match found.first() {
            None => {
                if json {
                    println!("{}", json!({"gpus": gpus, "tried": tried, "fits": 0}));
                } else {
                    println!("{gpus:>6} GPUs: none of {tried} layouts fits 80 GB");
                }
            }
            Some(c) => {
                let (l, p) = (&c.layout, &c.prediction);
                points.push((gpus as f64, p.tokens_per_s));
                if json {
                    println!(
                        "{}",
                        json!({"gpus": gpus, "tried": tried, "fits": found.len(), "layout": l, "tokens_per_s": p.tokens_per_s,
                        "mfu": p.mfu, "step_s": p.step_s, "memory_bytes": p.memory.total, "search_s": took})
                    );
                } else {
                    println!(
                        "{gpus:>6} GPUs: dp {} × tp {} × pp {} (v {}, mb {}, ZeRO-{}, {:?}): {:>10.0} tok/s, MFU {:.1}%, step {:.1} s, {:.0} GB; {} of {tried} fit ({:.0} ms)",
                        l.dp, l.tp, l.pp, l.interleave, l.micro_batch, l.zero, l.recompute, p.tokens_per_s, 100.0 * p.mfu, p.step_s,
                        p.memory.total / 1e9, found.len(), took * 1e3
                    );
                }
            }
        }
    }
    if let Some(path) = svg {
        let chart = LineChart::new("A 70B GPT on H100s: the fastest layout at each size", "GPUs", "tokens/s")
            .log2_x()
            .log_y()
            .series("simulated", points);
        std::fs::write(&path, chart.svg())?;
    }
    Ok(())
}

fn published(json: bool) -> anyhow::Result<()> {
    let a100 = profile("a100-80gb").map_err(anyhow::Error::msg)?;
    if !json {
        print!("{}", validate::report(&a100).map_err(anyhow::Error::msg)?);
        return Ok(());
    }
    for (r, p, e) in validate::predicted(&a100, validate::megatron_table_1()).map_err(anyhow::Error::msg)? {
        println!(
            "{}",
            json!({"model": r.name, "gpus": r.layout.gpus(), "published": r.tflops_per_gpu, "predicted": p.megatron_tflops_per_gpu, "error": e})
        );
    }
    Ok(())
}
