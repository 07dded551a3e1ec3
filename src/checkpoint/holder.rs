//! What a rank holds ([`Holder`]): the slots its optimizer steps, each made of pieces of the
//! model's tensors — a flat range of a box of a tensor ([`Region`]) — which is what
//! [`save`](super::save) writes and [`load`](super::load) fills, whatever the layout.

use super::plan::Region;
use crate::comm::{CommResult, ProcessGroup};
use std::ops::Range;
use tch::Tensor;

/// What one rank holds of a model and its optimizer state, and where it sits in the whole model:
/// what [`save`](fn@super::save) writes and [`load`](fn@super::load) fills (see the module docs).
pub trait Holder {
    /// Groups that together span every rank (the world; an engine's mesh dimensions): the ranks
    /// agree by all-reducing over each in turn.
    fn groups(&self) -> Vec<&ProcessGroup>;
    /// This rank's index among all ranks (for messages).
    fn global_rank(&self) -> usize;
    /// The group over which [`HeldSlot::replicated`] slots are copies of each other.
    fn replicas(&self) -> &ProcessGroup;
    /// The model's tensors: names and whole shapes.
    fn tensors(&self) -> Vec<(String, Vec<i64>)>;
    /// What this rank holds, one slot per optimizer slot (AdamW's state comes in this order).
    fn held_slots(&self) -> anyhow::Result<Vec<HeldSlot>>;
    /// After a load overwrote the slots' masters: bring what derives from them up to date (a
    /// collective for sharded holders).
    fn loaded(&mut self) -> CommResult<()>;
}

/// Values the optimizer steps as one (a parameter, a ZeRO shard) and where they sit in the model.
pub struct HeldSlot {
    /// The master values (a parameter with its shape, or a flat shard), contiguous.
    pub master: Tensor,
    pub pieces: Vec<HeldPiece>,
    /// Every rank of [`Holder::replicas`] holds this slot whole: each writes 1/N of it; a load
    /// reads 1/N on each and all-gathers.
    pub replicated: bool,
    /// This rank writes the slot's values (`false`: a rank over the model-parallel dimensions
    /// holds the same values and writes them).
    pub writes: bool,
}

/// Flat range `within` of box `region` of tensor `tensor` (an index into [`Holder::tensors`]) is
/// flat range `at` of a slot's master.
#[derive(Clone, Debug)]
pub struct HeldPiece {
    pub tensor: usize,
    pub region: Region,
    pub within: Range<i64>,
    pub at: Range<i64>,
}

/// The data-parallel strategies hold whole tensors (`named_parameters`; ZeRO's shards as flat
/// ranges of them), every rank of the group one replica.
impl<T: crate::ddp::DataParallel + ?Sized> Holder for T {
    fn groups(&self) -> Vec<&ProcessGroup> {
        vec![self.group()]
    }
    fn global_rank(&self) -> usize {
        self.group().rank()
    }
    fn replicas(&self) -> &ProcessGroup {
        self.group()
    }
    fn tensors(&self) -> Vec<(String, Vec<i64>)> {
        let names = self.model().named_parameters().into_iter().map(|(n, _)| n);
        names.zip(self.param_shapes()).collect()
    }
    fn held_slots(&self) -> anyhow::Result<Vec<HeldSlot>> {
        let shapes = self.param_shapes();
        Ok(self
            .slots()
            .into_iter()
            .map(|s| HeldSlot {
                pieces: s
                    .pieces
                    .iter()
                    .map(|(i, within, at)| HeldPiece {
                        tensor: *i,
                        region: Region::whole(&shapes[*i]),
                        within: within.clone(),
                        at: at.clone(),
                    })
                    .collect(),
                master: s.master,
                replicated: s.replicated,
                writes: true,
            })
            .collect())
    }
    fn loaded(&mut self) -> CommResult<()> {
        self.masters_loaded()
    }
}
