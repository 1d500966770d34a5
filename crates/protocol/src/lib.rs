//! What the processes of a Lazarus job share (docs/architecture.md):
//!
//! * [`messages`] — what a launcher (the controller on one machine, or a node agent) and its
//!   worker processes say to each other, with failure kinds as values; re-exported at the root;
//! * [`proto`] — the generated protobuf messages and gRPC stubs between the controller and its
//!   node agents (and `lazarus status`);
//! * [`pieces`] — long messages to an agent, sent in pieces;
//! * [`relay`] — what agents relay between the controller and workers, typed, and checked once;
//! * [`handshake`] — what each side of an agent's attach proves with the job's secret;
//! * [`tls`] — TLS on the control channel: a certificate the job's secret pins, or the operator's;
//! * [`rpc`] — the gRPC runtime and error text every side shares;
//! * [`stop_signal`] — SIGTERM and SIGINT end a run at a step boundary;
//! * [`when`] — times as people read them.
//!
//! The processes themselves are crates of their own: `lazarus-controller`, `lazarus-agent` and
//! `lazarus-worker`; the controller's decisions are `lazarus-decide`.

mod error;
pub mod handshake;
pub mod layout;
pub mod messages;
pub mod pieces;
pub mod proto;
pub mod relay;
pub mod rpc;
pub mod status_plan;
pub mod stop_signal;
pub mod tls;
pub mod when;

pub use error::ControlError;
pub use layout::{node_gpus, Reach, Workers, MAX_WORKERS, MAX_WORKERS_PER_HOST};
pub use lazarus_setting::Setting;
pub use messages::*;
