//! One transformer block split over a tensor-parallel group ([`TpBlock`]): attention by heads and
//! the MLP column → row, with Megatron's f and g written out (all-reduces, or with sequence
//! parallelism all-gathers and reduce-scatters along T), forward and a hand-run backward.

use super::{column_shard, gather_dim, row_shard, scatter_dim, shard};
use crate::comm::{CommError, CommResult, ProcessGroup, ReduceOp};
use tch::{Kind, Tensor};

/// A GPT block (nanoGPT's: `x + attn(ln_1(x))`, then `+ mlp(ln_2(·))`) split over a
/// tensor-parallel group of `t` ranks: attention by heads (each rank `n_head/t` heads: its rows of
/// the q, k and v blocks of `c_attn`, the matching columns of `attn.c_proj`), the MLP column → row.
/// LayerNorms and the two output biases are replicated. Per block, forward all-reduces the
/// attention and MLP outputs (g, twice) and backward the gradients of the two LayerNorm outputs
/// (f, twice): four all-reduces of B·T·C fp32 elements. The matmuls in fp32, or in bf16 as
/// autocast runs them ([`with_compute`](Self::with_compute)).
///
/// With [`sequence_parallel`](Self::sequence_parallel) (Korthikanti et al. 2022), the block's
/// input, output, LayerNorms and residual adds hold this rank's T/t tokens only: f becomes an
/// all-gather along T before the split matmuls and g a reduce-scatter along T after them (in
/// backward the reverse), the same bytes as the all-reduces they replace. The gathered input of
/// c_attn and c_fc is not kept: backward gathers it again for their weight gradients (two more
/// all-gathers). The replicated parameters' gradients, each from this rank's tokens, are then
/// summed over the group.
pub struct TpBlock {
    /// This rank's slices, in the GPT's parameter order: ln_1 w, b; c_attn w (3C/t, C), b (3C/t);
    /// attn.c_proj w (C, C/t), b (C); ln_2 w, b; c_fc w (4C/t, C), b (4C/t); mlp.c_proj w
    /// (C, 4C/t), b (C).
    pub params: Vec<Tensor>,
    n_head: i64,
    /// What each forward in flight keeps for its backward, by micro-batch (a pipeline runs several).
    saved: std::collections::BTreeMap<usize, BlockSaved>,
    /// Bytes this block all-reduced so far (with sequence parallelism: all-gathered and
    /// reduce-scattered, the full (B, T, C) size of each).
    pub bytes_all_reduced: u64,
    sequence_parallel: bool,
    /// The matrix multiplies' kind (bf16 autocast; fp32 by default): [`with_compute`](Self::with_compute).
    compute: Kind,
    /// Activation checkpointing: forward keeps only each micro-batch's input (`inputs`) and runs
    /// again, with its graph and its collectives, before the backward.
    recompute: bool,
    inputs: std::collections::BTreeMap<usize, Tensor>,
}

struct BlockSaved {
    x0: Tensor,
    h1: Tensor,
    /// Where the attention's graph starts: h1 (whole T) — with sequence parallelism c_attn's
    /// output instead, so that the gathered h1 is not kept.
    h1_leaf: Tensor,
    partial_a: Tensor,
    x1_leaf: Tensor,
    h2: Tensor,
    /// Where the MLP's graph starts: h2 — with sequence parallelism c_fc's output.
    h2_leaf: Tensor,
    partial_m: Tensor,
}

/// The backward of `y = x·wᵀ + b` by hand, for `dy` (…, O), `x` (…, I), `w` (O, I): (dL/dw,
/// dL/db, dL/dx).
/// Under bf16 autocast `dy` is bf16: the products are computed in its kind (`x` and `w` cast, as
/// the forward cast them) and the results returned in fp32, like the casts' backward.
fn linear_backward(dy: &Tensor, x: &Tensor, w: &Tensor) -> (Tensor, Tensor, Tensor) {
    let (o, i) = (w.size()[0], w.size()[1]);
    let k = dy.kind();
    let dy2 = dy.reshape([-1, o]);
    let f = |t: Tensor| t.to_kind(Kind::Float);
    (
        f(dy2.tr().mm(&x.reshape([-1, i]).to_kind(k))),
        f(dy2.sum_dim_intlist([0i64].as_slice(), false, dy.kind())),
        f(dy.matmul(&w.to_kind(k))),
    )
}

/// `x · wᵀ (+ b)` in `kind`, as `torch.autocast` runs a linear: `x`, `w` and `b` cast at the use
/// (the casts on autograd's tape, so fp32 parameters get fp32 gradients); fp32: as it is.
pub(crate) fn linear_in(kind: Kind, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    if kind == Kind::Float {
        return x.linear(w, b);
    }
    x.to_kind(kind).linear(&w.to_kind(kind), b.map(|b| b.to_kind(kind)).as_ref())
}

pub(crate) fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
    let c = *x.size().last().expect("(…, C)");
    x.layer_norm([c], Some(w), Some(b), 1e-5, false)
}

impl TpBlock {
    /// This rank's part of a block whose full parameters are `full` (the GPT's 12 block
    /// parameters, in its order), with `n_head` heads; `n_head` must divide by the group's size.
    pub fn from_full(full: &[Tensor], n_head: i64, pg: &ProcessGroup) -> Result<TpBlock, String> {
        let (t, r) = (pg.world_size(), pg.rank());
        if full.len() != 12 {
            return Err(format!("a GPT block has 12 parameters, not {}", full.len()));
        }
        if n_head % t as i64 != 0 {
            return Err(format!("{n_head} heads do not split over {t} tensor-parallel ranks"));
        }
        let c = full[0].size()[0];
        // c_attn: (3C, C) = q, k, v blocks of C rows each: this rank's heads in each block.
        let qkv = |w: &Tensor| -> Result<Tensor, String> {
            let mut s = w.size();
            let blocks = w.reshape([3, c, -1]);
            let part = shard(&blocks, 1, t, r)?;
            s[0] /= t as i64;
            // A tensor of its own, not a view of `part`: a view keeps its base alive, so once
            // ZeRO points the parameter at its flat buffer (set_data) the base would stay held,
            // uncounted (tests/held_memory.rs found it).
            Ok(part.reshape(s).copy())
        };
        let rep = |w: &Tensor| w.detach().copy();
        let params = vec![
            rep(&full[0]),
            rep(&full[1]),
            qkv(&full[2])?,
            qkv(&full[3])?,
            row_shard(&full[4], t, r)?,
            rep(&full[5]),
            rep(&full[6]),
            rep(&full[7]),
            column_shard(&full[8], t, r)?,
            column_shard(&full[9], t, r)?,
            row_shard(&full[10], t, r)?,
            rep(&full[11]),
        ];
        Ok(TpBlock {
            params: params.into_iter().map(|p| p.set_requires_grad(true)).collect(),
            n_head,
            saved: Default::default(),
            bytes_all_reduced: 0,
            sequence_parallel: false,
            compute: Kind::Float,
            recompute: false,
            inputs: Default::default(),
        })
    }

    /// Compute the four linear layers and attention in `kind` (bf16: `torch.autocast`'s rule, as
    /// the one-process GPT's `with_precision`): inputs and weights cast at each use, the
    /// parameters, their gradients, LayerNorms and the residual stream stay fp32. The partial
    /// outputs of the row-parallel layers are summed in fp32 (the all-reduces carry fp32: twice
    /// the bytes of Megatron's bf16 all-reduce, one rounding fewer).
    pub fn with_compute(mut self, kind: Kind) -> Self {
        self.compute = kind;
        self
    }

    /// Sequence parallelism on or off: `forward` then takes and returns this rank's T/t tokens
    /// (rank r the r-th slice of T), `backward` their gradients.
    pub fn sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    fn all_reduce(&mut self, pg: &ProcessGroup, t: &Tensor) -> CommResult<Tensor> {
        let mut out = t.detach().copy();
        pg.all_reduce(&mut out, ReduceOp::Sum)?;
        self.bytes_all_reduced += (out.numel() * out.kind().elt_size_in_bytes()) as u64;
        Ok(out)
    }

    /// f forward / g backward: identity, or (sequence parallel) all-gather along T.
    fn to_full(&mut self, pg: &ProcessGroup, t: &Tensor) -> CommResult<Tensor> {
        if !self.sequence_parallel {
            return Ok(t.detach());
        }
        let full = gather_dim(pg, &t.detach(), 1)?; // (B, T/t, C) → (B, T, C)
        self.bytes_all_reduced += (full.numel() * full.kind().elt_size_in_bytes()) as u64;
        Ok(full)
    }

    /// g forward / f backward: all-reduce, or (sequence parallel) reduce-scatter along T.
    fn sum_partials(&mut self, pg: &ProcessGroup, t: &Tensor) -> CommResult<Tensor> {
        if !self.sequence_parallel {
            return self.all_reduce(pg, t);
        }
        self.bytes_all_reduced += (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        scatter_dim(pg, &t.detach(), 1) // (B, T, C) partial sums → (B, T/t, C) of the sum
    }

    /// (B, T, C) → (B, T, C), the same on every rank of `pg`; with sequence parallelism
    /// (B, T/t, C) → (B, T/t, C), this rank's tokens.
    pub fn forward(&mut self, pg: &ProcessGroup, x: &Tensor) -> CommResult<Tensor> {
        self.forward_mb(pg, 0, x)
    }

    /// Activation checkpointing on or off (Megatron's full recompute of a block): forward runs
    /// without a graph and keeps only the block's input; backward runs the forward again — its
    /// two all-reduces (or reduce-scatters) too — then the backward. The same operations on the
    /// same values: the same gradients bitwise, for one more forward and its communication.
    pub fn recompute(mut self, on: bool) -> Self {
        self.recompute = on;
        self
    }

    /// [`forward`](Self::forward) of micro-batch `mb`, kept for its backward
    /// ([`backward_mb`](Self::backward_mb)) while others are in flight (pipeline schedules).
    pub fn forward_mb(&mut self, pg: &ProcessGroup, mb: usize, x: &Tensor) -> CommResult<Tensor> {
        if !self.recompute {
            return self.forward_kept(pg, mb, x);
        }
        if self.inputs.contains_key(&mb) {
            return Err(CommError::InvalidArgument(format!(
                "rank {}: TpBlock::forward of micro-batch {mb} twice without its backward",
                pg.rank()
            )));
        }
        let out = tch::no_grad(|| self.forward_kept(pg, mb, x))?;
        self.saved.remove(&mb); // graph-less: nothing of it is needed
        self.inputs.insert(mb, x.detach());
        Ok(out)
    }

    /// The forward, keeping what backward needs.
    fn forward_kept(&mut self, pg: &ProcessGroup, mb: usize, x: &Tensor) -> CommResult<Tensor> {
        let p = &self.params;
        if self.saved.contains_key(&mb) {
            return Err(CommError::InvalidArgument(format!(
                "rank {}: TpBlock::forward of micro-batch {mb} twice without its backward",
                pg.rank()
            )));
        }
        let (b, t, c) = x.size3().map_err(|e| CommError::InvalidArgument(format!("TpBlock input (B, T, C): {e}")))?;
        let t = if self.sequence_parallel { t * pg.world_size() as i64 } else { t }; // the whole sequence
        let heads = self.n_head / pg.world_size() as i64; // this rank's heads
        let hs = c / self.n_head;
        let cl = heads * hs; // C/t: this rank's attention width
        let x0 = x.detach().set_requires_grad(true);
        let h1 = layer_norm(&x0, &p[0], &p[1]);
        // f: identity forward; a leaf, so that backward gives this rank's part of dL/dh1. With
        // sequence parallelism f all-gathers along T, and the gathered input is not kept: c_attn
        // runs outside autograd from it, the graph starts at its output (a leaf), and backward
        // all-gathers h1 again for c_attn's weight gradient (Megatron's way).
        let (sp, k) = (self.sequence_parallel, self.compute);
        let h1_full = self.to_full(pg, &h1)?;
        let p = &self.params;
        let (h1_leaf, qkv) = if sp {
            let qkv = tch::no_grad(|| linear_in(k, &h1_full, &p[2], Some(&p[3]))).set_requires_grad(true);
            (qkv.shallow_clone(), qkv)
        } else {
            let h1_leaf = h1_full.set_requires_grad(true);
            let qkv = linear_in(k, &h1_leaf, &p[2], Some(&p[3]));
            (h1_leaf, qkv)
        }; // qkv: (B, T, 3C/t)
        let split = |i: i64| qkv.narrow(2, i * cl, cl).view([b, t, heads, hs]).transpose(1, 2);
        let y = Tensor::scaled_dot_product_attention::<Tensor>(
            &split(0),
            &split(1),
            &split(2),
            None,
            0.0,
            true,
            None,
            false,
        );
        let y = y.transpose(1, 2).contiguous().view([b, t, cl]);
        let partial_a = linear_in(k, &y, &p[4], None).to_kind(Kind::Float); // (B, T, C)
        let p5 = p[5].detach();
        // g: all-reduce forward (sequence parallel: reduce-scatter along T).
        let a = self.sum_partials(pg, &partial_a)? + p5;
        let x1 = x0.detach() + a;
        let x1_leaf = x1.detach().set_requires_grad(true);
        let p = &self.params;
        let h2 = layer_norm(&x1_leaf, &p[6], &p[7]);
        let h2_full = self.to_full(pg, &h2)?;
        let p = &self.params;
        // The same for c_fc: with sequence parallelism the graph starts at its output.
        let (h2_leaf, fc) = if sp {
            let fc = tch::no_grad(|| linear_in(k, &h2_full, &p[8], Some(&p[9]))).set_requires_grad(true);
            (fc.shallow_clone(), fc)
        } else {
            let h2_leaf = h2_full.set_requires_grad(true);
            let fc = linear_in(k, &h2_leaf, &p[8], Some(&p[9]));
            (h2_leaf, fc)
        }; // fc: (B, T, 4C/t)
        let partial_m = linear_in(k, &fc.gelu("none"), &p[10], None).to_kind(Kind::Float);
        let p11 = p[11].detach();
        let m = self.sum_partials(pg, &partial_m)? + p11;
        let out = x1 + m;
        self.saved.insert(mb, BlockSaved { x0, h1, h1_leaf, partial_a, x1_leaf, h2, h2_leaf, partial_m });
        Ok(out)
    }

    /// From dL/dy (the same on every rank): this rank's gradients of [`params`](Self::params)
    /// (sliced like them; the replicated ones alike on every rank) and dL/dx (the same on every
    /// rank). With sequence parallelism dL/dy and dL/dx are this rank's tokens'.
    pub fn backward(&mut self, pg: &ProcessGroup, dy: &Tensor) -> CommResult<(Vec<Tensor>, Tensor)> {
        self.backward_mb(pg, 0, dy)
    }

    /// [`backward`](Self::backward) of micro-batch `mb`.
    pub fn backward_mb(&mut self, pg: &ProcessGroup, mb: usize, dy: &Tensor) -> CommResult<(Vec<Tensor>, Tensor)> {
        if let Some(x) = self.inputs.remove(&mb) {
            let _ = self.forward_kept(pg, mb, &x)?; // recompute, now with the graph
        }
        let s = self.saved.remove(&mb).ok_or_else(|| {
            CommError::InvalidArgument(format!(
                "rank {}: TpBlock::backward of micro-batch {mb} without its forward",
                pg.rank()
            ))
        })?;
        let vjp = |out: &Tensor, grad: &Tensor, wrt: &[&Tensor]| -> Vec<Tensor> {
            Tensor::run_backward(&[(out * grad).sum(Kind::Float)], wrt, false, false)
        };
        let sum_bt = |g: &Tensor| g.sum_dim_intlist([0i64, 1].as_slice(), false, Kind::Float);
        let dy = dy.detach();
        let p: Vec<Tensor> = self.params.iter().map(|t| t.shallow_clone()).collect();
        let mut grads: Vec<Option<Tensor>> = (0..12).map(|_| None).collect();
        // MLP: g backward is the identity; the local graph from h2_leaf, then f: all-reduce dh2.
        grads[11] = Some(sum_bt(&dy));
        let dy_full = self.to_full(pg, &dy)?; // g backward: identity (sequence parallel: all-gather)
        let [g8, g9, g10, dh2]: [Tensor; 4] = if self.sequence_parallel {
            // The graph starts at c_fc's output: its gradient, then c_fc's by hand from h2
            // all-gathered again.
            let g = vjp(&s.partial_m, &dy_full, &[&p[10], &s.h2_leaf]);
            let [g10, d_fc]: [Tensor; 2] = g.try_into().expect("two gradients");
            let h2_full = self.to_full(pg, &s.h2)?;
            let (g8, g9, dh2) = linear_backward(&d_fc, &h2_full, &p[8]);
            [g8, g9, g10, dh2]
        } else {
            let g = vjp(&s.partial_m, &dy_full, &[&p[8], &p[9], &p[10], &s.h2_leaf]);
            g.try_into().expect("four gradients")
        };
        (grads[8], grads[9], grads[10]) = (Some(g8), Some(g9), Some(g10));
        let dh2 = self.sum_partials(pg, &dh2)?;
        let g = vjp(&s.h2, &dh2, &[&p[6], &p[7], &s.x1_leaf]);
        let [g6, g7, dx1_ln]: [Tensor; 3] = g.try_into().expect("three gradients");
        (grads[6], grads[7]) = (Some(g6), Some(g7));
        let dx1 = &dy + dx1_ln; // the residual path and the LayerNorm's
                                // Attention, the same way.
        grads[5] = Some(sum_bt(&dx1));
        let dx1_full = self.to_full(pg, &dx1)?;
        let [g2, g3, g4, dh1]: [Tensor; 4] = if self.sequence_parallel {
            let g = vjp(&s.partial_a, &dx1_full, &[&p[4], &s.h1_leaf]);
            let [g4, d_qkv]: [Tensor; 2] = g.try_into().expect("two gradients");
            let h1_full = self.to_full(pg, &s.h1)?;
            let (g2, g3, dh1) = linear_backward(&d_qkv, &h1_full, &p[2]);
            [g2, g3, g4, dh1]
        } else {
            let g = vjp(&s.partial_a, &dx1_full, &[&p[2], &p[3], &p[4], &s.h1_leaf]);
            g.try_into().expect("four gradients")
        };
        (grads[2], grads[3], grads[4]) = (Some(g2), Some(g3), Some(g4));
        let dh1 = self.sum_partials(pg, &dh1)?;
        let g = vjp(&s.h1, &dh1, &[&p[0], &p[1], &s.x0]);
        let [g0, g1, dx0_ln]: [Tensor; 3] = g.try_into().expect("three gradients");
        (grads[0], grads[1]) = (Some(g0), Some(g1));
        let dx = dx1 + dx0_ln;
        let mut grads: Vec<Tensor> = grads.into_iter().map(|g| g.expect("every gradient")).collect();
        if self.sequence_parallel {
            // The LayerNorms' and output biases' gradients came from this rank's tokens only:
            // sum them over the group, one all-reduce of their 6·C floats.
            let rep = [0usize, 1, 5, 6, 7, 11];
            let mut flat = Tensor::cat(&rep.map(|i| grads[i].reshape([-1])), 0);
            pg.all_reduce(&mut flat, ReduceOp::Sum)?;
            let c = grads[0].numel() as i64;
            for (j, &i) in rep.iter().enumerate() {
                grads[i] = flat.narrow(0, j as i64 * c, c).view_as(&grads[i]);
            }
        }
        Ok((grads, dx))
    }

    /// The full (unsplit) tensors of `sliced` — this block's parameters or their gradients,
    /// sliced like [`params`](Self::params) — gathered from every rank, in the GPT's order.
    pub fn unshard(&self, pg: &ProcessGroup, sliced: &[Tensor]) -> CommResult<Vec<Tensor>> {
        sliced.iter().enumerate().map(|(j, s)| unshard_one(pg, j, s)).collect()
    }
}

/// The whole tensor of a block's parameter `j` (0..12, the GPT's order) from this rank's slice
/// `s`, gathered from every rank of `pg` (a replicated one: a copy of this rank's).
pub(crate) fn unshard_one(pg: &ProcessGroup, j: usize, s: &Tensor) -> CommResult<Tensor> {
    let t = pg.world_size() as i64;
    Ok(match j {
        2 | 3 => {
            // (3C/t, …): q, k, v blocks of C/t rows each → gather each block's rows.
            let rows = s.size()[0];
            let rest: Vec<i64> = s.size()[1..].to_vec();
            let blocks = s.reshape([&[3, rows / 3][..], &rest].concat());
            let full = gather_dim(pg, &blocks, 1)?;
            full.reshape([&[rows * t][..], &rest].concat())
        }
        8 | 9 => gather_dim(pg, s, 0)?,
        4 | 10 => gather_dim(pg, s, 1)?,
        _ => s.detach().copy(),
    })
}
