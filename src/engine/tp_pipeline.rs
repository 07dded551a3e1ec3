//! 3-D parallelism's piece: a pipeline rank's stages, split over its tensor-parallel group
//! (Megatron-LM's layout). Each rank holds its stages' slices only — built from a GPT with just
//! its stages' parameters ([`Gpt::new_only`](crate::model::Gpt::new_only)), cut by
//! [`TpGpt::from_gpt_stages`] — and runs them one micro-batch at a time in the pipeline's schedule
//! ([`run_pipeline`] with [`TpStages`]): the tensor-parallel collectives inside each stage, the
//! activations, (B, T, C) or with sequence parallelism (B, T/t, C), point to point between the
//! stages of the same tensor rank. The tied wte's slices on the first and the last stage get the
//! same summed gradient (the executor's exchange, tensor rank by tensor rank).

use super::piece::{gather_stages, replicas_error};
use super::{Piece, PieceStep};
use crate::comm::{CommError, CommResult, DeviceMesh, ProcessGroup};
use crate::model::{Batch, Gpt};
use crate::pipeline::train::params_of_ranks;
use crate::pipeline::{run_pipeline, PipelineConfig, StageRunner};
use crate::tp::TpGpt;
use std::collections::BTreeMap;
use tch::Tensor;

/// A tensor-parallel GPT's stages as a pipeline rank runs them.
pub struct TpStages<'a> {
    pub m: &'a mut TpGpt,
    pub tp: &'a ProcessGroup,
}

impl StageRunner for TpStages<'_> {
    fn forward(&mut self, mb: usize, x: Tensor, part: &Batch) -> CommResult<Tensor> {
        let mut x = x;
        for s in self.m.stages() {
            x = self.m.stage_forward(self.tp, s, mb, &x, part)?;
        }
        Ok(x)
    }
    fn backward(
        &mut self,
        mb: usize,
        g_out: &Tensor,
        _part: &Batch,
    ) -> CommResult<(Vec<(usize, Tensor)>, Option<Tensor>)> {
        let (mut dy, mut grads) = (g_out.shallow_clone(), Vec::new());
        for s in self.m.stages().rev() {
            let (g, dx) = self.m.stage_backward(self.tp, s, mb, &dy)?;
            grads.extend(g);
            if let Some(dx) = dx {
                dy = dx;
            }
        }
        Ok((grads, (self.m.stages().start > 0).then_some(dy)))
    }
    fn activation(&self, rows: i64, t: i64) -> Vec<i64> {
        let tl = if self.m.is_sequence_parallel() { t / self.tp.world_size() as i64 } else { t };
        vec![rows, tl, self.m.cfg.n_embd]
    }
}

/// Pipeline rank × tensor rank's piece (see the module docs).
pub struct TpPipelinePiece {
    m: TpGpt,
    cfg: PipelineConfig,
    /// Which parameters each pipeline rank holds, and each GPT stage uses.
    owned: Vec<Vec<usize>>,
    uses: Vec<Vec<usize>>,
}

impl TpPipelinePiece {
    /// Pipeline rank `pp_rank`'s stages of `gpt` (which holds at least their parameters) split
    /// over the tensor-parallel group `tp`.
    /// `recompute(l)`: activation checkpointing of block `l`.
    pub fn new(
        gpt: &Gpt,
        cfg: PipelineConfig,
        pp_rank: usize,
        tp: &ProcessGroup,
        sp: bool,
        recompute: &dyn Fn(usize) -> bool,
    ) -> Result<Self, String> {
        let owned = params_of_ranks(&gpt.cfg, cfg.stages)?;
        let parts = crate::pipeline::partition(gpt.cfg.n_layer as usize + 2, cfg.stages)?;
        let m = TpGpt::from_gpt_stages(gpt, tp, parts[pp_rank].clone())?
            .with_sequence_parallel(sp)
            .recompute_blocks(recompute);
        Ok(TpPipelinePiece { m, cfg, owned, uses: Gpt::stage_uses_of(&gpt.cfg) })
    }
    fn lowest(&self, k: usize) -> Option<usize> {
        self.owned.iter().position(|o| o.contains(&k))
    }
}

impl Piece for TpPipelinePiece {
    fn params(&self) -> Vec<Tensor> {
        self.m.params()
    }
    fn indices(&self) -> Vec<usize> {
        self.m.indexed_params().into_iter().map(|(k, _)| k).collect()
    }
    /// A split slice on every tensor rank, a replicated tensor on tensor rank 0 — on the lowest
    /// pipeline rank that uses it (the tied wte on the first).
    fn counted(&self, mesh: &DeviceMesh) -> Vec<bool> {
        let (tp0, pp) = (mesh.coord("tp") == 0, mesh.coord("pp"));
        self.indices().into_iter().map(|k| (self.m.is_split(k) || tp0) && self.lowest(k) == Some(pp)).collect()
    }
    /// The tied wte's slice alone (the same unit on the first and the last stage), the other
    /// split slices, then the replicated tensors (the same on every tensor rank).
    fn units(&self, mesh: &DeviceMesh) -> Vec<(Vec<usize>, bool)> {
        let idx = self.indices();
        let (tp0, pp) = (mesh.coord("tp") == 0, mesh.coord("pp"));
        let pick = |f: &dyn Fn(usize) -> bool| (0..idx.len()).filter(|&j| f(idx[j])).collect::<Vec<usize>>();
        vec![
            (pick(&|k| k == 0), self.lowest(0) == Some(pp)),
            (pick(&|k| k != 0 && self.m.is_split(k)), true),
            (pick(&|k| !self.m.is_split(k)), tp0),
        ]
    }
    fn forward_backward(&mut self, mesh: &DeviceMesh, batch: &Batch) -> CommResult<PieceStep> {
        let (pp, tp) = (mesh.group("pp"), mesh.group("tp"));
        let (kind, m) = (self.cfg.schedule, self.cfg.micro_batches);
        let mut runner = TpStages { m: &mut self.m, tp };
        let mut st = run_pipeline(pp, &mut runner, &self.uses, kind, batch, m)?;
        let grads = self
            .indices()
            .iter()
            .map(|k| st.grads.remove(k))
            .collect::<Option<Vec<Tensor>>>()
            .filter(|_| st.grads.is_empty())
            .ok_or_else(|| {
                CommError::Protocol(format!("rank {}: the stages' gradients are not this rank's parameters", pp.rank()))
            })?;
        Ok(PieceStep { loss: st.loss, grads, pipeline: Some((st.bubble(), st.peak_in_flight)) })
    }
    /// Each stage's tensor ranks gather their slices into whole tensors (the replicated copies
    /// checked equal), then the pipeline ranks of each tensor rank gather the stages.
    fn gather_whole(&self, mesh: &DeviceMesh) -> CommResult<Option<Vec<Tensor>>> {
        let (pp, tp) = (mesh.group("pp"), mesh.group("tp"));
        let differ = self.m.replicas_differ(tp)?;
        let whole: BTreeMap<usize, Tensor> =
            self.m.unshard_indexed(tp, &self.m.indexed_params())?.into_iter().collect();
        let full = gather_stages(pp, &self.owned, &self.m.cfg, &whole)?;
        match differ {
            Some((k, d)) => Err(replicas_error(tp, k, d)),
            None => Ok(full),
        }
    }
}
