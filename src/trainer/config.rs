//! What a fit runs on: the [`ScalingConfig`] (how many workers, which backend and strategy), the
//! [`Strategy`] itself, and the checks a config must pass before any worker starts.

use super::Trainer;
use crate::comm::{Backend, CommConfig};
use crate::ddp::{self, Variant};
use crate::launch::Launch;
use crate::precision::Precision;
use crate::stages::Checkpointing;
use serde::{Deserialize, Serialize};

/// How the model is spread over the workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum Strategy {
    /// One worker, no communication.
    Single,
    /// Data parallel: full replicas, averaged gradients.
    Ddp,
    /// ZeRO stage 1: optimizer states sharded.
    Zero1,
    /// ZeRO stage 2: optimizer states and gradients sharded.
    Zero2,
    /// ZeRO stage 3: optimizer states, gradients and parameters sharded — PyTorch's FSDP (lesson
    /// 06) is this strategy, so `fsdp` is accepted as another name for it.
    #[value(alias = "fsdp")]
    #[serde(alias = "fsdp", alias = "Fsdp")]
    Zero3,
}

impl Strategy {
    /// The ZeRO stage this strategy runs, if any.
    pub fn zero_stage(self) -> Option<crate::zero::Stage> {
        use crate::zero::Stage;
        match self {
            Strategy::Zero1 => Some(Stage::One),
            Strategy::Zero2 => Some(Stage::Two),
            Strategy::Zero3 => Some(Stage::Three),
            Strategy::Single | Strategy::Ddp => None,
        }
    }
}

/// How many workers and how they talk (Ray Train's `ScalingConfig`, plus the parallel strategy).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ScalingConfig {
    pub num_workers: usize,
    /// Where each worker computes (lesson 11): `Cuda` puts rank r on `cuda:LOCAL_RANK` (an error
    /// where there is no GPU); the local and tcp backends stage CUDA tensors through the host.
    #[serde(default)]
    pub device: crate::device::DeviceChoice,
    /// The same as `device: Cuda` (Ray Train's name for it).
    pub use_gpu: bool,
    pub backend: Backend,
    /// Threads or processes (default: threads for `Local`, processes for `Tcp`).
    pub launch: Option<Launch>,
    pub strategy: Strategy,
    /// DDP implementation.
    pub variant: Variant,
    pub bucket_cap_bytes: usize,
    /// libtorch intra-op threads per worker (default 1 when several workers share the machine).
    pub threads_per_worker: Option<i32>,
    /// ZeRO-3/FSDP: free each block's parameters after its forward (see
    /// [`Zero::reshard_after_forward`](crate::zero::Zero::reshard_after_forward)).
    pub reshard_after_forward: bool,
    /// ZeRO/FSDP: consecutive transformer blocks per unit (see
    /// [`Zero::with_blocks_per_unit`](crate::zero::Zero::with_blocks_per_unit)); default 1.
    pub blocks_per_unit: usize,
    /// Activation checkpointing: which blocks are recomputed in backward (lesson 09).
    pub activation_checkpointing: Checkpointing,
    /// The compute precision (lesson 08): fp32, or bf16/fp16 matrix multiplies with fp32 master
    /// weights ([`Gpt::with_precision`](crate::model::Gpt::with_precision)); ZeRO/FSDP gathers
    /// parameters in it. fp16 also needs a loss scaler ([`GradScaler`](crate::precision::GradScaler)).
    pub precision: Precision,
    /// ZeRO/FSDP: the precision gradients are reduced in ([`Zero::reduce_dtype`](crate::zero::Zero::reduce_dtype)); default fp32.
    pub reduce_dtype: Precision,
    /// ZeRO/FSDP: CPU offload of the master shards and the optimizer (see
    /// [`Zero::offload`](crate::zero::Zero::offload)); default off.
    #[serde(default)]
    pub offload: bool,
    /// Tensor-parallel group size (lesson 12): the world as (n/t) × t, data parallel over the
    /// rows (`strategy`: DDP or ZeRO 1/2/3), [`TpGpt`](crate::tp::TpGpt) within each; default 1
    /// (none). With `pipeline` stages too, p × n/(p·t) × t (pp × dp × tp, 3-D parallelism): each
    /// pipeline rank's stages split over its tensor-parallel group. Laid out by
    /// [`ParallelDims`](crate::engine::ParallelDims) and run by the engine.
    #[serde(default = "one")]
    pub tensor_parallel: usize,
    /// With `tensor_parallel > 1`: sequence parallelism ([`TpGpt::with_sequence_parallel`](crate::tp::TpGpt::with_sequence_parallel)).
    #[serde(default)]
    pub sequence_parallel: bool,
    /// Pipeline parallelism (lesson 13): the world as p × (n/p) (pp × dp), each column a p-rank
    /// pipeline, each row the data-parallel replicas of one stage (`strategy`: DDP or ZeRO
    /// 1/2/3); default 1 stage (none). With `tensor_parallel` > 1 too, each stage is split over a
    /// tensor-parallel group (3-D). Laid out by [`ParallelDims`](crate::engine::ParallelDims)
    /// and run by the engine.
    #[serde(default)]
    pub pipeline: crate::pipeline::PipelineConfig,
    pub comm: CommConfig,
    /// Arguments for re-executed worker processes (tests pass `--exact NAME`); default: ours.
    pub child_args: Option<Vec<String>>,
}

impl Default for ScalingConfig {
    fn default() -> Self {
        ScalingConfig {
            num_workers: 1,
            device: crate::device::DeviceChoice::Cpu,
            use_gpu: false,
            backend: Backend::Local,
            launch: None,
            strategy: Strategy::Ddp,
            variant: Variant::Bucketed,
            bucket_cap_bytes: ddp::DEFAULT_BUCKET_CAP_BYTES,
            threads_per_worker: None,
            reshard_after_forward: true,
            blocks_per_unit: 1,
            activation_checkpointing: Checkpointing::None,
            precision: Precision::Fp32,
            reduce_dtype: Precision::Fp32,
            offload: false,
            tensor_parallel: 1,
            sequence_parallel: false,
            pipeline: Default::default(),
            comm: CommConfig::default(),
            child_args: None,
        }
    }
}

fn one() -> usize {
    1
}

impl Trainer {
    pub(super) fn check(&self) -> anyhow::Result<()> {
        let s = &self.scaling;
        if s.use_gpu || s.device == crate::device::DeviceChoice::Cuda {
            // Refused here, in the driver, before any worker starts (each worker resolves its own GPU).
            crate::device::resolve(crate::device::DeviceChoice::Cuda, 0)?;
        }
        if s.num_workers == 0 {
            anyhow::bail!("num_workers must be at least 1");
        }
        if s.backend == crate::comm::Backend::Nccl && !(s.use_gpu || s.device == crate::device::DeviceChoice::Cuda) {
            anyhow::bail!("the nccl backend moves CUDA tensors: ask for device cuda (train --device cuda)");
        }
        if s.strategy == Strategy::Single && s.num_workers != 1 {
            anyhow::bail!("the single strategy runs one worker, not {}", s.num_workers);
        }
        if s.blocks_per_unit == 0 {
            anyhow::bail!("blocks_per_unit must be at least 1");
        }
        // More compute threads than cores: every rank waits for the others' time slices, and a
        // collective runs at the pace of the slowest. Say so once a process (the driver only).
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        // SHARDLAB_NUM_THREADS wins over threads_per_worker in the launcher; count what it will use.
        let per = std::env::var("SHARDLAB_NUM_THREADS")
            .ok()
            .and_then(|v| v.parse::<i32>().ok())
            .or(s.threads_per_worker)
            .unwrap_or(1)
            .max(1) as usize;
        let threads = s.num_workers * per;
        static SAID: std::sync::Once = std::sync::Once::new();
        if threads > cores && !crate::launch::is_spawned_child() {
            SAID.call_once(|| {
                eprintln!(
                    "warning: {} worker(s) × {per} libtorch thread(s) = {threads} compute threads on {cores} core(s): \
                 oversubscribed, steps will be slower and uneven (fewer workers, or fewer threads per worker: \
                 train --threads, SHARDLAB_NUM_THREADS, ScalingConfig::threads_per_worker)",
                    s.num_workers
                )
            });
        }
        Ok(())
    }
}
