//! Lesson 13 — pipeline parallelism: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 13`. Hints are in this lesson's README.
#![allow(unused_variables, unused_imports, unused_mut)]

use shardlab::pipeline::{Op, Slot};
use std::ops::Range;

/// Exercise 1 — the 1F1B order of stage `stage` of `stages`, with `micro_batches` micro-batches:
/// `min(stages − stage − 1, micro_batches)` warm-up forwards, then one forward and one backward
/// while forwards remain (the backward of the oldest micro-batch not yet done), then the remaining
/// backwards. Micro-batches go in order 0, 1, 2, … in both directions.
pub fn one_f_one_b(stages: usize, micro_batches: usize, stage: usize) -> Vec<Op> {
    // TODO: push the warm-up forwards, then alternate Forward(f), Backward(b) while f < m, then the
    // backwards left (README, "Schedules: GPipe and 1F1B").
    todo!()
}

/// Exercise 2 — an idealised pipeline. `plans[s]` is stage s's operations in order. Each stage
/// runs its plan in order, one operation at a time: a forward takes `t_f`, a backward `t_b`;
/// `Forward(i)` on stage s starts once stage s−1's `Forward(i)` has ended (stage 0: at 0) and
/// the stage is free; `Backward(i)` once stage s+1's `Backward(i)` has ended (the last stage:
/// once its own `Forward(i)` has) and the stage is free. Sends take no time. Return each stage's
/// slots (`Slot { stage, op, start, end }`) in plan order, or an error saying "deadlock" when the
/// plans can never finish (some stage waits for an operation that waits for it).
pub fn simulate(plans: &[Vec<Op>], t_f: f64, t_b: f64) -> Result<Vec<Vec<Slot>>, String> {
    // TODO: keep, per stage, the next operation's index and when the stage is free, and per stage
    // and micro-batch when each forward and backward ended; sweep the stages, running each
    // stage's next operation while its input is ready, until all are done — or no stage can move:
    // a deadlock (without that check your loop never ends) (README, "Simulating a pipeline").
    todo!()
}

/// Exercise 3 — cutting a model of `num_stages` stages (for the GPT: the embeddings, each block,
/// the head) into `ranks` contiguous pieces, one per pipeline rank, as equal as they divide: the
/// first `num_stages % ranks` ranks take one stage more. An error when `ranks` is 0 or larger
/// than `num_stages` (a rank with nothing to run).
pub fn partition(num_stages: usize, ranks: usize) -> Result<Vec<Range<usize>>, String> {
    // TODO: q = num_stages / ranks, the first num_stages % ranks ranks take q + 1; ranges end to
    // end from 0 (README, "Cutting the model into stages").
    todo!()
}
