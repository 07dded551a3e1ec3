//! The Trainer end to end: workers as threads and as processes, metrics streamed to the driver,
//! every strategy through `ctx.prepare`, and configuration errors refused before anything starts.

use shardlab::data::{synthetic_corpus, DistributedSampler};
use shardlab::ddp;
use shardlab::prelude::*;

fn fit(scaling: ScalingConfig) -> anyhow::Result<shardlab::trainer::FitResult<Vec<f64>>> {
    Trainer::new(scaling).fit(|ctx| {
        let data = synthetic_corpus(4000, 7);
        let model = Gpt::new(GptConfig::tiny(), 1)?;
        let (mut dp, mut opt) = ctx.prepare(Box::new(model), &AdamWConfig::default())?;
        let n = ctx.world_size();
        let sampler = DistributedSampler::new(16, 4 * n, ctx.rank(), n, 0)?;
        let mut losses = Vec::new();
        for step in 0..4u64 {
            let local = ddp::train_step(&mut *dp, &mut opt, &sampler.batch(&data, step), 1, StepConfig::lr(1e-3))?.loss;
            let mut l = Tensor::from_slice(&[local]);
            ctx.group().all_reduce(&mut l, ReduceOp::Avg)?;
            losses.push(l.double_value(&[0]));
            ctx.report(json!({"step": step, "loss": losses[step as usize]}))?;
        }
        Ok(losses)
    })
}

fn check(f: shardlab::trainer::FitResult<Vec<f64>>, what: &str) {
    assert_eq!(f.reports.len(), 4, "{what}: rank 0 reported 4 times: {:?}", f.reports);
    for (i, r) in f.reports.iter().enumerate() {
        assert_eq!(r["step"].as_u64(), Some(i as u64), "{what}: reports arrive in order");
        assert_eq!(r["loss"].as_f64(), Some(f.results[0][i]), "{what}: the report carries rank 0's value");
    }
    assert!(f.results.iter().all(|l| l == &f.results[0]), "{what}: every rank saw the same global losses");
}

#[test]
fn every_strategy_through_the_trainer_on_threads() {
    let mut finals = Vec::new();
    for strategy in [Strategy::Ddp, Strategy::Zero1, Strategy::Zero2, Strategy::Zero3] {
        let s = ScalingConfig { num_workers: 2, strategy, ..ScalingConfig::default() };
        let f = fit(s).unwrap();
        finals.push(*f.results[0].last().unwrap());
        check(f, &format!("{strategy:?}"));
    }
    // Same training whatever the strategy (AdamW over 4 steps; float tolerance).
    assert!(finals.iter().all(|l| (l - finals[0]).abs() < 1e-4), "final losses differ by strategy: {finals:?}");
}

#[test]
fn processes_stream_their_reports() {
    let s = ScalingConfig {
        num_workers: 2,
        backend: Backend::Tcp,
        child_args: Some(vec![
            "--exact".into(),
            "processes_stream_their_reports".into(),
            "--nocapture".into(),
            "--test-threads=1".into(),
        ]),
        ..ScalingConfig::default()
    };
    check(fit(s).unwrap(), "tcp processes");
}

#[test]
fn bad_configurations_are_refused() {
    // Asking for a GPU where there is none: an error saying why, never a silent CPU run.
    if shardlab::device::cuda_devices() == 0 {
        let gpu = ScalingConfig { use_gpu: true, ..ScalingConfig::default() };
        assert!(fit(gpu).unwrap_err().to_string().contains("no CUDA device"));
        let gpu = ScalingConfig { device: shardlab::device::DeviceChoice::Cuda, ..ScalingConfig::default() };
        assert!(fit(gpu).unwrap_err().to_string().contains("no CUDA device"));
    } else {
        eprintln!("skipped the no-GPU refusal: a CUDA device is present");
    }
    let none = ScalingConfig { num_workers: 0, ..ScalingConfig::default() };
    assert!(fit(none).unwrap_err().to_string().contains("at least 1"));
    let single = ScalingConfig { num_workers: 2, strategy: Strategy::Single, ..ScalingConfig::default() };
    assert!(fit(single).unwrap_err().to_string().contains("one worker"));
    // An optimizer stepped over one model's slots, then handed another's: a clear error on every
    // rank, not a silent update of the wrong tensors.
    let e = Trainer::new(ScalingConfig { num_workers: 2, strategy: Strategy::Zero3, ..ScalingConfig::default() })
        .fit(|ctx| {
            let data = synthetic_corpus(4000, 7);
            let (mut a, mut opt) = ctx.prepare(Box::new(Gpt::new(GptConfig::tiny(), 0)?), &AdamWConfig::default())?;
            let mut b = ctx.prepare_model(Box::new(Gpt::new(GptConfig { n_layer: 1, ..GptConfig::tiny() }, 0)?))?;
            let batch = DistributedSampler::new(16, 4, ctx.rank(), 2, 0)?.batch(&data, 0);
            ddp::train_step(&mut *a, &mut opt, &batch, 1, StepConfig::lr(1e-3))?;
            ddp::train_step(&mut *b, &mut opt, &batch, 1, StepConfig::lr(1e-3))?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 0") && e.contains("rank 1") && e.contains("other slots"), "{e}");
}

/// The precision in the Trainer config reaches the model before it is wrapped: ZeRO-3 then gathers
/// bf16 units (fewer bytes sent than fp32), and configurations that cannot work are refused.
#[test]
fn the_precision_reaches_the_wrapped_model() {
    let run = |precision: Precision, reduce_dtype: Precision, strategy: Strategy| {
        Trainer::new(ScalingConfig { num_workers: 2, strategy, precision, reduce_dtype, ..ScalingConfig::default() })
            .fit(|ctx| {
                let data = synthetic_corpus(4000, 7);
                let (mut dp, mut opt) =
                    ctx.prepare(Box::new(Gpt::new(GptConfig::tiny(), 1)?), &AdamWConfig::default())?;
                let b = DistributedSampler::new(16, 8, ctx.rank(), 2, 0)?.batch(&data, 0);
                let sent0 = ctx.group().stats().bytes_sent;
                ddp::train_step(&mut *dp, &mut opt, &b, 1, StepConfig::lr(1e-3))?;
                Ok((ctx.group().stats().bytes_sent - sent0, dp.model().precision()))
            })
    };
    let fp32 = run(Precision::Fp32, Precision::Fp32, Strategy::Zero3).unwrap().results[0];
    let bf16 = run(Precision::Bf16, Precision::Fp32, Strategy::Zero3).unwrap().results[0];
    assert_eq!(bf16.1, Precision::Bf16, "the wrapped model computes in bf16");
    let r = bf16.0 as f64 / fp32.0 as f64;
    assert!((0.6..0.75).contains(&r), "bf16 ZeRO-3 gathers half the bytes: sent {} vs fp32 {} ({r})", bf16.0, fp32.0);
    let e = run(Precision::Bf16, Precision::Bf16, Strategy::Ddp).unwrap_err().to_string();
    assert!(e.contains("ZeRO/FSDP option"), "{e}");
    let e = run(Precision::Fp32, Precision::Fp16, Strategy::Zero2).unwrap_err().to_string();
    assert!(e.contains("needs fp16 compute"), "{e}");
}
