//! Periodic evaluation of a training job (nanoGPT's `estimate_loss`): every `interval` steps, the
//! mean loss over `iters` batches of each split, `train` and `val` (held-out text the model never
//! trains on), with no update; and the checkpoint of the best val loss kept (nanoGPT's
//! `always_save_checkpoint = False`).
//!
//! The batches: `iters` global batches per split, each the training step's global batch size
//! (`batch_size` × ranks rows of `block_size`), drawn by a [`DistributedSampler`] of their own
//! seed — the same batches at every evaluation and under every layout, so that two evaluations
//! (and two layouts) differ only by the weights. (nanoGPT draws fresh ones each time; fixed
//! batches take the sampling noise out of the comparison between evaluations.) Every replica
//! computes the loss of its rows; the mean over the replicas is the global batch's.
//!
//! When: before the step of every multiple of `interval` (step 0 included: the untrained model)
//! and after the last step, so a run's final val loss is always known. A point's `step` is the
//! number of updates the weights have had.

use super::GptJob;
use crate::comm::{CommResult, ReduceOp};
use crate::data::{DistributedSampler, Tokens};
use crate::model::Batch;
use serde::{Deserialize, Serialize};
use std::time::Instant;
use tch::Tensor;

/// How often and how long a job evaluates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EvalConfig {
    /// Steps between evaluations (nanoGPT's `eval_interval`); 0: never.
    pub interval: u64,
    /// Batches per split per evaluation (nanoGPT's `eval_iters`).
    pub iters: usize,
}

/// One evaluation: the mean losses of both splits after `step` updates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EvalPoint {
    pub step: u64,
    pub train_loss: f64,
    pub val_loss: f64,
    /// Wall-clock seconds the evaluation took (rank 0).
    pub seconds: f64,
    /// Wall-clock seconds from the run's start to the end of this evaluation (rank 0; training,
    /// evaluations and checkpoints included).
    #[serde(default)]
    pub elapsed_s: f64,
}

/// Seeds of the evaluation batches, apart from the training batches' (`job.seed`).
const TRAIN_SALT: u64 = 0x6576_616c_7472_6e31;
const VAL_SALT: u64 = 0x6576_616c_7661_6c31;

impl EvalConfig {
    pub fn enabled(&self) -> bool {
        self.interval > 0
    }
    /// The job's evaluation against its data, before any worker starts.
    pub fn check(&self, job: &GptJob) -> anyhow::Result<()> {
        if !self.enabled() {
            return Ok(());
        }
        anyhow::ensure!(self.iters >= 1, "--eval-iters must be at least 1 to evaluate every {} steps", self.interval);
        let val = job.data.load_val()?.ok_or_else(|| {
            anyhow::anyhow!(
                "evaluation needs a held-out split: --data a folder with train.bin and val.bin (`cargo run --release \
                 --bin data -- shakespeare`), or the synthetic corpus; a single token file has none"
            )
        })?;
        val.check(job.model.vocab_size, job.model.block_size).map_err(|e| anyhow::anyhow!("the val split: {e}"))
    }
}

/// A rank's evaluator: both splits' tokens and samplers.
pub struct Evaluator {
    cfg: EvalConfig,
    val: Tokens,
    samplers: [DistributedSampler; 2],
    /// Every evaluation so far (this run).
    pub points: Vec<EvalPoint>,
    /// The lowest val loss so far, this run's or the resumed checkpoint's ([`Self::carry_best`]).
    pub best: f64,
    /// The step of [`Self::best`] (`None` before the first evaluation, or carried from a
    /// checkpoint that did not record it).
    pub best_step: Option<u64>,
    /// When this rank's evaluator was made (the run's start, for `elapsed_s`).
    started: Instant,
}

impl Evaluator {
    /// The evaluator of replica `replica` of `replicas` (`None` when the job does not evaluate).
    pub fn new(job: &GptJob, replica: usize, replicas: usize, world: usize) -> anyhow::Result<Option<Evaluator>> {
        if !job.eval.enabled() {
            return Ok(None);
        }
        let val = job.data.load_val()?.ok_or_else(|| anyhow::anyhow!("the data has no val split"))?;
        let t = job.model.block_size as usize;
        let rows = job.batch_size * world;
        let sampler = |salt: u64| DistributedSampler::new(t, rows, replica, replicas, job.seed ^ salt);
        Ok(Some(Evaluator {
            cfg: job.eval,
            val,
            samplers: [sampler(TRAIN_SALT)?, sampler(VAL_SALT)?],
            points: Vec::new(),
            best: f64::INFINITY,
            best_step: None,
            started: Instant::now(),
        }))
    }

    /// Carry the best val loss on from a resumed checkpoint's `extra` (its `best_val_loss` and
    /// `best_step`) — unless it would compare unlike with unlike, or describe a `best/` that is
    /// not there: the checkpoint's evaluations averaged another number of batches (another
    /// estimator), or `CHECKPOINT_DIR/best` holds another step than the checkpoint's best (a run
    /// resumed from before a later best of another timeline, a folder reused). Then the run starts
    /// its best afresh, and its first evaluation after step 0 replaces `best/`; `note` says so on
    /// standard error. A checkpoint without `best_step` (older) carries its best as before.
    pub fn carry_best(
        &mut self,
        extra: Option<&serde_json::Value>,
        dir: Option<&std::path::Path>,
        note: bool,
    ) -> anyhow::Result<()> {
        let Some(extra) = extra else { return Ok(()) };
        let Some(best) = extra.get("best_val_loss").and_then(|v| v.as_f64()) else { return Ok(()) };
        let step = extra.get("best_step").and_then(|v| v.as_u64());
        let iters = extra.pointer("/job/eval/iters").and_then(|v| v.as_u64());
        let why = if iters.is_some_and(|i| i != self.cfg.iters as u64) {
            Some(format!("its evaluations averaged {} batches, this run's {}", iters.unwrap_or(0), self.cfg.iters))
        } else {
            let on_disk = match dir {
                Some(d) => crate::checkpoint::try_committed(&best_dir(d))?.last().map(|(s, _)| *s),
                None => step,
            };
            match (step, on_disk) {
                (Some(s), Some(d)) if s != d => {
                    Some(format!("best/ holds step {d}, not the checkpoint's best, step {s}"))
                }
                (Some(s), None) => Some(format!("best/ does not hold the checkpoint's best, step {s}")),
                _ => None,
            }
        };
        match why {
            None => (self.best, self.best_step) = (best, step),
            Some(why) if note => eprintln!(
                "note: the resumed checkpoint's best val loss ({best:.4}) is not carried on ({why}); this run's \
                 first evaluation after step 0 takes best/"
            ),
            Some(_) => {}
        }
        Ok(())
    }

    /// Whether to evaluate before step `step` of a run of `steps` (`step == steps`: after the last).
    pub fn due(&self, step: u64, steps: u64) -> bool {
        step % self.cfg.interval == 0 || step == steps
    }

    /// Both splits' mean loss after `step` updates: `loss_of` gives the global mean loss of one
    /// global batch (this replica's rows passed; a collective). Records the point; returns it and
    /// whether its val loss is the best so far.
    pub fn evaluate(
        &mut self,
        step: u64,
        train: &Tokens,
        mut loss_of: impl FnMut(&Batch) -> CommResult<f64>,
    ) -> anyhow::Result<(EvalPoint, bool)> {
        let t0 = Instant::now();
        let mut mean = |split: usize, data: &Tokens| -> anyhow::Result<f64> {
            let mut sum = 0.0;
            for k in 0..self.cfg.iters {
                let batch = self.samplers[split].batch(data, k as u64);
                sum += loss_of(&batch).map_err(|e| anyhow::anyhow!("evaluating after step {step}: {e}"))?;
            }
            Ok(sum / self.cfg.iters as f64)
        };
        let train_loss = mean(0, train)?;
        let val_loss = mean(1, &self.val);
        let p = EvalPoint {
            step,
            train_loss,
            val_loss: val_loss?,
            seconds: t0.elapsed().as_secs_f64(),
            elapsed_s: self.started.elapsed().as_secs_f64(),
        };
        // The same numbers on every rank (averaged by one all-reduce), so every rank stops here.
        anyhow::ensure!(
            p.train_loss.is_finite() && p.val_loss.is_finite(),
            "the evaluation after step {step} gave train loss {} and val loss {}: the weights have diverged",
            p.train_loss,
            p.val_loss
        );
        // Every rank holds the same val loss (the result of the same all-reduce, bitwise: the
        // collectives' results are copies of one reduction), so every rank decides alike and
        // enters the best checkpoint's save, a collective, together.
        let best = p.val_loss < self.best;
        if best {
            self.best = p.val_loss;
            self.best_step = Some(step);
        }
        self.points.push(p);
        Ok((p, best))
    }

    /// The report line of an evaluation (`--json`); `elapsed_s`: wall seconds since the run's
    /// start, evaluations and checkpoints included (the clock a "val loss after 10 minutes" reads).
    pub fn line(&self, p: &EvalPoint) -> serde_json::Value {
        serde_json::json!({"eval_step": p.step, "train_loss": p.train_loss, "val_loss": p.val_loss,
                           "best_val_loss": self.best, "eval_s": p.seconds,
                           "elapsed_s": p.elapsed_s})
    }
}

/// The global mean loss of one global batch under a data-parallel strategy: this rank's rows'
/// forward alone ([`DataParallel::eval_loss`](crate::ddp::DataParallel::eval_loss)) in the
/// training step's `accum` micro-batches (so an evaluation holds no more activations than a
/// step), weighted by their share of the rows, averaged over the group (equal rows per rank).
pub fn data_parallel_loss(dp: &mut dyn crate::ddp::DataParallel, batch: &Batch, accum: i64) -> CommResult<f64> {
    let rows = batch.len();
    let mut local = 0.0;
    for (lo, hi) in crate::ddp::micro_batches(rows, accum.clamp(1, rows.max(1))) {
        local += dp.eval_loss(&batch.rows(lo, hi))? * (hi - lo) as f64 / rows as f64;
    }
    let mut l = Tensor::from_slice(&[local]);
    dp.group().all_reduce(&mut l, ReduceOp::Avg)?;
    Ok(l.double_value(&[0]))
}

/// Where the checkpoint of the best val loss goes: `best/` inside the job's checkpoint folder (a
/// checkpoint folder of its own, holding one step).
pub fn best_dir(dir: &std::path::Path) -> std::path::PathBuf {
    dir.join("best")
}

/// Save the checkpoint of a new best val loss (after `step` updates) into [`best_dir`], replacing
/// the one before: a collective, as every save.
pub fn save_best<H: crate::checkpoint::Holder + ?Sized>(
    h: &H,
    opt: &crate::optim::AdamW,
    dir: &std::path::Path,
    step: u64,
    extra: serde_json::Value,
) -> anyhow::Result<crate::checkpoint::Report> {
    let opts = crate::checkpoint::SaveOptions { keep_last: Some(1), ..Default::default() };
    crate::checkpoint::save(h, opt, &best_dir(dir), step, extra, &opts)
        .map_err(|e| anyhow::anyhow!("after step {step}: saving the best val loss's checkpoint: {e:#}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::DataSource;
    use crate::model::GptConfig;

    fn job() -> GptJob {
        GptJob {
            model: GptConfig::tiny(),
            batch_size: 4,
            accum: 1,
            steps: 10,
            warmup: 0,
            optim: Default::default(),
            lr_schedule: None,
            grad_clip: None,
            data: DataSource::Synthetic { tokens: 5000, seed: 1 },
            seed: 1,
            init: None,
            save: None,
            checkpoint: Default::default(),
            eval: EvalConfig { interval: 4, iters: 3 },
        }
    }

    #[test]
    fn the_best_is_the_lowest_val_loss_and_batches_repeat() {
        let j = job();
        let train = j.data.load().unwrap();
        let mut ev = Evaluator::new(&j, 0, 1, 1).unwrap().unwrap();
        assert!(ev.due(0, 10) && ev.due(8, 10) && ev.due(10, 10) && !ev.due(9, 10));
        // A fake model: a fixed loss per evaluation; the batches it is given are recorded.
        let (mut seen, mut best) = (Vec::new(), Vec::new());
        for (step, o) in [(0, 3.0), (4, 1.0), (8, 2.0), (10, 0.5)] {
            let (p, b) = ev
                .evaluate(step, &train, |batch| {
                    seen.push(batch.x.int64_value(&[0, 0]));
                    Ok(o)
                })
                .unwrap();
            assert_eq!((p.train_loss, p.val_loss), (o, o));
            best.push(b);
        }
        assert_eq!(best, vec![true, true, false, true]);
        assert_eq!((ev.best, ev.best_step), (0.5, Some(10)));
        // 3 train + 3 val batches per evaluation, the same six every time.
        assert_eq!(seen.len(), 24);
        assert!(seen.chunks(6).all(|c| c == &seen[..6]), "{seen:?}");
    }

    /// A resumed checkpoint's best is carried on only when `best/` holds its step and the
    /// evaluations average as many batches; an older checkpoint (no `best_step`) carries it.
    #[test]
    fn the_best_is_carried_only_onto_its_own_timeline() {
        let j = job();
        let dir = std::env::temp_dir().join(format!("shardlab-carry-best-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // best/ holds a committed step 6 (a folder with its metadata file).
        let six = best_dir(&dir).join(crate::checkpoint::step_dir_name(6));
        std::fs::create_dir_all(&six).unwrap();
        std::fs::write(six.join("metadata.json"), "{}").unwrap();
        let extra = |step: Option<u64>, iters: usize| serde_json::json!({"best_val_loss": 1.25, "best_step": step, "job": {"eval": {"iters": iters}}});
        let carried = |e: serde_json::Value, d: Option<&std::path::Path>| {
            let mut ev = Evaluator::new(&j, 0, 1, 1).unwrap().unwrap();
            ev.carry_best(Some(&e), d, false).unwrap();
            (ev.best, ev.best_step)
        };
        assert_eq!(carried(extra(Some(6), 3), Some(&dir)), (1.25, Some(6)), "best/ holds the checkpoint's best");
        assert_eq!(
            carried(extra(Some(3), 3), Some(&dir)),
            (f64::INFINITY, None),
            "best/ holds another timeline's step 6"
        );
        assert_eq!(carried(extra(Some(6), 5), Some(&dir)), (f64::INFINITY, None), "5 batches then, 3 now");
        assert_eq!(carried(extra(Some(6), 3), Some(&dir.join("elsewhere"))), (f64::INFINITY, None), "no best/ there");
        assert_eq!(
            carried(extra(Some(3), 3), None),
            (1.25, Some(3)),
            "no checkpoint folder: nothing on disk to disagree"
        );
        let old = serde_json::json!({"best_val_loss": 1.25, "job": {"eval": {"iters": 3}}});
        assert_eq!(carried(old, Some(&dir)), (1.25, None), "an older checkpoint without best_step");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
