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

/// Remove what crashed saves left in `dir`: unfinished `step-N.tmp/` folders (never committed) and
/// `.deleting` ones; a `step-N.replaced` folder is put back as `step-N` if a crash came between
/// moving it aside and renaming its replacement in ([`replace`]), removed otherwise.
pub(super) fn sweep(dir: &Path) -> anyhow::Result<()> {
    for e in std::fs::read_dir(dir)?.flatten() {
        let f = e.file_name().to_string_lossy().into_owned();
        if !e.path().is_dir() {
            continue;
        }
        if f.ends_with(".tmp") || f.ends_with(".deleting") {
            std::fs::remove_dir_all(e.path())?;
        } else if let Some(step) = f.strip_suffix(".replaced") {
            if dir.join(step).exists() {
                std::fs::remove_dir_all(e.path())?;
            } else {
                std::fs::rename(e.path(), dir.join(step))?;
                fsync_dir(dir)?;
            }
        }
    }
    Ok(())
}

/// Commit folder `tmp` as `path`. When `path` is a committed checkpoint already, the two are
/// swapped atomically (`renameat2(RENAME_EXCHANGE)`: `path` names a committed checkpoint at every
/// instant) and the old one removed. Where the file system cannot swap, the old one is moved aside
/// to `path.replaced` first — which [`sweep`] puts back if a crash comes before the rename.
pub(super) fn replace(tmp: &Path, path: &Path) -> anyhow::Result<()> {
    if !path.exists() {
        return std::fs::rename(tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()));
    }
    if !exchange(tmp, path)? {
        return replace_aside(tmp, path);
    }
    // Committed (the old copy is now at `tmp`): what follows are warnings.
    after_commit(path, &[tmp.to_path_buf()]);
    Ok(())
}

/// [`replace`] where folders cannot be swapped: the old one moved aside (to `path.replaced`, which
/// [`sweep`] puts back after a crash before the rename), the new one renamed in, the old removed.
fn replace_aside(tmp: &Path, path: &Path) -> anyhow::Result<()> {
    let aside = path.with_file_name(format!("{}.replaced", path.file_name().unwrap_or_default().to_string_lossy()));
    std::fs::rename(path, &aside).with_context(|| format!("moving {} aside", path.display()))?;
    std::fs::rename(tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    after_commit(path, &[aside]);
    Ok(())
}

/// After `path` was committed in place of an old copy (now at `old`): make the folder durable and
/// remove the old copy — failures are warnings, the commit stands.
fn after_commit(path: &Path, old: &[PathBuf]) {
    if let Some(Err(e)) = path.parent().map(fsync_dir) {
        eprintln!("warning: {} is committed, but fsync of its folder failed: {e:#}", path.display());
    }
    for o in old {
        if let Err(e) = std::fs::remove_dir_all(o) {
            eprintln!(
                "warning: {} is committed; removing the copy it replaced ({}): {e:#}",
                path.display(),
                o.display()
            );
        }
    }
}

/// Swap folders `a` and `b` atomically (`renameat2(RENAME_EXCHANGE)`); `false` where the file
/// system or platform cannot.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn exchange(a: &Path, b: &Path) -> anyhow::Result<bool> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).context("a path with a NUL byte");
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: two NUL-terminated paths that live across the call.
    let r = unsafe { libc::renameat2(libc::AT_FDCWD, ca.as_ptr(), libc::AT_FDCWD, cb.as_ptr(), libc::RENAME_EXCHANGE) };
    if r == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOSYS)) {
        return Ok(false);
    }
    Err(e).with_context(|| format!("swapping {} and {}", a.display(), b.display()))
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn exchange(_: &Path, _: &Path) -> anyhow::Result<bool> {
    Ok(false)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(p: &Path, what: &str) {
        std::fs::create_dir_all(p).unwrap();
        std::fs::write(p.join(METADATA), what).unwrap();
    }
    fn what(p: &Path) -> String {
        std::fs::read_to_string(p.join(METADATA)).unwrap()
    }

    /// Replacing a committed step: swapped (or, where folders cannot be swapped, moved aside),
    /// nothing left behind; a crash between moving the old one aside and renaming the new one in
    /// leaves the old one, which the next save's sweep puts back (and removes the unfinished new).
    #[test]
    fn a_replaced_step_is_committed_at_every_instant() {
        let dir = std::env::temp_dir().join(format!("shardlab-replace-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (step, tmp) = (dir.join("step-00000005"), dir.join("step-00000005.tmp"));
        for swap in [true, false] {
            folder(&step, "old");
            folder(&tmp, "new");
            if swap {
                replace(&tmp, &step).unwrap()
            } else {
                replace_aside(&tmp, &step).unwrap()
            }
            assert_eq!(what(&step), "new");
            let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name()).collect();
            assert_eq!(left.len(), 1, "swap {swap}: {left:?}");
        }
        // The crash: the old step aside, the new one not renamed in yet.
        std::fs::rename(&step, dir.join("step-00000005.replaced")).unwrap();
        folder(&tmp, "newer");
        assert!(super::resolve(&dir).is_err(), "no committed checkpoint in the window");
        sweep(&dir).unwrap();
        assert_eq!(what(&step), "new", "the old step is back");
        assert!(!tmp.exists() && !dir.join("step-00000005.replaced").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
