//! A whole GPT under tensor parallelism (lesson 12): every block split by heads and column → row
//! ([`TpBlock`]), the token embedding split by vocabulary rows (Megatron's vocab-parallel
//! embedding), and the tied head computing only this rank's vocabulary columns of the logits,
//! which go straight into [`vocab_parallel_cross_entropy`] — the (B, T, V) logits are never
//! gathered. Every rank builds the full model from the same seed and keeps its slices
//! (picotron's trick), so a run equals one process's training up to f32 rounding (tests/tp.rs).
//!
//! Communication per step, all of it all-reduces over the tensor-parallel group (fp32):
//!
//! ```text
//! embedding  (B, T, C)   forward  g: sum of the ranks' rows (each id lives on one rank)
//! block × L  (B, T, C)   4 each   g twice forward, f twice backward
//! head       (B, T, C)   backward f: the LayerNorm output fed every rank's logits
//! loss       (B·T,)      3        row max, sum of exponentials, the target's logit
//! ```
//!
//! `4L + 5` all-reduces, `(4L + 2)·B·T·C + 3·B·T` floats — whatever t is. With sequence
//! parallelism ([`TpGpt::with_sequence_parallel`]) each (B, T, C) all-reduce becomes a
//! reduce-scatter or an all-gather along T (4L + 2 of each, the same bytes in twice the calls),
//! plus 2L all-gathers in backward (the LayerNorm outputs again, for the column-parallel weight
//! gradients) and L + 1 small all-reduces of the replicated parameters' gradients. What t divides is the
//! matrices (and their gradients and optimizer state): each rank holds `1/t` of every weight
//! matrix and of the embedding, and all of the LayerNorms, the position embedding and the output
//! biases.
//!
//! Run: `cargo run --release --bin lesson12`.

use super::{layer_norm, vocab_parallel_cross_entropy, TpBlock};
use crate::comm::{CommError, CommResult, CommStats, ProcessGroup, ReduceOp};
use crate::model::{Batch, Gpt, GptConfig, Model};
use crate::precision::Precision;
use tch::{Kind, Tensor};

/// A GPT split over a tensor-parallel group (fp32, CPU or one device per rank).
pub struct TpGpt {
    pub cfg: GptConfig,
    /// (V/t, C): this rank's vocabulary rows, ids `rank·V/t ..` — the embedding and the tied head.
    pub wte: Tensor,
    /// (block_size, C), replicated.
    pub wpe: Tensor,
    pub blocks: Vec<TpBlock>,
    /// ln_f weight and bias, replicated.
    pub ln_f: [Tensor; 2],
    /// Sequence parallelism (see [`with_sequence_parallel`](Self::with_sequence_parallel)).
    sequence_parallel: bool,
}

/// What one [`TpGpt::forward_backward`] gives.
pub struct TpStep {
    /// Mean cross-entropy of the batch, the same on every rank.
    pub loss: f64,
    /// This rank's gradients, sliced like [`TpGpt::params`] and in its order.
    pub grads: Vec<Tensor>,
    /// What the step communicated, from the group's own counters.
    pub comm: CommStats,
}

impl TpGpt {
    /// This rank's part of `gpt` over the tensor-parallel group `pg`. The vocabulary and the head
    /// count must divide by the group's size; fp32 only.
    pub fn from_gpt(gpt: &Gpt, pg: &ProcessGroup) -> Result<TpGpt, String> {
        let cfg = gpt.cfg;
        let (t, r) = (pg.world_size(), pg.rank());
        if cfg.vocab_size % t as i64 != 0 {
            return Err(format!(
                "a vocabulary of {} does not split over {t} tensor-parallel ranks (pad it to a multiple of {t}, as Megatron pads to 128·t)",
                cfg.vocab_size
            ));
        }
        if cfg.n_head % t as i64 != 0 {
            return Err(format!("{} heads do not split over {t} tensor-parallel ranks", cfg.n_head));
        }
        if gpt.precision() != Precision::Fp32 {
            return Err(format!("tensor parallelism here computes in fp32, not {:?}", gpt.precision()));
        }
        let p: Vec<Tensor> = gpt.parameters().iter().map(|p| p.detach()).collect();
        let leaf = |x: Tensor| x.set_requires_grad(true);
        let rep = |x: &Tensor| leaf(x.copy());
        let blocks = (0..cfg.n_layer as usize)
            .map(|l| TpBlock::from_full(&p[2 + 12 * l..14 + 12 * l], cfg.n_head, pg))
            .collect::<Result<Vec<_>, _>>()?;
        let n = p.len();
        Ok(TpGpt {
            cfg,
            // The embedding's rows are its output features of the head: a column-parallel slice.
            wte: leaf(super::column_shard(&p[0], t, r)?),
            wpe: rep(&p[1]),
            blocks,
            ln_f: [rep(&p[n - 2]), rep(&p[n - 1])],
            sequence_parallel: false,
        })
    }

    /// Sequence parallelism on or off (Korthikanti et al. 2022): between the split matmuls each
    /// rank keeps only its T/t tokens (rank r the r-th slice of T) — the blocks' LayerNorms and
    /// residuals ([`TpBlock::sequence_parallel`]), the embeddings' sum and ln_f. The vocab-parallel
    /// embedding reduce-scatters instead of all-reducing, the head all-gathers ln_f's output
    /// before the logits and reduce-scatters its gradient. The same losses and gradients; T must
    /// divide by the group's size.
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self.blocks = std::mem::take(&mut self.blocks).into_iter().map(|b| b.sequence_parallel(on)).collect();
        self
    }

    /// This rank's parameters in the GPT's order (wte, wpe, 12 per block, ln_f): handles, not copies.
    pub fn params(&self) -> Vec<Tensor> {
        let mut v = vec![self.wte.shallow_clone(), self.wpe.shallow_clone()];
        for b in &self.blocks {
            v.extend(b.params.iter().map(|p| p.shallow_clone()));
        }
        v.extend(self.ln_f.iter().map(|p| p.shallow_clone()));
        v
    }

    /// Whether parameter `i` (in [`params`](Self::params) order) is split over the group — its
    /// gradient's square counts from every rank in the global norm — or replicated (counted once).
    pub fn is_split(&self, i: usize) -> bool {
        let last = 2 + 12 * self.blocks.len();
        i == 0 || (2..last).contains(&i) && matches!((i - 2) % 12, 2 | 3 | 4 | 8 | 9 | 10)
    }

    /// Forward and backward of one batch (`x`, `y` (B, T), the same on every rank of `pg`).
    pub fn forward_backward(&mut self, pg: &ProcessGroup, batch: &Batch) -> CommResult<TpStep> {
        let before = pg.stats();
        let bad = |m: String| CommError::InvalidArgument(format!("rank {}: TpGpt: {m}", pg.rank()));
        let (_b, t) = batch.x.size2().map_err(|e| bad(format!("ids must be (B, T): {e}")))?;
        if t > self.cfg.block_size || batch.y.size() != batch.x.size() {
            return Err(bad(format!(
                "ids {:?} and targets {:?}: both (B, T) with T ≤ {}",
                batch.x.size(),
                batch.y.size(),
                self.cfg.block_size
            )));
        }
        let (lo_id, hi_id) = (batch.x.min().int64_value(&[]), batch.x.max().int64_value(&[]));
        if lo_id < 0 || hi_id >= self.cfg.vocab_size {
            // The one-process GPT would fail the lookup; a split table would silently give zeros.
            let e = bad(format!("input ids in {lo_id}..={hi_id}, outside the vocabulary 0..{}", self.cfg.vocab_size));
            pg.abort(&e.to_string());
            return Err(e);
        }
        let tp = pg.world_size() as i64;
        let sp = self.sequence_parallel;
        if sp && t % tp != 0 {
            return Err(bad(format!("sequence parallelism: {t} tokens do not split over {tp} ranks")));
        }
        let vl = self.wte.size()[0];
        let lo = pg.rank() as i64 * vl;
        // Vocab-parallel embedding: an id outside this rank's rows looks up a clamped row and is zeroed;
        // g (all-reduce forward, identity backward) sums the one rank that holds each id.
        let local = &batch.x - lo;
        let mine = local.ge(0).logical_and(&local.lt(vl)).to_kind(Kind::Float).unsqueeze(-1);
        let tok_part = Tensor::embedding(&self.wte, &local.clamp(0, vl - 1), -1, false, false) * mine; // (B, T, C)
        let pos = Tensor::arange(t, (Kind::Int64, batch.x.device()));
        let pos_e = Tensor::embedding(&self.wpe, &pos, -1, false, false); // (T, C)
        let (tl, t0) = if sp { (t / tp, pg.rank() as i64 * (t / tp)) } else { (t, 0) }; // this rank's tokens
        let mut x = if sp {
            super::scatter_dim(pg, &tok_part.detach(), 1)? // (B, T/t, C): this rank's tokens, summed
        } else {
            let mut tok = tok_part.detach().copy();
            pg.all_reduce(&mut tok, ReduceOp::Sum)?;
            tok
        } + pos_e.detach().narrow(0, t0, tl);
        for b in &mut self.blocks {
            x = b.forward(pg, &x)?;
        }
        // Head: ln_f, then f (identity forward; sequence parallel: all-gather along T) into this
        // rank's (B, T, V/t) columns of the logits.
        let x_l = x.detach().set_requires_grad(true);
        let h = layer_norm(&x_l, &self.ln_f[0], &self.ln_f[1]);
        let h_leaf = if sp { super::gather_dim(pg, &h.detach(), 1)? } else { h.detach() }.set_requires_grad(true);
        let logits = h_leaf.linear::<Tensor>(&self.wte, None).view([-1, vl]); // (B·T, V/t)
        let (loss, dlogits) = vocab_parallel_cross_entropy(pg, &logits.detach(), &batch.y.view([-1]))?;
        // Backward, in reverse: the head's local graph, then f backward — all-reduce dL/dh.
        let g = Tensor::run_backward(&[(&logits * &dlogits).sum(Kind::Float)], &[&self.wte, &h_leaf], false, false);
        let [g_wte_head, dh]: [Tensor; 2] = g.try_into().expect("two gradients");
        let dh = if sp {
            super::scatter_dim(pg, &dh, 1)? // this rank's tokens of the sum over the vocabulary slices
        } else {
            let mut dh = dh;
            pg.all_reduce(&mut dh, ReduceOp::Sum)?;
            dh
        };
        let g =
            Tensor::run_backward(&[(&h * &dh).sum(Kind::Float)], &[&self.ln_f[0], &self.ln_f[1], &x_l], false, false);
        let [mut g_lnw, mut g_lnb, mut dx]: [Tensor; 3] = g.try_into().expect("three gradients");
        if sp {
            // ln_f's gradients came from this rank's tokens: sum them over the group.
            let mut flat = Tensor::cat(&[&g_lnw, &g_lnb], 0);
            pg.all_reduce(&mut flat, ReduceOp::Sum)?;
            let c = g_lnw.numel() as i64;
            (g_lnw, g_lnb) = (flat.narrow(0, 0, c), flat.narrow(0, c, c));
        }
        let mut block_grads = Vec::with_capacity(self.blocks.len());
        for b in self.blocks.iter_mut().rev() {
            let (g, d) = b.backward(pg, &dx)?;
            block_grads.push(g);
            dx = d;
        }
        // The embedding's g backward is the identity (sequence parallel: all-gather along T): each
        // rank's rows get dL/dx where they were used, and wpe every position's gradient.
        let dx = if sp { super::gather_dim(pg, &dx, 1)? } else { dx };
        let surrogate = (&tok_part * &dx).sum(Kind::Float) + (pos_e.unsqueeze(0) * &dx).sum(Kind::Float);
        let g = Tensor::run_backward(&[surrogate], &[&self.wte, &self.wpe], false, false);
        let [g_wte_emb, g_wpe]: [Tensor; 2] = g.try_into().expect("two gradients");
        let mut grads = vec![g_wte_head + g_wte_emb, g_wpe];
        grads.extend(block_grads.into_iter().rev().flatten());
        grads.extend([g_lnw, g_lnb]);
        Ok(TpStep { loss, grads, comm: pg.stats().since(&before) })
    }

    /// The full (unsplit) tensors of `sliced` (parameters or gradients, sliced like
    /// [`params`](Self::params)), gathered from every rank, in the GPT's order.
    pub fn unshard(&self, pg: &ProcessGroup, sliced: &[Tensor]) -> CommResult<Vec<Tensor>> {
        let mut out = vec![super::gather_dim(pg, &sliced[0], 0)?, sliced[1].detach().copy()];
        for (l, b) in self.blocks.iter().enumerate() {
            out.extend(b.unshard(pg, &sliced[2 + 12 * l..14 + 12 * l])?);
        }
        let n = sliced.len();
        out.extend([sliced[n - 2].detach().copy(), sliced[n - 1].detach().copy()]);
        Ok(out)
    }

    /// Bytes of parameters this rank holds, measured from its tensors.
    pub fn param_bytes(&self) -> u64 {
        crate::memory::held_bytes(self.params().iter())
    }
}
