//! Toy DDP (lesson 04): broadcast rank 0's weights once; after each full backward, all-reduce
//! every gradient on its own, blocking, and divide by the world size.
//!
//! Per step and rank: one all-reduce per parameter tensor, Ψ·4 bytes in total (f32), none of it
//! overlapped with compute. Simple and correct; lesson 05 makes it fast.

use super::{DataParallel, DdpStats};
use crate::comm::{CommResult, ProcessGroup, ReduceOp};
use crate::model::{grads, Batch, Model};
use crate::stages::{forward_backward, AccumulateGrads, Checkpointing};
use std::time::Instant;
use tch::Tensor;

/// The naive data-parallel wrapper.
pub struct DdpNaive<'a> {
    pg: &'a ProcessGroup,
    model: Box<dyn Model + 'a>,
    params: Vec<Tensor>,
    require_sync: bool,
    /// The last backward ran inside no_sync.
    unsynced: bool,
    stats: DdpStats,
    checkpointing: Checkpointing,
}

impl<'a> DdpNaive<'a> {
    /// Wrap `model`: every rank's parameters become rank 0's.
    pub fn new(pg: &'a ProcessGroup, model: Box<dyn Model + 'a>) -> CommResult<Self> {
        let mut params = model.parameters();
        tch::no_grad(|| params.iter_mut().try_for_each(|p| pg.broadcast(p, 0)))?;
        Ok(DdpNaive {
            pg,
            model,
            params,
            require_sync: true,
            unsynced: false,
            stats: DdpStats::default(),
            checkpointing: Checkpointing::None,
        })
    }
}

/// Average `grads` over the group in place: sum-all-reduce each tensor, then divide by the world size.
pub fn average_gradients(pg: &ProcessGroup, grads: &mut [Tensor]) -> CommResult<u64> {
    let n = pg.world_size() as f64;
    let mut bytes = 0;
    for g in grads.iter_mut() {
        pg.all_reduce(g, ReduceOp::Sum)?; // g: (shape of the parameter) f32, summed over dp
        let _ = g.divide_scalar_(n);
        bytes += (g.numel() * 4) as u64;
    }
    Ok(bytes)
}

impl DataParallel for DdpNaive<'_> {
    fn model(&self) -> &dyn Model {
        &*self.model
    }
    fn group(&self) -> &ProcessGroup {
        self.pg
    }
    fn backward(&mut self, batch: &Batch, scale: f64) -> CommResult<f64> {
        let t0 = Instant::now();
        // Until this backward has finished (and averaged, if it syncs), a step would be wrong:
        // a failure below leaves gradients partly accumulated or averaged.
        self.unsynced = true;
        let mut hooks = AccumulateGrads::new(&self.params, |_| Ok(()));
        let value = forward_backward(&*self.model, &self.params, batch, scale, self.checkpointing, &mut hooks)?;
        self.stats.compute_s += t0.elapsed().as_secs_f64();
        if self.require_sync {
            let t1 = Instant::now();
            let mut g = grads(&self.params);
            self.stats.bytes += average_gradients(self.pg, &mut g)?;
            let dt = t1.elapsed().as_secs_f64();
            self.stats.comm_s += dt;
            self.stats.exposed_s += dt;
            self.stats.syncs += 1;
        }
        self.unsynced = !self.require_sync;
        Ok(value)
    }
    fn unsynced(&self) -> bool {
        self.unsynced
    }
    fn set_require_sync(&mut self, on: bool) {
        self.require_sync = on;
    }
    fn set_checkpointing(&mut self, policy: Checkpointing) {
        self.checkpointing = policy;
    }
    fn stats(&self) -> DdpStats {
        self.stats
    }
}
