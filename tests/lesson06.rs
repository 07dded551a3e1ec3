//! Grader for lesson 06 (the FSDP round trip).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/06_fsdp_round_trip/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 06` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong.

#[path = "../lessons/06_fsdp_round_trip/exercise.rs"]
mod exercise_code;
#[path = "../solutions/06_fsdp_round_trip.rs"]
mod solution_code;

use shardlab::model::{Gpt, GptConfig, Model};
use shardlab::prelude::*;

shardlab::graders! {
    lesson: "06", exercise_file: "lessons/06_fsdp_round_trip/exercise.rs";

    fn both(n: usize) -> [SpawnOptions; 2] {
        [SpawnOptions::new(n, Backend::Local), SpawnOptions::new(n, Backend::Tcp).launch(Launch::Threads)]
    }

    #[test]
    fn ex1_pad_and_shard() {
        for n in 1..=8usize {
            for numel in [0i64, 1, 7, 8, 1000, 1003, 12_704] {
                let parts: Vec<_> = (0..n).map(|r| pad_and_shard(numel, n, r)).collect();
                let padded = parts[0].0;
                assert!(
                    parts.iter().all(|p| p.0 == padded),
                    "numel={numel} n={n}: every rank must agree on the padded size"
                );
                assert!(
                    padded >= numel && padded - numel < n as i64 && padded % n as i64 == 0,
                    "numel={numel} n={n}: padded to {padded}, want the next multiple of {n}"
                );
                assert_eq!(parts[0].1.start, 0, "numel={numel} n={n}: rank 0 starts at 0");
                assert_eq!(parts[n - 1].1.end, padded, "numel={numel} n={n}: the last shard ends at the padded size");
                assert!(parts.windows(2).all(|w| w[0].1.end == w[1].1.start), "numel={numel} n={n}: contiguous shards");
                assert!(
                    parts.iter().all(|p| p.1.end - p.1.start == padded / n as i64),
                    "numel={numel} n={n}: equal shards"
                );
            }
        }
    }

    #[test]
    fn ex2_gather_unit_rebuilds_the_flat_buffer() {
        for n in 1..=4 {
            for opts in both(n) {
                let out = spawn_with(opts, |pg| {
                    let r = pg.rank() as f32;
                    let shard = Tensor::from_slice(&(0..5).map(|i| r * 100.0 + i as f32).collect::<Vec<_>>());
                    let before = pg.stats();
                    let full = gather_unit(pg, &shard)?;
                    let ran = pg.stats().since(&before);
                    anyhow::ensure!(
                        pg.world_size() == 1 || (ran.calls(OpKind::AllGather) == 1 && ran.collectives == 1 && ran.p2p == 0),
                        "rank {}: gather_unit should make exactly one all_gather; it made {} \
                         (an all_reduce of zero-padded shards gets the values but moves twice the bytes)",
                        pg.rank(),
                        ran.describe_calls()
                    );
                    Ok(Vec::<f32>::try_from(&full)?)
                })
                .unwrap();
                let want: Vec<f32> = (0..n).flat_map(|r| (0..5).map(move |i| r as f32 * 100.0 + i as f32)).collect();
                assert!(out.iter().all(|v| *v == want), "n={n}: every rank must hold all shards in rank order");
            }
        }
    }

    #[test]
    fn ex3_reduce_scatter_averages_and_keeps_the_own_shard() {
        for n in 1..=4 {
            for opts in both(n) {
                let out = spawn_with(opts, |pg| {
                    let full =
                        Tensor::arange(4 * pg.world_size() as i64, (Kind::Float, Device::Cpu)) * (pg.rank() as f64 + 1.0);
                    let before = pg.stats();
                    let shard = reduce_scatter_grads(pg, &full)?;
                    let ran = pg.stats().since(&before);
                    anyhow::ensure!(
                        pg.world_size() == 1
                            || (ran.calls(OpKind::ReduceScatter) == 1 && ran.collectives == 1 && ran.p2p == 0),
                        "rank {}: reduce_scatter_grads should make exactly one reduce_scatter; it made {} \
                         (an all_reduce and a slice gets the values but moves twice the bytes, and every rank then \
                         holds gradients it throws away)",
                        pg.rank(),
                        ran.describe_calls()
                    );
                    Ok(Vec::<f32>::try_from(&shard)?)
                })
                .unwrap();
                let mean = (1..=n).sum::<usize>() as f32 / n as f32;
                for (r, got) in out.iter().enumerate() {
                    let want: Vec<f32> = (4 * r..4 * r + 4).map(|i| i as f32 * mean).collect();
                    assert_eq!(got, &want, "n={n} rank {r}: the average of every rank's elements {}..{}", 4 * r, 4 * r + 4);
                }
            }
        }
    }

    #[test]
    fn ex3_and_1_2_a_gpt_unit_survives_the_round_trip() {
        // Shard a real unit (block 0 of the tiny GPT, 12 704 elements: N = 3 pads it), gather it back,
        // and reduce-scatter a gradient: the same numbers as the unsharded computation.
        for n in [2usize, 3] {
            let out = spawn(n, Backend::Local, |pg| {
                let m = Gpt::new(GptConfig::tiny(), 0)?;
                let unit: Vec<Tensor> = m.parameters()[2..14].iter().map(|p| p.detach().reshape([-1])).collect();
                let flat = Tensor::cat(&unit, 0);
                let (padded, range) = pad_and_shard(flat.numel() as i64, pg.world_size(), pg.rank());
                let padded_flat = Tensor::zeros([padded], (Kind::Float, Device::Cpu));
                padded_flat.narrow(0, 0, flat.numel() as i64).copy_(&flat);
                let shard = padded_flat.narrow(0, range.start, range.end - range.start).copy();
                let back = gather_unit(pg, &shard)?;
                let grad = &padded_flat * (pg.rank() as f64 + 1.0);
                let g = reduce_scatter_grads(pg, &grad)?;
                let want =
                    padded_flat.narrow(0, range.start, range.end - range.start) * ((pg.world_size() + 1) as f64 / 2.0);
                Ok((back.equal(&padded_flat), g.allclose(&want, 1e-6, 1e-6, false)))
            })
            .unwrap();
            assert!(out.iter().all(|&(a, b)| a && b), "n={n}: gathered unit or averaged gradient shard differs: {out:?}");
        }
    }
}
