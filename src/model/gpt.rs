//! A GPT-2-style decoder, architecture and parameter names as nanoGPT's `model.py`:
//! token + position embeddings → `n_layer` pre-LayerNorm blocks (causal self-attention, 4× MLP
//! with exact erf GELU) → final LayerNorm → `lm_head` tied to the token embedding. Biases on,
//! LayerNorm eps 1e-5, no dropout. Checkpoints are safetensors with nanoGPT's state-dict keys
//! (`transformer.wte.weight`, `transformer.h.0.attn.c_attn.weight`, …, `lm_head.weight`), so
//! they load into nanoGPT's `GPT` with `strict=True`.
//!
//! Shapes: B batch, T sequence (≤ block_size), C = n_embd, nh = n_head, hs = C/nh, V = vocab.

use super::{Batch, Model};
use crate::precision::Precision;
use crate::rng::Rng;
use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use tch::{nn, Device, Kind, Tensor};

/// Model shape (nanoGPT's `GPTConfig` without dropout; bias is always on).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GptConfig {
    pub vocab_size: i64,
    pub block_size: i64,
    pub n_layer: i64,
    pub n_head: i64,
    pub n_embd: i64,
}

impl GptConfig {
    /// The shape of the course's speed benchmark: 4 layers, 4 heads, width 256, block 128, vocab 4096.
    pub fn bench() -> Self {
        GptConfig { vocab_size: 4096, block_size: 128, n_layer: 4, n_head: 4, n_embd: 256 }
    }
    /// A tiny model for tests.
    pub fn tiny() -> Self {
        GptConfig { vocab_size: 64, block_size: 16, n_layer: 2, n_head: 2, n_embd: 32 }
    }
    pub fn validate(&self) -> anyhow::Result<()> {
        let c = self;
        if c.vocab_size < 1 || c.block_size < 1 || c.n_layer < 1 || c.n_head < 1 || c.n_embd < 1 {
            bail!("GPT shape must be positive: {c:?}");
        }
        if c.n_embd % c.n_head != 0 {
            bail!("n_embd ({}) must be a multiple of n_head ({})", c.n_embd, c.n_head);
        }
        Ok(())
    }
    /// Parameter count (lm_head tied, so counted once) — nanoGPT's `get_num_params(non_embedding=False)`.
    pub fn num_params(&self) -> i64 {
        let c = self.n_embd;
        let block = 2 * 2 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c);
        self.vocab_size * c + self.block_size * c + self.n_layer * block + 2 * c
    }
    /// Names and shapes of the parameters in registration order.
    pub fn param_shapes(&self) -> Vec<(String, Vec<i64>)> {
        let (c, v) = (self.n_embd, self.vocab_size);
        let mut out = vec![
            ("transformer.wte.weight".to_string(), vec![v, c]),
            ("transformer.wpe.weight".to_string(), vec![self.block_size, c]),
        ];
        for l in 0..self.n_layer {
            let p = |s: &str| format!("transformer.h.{l}.{s}");
            out.extend([
                (p("ln_1.weight"), vec![c]),
                (p("ln_1.bias"), vec![c]),
                (p("attn.c_attn.weight"), vec![3 * c, c]),
                (p("attn.c_attn.bias"), vec![3 * c]),
                (p("attn.c_proj.weight"), vec![c, c]),
                (p("attn.c_proj.bias"), vec![c]),
                (p("ln_2.weight"), vec![c]),
                (p("ln_2.bias"), vec![c]),
                (p("mlp.c_fc.weight"), vec![4 * c, c]),
                (p("mlp.c_fc.bias"), vec![4 * c]),
                (p("mlp.c_proj.weight"), vec![c, 4 * c]),
                (p("mlp.c_proj.bias"), vec![c]),
            ]);
        }
        out.push(("transformer.ln_f.weight".into(), vec![c]));
        out.push(("transformer.ln_f.bias".into(), vec![c]));
        out
    }
}

/// The GPT. Parameters live in a tch `VarStore` (so libtorch's optimizers can drive them):
/// group 0 holds the matrices and embeddings (weight-decayed, as in nanoGPT's
/// `configure_optimizers`), group 1 the biases and LayerNorm gains (not decayed).
pub struct Gpt {
    pub cfg: GptConfig,
    vs: nn::VarStore,
    params: Vec<(String, Tensor)>,
    precision: Precision,
}

const LN_EPS: f64 = 1e-5;

impl Gpt {
    /// A freshly initialised model, nanoGPT's init: weights N(0, 0.02), residual projections
    /// (`c_proj.weight`) N(0, 0.02/√(2·n_layer)), biases 0, LayerNorm gains 1. Deterministic in
    /// `seed` (same weights on every rank and in every launch mode).
    pub fn new(cfg: GptConfig, seed: u64) -> anyhow::Result<Self> {
        Self::new_only(cfg, seed, |_| true)
    }

    /// [`new`](Self::new), materialising only the parameters `keep(i)` names (by index in
    /// `named_parameters`); the others are empty (0 elements). The random stream is drawn in full
    /// (and discarded where not kept), so a kept parameter equals `new`'s: a pipeline rank builds
    /// only the parameters of its stages (lesson 13) and never holds the rest.
    pub fn new_only(cfg: GptConfig, seed: u64, keep: impl Fn(usize) -> bool) -> anyhow::Result<Self> {
        cfg.validate()?;
        let vs = nn::VarStore::new(Device::Cpu);
        let mut rng = Rng::new(seed);
        let mut params = Vec::new();
        for (i, (name, shape)) in cfg.param_shapes().into_iter().enumerate() {
            let numel: i64 = shape.iter().product();
            let init = if !keep(i) {
                if shape.len() >= 2 {
                    (0..numel).for_each(|_| _ = rng.normal()); // advance the stream as `new` does
                }
                Tensor::zeros([0], (Kind::Float, Device::Cpu))
            } else if name.ends_with("ln_1.weight") || name.ends_with("ln_2.weight") || name.ends_with("ln_f.weight") {
                Tensor::ones(shape.as_slice(), (Kind::Float, Device::Cpu))
            } else if shape.len() == 1 {
                Tensor::zeros(shape.as_slice(), (Kind::Float, Device::Cpu))
            } else {
                let std = if name.ends_with("c_proj.weight") { 0.02 / ((2 * cfg.n_layer) as f64).sqrt() } else { 0.02 };
                Tensor::from_slice(&rng.normal_vec(numel as usize, std)).view(shape.as_slice())
            };
            let group = if shape.len() >= 2 { 0 } else { 1 };
            let mut path = vs.root().set_group(group);
            let parts: Vec<&str> = name.split('.').collect();
            for part in &parts[..parts.len() - 1] {
                path = path.sub(*part);
            }
            let t = path.var_copy(parts[parts.len() - 1], &init);
            params.push((name, t));
        }
        Ok(Gpt { cfg, vs, params, precision: Precision::Fp32 })
    }

    /// [`Model::param_stages`] of the GPT of `cfg`, without building it: each parameter's first
    /// stage (embeddings 0, block l's parameters l + 1, ln_f the last).
    pub fn param_stages_of(cfg: &GptConfig) -> Vec<usize> {
        let last = cfg.n_layer as usize + 1;
        let n = cfg.param_shapes().len();
        (0..n)
            .map(|i| match i {
                0 | 1 => 0, // wte (also the lm_head: its gradient completes in the embedding stage, last in backward) and wpe
                i if i >= n - 2 => last,
                i => 1 + (i - 2) / 12,
            })
            .collect()
    }

    /// [`Model::stage_uses`] of the GPT of `cfg`, without building it: the head stage also uses
    /// wte (the tied lm_head).
    pub fn stage_uses_of(cfg: &GptConfig) -> Vec<Vec<usize>> {
        let mut uses = super::first_uses(cfg.n_layer as usize + 2, &Gpt::param_stages_of(cfg));
        uses.last_mut().expect("stages").push(0);
        uses
    }

    /// Free every parameter but those `keep(i)` names (their data becomes empty, in place): a
    /// model loaded whole (from `init` weights) cut down to a pipeline rank's stages.
    pub fn keep_only(&self, keep: impl Fn(usize) -> bool) {
        for (i, (_, p)) in self.params.iter().enumerate() {
            if !keep(i) {
                p.shallow_clone().set_data(&Tensor::zeros([0], (Kind::Float, p.device())));
            }
        }
    }

    /// Compute the matrix multiplies (the linear layers, attention and the logits) in `precision`,
    /// as `torch.autocast` does: their inputs and weights are cast to bf16/fp16 at each use (the
    /// cast is on autograd's tape, so an fp32 parameter gets an fp32 gradient), while the
    /// embeddings, the residual stream, LayerNorm and the loss stay in fp32 (an fp32 + bf16 add
    /// promotes to fp32; the logits are upcast before the cross-entropy). Parameters that are
    /// already in the compute kind (ZeRO gathering them in bf16, FSDP2's `param_dtype`) are used
    /// as they are, and get gradients in that kind.
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// The cast of the autocast-style linear: `x` and the weights in the compute kind.
    fn cast(&self, t: &Tensor) -> Tensor {
        t.to_kind(self.precision.kind())
    }

    /// `x · wᵀ + b` in the compute kind.
    pub(super) fn lin(&self, x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
        match self.precision {
            Precision::Fp32 => x.linear(w, Some(b)),
            _ => self.cast(x).linear(&self.cast(w), Some(self.cast(b))),
        }
    }

    /// LayerNorm over the last dimension, in the input's kind (the residual stream's: fp32).
    pub(super) fn ln(&self, x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
        let k = x.kind();
        x.layer_norm([self.cfg.n_embd], Some(w.to_kind(k)), Some(b.to_kind(k)), LN_EPS, false)
    }

    pub(super) fn p(&self, i: usize) -> &Tensor {
        &self.params[i].1
    }

    /// Index of block `l`'s first parameter (12 per block, after wte and wpe).
    pub(super) fn block_base(l: usize) -> usize {
        2 + 12 * l
    }

    /// Embeddings: (B, T) ids → (B, T, C).
    pub fn embed(&self, idx: &Tensor) -> Tensor {
        let (_b, t) = idx.size2().expect("token batch must be (B, T)");
        assert!(t <= self.cfg.block_size, "sequence length {t} exceeds block_size {}", self.cfg.block_size);
        let pos = Tensor::arange(t, (Kind::Int64, idx.device()));
        // Look up in fp32 whatever the parameters' kind (a no-op for fp32 tables; a transient copy
        // of bf16 ones under ZeRO): the embedding backward adds every occurrence of a token into
        // the table's gradient, and on the CPU it accumulates in the table's dtype — in bf16, a
        // frequent token's gradient stops growing after a few hundred occurrences.
        let wte = self.p(0).to_kind(Kind::Float);
        let wpe = self.p(1).to_kind(Kind::Float);
        let tok = Tensor::embedding(&wte, idx, -1, false, false); // (B, T, C)
        tok + Tensor::embedding(&wpe, &pos, -1, false, false) // + (T, C): the residual stream is fp32
    }

    /// Block `l`: x + attn(ln_1(x)), then + mlp(ln_2(·)). (B, T, C) → (B, T, C).
    pub fn block(&self, l: usize, x: &Tensor) -> Tensor {
        let b0 = Self::block_base(l);
        let w = |i: usize| self.p(b0 + i);
        let (b, t, c) = x.size3().expect("(B, T, C)");
        let (nh, hs) = (self.cfg.n_head, c / self.cfg.n_head);
        let h = self.ln(x, w(0), w(1));
        let qkv = self.lin(&h, w(2), w(3)); // (B, T, 3C), in the compute kind
        let heads = |i: i64| qkv.narrow(2, i * c, c).view([b, t, nh, hs]).transpose(1, 2); // (B, nh, T, hs)
        let y = Tensor::scaled_dot_product_attention::<Tensor>(
            &heads(0),
            &heads(1),
            &heads(2),
            None,
            0.0,
            true,
            None,
            false,
        );
        let y = self.lin(&y.transpose(1, 2).contiguous().view([b, t, c]), w(4), w(5));
        let x = x + y; // fp32 + compute kind → fp32
        let h = self.ln(&x, w(6), w(7));
        let m = self.lin(&self.lin(&h, w(8), w(9)).gelu("none"), w(10), w(11));
        x + m
    }

    /// Final LayerNorm and tied lm_head: (B, T, C) → logits (B, T, V).
    pub fn head(&self, x: &Tensor) -> Tensor {
        let n = self.params.len();
        let h = self.ln(x, self.p(n - 2), self.p(n - 1));
        match self.precision {
            Precision::Fp32 => h.linear::<Tensor>(self.p(0), None),
            _ => self.cast(&h).linear::<Tensor>(&self.cast(self.p(0)), None),
        }
    }

    /// Mean cross-entropy of `logits` (B, T, V) against `targets` (B, T); target −1 is ignored.
    /// Computed in fp32 (bf16/fp16 logits are upcast first).
    pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Tensor {
        let v = *logits.size().last().expect("logits");
        logits.to_kind(Kind::Float).view([-1, v]).cross_entropy_loss::<Tensor>(
            &targets.view([-1]),
            None,
            tch::Reduction::Mean,
            -1,
            0.0,
        )
    }

    /// Logits for a (B, T) batch of ids.
    pub fn logits(&self, idx: &Tensor) -> Tensor {
        let mut x = self.embed(idx);
        for l in 0..self.cfg.n_layer as usize {
            x = self.block(l, &x);
        }
        self.head(&x)
    }

    /// Write the weights as one safetensors file with nanoGPT's keys (f32, `lm_head.weight` included).
    pub fn save_safetensors(&self, path: impl AsRef<std::path::Path>) -> anyhow::Result<()> {
        super::write_state_dict(self.state_dict(), path)
    }

    /// Load weights saved by [`save_safetensors`](Self::save_safetensors) or by nanoGPT
    /// (`safetensors.torch.save_file(model.state_dict())`). Strict: every parameter must be present
    /// with this model's shape and no unknown key may appear (nanoGPT's non-flash `attn.bias` mask
    /// buffers are accepted and ignored). `lm_head.weight` may be absent (then it is tied to the
    /// token embedding, as in nanoGPT); if present it must equal `transformer.wte.weight`.
    pub fn load_safetensors(&self, path: impl AsRef<std::path::Path>) -> anyhow::Result<()> {
        let path = path.as_ref();
        let loaded: HashMap<String, Tensor> = Tensor::read_safetensors(path)
            .with_context(|| format!("reading {}", path.display()))?
            .into_iter()
            .collect();
        let mut problems = Vec::new();
        for (name, p) in &self.params {
            match loaded.get(name) {
                None => problems.push(format!("missing key {name}")),
                Some(t) if t.size() != p.size() => {
                    problems.push(format!("{name}: shape {:?} in the file, {:?} in this model", t.size(), p.size()))
                }
                Some(_) => {}
            }
        }
        let known: std::collections::HashSet<&str> = self.params.iter().map(|(n, _)| n.as_str()).collect();
        for k in loaded.keys() {
            let mask = k.starts_with("transformer.h.") && k.ends_with(".attn.bias");
            if !known.contains(k.as_str()) && k != "lm_head.weight" && !mask {
                problems.push(format!("unexpected key {k}"));
            }
        }
        if let (Some(head), Some(wte)) = (loaded.get("lm_head.weight"), loaded.get("transformer.wte.weight")) {
            if head.size() != wte.size() || !head.to_kind(Kind::Float).equal(&wte.to_kind(Kind::Float)) {
                problems.push("lm_head.weight differs from transformer.wte.weight; this GPT ties them".into());
            }
        }
        if !problems.is_empty() {
            problems.sort();
            bail!("{} does not fit this GPT {:?}:\n  {}", path.display(), self.cfg, problems.join("\n  "));
        }
        tch::no_grad(|| {
            for (name, p) in &self.params {
                let mut p = p.shallow_clone();
                p.copy_(&loaded[name].to_kind(Kind::Float));
            }
        });
        Ok(())
    }
}

impl Model for Gpt {
    fn precision(&self) -> Precision {
        self.precision
    }
    fn set_precision(&mut self, precision: Precision) -> anyhow::Result<()> {
        self.precision = precision;
        Ok(())
    }
    fn var_store(&self) -> &nn::VarStore {
        &self.vs
    }
    fn set_device(&mut self, device: tch::Device) -> anyhow::Result<()> {
        // VarStore::set_device replaces each variable's data in place (set_data), so the
        // shallow clones in `params` move with it.
        self.vs.set_device(device);
        Ok(())
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()
    }
    /// Embeddings, one stage per block, then head + loss.
    fn num_stages(&self) -> usize {
        self.cfg.n_layer as usize + 2
    }
    fn stage_forward(&self, s: usize, x: &Tensor, batch: &Batch) -> Tensor {
        let last = self.num_stages() - 1;
        match s {
            0 => self.embed(&batch.x),
            s if s == last => Self::cross_entropy(&self.head(x), &batch.y),
            s => self.block(s - 1, x),
        }
    }
    /// nanoGPT's state dict: every parameter plus `lm_head.weight` (the tied wte).
    fn state_dict_of(&self, params: Vec<Tensor>) -> Vec<(String, Tensor)> {
        let wte = params[0].shallow_clone();
        let mut sd: Vec<(String, Tensor)> = self.params.iter().map(|(n, _)| n.clone()).zip(params).collect();
        sd.push(("lm_head.weight".into(), wte));
        sd
    }
    /// The head stage also uses wte (the tied lm_head).
    fn stage_uses(&self) -> Vec<Vec<usize>> {
        Gpt::stage_uses_of(&self.cfg)
    }
    fn param_stages(&self) -> Vec<usize> {
        Gpt::param_stages_of(&self.cfg)
    }
}
