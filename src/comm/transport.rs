//! What a backend provides to the collective algorithms: ordered, reliable frames between every
//! pair of ranks, plus a way to fail loudly. `local` (threads) and `tcp` (processes/machines)
//! implement it; the algorithms in `algo` are written once against it.
//!
//! Receiving goes through an [`Inbox`]: one FIFO per peer, filled by whoever delivers (a reader
//! thread per TCP connection, or the sending thread itself for `local`). A failure anywhere
//! *poisons* the inbox and wakes every waiter, so a rank blocked on peer A still learns at once
//! that peer B died.

use super::error::{CommError, CommResult};
use super::frame::{Frame, OpDesc};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A backend's point-to-point layer.
pub(crate) trait Transport: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Send one data frame. TCP writes it before returning; local enqueues a copy.
    fn send(&self, peer: usize, desc: &OpDesc, payload: &[u8]) -> CommResult<()>;
    /// The inbox this rank receives from.
    fn inbox(&self) -> &Inbox;
    /// We failed: poison ourselves and tell every peer (best effort, never blocks for long).
    fn abort(&self, err: &CommError);
    /// Clean shutdown: tell every peer that nothing more will come from us.
    fn leave(&self);
    /// Receive the next data frame from `peer`.
    fn recv(&self, peer: usize, timeout: Duration, during: &dyn Fn() -> String) -> CommResult<Frame> {
        self.inbox().recv(peer, timeout, during)
    }
}

pub(crate) enum Msg {
    Frame(Frame),
    /// The peer left cleanly; anything after this would be an error.
    Left,
    /// Someone poisoned the inbox; re-check.
    Wake,
}

/// Per-peer FIFOs of incoming frames plus the group's poison state.
pub(crate) struct Inbox {
    tx: Vec<Sender<Msg>>,
    rx: Vec<Receiver<Msg>>,
    poison: Mutex<Option<CommError>>,
}

impl Inbox {
    pub fn new(world_size: usize) -> Self {
        let (tx, rx) = (0..world_size).map(|_| crossbeam_channel::unbounded()).unzip();
        Inbox { tx, rx, poison: Mutex::new(None) }
    }
    /// Hand a frame from `from` to whoever receives from it.
    pub fn deliver(&self, from: usize, m: Msg) {
        let _ = self.tx[from].send(m);
    }
    /// First error wins; wakes every waiter. Returns false if it was already poisoned.
    pub fn poison(&self, err: CommError) -> bool {
        let mut p = self.poison.lock().unwrap();
        if p.is_some() {
            return false;
        }
        *p = Some(err);
        drop(p);
        for tx in &self.tx {
            let _ = tx.send(Msg::Wake);
        }
        true
    }
    pub fn poisoned(&self) -> Option<CommError> {
        self.poison.lock().unwrap().clone()
    }
    pub fn recv(&self, peer: usize, timeout: Duration, during: &dyn Fn() -> String) -> CommResult<Frame> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = self.poisoned() {
                return Err(e);
            }
            match self.rx[peer].recv_deadline(deadline) {
                Ok(Msg::Frame(f)) => return Ok(f),
                Ok(Msg::Wake) => continue,
                Ok(Msg::Left) => {
                    // Keep reporting it if asked again.
                    let _ = self.tx[peer].send(Msg::Left);
                    return Err(CommError::PeerLeft { peer, during: during() });
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(CommError::Timeout { peer, timeout, during: during() })
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(CommError::PeerLost { peer, detail: "channel closed".into() })
                }
            }
        }
    }
}
