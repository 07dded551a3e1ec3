//! The control connections: how a failure reaches every rank at once.
//!
//! Each pair of ranks has a control connection beside its data connection. Nothing travels on it
//! but one last word: `Abort` (with the reason) when a rank fails, `Leave` when it shuts down
//! cleanly. Every rank that waits in the poll engine also watches all its control connections, so
//!
//! * an abort reaches a rank even while that rank is only *sending* to the failed one (a data
//!   connection can be full of unread frames; the control connection never is),
//! * a rank that dies (killed, crashed) closes all its control connections at once: every peer
//!   learns of it immediately, not only its ring neighbours,
//! * and a rank that fails while its process stays alive is noticed just as fast.

use super::super::error::CommError;
use super::super::frame::{self, FrameKind, HEADER_LEN, NO_DESC};
use super::super::relock;
use super::super::transport::Transport;
use super::{Fault, TcpTransport};
use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Largest control message kept (an abort's reason is cut to fit).
const MAX_CONTROL: usize = 16 << 10;

/// What this rank has read from one peer's control connection.
#[derive(Default)]
pub(super) struct ControlIn {
    buf: Vec<u8>,
    /// The peer said goodbye: its connection closing is expected.
    left: bool,
    /// Nothing more can come (closed, or broken): stop watching it.
    closed: bool,
}

impl TcpTransport {
    /// Read what peer `p` said on its control connection (without blocking); the failure that
    /// it means, if any.
    pub(super) fn read_control(&self, p: usize) -> Option<CommError> {
        let peer = self.peer(p);
        let mut st = relock(&peer.ctl_in);
        let lost = |detail: String| CommError::PeerLost { peer: p, detail };
        while !st.closed {
            let mut tmp = [0u8; 4096];
            match (&peer.ctl).read(&mut tmp) {
                Ok(0) => {
                    st.closed = true;
                    peer.ctl_closed.store(true, Ordering::Relaxed);
                    if !st.left {
                        return Some(lost("its connections closed without a goodbye".into()));
                    }
                }
                Ok(k) => st.buf.extend_from_slice(&tmp[..k]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    st.closed = true;
                    peer.ctl_closed.store(true, Ordering::Relaxed);
                    return Some(lost(format!("control connection: {e}")));
                }
            }
            while st.buf.len() >= HEADER_LEN {
                let h: [u8; HEADER_LEN] = st.buf[..HEADER_LEN].try_into().unwrap();
                let (kind, len) = match frame::decode_header(&h) {
                    Ok((k, _, len)) if k != FrameKind::Data && len <= MAX_CONTROL => (k, len),
                    _ => {
                        st.closed = true;
                        peer.ctl_closed.store(true, Ordering::Relaxed);
                        return Some(CommError::Protocol(format!("rank {p} sent garbage on its control connection")));
                    }
                };
                if st.buf.len() < HEADER_LEN + len {
                    break;
                }
                let reason = String::from_utf8_lossy(&st.buf[HEADER_LEN..HEADER_LEN + len]).into_owned();
                st.buf.drain(..HEADER_LEN + len);
                match kind {
                    FrameKind::Abort => {
                        let e = CommError::Aborted { by: p, reason };
                        return Some(decode_abort(&e).unwrap_or(e));
                    }
                    _ => st.left = true,
                }
            }
        }
        None
    }

    /// Peer `p` said goodbye (its group was dropped after its work): nothing more comes from it.
    pub(super) fn has_left(&self, p: usize) -> bool {
        relock(&self.peer(p).ctl_in).left
    }

    /// Look at every control connection without waiting; the failure one of them reports.
    pub(super) fn check_controls(&self) -> Option<CommError> {
        let mut fds: Vec<(usize, libc::pollfd)> = (self.peers.iter().enumerate())
            .filter_map(|(p, peer)| peer.as_ref().filter(|x| x.control_open()).map(|x| (p, x)))
            .map(|(p, x)| (p, libc::pollfd { fd: x.ctl.as_raw_fd(), events: libc::POLLIN, revents: 0 }))
            .collect();
        let mut raw: Vec<libc::pollfd> = fds.iter().map(|f| f.1).collect();
        if unsafe { libc::poll(raw.as_mut_ptr(), raw.len() as libc::nfds_t, 0) } <= 0 {
            return None;
        }
        for ((p, _), f) in fds.iter_mut().zip(&raw) {
            if f.revents != 0 {
                if let Some(e) = self.read_control(*p) {
                    return Some(self.set_poison(e));
                }
            }
        }
        None
    }

    /// A data connection to `peer` broke while `what`: if the peer failed on purpose, its reason
    /// is on (or about to reach) its control connection — report that rather than the bare
    /// socket error.
    pub(super) fn peer_failure(&self, peer: usize, what: &str, detail: String) -> CommError {
        if let Some(p) = self.poisoned() {
            return p;
        }
        let deadline = Instant::now() + Duration::from_millis(200);
        loop {
            if let Some(e) = self.read_control(peer) {
                return self.set_poison(e);
            }
            if self.peer(peer).control_open() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            let e = if relock(&self.peer(peer).ctl_in).left {
                CommError::PeerLeft { peer, during: what.to_string() }
            } else {
                CommError::PeerLost { peer, detail: format!("{what} failed: {detail}") }
            };
            return self.set_poison(e);
        }
    }

    /// Say our last word on every control connection (once per peer), then close our side of it.
    pub(super) fn last_word(&self, kind: FrameKind, payload: &[u8]) {
        let payload = &payload[..payload.len().min(MAX_CONTROL)];
        let mut out = frame::encode_header(kind, &NO_DESC, payload.len()).to_vec();
        out.extend_from_slice(payload);
        for p in self.peers.iter().flatten() {
            if p.said_last_word.swap(true, Ordering::SeqCst) {
                continue;
            }
            // A few hundred bytes into an idle connection: the kernel takes them at once.
            let deadline = Instant::now() + Duration::from_millis(500);
            let mut pos = 0;
            while pos < out.len() && Instant::now() < deadline {
                match (&p.ctl).write(&out[pos..]) {
                    Ok(k) if k > 0 => pos += k,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(1)),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    _ => break,
                }
            }
            let _ = p.ctl.shutdown(Shutdown::Write);
            if let super::Link::Shm(l) = &p.data {
                l.wake_peer(); // it may be asleep on its doorbell rather than in poll
            }
        }
    }

    /// Record the error that broke the group (the first one wins); returns the group's error.
    pub(super) fn set_poison(&self, e: CommError) -> CommError {
        relock(&self.poison).get_or_insert(e).clone()
    }

    /// The failure a test asked for (see [`Fault`]).
    pub(super) fn inject(&self, f: &Fault, desc: &frame::OpDesc) -> CommError {
        if f.kill {
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            std::thread::sleep(Duration::from_secs(60));
        }
        CommError::Aborted { by: self.rank, reason: format!("fault injected after {} bytes of {desc}", f.after_bytes) }
    }
}

/// Peers forward the original failure: "aborted because rank 2 failed: …" stays attributed to rank 2.
pub(super) fn decode_abort(e: &CommError) -> Option<CommError> {
    let CommError::Aborted { reason, .. } = e else { return None };
    let (by, rest) = reason.strip_prefix("@")?.split_once(' ')?;
    Some(CommError::Aborted { by: by.parse().ok()?, reason: rest.to_string() })
}
