//! Distributed checkpoints: saved by one strategy at one world size, loaded by any strategy at any
//! world size with the same parameters and AdamW state (bitwise), training continues as if never
//! stopped; a save that fails on one rank leaves the previous checkpoint intact; damaged
//! checkpoints are refused with errors that name the file.

use shardlab::checkpoint::{self, sim, SaveOptions};
use shardlab::data::{synthetic_corpus, DistributedSampler, Tokens};
use shardlab::ddp::{self, DataParallel};
use shardlab::engine::{parallelize, DataDim, Engine, ParallelDims, Plan};
use shardlab::model::{Gpt, GptConfig};
use shardlab::prelude::*;
use shardlab::zero::{Stage, Zero};
use std::path::{Path, PathBuf};

const GLOBAL: usize = 12;

#[derive(Clone, Copy, Debug, PartialEq)]
enum S {
    Ddp,
    Zero(Stage),
}

fn wrap<'a>(pg: &'a ProcessGroup, s: S, seed: u64, p: Precision) -> anyhow::Result<Box<dyn DataParallel + 'a>> {
    let m = Gpt::new(GptConfig::tiny(), seed)?.with_precision(p);
    Ok(match s {
        S::Ddp => ddp::wrap(pg, Box::new(m), ddp::Variant::Bucketed, ddp::DEFAULT_BUCKET_CAP_BYTES)?,
        S::Zero(st) => Box::new(Zero::new(pg, Box::new(m), st)?),
    })
}

fn opt() -> AdamW {
    AdamW::new(AdamWConfig { lr: 3e-3, eps: 1e-6, ..AdamWConfig::default() })
}

fn flat(ps: &[Tensor]) -> Vec<f32> {
    let all = Tensor::cat(&ps.iter().map(|p| p.detach().reshape([-1])).collect::<Vec<_>>(), 0);
    Vec::<f32>::try_from(&all).unwrap()
}

fn steps(dp: &mut dyn DataParallel, o: &mut AdamW, from: u64, to: u64) -> anyhow::Result<()> {
    let (r, n) = (dp.group().rank(), dp.group().world_size());
    let s = DistributedSampler::new(16, GLOBAL, r, n, 3)?;
    for step in from..to {
        ddp::train_step(dp, o, &s.batch(&synthetic_corpus(4000, 7), step), 1, StepConfig::lr(3e-3))?;
    }
    Ok(())
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shardlab-ckpt-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Train DDP on 2 ranks for 2 steps, save, train 2 more: (params at the save, final params).
fn reference(dir: &Path) -> (Vec<f32>, Vec<f32>) {
    let dir = dir.to_path_buf();
    spawn(2, Backend::Local, move |pg| {
        let mut dp = wrap(pg, S::Ddp, 5, Precision::Fp32)?;
        let mut o = opt();
        steps(&mut *dp, &mut o, 0, 2)?;
        checkpoint::save(&*dp, &o, &dir, 2, json!({"note": "test"}), &SaveOptions::default())?;
        let at_save = flat(&dp.full_parameters()?);
        steps(&mut *dp, &mut o, 2, 4)?;
        Ok((at_save, flat(&dp.full_parameters()?)))
    })
    .unwrap()
    .remove(0)
}

#[test]
fn a_checkpoint_loads_into_any_strategy_and_world_size_and_training_continues() {
    let dir = tmpdir("reshard");
    let (at_save, uninterrupted) = reference(&dir);
    let total_bytes: u64 = std::fs::read_dir(dir.join("step-00000002"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    for (s, m) in [
        (S::Ddp, 2),
        (S::Ddp, 1),
        (S::Zero(Stage::One), 3),
        (S::Zero(Stage::Two), 4),
        (S::Zero(Stage::Three), 3),
        (S::Zero(Stage::Three), 4),
    ] {
        let (d, again) = (dir.clone(), dir.join("again"));
        let out = spawn(m, Backend::Local, move |pg| {
            let mut dp = wrap(pg, s, 99, Precision::Fp32)?; // other weights: the load must replace them all
            let mut o = opt();
            let r = checkpoint::load(&mut *dp, &mut o, &d)?;
            let loaded = flat(&dp.full_parameters()?);
            if (s, m) == (S::Zero(Stage::Three), 3) {
                // Saved again from ZeRO-3's padded shards: checked below by loading it into DDP.
                checkpoint::save(&*dp, &o, &again, r.step, r.extra.clone(), &SaveOptions::default())?;
            }
            steps(&mut *dp, &mut o, r.step, 4)?;
            Ok((r.step, r.bytes, r.extra, loaded, flat(&dp.full_parameters()?)))
        })
        .unwrap();
        for (rank, (step, bytes, extra, loaded, fin)) in out.iter().enumerate() {
            assert_eq!(*step, 2);
            assert_eq!(extra["note"], "test", "the job's state comes back");
            assert!(
                loaded == &at_save,
                "{s:?} at {m} ranks, rank {rank}: the loaded parameters differ from the saved ones"
            );
            let worst = fin.iter().zip(&uninterrupted).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            if (s, m) == (S::Ddp, 2) {
                assert_eq!(worst, 0.0, "same strategy and world size: resuming is bitwise the uninterrupted run");
            } else {
                // Other reduction orders: AdamW amplifies rounding in near-zero gradients (eps 1e-6).
                assert!(
                    worst < 1e-4,
                    "{s:?} at {m} ranks, rank {rank}: 2 steps after loading, {worst} from the uninterrupted run"
                );
            }
            if matches!(s, S::Zero(Stage::Three)) {
                assert!(
                    (*bytes as f64) < 1.6 * total_bytes as f64 / m as f64,
                    "{s:?} at {m} ranks, rank {rank}: read {bytes} bytes of {total_bytes}: only its shard's ranges should be read"
                );
            }
        }
    }
    // The ZeRO-3 × 3 save of the loaded state, back into DDP × 2: the same parameters, and (AdamW's
    // moments and step counts restored too) bitwise the uninterrupted run after 2 more steps.
    let again = dir.join("again");
    let out = spawn(2, Backend::Local, move |pg| {
        let mut dp = wrap(pg, S::Ddp, 98, Precision::Fp32)?;
        let mut o = opt();
        let r = checkpoint::load(&mut *dp, &mut o, &again)?;
        let loaded = flat(&dp.full_parameters()?);
        steps(&mut *dp, &mut o, r.step, 4)?;
        Ok((loaded, flat(&dp.full_parameters()?)))
    })
    .unwrap();
    assert!(out[0].0 == at_save, "saved by ZeRO-3 on 3 ranks, loaded by DDP on 2: the same parameters");
    let worst = out[0].1.iter().zip(&uninterrupted).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst < 1e-4, "and AdamW's state with them: 2 steps later {worst} from the uninterrupted run");
    // bf16 ZeRO-1: the loaded f32 master shards reach the bf16 working copy every rank computes with.
    let d = dir.clone();
    let working = spawn(2, Backend::Local, move |pg| {
        let mut dp = wrap(pg, S::Zero(Stage::One), 99, Precision::Bf16)?;
        checkpoint::load(&mut *dp, &mut opt(), &d)?;
        Ok(flat(&dp.model().parameters().iter().map(|p| p.to_kind(Kind::Float)).collect::<Vec<_>>()))
    })
    .unwrap();
    let rounded: Vec<f32> =
        Vec::<f32>::try_from(&Tensor::from_slice(&at_save).to_kind(Kind::BFloat16).to_kind(Kind::Float)).unwrap();
    assert!(working.iter().all(|w| w == &rounded), "bf16 ZeRO-1's working parameters are the loaded masters in bf16");
    // Consolidated into one file with nanoGPT's names, f32 and bf16, one tensor at a time.
    let out = dir.join("model.safetensors");
    let c = checkpoint::consolidate(&dir, &out, false).unwrap();
    assert_eq!(c.tensors, 29, "the 28 parameters and lm_head.weight");
    assert_eq!(c.largest_tensor_numel, 128 * 32, "the MLP matrices are the tiny GPT's largest");
    let m = Gpt::new(GptConfig::tiny(), 99).unwrap();
    m.load_safetensors(&out).unwrap();
    assert!(flat(&m.parameters()) == at_save, "the consolidated file holds the saved parameters");
    checkpoint::consolidate(&dir, &out, true).unwrap();
    let b = Tensor::read_safetensors(&out).unwrap();
    assert!(b.iter().all(|(_, t)| t.kind() == Kind::BFloat16));
    m.load_safetensors(&out).unwrap();
    assert!(flat(&m.parameters()) == rounded, "--bf16: the saved parameters rounded to bf16");
    // Into bf16 masters and out: the fp32 masters load into a bf16 ZeRO-3 (its shards are f32).
    let d = dir.clone();
    let loaded = spawn(2, Backend::Local, move |pg| {
        let mut dp = wrap(pg, S::Zero(Stage::Three), 99, Precision::Bf16)?;
        checkpoint::load(&mut *dp, &mut opt(), &d)?;
        Ok(flat(&dp.full_parameters()?))
    })
    .unwrap();
    assert!(loaded[0] == at_save, "bf16 ZeRO-3 loads the fp32 masters exactly");
    // A flipped byte in a piece: consolidate streams the piece out before its checksum is known,
    // so it must fail and leave neither the output nor its temporary file.
    let ck = checkpoint::resolve(&dir).unwrap();
    let rank0 = ck.join("rank-00000.safetensors");
    let mut bytes = std::fs::read(&rank0).unwrap();
    // The first element of a parameter's piece (consolidate reads parameters, not AdamW's moments).
    let head_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let head: shardlab::serde_json::Value = shardlab::serde_json::from_slice(&bytes[8..8 + head_len]).unwrap();
    let (key, entry) =
        head.as_object().unwrap().iter().find(|(k, _)| k.starts_with("param")).expect("a parameter piece");
    let at = 8 + head_len + entry["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[at] ^= 0x10;
    eprintln!("flipped a bit of {key}");
    std::fs::write(&rank0, &bytes).unwrap();
    let bad = dir.join("bad.safetensors");
    let e = checkpoint::consolidate(&dir, &bad, false).unwrap_err().to_string();
    assert!(e.contains("checksum") && e.contains("rank-00000.safetensors"), "{e}");
    assert!(!bad.exists() && !dir.join("bad.safetensors.tmp").exists(), "a failed consolidate leaves no file behind");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_failed_save_leaves_the_previous_checkpoint_intact() {
    let dir = tmpdir("atomic");
    let d = dir.clone();
    let errors = spawn(2, Backend::Local, move |pg| {
        let mut dp = wrap(pg, S::Zero(Stage::Two), 5, Precision::Fp32)?;
        let mut o = opt();
        steps(&mut *dp, &mut o, 0, 1)?;
        checkpoint::save(&*dp, &o, &d, 1, json!({}), &SaveOptions::default())?;
        steps(&mut *dp, &mut o, 1, 2)?;
        // Rank 1's disk fills up 1000 bytes into its file.
        let fail = (pg.rank() == 1).then_some(1000);
        let e =
            checkpoint::save(&*dp, &o, &d, 2, json!({}), &SaveOptions { fail_after_bytes: fail, ..Default::default() });
        Ok(e.err().map(|e| format!("{e:#}")))
    })
    .unwrap();
    for (rank, e) in errors.iter().enumerate() {
        let e = e.as_ref().unwrap_or_else(|| panic!("rank {rank}: the failed save must be an error on every rank"));
        assert!(e.contains("rank 1"), "rank {rank}: the error names the failing rank: {e}");
    }
    assert!(errors[1].as_ref().unwrap().contains("no space left"), "{:?}", errors[1]);
    assert_eq!(std::fs::read_to_string(dir.join("latest")).unwrap(), "step-00000001", "latest still names step 1");
    assert!(dir.join("step-00000002.tmp").is_dir() && !dir.join("step-00000002").exists());
    assert_eq!(checkpoint::resolve(&dir).unwrap(), dir.join("step-00000001"));
    // The next save removes the unfinished one and keeps only the last 1 with keep_last.
    let d = dir.clone();
    spawn(2, Backend::Local, move |pg| {
        let dp = wrap(pg, S::Zero(Stage::Two), 5, Precision::Fp32)?;
        checkpoint::save(&*dp, &opt(), &d, 3, json!({}), &SaveOptions { keep_last: Some(1), ..Default::default() })?;
        Ok(())
    })
    .unwrap();
    let names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    assert!(!names.iter().any(|n| n.ends_with(".tmp")), "{names:?}");
    assert_eq!(checkpoint::committed(&dir).len(), 1, "keep_last 1: {names:?}");
    // Another timeline's later step in the folder, and a crashed save that got as far as its
    // metadata: keep_last never removes the new checkpoint (nor that later step), `latest` names
    // the new one, and the unfinished folder is never loaded.
    let copy_dir = |from: &Path, to: &Path| {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap().flatten() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    };
    copy_dir(&dir.join("step-00000003"), &dir.join("step-00000200"));
    copy_dir(&dir.join("step-00000003"), &dir.join("step-00000300.tmp"));
    std::fs::write(dir.join("latest"), "step-00000003").unwrap();
    assert_eq!(checkpoint::resolve(&dir).unwrap(), dir.join("step-00000003"), "latest, not a .tmp");
    let d = dir.clone();
    spawn(2, Backend::Local, move |pg| {
        let dp = wrap(pg, S::Zero(Stage::Two), 5, Precision::Fp32)?;
        checkpoint::save(&*dp, &opt(), &d, 4, json!({}), &SaveOptions { keep_last: Some(1), ..Default::default() })?;
        Ok(())
    })
    .unwrap();
    let steps: Vec<u64> = checkpoint::committed(&dir).into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, vec![4, 200], "keep_last 1 removed step 3 only");
    assert_eq!(checkpoint::resolve(&dir).unwrap(), dir.join("step-00000004"));
    assert!(!dir.join("step-00000300.tmp").exists(), "the next save removes unfinished folders");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Load `dir` into `s` on `n` ranks (the tiny GPT): each rank's error, if it refused.
fn load_errors(dir: &Path, n: usize, s: S) -> Vec<Option<String>> {
    let d = dir.to_path_buf();
    spawn(n, Backend::Local, move |pg| {
        let mut dp = wrap(pg, s, 1, Precision::Fp32)?;
        Ok(checkpoint::load(&mut *dp, &mut opt(), &d).err().map(|e| format!("{e:#}")))
    })
    .unwrap()
}

/// Load `dir` on 2 ranks of ZeRO-3 (or of another model config): the error text of rank 0.
fn load_error(dir: &Path, cfg: GptConfig) -> String {
    let d = dir.to_path_buf();
    let out = spawn(2, Backend::Local, move |pg| {
        let mut dp: Box<dyn DataParallel> = Box::new(Zero::new(pg, Box::new(Gpt::new(cfg, 1)?), Stage::Three)?);
        Ok(checkpoint::load(&mut *dp, &mut opt(), &d).err().map(|e| format!("{e:#}")))
    })
    .unwrap();
    assert!(out.iter().all(|e| e.is_some()), "every rank must refuse: {out:?}");
    out[0].clone().unwrap()
}

#[test]
fn damaged_checkpoints_are_refused_with_errors_that_name_the_file() {
    let dir = tmpdir("damaged");
    reference(&dir);
    let ck = dir.join("step-00000002");
    let copy = |tag: &str| {
        let d = tmpdir(tag);
        std::fs::create_dir_all(&d).unwrap();
        for e in std::fs::read_dir(&ck).unwrap().flatten() {
            std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
        }
        d
    };
    let tiny = GptConfig::tiny();
    // Truncated rank file.
    let d = copy("trunc");
    let f = d.join("rank-00001.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(len - 100).unwrap();
    let e = load_error(&d, tiny);
    assert!(e.contains("rank-00001.safetensors") && e.contains("truncated"), "{e}");
    // One flipped byte in the data (the last piece of rank 0's file).
    let d = copy("flip");
    let f = d.join("rank-00000.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let k = bytes.len() - 3;
    bytes[k] ^= 0x40;
    std::fs::write(&f, &bytes).unwrap();
    let flipped = d.clone();
    // DDP at 2 ranks reads every piece whole: the checksum of the damaged one fails.
    let out = load_errors(&flipped, 2, S::Ddp);
    let e = out[0].clone().expect("a flipped byte must be refused");
    assert!(e.contains("checksum") && e.contains("rank-00000.safetensors"), "{e}");
    // Part of a piece: a flipped byte in element 100 of rank 0's piece of wte (elements 0..1024),
    // loaded by DDP on 3 ranks — rank 0 reads elements 0..682 of it, not the whole piece: the
    // blocks it touches are checked (`files::tests`), and every rank refuses.
    let d = copy("partial");
    let f = d.join("rank-00000.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let head_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let head: shardlab::serde_json::Value = shardlab::serde_json::from_slice(&bytes[8..8 + head_len]).unwrap();
    let entry = &head["param/transformer.wte.weight/0"];
    assert_eq!(entry["shape"][0], 1024, "DDP rank 0's half of wte");
    bytes[8 + head_len + entry["data_offsets"][0].as_u64().unwrap() as usize + 4 * 100 + 1] ^= 0x40;
    std::fs::write(&f, &bytes).unwrap();
    let out = load_errors(&d, 3, S::Ddp);
    assert!(out.iter().all(|e| e.is_some()), "every rank refuses a partly read damaged piece: {out:?}");
    assert!(out[0].as_deref().is_some_and(|e| e.contains("do not match their checksum")), "{:?}", out[0]);
    // The first flip resharded into ZeRO-3 on 3 ranks: refused too.
    let out = load_errors(&flipped, 3, S::Zero(Stage::Three));
    assert!(out.iter().all(|e| e.is_some()), "every rank refuses: {out:?}");
    let named = out.iter().flatten().find(|e| e.contains("rank-00000.safetensors"));
    assert!(named.is_some_and(|e| e.contains("checksum")), "{out:?}");
    // A byte of a rank file's header changed (an offset's digit): refused before it is believed.
    let d = copy("header");
    let f = d.join("rank-00001.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let at = bytes.windows(16).position(|w| w == b"\"data_offsets\":[").expect("a header") + 16;
    bytes[at] = if bytes[at] == b'1' { b'2' } else { b'1' };
    std::fs::write(&f, &bytes).unwrap();
    let e = load_error(&d, tiny);
    assert!(e.contains("rank-00001.safetensors") && e.contains("header does not match"), "{e}");
    // Missing rank file.
    let d = copy("missing");
    std::fs::remove_file(d.join("rank-00001.safetensors")).unwrap();
    let e = load_error(&d, tiny);
    assert!(e.contains("rank-00001.safetensors"), "{e}");
    // Another model configuration: the mismatched parameters are listed.
    let e = load_error(&ck, GptConfig { n_embd: 48, n_head: 2, ..tiny });
    assert!(e.contains("does not fit this model") && e.contains("transformer.wte.weight"), "{e}");
    let e = load_error(&ck, GptConfig { n_layer: 3, ..tiny });
    assert!(e.contains("transformer.h.2.ln_1.weight is not in the checkpoint"), "{e}");
    // Unknown format version.
    let d = copy("version");
    let p = d.join("metadata.json");
    let text = std::fs::read_to_string(&p).unwrap().replacen("\"format_version\": 1", "\"format_version\": 7", 1);
    std::fs::write(&p, text).unwrap();
    let e = load_error(&d, tiny);
    assert!(e.contains("format version 7"), "{e}");
    // Not a checkpoint.
    let d = tmpdir("empty");
    std::fs::create_dir_all(d.join("step-00000005.tmp")).unwrap();
    let e = load_error(&d, tiny);
    assert!(e.contains("no committed checkpoint"), "{e}");
    for t in ["trunc", "flip", "partial", "header", "missing", "version", "empty", "damaged"] {
        let _ = std::fs::remove_dir_all(tmpdir(t));
    }
}

/// `train --resume`: 6 steps straight, and 3 steps + a checkpoint + 3 resumed steps, end with the
/// same losses and bitwise the same weights at the same world size; resumed on 4 ranks of ZeRO-3
/// instead of 2 of DDP (the same global batch), the same within float tolerance. fp16's loss scaler resumes too.
#[test]
fn resuming_a_job_continues_it_exactly() {
    use shardlab::job::{CheckpointConfig, DataSource, GptJob};
    let dir = tmpdir("resume");
    std::fs::create_dir_all(&dir).unwrap();
    let job = |steps: u64, save: &str, ck: CheckpointConfig| GptJob {
        model: GptConfig::tiny(),
        batch_size: 4,
        accum: 2,
        steps,
        warmup: 0,
        optim: AdamWConfig { lr: 3e-3, eps: 1e-6, ..AdamWConfig::default() },
        lr_schedule: Some(LrSchedule { max_lr: 3e-3, min_lr: 3e-4, warmup_iters: 2, decay_iters: 6 }),
        grad_clip: Some(1.0),
        data: DataSource::Synthetic { tokens: 4000, seed: 7 },
        seed: 1,
        init: None,
        save: Some(dir.join(save)),
        checkpoint: ck,
        eval: Default::default(),
    };
    let scaling = |n: usize, strategy: Strategy, precision: Precision| ScalingConfig {
        num_workers: n,
        strategy,
        precision,
        ..ScalingConfig::default()
    };
    let ck = dir.join("ck");
    for precision in [Precision::Fp32, Precision::Fp16] {
        let straight = job(6, "straight.safetensors", CheckpointConfig::default())
            .fit(scaling(2, Strategy::Ddp, precision), false, false)
            .unwrap();
        let _ = std::fs::remove_dir_all(&ck);
        let first = CheckpointConfig { dir: Some(ck.clone()), every: 3, ..Default::default() };
        // The first half runs 6 steps' schedule but stops after 3: a job that is killed after its save.
        let half = job(3, "half.safetensors", first).fit(scaling(2, Strategy::Ddp, precision), false, false).unwrap();
        assert!(ck.join("step-00000003").join("metadata.json").is_file());
        let resume = CheckpointConfig { resume: Some(ck.clone()), ..Default::default() };
        let rest = job(6, "resumed.safetensors", resume.clone())
            .fit(scaling(2, Strategy::Ddp, precision), false, false)
            .unwrap();
        let losses: Vec<f64> = half.losses.iter().chain(&rest.losses).copied().collect();
        assert_eq!(losses, straight.losses, "{precision:?}: the resumed run's losses are the straight run's");
        let a = std::fs::read(dir.join("straight.safetensors")).unwrap();
        assert!(
            a == std::fs::read(dir.join("resumed.safetensors")).unwrap(),
            "{precision:?}: bitwise the same weights"
        );
        if precision == Precision::Fp32 {
            // 4 ranks of 2 rows: the same global batch of 8 rows.
            let other = GptJob { batch_size: 2, ..job(6, "zero3.safetensors", resume) }
                .fit(scaling(4, Strategy::Zero3, precision), false, false)
                .unwrap();
            let worst = other.losses.iter().zip(&straight.losses[3..]).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
            assert!(worst < 1e-4, "resumed on 4 ranks of ZeRO-3: losses within {worst} of the straight run");
        }
    }
    // A checkpoint of another model is refused with the fields that differ.
    let mut other = job(6, "x.safetensors", CheckpointConfig { resume: Some(ck.clone()), ..Default::default() });
    other.seed = 2;
    let e = format!("{:#}", other.fit(scaling(2, Strategy::Ddp, Precision::Fp32), false, false).unwrap_err());
    assert!(e.contains("seed: 1 in the checkpoint, 2 here"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The synthetic corpus's ids spread over the vocabulary of 64 (id·5 + 1), so that every
/// tensor-parallel rank's slice of the embedding and the head is trained.
fn spread() -> Tokens {
    Tokens(synthetic_corpus(4000, 7).0.iter().map(|t| t * 5 + 1).collect())
}

/// One rank's engine over `pg`: the tiny GPT from `seed` laid out `tp` × `pp` (the rest data
/// parallel, `data` on it), 2 micro-batches per pipelined step.
fn engine(pg: &ProcessGroup, tp: usize, pp: usize, data: DataDim, seed: u64) -> anyhow::Result<Engine> {
    let cfg = GptConfig::tiny();
    let mut plan = Plan::new(ParallelDims::new(pg.world_size(), tp, pp).map_err(anyhow::Error::msg)?, data);
    plan.pipeline.micro_batches = 2;
    parallelize(pg, &plan, &cfg, &|keep| Gpt::new_only(cfg, seed, keep))
}

/// Steps `from..to` of an engine on the global batch of `GLOBAL` rows: the losses.
fn engine_steps(e: &mut Engine, o: &mut AdamW, from: u64, to: u64) -> anyhow::Result<Vec<f64>> {
    let s = DistributedSampler::new(16, GLOBAL, e.mesh().coord("dp"), e.dims.dp, 3)?;
    let data = spread();
    (from..to).map(|step| Ok(e.train_step(&s.batch(&data, step), o, 3e-3, None)?.loss)).collect()
}

/// Steps `from..to` of a data-parallel strategy on the same batches: the global losses.
fn whole_steps(dp: &mut dyn DataParallel, o: &mut AdamW, from: u64, to: u64) -> anyhow::Result<Vec<f64>> {
    let (r, n) = (dp.group().rank(), dp.group().world_size());
    let s = DistributedSampler::new(16, GLOBAL, r, n, 3)?;
    let data = spread();
    let mut losses = Vec::new();
    for step in from..to {
        let out = ddp::train_step(dp, o, &s.batch(&data, step), 1, StepConfig::lr(3e-3))?;
        let mut l = Tensor::from_slice(&[out.loss]);
        dp.group().all_reduce(&mut l, ReduceOp::Avg)?;
        losses.push(l.double_value(&[0]));
    }
    Ok(losses)
}

/// What a rank of a layout reports after loading: the whole parameters it loaded (on the ranks
/// that gather them), the losses of 2 more steps, the whole parameters after them.
type Loaded = (Option<Vec<f32>>, Vec<f64>, Option<Vec<f32>>);

/// Load `from` into layout `to` on `n` ranks (other initial weights: the load must replace them
/// all), save it again into `again` (when given), and train 2 more steps.
fn load_into(n: usize, to: To, from: &Path, again: Option<PathBuf>) -> Loaded {
    let from = from.to_path_buf();
    let out = spawn(n, Backend::Local, move |pg| {
        let mut o = opt();
        match to {
            To::Mesh(tp, pp, data) => {
                let mut e = engine(pg, tp, pp, data, 99)?;
                let r = checkpoint::load(&mut e, &mut o, &from)?;
                let loaded = e.full_parameters()?.map(|p| flat(&p));
                if let Some(again) = &again {
                    checkpoint::save(&e, &o, again, r.step, r.extra.clone(), &SaveOptions::default())?;
                }
                let losses = engine_steps(&mut e, &mut o, r.step, 4)?;
                Ok((loaded, losses, e.full_parameters()?.map(|p| flat(&p))))
            }
            To::Whole(s) => {
                let mut dp = wrap(pg, s, 99, Precision::Fp32)?;
                let r = checkpoint::load(&mut *dp, &mut o, &from)?;
                let loaded = Some(flat(&dp.full_parameters()?));
                if let Some(again) = &again {
                    checkpoint::save(&*dp, &o, again, r.step, r.extra.clone(), &SaveOptions::default())?;
                }
                let losses = whole_steps(&mut *dp, &mut o, r.step, 4)?;
                Ok((loaded, losses, Some(flat(&dp.full_parameters()?))))
            }
        }
    });
    out.unwrap_or_else(|e| panic!("{to:?} on {n} ranks: {e:#}")).remove(0)
}

#[derive(Clone, Copy, Debug)]
enum To {
    /// The engine: tp × pp, the data dimension's wrapper.
    Mesh(usize, usize, DataDim),
    /// A data-parallel strategy on the whole model.
    Whole(S),
}

/// Any layout's checkpoint loads into any other (DCP's promise): saved by 3-D parallelism
/// (dp 2 × tp 2 × pp 2: row- and column-parallel slices, c_attn's q, k and v rows, the tied wte on
/// two stages), loaded at zero3 × 4, tp 2 × pp 2, one process, ZeRO on tensor- and
/// pipeline-parallel pieces: the parameters each layout gathers after the load are bitwise the
/// saved ones; saved again by the loading layout, every tensor — parameters, AdamW's moments —
/// and every step count is bitwise the original's; 2 more steps continue the run (bitwise at the
/// same layout; within 1e-5 in loss and 1e-4 in weights elsewhere — other sums). And back: the
/// checkpoint ZeRO-3 wrote of the whole model loads into tensor-parallel boxes.
#[test]
fn a_checkpoint_of_any_layout_loads_into_any_other() {
    let dir = tmpdir("layouts");
    let a = dir.join("3d");
    let d = a.clone();
    let out = spawn(8, Backend::Local, move |pg| {
        let mut e = engine(pg, 2, 2, DataDim::Replicate, 5)?;
        let mut o = opt();
        let mut losses = engine_steps(&mut e, &mut o, 0, 2)?;
        checkpoint::save(&e, &o, &d, 2, json!({"note": "3-D"}), &SaveOptions::default())?;
        let at_save = e.full_parameters()?.map(|p| flat(&p));
        losses.extend(engine_steps(&mut e, &mut o, 2, 4)?);
        Ok((at_save, losses, e.full_parameters()?.map(|p| flat(&p))))
    })
    .unwrap();
    let (at_save, losses, fin) = match &out[0] {
        (Some(s), l, Some(f)) => (s.clone(), l.clone(), f.clone()),
        _ => panic!("rank 0 gathers the whole model"),
    };
    let meta = checkpoint::read_metadata(&checkpoint::resolve(&a).unwrap()).unwrap();
    let boxes = meta.tensors.values().flat_map(|t| &t.pieces).filter(|p| p.region.is_some()).count();
    assert!(boxes > 0, "tensor-parallel slices are saved as boxes of the whole tensors");
    assert_eq!(meta.format_version, 2, "boxes are format version 2 (whole tensors alone stay version 1)");
    // Consolidated into one file with the model's names: the saved parameters, in the GPT's order.
    let out = dir.join("3d.safetensors");
    checkpoint::consolidate(&a, &out, false).unwrap();
    let mut got: std::collections::BTreeMap<String, Tensor> =
        Tensor::read_safetensors(&out).unwrap().into_iter().collect();
    let names: Vec<Tensor> =
        GptConfig::tiny().param_shapes().iter().map(|(n, _)| got.remove(n).expect("every parameter")).collect();
    assert!(flat(&names) == at_save, "the consolidated 3-D checkpoint holds the saved parameters");
    let zero3 = dir.join("zero3");
    for (name, n, to) in [
        ("dp2×tp2×pp2", 8, To::Mesh(2, 2, DataDim::Replicate)),
        ("zero3:dp4", 4, To::Whole(S::Zero(Stage::Three))),
        ("tp2×pp2", 4, To::Mesh(2, 2, DataDim::Replicate)),
        ("one process", 1, To::Whole(S::Ddp)),
        ("zero2:dp2×tp2", 4, To::Mesh(2, 1, DataDim::Zero(Stage::Two))),
        ("zero1:dp2×pp2", 4, To::Mesh(1, 2, DataDim::Zero(Stage::One))),
        ("zero3:dp2×tp2×pp2", 8, To::Mesh(2, 2, DataDim::Zero(Stage::Three))),
        ("ddp2×tp2", 4, To::Mesh(2, 1, DataDim::Replicate)),
        ("ddp2×pp2", 4, To::Mesh(1, 2, DataDim::Replicate)),
    ] {
        let again = if name == "zero3:dp4" { zero3.clone() } else { dir.join("again") };
        let _ = std::fs::remove_dir_all(&again);
        let (loaded, l, f) = load_into(n, to, &a, Some(again.clone()));
        assert!(loaded.as_ref() == Some(&at_save), "{name}: the loaded parameters are not the saved ones");
        let f = f.expect("rank 0 gathers the whole model");
        if name == "dp2×tp2×pp2" {
            assert_eq!(l, losses[2..], "{name}: the same layout resumes bitwise");
            assert!(f == fin, "{name}: the same layout resumes bitwise");
        } else {
            for (s, (x, y)) in l.iter().zip(&losses[2..]).enumerate() {
                assert!((x - y).abs() <= 1e-5 * y.abs(), "{name}: step {}: loss {x}, the 3-D run's {y}", s + 2);
            }
            let worst = f.iter().zip(&fin).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-4, "{name}: 2 steps after the load, weights {worst} from the 3-D run's");
        }
        // Saved again by this layout: the same tensors, bitwise, and the same step counts.
        let m2 = checkpoint::read_metadata(&checkpoint::resolve(&again).unwrap()).unwrap();
        assert_eq!(m2.optimizer_steps, meta.optimizer_steps, "{name}: AdamW's step counts");
        assert_eq!(m2.tensors.keys().collect::<Vec<_>>(), meta.tensors.keys().collect::<Vec<_>>(), "{name}");
        for t in meta.tensors.keys() {
            let (x, y) = (checkpoint::read_tensor(&a, t).unwrap(), checkpoint::read_tensor(&again, t).unwrap());
            assert!(x.equal(&y), "{name}: {t} saved again differs from the 3-D checkpoint's");
        }
    }
    // A corrupt piece (a byte flipped in rank 3's file): every rank of the same layout refuses the
    // load, and none has changed a weight (the values are installed only once every rank has read
    // its part).
    let bad = dir.join("bad");
    let _ = std::fs::remove_dir_all(&bad);
    std::fs::create_dir_all(bad.join("step-00000002")).unwrap();
    let src = checkpoint::resolve(&a).unwrap();
    for e in std::fs::read_dir(&src).unwrap().flatten() {
        std::fs::copy(e.path(), bad.join("step-00000002").join(e.file_name())).unwrap();
    }
    let f = bad.join("step-00000002").join("rank-00003.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x40;
    std::fs::write(&f, bytes).unwrap();
    let b = bad.clone();
    let out = spawn(8, Backend::Local, move |pg| {
        let mut e = engine(pg, 2, 2, DataDim::Replicate, 99)?;
        let before = e.full_parameters()?.map(|p| flat(&p));
        let err = checkpoint::load(&mut e, &mut opt(), &b).err().map(|e| format!("{e:#}"));
        Ok((err, before == e.full_parameters()?.map(|p| flat(&p))))
    })
    .unwrap();
    for (rank, (err, unchanged)) in out.iter().enumerate() {
        let err = err.as_deref().unwrap_or_else(|| panic!("rank {rank} loaded a corrupt checkpoint"));
        assert!(err.contains("checksum") || err.contains("failed"), "rank {rank}: {err}");
        assert!(*unchanged, "rank {rank}: a refused load changed the weights");
    }
    assert!(out.iter().any(|(e, _)| e.as_deref().is_some_and(|e| e.contains("rank-00003"))), "the file is named");
    // Whole tensors (ZeRO-3's flat shards of them) back into boxes.
    let (loaded, ..) = load_into(4, To::Mesh(2, 2, DataDim::Zero(Stage::Two)), &zero3, None);
    assert!(loaded.as_ref() == Some(&at_save), "zero3's checkpoint into zero2 × tp 2 × pp 2");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `train --tp 2 --pp 2 --checkpoint-dir` then `--resume`: 3-D parallelism (dp 2 × tp 2 × pp 2 on
/// 8 ranks) saves during the run, and the resumed run's losses and weights are bitwise the
/// uninterrupted run's at the same layout; resumed as ZeRO-3 on 4 ranks of the whole model (the
/// same global batch), the same within 1e-5.
#[test]
fn a_three_d_job_resumes_at_its_layout_and_at_another() {
    use shardlab::job::{CheckpointConfig, DataSource, GptJob};
    use shardlab::pipeline::PipelineConfig;
    let dir = tmpdir("resume-3d");
    std::fs::create_dir_all(&dir).unwrap();
    let tokens = dir.join("tokens.bin");
    spread().write(&tokens).unwrap();
    let job = |steps: u64, batch_size: usize, save: &str, ck: CheckpointConfig| GptJob {
        model: GptConfig::tiny(),
        batch_size,
        accum: 1,
        steps,
        warmup: 0,
        optim: AdamWConfig { lr: 3e-3, eps: 1e-6, ..AdamWConfig::default() },
        lr_schedule: Some(LrSchedule { max_lr: 3e-3, min_lr: 3e-4, warmup_iters: 2, decay_iters: 6 }),
        grad_clip: Some(1.0),
        data: DataSource::File(tokens.clone()),
        seed: 1,
        init: None,
        save: Some(dir.join(save)),
        checkpoint: ck,
        eval: Default::default(),
    };
    let three_d = ScalingConfig {
        num_workers: 8,
        strategy: Strategy::Ddp,
        tensor_parallel: 2,
        pipeline: PipelineConfig { stages: 2, micro_batches: 2, ..PipelineConfig::default() },
        ..ScalingConfig::default()
    };
    let straight =
        job(6, 2, "straight.safetensors", CheckpointConfig::default()).fit(three_d.clone(), false, false).unwrap();
    let ck = dir.join("ck");
    let first = CheckpointConfig { dir: Some(ck.clone()), every: 3, ..Default::default() };
    let half = job(3, 2, "half.safetensors", first).fit(three_d.clone(), false, false).unwrap();
    assert!(ck.join("step-00000003").join("metadata.json").is_file());
    assert!(half.checkpoint_bytes_written > 0, "rank 0 wrote its pieces");
    let resume = CheckpointConfig { resume: Some(ck.clone()), ..Default::default() };
    let rest = job(6, 2, "resumed.safetensors", resume.clone()).fit(three_d, false, false).unwrap();
    let losses: Vec<f64> = half.losses.iter().chain(&rest.losses).copied().collect();
    assert_eq!(losses, straight.losses, "the resumed 3-D run's losses are the straight run's");
    let a = std::fs::read(dir.join("straight.safetensors")).unwrap();
    assert!(a == std::fs::read(dir.join("resumed.safetensors")).unwrap(), "bitwise the same weights");
    let zero3 = ScalingConfig { num_workers: 4, strategy: Strategy::Zero3, ..ScalingConfig::default() };
    let other = job(6, 4, "zero3.safetensors", resume).fit(zero3, false, false).unwrap();
    for (s, (x, y)) in other.losses.iter().zip(&straight.losses[3..]).enumerate() {
        assert!((x - y).abs() <= 1e-5 * y.abs(), "zero3 × 4, step {}: loss {x}, the 3-D run's {y}", s + 3);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Where a restart resumes, at every instant, and one job per folder: the newest commit wins by
/// its sequence number — also when `latest` still names the one before (rank 0 died between
/// the commit and replacing it) and when a run resumed from an earlier step saves a lower step
/// than another timeline's; saving a step again swaps the committed copy out atomically (the new
/// values load, nothing is left behind); a second job (another process holding the folder's
/// lock) is refused, naming it, and the folder is free again once that process is gone.
#[test]
fn the_newest_commit_is_resumed_and_a_second_job_is_refused() {
    let dir = tmpdir("seq");
    let save_at = |step: u64, seed: u64| {
        let d = dir.clone();
        spawn(2, Backend::Local, move |pg| {
            let dp = wrap(pg, S::Ddp, seed, Precision::Fp32)?;
            checkpoint::save(&*dp, &opt(), &d, step, json!({}), &SaveOptions::default()).map(|_| ())
        })
        .map(|_| ())
    };
    let seq = |step: u64| checkpoint::read_metadata(&dir.join(checkpoint::step_dir_name(step))).unwrap().seq;
    save_at(3, 1).unwrap();
    save_at(6, 1).unwrap();
    assert_eq!((seq(3), seq(6)), (1, 2), "one more than any commit before");
    std::fs::write(dir.join("latest"), "step-00000003").unwrap(); // as if rank 0 died before replacing it
    assert_eq!(checkpoint::resolve(&dir).unwrap(), dir.join("step-00000006"), "the newest commit, not latest");
    save_at(4, 1).unwrap(); // a run resumed from step 3 saves step 4; step 6 is another timeline's
    assert_eq!(checkpoint::resolve(&dir).unwrap(), dir.join("step-00000004"));
    // Step 4 again, from other weights: swapped in, the old copy gone.
    save_at(4, 2).unwrap();
    assert_eq!(seq(4), 4);
    let w = checkpoint::read_tensor(&dir, "param/transformer.wte.weight").unwrap();
    let want = Gpt::new(GptConfig::tiny(), 2).unwrap().parameters()[0].detach();
    assert!(w.equal(&want), "the second save of step 4 is the one that loads");
    let names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    assert!(!names.iter().any(|n| n.ends_with(".tmp") || n.ends_with(".deleting")), "{names:?}");
    // Another job holds the folder: refused on every rank, naming it; free once it is gone.
    let other = tmpdir("seq-other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join(".lock"), "pid 4242 on elsewhere, since 0 (Unix time)").unwrap();
    use std::os::unix::process::CommandExt;
    let mut holder = std::process::Command::new("flock")
        .arg("-o")
        .arg(other.join(".lock"))
        .args(["sleep", "30"])
        .process_group(0)
        .spawn()
        .expect("flock(1)");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let o = other.clone();
    let errs = spawn(2, Backend::Local, move |pg| {
        let dp = wrap(pg, S::Ddp, 1, Precision::Fp32)?;
        Ok(checkpoint::save(&*dp, &opt(), &o, 1, json!({}), &SaveOptions::default()).err().map(|e| format!("{e:#}")))
    })
    .unwrap();
    for (rank, e) in errs.iter().enumerate() {
        let e = e.as_deref().unwrap_or_else(|| panic!("rank {rank} saved into a folder another job holds"));
        assert!(e.contains("in use by another job") || e.contains("rank 0 failed"), "rank {rank}: {e}");
    }
    assert!(errs[0].as_deref().unwrap().contains("pid 4242 on elsewhere"), "{:?}", errs[0]);
    assert!(checkpoint::committed(&other).is_empty());
    unsafe { libc::kill(-(holder.id() as i32), libc::SIGKILL) }; // flock and its sleep
    holder.wait().unwrap();
    // This process's job takes it, and holds it until the job ends (`unlock_folder`, what the
    // step loops call after their last save): then another process may take it.
    let try_lock = |path: &Path| {
        std::process::Command::new("flock").args(["-n"]).arg(path.join(".lock")).arg("true").status().unwrap().success()
    };
    let o = other.clone();
    let locked = spawn(2, Backend::Local, move |pg| {
        let dp = wrap(pg, S::Ddp, 1, Precision::Fp32)?;
        checkpoint::save(&*dp, &opt(), &o, 1, json!({}), &SaveOptions::default())?;
        if pg.rank() == 0 {
            let during = try_lock(&o);
            checkpoint::unlock_folder(&o, &pg.job());
            return Ok(Some((during, try_lock(&o))));
        }
        Ok(None)
    })
    .unwrap();
    assert_eq!(checkpoint::committed(&other).len(), 1, "the folder is free once its holder is gone");
    assert_eq!(locked[0], Some((false, true)), "held during the job, free once it is over");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&other);
}

/// Two jobs at once in one process (thread ranks, as in a notebook): the second is refused on
/// every rank while the first holds the folder, and a job that failed without releasing it holds
/// it no longer once its groups are gone.
#[test]
fn two_jobs_of_one_process_are_told_apart() {
    let dir = tmpdir("two-jobs");
    let (hold, release) = std::sync::mpsc::channel::<()>();
    let release = std::sync::Mutex::new(release);
    let (saved, saved_rx) = std::sync::mpsc::channel::<()>();
    let d = dir.clone();
    let first = std::thread::spawn(move || {
        spawn(2, Backend::Local, move |pg| {
            let dp = wrap(pg, S::Ddp, 1, Precision::Fp32)?;
            checkpoint::save(&*dp, &opt(), &d, 1, json!({}), &SaveOptions::default())?;
            if pg.rank() == 0 {
                saved.send(()).unwrap();
                // Still running: the job keeps its groups (and the folder) until told to end.
                let _ = release.lock().unwrap().recv();
            }
            pg.barrier()?;
            Ok(())
        })
        .unwrap();
    });
    saved_rx.recv().unwrap();
    let d = dir.clone();
    let errs = spawn(2, Backend::Local, move |pg| {
        let dp = wrap(pg, S::Ddp, 2, Precision::Fp32)?;
        Ok(checkpoint::save(&*dp, &opt(), &d, 2, json!({}), &SaveOptions::default()).err().map(|e| format!("{e:#}")))
    })
    .unwrap();
    for (rank, e) in errs.iter().enumerate() {
        let e =
            e.as_deref().unwrap_or_else(|| panic!("rank {rank} saved into a folder another job of this process holds"));
        assert!(e.contains("in use by another job") || e.contains("rank 0 failed"), "rank {rank}: {e}");
    }
    assert!(errs[0].as_deref().unwrap().contains("another job of this process"), "{:?}", errs[0]);
    assert_eq!(checkpoint::committed(&dir).len(), 1, "only the first job's step");
    hold.send(()).unwrap();
    first.join().unwrap();
    // The first job ended without `unlock_folder` (as a failed job would): its groups are gone, so
    // the next job of this process takes the folder.
    let d = dir.clone();
    spawn(2, Backend::Local, move |pg| {
        let dp = wrap(pg, S::Ddp, 2, Precision::Fp32)?;
        checkpoint::save(&*dp, &opt(), &d, 2, json!({}), &SaveOptions::default()).map(|_| ())
    })
    .unwrap();
    assert_eq!(checkpoint::committed(&dir).len(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A job that fails after saving frees its folder for other processes: the training loops hold a
/// `FolderRelease` from their start, which releases on every way out (here an error).
#[test]
fn a_failed_job_releases_its_folder() {
    let dir = tmpdir("failed-job");
    let d = dir.clone();
    let r = spawn(2, Backend::Local, move |pg| {
        let _release = checkpoint::FolderRelease::new(vec![d.clone()], pg.job());
        let dp = wrap(pg, S::Ddp, 1, Precision::Fp32)?;
        checkpoint::save(&*dp, &opt(), &d, 1, json!({}), &SaveOptions::default())?;
        let held = !std::process::Command::new("flock").arg("-n").arg(d.join(".lock")).arg("true").status()?.success();
        anyhow::ensure!(!held || pg.rank() != 0, "rank 0 fails after its save (the folder held: {held})");
        Ok(())
    });
    let e = format!("{:#}", r.unwrap_err());
    assert!(e.contains("the folder held: true"), "{e}");
    let free = std::process::Command::new("flock").arg("-n").arg(dir.join(".lock")).arg("true").status().unwrap();
    assert!(free.success(), "the failed job's folder is free for another process");
    let _ = std::fs::remove_dir_all(&dir);
}

// The simulated disk of lesson 10 (`checkpoint::sim`): what survives a power loss.

#[test]
fn only_synced_bytes_and_entries_survive() {
    let mut d = sim::SimDisk::new();
    d.create_dir("c").unwrap();
    d.write("c/f", b"abcdefgh").unwrap();
    d.sync("c/f").unwrap();
    d.sync("c").unwrap();
    d.sync("").unwrap();
    d.write("c/f", b"ABCDEFGH").unwrap(); // overwritten in place, not synced
    d.write("c/g", b"new").unwrap(); // created, directory not synced
    d.power_loss();
    d.reboot();
    assert_eq!(d.read("c/f").unwrap(), b"ABCD", "an unsynced overwrite comes back torn");
    assert!(!d.exists("c/g"), "an entry the directory never synced is lost");
    // A rename is durable only once its directory is synced.
    d.write("c/h", b"x").unwrap();
    d.sync("c/h").unwrap();
    d.sync("c").unwrap();
    d.rename("c/h", "c/i").unwrap();
    d.power_loss();
    d.reboot();
    assert!(d.exists("c/h") && !d.exists("c/i"));
    // A crash at operation k: that operation does not happen, and nothing works until reboot.
    let k = d.ops();
    d.crash_at(k + 1);
    d.write("c/j", b"1").unwrap();
    assert_eq!(d.sync("c"), Err(sim::SimError::PowerLoss));
    assert_eq!(d.write("c/k", b"1"), Err(sim::SimError::PowerLoss));
    d.reboot();
    assert!(!d.exists("c/j"));
    assert_eq!(d.create_dir("c"), Err(sim::SimError::Exists("c".into())));
    assert_eq!(d.write("nope/x", b""), Err(sim::SimError::NotFound("nope".into())));
}

/// Two renames in one folder, no sync between: a loss may keep either, both or neither.
#[test]
fn unsynced_changes_are_kept_in_any_subset() {
    let setup = || {
        let mut d = sim::SimDisk::new();
        for f in ["x.tmp", "y.tmp"] {
            d.write(f, f.as_bytes()).unwrap();
            d.sync(f).unwrap();
        }
        d.sync("").unwrap();
        d.rename("x.tmp", "x").unwrap();
        d.rename("y.tmp", "y").unwrap();
        d
    };
    let names = |d: &sim::SimDisk| d.list("");
    assert_eq!(setup().unsynced(), vec![vec!["x".to_string(), "x.tmp".into()], vec!["y".into(), "y.tmp".into()]]);
    let mut seen = Vec::new();
    for mask in 0..4 {
        let mut d = setup();
        d.keep_on_power_loss(mask);
        d.power_loss();
        d.reboot();
        seen.push(names(&d));
        assert_eq!(d.last_loss().iter().filter(|(_, kept)| *kept).count(), mask.count_ones() as usize);
        assert!(d.unsynced().is_empty(), "after a loss everything left is durable");
    }
    assert_eq!(seen, [["x.tmp", "y.tmp"], ["x", "y.tmp"], ["x.tmp", "y"], ["x", "y"]]);
    // A rename is atomic even when chained: a → b → c is one change of a and c.
    let mut d = sim::SimDisk::new();
    d.write("a", b"1").unwrap();
    d.sync("a").unwrap();
    d.sync("").unwrap();
    d.rename("a", "b").unwrap();
    d.rename("b", "c").unwrap();
    d.write("n", b"2").unwrap();
    assert_eq!(d.unsynced(), vec![vec!["a".to_string(), "c".into()], vec!["n".into()]]);
    d.keep_on_power_loss(0b01);
    d.power_loss();
    d.reboot();
    assert_eq!(names(&d), ["c"]);
    // A synced folder has nothing pending; a subfolder's changes show with its path.
    d.create_dir("f").unwrap();
    d.sync("").unwrap();
    d.write("f/g", b"3").unwrap();
    assert_eq!(d.unsynced(), vec![vec!["f/g".to_string()]]);
    d.sync("f").unwrap();
    assert!(d.unsynced().is_empty());
    // A rename between folders: syncing either folder makes both halves durable, so the file
    // never ends in neither folder (nor in both).
    for synced in ["f", "h"] {
        let mut d = sim::SimDisk::new();
        for f in ["f", "h"] {
            d.create_dir(f).unwrap();
        }
        d.write("f/x", b"1").unwrap();
        d.sync("f/x").unwrap();
        d.sync("f").unwrap();
        d.sync("").unwrap();
        d.rename("f/x", "h/x").unwrap();
        d.sync(synced).unwrap();
        assert!(d.unsynced().is_empty(), "syncing {synced} settles the rename: {:?}", d.unsynced());
        d.power_loss();
        d.reboot();
        assert_eq!((d.list("f"), d.list("h")), (vec![], vec!["x".to_string()]), "synced {synced}");
    }
    // A folder removed but not yet durably: its pending changes may come back with it.
    let mut d = sim::SimDisk::new();
    d.create_dir("f").unwrap();
    d.sync("").unwrap();
    d.write("f/a", b"1").unwrap();
    d.remove_all("f").unwrap();
    assert_eq!(d.unsynced(), vec![vec!["f".to_string()], vec!["f/a".into()]]);
}
