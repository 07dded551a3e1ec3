//! The `collectives` benchmark bin end to end: real processes over TCP, one JSON object per line
//! with the nccl-tests fields and the timing method, busbw derived from algbw by the documented
//! factors, unlike comparisons with Gloo refused, and Gloo's emulated reduce-scatter flagged.
//!
//! Every benchmark started here runs under a deadline ([`deadline`]): in its own process group,
//! which is killed (ranks and the Gloo script included) when the deadline passes, so a stalled
//! benchmark fails its test instead of hanging the suite.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long one benchmark started by these tests may take: `SHARDLAB_BENCH_TEST_DEADLINE_S`
/// seconds, default 180 (the runs here take a few seconds; a Gloo comparison about half a minute,
/// mostly Python start-up).
fn deadline() -> Duration {
    let s = std::env::var("SHARDLAB_BENCH_TEST_DEADLINE_S").ok().and_then(|v| v.parse().ok()).unwrap_or(180);
    Duration::from_secs(s)
}

/// Run `cmd` (stdin closed, output captured) in a process group of its own; if it has not exited
/// after `limit`, kill the whole group and return an error with what it printed so far.
fn run_with_deadline(mut cmd: Command, limit: Duration) -> Result<Output, String> {
    cmd.process_group(0).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    let pgid = child.id() as libc::pid_t;
    // SAFETY: kill(2) with a negative pid signals our child's own process group and nothing else;
    // it is only called while that group still has members (the child unreaped, or a pipe open).
    let kill_group = || unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    };
    let (tx, rx) = mpsc::channel();
    for (k, pipe) in [
        (0, Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>),
        (1, Box::new(child.stderr.take().unwrap())),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut pipe = pipe;
            let mut buf = Vec::new();
            let _ = pipe.read_to_end(&mut buf);
            let _ = tx.send((k, buf));
        });
    }
    drop(tx);
    let start = Instant::now();
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if start.elapsed() > limit => {
                kill_group();
                timed_out = true;
                break child.wait().map_err(|e| e.to_string())?;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => {
                kill_group();
                return Err(format!("cannot wait for {cmd:?}: {e}"));
            }
        }
    };
    // Left-over processes of the group (ranks) may still hold the pipes: give them a little time
    // to go, then kill them (the group exists as long as they do, so its id cannot have been reused).
    let mut out = [Vec::new(), Vec::new()];
    let grace = Instant::now() + Duration::from_secs(10);
    for _ in 0..2 {
        let got = rx.recv_timeout(grace.saturating_duration_since(Instant::now())).or_else(|_| {
            kill_group();
            timed_out = true;
            rx.recv_timeout(Duration::from_secs(5))
        });
        if let Ok((k, buf)) = got {
            out[k] = buf;
        }
    }
    let [stdout, stderr] = out;
    if timed_out {
        return Err(format!(
            "{cmd:?} did not finish within {limit:?} and was killed with its process group; stderr:\n{}",
            String::from_utf8_lossy(&stderr)
        ));
    }
    Ok(Output { status, stdout, stderr })
}

/// The `collectives` bin with `args`, under the deadline.
fn collectives(args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_collectives"));
    cmd.args(args);
    run_with_deadline(cmd, deadline()).unwrap_or_else(|e| panic!("{e}"))
}

/// Run `collectives` with `args`, which must succeed; its stdout.
fn run_ok(args: &[&str]) -> String {
    let out = collectives(args);
    assert!(out.status.success(), "collectives {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Run `collectives --json` with `args` (and `env`): one JSON object per line.
fn run_json_env(args: &[&str], env: &[(&str, &str)]) -> Vec<serde_json::Value> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_collectives"));
    cmd.args(args).arg("--json").envs(env.iter().copied());
    let out = run_with_deadline(cmd, deadline()).unwrap_or_else(|e| panic!("{e}"));
    assert!(out.status.success(), "collectives {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// Run `collectives --json` with `args`: one JSON object per line.
fn run_json(args: &[&str]) -> Vec<serde_json::Value> {
    run_json_env(args, &[])
}

#[test]
fn json_lines_have_the_nccl_tests_fields() {
    let n = 3;
    // Over TCP, so that the set of algorithms is known (direct needs shared memory).
    let rows = run_json_env(
        &[
            "--backend",
            "tcp",
            "--world-size",
            "3",
            "--ops",
            "all_reduce,broadcast,all_gather,reduce_scatter",
            "--sizes",
            "4K,96K",
            "--algos",
            "all",
            "--iters",
            "3",
            "--warmup",
            "1",
        ],
        &[("SHARDLAB_TRANSPORT", "tcp")],
    );
    // 2 sizes × (2 all_reduce + 3 broadcast + 2 all_gather + 2 reduce_scatter algorithms)
    assert_eq!(rows.len(), 2 * 9);
    for r in &rows {
        for k in ["impl", "op", "algo", "world_size", "bytes", "time_s", "algbw_GBps", "busbw_GBps", "iters", "method"]
        {
            assert!(r.get(k).is_some(), "missing {k} in {r}");
        }
        assert_eq!(r["impl"], "shardlab-tcp");
        assert_eq!(r["world_size"], n);
        // nccl-tests is the default method; the fixed iteration count is what ran.
        assert_eq!(r["method"], "nccl-tests", "{r}");
        assert_eq!(r["iters"], 3, "{r}");
        assert_eq!(r["dtype"], "float32", "{r}");
        assert!(r["threads"].as_u64().unwrap() >= 1, "{r}");
        assert_eq!(r["transport"], "tcp", "{r}");
        let (bytes, t) = (r["bytes"].as_f64().unwrap(), r["time_s"].as_f64().unwrap());
        let algbw = r["algbw_GBps"].as_f64().unwrap();
        assert!(t > 0.0 && ((bytes / t / 1e9) - algbw).abs() <= 1e-9 * algbw.max(1.0));
        let factor = match r["op"].as_str().unwrap() {
            "all_reduce" => 2.0 * (n as f64 - 1.0) / n as f64,
            "all_gather" | "reduce_scatter" => (n as f64 - 1.0) / n as f64,
            "broadcast" => 1.0,
            op => panic!("unexpected op {op}"),
        };
        assert!((r["busbw_GBps"].as_f64().unwrap() - algbw * factor).abs() < 1e-9);
        // 96K of f32 is 24576 elements: divisible by 3, so all ops report the full size.
        assert!(bytes == 4096.0 - 4.0 || bytes == 4096.0 || bytes == 98304.0, "{r}");
    }
}

#[test]
fn the_method_is_chosen_and_reported() {
    let common = ["--world-size", "2", "--ops", "all_reduce", "--sizes", "4K", "--iters", "4", "--warmup", "1"];
    let barrier: Vec<&str> = common.iter().copied().chain(["--method", "barrier"]).collect();
    let rows = run_json(&barrier);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["method"], "barrier");
    // The default algorithm is recorded as what it resolved to, with the data path it used.
    assert!(["direct", "ring"].contains(&rows[0]["algo"].as_str().unwrap()), "{}", rows[0]);
    assert!(["shm", "tcp"].contains(&rows[0]["transport"].as_str().unwrap()), "{}", rows[0]);
    let table = run_ok(&common);
    let header = table.lines().next().unwrap_or_default();
    assert!(header.contains("method: nccl-tests") && header.contains("back to back"), "{table}");
    assert!(table.lines().any(|l| l.starts_with("impl ") && l.contains("time_us")), "{table}");
}

#[test]
fn bad_arguments_are_refused() {
    let cases: [(&[&str], &str); 8] = [
        (&["--ops", "all_to_all"], "all_to_all"),
        (&["--sizes", "12Q"], "12Q"),
        (&["--world-size", "0"], "world-size"),
        (&["--iters", "lots"], "--iters"),
        (&["--iters", "0"], "--iters"),
        (&["--method", "fastest"], "fastest"),
        // One f32 per rank's block at least: otherwise empty tensors would be timed (and Gloo's
        // script would round up to one element).
        (&["--ops", "all_gather", "--world-size", "2", "--sizes", "4"], "too small"),
        // Gloo's ranks are processes over TCP: threads sharing memory are not comparable.
        (&["--backend", "local", "--compare-gloo"], "--backend tcp"),
    ];
    for (args, says) in cases {
        let out = collectives(args);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: the message should mention {says:?}: {err}");
    }
}

#[test]
fn gloo_is_timed_the_same_way_and_its_reduce_scatter_flagged() {
    if !have_python() {
        return;
    }
    let table = run_ok(&[
        "--world-size",
        "2",
        "--ops",
        "all_reduce,reduce_scatter",
        "--sizes",
        "64K",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--method",
        "barrier",
        "--compare-gloo",
        "--transport",
        "tcp",
    ]);
    assert!(table.lines().next().unwrap_or_default().contains("method: barrier"), "{table}");
    // Both sides over TCP, whatever this machine would otherwise use between our ranks.
    assert!(table.lines().any(|l| l == "# data path: shardlab-tcp tcp, gloo tcp"), "{table}");
    assert!(!table.contains("data paths differ"), "{table}");
    let row = |imp: &str, op: &str| {
        table
            .lines()
            .find(|l| l.split_whitespace().take(2).eq([imp, op]))
            .unwrap_or_else(|| panic!("no {imp} {op} row in\n{table}"))
    };
    // Our rows carry the ratio; the reduce_scatter one says what Gloo really ran.
    assert!(row("shardlab-tcp", "all_reduce").contains('x'), "{table}");
    assert!(!row("shardlab-tcp", "all_reduce").contains("emulation"), "{table}");
    let rs = row("shardlab-tcp", "reduce_scatter");
    assert!(rs.contains("all_reduce emulation (reduce_scatter_tensor)"), "{table}");
    assert!(row("gloo", "reduce_scatter").contains("call reduce_scatter_tensor = an all_reduce"), "{table}");
    assert!(row("gloo", "all_reduce").contains("call all_reduce"), "{table}");
}

#[test]
fn a_stalled_benchmark_is_killed_at_the_deadline() {
    // A "benchmark" that never finishes and leaves a grandchild holding its output pipe.
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "sleep 300 & echo started; sleep 300"]);
    let t = Instant::now();
    let err = run_with_deadline(cmd, Duration::from_secs(1)).expect_err("must time out");
    assert!(err.contains("did not finish"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(30), "took {:?}", t.elapsed());
}

#[test]
fn shared_memory_against_gloo_says_the_data_paths_differ() {
    if !have_python() {
        return;
    }
    let table = run_ok(&[
        "--world-size",
        "2",
        "--ops",
        "all_reduce",
        "--sizes",
        "64K",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--compare-gloo",
        "--transport",
        "shm",
    ]);
    // Gloo has no shared-memory transport: the rows and the header say what each side ran.
    assert!(table.lines().any(|l| l == "# data path: shardlab-shm shm, gloo tcp"), "{table}");
    assert!(table.contains("# data paths differ"), "{table}");
    assert!(table.lines().any(|l| l.starts_with("shardlab-shm") && l.contains("direct") && l.contains('x')), "{table}");
}

/// The project's Python (with PyTorch, for the Gloo side); says so when a test is skipped.
fn have_python() -> bool {
    let py = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    if !py.exists() {
        eprintln!("skipped: {} not found (run `bash .ci/setup`)", py.display());
    }
    py.exists()
}
