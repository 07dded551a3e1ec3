//! DDP trains exactly like one process: for N = 1..4 ranks on both backends, naive and bucketed
//! DDP (with several buckets, and with gradient accumulation under `no_sync`) end, after several
//! AdamW steps (shardlab's AdamW), with the same parameters as a single process training on the
//! concatenated global batch with libtorch's AdamW, same hyper-parameters (float tolerance).

use shardlab::data::{synthetic_corpus, DistributedSampler, Tokens};
use shardlab::ddp::{self, Variant};
use shardlab::model::{zero_grads, Gpt, GptConfig, Model};
use shardlab::optim::AdamWConfig;
use shardlab::prelude::*;
use shardlab::stages::staged_backward;
use std::time::Duration;

const STEPS: u64 = 3;
const GLOBAL_BATCH: usize = 12; // divides by 1, 2, 3 and 4
const SEED: u64 = 42;

fn corpus() -> Tokens {
    synthetic_corpus(4000, 7)
}

/// eps 1e-6: a few gradient elements are zero up to rounding (the attention key biases), and
/// Adam would turn two correct implementations' different rounding noise there into lr-sized steps.
fn opt_cfg() -> AdamWConfig {
    AdamWConfig { lr: 3e-3, eps: 1e-6, ..AdamWConfig::default() }
}

fn flat(model: &dyn Model) -> Vec<f32> {
    let all = Tensor::cat(&model.parameters().iter().map(|p| p.detach().view([-1])).collect::<Vec<_>>(), 0);
    Vec::<f32>::try_from(&all).unwrap()
}

/// One process, the whole global batch, plain loss.backward() + libtorch AdamW.
fn single_process() -> Vec<f32> {
    let data = corpus();
    let cfg = GptConfig::tiny();
    let model = Gpt::new(cfg, SEED).unwrap();
    let mut opt = opt_cfg().build(&model).unwrap();
    let sampler = DistributedSampler::new(cfg.block_size as usize, GLOBAL_BATCH, 0, 1, 1).unwrap();
    for step in 0..STEPS {
        let b = sampler.batch(&data, step);
        model.loss(&b).backward();
        opt.step();
        zero_grads(&model.parameters());
    }
    flat(&model)
}

/// The same training on this rank of a data-parallel job.
fn ddp_rank(pg: &ProcessGroup, variant: Variant, cap: usize, accum: i64) -> anyhow::Result<Vec<f32>> {
    let data = corpus();
    let cfg = GptConfig::tiny();
    // Each rank starts from different weights: DDP's broadcast must make them rank 0's.
    let model = Gpt::new(cfg, SEED + pg.rank() as u64)?;
    // shardlab's AdamW against libtorch's in single_process().
    let mut opt = AdamW::new(opt_cfg());
    let mut dp = ddp::wrap(pg, Box::new(model), variant, cap)?;
    let sampler = DistributedSampler::new(cfg.block_size as usize, GLOBAL_BATCH, pg.rank(), pg.world_size(), 1)?;
    for step in 0..STEPS {
        ddp::train_step(&mut *dp, &mut opt, &sampler.batch(&data, step), accum, StepConfig::lr(opt_cfg().lr))?;
    }
    Ok(flat(dp.model()))
}

/// The variants checked on every world size: naive; bucketed with one bucket; bucketed with small
/// buckets (several in flight during backward); bucketed with 3-step accumulation.
const CASES: [(Variant, usize, i64); 4] = [
    (Variant::Naive, 0, 1),
    (Variant::Bucketed, ddp::DEFAULT_BUCKET_CAP_BYTES, 1),
    (Variant::Bucketed, 16 * 1024, 1),
    (Variant::Bucketed, 16 * 1024, 3),
];

fn check(results: Vec<Vec<Vec<f32>>>, n: usize, backend: &str) {
    let reference = single_process();
    for (rank, per_case) in results.iter().enumerate() {
        for (case, got) in CASES.iter().zip(per_case) {
            assert_eq!(got.len(), reference.len());
            let worst = got.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(
                worst < 2e-5,
                "{backend} n={n} rank {rank} {case:?}: parameters differ from one process by {worst}"
            );
        }
        assert_eq!(per_case, &results[0], "{backend} n={n}: rank {rank} holds other parameters than rank 0");
    }
}

fn run_all(pg: &ProcessGroup) -> anyhow::Result<Vec<Vec<f32>>> {
    CASES.iter().map(|&(v, cap, accum)| ddp_rank(pg, v, cap, accum)).collect()
}

#[test]
fn ddp_matches_single_process_local_backend() {
    for n in 1..=4 {
        let out = spawn(n, Backend::Local, run_all).unwrap();
        check(out, n, "local");
    }
}

fn processes(n: usize, test: &str) {
    let opts = SpawnOptions::new(n, Backend::Tcp)
        .config(CommConfig::default().with_timeout(Duration::from_secs(60)))
        .child_args(vec!["--exact".into(), test.into(), "--nocapture".into(), "--test-threads=1".into()]);
    let out = spawn_with(opts, run_all).unwrap();
    check(out, n, "tcp processes");
}

#[test]
fn ddp_matches_single_process_tcp_1() {
    processes(1, "ddp_matches_single_process_tcp_1");
}
#[test]
fn ddp_matches_single_process_tcp_2() {
    processes(2, "ddp_matches_single_process_tcp_2");
}
#[test]
fn ddp_matches_single_process_tcp_3() {
    processes(3, "ddp_matches_single_process_tcp_3");
}
#[test]
fn ddp_matches_single_process_tcp_4() {
    processes(4, "ddp_matches_single_process_tcp_4");
}

#[test]
fn gradients_match_after_one_backward() {
    // Same gradients (not only parameters after AdamW, which normalises): N=3 bucketed vs one process.
    let data = corpus();
    let cfg = GptConfig::tiny();
    let reference = {
        let m = Gpt::new(cfg, SEED).unwrap();
        let b = DistributedSampler::new(16, GLOBAL_BATCH, 0, 1, 1).unwrap().batch(&data, 0);
        m.loss(&b).backward();
        m.parameters().iter().map(|p| Vec::<f32>::try_from(&p.grad().view([-1])).unwrap()).collect::<Vec<_>>()
    };
    let out = spawn(3, Backend::Local, |pg| {
        let data = corpus();
        let mut dp = ddp::wrap(pg, Box::new(Gpt::new(cfg, SEED)?), Variant::Bucketed, 16 * 1024)?;
        let b = DistributedSampler::new(16, GLOBAL_BATCH, pg.rank(), 3, 1)?.batch(&data, 0);
        dp.backward(&b, 1.0)?;
        let st = dp.stats();
        anyhow::ensure!(st.syncs == 1 && st.bytes == 4 * dp.model().num_params() as u64, "{st:?}");
        Ok(dp
            .model()
            .parameters()
            .iter()
            .map(|p| Vec::<f32>::try_from(&p.grad().view([-1])).unwrap())
            .collect::<Vec<_>>())
    })
    .unwrap();
    for grads in out {
        for (g, r) in grads.iter().zip(&reference) {
            let worst = g.iter().zip(r).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-6, "gradient differs by {worst}");
        }
    }
}

#[test]
fn staged_backward_gives_the_monolithic_gradients() {
    let data = corpus();
    let m = Gpt::new(GptConfig::tiny(), 3).unwrap();
    let b = DistributedSampler::new(16, 4, 0, 1, 5).unwrap().batch(&data, 0);
    m.loss(&b).backward();
    let full: Vec<Tensor> = m.parameters().iter().map(|p| p.grad().copy()).collect();
    zero_grads(&m.parameters());
    let mut order = Vec::new();
    let loss = staged_backward(&m, &b, 1.0, |s| order.push(s));
    assert_eq!(order, (0..m.num_stages()).rev().collect::<Vec<_>>());
    assert!((loss - m.loss(&b).double_value(&[])).abs() < 1e-6);
    for (p, f) in m.parameters().iter().zip(&full) {
        assert!(p.grad().allclose(f, 1e-5, 1e-7, false));
    }
}

#[test]
fn bucket_assignment_is_reverse_and_capped() {
    let b = ddp::assign_buckets(&[4, 4, 10, 4, 4, 4], 8);
    assert_eq!(b, vec![vec![5, 4], vec![3], vec![2], vec![1, 0]]);
    assert_eq!(ddp::assign_buckets(&[], 8), Vec::<Vec<usize>>::new());
    assert_eq!(ddp::assign_buckets(&[1, 1, 1], 100), vec![vec![2, 1, 0]]);
}

/// With SGD the update is proportional to the gradient, so a wrong average (a missing ÷N) or a
/// wrong accumulation scale changes the parameters (AdamW would cancel a constant factor).
#[test]
fn sgd_steps_match_one_process_for_both_variants_and_uneven_accumulation() {
    use tch::nn::OptimizerConfig;
    let global = 10; // 5 rows per rank on 2 ranks; accumulation 3 cuts them 1 + 2 + 2
    let reference = {
        let data = corpus();
        let m = Gpt::new(GptConfig::tiny(), SEED).unwrap();
        let mut opt = tch::nn::Sgd::default().build(m.var_store(), 0.5).unwrap();
        for step in 0..STEPS {
            m.loss(&DistributedSampler::new(16, global, 0, 1, 1).unwrap().batch(&data, step)).backward();
            opt.step();
            opt.zero_grad();
        }
        flat(&m)
    };
    for (variant, accum) in [(Variant::Naive, 1), (Variant::Naive, 3), (Variant::Bucketed, 1), (Variant::Bucketed, 3)] {
        let out = spawn(2, Backend::Local, move |pg| {
            let data = corpus();
            let m = Gpt::new(GptConfig::tiny(), SEED + pg.rank() as u64)?;
            let mut dp = ddp::wrap(pg, Box::new(m), variant, 16 * 1024)?;
            let s = DistributedSampler::new(16, global, pg.rank(), 2, 1)?;
            for step in 0..STEPS {
                ddp::train_step(&mut *dp, &mut Sgd, &s.batch(&data, step), accum, StepConfig::lr(0.5))?;
            }
            Ok(flat(dp.model()))
        })
        .unwrap();
        for p in out {
            assert_eq!(p.len(), reference.len());
            let worst = p.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-5, "{variant:?} accum={accum}: SGD parameters differ from one process by {worst}");
        }
    }
}

#[test]
fn a_bad_bucket_assignment_is_an_error_on_every_rank() {
    // Every parameter exactly once, no empty bucket: anything else is refused before any message.
    type Assign = fn(&[usize], usize) -> Vec<Vec<usize>>;
    let cases: [(Assign, &str); 4] = [
        (|s, _| vec![(0..s.len()).collect(), vec![0]], "parameter 0 2 times"),
        (|s, _| vec![(1..s.len()).collect()], "parameter 0 0 times"),
        (|s, _| vec![(0..s.len()).collect(), vec![]], "empty bucket"),
        (|s, _| vec![(0..=s.len()).collect()], "the model has"),
    ];
    for (assign, want) in cases {
        let out = spawn(2, Backend::Local, move |pg| {
            let model = Gpt::new(GptConfig::tiny(), 1)?;
            Ok(ddp::DdpBucketed::with_assignment(pg, Box::new(model), 1024, assign).err().map(|e| e.to_string()))
        })
        .unwrap();
        for (rank, err) in out.iter().enumerate() {
            let err = err.as_deref().unwrap_or_else(|| panic!("rank {rank}: a bad assignment was accepted ({want})"));
            assert!(err.contains(want) && err.contains(&format!("rank {rank}")), "rank {rank}: {err}");
        }
    }
}

#[test]
fn ranks_with_different_bucket_assignments_all_fail() {
    // Same sizes, parameters permuted within a bucket on one rank only: each bucket's all-reduce
    // would average unrelated gradients. Refused on every rank before any gradient moves.
    let out = spawn(3, Backend::Local, |pg| {
        let model = Gpt::new(GptConfig::tiny(), 1)?;
        let rank = pg.rank();
        let assign = move |s: &[usize], _cap: usize| {
            let mut all: Vec<usize> = (0..s.len()).rev().collect();
            if rank == 2 {
                all.swap(0, 1);
            }
            vec![all]
        };
        Ok(ddp::DdpBucketed::with_assignment(pg, Box::new(model), 1 << 30, assign).err().map(|e| e.to_string()))
    })
    .unwrap();
    for (rank, err) in out.iter().enumerate() {
        let err = err.as_deref().unwrap_or_else(|| panic!("rank {rank}: differing assignments were accepted"));
        assert!(err.contains("different bucket assignments"), "rank {rank}: {err}");
    }
}
