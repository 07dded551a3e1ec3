//! Tensor parallelism's collectives in one step of `sim::step`, per micro-batch, as Megatron-LM
//! (and the course's `tp` module) run them on a tp group ([`charged`] lists them):
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
//! Not charged ([`uncharged`] lists the first two, so that `plan` can say what they would add):
//! with sequence parallelism, the backward's re-gather of each layer's two LayerNorm outputs for
//! the weight gradients (Megatron overlaps it with the input gradient's GEMM), and the replicated
//! parameters' gradient all-reduces (each layer's two LayerNorms and two output biases, 6·h
//! elements, and the final LayerNorm's 2·h; Megatron runs them once a step, the course's `TpGpt`
//! in each forward-backward); the tied embedding's gradient between the first and last pipeline
//! ranks; the optimizer's one small agreement all-reduce.
//!
//! Bytes for one micro-batch of b sequences of s tokens, width h: each activation collective moves
//! b·s·h elements of the activation's precision (2 or 4 bytes), the loss's 4·b·s bytes each.
//! `tests/sim.rs` runs the course's `TpGpt` on thread ranks and checks both lists against the
//! collectives it really calls and the bytes it really sends.

use super::collective::{time, Coll, Placement};
use super::hardware::Gpu;

/// Where in the model a tensor-parallel collective runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// Every layer (a [`charged`] list holds one layer's).
    Layer,
    /// The vocabulary-parallel embedding (first virtual stage).
    Embedding,
    /// The output layer and the loss (last virtual stage).
    Head,
}

/// One collective over the tp group for one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TpCollective {
    pub coll: Coll,
    /// The whole buffer's bytes, as [`time`] takes them (an all-gather's gathered output).
    pub bytes: f64,
    pub part: Part,
    pub forward: bool,
}

fn c(coll: Coll, bytes: f64, part: Part, forward: bool) -> TpCollective {
    TpCollective { coll, bytes, part, forward }
}

/// The collectives the simulator charges for one micro-batch: one layer's, the embedding's and
/// the head's. `activation_bytes`: the b·s·h activation; `tokens`: b·s.
pub fn charged(activation_bytes: f64, tokens: f64, sequence_parallel: bool, full_recompute: bool) -> Vec<TpCollective> {
    let a = activation_bytes;
    // One of the layer's two (g forward, f backward): sequence parallelism's pair, or an all-reduce.
    let one: &[Coll] = if sequence_parallel { &[Coll::AllGather, Coll::ReduceScatter] } else { &[Coll::AllReduce] };
    // A sum over the ranks: an all-reduce, or with sequence parallelism a reduce-scatter.
    let sum = if sequence_parallel { Coll::ReduceScatter } else { Coll::AllReduce };
    let mut v = Vec::new();
    let backward_blocks = if full_recompute { 4 } else { 2 };
    for (blocks, forward) in [(2, true), (backward_blocks, false)] {
        for _ in 0..blocks {
            v.extend(one.iter().map(|&k| c(k, a, Part::Layer, forward)));
        }
    }
    v.push(c(sum, a, Part::Embedding, true));
    if sequence_parallel {
        v.push(c(Coll::AllGather, a, Part::Embedding, false));
        v.push(c(Coll::AllGather, a, Part::Head, true));
    }
    v.extend((0..3).map(|_| c(Coll::AllReduce, 4.0 * tokens, Part::Head, true)));
    v.push(c(sum, a, Part::Head, false));
    v
}

/// What Megatron-LM and the course's `TpGpt` also run for one micro-batch that [`charged`]
/// leaves out: with sequence parallelism, each layer's two LayerNorm outputs gathered again in
/// backward and its replicated parameters' gradients (6·h elements of `grad_bytes`) all-reduced,
/// and the final LayerNorm's (2·h). Nothing without sequence parallelism: there every rank
/// computes the replicated parameters' gradients from the whole activations.
pub fn uncharged(activation_bytes: f64, hidden: f64, grad_bytes: f64, sequence_parallel: bool) -> Vec<TpCollective> {
    if !sequence_parallel {
        return vec![];
    }
    vec![
        c(Coll::AllGather, activation_bytes, Part::Layer, false),
        c(Coll::AllGather, activation_bytes, Part::Layer, false),
        c(Coll::AllReduce, 6.0 * hidden * grad_bytes, Part::Layer, false),
        c(Coll::AllReduce, 2.0 * hidden * grad_bytes, Part::Head, false),
    ]
}

/// Seconds of tensor-parallel communication per layer and at the model's two ends, for one
/// micro-batch, forward and backward (backward includes full recomputation's repeat).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TpComm {
    pub layer: [f64; 2],
    pub embedding: [f64; 2],
    pub head: [f64; 2],
}

impl TpComm {
    /// The seconds of `list` on a tp group placed `tp_at` (nothing when it has one rank).
    pub fn of_list(gpu: &Gpu, list: &[TpCollective], tp_at: Placement) -> TpComm {
        let mut s = TpComm::default();
        if tp_at.size <= 1 {
            return s;
        }
        for k in list {
            let pass = if k.forward { 0 } else { 1 };
            let slot = match k.part {
                Part::Layer => &mut s.layer,
                Part::Embedding => &mut s.embedding,
                Part::Head => &mut s.head,
            };
            slot[pass] += time(gpu, k.coll, k.bytes, tp_at);
        }
        s
    }

    /// What the simulator charges ([`charged`]): `activation_bytes` one micro-batch's b·s·h
    /// activation, `tokens` its b·s, `tp_at` the tp group's placement.
    pub fn new(
        gpu: &Gpu,
        activation_bytes: f64,
        tokens: f64,
        tp_at: Placement,
        sequence_parallel: bool,
        full_recompute: bool,
    ) -> TpComm {
        TpComm::of_list(gpu, &charged(activation_bytes, tokens, sequence_parallel, full_recompute), tp_at)
    }

    /// Seconds for `layers` layers of virtual stage `k` of `stages`, forward or backward, and
    /// the model's ends where stage `k` holds them.
    pub fn of(&self, layers: f64, k: usize, stages: usize, forward: bool) -> f64 {
        let pass = if forward { 0 } else { 1 };
        layers * self.layer[pass] + self.ends(k, stages, forward)
    }

    /// The model's ends alone: the embedding's on the first virtual stage, the head's and the
    /// loss's on the last.
    pub fn ends(&self, k: usize, stages: usize, forward: bool) -> f64 {
        let pass = if forward { 0 } else { 1 };
        (if k == 0 { self.embedding[pass] } else { 0.0 }) + (if k + 1 == stages { self.head[pass] } else { 0.0 })
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
        // the embedding's forward all-reduce (nothing backward), the last the loss's three forward
        // and the head's input gradient backward.
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
        assert!((c.ends(0, 1, true) - ar - 3.0 * loss).abs() < 1e-12 * middle && c.ends(1, 4, true) == 0.0);
        // Sequence parallelism: a reduce-scatter and an all-gather of the same bytes in place of
        // each all-reduce; the head's input is gathered first.
        let sp = TpComm::new(&gpu, act, tokens, at, true, false);
        let (ag, rs) = (time(&gpu, Coll::AllGather, act, at), time(&gpu, Coll::ReduceScatter, act, at));
        assert!((sp.embedding[0] - rs).abs() < 1e-15 && (sp.head[0] - ag - 3.0 * loss).abs() < 1e-12);
        assert!(
            (sp.of(10.0, 0, 4, false) - sp.of(10.0, 1, 4, false) - ag).abs() < 1e-12,
            "the embedding's reduce-scatter is gathered back in backward"
        );
        assert!((sp.layer[0] - 2.0 * (ag + rs)).abs() < 1e-12);
        // Full recomputation repeats the forward's two in backward; one rank has no tp group.
        assert!((TpComm::new(&gpu, act, tokens, at, false, true).layer[1] - 4.0 * ar).abs() < 1e-12);
        assert_eq!(TpComm::new(&gpu, act, tokens, Placement { size: 1, per_node: 8 }, false, false), TpComm::default());
        // What is left out costs something only with sequence parallelism.
        assert!(uncharged(act, 8192.0, 4.0, false).is_empty());
        let left = TpComm::of_list(&gpu, &uncharged(act, 8192.0, 4.0, true), at);
        assert!(left.layer[1] > 2.0 * ag && left.layer[0] == 0.0 && left.head[1] > 0.0);
    }
}
