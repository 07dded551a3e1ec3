//! Mixed precision: the dynamic loss scaler follows PyTorch's GradScaler rules on an injected
//! sequence of overflows, and every rank takes the same skip decision when one rank overflows.

use shardlab::prelude::*;

#[test]
fn the_scale_follows_gradscalers_rules() {
    // PyTorch's defaults: 2^16, ×2 after 2000 clean steps in a row, ×0.5 (and skip) on overflow.
    let mut s = GradScaler::default();
    assert_eq!(s.scale(), 65536.0);
    for _ in 0..1999 {
        assert!(!s.update(false));
    }
    assert_eq!(s.scale(), 65536.0, "1999 clean steps: not yet");
    s.update(false);
    assert_eq!(s.scale(), 131072.0, "the 2000th clean step doubles the scale");
    assert!(s.update(true), "an overflow skips the step");
    assert_eq!(s.scale(), 65536.0, "and halves the scale");
    for _ in 0..1999 {
        s.update(false);
    }
    assert!(s.update(true));
    assert_eq!(s.scale(), 32768.0, "an overflow restarts the count of clean steps");
    assert_eq!(s.skipped, 2);

    // A short interval, by hand: clean steps grow the scale every 3rd, overflows halve it.
    // step:      1  2  3(×2) 4(inf ×½) 5  6  7(×2) 8(inf) 9(inf) 10 11 12(×2)
    let mut s = GradScaler::new(8.0);
    s.growth_interval = 3;
    let infs = [false, false, false, true, false, false, false, true, true, false, false, false];
    let want = [8.0, 8.0, 16.0, 8.0, 8.0, 8.0, 16.0, 8.0, 4.0, 4.0, 4.0, 8.0];
    for (k, (&inf, &w)) in infs.iter().zip(&want).enumerate() {
        s.update(inf);
        assert_eq!(s.scale(), w, "after step {}", k + 1);
    }
    assert_eq!(s.skipped, 3);
}

#[test]
fn one_rank_overflowing_makes_every_rank_skip() {
    for backend in [Backend::Local, Backend::Tcp] {
        let out = spawn_with(SpawnOptions::new(3, backend).launch(Launch::Threads), |pg| {
            let s = GradScaler::new(1024.0);
            let g = Tensor::from_slice(&[2048.0f32, -512.0]);
            let clean = s.unscale_and_check(pg, &[g.shallow_clone()])?;
            let unscaled = Vec::<f32>::try_from(&g)?;
            // Now rank 2 has an inf (fp16 overflow), then a NaN, in one of its gradients.
            let mut flags = Vec::new();
            for bad in [f32::INFINITY, f32::NAN] {
                let h = Tensor::from_slice(&[1.0f32, if pg.rank() == 2 { bad } else { 3.0 }]);
                flags.push(s.unscale_and_check(pg, &[Tensor::from_slice(&[5.0f32]), h])?);
            }
            Ok((clean, unscaled, flags))
        })
        .unwrap();
        for (rank, (clean, unscaled, flags)) in out.iter().enumerate() {
            assert!(!clean, "{backend:?} rank {rank}: finite gradients are no overflow");
            assert_eq!(unscaled, &vec![2.0, -0.5], "{backend:?} rank {rank}: gradients divided by the scale");
            assert_eq!(
                flags,
                &vec![true, true],
                "{backend:?} rank {rank}: rank 2's inf / NaN must make every rank skip"
            );
        }
    }
}
