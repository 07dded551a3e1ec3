//! Sampling from the GPT (lesson 14): nanoGPT's `generate`, with a KV cache.
//!
//! Without a cache, each new token runs the whole sequence through the model again: step t costs
//! a forward over t tokens, so n tokens cost O(n²) token-forwards. With one, every block keeps
//! the keys and values of the tokens it has seen ([`KvCache`], per layer (B, n_head, T, head
//! size)); a step runs only the new token through the model, attending to the cached keys and
//! values: O(n) token-forwards. The logits are the full forward's (tested at every position).
//!
//! Past `block_size` tokens the model cannot see the whole sequence: like nanoGPT, the context is
//! cropped to the last `block_size` tokens and, positions having shifted, run in full each step
//! (the cache is of no use there).
//!
//! Sampling one token ([`sample_next`], nanoGPT's): logits / temperature, top-k (every logit
//! below the k-th largest is dropped; ties with it stay), softmax, one draw from the seeded
//! generator. Temperature 0 is the argmax. The same seed gives the same text.

use super::Gpt;
use crate::rng::Rng;
use tch::{Kind, Tensor};

/// Keys and values of the tokens seen so far, per layer: (B, n_head, T, head size) each.
#[derive(Default)]
pub struct KvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Tokens cached.
    pub len: i64,
}

/// How to draw each token.
#[derive(Clone, Copy, Debug)]
pub struct Sampling {
    /// Divides the logits: below 1 sharper, above 1 flatter; 0 takes the argmax.
    pub temperature: f64,
    /// Keep only the `k` largest logits (and ties with the k-th).
    pub top_k: Option<usize>,
}

impl Gpt {
    /// Logits (B, T, V) of `idx` (B, T), the continuation of what `cache` holds: its keys and
    /// values are appended to the cache. With an empty cache this is [`logits`](Gpt::logits).
    pub fn logits_cached(&self, idx: &Tensor, cache: &mut KvCache) -> Tensor {
        let (b, t) = idx.size2().expect("token batch must be (B, T)");
        let at = cache.len;
        assert!(at + t <= self.cfg.block_size, "{} tokens exceed block_size {}", at + t, self.cfg.block_size);
        let pos = Tensor::arange_start(at, at + t, (Kind::Int64, idx.device()));
        let wte = self.p(0).to_kind(Kind::Float);
        let wpe = self.p(1).to_kind(Kind::Float);
        let mut x = Tensor::embedding(&wte, idx, -1, false, false) + Tensor::embedding(&wpe, &pos, -1, false, false);
        let c = self.cfg.n_embd;
        let (nh, hs) = (self.cfg.n_head, c / self.cfg.n_head);
        for l in 0..self.cfg.n_layer as usize {
            let b0 = Self::block_base(l);
            let w = |i: usize| self.p(b0 + i);
            let h = self.ln(&x, w(0), w(1));
            let qkv = self.lin(&h, w(2), w(3));
            let heads = |i: i64| qkv.narrow(2, i * c, c).view([b, t, nh, hs]).transpose(1, 2);
            let (q, k_new, v_new) = (heads(0), heads(1), heads(2));
            let (k, v) = if cache.k.len() > l {
                (Tensor::cat(&[&cache.k[l], &k_new], 2), Tensor::cat(&[&cache.v[l], &v_new], 2))
            } else {
                (k_new, v_new)
            };
            // The new queries sit at positions at..at+t: query i sees keys 0..=at+i.
            let mask = if t == 1 {
                None // one query sees every cached key
            } else {
                let qi = Tensor::arange_start(at, at + t, (Kind::Int64, idx.device())).unsqueeze(1);
                let kj = Tensor::arange(at + t, (Kind::Int64, idx.device())).unsqueeze(0);
                Some(kj.le_tensor(&qi))
            };
            let y = Tensor::scaled_dot_product_attention(&q, &k, &v, mask.as_ref(), 0.0, false, None, false);
            if cache.k.len() > l {
                cache.k[l] = k;
                cache.v[l] = v;
            } else {
                cache.k.push(k);
                cache.v.push(v);
            }
            let y = self.lin(&y.transpose(1, 2).contiguous().view([b, t, c]), w(4), w(5));
            x = x + y;
            let h = self.ln(&x, w(6), w(7));
            let m = self.lin(&self.lin(&h, w(8), w(9)).gelu("none"), w(10), w(11));
            x = x + m;
        }
        cache.len += t;
        self.head(&x)
    }

    /// Continue `prompt` (token ids, at least one) by `max_new` tokens drawn with `sampling` from
    /// a generator seeded with `seed`; the prompt followed by the new tokens. `cached`: with the
    /// KV cache (the same tokens, faster); without, every step runs the whole context.
    pub fn generate(&self, prompt: &[i64], max_new: usize, sampling: Sampling, seed: u64, cached: bool) -> Vec<i64> {
        assert!(!prompt.is_empty(), "generate needs a prompt of at least one token");
        let _no_grad = tch::no_grad_guard();
        let mut rng = Rng::new(seed);
        let mut out = prompt.to_vec();
        let bs = self.cfg.block_size as usize;
        let mut cache = KvCache::default();
        let mut pending: Vec<i64> = out[out.len().saturating_sub(bs)..].to_vec(); // not yet in the cache
        for _ in 0..max_new {
            let logits = if cached && out.len() <= bs {
                let idx = Tensor::from_slice(&pending).unsqueeze(0);
                self.logits_cached(&idx, &mut cache)
            } else {
                let ctx = &out[out.len().saturating_sub(bs)..];
                self.logits(&Tensor::from_slice(ctx).unsqueeze(0))
            };
            let last = logits.get(0).get(-1).to_kind(Kind::Double);
            let next = sample_next(&last, sampling, &mut rng);
            out.push(next);
            pending = vec![next];
        }
        out
    }
}

/// Draw one token id from `logits` (V,) as nanoGPT's generate does: divide by the temperature,
/// keep the top k (ties with the k-th stay), softmax, one draw with `rng`; temperature 0: argmax.
pub fn sample_next(logits: &Tensor, s: Sampling, rng: &mut Rng) -> i64 {
    let l = Vec::<f64>::try_from(logits.to_kind(Kind::Double).view([-1])).expect("logits to f64");
    assert!(!l.is_empty(), "no logits");
    if s.temperature <= 0.0 {
        // The first of the largest (torch.argmax's choice).
        return l.iter().enumerate().fold(0, |best, (i, &x)| if x > l[best] { i } else { best }) as i64;
    }
    let mut z: Vec<f64> = l.iter().map(|x| x / s.temperature).collect();
    if let Some(k) = s.top_k.filter(|&k| k > 0 && k < z.len()) {
        let mut sorted = z.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let kth = sorted[k - 1];
        z.iter_mut().filter(|x| **x < kth).for_each(|x| *x = f64::NEG_INFINITY);
    }
    let top = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = z.iter().map(|x| (x - top).exp()).collect();
    let total: f64 = p.iter().sum();
    let mut u = rng.uniform() * total;
    for (i, pi) in p.iter().enumerate() {
        if u < *pi {
            return i as i64;
        }
        u -= pi;
    }
    p.iter().rposition(|&x| x > 0.0).unwrap_or(0) as i64 // rounding at the very end
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GptConfig;

    fn model() -> Gpt {
        let cfg = GptConfig { vocab_size: 40, ..GptConfig::tiny() };
        Gpt::new(cfg, 7).unwrap()
    }

    /// The cached forward gives the full forward's logits at every position: fed all at once,
    /// and as a prompt, a chunk, then single tokens.
    #[test]
    fn cached_logits_equal_the_full_forward_at_every_position() {
        let _g = tch::no_grad_guard();
        let m = model();
        let ids: Vec<i64> = (0..16).map(|i| (i * 7 + 3) % 40).collect();
        let full = m.logits(&Tensor::from_slice(&ids).unsqueeze(0));
        let mut c = KvCache::default();
        let at_once = m.logits_cached(&Tensor::from_slice(&ids).unsqueeze(0), &mut c);
        assert!(at_once.allclose(&full, 1e-5, 1e-5, false));
        // A prompt, a chunk of four appended to the non-empty cache, then one token at a time.
        let mut c = KvCache::default();
        let mut parts = vec![m.logits_cached(&Tensor::from_slice(&ids[..5]).unsqueeze(0), &mut c)];
        parts.push(m.logits_cached(&Tensor::from_slice(&ids[5..9]).unsqueeze(0), &mut c));
        for &id in &ids[9..] {
            parts.push(m.logits_cached(&Tensor::from_slice(&[id]).unsqueeze(0), &mut c));
        }
        let stepwise = Tensor::cat(&parts, 1);
        let diff = (&stepwise - &full).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "cached logits differ from the full forward by {diff}");
        assert_eq!(c.len, 16);
    }

    /// The same seed gives the same tokens, cached or not, also past block_size (cropped
    /// context); another seed gives others; temperature 0 is greedy.
    #[test]
    fn generation_is_seeded_and_the_cache_changes_nothing() {
        let m = model();
        let s = Sampling { temperature: 1.0, top_k: Some(10) };
        let a = m.generate(&[1, 2, 3], 30, s, 42, true);
        assert_eq!(a.len(), 33);
        assert_eq!(a, m.generate(&[1, 2, 3], 30, s, 42, false), "the cache must not change the draw");
        assert_eq!(a, m.generate(&[1, 2, 3], 30, s, 42, true));
        assert_ne!(a, m.generate(&[1, 2, 3], 30, s, 43, true));
        let g = Sampling { temperature: 0.0, top_k: None };
        let greedy = m.generate(&[1, 2, 3], 5, g, 1, true);
        let first = m.logits(&Tensor::from_slice(&[1i64, 2, 3]).unsqueeze(0)).get(0).get(-1).argmax(0, false);
        assert_eq!(greedy[3], first.int64_value(&[]));
    }

    /// Top-k keeps the k largest and ties with the k-th; temperature reshapes the distribution
    /// (checked on the frequencies of many draws, not one).
    #[test]
    fn top_k_and_temperature_shape_the_draws() {
        let logits = Tensor::from_slice(&[2.0f64, 1.0, 1.0, 0.0, -1.0]);
        let mut rng = Rng::new(5);
        let count = |s: Sampling, rng: &mut Rng| {
            let mut c = [0usize; 5];
            (0..20_000).for_each(|_| c[sample_next(&logits, s, rng) as usize] += 1);
            c
        };
        let c = count(Sampling { temperature: 1.0, top_k: Some(2) }, &mut rng);
        assert_eq!((c[3], c[4]), (0, 0), "below the 2nd largest: never drawn; {c:?}");
        assert!(c[1] > 0 && c[2] > 0, "ties with the 2nd largest stay: {c:?}");
        // softmax of (2, 1, 1): 0.576, 0.212, 0.212.
        let f0 = c[0] as f64 / 20_000.0;
        assert!((f0 - 0.576).abs() < 0.015, "{f0}");
        // Temperature 0.5 sharpens: softmax of (4, 2, 2, 0, −2) puts 0.78 on token 0.
        let c = count(Sampling { temperature: 0.5, top_k: None }, &mut rng);
        assert!((c[0] as f64 / 20_000.0 - 0.781).abs() < 0.015, "{c:?}");
        assert_eq!(sample_next(&logits, Sampling { temperature: 0.0, top_k: None }, &mut rng), 0);
    }
}
