//! ZeRO stages 1–3 (DeepSpeed's Zero Redundancy Optimizer); stage 3 is FSDP.
//!
//! Parameters are grouped into **units**: one per model stage (for the GPT: one per transformer
//! block), plus a *root* unit with the parameters of the first and last stages (embeddings, final
//! LayerNorm — the tied wte is used by both). Each unit is a [`FlatLayout`]: its tensors flattened
//! into one buffer, padded to a multiple of N and cut into N shards.
//!
//! | stage | every rank keeps | after backward | optimizer step |
//! |---|---|---|---|
//! | 1 | full params, full grads (kept, zeroed, between steps) and their averaged ⅟N, ⅟N of AdamW state | reduce-scatter (avg) each unit's flat grads | AdamW on the own shard, all-gather params |
//! | 2 | full params, ⅟N of grads and state | same, and free each unit's full grads at once | same |
//! | 3 | ⅟N of params, grads and state | same | AdamW on the own shard, nothing to gather |
//!
//! The optimizer is the caller's ([`crate::optim::AdamW`], the one every strategy steps), passed to
//! [`DataParallel::step`](crate::ddp::DataParallel::step) with the step's learning rate and clip:
//! it sees one slot per unit, this rank's flat shard, with the element ranges it weight-decays
//! ([`Decay::Ranges`](crate::optim::Decay::Ranges)). The step ([`crate::optim::optimizer_step`])
//! all-reduces the shards' sum of squares once for the global gradient norm (clipping) and
//! refuses on every rank when any gradient is not finite.
//!
//! Stage 3 materialises a unit only while it is needed: all-gather before its forward, free after;
//! all-gather again before its backward, free after (the root stays gathered for the whole step, as
//! FSDP's root does). libtorch's autograd keeps views of the gathered weights in its saved tensors,
//! so a freed unit would stay alive through its graph; stage 3 therefore runs a block's forward
//! without a graph and recomputes it in backward (see [`Zero::reshard_after_forward`]; the stage
//! runner's [`StageHooks::must_recompute`](crate::stages::StageHooks::must_recompute), the
//! mechanism activation checkpointing uses). A unit is released after its forward only when
//! resharding: with resharding off and a checkpoint policy, its blocks are recomputed but the unit
//! stays gathered until its backward. The next unit's all-gather is started asynchronously before
//! the current unit computes (prefetch), forward and backward. Parameters keep their identity (the
//! tensors the model and autograd know); only their data is swapped (`set_data`) between a view
//! into the gathered buffer and an empty tensor.
//!
//! Forward and backward run on the stage runner every strategy uses
//! ([`forward_backward`](crate::stages::forward_backward)), with ZeRO's
//! [`StageHooks`](crate::stages::StageHooks): gather and release units around each stage, collect
//! gradients, start reductions. Backward runs stage by stage with `Tensor::run_backward`, which
//! *returns* each stage's parameter gradients instead of accumulating full-size `.grad` tensors:
//! they go straight into the unit's flat gradient buffer, which is reduced (then, for stages 2–3,
//! freed; for stage 1, zeroed and kept) once the unit's last stage is done. Gradient accumulation:
//! stage 1 accumulates full local gradients and reduce-scatters once (`no_sync`); stages 2–3
//! reduce-scatter every micro-batch and accumulate the shard, as DeepSpeed does, so `no_sync` has
//! nothing to save there.
//!
//! Communication per step and rank (ring, f32): stages 1–2 send 2·(N−1)/N·4Ψ bytes, like DDP
//! (reduce-scatter + all-gather = all-reduce); stage 3 adds a second all-gather in backward,
//! 3·(N−1)/N·4Ψ = 1.5× DDP (less the root unit's, which is gathered once per step).
//!
//! The files: this one (the types, the units' layout, the builder), `gather.rs` (units in and out
//! of memory), `backward.rs` (the stage hooks and the gradient reductions), `data_parallel.rs` (the
//! [`DataParallel`](crate::ddp::DataParallel) strategy: memory, slots, the optimizer step), `flat.rs`
//! (one unit's flat, padded, sharded buffer), `shards.rs` ([`ShardedTensors`]: the same sharding
//! of a tensor- or pipeline-parallel piece's parameters, for the engine).
//!
//! [`round_trip`] has the same round trip driven by hand over a [`round_trip::UnitStack`], with the
//! gathered units counted (lesson 06's exercise 4).

mod backward;
mod data_parallel;
pub mod flat;
mod gather;
pub mod round_trip;
pub mod shards;
pub use shards::ShardedTensors;

use crate::comm::{CommError, CommResult, ProcessGroup, Work};
pub use crate::memory::MemoryStats;
use crate::model::Model;
use crate::stages::Checkpointing;
use crate::stats::DdpStats;
use flat::FlatLayout;
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// Which ZeRO stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Stage {
    One,
    Two,
    Three,
}

struct Unit {
    params: Vec<usize>,
    layout: FlatLayout,
    /// Stages 1–2: the full flat parameters (the model's parameters are views into it).
    /// Stage 3: the gathered buffer while the unit is materialised.
    full: Option<Tensor>,
    /// This rank's f32 shard of the parameters, the master the optimizer steps: a view into `full`
    /// (stages 1–2 in fp32) or a tensor of its own (stage 3, and stages 1–2 in mixed precision,
    /// where `full` holds the bf16/fp16 working copy).
    shard: Tensor,
    /// (shard,) averaged gradient, accumulated over micro-batches until the step.
    grad_shard: Tensor,
    /// (padded,) gradient of the current backward (stage 1: f32, kept across `no_sync`
    /// micro-batches and zeroed after each step — ZeRO-1 keeps full gradients; stages 2–3: in the
    /// reduce dtype, freed once reduced).
    grad_full: Option<Tensor>,
    /// The shard's element ranges that belong to weight-decayed tensors (nanoGPT's groups; never
    /// the padding) — the optimizer's [`Decay::Ranges`](crate::optim::Decay::Ranges) for this shard.
    decay: Vec<std::ops::Range<i64>>,
    /// The unit's gradients are final after this stage's backward.
    done_stage: usize,
    /// CPU offload on a GPU: pinned host buffers of one shard for the copy down (reduce kind) and
    /// the copy up (compute kind).
    staging: (Option<Tensor>, Option<Tensor>),
    is_root: bool,
}

/// A model trained with ZeRO stage 1, 2 or 3 (3 = FSDP).
pub struct Zero<'a> {
    model: Box<dyn Model + 'a>,
    z: Core<'a>,
}

/// Everything but the model: the state the stage hooks work on
/// ([`StageHooks`](crate::stages::StageHooks) for `Core`).
struct Core<'a> {
    pg: &'a ProcessGroup,
    params: Vec<Tensor>,
    stage_uses: Vec<Vec<usize>>,
    units: Vec<Unit>,
    unit_of: Vec<usize>,
    stage: Stage,
    require_sync: bool,
    stats: DdpStats,
    transient: u64,
    peak_transient: u64,
    /// In-flight all-gathers (stage 3): unit → (buffer, work).
    pending: Vec<(usize, Work<Tensor>)>,
    /// Stage 3: free each block unit right after its forward (and recompute the block in
    /// backward) instead of keeping it gathered until its backward.
    reshard_after_forward: bool,
    checkpointing: Checkpointing,
    /// This backward reduces gradients (stage 1 inside `no_sync` does not).
    sync: bool,
    /// The kind of the working parameters (the model's compute precision; FSDP2's `param_dtype`):
    /// what units are gathered in (stage 3) or kept whole in (stages 1–2). The shards the
    /// optimizer steps — the master weights — are f32 whatever it is.
    param_kind: Kind,
    /// Where the parameters, shards and buffers live.
    device: tch::Device,
    /// The kind gradients are accumulated and reduced in (FSDP2's `reduce_dtype`; f32 by default).
    reduce_kind: Kind,
    /// CPU offload (lesson 11; ZeRO-Offload, FSDP2's `CPUOffloadPolicy`): the f32 master shards,
    /// their gradient shards and so the optimizer's state live in host memory (pinned when the
    /// device is a GPU) and the step runs on the CPU. See [`Zero::offload`].
    offload: bool,
    /// Why a step now would be wrong (the last backward was not synchronised, or failed).
    step_blocked: Option<&'static str>,
    /// Reductions started by this backward, not yet waited for.
    reductions: Vec<(usize, Work<Tensor>)>,
}

/// How ZeRO/FSDP groups a model's parameters into units: the parameter indices of each unit, in
/// order. Unit 0 is the *root* (the parameters of the first and the last stage: embeddings, final
/// LayerNorm, the tied output weights), then one unit per `blocks_per_unit` consecutive middle
/// stages (transformer blocks). `param_stages[i]` is parameter i's stage ([`Model::param_stages`]).
pub fn unit_plan(param_stages: &[usize], num_stages: usize, blocks_per_unit: usize) -> Vec<Vec<usize>> {
    let last = num_stages.saturating_sub(1);
    let per = blocks_per_unit.max(1);
    let key = |s: usize| if s == 0 || s == last { 0 } else { (s - 1) / per + 1 };
    let mut keys: Vec<usize> = param_stages.iter().map(|&s| key(s)).collect();
    keys.sort_unstable();
    keys.dedup();
    keys.iter().map(|&k| (0..param_stages.len()).filter(|&i| key(param_stages[i]) == k).collect()).collect()
}

fn empty(device: tch::Device) -> Tensor {
    Tensor::empty([0], (Kind::Float, device))
}

impl<'a> Zero<'a> {
    /// Shard `model` over `pg` for `stage`; rank 0's weights are broadcast first. One unit per
    /// block (see [`Zero::with_blocks_per_unit`] for larger units). The optimizer is the caller's,
    /// passed to [`DataParallel::step`](crate::ddp::DataParallel::step): it sees one slot per
    /// unit, this rank's shard.
    pub fn new(pg: &'a ProcessGroup, model: Box<dyn Model + 'a>, stage: Stage) -> CommResult<Self> {
        Self::with_blocks_per_unit(pg, model, stage, 1)
    }

    /// As [`Zero::new`], with `blocks_per_unit` consecutive blocks (model stages between the first
    /// and the last) in each unit — FSDP's wrapping policy, DeepSpeed's bucket sizes. Larger units
    /// mean fewer, larger all-gathers and reduce-scatters (less per-call latency α, better
    /// bandwidth on small models) and more memory in flight: stage 3 holds up to two gathered
    /// units (current and prefetched) and their flat gradients.
    pub fn with_blocks_per_unit(
        pg: &'a ProcessGroup,
        model: Box<dyn Model + 'a>,
        stage: Stage,
        blocks_per_unit: usize,
    ) -> CommResult<Self> {
        if blocks_per_unit == 0 {
            return Err(CommError::InvalidArgument(format!("rank {}: blocks_per_unit must be at least 1", pg.rank())));
        }
        let mut params = model.parameters();
        tch::no_grad(|| params.iter_mut().try_for_each(|p| pg.broadcast(p, 0)))?;
        let stages = model.param_stages();
        let plan = unit_plan(&stages, model.num_stages(), blocks_per_unit);
        let (n, rank) = (pg.world_size(), pg.rank());
        let param_kind = model.precision().kind();
        // Every buffer of this wrapper lives where the model's parameters do (lesson 11).
        let device = params.first().map_or(tch::Device::Cpu, |p| p.device());
        let mut unit_of = vec![0; params.len()];
        let mut units = Vec::new();
        for (u, idx) in plan.into_iter().enumerate() {
            idx.iter().for_each(|&i| unit_of[i] = u);
            let layout = FlatLayout::new(idx.iter().map(|&i| params[i].size()).collect(), n);
            let flat = layout.flatten(&idx.iter().map(|&i| params[i].shallow_clone()).collect::<Vec<_>>());
            let r = layout.shard_range(rank);
            let (full, shard) = if stage == Stage::Three {
                tch::no_grad(|| idx.iter().for_each(|&i| params[i].set_data(&empty(device))));
                (None, flat.narrow(0, r.start, r.end - r.start).copy())
            } else if param_kind == Kind::Float {
                tch::no_grad(|| idx.iter().enumerate().for_each(|(j, &i)| params[i].set_data(&layout.view(&flat, j))));
                let shard = flat.narrow(0, r.start, r.end - r.start);
                (Some(flat), shard)
            } else {
                // Mixed precision: the whole parameters in the compute kind (what forward reads),
                // this rank's f32 master shard apart (what the optimizer steps).
                let working = flat.to_kind(param_kind);
                tch::no_grad(|| {
                    idx.iter().enumerate().for_each(|(j, &i)| params[i].set_data(&layout.view(&working, j)))
                });
                (Some(working), flat.narrow(0, r.start, r.end - r.start).copy())
            };
            let mut decay: Vec<std::ops::Range<i64>> = Vec::new();
            for (i, _within, in_shard) in layout.shard_pieces(rank) {
                if layout.shapes[i].len() >= 2 {
                    match decay.last_mut() {
                        Some(last) if last.end == in_shard.start => last.end = in_shard.end,
                        _ => decay.push(in_shard),
                    }
                }
            }
            let done_stage = idx.iter().map(|&i| stages[i]).min().unwrap_or(0);
            let is_root = u == 0 && idx.iter().any(|&i| stages[i] == 0 || stages[i] + 1 == model.num_stages());
            units.push(Unit {
                grad_shard: Tensor::zeros([layout.shard], (Kind::Float, device)),
                params: idx,
                layout,
                full,
                shard,
                grad_full: None,
                decay,
                done_stage,
                is_root,
                staging: (None, None),
            });
        }
        let stage_uses = model.stage_uses();
        Ok(Zero {
            model,
            z: Core {
                pg,
                params,
                stage_uses,
                units,
                unit_of,
                stage,
                require_sync: true,
                stats: DdpStats::default(),
                transient: 0,
                peak_transient: 0,
                pending: Vec::new(),
                reshard_after_forward: true,
                checkpointing: Checkpointing::None,
                sync: true,
                param_kind,
                device,
                reduce_kind: Kind::Float,
                offload: false,
                step_blocked: None,
                reductions: Vec::new(),
            },
        })
    }

    /// Stage 3 only, PyTorch FSDP2's option of the same name. `true` (default): a block unit is
    /// freed right after its forward and gathered again for its backward — parameters are
    /// sharded for the whole step, at the price of a second all-gather and, because libtorch's
    /// autograd keeps views of the gathered weights alive in its saved tensors (FSDP frees them
    /// by resizing the storage, which tch cannot), of recomputing the block's forward in
    /// backward. `false`: gathered units stay until their backward; no recompute, one all-gather
    /// per unit per step (DDP's traffic), the full parameters alive between a unit's forward and
    /// its backward.
    pub fn reshard_after_forward(mut self, on: bool) -> Self {
        self.z.reshard_after_forward = on;
        self
    }

    /// The precision gradients are accumulated and reduced in (FSDP2's `reduce_dtype`): fp32
    /// (default; gradients computed in bf16 are upcast before they are summed) or bf16/fp16 (half
    /// the bytes on the wire, and a sum of N rounded values). The gradient shards the optimizer
    /// reads are f32 either way.
    pub fn reduce_dtype(mut self, precision: crate::precision::Precision) -> Self {
        self.z.reduce_kind = precision.kind();
        self
    }

    /// CPU offload (DeepSpeed's ZeRO-Offload; FSDP2's `CPUOffloadPolicy`): move this rank's f32
    /// master shards and their gradient shards to host memory and run
    /// the optimizer there (its AdamW state is allocated next to the shards: host memory too). The
    /// device keeps the working parameters in the compute kind (whole for stages 1–2, gathered on
    /// demand for stage 3) and the transient flat gradients. Per step, each unit's averaged
    /// gradient shard is copied down as its reduction finishes (in the reduce kind), and the
    /// updated shard is cast to the compute kind on the host and copied up before its all-gather
    /// (stage 3: before every gather). On a GPU both copies go through a pinned (page-locked)
    /// buffer per unit, so the copy engine moves them by DMA at the link's speed. The copies are
    /// counted in [`DdpStats::d2h_bytes`] / [`DdpStats::h2d_bytes`] (on a CPU they count the bytes
    /// that would cross: there is no link); [`MemoryStats::offloaded`] counts the host side.
    ///
    /// The copies are blocking: a gradient's copy down waits for the kernels queued before it, so
    /// the GPU idles once per unit in backward (DeepSpeed overlaps them on side streams; tch exposes
    /// none). The arithmetic is that of the run without offload, bitwise on a CPU; on a GPU the
    /// step runs CPU kernels instead of CUDA ones, so expect last-bit differences. Call it before
    /// the first step (the optimizer's state is allocated where the shards are at the first step).
    pub fn offload(mut self, on: bool) -> Self {
        let z = &mut self.z;
        if on == z.offload {
            return self;
        }
        let (device, rank, param_kind, reduce_kind) = (z.device, z.pg.rank(), z.param_kind, z.reduce_kind);
        // A copy of its own on the host, never a view into a device buffer (stages 1-2 in f32
        // keep the master as a view of the full parameters).
        let host = |t: &Tensor| t.to(tch::Device::Cpu).copy();
        let back = |t: &Tensor| t.to_device(device).copy();
        // (shard,) page-locked on the host, for the copies across the link (GPU only).
        let pinned = |n: i64, kind: Kind| match device {
            tch::Device::Cuda(_) => Some(Tensor::empty([n], (kind, tch::Device::Cpu)).internal_pin_memory(device)),
            _ => None,
        };
        for u in &mut z.units {
            let move_ = |t: &Tensor| if on { host(t) } else { back(t) };
            u.shard = move_(&u.shard);
            u.grad_shard = move_(&u.grad_shard);
            let n = u.layout.shard;
            u.staging = if on { (pinned(n, reduce_kind), pinned(n, param_kind)) } else { (None, None) };
        }
        z.offload = on;
        if !on && z.stage != Stage::Three && z.param_kind == Kind::Float {
            // The master is a view of the full parameters again (no second copy on the device).
            for u in &mut z.units {
                let r = u.layout.shard_range(rank);
                let full = u.full.as_ref().expect("stages 1-2 keep full parameters");
                u.shard = full.narrow(0, r.start, r.end - r.start);
            }
        }
        self
    }

    /// The stage.
    pub fn stage(&self) -> Stage {
        self.z.stage
    }
}
