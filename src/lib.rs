//! # shardlab
//!
//! Distributed LLM training as a numbered, tested course — and the small, real library the course
//! builds: process groups and collectives that move bytes between threads, processes and machines
//! ([`comm`]), and a launcher ([`launch`]). Later lessons add DDP, FSDP, ZeRO, mixed precision and
//! checkpointing on top.
//!
//! Start with `use shardlab::prelude::*;`.

pub mod bench;
pub mod checkpoint;
pub mod comm;
pub mod corpus;
pub mod data;
pub mod ddp;
pub mod device;
pub mod engine;
pub mod flops;
pub mod grading;
pub mod job;
pub mod launch;
pub mod memory;
pub mod model;
pub mod optim;
pub mod params;
pub mod pipeline;
pub mod plot;
pub mod precision;
pub mod rng;
pub mod sim;
pub mod stages;
pub mod stats;
pub mod tp;
pub mod trainer;
pub mod zero;

/// Re-exported so notebooks and bins can build and read `report` metrics without their own dependency.
pub use serde_json;

/// Everything a lesson, bin or notebook usually needs.
pub mod prelude {
    pub use crate::comm::{
        Algo, Backend, CommConfig, CommError, CommResult, CommStats, DType, DataPath, DeviceMesh, OpKind, ProcessGroup,
        ReduceOp, TcpInit, Work, WorkTiming,
    };
    pub use crate::data::{synthetic_corpus, DistributedSampler, Tokens};
    pub use crate::ddp::{DataParallel, DdpBucketed, DdpNaive, DdpStats, StepOutput, Variant};
    pub use crate::launch::{is_spawned_child, spawn, spawn_with, Launch, LaunchError, SpawnOptions};
    pub use crate::model::{zero_grads, Batch, Gpt, GptConfig, Mlp, MlpConfig, Model};
    pub use crate::optim::{AdamW, AdamWConfig, LrSchedule, Optimizer, Sgd, StepConfig};
    pub use crate::plot::{BarChart, LineChart, Units};
    pub use crate::precision::{GradScaler, Precision};
    pub use crate::stages::{staged_backward, Checkpointing};
    pub use crate::trainer::{ScalingConfig, Strategy, TrainContext, Trainer};
    pub use serde_json::json;
    pub use tch::{Device, Kind, Tensor};
}
