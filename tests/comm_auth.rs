//! The authenticated rendezvous (`comm::auth`, `comm::store`): the handshake lets in exactly the
//! processes that know the job's secret — both ways, fresh each time, for the identity they claim —
//! and strangers on the store port (silent, garbage, a wrong secret, a flood) neither stall nor
//! break a real job, nor make the store grow.

use shardlab::comm::auth::{
    self, client_handshake, client_handshake_with_verdict, expect_rank, server_handshake, ClientHandshake,
    HandshakeStream, Identity, Secret, ServerHandshake, CHANNEL_CONTROL, CHANNEL_DATA, CLIENT_HELLO_LEN,
    MAX_UNAUTHENTICATED_BYTES, SERVER_HELLO_LEN,
};
use shardlab::comm::store::{self, StoreClient, StoreServer};
use shardlab::prelude::*;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const JOB: &str = "auth-test";

/// Tests that count the process's store threads or hold a store port run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn secret(b: u8) -> Secret {
    Secret::from_bytes([b; 32])
}

fn soon(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms)
}

/// A connected pair of TCP streams over loopback.
fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    (c, s)
}

/// Run a server handshake on one thread and a client handshake on this one.
fn both<Sv, Cl>(server: Sv, client: Cl) -> (CommResult<Identity>, CommResult<Identity>)
where
    Sv: FnOnce(&mut TcpStream) -> CommResult<Identity> + Send,
    Cl: FnOnce(&mut TcpStream) -> CommResult<Identity>,
{
    let (mut c, mut s) = tcp_pair();
    std::thread::scope(|sc| {
        let h = sc.spawn(move || server(&mut s));
        let cr = client(&mut c);
        drop(c); // a client that gave up hangs up, as a real one would
        (h.join().unwrap(), cr)
    })
}

/// The client proof a process holding `key` would send (the formula of the module docs): lets a
/// test play a stranger with a wrong secret that sends a proof anyway.
fn proof_with(key: &[u8; 32], client_hello: &[u8], server_hello: &[u8]) -> [u8; 32] {
    use hmac::{Hmac, Mac};
    let mut m = <Hmac<sha2::Sha256> as Mac>::new_from_slice(key).unwrap();
    m.update(b"shardlab-auth-v1\0");
    m.update(b"C");
    m.update(client_hello);
    m.update(&server_hello[..CLIENT_HELLO_LEN]);
    m.finalize().into_bytes().into()
}

fn is_auth(r: &CommResult<Identity>) -> bool {
    matches!(r, Err(CommError::Auth(_)))
}

// ---------------------------------------------------------------------------------------------
// The handshake.

/// A slow verdict: the server takes its time between the client's proof and its verdict (here its
/// check sleeps 1.5 s; on a crowded machine, a descheduled listener). A dialler that gave up at
/// its 0.5 s handshake deadline would dial again and meet the connection the server accepted as a
/// duplicate; the mesh's dialler waits for the verdict as long as the rendezvous lasts.
#[test]
fn a_dialler_waits_for_a_slow_verdict_until_the_rendezvous_deadline() {
    let k = secret(7);
    let slow = |p: &Identity| {
        std::thread::sleep(Duration::from_millis(1500));
        expect_rank(p, 3, 4)
    };
    let server = |s: &mut TcpStream| server_handshake(s, &k, &Identity::new(JOB, 1, 4, CHANNEL_DATA), soon(5000), slow);
    let me = Identity::new(JOB, 3, 4, CHANNEL_DATA);
    let (srv, cli) =
        both(server, |c| client_handshake_with_verdict(c, &k, &me, soon(500), soon(5000), |p| expect_rank(p, 1, 4)));
    assert_eq!(srv.unwrap().rank(), 3);
    assert_eq!(cli.unwrap().rank(), 1, "the verdict came within the rendezvous deadline");
    // With one deadline for everything, the dialler gives up before the verdict.
    let (_, cli) = both(server, |c| client_handshake(c, &k, &me, soon(500), |p| expect_rank(p, 1, 4)));
    assert!(cli.is_err(), "{cli:?}");
}

#[test]
fn right_secret_passes_both_ways_with_proven_identities() {
    let k = secret(7);
    let (srv, cli) = both(
        |s| server_handshake(s, &k, &Identity::new(JOB, 1, 4, CHANNEL_DATA), soon(2000), |p| expect_rank(p, 3, 4)),
        |c| client_handshake(c, &k, &Identity::new(JOB, 3, 4, CHANNEL_DATA), soon(2000), |p| expect_rank(p, 1, 4)),
    );
    let (srv, cli) = (srv.unwrap(), cli.unwrap());
    assert_eq!((srv.rank(), srv.world_size(), srv.channel()), (3, 4, CHANNEL_DATA));
    assert_eq!((cli.rank(), cli.world_size(), cli.channel()), (1, 4, CHANNEL_DATA));
    // Over a Unix socket too (any HandshakeStream), and the stream is usable afterwards.
    let (mut a, mut b) = UnixStream::pair().unwrap();
    let me = Identity::new(JOB, 0, 2, CHANNEL_CONTROL);
    std::thread::scope(|sc| {
        let h = sc.spawn(|| {
            let p = server_handshake(&mut b, &k, &me, soon(2000), |_| Ok(())).unwrap();
            b.write_all(b"after").unwrap();
            p
        });
        client_handshake(&mut a, &k, &me, soon(2000), |_| Ok(())).unwrap();
        let mut buf = [0u8; 5];
        a.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"after");
        h.join().unwrap();
    });
}

#[test]
fn wrong_secret_fails_both_ways_with_a_clear_error() {
    let me = Identity::new(JOB, 0, 2, CHANNEL_DATA);
    // The client has the wrong secret, then the server does: both sides fail, and the side that
    // can tell (the one that checks a proof) says the secrets differ.
    for (ks, kc) in [(secret(1), secret(2)), (secret(2), secret(1))] {
        let t = Instant::now();
        let (srv, cli) = both(
            |s| server_handshake(s, &ks, &me, soon(3000), |_| Ok(())),
            |c| client_handshake(c, &kc, &me, soon(3000), |_| Ok(())),
        );
        assert!(is_auth(&srv), "server: {srv:?}");
        let e = cli.unwrap_err();
        assert!(matches!(e, CommError::Auth(_)) && e.to_string().contains("SHARDLAB_SECRET"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(2), "a wrong secret must fail at once, took {:?}", t.elapsed());
    }
    // A stranger that sends a proof made with its wrong secret anyway: the server says why.
    let (c, s) = (ClientHandshake::new(&secret(2), &me).unwrap(), ServerHandshake::new(&secret(1), &me));
    let mut s = s.unwrap();
    let sh = s.on_hello(c.hello()).unwrap();
    let e = s.on_proof(&proof_with(&[2; 32], c.hello(), &sh)).unwrap_err();
    assert!(matches!(e, CommError::Auth(_)) && e.to_string().contains("secret"), "{e}");
    // (The same forger with the right key gets in: `proof_with` is the real formula.)
    assert!(s.on_proof(&proof_with(&[1; 32], c.hello(), &sh)).is_ok());
    // Another job with the same secret is refused too, with its own message.
    let other = Identity::new("another-job", 0, 2, CHANNEL_DATA);
    let (srv, cli) = both(
        |s| server_handshake(s, &secret(1), &me, soon(3000), |_| Ok(())),
        |c| client_handshake(c, &secret(1), &other, soon(3000), |_| Ok(())),
    );
    assert!(is_auth(&srv), "{srv:?}");
    assert!(cli.unwrap_err().to_string().contains("another job"));
    // And another channel.
    let ctl = Identity::new(JOB, 0, 2, CHANNEL_CONTROL);
    let (srv, cli) = both(
        |s| server_handshake(s, &secret(1), &me, soon(3000), |_| Ok(())),
        |c| client_handshake(c, &secret(1), &ctl, soon(3000), |_| Ok(())),
    );
    assert!(is_auth(&srv) && matches!(cli, Err(CommError::Auth(_))), "{srv:?} {cli:?}");
}

#[test]
fn a_replayed_transcript_fails() {
    let k = secret(3);
    let me = Identity::new(JOB, 1, 2, CHANNEL_DATA);
    // A real session, recorded.
    let c1 = ClientHandshake::new(&k, &me).unwrap();
    let mut s1 = ServerHandshake::new(&k, &me).unwrap();
    let sh1 = s1.on_hello(c1.hello()).unwrap();
    let (_, proof1) = c1.on_server_hello(&sh1).unwrap();
    assert!(s1.on_proof(&proof1).is_ok());
    // Replaying the client's side to a new server: its nonce is new, the old proof is worthless.
    let mut s2 = ServerHandshake::new(&k, &me).unwrap();
    let sh2 = s2.on_hello(c1.hello()).unwrap();
    assert_ne!(sh1[48..80], sh2[48..80], "the server's nonce must be fresh");
    assert!(matches!(s2.on_proof(&proof1), Err(CommError::Auth(_))));
    // Replaying the server's side to a new client: likewise.
    let c2 = ClientHandshake::new(&k, &me).unwrap();
    assert!(matches!(c2.on_server_hello(&sh1), Err(CommError::Auth(_))));
    // Reflecting the server's own proof back as the client's proof fails (roles are signed).
    let proof_s: [u8; 32] = sh1[CLIENT_HELLO_LEN..].try_into().unwrap();
    assert!(s1.on_proof(&proof_s).is_err());
    // The same over a socket: the recorded bytes of the client, replayed verbatim.
    let (mut a, mut b) = tcp_pair();
    let mut rec = c1.hello().to_vec();
    rec.extend_from_slice(&proof1);
    std::thread::scope(|sc| {
        let h = sc.spawn(|| server_handshake(&mut b, &k, &me, soon(3000), |_| Ok(())));
        a.write_all(&rec).unwrap();
        let r = h.join().unwrap();
        assert!(is_auth(&r), "replay accepted: {r:?}");
    });
}

#[test]
fn a_peer_claiming_another_rank_fails() {
    let k = secret(4);
    // Dialling rank 1, but the listener is rank 2: the client refuses it.
    let (srv, cli) = both(
        |s| server_handshake(s, &k, &Identity::new(JOB, 2, 4, CHANNEL_DATA), soon(2000), |_| Ok(())),
        |c| client_handshake(c, &k, &Identity::new(JOB, 3, 4, CHANNEL_DATA), soon(2000), |p| expect_rank(p, 1, 4)),
    );
    assert!(srv.is_err());
    assert!(cli.unwrap_err().to_string().contains("expected rank 1 but the peer is rank 2"));
    // The listener expects rank 3 and a client claims rank 0: the server refuses, and says why.
    let (srv, cli) = both(
        |s| server_handshake(s, &k, &Identity::new(JOB, 1, 4, CHANNEL_DATA), soon(2000), |p| expect_rank(p, 3, 4)),
        |c| client_handshake(c, &k, &Identity::new(JOB, 0, 4, CHANNEL_DATA), soon(2000), |_| Ok(())),
    );
    let (se, ce) = (srv.unwrap_err(), cli.unwrap_err());
    assert!(!matches!(se, CommError::Auth(_)), "an authenticated peer's bad claim is not a stranger: {se}");
    assert!(ce.to_string().contains("refused") && ce.to_string().contains("expected rank 3"), "{ce}");
    // A different world size is a mismatch.
    let (_, cli) = both(
        |s| server_handshake(s, &k, &Identity::new(JOB, 1, 8, CHANNEL_DATA), soon(2000), |_| Ok(())),
        |c| client_handshake(c, &k, &Identity::new(JOB, 3, 4, CHANNEL_DATA), soon(2000), |p| expect_rank(p, 1, 4)),
    );
    assert!(matches!(cli, Err(CommError::Mismatch(_))), "{cli:?}");
    // Changing the claimed rank in flight breaks the proofs.
    let c = ClientHandshake::new(&k, &Identity::new(JOB, 3, 4, CHANNEL_DATA)).unwrap();
    let mut tampered: [u8; CLIENT_HELLO_LEN] = *c.hello();
    tampered[8] = 2; // rank 3 → rank 2
    let mut s = ServerHandshake::new(&k, &Identity::new(JOB, 1, 4, CHANNEL_DATA)).unwrap();
    let sh = s.on_hello(&tampered).unwrap();
    assert!(matches!(c.on_server_hello(&sh), Err(CommError::Auth(_))));
}

/// A stream that counts what the handshake read from it.
struct Counting(UnixStream, Arc<AtomicUsize>);
impl Read for Counting {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        let n = self.0.read(b)?;
        self.1.fetch_add(n, Ordering::SeqCst);
        Ok(n)
    }
}
impl Write for Counting {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.write(b)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
impl HandshakeStream for Counting {
    fn set_io_timeout(&mut self, t: Option<Duration>) -> std::io::Result<()> {
        self.0.set_io_timeout(t)
    }
}

#[test]
fn garbage_and_short_input_fail_within_the_deadline() {
    let k = secret(5);
    let me = Identity::new(JOB, 0, 2, CHANNEL_DATA);
    let garbage: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    let mut valid_prefix = ClientHandshake::new(&k, &me).unwrap().hello().to_vec();
    valid_prefix.truncate(40);
    let cases: Vec<(&str, Vec<u8>, bool)> = vec![
        ("silence", vec![], false),
        ("a few bytes, then silence", b"GET / HTTP/1.1\r\n".to_vec(), false),
        ("half a valid hello, then silence", valid_prefix, false),
        ("1 MiB of garbage", garbage.clone(), false),
        ("a hang-up", vec![], true),
    ];
    for (what, bytes, hang_up) in cases {
        let (mut peer, b) = UnixStream::pair().unwrap();
        let read = Arc::new(AtomicUsize::new(0));
        let mut srv = Counting(b, read.clone());
        let writer = std::thread::spawn(move || {
            let _ = peer.write_all(&bytes);
            if hang_up {
                drop(peer);
                return None;
            }
            Some(peer) // held open, silent
        });
        let t = Instant::now();
        let r = server_handshake(&mut srv, &k, &me, soon(400), |_| Ok(()));
        let took = t.elapsed();
        assert!(is_auth(&r), "{what}: {r:?}");
        assert!(took < Duration::from_millis(1500), "{what}: the server took {took:?} for a 400 ms deadline");
        assert!(
            read.load(Ordering::SeqCst) <= MAX_UNAUTHENTICATED_BYTES,
            "{what}: the server read {} bytes from a stranger",
            read.load(Ordering::SeqCst)
        );
        drop(srv);
        let _ = writer.join();
    }
    // The client side: a server that sends garbage, or nothing.
    for (what, bytes) in [("garbage", garbage[..4096].to_vec()), ("silence", vec![])] {
        let (mut a, mut peer) = UnixStream::pair().unwrap();
        let w = std::thread::spawn(move || {
            let _ = peer.write_all(&bytes);
            std::thread::sleep(Duration::from_millis(1500));
        });
        let t = Instant::now();
        let r = client_handshake(&mut a, &k, &me, soon(400), |_| Ok(()));
        assert!(r.is_err(), "{what}: {r:?}");
        assert!(t.elapsed() < Duration::from_millis(1200), "{what}: took {:?}", t.elapsed());
        if what == "garbage" {
            assert!(matches!(r, Err(CommError::Auth(_))), "{r:?}");
        } else {
            assert!(matches!(r, Err(CommError::Io(_))), "{r:?}");
        }
        drop(a);
        w.join().unwrap();
    }
}

#[test]
fn secret_is_redacted_parsed_and_carried() {
    let s = Secret::generate().unwrap();
    let hex = s.to_hex();
    assert_eq!(hex.len(), 64);
    assert_ne!(Secret::generate().unwrap().to_hex(), hex, "two generated secrets must differ");
    let cfg = CommConfig { secret: Some(s), ..CommConfig::default() };
    let dbg = format!("{cfg:?}");
    assert!(!dbg.contains(&hex) && dbg.contains("redacted"), "Debug shows the secret: {dbg}");
    // A serialised config (logged, or passed to child processes as JSON) leaves it out: spawn
    // hands it to its children in SHARDLAB_SECRET.
    let json = serde_json::to_string(&cfg).unwrap();
    assert!(!json.contains(&hex) && !json.contains("\"secret\""), "the secret leaks into JSON: {json}");
    assert!(serde_json::from_str::<CommConfig>(&json).unwrap().secret.is_none());
    // A secret in JSON is still read (as hex).
    let mut v = serde_json::to_value(&cfg).unwrap();
    v.as_object_mut().unwrap().insert("secret".into(), serde_json::Value::String(hex.clone()));
    assert_eq!(serde_json::from_value::<CommConfig>(v).unwrap().secret.unwrap().to_hex(), hex);
    assert_eq!(Secret::from_hex(&format!("  {}\n", hex.to_uppercase())).unwrap().to_hex(), hex);
    for bad in ["", "abc", &hex[..63], &format!("{}zz", &hex[..62])] {
        let e = Secret::from_hex(bad).unwrap_err();
        assert!(e.to_string().contains("64 hex digits"), "{e}");
    }
    assert_eq!(Secret::derived_from_job_id("a").to_hex(), Secret::derived_from_job_id("a").to_hex());
    assert_ne!(Secret::derived_from_job_id("a").to_hex(), Secret::derived_from_job_id("b").to_hex());
}

#[test]
fn a_network_store_without_a_secret_is_refused() {
    if std::env::var_os(auth::SECRET_ENV).is_some() {
        return; // the refusal is for jobs without SHARDLAB_SECRET
    }
    let init = |rank, master: &str| TcpInit {
        rank,
        world_size: 2,
        master_addr: master.into(),
        master_port: 1,
        local_rank: rank,
        local_world_size: 2,
    };
    let cfg = CommConfig { store_bind: "0.0.0.0".into(), secret: None, ..CommConfig::default() };
    let e = ProcessGroup::init_tcp(&init(0, "127.0.0.1"), cfg).err().unwrap();
    assert!(e.to_string().contains("SHARDLAB_SECRET is not set") && e.to_string().contains("0.0.0.0"), "{e}");
    let cfg = CommConfig { secret: None, ..CommConfig::default() };
    let e = ProcessGroup::init_tcp(&init(1, "192.0.2.1"), cfg).err().unwrap();
    assert!(e.to_string().contains("SHARDLAB_SECRET is not set") && e.to_string().contains("192.0.2.1"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// The store.

fn store_threads() -> usize {
    let Ok(d) = std::fs::read_dir("/proc/self/task") else { return 0 };
    d.filter_map(|e| e.ok())
        .filter(|e| std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim() == "shardlab-store"))
        .count()
}

/// Connect, retrying while the port is not open yet (until `stop` or `until`).
fn reach(addr: SocketAddr, until: Instant, stop: &AtomicBool) -> Option<TcpStream> {
    while Instant::now() < until && !stop.load(Ordering::SeqCst) {
        if let Ok(s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}

/// Read until the peer closes or `limit` passes; what came.
fn drain(s: &mut TcpStream, limit: Duration) -> (usize, bool) {
    let until = Instant::now() + limit;
    let mut total = 0;
    let mut buf = [0u8; 512];
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return (total, false);
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return (total, true),
            Ok(n) => total += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => {
                return (total, false)
            }
            Err(_) => return (total, true), // reset: closed too
        }
    }
}

/// The strangers: each kind of attack against `addr`, repeated until `stop`. Returns what they
/// observed (any assertion failure panics the attacker thread, which the test reports).
fn attackers<'s>(
    sc: &'s std::thread::Scope<'s, '_>,
    addr: SocketAddr,
    job: &'s str,
    stop: &'s AtomicBool,
    until: Instant,
) -> Vec<std::thread::ScopedJoinHandle<'s, &'static str>> {
    let mut hs = Vec::new();
    // One connects and stays silent (and reconnects when dropped).
    hs.push(sc.spawn(move || {
        while !stop.load(Ordering::SeqCst) {
            let Some(mut s) = reach(addr, until, stop) else { break };
            let (n, _) = drain(&mut s, Duration::from_millis(300));
            assert_eq!(n, 0, "the store talked to a silent stranger");
        }
        "silent"
    }));
    // One sends garbage; the store must close on it without answering.
    hs.push(sc.spawn(move || {
        let garbage: Vec<u8> = (0..65536u32).map(|i| (i.wrapping_mul(2654435761) >> 11) as u8).collect();
        let mut absurd = vec![0x52, 0x4f, 0x54, 0x53, 2, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f];
        absurd.resize(CLIENT_HELLO_LEN, 0);
        let mut i = 0;
        while !stop.load(Ordering::SeqCst) {
            let Some(mut s) = reach(addr, until, stop) else { break };
            let _ = s.write_all(if i % 2 == 0 { &garbage } else { &absurd });
            let (n, closed) = drain(&mut s, Duration::from_secs(8));
            assert_eq!(n, 0, "the store answered garbage");
            assert!(closed, "the store kept a garbage connection open");
            i += 1;
        }
        "garbage"
    }));
    // One says a valid-looking hello but has the wrong secret (and sends a proof anyway).
    hs.push(sc.spawn(move || {
        let me = Identity::store(job);
        while !stop.load(Ordering::SeqCst) {
            let Some(mut s) = reach(addr, until, stop) else { break };
            let c = ClientHandshake::new(&secret(0xee), &me).unwrap();
            let _ = s.write_all(c.hello());
            let mut sh = [0u8; SERVER_HELLO_LEN];
            s.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
            if s.read_exact(&mut sh).is_err() {
                continue; // evicted or closed: fine
            }
            assert!(matches!(c.on_server_hello(&sh), Err(CommError::Auth(_))), "a wrong secret verified");
            let _ = s.write_all(&proof_with(&[0xee; 32], c.hello(), &sh));
            let (n, closed) = drain(&mut s, Duration::from_secs(8));
            assert!(n == 0 && closed, "the store answered a wrong proof with {n} bytes (closed: {closed})");
            // And through the library: a clear authentication error, at once.
            let t = Instant::now();
            match StoreClient::connect(&addr.to_string(), job, &secret(0xee), Duration::from_secs(5)) {
                Err(CommError::Auth(m)) => assert!(m.contains("SHARDLAB_SECRET"), "{m}"),
                Err(e) if e.to_string().contains("could not reach") => break, // the store closed meanwhile
                Err(e) => panic!("wrong secret: unexpected error {e}"),
                Ok(_) => panic!("the store accepted a wrong secret"),
            }
            assert!(t.elapsed() < Duration::from_secs(5));
        }
        "wrong secret"
    }));
    // One opens 200 connections at once and holds them (some say hello first), again and again.
    hs.push(sc.spawn(move || {
        let me = Identity::store(job);
        let hello = *ClientHandshake::new(&secret(0xdd), &me).unwrap().hello();
        while !stop.load(Ordering::SeqCst) {
            let mut held = Vec::new();
            for i in 0..200 {
                let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else { continue };
                if i % 3 == 0 {
                    let _ = s.write_all(&hello);
                }
                held.push(s);
            }
            if held.is_empty() && Instant::now() >= until {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        "flood"
    }));
    hs
}

/// Samples the process's store threads until `stop`; the most seen.
fn thread_monitor<'s>(
    sc: &'s std::thread::Scope<'s, '_>,
    stop: &'s AtomicBool,
) -> std::thread::ScopedJoinHandle<'s, usize> {
    sc.spawn(move || {
        let mut most = 0;
        while !stop.load(Ordering::SeqCst) {
            most = most.max(store_threads());
            std::thread::sleep(Duration::from_millis(5));
        }
        most
    })
}

/// Sets the flag when dropped — also when a test panics, so that the scope's threads end.
struct StopOnDrop<'a>(&'a AtomicBool);
impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

fn f32s(n: i64) -> Tensor {
    Tensor::ones([n], (Kind::Float, Device::Cpu))
}

/// The job of the attack tests: a few all_reduces.
fn work(pg: &ProcessGroup) -> CommResult<f64> {
    let mut sum = 0.0;
    for i in 0..5 {
        let mut t = f32s(1000 + 1000 * i) * (pg.rank() as f64 + 1.0);
        pg.all_reduce(&mut t, ReduceOp::Sum)?;
        sum += t.double_value(&[0]);
    }
    Ok(sum)
}

fn job_cfg() -> CommConfig {
    CommConfig {
        secret: Some(Secret::generate().unwrap()),
        rendezvous_timeout: Duration::from_secs(15),
        ..CommConfig::default()
    }
    .with_timeout(Duration::from_secs(20))
}

/// What rank 0 reports about its store once the group is up.
type StoreReport = (bool, usize, usize, usize, u64, u64, bool);

fn store_report(port: u16) -> StoreReport {
    let st = store::debug_stats(port).expect("rank 0 hosts the store in this process");
    let refused = TcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], port)), Duration::from_millis(500))
        .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused);
    (
        st.serving,
        st.peak_unauthenticated,
        st.peak_unauthenticated_per_ip,
        st.peak_authenticated,
        st.authenticated_total,
        st.dropped,
        refused,
    )
}

fn check_report(r: &StoreReport, ranks: u64) {
    eprintln!("store after the group formed (serving, peak unauth, peak unauth per ip, peak auth, authenticated, dropped, port closed): {r:?}");
    let (serving, peak_unauth, peak_ip, peak_auth, auth_total, dropped, refused) = *r;
    assert!(!serving, "the store still serves after the group is up");
    assert!(refused, "the store port still accepts connections after the group is up");
    assert!(peak_unauth <= store::MAX_UNAUTHENTICATED, "{peak_unauth} unauthenticated connections at once");
    assert!(peak_ip <= store::MAX_UNAUTHENTICATED_PER_IP, "{peak_ip} unauthenticated connections from one address");
    assert!(peak_auth as u64 <= auth_total && auth_total <= ranks + 2, "{auth_total} connections authenticated");
    assert!(dropped > 0, "no stranger was dropped: did the attack run?");
}

#[test]
fn strangers_on_the_store_port_do_not_stop_a_spawned_job() {
    let _g = serial();
    let port = shardlab::launch::free_port().unwrap();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let stop = AtomicBool::new(false);
    let cfg = job_cfg();
    let job = cfg.job_id.clone();
    let t = Instant::now();
    let (out, most_threads, names, took) = std::thread::scope(|sc| {
        // A failing assertion must not leave the strangers running.
        let _stop = StopOnDrop(&stop);
        let hs = attackers(sc, addr, &job, &stop, Instant::now() + Duration::from_secs(30));
        let mon = thread_monitor(sc, &stop);
        std::thread::sleep(Duration::from_millis(100)); // the attackers are knocking before the job starts
        let opts = SpawnOptions::new(4, Backend::Tcp).launch(Launch::Threads).master_port(port).config(cfg.clone());
        let t = Instant::now();
        let out = spawn_with(opts, |pg| {
            let report = if pg.rank() == 0 { Some(store_report(port)) } else { None };
            Ok((work(pg)?, report))
        });
        let took = t.elapsed();
        eprintln!("the spawned job took {took:?} under attack");
        stop.store(true, Ordering::SeqCst);
        let names: Vec<&str> = hs.into_iter().map(|h| h.join().expect("an attacker saw the store misbehave")).collect();
        (out, mon.join().unwrap(), names, took)
    });
    let out = out.unwrap_or_else(|e| panic!("the job failed under attack: {e}"));
    let want: f64 = (0..5).map(|_| 1.0 + 2.0 + 3.0 + 4.0).sum();
    assert!(out.iter().all(|o| o.0 == want), "{out:?}");
    check_report(out[0].1.as_ref().unwrap(), 4);
    assert!(most_threads <= 1, "{most_threads} store threads at once");
    assert_eq!(names.len(), 4);
    assert!(took < Duration::from_secs(10), "the job took {took:?} under attack");
    assert!(t.elapsed() < Duration::from_secs(30), "the strangers did not stop: {:?}", t.elapsed());
}

#[test]
fn strangers_already_inside_when_the_ranks_arrive() {
    // Staged by hand so the attack is surely in place before ranks 1..3 rendezvous: rank 0 hosts
    // the store and waits; the strangers move in; then the other ranks come.
    let _g = serial();
    let port = shardlab::launch::free_port().unwrap();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let cfg = &job_cfg();
    let job = cfg.job_id.clone();
    let init = |rank| TcpInit::loopback(rank, 4, port);
    let stop = AtomicBool::new(false);
    let t0 = Instant::now();
    let (results, report, most_threads) = std::thread::scope(|sc| {
        // A failing assertion must not leave the strangers running.
        let _stop = StopOnDrop(&stop);
        let rank0 = sc.spawn(|| ProcessGroup::init_tcp(&init(0), cfg.clone()));
        let until = Instant::now() + Duration::from_secs(10);
        while store::debug_stats(port).is_none_or(|s| !s.serving) {
            assert!(Instant::now() < until, "rank 0's store did not come up");
            std::thread::sleep(Duration::from_millis(5));
        }
        let hs = attackers(sc, addr, &job, &stop, Instant::now() + Duration::from_secs(30));
        let mon = thread_monitor(sc, &stop);
        // Let the strangers fill the store's unauthenticated slots.
        let until = Instant::now() + Duration::from_secs(5);
        while store::debug_stats(port).is_some_and(|s| s.unauthenticated < store::MAX_UNAUTHENTICATED_PER_IP)
            && Instant::now() < until
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        let others: Vec<_> = (1..4).map(|r| sc.spawn(move || ProcessGroup::init_tcp(&init(r), cfg.clone()))).collect();
        let mut pgs = vec![rank0.join().unwrap()];
        pgs.extend(others.into_iter().map(|h| h.join().unwrap()));
        let formed = t.elapsed();
        eprintln!("the group formed {formed:?} after ranks 1..3 started");
        let pgs: Vec<ProcessGroup> =
            pgs.into_iter().enumerate().map(|(r, p)| p.unwrap_or_else(|e| panic!("rank {r}: {e}"))).collect();
        assert!(formed < Duration::from_secs(10), "the group took {formed:?} to form under attack");
        let report = store_report(port);
        let results: Vec<CommResult<f64>> = std::thread::scope(|s2| {
            let hs: Vec<_> =
                pgs.iter().map(|pg| s2.spawn(move || work(pg).and_then(|v| pg.finish().map(|_| v)))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        stop.store(true, Ordering::SeqCst);
        for h in hs {
            h.join().expect("an attacker saw the store misbehave");
        }
        (results, report, mon.join().unwrap())
    });
    for (r, res) in results.iter().enumerate() {
        assert!(res.is_ok(), "rank {r}: {res:?}");
    }
    check_report(&report, 4);
    assert!(most_threads <= 1, "{most_threads} store threads at once");
    assert!(t0.elapsed() < Duration::from_secs(40));
}

/// A client that authenticated by hand, to speak raw requests after the handshake.
fn raw_authenticated(addr: &str, job: &str, k: &Secret) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    client_handshake(&mut s, k, &Identity::store(job), soon(3000), |_| Ok(())).unwrap();
    s
}

#[test]
fn store_quotas_and_bad_requests_after_authentication() {
    let _g = serial();
    let k = secret(9);
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), JOB, &k).unwrap();
    let addr = server.addr().to_string();
    let mut c = StoreClient::connect(&addr, JOB, &k, Duration::from_secs(5)).unwrap();
    // Key and value limits: refused before anything is sent.
    let e = c.set(&"k".repeat(store::MAX_KEY + 1), b"v").unwrap_err();
    assert!(matches!(e, CommError::InvalidArgument(_)) && e.to_string().contains("key"), "{e}");
    let e = c.set("k", &vec![0u8; store::MAX_VALUE + 1]).unwrap_err();
    assert!(matches!(e, CommError::InvalidArgument(_)) && e.to_string().contains("value"), "{e}");
    // Total bytes.
    let big = vec![1u8; store::MAX_VALUE];
    let mut i = 0;
    let e = loop {
        match c.set(&format!("big/{i}"), &big) {
            Ok(()) => i += 1,
            Err(e) => break e,
        }
        assert!(i <= store::MAX_TOTAL_BYTES / store::MAX_VALUE, "the byte quota was not enforced");
    };
    assert!(e.to_string().contains("quota") && e.to_string().contains("bytes"), "{e}");
    assert!(server.stats().bytes <= store::MAX_TOTAL_BYTES);
    // The connection still works after a refusal; overwriting within the quota is fine.
    c.set("big/0", b"small").unwrap();
    assert_eq!(c.get("big/0", Duration::ZERO).unwrap().as_deref(), Some(&b"small"[..]));
    // Key count.
    for j in 0..=store::MAX_KEYS {
        if let Err(e) = c.set(&format!("n/{j}"), b"") {
            assert!(e.to_string().contains("quota") && e.to_string().contains("keys"), "{e}");
            break;
        }
        assert!(j < store::MAX_KEYS, "the key quota was not enforced");
    }
    assert!(server.stats().keys <= store::MAX_KEYS);
    let e = c.add("a-new-counter", 1).unwrap_err();
    assert!(e.to_string().contains("quota"), "{e}");
    // Raw requests with absurd lengths after authentication: a refusal, a hang-up, no allocation.
    for (what, head) in [
        ("huge value", [0x52, 0x4f, 0x54, 0x53, 2, 1, 0, 0xff, 0xff, 0xff, 0x7f]),
        ("huge key", [0x52, 0x4f, 0x54, 0x53, 2, 0xff, 0xff, 1, 0, 0, 0]),
        ("wrong magic", [0, 0, 0, 0, 2, 1, 0, 1, 0, 0, 0]),
        ("unknown command", [0x52, 0x4f, 0x54, 0x53, 9, 1, 0, 1, 0, 0, 0]),
    ] {
        let mut s = raw_authenticated(&addr, JOB, &k);
        s.write_all(&head).unwrap();
        let mut reply = Vec::new();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.read_to_end(&mut reply).unwrap();
        assert_eq!(reply.first(), Some(&2), "{what}: {reply:?}");
        assert!(reply.len() < 200, "{what}");
    }
    // A GET for a key that never comes returns None after its wait.
    let t = Instant::now();
    assert_eq!(c.get("never", Duration::from_millis(200)).unwrap(), None);
    assert!(t.elapsed() >= Duration::from_millis(200) && t.elapsed() < Duration::from_secs(2));
    // close() stops serving at once; the port is closed.
    let t = Instant::now();
    server.close();
    assert!(t.elapsed() < Duration::from_secs(1));
    assert!(!server.stats().serving);
    assert!(TcpStream::connect_timeout(&server.addr(), Duration::from_millis(500)).is_err());
    let e = c.set("after", b"close");
    assert!(e.is_err(), "a closed store still answered");
}

#[test]
fn store_get_waits_and_serves_many_clients_on_one_thread() {
    let _g = serial();
    let k = secret(10);
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), JOB, &k).unwrap();
    let addr = server.addr().to_string();
    let n = 40;
    let got: Vec<Vec<u8>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..n)
            .map(|i| {
                let (addr, k) = (addr.clone(), k.clone());
                sc.spawn(move || {
                    let mut c = StoreClient::connect(&addr, JOB, &k, Duration::from_secs(5)).unwrap();
                    c.set(&format!("k/{i}"), format!("v{i}").as_bytes()).unwrap();
                    c.add("count", 1).unwrap();
                    c.get(&format!("k/{}", (i + 1) % n), Duration::from_secs(10)).unwrap().unwrap()
                })
            })
            .collect();
        let most = (0..20).map(|_| {
            std::thread::sleep(Duration::from_millis(5));
            store_threads()
        });
        assert!(most.max().unwrap() <= 1);
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, v) in got.iter().enumerate() {
        assert_eq!(v, format!("v{}", (i + 1) % n).as_bytes());
    }
    let mut c = StoreClient::connect(&addr, JOB, &k, Duration::from_secs(5)).unwrap();
    assert_eq!(c.add("count", 0).unwrap(), n as i64);
    // (The stats are a snapshot taken at the end of each turn of the store's loop: wait for it.)
    let until = Instant::now() + Duration::from_secs(2);
    while server.stats().authenticated_total != n as u64 + 1 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    let st = server.stats();
    assert!(st.peak_authenticated <= n + 1 && st.authenticated_total == n as u64 + 1, "{st:?}");
    // A client that hangs up in the middle of a long GET frees its connection at once.
    let wait_for = |want: usize| {
        let until = Instant::now() + Duration::from_secs(2);
        while server.stats().authenticated != want && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        server.stats().authenticated
    };
    let before = wait_for(1);
    let mut s = raw_authenticated(&addr, JOB, &k);
    let mut get = vec![0x52, 0x4f, 0x54, 0x53, 3, 4, 0, 8, 0, 0, 0];
    get.extend_from_slice(b"nope");
    get.extend_from_slice(&60_000u64.to_le_bytes());
    s.write_all(&get).unwrap();
    assert_eq!(wait_for(before + 1), before + 1);
    drop(s);
    assert_eq!(wait_for(before), before, "an abandoned GET kept its connection");
}

// ---------------------------------------------------------------------------------------------
// The ranks' own listeners (the mesh in comm::tcp).

#[test]
fn strangers_on_the_rank_listeners_do_not_stop_the_job() {
    let _g = serial();
    let port = shardlab::launch::free_port().unwrap();
    // Generous deadlines: the attackers below keep both cores busy, and a loaded CI machine must not
    // turn a slow-but-working rendezvous into a failure. A listener that strangers block would
    // still fail it (the ranks would wait for rank 3's data path until the deadline).
    let cfg = &CommConfig { rendezvous_timeout: Duration::from_secs(60), ..job_cfg() };
    let k = cfg.secret.clone().unwrap();
    let job = cfg.job_id.clone();
    let init = |rank| TcpInit::loopback(rank, 4, port);
    let stop = AtomicBool::new(false);
    let results = std::thread::scope(|sc| {
        // A failing assertion must not leave the strangers running.
        let _stop = StopOnDrop(&stop);
        // Ranks 0..2 come and wait in their rendezvous for rank 3; their listeners are open.
        let early: Vec<_> = (0..3).map(|r| sc.spawn(move || ProcessGroup::init_tcp(&init(r), cfg.clone()))).collect();
        let mut store = StoreClient::connect(&format!("127.0.0.1:{port}"), &job, &k, Duration::from_secs(10)).unwrap();
        // Each rank publishes "ip data_port control_port": attack both listeners.
        let listeners: Vec<SocketAddr> = (0..3)
            .flat_map(|r| {
                let a = store.get(&format!("addr/{r}"), Duration::from_secs(10)).unwrap().expect("published");
                let a = String::from_utf8(a).unwrap();
                let f: Vec<&str> = a.split(' ').collect();
                let ip: std::net::IpAddr = f[0].parse().unwrap();
                [f[1], f[2]].map(|p| SocketAddr::new(ip, p.parse().unwrap()))
            })
            .collect();
        drop(store);
        // Every kind of stranger on every listener.
        let mut hs = Vec::new();
        for (i, &a) in listeners.iter().enumerate() {
            let (stop, job) = (&stop, job.as_str());
            let flood = if i < 2 { 200 } else { 50 };
            hs.push(sc.spawn(move || {
                let (mut held, mut stallers) = (Vec::new(), Vec::new());
                while !stop.load(Ordering::SeqCst) {
                    // Silent.
                    if let Ok(s) = TcpStream::connect_timeout(&a, Duration::from_millis(200)) {
                        held.push(s);
                    }
                    // Garbage.
                    if let Ok(mut s) = TcpStream::connect_timeout(&a, Duration::from_millis(200)) {
                        let _ = s.write_all(&[0xab; 4096]);
                        let _ = s.shutdown(Shutdown::Write);
                    }
                    // A wrong secret: the listener must answer with a proof we cannot verify.
                    if let Ok(mut s) = TcpStream::connect_timeout(&a, Duration::from_millis(200)) {
                        let me = Identity::new(job, 3, 4, CHANNEL_DATA);
                        let r = client_handshake(&mut s, &secret(0xee), &me, soon(3000), |_| Ok(()));
                        // Auth once the listener answers with its proof; Io if a busy listener dropped us.
                        assert!(r.is_err(), "a rank accepted a wrong secret");
                    }
                    // Well-formed hellos (no secret needed to write one), then nothing: strangers
                    // that stall where a rank would send its proof. Always 20 of them, more than
                    // the listener's per-address cap, each replaced before the listener's own
                    // handshake deadline (5 s) would close it.
                    stallers.retain(|(at, _): &(Instant, TcpStream)| at.elapsed() < Duration::from_secs(4));
                    while stallers.len() < 20 {
                        let Ok(mut s) = TcpStream::connect_timeout(&a, Duration::from_millis(200)) else { break };
                        let me = Identity::new(job, 3, 4, CHANNEL_DATA);
                        let _ = s.write_all(ClientHandshake::new(&secret(0xee), &me).unwrap().hello());
                        stallers.push((Instant::now(), s));
                    }
                    // A flood, held open (bounded, so this process keeps file descriptors for the ranks).
                    if held.len() > flood {
                        held.clear();
                    }
                    for _ in 0..flood {
                        if let Ok(s) = TcpStream::connect_timeout(&a, Duration::from_millis(200)) {
                            held.push(s);
                        }
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }));
        }
        std::thread::sleep(Duration::from_millis(500));
        let t = Instant::now();
        let last = sc.spawn(move || ProcessGroup::init_tcp(&init(3), cfg.clone()));
        let mut pgs: Vec<_> = early.into_iter().map(|h| h.join().unwrap()).collect();
        pgs.push(last.join().unwrap());
        let pgs: Vec<ProcessGroup> =
            pgs.into_iter().enumerate().map(|(r, p)| p.unwrap_or_else(|e| panic!("rank {r}: {e}"))).collect();
        assert!(t.elapsed() < Duration::from_secs(45), "the mesh took {:?} to form under attack", t.elapsed());
        let results: Vec<CommResult<f64>> = std::thread::scope(|s2| {
            let hs: Vec<_> =
                pgs.iter().map(|pg| s2.spawn(move || work(pg).and_then(|v| pg.finish().map(|_| v)))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        stop.store(true, Ordering::SeqCst);
        for h in hs {
            h.join().expect("an attacker saw a rank misbehave");
        }
        results
    });
    for (r, res) in results.iter().enumerate() {
        assert!(res.is_ok(), "rank {r}: {res:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Ranks started by another launcher (torchrun style), with and without SHARDLAB_SECRET.

/// Run two ranks of `env_child` as processes with `env`; their exit status, stdout and stderr.
fn torchrun_pair(env: [&[(&str, &str)]; 2]) -> Vec<(bool, String, String)> {
    let port = shardlab::launch::free_port().unwrap().to_string();
    let exe = std::env::current_exe().unwrap();
    let child = |rank: usize| {
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(["--exact", "env_child", "--ignored", "--nocapture", "--test-threads=1"])
            .env_remove(auth::SECRET_ENV)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env("SHARDLAB_JOB_ID", "auth-env-test")
            .env("SHARDLAB_RDZV_TIMEOUT_S", "4")
            .env("SHARDLAB_AUTH_TEST_CHILD", "1");
        for (k, v) in env[rank] {
            cmd.env(k, v);
        }
        let o = cmd.output().unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    std::thread::scope(|s| {
        let a = s.spawn(|| child(0));
        let b = s.spawn(|| child(1));
        vec![a.join().unwrap(), b.join().unwrap()]
    })
}

#[test]
fn torchrun_style_ranks_with_and_without_a_secret() {
    let warning = "SHARDLAB_SECRET is not set";
    // Without SHARDLAB_SECRET on loopback: it works, and each rank warns once.
    let out = torchrun_pair([&[], &[]]);
    for (r, (ok, stdout, stderr)) in out.iter().enumerate() {
        assert!(*ok && stdout.contains(&format!("env-rank {r} sum 3")), "rank {r}: {stdout}\n{stderr}");
        assert_eq!(stderr.matches(warning).count(), 1, "rank {r} must warn exactly once: {stderr}");
    }
    // With the same secret: it works, silently.
    let k = Secret::generate().unwrap().to_hex();
    let same: &[(&str, &str)] = &[("SHARDLAB_SECRET", &k)];
    let out = torchrun_pair([same, same]);
    for (r, (ok, stdout, stderr)) in out.iter().enumerate() {
        assert!(*ok && stdout.contains(&format!("env-rank {r} sum 3")), "rank {r}: {stdout}\n{stderr}");
        assert!(!stderr.contains(warning), "rank {r}: {stderr}");
    }
    // With different secrets: both fail; rank 1 says the secrets differ, at once.
    let other = Secret::generate().unwrap().to_hex();
    let out = torchrun_pair([same, &[("SHARDLAB_SECRET", &other)]]);
    assert!(!out[0].0 && !out[1].0, "{out:?}");
    assert!(out[1].2.contains("authentication failed") && out[1].2.contains("SHARDLAB_SECRET"), "{}", out[1].2);
    // A malformed secret is an error, not a silent fallback.
    let out = torchrun_pair([&[("SHARDLAB_SECRET", "not-hex")], same]);
    assert!(!out[0].0 && out[0].2.contains("64 hex digits"), "{}", out[0].2);
}

#[test]
#[ignore = "child process of torchrun_style_ranks_with_and_without_a_secret"]
fn env_child() {
    if std::env::var("SHARDLAB_AUTH_TEST_CHILD").is_err() {
        return;
    }
    let pg = ProcessGroup::from_env(CommConfig::default().with_timeout(Duration::from_secs(10)))
        .unwrap_or_else(|e| panic!("rank {}: {e}", std::env::var("RANK").unwrap_or_default()));
    let mut t = Tensor::from_slice(&[pg.rank() as f32 + 1.0]);
    pg.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    pg.finish().unwrap();
    println!("env-rank {} sum {}", pg.rank(), t.double_value(&[0]));
}
