//! The handshake protocol: the hello, proof and verdict messages, the server's and the client's
//! side as state machines without I/O ([`ServerHandshake`], [`ClientHandshake`]), and the blocking
//! drivers that run them over a [`HandshakeStream`] before a deadline ([`client_handshake`],
//! [`server_handshake`]). The wire format, and what the handshake does and does not guarantee, are
//! described in the module docs of `comm::auth` (`mod.rs`).

use super::super::error::{CommError, CommResult};
use super::{HmacSha256, Identity, Secret};
use hmac::Mac;
use std::io::{ErrorKind, Read, Write};
use std::time::{Duration, Instant};

/// The client's first message.
pub const CLIENT_HELLO_LEN: usize = 80;
/// The server's hello and its proof.
pub const SERVER_HELLO_LEN: usize = CLIENT_HELLO_LEN + PROOF_LEN;
/// An HMAC-SHA256 proof.
pub const PROOF_LEN: usize = 32;
/// The longest refusal reason the server sends (and the client reads).
pub const MAX_REASON: usize = 255;
/// Everything a server reads from a peer before it is authenticated.
pub const MAX_UNAUTHENTICATED_BYTES: usize = CLIENT_HELLO_LEN + PROOF_LEN;
/// A sensible deadline for the whole handshake of an accepted connection.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);

const MAGIC: [u8; 4] = *b"SLA1";
const LABEL: &[u8] = b"shardlab-auth-v1\0";
const ROLE_CLIENT: u8 = b'C';
const ROLE_SERVER: u8 = b'S';
const ACCEPTED: u8 = 0;
const REFUSED: u8 = 1;

fn nonce() -> CommResult<[u8; 32]> {
    let mut n = [0u8; 32];
    getrandom::getrandom(&mut n).map_err(|e| CommError::Io(format!("no random bytes from the OS: {e}")))?;
    Ok(n)
}

fn hello(role: u8, me: &Identity, nonce: &[u8; 32]) -> [u8; CLIENT_HELLO_LEN] {
    let mut b = [0u8; CLIENT_HELLO_LEN];
    b[0..4].copy_from_slice(&MAGIC);
    b[4] = role;
    b[5] = me.channel;
    b[8..12].copy_from_slice(&me.rank.to_le_bytes());
    b[12..16].copy_from_slice(&me.world_size.to_le_bytes());
    b[16..48].copy_from_slice(&me.job);
    b[48..80].copy_from_slice(nonce);
    b
}

/// The identity in a hello, if it is one (right magic, role and reserved bytes).
fn parse_hello(b: &[u8; CLIENT_HELLO_LEN], role: u8) -> Option<Identity> {
    if b[0..4] != MAGIC || b[4] != role || b[6] != 0 || b[7] != 0 {
        return None;
    }
    Some(Identity {
        rank: u32::from_le_bytes(b[8..12].try_into().unwrap()),
        world_size: u32::from_le_bytes(b[12..16].try_into().unwrap()),
        channel: b[5],
        job: b[16..48].try_into().unwrap(),
    })
}

fn prover(secret: &Secret, role: u8, client_hello: &[u8], server_hello: &[u8]) -> HmacSha256 {
    let mut m = secret.mac();
    m.update(LABEL);
    m.update(&[role]);
    m.update(client_hello);
    m.update(&server_hello[..CLIENT_HELLO_LEN]);
    m
}

fn verdict(status: u8, reason: &str) -> Vec<u8> {
    let mut r = reason.as_bytes();
    if r.len() > MAX_REASON {
        let mut end = MAX_REASON;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        r = &r[..end];
    }
    let mut v = Vec::with_capacity(2 + r.len());
    v.push(status);
    v.push(r.len() as u8);
    v.extend_from_slice(r);
    v
}

/// The server's half of the handshake, as a state machine without I/O: for event loops (the store
/// drives it from poll(2)). [`server_handshake`] drives it over a blocking stream.
pub struct ServerHandshake {
    secret: Secret,
    me: Identity,
    nonce: [u8; 32],
    /// The client's hello and our hello (with proof), once the hello arrived.
    transcript: Option<([u8; CLIENT_HELLO_LEN], [u8; SERVER_HELLO_LEN])>,
}

impl ServerHandshake {
    pub fn new(secret: &Secret, me: &Identity) -> CommResult<Self> {
        Ok(ServerHandshake { secret: secret.clone(), me: *me, nonce: nonce()?, transcript: None })
    }

    /// The client's hello ([`CLIENT_HELLO_LEN`] bytes) → our hello and proof, to send back.
    /// `Err(CommError::Auth)` if it is not a hello at all.
    pub fn on_hello(&mut self, client_hello: &[u8; CLIENT_HELLO_LEN]) -> CommResult<[u8; SERVER_HELLO_LEN]> {
        if self.transcript.is_some() {
            return Err(CommError::Auth("handshake: a second hello".into()));
        }
        if parse_hello(client_hello, ROLE_CLIENT).is_none() {
            return Err(CommError::Auth("the peer did not open with a shardlab hello".into()));
        }
        let mut out = [0u8; SERVER_HELLO_LEN];
        out[..CLIENT_HELLO_LEN].copy_from_slice(&hello(ROLE_SERVER, &self.me, &self.nonce));
        let proof = prover(&self.secret, ROLE_SERVER, client_hello, &out).finalize().into_bytes();
        out[CLIENT_HELLO_LEN..].copy_from_slice(&proof);
        self.transcript = Some((*client_hello, out));
        Ok(out)
    }

    /// The client's proof → its identity, proven. `Err(CommError::Auth)` if the proof is wrong
    /// (another secret, a replay) or the peer belongs to another job or channel.
    pub fn on_proof(&self, proof: &[u8; PROOF_LEN]) -> CommResult<Identity> {
        let (ch, sh) =
            self.transcript.as_ref().ok_or_else(|| CommError::Auth("handshake: proof before hello".into()))?;
        let peer = parse_hello(ch, ROLE_CLIENT).expect("checked in on_hello");
        prover(&self.secret, ROLE_CLIENT, ch, sh).verify_slice(proof).map_err(|_| {
            CommError::Auth("the peer could not prove it knows the job's secret (SHARDLAB_SECRET)".into())
        })?;
        if !peer.same_job(&self.me) {
            return Err(CommError::Auth("the peer belongs to another job (different job id)".into()));
        }
        if peer.channel != self.me.channel {
            return Err(CommError::Auth(format!(
                "the peer opened channel {:?}, this endpoint serves channel {:?}",
                peer.channel as char, self.me.channel as char
            )));
        }
        Ok(peer)
    }

    /// The verdict that tells an authenticated client it is in.
    pub fn accepted() -> Vec<u8> {
        verdict(ACCEPTED, "")
    }

    /// The verdict that tells an authenticated client why it is refused (at most
    /// [`MAX_REASON`] bytes of `reason` are sent).
    pub fn refused(reason: &str) -> Vec<u8> {
        verdict(REFUSED, reason)
    }
}

/// The client's half of the handshake, without I/O (see [`client_handshake`]).
pub struct ClientHandshake {
    secret: Secret,
    me: Identity,
    hello: [u8; CLIENT_HELLO_LEN],
}

impl ClientHandshake {
    pub fn new(secret: &Secret, me: &Identity) -> CommResult<Self> {
        let hello = hello(ROLE_CLIENT, me, &nonce()?);
        Ok(ClientHandshake { secret: secret.clone(), me: *me, hello })
    }

    /// Our hello, to send first.
    pub fn hello(&self) -> &[u8; CLIENT_HELLO_LEN] {
        &self.hello
    }

    /// The server's hello and proof → its identity (proven) and our proof, to send back.
    pub fn on_server_hello(&self, sh: &[u8; SERVER_HELLO_LEN]) -> CommResult<(Identity, [u8; PROOF_LEN])> {
        let peer = parse_hello(sh[..CLIENT_HELLO_LEN].try_into().unwrap(), ROLE_SERVER).ok_or_else(|| {
            CommError::Auth("the peer did not answer with a shardlab hello (not a shardlab port?)".into())
        })?;
        if !peer.same_job(&self.me) {
            return Err(CommError::Auth(
                "the peer belongs to another job (different job id; is another job using this port?)".into(),
            ));
        }
        if peer.channel != self.me.channel {
            return Err(CommError::Auth(format!(
                "the peer answered on channel {:?}, expected {:?}",
                peer.channel as char, self.me.channel as char
            )));
        }
        prover(&self.secret, ROLE_SERVER, &self.hello, sh).verify_slice(&sh[CLIENT_HELLO_LEN..]).map_err(|_| {
            CommError::Auth(
                "the peer could not prove it knows this job's secret: SHARDLAB_SECRET differs between the ranks \
                 (set the same value on every machine), or a stranger answered"
                    .into(),
            )
        })?;
        let proof = prover(&self.secret, ROLE_CLIENT, &self.hello, sh).finalize().into_bytes().into();
        Ok((peer, proof))
    }
}

/// A stream the blocking handshakes can put a deadline on.
pub trait HandshakeStream: Read + Write {
    /// Make the stream blocking, with reads and writes that give up after `t` (`None`: never).
    fn set_io_timeout(&mut self, t: Option<Duration>) -> std::io::Result<()>;
}

impl HandshakeStream for std::net::TcpStream {
    fn set_io_timeout(&mut self, t: Option<Duration>) -> std::io::Result<()> {
        self.set_nonblocking(false)?;
        self.set_read_timeout(t)?;
        self.set_write_timeout(t)
    }
}

impl HandshakeStream for std::os::unix::net::UnixStream {
    fn set_io_timeout(&mut self, t: Option<Duration>) -> std::io::Result<()> {
        self.set_nonblocking(false)?;
        self.set_read_timeout(t)?;
        self.set_write_timeout(t)
    }
}

fn left(deadline: Instant) -> std::io::Result<Duration> {
    let l = deadline.saturating_duration_since(Instant::now());
    if l.is_zero() {
        return Err(std::io::Error::new(ErrorKind::TimedOut, "handshake deadline passed"));
    }
    Ok(l.max(Duration::from_millis(1)))
}

fn read_full<S: HandshakeStream>(s: &mut S, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut pos = 0;
    while pos < buf.len() {
        s.set_io_timeout(Some(left(deadline)?))?;
        match s.read(&mut buf[pos..]) {
            Ok(0) => {
                return Err(std::io::Error::new(ErrorKind::UnexpectedEof, "connection closed during the handshake"))
            }
            Ok(n) => pos += n,
            Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_full<S: HandshakeStream>(s: &mut S, mut buf: &[u8], deadline: Instant) -> std::io::Result<()> {
    while !buf.is_empty() {
        s.set_io_timeout(Some(left(deadline)?))?;
        match s.write(buf) {
            Ok(0) => return Err(std::io::Error::new(ErrorKind::WriteZero, "connection closed during the handshake")),
            Ok(n) => buf = &buf[n..],
            Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Run the client's side of the handshake on `s` (which dialled the peer) before `deadline`.
///
/// `me` is what we claim; `check` sees the peer's identity once its proof verified, and can
/// refuse it (e.g. [`expect_rank`](super::expect_rank)). Returns the peer's proven identity once
/// the peer accepted us.
///
/// Errors: [`CommError::Io`] if the connection broke or the deadline passed (worth retrying: a
/// busy store drops connections), [`CommError::Auth`] if the peer is not of this job or could not
/// prove the secret, [`CommError::Rendezvous`] if the peer refused us (with its reason), or
/// whatever `check` returned. On return the stream is blocking with no timeouts.
pub fn client_handshake<S: HandshakeStream>(
    s: &mut S,
    secret: &Secret,
    me: &Identity,
    deadline: Instant,
    check: impl FnOnce(&Identity) -> CommResult<()>,
) -> CommResult<Identity> {
    client_handshake_with_verdict(s, secret, me, deadline, deadline, check)
}

/// [`client_handshake`] waiting for the verdict until `verdict_deadline`: a server that has taken
/// our proof may have accepted us already, and a redial would then be a duplicate.
pub fn client_handshake_with_verdict<S: HandshakeStream>(
    s: &mut S,
    secret: &Secret,
    me: &Identity,
    deadline: Instant,
    verdict_deadline: Instant,
    check: impl FnOnce(&Identity) -> CommResult<()>,
) -> CommResult<Identity> {
    let r = client_inner(s, secret, me, (deadline, verdict_deadline.max(deadline)), check);
    let _ = s.set_io_timeout(None);
    r
}

fn client_inner<S: HandshakeStream>(
    s: &mut S,
    secret: &Secret,
    me: &Identity,
    (deadline, verdict_deadline): (Instant, Instant),
    check: impl FnOnce(&Identity) -> CommResult<()>,
) -> CommResult<Identity> {
    let io = |e: std::io::Error| CommError::Io(format!("authentication handshake: {e}"));
    let hs = ClientHandshake::new(secret, me)?;
    write_full(s, hs.hello(), deadline).map_err(io)?;
    let mut sh = [0u8; SERVER_HELLO_LEN];
    read_full(s, &mut sh, deadline).map_err(io)?;
    let (peer, proof) = hs.on_server_hello(&sh)?;
    check(&peer)?;
    write_full(s, &proof, deadline).map_err(io)?;
    let mut v = [0u8; 2];
    read_full(s, &mut v, verdict_deadline).map_err(io)?;
    let mut reason = [0u8; MAX_REASON];
    let reason = &mut reason[..v[1] as usize];
    read_full(s, reason, verdict_deadline).map_err(io)?;
    match v[0] {
        ACCEPTED => Ok(peer),
        REFUSED => Err(CommError::Rendezvous(format!(
            "rank {} refused the connection: {}",
            peer.rank(),
            String::from_utf8_lossy(reason)
        ))),
        x => Err(CommError::Auth(format!("the peer sent an unknown verdict {x}"))),
    }
}

/// Run the server's side of the handshake on an accepted `s` before `deadline`.
///
/// Reads at most [`MAX_UNAUTHENTICATED_BYTES`] from the peer before it is authenticated, into
/// fixed buffers. `check` sees the peer's identity once its proof verified; if it refuses, the
/// peer is told why and `check`'s error is returned.
///
/// Errors: [`CommError::Auth`] for everything that means "this peer did not authenticate" —
/// garbage, silence past the deadline, a broken connection, another secret, another job or
/// channel, a replay: drop the connection and keep serving. Any other error is `check`'s (an
/// authenticated rank of this job that was refused: usually a real error for the job). `check`
/// should therefore not return `CommError::Auth` itself. On return the stream is blocking with no
/// timeouts.
pub fn server_handshake<S: HandshakeStream>(
    s: &mut S,
    secret: &Secret,
    me: &Identity,
    deadline: Instant,
    check: impl FnOnce(&Identity) -> CommResult<()>,
) -> CommResult<Identity> {
    server_handshake_observed(s, secret, me, deadline, || {}, || true, check)
}

/// [`server_handshake`], calling `said_hello` once the peer has opened with a well-formed shardlab
/// hello (not yet proven: a crowded listener uses it to evict silent strangers before peers that
/// are talking), and `commit` once the peer is proven and checked, *before* it is told it is in:
/// `false` (the listener cut this connection meanwhile) sends no verdict, so the peer sees its
/// connection close and dials again instead of holding a connection nobody keeps.
pub(crate) fn server_handshake_observed<S: HandshakeStream>(
    s: &mut S,
    secret: &Secret,
    me: &Identity,
    deadline: Instant,
    said_hello: impl FnOnce(),
    commit: impl FnOnce() -> bool,
    check: impl FnOnce(&Identity) -> CommResult<()>,
) -> CommResult<Identity> {
    let r = server_inner(s, secret, me, deadline, said_hello, commit, check);
    let _ = s.set_io_timeout(None);
    r
}

fn server_inner<S: HandshakeStream>(
    s: &mut S,
    secret: &Secret,
    me: &Identity,
    deadline: Instant,
    said_hello: impl FnOnce(),
    commit: impl FnOnce() -> bool,
    check: impl FnOnce(&Identity) -> CommResult<()>,
) -> CommResult<Identity> {
    let io = |e: std::io::Error| CommError::Auth(format!("handshake with an unauthenticated peer: {e}"));
    let mut hs = ServerHandshake::new(secret, me)?;
    let mut ch = [0u8; CLIENT_HELLO_LEN];
    read_full(s, &mut ch, deadline).map_err(io)?;
    let sh = hs.on_hello(&ch)?;
    said_hello();
    write_full(s, &sh, deadline).map_err(io)?;
    let mut proof = [0u8; PROOF_LEN];
    read_full(s, &mut proof, deadline).map_err(io)?;
    let peer = hs.on_proof(&proof)?;
    match check(&peer) {
        Ok(()) if !commit() => Err(CommError::Auth("the listener cut the connection before accepting it".into())),
        Ok(()) => {
            write_full(s, &ServerHandshake::accepted(), deadline).map_err(io)?;
            Ok(peer)
        }
        Err(e) => {
            let _ = write_full(s, &ServerHandshake::refused(&e.to_string()), deadline);
            Err(e)
        }
    }
}

#[cfg(test)]
#[path = "handshake_tests.rs"]
mod tests;
