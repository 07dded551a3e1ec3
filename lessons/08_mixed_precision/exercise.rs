//! Lesson 08 — mixed precision: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 08`. Hints: `cargo grade 08 --hint K`.
#![allow(unused_variables, unused_imports, unused_mut)]

use shardlab::prelude::*;

/// Exercise 1 — what bf16 is. Round the f32 `x` to bfloat16 and return bf16's 16 bits: the sign,
/// the 8 exponent bits and the top 7 mantissa bits of `x`, rounded to the nearest (ties to the
/// even neighbour) — not truncated. A NaN stays a NaN (return a quiet NaN: `0x7FC0`, with `x`'s
/// sign if you like — libtorch returns plain `0x7FC0`; any NaN passes); ±inf stay ±inf; a value
/// past bf16's largest finite rounds to inf.
pub fn to_bf16_bits(x: f32) -> u16 {
    // TODO: return the bits of the bf16 nearest to `x`, ties to even; a NaN stays a NaN (README,
    // "Rounding to bf16"; hints: `cargo grade 08 --hint 1`).
    todo!()
}

/// Exercise 2 — the master-weight step. `master` is the f32 copy of a parameter the optimizer owns;
/// `working` is its bf16 copy the forward reads; `grad` the gradient (any float dtype). Take one SGD
/// step `master ← master − lr · grad` **in f32**, then refresh the working copy from the master.
pub fn master_weight_step(master: &mut Tensor, working: &mut Tensor, grad: &Tensor, lr: f64) {
    // TODO: `master` takes the step and stays f32; `working` ends as the master rounded to bf16,
    // in its own storage (README, "Master weights"; hints: `cargo grade 08 --hint 2`).
    todo!()
}

/// The dynamic loss scaler's state (PyTorch's `GradScaler`): the scale, the count of clean steps
/// since the last change, and its rules.
#[derive(Clone, Debug, PartialEq)]
pub struct ScaleState {
    pub scale: f64,
    pub growth_tracker: u64,
    pub growth_interval: u64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
}

/// Exercise 3 — the loss-scale update. After a step whose gradients had an inf or a NaN
/// (`found_inf`): multiply the scale by `backoff_factor` and restart the count of clean steps;
/// return `true` (the step must be skipped). After a clean step: count it; when the count reaches
/// `growth_interval`, multiply the scale by `growth_factor` and restart the count; return `false`.
pub fn update_scale(s: &mut ScaleState, found_inf: bool) -> bool {
    // TODO: update `s` by GradScaler's rules and return whether this step must be skipped (README,
    // "Loss scaling"; hints: `cargo grade 08 --hint 3`).
    todo!()
}

/// Exercise 4 — unscale and check, on every rank. Divide every gradient in `grads` by `scale` in
/// place, and return whether **any rank** found an inf or a NaN in its gradients — the same answer
/// on every rank, so that every rank skips the step together (a rank holds only its own shard of
/// the gradients under ZeRO, and its own overflow).
pub fn unscale_and_check(pg: &ProcessGroup, grads: &[Tensor], scale: f64) -> CommResult<bool> {
    // TODO: leave `grads` unscaled in place, and return the same answer on every rank: did any rank
    // find an inf or a NaN? (README, "Every rank skips together"; hints: `cargo grade 08 --hint 4`).
    todo!()
}
