//! A tiny TCP key-value store for rendezvous, like c10d's `TCPStore`: rank 0 hosts it at
//! MASTER_ADDR:MASTER_PORT, every rank publishes its data address under `addr/<rank>` and
//! waits for the others'.
//!
//! Wire format (little endian). Request: `magic u32 | cmd u8 | key_len u16 | val_len u32 | key |
//! val`. Reply: `status u8 | len u32 | data`. The first request must be `HELLO` with the job id;
//! anything else — a stranger, another job, garbage bytes, oversized lengths — gets the connection
//! closed, without a panic and without allocating more than the limits below.

use super::error::{CommError, CommResult};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const MAGIC: u32 = 0x5354_4f52; // "STOR"
const MAX_KEY: usize = 1024;
const MAX_VAL: usize = 1 << 20;
const MAX_CONNS: usize = 1024;
const CMD_HELLO: u8 = 1;
const CMD_SET: u8 = 2;
const CMD_GET: u8 = 3;
const CMD_ADD: u8 = 4;
const OK: u8 = 0;
const MISSING: u8 = 1;
const REFUSED: u8 = 2;

#[derive(Default)]
struct Shared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    stop: AtomicBool,
    conns: AtomicUsize,
}

/// The store server (hosted by rank 0). Stops when dropped.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StoreServer {
    /// Listen on `addr` for clients of job `job`.
    pub fn bind(addr: SocketAddr, job: &str) -> CommResult<Self> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            CommError::Rendezvous(format!(
                "rank 0 cannot host the store on {addr}: {e} (is another job using this MASTER_PORT?)"
            ))
        })?;
        let addr = listener.local_addr().map_err(|e| CommError::io("store local_addr", e))?;
        listener.set_nonblocking(true).map_err(|e| CommError::io("store set_nonblocking", e))?;
        let shared = Arc::new(Shared::default());
        let (s, job) = (shared.clone(), job.to_string());
        let thread = std::thread::Builder::new()
            .name("shardlab-store".into())
            .spawn(move || accept_loop(listener, s, job))
            .map_err(|e| CommError::io("spawn store thread", e))?;
        Ok(StoreServer { addr, shared, thread: Some(thread) })
    }
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>, job: String) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                if shared.conns.load(Ordering::SeqCst) >= MAX_CONNS {
                    continue; // dropped: too many open connections
                }
                shared.conns.fetch_add(1, Ordering::SeqCst);
                let (s, job) = (shared.clone(), job.clone());
                let ok = std::thread::Builder::new().name("shardlab-store-conn".into()).spawn(move || {
                    let _ = serve(stream, &s, &job);
                    s.conns.fetch_sub(1, Ordering::SeqCst);
                });
                if ok.is_err() {
                    shared.conns.fetch_sub(1, Ordering::SeqCst);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(2)),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn read_request(s: &mut TcpStream) -> std::io::Result<Option<(u8, String, Vec<u8>)>> {
    let mut h = [0u8; 11];
    s.read_exact(&mut h)?;
    let magic = u32::from_le_bytes(h[0..4].try_into().unwrap());
    let (cmd, klen) = (h[4], u16::from_le_bytes(h[5..7].try_into().unwrap()) as usize);
    let vlen = u32::from_le_bytes(h[7..11].try_into().unwrap()) as usize;
    if magic != MAGIC || klen > MAX_KEY || vlen > MAX_VAL {
        return Ok(None);
    }
    let mut key = vec![0u8; klen];
    s.read_exact(&mut key)?;
    let mut val = vec![0u8; vlen];
    s.read_exact(&mut val)?;
    match String::from_utf8(key) {
        Ok(k) => Ok(Some((cmd, k, val))),
        Err(_) => Ok(None),
    }
}

fn reply(s: &mut TcpStream, status: u8, data: &[u8]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(5 + data.len());
    out.push(status);
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out.extend_from_slice(data);
    s.write_all(&out)
}

fn serve(mut s: TcpStream, shared: &Shared, job: &str) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    // A silent client is dropped eventually; real clients talk or wait inside GET.
    s.set_read_timeout(Some(Duration::from_secs(600)))?;
    let mut hello = false;
    while let Some((cmd, key, val)) = read_request(&mut s)? {
        if shared.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        match (cmd, hello) {
            (CMD_HELLO, _) => {
                if val != job.as_bytes() {
                    let msg = format!("job id mismatch: this store serves job {job:?}");
                    return reply(&mut s, REFUSED, msg.as_bytes());
                }
                hello = true;
                reply(&mut s, OK, &[])?;
            }
            (_, false) => return reply(&mut s, REFUSED, b"HELLO first"),
            (CMD_SET, true) => {
                shared.map.lock().unwrap().insert(key, val);
                shared.changed.notify_all();
                reply(&mut s, OK, &[])?;
            }
            (CMD_GET, true) => {
                let ms = val.get(0..8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).unwrap_or(0);
                let deadline = Instant::now() + Duration::from_millis(ms.min(3_600_000));
                let mut map = shared.map.lock().unwrap();
                loop {
                    if let Some(v) = map.get(&key) {
                        let v = v.clone();
                        drop(map);
                        reply(&mut s, OK, &v)?;
                        break;
                    }
                    let now = Instant::now();
                    if now >= deadline || shared.stop.load(Ordering::SeqCst) {
                        drop(map);
                        reply(&mut s, MISSING, &[])?;
                        break;
                    }
                    map = shared.changed.wait_timeout(map, (deadline - now).min(Duration::from_millis(100))).unwrap().0;
                }
            }
            (CMD_ADD, true) => {
                let delta = val.get(0..8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).unwrap_or(0);
                let mut map = shared.map.lock().unwrap();
                let cur = map
                    .get(&key)
                    .and_then(|v| v.get(0..8))
                    .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                    .unwrap_or(0);
                let new = cur.wrapping_add(delta);
                map.insert(key, new.to_le_bytes().to_vec());
                drop(map);
                shared.changed.notify_all();
                reply(&mut s, OK, &new.to_le_bytes())?;
            }
            _ => return Ok(()),
        }
    }
    Ok(())
}

/// A connection to the store.
pub struct StoreClient {
    stream: TcpStream,
    addr: String,
}

impl StoreClient {
    /// Connect to `addr` (retrying until `timeout`, since rank 0 may start later) and say hello.
    pub fn connect(addr: &str, job: &str, timeout: Duration) -> CommResult<Self> {
        let deadline = Instant::now() + timeout;
        let mut last_err = String::from("no address");
        loop {
            let addrs: Vec<SocketAddr> = match addr.to_socket_addrs() {
                Ok(a) => a.collect(),
                Err(e) => return Err(CommError::Rendezvous(format!("cannot resolve store address {addr}: {e}"))),
            };
            for a in &addrs {
                match TcpStream::connect_timeout(a, Duration::from_millis(500)) {
                    Ok(stream) => {
                        let mut c = StoreClient { stream, addr: addr.to_string() };
                        c.stream.set_nodelay(true).ok();
                        c.stream.set_read_timeout(Some(timeout + Duration::from_secs(5))).ok();
                        let (st, data) = c.request(CMD_HELLO, "", job.as_bytes())?;
                        if st != OK {
                            return Err(CommError::Rendezvous(format!(
                                "store at {addr} refused us: {}",
                                String::from_utf8_lossy(&data)
                            )));
                        }
                        return Ok(c);
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

    fn request(&mut self, cmd: u8, key: &str, val: &[u8]) -> CommResult<(u8, Vec<u8>)> {
        let io = |e| CommError::io(format!("store {}", self.addr), e);
        let mut msg = Vec::with_capacity(11 + key.len() + val.len());
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
        if len > MAX_VAL {
            return Err(CommError::Protocol(format!("store {} sent an oversized reply", self.addr)));
        }
        let mut data = vec![0u8; len];
        self.stream.read_exact(&mut data).map_err(io)?;
        Ok((h[0], data))
    }

    pub fn set(&mut self, key: &str, val: &[u8]) -> CommResult<()> {
        if key.len() > MAX_KEY || val.len() > MAX_VAL {
            return Err(CommError::InvalidArgument("store key or value too large".into()));
        }
        self.request(CMD_SET, key, val).map(|_| ())
    }

    /// Wait up to `timeout` for `key` to be set; `None` if it never was.
    pub fn get(&mut self, key: &str, timeout: Duration) -> CommResult<Option<Vec<u8>>> {
        let (st, data) = self.request(CMD_GET, key, &(timeout.as_millis() as u64).to_le_bytes())?;
        Ok(if st == OK { Some(data) } else { None })
    }

    /// Atomically add `delta` to the counter `key` and return the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> CommResult<i64> {
        let (_, data) = self.request(CMD_ADD, key, &delta.to_le_bytes())?;
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
