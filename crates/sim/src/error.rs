use thiserror::Error;

#[derive(Debug, Error)]
pub enum SimError {
    /// A trace file line that does not parse; `line` is 1-based.
    #[error("{source_name} line {line}: {reason}")]
    Trace { source_name: String, line: usize, reason: String },
    #[error("invalid {field}: {value} ({reason})")]
    Invalid { field: &'static str, value: String, reason: String },
    #[error(transparent)]
    Plan(#[from] lazarus_plan::PlanError),
}

impl SimError {
    pub(crate) fn invalid(field: &'static str, value: impl std::fmt::Display, reason: impl Into<String>) -> Self {
        SimError::Invalid { field, value: value.to_string(), reason: reason.into() }
    }
}
