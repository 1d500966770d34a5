//! In-memory checkpoints and a whole-job restart (`gemini`): Gemini (Wang et al., SOSP 2023)
//! keeps each node's training state in a peer's CPU memory, checkpoints far more often than
//! storage allows, and after a failure restarts the job from those copies. MoEtion measured it
//! beside MoE models (arXiv:2412.15411, §7.2): without stalls it manages about 6 checkpoints per
//! 100 iterations, and a failure wastes 25.7 s (MoE-GPT-3.8B-8E), because a checkpoint of an MoE
//! no longer fits under one iteration.
//!
//! Here: DeepSpeed-MoE's static layout (whole EP groups); a checkpoint is each node's shard — its
//! expert block and its share of the dense state — copied to a peer over its link, taken as
//! often as that copy fits under the steps between (no stall: the copy runs beside training);
//! a failure costs the time-out, a relaunch and reading the shard back from the peer, and rolls
//! back to the last of those checkpoints; joiners are taken by a checkpoint and relaunch in
//! memory. One simplification favours it: a failure that takes a node and the peer holding its
//! copy still restores from memory (Gemini would fall back to storage).

use super::static_ep::{relaunch_without, EpConfig, EpRun, OnStaticEp};
use crate::cost::CostModel;
use crate::engine::Scenario;
use crate::error::SimError;

#[derive(Debug, Clone, Copy)]
pub(in crate::engine) struct Gemini {
    /// Bytes of one node's shard of the training state.
    shard_bytes: f64,
    /// Steps between in-memory checkpoints.
    every: u64,
}

impl Gemini {
    pub(in crate::engine) fn new(s: &Scenario) -> Self {
        let ep = EpConfig::of(s);
        let m = &s.model;
        let experts_bytes = m.layers as f64 * m.experts as f64 * m.expert_state_bytes;
        let dense_bytes = (m.params * s.cost.bytes_per_param - experts_bytes).max(0.0);
        let nodes = s.max_nodes.max(1) as f64;
        let shard_bytes = ep.experts_per_node as f64 * m.layers as f64 * m.expert_state_bytes + dense_bytes / nodes;
        let every = (s.cost.transfer_s(shard_bytes) / m.balanced_step_s).ceil().max(1.0) as u64;
        Gemini { shard_bytes, every }
    }
}

impl OnStaticEp for Gemini {
    fn checkpoint_every(&self, _cost: &CostModel) -> u64 {
        self.every
    }

    /// The copy to a peer runs beside training.
    fn checkpoint_s(&self, _run: &EpRun<'_, Self>) -> f64 {
        0.0
    }

    /// The time-out, the relaunch, and every node's shard read back from its peer.
    fn restart_s(&self, run: &EpRun<'_, Self>) -> f64 {
        let c = run.cost();
        run.detect_s + c.restart_s + c.transfer_s(self.shard_bytes)
    }

    fn on_failure(&self, run: &mut EpRun<'_, Self>, _: EpConfig, _: &[String], _: Vec<String>) -> Result<(), SimError> {
        run.restart()
    }

    /// A checkpoint in memory, a relaunch without the nodes that leave, the shards read back.
    fn on_notice(&self, run: &mut EpRun<'_, Self>, ep: EpConfig, _: &[String], staying: Vec<String>) -> Result<(), SimError> {
        let t = run.cost().restart_s + 2.0 * run.cost().transfer_s(self.shard_bytes);
        relaunch_without(run, ep, staying, t)
    }

    /// A checkpoint in memory, a relaunch on more nodes, the shards read back: nothing is
    /// rolled back.
    fn scale_up(&self, run: &mut EpRun<'_, Self>, ep: EpConfig, nodes: Vec<String>) -> Result<(), SimError> {
        let c = run.cost();
        let t = c.restart_s + 2.0 * c.transfer_s(self.shard_bytes);
        run.relaunch_with_checkpoint(nodes, ep, t);
        Ok(())
    }
}
