//! The optimizer every strategy steps: one in-repo AdamW (and plain SGD) over *slots* — a slot is
//! a tensor updated in place with its gradient: a whole parameter for single-process and DDP
//! training (N = 1), a rank's flat shard of a unit for ZeRO/FSDP. The caller owns it and passes
//! it to [`DataParallel::step`](crate::ddp::DataParallel::step) with the step's learning rate, so
//! an LR schedule reaches every strategy and the state can be read and restored (checkpoints).
//!
//! [`optimizer_step`] (in `step.rs`) is the one step every layout takes around the optimizer:
//! the global norm over every shard and stage, a non-finite check every rank agrees on, clipping,
//! the update, the gradients cleared.
//!
//! Also here: nanoGPT's learning-rate schedule ([`LrSchedule`]) and the clipping coefficient of
//! global-norm gradient clipping ([`clip_coef`], PyTorch's `clip_grad_norm_`).
//!
//! AdamW's arithmetic is libtorch's `torch::optim::AdamW` (the reference, [`AdamWConfig::build`]),
//! element for element: decoupled weight decay `p ← p·(1 − lr·wd)`, `m ← β₁m + (1−β₁)g`,
//! `v ← β₂v + (1−β₂)g²`, `p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)`. Weight decay follows
//! nanoGPT's groups: tensors of two or more dimensions (matrices, embeddings) decay, biases and
//! LayerNorm gains do not; a flat shard carries that choice as the element ranges it decays
//! ([`Decay::Ranges`]).

mod step;

pub use step::{optimizer_step, Held, NonFinite, Stepped};

use crate::model::Model;
use serde::{Deserialize, Serialize};
use tch::nn::{self, OptimizerConfig};
use tch::{Kind, Tensor};

/// AdamW hyper-parameters (nanoGPT's defaults except the learning rate). `lr` is the peak rate:
/// each step's rate comes from an [`LrSchedule`] (constant unless one is set).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 }
    }
}

impl AdamWConfig {
    /// libtorch's own AdamW over `model`'s parameters, group 0 decayed, group 1 not: the reference
    /// [`AdamW`] is tested against, and the optimizer of lesson 04's toy DDP.
    pub fn build(&self, model: &dyn Model) -> anyhow::Result<nn::Optimizer> {
        let mut opt =
            nn::AdamW { beta1: self.beta1, beta2: self.beta2, wd: self.weight_decay, eps: self.eps, amsgrad: false }
                .build(model.var_store(), self.lr)?;
        opt.set_weight_decay_group(0, self.weight_decay);
        opt.set_weight_decay_group(1, 0.0);
        Ok(opt)
    }
}

/// Whether a slot's elements are weight-decayed.
pub enum Decay {
    /// Every element (a matrix or an embedding).
    All,
    /// No element (a bias, a LayerNorm gain).
    Nothing,
    /// The elements in these ranges of a flat slot, none other (a ZeRO shard, which may end
    /// inside a matrix and go on into a bias; padding is never decayed). Ranges, not a per-element
    /// mask: nothing the size of the shard is kept for it.
    Ranges(Vec<std::ops::Range<i64>>),
}

impl Decay {
    /// nanoGPT's rule for a whole parameter of this shape.
    pub fn for_shape(shape: &[i64]) -> Decay {
        if shape.len() >= 2 {
            Decay::All
        } else {
            Decay::Nothing
        }
    }
}

/// An optimizer over slots (see the module docs). `step` updates `params[i]` in place from
/// `grads[i]` at learning rate `lr`; a slot whose gradient is undefined is skipped, as PyTorch
/// skips a parameter whose `.grad` is None. The slot list must be the same at every step.
pub trait Optimizer {
    /// Whether `step` would accept these slots (call it before a collective commits the ranks to
    /// stepping: a refusal on one rank must become an error on all).
    fn check(&self, params: &[Tensor], grads: &[Tensor], decay: &[Decay]) -> Result<(), String> {
        check_slots(params, grads, decay)
    }
    fn step(&mut self, lr: f64, params: &[Tensor], grads: &[Tensor], decay: &[Decay]) -> Result<(), String>;
    /// Bytes of optimizer state held.
    fn state_bytes(&self) -> u64;
}

/// AdamW's state: per slot its step count and moments.
#[derive(Debug)]
pub struct AdamWState {
    pub steps: Vec<u64>,
    /// (numel,) f32 each, one per slot.
    pub m: Vec<Tensor>,
    pub v: Vec<Tensor>,
}

/// AdamW over slots (libtorch's arithmetic; see the module docs). State is allocated at the first
/// step, like PyTorch's.
pub struct AdamW {
    pub cfg: AdamWConfig,
    steps: Vec<u64>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
}

impl AdamW {
    pub fn new(cfg: AdamWConfig) -> Self {
        AdamW { cfg, steps: Vec::new(), m: Vec::new(), v: Vec::new() }
    }
    /// A copy of the state.
    pub fn state(&self) -> AdamWState {
        AdamWState {
            steps: self.steps.clone(),
            m: self.m.iter().map(|t| t.copy()).collect(),
            v: self.v.iter().map(|t| t.copy()).collect(),
        }
    }
    /// The state without copying it: step counts and handles to the moments (a checkpoint writes
    /// from these; they change with the next step).
    pub fn state_views(&self) -> AdamWState {
        AdamWState {
            steps: self.steps.clone(),
            m: self.m.iter().map(|t| t.shallow_clone()).collect(),
            v: self.v.iter().map(|t| t.shallow_clone()).collect(),
        }
    }
    /// Replace the state (it must come from an optimizer over the same slots; checked at the next step).
    pub fn load_state(&mut self, s: AdamWState) -> Result<(), String> {
        if s.m.len() != s.steps.len() || s.v.len() != s.steps.len() {
            return Err(format!(
                "AdamW state: {} step counts, {} first and {} second moments",
                s.steps.len(),
                s.m.len(),
                s.v.len()
            ));
        }
        for (i, (m, v)) in s.m.iter().zip(&s.v).enumerate() {
            if m.size() != v.size() || m.kind() != Kind::Float || v.kind() != Kind::Float {
                return Err(format!("AdamW state: slot {i}'s moments differ in shape or are not f32"));
            }
        }
        self.steps = s.steps;
        self.m = s.m;
        self.v = s.v;
        Ok(())
    }
}

fn check_slots(params: &[Tensor], grads: &[Tensor], decay: &[Decay]) -> Result<(), String> {
    if params.len() != grads.len() || params.len() != decay.len() {
        return Err(format!("{} parameters, {} gradients and {} decay rules", params.len(), grads.len(), decay.len()));
    }
    for (i, (p, g)) in params.iter().zip(grads).enumerate() {
        if g.defined() && p.size() != g.size() {
            return Err(format!("slot {i}: parameter {:?} but gradient {:?}", p.size(), g.size()));
        }
        if g.defined() && p.device() != g.device() {
            return Err(format!("slot {i}: parameter on {:?} but gradient on {:?}", p.device(), g.device()));
        }
    }
    Ok(())
}

/// `p ← p·(1 − lr·wd)` where decayed.
fn decay_(p: &Tensor, decay: &Decay, lr: f64, wd: f64) {
    if wd == 0.0 {
        return;
    }
    let _ = match decay {
        Decay::All => p.shallow_clone().g_mul_scalar_(1.0 - lr * wd),
        Decay::Nothing => return,
        Decay::Ranges(ranges) => {
            for r in ranges {
                let _ = p.narrow(0, r.start, r.end - r.start).g_mul_scalar_(1.0 - lr * wd);
            }
            return;
        }
    };
}

impl Optimizer for AdamW {
    fn check(&self, params: &[Tensor], grads: &[Tensor], decay: &[Decay]) -> Result<(), String> {
        check_slots(params, grads, decay)?;
        if !self.m.is_empty()
            && (self.m.len() != params.len() || self.m.iter().zip(params).any(|(m, p)| m.size() != p.size()))
        {
            return Err(format!(
                "AdamW was built over {} other slots than these {} (sizes {:?} vs {:?})",
                self.m.len(),
                params.len(),
                self.m.iter().map(|m| m.numel()).collect::<Vec<_>>(),
                params.iter().map(|p| p.numel()).collect::<Vec<_>>()
            ));
        }
        Ok(())
    }
    fn step(&mut self, lr: f64, params: &[Tensor], grads: &[Tensor], decay: &[Decay]) -> Result<(), String> {
        self.check(params, grads, decay)?;
        if self.m.is_empty() {
            self.m = params.iter().map(|p| p.zeros_like()).collect();
            self.v = params.iter().map(|p| p.zeros_like()).collect();
            self.steps = vec![0; params.len()];
        }
        let c = self.cfg;
        tch::no_grad(|| {
            for (i, p) in params.iter().enumerate() {
                let g = &grads[i];
                if !g.defined() {
                    continue;
                }
                self.steps[i] += 1;
                let t = self.steps[i] as i32;
                let (bc1, bc2) = (1.0 - c.beta1.powi(t), 1.0 - c.beta2.powi(t));
                decay_(p, &decay[i], lr, c.weight_decay);
                // In place, two temporaries per slot (one pass each): m ← m + (1−β₁)(g − m),
                // v ← β₂v + ((1−β₂)g)·g, then p ← p + m / (−(√v/√bc₂ + ε)·bc₁/lr).
                let _ = self.m[i].lerp_(g, 1.0 - c.beta1);
                let _ = self.v[i].g_mul_scalar_(c.beta2).addcmul_(&(g * (1.0 - c.beta2)), g);
                let mut denom = self.v[i].sqrt();
                let _ = denom.g_div_scalar_(bc2.sqrt()).g_add_scalar_(c.eps).g_div_scalar_(-(lr / bc1));
                let _ = p.shallow_clone().addcdiv_(&self.m[i], &denom);
            }
        });
        Ok(())
    }
    fn state_bytes(&self) -> u64 {
        crate::memory::held_bytes(self.m.iter().chain(&self.v))
    }
}

/// Plain SGD, `p ← p − lr·g` (weight decay ignored): the optimizer gradient tests use, since
/// Adam's update hides a constant factor in the gradient (a sum instead of a mean).
#[derive(Default)]
pub struct Sgd;

impl Optimizer for Sgd {
    fn step(&mut self, lr: f64, params: &[Tensor], grads: &[Tensor], decay: &[Decay]) -> Result<(), String> {
        check_slots(params, grads, decay)?;
        tch::no_grad(|| {
            for (p, g) in params.iter().zip(grads).filter(|(_, g)| g.defined()) {
                let _ = p.shallow_clone().g_sub_(&(g * lr));
            }
        });
        Ok(())
    }
    fn state_bytes(&self) -> u64 {
        0
    }
}

/// nanoGPT's learning-rate schedule: linear warm-up over `warmup_iters` steps to `max_lr`, cosine
/// decay to `min_lr` at `decay_iters`, `min_lr` after. `step` counts from 0.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub max_lr: f64,
    pub min_lr: f64,
    pub warmup_iters: u64,
    pub decay_iters: u64,
}

impl LrSchedule {
    /// The same rate at every step.
    pub fn constant(lr: f64) -> Self {
        LrSchedule { max_lr: lr, min_lr: lr, warmup_iters: 0, decay_iters: 0 }
    }
    /// The rate of step `step`.
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup_iters {
            return self.max_lr * (step + 1) as f64 / (self.warmup_iters + 1) as f64;
        }
        if step >= self.decay_iters {
            return self.min_lr;
        }
        let ratio = (step - self.warmup_iters) as f64 / (self.decay_iters - self.warmup_iters) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        self.min_lr + coeff * (self.max_lr - self.min_lr)
    }
    /// Refuse schedules that cannot be meant.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.max_lr.is_finite() && self.max_lr > 0.0) {
            return Err(format!("the learning rate must be positive and finite, got {}", self.max_lr));
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.max_lr) {
            return Err(format!("min_lr must be in 0..={} (the peak rate), got {}", self.max_lr, self.min_lr));
        }
        if self.min_lr != self.max_lr && self.decay_iters <= self.warmup_iters {
            return Err(format!(
                "the cosine decay ends at step {}, not after the warm-up ({} steps): set lr_decay_iters above \
                 warmup_iters, or min_lr = lr for no decay",
                self.decay_iters, self.warmup_iters
            ));
        }
        Ok(())
    }
}

/// What one optimizer step does besides the update: its learning rate and, if set, the maximum
/// global gradient norm (nanoGPT's `grad_clip`, 1.0 by default there).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepConfig {
    pub lr: f64,
    pub grad_clip: Option<f64>,
}

impl StepConfig {
    /// Learning rate `lr`, no clipping.
    pub fn lr(lr: f64) -> Self {
        StepConfig { lr, grad_clip: None }
    }
}

/// PyTorch's `clip_grad_norm_` factor: gradients are multiplied by `max_norm / (norm + 1e-6)`
/// when that is below 1, and left alone otherwise. A non-finite `norm` is refused before this
/// (see [`DataParallel::step`](crate::ddp::DataParallel::step)).
pub fn clip_coef(norm: f64, max_norm: f64) -> f64 {
    (max_norm / (norm + 1e-6)).min(1.0)
}

/// The L2 norm over all `grads` (undefined ones skipped) as PyTorch's `clip_grad_norm_` computes
/// it: each tensor's norm in its own dtype, then the norm of those norms. 0 for no gradients.
pub fn global_norm(grads: &[Tensor]) -> f64 {
    let norms: Vec<Tensor> = grads.iter().filter(|g| g.defined() && g.numel() > 0).map(|g| g.norm()).collect();
    if norms.is_empty() {
        return 0.0;
    }
    Tensor::stack(&norms, 0).norm().double_value(&[])
}

/// Refuse a maximum norm that cannot be meant: it must be positive and finite (a negative one
/// would flip every gradient, zero would erase them, NaN would turn clipping off).
pub fn check_grad_clip(max_norm: Option<f64>) -> Result<(), String> {
    match max_norm {
        Some(c) if !(c.is_finite() && c > 0.0) => Err(format!("the gradient clip must be a positive norm, got {c}")),
        _ => Ok(()),
    }
}
