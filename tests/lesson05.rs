//! Grader for lesson 05 (production DDP: buckets, overlap, gradient accumulation).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/05_production_ddp/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 05` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong.

#[path = "../lessons/05_production_ddp/exercise.rs"]
mod exercise_code;
#[path = "../solutions/05_production_ddp.rs"]
mod solution_code;

use shardlab::data::{synthetic_corpus, DistributedSampler};
use shardlab::ddp::{self, Variant};
use shardlab::model::{Gpt, GptConfig, Model};
use shardlab::prelude::*;

shardlab::graders! {
    lesson: "05", exercise_file: "lessons/05_production_ddp/exercise.rs";

    /// shardlab's own copies of what each exercise builds (exercise K: `TWINS[K - 1]`): an exercise
    /// that names one is refused ("write it yourself").
    const TWINS: &[&[&str]] = &[&["ddp::assign_buckets", "bucketed::assign_buckets"], &[], &["train_step", "train_step_scaled", "Trainer"]];

    #[test]
    fn ex1_buckets_are_reverse_order_and_capped() {
        shardlab::grading::refuse_twins(GRADER, 1, TWINS[0]);
        // Worked example: 6 tensors, cap 8 bytes.
        assert_eq!(
            assign_buckets(&[4, 4, 10, 4, 4, 4], 8),
            vec![vec![5, 4], vec![3], vec![2], vec![1, 0]],
            "sizes [4, 4, 10, 4, 4, 4], cap 8: buckets fill in reverse parameter order (backward makes the last \
             gradients first), each up to the cap"
        );
        assert_eq!(assign_buckets(&[], 8), Vec::<Vec<usize>>::new());
        assert_eq!(assign_buckets(&[1, 1, 1], 100), vec![vec![2, 1, 0]]);
        // Properties on a pseudo-random case.
        let sizes: Vec<usize> = (0..200).map(|i| (i * 7919 % 97) * 64 + 4).collect();
        for cap in [1usize, 100, 4096, 25 << 20] {
            let b = assign_buckets(&sizes, cap);
            let order: Vec<usize> = b.iter().flatten().copied().collect();
            assert_eq!(order, (0..sizes.len()).rev().collect::<Vec<_>>(), "cap {cap}: every index once, last first");
            assert!(!b.iter().any(Vec::is_empty), "cap {cap}: an empty bucket (every bucket holds a parameter)");
            for bucket in &b {
                let bytes: usize = bucket.iter().map(|&i| sizes[i]).sum();
                assert!(bytes <= cap || bucket.len() == 1, "cap {cap}: bucket {bucket:?} has {bytes} bytes");
            }
            for w in b.windows(2) {
                let bytes: usize = w[0].iter().map(|&i| sizes[i]).sum();
                assert!(bytes + sizes[w[1][0]] > cap, "cap {cap}: {:?} had room for parameter {} (greedy)", w[0], w[1][0]);
            }
        }
    }

    #[test]
    fn ex1_the_librarys_ddp_trains_with_your_buckets() {
        shardlab::grading::refuse_twins(GRADER, 1, TWINS[0]);
        // DdpBucketed with your assign_buckets: 3 SGD steps on 2 ranks end where one process on
        // the whole batch ends, with one all-reduce per bucket per step (and the step's own one).
        let (want, _) = reference(8);
        for cap in [1usize, 8 * 1024, 1 << 30] {
            let out = spawn(2, Backend::Local, move |pg| {
                let data = synthetic_corpus(4000, 7);
                let model = Gpt::new(GptConfig::tiny(), 1)?;
                let mut dp = shardlab::ddp::DdpBucketed::with_assignment(pg, Box::new(model), cap, assign_buckets)?;
                let buckets = dp.bucket_params().len() as u64;
                let sampler = DistributedSampler::new(16, 8, pg.rank(), 2, 3)?;
                let before = pg.stats();
                for step in 0..3 {
                    ddp::train_step(&mut dp, &mut Sgd, &sampler.batch(&data, step), 1, StepConfig::lr(0.5))?;
                }
                let ran = pg.stats().since(&before);
                Ok((flat(dp.model()), buckets, ran.calls(OpKind::AllReduce)))
            })
            .unwrap_or_else(|e| panic!("cap {cap}: training with your buckets failed: {e}"));
            for (rank, (params, buckets, reduces)) in out.iter().enumerate() {
                let worst = params.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(worst < 1e-5, "cap {cap} rank {rank}: DDP with your buckets differs from one process by {worst}");
                // Per step: one all-reduce per bucket, and the optimizer step's one small all-reduce
                // that agrees on the global norm and on non-finite gradients (src/optim/step.rs).
                assert_eq!(*reduces, 3 * (buckets + 1), "cap {cap} rank {rank}: one all-reduce per bucket per step, and the step's one");
            }
        }
    }

    #[test]
    fn ex2_a_bucket_is_ready_after_its_earliest_stage() {
        // GPT with 2 blocks: stage 0 embeddings, 1–2 blocks, 3 head.
        let m = Gpt::new(GptConfig::tiny(), 0).unwrap();
        let stages = m.param_stages();
        assert_eq!(bucket_ready_stage(&[27, 26], &stages), 3, "ln_f only: ready after the head");
        assert_eq!(bucket_ready_stage(&[25, 14, 13], &stages), 1, "block 1's last params (25, 14) and block 0's last (13)");
        assert_eq!(bucket_ready_stage(&[3, 2, 1, 0], &stages), 0, "wte (also the lm_head) waits for the embeddings");
        assert_eq!(bucket_ready_stage(&[5], &[9, 9, 9, 9, 9, 4]), 4);
    }

    /// SGD (not AdamW, which cancels a constant gradient factor), so a wrong loss scale shows.
    fn sgd(model: &Gpt) -> tch::nn::Optimizer {
        use tch::nn::OptimizerConfig;
        tch::nn::Sgd::default().build(model.var_store(), 0.5).unwrap()
    }

    fn flat(m: &dyn Model) -> Vec<f32> {
        let all = Tensor::cat(&m.parameters().iter().map(|p| p.detach().view([-1])).collect::<Vec<_>>(), 0);
        Vec::<f32>::try_from(&all).unwrap()
    }

    /// Reference: one process, the whole global batch, plain backward, no accumulation.
    fn reference(global: usize) -> (Vec<f32>, Vec<f64>) {
        let data = synthetic_corpus(4000, 7);
        let m = Gpt::new(GptConfig::tiny(), 1).unwrap();
        let mut opt = sgd(&m);
        let mut losses = vec![];
        for step in 0..3 {
            let b = DistributedSampler::new(16, global, 0, 1, 3).unwrap().batch(&data, step);
            let loss = m.loss(&b);
            losses.push(loss.double_value(&[]));
            loss.backward();
            opt.step();
            opt.zero_grad();
        }
        (flat(&m), losses)
    }

    fn run(pg: &ProcessGroup, global: usize, accum: i64) -> anyhow::Result<(Vec<f32>, u64, Vec<f64>)> {
        let data = synthetic_corpus(4000, 7);
        let model = Gpt::new(GptConfig::tiny(), 1)?;
        let mut opt = sgd(&model);
        let mut dp = ddp::wrap(pg, Box::new(model), Variant::Bucketed, 8 * 1024)?;
        let sampler = DistributedSampler::new(16, global, pg.rank(), pg.world_size(), 3)?;
        let mut losses = vec![];
        for step in 0..3 {
            losses.push(accumulate_step(&mut *dp, &mut opt, &sampler.batch(&data, step), accum)?);
        }
        Ok((flat(dp.model()), dp.stats().syncs, losses))
    }

    #[test]
    fn ex3_accumulation_matches_one_big_batch_and_syncs_once_per_step() {
        shardlab::grading::refuse_twins(GRADER, 3, TWINS[2]);
        let init = flat(&Gpt::new(GptConfig::tiny(), 1).unwrap());
        // (ranks, global batch, accumulation): uneven micro-batches included (5 rows in 2 → 2 + 3).
        for (n, global, accum) in [(1usize, 12usize, 4i64), (2, 10, 2), (3, 12, 2), (4, 12, 3)] {
            let (want, want_losses) = reference(global);
            for opts in [SpawnOptions::new(n, Backend::Local), SpawnOptions::new(n, Backend::Tcp).launch(Launch::Threads)] {
                let backend = opts.backend;
                let out = spawn_with(opts, move |pg| run(pg, global, accum)).unwrap();
                for (rank, (params, syncs, losses)) in out.iter().enumerate() {
                    let what = format!("{backend:?} n={n} global={global} accum={accum} rank {rank}");
                    let moved = params.iter().zip(&init).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(moved > 1e-3, "{what}: the parameters did not change (no optimizer step?)");
                    let worst = params.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(worst < 1e-5, "{what}: parameters differ from one process on the whole batch by {worst} (loss scaling? zero_grad?)");
                    assert_eq!(*syncs, 3, "{what}: gradients must be all-reduced once per step, not per micro-batch");
                    if n == 1 {
                        for (a, b) in losses.iter().zip(&want_losses) {
                            assert!((a - b).abs() < 1e-5, "{what}: the returned loss must be the batch mean ({a} vs {b})");
                        }
                    }
                }
            }
        }
    }
}
