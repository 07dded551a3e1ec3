//! Asynchronous operations: the [`Work`] handle an `*_async` call returns, and the group's
//! communication thread ([`Worker`]), which runs the backend's deferred operations one at a
//! time in call order while the caller computes.

use super::backend::{CommBackend, InFlight, Op, Pending};
use super::error::{CommError, CommResult};
use super::family::Family;
use super::relock;
use crossbeam_channel::{Receiver, Sender};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// Handle of an operation started with one of the `*_async` methods; [`Work::wait`] blocks until it
/// is done and hands back the tensor the operation wrote (`T`).
///
/// The `*_async` methods take their tensors by value, so safe code cannot touch them while the
/// communication thread reads and writes their memory: the output comes back from `wait`, the
/// input is dropped when the operation is done. (A `shallow_clone` made *before* the call still
/// aliases the storage — that is an explicit choice of the caller, and it must not be written
/// through until `wait` returns.) A `Work` dropped without `wait` lets the operation finish in
/// the background; its tensors are freed then.
#[must_use = "wait on the Work to get the result (and to see its error)"]
pub struct Work<T = ()> {
    done: Done,
    out: T,
    /// Run on `out` by `wait` once the operation succeeded (a CUDA tensor's copy back from its
    /// host stand-in: on the waiting thread, so it is ordered before the caller uses `out`).
    after: Option<Box<dyn FnOnce(&mut T) + Send>>,
}

enum Done {
    /// Queued on the communication thread, which reports the result and when it ran.
    Queued(Receiver<(CommResult<()>, Instant, Instant)>),
    /// Started by the backend itself (native asynchrony), at the given time.
    InFlight(Box<dyn InFlight>, Instant),
}

/// When an asynchronous operation actually ran on the communication thread (for a backend with
/// native asynchrony: from the call until `wait` saw it finished).
#[derive(Clone, Copy, Debug)]
pub struct WorkTiming {
    pub started: Instant,
    pub finished: Instant,
}

impl<T> Work<T> {
    /// Block until the operation finished; its result (the tensor it wrote) or its error.
    pub fn wait(self) -> CommResult<T> {
        self.wait_timed().map(|(out, _)| out)
    }
    /// [`wait`](Self::wait), also saying when the operation started and finished on the
    /// communication thread (to measure how much communication overlapped compute).
    pub fn wait_timed(self) -> CommResult<(T, WorkTiming)> {
        let (r, started, finished) = match self.done {
            Done::Queued(rx) => rx.recv().map_err(|_| CommError::Io("communication thread stopped".into()))?,
            Done::InFlight(op, started) => (op.wait(), started, Instant::now()),
        };
        r?;
        let mut out = self.out;
        if let Some(f) = self.after {
            f(&mut out);
        }
        Ok((out, WorkTiming { started, finished }))
    }
    /// The same operation, handing back `out` instead, after `after(&mut out)` ran once it succeeded.
    pub(crate) fn replace_out<U>(self, out: U, after: impl FnOnce(&mut U) + Send + 'static) -> Work<U> {
        debug_assert!(self.after.is_none(), "one completion step per Work");
        Work { done: self.done, out, after: Some(Box::new(after)) }
    }
    /// True once the operation finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        match &self.done {
            Done::Queued(rx) => !rx.is_empty(),
            Done::InFlight(op, _) => op.is_done(),
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// An operation the backend runs by itself, whose failure aborts the rank's other groups.
struct Watched {
    op: Box<dyn InFlight>,
    family: Arc<Family>,
}

impl InFlight for Watched {
    fn is_done(&self) -> bool {
        self.op.is_done()
    }
    fn wait(self: Box<Self>) -> CommResult<()> {
        self.op.wait().inspect_err(|e| self.family.fire(e))
    }
}

/// The communication thread of one rank's group, started by the first `*_async` call.
pub(crate) struct Worker {
    backend: Arc<dyn CommBackend>,
    /// The rank's groups, aborted when an operation of this one fails.
    family: Arc<Family>,
    thread: Mutex<Option<(Sender<Job>, JoinHandle<()>)>>,
    /// Operations queued and not finished yet.
    queued: Arc<AtomicUsize>,
}

impl Worker {
    pub fn new(backend: Arc<dyn CommBackend>, family: Arc<Family>) -> Self {
        Worker { backend, family, thread: Mutex::new(None), queued: Arc::new(AtomicUsize::new(0)) }
    }

    /// Run `op` for a blocking call: in order after the operations already queued by `*_async`
    /// calls (inline on this thread when there are none).
    pub fn run(&self, op: Pending) -> CommResult<()> {
        let r = match op.0 {
            Op::Deferred(f) if self.queued.load(Ordering::SeqCst) == 0 => f(),
            Op::InFlight(op) => op.wait(),
            op => self.submit(Pending(op), ()).wait(),
        };
        r.inspect_err(|e| self.family.fire(e))
    }

    /// Queue `op` on the communication thread; `out` is handed back by [`Work::wait`].
    pub fn submit<T>(&self, op: Pending, out: T) -> Work<T> {
        let f = match op.0 {
            Op::InFlight(op) => {
                let op = Box::new(Watched { op, family: self.family.clone() });
                return Work { done: Done::InFlight(op, Instant::now()), out, after: None };
            }
            Op::Deferred(f) => f,
        };
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.queued.fetch_add(1, Ordering::SeqCst);
        let (backend, queued, family) = (self.backend.clone(), self.queued.clone(), self.family.clone());
        let job: Job = Box::new(move || {
            let started = Instant::now();
            // A panic inside an operation must not kill the communication thread silently:
            // it becomes this operation's error, and the peers are told.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
                let e = CommError::Io(format!("rank {}: an asynchronous operation panicked", backend.rank()));
                backend.abort(&e);
                Err(e)
            });
            if let Err(e) = &r {
                family.fire(e);
            }
            queued.fetch_sub(1, Ordering::SeqCst);
            let _ = tx.send((r, started, Instant::now()));
        });
        let mut thread = relock(&self.thread);
        let (jobs, _) = thread.get_or_insert_with(|| {
            let (jtx, jrx) = crossbeam_channel::unbounded::<Job>();
            let h = std::thread::Builder::new()
                .name(format!("shardlab-comm-{}", self.backend.rank()))
                .spawn(move || jrx.into_iter().for_each(|job| job()))
                .expect("spawn communication thread");
            (jtx, h)
        });
        // If the thread were gone, the job (and its sender) is dropped and `wait` reports it.
        let _ = jobs.send(job);
        Work { done: Done::Queued(rx), out, after: None }
    }

    /// Let the queued operations finish, then end the thread.
    pub fn stop(&self) {
        let thread = relock(&self.thread).take();
        if let Some((jobs, h)) = thread {
            drop(jobs);
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{host::HostBackend, local, CommConfig, ProcessGroup, ReduceOp};
    use std::sync::atomic::AtomicBool;
    use tch::{Device, Kind, Tensor};

    fn worker() -> Worker {
        let t = local::local_world(1).pop().unwrap();
        Worker::new(Arc::new(HostBackend::new(Box::new(t), &CommConfig::default())), Family::new(0))
    }

    /// A natively asynchronous operation that finishes when the test says so.
    struct Flag(Arc<AtomicBool>, CommResult<()>);
    impl InFlight for Flag {
        fn is_done(&self) -> bool {
            self.0.load(Ordering::SeqCst)
        }
        fn wait(self: Box<Self>) -> CommResult<()> {
            self.1
        }
    }

    #[test]
    fn in_flight_operations_are_waited_for_without_the_thread() {
        let w = worker();
        let done = Arc::new(AtomicBool::new(false));
        let work = w.submit(Pending::in_flight(Flag(done.clone(), Ok(()))), 7);
        assert!(!work.is_completed());
        done.store(true, Ordering::SeqCst);
        assert!(work.is_completed());
        assert_eq!(work.wait().unwrap(), 7);
        let e = CommError::Io("device error".into());
        assert!(matches!(w.run(Pending::in_flight(Flag(done, Err(e)))), Err(CommError::Io(_))));
        assert!(relock(&w.thread).is_none(), "no communication thread for in-flight operations");
    }

    #[test]
    fn deferred_operations_run_on_the_thread_and_panics_become_errors() {
        let w = worker();
        assert_eq!(w.submit(Pending::deferred(|| Ok(())), "out").wait().unwrap(), "out");
        let e = w.submit(Pending::deferred(|| panic!("boom")), ()).wait().unwrap_err();
        assert!(e.to_string().contains("an asynchronous operation panicked"), "{e}");
        w.stop();
    }

    #[test]
    fn async_calls_check_their_arguments_at_call_time() {
        let pg = ProcessGroup::local_world(1, CommConfig::default()).unwrap().pop().unwrap();
        let t = Tensor::ones([2, 4], (Kind::Float, Device::Cpu)).transpose(0, 1);
        let e = pg.all_reduce_async(t, ReduceOp::Sum).err().expect("a non-contiguous tensor is refused at once");
        assert!(e.to_string().contains("contiguous"), "{e}");
        let e = pg.all_reduce_async(Tensor::ones([4], (Kind::Int64, Device::Cpu)), ReduceOp::Avg).err().unwrap();
        assert!(e.to_string().contains("Avg"), "{e}");
    }
}
