//! Waiting for an enqueued NCCL operation: the state machine of `Work::wait`, apart from CUDA so
//! that it runs (and is tested) on machines without a GPU.
//!
//! A wait polls the operation's completion event, the communicator's asynchronous error and the
//! group's deadline. Two rules keep it from returning `Ok` on data that did not arrive:
//!
//! * **Poison first.** A failure poisons the group *before* it aborts the communicator. An
//!   aborted kernel's event completes too, on half-reduced data; another thread waiting on
//!   another operation sees the poison by the time it sees that completion.
//! * **Re-check after completion.** A completed event counts only if the group is not poisoned.
//!   (An operation that finished just before an unrelated failure is reported failed too: the
//!   group is unusable either way.)

use crate::comm::error::{CommError, CommResult};
use crate::comm::relock;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What the completion event says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Polled {
    Done,
    Pending,
    /// A CUDA error code.
    Failed(i32),
}

/// An operation to wait for: its completion, its communicator's error, and how to stop it.
pub(super) trait Completion {
    fn query(&self) -> Polled;
    /// The communicator's asynchronous error (`None`: healthy); `Err` when it is gone (aborted).
    fn async_error(&self) -> Result<Option<String>, ()>;
    /// Abort the communicator (after the group is poisoned).
    fn abort(&self);
}

/// Poison the group with `e` (the first error wins), *then* abort the communicator; the group's
/// error.
pub(super) fn fail(c: &dyn Completion, poison: &Mutex<Option<CommError>>, e: CommError) -> CommError {
    let e = relock(poison).get_or_insert(e).clone();
    c.abort();
    e
}

/// Poll `c` until it completes (`Ok` only if the group is not poisoned then), fails, or runs past
/// `deadline` (then poison and abort). `what` names the operation in errors.
pub(super) fn wait_for(
    c: &dyn Completion,
    poison: &Mutex<Option<CommError>>,
    deadline: Instant,
    timeout: Duration,
    what: &str,
) -> CommResult<()> {
    let poisoned = || relock(poison).clone();
    let mut spins = 0u32;
    loop {
        if let Some(e) = poisoned() {
            return Err(e);
        }
        match c.query() {
            Polled::Done => return poisoned().map_or(Ok(()), Err),
            Polled::Pending => {}
            Polled::Failed(code) => {
                return Err(fail(c, poison, CommError::Io(format!("{what}: CUDA error {code} while waiting"))))
            }
        }
        match c.async_error() {
            Ok(None) => {}
            Ok(Some(msg)) => {
                return Err(fail(c, poison, CommError::Io(format!("{what}: NCCL reported {msg} (a peer failed?)"))))
            }
            Err(()) => {
                let e = CommError::Io(format!("{what}: the NCCL communicator was aborted"));
                return Err(relock(poison).get_or_insert(e).clone());
            }
        }
        if Instant::now() > deadline {
            return Err(fail(
                c,
                poison,
                CommError::Io(format!(
                    "{what}: not finished within the group's timeout ({timeout:?}); NCCL communicator aborted (a rank \
                     died, or the ranks called different collectives?)"
                )),
            ));
        }
        // Spin briefly (most operations finish within microseconds of their kernel), then sleep.
        spins += 1;
        if spins < 200 {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// A kernel that never finishes on its own; aborting the communicator completes its event
    /// (as CUDA does for an aborted NCCL kernel). Records whether the group was poisoned when
    /// the abort came.
    struct Hung {
        aborted: AtomicBool,
        poisoned_at_abort: AtomicBool,
        poison: Arc<Mutex<Option<CommError>>>,
    }

    impl Completion for Hung {
        fn query(&self) -> Polled {
            if self.aborted.load(Ordering::SeqCst) {
                Polled::Done
            } else {
                Polled::Pending
            }
        }
        fn async_error(&self) -> Result<Option<String>, ()> {
            Ok(None)
        }
        fn abort(&self) {
            self.poisoned_at_abort.store(relock(&self.poison).is_some(), Ordering::SeqCst);
            self.aborted.store(true, Ordering::SeqCst);
        }
    }

    fn hung() -> Arc<Hung> {
        let poison = Arc::new(Mutex::new(None));
        Arc::new(Hung { aborted: AtomicBool::new(false), poisoned_at_abort: AtomicBool::new(false), poison })
    }

    /// One thread waits with a long deadline while another's wait times out and aborts: the
    /// first must see the abort's completed event as the failure it is, never as `Ok`; and the
    /// group was poisoned before the communicator was aborted.
    #[test]
    fn a_wait_never_takes_an_aborted_kernel_for_a_finished_one() {
        for _ in 0..50 {
            let h = hung();
            let long = Instant::now() + Duration::from_secs(30);
            let waiter = {
                let h = h.clone();
                std::thread::spawn(move || wait_for(&*h, &h.poison, long, Duration::from_secs(30), "all_reduce"))
            };
            let short = Instant::now() + Duration::from_millis(5);
            let e = wait_for(&*h, &h.poison, short, Duration::from_millis(5), "barrier").unwrap_err();
            assert!(e.to_string().contains("timeout"), "{e}");
            let other = waiter.join().unwrap();
            assert!(other.is_err(), "the other waiter returned Ok on an aborted kernel");
            assert!(h.poisoned_at_abort.load(Ordering::SeqCst), "the communicator was aborted before the poison");
        }
    }

    /// The same with the poison check alone: a completion seen before the poison is read is
    /// still refused once the group is poisoned (re-checked after completion).
    #[test]
    fn a_completion_is_rechecked_against_the_poison() {
        struct DoneButPoisoned(Arc<Mutex<Option<CommError>>>);
        impl Completion for DoneButPoisoned {
            fn query(&self) -> Polled {
                // The failure lands between the wait's first poison check and its query.
                relock(&self.0).get_or_insert(CommError::Io("peer failed".into()));
                Polled::Done
            }
            fn async_error(&self) -> Result<Option<String>, ()> {
                Ok(None)
            }
            fn abort(&self) {}
        }
        let p = Arc::new(Mutex::new(None));
        let c = DoneButPoisoned(p.clone());
        let r = wait_for(&c, &p, Instant::now() + Duration::from_secs(1), Duration::from_secs(1), "all_gather");
        assert!(r.unwrap_err().to_string().contains("peer failed"));
        // A healthy completion is Ok.
        struct Fine;
        impl Completion for Fine {
            fn query(&self) -> Polled {
                Polled::Done
            }
            fn async_error(&self) -> Result<Option<String>, ()> {
                Ok(None)
            }
            fn abort(&self) {
                panic!("nothing to abort")
            }
        }
        let p = Mutex::new(None);
        assert!(wait_for(&Fine, &p, Instant::now(), Duration::ZERO, "send").is_ok());
    }
}
