//! Lesson 10 demo — a rank killed mid-run: the job restarts from its latest checkpoint and ends
//! where an uninterrupted run ends.
//!
//!   cargo run --release --bin lesson10                          # ZeRO-3 on 2 processes; rank 1 SIGKILLed before step 13
//!   cargo run --release --bin lesson10 -- --kill-at save:0:10   # killed inside step 10's save, before its commit
//!   cargo run --release --bin lesson10 -- --shrink              # 3 ranks; rank 2's machine is gone: go on with 2
//!   cargo run --release --bin lesson10 -- --json                # both loss curves, for the notebook
//!
//! It runs the same job twice, each on rank processes over TCP with checkpoints every
//! `--save-every` steps: once uninterrupted, once with `SHARDLAB_FAIL_AT` killing a rank
//! (SIGKILL: no message, no clean-up). The elastic supervisor (`GptJob::fit_elastic`, torchrun's
//! `--max-restarts`) sees the failure, stops the survivors, and starts a new generation that
//! loads the latest committed checkpoint — resharded when it runs on fewer ranks — and trains to
//! the end. Same world size: the final weights are bitwise the uninterrupted run's. Shrunk: they
//! differ by the rounding of a different reduction order.

use clap::Parser;
use serde_json::json;
use shardlab::checkpoint;
use shardlab::job::{self, CheckpointConfig, DataSource, Elastic, GptJob};
use shardlab::prelude::*;
use std::path::{Path, PathBuf};

#[derive(Parser, Debug)]
#[command(
    about = "Lesson 10: kill a rank mid-run, restart from the latest checkpoint, end where an uninterrupted run ends"
)]
struct Args {
    #[arg(long, value_enum, default_value = "zero3")]
    strategy: Strategy,
    /// Ranks (processes); --shrink makes it 3 unless given.
    #[arg(long)]
    world_size: Option<usize>,
    #[arg(long, default_value_t = 20)]
    steps: u64,
    #[arg(long, default_value_t = 5)]
    save_every: u64,
    /// The failure: `step:RANK:STEP` (killed before training step STEP) or `save:RANK:STEP`
    /// (killed in step STEP's save, after writing its file, before the commit).
    #[arg(long)]
    kill_at: Option<String>,
    /// The killed rank's machine does not come back: go on with fewer ranks (resharding on load).
    #[arg(long)]
    shrink: bool,
    /// Where the two runs keep their checkpoints (a fresh temporary folder if not given).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// One JSON object: both runs' losses, the attempts, the checkpoint's files and the comparison.
    #[arg(long)]
    json: bool,
}

fn gpt_job(dir: &Path, a: &Args, world: usize) -> GptJob {
    GptJob {
        model: GptConfig { vocab_size: 64, block_size: 32, n_layer: 2, n_head: 2, n_embd: 64 },
        batch_size: 12 / world.max(1),
        accum: 1,
        steps: a.steps,
        warmup: 0,
        optim: AdamWConfig { lr: 3e-3, eps: 1e-6, ..AdamWConfig::default() },
        lr_schedule: Some(LrSchedule { max_lr: 3e-3, min_lr: 3e-4, warmup_iters: 3, decay_iters: a.steps }),
        grad_clip: Some(1.0),
        data: DataSource::Synthetic { tokens: 20_000, seed: 7 },
        seed: 1,
        init: None,
        save: Some(dir.join("final.safetensors")),
        checkpoint: CheckpointConfig { dir: Some(dir.join("ck")), every: a.save_every, ..Default::default() },
        eval: Default::default(),
    }
}

/// Every weight of a safetensors file, by name, as one vector.
fn weights(p: &Path) -> anyhow::Result<Vec<f32>> {
    let mut t = Tensor::read_safetensors(p)?;
    t.sort_by(|a, b| a.0.cmp(&b.0));
    let all: Vec<Tensor> = t.iter().map(|(_, t)| t.reshape([-1])).collect();
    Ok(Vec::<f32>::try_from(&Tensor::cat(&all, 0))?)
}

fn main() -> anyhow::Result<()> {
    job::run_one_if_asked();
    let a = Args::parse();
    let world = a.world_size.unwrap_or(if a.shrink { 3 } else { 2 });
    anyhow::ensure!((2..=4).contains(&world), "--world-size must be 2, 3 or 4 (the global batch is 12 rows)");
    anyhow::ensure!(a.save_every >= 1 && a.steps > a.save_every, "need --steps > --save-every ≥ 1");
    let kill = a.kill_at.clone().unwrap_or_else(|| format!("step:{}:{}", world - 1, a.save_every * 2 + 3));
    let root =
        a.dir.clone().unwrap_or_else(|| std::env::temp_dir().join(format!("shardlab-lesson10-{}", std::process::id())));
    let (ref_dir, run_dir) = (root.join("uninterrupted"), root.join("interrupted"));
    let scaling = ScalingConfig {
        num_workers: world,
        backend: Backend::Tcp,
        launch: Some(Launch::Processes),
        strategy: a.strategy,
        ..ScalingConfig::default()
    };
    if !is_spawned_child() {
        for d in [&ref_dir, &run_dir] {
            let _ = std::fs::remove_dir_all(d);
            std::fs::create_dir_all(d)?;
        }
        // Only this driver chooses the failure; its rank processes inherit it when they start.
        std::env::remove_var("SHARDLAB_FAIL_AT");
        if !a.json {
            println!(
                "{:?} on {world} processes, {} steps, a checkpoint every {} steps",
                a.strategy, a.steps, a.save_every
            );
            println!("1. the uninterrupted run …");
        }
    }
    // (A rank process runs its driver's current run from the environment, whichever this is.)
    let (reference, _) =
        gpt_job(&ref_dir, &a, world).fit_elastic(scaling.clone(), &Elastic::default(), false, false)?;
    if !is_spawned_child() {
        std::env::set_var("SHARDLAB_FAIL_AT", &kill);
        if !a.json {
            println!("2. the same run with SHARDLAB_FAIL_AT={kill} (the rank SIGKILLs itself) …");
        }
    }
    let elastic =
        Elastic { max_restarts: 2, min_world_size: if a.shrink { world - 1 } else { 0 }, shrink_on_failure: a.shrink };
    let (restarted, attempts) = gpt_job(&run_dir, &a, world).fit_elastic(scaling, &elastic, false, false)?;
    std::env::remove_var("SHARDLAB_FAIL_AT");

    let want = weights(&ref_dir.join("final.safetensors"))?;
    let got = weights(&run_dir.join("final.safetensors"))?;
    let max_diff = got.iter().zip(&want).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let bitwise = got == want;
    let first = (a.steps as usize).saturating_sub(restarted.losses.len());
    let same_losses = restarted.losses.iter().zip(&reference.losses[first..]).filter(|(x, y)| x == y).count();
    let loss_diff =
        restarted.losses.iter().zip(&reference.losses[first..]).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    let latest = checkpoint::resolve(&run_dir.join("ck"))?;
    let meta = checkpoint::read_metadata(&latest)?;
    let files: Vec<(String, u64)> = meta.files.iter().map(|(n, f)| (n.clone(), f.bytes)).collect();

    if a.json {
        println!(
            "{}",
            json!({
                "strategy": format!("{:?}", a.strategy), "world_size": world, "kill_at": kill,
                "uninterrupted_losses": reference.losses, "restarted_losses": restarted.losses,
                "restarted_from_step": first, "attempts": attempts,
                "bitwise_equal": bitwise, "max_abs_diff": max_diff, "max_loss_diff": loss_diff,
                "resume_bytes_read": restarted.resume_bytes_read, "resume_load_s": restarted.resume_load_s,
                "latest_checkpoint": latest.file_name().map(|n| n.to_string_lossy().to_string()),
                "checkpoint_files": files,
            })
        );
        return Ok(());
    }
    println!("\n generation  ranks  rows/rank  resumed from           how it ended");
    for t in &attempts {
        let from = if t.resume.is_some() { format!("step {first} (latest)") } else { "the start".into() };
        let how = t.error.as_deref().map_or("finished".into(), |e| e.lines().next().unwrap_or_default().to_string());
        println!(" {:>10}  {:>5}  {:>9}  {:<21}  {how}", t.generation, t.world_size, t.batch_size, from);
    }
    println!(
        "\nthe restarted generation loaded step {first} ({} bytes read by rank 0 in {:.2} s) and trained steps {first}..{}",
        restarted.resume_bytes_read, restarted.resume_load_s, a.steps
    );
    println!(
        "its losses equal the uninterrupted run's at {same_losses} of those {} steps (max |Δ| = {loss_diff:.1e})",
        restarted.losses.len()
    );
    if bitwise {
        println!("final weights: bitwise equal to the uninterrupted run's ({} values)", want.len());
    } else {
        println!(
            "final weights: max |Δ| = {max_diff:.2e} from the uninterrupted run's ({} values){}",
            want.len(),
            if a.shrink { " — fewer ranks add the gradients in another order" } else { "" }
        );
    }
    println!("\n{} (format {}, step {}, {} ranks):", latest.display(), meta.format_version, meta.step, meta.world_size);
    for (n, b) in &files {
        println!("  {n:<26} {b:>9} bytes");
    }
    println!("  metadata.json: {} tensors (params and AdamW's two moments), each as rank pieces", meta.tensors.len());
    if a.dir.is_none() {
        let _ = std::fs::remove_dir_all(&root);
    }
    Ok(())
}
