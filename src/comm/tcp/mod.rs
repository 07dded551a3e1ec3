//! Transport `tcp` ([`Backend::Tcp`](super::super::Backend)): ranks are processes (on one or
//! several machines) joined by a full mesh of TCP connections; rendezvous goes through the
//! [`store`](super::store) hosted by rank 0.
//!
//! One concern per file:
//! * [`mesh`] — who connects to whom, handshakes (a data and a control connection per pair);
//! * [`shm`] — the data path between ranks on the same machine: shared-memory rings;
//! * [`engine`] — moving frames: a send and a receive driven together, waiting in poll(2) or
//!   on a shared-memory doorbell;
//! * [`control`] — failures: an abort or a death reaches every rank at once.
//!
//! Sockets get TCP_NODELAY (small collectives are latency-bound) and large kernel buffers (large
//! ones are copy-bound).

mod control;
mod direct;
mod engine;
mod mesh;
mod shm;
mod shm_names;

use super::config::{CommConfig, DataPath, Fault};
use super::error::{CommError, CommResult};
use super::frame::{self, FrameKind, OpDesc, OpKind, HEADER_LEN};
use super::relock;
use super::store::StoreClient;
use super::transport::{stray_error, Recv, Transport};
use engine::{RecvState, SendState, STAGING};
use std::io::{IoSlice, Read, Write};
use std::net::{IpAddr, Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

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
    /// A failure to inject (tests), and the payload bytes sent so far in the collective it names.
    fault: Option<Fault>,
    fault_sent: AtomicUsize,
    /// This rank's shared-memory segment (its doorbell and inbound rings), if any peer uses one.
    shm: Option<Arc<shm::Segment>>,
    /// Every rank's segment (own included), when all ranks share memory: the exchange buffers.
    direct: Option<Vec<Arc<shm::Segment>>>,
    /// Exchange steps begun (selects the alternating buffer).
    step: std::sync::atomic::AtomicU64,
}

/// How frames travel to and from one peer: a socket, or shared-memory rings (same machine).
enum Link {
    Tcp(TcpStream),
    Shm(shm::ShmLink),
}

impl Link {
    /// Write what the link takes now (`WouldBlock` when it takes nothing).
    fn write_vectored(&self, bufs: &[IoSlice]) -> std::io::Result<usize> {
        match self {
            Link::Tcp(s) => (&*s).write_vectored(bufs),
            Link::Shm(l) => l.write_vectored(bufs),
        }
    }
    /// Read what has arrived (`WouldBlock` when nothing has; `Ok(0)`: the socket closed).
    fn read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Link::Tcp(s) => (&*s).read(buf),
            Link::Shm(l) => l.read(buf, true),
        }
    }
    /// Write all of a small control frame, or nothing (never half a header): best effort, for a
    /// goodbye.
    fn write_whole(&self, bytes: &[u8]) {
        match self {
            Link::Tcp(s) => {
                let _ = (&*s).write(bytes); // an idle socket takes 48 bytes whole
            }
            Link::Shm(l) => {
                if l.room() >= bytes.len() {
                    let _ = l.write_vectored(&[IoSlice::new(bytes)]);
                }
            }
        }
    }
    /// Copy what has arrived without consuming it; bytes copied.
    fn peek(&self, buf: &mut [u8]) -> usize {
        match self {
            Link::Tcp(s) => {
                let k = unsafe {
                    libc::recv(
                        s.as_raw_fd(),
                        buf.as_mut_ptr() as *mut libc::c_void,
                        buf.len(),
                        libc::MSG_PEEK | libc::MSG_DONTWAIT,
                    )
                };
                k.max(0) as usize
            }
            Link::Shm(l) => l.read(buf, false).unwrap_or(0),
        }
    }
    /// The socket to poll, for TCP links.
    fn fd(&self) -> Option<RawFd> {
        match self {
            Link::Tcp(s) => Some(s.as_raw_fd()),
            Link::Shm(_) => None,
        }
    }
    fn shutdown(&self, how: Shutdown) {
        if let Link::Tcp(s) = self {
            let _ = s.shutdown(how);
        }
    }
}

/// The connections to one peer.
struct Peer {
    /// Frames of collectives and point-to-point messages, in order.
    data: Link,
    /// Serialises writers of `data` (the communication thread, a goodbye).
    wlock: Mutex<()>,
    /// One last word (abort or leave) and nothing else.
    ctl: TcpStream,
    ctl_in: Mutex<control::ControlIn>,
    /// Mirrors `ctl_in.closed` without the lock (the poll loop asks on every wait).
    ctl_closed: AtomicBool,
    said_last_word: AtomicBool,
}

impl Peer {
    fn control_open(&self) -> bool {
        !self.ctl_closed.load(Ordering::Relaxed)
    }
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
    /// Build the mesh (see [`mesh`]) and make every socket non-blocking.
    pub fn connect(
        rank: usize,
        world: usize,
        store: &mut StoreClient,
        ip: IpAddr,
        cfg: &CommConfig,
    ) -> CommResult<Self> {
        let links = mesh::connect(rank, world, store, ip, cfg)?;
        let (mine, theirs) = shm_setup(rank, world, store, cfg)?;
        let mut peers = Vec::with_capacity(world);
        for (p, l) in links.into_iter().enumerate() {
            peers.push(match l {
                None => None,
                Some(l) => {
                    tune(&l.data);
                    let _ = l.ctl.set_nodelay(true);
                    for s in [&l.data, &l.ctl] {
                        s.set_nonblocking(true).map_err(|e| CommError::io("set_nonblocking", e))?;
                    }
                    let data = match (&mine, &theirs[p]) {
                        (Some(m), Some(t)) => Link::Shm(shm::ShmLink::new(rank, p, m.clone(), t.clone())),
                        _ => Link::Tcp(l.data),
                    };
                    Some(Peer {
                        data,
                        wlock: Mutex::new(()),
                        ctl: l.ctl,
                        ctl_in: Mutex::default(),
                        ctl_closed: AtomicBool::new(false),
                        said_last_word: AtomicBool::new(false),
                    })
                }
            });
        }
        Ok(TcpTransport {
            rank,
            world,
            peers,
            poison: Mutex::new(None),
            staging: Mutex::new(vec![0u64; STAGING / 8]),
            fault: cfg.fault.filter(|f| f.rank == rank),
            fault_sent: AtomicUsize::new(0),
            direct: match &mine {
                Some(m) if world > 1 && theirs.iter().enumerate().all(|(p, t)| p == rank || t.is_some()) => {
                    Some((0..world).map(|p| theirs[p].clone().unwrap_or_else(|| m.clone())).collect())
                }
                _ => None,
            },
            shm: theirs.iter().any(|t| t.is_some()).then_some(mine).flatten(),
            step: std::sync::atomic::AtomicU64::new(0),
        })
    }

    fn peer(&self, p: usize) -> &Peer {
        self.peers[p].as_ref().expect("no connection to self")
    }
}

/// A rank's shared-memory segment, if it has one.
type Seg = Option<Arc<shm::Segment>>;

/// Decide, with every peer, which pairs use shared memory, and map their segments: our own
/// segment (if any peer uses it) and, per peer, the peer's segment (None: TCP). Both ranks of a
/// pair decide alike: shared memory iff both offered a segment and they run on the same machine.
fn shm_setup(rank: usize, world: usize, store: &mut StoreClient, cfg: &CommConfig) -> CommResult<(Seg, Vec<Seg>)> {
    let rdv = |m: String| CommError::Rendezvous(format!("rank {rank}: {m}"));
    let host = shm::host_id();
    let mine = match cfg.transport {
        DataPath::Tcp => None,
        _ if world == 1 => None,
        want => {
            let mut tag = [0u8; 8];
            getrandom::getrandom(&mut tag).map_err(|e| CommError::Io(format!("no random bytes from the OS: {e}")))?;
            let tag: String = tag.iter().map(|b| format!("{b:02x}")).collect();
            // Once per process: a subgroup formed later would only find what this sweep left.
            static SWEPT: std::sync::Once = std::sync::Once::new();
            SWEPT.call_once(|| {
                let (n, bytes) = shm_names::sweep_dead(std::path::Path::new("/dev/shm"));
                if n > 0 {
                    eprintln!(
                        "shardlab: rank {rank}: removed {n} shared-memory segment(s) ({} MiB) left in /dev/shm by killed ranks",
                        bytes >> 20
                    );
                }
            });
            match shm::Segment::create(std::path::Path::new("/dev/shm"), &tag, rank, world, cfg.shm_exchange_bytes) {
                Ok(s) => Some(Arc::new(s)),
                Err(e) if want == DataPath::Shm => {
                    // Tell the peers (they wait for our offer), so every rank fails now with this
                    // reason instead of waiting out the rendezvous timeout.
                    let msg = format!("SHARDLAB_TRANSPORT=shm, but {e}");
                    let _ = store.set(&format!("shm/{rank}"), format!("!{msg}").as_bytes());
                    return Err(rdv(msg));
                }
                Err(e) => {
                    // Auto: still works over TCP, only slower — say why, once per rank.
                    eprintln!(
                        "shardlab: rank {rank}: no shared memory ({e}); using TCP to every peer \
                         (SHARDLAB_TRANSPORT=tcp silences this, =shm makes it an error)"
                    );
                    None
                }
            }
        }
    };
    let offer = match &mine {
        Some(s) => format!("{host}\n{}", s.path().display()),
        None => String::new(),
    };
    store.set(&format!("shm/{rank}"), offer.as_bytes())?;
    let deadline = std::time::Instant::now() + cfg.rendezvous_timeout;
    let mut theirs: Vec<Seg> = (0..world).map(|_| None).collect();
    for (p, slot) in theirs.iter_mut().enumerate().filter(|(p, _)| *p != rank) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let offer = store.get(&format!("shm/{p}"), left)?.ok_or_else(|| {
            rdv(format!("rank {p} did not say how it moves data within {:?}", cfg.rendezvous_timeout))
        })?;
        let offer = String::from_utf8_lossy(&offer).into_owned();
        if let Some(why) = offer.strip_prefix('!') {
            return Err(rdv(format!("rank {p} cannot take part: {why}")));
        }
        let (their_host, path) = offer.split_once('\n').unwrap_or(("", ""));
        if their_host != host {
            continue; // another machine (or no segment offered): TCP
        }
        if mine.is_none() {
            // We offered none, so the peer reads our empty offer and uses TCP with us too.
            continue;
        }
        if path.is_empty() {
            if cfg.transport == DataPath::Shm {
                return Err(rdv(format!(
                    "SHARDLAB_TRANSPORT=shm, but rank {p} on this machine offers no shared memory"
                )));
            }
            continue;
        }
        *slot = Some(Arc::new(
            shm::Segment::open(std::path::Path::new(path), p, world)
                .map_err(|e| rdv(format!("rank {p}'s shared memory: {e}")))?,
        ));
    }
    Ok((mine, theirs))
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
        relock(&self.poison).clone()
    }
    fn abort(&self, err: &CommError) {
        self.set_poison(err.clone());
        let CommError::Aborted { by, reason } = err.as_abort(self.rank) else { unreachable!() };
        self.last_word(FrameKind::Abort, format!("@{by} {reason}").as_bytes());
    }
    fn leave(&self) {
        // No operation is in flight (the group is being dropped after its work): the data
        // links are at a frame boundary, so a goodbye there is read as one.
        let bye = frame::encode_header(FrameKind::Leave, &frame::NO_DESC, 0);
        for p in self.peers.iter().flatten() {
            let _w = relock(&p.wlock);
            p.data.write_whole(&bye);
            p.data.shutdown(Shutdown::Write);
        }
        self.last_word(FrameKind::Leave, &[]);
    }
    fn group_formed(&self) {
        if let Some(s) = &self.shm {
            s.unlink(); // every peer has mapped it: the name is no longer needed
        }
    }
    fn shared_buffers(&self) -> Option<&dyn super::transport::Exchange> {
        self.direct.as_ref().map(|_| self as &dyn super::transport::Exchange)
    }
    fn data_path(&self) -> &'static str {
        let shm = self.peers.iter().flatten().filter(|p| matches!(p.data, Link::Shm(_))).count();
        match (shm, self.world - 1 - shm) {
            (0, _) => "tcp",
            (_, 0) => "shm",
            _ => "shm+tcp",
        }
    }
    fn first_message_but(&self, skip: Option<usize>) -> Option<(usize, OpDesc)> {
        self.peers.iter().enumerate().filter(|(p, _)| Some(*p) != skip).find_map(|(p, peer)| {
            let mut h = [0u8; HEADER_LEN];
            (peer.as_ref()?.data.peek(&mut h) == HEADER_LEN).then_some(())?;
            match frame::decode_header(&h) {
                Ok((FrameKind::Data, d, _)) if d.op == OpKind::P2p => Some((p, d)),
                _ => None,
            }
        })
    }
    fn stray(&self, next: &OpDesc) -> Option<CommError> {
        for (p, peer) in self.peers.iter().enumerate() {
            let Some(peer) = peer else { continue };
            let mut h = [0u8; HEADER_LEN];
            let k = peer.data.peek(&mut h);
            if k == 0 {
                continue; // nothing waiting (or the peer already closed: not our concern here)
            }
            let theirs = (k == HEADER_LEN).then(|| frame::decode_header(&h).ok()).flatten();
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
            p.data.shutdown(Shutdown::Both);
            let _ = p.ctl.shutdown(Shutdown::Both);
        }
    }
}
