//! This machine as a simulator profile (lesson 15): its kernels timed one by one, its transport
//! fitted to α + B/β, so that the simulator's step can be checked against `train` here.
//!
//! ```text
//! cargo run --release --bin plan -- --validate --gpu this-machine
//! ```
//!
//! What is measured, in fp32 on one intra-op thread per rank (how `train` runs ranks that share
//! this machine's cores):
//!
//! * every dense GEMM shape the simulated step asks for ([`dense_gemm_shapes`]): the median time
//!   of `matmul` on tensors of that shape, with cold caches as in a step (each timing cycles
//!   through copies of its operands that span twice the last-level cache) and, on ranks that
//!   share the machine, after a barrier, so that they time each kernel at once
//!   ([`measure_kernels_with`]; every kernel below is timed the same way) — the table [`Gpu::gemm_table`] that takes the place of
//!   the GPU's peak and its tile and wave quantization;
//! * the attention: libtorch's fused `scaled_dot_product_attention` (what `Gpt::block` calls; on a
//!   CPU a flash-attention kernel that never writes the s × s scores), forward and backward, kept
//!   whole ([`Gpu::attention_table`]) in place of the attention's two batched GEMMs;
//! * the element-wise kernels: a block's two LayerNorms, the GeLU and the two residual adds, and
//!   the loss's log-softmax, forward and backward; their bytes as the simulator counts them
//!   (`Model::elementwise_bytes`, in fp32) over their time is the profile's memory bandwidth —
//!   so the element-wise term checks how the kernels are combined, not its own byte count;
//! * the course's AdamW, per parameter;
//! * the transport: all-reduces between two process ranks over shared memory (the data path
//!   `train` takes here), timed as nccl-tests does (`bench::measure_with`), fitted by least squares
//!   of the relative error to t = 2(n − 1)·α + 2(n − 1)/n · B / β (for two ranks, 2α + B/β: each
//!   rank's half crosses once each way, whichever algorithm runs).
//!
//! Nothing is fitted to a training step: the steps `train` takes here are what the profile is
//! checked against.

use super::gemm::{Gemm, Timed, TimedAttention};
use super::hardware::{Gpu, Link};
use super::model::Model;
use super::step::{dense_gemm_shapes, Layout};
use tch::{Device, Kind, Tensor};

/// The median of `reps` timings of `f` after one untimed call.
pub fn median_seconds(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t0 = std::time::Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn randn(shape: &[i64]) -> Tensor {
    Tensor::randn(shape, (Kind::Float, Device::Cpu))
}

/// This machine's last-level cache, bytes (Linux's sysfs; 32 MiB where it cannot be read).
fn last_level_cache() -> usize {
    (0..8)
        .rev()
        .find_map(|i| std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size")).ok())
        .and_then(|s| {
            let s = s.trim();
            let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
            let n: usize = n.parse().ok()?;
            Some(
                n * match unit {
                    "K" => 1 << 10,
                    "M" => 1 << 20,
                    _ => 1,
                },
            )
        })
        .unwrap_or(32 << 20)
}

/// Cold caches: in a step, a kernel finds its operands pushed out of the caches by the kernels
/// between, where a kernel timed again and again on the same tensors finds them cache-hot. Each
/// timing cycles through copies of its operands (`make` builds one set of `bytes`), as many as
/// span twice the last-level cache, at most 64: a set is read again only after the others (or,
/// where a timing reads fewer sets than there are, after the sets built after it) have pushed
/// it out.
fn cold_sets<T>(bytes: usize, make: impl Fn() -> T) -> Vec<T> {
    (0..(2 * last_level_cache()).div_ceil(bytes.max(1)).clamp(1, 64)).map(|_| make()).collect()
}

/// Called by every timing once its operands are built, just before it starts the clock: with
/// ranks that share the machine, a barrier, so that they time the same kernel at the same time
/// (as a step runs them) and never one rank's timing against the other's building of operands.
pub type Together<'a> = &'a dyn Fn();

/// [`median_seconds`] of `f` on each of `sets` in turn, from `next` on (carried over between two
/// timings of the same sets, so that the second does not start on the sets the first just read),
/// after `sync`.
fn median_cold<T>(reps: usize, sets: &[T], next: &mut usize, sync: Together, mut f: impl FnMut(&T)) -> f64 {
    sync();
    median_seconds(reps, || {
        f(&sets[*next % sets.len()]);
        *next += 1;
    })
}

/// Seconds of one `(batch × m × k) · (batch × k × n)` product in fp32, operands cold.
pub fn time_gemm(g: &Gemm, reps: usize, sync: Together) -> f64 {
    let (b, m, k, n) = (g.batch as i64, g.m as i64, g.k as i64, g.n as i64);
    let sets = cold_sets(4 * (b * (m * k + k * n)) as usize, || (randn(&[b, m, k]), randn(&[b, k, n])));
    if b == 1 {
        median_cold(reps, &sets, &mut 0, sync, |(x, w)| drop(x.squeeze_dim(0).matmul(&w.squeeze_dim(0))))
    } else {
        median_cold(reps, &sets, &mut 0, sync, |(x, w)| drop(x.bmm(w)))
    }
}

/// Seconds of the fused causal attention's forward, and of its backward, for `batch` sequences of
/// `heads` heads, `seq` tokens and head size `d`, operands cold.
pub fn time_attention(batch: usize, heads: usize, seq: usize, d: usize, reps: usize, sync: Together) -> (f64, f64) {
    let shape = [batch as i64, heads as i64, seq as i64, d as i64];
    let sets = cold_sets(4 * 4 * batch * heads * seq * d, || {
        let qkv: Vec<Tensor> = (0..3).map(|_| randn(&shape).set_requires_grad(true)).collect();
        (qkv, randn(&shape))
    });
    let sdpa = |qkv: &[Tensor]| {
        Tensor::scaled_dot_product_attention::<Tensor>(&qkv[0], &qkv[1], &qkv[2], None, 0.0, true, None, false)
    };
    let mut next = 0;
    let forward = median_cold(reps, &sets, &mut next, sync, |(qkv, _)| drop(tch::no_grad(|| sdpa(qkv))));
    // Forward and backward together, less the forward; the backward gets the output's gradient
    // through a product with a constant (one element-wise pass over the output, small beside the
    // attention's s² work).
    let both = median_cold(reps, &sets, &mut next, sync, |(qkv, grad_out)| {
        let y = sdpa(qkv);
        drop(Tensor::run_backward(&[(&y * grad_out).sum(Kind::Float)], qkv, false, false));
    });
    (forward, (both - forward).max(0.0))
}

/// Seconds of one block's element-wise kernels for `rows` tokens of width `h`, with an MLP of
/// width `f` on this rank: two LayerNorms, the GeLU and two residual adds, forward and backward.
pub fn time_elementwise(rows: usize, h: usize, f: usize, reps: usize, sync: Together) -> f64 {
    let (r, h, f) = (rows as i64, h as i64, f as i64);
    let (w, b) = (Tensor::ones([h], (Kind::Float, Device::Cpu)), Tensor::zeros([h], (Kind::Float, Device::Cpu)));
    let sets = cold_sets(4 * 2 * (r * (h + f)) as usize, || {
        (randn(&[r, h]).set_requires_grad(true), randn(&[r, f]).set_requires_grad(true), randn(&[r, h]), randn(&[r, f]))
    });
    median_cold(reps, &sets, &mut 0, sync, |(x, u, gh, gf)| {
        let a = x.layer_norm([h], Some(&w), Some(&b), 1e-5, false);
        let y = x + &a;
        let c = y.layer_norm([h], Some(&w), Some(&b), 1e-5, false);
        let z = &y + &c;
        let g = u.gelu("none");
        let loss = (&z * gh).sum(Kind::Float) + (&g * gf).sum(Kind::Float);
        drop(Tensor::run_backward(&[loss], &[x, u], false, false));
    })
}

/// What this machine's kernels measured for a model (every figure per rank, one thread).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Kernels {
    /// Every dense GEMM shape the layouts ask for ([`dense_gemm_shapes`]).
    pub gemms: Vec<Timed>,
    /// The fused attention of every layout, forward and backward.
    pub attention: Vec<TimedAttention>,
    /// The element-wise kernels' bytes as the simulator counts them over their measured time: a
    /// block's LayerNorms, GeLU and residual adds, and the loss's softmax over the vocabulary.
    pub elementwise_bytes_per_s: f64,
    /// The course's AdamW (`optim::AdamW`) per parameter.
    pub optimizer_seconds_per_param: f64,
}

impl Kernels {
    /// Each figure the slower of two ranks' (measured at the same time, for the same shapes):
    /// a step runs at its slowest rank's pace.
    pub fn slowest(&self, other: &Kernels) -> Kernels {
        let mut k = self.clone();
        for t in &mut k.gemms {
            if let Some(o) = other.gemms.iter().find(|o| o.gemm == t.gemm) {
                t.seconds = t.seconds.max(o.seconds);
            }
        }
        for a in &mut k.attention {
            if let Some(o) =
                other.attention.iter().find(|o| (o.batch, o.seq, o.head_dim) == (a.batch, a.seq, a.head_dim))
            {
                (a.forward, a.backward) = (a.forward.max(o.forward), a.backward.max(o.backward));
            }
        }
        k.elementwise_bytes_per_s = k.elementwise_bytes_per_s.min(other.elementwise_bytes_per_s);
        k.optimizer_seconds_per_param = k.optimizer_seconds_per_param.max(other.optimizer_seconds_per_param);
        k
    }
}

/// Seconds per parameter of one step of the course's AdamW on 4 Mi parameters.
pub fn time_optimizer(reps: usize, sync: Together) -> f64 {
    use crate::optim::{AdamW, AdamWConfig, Decay, Optimizer};
    let shape = [4096i64, 1024];
    let (p, g) = (randn(&shape), randn(&shape));
    let mut opt = AdamW::new(AdamWConfig::default());
    let decay = [Decay::for_shape(&shape)];
    let (params, grads) = ([p], [g]);
    sync();
    median_seconds(reps, || opt.step(1e-4, &params, &grads, &decay).expect("one slot")) / (4096.0 * 1024.0)
}

/// Seconds of the loss over `rows` tokens and a vocabulary of `vocab`: log-softmax and the
/// negative log-likelihood, forward and backward.
pub fn time_loss(rows: usize, vocab: usize, reps: usize, sync: Together) -> f64 {
    let sets = cold_sets(4 * rows * vocab, || {
        let logits = randn(&[rows as i64, vocab as i64]).set_requires_grad(true);
        (logits, Tensor::randint(vocab as i64, [rows as i64], (Kind::Int64, Device::Cpu)))
    });
    median_cold(reps, &sets, &mut 0, sync, |(logits, target)| {
        let loss = logits.cross_entropy_for_logits(target);
        drop(Tensor::run_backward(&[loss], &[logits], false, false));
    })
}

/// Time this machine's kernels for `model` under every one of `layouts` (fp32, on the calling
/// thread's libtorch threads: one, as each rank runs).
pub fn measure_kernels(model: &Model, layouts: &[Layout]) -> Result<Kernels, String> {
    measure_kernels_with(model, layouts, &|| ())
}

/// [`measure_kernels`] on ranks that share this machine: `sync` (a barrier over them) before
/// every timing, so that the ranks time each kernel together. Every rank must pass the same
/// `model` and `layouts`.
pub fn measure_kernels_with(model: &Model, layouts: &[Layout], sync: Together) -> Result<Kernels, String> {
    if layouts.iter().any(|l| l.precision != crate::precision::Precision::Fp32) {
        return Err("every layout must be fp32: this machine's profile is measured in fp32".into());
    }
    const REPS: usize = 9;
    let (mut gemms, mut attention): (Vec<Timed>, Vec<TimedAttention>) = (Vec::new(), Vec::new());
    let (mut bytes, mut seconds) = (0.0, 0.0);
    for l in layouts {
        for g in dense_gemm_shapes(model, l) {
            if !gemms.iter().any(|t| t.gemm == g) {
                gemms.push(Timed { gemm: g, seconds: time_gemm(&g, REPS, sync) });
            }
        }
        let (batch, heads, d) = (l.micro_batch, model.heads / l.tp, model.hidden / model.heads);
        if !attention.iter().any(|a| (a.batch, a.seq, a.head_dim) == (batch * heads, model.seq, d)) {
            let (forward, backward) = time_attention(batch, heads, model.seq, d, REPS, sync);
            attention.push(TimedAttention { batch: batch * heads, seq: model.seq, head_dim: d, forward, backward });
        }
        // The simulator charges a forward's element-wise bytes once forward and twice backward,
        // in fp32 twice its 16-bit count, and the loss 12 bytes a logit forward and again
        // backward (`sim::step`).
        let rows = l.micro_batch * model.seq;
        let (ew, _) = model.elementwise_bytes(l.micro_batch as f64, l.tp as f64, false);
        bytes += 3.0 * 2.0 * ew * model.layers as f64 + 2.0 * 12.0 * (rows * model.vocab / l.tp) as f64;
        seconds += model.layers as f64 * time_elementwise(rows, model.hidden, model.ffn / l.tp, REPS, sync)
            + time_loss(rows, model.vocab / l.tp, REPS, sync);
    }
    Ok(Kernels {
        gemms,
        attention,
        elementwise_bytes_per_s: bytes / seconds,
        optimizer_seconds_per_param: time_optimizer(5, sync),
    })
}

/// Fit a ring all-reduce's α (seconds per step) and bus bandwidth β (bytes/s) on `n` ranks to
/// measured (bytes, seconds) points: t = a + c·B by least squares of the relative error (sizes
/// span orders of magnitude), then α = a / (2(n − 1)) and β = 2(n − 1)/n / c.
pub fn fit_all_reduce(points: &[(f64, f64)], n: usize) -> Result<(f64, f64), String> {
    if points.len() < 2 || n < 2 || points.iter().any(|p| !(p.0 > 0.0 && p.1 > 0.0)) {
        return Err(format!("an α-β fit needs two sizes or more, positive times, two ranks or more: {points:?}"));
    }
    // Weights 1/t²: the normal equations of Σ((a + c·B − t)/t)².
    let (mut sw, mut swb, mut swbb, mut swt, mut swbt) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(b, t) in points {
        let w = 1.0 / (t * t);
        (sw, swb, swbb, swt, swbt) = (sw + w, swb + w * b, swbb + w * b * b, swt + w * t, swbt + w * b * t);
    }
    let det = sw * swbb - swb * swb;
    let c = (sw * swbt - swb * swt) / det;
    let a = (swt - c * swb) / sw;
    if !(det > 0.0 && c > 0.0) {
        return Err(format!("the all-reduce times do not grow with the size: {points:?}"));
    }
    let steps = 2.0 * (n as f64 - 1.0);
    Ok((a.max(0.0) / steps, steps / n as f64 / c))
}

/// This machine as a [`Gpu`]: `ranks` ranks a "node" (one per core), each with `memory_bytes`,
/// its kernels as `k` measured them, and the transport's fitted α and β.
pub fn this_machine(k: &Kernels, ranks: usize, memory_bytes: f64, (alpha, beta): (f64, f64)) -> Result<Gpu, String> {
    let best = k.gemms.iter().map(|t| t.gemm.flops() / t.seconds).fold(0.0, f64::max);
    let link = Link { alpha, bytes_per_s: beta, efficiency: 1.0 };
    let gpu = Gpu {
        name: "this-machine".into(),
        peak_flops_16: best,
        peak_flops_32: best,
        memory_bytes,
        memory_bytes_per_s: k.elementwise_bytes_per_s,
        sms: 1,
        gpus_per_node: ranks,
        intra: link,
        inter: link,
        gemm_efficiency: 1.0,
        memory_efficiency: 1.0,
        gemm_table: k.gemms.clone(),
        attention_table: k.attention.clone(),
        measured_precision: Some(crate::precision::Precision::Fp32),
        fused_attention: true,
        optimizer_seconds_per_param: k.optimizer_seconds_per_param,
        source: "measured here (`sim::calibrate`): GEMMs, the fused attention, the element-wise kernels and \
                 AdamW timed one by one in fp32 on one thread; all-reduces between process ranks fitted to α-β"
            .into(),
    };
    gpu.check()?;
    Ok(gpu)
}
