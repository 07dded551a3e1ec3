//! Backend `tcp`: ranks are processes (on one or several machines) joined by a full mesh of TCP
//! connections. Rendezvous goes through the [`store`](super::store) hosted by rank 0.
//!
//! Per peer there is one socket: the rank's own threads write frames to it directly from the
//! tensor's memory (no copy), and one reader thread per peer drains it into the inbox — so a ring
//! step can send and receive at the same time and sockets never back up into a deadlock.
//! Sockets get TCP_NODELAY (small collectives are latency-bound) and large kernel buffers (large
//! ones are copy-bound).

use super::error::{CommError, CommResult};
use super::frame::{self, BufPool, FrameKind, OpDesc, HEADER_LEN, NO_DESC};
use super::store::StoreClient;
use super::transport::{Inbox, Msg, Transport};
use super::CommConfig;
use std::io::{IoSlice, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const HS_MAGIC: u32 = 0x5348_4853; // "SHHS"
const SOCK_BUF: usize = 4 << 20;

pub(crate) struct TcpTransport {
    rank: usize,
    world: usize,
    writers: Vec<Option<Mutex<TcpStream>>>,
    /// Second handles on the same sockets, to shut them down even while a writer is stuck.
    ctl: Vec<Option<TcpStream>>,
    inbox: Arc<Inbox>,
    closing: Arc<AtomicBool>,
    readers: Mutex<Vec<std::thread::JoinHandle<()>>>,
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

fn tune(s: &TcpStream) {
    let _ = s.set_nodelay(true);
    let sock = socket2::SockRef::from(s);
    let _ = sock.set_send_buffer_size(SOCK_BUF);
    let _ = sock.set_recv_buffer_size(SOCK_BUF);
}

impl TcpTransport {
    /// Build the mesh: listen, publish our address, connect to lower ranks, accept higher ones.
    pub fn connect(rank: usize, world: usize, store: &mut StoreClient, ip: IpAddr, cfg: &CommConfig) -> CommResult<Self> {
        let rdv = |m: String| CommError::Rendezvous(format!("rank {rank}: {m}"));
        let job = job_hash(&cfg.job_id);
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| rdv(format!("cannot listen on {ip}: {e}")))?;
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
            s.write_all(&handshake_bytes(job, rank, world)).map_err(|e| rdv(format!("handshake with rank {peer}: {e}")))?;
            let mut ack = [0u8; 24];
            s.read_exact(&mut ack).map_err(|e| rdv(format!("rank {peer} closed the handshake ({e}); different job or world size?")))?;
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
                return Err(rdv(format!("unexpected connection claiming to be rank {from} (two processes with the same RANK?)")));
            }
            s.write_all(&handshake_bytes(job, rank, world)).map_err(|e| rdv(format!("handshake with rank {from}: {e}")))?;
            s.set_read_timeout(None).ok();
            socks[from] = Some(s);
            missing -= 1;
        }

        let inbox = Arc::new(Inbox::new(world));
        let closing = Arc::new(AtomicBool::new(false));
        let pool = BufPool::new();
        let mut readers = Vec::new();
        let (mut writers, mut ctl) = (Vec::new(), Vec::new());
        for (peer, s) in socks.into_iter().enumerate() {
            let Some(s) = s else {
                writers.push(None);
                ctl.push(None);
                continue;
            };
            tune(&s);
            s.set_write_timeout(Some(cfg.timeout)).ok();
            let r = s.try_clone().map_err(|e| CommError::io("clone socket", e))?;
            let (inbox, closing, pool) = (inbox.clone(), closing.clone(), pool.clone());
            let h = std::thread::Builder::new()
                .name(format!("shardlab-rx-{rank}<-{peer}"))
                .spawn(move || reader(r, peer, inbox, closing, pool))
                .map_err(|e| CommError::io("spawn reader", e))?;
            readers.push(h);
            ctl.push(Some(s.try_clone().map_err(|e| CommError::io("clone socket", e))?));
            writers.push(Some(Mutex::new(s)));
        }
        Ok(TcpTransport { rank, world, writers, ctl, inbox, closing, readers: Mutex::new(readers) })
    }

    fn write_frame(&self, peer: usize, kind: FrameKind, desc: &OpDesc, payload: &[u8]) -> std::io::Result<()> {
        let w = self.writers[peer].as_ref().expect("no socket to self");
        let mut s = w.lock().unwrap();
        write_all_vectored(&mut s, &frame::encode_header(kind, desc, payload.len()), payload)
    }
}

fn write_all_vectored(s: &mut TcpStream, head: &[u8], body: &[u8]) -> std::io::Result<()> {
    let (mut h, mut b) = (head, body);
    while !h.is_empty() {
        let n = s.write_vectored(&[IoSlice::new(h), IoSlice::new(b)])?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        if n < h.len() {
            h = &h[n..];
        } else {
            b = &b[n - h.len()..];
            h = &[];
        }
    }
    s.write_all(b)
}

fn reader(mut s: TcpStream, peer: usize, inbox: Arc<Inbox>, closing: Arc<AtomicBool>, pool: Arc<BufPool>) {
    let lost = |detail: String| {
        if !closing.load(Ordering::SeqCst) {
            inbox.poison(CommError::PeerLost { peer, detail });
        }
    };
    loop {
        let mut h = [0u8; HEADER_LEN];
        if let Err(e) = s.read_exact(&mut h) {
            return lost(if e.kind() == std::io::ErrorKind::UnexpectedEof { "connection closed".into() } else { e.to_string() });
        }
        let (kind, desc, len) = match frame::decode_header(&h) {
            Ok(x) => x,
            Err(e) => {
                if !closing.load(Ordering::SeqCst) {
                    inbox.poison(CommError::Protocol(format!("from rank {peer}: {e}")));
                }
                return;
            }
        };
        let mut buf = pool.get(len);
        if let Err(e) = s.read_exact(buf.bytes_mut()) {
            return lost(e.to_string());
        }
        match kind {
            FrameKind::Data => inbox.deliver(peer, Msg::Frame(frame::Frame { desc, payload: buf })),
            FrameKind::Abort => {
                let reason = String::from_utf8_lossy(buf.bytes()).into_owned();
                inbox.poison(CommError::Aborted { by: peer, reason });
                return;
            }
            FrameKind::Leave => {
                inbox.deliver(peer, Msg::Left);
                return;
            }
        }
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn send(&self, peer: usize, desc: &OpDesc, payload: &[u8]) -> CommResult<()> {
        if let Some(e) = self.inbox.poisoned() {
            return Err(e);
        }
        self.write_frame(peer, FrameKind::Data, desc, payload).map_err(|e| match self.inbox.poisoned() {
            Some(p) => p,
            None if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => {
                CommError::Timeout { peer, timeout: Duration::ZERO, during: format!("sending {desc}") }
            }
            None => CommError::PeerLost { peer, detail: format!("send failed: {e}") },
        })
    }
    fn inbox(&self) -> &Inbox {
        &self.inbox
    }
    fn abort(&self, err: &CommError) {
        self.inbox.poison(err.clone());
        let reason = match err {
            CommError::Aborted { reason, .. } => reason.clone(),
            e => e.to_string(),
        };
        for (w, ctl) in self.writers.iter().zip(&self.ctl) {
            let (Some(w), Some(ctl)) = (w, ctl) else { continue };
            // Never wait behind a writer that is stuck on a dead peer.
            if let Ok(mut s) = w.try_lock() {
                s.set_write_timeout(Some(Duration::from_secs(1))).ok();
                let _ = write_all_vectored(&mut s, &frame::encode_header(FrameKind::Abort, &NO_DESC, reason.len()), reason.as_bytes());
            }
            // Peers see the reason first, then end-of-stream; our readers keep draining.
            let _ = ctl.shutdown(Shutdown::Write);
        }
    }
    fn leave(&self) {
        for w in self.writers.iter().flatten() {
            if let Ok(mut s) = w.try_lock() {
                s.set_write_timeout(Some(Duration::from_secs(1))).ok();
                let _ = write_all_vectored(&mut s, &frame::encode_header(FrameKind::Leave, &NO_DESC, 0), &[]);
                let _ = s.shutdown(Shutdown::Write);
            }
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::SeqCst);
        for s in self.ctl.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
        for h in self.readers.lock().unwrap().drain(..) {
            let _ = h.join();
        }
    }
}
