//! Grader for lesson 06 (the FSDP round trip).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/06_fsdp_round_trip/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 06` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong.

#[path = "../lessons/06_fsdp_round_trip/exercise.rs"]
mod exercise_code;
#[path = "../solutions/06_fsdp_round_trip.rs"]
mod solution_code;

use shardlab::model::{Batch, Gpt, GptConfig, Mlp, MlpConfig, Model};
use shardlab::prelude::*;
use shardlab::zero::flat::FlatLayout;
use shardlab::zero::round_trip::{Gathered, LiveUnits, UnitStack};
use std::cell::RefCell;

shardlab::graders! {
    lesson: "06", exercise_file: "lessons/06_fsdp_round_trip/exercise.rs";

    /// shardlab's own copies of what each exercise builds (exercise K: `TWINS[K - 1]`): an exercise
    /// that names one is refused ("write it yourself").
    const TWINS: &[&[&str]] = &[&["FlatLayout", ".shard_range"], &["ShardedTensors"], &["ShardedTensors"], &["ShardedTensors", "zero::Zero", "Zero::new"]];

    /// N ranks as threads, over the local backend and over TCP; a peer silent for a minute fails the test.
    fn both(n: usize) -> [SpawnOptions; 2] {
        let cfg = CommConfig::default().with_timeout(std::time::Duration::from_secs(60));
        [
            SpawnOptions::new(n, Backend::Local).config(cfg.clone()),
            SpawnOptions::new(n, Backend::Tcp).launch(Launch::Threads).config(cfg),
        ]
    }

    #[test]
    fn ex1_pad_and_shard() {
        shardlab::grading::refuse_twins(GRADER, 1, TWINS[0]);
        for n in 1..=8usize {
            for numel in [0i64, 1, 7, 8, 1000, 1003, 12_704] {
                let parts: Vec<_> = (0..n).map(|r| pad_and_shard(numel, n, r)).collect();
                let padded = parts[0].0;
                assert!(
                    parts.iter().all(|p| p.0 == padded),
                    "numel={numel} n={n}: every rank must agree on the padded size"
                );
                assert!(
                    padded >= numel && padded - numel < n as i64 && padded % n as i64 == 0,
                    "numel={numel} n={n}: padded to {padded}, want the next multiple of {n}"
                );
                assert_eq!(parts[0].1.start, 0, "numel={numel} n={n}: rank 0 starts at 0");
                assert_eq!(parts[n - 1].1.end, padded, "numel={numel} n={n}: the last shard ends at the padded size");
                assert!(parts.windows(2).all(|w| w[0].1.end == w[1].1.start), "numel={numel} n={n}: contiguous shards");
                assert!(
                    parts.iter().all(|p| p.1.end - p.1.start == padded / n as i64),
                    "numel={numel} n={n}: equal shards"
                );
            }
        }
    }

    #[test]
    fn ex2_gather_unit_rebuilds_the_flat_buffer() {
        shardlab::grading::refuse_twins(GRADER, 2, TWINS[1]);
        for n in 1..=4 {
            for opts in both(n) {
                let out = spawn_with(opts, |pg| {
                    let r = pg.rank() as f32;
                    let shard = Tensor::from_slice(&(0..5).map(|i| r * 100.0 + i as f32).collect::<Vec<_>>());
                    let before = pg.stats();
                    let full = gather_unit(pg, &shard)?;
                    let ran = pg.stats().since(&before);
                    anyhow::ensure!(
                        pg.world_size() == 1 || (ran.calls(OpKind::AllGather) == 1 && ran.collectives == 1 && ran.p2p == 0),
                        "rank {}: gather_unit should make exactly one all_gather; it made {} \
                         (an all_reduce of zero-padded shards gets the values but moves twice the bytes)",
                        pg.rank(),
                        ran.describe_calls()
                    );
                    if let Some(e) = shardlab::grading::layout_error(&full, &[5 * pg.world_size() as i64], Kind::Float) {
                        anyhow::bail!("rank {}: gather_unit returned {e} (every rank's 5-element shard, in rank order)", pg.rank());
                    }
                    Ok(Vec::<f32>::try_from(&full)?)
                })
                .unwrap();
                let want: Vec<f32> = (0..n).flat_map(|r| (0..5).map(move |i| r as f32 * 100.0 + i as f32)).collect();
                assert!(out.iter().all(|v| *v == want), "n={n}: every rank must hold all shards in rank order");
            }
        }
    }

    #[test]
    fn ex3_reduce_scatter_averages_and_keeps_the_own_shard() {
        shardlab::grading::refuse_twins(GRADER, 3, TWINS[2]);
        for n in 1..=4 {
            for opts in both(n) {
                let out = spawn_with(opts, |pg| {
                    let full =
                        Tensor::arange(4 * pg.world_size() as i64, (Kind::Float, Device::Cpu)) * (pg.rank() as f64 + 1.0);
                    let before = pg.stats();
                    let shard = reduce_scatter_grads(pg, &full)?;
                    let ran = pg.stats().since(&before);
                    anyhow::ensure!(
                        pg.world_size() == 1
                            || (ran.calls(OpKind::ReduceScatter) == 1 && ran.collectives == 1 && ran.p2p == 0),
                        "rank {}: reduce_scatter_grads should make exactly one reduce_scatter; it made {} \
                         (an all_reduce and a slice gets the values but moves twice the bytes, and every rank then \
                         holds gradients it throws away)",
                        pg.rank(),
                        ran.describe_calls()
                    );
                    if let Some(e) = shardlab::grading::layout_error(&shard, &[4], Kind::Float) {
                        anyhow::bail!("rank {}: reduce_scatter_grads returned {e} (this rank's 4-element block of the gradient)", pg.rank());
                    }
                    Ok(Vec::<f32>::try_from(&shard)?)
                })
                .unwrap();
                let mean = (1..=n).sum::<usize>() as f32 / n as f32;
                for (r, got) in out.iter().enumerate() {
                    let want: Vec<f32> = (4 * r..4 * r + 4).map(|i| i as f32 * mean).collect();
                    assert_eq!(got, &want, "n={n} rank {r}: the average of every rank's elements {}..{}", 4 * r, 4 * r + 4);
                }
            }
        }
    }

    #[test]
    fn ex3_and_1_2_a_gpt_unit_survives_the_round_trip() {
        shardlab::grading::refuse_twins(GRADER, 3, TWINS[2]);
        // Shard a real unit (block 0 of the tiny GPT, 12 704 elements: N = 3 pads it), gather it back,
        // and reduce-scatter a gradient: the same numbers as the unsharded computation.
        for n in [2usize, 3] {
            let out = spawn(n, Backend::Local, |pg| {
                let m = Gpt::new(GptConfig::tiny(), 0)?;
                let unit: Vec<Tensor> = m.parameters()[2..14].iter().map(|p| p.detach().reshape([-1])).collect();
                let flat = Tensor::cat(&unit, 0);
                let (padded, range) = pad_and_shard(flat.numel() as i64, pg.world_size(), pg.rank());
                let padded_flat = Tensor::zeros([padded], (Kind::Float, Device::Cpu));
                padded_flat.narrow(0, 0, flat.numel() as i64).copy_(&flat);
                let shard = padded_flat.narrow(0, range.start, range.end - range.start).copy();
                let back = gather_unit(pg, &shard)?;
                let grad = &padded_flat * (pg.rank() as f64 + 1.0);
                let g = reduce_scatter_grads(pg, &grad)?;
                let want =
                    padded_flat.narrow(0, range.start, range.end - range.start) * ((pg.world_size() + 1) as f64 / 2.0);
                for (what, got, want) in [("gather_unit", &back, &padded_flat), ("reduce_scatter_grads", &g, &want)] {
                    if let Some(e) = shardlab::grading::layout_error(got, &want.size(), want.kind()) {
                        anyhow::bail!("rank {}: {what} returned {e}", pg.rank());
                    }
                }
                Ok((back.equal(&padded_flat), g.allclose(&want, 1e-6, 1e-6, false)))
            })
            .unwrap_or_else(|e| panic!("n={n}: {e:#}"));
            assert!(out.iter().all(|&(a, b)| a && b), "n={n}: gathered unit or averaged gradient shard differs: {out:?}");
        }
    }

    // ---- exercise 4: the round trip over a stack of units ----

    /// The model of exercise 4: an MLP 7 → 16 → 16 → 16 → 3 (tanh, MSE loss), one unit per layer
    /// (its weight and bias, 128, 272, 272 and 51 elements: N = 3 pads the first three, N = 4 the
    /// last), batch 4 rows per rank.
    const SIZES: [i64; 5] = [7, 16, 16, 16, 3];
    const ROWS: i64 = 4;

    fn mlp() -> Mlp {
        Mlp::new(MlpConfig { sizes: SIZES.to_vec() }, 6).expect("the MLP")
    }

    /// Unit i of the MLP (layer i) on its flat parameters: `x·Wᵀ + b`, then tanh, or the loss.
    fn layer(u: usize, layout: &FlatLayout, flat: &Tensor, x: &Tensor, y: &Tensor) -> Tensor {
        let out = x.linear(&layout.view(flat, 0), Some(&layout.view(flat, 1)));
        if u + 1 == SIZES.len() - 1 {
            out.mse_loss(y, tch::Reduction::Mean)
        } else {
            out.tanh()
        }
    }

    /// What the stack saw of one compute: forward or backward, which unit, the units alive then.
    #[derive(Debug)]
    struct Seen {
        backward: bool,
        unit: usize,
        live: Vec<usize>,
        /// Live units whose buffer had been handed to a collective (its gather started).
        started: Vec<usize>,
    }

    /// The grader's `UnitStack`: the MLP's layers on this rank's rows, forward without a graph
    /// (each unit's input kept), backward recomputing the unit (as `Zero` does with
    /// `reshard_after_forward`). It counts the gathered buffers and notes every call.
    struct MlpUnits {
        layouts: Vec<FlatLayout>,
        /// Each unit's padded flat parameters, to check what the gather delivered.
        want: Vec<Tensor>,
        batch: Batch,
        live: LiveUnits,
        /// Input of each unit whose forward ran (unit 0's is the batch).
        inputs: RefCell<Vec<Tensor>>,
        /// Gradient of the loss with respect to the output of the unit backward reaches next.
        g_out: RefCell<Tensor>,
        seen: RefCell<Vec<Seen>>,
        problems: RefCell<Vec<String>>,
    }

    impl MlpUnits {
        /// Whether this call comes in order and gets the right, fully gathered unit; notes it.
        fn check(&self, backward: bool, unit: usize, p: &Gathered) -> bool {
            let l = self.layouts.len();
            let mut seen = self.seen.borrow_mut();
            let k = seen.len();
            let (want_bwd, want_unit) = if k < l { (false, k) } else { (true, (2 * l - 1).saturating_sub(k)) };
            seen.push(Seen { backward, unit, live: self.live.live(), started: self.live.started() });
            let what = |b: bool, u: usize| format!("{}({u})", if b { "backward" } else { "forward" });
            let mut problems = self.problems.borrow_mut();
            if !problems.is_empty() {
                return false;
            }
            if k >= 2 * l || (backward, unit) != (want_bwd, want_unit) {
                problems.push(format!(
                    "call {} to the stack was {}, expected {}: forward of units 0..{l} in order, then backward \
                     of the same units in reverse, each once",
                    k + 1,
                    what(backward, unit),
                    if k >= 2 * l { "no more calls".to_string() } else { what(want_bwd, want_unit) }
                ));
            } else if p.unit() != unit {
                problems.push(format!("{} was given the buffer of unit {}", what(backward, unit), p.unit()));
            } else if !p.params().equal(&self.want[unit]) {
                problems.push(format!(
                    "{} got parameters that are not unit {unit}'s full gathered parameters: gather this rank's \
                     shard into the unit's buffer (all_gather_async with `buffer.out()`), and wait on its Work \
                     before computing",
                    what(backward, unit)
                ));
            }
            problems.is_empty()
        }
    }

    impl UnitStack for MlpUnits {
        fn num_units(&self) -> usize {
            self.layouts.len()
        }
        fn buffer(&self, unit: usize) -> Gathered {
            self.live.alloc(unit, self.layouts[unit].padded)
        }
        fn forward(&self, unit: usize, p: &Gathered) {
            if !self.check(false, unit, p) {
                return;
            }
            let mut inputs = self.inputs.borrow_mut();
            let x = if unit == 0 { self.batch.x.shallow_clone() } else { inputs[unit].shallow_clone() };
            if unit == 0 {
                inputs.push(x.shallow_clone());
            }
            let out = tch::no_grad(|| layer(unit, &self.layouts[unit], p.params(), &x, &self.batch.y));
            inputs.push(out);
        }
        fn backward(&self, unit: usize, p: &Gathered) -> Tensor {
            let layout = &self.layouts[unit];
            if !self.check(true, unit, p) {
                return layout.zeros();
            }
            // Recompute the unit with a graph on the re-gathered parameters, then backward.
            let flat = p.params().detach().set_requires_grad(true);
            let x = self.inputs.borrow()[unit].detach().set_requires_grad(unit > 0);
            let out = layer(unit, layout, &flat, &x, &self.batch.y);
            let obj = if unit + 1 == self.layouts.len() { out } else { (out * &*self.g_out.borrow()).sum(Kind::Float) };
            let wrt = if unit > 0 { vec![flat, x] } else { vec![flat] };
            let mut g = Tensor::run_backward(&[obj], &wrt, false, false);
            if unit > 0 {
                *self.g_out.borrow_mut() = g.pop().expect("the input's gradient");
            }
            g.pop().expect("the unit's flat gradient")
        }
    }

    /// What one rank's round trip did.
    struct RoundTrip {
        /// The learner's gradient shards, and one process's (the same rows of every rank at once).
        got: Vec<Tensor>,
        want: Vec<Tensor>,
        ran: CommStats,
        shards: Vec<i64>,
        seen: Vec<Seen>,
        peak: usize,
        live_after: Vec<usize>,
        problems: Vec<String>,
    }

    /// Runs this lesson's `fsdp_round_trip` on this rank, next to one process on the whole batch.
    fn round_trip(pg: &ProcessGroup) -> anyhow::Result<RoundTrip> {
        let (n, r) = (pg.world_size(), pg.rank());
        let model = mlp();
        let global = model.synthetic_batch(ROWS * n as i64, 9);
        // One process, whole batch: the gradients every rank's averaged shards must add up to.
        let params = model.parameters();
        model.loss(&global).backward();
        let layouts: Vec<FlatLayout> = (0..SIZES.len() - 1)
            .map(|u| FlatLayout::new(vec![params[2 * u].size(), params[2 * u + 1].size()], n))
            .collect();
        let flat = |u: usize, ts: [Tensor; 2]| layouts[u].flatten(&ts);
        let full: Vec<Tensor> =
            (0..layouts.len()).map(|u| flat(u, [params[2 * u].shallow_clone(), params[2 * u + 1].shallow_clone()])).collect();
        let grads: Vec<Tensor> = (0..layouts.len()).map(|u| flat(u, [params[2 * u].grad(), params[2 * u + 1].grad()])).collect();
        let mine = |t: &Tensor, l: &FlatLayout| {
            let s = l.shard_range(r);
            t.narrow(0, s.start, s.end - s.start).copy()
        };
        let shards: Vec<Tensor> = full.iter().zip(&layouts).map(|(t, l)| mine(t, l)).collect();
        let want: Vec<Tensor> = grads.iter().zip(&layouts).map(|(t, l)| mine(t, l)).collect();
        let stack = MlpUnits {
            want: full,
            batch: global.rows(ROWS * r as i64, ROWS * (r as i64 + 1)),
            live: LiveUnits::new(),
            inputs: RefCell::new(Vec::new()),
            g_out: RefCell::new(Tensor::new()),
            seen: RefCell::new(Vec::new()),
            problems: RefCell::new(Vec::new()),
            layouts,
        };
        let before = pg.stats();
        let got = fsdp_round_trip(pg, &shards, &stack)?;
        let ran = pg.stats().since(&before);
        Ok(RoundTrip {
            got,
            want,
            ran,
            shards: stack.layouts.iter().map(|l| l.shard).collect(),
            peak: stack.live.peak(),
            live_after: stack.live.live(),
            seen: stack.seen.take(),
            problems: stack.problems.take(),
        })
    }

    /// The calls in order, each with the units alive then: `fwd0 [0, 1], fwd1 [1, 2], …`.
    fn timeline(seen: &[Seen]) -> String {
        let v: Vec<String> = seen
            .iter()
            .map(|s| format!("{}{} {:?}", if s.backward { "bwd" } else { "fwd" }, s.unit, s.live))
            .collect();
        v.join(", ")
    }

    fn ensure_protocol(pg: &ProcessGroup, t: &RoundTrip) -> anyhow::Result<()> {
        anyhow::ensure!(t.problems.is_empty(), "rank {}: {}", pg.rank(), t.problems.join("; "));
        anyhow::ensure!(
            t.seen.len() == 2 * t.shards.len(),
            "rank {}: the stack saw {} calls, expected a forward and a backward of each of the {} units: {}",
            pg.rank(),
            t.seen.len(),
            t.shards.len(),
            timeline(&t.seen)
        );
        Ok(())
    }

    #[test]
    fn ex4_round_trip_gradients_equal_one_process() {
        shardlab::grading::refuse_twins(GRADER, 4, TWINS[3]);
        for n in 1..=4 {
            for opts in both(n) {
                let backend = opts.backend;
                spawn_with(opts, |pg| {
                    let t = round_trip(pg)?;
                    ensure_protocol(pg, &t)?;
                    anyhow::ensure!(t.got.len() == t.want.len(), "rank {}: {} gradient shards returned, want one per unit ({})",
                        pg.rank(), t.got.len(), t.want.len());
                    for (u, (got, want)) in t.got.iter().zip(&t.want).enumerate() {
                        if let Some(e) = shardlab::grading::layout_error(got, &want.size(), want.kind()) {
                            anyhow::bail!("rank {}: unit {u}'s gradient shard is {e} (this rank's shard of the padded unit)", pg.rank());
                        }
                        let diff = (got - want).abs().max().double_value(&[]);
                        anyhow::ensure!(
                            got.allclose(want, 1e-4, 1e-6, false),
                            "rank {}: unit {u}'s gradient shard differs from one process on the whole batch by up to {diff:.3e} \
                             (this rank's block of the gradient averaged over ranks)",
                            pg.rank()
                        );
                    }
                    Ok(())
                })
                .unwrap_or_else(|e| panic!("n={n} {backend:?}: {e}"));
            }
        }
    }

    #[test]
    fn ex4_round_trip_sends_two_gathers_and_one_reduce_scatter_per_unit() {
        shardlab::grading::refuse_twins(GRADER, 4, TWINS[3]);
        for n in 2..=4 {
            for opts in both(n) {
                let backend = opts.backend;
                spawn_with(opts, |pg| {
                    let t = round_trip(pg)?;
                    ensure_protocol(pg, &t)?;
                    let (l, ran) = (t.shards.len() as u64, t.ran);
                    anyhow::ensure!(
                        ran.calls(OpKind::AllReduce) == 0,
                        "rank {}: the round trip made {}; FSDP needs no all_reduce (a reduce_scatter gives each rank \
                         its averaged block for half the bytes)",
                        pg.rank(), ran.describe_calls()
                    );
                    anyhow::ensure!(
                        ran.calls(OpKind::AllGather) == 2 * l && ran.calls(OpKind::ReduceScatter) == l
                            && ran.collectives == 3 * l && ran.p2p == 0,
                        "rank {}: the round trip made {}; want {} all_gather (every unit before its forward and again \
                         before its backward) and {l} reduce_scatter (every unit's gradient), nothing else",
                        pg.rank(), ran.describe_calls(), 2 * l
                    );
                    // Ring volume: each all-gather and each reduce-scatter sends N−1 of the N shards.
                    let want = 3 * (n as u64 - 1) * 4 * t.shards.iter().sum::<i64>() as u64;
                    anyhow::ensure!(
                        ran.bytes_sent == want,
                        "rank {}: sent {} bytes in the step; two all-gathers and one reduce-scatter of every unit send \
                         3·(N−1)·4·Σshard = {want}",
                        pg.rank(), ran.bytes_sent
                    );
                    Ok(())
                })
                .unwrap_or_else(|e| panic!("n={n} {backend:?}: {e}"));
            }
        }
    }

    #[test]
    fn ex4_round_trip_holds_at_most_two_gathered_units() {
        shardlab::grading::refuse_twins(GRADER, 4, TWINS[3]);
        for n in 1..=3 {
            spawn_with(both(n)[0].clone(), |pg| {
                let t = round_trip(pg)?;
                ensure_protocol(pg, &t)?;
                let r = pg.rank();
                anyhow::ensure!(
                    t.peak <= 2,
                    "rank {r}: up to {} gathered units were alive at once; the round trip holds at most 2 gathered units \
                     (the one computing and the one prefetched). Alive at each compute: {}",
                    t.peak, timeline(&t.seen)
                );
                let l = t.shards.len();
                for s in &t.seen {
                    let next = if s.backward { s.unit.checked_sub(1) } else { Some(s.unit + 1).filter(|&u| u < l) };
                    if let Some(next) = next {
                        anyhow::ensure!(
                            s.started.contains(&next),
                            "rank {r}: when unit {}'s {} ran, unit {next}'s all-gather had not been started: prefetch one \
                             unit ahead (start the next unit's gather before computing this one). Alive at each \
                             compute: {}",
                            s.unit, if s.backward { "backward" } else { "forward" }, timeline(&t.seen)
                        );
                    }
                }
                anyhow::ensure!(
                    t.live_after.is_empty(),
                    "rank {r}: units {:?} were still gathered after the step: drop each gathered unit after its compute",
                    t.live_after
                );
                Ok(())
            })
            .unwrap_or_else(|e| panic!("n={n}: {e}"));
        }
    }
}
