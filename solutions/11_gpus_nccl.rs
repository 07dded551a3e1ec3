//! Lesson 11 — GPUs, NCCL, multi-node and offload: reference answers.
//! Same signatures as `lessons/11_gpus_nccl/exercise.rs`; graded by `tests/lesson11.rs`.
#![allow(unused_variables, unused_imports, unused_mut)]

use shardlab::comm::store::StoreClient;
use shardlab::model::GptConfig;
use shardlab::optim::{AdamW, Decay, Optimizer};
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// Exercise 1 — model FLOPs utilisation. A GPT of shape `cfg` trains at `tokens_per_s` tokens
/// per second (all ranks together) on `devices` accelerators of `peak_tflops` dense TFLOP/s each.
/// Return the fraction of that peak the model's training FLOPs use: per token, 6 FLOPs for every
/// parameter that multiplies an activation — every parameter except the position embedding (a
/// lookup), the tied token embedding counted once (it is the output projection) — plus the
/// attention term 12·L·C·T (L layers, width C, context T = `block_size`).
pub fn mfu(cfg: &GptConfig, tokens_per_s: f64, devices: usize, peak_tflops: f64) -> f64 {
    let (v, c, l, t) = (cfg.vocab_size as f64, cfg.n_embd as f64, cfg.n_layer as f64, cfg.block_size as f64);
    // wte + per block: 2 LayerNorms 4C, qkv 3C² + 3C, out-proj C² + C, MLP 4C² + 4C and 4C² + C;
    // ln_f 2C.
    let n = v * c + l * (12.0 * c * c + 13.0 * c) + 2.0 * c;
    let flops_per_token = 6.0 * n + 12.0 * l * c * t;
    tokens_per_s * flops_per_token / (devices as f64 * peak_tflops * 1e12)
}

/// Exercise 2 — the NCCL unique id through the store. Every rank of a new communicator calls
/// this with the job's store and the communicator's `key`. Rank 0 calls `make_id` (in the library:
/// `ncclGetUniqueId`) and publishes `id:` followed by the 128 bytes under `key`, then returns its
/// id. If `make_id` fails, rank 0 publishes `error:` followed by the reason and returns the error.
/// Every other rank waits up to `timeout` for the value and returns the id — or an error naming
/// rank 0's reason (`error:`), saying rank 0 published nothing within the timeout (name "rank 0"),
/// or that the value is not an NCCL id (anything else).
pub fn share_unique_id(
    store: &mut StoreClient,
    rank: usize,
    key: &str,
    make_id: impl FnOnce() -> Result<[u8; 128], String>,
    timeout: Duration,
) -> Result<[u8; 128], String> {
    if rank == 0 {
        return match make_id() {
            Ok(id) => {
                store.set(key, &[&b"id:"[..], &id[..]].concat()).map_err(|e| e.to_string())?;
                Ok(id)
            }
            Err(why) => {
                store.set(key, format!("error:{why}").as_bytes()).map_err(|e| e.to_string())?;
                Err(why)
            }
        };
    }
    let v = store
        .get(key, timeout)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("rank {rank}: rank 0 published no NCCL id under {key} within {timeout:?}"))?;
    if let Some(why) = v.strip_prefix(b"error:") {
        return Err(format!("rank {rank}: rank 0 could not make the NCCL id: {}", String::from_utf8_lossy(why)));
    }
    match v.strip_prefix(b"id:").map(<[u8; 128]>::try_from) {
        Some(Ok(id)) => Ok(id),
        _ => Err(format!("rank {rank}: {key} is not an NCCL id ({} bytes)", v.len())),
    }
}

/// Exercise 3 — staging a tensor for a backend. Return what a backend working on `device` should
/// read (and write): `t` itself (a shallow clone, sharing its storage) when `t` is already on
/// `device` and contiguous; otherwise a contiguous copy of `t` on `device`, of the same kind and
/// shape — in pinned host memory when it comes from a GPU to the CPU.
pub fn stage(t: &Tensor, device: Device) -> Tensor {
    if t.device() == device && t.is_contiguous() {
        return t.shallow_clone();
    }
    if let (Device::Cpu, Device::Cuda(i)) = (device, t.device()) {
        // A non-blocking copy down lands in page-locked memory; wait for it before anyone reads.
        let host = tch::no_grad(|| t.contiguous().to_device_(Device::Cpu, t.kind(), true, false));
        tch::Cuda::synchronize(i as i64);
        return host;
    }
    tch::no_grad(|| t.to_device(device).contiguous())
}

/// Exercise 4 — the copy back. After the backend wrote its result into `staged` (what `stage`
/// returned for `dst`), make the caller's tensor `dst` hold it: write into `dst`'s own memory — it
/// may be a view into a larger buffer that the model reads — and do nothing when `staged` is
/// `dst`'s memory already.
pub fn unstage(dst: &mut Tensor, staged: &Tensor) {
    let same = dst.device() == staged.device()
        && dst.data_ptr() == staged.data_ptr()
        && dst.size() == staged.size()
        && dst.stride() == staged.stride();
    if !same {
        tch::no_grad(|| dst.copy_(staged));
    }
}

/// Exercise 5 — a CPU-offloaded optimizer step (ZeRO-Offload). Slot `i` has its working
/// parameter `params[i]` on the device (bf16, fp16 or f32: what forward reads), its averaged
/// gradient `grads[i]` there (any float kind), and in host memory its f32 master `masters[i]` and
/// an f32 buffer `grad_hosts[i]`, all of the same number of elements. Copy each gradient down into
/// its `grad_hosts[i]`, let `opt` step the masters with them at learning rate `lr` (with `decay`,
/// one per slot), then copy each updated master up into `params[i]`, in that tensor's kind.
/// Write into the tensors you were given (the model reads `params[i]`'s memory). `masters[i]` and
/// `grad_hosts[i]` are flat `(numel,)` while `params[i]` and `grads[i]` keep their shapes. Return
/// the bytes copied (device → host, host → device), counted even where "device" and host are the
/// same CPU (as in the grader): a gradient crosses in its own kind, a parameter in the device's
/// kind (cast on the host first). An optimizer refusal is the error, and then no parameter may
/// change.
pub fn offload_step(
    opt: &mut AdamW,
    lr: f64,
    params: &[Tensor],
    grads: &[Tensor],
    masters: &[Tensor],
    grad_hosts: &[Tensor],
    decay: &[Decay],
) -> Result<(u64, u64), String> {
    let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
    let (mut down, mut up) = (0, 0);
    for (g, h) in grads.iter().zip(grad_hosts) {
        // (numel,) in the gradient's kind over the link, then widened to f32 on the host.
        let moved = g.to_device(h.device());
        down += bytes(&moved);
        tch::no_grad(|| h.shallow_clone().copy_(&moved.reshape(h.size())));
    }
    opt.step(lr, masters, grad_hosts, decay)?;
    for (p, m) in params.iter().zip(masters) {
        // Cast on the host (half the bytes in bf16), then over the link into the device's copy.
        let narrow = m.to_kind(p.kind());
        up += bytes(&narrow);
        tch::no_grad(|| p.shallow_clone().copy_(&narrow.reshape(p.size())));
    }
    Ok((down, up))
}
