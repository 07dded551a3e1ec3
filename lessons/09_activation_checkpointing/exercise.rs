//! Lesson 09 — activation checkpointing: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 09`. Hints are in this lesson's README.
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

/// Exercise 3 — fit a budget. A model of `layers` blocks keeps `layer_bytes` of activations per
/// block when the block keeps its graph, and only `input_bytes` when it is recomputed. While
/// backward recomputes a block, that block's full `layer_bytes` are alive again (one block at a
/// time), so the peak is: the bytes every block keeps + `layer_bytes` if any block is recomputed.
/// Return the policy that fits the peak in `budget` with the fewest recomputed blocks: `None`
/// (no checkpointing) if that fits, else `Every(k)` with the largest k in 2..=layers that fits
/// (`every:k` recomputes blocks 0, k, 2k, …: ⌈layers/k⌉ of them), else `Full`; `Option::None` if
/// even full checkpointing does not fit.
pub fn policy_for_budget(layers: u64, layer_bytes: u64, input_bytes: u64, budget: u64) -> Option<Checkpointing> {
    // TODO: write the peak as a function of how many blocks are recomputed, then try no
    // checkpointing, every:k from the largest k down to 2, and full, in that order (README, "The budget").
    todo!()
}
