//! The `nccl` backend (lesson 11): whole collectives on CUDA memory by NVIDIA's NCCL, behind the
//! same [`CommBackend`](super::CommBackend) seam as the host backend (see that trait's docs for the design).
//!
//! NCCL and the CUDA runtime are loaded at run time (`dlopen`), never linked: the crate builds
//! and tests on machines without them. A process whose binary links libtorch_cuda.so already has
//! both loaded (PyTorch's wheel ships `libnccl.so.2` in nvidia-nccl-cu13 and libtorch_cuda needs
//! it), and we take those; otherwise `SHARDLAB_NCCL_LIB` may name the library file.
//!
//! Point-to-point: each `send`/`recv` is its own NCCL call, so a pair of ranks must order them
//! (one sends first, the other receives first); both sending first deadlocks, where the host
//! backends buffer a send. The collectives have no such caveat.
//!
//! Not yet: non-blocking communicator creation (`ncclCommInitRankConfig`), so `init_nccl` and
//! NCCL's first connection set-up are not bounded by the rendezvous timeout; an abort is local
//! (NCCL has no message to its peers: theirs fail on NCCL's error or on the group's timeout).
//!
//! Ordering: libtorch computes on the device's legacy default stream. Each operation records an
//! event there, makes the backend's own stream wait for it (the kernels that produced the input
//! have run), enqueues the NCCL kernel on the backend's stream and records a completion event;
//! `Work::wait` polls that event, the communicator's asynchronous error and the group's timeout
//! (on a timeout or an error it aborts the communicator, as torch's NCCL watchdog does). That
//! state machine is `wait.rs`, apart from CUDA and tested without a GPU: the group is poisoned
//! before the communicator is aborted, and a completed event counts only if the group is not
//! poisoned then (an aborted kernel's event completes too, on half-reduced data). `ncclAvg` is
//! used only where NCCL has it (2.10+). Dropping a backend destroys its stream.
//!
//! Not yet (they need a GPU to test): the compute stream waits on the completion event instead of
//! the host; events are created per operation; a launch holds the communicator's read lock, so
//! `abort` waits for a launch that hangs; a pipeline's send and recv are not grouped
//! (`ncclGroupStart/End`).

mod backend;
mod ffi;
mod wait;

pub use backend::NcclBackend;
pub use ffi::{Lib, UniqueId};

use super::error::{CommError, CommResult};
use std::time::Duration;

/// Rank 0's NCCL unique id, handed to every rank through the job's authenticated store under
/// `key` (lesson 11; one key per communicator: a subgroup or a restarted generation has its own).
/// Rank 0 calls `make` (ncclGetUniqueId) and publishes `id:` followed by the 128 bytes; if `make`
/// fails it publishes `error:` and the reason, so every rank fails at once with it instead of
/// waiting out `timeout`. The others wait up to `timeout` for the value. Rank 0 returns its own id.
pub fn share_unique_id(
    store: &mut super::store::StoreClient,
    rank: usize,
    key: &str,
    make: impl FnOnce() -> CommResult<UniqueId>,
    timeout: Duration,
) -> CommResult<UniqueId> {
    if rank == 0 {
        return match make() {
            Ok(id) => {
                store.set(key, &[&b"id:"[..], &id.0[..]].concat())?;
                Ok(id)
            }
            Err(e) => {
                store.set(key, format!("error:{e}").as_bytes())?;
                Err(e)
            }
        };
    }
    let v = store.get(key, timeout)?.ok_or_else(|| {
        CommError::Rendezvous(format!("rank {rank}: rank 0 did not publish the NCCL id ({key}) within {timeout:?}"))
    })?;
    if let Some(why) = v.strip_prefix(b"error:") {
        return Err(CommError::Rendezvous(format!(
            "rank {rank}: rank 0 could not make the NCCL id: {}",
            String::from_utf8_lossy(why)
        )));
    }
    match v.strip_prefix(b"id:").map(<[u8; 128]>::try_from) {
        Some(Ok(id)) => Ok(UniqueId(id)),
        _ => Err(CommError::Protocol(format!(
            "rank {rank}: {key} in the store is not an NCCL id (`id:` and 128 bytes; {} bytes)",
            v.len()
        ))),
    }
}
