//! Saving a checkpoint ([`save`]): every rank writes the pieces it holds into `step-N.tmp/`, then
//! rank 0 merges the ranks' indexes into `metadata.json` and commits (the scheme in the module
//! documentation of `checkpoint`).

use super::{
    agree, committed, files, fsync_dir, plan, remove_checkpoint, step_dir_name, write_synced, FileMeta, Holder,
    Metadata, PieceMeta, RankIndex, Report, SaveOptions, TensorMeta, FORMAT_VERSION, LATEST, METADATA,
};
use crate::optim::{AdamW, AdamWState};
use anyhow::{ensure, Context};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::Tensor;

/// Save what `h` holds (its parameters' master values) and `opt`'s state at `step` into `dir` (a
/// collective: every rank calls it). `extra`: the job's state, stored in the metadata. Returns
/// what this rank wrote. On any rank's failure every rank returns an error and the previous
/// checkpoints are untouched. CUDA tensors are staged through host memory, one piece at a time.
/// Of copies of a value (replicas) one rank's is written: they are assumed equal, as the
/// engine's step keeps them (bitwise: `Engine::full_parameters` checks).
pub fn save<H: Holder + ?Sized>(
    h: &H,
    opt: &AdamW,
    dir: &Path,
    step: u64,
    extra: serde_json::Value,
    opts: &SaveOptions,
) -> anyhow::Result<Report> {
    let t0 = std::time::Instant::now();
    let groups = h.groups();
    let rank = h.global_rank();
    let n: usize = groups.iter().map(|g| g.world_size()).product();
    let (rep_rank, rep_n) = (h.replicas().rank(), h.replicas().world_size());
    let name = step_dir_name(step);
    let tmp = dir.join(format!("{name}.tmp"));
    // ---- rank 0 prepares the folder (and removes what earlier crashed saves left) ----
    agree(&groups, rank, "preparing the checkpoint folder", || {
        if rank == 0 {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            super::lock_folder(dir, &groups[0].job())?;
            super::folder::sweep(dir)?;
            std::fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        }
        Ok(())
    })?;
    // ---- every rank writes its pieces ----
    let written = agree(&groups, rank, "writing its rank file", || {
        let tensors_of_model = h.tensors();
        let state: AdamWState = opt.state_views(); // no copy: written from the moments themselves
        let has_state = !state.m.is_empty();
        let slots = h.held_slots()?;
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        let mut pieces: Vec<(String, Vec<i64>, PieceMeta)> = Vec::new();
        let mut optimizer_steps = BTreeMap::new();
        let file = format!("rank-{rank:05}.safetensors");
        for (s, slot) in slots.iter().enumerate() {
            let master = slot.master.detach();
            ensure!(master.is_contiguous(), "slot {s}: its master tensor is not contiguous");
            super::check_slot(s, slot, &tensors_of_model)?;
            if has_state {
                ensure!(
                    slots.len() == state.m.len() && state.m[s].numel() == master.numel(),
                    "the optimizer's state does not fit what this rank holds ({} slots, the holder {}; slot {s}: {} \
                     values, its moments {})",
                    state.m.len(),
                    slots.len(),
                    master.numel(),
                    state.m[s].numel()
                );
            }
            if !slot.writes {
                continue;
            }
            // Views: a CUDA piece is staged through host memory by the file writer, one at a time.
            let flat = |t: &Tensor| t.view([-1]);
            let mut kinds = vec![("param", flat(&master))];
            if has_state {
                kinds.push(("exp_avg", flat(&state.m[s])));
                kinds.push(("exp_avg_sq", flat(&state.v[s])));
            }
            for piece in &slot.pieces {
                let (tname, shape) = &tensors_of_model[piece.tensor];
                let (within, at) = (&piece.within, &piece.at);
                // Replicated: rank r of the replicas writes the r-th of N balanced ranges of the piece.
                let (within, at) = if slot.replicated {
                    let own = plan::owned_range(within.end - within.start, rep_rank, rep_n);
                    (within.start + own.start..within.start + own.end, at.start + own.start..at.start + own.end)
                } else {
                    (within.clone(), at.clone())
                };
                if has_state {
                    optimizer_steps.insert(tname.clone(), state.steps[s]);
                }
                if within.is_empty() {
                    continue;
                }
                let whole = piece.region.is_whole(shape);
                // A key per piece: the box's offsets tell the boxes of one tensor apart (a rank's
                // q, k and v rows of c_attn).
                let place = if whole {
                    String::new()
                } else {
                    piece.region.offsets.iter().map(|o| format!("{o},")).collect::<String>()
                };
                for (kind, t) in &kinds {
                    let key = format!("{kind}/{tname}/{place}{}", within.start);
                    tensors.push((key.clone(), t.narrow(0, at.start, at.end - at.start)));
                    let meta = PieceMeta {
                        rank,
                        file: file.clone(),
                        key,
                        lo: within.start,
                        hi: within.end,
                        sha256: String::new(),
                        region: (!whole).then(|| piece.region.clone()),
                        blocks: Vec::new(),
                    };
                    pieces.push((format!("{kind}/{tname}"), shape.clone(), meta));
                }
            }
        }
        let w = files::write(&tmp.join(&file), &tensors, opts.fail_after_bytes)?;
        for ((p, h), b) in pieces.iter_mut().zip(&w.tensor_sha256).zip(&w.block_sha256) {
            p.2.sha256 = h.clone();
            p.2.blocks = b.clone();
        }
        let meta = FileMeta { bytes: w.bytes, sha256: w.sha256, header_sha256: w.header_sha256 };
        let index = RankIndex { rank, file, meta, pieces, optimizer_steps };
        write_synced(&tmp.join(format!("rank-{rank:05}.json")), &serde_json::to_vec(&index)?)?;
        crate::launch::injected_failure("save", rank, step)?;
        Ok(w.bytes)
    })?;
    // ---- rank 0 merges the indexes, writes the metadata last, commits ----
    let path = dir.join(&name);
    agree(&groups, rank, "committing the checkpoint", || {
        if rank != 0 {
            return Ok(());
        }
        let mut meta = Metadata {
            format_version: 1, // 2 once a piece is a box (below): older readers still read the rest
            step,
            world_size: n,
            tensors: BTreeMap::new(),
            files: BTreeMap::new(),
            optimizer_steps: BTreeMap::new(),
            extra: extra.clone(),
            seq: 1 + super::try_committed(dir)?.iter().map(|(_, p)| super::seq_of(p)).max().unwrap_or(0),
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
        // Every tensor covered exactly once (a tensor no rank wrote is a hole too).
        if meta.tensors.values().any(|t| t.pieces.iter().any(|p| p.region.is_some())) {
            meta.format_version = FORMAT_VERSION;
        }
        let kinds: &[&str] =
            if meta.optimizer_steps.is_empty() { &["param"] } else { &["param", "exp_avg", "exp_avg_sq"] };
        for (t, _) in h.tensors() {
            for k in kinds {
                ensure!(meta.tensors.contains_key(&format!("{k}/{t}")), "{k}/{t}: no rank wrote it");
            }
        }
        for (t, tm) in &meta.tensors {
            let numel = tm.shape.iter().product::<i64>();
            let saved: Vec<Vec<plan::Run>> = tm.pieces.iter().map(|p| p.runs(&tm.shape)).collect();
            let all = [plan::Run { global: 0, len: numel, offset: 0 }];
            plan::plan_region_reads(&saved, &all)
                .map_err(|e| anyhow::anyhow!("{t}: the ranks' pieces do not tile it: {e}"))?;
        }
        // The ranks' files are synced, but their names are durable only with the folder's sync, and
        // POSIX may persist metadata.json's name first: sync the folder before it exists, and after.
        fsync_dir(&tmp)?;
        write_synced(&tmp.join(METADATA), &serde_json::to_vec_pretty(&meta)?)?;
        fsync_dir(&tmp)?;
        // The commit point: the rename into the step-N namespace. A committed copy of this step (a
        // run resumed from an earlier step saves it again) is swapped out (`folder::replace`), so
        // that a step-N is committed at every instant. An error up to the rename: nothing was
        // committed; after it, a warning (the step is committed, and `resolve` finds it).
        super::folder::replace(&tmp, &path)?;
        if let Err(e) = fsync_dir(dir) {
            eprintln!("warning: {name} is committed, but fsync of {} failed: {e:#}", dir.display());
        }
        Ok(())
    })?;
    // Committed. What follows cannot undo that: a failure is a warning, not the save's error.
    // `latest` names it for people and older readers; `resolve` finds it by its sequence number
    // even if rank 0 dies before `latest` is replaced.
    if rank == 0 {
        let latest_tmp = dir.join(format!("{LATEST}.tmp"));
        let latest = write_synced(&latest_tmp, name.as_bytes())
            .and_then(|_| std::fs::rename(&latest_tmp, dir.join(LATEST)).map_err(anyhow::Error::from))
            .and_then(|_| fsync_dir(dir));
        if let Err(e) = latest {
            eprintln!("warning: {name} is committed, but {} was not replaced: {e:#}", dir.join(LATEST).display());
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
