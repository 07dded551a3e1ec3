//! AdamW on one rank's shard of a flat parameter buffer: the optimizer ZeRO shards.
//!
//! The same arithmetic as libtorch's `torch::optim::AdamW` (which tch's `nn::AdamW` runs), element
//! for element, so a sharded step equals the replicated one: decoupled weight decay
//! `p ← p·(1 − lr·wd)`, `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`,
//! `p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)`. Weight decay follows nanoGPT's groups: per
//! element, decayed where the element belongs to a tensor with two or more dimensions.

use super::flat::FlatLayout;
use crate::optim::AdamWConfig;
use tch::{Kind, Tensor};

/// Moments and decay factors of one shard.
pub struct ShardedAdamW {
    pub cfg: AdamWConfig,
    /// (shard,) f32 each.
    pub m: Tensor,
    pub v: Tensor,
    /// (shard,) f32: 1 − lr·wd where decayed, 1 elsewhere (padding included).
    decay: Tensor,
    pub step: u64,
}

impl ShardedAdamW {
    /// State for rank `rank`'s shard of `layout`.
    pub fn new(cfg: AdamWConfig, layout: &FlatLayout, rank: usize) -> Self {
        let keep = (1.0 - cfg.lr * cfg.weight_decay) as f32;
        let mut d = vec![1f32; layout.shard as usize];
        for (i, _within, in_shard) in layout.shard_pieces(rank) {
            if layout.shapes[i].len() >= 2 {
                d[in_shard.start as usize..in_shard.end as usize].iter_mut().for_each(|x| *x = keep);
            }
        }
        let z = || Tensor::zeros([layout.shard], (Kind::Float, tch::Device::Cpu));
        ShardedAdamW { cfg, m: z(), v: z(), decay: Tensor::from_slice(&d), step: 0 }
    }
    /// Bytes of optimizer state held (m and v).
    pub fn state_bytes(&self) -> u64 {
        ((self.m.numel() + self.v.numel()) * 4) as u64
    }
    /// One AdamW step on `p` (the shard's parameters, updated in place) with gradient `g`.
    pub fn update(&mut self, p: &mut Tensor, g: &Tensor) {
        let c = self.cfg;
        self.step += 1;
        let t = self.step as i32;
        let (bc1, bc2) = (1.0 - c.beta1.powi(t), 1.0 - c.beta2.powi(t));
        tch::no_grad(|| {
            let _ = p.g_mul_(&self.decay); // decoupled weight decay
            let _ = self.m.g_mul_scalar_(c.beta1).g_add_(&(g * (1.0 - c.beta1)));
            let _ = self.v.g_mul_scalar_(c.beta2).g_add_(&(g * g * (1.0 - c.beta2)));
            let denom = (self.v.sqrt() / bc2.sqrt()) + c.eps;
            let _ = p.g_sub_(&(&self.m / denom * (c.lr / bc1)));
        });
    }
}
