//! The published runs the simulator is checked against (lesson 15), with where each figure comes
//! from. Nothing in the simulator is fitted to them.

use super::model::Model;
use super::step::Layout;
use crate::memory::Recompute;
use crate::precision::Precision;

/// One row of a published table: a model, a layout, what was measured.
#[derive(Clone, Debug)]
pub struct Published {
    pub name: String,
    pub model: Model,
    pub layout: Layout,
    /// TFLOP/s per GPU as the paper counts them (Megatron's Eq. 3).
    pub tflops_per_gpu: f64,
    pub source: &'static str,
}

/// Narayanan et al. 2021 (arXiv 2104.04473), Table 1: weak scaling of GPT models on Selene's
/// A100-80GB nodes, sequences of 2,048 and a vocabulary of 51,200, full activation
/// recomputation, fp16 mixed precision (fp16 gradients reduced in fp16). The table gives heads, hidden size, layers, tp, pp, GPUs,
/// batch size and the achieved TFLOP/s per GPU; it does not give the micro-batch size or the
/// schedule, taken here as 1 and plain 1F1B (stated wherever the comparison is shown).
pub fn megatron_table_1() -> Vec<Published> {
    // (billions, heads, hidden, layers, tp, pp, gpus, batch, TFLOP/s per GPU)
    let rows: [(f64, usize, usize, usize, usize, usize, usize, usize, f64); 10] = [
        (1.7, 24, 2304, 24, 1, 1, 32, 512, 137.0),
        (3.6, 32, 3072, 30, 2, 1, 64, 512, 138.0),
        (7.5, 32, 4096, 36, 4, 1, 128, 512, 142.0),
        (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135.0),
        (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138.0),
        (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140.0),
        (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148.0),
        (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155.0),
        (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163.0),
        (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163.0),
    ];
    rows.iter()
        .map(|&(billions, heads, hidden, layers, tp, pp, gpus, batch, tflops)| {
            let mut layout = Layout::new(gpus / (tp * pp), tp, pp);
            layout.global_batch = batch;
            layout.recompute = Recompute::Full;
            layout.precision = Precision::Fp16;
            Published {
                name: format!("{billions}B"),
                model: Model::gpt(layers, hidden, heads),
                layout,
                tflops_per_gpu: tflops,
                source: "Narayanan et al. 2021, Table 1",
            }
        })
        .collect()
}
