//! Names of the shared-memory segments (`shm.rs`), and the sweep of those a killed rank left.
//!
//! A segment is named `shardlab-<pid namespace>-<pid>-<random>-<rank>`: who made it. It is
//! unlinked once its group has formed, so a name still in `/dev/shm` belongs to a group that is
//! forming or to a rank killed before its group formed; the next process to form a group on
//! the machine removes the latter ([`sweep_dead`], once per process).

use std::path::Path;

/// This process's segment names begin with this: `shardlab-<pid namespace>-` (then the pid).
/// The pid namespace (the inode of `/proc/self/ns/pid`) keeps containers that share `/dev/shm`
/// but not process ids from judging each other's segments.
pub(super) fn own_prefix() -> String {
    format!("shardlab-{}-", pid_namespace().unwrap_or(0))
}

/// The inode of this process's pid namespace (`None` where /proc does not say).
fn pid_namespace() -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map(|m| m.ino()).ok()
}

/// Remove the segments in `dir` that processes of this pid namespace made and that are dead
/// (killed before their group formed, which is when a segment is unlinked). Returns how many
/// and their bytes. Only regular files of this user; a segment of a live process is kept.
pub(super) fn sweep_dead(dir: &Path) -> (usize, u64) {
    use std::os::unix::fs::MetadataExt;
    if pid_namespace().is_none() {
        return (0, 0); // whose pids the names hold cannot be told: keep everything
    }
    let prefix = own_prefix();
    let (mut n, mut bytes) = (0, 0);
    let Ok(entries) = std::fs::read_dir(dir) else { return (0, 0) };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(&prefix)).and_then(|r| r.split('-').next()) else {
            continue;
        };
        let Ok(pid) = pid.parse::<libc::pid_t>() else { continue };
        let Ok(meta) = std::fs::symlink_metadata(e.path()) else { continue };
        if !meta.is_file() || meta.uid() != unsafe { libc::geteuid() } || pid <= 0 {
            continue;
        }
        let dead =
            unsafe { libc::kill(pid, 0) } != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if dead && std::fs::remove_file(e.path()).is_ok() {
            n += 1;
            bytes += meta.blocks() * 512;
        }
    }
    (n, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Leftovers of dead processes of this pid namespace go; a live process's segment, another
    /// namespace's and files that are not segments stay.
    #[test]
    fn segments_of_dead_processes_are_swept() {
        let dir = std::env::temp_dir().join(format!("shardlab-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let me = std::process::id();
        let p = own_prefix();
        let files = [
            (format!("{p}{dead}-ab-0"), true),
            (format!("{p}{me}-cd-1"), false),
            (format!("shardlab-1-{dead}-ef-0"), p == "shardlab-1-"),
            (format!("{p}notapid-0"), false),
            ("other".to_string(), false),
        ];
        for (f, _) in &files {
            std::fs::write(dir.join(f), vec![1u8; 8192]).unwrap();
        }
        let (n, bytes) = sweep_dead(&dir);
        for (f, gone) in &files {
            assert_eq!(!dir.join(f).exists(), *gone, "{f}");
        }
        assert_eq!(n, files.iter().filter(|f| f.1).count());
        assert!(bytes >= 8192 * n as u64);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
