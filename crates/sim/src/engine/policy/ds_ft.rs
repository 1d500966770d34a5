//! DeepSpeed-MoE with Lazarus's reconfiguration (§6.1 baseline `ds-ft`): DS's static EP layout,
//! but after a failure it regroups the survivors into complete EP groups while a full copy of the
//! experts survives among the nodes in use (restarting otherwise), checkpoints as rarely as
//! Lazarus, and takes joiners by the same regrouping.

use std::collections::{HashMap, HashSet};

use super::ds::{ep_imbalance, Ds, EpConfig};
use super::FailurePolicy;
use crate::cost::CostModel;
use crate::engine::{Busy, Run, Scenario};
use crate::error::SimError;

#[derive(Debug, Clone, Copy)]
pub(in crate::engine) struct DsFt {
    ds: Ds,
}

impl DsFt {
    pub(in crate::engine) fn new(s: &Scenario) -> Self {
        DsFt { ds: Ds::new(s) }
    }

    /// Regroup `nodes` into complete EP groups; nodes whose expert block changes fetch it.
    /// Live nodes left out after a failure are retired: DS-FT never takes them back (§6.2).
    fn regroup(&self, run: &mut Run<'_, Self>, nodes: Vec<String>, after_failure: bool) -> Result<(), SimError> {
        let ep = self.ds.ep.ep_nodes;
        let groups = nodes.len() / ep;
        if groups == 0 {
            return run.restart();
        }
        let index: HashMap<&str, usize> = run.used.iter().enumerate().map(|(i, u)| (u.as_str(), i)).collect();
        let block_of = |name: &String| index.get(name.as_str()).map(|i| i % ep);
        let mut slots: Vec<Vec<String>> = vec![Vec::new(); ep];
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
        let mut used = Vec::with_capacity(groups * ep);
        for g in 0..groups {
            for slot in &slots {
                if let Some(n) = slot.get(g) {
                    used.push(n.clone());
                }
            }
        }
        if used.len() != groups * ep {
            return run.restart();
        }
        if after_failure {
            let kept: HashSet<&String> = used.iter().collect();
            run.retired.extend(nodes.iter().filter(|n| !kept.contains(n)).cloned());
        }
        let c = run.cost();
        let transfer = if fetch {
            c.transfer_s(self.ds.ep.experts_per_node as f64 * run.s.model.layers as f64 * run.s.model.expert_state_bytes)
        } else {
            0.0
        };
        let t = c.group_rebuild_s + if after_failure { c.failure_timeout_s } else { 0.0 } + transfer;
        run.switch(used, self.ds.ep, Busy::Reconfig, t);
        Ok(())
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
