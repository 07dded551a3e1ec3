//! Lesson 02 — point-to-point & broadcast: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 02`. Hints: `cargo grade 02 --hint K`.
#![allow(unused_variables, unused_imports)]

use shardlab::prelude::*;

/// Exercise 1 — the binomial broadcast tree over relative ranks `v = (rank − root) mod n`.
///
/// Returns `(parent, children)` of `v`: the root (v = 0) has no parent; children are listed
/// biggest subtree first. Every rank is reached, and the depth is at most ⌈log2 n⌉.
pub fn tree_links(v: usize, n: usize) -> (Option<usize>, Vec<usize>) {
    // TODO: return v's parent (None for the root) and children, biggest subtree first, in the
    // binomial tree over n ranks (README; hints: `cargo grade 02 --hint 1`).
    todo!()
}

/// Exercise 2 — broadcast `t` from `root` to every rank using only `pg.send` and `pg.recv`,
/// along the tree of exercise 1: receive from your parent (unless you are the root), then send
/// to each of your children.
pub fn tree_broadcast(pg: &ProcessGroup, t: &mut Tensor, root: usize) -> CommResult<()> {
    // TODO: leave `root`'s `t` in `t` on every rank, moved only by `pg.send` and `pg.recv` along
    // exercise 1's tree rooted at `root` (README; hints: `cargo grade 02 --hint 2`).
    todo!()
}

/// Exercise 3 — make every rank start from rank 0's weights and prove it: broadcast every
/// parameter from rank 0, then compare `shardlab::params::checksum` across all ranks with
/// collectives. Returns the common checksum, or an error if any rank differs.
pub fn sync_and_verify(pg: &ProcessGroup, params: &mut [Tensor]) -> Result<u64, String> {
    // TODO: leave rank 0's values in every tensor of `params`; return the checksum every rank then
    // has, or an Err on every rank if any rank's differs (hints: `cargo grade 02 --hint 3`).
    todo!()
}
