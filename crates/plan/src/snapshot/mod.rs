//! The snapshot tier's decisions (MoEtion §4, PEC §3; docs/architecture.md, snapshots): which experts to
//! copy into another node's memory after a step ([`selection`]), and how many bytes a step may
//! send when no bandwidth is given ([`pace`]).
//!
//! Both are pure functions of inputs every rank shares (the step's global token counts, the plan,
//! the all-reduced step time and cost of the last round), so senders and receivers agree without
//! a message.

pub mod pace;
pub mod selection;

pub use pace::{RoundCost, SnapshotPace, SNAPSHOT_CPU_SHARE};
pub use selection::{nodes_holding, select_snapshots, SnapshotPolicy, SnapshotSelection};

use serde::{Deserialize, Serialize};

/// A snapshot a worker keeps for another node: expert `expert` of layer `layer` as it was after
/// `step`, and the tokens the expert has processed since (what a restore from it loses: PEC's
/// PLT), as the worker tells the controller (a worker's `held_snapshots`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotHeld {
    pub layer: usize,
    pub expert: usize,
    pub step: u64,
    /// Over the steps the keeper committed after `step`.
    pub tokens_lost: u64,
    /// In the step the keeper computed but holds uncommitted (its vote failed): lost as well
    /// when the move commits that step, which the keeper then commits without a snapshot round.
    #[serde(default)]
    pub held_step_tokens: u64,
}
