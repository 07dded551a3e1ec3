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

/// Which schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// All forwards, then all backwards.
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
    let (p, m) = (stages, micro_batches);
    let plans: Vec<Vec<Op>> = (0..p).map(|s| schedule(kind, p, m, s)).collect();
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
        if next.iter().zip(&plans).all(|(n, pl)| *n == pl.len()) {
            return Timeline { stages: out };
        }
        assert!(progressed, "schedule {kind:?} deadlocks with {p} stages and {m} micro-batches");
    }
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
