//! Lesson 09 — activation checkpointing: reference answers.
//! Same signatures as `lessons/09_activation_checkpointing/exercise.rs`; graded by `tests/lesson09.rs`.

use shardlab::model::{Batch, Model};
use shardlab::prelude::*;

/// Exercise 1 — the checkpointed forward. Run `model`'s stages in order on `batch` (stage 0 reads
/// the batch: pass it an undefined `Tensor::new()`; stage s > 0 reads stage s−1's output). Stage
/// s's input must be a fresh leaf that requires grad (the previous output, detached), so that each
/// stage has its own graph. Where `recompute[s]` is true, run the stage **without** a graph: it
/// keeps nothing but its input. Returns every stage's `(input, output)`.
pub fn checkpointed_forward(model: &dyn Model, batch: &Batch, recompute: &[bool]) -> Vec<(Tensor, Tensor)> {
    let mut kept: Vec<(Tensor, Tensor)> = Vec::with_capacity(model.num_stages());
    for s in 0..model.num_stages() {
        let input = match kept.last() {
            None => Tensor::new(),
            Some((_, prev)) => prev.detach().set_requires_grad(true),
        };
        let output = if recompute[s] {
            tch::no_grad(|| model.stage_forward(s, &input, batch))
        } else {
            model.stage_forward(s, &input, batch)
        };
        kept.push((input, output));
    }
    kept
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
    let n = model.num_stages();
    let params = model.parameters();
    let uses = model.stage_uses();
    let loss = kept[n - 1].1.double_value(&[]);
    let mut g_next = Tensor::new();
    for s in (0..n).rev() {
        let (input, mut out) = kept.pop().expect("one pair per stage");
        if recompute[s] {
            out = model.stage_forward(s, &input, batch);
        }
        let obj = if s == n - 1 { out * scale } else { (out * &g_next).sum(Kind::Float) };
        let mut wrt: Vec<Tensor> = uses[s].iter().map(|&i| params[i].shallow_clone()).collect();
        if s > 0 {
            wrt.push(input);
        }
        let mut grads = Tensor::run_backward(&[obj], &wrt, false, false);
        if s > 0 {
            g_next = grads.pop().expect("the input's gradient");
        }
        shardlab::model::ensure_grads(&params);
        for (&i, g) in uses[s].iter().zip(&grads) {
            if g.defined() {
                let _ = params[i].grad().g_add_(g);
            }
        }
    }
    loss
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
    let peak = |recomputed: u64| {
        let kept = (layers - recomputed) * layer_bytes + recomputed * input_bytes;
        kept + if recomputed > 0 { layer_bytes } else { 0 }
    };
    if peak(0) <= budget {
        return Some(Checkpointing::None);
    }
    if let Some(k) = (2..=layers).rev().find(|&k| peak(layers.div_ceil(k)) <= budget) {
        return Some(Checkpointing::Every(k as usize));
    }
    (peak(layers) <= budget).then_some(Checkpointing::Full)
}
