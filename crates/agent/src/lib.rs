//! What runs on each node of a Lazarus job (docs/architecture.md):
//!
//! * [`agent`] — `lazarus agent`: one per node; attaches to the controller, starts and
//!   supervises that node's workers, relays their reports, and keeps them through a controller's
//!   loss for a grace period;
//! * [`launcher`] — starts worker processes that never outlive it, confined to their CPUs and
//!   memory; the agent uses it, and so does the controller for workers on its own machine;
//! * [`loadgen`] — synthetic agents with fake workers, to measure a controller at cluster scale.

pub mod agent;
pub mod launcher;
pub mod loadgen;

pub use agent::{run_agent, AgentEnd, AgentOptions, DEFAULT_CONTROLLER_GRACE};
pub use launcher::{allowed_cpus, Confinement};
