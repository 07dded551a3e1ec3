//! The handshake's commit hook (see `server_handshake_observed`).

use super::*;
use crate::comm::auth::{Identity, CHANNEL_DATA};
use std::os::unix::net::UnixStream;

/// A connection the listener cut after the peer proved itself but before the verdict: the
/// peer is not told it is in (it gets an I/O error and dials again), where before it got
/// `Ok` on a connection the listener had dropped.
#[test]
fn a_connection_cut_before_its_verdict_is_not_accepted() {
    let k = Secret::from_hex(&"ab".repeat(32)).unwrap();
    let soon = || Instant::now() + std::time::Duration::from_secs(2);
    for keep in [true, false] {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let (srv, cli) = std::thread::scope(|sc| {
            let h = sc.spawn(|| {
                let me = Identity::new("job", 0, 2, CHANNEL_DATA);
                let r = server_handshake_observed(&mut b, &k, &me, soon(), || {}, || keep, |_| Ok(()));
                drop(b); // what the listener does with a connection it cut
                r
            });
            let me = Identity::new("job", 1, 2, CHANNEL_DATA);
            let cli = client_handshake(&mut a, &k, &me, soon(), |_| Ok(()));
            (h.join().unwrap(), cli)
        });
        assert_eq!(srv.is_ok(), keep, "{srv:?}");
        match cli {
            Ok(_) => assert!(keep, "the peer was told it is in on a connection the listener cut"),
            Err(CommError::Io(_)) => assert!(!keep, "a kept connection failed"),
            Err(e) => panic!("the dialler must see an I/O error and redial: {e}"),
        }
    }
}
