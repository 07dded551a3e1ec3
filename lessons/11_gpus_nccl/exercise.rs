//! Lesson 11 — GPUs, NCCL, multi-node and offload: your exercises.
//! Replace each `todo!()`; check your work with `cargo grade 11`. Hints: `cargo grade 11 --hint K`.
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
    // TODO: return the model's training FLOP/s as a fraction of all the devices' peak (README,
    // "MFU: how much of the GPU a run uses"; hints: `cargo grade 11 --hint 1`).
    todo!()
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
    // TODO: every rank returns rank 0's id or an error saying why; when rank 0 failed, no rank waits
    // out the timeout (README, "Bring-up: the unique id"; hints: `cargo grade 11 --hint 2`).
    todo!()
}

/// Exercise 3 — staging a tensor for a backend. Return what a backend working on `device` should
/// read (and write): `t` itself (a shallow clone, sharing its storage) when `t` is already on
/// `device` and contiguous; otherwise a contiguous copy of `t` on `device`, of the same kind and
/// shape — in pinned host memory when it comes from a GPU to the CPU.
pub fn stage(t: &Tensor, device: Device) -> Tensor {
    // TODO: no copy when the backend can use `t` as it is; otherwise a copy it can use — and a copy
    // down from a GPU must be finished before anyone reads it (README, "Host and device memory";
    // hints: `cargo grade 11 --hint 3`).
    todo!()
}

/// Exercise 4 — the copy back. After the backend wrote its result into `staged` (what `stage`
/// returned for `dst`), make the caller's tensor `dst` hold it: write into `dst`'s own memory — it
/// may be a view into a larger buffer that the model reads — and do nothing when `staged` is
/// `dst`'s memory already.
pub fn unstage(dst: &mut Tensor, staged: &Tensor) {
    // TODO: land the result in `dst`'s own memory, unless it is there already (README, "Host and
    // device memory"; hints: `cargo grade 11 --hint 4`).
    todo!()
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
    // TODO: `grad_hosts` filled, the masters stepped and `params` refreshed, all in place; return
    // the bytes (down, up), or the optimizer's error with no parameter changed (README, "CPU
    // offload"; hints: `cargo grade 11 --hint 5`).
    todo!()
}
