//! Lesson 07 — ZeRO stages 1/2/3: reference answers.
//! Same signatures as `lessons/07_zero_stages/exercise.rs`; graded by `tests/lesson07.rs`.

use shardlab::prelude::*;

/// Exercise 1 — the ZeRO paper's per-device model-state bytes for `params` parameters on `dp`
/// devices, 16-bit weights and gradients (2 bytes each) and `k` bytes of optimizer state per
/// parameter. `stage` 0 is plain data parallelism, 1–3 the ZeRO stages.
pub fn zero_bytes_per_device(params: f64, dp: f64, k: f64, stage: u8) -> f64 {
    match stage {
        0 => (2.0 + 2.0 + k) * params,
        1 => 2.0 * params + 2.0 * params + k * params / dp,
        2 => 2.0 * params + (2.0 + k) * params / dp,
        _ => (2.0 + 2.0 + k) * params / dp,
    }
}

/// Exercise 2 — one AdamW step (step number `t`, counting from 1) on a shard: parameters `p`,
/// gradient `g`, moments `m` and `v`, all 1-D and updated in place; `wd` is the weight decay of
/// every element (0 where not decayed). Same arithmetic as `torch.optim.AdamW`.
#[allow(clippy::too_many_arguments)]
pub fn adamw_shard_step(
    p: &mut Tensor,
    g: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    wd: &Tensor,
    t: i32,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
) {
    let (b1, b2) = betas;
    tch::no_grad(|| {
        let _ = p.g_mul_(&(1.0 - wd * lr));
        let _ = m.g_mul_scalar_(b1).g_add_(&(g * (1.0 - b1)));
        let _ = v.g_mul_scalar_(b2).g_add_(&(g * g * (1.0 - b2)));
        let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        let denom = v.sqrt() / bc2.sqrt() + eps;
        let _ = p.g_sub_(&(&*m / denom * (lr / bc1)));
    });
}

/// Exercise 3 — the end of a ZeRO-1/2 step: every rank has updated its own shard (`shard`, its
/// slice of the padded flat parameters); put everyone's updated shards into `flat` (the full
/// flat parameters, same on every rank afterwards).
pub fn all_gather_params(pg: &ProcessGroup, flat: &mut Tensor, shard: &Tensor) -> CommResult<()> {
    pg.all_gather(flat, &shard.copy())
}

/// Exercise 4 — a whole ZeRO-1 optimizer step on one flat parameter vector (padded to a multiple
/// of the world size). `grad` is this rank's full flat gradient from its own backward; `flat` the
/// full flat parameters, the same on every rank; `m`, `v` this rank's AdamW moments and `wd` the
/// weight decay of each element of its shard; `t` the step number, from 1. Afterwards every rank's
/// `flat` holds the parameters after one AdamW step on the gradient averaged over ranks.
#[allow(clippy::too_many_arguments)]
pub fn zero1_step(
    pg: &ProcessGroup,
    flat: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    wd: &Tensor,
    t: i32,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
) -> CommResult<()> {
    let shard_len = flat.numel() as i64 / pg.world_size() as i64;
    // This rank's block of the gradient, averaged over ranks.
    let mut g = Tensor::zeros([shard_len], (grad.kind(), Device::Cpu));
    pg.reduce_scatter(&mut g, grad, ReduceOp::Avg)?;
    // AdamW on the own shard only: a view into flat, updated in place.
    let mut shard = flat.narrow(0, pg.rank() as i64 * shard_len, shard_len);
    adamw_shard_step(&mut shard, &g, m, v, wd, t, lr, betas, eps);
    // Everyone's updated shards into everyone's flat.
    all_gather_params(pg, flat, &shard)
}
