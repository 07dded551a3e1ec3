//! One connection's side of the store server: its state machine (`Phase`: the `auth`
//! handshake, then requests, or a GET waiting for its key), the store's contents and budgets
//! (`State`), and the non-blocking steps that read, parse and validate a request (lengths are
//! checked before anything is allocated for them), execute it within the quotas, and flush the
//! reply. The event loop in `server` calls `service` whenever a connection's socket is ready.

use super::super::auth::{Identity, Secret, ServerHandshake, CLIENT_HELLO_LEN, PROOF_LEN};
use super::{
    StoreStats, CMD_ADD, CMD_GET, CMD_SET, MAGIC, MAX_AUTHENTICATED, MAX_GET_WAIT, MAX_KEY, MAX_KEYS, MAX_TOTAL_BYTES,
    MAX_VALUE, MISSING, OK, REFUSED, REQ_HEADER,
};
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, TcpStream};
use std::time::{Duration, Instant};

pub(super) enum Phase {
    /// Unauthenticated: reading the client's hello, then (our hello sent) its proof. `have`
    /// counts both: at most `MAX_UNAUTHENTICATED_BYTES` are ever read.
    Handshake { hs: Box<ServerHandshake>, hello: [u8; CLIENT_HELLO_LEN], proof: [u8; PROOF_LEN], have: usize },
    /// Authenticated: reading a request (its header, then a body of validated length).
    Request { head: [u8; REQ_HEADER], have: usize, body: Vec<u8>, body_have: usize },
    /// Authenticated: a GET waiting for its key.
    Waiting { key: String, until: Instant },
}

pub(super) fn fresh_request() -> Phase {
    Phase::Request { head: [0; REQ_HEADER], have: 0, body: Vec::new(), body_have: 0 }
}

pub(super) struct Conn {
    pub(super) s: TcpStream,
    pub(super) ip: IpAddr,
    pub(super) opened: Instant,
    pub(super) phase: Phase,
    pub(super) authed: bool,
    pub(super) out: Vec<u8>,
    pub(super) out_pos: usize,
    pub(super) close_when_flushed: bool,
    pub(super) dead: bool,
}

pub(super) struct State {
    pub(super) secret: Secret,
    pub(super) me: Identity,
    pub(super) map: HashMap<String, Vec<u8>>,
    pub(super) bytes: usize,
    pub(super) unauth: usize,
    pub(super) authed: usize,
    pub(super) per_ip: HashMap<IpAddr, usize>,
    pub(super) stats: StoreStats,
}

impl State {
    /// Mark `c` dead and give back its slot (once).
    pub(super) fn kill(&mut self, c: &mut Conn) {
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

pub(super) fn reply(c: &mut Conn, status: u8, data: &[u8]) {
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
pub(super) fn service(c: &mut Conn, st: &mut State) {
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
