//! The control plane of Lazarus (docs/architecture.md).
//!
//! * [`controller`] — the controller's decisions (the `lazarus-controller` crate: membership,
//!   leases, epochs, the load monitor, recovery) over the workers' record of a committed step;
//! * [`launcher`] — starts worker processes that never outlive it;
//! * [`protocol`] — what launcher and workers say to each other, with failure kinds as values;
//! * [`worker_process`] — the worker side: spec, rendezvous, reports that never block a step;
//! * [`control_loop`] — the controller process's loop (`lazarus train --workers N`, `lazarus
//!   controller`, the benchmarks): events from the workers into the decisions, commands out —
//!   the one lifecycle of every job, with live recovery or without;
//! * [`fleet`] — the workers as that loop sees them, started here or by agents: one
//!   [`fleet::FleetEvent`] at a time;
//! * [`proto`] — the generated messages and stubs of the control protocol;
//! * [`metrics`] — what a running job exposes to Prometheus (`--metrics-listen`);
//! * [`service`] — the controller's gRPC service (`lazarus status`, and the agents' sessions);
//! * [`tls`] — TLS on that service: a certificate the job's secret pins, or the operator's;
//! * [`hub`] — the controller's side of its node agents: admission, relay, a [`fleet::Fleet`];
//! * [`agent`] — `lazarus agent`: one per node, starts and supervises that node's workers;
//! * [`loadgen`] — synthetic agents with fake workers, to measure a controller at cluster scale;
//!
//! The benchmarks (`lazarus bench …`) are the `lazarus-bench` crate's; a benchmark across
//! worker processes runs here as a job without recovery ([`run_local_job`], [`worker_process::run_rank`]).

pub mod agent;
pub mod control_loop;
pub mod controller;
mod error;
pub mod events;
pub mod fleet;
pub mod hub;
pub mod launcher;
pub mod loadgen;
pub mod metrics;
pub mod pieces;
pub mod proto;
pub mod protocol;
pub mod service;
pub mod step_profile;
pub mod stop_signal;
pub mod tls;
pub mod when;
pub mod worker_process;

pub use control_loop::{
    plan_job, run_local_job, run_training, AgentsSpec, Hosts, JobPlan, NodeChange, NodeSchedule, PlanSource, ReconfigurationRecord,
    Recovery, TrainEvent, TrainOutcome,
};
pub use error::ControlError;
pub use launcher::{allowed_cpus, Confinement};
pub use protocol::{FailureKind, TrainJob, WorkerEvent};
