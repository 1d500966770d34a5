//! The controller process of a Lazarus job (docs/architecture.md): `lazarus train --workers N`
//! on one machine, `lazarus controller` over node agents, and the benchmarks across worker
//! processes.
//!
//! * [`decisions`] — the controller's decisions (the `lazarus-decide` crate: membership,
//!   leases, epochs, the load monitor, recovery) over the workers' record of a committed step;
//! * [`control_loop`] — the process's loop: events from the workers into the decisions,
//!   commands out — the one lifecycle of every job, with live recovery or without;
//! * [`fleet`] — the workers as that loop sees them, started here (`lazarus-agent`'s launcher)
//!   or by node agents: one [`fleet::FleetEvent`] at a time;
//! * [`hub`] — the controller's side of its node agents: admission, relay, a [`fleet::Fleet`];
//! * [`service`] — the gRPC service (`lazarus status`, and the agents' sessions);
//! * [`metrics`] — what a running job exposes to Prometheus (`--metrics-listen`);
//! * [`events`] — what the loop tells its caller: steps, moves, the outcome.
//!
//! The messages it exchanges are `lazarus-protocol`'s; the worker processes are
//! `lazarus-worker`; a benchmark across worker processes runs here as a job without recovery
//! ([`run_local_job`]).

pub mod control_loop;
pub mod dashboard;
pub mod decisions;
pub mod events;
pub mod fleet;
pub mod hub;
pub mod metrics;
mod server_thread;
pub mod service;

pub use control_loop::{
    plan_job, recovery_off, run_local_job, run_training, AgentsSpec, Hosts, HttpEndpoints, JobPlan, JobStopped, NodeChange, NodeSchedule,
    PlanSource, ReconfigurationRecord, Recovery, RecoveryOff, TrainEvent, TrainOutcome,
};
pub use lazarus_protocol::{ControlError, Reach, Workers};
