//! Grader for lesson 03 (the all-reduce family).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/03_allreduce_family/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 03` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong.

#[path = "../lessons/03_allreduce_family/exercise.rs"]
mod exercise_code;
#[path = "../solutions/03_allreduce_family.rs"]
mod solution_code;

use shardlab::prelude::*;
use std::time::Duration;

shardlab::graders! {
    lesson: "03", exercise_file: "lessons/03_allreduce_family/exercise.rs";

    /// shardlab's own copies of what each exercise builds (exercise K: `TWINS[K - 1]`): an exercise
    /// that names one is refused ("write it yourself").
    const TWINS: &[&[&str]] = &[&["comm::segment", "algo::segment", "plan::owned_range", "ddp::micro_batches"], &[], &[".all_reduce", ".all_reduce_with", ".all_reduce_async", ".reduce_scatter", ".reduce_scatter_with", ".reduce_scatter_async", ".all_gather", ".all_gather_with", ".all_gather_async"], &["model_time"]];

    #[test]
    fn ex1_ring_segments_split_evenly_in_order() {
        shardlab::grading::refuse_twins(GRADER, 1, TWINS[0]);
        for n in 1..=8 {
            for numel in [0usize, 1, 5, 7, 8, 1000, 1003] {
                let s = ring_segments(numel, n);
                assert_eq!(s.len(), n, "numel={numel} n={n}: one segment per rank");
                assert_eq!(s[0].start, 0, "numel={numel} n={n}: segments start at 0");
                assert_eq!(s[n - 1].end, numel, "numel={numel} n={n}: segments cover all {numel} elements");
                assert!(
                    s.windows(2).all(|w| w[0].end == w[1].start),
                    "numel={numel} n={n}: segments must be contiguous and in order: {s:?}"
                );
                let (lo, hi) = (s.iter().map(|r| r.len()).min().unwrap(), s.iter().map(|r| r.len()).max().unwrap());
                assert!(hi - lo <= 1, "numel={numel} n={n}: sizes differ by more than one: {s:?}");
            }
        }
    }

    #[test]
    fn ex2_ring_schedule_reduces_then_gathers_everything() {
        for n in 1..=7 {
            // Simulate: have[r][seg] = set of ranks whose contribution rank r holds for seg.
            let mut have: Vec<Vec<u64>> = (0..n).map(|r| (0..n).map(|_| 1u64 << r).collect()).collect();
            for step in 0..n - 1 {
                let snapshot = have.clone();
                for r in 0..n {
                    let (s, rv) = ring_schedule(r, n, step, false);
                    let (sp, _) = ring_schedule((r + n - 1) % n, n, step, false);
                    assert_eq!(
                        sp,
                        rv,
                        "n={n} step={step}: rank {r} expects segment {rv} but rank {} sends {sp}",
                        (r + n - 1) % n
                    );
                    let _ = s;
                    have[r][rv] |= snapshot[(r + n - 1) % n][rv];
                }
            }
            let all = (1u64 << n) - 1;
            for r in 0..n {
                assert_eq!(
                    have[r][(r + 1) % n],
                    all,
                    "n={n}: after reduce-scatter rank {r} should hold the full sum of segment {}",
                    (r + 1) % n
                );
            }
            let mut done: Vec<Vec<bool>> = (0..n).map(|r| (0..n).map(|s| s == (r + 1) % n).collect()).collect();
            for step in 0..n - 1 {
                let snapshot = done.clone();
                for r in 0..n {
                    let (s, rv) = ring_schedule(r, n, step, true);
                    let (sp, _) = ring_schedule((r + n - 1) % n, n, step, true);
                    assert_eq!(
                        sp, rv,
                        "n={n} gather step={step}: rank {r} expects segment {rv} but its neighbour sends {sp}"
                    );
                    assert!(snapshot[r][s], "n={n} gather step={step}: rank {r} sends segment {s} before it is complete");
                    done[r][rv] = snapshot[(r + n - 1) % n][rv] || done[r][rv];
                }
            }
            assert!(
                done.iter().all(|d| d.iter().all(|&x| x)),
                "n={n}: after all-gather every rank must hold every complete segment"
            );
        }
    }

    #[test]
    fn ex3_ring_all_reduce_sums_like_a_serial_reference_and_moves_ring_volume() {
        shardlab::grading::refuse_twins(GRADER, 3, TWINS[2]);
        // Small kernel socket buffers, and TCP even between ranks on this machine (shared-memory
        // rings would hold a whole segment): a ring in which every rank sends before it receives then
        // deadlocks over TCP (and fails after the timeout) instead of hiding in the buffers.
        std::env::set_var("SHARDLAB_SOCK_BUF", "65536");
        let cfg = CommConfig { chunk_bytes: 64 << 10, transport: DataPath::Tcp, ..CommConfig::default() }
            .with_timeout(Duration::from_secs(10));
        for backend in [Backend::Local, Backend::Tcp] {
            for n in 1..=4 {
                let opts = SpawnOptions::new(n, backend).launch(Launch::Threads).config(cfg.clone());
                let res = spawn_with(opts, |pg| {
                    let mut bad = Vec::new();
                    let n = pg.world_size();
                    // 1_000_003 f32: segments of 1–2 MB, far more than the 64 KiB socket buffers.
                    for numel in [1i64, 5, 1003, 1_000_003] {
                        let mine = |r: usize| Tensor::arange(numel, (Kind::Float, Device::Cpu)).remainder(13) + r as f64;
                        let mut t = mine(pg.rank());
                        let before = pg.stats();
                        ring_all_reduce(pg, &mut t)?;
                        let after = pg.stats();
                        let sent = after.bytes_sent - before.bytes_sent;
                        if after.collectives != before.collectives {
                            bad.push(format!(
                                "rank {}: ring_all_reduce called a collective (pg.all_reduce, …); use only send and recv",
                                pg.rank()
                            ));
                        }
                        // Serial reference: the sum of every rank's input.
                        let want = (0..n).map(mine).fold(Tensor::zeros([numel], (Kind::Float, Device::Cpu)), |a, b| a + b);
                        if let Some(e) = shardlab::grading::layout_error(&t, &want.size(), want.kind()) {
                            bad.push(format!("rank {} numel {numel}: t became {e} (sum into the tensor you were given)", pg.rank()));
                        } else if !t.allclose(&want, 1e-6, 1e-6, false) {
                            bad.push(format!("rank {} numel {numel}: wrong sum", pg.rank()));
                        }
                        // A ring sends 2(n−1)/n of the tensor per rank (± one element per step).
                        let ideal = 2.0 * (n as f64 - 1.0) / n as f64 * (numel * 4) as f64;
                        if (sent as f64 - ideal).abs() > (8 * n) as f64 {
                            bad.push(format!(
                                "rank {} numel {numel}: sent {sent} bytes, a ring sends about {ideal:.0}",
                                pg.rank()
                            ));
                        }
                    }
                    Ok(bad)
                })
                .unwrap_or_else(|e| panic!("{backend:?} n={n}: {e}"));
                let bad: Vec<String> = res.into_iter().flatten().collect();
                assert!(bad.is_empty(), "{backend:?} n={n}:\n{}", bad.join("\n"));
            }
        }
    }

    #[test]
    fn ex4_all_reduce_cost_model() {
        shardlab::grading::refuse_twins(GRADER, 4, TWINS[3]);
        let (a, b) = (20e-6, 1.0 / 3e9);
        assert_eq!(all_reduce_cost(1, 1e6, a, b), (0.0, 0.0), "one rank communicates nothing");
        let (naive, ring) = all_reduce_cost(4, 64e6, a, b);
        assert!((naive - 6.0 * (a + 64e6 * b)).abs() < 1e-12, "naive for n=4: 2(n−1)(α + Bβ), got {naive}");
        assert!((ring - (6.0 * a + 1.5 * 64e6 * b)).abs() < 1e-12, "ring for n=4: 2(n−1)α + 2(n−1)/n·Bβ, got {ring}");
        // 10 MB at α 20 µs and 3 GB/s (B·β = 3.3333 ms), worked by hand: naive 2(n − 1)·(α + Bβ),
        // ring 2(n − 1)·α + 2(n − 1)/n · Bβ.
        for (n, want_naive, want_ring) in [
            (2, 2.0 * 3.353_333_3e-3, 40e-6 + 3.333_333_3e-3), // 6.7067 ms, 3.3733 ms
            (3, 4.0 * 3.353_333_3e-3, 80e-6 + 4.444_444_4e-3), // 13.413 ms, 4.5244 ms
            (8, 14.0 * 3.353_333_3e-3, 280e-6 + 5.833_333_3e-3), // 46.947 ms, 6.1133 ms
        ] {
            let (nv, rg) = all_reduce_cost(n, 1e7, a, b);
            assert!((nv / want_naive - 1.0).abs() < 1e-6, "naive for n={n}: {nv} s, not {want_naive} s");
            assert!((rg / want_ring - 1.0).abs() < 1e-6, "ring for n={n}: {rg} s, not {want_ring} s");
        }
    }
}
