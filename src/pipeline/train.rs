//! One optimizer step of a pipeline rank (lesson 13): [`pipeline_step`] on its replica's rows,
//! then [`apply_step`] — its gradients averaged over its dp column, then the one optimizer step
//! ([`optimizer_step`]: the pipeline's global norm, agreed non-finite checks, clipping, AdamW on
//! what the rank holds). [`params_of_ranks`] says which parameters each pipeline rank holds. The
//! tied embedding lives on the first and the last rank, gets the same summed gradient on both and
//! so stays the same.
//!
//! The run loop of `train --pp` (the mesh, the data, what is not combined with it yet) is
//! `crate::job::pipeline_run`.

use super::{partition, pipeline_step, PipelineConfig, PipelineStep};
use crate::comm::{CommError, CommResult, ProcessGroup, ReduceOp};
use crate::model::{Batch, Gpt, GptConfig, Model};
use crate::optim::{optimizer_step, Decay, Held, NonFinite, Optimizer};
use tch::Tensor;

/// Which parameters (by index in the GPT's `named_parameters`) each of `p` pipeline ranks uses:
/// those of its stages, the tied embedding on the first and the last rank.
pub fn params_of_ranks(cfg: &GptConfig, p: usize) -> Result<Vec<Vec<usize>>, String> {
    let uses = Gpt::stage_uses_of(cfg);
    let parts = partition(uses.len(), p)?;
    Ok(parts
        .into_iter()
        .map(|r| {
            let mut v: Vec<usize> = r.flat_map(|s| uses[s].iter().copied()).collect();
            v.sort_unstable();
            v.dedup();
            v
        })
        .collect())
}

/// One optimizer step of a pipeline rank: [`pipeline_step`] over `pp` on this replica's `batch`,
/// then [`apply_step`]. Returns the step (loss: the replicas' mean, as DDP's: the global batch's
/// mean when every replica's rows hold as many targets) and the norm before clipping. An error on
/// one rank aborts both groups, so that no rank waits in a collective for it and no rank steps
/// alone; a step every rank refused together (a non-finite gradient anywhere) leaves them usable.
#[allow(clippy::too_many_arguments)]
pub fn train_step(
    pp: &ProcessGroup,
    dp: Option<&ProcessGroup>,
    model: &Gpt,
    cfg: &PipelineConfig,
    opt: &mut dyn Optimizer,
    lr: f64,
    grad_clip: Option<f64>,
    batch: &Batch,
) -> CommResult<(PipelineStep, f64)> {
    let c = model.cfg.n_embd;
    let step =
        pipeline_step(pp, model, cfg.schedule, batch, cfg.micro_batches, c).map_err(|e| abort_both(pp, dp, e))?;
    apply_step(pp, dp, model, step, opt, lr, grad_clip)
}

/// Abort `pp` and `dp` with `e` (so no rank waits for this one), returned as this rank's error.
fn abort_both(pp: &ProcessGroup, dp: Option<&ProcessGroup>, e: CommError) -> CommError {
    let m = format!("rank {}: pipeline train step: {e}", pp.rank());
    pp.abort(&m);
    if let Some(dp) = dp {
        dp.abort(&m);
    }
    CommError::InvalidArgument(m)
}

/// The optimizer step after a [`pipeline_step`]: with `dp`, the gradients (and the loss) averaged
/// over the data-parallel group; then [`optimizer_step`] over dp × pp — the global norm over the
/// whole pipeline (each tied parameter counted once, on the first replica), agreed non-finite
/// checks, clipping to `grad_clip`, `opt` on the parameters this rank holds (by index, ascending).
/// The returned step's gradients are cleared (zero) after the update, as every layout's are; their
/// bytes are what the rank held for the step.
pub fn apply_step(
    pp: &ProcessGroup,
    dp: Option<&ProcessGroup>,
    model: &Gpt,
    mut step: PipelineStep,
    opt: &mut dyn Optimizer,
    lr: f64,
    grad_clip: Option<f64>,
) -> CommResult<(PipelineStep, f64)> {
    let fail = |e: CommError| abort_both(pp, dp, e);
    let all = model.parameters();
    let owned = params_of_ranks(&model.cfg, pp.world_size()).map_err(|e| fail(CommError::InvalidArgument(e)))?;
    let (idx, mut grads): (Vec<usize>, Vec<Tensor>) = std::mem::take(&mut step.grads).into_iter().unzip();
    if let Some(dp) = dp {
        let n = dp.world_size() as f64;
        // grads: this rank's stages' parameters, averaged over dp (bucketing would group them).
        for g in &mut grads {
            dp.all_reduce(g, ReduceOp::Sum).map_err(fail)?;
            let _ = g.g_div_scalar_(n);
        }
        let mut l = Tensor::from_slice(&[step.loss]);
        dp.all_reduce(&mut l, ReduceOp::Sum).map_err(fail)?;
        step.loss = l.double_value(&[0]) / n;
    }
    // Counted in the global norm: a parameter on the lowest pipeline rank using it (the tied
    // embedding once), on the first replica (the dp-averaged gradients are the same on all).
    let lowest = |k: usize| owned.iter().position(|o| o.contains(&k));
    let first_replica = dp.is_none_or(|d| d.rank() == 0);
    let counted = idx.iter().map(|&k| first_replica && lowest(k) == Some(pp.rank())).collect();
    let params: Vec<Tensor> = idx.iter().map(|&k| all[k].shallow_clone()).collect();
    let decay: Vec<Decay> = params.iter().map(|p| Decay::for_shape(&p.size())).collect();
    let held = Held { params, grads, decay, counted };
    let dims: Vec<&ProcessGroup> = dp.into_iter().chain([pp]).collect();
    // A refusal every rank agreed on (CommError::Step) leaves the groups usable; anything else aborts them.
    let norm = optimizer_step(&dims, opt, &held, lr, grad_clip, NonFinite::Fail, None)
        .map_err(|e| if matches!(e, CommError::Step(_)) { e } else { fail(e) })?
        .norm;
    step.grads = idx.into_iter().zip(held.grads).collect();
    Ok((step, norm))
}
