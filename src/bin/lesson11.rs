//! Lesson 11 demo — GPUs, NCCL and CPU offload: what this machine has, what MFU means for
//! GPT-2-sized models, and CPU offload measured (ZeRO-2 and ZeRO-3 with and without it).
//!
//!   cargo run --release --bin lesson11                    # CPU here: offload's bookkeeping, fp32
//!   cargo run --release --bin lesson11 -- --device cuda   # on a GPU machine: bf16, GPU bytes
//!   cargo run --release --bin lesson11 -- --json          # one JSON object per line (the notebook)
//!
//! Offload runs are `train`'s job in fresh processes (`job::run_isolated`), TCP ranks: every
//! figure is measured from the run — bytes from the tensors each rank holds (`MemoryStats`:
//! `offloaded` is what lives in host memory), copies from the bytes each copy moved
//! (`DdpStats::d2h_bytes`/`h2d_bytes`), time from the median step.

use clap::Parser;
use serde_json::json;
use shardlab::ddp::Variant;
use shardlab::device::{self, DeviceChoice};
use shardlab::flops;
use shardlab::job::{self, DataSource, GptJob, OneRun};
use shardlab::prelude::*;

#[derive(Parser, Debug)]
#[command(about = "Lesson 11: GPUs, NCCL and CPU offload — the machine, MFU, offload measured")]
struct Args {
    /// Where the offload runs compute (cuda: one GPU per rank, shared round-robin by the tcp backend).
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceChoice,
    /// Compute precision [default: bf16 on a GPU, fp32 on the CPU, where bf16 matmuls are slow].
    #[arg(long, value_enum)]
    precision: Option<Precision>,
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    #[arg(long, default_value_t = 6)]
    steps: u64,
    #[arg(long, default_value_t = 4)]
    n_layer: i64,
    #[arg(long, default_value_t = 512)]
    n_embd: i64,
    #[arg(long)]
    json: bool,
}

fn main() -> anyhow::Result<()> {
    job::run_one_if_asked();
    let a = Args::parse();
    anyhow::ensure!(a.world_size >= 1 && a.steps >= 3, "need --world-size ≥ 1 and --steps ≥ 3");
    let on_gpu = device::resolve(a.device, 0)?.is_cuda();
    let precision = a.precision.unwrap_or(if on_gpu { Precision::Bf16 } else { Precision::Fp32 });

    // 1. The machine.
    let gpus = device::cuda_devices();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let torch_cuda = maps.contains("libtorch_cuda");
    let nccl = shardlab::comm::nccl::Lib::get().and_then(|l| l.version());
    if a.json {
        println!(
            "{}",
            json!({"section": "machine", "cuda_devices": gpus, "libtorch_cuda_loaded": torch_cuda,
                   "nccl_version": nccl.as_ref().ok(), "nccl_error": nccl.as_ref().err().map(|e| e.to_string())})
        );
    } else {
        println!("This machine:");
        println!(
            "  libtorch_cuda.so {} this process; libtorch sees {gpus} CUDA device(s)",
            if torch_cuda { "is loaded in" } else { "is NOT loaded in (a CPU-only libtorch, or not linked)" }
        );
        match &nccl {
            Ok(v) => println!(
                "  NCCL {}.{}.{} loads (the nccl backend can start where there is a GPU)",
                v / 10000,
                v / 100 % 100,
                v % 100
            ),
            Err(e) => println!("  NCCL does not load: {e}"),
        }
    }

    // 2. MFU: the FLOPs a GPT-2 step needs, and the tokens/s that 40% MFU on 8 × H100 means.
    let sizes = [
        ("gpt2 124M", 12, 12, 768),
        ("gpt2-medium 350M", 24, 16, 1024),
        ("gpt2-large 774M", 36, 20, 1280),
        ("gpt2-xl 1.5B", 48, 25, 1600),
    ];
    let peak = flops::peak_tflops("NVIDIA H100 80GB HBM3", Precision::Bf16).expect("H100 is in the table");
    if !a.json {
        println!("\nModel FLOPs per token (6N + 12·L·C·T, T = 1024) and what 40% MFU on 8 × H100 ({peak} TFLOP/s bf16 each) is:");
        println!(
            "  {:<18} {:>13} {:>15} {:>15} {:>17}",
            "model", "N (no wpe)", "GFLOP/token", "attention %", "tokens/s @ 40%"
        );
    }
    for (name, l, h, c) in sizes {
        let cfg = GptConfig { vocab_size: 50257, block_size: 1024, n_layer: l, n_head: h, n_embd: c };
        let (n, f) = (flops::matmul_params(&cfg), flops::flops_per_token(&cfg));
        let attn = 12.0 * (l * c * 1024) as f64 / f;
        let tps = 0.4 * 8.0 * peak * 1e12 / f;
        if a.json {
            println!(
                "{}",
                json!({"section": "mfu", "model": name, "matmul_params": n, "flops_per_token": f, "attention_fraction": attn, "tokens_per_s_at_40pct_8xh100": tps})
            );
        } else {
            println!("  {name:<18} {n:>13.0} {:>15.3} {:>14.1}% {tps:>17.0}", f / 1e9, 100.0 * attn);
        }
    }

    // 3. CPU offload, measured.
    let cfg = GptConfig { vocab_size: 4096, block_size: 64, n_layer: a.n_layer, n_head: 8, n_embd: a.n_embd };
    cfg.validate()?;
    let psi = cfg.num_params() as f64;
    let job = GptJob {
        model: cfg,
        batch_size: 4,
        accum: 1,
        steps: a.steps,
        warmup: 2,
        optim: AdamWConfig::default(),
        lr_schedule: None,
        grad_clip: None,
        data: DataSource::Synthetic { tokens: 100_000, seed: 1 },
        seed: 1,
        init: None,
        save: None,
        checkpoint: Default::default(),
        eval: Default::default(),
    };
    if !a.json {
        println!(
            "\nCPU offload: GPT of {:.1} M parameters (Ψ), {} ranks (TCP processes) on {}, {}, {} steps; rank 0:",
            psi / 1e6,
            a.world_size,
            if on_gpu { "cuda" } else { "the CPU" },
            precision.name(),
            a.steps
        );
        println!(
            "  {:<15} {:>14} {:>12} {:>13} {:>13} {:>12} {:>12}",
            "", "on device MB", "in host MB", "down MB/step", "up MB/step", "step ms", "final loss"
        );
    }
    for strategy in [Strategy::Zero2, Strategy::Zero3] {
        for offload in [false, true] {
            let r = job::run_isolated(&OneRun {
                job: job.clone(),
                strategy,
                world_size: a.world_size,
                backend: Backend::Tcp,
                variant: Variant::Bucketed,
                bucket_cap_bytes: shardlab::ddp::DEFAULT_BUCKET_CAP_BYTES,
                threads: Some(1),
                checkpointing: Checkpointing::None,
                reshard_after_forward: true,
                precision,
                reduce_dtype: Precision::Fp32,
                offload,
                device: a.device,
                tp: 1,
                pp: Default::default(),
            })?;
            let (m, st) = (r.memory, r.ddp);
            let per_step = |b: u64| b as f64 / a.steps as f64 / 1e6;
            let name = format!("{}{}", format!("{strategy:?}").to_lowercase(), if offload { " + offload" } else { "" });
            if a.json {
                println!(
                    "{}",
                    json!({"section": "offload", "strategy": format!("{strategy:?}").to_lowercase(), "offload": offload,
                           "params": psi, "world_size": a.world_size, "precision": precision.name(), "device": if on_gpu { "cuda" } else { "cpu" },
                           "device_model_state_bytes": m.model_states(), "params_bytes": m.params, "grads_bytes": m.grads,
                           "optim_bytes": m.optim, "host_bytes": m.offloaded, "peak_transient_bytes": m.peak_transient,
                           "d2h_bytes_per_step": per_step(st.d2h_bytes) * 1e6, "h2d_bytes_per_step": per_step(st.h2d_bytes) * 1e6,
                           "median_step_s": r.median_step_s, "final_loss": r.final_loss, "cuda": r.cuda})
                );
            } else {
                let gpu = r.cuda.as_ref().map_or(String::new(), |c| {
                    format!(
                        "  ({}: {:.2} GiB in use on it, all processes)",
                        c.name,
                        c.used_bytes as f64 / (1u64 << 30) as f64
                    )
                });
                println!(
                    "  {name:<15} {:>14.2} {:>12.2} {:>13.2} {:>13.2} {:>12.1} {:>12.6}{gpu}",
                    m.model_states() as f64 / 1e6,
                    m.offloaded as f64 / 1e6,
                    per_step(st.d2h_bytes),
                    per_step(st.h2d_bytes),
                    r.median_step_s * 1e3,
                    r.final_loss
                );
            }
        }
    }
    if !a.json {
        let elt = precision.kind().elt_size_in_bytes() as f64;
        let n = a.world_size as f64;
        let masters = if precision == Precision::Fp32 { 0.0 } else { 4.0 * psi / n }; // f32 masters apart from bf16 params
        println!(
            "  model, ZeRO-2: without offload the device keeps {:.2} MB ({:.0}Ψ working parameters{} + 4Ψ/N gradient shard + 8Ψ/N \
             AdamW); with offload {:.2} MB ({:.0}Ψ) and the host 16Ψ/N = {:.2} MB (f32 masters, gradient shards, AdamW m and v).",
            (elt * psi + masters + 12.0 * psi / n) / 1e6,
            elt,
            if masters > 0.0 { " + 4Ψ/N f32 masters" } else { "" },
            elt * psi / 1e6,
            elt,
            16.0 * psi / n / 1e6
        );
        println!(
            "  down: the f32 gradient shard each step (4Ψ/N = {:.2} MB); up: the parameter shard in {} (ZeRO-2: {:.2} MB; ZeRO-3: once per gather).",
            4.0 * psi / n / 1e6,
            precision.name(),
            elt * psi / n / 1e6
        );
        if !on_gpu {
            println!(
                "  On the CPU, \"device\" and host are the same memory: this measures offload's bookkeeping and the cost of its \
                 copies, not GPU bytes saved. On a GPU: --device cuda (and bash .ci/gpu)."
            );
        }
    }
    Ok(())
}
