//! The elastic supervisor (lesson 10, torchrun's `--max-restarts`): a failed job starts again, as a
//! new generation of processes, from its latest committed checkpoint — at the same size, or shrunk.

use super::{GptJob, RunSummary};
use crate::trainer::ScalingConfig;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

impl GptJob {
    /// Run under a supervisor, like torchrun's `--max-restarts` (lesson 10): when a rank dies or
    /// fails, the launcher stops the others (their collectives fail), and the job starts again —
    /// a new generation: new processes, a new rendezvous (port and secret), so no rank of the old
    /// generation can join — from the latest committed checkpoint in `checkpoint.dir`. With
    /// `shrink_on_failure` the new generation has fewer ranks (the largest count, down to
    /// `min_world_size`, that the global batch splits over: [`Elastic::after_failure`]), the
    /// same global batch, and resharding happens on load. Gives up after `max_restarts`.
    pub fn fit_elastic(
        &self,
        scaling: ScalingConfig,
        elastic: &Elastic,
        progress: bool,
        json_lines: bool,
    ) -> anyhow::Result<(RunSummary, Vec<Attempt>)> {
        let dir = self.checkpoint.dir.clone().ok_or_else(|| {
            anyhow::anyhow!(
                "an elastic run restarts from its checkpoints: give it a checkpoint folder (--checkpoint-dir)"
            )
        })?;
        anyhow::ensure!(self.checkpoint.every > 0, "an elastic run needs checkpoints during training (--save-every)");
        anyhow::ensure!(
            !elastic.shrink_on_failure || (scaling.tensor_parallel == 1 && scaling.pipeline.stages == 1),
            "shrinking on failure with tensor or pipeline parallelism is not built yet (the shrunk world must still \
             divide into tp × pp ranks); restarts at the same size are (max_restarts)"
        );
        if crate::launch::is_spawned_child() {
            // A worker of generation g: the supervisor put g's job and scaling in the environment
            // (whatever elastic run this process reached first, it runs its driver's current one).
            let (job, scaling): (GptJob, ScalingConfig) = serde_json::from_str(&std::env::var(ENV_ELASTIC)?)?;
            crate::launch::align_spawn_call_with_driver();
            let s = job.fit(scaling, false, false)?;
            return Ok((s, vec![]));
        }
        let mut attempts: Vec<Attempt> = Vec::new();
        let (mut world_size, mut batch_size) = (scaling.num_workers, self.batch_size);
        // The variables that tell workers their generation live as long as this run.
        struct Unset;
        impl Drop for Unset {
            fn drop(&mut self) {
                std::env::remove_var(crate::launch::ENV_GENERATION);
                std::env::remove_var(ENV_ELASTIC);
            }
        }
        let _unset = Unset;
        for generation in 0..=elastic.max_restarts {
            // From the latest checkpoint of this run's folder, else where the run itself started.
            let resume = match crate::checkpoint::try_committed(&dir)?.last() {
                Some(_) if generation > 0 => Some(dir.clone()),
                _ => self.checkpoint.resume.clone(),
            };
            let attempt = Attempt { generation, world_size, batch_size, resume, error: None };
            let job = attempt.job(self);
            let s = ScalingConfig { num_workers: world_size, ..scaling.clone() };
            std::env::set_var(crate::launch::ENV_GENERATION, generation.to_string());
            std::env::set_var(ENV_ELASTIC, serde_json::to_string(&(&job, &s))?);
            let r = job.fit(s, progress, json_lines);
            attempts.push(attempt);
            match r {
                Ok(s) => return Ok((s, attempts)),
                Err(e) => {
                    attempts.last_mut().expect("pushed").error = Some(format!("{e:#}"));
                    match elastic.after_failure(generation, world_size, batch_size) {
                        Ok((w, b)) => (world_size, batch_size) = (w, b),
                        Err(why) => anyhow::bail!("{why}; generation {generation} failed with: {e:#}"),
                    }
                }
            }
        }
        unreachable!("the loop returns")
    }
}

/// Restart policy of [`GptJob::fit_elastic`].
#[derive(Clone, Debug, Default)]
pub struct Elastic {
    /// Restarts after the first attempt before giving up (torchrun's `--max-restarts`).
    pub max_restarts: u32,
    /// Never go below this many ranks when shrinking.
    pub min_world_size: usize,
    /// After a failure, continue with fewer ranks (the failed rank's machine is gone): the largest
    /// count below the failed one that the global batch splits over.
    pub shrink_on_failure: bool,
}

impl Elastic {
    /// After generation `generation` (0-based) failed at `world_size` ranks of `batch_size` rows:
    /// the world size and rows per rank of the next generation, or why the run gives up. It gives
    /// up once `max_restarts` restarts are spent. Without `shrink_on_failure` it restarts at the
    /// same size; with it, at the largest world size below the failed one, and at least
    /// `min_world_size` (and 1), over which the global batch splits evenly — the same global
    /// batch, so the run goes on training the same thing.
    pub fn after_failure(
        &self,
        generation: u32,
        world_size: usize,
        batch_size: usize,
    ) -> Result<(usize, usize), String> {
        if generation >= self.max_restarts {
            return Err(format!("gave up after {} restart(s) (--max-restarts)", self.max_restarts));
        }
        if !self.shrink_on_failure {
            return Ok((world_size, batch_size));
        }
        let global = world_size * batch_size;
        let lowest = self.min_world_size.max(1);
        (lowest..world_size).rev().find(|w| global % w == 0).map(|w| (w, global / w)).ok_or_else(|| {
            format!(
                "cannot go on with fewer than {world_size} ranks: the global batch of {global} rows splits over \
                 none of {lowest}..{world_size} ranks (--min-world-size {})",
                self.min_world_size
            )
        })
    }
}

/// One generation of an elastic run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Attempt {
    pub generation: u32,
    pub world_size: usize,
    /// Rows per rank (the global batch stays the same when the world shrinks).
    pub batch_size: usize,
    /// The checkpoint folder it resumed from (its latest), if any.
    pub resume: Option<PathBuf>,
    /// How it ended, if it failed.
    pub error: Option<String>,
}

impl Attempt {
    fn job(&self, base: &GptJob) -> GptJob {
        let mut j = base.clone();
        j.batch_size = self.batch_size;
        j.checkpoint.resume = self.resume.clone();
        j
    }
}

const ENV_ELASTIC: &str = "SHARDLAB_ELASTIC_ATTEMPT";
