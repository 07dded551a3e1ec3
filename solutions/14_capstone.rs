//! Lesson 14 — the capstone: reference answers (the same signatures as
//! `lessons/14_capstone/exercise.rs`).
#![allow(unused_variables, unused_imports, unused_mut)]

use tch::{Kind, Tensor};

/// Exercise 1 — nanoGPT's character vocabulary: every distinct character of `text`, once, sorted
/// by code point (`sorted(set(text))`), so the same text gives the same ids whatever its order.
pub fn char_vocabulary(text: &str) -> Vec<char> {
    let mut v: Vec<char> = text.chars().collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// (Exercise 1, continued.) `text` as ids: each character's position in `vocab` (sorted, as
/// [`char_vocabulary`] gives it). A character not in the vocabulary is an error that names it.
pub fn encode(vocab: &[char], text: &str) -> Result<Vec<u16>, String> {
    text.chars()
        .map(|c| match vocab.binary_search(&c) {
            Ok(i) => u16::try_from(i).map_err(|_| format!("{c:?} has id {i}, past u16")),
            Err(_) => Err(format!("{c:?} is not in the vocabulary")),
        })
        .collect()
}

/// Exercise 2 — the train/val split by whole documents. The documents are joined in order with a
/// blank line (`"\n\n"`, two characters) after each but the last; `lengths[i]` is document i's
/// length in characters. Return the index of the first validation document: the one in whose
/// span — its text and the separator after it — the point at 90 % of the joined text falls, so
/// that validation is whole documents holding at least the last 10 %. Train is never empty (at
/// least 1); fewer than two documents is an error.
pub fn first_val_document(lengths: &[usize]) -> Result<usize, String> {
    if lengths.len() < 2 {
        return Err(format!("a split needs at least two documents, {} given", lengths.len()));
    }
    let total: usize = lengths.iter().sum::<usize>() + 2 * (lengths.len() - 1);
    let mut end = 0;
    for (i, n) in lengths.iter().enumerate() {
        end += n + 2;
        if 10 * end > 9 * total {
            return Ok(i.max(1));
        }
    }
    Ok(lengths.len() - 1)
}

/// Exercise 3 — the distribution nanoGPT's `generate` draws the next token from: the logits
/// divided by `temperature`; with `top_k = Some(k)`, only the logits at least as large as the
/// k-th largest kept (ties with it stay, as `torch.topk`'s threshold keeps them), the others
/// impossible (`None`, `Some(0)` or k at least the number of logits: all kept); then softmax.
/// `temperature == 0`: all the probability on the largest logit (the first of equal ones, as
/// `argmax`). Never NaN, however large the logits.
pub fn next_token_distribution(logits: &[f64], temperature: f64, top_k: Option<usize>) -> Vec<f64> {
    let mut p = vec![0.0; logits.len()];
    if temperature == 0.0 {
        let best = logits.iter().enumerate().fold(0, |b, (i, &x)| if x > logits[b] { i } else { b });
        p[best] = 1.0;
        return p;
    }
    let z: Vec<f64> = logits.iter().map(|x| x / temperature).collect();
    let kth = match top_k {
        Some(k) if k >= 1 && k < z.len() => {
            let mut s = z.clone();
            s.sort_by(|a, b| b.total_cmp(a));
            s[k - 1]
        }
        _ => f64::NEG_INFINITY,
    };
    let top = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    for (pi, &x) in p.iter_mut().zip(&z) {
        if x >= kth {
            *pi = (x - top).exp();
        }
    }
    let total: f64 = p.iter().sum();
    p.iter_mut().for_each(|x| *x /= total);
    p
}

/// (Exercise 3, continued.) One draw from `probs` with a uniform number `u` in [0, 1): the first
/// token whose cumulative probability exceeds `u` (so a token of probability 0 is never drawn).
pub fn draw(probs: &[f64], u: f64) -> usize {
    let mut cum = 0.0;
    for (i, p) in probs.iter().enumerate() {
        cum += p;
        if cum > u {
            return i;
        }
    }
    probs.iter().rposition(|&p| p > 0.0).unwrap_or(0)
}

/// Exercise 4 — causal self-attention with a KV cache, the heart of fast decoding. `q`, `k`, `v`:
/// (B, H, T_new, D), the queries, keys and values of the `T_new` newest tokens; `cache`: the keys
/// and values of every earlier token, (B, H, T_past, D) each (`None` before the first call).
/// Append the new keys and values to the cache, and return every new token's attention over all
/// the tokens up to and including itself — softmax(q·kᵀ/√D) under the causal mask, times v:
/// (B, H, T_new, D), equal to full attention over the whole sequence at those positions.
pub fn cached_attention(q: &Tensor, k: &Tensor, v: &Tensor, cache: &mut Option<(Tensor, Tensor)>) -> Tensor {
    let (k_all, v_all) = match cache.take() {
        None => (k.shallow_clone(), v.shallow_clone()),
        Some((pk, pv)) => (Tensor::cat(&[pk, k.shallow_clone()], 2), Tensor::cat(&[pv, v.shallow_clone()], 2)),
    };
    let (t_new, t_all, d) = (q.size()[2], k_all.size()[2], q.size()[3]);
    // (B, H, T_new, T_all)
    let scores = q.matmul(&k_all.transpose(-2, -1)) / (d as f64).sqrt();
    // New token i sits at position t_all − t_new + i: it sees keys 0..=that.
    let allowed = Tensor::ones([t_new, t_all], (Kind::Bool, q.device())).tril(t_all - t_new);
    let y = scores.masked_fill(&allowed.logical_not(), f64::NEG_INFINITY).softmax(-1, scores.kind()).matmul(&v_all);
    *cache = Some((k_all, v_all));
    y
}

/// Exercise 5 — which layout fits. The course's GPT by its shape (nanoGPT's names): a token
/// embedding `wte` (vocab_size × n_embd), a position embedding `wpe`, `n_layer` blocks and a final
/// LayerNorm `ln_f`; every LayerNorm and every linear layer of the blocks has a bias; the output
/// head has none, and its weight is `wte` (tied).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub vocab_size: usize,
    pub block_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
}

/// A layout of `dp × tp × pp` ranks: `tp`-way tensor and `pp`-way pipeline parallelism, and on
/// the data dimension DDP (`zero: 0`) or ZeRO stage `zero` (1, 2 or 3) over `dp` replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    pub zero: u8,
}

/// (Exercise 5, continued.) The bytes of model state each pipeline rank holds between steps under `layout`
/// (every tensor-parallel rank of a stage holds as many), one entry per pipeline rank, as the
/// engine holds them: fp32 weights and gradients and AdamW's two moments, the parameters cut as
/// lessons 12 and 13 cut them, the data dimension as lesson 07 measured it (README, "Which
/// layout fits"). The layout is one the engine runs: `tp` divides the heads and the vocabulary,
/// `pp` is at most the number of stages.
pub fn rank_state_bytes(shape: &Shape, layout: &Layout) -> Vec<f64> {
    let (c, v, t) = (shape.n_embd as f64, shape.vocab_size as f64, layout.tp as f64);
    // The stages the pipeline cuts: the embeddings, each block, the head (ln_f and the tied wte).
    // A tensor-parallel rank holds 1/t of wte, c_attn, c_fc and both c_proj weights; all of wpe,
    // the LayerNorms and the row-parallel layers' (the two c_proj) biases.
    let wte = v * c / t;
    let embeddings = wte + shape.block_size as f64 * c;
    let block =
        4.0 * c + (3.0 * c * c + 3.0 * c) / t + c * c / t + c + (4.0 * c * c + 4.0 * c) / t + 4.0 * c * c / t + c;
    let stages: Vec<f64> =
        std::iter::once(embeddings).chain(std::iter::repeat(block).take(shape.n_layer)).chain([2.0 * c]).collect();
    // Contiguous runs of stages, as equal as they divide, the first ranks one more.
    let (q, extra) = (stages.len() / layout.pp, stages.len() % layout.pp);
    let mut at = 0;
    let n = layout.dp as f64;
    (0..layout.pp)
        .map(|r| {
            let k = q + usize::from(r < extra);
            let mut p: f64 = stages[at..at + k].iter().sum();
            // The head's weight is wte: a rank with the head but not the embeddings keeps a copy.
            if at + k == stages.len() && at > 0 {
                p += wte;
            }
            at += k;
            // fp32 weights (4), gradients (4), AdamW m and v (8) per parameter.
            match layout.zero {
                0 => 16.0 * p,
                // Stage 1 keeps the full gradient and, beside it, its averaged shard.
                1 => 8.0 * p + 12.0 * p / n,
                2 => 4.0 * p + 12.0 * p / n,
                _ => 16.0 * p / n,
            }
        })
        .collect()
}

/// (Exercise 5, continued.) The layout to train `shape` with on `world` ranks with at most
/// `max_dp` data-parallel replicas (what a fixed global batch allows when, as in Megatron and
/// torchtitan, the replicas split it), when every rank has `budget` bytes for model state: of the
/// layouts the engine can cut the model into whose every rank fits, the one with the least model
/// parallelism (tp × pp), then tensor before pipeline parallelism, then the lowest ZeRO stage
/// (only DDP when dp = 1). When none fits, an error that gives the fewest bytes the largest rank of
/// any of those layouts needs, in whole bytes (`… needs 3249152`); an error, too, for no ranks,
/// `max_dp` 0, or a budget that is not a positive number.
pub fn choose_layout(shape: &Shape, world: usize, max_dp: usize, budget: f64) -> Result<Layout, String> {
    if world == 0 || max_dp == 0 {
        return Err("no ranks or no replicas: nothing to lay out".into());
    }
    if !(budget.is_finite() && budget > 0.0) {
        return Err(format!("a budget is a positive number of bytes, not {budget}"));
    }
    let mut candidates = Vec::new();
    for tp in (1..=world).filter(|&t| world % t == 0 && shape.n_head % t == 0 && shape.vocab_size % t == 0) {
        for pp in (1..=world / tp).filter(|&p| (world / tp) % p == 0 && p <= shape.n_layer + 2) {
            let dp = world / (tp * pp);
            if dp > max_dp {
                continue;
            }
            let top = if dp > 1 { 3 } else { 0 };
            candidates.extend((0..=top).map(|zero| Layout { dp, tp, pp, zero }));
        }
    }
    candidates.sort_by_key(|l| (l.tp * l.pp, l.pp, l.zero));
    let mut smallest: Option<(f64, Layout)> = None;
    for l in candidates {
        let most = rank_state_bytes(shape, &l).into_iter().fold(0.0, f64::max);
        if most <= budget {
            return Ok(l);
        }
        if smallest.is_none_or(|(b, _)| most < b) {
            smallest = Some((most, l));
        }
    }
    Err(match smallest {
        None => format!("no layout of {world} ranks with at most {max_dp} replicas runs this model"),
        Some((b, l)) => format!("nothing fits {budget:.0} bytes a rank: the smallest layout, {l:?}, needs {b:.0}"),
    })
}
