use lazarus_setting::Setting;
use thiserror::Error;

/// Why the control plane could not start, run or finish a job.
#[derive(Debug, Error)]
pub enum ControlError {
    /// A setting that cannot work (shown as the front end spells it: the CLI's flag).
    #[error("invalid {setting}: {reason}")]
    Invalid { setting: Setting, reason: String },
    /// A message from the launcher or a peer that breaks the protocol (`what` names it).
    #[error("invalid {what}: {reason}")]
    BadMessage { what: &'static str, reason: String },
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

impl From<crate::relay::BadMessage> for ControlError {
    fn from(e: crate::relay::BadMessage) -> Self {
        ControlError::BadMessage { what: e.field, reason: e.reason }
    }
}

impl ControlError {
    pub fn invalid(setting: Setting, reason: impl Into<String>) -> Self {
        ControlError::Invalid { setting, reason: reason.into() }
    }

    pub fn bad_message(what: &'static str, reason: impl Into<String>) -> Self {
        ControlError::BadMessage { what, reason: reason.into() }
    }

    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        ControlError::Io { what: what.into(), error: source }
    }
}
