//! How long a GEMM takes on a simulated GPU: its FLOPs at the GPU's large-GEMM efficiency, times
//! how much of the GPU its shape keeps busy.
//!
//! A GEMM's output is cut into tiles, one thread block each, and the blocks run in waves of one
//! per SM (NVIDIA's "Matrix Multiplication Background" guide, "Tile quantization" and "Wave
//! quantization": its A100 examples use 256 × 128 tiles on 108 SMs). A shape that needs 109
//! tiles runs two waves for barely more than one wave's work; an edge tile computes a full tile
//! for part of one. Both effects are counted, with 256 × 128 tiles:
//!
//! ```text
//! tiles = batch · ⌈m/256⌉ · ⌈n/128⌉          waves = ⌈tiles / SMs⌉
//! busy  = (batch · m · n) / (waves · SMs · 256 · 128)
//! time  = 2·batch·m·k·n / (peak · gemm_efficiency · busy)
//! ```
//!
//! A GEMM also reads its operands and writes its output, `2·batch·(m·k + k·n + m·n)` bytes in
//! 16-bit: its time is at least those bytes at the memory bandwidth (the roofline). The
//! attention's two batched GEMMs, whose k or n is the head size (64–160), sit below the ridge
//! point of an A100 (312 TFLOP/s over 2 TB/s: about 150 FLOPs a byte) and are bound by memory.
//!
//! The backward of `(m, k) × (k, n)` is two GEMMs of the same FLOPs with other outputs: the
//! input's gradient `(m, n) × (n, k)` and the weight's `(k, m) × (m, n)`.

use super::hardware::Gpu;
use crate::precision::Precision;

/// One GEMM: `batch` products of (m × k) by (k × n).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Gemm {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

/// One measured GEMM shape: seconds per call (a profile's table, `sim::calibrate`).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Timed {
    pub gemm: Gemm,
    pub seconds: f64,
}

/// A fused attention kernel measured (a profile's table, `sim::calibrate`): `batch` sequences ×
/// local heads, `seq` tokens, head size `head_dim`; seconds forward and backward.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TimedAttention {
    pub batch: usize,
    pub seq: usize,
    pub head_dim: usize,
    pub forward: f64,
    pub backward: f64,
}

/// The output tile the guide's examples use (rows, columns).
pub const TILE: (usize, usize) = (256, 128);

impl Gemm {
    pub fn flops(&self) -> f64 {
        2.0 * (self.batch * self.m) as f64 * self.k as f64 * self.n as f64
    }

    /// The fraction of `sms` SMs' tile slots that do useful work (module docs).
    pub fn busy(&self, sms: usize) -> f64 {
        let tiles = self.batch * self.m.div_ceil(TILE.0) * self.n.div_ceil(TILE.1);
        let waves = tiles.div_ceil(sms.max(1)).max(1);
        (self.batch * self.m * self.n) as f64 / (waves * sms.max(1) * TILE.0 * TILE.1) as f64
    }

    /// Its backward: the input's gradient and the weight's (or the second operand's).
    pub fn backward(&self) -> [Gemm; 2] {
        let Gemm { batch, m, k, n } = *self;
        [Gemm { batch, m, k: n, n: k }, Gemm { batch, m: k, k: m, n }]
    }

    /// Seconds on `gpu` in `precision`: the measured time where `gpu` has a table with this shape
    /// (a shape it lacks runs at its best measured rate).
    pub fn time(&self, gpu: &Gpu, precision: Precision) -> f64 {
        if let Some(t) = gpu.gemm_table.iter().find(|t| t.gemm == *self) {
            return t.seconds;
        }
        if !gpu.gemm_table.is_empty() {
            // A measured profile without this shape (`simulate_step` refuses a layout whose
            // shapes were not measured): its peak (`calibrate`'s: the best measured rate), no tiles.
            return self.flops() / gpu.peak_flops(precision);
        }
        let compute = self.flops() / (gpu.peak_flops(precision) * gpu.gemm_efficiency * self.busy(gpu.sms));
        // The roofline: a GEMM cannot finish before its operands are read and its output written.
        let elt = if precision == Precision::Fp32 { 4.0 } else { 2.0 };
        let bytes = elt * self.batch as f64 * (self.m * self.k + self.k * self.n + self.m * self.n) as f64;
        compute.max(bytes / (gpu.memory_bytes_per_s * gpu.memory_efficiency))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_tile_too_many_costs_a_wave() {
        // 108 tiles fill an A100's 108 SMs once; 109 need a second wave, half of it idle.
        let full = Gemm { batch: 1, m: 256 * 108, k: 4096, n: 128 };
        assert_eq!(full.busy(108), 1.0);
        let over = Gemm { batch: 1, m: 256 * 109, k: 4096, n: 128 };
        assert!((over.busy(108) - 109.0 / 216.0).abs() < 1e-12);
        // Half a tile at the edge: a full tile's work for half of one.
        let edge = Gemm { batch: 1, m: 128, k: 64, n: 128 };
        assert_eq!(edge.busy(1), 0.5);
        // The backward keeps the FLOPs and turns the output.
        let g = Gemm { batch: 3, m: 2048, k: 512, n: 1536 };
        for b in g.backward() {
            assert_eq!(b.flops(), g.flops());
        }
        assert_eq!(g.backward()[0], Gemm { batch: 3, m: 2048, k: 1536, n: 512 });
        assert_eq!(g.backward()[1], Gemm { batch: 3, m: 512, k: 2048, n: 1536 });
    }

    #[test]
    fn a_gemm_with_a_narrow_inner_dimension_waits_for_memory() {
        let a100 = crate::sim::profile("a100-80gb").unwrap();
        let bw = a100.memory_bytes_per_s * a100.memory_efficiency;
        // Attention scores of GPT-3 175B, one head: (2048 × 128) · (128 × 2048). 1.07 GFLOP over
        // 2·(2·2048·128 + 2048²) = 9.4 MB: 114 FLOPs a byte, under the A100's ridge point.
        let scores = Gemm { batch: 96, m: 2048, k: 128, n: 2048 };
        let bytes = 2.0 * 96.0 * (2.0 * 2048.0 * 128.0 + 2048.0 * 2048.0);
        assert!((scores.time(&a100, Precision::Bf16) - bytes / bw).abs() < 1e-12);
        // A layer's MLP GEMM (2048 tokens, 12288 → 49152): about 1,700 FLOPs a byte, bound by compute.
        let mlp = Gemm { batch: 1, m: 2048, k: 12288, n: 49152 };
        let compute = mlp.flops() / (a100.peak_flops(Precision::Bf16) * a100.gemm_efficiency * mlp.busy(a100.sms));
        assert_eq!(mlp.time(&a100, Precision::Bf16), compute);
    }
}
