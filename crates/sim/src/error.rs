use thiserror::Error;

#[derive(Debug, Error)]
pub enum SimError {
    /// A trace file line that does not parse; `line` is 1-based.
    #[error("{source_name} line {line}: {reason}")]
    Trace { source_name: String, line: usize, reason: String },
    /// A trace file with no events at all: there is nothing to simulate.
    #[error("{source_name}: the trace holds no events")]
    EmptyTrace { source_name: String },
    /// A routing-trace (expert loads) file that does not parse or does not fit the model;
    /// `reason` says where (line, entry, layer).
    #[error("routing trace: {reason}")]
    LoadTrace { reason: String },
    #[error("invalid {field}: {value} ({reason})")]
    Invalid { field: &'static str, value: String, reason: String },
    #[error(transparent)]
    Plan(#[from] lazarus_plan::PlanError),
    /// The controller's decision left the simulated job where it cannot go on (a join it did
    /// not take in would stall the simulation): a bug, reported instead of looping.
    #[error("at {at_s:.3} s of simulated time the controller {what}")]
    Controller { at_s: f64, what: String },
}

impl SimError {
    pub(crate) fn invalid(field: &'static str, value: impl std::fmt::Display, reason: impl Into<String>) -> Self {
        SimError::Invalid { field, value: value.to_string(), reason: reason.into() }
    }
}
