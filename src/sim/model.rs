//! The simulated model: a GPT of any shape (learned positions, LayerNorm, a GeLU MLP of width
//! `ffn`, a tied output layer), its parameters, and the work one layer does for one micro-batch
//! on one tensor-parallel rank.
//!
//! Forward FLOPs of one layer for b sequences of s tokens, hidden h, MLP width f:
//!
//! ```text
//! QKV 6bsh² + projection 2bsh² + MLP 4bshf       (the dense GEMMs)
//! + scores QKᵀ 2bs²h + weighted sum 2bs²h         (the attention's batched GEMMs)
//! = 24bsh²(1 + s/(6h)) with f = 4h                (Narayanan et al. 2021, §5.1)
//! ```
//!
//! The backward does twice the forward's FLOPs. Element-wise work (LayerNorms, GeLU, softmax,
//! dropout, residual adds) is bound by memory traffic; `elementwise_bytes` counts what one
//! forward reads and writes in 16-bit activations (1-byte dropout masks): per layer
//!
//! ```text
//! LayerNorm ×2 8bsh · bias+dropout+residual ×2 14bsh       (replicated, or /t with sequence parallelism)
//! bias+GeLU 4bsf                                          (/t)
//! scale-mask-softmax 4·a·b·s² · attention dropout 5·a·b·s²  (/t)
//! ```

use super::gemm::Gemm;
use serde::{Deserialize, Serialize};

/// A GPT's shape.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Model {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    /// The MLP's inner width (4·hidden in GPT-2/3).
    pub ffn: usize,
    /// Tokens per sequence.
    pub seq: usize,
    pub vocab: usize,
}

impl Model {
    /// GPT-3's shape for `layers`, `hidden`, `heads` (f = 4h), with Megatron's padded GPT-2
    /// vocabulary of 51,200 and sequences of 2,048 — the models of Narayanan et al. 2021.
    pub fn gpt(layers: usize, hidden: usize, heads: usize) -> Model {
        Model { layers, hidden, heads, ffn: 4 * hidden, seq: 2048, vocab: 51200 }
    }

    /// Checks the shape: every size positive, heads dividing the hidden size.
    pub fn check(&self) -> Result<(), String> {
        let m = self;
        if [m.layers, m.hidden, m.heads, m.ffn, m.seq, m.vocab].contains(&0) {
            return Err(format!("every size of the model must be positive: {m:?}"));
        }
        if m.hidden % m.heads != 0 {
            return Err(format!("{} heads do not divide the hidden size {}", m.heads, m.hidden));
        }
        Ok(())
    }

    /// Parameters of one layer: QKV and projection with biases, the MLP with biases, two
    /// LayerNorms.
    pub fn layer_params(&self) -> f64 {
        let (h, f) = (self.hidden as f64, self.ffn as f64);
        4.0 * h * h + 4.0 * h + 2.0 * h * f + f + h + 4.0 * h
    }

    /// All parameters: the layers, the token and position embeddings (the output layer is the
    /// token embedding), the final LayerNorm.
    pub fn params(&self) -> f64 {
        let (h, v, s) = (self.hidden as f64, self.vocab as f64, self.seq as f64);
        self.layers as f64 * self.layer_params() + (v + s) * h + 2.0 * h
    }

    /// Model FLOPs per token of training (6 per parameter that multiplies an activation, plus
    /// the attention's, counted as full: nanoGPT's and PaLM's count, `shardlab::flops`).
    pub fn model_flops_per_token(&self) -> f64 {
        let (h, l, s) = (self.hidden as f64, self.layers as f64, self.seq as f64);
        let matmul = self.params() - s * h; // the position embedding is a lookup
        6.0 * matmul + 12.0 * l * h * s
    }

    /// Forward FLOPs of one layer for `b` sequences on one of `tp` tensor-parallel ranks:
    /// (dense, attention) — module docs.
    pub fn layer_forward_flops(&self, b: f64, tp: f64) -> (f64, f64) {
        let (h, f, s) = (self.hidden as f64, self.ffn as f64, self.seq as f64);
        ((8.0 * b * s * h * h + 4.0 * b * s * h * f) / tp, 4.0 * b * s * s * h / tp)
    }

    /// The forward GEMMs of one layer for `b` sequences on one of `tp` ranks: the dense ones
    /// (QKV, projection, MLP up and down, over b·s tokens) and the attention's batched ones
    /// (scores and weighted sum, one per sequence and local head). Their FLOPs are
    /// [`layer_forward_flops`](Self::layer_forward_flops)'s.
    pub fn layer_gemms(&self, b: usize, tp: usize) -> ([Gemm; 4], [Gemm; 2]) {
        let (h, f, s, a) = (self.hidden, self.ffn, self.seq, self.heads);
        let (m, d) = (b * s, h / a);
        let g = |k, n| Gemm { batch: 1, m, k, n };
        let heads = b * a / tp;
        (
            [g(h, 3 * h / tp), g(h / tp, h), g(h, f / tp), g(f / tp, h)],
            [Gemm { batch: heads, m: s, k: d, n: s }, Gemm { batch: heads, m: s, k: s, n: d }],
        )
    }

    /// The output layer's forward GEMM for `b` sequences on one of `tp` ranks.
    pub fn logits_gemm(&self, b: usize, tp: usize) -> Gemm {
        Gemm { batch: 1, m: b * self.seq, k: self.hidden, n: self.vocab / tp }
    }

    /// Bytes one layer's forward element-wise kernels read and write for `b` sequences on one
    /// of `tp` ranks: (outside attention, attention's s × s part) — module docs.
    pub fn elementwise_bytes(&self, b: f64, tp: f64, sequence_parallel: bool) -> (f64, f64) {
        let (h, f, s, a) = (self.hidden as f64, self.ffn as f64, self.seq as f64, self.heads as f64);
        let replicated = 22.0 * b * s * h / if sequence_parallel { tp } else { 1.0 };
        (replicated + 4.0 * b * s * f / tp, 9.0 * a * b * s * s / tp)
    }

    /// FLOPs one training iteration of `batch` sequences computes under `recompute`, as Megatron
    /// counts them (f = 4h; Korthikanti et al. 2022 §6): 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))
    /// recomputing nothing, the attention's s·h term doubled under selective recomputation, and
    /// [`megatron_flops`](Self::megatron_flops) under full.
    pub fn hardware_flops(&self, batch: f64, recompute: crate::memory::Recompute) -> f64 {
        use crate::memory::Recompute;
        let (h, l, s, v) = (self.hidden as f64, self.layers as f64, self.seq as f64, self.vocab as f64);
        match recompute {
            Recompute::None => 72.0 * batch * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h)),
            Recompute::Selective => 72.0 * batch * s * l * h * h * (1.0 + s / (3.0 * h) + v / (12.0 * l * h)),
            Recompute::Full => self.megatron_flops(batch),
        }
    }

    /// FLOPs of one training iteration of `batch` sequences as Narayanan et al. 2021 count them
    /// (their Eq. 3, f = 4h): with the recomputed forward of full activation checkpointing,
    /// 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)). Their Table 1's TFLOP/s are this over the time.
    pub fn megatron_flops(&self, batch: f64) -> f64 {
        let (h, l, s, v) = (self.hidden as f64, self.layers as f64, self.seq as f64, self.vocab as f64);
        96.0 * batch * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt3_175b_has_175b_parameters() {
        // GPT-3's largest model (Brown et al. 2020, Table 2.1): 96 layers, 12,288 wide, 96 heads.
        let m = Model::gpt(96, 12288, 96);
        assert!((m.params() / 1e9 - 174.6).abs() < 0.5, "{}", m.params() / 1e9);
        // Megatron's Eq. 3 is 4/3 of the model FLOPs when the logits and attention agree: one
        // extra forward in four passes.
        let ratio = m.megatron_flops(1.0) / (m.model_flops_per_token() * 2048.0);
        assert!((ratio - 4.0 / 3.0).abs() < 0.01, "{ratio}");
    }

    #[test]
    fn a_layers_forward_is_24bsh2_with_the_attention_term() {
        let m = Model::gpt(1, 1024, 16);
        let (dense, attn) = m.layer_forward_flops(2.0, 1.0);
        let (b, s, h) = (2.0, 2048.0, 1024.0);
        let want = 24.0 * b * s * h * h * (1.0 + s / (6.0 * h));
        assert!(((dense + attn) - want).abs() / want < 1e-12);
        let (d4, a4) = m.layer_forward_flops(2.0, 4.0);
        assert_eq!((d4 * 4.0, a4 * 4.0), (dense, attn));
        // The GEMMs' shapes hold the same FLOPs.
        let (g, at) = m.layer_gemms(2, 4);
        let sum = |x: &[Gemm]| x.iter().map(Gemm::flops).sum::<f64>();
        assert!((sum(&g) - d4).abs() < 1e-6 * d4 && (sum(&at) - a4).abs() < 1e-6 * a4);
    }
}
