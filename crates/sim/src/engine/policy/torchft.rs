//! Replica groups that leave and come back (`torchft`): torchft (PyTorch, 2025) keeps a quorum of
//! data-parallel replica groups per step; a failed group leaves the quorum while the others train
//! on, and a healed group fetches the live state from a peer and rejoins — no job-wide restart,
//! provided the model fits in one group.
//!
//! Here: one replica group is one EP group of DeepSpeed-MoE's static layout (it holds every
//! expert). A failure drops the groups of the failed nodes: the others go on after the time-out
//! and a quorum change (the group rebuild), and lose only the step in flight; the dropped groups'
//! surviving nodes wait as spares and, with joiners, come back as whole groups at a step
//! boundary for a quorum change (their fetch of the live state runs beside the others' training,
//! not charged to them: a simplification in its favour). Storage checkpoints as DS-FT's, for the
//! failure that leaves no group.

use super::ds::{ep_imbalance, Ds, EpConfig};
use super::FailurePolicy;
use crate::cost::CostModel;
use crate::engine::{Busy, Run, Scenario};
use crate::error::SimError;

#[derive(Debug, Clone, Copy)]
pub(in crate::engine) struct TorchFt {
    ds: Ds,
}

impl TorchFt {
    pub(in crate::engine) fn new(s: &Scenario) -> Self {
        TorchFt { ds: Ds::new(s) }
    }
}

impl FailurePolicy for TorchFt {
    type Config = EpConfig;

    fn nodes_usable(&self, s: &Scenario, n: usize) -> usize {
        self.ds.nodes_usable(s, n)
    }

    fn fresh_config(&self, _run: &Run<'_, Self>, _n: usize) -> Result<EpConfig, SimError> {
        Ok(self.ds.ep)
    }

    fn checkpoint_every(&self, cost: &CostModel) -> u64 {
        cost.checkpoint_every_ds_ft
    }

    /// The groups without a failed node go on; a restart when none is left.
    fn on_failure(&self, run: &mut Run<'_, Self>, failed: &[String], _survivors: Vec<String>) -> Result<(), SimError> {
        let size = self.ds.ep.ep_nodes;
        let kept: Vec<String> =
            run.used.chunks(size).filter(|group| group.iter().all(|n| !failed.contains(n))).flatten().cloned().collect();
        if kept.is_empty() {
            return run.restart();
        }
        let c = run.cost();
        let t = c.failure_timeout_s + c.group_rebuild_s;
        run.switch(kept, self.ds.ep, Busy::Reconfig, t);
        Ok(())
    }

    /// Whole groups join the quorum at a step boundary.
    fn scale_up(&self, run: &mut Run<'_, Self>, nodes: Vec<String>) -> Result<(), SimError> {
        let t = run.cost().group_rebuild_s;
        run.switch(nodes, self.ds.ep, Busy::Reconfig, t);
        Ok(())
    }

    fn imbalance(&self, cost: &CostModel, config: &EpConfig, loads: &[Vec<f64>]) -> f64 {
        ep_imbalance(cost, config, loads)
    }
}
