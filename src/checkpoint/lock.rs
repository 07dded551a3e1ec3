//! One job per checkpoint folder: the rank that commits (rank 0) holds an exclusive `flock` on
//! `DIR/.lock` from its first save until its job ends ([`unlock_folder`]) or its process exits —
//! the kernel drops it when the process dies, so a crashed job leaves no stale lock. A second job
//! saving into the same folder would remove the first one's unfinished `step-N.tmp` and its older
//! steps (`keep_last`); it is refused instead, with the holder's pid and host. The lock is the
//! process's: two jobs at once in one process (thread ranks) are not told apart. Where the file
//! system has no `flock` (Lustre without `-o flock`), saving goes on without the lock, with a
//! warning.

use anyhow::Context;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The folders this process holds (their lock files stay open, and locked, until it exits).
static HELD: Mutex<BTreeMap<PathBuf, File>> = Mutex::new(BTreeMap::new());

const LOCK: &str = ".lock";

/// Lock checkpoint folder `dir` (which exists) for this process, or say which job holds it. Taking
/// it again in the same process is a no-op (the ranks of a job run as threads of one process,
/// and a job may save many times).
pub fn lock_folder(dir: &Path) -> anyhow::Result<()> {
    let key = dir.canonicalize().with_context(|| format!("resolving {}", dir.display()))?;
    let mut held = HELD.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(f) = held.get(&key) {
        // Still the folder's lock file (not one of a folder since removed and made again)?
        use std::os::unix::fs::MetadataExt;
        let same = match (f.metadata(), std::fs::metadata(key.join(LOCK))) {
            (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
            _ => false,
        };
        if same {
            return Ok(());
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
    held.insert(key, f);
    Ok(())
}

/// Release this process's lock on checkpoint folder `dir`, if it holds it (a job's last rank 0
/// step: the next job in this process, or one it launches, may save there).
pub fn unlock_folder(dir: &Path) {
    if let Ok(key) = dir.canonicalize() {
        HELD.lock().unwrap_or_else(|p| p.into_inner()).remove(&key);
    }
}
