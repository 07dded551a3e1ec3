//! Lesson 12 — tensor parallelism: reference answers.
//! Same signatures as `lessons/12_tensor_parallel/exercise.rs`; graded by `tests/lesson12.rs`.
#![allow(unused_variables, unused_imports, unused_mut)]

use shardlab::comm::{CommResult, ProcessGroup, ReduceOp};
use tch::{Kind, Tensor};

/// Exercise 1 — a column-parallel linear layer. `w` (out, in) and `b` (out,) are the whole
/// layer (PyTorch's layout: y = x·wᵀ + b); rank `rank` of `tp` keeps rows `rank·out/t ..` of `w`
/// and of `b` and returns its `out/t` features of y for the whole `x` (N, in): (N, out/t). No
/// communication. `out` divides by `tp` (the grader only asks for shapes that split).
pub fn column_parallel_linear(x: &Tensor, w: &Tensor, b: &Tensor, tp: usize, rank: usize) -> Tensor {
    let k = w.size()[0] / tp as i64;
    let w_mine = w.narrow(0, rank as i64 * k, k);
    let b_mine = b.narrow(0, rank as i64 * k, k);
    x.linear(&w_mine, Some(&b_mine))
}

/// Exercise 2 — a row-parallel linear layer over `pg`. `x_part` (N, in/t) is this rank's
/// features of the input (columns `rank·in/t ..`), `w` (out, in) and `b` (out,) the whole layer.
/// Multiply by this rank's columns of `w`, sum the partial outputs over the group with one
/// all-reduce, and add the bias once: the whole y (N, out), the same on every rank.
pub fn row_parallel_linear(pg: &ProcessGroup, x_part: &Tensor, w: &Tensor, b: &Tensor) -> CommResult<Tensor> {
    let k = x_part.size()[1];
    let w_mine = w.narrow(1, pg.rank() as i64 * k, k);
    let mut y = x_part.linear::<Tensor>(&w_mine, None); // (N, out): a partial sum
    pg.all_reduce(&mut y, ReduceOp::Sum)?;
    Ok(y + b)
}

/// Exercise 3 — the Megatron MLP `y = GELU(x·w_fcᵀ + b_fc)·w_projᵀ + b_proj` (the exact GELU,
/// `.gelu("none")`, as the GPT's), split column → row
/// over `pg`, forward and backward with Megatron's f and g written out. `x` (N, C) and `dy`
/// (N, C) = dL/dy are the same on every rank; the weights are whole (c_fc (4C, C), (4C,);
/// c_proj (C, 4C), (C,)). Return `(y, dx, grads)`: y and dL/dx (N, C), the same on every rank,
/// and the gradients of this rank's slices `[c_fc rows, c_fc bias rows, c_proj columns,
/// c_proj bias]` (the last whole). Exactly two all-reduces of (N, C): g in forward, f in backward.
pub fn tp_mlp(
    pg: &ProcessGroup,
    x: &Tensor,
    dy: &Tensor,
    w_fc: &Tensor,
    b_fc: &Tensor,
    w_proj: &Tensor,
    b_proj: &Tensor,
) -> CommResult<(Tensor, Tensor, Vec<Tensor>)> {
    let (t, r) = (pg.world_size() as i64, pg.rank() as i64);
    let k = w_fc.size()[0] / t; // 4C/t
    let w1 = w_fc.narrow(0, r * k, k).detach().set_requires_grad(true);
    let b1 = b_fc.narrow(0, r * k, k).detach().set_requires_grad(true);
    let w2 = w_proj.narrow(1, r * k, k).detach().set_requires_grad(true);
    // f forward: the identity — but a leaf, so that backward gives this rank's part of dx.
    let x_leaf = x.detach().set_requires_grad(true);
    let partial = x_leaf.linear(&w1, Some(&b1)).gelu("none").linear::<Tensor>(&w2, None); // (N, C)
                                                                                          // g forward: all-reduce the partial outputs, then the replicated bias once.
    let mut y = partial.detach().copy();
    pg.all_reduce(&mut y, ReduceOp::Sum)?;
    let y = y + b_proj;
    // g backward: the identity — every rank's partial output gets the whole dy.
    let g = Tensor::run_backward(&[(&partial * dy).sum(Kind::Float)], &[&w1, &b1, &w2, &x_leaf], false, false);
    let [g1, gb1, g2, mut dx]: [Tensor; 4] = g.try_into().expect("four gradients");
    // f backward: all-reduce the partial input gradients.
    pg.all_reduce(&mut dx, ReduceOp::Sum)?;
    let gb2 = dy.sum_dim_intlist([0i64].as_slice(), false, Kind::Float);
    Ok((y, dx, vec![g1, gb1, g2, gb2]))
}

/// Exercise 4 — the vocab-parallel cross-entropy. `logits` (N, V/t) are this rank's columns of
/// the (N, V) logits (vocabulary ids `rank·V/t ..`), `targets` (N,) global ids, −1 for "ignore".
/// Return the mean loss over the targets that are not −1 (the same on every rank) and dL/dlogits
/// for this rank's columns (N, V/t) — without gathering the logits: all-reduce only what has one
/// number per row (the row max, the sum of exponentials, the target's logit).
pub fn vocab_parallel_cross_entropy(pg: &ProcessGroup, logits: &Tensor, targets: &Tensor) -> CommResult<(f64, Tensor)> {
    let (n, vl) = logits.size2().expect("(N, V/t)");
    let lo = pg.rank() as i64 * vl;
    let z = logits.detach().to_kind(Kind::Float);
    let mut m = z.amax([1i64].as_slice(), false); // (N,)
    pg.all_reduce(&mut m, ReduceOp::Max)?;
    let e = (&z - m.unsqueeze(1)).exp();
    let mut sum = e.sum_dim_intlist([1i64].as_slice(), false, Kind::Float);
    pg.all_reduce(&mut sum, ReduceOp::Sum)?;
    let local = targets - lo;
    let mine = local.ge(0).logical_and(&local.lt(vl)).to_kind(Kind::Float);
    let idx = local.clamp(0, vl - 1).unsqueeze(1);
    let mut zt = z.gather(1, &idx, false).squeeze_dim(1) * &mine;
    pg.all_reduce(&mut zt, ReduceOp::Sum)?;
    let valid = targets.ne(-1).to_kind(Kind::Float);
    let count = valid.sum(Kind::Float).double_value(&[]).max(1.0);
    let loss = ((sum.log() + &m - zt) * &valid).sum(Kind::Float).double_value(&[]) / count;
    let onehot = z.zeros_like().scatter_value(1, &idx, 1.0) * mine.unsqueeze(1);
    let grad = (e / sum.unsqueeze(1) - onehot) * valid.unsqueeze(1) / count;
    Ok((loss, grad))
}
