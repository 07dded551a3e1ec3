//! ZeRO stages 1–3 (3 = FSDP) train exactly like one process: for N = 1..4 ranks on both
//! backends, DDP, ZeRO-1, ZeRO-2 and ZeRO-3 end, after several AdamW steps, with the same
//! parameters as a single process on the concatenated global batch using libtorch's own AdamW
//! (tch `nn::AdamW`, same hyper-parameters) — including unit sizes that do not divide by N
//! (the tiny GPT's units have 12 704 and 2 624 elements: N = 3 pads both); the ranks step
//! shardlab's AdamW over their shards. Also: the bytes each rank holds, measured from its tensors
//! (`held_bytes`), match the fp32 ZeRO model up to padding — ZeRO-1 with 4Ψ + 4Ψ/N of gradients
//! (its full buffer and its averaged shard) — and SGD steps match one process for every stage.

use shardlab::data::{synthetic_corpus, DistributedSampler, Tokens};
use shardlab::ddp::{self, DataParallel, Variant};
use shardlab::model::{Gpt, GptConfig, Model};
use shardlab::optim::AdamWConfig;
use shardlab::prelude::*;
use shardlab::zero::{Stage, Zero};

const STEPS: u64 = 3;
const GLOBAL: usize = 12;

fn corpus() -> Tokens {
    synthetic_corpus(4000, 7)
}

/// eps 1e-6 instead of 1e-8: a few gradient elements are zero up to rounding (e.g. the attention
/// key biases), and Adam would turn their rounding noise into lr-sized steps that differ between
/// two correct implementations; a larger eps keeps those steps tiny without changing the rest.
fn opt_cfg() -> AdamWConfig {
    AdamWConfig { lr: 3e-3, eps: 1e-6, ..AdamWConfig::default() }
}

fn flat(ps: &[Tensor]) -> Vec<f32> {
    let all = Tensor::cat(&ps.iter().map(|p| p.detach().reshape([-1])).collect::<Vec<_>>(), 0);
    Vec::<f32>::try_from(&all).unwrap()
}

fn single_process() -> Vec<f32> {
    let data = corpus();
    let m = Gpt::new(GptConfig::tiny(), 5).unwrap();
    let mut opt = opt_cfg().build(&m).unwrap();
    let s = DistributedSampler::new(16, GLOBAL, 0, 1, 2).unwrap();
    for step in 0..STEPS {
        m.loss(&s.batch(&data, step)).backward();
        opt.step();
        opt.zero_grad();
    }
    flat(&m.parameters())
}

#[derive(Clone, Copy, Debug)]
enum Strat {
    Ddp,
    Zero(Stage),
    /// ZeRO-3 keeping gathered units from forward to backward (no recompute).
    Zero3NoReshard,
    /// ZeRO-3 with both blocks of the tiny GPT in one unit.
    Zero3TwoBlockUnits,
    /// ZeRO-2 with both blocks in one unit and gradient accumulation.
    Zero2TwoBlockUnits,
}

const STRATS: [Strat; 7] = [
    Strat::Ddp,
    Strat::Zero(Stage::One),
    Strat::Zero(Stage::Two),
    Strat::Zero(Stage::Three),
    Strat::Zero3NoReshard,
    Strat::Zero3TwoBlockUnits,
    Strat::Zero2TwoBlockUnits,
];

/// Run every strategy on this rank (accumulation 2 for stage 1: the no_sync path).
fn run_all(pg: &ProcessGroup) -> anyhow::Result<Vec<Vec<f32>>> {
    let data = corpus();
    let mut out = Vec::new();
    for strat in STRATS {
        let model = Gpt::new(GptConfig::tiny(), 5 + pg.rank() as u64)?; // broadcast must fix the init
        let mut opt = AdamW::new(opt_cfg()); // shardlab's, over shards; the reference is libtorch's
        let (mut dp, accum): (Box<dyn DataParallel>, i64) = match strat {
            Strat::Ddp => (ddp::wrap(pg, Box::new(model), Variant::Bucketed, 16 * 1024)?, 1),
            Strat::Zero(st) => (Box::new(Zero::new(pg, Box::new(model), st)?), if st == Stage::One { 2 } else { 1 }),
            Strat::Zero3NoReshard => {
                (Box::new(Zero::new(pg, Box::new(model), Stage::Three)?.reshard_after_forward(false)), 2)
            }
            Strat::Zero3TwoBlockUnits => {
                (Box::new(Zero::with_blocks_per_unit(pg, Box::new(model), Stage::Three, 2)?), 1)
            }
            Strat::Zero2TwoBlockUnits => (Box::new(Zero::with_blocks_per_unit(pg, Box::new(model), Stage::Two, 2)?), 2),
        };
        let s = DistributedSampler::new(16, GLOBAL, pg.rank(), pg.world_size(), 2)?;
        for step in 0..STEPS {
            ddp::train_step(&mut *dp, &mut opt, &s.batch(&data, step), accum, StepConfig::lr(opt_cfg().lr))?;
        }
        // ZeRO-3 keeps only shards: full_parameters all-gathers them unit by unit.
        out.push(flat(&dp.full_parameters()?));
    }
    Ok(out)
}

fn check(results: Vec<Vec<Vec<f32>>>, what: &str) {
    let reference = single_process();
    for (rank, per) in results.iter().enumerate() {
        for (strat, got) in STRATS.iter().zip(per) {
            assert_eq!(got.len(), reference.len(), "{what} rank {rank} {strat:?}: parameter count");
            let worst = got.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 2e-5, "{what} rank {rank} {strat:?}: parameters differ from one process by {worst}");
        }
    }
}

#[test]
fn every_stage_matches_one_process_local() {
    for n in 1..=4 {
        check(spawn(n, Backend::Local, run_all).unwrap(), &format!("local n={n}"));
    }
}

#[test]
fn every_stage_matches_one_process_tcp() {
    for n in 1..=4 {
        let opts = SpawnOptions::new(n, Backend::Tcp).launch(Launch::Threads);
        check(spawn_with(opts, run_all).unwrap(), &format!("tcp n={n}"));
    }
}

#[test]
fn larger_units_make_fewer_collectives() {
    // Four blocks: one unit each (4 block units + the root), or two per unit (2 + the root).
    // ZeRO-3 gathers the root once per step and each block unit twice (forward, backward), and
    // reduce-scatters every unit once: counted by the group itself (CommStats).
    let cfg = GptConfig { n_layer: 4, ..GptConfig::tiny() };
    let out = spawn(2, Backend::Local, move |pg| {
        let mut v = Vec::new();
        for k in [1, 2, 3, 4, 5] {
            let model = Gpt::new(cfg, 1)?;
            let mut opt = AdamW::new(opt_cfg());
            let mut z = Zero::with_blocks_per_unit(pg, Box::new(model), Stage::Three, k)?;
            let b = DistributedSampler::new(16, 8, pg.rank(), 2, 0)?.batch(&corpus(), 0);
            let before = pg.stats();
            ddp::train_step(&mut z, &mut opt, &b, 1, StepConfig::lr(1e-3))?;
            let ran = pg.stats().since(&before);
            v.push((k, ran.calls(OpKind::AllGather), ran.calls(OpKind::ReduceScatter), ran.calls(OpKind::AllReduce)));
        }
        let zero_blocks = Zero::with_blocks_per_unit(pg, Box::new(Gpt::new(cfg, 1)?), Stage::Three, 0);
        anyhow::ensure!(zero_blocks.is_err(), "0 blocks per unit must be refused");
        Ok(v)
    })
    .unwrap();
    for (k, gathers, scatters, reduces) in &out[0] {
        let units = 4_usize.div_ceil(*k); // 3 blocks per unit: [0 1 2] [3]; 5: one unit
        assert_eq!(*gathers, 1 + 2 * units as u64, "{k} blocks per unit: all-gathers per step");
        assert_eq!(*scatters, 1 + units as u64, "{k} blocks per unit: reduce-scatters per step");
        assert_eq!(*reduces, 1, "{k} blocks per unit: one all-reduce (8 bytes: the global gradient norm)");
    }
}

#[test]
fn memory_per_rank_is_measured_from_the_tensors_held() {
    // fp32 training: params 4 B, grads 4 B, AdamW m and v 8 B per parameter (K = 8, no master copy),
    // each counted by `held_bytes` from the tensors the rank keeps after a step, not from layouts.
    // Twelve blocks, so that ZeRO-3's transient buffers — the root unit and its gradient, two
    // gathered blocks (current + prefetched) and up to three blocks' flat gradients (one being
    // accumulated, two reductions in flight) — are a fraction of the model.
    let cfg = GptConfig { n_layer: 12, ..GptConfig::tiny() };
    let out = spawn(4, Backend::Local, move |pg| {
        let mut v = Vec::new();
        for (st, reshard) in [(Stage::One, true), (Stage::Two, true), (Stage::Three, true), (Stage::Three, false)] {
            let model = Gpt::new(cfg, 1)?;
            let mut opt = AdamW::new(opt_cfg());
            let mut z = Zero::new(pg, Box::new(model), st)?.reshard_after_forward(reshard);
            let b = DistributedSampler::new(16, 8, pg.rank(), 4, 0)?.batch(&corpus(), 0);
            for step in 0..2 {
                ddp::train_step(&mut z, &mut opt, &b, 1 + step, StepConfig::lr(1e-3))?;
            }
            // Between steps, ZeRO-3's parameters are empty placeholders: any storage left behind
            // (a unit never released) shows here.
            let model_held = shardlab::memory::held_bytes(&z.model().parameters());
            v.push((z.memory(&opt), model_held));
        }
        Ok(v)
    })
    .unwrap();
    let psi = cfg.num_params() as f64;
    let n = 4.0;
    let units = 1.0 + cfg.n_layer as f64;
    for mems in out {
        let [m1, m2, m3, m3k] = [mems[0].0, mems[1].0, mems[2].0, mems[3].0];
        let close = |got: u64, want: f64, what: &str| {
            // Up to padding: each unit pads by fewer than N elements of 4 bytes.
            assert!((got as f64 - want).abs() <= units * 4.0 * n, "{what}: {got} bytes held, the model says {want}");
        };
        close(m1.params, 4.0 * psi, "ZeRO-1 params");
        close(m1.grads, 4.0 * psi + 4.0 * psi / n, "ZeRO-1 grads (full, and the averaged shard)");
        close(m1.optim, 8.0 * psi / n, "ZeRO-1 optimizer");
        close(m2.params, 4.0 * psi, "ZeRO-2 params");
        close(m2.grads, 4.0 * psi / n, "ZeRO-2 grads");
        close(m2.optim, 8.0 * psi / n, "ZeRO-2 optimizer");
        for (m, what) in [(m3, "ZeRO-3"), (m3k, "ZeRO-3 without resharding after forward")] {
            close(m.params, 4.0 * psi / n, &format!("{what} params"));
            close(m.grads, 4.0 * psi / n, &format!("{what} grads"));
            close(m.optim, 8.0 * psi / n, &format!("{what} optimizer"));
        }
        assert_eq!(mems[2].1, 0, "ZeRO-3: the model's parameters hold no storage between steps");
        assert_eq!(mems[3].1, 0, "ZeRO-3 (no reshard after forward): no storage between steps either");
        assert!(
            m3.peak_transient > 0 && (m3.peak_transient as f64) < 0.6 * 4.0 * psi,
            "ZeRO-3 must never hold the whole model at once: peak transient {} bytes of {}",
            m3.peak_transient,
            4.0 * psi
        );
    }
}

/// With SGD the update is the gradient times lr, so `Sum` instead of `Avg` in the reduce-scatter,
/// a dropped accumulation share or a gradient counted twice changes the parameters (AdamW would
/// cancel a constant factor). Reference: one process, the whole global batch, libtorch's SGD.
#[test]
fn sgd_steps_match_one_process_for_every_stage_with_uneven_accumulation() {
    use tch::nn::OptimizerConfig;
    // (ranks, global batch, accumulation): 10 rows on 2 ranks cut 1 + 2 + 2; 12 on 3 cut 1 + 1 + 2.
    for (n, global, accum) in [(1usize, 12usize, 3i64), (2, 10, 3), (3, 12, 3), (4, 12, 2)] {
        let reference = {
            let data = corpus();
            let m = Gpt::new(GptConfig::tiny(), 5).unwrap();
            let mut opt = tch::nn::Sgd::default().build(m.var_store(), 0.5).unwrap();
            for step in 0..STEPS {
                m.loss(&DistributedSampler::new(16, global, 0, 1, 2).unwrap().batch(&data, step)).backward();
                opt.step();
                opt.zero_grad();
            }
            flat(&m.parameters())
        };
        let cases = [(Stage::One, true), (Stage::Two, true), (Stage::Three, true), (Stage::Three, false)];
        let out = spawn(n, Backend::Local, move |pg| {
            let mut v = Vec::new();
            for (st, reshard) in cases {
                let data = corpus();
                let m = Gpt::new(GptConfig::tiny(), 5 + pg.rank() as u64)?;
                let mut z = Zero::new(pg, Box::new(m), st)?.reshard_after_forward(reshard);
                let s = DistributedSampler::new(16, global, pg.rank(), n, 2)?;
                for step in 0..STEPS {
                    ddp::train_step(&mut z, &mut Sgd, &s.batch(&data, step), accum, StepConfig::lr(0.5))?;
                }
                v.push(flat(&z.full_parameters()?));
            }
            Ok(v)
        })
        .unwrap();
        for (rank, per) in out.iter().enumerate() {
            for ((st, reshard), got) in cases.iter().zip(per) {
                let worst = got.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(
                    worst < 1e-6,
                    "n={n} accum={accum} rank {rank} {st:?} (reshard {reshard}): SGD parameters differ from one \
                     process by {worst}"
                );
            }
        }
    }
}

#[test]
fn held_bytes_counts_each_byte_once() {
    use shardlab::memory::held_bytes;
    let flat = Tensor::zeros([100], (Kind::Float, Device::Cpu));
    let a = flat.narrow(0, 0, 60);
    let b = flat.narrow(0, 40, 60); // overlaps a by 20 elements
    assert_eq!(held_bytes([&a, &b]), 400, "two overlapping views of one buffer: its 100 floats once");
    assert_eq!(held_bytes([&flat, &a, &b]), 400, "the buffer and its views: once");
    assert_eq!(held_bytes([&a]), 240, "a view alone: the bytes it spans");
    let other = Tensor::zeros([10], (Kind::Double, Device::Cpu));
    assert_eq!(held_bytes([&a, &other]), 240 + 80, "separate storages add up, each in its own dtype");
    let m = Tensor::zeros([4, 5], (Kind::Float, Device::Cpu));
    let col = m.narrow(1, 0, 1); // a column: strided, spans rows 0..4 of the matrix
    assert_eq!(held_bytes([&col]), (3 * 5 + 1) * 4, "a strided view spans from its first to its last element");
    assert_eq!(
        held_bytes([&Tensor::new(), &Tensor::zeros([0], (Kind::Float, Device::Cpu))]),
        0,
        "undefined and empty hold nothing"
    );
}

/// CPU offload (lesson 11) changes where the master shards, their gradients and AdamW's state
/// live, not the arithmetic: for every stage, in fp32 and bf16, offloaded training ends with
/// bitwise the parameters of the same run without offload. What stays on the device is measured
/// from the tensors held: for ZeRO-2 in bf16, the working parameters (2Ψ) and nothing else between
/// steps, with the masters, gradient shards and AdamW state (16Ψ/N) in host memory; and the bytes
/// copied each way per step are the shards' (down: f32 gradient shards, 4Ψ/N; up: bf16 parameter
/// shards, 2Ψ/N — ZeRO-3 copies a shard up for each of its gathers instead).
#[test]
fn offload_keeps_the_arithmetic_and_moves_the_model_states_to_the_host() {
    use shardlab::precision::Precision;
    let cfg = GptConfig { n_layer: 4, ..GptConfig::tiny() };
    let steps = 3u64;
    let out = spawn(2, Backend::Local, move |pg| {
        let mut v = Vec::new();
        for precision in [Precision::Fp32, Precision::Bf16] {
            for st in [Stage::One, Stage::Two, Stage::Three] {
                let mut per = Vec::new();
                for offload in [false, true] {
                    let mut model = Gpt::new(cfg, 3)?;
                    model.set_precision(precision)?;
                    let mut opt = AdamW::new(opt_cfg());
                    let mut z = Zero::new(pg, Box::new(model), st)?.offload(offload);
                    let s = DistributedSampler::new(16, 8, pg.rank(), 2, 1)?;
                    for step in 0..steps {
                        ddp::train_step(&mut z, &mut opt, &s.batch(&corpus(), step), 1, StepConfig::lr(1e-3))?;
                    }
                    per.push((flat(&z.full_parameters()?), z.memory(&opt), z.stats()));
                }
                v.push((precision, st, per));
            }
        }
        Ok(v)
    })
    .unwrap();
    let psi = cfg.num_params() as f64;
    let units = 1.0 + cfg.n_layer as f64;
    let close = |got: u64, want: f64, what: &str| {
        // Up to padding: each unit pads by fewer than N = 2 elements of at most 4 bytes.
        assert!((got as f64 - want).abs() <= units * 8.0, "{what}: {got} bytes, the model says {want}");
    };
    for (rank, runs) in out.into_iter().enumerate() {
        for (precision, st, per) in runs {
            let what = format!("rank {rank} {st:?} {}", precision.name());
            let ((plain, m0, s0), (off, m1, s1)) = (&per[0], &per[1]);
            assert!(plain == off, "{what}: offload changed the parameters");
            assert_eq!(m0.offloaded, 0, "{what}: nothing is offloaded without offload");
            assert_eq!(m1.optim, 0, "{what}: AdamW's state must live in host memory");
            close(m1.offloaded, 16.0 * psi / 2.0, &format!("{what}: masters + gradient shards + AdamW in host memory"));
            assert_eq!((s0.d2h_bytes, s0.h2d_bytes), (0, 0), "{what}: no copies without offload");
            close(s1.d2h_bytes / steps, 4.0 * psi / 2.0, &format!("{what}: gradient shards copied down per step"));
            let elt = if precision == Precision::Bf16 { 2.0 } else { 4.0 };
            if st == Stage::Three {
                // One copy up per gather: the root once per step, each block twice (forward and
                // backward with resharding), and the step's end gathers nothing.
                assert!(s1.h2d_bytes > 0, "{what}: shards copied up for the gathers");
            } else {
                close(s1.h2d_bytes / steps, elt * psi / 2.0, &format!("{what}: parameter shards copied up per step"));
                // The device keeps only the working parameters between steps.
                close(m1.params, elt * psi, &format!("{what}: working parameters on the device"));
                if st == Stage::Two {
                    assert_eq!(m1.grads, 0, "{what}: no gradient kept on the device between steps");
                }
            }
        }
    }
}
