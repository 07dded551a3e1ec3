//! Pipeline schedules (lesson 13): which forward and backward each stage runs, in which order.
//!
//! A model cut into `p` consecutive stages (one per rank) trains a batch as `m` micro-batches:
//! stage s runs the forward of micro-batch i after stage s−1 sent it the activations, and its
//! backward after stage s+1 sent back their gradient. What a schedule chooses is the order of one
//! stage's forwards `F i` and backwards `B i`:
//!
//! * **GPipe** (Huang et al. 2019): every forward, then every backward. Simple; each stage holds
//!   the activations of all `m` micro-batches at the turn.
//! * **1F1B** (PipeDream-Flush, Narayanan et al. 2021; Megatron's default): stage s runs
//!   `p − s − 1` warm-up forwards, then alternates one forward and one backward, then drains the
//!   remaining backwards. The same bubble as GPipe, but a stage never holds more than `p − s`
//!   micro-batches' activations.
//!
//! ```text
//! 1F1B, p = 4, m = 8, stage 0:  F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7
//!                    stage 3:  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7
//! ```
//!
//! [`simulate`] runs a schedule on an idealised machine (a forward takes `t_f`, a backward `t_b`,
//! sends are free) and gives each operation's start and end: the pipeline diagram, the **bubble**
//! (idle time over the step) — `(p − 1)/(m + p − 1)` for both schedules when every stage is
//! equally fast — and the peak number of micro-batches whose activations a stage holds.

use serde::{Deserialize, Serialize};

pub mod train;

/// A pipeline-parallel run's shape (`train --pp N --micro-batches M --schedule S`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineConfig {
    /// Pipeline ranks (stages of ranks) per replica; 1: no pipeline.
    pub stages: usize,
    /// Micro-batches each replica's batch is cut into.
    pub micro_batches: usize,
    /// The order of each stage's forwards and backwards.
    pub schedule: Schedule,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig { stages: 1, micro_batches: 4, schedule: Schedule::OneFOneB }
    }
}

/// Which schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// All forwards, then all backwards.
    #[value(name = "gpipe")]
    GPipe,
    /// Warm-up forwards, then one forward one backward, then the remaining backwards.
    #[value(name = "1f1b")]
    #[serde(rename = "1f1b")]
    OneFOneB,
}

/// One step of a stage's schedule: the forward or the backward of a micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    Forward(usize),
    Backward(usize),
}

/// Checks the shape of a pipeline: at least one stage and one micro-batch.
pub fn check(stages: usize, micro_batches: usize) -> Result<(), String> {
    if stages == 0 || micro_batches == 0 {
        return Err(format!(
            "a pipeline needs at least one stage and one micro-batch (got {stages} and {micro_batches})"
        ));
    }
    Ok(())
}

/// The order of stage `stage`'s operations under `kind`, with `stages` stages and
/// `micro_batches` micro-batches: every micro-batch's forward and backward, once each.
pub fn schedule(kind: Schedule, stages: usize, micro_batches: usize, stage: usize) -> Vec<Op> {
    assert!(stage < stages, "stage {stage} of {stages}");
    let m = micro_batches;
    match kind {
        Schedule::GPipe => (0..m).map(Op::Forward).chain((0..m).map(Op::Backward)).collect(),
        Schedule::OneFOneB => {
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
    }
}

/// When one operation ran in [`simulate`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Slot {
    pub stage: usize,
    pub op: Op,
    pub start: f64,
    pub end: f64,
}

/// A simulated step: every operation's time slot, per stage in its schedule's order.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Timeline {
    pub stages: Vec<Vec<Slot>>,
}

impl Timeline {
    /// When the last operation ends.
    pub fn makespan(&self) -> f64 {
        self.stages.iter().flatten().map(|s| s.end).fold(0.0, f64::max)
    }
    /// Idle fraction of stage `s` over the step: 1 − busy / makespan.
    pub fn bubble(&self, s: usize) -> f64 {
        let busy: f64 = self.stages[s].iter().map(|x| x.end - x.start).sum();
        1.0 - busy / self.makespan()
    }
    /// The most micro-batches whose activations stage `s` holds at once (forward done, backward
    /// not yet).
    pub fn peak_in_flight(&self, s: usize) -> usize {
        let (mut now, mut peak) = (0usize, 0usize);
        for x in &self.stages[s] {
            match x.op {
                Op::Forward(_) => {
                    now += 1;
                    peak = peak.max(now);
                }
                Op::Backward(_) => now -= 1,
            }
        }
        peak
    }
}

/// Run `kind` on an idealised pipeline: each stage runs its schedule in order, a forward takes
/// `t_f` and a backward `t_b`, `F i` on stage s waits for `F i` on stage s−1, `B i` waits for `B i`
/// on stage s+1 (the last stage's backward follows its own forward), and sends take no time.
pub fn simulate(kind: Schedule, stages: usize, micro_batches: usize, t_f: f64, t_b: f64) -> Timeline {
    check(stages, micro_batches).expect("simulate: a pipeline shape");
    let plans: Vec<Vec<Op>> = (0..stages).map(|s| schedule(kind, stages, micro_batches, s)).collect();
    simulate_plans(&plans, t_f, t_b).expect("GPipe and 1F1B never deadlock")
}

/// [`simulate`] for any plans (one per stage, each a list of that stage's operations in order):
/// an error if they can never finish (a stage waiting for an operation that waits for it).
pub fn simulate_plans(plans: &[Vec<Op>], t_f: f64, t_b: f64) -> Result<Timeline, String> {
    let p = plans.len();
    let m = plans.iter().flatten().map(|o| match *o {
        Op::Forward(i) | Op::Backward(i) => i + 1,
    });
    let m = m.max().unwrap_or(0);
    // end[s][i]: when F i / B i ended on stage s (None: not yet).
    let mut f_end = vec![vec![None::<f64>; m]; p];
    let mut b_end = vec![vec![None::<f64>; m]; p];
    let mut next = vec![0usize; p];
    let mut free_at = vec![0.0f64; p];
    let mut out: Vec<Vec<Slot>> = vec![Vec::new(); p];
    loop {
        let mut progressed = false;
        for s in 0..p {
            while next[s] < plans[s].len() {
                let op = plans[s][next[s]];
                let ready = match op {
                    Op::Forward(i) => {
                        if s == 0 {
                            Some(0.0)
                        } else {
                            f_end[s - 1][i]
                        }
                    }
                    Op::Backward(i) => {
                        if s + 1 == p {
                            f_end[s][i]
                        } else {
                            b_end[s + 1][i]
                        }
                    }
                };
                let Some(ready) = ready else { break };
                let start = ready.max(free_at[s]);
                let end = start + if matches!(op, Op::Forward(_)) { t_f } else { t_b };
                match op {
                    Op::Forward(i) => f_end[s][i] = Some(end),
                    Op::Backward(i) => b_end[s][i] = Some(end),
                }
                free_at[s] = end;
                out[s].push(Slot { stage: s, op, start, end });
                next[s] += 1;
                progressed = true;
            }
        }
        if next.iter().zip(plans).all(|(n, pl)| *n == pl.len()) {
            return Ok(Timeline { stages: out });
        }
        if !progressed {
            let stuck: Vec<String> = (0..p)
                .filter(|&s| next[s] < plans[s].len())
                .map(|s| format!("stage {s} at {:?}", plans[s][next[s]]))
                .collect();
            return Err(format!("the plans deadlock: {}", stuck.join(", ")));
        }
    }
}

/// An ASCII pipeline diagram of `t`, one row per stage, one column per `unit` of time: the
/// micro-batch's digit (mod 10) for its forward, a letter for its backward (a = 0, b = 1, …),
/// `.` for idle.
pub fn ascii_diagram(t: &Timeline, unit: f64) -> String {
    let cols = (t.makespan() / unit).round() as usize;
    let mut out = String::new();
    for (s, slots) in t.stages.iter().enumerate() {
        let mut row = vec!['.'; cols];
        for x in slots {
            let (a, b) = ((x.start / unit).round() as usize, (x.end / unit).round() as usize);
            let ch = match x.op {
                Op::Forward(i) => char::from(b'0' + (i % 10) as u8),
                Op::Backward(i) => char::from(b'a' + (i % 26) as u8),
            };
            row[a.min(cols)..b.min(cols)].iter_mut().for_each(|c| *c = ch);
        }
        out.push_str(&format!("stage {s} |{}|\n", row.into_iter().collect::<String>()));
    }
    out
}

/// The bubble of GPipe and 1F1B with equal stages: (p − 1)/(m + p − 1).
pub fn bubble_fraction(stages: usize, micro_batches: usize) -> f64 {
    (stages as f64 - 1.0) / (micro_batches + stages - 1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use Op::{Backward as B, Forward as F};

    #[test]
    fn one_f_one_b_orders_by_hand() {
        // Megatron's 1F1B for p = 4, m = 8 (warm-up p − s − 1 forwards), written out by hand.
        assert_eq!(
            schedule(Schedule::OneFOneB, 4, 8, 0),
            vec![F(0), F(1), F(2), F(3), B(0), F(4), B(1), F(5), B(2), F(6), B(3), F(7), B(4), B(5), B(6), B(7)]
        );
        assert_eq!(
            schedule(Schedule::OneFOneB, 4, 8, 3),
            vec![F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3), F(4), B(4), F(5), B(5), F(6), B(6), F(7), B(7)]
        );
        // Fewer micro-batches than the warm-up: all forwards, then all backwards.
        assert_eq!(schedule(Schedule::OneFOneB, 4, 2, 0), vec![F(0), F(1), B(0), B(1)]);
        assert_eq!(schedule(Schedule::GPipe, 2, 3, 1), vec![F(0), F(1), F(2), B(0), B(1), B(2)]);
    }

    #[test]
    fn simulated_bubble_and_memory() {
        for kind in [Schedule::GPipe, Schedule::OneFOneB] {
            for (p, m) in [(1, 1), (2, 4), (4, 8), (4, 3), (8, 32)] {
                let t = simulate(kind, p, m, 1.0, 2.0);
                // Equal stages: every stage idles (p − 1)(t_f + t_b) of (m + p − 1)(t_f + t_b).
                for s in 0..p {
                    assert!((t.bubble(s) - bubble_fraction(p, m)).abs() < 1e-12, "{kind:?} p={p} m={m} s={s}");
                }
                let peak = t.peak_in_flight(0);
                let want = if kind == Schedule::GPipe { m } else { p.min(m) };
                assert_eq!(peak, want, "{kind:?} p={p} m={m}: stage 0 holds {peak} micro-batches");
            }
        }
    }
}

use crate::comm::{CommError, CommResult, ProcessGroup};
use crate::model::{Batch, Model};
use std::collections::BTreeMap;
use std::ops::Range;
use std::time::Instant;
use tch::{Kind, Tensor};

/// The model stages (`0..num_stages`: for the GPT, the embeddings, each block, the head and loss)
/// of each of `ranks` pipeline ranks: contiguous, as equal as they divide (the first ranks take
/// one more). More ranks than stages is an error.
pub fn partition(num_stages: usize, ranks: usize) -> Result<Vec<Range<usize>>, String> {
    if ranks == 0 || ranks > num_stages {
        return Err(format!("{ranks} pipeline ranks for a model of {num_stages} stages: each rank needs at least one"));
    }
    let (q, extra) = (num_stages / ranks, num_stages % ranks);
    let mut out = Vec::new();
    let mut lo = 0;
    for r in 0..ranks {
        let n = q + usize::from(r < extra);
        out.push(lo..lo + n);
        lo += n;
    }
    Ok(out)
}

/// What one pipelined step did on this rank.
pub struct PipelineStep {
    /// The batch's mean loss (over its micro-batches; the same on every rank).
    pub loss: f64,
    /// Gradients of the parameters this rank's stages use (by index in the model's
    /// `named_parameters`), summed over micro-batches — tied parameters used on several ranks
    /// (the GPT's embedding, also its output head) summed over those ranks too.
    pub grads: BTreeMap<usize, Tensor>,
    /// When each of this rank's operations computed (seconds from the step's start; from after
    /// the receive it waited for to before its send), in schedule order: the pipeline diagram,
    /// measured. `Slot::stage` is the pipeline rank.
    pub slots: Vec<Slot>,
    /// The most micro-batches whose activations this rank held at once.
    pub peak_in_flight: usize,
    /// The step's duration on this rank (seconds).
    pub step_s: f64,
}

impl PipelineStep {
    /// This rank's idle fraction of its step: 1 − busy / step time.
    pub fn bubble(&self) -> f64 {
        let busy: f64 = self.slots.iter().map(|s| s.end - s.start).sum();
        1.0 - busy / self.step_s
    }
}

/// One training step's forward and backward of `model` as a pipeline over `pg` (rank r runs the
/// stages `partition(…)[r]`), `batch` cut into `micro_batches` equal micro-batches, in the order
/// `kind` gives. Activations (rows, T, `hidden`) f32 go forward to the next rank and their
/// gradients come back, point to point. Every rank builds the same `model` (the same seed) and
/// computes only its stages. Bad shapes are errors on every rank before anything is computed.
pub fn pipeline_step(
    pg: &ProcessGroup,
    model: &dyn Model,
    kind: Schedule,
    batch: &Batch,
    micro_batches: usize,
    hidden: i64,
) -> CommResult<PipelineStep> {
    let (p, r) = (pg.world_size(), pg.rank());
    let bad = |m: String| CommError::InvalidArgument(format!("rank {r}: pipeline: {m}"));
    let parts = partition(model.num_stages(), p).map_err(bad)?;
    check(p, micro_batches).map_err(bad)?;
    let (rows, t) = batch.x.size2().map_err(|e| bad(format!("batch (B, T): {e}")))?;
    if rows % micro_batches as i64 != 0 {
        return Err(bad(format!("{micro_batches} micro-batches do not divide a batch of {rows} rows")));
    }
    let mb = rows / micro_batches as i64;
    // The GPT's loss is the mean over targets other than −1: micro-batch i's mean weighs
    // (its targets) / (the batch's), so that the step's loss is the batch's mean. Every rank
    // has the batch: no communication.
    let counts: Vec<f64> = (0..micro_batches as i64)
        .map(|i| batch.y.narrow(0, i * mb, mb).ne(-1).sum(Kind::Int64).int64_value(&[]) as f64)
        .collect();
    if let Some(i) = counts.iter().position(|&c| c == 0.0) {
        return Err(bad(format!("micro-batch {i} has no target (all −1): its mean loss is undefined")));
    }
    let total: f64 = counts.iter().sum();
    let weight: Vec<f64> = counts.iter().map(|c| c / total).collect();
    let mine = parts[r].clone();
    let last = r + 1 == p;
    // Which parameters each rank's stages use.
    let uses = model.stage_uses();
    let used_by = |q: usize| -> Vec<usize> {
        let mut v: Vec<usize> = parts[q].clone().flat_map(|s| uses[s].iter().copied()).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let my_params = used_by(r);
    let params = model.parameters();
    let mut grads: BTreeMap<usize, Tensor> = BTreeMap::new();
    let mut saved: Vec<Option<(Option<Tensor>, Tensor)>> = (0..micro_batches).map(|_| None).collect();
    let (mut held, mut peak, mut losses) = (0usize, 0usize, 0.0f64);
    let act = |_: usize| Tensor::zeros([mb, t, hidden], (Kind::Float, batch.x.device()));
    // A send may block until the receiver reads (a full socket or shared-memory ring; NCCL always
    // waits for its peer). Two neighbours that both send first deadlock: in 1F1B's steady state
    // rank r sends activation i while rank r + 1 sends it gradient j. So rank r holds an
    // activation back until it has received the gradient that rank r + 1 sends before reading
    // that activation (Megatron pairs them in one send_forward_recv_backward).
    let next_plan = if last { Vec::new() } else { schedule(kind, p, micro_batches, r + 1) };
    let pos = |op: Op| next_plan.iter().position(|&o| o == op);
    let mut held_back: Vec<(usize, Tensor)> = Vec::new(); // (micro-batch, activation) not yet sent
    pg.barrier()?;
    let t0 = Instant::now();
    let mut slots = Vec::new();
    let plan = schedule(kind, p, micro_batches, r);
    for (n, &op) in plan.iter().enumerate() {
        // The slot is the compute: from after the receive that op waits for to before its send
        // (waiting for a neighbour is the bubble, not work).
        let (start, end);
        match op {
            Op::Forward(i) => {
                let part = batch.rows(i as i64 * mb, (i as i64 + 1) * mb);
                let x_leaf = if r == 0 {
                    None
                } else {
                    let mut x = act(i);
                    pg.recv(&mut x, r - 1)?; // (mb, T, hidden) from the previous stage
                    Some(x.set_requires_grad(true))
                };
                start = t0.elapsed().as_secs_f64();
                let mut x = x_leaf.as_ref().map_or_else(Tensor::new, |x| x.shallow_clone());
                for s in mine.clone() {
                    x = model.stage_forward(s, &x, &part);
                }
                end = t0.elapsed().as_secs_f64();
                if last {
                    losses += x.double_value(&[]) * weight[i];
                } else {
                    let want = [mb, t, hidden];
                    if x.size() != want || x.kind() != Kind::Float {
                        let e = format!(
                            "stage output {:?} {:?}, but the pipeline sends (rows, T, hidden) = {want:?} f32",
                            x.size(),
                            x.kind()
                        );
                        pg.abort(&e);
                        return Err(bad(e));
                    }
                    // Our next backward's gradient comes from rank r + 1; if it sends that before
                    // reading this activation, receive it first (at that backward).
                    let next_b = plan[n + 1..].iter().find(|o| matches!(o, Op::Backward(_))).copied();
                    let theirs_first = next_b.is_some_and(|b| pos(b) < pos(Op::Forward(i)));
                    if theirs_first {
                        held_back.push((i, x.detach()));
                    } else {
                        pg.send(&x.detach(), r + 1)?;
                    }
                }
                saved[i] = Some((x_leaf, x));
                held += 1;
                peak = peak.max(held);
            }
            Op::Backward(i) => {
                let (x_leaf, out) =
                    saved[i].take().ok_or_else(|| bad(format!("backward of micro-batch {i} before its forward")))?;
                let g_out = if last {
                    // The batch's mean over its targets: micro-batch i weighs its share of them.
                    Tensor::from(weight[i]).to_kind(Kind::Float)
                } else {
                    let mut g = act(i);
                    pg.recv(&mut g, r + 1)?; // dL/d(our output) from the next stage
                                             // Now the activations held back for this gradient can go.
                    for (_, a) in held_back.drain(..) {
                        pg.send(&a, r + 1)?;
                    }
                    g
                };
                start = t0.elapsed().as_secs_f64();
                let mut wrt: Vec<&Tensor> = my_params.iter().map(|&k| &params[k]).collect();
                if let Some(x) = &x_leaf {
                    wrt.push(x);
                }
                let surrogate = (&out * &g_out).sum(Kind::Float);
                let mut g = Tensor::run_backward(&[&surrogate], &wrt, false, false);
                end = t0.elapsed().as_secs_f64();
                if x_leaf.is_some() {
                    let dx = g.pop().expect("dL/dx");
                    pg.send(&dx, r - 1)?;
                }
                for (&k, gk) in my_params.iter().zip(g) {
                    match grads.get_mut(&k) {
                        Some(acc) => drop(acc.g_add_(&gk)),
                        None => drop(grads.insert(k, gk)),
                    }
                }
                held -= 1;
            }
        }
        slots.push(Slot { stage: r, op, start, end });
    }
    let step_s = t0.elapsed().as_secs_f64();
    // Tied parameters used on several ranks: the lowest user collects the others' gradients,
    // sums them and sends the sum back (the GPT's embedding: ranks 0 and p − 1).
    for k in 0..params.len() {
        let users: Vec<usize> = (0..p).filter(|&q| used_by(q).contains(&k)).collect();
        if users.len() < 2 || !users.contains(&r) {
            continue;
        }
        let g = grads.get_mut(&k).expect("a used parameter has a gradient");
        if r == users[0] {
            for &q in &users[1..] {
                let mut other = Tensor::zeros_like(g);
                pg.recv(&mut other, q)?;
                let _ = g.g_add_(&other);
            }
            for &q in &users[1..] {
                pg.send(g, q)?;
            }
        } else {
            pg.send(g, users[0])?;
            pg.recv(g, users[0])?;
        }
    }
    // The loss from the last rank to everyone.
    let mut l = Tensor::from_slice(&[if last { losses } else { 0.0 }]);
    pg.broadcast(&mut l, p - 1)?;
    Ok(PipelineStep { loss: l.double_value(&[0]), grads, slots, peak_in_flight: peak, step_s })
}
