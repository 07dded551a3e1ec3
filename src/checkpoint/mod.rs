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
//! Commit (the scheme of PyTorch DCP and of every database): write into `step-N.tmp/`, fsync each
//! file, write `metadata.json` last and fsync it and the folder, rename the folder to `step-N`,
//! fsync the parent, then replace `latest` (write, fsync, rename). A crash anywhere leaves the
//! previous checkpoint as it was: a folder without `metadata.json`, or still named `.tmp`, is not
//! a checkpoint.

pub mod files;
pub mod plan;
pub mod sim;

use crate::comm::{ProcessGroup, ReduceOp};
use crate::ddp::DataParallel;
use crate::optim::{AdamW, AdamWState};
use anyhow::{bail, ensure, Context};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use tch::Tensor;

/// The metadata format this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;
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
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TensorMeta {
    pub shape: Vec<i64>,
    pub pieces: Vec<PieceMeta>,
}

/// Elements `lo..hi` of a tensor (flattened), stored as `key` in `file`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PieceMeta {
    pub rank: usize,
    pub file: String,
    pub key: String,
    pub lo: i64,
    pub hi: i64,
    pub sha256: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FileMeta {
    pub bytes: u64,
    pub sha256: String,
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

/// Options of [`save`].
#[derive(Clone, Debug, Default)]
pub struct SaveOptions {
    /// Keep only the newest K committed checkpoints (older ones are removed after the commit).
    pub keep_last: Option<usize>,
    /// Testing: this rank's file write fails after this many bytes (a full disk).
    #[doc(hidden)]
    pub fail_after_bytes: Option<u64>,
}

/// What [`save`] or [`load`] did on this rank.
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

/// Run `f` on this rank, then agree with every rank: if any rank failed, every rank returns an
/// error (its own, or one saying which rank failed), so that no rank goes on alone.
fn agree<T>(pg: &ProcessGroup, what: &str, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    // A panic (a malformed file reaching an indexing bug) is this rank's error, not a hang of the others.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|p| Err(anyhow::anyhow!("panicked: {}", panic_text(&p))));
    let mut flag = Tensor::from_slice(&[if r.is_err() { pg.rank() as f64 + 1.0 } else { 0.0 }]);
    if let Err(e) = pg.all_reduce(&mut flag, ReduceOp::Max) {
        let mine = r.err().map(|e| format!(" (and this rank failed: {e:#})")).unwrap_or_default();
        bail!("rank {}: {what}: the ranks could not agree: {e}{mine}", pg.rank());
    }
    let failed = flag.double_value(&[0]) as usize;
    match r {
        Err(e) => Err(e.context(format!("rank {}: {what}", pg.rank()))),
        Ok(_) if failed > 0 => {
            bail!("rank {}: {what}: rank {} failed (its error says why); nothing was changed", pg.rank(), failed - 1)
        }
        Ok(v) => Ok(v),
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

/// Remove a checkpoint folder so that a crash midway never leaves something that looks committed:
/// rename it out of the `step-N` namespace first, then delete.
fn remove_checkpoint(path: &Path) -> anyhow::Result<()> {
    let doomed = path.with_file_name(format!("{}.deleting", path.file_name().unwrap_or_default().to_string_lossy()));
    std::fs::rename(path, &doomed).with_context(|| format!("renaming {} for removal", path.display()))?;
    if let Some(parent) = path.parent() {
        fsync_dir(parent)?;
    }
    std::fs::remove_dir_all(&doomed).with_context(|| format!("removing {}", doomed.display()))
}

fn fsync_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::File::open(dir).and_then(|f| f.sync_all()).with_context(|| format!("fsync {}", dir.display()))
}

fn write_synced(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
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

/// Save `dp`'s parameters and `opt`'s state at `step` into `dir` (a collective: every rank calls
/// it). `extra`: the job's state, stored in the metadata. Returns what this rank wrote. On any
/// rank's failure every rank returns an error and the previous checkpoints are untouched.
pub fn save(
    dp: &dyn DataParallel,
    opt: &AdamW,
    dir: &Path,
    step: u64,
    extra: serde_json::Value,
    opts: &SaveOptions,
) -> anyhow::Result<Report> {
    let t0 = std::time::Instant::now();
    let pg = dp.group();
    let (rank, n) = (pg.rank(), pg.world_size());
    let name = step_dir_name(step);
    let tmp = dir.join(format!("{name}.tmp"));
    // ---- rank 0 prepares the folder (and removes what earlier crashed saves left) ----
    agree(pg, "preparing the checkpoint folder", || {
        if rank == 0 {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            for e in std::fs::read_dir(dir)?.flatten() {
                let f = e.file_name().to_string_lossy().into_owned();
                if (f.ends_with(".tmp") || f.ends_with(".deleting")) && e.path().is_dir() {
                    std::fs::remove_dir_all(e.path())?;
                }
            }
            std::fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        }
        Ok(())
    })?;
    // ---- every rank writes its pieces ----
    let written = agree(pg, "writing its rank file", || {
        let names: Vec<String> = dp.model().named_parameters().into_iter().map(|(n, _)| n).collect();
        let shapes = dp.param_shapes();
        let state: AdamWState = opt.state_views(); // no copy: written from the moments themselves
        let has_state = !state.m.is_empty();
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        let mut pieces: Vec<(String, Vec<i64>, PieceMeta)> = Vec::new();
        let mut optimizer_steps = BTreeMap::new();
        let file = format!("rank-{rank:05}.safetensors");
        for (s, slot) in dp.slots().iter().enumerate() {
            let master = slot.master.detach();
            ensure!(master.is_contiguous(), "slot {s}: its master tensor is not contiguous");
            let flat = |t: &Tensor| t.view([-1]);
            let mut kinds = vec![("param", flat(&master))];
            if has_state {
                ensure!(
                    s < state.m.len(),
                    "the optimizer has {} slots, the strategy {}",
                    state.m.len(),
                    dp.slots().len()
                );
                kinds.push(("exp_avg", flat(&state.m[s])));
                kinds.push(("exp_avg_sq", flat(&state.v[s])));
            }
            for (i, within, at) in &slot.pieces {
                // Replicated: rank r writes the r-th of N balanced ranges of the piece.
                let (within, at) = if slot.replicated {
                    let own = plan::owned_range(within.end - within.start, rank, n);
                    (within.start + own.start..within.start + own.end, at.start + own.start..at.start + own.end)
                } else {
                    (within.clone(), at.clone())
                };
                if has_state {
                    optimizer_steps.insert(names[*i].clone(), state.steps[s]);
                }
                if within.is_empty() {
                    continue;
                }
                for (kind, t) in &kinds {
                    let key = format!("{kind}/{}/{}", names[*i], within.start);
                    tensors.push((key.clone(), t.narrow(0, at.start, at.end - at.start)));
                    let meta = PieceMeta {
                        rank,
                        file: file.clone(),
                        key,
                        lo: within.start,
                        hi: within.end,
                        sha256: String::new(),
                    };
                    pieces.push((format!("{kind}/{}", names[*i]), shapes[*i].clone(), meta));
                }
            }
        }
        let w = files::write(&tmp.join(&file), &tensors, opts.fail_after_bytes)?;
        for (p, h) in pieces.iter_mut().zip(&w.tensor_sha256) {
            p.2.sha256 = h.clone();
        }
        let index =
            RankIndex { rank, file, meta: FileMeta { bytes: w.bytes, sha256: w.sha256 }, pieces, optimizer_steps };
        write_synced(&tmp.join(format!("rank-{rank:05}.json")), &serde_json::to_vec(&index)?)?;
        crate::launch::injected_failure("save", rank, step)?;
        Ok(w.bytes)
    })?;
    // ---- rank 0 merges the indexes, writes the metadata last, commits ----
    let path = dir.join(&name);
    agree(pg, "committing the checkpoint", || {
        if rank != 0 {
            return Ok(());
        }
        let mut meta = Metadata {
            format_version: FORMAT_VERSION,
            step,
            world_size: n,
            tensors: BTreeMap::new(),
            files: BTreeMap::new(),
            optimizer_steps: BTreeMap::new(),
            extra: extra.clone(),
        };
        for r in 0..n {
            let p = tmp.join(format!("rank-{r:05}.json"));
            let index: RankIndex =
                serde_json::from_slice(&std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?)?;
            meta.files.insert(index.file.clone(), index.meta);
            for (t, shape, piece) in index.pieces {
                meta.tensors.entry(t).or_insert_with(|| TensorMeta { shape, pieces: Vec::new() }).pieces.push(piece);
            }
            for (k, v) in index.optimizer_steps {
                if let Some(old) = meta.optimizer_steps.insert(k.clone(), v) {
                    ensure!(old == v, "{k}: ranks saved different AdamW step counts ({old} and {v})");
                }
            }
        }
        // Every tensor covered exactly once.
        for (t, tm) in &meta.tensors {
            let numel = tm.shape.iter().product::<i64>();
            let ranges: Vec<Range<i64>> = tm.pieces.iter().map(|p| p.lo..p.hi).collect();
            plan::plan_reads(&ranges, 0..numel)
                .map_err(|e| anyhow::anyhow!("{t}: the ranks' pieces do not tile it: {e}"))?;
        }
        write_synced(&tmp.join(METADATA), &serde_json::to_vec_pretty(&meta)?)?;
        fsync_dir(&tmp)?;
        if path.exists() {
            remove_checkpoint(&path)?;
        }
        std::fs::rename(&tmp, &path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
        fsync_dir(dir)?;
        let latest_tmp = dir.join(format!("{LATEST}.tmp"));
        write_synced(&latest_tmp, name.as_bytes())?;
        std::fs::rename(&latest_tmp, dir.join(LATEST))?;
        Ok(())
    })?;
    // Committed. What follows cannot undo that: a failure is a warning, not the save's error.
    if rank == 0 {
        if let Err(e) = fsync_dir(dir) {
            eprintln!("warning: {name} is committed, but fsync of {} failed: {e:#}", dir.display());
        }
        if let Some(k) = opts.keep_last {
            // Older steps only: never this one, never a later step of another timeline.
            let older: Vec<PathBuf> = committed(dir).into_iter().filter(|(s, _)| *s < step).map(|(_, p)| p).collect();
            for old in older.iter().take((older.len() + 1).saturating_sub(k.max(1))) {
                if let Err(e) = remove_checkpoint(old) {
                    eprintln!("warning: keep_last: {e:#}");
                }
            }
        }
    }
    Ok(Report { path, step, bytes: written, seconds: t0.elapsed().as_secs_f64(), extra })
}

/// The checkpoint folder `path` names: a committed checkpoint itself, or a folder of them (its
/// `latest`, or else its newest committed one).
pub fn resolve(path: &Path) -> anyhow::Result<PathBuf> {
    if path.join(METADATA).is_file() {
        return Ok(path.to_path_buf());
    }
    ensure!(path.is_dir(), "{} is not a folder (a checkpoint is a folder with a {METADATA})", path.display());
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

/// Read and check a checkpoint's metadata.
pub fn read_metadata(dir: &Path) -> anyhow::Result<Metadata> {
    let p = dir.join(METADATA);
    let text = std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
    let v: serde_json::Value = serde_json::from_slice(&text).with_context(|| format!("{} is not JSON", p.display()))?;
    let version = v["format_version"].as_u64().with_context(|| format!("{}: no format_version", p.display()))?;
    ensure!(
        version == FORMAT_VERSION as u64,
        "{}: format version {version}; this shardlab reads version {FORMAT_VERSION}",
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
    Ok(meta)
}

/// Load the checkpoint at `path` ([`resolve`]) into `dp`'s parameters and `opt`'s state, whatever
/// the strategy and world size that saved it (a collective). Each rank reads only the ranges its
/// slots hold. Every parameter of the model must be in the checkpoint with the same shape; on any
/// rank's failure every rank returns an error.
pub fn load(dp: &mut dyn DataParallel, opt: &mut AdamW, path: &Path) -> anyhow::Result<Report> {
    let t0 = std::time::Instant::now();
    let pg = dp.group();
    let dir = agree(pg, "finding the checkpoint", || resolve(path))?;
    let meta = agree(pg, "reading the checkpoint's metadata", || read_metadata(&dir))?;
    // Every rank resolved the folder on its own: make sure they all read the same checkpoint.
    let mut s = Tensor::from_slice(&[meta.step as f64, -(meta.step as f64)]);
    pg.all_reduce(&mut s, ReduceOp::Max)?;
    ensure!(
        s.double_value(&[0]) == -s.double_value(&[1]),
        "rank {}: the ranks found different checkpoints in {} (steps up to {} and down to {}): is another job writing there?",
        pg.rank(),
        path.display(),
        s.double_value(&[0]),
        -s.double_value(&[1])
    );
    // Replicated strategies: each rank reads 1/N of every slot and the ranks all-gather the rest
    // (after every rank has read its part without error: no collective inside `agree`).
    let (rank, n) = (pg.rank(), pg.world_size());
    let mut gathers: Vec<Tensor> = Vec::new();
    let bytes = agree(pg, "reading its pieces", || {
        let named = dp.model().named_parameters();
        let shapes = dp.param_shapes();
        let mut problems = Vec::new();
        for ((name, _), shape) in named.iter().zip(&shapes) {
            match meta.tensors.get(&format!("param/{name}")) {
                None => problems.push(format!("{name} is not in the checkpoint")),
                Some(t) if &t.shape != shape => {
                    problems.push(format!("{name}: shape {:?} in the checkpoint, {shape:?} in this model", t.shape))
                }
                _ => {}
            }
        }
        ensure!(problems.is_empty(), "{} does not fit this model:\n  {}", dir.display(), problems.join("\n  "));
        let has_state = !meta.optimizer_steps.is_empty();
        let slots = dp.slots();
        let mut readers: BTreeMap<String, files::Reader> = BTreeMap::new();
        let mut m = Vec::new();
        let mut v = Vec::new();
        let mut steps = Vec::new();
        for slot in &slots {
            let mut kinds = vec![("param", slot.master.detach())];
            if has_state {
                m.push(slot.master.zeros_like());
                v.push(slot.master.zeros_like());
                kinds.push(("exp_avg", m.last().unwrap().shallow_clone()));
                kinds.push(("exp_avg_sq", v.last().unwrap().shallow_clone()));
                // One step count per slot. A parameter that never got a gradient has a lower count
                // than the others of a ZeRO unit; its moments are zero, so the unit's count (the
                // largest) only matters for their bias correction — as in FSDP's flat parameters.
                let counts = slot.pieces.iter().filter_map(|(i, ..)| meta.optimizer_steps.get(&named[*i].0).copied());
                steps.push(counts.max().unwrap_or(0));
            }
            let own = if slot.replicated && n > 1 {
                let numel = slot.master.numel() as i64;
                plan::owned_range(numel, rank, n)
            } else {
                0..slot.master.numel() as i64
            };
            for (kind, dst) in kinds {
                let dst = dst.view([-1]);
                if slot.replicated && n > 1 {
                    gathers.push(dst.shallow_clone());
                }
                for (i, within, at) in &slot.pieces {
                    // The part of this piece inside the range this rank reads.
                    let (lo, hi) = (at.start.max(own.start), at.end.min(own.end));
                    if lo >= hi {
                        continue;
                    }
                    let within = within.start + (lo - at.start)..within.start + (hi - at.start);
                    let at = lo..hi;
                    let t = format!("{kind}/{}", named[*i].0);
                    let tm = meta.tensors.get(&t).with_context(|| format!("{t} is not in the checkpoint"))?;
                    let ranges: Vec<Range<i64>> = tm.pieces.iter().map(|p| p.lo..p.hi).collect();
                    let reads = plan::plan_reads(&ranges, within.clone()).map_err(|e| anyhow::anyhow!("{t}: {e}"))?;
                    for r in reads {
                        let piece = &tm.pieces[r.piece];
                        let f = &meta
                            .files
                            .get(&piece.file)
                            .with_context(|| format!("{} is not listed in the metadata", piece.file))?;
                        if !readers.contains_key(&piece.file) {
                            readers.insert(piece.file.clone(), files::Reader::open(&dir.join(&piece.file), f.bytes)?);
                        }
                        let reader = readers.get_mut(&piece.file).unwrap();
                        ensure!(
                            reader.numel(&piece.key) == Some(piece.hi - piece.lo),
                            "{}: {} holds {:?} elements, the metadata says {}",
                            piece.file,
                            piece.key,
                            reader.numel(&piece.key),
                            piece.hi - piece.lo
                        );
                        let whole = r.src == 0 && r.len == piece.hi - piece.lo;
                        let vals = if whole {
                            reader.read_checked(&piece.key, &piece.sha256)?
                        } else {
                            reader.read(&piece.key, r.src, r.len)?
                        };
                        tch::no_grad(|| dst.narrow(0, at.start + r.dst, r.len).copy_(&Tensor::from_slice(&vals)));
                    }
                }
            }
        }
        // No optimizer state saved (before the first step): start the optimizer afresh too.
        opt.load_state(AdamWState { steps, m, v }).map_err(anyhow::Error::msg)?;
        Ok(readers.values().map(|r| r.bytes_read).sum::<u64>())
    })?;
    // Every rank found its own metadata: make sure they gather the same tensors (else a hang).
    let total: i64 = gathers.iter().map(|t| t.numel() as i64).sum();
    let mut c = Tensor::from_slice(&[gathers.len() as f64, total as f64, -(gathers.len() as f64), -(total as f64)]);
    pg.all_reduce(&mut c, ReduceOp::Max)?;
    ensure!(
        c.double_value(&[0]) == -c.double_value(&[2]) && c.double_value(&[1]) == -c.double_value(&[3]),
        "rank {rank}: the ranks planned different all-gathers for {} (one found optimizer state, another did not?)",
        dir.display()
    );
    // The all-gathers, one per tensor, in slot order on every rank (batching them into 64 MiB
    // buckets measured slower on 2 cores). Parts are padded to one length.
    for dst in &gathers {
        let numel = dst.numel() as i64;
        let chunk = (numel + n as i64 - 1) / n as i64;
        let own = plan::owned_range(numel, rank, n);
        let input = Tensor::zeros([chunk], (dst.kind(), dst.device()));
        tch::no_grad(|| input.narrow(0, 0, own.end - own.start).copy_(&dst.narrow(0, own.start, own.end - own.start)));
        let mut out = Tensor::zeros([chunk * n as i64], (dst.kind(), dst.device()));
        pg.all_gather(&mut out, &input)?;
        for q in 0..n {
            let r = plan::owned_range(numel, q, n);
            let part = out.narrow(0, q as i64 * chunk, r.end - r.start);
            tch::no_grad(|| dst.narrow(0, r.start, r.end - r.start).copy_(&part));
        }
    }
    dp.masters_loaded()?;
    Ok(Report { path: dir, step: meta.step, bytes, seconds: t0.elapsed().as_secs_f64(), extra: meta.extra })
}

/// What [`consolidate`] wrote.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Consolidated {
    pub tensors: usize,
    pub bytes_written: u64,
    pub bytes_read: u64,
    /// Elements of the largest tensor: the most this holds in memory at once.
    pub largest_tensor_numel: i64,
}

/// Write the parameters of the checkpoint at `path` ([`resolve`]) as one safetensors file at `out`
/// with the model's names, in f32 or bf16 (`bf16`), one tensor at a time: the header first (every
/// size is in the metadata), then each tensor assembled from its pieces — so memory holds one
/// tensor, never the model. Every piece is read whole and checked against its checksum. A GPT
/// checkpoint (it has `transformer.wte.weight`) also gets `lm_head.weight`, the tied embedding,
/// as nanoGPT's state dict has it. Written to `out.tmp`, fsynced, then
/// renamed to `out`.
pub fn consolidate(path: &Path, out: &Path, bf16: bool) -> anyhow::Result<Consolidated> {
    use std::io::Write;
    let dir = resolve(path)?;
    let meta = read_metadata(&dir)?;
    let mut names: Vec<(String, String)> =
        meta.tensors.keys().filter_map(|t| t.strip_prefix("param/").map(|n| (n.to_string(), t.clone()))).collect();
    // nanoGPT's GPT ties lm_head to wte and its state dict lists both.
    let tied = meta.tensors.contains_key("param/transformer.wte.weight");
    if tied && !meta.tensors.contains_key("param/lm_head.weight") {
        names.push(("lm_head.weight".into(), "param/transformer.wte.weight".into()));
    }
    let elem = if bf16 { 2u64 } else { 4 };
    let mut header = serde_json::Map::new();
    // The safetensors metadata PyTorch and Hugging Face write (transformers requires the format).
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt", "step": meta.step.to_string()}));
    let mut offset = 0u64;
    let mut largest = 0i64;
    for (name, t) in &names {
        let shape = &meta.tensors[t].shape;
        let numel = shape.iter().product::<i64>();
        largest = largest.max(numel);
        let n = elem * numel as u64;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": if bf16 { "BF16" } else { "F32" }, "shape": shape, "data_offsets": [offset, offset + n]}),
        );
        offset += n;
    }
    let mut head = serde_json::to_vec(&serde_json::Value::Object(header))?;
    while head.len() % 8 != 0 {
        head.push(b' ');
    }
    let tmp = out.with_file_name(format!("{}.tmp", out.file_name().unwrap_or_default().to_string_lossy()));
    let file = std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    w.write_all(&(head.len() as u64).to_le_bytes())?;
    w.write_all(&head)?;
    let mut readers: BTreeMap<String, files::Reader> = BTreeMap::new();
    let mut write_all = || -> anyhow::Result<()> {
        for (name, t) in &names {
            let tm = &meta.tensors[t];
            let numel = tm.shape.iter().product::<i64>();
            let ranges: Vec<Range<i64>> = tm.pieces.iter().map(|p| p.lo..p.hi).collect();
            // The reads come in the order they land and tile 0..numel, so every one is a whole piece:
            // each streams from its rank file to the output 1 MiB at a time (no tensor is ever whole
            // in memory), its checksum checked at its end — a corrupt piece fails the run before the
            // output is renamed into place.
            for r in plan::plan_reads(&ranges, 0..numel).map_err(|e| anyhow::anyhow!("{t}: {e}"))? {
                let piece = &tm.pieces[r.piece];
                anyhow::ensure!(r.src == 0 && r.len == piece.hi - piece.lo, "{t}: a partial read of a piece");
                let f = meta
                    .files
                    .get(&piece.file)
                    .with_context(|| format!("{} is not listed in the metadata", piece.file))?;
                if !readers.contains_key(&piece.file) {
                    readers.insert(piece.file.clone(), files::Reader::open(&dir.join(&piece.file), f.bytes)?);
                }
                let reader = readers.get_mut(&piece.file).expect("opened");
                reader.stream_checked(&piece.key, &piece.sha256, |bytes| {
                    if bf16 {
                        let vals: Vec<f32> =
                            bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                        let t = Tensor::from_slice(&vals).to_kind(tch::Kind::BFloat16);
                        let b = crate::comm::dtype::TensorBytes::of(&t, name).map_err(anyhow::Error::msg)?;
                        w.write_all(b.bytes())?;
                    } else {
                        w.write_all(bytes)?; // f32 little-endian in, f32 little-endian out
                    }
                    Ok(())
                })?;
            }
        }
        Ok(())
    };
    if let Err(e) = write_all() {
        drop(w);
        let _ = std::fs::remove_file(&tmp); // never a half-written output
        return Err(e);
    }
    let file = w.into_inner().map_err(|e| anyhow::anyhow!("writing {}: {}", tmp.display(), e.error()))?;
    file.sync_all()?;
    let bytes_written = file.metadata()?.len();
    std::fs::rename(&tmp, out).with_context(|| format!("renaming {} to {}", tmp.display(), out.display()))?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        fsync_dir(parent)?;
    }
    let bytes_read = readers.values().map(|r| r.bytes_read).sum();
    Ok(Consolidated { tensors: names.len(), bytes_written, bytes_read, largest_tensor_numel: largest })
}
