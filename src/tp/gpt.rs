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

use super::TpBlock;
use crate::comm::{CommError, CommResult, CommStats, ProcessGroup};
use crate::model::{Batch, Gpt, GptConfig, Model};
use crate::precision::Precision;
use tch::{Kind, Tensor};

/// How tensor parallelism splits a GPT parameter over a group of `t` ranks; rank `r` holds the
/// `r`-th of `t` equal parts of what is split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds it whole (LayerNorms, wpe, the row-parallel layers' biases).
    Replicated,
    /// Its rows (dimension 0): the vocab-parallel wte, column-parallel c_fc's weight and bias.
    Rows,
    /// Its columns (dimension 1): row-parallel `attn.c_proj` and `mlp.c_proj` weights.
    Columns,
    /// Its rows within each of the q, k and v thirds (a rank's heads): c_attn's weight and bias.
    QkvRows,
}

/// How the GPT's parameter `k` (its `named_parameters` order) is split (the slicing of
/// [`TpBlock::from_full`] and [`TpGpt::from_gpt`]).
pub fn split_of(cfg: &GptConfig, k: usize) -> Split {
    let last = 2 + 12 * cfg.n_layer as usize;
    if k == 0 {
        return Split::Rows;
    }
    if !(2..last).contains(&k) {
        return Split::Replicated;
    }
    match (k - 2) % 12 {
        2 | 3 => Split::QkvRows,
        8 | 9 => Split::Rows,
        4 | 10 => Split::Columns,
        _ => Split::Replicated,
    }
}

/// A GPT split over a tensor-parallel group (fp32 parameters, matmuls in fp32 or bf16; CPU or one
/// device per rank).
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
    pub(super) sequence_parallel: bool,
    /// The matrix multiplies' kind: fp32, or bf16 when the GPT it was cut from computes in bf16
    /// (autocast: [`TpBlock::with_compute`]; the logits too, upcast for the loss).
    pub(super) compute: Kind,
    /// The GPT stages this rank runs (0: embeddings, 1..=L: blocks, L + 1: head): all of them,
    /// or a pipeline rank's ([`from_gpt_stages`](Self::from_gpt_stages)). The tensors of the
    /// others are empty and `blocks` holds only the blocks in range.
    pub(super) stages: std::ops::Range<usize>,
    pub(super) emb_saved: std::collections::BTreeMap<usize, super::stages::EmbSaved>,
    pub(super) head_saved: std::collections::BTreeMap<usize, super::stages::HeadSaved>,
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
    /// count must divide by the group's size; the GPT computes in fp32 or bf16 (autocast).
    pub fn from_gpt(gpt: &Gpt, pg: &ProcessGroup) -> Result<TpGpt, String> {
        Self::from_gpt_stages(gpt, pg, 0..gpt.cfg.n_layer as usize + 2)
    }

    /// This rank's part of the GPT stages `stages` of `gpt` (which holds at least their
    /// parameters: a pipeline rank's model, [`Gpt::new_only`]) over the tensor-parallel group
    /// `pg` — a pipeline rank's piece under 3-D parallelism.
    pub fn from_gpt_stages(gpt: &Gpt, pg: &ProcessGroup, stages: std::ops::Range<usize>) -> Result<TpGpt, String> {
        let cfg = gpt.cfg;
        let (t, r) = (pg.world_size(), pg.rank());
        let l = cfg.n_layer as usize;
        if stages.is_empty() || stages.end > l + 2 {
            return Err(format!("stages {stages:?} of a GPT of {} stages", l + 2));
        }
        if cfg.vocab_size % t as i64 != 0 {
            return Err(format!(
                "a vocabulary of {} does not split over {t} tensor-parallel ranks (pad it to a multiple of {t}, as Megatron pads to 128·t)",
                cfg.vocab_size
            ));
        }
        if cfg.n_head % t as i64 != 0 {
            return Err(format!("{} heads do not split over {t} tensor-parallel ranks", cfg.n_head));
        }
        let compute = match gpt.precision() {
            Precision::Fp32 => Kind::Float,
            Precision::Bf16 => Kind::BFloat16,
            p => {
                return Err(format!(
                    "tensor parallelism computes in fp32 or bf16 (autocast), not {p:?} (fp16 needs a loss scaler \
                     the engine does not run: use bf16)"
                ))
            }
        };
        let p: Vec<Tensor> = gpt.parameters().iter().map(|p| p.detach()).collect();
        // The stages' parameters must be there (a pipeline rank's GPT holds only its own).
        let shapes = cfg.param_shapes();
        let mut needed: Vec<usize> = Gpt::stage_uses_of(&cfg)[stages.clone()].iter().flatten().copied().collect();
        needed.sort_unstable();
        needed.dedup();
        if let Some(&k) = needed.iter().find(|&&k| p[k].size() != shapes[k].1) {
            return Err(format!(
                "the GPT given for stages {stages:?} does not hold {} ({:?}, not {:?})",
                shapes[k].0,
                p[k].size(),
                shapes[k].1
            ));
        }
        let leaf = |x: Tensor| x.set_requires_grad(true);
        let rep = |x: &Tensor| leaf(x.copy());
        let none = || leaf(Tensor::empty([0], (Kind::Float, p[0].device())));
        let (embeds, head) = (stages.contains(&0), stages.contains(&(l + 1)));
        let blocks = (0..l)
            .filter(|b| stages.contains(&(b + 1)))
            .map(|b| TpBlock::from_full(&p[2 + 12 * b..14 + 12 * b], cfg.n_head, pg).map(|b| b.with_compute(compute)))
            .collect::<Result<Vec<_>, _>>()?;
        let n = p.len();
        Ok(TpGpt {
            cfg,
            // The embedding's rows are its output features of the head: a column-parallel slice.
            wte: if embeds || head { leaf(super::column_shard(&p[0], t, r)?) } else { none() },
            wpe: if embeds { rep(&p[1]) } else { none() },
            blocks,
            ln_f: if head { [rep(&p[n - 2]), rep(&p[n - 1])] } else { [none(), none()] },
            sequence_parallel: false,
            compute,
            stages,
            emb_saved: Default::default(),
            head_saved: Default::default(),
        })
    }

    /// Activation checkpointing: recompute block `l` (by layer) in backward where `which(l)`
    /// ([`TpBlock::recompute`]).
    pub fn recompute_blocks(mut self, which: impl Fn(usize) -> bool) -> Self {
        let first = self.stages.start.max(1) - 1;
        self.blocks = std::mem::take(&mut self.blocks)
            .into_iter()
            .enumerate()
            .map(|(k, b)| b.recompute(which(first + k)))
            .collect();
        self
    }

    /// The GPT stages this rank runs.
    pub fn stages(&self) -> std::ops::Range<usize> {
        self.stages.clone()
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

    /// This rank's parameters with their index in the GPT's `named_parameters` (wte 0, wpe 1, 12
    /// per block, ln_f last), ascending — those of its stages: handles, not copies.
    pub fn indexed_params(&self) -> Vec<(usize, Tensor)> {
        let l = self.cfg.n_layer as usize;
        let (embeds, head) = (self.stages.contains(&0), self.stages.contains(&(l + 1)));
        let mut v = Vec::new();
        if embeds || head {
            v.push((0, self.wte.shallow_clone()));
        }
        if embeds {
            v.push((1, self.wpe.shallow_clone()));
        }
        let first = self.stages.start.max(1) - 1; // the first block's layer
        for (k, b) in self.blocks.iter().enumerate() {
            v.extend(b.params.iter().enumerate().map(|(j, p)| (2 + 12 * (first + k) + j, p.shallow_clone())));
        }
        if head {
            v.extend(self.ln_f.iter().enumerate().map(|(j, p)| (2 + 12 * l + j, p.shallow_clone())));
        }
        v
    }

    /// This rank's parameters in the GPT's order ([`indexed_params`](Self::indexed_params)
    /// without the indices; the whole model's: wte, wpe, 12 per block, ln_f).
    pub fn params(&self) -> Vec<Tensor> {
        self.indexed_params().into_iter().map(|(_, p)| p).collect()
    }

    /// Whether the GPT's parameter `i` is split over the group — its gradient's square counts
    /// from every rank in the global norm — or replicated (counted once).
    pub fn is_split(&self, i: usize) -> bool {
        split_of(&self.cfg, i) != Split::Replicated
    }

    /// Forward and backward of one batch (`x`, `y` (B, T), the same on every rank of `pg`) through
    /// every stage ([`stage_forward`](Self::stage_forward), then
    /// [`stage_backward`](Self::stage_backward) in reverse). The whole model only.
    pub fn forward_backward(&mut self, pg: &ProcessGroup, batch: &Batch) -> CommResult<TpStep> {
        let n = self.cfg.n_layer as usize + 2;
        if self.stages != (0..n) {
            return Err(CommError::InvalidArgument(format!(
                "rank {}: TpGpt::forward_backward runs every stage; this rank holds {:?}",
                pg.rank(),
                self.stages
            )));
        }
        let before = pg.stats();
        let mut x = Tensor::new();
        for s in 0..n {
            x = self.stage_forward(pg, s, 0, &x, batch)?;
        }
        let loss = x.double_value(&[]);
        let mut grads: Vec<Option<Tensor>> = (0..4 + 12 * self.cfg.n_layer as usize).map(|_| None).collect();
        let mut dy = Tensor::from(1.0f32);
        for s in (0..n).rev() {
            let (g, dx) = self.stage_backward(pg, s, 0, &dy)?;
            for (i, g) in g {
                grads[i] = Some(match grads[i].take() {
                    Some(acc) => acc + g, // the tied wte: the head's, then the embedding's
                    None => g,
                });
            }
            if let Some(dx) = dx {
                dy = dx;
            }
        }
        let grads = grads.into_iter().map(|g| g.expect("every parameter has a gradient")).collect();
        Ok(TpStep { loss, grads, comm: pg.stats().since(&before) })
    }

    /// The full (unsplit) tensors of `sliced` (parameters or gradients, sliced like
    /// [`params`](Self::params) of the whole model), gathered from every rank, in the GPT's order.
    pub fn unshard(&self, pg: &ProcessGroup, sliced: &[Tensor]) -> CommResult<Vec<Tensor>> {
        let indexed: Vec<(usize, Tensor)> = sliced.iter().map(|t| t.shallow_clone()).enumerate().collect();
        Ok(self.unshard_indexed(pg, &indexed)?.into_iter().map(|(_, t)| t).collect())
    }

    /// The full tensors of `sliced` (by index in the GPT's `named_parameters`, as
    /// [`indexed_params`](Self::indexed_params) gives them), gathered from every rank of `pg`.
    pub fn unshard_indexed(&self, pg: &ProcessGroup, sliced: &[(usize, Tensor)]) -> CommResult<Vec<(usize, Tensor)>> {
        let last = 2 + 12 * self.cfg.n_layer as usize;
        sliced
            .iter()
            .map(|(k, s)| {
                let full = match *k {
                    0 => super::gather_dim(pg, s, 0)?,
                    k if (2..last).contains(&k) => super::block::unshard_one(pg, (k - 2) % 12, s)?,
                    _ => s.detach().copy(),
                };
                Ok((*k, full))
            })
            .collect()
    }

    /// Whether sequence parallelism is on.
    pub fn is_sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }

    /// Tensor rank 0's copy of every replicated parameter against this rank's (each rank updates
    /// its own copy from the same gradients): the first that differs and by how much. A
    /// collective over `pg`.
    pub fn replicas_differ(&self, pg: &ProcessGroup) -> CommResult<Option<(usize, f64)>> {
        let mut differ = None;
        for (k, p) in self.indexed_params().into_iter().filter(|(k, _)| !self.is_split(*k)) {
            let mut first = p.detach().copy();
            pg.broadcast(&mut first, 0)?;
            if differ.is_none() && !first.equal(&p) {
                differ = Some((k, (&first - &p).abs().max().double_value(&[])));
            }
        }
        Ok(differ)
    }

    /// Bytes of parameters this rank holds, measured from its tensors.
    pub fn param_bytes(&self) -> u64 {
        crate::memory::held_bytes(self.params().iter())
    }
}
