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
}
