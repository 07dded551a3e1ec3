//! The engine: every layout `train` accepts trains like one process. Each layout below runs the
//! same job (the tiny GPT, 10 clipped AdamW steps on a warm-up + cosine schedule, a global batch
//! of 8 rows) through `GptJob::fit`, as `train` does, on 4 ranks; one process (`--strategy single`,
//! one worker, the 8 rows at once) is the reference. Expected: every step's loss and global
//! gradient norm within 1e-5 relative (f32 sums grouped differently: split matmuls, sharded reductions, micro-batches), and
//! the weights each run saves after the last step within 1e-4 (Adam divides by √v, which magnifies
//! rounding where a gradient is near zero).
//!
//! The layouts put ZeRO on the data dimension of tensor- and pipeline-parallel pieces (torchtitan's
//! FSDP + TP), which the data-parallel strategies alone cannot: zero3 × tp 2, zero2 × tp 2,
//! zero1 × pp 2, zero3 × pp 2, DDP × tp 2 with sequence parallelism, zero2 × pp 2 in GPipe with
//! activation checkpointing (each pipeline rank recomputes its stages in backward), three replicas
//! (dp 3: three-way sums), and 3-D parallelism: dp 2 × tp 2 × pp 2 on 8 ranks with DDP and with
//! ZeRO-2, and tp 2 with sequence parallelism × pp 2; activation checkpointing of tensor-parallel
//! blocks (zero1 × tp 2, all of them; zero3 × tp 2 × pp 2, every other one); and gradient
//! accumulation over 2 micro-batches (zero3 × tp 2, dp 2 × tp 2 × pp 2).

use shardlab::data::{synthetic_corpus, DistributedSampler, Tokens};
use shardlab::job::{DataSource, GptJob, RunSummary};
use shardlab::pipeline::{PipelineConfig, Schedule};
use shardlab::prelude::*;
use std::path::{Path, PathBuf};

const STEPS: u64 = 10;

/// The synthetic corpus's ids spread over the vocabulary of 64 (id·5 + 1), so that every
/// tensor-parallel rank's slice of the embedding and the head is used.
fn corpus(dir: &Path) -> PathBuf {
    let file = dir.join("tokens.bin");
    Tokens(synthetic_corpus(4000, 3).0.iter().map(|t| t * 5 + 1).collect()).write(&file).unwrap();
    file
}

fn job(dir: &Path, batch_size: usize, save: &str) -> GptJob {
    GptJob {
        model: GptConfig::tiny(),
        batch_size,
        accum: 1,
        steps: STEPS,
        warmup: 0,
        optim: AdamWConfig { lr: 3e-3, ..AdamWConfig::default() },
        lr_schedule: Some(LrSchedule { max_lr: 3e-3, min_lr: 3e-4, warmup_iters: 2, decay_iters: STEPS }),
        grad_clip: Some(1.0),
        data: DataSource::File(dir.join("tokens.bin")),
        seed: 1,
        init: None,
        save: Some(dir.join(save)),
        checkpoint: Default::default(),
        eval: Default::default(),
    }
}

fn weights(path: &Path) -> Vec<(String, Tensor)> {
    let mut w: Vec<(String, Tensor)> = Tensor::read_safetensors(path).unwrap();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

fn check(name: &str, got: &RunSummary, want: &RunSummary, dir: &Path, file: &str, reference: &str) {
    assert_eq!(got.losses.len(), want.losses.len(), "{name}: steps");
    for (s, (a, b)) in got.losses.iter().zip(&want.losses).enumerate() {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{name} step {s}: loss {a}, one process {b}");
    }
    // The global norm before clipping: every gradient element counted once, averaged over the
    // replicas (AdamW and clipping would hide a gradient off by a constant factor).
    assert_eq!(got.grad_norms.len(), want.grad_norms.len(), "{name}: norms");
    for (s, (a, b)) in got.grad_norms.iter().zip(&want.grad_norms).enumerate() {
        let (a, b) = (a.expect("a finite norm"), b.expect("a finite norm"));
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{name} step {s}: gradient norm {a}, one process {b}");
    }
    let (ours, theirs) = (weights(&dir.join(file)), weights(&dir.join(reference)));
    assert_eq!(ours.len(), theirs.len(), "{name}: the saved tensors");
    for ((n, a), (m, b)) in ours.iter().zip(&theirs) {
        assert_eq!(n, m, "{name}: the saved names");
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d < 1e-4, "{name}: {n} differs from one process's by {d} after {STEPS} steps");
    }
}

/// The memory planner (`engine::fit`, lesson 14) against what rank 0 — pipeline rank 0, tensor
/// rank 0 — holds, counted from its tensors (`RunSummary::memory`, which tests/held_memory.rs
/// checks against the allocator): equal but for ZeRO's padding (each of a piece's at most 3 units
/// padded to a multiple of dp: under dp − 1 elements of 16 bytes each). Splitting one of the tiny
/// GPT's replicated biases wrongly would be 16 bytes × 32 off.
fn planned_matches_held(name: &str, r: &RunSummary, tp: usize, pp: usize, strategy: Strategy) {
    use shardlab::engine::{fit, DataDim, ParallelDims};
    let data = match strategy {
        Strategy::Single | Strategy::Ddp => DataDim::Replicate,
        Strategy::Zero1 => DataDim::Zero(shardlab::zero::Stage::One),
        Strategy::Zero2 => DataDim::Zero(shardlab::zero::Stage::Two),
        Strategy::Zero3 => DataDim::Zero(shardlab::zero::Stage::Three),
    };
    let dims = ParallelDims::new(r.world_size, tp, pp).unwrap();
    let planned = fit::rank_state_bytes(&GptConfig::tiny(), dims, data).unwrap()[0];
    let held = r.memory.model_states() as f64;
    let padding = 3.0 * 16.0 * (dims.dp - 1) as f64;
    assert!(
        held >= planned && held - planned <= padding,
        "{name}: rank 0 holds {held} bytes of model state, the planner says {planned} (padding at most {padding})"
    );
}

#[test]
fn every_layout_trains_like_one_process() {
    let dir = std::env::temp_dir().join(format!("shardlab-engine-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    corpus(&dir);
    // One process on the global batch of 4, 6 and 8 ranks × 2 rows.
    let single = ScalingConfig { num_workers: 1, strategy: Strategy::Single, ..ScalingConfig::default() };
    let one8 = job(&dir, 8, "one8.safetensors").fit(single.clone(), false, false).unwrap();
    let one12 = job(&dir, 12, "one12.safetensors").fit(single.clone(), false, false).unwrap();
    let one16 = job(&dir, 16, "one16.safetensors").fit(single, false, false).unwrap();
    planned_matches_held("single", &one8, 1, 1, Strategy::Single);
    let pp2 = PipelineConfig { stages: 2, micro_batches: 2, schedule: Schedule::OneFOneB };
    let gpipe = PipelineConfig { stages: 2, micro_batches: 4, schedule: Schedule::GPipe };
    let (none, full) = (Checkpointing::None, Checkpointing::Full);
    // Three replicas: three-way sums, whose order matters to the last bit — the copies of a
    // replicated tensor (every tensor rank's LayerNorms, the first and last stage's tied wte) must
    // still stay bitwise equal (the saves check it).
    let pp3 = PipelineConfig { stages: 2, micro_batches: 4, schedule: Schedule::OneFOneB };
    let layouts: [(&str, Strategy, usize, PipelineConfig, bool, Checkpointing, usize); 13] = [
        ("zero3:dp2×tp2", Strategy::Zero3, 2, PipelineConfig::default(), false, none, 4),
        ("zero2:dp2×tp2", Strategy::Zero2, 2, PipelineConfig::default(), false, none, 4),
        ("ddp2×tp2+sp", Strategy::Ddp, 2, PipelineConfig::default(), true, none, 4),
        ("zero1:dp2×pp2", Strategy::Zero1, 1, pp2, false, none, 4),
        ("zero3:dp2×pp2", Strategy::Zero3, 1, pp2, false, none, 4),
        ("zero2:dp2×pp2", Strategy::Zero2, 1, gpipe, false, full, 4),
        ("zero2:dp3×tp2", Strategy::Zero2, 2, PipelineConfig::default(), false, none, 6),
        ("zero1:dp3×pp2", Strategy::Zero1, 1, pp3, false, none, 6),
        // 3-D: each pipeline rank's stages split over its tensor-parallel pair.
        ("ddp2×tp2×pp2", Strategy::Ddp, 2, pp2, false, none, 8),
        ("zero2:dp2×tp2×pp2", Strategy::Zero2, 2, pp2, false, none, 8),
        ("tp2+sp×pp2", Strategy::Ddp, 2, PipelineConfig { micro_batches: 4, ..gpipe }, true, none, 4),
        // Activation checkpointing of tensor-parallel blocks: every block, and every other one
        // inside 3-D.
        ("zero1:dp2×tp2", Strategy::Zero1, 2, PipelineConfig::default(), false, full, 4),
        ("zero3:dp2×tp2×pp2", Strategy::Zero3, 2, pp2, false, Checkpointing::Every(2), 8),
    ];
    let mut held = Vec::new();
    for (name, strategy, tp, pipeline, sequence_parallel, activation_checkpointing, n) in layouts {
        let s = ScalingConfig {
            num_workers: n,
            strategy,
            tensor_parallel: tp,
            sequence_parallel,
            pipeline,
            activation_checkpointing,
            ..ScalingConfig::default()
        };
        let file = format!("{}.safetensors", name.replace([':', '×', '+'], "-"));
        let r = job(&dir, 2, &file).fit(s, false, false).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert_eq!(r.strategy, name);
        let (one, reference) = match n {
            4 => (&one8, "one8.safetensors"),
            6 => (&one12, "one12.safetensors"),
            _ => (&one16, "one16.safetensors"),
        };
        check(name, &r, one, &dir, &file, reference);
        assert!(r.bytes_sent_per_step > 0.0, "{name}: the mesh's bytes are counted");
        planned_matches_held(name, &r, tp, pipeline.stages, strategy);
        held.push((name, r.memory));
    }
    // Gradient accumulation: each replica's rows in 2 micro-batches run one after the other
    // (under pp each a pipelined step of its own), their gradients weighted by their share.
    for (name, strategy, tp, pipeline, n) in [
        ("zero3:dp2×tp2", Strategy::Zero3, 2, PipelineConfig::default(), 4),
        ("ddp2×tp2×pp2", Strategy::Ddp, 2, pp2, 8),
    ] {
        let s = ScalingConfig { num_workers: n, strategy, tensor_parallel: tp, pipeline, ..ScalingConfig::default() };
        let file = format!("accum-{}.safetensors", name.replace([':', '×', '+'], "-"));
        let r = GptJob { accum: 2, ..job(&dir, 2, &file) }
            .fit(s, false, false)
            .unwrap_or_else(|e| panic!("{name} accum 2: {e:#}"));
        let (one, reference) = if n == 4 { (&one8, "one8.safetensors") } else { (&one16, "one16.safetensors") };
        check(&format!("{name}, accum 2"), &r, one, &dir, &file, reference);
    }
    // Between steps ZeRO-3 holds its ⅟2 shard of the piece, ZeRO-2 the piece whole and its master
    // shard (a view of it): less parameter memory for ZeRO-3 (rank 0's tensors, measured).
    let (z3, z2) = (&held[0].1, &held[1].1);
    assert!(z3.params < z2.params, "zero3 × tp 2 holds {} parameter bytes, zero2 × tp 2 {}", z3.params, z2.params);
    assert!(z3.optim == z2.optim && z3.optim > 0, "both shard AdamW's state: {} and {}", z3.optim, z2.optim);
    // During a step ZeRO-3 gathers the piece and its backward gives every gradient at once: the
    // step's transient peak is above what it keeps (the piece's parameters and gradients, from
    // the tensors); ZeRO-2's holds the gradients and their flat copy.
    assert!(z3.peak_transient > 2 * z3.params, "zero3 × tp 2: peak {} vs {} held", z3.peak_transient, z3.params);
    assert!(
        z2.peak_transient > z2.grads,
        "zero2 × tp 2: peak {} vs {} gradient bytes held",
        z2.peak_transient,
        z2.grads
    );
    // Refused on every rank, with the reason: what is not built.
    let refused = |tp: usize, pipeline: PipelineConfig, activation_checkpointing| {
        let s = ScalingConfig {
            num_workers: 4,
            tensor_parallel: tp,
            pipeline,
            activation_checkpointing,
            ..Default::default()
        };
        format!("{:#}", job(&dir, 2, "no.safetensors").fit(s, false, false).err().expect("refused"))
    };
    let e = refused(1, pp2, Checkpointing::Every(2));
    assert!(e.contains("a pipeline rank recomputes its stages whole"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// 3-D against tensor parallelism alone, gradient by gradient: a tensor-parallel GPT's stages
/// pipelined over 4 ranks (embeddings, block, block, head: a rank of each kind, and the tied wte
/// exchanged between ranks that are not neighbours) give each tensor rank the gradients of the
/// whole tensor-parallel model on the same batch (2e-5), and its loss (1e-5 relative) — in 1F1B's
/// steady state (8 micro-batches of 1 row), in GPipe, with sequence parallelism, and with every
/// block recomputed. The batch's first row has ignored (−1) targets, so micro-batches weigh
/// differently (by their targets).
#[test]
fn tensor_parallel_stages_pipelined_give_the_tensor_parallel_gradients() {
    use shardlab::comm::DeviceMesh;
    use shardlab::engine::TpStages;
    use shardlab::pipeline::{partition, run_pipeline};
    use shardlab::tp::TpGpt;
    let cfg = GptConfig::tiny();
    let tokens = Tokens(synthetic_corpus(4000, 3).0.iter().map(|t| t * 5 + 1).collect());
    let batch = || {
        let b = DistributedSampler::new(16, 8, 0, 1, 5).unwrap().batch(&tokens, 0);
        let _ = b.y.narrow(0, 0, 1).narrow(1, 0, 11).fill_(-1);
        b
    };
    for (kind, m, sp, recompute) in
        [(Schedule::OneFOneB, 8, false, false), (Schedule::GPipe, 4, true, false), (Schedule::OneFOneB, 4, true, true)]
    {
        let out = spawn(8, Backend::Local, |pg| {
            let mesh = DeviceMesh::new(pg, &[4, 2], &["pp", "tp"])?;
            let (pp, tp) = (mesh.group("pp"), mesh.group("tp"));
            let gpt = Gpt::new(cfg, 3)?;
            let mut whole = TpGpt::from_gpt(&gpt, tp).map_err(anyhow::Error::msg)?.with_sequence_parallel(sp);
            let want = whole.forward_backward(tp, &batch())?;
            let stages = partition(4, 4).map_err(anyhow::Error::msg)?[pp.rank()].clone();
            let mut mine = TpGpt::from_gpt_stages(&gpt, tp, stages)
                .map_err(anyhow::Error::msg)?
                .with_sequence_parallel(sp)
                .recompute_blocks(|_| recompute);
            let uses = Gpt::stage_uses_of(&cfg);
            let st = run_pipeline(pp, &mut TpStages { m: &mut mine, tp }, &uses, kind, &batch(), m)?;
            let diffs: Vec<(usize, f64)> =
                st.grads.iter().map(|(&k, g)| (k, (g - &want.grads[k]).abs().max().double_value(&[]))).collect();
            Ok((st.loss, want.loss, diffs))
        })
        .unwrap();
        let what = format!("{kind:?}, {m} micro-batches, sp {sp}, recompute {recompute}");
        for (r, (got, want, diffs)) in out.into_iter().enumerate() {
            assert!((got - want).abs() <= 1e-5 * want.abs(), "{what}, rank {r}: loss {got}, tensor parallel {want}");
            assert!(!diffs.is_empty(), "{what}, rank {r}: no gradients");
            for (k, d) in diffs {
                assert!(
                    d < 2e-5,
                    "{what}, rank {r}: parameter {k}'s gradient differs from tensor parallelism's by {d}"
                );
            }
        }
    }
}

/// bf16 on top of the layouts: the matrix multiplies in bf16 as `torch.autocast` computes them
/// (fp32 parameters, gradients, AdamW state and residual stream), against one process computing
/// the same way (`--strategy single --precision bf16`). The pieces round at other places (a
/// row-parallel layer's partial products are rounded before their sum, the one process's after;
/// other micro-batches), so the bound is looser than fp32's: every step's loss within 1e-3
/// relative (measured: at most 6.3e-5), the weights after 10 steps within 2e-2 in relative L2
/// norm (measured: at most 3.3e-3; AdamW moves a weight whose gradient is near zero by up to the
/// learning rate either way). And each layout really computes in bf16: its losses differ from the
/// same layout's in fp32.
#[test]
fn bf16_layouts_train_like_one_process_in_bf16() {
    let dir = std::env::temp_dir().join(format!("shardlab-engine-bf16-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    corpus(&dir);
    let single = ScalingConfig {
        num_workers: 1,
        strategy: Strategy::Single,
        precision: Precision::Bf16,
        ..ScalingConfig::default()
    };
    let one8 = job(&dir, 8, "one8.safetensors").fit(single.clone(), false, false).unwrap();
    let one16 = job(&dir, 16, "one16.safetensors").fit(single, false, false).unwrap();
    let pp2 = PipelineConfig { stages: 2, micro_batches: 2, schedule: Schedule::OneFOneB };
    let worst = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| ((x - y) / y).abs()).fold(0f64, f64::max);
    // ‖a − b‖ / ‖b‖ over all the weights.
    let w_rel = |a: &str, b: &str| {
        let (x, y) = (weights(&dir.join(a)), weights(&dir.join(b)));
        let sq = |f: &dyn Fn(&Tensor, &Tensor) -> Tensor| -> f64 {
            x.iter().zip(&y).map(|((_, p), (_, q))| f(p, q).square().sum(Kind::Double).double_value(&[])).sum()
        };
        (sq(&|p, q| p - q) / sq(&|_, q| q.shallow_clone())).sqrt()
    };
    for (name, strategy, tp, pipeline, sp, ac, n) in [
        ("zero3:dp2×tp2", Strategy::Zero3, 2, PipelineConfig::default(), false, Checkpointing::None, 4),
        ("ddp2×tp2+sp", Strategy::Ddp, 2, PipelineConfig::default(), true, Checkpointing::Full, 4),
        ("zero1:dp2×pp2", Strategy::Zero1, 1, pp2, false, Checkpointing::Full, 4),
        ("zero2:dp2×tp2×pp2", Strategy::Zero2, 2, pp2, false, Checkpointing::Every(2), 8),
    ] {
        let run = |precision: Precision| {
            let s = ScalingConfig {
                num_workers: n,
                strategy,
                tensor_parallel: tp,
                sequence_parallel: sp,
                pipeline,
                activation_checkpointing: ac,
                precision,
                ..ScalingConfig::default()
            };
            let file = format!("{precision:?}-{}.safetensors", name.replace([':', '×', '+'], "-"));
            let r = job(&dir, 2, &file).fit(s, false, false).unwrap_or_else(|e| panic!("{name} {precision:?}: {e:#}"));
            (r, file)
        };
        let ((r, file), (r32, _)) = (run(Precision::Bf16), run(Precision::Fp32));
        let (one, reference) = if n == 4 { (&one8, "one8.safetensors") } else { (&one16, "one16.safetensors") };
        let (l, w) = (worst(&r.losses, &one.losses), w_rel(&file, reference));
        println!("{name} bf16: losses within {l:.1e} relative of one process in bf16, weights {w:.1e} (relative L2)");
        assert!(l < 1e-3 && w < 2e-2, "{name} bf16: losses {l:.2e} relative, weights {w:.2e} from one process");
        let d = worst(&r.losses, &r32.losses);
        assert!(d > 1e-6, "{name}: bf16 and fp32 give the same losses (within {d:.1e}): is bf16 computed?");
        assert!(r.precision == Precision::Bf16 && r.strategy == name, "{name}: {:?} {}", r.precision, r.strategy);
    }
    // fp16 is refused with the reason, on every rank.
    let s =
        ScalingConfig { num_workers: 2, tensor_parallel: 2, precision: Precision::Fp16, ..ScalingConfig::default() };
    let e = format!("{:#}", job(&dir, 2, "no.safetensors").fit(s, false, false).err().expect("refused"));
    assert!(e.contains("fp16 needs a loss scaler"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
