//! DeepSpeed-MoE (§6.1 baseline `ds`): static expert parallelism on a multiple of the EP size
//! of nodes ([`super::static_ep`]), frequent checkpoints to remote storage, a restart from the
//! last checkpoint on every failure, and a checkpoint-and-relaunch to take joiners.

use super::static_ep::{relaunch_without, EpConfig, EpRun, OnStaticEp};
use crate::cost::CostModel;
use crate::error::SimError;

#[derive(Debug, Clone, Copy)]
pub(in crate::engine) struct Ds;

impl OnStaticEp for Ds {
    fn checkpoint_every(&self, cost: &CostModel) -> u64 {
        cost.checkpoint_every_ds
    }

    fn on_failure(&self, run: &mut EpRun<'_, Self>, _: EpConfig, _: &[String], _: Vec<String>) -> Result<(), SimError> {
        run.restart()
    }

    /// Save, relaunch without the nodes that leave, load: nothing is rolled back.
    fn on_notice(&self, run: &mut EpRun<'_, Self>, ep: EpConfig, _: &[String], staying: Vec<String>) -> Result<(), SimError> {
        let c = run.cost();
        let t = 2.0 * c.checkpoint_s(&run.s.model) + c.restart_s;
        relaunch_without(run, ep, staying, t)
    }

    /// Save, relaunch on more nodes, load: nothing is rolled back.
    fn scale_up(&self, run: &mut EpRun<'_, Self>, ep: EpConfig, nodes: Vec<String>) -> Result<(), SimError> {
        let c = run.cost();
        let t = 2.0 * c.checkpoint_s(&run.s.model) + c.restart_s;
        run.relaunch_with_checkpoint(nodes, ep, t);
        Ok(())
    }
}
