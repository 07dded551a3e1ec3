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
//!      `SHARDLAB_STORE_BIND`, default 127.0.0.1 — and MASTER_ADDR is loopback), rank 0 draws a
//!      fresh secret for the run and leaves it in a file only this user can read, where the other
//!      ranks find it (`local_secret.rs`); it is removed once the group has formed;
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

// The job's secret and the identities live here; the handshake protocol in `handshake.rs`.
mod handshake;
pub(crate) mod local_secret;

use super::error::{CommError, CommResult};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

pub(crate) use handshake::server_handshake_observed;
pub use handshake::{
    client_handshake, client_handshake_with_verdict, server_handshake, ClientHandshake, HandshakeStream,
    ServerHandshake, CLIENT_HELLO_LEN, HANDSHAKE_DEADLINE, MAX_REASON, MAX_UNAUTHENTICATED_BYTES, PROOF_LEN,
    SERVER_HELLO_LEN,
};

/// The environment variable that carries the job's secret (64 hex digits).
pub const SECRET_ENV: &str = "SHARDLAB_SECRET";
/// Bytes of a [`Secret`].
pub const SECRET_LEN: usize = 32;

/// Channel byte of store connections.
pub const CHANNEL_STORE: u8 = b'S';
/// Channel byte of rank-to-rank data connections.
pub const CHANNEL_DATA: u8 = b'D';
/// Channel byte of rank-to-rank control connections.
pub const CHANNEL_CONTROL: u8 = b'C';

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

    /// A secret computed from the job id alone. **Anyone who knows the job id knows it**: for
    /// tests and lessons only (ranks without `SHARDLAB_SECRET` get a fresh one per run, see the
    /// module docs).
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

/// Where a TCP rank's secret came from (see [`job_secret`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SecretFrom {
    /// The config or `SHARDLAB_SECRET`.
    Given,
    /// Drawn by rank 0 for this run: to publish once its store listens (`local_secret.rs`).
    Drawn,
    /// Rank 0's file: read again if the store refuses it.
    File,
}

/// The secret a TCP rank uses (what `init_tcp` puts into its config): `cfg.secret`, else
/// `SHARDLAB_SECRET`, else — only when the store is reachable over loopback alone — a fresh one
/// for this run that rank 0 leaves in a file only this user can read (`local_secret.rs`);
/// otherwise a clear error. See the module docs.
pub(crate) fn job_secret(
    cfg: &super::CommConfig,
    rank: usize,
    master_addr: &str,
    master_port: u16,
) -> CommResult<(Secret, SecretFrom)> {
    if let Some(s) = &cfg.secret {
        return Ok((s.clone(), SecretFrom::Given));
    }
    if let Some(s) = Secret::from_env()? {
        return Ok((s, SecretFrom::Given));
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
    if rank == 0 {
        return Ok((Secret::generate()?, SecretFrom::Drawn));
    }
    let deadline = std::time::Instant::now() + cfg.rendezvous_timeout;
    match local_secret::fetch(&cfg.job_id, master_port, deadline, None) {
        Ok(s) => Ok((s, SecretFrom::File)),
        // No file and no store: rank 0 is not running (say that first).
        Err(e) => match std::net::TcpStream::connect((master_addr, master_port)) {
            Err(refused) => Err(CommError::Rendezvous(format!(
                "could not reach the store at {master_addr}:{master_port} within {:?} ({refused}); is rank 0 running \
                 and MASTER_ADDR/MASTER_PORT right? ({e})",
                cfg.rendezvous_timeout
            ))),
            Ok(_) => Err(e),
        },
    }
}
