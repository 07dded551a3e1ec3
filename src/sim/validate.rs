//! The published runs the simulator is checked against (lesson 15), with where each figure comes
//! from. No constant of the simulator is fitted to them; one modelling choice, the GEMMs'
//! roofline (`sim::gemm`), was made after Table 1 had been compared (lesson 15 says how).

use super::model::Model;
use super::step::Layout;
use crate::memory::Recompute;
use crate::precision::Precision;

/// One row of a published table: a model, a layout, what was measured.
#[derive(Clone, Debug)]
pub struct Published {
    pub name: String,
    pub model: Model,
    pub layout: Layout,
    /// TFLOP/s per GPU as the paper counts them (Megatron's Eq. 3).
    pub tflops_per_gpu: f64,
    pub source: &'static str,
}

/// Narayanan et al. 2021 (arXiv 2104.04473), Table 1: weak scaling of GPT models on Selene's
/// A100-80GB nodes, sequences of 2,048 and a vocabulary of 51,200, full activation
/// recomputation (the paper's §5.1, and its Eq. 3's count of FLOPs), fp16 mixed precision (fp16
/// gradients reduced in fp16). The table gives heads,
/// hidden size, layers, tp, pp, GPUs, batch size and the achieved TFLOP/s per GPU. The rest is
/// from the paper's own launch script, Megatron-LM's `examples/sc21/run_table_1.sh`: the
/// micro-batch (16 down to 1), the interleaved schedule's layers per virtual stage (76.1B: 5, so
/// v = 3; 145.6B: 5, v = 2; 310.1B: 3, v = 2; 529.6B: 1, v = 3) and the data-parallel
/// implementation (`--DDP-impl torch`, PyTorch's overlapped buckets, up to 18.4B; `local`,
/// reduced after the backward, above).
pub fn megatron_table_1() -> Vec<Published> {
    // (billions, heads, hidden, layers, tp, pp, gpus, batch, TFLOP/s per GPU, micro-batch, v, overlapped DDP)
    let rows: [(f64, usize, usize, usize, usize, usize, usize, usize, f64, usize, usize, bool); 10] = [
        (1.7, 24, 2304, 24, 1, 1, 32, 512, 137.0, 16, 1, true),
        (3.6, 32, 3072, 30, 2, 1, 64, 512, 138.0, 16, 1, true),
        (7.5, 32, 4096, 36, 4, 1, 128, 512, 142.0, 16, 1, true),
        (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135.0, 8, 1, true),
        (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138.0, 4, 1, false),
        (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140.0, 2, 3, false),
        (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148.0, 2, 2, false),
        (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155.0, 1, 2, false),
        (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163.0, 1, 3, false),
        (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163.0, 1, 1, false),
    ];
    rows.iter()
        .map(|&(billions, heads, hidden, layers, tp, pp, gpus, batch, tflops, mb, v, overlap)| {
            let mut layout = Layout::new(gpus / (tp * pp), tp, pp);
            layout.global_batch = batch;
            layout.micro_batch = mb;
            layout.interleave = v;
            layout.overlap_grad_reduce = overlap;
            layout.recompute = Recompute::Full;
            layout.precision = Precision::Fp16;
            Published {
                name: format!("{billions}B"),
                model: Model::gpt(layers, hidden, heads),
                layout,
                tflops_per_gpu: tflops,
                source: "Narayanan et al. 2021, Table 1",
            }
        })
        .collect()
}

/// Narayanan et al. 2021, §5.1: GPT-3 175B on 1,024 A100s with a batch of 1,536 reaches 140
/// TFLOP/s per GPU (their estimate of 34 days for 300B tokens rests on it). The paper and its
/// scripts do not give that run's layout. These are the ones with tp 8 (a node, as every large
/// run of theirs uses), micro-batch 1 and pp 8, 16 or 32, plain or interleaved (v chunks
/// dividing the 96 layers; their Figure 12 script runs the 175B model interleaved, their Table 1
/// interleaves its 145.6B and 310.1B rows). Shown beside the table, not part of it.
pub fn gpt3_175b_on_1024() -> Vec<Published> {
    [(8, 1), (8, 2), (8, 3), (16, 1), (16, 2), (16, 3), (32, 1), (32, 3)]
        .iter()
        .map(|&(pp, v)| {
            let mut layout = Layout::new(1024 / (8 * pp), 8, pp);
            layout.global_batch = 1536;
            layout.interleave = v;
            layout.recompute = Recompute::Full;
            layout.precision = Precision::Fp16;
            Published {
                name: "175B".into(),
                model: Model::gpt(96, 12288, 96),
                layout,
                tflops_per_gpu: 140.0,
                source: "Narayanan et al. 2021, §5.1 (layout not published)",
            }
        })
        .collect()
}

/// Each published row simulated on `gpu`: the row, the prediction, and the error of the
/// predicted TFLOP/s per GPU over the published (negative: predicted slower).
pub fn predicted(gpu: &super::Gpu, rows: Vec<Published>) -> Result<Vec<(Published, super::Prediction, f64)>, String> {
    rows.into_iter()
        .map(|r| {
            let p = super::simulate_step(&r.model, gpu, &r.layout)?;
            let e = p.megatron_tflops_per_gpu / r.tflops_per_gpu - 1.0;
            Ok((r, p, e))
        })
        .collect()
}

/// One published figure of NCCL's all-reduce bus bandwidth inside one 8-GPU node, large messages
/// (nccl-tests' `busbw`: the algorithm bandwidth × 2(n − 1)/n).
#[derive(Clone, Debug)]
pub struct PublishedBusBandwidth {
    pub gpu: &'static str,
    /// GB/s.
    pub bus_gb_s: f64,
    /// Whether NCCL ran the ring (what the simulator models) or NVLink SHARP (in-switch
    /// reduction, H100 and later, NCCL's default there; not modelled).
    pub ring: bool,
    pub source: &'static str,
}

/// What NCCL's maintainers and users report for one 8-GPU NVLink node.
pub fn nccl_bus_bandwidth() -> Vec<PublishedBusBandwidth> {
    vec![
        PublishedBusBandwidth {
            gpu: "a100-80gb",
            bus_gb_s: 240.0,
            ring: true,
            source: "NVIDIA/nccl#1054 (NCCL maintainer, 2023): application-level NVLink bandwidth is about 80% of \
                     the peak; NCCL's topology counts an A100's 12 links at 20 GB/s each, 240 GB/s",
        },
        PublishedBusBandwidth {
            gpu: "h100-80gb",
            bus_gb_s: 370.0,
            ring: true,
            source: "NVIDIA/nccl-tests#212 (NCCL maintainer, 2024): of NVLink 4's 450 GB/s, about 370 GB/s as busbw \
                     with NCCL_ALGO=RING or for operations other than all-reduce",
        },
        PublishedBusBandwidth {
            gpu: "h100-80gb",
            bus_gb_s: 480.0,
            ring: false,
            source: "NVIDIA/nccl-tests#212 (NCCL maintainer, 2024): all-reduce with NVLink SHARP, the default, peaks \
                     at about 480 GB/s busbw on 8 GPUs",
        },
        PublishedBusBandwidth {
            gpu: "h200",
            bus_gb_s: 475.0,
            ring: false,
            source: "NVIDIA/nccl-tests#272 (a user's 8× H200 run, NCCL 2.20, 2024): all_reduce_perf peaks at 475 GB/s \
                     busbw (NVLink SHARP)",
        },
    ]
}

/// The simulator's bus bandwidth for an all-reduce of `bytes` on one node of 8 `gpu`s: the
/// buffer over the simulated time, × 2(n − 1)/n, as nccl-tests computes `busbw` (GB/s).
pub fn simulated_bus_bandwidth(gpu: &super::Gpu, bytes: f64) -> f64 {
    let at = super::Placement { size: 8, per_node: 8 };
    let t = super::collective::time(gpu, super::Coll::AllReduce, bytes, at);
    bytes / t * 2.0 * 7.0 / 8.0 / 1e9
}

/// Table 1 and the 175B figure as `plan --validate` and `lesson15 validate` print them.
pub fn report(gpu: &super::Gpu) -> Result<String, String> {
    use std::fmt::Write;
    let mut out = String::from(
        "Narayanan et al. 2021, Table 1 (A100-80GB, fp16, full recompute; micro-batch, interleaving and DDP \
         from the paper's script, Megatron-LM examples/sc21/run_table_1.sh):\n",
    );
    let head = ["model", "GPUs", "tp", "pp", "v", "mb", "batch", "published", "predicted", "error"];
    let _ = writeln!(
        out,
        "{:>10} {:>5} {:>3} {:>3} {:>2} {:>3} {:>6} {:>10} {:>10} {:>7}",
        head[0], head[1], head[2], head[3], head[4], head[5], head[6], head[7], head[8], head[9]
    );
    let row = |out: &mut String, (r, p, e): &(Published, super::Prediction, f64)| {
        let l = &r.layout;
        let _ = writeln!(
            out,
            "{:>10} {:>5} {:>3} {:>3} {:>2} {:>3} {:>6} {:>10.0} {:>10.1} {:>+6.1}%",
            r.name,
            l.gpus(),
            l.tp,
            l.pp,
            l.interleave,
            l.micro_batch,
            l.global_batch,
            r.tflops_per_gpu,
            p.megatron_tflops_per_gpu,
            100.0 * e
        );
    };
    let table = predicted(gpu, megatron_table_1())?;
    for r in &table {
        row(&mut out, r);
    }
    let mean = table.iter().map(|(_, _, e)| e.abs()).sum::<f64>() / table.len() as f64;
    let _ = writeln!(out, "mean absolute error {:.1}%", 100.0 * mean);
    out += "(TFLOP/s per GPU as the paper counts them, its Eq. 3 with the recomputed forward.)\n";
    out += "GPT-3 175B on 1,024 A100s, batch 1,536 (§5.1: 140 TFLOP/s; its layout is not published: the candidates):\n";
    for r in &predicted(gpu, gpt3_175b_on_1024())? {
        row(&mut out, r);
    }
    out += "\nNCCL all-reduce bus bandwidth, one node of 8 GPUs, 4 GiB (nccl-tests' busbw):\n";
    let _ = writeln!(out, "{:>10} {:>6} {:>10} {:>10} {:>7}", "GPU", "algo", "published", "predicted", "error");
    for b in nccl_bus_bandwidth() {
        let g = super::profile(b.gpu)?;
        let p = simulated_bus_bandwidth(&g, 4.0 * (1u64 << 30) as f64);
        let algo = if b.ring { "ring" } else { "NVLS" };
        let note = if b.ring { "" } else { "  (NVLink SHARP reduces in the switch: not modelled)" };
        let _ = writeln!(
            out,
            "{:>10} {algo:>6} {:>10.0} {p:>10.0} {:>+6.1}%{note}",
            b.gpu,
            b.bus_gb_s,
            100.0 * (p / b.bus_gb_s - 1.0)
        );
    }
    Ok(out)
}
