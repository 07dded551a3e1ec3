//! Lesson 05's Trainer listing: a per-worker DDP training loop on two ranks, Ray Train style.
//!
//! `cargo run --release --example trainer_fit` (`tests/docs.rs` checks that lesson 05's text and
//! `src/trainer/mod.rs` show exactly the lines between the `listing` markers, and runs this).

fn main() -> anyhow::Result<()> {
    // listing: begin
    use serde_json::json;
    use shardlab::ddp::train_step;
    use shardlab::prelude::*;

    let scaling = ScalingConfig {
        num_workers: 2,
        backend: Backend::Tcp,
        strategy: Strategy::Ddp,
        variant: Variant::Bucketed,
        bucket_cap_bytes: 4 << 20,
        ..ScalingConfig::default()
    };
    let fit = Trainer::new(scaling).progress(20).fit(|ctx| {
        let data = synthetic_corpus(1_000_000, 1);
        let model = Gpt::new(GptConfig::bench(), 0)?;
        // DDP: rank 0's weights broadcast; the AdamW is ours, stepped by train_step.
        let (mut dp, mut opt) = ctx.prepare(Box::new(model), &AdamWConfig::default())?;
        let n = ctx.world_size();
        let sampler = DistributedSampler::new(128, 8 * n, ctx.rank(), n, 0)?;
        let schedule = LrSchedule { max_lr: 1e-3, min_lr: 1e-4, warmup_iters: 2, decay_iters: 20 };
        for step in 0..20u64 {
            let cfg = StepConfig { lr: schedule.lr(step), grad_clip: Some(1.0) };
            let out = train_step(&mut *dp, &mut opt, &sampler.batch(&data, step), 1, cfg)?;
            // This rank's local loss; the gradient norm is global (the same on every rank).
            ctx.report(json!({"step": step, "loss": out.loss, "grad_norm": out.grad_norm}))?;
        }
        Ok(dp.stats().hidden_fraction())
    })?;
    println!("rank 0 reported {} times; rank 1 hid {:.0}%", fit.reports.len(), 100.0 * fit.results[1]);
    // listing: end
    Ok(())
}
