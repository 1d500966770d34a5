//! Sparse per-expert snapshots and a rollback of the lost operators only (`moevement`): MoEtion
//! (Gandhi et al., arXiv:2412.15411; MoEvement in its later form) snapshots a changing subset of
//! experts to peers' CPU memory every iteration at near-zero overhead, and after a fault restores
//! the lost state from those snapshots while the rest of the model keeps its progress: 9.8–14.9 s
//! wasted per failure in its §7.2 (checkpoint, retrieval and half an interval of one iteration),
//! against 25.7 s for Gemini.
//!
//! Here: DeepSpeed-MoE's static layout; after a failure the survivors and the waiting nodes
//! regroup into whole EP groups (nodes left out wait and are taken back, unlike DS-FT) and the lost node's expert block
//! comes back from snapshots in peers' memory: the time-out, the group's rebuild and that block's
//! transfer, and no rollback beyond the step in flight. Snapshots cost no stall; storage
//! checkpoints, for the failure that leaves not one EP group, are written beside training as
//! MoEtion does (at DS-FT's interval) and are what a restart goes back to.

use super::static_ep::{regroup, EpConfig, EpRun, OnStaticEp};
use crate::error::SimError;

#[derive(Debug, Clone, Copy)]
pub(in crate::engine) struct MoEvement;

impl OnStaticEp for MoEvement {
    /// Persisted beside training, off the critical path.
    fn checkpoint_s(&self, _run: &EpRun<'_, Self>) -> f64 {
        0.0
    }

    /// The survivors and the waiting nodes regroup and the lost blocks come back from
    /// snapshots, while they make one whole EP group; a restart from storage otherwise.
    fn on_failure(&self, run: &mut EpRun<'_, Self>, ep: EpConfig, _: &[String], survivors: Vec<String>) -> Result<(), SimError> {
        let nodes = run.with_joiners(survivors);
        if nodes.len() < ep.ep_nodes {
            return run.restart();
        }
        let c = run.cost();
        regroup(run, ep, nodes, false, run.detect_s + c.group_rebuild_s)
    }
}
