//! A *piece*: what one rank holds of the model after the model-parallel transformations, and how
//! it runs its forward and backward — a tensor-parallel GPT ([`TpGpt`]) or a pipeline rank's
//! stages ([`PipelinePiece`]). The engine wraps a piece for the data dimension and steps it.

use crate::comm::{CommError, CommResult, DeviceMesh, ProcessGroup};
use crate::model::{Batch, Gpt, GptConfig, Model};
use crate::pipeline::train::params_of_ranks;
use crate::pipeline::{pipeline_step_with, PipelineConfig};
use crate::tp::TpGpt;
use std::collections::BTreeMap;
use tch::{Kind, Tensor};

/// What one forward and backward of a piece gives.
pub struct PieceStep {
    /// This replica's mean loss (the same on every rank of the piece).
    pub loss: f64,
    /// One gradient per parameter, in [`Piece::params`] order.
    pub grads: Vec<Tensor>,
    /// Under pipeline parallelism: this rank's idle fraction of the step and the most
    /// micro-batches whose activations it held at once.
    pub pipeline: Option<(f64, usize)>,
}

/// One rank's part of the model over the model-parallel dimensions of a mesh (`tp`, `pp`).
pub trait Piece {
    /// The parameters this rank holds (handles, not copies), in a fixed order.
    fn params(&self) -> Vec<Tensor>;
    /// Each of [`params`](Self::params)' index in the GPT's `named_parameters` (a tensor-parallel
    /// piece holds its slice of it, [`split_of`](crate::tp::split_of)).
    fn indices(&self) -> Vec<usize>;
    /// Whether each parameter's gradient counts in the global norm on this rank, over the
    /// model-parallel dimensions (a split slice on every rank that holds a slice, a replicated or
    /// tied tensor on one of its holders).
    fn counted(&self, mesh: &DeviceMesh) -> Vec<bool>;
    /// How ZeRO groups the parameters into flat units (positions in [`params`](Self::params)),
    /// and whether this rank counts each unit's gradients in the global norm: the same units, in
    /// the same order, on every rank that holds copies of the same tensors, so that the copies'
    /// shards have the same owners and stay bitwise equal (see
    /// [`ShardedTensors::new`](crate::zero::ShardedTensors::new)).
    fn units(&self, mesh: &DeviceMesh) -> Vec<(Vec<usize>, bool)>;
    /// Forward and backward of this replica's `batch` (the same on every rank of the piece).
    fn forward_backward(&mut self, mesh: &DeviceMesh, batch: &Batch) -> CommResult<PieceStep>;
    /// The whole model's parameters (the GPT's order) on the ranks of the piece that end up with
    /// them (every tensor-parallel rank; pipeline rank 0), `None` on the others: a collective over
    /// the piece's ranks of one replica.
    fn gather_whole(&self, mesh: &DeviceMesh) -> CommResult<Option<Vec<Tensor>>>;
}

impl Piece for TpGpt {
    fn params(&self) -> Vec<Tensor> {
        TpGpt::params(self)
    }
    fn indices(&self) -> Vec<usize> {
        self.indexed_params().into_iter().map(|(k, _)| k).collect()
    }
    fn counted(&self, mesh: &DeviceMesh) -> Vec<bool> {
        let first = mesh.coord("tp") == 0;
        (0..self.params().len()).map(|i| self.is_split(i) || first).collect()
    }
    /// The split tensors (counted on every tensor rank), then the replicated ones (the same on
    /// every tensor rank; counted on rank 0).
    fn units(&self, mesh: &DeviceMesh) -> Vec<(Vec<usize>, bool)> {
        let idx: Vec<usize> = self.indexed_params().into_iter().map(|(k, _)| k).collect();
        let (split, rep): (Vec<usize>, Vec<usize>) = (0..idx.len()).partition(|&j| self.is_split(idx[j]));
        vec![(split, true), (rep, mesh.coord("tp") == 0)]
    }
    fn forward_backward(&mut self, mesh: &DeviceMesh, batch: &Batch) -> CommResult<PieceStep> {
        let s = TpGpt::forward_backward(self, mesh.group("tp"), batch)?;
        Ok(PieceStep { loss: s.loss, grads: s.grads, pipeline: None })
    }
    fn gather_whole(&self, mesh: &DeviceMesh) -> CommResult<Option<Vec<Tensor>>> {
        // The replicated tensors must be equal on every tensor rank (each updated its own copy
        // from the same gradients): tp rank 0's copy against this rank's.
        let tp = mesh.group("tp");
        // Every rank takes part in every collective, equal copies or not (the caller agrees on
        // the outcome).
        let differ = self.replicas_differ(tp)?;
        let full = self.unshard(tp, &self.params())?;
        match differ {
            Some((k, d)) => Err(replicas_error(tp, k, d)),
            None => Ok(Some(full)),
        }
    }
}

/// A pipeline rank's stages of the GPT: the model with only this rank's parameters materialised
/// ([`Gpt::new_only`]), run by [`pipeline_step_with`] in `cfg`'s schedule.
pub struct PipelinePiece {
    pub gpt: Gpt,
    pub cfg: PipelineConfig,
    /// The parameters this rank holds, by index in the GPT's `named_parameters` (ascending).
    mine: Vec<usize>,
    /// Which parameters each pipeline rank holds.
    owned: Vec<Vec<usize>>,
    /// Activation checkpointing: recompute this rank's stages per micro-batch.
    recompute: bool,
}

impl PipelinePiece {
    /// Pipeline rank `rank`'s piece of `gpt` (which holds at least that rank's parameters).
    pub fn new(gpt: Gpt, cfg: PipelineConfig, rank: usize) -> Result<PipelinePiece, String> {
        let owned = params_of_ranks(&gpt.cfg, cfg.stages)?;
        let mine = owned.get(rank).ok_or_else(|| format!("pipeline rank {rank} of {}", cfg.stages))?.clone();
        Ok(PipelinePiece { gpt, cfg, mine, owned, recompute: false })
    }
    /// Recompute this rank's stages in backward instead of keeping their activations
    /// ([`pipeline_step_with`]).
    pub fn recompute(mut self, on: bool) -> Self {
        self.recompute = on;
        self
    }
    /// The lowest pipeline rank that uses parameter `k` (the one that counts its gradient).
    fn lowest(&self, k: usize) -> Option<usize> {
        self.owned.iter().position(|o| o.contains(&k))
    }
}

impl Piece for PipelinePiece {
    fn params(&self) -> Vec<Tensor> {
        let all = self.gpt.parameters();
        self.mine.iter().map(|&k| all[k].shallow_clone()).collect()
    }
    fn indices(&self) -> Vec<usize> {
        self.mine.clone()
    }
    fn counted(&self, mesh: &DeviceMesh) -> Vec<bool> {
        self.mine.iter().map(|&k| self.lowest(k) == Some(mesh.coord("pp"))).collect()
    }
    /// The tied embedding alone (the same unit on the first and the last stage; counted on the
    /// first), then the rest (used by this rank alone).
    fn units(&self, mesh: &DeviceMesh) -> Vec<(Vec<usize>, bool)> {
        let (tied, rest): (Vec<usize>, Vec<usize>) = (0..self.mine.len()).partition(|&j| self.mine[j] == 0);
        let counts_tied = self.lowest(0) == Some(mesh.coord("pp"));
        vec![(tied, counts_tied), (rest, true)]
    }
    fn forward_backward(&mut self, mesh: &DeviceMesh, batch: &Batch) -> CommResult<PieceStep> {
        let pp = mesh.group("pp");
        let c = self.gpt.cfg.n_embd;
        let (kind, m) = (self.cfg.schedule, self.cfg.micro_batches);
        let mut st = pipeline_step_with(pp, &self.gpt, kind, batch, m, c, self.recompute)?;
        let grads = self
            .mine
            .iter()
            .map(|k| st.grads.remove(k))
            .collect::<Option<Vec<Tensor>>>()
            .filter(|_| st.grads.is_empty())
            .ok_or_else(|| {
                CommError::Protocol(format!("rank {}: the stages' gradients are not this rank's parameters", pp.rank()))
            })?;
        Ok(PieceStep { loss: st.loss, grads, pipeline: Some((st.bubble(), st.peak_in_flight)) })
    }

    fn gather_whole(&self, mesh: &DeviceMesh) -> CommResult<Option<Vec<Tensor>>> {
        let all = self.gpt.parameters();
        let mine = self.mine.iter().map(|&k| (k, all[k].detach())).collect();
        gather_stages(mesh.group("pp"), &self.owned, &self.gpt.cfg, &mine)
    }
}

/// The whole model on pipeline rank 0 from every rank's whole tensors (`mine`: by index in the
/// GPT's `named_parameters`; `owned`: which each rank holds): every other rank sends rank 0 the
/// parameters it is the lowest user of, and the last rank also its copy of the tied wte, which
/// must equal rank 0's (they got the same gradients and updates). `None` on the other ranks.
pub(super) fn gather_stages(
    pp: &ProcessGroup,
    owned: &[Vec<usize>],
    cfg: &GptConfig,
    mine: &BTreeMap<usize, Tensor>,
) -> CommResult<Option<Vec<Tensor>>> {
    let (p, r) = (pp.world_size(), pp.rank());
    let shapes = cfg.param_shapes();
    let lowest = |k: usize| owned.iter().position(|o| o.contains(&k)).expect("every parameter has a stage");
    let empty = |k: usize| Tensor::zeros(shapes[k].1.as_slice(), (Kind::Float, tch::Device::Cpu));
    let held = |k: usize| {
        mine.get(&k).ok_or_else(|| CommError::Protocol(format!("rank {r}: parameter {k} is not among this rank's")))
    };
    let mut full = Vec::new();
    for k in 0..shapes.len() {
        let q = lowest(k);
        if r == 0 && q == 0 {
            full.push(held(k)?.copy());
        } else if r == 0 {
            let mut t = empty(k);
            pp.recv(&mut t, q)?;
            full.push(t);
        } else if r == q {
            pp.send(held(k)?, 0)?;
        }
    }
    if p > 1 && r == p - 1 {
        pp.send(held(0)?, 0)?;
    } else if p > 1 && r == 0 {
        let mut other = empty(0);
        pp.recv(&mut other, p - 1)?;
        if !other.equal(&full[0]) {
            let d = (&other - &full[0]).abs().max().double_value(&[]);
            return Err(CommError::Protocol(format!("the two copies of the tied wte differ by up to {d}")));
        }
    }
    Ok((r == 0).then_some(full))
}

/// The error of copies of a replicated parameter that differ between tensor-parallel ranks.
pub(super) fn replicas_error(tp: &ProcessGroup, k: usize, d: f64) -> CommError {
    CommError::Protocol(format!("rank {}: the tensor-parallel copies of parameter {k} differ by up to {d}", tp.rank()))
}
