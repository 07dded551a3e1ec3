//! Failures in the middle of a collective: a rank killed (SIGKILL) or aborting half-way through
//! a frame, anywhere in the ring, must leave every survivor with an error — never `Ok` with data
//! that did not arrive — and an abort must reach ranks that are only *sending* to the failed
//! rank within about a second, with the peer timeout left at 300 s (a regression shows as a test
//! that overruns its own short deadline instead of as a 5-minute hang).
//!
//! Faults are injected at exact byte offsets with `CommConfig::fault` (see `comm::Fault`).

use shardlab::comm::{segment, Fault};
use shardlab::prelude::*;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The peer timeout stays long: nobody may be released by a timeout.
const LONG: Duration = Duration::from_secs(300);
/// How long after the failure every survivor must have its error.
const PROMPT_MS: u128 = 1500;

fn now_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis()
}

/// "@<ms> <message>": when a rank saw its error, for the promptness checks.
fn stamped(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("@{} {e}", now_ms())
}

fn stamp_of(msg: &str) -> Option<u128> {
    msg.strip_prefix('@')?.split_once(' ')?.0.parse().ok()
}

fn child_args(test: &str) -> Vec<String> {
    vec!["--exact".into(), test.into(), "--nocapture".into(), "--test-threads=1".into()]
}

/// Four all_reduces (collectives #1–#4; #0 is rendezvous' barrier) of `numel` f32 on every rank,
/// each result checked against the exact sum: over TCP the ring algorithm, with shared memory the
/// direct one. Rank `victim` fails after `after` payload bytes of collective #2 (`kill`: SIGKILL;
/// else it aborts and its process stays alive 3 s).
#[allow(clippy::too_many_arguments)]
fn ring_job(
    path: DataPath,
    n: usize,
    numel: i64,
    victim: usize,
    after: usize,
    kill: bool,
    launch: Launch,
    test: &str,
) -> Vec<(usize, String)> {
    let cfg = CommConfig {
        transport: path,
        chunk_bytes: 64 << 10,         // many frames per step, so the fault lands inside one
        shm_exchange_bytes: 256 << 10, // several exchange steps per all_reduce
        fault: Some(Fault { rank: victim, seq: 2, after_bytes: after, kill }),
        ..CommConfig::default().with_timeout(LONG)
    };
    let mut opts = SpawnOptions::new(n, Backend::Tcp).launch(launch).config(cfg);
    if launch == Launch::Processes {
        opts = opts.child_args(child_args(test));
    }
    let t = std::time::Instant::now();
    let e = spawn_with(opts, move |pg| {
        // A process rank re-runs the test up to its first spawn call: take the world from the
        // group, not from the loop (the fault comes with the config, which the parent passes).
        let (r, n) = (pg.rank(), pg.world_size());
        for i in 0..4 {
            let mut t = Tensor::full([numel], (r + 1 + 10 * i) as f64, (Kind::Float, Device::Cpu));
            if let Err(e) = pg.all_reduce(&mut t, ReduceOp::Sum) {
                let e = stamped(e); // when this rank learned of the failure
                if r == victim && !kill {
                    std::thread::sleep(Duration::from_secs(3)); // the failed rank's process stays alive
                }
                return Err(e);
            }
            // Exact in f32: small integers.
            let want = (n * (n + 1) / 2 + 10 * i * n) as f64;
            let (lo, hi) = (t.min().double_value(&[]), t.max().double_value(&[]));
            anyhow::ensure!(lo == want && hi == want, "WRONG DATA in all_reduce {i}: [{lo}, {hi}], want {want}");
        }
        Ok(())
    })
    .expect_err("the victim fails, so the job must fail");
    // A hang is released by the 300 s timeout, which `check` refuses; this bound only keeps a slow
    // job from hiding behind it. It is not a speed goal: process ranks of a debug build start and
    // stop slowly when another test's ranks share the 2 cores (one job took 61 s so; alone, the
    // test's eleven jobs take 5.5 s in all).
    // Promptness is `check`'s PROMPT_MS, measured from the ranks' own error stamps.
    assert!(t.elapsed() < Duration::from_secs(150), "n={n} after={after}: took {:?}", t.elapsed());
    e.failures
}

/// Every rank failed, none holds wrong data, and the survivors failed promptly.
fn check(n: usize, victim: usize, kill: bool, failures: &[(usize, String)], what: &str) {
    let text = failures.iter().map(|(r, m)| format!("rank {r}: {m}")).collect::<Vec<_>>().join("\n");
    assert!(!text.contains("WRONG DATA"), "{what}: a rank returned Ok with data that did not arrive:\n{text}");
    assert_eq!(failures.len(), n, "{what}: every rank must fail:\n{text}");
    let victim_msg = &failures.iter().find(|f| f.0 == victim).unwrap().1;
    if kill {
        assert!(victim_msg.contains("signal: 9"), "{what}: {victim_msg}");
    } else {
        let at = stamp_of(victim_msg).unwrap_or_else(|| panic!("{what}: {victim_msg}"));
        for (r, m) in failures.iter().filter(|f| f.0 != victim) {
            let seen = stamp_of(m).unwrap_or_else(|| panic!("{what}: rank {r}: {m}"));
            // The victim's stamp is taken after its own error returns; survivors may be earlier.
            assert!(seen <= at + PROMPT_MS, "{what}: rank {r} learned of the failure {} ms late: {m}", seen - at);
        }
    }
    for (r, m) in failures.iter().filter(|f| f.0 != victim) {
        assert!(!m.contains("timed out"), "{what}: rank {r} was released by the timeout: {m}");
    }
    if kill {
        // The killed rank cannot say when it died: the survivors learn of it together.
        let seen: Vec<u128> = failures.iter().filter(|f| f.0 != victim).filter_map(|(_, m)| stamp_of(m)).collect();
        assert_eq!(seen.len(), n - 1, "{what}: every survivor stamps its error: {failures:?}");
        let spread = seen.iter().max().unwrap() - seen.iter().min().unwrap();
        assert!(spread <= PROMPT_MS, "{what}: survivors learned of the death {spread} ms apart: {failures:?}");
    }
}

/// Where to fail rank `r` in a ring all_reduce of `numel` f32 over `n` ranks (payload bytes it
/// has sent): in its first frame, half-way, just inside its last step, and inside its very last
/// frame. Its messages, in order: reduce-scatter step s sends segment r−s, all-gather step s
/// sends segment r+1−s (`algo::ring::all_reduce`).
fn ring_points(n: usize, numel: usize, r: usize) -> Vec<usize> {
    let seg = |i: usize| segment(numel, n, i % n, 4).len();
    let sends: Vec<usize> = (0..n - 1).map(|s| seg(r + n - s)).chain((0..n - 1).map(|s| seg(r + 1 + n - s))).collect();
    let total: usize = sends.iter().sum();
    let last = *sends.last().unwrap();
    vec![100, total / 2 + 6, total - last + 2, total - 10]
}

/// The same for the direct algorithm: a rank puts its whole buffer into shared memory over
/// each all_reduce (its own segment last, once reduced), 256 KiB at a time.
fn fault_points(path: DataPath, n: usize, numel: usize, r: usize) -> Vec<usize> {
    match path {
        DataPath::Shm => vec![100, numel * 2 + 6, numel * 4 - 10],
        _ => ring_points(n, numel, r),
    }
}

/// Paths and world sizes the fault tests run.
const CASES: [(DataPath, usize); 3] = [(DataPath::Tcp, 4), (DataPath::Tcp, 5), (DataPath::Shm, 4)];

#[test]
fn killed_rank_mid_frame_never_leaves_ok_with_missing_data() {
    for (path, n) in CASES {
        let numel = 1 << 18; // 1 MiB per rank
        for after in fault_points(path, n, numel, 2) {
            let f = ring_job(
                path,
                n,
                numel as i64,
                2,
                after,
                true,
                Launch::Processes,
                "killed_rank_mid_frame_never_leaves_ok_with_missing_data",
            );
            check(n, 2, true, &f, &format!("SIGKILL {path:?} n={n} after={after}"));
        }
    }
}

/// A rank that aborts half-way through a frame while its process stays alive (its connections
/// stay open: nobody sees them close).
fn aborting_rank(launch: Launch, test: &str) {
    for (path, n) in CASES {
        let numel = 1 << 18;
        for after in fault_points(path, n, numel, 2) {
            let f = ring_job(path, n, numel as i64, 2, after, false, launch, test);
            check(n, 2, false, &f, &format!("abort {launch:?} {path:?} n={n} after={after}"));
        }
    }
}

#[test]
fn aborting_thread_rank_mid_frame_never_leaves_ok_with_missing_data() {
    aborting_rank(Launch::Threads, "");
}

#[test]
fn aborting_process_rank_mid_frame_never_leaves_ok_with_missing_data() {
    // (A child process runs the first spawn it reaches as its rank: one launch kind per test.)
    aborting_rank(Launch::Processes, "aborting_process_rank_mid_frame_never_leaves_ok_with_missing_data");
}

/// Every rank runs `op` on thread ranks of `backend` (one of them fails inside it); the failures.
fn sender_job<F>((backend, path): (Backend, DataPath), n: usize, op: F) -> Vec<(usize, String)>
where
    F: Fn(&ProcessGroup) -> CommResult<()> + Send + Sync,
{
    let config = CommConfig { transport: path, ..CommConfig::default().with_timeout(LONG) };
    let opts = SpawnOptions::new(n, backend).launch(Launch::Threads).config(config);
    let t = std::time::Instant::now();
    // The closing barrier stamps the ranks whose own operation completed before the failure.
    let e = spawn_with(opts, |pg| op(pg).and_then(|_| pg.barrier()).map_err(stamped))
        .expect_err("one rank fails, so the job must fail");
    assert!(t.elapsed() < Duration::from_secs(30), "{backend:?} {path:?}: took {:?}: {:?}", t.elapsed(), e.failures);
    e.failures
}

fn big() -> Tensor {
    Tensor::ones([16 << 20], (Kind::Float, Device::Cpu)) // 64 MiB: far more than the socket buffers hold
}

/// The victim's message carries "FAILING@<ms>" (when it failed); everyone else must have had its
/// error by then + PROMPT_MS.
fn check_prompt(failures: &[(usize, String)], n: usize, what: &str) {
    let text = failures.iter().map(|(r, m)| format!("rank {r}: {m}")).collect::<Vec<_>>().join("\n");
    assert_eq!(failures.len(), n, "{what}: every rank must fail:\n{text}");
    let victim_stamp = |m: &str| m.split("FAILING@").nth(1)?.split_once(' ')?.0.parse::<u128>().ok();
    let at = failures.iter().find_map(|(_, m)| victim_stamp(m));
    let at = at.unwrap_or_else(|| panic!("{what}: no victim stamp:\n{text}"));
    for (r, m) in failures.iter().filter(|(_, m)| victim_stamp(m).is_none()) {
        let seen = stamp_of(m).unwrap_or_else(|| panic!("{what}: rank {r}: {m}"));
        assert!(
            seen <= at + PROMPT_MS,
            "{what}: rank {r} learned of the failure {} ms late:\n{text}",
            seen.saturating_sub(at)
        );
        assert!(!m.contains("timed out"), "{what}: rank {r} was released by the timeout: {m}");
    }
}

/// The victim fails (stamping when) after sleeping `ms`, while its peers are blocked sending to it.
fn fail_after(pg: &ProcessGroup, ms: u64, how: impl FnOnce() -> CommResult<()>) -> CommResult<()> {
    std::thread::sleep(Duration::from_millis(ms));
    let at = now_ms();
    let r = how();
    std::thread::sleep(Duration::from_millis(2000)); // stays alive after failing
    r.map_err(|e| CommError::Aborted { by: pg.rank(), reason: format!("FAILING@{at} {e}") })
}

#[test]
fn abort_reaches_ranks_that_only_send() {
    // Threads; processes over TCP frames; processes sharing memory (rings for send/recv, the
    // direct algorithms for the collectives).
    for backend in [(Backend::Local, DataPath::Auto), (Backend::Tcp, DataPath::Tcp), (Backend::Tcp, DataPath::Shm)] {
        // send: rank 0 pushes 64 MiB to rank 1, which gives up instead of receiving.
        let f = sender_job(backend, 2, |pg| {
            if pg.rank() == 0 {
                pg.send(&big(), 1)
            } else {
                fail_after(pg, 300, || {
                    pg.abort("rank 1 gives up");
                    Err(CommError::InvalidArgument("gave up".into()))
                })
            }
        });
        check_prompt(&f, 2, &format!("{backend:?} send"));
        // Naive broadcast: the root sends to rank 1, then to rank 2, which fails on a bad argument.
        let f = sender_job(backend, 3, |pg| {
            let mut t = big();
            if pg.rank() == 2 {
                fail_after(pg, 300, || pg.broadcast_with(&mut t, 7, Algo::Naive))
            } else {
                pg.broadcast_with(&mut t, 0, Algo::Naive)
            }
        });
        check_prompt(&f, 3, &format!("{backend:?} naive broadcast"));
        // Naive all_reduce: the non-roots send to rank 0, which fails on a bad tensor.
        let f = sender_job(backend, 3, |pg| {
            if pg.rank() == 0 {
                fail_after(pg, 300, || pg.all_reduce_with(&mut big().to_kind(Kind::Int), ReduceOp::Sum, Algo::Naive))
            } else {
                pg.all_reduce_with(&mut big(), ReduceOp::Sum, Algo::Naive)
            }
        });
        check_prompt(&f, 3, &format!("{backend:?} naive all_reduce"));
        // The default all_reduce (direct on shared memory): rank 2 fails while the others wait.
        let f = sender_job(backend, 3, |pg| {
            if pg.rank() == 2 {
                fail_after(pg, 300, || pg.all_reduce(&mut big().to_kind(Kind::Int), ReduceOp::Sum))
            } else {
                pg.all_reduce(&mut big(), ReduceOp::Sum)
            }
        });
        check_prompt(&f, 3, &format!("{backend:?} default all_reduce"));
    }
}

/// A rank that shuts its group down cleanly while a peer still waits for it (a torchrun-style
/// script that returned early on its own error): the peer gets `PeerLeft` at once — over TCP and
/// over shared memory, where no socket closes to say so.
#[test]
fn a_rank_that_left_is_reported_at_once() {
    for path in [DataPath::Tcp, DataPath::Shm] {
        let port = shardlab::launch::free_port().unwrap();
        let secret = shardlab::comm::auth::Secret::generate().unwrap();
        let cfg = CommConfig { transport: path, secret: Some(secret), ..CommConfig::default().with_timeout(LONG) };
        let init = |rank| TcpInit::loopback(rank, 2, port);
        let (waiter, leaver) = std::thread::scope(|s| {
            let waiter = s.spawn(|| -> CommResult<(CommResult<()>, Duration, &'static str)> {
                let pg = ProcessGroup::init_tcp(&init(0), cfg.clone())?;
                let t = std::time::Instant::now();
                let r = pg.all_reduce(&mut big(), ReduceOp::Sum); // rank 1 never joins this one
                Ok((r, t.elapsed(), pg.data_path()))
            });
            let leaver = s.spawn(|| ProcessGroup::init_tcp(&init(1), cfg.clone()).map(drop));
            (waiter.join().unwrap(), leaver.join().unwrap())
        });
        leaver.unwrap_or_else(|e| panic!("{path:?}: rank 1 could not join: {e}"));
        let (r, took, data_path) = waiter.unwrap_or_else(|e| panic!("{path:?}: rank 0 could not join: {e}"));
        assert_eq!(data_path, if path == DataPath::Shm { "shm" } else { "tcp" });
        let e = r.expect_err("rank 1 left: the all_reduce cannot complete");
        assert!(matches!(e, CommError::PeerLeft { peer: 1, .. }), "{path:?}: {e}");
        assert!(took < Duration::from_millis(PROMPT_MS as u64), "{path:?}: took {took:?} to notice: {e}");
    }
}

/// One operation of the fault matrix: a collective with one algorithm, the same started
/// asynchronously, or an all_reduce in a subgroup.
#[derive(Clone, Copy, Debug)]
enum Op {
    AllReduce(Algo),
    Broadcast(Algo),
    AllGather(Algo),
    ReduceScatter(Algo),
    AsyncAllReduce,
    /// An all_reduce in a subgroup: pairs of ranks from the last one down (the victim's holds 2).
    SubgroupAllReduce,
}

/// Every operation the host backend has on `path`: each collective with each of its algorithms
/// (direct only with shared memory), async work, and a subgroup.
fn matrix_ops(path: DataPath) -> Vec<Op> {
    use Algo::*;
    let mut ops = vec![
        Op::AllReduce(Naive),
        Op::AllReduce(Ring),
        Op::Broadcast(Naive),
        Op::Broadcast(Ring),
        Op::Broadcast(Tree),
        Op::AllGather(Naive),
        Op::AllGather(Ring),
        Op::ReduceScatter(Naive),
        Op::ReduceScatter(Ring),
        Op::AsyncAllReduce,
        Op::SubgroupAllReduce,
    ];
    if path == DataPath::Shm {
        ops.extend([Op::AllReduce(Direct), Op::Broadcast(Direct), Op::AllGather(Direct), Op::ReduceScatter(Direct)]);
    }
    ops
}

/// The faulted collective's number: #0 is rendezvous' barrier (in a subgroup too: its #0 is its
/// own barrier, and the split's two all-gathers are the parent's #1 and #2).
const MATRIX_SEQ: u64 = 1;

/// Run `op` on `numel` f32 per rank (inputs r + 1; broadcast from the victim, the last rank),
/// check what it returned against the exact result, then a barrier; errors stamped.
fn matrix_rank(pg: &ProcessGroup, op: Op, numel: i64) -> anyhow::Result<()> {
    let (r, n) = (pg.rank(), pg.world_size());
    let f = |v: f64, k: i64| Tensor::full([k], v, (Kind::Float, Device::Cpu));
    let exact = |t: &Tensor, want: &[f64], what: &str| -> anyhow::Result<()> {
        let k = want.len() as i64;
        let got = t.reshape([k, -1]);
        for (i, w) in want.iter().enumerate() {
            let row = got.get(i as i64);
            let (lo, hi) = (row.min().double_value(&[]), row.max().double_value(&[]));
            anyhow::ensure!(lo == *w && hi == *w, "WRONG DATA in {what} block {i}: [{lo}, {hi}], want {w}");
        }
        Ok(())
    };
    let sum = (n * (n + 1) / 2) as f64;
    let run = || -> anyhow::Result<()> {
        match op {
            Op::AllReduce(a) => {
                let mut t = f((r + 1) as f64, numel);
                pg.all_reduce_with(&mut t, ReduceOp::Sum, a)?;
                exact(&t, &[sum], "all_reduce")?;
            }
            Op::Broadcast(a) => {
                let mut t = f((r + 1) as f64, numel);
                pg.broadcast_with(&mut t, n - 1, a)?;
                exact(&t, &[n as f64], "broadcast")?;
            }
            Op::AllGather(a) => {
                let mut out = f(0.0, numel * n as i64);
                pg.all_gather_with(&mut out, &f((r + 1) as f64, numel), a)?;
                exact(&out, &(1..=n).map(|i| i as f64).collect::<Vec<_>>(), "all_gather")?;
            }
            Op::ReduceScatter(a) => {
                let mut out = f(0.0, numel);
                pg.reduce_scatter_with(&mut out, &f((r + 1) as f64, numel * n as i64), ReduceOp::Sum, a)?;
                exact(&out, &[sum], "reduce_scatter")?;
            }
            Op::AsyncAllReduce => {
                let w = pg.all_reduce_async(f((r + 1) as f64, numel), ReduceOp::Sum)?;
                exact(&w.wait()?, &[sum], "all_reduce_async")?;
            }
            Op::SubgroupAllReduce => {
                // Pairs from the last rank down: the victim's group has two ranks.
                let color = |q: usize| (n - 1 - q) / 2;
                let g = pg.split(Some(color(r)), r)?.expect("every rank is in one");
                let mut t = f((r + 1) as f64, numel);
                g.all_reduce(&mut t, ReduceOp::Sum)?;
                let want: usize = (0..n).filter(|&q| color(q) == color(r)).map(|q| q + 1).sum();
                exact(&t, &[want as f64], "subgroup all_reduce")?;
            }
        }
        Ok(pg.barrier()?)
    };
    run().map_err(stamped)
}

/// One cell of the matrix: `n` ranks on `path`, the last one failing in `op` after `after`
/// payload bytes (`kill`: SIGKILL, process ranks; else it aborts and lives on, thread ranks).
fn matrix_cell(path: DataPath, n: usize, op: Op, after: usize, kill: bool, test: &str) {
    let numel: i64 = 1 << 16; // 256 KiB per rank: several frames and exchange steps
    let victim = n - 1;
    let cfg = CommConfig {
        transport: path,
        chunk_bytes: 16 << 10,
        shm_exchange_bytes: 64 << 10,
        fault: Some(Fault { rank: victim, seq: MATRIX_SEQ, after_bytes: after, kill }),
        ..CommConfig::default().with_timeout(LONG)
    };
    let launch = if kill { Launch::Processes } else { Launch::Threads };
    let mut opts = SpawnOptions::new(n, Backend::Tcp).launch(launch).config(cfg);
    if kill {
        // The child processes re-run the test up to this cell's spawn (see `this_cell`).
        opts = opts.child_args(child_args(test));
        opts.env.push((CELL_ENV.into(), format!("{path:?} {n} {op:?}")));
    }
    let what = format!("{} {path:?} n={n} {op:?} after {after} B", if kill { "SIGKILL" } else { "abort" });
    let t = std::time::Instant::now();
    let res = spawn_with(opts, move |pg| {
        let r = matrix_rank(pg, op, numel);
        if r.is_err() && pg.rank() == victim && !kill {
            std::thread::sleep(Duration::from_millis(200)); // the failed rank lives on a while
        }
        r
    });
    let e = res.err().unwrap_or_else(|| panic!("{what}: the victim fails, so the job must fail"));
    assert!(t.elapsed() < Duration::from_secs(30), "{what}: took {:?}", t.elapsed());
    check(n, victim, kill, &e.failures, &what);
}

/// In the child processes of a process cell: which cell they run.
const CELL_ENV: &str = "SHARDLAB_MATRIX_CELL";

/// Whether to run this cell: always in the test itself; in a child process, only the cell it
/// was started for (it re-runs the test and becomes a rank at the first spawn it reaches).
fn this_cell(path: DataPath, n: usize, op: Op) -> bool {
    std::env::var(CELL_ENV).map_or(true, |c| c == format!("{path:?} {n} {op:?}"))
}

/// The fault matrix, aborts: every operation of every algorithm, on TCP and shared memory, at
/// 2–5 ranks, the victim failing early (100 bytes in: even world sizes) or half-way (odd).
/// Thread ranks.
#[test]
fn fault_matrix_aborts() {
    for path in [DataPath::Tcp, DataPath::Shm] {
        for n in 2..=5 {
            for op in matrix_ops(path) {
                matrix_cell(path, n, op, if n % 2 == 0 { 100 } else { 1 << 17 }, false, "");
            }
        }
    }
}

/// The fault matrix, deaths: the same operations, the victim SIGKILLed half-way; each
/// operation at one world size (2–5 in turn, to keep it short). Process ranks.
#[test]
fn fault_matrix_kills() {
    for path in [DataPath::Tcp, DataPath::Shm] {
        for (i, op) in matrix_ops(path).into_iter().enumerate() {
            let n = 2 + (i + (path == DataPath::Shm) as usize) % 4;
            if this_cell(path, n, op) {
                matrix_cell(path, n, op, 1 << 17, true, "fault_matrix_kills");
            }
        }
    }
}

/// Lesson 10's fault-injection lab (`faults`): run as a learner runs it, every scenario ends with
/// the error its lesson section quotes, on every rank, and the fixed deadlock completes.
#[test]
fn the_fault_lab_reports_every_failure_on_every_rank() {
    // Run as a learner would, without the environment knobs that change its transport or buffers,
    // and never longer than 3 minutes (the scenarios' timeouts add up to well under one).
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_faults"))
        .arg("--json")
        .env_remove("SHARDLAB_SOCK_BUF")
        .env_remove("SHARDLAB_TRANSPORT")
        .env_remove("SHARDLAB_TIMEOUT_S")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(180) {
            let _ = child.kill();
            panic!(
                "faults --json ran past 3 minutes: {}",
                String::from_utf8_lossy(&child.wait_with_output().unwrap().stdout)
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "faults --json failed: {}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let want: [(&str, &[&str], usize); 7] = [
        ("kill", &["disconnected unexpectedly", "disconnected unexpectedly", "signal: 9"], 3),
        ("order", &["ranks disagree", "ranks disagree"], 2),
        ("stall", &["timed out after 2s waiting for rank 1", "aborted because rank 0 failed: timed out"], 2),
        ("corrupt", &["does not match its checksum", "rank 0 failed"], 2),
        ("fp16", &["skipped (gradients inf or NaN; scale 2^30", "skipped (gradients inf or NaN; scale 2^30"], 2),
        ("oom", &["can't allocate memory", "can't allocate memory"], 2),
        ("deadlock", &["timed out after 3s", "timed out after 3s", "] exchanged", "] exchanged"], 4),
    ];
    assert_eq!(rows.len(), want.len(), "one JSON line per scenario: {rows:?}");
    for ((name, words, n), row) in want.iter().zip(&rows) {
        assert_eq!(row["scenario"], *name);
        let ranks: Vec<&str> = row["ranks"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        assert_eq!(ranks.len(), *n, "{name}: {ranks:?}");
        for (line, w) in ranks.iter().zip(words.iter()) {
            assert!(line.contains(w), "{name}: expected {w:?} in {line:?}");
            assert!(!line.contains("did not happen"), "{name}: {line}");
        }
        if *name == "fp16" {
            assert!(
                ranks.iter().all(|l| l.contains(" taken at scale 2^")),
                "fp16: the scaler must end up taking a step: {ranks:?}"
            );
        }
    }
}
