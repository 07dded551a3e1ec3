//! Transport `local` ([`Backend::Local`](super::Backend)): every rank is a thread of one
//! process. A "send" copies the payload into a pooled buffer and pushes it onto the receiver's
//! queue for that sender — shared memory, one copy each way. Fast to start, ideal for notebooks
//! and tests; the algorithms are the same as over TCP.
//!
//! A failure anywhere *poisons* the receiving side and wakes every waiter, so a rank blocked on
//! peer A still learns at once that peer B died.

use super::error::{CommError, CommResult};
use super::frame::{Buf, BufPool, OpDesc, OpKind};
use super::transport::{check_frame, stray_error, Recv, Transport};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

enum Msg {
    Frame(OpDesc, Buf),
    /// The peer left cleanly; anything after this would be an error.
    Left,
    /// Someone poisoned the inbox; re-check.
    Wake,
}

/// Per-sender FIFOs of one rank plus its poison state.
struct Inbox {
    tx: Vec<Sender<Msg>>,
    rx: Vec<Receiver<Msg>>,
    /// A message taken off a sender's queue only to look at it (`first_message`), read first.
    front: Vec<Mutex<Option<Msg>>>,
    poison: Mutex<Option<CommError>>,
}

impl Inbox {
    fn new(world_size: usize) -> Self {
        let (tx, rx) = (0..world_size).map(|_| crossbeam_channel::unbounded()).unzip();
        Inbox { tx, rx, front: (0..world_size).map(|_| Mutex::new(None)).collect(), poison: Mutex::new(None) }
    }
    fn poison(&self, err: CommError) {
        let mut p = super::relock(&self.poison);
        if p.is_none() {
            *p = Some(err);
            drop(p);
            self.tx.iter().for_each(|tx| {
                let _ = tx.send(Msg::Wake);
            });
        }
    }
    fn poisoned(&self) -> Option<CommError> {
        super::relock(&self.poison).clone()
    }
    fn next(&self, peer: usize, timeout: Duration, desc: &OpDesc) -> CommResult<(OpDesc, Buf)> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = self.poisoned() {
                return Err(e);
            }
            let front = super::relock(&self.front[peer]).take();
            match front.map_or_else(|| self.rx[peer].recv_deadline(deadline), Ok) {
                Ok(Msg::Frame(d, b)) => return Ok((d, b)),
                Ok(Msg::Wake) => continue,
                Ok(Msg::Left) => {
                    let _ = self.tx[peer].send(Msg::Left); // keep reporting it
                    return Err(CommError::PeerLeft { peer, during: desc.to_string() });
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(CommError::Timeout { peer, timeout, during: desc.to_string() })
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(CommError::PeerLost { peer, detail: "channel closed".into() })
                }
            }
        }
    }
}

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

impl LocalTransport {
    fn send_frame(&self, peer: usize, desc: &OpDesc, bytes: &[u8]) -> CommResult<()> {
        if let Some(e) = self.poisoned() {
            return Err(e);
        }
        let mut buf = self.pool.get(bytes.len());
        buf.bytes_mut().copy_from_slice(bytes);
        let _ = self.inboxes[peer].tx[self.rank].send(Msg::Frame(*desc, buf));
        Ok(())
    }
    /// Take one frame of `r` and consume it; returns bytes received.
    fn recv_frame(&self, desc: &OpDesc, r: &mut Recv, off: usize, timeout: Duration) -> CommResult<usize> {
        let (d, buf) = self.inboxes[self.rank].next(r.peer, timeout, desc)?;
        let b = buf.bytes();
        check_frame(self.rank, r.peer, desc, &d, b.len(), r.total - off)?;
        match r.dst.as_deref_mut() {
            Some(dst) => {
                dst[off..off + b.len()].copy_from_slice(b);
                (r.on_data)(off, &dst[off..off + b.len()])?;
            }
            None => (r.on_data)(off, b)?,
        }
        Ok(b.len())
    }
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.inboxes.len()
    }
    fn send(&self, peer: usize, desc: &OpDesc, payload: &[u8], chunk: usize, _: Duration) -> CommResult<()> {
        if payload.is_empty() {
            return self.send_frame(peer, desc, payload);
        }
        payload.chunks(chunk).try_for_each(|c| self.send_frame(peer, desc, c))
    }
    fn recv(&self, desc: &OpDesc, mut r: Recv, timeout: Duration) -> CommResult<()> {
        let mut off = 0;
        loop {
            off += self.recv_frame(desc, &mut r, off, timeout)?;
            if off == r.total {
                return Ok(());
            }
        }
    }
    fn exchange(
        &self,
        desc: &OpDesc,
        to: usize,
        payload: &[u8],
        chunk: usize,
        mut r: Recv,
        timeout: Duration,
    ) -> CommResult<()> {
        // Sends never block here, so interleaving chunk by chunk keeps both sides moving.
        let (mut s, mut off) = (0usize, 0usize);
        let (mut sent_any, mut recv_any) = (false, false);
        while !(sent_any && s >= payload.len() && recv_any && off >= r.total) {
            if !sent_any || s < payload.len() {
                let e = (s + chunk).min(payload.len());
                self.send_frame(to, desc, &payload[s..e])?;
                s = e;
                sent_any = true;
            }
            if !recv_any || off < r.total {
                off += self.recv_frame(desc, &mut r, off, timeout)?;
                recv_any = true;
            }
        }
        Ok(())
    }
    fn poisoned(&self) -> Option<CommError> {
        self.inboxes[self.rank].poisoned()
    }
    fn abort(&self, err: &CommError) {
        self.inboxes[self.rank].poison(err.clone());
        let told = err.as_abort(self.rank);
        for (p, inbox) in self.inboxes.iter().enumerate() {
            if p != self.rank {
                inbox.poison(told.clone());
            }
        }
    }
    fn first_message_but(&self, skip: Option<usize>) -> Option<(usize, OpDesc)> {
        let inbox = &self.inboxes[self.rank];
        (0..inbox.rx.len()).filter(|&p| p != self.rank && Some(p) != skip).find_map(|p| {
            let mut front = super::relock(&inbox.front[p]);
            while front.is_none() {
                match inbox.rx[p].try_recv() {
                    Ok(Msg::Wake) => {}
                    Ok(m) => *front = Some(m),
                    Err(_) => break,
                }
            }
            match &*front {
                Some(Msg::Frame(d, _)) if d.op == OpKind::P2p => Some((p, *d)),
                _ => None,
            }
        })
    }
    fn stray(&self, next: &OpDesc) -> Option<CommError> {
        let inbox = &self.inboxes[self.rank];
        for (p, rx) in inbox.rx.iter().enumerate() {
            let mut keep = Vec::new();
            let mut found = None;
            let mut front = super::relock(&inbox.front[p]).take();
            while let Some(m) = front.take().or_else(|| rx.try_recv().ok()) {
                match m {
                    Msg::Frame(d, _) if d != *next => found = Some(stray_error(self.rank, p, Some(&d), next)),
                    Msg::Wake => {}
                    m => keep.push(m),
                }
            }
            // The peer sends nothing else until the closing barrier completes: order is kept.
            keep.into_iter().for_each(|m| {
                let _ = inbox.tx[p].send(m);
            });
            if found.is_some() {
                return found;
            }
        }
        None
    }
    fn data_path(&self) -> &'static str {
        "local"
    }
    fn leave(&self) {
        for (p, inbox) in self.inboxes.iter().enumerate() {
            if p != self.rank {
                let _ = inbox.tx[self.rank].send(Msg::Left);
            }
        }
    }
}
