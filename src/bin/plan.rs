//! `plan` — the memory planner: model-state memory per device for DDP and ZeRO stages 1–3,
//! activation memory for a transformer shape, and how many devices of a given size are needed.
//!
//! ```text
//! cargo run --release --bin plan -- --params 7.5e9 --dp 64
//! cargo run --release --bin plan -- --params 70e9 --dp 8 --layers 80 --hidden 8192 --heads 64 --seq 4096 --device-gb 80 --json
//! ```
//!
//! Accounting: the ZeRO paper's (16-bit weights and gradients, K = 12 bytes of Adam state per
//! parameter: fp32 master copy, momentum, variance); see `shardlab::memory`.

use clap::Parser;
use serde_json::json;
use shardlab::memory::{activation_bytes, devices_needed, model_state_bytes, TransformerShape, K_MIXED_ADAM};

#[derive(Parser, Debug)]
#[command(about = "Per-device memory for DDP and ZeRO-1/2/3 (ZeRO paper accounting)")]
struct Args {
    /// Number of parameters (default: the ZeRO paper's 7.5e9 example).
    #[arg(long)]
    params: Option<f64>,
    /// Data-parallel degree (devices; default 64 with the paper's example, else 1).
    #[arg(long)]
    dp: Option<u64>,
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
    /// Use activation checkpointing for the "devices needed" answer.
    #[arg(long)]
    checkpointing: bool,
    #[arg(long)]
    json: bool,
}

fn gb(b: f64) -> String {
    format!("{:.2} GB", b / 1e9)
}

fn main() -> anyhow::Result<()> {
    let mut a = Args::parse();
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
    anyhow::ensure!(dp >= 1, "--dp must be at least 1");
    anyhow::ensure!(a.k >= 0.0, "--k must not be negative");
    let s = model_state_bytes(params, dp as f64, a.k);
    let shape = match (a.layers, a.hidden, a.heads, a.seq) {
        (Some(layers), Some(hidden), Some(heads), Some(seq)) => {
            Some(TransformerShape { layers, hidden, heads, seq, micro_batch: a.micro_batch })
        }
        (None, None, None, None) => None,
        _ => anyhow::bail!("give all of --layers --hidden --heads --seq for activation memory, or none"),
    };
    let acts = shape.map(|t| activation_bytes(&t));
    let act_used = acts.map(|(full, ckpt)| if a.checkpointing { ckpt } else { full }).unwrap_or(0.0);
    let needed = a.device_gb.map(|g| devices_needed(params, a.k, act_used, g * 1e9, 1 << 20));
    if a.json {
        let mut v = json!({
            "params": params, "dp": dp, "k": a.k,
            "bytes_per_device": {"ddp": s.ddp, "zero1": s.zero1, "zero2": s.zero2, "zero3": s.zero3},
        });
        if let Some((full, ckpt)) = acts {
            v["activation_bytes"] = json!({"no_checkpointing": full, "checkpointing": ckpt});
        }
        if let (Some(n), Some(g)) = (needed, a.device_gb) {
            v["devices_needed"] = json!({"device_gb": g, "checkpointing": a.checkpointing,
                "ddp": n[0], "zero1": n[1], "zero2": n[2], "zero3": n[3]});
        }
        println!("{v}");
        return Ok(());
    }
    println!(
        "{:.3e} parameters, {} data-parallel devices, K = {} bytes of optimizer state per parameter",
        params, dp, a.k
    );
    println!("model states per device:");
    println!("  DDP     (2+2+K)Ψ        {:>12}", gb(s.ddp));
    println!("  ZeRO-1  4Ψ + KΨ/N       {:>12}", gb(s.zero1));
    println!("  ZeRO-2  2Ψ + (2+K)Ψ/N   {:>12}", gb(s.zero2));
    println!("  ZeRO-3  (2+2+K)Ψ/N      {:>12}", gb(s.zero3));
    if let Some((full, ckpt)) = acts {
        println!(
            "activations per device: {} without checkpointing, {} with full activation checkpointing",
            gb(full),
            gb(ckpt)
        );
    }
    if let (Some(n), Some(g)) = (needed, a.device_gb) {
        let show = |x: Option<u64>| x.map(|v| v.to_string()).unwrap_or_else(|| "does not fit".into());
        println!(
            "devices of {g} GB needed (model states + activations{}): DDP {}, ZeRO-1 {}, ZeRO-2 {}, ZeRO-3 {}",
            if a.checkpointing { ", checkpointed" } else { "" },
            show(n[0]),
            show(n[1]),
            show(n[2]),
            show(n[3])
        );
    }
    Ok(())
}
