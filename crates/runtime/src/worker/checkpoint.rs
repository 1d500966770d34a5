//! Checkpoints of a distributed run, in the single-process format (either trainer resumes
//! them): rank 0 gathers every expert it does not hold from that expert's first holder, as
//! [`ExpertState`] bytes, writes, and releases them again.

use std::path::{Path, PathBuf};

use lazarus_comm::tags::{expert_transfer, TransferKind};
use lazarus_comm::{barrier, Group, Transport};

use super::Worker;
use crate::error::RuntimeError;
use crate::expert_state::ExpertState;

impl Worker {
    /// Write a checkpoint to `dir`. Every rank must call it together, between steps. Returns the
    /// path on rank 0.
    pub fn save_checkpoint(&mut self, t: &mut dyn Transport, world: &mut Group, dir: &Path) -> Result<Option<PathBuf>, RuntimeError> {
        let timeout = self.timeout;
        let deadline = || lazarus_comm::deadline_after(timeout);
        for l in 0..self.plan.layer_count() {
            for e in 0..self.plan.experts() {
                let Some(&first) = self.plan.holders(l, e).first() else { continue };
                if first == 0 {
                    continue;
                }
                let tag = expert_transfer(TransferKind::Checkpoint, l, e)?;
                if self.rank == first {
                    let bytes = self.encode_expert(l, e)?;
                    t.send(0, tag, &bytes, deadline())?;
                } else if self.rank == 0 {
                    let bytes = t.recv(first, tag, deadline())?;
                    let state = ExpertState::decode(&bytes, l, e, &self.trainer.model.expert_shapes())
                        .map_err(|err| RuntimeError::Invalid { field: "checkpoint", reason: format!("rank {first} sent: {err}") })?;
                    // Rank 0 does not hold this expert: taken in for the write, released below.
                    self.install_expert(&state)?;
                }
            }
        }
        let path = if self.rank == 0 {
            let path = self.trainer.save_checkpoint(dir)?;
            self.release_remote_experts()?;
            Some(path)
        } else {
            None
        };
        barrier(t, world, self.timeout)?;
        Ok(path)
    }
}
