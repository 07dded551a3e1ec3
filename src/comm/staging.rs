//! Staging (lesson 11): a tensor on the wrong side for a backend — a CUDA tensor through the CPU
//! backends (local, tcp), a CPU tensor through NCCL — is copied to where the backend works, and a
//! result is copied back into the caller's tensor afterwards.
//!
//! The rule: use the tensor itself when it is already on the backend's device and contiguous (no
//! copy); otherwise a contiguous copy there. A copy from a GPU to the host lands in **pinned**
//! (page-locked) memory: the GPU's copy engine reads and writes pinned pages directly (DMA), at
//! the link's full speed, where pageable memory goes through a driver bounce buffer. A tensor the
//! operation only writes (an all-gather's or reduce-scatter's output) gets an empty buffer on the
//! other side instead of a copy. Staging costs two copies over PCIe per operation (the input
//! across, the result back); NCCL moves device memory in place.

use tch::{Device, Tensor};

/// What the backend should read (and write, for an output): `t` itself (sharing its storage)
/// when it is on `device` and contiguous, else a contiguous copy on `device` — in pinned host
/// memory when it comes from a GPU. The copy is made on the calling thread after the work already
/// queued on the device (libtorch's default stream), so it holds the values the caller computed.
pub fn stage(t: &Tensor, device: Device) -> Tensor {
    if !t.defined() || (t.device() == device && t.is_contiguous()) {
        return t.shallow_clone();
    }
    if let (Device::Cpu, Device::Cuda(i)) = (device, t.device()) {
        // Contiguous on the GPU first, then one non-blocking copy down: libtorch puts its result
        // in page-locked memory (from its pinned-memory cache), the copy engine moves it by DMA,
        // and we wait for it before the backend reads it.
        let host = tch::no_grad(|| t.contiguous().to_device_(Device::Cpu, t.kind(), true, false));
        tch::Cuda::synchronize(i as i64);
        return host;
    }
    tch::no_grad(|| t.to_device(device).contiguous())
}

/// A buffer the backend writes a result into, for the caller's `t`: `t` itself when it is on
/// `device` and contiguous, else an uninitialised tensor of its shape and kind on `device`.
pub fn output_buffer(t: &Tensor, device: Device) -> Tensor {
    if !t.defined() || (t.device() == device && t.is_contiguous()) {
        return t.shallow_clone();
    }
    Tensor::empty(t.size(), (t.kind(), device))
}

/// Write a staged result back into the caller's tensor `dst` (in place: `dst` may be a view into
/// a larger buffer that others read). Nothing to do when `staged` is `dst` itself.
pub fn unstage(dst: &mut Tensor, staged: &Tensor) {
    if shares_storage(dst, staged) {
        return;
    }
    tch::no_grad(|| dst.copy_(staged));
}

/// Whether `a` and `b` are the same elements of the same memory.
fn shares_storage(a: &Tensor, b: &Tensor) -> bool {
    a.defined()
        && b.defined()
        && a.device() == b.device()
        && a.data_ptr() == b.data_ptr()
        && a.size() == b.size()
        && a.stride() == b.stride()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn contiguous_tensors_on_the_device_are_used_in_place_and_views_are_copied_and_written_back() {
        let t = Tensor::arange(6, (Kind::Float, Device::Cpu));
        let s = stage(&t, Device::Cpu);
        assert_eq!(s.data_ptr(), t.data_ptr(), "no copy for a contiguous CPU tensor");
        let base = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
        let mut view = base.tr(); // (3, 2), not contiguous
        let mut staged = stage(&view, Device::Cpu);
        assert!(staged.is_contiguous() && staged.data_ptr() != base.data_ptr());
        let _ = staged.fill_(7.0);
        unstage(&mut view, &staged);
        assert_eq!(base.sum(Kind::Float).double_value(&[]), 42.0, "written back through the view");
    }
}
