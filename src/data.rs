//! Data for the GPT: nanoGPT/llm.c-style token files (a flat array of little-endian `u16` token
//! ids, no header), a deterministic synthetic corpus with learnable structure, random
//! fixed-length batches from a seeded generator, and the distributed sampler.
//!
//! The sampler draws the *global* batch of each step from `(seed, step)` alone and gives rank r
//! the rows `r·G/N .. (r+1)·G/N`: every rank draws the same offsets, the ranks' rows are disjoint
//! and together are exactly the global batch, so changing the world size changes the split and
//! not what is trained on — which is what makes N-rank training comparable with one process.

use crate::model::Batch;
use crate::rng::Rng;
use anyhow::{bail, Context};
use std::path::Path;
use tch::Tensor;

/// Tokens of the synthetic corpus: digits are ids 0–9, then these.
pub const SYNTH_PLUS: u16 = 10;
pub const SYNTH_EQUALS: u16 = 11;
pub const SYNTH_NEWLINE: u16 = 12;
/// Ids the synthetic corpus uses (any model vocabulary ≥ this works).
pub const SYNTH_VOCAB: u16 = 13;

/// A token stream in memory.
#[derive(Clone, Debug)]
pub struct Tokens(pub Vec<u16>);

impl Tokens {
    /// Read a token file: little-endian u16 ids, no header (nanoGPT's `train.bin`, llm.c without header).
    pub fn read(path: impl AsRef<Path>) -> anyhow::Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).with_context(|| format!("reading token file {}", path.display()))?;
        if bytes.len() % 2 != 0 {
            bail!("{}: {} bytes is not a whole number of u16 tokens", path.display(), bytes.len());
        }
        Ok(Tokens(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()))
    }
    /// Write as a token file (little-endian u16).
    pub fn write(&self, path: impl AsRef<Path>) -> anyhow::Result<()> {
        let path = path.as_ref();
        let bytes: Vec<u8> = self.0.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(path, bytes).with_context(|| format!("writing token file {}", path.display()))
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// Largest id (0 when empty).
    pub fn max_id(&self) -> u16 {
        self.0.iter().copied().max().unwrap_or(0)
    }
    /// Fail clearly unless every id fits a model with `vocab_size` and there is room for at
    /// least one (input, target) window of `seq_len`.
    pub fn check(&self, vocab_size: i64, seq_len: i64) -> anyhow::Result<()> {
        if (self.max_id() as i64) >= vocab_size {
            bail!("the data has token id {} but the model's vocab_size is {vocab_size}", self.max_id());
        }
        if (self.len() as i64) < seq_len + 1 {
            bail!("the data has {} tokens; a window of {seq_len} needs at least {}", self.len(), seq_len + 1);
        }
        Ok(())
    }
    /// Inputs `tokens[o..o+T]` and targets `tokens[o+1..o+T+1]` for each offset: (B, T) i64 each.
    pub fn windows(&self, offsets: &[usize], seq_len: usize) -> Batch {
        let mut x = Vec::with_capacity(offsets.len() * seq_len);
        let mut y = Vec::with_capacity(offsets.len() * seq_len);
        for &o in offsets {
            x.extend(self.0[o..o + seq_len].iter().map(|&t| t as i64));
            y.extend(self.0[o + 1..o + seq_len + 1].iter().map(|&t| t as i64));
        }
        let b = offsets.len() as i64;
        Batch {
            x: Tensor::from_slice(&x).view([b, seq_len as i64]),
            y: Tensor::from_slice(&y).view([b, seq_len as i64]),
        }
    }
    /// The evaluation windows: consecutive, non-overlapping, every complete one
    /// (window i: inputs `tokens[i·T .. i·T+T]`, targets shifted by one).
    pub fn eval_offsets(&self, seq_len: usize) -> Vec<usize> {
        if self.0.len() < seq_len + 1 {
            return vec![];
        }
        (0..(self.0.len() - 1) / seq_len).map(|i| i * seq_len).collect()
    }
}

/// The synthetic corpus: lines `a+b=c` in decimal (a, b < 1000, c their sum), one per line, as
/// token ids (digits 0–9, `+` 10, `=` 11, newline 12). Deterministic in `seed`. Structure a model
/// can learn step by step: the format first, then digit statistics, then the sums themselves.
pub fn synthetic_corpus(n_tokens: usize, seed: u64) -> Tokens {
    let mut rng = Rng::new(seed);
    let mut out = Vec::with_capacity(n_tokens + 16);
    let digits = |v: u64, out: &mut Vec<u16>| out.extend(v.to_string().bytes().map(|b| (b - b'0') as u16));
    while out.len() < n_tokens {
        let (a, b) = (rng.below(1000), rng.below(1000));
        digits(a, &mut out);
        out.push(SYNTH_PLUS);
        digits(b, &mut out);
        out.push(SYNTH_EQUALS);
        digits(a + b, &mut out);
        out.push(SYNTH_NEWLINE);
    }
    out.truncate(n_tokens);
    Tokens(out)
}

/// Render synthetic-corpus ids as text (for printing samples).
pub fn synthetic_text(ids: &[u16]) -> String {
    ids.iter()
        .map(|&t| match t {
            0..=9 => (b'0' + t as u8) as char,
            SYNTH_PLUS => '+',
            SYNTH_EQUALS => '=',
            SYNTH_NEWLINE => '\n',
            _ => '?',
        })
        .collect()
}

/// Random windows for data-parallel training (see the module docs).
#[derive(Clone, Debug)]
pub struct DistributedSampler {
    pub seq_len: usize,
    /// Rows per step over all ranks together.
    pub global_batch: usize,
    pub rank: usize,
    pub world_size: usize,
    pub seed: u64,
}

impl DistributedSampler {
    pub fn new(seq_len: usize, global_batch: usize, rank: usize, world_size: usize, seed: u64) -> anyhow::Result<Self> {
        if world_size == 0 || rank >= world_size {
            bail!("rank {rank} is not in a world of {world_size}");
        }
        if global_batch == 0 || global_batch % world_size != 0 {
            bail!("the global batch ({global_batch}) must be a positive multiple of the world size ({world_size})");
        }
        if seq_len == 0 {
            bail!("seq_len must be positive");
        }
        Ok(DistributedSampler { seq_len, global_batch, rank, world_size, seed })
    }
    /// Rows per rank.
    pub fn local_batch(&self) -> usize {
        self.global_batch / self.world_size
    }
    /// The global batch's window offsets for `step` (the same on every rank).
    pub fn global_offsets(&self, data: &Tokens, step: u64) -> Vec<usize> {
        assert!(
            data.len() > self.seq_len,
            "{} tokens cannot fill a window of {} plus its target (check the data with Tokens::check)",
            data.len(),
            self.seq_len
        );
        let span = (data.len() - self.seq_len) as u64; // offsets 0..=len−T−1
        let mut rng = Rng::new(self.seed ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        (0..self.global_batch).map(|_| rng.below(span) as usize).collect()
    }
    /// The window offsets of this rank's rows of step `step`: its contiguous slice of the global
    /// batch (rank r takes rows r·B/N .. (r+1)·B/N).
    pub fn local_offsets(&self, data: &Tokens, step: u64) -> Vec<usize> {
        let all = self.global_offsets(data, step);
        let b = self.local_batch();
        all[self.rank * b..(self.rank + 1) * b].to_vec()
    }
    /// This rank's rows of step `step`'s global batch.
    pub fn batch(&self, data: &Tokens, step: u64) -> Batch {
        data.windows(&self.local_offsets(data, step), self.seq_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corpus_is_deterministic_and_well_formed() {
        let a = synthetic_corpus(10_000, 1);
        assert_eq!(a.0, synthetic_corpus(10_000, 1).0);
        assert_ne!(a.0, synthetic_corpus(10_000, 2).0);
        assert!(a.max_id() < SYNTH_VOCAB);
        let text = synthetic_text(&a.0);
        for line in text.lines().take(100) {
            let (lhs, c) = line.split_once('=').unwrap();
            let (x, y) = lhs.split_once('+').unwrap();
            assert_eq!(x.parse::<u64>().unwrap() + y.parse::<u64>().unwrap(), c.parse::<u64>().unwrap(), "{line}");
        }
    }

    #[test]
    fn token_file_round_trip_and_errors() {
        let dir = std::env::temp_dir().join(format!("shardlab-data-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let t = Tokens(vec![0, 1, 65535, 7]);
        t.write(dir.join("a.bin")).unwrap();
        assert_eq!(std::fs::read(dir.join("a.bin")).unwrap(), vec![0, 0, 1, 0, 255, 255, 7, 0]);
        assert_eq!(Tokens::read(dir.join("a.bin")).unwrap().0, t.0);
        std::fs::write(dir.join("odd.bin"), [1u8, 2, 3]).unwrap();
        assert!(Tokens::read(dir.join("odd.bin")).unwrap_err().to_string().contains("whole number"));
        assert!(t.check(1000, 2).unwrap_err().to_string().contains("65535"));
        assert!(t.check(65536, 4).unwrap_err().to_string().contains("at least 5"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn ranks_split_the_same_global_batch() {
        let data = synthetic_corpus(5000, 3);
        let one = DistributedSampler::new(8, 12, 0, 1, 9).unwrap().batch(&data, 5);
        for n in [2, 3, 4] {
            let parts: Vec<Batch> =
                (0..n).map(|r| DistributedSampler::new(8, 12, r, n, 9).unwrap().batch(&data, 5)).collect();
            let x = Tensor::cat(&parts.iter().map(|b| b.x.shallow_clone()).collect::<Vec<_>>(), 0);
            assert!(x.equal(&one.x), "n={n}: the ranks' rows must concatenate to the 1-rank batch");
        }
        assert!(one.y.narrow(1, 0, 7).equal(&one.x.narrow(1, 1, 7)), "targets are inputs shifted by one");
        assert!(DistributedSampler::new(8, 10, 0, 4, 0).is_err());
        let other_step = DistributedSampler::new(8, 12, 0, 1, 9).unwrap().batch(&data, 6);
        assert!(!other_step.x.equal(&one.x));
    }

    #[test]
    fn eval_windows_are_consecutive_and_complete() {
        let t = Tokens((0..21).collect());
        assert_eq!(t.eval_offsets(5), vec![0, 5, 10, 15]); // window 15..20, target up to 20
        assert_eq!(Tokens((0..20).collect()).eval_offsets(5), vec![0, 5, 10]);
    }
}
