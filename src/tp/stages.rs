//! A tensor-parallel GPT stage by stage (the GPT's stages: 0 the embeddings, 1..=L the blocks,
//! L + 1 the head and loss), one micro-batch at a time: what [`TpGpt::forward_backward`] chains
//! for a whole batch, and what a pipeline rank runs for its stages (3-D parallelism). Each stage's
//! forward keeps what its backward needs under the micro-batch's key, so several micro-batches can
//! be in flight (pipeline schedules).

use super::{gather_dim, layer_norm, scatter_dim, vocab_parallel_cross_entropy, TpGpt};
use crate::comm::{CommError, CommResult, ProcessGroup, ReduceOp};
use crate::model::Batch;
use tch::{Kind, Tensor};

/// What the embeddings' forward keeps: the graphs from wte and wpe to their outputs.
pub(super) struct EmbSaved {
    tok_part: Tensor,
    pos_e: Tensor,
}

/// What the head's forward keeps: ln_f's graph, the logits' graph and dL/dlogits.
pub(super) struct HeadSaved {
    x_l: Tensor,
    h: Tensor,
    h_leaf: Tensor,
    logits: Tensor,
    dlogits: Tensor,
}

impl TpGpt {
    fn bad(pg: &ProcessGroup, m: String) -> CommError {
        CommError::InvalidArgument(format!("rank {}: TpGpt: {m}", pg.rank()))
    }

    /// The forward of GPT stage `s` (one this rank runs) on micro-batch `mb` of `batch`: `x` is
    /// the previous stage's output (ignored by stage 0, which reads `batch.x`). Returns the
    /// stage's output — (B, T, C), or (B, T/t, C) with sequence parallelism, the same on every
    /// rank — or, for the head, the batch's mean loss as a scalar.
    pub fn stage_forward(
        &mut self,
        pg: &ProcessGroup,
        s: usize,
        mb: usize,
        x: &Tensor,
        batch: &Batch,
    ) -> CommResult<Tensor> {
        let l = self.cfg.n_layer as usize;
        if !self.stages.contains(&s) {
            return Err(Self::bad(pg, format!("stage {s} is not this rank's (it runs {:?})", self.stages)));
        }
        match s {
            0 => self.embed_forward(pg, mb, batch),
            _ if s <= l => {
                let b = s - self.stages.start.max(1);
                self.blocks[b].forward_mb(pg, mb, x)
            }
            _ => self.head_forward(pg, mb, x, batch),
        }
    }

    /// The backward of stage `s` on micro-batch `mb` from `dy`, the gradient of its output (for
    /// the head: the loss's weight, a scalar). Returns this rank's gradients of the stage's
    /// parameters, by index in the GPT's `named_parameters` (the tied wte from both its stages),
    /// and the gradient of the stage's input (none for stage 0).
    pub fn stage_backward(
        &mut self,
        pg: &ProcessGroup,
        s: usize,
        mb: usize,
        dy: &Tensor,
    ) -> CommResult<(Vec<(usize, Tensor)>, Option<Tensor>)> {
        let l = self.cfg.n_layer as usize;
        if !self.stages.contains(&s) {
            return Err(Self::bad(pg, format!("stage {s} is not this rank's (it runs {:?})", self.stages)));
        }
        match s {
            0 => Ok((self.embed_backward(pg, mb, dy)?, None)),
            _ if s <= l => {
                let b = s - self.stages.start.max(1);
                let (g, dx) = self.blocks[b].backward_mb(pg, mb, dy)?;
                Ok((g.into_iter().enumerate().map(|(j, g)| (2 + 12 * (s - 1) + j, g)).collect(), Some(dx)))
            }
            _ => {
                let (g, dx) = self.head_backward(pg, mb, dy)?;
                Ok((g, Some(dx)))
            }
        }
    }

    /// Vocab-parallel embedding: an id outside this rank's rows looks up a clamped row and is
    /// zeroed; g (all-reduce forward, identity backward; sequence parallel: reduce-scatter along
    /// T) sums the one rank that holds each id.
    fn embed_forward(&mut self, pg: &ProcessGroup, mb: usize, batch: &Batch) -> CommResult<Tensor> {
        let (_b, t) = batch.x.size2().map_err(|e| Self::bad(pg, format!("ids must be (B, T): {e}")))?;
        if t > self.cfg.block_size || batch.y.size() != batch.x.size() {
            return Err(Self::bad(
                pg,
                format!(
                    "ids {:?} and targets {:?}: both (B, T) with T ≤ {}",
                    batch.x.size(),
                    batch.y.size(),
                    self.cfg.block_size
                ),
            ));
        }
        let (lo_id, hi_id) = (batch.x.min().int64_value(&[]), batch.x.max().int64_value(&[]));
        if lo_id < 0 || hi_id >= self.cfg.vocab_size {
            // The one-process GPT would fail the lookup; a split table would silently give zeros.
            let e = Self::bad(
                pg,
                format!("input ids in {lo_id}..={hi_id}, outside the vocabulary 0..{}", self.cfg.vocab_size),
            );
            pg.abort(&e.to_string());
            return Err(e);
        }
        let tp = pg.world_size() as i64;
        let sp = self.sequence_parallel;
        if sp && t % tp != 0 {
            return Err(Self::bad(pg, format!("sequence parallelism: {t} tokens do not split over {tp} ranks")));
        }
        let vl = self.wte.size()[0];
        let lo = pg.rank() as i64 * vl;
        let local = &batch.x - lo;
        let mine = local.ge(0).logical_and(&local.lt(vl)).to_kind(Kind::Float).unsqueeze(-1);
        let tok_part = Tensor::embedding(&self.wte, &local.clamp(0, vl - 1), -1, false, false) * mine; // (B, T, C)
        let pos = Tensor::arange(t, (Kind::Int64, batch.x.device()));
        let pos_e = Tensor::embedding(&self.wpe, &pos, -1, false, false); // (T, C)
        let (tl, t0) = if sp { (t / tp, pg.rank() as i64 * (t / tp)) } else { (t, 0) }; // this rank's tokens
        let x = if sp {
            scatter_dim(pg, &tok_part.detach(), 1)? // (B, T/t, C): this rank's tokens, summed
        } else {
            let mut tok = tok_part.detach().copy();
            pg.all_reduce(&mut tok, ReduceOp::Sum)?;
            tok
        } + pos_e.detach().narrow(0, t0, tl);
        self.emb_saved.insert(mb, EmbSaved { tok_part, pos_e });
        Ok(x)
    }

    /// The embedding's g backward is the identity (sequence parallel: all-gather along T): each
    /// rank's rows get dL/dx where they were used, and wpe every position's gradient.
    fn embed_backward(&mut self, pg: &ProcessGroup, mb: usize, dx: &Tensor) -> CommResult<Vec<(usize, Tensor)>> {
        let s = self.emb_saved.remove(&mb).ok_or_else(|| Self::bad(pg, format!("no embedding forward of {mb}")))?;
        let dx = if self.sequence_parallel { gather_dim(pg, dx, 1)? } else { dx.shallow_clone() };
        let surrogate = (&s.tok_part * &dx).sum(Kind::Float) + (s.pos_e.unsqueeze(0) * &dx).sum(Kind::Float);
        let g = Tensor::run_backward(&[surrogate], &[&self.wte, &self.wpe], false, false);
        let [g_wte, g_wpe]: [Tensor; 2] = g.try_into().expect("two gradients");
        Ok(vec![(0, g_wte), (1, g_wpe)])
    }

    /// Head: ln_f, then f (identity forward; sequence parallel: all-gather along T) into this
    /// rank's (B, T, V/t) columns of the logits, and the vocab-parallel loss.
    fn head_forward(&mut self, pg: &ProcessGroup, mb: usize, x: &Tensor, batch: &Batch) -> CommResult<Tensor> {
        let vl = self.wte.size()[0];
        let x_l = x.detach().set_requires_grad(true);
        let h = layer_norm(&x_l, &self.ln_f[0], &self.ln_f[1]);
        let h_leaf = if self.sequence_parallel { gather_dim(pg, &h.detach(), 1)? } else { h.detach() };
        let h_leaf = h_leaf.set_requires_grad(true);
        // (B·T, V/t), in the compute kind (bf16 autocast: upcast for the loss, as the GPT's head).
        let logits = super::block::linear_in(self.compute, &h_leaf, &self.wte, None).view([-1, vl]);
        let (loss, dlogits) =
            vocab_parallel_cross_entropy(pg, &logits.detach().to_kind(Kind::Float), &batch.y.view([-1]))?;
        self.head_saved.insert(mb, HeadSaved { x_l, h, h_leaf, logits, dlogits });
        Ok(Tensor::from(loss))
    }

    /// The head's backward for the loss weighted by `w` (a scalar): the local graph of the
    /// logits, then f backward — all-reduce dL/dh (sequence parallel: reduce-scatter along T) —
    /// then ln_f's. Gradients of the tied wte (its head part) and of ln_f, and dL/dx.
    fn head_backward(
        &mut self,
        pg: &ProcessGroup,
        mb: usize,
        w: &Tensor,
    ) -> CommResult<(Vec<(usize, Tensor)>, Tensor)> {
        let s = self.head_saved.remove(&mb).ok_or_else(|| Self::bad(pg, format!("no head forward of {mb}")))?;
        let sp = self.sequence_parallel;
        // The weight scales the scalar objective, not dL/dlogits: no extra pass over (B·T, V/t).
        let obj = (&s.logits * &s.dlogits).sum(Kind::Float) * w.to_kind(Kind::Float);
        let g = Tensor::run_backward(&[obj], &[&self.wte, &s.h_leaf], false, false);
        let [g_wte, dh]: [Tensor; 2] = g.try_into().expect("two gradients");
        let dh = if sp {
            scatter_dim(pg, &dh, 1)? // this rank's tokens of the sum over the vocabulary slices
        } else {
            let mut dh = dh;
            pg.all_reduce(&mut dh, ReduceOp::Sum)?;
            dh
        };
        let wrt = [&self.ln_f[0], &self.ln_f[1], &s.x_l];
        let g = Tensor::run_backward(&[(&s.h * &dh).sum(Kind::Float)], &wrt, false, false);
        let [mut g_lnw, mut g_lnb, dx]: [Tensor; 3] = g.try_into().expect("three gradients");
        if sp {
            // ln_f's gradients came from this rank's tokens: sum them over the group.
            let mut flat = Tensor::cat(&[&g_lnw, &g_lnb], 0);
            pg.all_reduce(&mut flat, ReduceOp::Sum)?;
            let c = g_lnw.numel() as i64;
            (g_lnw, g_lnb) = (flat.narrow(0, 0, c), flat.narrow(0, c, c));
        }
        let n = 2 + 12 * self.cfg.n_layer as usize;
        Ok((vec![(0, g_wte), (n, g_lnw), (n + 1, g_lnb)], dx))
    }
}
