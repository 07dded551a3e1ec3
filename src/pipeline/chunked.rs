//! The interleaved 1F1B schedule on real ranks (Narayanan et al. 2021, §2.2.2): each of p ranks
//! runs v model chunks (virtual stages r, r + p, …, of p·v), so a micro-batch crosses the ranks v
//! times, and the last rank hands each chunk's activations back to the first.
//!
//! ```text
//! p = 2, v = 2: virtual stages 0 1 2 3 on ranks 0 1 0 1
//! forward:  rank 0 (stage 0) → rank 1 (1) → rank 0 (2) → rank 1 (3, the loss)
//! backward: the same path reversed, each stage's input gradient to the rank of the stage before
//! ```
//!
//! Sends block until the receiver reads (a full socket or shared-memory ring; NCCL always waits
//! for its peer), and with v chunks the messages go round a ring: the hold-back rule of the plain
//! executor (one neighbour each way) no longer suffices. Megatron posts each step's sends and
//! receives together (`batch_isend_irecv`). Here every rank works out the same **rendezvous
//! plan** before the step ([`rendezvous_plan`]): the schedules of all ranks run on paper with
//! each message sent at the moment its receiver needs it, which gives one global order of
//! computations and matched send/receive pairs. Each rank runs its own part of that order; as
//! every send meets its receive at the same point of the one order, no cycle of waiting ranks can
//! form, whatever blocks.

use super::executor::{micro_batch_weights, model_runner, partition, sum_tied, PipelineStep, StageRunner};
use super::{interleaved, ChunkOp, Op, Slot};
use crate::comm::{CommError, CommResult, ProcessGroup};
use crate::model::{Batch, Model};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;
use tch::{Kind, Tensor};

/// A message between virtual stages: the activation a stage's forward sends to the next, or the
/// gradient of its input its backward sends to the previous, for one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Msg {
    /// The output of virtual stage `stage` for micro-batch `mb`.
    Activation { stage: usize, mb: usize },
    /// The gradient of virtual stage `stage`'s input for micro-batch `mb`.
    Gradient { stage: usize, mb: usize },
}

/// One step of a rank's part of the rendezvous plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Compute(ChunkOp),
    Send { msg: Msg, to: usize },
    Recv { msg: Msg, from: usize },
}

/// What a chunk operation of virtual stage `k` (of `n`) needs, and what it produces.
fn needs(op: Op, k: usize, n: usize) -> Option<Msg> {
    match op {
        Op::Forward(mb) if k > 0 => Some(Msg::Activation { stage: k - 1, mb }),
        Op::Backward(mb) if k + 1 < n => Some(Msg::Gradient { stage: k + 1, mb }),
        _ => None,
    }
}
fn makes(op: Op, k: usize, n: usize) -> Option<(Msg, usize)> {
    match op {
        Op::Forward(mb) if k + 1 < n => Some((Msg::Activation { stage: k, mb }, k + 1)),
        Op::Backward(mb) if k > 0 => Some((Msg::Gradient { stage: k, mb }, k - 1)),
        _ => None,
    }
}

/// The rendezvous plan of `plans` (rank r's chunk operations in its order; rank r's chunk c is
/// virtual stage c·p + r): every rank's computations, sends and receives, in an order that is the
/// same global order seen from each rank. A message is sent when its receiver needs it (a rank
/// whose next operation waits for a message not yet produced waits too). A message between two
/// chunks of one rank stays on the rank. An error names the ranks and messages of a schedule
/// that cannot finish even with unbounded buffers.
pub fn rendezvous_plan(plans: &[Vec<ChunkOp>], chunks: usize) -> Result<Vec<Vec<Action>>, String> {
    let p = plans.len();
    let n = p * chunks;
    let owner = |k: usize| k % p;
    let mut next = vec![0usize; p];
    let mut have: Vec<BTreeSet<Msg>> = vec![BTreeSet::new(); p];
    let mut outbox: Vec<BTreeSet<Msg>> = vec![BTreeSet::new(); p];
    let mut actions: Vec<Vec<Action>> = vec![Vec::new(); p];
    loop {
        let mut moved = false;
        for r in 0..p {
            while let Some(&op) = plans[r].get(next[r]) {
                if op.chunk >= chunks {
                    return Err(format!("rank {r}: chunk {} of {chunks}", op.chunk));
                }
                let k = op.chunk * p + r;
                if let Some(msg) = needs(op.op, k, n).filter(|m| !have[r].contains(m)) {
                    let from = owner(match msg {
                        Msg::Activation { stage, .. } | Msg::Gradient { stage, .. } => stage,
                    });
                    if !outbox[from].remove(&msg) {
                        break; // not produced yet: rank r waits
                    }
                    actions[from].push(Action::Send { msg, to: r });
                    actions[r].push(Action::Recv { msg, from });
                    have[r].insert(msg);
                }
                actions[r].push(Action::Compute(op));
                next[r] += 1;
                moved = true;
                if let Some((msg, to)) = makes(op.op, k, n) {
                    if owner(to) == r {
                        have[r].insert(msg);
                    } else {
                        outbox[r].insert(msg);
                    }
                }
            }
        }
        if (0..p).all(|r| next[r] == plans[r].len()) {
            break;
        }
        if !moved {
            let waiting: Vec<String> = (0..p)
                .filter(|&r| next[r] < plans[r].len())
                .map(|r| format!("rank {r} at {:?}", plans[r][next[r]]))
                .collect();
            return Err(format!("the schedule cannot finish: {}", waiting.join(", ")));
        }
    }
    if let Some((r, m)) = outbox.iter().enumerate().find_map(|(r, o)| o.iter().next().map(|m| (r, *m))) {
        return Err(format!("rank {r} produced {m:?}, which no operation reads"));
    }
    Ok(actions)
}

/// One training step's forward and backward of `model` under the interleaved 1F1B schedule over
/// `pg`: `chunks` model chunks a rank (the model's stages cut into p·v contiguous virtual stages,
/// rank r running c·p + r), `batch` cut into `micro_batches` micro-batches (a multiple of p, as
/// Megatron groups them). Activations (rows, T, `hidden`) f32. The same result as
/// [`pipeline_step`](super::pipeline_step) and one process, up to f32 rounding. `slots` hold
/// every computation in order (`Slot::stage` the rank); `peak_in_flight` counts chunk forwards
/// whose backward has not run. Bad shapes and schedules are errors on every rank before anything
/// is sent.
pub fn interleaved_step(
    pg: &ProcessGroup,
    model: &dyn Model,
    chunks: usize,
    batch: &Batch,
    micro_batches: usize,
    hidden: i64,
) -> CommResult<PipelineStep> {
    let (p, r) = (pg.world_size(), pg.rank());
    let bad = |m: String| CommError::InvalidArgument(format!("rank {r}: interleaved pipeline: {m}"));
    let n = p * chunks.max(1);
    let parts = partition(model.num_stages(), n).map_err(bad)?;
    let plans: Vec<Vec<ChunkOp>> =
        (0..p).map(|q| interleaved(p, chunks, micro_batches, q)).collect::<Result<_, _>>().map_err(bad)?;
    let mine = rendezvous_plan(&plans, chunks).map_err(bad)?.swap_remove(r);
    let (mb, t, weight) = micro_batch_weights(batch, micro_batches).map_err(bad)?;
    let mut runners: Vec<Box<dyn StageRunner + '_>> =
        (0..chunks).map(|c| Box::new(model_runner(model, parts[c * p + r].clone(), hidden)) as Box<_>).collect();
    let shape = runners[0].activation(mb, t);
    let uses = model.stage_uses();
    let used: Vec<Vec<usize>> = (0..p)
        .map(|q| {
            let mut v: Vec<usize> =
                (0..chunks).flat_map(|c| parts[c * p + q].clone()).flat_map(|s| uses[s].iter().copied()).collect();
            v.sort_unstable();
            v.dedup();
            v
        })
        .collect();
    let fail = |e: CommError| {
        pg.abort(&format!("rank {r}: interleaved pipeline stage: {e}"));
        e
    };
    let mut inbox: BTreeMap<Msg, Tensor> = BTreeMap::new();
    let mut outbox: BTreeMap<Msg, Tensor> = BTreeMap::new();
    let mut grads: BTreeMap<usize, Tensor> = BTreeMap::new();
    let (mut held, mut peak, mut losses) = (0usize, 0usize, 0.0f64);
    let mut slots = Vec::new();
    pg.barrier()?;
    let t0 = Instant::now();
    for a in mine {
        match a {
            Action::Recv { msg, from } => {
                let mut x = Tensor::zeros(shape.as_slice(), (Kind::Float, batch.x.device()));
                pg.recv(&mut x, from)?;
                inbox.insert(msg, x);
            }
            Action::Send { msg, to } => pg.send(&outbox.remove(&msg).expect("planned before its send"), to)?,
            Action::Compute(ChunkOp { chunk, op }) => {
                let k = chunk * p + r;
                let i = match op {
                    Op::Forward(i) | Op::Backward(i) => i,
                };
                let part = batch.rows(i as i64 * mb, (i as i64 + 1) * mb);
                let input = needs(op, k, n).map(|m| inbox.remove(&m).expect("received before its use"));
                let start = t0.elapsed().as_secs_f64();
                let output = match op {
                    Op::Forward(_) => {
                        let y = runners[chunk].forward(i, input.unwrap_or_else(Tensor::new), &part).map_err(fail)?;
                        held += 1;
                        peak = peak.max(held);
                        if k + 1 == n {
                            losses += y.double_value(&[]) * weight[i];
                            None
                        } else if y.size() != shape || y.kind() != Kind::Float {
                            let e = format!(
                                "stage output {:?} {:?}, but the pipeline sends {shape:?} f32",
                                y.size(),
                                y.kind()
                            );
                            pg.abort(&e);
                            return Err(bad(e));
                        } else {
                            Some(y.detach())
                        }
                    }
                    Op::Backward(_) => {
                        let g_out = input.unwrap_or_else(|| Tensor::from(weight[i]).to_kind(Kind::Float));
                        let (g, dx) = runners[chunk].backward(i, &g_out, &part).map_err(fail)?;
                        for (j, gj) in g {
                            match grads.get_mut(&j) {
                                Some(acc) => drop(acc.g_add_(&gj)),
                                None => drop(grads.insert(j, gj)),
                            }
                        }
                        held -= 1;
                        dx
                    }
                };
                slots.push(Slot { stage: r, op, start, end: t0.elapsed().as_secs_f64() });
                if let (Some((msg, to)), Some(out)) = (makes(op, k, n), output) {
                    if to % p == r {
                        inbox.insert(msg, out);
                    } else {
                        outbox.insert(msg, out);
                    }
                }
            }
        }
    }
    let step_s = t0.elapsed().as_secs_f64();
    sum_tied(pg, &mut grads, &used)?;
    let mut l = Tensor::from_slice(&[if r == (n - 1) % p { losses } else { 0.0 }]);
    pg.broadcast(&mut l, (n - 1) % p)?;
    Ok(PipelineStep { loss: l.double_value(&[0]), grads, slots, peak_in_flight: peak, step_s })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_pairs_every_message_in_one_order() {
        for (p, v, m) in [(2, 2, 4), (4, 2, 8), (3, 3, 6), (4, 1, 6), (1, 3, 2)] {
            let plans: Vec<Vec<ChunkOp>> = (0..p).map(|r| interleaved(p, v, m, r).unwrap()).collect();
            let plan = rendezvous_plan(&plans, v).unwrap();
            for r in 0..p {
                // Every computation, in the schedule's order.
                let ops: Vec<ChunkOp> =
                    plan[r].iter().filter_map(|a| if let Action::Compute(o) = a { Some(*o) } else { None }).collect();
                assert_eq!(ops, plans[r], "p {p} v {v} m {m} rank {r}");
                // Each pair of ranks: the sends of one match the receives of the other, in order.
                for q in 0..p {
                    let sent: Vec<Msg> = plan[r]
                        .iter()
                        .filter_map(
                            |a| if let Action::Send { msg, to } = a { (*to == q).then_some(*msg) } else { None },
                        )
                        .collect();
                    let got: Vec<Msg> = plan[q]
                        .iter()
                        .filter_map(|a| {
                            if let Action::Recv { msg, from } = a {
                                (*from == r).then_some(*msg)
                            } else {
                                None
                            }
                        })
                        .collect();
                    assert_eq!(sent, got, "p {p} v {v} m {m}: rank {r} to rank {q}");
                }
            }
            // Messages: a micro-batch crosses n − 1 boundaries each way; those inside a rank stay.
            let n = p * v;
            let crossing = (0..n - 1).filter(|k| k % p != (k + 1) % p).count();
            let sends: usize = plan.iter().flatten().filter(|a| matches!(a, Action::Send { .. })).count();
            assert_eq!(sends, 2 * m * crossing, "p {p} v {v} m {m}");
        }
        // Two ranks that both wait for the other's first message: refused, with where they wait.
        let f = |chunk, i| ChunkOp { chunk, op: Op::Forward(i) };
        let b = |chunk, i| ChunkOp { chunk, op: Op::Backward(i) };
        let stuck = vec![vec![b(0, 0), f(0, 0)], vec![f(0, 0), b(0, 0)]];
        let e = rendezvous_plan(&stuck, 1).unwrap_err();
        assert!(e.contains("cannot finish") && e.contains("rank 0"), "{e}");
    }
}
