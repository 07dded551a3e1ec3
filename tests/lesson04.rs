//! Grader for lesson 04 (toy DDP).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/04_toy_ddp/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 04` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong.

#[path = "../lessons/04_toy_ddp/exercise.rs"]
mod exercise_code;
#[path = "../solutions/04_toy_ddp.rs"]
mod solution_code;

use shardlab::data::{synthetic_corpus, DistributedSampler};
use shardlab::model::{Batch, Gpt, GptConfig, Mlp, MlpConfig, Model};
use shardlab::prelude::*;

shardlab::graders! {
    lesson: "04", exercise_file: "lessons/04_toy_ddp/exercise.rs";

    /// shardlab's own copies of what each exercise builds (exercise K: `TWINS[K - 1]`): an exercise
    /// that names one is refused ("write it yourself").
    const TWINS: &[&[&str]] = &[&["DistributedSampler", ".local_batch", ".local_offsets", "ddp::micro_batches", "comm::segment", "algo::segment", "plan::owned_range"], &["params::broadcast_params", "ddp::assign_buckets", "DdpNaive", "DdpBucketed", "shardlab::ddp"], &["shardlab::ddp", "ddp::average_gradients", "naive::average_gradients", "DdpNaive", "DdpBucketed", "DataParallel"], &["shardlab::ddp", "DataParallel", "DdpNaive", "DdpBucketed", "train_step", "train_step_scaled", "Trainer"]];

    const GLOBAL: usize = 12;
    const STEPS: u64 = 3;

    fn tcp_threads(n: usize) -> SpawnOptions {
        SpawnOptions::new(n, Backend::Tcp).launch(Launch::Threads)
    }

    #[test]
    fn ex1_shard_rows_split_the_global_batch() {
        shardlab::grading::refuse_twins(GRADER, 1, TWINS[0]);
        for n in 1..=6 {
            for g in [n, 2 * n, 12 * n] {
                let parts: Vec<_> = (0..n).map(|r| shard_rows(g, r, n)).collect();
                assert!(
                    parts.windows(2).all(|w| w[0].end <= w[1].start),
                    "g={g} n={n}: ranks' rows overlap (a row trained twice, another never): {parts:?}"
                );
                assert_eq!(parts[0].start, 0, "g={g} n={n}: rank 0 starts at row 0");
                assert_eq!(parts[n - 1].end, g, "g={g} n={n}: the last rank ends at row {g}");
                assert!(
                    parts.windows(2).all(|w| w[0].end == w[1].start),
                    "g={g} n={n}: contiguous, in rank order: {parts:?}"
                );
                assert!(parts.iter().all(|p| p.len() == g / n), "g={g} n={n}: equal shares: {parts:?}");
            }
        }
    }

    /// Parameters that differ per seed (our own generator: libtorch's global one is shared by thread ranks).
    fn params(seed: u64) -> Vec<Tensor> {
        let mut rng = shardlab::rng::Rng::new(seed);
        [5usize, 300, 1].iter().map(|&n| Tensor::from_slice(&rng.normal_vec(n, 1.0)).set_requires_grad(true)).collect()
    }

    #[test]
    fn ex2_every_rank_starts_from_rank_0s_weights_in_few_messages() {
        shardlab::grading::refuse_twins(GRADER, 2, TWINS[1]);
        // Parameters of 5, 300 and 1 f32 = 20, 1200 and 4 bytes. Buckets of consecutive parameters:
        // cap 1 B → each alone, 3 broadcasts; cap 1220 B → [20 + 1200] [4], 2; cap 1 MiB → one.
        for (cap, want) in [(1usize, 3u64), (1220, 2), (1 << 20, 1)] {
            for opts in [SpawnOptions::new(3, Backend::Local), tcp_threads(3)] {
                let out = spawn_with(opts, move |pg| {
                    let mut p = params(100 + pg.rank() as u64);
                    let before = pg.stats();
                    sync_initial_weights(pg, &mut p, cap)?;
                    let ran = pg.stats().since(&before);
                    anyhow::ensure!(
                        ran.calls(OpKind::Broadcast) == want && ran.collectives == want && ran.p2p == 0,
                        "rank {}, buckets of at most {cap} bytes: {want} broadcast(s) move these 20 + 1200 + 4 \
                         bytes; you made {}",
                        pg.rank(),
                        ran.describe_calls()
                    );
                    Ok(shardlab::params::checksum(&p))
                })
                .unwrap_or_else(|e| panic!("cap {cap}: {e}"));
                let rank0 = shardlab::params::checksum(&params(100));
                assert!(out.iter().all(|&c| c == rank0), "cap {cap}: every rank must hold rank 0's initial weights");
            }
        }
    }

    #[test]
    fn ex3_gradients_are_averaged_in_place() {
        shardlab::grading::refuse_twins(GRADER, 3, TWINS[2]);
        for (backend, opts) in [(Backend::Local, SpawnOptions::new(4, Backend::Local)), (Backend::Tcp, tcp_threads(4))] {
            let out = spawn_with(opts, |pg| {
                let r = pg.rank() as f64;
                let params: Vec<Tensor> = [3i64, 1000, 7]
                    .iter()
                    .map(|&n| Tensor::zeros([n], (Kind::Float, Device::Cpu)).set_requires_grad(true))
                    .collect();
                // grad of p_i · (r + 1 + i·j) summed: rank r's gradient element j of tensor i is r + 1 + i·j.
                let loss = params
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let c = Tensor::arange(p.numel() as i64, (Kind::Float, Device::Cpu)) * (i as f64) + (r + 1.0);
                        (p * c).sum(Kind::Float)
                    })
                    .reduce(|a, b| a + b)
                    .unwrap();
                loss.backward();
                average_gradients(pg, &params)?;
                Ok(params.iter().map(|p| Vec::<f32>::try_from(&p.grad()).unwrap()).collect::<Vec<_>>())
            })
            .unwrap();
            // Expected: mean over r of (r + 1 + i·j) = 2.5 + i·j for 4 ranks.
            for (rank, grads) in out.iter().enumerate() {
                for (i, g) in grads.iter().enumerate() {
                    for (j, &v) in g.iter().enumerate() {
                        let want = 2.5 + (i * j) as f32;
                        assert!((v - want).abs() < 1e-3, "{backend:?} rank {rank}: grad[{i}][{j}] = {v}, want {want}: the average of the 4 ranks' gradients");
                    }
                }
            }
        }
    }

    fn corpus() -> shardlab::data::Tokens {
        synthetic_corpus(4000, 7)
    }

    fn global_batch(step: u64) -> Batch {
        DistributedSampler::new(16, GLOBAL, 0, 1, 3).unwrap().batch(&corpus(), step)
    }

    fn flat(m: &dyn Model) -> Vec<f32> {
        let all = Tensor::cat(&m.parameters().iter().map(|p| p.detach().view([-1])).collect::<Vec<_>>(), 0);
        Vec::<f32>::try_from(&all).unwrap()
    }

    fn reference_gpt() -> Vec<f32> {
        let m = Gpt::new(GptConfig::tiny(), 1).unwrap();
        let mut opt = AdamWConfig { lr: 3e-3, eps: 1e-6, ..AdamWConfig::default() }.build(&m).unwrap();
        for s in 0..STEPS {
            m.loss(&global_batch(s)).backward();
            opt.step();
            opt.zero_grad();
        }
        flat(&m)
    }

    #[test]
    fn ex4_ddp_matches_one_process_on_the_concatenated_batch() {
        shardlab::grading::refuse_twins(GRADER, 4, TWINS[3]);
        // Reference: one process, the whole global batch, same AdamW ("same as single-process training").
        let reference = reference_gpt();
        for n in 1..=4 {
            for (name, opts) in [("local", SpawnOptions::new(n, Backend::Local)), ("tcp", tcp_threads(n))] {
                let out = spawn_with(opts, |pg| {
                    // Different initial weights per rank: sync_initial_weights must fix that.
                    let m = Gpt::new(GptConfig::tiny(), 1 + 10 * pg.rank() as u64)?;
                    let mut opt = AdamWConfig { lr: 3e-3, eps: 1e-6, ..AdamWConfig::default() }.build(&m)?;
                    sync_initial_weights(pg, &mut m.parameters(), 1 << 20)?;
                    let mut losses = Vec::new();
                    for s in 0..STEPS {
                        losses.push(ddp_step(pg, &m, &mut opt, &global_batch(s))?);
                    }
                    Ok((flat(&m), losses))
                })
                .unwrap();
                for (rank, (params, losses)) in out.iter().enumerate() {
                    let worst = params.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(worst < 2e-5, "{name} n={n} rank {rank}: parameters differ from one process by {worst}");
                    assert!(losses.iter().all(|l| l.is_finite()), "{name} n={n}: losses {losses:?}");
                }
                if n > 1 {
                    assert_ne!(out[0].1, out[1].1, "{name} n={n}: ranks must train on different rows (same local losses)");
                }
            }
        }
    }

    #[test]
    fn ex4_ddp_step_also_trains_an_mlp() {
        shardlab::grading::refuse_twins(GRADER, 4, TWINS[3]);
        let cfg = MlpConfig { sizes: vec![8, 16, 4] };
        let data = Mlp::new(cfg.clone(), 0).unwrap().synthetic_batch(GLOBAL as i64, 5);
        let reference = {
            let m = Mlp::new(cfg.clone(), 0).unwrap();
            let mut opt = AdamWConfig::default().build(&m).unwrap();
            for _ in 0..STEPS {
                m.loss(&data).backward();
                opt.step();
                opt.zero_grad();
            }
            flat(&m)
        };
        let out = spawn(3, Backend::Local, |pg| {
            let m = Mlp::new(cfg.clone(), pg.rank() as u64)?;
            let mut opt = AdamWConfig::default().build(&m)?;
            sync_initial_weights(pg, &mut m.parameters(), 1 << 20)?;
            let data = Mlp::new(cfg.clone(), 0)?.synthetic_batch(GLOBAL as i64, 5);
            for _ in 0..STEPS {
                ddp_step(pg, &m, &mut opt, &data)?;
            }
            Ok(flat(&m))
        })
        .unwrap();
        for p in out {
            let worst = p.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-5, "MLP: parameters differ from one process by {worst}");
        }
    }
}
