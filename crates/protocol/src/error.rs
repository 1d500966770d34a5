use thiserror::Error;

/// Why the control plane could not start, run or finish a job.
#[derive(Debug, Error)]
pub enum ControlError {
    /// A setting that cannot work; `field` is what the user wrote (a flag, e.g. `--cpus-per-worker`).
    #[error("invalid {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    /// An operating-system call failed.
    #[error("{what}: {error}")]
    Io { what: String, error: std::io::Error },
    /// The worker processes could not be started.
    #[error("{0}")]
    Launch(String),
    #[error(transparent)]
    Plan(#[from] lazarus_plan::PlanError),
    #[error(transparent)]
    Runtime(#[from] lazarus_runtime::RuntimeError),
    #[error(transparent)]
    Model(#[from] lazarus_model::ModelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
}

impl ControlError {
    pub fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        ControlError::Invalid { field, reason: reason.into() }
    }

    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        ControlError::Io { what: what.into(), error: source }
    }
}
