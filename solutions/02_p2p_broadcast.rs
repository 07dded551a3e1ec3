//! Lesson 02 — point-to-point & broadcast: reference answers.
//! Same signatures as `lessons/02_p2p_broadcast/exercise.rs`; graded by `tests/lesson02.rs`.

use shardlab::prelude::*;

/// Exercise 1 — the binomial broadcast tree over relative ranks `v = (rank − root) mod n`.
///
/// Returns `(parent, children)` of `v`: the root (v = 0) has no parent; children are listed
/// biggest subtree first. Every rank is reached, and the depth is at most ⌈log2 n⌉.
pub fn tree_links(v: usize, n: usize) -> (Option<usize>, Vec<usize>) {
    // v's parent clears v's lowest set bit; v's children set each lower bit (v + 2^k < n).
    let low = v & v.wrapping_neg();
    let (parent, mask) = if v == 0 { (None, n.next_power_of_two()) } else { (Some(v - low), low) };
    let mut children = Vec::new();
    let mut m = mask >> 1;
    while m > 0 {
        if v + m < n {
            children.push(v + m);
        }
        m >>= 1;
    }
    (parent, children)
}

/// Exercise 2 — broadcast `t` from `root` to every rank using only `pg.send` and `pg.recv`,
/// along the tree of exercise 1: receive from your parent (unless you are the root), then send
/// to each of your children.
pub fn tree_broadcast(pg: &ProcessGroup, t: &mut Tensor, root: usize) -> CommResult<()> {
    let n = pg.world_size();
    let v = (pg.rank() + n - root) % n;
    let (parent, children) = tree_links(v, n);
    if let Some(p) = parent {
        pg.recv(t, (p + root) % n)?;
    }
    for c in children {
        pg.send(t, (c + root) % n)?;
    }
    Ok(())
}

/// Exercise 3 — make every rank start from rank 0's weights and prove it: broadcast every
/// parameter from rank 0, then compare `shardlab::params::checksum` across all ranks with
/// collectives. Returns the common checksum, or an error if any rank differs.
pub fn sync_and_verify(pg: &ProcessGroup, params: &mut [Tensor]) -> Result<u64, String> {
    shardlab::params::broadcast_params(pg, params, 0).map_err(|e| e.to_string())?;
    let sum = shardlab::params::checksum(params);
    // The same value on every rank ⇔ max == min.
    let mut hi = Tensor::from_slice(&[sum as i64]);
    let mut lo = hi.copy();
    pg.all_reduce(&mut hi, ReduceOp::Max).map_err(|e| e.to_string())?;
    pg.all_reduce(&mut lo, ReduceOp::Min).map_err(|e| e.to_string())?;
    if hi.int64_value(&[0]) != lo.int64_value(&[0]) {
        return Err(format!("rank {} checksum {sum:#x}: ranks disagree after the broadcast", pg.rank()));
    }
    Ok(sum)
}
