//! Which layout fits a memory budget (lesson 14): the bytes of model state every rank of a layout
//! holds, counted from the GPT's parameter shapes with the engine's own cuts — tensor
//! parallelism's split of each parameter ([`split_of`]), the pipeline's stages
//! ([`params_of_ranks`]: contiguous, the tied embedding on the first and the last rank) and the
//! data dimension's strategy — and the choice of a layout for a world of ranks under a budget.
//!
//! fp32 training with AdamW (P: the rank's parameters, N: dp), what a rank holds between steps
//! (DDP's gradients live during a step) — checked against the ranks' tensors by
//! `cargo run --release --bin lesson14 -- fit` and `tests/engine.rs` (`planned_matches_held`):
//!
//! | data dimension | weights | gradients | AdamW m, v | in all |
//! |---|---|---|---|---|
//! | DDP | 4P | 4P | 8P | 16P |
//! | ZeRO-1 | 4P | 4P full + 4P/N averaged shard | 8P/N | 8P + 12P/N |
//! | ZeRO-2 | 4P | 4P/N | 8P/N | 4P + 12P/N |
//! | ZeRO-3 | 4P/N | 4P/N | 8P/N | 16P/N |
//!
//! ZeRO pads each unit's flat buffer to a multiple of N (at most N − 1 elements a unit more, not
//! counted here). This is the model-state accounting of the ZeRO paper's Table 1 and of
//! DeepSpeed's estimators: a first-order budget. On top of it a device holds activations and a
//! step's transient buffers ([`MemoryStats::peak_transient`](crate::memory::MemoryStats::peak_transient):
//! ZeRO-3's gathered parameters, the full gradients a ZeRO piece's backward gives at once, the
//! flat copy stages 2–3 reduce from), which `lesson14 fit` measures beside the count. fp32 only:
//! under bf16 the whole-model ZeRO strategies (`crate::zero`, tp = pp = 1) keep a bf16 working
//! copy beside the fp32 master, and CPU offload moves state off the device.
//!
//! Tensor parallelism divides the matrices and the embedding, not the LayerNorms, the position
//! embedding or the row-parallel biases, so a small model's rank holds more than P/t; and ZeRO-3
//! over all the ranks always holds the fewest state bytes. What forces tensor or pipeline
//! parallelism then is a limit on the replicas — at scale the global batch (Megatron and
//! torchtitan give each replica global batch / dp rows, a micro-batch at least) — and
//! activations, which ZeRO does not shard.

use super::{DataDim, ParallelDims};
use crate::model::GptConfig;
use crate::pipeline::train::params_of_ranks;
use crate::tp::{split_of, Split};
use crate::zero::Stage;

/// The parameters each pipeline rank holds under `tp`-way tensor and `pp`-way pipeline
/// parallelism (every tensor-parallel rank of a stage holds as many). An error for a cut the
/// engine refuses: `tp` not dividing the heads or the vocabulary, more pipeline ranks than stages.
pub fn rank_params(cfg: &GptConfig, tp: usize, pp: usize) -> Result<Vec<u64>, String> {
    cfg.validate().map_err(|e| e.to_string())?;
    let t = tp as i64;
    if tp == 0 || cfg.n_head % t != 0 || cfg.vocab_size % t != 0 {
        return Err(format!("tp {tp} must divide the {} heads and the vocabulary of {}", cfg.n_head, cfg.vocab_size));
    }
    let shapes = cfg.param_shapes();
    let held = |k: usize| -> u64 {
        let numel: i64 = shapes[k].1.iter().product();
        match split_of(cfg, k) {
            Split::Replicated => numel as u64,
            _ => (numel / t) as u64,
        }
    };
    Ok(params_of_ranks(cfg, pp)?.into_iter().map(|ks| ks.into_iter().map(held).sum()).collect())
}

/// Model-state bytes (fp32 weights, gradients and AdamW state, the table above) of a rank holding
/// `p` parameters with `data` over `dp` replicas.
pub fn state_bytes(p: u64, dp: usize, data: DataDim) -> f64 {
    let (p, n) = (p as f64, dp as f64);
    match data {
        DataDim::Replicate => 16.0 * p,
        DataDim::Zero(Stage::One) => 8.0 * p + 12.0 * p / n,
        DataDim::Zero(Stage::Two) => 4.0 * p + 12.0 * p / n,
        DataDim::Zero(Stage::Three) => 16.0 * p / n,
    }
}

/// The model-state bytes of every pipeline rank of a layout (tensor-parallel ranks alike).
pub fn rank_state_bytes(cfg: &GptConfig, dims: ParallelDims, data: DataDim) -> Result<Vec<f64>, String> {
    if dims.dp == 0 {
        return Err("a layout needs at least one data-parallel replica".into());
    }
    Ok(rank_params(cfg, dims.tp, dims.pp)?.into_iter().map(|p| state_bytes(p, dims.dp, data)).collect())
}

/// The most model-state bytes any rank of the layout holds: what must fit.
pub fn max_state_bytes(cfg: &GptConfig, dims: ParallelDims, data: DataDim) -> Result<f64, String> {
    Ok(rank_state_bytes(cfg, dims, data)?.into_iter().fold(0.0, f64::max))
}

/// Every layout of `world` ranks the engine can cut this GPT into with at most `max_dp`
/// data-parallel replicas, with every data-dimension strategy (only DDP when dp = 1), in order of
/// preference: the least model parallelism first (tp·pp: torchtitan's FSDP first, tensor
/// parallelism when that is not enough), tensor before pipeline parallelism (no bubble; Megatron
/// keeps tp inside a node, at most 8, and pipelines across nodes), then the lowest ZeRO stage
/// (the Hugging Face DeepSpeed guide's speed order: DDP, then stages 1, 2, 3).
pub fn layouts(cfg: &GptConfig, world: usize, max_dp: usize) -> Vec<(ParallelDims, DataDim)> {
    let mut out = Vec::new();
    for tp in (1..=world).filter(|t| world % t == 0) {
        for pp in (1..=world / tp).filter(|p| (world / tp) % p == 0) {
            let dims = ParallelDims { pp, dp: world / (tp * pp), tp };
            if dims.dp > max_dp || rank_params(cfg, tp, pp).is_err() {
                continue;
            }
            out.push((dims, DataDim::Replicate));
            if dims.dp > 1 {
                out.extend([Stage::One, Stage::Two, Stage::Three].map(|s| (dims, DataDim::Zero(s))));
            }
        }
    }
    let zero = |d: &DataDim| match d {
        DataDim::Replicate => 0,
        DataDim::Zero(s) => *s as u8 + 1,
    };
    out.sort_by_key(|(d, data)| (d.tp * d.pp, d.pp, zero(data)));
    out
}

/// The layout to train with: the first of [`layouts`] whose every rank's model state fits in
/// `budget` bytes, with its largest rank's bytes. An error that says what the smallest layout
/// needs when none fits. (This course's `train` scales the global batch with the world — every
/// rank adds `--batch-size` rows — so it puts no limit on the replicas: `max_dp = world`.)
pub fn choose(
    cfg: &GptConfig,
    world: usize,
    max_dp: usize,
    budget: f64,
) -> Result<(ParallelDims, DataDim, f64), String> {
    if world == 0 || max_dp == 0 {
        return Err("a layout needs at least one rank and one replica".into());
    }
    if !(budget.is_finite() && budget > 0.0) {
        return Err(format!("the budget must be a positive number of bytes, not {budget}"));
    }
    let all = layouts(cfg, world, max_dp);
    let mut least: Option<(f64, String)> = None;
    for (dims, data) in all {
        let bytes = max_state_bytes(cfg, dims, data)?;
        if bytes <= budget {
            return Ok((dims, data, bytes));
        }
        if least.as_ref().is_none_or(|(b, _)| bytes < *b) {
            least = Some((bytes, dims.name(data, false)));
        }
    }
    Err(match least {
        None => format!("no layout of {world} ranks with at most {max_dp} replicas runs this model"),
        Some((b, name)) => {
            format!("no layout of {world} ranks fits {budget:.0} bytes per rank: the smallest, {name}, needs {b:.0}")
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The capstone's GPT (4 layers, 4 heads, 128 wide, context 64, vocabulary 84).
    fn capstone() -> GptConfig {
        GptConfig { vocab_size: 84, block_size: 64, n_layer: 4, n_head: 4, n_embd: 128 }
    }

    #[test]
    fn parameters_per_rank_by_hand() {
        let c = capstone();
        // Whole: 84·128 + 64·128 + 4·198272 + 256 = 812288 (num_params).
        assert_eq!(rank_params(&c, 1, 1).unwrap(), vec![812288]);
        assert_eq!(c.num_params(), 812288);
        // tp 2: wte 5376, wpe 8192, a block 512 (LayerNorms) + 24768 (c_attn) + 8192 + 128
        // (attn.c_proj, its bias whole) + 33024 (c_fc) + 32768 + 128 = 99520, ln_f 256.
        assert_eq!(rank_params(&c, 2, 1).unwrap(), vec![5376 + 8192 + 4 * 99520 + 256]);
        // pp 3 over 6 stages (embeddings, 4 blocks, head), 2 each: embeddings + block 0; blocks 1–2;
        // block 3 + ln_f + the tied wte.
        assert_eq!(rank_params(&c, 1, 3).unwrap(), vec![10752 + 8192 + 198272, 2 * 198272, 198272 + 256 + 10752]);
        assert!(rank_params(&c, 3, 1).is_err(), "3 does not divide 4 heads");
        assert!(rank_params(&c, 1, 7).is_err(), "7 ranks for 6 stages");
    }

    #[test]
    fn the_choice_follows_the_budget() {
        let c = capstone();
        let p = 812288.0;
        let pick =
            |budget: f64, max_dp: usize| choose(&c, 4, max_dp, budget).map(|(d, data, _)| (d.dp, d.tp, d.pp, data));
        let (rep, z1, z2, z3) =
            (DataDim::Replicate, DataDim::Zero(Stage::One), DataDim::Zero(Stage::Two), DataDim::Zero(Stage::Three));
        assert_eq!(pick(16.0 * p, 4), Ok((4, 1, 1, rep)), "16P fits: DDP");
        assert_eq!(pick(16.0 * p - 1.0, 4), Ok((4, 1, 1, z1)), "ZeRO-1 over 4: 8P + 3P");
        assert_eq!(pick(11.0 * p - 1.0, 4), Ok((4, 1, 1, z2)), "ZeRO-2 over 4: 4P + 3P");
        assert_eq!(pick(7.0 * p - 1.0, 4), Ok((4, 1, 1, z3)), "ZeRO-3 over 4: 4P");
        assert!(pick(4.0 * p - 1.0, 4).is_err(), "nothing holds less than ZeRO-3 over every rank");
        // At most 2 replicas: ZeRO-3 over 2 × tp 2 (8 · 411904 bytes).
        assert_eq!(pick(4e6, 2), Ok((2, 2, 1, z3)));
        assert!(choose(&c, 4, 4, f64::NAN).is_err() && choose(&c, 0, 4, 1e9).is_err());
        assert!(rank_params(&GptConfig { n_embd: 130, ..c }, 1, 1).is_err(), "130 channels over 4 heads");
    }
}
