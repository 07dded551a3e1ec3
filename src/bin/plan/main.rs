//! `plan` — the memory planner: model-state memory per device for DDP and ZeRO stages 1–3,
//! activation memory for a transformer shape, and how many devices of a given size are needed;
//! with tensor, sequence and pipeline parallelism (lessons 12–13; Korthikanti et al. 2022).
//!
//! ```text
//! cargo run --release --bin plan -- --params 7.5e9 --dp 64
//! cargo run --release --bin plan -- --params 70e9 --dp 8 --layers 80 --hidden 8192 --heads 64 --seq 4096 --device-gb 80 --json
//! cargo run --release --bin plan -- --params 175e9 --dp 8 --tp 8 --pp 8 --layers 96 --hidden 12288 --heads 96 --seq 2048 --sequence-parallel --recompute selective
//! ```
//!
//! With `--simulate`, `--search` or `--validate`, lesson 15's cluster simulator (`shardlab::sim`,
//! see `simulate.rs` and `validate.rs` beside this file): step time, tokens/s, MFU and memory for a
//! layout of any GPT on thousands of GPUs.
//!
//! ```text
//! cargo run --release --bin plan -- --simulate --gpu h100-80gb --n-layer 80 --n-embd 8192 --n-head 64 --ffn 28672 --block-size 4096 --gpus 1024 --tp 8 --pp 4 --global-batch-size 1024 --sequence-parallel --recompute selective
//! cargo run --release --bin plan -- --search --gpu h100-80gb --n-layer 80 --n-embd 8192 --n-head 64 --ffn 28672 --block-size 4096 --gpus 1024 --global-batch-size 1024
//! cargo run --release --bin plan -- --validate
//! cargo run --release --bin plan -- --validate --gpu this-machine
//! ```
//!
//! Accounting: the ZeRO paper's (16-bit weights and gradients, K = 12 bytes of Adam state per
//! parameter: fp32 master copy, momentum, variance); see `shardlab::memory`.

use clap::Parser;
use serde_json::json;
use shardlab::memory::{
    devices_needed, model_state_bytes, stage_activation_bytes, Recompute, TransformerShape, K_MIXED_ADAM,
};
use shardlab::pipeline::Schedule;

mod simulate;
mod validate;

#[derive(Parser, Debug)]
#[command(about = "Per-device memory for DDP and ZeRO-1/2/3 (ZeRO paper accounting); with --simulate, \
                   --search or --validate, lesson 15's cluster simulator")]
struct Args {
    /// Number of parameters (default: the ZeRO paper's 7.5e9 example).
    #[arg(long)]
    params: Option<f64>,
    /// Data-parallel degree (devices; default 64 with the paper's example, else 1).
    #[arg(long)]
    dp: Option<u64>,
    /// Tensor-parallel degree (lesson 12): each device holds Ψ/(tp·pp) parameters.
    #[arg(long, default_value_t = 1)]
    tp: u64,
    /// Pipeline-parallel degree (lesson 13).
    #[arg(long, default_value_t = 1)]
    pp: u64,
    /// With --tp: sequence parallelism (LayerNorm and dropout regions sharded along the sequence).
    #[arg(long)]
    sequence_parallel: bool,
    /// What a layer keeps for its backward: none (recompute nothing), selective (recompute the
    /// attention's s × s matrices) or full (keep only the layer's input).
    #[arg(long, value_enum, default_value = "none")]
    recompute: Recompute,
    /// With --pp: micro-batches per step (default: pp), and the schedule.
    #[arg(long)]
    micro_batches: Option<u64>,
    #[arg(long, value_enum, default_value = "1f1b")]
    schedule: Schedule,
    /// Optimizer-state bytes per parameter (12: mixed-precision Adam).
    #[arg(long, default_value_t = K_MIXED_ADAM)]
    k: f64,
    /// Transformer shape for activation memory (all five or none).
    #[arg(long)]
    layers: Option<f64>,
    #[arg(long)]
    hidden: Option<f64>,
    #[arg(long)]
    heads: Option<f64>,
    #[arg(long)]
    seq: Option<f64>,
    #[arg(long, default_value_t = 1.0)]
    micro_batch: f64,
    /// Device memory in GB (1e9 bytes) for the "devices needed" answer.
    #[arg(long)]
    device_gb: Option<f64>,
    /// Full activation checkpointing (the same as --recompute full).
    #[arg(long)]
    checkpointing: bool,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    sim: simulate::SimArgs,
}

fn gb(b: f64) -> String {
    format!("{:.2} GB", b / 1e9)
}

fn main() -> anyhow::Result<()> {
    shardlab::job::run_one_if_asked();
    let mut a = Args::parse();
    if a.sim.wanted() {
        let shared = simulate::Shared {
            dp: a.dp,
            tp: a.tp,
            pp: a.pp,
            sequence_parallel: a.sequence_parallel,
            recompute: a.recompute,
            schedule: a.schedule,
            json: a.json,
            planner_flags: [
                ("--params", a.params.is_some()),
                ("--layers", a.layers.is_some()),
                ("--hidden", a.hidden.is_some()),
                ("--heads", a.heads.is_some()),
                ("--seq", a.seq.is_some()),
                ("--micro-batches", a.micro_batches.is_some()),
                ("--micro-batch", a.micro_batch != 1.0),
                ("--k", a.k != K_MIXED_ADAM),
                ("--device-gb", a.device_gb.is_some()),
            ]
            .into_iter()
            .filter_map(|(f, given)| given.then_some(f))
            .collect(),
            layout_flags: [
                ("--dp", a.dp.is_some()),
                ("--tp", a.tp != 1),
                ("--pp", a.pp != 1),
                ("--sequence-parallel", a.sequence_parallel),
                ("--recompute", a.recompute != Recompute::None),
                ("--checkpointing", a.checkpointing),
                ("--schedule", a.schedule != Schedule::OneFOneB),
            ]
            .into_iter()
            .filter_map(|(f, given)| given.then_some(f))
            .collect(),
        };
        return simulate::main(&a.sim, &shared);
    }
    let sim_only = a.sim.given();
    anyhow::ensure!(
        sim_only.is_empty(),
        "{} {} the simulator's: add --simulate, --search or --validate (without them `plan` is the memory planner)",
        sim_only.join(", "),
        if sim_only.len() == 1 { "is" } else { "are" }
    );
    if a.params.is_none() {
        println!(
            "(no --params: the ZeRO paper's example, 7.5e9 parameters on 64 devices; \
             `plan --params 70e9 --dp 8` for your own model)\n"
        );
        a.params = Some(7.5e9);
        a.dp = Some(a.dp.unwrap_or(64));
    }
    let (params, dp) = (a.params.unwrap_or(7.5e9), a.dp.unwrap_or(1));
    anyhow::ensure!(params.is_finite() && params > 0.0, "--params must be a positive number");
    anyhow::ensure!(dp >= 1 && a.tp >= 1 && a.pp >= 1, "--dp, --tp and --pp must be at least 1");
    anyhow::ensure!(a.k >= 0.0, "--k must not be negative");
    anyhow::ensure!(
        !a.sequence_parallel || a.tp > 1,
        "--sequence-parallel shards over the tensor-parallel group: give --tp"
    );
    if a.checkpointing {
        anyhow::ensure!(a.recompute != Recompute::Selective, "--checkpointing is --recompute full, not selective");
        a.recompute = Recompute::Full;
    }
    anyhow::ensure!(
        a.pp > 1 || (a.micro_batches.is_none() && a.schedule == Schedule::OneFOneB),
        "--micro-batches and --schedule shape a pipeline: give --pp too"
    );
    let m = a.micro_batches.unwrap_or(a.pp);
    anyhow::ensure!(m >= 1, "--micro-batches must be at least 1");
    // Each device holds 1/(tp·pp) of the model (replicated LayerNorms and biases, and the
    // embeddings' placement, aside); ZeRO shards that over dp.
    let local = params / (a.tp * a.pp) as f64;
    let s = model_state_bytes(local, dp as f64, a.k);
    let shape = match (a.layers, a.hidden, a.heads, a.seq) {
        (Some(layers), Some(hidden), Some(heads), Some(seq)) => {
            Some(TransformerShape { layers, hidden, heads, seq, micro_batch: a.micro_batch })
        }
        (None, None, None, None) => None,
        _ => anyhow::bail!("give all of --layers --hidden --heads --seq for activation memory, or none"),
    };
    if let Some(t) = &shape {
        anyhow::ensure!(t.layers >= a.pp as f64, "--pp {} is more stages than --layers {}", a.pp, t.layers);
    }
    let (tp, pp) = (a.tp as f64, a.pp as f64);
    let acts = shape.map(|t| {
        let at = |r| stage_activation_bytes(&t, tp, a.sequence_parallel, r, pp, a.schedule.in_flight(pp, m as f64));
        (at(Recompute::None), at(Recompute::Full), at(a.recompute))
    });
    let act_used = acts.map(|(_, _, used)| used).unwrap_or(0.0);
    // Devices: dp replicas of a tp × pp model; the search is over dp.
    let needed = a.device_gb.map(|g| devices_needed(local, a.k, act_used, g * 1e9, 1 << 20));
    let devices = |dp: u64| dp * a.tp * a.pp;
    if a.json {
        let mut v = json!({
            "params": params, "dp": dp, "tp": a.tp, "pp": a.pp, "k": a.k,
            "bytes_per_device": {"ddp": s.ddp, "zero1": s.zero1, "zero2": s.zero2, "zero3": s.zero3},
        });
        if let Some((full, ckpt, used)) = acts {
            v["activation_bytes"] = json!({"no_checkpointing": full, "checkpointing": ckpt,
                "recompute": a.recompute, "sequence_parallel": a.sequence_parallel, "used": used,
                "micro_batches": m, "schedule": a.schedule});
        }
        if let (Some(n), Some(g)) = (needed, a.device_gb) {
            let d = |x: Option<u64>| x.map(devices);
            v["devices_needed"] = json!({"device_gb": g, "checkpointing": a.recompute == Recompute::Full,
                "recompute": a.recompute, "ddp": d(n[0]), "zero1": d(n[1]), "zero2": d(n[2]), "zero3": d(n[3])});
        }
        println!("{v}");
        return Ok(());
    }
    println!(
        "{:.3e} parameters, {} data-parallel devices, K = {} bytes of optimizer state per parameter",
        params, dp, a.k
    );
    if a.tp * a.pp > 1 {
        println!(
            "dp {dp} × tp {} × pp {} = {} devices; each holds Ψ/(tp·pp) = {:.3e} parameters (ZeRO shards them over dp)",
            a.tp,
            a.pp,
            devices(dp),
            local
        );
    }
    println!("model states per device:");
    println!("  DDP     (2+2+K)Ψ        {:>12}", gb(s.ddp));
    println!("  ZeRO-1  4Ψ + KΨ/N       {:>12}", gb(s.zero1));
    println!("  ZeRO-2  2Ψ + (2+K)Ψ/N   {:>12}", gb(s.zero2));
    println!("  ZeRO-3  (2+2+K)Ψ/N      {:>12}", gb(s.zero3));
    if let Some((full, ckpt, used)) = acts {
        println!(
            "activations per device: {} without recompute{}, {} with full activation checkpointing",
            gb(full),
            if a.sequence_parallel { " (sequence parallel)" } else { "" },
            gb(ckpt)
        );
        if a.tp * a.pp > 1 || a.recompute == Recompute::Selective {
            println!(
                "  as planned ({}{}, recompute {:?}{}): {}",
                if a.tp > 1 { format!("tp {}", a.tp) } else { "no tp".into() },
                if a.sequence_parallel { " + sequence parallel" } else { "" },
                a.recompute,
                if a.pp > 1 {
                    format!(", pp {} stage 0 with {m} micro-batches, {:?}", a.pp, a.schedule)
                } else {
                    String::new()
                },
                gb(used)
            );
        }
    }
    if let (Some(n), Some(g)) = (needed, a.device_gb) {
        let show = |x: Option<u64>| x.map(|v| v.to_string()).unwrap_or_else(|| "does not fit".into());
        let show = |x: Option<u64>| show(x.map(devices));
        println!(
            "devices of {g} GB needed (model states + activations{}{}): DDP {}, ZeRO-1 {}, ZeRO-2 {}, ZeRO-3 {}",
            match a.recompute {
                Recompute::Full => ", checkpointed",
                Recompute::Selective => ", selective recompute",
                Recompute::None => "",
            },
            if a.tp * a.pp > 1 { format!(", in multiples of tp·pp = {}", a.tp * a.pp) } else { String::new() },
            show(n[0]),
            show(n[1]),
            show(n[2]),
            show(n[3])
        );
    }
    Ok(())
}
