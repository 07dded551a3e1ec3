//! Data parallelism's collectives in one step of `sim::step`: what the gradient reduction (and,
//! with ZeRO, the parameters' gathers) adds to the step once the pipeline is done, by ZeRO stage.
//!
//! * ZeRO-0 (DDP): one all-reduce of the gradients after the last backward; with
//!   `overlap_grad_reduce` only what outlasts the last micro-batch's backward shows (PyTorch's
//!   last bucket, ready only when the backward ends, is always exposed: not counted, a bucket's
//!   all-reduce being small beside a step of these sizes);
//! * ZeRO-1: a reduce-scatter of the gradients once a step (overlapped the same way), then the
//!   updated weights all-gathered after the optimizer, with nothing left to hide behind;
//! * ZeRO-2: only 1/dp of the gradients is kept, so they are reduce-scattered after every
//!   micro-batch's backward, hidden behind the next micro-batch's work as far as it lasts;
//! * ZeRO-3: every micro-batch and chunk gathers its parameters for the forward and again for the
//!   backward and reduce-scatters its gradients; prefetched behind the compute, the first gather
//!   exposed.
//!
//! Bytes: `params` elements of this rank's share of the model (its pipeline stage, split over tp),
//! gathered in the weights' precision and reduced in the gradients'.

use super::collective::{time, Coll, Placement};
use super::hardware::Gpu;

/// What one step's data-parallel reduction has to work with.
pub struct DpStep {
    /// Parameters of this rank's share (its stage over tp), elements.
    pub params: f64,
    /// Bytes an element of the weights (gathered) and of the gradients (reduced).
    pub weight_bytes: f64,
    pub grad_bytes: f64,
    pub zero: u8,
    pub overlap_grad_reduce: bool,
    /// Micro-batches a step and chunks a rank (the interleaved schedule's v).
    pub micro_batches: usize,
    pub chunks: usize,
    /// The last backward a reduction can hide behind (the first rank's last micro-batch).
    pub last_backward: f64,
    /// The rank's compute, and its compute with tensor parallelism's collectives, for the step.
    pub compute: f64,
    pub busy: f64,
}

/// Seconds of data-parallel communication the step does not hide, on a dp group placed `dp_at`.
pub fn exposed(gpu: &Gpu, s: &DpStep, dp_at: Placement) -> f64 {
    let gather_params = time(gpu, Coll::AllGather, s.params * s.weight_bytes, dp_at);
    let reduce_scatter = time(gpu, Coll::ReduceScatter, s.params * s.grad_bytes, dp_at);
    let overlapped = |reduce: f64| if s.overlap_grad_reduce { (reduce - s.last_backward).max(0.0) } else { reduce };
    match s.zero {
        0 => overlapped(time(gpu, Coll::AllReduce, s.params * s.grad_bytes, dp_at)),
        1 => overlapped(reduce_scatter) + gather_params,
        2 => {
            let hidden = if s.overlap_grad_reduce { s.last_backward } else { 0.0 };
            (s.micro_batches as f64 * reduce_scatter - s.busy).max(reduce_scatter - hidden).max(0.0) + gather_params
        }
        _ => {
            let chunk = s.params / s.chunks as f64;
            let gather = time(gpu, Coll::AllGather, chunk * s.weight_bytes, dp_at);
            let reduce = time(gpu, Coll::ReduceScatter, chunk * s.grad_bytes, dp_at);
            let ops = (s.micro_batches * s.chunks) as f64;
            gather + (ops * (2.0 * gather + reduce) - s.compute).max(0.0)
        }
    }
}
