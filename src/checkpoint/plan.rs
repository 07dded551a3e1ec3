//! Resharding as interval arithmetic: which saved pieces cover the range a rank wants.
//!
//! A checkpoint stores each logical tensor (a parameter, or one of AdamW's moments for it) as
//! *pieces*: flat element ranges `[lo, hi)` of the tensor flattened in row-major order, each in
//! one rank's file. A loading rank wants its own ranges — the whole tensor (DDP), or the part of
//! it inside its shard (ZeRO, at any world size). The reads are the intersections of wanted and
//! saved ranges; nothing else is read, and nothing is gathered in one place.

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

#[cfg(test)]
mod tests {
    use super::*;

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
