//! Production DDP (lesson 05): gradient buckets all-reduced while backward is still running.
//!
//! * Buckets: parameters in *reverse* registration order (roughly the order backward finishes
//!   them), packed greedily into flat f32 buffers of at most `cap` bytes (a tensor larger than
//!   the cap gets a bucket of its own). Fewer, larger messages: less per-message latency (α).
//! * Overlap: backward runs stage by stage (the stage runner, [`forward_backward`]); once the
//!   stage that first uses every parameter of a bucket has run backward, the bucket's gradients
//!   are final — they are copied into its flat buffer and its all-reduce (average) starts on the
//!   communication thread while the training thread goes on with the earlier stages.
//! * After backward: wait for every bucket (the *exposed* communication time), copy the averaged
//!   buffers back into the gradients and free them: between steps a rank holds its `.grad`s
//!   (Ψ·4), not a second copy in buckets; the buckets are transient (Ψ·4 at the end of backward).
//!
//! Per step and rank: the same Ψ·4 bytes as [`DdpNaive`](super::DdpNaive), in `buckets` messages.

use super::{DataParallel, DdpStats};
use crate::comm::{CommResult, ProcessGroup, ReduceOp, Work};
use crate::memory::{held_bytes, MemoryStats};
use crate::model::{grads, Batch, Model};
use crate::optim::Optimizer;
use crate::stages::{forward_backward, AccumulateGrads, Checkpointing};
use std::time::Instant;
use tch::{Kind, Tensor};

/// Group parameters of `sizes` bytes (registration order) into buckets of at most `cap` bytes,
/// walking from the last parameter to the first; each bucket lists its parameter indices in that
/// (reverse) order. A parameter larger than `cap` gets a bucket of its own.
pub fn assign_buckets(sizes: &[usize], cap: usize) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut bytes = 0;
    for i in (0..sizes.len()).rev() {
        if !current.is_empty() && bytes + sizes[i] > cap {
            buckets.push(std::mem::take(&mut current));
            bytes = 0;
        }
        current.push(i);
        bytes += sizes[i];
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    buckets
}

/// Every parameter of `n` exactly once, no empty bucket.
fn check_assignment(assignment: &[Vec<usize>], n: usize) -> Result<(), String> {
    let mut seen = vec![0usize; n];
    for b in assignment {
        if b.is_empty() {
            return Err(format!("the bucket assignment has an empty bucket: {assignment:?}"));
        }
        for &i in b {
            if i >= n {
                return Err(format!("the bucket assignment names parameter {i}; the model has {n}"));
            }
            seen[i] += 1;
        }
    }
    match seen.iter().position(|&c| c != 1) {
        Some(i) => {
            Err(format!("the bucket assignment lists parameter {i} {} times (every parameter exactly once)", seen[i]))
        }
        None => Ok(()),
    }
}

struct Bucket {
    params: Vec<usize>,
    /// Offsets of each parameter's gradient in the bucket's flat buffer: (Σ numel,) f32, the
    /// bucket's gradients, all-reduced (average over dp) in one message. Allocated when the bucket
    /// is ready in backward, carried by its `Work`, freed once copied back into the `.grad`s.
    offsets: Vec<i64>,
    numel: i64,
    /// After this stage's backward every gradient in the bucket is final.
    ready_stage: usize,
}

/// The bucketed, overlapping data-parallel wrapper.
pub struct DdpBucketed<'a> {
    pg: &'a ProcessGroup,
    model: Box<dyn Model + 'a>,
    params: Vec<Tensor>,
    buckets: Vec<Bucket>,
    require_sync: bool,
    /// The last backward ran inside no_sync.
    unsynced: bool,
    stats: DdpStats,
    checkpointing: Checkpointing,
    /// The most bytes of flat buckets alive at once so far (all of them at the end of backward).
    peak_transient: u64,
}

impl<'a> DdpBucketed<'a> {
    /// Wrap `model` with buckets of at most `cap_bytes`; rank 0's weights are broadcast first.
    pub fn new(pg: &'a ProcessGroup, model: Box<dyn Model + 'a>, cap_bytes: usize) -> CommResult<Self> {
        Self::with_assignment(pg, model, cap_bytes, assign_buckets)
    }

    /// As [`DdpBucketed::new`], with the buckets chosen by `assign(sizes, cap_bytes)` instead of
    /// [`assign_buckets`] (lesson 05's grader trains with the learner's). The assignment must list
    /// every parameter exactly once and no empty bucket; every rank must compute the same one.
    pub fn with_assignment(
        pg: &'a ProcessGroup,
        model: Box<dyn Model + 'a>,
        cap_bytes: usize,
        assign: impl Fn(&[usize], usize) -> Vec<Vec<usize>>,
    ) -> CommResult<Self> {
        let mut params = model.parameters();
        let stages = model.param_stages();
        let sizes: Vec<usize> = params.iter().map(|p| p.numel() * 4).collect();
        let assignment = assign(&sizes, cap_bytes.max(1));
        let invalid = check_assignment(&assignment, params.len()).err();
        // Every rank must build the same buckets (a learner's assignment that iterates a HashMap
        // would not): agree on validity and on a fingerprint of the assignment, in one all-reduce,
        // so that a bad or differing assignment is an error on every rank, never a wrong average.
        let print = (assignment
            .iter()
            .flatten()
            .chain([&usize::MAX])
            .fold(0xcbf2_9ce4_8422_2325u64, |h, &i| (h ^ i as u64).wrapping_mul(0x100_0000_01b3))
            >> 2) as i64;
        let mut agree = Tensor::from_slice(&[i64::from(invalid.is_some()), print, -print]);
        pg.all_reduce(&mut agree, ReduceOp::Max)?;
        let v = Vec::<i64>::try_from(&agree).unwrap_or_default();
        let rank = pg.rank();
        if let Some(e) = invalid {
            return Err(crate::comm::CommError::InvalidArgument(format!("rank {rank}: {e}")));
        }
        if v.first() != Some(&0) {
            return Err(crate::comm::CommError::InvalidArgument(format!(
                "rank {rank}: another rank's bucket assignment is invalid (its error says why)"
            )));
        }
        if v.get(1) != v.get(2).map(|m| -m).as_ref() {
            return Err(crate::comm::CommError::InvalidArgument(format!(
                "rank {rank}: the ranks computed different bucket assignments (every rank must pack the same \
                 parameters into the same buckets, in the same order); this rank's: {assignment:?}"
            )));
        }
        tch::no_grad(|| params.iter_mut().try_for_each(|p| pg.broadcast(p, 0)))?;
        let buckets = assignment
            .into_iter()
            .map(|idx| {
                let mut offsets = Vec::with_capacity(idx.len());
                let mut n = 0i64;
                for &i in &idx {
                    offsets.push(n);
                    n += params[i].numel() as i64;
                }
                let ready_stage = idx.iter().map(|&i| stages[i]).min().unwrap_or(0);
                Bucket { params: idx, offsets, numel: n, ready_stage }
            })
            .collect();
        Ok(DdpBucketed {
            pg,
            model,
            params,
            buckets,
            require_sync: true,
            unsynced: false,
            stats: DdpStats::default(),
            checkpointing: Checkpointing::None,
            peak_transient: 0,
        })
    }

    /// Parameter indices of each bucket, in the order they are reduced (for [`assign_buckets`]:
    /// reverse registration order).
    pub fn bucket_params(&self) -> Vec<Vec<usize>> {
        self.buckets.iter().map(|b| b.params.clone()).collect()
    }
}

impl DataParallel for DdpBucketed<'_> {
    fn model(&self) -> &dyn Model {
        &*self.model
    }
    fn group(&self) -> &ProcessGroup {
        self.pg
    }
    fn backward(&mut self, batch: &Batch, scale: f64) -> CommResult<f64> {
        let DdpBucketed { pg, model, params, buckets, require_sync, unsynced, stats, checkpointing, peak_transient } =
            self;
        let sync = *require_sync;
        // Until this backward has finished (and averaged, if it syncs), a step would be wrong:
        // a failure below leaves gradients partly accumulated or averaged.
        *unsynced = true;
        let mut works: Vec<(usize, Work<Tensor>)> = Vec::new();
        let mut err = None;
        let t0 = Instant::now();
        let mut hooks = AccumulateGrads::new(params, |stage| {
            if !sync || err.is_some() {
                return Ok(());
            }
            for (bi, b) in buckets.iter_mut().enumerate().filter(|(_, b)| b.ready_stage == stage) {
                let dev = b.params.first().map_or(tch::Device::Cpu, |&i| params[i].device());
                let flat = flat_buffer(b.numel, dev); // every element is written below
                let g = grads(&b.params.iter().map(|&i| params[i].shallow_clone()).collect::<Vec<_>>());
                for (g, &off) in g.iter().zip(&b.offsets) {
                    flat.narrow(0, off, g.numel() as i64).copy_(&g.view([-1]));
                }
                // The bucket's buffer travels with the Work and comes back from `wait`.
                match pg.all_reduce_async(flat, ReduceOp::Avg) {
                    Ok(w) => works.push((bi, w)),
                    Err(e) => {
                        // Finish the backward (no collective is left half-started), then fail.
                        err = Some(e);
                        return Ok(());
                    }
                }
            }
            Ok(())
        });
        let loss = forward_backward(&**model, params, batch, scale, *checkpointing, &mut hooks);
        drop(hooks);
        let loss = loss?;
        stats.compute_s += t0.elapsed().as_secs_f64();
        if !sync {
            return Ok(loss); // still unsynced: the gradients are local sums
        }
        // Wait for every started all-reduce even after an error, so no buffer is still in flight.
        let t1 = Instant::now();
        let mut results = Vec::new();
        for (bi, w) in works {
            results.push((bi, w.wait_timed()));
        }
        stats.exposed_s += t1.elapsed().as_secs_f64();
        if let Some(e) = err {
            return Err(e);
        }
        let mut in_flight = 0;
        for (bi, r) in results {
            let (flat, t) = r?;
            stats.comm_s += (t.finished - t.started).as_secs_f64();
            let b = &buckets[bi];
            for (&i, &off) in b.params.iter().zip(&b.offsets) {
                let mut g = params[i].grad();
                g.copy_(&flat.narrow(0, off, g.numel() as i64).view_as(&g));
            }
            stats.bytes += (flat.numel() * 4) as u64;
            in_flight += held_bytes([&flat]);
            // Not kept between steps: the next backward allocates it again (freed memory is
            // reused, see launch::keep_freed_memory), so between steps DDP holds Ψ·4 of gradients.
            drop(flat);
        }
        *peak_transient = (*peak_transient).max(in_flight);
        stats.syncs += 1;
        *unsynced = false;
        Ok(loss)
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
    /// As every replicated strategy (the full model and its `.grad`s), plus the flat buckets'
    /// peak during backward as transient memory: they are not kept between steps.
    fn memory(&self, opt: &dyn Optimizer) -> MemoryStats {
        let grads: Vec<Tensor> = self.params.iter().map(|p| p.grad()).collect();
        MemoryStats {
            params: held_bytes(&self.params),
            grads: held_bytes(&grads),
            optim: opt.state_bytes(),
            peak_transient: self.peak_transient,
            offloaded: 0,
        }
    }
}

/// A bucket's flat gradients, on the parameters' device (uninitialised: every element is copied in).
fn flat_buffer(n: i64, device: tch::Device) -> Tensor {
    Tensor::empty([n], (Kind::Float, device))
}
