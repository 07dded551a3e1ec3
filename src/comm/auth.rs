//! Who may talk to a job: a per-job secret and a mutual challenge-response that every connection
//! of a TCP job (the store's, and the rank-to-rank ones) runs before anything else is read.
//!
//! # The secret
//!
//! A job's ranks share 32 random bytes, the [`Secret`]. It never travels on the wire: each side of
//! a connection proves that it knows it. Where it comes from, in this order:
//!
//! 1. [`CommConfig::secret`](super::CommConfig::secret), which `CommConfig::default()` reads from
//!    the environment variable **`SHARDLAB_SECRET`** (64 hex digits, e.g. from
//!    `openssl rand -hex 32`). A value that is not 64 hex digits is an error, never ignored.
//! 2. [`crate::launch::spawn`] generates a fresh one per job from the OS's random source when
//!    none is set, and hands it to its thread ranks and child processes (in the config and in
//!    `SHARDLAB_SECRET`). Jobs started by `spawn` are therefore always authenticated.
//! 3. Ranks started by another launcher (torchrun, Slurm, by hand) without `SHARDLAB_SECRET`:
//!    * if the store is only reachable over loopback (rank 0 binds a loopback address —
//!      `SHARDLAB_STORE_BIND`, default 127.0.0.1 — and MASTER_ADDR is loopback), the secret is
//!      derived from the job id, with a one-time warning on stderr: the rendezvous is then
//!      authenticated only against processes that do not know the job id (anyone on the machine
//!      who can read your command line or environment does);
//!    * otherwise (several machines, `SHARDLAB_STORE_BIND=0.0.0.0`, a non-loopback MASTER_ADDR)
//!      the rank refuses to start, with a message saying to export the same `SHARDLAB_SECRET` on
//!      every machine: an unauthenticated store reachable from the network is never opened.
//!
//! For a job on several machines, generate one secret and export it everywhere before starting
//! the ranks:
//!
//! ```text
//! export SHARDLAB_SECRET=$(openssl rand -hex 32)   # once; copy the same value to every machine
//! ```
//!
//! # The handshake
//!
//! The side that dialled is the *client*, the side that accepted the *server*. Each side claims
//! an [`Identity`] — rank, world size, channel byte and (a hash of) the job id — and sends a fresh
//! 32-byte random nonce:
//!
//! ```text
//! client → server  HELLO  (80 bytes)  magic "SLA1" | role 'C' | channel | 0 | 0 | rank u32 | world u32 | SHA-256(job id) | nonce_c
//! server → client  HELLO' (112 bytes) the same fields for the server (role 'S', nonce_s) | proof_s
//! client → server  proof_c (32 bytes)
//! server → client  verdict (2..257 bytes) status u8 (0 accepted, 1 refused) | len u8 | reason
//!
//! proof_x = HMAC-SHA256(secret, "shardlab-auth-v1\0" | x | HELLO | HELLO' without its proof)
//! ```
//!
//! Both proofs cover both nonces and both claimed identities, and name the prover's role, so a
//! recorded transcript cannot be replayed (the other side's nonce is new each time), a proof
//! cannot be reflected back, and a claimed rank, world size, channel or job cannot be changed in
//! flight. Proofs are compared in constant time (`verify_slice`). Every read has a deadline and the
//! server reads at most 112 bytes from an unauthenticated peer, into fixed-size buffers.
//!
//! What this does not do: it does not encrypt or sign the traffic that follows. It keeps strangers
//! who can *connect* to a port out of the job; a network attacker who can *modify* packets between
//! two ranks is out of scope (use a private network, a VPN or an SSH tunnel).
//!
//! # Using it on a connection
//!
//! ```ignore
//! // Dialling rank `peer` (the data connection):
//! let me = Identity::new(&cfg.job_id, rank, world, auth::CHANNEL_DATA);
//! let secret = cfg.secret.as_ref().expect("init_tcp resolved the secret");
//! let deadline = Instant::now() + auth::HANDSHAKE_DEADLINE.min(left);
//! auth::client_handshake(&mut stream, secret, &me, deadline, |p| auth::expect_rank(p, peer, world))?;
//!
//! // Accepting (on the listener's side):
//! match auth::server_handshake(&mut stream, secret, &me, deadline, |p| my_check(p)) {
//!     Ok(peer) => { /* peer.rank(), peer.channel() are proven */ }
//!     Err(CommError::Auth(_)) => { /* a stranger, garbage, a timeout: drop it, keep accepting */ }
//!     Err(e) => { /* an authenticated rank of this job failed `my_check`: a real error */ }
//! }
//! ```

use super::error::{CommError, CommResult};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::io::{ErrorKind, Read, Write};
use std::time::{Duration, Instant};

/// The environment variable that carries the job's secret (64 hex digits).
pub const SECRET_ENV: &str = "SHARDLAB_SECRET";
/// Bytes of a [`Secret`].
pub const SECRET_LEN: usize = 32;
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

/// Channel byte of store connections.
pub const CHANNEL_STORE: u8 = b'S';
/// Channel byte of rank-to-rank data connections.
pub const CHANNEL_DATA: u8 = b'D';
/// Channel byte of rank-to-rank control connections.
pub const CHANNEL_CONTROL: u8 = b'C';

const MAGIC: [u8; 4] = *b"SLA1";
const LABEL: &[u8] = b"shardlab-auth-v1\0";
const ROLE_CLIENT: u8 = b'C';
const ROLE_SERVER: u8 = b'S';
const ACCEPTED: u8 = 0;
const REFUSED: u8 = 1;

type HmacSha256 = Hmac<Sha256>;

/// A job's shared secret. Its `Debug` never shows it; serde carries it as hex (that is how
/// [`crate::launch::spawn`] hands it to child processes).
#[derive(Clone)]
pub struct Secret([u8; SECRET_LEN]);

impl Secret {
    /// 32 fresh bytes from the operating system's random source.
    pub fn generate() -> CommResult<Secret> {
        let mut b = [0u8; SECRET_LEN];
        getrandom::getrandom(&mut b).map_err(|e| CommError::Io(format!("no random bytes from the OS: {e}")))?;
        Ok(Secret(b))
    }

    pub fn from_bytes(bytes: [u8; SECRET_LEN]) -> Secret {
        Secret(bytes)
    }

    /// Parse 64 hex digits (surrounding whitespace allowed).
    pub fn from_hex(hex: &str) -> CommResult<Secret> {
        let h = hex.trim().as_bytes();
        let bad = || {
            CommError::InvalidArgument(format!(
                "{SECRET_ENV} must be {} hex digits ({SECRET_LEN} bytes, e.g. from `openssl rand -hex 32`); got {} characters{}",
                2 * SECRET_LEN,
                h.len(),
                if h.len() == 2 * SECRET_LEN { " that are not all hex digits" } else { "" }
            ))
        };
        if h.len() != 2 * SECRET_LEN {
            return Err(bad());
        }
        let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        let mut b = [0u8; SECRET_LEN];
        for (i, pair) in h.chunks(2).enumerate() {
            b[i] = (digit(pair[0]).ok_or_else(bad)? << 4) | digit(pair[1]).ok_or_else(bad)?;
        }
        Ok(Secret(b))
    }

    /// The secret as 64 lowercase hex digits — to put in `SHARDLAB_SECRET` for another process.
    /// Treat the result like a password.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// `SHARDLAB_SECRET`, if set; an error if it is set but malformed.
    pub fn from_env() -> CommResult<Option<Secret>> {
        match std::env::var(SECRET_ENV) {
            Ok(v) if v.trim().is_empty() => Ok(None),
            Ok(v) => Secret::from_hex(&v).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(CommError::InvalidArgument(format!("{SECRET_ENV} is not valid UTF-8 hex")))
            }
        }
    }

    /// A secret computed from the job id alone. **Anyone who knows the job id knows it**: this is
    /// only the fallback for single-machine jobs whose launcher did not set `SHARDLAB_SECRET` (see
    /// the module docs), and handy in tests and lessons.
    pub fn derived_from_job_id(job_id: &str) -> Secret {
        let mut h = Sha256::new();
        h.update(b"shardlab-job-id-derived-secret\0");
        h.update(job_id.as_bytes());
        Secret(h.finalize().into())
    }

    fn mac(&self) -> HmacSha256 {
        <HmacSha256 as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl serde::Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> serde::Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Secret::from_hex(&s).map_err(serde::de::Error::custom)
    }
}

/// What one side of a connection claims to be; once a handshake succeeded, the peer's claim is
/// proven (it knows the secret and claimed exactly this in the transcript it signed).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    rank: u32,
    world_size: u32,
    channel: u8,
    job: [u8; 32],
}

impl Identity {
    /// `rank` of `world_size` in job `job_id`, on channel `channel` (e.g. [`CHANNEL_DATA`]).
    /// Ranks and world sizes beyond `u32::MAX` are clamped (no such job exists).
    pub fn new(job_id: &str, rank: usize, world_size: usize, channel: u8) -> Identity {
        Identity {
            rank: u32::try_from(rank).unwrap_or(u32::MAX),
            world_size: u32::try_from(world_size).unwrap_or(u32::MAX),
            channel,
            job: Sha256::digest(job_id.as_bytes()).into(),
        }
    }
    /// The identity of both ends of a store connection: the store serves anybody who knows the
    /// secret, so the rank fields are 0.
    pub fn store(job_id: &str) -> Identity {
        Identity::new(job_id, 0, 0, CHANNEL_STORE)
    }
    pub fn rank(&self) -> usize {
        self.rank as usize
    }
    pub fn world_size(&self) -> usize {
        self.world_size as usize
    }
    pub fn channel(&self) -> u8 {
        self.channel
    }
    /// Same job (by the hash of its id)?
    pub fn same_job(&self, other: &Identity) -> bool {
        self.job == other.job
    }
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Identity {{ rank: {}, world_size: {}, channel: {:?}, job: {:02x}{:02x}{:02x}{:02x}… }}",
            self.rank, self.world_size, self.channel as char, self.job[0], self.job[1], self.job[2], self.job[3]
        )
    }
}

/// A `check` for [`client_handshake`]/[`server_handshake`]: the peer must be rank `rank` of a world
/// of `world_size` (a different world size is a [`CommError::Mismatch`]).
pub fn expect_rank(peer: &Identity, rank: usize, world_size: usize) -> CommResult<()> {
    if peer.world_size() != world_size {
        return Err(CommError::Mismatch(format!(
            "rank {} runs with WORLD_SIZE={}, this rank with WORLD_SIZE={world_size}",
            peer.rank(),
            peer.world_size()
        )));
    }
    if peer.rank() != rank {
        return Err(CommError::Rendezvous(format!(
            "expected rank {rank} but the peer is rank {} (two processes with the same RANK?)",
            peer.rank()
        )));
    }
    Ok(())
}

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
/// refuse it (e.g. [`expect_rank`]). Returns the peer's proven identity once the peer accepted us.
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
    let r = client_inner(s, secret, me, deadline, check);
    let _ = s.set_io_timeout(None);
    r
}

fn client_inner<S: HandshakeStream>(
    s: &mut S,
    secret: &Secret,
    me: &Identity,
    deadline: Instant,
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
    read_full(s, &mut v, deadline).map_err(io)?;
    let mut reason = [0u8; MAX_REASON];
    let reason = &mut reason[..v[1] as usize];
    read_full(s, reason, deadline).map_err(io)?;
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
    server_handshake_observed(s, secret, me, deadline, || {}, check)
}

/// [`server_handshake`], calling `said_hello` once the peer has opened with a well-formed shardlab
/// hello (not yet proven: a crowded listener uses it to evict silent strangers before peers that
/// are talking).
pub(crate) fn server_handshake_observed<S: HandshakeStream>(
    s: &mut S,
    secret: &Secret,
    me: &Identity,
    deadline: Instant,
    said_hello: impl FnOnce(),
    check: impl FnOnce(&Identity) -> CommResult<()>,
) -> CommResult<Identity> {
    let r = server_inner(s, secret, me, deadline, said_hello, check);
    let _ = s.set_io_timeout(None);
    r
}

fn server_inner<S: HandshakeStream>(
    s: &mut S,
    secret: &Secret,
    me: &Identity,
    deadline: Instant,
    said_hello: impl FnOnce(),
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

/// The secret a TCP rank uses (what `init_tcp` puts into its config): `cfg.secret`, else
/// `SHARDLAB_SECRET`, else — only when the store is reachable over loopback alone — one derived
/// from the job id, with a one-time warning; otherwise a clear error. See the module docs.
pub(crate) fn job_secret(
    cfg: &super::CommConfig,
    rank: usize,
    master_addr: &str,
    master_port: u16,
) -> CommResult<Secret> {
    if let Some(s) = &cfg.secret {
        return Ok(s.clone());
    }
    if let Some(s) = Secret::from_env()? {
        return Ok(s);
    }
    let bind_loopback =
        rank != 0 || cfg.store_bind.parse::<std::net::IpAddr>().map(|ip| ip.is_loopback()).unwrap_or(true);
    // An address that does not resolve fails the rendezvous anyway, with its own message.
    let master_loopback = std::net::ToSocketAddrs::to_socket_addrs(&(master_addr, master_port))
        .map(|mut a| a.all(|a| a.ip().is_loopback()))
        .unwrap_or(true);
    if !(bind_loopback && master_loopback) {
        let what = if bind_loopback {
            format!("MASTER_ADDR {master_addr} is not a loopback address")
        } else {
            format!("rank 0's store would listen on {} (SHARDLAB_STORE_BIND)", cfg.store_bind)
        };
        return Err(CommError::InvalidArgument(format!(
            "{SECRET_ENV} is not set and {what}, so the rendezvous would be open to the network without \
             authentication. Generate one secret (`openssl rand -hex 32`) and export it as {SECRET_ENV} \
             with the same value on every machine of the job."
        )));
    }
    static WARN: std::sync::Once = std::sync::Once::new();
    WARN.call_once(|| {
        eprintln!(
            "shardlab: WARNING: {SECRET_ENV} is not set, so this job's rendezvous secret is derived from its \
             job id ({:?}): any process on this machine that knows the job id can join or disrupt the job. \
             Export the same {SECRET_ENV} (e.g. `openssl rand -hex 32`) for every rank, or start the ranks \
             with shardlab::launch::spawn, which generates one.",
            cfg.job_id
        )
    });
    Ok(Secret::derived_from_job_id(&cfg.job_id))
}
