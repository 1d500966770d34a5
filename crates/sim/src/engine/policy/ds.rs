//! DeepSpeed-MoE (§6.1 baseline `ds`): static expert parallelism on a multiple of the EP size
//! of nodes, frequent checkpoints to remote storage, a restart from the last checkpoint on every
//! failure, and a checkpoint-and-relaunch to take joiners.

use super::FailurePolicy;
use crate::cost::CostModel;
use crate::engine::{Run, Scenario};
use crate::error::SimError;

/// Static expert parallelism: groups of `ep_nodes` nodes, node i holds block i % ep_nodes.
#[derive(Debug, Clone, Copy)]
pub(in crate::engine) struct EpConfig {
    pub(in crate::engine) ep_nodes: usize,
    pub(in crate::engine) experts_per_node: usize,
}

/// DeepSpeed-MoE's layout, shared with DS-FT.
#[derive(Debug, Clone, Copy)]
pub(in crate::engine) struct Ds {
    pub(in crate::engine) ep: EpConfig,
}

impl Ds {
    /// Nodes per EP group: experts per GPU is the largest divisor of E that fits the slots
    /// (§6.1: GPT-S and GPT-L use 4 of 6 slots, GPT-M all 6).
    pub(in crate::engine) fn new(s: &Scenario) -> Self {
        let (e, slots, g) = (s.model.experts, s.cost.slots_per_gpu, s.cost.gpus_per_node);
        let per_gpu = (1..=slots.min(e)).rev().find(|s| e % s == 0).unwrap_or(1);
        let ep_nodes = (e / per_gpu).div_ceil(g);
        Ds { ep: EpConfig { ep_nodes, experts_per_node: e.div_ceil(ep_nodes) } }
    }
}

impl FailurePolicy for Ds {
    type Config = EpConfig;

    /// Whole EP groups only.
    fn nodes_usable(&self, _s: &Scenario, n: usize) -> usize {
        let ep = self.ep.ep_nodes;
        (n / ep) * ep
    }

    fn fresh_config(&self, _run: &Run<'_, Self>, _n: usize) -> Result<EpConfig, SimError> {
        Ok(self.ep)
    }

    fn checkpoint_every(&self, cost: &CostModel) -> u64 {
        cost.checkpoint_every_ds
    }

    fn on_failure(&self, run: &mut Run<'_, Self>, _failed: &[String], _survivors: Vec<String>) -> Result<(), SimError> {
        run.restart()
    }

    /// Save, relaunch on more nodes, load: nothing is rolled back.
    fn scale_up(&self, run: &mut Run<'_, Self>, nodes: Vec<String>) -> Result<(), SimError> {
        let c = run.cost();
        let t = 2.0 * c.checkpoint_s(&run.s.model) + c.restart_s;
        run.relaunch_with_checkpoint(nodes, self.ep, t);
        Ok(())
    }

    fn imbalance(&self, cost: &CostModel, config: &EpConfig, loads: &[Vec<f64>]) -> f64 {
        ep_imbalance(cost, config, loads)
    }
}

/// Each GPU holds a contiguous block of experts; the most loaded one sets the pace.
pub(super) fn ep_imbalance(cost: &CostModel, config: &EpConfig, loads: &[Vec<f64>]) -> f64 {
    let g = cost.gpus_per_node;
    let per_gpu = config.experts_per_node.div_ceil(g);
    let gpus = config.ep_nodes * g;
    let mut imbalance = 0.0;
    for l in loads {
        let worst = l.chunks(per_gpu).map(|c| c.iter().sum::<f64>()).fold(0.0, f64::max);
        imbalance += worst * gpus as f64;
    }
    imbalance / loads.len().max(1) as f64
}
