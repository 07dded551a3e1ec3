//! Every collective and algorithm against a serial reference, on both backends, world sizes 1–4,
//! sizes that do not divide by the world size (and 0 and 1 elements), all dtypes.
//! Reference: the same reduction computed in one process with libtorch (`stack(…).sum(0)` etc.).

use shardlab::prelude::*;
use std::time::Duration;

/// Rank r's deterministic input: small integers, so sums are exact in every dtype (bf16 included).
fn input(rank: usize, numel: usize, kind: Kind) -> Tensor {
    let v: Vec<i64> = (0..numel as i64).map(|i| (i * 7 + rank as i64 * 13) % 17 - 8).collect();
    Tensor::from_slice(&v).to_kind(kind)
}

fn reference(n: usize, numel: usize, kind: Kind, op: ReduceOp) -> Tensor {
    let all = Tensor::stack(&(0..n).map(|r| input(r, numel, Kind::Double)).collect::<Vec<_>>(), 0);
    let red = match op {
        ReduceOp::Sum => all.sum_dim_intlist(0, false, Kind::Double),
        ReduceOp::Avg => all.sum_dim_intlist(0, false, Kind::Double) / n as f64,
        ReduceOp::Max => all.amax(0, false),
        ReduceOp::Min => all.amin(0, false),
    };
    red.to_kind(kind)
}

/// `same`, except that Avg on bf16/f16 may differ from the rounded exact mean: those dtypes scale
/// each contribution by 1/n before summing (so the sum cannot overflow), and x/n rounds when n is
/// not a power of two. With unit roundoff u (2^-8 bf16, 2^-11 f16) and |x| ≤ M = 8: each x/n rounds
/// by ≤ u·M/n and each of the n−1 hops by ≤ u·M (no partial sum exceeds M), so ≤ n·u·M from the
/// exact mean, plus ≤ u·M for rounding the reference itself to the dtype.
fn reduced_same(got: &Tensor, want: &Tensor, n: usize, op: ReduceOp) -> bool {
    let u = match got.kind() {
        Kind::BFloat16 => 2f64.powi(-8),
        Kind::Half => 2f64.powi(-11),
        _ => return same(got, want),
    };
    if op != ReduceOp::Avg {
        return same(got, want);
    }
    let tol = (n + 1) as f64 * u * 8.0;
    got.size() == want.size()
        && got.kind() == want.kind()
        && got.to_kind(Kind::Double).allclose(&want.to_kind(Kind::Double), 0.0, tol, false)
}

fn same(a: &Tensor, b: &Tensor) -> bool {
    a.size() == b.size()
        && a.kind() == b.kind()
        && a.to_kind(Kind::Double).allclose(&b.to_kind(Kind::Double), 1e-6, 1e-6, false)
}

/// Small frames so even modest tensors travel as many pipelined chunks.
fn cfg() -> CommConfig {
    CommConfig { chunk_bytes: 4096, ..CommConfig::default() }.with_timeout(Duration::from_secs(20))
}

fn opts(n: usize, backend: Backend) -> SpawnOptions {
    SpawnOptions::new(n, backend).launch(Launch::Threads).config(cfg())
}

/// Process ranks on one machine: over TCP frames only, or sharing memory (frames through
/// shared-memory rings for naive/ring, and the direct algorithms, chunked through 4 KiB buffers).
fn opts_path(n: usize, path: DataPath) -> SpawnOptions {
    let config = CommConfig { transport: path, shm_exchange_bytes: 4096, ..cfg() };
    SpawnOptions::new(n, Backend::Tcp).launch(Launch::Threads).config(config)
}

const SIZES: [usize; 5] = [0, 1, 5, 1003, 20_011];
const KINDS: [Kind; 5] = [Kind::Float, Kind::Double, Kind::BFloat16, Kind::Half, Kind::Int64];

fn check_all(backend: Backend, path: Option<DataPath>) {
    for n in 1..=4 {
        let algos: &[Algo] = if path == Some(DataPath::Shm) && n > 1 {
            &[Algo::Naive, Algo::Ring, Algo::Direct]
        } else {
            &[Algo::Naive, Algo::Ring]
        };
        let o = path.map_or_else(|| opts(n, backend), |p| opts_path(n, p));
        let failures = spawn_with(o, move |pg| {
            let (r, n) = (pg.rank(), pg.world_size());
            let mut bad = Vec::new();
            let want_path = match path {
                None => "local",
                Some(DataPath::Shm) if n > 1 => "shm",
                Some(_) => "tcp",
            };
            anyhow::ensure!(pg.data_path() == want_path, "data path {} instead of {want_path}", pg.data_path());
            for &kind in &KINDS {
                for &numel in &SIZES {
                    let ops: &[ReduceOp] = if kind == Kind::Int64 {
                        &[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min]
                    } else {
                        &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min]
                    };
                    for &algo in algos {
                        for &op in ops {
                            let mut t = input(r, numel, kind);
                            pg.all_reduce_with(&mut t, op, algo)?;
                            if !reduced_same(&t, &reference(n, numel, kind, op), n, op) {
                                bad.push(format!("all_reduce {algo:?} {op:?} {kind:?} numel={numel}"));
                            }
                        }
                        // all_gather: rank r contributes input(r); out = cat of all.
                        let x = input(r, numel, kind);
                        let mut out = Tensor::full([(numel * n) as i64], -99, (kind, Device::Cpu));
                        pg.all_gather_with(&mut out, &x, algo)?;
                        let want = Tensor::cat(&(0..n).map(|q| input(q, numel, kind)).collect::<Vec<_>>(), 0);
                        if !same(&out, &want) {
                            bad.push(format!("all_gather {algo:?} {kind:?} numel={numel}"));
                        }
                        // reduce_scatter: input has n·numel elements; rank r gets block r of the sum.
                        for &op in ops {
                            let big = input(r, numel * n, kind);
                            let mut out = Tensor::full([numel as i64], -99, (kind, Device::Cpu));
                            pg.reduce_scatter_with(&mut out, &big, op, algo)?;
                            let full = reference(n, numel * n, kind, op);
                            let want = full.narrow(0, (r * numel) as i64, numel as i64);
                            if !reduced_same(&out, &want, n, op) {
                                bad.push(format!("reduce_scatter {algo:?} {op:?} {kind:?} numel={numel}"));
                            }
                            if !same(&big, &input(r, numel * n, kind)) {
                                bad.push(format!("reduce_scatter {algo:?} modified its input"));
                            }
                        }
                    }
                    for algo in [Algo::Naive, Algo::Tree].iter().chain(algos.iter().skip(1)).copied() {
                        for root in 0..n {
                            let mut t = if r == root {
                                input(root, numel, kind)
                            } else {
                                Tensor::zeros([numel as i64], (kind, Device::Cpu))
                            };
                            pg.broadcast_with(&mut t, root, algo)?;
                            if !same(&t, &input(root, numel, kind)) {
                                bad.push(format!("broadcast {algo:?} root={root} {kind:?} numel={numel}"));
                            }
                        }
                    }
                }
            }
            pg.barrier()?;
            Ok(bad)
        })
        .unwrap_or_else(|e| panic!("{backend:?} world {n}: {e}"));
        for (r, bad) in failures.iter().enumerate() {
            assert!(bad.is_empty(), "{backend:?} world {n} rank {r} wrong results:\n{}", bad.join("\n"));
        }
    }
}

#[test]
fn collectives_match_serial_reference_local() {
    check_all(Backend::Local, None);
}

#[test]
fn collectives_match_serial_reference_tcp() {
    check_all(Backend::Tcp, Some(DataPath::Tcp));
}

#[test]
fn collectives_match_serial_reference_shared_memory() {
    check_all(Backend::Tcp, Some(DataPath::Shm));
}

#[test]
fn send_recv_ring_and_async_ops() {
    for backend in [Backend::Local, Backend::Tcp] {
        for n in 2..=4 {
            let res = spawn_with(opts(n, backend), |pg| {
                let (r, n) = (pg.rank(), pg.world_size());
                // Pass a token around the ring: rank r sends r+1 values to r+1.
                let mut got = Tensor::zeros([10_000], (Kind::Float, Device::Cpu));
                let mine = Tensor::full([10_000], r as f64, (Kind::Float, Device::Cpu));
                if r % 2 == 0 {
                    pg.send(&mine, (r + 1) % n)?;
                    pg.recv(&mut got, (r + n - 1) % n)?;
                } else {
                    pg.recv(&mut got, (r + n - 1) % n)?;
                    pg.send(&mine, (r + 1) % n)?;
                }
                let from_prev = got.double_value(&[9_999]) as usize == (r + n - 1) % n;
                // Several async all-reduces in flight, then a blocking one: order is kept.
                let ts: Vec<Tensor> =
                    (0..4).map(|k| Tensor::full([777], (r * 10 + k) as f64, (Kind::Float, Device::Cpu))).collect();
                let works: Vec<Work<Tensor>> =
                    ts.into_iter().map(|t| pg.all_reduce_async(t, ReduceOp::Sum)).collect::<CommResult<_>>()?;
                let mut last = Tensor::ones([3], (Kind::Float, Device::Cpu));
                pg.all_reduce(&mut last, ReduceOp::Sum)?;
                let ts: Vec<Tensor> = works.into_iter().map(|w| w.wait()).collect::<CommResult<_>>()?;
                let sums: Vec<f64> = ts.iter().map(|t| t.double_value(&[776])).collect();
                Ok((from_prev, sums, last.double_value(&[0])))
            })
            .unwrap();
            let tri = (0..n).map(|q| q * 10).sum::<usize>() as f64;
            for (from_prev, sums, last) in res {
                assert!(from_prev, "{backend:?} n={n}: recv got the wrong sender's data");
                assert_eq!(
                    sums,
                    (0..4).map(|k| tri + (k * n) as f64).collect::<Vec<_>>(),
                    "{backend:?} n={n}: async all_reduce"
                );
                assert_eq!(last, n as f64);
            }
        }
    }
}

#[test]
fn stats_count_ring_traffic() {
    // Ring all_reduce moves 2(n−1)/n of the buffer per rank; naive moves (n−1)·B through rank 0.
    let n = 4;
    let bytes = 4 * 100_000u64;
    let res = spawn_with(opts(n, Backend::Local), move |pg| {
        let mut t = Tensor::ones([100_000], (Kind::Float, Device::Cpu));
        let s0 = pg.stats();
        pg.all_reduce_with(&mut t, ReduceOp::Sum, Algo::Ring)?;
        let s1 = pg.stats();
        pg.all_reduce_with(&mut t, ReduceOp::Sum, Algo::Naive)?;
        let s2 = pg.stats();
        anyhow::ensure!(
            s2.collectives - s0.collectives == 2 && s2.p2p == s0.p2p,
            "two collectives, no p2p: {s0:?} -> {s2:?}"
        );
        Ok((s1.bytes_sent - s0.bytes_sent, s2.bytes_sent - s1.bytes_sent))
    })
    .unwrap();
    for (r, (ring, naive)) in res.into_iter().enumerate() {
        assert_eq!(ring, 2 * (n as u64 - 1) * bytes / n as u64, "rank {r} ring bytes");
        assert_eq!(naive, if r == 0 { (n as u64 - 1) * bytes } else { bytes }, "rank {r} naive bytes");
    }
}

#[test]
fn binomial_tree_is_a_spanning_tree() {
    for n in 1..=33 {
        let mut seen = vec![0; n];
        for v in 0..n {
            let (parent, children) = shardlab::comm::binomial_tree(v, n);
            assert_eq!(parent.is_none(), v == 0);
            for c in children {
                assert!(c < n && c > v);
                assert_eq!(shardlab::comm::binomial_tree(c, n).0, Some(v), "n={n}: child {c} of {v} disagrees");
                seen[c] += 1;
            }
        }
        assert!(seen.iter().skip(1).all(|&s| s == 1), "n={n}: every non-root has one parent");
        let depth = |mut v: usize| {
            let mut d = 0;
            while let Some(p) = shardlab::comm::binomial_tree(v, n).0 {
                v = p;
                d += 1;
            }
            d
        };
        let max = (0..n).map(depth).max().unwrap();
        assert!(max <= (n as f64).log2().ceil() as usize, "n={n}: depth {max}");
    }
}
