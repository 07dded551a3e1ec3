//! The rank files: safetensors written as a stream (header, then each tensor's bytes) with a
//! SHA-256 of the whole file and of every tensor, and read back by element ranges — a loading
//! rank seeks to the bytes it needs and reads nothing else.
//!
//! safetensors: an 8-byte little-endian header length, a JSON header
//! `{key: {"dtype": "F32", "shape": [n], "data_offsets": [begin, end]}}` (offsets relative to the
//! end of the header), then the data. PyTorch's `safetensors.torch.load_file` reads these files.

use anyhow::{bail, ensure, Context};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use tch::{Kind, Tensor};

/// Hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Each tensor of a rank file is checksummed in up to this many blocks (of at least
/// [`MIN_BLOCK_ELEMS`] elements): a read of part of it (resharding) reads and checks the blocks
/// it touches — for one range, at most two blocks more than it needs (1/8 of the tensor, or two
/// 64-element blocks); the rows of a box may touch every block.
pub const BLOCKS: i64 = 16;
/// The smallest block, in elements.
pub const MIN_BLOCK_ELEMS: i64 = 64;

/// The block size of a tensor of `numel` elements.
pub fn block_elems(numel: i64) -> i64 {
    ((numel + BLOCKS - 1) / BLOCKS).max(MIN_BLOCK_ELEMS)
}

/// The checksum of a block: the first 64 bits of its SHA-256, in hex (enough to catch corruption;
/// 16 characters a block in the metadata).
fn block_hash(bytes: &[u8]) -> String {
    sha256_hex(bytes)[..16].to_string()
}

/// What writing a rank file produced: its size, its checksum, its header's checksum, and each
/// tensor's checksum, whole and by blocks ([`block_elems`]).
pub struct Written {
    pub bytes: u64,
    pub sha256: String,
    pub header_sha256: String,
    pub tensor_sha256: Vec<String>,
    pub block_sha256: Vec<Vec<String>>,
}

/// A writer that fails once `limit` bytes have gone through it (a full disk, in tests).
struct Limited<W> {
    inner: W,
    left: Option<u64>,
}

impl<W: Write> Write for Limited<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(left) = self.left.as_mut() {
            if *left < buf.len() as u64 {
                return Err(std::io::Error::new(std::io::ErrorKind::StorageFull, "no space left on device (injected)"));
            }
            *left -= buf.len() as u64;
        }
        self.inner.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Write `tensors` (f32, contiguous, 1-D) as one safetensors file at `path`, fsynced.
/// `fail_after_bytes`: fail the write after that many bytes (testing a full disk).
pub fn write(path: &Path, tensors: &[(String, Tensor)], fail_after_bytes: Option<u64>) -> anyhow::Result<Written> {
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for (key, t) in tensors {
        ensure!(
            t.kind() == Kind::Float && t.dim() == 1,
            "{key}: the checkpoint writes 1-D f32 pieces, got {:?} {:?}",
            t.kind(),
            t.size()
        );
        let n = 4 * t.numel() as u64;
        header.insert(key.clone(), json!({"dtype": "F32", "shape": [t.numel()], "data_offsets": [offset, offset + n]}));
        offset += n;
    }
    let mut head = serde_json::to_vec(&Value::Object(header))?;
    while head.len() % 8 != 0 {
        head.push(b' ');
    }
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = Limited { inner: std::io::BufWriter::with_capacity(1 << 20, file), left: fail_after_bytes };
    let mut whole = Sha256::new();
    let put = |w: &mut Limited<_>, bytes: &[u8], whole: &mut Sha256| -> anyhow::Result<()> {
        whole.update(bytes);
        w.write_all(bytes).with_context(|| format!("writing {}", path.display()))
    };
    let len_bytes = (head.len() as u64).to_le_bytes();
    let header_sha256 = sha256_hex(&[&len_bytes[..], &head].concat());
    put(&mut w, &len_bytes, &mut whole)?;
    put(&mut w, &head, &mut whole)?;
    let mut tensor_sha256 = Vec::with_capacity(tensors.len());
    let mut block_sha256 = Vec::with_capacity(tensors.len());
    for (key, t) in tensors {
        // A piece on a GPU is staged through host memory, one piece at a time.
        let t =
            if t.device() == tch::Device::Cpu { t.contiguous() } else { t.to_device(tch::Device::Cpu).contiguous() };
        let view = crate::comm::dtype::TensorBytes::of(&t, key).map_err(anyhow::Error::msg)?;
        tensor_sha256.push(sha256_hex(view.bytes()));
        let block = 4 * block_elems(t.numel() as i64) as usize;
        block_sha256.push(view.bytes().chunks(block).map(block_hash).collect());
        put(&mut w, view.bytes(), &mut whole)?;
    }
    let file = w.inner.into_inner().map_err(|e| anyhow::anyhow!("writing {}: {}", path.display(), e.error()))?;
    file.sync_all().with_context(|| format!("fsync {}", path.display()))?;
    let bytes = file.metadata()?.len();
    let sha256 = whole.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(Written { bytes, sha256, header_sha256, tensor_sha256, block_sha256 })
}

/// A rank file opened for ranged reads.
pub struct Reader {
    file: File,
    path: String,
    data_start: u64,
    entries: BTreeMap<String, (u64, u64)>,
    /// Bytes read from the file so far (header included).
    pub bytes_read: u64,
    /// The last block [`read_blocks_checked`](Self::read_blocks_checked) checked: tensor, index,
    /// values.
    block: Option<(String, i64, Vec<f32>)>,
}

impl Reader {
    /// Open `path` and parse its header; `expect_bytes`: the size the metadata recorded (a shorter
    /// file is truncated, a longer one is not this checkpoint's); `header_sha256`: the header's
    /// recorded checksum, checked before the header is believed (empty: not recorded).
    pub fn open(path: &Path, expect_bytes: u64, header_sha256: &str) -> anyhow::Result<Self> {
        let shown = path.display().to_string();
        let mut file = File::open(path).with_context(|| format!("opening {shown} (a rank file of this checkpoint)"))?;
        let len = file.metadata()?.len();
        ensure!(
            len == expect_bytes,
            "{shown} has {len} bytes, the checkpoint's metadata says {expect_bytes}: {}",
            if len < expect_bytes { "the file is truncated" } else { "it is not the file this checkpoint wrote" }
        );
        let mut n = [0u8; 8];
        file.read_exact(&mut n).with_context(|| format!("{shown}: reading the header length"))?;
        let n = u64::from_le_bytes(n);
        ensure!(n <= len - 8, "{shown}: header length {n} is past the end of the file");
        let mut head = vec![0u8; n as usize];
        file.read_exact(&mut head)?;
        if !header_sha256.is_empty() {
            let got = sha256_hex(&[&n.to_le_bytes()[..], &head].concat());
            ensure!(
                got == header_sha256,
                "{shown}: its header does not match its checksum (sha256 {got}, the metadata says {header_sha256}): the file is corrupt"
            );
        }
        let header: BTreeMap<String, Value> =
            serde_json::from_slice(&head).with_context(|| format!("{shown}: the safetensors header is not JSON"))?;
        let mut entries = BTreeMap::new();
        for (k, v) in header {
            if k == "__metadata__" {
                continue;
            }
            ensure!(v["dtype"] == "F32", "{shown}: {k} is {} (this checkpoint stores f32)", v["dtype"]);
            let off = v["data_offsets"].as_array().context("data_offsets")?;
            let (b, e) = (off[0].as_u64().unwrap_or(0), off[1].as_u64().unwrap_or(0));
            ensure!(b <= e && 8 + n + e <= len, "{shown}: {k}'s bytes {b}..{e} are not inside the file");
            entries.insert(k, (b, e));
        }
        Ok(Reader { file, path: shown, data_start: 8 + n, entries, bytes_read: 8 + n, block: None })
    }

    /// Elements `src..src + len` of tensor `key`.
    pub fn read(&mut self, key: &str, src: i64, len: i64) -> anyhow::Result<Vec<f32>> {
        let mut v = vec![0f32; len.max(0) as usize];
        self.read_into(key, src, &mut v)?;
        Ok(v)
    }

    /// Elements `src..src + dst.len()` of `key` into `dst`, through a 1 MiB buffer (no copy of
    /// the whole range in memory).
    pub fn read_into(&mut self, key: &str, src: i64, dst: &mut [f32]) -> anyhow::Result<()> {
        let Some(&(b, e)) = self.entries.get(key) else { bail!("{}: no tensor {key} in this rank file", self.path) };
        let len = dst.len() as i64;
        let (lo, hi) = (b + 4 * src as u64, b + 4 * (src + len) as u64);
        ensure!(src >= 0 && hi <= e, "{}: elements {src}..{} are outside {key}", self.path, src + len);
        self.file.seek(SeekFrom::Start(self.data_start + lo))?;
        let mut buf = vec![0u8; (1 << 20).min(hi - lo) as usize];
        for out in dst.chunks_mut(buf.len().max(4) / 4) {
            let bytes = &mut buf[..4 * out.len()];
            self.file.read_exact(bytes).with_context(|| format!("reading {key} from {}", self.path))?;
            for (x, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        self.bytes_read += hi - lo;
        Ok(())
    }

    /// Elements `src..src + dst.len()` of `key` into `dst`, each block ([`block_elems`]) they
    /// touch read whole and checked against `blocks` (its recorded checksums, in order) — the
    /// last block checked is kept, so that many small reads of one block (a box's rows) read it
    /// once.
    pub fn read_blocks_checked(
        &mut self,
        key: &str,
        blocks: &[String],
        src: i64,
        dst: &mut [f32],
    ) -> anyhow::Result<()> {
        let n = self.numel(key).with_context(|| format!("{}: no tensor {key}", self.path))?;
        let end = src + dst.len() as i64;
        ensure!(src >= 0 && end <= n, "{}: elements {src}..{end} are outside {key}", self.path);
        let size = block_elems(n);
        let count = (n + size - 1) / size;
        ensure!(
            blocks.len() as i64 == count,
            "{}: {key} has {count} blocks, the metadata lists {} checksums",
            self.path,
            blocks.len()
        );
        let mut at = src;
        while at < end {
            let b = at / size;
            let lo = b * size;
            let hi = (lo + size).min(n);
            let fresh = !matches!(&self.block, Some((k, i, _)) if k == key && *i == b);
            if fresh {
                let mut vals = vec![0f32; (hi - lo) as usize];
                self.read_into(key, lo, &mut vals)?;
                let bytes: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
                let got = block_hash(&bytes);
                ensure!(
                    got == blocks[b as usize],
                    "{}: {key}'s elements {lo}..{hi} do not match their checksum (sha256 {got}, the metadata says {}): the file is corrupt",
                    self.path,
                    blocks[b as usize]
                );
                self.block = Some((key.to_string(), b, vals));
            }
            let (_, _, vals) = self.block.as_ref().expect("just read");
            let take = (hi.min(end) - at) as usize;
            let d = (at - src) as usize;
            dst[d..d + take].copy_from_slice(&vals[(at - lo) as usize..(at - lo) as usize + take]);
            at += take as i64;
        }
        Ok(())
    }

    /// The whole of tensor `key`, checked against its recorded SHA-256.
    pub fn read_checked(&mut self, key: &str, sha256: &str) -> anyhow::Result<Vec<f32>> {
        let n = self.numel(key).with_context(|| format!("{}: no tensor {key}", self.path))?;
        let mut v = vec![0f32; n as usize];
        self.read_checked_into(key, sha256, &mut v)?;
        Ok(v)
    }

    /// The whole of tensor `key`, 1 MiB of raw little-endian f32 bytes at a time, to `f`; checked
    /// against its recorded SHA-256 at the end (an error then means `f` saw corrupt bytes: the
    /// caller must throw away what it made of them).
    pub fn stream_checked(
        &mut self,
        key: &str,
        sha256: &str,
        mut f: impl FnMut(&[u8]) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let &(b, e) = self.entries.get(key).with_context(|| format!("{}: no tensor {key}", self.path))?;
        self.file.seek(SeekFrom::Start(self.data_start + b))?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; (1 << 20).min(e - b) as usize];
        let mut left = (e - b) as usize;
        while left > 0 {
            let bytes = &mut buf[..left.min(1 << 20)];
            self.file.read_exact(bytes).with_context(|| format!("reading {key} from {}", self.path))?;
            h.update(&*bytes);
            f(bytes)?;
            left -= bytes.len();
        }
        self.bytes_read += e - b;
        let got: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        ensure!(
            got == sha256,
            "{}: {key} does not match its checksum (sha256 {got}, the metadata says {sha256}): the file is corrupt",
            self.path
        );
        Ok(())
    }

    /// The whole of tensor `key` into `dst` (its length), checked against its recorded SHA-256 as
    /// it streams by. On a mismatch `dst` holds the corrupt values: the caller must fail.
    pub fn read_checked_into(&mut self, key: &str, sha256: &str, dst: &mut [f32]) -> anyhow::Result<()> {
        let n = self.numel(key).with_context(|| format!("{}: no tensor {key}", self.path))?;
        ensure!(dst.len() as i64 == n, "{}: {key} has {n} elements, not {}", self.path, dst.len());
        let mut at = 0;
        self.stream_checked(key, sha256, |bytes| {
            for (x, c) in dst[at..].iter_mut().zip(bytes.chunks_exact(4)) {
                *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            at += bytes.len() / 4;
            Ok(())
        })
    }

    /// Elements of `key` in the file.
    pub fn numel(&self, key: &str) -> Option<i64> {
        self.entries.get(key).map(|(b, e)| ((e - b) / 4) as i64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tensor of 16 blocks with one byte flipped in block 5: a read inside the first blocks
    /// passes, any read touching block 5 fails naming its elements, the unchecked read returns the
    /// flipped value silently — which is why partial reads check blocks. A changed header is
    /// refused at open.
    #[test]
    fn a_partial_read_checks_the_blocks_it_touches() {
        let dir = std::env::temp_dir().join(format!("shardlab-blocks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rank-00000.safetensors");
        let n = 16 * 1000;
        let size = block_elems(n);
        assert_eq!(size, 1000);
        let t = Tensor::arange(n, (Kind::Float, tch::Device::Cpu));
        let w = write(&path, &[("p".to_string(), t)], None).unwrap();
        assert_eq!(w.block_sha256[0].len(), 16);
        let mut bytes = std::fs::read(&path).unwrap();
        let at = bytes.len() - 4 * (n as usize - 5007); // element 5007, in block 5
        bytes[at + 2] ^= 0x01;
        std::fs::write(&path, &bytes).unwrap();
        let mut r = Reader::open(&path, bytes.len() as u64, &w.header_sha256).unwrap();
        let mut out = vec![0f32; 100];
        r.read_blocks_checked("p", &w.block_sha256[0], 5, &mut out).unwrap();
        assert_eq!(out[0], 5.0);
        let e = r.read_blocks_checked("p", &w.block_sha256[0], 4950, &mut out).unwrap_err();
        assert!(format!("{e}").contains("elements 5000..6000"), "{e}");
        r.read_into("p", 5007, &mut out[..1]).unwrap();
        assert_ne!(out[0], 5007.0, "unchecked, the flipped value comes back");
        r.read_blocks_checked("p", &w.block_sha256[0], n - 10, &mut out[..10]).unwrap();
        bytes[12] ^= 0x01;
        std::fs::write(&path, &bytes).unwrap();
        let e = Reader::open(&path, bytes.len() as u64, &w.header_sha256).err().expect("a changed header");
        assert!(format!("{e}").contains("header does not match"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
