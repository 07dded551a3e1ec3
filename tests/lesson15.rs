//! Grader for lesson 15 (scaling out on paper).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/15_scaling_out/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 15` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong. Expected
//! values are worked out by hand in the comments next to them; none comes from shardlab's own
//! copy of the function (an exercise file that calls it is refused).

#[path = "../lessons/15_scaling_out/exercise.rs"]
mod exercise_code;
#[path = "../solutions/15_scaling_out.rs"]
mod solution_code;

shardlab::graders! {
    lesson: "15", exercise_file: "lessons/15_scaling_out/exercise.rs";

    /// No answer here needs shardlab: any use of it is its own copy of the exercise.
    const TWINS: &[&str] = &["shardlab"];

    fn near(got: f64, want: f64, rel: f64) -> bool {
        (got - want).abs() <= rel * want.abs()
    }

    /// A ring all-reduce's time on `n` ranks by the α-β model, each point times `factor[i]`.
    fn points(alpha: f64, beta: f64, n: usize, sizes: &[f64], factor: &[f64]) -> Vec<(f64, f64)> {
        let n = n as f64;
        sizes.iter().zip(factor.iter().cycle()).map(|(&b, f)| (b, (2.0 * (n - 1.0) * alpha + 2.0 * (n - 1.0) / n * b / beta) * f)).collect()
    }

    #[test]
    fn ex1_alpha_and_beta_from_measured_all_reduces() {
        shardlab::grading::refuse_twins(GRADER, 1, TWINS);
        let sizes = [1024.0, 16384.0, 262144.0, 1048576.0, 4194304.0, 16777216.0, 67108864.0];
        // A made-up link, α 20 µs and β 10 GB/s, on 2 ranks: 2·α + B/β exactly, recovered exactly.
        let (a, b) = fit_alpha_beta(&points(20e-6, 10e9, 2, &sizes, &[1.0]), 2).expect("seven good points");
        assert!(near(a, 20e-6, 1e-6) && near(b, 10e9, 1e-6), "points made with α = 20 µs, β = 10 GB/s on 2 ranks gave α = {a:e} s, β = {b:e} B/s");
        // 4 ranks, α 5 µs, β 20 GB/s: the ring takes 2·3 = 6 steps of α and moves 2·3/4 of B.
        let (a, b) = fit_alpha_beta(&points(5e-6, 20e9, 4, &sizes, &[1.0]), 4).expect("good points");
        assert!(
            near(a, 5e-6, 1e-6) && near(b, 20e9, 1e-6),
            "points made with α = 5 µs, β = 20 GB/s on 4 ranks gave α = {a:e} s, β = {b:e} B/s: on n ranks the ring has 2(n − 1) steps and moves 2(n − 1)/n of the bytes"
        );
        // Disturbed by ±3% (alternating), as a benchmark's points are: the 64 MiB point's 3% is
        // 200 µs, ten times the latency, so a plain least-squares line's intercept says little of
        // α (2.9 µs here); weighing each point's relative error gives 10.03 µs.
        let noisy = points(10e-6, 10e9, 2, &sizes, &[1.03, 0.97]);
        let (a, b) = fit_alpha_beta(&noisy, 2).expect("noisy points");
        // Weights of 1/t (or 1/B) land 2–3% off; a line through two of the points, 3%.
        assert!(
            near(a, 10e-6, 0.015) && near(b, 10e9, 0.01),
            "points of α = 10 µs, β = 10 GB/s disturbed by ±3% gave α = {a:e} s, β = {b:e} B/s: least squares of the relative error over every point — what weight on (a + c·B − t)² makes it ((a + c·B − t)/t)²?"
        );
        // Only the largest 5% slow: the same.
        let slow = points(10e-6, 10e9, 2, &sizes, &[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.05]);
        let (a, _) = fit_alpha_beta(&slow, 2).expect("points");
        assert!(near(a, 10e-6, 0.02), "the largest point 5% slow moved α to {a:e} s (made with 10 µs): weigh each point's relative error");
        assert!(fit_alpha_beta(&noisy[..1], 2).is_err(), "one point cannot give two unknowns: an Err");
        assert!(fit_alpha_beta(&noisy, 1).is_err(), "one rank has no all-reduce to fit: an Err");
        assert!(fit_alpha_beta(&[(1e6, 1e-3), (2e6, 0.5e-3)], 2).is_err(), "times that fall as the size grows: an Err, not a negative β");
        assert!(fit_alpha_beta(&[(1e6, 1e-3), (0.0, 1e-5)], 2).is_err(), "a size of 0 bytes: an Err");
        assert!(fit_alpha_beta(&[(1e6, 1e-3), (2e6, -1.0)], 2).is_err(), "a negative time: an Err");

        // A negative intercept (noisy or convex points) is a latency too small to resolve: 0.
        let (a, _) = fit_alpha_beta(&[(1e5, 20e-6), (2e5, 40e-6), (4e5, 80e-6), (8e5, 200e-6), (1.6e6, 500e-6)], 2).expect("points that grow");
        assert_eq!(a, 0.0, "these points' line crosses zero below 0 s: α is then 0, not negative");

        // Now yours, on this machine: all-reduces of 256 KiB to 4 MiB between two ranks here
        // (threads of this process), fitted by your function, each prediction printed next to its
        // measurement (`cargo test --test lesson15 exercise::ex1 -- --nocapture` shows them).
        // Timings on a shared machine jump, so only the fit's sanity is graded here.
        use shardlab::bench::{measure_with, Iters, Method, Timing};
        use shardlab::comm::{Algo, Backend, OpKind};
        let sizes: [u64; 5] = [256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20];
        let timing = Timing { warmup: 2, iters: Iters::Fixed(20), method: Method::NcclTests };
        let measured = shardlab::launch::spawn(2, Backend::Local, move |pg| {
            sizes.iter().map(|&b| Ok(measure_with(pg, "shardlab", OpKind::AllReduce, Algo::Ring, b, timing)?.time_s)).collect::<anyhow::Result<Vec<f64>>>()
        })
        .expect("two thread ranks");
        let here: Vec<(f64, f64)> = sizes.iter().zip(&measured[0]).map(|(b, t)| (*b as f64, *t)).collect();
        let (a, b) = fit_alpha_beta(&here, 2).unwrap_or_else(|e| panic!("your fit refused this machine's points {here:?}: {e}"));
        assert!(a.is_finite() && a >= 0.0 && b.is_finite() && b > 0.0, "this machine's points gave α = {a:e} s, β = {b:e} B/s: α must be a latency of 0 s or more and β a positive bandwidth");
        println!("this machine, two thread ranks, ring all-reduce: your α {:.1} µs, β {:.2} GB/s", a * 1e6, b / 1e9);
        for (bytes, t) in &here {
            let model = 2.0 * a + bytes / b;
            println!("  {:>8} B: measured {:>8.1} µs, your model {:>8.1} µs", bytes, t * 1e6, model * 1e6);
        }
    }

    #[test]
    fn ex2_an_all_reduce_across_the_hierarchy() {
        shardlab::grading::refuse_twins(GRADER, 2, TWINS);
        // An A100 node as NCCL sees it: NVLink α 5 µs and 230 GB/s of bus bandwidth; an HDR NIC
        // α 10 µs and 23 GB/s. One GB of gradients.
        let nvlink = Link { alpha: 5e-6, bytes_per_s: 230e9 };
        let nic = Link { alpha: 10e-6, bytes_per_s: 23e9 };
        let gb = 1e9;
        let check = |got: f64, want: f64, what: &str| assert!(near(got, want, 1e-6), "{what}: {got:e} s, not {want:e} s");
        // 8 GPUs in one node: 2·7·5 µs = 70 µs, and 2·7/8 · 1 GB / 230 GB/s = 7.6087 ms.
        check(all_reduce_seconds(gb, 8, 8, nvlink, nic), 70e-6 + 1.75 / 230.0, "8 GPUs in one node (NVLink only)");
        // 8 GPUs, one a node: every step crosses a NIC: 2·7·10 µs = 140 µs, 1.75 GB / 23 GB/s = 76.087 ms.
        check(all_reduce_seconds(gb, 8, 1, nvlink, nic), 140e-6 + 1.75 / 23.0, "8 GPUs one per node (the NIC bounds it and its latency counts)");
        // 64 GPUs, 8 a node: 8 NICs a node carry 184 GB/s, less than NVLink: 2·63·10 µs = 1.26 ms,
        // 2·63/64 · 1 GB / 184 GB/s = 10.6997 ms.
        check(all_reduce_seconds(gb, 64, 8, nvlink, nic), 1.26e-3 + 1.96875 / 184.0, "64 GPUs, 8 a node (bus bandwidth 8 × 23 GB/s)");
        // 16 GPUs, 4 a node: 4 × 23 = 92 GB/s: 2·15·10 µs = 300 µs, 1.875 GB / 92 GB/s = 20.380 ms.
        check(all_reduce_seconds(gb, 16, 4, nvlink, nic), 300e-6 + 1.875 / 92.0, "16 GPUs, 4 a node (bus bandwidth 4 × 23 GB/s)");
        // 400 Gb/s NICs (40 GB/s): 8 of them (320 GB/s) outrun NVLink, which bounds the ring:
        // 2·15·10 µs = 300 µs, 1.875 GB / 230 GB/s = 8.152 ms.
        let fast = Link { alpha: 10e-6, bytes_per_s: 40e9 };
        check(all_reduce_seconds(gb, 16, 8, nvlink, fast), 300e-6 + 1.875 / 230.0, "16 GPUs, 8 a node with 40 GB/s NICs (NVLink is then the slower)");
        // 4 KiB on 1,024 GPUs: latency is everything, 2·1023·10 µs = 20.46 ms (the bytes: 45 ns).
        check(all_reduce_seconds(4096.0, 1024, 8, nvlink, nic), 20.46e-3 + 2.0 * 1023.0 / 1024.0 * 4096.0 / 184e9, "4 KiB on 1,024 GPUs (a ring's latency)");
        // A group smaller than a node stays in it: 4 GPUs of 8 a node, 2·3·5 µs + 1.5 GB / 230 GB/s.
        check(all_reduce_seconds(gb, 4, 8, nvlink, nic), 30e-6 + 1.5 / 230.0, "4 GPUs with room for 8 in a node");
        assert_eq!(all_reduce_seconds(gb, 1, 8, nvlink, nic), 0.0, "one GPU has nothing to all-reduce");
    }

    /// An order as `F0.0 B1.0 …` (F/B, chunk.micro-batch), for messages.
    fn show(o: &[Step]) -> String {
        o.iter().map(|s| format!("{}{}.{}", if s.forward { "F" } else { "B" }, s.chunk, s.micro_batch)).collect::<Vec<_>>().join(" ")
    }

    fn same_order(got: Result<Vec<Step>, String>, want: Vec<Step>, what: &str) {
        let got = got.unwrap_or_else(|e| panic!("{what}: an Err ({e}) for a valid schedule"));
        if got != want {
            let at = got.iter().zip(&want).position(|(g, w)| g != w).unwrap_or(got.len().min(want.len()));
            panic!("{what}: first differs at operation {at}\n  yours:    {}\n  expected: {}", show(&got), show(&want));
        }
    }

    fn f(chunk: usize, micro_batch: usize) -> Step {
        Step { forward: true, chunk, micro_batch }
    }
    fn b(chunk: usize, micro_batch: usize) -> Step {
        Step { forward: false, chunk, micro_batch }
    }

    #[test]
    fn ex3_the_interleaved_schedule_rank_by_rank() {
        shardlab::grading::refuse_twins(GRADER, 3, TWINS);
        // p = 2, v = 2, m = 4, written out by hand (Narayanan et al. 2021, fig. 4 and Megatron-LM's
        // schedule). Forwards go through micro-batches in groups of p = 2, each group through
        // chunk 0 then chunk 1: (0,0) (0,1) (1,0) (1,1) (0,2) (0,3) (1,2) (1,3); backwards the same
        // groups through chunk 1 then chunk 0.
        // Rank 0 warms up with (p − 0 − 1)·2 + (v − 1)·p = 4 forwards.
        same_order(
            interleaved_order(2, 2, 4, 0),
            vec![f(0, 0), f(0, 1), f(1, 0), f(1, 1), f(0, 2), b(1, 0), f(0, 3), b(1, 1), f(1, 2), b(0, 0), f(1, 3), b(0, 1),
                 b(1, 2), b(1, 3), b(0, 2), b(0, 3)],
            "rank 0 of 2 with 2 chunks and 4 micro-batches",
        );
        // Rank 1: (2 − 1 − 1)·2 + 1·2 = 2 warm-up forwards.
        same_order(
            interleaved_order(2, 2, 4, 1),
            vec![f(0, 0), f(0, 1), f(1, 0), b(1, 0), f(1, 1), b(1, 1), f(0, 2), b(0, 0), f(0, 3), b(0, 1), f(1, 2), b(1, 2),
                 f(1, 3), b(1, 3), b(0, 2), b(0, 3)],
            "rank 1 of 2 with 2 chunks and 4 micro-batches",
        );
        // p = 4, v = 3, m = 4, rank 2: (4 − 2 − 1)·2 + 2·4 = 10 warm-up forwards of 12; one group
        // of 4 micro-batches through chunks 0, 1, 2 forward, then 2, 1, 0 backward.
        same_order(
            interleaved_order(4, 3, 4, 2),
            vec![f(0, 0), f(0, 1), f(0, 2), f(0, 3), f(1, 0), f(1, 1), f(1, 2), f(1, 3), f(2, 0), f(2, 1), f(2, 2), b(2, 0),
                 f(2, 3), b(2, 1), b(2, 2), b(2, 3), b(1, 0), b(1, 1), b(1, 2), b(1, 3), b(0, 0), b(0, 1), b(0, 2), b(0, 3)],
            "rank 2 of 4 with 3 chunks and 4 micro-batches",
        );
        // One chunk is lesson 13's 1F1B: rank 0 of 2 warms up with p − 0 − 1 = 1 forward.
        same_order(
            interleaved_order(2, 1, 3, 0),
            vec![f(0, 0), f(0, 1), b(0, 0), f(0, 2), b(0, 1), b(0, 2)],
            "one chunk: plain 1F1B (lesson 13), 1 warm-up forward on rank 0 of 2",
        );
        // Fewer micro-batches than stages, one chunk: rank 0 of 4 wants 3 warm-up forwards, has 2.
        same_order(
            interleaved_order(4, 1, 2, 0),
            vec![f(0, 0), f(0, 1), b(0, 0), b(0, 1)],
            "one chunk, 2 micro-batches on rank 0 of 4 (a warm-up of 3 capped at the 2 there are)",
        );
        // A warm-up longer than the work: p 4, v 2, m 4, rank 0 wants 3·2 + 4 = 10 forwards of 8:
        // all 8 forwards, then all 8 backwards.
        let all = interleaved_order(4, 2, 4, 0).expect("p 4, v 2, m 4");
        assert_eq!(all.len(), 16, "every chunk forward and backward once: 2 · 4 · 2");
        assert!(all[..8].iter().all(|s| s.forward) && all[8..].iter().all(|s| !s.forward), "a warm-up of 10 caps at the 8 forwards there are: {}", show(&all));
        assert_eq!(all[4], f(1, 0), "p 4: micro-batches in groups of 4 through chunk 0, then chunk 1");
        // Every order is complete and causal: each (chunk, micro-batch) once each way, a backward
        // after its forward.
        for (p, v, m) in [(2, 3, 4), (4, 2, 8), (3, 4, 6), (4, 1, 6)] {
            for r in 0..p {
                let o = interleaved_order(p, v, m, r).unwrap_or_else(|e| panic!("p {p} v {v} m {m} rank {r}: {e}"));
                assert_eq!(o.len(), 2 * v * m, "p {p} v {v} m {m} rank {r}: {} operations, not 2·v·m", o.len());
                for c in 0..v {
                    for i in 0..m {
                        let fw = o.iter().position(|s| *s == f(c, i));
                        let bw = o.iter().position(|s| *s == b(c, i));
                        assert!(matches!((fw, bw), (Some(x), Some(y)) if x < y), "p {p} v {v} m {m} rank {r}: chunk {c} micro-batch {i} needs a forward, then a backward, each once: {}", show(&o));
                    }
                }
            }
        }
        assert!(interleaved_order(2, 2, 3, 0).is_err(), "3 micro-batches on 2 stages cannot go in groups of 2: an Err");
        assert!(interleaved_order(2, 2, 4, 2).is_err(), "rank 2 of 2 stages: an Err");
        assert!(interleaved_order(2, 0, 4, 0).is_err(), "no chunks: an Err");
        assert!(interleaved_order(2, 2, 0, 0).is_err(), "no micro-batches: an Err");
    }
}
