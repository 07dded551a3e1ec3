//! What a collective costs on a simulated cluster: the course's ring (lesson 03) on the links a
//! group's placement uses, and NCCL's tree for latency at scale.
//!
//! For a buffer of B bytes on a group of n ranks, α a step's latency and `bw` the group's bus
//! bandwidth (per GPU and direction):
//!
//! ```text
//! ring all-reduce          2(n−1)·α + 2·(n−1)/n · B / bw      (reduce-scatter, then all-gather)
//! ring reduce-scatter      (n−1)·α +   (n−1)/n · B / bw       (B: the whole buffer, each keeps B/n)
//! ring all-gather          (n−1)·α +   (n−1)/n · B / bw       (B: the whole gathered buffer)
//! tree all-reduce          2·(⌈log2 nodes⌉·α_ib + (k−1)·α_nv) + 2·(n−1)/n · B / bw
//! send / recv              α + B / bw                        (NVLink in a node, else a NIC)
//! ```
//!
//! The hierarchy: a group of n ranks with k on each node it spans. Within one node the bus is
//! NVLink. Across nodes NCCL runs k rings side by side, one per NIC (channels), and each ring
//! crosses between nodes once per node, so the bytes that leave a node go through k NICs:
//! `bw = min(NVLink, k × NIC)` (each at what NCCL reaches of its line rate, `Link::efficiency`).
//! That is why a data-parallel group with one rank per node (tp 8 fills the node) all-reduces at
//! one NIC's speed, 25 GB/s on A100 nodes, and one with eight ranks per node at up to 200 GB/s.
//! NCCL picks the tree when its latency term wins (small messages, many nodes); so here. The ring's
//! latency is charged at the slower link's α on every step once the group spans nodes (NCCL pays
//! it on the steps that cross only): an overestimate for small messages on few nodes.

use super::hardware::Gpu;
use serde::{Deserialize, Serialize};

/// A collective's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Coll {
    AllReduce,
    ReduceScatter,
    AllGather,
    /// One message between two ranks of the group (a pipeline's activations).
    SendRecv,
}

/// Where a group's ranks sit: `size` ranks, `per_node` of them on each node the group spans
/// (`per_node == size`: the group is inside one node).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub size: usize,
    pub per_node: usize,
}

impl Placement {
    /// The nodes the group spans.
    pub fn nodes(&self) -> usize {
        self.size.div_ceil(self.per_node.max(1))
    }

    /// A group of `size` ranks whose members are `stride` ranks apart, on nodes of
    /// `gpus_per_node` GPUs numbered in order (Megatron's rank order: tp innermost, then dp,
    /// then pp): how many of its members share a node.
    pub fn strided(size: usize, stride: usize, gpus_per_node: usize) -> Placement {
        let per_node = if stride >= gpus_per_node { 1 } else { (gpus_per_node / stride).clamp(1, size.max(1)) };
        Placement { size, per_node }
    }
}

/// The group's bus bandwidth, bytes per second per GPU and direction (module docs).
pub fn bus_bandwidth(gpu: &Gpu, at: Placement) -> f64 {
    if at.nodes() <= 1 {
        gpu.intra.achieved()
    } else {
        gpu.intra.achieved().min(at.per_node as f64 * gpu.inter.achieved())
    }
}

/// Seconds for `op` on `bytes` (the whole buffer: an all-reduce's input, a reduce-scatter's
/// input, an all-gather's output, a message) over a group placed at `at`. Zero for a group of
/// one rank.
pub fn time(gpu: &Gpu, op: Coll, bytes: f64, at: Placement) -> f64 {
    let n = at.size as f64;
    if at.size <= 1 || bytes <= 0.0 {
        return 0.0;
    }
    let bw = bus_bandwidth(gpu, at);
    let alpha = if at.nodes() > 1 { gpu.inter.alpha } else { gpu.intra.alpha };
    let part = (n - 1.0) / n * bytes / bw;
    match op {
        Coll::AllReduce => {
            let ring = 2.0 * (n - 1.0) * alpha + 2.0 * part;
            let levels = (at.nodes() as f64).log2().ceil();
            let tree_alpha = 2.0 * (levels * gpu.inter.alpha + (at.per_node as f64 - 1.0) * gpu.intra.alpha);
            ring.min(tree_alpha + 2.0 * part)
        }
        Coll::ReduceScatter | Coll::AllGather => (n - 1.0) * alpha + part,
        Coll::SendRecv => {
            let link = if at.nodes() > 1 { gpu.inter } else { gpu.intra };
            link.alpha + bytes / link.achieved()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::hardware::profile;

    #[test]
    fn the_nic_bounds_a_group_that_spans_nodes() {
        let a100 = profile("a100-80gb").unwrap();
        let gb = 1e9;
        // In one node: NVLink, 2·7/8 GB at about 234 GB/s (0.78 of 300) ≈ 7.5 ms.
        let node = time(&a100, Coll::AllReduce, gb, Placement { size: 8, per_node: 8 });
        assert!(node > 7e-3 && node < 8e-3, "{node}");
        // One rank per node (tp 8 fills each node): one NIC, 23 GB/s, ten times slower.
        let spread = time(&a100, Coll::AllReduce, gb, Placement::strided(8, 8, 8));
        assert!(spread > 9.0 * node && spread < 11.0 * node, "{spread} vs {node}");
        // Eight per node on 16 nodes: eight NICs together, 184 GB/s, below NVLink's 234, and
        // each rank sends 127/128 of the buffer twice instead of 7/8: 1.27 × 1.13 ≈ 1.44 times
        // the node's time.
        let wide = time(&a100, Coll::AllReduce, gb, Placement { size: 128, per_node: 8 });
        assert!(wide > node * 1.4 && wide < node * 1.5, "{wide} vs {node}");
    }

    #[test]
    fn small_messages_at_scale_take_the_tree() {
        let h100 = profile("h100-80gb").unwrap();
        let at = Placement { size: 4096, per_node: 1 };
        let t = time(&h100, Coll::AllReduce, 4.0, at);
        // A ring would pay 2·4095 steps of 10 µs; the tree 2·12 levels.
        assert!(t < 1e-3 && t > 2.0 * 12.0 * 10e-6 * 0.99, "{t}");
        assert_eq!(time(&h100, Coll::AllReduce, 1e9, Placement { size: 1, per_node: 1 }), 0.0);
    }

    #[test]
    fn placement_follows_megatrons_rank_order() {
        // dp group of 16 with tp 2 on 8-GPU nodes: 4 members per node, 4 nodes.
        let p = Placement::strided(16, 2, 8);
        assert_eq!((p.per_node, p.nodes()), (4, 4));
        // pp group with tp·dp = 64: one stage per node.
        assert_eq!(Placement::strided(8, 64, 8).per_node, 1);
        // tp 4 inside a node.
        assert_eq!(Placement::strided(4, 1, 8), Placement { size: 4, per_node: 4 });
    }
}
