//! The schedules (GPipe, 1F1B), their per-stage order of forwards and backwards, and the
//! simulator that turns them into a timeline and a bubble (see the module docs of `pipeline`).

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

/// One operation of one model chunk (the interleaved schedule's unit of work).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkOp {
    pub chunk: usize,
    pub op: Op,
}

/// The interleaved 1F1B schedule (Narayanan et al. 2021, §2.2.2; Megatron-LM's
/// `forward_backward_pipelining_with_interleaving`): each of the `stages` ranks holds `chunks`
/// model chunks — rank r holds virtual stages r, r + p, r + 2p, … of p·v — so a micro-batch
/// passes every rank v times, and the bubble shrinks v-fold, (p − 1)/(v·m + p − 1) of the step
/// with equal chunks, for v times the point-to-point messages. Rank `rank`'s order: the
/// forwards go through the chunks in groups of p micro-batches (chunk 0 of micro-batches 0..p,
/// chunk 1 of the same, …, then the next p micro-batches), the backwards through the chunks in
/// reverse; (p − r − 1)·2 + (v − 1)·p warm-up forwards, then one forward one backward, then the
/// rest of the backwards. With Megatron's default group of p micro-batches
/// (`microbatch_group_size_per_vp_stage`), the micro-batches must be a multiple of p; so here.
pub fn interleaved(stages: usize, chunks: usize, micro_batches: usize, rank: usize) -> Result<Vec<ChunkOp>, String> {
    check(stages, micro_batches)?;
    let (p, v, m) = (stages, chunks, micro_batches);
    if v == 0 || rank >= p {
        return Err(format!("rank {rank} of {p} pipeline ranks with {v} chunks each"));
    }
    if v == 1 {
        // Megatron runs its plain 1F1B when there is one chunk (the interleaved warm-up would be
        // longer for nothing).
        return Ok(schedule(Schedule::OneFOneB, p, m, rank).into_iter().map(|op| ChunkOp { chunk: 0, op }).collect());
    }
    if m % p != 0 {
        return Err(format!(
            "the interleaved schedule takes micro-batches in groups of the {p} pipeline ranks: {m} is not a multiple of {p}"
        ));
    }
    let total = m * v;
    // The k-th forward (backward) of this rank: which chunk, which micro-batch.
    let at = |k: usize, forward: bool| {
        let chunk = (k % (p * v)) / p;
        let chunk = if forward { chunk } else { v - 1 - chunk };
        (chunk, (k / (p * v)) * p + k % p)
    };
    let f = |k| {
        let (chunk, i) = at(k, true);
        ChunkOp { chunk, op: Op::Forward(i) }
    };
    let b = |k| {
        let (chunk, i) = at(k, false);
        ChunkOp { chunk, op: Op::Backward(i) }
    };
    let warmup = ((p - rank - 1) * 2 + (v - 1) * p).min(total);
    let mut ops: Vec<ChunkOp> = (0..warmup).map(f).collect();
    for k in 0..total - warmup {
        ops.push(f(warmup + k));
        ops.push(b(k));
    }
    ops.extend((total - warmup..total).map(b));
    Ok(ops)
}

/// The bubble of the interleaved schedule with equal chunks: (p − 1)/(v·m + p − 1) — the
/// non-interleaved (p − 1)/(m + p − 1) with the fill and drain v times shorter.
pub fn interleaved_bubble_fraction(stages: usize, chunks: usize, micro_batches: usize) -> f64 {
    let (p, v, m) = (stages as f64, chunks as f64, micro_batches as f64);
    (p - 1.0) / (v * m + p - 1.0)
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
                let end = start + if matches!(op, Op::Forward(_)) { t_f } else { t_b };
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

    #[test]
    fn interleaved_orders_by_hand() {
        // p = 2, v = 2, m = 4, from Megatron's rules by hand. Forwards in groups of p = 2
        // micro-batches per chunk: (c0,0) (c0,1) (c1,0) (c1,1) (c0,2) (c0,3) (c1,2) (c1,3);
        // backwards the same with the chunks reversed. Rank 0: (2 − 0 − 1)·2 + (2 − 1)·2 = 4
        // warm-up forwards; rank 1: 0·2 + 2 = 2.
        let c = |chunk: usize, op: Op| ChunkOp { chunk, op };
        assert_eq!(
            interleaved(2, 2, 4, 0).unwrap(),
            vec![
                c(0, F(0)),
                c(0, F(1)),
                c(1, F(0)),
                c(1, F(1)),
                c(0, F(2)),
                c(1, B(0)),
                c(0, F(3)),
                c(1, B(1)),
                c(1, F(2)),
                c(0, B(0)),
                c(1, F(3)),
                c(0, B(1)),
                c(1, B(2)),
                c(1, B(3)),
                c(0, B(2)),
                c(0, B(3)),
            ]
        );
        assert_eq!(
            interleaved(2, 2, 4, 1).unwrap(),
            vec![
                c(0, F(0)),
                c(0, F(1)),
                c(1, F(0)),
                c(1, B(0)),
                c(1, F(1)),
                c(1, B(1)),
                c(0, F(2)),
                c(0, B(0)),
                c(0, F(3)),
                c(0, B(1)),
                c(1, F(2)),
                c(1, B(2)),
                c(1, F(3)),
                c(1, B(3)),
                c(0, B(2)),
                c(0, B(3)),
            ]
        );
        // One chunk is 1F1B.
        let one: Vec<Op> = interleaved(4, 1, 8, 1).unwrap().into_iter().map(|x| x.op).collect();
        assert_eq!(one, schedule(Schedule::OneFOneB, 4, 8, 1));
        assert!(interleaved(4, 2, 6, 0).unwrap_err().contains("not a multiple of 4"));
        assert!(
            interleaved(4, 0, 8, 0).is_err() && interleaved(4, 2, 8, 4).is_err() && interleaved(0, 2, 8, 0).is_err()
        );
    }

    /// Narayanan et al. 2021, §2.2.2: with v chunks per rank the bubble time is (p − 1)(t_f + t_b)/v
    /// for m(t_f + t_b) of work — of the step, (p − 1)/(v·m + p − 1). The simulation of the
    /// schedule gives it on every rank; the first rank holds (p − 1)·2 + (v − 1)·p + 1 chunks'
    /// activations at its peak (its warm-up and one more), against 1F1B's p stages.
    #[test]
    fn interleaving_shrinks_the_bubble_v_fold() {
        for (p, v, m) in [(2, 2, 4), (4, 2, 8), (4, 4, 8), (4, 2, 4), (8, 3, 16), (4, 2, 12), (3, 2, 3)] {
            let plans: Vec<Vec<ChunkOp>> = (0..p).map(|r| interleaved(p, v, m, r).unwrap()).collect();
            for (r, plan) in plans.iter().enumerate() {
                let mut seen: Vec<(usize, bool, usize)> = plan
                    .iter()
                    .map(|x| match x.op {
                        F(i) => (x.chunk, true, i),
                        B(i) => (x.chunk, false, i),
                    })
                    .collect();
                seen.sort_unstable();
                seen.dedup();
                assert_eq!(
                    seen.len(),
                    2 * v * m,
                    "p={p} v={v} m={m} rank {r}: every chunk's F and B of every micro-batch, once"
                );
            }
            // A chunk takes 1/v of a stage's time: forward 1, backward 2 for the whole stage.
            let t = simulate_chunks(&plans, v, 1.0 / v as f64, 2.0 / v as f64).unwrap();
            for r in 0..p {
                let (got, want) = (t.bubble(r), interleaved_bubble_fraction(p, v, m));
                assert!((got - want).abs() < 1e-9, "p={p} v={v} m={m} rank {r}: bubble {got}, want {want}");
            }
            assert!(interleaved_bubble_fraction(p, v, m) < bubble_fraction(p, m) || p == 1);
            let warmup = ((p - 1) * 2 + (v - 1) * p).min(m * v);
            assert_eq!(t.peak_in_flight(0), (warmup + 1).min(m * v), "p={p} v={v} m={m}");
        }
    }
}
