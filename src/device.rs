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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_is_an_error_where_there_is_none_and_auto_falls_to_cpu_only_then() {
        assert_eq!(resolve(DeviceChoice::Cpu, 3).unwrap(), Device::Cpu);
        if cuda_devices() == 0 {
            eprintln!("skipped the CUDA half: no CUDA device");
            assert_eq!(resolve(DeviceChoice::Auto, 0).unwrap(), Device::Cpu);
            let e = resolve(DeviceChoice::Cuda, 0).unwrap_err().to_string();
            assert!(e.contains("no CUDA device") && e.contains("libtorch_cuda.so"), "{e}");
        } else {
            let n = cuda_devices();
            assert_eq!(resolve(DeviceChoice::Cuda, n + 1).unwrap(), Device::Cuda(1 % n));
            assert_eq!(resolve(DeviceChoice::Auto, 0).unwrap(), Device::Cuda(0));
        }
    }
}
