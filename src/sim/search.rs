//! The layout search (`plan --search`): every layout of a model on a cluster that fits memory,
//! simulated and ranked by tokens/s — Calculon's "optimal execution" question, on the course's
//! schedules.
//!
//! The space, for `gpus` GPUs and a fixed global batch: tp a power of two up to a node that
//! divides the heads; pp dividing the layers; dp the rest; the interleaved schedule's v ∈ {1, 2,
//! 4} where it divides a stage's layers; micro-batches of 1, 2, 4 or 8 sequences; ZeRO 0–3
//! (0–1 with pp > 1, as DeepSpeed allows);
//! recomputation none, selective or full; sequence parallelism whenever tp > 1 (it saves memory
//! for the same bytes sent, Korthikanti et al. 2022 §4.2.2).

use super::hardware::Gpu;
use super::model::Model;
use super::step::{simulate_step, Layout, Prediction, Split};
use crate::memory::Recompute;
use crate::precision::Precision;

/// A layout and what the simulator predicts for it.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub layout: Layout,
    pub prediction: Prediction,
}

/// Every layout of `model` on `gpus` GPUs with `global_batch` sequences per step that fits the
/// GPU's memory, fastest first; and how many layouts were simulated.
pub fn search(
    model: &Model,
    gpu: &Gpu,
    gpus: usize,
    global_batch: usize,
    precision: Precision,
) -> Result<(Vec<Candidate>, usize), String> {
    model.check()?;
    gpu.check()?;
    if gpus == 0 || global_batch == 0 {
        return Err("the search needs at least one GPU and one sequence per step".into());
    }
    let mut found = Vec::new();
    let mut tried = 0;
    let tps = (0..).map(|i| 1usize << i).take_while(|&t| t <= gpu.gpus_per_node.min(gpus));
    for tp in tps {
        if model.heads % tp != 0 || model.ffn % tp != 0 || gpus % tp != 0 {
            continue;
        }
        for pp in (1..=model.layers.min(gpus / tp)).filter(|pp| model.layers % pp == 0 && (gpus / tp) % pp == 0) {
            let dp = gpus / (tp * pp);
            for v in [1, 2, 4].into_iter().filter(|&v| v == 1 || (pp > 1 && (model.layers / pp) % v == 0)) {
                for mb in [1, 2, 4, 8].into_iter().filter(|mb| global_batch % (dp * mb) == 0) {
                    // DeepSpeed refuses ZeRO-2 and -3 with pipeline parallelism (the gradients
                    // of every micro-batch would be reduce-scattered): ZeRO-1 at most with pp.
                    for zero in (0..=3u8).filter(|&z| pp == 1 || z <= 1) {
                        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
                            let mut l = Layout::new(dp, tp, pp);
                            l.interleave = v;
                            l.micro_batch = mb;
                            l.global_batch = global_batch;
                            l.zero = zero;
                            l.recompute = recompute;
                            l.precision = precision;
                            l.sequence_parallel = tp > 1;
                            l.overlap_grad_reduce = true;
                            if l.check(model).is_err() {
                                continue;
                            }
                            tried += 1;
                            let p = simulate_step(model, gpu, &l)?;
                            if p.fits {
                                found.push(Candidate { layout: l, prediction: p });
                            }
                        }
                    }
                }
            }
        }
    }
    // Fastest first; of two as fast, the one that holds less.
    found.sort_by(|a, b| {
        (b.prediction.tokens_per_s.total_cmp(&a.prediction.tokens_per_s))
            .then(a.prediction.memory.total.total_cmp(&b.prediction.memory.total))
    });
    Ok((found, tried))
}

/// The parts of a step, named.
pub fn parts(s: &Split) -> [(&'static str, f64); 6] {
    [
        ("compute", s.compute),
        ("tp comm", s.tp_comm),
        ("pp comm", s.pp_comm),
        ("bubble", s.bubble),
        ("exposed dp comm", s.dp_exposed),
        ("optimizer", s.optimizer),
    ]
}

/// Why `a` is faster than `b` (two layouts of the same model and global batch): the part of
/// the step that is shortest in `a` compared with `b`.
pub fn why_faster(a: &Candidate, b: &Candidate) -> String {
    let (pa, pb) = (parts(&a.prediction.split), parts(&b.prediction.split));
    let best = pa.iter().zip(&pb).max_by(|x, y| (x.1 .1 - x.0 .1).total_cmp(&(y.1 .1 - y.0 .1)));
    match best {
        Some(((name, x), (_, y))) if y > x => format!("{name} {x:.3} s against {y:.3} s"),
        _ if a.prediction.step_s == b.prediction.step_s => {
            format!("as fast, {:.1} GB less memory", (b.prediction.memory.total - a.prediction.memory.total) / 1e9)
        }
        _ => "no part of its step is shorter".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::hardware::profile;

    #[test]
    fn only_layouts_that_fit_are_ranked_fastest_first() {
        let h100 = profile("h100-80gb").unwrap();
        // A 13B GPT on 64 H100s: replicated with Adam (16 bytes a parameter) it cannot fit 80 GB.
        let model = Model::gpt(40, 5120, 40);
        let (found, tried) = search(&model, &h100, 64, 256, Precision::Bf16).unwrap();
        assert!(tried > found.len() && !found.is_empty(), "{tried} tried, {} fit", found.len());
        assert!(found.iter().all(|c| c.prediction.memory.total <= h100.memory_bytes));
        assert!(found.iter().all(|c| !(c.layout.zero == 0 && c.layout.tp * c.layout.pp == 1)));
        assert!(found.windows(2).all(|w| w[0].prediction.tokens_per_s >= w[1].prediction.tokens_per_s));
        assert!(found.iter().all(|c| c.layout.gpus() == 64 && c.layout.tp <= 8));
        assert!(found.iter().all(|c| c.layout.pp == 1 || c.layout.zero <= 1));
    }
}
