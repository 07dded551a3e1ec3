//! A fresh secret for ranks started by hand on one machine without `SHARDLAB_SECRET`.
//!
//! Rank 0 draws 32 random bytes for this run and, once its store listens, leaves them in a file
//! only this user can read: `$XDG_RUNTIME_DIR/shardlab/` or `/tmp/shardlab-<uid>/` (a directory
//! of mode 0700, checked), named after the job id and the store's port, with its pid, start time
//! and pid namespace. The other ranks wait for the file (as they wait for the store) and read it;
//! a file whose writer is gone (a killed run's) is not read, and a secret the store refuses
//! (an earlier run's) is read again until a new one comes. Rank 0 removes the file once the
//! group has formed, or when its rendezvous fails, if it still holds its secret.
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

/// Rank 0's file; removed when dropped, if it still holds this run's secret (a later run that
/// took the same job id and port may have replaced it).
pub(crate) struct SecretFile {
    path: PathBuf,
    hex: String,
}

impl Drop for SecretFile {
    fn drop(&mut self) {
        if std::fs::read_to_string(&self.path).is_ok_and(|t| t.split_whitespace().nth(3) == Some(&self.hex)) {
            let _ = std::fs::remove_file(&self.path);
        }
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

/// The file's path, for messages.
pub(crate) fn describe(job_id: &str, port: u16) -> String {
    path(job_id, port).map_or_else(|e| e.to_string(), |p| p.display().to_string())
}

/// Who a process is, beyond its pid (which is reused): its start time (clock ticks after boot,
/// `/proc/<pid>/stat` field 22) and its pid namespace.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(19)?.parse().ok()
}

fn pid_namespace() -> u64 {
    std::fs::metadata("/proc/self/ns/pid").map(|m| m.ino()).unwrap_or(0)
}

/// Rank 0, once its store listens: leave this run's `secret` for the other ranks.
pub(crate) fn publish(job_id: &str, port: u16, secret: &Secret) -> CommResult<SecretFile> {
    let p = path(job_id, port)?;
    let me = std::process::id();
    let tmp = p.with_extension(format!("tmp{me}"));
    let hex = secret.to_hex();
    let line = format!("{me} {} {} {hex}\n", start_time(me).unwrap_or(0), pid_namespace());
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        f.write_all(line.as_bytes())?;
        std::fs::rename(&tmp, &p)
    };
    let _ = std::fs::remove_file(&tmp);
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        CommError::Io(format!("cannot write the run's secret to {}: {e}", p.display()))
    })?;
    Ok(SecretFile { path: p, hex })
}

/// The secret in a file whose writer still runs (the same process: pid, start time); a writer
/// in another pid namespace cannot be judged from here and counts as running.
fn read_live(p: &std::path::Path) -> Option<Secret> {
    let text = std::fs::read_to_string(p).ok()?;
    let f: Vec<&str> = text.split_whitespace().collect();
    let [pid, started, ns, hex] = f[..] else { return None };
    let (pid, started, ns): (u32, u64, u64) = (pid.parse().ok()?, started.parse().ok()?, ns.parse().ok()?);
    let live = ns != pid_namespace() || start_time(pid).is_some_and(|t| t == started);
    live.then(|| Secret::from_hex(hex).ok()).flatten()
}

/// Another rank: rank 0's secret for this run, waited for until `deadline`; `not`: one that
/// failed to authenticate (a file left by an earlier run): wait for another.
pub(crate) fn fetch(job_id: &str, port: u16, deadline: Instant, not: Option<&Secret>) -> CommResult<Secret> {
    let p = path(job_id, port)?;
    loop {
        if let Some(s) = read_live(&p).filter(|s| not.is_none_or(|n| n.to_hex() != s.to_hex())) {
            return Ok(s);
        }
        if Instant::now() >= deadline {
            return Err(CommError::Rendezvous(format!(
                "SHARDLAB_SECRET is not set and rank 0 left no secret for this run in {} in time \
                 (did it start? ranks that do not share this directory need one SHARDLAB_SECRET, e.g. \
                 `openssl rand -hex 32`, exported for every rank)",
                p.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
