//! Grader for lesson 09 (activation checkpointing).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/09_activation_checkpointing/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 09` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong.

#[path = "../lessons/09_activation_checkpointing/exercise.rs"]
mod exercise_code;
#[path = "../solutions/09_activation_checkpointing.rs"]
mod solution_code;

use shardlab::data::{synthetic_corpus, DistributedSampler};
use shardlab::model::{Batch, Gpt, GptConfig, Mlp, MlpConfig, Model};
use shardlab::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

shardlab::graders! {
    lesson: "09", exercise_file: "lessons/09_activation_checkpointing/exercise.rs";

    /// shardlab's own copies of what each exercise builds (exercise K: `TWINS[K - 1]`): an exercise
    /// that names one is refused ("write it yourself").
    const TWINS: &[&[&str]] = &[&["stages::forward_backward", "stages::forward_only", "staged_backward", "AccumulateGrads", "StageHooks", "shardlab::stages"], &["stages::forward_backward", "stages::forward_only", "staged_backward", "AccumulateGrads", "StageHooks", "shardlab::stages"], &[], &[]];

    /// A model that counts its stage forwards and records, per call, whether the output carries a
    /// graph and whether the next stage's parameters already have gradients (has its backward run?).
    struct Watched<M: Model> {
        inner: M,
        calls: Vec<AtomicUsize>,
        graphs: Mutex<Vec<(usize, bool, bool)>>,
    }

    impl<M: Model> Watched<M> {
        fn new(inner: M) -> Self {
            let n = inner.num_stages();
            Watched { inner, calls: (0..n).map(|_| AtomicUsize::new(0)).collect(), graphs: Mutex::new(Vec::new()) }
        }
        fn calls(&self) -> Vec<usize> {
            self.calls.iter().map(|c| c.load(Ordering::Relaxed)).collect()
        }
    }

    impl<M: Model> Model for Watched<M> {
        fn named_parameters(&self) -> Vec<(String, Tensor)> {
            self.inner.named_parameters()
        }
        fn num_stages(&self) -> usize {
            self.inner.num_stages()
        }
        fn stage_forward(&self, s: usize, x: &Tensor, batch: &Batch) -> Tensor {
            self.calls[s].fetch_add(1, Ordering::Relaxed);
            let y = self.inner.stage_forward(s, x, batch);
            let params = self.inner.parameters();
            let next_done = self.inner.stage_uses().get(s + 1).is_some_and(|u| {
                u.iter().any(|&i| {
                    let g = params[i].grad();
                    g.defined() && g.abs().sum(Kind::Float).double_value(&[]) > 0.0
                })
            });
            self.graphs.lock().unwrap().push((s, y.requires_grad(), next_done));
            y
        }
        fn param_stages(&self) -> Vec<usize> {
            self.inner.param_stages()
        }
        fn stage_uses(&self) -> Vec<Vec<usize>> {
            self.inner.stage_uses()
        }
        fn var_store(&self) -> &tch::nn::VarStore {
            self.inner.var_store()
        }
    }

    /// A 4-block GPT: stages 0 (embeddings), 1–4 (blocks), 5 (head + loss; it also uses the tied wte).
    fn gpt() -> Gpt {
        Gpt::new(GptConfig { vocab_size: 16, block_size: 16, n_layer: 4, n_head: 2, n_embd: 32 }, 1).unwrap()
    }

    fn batch() -> Batch {
        DistributedSampler::new(16, 4, 0, 1, 3).unwrap().batch(&synthetic_corpus(4000, 7), 0)
    }

    fn mask(policy: Checkpointing, n: usize) -> Vec<bool> {
        (0..n).map(|s| policy.recomputes(s, n)).collect()
    }

    /// Exercise 2 is graded on its own: its input comes from the reference answer to exercise 1.
    fn forward_for_ex2(model: &dyn Model, batch: &Batch, recompute: &[bool]) -> Vec<(Tensor, Tensor)> {
        crate::solution_code::checkpointed_forward(model, batch, recompute)
    }

    /// Every parameter's gradient as raw f32 bits.
    fn grad_bits(m: &dyn Model) -> Vec<Vec<u32>> {
        m.parameters()
            .iter()
            .map(|p| {
                let g = p.grad();
                assert!(g.defined(), "a parameter has no gradient: every parameter of this model is used");
                Vec::<f32>::try_from(&g.reshape([-1])).unwrap().iter().map(|x| x.to_bits()).collect()
            })
            .collect()
    }

    /// The reference: one plain backward of the whole model's scaled loss (libtorch's autograd, no
    /// stages, nothing recomputed), the gradients bitwise.
    fn plain_grads(m: &dyn Model, b: &Batch, scale: f64) -> Vec<Vec<u32>> {
        (m.loss(b) * scale).backward();
        grad_bits(m)
    }

    #[test]
    fn ex1_forward_keeps_a_graph_only_where_asked() {
        shardlab::grading::refuse_twins(GRADER, 1, TWINS[0]);
        let n = 6;
        for policy in [Checkpointing::None, Checkpointing::Full, Checkpointing::Every(2)] {
            let m = Watched::new(gpt());
            let rec = mask(policy, n);
            let kept = checkpointed_forward(&m, &batch(), &rec);
            assert_eq!(kept.len(), n, "{policy}: one (input, output) per stage");
            assert_eq!(m.calls(), vec![1; n], "{policy}: each stage's forward runs once");
            assert!(!kept[0].0.defined(), "stage 0's input is an undefined Tensor::new() (it reads the batch)");
            for s in 0..n {
                let (input, output) = &kept[s];
                assert_eq!(
                    output.requires_grad(),
                    !rec[s],
                    "{policy}: stage {s}'s output {} — {}",
                    if output.requires_grad() { "carries a graph" } else { "carries no graph" },
                    if rec[s] { "a recomputed stage runs under tch::no_grad and keeps only its input" } else { "a stage that is not recomputed keeps its graph" }
                );
                if s > 0 {
                    assert!(input.requires_grad(), "{policy}: stage {s}'s input must require grad (its own leaf)");
                    assert!(
                        input.equal(&kept[s - 1].1.detach()),
                        "{policy}: stage {s}'s input must be stage {}'s output",
                        s - 1
                    );
                }
            }
            for &(s, graph, _) in m.graphs.lock().unwrap().iter() {
                assert_eq!(
                    graph, !rec[s],
                    "{policy}: stage {s}'s forward {} a graph — run a recomputed stage under tch::no_grad \
                     (building the graph and detaching the output afterwards still builds it)",
                    if graph { "built" } else { "built no" }
                );
            }
            let want = m.inner.loss(&batch()).double_value(&[]);
            shardlab::grading::assert_layout(&kept[n - 1].1, &[], Kind::Float, &format!("{policy}: the last stage's output (the loss)"));
            let got = kept[n - 1].1.double_value(&[]);
            assert!((got - want).abs() < 1e-6, "{policy}: the last output is the loss {want}, got {got}");
        }
        // Each stage's graph must end at its input: a leaf, detached from the previous stage's graph.
        let m = gpt();
        let kept = checkpointed_forward(&m, &batch(), &[false; 6]);
        for s in 1..6 {
            assert!(kept[s].0.is_leaf(), "stage {s}'s input must be a leaf: detach the previous output");
        }
        let wpe = m.parameters()[1].shallow_clone(); // used by stage 0 only
        let g = Tensor::run_backward(&[kept[2].1.sum(Kind::Float)], &[kept[2].0.shallow_clone(), wpe], false, false);
        assert!(g[0].defined(), "stage 2's output must depend on its own input leaf");
        assert!(!g[1].defined(), "stage 2's graph must not reach the embeddings: detach the input");
    }

    #[test]
    fn ex2_gradients_are_bitwise_those_without_checkpointing() {
        shardlab::grading::refuse_twins(GRADER, 2, TWINS[1]);
        let n = 6;
        for policy in [Checkpointing::None, Checkpointing::Full, Checkpointing::Every(2), Checkpointing::Every(3)] {
            let reference = gpt();
            let want = plain_grads(&reference, &batch(), 0.25);
            let m = Watched::new(gpt());
            let rec = mask(policy, n);
            let kept = forward_for_ex2(&m, &batch(), &rec);
            let loss = checkpointed_backward(&m, &batch(), &rec, kept, 0.25);
            let plain = m.inner.loss(&batch()).double_value(&[]);
            assert!((loss - plain).abs() < 1e-6, "{policy}: returns the unscaled loss {plain}, got {loss}");
            let calls = m.calls();
            for s in 0..n {
                let w = if rec[s] { 2 } else { 1 };
                assert_eq!(
                    calls[s], w,
                    "{policy}: stage {s} ran forward {} time(s), expected {w} (a recomputed stage runs once more, \
                     with a graph, just before its backward; the others never again)",
                    calls[s]
                );
            }
            for &(s, graph, next_done) in m.graphs.lock().unwrap().iter().skip(n) {
                assert!(graph, "{policy}: stage {s}'s recompute must build a graph (it is differentiated next)");
                assert!(
                    next_done || s + 1 == n,
                    "{policy}: stage {s} was recomputed before stage {}'s backward had run: recompute each stage \
                     just before its own backward, so that only one rebuilt graph is alive at a time",
                    s + 1
                );
            }
            let got = grad_bits(&m.inner);
            let names: Vec<String> = m.inner.named_parameters().into_iter().map(|(n, _)| n).collect();
            for ((g, w), name) in got.iter().zip(&want).zip(&names) {
                assert!(
                    g == w,
                    "{policy}: the gradient of {name} differs from one plain backward of the whole model's loss \
                     (scale 0.25; the tied wte adds the head's and the embedding's contributions)"
                );
            }
        }
        // Another model: an MLP's stages, scale 1.
        let mlp = || Mlp::new(MlpConfig { sizes: vec![8, 16, 16, 4] }, 3).unwrap();
        let b = Batch {
            x: Tensor::randn([5, 8], (Kind::Float, Device::Cpu)),
            y: Tensor::randn([5, 4], (Kind::Float, Device::Cpu)),
        };
        let want = plain_grads(&mlp(), &b, 1.0);
        let m = mlp();
        let rec: Vec<bool> = (0..m.num_stages()).map(|s| s == 1).collect();
        let kept = forward_for_ex2(&m, &b, &rec);
        checkpointed_backward(&m, &b, &rec, kept, 1.0);
        assert!(grad_bits(&m) == want, "MLP, middle stage recomputed: gradients differ from one plain backward of the loss");
    }

    #[test]
    fn ex3_the_peak_follows_the_backward() {
        // 8 blocks that keep M = 100 bytes each, or m = 10 when recomputed; by hand:
        let mask = |blocks: &[usize]| (0..8).map(|b| blocks.contains(&b)).collect::<Vec<bool>>();
        let peak = |blocks: &[usize]| peak_activation_bytes(&mask(blocks), 100, 10);
        assert_eq!(peak(&[]), 800, "no recompute: every block's 100 bytes at the start of backward");
        assert_eq!(peak(&[0, 1, 2, 3, 4, 5, 6, 7]), 170, "full: 8·10 kept; rebuilding block 7 while blocks 0–6 keep 10 each: 70 + 100");
        assert_eq!(peak(&[0, 2, 4, 6]), 440, "every:2: 4·100 + 4·10 kept at the start; rebuilding block 6 adds 100 to blocks 0–5's 330");
        assert_eq!(peak(&[0, 4]), 620, "every:4: 6·100 + 2·10");
        assert_eq!(peak(&[0, 7]), 710, "blocks 0 and 7: rebuilding block 7 while blocks 1–6 still hold their 100 each: 10 + 600 + 100");
        assert_eq!(peak(&[7]), 800, "only the last block: it is rebuilt first, on top of everything — no saving");
        assert_eq!(peak(&[0]), 710, "only block 0: it is rebuilt last, when everything else is freed");
        assert_eq!(peak_activation_bytes(&[], 100, 10), 0, "no blocks, no activations");
    }

    #[test]
    fn ex4_the_policy_with_fewest_recomputes_that_fits() {
        // Same 8 blocks (M = 100, m = 10). every:k recomputes blocks 0, k, 2k, …:
        // k = 8 → {0}: 710;  k = 4, 5, 6 → two blocks: 620;  k = 7 → {0, 7}: 710;
        // k = 3 → {0, 3, 6}: 530;  k = 2 → four blocks: 440;  full: 170.
        let p = |budget| policy_for_budget(8, 100, 10, budget);
        assert_eq!(p(800), Some(Checkpointing::None), "800 fits with no recompute");
        assert_eq!(p(799), Some(Checkpointing::Every(8)), "799: every:8 recomputes one block (710)");
        assert_eq!(p(709), Some(Checkpointing::Every(4)), "709: two blocks (every:4, 5 or 6 at 620; every:7 is 710): the smallest k");
        assert_eq!(p(600), Some(Checkpointing::Every(3)), "600: every:3 (530)");
        assert_eq!(p(500), Some(Checkpointing::Every(2)), "500: every:2 (440)");
        assert_eq!(p(439), Some(Checkpointing::Full), "439: only full (170) fits");
        assert_eq!(p(169), None, "169: nothing fits");
        assert_eq!(policy_for_budget(1, 100, 10, 100), Some(Checkpointing::None), "one block, 100: no checkpointing");
        assert_eq!(policy_for_budget(1, 100, 10, 99), None, "one block, 99: recomputing it needs its 100 again");
    }
}
