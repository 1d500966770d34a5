//! The one scheduler: allocate (Eq. 1), then place, for every MoE layer — from measured loads
//! and the previous plan (paper §4.1, §4.3).
//!
//! `lazarus plan`, `lazarus train --workers`, the benchmarks, the simulator and the controller
//! all call [`plan_model`] (or [`plan_layer`] for one layer); nothing else allocates and places.
//! What differs between them is a [`PlanPolicy`] value, not code.
//!
//! Files: this one holds the policy and the planning functions; `model_plan` the plan of a whole
//! model ([`ModelPlan`], with the survival check) and the runtime's view of it ([`ReplicaMap`]);
//! `file` the one JSON format of a plan.

mod file;
mod map_change;
mod model_plan;
#[cfg(test)]
mod tests;

pub use file::{PlanFile, PlanFileLayer, PLAN_FORMAT};
pub use map_change::{ExpertChange, PlanUpdate, ReplicaMapChange};
pub use model_plan::{ModelPlan, ReplicaMap};

use crate::allocation::{allocate, ReplicaAllocation};
use crate::error::PlanError;
use crate::placement::{place, place_balanced, repair_nodes, ClusterShape, Placement, Strategy, DEFAULT_MAX_IMBALANCE, SEARCH_MAX_NODES};

/// How the scheduler plans a layer: the fault-tolerance floor, the placement strategy and the
/// throughput guard. One value per use, chosen by the caller: the trainer's and the
/// controller's is [`PlanPolicy::trainer`], the paper's simulator runs the unguarded one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanPolicy {
    /// Fault-tolerance floor f: every expert gets at least this many replicas (allocation lowers
    /// it to ⌊N·G·c / E⌋ when the slots cannot hold f per expert).
    pub floor: usize,
    pub strategy: Strategy,
    /// The throughput guard of [`place_balanced`]: the most fault-tolerant placement on which
    /// no node needs more than this many times its mean share of tokens under the balanced
    /// dispatcher. `None`: no guard. Only with [`Strategy::Lazarus`].
    pub max_imbalance: Option<f64>,
    /// After nodes are lost or join, keep every survivor's replicas where they are and change
    /// only what must change ([`replan_model`]) instead of planning afresh, on clusters past
    /// the exact search's size. The trainer's and the controller's policy do; the paper's
    /// (the simulator's) plans afresh, as the paper does.
    pub keep_survivors: bool,
}

impl PlanPolicy {
    /// The paper's plan: floor `floor`, the `lazarus` strategy, no throughput guard (the
    /// simulator models Algorithm 1's per-replica shares, under which the guard buys nothing).
    pub fn unguarded(floor: usize) -> Self {
        PlanPolicy { floor, strategy: Strategy::Lazarus, max_imbalance: None, keep_survivors: false }
    }

    /// What `train --workers` and the controller plan with on `nodes` nodes: floor 2 (1 on a
    /// single node, where a second replica protects nothing), the `lazarus` strategy, and the
    /// throughput guard `max_imbalance` (the default is [`DEFAULT_MAX_IMBALANCE`]).
    pub fn trainer(nodes: usize, max_imbalance: Option<f64>) -> Self {
        PlanPolicy { floor: if nodes > 1 { 2 } else { 1 }, strategy: Strategy::Lazarus, max_imbalance, keep_survivors: true }
    }

    /// The trainer's policy with the default guard.
    pub fn trainer_default(nodes: usize) -> Self {
        Self::trainer(nodes, Some(DEFAULT_MAX_IMBALANCE))
    }

    /// A guard is a finite ratio ≥ 1 and needs the `lazarus` strategy.
    pub fn validate(&self) -> Result<(), PlanError> {
        if let Some(m) = self.max_imbalance {
            if !m.is_finite() || m < 1.0 {
                return Err(PlanError::invalid("max_imbalance", m, "must be a finite ratio ≥ 1 (busiest node's tokens over the mean)"));
            }
            if self.strategy != Strategy::Lazarus {
                return Err(PlanError::invalid(
                    "max_imbalance",
                    m,
                    format!("the throughput guard needs the lazarus strategy, not {}", self.strategy),
                ));
            }
        }
        Ok(())
    }
}

/// One layer planned from its loads: the allocation (with the floor that was applied) and the
/// placement.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerPlan {
    pub allocation: ReplicaAllocation,
    pub placement: Placement,
}

/// Allocate (Eq. 1) and place one layer from its loads.
pub fn plan_layer(loads: &[f64], shape: ClusterShape, policy: &PlanPolicy) -> Result<LayerPlan, PlanError> {
    plan_layer_after(loads, shape, policy, None)
}

/// [`plan_layer`], keeping `previous` when the new allocation gives every expert as many
/// replicas as it has there, on the same cluster, and (with a guard) it still meets the guard
/// under the new loads: the placement then need not change, so no state moves.
fn plan_layer_after(loads: &[f64], shape: ClusterShape, policy: &PlanPolicy, previous: Option<&Placement>) -> Result<LayerPlan, PlanError> {
    policy.validate()?;
    let allocation = allocate(loads, shape.total_slots(), policy.floor)?;
    if let Some(p) = previous {
        if p.shape() == shape && p.replica_counts() == allocation.replicas && meets_guard(p, loads, policy)? {
            return Ok(LayerPlan { allocation, placement: p.clone() });
        }
    }
    let placement = match policy.max_imbalance {
        Some(m) => place_balanced(&allocation.replicas, shape, loads, m)?,
        None => place(&allocation.replicas, shape, policy.strategy, Some(loads))?,
    };
    Ok(LayerPlan { allocation, placement })
}

/// Below this many (layers × nodes) the layers are planned on the calling thread.
const PARALLEL_MIN_WORK: usize = 256;

/// Plan every MoE layer of a model on `shape` from `loads[layer][expert]`, under `policy`.
///
/// With a `previous` plan (the one running now), each layer whose allocation is unchanged on
/// the same cluster keeps its placement (see [`plan_layer`]), and the new plan's epoch is the
/// previous one's plus one; without, the epoch is 0. Layers are independent (§4.1), so large
/// models are planned on all cores; the result does not depend on how many there are.
pub fn plan_model(
    loads: &[Vec<f64>],
    shape: ClusterShape,
    policy: &PlanPolicy,
    previous: Option<&ModelPlan>,
) -> Result<ModelPlan, PlanError> {
    policy.validate()?;
    let Some(first) = loads.first() else {
        return Err(PlanError::invalid("loads", "[]", "at least one MoE layer is needed"));
    };
    if let Some((l, layer)) = loads.iter().enumerate().find(|(_, x)| x.len() != first.len()) {
        return Err(PlanError::invalid("loads", format!("layer {l} with {} experts", layer.len()), format!("layer 0 has {}", first.len())));
    }
    let previous_layers: Vec<Option<&Placement>> = match previous {
        Some(p) if p.layers().len() == loads.len() => p.layers().iter().map(Some).collect(),
        _ => vec![None; loads.len()],
    };
    let jobs: Vec<(&Vec<f64>, Option<&Placement>)> = loads.iter().zip(previous_layers).collect();
    let plan = |&(l, prev): &(&Vec<f64>, Option<&Placement>)| plan_layer_after(l, shape, policy, prev).map(|p| p.placement);
    let layers: Vec<Placement> = if jobs.len() * shape.nodes < PARALLEL_MIN_WORK {
        jobs.iter().map(plan).collect::<Result<_, _>>()?
    } else {
        crate::parallel::map_in_order(&jobs, plan)?
    };
    ModelPlan::new(previous.map_or(0, |p| p.epoch() + 1), layers)
}

/// Plan every MoE layer again after the cluster's nodes changed: node i of the new plan is node
/// `origin[i]` of `previous` (`None`: a node that joins, holding nothing).
///
/// With a policy that keeps survivors ([`PlanPolicy::keep_survivors`]) on a cluster past the
/// exact search's size, each layer is the previous placement repaired (see
/// `placement/repair.rs`): what a survivor holds stays in its slot unless its expert now has too
/// many replicas, and only the missing replicas are placed — so a node lost among a thousand
/// moves about that node's state, not the model's; with the same nodes in the same places (a
/// rebalance), only what the new loads' allocation changes moves. A repaired layer that breaks
/// the policy's throughput guard is planned afresh where that balances better. Otherwise, and on
/// small clusters (where the optimum is
/// searched exactly and the optimal node mapping limits what moves), every layer is planned
/// afresh as by [`plan_model`].
///
/// Returns the plan and whether its nodes are in `origin`'s order by construction (true when
/// at least one layer was repaired): then node i of the plan *is* the node that was
/// `origin[i]`, and the caller need not search for the mapping that moves least.
pub fn replan_model(
    loads: &[Vec<f64>],
    shape: ClusterShape,
    policy: &PlanPolicy,
    previous: &ModelPlan,
    origin: &[Option<usize>],
) -> Result<(ModelPlan, bool), PlanError> {
    if origin.len() != shape.nodes {
        return Err(PlanError::Length { field: "origin", got: origin.len(), expected: shape.nodes });
    }
    // (The same nodes in the same places — a rebalance — are repaired too: each expert's
    // replicas brought to what the measured loads ask, the rest left where it is.)
    let repair = policy.keep_survivors && shape.nodes > SEARCH_MAX_NODES && previous.layers().len() == loads.len();
    if !repair {
        return plan_model(loads, shape, policy, Some(previous)).map(|p| (p, false));
    }
    policy.validate()?;
    let jobs: Vec<(&Vec<f64>, &Placement)> = loads.iter().zip(previous.layers()).collect();
    let plan = |&(l, prev): &(&Vec<f64>, &Placement)| -> Result<(Placement, bool), PlanError> {
        match repair_layer(l, shape, policy, prev, origin)? {
            Some(repaired) => Ok(repaired),
            None => plan_layer(l, shape, policy).map(|p| (p.placement, false)),
        }
    };
    let layers: Vec<(Placement, bool)> = crate::parallel::map_in_order(&jobs, plan)?;
    let repaired = layers.iter().any(|(_, r)| *r);
    ModelPlan::new(previous.epoch() + 1, layers.into_iter().map(|(p, _)| p).collect()).map(|p| (p, repaired))
}

/// One layer repaired ([`replan_model`]): the repaired placement (`true`), or a fresh plan
/// (`false`) where the repair is past the guard and a fresh plan balances better; None when the
/// repair does not fit. (Where the slots cannot meet the guard at all — one slot a GPU, more
/// GPUs than experts — planning afresh would move every replica for nothing.)
fn repair_layer(
    loads: &[f64],
    shape: ClusterShape,
    policy: &PlanPolicy,
    previous: &Placement,
    origin: &[Option<usize>],
) -> Result<Option<(Placement, bool)>, PlanError> {
    let allocation = allocate(loads, shape.total_slots(), policy.floor)?;
    let Some(nodes) = repair_nodes(previous, origin, &allocation.replicas, shape, loads) else {
        return Ok(None);
    };
    let repaired = Placement::from_nodes(shape, previous.experts(), nodes)?;
    let Some(kept) = past_guard(&repaired, loads, policy)? else { return Ok(Some((repaired, true))) };
    if kept <= imbalance_floor(loads, &repaired.replica_counts(), shape.ranks()) * (1.0 + 1e-9) {
        // No placement of these replicas balances better.
        return Ok(Some((repaired, true)));
    }
    let fresh = plan_layer(loads, shape, policy)?.placement;
    if kept <= fresh.load_balance(loads)?.imbalance() * (1.0 + 1e-9) {
        Ok(Some((repaired, true)))
    } else {
        Ok(Some((fresh, false)))
    }
}

/// The least imbalance any placement of `replicas[e]` replicas of each expert over `gpus` GPUs
/// can have under `loads`: each expert's tokens go to at most its replicas' GPUs, so some GPU
/// takes at least `loads[e] / replicas[e]` of them, and the busiest at least the mean.
fn imbalance_floor(loads: &[f64], replicas: &[usize], gpus: usize) -> f64 {
    let mean = loads.iter().sum::<f64>() / gpus.max(1) as f64;
    if mean <= 0.0 {
        return 1.0;
    }
    let busiest = loads.iter().zip(replicas).map(|(&l, &r)| l / r.max(1) as f64).fold(mean, f64::max);
    busiest / mean
}

/// Whether a placement kept or repaired meets the policy's throughput guard under `loads`.
/// Each expert's tokens split evenly over its replicas is one way to dispatch, so its busiest
/// GPU bounds λ* from above: a placement within the guard that way needs no max-flow.
fn meets_guard(placement: &Placement, loads: &[f64], policy: &PlanPolicy) -> Result<bool, PlanError> {
    Ok(past_guard(placement, loads, policy)?.is_none())
}

/// [`meets_guard`]'s check, with the imbalance (λ*/mean, by max-flow) of a placement past the
/// guard: None when it meets it.
fn past_guard(placement: &Placement, loads: &[f64], policy: &PlanPolicy) -> Result<Option<f64>, PlanError> {
    let Some(m) = policy.max_imbalance else { return Ok(None) };
    let limit = m * (1.0 + 1e-9);
    if placement.even_split_balance(loads)?.imbalance() <= limit {
        return Ok(None);
    }
    let imbalance = placement.load_balance(loads)?.imbalance();
    Ok((imbalance > limit).then_some(imbalance))
}
