use thiserror::Error;

/// Why a communication call did not complete. Every call ends with one of these instead of
/// hanging: a peer that dies mid-step shows up as `PeerLost` on every rank that talks to it.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CommError {
    /// The connection to `peer` closed or failed (process killed, node gone).
    #[error("peer {peer} lost: {reason}")]
    PeerLost { peer: usize, reason: String },
    /// Nothing arrived from `peer` before the deadline.
    #[error("timed out waiting for peer {peer} ({what})")]
    Timeout { peer: usize, what: String },
    /// A message stamped with an older plan epoch than ours.
    #[error("stale message from peer {peer}: epoch {got}, current epoch {current}")]
    StaleEpoch { peer: usize, got: u64, current: u64 },
    /// The peer sent something that is not a frame of this protocol, or out of order.
    #[error("protocol error with peer {peer}: {reason}")]
    Protocol { peer: usize, reason: String },
    /// Rendezvous could not connect the ranks.
    #[error("rendezvous failed: {0}")]
    Rendezvous(String),
    /// Bad arguments to a call (sizes, ranks, groups).
    #[error("invalid {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
}

impl CommError {
    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        CommError::Invalid { field, reason: reason.into() }
    }
}
