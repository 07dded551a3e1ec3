//! Backend `local`: every rank is a thread of one process. A "send" copies the payload into a
//! pooled buffer and pushes it onto the receiver's inbox — shared memory, one copy each way.
//! Fast to start, ideal for notebooks and tests; the algorithms are the same as over TCP.

use super::error::{CommError, CommResult};
use super::frame::{BufPool, Frame, OpDesc};
use super::transport::{Inbox, Msg, Transport};
use std::sync::Arc;

pub(crate) struct LocalTransport {
    rank: usize,
    inboxes: Arc<Vec<Inbox>>,
    pool: Arc<BufPool>,
}

/// Build the transports of a `world_size`-rank local world, one per rank.
pub(crate) fn local_world(world_size: usize) -> Vec<LocalTransport> {
    let inboxes = Arc::new((0..world_size).map(|_| Inbox::new(world_size)).collect::<Vec<_>>());
    let pool = BufPool::new();
    (0..world_size).map(|rank| LocalTransport { rank, inboxes: inboxes.clone(), pool: pool.clone() }).collect()
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.inboxes.len()
    }
    fn send(&self, peer: usize, desc: &OpDesc, payload: &[u8]) -> CommResult<()> {
        if let Some(e) = self.inboxes[self.rank].poisoned() {
            return Err(e);
        }
        let mut buf = self.pool.get(payload.len());
        buf.bytes_mut().copy_from_slice(payload);
        self.inboxes[peer].deliver(self.rank, Msg::Frame(Frame { desc: *desc, payload: buf }));
        Ok(())
    }
    fn inbox(&self) -> &Inbox {
        &self.inboxes[self.rank]
    }
    fn abort(&self, err: &CommError) {
        self.inboxes[self.rank].poison(err.clone());
        let reason = err.to_string();
        for (p, inbox) in self.inboxes.iter().enumerate() {
            if p != self.rank {
                inbox.poison(CommError::Aborted { by: self.rank, reason: reason.clone() });
            }
        }
    }
    fn leave(&self) {
        for (p, inbox) in self.inboxes.iter().enumerate() {
            if p != self.rank {
                inbox.deliver(self.rank, Msg::Left);
            }
        }
    }
}
