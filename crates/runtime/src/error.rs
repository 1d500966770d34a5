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
    /// A deterministic step's exact sum refused a value (a gradient not finite or beyond 2^30).
    #[error("deterministic step: {0}")]
    Exact(#[from] lazarus_comm::exact::ExactError),
    #[error("invalid {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
}
