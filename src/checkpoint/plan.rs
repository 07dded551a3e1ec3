//! Resharding as interval arithmetic: which saved pieces cover the range a rank wants.
//!
//! A checkpoint stores each logical tensor (a parameter, or one of AdamW's moments for it) as
//! *pieces*: flat element ranges `[lo, hi)` of the tensor flattened in row-major order, each in
//! one rank's file. A loading rank wants its own ranges — the whole tensor (DDP), or the part of
//! it inside its shard (ZeRO, at any world size). The reads are the intersections of wanted and
//! saved ranges; nothing else is read, and nothing is gathered in one place.
//!
//! Under tensor parallelism a rank's tensor is a *box* of the whole one ([`Region`]: offsets and
//! sizes per dimension, DCP's chunks) — a row-parallel weight's columns, the q, k and v rows of
//! a rank's heads — and a piece is a flat range of that box. Its elements are *runs* of the whole
//! tensor's flat order, one per row of the box it touches ([`runs`]); [`plan_region_reads`]
//! intersects wanted runs with saved runs the same way.

use serde::{Deserialize, Serialize};
use std::ops::Range;

/// One read: `len` elements from saved piece `piece` starting `src` elements into it, landing
/// `dst` elements into the wanted range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Read {
    pub piece: usize,
    pub src: i64,
    pub dst: i64,
    pub len: i64,
}

/// The reads that fill `want` from `saved` (pieces of one tensor, in any order, each a range of
/// its flat elements). Every element of `want` must be covered exactly once by the saved pieces
/// (a checkpoint's pieces of one tensor do not overlap); an element covered by none is an error
/// naming the first gap, and two pieces covering the same element are an error too.
pub fn plan_reads(saved: &[Range<i64>], want: Range<i64>) -> Result<Vec<Read>, String> {
    let mut hits: Vec<(i64, i64, usize)> = saved
        .iter()
        .enumerate()
        .filter_map(|(k, r)| {
            let (lo, hi) = (r.start.max(want.start), r.end.min(want.end));
            (lo < hi).then_some((lo, hi, k))
        })
        .collect();
    hits.sort_unstable();
    let mut reads = Vec::with_capacity(hits.len());
    let mut next = want.start;
    for (lo, hi, k) in hits {
        if lo > next {
            return Err(format!("elements {next}..{lo} are in no saved piece"));
        }
        if lo < next {
            return Err(format!("elements {lo}..{} are in two saved pieces", next.min(hi)));
        }
        reads.push(Read { piece: k, src: lo - saved[k].start, dst: lo - want.start, len: hi - lo });
        next = hi;
    }
    if next < want.end {
        return Err(format!("elements {next}..{} are in no saved piece", want.end));
    }
    Ok(reads)
}

/// The part of `0..numel` rank `rank` of `world_size` writes of a tensor every rank holds whole
/// (replicated strategies): contiguous, balanced, together covering the tensor exactly once.
pub fn owned_range(numel: i64, rank: usize, world_size: usize) -> Range<i64> {
    let (r, n) = (rank as i64, world_size as i64);
    numel * r / n..numel * (r + 1) / n
}

/// A box of a tensor: where a rank's slice of it sits, as the offset and size along each
/// dimension (PyTorch DCP's chunk `offsets`/`sizes`). The slice's elements are the box's, in
/// row-major order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    pub offsets: Vec<i64>,
    pub sizes: Vec<i64>,
}

impl Region {
    /// The whole of a tensor of `shape`.
    pub fn whole(shape: &[i64]) -> Region {
        Region { offsets: vec![0; shape.len()], sizes: shape.to_vec() }
    }
    /// Rows `lo..lo + n` along dimension `dim` of a tensor of `shape`, the rest whole.
    pub fn slice(shape: &[i64], dim: usize, lo: i64, n: i64) -> Region {
        let mut r = Region::whole(shape);
        r.offsets[dim] = lo;
        r.sizes[dim] = n;
        r
    }
    pub fn numel(&self) -> i64 {
        self.sizes.iter().product()
    }
    /// Whether it is the whole of a tensor of `shape`.
    pub fn is_whole(&self, shape: &[i64]) -> bool {
        self.offsets.iter().all(|&o| o == 0) && self.sizes == shape
    }
    /// An error unless it lies inside a tensor of `shape`.
    pub fn check(&self, shape: &[i64]) -> Result<(), String> {
        let inside = self.offsets.len() == shape.len()
            && self.sizes.len() == shape.len()
            && shape.iter().zip(&self.offsets).zip(&self.sizes).all(|((&d, &o), &n)| o >= 0 && n >= 0 && o + n <= d);
        if inside {
            Ok(())
        } else {
            Err(format!(
                "the box at {:?} of size {:?} is not inside a tensor of shape {shape:?}",
                self.offsets, self.sizes
            ))
        }
    }
}

/// Elements `global..global + len` of a whole tensor's flat order, which are elements
/// `offset..offset + len` of a piece (or of a wanted range).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub global: i64,
    pub len: i64,
    pub offset: i64,
}

/// The runs of the whole tensor (`shape`) that flat range `r` of box `region` covers: one per
/// row of the box it touches, adjacent runs merged (one run when the box spans the trailing
/// dimensions whole). `offset`s count from `r.start`.
pub fn runs(shape: &[i64], region: &Region, r: Range<i64>) -> Vec<Run> {
    if r.is_empty() {
        return Vec::new();
    }
    let d = shape.len();
    if d == 0 || region.is_whole(shape) {
        return vec![Run { global: r.start, len: r.end - r.start, offset: 0 }];
    }
    let row = region.sizes[d - 1];
    let mut stride = vec![1i64; d];
    for k in (0..d - 1).rev() {
        stride[k] = stride[k + 1] * shape[k + 1];
    }
    let mut out: Vec<Run> = Vec::new();
    for q in r.start / row..=(r.end - 1) / row {
        // Row q of the box: its index along the leading dimensions, then its place in the whole.
        let (mut rem, mut base) = (q, region.offsets[d - 1]);
        for k in (0..d - 1).rev() {
            base += (region.offsets[k] + rem % region.sizes[k]) * stride[k];
            rem /= region.sizes[k];
        }
        let (lo, hi) = (r.start.max(q * row), r.end.min((q + 1) * row));
        let (global, offset) = (base + lo - q * row, lo - r.start);
        match out.last_mut() {
            Some(l) if l.global + l.len == global && l.offset + l.len == offset => l.len += hi - lo,
            _ => out.push(Run { global, len: hi - lo, offset }),
        }
    }
    out
}

/// [`plan_reads`] for boxes: the reads that fill the wanted runs (`want`, offsets into the wanted
/// range) from the saved pieces (`saved[k]`: piece k's runs, offsets into the piece). The same
/// rules: every wanted element in exactly one saved piece, or an error naming the elements (flat
/// indices of the whole tensor). Reads contiguous in both the piece and the wanted range merge.
pub fn plan_region_reads(saved: &[Vec<Run>], want: &[Run]) -> Result<Vec<Read>, String> {
    let mut s: Vec<(i64, i64, usize, i64)> = saved
        .iter()
        .enumerate()
        .flat_map(|(k, rs)| rs.iter().map(move |r| (r.global, r.global + r.len, k, r.offset)))
        .filter(|r| r.0 < r.1)
        .collect();
    s.sort_unstable();
    if let Some(w) = s.windows(2).find(|w| w[0].1 > w[1].0) {
        return Err(format!("elements {}..{} are in two saved pieces", w[1].0, w[0].1.min(w[1].1)));
    }
    let mut reads: Vec<Read> = Vec::new();
    for w in want {
        let (mut next, end) = (w.global, w.global + w.len);
        let mut k = s.partition_point(|x| x.1 <= next);
        while next < end {
            match s.get(k) {
                Some(&(lo, hi, piece, offset)) if lo <= next => {
                    let hi = hi.min(end);
                    let read = Read { piece, src: offset + next - lo, dst: w.offset + next - w.global, len: hi - next };
                    match reads.last_mut() {
                        Some(l) if l.piece == piece && l.src + l.len == read.src && l.dst + l.len == read.dst => {
                            l.len += read.len
                        }
                        _ => reads.push(read),
                    }
                    next = hi;
                    k += 1;
                }
                other => {
                    let to = other.map_or(end, |x| x.0.min(end));
                    return Err(format!("elements {next}..{to} are in no saved piece"));
                }
            }
        }
    }
    Ok(reads)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A (4, 6) tensor saved as two column halves (row-parallel slices: 4 runs each) and loaded
    /// as row halves, as flat pieces of a box, and whole: every element lands where it belongs
    /// (checked element by element against the tensor's own values).
    #[test]
    fn boxes_reshard_into_any_other_boxes() {
        let shape = [4i64, 6];
        let value = |g: i64| g as f32; // the whole tensor: element g holds g
        let piece = |reg: &Region, r: Range<i64>| -> Vec<f32> {
            let mut v = vec![0.0; (r.end - r.start) as usize];
            for run in runs(&shape, reg, r) {
                for i in 0..run.len {
                    v[(run.offset + i) as usize] = value(run.global + i);
                }
            }
            v
        };
        let left = Region::slice(&shape, 1, 0, 3);
        let right = Region::slice(&shape, 1, 3, 3);
        assert_eq!(runs(&shape, &left, 0..12).len(), 4);
        // Saved: the left half whole, the right half as two flat ranges of its box.
        let saved_boxes = [(left.clone(), 0..12), (right.clone(), 0..5), (right.clone(), 5..12)];
        let saved: Vec<Vec<Run>> = saved_boxes.iter().map(|(b, r)| runs(&shape, b, r.clone())).collect();
        let data: Vec<Vec<f32>> = saved_boxes.iter().map(|(b, r)| piece(b, r.clone())).collect();
        for (want_box, want_range) in [
            (Region::slice(&shape, 0, 1, 2), 0..12),
            (Region::slice(&shape, 0, 1, 2), 4..9),
            (Region::whole(&shape), 0..24),
            (Region::whole(&shape), 7..20),
            (right.clone(), 2..10),
            (Region { offsets: vec![1, 2], sizes: vec![2, 3] }, 0..6),
        ] {
            let want = runs(&shape, &want_box, want_range.clone());
            let mut got = vec![f32::NAN; (want_range.end - want_range.start) as usize];
            for r in plan_region_reads(&saved, &want).unwrap() {
                for i in 0..r.len {
                    got[(r.dst + i) as usize] = data[r.piece][(r.src + i) as usize];
                }
            }
            assert_eq!(got, piece(&want_box, want_range.clone()), "{want_box:?} {want_range:?}");
        }
        // Whole-tensor pieces plan as plan_reads does.
        let flat: Vec<Vec<Run>> =
            [4..7, 0..4, 7..10].iter().map(|r| runs(&[10], &Region::whole(&[10]), r.clone())).collect();
        let want = runs(&[10], &Region::whole(&[10]), 0..5);
        assert_eq!(plan_region_reads(&flat, &want).unwrap(), plan_reads(&[4..7, 0..4, 7..10], 0..5).unwrap());
        // Gaps and overlaps are errors.
        let half = vec![runs(&shape, &left, 0..12)];
        assert!(plan_region_reads(&half, &runs(&shape, &Region::whole(&shape), 0..24))
            .unwrap_err()
            .contains("3..6 are in no saved piece"));
        let twice = vec![runs(&shape, &left, 0..12), runs(&shape, &Region::slice(&shape, 1, 2, 2), 0..8)];
        assert!(plan_region_reads(&twice, &[]).unwrap_err().contains("two saved pieces"));
        assert!(Region::slice(&shape, 1, 4, 3).check(&shape).is_err());
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)]
    fn reads_cover_the_wanted_range_from_any_sharding() {
        // Saved by 3 ranks (10 elements: 0..4, 4..7, 7..10), wanted by 2 ranks of 4 (0..5, 5..10).
        let saved = [4..7, 0..4, 7..10];
        let r = plan_reads(&saved, 0..5).unwrap();
        assert_eq!(r, vec![Read { piece: 1, src: 0, dst: 0, len: 4 }, Read { piece: 0, src: 0, dst: 4, len: 1 }]);
        let r = plan_reads(&saved, 5..10).unwrap();
        assert_eq!(r, vec![Read { piece: 0, src: 1, dst: 0, len: 2 }, Read { piece: 2, src: 0, dst: 2, len: 3 }]);
        assert_eq!(plan_reads(&saved, 3..3).unwrap(), vec![]);
        assert!(plan_reads(&[0..4, 5..10], 0..10).unwrap_err().contains("4..5"));
        assert!(plan_reads(&[0..6, 5..10], 0..10).unwrap_err().contains("two saved pieces"));
        assert!(plan_reads(&[0..4], 0..10).unwrap_err().contains("4..10"));
        for n in 1..6 {
            let parts: Vec<Range<i64>> = (0..n).map(|r| owned_range(13, r, n)).collect();
            assert_eq!(parts.iter().map(|r| r.end - r.start).sum::<i64>(), 13);
            assert!(parts.windows(2).all(|w| w[0].end == w[1].start));
        }
    }
}
