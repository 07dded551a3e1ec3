//! ZeRO stages 1–3 (DeepSpeed's Zero Redundancy Optimizer); stage 3 is FSDP.
//!
//! Parameters are grouped into **units**: one per model stage (for the GPT: one per transformer
//! block), plus a *root* unit with the parameters of the first and last stages (embeddings,
//! final LayerNorm — the tied wte is used by both). Each unit is a [`FlatLayout`]: its tensors
//! flattened into one buffer, padded to a multiple of N and cut into N shards.
//!
//! | stage | every rank keeps | after backward | optimizer step |
//! |---|---|---|---|
//! | 1 | full params, full grads (kept, zeroed, between steps) and their averaged ⅟N, ⅟N of AdamW state | reduce-scatter (avg) each unit's flat grads | AdamW on the own shard, all-gather params |
//! | 2 | full params, ⅟N of grads and state | same, and free each unit's full grads at once | same |
//! | 3 | ⅟N of params, grads and state | same | AdamW on the own shard, nothing to gather |
//!
//! The optimizer is the caller's ([`crate::optim::AdamW`], the one every strategy steps), passed
//! to [`DataParallel::step`] with the step's learning rate and clip: it sees one slot per unit,
//! this rank's flat shard, with a per-element weight-decay mask ([`Decay::Mask`]). The step
//! all-reduces the shards' sum of squares once for the global gradient norm (clipping) and refuses
//! on every rank when it is not finite.
//!
//! Stage 3 materialises a unit only while it is needed: all-gather before its forward, free
//! after; all-gather again before its backward, free after (the root stays gathered for the whole
//! step, as FSDP's root does). libtorch's autograd keeps views of the gathered weights in its saved
//! tensors, so a freed unit would stay alive through its graph; stage 3 therefore runs a block's
//! forward without a graph and recomputes it in backward (see [`Zero::reshard_after_forward`];
//! the stage runner's [`StageHooks::must_recompute`], the mechanism activation checkpointing
//! uses). A unit is released after its forward only when resharding: with resharding off and a
//! checkpoint policy, its blocks are recomputed but the unit stays gathered until its backward.
//! The next unit's all-gather is started asynchronously before the current unit computes
//! (prefetch), forward and backward. Parameters keep their identity (the tensors the model and
//! autograd know); only their data is swapped (`set_data`) between a view into the gathered buffer
//! and an empty tensor.
//!
//! Forward and backward run on the stage runner every strategy uses
//! ([`forward_backward`](crate::stages::forward_backward)), with ZeRO's [`StageHooks`]: gather and
//! release units around each stage, collect gradients, start reductions. Backward runs stage by
//! stage with `Tensor::run_backward`, which *returns* each stage's parameter gradients instead of
//! accumulating full-size `.grad` tensors: they go straight into the unit's flat gradient buffer,
//! which is reduced (then, for stages 2–3, freed; for stage 1, zeroed and kept) once the unit's
//! last stage is done. Gradient accumulation: stage 1 accumulates full local gradients
//! and reduce-scatters once (`no_sync`); stages 2–3 reduce-scatter every micro-batch and
//! accumulate the shard, as DeepSpeed does, so `no_sync` has nothing to save there.
//!
//! Communication per step and rank (ring, f32): stages 1–2 send 2·(N−1)/N·4Ψ bytes, like DDP
//! (reduce-scatter + all-gather = all-reduce); stage 3 adds a second all-gather in backward,
//! 3·(N−1)/N·4Ψ = 1.5× DDP (less the root unit's, which is gathered once per step).
//!
//! [`round_trip`] has the same round trip driven by hand over a [`round_trip::UnitStack`], with the
//! gathered units counted (lesson 06's exercise 4).

pub mod flat;
pub mod round_trip;

use crate::comm::{CommError, CommResult, ProcessGroup, ReduceOp, Work};
use crate::ddp::DataParallel;
use crate::memory::held_bytes;
pub use crate::memory::MemoryStats;
use crate::model::{Batch, Model};
use crate::optim::{self, Decay, Optimizer};
use crate::stages::{forward_backward, Checkpointing, StageHooks};
use crate::stats::DdpStats;
use flat::FlatLayout;
use serde::{Deserialize, Serialize};
use std::time::Instant;
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
    /// (shard,) f32: 1 where the element belongs to a weight-decayed tensor (nanoGPT's groups), 0
    /// elsewhere and in the padding — the optimizer's [`Decay::Mask`] for this shard.
    decay_mask: Tensor,
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

/// Everything but the model: the state the stage hooks work on ([`StageHooks`] for `Core`).
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
    /// passed to [`DataParallel::step`]: it sees one slot per unit, this rank's shard.
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
            let mut mask = vec![0f32; layout.shard as usize];
            for (i, _within, in_shard) in layout.shard_pieces(rank) {
                if layout.shapes[i].len() >= 2 {
                    mask[in_shard.start as usize..in_shard.end as usize].iter_mut().for_each(|x| *x = 1.0);
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
                decay_mask: Tensor::from_slice(&mask).to_device(device),
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
    /// master shards, their gradient shards and the per-element decay masks to host memory and run
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
            u.decay_mask = move_(&u.decay_mask);
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

impl Core<'_> {
    fn track(&mut self, delta: i64) {
        self.transient = (self.transient as i64 + delta).max(0) as u64;
        self.peak_transient = self.peak_transient.max(self.transient);
    }

    // ---- stage 3: materialise and release units ----

    fn gather_start(&mut self, u: usize) -> CommResult<()> {
        if self.stage != Stage::Three || self.units[u].full.is_some() || self.pending.iter().any(|(p, _)| *p == u) {
            return Ok(());
        }
        let kind = self.param_kind;
        let out = Tensor::empty([self.units[u].layout.padded], (kind, self.device));
        self.track(kind.elt_size_in_bytes() as i64 * self.units[u].layout.padded);
        // (padded,) in the compute kind from N shards (bf16: half the bytes of f32).
        let input = self.shard_for_gather(u);
        let w = self.pg.all_gather_async(out, input)?;
        self.pending.push((u, w));
        Ok(())
    }

    /// Stage 3: what unit `u`'s all-gather sends — this rank's shard in the compute kind, on the
    /// device. The shard is a parameter the optimizer writes only after every gather of the step
    /// has been waited on, so the op may read it through an alias (f32, not offloaded).
    fn shard_for_gather(&mut self, u: usize) -> Tensor {
        let (shard, kind) = (&self.units[u].shard, self.param_kind);
        if self.offload {
            let t = upload(&self.units[u], kind, self.device);
            self.stats.h2d_bytes += (t.numel() * t.kind().elt_size_in_bytes()) as u64;
            t
        } else if kind == Kind::Float {
            shard.shallow_clone()
        } else {
            shard.to_kind(kind)
        }
    }

    fn materialize(&mut self, u: usize) -> CommResult<()> {
        if self.stage != Stage::Three || self.units[u].full.is_some() {
            return Ok(());
        }
        self.gather_start(u)?;
        let pos = self.pending.iter().position(|(p, _)| *p == u).expect("started above");
        let (_, w) = self.pending.remove(pos);
        let t0 = Instant::now();
        let (out, t) = w.wait_timed()?;
        self.stats.gather_exposed_s += t0.elapsed().as_secs_f64();
        self.stats.gather_s += (t.finished - t.started).as_secs_f64();
        let unit = &mut self.units[u];
        tch::no_grad(|| {
            for (j, &i) in unit.params.iter().enumerate() {
                self.params[i].set_data(&unit.layout.view(&out, j));
            }
        });
        unit.full = Some(out);
        Ok(())
    }

    fn release(&mut self, u: usize) {
        if self.stage != Stage::Three || self.units[u].full.is_none() {
            return;
        }
        let unit = &mut self.units[u];
        let device = self.device;
        tch::no_grad(|| unit.params.iter().for_each(|&i| self.params[i].set_data(&empty(device))));
        unit.full = None;
        let bytes = self.param_kind.elt_size_in_bytes() as i64 * unit.layout.padded;
        self.track(-bytes);
    }

    /// After a failed backward: nothing may stay in flight (wait for, and drop, every started
    /// gather and reduction), no unit stays gathered, and the partial gradients are dropped — a
    /// retry starts from clean buffers, and a step before it is refused.
    fn reset_after_error(&mut self) {
        let _ = self.wait_all();
        for (_, w) in std::mem::take(&mut self.reductions) {
            let _ = w.wait();
        }
        for u in 0..self.units.len() {
            self.release(u);
        }
        for u in &mut self.units {
            match (self.stage, u.grad_full.as_mut()) {
                (Stage::One, Some(g)) => drop(g.zero_()),
                _ => u.grad_full = None,
            }
            let _ = u.grad_shard.zero_();
        }
        self.transient = 0;
        self.step_blocked = Some("the last backward failed; its partial gradients were dropped: run a backward again");
    }

    /// The non-root unit of stage `s`, if any.
    fn block_unit(&self, s: usize) -> Option<usize> {
        self.stage_uses.get(s)?.iter().map(|&i| self.unit_of[i]).find(|&u| !self.units[u].is_root)
    }

    fn wait_all(&mut self) -> CommResult<()> {
        let mut first = None;
        for (_, w) in std::mem::take(&mut self.pending) {
            if let Err(e) = w.wait() {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl DataParallel for Zero<'_> {
    fn model(&self) -> &dyn Model {
        &*self.model
    }
    fn group(&self) -> &ProcessGroup {
        self.z.pg
    }
    fn set_require_sync(&mut self, on: bool) {
        self.z.require_sync = on;
    }
    /// The last backward was not synchronised, or failed: a step now is refused.
    fn unsynced(&self) -> bool {
        self.z.step_blocked.is_some()
    }
    fn stats(&self) -> DdpStats {
        self.z.stats
    }

    fn set_checkpointing(&mut self, policy: Checkpointing) {
        self.z.checkpointing = policy;
    }

    fn backward(&mut self, batch: &Batch, scale: f64) -> CommResult<f64> {
        let r = self.backward_inner(batch, scale);
        if r.is_err() {
            self.z.reset_after_error();
        }
        r
    }

    /// Bytes held now (after a step: what is kept between steps), measured from the tensors this
    /// rank keeps: the model's parameters and the units' buffers (full and shard) for parameters,
    /// the flat gradient buffers for gradients; and the transient peak so far.
    ///
    /// With [`Zero::offload`], the master shards, gradient shards and optimizer state are in host
    /// memory: counted in `offloaded`, not in `params`/`grads`/`optim` (which then hold what is on
    /// the device).
    fn memory(&self, opt: &dyn Optimizer) -> MemoryStats {
        let units = &self.z.units;
        let working = || self.z.params.iter().chain(units.iter().flat_map(|u| u.full.iter()));
        let shards = || units.iter().map(|u| &u.shard);
        let grad_full = || units.iter().flat_map(|u| u.grad_full.iter());
        let grad_shards = || units.iter().map(|u| &u.grad_shard);
        if self.z.offload {
            MemoryStats {
                params: held_bytes(working()),
                grads: held_bytes(grad_full()),
                optim: 0,
                offloaded: held_bytes(shards())
                    + held_bytes(grad_shards())
                    + held_bytes(units.iter().flat_map(|u| u.staging.0.iter().chain(u.staging.1.iter())))
                    + opt.state_bytes(),
                peak_transient: self.z.peak_transient,
            }
        } else {
            MemoryStats {
                params: held_bytes(working().chain(shards())),
                grads: held_bytes(grad_full().chain(grad_shards())),
                optim: opt.state_bytes(),
                offloaded: 0,
                peak_transient: self.z.peak_transient,
            }
        }
    }

    /// One slot per unit: this rank's f32 master shard and the parameter pieces in it.
    fn slots(&self) -> Vec<crate::ddp::Slot> {
        let rank = self.z.pg.rank();
        self.z
            .units
            .iter()
            .map(|u| crate::ddp::Slot {
                master: u.shard.shallow_clone(),
                pieces: u
                    .layout
                    .shard_pieces(rank)
                    .into_iter()
                    .map(|(j, within, at)| (u.params[j], within, at))
                    .collect(),
                replicated: false,
            })
            .collect()
    }

    fn param_shapes(&self) -> Vec<Vec<i64>> {
        let mut out = vec![Vec::new(); self.z.params.len()];
        for u in &self.z.units {
            for (j, &i) in u.params.iter().enumerate() {
                out[i] = u.layout.shapes[j].clone();
            }
        }
        out
    }

    fn masters_loaded(&mut self) -> CommResult<()> {
        self.z.gather_params()
    }

    /// This rank's gradient shards (f32, averaged over the group), one per unit.
    fn grads(&self) -> Vec<Tensor> {
        self.z.units.iter().map(|u| u.grad_shard.shallow_clone()).collect()
    }

    fn zero_grads(&mut self) {
        for u in &mut self.z.units {
            let _ = u.grad_shard.zero_();
        }
    }

    fn full_parameters(&self) -> CommResult<Vec<Tensor>> {
        let mut out: Vec<Option<Tensor>> = (0..self.z.params.len()).map(|_| None).collect();
        for u in &self.z.units {
            let full = match &u.full {
                Some(f) if f.kind() == Kind::Float => f.shallow_clone(),
                _ => {
                    let mut f = u.layout.zeros_on(self.z.device);
                    self.z.pg.all_gather(&mut f, &u.shard)?;
                    f
                }
            };
            for (j, &i) in u.params.iter().enumerate() {
                out[i] = Some(u.layout.view(&full, j).copy());
            }
        }
        Ok(out.into_iter().map(|t| t.expect("every parameter is in a unit")).collect())
    }

    /// One all-reduce of two numbers decides the step on every rank together: Σ g² over the own
    /// gradient shards (padding is zero; the global norm is its square root) and whether this
    /// rank's optimizer refuses its slots. A refusal anywhere, or a non-finite norm, is an error on
    /// every rank before any weight changes. Then the shards are clipped if asked, `opt` steps
    /// every unit's shard (one slot per unit), and stages 1–2 all-gather the updated shards into
    /// every rank's full parameters.
    fn step(&mut self, opt: &mut dyn Optimizer, lr: f64, grad_clip: Option<f64>) -> CommResult<f64> {
        let z = &mut self.z;
        let rank = z.pg.rank();
        optim::check_grad_clip(grad_clip).map_err(|e| CommError::InvalidArgument(format!("rank {rank}: {e}")))?;
        if let Some(why) = z.step_blocked {
            return Err(CommError::Step(format!("rank {rank}: {why}")));
        }
        let params: Vec<Tensor> = z.units.iter().map(|u| u.shard.shallow_clone()).collect();
        let grads: Vec<Tensor> = z.units.iter().map(|u| u.grad_shard.shallow_clone()).collect();
        let decay: Vec<Decay> = z.units.iter().map(|u| Decay::Mask(u.decay_mask.shallow_clone())).collect();
        let refused = opt.check(&params, &grads, &decay).err();
        let local = optim::global_norm(&grads);
        // (2,) f64, summed over dp: [Σ g², ranks refusing].
        let mut agree = Tensor::from_slice(&[local * local, refused.is_some() as u8 as f64]);
        z.pg.all_reduce(&mut agree, ReduceOp::Sum)?;
        let (sq, refusing) = (agree.double_value(&[0]), agree.double_value(&[1]));
        if let Some(e) = refused {
            return Err(CommError::Step(format!("rank {rank}: the optimizer: {e}")));
        }
        if refusing > 0.0 {
            return Err(CommError::Step(format!(
                "rank {rank}: {refusing} rank(s) refused the step (their optimizer does not fit their shards)"
            )));
        }
        let norm = sq.sqrt();
        crate::ddp::check_norm(norm, rank)?;
        if let Some(max) = grad_clip {
            crate::ddp::scale_grads(&grads, optim::clip_coef(norm, max));
        }
        opt.step(lr, &params, &grads, &decay)
            .map_err(|e| CommError::Step(format!("rank {rank}: the optimizer: {e}")))?;
        for u in &mut z.units {
            let _ = u.grad_shard.zero_();
        }
        z.gather_params()?;
        Ok(norm)
    }
}

/// CPU offload: unit `u`'s master shard in the compute kind on `device` — cast on the host (into
/// the pinned buffer on a GPU: half the bytes over PCIe in bf16), then copied up.
fn upload(u: &Unit, kind: Kind, device: tch::Device) -> Tensor {
    match &u.staging.1 {
        Some(up) => {
            let mut up = up.shallow_clone();
            tch::no_grad(|| up.copy_(&u.shard));
            up.to_device(device)
        }
        None => u.shard.to_kind(kind).to_device(device),
    }
}

impl Core<'_> {
    /// Stages 1–2: all-gather every rank's master shard into the whole parameters (in the compute
    /// kind) — after the optimizer step, or after a checkpoint was loaded into the shards. Stage
    /// 3 gathers on demand: nothing to do.
    fn gather_params(&mut self) -> CommResult<()> {
        let z = self;
        if z.stage != Stage::Three {
            // Every rank updated its own shard: all-gather the updated parameters into the full buffers.
            let mut works = Vec::new();
            let mut first_err = None;
            for u in &z.units {
                // The output buffer contains the shard: gather from a copy. The full buffer stays
                // in the unit (the parameters are views of it); nothing reads or writes them until
                // every gather below has been waited on.
                // (shard,) in the compute kind: a copy either way.
                let input = if z.offload {
                    // Cast on the host, then copy up: half the bytes over PCIe in bf16.
                    let t = upload(u, z.param_kind, z.device);
                    z.stats.h2d_bytes += (t.numel() * t.kind().elt_size_in_bytes()) as u64;
                    t
                } else if z.param_kind == Kind::Float {
                    u.shard.copy()
                } else {
                    u.shard.to_kind(z.param_kind)
                };
                let full = u.full.as_ref().expect("stages 1-2 keep full parameters").shallow_clone();
                match z.pg.all_gather_async(full, input) {
                    Ok(w) => works.push(w),
                    Err(e) => {
                        first_err = Some(e);
                        break;
                    }
                }
            }
            // Wait for every started gather, even after a failure: none may still write into the
            // buffers the parameters view.
            for w in works {
                if let Err(e) = w.wait() {
                    first_err.get_or_insert(e);
                }
            }
            if let Some(e) = first_err {
                return Err(e);
            }
        }
        Ok(())
    }
}

impl Core<'_> {
    /// Wait for one gradient reduction; stages 2-3 add the averaged shard and free the full gradient.
    fn finish_reduction(&mut self, (u, w): (usize, Work<Tensor>), apply: bool) -> CommResult<()> {
        let t0 = Instant::now();
        let r = w.wait_timed();
        self.stats.exposed_s += t0.elapsed().as_secs_f64();
        let (out, t) = r?;
        self.stats.comm_s += (t.finished - t.started).as_secs_f64();
        self.stats.bytes += (out.numel() * out.kind().elt_size_in_bytes()) as u64;
        if apply {
            if self.offload {
                // (shard,) in the reduce kind, device → host: the copy down (into the pinned
                // buffer on a GPU), then added to the f32 shard on the host.
                self.stats.d2h_bytes += (out.numel() * out.kind().elt_size_in_bytes()) as u64;
                let unit = &mut self.units[u];
                match unit.staging.0.as_mut() {
                    Some(down) => {
                        tch::no_grad(|| down.copy_(&out));
                        let _ = unit.grad_shard.g_add_(down);
                    }
                    None => drop(unit.grad_shard.g_add_(&out.to_device(tch::Device::Cpu))),
                }
            } else {
                let _ = self.units[u].grad_shard.g_add_(&out);
            }
            if self.stage == Stage::One {
                if let Some(g) = self.units[u].grad_full.as_mut() {
                    let _ = g.zero_(); // the full local gradient buffer stays allocated (ZeRO-1)
                }
            } else {
                self.units[u].grad_full = None; // stages 2-3 keep only the shard
                let b = self.reduce_kind.elt_size_in_bytes() as i64 * self.units[u].layout.padded;
                self.track(-b);
            }
        }
        Ok(())
    }
}

impl Zero<'_> {
    fn backward_inner(&mut self, batch: &Batch, scale: f64) -> CommResult<f64> {
        let t0 = Instant::now();
        let z = &mut self.z;
        z.sync = z.require_sync || z.stage != Stage::One;
        let params: Vec<Tensor> = z.params.iter().map(|p| p.shallow_clone()).collect();
        let policy = z.checkpointing;
        let loss = forward_backward(&*self.model, &params, batch, scale, policy, z)?;
        self.z.stats.compute_s += t0.elapsed().as_secs_f64();
        // ---- wait for the reductions still in flight ----
        let mut first_err: Option<CommError> = None;
        for r in std::mem::take(&mut self.z.reductions) {
            if let Err(e) = self.z.finish_reduction(r, first_err.is_none()) {
                first_err.get_or_insert(e);
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        if self.z.sync {
            self.z.stats.syncs += 1;
            self.z.step_blocked = None;
        } else {
            self.z.step_blocked = Some(
                "the last backward ran without gradient synchronisation (no_sync): its gradients were never \
                 reduced; finish with a synchronised backward before stepping",
            );
        }
        Ok(loss)
    }
}

/// ZeRO as stage hooks: gather (stage 3) before a unit's forward and backward, release after;
/// collect each stage's gradients into its unit's flat buffer; reduce-scatter a unit as soon as
/// its last stage's backward is done.
impl StageHooks for Core<'_> {
    fn begin(&mut self) -> CommResult<()> {
        if let Some(r) = self.units.iter().position(|u| u.is_root) {
            self.materialize(r)?; // the root stays gathered for the whole step, as FSDP's root
        }
        Ok(())
    }

    fn must_recompute(&self, s: usize) -> bool {
        // Resharding after forward: keep no graph (its saved views would pin the gathered
        // buffer), only the stage's input; backward recomputes the stage.
        self.stage == Stage::Three && self.reshard_after_forward && self.block_unit(s).is_some()
    }

    fn pre_forward(&mut self, s: usize) -> CommResult<()> {
        let unit = self.block_unit(s);
        if let Some(u) = unit {
            self.materialize(u)?;
        }
        // Prefetch the next *other* unit as soon as this one is here, so that its all-gather
        // overlaps all of this unit's blocks, not only the last.
        let n = self.stage_uses.len();
        if let Some(next) = (s + 1..n).filter_map(|t| self.block_unit(t)).find(|&v| Some(v) != unit) {
            self.gather_start(next)?;
        }
        Ok(())
    }

    fn post_forward(&mut self, s: usize, _recomputed: bool) -> CommResult<()> {
        // A unit of several blocks stays gathered until its last block has run.
        if let (Some(u), true) = (self.block_unit(s), self.must_recompute(s)) {
            if self.block_unit(s + 1) != Some(u) {
                self.release(u);
            }
        }
        Ok(())
    }

    fn pre_backward(&mut self, s: usize) -> CommResult<()> {
        let unit = self.block_unit(s);
        if let Some(u) = unit {
            self.materialize(u)?;
        }
        // Prefetch the previous *other* unit (backward runs the units in reverse).
        if let Some(prev) = (0..s).rev().filter_map(|t| self.block_unit(t)).find(|&v| Some(v) != unit) {
            self.gather_start(prev)?;
        }
        Ok(())
    }

    fn grads(&mut self, _s: usize, uses: &[usize], grads: Vec<Tensor>) -> CommResult<()> {
        for (&i, g) in uses.iter().zip(&grads) {
            if !g.defined() {
                continue;
            }
            let u = self.unit_of[i];
            let j = self.units[u].params.iter().position(|&p| p == i).expect("param in its unit");
            if self.units[u].grad_full.is_none() {
                // Stage 1 accumulates micro-batches in it: f32 whatever the reduce dtype (as
                // Megatron's --accumulate-allreduce-grads-in-fp32); stages 2–3 reduce every
                // micro-batch and accumulate the f32 shard, so their buffer is in the reduce dtype.
                let kind = if self.stage == Stage::One { Kind::Float } else { self.reduce_kind };
                let padded = self.units[u].layout.padded;
                self.units[u].grad_full = Some(Tensor::zeros([padded], (kind, self.device)));
                if self.stage != Stage::One {
                    let b = kind.elt_size_in_bytes() as i64 * padded; // stage 1 keeps it: not transient
                    self.track(b);
                }
            }
            let gf = self.units[u].grad_full.as_ref().unwrap();
            let _ = self.units[u].layout.view(gf, j).g_add_(g);
        }
        Ok(())
    }

    fn post_backward(&mut self, s: usize) -> CommResult<()> {
        if let Some(u) = self.block_unit(s) {
            if s == 0 || self.block_unit(s - 1) != Some(u) {
                self.release(u);
            }
        }
        if !self.sync {
            return Ok(());
        }
        // Units whose gradients are now final: start their reduction.
        for u in 0..self.units.len() {
            if self.units[u].done_stage != s {
                continue;
            }
            let Some(gf) = self.units[u].grad_full.as_ref() else { continue };
            let out = Tensor::empty([self.units[u].layout.shard], (self.reduce_kind, self.device));
            // (shard,) of grads averaged over dp, in the reduce kind. The unit keeps its full gradient (freed or
            // zeroed in finish_reduction, after the wait); the op reads it through this alias, or
            // reads a transient copy in the reduce kind (stage 1's f32 buffer with bf16 reduction).
            let input = if gf.kind() == self.reduce_kind { gf.shallow_clone() } else { gf.to_kind(self.reduce_kind) };
            let w = self.pg.reduce_scatter_async(out, input, ReduceOp::Avg)?;
            self.reductions.push((u, w));
            // Keep at most two reductions in flight: finishing the older one frees its unit's
            // full gradient (stages 2-3), so gradients never pile up to 4Ψ.
            if self.reductions.len() > 2 {
                let r = self.reductions.remove(0);
                self.finish_reduction(r, true)?;
            }
        }
        Ok(())
    }

    fn end(&mut self) -> CommResult<()> {
        if let Some(r) = self.units.iter().position(|u| u.is_root) {
            self.release(r);
        }
        Ok(())
    }
}
