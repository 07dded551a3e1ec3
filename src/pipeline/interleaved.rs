//! The interleaved 1F1B schedule (Narayanan et al. 2021, §2.2.2): each rank holds v model chunks,
//! the bubble shrinks v-fold. Scheduled here, simulated by
//! [`simulate_chunks`](super::simulate_chunks), run on real ranks by
//! [`interleaved_step`](super::interleaved_step).

use super::{check, schedule, Op, Schedule};
use serde::{Deserialize, Serialize};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{bubble_fraction, simulate_chunks};
    use Op::{Backward as B, Forward as F};

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
