//! Tensor parallelism's collectives in one step of `sim::step`, per micro-batch, as Megatron-LM
//! (and the course's `tp` module) run them on a tp group:
//!
//! * every layer: its two blocks' outputs all-reduced forward (g) and their inputs' gradients
//!   backward (f) — with sequence parallelism an all-gather and a reduce-scatter of the same b·s·h
//!   activation in place of each all-reduce; full recomputation repeats the forward's two;
//! * the vocabulary-parallel embedding (first virtual stage): its output summed over the ranks'
//!   vocabulary slices, an all-reduce forward; with sequence parallelism a reduce-scatter forward
//!   and its all-gather backward;
//! * the output layer and the loss (last virtual stage): with sequence parallelism the final
//!   activation gathered forward; the vocabulary-parallel cross-entropy's three all-reduces of one
//!   fp32 number a token (the logits' max, the sum of their exponentials, the target's logit); and
//!   the head's input gradient summed backward (all-reduce, or reduce-scatter with sequence
//!   parallelism).
//!
//! Not charged: with sequence parallelism, the backward's re-gather of each LayerNorm output for
//! the weight gradients (Megatron overlaps it with the input gradient's GEMM); the LayerNorm and
//! bias gradients' small all-reduces over tp; the tied embedding's gradient between the first and
//! last pipeline ranks; the optimizer's one small agreement all-reduce.
//!
//! Bytes for one micro-batch of b sequences of s tokens, width h: each activation collective moves
//! b·s·h elements of the activation's precision (2 or 4 bytes), the loss's 4·b·s bytes each.

use super::collective::{time, Coll, Placement};
use super::hardware::Gpu;

/// Seconds of tensor-parallel communication per layer and at the model's two ends, for one
/// micro-batch.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TpComm {
    /// One layer's forward and backward (backward includes full recomputation's repeat).
    pub layer_forward: f64,
    pub layer_backward: f64,
    /// The embedding's forward and backward (first virtual stage).
    pub embedding_forward: f64,
    pub embedding_backward: f64,
    /// The output layer and loss: forward and backward (last virtual stage).
    pub head_forward: f64,
    pub head_backward: f64,
}

impl TpComm {
    /// `activation_bytes`: one micro-batch's b·s·h activation; `tokens`: its b·s; `tp_at`: the
    /// tp group's placement (no cost when it has one rank).
    pub fn new(
        gpu: &Gpu,
        activation_bytes: f64,
        tokens: f64,
        tp_at: Placement,
        sequence_parallel: bool,
        full_recompute: bool,
    ) -> TpComm {
        if tp_at.size <= 1 {
            return TpComm::default();
        }
        let all_reduce = time(gpu, Coll::AllReduce, activation_bytes, tp_at);
        let gather = time(gpu, Coll::AllGather, activation_bytes, tp_at);
        let scatter = time(gpu, Coll::ReduceScatter, activation_bytes, tp_at);
        // One of the layer's two (g forward, f backward): sequence parallelism's pair, or an all-reduce.
        let one = if sequence_parallel { gather + scatter } else { all_reduce };
        // A sum over the ranks: an all-reduce, or with sequence parallelism a reduce-scatter.
        let sum = if sequence_parallel { scatter } else { all_reduce };
        let loss = 3.0 * time(gpu, Coll::AllReduce, 4.0 * tokens, tp_at);
        TpComm {
            layer_forward: 2.0 * one,
            layer_backward: 2.0 * one + if full_recompute { 2.0 * one } else { 0.0 },
            embedding_forward: sum,
            embedding_backward: if sequence_parallel { gather } else { 0.0 },
            head_forward: if sequence_parallel { gather } else { 0.0 } + loss,
            head_backward: sum,
        }
    }

    /// Seconds for `layers` layers of virtual stage `k` of `stages`, forward or backward.
    pub fn of(&self, layers: f64, k: usize, stages: usize, forward: bool) -> f64 {
        let (first, last) = (k == 0, k + 1 == stages);
        if forward {
            layers * self.layer_forward
                + if first { self.embedding_forward } else { 0.0 }
                + if last { self.head_forward } else { 0.0 }
        } else {
            layers * self.layer_backward
                + if first { self.embedding_backward } else { 0.0 }
                + if last { self.head_backward } else { 0.0 }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::hardware::profile;

    #[test]
    fn the_ends_of_the_model_add_their_collectives_where_they_run() {
        let gpu = profile("h100-80gb").unwrap();
        let (act, tokens) = (2.0 * 4096.0 * 8192.0, 4096.0);
        let at = Placement { size: 8, per_node: 8 };
        let ar = time(&gpu, Coll::AllReduce, act, at);
        let loss = time(&gpu, Coll::AllReduce, 4.0 * tokens, at);
        let c = TpComm::new(&gpu, act, tokens, at, false, false);
        // 10 layers on each of 4 virtual stages: every stage 4 all-reduces a layer; the first adds
        // the embedding's forward all-reduce (nothing backward), the last the loss's three forward and the head's
        // input gradient backward.
        let middle = c.of(10.0, 1, 4, true);
        assert!((middle - 20.0 * ar).abs() < 1e-12 * middle);
        assert!((c.of(10.0, 0, 4, true) - middle - ar).abs() < 1e-12 * middle);
        assert!((c.of(10.0, 3, 4, true) - middle - 3.0 * loss).abs() < 1e-12 * middle);
        assert!(
            (c.of(10.0, 0, 4, false) - c.of(10.0, 1, 4, false)).abs() < 1e-12 * middle,
            "the embedding's backward sends nothing"
        );
        assert!((c.of(10.0, 3, 4, false) - c.of(10.0, 1, 4, false) - ar).abs() < 1e-12 * middle);
        // One stage holds both ends.
        assert!((c.of(10.0, 0, 1, true) - middle - ar - 3.0 * loss).abs() < 1e-12 * middle);
        // Sequence parallelism: a reduce-scatter and an all-gather of the same bytes in place of
        // each all-reduce; the head's input is gathered first.
        let sp = TpComm::new(&gpu, act, tokens, at, true, false);
        let (ag, rs) = (time(&gpu, Coll::AllGather, act, at), time(&gpu, Coll::ReduceScatter, act, at));
        assert!((sp.embedding_forward - rs).abs() < 1e-15 && (sp.head_forward - ag - 3.0 * loss).abs() < 1e-12);
        assert!(
            (sp.of(10.0, 0, 4, false) - sp.of(10.0, 1, 4, false) - ag).abs() < 1e-12,
            "the embedding's reduce-scatter is gathered back in backward"
        );
        assert!((sp.layer_forward - 2.0 * (ag + rs)).abs() < 1e-12);
        // Full recomputation repeats the forward's two in backward; one rank has no tp group.
        assert!((TpComm::new(&gpu, act, tokens, at, false, true).layer_backward - 4.0 * ar).abs() < 1e-12);
        assert_eq!(TpComm::new(&gpu, act, tokens, Placement { size: 1, per_node: 8 }, false, false), TpComm::default());
    }
}
