//! The stage runner every strategy uses, and activation checkpointing on it: recomputing a block
//! in backward gives bitwise the gradients of keeping its graph (same operations on the same
//! values), for one process and for ZeRO-3 with and without resharding after forward; each policy
//! recomputes exactly the blocks it names, counted by a model that counts its forwards.

use shardlab::data::{synthetic_corpus, DistributedSampler};
use shardlab::ddp::{self, DataParallel, Single, Variant};
use shardlab::model::{Batch, Gpt, GptConfig, Model};
use shardlab::prelude::*;
use shardlab::zero::{Stage, Zero};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const CFG: GptConfig = GptConfig { vocab_size: 16, block_size: 16, n_layer: 4, n_head: 2, n_embd: 32 };

/// Parameters as raw f32 bits, concatenated.
fn bits(p: &[Tensor]) -> Vec<u32> {
    let all = Tensor::cat(&p.iter().map(|t| t.reshape([-1])).collect::<Vec<_>>(), 0);
    Vec::<f32>::try_from(&all).unwrap().iter().map(|x| x.to_bits()).collect()
}

fn batch() -> Batch {
    DistributedSampler::new(16, 4, 0, 1, 3).unwrap().batch(&synthetic_corpus(4000, 7), 0)
}

/// A GPT that counts how often each stage's forward runs.
struct Counting {
    gpt: Gpt,
    calls: Arc<Vec<AtomicUsize>>,
}

impl Model for Counting {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.gpt.named_parameters()
    }
    fn num_stages(&self) -> usize {
        self.gpt.num_stages()
    }
    fn stage_forward(&self, s: usize, x: &Tensor, batch: &Batch) -> Tensor {
        self.calls[s].fetch_add(1, Ordering::Relaxed);
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

/// Gradients (as raw f32 bits) and forward counts per stage of one backward under `policy`.
fn single(policy: Checkpointing) -> (Vec<Vec<u32>>, Vec<usize>) {
    let calls = Arc::new((0..CFG.n_layer as usize + 2).map(|_| AtomicUsize::new(0)).collect::<Vec<_>>());
    let c = calls.clone();
    // One libtorch thread, pinned: the test binary's other tests spawn several ranks, which sets
    // the process's thread count to 1 while this one runs, and a reduction split over another
    // number of threads adds in another order — not a difference checkpointing made.
    let opts = SpawnOptions { threads_per_rank: Some(1), ..SpawnOptions::new(1, Backend::Local) };
    let grads = spawn_with(opts, move |pg| {
        let m = Counting { gpt: Gpt::new(CFG, 1)?, calls: c.clone() };
        let mut dp = Single::new(pg, Box::new(m))?;
        dp.set_checkpointing(policy);
        dp.backward(&batch(), 1.0)?;
        Ok(dp
            .model()
            .parameters()
            .iter()
            .map(|p| Vec::<f32>::try_from(&p.grad().reshape([-1])).unwrap().iter().map(|x| x.to_bits()).collect())
            .collect::<Vec<Vec<u32>>>())
    })
    .unwrap()
    .remove(0);
    (grads, calls.iter().map(|a| a.load(Ordering::Relaxed)).collect())
}

#[test]
fn checkpointed_gradients_are_bitwise_the_plain_ones() {
    let (plain, calls) = single(Checkpointing::None);
    assert_eq!(calls, vec![1; 6], "no checkpointing: every stage runs forward once");
    // Stages: 0 embeddings, 1..=4 blocks, 5 head + loss.
    for (policy, want) in [
        (Checkpointing::Full, vec![1, 2, 2, 2, 2, 1]),
        (Checkpointing::Every(2), vec![1, 2, 1, 2, 1, 1]),
        (Checkpointing::Every(3), vec![1, 2, 1, 1, 2, 1]),
        (Checkpointing::Every(9), vec![1, 2, 1, 1, 1, 1]),
    ] {
        let (g, calls) = single(policy);
        assert_eq!(calls, want, "{policy}: forwards per stage (recomputed blocks run twice)");
        assert!(g == plain, "{policy}: gradients must be bitwise those without checkpointing");
    }
}

#[test]
fn policies_parse_and_print() {
    for s in ["none", "full", "every:1", "every:3"] {
        assert_eq!(s.parse::<Checkpointing>().unwrap().to_string(), s);
    }
    for bad in ["every:0", "every:", "every:x", "some", ""] {
        let e = bad.parse::<Checkpointing>().unwrap_err();
        assert!(e.contains("none, full or every:K"), "{bad:?}: {e}");
    }
}

#[test]
fn zero3_resharding_and_checkpointing_combine() {
    // ZeRO-3 recomputes every block when it reshards after forward; without resharding, the
    // checkpoint policy decides. All four combinations take the same SGD step, bitwise, on 2 ranks;
    // and so does bucketed DDP with full checkpointing.
    let out = spawn(2, Backend::Local, |pg| {
        let data = synthetic_corpus(4000, 7);
        let s = DistributedSampler::new(16, 8, pg.rank(), 2, 1)?;
        let mut v = Vec::new();
        for (reshard, policy) in [
            (true, Checkpointing::None),
            (true, Checkpointing::Full),
            (false, Checkpointing::None),
            (false, Checkpointing::Full),
            (false, Checkpointing::Every(2)),
        ] {
            let mut z = Zero::new(pg, Box::new(Gpt::new(CFG, 1)?), Stage::Three)?.reshard_after_forward(reshard);
            z.set_checkpointing(policy);
            for step in 0..2 {
                ddp::train_step(&mut z, &mut Sgd, &s.batch(&data, step), 2, StepConfig::lr(0.5))?;
            }
            let p = z.full_parameters()?;
            v.push((format!("zero3 reshard={reshard} {policy}"), bits(&p)));
        }
        for policy in [Checkpointing::None, Checkpointing::Full] {
            let mut d = ddp::wrap(pg, Box::new(Gpt::new(CFG, 1)?), Variant::Bucketed, 16 * 1024)?;
            d.set_checkpointing(policy);
            for step in 0..2 {
                ddp::train_step(&mut *d, &mut Sgd, &s.batch(&data, step), 2, StepConfig::lr(0.5))?;
            }
            let p = d.full_parameters()?;
            v.push((format!("ddp {policy}"), bits(&p)));
        }
        Ok(v)
    })
    .unwrap();
    for per in out {
        let zero_ref = &per[0].1;
        for (what, p) in &per[1..5] {
            assert!(p == zero_ref, "{what}: must equal ZeRO-3 without checkpointing bitwise");
        }
        assert!(per[6].1 == per[5].1, "DDP with full checkpointing must equal DDP without, bitwise");
    }
}
