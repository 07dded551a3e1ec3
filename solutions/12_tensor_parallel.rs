//! Lesson 12 — tensor parallelism: reference answers.
//! Same signatures as `lessons/12_tensor_parallel/exercise.rs`; graded by `tests/lesson12.rs`.
#![allow(unused_variables, unused_imports, unused_mut)]

use shardlab::comm::{CommError, CommResult, ProcessGroup, ReduceOp};
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
    let (t, r) = (pg.world_size() as i64, pg.rank() as i64);
    let s = x.size();
    let (bsz, tt, c) = (s[0], s[1], s[2]);
    if n_head <= 0 || n_head % t != 0 || c % n_head != 0 {
        return Err(CommError::InvalidArgument(format!(
            "{n_head} heads of a width-{c} model do not split over {t} tensor-parallel ranks"
        )));
    }
    let hs = c / n_head; // the head size
    let h = n_head / t; // this rank's heads
    let cols = h * hs; // C/t: its rows of each of q, k and v, its columns of c_proj

    // c_attn is three blocks of C rows: this rank's heads are rows r·C/t … of each block, not
    // rows r·3C/t … of the whole matrix (that would be all of q and part of k at t = 2).
    let w = w_attn.reshape([3, c, c]).narrow(1, r * cols, cols).reshape([3 * cols, c]);
    let b = b_attn.reshape([3, c]).narrow(1, r * cols, cols).reshape([3 * cols]);
    let qkv = x.linear(&w, Some(&b)); // (B, T, 3C/t)
    let heads = |i: i64| qkv.narrow(2, i * cols, cols).reshape([bsz, tt, h, hs]).transpose(1, 2); // (B, h, T, hs)
    let (q, k, v) = (heads(0), heads(1), heads(2));
    let scores = q.matmul(&k.transpose(-2, -1)) / (hs as f64).sqrt(); // (B, h, T, T)
    let future = Tensor::ones([tt, tt], (Kind::Bool, x.device())).triu(1);
    let att = scores.masked_fill(&future, f64::NEG_INFINITY).softmax(-1, Kind::Float);
    let y = att.matmul(&v).transpose(1, 2).reshape([bsz, tt, cols]); // (B, T, C/t)

    // Row-parallel c_proj: this rank's heads' columns give a partial (B, T, C); sum, then the bias once.
    let mut out = y.linear::<Tensor>(&w_proj.narrow(1, r * cols, cols), None);
    pg.all_reduce(&mut out, ReduceOp::Sum)?;
    Ok(out + b_proj)
}
