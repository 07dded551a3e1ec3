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
//! plan** before the step ([`rendezvous_plan`]): the schedules of all ranks timed on an idealised
//! machine, each message sent at the receiver's first pause after it is made, which gives one global order of
//! computations and matched send/receive pairs. Each rank runs its own part of that order; as
//! every send meets its receive at the same point of the one order, no cycle of waiting ranks can
//! form, whatever blocks.
//!
//! The price of sends that block on the compute thread: a sender waits for its receiver to reach
//! the pair, so the step loses some of the schedule's overlap. Replayed on paper (the tests), the
//! plan ends with the idealised schedule in many shapes but up to a quarter past it in others,
//! some slower than plain 1F1B (p = 2, 5, 8 in particular). Megatron avoids it by posting
//! non-blocking sends and receives together (`batch_isend_irecv`); a sender thread per peer would
//! do it here.
//!
//! Memory: an activation waiting to be sent is the output the chunk keeps for its backward
//! anyway (no copy); a gradient waiting is extra, a few at a time (the schedule bounds them, not
//! m), and not counted in `peak_in_flight`.

use super::executor::{accumulate, micro_batch_weights, model_runner, partition, sum_tied, PipelineStep, StageRunner};
use super::{interleaved, simulate_chunks, ChunkOp, Op, Slot};
use crate::comm::{CommError, CommResult, ProcessGroup};
use crate::model::{Batch, Model};
use std::collections::BTreeMap;
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
/// virtual stage c·p + r): every rank's computations, sends and receives, each rank's list its
/// part of one global order. The order is time on an idealised machine
/// ([`simulate_chunks`], a forward 1, a backward 2): each computation at its start, each message
/// (a send paired with its receive) once its producer has finished it, at the receiver's first
/// pause, before anything that starts then, so that a send waits little (module docs: not never);
/// and since every send meets its receive at one point of one order, no cycle of waiting ranks
/// can form, whether sends block or not. It rests on every rank
/// computing the same plan (it depends on `plans` and `chunks` only), on messages between two
/// ranks arriving in the order they were sent, and on nothing else using the group during the
/// step. A message between two chunks of one rank stays on the rank. Errors: a plan that does not
/// run every virtual stage's forward and backward of every micro-batch once, or that cannot
/// finish even with unbounded buffers.
pub fn rendezvous_plan(plans: &[Vec<ChunkOp>], chunks: usize) -> Result<Vec<Vec<Action>>, String> {
    let p = plans.len();
    let n = p * chunks;
    let m = plans.iter().flatten().filter(|o| matches!(o.op, Op::Forward(_))).count() / n.max(1);
    for (r, plan) in plans.iter().enumerate() {
        let mut ops: Vec<ChunkOp> = plan.clone();
        ops.sort_by_key(|o| {
            (
                o.chunk,
                matches!(o.op, Op::Backward(_)),
                match o.op {
                    Op::Forward(i) | Op::Backward(i) => i,
                },
            )
        });
        let want: Vec<ChunkOp> = (0..chunks)
            .flat_map(|chunk| {
                let f = (0..m).map(move |i| ChunkOp { chunk, op: Op::Forward(i) });
                f.chain((0..m).map(move |i| ChunkOp { chunk, op: Op::Backward(i) }))
            })
            .collect();
        if ops != want {
            return Err(format!(
                "rank {r}: a plan must run each of its {chunks} chunks' forward and backward of each of {m} micro-batches once"
            ));
        }
    }
    let timeline = simulate_chunks(plans, chunks, 1.0, 2.0)?;
    let slot_of = |q: usize, o: ChunkOp| {
        let j = plans[q].iter().position(|x| *x == o).expect("every operation is in its rank's plan");
        &timeline.stages[q][j]
    };
    // (time, 0 for a message and 1 for a computation, rank, index in its plan)
    let mut events: Vec<(f64, u8, usize, usize)> = Vec::new();
    for (r, plan) in plans.iter().enumerate() {
        for (j, op) in plan.iter().enumerate() {
            let slot = &timeline.stages[r][j];
            events.push((slot.start, 1, r, j));
            let Some((_, to)) = makes(op.op, op.chunk * p + r, n).filter(|(_, to)| to % p != r) else { continue };
            // The message goes at the receiver's first pause once it is made: when it is made if the
            // receiver is idle then, else at the end of the computation the receiver is in. A
            // blocking send then waits as little as it can.
            let q = to % p;
            let needed = slot_of(q, ChunkOp { chunk: to / p, op: op.op }).start;
            let made = slot.end;
            let pause = timeline.stages[q].iter().find(|s| s.start < made && made < s.end).map_or(made, |s| s.end);
            events.push((pause.min(needed), 0, r, j));
        }
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then((a.1, a.2, a.3).cmp(&(b.1, b.2, b.3))));
    let mut actions: Vec<Vec<Action>> = vec![Vec::new(); p];
    for (_, kind, r, j) in events {
        let op = plans[r][j];
        if kind == 1 {
            actions[r].push(Action::Compute(op));
        } else if let Some((msg, to)) = makes(op.op, op.chunk * p + r, n) {
            actions[r].push(Action::Send { msg, to: to % p });
            actions[to % p].push(Action::Recv { msg, from: r });
        }
    }
    Ok(actions)
}

/// One training step's forward and backward of `model` under the interleaved 1F1B schedule over
/// `pg`: `chunks` model chunks a rank (the model's stages cut into p·v contiguous virtual stages,
/// rank r running c·p + r), `batch` cut into `micro_batches` micro-batches (a multiple of p, as
/// Megatron groups them). Activations (rows, T, `hidden`) f32. The same result as
/// [`pipeline_step`](super::pipeline_step) and one process, up to f32 rounding. `slots` hold
/// every computation in order (`Slot::stage` the rank); `peak_in_flight` counts chunk forwards
/// whose backward has not run. A bad batch or schedule is an error on every rank before anything
/// is sent; a stage output of the wrong shape aborts the group mid-step (every rank then fails).
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
            Action::Send { msg, to } => {
                let t = outbox.remove(&msg).ok_or_else(|| fail(bad(format!("{msg:?} sent before it was made"))))?;
                pg.send(&t, to)?
            }
            Action::Compute(ChunkOp { chunk, op }) => {
                let k = chunk * p + r;
                let i = match op {
                    Op::Forward(i) | Op::Backward(i) => i,
                };
                let part = batch.rows(i as i64 * mb, (i as i64 + 1) * mb);
                let input = match needs(op, k, n) {
                    Some(m) => Some(inbox.remove(&m).ok_or_else(|| fail(bad(format!("{m:?} used before it came"))))?),
                    None => None,
                };
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
                        accumulate(&mut grads, g);
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

    /// The plan executed on paper with sends that block until read (a pair completes when both
    /// ranks reach it), a forward taking 1 and a backward 2: the step's end, or None on a
    /// deadlock. A computation must come after the receive of what it needs.
    fn replay(plan: &[Vec<Action>], chunks: usize) -> Option<f64> {
        let p = plan.len();
        let (mut at, mut clock) = (vec![0usize; p], vec![0.0f64; p]);
        let mut got: Vec<std::collections::BTreeSet<Msg>> = vec![Default::default(); p];
        loop {
            let mut moved = false;
            for r in 0..p {
                while let Some(Action::Compute(o)) = plan[r].get(at[r]) {
                    if let Some(m) = needs(o.op, o.chunk * p + r, p * chunks) {
                        let (Msg::Activation { stage, .. } | Msg::Gradient { stage, .. }) = m;
                        assert!(stage % p == r || got[r].remove(&m), "rank {r}: {o:?} before {m:?} came");
                    }
                    clock[r] += if matches!(o.op, Op::Forward(_)) { 1.0 } else { 2.0 };
                    at[r] += 1;
                    moved = true;
                }
                if let Some(&Action::Send { msg, to }) = plan[r].get(at[r]) {
                    if plan[to].get(at[to]) == Some(&Action::Recv { msg, from: r }) {
                        let t = clock[r].max(clock[to]);
                        (clock[r], clock[to]) = (t, t);
                        got[to].insert(msg);
                        at[r] += 1;
                        at[to] += 1;
                        moved = true;
                    }
                }
            }
            if (0..p).all(|r| at[r] == plan[r].len()) {
                return Some(clock.iter().copied().fold(0.0, f64::max));
            }
            if !moved {
                return None;
            }
        }
    }

    /// Replayed with sends that block until read, every plan of p ≤ 8, v ≤ 4, m = p, 2p, 4p
    /// finishes, each computation after the receive it needs, within a quarter of the idealised
    /// schedule's step (sends free); the worst shape and how many end slower than plain 1F1B are
    /// printed (`cargo test --lib chunked -- --nocapture`).
    #[test]
    fn the_plan_keeps_most_of_the_overlap_with_blocking_sends() {
        let (mut worst, mut slower, mut shapes) = ((0.0f64, String::new()), 0, 0);
        for p in 2..=8 {
            for v in 1..=4 {
                for m in [p, 2 * p, 4 * p] {
                    let plans: Vec<Vec<ChunkOp>> = (0..p).map(|r| interleaved(p, v, m, r).unwrap()).collect();
                    let plan = rendezvous_plan(&plans, v).unwrap();
                    let end = replay(&plan, v).unwrap_or_else(|| panic!("p {p} v {v} m {m}: the plan deadlocks"));
                    let ideal = simulate_chunks(&plans, v, 1.0, 2.0).unwrap().makespan();
                    let one: Vec<Vec<ChunkOp>> = (0..p).map(|r| interleaved(p, 1, m, r).unwrap()).collect();
                    let plain = simulate_chunks(&one, 1, v as f64, 2.0 * v as f64).unwrap().makespan();
                    assert!(end <= 1.25 * ideal, "p {p} v {v} m {m}: replayed {end}, the schedule's {ideal}");
                    if end / ideal > worst.0 {
                        worst = (end / ideal, format!("p {p} v {v} m {m}: {end} against {ideal}"));
                    }
                    slower += usize::from(v > 1 && end > plain);
                    shapes += 1;
                }
            }
        }
        println!(
            "{shapes} shapes; worst {} ({:+.0}%); {slower} interleaved ones slower than plain 1F1B",
            worst.1,
            100.0 * (worst.0 - 1.0)
        );
    }

    #[test]
    fn the_plan_pairs_every_message_in_one_order() {
        for (p, v, m) in [(2, 2, 4), (4, 2, 8), (4, 4, 16), (8, 2, 16), (3, 3, 6), (4, 1, 6), (1, 3, 2)] {
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
        assert!(e.contains("deadlock") && e.contains("stage 0"), "{e}");
        // A plan that skips a backward, or runs one twice: refused.
        let e = rendezvous_plan(&[vec![f(0, 0), f(0, 1), b(0, 0), b(0, 0)]], 1).unwrap_err();
        assert!(e.contains("once"), "{e}");
    }
}
