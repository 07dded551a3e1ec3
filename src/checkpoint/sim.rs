//! A disk that can lose power (lesson 10): an in-memory file system with the durability rules
//! of POSIX, for testing a commit protocol against a crash after every single operation.
//!
//! What survives a power loss, the pessimistic way real disks are allowed to behave:
//! - a file's bytes survive only once the file was `sync`ed (fsync) after its last write; a file
//!   written but not synced comes back **torn** — the first half of what was written;
//! - a directory's entries (files created, renamed or removed in it) survive only once the
//!   directory itself was `sync`ed; an entry added since comes back missing, one removed comes
//!   back, a rename since is undone.
//!
//! Paths are relative to the disk's root and use `/`: `"latest"`, `"step-00000002.tmp/a.bin"`.
//! Operations count from 0; [`SimDisk::crash_at`]`(k)` makes operation `k` fail instead of
//! happening: the power goes, everything not durable is lost, and every call fails with
//! [`SimError::PowerLoss`] until [`SimDisk::reboot`].
//!
//! ```text
//! d.write("a", b"hello")    // in the page cache; the root's entry for "a" is not durable either
//! d.power_loss()            // "a" is gone: never synced, never linked durably
//! ```

use std::collections::BTreeMap;
use std::fmt;

/// Why a [`SimDisk`] operation failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SimError {
    /// The power went (at this operation, or before it and the disk was not rebooted).
    PowerLoss,
    /// No such file or directory.
    NotFound(String),
    /// Something already has that name.
    Exists(String),
    /// A file where a directory is needed, or the other way round.
    NotADirectory(String),
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SimError::PowerLoss => write!(f, "the machine lost power"),
            SimError::NotFound(p) => write!(f, "{p}: no such file or directory"),
            SimError::Exists(p) => write!(f, "{p}: already exists"),
            SimError::NotADirectory(p) => write!(f, "{p}: not a directory (or a directory where a file is needed)"),
        }
    }
}

impl std::error::Error for SimError {}

#[derive(Clone, Debug)]
enum Node {
    File { data: Vec<u8>, durable: Vec<u8> },
    Dir { entries: BTreeMap<String, usize>, durable: BTreeMap<String, usize> },
}

/// The simulated disk (see the module docs).
#[derive(Clone, Debug)]
pub struct SimDisk {
    /// Inodes; 0 is the root directory. Unlinked ones stay (nothing reuses them).
    nodes: Vec<Node>,
    ops: usize,
    crash_at: Option<usize>,
    down: bool,
    log: Vec<String>,
}

impl Default for SimDisk {
    fn default() -> Self {
        Self::new()
    }
}

fn split(path: &str) -> (&str, &str) {
    path.rsplit_once('/').unwrap_or(("", path))
}

impl SimDisk {
    /// An empty disk: only the root directory.
    pub fn new() -> Self {
        SimDisk {
            nodes: vec![Node::Dir { entries: BTreeMap::new(), durable: BTreeMap::new() }],
            ops: 0,
            crash_at: None,
            down: false,
            log: Vec::new(),
        }
    }

    /// Make operation number `op` (counting from 0 over this disk's life) lose the power.
    pub fn crash_at(&mut self, op: usize) {
        self.crash_at = Some(op);
    }

    /// Operations attempted so far.
    pub fn ops(&self) -> usize {
        self.ops
    }

    /// What was done, one line per operation (`"3 sync step-00000002.tmp"`) and per power loss
    /// (`"7 POWER LOSS"`), for error messages.
    pub fn log(&self) -> &[String] {
        &self.log
    }

    /// Whether the power is off (a crash happened and no reboot since).
    pub fn is_down(&self) -> bool {
        self.down
    }

    /// Lose the power now: only what was made durable survives (module docs).
    pub fn power_loss(&mut self) {
        for n in &mut self.nodes {
            match n {
                Node::File { data, durable } => {
                    if data != durable {
                        // Torn: part of the new bytes reached the platters.
                        let torn = data[..data.len() / 2].to_vec();
                        *durable = torn.clone();
                        *data = torn;
                    }
                }
                Node::Dir { entries, durable } => *entries = durable.clone(),
            }
        }
        self.down = true;
        self.log.push(format!("{} POWER LOSS", self.ops));
    }

    /// Power back on, with whatever survived; operations work again.
    pub fn reboot(&mut self) {
        self.down = false;
        self.crash_at = None;
    }

    /// Count an operation; fail it if the power is off or goes now.
    fn op(&mut self, what: String) -> Result<(), SimError> {
        if self.down {
            return Err(SimError::PowerLoss);
        }
        let k = self.ops;
        self.ops += 1;
        self.log.push(format!("{k} {what}"));
        if self.crash_at == Some(k) {
            self.power_loss();
            return Err(SimError::PowerLoss);
        }
        Ok(())
    }

    fn lookup(&self, path: &str) -> Option<usize> {
        let mut at = 0;
        for part in path.split('/').filter(|p| !p.is_empty()) {
            match &self.nodes[at] {
                Node::Dir { entries, .. } => at = *entries.get(part)?,
                Node::File { .. } => return None,
            }
        }
        Some(at)
    }

    /// The directory that holds `path`, and the name in it.
    fn parent<'a>(&self, path: &'a str) -> Result<(usize, &'a str), SimError> {
        let (dir, name) = split(path);
        if name.is_empty() {
            return Err(SimError::NotFound(path.into()));
        }
        match self.lookup(dir) {
            Some(d) if matches!(self.nodes[d], Node::Dir { .. }) => Ok((d, name)),
            Some(_) => Err(SimError::NotADirectory(dir.into())),
            None => Err(SimError::NotFound(dir.into())),
        }
    }

    fn entries(&mut self, dir: usize) -> &mut BTreeMap<String, usize> {
        match &mut self.nodes[dir] {
            Node::Dir { entries, .. } => entries,
            Node::File { .. } => unreachable!("parent() returns directories"),
        }
    }

    /// Create the directory `path` (its parent must exist; `path` must not).
    pub fn create_dir(&mut self, path: &str) -> Result<(), SimError> {
        self.op(format!("create_dir {path}"))?;
        let (dir, name) = self.parent(path)?;
        if self.entries(dir).contains_key(name) {
            return Err(SimError::Exists(path.into()));
        }
        self.nodes.push(Node::Dir { entries: BTreeMap::new(), durable: BTreeMap::new() });
        let ino = self.nodes.len() - 1;
        self.entries(dir).insert(name.into(), ino);
        Ok(())
    }

    /// Create the file `path`, or replace its contents, with `bytes` (not durable until synced).
    pub fn write(&mut self, path: &str, bytes: &[u8]) -> Result<(), SimError> {
        self.op(format!("write {path} ({} bytes)", bytes.len()))?;
        let (dir, name) = self.parent(path)?;
        match self.entries(dir).get(name).copied() {
            Some(ino) => match &mut self.nodes[ino] {
                Node::File { data, .. } => *data = bytes.to_vec(),
                Node::Dir { .. } => return Err(SimError::NotADirectory(path.into())),
            },
            None => {
                self.nodes.push(Node::File { data: bytes.to_vec(), durable: Vec::new() });
                let ino = self.nodes.len() - 1;
                self.entries(dir).insert(name.into(), ino);
            }
        }
        Ok(())
    }

    /// fsync: make a file's bytes, or a directory's entries, durable. `""` is the root.
    pub fn sync(&mut self, path: &str) -> Result<(), SimError> {
        self.op(format!("sync {}", if path.is_empty() { "/" } else { path }))?;
        let ino = self.lookup(path).ok_or_else(|| SimError::NotFound(path.into()))?;
        match &mut self.nodes[ino] {
            Node::File { data, durable } => *durable = data.clone(),
            Node::Dir { entries, durable } => *durable = entries.clone(),
        }
        Ok(())
    }

    /// Rename `from` to `to` (atomic; replaces a file at `to`, or an empty directory).
    pub fn rename(&mut self, from: &str, to: &str) -> Result<(), SimError> {
        self.op(format!("rename {from} -> {to}"))?;
        let (fd, fname) = self.parent(from)?;
        let (td, tname) = self.parent(to)?;
        let ino = *self.entries(fd).get(fname).ok_or_else(|| SimError::NotFound(from.into()))?;
        if to.strip_prefix(from).is_some_and(|rest| rest.starts_with('/')) {
            return Err(SimError::NotFound(format!("{to} (inside {from}, which is being moved)")));
        }
        if let Some(&old) = self.entries(td).get(tname) {
            let replaceable = match (&self.nodes[ino], &self.nodes[old]) {
                (Node::File { .. }, Node::File { .. }) => true,
                (Node::Dir { .. }, Node::Dir { entries, .. }) => entries.is_empty(),
                _ => false,
            };
            if !replaceable {
                return Err(match (&self.nodes[ino], &self.nodes[old]) {
                    (Node::File { .. }, Node::Dir { .. }) | (Node::Dir { .. }, Node::File { .. }) => {
                        SimError::NotADirectory(to.into())
                    }
                    _ => SimError::Exists(to.into()),
                });
            }
        }
        self.entries(fd).remove(fname);
        self.entries(td).insert(tname.into(), ino);
        Ok(())
    }

    /// Remove `path` and everything under it (`rm -rf`); a missing `path` is not an error. One
    /// operation: the entry goes from its directory (durable once that directory is synced).
    pub fn remove_all(&mut self, path: &str) -> Result<(), SimError> {
        self.op(format!("remove_all {path}"))?;
        match self.parent(path) {
            Ok((dir, name)) => {
                self.entries(dir).remove(name);
                Ok(())
            }
            Err(SimError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Whether `path` exists (not an operation: free, and works while the power is off).
    pub fn exists(&self, path: &str) -> bool {
        self.lookup(path).is_some()
    }

    /// A file's current bytes (free).
    pub fn read(&self, path: &str) -> Option<Vec<u8>> {
        match &self.nodes[self.lookup(path)?] {
            Node::File { data, .. } => Some(data.clone()),
            Node::Dir { .. } => None,
        }
    }

    /// A directory's entry names, sorted (free; empty if it is not a directory).
    pub fn list(&self, dir: &str) -> Vec<String> {
        match self.lookup(dir).map(|i| &self.nodes[i]) {
            Some(Node::Dir { entries, .. }) => entries.keys().cloned().collect(),
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_synced_bytes_and_entries_survive() {
        let mut d = SimDisk::new();
        d.create_dir("c").unwrap();
        d.write("c/f", b"abcdefgh").unwrap();
        d.sync("c/f").unwrap();
        d.sync("c").unwrap();
        d.sync("").unwrap();
        d.write("c/f", b"ABCDEFGH").unwrap(); // overwritten in place, not synced
        d.write("c/g", b"new").unwrap(); // created, directory not synced
        d.power_loss();
        d.reboot();
        assert_eq!(d.read("c/f").unwrap(), b"ABCD", "an unsynced overwrite comes back torn");
        assert!(!d.exists("c/g"), "an entry the directory never synced is lost");
        // A rename is durable only once its directory is synced.
        d.write("c/h", b"x").unwrap();
        d.sync("c/h").unwrap();
        d.sync("c").unwrap();
        d.rename("c/h", "c/i").unwrap();
        d.power_loss();
        d.reboot();
        assert!(d.exists("c/h") && !d.exists("c/i"));
        // A crash at operation k: that operation does not happen, and nothing works until reboot.
        let k = d.ops();
        d.crash_at(k + 1);
        d.write("c/j", b"1").unwrap();
        assert_eq!(d.sync("c"), Err(SimError::PowerLoss));
        assert_eq!(d.write("c/k", b"1"), Err(SimError::PowerLoss));
        d.reboot();
        assert!(!d.exists("c/j"));
        assert_eq!(d.create_dir("c"), Err(SimError::Exists("c".into())));
        assert_eq!(d.write("nope/x", b""), Err(SimError::NotFound("nope".into())));
    }
}
