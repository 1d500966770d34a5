//! DeepSpeed-MoE with Lazarus's reconfiguration (§6.1 baseline `ds-ft`): DS's static EP layout,
//! but after a failure it regroups the survivors into complete EP groups while a full copy of the
//! experts survives among the nodes in use (restarting otherwise), checkpoints as rarely as
//! Lazarus, and takes joiners by the same regrouping. Live nodes left out after a failure are
//! retired: DS-FT never takes them back (§6.2).

use super::static_ep::{regroup, EpConfig, EpRun, OnStaticEp};
use crate::error::SimError;

#[derive(Debug, Clone, Copy)]
pub(in crate::engine) struct DsFt;

impl OnStaticEp for DsFt {
    /// Reconfigure while every expert block keeps a live holder among the nodes in use and a
    /// whole EP group survives; restart otherwise.
    fn on_failure(&self, run: &mut EpRun<'_, Self>, ep: EpConfig, failed: &[String], survivors: Vec<String>) -> Result<(), SimError> {
        let size = ep.ep_nodes;
        let full_copy = (0..size).all(|b| (0..run.used.len()).any(|i| i % size == b && !failed.contains(&run.used[i])));
        if !full_copy || survivors.len() < size {
            return run.restart();
        }
        let c = run.cost();
        regroup(run, ep, survivors, true, c.group_rebuild_s + run.detect_s)
    }
}
