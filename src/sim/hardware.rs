//! The simulator's hardware: one table of GPU and network profiles, each figure with its source.
//! Nothing here is tuned to a run the simulator is checked against (lesson 15's validation).
//!
//! A profile is a node of `gpus_per_node` GPUs. Within a node every GPU reaches every other at
//! `intra` (NVLink through NVSwitch); between nodes each GPU has its own NIC at `inter`
//! (InfiniBand, one HCA per GPU on DGX systems). Bandwidths are per GPU and per direction.
//!
//! In the data-sheet profiles the two efficiencies are the only figures that are not a data
//! sheet's: what fraction of the peak a large matrix multiplication and a large memory-bound
//! kernel reach, the same for every GPU, from published measurements ([`GEMM_EFFICIENCY`],
//! [`HBM_EFFICIENCY`]). A measured profile (`sim::calibrate`) carries tables of timed kernels.

use serde::{Deserialize, Serialize};

/// One kind of link: a message of B bytes takes `alpha + B / (bytes_per_s · efficiency)` seconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// Seconds of latency per message (per step of a ring).
    pub alpha: f64,
    /// The line rate, bytes per second per GPU and per direction (the data sheet's).
    pub bytes_per_s: f64,
    /// The fraction of the line rate NCCL's collectives reach on it.
    pub efficiency: f64,
}

impl Link {
    /// Bytes per second a collective moves on this link.
    pub fn achieved(&self) -> f64 {
        self.bytes_per_s * self.efficiency
    }
}

/// A GPU and the cluster it sits in.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// The name `plan --gpu` takes.
    pub name: String,
    /// Dense 16-bit (bf16/fp16) tensor-core peak, FLOP/s.
    pub peak_flops_16: f64,
    /// Dense fp32 peak without TF32, FLOP/s.
    pub peak_flops_32: f64,
    /// Device memory, bytes (what `nvidia-smi` reports as the total: "80GB" cards hold 80 GiB).
    pub memory_bytes: f64,
    /// Device memory bandwidth, bytes per second.
    pub memory_bytes_per_s: f64,
    /// Streaming multiprocessors (a GEMM's tiles run in waves of one per SM, `sim::gemm`).
    pub sms: usize,
    /// GPUs per node.
    pub gpus_per_node: usize,
    /// Within a node.
    pub intra: Link,
    /// Between nodes, per GPU (its own NIC).
    pub inter: Link,
    /// The fraction of the peak a large matrix multiplication reaches.
    pub gemm_efficiency: f64,
    /// The fraction of the memory bandwidth a large element-wise kernel reaches.
    pub memory_efficiency: f64,
    /// Measured GEMM times by shape (this machine's profile, `sim::calibrate`): a shape's time
    /// replaces the peak, efficiency and quantization model, and `simulate_step` refuses a layout
    /// with a shape the table lacks. Empty for the GPUs.
    #[serde(default)]
    pub gemm_table: Vec<super::gemm::Timed>,
    /// Measured fused attention kernels, charged in place of the attention's GEMMs where one
    /// matches. Empty for the GPUs.
    #[serde(default)]
    pub attention_table: Vec<super::gemm::TimedAttention>,
    /// The precision a measured profile's tables hold (`None` for the data-sheet profiles).
    #[serde(default)]
    pub measured_precision: Option<crate::precision::Precision>,
    /// The attention is one fused kernel (flash attention; timed in the table): its s × s scores
    /// are never written, so no element-wise traffic is charged for them. False for the GPU
    /// profiles, as in the 2021 runs they are checked against.
    #[serde(default)]
    pub fused_attention: bool,
    /// Measured seconds of the optimizer per parameter it updates (this machine's profile); 0: the
    /// memory-bound model (every state read and written once at the memory bandwidth).
    #[serde(default)]
    pub optimizer_seconds_per_param: f64,
    /// Where the figures come from.
    pub source: String,
}

/// The fraction of the dense peak a large bf16/fp16 cuBLAS GEMM reaches on A100 and H100: an
/// assumption of about 75–80%, the range published GEMM sweeps show for both (NVIDIA's "Matrix
/// Multiplication Background" guide plots A100 GEMMs well below the peak even at large sizes).
/// One figure for every GPU, chosen before any comparison and not fitted to one.
pub const GEMM_EFFICIENCY: f64 = 0.78;

/// The fraction of HBM's peak bandwidth an element-wise kernel reaches: an assumption of 85%
/// (bandwidth tests reach about 90%; a step's LayerNorms, softmaxes and dropouts a little less).
pub const HBM_EFFICIENCY: f64 = 0.85;

/// NCCL's per-step latencies are a few microseconds within a node and somewhat more across
/// InfiniBand (its tuning model, `src/graph/tuning.cc`, uses base latencies of a few µs per
/// algorithm plus per-hop latencies); they matter for small messages only.
const NVLINK_ALPHA: f64 = 5e-6;
const IB_ALPHA: f64 = 10e-6;

/// NCCL's ring reaches about 80% of NVLink's line rate: "the app-level bandwidth is 80% of the
/// peak" (NCCL's maintainer, NVIDIA/nccl#1054; its topology counts an A100 link at 20 of 25 GB/s)
/// and about 370 of H100's 450 GB/s as ring busbw (NVIDIA/nccl-tests#212). 0.78 was chosen before
/// those were found; `sim::validate::nccl_bus_bandwidth` checks it against them (−2.7%, −5.4%).
/// NVLink SHARP, H100's default all-reduce inside a node (about 480 GB/s busbw), is not modelled.
/// InfiniBand's large messages reach about 92% of line rate.
const NVLINK_EFFICIENCY: f64 = 0.78;
const IB_EFFICIENCY: f64 = 0.92;

const MIB: f64 = 1048576.0;

/// The built-in profiles: `a100-80gb`, `h100-80gb`, `h200`.
pub fn profiles() -> Vec<Gpu> {
    vec![
        Gpu {
            name: "a100-80gb".into(),
            peak_flops_16: 312e12,
            peak_flops_32: 19.5e12,
            memory_bytes: 81920.0 * MIB,
            memory_bytes_per_s: 2.039e12,
            sms: 108,
            gpus_per_node: 8,
            // NVLink 3: 600 GB/s per GPU both directions together.
            intra: Link { alpha: NVLINK_ALPHA, bytes_per_s: 300e9, efficiency: NVLINK_EFFICIENCY },
            // DGX A100 / Selene: eight 200 Gb/s HDR InfiniBand HCAs per node, one per GPU.
            inter: Link { alpha: IB_ALPHA, bytes_per_s: 25e9, efficiency: IB_EFFICIENCY },
            gemm_efficiency: GEMM_EFFICIENCY,
            memory_efficiency: HBM_EFFICIENCY,
            gemm_table: Vec::new(),
            attention_table: Vec::new(),
            measured_precision: None,
            fused_attention: false,
            optimizer_seconds_per_param: 0.0,
            source: "NVIDIA A100 Tensor Core GPU data sheet (SXM4 80GB: 312 TFLOP/s dense bf16, 2,039 GB/s, \
                     NVLink 600 GB/s; 108 SMs, the A100 architecture whitepaper); DGX A100 data sheet (8× 200 Gb/s HDR HCAs), the cluster of \
                     Narayanan et al. 2021 §5"
                .into(),
        },
        Gpu {
            name: "h100-80gb".into(),
            peak_flops_16: 989e12,
            peak_flops_32: 67e12,
            memory_bytes: 81559.0 * MIB,
            memory_bytes_per_s: 3.35e12,
            sms: 132,
            gpus_per_node: 8,
            // NVLink 4: 900 GB/s per GPU both directions together.
            intra: Link { alpha: NVLINK_ALPHA, bytes_per_s: 450e9, efficiency: NVLINK_EFFICIENCY },
            // DGX H100: eight 400 Gb/s NDR ConnectX-7 ports per node, one per GPU.
            inter: Link { alpha: IB_ALPHA, bytes_per_s: 50e9, efficiency: IB_EFFICIENCY },
            gemm_efficiency: GEMM_EFFICIENCY,
            memory_efficiency: HBM_EFFICIENCY,
            gemm_table: Vec::new(),
            attention_table: Vec::new(),
            measured_precision: None,
            fused_attention: false,
            optimizer_seconds_per_param: 0.0,
            source: "NVIDIA H100 Tensor Core GPU data sheet (SXM5: 989 TFLOP/s dense bf16, 3.35 TB/s, NVLink \
                     900 GB/s; 132 SMs, the H100 architecture whitepaper); DGX H100 data sheet (8× 400 Gb/s ConnectX-7)"
                .into(),
        },
        Gpu {
            name: "h200".into(),
            peak_flops_16: 989e12,
            peak_flops_32: 67e12,
            memory_bytes: 143771.0 * MIB,
            memory_bytes_per_s: 4.8e12,
            sms: 132,
            gpus_per_node: 8,
            intra: Link { alpha: NVLINK_ALPHA, bytes_per_s: 450e9, efficiency: NVLINK_EFFICIENCY },
            inter: Link { alpha: IB_ALPHA, bytes_per_s: 50e9, efficiency: IB_EFFICIENCY },
            gemm_efficiency: GEMM_EFFICIENCY,
            memory_efficiency: HBM_EFFICIENCY,
            gemm_table: Vec::new(),
            attention_table: Vec::new(),
            measured_precision: None,
            fused_attention: false,
            optimizer_seconds_per_param: 0.0,
            source: "NVIDIA H200 Tensor Core GPU data sheet (SXM: 989 TFLOP/s dense bf16, 141 GB, 4.8 TB/s, \
                     NVLink 900 GB/s; the H100's 132 SMs); DGX H200 (8× 400 Gb/s ConnectX-7)"
                .into(),
        },
    ]
}

/// The profile called `name` (case-insensitive), or an error that lists the names.
pub fn profile(name: &str) -> Result<Gpu, String> {
    let all = profiles();
    let names: Vec<String> = all.iter().map(|g| g.name.clone()).collect();
    all.into_iter()
        .find(|g| g.name.eq_ignore_ascii_case(name))
        .ok_or_else(|| format!("no GPU profile called {name:?}; there are {}", names.join(", ")))
}

impl Gpu {
    /// The dense peak for GEMMs in `precision`: the 16-bit tensor-core peak, or fp32's.
    pub fn peak_flops(&self, precision: crate::precision::Precision) -> f64 {
        if precision == crate::precision::Precision::Fp32 {
            self.peak_flops_32
        } else {
            self.peak_flops_16
        }
    }

    /// The measured fused attention's (forward, backward) seconds for `batch` sequences × local
    /// heads of `seq` tokens and head size `head_dim`, if this profile has it.
    pub fn attention_time(&self, batch: usize, seq: usize, head_dim: usize) -> Option<(f64, f64)> {
        self.attention_table
            .iter()
            .find(|a| (a.batch, a.seq, a.head_dim) == (batch, seq, head_dim))
            .map(|a| (a.forward, a.backward))
    }

    /// Checks that every figure is a positive number.
    pub fn check(&self) -> Result<(), String> {
        let figures = [
            ("peak_flops_16", self.peak_flops_16),
            ("peak_flops_32", self.peak_flops_32),
            ("memory_bytes", self.memory_bytes),
            ("memory_bytes_per_s", self.memory_bytes_per_s),
            ("intra.bytes_per_s", self.intra.bytes_per_s),
            ("inter.bytes_per_s", self.inter.bytes_per_s),
            ("intra.efficiency", self.intra.efficiency),
            ("inter.efficiency", self.inter.efficiency),
            ("gemm_efficiency", self.gemm_efficiency),
            ("memory_efficiency", self.memory_efficiency),
        ];
        for (what, v) in figures {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{}: {what} must be a positive number, not {v}", self.name));
            }
        }
        let times = self.gemm_table.iter().map(|t| t.seconds);
        let attention = self.attention_table.iter().flat_map(|a| [a.forward, a.backward]);
        if times.chain(attention).any(|t| !(t.is_finite() && t > 0.0))
            || !(self.optimizer_seconds_per_param.is_finite() && self.optimizer_seconds_per_param >= 0.0)
        {
            return Err(format!("{}: every measured time must be a positive number", self.name));
        }
        if !(self.intra.alpha >= 0.0 && self.inter.alpha >= 0.0) || self.gpus_per_node == 0 || self.sms == 0 {
            return Err(format!("{}: latencies must not be negative and a node holds a GPU", self.name));
        }
        Ok(())
    }
}
