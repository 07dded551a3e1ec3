//! Grader for lesson 14 (the capstone).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/14_capstone/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 14` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong. Expected
//! values are worked out by hand in the comments next to them; none comes from shardlab's own
//! copy of the function (an exercise file that calls it is refused).

#[path = "../lessons/14_capstone/exercise.rs"]
mod exercise_code;
#[path = "../solutions/14_capstone.rs"]
mod solution_code;

shardlab::graders! {
    lesson: "14", exercise_file: "lessons/14_capstone/exercise.rs";

    use tch::{Kind, Tensor};

    /// No answer here needs shardlab: any use of it is its own copy of the exercise. Nor
    /// libtorch's fused attention, which is exercise 4's whole point.
    const TWINS: &[&str] = &["shardlab", "scaled_dot_product_attention"];

    fn close(a: &[f64], b: &[f64], tol: f64) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol)
    }

    #[test]
    fn ex1_characters_become_sorted_ids() {
        shardlab::grading::refuse_twins(GRADER, 1, TWINS);
        // "hello world": the distinct characters ' ' d e h l o r w, in code-point order (space is 32).
        let v = char_vocabulary("hello world");
        assert_eq!(v, vec![' ', 'd', 'e', 'h', 'l', 'o', 'r', 'w'], "the distinct characters, each once, sorted by code point");
        // Order-independent: the same characters in another order give the same vocabulary.
        assert_eq!(char_vocabulary("world hello"), v, "the vocabulary must not depend on the order of the text");
        // Beyond ASCII: 'é' is U+00E9, 'ï' U+00EF, both after every ASCII letter.
        assert_eq!(char_vocabulary("naïve café"), vec![' ', 'a', 'c', 'e', 'f', 'n', 'v', 'é', 'ï'], "code points, not bytes");
        assert!(char_vocabulary("").is_empty(), "no text, no characters");
        // h = 3, e = 2, l = 4, o = 5 in the vocabulary above.
        assert_eq!(encode(&v, "hello").unwrap(), vec![3, 2, 4, 4, 5], "each character's position in the vocabulary");
        let text = "we hold, we do, we roll";
        let v2 = char_vocabulary(text);
        let ids = encode(&v2, text).unwrap();
        let back: String = ids.iter().map(|&i| v2[i as usize]).collect();
        assert_eq!(back, text, "decoding the ids must give the text back");
        // Ids count characters, not bytes: in "naïve café"'s vocabulary c = 2, a = 1, f = 4, é = 7.
        let cafe = encode(&char_vocabulary("naïve café"), "café")
            .unwrap_or_else(|e| panic!("encode character by character, not byte by byte ('é' is two bytes in UTF-8): {e}"));
        assert_eq!(cafe, vec![2, 1, 4, 7], "encode character by character, not byte by byte ('é' is two bytes in UTF-8)");
        let e = encode(&v, "hello!").expect_err("'!' is not in the vocabulary of \"hello world\": that must be an error, not a made-up id");
        assert!(e.contains('!'), "the error should name the character: {e}");
    }

    #[test]
    fn ex2_validation_is_whole_documents_from_the_90_percent_point() {
        shardlab::grading::refuse_twins(GRADER, 2, TWINS);
        // 50, 30, 10, 10 characters and three separators: 106 in all, the 90 % point at 95.4.
        // Spans with their separators end at 52, 84, 96: the point falls in document 2.
        assert_eq!(first_val_document(&[50, 30, 10, 10]).unwrap(), 2, "[50, 30, 10, 10]: the 90 % point (95.4 of 106 characters, separators counted) falls in document 2");
        // Ten documents of 10: 118 characters, the point at 106.2, document 8 spans 96..108.
        assert_eq!(first_val_document(&[10; 10]).unwrap(), 8, "ten documents of 10: the 90 % point (106.2 of 118) falls in document 8");
        // 10 and 100: 112, the point at 100.8, inside document 1.
        assert_eq!(first_val_document(&[10, 100]).unwrap(), 1, "[10, 100]");
        // 100 and 1: the point (92.7 of 103) falls in document 0 — but train may not be empty.
        assert_eq!(first_val_document(&[100, 1]).unwrap(), 1, "[100, 1]: the first document holds the 90 % point, but train may not be empty: validation starts at 1");
        // Exactly on a boundary: 43, 43, 10 make 100 characters; document 1's span ends at 90, the
        // point itself. The point falls in the span after it (a span [start, end) excludes its end).
        assert_eq!(first_val_document(&[43, 43, 10]).unwrap(), 2, "[43, 43, 10]: document 1's span ends exactly at the 90 % point (90 of 100), so the point falls in document 2");
        for n in [0, 1] {
            let e = first_val_document(&vec![5; n]).expect_err("fewer than two documents cannot be split");
            assert!(!e.is_empty(), "say why");
        }
        // Validation always holds at least the last 10 % (separators counted).
        for lengths in [vec![3, 9, 27, 81, 5, 1], vec![1, 1, 1, 1, 1, 1, 1, 1, 1, 100], vec![40, 40, 40, 40, 40]] {
            let cut = first_val_document(&lengths).unwrap();
            assert!(cut >= 1 && cut < lengths.len(), "{lengths:?}: {cut} leaves a side empty");
            let total: usize = lengths.iter().sum::<usize>() + 2 * (lengths.len() - 1);
            let val: usize = lengths[cut..].iter().sum::<usize>() + 2 * (lengths.len() - cut - 1);
            assert!(10 * (val + 2) >= total, "{lengths:?}: validation from {cut} holds {val} of {total}, under 10 %");
        }
    }

    #[test]
    fn ex3_the_distribution_temperature_and_top_k_make() {
        shardlab::grading::refuse_twins(GRADER, 3, TWINS);
        let p = |l: &[f64], t: f64, k: Option<usize>| next_token_distribution(l, t, k);
        // softmax(1, 2, 3) = e^i / (e + e² + e³).
        let want = [0.09003057317038046, 0.24472847105479764, 0.6652409557748219];
        let got = p(&[1.0, 2.0, 3.0], 1.0, None);
        assert!(close(&got, &want, 1e-12), "softmax of [1, 2, 3] at temperature 1 (compute in f64): want {want:?}, got {got:?}");
        // Temperature 0.5 doubles the logits: softmax(2, 4, 6) = (e^-4, e^-2, 1) / sum.
        let want = [0.015876239976466765, 0.11731042782619837, 0.8668133321973349];
        let got = p(&[1.0, 2.0, 3.0], 0.5, None);
        assert!(close(&got, &want, 1e-12), "temperature 0.5 sharpens: logits / 0.5 (compute in f64), want {want:?}, got {got:?}");
        // Top 2 of [1, 2, 3]: the 1 is impossible; softmax(2, 3) = (1, e) / (1 + e).
        let want = [0.0, 0.2689414213699951, 0.7310585786300049];
        let got = p(&[1.0, 2.0, 3.0], 1.0, Some(2));
        assert!(close(&got, &want, 1e-12), "top-k 2 keeps the two largest: want {want:?}, got {got:?}");
        // Ties with the k-th largest stay: [2, 2, 2, 1] with k = 1 keeps all three 2s.
        let got = p(&[2.0, 2.0, 2.0, 1.0], 1.0, Some(1));
        assert!(close(&got, &[1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0, 0.0], 1e-12), "k = 1 with three equal largest logits keeps all three (ties with the k-th stay): {got:?}");
        let got = p(&[1.0, 3.0, 3.0, 2.0], 1.0, Some(2));
        assert!(close(&got, &[0.0, 0.5, 0.5, 0.0], 1e-12), "[1, 3, 3, 2], k = 2: the two 3s: {got:?}");
        // k ≥ V keeps everything (sample's default top-k is 200 for 84 characters), and so does k = 0.
        assert!(close(&p(&[1.0, 2.0, 3.0], 1.0, Some(3)), &p(&[1.0, 2.0, 3.0], 1.0, None), 1e-12), "k = V keeps every token");
        assert!(close(&p(&[1.0, 2.0, 3.0], 1.0, Some(200)), &p(&[1.0, 2.0, 3.0], 1.0, None), 1e-12), "k = 200 with 3 logits keeps every token");
        assert!(close(&p(&[1.0, 2.0, 3.0], 1.0, Some(0)), &p(&[1.0, 2.0, 3.0], 1.0, None), 1e-12), "k = 0 keeps every token");
        // Temperature 0: argmax, the first of equal largest.
        assert_eq!(p(&[1.0, 3.0, 3.0, 2.0], 0.0, None), vec![0.0, 1.0, 0.0, 0.0], "temperature 0 puts everything on the first largest logit");
        // Large logits: softmax(1000, 999) = (e, 1) / (1 + e), no overflow.
        let got = p(&[1000.0, 999.0], 1.0, None);
        assert!(close(&got, &[0.7310585786300049, 0.2689414213699951], 1e-12), "logits of 1000 must not overflow (subtract the largest first): {got:?}");
        // Drawing: 1000 evenly spaced u give each token its share exactly.
        let probs = [0.25, 0.0, 0.75];
        let mut counts = [0usize; 3];
        for j in 0..1000 {
            counts[draw(&probs, (j as f64 + 0.5) / 1000.0)] += 1;
        }
        assert_eq!(counts, [250, 0, 750], "1000 evenly spaced u over [0.25, 0, 0.75]");
        assert_eq!(draw(&probs, 0.25), 2, "u = 0.25 is past token 0 (cumulative 0.25 does not exceed it) and token 1 has probability 0");
        assert_eq!(draw(&probs, 0.0), 0);
        // Rounding: 0.2 + 0.7 + 0.1 sums to 0.9999999999999999 in f64, so u = 0.9999999999999999
        // exceeds no cumulative sum; the draw is then the last token that can be drawn.
        assert_eq!(draw(&[0.2, 0.7, 0.1, 0.0], 0.9999999999999999), 2, "u past every cumulative sum (rounding): the last token of nonzero probability, never one of probability 0 nor past the end");
    }

    /// Full causal attention over the whole sequence, one position at a time: softmax over keys
    /// 0..=t of q_t·k/√D, times v.
    fn full_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
        let (t, d) = (q.size()[2], q.size()[3]);
        let rows: Vec<Tensor> = (0..t)
            .map(|i| {
                let qi = q.narrow(2, i, 1);
                let ks = k.narrow(2, 0, i + 1);
                let w = (qi.matmul(&ks.transpose(-2, -1)) / (d as f64).sqrt()).softmax(-1, Kind::Float);
                w.matmul(&v.narrow(2, 0, i + 1))
            })
            .collect();
        Tensor::cat(&rows, 2)
    }

    #[test]
    fn ex4_cached_attention_equals_full_attention_at_every_position() {
        shardlab::grading::refuse_twins(GRADER, 4, TWINS);
        tch::manual_seed(14);
        let (b, h, t, d) = (2, 3, 7, 4);
        let opts = (Kind::Float, tch::Device::Cpu);
        let (q, k, v) = (Tensor::randn([b, h, t, d], opts), Tensor::randn([b, h, t, d], opts), Tensor::randn([b, h, t, d], opts));
        let want = full_attention(&q, &k, &v);
        // Fed as: the whole sequence at once; one token at a time; a prompt of 3, then 1, 2, 1.
        for chunks in [vec![7], vec![1; 7], vec![3, 1, 2, 1]] {
            let mut cache = None;
            let mut outs = Vec::new();
            let mut at = 0;
            for &n in &chunks {
                let y = cached_attention(&q.narrow(2, at, n), &k.narrow(2, at, n), &v.narrow(2, at, n), &mut cache);
                assert_eq!(y.size(), vec![b, h, n, d], "chunks {chunks:?}: the output of {n} new tokens is (B, H, {n}, D)");
                outs.push(y);
                at += n;
                let (ck, cv) = cache.as_ref().expect("the cache holds every token seen so far");
                assert_eq!(ck.size(), vec![b, h, at, d], "chunks {chunks:?}: after {at} tokens the cached keys are (B, H, {at}, D)");
                assert!(ck.equal(&k.narrow(2, 0, at)) && cv.equal(&v.narrow(2, 0, at)), "chunks {chunks:?}: the cache must hold the keys and values of tokens 0..{at}, in order");
            }
            let got = Tensor::cat(&outs, 2);
            let err = (&got - &want).abs().max().double_value(&[]);
            assert!(err < 1e-5, "chunks {chunks:?}: cached attention differs from full causal attention by {err} (scaled by √D? each new token sees every earlier one, and no later one?)");
        }
    }

    /// The capstone's GPT (`lesson14 fit`): vocabulary 84, context 64, 4 layers, 4 heads, 128 wide.
    /// Its parameters, by hand (C = 128): wte 84·C = 10752, wpe 64·C = 8192, a block 2·2C
    /// (LayerNorms) + 3C² + 3C (c_attn) + C² + C (attn.c_proj) + 4C² + 4C (c_fc) + 4C² + C
    /// (mlp.c_proj) = 198272, ln_f 2C = 256; in all P = 812288.
    fn capstone() -> Shape {
        Shape { vocab_size: 84, block_size: 64, n_layer: 4, n_head: 4, n_embd: 128 }
    }

    fn layout(dp: usize, tp: usize, pp: usize, zero: u8) -> Layout {
        Layout { dp, tp, pp, zero }
    }

    /// What rank 0 of a real run holds after 2 steps, counted from its tensors (the same count
    /// `lesson14 fit` prints; tests/held_memory.rs checks it against the allocator).
    fn held_by_rank0(world: usize, tp: usize, pp: usize, strategy: shardlab::prelude::Strategy) -> f64 {
        use shardlab::job::{DataSource, GptJob};
        use shardlab::pipeline::PipelineConfig;
        use shardlab::prelude::*;
        let job = GptJob {
            model: GptConfig { vocab_size: 64, block_size: 16, n_layer: 2, n_head: 2, n_embd: 32 },
            batch_size: 2,
            accum: 1,
            steps: 2,
            warmup: 0,
            optim: AdamWConfig::default(),
            lr_schedule: None,
            grad_clip: None,
            data: DataSource::Synthetic { tokens: 2000, seed: 1 },
            seed: 1,
            init: None,
            save: None,
            checkpoint: Default::default(),
            eval: Default::default(),
        };
        let s = ScalingConfig {
            num_workers: world,
            strategy,
            tensor_parallel: tp,
            pipeline: PipelineConfig { stages: pp, micro_batches: pp, ..PipelineConfig::default() },
            threads_per_worker: Some(1),
            ..ScalingConfig::default()
        };
        job.fit(s, false, false).expect("the measuring run").memory.model_states() as f64
    }

    #[test]
    fn ex5_each_rank_holds_what_the_engine_holds() {
        shardlab::grading::refuse_twins(GRADER, 5, TWINS);
        let c = capstone();
        let p = 812288.0;
        let got = |l: Layout| rank_state_bytes(&c, &l);
        let same = |a: &[f64], b: &[f64]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 0.5);
        // Data parallel over 4, fp32 AdamW: 4 bytes of weight, 4 of gradient, 8 of m and v.
        assert!(same(&got(layout(4, 1, 1, 0)), &[16.0 * p]), "DDP: every replica holds 16 bytes a parameter: {:?}", got(layout(4, 1, 1, 0)));
        assert!(same(&got(layout(4, 1, 1, 3)), &[4.0 * p]), "ZeRO-3 over 4: everything sharded, 16P/4: {:?}", got(layout(4, 1, 1, 3)));
        assert!(same(&got(layout(4, 1, 1, 2)), &[7.0 * p]), "ZeRO-2 over 4: weights whole (4P), gradients and AdamW sharded (12P/4): {:?}", got(layout(4, 1, 1, 2)));
        // Stage 1: weights 4P, the full gradient 4P and its averaged shard P, AdamW 8P/4 = 11P.
        assert!(same(&got(layout(4, 1, 1, 1)), &[11.0 * p]), "ZeRO-1 over 4, as shardlab's stage 1 holds it (lesson 07: the full gradient and, beside it, the averaged shard): {:?}", got(layout(4, 1, 1, 1)));
        // Tensor parallel 2: wte 5376 and c_attn, both c_proj weights, c_fc halved; wpe, the
        // LayerNorms, the two c_proj biases and ln_f whole. A block: 512 + 24768 + 8192 + 128 +
        // 33024 + 32768 + 128 = 99520; in all 5376 + 8192 + 4·99520 + 256 = 411904, not P/2.
        assert!(same(&got(layout(2, 2, 1, 0)), &[16.0 * 411904.0]), "DDP × tp 2: {:?}, want {} (what does t not divide?)", got(layout(2, 2, 1, 0)), 16.0 * 411904.0);
        assert!(same(&got(layout(2, 2, 1, 3)), &[8.0 * 411904.0]), "ZeRO-3 over 2 × tp 2: {:?}", got(layout(2, 2, 1, 3)));
        // Pipeline 4 over the 6 stages (embeddings, 4 blocks, head): 2, 2, 1, 1 — embeddings +
        // block 0 = 217216; blocks 1–2 = 396544; block 3 = 198272; ln_f + the tied wte = 11008.
        let want: Vec<f64> = [217216.0, 396544.0, 198272.0, 11008.0].iter().map(|x| 16.0 * x).collect();
        assert!(same(&got(layout(1, 1, 4, 0)), &want), "pp 4, one entry per pipeline rank: {:?}, want {want:?} (which stages does each rank take, and where does the tied head's weight live?)", got(layout(1, 1, 4, 0)));
        // tp 2 × pp 2: 3 stages each, halved as above: 5376 + 8192 + 2·99520 = 212608; 2·99520 +
        // 256 + 5376 = 204672.
        let want = [16.0 * 212608.0, 16.0 * 204672.0];
        assert!(same(&got(layout(1, 2, 2, 0)), &want), "tp 2 × pp 2: {:?}, want {want:?}", got(layout(1, 2, 2, 0)));
        // Against real runs of a small GPT (vocabulary 64, context 16, 2 layers, 2 heads, 32
        // wide): what rank 0 — pipeline rank 0, tensor rank 0 — holds, within 1 % (ZeRO pads its
        // flat buffers by a few elements).
        use shardlab::prelude::Strategy;
        let small = Shape { vocab_size: 64, block_size: 16, n_layer: 2, n_head: 2, n_embd: 32 };
        for (name, world, tp, pp, strategy, zero) in [
            ("zero1 × 2", 2, 1, 1, Strategy::Zero1, 1),
            ("zero2 × 2", 2, 1, 1, Strategy::Zero2, 2),
            ("tp 2", 2, 2, 1, Strategy::Ddp, 0),
            ("pp 2", 2, 1, 2, Strategy::Ddp, 0),
            ("zero3 × 2 × tp 2", 4, 2, 1, Strategy::Zero3, 3),
        ] {
            let l = layout(world / (tp * pp), tp, pp, zero);
            let planned = rank_state_bytes(&small, &l);
            let held = held_by_rank0(world, tp, pp, strategy);
            assert!(!planned.is_empty() && (planned[0] - held).abs() <= 0.01 * held, "{name}: rank 0 of a real run holds {held} bytes of model state; you say {:?}", planned.first());
        }
    }

    #[test]
    fn ex5_the_layout_chosen_for_a_budget() {
        shardlab::grading::refuse_twins(GRADER, 5, TWINS);
        let c = capstone();
        let pick = |max_dp: usize, budget: f64| choose_layout(&c, 4, max_dp, budget);
        // 4 ranks, 4 replicas allowed: data parallel over 4, the lowest stage that fits (the
        // totals of the test before: 16P = 12996608, 11P = 8935168, 7P = 5686016, 4P = 3249152).
        assert_eq!(pick(4, 12996608.0), Ok(layout(4, 1, 1, 0)), "DDP's 16P fits a budget of exactly 16P");
        assert_eq!(pick(4, 12996607.0), Ok(layout(4, 1, 1, 1)), "a byte short of DDP: the lowest ZeRO stage that fits");
        assert_eq!(pick(4, 8935167.0), Ok(layout(4, 1, 1, 2)), "a byte short of ZeRO-1");
        assert_eq!(pick(4, 5686015.0), Ok(layout(4, 1, 1, 3)), "a byte short of ZeRO-2");
        assert_eq!(pick(4, 3300000.0), Ok(layout(4, 1, 1, 3)), "ZeRO-3 over 4 holds the least: 3249152");
        let e = pick(4, 3249151.0).expect_err("a byte short of ZeRO-3 over 4: nothing holds less, nothing fits");
        assert!(e.contains("3249152"), "say (in bytes) what the smallest layout needs: {e}");
        // At most 2 replicas, so tp × pp = 2 — tensor before pipeline (ddp2×tp2 holds 6590464
        // bytes, ddp2×pp2 6647808: both fit the second budget).
        assert_eq!(pick(2, 4061440.0), Ok(layout(2, 2, 1, 3)), "at most 2 replicas, 5 bytes a parameter: ZeRO-3 over 2 × tp 2 (3295232)");
        assert_eq!(pick(2, 6647808.0), Ok(layout(2, 2, 1, 0)), "at most 2 replicas: DDP × tp 2 fits and comes before pipeline parallelism");
        assert_eq!(pick(2, 6092160.0), Ok(layout(2, 2, 1, 1)), "at most 2 replicas, 7.5 bytes a parameter: ZeRO-1 over 2 × tp 2 (5766656)");
        // One replica, DDP (nothing to shard over): tp 4 (3387392), then tp 2 × pp 2 (3401728 on
        // its first rank), then pp 4 (6344704 on its second).
        assert_eq!(pick(1, 3400000.0), Ok(layout(1, 4, 1, 0)), "at most 1 replica: tp 4");
        assert_eq!(pick(1, 6344704.0), Ok(layout(1, 4, 1, 0)), "tp 4 fits whenever pp 4 does");
        let e = pick(1, 3387391.0).expect_err("1 replica, a byte short of tp 4: nothing fits");
        assert!(e.contains("3387392"), "say (in bytes) what the smallest layout needs: {e}");
        // What the engine cannot run is not a candidate: 3 heads (tp 2 does not divide them),
        // a vocabulary of 85 (nor it), 1 layer (3 stages: pp 4 has a rank with nothing).
        let odd_heads = Shape { vocab_size: 84, block_size: 64, n_layer: 4, n_head: 3, n_embd: 96 };
        assert_eq!(choose_layout(&odd_heads, 2, 1, 1e12), Ok(layout(1, 1, 2, 0)), "3 heads on 2 ranks, 1 replica: tp 2 cannot split 3 heads, so pp 2");
        let odd_vocab = Shape { vocab_size: 85, ..c };
        assert_eq!(choose_layout(&odd_vocab, 2, 1, 1e12), Ok(layout(1, 1, 2, 0)), "a vocabulary of 85 cannot be split in 2: pp 2");
        let one_layer = Shape { n_layer: 1, n_head: 1, n_embd: 32, ..c };
        assert_eq!(choose_layout(&one_layer, 3, 1, 1e12), Ok(layout(1, 1, 3, 0)), "1 layer, 3 ranks, 1 replica: 3 stages (embeddings, block, head), one each");
        assert!(choose_layout(&one_layer, 4, 1, 1e12).is_err(), "1 layer, 1 head, 4 ranks, 1 replica: no tp, and pp 4 over 3 stages leaves a rank empty");
        // Every rank must fit, not only the first: 1 head, 2 layers, 32 wide on 4 ranks is pp 4,
        // whose ranks hold the embeddings (84·32 + 64·32 = 4736 parameters), a block (12704), a
        // block, and ln_f + wte (2752): 16 · 12704 = 203264 bytes on ranks 1 and 2.
        let narrow = Shape { vocab_size: 84, block_size: 64, n_layer: 2, n_head: 1, n_embd: 32 };
        assert_eq!(choose_layout(&narrow, 4, 1, 203264.0), Ok(layout(1, 1, 4, 0)), "pp 4 of a 2-layer, 1-head GPT: its largest rank holds 203264 bytes");
        assert!(choose_layout(&narrow, 4, 1, 160000.0).is_err(), "pp 4's first rank holds 75776 bytes, but its second 203264: a budget of 160000 fits no layout");
        // The order's second key before its third: with a vocabulary of 4, pp 2 holds less than
        // tp 2 (wpe, the LayerNorms and the c_proj biases whole on each tensor rank). Vocabulary 4, context 4, 2
        // layers, 2 heads, 32 wide: a block 12704 parameters, 6448 of it on a tensor rank; tp 2
        // holds 64 + 128 + 2·6448 + 64 = 13152 (DDP 210432 bytes, ZeRO-1 over 2: 14 · 13152 =
        // 184128); pp 2's ranks 256 + 12704 = 12960 and 12704 + 64 + 128 = 12896 (DDP 207360).
        let tiny_vocab = Shape { vocab_size: 4, block_size: 4, n_layer: 2, n_head: 2, n_embd: 32 };
        assert_eq!(choose_layout(&tiny_vocab, 4, 2, 208000.0), Ok(layout(2, 2, 1, 1)), "pp 2 holds less here (207360) than DDP × tp 2 (210432), yet tensor before pipeline comes before the ZeRO stage: ZeRO-1 over 2 × tp 2 (184128)");
        // Bad input is an error that says so, not a layout nor "nothing fits".
        for (world, max_dp, budget) in [(0, 4, 1e12), (4, 0, 1e12), (4, 4, f64::NAN), (4, 4, 0.0), (4, 4, -1.0), (4, 4, f64::INFINITY)] {
            let e = choose_layout(&c, world, max_dp, budget).expect_err(&format!("world {world}, at most {max_dp} replicas, budget {budget}: an error"));
            assert!(!e.contains("3249152"), "world {world}, at most {max_dp} replicas, budget {budget}: bad input, not a budget too small: {e}");
        }
    }
}
