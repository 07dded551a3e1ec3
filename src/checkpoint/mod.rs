//! Distributed checkpoints (lesson 10): every rank writes only what it holds, a metadata file
//! says which rank holds which elements, a checkpoint is committed atomically, and it loads into
//! any strategy at any world size by reading only the byte ranges each rank needs.
//!
//! ```text
//! DIR/
//!   latest                    "step-00000200" — replaced atomically after each commit
//!   step-00000100/            a committed checkpoint
//!     metadata.json           written last: format version, step, every tensor's pieces, files, job state
//!     rank-00000.safetensors  rank 0's pieces (f32: parameters and AdamW's two moments)
//!     rank-00000.json         rank 0's index (merged into metadata.json)
//!     rank-00001.safetensors  …
//!   step-00000200.tmp/        being written; ignored by loads, removed by the next save
//! ```
//!
//! What is saved, per parameter: the f32 master values and AdamW's `exp_avg`/`exp_avg_sq`, as
//! *pieces* — flat element ranges of the parameter. A ZeRO rank writes the pieces inside its
//! shards; replicated strategies (every rank holds everything) split each tensor into N balanced
//! ranges and rank r writes the r-th, so the bytes are written once, by all ranks in parallel.
//! Loading plans, per wanted range, the reads from the saved pieces ([`plan::plan_reads`]):
//! resharding N → M and between strategies is interval arithmetic.
//!
//! Any layout, DCP's model: what a rank holds is described by a [`Holder`] — slots of values the
//! optimizer steps, each made of pieces of the model's tensors, a piece a flat range of a *box*
//! of its tensor ([`plan::Region`]; the whole tensor unless tensor parallelism split it). The
//! data-parallel strategies are holders of whole tensors; the engine ([`crate::engine::Engine`])
//! of tensor- and pipeline-parallel pieces, sharded by ZeRO or replicated over the data
//! dimension. Of the copies of a value (DDP's replicas, a LayerNorm on every tensor-parallel
//! rank, the tied embedding on two stages) one rank writes it — the one that counts its gradient
//! in the global norm — and replicas over the data dimension split it between them. A checkpoint
//! saved by any holder loads into any other: the reads are the intersections of the boxes' runs
//! ([`plan::plan_region_reads`]).
//!
//! Commit (the scheme of PyTorch DCP and of every database): write into `step-N.tmp/`, fsync each
//! file, write `metadata.json` last and fsync it and the folder, rename the folder to `step-N`,
//! fsync the parent, then replace `latest` (write, fsync, rename). A crash anywhere leaves the
//! previous checkpoint as it was: a folder without `metadata.json`, or still named `.tmp`, is not
//! a checkpoint.

pub mod files;
pub mod plan;
pub mod sim;

mod consolidate;
mod folder;
mod holder;
mod load;
mod lock;
mod save;

pub use consolidate::{consolidate, read_tensor, Consolidated};
pub use folder::{committed, resolve, try_committed};
use folder::{fsync_dir, remove_checkpoint, seq_of, write_synced};
pub use holder::{HeldPiece, HeldSlot, Holder};
pub use load::load;
pub use lock::{lock_folder, unlock_folder, FolderRelease};
pub use save::save;
use std::ops::Range;

use crate::comm::{CommResult, ProcessGroup, ReduceOp};
use anyhow::{bail, ensure, Context};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::Tensor;

/// The metadata format this code writes (version 1, without boxes, it reads too).
pub const FORMAT_VERSION: u32 = 2;
const METADATA: &str = "metadata.json";
const LATEST: &str = "latest";

/// A checkpoint's `metadata.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Metadata {
    pub format_version: u32,
    /// Optimizer steps taken when it was saved.
    pub step: u64,
    /// Ranks that wrote it.
    pub world_size: usize,
    /// `param/NAME`, `exp_avg/NAME`, `exp_avg_sq/NAME` → shape and pieces.
    pub tensors: BTreeMap<String, TensorMeta>,
    /// Rank files → size and SHA-256.
    pub files: BTreeMap<String, FileMeta>,
    /// AdamW's step count per parameter (absent: no optimizer state was saved — before the first step).
    pub optimizer_steps: BTreeMap<String, u64>,
    /// The job's own state (configuration, LR schedule, loss scaler, data position, …).
    pub extra: serde_json::Value,
    /// The commit's sequence number in its folder: one more than any committed before it, so the
    /// newest commit is the highest whatever its step (a run resumed from an earlier step saves
    /// lower steps again) and whether or not `latest` was replaced after it. 0: written before
    /// sequence numbers.
    #[serde(default)]
    pub seq: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TensorMeta {
    pub shape: Vec<i64>,
    pub pieces: Vec<PieceMeta>,
}

/// Elements `lo..hi` of a tensor (flattened) — of the box `region` of it when there is one —
/// stored as `key` in `file`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PieceMeta {
    pub rank: usize,
    pub file: String,
    pub key: String,
    pub lo: i64,
    pub hi: i64,
    pub sha256: String,
    /// The box of the tensor the piece is a flat range of (absent: the whole tensor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<plan::Region>,
    /// The checksums of the piece's blocks ([`files::block_elems`]), in order: what a read of
    /// part of it checks (absent in checkpoints written before them: such reads go unchecked).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blocks: Vec<String>,
}

impl PieceMeta {
    /// The piece's runs of its tensor (`shape`) ([`plan::runs`]).
    pub fn runs(&self, shape: &[i64]) -> Vec<plan::Run> {
        let whole = plan::Region::whole(shape);
        plan::runs(shape, self.region.as_ref().unwrap_or(&whole), self.lo..self.hi)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FileMeta {
    pub bytes: u64,
    pub sha256: String,
    /// The file's header (its length and JSON), checked before a load believes it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub header_sha256: String,
}

/// What one rank wrote (its index file).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct RankIndex {
    rank: usize,
    file: String,
    meta: FileMeta,
    pieces: Vec<(String, Vec<i64>, PieceMeta)>,
    optimizer_steps: BTreeMap<String, u64>,
}

/// Options of [`save`](fn@save).
#[derive(Clone, Debug, Default)]
pub struct SaveOptions {
    /// Keep only the newest K committed checkpoints (older ones are removed after the commit).
    pub keep_last: Option<usize>,
    /// Testing: this rank's file write fails after this many bytes (a full disk).
    #[doc(hidden)]
    pub fail_after_bytes: Option<u64>,
}

/// What [`save`](fn@save) or [`load`](fn@load) did on this rank.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// The checkpoint folder.
    pub path: PathBuf,
    pub step: u64,
    /// Bytes this rank wrote or read.
    pub bytes: u64,
    pub seconds: f64,
    /// The job state saved with it.
    pub extra: serde_json::Value,
}

/// The name of step `step`'s folder.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Run `f` on this rank, then agree with every rank (over `groups`, which together span them):
/// if any rank failed, every rank returns an error (its own, or one saying which rank failed), so
/// that no rank goes on alone. `rank`: this rank's global index.
fn agree<T>(
    groups: &[&ProcessGroup],
    rank: usize,
    what: &str,
    f: impl FnOnce() -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    // A panic (a malformed file reaching an indexing bug) is this rank's error, not a hang of the others.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|p| Err(anyhow::anyhow!("panicked: {}", panic_text(&p))));
    let mut flag = Tensor::from_slice(&[if r.is_err() { rank as f64 + 1.0 } else { 0.0 }]);
    if let Err(e) = groups.iter().try_for_each(|g| g.all_reduce(&mut flag, ReduceOp::Max)) {
        let mine = r.err().map(|e| format!(" (and this rank failed: {e:#})")).unwrap_or_default();
        bail!("rank {rank}: {what}: the ranks could not agree: {e}{mine}");
    }
    let failed = flag.double_value(&[0]) as usize;
    match r {
        Err(e) => Err(e.context(format!("rank {rank}: {what}"))),
        Ok(_) if failed > 0 => {
            bail!("rank {rank}: {what}: rank {} failed (its error says why); nothing was changed", failed - 1)
        }
        Ok(v) => Ok(v),
    }
}

/// The same value on every rank (over `groups`), or an error naming the two extremes.
fn same_everywhere(groups: &[&ProcessGroup], values: &[f64]) -> CommResult<Option<(Vec<f64>, Vec<f64>)>> {
    let mut t = Tensor::from_slice(&values.iter().flat_map(|&v| [v, -v]).collect::<Vec<f64>>());
    groups.iter().try_for_each(|g| g.all_reduce(&mut t, ReduceOp::Max))?;
    let v: Vec<f64> = Vec::<f64>::try_from(&t)
        .map_err(|e| crate::comm::CommError::Protocol(format!("reading back an agreement: {e}")))?;
    let (hi, lo): (Vec<f64>, Vec<f64>) = v.chunks(2).map(|c| (c[0], -c[1])).unzip();
    Ok((hi != lo).then_some((hi, lo)))
}

/// A holder's slot against itself: its pieces inside its master and each other, each one's range
/// inside its box, the box inside its tensor — a holder that mislabels what it holds is an error,
/// not a checkpoint with holes or a load that leaves values untouched.
fn check_slot(s: usize, slot: &HeldSlot, tensors: &[(String, Vec<i64>)]) -> anyhow::Result<()> {
    let numel = slot.master.numel() as i64;
    let mut at: Vec<Range<i64>> = Vec::new();
    for p in &slot.pieces {
        let (name, shape) =
            tensors.get(p.tensor).with_context(|| format!("slot {s}: tensor {} of {}", p.tensor, tensors.len()))?;
        p.region.check(shape).map_err(|e| anyhow::anyhow!("slot {s}: {name}: {e}"))?;
        ensure!(
            0 <= p.within.start
                && p.within.start <= p.within.end
                && p.within.end <= p.region.numel()
                && p.at.end - p.at.start == p.within.end - p.within.start
                && 0 <= p.at.start
                && p.at.end <= numel,
            "slot {s}: {name}: elements {:?} of its box ({}) at {:?} of the slot ({numel})",
            p.within,
            p.region.numel(),
            p.at
        );
        at.push(p.at.clone());
    }
    at.sort_by_key(|r| r.start);
    if let Some(w) = at.windows(2).find(|w| w[0].end > w[1].start) {
        bail!("slot {s}: two pieces hold its elements {}..{}", w[1].start, w[0].end.min(w[1].end));
    }
    Ok(())
}

/// The reader of rank file `file` of checkpoint `dir`, opened on first use (its size checked
/// against the metadata).
fn open_reader<'a>(
    readers: &'a mut BTreeMap<String, files::Reader>,
    meta: &Metadata,
    dir: &Path,
    file: &str,
) -> anyhow::Result<&'a mut files::Reader> {
    let f = meta.files.get(file).with_context(|| format!("{file} is not listed in the metadata"))?;
    if !readers.contains_key(file) {
        readers.insert(file.to_string(), files::Reader::open(&dir.join(file), f.bytes, &f.header_sha256)?);
    }
    Ok(readers.get_mut(file).expect("opened"))
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

/// Read and check a checkpoint's metadata.
pub fn read_metadata(dir: &Path) -> anyhow::Result<Metadata> {
    let p = dir.join(METADATA);
    let text = std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
    let v: serde_json::Value = serde_json::from_slice(&text).with_context(|| format!("{} is not JSON", p.display()))?;
    let version = v["format_version"].as_u64().with_context(|| format!("{}: no format_version", p.display()))?;
    ensure!(
        version == FORMAT_VERSION as u64 || version == 1,
        "{}: format version {version}; this shardlab reads versions 1 to {FORMAT_VERSION}",
        p.display()
    );
    let meta: Metadata = serde_json::from_value(v).with_context(|| format!("{}: malformed metadata", p.display()))?;
    // File names are joined to the folder: only this format's own names (no path from a crafted file).
    let rank_file = |f: &str| {
        f.strip_prefix("rank-")
            .and_then(|r| r.strip_suffix(".safetensors"))
            .is_some_and(|r| r.len() == 5 && r.bytes().all(|b| b.is_ascii_digit()))
    };
    for f in meta.files.keys().chain(meta.tensors.values().flat_map(|t| t.pieces.iter().map(|p| &p.file))) {
        ensure!(rank_file(f), "{}: {f:?} is not a rank file name (rank-NNNNN.safetensors)", p.display());
    }
    // Every piece inside its tensor (a box inside the shape, a range inside the box).
    for (name, t) in &meta.tensors {
        for piece in &t.pieces {
            let whole = plan::Region::whole(&t.shape);
            let region = piece.region.as_ref().unwrap_or(&whole);
            region.check(&t.shape).map_err(|e| anyhow::anyhow!("{}: {name}: {e}", p.display()))?;
            ensure!(
                0 <= piece.lo && piece.lo <= piece.hi && piece.hi <= region.numel(),
                "{}: {name}: elements {}..{} of a box of {}",
                p.display(),
                piece.lo,
                piece.hi,
                region.numel()
            );
        }
    }
    Ok(meta)
}
