//! The communication layer: a Gloo-style [`ProcessGroup`] with point-to-point and collective
//! operations on CPU tensors, over two transports:
//!
//! * [`Backend::Local`] — ranks are threads of one process (shared memory); notebooks and fast tests.
//! * [`Backend::Tcp`] — ranks are processes on one or several machines, rendezvous through a TCP
//!   store at MASTER_ADDR:MASTER_PORT exactly as torchrun sets it up.
//!
//! Every operation is checked across ranks (kind, order, dtype, size, root, algorithm travel in each
//! frame's header) and every failure — bad arguments, a dead or silent peer, ranks that disagree —
//! becomes a [`CommError`] on every rank instead of a hang. After a failure the group is poisoned:
//! later calls return the same error. Data that no operation asked for is caught when the next
//! operation reads it, or by [`ProcessGroup::finish`] (which [`crate::launch::spawn`] runs after
//! every rank's work).
//!
//! <!-- listing: examples/all_reduce.rs (compiled and run by tests/docs.rs) -->
//! ```no_run
//! use shardlab::prelude::*;
//!
//! let sums = spawn(4, Backend::Tcp, |pg| {
//!     let mut t = Tensor::from_slice(&[pg.rank() as f32]);
//!     pg.all_reduce(&mut t, ReduceOp::Sum)?; // every rank: 0+1+2+3
//!     Ok(t.double_value(&[0]))
//! })?;
//! assert_eq!(sums, vec![6.0; 4]);
//! ```
//!
//! # From `all_reduce` to the socket
//!
//! 1. [`ProcessGroup::all_reduce`] (`group.rs`) takes the configured [`Algo`], asks its
//!    [`CommBackend`] for the operation and hands it to its `Worker` (`work.rs`), which runs it
//!    at once — or, behind earlier `*_async` calls, on the communication thread.
//! 2. `HostBackend::all_reduce` (`host.rs`, the one backend today) checks the tensor
//!    (`TensorBytes`, `dtype.rs`), resolves `Algo::Auto`, describes the call as an `OpDesc`
//!    (`frame.rs`) and returns a [`Pending`]; running it, `Host::exec` gives the call its
//!    sequence number, builds a `Ctx` (`algo/mod.rs`) and calls the algorithm.
//! 3. `ring::all_reduce` (`algo/ring.rs`): n−1 reduce-scatter steps, then n−1 all-gather
//!    steps; each is `Transport::exchange` (`transport.rs`): send a segment to the next rank
//!    while receiving one from the previous rank. (`direct::all_reduce`, `algo/direct.rs`,
//!    instead reads the peers' shared memory through `Exchange`, `tcp/direct.rs`.)
//! 4. The transport moves frames (`frame.rs`: a 48-byte header repeating the `OpDesc`, then
//!    payload): `LocalTransport` (`local.rs`) through in-process queues; `TcpTransport`
//!    (`tcp/mod.rs`) in `pump` (`tcp/engine.rs`), which writes to and reads from each peer's
//!    link — a socket, or a shared-memory ring (`tcp/shm.rs`) — sleeping in poll(2) on the data
//!    connections and every peer's control connection (`tcp/control.rs`), so an abort anywhere
//!    wakes it.
//!
//! # Files
//!
//! | file | concern |
//! |---|---|
//! | `group.rs` | [`ProcessGroup`]: the public API, shared argument checks |
//! | `work.rs` | [`Work`], [`WorkTiming`], the communication thread |
//! | `family.rs` | a rank's groups fail together (a subgroup's failure aborts its parent and siblings) |
//! | `backend.rs` | [`CommBackend`]: the seam a backend (host today, NCCL later) fills; [`Pending`], [`CommStats`] |
//! | `host.rs` | the host backend: tensor checks, sequence numbers, dispatch to algorithms |
//! | `algo/` | the host algorithms: `naive`, `ring`, `tree`, `direct` |
//! | `rendezvous.rs` | [`TcpInit`], `local_world`, `init_tcp`, `from_env` |
//! | `config.rs` | [`Backend`], [`CommConfig`], [`DataPath`], [`Fault`], environment variables |
//! | `transport.rs` | what the algorithms need from a transport: frames, `exchange`, failures |
//! | `frame.rs` | [`OpKind`], `OpDesc` and the frame header; pooled buffers |
//! | `local.rs`, `tcp/` | the transports: threads; processes (mesh, engine, control, shm, direct) |
//! | [`store`], [`auth`] | rendezvous key-value store; the job secret and handshakes |
//! | [`dtype`], [`error`] | element types and reduction kernels; [`CommError`] |

pub mod algo;
pub mod auth;
mod backend;
mod config;
pub mod dtype;
pub mod error;
mod family;
pub(crate) mod frame;
mod group;
mod host;
pub(crate) mod local;
pub mod mesh;
pub mod nccl;
mod rendezvous;
pub mod staging;
pub mod store;
mod subgroup;
pub(crate) mod tcp;
pub(crate) mod transport;
mod work;

pub use algo::{binomial_tree, segment, Algo};
pub use backend::{CommBackend, CommStats, InFlight, Pending};
pub use config::{Backend, CommConfig, DataPath, Fault};
pub use dtype::{DType, ReduceOp};
pub use error::{CommError, CommResult};
pub use family::JobToken;
pub use frame::OpKind;
pub use group::ProcessGroup;
pub use mesh::DeviceMesh;
pub use rendezvous::{first_host, tasks_on_node, TcpInit};
pub use work::{Work, WorkTiming};

use std::sync::Mutex;

/// Lock a mutex whose data stays valid even if a holder panicked (buffers, flags, the poison
/// slot): a panic in one operation must not turn every later call into a panic.
pub(crate) fn relock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
