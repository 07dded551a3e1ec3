//! Lesson 15's cluster simulator: what a layout of a GPT would cost on thousands of GPUs — step
//! time, tokens/s, MFU, memory per GPU and where the time goes — from the course's own pipeline
//! schedules run in virtual time on a model of the hardware.
//!
//! ```text
//! cargo run --release --bin plan -- --simulate --gpu a100-80gb --n-layer 96 --n-embd 12288 --n-head 96 \
//!     --dp 8 --tp 8 --pp 16 --global-batch-size 1536 --recompute full
//! ```
//!
//! * [`calibrate`] — this machine as a profile: its kernels timed, its transport fitted to α-β;
//! * [`hardware`] — GPU and network profiles (A100, H100, H200), each figure with its source;
//! * [`collective`] — a collective's time on a group placed on nodes (ring, tree, the NIC bound);
//! * [`model`] — a GPT's parameters, FLOPs, GEMM shapes and element-wise traffic per layer;
//! * [`gemm`] — a GEMM's time by its shape (tile and wave quantization);
//! * [`step`] — one step: the pipeline simulated, data parallelism and the optimizer added;
//! * [`dp_comm`] — data parallelism's reduction (and ZeRO's gathers) by stage, and what of it shows;
//! * [`tp_comm`] — tensor parallelism's collectives in a step: every layer's, the embedding's,
//!   the output layer's and the loss's;
//! * [`search`] — every layout that fits, ranked by tokens/s;
//! * [`validate`] — the published runs the simulator is checked against.

pub mod calibrate;
pub mod collective;
pub mod dp_comm;
pub mod gemm;
pub mod hardware;
pub mod model;
pub mod search;
pub mod step;
pub mod tp_comm;
pub mod validate;

pub use collective::{bus_bandwidth, Coll, Placement};
pub use hardware::{profile, profiles, Gpu, Link};
pub use model::Model;
pub use search::{search, why_faster, Candidate};
pub use step::{simulate_step, Layout, Memory, Prediction, Split};
