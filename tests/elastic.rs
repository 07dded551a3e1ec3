//! Elastic restart (lesson 10): a rank killed with SIGKILL mid-run — before a step, or in the
//! middle of a checkpoint save — is restarted as a new generation from the latest committed
//! checkpoint, and the run ends with bitwise the weights of an uninterrupted run; with a rank
//! lost for good it goes on with fewer ranks (resharding on load) and ends within float
//! tolerance; it gives up with a clear error after its restarts. A tensor-parallel run restarts
//! from its checkpoints the same way. One test, because it sets the
//! fault-injection variable of the processes it starts.

use shardlab::job::{CheckpointConfig, DataSource, Elastic, GptJob};
use shardlab::model::GptConfig;
use shardlab::prelude::*;
use std::path::{Path, PathBuf};

const NAME: &str = "a_killed_rank_restarts_and_the_run_ends_as_if_uninterrupted";

fn job(dir: &Path, save: &str) -> GptJob {
    GptJob {
        model: GptConfig::tiny(),
        batch_size: 6,
        accum: 1,
        steps: 6,
        warmup: 0,
        optim: AdamWConfig { lr: 3e-3, eps: 1e-6, ..AdamWConfig::default() },
        lr_schedule: Some(LrSchedule { max_lr: 3e-3, min_lr: 3e-4, warmup_iters: 2, decay_iters: 6 }),
        grad_clip: Some(1.0),
        data: DataSource::Synthetic { tokens: 4000, seed: 7 },
        seed: 1,
        init: None,
        save: Some(dir.join(save)),
        checkpoint: CheckpointConfig { dir: Some(dir.join("ck")), every: 2, ..Default::default() },
        eval: Default::default(),
    }
}

fn processes(n: usize) -> ScalingConfig {
    ScalingConfig {
        num_workers: n,
        backend: Backend::Tcp,
        launch: Some(Launch::Processes),
        child_args: Some(vec!["--exact".into(), NAME.into(), "--nocapture".into(), "--test-threads=1".into()]),
        ..ScalingConfig::default()
    }
}

/// Set the fault to inject, in the driver only: a worker process re-runs this test up to its
/// elastic run and must keep the value its driver started it with.
fn fail_at(spec: Option<&str>) {
    if !is_spawned_child() {
        match spec {
            Some(s) => std::env::set_var("SHARDLAB_FAIL_AT", s),
            None => std::env::remove_var("SHARDLAB_FAIL_AT"),
        }
    }
}

fn fresh(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shardlab-elastic-{tag}-{}", std::process::id()));
    if is_spawned_child() {
        return d; // a worker runs its driver's job, with the driver's folders
    }
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn weights(p: &Path) -> Vec<f32> {
    let mut t = Tensor::read_safetensors(p).unwrap();
    t.sort_by(|a, b| a.0.cmp(&b.0)); // by name: the reading order is not the writing order
    let all: Vec<Tensor> = t.iter().map(|(_, t)| t.reshape([-1])).collect();
    Vec::<f32>::try_from(&Tensor::cat(&all, 0)).unwrap()
}

#[test]
fn a_killed_rank_restarts_and_the_run_ends_as_if_uninterrupted() {
    // Worker processes re-run this test and leave inside the first elastic run they reach, where
    // they run their driver's current job (from the environment).
    let restarts = Elastic { max_restarts: 2, ..Elastic::default() };
    let mut runs = Vec::new();
    for (tag, spec) in [("step", "step:1:3"), ("save", "save:0:4")] {
        let d = fresh(tag);
        fail_at(Some(spec));
        let (summary, attempts) =
            job(&d, "final.safetensors").fit_elastic(processes(2), &restarts, false, false).unwrap();
        runs.push((tag, d, summary, attempts));
    }
    // Rank 2 of 3 dies at step 3 and its machine is gone: go on with 2 ranks of 9 rows.
    let d = fresh("shrink");
    fail_at(Some("step:2:3"));
    let shrink = Elastic { max_restarts: 1, min_world_size: 2, shrink_on_failure: true };
    let (_, shrunk) = GptJob { batch_size: 4, ..job(&d, "final.safetensors") }
        .fit_elastic(processes(3), &shrink, false, false)
        .unwrap();
    // Tensor parallelism (tp 2 on 2 processes) restarts from its own checkpoints too.
    let tp = |n| ScalingConfig { tensor_parallel: 2, ..processes(n) };
    let t = fresh("tp");
    fail_at(Some("step:1:3"));
    let (_, tp_attempts) = job(&t, "final.safetensors").fit_elastic(tp(2), &restarts, false, false).unwrap();
    // No restarts allowed: the failure is the run's error.
    let g = fresh("giveup");
    fail_at(Some("step:1:3"));
    let e = job(&g, "final.safetensors").fit_elastic(processes(2), &Elastic::default(), false, false).unwrap_err();
    fail_at(None);
    let tr = fresh("tp-reference");
    job(&tr, "final.safetensors").fit_elastic(tp(2), &restarts, false, false).unwrap();
    assert_eq!(tp_attempts.len(), 2, "tp: one failure, one restart: {tp_attempts:?}");
    assert!(
        weights(&t.join("final.safetensors")) == weights(&tr.join("final.safetensors")),
        "tp 2: the restarted run must end with bitwise the uninterrupted run's weights"
    );

    // The reference: the same job on the same processes, never interrupted.
    let r = fresh("reference");
    let (reference, clean) = job(&r, "final.safetensors").fit_elastic(processes(2), &restarts, false, false).unwrap();
    assert_eq!(clean.len(), 1, "no failure, no restart: {clean:?}");
    let want = weights(&r.join("final.safetensors"));

    for (tag, d, summary, attempts) in &runs {
        assert_eq!(attempts.len(), 2, "{tag}: one failure, one restart: {attempts:?}");
        assert!(attempts[0].error.as_deref().is_some_and(|e| e.contains("rank")), "{tag}: {attempts:?}");
        assert_eq!(attempts[1].resume.as_deref(), Some(d.join("ck").as_path()), "{tag}: generation 1 resumes");
        // Killed before step 3 or in step 4's save: the latest commit is step 2 either way.
        assert_eq!(summary.losses.len(), 4, "{tag}: the restart trained steps 2..6");
        let got = weights(&d.join("final.safetensors"));
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(
            got == want,
            "{tag}: the restarted run must end with bitwise the uninterrupted run's weights (off by {worst}; losses {:?} vs {:?})",
            summary.losses,
            reference.losses
        );
        assert!(!d.join("ck").join("step-00000004.tmp").exists() || *tag == "step", "{tag}: the next save cleans up");
    }
    assert_eq!(shrunk.iter().map(|a| (a.world_size, a.batch_size)).collect::<Vec<_>>(), vec![(3, 4), (2, 6)]);
    let got = weights(&d.join("final.safetensors"));
    let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst < 1e-4, "shrunk to 2 ranks: the weights are {worst} from the uninterrupted run's");
    let e = format!("{e:#}");
    assert!(e.contains("gave up after 0 restart(s)") && e.contains("rank 1"), "{e}");
    for p in [&d, &g, &r, &t, &tr] {
        let _ = std::fs::remove_dir_all(p);
    }
    for (_, p, ..) in &runs {
        let _ = std::fs::remove_dir_all(p);
    }
}
