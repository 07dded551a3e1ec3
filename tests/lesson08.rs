//! Grader for lesson 08 (mixed precision).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/08_mixed_precision/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 08` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong.

#[path = "../lessons/08_mixed_precision/exercise.rs"]
mod exercise_code;
#[path = "../solutions/08_mixed_precision.rs"]
mod solution_code;

use shardlab::prelude::*;

shardlab::graders! {
    lesson: "08", exercise_file: "lessons/08_mixed_precision/exercise.rs";

    /// shardlab's own copies of what each exercise builds (exercise K: `TWINS[K - 1]`): an exercise
    /// that names one is refused ("write it yourself").
    const TWINS: &[&[&str]] = &[&["BFloat16", "half::bf16", "half::f16"], &["Sgd", "shardlab::optim"], &["GradScaler"], &["GradScaler", "optim::NonFinite", "optim::optimizer_step", ".unscale"]];

    /// libtorch's own f32 → bf16 conversion (round to nearest, ties to even), as raw bits.
    fn libtorch_bf16_bits(xs: &[f32]) -> Vec<u16> {
        let t = Tensor::from_slice(xs).to_kind(Kind::BFloat16).view_dtype(Kind::Int16);
        Vec::<i16>::try_from(&t).unwrap().into_iter().map(|b| b as u16).collect()
    }

    fn is_bf16_nan(b: u16) -> bool {
        b & 0x7F80 == 0x7F80 && b & 0x007F != 0
    }

    #[test]
    fn ex1_rounds_to_nearest_even_like_libtorch() {
        shardlab::grading::refuse_twins(GRADER, 1, TWINS[0]);
        let one = 1.0f32.to_bits();
        let mut xs = vec![
            0.0, -0.0, 1.0, -1.0, 0.1, 1.0 / 3.0, 3.14159, 65504.0, 1e-30, -2.5e-40, 1e-45,
            f32::from_bits(one + 0x8000),          // 1 + 2⁻⁸: halfway between 1 and 1 + 2⁻⁷ → the even one, 1
            f32::from_bits(one + 0x18000),         // 1 + 3·2⁻⁸: halfway, the even neighbour is above
            f32::from_bits(one + 0x8001),          // a hair above halfway → up
            f32::from_bits(one + 0x7FFF),          // a hair below halfway → down
            f32::from_bits(0x3FFF_FFFF),           // just below 2: rounds up into the next exponent
            f32::from_bits(0x7F7F_0000),           // bf16's largest finite, exactly
            f32::from_bits(0x7F7F_8000),           // halfway to inf: rounds to inf (ties to even)
            f32::MAX, -f32::MAX, f32::INFINITY, f32::NEG_INFINITY,
            f32::MIN_POSITIVE, f32::from_bits(0x0000_8000), f32::from_bits(0x0001_7FFF),
        ];
        let mut rng = shardlab::rng::Rng::new(8);
        for e in -40..40 {
            xs.extend(rng.normal_vec(25, 1.0).into_iter().map(|v| v * 2f32.powi(e)));
        }
        let want = libtorch_bf16_bits(&xs);
        for (&x, &w) in xs.iter().zip(&want) {
            let got = to_bf16_bits(x);
            let truncated = (x.to_bits() >> 16) as u16;
            assert!(
                got == w,
                "to_bf16_bits({x:e}) (f32 bits {:#010x}) = {got:#06x}, libtorch rounds it to {w:#06x}{}",
                x.to_bits(),
                if got == truncated && got != w {
                    " — that is the truncation: round to the nearest instead (add half of the dropped part)"
                } else if w & 0x7FFF == 0x7F80 {
                    " (past bf16's largest finite, or infinite: inf)"
                } else {
                    " (ties go to the neighbour whose last kept bit is 0)"
                }
            );
        }
        for nan in [f32::NAN, -f32::NAN, f32::from_bits(0x7F80_0001), f32::from_bits(0xFFC0_1234)] {
            let got = to_bf16_bits(nan);
            assert!(is_bf16_nan(got), "a NaN (f32 bits {:#010x}) must stay a NaN, got {got:#06x} (an infinity or a number)", nan.to_bits());
        }
    }

    #[test]
    fn ex2_small_updates_accumulate_in_the_master() {
        shardlab::grading::refuse_twins(GRADER, 2, TWINS[1]);
        // 1000 SGD steps of lr·grad = 1e-4 each: bf16 has 8 significant bits (spacing 2⁻⁷ ≈ 0.0078
        // at 1.0), so each update alone rounds away in bf16 — the f32 master keeps them all.
        // Expected: the f64 sum of the updates (f32 rounding adds at most 1000 × 1.2e-7 below 2).
        let init = [1.0f32, 0.5, -2.0, 1.5, 0.0];
        let g = [1.0f32, -1.0, 0.5, 4.0, -2.0];
        let lr = 1e-4;
        let mut master = Tensor::from_slice(&init).set_requires_grad(true); // a parameter the optimizer owns
        let mut working = Tensor::from_slice(&init).to_kind(Kind::BFloat16);
        let ptr = working.data_ptr();
        let grad = Tensor::from_slice(&g).to_kind(Kind::BFloat16);
        for _ in 0..1000 {
            master_weight_step(&mut master, &mut working, &grad, lr);
        }
        shardlab::grading::assert_layout(&master, &[5], Kind::Float, "the master after 1000 steps (it stays f32)");
        shardlab::grading::assert_layout(&working, &[5], Kind::BFloat16, "the working copy after 1000 steps (it stays bf16)");
        assert_eq!(working.data_ptr(), ptr, "refresh the working copy in place (the model's parameters are views of it)");
        let got = Vec::<f32>::try_from(&master.detach()).unwrap();
        for i in 0..init.len() {
            let want = init[i] as f64 - 1000.0 * lr * g[i] as f64;
            assert!(
                (got[i] as f64 - want).abs() < 2e-4,
                "element {i}: the master is {} after 1000 steps of {}, expected {want}{}",
                got[i],
                -lr * g[i] as f64,
                if got[i] == init[i] { " — no update survived: were they applied to the bf16 copy and rounded away?" } else { "" }
            );
        }
        let w = Vec::<f32>::try_from(&working.to_kind(Kind::Float)).unwrap();
        let m16 = Vec::<f32>::try_from(&master.detach().to_kind(Kind::BFloat16).to_kind(Kind::Float)).unwrap();
        assert_eq!(w, m16, "the working copy must be the master rounded to bf16 after the last step");
    }

    fn state(scale: f64, interval: u64) -> ScaleState {
        ScaleState { scale, growth_tracker: 0, growth_interval: interval, growth_factor: 2.0, backoff_factor: 0.5 }
    }

    #[test]
    fn ex3_the_scale_follows_gradscalers_rules() {
        shardlab::grading::refuse_twins(GRADER, 3, TWINS[2]);
        // By hand from PyTorch's GradScaler rules, growth_interval 3:
        // step:   1  2  3(×2)  4(inf ×½)  5  6(inf ×½)  7  8  9(×2)  10 11(inf)  12(inf)  13 14 15(×2)
        let mut s = state(8.0, 3);
        let infs = [false, false, false, true, false, true, false, false, false, false, true, true, false, false, false];
        let want = [8.0, 8.0, 16.0, 8.0, 8.0, 4.0, 4.0, 4.0, 8.0, 8.0, 4.0, 2.0, 2.0, 2.0, 4.0];
        for (k, (&inf, &w)) in infs.iter().zip(&want).enumerate() {
            let skip = update_scale(&mut s, inf);
            assert_eq!(skip, inf, "step {}: {} must {}be skipped", k + 1, if inf { "an overflow" } else { "a clean step" }, if inf { "" } else { "not " });
            assert_eq!(
                s.scale, w,
                "after step {} ({}), the scale is {}, expected {w} (overflow: ×backoff and the count of clean \
                 steps restarts; growth after growth_interval clean steps *in a row*)",
                k + 1,
                if inf { "overflow" } else { "clean" },
                s.scale
            );
        }
        // PyTorch's defaults: the 2000th clean step in a row doubles 2¹⁶.
        let mut s = state(65536.0, 2000);
        for k in 1..=1999 {
            update_scale(&mut s, false);
            assert_eq!(s.scale, 65536.0, "clean step {k} of 2000: no growth yet");
        }
        update_scale(&mut s, false);
        assert_eq!(s.scale, 131072.0, "the 2000th clean step doubles the scale");
        for _ in 0..2000 {
            update_scale(&mut s, false);
        }
        assert_eq!(s.scale, 262144.0, "and the next 2000 double it again (the count restarts after growing)");
    }

    #[test]
    fn ex4_every_rank_skips_together() {
        shardlab::grading::refuse_twins(GRADER, 4, TWINS[3]);
        for backend in [Backend::Local, Backend::Tcp] {
            let out = spawn_with(SpawnOptions::new(3, backend).launch(Launch::Threads), |pg| {
                let g = Tensor::from_slice(&[2048.0f32, -512.0]);
                let clean = unscale_and_check(pg, &[g.shallow_clone()], 1024.0)?;
                let unscaled = Vec::<f32>::try_from(&g)?;
                let mut flags = Vec::new();
                // Rank 2 overflows (inf), then gets a NaN, in its second gradient; rank 1 holds no
                // gradient at all in the last round (a ZeRO rank whose shard is empty).
                for bad in [f32::INFINITY, f32::NAN] {
                    let h = Tensor::from_slice(&[1.0f32, if pg.rank() == 2 { bad } else { 3.0 }]);
                    flags.push(unscale_and_check(pg, &[Tensor::from_slice(&[5.0f32]), h], 8.0)?);
                }
                let none: Vec<Tensor> = if pg.rank() == 1 { vec![] } else { vec![Tensor::from_slice(&[1.0f32])] };
                flags.push(unscale_and_check(pg, &none, 2.0)?);
                Ok((clean, unscaled, flags))
            })
            .unwrap();
            for (rank, (clean, unscaled, flags)) in out.iter().enumerate() {
                assert!(!clean, "{backend:?} rank {rank}: finite gradients are no overflow");
                assert_eq!(unscaled, &vec![2.0, -0.5], "{backend:?} rank {rank}: the gradients divided by the scale 1024, in place");
                assert_eq!(
                    flags[..2],
                    [true, true],
                    "{backend:?} rank {rank}: rank 2's inf, then its NaN, must make every rank skip ({})",
                    if rank == 2 { "look for NaN as well as inf" } else { "agree with one collective: the flag must reach every rank" }
                );
                assert!(!flags[2], "{backend:?} rank {rank}: no rank overflowed in the last round");
            }
        }
    }
}
