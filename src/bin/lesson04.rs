//! Lesson 04 demo — toy DDP trains exactly like one process.
//!
//!   cargo run --release --bin lesson04 -- --world-size 4 --backend tcp --steps 20
//!
//! Trains the same small GPT twice on the synthetic arithmetic corpus: N data-parallel ranks
//! (naive DDP: broadcast the initial weights, each rank its slice of the global batch, gradients
//! all-reduced and averaged), then one process on the whole global batch. Prints both loss
//! curves side by side and the largest difference between the final weights.

use clap::Parser;
use serde_json::json;
use shardlab::ddp::Variant;
use shardlab::job::{self, DataSource, GptJob};
use shardlab::prelude::*;

#[derive(Parser, Debug)]
#[command(about = "Lesson 04: N-rank toy DDP vs one process on the concatenated batch")]
struct Args {
    #[arg(long, default_value_t = 4)]
    world_size: usize,
    #[arg(long, value_enum, default_value = "tcp")]
    backend: Backend,
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// Global batch (sequences per step over all ranks); a multiple of the world size.
    #[arg(long, default_value_t = 16)]
    global_batch: usize,
    #[arg(long)]
    json: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.world_size >= 1, "--world-size must be at least 1");
    anyhow::ensure!(args.steps >= 2, "--steps must be at least 2");
    anyhow::ensure!(
        args.global_batch % args.world_size == 0,
        "--global-batch ({}) must be a multiple of --world-size ({})",
        args.global_batch,
        args.world_size
    );
    // The driver's pid names the folder; rank processes (its children) find it through theirs.
    let pid =
        if shardlab::launch::is_spawned_child() { std::os::unix::process::parent_id() } else { std::process::id() };
    let dir = std::env::temp_dir().join(format!("shardlab-lesson04-{pid}"));
    std::fs::create_dir_all(&dir)?;
    let mk = |n: usize, save: &str| GptJob {
        model: GptConfig { vocab_size: 16, block_size: 32, n_layer: 2, n_head: 2, n_embd: 64 },
        batch_size: args.global_batch / n,
        accum: 1,
        steps: args.steps,
        warmup: 1.min(args.steps.saturating_sub(1)),
        optim: AdamWConfig { lr: 3e-3, ..AdamWConfig::default() },
        lr_schedule: None,
        grad_clip: None,
        data: DataSource::Synthetic { tokens: 200_000, seed: 1 },
        seed: 1,
        init: None,
        save: Some(dir.join(save)),
        checkpoint: Default::default(),
        eval: Default::default(),
    };
    // Process ranks re-run this program up to the first fit: the data-parallel run comes first.
    let ddp = mk(args.world_size, "ddp.safetensors");
    let ddp_run =
        ddp.fit(job::scaling(Strategy::Ddp, args.world_size, args.backend, Variant::Naive, 0), false, false)?;
    let single = mk(1, "single.safetensors");
    let single_run = single.fit(job::scaling(Strategy::Single, 1, Backend::Local, Variant::Naive, 0), false, false)?;
    // Compare the saved weights.
    let a = Tensor::read_safetensors(dir.join("ddp.safetensors"))?;
    let b: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.join("single.safetensors"))?.into_iter().collect();
    let max_diff = a.iter().map(|(k, t)| (t - &b[k]).abs().max().double_value(&[])).fold(0.0, f64::max);
    let _ = std::fs::remove_dir_all(&dir);
    if args.json {
        for (i, (d, s)) in ddp_run.losses.iter().zip(&single_run.losses).enumerate() {
            println!("{}", json!({"step": i, "ddp_loss": d, "single_loss": s}));
        }
        println!(
            "{}",
            json!({"world_size": args.world_size, "backend": format!("{:?}", args.backend).to_lowercase(), "max_param_diff": max_diff, "steps": args.steps})
        );
    } else {
        println!("{} ranks ({:?}) vs one process, global batch {}:", args.world_size, args.backend, args.global_batch);
        println!("{:>5} {:>12} {:>12}", "step", "DDP loss", "single loss");
        for (i, (d, s)) in ddp_run.losses.iter().zip(&single_run.losses).enumerate() {
            println!("{i:>5} {d:>12.6} {s:>12.6}");
        }
        println!("largest difference between the final weights: {max_diff:.2e}");
    }
    Ok(())
}
