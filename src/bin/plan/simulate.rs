//! `plan --simulate`, `--search` and `--validate`: lesson 15's cluster simulator on the command
//! line (`shardlab::sim`).

use clap::Args;
use serde_json::json;
use shardlab::memory::Recompute;
use shardlab::pipeline::Schedule;
use shardlab::plot::{BarChart, Units};
use shardlab::precision::Precision;
use shardlab::sim::{profile, search, simulate_step, why_faster, Gpu, Layout, Model, Prediction};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct SimArgs {
    /// Simulate one step of a layout: memory per GPU, step time, tokens/s, MFU and where the
    /// time goes.
    #[arg(long)]
    simulate: bool,
    /// Rank every layout that fits memory by tokens/s.
    #[arg(long)]
    search: bool,
    /// Predict the published runs the simulator is checked against (Narayanan et al. 2021,
    /// Table 1) and time the simulator at 8, 1,024 and 16,384 GPUs.
    #[arg(long)]
    validate: bool,
    /// The GPU: a100-80gb, h100-80gb or h200 (figures and sources: `shardlab::sim::hardware`;
    /// default h100-80gb, and a100-80gb for --validate, the published runs' GPU). With
    /// --validate, `this-machine`: this machine's kernels and transport measured, then the
    /// simulator checked against `train` here (`sim::calibrate`).
    #[arg(long)]
    gpu: Option<String>,
    /// With --validate --gpu this-machine: `train` runs per layout (their median is the measurement).
    #[arg(long)]
    repeats: Option<usize>,
    /// GPUs in all (default: dp × tp × pp).
    #[arg(long)]
    gpus: Option<usize>,
    /// GPUs per node (default: the profile's, 8).
    #[arg(long)]
    gpus_per_node: Option<usize>,
    #[arg(long)]
    n_layer: Option<usize>,
    #[arg(long)]
    n_embd: Option<usize>,
    #[arg(long)]
    n_head: Option<usize>,
    /// The MLP's width (default 4 × n-embd).
    #[arg(long)]
    ffn: Option<usize>,
    #[arg(long, default_value_t = 2048)]
    block_size: usize,
    #[arg(long, default_value_t = 51200)]
    vocab_size: usize,
    /// Model chunks per pipeline rank (the interleaved 1F1B schedule; 1: plain).
    #[arg(long, default_value_t = 1)]
    interleave: usize,
    #[arg(long, default_value_t = 1)]
    micro_batch_size: usize,
    /// Sequences per step, all replicas together (default: 4·pp micro-batches per replica).
    #[arg(long)]
    global_batch_size: Option<usize>,
    /// 0 (DDP), 1, 2 or 3.
    #[arg(long, default_value_t = 0)]
    zero: u8,
    #[arg(long, value_enum, default_value = "bf16")]
    precision: Precision,
    /// Reduce gradients during the last backward instead of after it.
    #[arg(long)]
    overlap_grad_reduce: bool,
    /// Write the step's breakdown as an SVG bar chart here.
    #[arg(long)]
    svg: Option<PathBuf>,
}

impl SimArgs {
    pub fn wanted(&self) -> bool {
        self.simulate || self.search || self.validate
    }

    /// The simulator's own flags that were given (the memory planner takes none of them).
    pub fn given(&self) -> Vec<&'static str> {
        [
            ("--gpu", self.gpu.is_some()),
            ("--repeats", self.repeats.is_some()),
            ("--gpus", self.gpus.is_some()),
            ("--gpus-per-node", self.gpus_per_node.is_some()),
            ("--n-layer", self.n_layer.is_some()),
            ("--n-embd", self.n_embd.is_some()),
            ("--n-head", self.n_head.is_some()),
            ("--ffn", self.ffn.is_some()),
            ("--block-size", self.block_size != 2048),
            ("--vocab-size", self.vocab_size != 51200),
            ("--interleave", self.interleave != 1),
            ("--micro-batch-size", self.micro_batch_size != 1),
            ("--global-batch-size", self.global_batch_size.is_some()),
            ("--zero", self.zero != 0),
            ("--precision", self.precision != Precision::Bf16),
            ("--overlap-grad-reduce", self.overlap_grad_reduce),
            ("--svg", self.svg.is_some()),
        ]
        .into_iter()
        .filter_map(|(f, given)| given.then_some(f))
        .collect()
    }
}

/// The flags `plan` shares between its memory planner and the simulator.
pub struct Shared {
    pub dp: Option<u64>,
    pub tp: u64,
    pub pp: u64,
    pub sequence_parallel: bool,
    pub recompute: Recompute,
    pub schedule: Schedule,
    pub json: bool,
    /// The memory planner's own flags that were given (the simulator does not take them).
    pub planner_flags: Vec<&'static str>,
    /// The layout flags that were given (--search chooses the layout; --validate takes the
    /// published ones).
    pub layout_flags: Vec<&'static str>,
}

pub fn main(a: &SimArgs, s: &Shared) -> anyhow::Result<()> {
    anyhow::ensure!(
        [a.simulate, a.search, a.validate].iter().filter(|x| **x).count() == 1,
        "give one of --simulate, --search and --validate"
    );
    anyhow::ensure!(
        s.planner_flags.is_empty(),
        "{} {} the memory planner's; the simulator takes --n-layer --n-embd --n-head --ffn --block-size \
         --vocab-size, --micro-batch-size and --global-batch-size",
        s.planner_flags.join(", "),
        if s.planner_flags.len() == 1 { "is" } else { "are" }
    );
    anyhow::ensure!(
        !s.layout_flags.contains(&"--checkpointing"),
        "--checkpointing is the memory planner's; the simulator takes --recompute full"
    );
    let here = a.gpu.as_deref().is_some_and(|g| g.eq_ignore_ascii_case("this-machine"));
    anyhow::ensure!(
        a.repeats.is_none() || (a.validate && here),
        "--repeats is for --validate --gpu this-machine (the `train` runs per layout)"
    );
    anyhow::ensure!(
        !here || a.validate,
        "--gpu this-machine is measured for the model --validate trains here: run plan --validate --gpu this-machine"
    );
    // What a mode decides itself must not be given: it would be ignored.
    let mut chosen: Vec<&str> = s.layout_flags.clone();
    for (flag, given) in [
        ("--interleave", a.interleave != 1),
        ("--micro-batch-size", a.micro_batch_size != 1),
        ("--zero", a.zero != 0),
        ("--overlap-grad-reduce", a.overlap_grad_reduce),
        ("--svg", a.svg.is_some()),
    ] {
        if given {
            chosen.push(flag);
        }
    }
    if a.search || a.validate {
        anyhow::ensure!(
            chosen.is_empty(),
            "{} choose{} a layout: {} tries every one (or takes the published ones); drop {}",
            chosen.join(", "),
            if chosen.len() == 1 { "s" } else { "" },
            if a.search { "--search" } else { "--validate" },
            chosen.join(", ")
        );
    }
    if a.validate {
        let model_flags = [a.n_layer.is_some(), a.n_embd.is_some(), a.n_head.is_some(), a.ffn.is_some()];
        let defaults = a.block_size == 2048 && a.vocab_size == 51200 && a.precision == Precision::Bf16;
        anyhow::ensure!(
            !model_flags.contains(&true) && defaults && a.gpus.is_none() && a.global_batch_size.is_none(),
            "--validate simulates the published runs' models, precision and clusters (or this machine's): \
             it takes no model, --precision, --gpus or batch"
        );
        if here {
            anyhow::ensure!(a.gpus_per_node.is_none(), "--gpu this-machine runs two ranks here: drop --gpus-per-node");
            return super::validate::this_machine(a.repeats.unwrap_or(3), s.json);
        }
    }
    let default_gpu = if a.validate { "a100-80gb" } else { "h100-80gb" };
    let mut gpu = profile(a.gpu.as_deref().unwrap_or(default_gpu)).map_err(anyhow::Error::msg)?;
    if let Some(g) = a.gpus_per_node {
        gpu.gpus_per_node = g;
    }
    if a.validate {
        return super::validate::published(&gpu, s.json);
    }
    let model = match (a.n_layer, a.n_embd, a.n_head) {
        (Some(layers), Some(hidden), Some(heads)) => {
            Model { layers, hidden, heads, ffn: a.ffn.unwrap_or(4 * hidden), seq: a.block_size, vocab: a.vocab_size }
        }
        _ => anyhow::bail!("give the model: --n-layer --n-embd --n-head (and --ffn --block-size --vocab-size)"),
    };
    model.check().map_err(anyhow::Error::msg)?;
    let (tp, pp) = (s.tp as usize, s.pp as usize);
    if a.search {
        let gpus = a.gpus.ok_or_else(|| anyhow::anyhow!("--search needs --gpus"))?;
        let batch = a.global_batch_size.ok_or_else(|| anyhow::anyhow!("--search needs --global-batch-size"))?;
        return search_all(&model, &gpu, gpus, batch, a.precision, s.json);
    }
    let dp = match (s.dp, a.gpus) {
        (Some(dp), Some(n)) => {
            anyhow::ensure!(dp as usize * tp * pp == n, "--dp {dp} × --tp {tp} × --pp {pp} is not --gpus {n}");
            dp as usize
        }
        (Some(dp), None) => dp as usize,
        (None, Some(n)) => {
            anyhow::ensure!(n % (tp * pp) == 0, "--tp {tp} × --pp {pp} does not divide --gpus {n}");
            n / (tp * pp)
        }
        (None, None) => 1,
    };
    let mut l = Layout::new(dp, tp, pp);
    l.interleave = a.interleave;
    l.micro_batch = a.micro_batch_size;
    l.global_batch = a.global_batch_size.unwrap_or(dp * a.micro_batch_size * if pp > 1 { 4 * pp } else { 1 });
    l.zero = a.zero;
    l.sequence_parallel = s.sequence_parallel;
    l.recompute = s.recompute;
    l.precision = a.precision;
    l.schedule = s.schedule;
    l.overlap_grad_reduce = a.overlap_grad_reduce;
    let p = simulate_step(&model, &gpu, &l).map_err(anyhow::Error::msg)?;
    if let Some(path) = &a.svg {
        let names = ["compute", "tp comm", "pp comm", "bubble", "exposed dp", "optimizer"];
        let parts = shardlab::sim::search::parts(&p.split).map(|(_, t)| t).to_vec();
        let chart = BarChart::new(&format!("One step, {:.2} s: where the time goes", p.step_s), "seconds", &names)
            .y_units(Units::Plain)
            .series(&layout_name(&l), parts);
        std::fs::write(path, chart.svg())?;
    }
    if s.json {
        println!("{}", prediction_json(&model, &gpu, &l, &p));
        return Ok(());
    }
    println!(
        "{} on {} × {} ({} a node): {}",
        model_name(&model),
        l.gpus(),
        gpu.name,
        gpu.gpus_per_node,
        layout_name(&l)
    );
    println!(
        "  {} micro-batches of {} per replica, global batch {} sequences of {} tokens",
        l.micro_batches(),
        l.micro_batch,
        l.global_batch,
        model.seq
    );
    print_prediction(&p, gpu.memory_bytes);
    Ok(())
}

fn model_name(m: &Model) -> String {
    format!(
        "GPT {:.1}B (L {} h {} a {} ffn {} s {} V {})",
        m.params() / 1e9,
        m.layers,
        m.hidden,
        m.heads,
        m.ffn,
        m.seq,
        m.vocab
    )
}

fn layout_name(l: &Layout) -> String {
    let mut s = format!("dp {} × tp {} × pp {}", l.dp, l.tp, l.pp);
    if l.interleave > 1 {
        s += &format!(" (v {})", l.interleave);
    }
    if l.zero > 0 {
        s += &format!(", ZeRO-{}", l.zero);
    }
    if l.sequence_parallel {
        s += ", sp";
    }
    s += &format!(", mb {}, recompute {:?}", l.micro_batch, l.recompute).to_lowercase();
    s
}

fn print_prediction(p: &Prediction, device: f64) {
    println!(
        "  step {:.3} s · {:.0} tokens/s · MFU {:.1}% · {:.1} TFLOP/s per GPU computed (Megatron's count: recompute included)",
        p.step_s,
        p.tokens_per_s,
        100.0 * p.mfu,
        p.megatron_tflops_per_gpu
    );
    println!(
        "  memory per GPU {:.1} GB of {:.0}: model states {:.1}, activations {:.1}{}",
        p.memory.total / 1e9,
        device / 1e9,
        p.memory.model_states / 1e9,
        p.memory.activations / 1e9,
        if p.fits { "" } else { "  — DOES NOT FIT" }
    );
    println!("  where the step goes:");
    for (name, t) in shardlab::sim::search::parts(&p.split) {
        println!("    {name:<16} {:>9.4} s  {:>5.1}%", t, 100.0 * t / p.step_s);
    }
    print_tp_parts(p);
}

/// Of tensor parallelism's collectives, those at the model's two ends, and what the simulator
/// leaves out (`sim::tp_comm`).
pub fn print_tp_parts(p: &Prediction) {
    if p.split.tp_comm > 0.0 {
        println!(
            "    (tp comm: {:.2} ms at the model's ends — embedding, output layer, loss; not charged: {:.2} ms of \
             sequence parallelism's re-gathers and small gradient all-reduces)",
            p.tp_ends_s * 1e3,
            p.tp_uncharged_s * 1e3
        );
    }
}

fn prediction_json(m: &Model, gpu: &Gpu, l: &Layout, p: &Prediction) -> serde_json::Value {
    json!({
        "model": m, "params": m.params(), "gpu": gpu.name, "gpus_per_node": gpu.gpus_per_node, "layout": l,
        "step_s": p.step_s, "tokens_per_s": p.tokens_per_s, "mfu": p.mfu,
        "megatron_tflops_per_gpu": p.megatron_tflops_per_gpu,
        "memory_per_gpu_bytes": p.memory.total, "memory": p.memory, "fits": p.fits, "split": p.split,
        "tp_ends_s": p.tp_ends_s, "tp_uncharged_s": p.tp_uncharged_s,
    })
}

fn search_all(
    model: &Model,
    gpu: &Gpu,
    gpus: usize,
    batch: usize,
    precision: Precision,
    json: bool,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let (found, tried) = search(model, gpu, gpus, batch, precision).map_err(anyhow::Error::msg)?;
    let took = t0.elapsed().as_secs_f64();
    if json {
        let top: Vec<_> =
            found.iter().take(20).map(|c| prediction_json(model, gpu, &c.layout, &c.prediction)).collect();
        println!("{}", json!({"tried": tried, "fit": found.len(), "seconds": took, "top": top}));
        return Ok(());
    }
    println!(
        "{} on {gpus} × {}, global batch {batch}: {tried} layouts simulated in {took:.2} s, {} fit {:.0} GB",
        model_name(model),
        gpu.name,
        found.len(),
        gpu.memory_bytes / 1e9
    );
    anyhow::ensure!(!found.is_empty(), "no layout fits: more GPUs, or a smaller model or batch");
    for (i, c) in found.iter().take(10).enumerate() {
        let p = &c.prediction;
        let why = match found.get(i + 1) {
            Some(next) => format!("  beats #{}: {}", i + 2, why_faster(c, next)),
            None => String::new(),
        };
        println!(
            "{:>3}. {:<52} {:>10.0} tok/s  MFU {:>4.1}%  {:>5.1} GB{}",
            i + 1,
            layout_name(&c.layout),
            p.tokens_per_s,
            100.0 * p.mfu,
            p.memory.total / 1e9,
            why
        );
    }
    Ok(())
}
