//! `plan --validate`: the simulator checked against published runs ([`published`]: Narayanan et
//! al. 2021, Table 1) and, with `--gpu this-machine`, against `train` on this machine
//! ([`this_machine`]):
//!
//! 1. the profile (`shardlab::sim::calibrate`): all-reduces between two process ranks fitted to
//!    α-β, then the model's GEMMs, fused attention, element-wise kernels and AdamW timed on both
//!    ranks at once (a two-rank layout's profile) and on one alone (the one-rank layout's);
//! 2. each layout simulated with that profile;
//! 3. each layout trained by `train`'s own code in a fresh process tree (`job::run_isolated`), its
//!    median step time taken `repeats` times; the median of those is the measurement.
//!
//! The model is the course's benchmark GPT (`GptConfig::bench()`: 4 layers, 256 wide, 4 heads,
//! 128 tokens, vocabulary 4,096), batch 8 rows per rank as `train` runs it: the data-parallel
//! layouts take 8 rows a rank, tp 2 runs 16 rows on both ranks, pp 2 cuts 16 rows into 4
//! micro-batches.

use serde_json::json;
use shardlab::bench::{self, Iters, Method, Timing};
use shardlab::comm::{Algo, Backend, OpKind};
use shardlab::ddp::Variant;
use shardlab::job::{self, GptJob, OneRun};
use shardlab::memory::Recompute;
use shardlab::model::GptConfig;
use shardlab::pipeline::{PipelineConfig, Schedule};
use shardlab::precision::Precision;
use shardlab::sim::{calibrate, simulate_step, validate, Gpu, Layout, Model};
use shardlab::stages::Checkpointing;
use shardlab::trainer::Strategy;
use std::time::Instant;

const RANKS: usize = 2;
const SIZES: [u64; 5] = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20];

/// (name, train's strategy, tp, pp, the simulator's layout)
fn layouts() -> Vec<(&'static str, Strategy, usize, usize, Layout)> {
    let lay = |dp, tp, pp, micro_batch, zero| {
        let mut l = Layout::new(dp, tp, pp);
        l.micro_batch = micro_batch;
        l.global_batch = 8 * RANKS.min(dp * tp * pp);
        l.zero = zero;
        l.precision = Precision::Fp32;
        // ZeRO-1/2 reduce-scatter each unit's gradients during the backward. Bucketed DDP would,
        // but this model's 17 MB of gradients fit one 25 MiB bucket, whose all-reduce starts
        // when the embedding's gradient, the backward's last, is ready: nothing overlaps.
        l.overlap_grad_reduce = zero > 0;
        l
    };
    vec![
        ("single", Strategy::Single, 1, 1, lay(1, 1, 1, 8, 0)),
        ("ddp × 2", Strategy::Ddp, 1, 1, lay(2, 1, 1, 8, 0)),
        ("zero1 × 2", Strategy::Zero1, 1, 1, lay(2, 1, 1, 8, 1)),
        ("zero2 × 2", Strategy::Zero2, 1, 1, lay(2, 1, 1, 8, 2)),
        // ZeRO-3 frees each block's gathered weights after its forward and recomputes the block in
        // backward (`zero::Zero::reshard_after_forward`, on in `train`): full recomputation.
        ("zero3 × 2", Strategy::Zero3, 1, 1, Layout { recompute: Recompute::Full, ..lay(2, 1, 1, 8, 3) }),
        ("tp 2", Strategy::Ddp, 2, 1, lay(1, 2, 1, 16, 0)),
        ("pp 2, 4 micro-batches", Strategy::Ddp, 1, 2, lay(1, 1, 2, 4, 0)),
    ]
}

fn memory_total() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().find(|l| l.starts_with("MemTotal:")).map(str::to_owned))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<f64>().ok()))
        .map_or(16e9, |kb| kb * 1024.0)
}

pub fn this_machine(repeats: usize, json: bool) -> anyhow::Result<()> {
    anyhow::ensure!(repeats >= 1, "--repeats must be at least 1");
    let cfg = GptConfig::bench();
    let model = Model {
        layers: cfg.n_layer as usize,
        hidden: cfg.n_embd as usize,
        heads: cfg.n_head as usize,
        ffn: 4 * cfg.n_embd as usize,
        seq: cfg.block_size as usize,
        vocab: cfg.vocab_size as usize,
    };
    let all = layouts();
    let sim_layouts: Vec<Layout> = all.iter().map(|r| r.4).collect();
    // 1. The transport between two process ranks, then the kernels timed on every rank at once
    //    (the ranks share the machine's memory and caches as they do in training). The children
    //    this call starts run only this closure.
    let timing = Timing { warmup: 3, iters: Iters::Auto, method: Method::NcclTests };
    let ranks = shardlab::launch::spawn(RANKS, Backend::Tcp, |pg| {
        let mut t = Vec::new();
        for b in SIZES {
            t.push(bench::measure_with(pg, "shardlab", OpKind::AllReduce, Algo::Auto, b, timing)?.time_s);
        }
        pg.barrier()?;
        // A barrier before every timing: both ranks time the same kernel at once. A failed
        // barrier (the other rank gone) is kept and returned once the timings end.
        let failed = std::cell::RefCell::new(None);
        let sync = || {
            if failed.borrow().is_none() {
                if let Err(e) = pg.barrier() {
                    *failed.borrow_mut() = Some(e);
                }
            }
        };
        let k = calibrate::measure_kernels_with(&model, &sim_layouts, &sync).map_err(anyhow::Error::msg)?;
        if let Some(e) = failed.into_inner() {
            return Err(e.into());
        }
        Ok((t, k))
    })?;
    let points: Vec<(f64, f64)> = SIZES.iter().zip(&ranks[0].0).map(|(b, t)| (*b as f64, *t)).collect();
    let (alpha, beta) = calibrate::fit_all_reduce(&points, RANKS).map_err(anyhow::Error::msg)?;
    let memory = memory_total() / RANKS as f64;
    let slowest = ranks[1..].iter().fold(ranks[0].1.clone(), |k, r| k.slowest(&r.1));
    let loaded = calibrate::this_machine(&slowest, RANKS, memory, (alpha, beta)).map_err(anyhow::Error::msg)?;
    // 2. The same kernels with the machine to this one thread: a one-rank layout's.
    tch::set_num_threads(1);
    shardlab::launch::keep_freed_memory();
    let one: Vec<Layout> = sim_layouts.iter().filter(|l| l.gpus() == 1).copied().collect();
    let k = calibrate::measure_kernels(&model, &one).map_err(anyhow::Error::msg)?;
    let alone = calibrate::this_machine(&k, RANKS, memory, (alpha, beta)).map_err(anyhow::Error::msg)?;
    let gpu = &loaded;
    if json {
        let profile = |g: &shardlab::sim::Gpu| {
            json!({"gemm_shapes": g.gemm_table.len(), "best_gemm_flops_per_s": g.peak_flops_32,
                   "elementwise_bytes_per_s": g.memory_bytes_per_s, "adamw_seconds_per_param": g.optimizer_seconds_per_param})
        };
        println!(
            "{}",
            json!({"alpha_s": alpha, "beta_bytes_per_s": beta, "all_reduce_points": points,
                   "both_ranks_busy": profile(gpu), "alone": profile(&alone)})
        );
    } else {
        println!("this machine, {RANKS} ranks of one thread (fp32):");
        println!(
            "  all-reduce between process ranks: α {:.1} µs, β {:.2} GB/s (fitted to 64 KiB–16 MiB)",
            alpha * 1e6,
            beta / 1e9
        );
        println!(
            "  with both ranks busy (the slower rank's): GEMMs {:.1}–{:.1} GFLOP/s over {} shapes; element-wise {:.1} GB/s; AdamW {:.1} ns a parameter",
            gpu.gemm_table.iter().map(|t| t.gemm.flops() / t.seconds).fold(f64::MAX, f64::min) / 1e9,
            gpu.peak_flops_32 / 1e9,
            gpu.gemm_table.len(),
            gpu.memory_bytes_per_s / 1e9,
            gpu.optimizer_seconds_per_param * 1e9
        );
        println!(
            "  alone: GEMMs up to {:.1} GFLOP/s; element-wise {:.1} GB/s; AdamW {:.1} ns a parameter",
            alone.peak_flops_32 / 1e9,
            alone.memory_bytes_per_s / 1e9,
            alone.optimizer_seconds_per_param * 1e9
        );
        println!("\n{:<24} {:>12} {:>12} {:>8}   runs (median step, ms)", "layout", "predicted", "measured", "error");
    }

    // 3. Each layout simulated, then trained.
    let corpus = job::TempCorpus::new("plan-validate", 400_000)?;
    let job = GptJob::benchmark(cfg, corpus.path.clone(), 12, 4);
    let mut errors = Vec::new();
    for (name, strategy, tp, pp, layout) in all {
        let profile = if layout.gpus() == 1 { &alone } else { &loaded };
        let predicted = simulate_step(&model, profile, &layout).map_err(anyhow::Error::msg)?;
        let run = OneRun {
            job: job.clone(),
            strategy,
            world_size: layout.gpus(),
            backend: Backend::Tcp,
            variant: Variant::Bucketed,
            bucket_cap_bytes: 25 << 20,
            threads: Some(1),
            checkpointing: Checkpointing::None,
            reshard_after_forward: true,
            precision: Precision::Fp32,
            reduce_dtype: Precision::Fp32,
            offload: false,
            device: Default::default(),
            tp,
            pp: PipelineConfig { stages: pp, micro_batches: 4, schedule: Schedule::OneFOneB },
        };
        let mut runs = Vec::new();
        for _ in 0..repeats {
            runs.push(job::run_isolated(&run)?.median_step_s);
        }
        let mut sorted = runs.clone();
        sorted.sort_by(f64::total_cmp);
        let measured = sorted[sorted.len() / 2];
        let error = predicted.step_s / measured - 1.0;
        if json {
            println!(
                "{}",
                json!({"layout": name, "predicted_step_s": predicted.step_s, "measured_step_s": measured,
                       "runs_s": runs, "error": error, "split": predicted.split,
                       "tp_ends_s": predicted.tp_ends_s})
            );
        } else {
            let ms: Vec<String> = runs.iter().map(|s| format!("{:.0}", s * 1e3)).collect();
            println!(
                "{:<24} {:>9.0} ms {:>9.0} ms {:>+7.1}%   {}",
                name,
                predicted.step_s * 1e3,
                measured * 1e3,
                100.0 * error,
                ms.join(" ")
            );
            if predicted.split.tp_comm > 0.0 {
                println!(
                    "{:<24} of which tp comm {:.1} ms, {:.1} ms of it at the model's ends (embedding, output layer, loss)",
                    "",
                    predicted.split.tp_comm * 1e3,
                    predicted.tp_ends_s * 1e3
                );
            }
        }
        errors.push(error);
    }
    if !json {
        let mean = errors.iter().map(|e| e.abs()).sum::<f64>() / errors.len() as f64;
        println!(
            "\nmean absolute error {:.1}% (the median of {repeats} runs each; `train`'s median step)",
            100.0 * mean
        );
    }
    Ok(())
}

/// The published runs (Narayanan et al. 2021, Table 1) predicted, and the simulator's own time.
pub fn published(gpu: &Gpu, json: bool) -> anyhow::Result<()> {
    anyhow::ensure!(gpu.name == "a100-80gb", "the published runs are on A100-80GB: --gpu a100-80gb (the default)");
    let rows = validate::predicted(gpu, validate::megatron_table_1()).map_err(anyhow::Error::msg)?;
    // The simulator's own time: the 175B model on 8, 1,024 and 16,384 GPUs.
    let model = Model::gpt(96, 12288, 96);
    let mut timings = Vec::new();
    for (gpus, tp, pp) in [(8, 8, 1), (1024, 8, 16), (16384, 8, 16)] {
        let mut l = Layout::new(gpus / (tp * pp), tp, pp);
        l.global_batch = 2 * gpus;
        l.recompute = Recompute::Full;
        l.sequence_parallel = true;
        let t0 = Instant::now();
        let _ = simulate_step(&model, gpu, &l).map_err(anyhow::Error::msg)?;
        timings.push((gpus, l.micro_batches(), t0.elapsed().as_secs_f64()));
    }
    if json {
        let v: Vec<_> = rows
            .iter()
            .map(|(r, p, e)| {
                json!({"model": r.name, "gpus": r.layout.gpus(), "tp": r.layout.tp, "pp": r.layout.pp,
                "interleave": r.layout.interleave, "micro_batch": r.layout.micro_batch,
                "published_tflops": r.tflops_per_gpu, "predicted_tflops": p.megatron_tflops_per_gpu, "error": e})
            })
            .collect();
        let t: Vec<_> = timings.iter().map(|(g, m, s)| json!({"gpus": g, "micro_batches": m, "seconds": s})).collect();
        let gpt3: Vec<_> = validate::predicted(gpu, validate::gpt3_175b_on_1024())
            .map_err(anyhow::Error::msg)?
            .iter()
            .map(|(r, p, e)| {
                json!({"pp": r.layout.pp, "interleave": r.layout.interleave, "published_tflops": r.tflops_per_gpu,
                "predicted_tflops": p.megatron_tflops_per_gpu, "error": e})
            })
            .collect();
        let mut nccl = Vec::new();
        for b in validate::nccl_bus_bandwidth() {
            let g = shardlab::sim::profile(b.gpu).map_err(anyhow::Error::msg)?;
            let p = validate::simulated_bus_bandwidth(&g, 4.0 * (1u64 << 30) as f64);
            nccl.push(json!({"gpu": b.gpu, "ring": b.ring, "published_gb_s": b.bus_gb_s, "predicted_gb_s": p,
                             "error": p / b.bus_gb_s - 1.0, "source": b.source}));
        }
        println!(
            "{}",
            json!({"megatron_table_1": v, "gpt3_175b_on_1024": gpt3, "nccl_bus_bandwidth": nccl, "simulator_seconds": t})
        );
        return Ok(());
    }
    print!("{}", validate::report(gpu).map_err(anyhow::Error::msg)?);
    for (g, m, s) in timings {
        println!("simulating GPT-175B on {g:>6} GPUs ({m} micro-batches a replica): {:.1} ms", s * 1e3);
    }
    Ok(())
}
