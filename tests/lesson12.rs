//! Grader for lesson 12 (tensor parallelism).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/12_tensor_parallel/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 12` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong.
//!
//! References: the linear layers against a plain f64 product written with `ndarray` (no libtorch,
//! so nothing of the code under test is reused); the MLP and the loss against libtorch's autograd
//! and `cross_entropy` on one process with the whole weights; attention against nanoGPT's written
//! out here (and checked against libtorch's `scaled_dot_product_attention`). Communication is read
//! from the group's own counters.

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
    const TWINS: &[&[&str]] = &[&["tp::column_shard", "tp::row_shard", "shardlab::tp", "TpMlp", "TpBlock"], &["shardlab::tp", "tp::row_shard", "tp::column_shard", "TpMlp", "TpBlock"], &["shardlab::tp", "tp::row_shard", "tp::column_shard", "TpMlp", "TpBlock", "TpGpt"], &["shardlab::tp", "TpGpt", "tp::vocab_parallel_cross_entropy"], &["shardlab::tp", "TpBlock", "TpGpt", "tp::column_shard", "tp::row_shard", "tp::shard"]];

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
        // A NaN is the largest difference there is (f64::max would skip it).
        g.iter().zip(want.iter()).map(|(a, b)| (a - b).abs()).fold(0.0, |m, d| if d.is_nan() { f64::INFINITY } else { m.max(d) })
    }
    fn max_diff(a: &Tensor, b: &Tensor, what: &str) -> f64 {
        assert_eq!(a.size(), b.size(), "{what}: shape {:?}, expected {:?}", a.size(), b.size());
        let d = (a - b).abs().max().double_value(&[]);
        if d.is_nan() { f64::INFINITY } else { d }
    }
    /// Deterministic values with no low-rank structure (a sin wave over the flat index is a rank-2
    /// matrix): the fractional part of a scaled sine, in [−0.5, 0.5) · scale.
    fn noise(shape: &[i64], k: f64, scale: f64) -> Tensor {
        let n: i64 = shape.iter().product();
        (((Tensor::arange(n, (Kind::Double, Device::Cpu)) * k + 0.3).sin() * 43758.5453).frac() - 0.5)
            .to_kind(Kind::Float)
            .reshape(shape)
            * scale
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
                let y = Tensor::from_slice(&y).reshape([n, o]);
                let d = worst(&y, &want);
                if d >= 1e-5 {
                    // Name the two usual mistakes: the bias added by every rank, the partials not summed.
                    let k = i / tp as i64;
                    let bias: Vec<f64> = Vec::<f64>::try_from(b.to_kind(Kind::Double)).unwrap();
                    let mut t_biases = want.clone();
                    for mut row in t_biases.rows_mut() {
                        row.iter_mut().zip(&bias).for_each(|(v, b)| *v += (tp as f64 - 1.0) * b);
                    }
                    let own = linear_f64(&x.narrow(1, rank as i64 * k, k), &w.narrow(1, rank as i64 * k, k), &b);
                    let why = if worst(&y, &t_biases) < 1e-5 {
                        format!("the bias was added {tp} times: every rank added it before the sum; add it once, after the all-reduce")
                    } else if worst(&y, &own) < 1e-5 {
                        "this is the rank's own partial product plus the bias: the partial products were not summed over the group".to_string()
                    } else {
                        "the partial products summed, the bias added once".to_string()
                    };
                    panic!("tp={tp} rank {rank}: y differs from x·wᵀ + b by {d}: {why}");
                }
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
                // y is the group's sum: on autograd's tape it would still be this rank's partial
                // (the all-reduce wrote behind autograd's back), and a backward through it would
                // miss the other ranks' contributions.
                anyhow::ensure!(
                    !y.requires_grad(),
                    "rank {}: the returned y is still on the local graph (it requires grad): all-reduce a detached \
                     copy of the partial output, not the partial itself (README, \"f and g\", step 3)",
                    pg.rank()
                );
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

    /// Attention over the heads of `qkv` (B, T, 3·width: q, then k, then v, each `width` wide in
    /// heads of `hs`): scores ÷ `scale`, the future masked to −∞ when `causal`, softmax, the heads
    /// back together: (B, T, width).
    fn heads_attention(qkv: &Tensor, hs: i64, scale: f64, causal: bool) -> Tensor {
        let (b, t, three) = qkv.size3().unwrap();
        let width = three / 3;
        let head = |i: i64| qkv.narrow(2, i * width, width).reshape([b, t, width / hs, hs]).transpose(1, 2);
        let mut att = head(0).matmul(&head(1).transpose(-2, -1)) / scale;
        if causal {
            let future = Tensor::ones([t, t], (Kind::Bool, Device::Cpu)).triu(1);
            att = att.masked_fill(&future, f64::NEG_INFINITY);
        }
        att.softmax(-1, Kind::Float).matmul(&head(2)).transpose(1, 2).reshape([b, t, width])
    }

    /// One process's causal self-attention (nanoGPT's `CausalSelfAttention`, written out here):
    /// q, k, v from the whole c_attn, `n_head` heads, scores ÷ `scale` (√(head size) when right),
    /// future positions masked when `causal`, then the whole c_proj.
    fn attention_ref(x: &Tensor, w: &[Tensor; 4], n_head: i64, scale: f64, causal: bool) -> Tensor {
        let c = x.size()[2];
        heads_attention(&x.linear(&w[0], Some(&w[1])), c / n_head, scale, causal).linear(&w[2], Some(&w[3]))
    }

    /// Rank `r` of `tp`'s part of c_proj's output, without the bias: its heads' rows of each of q, k
    /// and v, or with `fused` rows r·3C/t … of the whole c_attn taken as its q, k and v.
    fn rank_partial(x: &Tensor, w: &[Tensor; 4], n_head: i64, tp: i64, r: i64, fused: bool) -> Tensor {
        let c = x.size()[2];
        let (hs, cols) = (c / n_head, c / tp);
        let (wq, bq) = if fused {
            // The mistake the README warns about: rows r·3C/t … of the fused matrix.
            (w[0].narrow(0, r * 3 * cols, 3 * cols), w[1].narrow(0, r * 3 * cols, 3 * cols))
        } else {
            // This rank's heads: the same C/t rows of each of the q, k and v blocks.
            (
                w[0].reshape([3, c, c]).narrow(1, r * cols, cols).reshape([3 * cols, c]),
                w[1].reshape([3, c]).narrow(1, r * cols, cols).reshape([3 * cols]),
            )
        };
        let y = heads_attention(&x.linear(&wq, Some(&bq)), hs, (hs as f64).sqrt(), true);
        y.linear::<Tensor>(&w[2].narrow(1, r * cols, cols), None)
    }

    /// The sum over t ranks when each takes rows r·3C/t … of the fused c_attn as if they were its
    /// q, k and v (the mistake the README warns about), for naming it when it happens.
    fn fused_split_ref(x: &Tensor, w: &[Tensor; 4], n_head: i64, tp: i64) -> Tensor {
        (0..tp).fold(w[3].shallow_clone() * 1.0, |out, r| out + rank_partial(x, w, n_head, tp, r, true))
    }

    #[test]
    fn ex5_attention_split_by_heads_matches_one_process() {
        shardlab::grading::refuse_twins(GRADER, 5, TWINS[4]);
        let (b, t, c) = (2i64, 5i64, 12i64);
        let weights = move || [noise(&[3 * c, c], 0.71, 0.8), noise(&[3 * c], 1.3, 0.4), noise(&[c, c], 0.37, 0.6), noise(&[c], 2.1, 1.0)];
        let input = move || noise(&[b, t, c], 0.53, 2.0);
        for (tp, n_head) in [(1usize, 4i64), (2, 4), (4, 4), (2, 6), (3, 6)] {
            let (x, w) = (input(), weights());
            let hs = (c / n_head) as f64;
            let want = attention_ref(&x, &w, n_head, hs.sqrt(), true);
            // The reference written out above against libtorch's own fused attention.
            let q = |i: i64| x.linear(&w[0], Some(&w[1])).narrow(2, i * c, c).reshape([b, t, n_head, c / n_head]).transpose(1, 2);
            let sdpa = Tensor::scaled_dot_product_attention::<Tensor>(&q(0), &q(1), &q(2), None, 0.0, true, None, false);
            let sdpa = sdpa.transpose(1, 2).reshape([b, t, c]).linear(&w[2], Some(&w[3]));
            assert!(max_diff(&sdpa, &want, "reference") < 1e-5, "the grader's reference disagrees with libtorch's attention");
            let out = spawn(tp, Backend::Local, move |pg| {
                let [wa, ba, wp, bp] = weights();
                let before = pg.stats();
                let y = tp_attention(pg, &input(), &wa, &ba, &wp, &bp, n_head)?;
                let s = pg.stats().since(&before);
                Ok((Vec::<f32>::try_from(y.to_kind(Kind::Float).reshape([-1]))?, y.size(), s.calls(OpKind::AllReduce), s.collectives, s.p2p, s.bytes_sent))
            })
            .unwrap_or_else(|e| panic!("tp={tp}, {n_head} heads: {e}"));
            for (r, (y, size, ar, coll, p2p, sent)) in out.into_iter().enumerate() {
                let at = format!("tp={tp}, {n_head} heads, rank {r}");
                assert_eq!(size, vec![b, t, c], "{at}: the output is the whole (B, T, C) on every rank");
                let y = Tensor::from_slice(&y).reshape([b, t, c]);
                let d = max_diff(&y, &want, &at);
                if d >= 1e-5 {
                    let near = |other: &Tensor| max_diff(&y, other, &at) < 1e-5;
                    // This rank's heads alone (a correct split, not summed): its partial plus the bias.
                    let own = rank_partial(&x, &w, n_head, tp as i64, r as i64, false) + &w[3];
                    let why = if bool::try_from(y.isnan().any()).unwrap_or(false) {
                        "the output holds NaN: a softmax row with every score −∞ (mask only the positions after the \
                         query, j > i, before the softmax, along the last dimension)"
                            .to_string()
                    } else if near(&(&want + &w[3] * (tp as f64 - 1.0))) {
                        format!("c_proj's bias was added {tp} times: every rank added it before the sum; add it once, after the all-reduce")
                    } else if tp > 1 && near(&fused_split_ref(&x, &w, n_head, tp as i64)) {
                        "each rank took a contiguous third of its rows of the fused c_attn as q, k and v: rank 0 got q's rows only. \
                         c_attn is three blocks (q, k, v) of C rows; a rank's heads are the same rows of each block"
                            .to_string()
                    } else if tp > 1 && near(&own) {
                        "this is the rank's own heads' output: the partial outputs were not summed over the group".to_string()
                    } else if tp > 1 && near(&((&want - &w[3]) / tp as f64 + &w[3])) {
                        "the partial outputs were averaged: sum them (ReduceOp::Sum)".to_string()
                    } else if near(&attention_ref(&x, &w, n_head, hs.sqrt(), false)) {
                        "no causal mask: a position attends to the ones after it".to_string()
                    } else if near(&attention_ref(&x, &w, n_head, (c as f64).sqrt(), true)) {
                        "the scores were divided by √C; divide by √(head size) = √(C/n_head)".to_string()
                    } else {
                        "compare one head at a time with one process: which rows of c_attn, which columns of c_proj".to_string()
                    };
                    panic!("{at}: the output differs from one process's attention by {d}: {why}");
                }
                assert!(
                    ar == 1 && coll == 1 && p2p == 0,
                    "{at}: exactly one all-reduce and nothing else (c_proj's partial sums), got {ar} all-reduces, {coll} collectives, {p2p} sends/recvs"
                );
                // An all-reduce of the (B, T, C) f32 partials sends 2(t−1)/t of it by ring, (t−1)/t at least.
                let full = (b * t * c * 4) as u64;
                assert!(
                    tp == 1 || (full * (tp as u64 - 1) / tp as u64 <= sent && sent <= 2 * full),
                    "{at}: sent {sent} bytes: the one all-reduce is of the (B, T, C) f32 partial outputs, {full} bytes"
                );
            }
        }
        // Heads that do not split over the ranks, or a width that does not split into the heads: an
        // error on every rank, before any communication.
        for (tp, n_head, why) in [(2usize, 3i64, "3 heads do not split over 2 ranks"), (1, 5, "a width of 12 does not split into 5 heads")] {
            let out = spawn(tp, Backend::Local, move |pg| {
                let [wa, ba, wp, bp] = weights();
                let before = pg.stats();
                let r = tp_attention(pg, &input(), &wa, &ba, &wp, &bp, n_head);
                Ok((r.map(|_| ()).map_err(|e| e.to_string()), pg.stats().since(&before).collectives))
            })
            .unwrap_or_else(|e| panic!("tp={tp}, {n_head} heads: {e}"));
            for (r, (res, coll)) in out.into_iter().enumerate() {
                let at = format!("tp={tp}, {n_head} heads, rank {r}");
                assert!(res.is_err(), "{at}: {why}: that must be an error, got Ok");
                let e = res.unwrap_err();
                assert!(e.contains("invalid argument"), "{at}: expected CommError::InvalidArgument, got: {e}");
                assert_eq!(coll, 0, "{at}: refuse before communicating");
            }
        }
    }
}
