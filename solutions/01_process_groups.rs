//! Lesson 01 — process groups & rendezvous: reference answers.
//! Same signatures as `lessons/01_process_groups/exercise.rs`; graded by `tests/lesson01.rs`.

use shardlab::comm::store::StoreClient;
use std::time::Duration;

/// Exercise 1 — who dials whom when `world_size` ranks build a full mesh of connections.
///
/// Returns `(dial, accept)`: the ranks this rank connects to, and the ranks it waits for, each in
/// increasing order. Every pair must be connected exactly once, and no rank may wait for a
/// connection from a rank that is itself waiting for it (that would deadlock).
pub fn dial_plan(rank: usize, world_size: usize) -> (Vec<usize>, Vec<usize>) {
    // Lower ranks listen, higher ranks dial: rank r dials 0..r and accepts r+1..n.
    ((0..rank).collect(), (rank + 1..world_size).collect())
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
    store.set(&format!("addr/{rank}"), my_addr.as_bytes()).map_err(|e| e.to_string())?;
    let deadline = std::time::Instant::now() + timeout;
    let mut out = Vec::with_capacity(world_size);
    let mut missing = Vec::new();
    for r in 0..world_size {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match store.get(&format!("addr/{r}"), left).map_err(|e| e.to_string())? {
            Some(v) => out.push(String::from_utf8_lossy(&v).into_owned()),
            None => missing.push(r),
        }
    }
    if missing.is_empty() {
        Ok(out)
    } else {
        Err(format!("ranks {missing:?} did not publish an address within {timeout:?}"))
    }
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
    let e = |e: shardlab::comm::CommError| e.to_string();
    store.set(&format!("barrier/{name}/arrived/{rank}"), b"1").map_err(e)?;
    // The last rank to arrive opens the barrier for everybody.
    if store.add(&format!("barrier/{name}/count"), 1).map_err(e)? == world_size as i64 {
        store.set(&format!("barrier/{name}/open"), b"1").map_err(e)?;
    }
    if store.get(&format!("barrier/{name}/open"), timeout).map_err(e)?.is_some() {
        return Ok(());
    }
    let mut missing = Vec::new();
    for r in 0..world_size {
        if store.get(&format!("barrier/{name}/arrived/{r}"), Duration::ZERO).map_err(e)?.is_none() {
            missing.push(r);
        }
    }
    Err(format!("barrier {name:?}: ranks {missing:?} did not arrive within {timeout:?}"))
}
