//! Backend `tcp`: ranks are processes (on one or several machines) joined by a full mesh of TCP
//! connections. Rendezvous goes through the [`store`](super::store) hosted by rank 0.
//!
//! Per peer there is one non-blocking socket, driven by the rank's own thread with poll(2): bytes
//! go out straight from the tensor's memory and come in straight into it (copies) or through a
//! small cache-resident staging buffer (reductions). A ring step sends and receives at the same
//! time, so sockets never back up into a deadlock, and no helper thread or queue sits in the way.
//! Sockets get TCP_NODELAY (small collectives are latency-bound) and large kernel buffers (large
//! ones are copy-bound).

use super::error::{CommError, CommResult};
use super::frame::{self, FrameKind, OpDesc, HEADER_LEN, NO_DESC};
use super::store::StoreClient;
use super::transport::{check_frame, stray_error, Recv, Transport};
use super::CommConfig;
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const HS_MAGIC: u32 = 0x5348_4853; // "SHHS"
/// Kernel socket buffers. Small enough that data written by one rank is usually still in the
/// shared L3 cache when the other reads it (measured best on the 2-core CI machine: 0.5–1 MiB);
/// `SHARDLAB_SOCK_BUF` overrides (0 = kernel default).
const SOCK_BUF: usize = 1 << 20;

pub(crate) struct TcpTransport {
    rank: usize,
    world: usize,
    peers: Vec<Option<Peer>>,
    poison: Mutex<Option<CommError>>,
    /// Where reduced data lands before it is combined: small enough to stay in cache.
    staging: Mutex<Vec<u64>>,
}

/// 64-bit FNV-1a of the job id: cheap to put in every handshake.
pub(crate) fn job_hash(job: &str) -> u64 {
    job.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

fn handshake_bytes(job: u64, from: usize, world: usize) -> [u8; 24] {
    let mut b = [0u8; 24];
    b[0..4].copy_from_slice(&HS_MAGIC.to_le_bytes());
    b[4..12].copy_from_slice(&job.to_le_bytes());
    b[12..16].copy_from_slice(&(from as u32).to_le_bytes());
    b[16..20].copy_from_slice(&(world as u32).to_le_bytes());
    b
}

/// The socket settings of every data connection (also used by the benchmark's ceiling).
pub(crate) fn tune(s: &TcpStream) {
    let _ = s.set_nodelay(true);
    let sock = socket2::SockRef::from(s);
    let buf = std::env::var("SHARDLAB_SOCK_BUF").ok().and_then(|v| v.parse().ok()).unwrap_or(SOCK_BUF);
    if buf > 0 {
        let _ = sock.set_send_buffer_size(buf);
        let _ = sock.set_recv_buffer_size(buf);
    }
}

impl TcpTransport {
    /// Build the mesh: listen, publish our address, connect to lower ranks, accept higher ones.
    pub fn connect(
        rank: usize,
        world: usize,
        store: &mut StoreClient,
        ip: IpAddr,
        cfg: &CommConfig,
    ) -> CommResult<Self> {
        let rdv = |m: String| CommError::Rendezvous(format!("rank {rank}: {m}"));
        let job = job_hash(&cfg.job_id);
        let listener =
            TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| rdv(format!("cannot listen on {ip}: {e}")))?;
        let me = listener.local_addr().map_err(|e| CommError::io("local_addr", e))?;
        store.set(&format!("addr/{rank}"), me.to_string().as_bytes())?;
        let deadline = Instant::now() + cfg.rendezvous_timeout;
        let mut socks: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();

        for (peer, slot) in socks.iter_mut().enumerate().take(rank) {
            let left = deadline.saturating_duration_since(Instant::now());
            let addr = store.get(&format!("addr/{peer}"), left)?.ok_or_else(|| {
                rdv(format!("rank {peer} did not publish its address within {:?}", cfg.rendezvous_timeout))
            })?;
            let addr: SocketAddr = String::from_utf8_lossy(&addr)
                .parse()
                .map_err(|_| CommError::Protocol(format!("bad address for rank {peer} in the store")))?;
            let mut s = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(100)))
                .map_err(|e| rdv(format!("cannot connect to rank {peer} at {addr}: {e}")))?;
            s.set_read_timeout(Some(left.max(Duration::from_millis(100)))).ok();
            s.write_all(&handshake_bytes(job, rank, world))
                .map_err(|e| rdv(format!("handshake with rank {peer}: {e}")))?;
            let mut ack = [0u8; 24];
            s.read_exact(&mut ack)
                .map_err(|e| rdv(format!("rank {peer} closed the handshake ({e}); different job or world size?")))?;
            if ack != handshake_bytes(job, peer, world) {
                return Err(rdv(format!("rank {peer} answered with a different job id or world size")));
            }
            s.set_read_timeout(None).ok();
            *slot = Some(s);
        }

        listener.set_nonblocking(true).map_err(|e| CommError::io("set_nonblocking", e))?;
        let mut missing = world - rank - 1;
        while missing > 0 {
            if Instant::now() >= deadline {
                let absent: Vec<usize> = (rank + 1..world).filter(|p| socks[*p].is_none()).collect();
                return Err(rdv(format!(
                    "ranks {absent:?} did not connect within {:?} (did they start? same WORLD_SIZE?)",
                    cfg.rendezvous_timeout
                )));
            }
            let (mut s, _) = match listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                Err(e) => return Err(CommError::io("accept", e)),
            };
            // Strangers get a short time to say who they are; garbage is dropped.
            s.set_nonblocking(false).ok();
            s.set_read_timeout(Some(Duration::from_secs(2))).ok();
            let mut hs = [0u8; 24];
            if s.read_exact(&mut hs).is_err() {
                continue;
            }
            let from = u32::from_le_bytes(hs[12..16].try_into().unwrap()) as usize;
            let their_world = u32::from_le_bytes(hs[16..20].try_into().unwrap()) as usize;
            if hs[0..4] != HS_MAGIC.to_le_bytes() || u64::from_le_bytes(hs[4..12].try_into().unwrap()) != job {
                continue; // another job or not us at all
            }
            if their_world != world {
                return Err(CommError::Mismatch(format!(
                    "rank {from} runs with WORLD_SIZE={their_world}, rank {rank} with WORLD_SIZE={world}"
                )));
            }
            if from <= rank || from >= world || socks[from].is_some() {
                return Err(rdv(format!(
                    "unexpected connection claiming to be rank {from} (two processes with the same RANK?)"
                )));
            }
            s.write_all(&handshake_bytes(job, rank, world))
                .map_err(|e| rdv(format!("handshake with rank {from}: {e}")))?;
            s.set_read_timeout(None).ok();
            socks[from] = Some(s);
            missing -= 1;
        }

        let mut peers = Vec::with_capacity(world);
        for s in socks {
            peers.push(match s {
                None => None,
                Some(s) => {
                    tune(&s);
                    s.set_nonblocking(true).map_err(|e| CommError::io("set_nonblocking", e))?;
                    Some(Peer { s, wlock: Mutex::new(()), owed: AtomicUsize::new(0) })
                }
            });
        }
        Ok(TcpTransport { rank, world, peers, poison: Mutex::new(None), staging: Mutex::new(vec![0u64; STAGING / 8]) })
    }

    fn peer(&self, p: usize) -> &Peer {
        self.peers[p].as_ref().expect("no connection to self")
    }

    /// Drive an optional send and an optional receive until both are done, waiting in poll(2)
    /// whenever neither side can move. The deadline restarts whenever a byte moves.
    fn pump(
        &self,
        desc: &OpDesc,
        mut send: Option<SendState>,
        mut recv: Option<RecvState>,
        timeout: Duration,
    ) -> CommResult<()> {
        let mut deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = self.poisoned() {
                return Err(e);
            }
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
            if now >= deadline {
                let peer = want_in.or(want_out).unwrap();
                return Err(CommError::Timeout { peer, timeout, during: desc.to_string() });
            }
            let mut fds: Vec<libc::pollfd> = Vec::with_capacity(2);
            if let Some(p) = want_out {
                fds.push(libc::pollfd { fd: self.peer(p).s.as_raw_fd(), events: libc::POLLOUT, revents: 0 });
            }
            if let Some(p) = want_in {
                let fd = self.peer(p).s.as_raw_fd();
                match fds.iter_mut().find(|f| f.fd == fd) {
                    Some(f) => f.events |= libc::POLLIN,
                    None => fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 }),
                }
            }
            // Wake at least every 100 ms to notice a poison set by another thread.
            let ms = (deadline - now).as_millis().clamp(1, 100) as libc::c_int;
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        }
    }

    /// Write as much of the current frames as the socket takes; true if anything moved.
    fn progress_send(&self, desc: &OpDesc, st: &mut SendState) -> CommResult<bool> {
        let peer = self.peer(st.peer);
        let _w = peer.wlock.lock().unwrap();
        let mut moved = false;
        while !st.done() {
            if st.hdr_pos == HEADER_LEN && st.pos == st.end {
                // Start the next frame.
                st.end = (st.pos + st.chunk).min(st.payload.len());
                st.hdr = frame::encode_header(FrameKind::Data, desc, st.end - st.pos);
                st.hdr_pos = 0;
                st.started = true;
            }
            let res = (&peer.s)
                .write_vectored(&[IoSlice::new(&st.hdr[st.hdr_pos..]), IoSlice::new(&st.payload[st.pos..st.end])]);
            match res {
                Ok(0) => {
                    return Err(CommError::PeerLost { peer: st.peer, detail: "connection closed while sending".into() })
                }
                Ok(k) => {
                    moved = true;
                    let h = k.min(HEADER_LEN - st.hdr_pos);
                    st.hdr_pos += h;
                    st.pos += k - h;
                    peer.owed.store(HEADER_LEN - st.hdr_pos + st.end - st.pos, Ordering::Relaxed);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(moved),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(self.broken(st.peer, "sending", e)),
            }
        }
        Ok(moved)
    }

    /// A socket broke. If the peer aborted on purpose, its reason is waiting in our receive
    /// buffer (behind data frames we never read): report that instead of a bare "broken pipe".
    fn broken(&self, peer: usize, what: &str, e: std::io::Error) -> CommError {
        if let Some(p) = self.poisoned() {
            return p;
        }
        let sock = &self.peer(peer).s;
        let deadline = Instant::now() + Duration::from_millis(200);
        let mut h = [0u8; HEADER_LEN];
        while Instant::now() < deadline {
            if read_exact_until(sock, &mut h, deadline).is_err() {
                break;
            }
            let Ok((kind, _, len)) = frame::decode_header(&h) else { break };
            match kind {
                FrameKind::Abort => {
                    let e = CommError::Aborted { by: peer, reason: read_blocking(sock, len.min(64 << 10)) };
                    return decode_abort(&e).unwrap_or(e);
                }
                FrameKind::Leave => return CommError::PeerLeft { peer, during: what.to_string() },
                FrameKind::Data => {
                    let mut sink = vec![0u8; len.min(1 << 20)];
                    let mut left = len;
                    while left > 0 {
                        let k = left.min(sink.len());
                        if read_exact_until(sock, &mut sink[..k], deadline).is_err() {
                            left = usize::MAX;
                            break;
                        }
                        left -= k;
                    }
                    if left == usize::MAX {
                        break;
                    }
                }
            }
        }
        CommError::PeerLost { peer, detail: format!("{what} failed: {e}") }
    }

    /// Read whatever has arrived for `st`; true if anything moved.
    fn progress_recv(&self, desc: &OpDesc, st: &mut RecvState) -> CommResult<bool> {
        let peer_id = st.r.peer;
        let sock = &self.peer(peer_id).s;
        let es = desc.dtype.size();
        let mut moved = false;
        let mut staging = self.staging.lock().unwrap();
        let staging: &mut [u8] = unsafe { std::slice::from_raw_parts_mut(staging.as_mut_ptr() as *mut u8, STAGING) };
        let read = |buf: &mut [u8]| -> CommResult<Option<usize>> {
            loop {
                match (&*sock).read(buf) {
                    Ok(0) if !buf.is_empty() => {
                        return Err(self
                            .poisoned()
                            .unwrap_or(CommError::PeerLost { peer: peer_id, detail: "connection closed".into() }));
                    }
                    Ok(k) => return Ok(Some(k)),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => return Err(self.broken(peer_id, "receiving", e)),
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
                        let reason = read_blocking(sock, len.min(64 << 10));
                        let e = CommError::Aborted { by: peer_id, reason };
                        return Err(match decode_abort(&e) {
                            Some(orig) => orig,
                            None => e,
                        });
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

    fn write_control(&self, kind: FrameKind, payload: &[u8]) {
        for p in self.peers.iter().flatten() {
            // Never wait behind a writer that is stuck on a dead peer.
            if let Ok(_w) = p.wlock.try_lock() {
                // Finish a frame an operation left half-written (zeros: the group is over anyway),
                // so that the control frame starts on a frame boundary.
                let mut out = vec![0u8; p.owed.swap(0, Ordering::Relaxed).min(frame::MAX_FRAME + HEADER_LEN)];
                out.extend_from_slice(&frame::encode_header(kind, &NO_DESC, payload.len()));
                out.extend_from_slice(payload);
                let deadline = Instant::now() + Duration::from_secs(1);
                let mut pos = 0;
                while pos < out.len() && Instant::now() < deadline {
                    match (&p.s).write(&out[pos..]) {
                        Ok(k) if k > 0 => pos += k,
                        Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(1)),
                        _ => break,
                    }
                }
            }
            let _ = p.s.shutdown(Shutdown::Write);
        }
    }
}

/// Peers forward the original failure: "aborted because rank 2 failed: …" stays attributed to rank 2.
fn decode_abort(e: &CommError) -> Option<CommError> {
    let CommError::Aborted { reason, .. } = e else { return None };
    let (by, rest) = reason.strip_prefix("@")?.split_once(' ')?;
    Some(CommError::Aborted { by: by.parse().ok()?, reason: rest.to_string() })
}

/// Read into `buf` from a non-blocking socket until it is full, the stream ends or fails, or
/// `deadline` passes; the number of bytes read.
fn read_until(s: &TcpStream, buf: &mut [u8], deadline: Instant) -> usize {
    let mut got = 0;
    while got < buf.len() && Instant::now() < deadline {
        match (&*s).read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(Duration::from_micros(200)),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    got
}

fn read_exact_until(s: &TcpStream, buf: &mut [u8], deadline: Instant) -> Result<(), ()> {
    if read_until(s, buf, deadline) == buf.len() {
        Ok(())
    } else {
        Err(())
    }
}

/// An abort frame's reason (whatever of it arrives within a second).
fn read_blocking(s: &TcpStream, len: usize) -> String {
    let mut buf = vec![0u8; len];
    let got = read_until(s, &mut buf, Instant::now() + Duration::from_secs(1));
    String::from_utf8_lossy(&buf[..got]).into_owned()
}

const STAGING: usize = 256 << 10;

struct Peer {
    s: TcpStream,
    wlock: Mutex<()>,
    /// Bytes of a data frame still owed to the stream (an operation stopped half-way through a
    /// frame). A control frame must not start before them, or the peer would read it as data.
    owed: AtomicUsize,
}

struct SendState<'a> {
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
    fn new(peer: usize, payload: &'a [u8], chunk: usize) -> Self {
        SendState { peer, payload, chunk, hdr: [0; HEADER_LEN], hdr_pos: HEADER_LEN, pos: 0, end: 0, started: false }
    }
    fn done(&self) -> bool {
        self.started && self.hdr_pos == HEADER_LEN && self.pos == self.end && self.pos == self.payload.len()
    }
}

struct RecvState<'a> {
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
    fn new(r: Recv<'a>) -> Self {
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

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn send(&self, peer: usize, desc: &OpDesc, payload: &[u8], chunk: usize, timeout: Duration) -> CommResult<()> {
        self.pump(desc, Some(SendState::new(peer, payload, chunk)), None, timeout)
    }
    fn recv(&self, desc: &OpDesc, r: Recv, timeout: Duration) -> CommResult<()> {
        self.pump(desc, None, Some(RecvState::new(r)), timeout)
    }
    fn exchange(
        &self,
        desc: &OpDesc,
        to: usize,
        payload: &[u8],
        chunk: usize,
        r: Recv,
        timeout: Duration,
    ) -> CommResult<()> {
        self.pump(desc, Some(SendState::new(to, payload, chunk)), Some(RecvState::new(r)), timeout)
    }
    fn poisoned(&self) -> Option<CommError> {
        self.poison.lock().unwrap().clone()
    }
    fn abort(&self, err: &CommError) {
        {
            let mut p = self.poison.lock().unwrap();
            if p.is_none() {
                *p = Some(err.clone());
            }
        }
        let CommError::Aborted { by, reason } = err.as_abort(self.rank) else { unreachable!() };
        self.write_control(FrameKind::Abort, format!("@{by} {reason}").as_bytes());
    }
    fn leave(&self) {
        self.write_control(FrameKind::Leave, &[]);
    }
    fn stray(&self, next: &OpDesc) -> Option<CommError> {
        for (p, peer) in self.peers.iter().enumerate() {
            let Some(peer) = peer else { continue };
            let mut h = [0u8; HEADER_LEN];
            let k = unsafe {
                libc::recv(
                    peer.s.as_raw_fd(),
                    h.as_mut_ptr() as *mut libc::c_void,
                    HEADER_LEN,
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            if k <= 0 {
                continue; // nothing waiting (or the peer already closed: not our concern here)
            }
            let theirs = (k as usize == HEADER_LEN).then(|| frame::decode_header(&h).ok()).flatten();
            match theirs {
                Some((FrameKind::Leave | FrameKind::Abort, _, _)) => continue,
                Some((FrameKind::Data, d, _)) if d == *next => continue,
                Some((FrameKind::Data, d, _)) => return Some(stray_error(self.rank, p, Some(&d), next)),
                None => return Some(stray_error(self.rank, p, None, next)),
            }
        }
        None
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        for p in self.peers.iter().flatten() {
            let _ = p.s.shutdown(Shutdown::Both);
        }
    }
}
