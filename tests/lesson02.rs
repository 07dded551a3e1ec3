//! Grader for lesson 02 (point-to-point & broadcast).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/02_p2p_broadcast/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 02` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong.

#[path = "../lessons/02_p2p_broadcast/exercise.rs"]
mod exercise_code;
#[path = "../solutions/02_p2p_broadcast.rs"]
mod solution_code;

use shardlab::prelude::*;
use std::time::Duration;

shardlab::graders! {
    lesson: "02", exercise_file: "lessons/02_p2p_broadcast/exercise.rs";

    /// shardlab's own copies of what each exercise builds (exercise K: `TWINS[K - 1]`): an exercise
    /// that names one is refused ("write it yourself").
    const TWINS: &[&[&str]] = &[&["comm::binomial_tree"], &["broadcast_with", "broadcast_async", "broadcast_params", "comm::binomial_tree", ".broadcast"], &[]];

    fn opts(n: usize, backend: Backend) -> SpawnOptions {
        let cfg = CommConfig { chunk_bytes: 64 << 10, ..CommConfig::default() }.with_timeout(Duration::from_secs(20));
        SpawnOptions::new(n, backend).launch(Launch::Threads).config(cfg)
    }

    #[test]
    fn ex1_tree_links_form_a_binomial_tree() {
        shardlab::grading::refuse_twins(GRADER, 1, TWINS[0]);
        for n in 1..=33 {
            let mut parents = vec![0usize; n];
            for v in 0..n {
                let (parent, children) = tree_links(v, n);
                assert_eq!(parent.is_none(), v == 0, "n={n}: only v=0 (the root) has no parent; v={v} got {parent:?}");
                for &c in &children {
                    assert!(c > v && c < n, "n={n}: child {c} of {v} must be in ({v}, {n})");
                    assert_eq!(tree_links(c, n).0, Some(v), "n={n}: {v} lists child {c}, but {c}'s parent is not {v}");
                    parents[c] += 1;
                }
                // biggest subtree first = children in decreasing order
                assert!(
                    children.windows(2).all(|w| w[0] > w[1]),
                    "n={n}: children of {v} should be biggest-subtree first: {children:?}"
                );
            }
            assert!(parents[1..].iter().all(|&p| p == 1), "n={n}: every rank but the root must have exactly one parent");
            let depth = |mut v: usize| {
                let mut d = 0;
                while let Some(p) = tree_links(v, n).0 {
                    v = p;
                    d += 1;
                    assert!(d <= n, "n={n}: parent links loop");
                }
                d
            };
            let max = (0..n).map(depth).max().unwrap();
            let bound = (n as f64).log2().ceil() as usize;
            assert!(max <= bound, "n={n}: tree depth {max} exceeds ⌈log2 n⌉ = {bound}");
        }
    }

    #[test]
    fn ex2_tree_broadcast_delivers_the_roots_tensor_along_the_tree() {
        shardlab::grading::refuse_twins(GRADER, 2, TWINS[1]);
        for backend in [Backend::Local, Backend::Tcp] {
            for n in 1..=5 {
                let res = spawn_with(opts(n, backend), |pg| {
                    let mut bad = Vec::new();
                    for root in 0..pg.world_size() {
                        for numel in [0i64, 1, 1000, 100_003] {
                            let want = Tensor::arange(numel, (Kind::Float, Device::Cpu)) * (root as f64 + 1.0);
                            let mut t = if pg.rank() == root { want.copy() } else { Tensor::full([numel], -1.0, (Kind::Float, Device::Cpu)) };
                            let before = pg.stats();
                            tree_broadcast(pg, &mut t, root)?;
                            let after = pg.stats();
                            if let Some(e) = shardlab::grading::layout_error(&t, &want.size(), want.kind()) {
                                bad.push(format!("rank {} root {root} numel {numel}: t became {e} (fill the tensor you were given)", pg.rank()));
                            } else if !t.equal(&want) {
                                bad.push(format!("rank {} root {root} numel {numel}: wrong data", pg.rank()));
                            }
                            // Along the tree: a rank sends B per child and receives B once (unless root).
                            let n = pg.world_size();
                            let v = (pg.rank() + n - root) % n;
                            let b = (numel * 4) as u64;
                            let kids = tree_links(v, n).1.len() as u64;
                            let (sent, recvd) = (after.bytes_sent - before.bytes_sent, after.bytes_received - before.bytes_received);
                            if after.collectives != before.collectives {
                                bad.push(format!("rank {}: tree_broadcast called a collective (pg.broadcast, all_reduce, …); use only send and recv", pg.rank()));
                            }
                            if sent != kids * b || recvd != if v == 0 { 0 } else { b } {
                                bad.push(format!("rank {} root {root}: sent {sent} B and received {recvd} B; a tree rank with {kids} children sends {} and receives {}", pg.rank(), kids * b, if v == 0 { 0 } else { b }));
                            }
                        }
                    }
                    Ok(bad)
                })
                .unwrap_or_else(|e| panic!("{backend:?} n={n}: {e}"));
                let bad: Vec<String> = res.into_iter().flatten().collect();
                assert!(bad.is_empty(), "{backend:?} n={n}:\n{}", bad.join("\n"));
            }
        }
    }

    #[test]
    fn ex3_sync_and_verify_makes_all_ranks_identical() {
        let sizes = [1000i64, 7, 4096, 3];
        for backend in [Backend::Local, Backend::Tcp] {
            for n in 1..=4 {
                let res = spawn_with(opts(n, backend), |pg| {
                    // Each rank starts from different weights, as unsynchronised ranks would.
                    let mut params = shardlab::params::random_params(&sizes, 100 + pg.rank() as i64);
                    let ours = shardlab::params::checksum(&params);
                    let sum = sync_and_verify(pg, &mut params).map_err(anyhow::Error::msg)?;
                    Ok((ours, sum, shardlab::params::checksum(&params)))
                })
                .unwrap_or_else(|e| panic!("{backend:?} n={n}: {e}"));
                let root_before = res[0].0;
                for (r, (_, sum, now)) in res.iter().enumerate() {
                    assert_eq!(*now, root_before, "{backend:?} n={n}: rank {r} does not hold rank 0's weights after sync");
                    assert_eq!(*sum, root_before, "{backend:?} n={n}: rank {r} returned a checksum that is not rank 0's");
                }
            }
        }
    }

    #[test]
    fn ex3_sync_and_verify_reports_ranks_that_still_differ() {
        // The verify half. Rank 1 ties its two parameters (one tensor passed twice, as a model with
        // tied embedding and output weights would; rank 0's are distinct): the broadcast writes both
        // of rank 0's tensors into the one storage, so rank 1 still differs from rank 0 afterwards.
        for backend in [Backend::Local, Backend::Tcp] {
            for n in [2, 3] {
                let res = spawn_with(opts(n, backend), |pg| {
                    let mut params = shardlab::params::random_params(&[1000, 1000], 100 + pg.rank() as i64);
                    if pg.rank() == 1 {
                        params[1] = params[0].shallow_clone();
                    }
                    Ok(sync_and_verify(pg, &mut params))
                })
                .unwrap_or_else(|e| panic!("{backend:?} n={n}: {e}"));
                for (r, out) in res.iter().enumerate() {
                    assert!(
                        out.is_err(),
                        "{backend:?} n={n}: rank 1 still differs from rank 0 after the broadcast (its two parameters \
                         share storage), yet rank {r}'s sync_and_verify returned {out:?}: compare every rank's \
                         checksum and return Err on every rank when they disagree"
                    );
                }
            }
        }
    }
}
