//! What measured numbers are read against: the α-β (latency-bandwidth) model's prediction for
//! an operation, and this machine's ceilings — one loopback TCP stream, and memcpy.

use crate::comm::{Algo, OpKind};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// The α-β (latency-bandwidth) model of an operation: predicted seconds for `bytes` on `n` ranks,
/// with α seconds per message and β seconds per byte on each link.
///
/// * all_reduce naive (reduce to rank 0, send back): 2(n−1)·(α + B·β) — rank 0's link carries it all
/// * all_reduce ring: 2(n−1)·α + 2·(n−1)/n·B·β
/// * all_gather / reduce_scatter ring: (n−1)·α + (n−1)/n·B·β; naive (through rank 0, B the full
///   gathered size / full input): 2(n−1)·α + (n−1)·(1 + 1/n)·B·β
/// * broadcast naive: (n−1)·(α + B·β); tree: ⌈log2 n⌉·(α + B·β); chain: (n−1)·α + B·β
pub fn model_time(op: OpKind, algo: Algo, n: usize, bytes: f64, alpha: f64, beta: f64) -> f64 {
    let (nf, b) = (n as f64, bytes);
    if n <= 1 {
        return 0.0;
    }
    match (op, algo) {
        (OpKind::AllReduce, Algo::Naive) => 2.0 * (nf - 1.0) * (alpha + b * beta),
        (OpKind::AllReduce, _) => 2.0 * (nf - 1.0) * alpha + 2.0 * (nf - 1.0) / nf * b * beta,
        (OpKind::AllGather | OpKind::ReduceScatter, Algo::Naive) => {
            2.0 * (nf - 1.0) * alpha + (nf - 1.0) * (1.0 + 1.0 / nf) * b * beta
        }
        (OpKind::AllGather | OpKind::ReduceScatter, _) => (nf - 1.0) * alpha + (nf - 1.0) / nf * b * beta,
        (OpKind::Broadcast, Algo::Naive) => (nf - 1.0) * (alpha + b * beta),
        (OpKind::Broadcast, Algo::Tree) => nf.log2().ceil() * (alpha + b * beta),
        (OpKind::Broadcast, _) => (nf - 1.0) * alpha + b * beta,
        _ => f64::NAN,
    }
}

/// Throughput of one loopback TCP stream (bytes/s) with the socket settings the tcp backend uses:
/// the ceiling for what one link of the tcp backend can carry on this machine.
pub fn loopback_tcp_throughput(total: usize) -> std::io::Result<f64> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<usize> {
        let (mut s, _) = l.accept()?;
        crate::comm::tcp::tune(&s);
        let mut buf = vec![0u8; 4 << 20];
        let mut got = 0;
        loop {
            let k = s.read(&mut buf)?;
            if k == 0 {
                return Ok(got);
            }
            got += k;
        }
    });
    let mut s = std::net::TcpStream::connect(addr)?;
    crate::comm::tcp::tune(&s);
    let buf = vec![1u8; 1 << 20];
    let t = Instant::now();
    let mut sent = 0;
    while sent < total {
        s.write_all(&buf)?;
        sent += buf.len();
    }
    s.shutdown(std::net::Shutdown::Write)?;
    let got = reader.join().unwrap()?;
    Ok(got as f64 / t.elapsed().as_secs_f64())
}

/// memcpy bandwidth (bytes copied per second) on a buffer too large for the caches.
pub fn memcpy_throughput(bytes: usize, reps: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let t = Instant::now();
    for _ in 0..reps {
        dst.copy_from_slice(std::hint::black_box(&src));
    }
    std::hint::black_box(&dst);
    (bytes * reps) as f64 / t.elapsed().as_secs_f64().max(Duration::from_nanos(1).as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_beats_naive_on_bandwidth_not_latency() {
        let (a, b) = (50e-6, 1.0 / 2e9);
        // 4 ranks, 64 MiB: ring moves 1.5·B per rank, naive 6·B through rank 0.
        let big = (64u64 << 20) as f64;
        let ring = model_time(OpKind::AllReduce, Algo::Ring, 4, big, a, b);
        let naive = model_time(OpKind::AllReduce, Algo::Naive, 4, big, a, b);
        assert!((naive / ring - 4.0).abs() < 0.05, "{naive} vs {ring}");
        // 4 bytes: both are 2(n−1) messages.
        let (r, nv) = (
            model_time(OpKind::AllReduce, Algo::Ring, 4, 4.0, a, b),
            model_time(OpKind::AllReduce, Algo::Naive, 4, 4.0, a, b),
        );
        assert!((r / nv - 1.0).abs() < 0.01);
        assert_eq!(model_time(OpKind::Broadcast, Algo::Tree, 8, big, a, b), 3.0 * (a + big * b));
    }
}
