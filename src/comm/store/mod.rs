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

mod conn;
mod server;

pub use server::{debug_stats, StoreServer};

use super::auth::{self, Identity, Secret};
use super::error::{CommError, CommResult};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
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
const MAX_GET_WAIT: Duration = Duration::from_secs(3600);
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
