//! The engine of one rank: its mesh, its piece, the data dimension's wrapper, and the one training
//! step ([`Engine::train_step`] = [`forward_backward`](Engine::forward_backward) then
//! [`apply`](Engine::apply)); [`parallelize`] builds it from a layout and a GPT.

use super::{DataDim, ParallelDims, Piece, PieceStep, PipelinePiece, Plan, TpPipelinePiece};
use crate::comm::{CommError, CommResult, DeviceMesh, ProcessGroup, ReduceOp};
use crate::memory::{held_bytes, MemoryStats};
use crate::model::{Batch, Gpt, GptConfig};
use crate::optim::{optimizer_step, Decay, Held, NonFinite, Optimizer};
use crate::precision::Precision;
use crate::stages::Checkpointing;
use crate::tp::TpGpt;
use crate::zero::ShardedTensors;
use tch::Tensor;

/// The mesh's groups outermost first (pp, dp, tp): a rank's row-major index over them is its
/// global rank.
pub(super) fn groups(mesh: &DeviceMesh) -> [&ProcessGroup; 3] {
    [mesh.group("pp"), mesh.group("dp"), mesh.group("tp")]
}

/// Abort every group of the mesh with `e` (so no rank waits in a collective for this one),
/// returned as this rank's error.
fn abort(mesh: &DeviceMesh, e: CommError) -> CommError {
    let g = groups(mesh);
    let rank = g.iter().fold(0, |acc, g| acc * g.world_size() + g.rank());
    let m = format!("rank {rank}: train step: {e}");
    g.iter().for_each(|g| g.abort(&m));
    CommError::InvalidArgument(m)
}

/// One rank's engine (see the module docs of [`crate::engine`]).
pub struct Engine {
    pub dims: ParallelDims,
    /// The whole model's configuration.
    pub(super) cfg: GptConfig,
    pub(super) mesh: DeviceMesh,
    pub(super) piece: Box<dyn Piece>,
    /// ZeRO over dp; `None`: DDP.
    pub(super) shards: Option<ShardedTensors>,
    /// DDP: bytes of the last step's gradients (they live only during a step), measured.
    last_grad_bytes: u64,
    /// ZeRO-3: bytes of the piece's parameters gathered for the last step.
    gathered: u64,
    /// The most bytes a step held besides what is kept between steps (ZeRO: the piece's
    /// gradients with the gathered parameters, or with the flat copy reduced from), measured.
    peak_transient: u64,
}

/// What one step gives, the same on every rank.
#[derive(Clone, Copy, Debug)]
pub struct Trained {
    /// The global batch's mean loss (the replicas' means averaged).
    pub loss: f64,
    /// The global gradient norm before clipping.
    pub norm: f64,
    /// Under pipeline parallelism, this rank's bubble and peak micro-batches held.
    pub pipeline: Option<(f64, usize)>,
}

/// Lay out `pg`'s ranks as `plan.dims`, build this rank's piece of the GPT (`cfg`) and wrap it for
/// `plan.data`.
/// `build(keep)` gives the GPT with (at least) the parameters `keep` accepts materialised — every
/// rank builds from the same seed, so the pieces fit together. An error is the same on every
/// rank (it depends only on the arguments) or aborts the mesh.
pub fn parallelize(
    pg: &ProcessGroup,
    plan: &Plan,
    cfg: &GptConfig,
    build: &dyn Fn(&dyn Fn(usize) -> bool) -> anyhow::Result<Gpt>,
) -> anyhow::Result<Engine> {
    let Plan { dims, data, sequence_parallel, pipeline, activation_checkpointing: ac, precision } = *plan;
    anyhow::ensure!(
        matches!(precision, Precision::Fp32 | Precision::Bf16),
        "the engine computes in fp32 or bf16 (autocast), not {precision:?}: fp16 needs a loss scaler (use bf16)"
    );
    // Every rank builds its GPT from the same seed, in the plan's precision (a GPT built in
    // another is a contradiction, not something to overwrite).
    let build = |keep: &dyn Fn(usize) -> bool| -> anyhow::Result<Gpt> {
        let g = build(keep)?;
        let p = crate::model::Model::precision(&g);
        anyhow::ensure!(
            p == Precision::Fp32 || p == precision,
            "the GPT was built to compute in {p:?}, the plan says {precision:?}"
        );
        Ok(g.with_precision(precision))
    };
    anyhow::ensure!(
        dims.world() == pg.world_size(),
        "the layout {dims:?} has {} ranks, the group {}",
        dims.world(),
        pg.world_size()
    );
    anyhow::ensure!(
        !sequence_parallel || dims.tp > 1,
        "sequence parallelism splits over the tensor-parallel group: it needs tensor_parallel > 1 (--tp)"
    );
    anyhow::ensure!(
        dims.pp == 1 || pipeline.stages == dims.pp,
        "the pipeline config has {} stages, the layout {}",
        pipeline.stages,
        dims.pp
    );
    anyhow::ensure!(
        dims.tp > 1 || dims.pp == 1 || matches!(ac, Checkpointing::None | Checkpointing::Full),
        "--activation-checkpointing {ac} with --pp: a pipeline rank recomputes its stages whole (full) or not at all \
         (none); with --tp too, its blocks by the policy"
    );
    // A tensor-parallel block is recomputed by the policy (stage l + 1 of the GPT's L + 2).
    let n_stages = cfg.n_layer as usize + 2;
    let recompute_block = |l: usize| ac.recomputes(l + 1, n_stages);
    let mesh = dims.mesh(pg)?;
    // From here an error on one rank (a weights file it cannot read, say) aborts the mesh, so
    // that no other rank waits for it in the broadcasts below or in the first step.
    let built = (|| -> anyhow::Result<(Box<dyn Piece>, Option<ShardedTensors>)> {
        let piece: Box<dyn Piece> = if dims.pp > 1 && dims.tp > 1 {
            // 3-D: this pipeline rank's stages, split over its tensor-parallel group.
            let owned = crate::pipeline::train::params_of_ranks(cfg, dims.pp).map_err(anyhow::Error::msg)?;
            let mine = owned[mesh.coord("pp")].clone();
            let gpt = build(&|k| mine.binary_search(&k).is_ok())?;
            let (pp, tp) = (mesh.coord("pp"), mesh.group("tp"));
            let piece = TpPipelinePiece::new(&gpt, pipeline, pp, tp, sequence_parallel, &recompute_block)
                .map_err(|e| anyhow::anyhow!("--tp {} with --pp {}: {e}", dims.tp, dims.pp))?;
            Box::new(piece)
        } else if dims.pp > 1 {
            let owned = crate::pipeline::train::params_of_ranks(cfg, dims.pp).map_err(anyhow::Error::msg)?;
            let mine = owned[mesh.coord("pp")].clone();
            let gpt = build(&|k| mine.binary_search(&k).is_ok())?;
            let piece = PipelinePiece::new(gpt, pipeline, mesh.coord("pp")).map_err(anyhow::Error::msg)?;
            Box::new(piece.recompute(ac == Checkpointing::Full))
        } else {
            let full = build(&|_| true)?;
            let m = TpGpt::from_gpt(&full, mesh.group("tp")).map_err(|e| anyhow::anyhow!("--tp {}: {e}", dims.tp))?;
            Box::new(m.with_sequence_parallel(sequence_parallel).recompute_blocks(recompute_block))
        };
        let shards = match data {
            DataDim::Replicate => None,
            DataDim::Zero(stage) => {
                Some(ShardedTensors::new(mesh.group("dp"), piece.params(), &piece.units(&mesh), stage)?)
            }
        };
        Ok((piece, shards))
    })();
    let (piece, shards) = match built {
        Ok(b) => b,
        Err(e) => {
            let e = abort(&mesh, CommError::InvalidArgument(format!("{e:#}")));
            return Err(anyhow::Error::new(e));
        }
    };
    Ok(Engine { dims, cfg: *cfg, mesh, piece, shards, last_grad_bytes: 0, gathered: 0, peak_transient: 0 })
}

impl Engine {
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }
    /// The mesh alone: the piece, its shards and buffers dropped (the communicators, with their
    /// own buffers, kept).
    pub fn into_mesh(self) -> DeviceMesh {
        self.mesh
    }
    pub fn piece(&self) -> &dyn Piece {
        &*self.piece
    }
    /// The piece's forward and backward on this replica's `batch` (ZeRO-3: between a gather of its
    /// parameters and their release). An error aborts the mesh.
    pub fn forward_backward(&mut self, batch: &Batch) -> CommResult<PieceStep> {
        self.forward_backward_accum(batch, 1)
    }

    /// [`forward_backward`](Self::forward_backward) with gradient accumulation: `batch` cut into
    /// `accum` micro-batches ([`micro_batches`](crate::ddp::micro_batches): sizes differ by at most
    /// one row), each run through the piece, its loss and gradients weighted by its share of the
    /// rows and summed — the data-parallel strategies' rule ([`crate::ddp::train_step`]). ZeRO-3
    /// gathers the parameters once for all of them.
    pub fn forward_backward_accum(&mut self, batch: &Batch, accum: i64) -> CommResult<PieceStep> {
        let dp = self.mesh.group("dp");
        let rows = batch.len();
        if accum < 1 || accum > rows {
            // The same arguments on every rank: the same error, nothing started.
            return Err(CommError::InvalidArgument(format!(
                "gradient accumulation over {accum} micro-batches needs 1..={rows} (the rows of this replica's batch)"
            )));
        }
        let mut run = || {
            if let Some(s) = self.shards.as_mut() {
                self.gathered = s.gather(dp)?;
            }
            let mut total: Option<PieceStep> = None;
            for (lo, hi) in crate::ddp::micro_batches(rows, accum) {
                let share = (hi - lo) as f64 / rows as f64;
                let part = self.piece.forward_backward(&self.mesh, &batch.rows(lo, hi))?;
                total = Some(match total {
                    None if accum == 1 => part,
                    None => PieceStep {
                        loss: part.loss * share,
                        grads: part.grads.into_iter().map(|g| g * share).collect(),
                        pipeline: part.pipeline,
                    },
                    Some(mut t) => {
                        t.loss += part.loss * share;
                        t.grads.iter_mut().zip(&part.grads).for_each(|(a, g)| _ = a.g_add_(&(g * share)));
                        t.pipeline = match (t.pipeline, part.pipeline) {
                            (Some((b, p)), Some((b2, p2))) => Some((b.max(b2), p.max(p2))),
                            (a, b) => a.or(b),
                        };
                        t
                    }
                });
            }
            Ok(total.expect("at least one micro-batch"))
        };
        let r = run();
        if let Some(s) = self.shards.as_mut() {
            s.release();
        }
        r.map_err(|e| abort(&self.mesh, e))
    }

    /// The step after [`forward_backward`](Self::forward_backward): the loss and the gradients
    /// averaged over dp (DDP: all-reduced; ZeRO: reduce-scattered into this rank's shards), then
    /// [`optimizer_step`] over pp × dp × tp, then (ZeRO-1/2) the updated shards all-gathered. A
    /// step every rank refused together (a non-finite gradient anywhere) is an error that leaves
    /// the engine usable; any other error aborts the mesh.
    pub fn apply(
        &mut self,
        step: PieceStep,
        opt: &mut dyn Optimizer,
        lr: f64,
        clip: Option<f64>,
    ) -> CommResult<Trained> {
        let PieceStep { loss, mut grads, pipeline } = step;
        let dp = self.mesh.group("dp");
        let n = dp.world_size() as f64;
        let mut l = Tensor::from_slice(&[loss]);
        if n > 1.0 {
            dp.all_reduce(&mut l, ReduceOp::Sum).map_err(|e| abort(&self.mesh, e))?;
        }
        let loss = l.double_value(&[0]) / n;
        let held = match self.shards.as_mut() {
            None => {
                if n > 1.0 {
                    crate::ddp::average_gradients(dp, &mut grads).map_err(|e| abort(&self.mesh, e))?;
                }
                self.last_grad_bytes = held_bytes(grads.iter());
                // Counted on the first replica: the averaged gradients are the same on all.
                let first = dp.rank() == 0;
                let counted = self.piece.counted(&self.mesh).into_iter().map(|c| c && first).collect();
                let params = self.piece.params();
                let decay = params.iter().map(|p| Decay::for_shape(&p.size())).collect();
                Held { params, grads, decay, counted }
            }
            Some(s) => {
                let grad_bytes = held_bytes(grads.iter());
                let r = s.reduce(dp, &grads);
                drop(grads);
                let flat = r.map_err(|e| abort(&self.mesh, e))?;
                let peak = grad_bytes + flat.max(self.gathered);
                self.peak_transient = self.peak_transient.max(peak);
                s.held()
            }
        };
        let stepped = optimizer_step(&groups(&self.mesh), opt, &held, lr, clip, NonFinite::Fail, None)
            .map_err(|e| if matches!(e, CommError::Step(_)) { e } else { abort(&self.mesh, e) })?;
        if let Some(s) = self.shards.as_mut() {
            s.updated(dp).map_err(|e| abort(&self.mesh, e))?;
        }
        Ok(Trained { loss, norm: stepped.norm, pipeline })
    }

    /// The mean loss of the global batch whose replica rows are `batch`, with no update
    /// (evaluation): the piece's forward and backward as in training
    /// ([`forward_backward_accum`](Self::forward_backward_accum), ZeRO-3's gathers included), the
    /// gradients dropped, the loss averaged over dp. Pieces have no forward-only schedule yet (a
    /// pipeline's would be a schedule of its own), so an evaluation costs what a step's forward
    /// and backward cost; nothing the rank holds changes.
    pub fn eval_loss(&mut self, batch: &Batch, accum: i64) -> CommResult<f64> {
        let step = self.forward_backward_accum(batch, accum)?;
        let dp = self.mesh.group("dp");
        let mut l = Tensor::from_slice(&[step.loss]);
        if dp.world_size() > 1 {
            dp.all_reduce(&mut l, ReduceOp::Avg).map_err(|e| abort(&self.mesh, e))?;
        }
        Ok(l.double_value(&[0]))
    }

    /// One training step with `accum` micro-batches of gradient accumulation:
    /// [`forward_backward_accum`](Self::forward_backward_accum), then [`apply`](Self::apply).
    pub fn train_step_accum(
        &mut self,
        batch: &Batch,
        accum: i64,
        opt: &mut dyn Optimizer,
        lr: f64,
        clip: Option<f64>,
    ) -> CommResult<Trained> {
        let step = self.forward_backward_accum(batch, accum)?;
        self.apply(step, opt, lr, clip)
    }

    /// One training step: [`forward_backward`](Self::forward_backward), then [`apply`](Self::apply).
    pub fn train_step(
        &mut self,
        batch: &Batch,
        opt: &mut dyn Optimizer,
        lr: f64,
        clip: Option<f64>,
    ) -> CommResult<Trained> {
        let step = self.forward_backward(batch)?;
        self.apply(step, opt, lr, clip)
    }

    /// The whole model's parameters (the GPT's order) on the first replica's ranks that gather
    /// them (every tensor-parallel rank, pipeline rank 0; always global rank 0), `None` on the
    /// others: a collective over the mesh (ZeRO-3 gathers its shards first).
    pub fn full_parameters(&mut self) -> CommResult<Option<Vec<Tensor>>> {
        let dp = self.mesh.group("dp");
        let r = (|| {
            if let Some(s) = self.shards.as_mut() {
                s.gather(dp)?;
            }
            if dp.rank() == 0 {
                self.piece.gather_whole(&self.mesh)
            } else {
                Ok(None)
            }
        })();
        if let Some(s) = self.shards.as_mut() {
            s.release();
        }
        // A rank that failed aborts at once (a peer may wait on it in a receive).
        let r = r.map_err(|e| abort(&self.mesh, e));
        // Every rank learns whether every rank got through (a rank that sent its part and left
        // would not see the gatherer fail).
        let failed = Tensor::from_slice(&[r.is_err() as u8 as f64]);
        let anyone =
            groups(&self.mesh).iter().try_fold(failed, |mut t, g| g.all_reduce(&mut t, ReduceOp::Sum).map(|_| t));
        match (r, anyone) {
            (Err(e), _) => Err(e),
            (Ok(_), Err(e)) => Err(abort(&self.mesh, e)),
            (Ok(_), Ok(n)) if n.double_value(&[0]) > 0.0 => Err(CommError::Protocol(
                "another rank failed while gathering the whole model; nothing was written".into(),
            )),
            (Ok(full), Ok(_)) => Ok(full),
        }
    }

    /// Bytes this rank holds between steps, from its tensors: the piece's parameters (ZeRO: its
    /// full buffers and master shards), its gradients (DDP: the last step's, which live during a
    /// step; ZeRO: the kept flat gradients and the shards) and `opt`'s state; and (ZeRO) the
    /// transient peak of a step: the piece's gradients, which its backward gives all at once, with
    /// the parameters gathered for it (stage 3) or the flat copy reduced from (stages 2–3).
    pub fn memory(&self, opt: &dyn Optimizer) -> MemoryStats {
        let (params, grads) = match &self.shards {
            Some(s) => s.held_bytes(),
            None => (held_bytes(self.piece.params().iter()), self.last_grad_bytes),
        };
        MemoryStats { params, grads, optim: opt.state_bytes(), peak_transient: self.peak_transient, offloaded: 0 }
    }

    /// What the optimizer steps on this rank: the piece's parameters (DDP) or its master shards
    /// (ZeRO) — handles.
    pub fn masters(&self) -> Vec<Tensor> {
        match &self.shards {
            Some(s) => s.held().params,
            None => self.piece.params(),
        }
    }

    /// The gradient buffers the engine keeps between steps (ZeRO: the shards, stage 1's flat
    /// gradients; DDP: none — a step's gradients are the [`PieceStep`]'s).
    pub fn kept_grads(&self) -> Vec<Tensor> {
        self.shards.as_ref().map_or_else(Vec::new, |s| s.kept_grads())
    }

    /// Bytes this rank has sent over the mesh's groups so far.
    pub fn bytes_sent(&self) -> u64 {
        groups(&self.mesh).iter().map(|g| g.stats().bytes_sent).sum()
    }
}
