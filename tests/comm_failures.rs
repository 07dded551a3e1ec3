//! Every failure is an error on every rank — never a hang, never a panic, never a wrong number:
//! bad arguments, port in use, rendezvous timeout, ranks that disagree (size, dtype, order, root),
//! a silent peer, a panicking or killed peer, strangers and garbage on the store port.

use shardlab::comm::auth::Secret;
use shardlab::comm::store::{StoreClient, StoreServer};
use shardlab::prelude::*;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(20);

fn cfg(timeout: Duration) -> CommConfig {
    CommConfig::default().with_timeout(timeout)
}

/// Every way ranks can talk: threads; processes over TCP frames; processes sharing memory
/// (frames through shared-memory rings, and the direct algorithms by default).
const SETUPS: [(Backend, DataPath); 3] =
    [(Backend::Local, DataPath::Auto), (Backend::Tcp, DataPath::Tcp), (Backend::Tcp, DataPath::Shm)];

/// Run `f` on `n` thread ranks of `backend` (with spawn's end-of-job check); every rank's
/// outcome, plus how long it took.
fn run<F>(
    (backend, path): (Backend, DataPath),
    n: usize,
    timeout: Duration,
    f: F,
) -> (Vec<Result<(), String>>, Duration)
where
    F: Fn(&ProcessGroup) -> CommResult<()> + Send + Sync,
{
    let t = Instant::now();
    let config = CommConfig { transport: path, ..cfg(timeout) };
    let opts = SpawnOptions::new(n, backend).launch(Launch::Threads).config(config);
    let out = match spawn_with(opts, |pg| Ok(f(pg)?)) {
        Ok(_) => vec![Ok(()); n],
        Err(e) => (0..n).map(|r| e.failures.iter().find(|f| f.0 == r).map_or(Ok(()), |f| Err(f.1.clone()))).collect(),
    };
    (out, t.elapsed())
}

/// All ranks failed, quickly (long before the peer timeout), and at least one says `needle`.
fn assert_all_fail_fast(res: &[Result<(), String>], took: Duration, needle: &str) {
    assert!(res.iter().all(|r| r.is_err()), "every rank must fail, got {res:?}");
    assert!(took < TIMEOUT / 2, "failure took {took:?}: ranks waited for the timeout instead of being told");
    assert!(res.iter().any(|r| r.as_ref().unwrap_err().contains(needle)), "no rank mentions {needle:?}: {res:?}");
}

fn f32s(n: i64) -> Tensor {
    Tensor::ones([n], (Kind::Float, Device::Cpu))
}

#[test]
fn world_size_zero_and_rank_out_of_range() {
    assert!(matches!(ProcessGroup::local_world(0, CommConfig::default()), Err(CommError::InvalidArgument(_))));
    assert!(spawn(0, Backend::Local, |_| Ok(())).unwrap_err().to_string().contains("world_size"));
    let init = |rank, world_size| TcpInit {
        rank,
        world_size,
        master_addr: "127.0.0.1".into(),
        master_port: 1,
        local_rank: 0,
        local_world_size: 1,
    };
    let e = ProcessGroup::init_tcp(&init(0, 0), CommConfig::default()).err().unwrap();
    assert!(matches!(e, CommError::InvalidArgument(_)), "{e}");
    let e = ProcessGroup::init_tcp(&init(2, 2), CommConfig::default()).err().unwrap();
    assert!(e.to_string().contains("RANK 2 is out of range for WORLD_SIZE 2"), "{e}");
}

#[test]
fn port_in_use_is_a_clear_error() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    let init = TcpInit {
        rank: 0,
        world_size: 1,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        local_rank: 0,
        local_world_size: 1,
    };
    let e = ProcessGroup::init_tcp(&init, CommConfig::default()).err().unwrap();
    assert!(matches!(e, CommError::Rendezvous(_)) && e.to_string().contains(&port.to_string()), "{e}");
}

#[test]
fn rendezvous_times_out_with_names() {
    let port = shardlab::launch::free_port().unwrap();
    let c = CommConfig { rendezvous_timeout: Duration::from_millis(800), ..CommConfig::default() };
    // Rank 1 alone: nobody hosts the store.
    let t = Instant::now();
    let init = |rank| TcpInit {
        rank,
        world_size: 2,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        local_rank: rank,
        local_world_size: 2,
    };
    let e = ProcessGroup::init_tcp(&init(1), c.clone()).err().unwrap();
    assert!(e.to_string().contains("could not reach the store"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5));
    // Rank 0 alone: it hosts the store, but rank 1 never connects.
    let e = ProcessGroup::init_tcp(&init(0), c).err().unwrap();
    assert!(e.to_string().contains("[1] did not connect"), "{e}");
}

#[test]
fn mismatched_sizes_dtypes_order_and_roots_fail_on_every_rank() {
    for backend in SETUPS {
        let direct = backend.1 == DataPath::Shm;
        // Size: rank 1 has one element more.
        let (res, took) =
            run(backend, 3, TIMEOUT, |pg| pg.all_reduce(&mut f32s(1000 + (pg.rank() == 1) as i64), ReduceOp::Sum));
        assert_all_fail_fast(&res, took, "1001");
        // Dtype: rank 0 uses f64.
        let (res, took) = run(backend, 3, TIMEOUT, |pg| {
            let mut t = if pg.rank() == 0 { f32s(64).to_kind(Kind::Double) } else { f32s(64) };
            pg.all_reduce(&mut t, ReduceOp::Sum)
        });
        assert_all_fail_fast(&res, took, "f64");
        // Order: rank 2 runs all_gather where the others run all_reduce.
        let (res, took) = run(backend, 3, TIMEOUT, |pg| {
            if pg.rank() == 2 {
                pg.all_gather(&mut f32s(3 * 64), &f32s(64))
            } else {
                pg.all_reduce(&mut f32s(64), ReduceOp::Sum)
            }
        });
        assert_all_fail_fast(&res, took, "all_gather");
        // Root: rank 1 thinks the root is 1. With frames, they reach ranks that expect nothing from
        // it in this broadcast, so the disagreement surfaces at the next collective that reads
        // them… (the direct algorithm compares the ranks' op descriptions at once.)
        let (res, took) = run(backend, 3, TIMEOUT, |pg| {
            pg.broadcast(&mut f32s(10), if pg.rank() == 1 { 1 } else { 0 })?;
            pg.all_reduce(&mut f32s(10), ReduceOp::Sum)
        });
        assert_all_fail_fast(&res, took, "broadcast #");
        // …or, if nothing reads them, at the end-of-job check.
        let (res, took) =
            run(backend, 3, TIMEOUT, |pg| pg.broadcast(&mut f32s(10), if pg.rank() == 1 { 1 } else { 0 }));
        assert_all_fail_fast(
            &res,
            took,
            if direct { "runs broadcast #1 (10 × f32, root 1" } else { "sent data for broadcast #" },
        );
        // A message nobody receives (rank 1 → rank 2) is caught by the end-of-job check (its
        // first barrier finds it waiting: "rank 1 sent it a message first").
        let (res, took) = run(backend, 3, TIMEOUT, |pg| if pg.rank() == 1 { pg.send(&f32s(10), 2) } else { Ok(()) });
        assert_all_fail_fast(&res, took, "send/recv #0 (10 × f32, from rank 1");
        // Algorithm: rank 0 runs naive, the others ring.
        let (res, took) = run(backend, 2, TIMEOUT, |pg| {
            let algo = if pg.rank() == 0 { Algo::Naive } else { Algo::Ring };
            pg.all_reduce_with(&mut f32s(10), ReduceOp::Sum, algo)
        });
        assert_all_fail_fast(&res, took, "algo");
        if direct {
            // Shared memory: one rank reads its peers' buffers (direct) while the others send
            // frames (ring).
            for n in [2, 3] {
                let (res, took) = run(backend, n, TIMEOUT, |pg| {
                    let algo = if pg.rank() == 1 { Algo::Direct } else { Algo::Ring };
                    pg.all_reduce_with(&mut f32s(1 << 16), ReduceOp::Sum, algo)
                });
                assert_all_fail_fast(&res, took, "algo direct");
            }
        }
    }
}

/// A message and a collective called in different orders on the two ranks of the message is a
/// mismatch on every data path, whether the message fits the link (it would pass unchecked) or
/// not (the sender would block in it while its peer waits in the collective: both hang). The
/// right order passes, also where a broadcast's leaf finishes first and sends at once.
#[test]
fn send_and_collective_in_different_orders_fail_on_every_rank() {
    for backend in SETUPS {
        for n in [2, 3] {
            // 100 floats fit every link; 1 Mi floats (4 MiB) fill a shared-memory ring (2 MiB)
            // and the loopback socket's buffers.
            for numel in [100, 1 << 20] {
                let last = n - 1;
                let (res, took) = run(backend, n, TIMEOUT, |pg| {
                    let mut t = f32s(numel);
                    if pg.rank() == 0 {
                        pg.send(&t, last)?;
                    }
                    pg.all_reduce(&mut f32s(1000), ReduceOp::Sum)?;
                    if pg.rank() == last {
                        pg.recv(&mut t, 0)?;
                    }
                    Ok(())
                });
                println!("{backend:?} n={n} numel={numel}: send first on rank 0: {took:?} {res:?}");
                assert_all_fail_fast(&res, took, "different orders");
            }
        }
        // The other way round: the receiver enters the message first, the sender the collective.
        let (res, took) = run(backend, 2, TIMEOUT, |pg| {
            let mut t = f32s(100);
            if pg.rank() == 1 {
                pg.recv(&mut t, 0)?;
            }
            pg.all_reduce(&mut f32s(1000), ReduceOp::Sum)?;
            if pg.rank() == 0 {
                pg.send(&t, 1)?;
            }
            Ok(())
        });
        println!("{backend:?}: recv first on rank 1: {took:?} {res:?}");
        assert_all_fail_fast(&res, took, "all_reduce");
        // Right orders pass: a message between the same collectives on both ranks; rank 1, a
        // leaf of the broadcast, sends as soon as its part is done.
        let (res, _) = run(backend, 3, TIMEOUT, |pg| {
            let mut t = f32s(1 << 20);
            pg.all_reduce(&mut f32s(1000), ReduceOp::Sum)?;
            match pg.rank() {
                0 => pg.send(&t, 2)?,
                2 => pg.recv(&mut t, 0)?,
                _ => {}
            }
            pg.broadcast(&mut f32s(1000), 0)?;
            match pg.rank() {
                1 => pg.send(&t, 2)?,
                2 => pg.recv(&mut t, 1)?,
                _ => {}
            }
            pg.all_reduce(&mut f32s(1000), ReduceOp::Sum)
        });
        assert!(res.iter().all(|r| r.is_ok()), "{backend:?}: messages between the same collectives: {res:?}");
    }
}

#[test]
fn bad_tensor_on_one_rank_fails_every_rank() {
    for backend in SETUPS {
        let (res, took) = run(backend, 2, TIMEOUT, |pg| {
            let mut t = if pg.rank() == 0 { Tensor::ones([4], (Kind::Int, Device::Cpu)) } else { f32s(4) };
            pg.all_reduce(&mut t, ReduceOp::Sum)
        });
        assert_all_fail_fast(&res, took, "not supported");
        let (res, took) = run(backend, 2, TIMEOUT, |pg| {
            let mut t = if pg.rank() == 1 { f32s(8).view([2, 4]).transpose(0, 1) } else { f32s(8) };
            pg.all_reduce(&mut t, ReduceOp::Sum)
        });
        assert_all_fail_fast(&res, took, "contiguous");
        let (res, took) = run(backend, 2, TIMEOUT, |pg| {
            pg.all_reduce(&mut Tensor::ones([4], (Kind::Int64, Device::Cpu)), ReduceOp::Avg)
        });
        assert_all_fail_fast(&res, took, "Avg");
        let (res, took) = run(backend, 2, TIMEOUT, |pg| pg.all_gather(&mut f32s(5), &f32s(2)));
        assert_all_fail_fast(&res, took, "world_size");
        let (res, took) = run(backend, 2, TIMEOUT, |pg| {
            let mut out = f32s(8);
            let input = out.narrow(0, 4 * pg.rank() as i64, 4); // a view of out: not supported
            pg.all_gather(&mut out, &input)
        });
        assert_all_fail_fast(&res, took, "share memory");
        let (res, took) = run(backend, 2, TIMEOUT, |pg| pg.broadcast(&mut f32s(5), 7));
        assert_all_fail_fast(&res, took, "out of range");
    }
}

#[test]
fn silent_peer_times_out_and_group_stays_poisoned() {
    for (backend, path) in SETUPS {
        let timeout = Duration::from_millis(500);
        let t = Instant::now();
        let config = CommConfig { transport: path, ..cfg(timeout) };
        let e = spawn_with(SpawnOptions::new(3, backend).launch(Launch::Threads).config(config), |pg| {
            if pg.rank() == 2 {
                std::thread::sleep(Duration::from_millis(1500)); // misses the collective
            }
            let first = pg.all_reduce(&mut f32s(100), ReduceOp::Sum);
            let second = pg.barrier();
            anyhow::ensure!(first.is_err() && second.is_err(), "rank {}: {first:?} then {second:?}", pg.rank());
            Err::<(), _>(anyhow::anyhow!("first: {} | then: {}", first.unwrap_err(), second.unwrap_err()))
        })
        .unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(10));
        assert_eq!(e.failures.len(), 3, "{backend:?} {path:?}: {e}");
        for (r, msg) in &e.failures {
            assert!(msg.starts_with("first: ") && msg.contains(" | then: "), "{backend:?} {path:?} rank {r}: {msg}");
        }
        assert!(e.to_string().contains("timed out"), "{backend:?} {path:?}: {e}");
    }
}

#[test]
fn panicking_rank_is_reported_and_the_others_are_released() {
    for (backend, path) in SETUPS {
        let t = Instant::now();
        let config = CommConfig { transport: path, ..cfg(TIMEOUT) };
        let e = spawn_with(SpawnOptions::new(3, backend).launch(Launch::Threads).config(config), |pg| {
            pg.all_reduce(&mut f32s(10), ReduceOp::Sum)?;
            if pg.rank() == 1 {
                panic!("boom in rank 1");
            }
            pg.all_reduce(&mut f32s(10), ReduceOp::Sum)?;
            Ok(())
        })
        .unwrap_err();
        assert!(t.elapsed() < TIMEOUT / 2, "{backend:?} {path:?}: survivors waited for the timeout");
        assert_eq!(e.failures.len(), 3, "{e}");
        assert!(e.to_string().contains("rank 1: panicked: boom in rank 1"), "{e}");
    }
}

fn child_args(test: &str) -> Vec<String> {
    vec!["--exact".into(), test.into(), "--nocapture".into(), "--test-threads=1".into()]
}

#[test]
fn processes_rank_killed_mid_collective() {
    let t = Instant::now();
    let opts = SpawnOptions::new(3, Backend::Tcp)
        .config(cfg(TIMEOUT))
        .child_args(child_args("processes_rank_killed_mid_collective"));
    let e = spawn_with(opts, |pg| {
        let big = f32s(4 << 20); // 16 MiB: many chunks in flight when the rank dies
        pg.all_reduce(&mut f32s(8), ReduceOp::Sum)?;
        if pg.rank() == 2 {
            let _w = pg.all_reduce_async(big.copy(), ReduceOp::Sum)?;
            std::thread::sleep(Duration::from_millis(20));
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        for _ in 0..50 {
            pg.all_reduce(&mut big.shallow_clone(), ReduceOp::Sum)?;
        }
        Ok(())
    })
    .unwrap_err();
    assert!(t.elapsed() < TIMEOUT, "took {:?}", t.elapsed());
    let text = e.to_string();
    assert_eq!(e.failures.len(), 3, "{text}");
    assert!(text.contains("rank 2: process exited with signal: 9"), "{text}");
    assert!(text.contains("disconnected") || text.contains("aborted"), "{text}");
}

#[test]
fn processes_spawn_collects_results_in_rank_order() {
    let opts = SpawnOptions::new(3, Backend::Tcp)
        .config(cfg(TIMEOUT))
        .child_args(child_args("processes_spawn_collects_results_in_rank_order"));
    let out = spawn_with(opts, |pg| {
        let mut t = Tensor::from_slice(&[pg.rank() as f32 + 1.0]);
        pg.all_reduce(&mut t, ReduceOp::Sum)?;
        Ok((pg.rank(), std::process::id(), t.double_value(&[0])))
    })
    .unwrap();
    assert_eq!(out.iter().map(|o| o.0).collect::<Vec<_>>(), vec![0, 1, 2]);
    assert!(out.iter().all(|o| o.2 == 6.0), "{out:?}");
    let mut pids: Vec<u32> = out.iter().map(|o| o.1).collect();
    pids.dedup();
    assert_eq!(pids.len(), 3, "each rank is its own process");
    assert!(!pids.contains(&std::process::id()));
}

#[test]
fn processes_rank_error_is_reported() {
    let opts = SpawnOptions::new(2, Backend::Tcp)
        .config(cfg(TIMEOUT))
        .child_args(child_args("processes_rank_error_is_reported"));
    let e = spawn_with(opts, |pg| {
        if pg.rank() == 0 {
            anyhow::bail!("rank 0 refuses");
        }
        pg.barrier()?;
        Ok(())
    })
    .unwrap_err();
    let text = e.to_string();
    assert!(text.contains("rank 0: rank 0 refuses"), "{text}");
    assert!(text.contains("rank 1:"), "{text}");
}

#[test]
fn store_rejects_strangers_other_jobs_and_garbage() {
    let secret = Secret::generate().unwrap();
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "job-a", &secret).unwrap();
    let addr = server.addr().to_string();
    // Another job is refused, and so is a process that does not know the job's secret: at once,
    // with an error that says which.
    let t = Instant::now();
    let e = StoreClient::connect(&addr, "job-b", &secret, Duration::from_secs(2)).err().unwrap();
    assert!(matches!(e, CommError::Auth(_)) && e.to_string().contains("another job"), "{e}");
    let e = StoreClient::connect(&addr, "job-a", &Secret::generate().unwrap(), Duration::from_secs(2)).err().unwrap();
    assert!(matches!(e, CommError::Auth(_)) && e.to_string().contains("SHARDLAB_SECRET"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2), "refusals must not wait for the timeout");
    // Garbage: random bytes, a valid request magic with absurd lengths, a request before the
    // handshake, a hang-up. The store reads no request before authentication: it answers nothing
    // and closes the connection.
    let payloads: Vec<Vec<u8>> = vec![
        (0..4096u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect(),
        [0x52, 0x4f, 0x54, 0x53, 2, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f].to_vec(),
        [0x52, 0x4f, 0x54, 0x53, 2, 1, 0, 1, 0, 0, 0, b'k', b'v'].to_vec(),
        Vec::new(),
    ];
    for p in payloads {
        let t = Instant::now();
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(&p);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut buf = [0u8; 64];
        let mut total = 0;
        while let Ok(k) = s.read(&mut buf) {
            if k == 0 {
                break;
            }
            total += k;
        }
        assert_eq!(total, 0, "the store talked to a stranger");
        assert!(t.elapsed() < Duration::from_secs(6), "a stranger's connection stayed open {:?}", t.elapsed());
    }
    assert!(server.stats().authenticated_total == 0 && server.stats().keys == 0, "{:?}", server.stats());
    // The store still works for its own job.
    let mut c = StoreClient::connect(&addr, "job-a", &secret, Duration::from_secs(2)).unwrap();
    c.set("k", b"v").unwrap();
    assert_eq!(c.get("k", Duration::from_secs(1)).unwrap().as_deref(), Some(&b"v"[..]));
    assert_eq!(c.get("missing", Duration::from_millis(50)).unwrap(), None);
    assert_eq!(c.add("n", 2).unwrap(), 2);
    assert_eq!(c.add("n", 3).unwrap(), 5);
}

/// Ranks started by hand (torchrun's variables, no `SHARDLAB_SECRET`) on one machine: rank 0
/// draws a fresh secret for the run and leaves it in a private file for the others, removed once
/// the group has formed — not one derived from the job id, which anyone who knows the id could
/// compute. Ranks that do not share the file (another runtime directory) fail with a message
/// saying what to export.
#[test]
fn env_init_reads_torchrun_variables() {
    // Exercised through a child process so the test harness's own environment stays clean.
    let exe = std::env::current_exe().unwrap();
    let runtime = |tag: &str| {
        let d = std::env::temp_dir().join(format!("shardlab-xdg-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    };
    let (shared, elsewhere) = (runtime("a"), runtime("b"));
    let child = |rank: usize, port: u16, xdg: &std::path::Path| {
        std::process::Command::new(&exe)
            .args(["--exact", "env_init_child", "--ignored", "--nocapture", "--test-threads=1"])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("SHARDLAB_JOB_ID", "env-test")
            .env("SHARDLAB_TEST_CHILD", "1")
            .env("SHARDLAB_RDZV_TIMEOUT_S", "3")
            .env("XDG_RUNTIME_DIR", xdg)
            .env_remove("SHARDLAB_SECRET")
            .output()
            .unwrap()
    };
    let pair_on = |port: u16, dirs: [&std::path::Path; 2]| {
        std::thread::scope(|s| {
            let a = s.spawn(|| child(0, port, dirs[0]));
            let b = s.spawn(|| child(1, port, dirs[1]));
            [a.join().unwrap(), b.join().unwrap()]
        })
    };
    let pair = |dirs: [&std::path::Path; 2]| pair_on(shardlab::launch::free_port().unwrap(), dirs);
    let outs = pair([&shared, &shared]);
    let derived = shardlab::comm::auth::Secret::derived_from_job_id("env-test").to_hex();
    let mut secrets = Vec::new();
    for (r, o) in outs.iter().enumerate() {
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success() && out.contains(&format!("env-rank {r} of 2 sum 3")),
            "rank {r}: {out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let hex = out.split("secret ").nth(1).and_then(|t| t.split_whitespace().next()).unwrap().to_string();
        assert_ne!(hex, derived, "rank {r} used the secret anyone can derive from the job id");
        secrets.push(hex);
    }
    assert_eq!(secrets[0], secrets[1], "both ranks hold the run's secret");
    let left: Vec<_> = std::fs::read_dir(shared.join("shardlab")).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "rank 0 removes the secret's file once the group has formed: {left:?}");
    // A second run draws another secret.
    let again = pair([&shared, &shared]);
    for (r, o) in again.iter().enumerate() {
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "second run, rank {r}: {out}\n{}", String::from_utf8_lossy(&o.stderr));
        let hex = out.split("secret ").nth(1).and_then(|t| t.split_whitespace().next()).unwrap();
        assert!(hex.len() == 64 && hex != secrets[0], "rank {r}: a fresh secret per run, got {hex}");
    }
    // A file left by an earlier run on the same job id and port (another secret; its writer, this
    // test's process, still runs) does not stop the group: rank 1 reads again when the store
    // refuses it.
    let port = shardlab::launch::free_port().unwrap();
    let name: String = {
        use sha2::Digest;
        sha2::Sha256::digest(format!("env-test\0{port}").as_bytes())[..8].iter().map(|b| format!("{b:02x}")).collect()
    };
    let started = std::fs::read_to_string("/proc/self/stat").unwrap();
    let started = started.rsplit_once(')').unwrap().1.split_whitespace().nth(19).unwrap().to_string();
    let ns = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata("/proc/self/ns/pid").unwrap());
    let stale = shared.join("shardlab").join(format!("rdzv-{name}"));
    std::fs::write(&stale, format!("{} {started} {ns} {}\n", std::process::id(), "ab".repeat(32))).unwrap();
    let outs = pair_on(port, [&shared, &shared]);
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "stale file, rank {r}: {}", String::from_utf8_lossy(&o.stderr));
    }
    assert!(!stale.exists(), "rank 0's file replaced the stale one and was removed");
    // No shared file system: rank 1 cannot find the secret and says what to do.
    let t = std::time::Instant::now();
    let split = pair([&shared, &elsewhere]);
    let err = String::from_utf8_lossy(&split[1].stderr);
    assert!(!split[1].status.success() && err.contains("SHARDLAB_SECRET"), "{err}");
    assert!(!split[0].status.success() && t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    let _ = std::fs::remove_dir_all(&shared);
    let _ = std::fs::remove_dir_all(&elsewhere);
}

#[test]
#[ignore = "child process of env_init_reads_torchrun_variables"]
fn env_init_child() {
    if std::env::var("SHARDLAB_TEST_CHILD").is_err() {
        return;
    }
    let pg = ProcessGroup::from_env(CommConfig::default().with_timeout(Duration::from_secs(10))).unwrap();
    let mut t = Tensor::from_slice(&[pg.rank() as f32 + 1.0]);
    pg.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    let secret = pg.config().secret.as_ref().map(|s| s.to_hex()).unwrap_or_default();
    println!("env-rank {} of {} sum {} secret {secret}", pg.rank(), pg.world_size(), t.double_value(&[0]));
}
