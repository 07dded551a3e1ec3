//! Tensor parallelism (lesson 12): the sharded algebra, a Megatron MLP split column → row and a
//! GPT block split by heads over 2 and 4 ranks against one process, the vocab-parallel loss, the
//! whole GPT (`TpGpt`) trained like one process (also over TCP, dp × tp on a 2 × 2 mesh and as a
//! job with `--tp`), and the shapes that do not split refused.
//!
//! * The algebra, with `ndarray` (no libtorch): for Y = X·A, splitting A's columns gives Y's
//!   columns (`X·[A₁ A₂] = [X·A₁  X·A₂]`); splitting A's rows and X's columns gives partial sums
//!   (`[X₁ X₂]·[B₁; B₂] = X₁·B₁ + X₂·B₂`).
//! * The MLP: every rank builds the full weights from the same seed and keeps its slices
//!   (picotron's trick), so the run can be compared with one process's autograd on the full
//!   weights: the output and dL/dx on every rank, and the gradients of the slices gathered back,
//!   within f32 rounding (1e-5; the sums are grouped differently). Communication measured from
//!   the group's own counters: exactly one all-reduce forward and one backward, each of the
//!   (B, T, C) f32 activations — 2·B·T·C·4 bytes all-reduced per MLP.

use ndarray::{concatenate, s, Array2, Axis};
use shardlab::engine::{parallelize, DataDim, ParallelDims, Plan};
#[allow(unused_imports)]
use shardlab::model::Model;
use shardlab::prelude::*;
use shardlab::tp::{column_shard, row_shard, TpMlp};

#[test]
fn sharded_matmul_algebra_without_libtorch() {
    // Deterministic small integers: the sums are exact in f64.
    let x = Array2::from_shape_fn((3, 4), |(i, j)| (i * 4 + j) as f64 - 5.0);
    let a = Array2::from_shape_fn((4, 6), |(i, j)| ((i * 7 + j * 3) % 5) as f64 - 2.0);
    let y = x.dot(&a);
    // Column split of A (t = 2): each rank's Y columns.
    let y_cols =
        concatenate(Axis(1), &[x.dot(&a.slice(s![.., 0..3])).view(), x.dot(&a.slice(s![.., 3..6])).view()]).unwrap();
    assert_eq!(y, y_cols, "X·[A1 A2] = [X·A1 X·A2]");
    // Row split of A with X's columns split alike: partial products summed.
    let y_rows = x.slice(s![.., 0..2]).dot(&a.slice(s![0..2, ..])) + x.slice(s![.., 2..4]).dot(&a.slice(s![2..4, ..]));
    assert_eq!(y, y_rows, "[X1 X2]·[B1; B2] = X1·B1 + X2·B2");
    // The MLP's pair: column-split first layer, row-split second — no gather in between.
    let b = Array2::from_shape_fn((6, 4), |(i, j)| ((i + 2 * j) % 3) as f64 - 1.0);
    let relu = |m: Array2<f64>| m.mapv(|v| v.max(0.0)); // any elementwise function
    let whole = relu(x.dot(&a)).dot(&b);
    let parts: Array2<f64> = (0..2)
        .map(|r| relu(x.dot(&a.slice(s![.., 3 * r..3 * r + 3]))).dot(&b.slice(s![3 * r..3 * r + 3, ..])))
        .fold(Array2::zeros((3, 4)), |acc, p| acc + p);
    assert_eq!(whole, parts, "f(X·A)·B = Σ_r f(X·A_r)·B_r for an elementwise f");
}

const C: i64 = 16;
const B: i64 = 2;
const T: i64 = 5;

/// Deterministic values without libtorch's global generator (the rank threads share it).
fn wave(shape: &[i64], k: f64, scale: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * k + 0.3).sin() * scale).reshape(shape)
}

/// The full MLP (nanoGPT's shapes: c_fc (4C, C), c_proj (C, 4C)), the same on every rank.
fn full_weights() -> [Tensor; 4] {
    [wave(&[4 * C, C], 0.71, 0.3), wave(&[4 * C], 1.3, 0.1), wave(&[C, 4 * C], 0.37, 0.3), wave(&[C], 2.1, 0.1)]
}

fn inputs() -> (Tensor, Tensor) {
    (wave(&[B, T, C], 0.53, 1.0), wave(&[B, T, C], 0.91, 1.0))
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

#[test]
fn mlp_split_column_then_row_matches_one_process() {
    // One process: autograd through the whole MLP; L = Σ y ⊙ dy, so dL/dy = dy.
    let [w1, b1, w2, b2] = full_weights().map(|t| t.set_requires_grad(true));
    let (x, dy) = inputs();
    let x1 = x.copy().set_requires_grad(true);
    let y = x1.linear(&w1, Some(&b1)).gelu("none").linear(&w2, Some(&b2));
    (&y * &dy).sum(Kind::Float).backward();
    let reference: Vec<Tensor> = vec![y.detach(), x1.grad(), w1.grad(), b1.grad(), w2.grad(), b2.grad()];
    for tp in [2usize, 4] {
        let out = spawn(tp, Backend::Local, |pg| {
            let [w1, b1, w2, b2] = full_weights();
            let mut mlp = TpMlp::from_full(&w1, &b1, &w2, &b2, pg).map_err(anyhow::Error::msg)?;
            let (x, dy) = inputs();
            let before = pg.stats();
            let y = mlp.forward(pg, &x)?;
            let ([g1, gb1, g2, gb2], dx) = mlp.backward(pg, &dy)?;
            let after = pg.stats();
            let calls = after.calls(OpKind::AllReduce) - before.calls(OpKind::AllReduce);
            // Gather the slices' gradients back to full tensors (dim 0 of c_fc, dim 1 of c_proj).
            let gather = |g: &Tensor, dim: i64| -> anyhow::Result<Tensor> {
                let flat = g.transpose(0, dim).contiguous().reshape([-1]);
                let mut all = Tensor::zeros([flat.numel() as i64 * pg.world_size() as i64], (Kind::Float, Device::Cpu));
                pg.all_gather(&mut all, &flat)?;
                let mut size = g.transpose(0, dim).size();
                size[0] *= pg.world_size() as i64;
                Ok(all.reshape(size).transpose(0, dim))
            };
            let tensors =
                vec![y, dx, gather(&g1, 0)?, gather(&gb1.unsqueeze(1), 0)?.squeeze_dim(1), gather(&g2, 1)?, gb2];
            let flat: Vec<Vec<f32>> = tensors.iter().map(|t| Vec::<f32>::try_from(t.reshape([-1])).unwrap()).collect();
            Ok((flat, calls, mlp.bytes_all_reduced))
        })
        .unwrap();
        let names = ["y", "dL/dx", "c_fc.weight grad", "c_fc.bias grad", "c_proj.weight grad", "c_proj.bias grad"];
        for (rank, (flat, calls, bytes)) in out.into_iter().enumerate() {
            for ((got, want), name) in flat.iter().zip(&reference).zip(names) {
                let got = Tensor::from_slice(got).reshape(want.size());
                let d = max_diff(&got, want);
                assert!(d < 1e-5, "tp={tp} rank {rank}: {name} differs from one process by {d}");
            }
            assert_eq!(calls, 2, "tp={tp} rank {rank}: one all-reduce forward (g) and one backward (f)");
            assert_eq!(bytes, 2 * (B * T * C * 4) as u64, "tp={tp} rank {rank}: two (B, T, C) f32 all-reduces");
        }
    }
    // Shapes that do not split are refused with the reason.
    let e = column_shard(&Tensor::zeros([6, 4], (Kind::Float, Device::Cpu)), 4, 0).unwrap_err();
    assert!(e.contains("does not split into 4"), "{e}");
    assert!(row_shard(&Tensor::zeros([6, 4], (Kind::Float, Device::Cpu)), 4, 3).is_ok());
}

/// The GPT with every block parameter moved off its init (biases 0 and LayerNorm gains 1 would
/// hide a bias added t times or a gain applied to the wrong slice).
fn perturbed(cfg: GptConfig) -> Gpt {
    let gpt = Gpt::new(cfg, 3).unwrap();
    tch::no_grad(|| {
        for (i, p) in gpt.parameters().iter_mut().enumerate().skip(2).take(12) {
            let _ = p.g_add_(&wave(&p.size(), 0.1 + i as f64 * 0.37, 0.2));
        }
    });
    gpt
}

/// A whole GPT block split by heads and column → row, against the GPT's own block and libtorch's
/// autograd on one process: output, dL/dx and every parameter's gradient (the slices gathered
/// back) within 2e-5; four all-reduces of B·T·C f32 per block (two forward, two backward).
#[test]
fn gpt_block_split_by_heads_matches_the_gpt() {
    use shardlab::tp::TpBlock;
    let cfg = GptConfig { vocab_size: 32, block_size: 8, n_layer: 1, n_head: 4, n_embd: 16 };
    let gpt = perturbed(cfg);
    let (x, dy) = (wave(&[B, T, 16], 0.53, 1.0), wave(&[B, T, 16], 0.91, 1.0));
    let x1 = x.copy().set_requires_grad(true);
    let y = gpt.block(0, &x1);
    (&y * &dy).sum(Kind::Float).backward();
    let block: Vec<Tensor> = gpt.parameters().drain(2..14).collect();
    let mut reference = vec![y.detach(), x1.grad()];
    reference.extend(block.iter().map(|p| p.grad()));
    for tp in [2usize, 4] {
        let out = spawn(tp, Backend::Local, move |pg| {
            let gpt = perturbed(cfg); // every rank builds the full weights alike and keeps its slices
            let full: Vec<Tensor> = gpt.parameters()[2..14].iter().map(|p| p.detach()).collect();
            let mut b = TpBlock::from_full(&full, cfg.n_head, pg).map_err(anyhow::Error::msg)?;
            let (x, dy) = (wave(&[B, T, 16], 0.53, 1.0), wave(&[B, T, 16], 0.91, 1.0));
            let before = pg.stats().calls(OpKind::AllReduce);
            let y = b.forward(pg, &x)?;
            let (grads, dx) = b.backward(pg, &dy)?;
            let calls = pg.stats().calls(OpKind::AllReduce) - before;
            let mut all = vec![y, dx];
            all.extend(b.unshard(pg, &grads)?);
            let flat: Vec<Vec<f32>> = all.iter().map(|t| Vec::<f32>::try_from(t.reshape([-1])).unwrap()).collect();
            Ok((flat, calls, b.bytes_all_reduced))
        })
        .unwrap();
        for (rank, (flat, calls, bytes)) in out.into_iter().enumerate() {
            for (i, (got, want)) in flat.iter().zip(&reference).enumerate() {
                let got = Tensor::from_slice(got).reshape(want.size());
                let d = max_diff(&got, want);
                let what = match i {
                    0 => "y".to_string(),
                    1 => "dL/dx".to_string(),
                    k => format!("the gradient of block parameter {}", k - 2),
                };
                assert!(d < 2e-5, "tp={tp} rank {rank}: {what} differs from the GPT's block by {d}");
            }
            assert_eq!(calls, 4, "tp={tp} rank {rank}: all-reduces per block (g twice forward, f twice backward)");
            assert_eq!(bytes, 4 * (B * T * 16 * 4) as u64, "tp={tp} rank {rank}: four (B, T, C) f32 all-reduces");
        }
    }
    // Heads that do not split are refused.
    let e = spawn(3, Backend::Local, move |pg| {
        let full: Vec<Tensor> = Gpt::new(cfg, 3)?.parameters()[2..14].iter().map(|p| p.detach()).collect();
        Ok(TpBlock::from_full(&full, cfg.n_head, pg).err().unwrap_or_default())
    })
    .unwrap();
    assert!(e.iter().all(|e| e.contains("4 heads do not split over 3")), "{e:?}");
}

/// Sequence parallelism (Korthikanti et al. 2022): each rank passes only its T/t tokens through
/// the LayerNorms and residuals, all-gathering before the split matmuls and reduce-scattering
/// after them. Against the GPT's own block on one process: this rank's tokens' output and dL/dx,
/// and every parameter's gradient (the replicated ones summed over the group), within 2e-5. The
/// group's counters: 6 all-gathers (2 of them in backward, gathering the LayerNorm outputs again
/// for the weight gradients instead of keeping them), 4 reduce-scatters and 1 all-reduce (the
/// replicated parameters' gradients, 6·C floats), no other collective; the bytes sent are the
/// plain block's 4 all-reduces' plus those two all-gathers' (a ring's (t − 1)/t of B·T·C floats
/// each), plus at most twice the 6·C floats of the small all-reduce.
#[test]
fn gpt_block_with_sequence_parallelism_matches_the_gpt() {
    use shardlab::tp::TpBlock;
    const TS: i64 = 8; // tokens, split over t = 2 and 4
    let cfg = GptConfig { vocab_size: 32, block_size: TS, n_layer: 1, n_head: 4, n_embd: 16 };
    let gpt = perturbed(cfg);
    let (x, dy) = (wave(&[B, TS, 16], 0.53, 1.0), wave(&[B, TS, 16], 0.91, 1.0));
    let x1 = x.copy().set_requires_grad(true);
    let y = gpt.block(0, &x1);
    (&y * &dy).sum(Kind::Float).backward();
    let block: Vec<Tensor> = gpt.parameters().drain(2..14).collect();
    let (y_ref, dx_ref) = (y.detach(), x1.grad());
    let grads_ref: Vec<Tensor> = block.iter().map(|p| p.grad()).collect();
    for tp in [2usize, 4] {
        let out = spawn(tp, Backend::Local, move |pg| {
            let gpt = perturbed(cfg);
            let full: Vec<Tensor> = gpt.parameters()[2..14].iter().map(|p| p.detach()).collect();
            let (x, dy) = (wave(&[B, TS, 16], 0.53, 1.0), wave(&[B, TS, 16], 0.91, 1.0));
            let n = TS / tp as i64;
            let mine = |t: &Tensor| t.narrow(1, pg.rank() as i64 * n, n);
            // The plain block first, for its bytes.
            let mut plain = TpBlock::from_full(&full, cfg.n_head, pg).map_err(anyhow::Error::msg)?;
            let before = pg.stats();
            let _ = plain.forward(pg, &x)?;
            let _ = plain.backward(pg, &dy)?;
            let plain_sent = pg.stats().since(&before).bytes_sent;
            let mut b = TpBlock::from_full(&full, cfg.n_head, pg).map_err(anyhow::Error::msg)?.sequence_parallel(true);
            let before = pg.stats();
            let y = b.forward(pg, &mine(&x))?;
            let (grads, dx) = b.backward(pg, &mine(&dy))?;
            let st = pg.stats().since(&before);
            let calls = [OpKind::AllGather, OpKind::ReduceScatter, OpKind::AllReduce].map(|k| st.calls(k));
            let mut all = vec![y, dx];
            all.extend(b.unshard(pg, &grads)?);
            let flat: Vec<Vec<f32>> = all.iter().map(|t| Vec::<f32>::try_from(t.reshape([-1])).unwrap()).collect();
            Ok((flat, calls, st.collectives, st.bytes_sent, plain_sent))
        })
        .unwrap();
        let n = TS / tp as i64;
        for (rank, (flat, calls, collectives, sent, plain_sent)) in out.into_iter().enumerate() {
            let mine = |t: &Tensor| t.narrow(1, rank as i64 * n, n);
            let mut want = vec![mine(&y_ref), mine(&dx_ref)];
            want.extend(grads_ref.iter().map(|g| g.shallow_clone()));
            for (i, (got, want)) in flat.iter().zip(&want).enumerate() {
                let got = Tensor::from_slice(got).reshape(want.size());
                let d = max_diff(&got, want);
                let what = match i {
                    0 => "y (this rank's tokens)".to_string(),
                    1 => "dL/dx (this rank's tokens)".to_string(),
                    k => format!("the gradient of block parameter {}", k - 2),
                };
                assert!(d < 2e-5, "tp={tp} rank {rank}: {what} differs from the GPT's block by {d}");
            }
            assert_eq!(calls, [6, 4, 1], "tp={tp} rank {rank}: all-gathers, reduce-scatters, all-reduces");
            assert_eq!(collectives, 11, "tp={tp} rank {rank}: no other collective");
            let (small, regather) = (2 * 6 * 16 * 4, 2 * (tp as u64 - 1) * (B * TS * 16 * 4) as u64 / tp as u64);
            assert!(
                sent >= plain_sent + regather && sent <= plain_sent + regather + small,
                "tp={tp} rank {rank}: sequence parallel sent {sent} bytes, the plain block {plain_sent} (+ {regather} to gather again)"
            );
        }
    }
}

/// The vocabulary split over the group: the loss and the gradient of the logits equal libtorch's
/// cross-entropy on the full (N, V) logits, without gathering them (three all-reduces of N floats).
#[test]
fn vocab_parallel_cross_entropy_matches_the_full_loss() {
    use shardlab::tp::vocab_parallel_cross_entropy;
    let (n, v) = (10i64, 24i64);
    let logits = wave(&[n, v], 0.77, 3.0);
    // Two targets −1: ignored, as the GPT's loss ignores them.
    let targets = Tensor::from_slice(&[0i64, 5, 23, -1, 11, 6, 18, 1, -1, 9]);
    let z = logits.copy().set_requires_grad(true);
    let loss = z.cross_entropy_loss::<Tensor>(&targets, None, tch::Reduction::Mean, -1, 0.0);
    loss.backward();
    let (want_loss, want_grad) = (loss.double_value(&[]), z.grad());
    for tp in [2usize, 3, 4] {
        let out = spawn(tp, Backend::Local, move |pg| {
            let vl = v / pg.world_size() as i64;
            let logits = wave(&[n, v], 0.77, 3.0).narrow(1, pg.rank() as i64 * vl, vl);
            let targets = Tensor::from_slice(&[0i64, 5, 23, -1, 11, 6, 18, 1, -1, 9]);
            let before = pg.stats();
            let (loss, grad) = vocab_parallel_cross_entropy(pg, &logits, &targets)?;
            let sent = pg.stats().calls(OpKind::AllReduce) - before.calls(OpKind::AllReduce);
            let full = shardlab::tp::gather_dim(pg, &grad, 1)?;
            Ok((loss, Vec::<f32>::try_from(full.reshape([-1]))?, sent))
        })
        .unwrap();
        for (rank, (loss, grad, calls)) in out.into_iter().enumerate() {
            assert!(
                (loss - want_loss).abs() < 1e-5,
                "tp={tp} rank {rank}: loss {loss}, full cross-entropy {want_loss}"
            );
            let d = max_diff(&Tensor::from_slice(&grad).reshape([n, v]), &want_grad);
            assert!(d < 1e-6, "tp={tp} rank {rank}: dL/dlogits differs by {d}");
            // Three all-reduces of N numbers (max, Σexp, target logit), plus the test's gather.
            assert_eq!(calls, 3, "tp={tp} rank {rank}: all-reduces");
        }
    }
    // A target out of range on one rank: every rank fails (the bad one aborts the group).
    let out = spawn_with(SpawnOptions::new(2, Backend::Local), move |pg| {
        let logits = wave(&[n, v / 2], 0.77, 3.0);
        let t = if pg.rank() == 1 { 99i64 } else { 3 };
        let targets = Tensor::from_slice(&[t; 10]);
        Ok(vocab_parallel_cross_entropy(pg, &logits, &targets).err().map(|e| e.to_string()).unwrap_or_default())
    });
    let text = match out {
        Ok(v) => format!("{v:?}"),
        Err(e) => e.to_string(),
    };
    assert!(text.contains("ids must be in 0..24"), "{text}");
}

// ---- The whole GPT under tensor parallelism (TpGpt) ----

const GPT: GptConfig = GptConfig { vocab_size: 64, block_size: 16, n_layer: 2, n_head: 4, n_embd: 32 };
const ROWS: usize = 8;
const STEPS: u64 = 3;

/// The synthetic corpus's 13 ids spread over the whole vocabulary (id·5 + 1: 1 … 61), so that
/// every rank's slice of the embedding, the head and the loss holds some of them at t = 2 and 4;
/// a row's first targets −1 (ignored by the loss).
fn spread_corpus() -> Tokens {
    Tokens(shardlab::data::synthetic_corpus(4000, 3).0.iter().map(|t| t * 5 + 1).collect())
}

fn batch(step: u64) -> Batch {
    batch_with(step, true)
}

/// Without ignored targets, for dp × tp: averaging the replicas' means (as DDP does) is the
/// batch's mean only when every replica's rows hold as many targets.
fn batch_with(step: u64, ignored: bool) -> Batch {
    let b = DistributedSampler::new(GPT.block_size as usize, ROWS, 0, 1, 5).unwrap().batch(&spread_corpus(), step);
    if ignored {
        let _ = b.y.narrow(0, 1, 1).narrow(1, 0, 5).fill_(-1);
    }
    b
}

#[test]
fn the_test_batches_use_every_ranks_vocabulary() {
    let ids = Vec::<i64>::try_from(batch(0).x.reshape([-1])).unwrap();
    for t in [2i64, 4] {
        let per = GPT.vocab_size / t;
        for r in 0..t {
            assert!(ids.iter().any(|&i| i / per == r), "t={t}: no input id in rank {r}'s rows");
        }
    }
}

fn opt() -> AdamW {
    AdamW::new(AdamWConfig { lr: 3e-3, ..Default::default() })
}

/// One process: the GPT's own forward, libtorch's autograd, the same AdamW on whole tensors and
/// the same clipping (PyTorch's clip_grad_norm_ rule). Losses per step, the first step's
/// gradients and the final parameters.
fn one_process() -> (Vec<f64>, Vec<Tensor>, Vec<Tensor>) {
    one_process_with(true)
}

fn one_process_with(ignored: bool) -> (Vec<f64>, Vec<Tensor>, Vec<Tensor>) {
    use shardlab::optim::{clip_coef, global_norm, Decay};
    let gpt = Gpt::new(GPT, 9).unwrap();
    let mut o = opt();
    let (mut losses, mut first) = (vec![], vec![]);
    for step in 0..STEPS {
        let params = gpt.parameters();
        shardlab::model::zero_grads(&params);
        let loss = gpt.loss(&batch_with(step, ignored));
        loss.backward();
        let grads: Vec<Tensor> = params.iter().map(|p| p.grad().copy()).collect();
        if step == 0 {
            first = grads.iter().map(|g| g.copy()).collect();
        }
        let k = clip_coef(global_norm(&grads), 1.0);
        let grads: Vec<Tensor> = grads.iter().map(|g| g * k).collect();
        let decay: Vec<Decay> = params.iter().map(|p| Decay::for_shape(&p.size())).collect();
        o.step(3e-3, &params, &grads, &decay).unwrap();
        losses.push(loss.double_value(&[]));
    }
    (losses, first, gpt.parameters().iter().map(|p| p.detach().copy()).collect())
}

type TpOut = (Vec<f64>, Vec<Vec<f32>>, Vec<Vec<f32>>, [u64; 4], u64, f64);

/// `STEPS` steps of TpGpt over a tp group: losses, the first step's gradients and the final
/// parameters (gathered back to full), the first step's all-reduces, all-gathers,
/// reduce-scatters and other collectives, and the parameter bytes this rank holds.
fn tp_run(pg: &ProcessGroup) -> anyhow::Result<TpOut> {
    tp_run_with(pg, false)
}

fn tp_run_with(pg: &ProcessGroup, sequence_parallel: bool) -> anyhow::Result<TpOut> {
    // The first step's forward and backward, on TpGpt itself: its gradients gathered back and its calls.
    let mut m = shardlab::tp::TpGpt::from_gpt(&Gpt::new(GPT, 9)?, pg)
        .map_err(anyhow::Error::msg)?
        .with_sequence_parallel(sequence_parallel);
    let step0 = m.forward_backward(pg, &batch(0))?;
    let first = m.unshard(pg, &step0.grads)?;
    let c = |k| step0.comm.calls(k);
    let (ar, ag, rs) = (c(OpKind::AllReduce), c(OpKind::AllGather), c(OpKind::ReduceScatter));
    let calls = [ar, ag, rs, step0.comm.collectives - ar - ag - rs];
    // Training: the engine over a 1 × 1 × t layout (the one optimizer step).
    let dims = ParallelDims { pp: 1, dp: 1, tp: pg.world_size() };
    let plan = Plan { sequence_parallel, ..Plan::new(dims, DataDim::Replicate) };
    let mut e = parallelize(pg, &plan, &GPT, &|_| Gpt::new(GPT, 9))?;
    let mut o = opt();
    let (mut losses, mut norm0) = (vec![], 0.0);
    for step in 0..STEPS {
        let out = e.train_step(&batch(step), &mut o, 3e-3, Some(1.0))?;
        losses.push(out.loss);
        if step == 0 {
            norm0 = out.norm;
        }
    }
    let params = e.full_parameters()?.expect("every tp rank of the first replica gathers the whole model");
    let flat = |v: &[Tensor]| v.iter().map(|t| Vec::<f32>::try_from(t.reshape([-1])).unwrap()).collect::<Vec<_>>();
    Ok((losses, flat(&first), flat(&params), calls, e.memory(&o).params, norm0))
}

fn check_tp(tp: usize, out: Vec<TpOut>) {
    check_tp_with(tp, out, false)
}

fn check_tp_with(tp: usize, out: Vec<TpOut>, sequence_parallel: bool) {
    let (losses, first, fin) = one_process();
    let full_bytes = shardlab::memory::held_bytes(Gpt::new(GPT, 9).unwrap().parameters().iter());
    let nl = GPT.n_layer as u64;
    // The first step's global norm (clipping's input), as PyTorch's clip_grad_norm_ on one process.
    let norm = shardlab::optim::global_norm(&first);
    for (rank, (l, g, p, calls, bytes, norm0)) in out.into_iter().enumerate() {
        assert!(
            (norm0 - norm).abs() < 1e-5 * norm.max(1.0),
            "tp={tp} rank {rank}: the global norm {norm0}, one process's {norm}"
        );
        for (s, (a, b)) in l.iter().zip(&losses).enumerate() {
            assert!((a - b).abs() < 1e-5, "tp={tp} rank {rank} step {s}: loss {a}, one process {b}");
        }
        for (i, (got, want)) in g.iter().zip(&first).enumerate() {
            let d = max_diff(&Tensor::from_slice(got).reshape(want.size()), want);
            assert!(d < 2e-5, "tp={tp} rank {rank}: parameter {i}'s gradient differs from one process's by {d}");
        }
        for (i, (got, want)) in p.iter().zip(&fin).enumerate() {
            let d = max_diff(&Tensor::from_slice(got).reshape(want.size()), want);
            assert!(d < 1e-4, "tp={tp} rank {rank}: parameter {i} after {STEPS} steps differs by {d}");
        }
        let want = if sequence_parallel {
            // All-reduces: 1 per block (its replicated gradients), 3 (loss), 1 (ln_f's gradients);
            // all-gathers: 6 per block (2 in backward to gather the LayerNorm outputs again), 1
            // each for the head and the embedding; reduce-scatters: 4 per block, 1 + 1.
            [nl + 4, 6 * nl + 2, 4 * nl + 2, 0]
        } else {
            // 1 (embedding) + 4 per block + 1 (head) + 3 (loss) all-reduces, and nothing else.
            [4 * nl + 5, 0, 0, 0]
        };
        assert_eq!(
            calls, want,
            "tp={tp} sp={sequence_parallel} rank {rank}: all-reduces, all-gathers, reduce-scatters, others"
        );
        // The matrices and the embedding are split; what is replicated (LayerNorms, wpe, biases
        // of the row-parallel layers) is small: a rank holds well under 1/t + 10% of the model.
        assert!(
            bytes < full_bytes / tp as u64 + full_bytes / 10 && bytes > full_bytes / tp as u64,
            "tp={tp} rank {rank}: holds {bytes} parameter bytes of {full_bytes}"
        );
    }
}

/// A GPT trained with tensor parallelism equals one process's training: the same losses
/// (1e-5), the first step's gradients (2e-5) and the parameters after 3 AdamW steps with
/// clipping (1e-4: Adam divides by √v, which magnifies f32 rounding where a gradient is near 0).
#[test]
fn tp_gpt_trains_like_one_process_local() {
    for tp in [2usize, 4] {
        check_tp(tp, spawn(tp, Backend::Local, tp_run).unwrap());
    }
}

/// The same with sequence parallelism: the same losses, gradients and parameters as one process
/// (same tolerances), with the all-reduces of activations replaced by all-gathers and
/// reduce-scatters (counted); a sequence that does not split is refused on every rank.
#[test]
fn tp_gpt_with_sequence_parallelism_trains_like_one_process() {
    for tp in [2usize, 4] {
        check_tp_with(tp, spawn(tp, Backend::Local, |pg| tp_run_with(pg, true)).unwrap(), true);
    }
    let e = spawn(2, Backend::Local, |pg| {
        let mut m = shardlab::tp::TpGpt::from_gpt(&Gpt::new(GPT, 9)?, pg)
            .map_err(anyhow::Error::msg)?
            .with_sequence_parallel(true);
        let b = batch(0);
        let odd = Batch { x: b.x.narrow(1, 0, 5), y: b.y.narrow(1, 0, 5) };
        Ok(m.forward_backward(pg, &odd).err().map(|e| e.to_string()).unwrap_or_default())
    })
    .unwrap();
    assert!(e.iter().all(|e| e.contains("5 tokens do not split over 2 ranks")), "{e:?}");
}

#[test]
fn tp_gpt_trains_like_one_process_tcp() {
    let name = "tp_gpt_trains_like_one_process_tcp";
    let o = SpawnOptions::new(2, Backend::Tcp)
        .child_args(["--exact", name, "--nocapture", "--test-threads=1"].map(String::from).to_vec());
    check_tp(2, spawn_with(o, tp_run).unwrap());
}

/// dp × tp on a 2 × 2 mesh: each data-parallel replica runs its half of the batch with its tp
/// pair, gradients averaged over dp — the same losses as one process on the whole batch.
#[test]
fn dp_times_tp_on_a_2x2_mesh_matches_one_process() {
    let (losses, _, fin) = one_process_with(false);
    let out = spawn(4, Backend::Local, |pg| {
        let dims = ParallelDims { pp: 1, dp: 2, tp: 2 };
        let plan = Plan::new(dims, DataDim::Replicate);
        let mut e = parallelize(pg, &plan, &GPT, &|_| Gpt::new(GPT, 9))?;
        let mut o = opt();
        let half = (ROWS / 2) as i64;
        let d = e.mesh().coord("dp") as i64;
        let mut l = vec![];
        for step in 0..STEPS {
            let b = batch_with(step, false);
            l.push(e.train_step(&b.rows(d * half, (d + 1) * half), &mut o, 3e-3, Some(1.0))?.loss);
        }
        // The first replica's ranks gather the whole model; the second's weights are checked
        // through its losses (they train the same model).
        let p = e.full_parameters()?.unwrap_or_default();
        Ok((l, p.iter().map(|t| Vec::<f32>::try_from(t.reshape([-1])).unwrap()).collect::<Vec<_>>()))
    })
    .unwrap();
    for (rank, (l, p)) in out.into_iter().enumerate() {
        for (s, (a, b)) in l.iter().zip(&losses).enumerate() {
            assert!((a - b).abs() < 1e-5, "rank {rank} step {s}: loss {a}, one process {b}");
        }
        for (i, (got, want)) in p.iter().zip(&fin).enumerate() {
            let d = max_diff(&Tensor::from_slice(got).reshape(want.size()), want);
            assert!(d < 1e-4, "rank {rank}: parameter {i} after {STEPS} steps differs by {d}");
        }
    }
}

/// A vocabulary or a head count that does not divide by t: refused on every rank, before any
/// rank computes (each rank checks the same shape against the same t).
#[test]
fn tp_gpt_refuses_shapes_that_do_not_split() {
    let odd_vocab = GptConfig { vocab_size: 63, ..GPT };
    let e = spawn(2, Backend::Local, move |pg| {
        Ok(shardlab::tp::TpGpt::from_gpt(&Gpt::new(odd_vocab, 9)?, pg).err().unwrap_or_default())
    })
    .unwrap();
    assert!(e.iter().all(|e| e.contains("vocabulary of 63 does not split over 2")), "{e:?}");
    let e = spawn(3, Backend::Local, move |pg| {
        let cfg = GptConfig { vocab_size: 66, ..GPT };
        Ok(shardlab::tp::TpGpt::from_gpt(&Gpt::new(cfg, 9)?, pg).err().unwrap_or_default())
    })
    .unwrap();
    assert!(e.iter().all(|e| e.contains("4 heads do not split over 3")), "{e:?}");
}

/// `train --tp`: a job on 4 ranks as dp 2 × tp 2 trains on the same global batch as DDP on 4
/// ranks, to the same losses (1e-5); a head count
/// that does not split and a --tp that does not divide the world are refused with the reason.
#[test]
fn a_job_with_tp_trains_like_ddp() {
    use shardlab::job::{DataSource, GptJob};
    // Ids over the whole vocabulary of 64 (each tp rank's slice is used).
    let file = std::env::temp_dir().join(format!("shardlab-tp-job-{}.bin", std::process::id()));
    spread_corpus().write(&file).unwrap();
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
    let fit_sp = |tp: usize, strategy: Strategy, sequence_parallel: bool| {
        let s = ScalingConfig {
            num_workers: 4,
            strategy,
            tensor_parallel: tp,
            sequence_parallel,
            ..ScalingConfig::default()
        };
        job.fit(s, false, false)
    };
    let fit = |tp: usize, strategy: Strategy| fit_sp(tp, strategy, false);
    let ddp = fit(1, Strategy::Ddp).unwrap();
    let tp = fit(2, Strategy::Ddp).unwrap();
    assert_eq!(tp.strategy, "ddp2×tp2");
    assert!(tp.bytes_sent_per_step > 0.0, "the bytes of the tp and dp groups are counted");
    for (s, (a, b)) in tp.losses.iter().zip(&ddp.losses).enumerate() {
        assert!((a - b).abs() < 1e-5, "step {s}: dp 2 × tp 2 loss {a}, DDP on 4 ranks {b}");
    }
    let sp = fit_sp(2, Strategy::Ddp, true).unwrap();
    assert_eq!(sp.strategy, "ddp2×tp2+sp");
    for (s, (a, b)) in sp.losses.iter().zip(&ddp.losses).enumerate() {
        assert!((a - b).abs() < 1e-5, "step {s}: dp 2 × tp 2 with sequence parallelism: loss {a}, DDP on 4 ranks {b}");
    }
    assert!(
        tp.memory.params < ddp.memory.params,
        "a tp rank holds {} parameter bytes, a DDP rank {}",
        tp.memory.params,
        ddp.memory.params
    );
    let e = format!("{:#}", fit(4, Strategy::Ddp).err().expect("2 heads over 4 ranks"));
    assert!(e.contains("2 heads do not split over 4"), "{e}");
    let e = format!("{:#}", fit(3, Strategy::Ddp).err().expect("3 does not divide 4"));
    assert!(e.contains("does not divide the world of 4"), "{e}");
    let _ = std::fs::remove_file(&file);
}

/// Activation checkpointing of tensor-parallel blocks (`TpGpt::recompute_blocks`): each block's
/// forward runs again before its backward, with its two all-reduces (counted by the group: 2 more
/// per block), and the loss and every gradient are bitwise those of the step that keeps the
/// blocks' graphs.
#[test]
fn tp_recompute_repeats_each_blocks_forward_and_changes_no_bit() {
    let out = spawn(2, Backend::Local, |pg| {
        let mut res = Vec::new();
        for recompute in [false, true] {
            let mut m = shardlab::tp::TpGpt::from_gpt(&Gpt::new(GPT, 9)?, pg)
                .map_err(anyhow::Error::msg)?
                .recompute_blocks(|_| recompute);
            let st = m.forward_backward(pg, &batch(0))?;
            let grads: Vec<Vec<f32>> =
                st.grads.iter().map(|g| Vec::<f32>::try_from(g.reshape([-1])).unwrap()).collect();
            res.push((st.loss, grads, st.comm.calls(OpKind::AllReduce)));
        }
        Ok(res)
    })
    .unwrap();
    let nl = GPT.n_layer as u64;
    for (r, res) in out.into_iter().enumerate() {
        let ((l0, g0, c0), (l1, g1, c1)) = (&res[0], &res[1]);
        assert_eq!(l0.to_bits(), l1.to_bits(), "rank {r}: the loss changed with recompute");
        assert_eq!(g0, g1, "rank {r}: a gradient changed with recompute");
        assert_eq!((*c0, *c1), (4 * nl + 5, 6 * nl + 5), "rank {r}: all-reduces without and with recompute");
    }
}

/// bf16 (autocast) under tensor parallelism, gradient by gradient, against one process's GPT in
/// bf16. Over a group of 1 the tensor-parallel code runs the same casts and matmuls as the one
/// process: every gradient is bitwise the same — except the row-parallel layers' output biases,
/// which `TpBlock` adds after the sum of the partial outputs, in fp32, where the one process adds
/// them inside its bf16 linear (their gradients are summed in fp32 here, in bf16 there: closer to
/// fp32's). A matmul left in fp32 anywhere (the head, say) would show as a difference. With and
/// without sequence parallelism (its hand-written c_attn and c_fc weight gradients). Over 2 ranks
/// the partial products round before their sum: each gradient is about as far from the one
/// process's bf16 one as fp32's is (measured: at most 0.95 of it; bound 1.5). Every gradient is
/// fp32.
#[test]
fn tp_gpt_in_bf16_gives_one_process_bf16_gradients() {
    use shardlab::tp::TpGpt;
    let grads_of = |p: Precision| -> Vec<Vec<f32>> {
        let gpt = Gpt::new(GPT, 9).unwrap().with_precision(p);
        let params = gpt.parameters();
        shardlab::model::zero_grads(&params);
        gpt.loss(&batch(0)).backward();
        params.iter().map(|p| Vec::<f32>::try_from(p.grad().reshape([-1])).unwrap()).collect()
    };
    let (g16, g32) = (grads_of(Precision::Bf16), grads_of(Precision::Fp32));
    let dist = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>().sqrt();
    let names: Vec<String> = GPT.param_shapes().into_iter().map(|(n, _)| n).collect();
    let row_bias = |n: &str| n.ends_with("attn.c_proj.bias") || n.ends_with("mlp.c_proj.bias");
    for (t, sp) in [(1, false), (1, true), (2, false), (2, true)] {
        let out = spawn(t, Backend::Local, move |pg| {
            let bf16 = Gpt::new(GPT, 9)?.with_precision(Precision::Bf16);
            let mut m = TpGpt::from_gpt(&bf16, pg).map_err(anyhow::Error::msg)?.with_sequence_parallel(sp);
            let st = m.forward_backward(pg, &batch(0))?;
            let fp32 = st.grads.iter().all(|g| g.kind() == tch::Kind::Float);
            let full = m.unshard(pg, &st.grads)?;
            Ok((fp32, full.iter().map(|t| Vec::<f32>::try_from(t.reshape([-1])).unwrap()).collect::<Vec<_>>()))
        })
        .unwrap();
        let (fp32, full) = &out[0];
        assert!(fp32, "tp {t}, sp {sp}: the gradients of fp32 parameters are fp32");
        for (k, ((a, b16), b32)) in full.iter().zip(&g16).zip(&g32).enumerate() {
            let (d16, d32) = (dist(a, b16), dist(b32, b16));
            let n = &names[k];
            if t == 1 && !row_bias(n) {
                assert!(a == b16, "tp 1, sp {sp}: {n} is {d16:.1e} from one process's bf16 gradient, not bitwise it");
            } else {
                assert!(
                    d16 < d32,
                    "tp {t}, sp {sp}: {n}: {d16:.1e} from one process's bf16 gradient, fp32's {d32:.1e}"
                );
            }
        }
    }
}
