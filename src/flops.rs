//! Model FLOPs and MFU (lesson 11): how much of the hardware's peak a training run uses.
//!
//! A training step of a decoder does, per token, 6 FLOPs per parameter that multiplies an
//! activation (2 forward, 4 backward: the gradients of the input and of the weight) plus the
//! attention scores and their weighted sum, 12·L·C·T (forward 4·L·C·T over a causal window of T,
//! counted as full, ×3 for backward) — nanoGPT's `estimate_mfu` and the PaLM paper's appendix B:
//!
//! ```text
//! flops_per_token = 6·N + 12·L·C·T      N: parameters except the position embedding
//! MFU = tokens/s (all ranks) × flops_per_token / (devices × peak FLOP/s per device)
//! ```
//!
//! These are *model* FLOPs: recomputation (activation checkpointing, ZeRO-3's re-gather) does
//! not count, so MFU says how fast the model trains, not how busy the chips are.

use crate::model::GptConfig;
use crate::precision::Precision;

/// Parameters that multiply activations: every parameter of the GPT except the position
/// embedding (a lookup). The tied token embedding counts once, as the output projection.
pub fn matmul_params(cfg: &GptConfig) -> f64 {
    let (v, c, l) = (cfg.vocab_size as f64, cfg.n_embd as f64, cfg.n_layer as f64);
    // wte (= lm_head) + per block: two LayerNorms (4C), qkv (3C² + 3C), attention projection
    // (C² + C), MLP (4C² + 4C and 4C² + C) + the final LayerNorm (2C).
    v * c + l * (12.0 * c * c + 13.0 * c) + 2.0 * c
}

/// Training FLOPs per token: 6·N + 12·L·C·T (module docs).
pub fn flops_per_token(cfg: &GptConfig) -> f64 {
    let (c, l, t) = (cfg.n_embd as f64, cfg.n_layer as f64, cfg.block_size as f64);
    6.0 * matmul_params(cfg) + 12.0 * l * c * t
}

/// Model FLOPs utilisation: the fraction of `devices` × `peak_tflops` that `tokens_per_s` (all
/// ranks together) of a model of `flops_per_token` amounts to.
pub fn mfu(tokens_per_s: f64, flops_per_token: f64, devices: usize, peak_tflops: f64) -> f64 {
    tokens_per_s * flops_per_token / (devices as f64 * peak_tflops * 1e12)
}

/// Dense peak TFLOP/s of a GPU in a precision, from its name as CUDA reports it (data sheets,
/// no sparsity); `None` for a device not in the table, or a precision it has no tensor cores for
/// (give `--peak-tflops`). fp32 is the CUDA-core rate: libtorch leaves TF32 off for matmuls by
/// default, so fp32 matmuls do not run on the tensor cores.
pub fn peak_tflops(device_name: &str, precision: Precision) -> Option<f64> {
    let n = device_name.to_ascii_uppercase();
    // (name fragment, bf16, fp16, fp32); the first fragment that matches wins, so the more specific
    // names come first ("H100 NVL" before "H100", "L40S" before "L40" before "L4").
    const TABLE: &[(&str, Option<f64>, f64, f64)] = &[
        ("GB200", None, 0.0, 0.0), // per-GPU figures differ from B200's: not in this table
        ("B200", Some(2250.0), 2250.0, 80.0),
        ("H200 NVL", Some(835.0), 835.0, 60.0),
        ("H200", Some(989.0), 989.0, 67.0),
        ("H100 NVL", Some(835.0), 835.0, 60.0),
        ("H100 PCIE", Some(756.0), 756.0, 51.0),
        ("H100", Some(989.0), 989.0, 67.0),
        ("H800 PCIE", Some(756.0), 756.0, 51.0),
        ("H800", Some(989.0), 989.0, 67.0),
        ("A100", Some(312.0), 312.0, 19.5),
        ("A800", Some(312.0), 312.0, 19.5),
        ("L40S", Some(362.0), 362.0, 91.6),
        ("L40", Some(181.0), 181.0, 90.5),
        ("L4", Some(121.0), 121.0, 30.3),
        ("RTX 4090", Some(165.0), 165.0, 82.6),
        ("V100", None, 125.0, 15.7),
        ("T4", None, 65.0, 8.1),
    ];
    let (_, bf16, fp16, fp32) = TABLE.iter().find(|(k, ..)| n.contains(k))?;
    let peak = match precision {
        Precision::Bf16 => (*bf16)?,
        Precision::Fp16 => *fp16,
        Precision::Fp32 => *fp32,
    };
    (peak > 0.0).then_some(peak)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_small_by_hand() {
        // GPT-2 124M (V 50257, T 1024, L 12, C 768): nanoGPT prints "number of parameters: 123.65M"
        // (all parameters but wpe) — 123,653,376.
        let cfg = GptConfig { vocab_size: 50257, block_size: 1024, n_layer: 12, n_head: 12, n_embd: 768 };
        assert_eq!(matmul_params(&cfg), 123_653_376.0);
        // 6 × 123,653,376 + 12 × 12 × 768 × 1024 = 741,920,256 + 113,246,208.
        assert_eq!(flops_per_token(&cfg), 855_166_464.0);
        // 100k tokens/s on one H100 in bf16: 8.55e13 / 9.89e14.
        let m = mfu(1e5, flops_per_token(&cfg), 1, peak_tflops("NVIDIA H100 80GB HBM3", Precision::Bf16).unwrap());
        assert!((m - 0.08647).abs() < 1e-4, "{m}");
        assert_eq!(peak_tflops("NVIDIA H100 PCIe", Precision::Bf16), Some(756.0));
        assert_eq!(peak_tflops("NVIDIA H200", Precision::Fp32), Some(67.0), "CUDA cores: TF32 is off by default");
        assert_eq!(peak_tflops("NVIDIA L40", Precision::Bf16), Some(181.0), "not the L4's row");
        assert_eq!(peak_tflops("NVIDIA H100 NVL", Precision::Bf16), Some(835.0));
        assert_eq!(peak_tflops("Tesla V100-SXM2-32GB", Precision::Bf16), None, "no bf16 tensor cores");
        assert_eq!(peak_tflops("NVIDIA GB200", Precision::Bf16), None);
        assert_eq!(peak_tflops("cpu", Precision::Bf16), None);
    }

    #[test]
    fn matmul_params_are_the_models_parameters_but_wpe() {
        for cfg in [GptConfig::tiny(), GptConfig { vocab_size: 100, block_size: 8, n_layer: 3, n_head: 4, n_embd: 24 }]
        {
            let m = crate::model::Gpt::new(cfg, 1).unwrap();
            use crate::model::Model;
            let (mut all, mut wpe) = (0i64, 0i64);
            for (name, p) in m.named_parameters() {
                all += p.numel() as i64;
                if name.contains("wpe") {
                    wpe += p.numel() as i64;
                }
            }
            assert!(wpe > 0, "the model has a position embedding");
            assert_eq!(matmul_params(&cfg), (all - wpe) as f64, "{cfg:?}: counted from the model's own tensors");
        }
    }
}
