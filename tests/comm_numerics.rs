//! Numerics of the reductions: data from other ranks can never panic a rank, and every algorithm
//! computes the right numbers in the corner cases — i64 sums that overflow (wrap, like torch and
//! NCCL), f16 averages whose sum overflows but whose mean does not (premultiply), bf16/f16 rounding
//! under naive vs ring accumulation orders, and NaN in Max/Min (propagates, like torch.maximum).
//! World sizes 2–4 on the Local backend, and each check once more over TCP (ranks as threads).

use half::{bf16, f16};
use shardlab::prelude::*;
use std::time::Duration;

/// Tiny frames: every reduction runs over many chunks, at many offsets.
fn opts(n: usize, backend: Backend) -> SpawnOptions {
    let cfg = CommConfig { chunk_bytes: 64, ..CommConfig::default() }.with_timeout(Duration::from_secs(20));
    SpawnOptions::new(n, backend).launch(Launch::Threads).config(cfg)
}

/// Direct runs where the ranks share memory (process ranks on this machine: `Backend::Tcp` here);
/// elsewhere (threads) that slot runs the ring again.
const ALGOS: [Algo; 3] = [Algo::Naive, Algo::Ring, Algo::Direct];

/// Raw bit patterns of a 1-D tensor (f32/f64/bf16/f16/i64), for exact comparisons.
fn bits(t: &Tensor) -> Vec<i64> {
    let as_int = match t.kind() {
        Kind::BFloat16 | Kind::Half => t.view_dtype(Kind::Int16),
        Kind::Float => t.view_dtype(Kind::Int),
        _ => t.view_dtype(Kind::Int64),
    };
    Vec::<i64>::try_from(&as_int.to_kind(Kind::Int64)).unwrap()
}

fn values(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(&t.to_kind(Kind::Double)).unwrap()
}

/// Each rank's result of: all_reduce naive, all_reduce ring, reduce_scatter naive, reduce_scatter
/// ring (rank r's block), as f64 values and as bits; `input(rank, numel)` builds the tensors.
/// reduce_scatter's input must come back bit-for-bit unchanged.
#[derive(serde::Serialize, serde::Deserialize)]
struct Results {
    all_reduce: Vec<(Vec<f64>, Vec<i64>)>,
    reduce_scatter: Vec<(Vec<f64>, Vec<i64>)>,
}

fn run(
    backend: Backend,
    n: usize,
    numel: usize,
    op: ReduceOp,
    input: impl Fn(usize, usize) -> Tensor + Send + Sync,
) -> Vec<Results> {
    spawn_with(opts(n, backend), |pg| {
        let (r, n) = (pg.rank(), pg.world_size());
        let mut res = Results { all_reduce: Vec::new(), reduce_scatter: Vec::new() };
        for algo in ALGOS {
            let algo = if algo == Algo::Direct && pg.data_path() != "shm" { Algo::Ring } else { algo };
            let mut t = input(r, numel);
            pg.all_reduce_with(&mut t, op, algo)?;
            res.all_reduce.push((values(&t), bits(&t)));
            let big = input(r, n * numel);
            let before = bits(&big);
            let mut out = Tensor::zeros([numel as i64], (big.kind(), Device::Cpu));
            pg.reduce_scatter_with(&mut out, &big, op, algo)?;
            anyhow::ensure!(bits(&big) == before, "reduce_scatter {algo:?} {op:?} modified its input");
            res.reduce_scatter.push((values(&out), bits(&out)));
        }
        Ok(res)
    })
    .unwrap_or_else(|e| panic!("{backend:?} world {n} {op:?}: {e}"))
}

/// Every rank of an all_reduce holds the same bits.
fn assert_ranks_agree(res: &[Results], what: &str) {
    for (k, algo) in ALGOS.iter().enumerate() {
        for (r, x) in res.iter().enumerate() {
            assert_eq!(
                x.all_reduce[k].1, res[0].all_reduce[k].1,
                "{what}: all_reduce {algo:?} rank {r} differs from rank 0"
            );
        }
    }
}

// ---------------------------------------------------------------- i64 Sum wraps

/// Values whose sums overflow i64 upwards (i % 4 == 0), downwards (1), both ways in large mixed
/// values (2), and small ones that do not overflow (3).
fn i64_values(r: usize, numel: usize) -> Vec<i64> {
    (0..numel)
        .map(|i| match i % 4 {
            0 => i64::MAX - 3 * r as i64,
            1 => i64::MIN + r as i64,
            2 => (i as i64 * 0x1234_5678_9abc) ^ ((r as i64 + 1) << 61),
            _ => i as i64 - r as i64,
        })
        .collect()
}

fn check_i64_sum_wraps(backend: Backend, n: usize) {
    let numel = 4 * 13 + 1;
    let res = run(backend, n, numel, ReduceOp::Sum, |r, len| Tensor::from_slice(&i64_values(r, len)));
    // Expected: i64::wrapping_add over the ranks (wrapping addition is associative and
    // commutative, so the order the algorithms use does not matter and equality is exact).
    let want = |len: usize| -> Vec<i64> {
        (0..len).map(|i| (0..n).fold(0i64, |a, q| a.wrapping_add(i64_values(q, len)[i]))).collect()
    };
    let overflows =
        (0..numel).filter(|&i| (0..n).try_fold(0i64, |a, q| a.checked_add(i64_values(q, numel)[i])).is_none());
    assert!(overflows.count() >= numel / 4, "the test data must overflow");
    let (full, big) = (want(numel), want(n * numel));
    for (r, x) in res.iter().enumerate() {
        for (k, algo) in ALGOS.iter().enumerate() {
            assert_eq!(x.all_reduce[k].1, full, "{backend:?} n={n} rank {r}: all_reduce {algo:?}");
            assert_eq!(
                x.reduce_scatter[k].1,
                big[r * numel..(r + 1) * numel],
                "{backend:?} n={n} rank {r}: reduce_scatter {algo:?}"
            );
        }
    }
}

#[test]
fn i64_sum_wraps_like_wrapping_add() {
    for n in 2..=4 {
        check_i64_sum_wraps(Backend::Local, n);
    }
}

// ---------------------------------------------------------------- f16 Avg near the top of the range

/// Multiples of 32 in [59904, 60096]: exact in f16 (spacing 32 above 32768), and any two of them
/// sum past f16's largest finite value 65504, so sum-then-divide would give inf.
fn f16_big(r: usize, i: usize) -> f64 {
    60000.0 + 32.0 * ((i * 5 + r * 3) % 7) as f64 - 96.0
}

fn check_f16_avg_near_max(backend: Backend, n: usize) {
    let numel = 37;
    let input = |r: usize, len: usize| {
        Tensor::from_slice(&(0..len).map(|i| f16_big(r, i)).collect::<Vec<_>>()).to_kind(Kind::Half)
    };
    let res = run(backend, n, numel, ReduceOp::Avg, input);
    assert_ranks_agree(&res, &format!("{backend:?} n={n} f16 Avg"));
    // Allowed distance in f16 ulps from the f64 mean rounded to f16 (the spacing is 32 there):
    // * n = 2: x/2 is exact and one addition rounds the exact mean once: 0 ulps.
    // * n = 4: x/4 is exact (multiples of 8 in [8192, 16384), spacing 8); the three hops round
    //   partial sums near 30000 (spacing 16), 45000 and 60000 (spacing 32): at most 8+16+16 = 40
    //   from the mean, and the only multiples of 32 that close are the rounded mean and its two
    //   neighbours: 1 ulp.
    // * n = 3: x/3 rounds (≤ 8 each, spacing 16 near 20000) and two hops round (≤ 16 each): at most
    //   56 from the mean: 2 ulps.
    let ulps = match n {
        2 => 0,
        3 => 2,
        _ => 1,
    };
    let want = |len: usize| -> Vec<i64> {
        (0..len)
            .map(|i| f16::from_f64((0..n).map(|q| f16_big(q, i)).sum::<f64>() / n as f64).to_bits() as i64)
            .collect()
    };
    let (full, big) = (want(numel), want(n * numel));
    for (r, x) in res.iter().enumerate() {
        for (k, algo) in ALGOS.iter().enumerate() {
            for (what, got, want) in [
                ("all_reduce", &x.all_reduce[k], &full[..]),
                ("reduce_scatter", &x.reduce_scatter[k], &big[r * numel..(r + 1) * numel]),
            ] {
                for (i, (&g, &w)) in got.1.iter().zip(want).enumerate() {
                    assert!(
                        got.0[i].is_finite() && (g - w).abs() <= ulps,
                        "{backend:?} n={n} rank {r}: {what} {algo:?} f16 Avg [{i}] = {} (bits {g:#x}), want {} (bits {w:#x}) within {ulps} ulp",
                        got.0[i],
                        f16::from_bits(w as u16)
                    );
                }
            }
        }
    }
}

#[test]
fn f16_avg_does_not_overflow_when_the_mean_fits() {
    for n in 2..=4 {
        check_f16_avg_near_max(Backend::Local, n);
    }
}

// ---------------------------------------------------------------- bf16/f16 rounding, naive vs ring

/// Values in [1, 4) on a 101-step grid, rounded to the half type when the tensor is built: the
/// inputs are exact, but their sums and means mostly are not (they need more bits).
fn grid(r: usize, i: usize) -> f64 {
    1.0 + ((i * 37 + r * 11) % 101) as f64 * (3.0 / 101.0)
}

fn check_half_rounding(backend: Backend, n: usize, kind: Kind, op: ReduceOp) {
    let numel = 101;
    let input =
        move |r: usize, len: usize| Tensor::from_slice(&(0..len).map(|i| grid(r, i)).collect::<Vec<_>>()).to_kind(kind);
    let res = run(backend, n, numel, op, input);
    let what = format!("{backend:?} n={n} {kind:?} {op:?}");
    assert_ranks_agree(&res, &what);
    // Reference: the f64 sum (or mean) of the actual half-precision inputs — exact in f64.
    let reference = |len: usize| -> Vec<f64> {
        let ins: Vec<Vec<f64>> = (0..n).map(|q| values(&input(q, len))).collect();
        let d = if op == ReduceOp::Avg { n as f64 } else { 1.0 };
        (0..len).map(|i| ins.iter().map(|v| v[i]).sum::<f64>() / d).collect()
    };
    let (full, big) = (reference(numel), reference(n * numel));
    let round = |v: f64| if kind == Kind::BFloat16 { bf16::from_f64(v).to_f64() } else { f16::from_f64(v).to_f64() };
    assert!(full.iter().filter(|&&v| round(v) != v).count() > numel / 4, "{what}: results must need rounding");
    // Tolerance: u = 2^-8 (bf16) or 2^-11 (f16) is the relative error of one round-to-nearest.
    // Sum rounds each of the n−1 partial sums, all positive and at most the total: ≤ (n−1)·u·ref.
    // Avg also rounds each premultiplied x_i/n (≤ u·x_i/n, u·mean in total): ≤ n·u·ref.
    // 1% slack covers the (1+u)^k growth of the partial sums.
    let u = if kind == Kind::BFloat16 { 2f64.powi(-8) } else { 2f64.powi(-11) };
    let hops = (if op == ReduceOp::Avg { n } else { n - 1 }) as f64;
    let tol = |want: f64| 1.01 * hops * u * want;
    for (r, x) in res.iter().enumerate() {
        for (k, algo) in ALGOS.iter().enumerate() {
            for (name, got, want) in [
                ("all_reduce", &x.all_reduce[k].0, &full[..]),
                ("reduce_scatter", &x.reduce_scatter[k].0, &big[r * numel..(r + 1) * numel]),
            ] {
                for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                    assert!(
                        (g - w).abs() <= tol(w),
                        "{what} rank {r}: {name} {algo:?} [{i}] = {g}, want {w} ± {}",
                        tol(w)
                    );
                }
            }
        }
        // Naive and ring add in different orders, so with rounding after every hop they agree only
        // to within the tolerance above (both are checked against it) — except on 2 ranks, where
        // each element is one (commutative) addition of the same two values: bit-identical.
        if n == 2 {
            assert_eq!(x.all_reduce[0].1, x.all_reduce[1].1, "{what} rank {r}: all_reduce naive vs ring");
            assert_eq!(x.reduce_scatter[0].1, x.reduce_scatter[1].1, "{what} rank {r}: reduce_scatter naive vs ring");
        }
    }
}

#[test]
fn half_sum_and_avg_naive_and_ring_within_rounding_bound() {
    for n in 2..=4 {
        for kind in [Kind::BFloat16, Kind::Half] {
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                check_half_rounding(Backend::Local, n, kind, op);
            }
        }
    }
}

// ---------------------------------------------------------------- NaN in Max/Min

/// Which rank holds a NaN at element i: rank 0 (i % 4 == 0), the last rank (1), rank 1 (2), none (3).
/// Rank 0 is where the naive algorithms accumulate, and each ring segment starts at a different
/// rank, so these cover NaN arriving first, last and in the middle of every accumulation order.
fn nan_rank(i: usize, n: usize) -> Option<usize> {
    match i % 4 {
        0 => Some(0),
        1 => Some(n - 1),
        2 => Some(1),
        _ => None,
    }
}

fn nan_input(r: usize, i: usize, n: usize) -> f64 {
    if nan_rank(i, n) == Some(r) {
        f64::NAN
    } else {
        ((i * 7 + r * 3) % 11) as f64 - 5.0
    }
}

fn check_nan_max_min(backend: Backend, n: usize, kind: Kind, op: ReduceOp) {
    let numel = 4 * 9 + 3;
    let input = move |r: usize, len: usize| {
        Tensor::from_slice(&(0..len).map(|i| nan_input(r, i, n)).collect::<Vec<_>>()).to_kind(kind)
    };
    let res = run(backend, n, numel, op, input);
    let what = format!("{backend:?} n={n} {kind:?} {op:?}");
    // Expected: NaN wherever some rank has NaN (torch.maximum/minimum), else the max/min of the
    // small integers, exact in every dtype.
    let want = |i: usize| -> f64 {
        let vals = (0..n).map(|q| nan_input(q, i, n));
        match (nan_rank(i, n), op) {
            (Some(_), _) => f64::NAN,
            (None, ReduceOp::Max) => vals.fold(f64::NEG_INFINITY, f64::max),
            (None, _) => vals.fold(f64::INFINITY, f64::min),
        }
    };
    for (r, x) in res.iter().enumerate() {
        for (k, algo) in ALGOS.iter().enumerate() {
            for (name, got, off) in
                [("all_reduce", &x.all_reduce[k].0, 0), ("reduce_scatter", &x.reduce_scatter[k].0, r * numel)]
            {
                for (i, &g) in got.iter().enumerate() {
                    let w = want(off + i);
                    assert!(
                        g.is_nan() == w.is_nan() && (w.is_nan() || g == w),
                        "{what} rank {r}: {name} {algo:?} [{i}] = {g}, want {w} (NaN on rank {:?})",
                        nan_rank(off + i, n)
                    );
                }
            }
        }
    }
}

#[test]
fn max_min_propagate_nan_from_any_rank() {
    for n in 2..=4 {
        for kind in [Kind::Float, Kind::Double, Kind::BFloat16, Kind::Half] {
            for op in [ReduceOp::Max, ReduceOp::Min] {
                check_nan_max_min(Backend::Local, n, kind, op);
            }
        }
    }
}

// ---------------------------------------------------------------- reduce_scatter keeps its input

/// Half Avg premultiplies each contribution by 1/n; reduce_scatter must do that in scratch space.
/// (`run` already checks the input bits on every rank; here with both half types and data near
/// f16's limit, and the outputs must be finite.)
fn check_reduce_scatter_keeps_input(backend: Backend, n: usize) {
    for kind in [Kind::BFloat16, Kind::Half] {
        let input = move |r: usize, len: usize| {
            Tensor::from_slice(&(0..len).map(|i| f16_big(r, i)).collect::<Vec<_>>()).to_kind(kind)
        };
        for x in run(backend, n, 29, ReduceOp::Avg, input) {
            for (out, _) in &x.reduce_scatter {
                assert!(out.iter().all(|v| v.is_finite()), "{backend:?} n={n} {kind:?}: {out:?}");
            }
        }
    }
}

#[test]
fn reduce_scatter_half_avg_leaves_input_untouched() {
    for n in 2..=4 {
        check_reduce_scatter_keeps_input(Backend::Local, n);
    }
}

// ---------------------------------------------------------------- the same over TCP

#[test]
fn numerics_over_tcp() {
    check_i64_sum_wraps(Backend::Tcp, 3);
    check_f16_avg_near_max(Backend::Tcp, 4);
    check_half_rounding(Backend::Tcp, 3, Kind::BFloat16, ReduceOp::Avg);
    check_nan_max_min(Backend::Tcp, 3, Kind::Float, ReduceOp::Max);
    check_nan_max_min(Backend::Tcp, 4, Kind::BFloat16, ReduceOp::Min);
    check_reduce_scatter_keeps_input(Backend::Tcp, 3);
}
