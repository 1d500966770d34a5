//! The Lazarus worker runtime (paper §4.2): one rank of a data- and expert-parallel job.
//!
//! * [`DistributedMoe`] — one MoE layer over the ranks with the flexible token dispatcher: route,
//!   all-gather the per-expert token counts, compute the shared dispatch schedule, send each
//!   token slot to a replica with a padding-free all-to-all, run the local experts, send results
//!   back and combine; backward mirrors it. Autograd cannot see across an all-to-all, so the
//!   layer is a chain of *segments* (docs/architecture.md, a training step).
//! * [`Worker`] — the full training step over every layer, computed and then committed (a step
//!   that fails is dropped whole), checkpoints in the single-process format, and an expert's
//!   state in and out ([`ExpertState`], the one wire form of an expert's weights and optimizer
//!   state).
//! * [`bench`] — the per-rank part of `lazarus bench moe-layer`.

mod error;
mod expert_state;
mod host_copy;
mod moe;
mod shared_state;
mod tensor_wire;
mod worker;

pub use error::RuntimeError;
pub use expert_state::{ExpertState, EXPERT_TENSORS};
pub use moe::{DispatchMode, DistributedMoe, ExpertGrads, ExpertWeights, MoeForward, MoeGrads, DEFAULT_BUCKET_BYTES};
pub use shared_state::SharedState;
pub use tensor_wire::TensorTrainState;
pub use worker::{
    batch_share, check_plan, pause_signal, validate_worker_config, FaultHook, FaultPoint, PauseSignal, PendingStep, Reconfiguration,
    ReconfigureReport, SnapshotHeld, SnapshotSettings, SnapshotStepStats, Worker, WorkerOptions, WorkerStepReport,
};
