//! DeepSpeed-MoE with Lazarus's reconfiguration (§6.1 baseline `ds-ft`): DS's static EP layout,
//! but after a failure it regroups the survivors into complete EP groups while a full copy of the
//! experts survives among the nodes in use (restarting otherwise), checkpoints as rarely as
//! Lazarus, and takes joiners by the same regrouping.

use super::ds::{ep_imbalance, regroup, Ds, EpConfig};
use super::FailurePolicy;
use crate::cost::CostModel;
use crate::engine::{Run, Scenario};
use crate::error::SimError;

#[derive(Debug, Clone, Copy)]
pub(in crate::engine) struct DsFt {
    ds: Ds,
}

impl DsFt {
    pub(in crate::engine) fn new(s: &Scenario) -> Self {
        DsFt { ds: Ds::new(s) }
    }

    /// Regroup `nodes` into complete EP groups ([`regroup`]). Live nodes left out after a
    /// failure are retired: DS-FT never takes them back (§6.2).
    fn regroup(&self, run: &mut Run<'_, Self>, nodes: Vec<String>, after_failure: bool) -> Result<(), SimError> {
        let c = run.cost();
        let fixed = c.group_rebuild_s + if after_failure { c.failure_timeout_s } else { 0.0 };
        regroup(run, self.ds.ep, nodes, after_failure, fixed)
    }
}

impl FailurePolicy for DsFt {
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

    /// Reconfigure while every expert block keeps a live holder among the nodes in use and a
    /// whole EP group survives; restart otherwise.
    fn on_failure(&self, run: &mut Run<'_, Self>, failed: &[String], survivors: Vec<String>) -> Result<(), SimError> {
        let ep = self.ds.ep.ep_nodes;
        let full_copy = (0..ep).all(|b| (0..run.used.len()).any(|i| i % ep == b && !failed.contains(&run.used[i])));
        if full_copy && survivors.len() >= ep {
            self.regroup(run, survivors, true)
        } else {
            run.restart()
        }
    }

    fn scale_up(&self, run: &mut Run<'_, Self>, nodes: Vec<String>) -> Result<(), SimError> {
        self.regroup(run, nodes, false)
    }

    fn imbalance(&self, cost: &CostModel, config: &EpConfig, loads: &[Vec<f64>]) -> f64 {
        ep_imbalance(cost, config, loads)
    }
}
