//! Lesson 08 — mixed precision: reference answers.
//! Same signatures as `lessons/08_mixed_precision/exercise.rs`; graded by `tests/lesson08.rs`.

use shardlab::prelude::*;

/// Exercise 1 — what bf16 is. Round the f32 `x` to bfloat16 and return bf16's 16 bits: the sign,
/// the 8 exponent bits and the top 7 mantissa bits of `x`, rounded to the nearest (ties to the
/// even neighbour) — not truncated. A NaN stays a NaN (return a quiet NaN: `0x7FC0`, with `x`'s
/// sign if you like — libtorch returns plain `0x7FC0`; any NaN passes); ±inf stay ±inf; a value
/// past bf16's largest finite rounds to inf.
pub fn to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16 & 0x8000) | 0x7FC0;
    }
    // Add half of the dropped part's weight, plus one more if the kept part is odd (ties to even):
    // the carry ripples into the exponent where it must (and up to inf past the largest finite).
    let lsb = (bits >> 16) & 1;
    let rounded = bits.wrapping_add(0x7FFF + lsb);
    (rounded >> 16) as u16
}

/// Exercise 2 — the master-weight step. `master` is the f32 copy of a parameter the optimizer owns;
/// `working` is its bf16 copy the forward reads; `grad` the gradient (any float dtype). Take one SGD
/// step `master ← master − lr · grad` **in f32**, then refresh the working copy from the master.
pub fn master_weight_step(master: &mut Tensor, working: &mut Tensor, grad: &Tensor, lr: f64) {
    tch::no_grad(|| {
        let g = grad.to_kind(Kind::Float);
        let _ = master.g_add_(&(g * -lr));
        working.copy_(master); // copy_ casts f32 → bf16, rounding to nearest even
    });
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
    if found_inf {
        s.scale *= s.backoff_factor;
        s.growth_tracker = 0;
        return true;
    }
    s.growth_tracker += 1;
    if s.growth_tracker == s.growth_interval {
        s.scale *= s.growth_factor;
        s.growth_tracker = 0;
    }
    false
}

/// Exercise 4 — unscale and check, on every rank. Divide every gradient in `grads` by `scale` in
/// place, and return whether **any rank** found an inf or a NaN in its gradients — the same answer
/// on every rank, so that every rank skips the step together (a rank holds only its own shard of
/// the gradients under ZeRO, and its own overflow).
pub fn unscale_and_check(pg: &ProcessGroup, grads: &[Tensor], scale: f64) -> CommResult<bool> {
    let mut bad = false;
    for g in grads {
        let _ = g.shallow_clone().g_mul_scalar_(1.0 / scale);
        bad |= g.isfinite().logical_not().any().int64_value(&[]) != 0;
    }
    let mut flag = Tensor::from_slice(&[bad as u8 as f32]); // (1,) f32: 1 if this rank overflowed
    pg.all_reduce(&mut flag, ReduceOp::Max)?;
    Ok(flag.double_value(&[0]) > 0.0)
}
