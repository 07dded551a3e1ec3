//! Mixed precision: the dynamic loss scaler follows PyTorch's GradScaler rules on an injected
//! sequence of overflows, and every rank takes the same skip decision when one rank overflows;
//! bf16/fp16 compute keeps fp32 masters; bf16 ZeRO-3 holds 16Ψ/N bytes of model states (measured)
//! and gathers half the bytes; fp16 training skips overflowing steps on every rank together.

use shardlab::prelude::*;

#[test]
fn the_scale_follows_gradscalers_rules() {
    // PyTorch's defaults: 2^16, ×2 after 2000 clean steps in a row, ×0.5 (and skip) on overflow.
    let mut s = GradScaler::default();
    assert_eq!(s.scale(), 65536.0);
    for _ in 0..1999 {
        assert!(!s.update(false));
    }
    assert_eq!(s.scale(), 65536.0, "1999 clean steps: not yet");
    s.update(false);
    assert_eq!(s.scale(), 131072.0, "the 2000th clean step doubles the scale");
    assert!(s.update(true), "an overflow skips the step");
    assert_eq!(s.scale(), 65536.0, "and halves the scale");
    for _ in 0..1999 {
        s.update(false);
    }
    assert!(s.update(true));
    assert_eq!(s.scale(), 32768.0, "an overflow restarts the count of clean steps");
    assert_eq!(s.skipped, 2);

    // A short interval, by hand: clean steps grow the scale every 3rd, overflows halve it.
    // step:      1  2  3(×2) 4(inf ×½) 5  6  7(×2) 8(inf) 9(inf) 10 11 12(×2)
    let mut s = GradScaler::new(8.0);
    s.growth_interval = 3;
    let infs = [false, false, false, true, false, false, false, true, true, false, false, false];
    let want = [8.0, 8.0, 16.0, 8.0, 8.0, 8.0, 16.0, 8.0, 4.0, 4.0, 4.0, 8.0];
    for (k, (&inf, &w)) in infs.iter().zip(&want).enumerate() {
        s.update(inf);
        assert_eq!(s.scale(), w, "after step {}", k + 1);
    }
    assert_eq!(s.skipped, 3);
}

#[test]
fn one_rank_overflowing_makes_every_rank_skip() {
    for backend in [Backend::Local, Backend::Tcp] {
        let out = spawn_with(SpawnOptions::new(3, backend).launch(Launch::Threads), |pg| {
            let s = GradScaler::new(1024.0);
            let g = Tensor::from_slice(&[2048.0f32, -512.0]);
            let clean = s.unscale_and_check(pg, &[g.shallow_clone()])?;
            let unscaled = Vec::<f32>::try_from(&g)?;
            // Now rank 2 has an inf (fp16 overflow), then a NaN, in one of its gradients.
            let mut flags = Vec::new();
            for bad in [f32::INFINITY, f32::NAN] {
                let h = Tensor::from_slice(&[1.0f32, if pg.rank() == 2 { bad } else { 3.0 }]);
                flags.push(s.unscale_and_check(pg, &[Tensor::from_slice(&[5.0f32]), h])?);
            }
            Ok((clean, unscaled, flags))
        })
        .unwrap();
        for (rank, (clean, unscaled, flags)) in out.iter().enumerate() {
            assert!(!clean, "{backend:?} rank {rank}: finite gradients are no overflow");
            assert_eq!(unscaled, &vec![2.0, -0.5], "{backend:?} rank {rank}: gradients divided by the scale");
            assert_eq!(
                flags,
                &vec![true, true],
                "{backend:?} rank {rank}: rank 2's inf / NaN must make every rank skip"
            );
        }
    }
}

// ---- mixed-precision training (lesson 08) ----

use shardlab::data::{synthetic_corpus, DistributedSampler};
use shardlab::ddp::{self, DataParallel};
use shardlab::model::{Gpt, GptConfig, Model};
use shardlab::optim::AdamWConfig;
use shardlab::zero::{Stage, Zero};

fn flat(ps: &[Tensor]) -> Vec<f32> {
    let all = Tensor::cat(&ps.iter().map(|p| p.detach().to_kind(Kind::Float).reshape([-1])).collect::<Vec<_>>(), 0);
    Vec::<f32>::try_from(&all).unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

/// bf16 autocast-style: the matmuls really run in bf16 (the logits come out bf16), the parameters
/// and their gradients stay fp32, and the loss is close to fp32's but not equal to it.
#[test]
fn bf16_computes_the_matmuls_in_bf16_and_keeps_fp32_masters() {
    let data = synthetic_corpus(4000, 7);
    let batch = DistributedSampler::new(16, 8, 0, 1, 2).unwrap().batch(&data, 0);
    let losses = |p: Precision| {
        let m = Gpt::new(GptConfig::tiny(), 5).unwrap().with_precision(p);
        let logits = m.logits(&batch.x);
        let loss = m.loss(&batch);
        loss.backward();
        let grads: Vec<Tensor> = m.parameters().iter().map(|p| p.grad()).collect();
        (logits.kind(), loss.double_value(&[]), m.parameters()[0].kind(), grads[2].kind(), flat(&grads))
    };
    let (k32, l32, _, _, g32) = losses(Precision::Fp32);
    for p in [Precision::Bf16, Precision::Fp16] {
        let (k, l, pk, gk, g) = losses(p);
        assert_eq!(k, p.kind(), "{p:?}: the logits come from a {p:?} matmul");
        assert_eq!((pk, gk), (Kind::Float, Kind::Float), "{p:?}: parameters and gradients stay fp32");
        assert!(l != l32 && (l - l32).abs() < 0.02, "{p:?}: loss {l} vs fp32 {l32}: close, and not the same numbers");
        let d = max_diff(&g, &g32);
        assert!(d > 0.0 && d < 2e-2, "{p:?}: gradients differ from fp32's by {d}");
    }
    assert_eq!(k32, Kind::Float);
}

/// ZeRO-3 in bf16 (FSDP2's param_dtype = bf16, reduce_dtype = fp32): the model states a rank
/// keeps between steps are 16 bytes per parameter over N — the f32 master shard (4), the f32
/// gradient shard (4), AdamW's m and v (8) — measured from the tensors held, padding aside; the
/// gathered units are bf16, so the transient peak halves; the all-gathers send half the bytes;
/// with reduce_dtype = bf16 the reduce-scatters do too.
#[test]
fn bf16_zero3_holds_16_bytes_per_parameter_over_n_and_gathers_half_the_bytes() {
    let cfg = GptConfig { n_layer: 12, ..GptConfig::tiny() };
    let n = 4usize;
    let out = spawn(n, Backend::Local, move |pg| {
        let mut v = Vec::new();
        for (p, reduce) in
            [(Precision::Fp32, Precision::Fp32), (Precision::Bf16, Precision::Fp32), (Precision::Bf16, Precision::Bf16)]
        {
            let model = Gpt::new(cfg, 1)?.with_precision(p);
            let mut opt = AdamW::new(AdamWConfig { lr: 1e-3, ..AdamWConfig::default() });
            let mut z = Zero::new(pg, Box::new(model), Stage::Three)?.reduce_dtype(reduce);
            let b = DistributedSampler::new(16, 8, pg.rank(), n, 0)?.batch(&synthetic_corpus(4000, 7), 0);
            ddp::train_step(&mut z, &mut opt, &b, 1, StepConfig::lr(1e-3))?; // warm-up: AdamW state exists
            let sent0 = pg.stats().bytes_sent;
            let out = ddp::train_step(&mut z, &mut opt, &b, 1, StepConfig::lr(1e-3))?;
            let sent = pg.stats().bytes_sent - sent0;
            let held_by_model = shardlab::memory::held_bytes(&z.model().parameters());
            v.push((z.memory(&opt), sent, held_by_model, out.loss, z.stats().bytes));
        }
        Ok(v)
    })
    .unwrap();
    let psi = cfg.num_params() as f64;
    let units = 1.0 + cfg.n_layer as f64;
    let nf = n as f64;
    for (rank, runs) in out.iter().enumerate() {
        let (m32, sent32, _, loss32, _) = runs[0];
        let (m16, sent16, held16, loss16, red16) = runs[1];
        let (m_bb, sent_bb, _, _, red_bb) = runs[2];
        let states = (m16.params + m16.grads + m16.optim) as f64;
        assert!(
            (states - 16.0 * psi / nf).abs() <= units * 16.0 * nf,
            "rank {rank}: bf16 ZeRO-3 holds {states} bytes of model states; 16Ψ/N = {}",
            16.0 * psi / nf
        );
        assert_eq!(held16, 0, "rank {rank}: no gathered bf16 unit may outlive the step");
        // The transient peak is gathered units plus flat gradients in flight: bf16 units alone
        // take it part of the way down, bf16 units and bf16 gradients halve it.
        let r16 = m16.peak_transient as f64 / m32.peak_transient as f64;
        let r_bb = m_bb.peak_transient as f64 / m32.peak_transient as f64;
        assert!(r16 > 0.55 && r16 < 0.9, "rank {rank}: bf16 units: peak transient {r16} of fp32's");
        assert!((0.45..0.55).contains(&r_bb), "rank {rank}: bf16 units and gradients: peak transient {r_bb} of fp32's");
        // fp32 ZeRO-3 sends 2 gathers (4 B) + 1 reduce-scatter (4 B) per block unit: 12 B; bf16
        // gathers make it 2·2 + 4 = 8 B (root gathered once: a little more than 2/3); bf16 reductions 6 B.
        let r = sent16 as f64 / sent32 as f64;
        assert!((0.6..0.72).contains(&r), "rank {rank}: bf16 all-gathers: bytes sent {sent16} vs fp32 {sent32} ({r})");
        let r = sent_bb as f64 / sent32 as f64;
        assert!((0.48..0.52).contains(&r), "rank {rank}: bf16 gathers and reductions: {sent_bb} vs {sent32} ({r})");
        assert_eq!(red_bb * 2, red16, "rank {rank}: bf16 reduce-scatters carry half the bytes");
        assert!((loss16 - loss32).abs() < 0.02, "rank {rank}: bf16 loss {loss16} vs fp32 {loss32}");
    }
}

/// ZeRO-1/2/3 in bf16 all compute with the same bf16 parameters and reduce in fp32: with SGD they
/// take the same steps (stage 3 with and without resharding after forward).
#[test]
fn bf16_zero_stages_agree_with_each_other() {
    let cases = [(Stage::One, true), (Stage::Two, true), (Stage::Three, true), (Stage::Three, false)];
    let out = spawn(2, Backend::Local, move |pg| {
        let mut v = Vec::new();
        for (st, reshard) in cases {
            let m = Gpt::new(GptConfig::tiny(), 5)?.with_precision(Precision::Bf16);
            let mut z = Zero::new(pg, Box::new(m), st)?.reshard_after_forward(reshard);
            let s = DistributedSampler::new(16, 8, pg.rank(), 2, 2)?;
            for step in 0..3 {
                ddp::train_step(&mut z, &mut Sgd, &s.batch(&synthetic_corpus(4000, 7), step), 2, StepConfig::lr(0.5))?;
            }
            v.push(flat(&z.full_parameters()?));
        }
        Ok(v)
    })
    .unwrap();
    for (rank, per) in out.iter().enumerate() {
        for (i, got) in per.iter().enumerate().skip(1) {
            let d = max_diff(got, &per[0]);
            assert!(d < 1e-6, "rank {rank}: bf16 {:?} differs from bf16 ZeRO-1 by {d}", cases[i]);
        }
    }
}

/// fp16 with a loss scale far too large: the first steps overflow, every rank skips them together
/// (no weight changes), the scale halves each time, and training then proceeds — for DDP and ZeRO-3.
#[test]
fn fp16_overflowing_steps_are_skipped_on_every_rank_and_the_scale_backs_off() {
    let out = spawn(2, Backend::Local, |pg| {
        let mut v = Vec::new();
        for zero in [false, true] {
            let m = Gpt::new(GptConfig::tiny(), 5)?.with_precision(Precision::Fp16);
            let mut dp: Box<dyn DataParallel> = if zero {
                Box::new(Zero::new(pg, Box::new(m), Stage::Three)?)
            } else {
                ddp::wrap(pg, Box::new(m), ddp::Variant::Bucketed, ddp::DEFAULT_BUCKET_CAP_BYTES)?
            };
            let mut opt = AdamW::new(AdamWConfig { lr: 1e-3, ..AdamWConfig::default() });
            let mut scaler = GradScaler::new(2f64.powi(40));
            let s = DistributedSampler::new(16, 8, pg.rank(), 2, 2)?;
            let mut trace = Vec::new();
            for step in 0..40 {
                let before = flat(&dp.full_parameters()?);
                let o = ddp::train_step_scaled(
                    &mut *dp,
                    &mut opt,
                    &s.batch(&synthetic_corpus(4000, 7), step),
                    1,
                    StepConfig::lr(1e-3),
                    Some(&mut scaler),
                )?;
                let moved = max_diff(&before, &flat(&dp.full_parameters()?)) > 0.0;
                trace.push((o.skipped, o.loss_scale.unwrap(), moved, o.grad_norm.is_finite()));
            }
            v.push((trace, scaler.skipped, scaler.scale()));
        }
        Ok(v)
    })
    .unwrap();
    assert_eq!(out[0], out[1], "both ranks must take the same skip decisions");
    for (trace, skipped, scale) in &out[0] {
        assert!(*skipped >= 3 && *skipped < 40, "overflow steps skipped: {skipped}");
        assert!(*scale < 2f64.powi(40) / 4.0, "the scale backed off to {scale}");
        for (k, &(skip, s, moved, finite)) in trace.iter().enumerate() {
            assert_eq!(skip, !moved, "step {k}: a skipped step must not move the weights, a taken one must");
            assert_eq!(skip, !finite, "step {k}: a skipped step reports a non-finite norm");
            if k > 0 {
                let (prev_skip, prev_s, ..) = trace[k - 1];
                assert_eq!(
                    s,
                    if prev_skip { prev_s / 2.0 } else { prev_s },
                    "step {k}: the scale after step {}",
                    k - 1
                );
            }
        }
        assert!(trace.iter().any(|t| !t.0), "training must get past the overflows");
    }
}

#[test]
fn the_mlp_refuses_mixed_precision_with_a_clear_error() {
    let mut m = shardlab::model::Mlp::new(shardlab::model::MlpConfig { sizes: vec![4, 8, 2] }, 0).unwrap();
    let e = m.set_precision(Precision::Bf16).unwrap_err().to_string();
    assert!(e.contains("fp32 only"), "{e}");
}

/// fp16 under the loss scaler takes the step fp32 takes, up to fp16's rounding: with SGD (whose
/// update is the gradient itself, so a missing or doubled unscale shows) and clipping active, the
/// reported norm is the unscaled one and the parameters follow fp32's.
#[test]
fn fp16_scaled_steps_follow_fp32_with_sgd_and_clipping() {
    let out = spawn(2, Backend::Local, |pg| {
        let mut v = Vec::new();
        for zero in [false, true] {
            let mut per = Vec::new();
            for p in [Precision::Fp32, Precision::Fp16] {
                let m = Gpt::new(GptConfig::tiny(), 5)?.with_precision(p);
                let mut dp: Box<dyn DataParallel> = if zero {
                    Box::new(Zero::new(pg, Box::new(m), Stage::Two)?)
                } else {
                    Box::new(ddp::DdpNaive::new(pg, Box::new(m))?)
                };
                let mut scaler = GradScaler::new(1024.0);
                let s = DistributedSampler::new(16, 8, pg.rank(), 2, 2)?;
                let mut norms = Vec::new();
                for step in 0..3 {
                    let cfg = StepConfig { lr: 0.5, grad_clip: Some(0.5) };
                    let b = s.batch(&synthetic_corpus(4000, 7), step);
                    let sc = (p == Precision::Fp16).then_some(&mut scaler);
                    norms.push(ddp::train_step_scaled(&mut *dp, &mut Sgd, &b, 2, cfg, sc)?.grad_norm);
                }
                per.push((norms, flat(&dp.full_parameters()?)));
            }
            v.push(per);
        }
        Ok(v)
    })
    .unwrap();
    for (rank, per_strategy) in out.iter().enumerate() {
        for (which, per) in ["DdpNaive", "ZeRO-2"].iter().zip(per_strategy) {
            let ((n32, p32), (n16, p16)) = (&per[0], &per[1]);
            for (k, (a, b)) in n32.iter().zip(n16).enumerate() {
                assert!(*a > 0.5, "{which}: clipping must be active (norm {a} > 0.5) for this test to mean anything");
                assert!((a - b).abs() < 0.01 * a, "rank {rank} {which} step {k}: fp16 norm {b} vs fp32 {a}");
            }
            let d = max_diff(p32, p16);
            assert!(d < 2e-3, "rank {rank} {which}: fp16 parameters differ from fp32's by {d}");
        }
    }
}

/// ZeRO-1 accumulates its micro-batches in f32 whatever the reduce dtype, and reduces once in it:
/// with bf16 reduction the reduce-scatters carry half the bytes and the step stays close to fp32's.
#[test]
fn zero1_with_bf16_reduction_accumulates_in_f32() {
    let out = spawn(2, Backend::Local, |pg| {
        let mut v = Vec::new();
        for reduce in [Precision::Fp32, Precision::Bf16] {
            let m = Gpt::new(GptConfig::tiny(), 5)?;
            let mut z = Zero::new(pg, Box::new(m), Stage::One)?.reduce_dtype(reduce);
            let s = DistributedSampler::new(16, 8, pg.rank(), 2, 2)?;
            for step in 0..2 {
                ddp::train_step(&mut z, &mut Sgd, &s.batch(&synthetic_corpus(4000, 7), step), 4, StepConfig::lr(0.5))?;
            }
            v.push((z.stats().bytes, flat(&z.full_parameters()?)));
        }
        Ok(v)
    })
    .unwrap();
    for (rank, v) in out.iter().enumerate() {
        assert_eq!(v[1].0 * 2, v[0].0, "rank {rank}: bf16 reduce-scatters carry half the bytes");
        let d = max_diff(&v[0].1, &v[1].1);
        assert!(d > 0.0 && d < 1e-3, "rank {rank}: bf16-reduced ZeRO-1 differs from fp32-reduced by {d}");
    }
}

/// fp16 without a loss scaler is refused: `train_step` on an fp16 model errs on every rank before
/// anything is computed (no weight changes), under DDP and ZeRO-3; the Trainer's context gives the
/// scaler fp16 needs (`TrainContext::scaler`) and none for bf16 and fp32.
#[test]
fn fp16_without_a_loss_scaler_is_refused_on_every_rank() {
    let out = spawn(2, Backend::Local, |pg| {
        let mut v = Vec::new();
        for zero in [false, true] {
            let m = Gpt::new(GptConfig::tiny(), 5)?.with_precision(Precision::Fp16);
            let mut dp: Box<dyn DataParallel> = if zero {
                Box::new(Zero::new(pg, Box::new(m), Stage::Three)?)
            } else {
                ddp::wrap(pg, Box::new(m), ddp::Variant::Bucketed, ddp::DEFAULT_BUCKET_CAP_BYTES)?
            };
            let mut opt = AdamW::new(AdamWConfig { lr: 1e-3, ..AdamWConfig::default() });
            let b = DistributedSampler::new(16, 8, pg.rank(), 2, 2)?.batch(&synthetic_corpus(4000, 7), 0);
            let before = flat(&dp.full_parameters()?);
            let e = ddp::train_step(&mut *dp, &mut opt, &b, 1, StepConfig::lr(1e-3)).err().map(|e| e.to_string());
            v.push((e.unwrap_or_default(), flat(&dp.full_parameters()?) == before && opt.state_bytes() == 0));
        }
        Ok(v)
    })
    .unwrap();
    for (r, v) in out.iter().enumerate() {
        for (e, unchanged) in v {
            assert!(e.contains("an fp16 model needs a loss scaler"), "rank {r}: {e}");
            assert!(unchanged, "rank {r}: a refused fp16 step changed something");
        }
    }
    let scaler = |precision| {
        let s = ScalingConfig { precision, ..ScalingConfig::default() };
        Trainer::new(s).fit(|ctx| Ok(ctx.scaler().is_some())).unwrap().results[0]
    };
    assert!(scaler(Precision::Fp16) && !scaler(Precision::Bf16) && !scaler(Precision::Fp32));
}
