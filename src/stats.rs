//! What every strategy reports about its communication: timings and volumes (`DdpStats`, the name
//! it got in lesson 05). Shared by DDP and ZeRO/FSDP, as [`MemoryStats`](crate::memory::MemoryStats)
//! is for the bytes held, so that neither strategy module depends on the other for it.

use serde::{Deserialize, Serialize};

/// Timings and volumes of the synchronised backward passes so far (this rank).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DdpStats {
    /// Synchronised backward passes.
    pub syncs: u64,
    /// Seconds spent in forward + backward compute (including the time the compute thread
    /// spent launching communication).
    pub compute_s: f64,
    /// Seconds the communication itself ran (summed over all-reduces, on whichever thread ran them).
    pub comm_s: f64,
    /// Seconds the training thread waited for communication after its backward was done (the
    /// part of `comm_s` that was not hidden behind compute).
    pub exposed_s: f64,
    /// Gradient bytes all-reduced (or reduce-scattered).
    pub bytes: u64,
    /// Sharded strategies: seconds the parameter all-gathers ran, and the part the training
    /// thread waited for (the rest was hidden by prefetching).
    #[serde(default)]
    pub gather_s: f64,
    #[serde(default)]
    pub gather_exposed_s: f64,
    /// CPU offload ([`Zero::offload`](crate::zero::Zero::offload)): bytes copied device → host
    /// (gradient shards) and host → device (updated parameter shards, in the compute kind).
    #[serde(default)]
    pub d2h_bytes: u64,
    #[serde(default)]
    pub h2d_bytes: u64,
}

impl DdpStats {
    /// What happened between `before` and `self` (two readings of the same strategy's counters).
    pub fn since(&self, before: &DdpStats) -> DdpStats {
        self.zip(before, |a, b| a - b, |a, b| a - b)
    }

    /// Both readings' counts together.
    pub fn plus(&self, other: &DdpStats) -> DdpStats {
        self.zip(other, |a, b| a + b, |a, b| a + b)
    }

    fn zip(&self, o: &DdpStats, n: impl Fn(u64, u64) -> u64, s: impl Fn(f64, f64) -> f64) -> DdpStats {
        DdpStats {
            syncs: n(self.syncs, o.syncs),
            compute_s: s(self.compute_s, o.compute_s),
            comm_s: s(self.comm_s, o.comm_s),
            exposed_s: s(self.exposed_s, o.exposed_s),
            bytes: n(self.bytes, o.bytes),
            gather_s: s(self.gather_s, o.gather_s),
            gather_exposed_s: s(self.gather_exposed_s, o.gather_exposed_s),
            d2h_bytes: n(self.d2h_bytes, o.d2h_bytes),
            h2d_bytes: n(self.h2d_bytes, o.h2d_bytes),
        }
    }

    /// Fraction of the communication time hidden behind backward compute.
    pub fn hidden_fraction(&self) -> f64 {
        if self.comm_s <= 0.0 {
            0.0
        } else {
            (1.0 - self.exposed_s / self.comm_s).clamp(0.0, 1.0)
        }
    }
}
