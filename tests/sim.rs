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
    // Every part of the step is counted once: the parts add up to the step.
    for p in [&ddp, &zero[0], &zero[1], &zero[2]] {
        let s = p.split;
        let sum = s.compute + s.tp_comm + s.pp_comm + s.bubble + s.dp_exposed + s.optimizer;
        assert!((sum - p.step_s).abs() < 1e-9 * p.step_s && s.bubble >= 0.0, "{s:?} vs {}", p.step_s);
    }
    // Recomputing nothing is faster and holds more.
    let keep = run(&|l: &mut Layout| l.recompute = Recompute::None);
    assert!(keep.step_s < ddp.step_s && keep.memory.activations > ddp.memory.activations);
    // Tensor parallelism across nodes (16 > 8 GPUs a node): each GPU computes about half as much
    // as with tp 8 (a little more: smaller GEMMs keep fewer SMs busy) and sends as much, over the
    // NICs: its collectives take a much larger share of the step.
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
    assert!(share(&across) > 1.5 * share(&node), "{:?} vs {:?}", across.split, node.split);
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

#[test]
fn a_slow_network_shows_what_overlap_and_zero_cost() {
    // One GPU a node: every data-parallel byte goes through one NIC (23 GB/s).
    let mut gpu = profile("a100-80gb").unwrap();
    gpu.gpus_per_node = 1;
    let model = Model::gpt(32, 4096, 32);
    let run = |zero: u8, overlap: bool| {
        let mut l = Layout::new(8, 1, 1);
        l.global_batch = 32;
        l.recompute = Recompute::Full;
        l.zero = zero;
        l.overlap_grad_reduce = overlap;
        simulate_step(&model, &gpu, &l).unwrap()
    };
    // A reduction longer than the last backward: overlap hides some of it, not all.
    let (after, during) = (run(0, false), run(0, true));
    assert!(during.split.dp_exposed > 0.0 && during.split.dp_exposed < after.split.dp_exposed, "{after:?} {during:?}");
    // ZeRO-2 reduce-scatters every micro-batch (4 here) and ZeRO-1 once a step: on this network,
    // ZeRO-2's smaller gradients cost time.
    let (one, two) = (run(1, true), run(2, true));
    assert!(two.step_s > one.step_s && two.memory.model_states < one.memory.model_states);
}

#[test]
fn sequence_parallelism_and_interleaving_change_memory_as_published() {
    let gpu = profile("h100-80gb").unwrap();
    let model = Model::gpt(32, 4096, 32);
    let run = |sp: bool, pp: usize, v: usize| {
        let mut l = Layout::new(1, 4, pp);
        l.global_batch = 8;
        l.sequence_parallel = sp;
        l.interleave = v;
        simulate_step(&model, &gpu, &l).unwrap()
    };
    // Korthikanti et al. 2022, Table 2: per layer sbh(10 + 24/t + 5as/(ht)) without, and
    // sbh(34 + 5as/h)/t with sequence parallelism (t = 4, a = 32, s = 2048, h = 4096).
    let (without, with) = (run(false, 1, 1), run(true, 1, 1));
    let (a, s, h, t) = (32.0, 2048.0, 4096.0, 4.0);
    let want = ((34.0 + 5.0 * a * s / h) / t) / (10.0 + 24.0 / t + 5.0 * a * s / (h * t));
    assert!((with.memory.activations / without.memory.activations - want).abs() < 1e-9);
    // All-gather + reduce-scatter move what one all-reduce does.
    assert!((with.split.tp_comm / without.split.tp_comm - 1.0).abs() < 0.05);
    // The interleaved schedule's first rank holds 1 + (p − 1)/(p·v) times 1F1B's activations
    // (Narayanan et al. 2021 §2.2.2): p = 4, v = 2, from the schedule's own order.
    let (plain, inter) = (run(false, 4, 1), run(false, 4, 2));
    let ratio = inter.memory.activations / plain.memory.activations;
    assert!((ratio - (1.0 + 3.0 / 8.0)).abs() < 1e-9, "{ratio}");
}

/// Narayanan et al. 2021, Table 1 (`sim::validate`): TFLOP/s per GPU as they count them (their
/// Eq. 3), predicted next to published, each row laid out as the paper's script ran it
/// (micro-batch, interleaving, DDP). The target is 10% on each row; today's model is at
/// +1.0% to +9.8% (5.8% on average), every row over: what it leaves out (kernel launches, the
/// loss scaler's checks, gradient clipping, dropout's masks) only adds time.
#[test]
fn megatrons_weak_scaling_table_within_ten_percent() {
    let a100 = profile("a100-80gb").unwrap();
    let mut worst = (0.0f64, String::new());
    for r in validate::megatron_table_1() {
        let p = simulate_step(&r.model, &a100, &r.layout).unwrap();
        let err = p.megatron_tflops_per_gpu / r.tflops_per_gpu - 1.0;
        println!(
            "{}: published {}, predicted {:.1} ({:+.1}%)",
            r.name,
            r.tflops_per_gpu,
            p.megatron_tflops_per_gpu,
            err * 100.0
        );
        assert!(p.fits, "{}: {:.1} GB per GPU", r.name, p.memory.total / 1e9);
        if err.abs() > worst.0.abs() {
            worst = (err, r.name.clone());
        }
    }
    println!("worst row: {} at {:+.1}%", worst.1, worst.0 * 100.0);
    assert!(worst.0.abs() < 0.10, "{} off by {:+.1}%", worst.1, worst.0 * 100.0);
}

#[test]
fn an_alpha_beta_fit_recovers_a_known_link() {
    use shardlab::sim::calibrate::fit_all_reduce;
    // Two ranks, α 20 µs, β 10 GB/s: a ring all-reduce takes 2α + B/β. Each point is disturbed
    // by up to ±4% (alternating), as a benchmark's would be.
    let (alpha, beta) = (20e-6, 10e9);
    let points: Vec<(f64, f64)> = [65536.0, 262144.0, 1048576.0, 4194304.0, 16777216.0]
        .iter()
        .enumerate()
        .map(|(i, &b)| (b, (2.0 * alpha + b / beta) * if i % 2 == 0 { 1.04 } else { 0.96 }))
        .collect();
    let (a, b) = fit_all_reduce(&points, 2).unwrap();
    assert!((a / alpha - 1.0).abs() < 0.25, "α {a}");
    assert!((b / beta - 1.0).abs() < 0.06, "β {b}");
    // Four ranks: the same times are 6 steps of α and 3/2 of B/β.
    let (a4, b4) = fit_all_reduce(&points, 4).unwrap();
    assert!((a4 * 6.0 - a * 2.0).abs() < 1e-12 && (b4 / 1.5 - b).abs() < 1e-3 * b);
    assert!(fit_all_reduce(&points[..1], 2).is_err());
    assert!(fit_all_reduce(&[(1e6, 1e-3), (2e6, 0.5e-3)], 2).is_err(), "times that fall with the size");
}

#[test]
fn a_measured_table_replaces_the_gpus_peak_and_tiles() {
    use shardlab::sim::gemm::{Gemm, Timed};
    let mut gpu = profile("a100-80gb").unwrap();
    let g = Gemm { batch: 1, m: 1024, k: 256, n: 768 };
    let modelled = g.time(&gpu, shardlab::precision::Precision::Fp32);
    gpu.gemm_table = vec![Timed { gemm: g, seconds: 4e-3 }];
    assert_eq!(g.time(&gpu, shardlab::precision::Precision::Fp32), 4e-3);
    assert_ne!(modelled, 4e-3);
    // A step whose shapes the table lacks is refused, not priced at some rate.
    gpu.measured_precision = Some(shardlab::precision::Precision::Fp32);
    let model = Model { layers: 2, hidden: 64, heads: 4, ffn: 256, seq: 32, vocab: 128 };
    let mut l = Layout::new(1, 1, 1);
    l.precision = shardlab::precision::Precision::Fp32;
    let e = simulate_step(&model, &gpu, &l).unwrap_err();
    assert!(e.contains("no time for the GEMM"), "{e}");
}

#[test]
fn this_machines_kernels_are_timed_for_every_shape_the_step_asks_for() {
    use shardlab::sim::calibrate::{measure_kernels, this_machine};
    use shardlab::sim::step::dense_gemm_shapes;
    tch::set_num_threads(1);
    let model = Model { layers: 2, hidden: 64, heads: 4, ffn: 256, seq: 32, vocab: 128 };
    let mut layouts = vec![Layout::new(1, 1, 1), Layout::new(1, 2, 1)];
    for l in &mut layouts {
        l.precision = shardlab::precision::Precision::Fp32;
        l.micro_batch = 2;
        l.global_batch = 2;
    }
    let k = measure_kernels(&model, &layouts).unwrap();
    for l in &layouts {
        for g in dense_gemm_shapes(&model, l) {
            let t = k.gemms.iter().find(|t| t.gemm == g).unwrap_or_else(|| panic!("{g:?} not timed"));
            assert!(t.seconds > 0.0 && t.seconds < 1.0, "{t:?}");
        }
    }
    // One attention kernel a layout: 2 sequences × 4 heads, then × 2 local heads under tp 2.
    let keys: Vec<(usize, usize, usize)> = k.attention.iter().map(|a| (a.batch, a.seq, a.head_dim)).collect();
    assert_eq!(keys, vec![(8, 32, 16), (4, 32, 16)]);
    // Rates a CPU core can have: between 10 MB/s and 1 TB/s; AdamW between 0.01 and 1000 ns.
    assert!(k.elementwise_bytes_per_s > 1e7 && k.elementwise_bytes_per_s < 1e12, "{k:?}");
    assert!(k.optimizer_seconds_per_param > 1e-11 && k.optimizer_seconds_per_param < 1e-6, "{k:?}");
    let mut gpu = this_machine(&k, 2, 1e9, (10e-6, 5e9)).unwrap();
    let p = simulate_step(&model, &gpu, &layouts[1]).unwrap();
    assert!(p.step_s > 0.0 && p.split.tp_comm > 0.0, "{p:?}");
    // The attention's measured times are what the step charges: one more second forward and one
    // backward on the one-rank layout's kernel add a second per layer to each pass.
    let before = simulate_step(&model, &gpu, &layouts[0]).unwrap().split.compute;
    let a = gpu.attention_table.iter_mut().find(|a| a.batch == 8).unwrap();
    (a.forward, a.backward) = (a.forward + 1.0, a.backward + 1.0);
    let after = simulate_step(&model, &gpu, &layouts[0]).unwrap().split.compute;
    assert!((after - before - 2.0 * model.layers as f64).abs() < 1e-9, "{before} → {after}");
    // bf16 is refused, measuring and simulating: the tables are fp32's.
    let mut bf16 = layouts[0];
    bf16.precision = shardlab::precision::Precision::Bf16;
    assert!(measure_kernels(&model, &[bf16]).unwrap_err().contains("fp32"));
    assert!(simulate_step(&model, &gpu, &bf16).unwrap_err().contains("measured in"));
    // A layout it was not measured for (micro-batch 4) is refused.
    let mut other = layouts[0];
    (other.micro_batch, other.global_batch) = (4, 4);
    assert!(simulate_step(&model, &gpu, &other).unwrap_err().contains("no time for"));
}

/// `sim::tp_comm` against the course's tensor-parallel GPT run on thread ranks: the collectives
/// the simulator charges for a micro-batch, plus the ones it lists as left out, are every
/// collective `TpGpt` calls in one forward and backward — counted by kind from the group's own
/// counters — and their ring volume is, to the byte, what each rank's transport sent; with and
/// without sequence parallelism and full recomputation, on 2 and 4 ranks. Without sequence
/// parallelism nothing is left out: the charged list alone must match.
#[test]
fn the_simulators_tp_collectives_are_the_ones_tp_really_runs() {
    use shardlab::comm::{Backend, OpKind};
    use shardlab::model::{Batch, Gpt, GptConfig};
    use shardlab::sim::tp_comm::{charged, uncharged, Part, TpCollective};
    use shardlab::sim::Coll;
    use tch::{Device, Kind, Tensor};
    const CFG: GptConfig = GptConfig { vocab_size: 64, block_size: 16, n_layer: 3, n_head: 4, n_embd: 32 };
    const ROWS: i64 = 2;
    for tp in [2usize, 4] {
        for (sp, recompute) in [(false, false), (true, false), (false, true), (true, true)] {
            let got = shardlab::launch::spawn(tp, Backend::Local, move |pg| {
                let mut m = shardlab::tp::TpGpt::from_gpt(&Gpt::new(CFG, 5)?, pg)
                    .map_err(anyhow::Error::msg)?
                    .with_sequence_parallel(sp)
                    .recompute_blocks(|_| recompute);
                let ids = Tensor::arange(ROWS * CFG.block_size, (Kind::Int64, Device::Cpu)).remainder(CFG.vocab_size);
                let batch =
                    Batch { x: ids.reshape([ROWS, -1]), y: (&ids + 1).remainder(CFG.vocab_size).reshape([ROWS, -1]) };
                let before = pg.stats();
                m.forward_backward(pg, &batch)?;
                let st = pg.stats().since(&before);
                let calls = [OpKind::AllReduce, OpKind::AllGather, OpKind::ReduceScatter].map(|k| st.calls(k));
                Ok((calls, st.collectives, st.bytes_sent))
            })
            .unwrap();
            // The simulator's lists for this model: 4-byte activations of ROWS·s·h, L layers, one stage.
            let (tokens, h, layers) = ((ROWS * CFG.block_size) as f64, CFG.n_embd as f64, CFG.n_layer as usize);
            let act = 4.0 * tokens * h;
            let per_model = |list: Vec<TpCollective>| -> Vec<TpCollective> {
                list.iter()
                    .flat_map(|c| std::iter::repeat_n(*c, if c.part == Part::Layer { layers } else { 1 }))
                    .collect()
            };
            let sim = per_model(charged(act, tokens, sp, recompute));
            let left = per_model(uncharged(act, h, 4.0, sp));
            assert_eq!(left.is_empty(), !sp, "only sequence parallelism leaves collectives uncharged");
            let count = |list: &[TpCollective], k: Coll| list.iter().filter(|c| c.coll == k).count() as u64;
            let kinds = [Coll::AllReduce, Coll::AllGather, Coll::ReduceScatter];
            let want = kinds.map(|k| count(&sim, k) + count(&left, k));
            // A ring moves 2(t − 1)/t of an all-reduce's buffer out of each rank, (t − 1)/t of an
            // all-gather's or a reduce-scatter's (the whole gathered buffer). Every buffer here
            // splits evenly over t, so the bytes are exact.
            let t = tp as f64;
            let ring = |list: &[TpCollective]| -> f64 {
                list.iter().map(|c| c.bytes * (t - 1.0) / t * if c.coll == Coll::AllReduce { 2.0 } else { 1.0 }).sum()
            };
            let (sim_bytes, left_bytes) = (ring(&sim), ring(&left));
            let case = format!("tp {tp} sp {sp} recompute {recompute}");
            for (rank, (calls, collectives, sent)) in got.into_iter().enumerate() {
                assert_eq!(calls, want, "{case} rank {rank}: all-reduces, all-gathers, reduce-scatters");
                assert_eq!(collectives, want.iter().sum::<u64>(), "{case} rank {rank}: no other collective");
                println!("{case} rank {rank}: sent {sent} B; charged {sim_bytes:.0} + left out {left_bytes:.0}");
                assert_eq!(
                    sent as f64,
                    sim_bytes + left_bytes,
                    "{case} rank {rank}: bytes sent, and the simulator's rings"
                );
            }
        }
    }
}

/// NCCL's all-reduce bus bandwidth in one 8-GPU node as its maintainers give it
/// (`sim::validate::nccl_bus_bandwidth`, each figure with its source): the simulator's ring within
/// 10% on A100 and H100; NVLink SHARP (in-switch reduction, NCCL's default all-reduce on H100 and
/// H200) is not modelled, and the simulator stays below it.
#[test]
fn nccls_published_bus_bandwidth_in_a_node() {
    for b in validate::nccl_bus_bandwidth() {
        let gpu = profile(b.gpu).unwrap();
        let got = validate::simulated_bus_bandwidth(&gpu, 4.0 * (1u64 << 30) as f64);
        let err = got / b.bus_gb_s - 1.0;
        println!("{} ring {}: published {} GB/s, simulated {got:.0} ({:+.1}%)", b.gpu, b.ring, b.bus_gb_s, 100.0 * err);
        if b.ring {
            assert!(err.abs() < 0.10, "{}: {got:.0} GB/s against {} ({})", b.gpu, b.bus_gb_s, b.source);
        } else {
            assert!(err < -0.15, "{}: NVLink SHARP is not modelled, yet {got:.0} GB/s", b.gpu);
        }
    }
}
