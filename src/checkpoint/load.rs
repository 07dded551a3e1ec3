//! Loading a checkpoint ([`load`]) into any strategy at any world size: each rank plans and reads
//! only the byte ranges its slots hold, and replicated strategies all-gather the rest.

use super::{agree, files, plan, read_metadata, resolve, Report};
use crate::comm::ReduceOp;
use crate::ddp::DataParallel;
use crate::optim::{AdamW, AdamWState};
use anyhow::{ensure, Context};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use tch::Tensor;

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
