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
    // TODO: one (input, output) per stage, in stage order, with a graph only where `recompute[s]` is
    // false (README, "Keep only the input"; hints: `cargo grade 09 --hint 1`).
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
    // TODO: every parameter's `.grad` gains what `(scale × loss).backward()` would add; return the
    // unscaled loss (README, "Backward, stage by stage"; hints: `cargo grade 09 --hint 2`).
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
    // TODO: return the most bytes alive at any moment of backward (README, "The budget"; hints:
    // `cargo grade 09 --hint 3`).
    todo!()
}

/// Exercise 4 — fit a budget. For a model of `layers` blocks, return the policy whose peak
/// (exercise 3) fits in `budget` with the fewest recomputed blocks — the least extra time: `None`
/// (no checkpointing) if that fits, else the `Every(k)` (k in 2..=layers; it recomputes blocks 0,
/// k, 2k, …) or `Full` that fits with the fewest recomputed blocks — ties broken by the lower peak,
/// then the smaller k;
/// `Option::None` if even full checkpointing does not fit.
pub fn policy_for_budget(layers: u64, layer_bytes: u64, input_bytes: u64, budget: u64) -> Option<Checkpointing> {
    // TODO: the policy that fits `budget` with the fewest recomputed blocks (ties as above), or
    // `Option::None` if none fits (README, "The budget"; hints: `cargo grade 09 --hint 4`).
    todo!()
}
