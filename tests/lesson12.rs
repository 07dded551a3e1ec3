//! Grader for lesson 12 (tensor parallelism).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/12_tensor_parallel/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 12` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong.
//!
//! References: the linear layers against a plain f64 product written with `ndarray` (no libtorch,
//! so nothing of the code under test is reused); the MLP and the loss against libtorch's autograd
//! and `cross_entropy` on one process with the whole weights. Communication is read from the
//! group's own counters.

#[path = "../lessons/12_tensor_parallel/exercise.rs"]
mod exercise_code;
#[path = "../solutions/12_tensor_parallel.rs"]
mod solution_code;

use ndarray::Array2;
use shardlab::prelude::*;

shardlab::graders! {
    lesson: "12", exercise_file: "lessons/12_tensor_parallel/exercise.rs";

    /// shardlab's own copies of what each exercise builds (exercise K: `TWINS[K - 1]`): an exercise
    /// that names one is refused ("write it yourself").
    const TWINS: &[&[&str]] = &[&["tp::column_shard", "tp::row_shard", "shardlab::tp", "TpMlp", "TpBlock"], &["shardlab::tp", "tp::row_shard", "tp::column_shard", "TpMlp", "TpBlock"], &["shardlab::tp", "tp::row_shard", "tp::column_shard", "TpMlp", "TpBlock", "TpGpt"], &["shardlab::tp", "TpGpt", "tp::vocab_parallel_cross_entropy"]];

    /// Deterministic values (sin waves: no shared random generator between rank threads).
    fn wave(shape: &[i64], k: f64, scale: f64) -> Tensor {
        let n: i64 = shape.iter().product();
        ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * k + 0.3).sin() * scale).reshape(shape)
    }
    fn nd(t: &Tensor) -> Array2<f64> {
        let (r, c) = t.size2().unwrap();
        let v: Vec<f64> = Vec::<f64>::try_from(t.to_kind(Kind::Double).reshape([-1])).unwrap();
        Array2::from_shape_vec((r as usize, c as usize), v).unwrap()
    }
    /// y = x·wᵀ + b in f64 with ndarray: the reference for exercises 1 and 2.
    fn linear_f64(x: &Tensor, w: &Tensor, b: &Tensor) -> Array2<f64> {
        let bias: Vec<f64> = Vec::<f64>::try_from(b.to_kind(Kind::Double)).unwrap();
        let mut y = nd(x).dot(&nd(w).t());
        for mut row in y.rows_mut() {
            for (v, b) in row.iter_mut().zip(&bias) {
                *v += b;
            }
        }
        y
    }
    fn worst(got: &Tensor, want: &Array2<f64>) -> f64 {
        let g = nd(got);
        assert_eq!(g.dim(), want.dim(), "shape {:?}, expected {:?}", g.dim(), want.dim());
        g.iter().zip(want.iter()).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max)
    }
    fn max_diff(a: &Tensor, b: &Tensor, what: &str) -> f64 {
        assert_eq!(a.size(), b.size(), "{what}: shape {:?}, expected {:?}", a.size(), b.size());
        (a - b).abs().max().double_value(&[])
    }

    #[test]
    fn ex1_column_parallel_pieces_are_the_columns_of_y() {
        shardlab::grading::refuse_twins(GRADER, 1, TWINS[0]);
        let (n, i, o) = (5i64, 8i64, 12i64);
        let (x, w, b) = (wave(&[n, i], 0.53, 1.0), wave(&[o, i], 0.71, 0.5), wave(&[o], 1.3, 0.5));
        let want = linear_f64(&x, &w, &b);
        for tp in [1usize, 2, 3, 4, 6] {
            let k = o / tp as i64;
            for rank in 0..tp {
                let y = column_parallel_linear(&x, &w, &b, tp, rank);
                assert_eq!(y.size(), vec![n, k], "tp={tp} rank {rank}: y's shape (N, out/t)");
                let mine = want.slice(ndarray::s![.., rank * k as usize..(rank + 1) * k as usize]).to_owned();
                let d = worst(&y, &mine);
                assert!(d < 1e-5, "tp={tp} rank {rank}: y's columns {}.. differ from x·wᵀ + b by {d} (rows of w and of b)", rank * k as usize);
            }
        }
    }

    #[test]
    fn ex2_row_parallel_sums_partial_products_and_adds_the_bias_once() {
        shardlab::grading::refuse_twins(GRADER, 2, TWINS[1]);
        let (n, i, o) = (5i64, 12i64, 6i64);
        for tp in [2usize, 3, 4, 1] {
            let out = spawn(tp, Backend::Local, move |pg| {
                let (x, w, b) = (wave(&[n, i], 0.53, 1.0), wave(&[o, i], 0.71, 0.5), wave(&[o], 1.3, 0.5));
                let k = i / pg.world_size() as i64;
                let x_part = x.narrow(1, pg.rank() as i64 * k, k);
                let before = pg.stats();
                let y = row_parallel_linear(pg, &x_part, &w, &b)?;
                let c = pg.stats().since(&before);
                Ok((Vec::<f32>::try_from(y.reshape([-1]))?, y.size(), c.calls(OpKind::AllReduce), c.collectives, c.p2p))
            })
            .unwrap_or_else(|e| panic!("tp={tp}: {e}"));
            let (x, w, b) = (wave(&[n, i], 0.53, 1.0), wave(&[o, i], 0.71, 0.5), wave(&[o], 1.3, 0.5));
            let want = linear_f64(&x, &w, &b);
            for (rank, (y, size, ar, coll, p2p)) in out.into_iter().enumerate() {
                assert_eq!(size, vec![n, o], "tp={tp} rank {rank}: y is the whole (N, out) on every rank");
                let d = worst(&Tensor::from_slice(&y).reshape([n, o]), &want);
                assert!(d < 1e-5, "tp={tp} rank {rank}: y differs from x·wᵀ + b by {d} (the partial products summed, the bias added once)");
                assert!(ar == 1 && coll == 1 && p2p == 0, "tp={tp} rank {rank}: one all-reduce and nothing else, got {ar} all-reduces, {coll} collectives, {p2p} sends/recvs");
            }
        }
    }

    #[test]
    fn ex3_tp_mlp_matches_one_process_with_two_all_reduces() {
        shardlab::grading::refuse_twins(GRADER, 3, TWINS[2]);
        let (n, c) = (6i64, 8i64);
        let weights = move || [wave(&[4 * c, c], 0.71, 0.3), wave(&[4 * c], 1.3, 0.1), wave(&[c, 4 * c], 0.37, 0.3), wave(&[c], 2.1, 0.1)];
        let inputs = move || (wave(&[n, c], 0.53, 1.0), wave(&[n, c], 0.91, 1.0));
        // One process: libtorch's autograd through the whole MLP; L = Σ y ⊙ dy, so dL/dy = dy.
        let [w1, b1, w2, b2] = weights().map(|t| t.set_requires_grad(true));
        let (x, dy) = inputs();
        let x1 = x.copy().set_requires_grad(true);
        let y = x1.linear(&w1, Some(&b1)).gelu("none").linear(&w2, Some(&b2));
        (&y * &dy).sum(Kind::Float).backward();
        let (y, dx, g) = (y.detach(), x1.grad(), [w1.grad(), b1.grad(), w2.grad(), b2.grad()]);
        for tp in [2usize, 4, 1] {
            let out = spawn(tp, Backend::Local, move |pg| {
                let [w1, b1, w2, b2] = weights();
                let (x, dy) = inputs();
                let before = pg.stats();
                let (y, dx, grads) = tp_mlp(pg, &x, &dy, &w1, &b1, &w2, &b2)?;
                let c = pg.stats().since(&before);
                let flat = |t: &Tensor| (Vec::<f32>::try_from(t.reshape([-1])).unwrap(), t.size());
                Ok((flat(&y), flat(&dx), grads.iter().map(flat).collect::<Vec<_>>(), c.calls(OpKind::AllReduce), c.collectives, c.bytes_sent))
            })
            .unwrap_or_else(|e| panic!("tp={tp}: {e}"));
            let k = 4 * c / tp as i64;
            for (r, (gy, gdx, grads, ar, coll, _sent)) in out.into_iter().enumerate() {
                let t = |(v, s): &(Vec<f32>, Vec<i64>)| Tensor::from_slice(v).reshape(s.as_slice());
                let d = max_diff(&t(&gy), &y, &format!("tp={tp} rank {r}: y"));
                assert!(d < 1e-5, "tp={tp} rank {r}: y differs from one process by {d} (g: all-reduce the partial outputs, the bias once; the GELU is exact, gelu(\"none\"))");
                let d = max_diff(&t(&gdx), &dx, &format!("tp={tp} rank {r}: dL/dx"));
                assert!(d < 1e-5, "tp={tp} rank {r}: dL/dx differs from one process by {d} (f backward: all-reduce the partial dx)");
                assert_eq!(grads.len(), 4, "tp={tp} rank {r}: four gradients");
                let want = [g[0].narrow(0, r as i64 * k, k), g[1].narrow(0, r as i64 * k, k), g[2].narrow(1, r as i64 * k, k), g[3].shallow_clone()];
                let names = ["c_fc.weight's rows", "c_fc.bias's rows", "c_proj.weight's columns", "c_proj.bias"];
                for ((got, want), name) in grads.iter().zip(&want).zip(names) {
                    let d = max_diff(&t(got), want, &format!("tp={tp} rank {r}: the gradient of {name}"));
                    assert!(d < 1e-5, "tp={tp} rank {r}: the gradient of {name} differs from one process's by {d}");
                }
                assert!(ar == 2 && coll == 2, "tp={tp} rank {r}: exactly two all-reduces (g forward, f backward) and no other collective, got {ar} all-reduces of {coll} collectives");
            }
        }
    }

    #[test]
    fn ex4_vocab_parallel_loss_without_gathering_the_logits() {
        shardlab::grading::refuse_twins(GRADER, 4, TWINS[3]);
        let (n, v) = (10i64, 48i64);
        let targets = || Tensor::from_slice(&[0i64, 5, 47, -1, 11, 30, 18, 1, -1, 24]);
        // Row 2 is shifted by +100: exp(100) overflows f32, so only a loss that subtracts the
        // (all-reduced) row max before exp gets it right, as libtorch's does.
        let logits = || {
            let z = wave(&[n, v], 0.77, 3.0);
            let _ = z.narrow(0, 2, 1).g_add_scalar_(100.0);
            z
        };
        let z = logits().set_requires_grad(true);
        // Two targets −1: ignored, as the GPT's loss (and PyTorch's ignore_index=−1) ignores them.
        let loss = z.cross_entropy_loss::<Tensor>(&targets(), None, tch::Reduction::Mean, -1, 0.0);
        loss.backward();
        let (want_loss, want_grad) = (loss.double_value(&[]), z.grad());
        for tp in [1usize, 2, 3, 4] {
            let out = spawn(tp, Backend::Local, move |pg| {
                let vl = v / pg.world_size() as i64;
                let mine = logits().narrow(1, pg.rank() as i64 * vl, vl);
                let before = pg.stats();
                let (loss, grad) = vocab_parallel_cross_entropy(pg, &mine, &targets())?;
                let c = pg.stats().since(&before);
                Ok((loss, Vec::<f32>::try_from(grad.reshape([-1]))?, grad.size(), c.calls(OpKind::AllReduce), c.collectives, c.bytes_sent))
            })
            .unwrap_or_else(|e| panic!("tp={tp}: {e}"));
            let vl = v / tp as i64;
            for (r, (loss, grad, size, ar, coll, sent)) in out.into_iter().enumerate() {
                assert!((loss - want_loss).abs() < 1e-5, "tp={tp} rank {r}: loss {loss}, the full cross-entropy is {want_loss} (the mean over targets that are not −1; subtract the all-reduced row max before exp)");
                assert_eq!(size, vec![n, vl], "tp={tp} rank {r}: dL/dlogits is this rank's (N, V/t)");
                let d = max_diff(&Tensor::from_slice(&grad).reshape([n, vl]), &want_grad.narrow(1, r as i64 * vl, vl), &format!("tp={tp} rank {r}: dL/dlogits"));
                assert!(d < 1e-6, "tp={tp} rank {r}: dL/dlogits differs from the full cross-entropy's by {d} (softmax − one-hot on your columns, ÷ the count of targets ≠ −1, zero rows where the target is −1)");
                assert!(ar == coll, "tp={tp} rank {r}: all-reduces only (no all-gather of the logits), got {coll} collectives of which {ar} all-reduces");
                // All-reducing a few numbers per row, not the (N, V/t) logits: far less than the logits.
                let logits_bytes = (n * vl * 4) as u64;
                assert!(tp == 1 || sent < logits_bytes / 2, "tp={tp} rank {r}: sent {sent} bytes — a rank's logits are {logits_bytes}; all-reduce only one number per row at a time");
            }
        }
    }
}
