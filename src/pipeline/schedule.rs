//! The schedules (GPipe, 1F1B), their per-stage order of forwards and backwards, and the
//! simulator that turns them into a timeline and a bubble (see the module docs of `pipeline`).

use super::ChunkOp;
use serde::{Deserialize, Serialize};

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

impl Schedule {
    /// The most micro-batches whose activations the first of `stages` pipeline ranks holds at
    /// once with `micro_batches` per step: all of them under GPipe, min(p, m) under 1F1B.
    pub fn in_flight(self, stages: f64, micro_batches: f64) -> f64 {
        match self {
            Schedule::GPipe => micro_batches,
            Schedule::OneFOneB => stages.min(micro_batches),
        }
    }
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
    let chunked: Vec<Vec<ChunkOp>> =
        plans.iter().map(|pl| pl.iter().map(|&op| ChunkOp { chunk: 0, op }).collect()).collect();
    simulate_chunks(&chunked, 1, t_f, t_b)
}

/// [`simulate_plans`] for ranks that hold `chunks` model chunks each (the interleaved schedule's
/// virtual stages: chunk c of rank r is virtual stage c·p + r of p·chunks): `F i` of virtual stage
/// k waits for `F i` of k − 1, `B i` for `B i` of k + 1, the last virtual stage's backward for its
/// own forward. `t_f` and `t_b` are one chunk's times.
pub fn simulate_chunks(plans: &[Vec<ChunkOp>], chunks: usize, t_f: f64, t_b: f64) -> Result<Timeline, String> {
    simulate_timed(plans, chunks, |_, op| if matches!(op, Op::Forward(_)) { t_f } else { t_b })
}

/// [`simulate_chunks`] with each operation's time from `time(virtual_stage, op)`: stages of
/// unequal work (the last holds the output layer) or messages between stages (lesson 15's
/// simulator adds a send to the operation that makes it).
pub fn simulate_timed(
    plans: &[Vec<ChunkOp>],
    chunks: usize,
    time: impl Fn(usize, Op) -> f64,
) -> Result<Timeline, String> {
    let p = plans.len();
    let vs = p * chunks.max(1);
    let m = plans.iter().flatten().map(|o| match o.op {
        Op::Forward(i) | Op::Backward(i) => i + 1,
    });
    let m = m.max().unwrap_or(0);
    if let Some(o) = plans.iter().flatten().find(|o| o.chunk >= chunks.max(1)) {
        return Err(format!("chunk {} of {} chunks", o.chunk, chunks));
    }
    // end[k][i]: when F i / B i ended on virtual stage k (None: not yet).
    let mut f_end = vec![vec![None::<f64>; m]; vs];
    let mut b_end = vec![vec![None::<f64>; m]; vs];
    let mut next = vec![0usize; p];
    let mut free_at = vec![0.0f64; p];
    let mut out: Vec<Vec<Slot>> = vec![Vec::new(); p];
    loop {
        let mut progressed = false;
        for s in 0..p {
            while next[s] < plans[s].len() {
                let ChunkOp { chunk, op } = plans[s][next[s]];
                let k = chunk * p + s;
                let ready = match op {
                    Op::Forward(_) if k == 0 => Some(0.0),
                    Op::Forward(i) => f_end[k - 1][i],
                    Op::Backward(i) if k + 1 == vs => f_end[k][i],
                    Op::Backward(i) => b_end[k + 1][i],
                };
                let Some(ready) = ready else { break };
                let start = ready.max(free_at[s]);
                let end = start + time(k, op);
                match op {
                    Op::Forward(i) => f_end[k][i] = Some(end),
                    Op::Backward(i) => b_end[k][i] = Some(end),
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
