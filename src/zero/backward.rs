//! Backward: ZeRO's stage hooks (gather before a unit's forward and backward, release after,
//! gradients into the unit's flat buffer, a reduce-scatter as soon as a unit's last stage is done)
//! and the wait for each reduction.

use super::{Core, Stage, Zero};
use crate::comm::{CommError, CommResult, ReduceOp, Work};
use crate::model::Batch;
use crate::stages::{forward_backward, StageHooks};
use std::time::Instant;
use tch::{Kind, Tensor};

impl Core<'_> {
    /// Wait for one gradient reduction; stages 2-3 add the averaged shard and free the full gradient.
    pub(super) fn finish_reduction(&mut self, (u, w): (usize, Work<Tensor>), apply: bool) -> CommResult<()> {
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
    pub(super) fn backward_inner(&mut self, batch: &Batch, scale: f64) -> CommResult<f64> {
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
            self.z.step_blocked = Some(crate::ddp::NO_SYNC_REFUSAL);
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
