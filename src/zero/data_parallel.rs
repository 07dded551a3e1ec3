//! [`Zero`] as a [`DataParallel`] strategy: backward, the memory it holds, its optimizer slots, the
//! full parameters, and the optimizer step on this rank's shards (with CPU offload's upload).

use super::Zero;
use crate::comm::{CommResult, ProcessGroup};
use crate::ddp::DataParallel;
use crate::memory::held_bytes;

pub use crate::memory::MemoryStats;
use crate::model::{Batch, Model};
use crate::optim::{self, Decay, Held, NonFinite, Optimizer, Stepped};
use crate::stages::Checkpointing;
use crate::stats::DdpStats;
use tch::{Kind, Tensor};
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

    /// The forward alone, unit by unit as in training (stage 3: each unit gathered before its
    /// blocks and, resharding after forward, released after them); every unit still gathered is
    /// released at the end, so the rank holds what it held before.
    fn eval_loss(&mut self, batch: &Batch) -> CommResult<f64> {
        let r = crate::stages::forward_only(&*self.model, batch, &mut self.z);
        let waited = self.z.wait_all();
        for u in 0..self.z.units.len() {
            self.z.release(u);
        }
        let loss = r?;
        waited.map(|_| loss)
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

    /// [`optimizer_step`](crate::optim::optimizer_step) over the group decides the step on every
    /// rank together: Σ g² over the own gradient shards (padding is zero; each shard counted by
    /// its owner), whether any rank's optimizer refuses its shards or holds a non-finite gradient.
    /// A refusal anywhere, or a non-finite gradient, is an error on every rank before any weight
    /// changes (the gradient shards cleared). Then the shards are clipped if asked, `opt` steps
    /// every unit's shard (one slot per unit), and stages 1–2 all-gather the updated shards into
    /// every rank's full parameters.
    fn step_with(
        &mut self,
        opt: &mut dyn Optimizer,
        lr: f64,
        grad_clip: Option<f64>,
        non_finite: NonFinite,
    ) -> CommResult<Stepped> {
        let z = &mut self.z;
        let refusal = z.step_blocked.map(str::to_string);
        let held = Held::uniform(
            z.units.iter().map(|u| u.shard.shallow_clone()).collect(),
            z.units.iter().map(|u| u.grad_shard.shallow_clone()).collect(),
            z.units.iter().map(|u| Decay::Ranges(u.decay.clone())).collect(),
            true,
        );
        let stepped = optim::optimizer_step(&[z.pg], opt, &held, lr, grad_clip, non_finite, refusal);
        if matches!(stepped, Err(_) | Ok(Stepped { skipped: true, .. })) {
            // Refused or skipped: clear what backward accumulated besides the shards too (ZeRO-1's
            // full gradients, kept across no_sync micro-batches), so nothing of it reaches a later step.
            for u in &mut z.units {
                if let Some(g) = u.grad_full.as_mut() {
                    let _ = g.zero_();
                }
            }
        }
        let stepped = stepped?;
        if !stepped.skipped {
            z.gather_params()?;
        }
        Ok(stepped)
    }
}
