//! Lesson 10 — distributed checkpoints and elastic restart: reference answers.
//! Same signatures as `lessons/10_distributed_checkpoints/exercise.rs`; graded by `tests/lesson10.rs`.
#![allow(unused_variables, unused_imports, unused_mut)]

use shardlab::checkpoint::plan::Read;
use shardlab::checkpoint::sim::{SimDisk, SimError};
use shardlab::job::Elastic;
use std::ops::Range;

/// Exercise 1 — the resharding planner. One tensor was saved as pieces `saved[k]` (flat element
/// ranges, any order, each in some rank's file); a loading rank wants the elements `want`. Return
/// the reads, sorted by where they land: `Read { piece: k, src, dst, len }` copies `len` elements
/// starting `src` elements into piece `k` to `dst` elements into the wanted range. An element of
/// `want` in no piece is an error naming the gap (`"elements 4..5 are in no saved piece"`); an
/// element in two pieces is an error saying "two saved pieces".
pub fn plan_reads(saved: &[Range<i64>], want: Range<i64>) -> Result<Vec<Read>, String> {
    // The intersections of `want` with each piece, in the order they land.
    let mut hits: Vec<(i64, i64, usize)> = saved
        .iter()
        .enumerate()
        .filter_map(|(k, r)| {
            let (lo, hi) = (r.start.max(want.start), r.end.min(want.end));
            (lo < hi).then_some((lo, hi, k))
        })
        .collect();
    hits.sort_unstable();
    // Walk them: each must start exactly where the previous one ended.
    let mut reads = Vec::new();
    let mut next = want.start;
    for (lo, hi, k) in hits {
        if lo > next {
            return Err(format!("elements {next}..{lo} are in no saved piece"));
        }
        if lo < next {
            return Err(format!("elements {lo}..{} are in two saved pieces", next.min(hi)));
        }
        reads.push(Read { piece: k, src: lo - saved[k].start, dst: lo - want.start, len: hi - lo });
        next = hi;
    }
    if next < want.end {
        return Err(format!("elements {next}..{} are in no saved piece", want.end));
    }
    Ok(reads)
}

/// Exercise 2 — the atomic commit. Write checkpoint `step` to `disk`: the folder
/// `step-NNNNNNNN` (the step in 8 digits) holding `files` (name, bytes), then make the file
/// `latest` hold that folder's name. Whenever the power goes (at any operation of this
/// function), `latest` must afterwards name a complete checkpoint — the previous one or this one
/// — and any `step-NNNNNNNN` folder holding `metadata.json` must be complete; once this returns
/// `Ok`, the new checkpoint and `latest` survive a power loss. What an earlier crash left must
/// not stop it: a `step-NNNNNNNN.tmp` folder, or a `step-NNNNNNNN` folder of this step that
/// `latest` does not name. In the `.tmp` folder too, a whole `metadata.json` means "complete":
/// it may survive a power loss only once every other file is durable, bytes and name. Return
/// the disk's error when an operation fails.
pub fn commit_checkpoint(disk: &mut SimDisk, step: u64, files: &[(&str, &[u8])]) -> Result<(), SimError> {
    let name = format!("step-{step:08}");
    let tmp = format!("{name}.tmp");
    // A crashed attempt's leftovers: not a checkpoint, never read; start again.
    disk.remove_all(&tmp)?;
    disk.create_dir(&tmp)?;
    // Every other file durable, bytes and names, before metadata.json exists: a file's sync does
    // not make its name durable, and a folder's names reach the disk in any order until it is
    // synced. Then metadata.json, bytes and name.
    let (meta, rest): (Vec<_>, Vec<_>) = files.iter().partition(|(f, _)| *f == "metadata.json");
    for batch in [rest, meta] {
        for (f, bytes) in batch {
            let path = format!("{tmp}/{f}");
            disk.write(&path, bytes)?;
            disk.sync(&path)?;
        }
        disk.sync(&tmp)?;
    }
    // The one atomic step: the rename, made durable in the root before `latest` can name it.
    // An earlier attempt at this step may have got as far as the rename (`latest` does not name it
    // yet, so nothing reads it): a folder cannot be renamed over a non-empty one.
    disk.remove_all(&name)?;
    disk.rename(&tmp, &name)?;
    disk.sync("")?;
    // `latest` is replaced, never overwritten in place: write a new file, sync it, rename over.
    disk.write("latest.tmp", name.as_bytes())?;
    disk.sync("latest.tmp")?;
    disk.rename("latest.tmp", "latest")?;
    disk.sync("")?;
    Ok(())
}

/// Exercise 3 — where to resume. The step of the checkpoint a restarted run loads from `disk`:
/// the one `latest` names, if it names a folder `step-NNNNNNNN` (exactly 8 digits) that holds
/// `metadata.json`; otherwise (no `latest`, a damaged one, one naming an unfinished folder) the
/// highest step among the `step-NNNNNNNN` folders that hold `metadata.json`. `None` if there is
/// no complete checkpoint. `.tmp` folders are never checkpoints.
pub fn resume_step(disk: &SimDisk) -> Option<u64> {
    let step_of = |name: &str| -> Option<u64> {
        let digits = name.strip_prefix("step-")?;
        (digits.len() == 8 && digits.bytes().all(|b| b.is_ascii_digit())).then(|| digits.parse().ok())?
    };
    let complete = |name: &str| step_of(name).filter(|_| disk.exists(&format!("{name}/metadata.json")));
    if let Some(s) = disk.read("latest").and_then(|b| complete(String::from_utf8_lossy(&b).trim())) {
        return Some(s);
    }
    disk.list("").iter().filter_map(|n| complete(n)).max()
}

/// Exercise 4 — the elastic supervisor's decision. Generation `generation` (0 for the first
/// attempt) failed, running `world_size` ranks of `batch_size` rows each. Return the next
/// generation's `(world_size, batch_size)`, or `Err` (saying "gave up after R restart(s)", R =
/// `policy.max_restarts`) once
/// `policy.max_restarts` restarts are spent. Without `policy.shrink_on_failure` the next
/// generation has the same shape. With it, it runs the largest world size below `world_size`
/// that is at least `policy.min_world_size` (and at least 1) and over which the global batch
/// (`world_size × batch_size` rows) splits evenly, with the same global batch; `Err` (saying
/// "cannot go on") if there is none.
pub fn after_failure(
    policy: &Elastic,
    generation: u32,
    world_size: usize,
    batch_size: usize,
) -> Result<(usize, usize), String> {
    if generation >= policy.max_restarts {
        return Err(format!("gave up after {} restart(s)", policy.max_restarts));
    }
    if !policy.shrink_on_failure {
        return Ok((world_size, batch_size));
    }
    let global = world_size * batch_size;
    let lowest = policy.min_world_size.max(1);
    (lowest..world_size)
        .rev()
        .find(|w| global % w == 0)
        .map(|w| (w, global / w))
        .ok_or_else(|| format!("cannot go on: {global} rows split over none of {lowest}..{world_size} ranks"))
}
