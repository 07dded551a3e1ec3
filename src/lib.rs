//! # shardlab
//!
//! Distributed LLM training as a numbered, tested course — and the small, real library the course
//! builds: process groups and collectives that move bytes between threads, processes and machines
//! ([`comm`]), and a launcher ([`launch`]). Later lessons add DDP, FSDP, ZeRO, mixed precision and
//! checkpointing on top.
//!
//! Start with `use shardlab::prelude::*;`.

pub mod bench;
pub mod comm;
pub mod launch;
pub mod params;
pub mod plot;

/// Everything a lesson, bin or notebook usually needs.
pub mod prelude {
    pub use crate::comm::{
        Algo, Backend, CommConfig, CommError, CommResult, CommStats, DType, ProcessGroup, ReduceOp, TcpInit, Work,
    };
    pub use crate::launch::{is_spawned_child, spawn, spawn_with, Launch, LaunchError, SpawnOptions};
    pub use crate::plot::{BarChart, LineChart};
    pub use tch::{Device, Kind, Tensor};
}
