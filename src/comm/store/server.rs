//! The store's server side, hosted by rank 0: [`StoreServer`] binds MASTER_ADDR:MASTER_PORT and
//! runs the `EventLoop` on one thread, driving every connection with poll(2) — however many
//! connections come, no thread is spawned per connection. The loop accepts new connections
//! within the unauthenticated caps (evicting the oldest unauthenticated one when a cap is
//! reached), drops those past their handshake deadline, and wakes GETs whose key arrived or whose
//! wait is over. What one connection does with its bytes (handshake, requests) is in `conn`.

use super::super::auth::{Identity, Secret, ServerHandshake, CLIENT_HELLO_LEN, PROOF_LEN};
use super::super::error::{CommError, CommResult};
use super::conn::{fresh_request, reply, service, Conn, Phase, State};
use super::{StoreStats, MAX_UNAUTHENTICATED, MAX_UNAUTHENTICATED_PER_IP, MISSING, OK, UNAUTHENTICATED_DEADLINE};
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// Connections accepted per turn of the event loop, so that a flood of new connections cannot
/// evict a rank in the middle of its handshake (which takes a few turns).
const ACCEPTS_PER_TURN: usize = 4;
/// poll(2) event of a peer that closed its side.
#[cfg(any(target_os = "linux", target_os = "android"))]
const HANGUP: libc::c_short = libc::POLLRDHUP;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
const HANGUP: libc::c_short = 0;

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
