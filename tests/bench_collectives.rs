//! The `collectives` benchmark bin end to end: real processes over TCP, one JSON object per line
//! with the nccl-tests fields, busbw derived from algbw by the documented factors.

use std::process::Command;

fn run(args: &[&str]) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_collectives")).args(args).output().expect("run collectives");
    assert!(out.status.success(), "collectives failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

#[test]
fn json_lines_have_the_nccl_tests_fields() {
    let n = 3;
    let rows = run(&[
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
        "--json",
    ]);
    // 2 sizes × (2 all_reduce + 3 broadcast + 2 all_gather + 2 reduce_scatter algorithms)
    assert_eq!(rows.len(), 2 * 9);
    for r in &rows {
        for k in ["impl", "op", "algo", "world_size", "bytes", "median_s", "algbw_GBps", "busbw_GBps"] {
            assert!(r.get(k).is_some(), "missing {k} in {r}");
        }
        assert_eq!(r["impl"], "shardlab-tcp");
        assert_eq!(r["world_size"], n);
        let (bytes, t) = (r["bytes"].as_f64().unwrap(), r["median_s"].as_f64().unwrap());
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
fn bad_arguments_are_refused() {
    for args in [&["--ops", "all_to_all"][..], &["--sizes", "12Q"], &["--world-size", "0"], &["--iters", "lots"]] {
        let out = Command::new(env!("CARGO_BIN_EXE_collectives")).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(!String::from_utf8_lossy(&out.stderr).trim().is_empty(), "{args:?}: no message");
    }
}
