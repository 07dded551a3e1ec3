//! The exchange buffers of an all-shared-memory group (every rank on this machine): what the
//! `Direct` algorithms run on (see [`Exchange`]).
//!
//! A step: a rank copies its part into its own exchange buffer, publishes its op description,
//! raises its epoch (release) and rings its peers' doorbells; it then waits until every peer's
//! epoch has caught up (acquire), checks that every peer published the same op, and reads the
//! peers' parts straight out of their buffers. While waiting it sleeps on its doorbell and looks
//! at the control connections each time it wakes, so a dead or aborting peer is an error, not a
//! hang; a peer that published nothing for the whole timeout is a timeout.

use super::super::error::{CommError, CommResult};
use super::super::frame::{self, FrameKind, OpDesc, OpKind, HEADER_LEN};
use super::super::transport::{Exchange, Transport};
use super::TcpTransport;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

impl Exchange for TcpTransport {
    fn capacity(&self) -> usize {
        // Every rank chunks alike: by the smallest buffer of the group.
        self.direct.as_ref().map_or(0, |segs| segs.iter().map(|s| s.exchange_len()).min().unwrap_or(0))
    }
    fn begin(&self) {
        self.step.fetch_add(1, Ordering::Relaxed);
    }
    fn put(&self, desc: &OpDesc, off: usize, src: &[u8]) -> CommResult<()> {
        let me = self.shm.as_ref().expect("exchange without shared memory");
        assert!(off + src.len() <= me.exchange_len(), "exchange buffer overflow");
        let dst = unsafe { me.exchange_buf(self.step.load(Ordering::Relaxed)).add(off) };
        let mut k = src.len();
        let fault = self.fault.filter(|f| f.seq == desc.seq);
        if let Some(f) = &fault {
            k = k.min(f.after_bytes.saturating_sub(self.fault_sent.load(Ordering::Relaxed)));
        }
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, k) };
        if let Some(f) = fault {
            if self.fault_sent.fetch_add(k, Ordering::Relaxed) + k >= f.after_bytes && k < src.len() {
                return Err(self.inject(&f, desc));
            }
        }
        Ok(())
    }
    fn sync(&self, desc: &OpDesc, timeout: Duration) -> CommResult<()> {
        let segs = self.direct.as_ref().expect("exchange without shared memory");
        let me = &segs[self.rank];
        let e = me.epoch().load(Ordering::Relaxed) + 1;
        let mine = frame::encode_header(FrameKind::Data, desc, 0);
        unsafe { std::ptr::copy_nonoverlapping(mine.as_ptr(), me.op_slot(e), HEADER_LEN) };
        me.epoch().store(e, Ordering::Release);
        segs.iter().enumerate().filter(|(p, _)| *p != self.rank).for_each(|(_, s)| s.ring_bell());
        let mut deadline = Instant::now() + timeout;
        let mut behind = segs.len();
        loop {
            if let Some(err) = self.poisoned() {
                return Err(err);
            }
            let bell = me.bell_value();
            let late: Vec<usize> = (0..segs.len()).filter(|&p| segs[p].epoch().load(Ordering::Acquire) < e).collect();
            if late.is_empty() {
                break;
            }
            let now = Instant::now();
            if late.len() < behind {
                behind = late.len();
                deadline = now + timeout;
            }
            if let Some(err) = self.check_controls() {
                return Err(err);
            }
            // A late peer that said goodbye will never publish; one that sends frames for this
            // collective runs another algorithm, and one whose message comes first sent it
            // before this collective.
            for &p in late.iter().filter(|&&p| p != self.rank) {
                if self.has_left(p) {
                    return Err(self.set_poison(CommError::PeerLeft { peer: p, during: desc.to_string() }));
                }
                let mut h = [0u8; HEADER_LEN];
                if self.peer(p).data.peek(&mut h) == HEADER_LEN {
                    match frame::decode_header(&h) {
                        Ok((FrameKind::Leave, _, _)) => {
                            return Err(self.set_poison(CommError::PeerLeft { peer: p, during: desc.to_string() }))
                        }
                        Ok((FrameKind::Data, theirs, _)) if theirs.op != OpKind::P2p && theirs.seq == desc.seq => {
                            return Err(CommError::Mismatch(format!(
                                "rank {} is running {desc} but rank {p} sent data for {theirs}",
                                self.rank
                            )));
                        }
                        // A message its sender sent before this collective (one too big for the
                        // link would block the sender there for good).
                        Ok((FrameKind::Data, theirs, _)) if crate::comm::transport::sent_before(&theirs, desc) => {
                            return Err(crate::comm::transport::message_first_error(self.rank, desc, p, &theirs));
                        }
                        _ => {}
                    }
                }
            }
            if now >= deadline {
                return Err(CommError::Timeout { peer: late[0], timeout, during: desc.to_string() });
            }
            me.wait(bell, (deadline - now).min(Duration::from_millis(20)));
        }
        // Every rank must be running this very operation.
        for (p, s) in segs.iter().enumerate().filter(|(p, _)| *p != self.rank) {
            let mut h = [0u8; HEADER_LEN];
            unsafe { std::ptr::copy_nonoverlapping(s.op_slot(e), h.as_mut_ptr(), HEADER_LEN) };
            match frame::decode_header(&h) {
                Ok((FrameKind::Data, theirs, _)) if theirs == *desc => {}
                Ok((_, theirs, _)) => {
                    return Err(CommError::Mismatch(format!(
                        "rank {} is running {desc} but rank {p} runs {theirs}",
                        self.rank
                    )))
                }
                Err(_) => return Err(CommError::Protocol(format!("rank {p} published a garbled operation"))),
            }
        }
        Ok(())
    }
    fn theirs(&self, p: usize, off: usize, len: usize) -> &[u8] {
        let s = &self.direct.as_ref().expect("exchange without shared memory")[p];
        assert!(off + len <= s.exchange_len(), "exchange buffer overrun");
        unsafe { std::slice::from_raw_parts(s.exchange_buf(self.step.load(Ordering::Relaxed)).add(off), len) }
    }
}

impl TcpTransport {
    /// A peer that published an exchange step for the very collective we run with frames: it
    /// runs a `Direct` algorithm where we run a frame algorithm. (A peer may legitimately be
    /// one step ahead in a *later* collective, and point-to-point calls are not ordered with
    /// collectives.)
    ///
    /// Receiving a message (`desc` a send/recv from `from`): a sender that has published a step
    /// of a collective and left nothing in the link entered that collective before sending the
    /// rest of the message, which it will not do until this rank joins the collective too.
    pub(super) fn peer_ahead_in_exchange(&self, desc: &OpDesc, from: Option<usize>) -> Option<CommError> {
        let segs = self.direct.as_ref()?;
        let mine = segs[self.rank].epoch().load(Ordering::Relaxed);
        if desc.op == OpKind::P2p {
            let p = from?;
            if segs[p].epoch().load(Ordering::Acquire) <= mine || self.peer(p).data.peek(&mut [0u8; 1]) > 0 {
                return None;
            }
            let mut h = [0u8; HEADER_LEN];
            unsafe { std::ptr::copy_nonoverlapping(segs[p].op_slot(mine + 1), h.as_mut_ptr(), HEADER_LEN) };
            let theirs = frame::decode_header(&h).map(|(_, d, _)| d.to_string()).unwrap_or_else(|_| "?".into());
            return Some(CommError::Mismatch(format!(
                "rank {} waits for {desc} but rank {p} entered a collective first ({theirs}): \
                 the ranks called send/recv and collectives in different orders",
                self.rank
            )));
        }
        for (p, s) in segs.iter().enumerate() {
            if s.epoch().load(Ordering::Acquire) <= mine {
                continue;
            }
            let mut h = [0u8; HEADER_LEN];
            unsafe { std::ptr::copy_nonoverlapping(s.op_slot(mine + 1), h.as_mut_ptr(), HEADER_LEN) };
            match frame::decode_header(&h) {
                Ok((_, theirs, _)) if theirs.seq == desc.seq => {
                    return Some(CommError::Mismatch(format!(
                        "rank {} is running {desc} but rank {p} runs {theirs}",
                        self.rank
                    )))
                }
                _ => {}
            }
        }
        None
    }
}
