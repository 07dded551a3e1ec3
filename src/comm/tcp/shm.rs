//! The same-host data path: shared-memory rings between process ranks on one machine, as NCCL's
//! SHM transport does within a node (TCP stays the path between machines, and the control
//! connections stay TCP everywhere).
//!
//! Each rank creates one segment in `/dev/shm` (mode 0600, published in the authenticated store
//! and unlinked once the group is up). Its name, `shardlab-<pid namespace>-<pid>-<random>-<rank>`,
//! says who made it: a process killed before its group formed leaves its segment behind, and the
//! next group formed on the machine removes the segments whose maker is dead (`shm_names.rs`).
//! It holds the rank's *doorbell* and one inbound ring per peer (none for itself):
//!
//! ```text
//! [ header | doorbell | sleepers | epoch | op slots | ring from rank 0: head · tail · data | …
//!   | exchange buffer 0 | exchange buffer 1 ]
//! ```
//!
//! The rings carry frames (point-to-point messages, and the frame algorithms when asked for).
//! The two exchange buffers serve the `direct` collectives (see `direct.rs`): a rank copies its
//! part in, raises its epoch, and every rank reads its peers' parts straight out of their
//! buffers — one copy per byte that moves, instead of two through a ring or a socket.
//!
//! A ring is a single-producer single-consumer byte stream — the same frames as on a socket.
//! The writer copies into `data` at `tail` and publishes with a release store of `tail`; the
//! reader copies out from `head` and publishes `head`. One copy in, one copy out, no kernel on
//! the data path. After either, it rings the other side's doorbell; a rank with nothing to do
//! sleeps on its own doorbell with futex(2), so waiting ranks leave the (two) cores to the
//! ranks that compute. A peer's death is seen on its TCP control connection, which the engine
//! checks whenever it wakes.
//!
//! Limit: every byte is copied twice through memory (writer → ring → reader), so a ring step
//! runs at about half the machine's memcpy bandwidth per direction, shared by all ranks.

use super::super::error::{CommError, CommResult};
use std::io::IoSlice;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const MAGIC: u64 = 0x314d_4853_424c_4853; // "SHLBSHM1"
/// Cache-line padding (two lines: adjacent-line prefetch would otherwise share them).
const LINE: usize = 128;
const HEADER: usize = 8 * LINE;
/// Offsets in the header.
const BELL: usize = LINE;
const SLEEPERS: usize = 2 * LINE;
const EPOCH: usize = 3 * LINE;
const OP_SLOTS: usize = 4 * LINE;
/// Ring bytes per peer (`SHARDLAB_SHM_RING` overrides): two 1 MiB frames in flight.
const RING: usize = 2 << 20;

/// One rank's mapped segment (its own, or a peer's).
pub(super) struct Segment {
    base: *mut u8,
    /// The rank that made it (its rings are from the others).
    rank: usize,
    len: usize,
    ring: usize,
    exchange: usize,
    path: PathBuf,
    owner: bool,
}

// The mapping is shared memory accessed through atomics and raw copies only.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

fn io_err(what: &str, path: &Path) -> CommError {
    CommError::Io(format!("shared memory {what} {}: {}", path.display(), std::io::Error::last_os_error()))
}

impl Segment {
    fn size(world: usize, ring: usize, exchange: usize) -> usize {
        HEADER + world.saturating_sub(1) * (2 * LINE + ring) + 2 * exchange
    }

    /// Create rank `rank`'s segment in `dir` (unlinked again on drop).
    pub fn create(dir: &Path, tag: &str, rank: usize, world: usize, exchange: usize) -> CommResult<Segment> {
        let ring = std::env::var("SHARDLAB_SHM_RING")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|r| r.is_power_of_two() && *r >= 4096)
            .unwrap_or(RING);
        let exchange = exchange.next_multiple_of(LINE);
        let path = dir.join(format!("{}{}-{tag}-{rank}", super::shm_names::own_prefix(), std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| CommError::Io(format!("cannot create {}: {e}", path.display())))?;
        let len = Self::size(world, ring, exchange);
        // tmpfs allocates pages when they are first touched: unused rings cost nothing.
        // Reserve the pages now: tmpfs files are sparse, and a page that cannot be had when a copy
        // first touches it is a SIGBUS, not an error (containers often give /dev/shm 64 MiB).
        let err = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len as libc::off_t) };
        if err != 0 {
            let _ = std::fs::remove_file(&path);
            return Err(CommError::Io(format!(
                "cannot reserve {} MiB in {}: {} (too little room in {}? e.g. docker run --shm-size)",
                len >> 20,
                path.display(),
                std::io::Error::from_raw_os_error(err),
                dir.display()
            )));
        }
        let seg = Self::map(&f, len, ring, exchange, rank, path.clone(), true).inspect_err(|_| {
            let _ = std::fs::remove_file(&path);
        })?;
        unsafe {
            (seg.base as *mut u64).write_volatile(MAGIC);
            (seg.base.add(8) as *mut u64).write_volatile(world as u64);
            (seg.base.add(16) as *mut u64).write_volatile(ring as u64);
            (seg.base.add(24) as *mut u64).write_volatile(exchange as u64);
            (seg.base.add(32) as *mut u64).write_volatile(rank as u64);
        }
        Ok(seg)
    }

    /// Map rank `rank`'s segment and check that it is one, its, for this world.
    pub fn open(path: &Path, rank: usize, world: usize) -> CommResult<Segment> {
        // Only a regular file of ours, made by a rank (not a link, not another user's file).
        let named = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("shardlab-"));
        if !named || path.parent() != Some(Path::new("/dev/shm")) {
            return Err(CommError::Protocol(format!("{} is not a shardlab segment path", path.display())));
        }
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(|e| CommError::Io(format!("cannot open {}: {e}", path.display())))?;
        let meta = f.metadata().map_err(|e| CommError::io("stat shared memory", e))?;
        {
            use std::os::unix::fs::MetadataExt;
            if !meta.is_file() || meta.uid() != unsafe { libc::geteuid() } || meta.mode() & 0o077 != 0 {
                return Err(CommError::Protocol(format!(
                    "{} is not a private file of this user (a shardlab segment is mode 0600)",
                    path.display()
                )));
            }
        }
        let flen = meta.len() as usize;
        if flen < HEADER {
            return Err(CommError::Protocol(format!("{} is not a shardlab segment", path.display())));
        }
        let head = Self::map(&f, HEADER, 0, 0, rank, path.to_path_buf(), false)?;
        let (magic, w, ring, exchange) = (head.word(0), head.word(8), head.word(16) as usize, head.word(24) as usize);
        let owner = head.word(32);
        drop(head);
        let sizes_ok = ring.is_power_of_two()
            && ring < (1 << 40)
            && exchange < (1 << 40)
            && world < (1 << 20)
            && flen == Self::size(world, ring, exchange);
        if magic != MAGIC || w != world as u64 || owner != rank as u64 || !sizes_ok {
            return Err(CommError::Protocol(format!(
                "{} is not rank {rank}'s shardlab segment for this world",
                path.display()
            )));
        }
        Self::map(&f, flen, ring, exchange, rank, path.to_path_buf(), false)
    }

    fn map(
        f: &std::fs::File,
        len: usize,
        ring: usize,
        exchange: usize,
        rank: usize,
        path: PathBuf,
        owner: bool,
    ) -> CommResult<Segment> {
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io_err("mmap", &path));
        }
        Ok(Segment { base: p as *mut u8, rank, len, ring, exchange, path, owner })
    }

    fn word(&self, off: usize) -> u64 {
        unsafe { (self.base.add(off) as *const u64).read_volatile() }
    }
    fn atomic32(&self, off: usize) -> &AtomicU32 {
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }
    fn atomic64(&self, off: usize) -> &AtomicU64 {
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }
    /// The ring from rank `p` (≠ the owner): the others' rings in rank order.
    fn slot(&self, p: usize) -> usize {
        assert_ne!(p, self.rank, "no ring from a rank to itself");
        HEADER + (p - (p > self.rank) as usize) * (2 * LINE + self.ring)
    }
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Remove the name (mappings stay valid): called once every peer has mapped it.
    pub fn unlink(&self) {
        let _ = std::fs::remove_file(&self.path);
    }

    fn bell(&self) -> &AtomicU32 {
        self.atomic32(BELL)
    }
    fn sleepers(&self) -> &AtomicU32 {
        self.atomic32(SLEEPERS)
    }
    /// How many exchange steps this rank has published (release store after its data).
    pub fn epoch(&self) -> &AtomicU64 {
        self.atomic64(EPOCH)
    }
    /// The op description this rank published with epoch `e` (two slots, alternating: a peer
    /// can be at most one epoch ahead of a rank still reading).
    pub fn op_slot(&self, e: u64) -> *mut u8 {
        unsafe { self.base.add(OP_SLOTS + (e % 2) as usize * 64) }
    }
    /// Bytes of one exchange buffer.
    pub fn exchange_len(&self) -> usize {
        self.exchange
    }
    /// Exchange buffer `i` (0 or 1).
    pub fn exchange_buf(&self, i: u64) -> *mut u8 {
        unsafe { self.base.add(self.len - (2 - (i % 2) as usize) * self.exchange) }
    }
    /// The doorbell's value: read it *before* looking for work, then [`wait`](Self::wait) on it.
    pub fn bell_value(&self) -> u32 {
        self.bell().load(Ordering::SeqCst)
    }
    /// Sleep until the doorbell rings after `seen` (or `timeout`).
    pub fn wait(&self, seen: u32, timeout: Duration) {
        self.sleepers().fetch_add(1, Ordering::SeqCst);
        if self.bell().load(Ordering::SeqCst) == seen {
            let ts = libc::timespec { tv_sec: timeout.as_secs() as _, tv_nsec: timeout.subsec_nanos() as _ };
            // A shared (not PRIVATE) futex: the waker is another process.
            unsafe {
                libc::syscall(libc::SYS_futex, self.bell().as_ptr(), libc::FUTEX_WAIT, seen, &ts as *const _, 0, 0)
            };
        }
        self.sleepers().fetch_sub(1, Ordering::SeqCst);
    }
    /// Tell the owner something changed (data arrived, or room was made).
    pub fn ring_bell(&self) {
        self.bell().fetch_add(1, Ordering::SeqCst);
        if self.sleepers().load(Ordering::SeqCst) > 0 {
            unsafe { libc::syscall(libc::SYS_futex, self.bell().as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0, 0, 0) };
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
        if self.owner {
            self.unlink();
        }
    }
}

use std::os::unix::fs::OpenOptionsExt;

/// The shared-memory data link between this rank and one peer on the same machine: we write
/// into the ring for us in the peer's segment and read the ring for the peer in ours.
pub(super) struct ShmLink {
    me: usize,
    peer: usize,
    mine: Arc<Segment>,
    theirs: Arc<Segment>,
}

impl ShmLink {
    pub fn new(me: usize, peer: usize, mine: Arc<Segment>, theirs: Arc<Segment>) -> Self {
        ShmLink { me, peer, mine, theirs }
    }

    /// (head, tail) of the ring at `slot` of `seg`, checked: a peer cannot make us read or
    /// write outside the ring.
    fn positions(seg: &Segment, slot: usize) -> std::io::Result<(u64, u64)> {
        let head = seg.atomic64(slot).load(Ordering::Acquire);
        let tail = seg.atomic64(slot + LINE).load(Ordering::Acquire);
        if tail.wrapping_sub(head) > seg.ring as u64 {
            return Err(std::io::Error::other("shared-memory ring positions are corrupt"));
        }
        Ok((head, tail))
    }

    /// Wake the peer if it sleeps on its doorbell (it then looks at its control connections).
    pub fn wake_peer(&self) {
        self.theirs.ring_bell();
    }

    /// Free bytes in the peer's ring for us.
    pub fn room(&self) -> usize {
        let seg = &*self.theirs;
        Self::positions(seg, seg.slot(self.me)).map_or(0, |(h, t)| seg.ring - (t - h) as usize)
    }

    /// Copy as much of `bufs` as fits into the peer's ring; `WouldBlock` when it is full.
    pub fn write_vectored(&self, bufs: &[IoSlice]) -> std::io::Result<usize> {
        let seg = &*self.theirs;
        let slot = seg.slot(self.me);
        let (head, tail) = Self::positions(seg, slot)?;
        let free = seg.ring - (tail - head) as usize;
        if free == 0 {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        let data = unsafe { seg.base.add(slot + 2 * LINE) };
        let mut at = tail;
        for b in bufs {
            let k = b.len().min(free - (at - tail) as usize);
            copy_ring(data, seg.ring, at, b.as_ptr(), k, true);
            at += k as u64;
        }
        if at == tail {
            return Ok(0);
        }
        seg.atomic64(slot + LINE).store(at, Ordering::Release);
        seg.ring_bell();
        Ok((at - tail) as usize)
    }

    /// Copy what has arrived (up to `buf.len()`) out of our ring for this peer; `WouldBlock`
    /// when it is empty. With `consume: false` the bytes stay (a peek).
    pub fn read(&self, buf: &mut [u8], consume: bool) -> std::io::Result<usize> {
        let seg = &*self.mine;
        let slot = seg.slot(self.peer);
        let (head, tail) = Self::positions(seg, slot)?;
        let k = ((tail - head) as usize).min(buf.len());
        if k == 0 {
            return if buf.is_empty() { Ok(0) } else { Err(std::io::ErrorKind::WouldBlock.into()) };
        }
        let data = unsafe { seg.base.add(slot + 2 * LINE) };
        copy_ring(data, seg.ring, head, buf.as_mut_ptr(), k, false);
        if consume {
            seg.atomic64(slot).store(head + k as u64, Ordering::Release);
            self.theirs.ring_bell(); // the writer may be waiting for room
        }
        Ok(k)
    }
}

/// Copy `k` bytes between `other` and the ring at stream position `at` (wrapping at `ring`).
fn copy_ring(data: *mut u8, ring: usize, at: u64, other: *const u8, k: usize, into_ring: bool) {
    let off = (at % ring as u64) as usize;
    let first = k.min(ring - off);
    unsafe {
        if into_ring {
            std::ptr::copy_nonoverlapping(other, data.add(off), first);
            std::ptr::copy_nonoverlapping(other.add(first), data, k - first);
        } else {
            std::ptr::copy_nonoverlapping(data.add(off), other as *mut u8, first);
            std::ptr::copy_nonoverlapping(data, (other as *mut u8).add(first), k - first);
        }
    }
}

/// What identifies this machine: ranks with the same id can share memory.
/// Containers on one host with host networking share the boot id and the host name but not
/// always `/dev/shm`: its device and inode are part of the id.
pub(super) fn host_id() -> String {
    use std::os::unix::fs::MetadataExt;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let mut name = [0u8; 256];
    unsafe { libc::gethostname(name.as_mut_ptr() as *mut libc::c_char, name.len()) };
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    let shm = std::fs::metadata("/dev/shm").map(|m| format!("{}:{}", m.dev(), m.ino())).unwrap_or_default();
    format!("{}/{}/{shm}", boot.trim(), String::from_utf8_lossy(&name[..end]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// A segment holds rings from the other ranks only: world − 1 of them, and the pages are
    /// reserved (measured by the file system's allocated blocks, not by our own size formula).
    #[test]
    fn a_segment_reserves_a_ring_per_peer_not_for_itself() {
        let seg = Segment::create(Path::new("/dev/shm"), "test-ring", 2, 4, 1 << 16).unwrap();
        let held = std::fs::metadata(seg.path()).unwrap().blocks() * 512;
        let ring = RING as u64;
        assert!(held >= 3 * ring && held < 4 * ring, "{held} bytes reserved for 3 rings of {ring}");
        // The peers' rings do not overlap and stay inside the segment.
        let slots: Vec<usize> = [0, 1, 3].iter().map(|&p| seg.slot(p)).collect();
        assert!(slots.windows(2).all(|w| w[1] - w[0] == 2 * LINE + RING), "{slots:?}");
        assert!(slots[2] + 2 * LINE + RING <= seg.len - 2 * seg.exchange);
        let other = Segment::open(seg.path(), 2, 4).unwrap();
        assert_eq!(other.slot(3), seg.slot(3));
        let e = Segment::open(seg.path(), 1, 4).err().expect("another rank's claim is refused");
        assert!(e.to_string().contains("rank 1's"), "{e}");
    }
}
