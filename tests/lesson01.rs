//! Grader for lesson 01 (process groups & rendezvous).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/01_process_groups/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 01` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong.

#[path = "../lessons/01_process_groups/exercise.rs"]
mod exercise_code;
#[path = "../solutions/01_process_groups.rs"]
mod solution_code;

use shardlab::comm::auth::Secret;
use shardlab::comm::store::{StoreClient, StoreServer};
use std::time::{Duration, Instant};

shardlab::graders! {
    lesson: "01", exercise_file: "lessons/01_process_groups/exercise.rs";

    #[test]
    fn ex1_dial_plan_connects_every_pair_once_without_deadlock() {
        for n in 1..=9 {
            let plans: Vec<(Vec<usize>, Vec<usize>)> = (0..n).map(|r| dial_plan(r, n)).collect();
            let mut dialed = vec![vec![false; n]; n];
            for (r, (dial, accept)) in plans.iter().enumerate() {
                for list in [dial, accept] {
                    assert!(
                        list.windows(2).all(|w| w[0] < w[1]),
                        "n={n}: rank {r}'s lists must be increasing: {dial:?} {accept:?}"
                    );
                    assert!(
                        list.iter().all(|&p| p < n && p != r),
                        "n={n}: rank {r} lists itself or a rank ≥ {n}: {list:?}"
                    );
                }
                for &p in dial {
                    assert!(plans[p].1.contains(&r), "n={n}: rank {r} dials {p}, but rank {p} does not accept from {r}");
                    assert!(!dialed[r][p] && !dialed[p][r], "n={n}: the pair ({r}, {p}) is connected twice");
                    dialed[r][p] = true;
                }
                for &p in accept {
                    assert!(plans[p].0.contains(&r), "n={n}: rank {r} waits for {p}, but rank {p} never dials {r}");
                }
            }
            for a in 0..n {
                for b in a + 1..n {
                    assert!(dialed[a][b] || dialed[b][a], "n={n}: ranks {a} and {b} are never connected");
                }
            }
            // No cycle of "a dials b": otherwise some ranks could wait on each other for ever.
            let mut indeg: Vec<usize> = (0..n).map(|b| (0..n).filter(|&a| dialed[a][b]).count()).collect();
            let mut done = 0;
            let mut ready: Vec<usize> = (0..n).filter(|&b| indeg[b] == 0).collect();
            while let Some(a) = ready.pop() {
                done += 1;
                for b in 0..n {
                    if dialed[a][b] {
                        indeg[b] -= 1;
                        if indeg[b] == 0 {
                            ready.push(b);
                        }
                    }
                }
            }
            assert_eq!(done, n, "n={n}: the dial graph has a cycle, so ranks can wait on each other for ever");
        }
    }

    /// The store's secret in these tests (a real job's comes from `SHARDLAB_SECRET` or `spawn`).
    fn secret() -> Secret {
        Secret::derived_from_job_id("lesson01")
    }

    fn store() -> (StoreServer, String) {
        let s = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "lesson01", &secret()).unwrap();
        let a = s.addr().to_string();
        (s, a)
    }

    fn client(addr: &str) -> StoreClient {
        StoreClient::connect(addr, "lesson01", &secret(), Duration::from_secs(5)).unwrap()
    }

    #[test]
    fn ex2_exchange_addresses_returns_everyone_in_rank_order() {
        let (_server, addr) = store();
        let n = 4;
        let got: Vec<Result<Vec<String>, String>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|r| {
                    let addr = addr.clone();
                    s.spawn(move || {
                        std::thread::sleep(Duration::from_millis(30 * (n - r) as u64)); // arrive in any order
                        exchange_addresses(
                            &mut client(&addr),
                            r,
                            n,
                            &format!("10.0.0.{r}:{}", 4000 + r),
                            Duration::from_secs(5),
                        )
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want: Vec<String> = (0..n).map(|r| format!("10.0.0.{r}:{}", 4000 + r)).collect();
        for (r, g) in got.into_iter().enumerate() {
            assert_eq!(g.as_ref(), Ok(&want), "rank {r} got the wrong address list");
        }
    }

    #[test]
    fn ex2_exchange_addresses_names_missing_ranks() {
        let (_server, addr) = store();
        let t = Instant::now();
        // World of 5, but ranks 1, 3 and 4 never come.
        let got: Vec<Result<Vec<String>, String>> = std::thread::scope(|s| {
            let hs: Vec<_> = [0usize, 2]
                .into_iter()
                .map(|r| {
                    let addr = addr.clone();
                    s.spawn(move || exchange_addresses(&mut client(&addr), r, 5, "x:1", Duration::from_millis(600)))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let took = t.elapsed();
        assert!(
            took < Duration::from_millis(1200),
            "waited {took:?}: the 600 ms timeout is for all missing ranks together, not each"
        );
        for g in got {
            let e = g.expect_err("a missing rank must be an error, not a shorter list");
            assert!(e.contains("[1, 3, 4]"), "the error should name the missing ranks [1, 3, 4]: {e}");
        }
    }

    #[test]
    fn ex3_store_barrier_releases_nobody_early() {
        let (_server, addr) = store();
        let n = 4;
        for round in 0..3 {
            let start = Instant::now();
            let times: Vec<(Duration, Duration)> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..n)
                    .map(|r| {
                        let addr = addr.clone();
                        s.spawn(move || {
                            let mut c = client(&addr);
                            std::thread::sleep(Duration::from_millis(40 * r as u64));
                            let arrived = start.elapsed();
                            store_barrier(&mut c, &format!("round{round}"), r, n, Duration::from_secs(5)).unwrap();
                            (arrived, start.elapsed())
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let last_arrival = times.iter().map(|t| t.0).max().unwrap();
            for (r, (_, left)) in times.iter().enumerate() {
                assert!(
                    *left >= last_arrival,
                    "round {round}: rank {r} left at {left:?}, before the last rank arrived at {last_arrival:?}"
                );
            }
        }
    }

    #[test]
    fn ex3_store_barrier_names_missing_ranks() {
        let (_server, addr) = store();
        let got: Vec<Result<(), String>> = std::thread::scope(|s| {
            let hs: Vec<_> = [0usize, 2, 3]
                .into_iter()
                .map(|r| {
                    let addr = addr.clone();
                    s.spawn(move || store_barrier(&mut client(&addr), "b", r, 4, Duration::from_millis(500)))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for g in got {
            let e = g.expect_err("a barrier with a missing rank must time out with an error");
            assert!(e.contains("[1]"), "the error should name the missing rank 1: {e}");
        }
    }
}
