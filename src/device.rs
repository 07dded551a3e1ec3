//! Where a rank's tensors live (lesson 11): `--device cpu|cuda|auto`.
//!
//! A rank on a GPU machine uses `cuda:LOCAL_RANK` (one GPU per rank, as torchrun's scripts do with
//! `torch.cuda.set_device(local_rank)`); more ranks than GPUs share them round-robin (the tcp
//! backend allows it, for teaching; NCCL refuses two ranks on one GPU). Asking for CUDA where
//! libtorch sees no GPU is an error that says why, never a silent fall-back to the CPU.

use serde::{Deserialize, Serialize};
use tch::Device;

/// The device a run asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// The CPU.
    #[default]
    Cpu,
    /// A GPU per rank: an error if there is none.
    Cuda,
    /// A GPU per rank if libtorch sees any, else the CPU.
    Auto,
}

/// GPUs libtorch sees (0 on a CPU machine, or where the binary lacks libtorch_cuda.so).
pub fn cuda_devices() -> usize {
    if tch::Cuda::is_available() {
        tch::Cuda::device_count().max(0) as usize
    } else {
        0
    }
}

/// The device of the rank with local rank `local_rank` (its index on its machine).
pub fn resolve(choice: DeviceChoice, local_rank: usize) -> anyhow::Result<Device> {
    let n = cuda_devices();
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Auto if n == 0 => Ok(Device::Cpu),
        DeviceChoice::Cuda if n == 0 => anyhow::bail!(
            "--device cuda, but libtorch sees no CUDA device (CUDA_VISIBLE_DEVICES={:?}). On a GPU machine: \
             is the binary linked to libtorch_cuda.so (`readelf -d BINARY | grep torch_cuda`), and do \
             LD_LIBRARY_PATH's libraries come from a CUDA build of PyTorch (`python3 -c 'import torch; \
             print(torch.version.cuda, torch.cuda.device_count())'`)?",
            std::env::var("CUDA_VISIBLE_DEVICES").ok()
        ),
        DeviceChoice::Cuda | DeviceChoice::Auto => Ok(Device::Cuda(local_rank % n)),
    }
}

/// Load libtorch_cuda.so into this process (where libtorch has one), so that libtorch sees the
/// GPUs where there are some. The bins link it (build.rs); test binaries do not, and call this
/// before any libtorch call. The one on LD_LIBRARY_PATH first (a GPU machine's own PyTorch), else
/// the one this crate was built against. Nothing happens where neither loads.
pub fn load_libtorch_cuda() {
    let built = format!("{}/libtorch_cuda.so", option_env!("SHARDLAB_LIBTORCH_LIB").unwrap_or("."));
    for name in ["libtorch_cuda.so", built.as_str()] {
        let c = std::ffi::CString::new(name).expect("no NUL in a path");
        if !unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) }.is_null() {
            return;
        }
    }
}

/// A GPU as the CUDA runtime reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaInfo {
    /// `cudaDeviceProp::name`, e.g. "NVIDIA H200".
    pub name: String,
    /// `cudaMemGetInfo`: bytes in use on the whole device (every process: CUDA contexts, the
    /// caching allocators' reserved blocks — what nvidia-smi shows) and its capacity.
    pub used_bytes: u64,
    pub total_bytes: u64,
}

type CudaFn<A, B> = unsafe extern "C" fn(A, B) -> i32;

/// Name and memory of GPU `index`, from the CUDA runtime that libtorch_cuda loaded (`None` where
/// there is no CUDA runtime or no such device). Querying creates the device's CUDA context in this
/// process if it has none (a few hundred MB on the device): call it where the process uses that
/// GPU anyway. Memory is device-wide: ranks
/// sharing a GPU see each other's bytes; the per-rank model-state bytes are
/// [`MemoryStats`](crate::memory::MemoryStats), measured from the tensors a rank holds.
pub fn cuda_info(index: usize) -> Option<CudaInfo> {
    if index >= cuda_devices() {
        return None;
    }
    // The runtime libtorch_cuda already loaded (it sees a GPU, so it has one): never a second one.
    let lib = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"].iter().find_map(|n| {
        let c = std::ffi::CString::new(*n).ok()?;
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        (!h.is_null()).then_some(h)
    })?;
    let sym = |name: &str| {
        let c = std::ffi::CString::new(name).expect("symbol name");
        let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    // SAFETY: the CUDA runtime's C signatures: cudaGetDeviceProperties(cudaDeviceProp*, int) (its
    // struct begins with char name[256]; the buffer is larger than any version of the struct),
    // cudaMemGetInfo(size_t* free, size_t* total) on the current device, cudaGetDevice(int*),
    // cudaSetDevice(int). The calling thread's current device is restored afterwards.
    unsafe {
        let props: CudaFn<*mut u8, i32> =
            std::mem::transmute(sym("cudaGetDeviceProperties_v2").or_else(|| sym("cudaGetDeviceProperties"))?);
        let set_device: unsafe extern "C" fn(i32) -> i32 = std::mem::transmute(sym("cudaSetDevice")?);
        let get_device: unsafe extern "C" fn(*mut i32) -> i32 = std::mem::transmute(sym("cudaGetDevice")?);
        let mem_info: CudaFn<*mut usize, *mut usize> = std::mem::transmute(sym("cudaMemGetInfo")?);
        let mut buf = vec![0u8; 1 << 14];
        if props(buf.as_mut_ptr(), index as i32) != 0 {
            return None;
        }
        let name = std::ffi::CStr::from_bytes_until_nul(&buf[..256]).ok()?.to_string_lossy().into_owned();
        let mut current = 0i32;
        if get_device(&mut current) != 0 || set_device(index as i32) != 0 {
            return None;
        }
        let (mut free, mut total) = (0usize, 0usize);
        let r = mem_info(&mut free, &mut total);
        set_device(current);
        if r != 0 {
            return None;
        }
        Some(CudaInfo { name, used_bytes: (total - free) as u64, total_bytes: total as u64 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_is_an_error_where_there_is_none_and_auto_falls_to_cpu_only_then() {
        assert_eq!(resolve(DeviceChoice::Cpu, 3).unwrap(), Device::Cpu);
        if cuda_devices() == 0 {
            eprintln!("skipped the CUDA half: no CUDA device");
            assert_eq!(resolve(DeviceChoice::Auto, 0).unwrap(), Device::Cpu);
            assert_eq!(cuda_info(0), None);
            let e = resolve(DeviceChoice::Cuda, 0).unwrap_err().to_string();
            assert!(e.contains("no CUDA device") && e.contains("libtorch_cuda.so"), "{e}");
        } else {
            let n = cuda_devices();
            assert_eq!(resolve(DeviceChoice::Cuda, n + 1).unwrap(), Device::Cuda(1 % n));
            assert_eq!(resolve(DeviceChoice::Auto, 0).unwrap(), Device::Cuda(0));
        }
    }
}
