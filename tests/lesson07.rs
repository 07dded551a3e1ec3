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

shardlab::graders! {
    lesson: "07", exercise_file: "lessons/07_zero_stages/exercise.rs";

    #[test]
    fn ex1_planner_reproduces_the_zero_paper() {
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
        assert!(got.iter().zip([120.0, 52.5, 41.25, 30.0]).all(|(g, w)| (g - w).abs() < 1e-9), "7.5B on 4: {got:?}");
        // 70 B on 8, fully sharded: 140 GB with K = 12, 105 GB with K = 8.
        assert!((zero_bytes_per_device(70e9, 8.0, 12.0, 3) / 1e9 - 140.0).abs() < 1e-9);
        assert!((zero_bytes_per_device(70e9, 8.0, 8.0, 3) / 1e9 - 105.0).abs() < 1e-9);
    }

    #[test]
    fn ex2_sharded_adamw_is_libtorchs_adamw() {
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
            let reference = Tensor::cat(&[w.detach().view([-1]), b.detach()], 0);
            let diff = (&p - &reference).abs().max().double_value(&[]);
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
                    Ok(Vec::<f32>::try_from(&flat)?)
                })
                .unwrap();
                let want: Vec<f32> = (0..n).flat_map(|r| [r as f32 + 1.0; 3]).collect();
                assert!(out.iter().all(|v| *v == want), "n={n}: every rank must end with every rank's update (the buffer started stale, at -7, outside \
                     each rank's own shard): {out:?}");
            }
        }
    }
}
