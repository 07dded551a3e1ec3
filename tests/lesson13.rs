//! Grader for lesson 13 (pipeline parallelism).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/13_pipeline_parallel/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 13` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong.

#[path = "../lessons/13_pipeline_parallel/exercise.rs"]
mod exercise_code;
#[path = "../solutions/13_pipeline_parallel.rs"]
mod solution_code;

use shardlab::pipeline::{Op, Schedule, Slot};
use shardlab::prelude::*;
use std::collections::BTreeMap;

shardlab::graders! {
    lesson: "13", exercise_file: "lessons/13_pipeline_parallel/exercise.rs";

    /// shardlab's own copies of what each exercise builds (exercise K: `TWINS[K - 1]`): an exercise
    /// that names one is refused ("write it yourself").
    const TWINS: &[&[&str]] = &[&["pipeline::schedule", "Schedule", "OneFOneB", "pipeline::interleaved", "ChunkOp"], &["simulate_plans", "simulate_chunks", "simulate_timed", "pipeline::Timeline", "pipeline::simulate"], &["pipeline::partition", "executor::partition"], &["run_pipeline", "pipeline_step", "pipeline::executor", "PipelineStep"], &["run_pipeline", "pipeline_step", "pipeline::executor", "PipelineStep"]];

    fn f(i: usize) -> Op {
        Op::Forward(i)
    }
    fn b(i: usize) -> Op {
        Op::Backward(i)
    }

    #[test]
    fn ex1_one_f_one_b_in_megatrons_order() {
        shardlab::grading::refuse_twins(GRADER, 1, TWINS[0]);
        // Written out by hand (Narayanan et al. 2021, fig. 4; Megatron-LM's schedule): p = 4, m = 8.
        assert_eq!(
            one_f_one_b(4, 8, 0),
            vec![f(0), f(1), f(2), f(3), b(0), f(4), b(1), f(5), b(2), f(6), b(3), f(7), b(4), b(5), b(6), b(7)],
            "stage 0 of 4: 3 warm-up forwards, then F3 B0 F4 B1 …, then the last backwards"
        );
        assert_eq!(
            one_f_one_b(4, 8, 3),
            vec![f(0), b(0), f(1), b(1), f(2), b(2), f(3), b(3), f(4), b(4), f(5), b(5), f(6), b(6), f(7), b(7)],
            "the last stage has no warm-up: F0 B0 F1 B1 …"
        );
        assert_eq!(one_f_one_b(4, 2, 0), vec![f(0), f(1), b(0), b(1)], "m = 2 below the warm-up of 3: all forwards, then all backwards");
        assert_eq!(one_f_one_b(1, 3, 0), vec![f(0), b(0), f(1), b(1), f(2), b(2)], "one stage: forward, backward, …");
        for p in 1..=6 {
            for m in 1..=9 {
                for s in 0..p {
                    let ops = one_f_one_b(p, m, s);
                    // 1F1B as the lesson states it: min(p − s − 1, m) warm-up forwards, then a
                    // forward and a backward in turn while forwards remain, then the backwards;
                    // forwards and backwards each in micro-batch order.
                    let warm = (p - s - 1).min(m);
                    let mut want: Vec<Op> = (0..warm).map(f).collect();
                    for i in 0..m - warm {
                        want.push(f(warm + i));
                        want.push(b(i));
                    }
                    want.extend((m - warm..m).map(b));
                    assert_eq!(ops, want, "p={p} m={m} stage {s}");
                    let (mut held, mut peak) = (0i64, 0i64);
                    for o in &ops {
                        held += if matches!(o, Op::Forward(_)) { 1 } else { -1 };
                        peak = peak.max(held);
                    }
                    assert!(peak as usize <= p - s, "p={p} m={m} stage {s}: {peak} micro-batches in flight, 1F1B keeps at most p − s");
                }
            }
        }
    }

    fn plans(kind: Schedule, p: usize, m: usize) -> Vec<Vec<Op>> {
        (0..p).map(|s| shardlab::pipeline::schedule(kind, p, m, s)).collect()
    }

    #[test]
    fn ex2_simulate_times_every_operation() {
        shardlab::grading::refuse_twins(GRADER, 2, TWINS[1]);
        // p = 2, m = 2, GPipe, t_f = 1, t_b = 2, by hand: stage 0 F0 0–1, F1 1–2; stage 1 F0 1–2,
        // F1 2–3, B0 3–5, B1 5–7; stage 0 B0 5–7 (after stage 1's B0), B1 7–9.
        let got = simulate(&plans(Schedule::GPipe, 2, 2), 1.0, 2.0).unwrap_or_else(|e| panic!("GPipe p=2 m=2: {e}"));
        let times = |s: usize| got[s].iter().map(|x| (x.op, x.start, x.end)).collect::<Vec<_>>();
        assert_eq!(times(0), vec![(f(0), 0.0, 1.0), (f(1), 1.0, 2.0), (b(0), 5.0, 7.0), (b(1), 7.0, 9.0)], "stage 0 (op, start, end)");
        assert_eq!(times(1), vec![(f(0), 1.0, 2.0), (f(1), 2.0, 3.0), (b(0), 3.0, 5.0), (b(1), 5.0, 7.0)], "stage 1 (op, start, end)");
        assert!(got.iter().enumerate().all(|(s, v)| v.iter().all(|x| x.stage == s)), "each slot names its stage");
        // The bubble of both schedules with equal stages: (p − 1)/(m + p − 1) on every stage.
        for kind in [Schedule::GPipe, Schedule::OneFOneB] {
            for (p, m) in [(2, 4), (4, 8), (4, 3), (3, 7)] {
                let t = simulate(&plans(kind, p, m), 1.0, 2.0).unwrap_or_else(|e| panic!("{kind:?} p={p} m={m}: {e}"));
                let span = t.iter().flatten().map(|x| x.end).fold(0.0, f64::max);
                for (s, slots) in t.iter().enumerate() {
                    let busy: f64 = slots.iter().map(|x| x.end - x.start).sum();
                    let bubble = 1.0 - busy / span;
                    let want = (p as f64 - 1.0) / (m + p - 1) as f64;
                    assert!((bubble - want).abs() < 1e-9, "{kind:?} p={p} m={m} stage {s}: bubble {bubble}, want (p−1)/(m+p−1) = {want}");
                }
            }
        }
        // Plans that can never finish. Stage 0 wants B0 before its F0: stage 1's B0 waits for
        // stage 1's F0, which waits for stage 0's F0.
        let stuck = vec![vec![b(0), f(0)], vec![f(0), b(0)]];
        let e = simulate(&stuck, 1.0, 1.0).expect_err("stage 0 waits for B0 of stage 1, which waits for F0 of stage 0: that never finishes");
        assert!(e.to_lowercase().contains("deadlock"), "say it deadlocks: {e}");
        // The last stage wants B0 before its own F0: its backward follows its own forward.
        let stuck = vec![vec![f(0), b(0)], vec![b(0), f(0)]];
        let e = simulate(&stuck, 1.0, 1.0).expect_err("the last stage's B0 waits for its own F0, which comes after it: a deadlock");
        assert!(e.to_lowercase().contains("deadlock"), "say it deadlocks: {e}");
    }

    #[test]
    fn ex3_partition_is_contiguous_and_balanced() {
        shardlab::grading::refuse_twins(GRADER, 3, TWINS[2]);
        assert_eq!(partition(6, 4).unwrap(), vec![0..2, 2..4, 4..5, 5..6], "6 stages on 4 ranks: 2, 2, 1, 1");
        assert_eq!(partition(4, 4).unwrap(), vec![0..1, 1..2, 2..3, 3..4]);
        assert_eq!(partition(7, 1).unwrap(), vec![0..7]);
        for n in 1..=12 {
            for r in 1..=n {
                let parts = partition(n, r).unwrap();
                assert_eq!(parts.len(), r, "{n} stages on {r} ranks: one piece per rank");
                // Contiguous from 0 to n, sizes within one of each other, the larger first.
                assert!(parts.first().map(|p| p.start) == Some(0) && parts.last().map(|p| p.end) == Some(n), "{n} stages on {r} ranks: {parts:?} must cover 0..{n}");
                assert!(parts.windows(2).all(|w| w[0].end == w[1].start), "{n} stages on {r} ranks: {parts:?} must be contiguous");
                let sizes: Vec<usize> = parts.iter().map(|p| p.len()).collect();
                assert!(sizes.windows(2).all(|w| w[0] >= w[1]) && sizes[0] - sizes[r - 1] <= 1, "{n} stages on {r} ranks: sizes {sizes:?} must differ by at most one, the larger first");
            }
        }
        let e = partition(4, 5).expect_err("5 ranks for 4 stages: a rank would have nothing to run");
        assert!(!e.is_empty(), "the error should say why");
        assert!(partition(4, 0).is_err(), "0 ranks is an error");
    }

    /// A 4-stage GPT (embeddings, two blocks, head) and an 8-row batch whose first row has 11
    /// targets −1: micro-batches then hold different numbers of targets (tests/pipeline.rs's set-up).
    fn gpt_and_batch() -> (GptConfig, Batch) {
        let cfg = GptConfig { vocab_size: 64, block_size: 16, n_layer: 2, n_head: 2, n_embd: 32 };
        let data = shardlab::data::synthetic_corpus(4000, 3);
        let batch = DistributedSampler::new(16, 8, 0, 1, 5).unwrap().batch(&data, 0);
        let _ = batch.y.narrow(0, 0, 1).narrow(1, 0, 11).fill_(-1);
        (cfg, batch)
    }

    /// Every rank runs the learner's `run_rank` on its stages of the same GPT with `plan`s from
    /// `kind`: (its loss, its gradients by parameter index) per rank.
    fn run_ranks(opts: SpawnOptions, kind: Schedule, m: usize, cfg: GptConfig, batch: fn() -> (GptConfig, Batch)) -> Vec<(f64, Vec<(usize, Vec<f32>)>)> {
        let p = opts.world_size;
        spawn_with(opts, move |pg| {
            let (_, batch) = batch();
            let gpt = Gpt::new(cfg, 9)?;
            let r = pg.rank();
            let parts = shardlab::pipeline::partition(gpt.num_stages(), p).map_err(anyhow::Error::msg)?;
            let mut runner = shardlab::pipeline::model_runner(&gpt, parts[r].clone(), cfg.n_embd);
            let plan = shardlab::pipeline::schedule(kind, p, m, r);
            let next = if r + 1 == p { vec![] } else { shardlab::pipeline::schedule(kind, p, m, r + 1) };
            let (loss, grads) = run_rank(pg, &mut runner, &plan, &next, &batch, m)?;
            let params = gpt.parameters();
            for (&k, g) in &grads {
                let p = params.get(k).ok_or_else(|| anyhow::anyhow!("rank {r}: a gradient for parameter {k}; the model has {}", params.len()))?;
                if let Some(e) = shardlab::grading::layout_error(g, &p.size(), Kind::Float) {
                    anyhow::bail!("rank {r}: parameter {k}'s gradient sum is {e}: want its parameter's shape, f32");
                }
            }
            let grads = grads.iter().map(|(&k, g)| (k, Vec::<f32>::try_from(g.reshape([-1])).unwrap())).collect();
            Ok((loss, grads))
        })
        .unwrap_or_else(|e| {
            let e = e.to_string();
            let why = if e.contains("timed out") {
                " — the ranks waited on each other until the timeout: does every send have its receiver on the way to \
                 it? (README, \"Two neighbours that both send first\"; or the machine was very busy: grade again \
                 with `cargo grade 13 ex4`)"
            } else {
                ""
            };
            panic!("{kind:?}, {p} ranks, {m} micro-batches: {e}{why}")
        })
    }

    #[test]
    fn ex4_a_pipelined_step_equals_one_process() {
        shardlab::grading::refuse_twins(GRADER, 4, TWINS[3]);
        let (cfg, batch) = gpt_and_batch();
        let gpt = Gpt::new(cfg, 9).unwrap();
        let loss = gpt.loss(&batch);
        loss.backward();
        let want_loss = loss.double_value(&[]);
        let names: Vec<String> = gpt.named_parameters().into_iter().map(|(n, _)| n).collect();
        let want: Vec<Tensor> = gpt.parameters().iter().map(|p| p.grad().reshape([-1])).collect();
        let uses = gpt.stage_uses();
        for (p, m, kind) in [(1usize, 2usize, Schedule::OneFOneB), (2, 4, Schedule::OneFOneB), (4, 8, Schedule::OneFOneB), (4, 4, Schedule::GPipe), (3, 2, Schedule::OneFOneB)] {
            // A wrong order of sends and receives waits for the timeout: 20 s, not the default 300.
            let opts = SpawnOptions::new(p, Backend::Local).config(CommConfig::default().with_timeout(std::time::Duration::from_secs(20)));
            let out = run_ranks(opts, kind, m, cfg, gpt_and_batch);
            let at = format!("{kind:?}, {p} ranks, {m} micro-batches");
            for (r, (l, _)) in out.iter().enumerate().take(p - 1) {
                assert_eq!(*l, 0.0, "{at}, rank {r}: only the last rank has the loss; return 0.0 on the others");
            }
            let got_loss = out[p - 1].0;
            if (got_loss - want_loss).abs() >= 1e-5 {
                // The plain mean of the micro-batches' means (right only when they hold equal counts).
                let mb = 8 / m as i64;
                let plain: f64 = (0..m as i64).map(|i| gpt.loss(&batch.rows(i * mb, (i + 1) * mb)).double_value(&[])).sum::<f64>() / m as f64;
                let why = if (got_loss - plain).abs() < 1e-5 {
                    "each micro-batch weighed 1/m; weigh it by its share of the batch's targets (README, \"The loss over micro-batches\")"
                } else {
                    "the batch's mean is Σ_i (c_i / C) · mean_i over the micro-batches"
                };
                panic!("{at}: the last rank's loss is {got_loss}, one process's {want_loss}: {why}");
            }
            let parts = shardlab::pipeline::partition(uses.len(), p).unwrap();
            let mut sums: Vec<Option<Tensor>> = (0..want.len()).map(|_| None).collect();
            for (r, (_, grads)) in out.iter().enumerate() {
                let mut mine: Vec<usize> = parts[r].clone().flat_map(|s| uses[s].iter().copied()).collect();
                mine.sort_unstable();
                mine.dedup();
                let keys: Vec<usize> = grads.iter().map(|(k, _)| *k).collect();
                assert_eq!(keys, mine, "{at}, rank {r}: gradients of the parameters its stages use, each once (by index), got {keys:?}");
                // The tied embedding's parts (ranks 0 and p − 1) summed here, as the exchange would.
                for (k, g) in grads {
                    let g = Tensor::from_slice(g);
                    sums[*k] = Some(match sums[*k].take() { Some(s) => s + g, None => g });
                }
            }
            for (k, s) in sums.iter().enumerate() {
                let s = s.as_ref().unwrap_or_else(|| panic!("{at}: no rank returned a gradient for {}", names[k]));
                assert_eq!(s.size(), want[k].size(), "{at}: {}'s gradient has {} elements, expected {}", names[k], s.numel(), want[k].numel());
                let d = (s - &want[k]).abs().max().double_value(&[]);
                assert!(
                    d < 1e-5,
                    "{at}: {}'s gradient (summed over micro-batches, and over ranks where it is tied) differs from one \
                     process's by {d}: the last rank starts B i from micro-batch i's weight, every other rank from the \
                     gradient it receives, and each adds its gradients over the micro-batches{}",
                    names[k],
                    if k == 0 && p > 1 {
                        " (the tied embedding's exchange between the first and the last rank is not part of run_rank)"
                    } else {
                        " (each received activation in a tensor of its own: a reused buffer overwrites one autograd still holds)"
                    }
                );
            }
        }
    }

    /// 8 MiB activations over TCP sockets between 4 ranks: a send waits until its receiver reads
    /// (a socket's buffers hold less), so two neighbours that both send first wait for each other.
    #[test]
    fn ex4_sends_that_block_do_not_deadlock() {
        shardlab::grading::refuse_twins(GRADER, 4, TWINS[3]);
        fn big() -> (GptConfig, Batch) {
            let cfg = GptConfig { vocab_size: 64, block_size: 64, n_layer: 2, n_head: 4, n_embd: 64 };
            // 4 micro-batches of 512 rows: (512, 64, 64) f32 = 8 MiB per activation.
            (cfg, DistributedSampler::new(64, 2048, 0, 1, 5).unwrap().batch(&shardlab::data::synthetic_corpus(200_000, 3), 0))
        }
        let mut config = CommConfig::default().with_timeout(std::time::Duration::from_secs(45));
        config.transport = shardlab::comm::DataPath::Tcp;
        let opts = SpawnOptions::new(4, Backend::Tcp).launch(Launch::Threads).config(config);
        let (cfg, batch) = big();
        let out = run_ranks(opts, Schedule::OneFOneB, 4, cfg, big);
        let want = Gpt::new(cfg, 9).unwrap().loss(&batch).double_value(&[]);
        assert!((out[3].0 - want).abs() < 1e-5, "1F1B over TCP: the last rank's loss is {}, one process's {want}", out[3].0);
    }

    /// Rank r's part of parameter k in the exchange's tests: small integers, distinct per rank
    /// and parameter, so that every sum is exact in f32; parameter 0 is (2, 3), the others (4,).
    fn small_part(r: usize, k: usize) -> Tensor {
        let shape: &[i64] = if k == 0 { &[2, 3] } else { &[4] };
        Tensor::arange(shape.iter().product::<i64>(), (Kind::Float, Device::Cpu)).reshape(shape)
            + (100 * (r + 1) + 10 * k) as f64
    }

    /// Parts that are not integers (sin of distinct arguments): sums in f32 depend on their order.
    fn float_part(r: usize, k: usize) -> Tensor {
        (Tensor::arange(64, (Kind::Double, Device::Cpu)) * 0.731 + 1.37 * r as f64 + 0.113 * k as f64).sin().to_kind(Kind::Float)
    }

    /// Parameter 0 is 32 MiB, (2048, 4096) f32, filled with r + 1 (more than the sockets' buffers
    /// hold, whatever the kernel's setting); the others as `small_part`.
    fn big_part(r: usize, k: usize) -> Tensor {
        if k == 0 {
            Tensor::full([2048, 4096], (r + 1) as f64, (Kind::Float, Device::Cpu))
        } else {
            small_part(r, k)
        }
    }

    /// Every rank runs the learner's `sum_tied` on its parts of the parameters `used[r]`, then
    /// checks what it holds against the sum over each parameter's users (within `tol`); returns
    /// each rank's bytes sent and its gradients after the exchange.
    fn exchange(
        opts: SpawnOptions,
        used: Vec<Vec<usize>>,
        part: fn(usize, usize) -> Tensor,
        tol: f64,
    ) -> Vec<(u64, BTreeMap<usize, Vec<f32>>)> {
        let (p, at) = (opts.world_size, format!("{} ranks, used = {used:?}", opts.world_size));
        let at2 = at.clone();
        let blocking = opts.backend == Backend::Tcp;
        let out = spawn_with(opts, move |pg| {
            let r = pg.rank();
            let mut grads: BTreeMap<usize, Tensor> = used[r].iter().map(|&k| (k, part(r, k))).collect();
            let before = pg.stats();
            sum_tied(pg, &mut grads, &used)?;
            let ran = pg.stats().since(&before);
            let keys: Vec<usize> = grads.keys().copied().collect();
            let mut mine = used[r].clone();
            mine.sort_unstable();
            anyhow::ensure!(keys == mine, "{at}, rank {r}: grads must keep exactly its parameters {mine:?}, got {keys:?}");
            for (&k, g) in &grads {
                let users: Vec<usize> = (0..used.len()).filter(|&q| used[q].contains(&k)).collect();
                let own = part(r, k).to_kind(Kind::Double);
                let sum = users.iter().map(|&q| part(q, k).to_kind(Kind::Double)).fold(own.zeros_like(), |a, b| a + b);
                let want = if users.len() > 1 { sum.shallow_clone() } else { own.shallow_clone() };
                let d = shardlab::grading::max_diff(&g.to_kind(Kind::Double), &want, &format!("{at}, rank {r}: parameter {k}'s gradient"));
                if d > tol {
                    let g = g.to_kind(Kind::Double);
                    let close = |t: &Tensor| (&g - t).abs().max().double_value(&[]) <= tol.max(1e-5);
                    let why = if users.len() < 2 {
                        "a parameter only this rank uses stays as it is".to_string()
                    } else if close(&own) {
                        "it still holds its own part: the sum never reached it".to_string()
                    } else if close(&(&sum / users.len() as f64)) {
                        "the mean of the parts: sum them, do not average".to_string()
                    } else if close(&(&sum + &own)) {
                        "its part was added twice: the sum already holds it".to_string()
                    } else {
                        "every user must end with the sum of all its users' parts".to_string()
                    };
                    anyhow::bail!("{at}, rank {r}: parameter {k} (used by ranks {users:?}) is off by {d}: {why}");
                }
            }
            let shares = used[r].iter().any(|k| used.iter().filter(|u| u.contains(k)).count() > 1);
            anyhow::ensure!(
                ran.collectives == 0 && (shares || ran.p2p == 0),
                "{at}, rank {r}{} made {}: only a parameter's users talk, with send and recv (a collective — a barrier, \
                 an all-reduce, or making a subgroup — runs through every rank of the group)",
                if shares { "" } else { ", which shares no parameter," },
                ran.describe_calls()
            );
            let vals = grads.iter().map(|(&k, g)| (k, Vec::<f32>::try_from(g.reshape([-1])).unwrap())).collect();
            Ok((ran.bytes_sent, vals))
        })
        .unwrap_or_else(|e| {
            let e = format!("{e:#}");
            let why = if e.contains("timed out") && blocking {
                " — the users waited on each other until the timeout: when both send first and a send waits until it \
                 is read, neither reads (README, \"Two neighbours that both send first\")"
            } else if e.contains("timed out") {
                " — a rank waited for a message no user sends (in-process sends never wait): both users receive \
                 first, or they disagree on who receives first, or on which parameters are shared"
            } else if e.contains("sent data for") {
                " — two users met at different parameters: walk the parameters in the same order on every rank"
            } else if e.contains("has not received") {
                " — a rank was sent a message it never asked for: do the users of each parameter agree on who \
                 receives first, by a rule that depends on the users only?"
            } else {
                ""
            };
            panic!("{at2}: {e}{why}")
        });
        assert_eq!(out.len(), p);
        out
    }

    /// The bytes all the ranks sent, against 2 (users − 1) × bytes summed over shared parameters.
    fn check_bytes(at: &str, out: &[(u64, BTreeMap<usize, Vec<f32>>)], limit: u64) {
        let total: u64 = out.iter().map(|o| o.0).sum();
        assert!(
            total <= limit,
            "{at}: the ranks sent {total} bytes in all; the exchange needs at most 2 (users − 1) × the bytes of each \
             shared parameter, {limit} here"
        );
    }

    #[test]
    fn ex5_tied_gradients_end_summed_on_every_user() {
        shardlab::grading::refuse_twins(GRADER, 5, TWINS[4]);
        let local = |p| {
            SpawnOptions::new(p, Backend::Local)
                .config(CommConfig::default().with_timeout(std::time::Duration::from_secs(20)))
        };
        // Written out by hand: ranks 0 and 3 share parameter 0, 0..6 + 100 and 0..6 + 400 → 500, 502, …, 510.
        let want0 = Tensor::from_slice(&[500.0f32, 502.0, 504.0, 506.0, 508.0, 510.0]).reshape([2, 3]);
        let sum0 = small_part(0, 0) + small_part(3, 0);
        assert!(sum0.equal(&want0), "the grader's own parts: {sum0:?}");
        // The GPT's layout on 4 ranks: wte (0) on the first and the last rank; 24 bytes, 2 users.
        let gpt = vec![vec![0, 1, 2], vec![3, 4], vec![5], vec![0, 6]];
        check_bytes("the GPT's layout", &exchange(local(4), gpt, small_part, 0.0), 2 * 24);
        // Parameter 7 on three ranks, parameter 0 on two; lists in any order.
        let three = vec![vec![7, 0, 1], vec![2], vec![3, 7], vec![0, 4, 7]];
        check_bytes("parameter 7 on ranks 0, 2, 3", &exchange(local(4), three, small_part, 0.0), 2 * 24 + 4 * 16);
        // A parameter shared by ranks 1 and 3, not 0; its index above the number of entries.
        let middle = vec![vec![0], vec![1, 8], vec![2], vec![8, 3]];
        check_bytes("parameter 8 on ranks 1 and 3", &exchange(local(4), middle, small_part, 0.0), 2 * 16);
        // Parts that are not integers: every user must hold the same bits (the copies stay equal).
        let floats = vec![vec![5, 0], vec![1], vec![5, 2], vec![5, 0, 3]];
        let out = exchange(local(4), floats, float_part, 1e-5);
        for k in [0usize, 5] {
            let copies: Vec<(usize, &Vec<f32>)> = out.iter().enumerate().filter_map(|(r, o)| o.1.get(&k).map(|v| (r, v))).collect();
            for (r, v) in &copies[1..] {
                let same = v.iter().zip(copies[0].1).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "parameter {k}: rank {r}'s sum differs in its bits from rank {}'s: every user must hold the same \
                     tensor (sums added in another order round differently), or the copies of a tied weight drift apart",
                    copies[0].0
                );
            }
        }
        // One rank, and two ranks that share nothing: nothing to do.
        exchange(local(1), vec![vec![0, 1]], small_part, 0.0);
        check_bytes("nothing shared", &exchange(local(2), vec![vec![0, 1], vec![2]], small_part, 0.0), 0);
    }

    /// A 32 MiB tied parameter between ranks 0 and 3 over TCP sockets: a send waits until its
    /// receiver reads, so two users that both send first wait for each other.
    #[test]
    fn ex5_the_exchange_does_not_deadlock_where_sends_block() {
        shardlab::grading::refuse_twins(GRADER, 5, TWINS[4]);
        let mut config = CommConfig::default().with_timeout(std::time::Duration::from_secs(45));
        config.transport = shardlab::comm::DataPath::Tcp;
        let opts = SpawnOptions::new(4, Backend::Tcp).launch(Launch::Threads).config(config);
        exchange(opts, vec![vec![0, 1], vec![2], vec![3], vec![0, 4]], big_part, 0.0);
    }
}

#[allow(dead_code)]
fn _uses(_: Slot) {}
