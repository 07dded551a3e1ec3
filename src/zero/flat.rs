//! Flat, padded, sharded parameter groups: the layout FSDP and ZeRO share.
//!
//! A unit's tensors are laid end to end in one flat buffer of `total` elements, padded with zeros
//! to `padded` = ⌈total / N⌉·N so that it splits into N equal shards of `shard` elements; rank r
//! owns elements `r·shard .. (r+1)·shard`. A shard may cut a tensor anywhere.

use std::ops::Range;
use tch::{Kind, Tensor};

/// Where each tensor of a unit lives in its flat buffer, and how the buffer is sharded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatLayout {
    pub shapes: Vec<Vec<i64>>,
    pub offsets: Vec<i64>,
    pub total: i64,
    pub padded: i64,
    pub shard: i64,
    pub world_size: usize,
}

impl FlatLayout {
    /// Layout of tensors with these shapes, sharded over `world_size` ranks.
    pub fn new(shapes: Vec<Vec<i64>>, world_size: usize) -> Self {
        assert!(world_size >= 1, "world_size must be at least 1");
        let mut offsets = Vec::with_capacity(shapes.len());
        let mut total = 0;
        for s in &shapes {
            offsets.push(total);
            total += s.iter().product::<i64>();
        }
        let n = world_size as i64;
        let shard = (total + n - 1) / n;
        FlatLayout { shapes, offsets, total, padded: shard * n, shard, world_size }
    }
    /// Elements of tensor `i`.
    pub fn numel(&self, i: usize) -> i64 {
        self.shapes[i].iter().product()
    }
    /// The flat elements rank `rank` owns.
    pub fn shard_range(&self, rank: usize) -> Range<i64> {
        rank as i64 * self.shard..(rank as i64 + 1) * self.shard
    }
    /// A zeroed (padded,) f32 buffer on the CPU.
    pub fn zeros(&self) -> Tensor {
        self.zeros_on(tch::Device::Cpu)
    }
    /// A zeroed (padded,) f32 buffer on `device`.
    pub fn zeros_on(&self, device: tch::Device) -> Tensor {
        Tensor::zeros([self.padded], (Kind::Float, device))
    }
    /// Tensor `i` as a view into `flat` (a buffer of this layout).
    pub fn view(&self, flat: &Tensor, i: usize) -> Tensor {
        flat.narrow(0, self.offsets[i], self.numel(i)).view(self.shapes[i].as_slice())
    }
    /// Copy `tensors` into a new padded flat buffer (padding zero).
    pub fn flatten(&self, tensors: &[Tensor]) -> Tensor {
        let flat = self.zeros_on(tensors.first().map_or(tch::Device::Cpu, |t| t.device()));
        for (i, t) in tensors.iter().enumerate() {
            flat.narrow(0, self.offsets[i], self.numel(i)).copy_(&t.detach().reshape([-1]));
        }
        flat
    }
    /// For each tensor, the part of it inside rank `rank`'s shard:
    /// `(tensor index, range within the tensor, range within the shard)`.
    pub fn shard_pieces(&self, rank: usize) -> Vec<(usize, Range<i64>, Range<i64>)> {
        let r = self.shard_range(rank);
        (0..self.shapes.len())
            .filter_map(|i| {
                let (lo, hi) = (self.offsets[i].max(r.start), (self.offsets[i] + self.numel(i)).min(r.end));
                (lo < hi).then(|| (i, lo - self.offsets[i]..hi - self.offsets[i], lo - r.start..hi - r.start))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pads_to_a_multiple_and_pieces_cover_everything_once() {
        for n in 1..=5 {
            let l = FlatLayout::new(vec![vec![3, 2], vec![5], vec![], vec![1, 4]], n);
            assert_eq!(l.total, 16);
            assert_eq!(l.padded % n as i64, 0);
            assert!(l.padded >= 16 && l.padded < 16 + n as i64);
            let mut covered = vec![0; 16];
            for r in 0..n {
                for (i, within, in_shard) in l.shard_pieces(r) {
                    assert_eq!(within.end - within.start, in_shard.end - in_shard.start);
                    for k in within {
                        covered[(l.offsets[i] + k) as usize] += 1;
                    }
                }
            }
            assert!(covered.iter().all(|&c| c == 1), "n={n}: {covered:?}");
        }
        let l = FlatLayout::new(vec![vec![2, 2], vec![3]], 2);
        let flat =
            l.flatten(&[Tensor::ones([2, 2], tch::kind::FLOAT_CPU), Tensor::full([3], 2.0, tch::kind::FLOAT_CPU)]);
        assert_eq!(Vec::<f32>::try_from(&flat).unwrap(), vec![1., 1., 1., 1., 2., 2., 2., 0.]);
        assert_eq!(Vec::<f32>::try_from(&l.view(&flat, 1)).unwrap(), vec![2., 2., 2.]);
    }
}
