//! The one map of message tags. A tag names a message between two ranks, and both must agree
//! on it; the ranges below are disjoint by their top byte, so no two kinds of message can be
//! confused:
//!
//! * **collectives** (top bit clear): `(group id << 32) | sequence number`, taken by every member
//!   of a [`crate::Group`] in the same order ([`collective`]);
//! * **expert-state transfers** (top byte `0x80 | kind`): one expert's state sent point to point
//!   — the checkpoint gather to rank 0, state transfers after a reconfiguration, snapshots
//!   ([`expert_transfer`]): `kind`, MoE layer (24 bits) and expert (32 bits);
//! * **transport control** (top byte `0xFF`): abort and goodbye frames of the TCP transport,
//!   never sent by callers ([`is_control`]).

use crate::error::CommError;

/// What an expert-state message is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum TransferKind {
    /// Rank 0 gathers every expert it does not hold to write a checkpoint.
    Checkpoint = 1,
    /// A worker fetches an expert the new plan gives it from a surviving holder.
    StateTransfer = 2,
    /// An expert's state copied into another node's memory (the snapshot tier).
    Snapshot = 3,
    /// The replicated (non-expert) training state sent to a worker that joins a running job
    /// (layer and expert 0: one such message between two ranks per move).
    SharedState = 4,
}

/// Tag of the `seq`-th collective of the group with id `group` (31 bits are used).
pub fn collective(group: u32, seq: u32) -> u64 {
    (((group & 0x7fff_ffff) as u64) << 32) | seq as u64
}

/// Tag of one expert's state sent for `kind`.
pub fn expert_transfer(kind: TransferKind, layer: usize, expert: usize) -> Result<u64, CommError> {
    if layer >= 1 << 24 || expert as u64 >= 1 << 32 {
        return Err(CommError::Invalid {
            field: "tag",
            reason: format!("layer {layer} expert {expert} is beyond the tag space (2^24 layers, 2^32 experts)"),
        });
    }
    Ok(((0x80 | kind as u64) << 56) | ((layer as u64) << 32) | expert as u64)
}

/// First tag of the transport's own control frames.
pub(crate) const CONTROL: u64 = 0xFF << 56;
/// "Peer X is lost, abandon the step."
pub(crate) const ABORT: u64 = u64::MAX;
/// "I am closing on purpose: my end of file is not a failure."
pub(crate) const BYE: u64 = u64::MAX - 1;

/// Whether frames with `tag` travel beside the ordered stream between two ranks: snapshots
/// sent after one step are taken by their receiver after the next, while that step's
/// collectives (ordered, from the same peer) go first.
pub fn is_out_of_band(tag: u64) -> bool {
    tag >> 56 == 0x80 | TransferKind::Snapshot as u64
}

/// Whether `tag` is reserved for the transport's control frames.
pub fn is_control(tag: u64) -> bool {
    tag >= CONTROL
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ranges_are_disjoint() {
        let c = collective(u32::MAX, u32::MAX);
        assert!(c < 1 << 63 && !is_control(c));
        for kind in [TransferKind::Checkpoint, TransferKind::StateTransfer, TransferKind::Snapshot, TransferKind::SharedState] {
            let lo = expert_transfer(kind, 0, 0).unwrap();
            let hi = expert_transfer(kind, (1 << 24) - 1, u32::MAX as usize).unwrap();
            assert!(lo >= 1 << 63 && !is_control(hi) && hi >> 56 == lo >> 56);
        }
        assert_ne!(expert_transfer(TransferKind::Checkpoint, 1, 2).unwrap(), expert_transfer(TransferKind::Snapshot, 1, 2).unwrap());
        assert!(expert_transfer(TransferKind::Checkpoint, 1 << 24, 0).is_err());
        assert!(is_control(ABORT) && is_control(BYE));
        assert!(is_out_of_band(expert_transfer(TransferKind::Snapshot, 3, 4).unwrap()));
        assert!(!is_out_of_band(expert_transfer(TransferKind::StateTransfer, 3, 4).unwrap()) && !is_out_of_band(collective(1, 2)));
    }
}
