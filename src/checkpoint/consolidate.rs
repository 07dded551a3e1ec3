//! Consolidating a checkpoint ([`consolidate`]) into one safetensors file with the model's names,
//! streamed one tensor at a time ([`Consolidated`] says what was written).

use super::{files, fsync_dir, open_reader, plan, read_metadata, resolve};
use anyhow::Context;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use tch::Tensor;

/// Tensor `name` of checkpoint `meta` in `dir` (`param/NAME`, `exp_avg/NAME`, `exp_avg_sq/NAME`)
/// whole, from its pieces — each read whole and checked against its checksum.
fn assemble(
    meta: &super::Metadata,
    dir: &Path,
    readers: &mut BTreeMap<String, files::Reader>,
    name: &str,
) -> anyhow::Result<Vec<f32>> {
    let tm = meta.tensors.get(name).with_context(|| format!("{name} is not in the checkpoint"))?;
    let numel = tm.shape.iter().product::<i64>();
    let saved: Vec<Vec<plan::Run>> = tm.pieces.iter().map(|p| p.runs(&tm.shape)).collect();
    let all = [plan::Run { global: 0, len: numel, offset: 0 }];
    let reads = plan::plan_region_reads(&saved, &all).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
    let mut whole = vec![0f32; numel as usize];
    let mut by_piece: BTreeMap<usize, Vec<&plan::Read>> = BTreeMap::new();
    reads.iter().for_each(|r| by_piece.entry(r.piece).or_default().push(r));
    for (k, rs) in by_piece {
        let piece = &tm.pieces[k];
        let vals = open_reader(readers, meta, dir, &piece.file)?.read_checked(&piece.key, &piece.sha256)?;
        for r in rs {
            let (s, d, n) = (r.src as usize, r.dst as usize, r.len as usize);
            whole[d..d + n].copy_from_slice(&vals[s..s + n]);
        }
    }
    Ok(whole)
}

/// Tensor `name` of the checkpoint at `path` ([`resolve`]) whole, with its shape, whatever layout
/// saved it: `param/NAME` (the f32 master values), `exp_avg/NAME` or `exp_avg_sq/NAME` (AdamW's
/// moments). Every piece is checked against its checksum.
pub fn read_tensor(path: &Path, name: &str) -> anyhow::Result<Tensor> {
    let dir = resolve(path)?;
    let meta = read_metadata(&dir)?;
    let shape = meta.tensors.get(name).with_context(|| format!("{name} is not in the checkpoint"))?.shape.clone();
    let vals = assemble(&meta, &dir, &mut BTreeMap::new(), name)?;
    Ok(Tensor::from_slice(&vals).reshape(shape))
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
            let mut emit = |bytes: &[u8]| -> anyhow::Result<()> {
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
            };
            if tm.pieces.iter().all(|p| p.region.is_none()) {
                let ranges: Vec<Range<i64>> = tm.pieces.iter().map(|p| p.lo..p.hi).collect();
                // The reads come in the order they land and tile 0..numel, so every one is a whole
                // piece: each streams from its rank file to the output 1 MiB at a time (no tensor
                // is ever whole in memory), its checksum checked at its end — a corrupt piece fails
                // the run before the output is renamed into place.
                for r in plan::plan_reads(&ranges, 0..numel).map_err(|e| anyhow::anyhow!("{t}: {e}"))? {
                    let piece = &tm.pieces[r.piece];
                    anyhow::ensure!(r.src == 0 && r.len == piece.hi - piece.lo, "{t}: a partial read of a piece");
                    open_reader(&mut readers, &meta, &dir, &piece.file)?.stream_checked(
                        &piece.key,
                        &piece.sha256,
                        &mut emit,
                    )?;
                }
            } else {
                // Boxes (tensor-parallel slices): the tensor assembled in memory from its pieces,
                // each read whole and checked, then written.
                let whole = assemble(&meta, &dir, &mut readers, t)?;
                let bytes: Vec<u8> = whole.iter().flat_map(|x| x.to_le_bytes()).collect();
                emit(&bytes)?;
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
