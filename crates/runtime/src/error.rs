use thiserror::Error;

#[derive(Debug, Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Comm(#[from] lazarus_comm::CommError),
    #[error(transparent)]
    Plan(#[from] lazarus_plan::PlanError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Model(#[from] lazarus_model::ModelError),
    #[error("invalid {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
}
