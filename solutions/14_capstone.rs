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
