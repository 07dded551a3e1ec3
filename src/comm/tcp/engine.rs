//! The engine: one optional send and one optional receive, driven by the rank's own thread over
//! non-blocking links (sockets or shared-memory rings) until both are done. Bytes go out straight
//! from the tensor's memory and come in straight into it (copies) or through a small
//! cache-resident staging buffer (reductions). While neither side can move, the thread sleeps:
//! in poll(2) on the data sockets *and every peer's control connection* (so an abort or a death
//! anywhere in the group wakes it at once), or, when only shared-memory links are involved, on
//! its doorbell (futex), looking at the control connections each time it wakes.
//!
//! A frame's bytes are only ever real data: a sender that stops half-way through a frame never
//! pads it, so the receiver can only be left waiting (and is then told through the control
//! connection) or see the connection close — never complete a frame with bytes nobody sent.

use super::super::error::{CommError, CommResult};
use super::super::frame::{self, FrameKind, OpDesc, OpKind, HEADER_LEN};
use super::super::relock;
use super::super::transport::Transport;
use super::super::transport::{check_frame, Recv};
use super::super::transport::{message_first_error, sent_before};
use super::TcpTransport;
use std::io::{ErrorKind, IoSlice};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Where reduced data lands before it is combined: small enough to stay in cache.
pub(super) const STAGING: usize = 256 << 10;

pub(super) struct SendState<'a> {
    peer: usize,
    payload: &'a [u8],
    chunk: usize,
    hdr: [u8; HEADER_LEN],
    hdr_pos: usize,
    pos: usize,
    end: usize,
    started: bool,
}

impl<'a> SendState<'a> {
    pub fn new(peer: usize, payload: &'a [u8], chunk: usize) -> Self {
        SendState { peer, payload, chunk, hdr: [0; HEADER_LEN], hdr_pos: HEADER_LEN, pos: 0, end: 0, started: false }
    }
    fn done(&self) -> bool {
        self.started && self.hdr_pos == HEADER_LEN && self.pos == self.end && self.pos == self.payload.len()
    }
}

pub(super) struct RecvState<'a> {
    r: Recv<'a>,
    off: usize,
    hdr: [u8; HEADER_LEN],
    hdr_got: usize,
    in_frame: bool,
    frame_len: usize,
    frame_got: usize,
    staged: usize,
    frames: usize,
}

impl<'a> RecvState<'a> {
    pub fn new(r: Recv<'a>) -> Self {
        RecvState {
            r,
            off: 0,
            hdr: [0; HEADER_LEN],
            hdr_got: 0,
            in_frame: false,
            frame_len: 0,
            frame_got: 0,
            staged: 0,
            frames: 0,
        }
    }
    fn done(&self) -> bool {
        self.frames > 0 && !self.in_frame && self.off == self.r.total
    }
}

impl TcpTransport {
    /// Drive an optional send and an optional receive until both are done. The deadline restarts
    /// whenever a byte moves.
    pub(super) fn pump(
        &self,
        desc: &OpDesc,
        mut send: Option<SendState>,
        mut recv: Option<RecvState>,
        timeout: Duration,
    ) -> CommResult<()> {
        let mut deadline = Instant::now() + timeout;
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(self.world + 1);
        let mut watched: Vec<usize> = Vec::with_capacity(self.world);
        let mut last_look = Instant::now();
        loop {
            if let Some(e) = self.poisoned() {
                return Err(e);
            }
            // Read the doorbell before looking for work: a ring after this wakes the wait below.
            let bell = self.shm.as_ref().map(|s| s.bell_value());
            // A shared-memory peer that had said goodbye before this attempt has put everything it
            // will ever send into the ring already: if this attempt moves nothing, it never will.
            // (Sockets report the same as a closed connection.)
            let gone = [send.as_ref().filter(|st| !st.done()).map(|st| st.peer), recv.as_ref().map(|st| st.r.peer)]
                .into_iter()
                .flatten()
                .find(|&p| self.peer(p).data.fd().is_none() && self.has_left(p));
            let mut moved = false;
            if let Some(st) = send.as_mut().filter(|st| !st.done()) {
                moved |= self.progress_send(desc, st)?;
            }
            if let Some(st) = recv.as_mut().filter(|st| !st.done()) {
                moved |= self.progress_recv(desc, st)?;
            }
            let want_out = send.as_ref().filter(|st| !st.done()).map(|st| st.peer);
            let want_in = recv.as_ref().filter(|st| !st.done()).map(|st| st.r.peer);
            if want_out.is_none() && want_in.is_none() {
                return Ok(());
            }
            let now = Instant::now();
            if moved {
                deadline = now + timeout;
                continue;
            }
            if let Some(peer) = gone.filter(|p| Some(*p) == want_in || Some(*p) == want_out) {
                return Err(self.set_poison(CommError::PeerLeft { peer, during: desc.to_string() }));
            }
            if now >= deadline {
                let peer = want_in.or(want_out).unwrap();
                return Err(CommError::Timeout { peer, timeout, during: desc.to_string() });
            }
            fds.clear();
            let mut on_shm = false;
            for (p, ev) in [(want_out, libc::POLLOUT), (want_in, libc::POLLIN)] {
                let Some(p) = p else { continue };
                let Some(fd) = self.peer(p).data.fd() else {
                    on_shm = true;
                    continue;
                };
                match fds.iter_mut().find(|f| f.fd == fd) {
                    Some(f) => f.events |= ev,
                    None => fds.push(libc::pollfd { fd, events: ev, revents: 0 }),
                }
            }
            let data_fds = fds.len();
            watched.clear();
            for (p, peer) in self.peers.iter().enumerate() {
                if let Some(peer) = peer.as_ref().filter(|peer| peer.control_open()) {
                    fds.push(libc::pollfd { fd: peer.ctl.as_raw_fd(), events: libc::POLLIN, revents: 0 });
                    watched.push(p);
                }
            }
            // Wake at least every 100 ms to notice a poison set by another thread. Waiting on a
            // shared-memory link too: sleep on the doorbell (only ring traffic: just look at the
            // control connections first) or, mixed with sockets, poll in short slices.
            let mut ms = (deadline - now).as_millis().clamp(1, 100) as libc::c_int;
            if on_shm {
                ms = if data_fds == 0 { 0 } else { 1 };
            }
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            for (f, &p) in fds[data_fds..].iter().zip(&watched) {
                if f.revents != 0 {
                    if let Some(e) = self.read_control(p) {
                        return Err(self.set_poison(e));
                    }
                }
            }
            if let Some(e) = self.peer_ahead_in_exchange(desc, want_in) {
                return Err(self.set_poison(e));
            }
            // Stalled in a collective: a peer may be stuck sending us a message it sent before
            // this collective, which we would read only after it (a look every 50 ms at most).
            if desc.op != OpKind::P2p && last_look.elapsed() >= Duration::from_millis(50) {
                last_look = Instant::now();
                let early = self.first_message_but(want_in).filter(|(_, m)| sent_before(m, desc));
                if let Some((p, m)) = early {
                    return Err(self.set_poison(message_first_error(self.rank, desc, p, &m)));
                }
            }
            if let (true, 0, Some(seg), Some(bell)) = (on_shm, data_fds, &self.shm, bell) {
                seg.wait(bell, (deadline - now).min(Duration::from_millis(20)));
            }
        }
    }

    /// Write as much of the current frames as the socket takes; true if anything moved.
    fn progress_send(&self, desc: &OpDesc, st: &mut SendState) -> CommResult<bool> {
        let peer = self.peer(st.peer);
        let _w = relock(&peer.wlock);
        let fault = self.fault.filter(|f| f.seq == desc.seq && desc.op != OpKind::P2p);
        let mut moved = false;
        while !st.done() {
            if st.hdr_pos == HEADER_LEN && st.pos == st.end {
                // Start the next frame.
                st.end = (st.pos + st.chunk).min(st.payload.len());
                st.hdr = frame::encode_header(FrameKind::Data, desc, st.end - st.pos);
                st.hdr_pos = 0;
                st.started = true;
            }
            let mut end = st.end;
            if let Some(f) = fault {
                let sent = self.fault_sent.load(Ordering::Relaxed);
                if sent >= f.after_bytes {
                    return Err(self.inject(&f, desc));
                }
                end = end.min(st.pos + (f.after_bytes - sent));
            }
            let res = peer
                .data
                .write_vectored(&[IoSlice::new(&st.hdr[st.hdr_pos..]), IoSlice::new(&st.payload[st.pos..end])]);
            match res {
                Ok(0) => return Err(self.peer_failure(st.peer, "sending", "connection closed".into())),
                Ok(k) => {
                    moved = true;
                    let h = k.min(HEADER_LEN - st.hdr_pos);
                    st.hdr_pos += h;
                    st.pos += k - h;
                    if fault.is_some() {
                        self.fault_sent.fetch_add(k - h, Ordering::Relaxed);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(moved),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(self.peer_failure(st.peer, "sending", e.to_string())),
            }
        }
        Ok(moved)
    }

    /// Read whatever has arrived for `st`; true if anything moved.
    fn progress_recv(&self, desc: &OpDesc, st: &mut RecvState) -> CommResult<bool> {
        let peer_id = st.r.peer;
        let sock = &self.peer(peer_id).data;
        let es = desc.dtype.size();
        let mut moved = false;
        let mut staging = relock(&self.staging);
        let staging: &mut [u8] = unsafe { std::slice::from_raw_parts_mut(staging.as_mut_ptr() as *mut u8, STAGING) };
        let read = |buf: &mut [u8]| -> CommResult<Option<usize>> {
            loop {
                match sock.read(buf) {
                    Ok(0) if !buf.is_empty() => {
                        return Err(self.peer_failure(peer_id, "receiving", "connection closed".into()))
                    }
                    Ok(k) => return Ok(Some(k)),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => return Err(self.peer_failure(peer_id, "receiving", e.to_string())),
                }
            }
        };
        while !st.done() {
            if !st.in_frame {
                let Some(k) = read(&mut st.hdr[st.hdr_got..])? else { return Ok(moved) };
                moved = true;
                st.hdr_got += k;
                if st.hdr_got < HEADER_LEN {
                    continue;
                }
                st.hdr_got = 0;
                let (kind, theirs, len) = frame::decode_header(&st.hdr)
                    .map_err(|e| CommError::Protocol(format!("from rank {peer_id}: {e}")))?;
                match kind {
                    FrameKind::Data => {}
                    FrameKind::Leave => return Err(CommError::PeerLeft { peer: peer_id, during: desc.to_string() }),
                    FrameKind::Abort => {
                        return Err(CommError::Protocol(format!("rank {peer_id} sent an abort on its data connection")))
                    }
                }
                check_frame(self.rank, peer_id, desc, &theirs, len, st.r.total - st.off)?;
                st.in_frame = true;
                st.frame_len = len;
                st.frame_got = 0;
            }
            if st.frame_got < st.frame_len {
                let (off, want) = (st.off, st.frame_len - st.frame_got);
                match st.r.dst.as_deref_mut() {
                    Some(dst) => {
                        let at = off + st.frame_got;
                        let Some(k) = read(&mut dst[at..at + want])? else { return Ok(moved) };
                        st.frame_got += k;
                    }
                    None => {
                        let room = (STAGING - st.staged).min(want);
                        let Some(k) = read(&mut staging[st.staged..st.staged + room])? else { return Ok(moved) };
                        st.frame_got += k;
                        st.staged += k;
                        // Apply whole elements while they are hot in cache; keep a partial one.
                        let whole = st.staged - st.staged % es;
                        if whole > 0 {
                            (st.r.on_data)(st.off, &staging[..whole])?;
                            st.off += whole;
                            staging.copy_within(whole..st.staged, 0);
                            st.staged -= whole;
                        }
                    }
                }
                moved = true;
            }
            if st.frame_got == st.frame_len {
                st.in_frame = false;
                st.frames += 1;
                if let Some(dst) = st.r.dst.as_deref_mut() {
                    let (a, b) = (st.off, st.off + st.frame_len);
                    (st.r.on_data)(a, &dst[a..b])?;
                    st.off = b;
                } else if st.frame_len == 0 {
                    (st.r.on_data)(st.off, &[])?;
                }
            }
        }
        Ok(moved)
    }
}
