//! Pipeline schedules (lesson 13): which forward and backward each stage runs, in which order.
//!
//! A model cut into `p` consecutive stages (one per rank) trains a batch as `m` micro-batches:
//! stage s runs the forward of micro-batch i after stage s−1 sent it the activations, and its
//! backward after stage s+1 sent back their gradient. What a schedule chooses is the order of one
//! stage's forwards `F i` and backwards `B i`:
//!
//! * **GPipe** (Huang et al. 2019): every forward, then every backward. Simple; each stage holds
//!   the activations of all `m` micro-batches at the turn.
//! * **1F1B** (PipeDream-Flush, Narayanan et al. 2021; Megatron's default): stage s runs
//!   `p − s − 1` warm-up forwards, then alternates one forward and one backward, then drains the
//!   remaining backwards. The same bubble as GPipe, but a stage never holds more than `p − s`
//!   micro-batches' activations.
//!
//! ```text
//! 1F1B, p = 4, m = 8, stage 0:  F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7
//!                    stage 3:  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7
//! ```
//!
//! * **Interleaved 1F1B** (Narayanan et al. 2021, §2.2.2): each rank holds v model chunks
//!   (virtual stages r, r + p, …), so a micro-batch crosses every rank v times; the bubble shrinks
//!   v-fold for v times the messages and more activations in flight ([`interleaved`] the order,
//!   [`simulate_chunks`] on paper, [`interleaved_step`] on real ranks).
//!
//! [`simulate`] runs a schedule on an idealised machine (a forward takes `t_f`, a backward `t_b`,
//! sends are free) and gives each operation's start and end: the pipeline diagram, the **bubble**
//! (idle time over the step) — `(p − 1)/(m + p − 1)` for both schedules when every stage is
//! equally fast — and the peak number of micro-batches whose activations a stage holds.

//!
//! The files: `schedule.rs` (the schedules and the simulator), `interleaved.rs` (interleaved 1F1B), `executor.rs` (one pipelined
//! forward and backward over real ranks: [`pipeline_step`]), `chunked.rs` (the same with v chunks
//! a rank: [`interleaved_step`], sends ordered by a rendezvous plan), `train.rs` (which parameters each
//! rank holds). A rank's optimizer step after it is the engine's (`crate::engine`:
//! `PipelinePiece`).

mod chunked;
mod executor;
mod interleaved;
mod schedule;
pub mod train;

pub use chunked::{interleaved_step, rendezvous_plan, Action, Msg};
pub use executor::{
    model_runner, partition, pipeline_step, pipeline_step_with, run_pipeline, PipelineStep, StageRunner,
};
pub use interleaved::{interleaved, interleaved_bubble_fraction, ChunkOp};
pub use schedule::{
    ascii_diagram, bubble_fraction, check, schedule, simulate, simulate_chunks, simulate_plans, simulate_timed, Op,
    PipelineConfig, Schedule, Slot, Timeline,
};
