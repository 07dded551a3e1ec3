//! Tensor parallelism (lesson 12), Megatron-LM's way: the matrices inside a layer are split over
//! the `t` ranks of a tensor-parallel group, each rank computes with its slice, and two conjugate
//! operators stitch the results together.
//!
//! For a linear layer `y = x·Wᵀ + b` with PyTorch's weight layout `W: (out, in)`:
//!
//! * **column-parallel** ([`column_shard`]): each rank keeps `out/t` rows of W (and of b) and
//!   computes its `out/t` features of y from the whole x — no communication forward;
//! * **row-parallel** ([`row_shard`]): each rank keeps `in/t` columns of W, reads only its `in/t`
//!   features of x and computes a partial y; the partials are **summed** (an all-reduce).
//!
//! An MLP `x → fc (C → 4C) → GELU → proj (4C → C)` splits column → row ([`TpMlp`]): the GELU
//! works on each rank's own 4C/t features (it is elementwise), so the only communication is one
//! all-reduce of the (B, T, C) output in forward (Megatron's operator **g**: all-reduce forward,
//! identity backward) and one of the (B, T, C) input gradient in backward (operator **f**:
//! identity forward, all-reduce backward — every rank's x fed all its features, so each rank's
//! partial dx is summed). Two all-reduces of B·T·C elements per MLP, forward and backward
//! together; attention splits the same way by heads.
//!
//! tch has no custom autograd functions, so f and g are explicit: forward builds the local graph
//! from a leaf copy of x and stops at the partial output; backward runs the local graph from the
//! output gradient (`Tensor::run_backward`, which returns the gradients, as the stage runner
//! does) and all-reduces the input gradient — the communication sits between the pieces.

mod block;
mod gpt;
mod stages;
pub(crate) use block::layer_norm;
pub use block::TpBlock;
pub use gpt::{split_of, Split, TpGpt, TpStep};

use crate::comm::{CommError, CommResult, ProcessGroup, ReduceOp};
use tch::{Kind, Tensor};

/// Rows `rank·out/t ..` of a `(out, in)` weight (or of a bias): a column-parallel layer's slice.
/// `out` must divide by `tp`.
pub fn column_shard(w: &Tensor, tp: usize, rank: usize) -> Result<Tensor, String> {
    shard(w, 0, tp, rank)
}

/// Columns `rank·in/t ..` of a `(out, in)` weight: a row-parallel layer's slice. `in` must
/// divide by `tp`.
pub fn row_shard(w: &Tensor, tp: usize, rank: usize) -> Result<Tensor, String> {
    shard(w, 1, tp, rank)
}

fn shard(w: &Tensor, dim: usize, tp: usize, rank: usize) -> Result<Tensor, String> {
    let size = w.size();
    let n = *size.get(dim).ok_or_else(|| format!("a tensor of shape {size:?} has no dimension {dim}"))?;
    if tp == 0 || rank >= tp || n % tp as i64 != 0 {
        return Err(format!("dimension {dim} of {size:?} ({n}) does not split into {tp} equal parts (rank {rank})"));
    }
    let k = n / tp as i64;
    Ok(w.narrow(dim as i64, rank as i64 * k, k).detach().copy())
}

/// A GPT MLP split column → row over a tensor-parallel group: `c_fc` column-parallel, `c_proj`
/// row-parallel, `c_proj`'s bias replicated (added once, after the sum).
pub struct TpMlp {
    /// (4C/t, C), (4C/t): this rank's output features of c_fc.
    pub w_fc: Tensor,
    pub b_fc: Tensor,
    /// (C, 4C/t): this rank's input features of c_proj; (C,) replicated.
    pub w_proj: Tensor,
    pub b_proj: Tensor,
    /// The forward's leaf copy of x and its partial output (before the all-reduce), kept for backward.
    saved: Option<(Tensor, Tensor)>,
    /// Bytes this layer all-reduced (forward output + backward input gradient).
    pub bytes_all_reduced: u64,
}

impl TpMlp {
    /// This rank's slices of a full MLP (`c_fc` (4C, C) and (4C,), `c_proj` (C, 4C) and (C,)),
    /// every rank building the full weights alike (same seed) and keeping its part.
    pub fn from_full(
        w_fc: &Tensor,
        b_fc: &Tensor,
        w_proj: &Tensor,
        b_proj: &Tensor,
        pg: &ProcessGroup,
    ) -> Result<TpMlp, String> {
        let (t, r) = (pg.world_size(), pg.rank());
        let leaf = |x: Tensor| x.set_requires_grad(true);
        Ok(TpMlp {
            w_fc: leaf(column_shard(w_fc, t, r)?),
            b_fc: leaf(column_shard(b_fc, t, r)?),
            w_proj: leaf(row_shard(w_proj, t, r)?),
            b_proj: leaf(b_proj.detach().copy()),
            saved: None,
            bytes_all_reduced: 0,
        })
    }

    /// y = proj(GELU(fc(x))) for the whole x (B, T, C), the same on every rank of `pg`.
    pub fn forward(&mut self, pg: &ProcessGroup, x: &Tensor) -> CommResult<Tensor> {
        if self.saved.is_some() {
            return Err(CommError::InvalidArgument(format!(
                "rank {}: TpMlp::forward twice without a backward (it keeps one forward's graph)",
                pg.rank()
            )));
        }
        // f: identity forward (x is replicated); a leaf so that backward yields this rank's dx.
        let x_leaf = x.detach().set_requires_grad(true);
        // (B, T, 4C/t) local features, GELU elementwise, then (B, T, C) partial sums.
        let h = x_leaf.linear(&self.w_fc, Some(&self.b_fc)).gelu("none");
        let partial = h.linear::<Tensor>(&self.w_proj, None);
        // g: all-reduce forward — (B, T, C) f32 summed over tp.
        let mut y = partial.detach().copy();
        pg.all_reduce(&mut y, ReduceOp::Sum)?;
        self.bytes_all_reduced += (y.numel() * y.kind().elt_size_in_bytes()) as u64;
        self.saved = Some((x_leaf, partial));
        Ok(y + &self.b_proj.detach())
    }

    /// From dL/dy (B, T, C), the same on every rank: this rank's weight gradients (of `w_fc`,
    /// `b_fc`, `w_proj`, `b_proj`, in that order; the last alike on every rank) and dL/dx, the same
    /// on every rank.
    pub fn backward(&mut self, pg: &ProcessGroup, dy: &Tensor) -> CommResult<([Tensor; 4], Tensor)> {
        let (x_leaf, partial) = self.saved.take().ok_or_else(|| {
            CommError::InvalidArgument(format!("rank {}: TpMlp::backward without a forward", pg.rank()))
        })?;
        // g backward: identity — each rank's partial output gets the whole dy. One backward of
        // the local graph gives the slices' gradients and this rank's part of dx.
        let dy = dy.detach();
        let surrogate = (&partial * &dy).sum(Kind::Float);
        let g = Tensor::run_backward(&[&surrogate], &[&self.w_fc, &self.b_fc, &self.w_proj, &x_leaf], false, false);
        let [g_fc, g_bfc, g_proj, dx_part]: [Tensor; 4] = g.try_into().expect("four gradients");
        // The replicated bias: dy summed over (B, T), alike on every rank.
        let g_bproj = dy.sum_dim_intlist([0i64, 1].as_slice(), false, Kind::Float);
        // f backward: all-reduce the partial input gradients — (B, T, C) summed over tp.
        let mut dx = dx_part;
        pg.all_reduce(&mut dx, ReduceOp::Sum)?;
        self.bytes_all_reduced += (dx.numel() * dx.kind().elt_size_in_bytes()) as u64;
        Ok(([g_fc, g_bfc, g_proj, g_bproj], dx))
    }
}

/// All-gather a tensor split along `dim` over `pg` (each rank holding an equal slice): the whole
/// tensor, on every rank.
pub fn gather_dim(pg: &ProcessGroup, slice: &Tensor, dim: i64) -> CommResult<Tensor> {
    let moved = slice.transpose(0, dim).contiguous();
    let mut size = moved.size();
    let mut all = Tensor::zeros([moved.numel() as i64 * pg.world_size() as i64], (moved.kind(), moved.device()));
    pg.all_gather(&mut all, &moved.reshape([-1]))?;
    size[0] *= pg.world_size() as i64;
    Ok(all.reshape(size).transpose(0, dim).contiguous())
}

/// The reverse of [`gather_dim`]: `full` summed over `pg` (each rank's partial sums) and this
/// rank's `1/t` of the sum along `dim` (rank r gets the r-th slice): one reduce-scatter.
pub fn scatter_dim(pg: &ProcessGroup, full: &Tensor, dim: i64) -> CommResult<Tensor> {
    let t = pg.world_size() as i64;
    let moved = full.transpose(0, dim).contiguous();
    let mut size = moved.size();
    if size[0] % t != 0 {
        return Err(CommError::InvalidArgument(format!(
            "rank {}: dimension {dim} of {:?} does not split over {t} ranks",
            pg.rank(),
            full.size()
        )));
    }
    size[0] /= t;
    let mut part = Tensor::zeros([moved.numel() as i64 / t], (moved.kind(), moved.device()));
    pg.reduce_scatter(&mut part, &moved.reshape([-1]), ReduceOp::Sum)?;
    Ok(part.reshape(size).transpose(0, dim).contiguous())
}

/// Mean cross-entropy over a vocabulary split across `pg` (Megatron's vocab-parallel loss):
/// `logits` (N, V/t) are this rank's columns — vocabulary ids `rank·V/t ..` — and `targets` (N,)
/// the global ids. The full (N, V) logits are never gathered: three all-reduces of N numbers
/// (the row maxima, the sums of exponentials, the target logits). Returns the loss (the same on
/// every rank) and dL/d(logits) for this rank's columns.
pub fn vocab_parallel_cross_entropy(pg: &ProcessGroup, logits: &Tensor, targets: &Tensor) -> CommResult<(f64, Tensor)> {
    let fail = |m: String| {
        // A bad argument on one rank: abort, so that the others fail too instead of waiting.
        let e = format!("rank {}: vocab_parallel_cross_entropy: {m}", pg.rank());
        pg.abort(&e);
        CommError::InvalidArgument(e)
    };
    let (n, vl) = logits.size2().map_err(|e| fail(format!("logits must be (N, V/t): {e}")))?;
    if targets.size() != [n] {
        return Err(fail(format!("targets {:?} for logits {:?}", targets.size(), logits.size())));
    }
    let v = vl * pg.world_size() as i64;
    let targets = targets.to_device(logits.device()).to_kind(Kind::Int64);
    let (tmin, tmax) = (targets.min().int64_value(&[]), targets.max().int64_value(&[]));
    if tmin < -1 || tmax >= v {
        return Err(fail(format!("targets in {tmin}..={tmax}: ids must be in 0..{v}, or −1 (ignored)")));
    }
    // Targets −1 are ignored, as the GPT's loss ignores them: the mean is over the others.
    let valid = targets.ne(-1).to_kind(Kind::Float);
    let count = valid.sum(Kind::Float).double_value(&[]).max(1.0);
    let lo = pg.rank() as i64 * vl;
    let z = logits.detach().to_kind(Kind::Float);
    // (N,) max over the whole vocabulary, for a stable exp.
    let mut m = z.amax([1i64].as_slice(), false);
    pg.all_reduce(&mut m, ReduceOp::Max)?;
    let e = (&z - m.unsqueeze(1)).exp();
    let mut sum = e.sum_dim_intlist([1i64].as_slice(), false, Kind::Float);
    pg.all_reduce(&mut sum, ReduceOp::Sum)?;
    // The target's logit, from the rank whose columns hold it (0 elsewhere).
    let local = targets.to_kind(Kind::Int64) - lo;
    let mine = local.ge(0).logical_and(&local.lt(vl));
    let idx = local.clamp(0, vl - 1);
    let picked = z.gather(1, &idx.unsqueeze(1), false).squeeze_dim(1) * mine.to_kind(Kind::Float);
    let mut zt = picked;
    pg.all_reduce(&mut zt, ReduceOp::Sum)?;
    let loss = ((sum.log() + &m - zt) * &valid).sum(Kind::Float).double_value(&[]) / count;
    // dL/dz = (softmax − one-hot) / (targets counted), this rank's columns; 0 for ignored rows.
    let onehot = Tensor::zeros([n, vl], (Kind::Float, z.device())).scatter_value(1, &idx.unsqueeze(1), 1.0)
        * mine.to_kind(Kind::Float).unsqueeze(1);
    let grad = (e / sum.unsqueeze(1) - onehot) * valid.unsqueeze(1) / count;
    Ok((loss, grad))
}
