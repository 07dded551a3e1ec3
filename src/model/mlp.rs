//! A small multi-layer perceptron for the first data-parallel lessons: `layers.{i}.weight/bias`,
//! tanh between layers, mean-squared-error loss. Each layer is one stage.

use super::{Batch, Model};
use crate::rng::Rng;
use serde::{Deserialize, Serialize};
use tch::{nn, Device, Tensor};

/// Layer widths: `sizes[0]` inputs, `sizes.last()` outputs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MlpConfig {
    pub sizes: Vec<i64>,
}

/// The MLP.
pub struct Mlp {
    pub cfg: MlpConfig,
    vs: nn::VarStore,
    params: Vec<(String, Tensor)>,
}

impl Mlp {
    /// Weights U(−1/√fan_in, 1/√fan_in) like `nn.Linear`, deterministic in `seed`.
    pub fn new(cfg: MlpConfig, seed: u64) -> anyhow::Result<Self> {
        if cfg.sizes.len() < 2 || cfg.sizes.iter().any(|&s| s < 1) {
            anyhow::bail!("an MLP needs at least two positive layer sizes, got {:?}", cfg.sizes);
        }
        let vs = nn::VarStore::new(Device::Cpu);
        let mut rng = Rng::new(seed);
        let mut params = Vec::new();
        for (i, w) in cfg.sizes.windows(2).enumerate() {
            let (fan_in, fan_out) = (w[0], w[1]);
            let bound = 1.0 / (fan_in as f64).sqrt();
            let mut u = |n: i64| -> Vec<f32> { (0..n).map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as f32).collect() };
            let weight = Tensor::from_slice(&u(fan_in * fan_out)).view([fan_out, fan_in]);
            let bias = Tensor::from_slice(&u(fan_out));
            let path = vs.root().sub("layers").sub(i);
            params.push((format!("layers.{i}.weight"), path.var_copy("weight", &weight)));
            params.push((format!("layers.{i}.bias"), path.set_group(1).var_copy("bias", &bias)));
        }
        Ok(Mlp { cfg, vs, params })
    }
    /// A regression problem for the MLP: `n` rows of inputs ~ N(0, 1) and targets
    /// `sin(x·a)` for a fixed random projection `a` — deterministic in `seed`.
    pub fn synthetic_batch(&self, n: i64, seed: u64) -> Batch {
        let (d_in, d_out) = (self.cfg.sizes[0], *self.cfg.sizes.last().unwrap());
        let mut rng = Rng::new(seed);
        let x = Tensor::from_slice(&rng.normal_vec((n * d_in) as usize, 1.0)).view([n, d_in]);
        let a = Tensor::from_slice(&Rng::new(12345).normal_vec((d_in * d_out) as usize, 1.0)).view([d_in, d_out]);
        let y = x.matmul(&a).sin();
        Batch { x, y }
    }
}

impl Model for Mlp {
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
    fn num_stages(&self) -> usize {
        self.cfg.sizes.len() - 1
    }
    fn stage_forward(&self, s: usize, x: &Tensor, batch: &Batch) -> Tensor {
        let input = if s == 0 { &batch.x } else { x };
        let y = input.linear(&self.params[2 * s].1, Some(&self.params[2 * s + 1].1));
        if s + 1 == self.num_stages() {
            y.mse_loss(&batch.y, tch::Reduction::Mean)
        } else {
            y.tanh()
        }
    }
    fn param_stages(&self) -> Vec<usize> {
        (0..self.params.len()).map(|i| i / 2).collect()
    }
}
