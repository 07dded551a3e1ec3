//! Units in and out of memory: the asynchronous all-gather of a unit's shards (prefetch), making
//! a gathered unit the parameters' data, releasing it, and (stages 1–2) gathering every unit after
//! the optimizer step.

use super::{empty, Core, Stage, Unit};
use crate::comm::CommResult;
use std::time::Instant;
use tch::{Kind, Tensor};

impl Core<'_> {
    pub(super) fn track(&mut self, delta: i64) {
        self.transient = (self.transient as i64 + delta).max(0) as u64;
        self.peak_transient = self.peak_transient.max(self.transient);
    }

    // ---- stage 3: materialise and release units ----

    pub(super) fn gather_start(&mut self, u: usize) -> CommResult<()> {
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
    pub(super) fn shard_for_gather(&mut self, u: usize) -> Tensor {
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

    pub(super) fn materialize(&mut self, u: usize) -> CommResult<()> {
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

    pub(super) fn release(&mut self, u: usize) {
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
    pub(super) fn reset_after_error(&mut self) {
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
    pub(super) fn block_unit(&self, s: usize) -> Option<usize> {
        self.stage_uses.get(s)?.iter().map(|&i| self.unit_of[i]).find(|&u| !self.units[u].is_root)
    }

    pub(super) fn wait_all(&mut self) -> CommResult<()> {
        let mut first = None;
        for (_, w) in std::mem::take(&mut self.pending) {
            if let Err(e) = w.wait() {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl Core<'_> {
    /// Stages 1–2: all-gather every rank's master shard into the whole parameters (in the compute
    /// kind) — after the optimizer step, or after a checkpoint was loaded into the shards. Stage
    /// 3 gathers on demand: nothing to do.
    pub(super) fn gather_params(&mut self) -> CommResult<()> {
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
