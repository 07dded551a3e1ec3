//! Lesson 15 — scaling out on paper: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 15`. Hints: `cargo grade 15 --hint K`.
//! Write these yourself: the grader refuses an answer that calls shardlab's own copy
//! (`shardlab::sim`, `shardlab::pipeline`).
#![allow(unused_variables, unused_imports, unused_mut)]

/// Exercise 1 — your own α and β. `points` are measured (bytes, seconds) of a ring all-reduce on
/// `ranks` ranks, whose time the α-β model gives as 2(n − 1)·α + 2(n − 1)/n · bytes/β. Return
/// (α in seconds, β in bytes per second), fitted by least squares of the relative error over
/// every point; a negative fitted latency is 0. An Err for fewer than two points, fewer than two
/// ranks, a size or time that is not positive, or a fitted slope of 0 or less.
pub fn fit_alpha_beta(points: &[(f64, f64)], ranks: usize) -> Result<(f64, f64), String> {
    // TODO: fit a straight line in the message size, weighting each point so that its relative
    // error counts (README, "The α-β model"); then read α and β off its two coefficients.
    todo!()
}

/// A kind of link: a message of B bytes takes `alpha + B / bytes_per_s` seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    pub alpha: f64,
    pub bytes_per_s: f64,
}

/// Exercise 2 — a ring all-reduce of `bytes` over `gpus` GPUs placed `per_node` to a node (the
/// group fills ⌈gpus / per_node⌉ nodes; `gpus` is at most `per_node`, one node, or a multiple of
/// it), GPUs inside a node joined by `nvlink`, nodes by one NIC per GPU (`nic`). Seconds.
pub fn all_reduce_seconds(bytes: f64, gpus: usize, per_node: usize, nvlink: Link, nic: Link) -> f64 {
    // TODO: the ring's latency and bandwidth terms, with the link that bounds each (README, "The
    // hierarchy").
    todo!()
}

/// One operation of a pipeline rank: the forward or backward of one of its model chunks for one
/// micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub forward: bool,
    pub chunk: usize,
    pub micro_batch: usize,
}

/// Exercise 3 — rank `rank`'s order under the interleaved 1F1B schedule: `stages` pipeline ranks,
/// each holding `chunks` model chunks, `micro_batches` micro-batches a step. With one chunk, lesson
/// 13's plain 1F1B. An Err for a rank that is not one of the stages, no chunks, no
/// micro-batches, or (with more than one chunk) micro-batches that are not a multiple of the
/// stages.
pub fn interleaved_order(stages: usize, chunks: usize, micro_batches: usize, rank: usize) -> Result<Vec<Step>, String> {
    // TODO: which chunk and micro-batch the k-th forward and the k-th backward are, how many
    // forwards warm up, then one forward one backward (README, "The bubble, and interleaving").
    todo!()
}
