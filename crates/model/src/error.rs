//! Errors of the model crate. Configuration and data errors name the field and the value.

use lazarus_setting::Setting;
use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error("invalid {field}: {value} ({reason})")]
    Config { field: &'static str, value: String, reason: String },
    #[error("{path}: {reason}")]
    Data { path: PathBuf, reason: String },
    /// (The I/O error is part of the message, not a separate cause, so it is said once.)
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },
    /// A non-finite loss or gradient: the step is not applied, and the run stops.
    #[error(
        "training diverged at step {step}: the {what} is {value} (not applied; lower {}, or resume from the last checkpoint)",
        Setting::Lr
    )]
    Diverged { step: u64, what: &'static str, value: f64 },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl ModelError {
    pub(crate) fn config(field: &'static str, value: impl ToString, reason: impl Into<String>) -> Self {
        ModelError::Config { field, value: value.to_string(), reason: reason.into() }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io { path: path.into(), error: source }
    }
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
