//! Measuring collectives: two bandwidths per point, as nccl-tests reports them,
//!
//! * algbw = bytes / time — what the caller sees;
//! * busbw = algbw × factor — the bytes each link actually carried, comparable across world sizes:
//!   2(n−1)/n for all_reduce, (n−1)/n for all_gather and reduce_scatter, 1 for broadcast;
//!
//! and two ways of taking the time (a [`Method`]):
//!
//! * [`Method::NcclTests`] — what nccl-tests does: warm-up, one barrier, then the operation `iters`
//!   times back to back with nothing between the calls; each rank's time is its elapsed time / iters,
//!   the result the largest of those over the ranks. Consecutive operations may overlap across
//!   ranks (a fast rank starts the next one while a slow one finishes), as in a training loop.
//! * [`Method::Barrier`] — a barrier before every operation, each operation timed alone; each rank's
//!   median, the result the largest median over the ranks. Isolates one call's latency, but pays
//!   (and partly hides) the skew the barrier leaves between ranks.
//!
//! Used by the `collectives` bin (nccl-tests by default), the lesson 02/03 bins and notebooks
//! ([`measure`]: barrier). Also measures the limits the numbers should be read against: one
//! loopback TCP stream, and memcpy.

use crate::comm::{Algo, CommResult, OpKind, ProcessGroup, ReduceOp};
use serde::{Deserialize, Serialize};
use std::time::Instant;
use tch::{Device, Kind, Tensor};

mod limits;
mod stats;

pub use limits::{loopback_tcp_throughput, memcpy_throughput, model_time};
pub use stats::{median, peak_rss_bytes, reset_peak_rss};

/// How the time of one point is taken; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum Method {
    /// Warm-up, then `iters` operations back to back (one barrier before the first); per rank
    /// elapsed / iters; the maximum over ranks.
    #[value(name = "nccl-tests")]
    #[serde(rename = "nccl-tests")]
    NcclTests,
    /// A barrier before every operation, each timed alone; per rank the median; the maximum over ranks.
    #[value(name = "barrier")]
    #[serde(rename = "barrier")]
    Barrier,
}

impl Method {
    /// The name used on the command line and in the `method` field of records.
    pub fn name(self) -> &'static str {
        match self {
            Method::NcclTests => "nccl-tests",
            Method::Barrier => "barrier",
        }
    }

    /// One line saying what the reported time is.
    pub fn describe(self) -> &'static str {
        match self {
            Method::NcclTests => {
                "after warm-up, N iterations back to back (no barrier between them); \
                 time = max over ranks of each rank's elapsed/N"
            }
            Method::Barrier => {
                "after warm-up, a barrier before each iteration, each timed alone; \
                 time = max over ranks of each rank's median"
            }
        }
    }
}

/// One measured line (one JSON object of the `collectives` bin's `--json` output).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchRecord {
    /// Who ran it: `shardlab-tcp`, `shardlab-local`, `gloo`, or `limit` for the ceilings.
    #[serde(rename = "impl")]
    pub impl_: String,
    /// all_reduce, broadcast, all_gather, reduce_scatter (or tcp_stream / memcpy for limits).
    pub op: String,
    /// The algorithm that ran (naive, ring, tree, direct; `gloo` for Gloo's own choice; `-` for limits).
    pub algo: String,
    pub world_size: usize,
    /// The full tensor (all_reduce, broadcast), gathered output (all_gather) or input (reduce_scatter).
    pub bytes: u64,
    /// Seconds per operation, taken as `method` says. (Older output called this `median_s`.)
    #[serde(alias = "median_s")]
    pub time_s: f64,
    #[serde(rename = "algbw_GBps")]
    pub algbw_gbps: f64,
    #[serde(rename = "busbw_GBps")]
    pub busbw_gbps: f64,
    /// Timed iterations.
    #[serde(default)]
    pub iters: usize,
    /// How `time_s` was taken: [`Method::name`], or `-` for limits.
    #[serde(default)]
    pub method: String,
    /// Element type of the tensors.
    #[serde(default = "default_dtype")]
    pub dtype: String,
    /// libtorch intra-op threads per rank (0: not recorded).
    #[serde(default)]
    pub threads: usize,
    /// How the data moved: `tcp`, `shm`, `shm+tcp` ([`ProcessGroup::data_path`]), `local`
    /// (threads); `tcp` for Gloo; empty when not recorded.
    #[serde(default)]
    pub transport: String,
    /// For Gloo: the torch.distributed call that ran (e.g. `reduce_scatter_tensor`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call: Option<String>,
}

fn default_dtype() -> String {
    "float32".into()
}

/// The collectives the benchmark knows.
pub const OPS: [OpKind; 4] = [OpKind::AllReduce, OpKind::Broadcast, OpKind::AllGather, OpKind::ReduceScatter];

/// The [`OpKind`] of one of [`OPS`] by its name (`all_reduce`, ...).
pub fn op_from_name(s: &str) -> Option<OpKind> {
    OPS.into_iter().find(|o| o.name() == s)
}

/// busbw / algbw for `op` on `n` ranks.
pub fn bus_factor(op: OpKind, n: usize) -> f64 {
    let n = n as f64;
    match op {
        OpKind::AllReduce => 2.0 * (n - 1.0) / n,
        OpKind::AllGather | OpKind::ReduceScatter => (n - 1.0) / n,
        _ => 1.0,
    }
}

impl BenchRecord {
    /// A record of `op` on `n` ranks: `bytes` moved in `time_s` seconds per operation over `iters`
    /// timed iterations (f32). `method`, `threads` and `transport` are left unrecorded (`-`, 0,
    /// empty): [`measure_with`] fills them in.
    pub fn new(impl_: &str, op: OpKind, algo: &str, n: usize, bytes: u64, time_s: f64, iters: usize) -> Self {
        let algbw = bytes as f64 / time_s / 1e9;
        BenchRecord {
            impl_: impl_.into(),
            op: op.name().into(),
            algo: algo.into(),
            world_size: n,
            bytes,
            time_s,
            algbw_gbps: algbw,
            busbw_gbps: algbw * bus_factor(op, n),
            iters,
            method: "-".into(),
            dtype: default_dtype(),
            threads: 0,
            transport: String::new(),
            call: None,
        }
    }

    /// A ceiling measured by `--limits` (`what` = tcp_stream or memcpy): `bytes` moved at `bytes_per_s`.
    pub fn limit(what: &str, bytes: u64, bytes_per_s: f64, iters: usize) -> Self {
        BenchRecord {
            impl_: "limit".into(),
            op: what.into(),
            algo: "-".into(),
            world_size: 1,
            bytes,
            time_s: bytes as f64 / bytes_per_s,
            algbw_gbps: bytes_per_s / 1e9,
            busbw_gbps: bytes_per_s / 1e9,
            iters,
            method: "-".into(),
            dtype: "-".into(),
            threads: 0,
            transport: "-".into(),
            call: None,
        }
    }
}

/// Parse "4K", "64K", "1M", "16M", "1G", "1000" into bytes (K/M/G are powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>().map(|v| v * mult).map_err(|_| format!("bad size {s:?} (use e.g. 4K, 16M, 1G or a byte count)"))
}

/// Human-readable bytes: 4K, 16M, 1.5G.
pub fn fmt_size(b: u64) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => format!("{b}B"),
    }
}

/// How many iterations to time.
#[derive(Clone, Copy, Debug)]
pub enum Iters {
    /// Enough for ~0.3 s of timed work, at least 5, at most 200 (decided by rank 0 for everybody).
    Auto,
    /// Exactly this many (at least one).
    Fixed(usize),
}

/// How to time one point: warm-up iterations (at least one is always run), timed iterations, method.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub warmup: usize,
    pub iters: Iters,
    pub method: Method,
}

/// Time `op` with `algo` on `bytes` bytes of f32 on every rank with the barrier method (the lesson
/// bins' and notebooks' measurement); returns the record (the same on every rank: the slowest
/// rank's median). See [`measure_with`] for the choice of method.
pub fn measure(
    pg: &ProcessGroup,
    impl_: &str,
    op: OpKind,
    algo: Algo,
    bytes: u64,
    warmup: usize,
    iters: Iters,
) -> CommResult<BenchRecord> {
    measure_with(pg, impl_, op, algo, bytes, Timing { warmup, iters, method: Method::Barrier })
}

/// Time `op` with `algo` on `bytes` bytes of f32 on every rank as `timing` says; returns the
/// record (method, threads per rank and data path included), the same on every rank. Every rank
/// must call it with the same arguments.
pub fn measure_with(
    pg: &ProcessGroup,
    impl_: &str,
    op: OpKind,
    algo: Algo,
    bytes: u64,
    timing: Timing,
) -> CommResult<BenchRecord> {
    measure_on(pg, impl_, op, algo, bytes, timing, Device::Cpu)
}

/// [`measure_with`] on tensors on `device` (lesson 11: a GPU for the nccl backend, where NCCL
/// moves device memory in place; CUDA tensors through the tcp backend time its staging through
/// the host too). A blocking collective returns once its result is complete on the device, so
/// the wall clock times the operation itself.
pub fn measure_on(
    pg: &ProcessGroup,
    impl_: &str,
    op: OpKind,
    algo: Algo,
    bytes: u64,
    timing: Timing,
    device: Device,
) -> CommResult<BenchRecord> {
    let n = pg.world_size();
    let f32s = |b: u64| (b / 4) as i64;
    let opts = (Kind::Float, device);
    // Zero-filled, so repeated sums stay finite however many iterations run.
    let (mut a, mut b, real_bytes) = match op {
        OpKind::AllGather | OpKind::ReduceScatter => {
            let per = f32s(bytes) / n as i64;
            (Tensor::zeros([per * n as i64], opts), Tensor::zeros([per], opts), (per * n as i64 * 4) as u64)
        }
        _ => (Tensor::zeros([f32s(bytes)], opts), Tensor::zeros([0], opts), (f32s(bytes) * 4) as u64),
    };
    let mut run = |pg: &ProcessGroup| -> CommResult<()> {
        match op {
            OpKind::AllReduce => pg.all_reduce_with(&mut a, ReduceOp::Sum, algo),
            OpKind::Broadcast => pg.broadcast_with(&mut a, 0, algo),
            OpKind::AllGather => pg.all_gather_with(&mut a, &b, algo),
            OpKind::ReduceScatter => pg.reduce_scatter_with(&mut b, &a, ReduceOp::Sum, algo),
            _ => unreachable!(),
        }
    };
    // This rank's seconds per operation over `k` operations, as `method` takes it.
    let mut timed = |pg: &ProcessGroup, k: usize| -> CommResult<f64> {
        match timing.method {
            Method::NcclTests => {
                pg.barrier()?;
                let t = Instant::now();
                for _ in 0..k {
                    run(pg)?;
                }
                Ok(t.elapsed().as_secs_f64() / k as f64)
            }
            Method::Barrier => {
                let mut times = Vec::with_capacity(k);
                for _ in 0..k {
                    pg.barrier()?;
                    let t = Instant::now();
                    run(pg)?;
                    times.push(t.elapsed().as_secs_f64());
                }
                Ok(median(&mut times))
            }
        }
    };
    let warm = timed(pg, timing.warmup.max(1))?;
    let iters = match timing.iters {
        Iters::Fixed(k) => k.max(1),
        Iters::Auto => {
            // From the slowest rank's warm-up time; rank 0 decides, so every rank runs the same count.
            let per = max_over_ranks(pg, warm)?.max(1e-7);
            let mut k = Tensor::from_slice(&[((0.3 / per) as i64).clamp(5, 200)]);
            pg.broadcast(&mut k, 0)?;
            k.int64_value(&[0]) as usize
        }
    };
    let t = max_over_ranks(pg, timed(pg, iters)?)?;
    // Recorded under the algorithm that ran (`Auto` resolved).
    let mut r = BenchRecord::new(impl_, op, pg.resolve(op, algo).name(), n, real_bytes, t, iters);
    r.method = timing.method.name().into();
    r.threads = tch::get_num_threads().max(1) as usize;
    r.transport = pg.data_path().into();
    Ok(r)
}

/// The largest `x` over all ranks, on every rank.
fn max_over_ranks(pg: &ProcessGroup, x: f64) -> CommResult<f64> {
    let mut m = Tensor::from_slice(&[x]);
    pg.all_reduce(&mut m, ReduceOp::Max)?;
    Ok(m.double_value(&[0]))
}

/// One-way time of a `bytes`-byte message between ranks 0 and 1 (half the median ping-pong round
/// trip, other ranks idle); the same value is returned on every rank.
pub fn pingpong(pg: &ProcessGroup, bytes: u64, iters: usize) -> CommResult<f64> {
    let mut t = Tensor::zeros([(bytes / 4) as i64], (Kind::Float, Device::Cpu));
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        pg.barrier()?;
        let s = Instant::now();
        match pg.rank() {
            0 => {
                pg.send(&t, 1)?;
                pg.recv(&mut t, 1)?;
            }
            1 => {
                pg.recv(&mut t, 0)?;
                pg.send(&t, 0)?;
            }
            _ => {}
        }
        times.push(s.elapsed().as_secs_f64() / 2.0);
    }
    let mut m = Tensor::from_slice(&[if pg.rank() == 0 { median(&mut times) } else { 0.0 }]);
    pg.all_reduce(&mut m, ReduceOp::Max)?;
    Ok(m.double_value(&[0]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_print() {
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("16M").unwrap(), 16 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("1000").unwrap(), 1000);
        assert!(parse_size("12Q").is_err());
        assert_eq!(fmt_size(64 << 20), "64M");
        assert_eq!(fmt_size(1000), "1000B");
    }

    #[test]
    fn bus_factors_match_nccl_tests() {
        assert_eq!(bus_factor(OpKind::AllReduce, 4), 1.5);
        assert_eq!(bus_factor(OpKind::AllGather, 4), 0.75);
        assert_eq!(bus_factor(OpKind::ReduceScatter, 2), 0.5);
        assert_eq!(bus_factor(OpKind::Broadcast, 8), 1.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
