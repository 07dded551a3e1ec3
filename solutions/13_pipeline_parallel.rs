//! Lesson 13 — pipeline parallelism: reference answers.
//! Same signatures as `lessons/13_pipeline_parallel/exercise.rs`; graded by `tests/lesson13.rs`.
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
    let (p, r) = (pg.world_size(), pg.rank());
    let last = r + 1 == p;
    let (rows, t) = (batch.x.size()[0], batch.x.size()[1]);
    let mb = rows / micro_batches as i64;
    let part = |i: usize| batch.rows(i as i64 * mb, (i as i64 + 1) * mb);
    // Micro-batch i weighs its share of the batch's targets (those that are not −1).
    let counts: Vec<f64> =
        (0..micro_batches).map(|i| part(i).y.ne(-1).sum(Kind::Int64).int64_value(&[]) as f64).collect();
    let total: f64 = counts.iter().sum();
    let shape = runner.activation(mb, t);
    let act = || Tensor::zeros(shape.as_slice(), (Kind::Float, batch.x.device()));
    let at = |plan: &[Op], op: Op| plan.iter().position(|&o| o == op);
    let (mut loss, mut grads) = (0.0, BTreeMap::<usize, Tensor>::new());
    let mut held_back: Vec<Tensor> = Vec::new();
    for (n, &op) in plan.iter().enumerate() {
        match op {
            Op::Forward(i) => {
                let x = if r == 0 {
                    Tensor::new()
                } else {
                    let mut x = act();
                    pg.recv(&mut x, r - 1)?;
                    x
                };
                let out = runner.forward(i, x, &part(i))?;
                if last {
                    loss += out.double_value(&[]) * counts[i] / total;
                    continue;
                }
                // Rank r + 1 sends the gradient of our next backward before it reads this
                // activation: send it only after that gradient has arrived.
                let next_b = plan[n + 1..].iter().find(|o| matches!(o, Op::Backward(_))).copied();
                if next_b.is_some_and(|b| at(next_plan, b) < at(next_plan, Op::Forward(i))) {
                    held_back.push(out.detach());
                } else {
                    pg.send(&out.detach(), r + 1)?;
                }
            }
            Op::Backward(i) => {
                let g_out = if last {
                    Tensor::from((counts[i] / total) as f32)
                } else {
                    let mut g = act();
                    pg.recv(&mut g, r + 1)?;
                    for a in held_back.drain(..) {
                        pg.send(&a, r + 1)?;
                    }
                    g
                };
                let (g, dx) = runner.backward(i, &g_out, &part(i))?;
                if let Some(dx) = dx {
                    pg.send(&dx, r - 1)?;
                }
                for (k, gk) in g {
                    match grads.get_mut(&k) {
                        Some(sum) => drop(sum.g_add_(&gk)),
                        None => drop(grads.insert(k, gk)),
                    }
                }
            }
        }
    }
    Ok((loss, grads))
}

/// Exercise 5 — the tied parameters' exchange, after the step. `used[q]` lists the parameters (by
/// index, in no particular order) that rank q's stages use, for every rank q of `pg`; `grads` holds
/// this rank's gradient sums (as `run_rank` returns them). A parameter used by more than one rank
/// (the GPT's `wte`, on ranks 0 and p − 1) must end with the sum of its users' gradients on every
/// one of them, the same bits on each, in its parameter's shape; every other gradient stays as it
/// is. Only a parameter's users talk, with `send` and `recv` (a rank that shares nothing sends and
/// receives nothing), and in an order that never deadlocks where a send blocks until it is read.
pub fn sum_tied(pg: &ProcessGroup, grads: &mut BTreeMap<usize, Tensor>, used: &[Vec<usize>]) -> CommResult<()> {
    let r = pg.rank();
    let n_params = used.iter().flatten().map(|&k| k + 1).max().unwrap_or(0);
    for k in 0..n_params {
        // Every rank walks the same parameters in the same order, so the users of each meet.
        let users: Vec<usize> = (0..used.len()).filter(|&q| used[q].contains(&k)).collect();
        if users.len() < 2 || !users.contains(&r) {
            continue;
        }
        let g = grads.get_mut(&k).expect("a used parameter has a gradient");
        if r == users[0] {
            // The lowest user receives the others' parts first, then sends the sum back.
            for &q in &users[1..] {
                let mut part = Tensor::zeros_like(g);
                pg.recv(&mut part, q)?;
                let _ = g.g_add_(&part);
            }
            for &q in &users[1..] {
                pg.send(g, q)?;
            }
        } else {
            pg.send(g, users[0])?;
            pg.recv(g, users[0])?;
        }
    }
    Ok(())
}
