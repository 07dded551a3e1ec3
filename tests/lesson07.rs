//! Grader for lesson 07 (ZeRO stages 1/2/3).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/07_zero_stages/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 07` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong.

#[path = "../lessons/07_zero_stages/exercise.rs"]
mod exercise_code;
#[path = "../solutions/07_zero_stages.rs"]
mod solution_code;

use shardlab::prelude::*;
use shardlab::zero::flat::FlatLayout;

shardlab::graders! {
    lesson: "07", exercise_file: "lessons/07_zero_stages/exercise.rs";

    /// shardlab's own copies of what each exercise builds (exercise K: `TWINS[K - 1]`): an exercise
    /// that names one is refused ("write it yourself").
    const TWINS: &[&[&str]] = &[&["model_state_bytes", "model_state_bytes_with", "StateBytes", "fit::state_bytes"], &["AdamW", "AdamWConfig", "nn::adamw", "nn::Adam", "COptimizer", "shardlab::optim"], &[], &["zero::Zero", "Zero::new", "ShardedTensors", "optim::optimizer_step", "AdamW", "nn::adamw", "shardlab::optim", "shardlab::zero"]];

    #[test]
    fn ex1_planner_reproduces_the_zero_paper() {
        shardlab::grading::refuse_twins(GRADER, 1, TWINS[0]);
        // ZeRO paper, Table 1: 7.5 B parameters, K = 12, N = 64 → 120 / 31.4 / 16.6 / 1.88 GB.
        let got: Vec<f64> = (0..=3).map(|s| zero_bytes_per_device(7.5e9, 64.0, 12.0, s) / 1e9).collect();
        let what = [
            "nothing sharded: (2 + 2 + K)Ψ",
            "optimizer states sharded: 2Ψ + 2Ψ + KΨ/N",
            "gradients and optimizer states sharded, parameters not: 2Ψ + (2 + K)Ψ/N",
            "everything sharded: (2 + 2 + K)Ψ/N",
        ];
        for (stage, (g, want)) in got.iter().zip([120.0, 31.4, 16.6, 1.88]).enumerate() {
            assert!(
                (g - want).abs() < 0.01 * want,
                "7.5B on 64, stage {stage}: got {g} GB, the paper says {want} GB ({})",
                what[stage]
            );
        }
        // N = 4 row: 120 / 52.5 / 41.25 / 30.
        let got: Vec<f64> = (0..=3).map(|s| zero_bytes_per_device(7.5e9, 4.0, 12.0, s) / 1e9).collect();
        assert!(
            got.iter().zip([120.0, 52.5, 41.25, 30.0]).all(|(g, w)| (g - w).abs() < 1e-9),
            "7.5B on 4 devices, stages 0-3: got {got:?} GB, want [120, 52.5, 41.25, 30] GB"
        );
        // 70 B on 8, fully sharded: 140 GB with K = 12, 105 GB with K = 8.
        for (k, want) in [(12.0, 140.0), (8.0, 105.0)] {
            let got = zero_bytes_per_device(70e9, 8.0, k, 3) / 1e9;
            assert!((got - want).abs() < 1e-9, "70B on 8 devices, stage 3, K = {k}: got {got} GB, want {want} GB (K is a parameter)");
        }
    }

    #[test]
    fn ex2_sharded_adamw_is_libtorchs_adamw() {
        shardlab::grading::refuse_twins(GRADER, 2, TWINS[1]);
        // Reference: tch's nn::AdamW (libtorch's torch::optim::AdamW) on the same two tensors.
        let vs = tch::nn::VarStore::new(Device::Cpu);
        let mut rng = shardlab::rng::Rng::new(3);
        let w0 = Tensor::from_slice(&rng.normal_vec(12, 1.0)).view([3, 4]);
        let b0 = Tensor::from_slice(&rng.normal_vec(5, 1.0));
        let w = vs.root().var_copy("w", &w0);
        let b = vs.root().set_group(1).var_copy("b", &b0);
        let (lr, wd, betas, eps) = (0.01, 0.1, (0.9, 0.95), 1e-8);
        let mut opt = tch::nn::AdamW { beta1: betas.0, beta2: betas.1, wd, eps, amsgrad: false }.build(&vs, lr).unwrap();
        use tch::nn::OptimizerConfig;
        opt.set_weight_decay_group(0, wd);
        opt.set_weight_decay_group(1, 0.0);
        // Ours: one flat shard holding both tensors, weight decay only on the matrix's elements.
        let mut p = Tensor::cat(&[w0.view([-1]), b0.shallow_clone()], 0);
        let (mut m, mut v) = (p.zeros_like(), p.zeros_like());
        let wdv = Tensor::cat(
            &[Tensor::full([12], wd, (Kind::Float, Device::Cpu)), Tensor::zeros([5], (Kind::Float, Device::Cpu))],
            0,
        );
        for t in 1..=5 {
            let gw = Tensor::from_slice(&rng.normal_vec(12, 1.0)).view([3, 4]);
            let gb = Tensor::from_slice(&rng.normal_vec(5, 1.0));
            let loss = (&w * &gw).sum(Kind::Float) + (&b * &gb).sum(Kind::Float);
            loss.backward();
            opt.step();
            opt.zero_grad();
            adamw_shard_step(&mut p, &Tensor::cat(&[gw.view([-1]), gb], 0), &mut m, &mut v, &wdv, t, lr, betas, eps);
            for (what, x) in [("p", &p), ("m", &m), ("v", &v)] {
                shardlab::grading::assert_layout(x, &[17], Kind::Float, &format!("step {t}: {what} after the step (update it in place)"));
            }
            let reference = Tensor::cat(&[w.detach().view([-1]), b.detach()], 0);
            let diff = shardlab::grading::max_diff(&p, &reference, &format!("step {t}: p"));
            assert!(diff < 1e-6, "step {t}: sharded AdamW differs from libtorch's by {diff}");
        }
    }

    #[test]
    fn ex3_all_gather_params_gives_everyone_every_update() {
        for n in 1..=4 {
            for opts in [SpawnOptions::new(n, Backend::Local), SpawnOptions::new(n, Backend::Tcp).launch(Launch::Threads)] {
                let out = spawn_with(opts, |pg| {
                    let (n, r) = (pg.world_size() as i64, pg.rank() as i64);
                    // The flat parameters as they were before the step: stale, and not zero.
                    let mut flat = Tensor::full([3 * n], -7.0, (Kind::Float, Device::Cpu));
                    // Rank r "updates" its shard: writes r + 1 into its three elements.
                    let shard = flat.narrow(0, 3 * r, 3);
                    let _ = shard.shallow_clone().fill_(r as f64 + 1.0);
                    let before = pg.stats();
                    all_gather_params(pg, &mut flat, &shard)?;
                    let ran = pg.stats().since(&before);
                    anyhow::ensure!(
                        n == 1 || (ran.calls(OpKind::AllGather) == 1 && ran.collectives == 1 && ran.p2p == 0),
                        "rank {r}: all_gather_params should make exactly one all_gather; it made {}",
                        ran.describe_calls()
                    );
                    if let Some(e) = shardlab::grading::layout_error(&flat, &[3 * n], Kind::Float) {
                        anyhow::bail!("rank {r}: flat became {e} (gather into the buffer you were given)");
                    }
                    Ok(Vec::<f32>::try_from(&flat)?)
                })
                .unwrap();
                let want: Vec<f32> = (0..n).flat_map(|r| [r as f32 + 1.0; 3]).collect();
                assert!(out.iter().all(|v| *v == want), "n={n}: every rank must end with every rank's update (the buffer started stale, at -7, outside \
                     each rank's own shard): {out:?}");
            }
        }
    }

    // ---- exercise 4: a whole ZeRO-1 step ----

    /// N ranks as threads, over the local backend and over TCP; a peer silent for a minute fails the test.
    fn both(n: usize) -> [SpawnOptions; 2] {
        let cfg = CommConfig::default().with_timeout(std::time::Duration::from_secs(60));
        [
            SpawnOptions::new(n, Backend::Local).config(cfg.clone()),
            SpawnOptions::new(n, Backend::Tcp).launch(Launch::Threads).config(cfg),
        ]
    }

    /// lr, betas, eps, weight decay of the ZeRO-1 tests. ε is large next to the gradients (~0.01)
    /// so that a gradient N times too large changes the update: AdamW's m/√v alone cannot see it.
    const HP: (f64, (f64, f64), f64, f64) = (0.01, (0.9, 0.95), 1e-3, 0.1);
    const STEPS: i32 = 4;

    /// Rank `q`'s gradient at step `t` for the 3×4 matrix and the 5-element bias (17 values).
    fn rank_grad(q: usize, t: i32) -> Tensor {
        Tensor::from_slice(&shardlab::rng::Rng::new(1000 * t as u64 + q as u64).normal_vec(17, 0.01))
    }

    /// Runs `STEPS` of this lesson's `zero1_step` on this rank next to libtorch's AdamW in one
    /// process on the averaged gradient; after each step calls `check(t, communication, flat
    /// params, libtorch's params, shard length)`.
    fn zero1_next_to_libtorch(
        pg: &ProcessGroup,
        mut check: impl FnMut(i32, &CommStats, &Tensor, &Tensor, i64) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let (n, r) = (pg.world_size(), pg.rank());
        let (lr, betas, eps, wd) = HP;
        let mut rng = shardlab::rng::Rng::new(5);
        let w0 = Tensor::from_slice(&rng.normal_vec(12, 1.0)).view([3, 4]);
        let b0 = Tensor::from_slice(&rng.normal_vec(5, 1.0));
        // Reference: tch's nn::AdamW (libtorch's) on the two tensors, matrix decayed, bias not.
        let vs = tch::nn::VarStore::new(Device::Cpu);
        let w = vs.root().var_copy("w", &w0);
        let b = vs.root().set_group(1).var_copy("b", &b0);
        use tch::nn::OptimizerConfig;
        let mut opt = tch::nn::AdamW { beta1: betas.0, beta2: betas.1, wd, eps, amsgrad: false }.build(&vs, lr)?;
        opt.set_weight_decay_group(0, wd);
        opt.set_weight_decay_group(1, 0.0);
        // ZeRO-1: both tensors in one flat buffer padded to a multiple of N; this rank's AdamW state.
        let layout = FlatLayout::new(vec![vec![3, 4], vec![5]], n);
        let mut flat = layout.flatten(&[w0, b0]);
        let wdv = Tensor::zeros([layout.shard], (Kind::Float, Device::Cpu));
        for (i, _, in_shard) in layout.shard_pieces(r) {
            if i == 0 {
                let _ = wdv.narrow(0, in_shard.start, in_shard.end - in_shard.start).fill_(wd);
            }
        }
        let (mut m, mut v) = (wdv.zeros_like(), wdv.zeros_like());
        for t in 1..=STEPS {
            let grads: Vec<Tensor> = (0..n).map(|q| rank_grad(q, t)).collect();
            let mean = Tensor::stack(&grads, 0).mean_dim(0, false, Kind::Float);
            let loss = (&w * mean.narrow(0, 0, 12).view([3, 4])).sum(Kind::Float) + (&b * mean.narrow(0, 12, 5)).sum(Kind::Float);
            loss.backward();
            opt.step();
            opt.zero_grad();
            let reference = Tensor::cat(&[w.detach().view([-1]), b.detach()], 0);
            let grad = layout.flatten(&[grads[r].narrow(0, 0, 12).view([3, 4]), grads[r].narrow(0, 12, 5)]);
            let before = pg.stats();
            zero1_step(pg, &mut flat, &grad, &mut m, &mut v, &wdv, t, lr, betas, eps)?;
            let ran = pg.stats().since(&before);
            for (what, x, len) in [("flat", &flat, layout.padded), ("m", &m, layout.shard), ("v", &v, layout.shard)] {
                if let Some(e) = shardlab::grading::layout_error(x, &[len], Kind::Float) {
                    anyhow::bail!("rank {r}, step {t}: {what} became {e} (update the buffers you were given in place)");
                }
            }
            check(t, &ran, &flat, &reference, layout.shard)?;
        }
        Ok(())
    }

    #[test]
    fn ex4_zero1_step_is_libtorchs_adamw_on_the_averaged_gradient() {
        shardlab::grading::refuse_twins(GRADER, 4, TWINS[3]);
        for n in 1..=4 {
            for opts in both(n) {
                let backend = opts.backend;
                spawn_with(opts, |pg| {
                    zero1_next_to_libtorch(pg, |t, _, flat, reference, _| {
                        let diff = (flat.narrow(0, 0, 17) - reference).abs().max().double_value(&[]);
                        anyhow::ensure!(
                            diff < 1e-6,
                            "rank {}, step {t}: the parameters differ from libtorch's AdamW on the gradient averaged \
                             over ranks by {diff:.3e} (every rank's flat must hold every rank's updated shard)",
                            pg.rank()
                        );
                        Ok(())
                    })
                })
                .unwrap_or_else(|e| panic!("n={n} {backend:?}: {e}"));
            }
        }
    }

    #[test]
    fn ex4_zero1_step_is_one_reduce_scatter_and_one_all_gather() {
        shardlab::grading::refuse_twins(GRADER, 4, TWINS[3]);
        for n in 2..=4 {
            for opts in both(n) {
                let backend = opts.backend;
                spawn_with(opts, |pg| {
                    zero1_next_to_libtorch(pg, |t, ran, _, _, shard| {
                        anyhow::ensure!(
                            ran.calls(OpKind::AllReduce) == 0,
                            "rank {}, step {t}: the step made {}; ZeRO-1 needs no all_reduce (each rank only needs its \
                             own block of the averaged gradient: a reduce_scatter, half the bytes)",
                            pg.rank(), ran.describe_calls()
                        );
                        anyhow::ensure!(
                            ran.calls(OpKind::ReduceScatter) == 1 && ran.calls(OpKind::AllGather) == 1
                                && ran.collectives == 2 && ran.p2p == 0,
                            "rank {}, step {t}: the step made {}; want exactly one reduce_scatter (the gradient) and one \
                             all_gather (the updated parameters)",
                            pg.rank(), ran.describe_calls()
                        );
                        // Ring volume: the reduce-scatter and the all-gather each send N−1 shards.
                        let want = 2 * (n as u64 - 1) * 4 * shard as u64;
                        anyhow::ensure!(
                            ran.bytes_sent == want,
                            "rank {}, step {t}: sent {} bytes; a reduce-scatter and an all-gather of the flat vector \
                             send 2·(N−1)·4·shard = {want}",
                            pg.rank(), ran.bytes_sent
                        );
                        Ok(())
                    })
                })
                .unwrap_or_else(|e| panic!("n={n} {backend:?}: {e}"));
            }
        }
    }
}
