//! The engine: one layout of the ranks, one device mesh, one training step for every combination
//! of the course's parallelisms (torchtitan's `ParallelDims` → `DeviceMesh` → `parallelize` →
//! one train step, in our words).
//!
//! A layout is `pp × dp × tp` ranks ([`ParallelDims`]; world = the product), laid out as one
//! [`DeviceMesh`] with dimensions `["pp", "dp", "tp"]`, row-major: tensor-parallel ranks are
//! neighbours (the most traffic, the fastest links), pipeline stages the farthest apart — the
//! order torchtitan and Megatron use. [`parallelize`] turns a GPT into this rank's **piece**
//! ([`Piece`]) and wraps it for the data dimension:
//!
//! 1. **tensor parallelism** over `tp` ([`TpGpt`](crate::tp::TpGpt): blocks split by heads,
//!    vocab-parallel embedding and loss; sequence parallelism optional), and/or
//! 2. **pipeline parallelism** over `pp` ([`PipelinePiece`]: this rank's stages, micro-batches in
//!    a schedule) — both together ([`TpPipelinePiece`], 3-D parallelism): a pipeline rank's
//!    stages split over its tensor-parallel group;
//! 3. over `dp`, **DDP** (gradients averaged, every replica holds its piece whole) or **ZeRO
//!    1/2/3** ([`ShardedTensors`](crate::zero::ShardedTensors): the piece's parameters, gradients
//!    and AdamW state sharded over `dp`).
//!
//! One step ([`Engine::train_step`]): (ZeRO-3: gather the piece's parameters) → the piece's forward
//! and backward on this replica's rows → (ZeRO-3: free them) → gradients averaged over `dp`
//! (all-reduce, or reduce-scatter into shards) → the one optimizer step
//! ([`optimizer_step`](crate::optim::optimizer_step) over pp, dp and tp: the global norm with every
//! element counted once, agreed non-finite checks, clipping, AdamW on what the rank holds) →
//! (ZeRO-1/2: all-gather the updated parameters).
//!
//! A layout with neither tp nor pp runs the data-parallel strategies on the whole model
//! ([`crate::ddp`], [`crate::zero`]), which overlap communication with backward block by block.
//!
//! Checkpoints: an engine is a [`Holder`](crate::checkpoint::Holder) — what its rank holds, as
//! boxes of the GPT's tensors (tensor-parallel slices) and flat ranges of them (ZeRO's shards) —
//! so [`checkpoint::save`](crate::checkpoint::save) and [`load`](crate::checkpoint::load) take
//! any layout to any other (`state.rs`).
//!
//! Files: this one (the layout), `fit.rs` (which layout fits a memory budget), `piece.rs` (what a piece is; tensor and pipeline pieces),
//! `tp_pipeline.rs` (the 3-D piece), `step.rs` (the engine and its step), `state.rs` (what a rank
//! holds, for checkpoints).

pub mod fit;
mod piece;
mod state;
mod step;
mod tp_pipeline;

pub use piece::{Piece, PieceStep, PipelinePiece};
pub use step::{parallelize, Engine, Trained};
pub use tp_pipeline::{TpPipelinePiece, TpStages};

use crate::comm::{CommResult, DeviceMesh, ProcessGroup};
use crate::pipeline::PipelineConfig;
use crate::precision::Precision;
use crate::stages::Checkpointing;
use crate::zero::Stage;

/// How many ranks each dimension of a layout has: pipeline stages × data-parallel replicas ×
/// tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParallelDims {
    pub pp: usize,
    pub dp: usize,
    pub tp: usize,
}

impl ParallelDims {
    /// The layout of `world` ranks with `tp` tensor-parallel ranks and `pp` pipeline stages; the
    /// data dimension takes what is left. An error when tp × pp does not divide the world.
    pub fn new(world: usize, tp: usize, pp: usize) -> Result<ParallelDims, String> {
        if tp == 0 || world % tp != 0 {
            return Err(format!("--tp {tp} does not divide the world of {world} ranks into tensor-parallel groups"));
        }
        if pp == 0 || world % (tp * pp) != 0 {
            let of = if tp > 1 { format!(" of {tp} tensor-parallel ranks each") } else { String::new() };
            return Err(format!("--pp {pp} does not divide the world of {world} ranks into pipelines{of}"));
        }
        Ok(ParallelDims { pp, dp: world / (tp * pp), tp })
    }

    pub fn world(&self) -> usize {
        self.pp * self.dp * self.tp
    }

    /// The mesh of this layout over `pg` (every rank calls it): `["pp", "dp", "tp"]`.
    pub fn mesh(&self, pg: &ProcessGroup) -> CommResult<DeviceMesh> {
        DeviceMesh::new(pg, &[self.pp, self.dp, self.tp], &["pp", "dp", "tp"])
    }

    /// The layout's name: `ddp2×tp2`, `zero3:dp2×pp2`, `tp2+sp`… (the data dimension left out when
    /// it is one DDP replica).
    pub fn name(&self, data: DataDim, sequence_parallel: bool) -> String {
        let mut parts = Vec::new();
        match data {
            DataDim::Replicate if self.dp > 1 => parts.push(format!("ddp{}", self.dp)),
            DataDim::Replicate => {}
            DataDim::Zero(s) => parts.push(format!("zero{}:dp{}", s as u8 + 1, self.dp)),
        }
        if self.tp > 1 {
            parts.push(format!("tp{}{}", self.tp, if sequence_parallel { "+sp" } else { "" }));
        }
        if self.pp > 1 {
            parts.push(format!("pp{}", self.pp));
        }
        parts.join("×")
    }
}

/// A layout and what runs on each of its dimensions: what [`parallelize`] builds.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub dims: ParallelDims,
    /// DDP or ZeRO over `dp`.
    pub data: DataDim,
    /// Sequence parallelism inside the tensor-parallel blocks (needs tp > 1).
    pub sequence_parallel: bool,
    /// The schedule and micro-batches of the pipeline (its `stages` = `dims.pp`).
    pub pipeline: PipelineConfig,
    /// Activation checkpointing: tensor-parallel blocks are recomputed by the policy
    /// ([`TpBlock::recompute`](crate::tp::TpBlock::recompute)); under pipeline parallelism alone
    /// `Full` recomputes each rank's stages per micro-batch
    /// ([`pipeline_step_with`](crate::pipeline::pipeline_step_with)) and `every:K` is refused.
    pub activation_checkpointing: Checkpointing,
    /// The matrix multiplies' precision: fp32, or bf16 as `torch.autocast` computes (fp32
    /// parameters, gradients, optimizer state and residual stream; each linear's inputs cast at
    /// the use). fp16 is refused: it needs a loss scaler.
    pub precision: Precision,
}

impl Plan {
    /// `dims` with `data` on the data dimension; no sequence parallelism, the default pipeline
    /// schedule, no activation checkpointing, fp32.
    pub fn new(dims: ParallelDims, data: DataDim) -> Plan {
        let pipeline = PipelineConfig { stages: dims.pp, ..PipelineConfig::default() };
        Plan {
            dims,
            data,
            sequence_parallel: false,
            pipeline,
            activation_checkpointing: Checkpointing::None,
            precision: Precision::Fp32,
        }
    }
}

/// What the data dimension does with a piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataDim {
    /// DDP: every replica holds its piece whole; gradients are averaged with an all-reduce.
    Replicate,
    /// ZeRO stage 1, 2 or 3 over the replicas.
    Zero(Stage),
}
