//! Lesson 05's Trainer listing: a per-worker DDP training loop on two ranks, Ray Train style.
//!
//! `cargo run --release --example trainer_fit` (`tests/docs.rs` checks that lesson 05's text and
//! `src/trainer.rs` show exactly the lines between the `listing` markers, and runs this).

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
        let mut opt = AdamWConfig::default().build(&model)?;
        let mut dp = ctx.prepare_model(Box::new(model))?; // DDP: rank 0's weights broadcast
        let n = ctx.world_size();
        let sampler = DistributedSampler::new(128, 8 * n, ctx.rank(), n, 0)?;
        for step in 0..20u64 {
            let loss = train_step(&mut *dp, &mut opt, &sampler.batch(&data, step), 1)?;
            ctx.report(json!({"step": step, "loss": loss}))?; // this rank's local loss
        }
        Ok(dp.stats().hidden_fraction())
    })?;
    println!("rank 0 reported {} times; rank 1 hid {:.0}%", fit.reports.len(), 100.0 * fit.results[1]);
    // listing: end
    Ok(())
}
