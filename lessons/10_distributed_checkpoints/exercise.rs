//! Lesson 10 — distributed checkpoints and elastic restart: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 10`. Hints: `cargo grade 10 --hint K`.
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
    // TODO: the reads that fill `want` exactly once, sorted by `dst`, or the error for a gap or an
    // overlap (README, "Resharding is interval arithmetic"; hints: `cargo grade 10 --hint 1`).
    todo!()
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
    // TODO: write checkpoint `step` and point `latest` at it; a power loss at any operation must
    // leave `latest` naming a complete checkpoint (README, "The atomic commit"; hints:
    // `cargo grade 10 --hint 2`).
    todo!()
}

/// Exercise 3 — where to resume. The step of the checkpoint a restarted run loads from `disk`:
/// the one `latest` names, if it names a folder `step-NNNNNNNN` (exactly 8 digits) that holds
/// `metadata.json`; otherwise (no `latest`, a damaged one, one naming an unfinished folder) the
/// highest step among the `step-NNNNNNNN` folders that hold `metadata.json`. `None` if there is
/// no complete checkpoint. `.tmp` folders are never checkpoints.
pub fn resume_step(disk: &SimDisk) -> Option<u64> {
    // TODO: the step of the checkpoint a restart loads, by the rule above, or `None` (README, "Where
    // a restart resumes"; hints: `cargo grade 10 --hint 3`).
    todo!()
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
    // TODO: the next generation's (world_size, batch_size), or the Err that ends the run (README,
    // "Elastic restart"; hints: `cargo grade 10 --hint 4`).
    todo!()
}
