//! One training step of a layout on a simulated cluster, in virtual time.
//!
//! Every replica does the same work, so one pipeline (its p ranks, each standing for its dp
//! replicas and its tp peers) is simulated and the rest follow by symmetry: the cost does not
//! grow with the number of GPUs, only with p·v·m, the operations of one pipeline.
//!
//! The step, as Megatron-LM (2021) and the course's engine run it:
//! 1. the pipeline: each rank runs the course's own schedule (`pipeline::schedule` for GPipe and
//!    1F1B, `pipeline::interleaved` for v > 1) through `pipeline::simulate_timed`; an operation
//!    of a chunk of layers costs its GEMMs by their shapes (`sim::gemm`; a measured profile's
//!    table and fused attention where it has them), its element-wise kernels at the memory
//!    bandwidth, tensor parallelism's collectives over the tp group (`sim::tp_comm`: every
//!    layer's, the embedding's and the output layer's and loss's), recomputation's forward, and
//!    the send of its activations to the next virtual stage; the last chunk adds the output
//!    layer;
//! 2. the data-parallel gradient reduction (`sim::dp_comm`): an all-reduce (ZeRO-0) or a reduce-scatter and the
//!    parameters' all-gather (ZeRO-1/2) after the last backward, exposed unless
//!    `overlap_grad_reduce`, where only what outlasts the last micro-batch's backward shows;
//!    ZeRO-3 gathers each chunk's parameters before its forward and backward and reduce-scatters
//!    its gradients after, every micro-batch, hidden behind compute as far as compute lasts;
//! 3. the optimizer: AdamW reads and writes every parameter's state it holds once (memory-bound;
//!    a measured profile's time per parameter where it has one).

use super::collective::{time, Coll, Placement};
use super::dp_comm::{exposed, DpStep};
use super::gemm::Gemm;
use super::hardware::Gpu;
use super::model::Model;
use super::tp_comm::{uncharged, TpComm};
use crate::memory::{layer_activation_bytes, model_state_bytes_with, Recompute, TransformerShape};
use crate::pipeline::{interleaved, schedule, simulate_timed, ChunkOp, Op, Schedule};
use crate::precision::Precision;
use serde::{Deserialize, Serialize};

/// How the model is laid out on the cluster: dp × tp × pp GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    /// Model chunks per pipeline rank (the interleaved schedule's v; 1: plain).
    pub interleave: usize,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Sequences per step, all replicas together.
    pub global_batch: usize,
    /// 0: DDP; 1, 2, 3: ZeRO's stages over dp.
    pub zero: u8,
    pub sequence_parallel: bool,
    pub recompute: Recompute,
    pub precision: Precision,
    pub schedule: Schedule,
    /// Reduce gradients while the last backward runs (PyTorch DDP's buckets, Megatron's
    /// `--overlap-grad-reduce`) instead of after it.
    pub overlap_grad_reduce: bool,
}

impl Layout {
    /// dp × tp × pp with one micro-batch of one sequence per step and replica, bf16, 1F1B,
    /// nothing else.
    pub fn new(dp: usize, tp: usize, pp: usize) -> Layout {
        Layout {
            dp,
            tp,
            pp,
            interleave: 1,
            micro_batch: 1,
            global_batch: dp,
            zero: 0,
            sequence_parallel: false,
            recompute: Recompute::None,
            precision: Precision::Bf16,
            schedule: Schedule::OneFOneB,
            overlap_grad_reduce: false,
        }
    }

    /// GPUs the layout takes.
    pub fn gpus(&self) -> usize {
        self.dp * self.tp * self.pp
    }

    /// Micro-batches per step and replica.
    pub fn micro_batches(&self) -> usize {
        self.global_batch / (self.dp * self.micro_batch).max(1)
    }

    /// Checks the layout against the model: what does not divide, and why it must.
    pub fn check(&self, m: &Model) -> Result<(), String> {
        m.check()?;
        let l = self;
        if [l.dp, l.tp, l.pp, l.interleave, l.micro_batch, l.global_batch].contains(&0) {
            return Err(format!("every degree and batch size must be at least 1: {l:?}"));
        }
        if m.heads % l.tp != 0 || m.ffn % l.tp != 0 || m.hidden % l.tp != 0 {
            return Err(format!(
                "tp {} must divide the heads {}, hidden {} and ffn {}",
                l.tp, m.heads, m.hidden, m.ffn
            ));
        }
        if m.layers % (l.pp * l.interleave) != 0 {
            return Err(format!(
                "pp {} × interleave {} must divide the {} layers (every chunk the same size)",
                l.pp, l.interleave, m.layers
            ));
        }
        if l.global_batch % (l.dp * l.micro_batch) != 0 {
            return Err(format!(
                "the global batch {} must be a multiple of dp {} × micro-batch {}",
                l.global_batch, l.dp, l.micro_batch
            ));
        }
        if l.interleave > 1 && (l.schedule != Schedule::OneFOneB || l.micro_batches() % l.pp != 0) {
            return Err(format!(
                "the interleaved schedule is 1F1B with micro-batches ({}) a multiple of pp ({})",
                l.micro_batches(),
                l.pp
            ));
        }
        if l.zero > 3 {
            return Err(format!("ZeRO has stages 0 to 3, not {}", l.zero));
        }
        if l.sequence_parallel && l.tp == 1 {
            return Err("sequence parallelism shards over the tensor-parallel group: it needs tp > 1".into());
        }
        Ok(())
    }
}

/// Where one rank's step time goes (seconds; they add up to the step).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Split {
    /// GEMMs and element-wise kernels, recomputation included.
    pub compute: f64,
    /// Tensor parallelism's collectives (on the critical path: not overlapped).
    pub tp_comm: f64,
    /// Sends between pipeline stages.
    pub pp_comm: f64,
    /// Waiting in the pipeline (the bubble).
    pub bubble: f64,
    /// Data parallelism's collectives that compute did not hide.
    pub dp_exposed: f64,
    pub optimizer: f64,
}

/// Memory per GPU, bytes (the busiest rank: the first pipeline rank).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Memory {
    /// Weights, gradients and optimizer state (the ZeRO paper's accounting, `shardlab::memory`).
    pub model_states: f64,
    pub activations: f64,
    pub total: f64,
}

/// What the simulator predicts for one step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub step_s: f64,
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation: [`Model::model_flops_per_token`] × tokens/s over the GPUs' peak.
    pub mfu: f64,
    /// TFLOP/s per GPU as Megatron counts them: the FLOPs computed, recomputation included
    /// ([`Model::hardware_flops`]; Narayanan et al. 2021's Eq. 3 under full recomputation).
    pub megatron_tflops_per_gpu: f64,
    pub split: Split,
    /// Tensor parallelism on the busiest rank, seconds a step: of `split.tp_comm`, the
    /// collectives at the model's ends (embedding, output layer, loss), and what the simulator
    /// leaves out (`sim::tp_comm::uncharged`, not in the step).
    #[serde(default)]
    pub tp_ends_s: f64,
    #[serde(default)]
    pub tp_uncharged_s: f64,
    pub memory: Memory,
    /// Whether the memory fits the GPU.
    pub fits: bool,
}

/// Seconds for memory-bound kernels that read and write `bytes` on `gpu` (GEMMs are timed by
/// their shapes, [`Gemm::time`]).
fn memory_time(gpu: &Gpu, bytes: f64) -> f64 {
    bytes / (gpu.memory_bytes_per_s * gpu.memory_efficiency)
}

/// The dense GEMM shapes one step of `model` under `layout` asks for: each layer's forward GEMMs
/// (QKV, projection, MLP up and down) and the output layer's, each followed by its backward two.
/// The attention's batched GEMMs are apart ([`Model::layer_gemms`]).
pub fn dense_gemm_shapes(model: &Model, layout: &Layout) -> Vec<Gemm> {
    let (dense, _) = model.layer_gemms(layout.micro_batch, layout.tp);
    let logits = model.logits_gemm(layout.micro_batch, layout.tp);
    dense.iter().chain([&logits]).flat_map(|g| [*g, g.backward()[0], g.backward()[1]]).collect()
}

/// A measured profile (this machine's) prices only what was measured: its precision, every dense
/// GEMM shape of the layout and, with a fused attention, the attention's shape.
fn measured_for(gpu: &Gpu, model: &Model, l: &Layout) -> Result<(), String> {
    if gpu.gemm_table.is_empty() {
        return Ok(());
    }
    let again = "measure the profile for this model and layout (`sim::calibrate::measure_kernels`)";
    if gpu.measured_precision != Some(l.precision) {
        return Err(format!(
            "{} was measured in {:?}, not {:?}: {again}",
            gpu.name, gpu.measured_precision, l.precision
        ));
    }
    if let Some(g) = dense_gemm_shapes(model, l).into_iter().find(|g| !gpu.gemm_table.iter().any(|t| t.gemm == *g)) {
        return Err(format!("{} has no time for the GEMM {g:?}: {again}", gpu.name));
    }
    let (batch, d) = (l.micro_batch * model.heads / l.tp, model.hidden / model.heads);
    if gpu.fused_attention && gpu.attention_time(batch, model.seq, d).is_none() {
        return Err(format!("{} has no time for the attention of {batch} × {} × {d}: {again}", gpu.name, model.seq));
    }
    Ok(())
}

/// Simulate one step of `model` laid out as `layout` on GPUs like `gpu`.
pub fn simulate_step(model: &Model, gpu: &Gpu, layout: &Layout) -> Result<Prediction, String> {
    gpu.check()?;
    layout.check(model)?;
    measured_for(gpu, model, layout)?;
    let l = layout;
    let (dp, tp, pp, v, m) = (l.dp, l.tp, l.pp, l.interleave, l.micro_batches());
    let g = gpu.gpus_per_node;
    if g % tp != 0 && tp % g != 0 {
        return Err(format!(
            "tp {tp} and {g} GPUs a node: a tensor-parallel group must fill whole nodes or fit in one \
             (one of the two must divide the other)"
        ));
    }
    let (b, t) = (l.micro_batch as f64, tp as f64);
    let act = if l.precision == Precision::Fp32 { 4.0 } else { 2.0 };
    // Gradient bytes: fp16 reduces fp16 gradients (Narayanan et al. 2021); bf16 accumulates and
    // reduces them in fp32 (Megatron-LM refuses bf16 otherwise); fp32, fp32.
    let grad = if l.precision == Precision::Fp16 { 2.0 } else { 4.0 };
    let tp_at = Placement::strided(tp, 1, g);
    let dp_at = Placement::strided(dp, tp, g);

    // One layer, one micro-batch, on one tp rank: its GEMMs by their shapes (`sim::gemm`), its
    // element-wise kernels by their bytes.
    let (dense, attn) = model.layer_gemms(l.micro_batch, tp);
    let fwd = |g: &[Gemm]| g.iter().map(|g| g.time(gpu, l.precision)).sum::<f64>();
    let bwd = |g: &[Gemm]| g.iter().flat_map(Gemm::backward).map(|g| g.time(gpu, l.precision)).sum::<f64>();
    let (ew, ew_attn) = model.elementwise_bytes(b, t, l.sequence_parallel);
    let ew_attn = if gpu.fused_attention { 0.0 } else { ew_attn };
    let (ew, ew_attn) = (ew * act / 2.0, ew_attn * act / 2.0);
    // A measured fused attention kernel where the profile has one, else its two batched GEMMs.
    let (attn_f, attn_b) = gpu
        .attention_time(l.micro_batch * model.heads / tp, model.seq, model.hidden / model.heads)
        .unwrap_or_else(|| (fwd(&attn), bwd(&attn)));
    let layer_f = fwd(&dense) + attn_f + memory_time(gpu, ew + ew_attn);
    let layer_b = bwd(&dense) + attn_b + 2.0 * memory_time(gpu, ew + ew_attn);
    let recompute = match l.recompute {
        Recompute::None => 0.0,
        Recompute::Selective => attn_f + memory_time(gpu, ew_attn),
        Recompute::Full => layer_f,
    };
    let activation = b * (model.seq * model.hidden) as f64 * act;
    // Tensor parallelism's collectives: every layer's, the embedding's and the head's (`tp_comm`).
    let tp_comm =
        TpComm::new(gpu, activation, b * model.seq as f64, tp_at, l.sequence_parallel, l.recompute == Recompute::Full);
    let h = model.hidden as f64;
    let tp_left = TpComm::of_list(gpu, &uncharged(activation, h, grad, l.sequence_parallel), tp_at);
    // A chunk's activations to the next virtual stage, on NVLink when the two pipeline ranks
    // share a node (ranks tp·dp apart), else a NIC. Each tp rank sends its 1/tp: with sequence
    // parallelism that is what it holds; without, Megatron's scatter-gather all-gathers it on the
    // far side.
    let stride = tp * dp;
    let send_between = |k: usize| {
        let (from, to) = ((k % pp) * stride, ((k + 1) % pp) * stride);
        let link = Placement { size: 2, per_node: if from / g == to / g { 2 } else { 1 } };
        time(gpu, Coll::SendRecv, activation / t, link)
            + if tp > 1 && !l.sequence_parallel { time(gpu, Coll::AllGather, activation, tp_at) } else { 0.0 }
    };
    let layers = (model.layers / (pp * v)) as f64;
    // After each micro-batch's backward, its gradients are added into the accumulated ones
    // (Megatron's `main_grad`): read both, write one, for the chunk's parameters.
    let chunk_params = layers * model.layer_params() / t;
    let accumulate = memory_time(gpu, chunk_params * (act + 2.0 * grad));
    let logits = [model.logits_gemm(l.micro_batch, tp)];
    let logits_bytes = memory_time(gpu, 12.0 * b * (model.seq * model.vocab) as f64 / t);
    let (logits_f, logits_b) = (fwd(&logits) + logits_bytes, bwd(&logits) + logits_bytes);
    let vs = pp * v;
    let compute_of = |k: usize, op: Op| match op {
        Op::Forward(_) => layers * layer_f + if k + 1 == vs { logits_f } else { 0.0 },
        Op::Backward(_) => layers * (layer_b + recompute) + accumulate + if k + 1 == vs { logits_b } else { 0.0 },
    };
    let tp_of = |k: usize, op: Op| tp_comm.of(layers, k, vs, matches!(op, Op::Forward(_)));
    let send_of = |k: usize, op: Op| match op {
        Op::Forward(_) if k + 1 < vs => send_between(k),
        Op::Backward(_) if k > 0 => send_between(k - 1),
        _ => 0.0,
    };
    let plans: Vec<Vec<ChunkOp>> = if v == 1 {
        (0..pp)
            .map(|r| schedule(l.schedule, pp, m, r).into_iter().map(|op| ChunkOp { chunk: 0, op }).collect())
            .collect()
    } else {
        (0..pp).map(|r| interleaved(pp, v, m, r)).collect::<Result<_, _>>()?
    };
    let timeline = simulate_timed(&plans, v, |k, op| compute_of(k, op) + tp_of(k, op) + send_of(k, op))?;
    let makespan = timeline.makespan();

    // The busiest rank's work: the first pipeline rank holds the embedding, the last the output
    // layer and the loss.
    let mut split = Split::default();
    let (mut busiest, mut tp_ends_s, mut tp_uncharged_s) = (0.0, 0.0, 0.0);
    for (r, plan) in plans.iter().enumerate() {
        let (mut s, mut ends, mut left) = (Split::default(), 0.0, 0.0);
        for o in plan {
            let k = o.chunk * pp + r;
            let forward = matches!(o.op, Op::Forward(_));
            s.compute += compute_of(k, o.op);
            s.tp_comm += tp_of(k, o.op);
            s.pp_comm += send_of(k, o.op);
            ends += tp_comm.ends(k, vs, forward);
            left += tp_left.of(layers, k, vs, forward);
        }
        if s.compute + s.tp_comm + s.pp_comm >= busiest {
            busiest = s.compute + s.tp_comm + s.pp_comm;
            (split, tp_ends_s, tp_uncharged_s) = (s, ends, left);
        }
    }
    split.bubble = makespan - busiest;

    // Data parallelism over the first pipeline rank's share of the model (its layers and the
    // token and position embeddings; the last rank holds a copy of the token embedding too).
    let (vocab, seq) = (model.vocab as f64, model.seq as f64);
    let local = (model.layers / pp) as f64 * model.layer_params() / t + vocab * h / t + seq * h;
    // The last backward a reduction can hide behind: the first rank's last micro-batch, its
    // chunks in turn.
    let last_backward = (0..v).map(|c| compute_of(c * pp, Op::Backward(0))).sum::<f64>();
    let dp_step = DpStep {
        params: local,
        weight_bytes: act,
        grad_bytes: grad,
        zero: l.zero,
        overlap_grad_reduce: l.overlap_grad_reduce,
        micro_batches: m,
        chunks: v,
        last_backward,
        compute: split.compute,
        busy: split.compute + split.tp_comm,
    };
    split.dp_exposed = exposed(gpu, &dp_step, dp_at);
    // AdamW over fp32 master weights: read master, both moments and the gradient, write master,
    // moments and the 16-bit weights (fp32 training: no separate master).
    let optim_bytes = if l.precision == Precision::Fp32 { 28.0 } else { 26.0 + grad };
    let held = if l.zero >= 1 { local / dp as f64 } else { local };
    split.optimizer = if gpu.optimizer_seconds_per_param > 0.0 {
        held * gpu.optimizer_seconds_per_param
    } else {
        memory_time(gpu, held * optim_bytes)
    };
    let step_s = makespan + split.dp_exposed + split.optimizer;

    // Memory of the first pipeline rank: model states, and the activations of the chunks its
    // schedule holds at once (counted from the timeline).
    let (w, gr, k) = if l.precision == Precision::Fp32 { (4.0, 4.0, 8.0) } else { (2.0, grad, 12.0) };
    let s = model_state_bytes_with(local, dp as f64, w, gr, k);
    let model_states = [s.ddp, s.zero1, s.zero2, s.zero3][l.zero as usize];
    let shape = TransformerShape {
        layers: model.layers as f64,
        hidden: model.hidden as f64,
        heads: model.heads as f64,
        seq: model.seq as f64,
        micro_batch: b,
    };
    let per_layer = layer_activation_bytes(&shape, t, l.sequence_parallel, l.recompute) * act / 2.0;
    let recomputing = if l.recompute == Recompute::Full {
        layer_activation_bytes(&shape, t, l.sequence_parallel, Recompute::None) * act / 2.0
    } else {
        0.0
    };
    let activations = timeline.peak_in_flight(0) as f64 * layers * per_layer + recomputing;
    let total = model_states + activations;
    let tokens = (l.global_batch * model.seq) as f64;
    let tokens_per_s = tokens / step_s;
    let gpus = l.gpus() as f64;
    let peak = gpu.peak_flops(l.precision);
    Ok(Prediction {
        step_s,
        tokens_per_s,
        mfu: tokens_per_s * model.model_flops_per_token() / (gpus * peak),
        megatron_tflops_per_gpu: model.hardware_flops(l.global_batch as f64, l.recompute) / step_s / gpus / 1e12,
        split,
        tp_ends_s,
        tp_uncharged_s,
        memory: Memory { model_states, activations, total },
        fits: total <= gpu.memory_bytes,
    })
}
