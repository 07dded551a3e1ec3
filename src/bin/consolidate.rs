//! Consolidate a sharded checkpoint (lesson 10) into one safetensors file with nanoGPT's names,
//! streaming one tensor at a time (memory: the largest tensor, not the model).
//!
//!   cargo run --release --bin consolidate -- CHECKPOINT --out model.safetensors [--bf16]
//!
//! CHECKPOINT is a step-N folder or a checkpoint folder (its latest). The output loads into
//! nanoGPT's `GPT` with `strict=True` (`safetensors.torch.load_file`), and into shardlab with
//! `train --init`.

use clap::Parser;
use shardlab::checkpoint;

#[derive(Parser, Debug)]
#[command(about = "Consolidate a sharded checkpoint into one safetensors file (streaming)")]
struct Args {
    /// A step-N checkpoint folder, or a folder of them (its latest).
    checkpoint: std::path::PathBuf,
    #[arg(long)]
    out: std::path::PathBuf,
    /// Write bf16 instead of f32.
    #[arg(long)]
    bf16: bool,
    #[arg(long)]
    json: bool,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    shardlab::bench::reset_peak_rss();
    // Memory above what the process held before (libtorch's code and its allocator's caches):
    // what consolidating costs, to compare with the largest tensor.
    let start = shardlab::bench::peak_rss_bytes().unwrap_or(0);
    let r = checkpoint::consolidate(&a.checkpoint, &a.out, a.bf16)?;
    let peak = shardlab::bench::peak_rss_bytes().unwrap_or(0);
    if a.json {
        let mut v = serde_json::to_value(&r)?;
        v["peak_rss_bytes"] = serde_json::json!(peak);
        v["rss_at_start_bytes"] = serde_json::json!(start);
        v["peak_above_start_bytes"] = serde_json::json!(peak.saturating_sub(start));
        println!("{v}");
    } else {
        println!(
            "wrote {} ({} tensors, {} bytes; read {} bytes; largest tensor {} elements; peak RSS {:.1} MB, {:.1} MB above the start)",
            a.out.display(),
            r.tensors,
            r.bytes_written,
            r.bytes_read,
            r.largest_tensor_numel,
            peak as f64 / 1e6,
            peak.saturating_sub(start) as f64 / 1e6
        );
    }
    Ok(())
}
