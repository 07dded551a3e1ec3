//! The optimizer: AdamW with nanoGPT's parameter groups (matrices and embeddings decayed, biases
//! and LayerNorm gains not), run by libtorch's own `torch::optim::AdamW` through tch — so every
//! strategy here is held to PyTorch's AdamW semantics.

use crate::model::Model;
use serde::{Deserialize, Serialize};
use tch::nn::{self, OptimizerConfig};

/// AdamW hyper-parameters (nanoGPT's defaults except the learning rate).
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
    /// libtorch's AdamW over `model`'s parameters: group 0 decayed, group 1 not.
    pub fn build(&self, model: &dyn Model) -> anyhow::Result<nn::Optimizer> {
        let mut opt =
            nn::AdamW { beta1: self.beta1, beta2: self.beta2, wd: self.weight_decay, eps: self.eps, amsgrad: false }
                .build(model.var_store(), self.lr)?;
        opt.set_weight_decay_group(0, self.weight_decay);
        opt.set_weight_decay_group(1, 0.0);
        Ok(opt)
    }
}
