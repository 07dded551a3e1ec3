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
    // TODO: return the fitted (α in seconds, β in bytes per second), or an Err for the cases
    // above (README, "The α-β model"; hints: `cargo grade 15 --hint 1`).
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
    // TODO: the seconds of this ring all-reduce across the hierarchy, by the α-β model (README,
    // "The hierarchy"; hints: `cargo grade 15 --hint 2`).
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
    // TODO: this rank's forwards and backwards in schedule order, each (chunk, micro-batch) once
    // each way, or an Err for the cases above (README, "The bubble, and interleaving"; hints:
    // `cargo grade 15 --hint 3`).
    todo!()
}

/// What one data-parallel step sends, by the α-β model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepComm {
    /// All-reduces in a step: one per gradient bucket.
    pub messages: usize,
    /// Bytes one rank sends in a step (the ring shares the work evenly: every rank sends as much,
    /// where the buckets split evenly over the ranks).
    pub bytes_per_rank: f64,
    /// Seconds of those all-reduces one after another on the link (nothing hidden behind backward).
    pub seconds: f64,
}

/// Exercise 4 — your prediction of one step of lesson 05's bucketed DDP on `ranks` ranks: the
/// gradients of parameters of `param_bytes` bytes (registration order), packed into buckets of at
/// most `cap` bytes from the last parameter to the first (a parameter larger than `cap` gets a
/// bucket of its own), each bucket one ring all-reduce over `link` (α per ring step, β the bus
/// bandwidth, as exercise 1 fits them). One rank runs no all-reduce: 0 messages, 0 bytes, 0 s.
/// An Err for no ranks, a cap of 0 bytes, a parameter of 0 bytes, or a link whose α is negative
/// or whose β is not positive.
pub fn predict_ddp_comm(param_bytes: &[usize], cap: usize, ranks: usize, link: Link) -> Result<StepComm, String> {
    // TODO: the step's all-reduces, bytes sent per rank and seconds, or an Err for the cases above
    // (README, exercise 4; hints: `cargo grade 15 --hint 4`).
    todo!()
}

/// A GPT and a layout, as the layout search sees them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Plan {
    /// Ψ, the model's parameters.
    pub params: f64,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    /// Tokens a sequence.
    pub seq: usize,
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    /// Sequences a micro-batch.
    pub micro_batch: usize,
    /// Micro-batches a step, per data-parallel replica.
    pub micro_batches: usize,
    /// ZeRO stage, 0 to 3.
    pub zero: u8,
}

/// Bytes one GPU holds at its peak.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryPerGpu {
    pub model_states: f64,
    pub activations: f64,
}

/// Exercise 5 — the layout search's memory filter: what the first pipeline rank holds under
/// 1F1B, in bf16 mixed precision with AdamW (bf16 weights, fp32 gradients, fp32 master weights
/// and two moments: 2 + 4 + 12 bytes a parameter), the parameters spread evenly over tp · pp,
/// ZeRO sharding over dp, selective recomputation, and sequence parallelism whenever tp > 1.
/// An Err for a count of 0 (Ψ, layers, width, heads, tokens, dp, tp, pp, the micro-batch or the
/// micro-batches), tp not dividing the heads, pp not dividing the layers, a ZeRO stage above 3,
/// or ZeRO-2/3 with pp > 1 (DeepSpeed refuses it).
pub fn memory_per_gpu(plan: &Plan) -> Result<MemoryPerGpu, String> {
    // TODO: the first pipeline rank's model states and peak activations, in bytes, or an Err for
    // the cases above (README, exercise 5; hints: `cargo grade 15 --hint 5`).
    todo!()
}
