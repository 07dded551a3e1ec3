//! Binomial-tree broadcast: ⌈log2 n⌉ rounds; every rank forwards each chunk to its children as
//! soon as it has landed, so large messages are pipelined down the tree.

use super::Ctx;
use crate::comm::error::CommResult;

/// Parent and children of relative rank `v` (= (rank − root) mod n) in a binomial broadcast tree.
/// Children are listed biggest subtree first.
pub fn binomial_tree(v: usize, n: usize) -> (Option<usize>, Vec<usize>) {
    let (parent, mask) =
        if v == 0 { (None, n.next_power_of_two()) } else { (Some(v - (v & v.wrapping_neg())), v & v.wrapping_neg()) };
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

pub(crate) fn broadcast(c: &Ctx, buf: &mut [u8], root: usize) -> CommResult<()> {
    let v = (c.rank + c.n - root) % c.n;
    let (parent, children) = binomial_tree(v, c.n);
    let children: Vec<usize> = children.into_iter().map(|k| (k + root) % c.n).collect();
    let Some(pv) = parent else {
        // Root: chunk by chunk to every child, so the first chunk is travelling down the tree
        // while the rest is still being sent.
        if buf.is_empty() {
            return children.iter().try_for_each(|&k| c.send(k, buf));
        }
        return buf.chunks(c.chunk).try_for_each(|ch| children.iter().try_for_each(|&k| c.send(k, ch)));
    };
    // Forward each frame down the tree as soon as it has landed (pipelining).
    c.recv_forward((pv + root) % c.n, buf, &mut |_, b| children.iter().try_for_each(|&k| c.send(k, b)))
}
