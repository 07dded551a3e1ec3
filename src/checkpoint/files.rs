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

/// What writing a rank file produced: its size, its checksum, and each tensor's checksum.
pub struct Written {
    pub bytes: u64,
    pub sha256: String,
    pub tensor_sha256: Vec<String>,
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
    put(&mut w, &(head.len() as u64).to_le_bytes(), &mut whole)?;
    put(&mut w, &head, &mut whole)?;
    let mut tensor_sha256 = Vec::with_capacity(tensors.len());
    for (key, t) in tensors {
        // A piece on a GPU is staged through host memory, one piece at a time.
        let t =
            if t.device() == tch::Device::Cpu { t.contiguous() } else { t.to_device(tch::Device::Cpu).contiguous() };
        let view = crate::comm::dtype::TensorBytes::of(&t, key).map_err(anyhow::Error::msg)?;
        tensor_sha256.push(sha256_hex(view.bytes()));
        put(&mut w, view.bytes(), &mut whole)?;
    }
    let file = w.inner.into_inner().map_err(|e| anyhow::anyhow!("writing {}: {}", path.display(), e.error()))?;
    file.sync_all().with_context(|| format!("fsync {}", path.display()))?;
    let bytes = file.metadata()?.len();
    Ok(Written { bytes, sha256: whole.finalize().iter().map(|b| format!("{b:02x}")).collect(), tensor_sha256 })
}

/// A rank file opened for ranged reads.
pub struct Reader {
    file: File,
    path: String,
    data_start: u64,
    entries: BTreeMap<String, (u64, u64)>,
    /// Bytes read from the file so far (header included).
    pub bytes_read: u64,
}

impl Reader {
    /// Open `path` and parse its header; `expect_bytes`: the size the metadata recorded (a shorter
    /// file is truncated, a longer one is not this checkpoint's).
    pub fn open(path: &Path, expect_bytes: u64) -> anyhow::Result<Self> {
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
        Ok(Reader { file, path: shown, data_start: 8 + n, entries, bytes_read: 8 + n })
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
