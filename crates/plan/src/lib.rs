//! The planning core of Lazarus: every decision the controller makes, as pure functions.
//!
//! * [`allocation`] — how many replicas each expert gets (paper §4.1, Eq. 1);
//! * [`placement`] — where the replicas go (MRO of Theorem 1 and our `lazarus` strategy);
//! * [`balance`] — how evenly the balanced dispatcher can load the nodes of a placement;
//! * [`recovery`] — the probability that a plan survives k node failures;
//! * [`reconfig`] — which live node becomes which plan node and who sends what (§4.3);
//! * [`dispatch`] — how many tokens each rank sends to each rank (Algorithm 1);
//! * [`snapshot`] — which experts to copy into another node's memory each step (MoEtion §4),
//!   and how many bytes a step may take when no bandwidth is given;
//! * [`scheduler`] — the one scheduler (allocate, then place, every layer) and the plan of a
//!   whole model with its file format.
//!
//! No I/O, no clock: the same inputs give the same plan on every machine (the scheduler plans
//! layers on several threads, with the same result).

pub mod allocation;
pub mod balance;
pub mod dispatch;
pub mod distinct;
mod error;
mod fasthash;
pub mod load_trace;
pub mod nodeset;
pub mod parallel;
pub mod placement;
pub mod reconfig;
pub mod recovery;
pub mod rng;
pub mod scheduler;
pub mod snapshot;

pub use allocation::{allocate, ReplicaAllocation};
pub use balance::{min_max_load, LoadBalance};
pub use dispatch::{DispatchSchedule, RankLayout, TokenCounts};
pub use error::PlanError;
pub use load_trace::parse_load_trace;
pub use placement::{
    place, place_balanced, recovery_curve, recovery_probability, ClusterShape, Placement, Strategy, DEFAULT_MAX_IMBALANCE,
};
pub use reconfig::{
    plan_reconfiguration, plan_reconfiguration_mapped, rank_transfers, size_of_move, Move, MoveSize, NodeState, RankTransfer,
    ReconfigurationPlan, StateTransfer,
};
pub use recovery::{curve_of_sets, probability_of_sets, RecoveryEstimate, RecoveryMethod};
pub use scheduler::{
    plan_layer, plan_model, replan_model, ExpertChange, LayerPlan, ModelPlan, PlanFile, PlanFileLayer, PlanPolicy, PlanUpdate, ReplicaMap,
    ReplicaMapChange, PLAN_FORMAT,
};
pub use snapshot::{
    nodes_holding, select_snapshots, RoundCost, SnapshotHeld, SnapshotPace, SnapshotPolicy, SnapshotSelection, SNAPSHOT_CPU_SHARE,
};

/// Index of an expert within one MoE layer, 0-based in input order.
pub type ExpertId = usize;
