//! Lazarus (§6.1): adaptive replica counts and fault-tolerant placement from the scheduler every
//! other part of Lazarus uses; after a failure it reconfigures while every expert keeps a replica
//! and restarts from the last checkpoint otherwise; it rebalances periodically and takes joiners
//! by reconfiguring onto them.

use std::collections::{BTreeMap, HashMap};

use lazarus_plan::{plan_model, plan_reconfiguration, ClusterShape, ModelPlan, NodeState, Placement, PlanPolicy};

use super::FailurePolicy;
use crate::cost::CostModel;
use crate::engine::{Busy, Run, Scenario};
use crate::error::SimError;

/// Lazarus's policy; its configuration is the plan of every layer over the nodes in use (plan
/// node i = `used[i]`).
#[derive(Debug, Clone, Copy)]
pub(in crate::engine) struct Lazarus;

impl Lazarus {
    /// Lazarus's plan for `n` nodes from the loads of `epoch`: the scheduler every other part
    /// of Lazarus uses (Eq. 1 allocation with floor f, lowered when slots run short;
    /// fault-tolerant placement, unguarded — the simulator models Algorithm 1's per-replica
    /// shares). Layers whose allocation is unchanged keep their placement.
    fn plan(run: &Run<'_, Self>, n: usize, epoch: u64) -> Result<ModelPlan, SimError> {
        let c = run.cost();
        let shape = ClusterShape::new(n, c.gpus_per_node, c.slots_per_gpu)?;
        Ok(plan_model(&run.loads(epoch), shape, &PlanPolicy::unguarded(c.min_replicas), run.config.as_ref())?)
    }

    /// Move to a new plan on `nodes` (survivors first, then joiners): the live nodes are mapped
    /// onto the plan's nodes and the missing expert states fetched from live holders
    /// (`plan_reconfiguration`), the slowest link setting the transfer time.
    fn reconfigure(run: &mut Run<'_, Self>, nodes: Vec<String>, kind: Busy, after_failure: bool) -> Result<(), SimError> {
        let n = nodes.len();
        let new = Self::plan(run, n, run.plan_epoch())?;
        let layers = new.layers().len();
        let bytes = run.s.model.expert_state_bytes;
        // Where each of the nodes sits in the current plan (None: it holds nothing).
        let old: &[Placement] = match &run.config {
            Some(old) => old.layers(),
            None => &[],
        };
        let index: HashMap<&str, usize> = run.used.iter().enumerate().map(|(i, u)| (u.as_str(), i)).collect();
        let old_index: Vec<Option<usize>> =
            nodes.iter().map(|name| index.get(name.as_str()).copied().filter(|_| !old.is_empty())).collect();
        let (order, transfer_s) = if n * layers <= 4096 {
            let live: Vec<NodeState> = old_index
                .iter()
                .enumerate()
                .map(|(i, o)| NodeState {
                    node: i as u64,
                    experts: o.map(|o| old.iter().map(|p| p.nodes()[o].clone()).collect()).unwrap_or_default(),
                })
                .collect();
            let rp = plan_reconfiguration(&live, new.layers(), &vec![bytes as u64; layers])?;
            let mut sent: BTreeMap<u64, f64> = BTreeMap::new();
            let mut recv: BTreeMap<u64, f64> = BTreeMap::new();
            for t in &rp.transfers {
                *sent.entry(t.from).or_default() += t.bytes as f64;
                *recv.entry(t.to).or_default() += t.bytes as f64;
            }
            let worst = sent.values().chain(recv.values()).cloned().fold(0.0, f64::max);
            let order: Vec<String> = rp.plan_to_node.iter().map(|&p| nodes[p as usize].clone()).collect();
            (order, run.cost().transfer_s(worst))
        } else {
            // Large clusters: keep each node on its own index and count what it lacks (the exact
            // assignment is O(N³) per event).
            let mut worst = 0.0f64;
            // have[e] == stamp: the node holds expert e in the layer being looked at.
            let mut have = vec![0u32; run.s.model.experts];
            let mut stamp = 0u32;
            for (i, o) in old_index.iter().enumerate() {
                let mut need = 0usize;
                for (l, p) in new.layers().iter().enumerate() {
                    stamp += 1;
                    if let (Some(o), Some(was)) = (o, old.get(l)) {
                        was.nodes()[*o].iter().for_each(|&e| have[e] = stamp);
                    }
                    for &e in &p.nodes()[i] {
                        if have[e] != stamp {
                            need += 1;
                            have[e] = stamp;
                        }
                    }
                }
                worst = worst.max(need as f64 * bytes);
            }
            (nodes.clone(), run.cost().transfer_s(worst))
        };
        let c = run.cost();
        let fixed = match kind {
            Busy::Rebalance => c.rebalance_s,
            _ => c.group_rebuild_s + if after_failure { c.failure_timeout_s } else { 0.0 },
        };
        run.switch(order, new, kind, fixed + transfer_s);
        Ok(())
    }
}

impl FailurePolicy for Lazarus {
    type Config = ModelPlan;

    /// Any number of nodes with at least one replica slot per expert.
    fn nodes_usable(&self, s: &Scenario, n: usize) -> usize {
        if n * s.cost.gpus_per_node * s.cost.slots_per_gpu >= s.model.experts {
            n
        } else {
            0
        }
    }

    fn fresh_config(&self, run: &Run<'_, Self>, n: usize) -> Result<ModelPlan, SimError> {
        Self::plan(run, n, run.plan_epoch())
    }

    fn checkpoint_every(&self, cost: &CostModel) -> u64 {
        cost.checkpoint_every_lazarus
    }

    fn rebalance_every(&self, cost: &CostModel) -> Option<u64> {
        Some(cost.rebalance_every)
    }

    /// Replan on the same nodes from the last epoch's loads.
    fn rebalance(&self, run: &mut Run<'_, Self>) -> Result<(), SimError> {
        let nodes = run.used.clone();
        Self::reconfigure(run, nodes, Busy::Rebalance, false)
    }

    /// Reconfigure onto the survivors and any usable joiners while every expert keeps a replica
    /// among the survivors; restart from the last checkpoint otherwise.
    fn on_failure(&self, run: &mut Run<'_, Self>, failed: &[String], survivors: Vec<String>) -> Result<(), SimError> {
        let recoverable = match &run.config {
            Some(plan) if !survivors.is_empty() => {
                let failed_nodes: Vec<usize> = (0..run.used.len()).filter(|&i| failed.contains(&run.used[i])).collect();
                plan.survives(&failed_nodes)
            }
            _ => false,
        };
        if recoverable {
            let nodes = run.with_joiners(survivors);
            if self.nodes_usable(run.s, nodes.len()) == nodes.len() {
                return Self::reconfigure(run, nodes, Busy::Reconfig, true);
            }
        }
        run.restart()
    }

    fn scale_up(&self, run: &mut Run<'_, Self>, nodes: Vec<String>) -> Result<(), SimError> {
        Self::reconfigure(run, nodes, Busy::Reconfig, false)
    }

    /// Per-replica shares (Algorithm 1): each replica of expert e takes `load[e] / replicas[e]`;
    /// the most loaded GPU of each layer, times the number of GPUs.
    fn imbalance(&self, cost: &CostModel, plan: &ModelPlan, loads: &[Vec<f64>]) -> f64 {
        let g = cost.gpus_per_node;
        let mut imbalance = 0.0;
        for (p, l) in plan.layers().iter().zip(loads) {
            let r = p.replica_counts();
            let mut worst = 0.0f64;
            for node in 0..p.shape().nodes {
                for gpu in 0..g {
                    let load: f64 = p.gpu(node, gpu).iter().map(|&e| l[e] / r[e] as f64).sum();
                    worst = worst.max(load);
                }
            }
            imbalance += worst * p.shape().ranks() as f64;
        }
        imbalance / loads.len().max(1) as f64
    }
}
