//! A disk that can lose power (lesson 10): an in-memory file system with the durability rules
//! of POSIX, for testing a commit protocol against a crash after every single operation.
//!
//! What survives a power loss, the pessimistic way real disks are allowed to behave:
//! - a file's bytes survive only once the file was `sync`ed (fsync) after its last write; a file
//!   written but not synced comes back **torn** — the first half of what was written;
//! - a directory's entries (files created, renamed or removed in it) are durable only once the
//!   directory itself was `sync`ed. A name changed since may come back as it was at that sync or
//!   as it is now, each name independently of the others (POSIX does not order them): by
//!   default every such change is lost (an entry added comes back missing, one removed comes
//!   back, a rename is undone); [`SimDisk::keep_on_power_loss`] keeps any subset of them, so
//!   that a test can try every order in which they might have reached the disk. The two names
//!   of one rename go together (a rename is atomic; syncing either folder of a rename between
//!   two folders makes both halves durable, as a journaling file system does).
//!
//! Simplifications, so that a test knows what it has not tried: a name changed twice since its
//! folder's sync comes back as it was or as it is, never as it was in between; `remove_all` takes
//! a folder's entry away in one operation (a real `rm -rf` unlinks file by file, and a crash can
//! leave part of the folder).
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
//!
//! Two renames in one folder with no sync of it between them may reach the disk in either order:
//! ```text
//! d.rename("x.tmp", "x"); d.rename("y.tmp", "y")
//! d.unsynced()              // [["x", "x.tmp"], ["y", "y.tmp"]]: two changes, pending
//! d.keep_on_power_loss(0b10); d.power_loss()   // "y" was renamed, "x" was not
//! ```

use std::collections::{BTreeMap, BTreeSet};
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
    /// The (directory inode, name) pairs each rename since the disk was made tied together.
    renames: Vec<[(usize, String); 2]>,
    /// Bit i keeps group i of [`SimDisk::unsynced`] at the next power loss.
    keep: u64,
    /// What the last power loss chose between: each group's paths, and whether it was kept.
    last_loss: Vec<(Vec<String>, bool)>,
}

impl Default for SimDisk {
    fn default() -> Self {
        Self::new()
    }
}

fn split(path: &str) -> (&str, &str) {
    path.rsplit_once('/').unwrap_or(("", path))
}

/// `name`'s path in directory inode `dir` (an unlinked directory shows as `<dir #ino>`).
fn join(paths: &BTreeMap<usize, String>, dir: usize, name: &str) -> String {
    match paths.get(&dir).map(String::as_str) {
        Some("") => name.to_string(),
        Some(p) => format!("{p}/{name}"),
        None => format!("<dir #{dir}>/{name}"),
    }
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
            renames: Vec::new(),
            keep: 0,
            last_loss: Vec::new(),
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

    /// Which of the directory changes not yet made durable the next power loss keeps: bit `i`
    /// keeps group `i` of [`SimDisk::unsynced`] as it is at that moment (0, the default, keeps
    /// none). Bits past the last group are ignored.
    pub fn keep_on_power_loss(&mut self, mask: u64) {
        self.keep = mask;
    }

    /// The directory changes a power loss now may keep or lose: the names whose entry differs
    /// from their folder's last sync, as paths, grouped so that a rename's two names go together,
    /// in a fixed order (a group's index is its bit in [`SimDisk::keep_on_power_loss`]). Free.
    pub fn unsynced(&self) -> Vec<Vec<String>> {
        let paths = self.paths();
        self.groups().into_iter().map(|g| g.iter().map(|(d, n)| join(&paths, *d, n)).collect()).collect()
    }

    /// The groups the last power loss chose between (see [`SimDisk::unsynced`]), each with
    /// whether it was kept: for a test's message.
    pub fn last_loss(&self) -> &[(Vec<String>, bool)] {
        &self.last_loss
    }

    /// Changed (directory, name) pairs, grouped by the renames that tie them.
    /// Folders no link reaches, now or durably, are left out: nothing in them can be seen.
    fn groups(&self) -> Vec<Vec<(usize, String)>> {
        let linked = self.paths();
        let mut changed = BTreeSet::new();
        for &d in linked.keys() {
            if let Node::Dir { entries, durable } = &self.nodes[d] {
                for name in entries.keys().chain(durable.keys()) {
                    if entries.get(name) != durable.get(name) {
                        changed.insert((d, name.clone()));
                    }
                }
            }
        }
        // Union-find over every name a rename touched, so that a → b → c ties a to c.
        let mut up: BTreeMap<(usize, String), (usize, String)> = BTreeMap::new();
        fn root(up: &BTreeMap<(usize, String), (usize, String)>, mut k: (usize, String)) -> (usize, String) {
            while let Some(p) = up.get(&k) {
                k = p.clone();
            }
            k
        }
        for [a, b] in &self.renames {
            let (ra, rb) = (root(&up, a.clone()), root(&up, b.clone()));
            if ra != rb {
                up.insert(ra, rb);
            }
        }
        let mut groups: BTreeMap<(usize, String), Vec<(usize, String)>> = BTreeMap::new();
        let mut order = Vec::new();
        for k in changed {
            let r = root(&up, k.clone());
            if !groups.contains_key(&r) {
                order.push(r.clone());
            }
            groups.entry(r).or_default().push(k);
        }
        order.into_iter().map(|r| groups.remove(&r).unwrap_or_default()).collect()
    }

    /// The path of every directory linked now or durably (a power loss may bring it back), by
    /// inode; the root is `""`.
    fn paths(&self) -> BTreeMap<usize, String> {
        let mut paths = BTreeMap::from([(0, String::new())]);
        let mut todo = vec![0];
        while let Some(d) = todo.pop() {
            if let Node::Dir { entries, durable } = &self.nodes[d] {
                for (name, &ino) in entries.iter().chain(durable.iter()) {
                    if matches!(self.nodes[ino], Node::Dir { .. }) && !paths.contains_key(&ino) {
                        paths.insert(ino, join(&paths, d, name));
                        todo.push(ino);
                    }
                }
            }
        }
        paths
    }

    /// Lose the power now: only what was made durable survives, plus the directory changes that
    /// [`SimDisk::keep_on_power_loss`] keeps (module docs).
    pub fn power_loss(&mut self) {
        let paths = self.paths();
        self.last_loss.clear();
        for (i, group) in self.groups().into_iter().enumerate() {
            let kept = i < 64 && self.keep >> i & 1 == 1;
            self.last_loss.push((group.iter().map(|(d, n)| join(&paths, *d, n)).collect(), kept));
            for (d, name) in group.into_iter().filter(|_| kept) {
                if let Node::Dir { entries, durable } = &mut self.nodes[d] {
                    match entries.get(&name) {
                        Some(&ino) => durable.insert(name, ino),
                        None => durable.remove(&name),
                    };
                }
            }
        }
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
        // Every entry is now durable: no rename ties pending names, and the next loss keeps none.
        self.renames.clear();
        self.keep = 0;
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
        // A rename between two folders is one journal transaction: syncing either folder makes
        // both of its halves durable (else a file could end in neither folder, or in both).
        let other_halves: Vec<(usize, String)> = (self.renames.iter())
            .flat_map(|[a, b]| [(a, b), (b, a)])
            .filter(|(here, _)| here.0 == ino)
            .map(|(_, there)| there.clone())
            .collect();
        match &mut self.nodes[ino] {
            Node::File { data, durable } => *durable = data.clone(),
            Node::Dir { entries, durable } => *durable = entries.clone(),
        }
        for (d, name) in other_halves {
            if let Node::Dir { entries, durable } = &mut self.nodes[d] {
                match entries.get(&name) {
                    Some(&i) => durable.insert(name, i),
                    None => durable.remove(&name),
                };
            }
        }
        // A rename both of whose names are durable ties nothing any more.
        let pending = |n: &Node, name: &str| matches!(n, Node::Dir { entries, durable } if entries.get(name) != durable.get(name));
        let renames = std::mem::take(&mut self.renames);
        self.renames = renames
            .into_iter()
            .filter(|[a, b]| pending(&self.nodes[a.0], &a.1) || pending(&self.nodes[b.0], &b.1))
            .collect();
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
            match (&self.nodes[ino], &self.nodes[old]) {
                (Node::File { .. }, Node::File { .. }) => {}
                (Node::Dir { .. }, Node::Dir { entries, .. }) if entries.is_empty() => {}
                (Node::Dir { .. }, Node::Dir { .. }) => return Err(SimError::Exists(to.into())),
                _ => return Err(SimError::NotADirectory(to.into())),
            }
        }
        self.entries(fd).remove(fname);
        self.entries(td).insert(tname.into(), ino);
        self.renames.push([(fd, fname.to_string()), (td, tname.to_string())]);
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
