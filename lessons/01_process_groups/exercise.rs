//! Lesson 01 — process groups & rendezvous: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 01`. Hints: `cargo grade 01 --hint K`.
#![allow(unused_variables)]

use shardlab::comm::store::StoreClient;
use std::time::Duration;

/// Exercise 1 — who dials whom when `world_size` ranks build a full mesh of connections.
///
/// Returns `(dial, accept)`: the ranks this rank connects to, and the ranks it waits for, each in
/// increasing order. Every pair must be connected exactly once, and no rank may wait for a
/// connection from a rank that is itself waiting for it (that would deadlock).
pub fn dial_plan(rank: usize, world_size: usize) -> (Vec<usize>, Vec<usize>) {
    // TODO: return (ranks to dial, ranks to accept from), each increasing. Hint: let one side of
    // every pair listen (`cargo grade 01 --hint 1`).
    todo!()
}

/// Exercise 2 — the rendezvous: publish `my_addr` under `addr/<rank>` in the store and return
/// every rank's address in rank order (waiting up to `timeout` for the others to publish theirs).
/// On timeout the error names the ranks that never published.
pub fn exchange_addresses(
    store: &mut StoreClient,
    rank: usize,
    world_size: usize,
    my_addr: &str,
    timeout: Duration,
) -> Result<Vec<String>, String> {
    // TODO: publish `my_addr` as `addr/<rank>`; return every rank's address in rank order, waiting
    // at most `timeout` in all, or an Err naming the ranks that never published (hints:
    // `cargo grade 01 --hint 2`).
    todo!()
}

/// Exercise 3 — a barrier through the store (what c10d's store-based barrier does): nobody
/// returns before all `world_size` ranks arrived at barrier `name`. The same name is never
/// reused. On timeout the error names the ranks that did not arrive.
pub fn store_barrier(
    store: &mut StoreClient,
    name: &str,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<(), String> {
    // TODO: return Ok once all `world_size` ranks have arrived at barrier `name`, never earlier;
    // after `timeout`, an Err naming the ranks that never arrived (`cargo grade 01 --hint 3`).
    todo!()
}
