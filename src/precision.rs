//! Mixed precision, part 1: the dynamic loss scaler fp16 training needs (lesson 08).
//!
//! fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by a large
//! scale S before backward shifts every gradient up by S (the chain rule is linear); before the
//! optimizer step the gradients are divided by S again ("unscaled"). If S was too large some
//! gradient overflowed to inf (or became NaN): that step is skipped and S halved. After
//! `growth_interval` clean steps S doubles, probing for the largest scale that does not
//! overflow. These are PyTorch's `torch.amp.GradScaler` rules and defaults.
//!
//! In data-parallel training every rank must take the same decision: each rank's overflow flag
//! travels in the optimizer step's all-reduce ([`crate::optim::optimizer_step`]) before anyone
//! steps, so either every rank skips or none does.
//! bf16 has fp32's 8 exponent bits and needs no loss scaling.

use crate::comm::{CommResult, ProcessGroup, ReduceOp};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// The numeric format of compute (weights and activations in forward and backward).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32.
    #[default]
    Fp32,
    /// bfloat16 compute, f32 master weights and optimizer state; no loss scaling.
    Bf16,
    /// float16 compute with dynamic loss scaling ([`GradScaler`]).
    Fp16,
}

impl Precision {
    /// `fp32`, `bf16` or `fp16` (the command-line spelling).
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    /// The tensor kind of compute.
    pub fn kind(self) -> Kind {
        match self {
            Precision::Fp32 => Kind::Float,
            Precision::Bf16 => Kind::BFloat16,
            Precision::Fp16 => Kind::Half,
        }
    }
}

/// Dynamic loss scaling with PyTorch's `GradScaler` semantics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GradScaler {
    scale: f64,
    /// ×`growth_factor` after this many consecutive steps without overflow (PyTorch: 2000).
    pub growth_interval: u64,
    /// PyTorch: 2.0.
    pub growth_factor: f64,
    /// ×`backoff_factor` on overflow (PyTorch: 0.5).
    pub backoff_factor: f64,
    growth_tracker: u64,
    /// Steps skipped because of an overflow, so far.
    pub skipped: u64,
}

impl Default for GradScaler {
    /// PyTorch's defaults: initial scale 2¹⁶, ×2 after 2000 clean steps, ×0.5 on overflow.
    fn default() -> Self {
        GradScaler::new(65536.0)
    }
}

impl GradScaler {
    /// A scaler starting at `init_scale`, with PyTorch's growth and backoff rules.
    pub fn new(init_scale: f64) -> Self {
        GradScaler {
            scale: init_scale,
            growth_interval: 2000,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_tracker: 0,
            skipped: 0,
        }
    }

    /// The current scale S: multiply the loss by it before backward.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Divide every defined gradient by S in place (PyTorch's `scaler.unscale_(opt)`); the
    /// optimizer step's agreed non-finite check then decides whether to skip
    /// ([`optimizer_step`](crate::optim::optimizer_step) with [`NonFinite::Skip`](crate::optim::NonFinite::Skip)).
    pub fn unscale(&self, grads: &[Tensor]) {
        let inv = 1.0 / self.scale;
        tch::no_grad(|| grads.iter().filter(|g| g.defined()).for_each(|g| _ = g.shallow_clone().g_mul_scalar_(inv)));
    }

    /// Divide every gradient by S in place and report whether any rank saw an inf or a NaN (the
    /// flag is all-reduced with max over `pg`, so every rank returns the same answer). Call after
    /// the synchronised backward, before clipping and the optimizer step.
    pub fn unscale_and_check(&self, pg: &ProcessGroup, grads: &[Tensor]) -> CommResult<bool> {
        self.unscale(grads);
        let mut flags = Vec::new();
        for g in grads.iter().filter(|g| g.defined()) {
            flags.push(g.isfinite().logical_not().any()); // one flag per tensor, read once below
        }
        let local_bad = !flags.is_empty() && Tensor::stack(&flags, 0).any().int64_value(&[]) != 0;
        let mut flag = Tensor::from_slice(&[local_bad as u8 as f32]);
        pg.all_reduce(&mut flag, ReduceOp::Max)?; // (1,) f32: any rank overflowed
        Ok(flag.double_value(&[0]) > 0.0)
    }

    /// After the step (taken or skipped): back off on overflow, grow after `growth_interval`
    /// clean steps in a row. Returns whether the step had to be skipped.
    pub fn update(&mut self, found_inf: bool) -> bool {
        if found_inf {
            self.scale *= self.backoff_factor;
            self.growth_tracker = 0;
            self.skipped += 1;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.growth_interval {
                self.scale *= self.growth_factor;
                self.growth_tracker = 0;
            }
        }
        found_inf
    }
}
