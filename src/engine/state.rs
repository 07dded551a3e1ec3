//! What an engine's rank holds, for checkpoints ([`Holder`]): each parameter of its piece is a
//! slice of a GPT tensor — the boxes tensor parallelism cut ([`split_of`]) — held whole (DDP over
//! the data dimension: the replicas split the writing) or as ZeRO's flat shard ranges. Of the
//! copies over the model-parallel dimensions (a LayerNorm on every tensor rank, the tied wte on the
//! first and last stage) the rank that counts a gradient in the global norm writes its value.

use super::step::groups;
use super::Engine;
use crate::checkpoint::plan::Region;
use crate::checkpoint::{HeldPiece, HeldSlot, Holder};
use crate::comm::{CommResult, ProcessGroup};
use crate::model::GptConfig;
use crate::tp::{split_of, Split};
use std::ops::Range;

/// The boxes of GPT tensor `k` that tensor rank `r` of `t` holds, in the order of its slice's
/// elements (c_attn's q, k and v rows of its heads: three boxes).
pub fn tp_boxes(cfg: &GptConfig, k: usize, t: usize, r: usize) -> Vec<Region> {
    let shape = cfg.param_shapes()[k].1.clone();
    let (t, r) = (t as i64, r as i64);
    let part = |dim: usize| {
        let n = shape[dim] / t;
        vec![Region::slice(&shape, dim, r * n, n)]
    };
    match split_of(cfg, k) {
        Split::Replicated => vec![Region::whole(&shape)],
        Split::Rows => part(0),
        Split::Columns => part(1),
        Split::QkvRows => {
            let third = shape[0] / 3;
            let n = third / t;
            (0..3).map(|q| Region::slice(&shape, 0, q * third + r * n, n)).collect()
        }
    }
}

/// The pieces of GPT tensors that flat range `within` of a rank's slice `boxes` (of tensor `k`),
/// at `at` in its slot, covers: one per box it touches.
fn pieces_of(k: usize, boxes: &[Region], within: &Range<i64>, at: &Range<i64>) -> Vec<HeldPiece> {
    let mut out = Vec::new();
    let mut start = 0;
    for b in boxes {
        let end = start + b.numel();
        let (lo, hi) = (within.start.max(start), within.end.min(end));
        if lo < hi {
            let at = at.start + (lo - within.start)..at.start + (hi - within.start);
            out.push(HeldPiece { tensor: k, region: b.clone(), within: lo - start..hi - start, at });
        }
        start = end;
    }
    out
}

impl Holder for Engine {
    fn groups(&self) -> Vec<&ProcessGroup> {
        groups(&self.mesh).to_vec()
    }
    fn global_rank(&self) -> usize {
        groups(&self.mesh).iter().fold(0, |acc, g| acc * g.world_size() + g.rank())
    }
    fn replicas(&self) -> &ProcessGroup {
        self.mesh.group("dp")
    }
    fn tensors(&self) -> Vec<(String, Vec<i64>)> {
        self.cfg.param_shapes()
    }
    /// DDP: a slot per parameter of the piece, replicated over dp, written by the rank that counts
    /// it. ZeRO: a slot per unit (its master shard), written by the ranks that count the unit.
    fn held_slots(&self) -> anyhow::Result<Vec<HeldSlot>> {
        let tp = self.mesh.group("tp");
        let idx = self.piece.indices();
        let boxes: Vec<Vec<Region>> = idx.iter().map(|&k| tp_boxes(&self.cfg, k, tp.world_size(), tp.rank())).collect();
        // The boxes must be the piece's parameters, element for element.
        let shapes = self.cfg.param_shapes();
        for (j, &k) in idx.iter().enumerate() {
            let n: i64 = boxes[j].iter().map(|b| b.numel()).sum();
            let whole: i64 = shapes[k].1.iter().product();
            let held = self.shards.is_some() || self.piece.params()[j].numel() as i64 == n;
            anyhow::ensure!(
                held && (n * tp.world_size() as i64 == whole || n == whole),
                "{}: tensor rank {}'s boxes hold {n} of its {whole} elements",
                shapes[k].0,
                tp.rank()
            );
        }
        Ok(match &self.shards {
            None => {
                let counted = self.piece.counted(&self.mesh);
                let params = self.piece.params();
                params
                    .into_iter()
                    .enumerate()
                    .map(|(j, p)| {
                        let n = p.numel() as i64;
                        HeldSlot {
                            pieces: pieces_of(idx[j], &boxes[j], &(0..n), &(0..n)),
                            master: p.detach(),
                            replicated: true,
                            writes: counted[j],
                        }
                    })
                    .collect()
            }
            Some(s) => s
                .shard_pieces(self.mesh.group("dp").rank())
                .into_iter()
                .map(|(shard, pieces, counted)| HeldSlot {
                    master: shard,
                    pieces: pieces.iter().flat_map(|(j, w, a)| pieces_of(idx[*j], &boxes[*j], w, a)).collect(),
                    replicated: false,
                    writes: counted,
                })
                .collect(),
        })
    }
    /// ZeRO-1/2: the loaded master shards all-gathered into the piece's parameters.
    fn loaded(&mut self) -> CommResult<()> {
        let dp = self.mesh.group("dp");
        match self.shards.as_mut() {
            Some(s) => s.updated(dp),
            None => Ok(()),
        }
    }
}
