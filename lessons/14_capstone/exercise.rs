//! Lesson 14 — the capstone: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 14`. Hints: `cargo grade 14 --hint K`.
//! Write these yourself: the grader refuses an answer that calls shardlab's own copy
//! (`shardlab::corpus`, `shardlab::model::sample_next`, the GPT's cached forward,
//! `shardlab::engine::fit`).
#![allow(unused_variables, unused_imports, unused_mut)]

use tch::{Kind, Tensor};

/// Exercise 1 — nanoGPT's character vocabulary: every distinct character of `text`, once, sorted
/// by code point (`sorted(set(text))`), so the same text gives the same ids whatever its order.
pub fn char_vocabulary(text: &str) -> Vec<char> {
    // TODO: the distinct characters of `text`, in code-point order (README, "Characters as
    // tokens"; hints: `cargo grade 14 --hint 1`).
    todo!()
}

/// (Exercise 1, continued.) `text` as ids: each character's position in `vocab` (sorted, as
/// [`char_vocabulary`] gives it). A character not in the vocabulary is an error that names it.
pub fn encode(vocab: &[char], text: &str) -> Result<Vec<u16>, String> {
    // TODO: one id per character; an unknown character is an Err naming it, never a silent id
    // (hints: `cargo grade 14 --hint 1`).
    todo!()
}

/// Exercise 2 — the train/val split by whole documents. The documents are joined in order with a
/// blank line (`"\n\n"`, two characters) after each but the last; `lengths[i]` is document i's
/// length in characters. Return the index of the first validation document: the one in whose
/// span — its text and the separator after it — the point at 90 % of the joined text falls, so
/// that validation is whole documents holding at least the last 10 %. Train is never empty (at
/// least 1); fewer than two documents is an error.
pub fn first_val_document(lengths: &[usize]) -> Result<usize, String> {
    // TODO: find the document the 90 % point of the joined text falls in (README, "A split the
    // model cannot cheat on"; hints: `cargo grade 14 --hint 2`).
    todo!()
}

/// Exercise 3 — the distribution nanoGPT's `generate` draws the next token from: the logits
/// divided by `temperature`; with `top_k = Some(k)`, only the logits at least as large as the
/// k-th largest kept (ties with it stay, as `torch.topk`'s threshold keeps them), the others
/// impossible (`None`, `Some(0)` or k at least the number of logits: all kept); then softmax.
/// `temperature == 0`: all the probability on the largest logit (the first of equal ones, as
/// `argmax`). Never NaN, however large the logits.
pub fn next_token_distribution(logits: &[f64], temperature: f64, top_k: Option<usize>) -> Vec<f64> {
    // TODO: the probabilities, one per logit, summing to 1 (README, "Temperature and top-k";
    // hints: `cargo grade 14 --hint 3`).
    todo!()
}

/// (Exercise 3, continued.) One draw from `probs` with a uniform number `u` in [0, 1): the first
/// token whose cumulative probability exceeds `u` (so a token of probability 0 is never drawn).
pub fn draw(probs: &[f64], u: f64) -> usize {
    // TODO: the index of the token `u` draws, never one of probability 0 nor past the end (hints:
    // `cargo grade 14 --hint 3`).
    todo!()
}

/// Exercise 4 — causal self-attention with a KV cache, the heart of fast decoding. `q`, `k`, `v`:
/// (B, H, T_new, D), the queries, keys and values of the `T_new` newest tokens; `cache`: the keys
/// and values of every earlier token, (B, H, T_past, D) each (`None` before the first call).
/// Append the new keys and values to the cache, and return every new token's attention over all
/// the tokens up to and including itself — softmax(q·kᵀ/√D) under the causal mask, times v:
/// (B, H, T_new, D), equal to full attention over the whole sequence at those positions.
pub fn cached_attention(q: &Tensor, k: &Tensor, v: &Tensor, cache: &mut Option<(Tensor, Tensor)>) -> Tensor {
    // TODO: the new tokens' causal attention, (B, H, T_new, D), with the cache left holding every
    // token so far (README, "Decoding with a KV cache"; hints: `cargo grade 14 --hint 4`).
    todo!()
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
    // TODO: one entry per pipeline rank, in order: the bytes of model state it holds (README,
    // "Which layout fits"; hints: `cargo grade 14 --hint 5`).
    todo!()
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
    // TODO: the preferred layout whose every rank fits `budget`, or the errors above (README,
    // "Which layout fits"; hints: `cargo grade 14 --hint 5`).
    todo!()
}
