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
    // TODO: this rank's out/t features of y (README, "Column-parallel: split the outputs"; hints:
    // `cargo grade 12 --hint 1`).
    todo!()
}

/// Exercise 2 — a row-parallel linear layer over `pg`. `x_part` (N, in/t) is this rank's
/// features of the input (columns `rank·in/t ..`), `w` (out, in) and `b` (out,) the whole layer.
/// Multiply by this rank's columns of `w`, sum the partial outputs over the group with one
/// all-reduce, and add the bias once: the whole y (N, out), the same on every rank.
pub fn row_parallel_linear(pg: &ProcessGroup, x_part: &Tensor, w: &Tensor, b: &Tensor) -> CommResult<Tensor> {
    // TODO: the whole y on every rank from this rank's features of x (README, "Row-parallel:
    // split the inputs"; hints: `cargo grade 12 --hint 2`).
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
    // TODO: forward and backward on this rank's slices, communicating only through f and g
    // (README, "f and g: the MLP in two all-reduces"; hints: `cargo grade 12 --hint 3`).
    todo!()
}

/// Exercise 4 — the vocab-parallel cross-entropy. `logits` (N, V/t) are this rank's columns of
/// the (N, V) logits (vocabulary ids `rank·V/t ..`), `targets` (N,) global ids, −1 for "ignore".
/// Return the mean loss over the targets that are not −1 (the same on every rank) and dL/dlogits
/// for this rank's columns (N, V/t) — without gathering the logits: all-reduce only what has one
/// number per row (the row max, the sum of exponentials, the target's logit).
pub fn vocab_parallel_cross_entropy(pg: &ProcessGroup, logits: &Tensor, targets: &Tensor) -> CommResult<(f64, Tensor)> {
    // TODO: the loss and its gradient on your columns, never gathering the logits (README, "The
    // loss without the logits"; hints: `cargo grade 12 --hint 4`).
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
    // TODO: this rank's heads, then the whole output on every rank; refuse a split that does
    // not divide (README, "Attention by heads: the whole block"; hints: `cargo grade 12 --hint 5`).
    todo!()
}
