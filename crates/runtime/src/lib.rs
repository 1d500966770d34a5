//! The Lazarus worker runtime. This first piece is one MoE layer distributed over ranks with the
//! flexible token dispatcher (paper §4.2): route, all-gather the per-expert token counts,
//! compute the shared dispatch schedule, send each token slot to a replica with a padding-free
//! all-to-all, run the local experts, send results back and combine; backward mirrors it.
//!
//! Autograd cannot see across an all-to-all, so the layer is a chain of *segments* (DESIGN.md,
//! "Runtime step mechanics"): router + combine on the token's rank, and each expert on the rank
//! that holds it, each with fresh leaf inputs. Backward seeds every segment with the gradient
//! that arrives over the network.

pub mod bench;
mod error;
mod moe;
mod worker;

pub use error::RuntimeError;
pub use moe::{DispatchMode, DistributedMoe, ExpertGrads, ExpertWeights, MoeForward, MoeGrads, DEFAULT_BUCKET_BYTES};
pub use worker::{batch_share, check_plan, validate_worker_config, Worker, WorkerOptions, WorkerStepReport};
