//! `sample` — write text with a trained GPT (lesson 14; nanoGPT's `sample.py`).
//!
//! ```text
//! cargo run --release --bin sample -- --from ck/best --start ROMEO: --max-new-tokens 500 \
//!     --temperature 0.8 --top-k 200 --seed 1337          # a checkpoint of any layout (train --checkpoint-dir)
//! cargo run --release --bin sample -- --from model.safetensors --meta data/shakespeare_char/meta.json \
//!     --n-layer 6 --n-head 6 --n-embd 384 --block-size 256 --start ROMEO:
//! cargo run --release --bin sample -- --bench --max-new-tokens 256   # decode tokens/s, with and without the KV cache
//! ```
//!
//! `--from` is a distributed checkpoint (a step-N folder or a checkpoint folder: its latest) saved
//! by `train` under any layout — the model's shape and the data's `meta.json` come from the job
//! saved with it — or a safetensors file with nanoGPT's names (`train --save`, `consolidate`),
//! whose shape the flags give. `--meta` is the corpus's `meta.json` (characters ↔ ids); without
//! one the start is a list of ids and ids are printed. The same seed gives the same text.
//! `--bench` times decoding `--max-new-tokens` tokens (at most block_size − 1: past the context
//! window both ways run the whole cropped context, and the cache gains nothing) from a one-token
//! prompt with and without the KV cache (the same tokens either way), with the given shape and
//! random weights unless `--from`.

use anyhow::Context;
use clap::Parser;
use shardlab::corpus::Meta;
use shardlab::model::{Gpt, GptConfig, Sampling};
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Write text with a trained GPT (nanoGPT's sample.py), with a KV cache")]
struct Args {
    /// Weights: a checkpoint folder saved by `train` (any layout; it carries the model's shape),
    /// or a safetensors file with nanoGPT's names (the shape from the flags).
    #[arg(long, alias = "init")]
    from: Option<std::path::PathBuf>,
    /// The corpus's meta.json (characters ↔ ids) [default: with a checkpoint, its data's].
    #[arg(long)]
    meta: Option<std::path::PathBuf>,
    /// [default: the checkpoint's, else 6]
    #[arg(long)]
    n_layer: Option<i64>,
    /// [default: the checkpoint's, else 6]
    #[arg(long)]
    n_head: Option<i64>,
    /// [default: the checkpoint's, else 384]
    #[arg(long)]
    n_embd: Option<i64>,
    /// [default: the checkpoint's, else 256]
    #[arg(long)]
    block_size: Option<i64>,
    /// Vocabulary size [default: the checkpoint's, else meta.json's; required without either].
    #[arg(long)]
    vocab_size: Option<i64>,
    /// The prompt: text (with --meta) or comma-separated ids.
    #[arg(long, default_value = "\n")]
    start: String,
    #[arg(long, default_value_t = 500)]
    max_new_tokens: usize,
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    #[arg(long, default_value_t = 200)]
    top_k: usize,
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Decode without the KV cache (every step runs the whole context).
    #[arg(long)]
    no_cache: bool,
    /// Time decoding with and without the cache instead of printing text.
    #[arg(long)]
    bench: bool,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    tch::set_num_threads(std::env::var("OMP_NUM_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(1));
    // A checkpoint folder carries its model's shape and data; a safetensors file does not.
    let restored = match &a.from {
        Some(p) if p.is_dir() => Some(shardlab::job::restore::load_gpt(p)?),
        _ => None,
    };
    if let (None, Some(r)) = (&a.meta, &restored) {
        if let (shardlab::job::DataSource::Dir(d), None) = (&r.job.data, r.meta_path()) {
            eprintln!(
                "sample: the checkpoint was trained on {}, but there is no meta.json there (a path relative to where \
                 it was trained?): printing ids; give --meta",
                d.display()
            );
        }
    }
    let meta_path = a.meta.clone().or_else(|| restored.as_ref().and_then(|r| r.meta_path()));
    let meta = meta_path.as_deref().map(Meta::read_file).transpose()?;
    let vocab = meta.as_ref().map(|m| m.vocab()).transpose()?;
    let (model, cfg) = match restored {
        Some(r) => {
            let c = r.job.model;
            for (flag, given, saved) in [
                ("--n-layer", a.n_layer, c.n_layer),
                ("--n-head", a.n_head, c.n_head),
                ("--n-embd", a.n_embd, c.n_embd),
                ("--block-size", a.block_size, c.block_size),
                ("--vocab-size", a.vocab_size, c.vocab_size),
            ] {
                anyhow::ensure!(
                    given.is_none_or(|g| g == saved),
                    "{flag} {} but the checkpoint's model has {saved}: leave it out",
                    given.unwrap_or_default()
                );
            }
            if let Some(m) = &meta {
                anyhow::ensure!(
                    m.vocab_size as i64 <= c.vocab_size,
                    "meta.json has {} characters but the checkpoint's model only {}",
                    m.vocab_size,
                    c.vocab_size
                );
            }
            eprintln!("sample: {} (step {}), a GPT of {c:?}", r.path.display(), r.step);
            (r.model, c)
        }
        None => {
            let vocab_size = match (a.vocab_size, &meta) {
                (Some(v), Some(m)) if v < m.vocab_size as i64 => {
                    anyhow::bail!("--vocab-size {v} is smaller than meta.json's {}", m.vocab_size)
                }
                (Some(v), _) => v,
                (None, Some(m)) => m.vocab_size as i64,
                (None, None) => anyhow::bail!("give --meta (the corpus's meta.json) or --vocab-size"),
            };
            let cfg = GptConfig {
                vocab_size,
                block_size: a.block_size.unwrap_or(256),
                n_layer: a.n_layer.unwrap_or(6),
                n_head: a.n_head.unwrap_or(6),
                n_embd: a.n_embd.unwrap_or(384),
            };
            let model = Gpt::new(cfg, a.seed)?;
            if let Some(p) = &a.from {
                model.load_safetensors(p).with_context(|| format!("loading {} into a GPT of {cfg:?}", p.display()))?;
            }
            (model, cfg)
        }
    };
    let sampling = Sampling { temperature: a.temperature, top_k: (a.top_k > 0).then_some(a.top_k) };
    if a.bench {
        // Within the context window: past block_size both ways run the whole cropped context.
        let n = a.max_new_tokens.min(cfg.block_size as usize - 1);
        anyhow::ensure!(n > 0, "--bench needs --max-new-tokens ≥ 1 and --block-size ≥ 2");
        let time = |cached: bool| {
            let t = Instant::now();
            let out = model.generate(&[0], n, sampling, a.seed, cached);
            (out, n as f64 / t.elapsed().as_secs_f64())
        };
        let (with, fast) = time(true);
        let (without, slow) = time(false);
        anyhow::ensure!(with == without, "the cache changed the tokens drawn");
        println!(
            "{}",
            serde_json::json!({"tokens": n, "cached_tokens_per_s": fast, "uncached_tokens_per_s": slow,
                               "speedup": fast / slow, "config": cfg, "threads": tch::get_num_threads()})
        );
        return Ok(());
    }
    let prompt: Vec<i64> = match &vocab {
        Some(v) => v.encode(&a.start)?.into_iter().map(i64::from).collect(),
        None => a
            .start
            .split(',')
            .map(|s| s.trim().parse::<i64>().context("--start: ids without --meta"))
            .collect::<Result<_, _>>()?,
    };
    anyhow::ensure!(!prompt.is_empty(), "--start is empty: give at least one character (or id)");
    if let Some(bad) = prompt.iter().find(|&&i| i < 0 || i >= cfg.vocab_size) {
        anyhow::bail!("--start: id {bad} is outside the vocabulary (0..{})", cfg.vocab_size);
    }
    let out = model.generate(&prompt, a.max_new_tokens, sampling, a.seed, !a.no_cache);
    match &vocab {
        Some(v) => println!("{}", v.decode(&out.iter().map(|&i| i as u16).collect::<Vec<_>>())?),
        None => println!("{out:?}"),
    }
    Ok(())
}
