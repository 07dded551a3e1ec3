//! A tiny TCP key-value store for rendezvous, like c10d's `TCPStore`: rank 0 hosts it at
//! MASTER_ADDR:MASTER_PORT, every rank publishes its data address under `addr/<rank>` and
//! waits for the others'. Once the group is up, `init_tcp` closes it ([`StoreServer::close`]):
//! the port serves nobody for the rest of the job.
//!
//! Every connection first runs the [`auth`] handshake: only a process that knows the
//! job's secret gets to send a request. Before that, a connection is *unauthenticated* and
//! strictly limited, so strangers on the port cannot lock the job out or make rank 0 allocate:
//!
//! * it has [`UNAUTHENTICATED_DEADLINE`] (5 s) to finish the handshake, and the server reads at most
//!   [`auth::MAX_UNAUTHENTICATED_BYTES`] (112) bytes from it, into fixed buffers;
//! * at most [`MAX_UNAUTHENTICATED_PER_IP`] (16) are open per peer address and
//!   [`MAX_UNAUTHENTICATED`] (128) in all; a new connection beyond either cap evicts the *oldest*
//!   unauthenticated one (of that address, or overall). A real rank finishes its handshake within
//!   a round trip, so a flood of silent or slow connections evicts the flood, not the rank — and a
//!   rank whose connection was dropped before authenticating retries until its rendezvous timeout;
//! * anything wrong — garbage, silence, a wrong secret, another job, a replay — drops that
//!   connection only; the job goes on.
//!
//! Authenticated connections (at most [`MAX_AUTHENTICATED`], a separate budget that strangers cannot
//! touch) may SET, GET (waiting up to an hour for the key) and ADD, within quotas: keys up to
//! [`MAX_KEY`] bytes, values up to [`MAX_VALUE`], at most [`MAX_KEYS`] keys and [`MAX_TOTAL_BYTES`] in
//! all. A request over a quota gets a refusal that the client turns into a [`CommError`]; lengths
//! are checked before anything is allocated for them.
//!
//! The whole server is one thread driving every connection with poll(2): however many
//! connections come, no thread is spawned per connection.
//!
//! Wire format after the handshake (little endian). Request: `magic u32 | cmd u8 | key_len u16 |
//! val_len u32 | key | val`. Reply: `status u8 | len u32 | data` (status 0 ok, 1 missing, 2 refused
//! with a reason in `data`).

use super::auth::{self, Identity, Secret, ServerHandshake, CLIENT_HELLO_LEN, PROOF_LEN};
use super::error::{CommError, CommResult};
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

const MAGIC: u32 = 0x5354_4f52; // "STOR"
const REQ_HEADER: usize = 11;
/// Longest key.
pub const MAX_KEY: usize = 1024;
/// Longest value.
pub const MAX_VALUE: usize = 64 << 10;
/// Most keys the store holds.
pub const MAX_KEYS: usize = 1 << 16;
/// Most bytes (keys plus values) the store holds.
pub const MAX_TOTAL_BYTES: usize = 64 << 20;
/// Unauthenticated connections open at once, in all.
pub const MAX_UNAUTHENTICATED: usize = 128;
/// Unauthenticated connections open at once from one peer address.
pub const MAX_UNAUTHENTICATED_PER_IP: usize = 16;
/// Authenticated connections open at once.
pub const MAX_AUTHENTICATED: usize = 4096;
/// How long a connection may take to authenticate.
pub const UNAUTHENTICATED_DEADLINE: Duration = auth::HANDSHAKE_DEADLINE;
/// Connections accepted per turn of the event loop, so that a flood of new connections cannot
/// evict a rank in the middle of its handshake (which takes a few turns).
const ACCEPTS_PER_TURN: usize = 4;
const MAX_GET_WAIT: Duration = Duration::from_secs(3600);
/// poll(2) event of a peer that closed its side.
#[cfg(any(target_os = "linux", target_os = "android"))]
const HANGUP: libc::c_short = libc::POLLRDHUP;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
const HANGUP: libc::c_short = 0;
const CMD_SET: u8 = 2;
const CMD_GET: u8 = 3;
const CMD_ADD: u8 = 4;
const OK: u8 = 0;
const MISSING: u8 = 1;
const REFUSED: u8 = 2;

/// A snapshot of a store's connections and contents (for tests and diagnostics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Still accepting and serving connections.
    pub serving: bool,
    pub unauthenticated: usize,
    pub authenticated: usize,
    /// The most unauthenticated connections open at once so far.
    pub peak_unauthenticated: usize,
    /// The most unauthenticated connections from one address open at once so far.
    pub peak_unauthenticated_per_ip: usize,
    pub peak_authenticated: usize,
    /// Connections accepted so far.
    pub accepted: u64,
    /// Connections that authenticated so far.
    pub authenticated_total: u64,
    /// Unauthenticated connections dropped so far (failed, timed out or evicted).
    pub dropped: u64,
    pub keys: usize,
    pub bytes: usize,
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    stats: Mutex<StoreStats>,
}

/// Stores of this process by port, for [`debug_stats`].
static REGISTRY: Mutex<Vec<(u16, Weak<Shared>)>> = Mutex::new(Vec::new());

/// The stats of the store this process hosts on `port`, while its [`StoreServer`] exists (a test
/// hook: rank 0's server lives inside its `ProcessGroup`).
#[doc(hidden)]
pub fn debug_stats(port: u16) -> Option<StoreStats> {
    let reg = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    reg.iter().rev().filter(|(p, _)| *p == port).find_map(|(_, w)| w.upgrade()).map(|s| *lock(&s.stats))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The store server (hosted by rank 0). Stops when closed or dropped.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    wake: UnixStream,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl StoreServer {
    /// Listen on `addr` for the ranks of job `job` that know `secret`.
    pub fn bind(addr: SocketAddr, job: &str, secret: &Secret) -> CommResult<Self> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            CommError::Rendezvous(format!(
                "rank 0 cannot host the store on {addr}: {e} (is another job using this MASTER_PORT?)"
            ))
        })?;
        let addr = listener.local_addr().map_err(|e| CommError::io("store local_addr", e))?;
        listener.set_nonblocking(true).map_err(|e| CommError::io("store set_nonblocking", e))?;
        let (wake, wake_rx) = UnixStream::pair().map_err(|e| CommError::io("store wake pipe", e))?;
        wake.set_nonblocking(true).map_err(|e| CommError::io("store wake pipe", e))?;
        wake_rx.set_nonblocking(true).map_err(|e| CommError::io("store wake pipe", e))?;
        let shared = Arc::new(Shared::default());
        lock(&shared.stats).serving = true;
        {
            let mut reg = lock(&REGISTRY);
            reg.retain(|(_, w)| w.strong_count() > 0);
            reg.push((addr.port(), Arc::downgrade(&shared)));
        }
        let ev = EventLoop {
            listener,
            wake: wake_rx,
            shared: shared.clone(),
            conns: Vec::new(),
            st: State {
                secret: secret.clone(),
                me: Identity::store(job),
                map: HashMap::new(),
                bytes: 0,
                unauth: 0,
                authed: 0,
                per_ip: HashMap::new(),
                stats: StoreStats { serving: true, ..StoreStats::default() },
            },
        };
        let thread = std::thread::Builder::new()
            .name("shardlab-store".into())
            .spawn(move || ev.run())
            .map_err(|e| CommError::io("spawn store thread", e))?;
        Ok(StoreServer { addr, shared, wake, thread: Mutex::new(Some(thread)) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections and contents right now.
    pub fn stats(&self) -> StoreStats {
        *lock(&self.shared.stats)
    }

    /// Stop serving: close the listening socket and every connection, and wait for the server
    /// thread to end. Clients still waiting in `get` see their connection close. Idempotent.
    pub fn close(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let _ = (&self.wake).write(&[1]);
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.close();
    }
}

enum Phase {
    /// Unauthenticated: reading the client's hello, then (our hello sent) its proof. `have`
    /// counts both: at most `MAX_UNAUTHENTICATED_BYTES` are ever read.
    Handshake { hs: Box<ServerHandshake>, hello: [u8; CLIENT_HELLO_LEN], proof: [u8; PROOF_LEN], have: usize },
    /// Authenticated: reading a request (its header, then a body of validated length).
    Request { head: [u8; REQ_HEADER], have: usize, body: Vec<u8>, body_have: usize },
    /// Authenticated: a GET waiting for its key.
    Waiting { key: String, until: Instant },
}

fn fresh_request() -> Phase {
    Phase::Request { head: [0; REQ_HEADER], have: 0, body: Vec::new(), body_have: 0 }
}

struct Conn {
    s: TcpStream,
    ip: IpAddr,
    opened: Instant,
    phase: Phase,
    authed: bool,
    out: Vec<u8>,
    out_pos: usize,
    close_when_flushed: bool,
    dead: bool,
}

struct State {
    secret: Secret,
    me: Identity,
    map: HashMap<String, Vec<u8>>,
    bytes: usize,
    unauth: usize,
    authed: usize,
    per_ip: HashMap<IpAddr, usize>,
    stats: StoreStats,
}

impl State {
    /// Mark `c` dead and give back its slot (once).
    fn kill(&mut self, c: &mut Conn) {
        if c.dead {
            return;
        }
        c.dead = true;
        if c.authed {
            self.authed -= 1;
        } else {
            self.unauth -= 1;
            self.stats.dropped += 1;
            self.release_ip(c.ip);
        }
    }

    fn release_ip(&mut self, ip: IpAddr) {
        if let Some(n) = self.per_ip.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                self.per_ip.remove(&ip);
            }
        }
    }

    /// Put `val` under `key` if the quotas allow it; the refusal otherwise.
    fn put(&mut self, key: String, val: Vec<u8>) -> Result<(), String> {
        let old = self.map.get(&key).map(|v| key.len() + v.len());
        if old.is_none() && self.map.len() >= MAX_KEYS {
            return Err(format!("store quota exceeded: it holds at most {MAX_KEYS} keys"));
        }
        let bytes = self.bytes - old.unwrap_or(0) + key.len() + val.len();
        if bytes > MAX_TOTAL_BYTES {
            return Err(format!("store quota exceeded: it holds at most {MAX_TOTAL_BYTES} bytes of keys and values"));
        }
        self.bytes = bytes;
        self.map.insert(key, val);
        Ok(())
    }
}

fn reply(c: &mut Conn, status: u8, data: &[u8]) {
    c.out.clear();
    c.out_pos = 0;
    c.out.push(status);
    c.out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    c.out.extend_from_slice(data);
}

/// Read into `buf`: `Some(n)` bytes (0 = the peer closed), `None` if nothing is there now.
fn read_some(s: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<Option<usize>> {
    loop {
        match s.read(buf) {
            Ok(n) => return Ok(Some(n)),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(e),
        }
    }
}

/// What reading did for a connection.
enum Step {
    /// Nothing more to read now.
    Idle,
    /// Read something; keep going.
    More,
    /// The peer is gone, failed to authenticate, or broke the protocol.
    Kill,
    /// Hand over these bytes (our handshake hello).
    Send(Vec<u8>),
    /// The handshake succeeded.
    Authenticated,
    /// A complete request.
    Request(u8, String, Vec<u8>),
    /// A malformed request: answer this, then hang up (its body's length cannot be trusted).
    Refuse(String),
}

fn read_into(s: &mut TcpStream, buf: &mut [u8], have: &mut usize) -> Option<Step> {
    match read_some(s, &mut buf[*have..]) {
        Ok(None) => Some(Step::Idle),
        Ok(Some(0)) | Err(_) => Some(Step::Kill),
        Ok(Some(n)) => {
            *have += n;
            None
        }
    }
}

fn read_step(s: &mut TcpStream, phase: &mut Phase) -> Step {
    match phase {
        Phase::Waiting { .. } => Step::Idle,
        Phase::Handshake { hs, hello, proof, have } => {
            if *have < CLIENT_HELLO_LEN {
                if let Some(step) = read_into(s, hello, have) {
                    return step;
                }
                if *have < CLIENT_HELLO_LEN {
                    return Step::More;
                }
                return match hs.on_hello(hello) {
                    Ok(sh) => Step::Send(sh.to_vec()),
                    Err(_) => Step::Kill,
                };
            }
            let mut got = *have - CLIENT_HELLO_LEN;
            let step = read_into(s, proof, &mut got);
            *have = CLIENT_HELLO_LEN + got;
            if let Some(step) = step {
                return step;
            }
            if got < PROOF_LEN {
                return Step::More;
            }
            match hs.on_proof(proof) {
                Ok(_) => Step::Authenticated,
                Err(_) => Step::Kill,
            }
        }
        Phase::Request { head, have, body, body_have } => {
            if *have < REQ_HEADER {
                if let Some(step) = read_into(s, head, have) {
                    return step;
                }
                if *have < REQ_HEADER {
                    return Step::More;
                }
                let magic = u32::from_le_bytes(head[0..4].try_into().unwrap());
                let cmd = head[4];
                let klen = u16::from_le_bytes(head[5..7].try_into().unwrap()) as usize;
                let vlen = u32::from_le_bytes(head[7..11].try_into().unwrap()) as usize;
                if magic != MAGIC {
                    return Step::Refuse("bad request (wrong magic)".into());
                } else if !matches!(cmd, CMD_SET | CMD_GET | CMD_ADD) {
                    return Step::Refuse(format!("bad request (unknown command {cmd})"));
                } else if klen > MAX_KEY {
                    return Step::Refuse(format!("store key of {klen} bytes is over the limit of {MAX_KEY}"));
                } else if cmd == CMD_SET && vlen > MAX_VALUE {
                    return Step::Refuse(format!("store value of {vlen} bytes is over the limit of {MAX_VALUE}"));
                } else if cmd != CMD_SET && vlen != 8 {
                    return Step::Refuse("bad request (GET and ADD carry 8 bytes)".into());
                }
                // Lengths checked: at most MAX_KEY + MAX_VALUE bytes.
                *body = vec![0u8; klen + vlen];
                *body_have = 0;
            }
            if *body_have < body.len() {
                if let Some(step) = read_into(s, body, body_have) {
                    return step;
                }
                if *body_have < body.len() {
                    return Step::More;
                }
            }
            let cmd = head[4];
            let klen = u16::from_le_bytes(head[5..7].try_into().unwrap()) as usize;
            let mut key = std::mem::take(body);
            let val = key.split_off(klen);
            *phase = fresh_request();
            match String::from_utf8(key) {
                Ok(k) => Step::Request(cmd, k, val),
                Err(_) => Step::Refuse("bad request (key is not UTF-8)".into()),
            }
        }
    }
}

/// Move `c` forward as far as its socket allows: flush its reply, read, run the handshake or
/// the request. Never blocks.
fn service(c: &mut Conn, st: &mut State) {
    loop {
        if c.dead {
            return;
        }
        if c.out_pos < c.out.len() {
            match c.s.write(&c.out[c.out_pos..]) {
                Ok(0) => return st.kill(c),
                Ok(n) => c.out_pos += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(_) => return st.kill(c),
            }
            if c.out_pos == c.out.len() {
                c.out.clear();
                c.out_pos = 0;
            }
            continue;
        }
        if c.close_when_flushed {
            return st.kill(c);
        }
        match read_step(&mut c.s, &mut c.phase) {
            Step::Idle => return,
            Step::More => {}
            Step::Kill => return st.kill(c),
            Step::Send(b) => {
                c.out = b;
                c.out_pos = 0;
            }
            Step::Authenticated => {
                // It leaves the unauthenticated budget for the authenticated one.
                st.unauth -= 1;
                st.release_ip(c.ip);
                st.stats.authenticated_total += 1;
                c.authed = true;
                st.authed += 1;
                c.out_pos = 0;
                if st.authed > MAX_AUTHENTICATED {
                    c.out =
                        ServerHandshake::refused(&format!("the store already serves {MAX_AUTHENTICATED} connections"));
                    c.close_when_flushed = true;
                } else {
                    c.out = ServerHandshake::accepted();
                    c.phase = fresh_request();
                }
            }
            Step::Request(cmd, key, val) => execute(c, st, cmd, key, val),
            Step::Refuse(why) => {
                reply(c, REFUSED, why.as_bytes());
                c.close_when_flushed = true;
            }
        }
    }
}

fn execute(c: &mut Conn, st: &mut State, cmd: u8, key: String, val: Vec<u8>) {
    let word = |v: &[u8]| v.get(0..8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).unwrap_or(0);
    match cmd {
        CMD_SET => match st.put(key, val) {
            Ok(()) => reply(c, OK, &[]),
            Err(why) => reply(c, REFUSED, why.as_bytes()),
        },
        CMD_GET => {
            if let Some(v) = st.map.get(&key) {
                let v = v.clone();
                reply(c, OK, &v);
            } else {
                let wait = Duration::from_millis(word(&val)).min(MAX_GET_WAIT);
                if wait.is_zero() {
                    reply(c, MISSING, &[]);
                } else {
                    c.phase = Phase::Waiting { key, until: Instant::now() + wait };
                }
            }
        }
        CMD_ADD => {
            let cur = st.map.get(&key).map(|v| word(v) as i64).unwrap_or(0);
            let new = cur.wrapping_add(word(&val) as i64);
            match st.put(key, new.to_le_bytes().to_vec()) {
                Ok(()) => reply(c, OK, &new.to_le_bytes()),
                Err(why) => reply(c, REFUSED, why.as_bytes()),
            }
        }
        _ => unreachable!("checked when the header was read"),
    }
}

struct EventLoop {
    listener: TcpListener,
    wake: UnixStream,
    shared: Arc<Shared>,
    conns: Vec<Conn>,
    st: State,
}

impl EventLoop {
    fn run(mut self) {
        while !self.shared.stop.load(Ordering::SeqCst) {
            self.turn();
        }
        // Closing: every connection and the listener go with `self`.
        let mut s = lock(&self.shared.stats);
        *s = StoreStats { serving: false, unauthenticated: 0, authenticated: 0, ..self.st.stats };
    }

    fn turn(&mut self) {
        let now = Instant::now();
        let mut fds = Vec::with_capacity(2 + self.conns.len());
        let pfd = |fd, events| libc::pollfd { fd, events, revents: 0 };
        fds.push(pfd(self.listener.as_raw_fd(), libc::POLLIN));
        fds.push(pfd(self.wake.as_raw_fd(), libc::POLLIN));
        let mut next = now + Duration::from_secs(1);
        for c in &self.conns {
            let events = if c.out_pos < c.out.len() {
                libc::POLLOUT
            } else if matches!(c.phase, Phase::Waiting { .. }) {
                HANGUP // only to notice a client that gives up its GET
            } else {
                libc::POLLIN
            };
            fds.push(pfd(c.s.as_raw_fd(), events));
            match &c.phase {
                Phase::Waiting { until, .. } => next = next.min(*until),
                _ if !c.authed => next = next.min(c.opened + UNAUTHENTICATED_DEADLINE),
                _ => {}
            }
        }
        let ms = next.saturating_duration_since(now).as_micros().div_ceil(1000).min(1000) as libc::c_int;
        // SAFETY: `fds` is a valid array of pollfd for the duration of the call.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if rc < 0 {
            return; // EINTR; anything else shows up again at the next turn
        }
        if fds[1].revents != 0 {
            let mut b = [0u8; 64];
            while matches!((&self.wake).read(&mut b), Ok(n) if n > 0) {}
        }
        if self.shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let st = &mut self.st;
        for (c, f) in self.conns.iter_mut().zip(&fds[2..]) {
            if f.revents == 0 {
                continue;
            }
            if matches!(c.phase, Phase::Waiting { .. })
                && f.revents & (HANGUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
            {
                st.kill(c); // the client gave up its GET
                continue;
            }
            service(c, st);
        }
        // GETs whose key arrived or whose time is up; handshakes past their deadline.
        let now = Instant::now();
        for c in self.conns.iter_mut() {
            if let Phase::Waiting { key, until } = &c.phase {
                let (hit, expired) = (st.map.get(key).cloned(), now >= *until);
                if hit.is_some() || expired {
                    c.phase = fresh_request();
                    match hit {
                        Some(v) => reply(c, OK, &v),
                        None => reply(c, MISSING, &[]),
                    }
                    service(c, st);
                }
            } else if !c.authed && now >= c.opened + UNAUTHENTICATED_DEADLINE {
                st.kill(c);
            }
        }
        if fds[0].revents != 0 {
            self.accept();
        }
        self.conns.retain(|c| !c.dead);
        let st = &mut self.st;
        st.stats.unauthenticated = st.unauth;
        st.stats.authenticated = st.authed;
        st.stats.peak_unauthenticated = st.stats.peak_unauthenticated.max(st.unauth);
        st.stats.peak_authenticated = st.stats.peak_authenticated.max(st.authed);
        st.stats.keys = st.map.len();
        st.stats.bytes = st.bytes;
        *lock(&self.shared.stats) = st.stats;
    }

    fn accept(&mut self) {
        for _ in 0..ACCEPTS_PER_TURN {
            let (s, peer) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(_) => {
                    // Out of file descriptors, say: let connections close before trying again.
                    std::thread::sleep(Duration::from_millis(5));
                    return;
                }
            };
            let st = &mut self.st;
            st.stats.accepted += 1;
            let ip = peer.ip().to_canonical();
            let hs = match ServerHandshake::new(&st.secret, &st.me) {
                Ok(h) => h,
                Err(_) => continue,
            };
            if s.set_nonblocking(true).is_err() {
                continue;
            }
            let _ = s.set_nodelay(true);
            // Make room: the oldest unauthenticated connection of this address, or overall, goes.
            if st.per_ip.get(&ip).copied().unwrap_or(0) >= MAX_UNAUTHENTICATED_PER_IP {
                if let Some(v) = oldest_unauth(&mut self.conns, Some(ip)) {
                    st.kill(v);
                }
            }
            if st.unauth >= MAX_UNAUTHENTICATED {
                if let Some(v) = oldest_unauth(&mut self.conns, None) {
                    st.kill(v);
                }
            }
            st.unauth += 1;
            let n = st.per_ip.entry(ip).or_insert(0);
            *n += 1;
            st.stats.peak_unauthenticated_per_ip = st.stats.peak_unauthenticated_per_ip.max(*n);
            st.stats.peak_unauthenticated = st.stats.peak_unauthenticated.max(st.unauth);
            let mut c = Conn {
                s,
                ip,
                opened: Instant::now(),
                phase: Phase::Handshake {
                    hs: Box::new(hs),
                    hello: [0; CLIENT_HELLO_LEN],
                    proof: [0; PROOF_LEN],
                    have: 0,
                },
                authed: false,
                out: Vec::new(),
                out_pos: 0,
                close_when_flushed: false,
                dead: false,
            };
            service(&mut c, st); // a client's hello is usually there already
            self.conns.push(c);
        }
    }
}

fn oldest_unauth(conns: &mut [Conn], ip: Option<IpAddr>) -> Option<&mut Conn> {
    conns.iter_mut().filter(|c| !c.dead && !c.authed && ip.is_none_or(|ip| c.ip == ip)).min_by_key(|c| c.opened)
}

/// A connection to the store.
pub struct StoreClient {
    stream: TcpStream,
    addr: String,
    /// How long a reply may take (plus a GET's own wait).
    io_timeout: Duration,
}

impl StoreClient {
    /// Connect to `addr` and authenticate as a member of job `job` that knows `secret`. Retries
    /// until `timeout` while the store is not up yet (rank 0 may start later) or drops us before
    /// we authenticated (it is busy, e.g. with strangers); fails at once if the store belongs to
    /// another job or does not know our secret.
    pub fn connect(addr: &str, job: &str, secret: &Secret, timeout: Duration) -> CommResult<Self> {
        let deadline = Instant::now() + timeout;
        let me = Identity::store(job);
        let mut last_err = String::from("no address");
        loop {
            let addrs: Vec<SocketAddr> = match addr.to_socket_addrs() {
                Ok(a) => a.collect(),
                Err(e) => return Err(CommError::Rendezvous(format!("cannot resolve store address {addr}: {e}"))),
            };
            for a in &addrs {
                match TcpStream::connect_timeout(a, Duration::from_millis(500)) {
                    Ok(mut stream) => {
                        stream.set_nodelay(true).ok();
                        let now = Instant::now();
                        let hs_deadline =
                            (now + auth::HANDSHAKE_DEADLINE).min(deadline).max(now + Duration::from_secs(1));
                        match auth::client_handshake(&mut stream, secret, &me, hs_deadline, |_| Ok(())) {
                            Ok(_) => {
                                return Ok(StoreClient {
                                    stream,
                                    addr: addr.to_string(),
                                    io_timeout: timeout + Duration::from_secs(5),
                                })
                            }
                            Err(CommError::Io(m)) => last_err = format!("dropped before authenticating: {m}"),
                            Err(CommError::Auth(m)) => {
                                return Err(CommError::Auth(format!("store at {addr}: {m}")));
                            }
                            Err(e) => return Err(CommError::Rendezvous(format!("store at {addr}: {e}"))),
                        }
                    }
                    Err(e) => last_err = e.to_string(),
                }
            }
            if Instant::now() >= deadline {
                return Err(CommError::Rendezvous(format!(
                    "could not reach the store at {addr} within {timeout:?} ({last_err}); is rank 0 running and MASTER_ADDR/MASTER_PORT right?"
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn request(&mut self, cmd: u8, key: &str, val: &[u8], wait: Duration) -> CommResult<(u8, Vec<u8>)> {
        if key.len() > MAX_KEY {
            return Err(CommError::InvalidArgument(format!(
                "store key of {} bytes is over the limit of {MAX_KEY}",
                key.len()
            )));
        }
        if val.len() > MAX_VALUE {
            return Err(CommError::InvalidArgument(format!(
                "store value of {} bytes is over the limit of {MAX_VALUE}",
                val.len()
            )));
        }
        let io = |e| CommError::io(format!("store {}", self.addr), e);
        self.stream.set_read_timeout(Some(self.io_timeout + wait)).map_err(io)?;
        let mut msg = Vec::with_capacity(REQ_HEADER + key.len() + val.len());
        msg.extend_from_slice(&MAGIC.to_le_bytes());
        msg.push(cmd);
        msg.extend_from_slice(&(key.len() as u16).to_le_bytes());
        msg.extend_from_slice(&(val.len() as u32).to_le_bytes());
        msg.extend_from_slice(key.as_bytes());
        msg.extend_from_slice(val);
        self.stream.write_all(&msg).map_err(io)?;
        let mut h = [0u8; 5];
        self.stream.read_exact(&mut h).map_err(io)?;
        let len = u32::from_le_bytes(h[1..5].try_into().unwrap()) as usize;
        if len > MAX_VALUE {
            return Err(CommError::Protocol(format!("store {} sent an oversized reply", self.addr)));
        }
        let mut data = vec![0u8; len];
        self.stream.read_exact(&mut data).map_err(io)?;
        if h[0] == REFUSED {
            return Err(CommError::Rendezvous(format!(
                "store {} refused {key:?}: {}",
                self.addr,
                String::from_utf8_lossy(&data)
            )));
        }
        Ok((h[0], data))
    }

    /// Set `key` to `val` (keys up to [`MAX_KEY`] bytes, values up to [`MAX_VALUE`]; the store
    /// refuses more than [`MAX_KEYS`] keys or [`MAX_TOTAL_BYTES`] in all).
    pub fn set(&mut self, key: &str, val: &[u8]) -> CommResult<()> {
        self.request(CMD_SET, key, val, Duration::ZERO).map(|_| ())
    }

    /// Wait up to `timeout` for `key` to be set; `None` if it never was.
    pub fn get(&mut self, key: &str, timeout: Duration) -> CommResult<Option<Vec<u8>>> {
        let timeout = timeout.min(MAX_GET_WAIT);
        let (st, data) = self.request(CMD_GET, key, &(timeout.as_millis() as u64).to_le_bytes(), timeout)?;
        Ok(if st == OK { Some(data) } else { None })
    }

    /// Atomically add `delta` to the counter `key` and return the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> CommResult<i64> {
        let (_, data) = self.request(CMD_ADD, key, &delta.to_le_bytes(), Duration::ZERO)?;
        let b: [u8; 8] = data
            .get(0..8)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| CommError::Protocol("bad ADD reply".into()))?;
        Ok(i64::from_le_bytes(b))
    }
}

impl StoreClient {
    /// The local address of our connection to the store: the interface that reaches rank 0,
    /// which is the one the data connections should use too.
    pub fn local_ip(&self) -> CommResult<std::net::IpAddr> {
        self.stream.local_addr().map(|a| a.ip()).map_err(|e| CommError::io("store local_addr", e))
    }
}
