//! The groups of one rank fail together. A rank's first group and every subgroup made from it
//! ([`ProcessGroup::split`](super::ProcessGroup::split), a [`DeviceMesh`](super::DeviceMesh)'s
//! rows and columns) form a *family*: the first group of the family to fail — its own error, a
//! bad argument, a peer's abort, [`ProcessGroup::abort`](super::ProcessGroup::abort) — aborts
//! every other, so each of them tells its own peers at once.
//!
//! Without it, a rank that fails its tensor-parallel group and stays alive (catching the error,
//! or stuck elsewhere) would leave its data-parallel peers waiting for it the whole timeout: they
//! share no connection with the group that failed. With it, the failure spreads through the
//! mesh in one hop per group: the dp peers' groups fail, then theirs.
//!
//! This is what PyTorch gets by tearing the process down when one process group's watchdog sees
//! an error; here the process lives on and every group's next (or current) operation returns the
//! error.

use super::backend::CommBackend;
use super::error::CommError;
use super::relock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// Which job a group belongs to, within this process: its rank's family of groups, weakly held.
/// Two jobs in one process (thread ranks, a notebook running one job after another) have
/// different tokens; a token whose job has dropped its groups is no longer [`alive`](Self::alive).
#[derive(Clone)]
pub struct JobToken(Weak<Family>);

impl JobToken {
    /// Whether `other` is a token of the same job.
    pub fn same_job(&self, other: &JobToken) -> bool {
        Weak::ptr_eq(&self.0, &other.0)
    }
    /// Whether the job still has a group (it has not ended, or it failed but still holds them).
    pub fn alive(&self) -> bool {
        self.0.strong_count() > 0
    }
}

impl std::fmt::Debug for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JobToken({:p}, alive: {})", self.0.as_ptr(), self.alive())
    }
}

/// The groups of one rank (weakly held: a dropped group leaves).
pub(crate) struct Family {
    /// This rank's rank in the family's first group (named in the error the others get).
    rank: usize,
    members: Mutex<Vec<Weak<dyn CommBackend>>>,
    fired: AtomicBool,
}

impl Family {
    /// The token of the job whose groups these are.
    pub fn token(self: &Arc<Self>) -> JobToken {
        JobToken(Arc::downgrade(self))
    }

    pub fn new(rank: usize) -> Arc<Self> {
        Arc::new(Family { rank, members: Mutex::new(Vec::new()), fired: AtomicBool::new(false) })
    }

    /// `group` is one of this rank's groups (made after the family failed: it fails at once).
    pub fn join(&self, group: &Arc<dyn CommBackend>) {
        let mut m = relock(&self.members);
        m.retain(|w| w.strong_count() > 0);
        m.push(Arc::downgrade(group));
        drop(m);
        if self.fired.load(Ordering::SeqCst) {
            let reason = format!("another group of rank {} of the job had failed before this one was made", self.rank);
            group.abort(&CommError::Aborted { by: group.rank(), reason });
        }
    }

    /// A group of the family failed with `err`: abort every other group (once; later failures
    /// find them aborted already).
    pub fn fire(&self, err: &CommError) {
        if self.fired.swap(true, Ordering::SeqCst) {
            return;
        }
        let live: Vec<Arc<dyn CommBackend>> = relock(&self.members).iter().filter_map(Weak::upgrade).collect();
        for g in live.into_iter().filter(|g| g.poisoned().is_none()) {
            let reason = format!("another group of rank {} of the job failed: {err}", self.rank);
            g.abort(&CommError::Aborted { by: g.rank(), reason });
        }
    }
}
