//! Building the mesh: every pair of ranks gets two TCP connections, a *data* connection for the
//! frames of collectives and a *control* connection that carries nothing but an abort or a
//! goodbye (so a failure reaches a rank at once, whatever is queued on its data connection).
//!
//! Rank r listens on two ephemeral ports (data, control), publishes them in the store as
//! `addr/r`, dials every lower rank and accepts every higher rank. Every connection is
//! authenticated first (the job's secret, challenge-response: [`auth`]), both sides proving
//! their rank, world size and channel. Accepted connections are handshaken on short-lived threads
//! with a deadline; at most `MAX_PENDING` wait at once (16 per address). A new one evicts the
//! oldest that has overstayed: silent for `GRACE` since it connected, or, after opening with a
//! shardlab hello, without its proof for `PROOF_GRACE` (a rank sends its proof one round trip
//! after its hello). If none has, the newcomer is dropped. So strangers that connect and stay
//! silent, send garbage, or say hello and stall are dropped without locking the job's ranks out
//! (a dialling rank that was dropped or evicted retries until the rendezvous deadline).

use super::super::auth::{self, Identity};
use super::super::error::{CommError, CommResult};
use super::super::store::StoreClient;
use super::super::CommConfig;
use std::collections::VecDeque;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Connections handshaking at once on one rank's listeners, and per peer address.
const MAX_PENDING: usize = 64;
const MAX_PENDING_PER_ADDR: usize = 16;
/// How long a new connection has to open with its hello before a newcomer may evict it. A real
/// rank sends its hello as soon as it has connected; on loopback the job's ranks share an address
/// with any local stranger, so without it a flood would evict a rank's connection before its
/// hello was read (measured from the accept, so it also covers starting the handshake's thread).
const GRACE: Duration = Duration::from_millis(100);
/// How long a connection that said hello is safe from eviction while its proof is due.
const PROOF_GRACE: Duration = Duration::from_secs(1);

/// The two connections to one peer.
pub(super) struct Links {
    pub data: TcpStream,
    pub ctl: TcpStream,
}

/// Dial rank `peer` at `addr` on `channel` and authenticate both ways; retried (an eviction by a
/// crowded listener, a refused connection) until `deadline`.
fn dial(
    cfg: &CommConfig,
    addr: SocketAddr,
    (rank, peer, world): (usize, usize, usize),
    channel: u8,
    deadline: Instant,
) -> CommResult<TcpStream> {
    let secret = cfg.secret.as_ref().expect("init_tcp resolves the secret");
    let me = Identity::new(&cfg.job_id, rank, world, channel);
    let rdv = |m: String| CommError::Rendezvous(format!("rank {rank}: {m}"));
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(100)))
            .map_err(|e| CommError::Io(format!("cannot connect to rank {peer} at {addr}: {e}")))
            .and_then(|mut s| {
                // The exchange within the handshake's deadline; the verdict as long as the
                // rendezvous lasts (the listener may have accepted us already).
                let until = deadline.min(Instant::now() + auth::HANDSHAKE_DEADLINE);
                auth::client_handshake_with_verdict(&mut s, secret, &me, until, deadline, |p| {
                    auth::expect_rank(p, peer, world)
                })?;
                Ok(s)
            });
        match attempt {
            Ok(s) => return Ok(s),
            Err(CommError::Io(m)) if Instant::now() < deadline => {
                let _ = m; // the listener was busy or evicted us: try again
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(CommError::Io(m)) => return Err(rdv(format!("{m} (within {:?})", cfg.rendezvous_timeout))),
            Err(e) => return Err(e),
        }
    }
}

/// An accepted connection after its handshake: the peer's proven identity.
type Accepted = CommResult<(Identity, TcpStream)>;

/// A handshake in flight on its own thread. Finishing and being cut short exclude each other
/// (one lock), so a connection is either handed over whole or closed, never both.
struct Pending {
    from: IpAddr,
    since: Instant,
    handle: TcpStream,
    state: std::sync::Arc<std::sync::Mutex<Hs>>,
}

#[derive(PartialEq)]
enum Hs {
    Running,
    /// Opened with a well-formed hello at this instant; its proof is due.
    SaidHello(Instant),
    Finished,
    Cut,
}

impl Pending {
    fn running(&self) -> bool {
        matches!(*super::relock(&self.state), Hs::Running | Hs::SaidHello(_))
    }
    /// Cut it short if it has overstayed (silent for `GRACE` since it connected, or without its
    /// proof for `PROOF_GRACE` since its hello): checked and cut under one lock, so a hello read
    /// meanwhile is not cut. True if it was cut.
    fn evict_if_overstayed(&self) -> bool {
        let mut st = super::relock(&self.state);
        let overstayed = match *st {
            Hs::Running => self.since.elapsed() >= GRACE,
            Hs::SaidHello(at) => at.elapsed() >= PROOF_GRACE,
            Hs::Finished | Hs::Cut => false,
        };
        if overstayed {
            *st = Hs::Cut;
            let _ = self.handle.shutdown(Shutdown::Both);
        }
        overstayed
    }
    /// Close it if it is still handshaking.
    fn cut(&self) {
        let mut st = super::relock(&self.state);
        if matches!(*st, Hs::Running | Hs::SaidHello(_)) {
            *st = Hs::Cut;
            let _ = self.handle.shutdown(Shutdown::Both);
        }
    }
}

/// Accept on `listener` (channel `channel`), handshaking each connection on its own thread.
struct Acceptor {
    listener: TcpListener,
    me: Identity,
    channel: u8,
}

/// Build the mesh of `rank`: `Links` to every other rank (None for itself).
pub(super) fn connect(
    rank: usize,
    world: usize,
    store: &mut StoreClient,
    ip: IpAddr,
    cfg: &CommConfig,
) -> CommResult<Vec<Option<Links>>> {
    let rdv = |m: String| CommError::Rendezvous(format!("rank {rank}: {m}"));
    let listen = || TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| rdv(format!("cannot listen on {ip}: {e}")));
    let acceptors = [(listen()?, auth::CHANNEL_DATA), (listen()?, auth::CHANNEL_CONTROL)].map(|(listener, channel)| {
        Acceptor { listener, me: Identity::new(&cfg.job_id, rank, world, channel), channel }
    });
    let port = |a: &Acceptor| a.listener.local_addr().map(|a| a.port()).map_err(|e| CommError::io("local_addr", e));
    store.set(&format!("addr/{rank}"), format!("{ip} {} {}", port(&acceptors[0])?, port(&acceptors[1])?).as_bytes())?;
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    let mut data: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut ctl: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();

    for peer in 0..rank {
        let left = deadline.saturating_duration_since(Instant::now());
        let addr = store.get(&format!("addr/{peer}"), left)?.ok_or_else(|| {
            rdv(format!("rank {peer} did not publish its address within {:?}", cfg.rendezvous_timeout))
        })?;
        let addr = String::from_utf8_lossy(&addr).into_owned();
        let bad = || CommError::Protocol(format!("bad address for rank {peer} in the store: {addr:?}"));
        let mut f = addr.split(' ');
        let (host, pd, pc) = (f.next().ok_or_else(bad)?, f.next().ok_or_else(bad)?, f.next().ok_or_else(bad)?);
        let host: IpAddr = host.parse().map_err(|_| bad())?;
        let (pd, pc): (u16, u16) = (pd.parse().map_err(|_| bad())?, pc.parse().map_err(|_| bad())?);
        let who = (rank, peer, world);
        data[peer] = Some(dial(cfg, SocketAddr::new(host, pd), who, auth::CHANNEL_DATA, deadline)?);
        ctl[peer] = Some(dial(cfg, SocketAddr::new(host, pc), who, auth::CHANNEL_CONTROL, deadline)?);
    }

    let secret = cfg.secret.clone().expect("init_tcp resolves the secret");
    for a in &acceptors {
        a.listener.set_nonblocking(true).map_err(|e| CommError::io("set_nonblocking", e))?;
    }
    let (tx, rx) = crossbeam_channel::unbounded::<Accepted>();
    let mut pending: VecDeque<Pending> = VecDeque::new();
    let mut missing = 2 * (world - rank - 1);
    let result = (|| {
        while missing > 0 {
            if Instant::now() >= deadline {
                let absent: Vec<usize> =
                    (rank + 1..world).filter(|p| data[*p].is_none() || ctl[*p].is_none()).collect();
                return Err(rdv(format!(
                    "ranks {absent:?} did not connect within {:?} (did they start? same WORLD_SIZE? same {}?)",
                    cfg.rendezvous_timeout,
                    auth::SECRET_ENV
                )));
            }
            pending.retain(Pending::running);
            let mut idle = true;
            for a in &acceptors {
                let (s, from) = match a.listener.accept() {
                    Ok((s, from)) => (s, from.ip()),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(CommError::io("accept", e)),
                };
                idle = false;
                // Crowded: cut the oldest handshake that overstayed short (of this address, if it
                // has too many), or drop the newcomer if every one is still within its grace.
                let same = pending.iter().filter(|p| p.from == from).count();
                let crowded = same >= MAX_PENDING_PER_ADDR || pending.len() >= MAX_PENDING;
                if crowded {
                    let mine = same >= MAX_PENDING_PER_ADDR;
                    match pending.iter().position(|p| (!mine || p.from == from) && p.evict_if_overstayed()) {
                        Some(i) => drop(pending.remove(i)),
                        None => {
                            let _ = s.shutdown(Shutdown::Both);
                            continue;
                        }
                    }
                }
                let Ok(handle) = s.try_clone() else { continue };
                let state = std::sync::Arc::new(std::sync::Mutex::new(Hs::Running));
                let (tx, secret, me, ch, st) = (tx.clone(), secret.clone(), a.me, a.channel, state.clone());
                let spawned = std::thread::Builder::new().name("shardlab-hello".into()).spawn(move || {
                    let mut s = s;
                    let until = Instant::now() + auth::HANDSHAKE_DEADLINE;
                    let check = |p: &Identity| {
                        if p.world_size() != world {
                            return auth::expect_rank(p, p.rank(), world); // the Mismatch error
                        }
                        if p.rank() <= rank || p.rank() >= world || p.channel() != ch {
                            return Err(CommError::Rendezvous(format!(
                                "rank {rank}: unexpected connection from rank {} on channel {:?}",
                                p.rank(),
                                p.channel() as char
                            )));
                        }
                        Ok(())
                    };
                    let hello = || {
                        let mut st = super::relock(&st);
                        if *st == Hs::Running {
                            *st = Hs::SaidHello(Instant::now());
                        }
                    };
                    // Finished (safe from eviction) before the peer is told it is in; a
                    // connection evicted first is never accepted, so its dialler redials.
                    let commit = || {
                        let mut st = super::relock(&st);
                        let kept = *st != Hs::Cut;
                        if kept {
                            *st = Hs::Finished;
                        }
                        kept
                    };
                    let outcome = auth::server_handshake_observed(&mut s, &secret, &me, until, hello, commit, check);
                    {
                        let mut st = super::relock(&st);
                        if *st == Hs::Cut {
                            return; // evicted meanwhile: its socket is already shut
                        }
                        *st = Hs::Finished;
                    }
                    match outcome {
                        Ok(peer) => _ = tx.send(Ok((peer, s))),
                        Err(CommError::Auth(_)) => {} // a stranger, garbage or a timeout: dropped
                        Err(e) => _ = tx.send(Err(e)),
                    }
                });
                if spawned.is_ok() {
                    pending.push_back(Pending { from, since: Instant::now(), handle, state });
                }
            }
            let got = if idle { rx.recv_timeout(Duration::from_millis(2)).ok() } else { rx.try_recv().ok() };
            let Some(got) = got else { continue };
            let (peer, s) = got?;
            let slot = if peer.channel() == auth::CHANNEL_DATA { &mut data } else { &mut ctl };
            if slot[peer.rank()].is_some() {
                return Err(rdv(format!(
                    "two connections claim to be rank {} (two processes with the same RANK?)",
                    peer.rank()
                )));
            }
            slot[peer.rank()] = Some(s);
            missing -= 1;
        }
        Ok(())
    })();
    // Handshakes still running belong to strangers (or to a failed rendezvous): cut them short.
    pending.iter().for_each(Pending::cut);
    result?;
    Ok(data.into_iter().zip(ctl).map(|(d, c)| Some(Links { data: d?, ctl: c? })).collect())
}
