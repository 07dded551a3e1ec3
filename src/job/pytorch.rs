//! The same job run by PyTorch 2.11 (`benches/torch_gpt.py` from `.venv`), for comparisons that
//! are like for like: same shape, batch, steps, data and timing rule.

use super::{DataSource, GptJob};

/// Run `benches/torch_gpt.py train` (PyTorch 2.11 from `.venv`) with the same shape, batch,
/// steps and data; its summary (`tokens_per_s`, …). `strategy`: single, ddp or fsdp.
pub fn pytorch_train(job: &GptJob, strategy: &str, world_size: usize) -> anyhow::Result<serde_json::Value> {
    pytorch_train_with(job, strategy, world_size, &PyTorchOptions::default())
}

/// Options of [`pytorch_train_with`].
#[derive(Clone, Debug)]
pub struct PyTorchOptions<'a> {
    /// `torch.set_num_threads` per process (default 1: ranks share the machine).
    pub threads: usize,
    /// `none`, `full` or `every:K`: `torch.utils.checkpoint.checkpoint(block, x,
    /// use_reentrant=False)` around the chosen blocks (blocks 0, K, 2K, …), as shardlab's policy.
    pub checkpointing: crate::stages::Checkpointing,
    /// Extra environment variables for the Python process (e.g. the allocator's).
    pub env: &'a [(&'a str, &'a str)],
    /// fsdp: FSDP2's `reshard_after_forward` for the blocks (default true, as FSDP2's).
    pub reshard_after_forward: bool,
    /// fp32, or bf16/fp16 under `torch.autocast("cpu", dtype=…)` (fp16 with a `GradScaler`).
    pub precision: crate::precision::Precision,
}

impl Default for PyTorchOptions<'_> {
    fn default() -> Self {
        PyTorchOptions {
            threads: 1,
            checkpointing: crate::stages::Checkpointing::None,
            env: &[],
            reshard_after_forward: true,
            precision: crate::precision::Precision::Fp32,
        }
    }
}

/// [`pytorch_train`] with options; the summary also carries `peak_rss_bytes` (rank 0's process).
pub fn pytorch_train_with(
    job: &GptJob,
    strategy: &str,
    world_size: usize,
    opts: &PyTorchOptions,
) -> anyhow::Result<serde_json::Value> {
    use anyhow::Context;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let py = root.join(".venv/bin/python");
    anyhow::ensure!(py.exists(), "{} is missing: run `bash .ci/setup`", py.display());
    let DataSource::File(data) = &job.data else { anyhow::bail!("the PyTorch comparison needs a token file") };
    let c = job.model;
    let out = std::process::Command::new(py)
        .args(["-W", "ignore"])
        .arg(root.join("benches/torch_gpt.py"))
        .args(["--n-layer", &c.n_layer.to_string(), "--n-head", &c.n_head.to_string()])
        .args(["--n-embd", &c.n_embd.to_string(), "--block-size", &c.block_size.to_string()])
        .args(["--vocab-size", &c.vocab_size.to_string(), "--threads", &opts.threads.to_string()])
        .args(["train", "--strategy", strategy, "--checkpointing", &opts.checkpointing.to_string()])
        .args(["--world-size", &world_size.to_string(), "--batch-size", &job.batch_size.to_string()])
        .args([
            "--steps",
            &job.steps.to_string(),
            "--warmup",
            &job.warmup.to_string(),
            "--lr",
            &job.optim.lr.to_string(),
        ])
        .arg("--data")
        .arg(data)
        .args(if opts.reshard_after_forward { &[][..] } else { &["--no-reshard-after-forward"][..] })
        .args(["--precision", opts.precision.name()])
        .envs(opts.env.iter().copied())
        .output()?;
    anyhow::ensure!(out.status.success(), "PyTorch run failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default())
        .context("parsing PyTorch's summary")
}
