//! The policies the simulator compares (§6.1's baselines and the systems users pick today),
//! each one file behind
//! [`FailurePolicy`]: what the simulated system does about failures and joins. The engine
//! ([`super::Run`]) keeps time, membership, training progress, checkpoints and restarts; a policy
//! only decides.
//!
//! Adding a policy: a file here with a type implementing [`FailurePolicy`], a variant of
//! [`Policy`] with its name, and its arm in [`super::simulate`].

mod ds;
mod ds_ft;
mod gemini;
mod lazarus;
mod moevement;
mod static_ep;
mod torchft;

use serde::Serialize;

use super::Run;
use crate::cost::CostModel;
use crate::engine::Scenario;
use crate::error::SimError;
pub(super) use ds::Ds;
pub(super) use ds_ft::DsFt;
pub(super) use gemini::Gemini;
pub(super) use lazarus::Lazarus;
pub(super) use moevement::MoEvement;
pub(super) use static_ep::StaticEp;
pub(super) use torchft::TorchFt;

/// What the simulated system does about failures (§6.1 baselines).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Adaptive replicas and fault-tolerant placement; reconfigure while every expert keeps a
    /// replica, restart from the last checkpoint otherwise; rebalance periodically.
    Lazarus,
    /// DeepSpeed-MoE: static expert parallelism on a multiple of the EP size of nodes, frequent
    /// checkpoints to remote storage, restart on every failure.
    Ds,
    /// DeepSpeed-MoE with Lazarus's reconfiguration: reconfigure while a full copy of the experts
    /// survives among the nodes in use, restart otherwise.
    DsFt,
    /// In-memory checkpoints in peers' CPU memory, a whole-job restart from them (Gemini).
    Gemini,
    /// Sparse per-expert snapshots every step, the lost state restored without a job-wide
    /// rollback (MoEvement/MoEtion).
    #[serde(rename = "moevement")]
    MoEvement,
    /// Replica groups that leave the quorum on a failure and come back healed (torchft).
    #[serde(rename = "torchft")]
    TorchFt,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::Lazarus => "lazarus",
            Policy::Ds => "ds",
            Policy::DsFt => "ds-ft",
            Policy::Gemini => "gemini",
            Policy::MoEvement => "moevement",
            Policy::TorchFt => "torchft",
        }
    }

    /// Every policy, Lazarus first.
    pub const ALL: [Policy; 6] = [Policy::Lazarus, Policy::Ds, Policy::DsFt, Policy::Gemini, Policy::MoEvement, Policy::TorchFt];
}

/// Every decision that differs between the simulated systems.
///
/// The engine calls these at fixed points of its event loop; the methods that act
/// (`rebalance`, `on_failure`, `scale_up`) end in one of the engine's mechanisms:
/// [`Run::restart`] (roll back to the last checkpoint and relaunch), [`Run::switch`] (move to a
/// new configuration without a restart) or [`Run::relaunch_with_checkpoint`].
pub(super) trait FailurePolicy: Sized {
    /// The parallel configuration the policy trains with over the nodes in use.
    type Config;

    /// How many of `n` live nodes the policy can use (0: none, the job waits).
    fn nodes_usable(&self, s: &Scenario, n: usize) -> usize;

    /// Its configuration on `n` nodes (a value `nodes_usable` returned) at the job's start or
    /// after a restart; `run.config` still holds the configuration before, if any.
    fn fresh_config(&self, run: &Run<'_, Self>, n: usize) -> Result<Self::Config, SimError>;

    /// Steps between checkpoints.
    fn checkpoint_every(&self, cost: &CostModel) -> u64;

    /// Seconds the job stalls for one checkpoint: by default a whole save to remote storage.
    fn checkpoint_s(&self, run: &Run<'_, Self>) -> f64 {
        run.cost().checkpoint_s(&run.s.model)
    }

    /// Seconds from a failure to training again when the job restarts from its last
    /// checkpoint: by default the failure time-out, the relaunch and a whole load from storage.
    fn restart_s(&self, run: &Run<'_, Self>) -> f64 {
        let c = run.cost();
        run.detect_s + c.restart_s + c.checkpoint_s(&run.s.model)
    }

    /// Steps between rebalances, if it rebalances at all.
    fn rebalance_every(&self, _cost: &CostModel) -> Option<u64> {
        None
    }

    /// Rebalance at a step boundary (called only when `rebalance_every` is due).
    fn rebalance(&self, _run: &mut Run<'_, Self>) -> Result<(), SimError> {
        Ok(())
    }

    /// Nodes in use failed: `failed` are gone (already out of the live set), `survivors` are the
    /// rest of the nodes in use, in order. The step in flight is already counted as lost.
    fn on_failure(&self, run: &mut Run<'_, Self>, failed: &[String], survivors: Vec<String>) -> Result<(), SimError>;

    /// Nodes in use gave notice: at the end of the step in flight, move off `leaving` onto
    /// `staying` (the rest of the nodes in use) and any usable joiners, before they go.
    fn on_notice(&self, run: &mut Run<'_, Self>, leaving: &[String], staying: Vec<String>) -> Result<(), SimError>;

    /// Take more nodes at a step boundary: `nodes` are the nodes in use followed by the joiners,
    /// `nodes_usable` of them (more than are in use).
    fn scale_up(&self, run: &mut Run<'_, Self>, nodes: Vec<String>) -> Result<(), SimError>;

    /// Seconds nodes standing by since `ready_at` (`joining` of them) wait beyond the scale-up
    /// wait before the job moves to take them in; a move made before then for another reason
    /// takes them along (0: no longer than the scale-up wait).
    fn join_deferral_s(&self, _run: &Run<'_, Self>, _joining: usize, _ready_at: f64) -> f64 {
        0.0
    }

    /// How much the most loaded GPU stretches the expert part of a step under `config`, averaged
    /// over layers: 1 is perfect balance (`loads[layer][expert]`, each layer summing to 1).
    fn imbalance(&self, cost: &CostModel, config: &Self::Config, loads: &[Vec<f64>]) -> f64;
}
