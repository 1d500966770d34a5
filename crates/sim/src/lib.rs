//! A discrete-event simulator of one MoE training job on a cluster whose nodes fail and join
//! (paper §6.2–6.4): Lazarus against DeepSpeed-MoE with checkpoint/restart (`ds`) and with
//! Lazarus's reconfiguration (`ds-ft`), on spot-instance traces or seeded failure patterns.
//! Allocation, placement, the recovery check and transfer sizes come from `lazarus-plan`.

pub mod cost;
pub mod engine;
mod error;
pub mod loads;
pub mod mix;
pub mod svg;
pub mod trace;

pub use cost::{CostModel, Dispatch, ModelSpec};
pub use engine::{
    simulate, Breakdown, Notices, Policy, PolicyReport, Scenario, SeriesPoint, MAX_BOUNDARIES, MAX_DURATION_S, MAX_LOAD_DRAWS,
};
pub use error::SimError;
pub use loads::LoadModel;
pub use mix::{Cause, FailureMix, Seen};
pub use trace::{parse_duration_ms, Change, Trace, TraceEvent, MAX_EVENTS, MAX_NODES};
