//! The training core every strategy shares: shardlab's AdamW against libtorch's, nanoGPT's LR
//! schedule, and global-norm gradient clipping across shards against single-process
//! `clip_grad_norm_` (tch's `Optimizer::clip_grad_norm`, PyTorch's formula).

use shardlab::data::{synthetic_corpus, DistributedSampler, Tokens};
use shardlab::ddp::{self, DataParallel, Single, Variant};
use shardlab::model::{Gpt, GptConfig, Model};
use shardlab::prelude::*;
use shardlab::zero::{Stage, Zero};

fn corpus() -> Tokens {
    synthetic_corpus(4000, 7)
}

fn flat(ps: &[Tensor]) -> Vec<f32> {
    let all = Tensor::cat(&ps.iter().map(|p| p.detach().reshape([-1])).collect::<Vec<_>>(), 0);
    Vec::<f32>::try_from(&all).unwrap()
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "parameter count");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

/// shardlab's AdamW and libtorch's on the same model and batches, one process: `steps` steps,
/// the worst parameter difference.
fn adamw_vs_libtorch(eps: f64, steps: u64) -> f32 {
    let cfg = AdamWConfig { lr: 1e-3, eps, ..AdamWConfig::default() };
    let data = corpus();
    let s = DistributedSampler::new(16, 4, 0, 1, 3).unwrap();
    let reference = {
        let m = Gpt::new(GptConfig::tiny(), 2).unwrap();
        let mut opt = cfg.build(&m).unwrap();
        for step in 0..steps {
            m.loss(&s.batch(&data, step)).backward();
            opt.step();
            opt.zero_grad();
        }
        flat(&m.parameters())
    };
    let out = spawn(1, Backend::Local, move |pg| {
        let mut dp = Single::new(pg, Box::new(Gpt::new(GptConfig::tiny(), 2)?))?;
        let mut opt = AdamW::new(cfg);
        for step in 0..steps {
            ddp::train_step(&mut dp, &mut opt, &s.batch(&corpus(), step), 1, StepConfig::lr(cfg.lr))?;
        }
        let state = opt.state();
        anyhow::ensure!(state.steps.iter().all(|&t| t == steps), "every slot stepped {steps} times: {:?}", state.steps);
        Ok(flat(&dp.model().parameters()))
    })
    .unwrap();
    worst(&out[0], &reference)
}

#[test]
fn adamw_is_libtorchs_adamw_over_20_steps() {
    // One step from the same gradients: the same arithmetic up to rounding (libtorch fuses
    // `add_(g, α)` and `addcdiv_`, we do not), with nanoGPT's eps 1e-8.
    let w = adamw_vs_libtorch(1e-8, 1);
    assert!(w < 1e-7, "one step: shardlab's AdamW differs from libtorch's by {w}");
    // Twenty steps. Over many steps the two runs' parameters, and so their gradients, drift apart
    // by rounding, and with eps 1e-8 Adam turns the rounding noise of near-zero gradient elements
    // (attention key biases) into lr-sized steps (measured: 3e-6 after 20 steps); eps 1e-6 keeps
    // those steps small without changing the rest.
    let w = adamw_vs_libtorch(1e-6, 20);
    assert!(w < 1e-6, "20 steps: shardlab's AdamW differs from libtorch's by {w}");
}

#[test]
fn adamw_state_round_trips_and_resumes_identically() {
    // 6 steps straight vs 3 steps, state saved into a fresh optimizer, 3 more: identical.
    let cfg = AdamWConfig::default();
    let out = spawn(1, Backend::Local, move |pg| {
        let s = DistributedSampler::new(16, 4, 0, 1, 3)?;
        let run = |split: bool| -> anyhow::Result<Vec<f32>> {
            let mut dp = Single::new(pg, Box::new(Gpt::new(GptConfig::tiny(), 2)?))?;
            let mut opt = AdamW::new(cfg);
            for step in 0..6 {
                if split && step == 3 {
                    let mut fresh = AdamW::new(cfg);
                    fresh.load_state(opt.state()).map_err(anyhow::Error::msg)?;
                    opt = fresh;
                }
                ddp::train_step(&mut dp, &mut opt, &s.batch(&corpus(), step), 1, StepConfig::lr(1e-3))?;
            }
            Ok(flat(&dp.model().parameters()))
        };
        Ok((run(false)?, run(true)?))
    })
    .unwrap();
    let (a, b) = &out[0];
    assert_eq!(a, b, "resuming from state() must give bit-identical parameters");
}

#[test]
fn the_lr_schedule_is_nanogpts() {
    // nanoGPT's get_lr with warmup_iters 10, lr_decay_iters 100, learning_rate 6e-4, min_lr 6e-5.
    let s = LrSchedule { max_lr: 6e-4, min_lr: 6e-5, warmup_iters: 10, decay_iters: 100 };
    let close = |a: f64, b: f64| (a - b).abs() < 1e-15;
    assert!(close(s.lr(0), 6e-4 / 11.0), "step 0: lr·1/(warmup+1), got {}", s.lr(0));
    assert!(close(s.lr(9), 6e-4 * 10.0 / 11.0), "step 9");
    assert!(close(s.lr(10), 6e-4), "step 10: the peak");
    assert!(close(s.lr(55), 6e-5 + 0.5 * (6e-4 - 6e-5)), "halfway through the decay: cos(π/2) → the mean");
    assert!(close(s.lr(100), 6e-5) && close(s.lr(1000), 6e-5), "after the decay: min_lr");
    assert!((11..100).all(|t| s.lr(t) < s.lr(t - 1)), "decreasing during the decay");
    assert!(LrSchedule::constant(3e-4).lr(7) == 3e-4);
    assert!(LrSchedule { max_lr: 1e-3, min_lr: 2e-3, warmup_iters: 0, decay_iters: 5 }.validate().is_err());
    assert!(LrSchedule { max_lr: 1e-3, min_lr: 0.0, warmup_iters: 9, decay_iters: 5 }.validate().is_err());
}

#[derive(Clone, Copy, Debug)]
enum Strat {
    Ddp,
    Zero(Stage),
}

#[test]
fn clipping_across_shards_is_single_process_clip_grad_norm() {
    // SGD, so the clipped gradient is the update (AdamW would largely cancel the clip factor). A
    // clip of 0.05 is far below the tiny GPT's gradient norm (≈ 1–3): every step clips.
    // Reference: one process, tch's `clip_grad_norm` (PyTorch's formula: the norm of the
    // per-tensor norms, coefficient max/(norm + 1e-6) when below 1), and its norm computed here
    // the same way.
    const CLIP: f64 = 0.05;
    const GLOBAL: usize = 12;
    let (reference, ref_norms) = {
        use tch::nn::OptimizerConfig;
        let data = corpus();
        let m = Gpt::new(GptConfig::tiny(), 5).unwrap();
        let mut opt = tch::nn::Sgd::default().build(m.var_store(), 0.5).unwrap();
        let mut norms = Vec::new();
        for step in 0..3 {
            m.loss(&DistributedSampler::new(16, GLOBAL, 0, 1, 2).unwrap().batch(&data, step)).backward();
            let per: Vec<Tensor> = m.parameters().iter().map(|p| p.grad().norm()).collect();
            norms.push(Tensor::stack(&per, 0).norm().double_value(&[]));
            opt.clip_grad_norm(CLIP);
            opt.step();
            opt.zero_grad();
        }
        (flat(&m.parameters()), norms)
    };
    assert!(ref_norms.iter().all(|&n| n > 10.0 * CLIP), "clipping must be active: norms {ref_norms:?}");
    let strats = [Strat::Ddp, Strat::Zero(Stage::One), Strat::Zero(Stage::Two), Strat::Zero(Stage::Three)];
    for n in 1..=4 {
        let out = spawn(n, Backend::Local, move |pg| {
            let mut v = Vec::new();
            for strat in strats {
                let m = Gpt::new(GptConfig::tiny(), 5 + pg.rank() as u64)?;
                let mut dp: Box<dyn DataParallel> = match strat {
                    Strat::Ddp => ddp::wrap(pg, Box::new(m), Variant::Bucketed, 16 * 1024)?,
                    Strat::Zero(st) => Box::new(Zero::new(pg, Box::new(m), st)?),
                };
                let s = DistributedSampler::new(16, GLOBAL, pg.rank(), n, 2)?;
                let mut norms = Vec::new();
                for step in 0..3 {
                    let c = StepConfig { lr: 0.5, grad_clip: Some(CLIP) };
                    norms.push(ddp::train_step(&mut *dp, &mut Sgd, &s.batch(&corpus(), step), 1, c)?.grad_norm);
                }
                v.push((flat(&dp.full_parameters()?), norms));
            }
            Ok(v)
        })
        .unwrap();
        for (rank, per) in out.iter().enumerate() {
            for (strat, (params, norms)) in strats.iter().zip(per) {
                for (got, want) in norms.iter().zip(&ref_norms) {
                    assert!(
                        (got - want).abs() < 1e-5 * want,
                        "n={n} rank {rank} {strat:?}: global gradient norm {got}, one process {want}"
                    );
                }
                let w = worst(params, &reference);
                assert!(w < 1e-6, "n={n} rank {rank} {strat:?}: clipped SGD differs from one process by {w}");
            }
        }
    }
}

#[test]
fn a_bad_step_is_refused_on_every_rank_and_changes_nothing() {
    // A NaN in one rank's batch (ZeRO-3: the norm is all-reduced), an optimizer that does not fit
    // one rank's shards, a negative clip, a step after a no_sync backward: every rank gets an
    // error, no rank hangs, and the weights stay what they were.
    let out = spawn(2, Backend::Local, |pg| {
        let data = corpus();
        let s = DistributedSampler::new(16, 4, pg.rank(), 2, 0)?;
        let mut z = Zero::new(pg, Box::new(Gpt::new(GptConfig::tiny(), 1)?), Stage::Three)?;
        let before = flat(&z.full_parameters()?);
        let mut errs = Vec::new();
        // 1. NaN gradients on rank 1 only.
        let mut opt = AdamW::new(AdamWConfig::default());
        z.backward(&s.batch(&data, 0), if pg.rank() == 1 { f64::NAN } else { 1.0 })?;
        errs.push(z.step(&mut opt, 1e-3, None).unwrap_err().to_string());
        // 2. Rank 0's optimizer was built over other slots (a 1-block model's shards).
        let mut other = AdamW::new(AdamWConfig::default());
        if pg.rank() == 0 {
            let mut small =
                Zero::new(pg, Box::new(Gpt::new(GptConfig { n_layer: 1, ..GptConfig::tiny() }, 1)?), Stage::Three)?;
            small.step(&mut other, 1e-3, None).map_err(|e| anyhow::anyhow!("{e}"))?;
        } else {
            let mut small =
                Zero::new(pg, Box::new(Gpt::new(GptConfig { n_layer: 1, ..GptConfig::tiny() }, 1)?), Stage::Three)?;
            small.step(&mut AdamW::new(AdamWConfig::default()), 1e-3, None).map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        z.backward(&s.batch(&data, 0), 1.0)?;
        let o = if pg.rank() == 0 { &mut other } else { &mut opt };
        errs.push(z.step(o, 1e-3, None).unwrap_err().to_string());
        // 3. A negative clip.
        z.backward(&s.batch(&data, 0), 1.0)?;
        errs.push(z.step(&mut opt, 1e-3, Some(-1.0)).unwrap_err().to_string());
        let after = flat(&z.full_parameters()?);
        Ok((errs, before == after))
    })
    .unwrap();
    for (rank, (errs, unchanged)) in out.iter().enumerate() {
        assert!(errs[0].contains("not finite on rank(s)"), "rank {rank}: {}", errs[0]);
        assert!(errs[1].contains("refused") || errs[1].contains("other slots"), "rank {rank}: {}", errs[1]);
        assert!(errs[2].contains("positive norm"), "rank {rank}: {}", errs[2]);
        assert!(unchanged, "rank {rank}: a refused step must leave the weights as they were");
    }
    // A step after a no_sync backward (the gradients were never averaged): refused on every rank,
    // and everything that backward accumulated is cleared — also ZeRO-1's full local gradients —
    // so the next step, on batch 1 alone, is exactly a fresh wrapper's step on batch 1.
    for layout in ["zero1", "ddp naive", "ddp bucketed"] {
        let out = spawn(2, Backend::Local, move |pg| {
            let wrap = || -> anyhow::Result<Box<dyn DataParallel + '_>> {
                let model = Box::new(Gpt::new(GptConfig::tiny(), 1)?);
                Ok(match layout {
                    "zero1" => Box::new(Zero::new(pg, model, Stage::One)?),
                    "ddp naive" => ddp::wrap(pg, model, Variant::Naive, 16 * 1024)?,
                    _ => ddp::wrap(pg, model, Variant::Bucketed, 16 * 1024)?,
                })
            };
            let s = DistributedSampler::new(16, 4, pg.rank(), 2, 0)?;
            let mut d = wrap()?;
            d.set_require_sync(false);
            d.backward(&s.batch(&corpus(), 0), 1.0)?;
            let refused = d.step(&mut Sgd, 0.5, None).unwrap_err().to_string();
            d.set_require_sync(true);
            d.backward(&s.batch(&corpus(), 1), 1.0)?;
            d.step(&mut Sgd, 0.5, None)?;
            let mut fresh = wrap()?;
            fresh.backward(&s.batch(&corpus(), 1), 1.0)?;
            fresh.step(&mut Sgd, 0.5, None)?;
            Ok((refused, flat(&d.full_parameters()?) == flat(&fresh.full_parameters()?)))
        })
        .unwrap();
        for (rank, (refused, same)) in out.iter().enumerate() {
            assert!(refused.contains("no_sync") && refused.contains("cleared"), "{layout} rank {rank}: {refused}");
            assert!(same, "{layout} rank {rank}: the refused step's no_sync gradients reached the next step");
        }
    }
}

/// Put a NaN into the first element of `g`, in place.
fn poison(g: &Tensor) {
    let _ = g.detach().reshape([-1]).narrow(0, 0, 1).fill_(f64::NAN);
}

/// Whether every defined gradient is all zeros (a NaN is not).
fn cleared(grads: &[Tensor]) -> bool {
    grads.iter().filter(|g| g.defined()).all(|g| g.abs().sum(Kind::Double).double_value(&[]) == 0.0)
}

/// What one rank saw: the refused step's error, whether its gradients were cleared, whether its
/// weights and optimizer were untouched, then the next step's norm and whether it moved weights.
type NanOut = (String, bool, bool, f64, bool);

fn check_nan_outcome(layout: &str, out: &[NanOut], poisoned: &str) {
    for (rank, (err, cleared, unchanged, norm, moved)) in out.iter().enumerate() {
        assert!(
            err.contains(&format!("not finite on rank(s) {poisoned}")) && err.contains("not applied"),
            "{layout} rank {rank}: {err}"
        );
        assert!(unchanged, "{layout} rank {rank}: a refused step changed a weight or the optimizer's state");
        assert!(cleared, "{layout} rank {rank}: a refused step must clear the gradients");
        assert!(norm.is_finite() && *norm > 0.0, "{layout} rank {rank}: the next step's norm is {norm}");
        assert!(moved, "{layout} rank {rank}: the next step did not change the weights");
    }
}

/// The one optimizer step under every layout: a NaN in one rank's gradient — in a gradient that
/// rank does not count in the global norm (a replica's copy, a tensor rank's replicated
/// LayerNorm, the tied embedding's second holder), so only the agreed non-finite check can see
/// it — stops the step on every rank: every rank's error names the rank, no weight and no
/// optimizer state changes, the gradients are cleared, and the next step goes through.
#[test]
fn a_nan_in_one_ranks_gradient_stops_every_rank_under_every_layout() {
    for layout in ["ddp-naive", "ddp-bucketed", "zero1", "zero2", "zero3"] {
        let out = spawn(2, Backend::Local, move |pg| {
            let model = Box::new(Gpt::new(GptConfig::tiny(), 1)?);
            let mut d: Box<dyn DataParallel> = match layout {
                "ddp-naive" => ddp::wrap(pg, model, Variant::Naive, 16 * 1024)?,
                "ddp-bucketed" => ddp::wrap(pg, model, Variant::Bucketed, 16 * 1024)?,
                "zero1" => Box::new(Zero::new(pg, model, Stage::One)?),
                "zero2" => Box::new(Zero::new(pg, model, Stage::Two)?),
                _ => Box::new(Zero::new(pg, model, Stage::Three)?),
            };
            let b = DistributedSampler::new(16, 4, pg.rank(), 2, 0)?.batch(&corpus(), 0);
            let mut opt = AdamW::new(AdamWConfig::default());
            let before = flat(&d.full_parameters()?);
            d.backward(&b, 1.0)?;
            if pg.rank() == 1 {
                poison(d.grads().last().unwrap());
            }
            let err = d.step(&mut opt, 1e-3, Some(1.0)).unwrap_err().to_string();
            let was_cleared = cleared(&d.grads());
            let unchanged = flat(&d.full_parameters()?) == before && opt.state_bytes() == 0;
            d.backward(&b, 1.0)?;
            let norm = d.step(&mut opt, 1e-3, Some(1.0))?;
            let moved = flat(&d.full_parameters()?) != before;
            Ok((err, was_cleared, unchanged, norm, moved))
        })
        .unwrap();
        check_nan_outcome(layout, &out, "[1]");
    }
    // Tensor and pipeline parallel, alone and with dp 2 (DDP or ZeRO on the data dimension), on
    // the engine: the NaN in the last rank's copy of a gradient it does not count — tp: the final
    // LayerNorm's bias (replicated over tp); pp: the tied embedding's second holder (counted on
    // the first stage). With dp, the mesh is pp × dp × tp: the last rank is dp 1.
    use shardlab::engine::{parallelize, DataDim, ParallelDims, Plan};
    use shardlab::pipeline::{PipelineConfig, Schedule};
    let pc = PipelineConfig { stages: 2, micro_batches: 2, schedule: Schedule::OneFOneB };
    for (name, tp, pp, dp, data) in [
        ("tp 2", 2, 1, 1, DataDim::Replicate),
        ("ddp 2 × tp 2", 2, 1, 2, DataDim::Replicate),
        ("pp 2", 1, 2, 1, DataDim::Replicate),
        ("ddp 2 × pp 2", 1, 2, 2, DataDim::Replicate),
        ("zero3 2 × tp 2", 2, 1, 2, DataDim::Zero(Stage::Three)),
        ("zero1 2 × pp 2", 1, 2, 2, DataDim::Zero(Stage::One)),
    ] {
        let out = spawn(tp * pp * dp, Backend::Local, move |pg| {
            let plan = Plan { pipeline: pc, ..Plan::new(ParallelDims { pp, dp, tp }, data) };
            let cfg = GptConfig::tiny();
            let mut e = parallelize(pg, &plan, &cfg, &|keep| Gpt::new_only(cfg, 1, keep))?;
            let b = DistributedSampler::new(16, 4, e.mesh().coord("dp"), dp, 0)?.batch(&corpus(), 0);
            let mut opt = AdamW::new(AdamWConfig::default());
            let before = flat(&e.masters());
            let step = e.forward_backward(&b)?;
            let grads: Vec<Tensor> = step.grads.iter().map(|g| g.shallow_clone()).collect();
            if pg.rank() + 1 == pg.world_size() {
                // tp: ln_f's bias (the last parameter); pp: the last stage's wte (its first).
                poison(if pp > 1 { &grads[0] } else { grads.last().unwrap() });
            }
            let err = match e.apply(step, &mut opt, 1e-3, Some(1.0)) {
                Ok(_) => "the step was taken".to_string(),
                Err(e) => e.to_string(),
            };
            let unchanged = flat(&e.masters()) == before && opt.state_bytes() == 0;
            // DDP clears the step's gradients; ZeRO the shards it reduced them into (and ZeRO-1's
            // flat gradients), the step's own being gone.
            let was_cleared = cleared(&e.kept_grads()) && (data != DataDim::Replicate || cleared(&grads));
            let norm = e.train_step(&b, &mut opt, 1e-3, Some(1.0))?.norm;
            let moved = flat(&e.masters()) != before;
            Ok((err, was_cleared, unchanged, norm, moved))
        })
        .unwrap();
        // The ranks holding the NaN after the data dimension: DDP averages it into the last rank's
        // dp partner (tp × dp: rank 1; pp × dp: rank 2, the same stage); ZeRO reduce-scatters it
        // to the owner of its shard — ln_f's bias ends the last rank's uncounted unit (dp 1: rank
        // 3), the tied wte's first element starts it (dp 0 of the last stage: rank 2).
        let want = match (tp, dp, data) {
            (_, 1, _) => "[1]",
            (2, _, DataDim::Replicate) => "[1, 3]",
            (_, _, DataDim::Replicate) => "[2, 3]",
            (2, _, _) => "[3]",
            _ => "[2]",
        };
        check_nan_outcome(name, &out, want);
    }
}
