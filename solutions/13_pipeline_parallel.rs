//! Lesson 13 — pipeline parallelism: reference answers.
//! Same signatures as `lessons/13_pipeline_parallel/exercise.rs`; graded by `tests/lesson13.rs`.
#![allow(unused_variables, unused_imports, unused_mut)]

use shardlab::pipeline::{Op, Slot};
use std::ops::Range;

/// Exercise 1 — the 1F1B order of stage `stage` of `stages`, with `micro_batches` micro-batches:
/// `min(stages − stage − 1, micro_batches)` warm-up forwards, then one forward and one backward
/// while forwards remain (the backward of the oldest micro-batch not yet done), then the remaining
/// backwards. Micro-batches go in order 0, 1, 2, … in both directions.
pub fn one_f_one_b(stages: usize, micro_batches: usize, stage: usize) -> Vec<Op> {
    let m = micro_batches;
    let warmup = (stages - stage - 1).min(m);
    let mut ops: Vec<Op> = (0..warmup).map(Op::Forward).collect();
    let (mut f, mut b) = (warmup, 0);
    while f < m {
        ops.push(Op::Forward(f));
        ops.push(Op::Backward(b));
        f += 1;
        b += 1;
    }
    ops.extend((b..m).map(Op::Backward));
    ops
}

/// Exercise 2 — an idealised pipeline. `plans[s]` is stage s's operations in order. Each stage
/// runs its plan in order, one operation at a time: a forward takes `t_f`, a backward `t_b`;
/// `Forward(i)` on stage s starts once stage s−1's `Forward(i)` has ended (stage 0: at 0) and
/// the stage is free; `Backward(i)` once stage s+1's `Backward(i)` has ended (the last stage:
/// once its own `Forward(i)` has) and the stage is free. Sends take no time. Return each stage's
/// slots (`Slot { stage, op, start, end }`) in plan order, or an error saying "deadlock" when the
/// plans can never finish (some stage waits for an operation that waits for it).
pub fn simulate(plans: &[Vec<Op>], t_f: f64, t_b: f64) -> Result<Vec<Vec<Slot>>, String> {
    let p = plans.len();
    let m = plans.iter().flatten().map(|&o| match o {
        Op::Forward(i) | Op::Backward(i) => i + 1,
    });
    let m = m.max().unwrap_or(0);
    let mut f_end = vec![vec![None::<f64>; m]; p];
    let mut b_end = vec![vec![None::<f64>; m]; p];
    let mut next = vec![0usize; p];
    let mut free = vec![0.0f64; p];
    let mut out: Vec<Vec<Slot>> = vec![Vec::new(); p];
    loop {
        let mut moved = false;
        for s in 0..p {
            while let Some(&op) = plans[s].get(next[s]) {
                let ready = match op {
                    Op::Forward(i) if s == 0 => Some(0.0),
                    Op::Forward(i) => f_end[s - 1][i],
                    Op::Backward(i) if s + 1 == p => f_end[s][i],
                    Op::Backward(i) => b_end[s + 1][i],
                };
                let Some(ready) = ready else { break };
                let start = ready.max(free[s]);
                let end = start + if matches!(op, Op::Forward(_)) { t_f } else { t_b };
                match op {
                    Op::Forward(i) => f_end[s][i] = Some(end),
                    Op::Backward(i) => b_end[s][i] = Some(end),
                }
                free[s] = end;
                out[s].push(Slot { stage: s, op, start, end });
                next[s] += 1;
                moved = true;
            }
        }
        if (0..p).all(|s| next[s] == plans[s].len()) {
            return Ok(out);
        }
        if !moved {
            let stuck: Vec<String> = (0..p)
                .filter(|&s| next[s] < plans[s].len())
                .map(|s| format!("stage {s} at {:?}", plans[s][next[s]]))
                .collect();
            return Err(format!("the plans deadlock: {}", stuck.join(", ")));
        }
    }
}

/// Exercise 3 — cutting a model of `num_stages` stages (for the GPT: the embeddings, each block,
/// the head) into `ranks` contiguous pieces, one per pipeline rank, as equal as they divide: the
/// first `num_stages % ranks` ranks take one stage more. An error when `ranks` is 0 or larger
/// than `num_stages` (a rank with nothing to run).
pub fn partition(num_stages: usize, ranks: usize) -> Result<Vec<Range<usize>>, String> {
    if ranks == 0 || ranks > num_stages {
        return Err(format!("{ranks} pipeline ranks for a model of {num_stages} stages: each rank needs at least one"));
    }
    let (q, extra) = (num_stages / ranks, num_stages % ranks);
    let mut lo = 0;
    Ok((0..ranks)
        .map(|r| {
            let n = q + usize::from(r < extra);
            lo += n;
            lo - n..lo
        })
        .collect())
}
