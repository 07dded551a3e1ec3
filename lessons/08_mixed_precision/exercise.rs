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
    // TODO: work on x.to_bits(). bf16 keeps the top 16 bits; round the low 16 away to the nearest,
    // ties to even (README, "Rounding to bf16"). Handle NaN first: it must stay a NaN.
    todo!()
}

/// Exercise 2 — the master-weight step. `master` is the f32 copy of a parameter the optimizer owns;
/// `working` is its bf16 copy the forward reads; `grad` the gradient (any float dtype). Take one SGD
/// step `master ← master − lr · grad` **in f32**, then refresh the working copy from the master.
pub fn master_weight_step(master: &mut Tensor, working: &mut Tensor, grad: &Tensor, lr: f64) {
    // TODO: the update happens on the f32 master (upcast the gradient), under tch::no_grad; then
    // the bf16 working copy is refreshed from the master (README, "Master weights").
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
    // TODO: PyTorch's GradScaler rules (README, "Loss scaling"): back off and restart the count on
    // an overflow, grow after `growth_interval` clean steps in a row.
    todo!()
}

/// Exercise 4 — unscale and check, on every rank. Divide every gradient in `grads` by `scale` in
/// place, and return whether **any rank** found an inf or a NaN in its gradients — the same answer
/// on every rank, so that every rank skips the step together (a rank holds only its own shard of
/// the gradients under ZeRO, and its own overflow).
pub fn unscale_and_check(pg: &ProcessGroup, grads: &[Tensor], scale: f64) -> CommResult<bool> {
    // TODO: divide each gradient by the scale in place, look for inf/NaN, then make every rank
    // agree on the answer with one collective (README, "Every rank skips together").
    todo!()
}
