//! Models the course trains: a GPT-2-style decoder with nanoGPT's parameter names ([`Gpt`]) and a
//! small MLP for the first data-parallel lessons ([`Mlp`]).
//!
//! Both expose their forward pass as a chain of *stages* (GPT: embeddings, one stage per block,
//! head + loss). libtorch's autograd has no per-parameter hooks reachable from tch, so the
//! parallel wrappers get "this gradient is final now" by structure instead: the stage runner
//! (`crate::stages::forward_backward`, which every strategy runs; `stages::staged_backward` is a
//! thin wrapper over it) cuts the graph at stage boundaries and runs backward one stage at a time,
//! calling the strategy's hooks after each — the moment DDP may start all-reducing that stage's
//! gradients (lesson 05) and FSDP may free and re-shard its parameters.

mod generate;
mod gpt;
mod mlp;

pub use generate::{sample_next, KvCache, Sampling};
pub use gpt::{Gpt, GptConfig};
pub use mlp::{Mlp, MlpConfig};

use tch::Tensor;

/// One (micro-)batch: inputs and targets. GPT: `x`, `y` are (B, T) i64 token ids, `y` is `x`
/// shifted by one. MLP: `x` is (B, in) f32, `y` is (B, out) f32.
#[derive(Debug)]
pub struct Batch {
    pub x: Tensor,
    pub y: Tensor,
}

impl Batch {
    /// Rows `lo..hi` of the batch (views, no copy).
    pub fn rows(&self, lo: i64, hi: i64) -> Batch {
        Batch { x: self.x.narrow(0, lo, hi - lo), y: self.y.narrow(0, lo, hi - lo) }
    }
    pub fn len(&self) -> i64 {
        self.x.size()[0]
    }
    /// The batch on `device` (no copy when it is there already).
    pub fn to_device(&self, device: tch::Device) -> Batch {
        Batch { x: self.x.to_device(device), y: self.y.to_device(device) }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What the parallel wrappers need from a model.
pub trait Model: Send {
    /// Parameters with their names, in registration order (the order of PyTorch's
    /// `named_parameters()`); tied parameters appear once.
    fn named_parameters(&self) -> Vec<(String, Tensor)>;
    /// The precision the forward computes in ([`Gpt::with_precision`]); default fp32. A model's
    /// own parameters are fp32; a ZeRO/FSDP wrapper replaces their data with views of units
    /// gathered in this precision (and keeps the fp32 masters in its shards).
    fn precision(&self) -> crate::precision::Precision {
        crate::precision::Precision::Fp32
    }
    /// Compute in `precision` from now on (lesson 08). Default: only fp32 is supported.
    fn set_precision(&mut self, precision: crate::precision::Precision) -> anyhow::Result<()> {
        anyhow::ensure!(
            precision == crate::precision::Precision::Fp32,
            "this model computes in fp32 only, not {precision:?} (mixed precision is for the GPT)"
        );
        Ok(())
    }
    /// Number of forward stages.
    fn num_stages(&self) -> usize;
    /// Forward of stage `s`: `x` is the previous stage's output (ignored by stage 0, which reads
    /// `batch.x`); the last stage returns the scalar mean loss.
    fn stage_forward(&self, s: usize, x: &Tensor, batch: &Batch) -> Tensor;
    /// For each parameter (same order as `named_parameters`), the *first* stage that uses it:
    /// in a staged backward its gradient is final once that stage's backward has run.
    fn param_stages(&self) -> Vec<usize>;
    /// For each stage, every parameter it uses (a tied parameter appears in each stage that uses
    /// it). Default: each parameter only in its first-use stage.
    fn stage_uses(&self) -> Vec<Vec<usize>> {
        first_uses(self.num_stages(), &self.param_stages())
    }
    /// The VarStore holding the parameters (group 0: weight-decayed, group 1: not), for
    /// libtorch's optimizers.
    fn var_store(&self) -> &tch::nn::VarStore;

    /// Move the parameters to `device` (lesson 11), in place: the tensors `named_parameters`
    /// returned before see the move. Default: the CPU only.
    fn set_device(&mut self, device: tch::Device) -> anyhow::Result<()> {
        anyhow::ensure!(device == tch::Device::Cpu, "this model stays on the CPU, it cannot move to {device:?}");
        Ok(())
    }

    /// The state dict for these parameter values (one per parameter, `named_parameters` order):
    /// the parameter names, plus the tied aliases PyTorch also writes. Sharded strategies pass
    /// the gathered full parameters.
    fn state_dict_of(&self, params: Vec<Tensor>) -> Vec<(String, Tensor)> {
        self.named_parameters().into_iter().map(|(n, _)| n).zip(params).collect()
    }
    /// The state dict of the parameters this model holds.
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        self.state_dict_of(self.parameters())
    }
    /// The parameters alone.
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters().into_iter().map(|(_, t)| t).collect()
    }
    /// Total number of parameter elements.
    fn num_params(&self) -> i64 {
        self.parameters().iter().map(|t| t.numel() as i64).sum()
    }
    /// Forward through every stage: the mean loss (with autograd graph).
    fn loss(&self, batch: &Batch) -> Tensor {
        let mut x = Tensor::new();
        for s in 0..self.num_stages() {
            x = self.stage_forward(s, &x, batch);
        }
        x
    }
}

/// Group parameter indices by the stage that first uses them (`param_stages`), for `num_stages` stages.
pub fn first_uses(num_stages: usize, param_stages: &[usize]) -> Vec<Vec<usize>> {
    let mut uses = vec![Vec::new(); num_stages];
    for (i, &s) in param_stages.iter().enumerate() {
        uses[s].push(i);
    }
    uses
}

/// Write a state dict as one safetensors file (f32, PyTorch names).
pub fn write_state_dict(sd: Vec<(String, Tensor)>, path: impl AsRef<std::path::Path>) -> anyhow::Result<()> {
    use anyhow::Context;
    let path = path.as_ref();
    let sd: Vec<(String, Tensor)> = sd.into_iter().map(|(n, t)| (n, t.detach().contiguous())).collect();
    Tensor::write_safetensors(&sd, path).with_context(|| format!("writing {}", path.display()))
}

/// Give every parameter that has no gradient tensor a zero one (a parameter unused by the last
/// backward has none, and the parallel wrappers need a tensor to write the reduced gradient into).
pub fn ensure_grads(params: &[Tensor]) {
    let missing: Vec<&Tensor> = params.iter().filter(|p| !p.grad().defined()).collect();
    if !missing.is_empty() {
        // tch cannot assign `.grad` directly; a backward through `0·p` allocates it.
        let z = missing.iter().map(|p| (*p * 0.0).sum(tch::Kind::Float)).reduce(|a, b| a + b).expect("non-empty");
        z.backward();
    }
}

/// Set every parameter's gradient to zero, allocating it if absent (PyTorch's
/// `zero_grad(set_to_none=False)`). The library's training step does the same in place:
/// [`DataParallel::step`](crate::ddp::DataParallel::step) zeroes the gradients after the optimizer
/// step and keeps them allocated for the next backward. libtorch's optimizers (lesson 04's toy
/// DDP, the reference in the tests) free them instead with `zero_grad()` (`set_to_none=True`): the
/// next backward then writes fresh tensors rather than adding into zeroed ones.
pub fn zero_grads(params: &[Tensor]) {
    ensure_grads(params);
    for p in params {
        let _ = p.grad().detach_().zero_();
    }
}

/// The gradient tensors of `params`, allocating zeros for any that has none.
pub fn grads(params: &[Tensor]) -> Vec<Tensor> {
    ensure_grads(params);
    params.iter().map(|p| p.grad()).collect()
}
