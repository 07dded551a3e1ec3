//! ZeRO over a list of tensors: the data-dimension sharding of a model *piece* that runs its own
//! forward and backward — a tensor-parallel GPT's slices, a pipeline rank's stages — and hands
//! back its gradients at the end of backward (the engine, `crate::engine`, composes the two).
//!
//! The piece's parameters are laid end to end in flat units ([`FlatLayout`]), at most two: the
//! gradients this rank counts in the global norm and those it does not (a replicated tensor on a
//! tensor rank other than 0, the tied embedding's second holder in a pipeline), so that each shard
//! is counted or not as a whole. Each of the `N` ranks of the data group owns `1/N` of every unit:
//!
//! | stage | kept between steps | per step |
//! |---|---|---|
//! | 1 | full params, full flat grads (zeroed), ⅟N shards of grads and AdamW state | grads → flat buffer, reduce-scatter (avg), AdamW on the shard, all-gather params |
//! | 2 | full params, ⅟N of grads and state | the same, the flat gradient freed once reduced |
//! | 3 | ⅟N of params, grads and state | all-gather the params before forward, free them after backward, then as stage 2 with nothing to gather |
//!
//! Unlike [`Zero`](super::Zero) on a whole model, the piece's backward gives every gradient at its
//! end: there is no per-block overlap, and stage 3 gathers the whole piece for the step (one unit,
//! FSDP's root) — it holds ⅟N between steps, the piece during one. Parameters keep their identity
//! (the tensors the piece computes with): only their data is swapped (`set_data`) between views of
//! a flat buffer and empty tensors, as `Zero` does. fp32 only.
//!
//! Communication per step and data rank (ring): stages 1–2 send 2·(N−1)/N·4Ψ' bytes (Ψ' the
//! piece's parameters), like DDP's all-reduce; stage 3 the same (one all-gather before forward
//! instead of one after the step).

use super::flat::FlatLayout;
use super::Stage;
use crate::comm::{CommError, CommResult, ProcessGroup, ReduceOp};
use crate::memory::held_bytes;
use crate::optim::{Decay, Held};
use std::ops::Range;
use tch::{Kind, Tensor};

struct Unit {
    /// Indices into the piece's parameter list.
    idx: Vec<usize>,
    layout: FlatLayout,
    /// Stages 1–2: the full flat parameters (the parameters are views of it). Stage 3: the
    /// gathered buffer during a step.
    full: Option<Tensor>,
    /// This rank's f32 master shard: a view into `full` (stages 1–2), its own tensor (stage 3).
    shard: Tensor,
    /// (shard,) the averaged gradient of the last backward.
    grad_shard: Tensor,
    /// Stage 1: the (padded,) flat gradient, kept (zeroed) between steps.
    grad_full: Option<Tensor>,
    /// The shard's element ranges that are weight-decayed (matrices; never the padding).
    decay: Vec<Range<i64>>,
    /// This rank counts the unit's gradients in the global norm (over the model-parallel dims).
    counted: bool,
}

/// A piece's parameters sharded over a data-parallel group (see the module docs).
pub struct ShardedTensors {
    stage: Stage,
    params: Vec<Tensor>,
    units: Vec<Unit>,
}

fn empty() -> Tensor {
    Tensor::empty([0], (Kind::Float, tch::Device::Cpu))
}

impl ShardedTensors {
    /// Shard `params` (handles to the piece's fp32 CPU tensors) over `pg` for `stage`, in the flat
    /// `units` given (indices into `params`, and whether this rank counts the unit's gradients in
    /// the global norm). Ranks that hold copies of the same tensors (a replicated tensor on every
    /// tensor-parallel rank, the tied embedding on two pipeline stages) must lay them out in the
    /// same units at the same places: their shards then have the same owners, so the reductions
    /// add in the same order and the copies stay bitwise equal. Rank 0's values are broadcast
    /// first, as [`Zero::new`](super::Zero::new) does. Every rank of `pg` calls it with the same
    /// shapes.
    pub fn new(
        pg: &ProcessGroup,
        mut params: Vec<Tensor>,
        units: &[(Vec<usize>, bool)],
        stage: Stage,
    ) -> CommResult<Self> {
        let bad = |m: String| CommError::InvalidArgument(format!("rank {}: ZeRO over a piece: {m}", pg.rank()));
        let mut seen = vec![0usize; params.len()];
        let mut outside = false;
        for &i in units.iter().flat_map(|(idx, _)| idx) {
            match seen.get_mut(i) {
                Some(c) => *c += 1,
                None => outside = true,
            }
        }
        let local = if outside || seen.iter().any(|&c| c != 1) {
            Some(format!("the units must hold each of the {} parameters once", params.len()))
        } else {
            params
                .iter()
                .find(|p| p.kind() != Kind::Float || p.device() != tch::Device::Cpu)
                .map(|p| format!("fp32 CPU parameters only, not {:?} on {:?}", p.kind(), p.device()))
        };
        if let Some(m) = local {
            return Err(bad(m));
        }
        tch::no_grad(|| params.iter_mut().try_for_each(|p| pg.broadcast(p, 0)))?;
        let (n, rank) = (pg.world_size(), pg.rank());
        let mut units_out = Vec::new();
        for (idx, counted) in units.iter().filter(|(idx, _)| !idx.is_empty()) {
            let (idx, want) = (idx.clone(), *counted);
            let layout = FlatLayout::new(idx.iter().map(|&i| params[i].size()).collect(), n);
            let flat = layout.flatten(&idx.iter().map(|&i| params[i].shallow_clone()).collect::<Vec<_>>());
            let r = layout.shard_range(rank);
            let (full, shard) = if stage == Stage::Three {
                tch::no_grad(|| idx.iter().for_each(|&i| params[i].set_data(&empty())));
                (None, flat.narrow(0, r.start, r.end - r.start).copy())
            } else {
                tch::no_grad(|| idx.iter().enumerate().for_each(|(j, &i)| params[i].set_data(&layout.view(&flat, j))));
                let shard = flat.narrow(0, r.start, r.end - r.start);
                (Some(flat), shard)
            };
            let mut decay: Vec<Range<i64>> = Vec::new();
            for (j, _within, at) in layout.shard_pieces(rank) {
                if layout.shapes[j].len() >= 2 {
                    match decay.last_mut() {
                        Some(last) if last.end == at.start => last.end = at.end,
                        _ => decay.push(at),
                    }
                }
            }
            units_out.push(Unit {
                grad_shard: Tensor::zeros([layout.shard], (Kind::Float, tch::Device::Cpu)),
                grad_full: (stage == Stage::One).then(|| layout.zeros()),
                idx,
                layout,
                full,
                shard,
                decay,
                counted: want,
            });
        }
        Ok(ShardedTensors { stage, params, units: units_out })
    }

    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// Stage 3: all-gather every unit and point the parameters at it (before forward); returns
    /// the bytes gathered (held until [`release`](Self::release)). Stages 1–2 hold the full
    /// parameters: nothing to do.
    pub fn gather(&mut self, pg: &ProcessGroup) -> CommResult<u64> {
        if self.stage != Stage::Three {
            return Ok(0);
        }
        for u in &mut self.units {
            let mut full = Tensor::empty([u.layout.padded], (Kind::Float, tch::Device::Cpu));
            pg.all_gather(&mut full, &u.shard)?;
            tch::no_grad(|| {
                u.idx.iter().enumerate().for_each(|(j, &i)| self.params[i].set_data(&u.layout.view(&full, j)))
            });
            u.full = Some(full);
        }
        Ok(held_bytes(self.units.iter().flat_map(|u| u.full.iter())))
    }

    /// Stage 3: free the gathered parameters (after backward; also after a failed step).
    pub fn release(&mut self) {
        if self.stage != Stage::Three {
            return;
        }
        for u in &mut self.units {
            tch::no_grad(|| u.idx.iter().for_each(|&i| self.params[i].set_data(&empty())));
            u.full = None;
        }
    }

    /// Average `grads` (one per parameter, in the order given to [`new`](Self::new)) over `pg`
    /// into this rank's gradient shards: each unit's gradients flattened (stage 1: into its kept
    /// flat buffer, zeroed after), reduce-scattered with the average. Returns the bytes of the
    /// largest flat copy it made (stages 2–3; freed before it returns).
    pub fn reduce(&mut self, pg: &ProcessGroup, grads: &[Tensor]) -> CommResult<u64> {
        if grads.len() != self.params.len() {
            return Err(CommError::InvalidArgument(format!(
                "rank {}: ZeRO over a piece: {} gradients for {} parameters",
                pg.rank(),
                grads.len(),
                self.params.len()
            )));
        }
        let mut transient = 0;
        for u in &mut self.units {
            let g: Vec<Tensor> = u.idx.iter().map(|&i| grads[i].shallow_clone()).collect();
            let flat = match &u.grad_full {
                Some(kept) => {
                    for (j, t) in g.iter().enumerate() {
                        u.layout.view(kept, j).copy_(&t.detach());
                    }
                    kept.shallow_clone()
                }
                None => {
                    let f = u.layout.flatten(&g);
                    transient = transient.max(held_bytes([&f]));
                    f
                }
            };
            pg.reduce_scatter(&mut u.grad_shard, &flat, ReduceOp::Avg)?;
            if u.grad_full.is_some() {
                let _ = flat.shallow_clone().zero_();
            }
        }
        Ok(transient)
    }

    /// What the optimizer steps on this rank: one slot per unit — the master shard, its averaged
    /// gradient, its decayed ranges — counted in the global norm when its unit is (a shard is its
    /// owner's alone over the data group: only the model-parallel rule decides).
    pub fn held(&self) -> Held {
        Held {
            params: self.units.iter().map(|u| u.shard.shallow_clone()).collect(),
            grads: self.units.iter().map(|u| u.grad_shard.shallow_clone()).collect(),
            decay: self.units.iter().map(|u| Decay::Ranges(u.decay.clone())).collect(),
            counted: self.units.iter().map(|u| u.counted).collect(),
        }
    }

    /// After an optimizer step that updated the shards: stages 1–2 all-gather them into the full
    /// parameters (from a copy: the output buffer contains the shard). Stage 3: nothing.
    pub fn updated(&mut self, pg: &ProcessGroup) -> CommResult<()> {
        if self.stage == Stage::Three {
            return Ok(());
        }
        for u in &mut self.units {
            let mut full = u.full.as_ref().expect("stages 1-2 keep full parameters").shallow_clone();
            pg.all_gather(&mut full, &u.shard.copy())?;
        }
        Ok(())
    }

    /// What this rank holds, one entry per unit (the optimizer's slots): its master shard, the
    /// pieces of the parameters in it — `(parameter index, flat range within the parameter, flat
    /// range within the shard)` — and whether it counts (and a checkpoint writes) them.
    pub fn shard_pieces(&self, rank: usize) -> Vec<(Tensor, Vec<(usize, Range<i64>, Range<i64>)>, bool)> {
        let units = self.units.iter();
        units
            .map(|u| {
                let pieces = u.layout.shard_pieces(rank).into_iter().map(|(j, w, a)| (u.idx[j], w, a)).collect();
                (u.shard.shallow_clone(), pieces, u.counted)
            })
            .collect()
    }

    /// The gradient buffers kept between steps: the shards and stage 1's flat gradients.
    pub fn kept_grads(&self) -> Vec<Tensor> {
        self.units.iter().flat_map(|u| u.grad_full.iter().chain([&u.grad_shard])).map(|t| t.shallow_clone()).collect()
    }

    /// Bytes held in parameters (the working parameters, the full buffers and the master shards)
    /// and in gradients (stage 1's flat buffers and the gradient shards), from the tensors.
    pub fn held_bytes(&self) -> (u64, u64) {
        let params = self.params.iter().chain(self.units.iter().flat_map(|u| u.full.iter().chain([&u.shard])));
        let grads = self.units.iter().flat_map(|u| u.grad_full.iter().chain([&u.grad_shard]));
        (held_bytes(params), held_bytes(grads))
    }
}
