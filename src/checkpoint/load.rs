//! Loading a checkpoint ([`load`]) into any strategy at any world size: each rank plans and reads
//! only the byte ranges its slots hold, and replicated strategies all-gather the rest.

use super::{agree, files, open_reader, plan, read_metadata, resolve, same_everywhere, Holder, Report};
use crate::optim::{AdamW, AdamWState};
use anyhow::{ensure, Context};
use std::collections::BTreeMap;
use std::path::Path;
use tch::Tensor;

/// Load the checkpoint at `path` ([`resolve`]) into what `h` holds and `opt`'s state, whatever
/// the layout and world size that saved it (a collective). Each rank reads only the elements its
/// slots hold (replicated slots: 1/N of them, the replicas all-gather the rest); a saved piece
/// read whole is checked against its checksum. Every tensor of the model must be in the
/// checkpoint with the same shape; on any rank's failure every rank returns an error.
pub fn load<H: Holder + ?Sized>(h: &mut H, opt: &mut AdamW, path: &Path) -> anyhow::Result<Report> {
    let t0 = std::time::Instant::now();
    let groups = h.groups();
    let rank = h.global_rank();
    let dir = agree(&groups, rank, "finding the checkpoint", || resolve(path))?;
    let meta = agree(&groups, rank, "reading the checkpoint's metadata", || read_metadata(&dir))?;
    // Every rank resolved the folder on its own: make sure they all read the same checkpoint.
    if let Some((hi, lo)) = same_everywhere(&groups, &[meta.step as f64])? {
        anyhow::bail!(
            "rank {rank}: the ranks found different checkpoints in {} (steps up to {} and down to {}): is another job writing there?",
            path.display(),
            hi[0],
            lo[0]
        );
    }
    // Replicated slots: each rank reads 1/N of every slot and the replicas all-gather the rest
    // (after every rank has read its part without error: no collective inside `agree`).
    let (rep_rank, rep_n) = (h.replicas().rank(), h.replicas().world_size());
    let mut gathers: Vec<Tensor> = Vec::new();
    let bytes = agree(&groups, rank, "reading its pieces", || {
        let tensors = h.tensors();
        let mut problems = Vec::new();
        for (name, shape) in &tensors {
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
        let slots = h.held_slots()?;
        for (s, slot) in slots.iter().enumerate() {
            super::check_slot(s, slot, &tensors)?;
        }
        let mut readers: BTreeMap<String, files::Reader> = BTreeMap::new();
        let (mut m, mut v, mut steps) = (Vec::new(), Vec::new(), Vec::new());
        // The parameters' values are read into host buffers and copied in only once every rank
        // has read its part (a failed load changes nothing); the moments are new tensors.
        let mut pending: Vec<(Tensor, i64, Vec<f32>)> = Vec::new();
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
                let counts = slot.pieces.iter().filter_map(|p| meta.optimizer_steps.get(&tensors[p.tensor].0).copied());
                steps.push(counts.max().unwrap_or(0));
            }
            let numel = slot.master.numel() as i64;
            let replicated = slot.replicated && rep_n > 1;
            let own = if replicated { plan::owned_range(numel, rep_rank, rep_n) } else { 0..numel };
            for (kind, dst) in kinds {
                let dst = dst.view([-1]);
                if replicated {
                    gathers.push(dst.shallow_clone());
                }
                for piece in &slot.pieces {
                    // The part of this piece inside the range this rank reads.
                    let (lo, hi) = (piece.at.start.max(own.start), piece.at.end.min(own.end));
                    if lo >= hi {
                        continue;
                    }
                    let within = piece.within.start + (lo - piece.at.start)..piece.within.start + (hi - piece.at.start);
                    let (tname, shape) = &tensors[piece.tensor];
                    let t = format!("{kind}/{tname}");
                    let tm = meta.tensors.get(&t).with_context(|| format!("{t} is not in the checkpoint"))?;
                    let saved: Vec<Vec<plan::Run>> = tm.pieces.iter().map(|p| p.runs(shape)).collect();
                    let want = plan::runs(shape, &piece.region, within.clone());
                    let reads = plan::plan_region_reads(&saved, &want).map_err(|e| anyhow::anyhow!("{t}: {e}"))?;
                    // Into a host buffer, then one copy into the slot (staging a CUDA tensor).
                    let mut buf = vec![0f32; (hi - lo) as usize];
                    let mut by_piece: BTreeMap<usize, Vec<&plan::Read>> = BTreeMap::new();
                    reads.iter().for_each(|r| by_piece.entry(r.piece).or_default().push(r));
                    for (k, rs) in by_piece {
                        let sp = &tm.pieces[k];
                        let reader = open_reader(&mut readers, &meta, &dir, &sp.file)?;
                        ensure!(
                            reader.numel(&sp.key) == Some(sp.hi - sp.lo),
                            "{}: {} holds {:?} elements, the metadata says {}",
                            sp.file,
                            sp.key,
                            reader.numel(&sp.key),
                            sp.hi - sp.lo
                        );
                        // A saved piece this wanted range needs whole is read in one go and checked.
                        if rs.iter().map(|r| r.len).sum::<i64>() == sp.hi - sp.lo {
                            let vals = reader.read_checked(&sp.key, &sp.sha256)?;
                            for r in rs {
                                let (s, d) = (r.src as usize, r.dst as usize);
                                buf[d..d + r.len as usize].copy_from_slice(&vals[s..s + r.len as usize]);
                            }
                        } else {
                            // Part of a piece: the blocks it touches, each read whole and checked.
                            for r in rs {
                                let d = &mut buf[r.dst as usize..(r.dst + r.len) as usize];
                                if sp.blocks.is_empty() {
                                    reader.read_into(&sp.key, r.src, d)?; // written before block checksums
                                } else {
                                    reader.read_blocks_checked(&sp.key, &sp.blocks, r.src, d)?;
                                }
                            }
                        }
                    }
                    if kind == "param" {
                        pending.push((dst.shallow_clone(), lo, buf));
                    } else {
                        tch::no_grad(|| dst.narrow(0, lo, hi - lo).copy_(&Tensor::from_slice(&buf)));
                    }
                }
            }
        }
        Ok((readers.values().map(|r| r.bytes_read).sum::<u64>(), pending, AdamWState { steps, m, v }))
    })?;
    let (bytes, pending, state) = bytes;
    // Every rank read its part: install it.
    for (dst, lo, buf) in pending {
        tch::no_grad(|| dst.narrow(0, lo, buf.len() as i64).copy_(&Tensor::from_slice(&buf)));
    }
    // Every rank found its own metadata: make sure the replicas gather the same tensors (else a
    // hang), compared within each group of replicas and the outcome agreed over the whole mesh.
    let total: i64 = gathers.iter().map(|t| t.numel() as i64).sum();
    let differ = same_everywhere(&[h.replicas()], &[gathers.len() as f64, total as f64]).map(|d| d.is_some());
    agree(&groups, rank, "planning the replicas' all-gathers", || match differ {
        Ok(false) => Ok(()),
        Ok(true) => anyhow::bail!(
            "the replicas planned different all-gathers for {} (one found optimizer state, another did not?)",
            dir.display()
        ),
        Err(e) => Err(e.into()),
    })?;
    // The all-gathers, one per tensor, in slot order on every rank (batching them into 64 MiB
    // buckets measured slower on 2 cores). Parts are padded to one length.
    let (pg, n, rank) = (h.replicas(), rep_n, rep_rank);
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
    h.loaded()?;
    // No optimizer state saved (before the first step): the optimizer starts afresh too.
    opt.load_state(state).map_err(anyhow::Error::msg)?;
    Ok(Report { path: dir, step: meta.step, bytes, seconds: t0.elapsed().as_secs_f64(), extra: meta.extra })
}
