//! DeepSpeed-MoE's static expert-parallel layout, shared by every baseline that trains on it
//! (`ds`, `ds-ft`, `gemini`, `moevement`, `torchft`): whole EP groups of nodes, node i holding
//! expert block i mod the group size. [`StaticEp`] is the [`FailurePolicy`] of the layout — the
//! nodes it can use, its configuration, its imbalance — and hands what differs between the
//! baselines (checkpoints, failures, joiners) to an [`OnStaticEp`].

use std::collections::{HashMap, HashSet};

use super::FailurePolicy;
use crate::cost::CostModel;
use crate::engine::{Busy, Run, Scenario};
use crate::error::SimError;

/// Static expert parallelism: groups of `ep_nodes` nodes, node i holds block i % ep_nodes.
#[derive(Debug, Clone, Copy)]
pub(in crate::engine) struct EpConfig {
    pub(in crate::engine) ep_nodes: usize,
    pub(in crate::engine) experts_per_node: usize,
}

impl EpConfig {
    /// Nodes per EP group: experts per GPU is the largest divisor of E that fits the slots
    /// (§6.1: GPT-S and GPT-L use 4 of 6 slots, GPT-M all 6).
    pub(in crate::engine) fn of(s: &Scenario) -> Self {
        let (e, slots, g) = (s.model.experts, s.cost.slots_per_gpu, s.cost.gpus_per_node);
        let per_gpu = (1..=slots.min(e)).rev().find(|s| e % s == 0).unwrap_or(1);
        let ep_nodes = (e / per_gpu).div_ceil(g);
        EpConfig { ep_nodes, experts_per_node: e.div_ceil(ep_nodes) }
    }
}

/// The job of a baseline on the static layout.
pub(in crate::engine) type EpRun<'a, R> = Run<'a, StaticEp<R>>;

/// What a baseline on the static layout decides itself; `run` is the job, `ep` its layout.
pub(in crate::engine) trait OnStaticEp: Sized {
    /// Steps between checkpoints (default: as rarely as Lazarus, DS-FT's interval).
    fn checkpoint_every(&self, cost: &CostModel) -> u64 {
        cost.checkpoint_every_ds_ft
    }

    /// Seconds one checkpoint stalls the job (default: a whole save to storage).
    fn checkpoint_s(&self, run: &EpRun<'_, Self>) -> f64 {
        run.cost().checkpoint_s(&run.s.model)
    }

    /// Seconds from a failure to training again after a restart (default: the time-out, the
    /// relaunch and a whole load from storage); the time-out is how the failure was found out.
    fn restart_s(&self, run: &EpRun<'_, Self>) -> f64 {
        let c = run.cost();
        run.detect_s + c.restart_s + c.checkpoint_s(&run.s.model)
    }

    fn on_failure(&self, run: &mut EpRun<'_, Self>, ep: EpConfig, failed: &[String], survivors: Vec<String>) -> Result<(), SimError>;

    /// Nodes in use gave notice (default: the rest and any joiners regroup into whole EP
    /// groups at the end of the step in flight, as after a failure but with no time-out and no
    /// step lost).
    fn on_notice(&self, run: &mut EpRun<'_, Self>, ep: EpConfig, _leaving: &[String], staying: Vec<String>) -> Result<(), SimError> {
        let nodes = run.with_joiners(staying);
        let fixed = run.cost().group_rebuild_s;
        regroup(run, ep, nodes, false, fixed)
    }

    /// Take joiners at a step boundary (default: regroup into whole EP groups, each node that
    /// changes block fetching it, in a group rebuild).
    fn scale_up(&self, run: &mut EpRun<'_, Self>, ep: EpConfig, nodes: Vec<String>) -> Result<(), SimError> {
        let fixed = run.cost().group_rebuild_s;
        regroup(run, ep, nodes, false, fixed)
    }
}

/// A baseline on the static layout.
#[derive(Debug, Clone, Copy)]
pub(in crate::engine) struct StaticEp<R> {
    pub(in crate::engine) ep: EpConfig,
    on: R,
}

impl<R: OnStaticEp> StaticEp<R> {
    pub(in crate::engine) fn new(s: &Scenario, on: R) -> Self {
        StaticEp { ep: EpConfig::of(s), on }
    }
}

impl<R: OnStaticEp> FailurePolicy for StaticEp<R> {
    type Config = EpConfig;

    /// Whole EP groups only.
    fn nodes_usable(&self, _s: &Scenario, n: usize) -> usize {
        (n / self.ep.ep_nodes) * self.ep.ep_nodes
    }

    fn fresh_config(&self, _run: &Run<'_, Self>, _n: usize) -> Result<EpConfig, SimError> {
        Ok(self.ep)
    }

    fn checkpoint_every(&self, cost: &CostModel) -> u64 {
        self.on.checkpoint_every(cost)
    }

    fn checkpoint_s(&self, run: &Run<'_, Self>) -> f64 {
        self.on.checkpoint_s(run)
    }

    fn restart_s(&self, run: &Run<'_, Self>) -> f64 {
        self.on.restart_s(run)
    }

    fn on_failure(&self, run: &mut Run<'_, Self>, failed: &[String], survivors: Vec<String>) -> Result<(), SimError> {
        self.on.on_failure(run, self.ep, failed, survivors)
    }

    fn on_notice(&self, run: &mut Run<'_, Self>, leaving: &[String], staying: Vec<String>) -> Result<(), SimError> {
        self.on.on_notice(run, self.ep, leaving, staying)
    }

    fn scale_up(&self, run: &mut Run<'_, Self>, nodes: Vec<String>) -> Result<(), SimError> {
        self.on.scale_up(run, self.ep, nodes)
    }

    fn imbalance(&self, cost: &CostModel, config: &EpConfig, loads: &[Vec<f64>]) -> f64 {
        ep_imbalance(cost, config, loads)
    }
}

/// Each GPU holds a contiguous block of experts; the most loaded one sets the pace.
fn ep_imbalance(cost: &CostModel, config: &EpConfig, loads: &[Vec<f64>]) -> f64 {
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

/// Regroup `nodes` into complete EP groups of layout `ep`, keeping each node on its expert block
/// where it can; nodes whose block changes fetch it. The move takes `fixed_s` plus that fetch.
/// `retire`: the live nodes left out are not taken back before a restart (DS-FT, §6.2). A restart
/// when not one whole group can be made.
pub(super) fn regroup<P: FailurePolicy<Config = EpConfig>>(
    run: &mut Run<'_, P>,
    ep: EpConfig,
    nodes: Vec<String>,
    retire: bool,
    fixed_s: f64,
) -> Result<(), SimError> {
    let size = ep.ep_nodes;
    let groups = nodes.len() / size;
    if groups == 0 {
        return run.restart();
    }
    let index: HashMap<&str, usize> = run.used.iter().enumerate().map(|(i, u)| (u.as_str(), i)).collect();
    let block_of = |name: &String| index.get(name.as_str()).map(|i| i % size);
    let mut slots: Vec<Vec<String>> = vec![Vec::new(); size];
    let mut movers: Vec<String> = Vec::new();
    for n in &nodes {
        match block_of(n) {
            Some(b) if slots[b].len() < groups => slots[b].push(n.clone()),
            _ => movers.push(n.clone()),
        }
    }
    let mut fetch = false;
    for slot in slots.iter_mut() {
        while slot.len() < groups {
            match movers.pop() {
                Some(m) => {
                    slot.push(m);
                    fetch = true;
                }
                None => break,
            }
        }
    }
    let mut used = Vec::with_capacity(groups * size);
    for g in 0..groups {
        for slot in &slots {
            if let Some(n) = slot.get(g) {
                used.push(n.clone());
            }
        }
    }
    if used.len() != groups * size {
        return run.restart();
    }
    if retire {
        let kept: HashSet<&String> = used.iter().collect();
        run.retired.extend(nodes.iter().filter(|n| !kept.contains(n)).cloned());
    }
    let c = run.cost();
    let transfer =
        if fetch { c.transfer_s(ep.experts_per_node as f64 * run.s.model.layers as f64 * run.s.model.expert_state_bytes) } else { 0.0 };
    run.switch(used, ep, Busy::Reconfig, fixed_s + transfer, transfer);
    Ok(())
}

/// Save a checkpoint and relaunch without the nodes that gave notice, on the rest and any
/// joiners (whole groups), taking `seconds`: nothing is rolled back. A restart when not one group
/// is left.
pub(super) fn relaunch_without<R: OnStaticEp>(
    run: &mut EpRun<'_, R>,
    ep: EpConfig,
    staying: Vec<String>,
    seconds: f64,
) -> Result<(), SimError> {
    let mut nodes = run.with_joiners(staying);
    nodes.truncate((nodes.len() / ep.ep_nodes) * ep.ep_nodes);
    if nodes.is_empty() {
        return run.restart();
    }
    run.relaunch_with_checkpoint(nodes, ep, seconds);
    Ok(())
}
