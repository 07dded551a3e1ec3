//! Lesson 15 — reference answers (same signatures as `lessons/15_scaling_out/exercise.rs`).
#![allow(unused_variables, unused_imports, unused_mut)]

/// Exercise 1 — your own α and β. `points` are measured (bytes, seconds) of a ring all-reduce on
/// `ranks` ranks, whose time the α-β model gives as 2(n − 1)·α + 2(n − 1)/n · bytes/β. Return
/// (α in seconds, β in bytes per second), fitted by least squares of the relative error over
/// every point; a negative fitted latency is 0. An Err for fewer than two points, fewer than two
/// ranks, a size or time that is not positive, or a fitted slope of 0 or less.
pub fn fit_alpha_beta(points: &[(f64, f64)], ranks: usize) -> Result<(f64, f64), String> {
    if points.len() < 2 || ranks < 2 {
        return Err(format!(
            "a fit needs two points or more on two ranks or more: {} points, {ranks} ranks",
            points.len()
        ));
    }
    if let Some(p) = points.iter().find(|p| !(p.0 > 0.0 && p.1 > 0.0)) {
        return Err(format!("sizes and times must be positive: {p:?}"));
    }
    // t = a + c·B, minimising Σ ((a + c·B − t) / t)²: weighted least squares, weights 1/t².
    let (mut sw, mut swb, mut swbb, mut swt, mut swbt) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(b, t) in points {
        let w = 1.0 / (t * t);
        sw += w;
        swb += w * b;
        swbb += w * b * b;
        swt += w * t;
        swbt += w * b * t;
    }
    let det = sw * swbb - swb * swb;
    if det <= 0.0 {
        return Err("the points need two different sizes".into());
    }
    let c = (sw * swbt - swb * swt) / det;
    if c <= 0.0 {
        return Err(format!("the times do not grow with the size: {points:?}"));
    }
    let a = ((swt - c * swb) / sw).max(0.0);
    let n = ranks as f64;
    let steps = 2.0 * (n - 1.0);
    Ok((a / steps, steps / n / c))
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
    if gpus <= 1 {
        return 0.0;
    }
    let n = gpus as f64;
    let per_node = per_node.clamp(1, gpus);
    let (alpha, bus) = if gpus <= per_node {
        (nvlink.alpha, nvlink.bytes_per_s)
    } else {
        // Each node's k GPUs drive k NICs at once; the ring's steps inside a node still run on NVLink.
        (nic.alpha, nvlink.bytes_per_s.min(per_node as f64 * nic.bytes_per_s))
    };
    2.0 * (n - 1.0) * alpha + 2.0 * (n - 1.0) / n * bytes / bus
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
    let (p, v, m) = (stages, chunks, micro_batches);
    if p == 0 || rank >= p || v == 0 || m == 0 {
        return Err(format!("rank {rank} of {p} stages with {v} chunks and {m} micro-batches"));
    }
    if v > 1 && m % p != 0 {
        return Err(format!("{m} micro-batches are not a multiple of the {p} stages"));
    }
    // The k-th forward (backward): micro-batches in groups of p, each group through the chunks in
    // turn (backwards through them in reverse).
    let step = |k: usize, forward: bool| {
        let chunk = if v == 1 { 0 } else { (k % (p * v)) / p };
        let chunk = if forward { chunk } else { v - 1 - chunk };
        let micro_batch = if v == 1 { k } else { (k / (p * v)) * p + k % p };
        Step { forward, chunk, micro_batch }
    };
    let total = m * v;
    let warmup = if v == 1 { p - rank - 1 } else { (p - rank - 1) * 2 + (v - 1) * p }.min(total);
    let mut order: Vec<Step> = (0..warmup).map(|k| step(k, true)).collect();
    for k in 0..total - warmup {
        order.push(step(warmup + k, true));
        order.push(step(k, false));
    }
    order.extend((total - warmup..total).map(|k| step(k, false)));
    Ok(order)
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
    if ranks == 0 || cap == 0 || param_bytes.contains(&0) {
        return Err(format!(
            "{ranks} ranks, buckets of {cap} bytes, parameters of {param_bytes:?} bytes: each must be at least 1"
        ));
    }
    if !(link.alpha >= 0.0 && link.bytes_per_s > 0.0) {
        return Err(format!("a link needs α ≥ 0 and β > 0: {link:?}"));
    }
    if ranks == 1 {
        return Ok(StepComm { messages: 0, bytes_per_rank: 0.0, seconds: 0.0 });
    }
    // The buckets, walking from the last parameter to the first (lesson 05).
    let mut buckets: Vec<usize> = Vec::new();
    let mut open = 0;
    for &b in param_bytes.iter().rev() {
        if open > 0 && open + b > cap {
            buckets.push(open);
            open = 0;
        }
        open += b;
    }
    if open > 0 {
        buckets.push(open);
    }
    // Each bucket: a ring all-reduce, 2(n − 1) steps of α, each rank sending 2(n − 1)/n of it.
    let n = ranks as f64;
    let share = 2.0 * (n - 1.0) / n;
    let bytes: f64 = buckets.iter().map(|&b| b as f64).sum();
    let seconds = buckets.len() as f64 * 2.0 * (n - 1.0) * link.alpha + share * bytes / link.bytes_per_s;
    Ok(StepComm { messages: buckets.len(), bytes_per_rank: share * bytes, seconds })
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
    let p = plan;
    let counts = [p.layers, p.hidden, p.heads, p.seq, p.dp, p.tp, p.pp, p.micro_batch, p.micro_batches];
    if counts.contains(&0) || !(p.params > 0.0) {
        return Err(format!("every count of a plan must be at least 1: {p:?}"));
    }
    if p.heads % p.tp != 0 || p.layers % p.pp != 0 {
        return Err(format!("tp {} must divide the {} heads and pp {} the {} layers", p.tp, p.heads, p.pp, p.layers));
    }
    if p.zero > 3 || (p.zero >= 2 && p.pp > 1) {
        return Err(format!("ZeRO-{} with pp {}: ZeRO has stages 0 to 3, and at most 1 with pipelining", p.zero, p.pp));
    }
    // Model states: this rank's share of the parameters, then what ZeRO shards over dp.
    let local = p.params / (p.tp * p.pp) as f64;
    let dp = p.dp as f64;
    let (w, g, k) = (2.0, 4.0, 12.0);
    let model_states = match p.zero {
        0 => (w + g + k) * local,
        1 => (w + g) * local + k * local / dp,
        2 => w * local + (g + k) * local / dp,
        _ => (w + g + k) * local / dp,
    };
    // Activations: 34·s·b·h bytes a layer with selective recomputation, sharded over tp by
    // sequence parallelism; the first rank holds its L/p layers for min(p, m) micro-batches.
    let (s, b, h) = (p.seq as f64, p.micro_batch as f64, p.hidden as f64);
    let per_layer = 34.0 * s * b * h / p.tp as f64;
    let in_flight = p.pp.min(p.micro_batches) as f64;
    let activations = per_layer * (p.layers / p.pp) as f64 * in_flight;
    Ok(MemoryPerGpu { model_states, activations })
}
