//! Evaluation during training (`train --eval-interval N`, nanoGPT's `estimate_loss`) on a
//! character layout made here (nanoGPT's `train.bin`/`val.bin`/`meta.json`, from a text this
//! file generates: no network).
//!
//! Expected, with where each comes from:
//! * the same `train_loss`/`val_loss` at every evaluation under every layout (one process, DDP,
//!   ZeRO-3 with and without resharding after forward, ZeRO-2 × tp 2, ZeRO-1 × pp 2): the
//!   evaluation batches depend on the seed alone and the weights are the same at each point, so
//!   within f32 rounding (1e-5 relative, the engine tests' bound);
//! * evaluating changes nothing: each layout's losses and saved weights are bitwise those of the
//!   same run without evaluation, and the rank holds the same bytes after it (counted from its
//!   tensors);
//! * the best val loss's checkpoint (`CHECKPOINT_DIR/best`) is the step with the lowest val loss,
//!   and loading it gives that val loss again — bitwise in the same layout, within 1e-5 in another.

use shardlab::corpus::{build_char_layout, practice_documents};
use shardlab::job::{CheckpointConfig, DataSource, EvalConfig, GptJob, RunSummary};
use shardlab::pipeline::{PipelineConfig, Schedule};
use shardlab::prelude::*;
use std::path::{Path, PathBuf};

const STEPS: u64 = 6;

/// Eight practice "plays" (`corpus::practice_documents`: seeded lines of words; the last goes to
/// val), so the model has something to learn and val is text it never saw.
fn layout(dir: &Path) -> PathBuf {
    let out = dir.join("chars");
    build_char_layout(&practice_documents(8, 60, 12345), &out, "shardlab::corpus::practice_documents").unwrap();
    out
}

fn job(data: &Path, batch_size: usize, eval: bool, save: PathBuf) -> GptJob {
    GptJob {
        model: GptConfig { vocab_size: 48, block_size: 16, n_layer: 2, n_head: 2, n_embd: 32 },
        batch_size,
        accum: 1,
        steps: STEPS,
        warmup: 0,
        optim: AdamWConfig { lr: 1e-2, ..AdamWConfig::default() },
        lr_schedule: None,
        grad_clip: Some(1.0),
        data: DataSource::Dir(data.to_path_buf()),
        seed: 3,
        init: None,
        save: Some(save),
        checkpoint: Default::default(),
        eval: if eval { EvalConfig { interval: 3, iters: 2 } } else { EvalConfig::default() },
    }
}

fn weights(path: &Path) -> Vec<(String, Tensor)> {
    let mut w: Vec<(String, Tensor)> = Tensor::read_safetensors(path).unwrap();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-5 * b.abs()
}

/// The tests of this file train one after another. A run of several ranks in this process sets
/// libtorch's intra-op threads to one (`launch`: ranks share the machine), while a one-process run
/// keeps the count it finds; a one-process run overlapping another test's first multi-rank run
/// would change its thread count mid-run, and with it the order of its sums — one bit in a
/// weight, which the bitwise checks below would (rightly) see.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shardlab-eval-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn evaluation_is_the_same_under_every_layout_and_changes_no_weight() {
    let _serial = serial();
    let d = dir("layouts");
    let data = layout(&d);
    let pp2 = PipelineConfig { stages: 2, micro_batches: 2, schedule: Schedule::OneFOneB };
    let base = ScalingConfig::default();
    let layouts: Vec<(&str, ScalingConfig, usize)> = vec![
        ("single", ScalingConfig { num_workers: 1, strategy: Strategy::Single, ..base.clone() }, 8),
        ("ddp2", ScalingConfig { num_workers: 2, strategy: Strategy::Ddp, ..base.clone() }, 4),
        ("zero3x2", ScalingConfig { num_workers: 2, strategy: Strategy::Zero3, ..base.clone() }, 4),
        (
            "zero3x2-keep",
            ScalingConfig { num_workers: 2, strategy: Strategy::Zero3, reshard_after_forward: false, ..base.clone() },
            4,
        ),
        (
            "zero2:dp2xtp2",
            ScalingConfig { num_workers: 4, strategy: Strategy::Zero2, tensor_parallel: 2, ..base.clone() },
            2,
        ),
        (
            "zero1:dp2xpp2",
            ScalingConfig { num_workers: 4, strategy: Strategy::Zero1, pipeline: pp2, ..base.clone() },
            2,
        ),
    ];
    let mut reference: Option<RunSummary> = None;
    for (name, s, rows) in layouts {
        let with = job(&data, rows, true, d.join(format!("{name}-eval.safetensors")))
            .fit(s.clone(), false, false)
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let without = job(&data, rows, false, d.join(format!("{name}.safetensors")))
            .fit(s, false, false)
            .unwrap_or_else(|e| panic!("{name} without evaluation: {e:#}"));
        // Before step 0, after step 3, after the last.
        let steps: Vec<u64> = with.evals.iter().map(|p| p.step).collect();
        assert_eq!(steps, vec![0, 3, STEPS], "{name}: when it evaluates");
        assert!(without.evals.is_empty(), "{name}: no evaluation asked, none run");
        assert_eq!(with.losses, without.losses, "{name}: evaluating changed the training losses");
        for ((n, a), (m, b)) in weights(&d.join(format!("{name}-eval.safetensors")))
            .iter()
            .zip(&weights(&d.join(format!("{name}.safetensors"))))
        {
            assert_eq!(n, m);
            assert!(a.equal(b), "{name}: {n} differs after a run with evaluation");
        }
        // What the rank holds after the run: evaluating left nothing gathered (ZeRO-3's units)
        // and no gradient behind.
        let (a, b) = (&with.memory, &without.memory);
        assert_eq!((a.params, a.grads, a.optim), (b.params, b.grads, b.optim), "{name}: bytes held after the run");
        let (first, last) = (with.evals[0], with.evals[2]);
        assert!(last.val_loss < first.val_loss - 0.3, "{name}: the model learned nothing? {:?}", with.evals);
        assert_ne!(first.train_loss, first.val_loss, "{name}: the two splits are different batches");
        match &reference {
            None => reference = Some(with),
            Some(r) => {
                for (p, q) in with.evals.iter().zip(&r.evals) {
                    assert!(
                        close(p.train_loss, q.train_loss) && close(p.val_loss, q.val_loss),
                        "{name} at step {}: {p:?}, one process {q:?}",
                        p.step
                    );
                }
            }
        }
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn the_best_val_checkpoint_is_kept_and_loads_back_to_its_loss() {
    let _serial = serial();
    let d = dir("best");
    let data = layout(&d);
    let ck = d.join("ck");
    let single = ScalingConfig { num_workers: 1, strategy: Strategy::Single, ..ScalingConfig::default() };
    let mut j = job(&data, 8, true, d.join("final.safetensors"));
    j.eval.interval = 2;
    j.checkpoint = CheckpointConfig { dir: Some(ck.clone()), every: 3, at_end: true, ..Default::default() };
    let run = j.fit(single.clone(), false, false).unwrap();
    let points: Vec<_> = run.evals.iter().filter(|p| p.step > 0).collect();
    let best = points.iter().min_by(|a, b| a.val_loss.total_cmp(&b.val_loss)).unwrap();
    let kept: Vec<String> = std::fs::read_dir(ck.join("best"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert_eq!(kept, vec![format!("step-{:08}", best.step)], "one checkpoint, the best val loss's: {:?}", run.evals);
    // Each regular checkpoint carries the best so far, its own step's evaluation included (a run
    // resumed from it to train longer must not take a worse model for the best).
    for at in [3u64, 6] {
        let meta = shardlab::checkpoint::read_metadata(&ck.join(format!("step-{at:08}"))).unwrap();
        let want = run.evals.iter().filter(|p| p.step <= at).map(|p| p.val_loss).fold(f64::INFINITY, f64::min);
        assert_eq!(
            meta.extra["best_val_loss"].as_f64(),
            Some(want),
            "step {at}'s checkpoint: the best val loss so far"
        );
    }
    // Loaded back, in the same layout and in another, it evaluates to the loss it was kept for.
    for (name, s, rows) in [
        ("single", single, 8),
        ("zero3x2", ScalingConfig { num_workers: 2, strategy: Strategy::Zero3, ..ScalingConfig::default() }, 4),
    ] {
        let mut again = job(&data, rows, true, d.join(format!("again-{name}.safetensors")));
        again.eval.interval = 2;
        again.steps = best.step;
        again.checkpoint.resume = Some(ck.join("best"));
        let r = again.fit(s, false, false).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert_eq!(r.evals.len(), 1, "{name}: only the evaluation at the end: {:?}", r.evals);
        let v = r.evals[0].val_loss;
        if name == "single" {
            assert_eq!(v, best.val_loss, "{name}: the best checkpoint's val loss");
        } else {
            assert!(close(v, best.val_loss), "{name}: {v}, kept for {}", best.val_loss);
        }
    }
    // A run resumed from the step-3 checkpoint carries the best so far and evaluates as the
    // straight run did.
    let mut resumed = job(&data, 8, true, d.join("resumed.safetensors"));
    resumed.eval.interval = 2;
    resumed.checkpoint = CheckpointConfig {
        dir: Some(d.join("ck2")),
        resume: Some(ck.join(format!("step-{:08}", 3))),
        ..Default::default()
    };
    let r = resumed
        .fit(ScalingConfig { num_workers: 1, strategy: Strategy::Single, ..ScalingConfig::default() }, false, false)
        .unwrap();
    let straight: Vec<_> = run.evals.iter().filter(|p| p.step >= 3).map(|p| (p.step, p.val_loss)).collect();
    let again: Vec<_> = r.evals.iter().map(|p| (p.step, p.val_loss)).collect();
    assert_eq!(again, straight, "the resumed run's evaluations");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn evaluation_refuses_data_without_a_val_split_and_a_vocabulary_too_small() {
    let _serial = serial();
    let d = dir("refusals");
    let data = layout(&d);
    let single = ScalingConfig { num_workers: 1, strategy: Strategy::Single, ..ScalingConfig::default() };
    let mut j = job(&data, 8, true, d.join("x.safetensors"));
    j.data = DataSource::File(data.join("train.bin"));
    let e = j.fit(single.clone(), false, false).unwrap_err().to_string();
    assert!(e.contains("held-out split"), "{e}");
    let mut j = job(&data, 8, false, d.join("x.safetensors"));
    let vocab = shardlab::corpus::Meta::read(&data).unwrap().vocab_size;
    j.model.vocab_size = vocab as i64 - 1;
    let e = j.fit(single.clone(), false, false).unwrap_err().to_string();
    assert!(e.contains("meta.json") && e.contains(&vocab.to_string()), "{e}");
    let mut j = job(&data, 8, true, d.join("x.safetensors"));
    j.eval.iters = 0;
    let e = j.fit(single, false, false).unwrap_err().to_string();
    assert!(e.contains("--eval-iters"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_sharded_checkpoint_restores_the_weights_the_run_saved() {
    let _serial = serial();
    let d = dir("restore");
    let data = layout(&d);
    let mut j = job(&data, 2, false, d.join("final.safetensors"));
    j.checkpoint = CheckpointConfig { dir: Some(d.join("ck")), at_end: true, ..Default::default() };
    let s = ScalingConfig { num_workers: 4, strategy: Strategy::Zero2, tensor_parallel: 2, ..ScalingConfig::default() };
    j.fit(s, false, false).unwrap();
    // The checkpoint folder (its latest): every rank's tensor-parallel slices and ZeRO shards.
    let r = shardlab::job::restore::load_gpt(&d.join("ck")).unwrap();
    assert_eq!(r.step, STEPS);
    assert_eq!(r.meta_path(), Some(data.join("meta.json")));
    let saved = weights(&d.join("final.safetensors"));
    let mut restored = r.model.named_parameters();
    restored.sort_by(|a, b| a.0.cmp(&b.0));
    // The saved file also lists lm_head.weight (tied to wte, as nanoGPT's state dict has it).
    let saved: Vec<_> = saved.into_iter().filter(|(n, _)| n != "lm_head.weight").collect();
    assert_eq!(restored.len(), saved.len());
    for ((n, a), (m, b)) in restored.iter().zip(&saved) {
        assert_eq!(n, m);
        assert!(a.equal(b), "{n}: restored from the checkpoint, not what the run saved");
    }
    std::fs::remove_dir_all(&d).unwrap();
}
