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

use super::static_ep::{EpConfig, EpRun, OnStaticEp};
use crate::engine::Busy;
use crate::error::SimError;

#[derive(Debug, Clone, Copy)]
pub(in crate::engine) struct TorchFt;

impl OnStaticEp for TorchFt {
    /// The groups without a failed node go on; a restart when none is left.
    fn on_failure(&self, run: &mut EpRun<'_, Self>, ep: EpConfig, failed: &[String], _: Vec<String>) -> Result<(), SimError> {
        let c = run.cost();
        leave_quorum(run, ep, failed, run.detect_s + c.group_rebuild_s)
    }

    /// The groups of the nodes that leave step out of the quorum at the step's end.
    fn on_notice(&self, run: &mut EpRun<'_, Self>, ep: EpConfig, leaving: &[String], _: Vec<String>) -> Result<(), SimError> {
        let t = run.cost().group_rebuild_s;
        leave_quorum(run, ep, leaving, t)
    }

    /// Whole groups join the quorum at a step boundary.
    fn scale_up(&self, run: &mut EpRun<'_, Self>, ep: EpConfig, nodes: Vec<String>) -> Result<(), SimError> {
        let t = run.cost().group_rebuild_s;
        run.switch(nodes, ep, Busy::Reconfig, t, 0.0);
        Ok(())
    }
}

/// The replica groups holding any of `gone` leave the quorum; the others go on after
/// `seconds`. A restart when none is left.
fn leave_quorum(run: &mut EpRun<'_, TorchFt>, ep: EpConfig, gone: &[String], seconds: f64) -> Result<(), SimError> {
    let kept: Vec<String> =
        run.used.chunks(ep.ep_nodes).filter(|group| group.iter().all(|n| !gone.contains(n))).flatten().cloned().collect();
    if kept.is_empty() {
        return run.restart();
    }
    run.switch(kept, ep, Busy::Reconfig, seconds, 0.0);
    Ok(())
}
