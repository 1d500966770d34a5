//! Errors of the planning core. Every variant names the offending field and value so the CLI can
//! show it to the user unchanged.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum PlanError {
    /// A numeric input is out of its allowed range.
    #[error("invalid {field}: {value} ({reason})")]
    Invalid { field: &'static str, value: String, reason: String },
    /// Fewer replica slots than experts: some expert would have no replica at all.
    #[error(
        "cannot host the layer: {experts} experts need at least {experts} replica slots, \
         but the cluster has {slots} (nodes x gpus-per-node x slots)"
    )]
    CannotHost { experts: usize, slots: usize },
    /// Replica counts do not fill the cluster's slots exactly.
    #[error("replicas sum to {sum} but the cluster has {slots} slots (nodes x gpus-per-node x slots)")]
    SlotMismatch { sum: usize, slots: usize },
    /// Inputs of two different lengths that must agree.
    #[error("{field} has length {got}, expected {expected}")]
    Length { field: &'static str, got: usize, expected: usize },
}

impl PlanError {
    pub(crate) fn invalid(field: &'static str, value: impl ToString, reason: impl Into<String>) -> Self {
        PlanError::Invalid { field, value: value.to_string(), reason: reason.into() }
    }
}
