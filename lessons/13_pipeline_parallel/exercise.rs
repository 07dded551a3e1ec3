//! Lesson 13 — pipeline parallelism: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 13`. Hints: `cargo grade 13 --hint K`.
#![allow(unused_variables, unused_imports, unused_mut)]

use shardlab::comm::{CommResult, ProcessGroup};
use shardlab::model::Batch;
use shardlab::pipeline::{Op, Slot, StageRunner};
use std::collections::BTreeMap;
use std::ops::Range;
use tch::{Kind, Tensor};

/// Exercise 1 — the 1F1B order of stage `stage` of `stages`, with `micro_batches` micro-batches:
/// `min(stages − stage − 1, micro_batches)` warm-up forwards, then one forward and one backward
/// while forwards remain (the backward of the oldest micro-batch not yet done), then the remaining
/// backwards. Micro-batches go in order 0, 1, 2, … in both directions.
pub fn one_f_one_b(stages: usize, micro_batches: usize, stage: usize) -> Vec<Op> {
    // TODO: the three phases of 1F1B for this stage (README, "Schedules: GPipe and 1F1B"; hints:
    // `cargo grade 13 --hint 1`).
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
    // TODO: run every stage's plan by the rules above until all are done, or report the deadlock
    // when no stage can move — without that check your loop never ends (README, "Simulating a
    // pipeline"; hints: `cargo grade 13 --hint 2`).
    todo!()
}

/// Exercise 3 — cutting a model of `num_stages` stages (for the GPT: the embeddings, each block,
/// the head) into `ranks` contiguous pieces, one per pipeline rank, as equal as they divide: the
/// first `num_stages % ranks` ranks take one stage more. An error when `ranks` is 0 or larger
/// than `num_stages` (a rank with nothing to run).
pub fn partition(num_stages: usize, ranks: usize) -> Result<Vec<Range<usize>>, String> {
    // TODO: contiguous ranges, end to end from 0, as equal as they divide; the errors first
    // (README, "Cutting the model into stages"; hints: `cargo grade 13 --hint 3`).
    todo!()
}

/// Exercise 4 — one pipeline rank's part of a training step, over real sends and receives.
/// `runner` computes this rank's stages (`forward`, `backward`, `activation`: see
/// `shardlab::pipeline::StageRunner`). `batch` (B, T) is the whole batch on every rank, cut into
/// `micro_batches` equal micro-batches of consecutive rows. `plan` is this rank's operations in
/// order, `next_plan` rank r + 1's (empty on the last rank). Run `plan`:
/// - `Forward(i)`: the first rank passes an undefined tensor (`Tensor::new()`), the others receive
///   micro-batch i's activation (f32, shape `runner.activation(rows, T)`) from rank r − 1. The last
///   rank's output is micro-batch i's mean loss; the others send theirs to rank r + 1 — without
///   deadlocking where a send blocks until it is read (README, "Two neighbours that both send
///   first").
/// - `Backward(i)`: the last rank starts from micro-batch i's weight in the batch's loss (a scalar
///   f32 tensor; README, "The loss over micro-batches"), the others from the gradient received
///   from rank r + 1; send dL/dx to rank r − 1; add the parameter gradients into this rank's sums.
/// Return the batch's mean loss on the last rank (0.0 on the others) and this rank's gradient
/// sums by parameter index, each in its parameter's shape, f32 (as `runner.backward` returns
/// them). The tied embedding's exchange and the loss's broadcast are not part
/// of it.
pub fn run_rank(
    pg: &ProcessGroup,
    runner: &mut dyn StageRunner,
    plan: &[Op],
    next_plan: &[Op],
    batch: &Batch,
    micro_batches: usize,
) -> CommResult<(f64, BTreeMap<usize, Tensor>)> {
    // TODO: walk `plan` with real sends and receives, so that the step equals one process's and
    // never deadlocks where sends block (README, "The executor", "Two neighbours that both send
    // first", "The loss over micro-batches"; hints: `cargo grade 13 --hint 4`).
    todo!()
}

/// Exercise 5 — the tied parameters' exchange, after the step. `used[q]` lists the parameters (by
/// index, in no particular order) that rank q's stages use, for every rank q of `pg`; `grads` holds
/// this rank's gradient sums (as `run_rank` returns them). A parameter used by more than one rank
/// (the GPT's `wte`, on ranks 0 and p − 1) must end with the sum of its users' gradients on every
/// one of them, the same bits on each, in its parameter's shape; every other gradient stays as it
/// is. Only a parameter's users talk, with `send` and `recv` (a rank that shares nothing sends and
/// receives nothing), and in an order that never deadlocks where a send blocks until it is read.
pub fn sum_tied(pg: &ProcessGroup, grads: &mut BTreeMap<usize, Tensor>, used: &[Vec<usize>]) -> CommResult<()> {
    // TODO: for each parameter with several users, every user ends with the sum (README, "Tied
    // embeddings on the first and last rank"; hints: `cargo grade 13 --hint 5`).
    todo!()
}
