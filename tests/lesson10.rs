//! Grader for lesson 10 (distributed checkpoints and elastic restart).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/10_distributed_checkpoints/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 10` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong.

#[path = "../lessons/10_distributed_checkpoints/exercise.rs"]
mod exercise_code;
#[path = "../solutions/10_distributed_checkpoints.rs"]
mod solution_code;

use shardlab::checkpoint::plan::{owned_range, Read};
use shardlab::checkpoint::sim::{SimDisk, SimError};
use shardlab::job::Elastic;
use std::ops::Range;

shardlab::graders! {
    lesson: "10", exercise_file: "lessons/10_distributed_checkpoints/exercise.rs";

    /// shardlab's own copies of what each exercise builds (exercise K: `TWINS[K - 1]`): an exercise
    /// that names one is refused ("write it yourself").
    const TWINS: &[&[&str]] = &[&["plan::plan_reads", "plan_region_reads"], &[], &[], &[".after_failure", "Elastic::after_failure"]];

    /// Apply `reads` to the saved pieces of the tensor `0, 1, 2, …` (each piece holds its own
    /// elements) and return what lands in the wanted range (-1: nothing landed there).
    fn apply(saved: &[Range<i64>], want: &Range<i64>, reads: &[Read]) -> Vec<i64> {
        let mut out = vec![-1; (want.end - want.start) as usize];
        for r in reads {
            let piece = &saved[r.piece];
            assert!(r.len > 0, "a read of {} elements: leave empty intersections out ({r:?})", r.len);
            assert!(
                r.src >= 0 && r.src + r.len <= piece.end - piece.start,
                "{r:?} reads outside piece {} ({piece:?}): src counts from the piece's start",
                r.piece
            );
            assert!(
                r.dst >= 0 && r.dst + r.len <= want.end - want.start,
                "{r:?} lands outside the wanted range {want:?}: dst counts from want.start"
            );
            for i in 0..r.len {
                out[(r.dst + i) as usize] = piece.start + r.src + i;
            }
        }
        out
    }

    /// Files of checkpoint `step`: two rank files and the metadata, bytes that name the step.
    fn files(step: u64) -> Vec<(String, Vec<u8>)> {
        let body = |name: &str, n: usize| -> Vec<u8> {
            format!("{name} of step {step}: ").bytes().chain((0..n).map(|i| (i * 7 + step as usize) as u8)).collect()
        };
        vec![
            ("rank-00000.safetensors".into(), body("rank 0", 300)),
            ("rank-00001.safetensors".into(), body("rank 1", 200)),
            ("metadata.json".into(), body("metadata", 40)),
        ]
    }

    fn as_refs(f: &[(String, Vec<u8>)]) -> Vec<(&str, &[u8])> {
        f.iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect()
    }

    /// A disk holding checkpoint 1, committed and durable (written here, not by your code).
    fn disk_with_step_1() -> SimDisk {
        let mut d = SimDisk::new();
        d.create_dir("step-00000001").unwrap();
        for (n, b) in files(1) {
            d.write(&format!("step-00000001/{n}"), &b).unwrap();
            d.sync(&format!("step-00000001/{n}")).unwrap();
        }
        d.sync("step-00000001").unwrap();
        d.write("latest", b"step-00000001").unwrap();
        d.sync("latest").unwrap();
        d.sync("").unwrap();
        d
    }

    /// Whether `folder` holds exactly checkpoint `step`'s files; else what is wrong.
    fn complete(d: &SimDisk, folder: &str, step: u64) -> Result<(), String> {
        for (n, b) in files(step) {
            match d.read(&format!("{folder}/{n}")) {
                None => return Err(format!("{folder}/{n} is missing")),
                Some(got) if got != b => {
                    return Err(format!("{folder}/{n} holds {} bytes, not its {} (torn: synced before the power went?)", got.len(), b.len()))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// After a power loss: `latest` names a complete checkpoint (1, or 2 once committed), every
    /// step-N folder with a metadata.json is complete (a loader that finds no `latest` trusts them),
    /// and so is a .tmp folder with a whole one.
    fn consistent(d: &SimDisk, allow_2: bool) -> Result<u64, String> {
        let latest = d.read("latest").ok_or("`latest` is gone")?;
        let latest = String::from_utf8_lossy(&latest).trim().to_string();
        let step = match latest.as_str() {
            "step-00000001" => 1,
            "step-00000002" if allow_2 => 2,
            other => return Err(format!("`latest` holds {other:?}: not a whole checkpoint name (written in place, not replaced?)")),
        };
        complete(d, &latest, step).map_err(|e| format!("`latest` names {latest}, but {e}"))?;
        for s in [1, 2] {
            let folder = format!("step-{s:08}");
            if d.exists(&format!("{folder}/metadata.json")) {
                complete(d, &folder, s).map_err(|e| format!("{folder} has its metadata.json, but {e}"))?;
            }
        }
        // No loader reads a .tmp folder, but a whole metadata.json there means "complete" too (a torn
        // one is a damaged file, which a loader refuses).
        let whole = files(2).into_iter().find(|(n, _)| n == "metadata.json").map(|(_, b)| b);
        if d.read("step-00000002.tmp/metadata.json") == whole {
            complete(d, "step-00000002.tmp", 2).map_err(|e| format!("step-00000002.tmp has its whole metadata.json, but {e}"))?;
        }
        complete(d, "step-00000001", 1).map_err(|e| format!("the previous checkpoint was damaged: {e}"))?;
        Ok(step)
    }

    /// Which of the directory changes no folder sync had made durable the last power loss kept.
    fn kept(d: &SimDisk) -> String {
        let (kept, lost): (Vec<_>, Vec<_>) = d.last_loss().iter().partition(|(_, k)| *k);
        let names = |v: Vec<&(Vec<String>, bool)>| v.iter().map(|(g, _)| g.join(" & ")).collect::<Vec<_>>().join(", ");
        if d.last_loss().is_empty() {
            String::new()
        } else {
            format!(
                "\n  names changed since their folder's last sync, which reach the disk in any order: kept [{}], lost [{}]",
                names(kept),
                names(lost)
            )
        }
    }

    /// The subsets of `n` unsynced changes a crash is tried with: all of them up to 6 changes,
    /// else none, all, each one alone and all but each one.
    fn masks(n: usize) -> Vec<u64> {
        let all = if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
        if n <= 6 {
            return (0..=all).collect();
        }
        let mut m = vec![0, all];
        m.extend((0..n.min(64)).flat_map(|i| [1u64 << i, all ^ 1u64 << i]));
        m
    }

    /// Commit checkpoint 2 (`files`, in that order) over checkpoint 1 with the power cut at every
    /// operation in turn, keeping every subset of the directory changes not yet synced; after each
    /// crash the checkpoints must be consistent, and a second commit must work and be durable.
    fn every_crash(files: &[(String, Vec<u8>)]) {
        let mut k = 0;
        loop {
            let mut lost = 0;
            let mut m = 0;
            while m < masks(lost).len() {
                let mut d = disk_with_step_1();
                let start = d.ops();
                d.crash_at(start + k);
                d.keep_on_power_loss(masks(lost)[m]);
                let r = commit_checkpoint(&mut d, 2, &as_refs(files));
                if !d.is_down() {
                    // Every operation ran: the commit is done, and must survive a power loss now,
                    // whichever of the changes still unsynced reach the disk.
                    assert_eq!(r, Ok(()), "the commit returned an error without a crash:\n    {}", log_tail(&d));
                    for mask in masks(d.unsynced().len()) {
                        let mut d = d.clone();
                        d.keep_on_power_loss(mask);
                        d.power_loss();
                        d.reboot();
                        let got = consistent(&d, true).map_err(|e| format!("power lost after the commit returned: {e}"));
                        assert_eq!(
                            got,
                            Ok(2),
                            "once commit_checkpoint returns Ok, the new checkpoint and `latest` must be durable (sync the \
                             files, the folder, and the root after each rename). Operations:\n    {}{}",
                            log_tail(&d),
                            kept(&d)
                        );
                    }
                    assert!(k > 3, "a commit of three files in {k} operations cannot be durable");
                    return;
                }
                assert_eq!(r, Err(SimError::PowerLoss), "operation {} lost the power: return the disk's error", start + k);
                lost = d.last_loss().len();
                d.reboot();
                if let Err(e) = consistent(&d, true) {
                    panic!(
                        "the power went at operation {} ({}): {e}{}\n  operations:\n    {}",
                        start + k,
                        d.log()[start + k],
                        kept(&d),
                        log_tail(&d)
                    );
                }
                // The restarted job saves step 2 again, over whatever the crash left.
                let again = commit_checkpoint(&mut d, 2, &as_refs(files));
                assert_eq!(
                    again,
                    Ok(()),
                    "after a power loss at operation {} the next commit fails (a leftover .tmp or step folder in the \
                     way?):\n    {}",
                    start + k,
                    log_tail(&d)
                );
                d.power_loss();
                d.reboot();
                assert_eq!(consistent(&d, true), Ok(2), "the second commit (after a crash at operation {}) is not durable", start + k);
                m += 1;
            }
            k += 1;
            assert!(k < 1000, "more than 1000 operations for one commit");
        }
    }

    fn log_tail(d: &SimDisk) -> String {
        let l = d.log();
        l[l.len().saturating_sub(14)..].join("\n    ")
    }

    #[test]
    fn ex1_reads_fill_the_wanted_range_from_any_sharding() {
        shardlab::grading::refuse_twins(GRADER, 1, TWINS[0]);
        // Saved by 3 ranks in the order 4..7, 0..4, 7..10; wanted: 0..5 then 5..10 (2 ranks). By hand:
        let saved = [4..7, 0..4, 7..10];
        let plan = |want: Range<i64>| {
            plan_reads(&saved, want.clone())
                .unwrap_or_else(|e| panic!("{want:?} from {saved:?} (pieces come in any order): {e}"))
        };
        assert_eq!(
            plan(0..5),
            vec![Read { piece: 1, src: 0, dst: 0, len: 4 }, Read { piece: 0, src: 0, dst: 4, len: 1 }],
            "0..5 from [4..7, 0..4, 7..10]: all of piece 1, then the first element of piece 0"
        );
        assert_eq!(
            plan(5..10),
            vec![Read { piece: 0, src: 1, dst: 0, len: 2 }, Read { piece: 2, src: 0, dst: 2, len: 3 }],
            "5..10: piece 0 from its second element (src 1), then all of piece 2; dst counts from 5"
        );
        assert_eq!(plan_reads(&saved, 3..3).unwrap(), vec![], "an empty wanted range needs no reads");
        // Every saving world size N to every loading one M, pieces listed in any order.
        for numel in [1i64, 7, 13, 64] {
            for n in 1..=4 {
                let mut saved: Vec<Range<i64>> = (0..n).map(|r| owned_range(numel, r, n)).filter(|r| !r.is_empty()).collect();
                saved.reverse();
                for m in 1..=5 {
                    for r in 0..m {
                        let want = owned_range(numel, r, m);
                        let reads = plan_reads(&saved, want.clone())
                            .unwrap_or_else(|e| panic!("{numel} elements saved by {n} ranks, {want:?} wanted: {e}"));
                        let got = apply(&saved, &want, &reads);
                        let expect: Vec<i64> = want.clone().collect();
                        assert_eq!(got, expect, "{numel} elements saved by {n} ranks ({saved:?}), rank {r} of {m} wants {want:?}: {reads:?}");
                        assert!(
                            reads.windows(2).all(|w| w[0].dst + w[0].len == w[1].dst),
                            "reads must be sorted by where they land: {reads:?}"
                        );
                    }
                }
            }
        }
        // A window in the middle of pieces, e.g. one ZeRO shard of a tensor saved by DDP ranks.
        let saved = [0..30, 30..50, 50..100];
        let reads = plan_reads(&saved, 25..60).unwrap();
        assert_eq!(apply(&saved, &(25..60), &reads), (25..60).collect::<Vec<i64>>(), "25..60 of [0..30, 30..50, 50..100]: {reads:?}");
        assert_eq!(reads.len(), 3, "25..60 touches three pieces: {reads:?}");
        // What no checkpoint may hold: gaps and overlaps.
        let gap = plan_reads(&[0..4, 5..10], 0..10).expect_err("[0..4, 5..10] leaves element 4 out: that is an error");
        assert!(gap.contains("4..5"), "the error names the gap 4..5: {gap:?}");
        let tail = plan_reads(&[0..4], 0..10).expect_err("[0..4] cannot fill 0..10");
        assert!(tail.contains("4..10"), "the error names the missing 4..10: {tail:?}");
        let head = plan_reads(&[3..10], 0..10).expect_err("[3..10] cannot fill 0..10");
        assert!(head.contains("0..3"), "the error names the missing 0..3: {head:?}");
        let two = plan_reads(&[0..6, 5..10], 0..10).expect_err("[0..6, 5..10] holds element 5 twice");
        assert!(two.contains("two saved pieces"), "the error says \"two saved pieces\": {two:?}");
        assert!(plan_reads(&[0..6, 5..10], 0..5).is_ok(), "an overlap outside the wanted range does not matter");
    }

    #[test]
    fn ex2_a_commit_survives_a_power_loss_at_every_operation() {
        shardlab::grading::refuse_names(GRADER, 2, &[".crash_at", ".keep_on_power_loss", ".power_loss", ".reboot"], |t| {
            format!("your commit calls `{t}`, one of the simulated disk's test controls (the grader's power switch): a commit only creates, writes, syncs, renames and removes")
        });
        every_crash(&files(2));
        let new = files(2);
        // What an earlier crash (of this code, or of an older writer) may have left, durable:
        // a .tmp folder with a stale file of a 3-rank run, and a step folder without metadata.json.
        for leftover in ["step-00000002.tmp", "step-00000002"] {
            let mut d = disk_with_step_1();
            d.create_dir(leftover).unwrap();
            for f in ["rank-00000.safetensors", "rank-00002.safetensors"] {
                d.write(&format!("{leftover}/{f}"), b"half-written").unwrap();
                d.sync(&format!("{leftover}/{f}")).unwrap();
            }
            d.sync(leftover).unwrap();
            d.sync("").unwrap();
            let r = commit_checkpoint(&mut d, 2, &as_refs(&new));
            assert_eq!(r, Ok(()), "a leftover {leftover}/ from a crashed save is in the way:\n    {}", log_tail(&d));
            d.power_loss();
            d.reboot();
            assert_eq!(consistent(&d, true), Ok(2), "with a leftover {leftover}/ the commit is not durable");
            let mut want: Vec<String> = new.iter().map(|(n, _)| n.clone()).collect();
            want.sort();
            assert_eq!(
                d.list("step-00000002"),
                want,
                "step-00000002 must hold exactly the checkpoint's files (a leftover {leftover}/ was reused, not removed?)"
            );
        }
        // Files listed with metadata.json first: it must still be the last one made durable (a
        // folder with its metadata.json is taken for complete).
        let mut first = files(2);
        first.rotate_right(1);
        assert_eq!(first[0].0, "metadata.json");
        every_crash(&first);
        // Committing does not remove the previous checkpoint (checked above) and works twice in a row.
        let mut d = disk_with_step_1();
        commit_checkpoint(&mut d, 2, &as_refs(&new)).unwrap();
        commit_checkpoint(&mut d, 3, &as_refs(&files(3))).unwrap();
        d.power_loss();
        d.reboot();
        assert_eq!(d.read("latest").map(|b| String::from_utf8_lossy(&b).trim().to_string()), Some("step-00000003".into()));
        complete(&d, "step-00000003", 3).unwrap();
        complete(&d, "step-00000002", 2).unwrap();
    }

    #[test]
    fn ex3_resume_from_the_newest_complete_checkpoint() {
        // Folders are built directly; durability does not matter here.
        let mut d = SimDisk::new();
        assert_eq!(resume_step(&d), None, "an empty folder holds no checkpoint");
        for (step, meta) in [(100, true), (200, true), (300, false)] {
            d.create_dir(&format!("step-{step:08}")).unwrap();
            if meta {
                d.write(&format!("step-{step:08}/metadata.json"), b"{}").unwrap();
            }
        }
        d.create_dir("step-00000400.tmp").unwrap();
        d.write("step-00000400.tmp/metadata.json", b"{}").unwrap();
        d.create_dir("step-500").unwrap();
        d.write("step-500/metadata.json", b"{}").unwrap();
        d.write("notes.txt", b"step-00000900").unwrap();
        assert_eq!(
            resume_step(&d),
            Some(200),
            "no `latest`: the highest step-NNNNNNNN folder with a metadata.json is 200 (300 has none, 400 is a .tmp, \
             step-500 is not 8 digits)"
        );
        d.write("latest", b"step-00000100").unwrap();
        assert_eq!(resume_step(&d), Some(100), "`latest` names step 100, complete: it wins even over a newer one");
        d.write("latest", b"step-00000100\n").unwrap();
        assert_eq!(resume_step(&d), Some(100), "`latest` with a trailing newline still names step 100");
        d.write("latest", b"step-00000300").unwrap();
        assert_eq!(resume_step(&d), Some(200), "`latest` names 300, which has no metadata.json: fall back to 200");
        d.write("latest", b"step-00000400.tmp").unwrap();
        assert_eq!(resume_step(&d), Some(200), "`latest` names a .tmp folder: never a checkpoint");
        d.write("latest", b"step-0000").unwrap();
        assert_eq!(resume_step(&d), Some(200), "a torn `latest`: fall back to the folders");
        d.write("latest", b"step-00000700").unwrap();
        assert_eq!(resume_step(&d), Some(200), "`latest` names a folder that does not exist");
        d.write("step-00000300/metadata.json", b"{}").unwrap();
        d.remove_all("latest").unwrap();
        assert_eq!(resume_step(&d), Some(300), "step 300 is complete now: the newest");
        let mut d = SimDisk::new();
        d.create_dir("step-00000007.tmp").unwrap();
        d.write("step-00000007.tmp/metadata.json", b"{}").unwrap();
        assert_eq!(resume_step(&d), None, "only an unfinished .tmp folder: no checkpoint");
        d.create_dir("step-00000000").unwrap();
        d.write("step-00000000/metadata.json", b"{}").unwrap();
        assert_eq!(resume_step(&d), Some(0), "step 0 (saved before the first update) is a checkpoint too");
    }

    #[test]
    fn ex4_the_supervisor_restarts_shrinks_or_gives_up() {
        shardlab::grading::refuse_twins(GRADER, 4, TWINS[3]);
        let same = Elastic { max_restarts: 3, ..Elastic::default() };
        assert_eq!(after_failure(&same, 0, 4, 8), Ok((4, 8)), "3 restarts allowed, none used: restart the same 4 × 8");
        assert_eq!(after_failure(&same, 2, 4, 8), Ok((4, 8)), "generation 2 failed: the third restart is still allowed");
        let e = after_failure(&same, 3, 4, 8).expect_err("generation 3 failed: the three restarts are spent");
        assert!(e.contains("gave up after 3 restart(s)"), "say \"gave up after 3 restart(s)\": {e:?}");
        let e = after_failure(&Elastic::default(), 0, 2, 4).expect_err("max_restarts 0: the first failure ends the run");
        assert!(e.contains("gave up after 0 restart(s)"), "{e:?}");
        let shrink = Elastic { max_restarts: 5, min_world_size: 2, shrink_on_failure: true };
        assert_eq!(after_failure(&shrink, 0, 4, 6), Ok((3, 8)), "24 rows over 3 ranks: 8 each");
        assert_eq!(after_failure(&shrink, 0, 3, 4), Ok((2, 6)), "12 rows over 2 ranks: 6 each");
        assert_eq!(after_failure(&shrink, 1, 4, 4), Ok((2, 8)), "16 rows do not split over 3 ranks; over 2: 8 each");
        let e = after_failure(&shrink, 0, 2, 5).expect_err("min_world_size 2: 2 ranks cannot shrink");
        assert!(e.contains("cannot go on"), "say \"cannot go on\": {e:?}");
        let e = after_failure(&shrink, 5, 4, 6).expect_err("restarts spent: give up, even if it could shrink");
        assert!(e.contains("gave up after 5 restart(s)"), "{e:?}");
        let down_to_one = Elastic { max_restarts: 2, min_world_size: 0, shrink_on_failure: true };
        assert_eq!(after_failure(&down_to_one, 0, 2, 3), Ok((1, 6)), "min_world_size 0 means 1: 6 rows on one rank");
        let e = after_failure(&down_to_one, 0, 1, 6).expect_err("one rank cannot shrink");
        assert!(e.contains("cannot go on"), "{e:?}");
        let prime = Elastic { max_restarts: 2, min_world_size: 4, shrink_on_failure: true };
        let e = after_failure(&prime, 0, 5, 7).expect_err("35 rows split over neither 4 ranks (nor 3, 2 below the minimum)");
        assert!(e.contains("cannot go on"), "{e:?}");
        assert_eq!(
            after_failure(&Elastic { max_restarts: 1, min_world_size: 4, shrink_on_failure: true }, 0, 8, 3),
            Ok((6, 4)),
            "24 rows: 7 ranks do not divide them, 6 do"
        );
    }
}
