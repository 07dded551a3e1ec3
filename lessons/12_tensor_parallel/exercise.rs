//! Lesson 12 — tensor parallelism: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 12`. Hints: `cargo grade 12 --hint K`.
#![allow(unused_variables, unused_imports, unused_mut)]

use shardlab::comm::{CommError, CommResult, ProcessGroup, ReduceOp};
use tch::{Kind, Tensor};

/// Exercise 1 — a column-parallel linear layer. `w` (out, in) and `b` (out,) are the whole
/// layer (PyTorch's layout: y = x·wᵀ + b); rank `rank` of `tp` keeps rows `rank·out/t ..` of `w`
/// and of `b` and returns its `out/t` features of y for the whole `x` (N, in): (N, out/t). No
/// communication. `out` divides by `tp` (the grader only asks for shapes that split).
pub fn column_parallel_linear(x: &Tensor, w: &Tensor, b: &Tensor, tp: usize, rank: usize) -> Tensor {
    // TODO: compute this rank's out/t features of y from its rows of w and b (README,
    // "Column-parallel: split the outputs").
    todo!()
}

/// Exercise 2 — a row-parallel linear layer over `pg`. `x_part` (N, in/t) is this rank's
/// features of the input (columns `rank·in/t ..`), `w` (out, in) and `b` (out,) the whole layer.
/// Multiply by this rank's columns of `w`, sum the partial outputs over the group with one
/// all-reduce, and add the bias once: the whole y (N, out), the same on every rank.
pub fn row_parallel_linear(pg: &ProcessGroup, x_part: &Tensor, w: &Tensor, b: &Tensor) -> CommResult<Tensor> {
    // TODO: multiply your features of x by your columns of w, sum over the group, add the bias
    // once (README, "Row-parallel: split the inputs").
    todo!()
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
    // TODO: the MLP's forward and backward on your slices, with g (all-reduce forward) and f
    // (all-reduce backward) as the only communication (README, "f and g: the MLP in two
    // all-reduces").
    todo!()
}

/// Exercise 4 — the vocab-parallel cross-entropy. `logits` (N, V/t) are this rank's columns of
/// the (N, V) logits (vocabulary ids `rank·V/t ..`), `targets` (N,) global ids, −1 for "ignore".
/// Return the mean loss over the targets that are not −1 (the same on every rank) and dL/dlogits
/// for this rank's columns (N, V/t) — without gathering the logits: all-reduce only what has one
/// number per row (the row max, the sum of exponentials, the target's logit).
pub fn vocab_parallel_cross_entropy(pg: &ProcessGroup, logits: &Tensor, targets: &Tensor) -> CommResult<(f64, Tensor)> {
    // TODO: all-reduce the row max (Max); the sum of exp(z − max) (Sum); the target's logit from
    // the rank whose columns hold it (Sum); loss = mean over targets ≠ −1 of log Σ + max − z_t;
    // the gradient is (softmax − one-hot)/count on your columns, 0 on ignored rows (README,
    // "The loss without the logits").
    todo!()
}

/// Exercise 5 — causal self-attention split by heads over `pg` (t ranks), forward only. `x` (B, T,
/// C) is the whole input, the same on every rank. `w_attn` (3C, C) and `b_attn` (3C,) are the
/// whole `c_attn` (nanoGPT's layout: the q rows, then the k rows, then the v rows, C each; head h
/// is rows h·C/n_head … of each); `w_proj` (C, C) and `b_proj` (C,) the whole `attn.c_proj`.
/// This rank computes n_head/t of the heads and returns the whole attention output (B, T, C), the
/// same on every rank and equal to one process's, with exactly one all-reduce. When `n_head` does
/// not divide by t (or C by `n_head`), return `CommError::InvalidArgument` on every rank without
/// communicating.
pub fn tp_attention(
    pg: &ProcessGroup,
    x: &Tensor,
    w_attn: &Tensor,
    b_attn: &Tensor,
    w_proj: &Tensor,
    b_proj: &Tensor,
    n_head: i64,
) -> CommResult<Tensor> {
    // TODO: check the split; take this rank's heads from c_attn and the matching part of c_proj;
    // causal attention on those heads; one all-reduce; the bias once (README, "Attention by
    // heads: the whole block").
    todo!()
}
