//! What a strategy says it holds between steps (`DataParallel::memory`: parameters, gradients,
//! optimizer state, offloaded state; for the engine's tensor-, pipeline- and 3-D-parallel layouts
//! `Engine::memory` and its kept gradient buffers) against what the process's allocator gets back
//! when the strategy and its optimizer are dropped after three steps (the engine's communicators
//! kept: their buffers are not model states) — measured from outside the strategy:
//! glibc's `mallinfo2`, with every allocation of 64 KiB or more in a mapping of its own and one
//! arena for every thread (so the count is exact for tensors and covers every rank-thread).
//! libtorch's own caches (kernels' scratch space, kept by the process whatever the layout) outlive
//! the drop and are not counted on either side. A buffer a strategy keeps but does not count — a
//! weight-decay mask the size of a shard, a second copy of the gradients in flat buckets, the base
//! tensor a sliced parameter was a view of — shows up as a difference, and the test fails above 5%.
//!
//! One test in its own binary: the allocator settings and the measurement are process-wide.

use shardlab::ddp::{self, DataParallel, Variant};
use shardlab::prelude::*;
use shardlab::zero::{Stage, Zero};

/// Bytes the allocator has handed out and not had back: the arenas' chunks in use plus the
/// mapped blocks.
fn heap_bytes() -> u64 {
    // SAFETY: mallinfo2 only reads the allocator's counters.
    let m = unsafe { libc::mallinfo2() };
    (m.uordblks + m.hblkhd) as u64
}

/// A GPT of about 3.2 M parameters (12.8 MB in f32): model states of 25–100 MB per layout, far
/// above what a step leaves behind besides them (a batch, the stage runner's bookkeeping).
fn cfg() -> GptConfig {
    GptConfig { vocab_size: 256, block_size: 32, n_layer: 4, n_head: 4, n_embd: 256 }
}

fn wrap<'a>(pg: &'a ProcessGroup, layout: &str) -> anyhow::Result<Box<dyn DataParallel + 'a>> {
    let precision = if layout.ends_with("bf16") { Precision::Bf16 } else { Precision::Fp32 };
    let model = Box::new(Gpt::new(cfg(), 1)?.with_precision(precision));
    Ok(match layout {
        "ddp naive" => ddp::wrap(pg, model, Variant::Naive, ddp::DEFAULT_BUCKET_CAP_BYTES)?,
        "ddp bucketed" => ddp::wrap(pg, model, Variant::Bucketed, 1 << 20)?,
        "zero1" => Box::new(Zero::new(pg, model, Stage::One)?),
        "zero2" => Box::new(Zero::new(pg, model, Stage::Two)?),
        "zero3" => Box::new(Zero::new(pg, model, Stage::Three)?),
        "zero3 bf16" => Box::new(Zero::new(pg, model, Stage::Three)?),
        "zero2 offload" => Box::new(Zero::new(pg, model, Stage::Two)?.offload(true)),
        other => anyhow::bail!("no layout {other}"),
    })
}

#[test]
fn every_strategys_held_bytes_are_what_the_allocator_holds() {
    // SAFETY: set before any other thread of this binary starts (it has this one test), so no
    // allocation races the change; SHARDLAB_MALLOC_DEFAULT keeps spawn from raising the mapping
    // threshold again (launch::keep_freed_memory).
    unsafe {
        std::env::set_var("SHARDLAB_MALLOC_DEFAULT", "1");
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 10);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
    let data = synthetic_corpus(20_000, 7);
    let mut report = Vec::new();
    for layout in ["ddp naive", "ddp bucketed", "zero1", "zero2", "zero3", "zero3 bf16", "zero2 offload"] {
        let out = spawn(2, Backend::Local, |pg| {
            let sampler = DistributedSampler::new(32, 8, pg.rank(), 2, 0)?;
            let batches: Vec<Batch> = (0..3).map(|s| sampler.batch(&data, s)).collect();
            // Rank 0 reads the allocator while every rank waits between two barriers.
            let read = |pg: &ProcessGroup| -> anyhow::Result<u64> {
                pg.barrier()?;
                let b = if pg.rank() == 0 { heap_bytes() } else { 0 };
                pg.barrier()?;
                Ok(b)
            };
            let mut dp = wrap(pg, layout)?;
            let mut opt = AdamW::new(AdamWConfig::default());
            for b in &batches {
                ddp::train_step(&mut *dp, &mut opt, b, 1, StepConfig::lr(1e-3))?;
            }
            let m = dp.memory(&opt);
            let holding = read(pg)?;
            drop((dp, opt));
            let released = read(pg)?;
            Ok((holding, released, m.model_states() + m.offloaded))
        })
        .unwrap();
        let counted: u64 = out.iter().map(|o| o.2).sum();
        let measured = out[0].0 as i64 - out[0].1 as i64;
        let off = (measured - counted as i64) as f64 / counted as f64;
        let line = format!("{layout}: counted {counted} B, dropping them released {measured} B ({:+.1}%)", off * 100.0);
        println!("{line}");
        report.push((line, off.abs() <= 0.05));
    }
    // The engine's layouts (tensor and pipeline pieces, DDP or ZeRO over dp): what it keeps
    // between steps is the piece's parameters (ZeRO: their flat buffers and master shards), the
    // kept gradient buffers (ZeRO's shards, ZeRO-1's flat gradients; a DDP piece keeps none: its
    // gradients live in the step) and AdamW's state.
    use shardlab::engine::{parallelize, DataDim, ParallelDims, Plan};
    use shardlab::pipeline::PipelineConfig;
    let tokens = &data;
    for (layout, pp, dp, tp, data) in [
        ("tp2", 1, 1, 2, DataDim::Replicate),
        ("pp2", 2, 1, 1, DataDim::Replicate),
        ("zero2:dp2×tp2", 1, 2, 2, DataDim::Zero(Stage::Two)),
        ("zero1:dp2×pp2", 2, 2, 1, DataDim::Zero(Stage::One)),
        ("zero3:dp2×tp2×pp2", 2, 2, 2, DataDim::Zero(Stage::Three)),
    ] {
        let out = spawn(pp * dp * tp, Backend::Local, |pg| {
            let plan = Plan {
                pipeline: PipelineConfig { stages: pp, micro_batches: 2, ..Default::default() },
                ..Plan::new(ParallelDims { pp, dp, tp }, data)
            };
            let read = |pg: &ProcessGroup| -> anyhow::Result<u64> {
                pg.barrier()?;
                let b = if pg.rank() == 0 { heap_bytes() } else { 0 };
                pg.barrier()?;
                Ok(b)
            };
            let mut e = parallelize(pg, &plan, &cfg(), &|keep| Gpt::new_only(cfg(), 1, keep))?;
            let sampler = DistributedSampler::new(32, 8, e.mesh().coord("dp"), dp, 0)?;
            let mut opt = AdamW::new(AdamWConfig::default());
            for s in 0..3 {
                e.train_step(&sampler.batch(&tokens, s), &mut opt, 1e-3, Some(1.0))?;
            }
            let m = e.memory(&opt);
            let kept = m.params + m.optim + shardlab::memory::held_bytes(e.kept_grads().iter());
            let holding = read(pg)?;
            // The mesh's communicators keep buffers of their own (not model states): kept.
            let mesh = e.into_mesh();
            drop(opt);
            let released = read(pg)?;
            drop(mesh);
            Ok((holding, released, kept))
        })
        .unwrap();
        let counted: u64 = out.iter().map(|o| o.2).sum();
        let measured = out[0].0 as i64 - out[0].1 as i64;
        let off = (measured - counted as i64) as f64 / counted as f64;
        let line = format!("{layout}: counted {counted} B, dropping them released {measured} B ({:+.1}%)", off * 100.0);
        println!("{line}");
        report.push((line, off.abs() <= 0.05));
    }
    // Over 5%: the ranks' strategies and optimizers gave the allocator back more (or less) than they
    // said they hold between steps — a buffer kept and not counted, or counted and not kept.
    let bad: Vec<&str> = report.iter().filter(|(_, ok)| !ok).map(|(l, _)| l.as_str()).collect();
    assert!(bad.is_empty(), "held bytes not what the allocator holds (over 5% off):\n{}", bad.join("\n"));
}
