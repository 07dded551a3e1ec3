//! A fresh secret for ranks started by hand on one machine without `SHARDLAB_SECRET`.
//!
//! Rank 0 draws 32 random bytes for this run and leaves them, with its pid, in a file only this
//! user can read: `$XDG_RUNTIME_DIR/shardlab/` or `/tmp/shardlab-<uid>/` (a directory of mode
//! 0700, checked), named after the job id and the store's port. The other ranks wait for the file
//! (as they wait for the store) and read it. Rank 0 removes it once the group has formed, or when
//! its rendezvous fails. A file whose writer is dead is left from a killed run and is not read.
//!
//! So the rendezvous is authenticated against every other user of the machine, and against
//! processes of this user that cannot read the file while it exists. (A secret derived from the
//! job id would be public: the default job id is "shardlab".) Ranks that do not share a file
//! system (containers that share only the network) never see the file and say so: give them one
//! `SHARDLAB_SECRET`.

use super::Secret;
use crate::comm::error::{CommError, CommResult};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Rank 0's file; removed when dropped.
pub(crate) struct SecretFile(PathBuf);

impl Drop for SecretFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The private directory of this user (made if missing; refused if anyone else could use it).
fn dir() -> CommResult<PathBuf> {
    let uid = unsafe { libc::geteuid() };
    let d = match std::env::var_os("XDG_RUNTIME_DIR").filter(|v| !v.is_empty()) {
        Some(x) => PathBuf::from(x).join("shardlab"),
        None => std::env::temp_dir().join(format!("shardlab-{uid}")),
    };
    match std::fs::DirBuilder::new().mode(0o700).create(&d) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(CommError::Io(format!("cannot make {}: {e}", d.display()))),
    }
    let m = std::fs::symlink_metadata(&d).map_err(|e| CommError::Io(format!("{}: {e}", d.display())))?;
    if !m.is_dir() || m.uid() != uid || m.permissions().mode() & 0o077 != 0 {
        return Err(CommError::InvalidArgument(format!(
            "{} is not a private directory of this user (mode 0700), so a run secret cannot be kept there; \
             export SHARDLAB_SECRET (`openssl rand -hex 32`) for every rank instead",
            d.display()
        )));
    }
    Ok(d)
}

fn path(job_id: &str, port: u16) -> CommResult<PathBuf> {
    let h = Sha256::digest(format!("{job_id}\0{port}").as_bytes());
    let name: String = h[..8].iter().map(|b| format!("{b:02x}")).collect();
    Ok(dir()?.join(format!("rdzv-{name}")))
}

/// Rank 0: a fresh secret for this run, left for the other ranks.
pub(crate) fn publish(job_id: &str, port: u16) -> CommResult<(Secret, SecretFile)> {
    let secret = Secret::generate()?;
    let p = path(job_id, port)?;
    let tmp = p.with_extension(format!("tmp{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
        writeln!(f, "{} {}", std::process::id(), secret.to_hex())?;
        std::fs::rename(&tmp, &p)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        CommError::Io(format!("cannot write the run's secret to {}: {e}", p.display()))
    })?;
    Ok((secret, SecretFile(p)))
}

/// Another rank: rank 0's secret for this run, waited for until `timeout`.
pub(crate) fn fetch(job_id: &str, port: u16, timeout: Duration) -> CommResult<Secret> {
    let p = path(job_id, port)?;
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(text) = std::fs::read_to_string(&p) {
            let mut f = text.split_whitespace();
            let pid = f.next().and_then(|v| v.parse::<libc::pid_t>().ok()).filter(|&pid| pid > 0);
            let live = pid.is_some_and(|pid| {
                let r = unsafe { libc::kill(pid, 0) };
                r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
            });
            if let (true, Some(hex)) = (live, f.next()) {
                return Secret::from_hex(hex);
            }
        }
        if Instant::now() >= deadline {
            return Err(CommError::Rendezvous(format!(
                "SHARDLAB_SECRET is not set and rank 0 left no secret for this run in {} within {timeout:?} \
                 (did it start? ranks that do not share this file system need one SHARDLAB_SECRET, e.g. \
                 `openssl rand -hex 32`, exported for every rank)",
                p.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
