//! Pipeline parallelism (lesson 13): the GPT's stages split over p ranks, micro-batches over
//! send/recv, GPipe and 1F1B. A step's loss and every gradient equal one process's on the whole
//! batch (the mean of equal micro-batches' means is the batch's mean; within f32 rounding, 1e-5):
//! each rank's gradients of the parameters its stages use, the tied embedding's summed over the
//! first and last rank. The activations a rank holds are counted by the executor: GPipe holds all
//! m micro-batches at its turn, 1F1B at most p − r (Narayanan et al. 2021).

use shardlab::data::synthetic_corpus;
use shardlab::pipeline::{partition, pipeline_step, Schedule};
use shardlab::prelude::*;

const ROWS: usize = 8;

fn setup() -> (GptConfig, Batch) {
    setup_with(true)
}

fn setup_with(ignored: bool) -> (GptConfig, Batch) {
    let cfg = GptConfig { vocab_size: 64, block_size: 16, n_layer: 2, n_head: 2, n_embd: 32 };
    let data = synthetic_corpus(4000, 3);
    let batch = DistributedSampler::new(cfg.block_size as usize, ROWS, 0, 1, 5).unwrap().batch(&data, 0);
    // Targets −1 (ignored by the loss) in the first row: micro-batches then hold different numbers
    // of targets, and the batch's mean weighs each micro-batch's mean by its share.
    if ignored {
        let _ = batch.y.narrow(0, 0, 1).narrow(1, 0, 11).fill_(-1);
    }
    (cfg, batch)
}

fn reference() -> (f64, Vec<Vec<f32>>) {
    reference_with(true)
}

fn reference_with(ignored: bool) -> (f64, Vec<Vec<f32>>) {
    let (cfg, batch) = setup_with(ignored);
    let gpt = Gpt::new(cfg, 9).unwrap();
    let loss = gpt.loss(&batch);
    loss.backward();
    let grads = gpt.parameters().iter().map(|p| Vec::<f32>::try_from(p.grad().reshape([-1])).unwrap()).collect();
    (loss.double_value(&[]), grads)
}

fn run(p: usize, m: usize, kind: Schedule, backend: Backend, test: &str) -> Vec<(f64, Vec<(usize, Vec<f32>)>, usize)> {
    let mut opts = SpawnOptions::new(p, backend);
    if backend == Backend::Tcp {
        opts = opts.child_args(vec!["--exact".into(), test.into(), "--nocapture".into(), "--test-threads=1".into()]);
    }
    spawn_with(opts, move |pg| {
        let (cfg, batch) = setup();
        let gpt = Gpt::new(cfg, 9)?; // the same weights on every rank; each computes its stages
        let step = pipeline_step(pg, &gpt, kind, &batch, m, cfg.n_embd)?;
        // The measured diagram: this rank's operations in its schedule's order, each a slot of
        // compute inside the step; a rank that is not the first waits for its first input.
        let ops: Vec<_> = step.slots.iter().map(|s| s.op).collect();
        anyhow::ensure!(ops == shardlab::pipeline::schedule(kind, p, m, pg.rank()), "slots out of schedule order");
        anyhow::ensure!(step.slots.iter().all(|s| 0.0 <= s.start && s.start <= s.end && s.end <= step.step_s), "slots");
        anyhow::ensure!(pg.rank() == 0 || step.slots[0].start > 0.0, "rank {} never waited", pg.rank());
        anyhow::ensure!((0.0..1.0).contains(&step.bubble()), "bubble {}", step.bubble());
        let grads = step.grads.iter().map(|(&k, g)| (k, Vec::<f32>::try_from(g.reshape([-1])).unwrap())).collect();
        Ok((step.loss, grads, step.peak_in_flight))
    })
    .unwrap()
}

fn check(out: Vec<(f64, Vec<(usize, Vec<f32>)>, usize)>, p: usize, m: usize, kind: Schedule) {
    let (loss, grads) = reference();
    let (cfg, _) = setup();
    let parts = partition(cfg.n_layer as usize + 2, p).unwrap();
    let mut seen = vec![false; grads.len()];
    for (r, (l, g, peak)) in out.into_iter().enumerate() {
        let what = format!("{kind:?} p={p} m={m} rank {r} (stages {:?})", parts[r]);
        assert!((l - loss).abs() < 1e-5, "{what}: loss {l}, one process {loss}");
        for (k, got) in g {
            seen[k] = true;
            let worst = got.iter().zip(&grads[k]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-5, "{what}: the gradient of parameter {k} differs from one process by {worst}");
        }
        let want = if kind == Schedule::GPipe { m } else { (p - r).min(m) };
        assert_eq!(peak, want, "{what}: micro-batches whose activations the rank held at once");
    }
    assert!(seen.iter().all(|&s| s), "{kind:?} p={p}: every parameter's gradient is on some rank");
}

#[test]
fn pipeline_matches_one_process_local() {
    for kind in [Schedule::GPipe, Schedule::OneFOneB] {
        for (p, m) in [(2, 4), (4, 4), (3, 2), (4, 8)] {
            check(run(p, m, kind, Backend::Local, ""), p, m, kind);
        }
    }
}

#[test]
fn pipeline_1f1b_matches_one_process_tcp() {
    let out = run(4, 4, Schedule::OneFOneB, Backend::Tcp, "pipeline_1f1b_matches_one_process_tcp");
    check(out, 4, 4, Schedule::OneFOneB);
}

#[test]
fn bad_pipelines_are_refused_on_every_rank() {
    let out = spawn(2, Backend::Local, move |pg| {
        let (cfg, batch) = setup();
        let gpt = Gpt::new(cfg, 9)?;
        let m3 = pipeline_step(pg, &gpt, Schedule::GPipe, &batch, 3, cfg.n_embd).err().map(|e| e.to_string());
        Ok(m3.unwrap_or_default())
    })
    .unwrap();
    assert!(out.iter().all(|e| e.contains("3 micro-batches do not divide a batch of 8 rows")), "{out:?}");
    assert!(partition(4, 5).unwrap_err().contains("5 pipeline ranks for a model of 4 stages"));
}

/// Data × pipeline parallel on a 2 × 2 mesh: each dp replica pipelines its half of the batch over
/// its pp pair (1F1B, 2 micro-batches), then the replicas average their gradients over dp. The
/// result is one process's step on the whole batch (1e-5). (No ignored targets here: averaging
/// over dp is a mean of the replicas' means, as in DDP.)
#[test]
fn dp_times_pp_on_a_2x2_mesh_matches_one_process() {
    let out = spawn(4, Backend::Local, |pg| {
        let mesh = DeviceMesh::new(pg, &[2, 2], &["dp", "pp"])?;
        let (cfg, batch) = setup_with(false);
        let half = (ROWS / 2) as i64;
        let d = mesh.coord("dp") as i64;
        let mine = batch.rows(d * half, (d + 1) * half);
        let gpt = Gpt::new(cfg, 9)?;
        let mut step = pipeline_step(mesh.group("pp"), &gpt, Schedule::OneFOneB, &mine, 2, cfg.n_embd)?;
        let mut loss = Tensor::from_slice(&[step.loss]);
        mesh.group("dp").all_reduce(&mut loss, ReduceOp::Avg)?;
        for g in step.grads.values_mut() {
            mesh.group("dp").all_reduce(g, ReduceOp::Avg)?;
        }
        let grads: Vec<(usize, Vec<f32>)> =
            step.grads.iter().map(|(&k, g)| (k, Vec::<f32>::try_from(g.reshape([-1])).unwrap())).collect();
        Ok((loss.double_value(&[0]), grads, mesh.coord("pp")))
    })
    .unwrap();
    let (loss, grads) = reference_with(false);
    for (r, (l, g, pp)) in out.into_iter().enumerate() {
        assert!((l - loss).abs() < 1e-5, "rank {r}: loss {l}, one process {loss}");
        for (k, got) in g {
            let worst = got.iter().zip(&grads[k]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-5, "rank {r} (pp stage {pp}): parameter {k}'s gradient differs by {worst}");
        }
    }
}

/// The blocking-send tests' batch: 256 rows of 64 tokens, cut by both tests into 4 micro-batches
/// of 64 rows — (64, 64, 256) f32 = 4 MiB per activation, above the sockets' buffers — and their
/// 4 process ranks over TCP, each running only `test`.
fn big_batch() -> Batch {
    DistributedSampler::new(64, 256, 0, 1, 5).unwrap().batch(&synthetic_corpus(20_000, 3), 0)
}
fn four_tcp_ranks(test: &str) -> SpawnOptions {
    SpawnOptions::new(4, Backend::Tcp)
        .config(CommConfig::default().with_timeout(std::time::Duration::from_secs(60)))
        .child_args(vec!["--exact".into(), test.into(), "--nocapture".into(), "--test-threads=1".into()])
}

/// Activations larger than a socket's or a shared-memory ring's buffer (4 MiB per send), so a send
/// blocks until its receiver reads: in 1F1B's steady state two neighbours would both send first
/// and wait forever. The executor holds an activation back until it has received the gradient its
/// neighbour sends first; the step completes, with one process's loss.
#[test]
fn pipeline_1f1b_with_blocking_sends_tcp() {
    const TEST: &str = "pipeline_1f1b_with_blocking_sends_tcp";
    let cfg = GptConfig { vocab_size: 64, block_size: 64, n_layer: 2, n_head: 4, n_embd: 256 };
    let batch = big_batch;
    let opts = four_tcp_ranks(TEST);
    let out = spawn_with(opts, move |pg| {
        let gpt = Gpt::new(cfg, 9)?;
        Ok(pipeline_step(pg, &gpt, Schedule::OneFOneB, &batch(), 4, cfg.n_embd)?.loss)
    })
    .unwrap();
    let want = Gpt::new(cfg, 9).unwrap().loss(&batch()).double_value(&[]);
    for (r, l) in out.into_iter().enumerate() {
        assert!((l - want).abs() < 1e-5, "rank {r}: loss {l}, one process {want}");
    }
}

/// A pipeline rank builds only its stages' parameters: `Gpt::new_only` materialises exactly
/// the parameters of `params_of_ranks` (equal to `Gpt::new`'s, bit for bit), the others hold no
/// storage; over the ranks (the tied embedding counted once) the bytes measured from the
/// tensors add up to the whole model's.
#[test]
fn a_pipeline_rank_builds_only_its_stages() {
    use shardlab::pipeline::train::params_of_ranks;
    let cfg = GptConfig { vocab_size: 64, block_size: 16, n_layer: 4, n_head: 2, n_embd: 32 };
    let whole = Gpt::new(cfg, 9).unwrap();
    let whole_bytes = shardlab::memory::held_bytes(whole.parameters().iter());
    for p in [1, 2, 3, 6] {
        let owned = params_of_ranks(&cfg, p).unwrap();
        let mut counted = std::collections::BTreeSet::new();
        let mut sum = 0;
        for (r, mine) in owned.iter().enumerate() {
            let g = Gpt::new_only(cfg, 9, |i| mine.contains(&i)).unwrap();
            for (i, (a, b)) in g.parameters().iter().zip(whole.parameters()).enumerate() {
                if mine.contains(&i) {
                    assert!(a.equal(&b), "p={p} rank {r}: parameter {i} differs from Gpt::new's");
                    if counted.insert(i) {
                        sum += shardlab::memory::held_bytes([a]);
                    }
                } else {
                    assert_eq!(a.numel(), 0, "p={p} rank {r}: parameter {i} is not its stages' but is held");
                }
            }
        }
        assert_eq!(counted.len(), whole.parameters().len(), "p={p}: every parameter on some rank");
        assert_eq!(sum, whole_bytes, "p={p}: the ranks' parameters add up to the model");
        // The tied embedding (parameter 0) is on the first and the last rank only.
        let with_wte: Vec<usize> = (0..p).filter(|&r| owned[r].contains(&0)).collect();
        assert_eq!(with_wte, if p == 1 { vec![0] } else { vec![0, p - 1] }, "p={p}");
    }
    assert!(params_of_ranks(&cfg, 7).unwrap_err().contains("7 pipeline ranks for a model of 6 stages"));
}

/// `train --pp`: a job on 4 ranks as dp 2 × pp 2, and as one 4-stage pipeline, trains on the
/// same global batch as DDP on 4 ranks, to the same losses (1e-5) and the same weights after the
/// last step (saved whole from the stages, whose two copies of the tied wte the save checks
/// equal; 1e-4 after 4 clipped AdamW steps), holding fewer
/// parameter bytes per rank; bad shapes are refused with the reason. (With --tp too: 3-D,
/// tests/engine.rs.)
#[test]
fn a_job_with_pp_trains_like_ddp() {
    use shardlab::job::{DataSource, GptJob};
    use shardlab::pipeline::PipelineConfig;
    let dir = std::env::temp_dir().join(format!("shardlab-pp-job-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tokens.bin");
    synthetic_corpus(4000, 3).write(&file).unwrap();
    let job = GptJob {
        model: GptConfig::tiny(),
        batch_size: 2,
        accum: 1,
        steps: 4,
        warmup: 0,
        optim: AdamWConfig { lr: 3e-3, ..AdamWConfig::default() },
        lr_schedule: Some(LrSchedule { max_lr: 3e-3, min_lr: 3e-4, warmup_iters: 1, decay_iters: 4 }),
        grad_clip: Some(1.0),
        data: DataSource::File(file.clone()),
        seed: 1,
        init: None,
        save: None,
        checkpoint: Default::default(),
        eval: Default::default(),
    };
    let fit = |pipeline: PipelineConfig, strategy: Strategy, save: &str| {
        let s = ScalingConfig { num_workers: 4, strategy, pipeline, ..ScalingConfig::default() };
        GptJob { save: Some(dir.join(save)), ..job.clone() }.fit(s, false, false)
    };
    let pp = |stages, micro_batches, schedule| PipelineConfig { stages, micro_batches, schedule };
    let ddp = fit(PipelineConfig::default(), Strategy::Ddp, "ddp.safetensors").unwrap();
    let weights = |f: &str| {
        let mut w: Vec<(String, Tensor)> = Tensor::read_safetensors(dir.join(f)).unwrap();
        w.sort_by(|a, b| a.0.cmp(&b.0));
        w
    };
    for (cfg, name, f) in [
        (pp(2, 2, Schedule::OneFOneB), "ddp2×pp2", "pp2.safetensors"),
        (pp(4, 4, Schedule::GPipe), "pp4", "pp4.safetensors"),
    ] {
        let r = fit(cfg, Strategy::Ddp, f).unwrap();
        assert_eq!(r.strategy, name);
        for (s, (a, b)) in r.losses.iter().zip(&ddp.losses).enumerate() {
            assert!((a - b).abs() < 1e-5, "{name} step {s}: loss {a}, DDP on 4 ranks {b}");
        }
        let (ours, theirs) = (weights(f), weights("ddp.safetensors"));
        assert_eq!(ours.len(), theirs.len(), "{name}: the saved tensors");
        for ((n, a), (_, b)) in ours.iter().zip(theirs) {
            let d = (a - &b).abs().max().double_value(&[]);
            assert!(d < 1e-4, "{name}: {n} differs from DDP's by {d} after {} steps", job.steps);
        }
        assert!(r.bytes_sent_per_step > 0.0, "{name}: the bytes of the pp and dp groups are counted");
        // Rank 0 holds the embeddings and its blocks only.
        assert!(
            r.memory.params < ddp.memory.params,
            "{name}: pipeline rank 0 holds {} parameter bytes, a DDP rank {}",
            r.memory.params,
            ddp.memory.params
        );
        let st = r.pipeline.expect("a pipeline run reports its bubble");
        assert!((0.0..1.0).contains(&st.bubble), "{name}: bubble {}", st.bubble);
        let want = if cfg.schedule == Schedule::GPipe { cfg.micro_batches } else { cfg.stages.min(cfg.micro_batches) };
        assert_eq!(st.peak_in_flight, want, "{name}: rank 0's activations held");
    }
    let err = |cfg, strategy| format!("{:#}", fit(cfg, strategy, "x.safetensors").err().expect("refused"));
    assert!(err(pp(3, 2, Schedule::OneFOneB), Strategy::Ddp).contains("--pp 3 does not divide the world of 4"));
    assert!(err(pp(2, 3, Schedule::OneFOneB), Strategy::Ddp).contains("--micro-batches 3 does not divide"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A GPT that counts its stage forwards (what the executor really ran).
struct Counting {
    gpt: Gpt,
    forwards: std::sync::atomic::AtomicUsize,
}

impl Model for Counting {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.gpt.named_parameters()
    }
    fn num_stages(&self) -> usize {
        self.gpt.num_stages()
    }
    fn stage_forward(&self, s: usize, x: &Tensor, batch: &Batch) -> Tensor {
        self.forwards.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.gpt.stage_forward(s, x, batch)
    }
    fn param_stages(&self) -> Vec<usize> {
        self.gpt.param_stages()
    }
    fn stage_uses(&self) -> Vec<Vec<usize>> {
        self.gpt.stage_uses()
    }
    fn var_store(&self) -> &tch::nn::VarStore {
        self.gpt.var_store()
    }
}

/// Activation checkpointing in a pipeline (`pipeline_step_with(…, true)`): each rank runs its
/// stages' forward twice per micro-batch (counted on the model), and the loss and every gradient
/// are bitwise those of the step that keeps its activations — the same operations on the same
/// values.
#[test]
fn pipeline_recompute_runs_each_forward_twice_and_changes_no_bit() {
    use shardlab::pipeline::pipeline_step_with;
    let out = spawn(2, Backend::Local, |pg| {
        let (cfg, batch) = setup();
        let mut results = Vec::new();
        for recompute in [false, true] {
            let m = Counting { gpt: Gpt::new(cfg, 9)?, forwards: Default::default() };
            let st = pipeline_step_with(pg, &m, Schedule::OneFOneB, &batch, 4, cfg.n_embd, recompute)?;
            let grads: Vec<Vec<f32>> =
                st.grads.values().map(|g| Vec::<f32>::try_from(g.reshape([-1])).unwrap()).collect();
            results.push((st.loss, grads, m.forwards.load(std::sync::atomic::Ordering::Relaxed)));
        }
        Ok(results)
    })
    .unwrap();
    for (r, res) in out.into_iter().enumerate() {
        let ((l0, g0, f0), (l1, g1, f1)) = (&res[0], &res[1]);
        assert_eq!(l0.to_bits(), l1.to_bits(), "rank {r}: the loss changed with recompute");
        assert_eq!(g0, g1, "rank {r}: a gradient changed with recompute");
        // 4 stages over 2 ranks: 2 each, 4 micro-batches.
        assert_eq!((*f0, *f1), (8, 16), "rank {r}: stage forwards without and with recompute");
    }
}

/// The interleaved 1F1B schedule on real ranks (`pipeline::interleaved_step`): v chunks a rank,
/// the loss and every gradient equal one process's on the whole batch (1e-5), on thread ranks;
/// every chunk operation runs once, in the schedule's order.
#[test]
fn interleaved_pipeline_matches_one_process_local() {
    use shardlab::pipeline::{interleaved, interleaved_step};
    let cfg = GptConfig { vocab_size: 64, block_size: 16, n_layer: 6, n_head: 2, n_embd: 32 };
    let (_, batch) = setup();
    let gpt = Gpt::new(cfg, 9).unwrap();
    let loss = gpt.loss(&batch);
    loss.backward();
    let want: Vec<Vec<f32>> =
        gpt.parameters().iter().map(|p| Vec::<f32>::try_from(p.grad().reshape([-1])).unwrap()).collect();
    let want_loss = loss.double_value(&[]);
    // (p, v, m): 8 stages (embeddings, 6 blocks, head) over p·v virtual stages.
    for (p, v, m) in [(2, 2, 4), (2, 4, 2), (4, 2, 8), (4, 2, 4), (2, 1, 4)] {
        let out = spawn(p, Backend::Local, move |pg| {
            let (_, batch) = setup();
            let gpt = Gpt::new(cfg, 9)?;
            let step = interleaved_step(pg, &gpt, v, &batch, m, cfg.n_embd)?;
            let ops: Vec<_> = step.slots.iter().map(|s| s.op).collect();
            let plan: Vec<_> =
                interleaved(p, v, m, pg.rank()).map_err(anyhow::Error::msg)?.iter().map(|c| c.op).collect();
            anyhow::ensure!(ops == plan, "slots out of the schedule's order");
            let grads: Vec<(usize, Vec<f32>)> =
                step.grads.iter().map(|(&k, g)| (k, Vec::<f32>::try_from(g.reshape([-1])).unwrap())).collect();
            Ok((step.loss, grads))
        })
        .unwrap();
        let mut seen = vec![false; want.len()];
        for (r, (l, grads)) in out.into_iter().enumerate() {
            let what = format!("p {p} v {v} m {m} rank {r}");
            assert!((l - want_loss).abs() < 1e-5, "{what}: loss {l}, one process {want_loss}");
            for (k, got) in grads {
                seen[k] = true;
                let worst = got.iter().zip(&want[k]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(worst < 1e-5, "{what}: the gradient of parameter {k} differs from one process by {worst}");
            }
        }
        assert!(seen.iter().all(|&s| s), "p {p} v {v} m {m}: every parameter's gradient is on some rank");
    }
    // A micro-batch count the schedule cannot group, and more virtual stages than stages: refused on every rank.
    for (p, v, m, expect) in [(2, 2, 3, "not a multiple of 2"), (4, 4, 4, "each rank needs at least one")] {
        let errs = spawn(p, Backend::Local, move |pg| {
            let (_, batch) = setup();
            Ok(interleaved_step(pg, &Gpt::new(cfg, 9)?, v, &batch, m, cfg.n_embd)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default())
        })
        .unwrap();
        assert!(errs.iter().all(|e| e.contains(expect)), "{errs:?}");
    }
}

/// The interleaved schedule where a send blocks until it is read: 4 process ranks over TCP, 2
/// chunks each, 4 MiB activations (above the sockets' buffers), the last rank sending each
/// chunk's activations round to the first. The rendezvous plan orders every send against its
/// receive; the loss equals one process's, and so does every gradient (compared by its sum and
/// the sum of its absolute values: a gradient received into the wrong buffer would move both).
#[test]
fn interleaved_pipeline_with_blocking_sends_tcp() {
    use shardlab::pipeline::interleaved_step;
    const TEST: &str = "interleaved_pipeline_with_blocking_sends_tcp";
    let cfg = GptConfig { vocab_size: 64, block_size: 64, n_layer: 6, n_head: 4, n_embd: 256 };
    let batch = big_batch;
    let sums = |g: &Tensor| (g.sum(Kind::Double).double_value(&[]), g.abs().sum(Kind::Double).double_value(&[]));
    let opts = four_tcp_ranks(TEST);
    let out = spawn_with(opts, move |pg| {
        let gpt = Gpt::new(cfg, 9)?;
        let step = interleaved_step(pg, &gpt, 2, &batch(), 4, cfg.n_embd)?;
        let grads: Vec<(usize, (f64, f64))> = step.grads.iter().map(|(&k, g)| (k, sums(g))).collect();
        Ok((step.loss, grads))
    })
    .unwrap();
    let gpt = Gpt::new(cfg, 9).unwrap();
    let loss = gpt.loss(&batch());
    loss.backward();
    let want = loss.double_value(&[]);
    let want_grads: Vec<(f64, f64)> = gpt.parameters().iter().map(|p| sums(&p.grad())).collect();
    for (r, (l, grads)) in out.into_iter().enumerate() {
        assert!((l - want).abs() < 1e-5, "rank {r}: loss {l}, one process {want}");
        for (k, (sum, abs)) in grads {
            let (ws, wa) = want_grads[k];
            assert!(
                (sum - ws).abs() < 1e-4 * wa.max(1e-3) && (abs - wa).abs() < 1e-4 * wa.max(1e-3),
                "rank {r}: parameter {k}'s gradient sums to {sum} (|·| {abs}), one process's {ws} ({wa})"
            );
        }
    }
}
