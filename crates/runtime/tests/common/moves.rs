//! What the tests of a move (a worker that joins, a worker lost) share: their job, and its plans
//! on single-GPU nodes of three slots with the experts' loads skewed 4:3:2:1.

use lazarus_model::TrainConfig;
use lazarus_plan::{plan_model, ClusterShape, ModelPlan, PlanPolicy};

/// Steps of the job.
pub const STEPS: u64 = 8;

pub fn config() -> TrainConfig {
    crate::common::tiny_config(2, STEPS, 6, 11, (5, 30_000))
}

/// The plan of `nodes` single-GPU nodes with three slots each, every expert at least twice,
/// repaired from `previous` where there is one.
pub fn plan_for(nodes: usize, previous: Option<&ModelPlan>) -> ModelPlan {
    let loads = vec![vec![4.0, 3.0, 2.0, 1.0]; config().model.moe_layers()];
    plan_model(&loads, ClusterShape::new(nodes, 1, 3).unwrap(), &PlanPolicy::trainer(nodes, None), previous).unwrap()
}
