//! Lesson 02 — point-to-point & broadcast: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 02`. Hints: `cargo grade 02 --hint K`.
#![allow(unused_variables, unused_imports)]

use shardlab::prelude::*;

/// Exercise 1 — the binomial broadcast tree over relative ranks `v = (rank − root) mod n`.
///
/// Returns `(parent, children)` of `v`: the root (v = 0) has no parent; children are listed
/// biggest subtree first. Every rank is reached, and the depth is at most ⌈log2 n⌉.
pub fn tree_links(v: usize, n: usize) -> (Option<usize>, Vec<usize>) {
    // TODO: v's parent and children in the binomial tree over n ranks, biggest subtree first
    // (README; hints: `cargo grade 02 --hint 1`).
    todo!()
}

/// Exercise 2 — broadcast `t` from `root` to every rank using only `pg.send` and `pg.recv`,
/// along the tree of exercise 1: receive from your parent (unless you are the root), then send
/// to each of your children.
pub fn tree_broadcast(pg: &ProcessGroup, t: &mut Tensor, root: usize) -> CommResult<()> {
    // TODO: the tree of exercise 1, rooted at `root` instead of 0: receive from your parent, send
    // to your children (README; hints: `cargo grade 02 --hint 2`).
    todo!()
}

/// Exercise 3 — make every rank start from rank 0's weights and prove it: broadcast every
/// parameter from rank 0, then compare `shardlab::params::checksum` across all ranks with
/// collectives. Returns the common checksum, or an error if any rank differs.
pub fn sync_and_verify(pg: &ProcessGroup, params: &mut [Tensor]) -> Result<u64, String> {
    // TODO: broadcast every tensor from rank 0, compute shardlab::params::checksum, compare it
    // across ranks (hint: all_reduce Max and Min of an i64 tensor) and return it or an error.
    todo!()
}
