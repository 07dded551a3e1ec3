//! `collectives` — nccl-tests for shardlab: time all_reduce, broadcast, all_gather and
//! reduce_scatter over a range of sizes, optionally side by side with PyTorch's own Gloo backend.
//!
//!   cargo run --release --bin collectives -- --backend tcp --world-size 2 \
//!       --ops all_reduce,broadcast,all_gather,reduce_scatter --sizes 4K,64K,1M,16M,64M --json
//!   cargo run --release --bin collectives -- --world-size 4 --compare-gloo --limits
//!   cargo run --release --bin collectives -- --world-size 2 --compare-gloo --method barrier
//!   cargo run --release --bin collectives -- --backend nccl --world-size 1 --sizes 1M,64M,1G  # a GPU per rank
//!
//! bytes = the full tensor (all_reduce, broadcast), the full gathered output (all_gather), the full
//! input (reduce_scatter); busbw as nccl-tests. Every record names the algorithm that ran (`auto`
//! resolved) and the data path (`tcp`, `shm`, `shm+tcp`, `local`). The time per operation is
//! taken by `--method` (see [`shardlab::bench::Method`]):
//!
//! * `nccl-tests` (default): after warm-up, the operation N times back to back, no barrier between
//!   iterations; each rank's elapsed time / N; the largest over the ranks.
//! * `barrier`: a barrier before every iteration, each timed alone; each rank's median; the largest.
//!
//! The method is printed above the table and is the `method` field of every `--json` line.
//!
//! `--transport auto|tcp|shm` chooses how our process ranks move data on this machine (default
//! `auto`: shared memory); the rows are named after the data path that ran (`shardlab-tcp`,
//! `shardlab-shm`).
//!
//! `--compare-gloo` runs `benches/gloo_collectives.py` (torch.distributed's Gloo backend) on the
//! same points, with the same method, warm-up, iteration setting and intra-op thread count, and
//! refuses comparisons that would not be like with like. Gloo's ranks are processes, so
//! `--backend local` (threads of one process) is refused. Every point must come back from Gloo with
//! the same op, size, world size, dtype, threads and method. Gloo has no shared-memory transport
//! (its ranks on one machine talk over loopback TCP): `--transport tcp` compares the same data
//! path, `--transport shm` compares what a user of each library gets on one machine — the header
//! says which, and so does every row's data path. The `vs_gloo` column is
//! Gloo's time / ours (above 1: shardlab is faster). The Gloo rows name the torch call that ran;
//! PyTorch's Gloo has no reduce-scatter of its own (`reduce_scatter_tensor` clones the input,
//! all-reduces all of it and copies out this rank's chunk), which the `note` column says next to
//! every reduce_scatter ratio.

use anyhow::{bail, Context, Result};
use clap::Parser;
use shardlab::bench::{self, BenchRecord, Iters, Method, Timing};
use shardlab::comm::{Algo, OpKind};
use shardlab::prelude::*;

#[derive(Parser, Debug)]
#[command(about = "Benchmark shardlab's collectives (and PyTorch Gloo's) like nccl-tests")]
struct Args {
    /// local: ranks are threads of this process; tcp: ranks are processes (on one machine they
    /// share memory unless --transport tcp).
    #[arg(long, value_enum, default_value = "tcp")]
    backend: Backend,
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    /// Comma-separated: all_reduce,broadcast,all_gather,reduce_scatter.
    #[arg(long, default_value = "all_reduce,broadcast,all_gather,reduce_scatter")]
    ops: String,
    /// Comma-separated sizes in bytes, K/M/G suffixes (KiB/MiB/GiB).
    #[arg(long, default_value = "4K,64K,1M,16M,64M")]
    sizes: String,
    /// `default` (the library's default, `auto`: direct where every rank shares memory, else ring;
    /// broadcast: tree), `all`, or a comma list of naive,ring,tree,direct,auto (each op runs those
    /// it supports; direct only where every rank shares memory).
    #[arg(long, default_value = "default")]
    algos: String,
    /// Timed iterations per point: `auto` (≈0.3 s each, 5..200) or a number ≥ 1.
    #[arg(long, default_value = "auto")]
    iters: String,
    /// Untimed warm-up iterations per point (at least one is always run).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// How the time per operation is taken: `nccl-tests` (iterations back to back, mean per rank,
    /// slowest rank) or `barrier` (barrier before each iteration, median per rank, slowest rank).
    #[arg(long, value_enum, default_value = "nccl-tests")]
    method: Method,
    /// How process ranks on this machine move data: auto (shared memory), tcp or shm
    /// [default: SHARDLAB_TRANSPORT, else auto].
    #[arg(long, value_enum)]
    transport: Option<DataPath>,
    /// Also run PyTorch's Gloo backend (benches/gloo_collectives.py) on the same points, the same
    /// way, and show the ratio. Needs `--backend tcp`.
    #[arg(long)]
    compare_gloo: bool,
    /// Also measure the ceilings: one loopback TCP stream and memcpy.
    #[arg(long)]
    limits: bool,
    /// Where the benchmark's tensors live [default: cuda for --backend nccl, else cpu]. CUDA
    /// tensors through the tcp or local backend are staged through host memory (timed too).
    #[arg(long, value_enum)]
    device: Option<shardlab::device::DeviceChoice>,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

fn algos_for(spec: &str, op: OpKind) -> Result<Vec<Algo>> {
    let supported = Algo::supported(op);
    Ok(match spec {
        "default" => vec![Algo::Auto],
        "all" => supported.to_vec(),
        list => {
            let mut v = Vec::new();
            for name in list.split(',') {
                let a = <Algo as clap::ValueEnum>::from_str(name.trim(), true)
                    .map_err(|_| anyhow::anyhow!("unknown algorithm {name:?}"))?;
                if supported.contains(&a) || a == Algo::Auto {
                    v.push(a);
                }
            }
            v
        }
    })
}

/// The smallest `bytes` that gives `op` on `n` ranks at least one f32 (per rank's block for
/// all_gather and reduce_scatter). Below it we would time empty tensors, and Gloo's script would
/// round up to one element: the two sides would measure different things.
fn min_bytes(op: OpKind, n: usize) -> u64 {
    match op {
        OpKind::AllGather | OpKind::ReduceScatter => 4 * n as u64,
        _ => 4,
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.world_size == 0 {
        bail!("--world-size must be at least 1");
    }
    if args.compare_gloo {
        if args.backend != Backend::Tcp {
            bail!(
                "--compare-gloo needs --backend tcp: Gloo's ranks are processes, and --backend {} runs \
                 ranks as threads of one process (compare like with like)",
                backend_name(args.backend)
            );
        }
    }
    let ops: Vec<OpKind> = args
        .ops
        .split(',')
        .map(|s| {
            bench::op_from_name(s.trim())
                .with_context(|| format!("unknown op {s:?} (all_reduce, broadcast, all_gather, reduce_scatter)"))
        })
        .collect::<Result<_>>()?;
    let sizes: Vec<u64> =
        args.sizes.split(',').map(bench::parse_size).collect::<Result<_, _>>().map_err(anyhow::Error::msg)?;
    let iters = match args.iters.as_str() {
        "auto" => Iters::Auto,
        k => match k.parse::<usize>() {
            Ok(k) if k >= 1 => Iters::Fixed(k),
            _ => bail!("--iters takes `auto` or a number of at least 1, not {k:?}"),
        },
    };
    let mut plan = Vec::new();
    for &op in &ops {
        for algo in algos_for(&args.algos, op)? {
            for &b in &sizes {
                if b < min_bytes(op, args.world_size) {
                    bail!(
                        "size {} is too small for {} on {} ranks: it needs at least {} bytes (one f32{})",
                        bench::fmt_size(b),
                        op.name(),
                        args.world_size,
                        min_bytes(op, args.world_size),
                        if matches!(op, OpKind::AllGather | OpKind::ReduceScatter) { " per rank" } else { "" }
                    );
                }
                plan.push((op, algo, b));
            }
        }
    }
    if plan.is_empty() {
        bail!("nothing to measure: no op in --ops supports an algorithm in --algos {:?}", args.algos);
    }
    let python = if args.compare_gloo { Some(gloo_python()?) } else { None };
    let timing = Timing { warmup: args.warmup, iters, method: args.method };
    let (json, total) = (args.json, plan.len() as u64);
    let default = CommConfig::default();
    let config = CommConfig { transport: args.transport.unwrap_or(default.transport), ..default };
    let device_choice = args.device.unwrap_or(if args.backend == Backend::Nccl {
        shardlab::device::DeviceChoice::Cuda
    } else {
        shardlab::device::DeviceChoice::Cpu
    });
    if args.backend == Backend::Nccl && device_choice == shardlab::device::DeviceChoice::Cpu {
        bail!("--backend nccl moves GPU memory: use --device cuda (CPU tensors would time their staging)");
    }
    // Before any rank starts: a clear error where there is no GPU.
    shardlab::device::resolve(device_choice, 0)?;
    let records = spawn_with(SpawnOptions::new(args.world_size, args.backend).config(config), |pg| {
        let device = shardlab::device::resolve(device_choice, pg.local_rank())?;
        let on = if device.is_cuda() { "+cuda" } else { "" };
        let impl_name = format!("shardlab-{}{on}", pg.data_path());
        let bar = (pg.rank() == 0).then(|| {
            let b = indicatif::ProgressBar::new(total);
            b.set_style(indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").unwrap());
            b
        });
        let mut out = Vec::new();
        for &(op, algo, bytes) in &plan {
            if let Some(b) = &bar {
                b.set_message(format!("{} {} {}", op.name(), algo.name(), bench::fmt_size(bytes)));
            }
            // Direct needs every rank's shared memory: skipped where this group has none.
            if algo != Algo::Direct || pg.resolve(op, Algo::Auto) == Algo::Direct {
                out.push(bench::measure_on(pg, &impl_name, op, algo, bytes, timing, device)?);
            }
            if let Some(b) = &bar {
                b.inc(1);
            }
        }
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        Ok(if pg.rank() == 0 { out } else { Vec::new() })
    })?;
    let mut rows: Vec<BenchRecord> = records.into_iter().next().unwrap_or_default();
    if rows.is_empty() {
        bail!(
            "nothing was measured: the direct algorithm needs ranks that all share memory \
             (one machine, SHARDLAB_TRANSPORT=auto or shm)"
        );
    }

    if let Some(py) = python {
        // The ops in plan order, once each: Gloo runs only what we measured.
        let mut planned: Vec<&str> = Vec::new();
        for &(op, _, _) in &plan {
            if !planned.contains(&op.name()) {
                planned.push(op.name());
            }
        }
        let threads = rows.first().map_or(1, |r| r.threads);
        let gloo = run_gloo(&py, &args, &planned.join(","), threads)?;
        check_alike(&rows, &gloo)?;
        rows.extend(gloo);
    }
    if args.limits {
        let tcp = bench::loopback_tcp_throughput(1 << 30)?;
        let mem = bench::memcpy_throughput(256 << 20, 8);
        rows.push(BenchRecord::limit("tcp_stream", 1 << 30, tcp, 1));
        rows.push(BenchRecord::limit("memcpy", 256 << 20, mem, 8));
    }
    if json {
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
    } else {
        print_table(args.method, &rows);
    }
    Ok(())
}

fn backend_name(b: Backend) -> &'static str {
    match b {
        Backend::Tcp => "tcp",
        Backend::Nccl => "nccl",
        Backend::Local => "local",
    }
}

/// The project's Python (created by `bash .ci/setup`), checked before anything is measured.
fn gloo_python() -> Result<std::path::PathBuf> {
    let py = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    if !py.exists() {
        bail!("{} not found (needed by --compare-gloo): run `bash .ci/setup` first", py.display());
    }
    Ok(py)
}

/// Run benches/gloo_collectives.py on the same points, with the same method, warm-up, iterations
/// and intra-op threads per rank as ours.
fn run_gloo(py: &std::path::Path, args: &Args, ops: &str, threads: usize) -> Result<Vec<BenchRecord>> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/gloo_collectives.py");
    let out = std::process::Command::new(py)
        .arg(script)
        .args([
            "--world-size",
            &args.world_size.to_string(),
            "--ops",
            ops,
            "--sizes",
            &args.sizes,
            "--iters",
            &args.iters,
            "--warmup",
            &args.warmup.to_string(),
            "--method",
            args.method.name(),
            "--threads",
            &threads.to_string(),
            "--json",
        ])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running the Gloo benchmark")?;
    if !out.status.success() {
        bail!("the Gloo benchmark failed ({})", out.status);
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.trim_start().starts_with('{'))
        .map(|l| serde_json::from_str(l).with_context(|| format!("bad line from the Gloo benchmark: {l}")))
        .collect()
}

/// Every point we measured must have a Gloo row taken the same way: same op, bytes, world size,
/// dtype, threads per rank and method. Anything else is refused rather than printed as
/// a ratio.
fn check_alike(ours: &[BenchRecord], gloo: &[BenchRecord]) -> Result<()> {
    for r in ours {
        let g = gloo.iter().find(|g| g.op == r.op && g.bytes == r.bytes && g.world_size == r.world_size).with_context(
            || format!("the Gloo benchmark reported no {} of {} bytes on {} ranks", r.op, r.bytes, r.world_size),
        )?;
        for (what, a, b) in [
            ("method", r.method.clone(), g.method.clone()),
            ("dtype", r.dtype.clone(), g.dtype.clone()),
            ("threads per rank", r.threads.to_string(), g.threads.to_string()),
        ] {
            if a != b {
                bail!(
                    "not like with like: {} {} bytes was measured with {what} {a:?} by shardlab but {b:?} by Gloo",
                    r.op,
                    r.bytes
                );
            }
        }
    }
    Ok(())
}

/// What PyTorch's Gloo really runs when `call` is not the collective `op` it stands in for.
fn gloo_emulation(op: &str, call: &str) -> Option<&'static str> {
    match (op, call) {
        // ProcessGroupGloo::reduce_scatter_tensor_coalesced: clone, all-reduce, copy out the chunk.
        ("reduce_scatter", "reduce_scatter_tensor") => Some("an all_reduce of the full input + copy of own chunk"),
        ("reduce_scatter", "all_reduce+slice") => Some("the script's all_reduce of the full input + copy of own chunk"),
        _ => None,
    }
}

fn print_table(method: Method, rows: &[BenchRecord]) {
    println!("# method: {} — {}", method.name(), method.describe());
    let mut paths: Vec<String> = Vec::new();
    for r in rows.iter().filter(|r| r.impl_ != "limit") {
        let p = format!("{} {}", r.impl_, r.transport);
        if !paths.contains(&p) {
            paths.push(p);
        }
    }
    println!("# data path: {}", paths.join(", "));
    let gloo_path = rows.iter().find(|r| r.impl_ == "gloo").map(|g| g.transport.clone());
    if let Some(gp) = gloo_path.filter(|gp| rows.iter().any(|r| r.impl_.starts_with("shardlab") && &r.transport != gp))
    {
        println!(
            "# data paths differ: Gloo has no shared-memory transport (its ranks use {gp} on one machine); these \
             ratios compare what each library does on one machine, not the same wire (--transport tcp for that)"
        );
    }
    if rows.iter().any(|r| r.impl_ == "gloo") {
        println!(
            "# vs_gloo = Gloo's time / ours, same op, bytes, ranks, dtype, threads and method \
             (above 1: shardlab faster)"
        );
    }
    println!(
        "{:<15} {:<15} {:<6} {:>5} {:>8} {:>12} {:>11} {:>11} {:>8}  note",
        "impl", "op", "algo", "n", "bytes", "time_us", "algbw_GB/s", "busbw_GB/s", "vs_gloo"
    );
    let mut emulated = false;
    for r in rows {
        let gloo = rows
            .iter()
            .find(|g| g.impl_ == "gloo" && g.op == r.op && g.world_size == r.world_size && g.bytes == r.bytes);
        let (ratio, note) = match (r.impl_.as_str(), gloo) {
            ("gloo" | "limit", _) | (_, None) => (String::new(), gloo_call_note(r)),
            (_, Some(g)) => {
                let emul = g.call.as_deref().and_then(|c| gloo_emulation(&g.op, c));
                emulated |= emul.is_some();
                let note = match (emul, &g.call) {
                    (Some(_), Some(c)) => format!("Gloo side is an all_reduce emulation ({c})"),
                    _ => String::new(),
                };
                (format!("{:.2}x", g.time_s / r.time_s), note)
            }
        };
        let line = format!(
            "{:<15} {:<15} {:<6} {:>5} {:>8} {:>12.1} {:>11.3} {:>11.3} {:>8}  {}",
            r.impl_,
            r.op,
            r.algo,
            r.world_size,
            bench::fmt_size(r.bytes),
            r.time_s * 1e6,
            r.algbw_gbps,
            r.busbw_gbps,
            ratio,
            note
        );
        println!("{}", line.trim_end());
    }
    if emulated {
        println!(
            "# PyTorch's Gloo has no reduce-scatter: reduce_scatter_tensor clones the input, all-reduces all of it \
             and copies out this rank's chunk, so those ratios compare a reduce-scatter with an all-reduce."
        );
    }
}

/// The note of a Gloo row: the torch call that ran, and what it really is when it is an emulation.
fn gloo_call_note(r: &BenchRecord) -> String {
    match (&r.impl_[..], &r.call) {
        ("gloo", Some(c)) => match gloo_emulation(&r.op, c) {
            Some(what) => format!("call {c} = {what}"),
            None => format!("call {c}"),
        },
        _ => String::new(),
    }
}
