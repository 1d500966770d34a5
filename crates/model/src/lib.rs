//! The trainable model of Lazarus: a GPT-style decoder with Mixture-of-Experts feed-forwards on
//! candle, an AdamW whose state is visible per tensor, data loading, checkpoints and the
//! single-process trainer.

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod device;
mod error;
pub mod eval;
mod files;
pub mod generate;
pub mod hf;
pub mod model;
pub mod ops;
pub mod optim;
pub mod params;
pub mod profile;
pub mod rng;
pub mod routing;
pub mod tokenizer;
pub mod trainer;

pub use config::ModelConfig;
pub use data::{ByteTokenizer, Cursor, DataSource, Sampler, TokenWidth};
pub use error::{ModelError, Result};
pub use model::{ForwardOutput, MoeModel, MoeStats};
pub use optim::{AdamW, AdamWConfig, LrSchedule};
pub use params::ParamStore;
pub use trainer::{Precision, RoutingTrace, StepReport, TrainConfig, Trainer};
