//! One job per checkpoint folder: the rank that commits (rank 0) holds an exclusive `flock` on
//! `DIR/.lock` from its first save until its job ends ([`unlock_folder`]) or its process exits —
//! the kernel drops it when the process dies, so a crashed job leaves no stale lock. A second job
//! saving into the same folder would remove the first one's unfinished `step-N.tmp` and its older
//! steps (`keep_last`); it is refused instead, with the holder's pid and host. Within one process
//! (thread ranks, a notebook) the lock is the job's: a folder another job of this process holds
//! is refused the same way. The training loops release their folders when the job ends, failed
//! or not ([`FolderRelease`]); a lock a job left behind anyway (a job that called `save` itself)
//! passes to the next job of the process once the first job's groups are gone
//! ([`JobToken::alive`]), and any lock or unlock in the process closes such leftovers. Where the
//! file system has no `flock` (Lustre without `-o flock`), saving goes on without the lock, with a
//! warning.

use crate::comm::JobToken;
use anyhow::Context;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The folders this process holds, and for which of its jobs (the lock files stay open, and
/// locked, until it exits or the job releases them).
static HELD: Mutex<BTreeMap<PathBuf, (File, JobToken)>> = Mutex::new(BTreeMap::new());

const LOCK: &str = ".lock";

/// Lock checkpoint folder `dir` (which exists) for `job`, or say which job holds it. Taking it
/// again for the same job is a no-op (a job saves many times); for a job of this process whose
/// groups are gone, it passes to `job`.
pub fn lock_folder(dir: &Path, job: &JobToken) -> anyhow::Result<()> {
    let key = dir.canonicalize().with_context(|| format!("resolving {}", dir.display()))?;
    let mut held = HELD.lock().unwrap_or_else(|p| p.into_inner());
    // Locks of jobs whose groups are gone are closed (other processes may take those folders),
    // except this folder's, which passes to `job` below.
    held.retain(|k, (_, holder)| holder.alive() || *k == key);
    if let Some((f, holder)) = held.get_mut(&key) {
        // Still the folder's lock file (not one of a folder since removed and made again)?
        use std::os::unix::fs::MetadataExt;
        let same = match (f.metadata(), std::fs::metadata(key.join(LOCK))) {
            (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
            _ => false,
        };
        if same {
            if holder.same_job(job) || !holder.alive() {
                *holder = job.clone();
                return Ok(());
            }
            anyhow::bail!(
                "{} is in use by another job (another job of this process, pid {}, still running or still \
                 holding its process groups): two jobs saving into one folder would remove each other's \
                 checkpoints — give this one its own checkpoint folder, or let the other end",
                dir.display(),
                std::process::id()
            );
        }
        held.remove(&key);
    }
    let path = key.join(LOCK);
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    use std::os::unix::io::AsRawFd;
    // SAFETY: flock on a file descriptor this function owns; no memory is involved.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let err = std::io::Error::last_os_error();
        let mut who = String::new();
        let _ = f.read_to_string(&mut who);
        if matches!(err.raw_os_error(), Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP) | Some(libc::ENOLCK)) {
            eprintln!(
                "warning: {} cannot be locked ({err}): saving without the lock — make sure no other job saves there",
                dir.display()
            );
            return Ok(());
        }
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            anyhow::bail!(
                "{} is in use by another job ({}): two jobs saving into one folder would remove each other's \
                 checkpoints — give this one its own checkpoint folder, or stop the other",
                dir.display(),
                if who.trim().is_empty() { "its holder did not say who it is".into() } else { who.trim().to_string() }
            );
        }
        return Err(err).with_context(|| format!("locking {}", path.display()));
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    f.set_len(0)?;
    f.rewind()?;
    write!(f, "pid {} on {}, since {since} (Unix time)", std::process::id(), host.trim())?;
    f.sync_all()?;
    held.insert(key, (f, job.clone()));
    Ok(())
}

/// Release `job`'s lock on checkpoint folder `dir`, if it holds it (a job's end: the next job in
/// this process, or one it launches, may save there), or a lock there whose job is gone. A
/// running job's lock stays.
pub fn unlock_folder(dir: &Path, job: &JobToken) {
    let mut held = HELD.lock().unwrap_or_else(|p| p.into_inner());
    held.retain(|_, (_, holder)| holder.alive());
    if let Ok(key) = dir.canonicalize() {
        if held.get(&key).is_some_and(|(_, holder)| holder.same_job(job)) {
            held.remove(&key);
        }
    }
}

/// Releases `job`'s locks on `dirs` when dropped: a training loop holds one from its start, so
/// its folders are free when it ends — returning, failing with an error or panicking.
pub struct FolderRelease {
    dirs: Vec<PathBuf>,
    job: JobToken,
}

impl FolderRelease {
    pub fn new(dirs: Vec<PathBuf>, job: JobToken) -> Self {
        FolderRelease { dirs, job }
    }
}

impl Drop for FolderRelease {
    fn drop(&mut self) {
        for d in &self.dirs {
            unlock_folder(d, &self.job);
        }
    }
}
