//! Lesson 09 — activation checkpointing: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 09`. Hints: `cargo grade 09 --hint K`.
#![allow(unused_variables, unused_imports, unused_mut)]

use shardlab::model::{Batch, Model};
use shardlab::prelude::*;

/// Exercise 1 — the checkpointed forward. Run `model`'s stages in order on `batch` (stage 0 reads
/// the batch: pass it an undefined `Tensor::new()`; stage s > 0 reads stage s−1's output). Stage
/// s's input must be a fresh leaf that requires grad (the previous output, detached), so that each
/// stage has its own graph. Where `recompute[s]` is true, run the stage **without** a graph: it
/// keeps nothing but its input. Returns every stage's `(input, output)`.
pub fn checkpointed_forward(model: &dyn Model, batch: &Batch, recompute: &[bool]) -> Vec<(Tensor, Tensor)> {
    // TODO: walk the stages in order. Stage 0 gets Tensor::new(); every later stage gets the
    // previous output detached and marked as requiring grad (its own leaf). Use tch::no_grad for
    // the stages where recompute[s] is true, so they build no graph (README, "Keep only the input").
    todo!()
}

/// Exercise 2 — the checkpointed backward. From `kept` (exercise 1's result, same `recompute`),
/// run the stages' backward from last to first, adding every parameter's gradient into its
/// `.grad` exactly as `loss.backward()` would (a parameter may be used by two stages: the tied
/// embedding). A recomputed stage runs its forward again, with a graph, just before its backward.
/// The last stage's output is the loss: back-propagate `scale × loss`. Returns the loss value.
pub fn checkpointed_backward(
    model: &dyn Model,
    batch: &Batch,
    recompute: &[bool],
    mut kept: Vec<(Tensor, Tensor)>,
    scale: f64,
) -> f64 {
    // TODO: from the last stage to the first: rerun the forward of a recomputed stage (now with a
    // graph), build the stage's objective (scale × loss for the last stage, sum(out · g_next) for the
    // others), get the gradients of the parameters the stage uses and of its input with
    // Tensor::run_backward, and add the parameters' into their .grad (README, "Backward, stage by stage").
    todo!()
}

/// Exercise 3 — the peak, on the backward's timeline. Blocks `0..recompute.len()` each keep
/// `layer_bytes` of activations for backward when they keep their graph, and only their input,
/// `input_bytes`, when `recompute[i]`. At the start of backward every block's kept bytes are alive.
/// Backward then runs the blocks from last to first and frees each block's bytes once its
/// backward is done; a recomputed block first rebuilds its graph, so while it runs, the blocks
/// before it plus its own full `layer_bytes` are alive. Return the largest total alive at any
/// moment.
pub fn peak_activation_bytes(recompute: &[bool], layer_bytes: u64, input_bytes: u64) -> u64 {
    // TODO: walk the backward's order (last block first), keeping a running total of what is alive:
    // what does each block hold before backward reaches it, what is freed after its backward, what
    // is added while a recomputed block runs? The answer is the largest total (README, "The budget").
    todo!()
}

/// Exercise 4 — fit a budget. For a model of `layers` blocks, return the policy whose peak
/// (exercise 3) fits in `budget` with the fewest recomputed blocks — the least extra time: `None`
/// (no checkpointing) if that fits, else the `Every(k)` (k in 2..=layers; it recomputes blocks 0,
/// k, 2k, …) or `Full` that fits with the fewest recomputed blocks — ties broken by the lower peak,
/// then the smaller k;
/// `Option::None` if even full checkpointing does not fit.
pub fn policy_for_budget(layers: u64, layer_bytes: u64, input_bytes: u64, budget: u64) -> Option<Checkpointing> {
    // TODO: list the candidate policies, turn each into a per-block recompute mask
    // (Checkpointing::recomputes works on model stages: blocks are stages 1..=layers), and keep the
    // one that fits with the fewest recomputed blocks (README, "The budget").
    todo!()
}
