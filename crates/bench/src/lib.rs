//! The benchmarks of Lazarus, in one place: what each measures and how, as library code the
//! `lazarus bench` commands print (docs/results.md holds their figures with the commands).
//!
//! * [`train`] — `bench train`: one training step of the single-process trainer, its model
//!   FLOP rate against the device's measured peak, and (`--profile`) where the step's time went;
//! * [`moe_layer`] — `bench moe-layer`: one MoE layer across worker processes, Lazarus's
//!   padding-free dispatcher against static expert parallelism, side by side; its per-rank part
//!   runs in the hidden `bench-worker` subcommand;
//! * [`recovery`] — `bench recovery`: training under kills from outside, each recovery's time
//!   broken down, against the target.

pub mod moe_layer;
pub mod recovery;
pub mod train;
