//! The checkpoint folder: its committed `step-N` checkpoints, which one a restart resumes
//! ([`resolve`]), and the file-system steps of a commit (fsync, atomic replace, removal that never
//! leaves something that looks committed).

use super::{LATEST, METADATA};
use anyhow::{bail, ensure, Context};
use std::path::{Path, PathBuf};

/// Remove a checkpoint folder so that a crash midway never leaves something that looks committed:
/// rename it out of the `step-N` namespace first, then delete.
pub(super) fn remove_checkpoint(path: &Path) -> anyhow::Result<()> {
    let doomed = path.with_file_name(format!("{}.deleting", path.file_name().unwrap_or_default().to_string_lossy()));
    std::fs::rename(path, &doomed).with_context(|| format!("renaming {} for removal", path.display()))?;
    if let Some(parent) = path.parent() {
        fsync_dir(parent)?;
    }
    std::fs::remove_dir_all(&doomed).with_context(|| format!("removing {}", doomed.display()))
}

/// Swap folders `a` and `b` atomically (`renameat2(RENAME_EXCHANGE)`): both names exist at every
/// instant. Where the file system cannot (EINVAL, ENOSYS), `b` is removed and `a` renamed to it —
/// with a window in which neither exists.
pub(super) fn exchange(a: &Path, b: &Path) -> anyhow::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).context("a path with a NUL byte");
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: two NUL-terminated paths that live across the call.
    let r = unsafe { libc::renameat2(libc::AT_FDCWD, ca.as_ptr(), libc::AT_FDCWD, cb.as_ptr(), libc::RENAME_EXCHANGE) };
    if r == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOSYS)) {
        remove_checkpoint(b)?;
        return std::fs::rename(a, b).with_context(|| format!("renaming {} to {}", a.display(), b.display()));
    }
    Err(e).with_context(|| format!("swapping {} and {}", a.display(), b.display()))
}

/// The sequence number of the checkpoint in `dir` (0 if it has none or cannot be read).
pub(super) fn seq_of(dir: &Path) -> u64 {
    let v: Option<serde_json::Value> =
        std::fs::read(dir.join(METADATA)).ok().and_then(|b| serde_json::from_slice(&b).ok());
    v.and_then(|v| v["seq"].as_u64()).unwrap_or(0)
}

pub(super) fn fsync_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::File::open(dir).and_then(|f| f.sync_all()).with_context(|| format!("fsync {}", dir.display()))
}

pub(super) fn write_synced(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(bytes).with_context(|| format!("writing {}", path.display()))?;
    f.sync_all().with_context(|| format!("fsync {}", path.display()))
}

/// Committed checkpoints in `dir`, oldest first: folders `step-N` with a `metadata.json` (none if
/// `dir` cannot be read; [`try_committed`] says why).
pub fn committed(dir: &Path) -> Vec<(u64, PathBuf)> {
    try_committed(dir).unwrap_or_default()
}

/// [`committed`], with an error when `dir` exists but cannot be read (an empty list when it
/// does not exist).
pub fn try_committed(dir: &Path) -> anyhow::Result<Vec<(u64, PathBuf)>> {
    if !dir.exists() {
        return Ok(Vec::new());
    }
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            e.path().join(METADATA).is_file().then(|| (step, e.path()))
        })
        .collect();
    out.sort();
    Ok(out)
}

/// The checkpoint folder `path` names: a committed checkpoint itself, or a folder of them (its
/// `latest`, or else its newest committed one).
pub fn resolve(path: &Path) -> anyhow::Result<PathBuf> {
    if path.join(METADATA).is_file() {
        return Ok(path.to_path_buf());
    }
    ensure!(path.is_dir(), "{} is not a folder (a checkpoint is a folder with a {METADATA})", path.display());
    // The newest commit by sequence number (a crash between a commit and the replacement of
    // `latest` leaves `latest` naming the one before).
    // Equal numbers (copied folders): the one `latest` names, else the highest step.
    let all: Vec<(u64, u64, PathBuf)> =
        try_committed(path)?.into_iter().map(|(step, p)| (seq_of(&p), step, p)).collect();
    let top = all.iter().map(|c| c.0).max().unwrap_or(0);
    if top > 0 {
        let latest = std::fs::read_to_string(path.join(LATEST)).unwrap_or_default();
        let newest: Vec<&(u64, u64, PathBuf)> = all.iter().filter(|c| c.0 == top).collect();
        let named = newest.iter().find(|c| c.2.file_name().is_some_and(|f| f.to_string_lossy() == latest.trim()));
        let pick = named.or(newest.last()).expect("a checkpoint with the top number");
        return Ok(pick.2.clone());
    }
    // Checkpoints written before sequence numbers: `latest`, else the highest step.
    if let Ok(name) = std::fs::read_to_string(path.join(LATEST)) {
        let name = name.trim();
        let valid = name.strip_prefix("step-").is_some_and(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()));
        if !valid {
            // Never written by `save` (it replaces `latest` atomically): say so, and use the newest
            // committed checkpoint instead.
            eprintln!(
                "shardlab: {}: {name:?} is not a checkpoint name (step-N); ignoring it",
                path.join(LATEST).display()
            );
        } else if path.join(name).join(METADATA).is_file() {
            return Ok(path.join(name));
        }
    }
    match committed(path).pop() {
        Some((_, p)) => Ok(p),
        None => bail!(
            "{} holds no committed checkpoint (no step-N folder with a {METADATA}; a step-N.tmp folder is an unfinished save)",
            path.display()
        ),
    }
}
