//! Subgroups and device meshes (lesson 12): `ProcessGroup::split`/`new_group` make real
//! communicators of some ranks, and `DeviceMesh` lays a group out as named dimensions. On the
//! local and tcp backends: collectives on the rows and columns of 2 × 2 and 2 × 3 meshes give the
//! sums of exactly their members (by hand: rank = dp·T + tp), interleaved with the parent's own
//! collectives and with operations in flight in two groups at once; bad shapes and bad rank lists
//! are errors on every rank; a killed rank fails the groups it is in, promptly, and only those.

use shardlab::prelude::*;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(20);

fn cfg() -> CommConfig {
    CommConfig::default().with_timeout(TIMEOUT)
}

fn child_args(test: &str) -> Vec<String> {
    vec!["--exact".into(), test.into(), "--nocapture".into(), "--test-threads=1".into()]
}

/// Sum of `x` over `g`.
fn sum(g: &ProcessGroup, x: f64) -> CommResult<f64> {
    let mut t = Tensor::from_slice(&[x]);
    g.all_reduce(&mut t, ReduceOp::Sum)?;
    Ok(t.double_value(&[0]))
}

/// On this rank of a D × T mesh: (its dp and tp coordinates, the tp group's sum of ranks, the dp
/// group's, the parent's, the tp group's ranks gathered in order, the same sums from two async
/// all-reduces in flight at once in both groups).
fn mesh_run(pg: &ProcessGroup, d: usize, t: usize) -> anyhow::Result<Vec<f64>> {
    let mesh = DeviceMesh::new(pg, &[d, t], &["dp", "tp"])?;
    let r = pg.rank() as f64;
    let (tp, dp) = (mesh.group("tp"), mesh.group("dp"));
    anyhow::ensure!(tp.world_size() == t && dp.world_size() == d, "group sizes");
    anyhow::ensure!(tp.rank() == mesh.coord("tp") && dp.rank() == mesh.coord("dp"), "rank in group = coordinate");
    let row = sum(tp, r)?;
    let parent = sum(pg, r)?; // the parent still works between the subgroups' operations
    let col = sum(dp, r)?;
    let mut gathered = Tensor::zeros([t as i64], (Kind::Float, Device::Cpu));
    tp.all_gather(&mut gathered, &Tensor::from_slice(&[r as f32]))?;
    let a = tp.all_reduce_async(Tensor::from_slice(&[r]), ReduceOp::Sum)?;
    let b = dp.all_reduce_async(Tensor::from_slice(&[r]), ReduceOp::Sum)?;
    let (a, b) = (a.wait()?.double_value(&[0]), b.wait()?.double_value(&[0]));
    let mut out = vec![mesh.coord("dp") as f64, mesh.coord("tp") as f64, row, col, parent];
    out.extend(Vec::<f32>::try_from(&gathered)?.into_iter().map(f64::from));
    out.extend([a, b]);
    Ok(out)
}

fn check_mesh(results: Vec<Vec<f64>>, d: usize, t: usize, what: &str) {
    let n = d * t;
    for (rank, v) in results.iter().enumerate() {
        let (dp, tp) = (rank / t, rank % t);
        let row: f64 = (0..t).map(|j| (dp * t + j) as f64).sum();
        let col: f64 = (0..d).map(|i| (i * t + tp) as f64).sum();
        let members: Vec<f64> = (0..t).map(|j| (dp * t + j) as f64).collect();
        let mut want = vec![dp as f64, tp as f64, row, col, (n * (n - 1) / 2) as f64];
        want.extend(members);
        want.extend([row, col]);
        assert_eq!(v, &want, "{what} {d}×{t}, rank {rank} = (dp {dp}, tp {tp}): [dp, tp, row sum, column sum, world sum, tp members…, async row, async column]");
    }
}

#[test]
fn mesh_rows_and_columns_local() {
    for (d, t) in [(2, 2), (2, 3), (3, 2)] {
        let out =
            spawn_with(SpawnOptions::new(d * t, Backend::Local).config(cfg()), move |pg| mesh_run(pg, d, t)).unwrap();
        check_mesh(out, d, t, "local");
    }
}

/// Processes re-run the test function from the top, so one spawn per test.
fn mesh_tcp(d: usize, t: usize, test: &str) {
    let opts = SpawnOptions::new(d * t, Backend::Tcp).config(cfg()).child_args(child_args(test));
    let out = spawn_with(opts, move |pg| mesh_run(pg, d, t)).unwrap();
    check_mesh(out, d, t, "tcp");
}

#[test]
fn mesh_2x2_tcp() {
    mesh_tcp(2, 2, "mesh_2x2_tcp");
}

#[test]
fn mesh_2x3_tcp() {
    mesh_tcp(2, 3, "mesh_2x3_tcp");
}

/// Over TCP: a group of some ranks (the others get none and go on), and a split of it.
#[test]
fn new_group_and_nested_split_tcp() {
    let opts =
        SpawnOptions::new(3, Backend::Tcp).config(cfg()).child_args(child_args("new_group_and_nested_split_tcp"));
    let out = spawn_with(opts, |pg| {
        let r = pg.rank() as f64;
        let g = pg.new_group(&[2, 0])?;
        let parent = sum(pg, r)?;
        let (in_g, nested) = match &g {
            Some(g) => {
                let s = g.split(Some(0), 1 - g.rank())?.expect("both in it"); // reversed order
                (sum(g, r)?, s.rank() as f64)
            }
            None => (-1.0, -1.0),
        };
        Ok((in_g, nested, parent))
    })
    .unwrap();
    assert_eq!(
        out,
        vec![(2.0, 0.0, 3.0), (-1.0, -1.0, 3.0), (2.0, 1.0, 3.0)],
        "[(group sum, rank in the reversed split, world sum)]"
    );
}

/// `new_group` takes members in the listed order and leaves the others out; a subgroup can be
/// split again; bad arguments are errors on every rank, before any rank computes.
#[test]
fn new_group_nested_splits_and_bad_arguments() {
    let out = spawn_with(SpawnOptions::new(4, Backend::Local).config(cfg()), |pg| {
        let r = pg.rank();
        let g = pg.new_group(&[3, 1])?;
        let in_g = match &g {
            Some(g) => (g.rank() as f64, sum(g, r as f64)?),
            None => (-1.0, -1.0),
        };
        // Split a subgroup again: the pair {3, 1} into two singletons.
        let single = match &g {
            Some(g) => g.split(Some(g.rank()), 0)?.map_or(-1.0, |s| s.world_size() as f64),
            None => -1.0,
        };
        let dup = pg.new_group(&[0, 0]).err().map(|e| e.to_string()).unwrap_or_default();
        // Only rank 0's list is bad: every rank fails (none waits for it).
        let one_bad = pg
            .new_group(if r == 0 { &[0, 9][..] } else { &[0, 1][..] })
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        let huge =
            pg.split(Some(if r == 2 { usize::MAX } else { 0 }), 0).err().map(|e| e.to_string()).unwrap_or_default();
        let shape = DeviceMesh::new(pg, &[2, 3], &["dp", "tp"]).err().map(|e| e.to_string()).unwrap_or_default();
        // Ranks that disagree on the mesh: every rank fails, none hangs.
        let tp_size = if r == 0 { 4 } else { 2 };
        let disagree = DeviceMesh::new(pg, &[4 / tp_size, tp_size], &["dp", "tp"])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        Ok((in_g, single, dup, shape, disagree, one_bad, huge))
    })
    .unwrap();
    for (r, (in_g, single, dup, shape, disagree, one_bad, huge)) in out.into_iter().enumerate() {
        let want = match r {
            3 => (0.0, 4.0),
            1 => (1.0, 4.0),
            _ => (-1.0, -1.0),
        };
        assert_eq!(
            in_g, want,
            "rank {r}: new_group([3, 1]) gives rank 3 rank 0 and rank 1 rank 1; ranks 0, 2 are not in it"
        );
        assert_eq!(single, if want.0 >= 0.0 { 1.0 } else { -1.0 }, "rank {r}: the subgroup split again");
        assert!(dup.contains("appears twice"), "rank {r}: {dup:?}");
        assert!(shape.contains("6 ranks") && shape.contains("4"), "rank {r}: {shape:?}");
        assert!(disagree.contains("disagree"), "rank {r}: {disagree:?}");
        assert!(one_bad.contains(if r == 0 { "out of range" } else { "another rank's list" }), "rank {r}: {one_bad:?}");
        assert!(huge.contains("rank 2 passed a color"), "rank {r}: {huge:?}");
    }
}

/// Rank 3 of a 2 × 2 mesh is killed. Its row (tp group {2, 3}) and column (dp group {1, 3}) fail
/// at once on their next operation; rank 0, in neither, still runs its groups ({0, 1} and
/// {0, 2}: ranks 1 and 2 answer there before their own failing operation), then stops with a
/// message of its own, so the test can tell its groups worked.
#[test]
fn a_dead_rank_fails_the_groups_it_is_in() {
    let t0 = Instant::now();
    let opts = SpawnOptions::new(4, Backend::Tcp)
        .config(cfg())
        .child_args(child_args("a_dead_rank_fails_the_groups_it_is_in"));
    let e = spawn_with(opts, |pg| {
        let mesh = DeviceMesh::new(pg, &[2, 2], &["dp", "tp"])?;
        let r = pg.rank() as f64;
        // Rank 3 dies only once ranks 1 and 2 are past every operation they share with it before
        // their last: each sends it a token through the group they share (a barrier of the
        // parent could see it die from inside the barrier).
        let token = Tensor::zeros([1], (Kind::Float, Device::Cpu));
        match pg.rank() {
            3 => {
                mesh.group("dp").recv(&mut token.shallow_clone(), 0)?; // from rank 1
                mesh.group("tp").recv(&mut token.shallow_clone(), 0)?; // from rank 2
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
            1 => mesh.group("dp").send(&token, 1)?,
            2 => mesh.group("tp").send(&token, 1)?,
            _ => {}
        }
        // Rank 0's groups do not contain rank 3: they work (rank 1 and 2 take part first).
        match pg.rank() {
            0 => {
                sum(mesh.group("tp"), r)?;
                sum(mesh.group("dp"), r)?;
                anyhow::bail!("rank 0: both its groups worked"); // (the parent's final barrier would fail anyway)
            }
            1 => {
                sum(mesh.group("tp"), r)?; // {0, 1}: fine
                sum(mesh.group("dp"), r)?; // {1, 3}: fails
            }
            _ => {
                sum(mesh.group("dp"), r)?; // {0, 2}: fine
                sum(mesh.group("tp"), r)?; // {2, 3}: fails
            }
        }
        Ok(())
    })
    .unwrap_err();
    assert!(t0.elapsed() < TIMEOUT, "a dead rank must fail its groups promptly: took {:?}", t0.elapsed());
    let text = e.to_string();
    let failed: Vec<usize> = e.failures.iter().map(|f| f.0).collect();
    assert!(failed.contains(&3) && failed.contains(&1) && failed.contains(&2), "{text}");
    assert!(text.contains("rank 0: both its groups worked"), "rank 0 is in no group with rank 3: {text}");
}

/// Rank 3 of a 2 × 2 mesh gives up on its tp group ({2, 3}) and stays alive. Its other groups
/// fail with it (the parent and its dp group {1, 3}), so its dp peer, rank 1, is told at once
/// instead of waiting out the timeout; rank 1's groups fail in turn, which reaches rank 0,
/// which shares no group with rank 3. Every rank's error names the first failure, in seconds.
fn a_failed_group_fails_the_ranks_other_groups(backend: Backend, test: &str) {
    let opts = SpawnOptions::new(4, backend).config(cfg()).child_args(child_args(test));
    let e = spawn_with(opts, |pg| -> anyhow::Result<()> {
        let mesh = DeviceMesh::new(pg, &[2, 2], &["dp", "tp"])?;
        // Rank 3 gives up only once every rank has built the mesh (a token from each).
        let r = pg.rank();
        let token = Tensor::zeros([1], (Kind::Float, Device::Cpu));
        match r {
            3 => (0..3).try_for_each(|p| pg.recv(&mut token.shallow_clone(), p))?,
            _ => pg.send(&token, 3)?,
        }
        let t0 = Instant::now();
        if r == 3 {
            mesh.group("tp").abort("rank 3 gives up on tp");
            std::thread::sleep(Duration::from_secs(6)); // alive, in no operation
            anyhow::bail!("rank 3: slept");
        }
        // Rank 2 shares the failed group; rank 1 only dp {1, 3}; rank 0 neither.
        let g = mesh.group(if r == 1 { "dp" } else { "tp" });
        let err = sum(g, r as f64).expect_err("the operation must fail").to_string();
        let took = t0.elapsed();
        anyhow::ensure!(took < Duration::from_secs(4), "rank {r}: failed only after {took:?}: {err}");
        anyhow::ensure!(err.contains("rank 3 gives up on tp"), "rank {r}: the first failure is not named: {err}");
        anyhow::bail!("rank {r}: failed fast")
    })
    .unwrap_err();
    let text = e.to_string();
    for r in 0..3 {
        assert!(text.contains(&format!("rank {r}: failed fast")), "rank {r}: {text}");
    }
}

#[test]
fn a_failed_group_fails_the_ranks_other_groups_local() {
    a_failed_group_fails_the_ranks_other_groups(Backend::Local, "a_failed_group_fails_the_ranks_other_groups_local");
}

#[test]
fn a_failed_group_fails_the_ranks_other_groups_tcp() {
    a_failed_group_fails_the_ranks_other_groups(Backend::Tcp, "a_failed_group_fails_the_ranks_other_groups_tcp");
}
