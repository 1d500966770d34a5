//! What a training job tells whoever runs it, as it happens ([`TrainEvent`]): its steps,
//! losses, moves (each [`ReconfigurationRecord`], as the `--json-log` records it), rebalances,
//! joins and notices — and how it ended ([`TrainOutcome`]). The controller's loop sends them;
//! the CLI shows them and the metrics count them.

use std::net::SocketAddr;
use std::path::PathBuf;

use lazarus_model::StepReport;
use serde::Serialize;

/// One reconfiguration, as the `--json-log` records it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReconfigurationRecord {
    pub event: &'static str,
    /// The job's epoch after it: one more per move to a new plan (1 after the first), and a
    /// drain takes two (its hand-over, then its leaving).
    pub epoch: u64,
    /// `reconfigure` (workers lost, no state lost), `rollback` (to the last checkpoint, or the
    /// start), `join` (workers taken in at a step boundary), `rebalance` or `drain`.
    pub cause: crate::decisions::MoveCause,
    /// The workers lost (their original ranks).
    pub lost: Vec<u64>,
    /// The workers taken in (their ids: after the first workers, in order of arrival).
    pub joined: Vec<u64>,
    /// The step training went on from (steps committed).
    pub step: u64,
    /// From the first sign of the failure until every survivor said where it stopped.
    pub detect_s: f64,
    /// Computing the new plan, the node mapping and the transfers.
    pub plan_s: f64,
    /// The slowest worker's state transfers.
    pub transfer_s: f64,
    pub transfer_bytes: u64,
    /// The slowest worker's rendezvous at the new epoch (the transport rebuilt).
    pub rebuild_s: f64,
    /// From the first sign of the failure to the next completed step.
    pub recovery_s: f64,
    /// Workers after it.
    pub workers: usize,
    /// Experts that lost every live replica and came back from snapshots in other nodes'
    /// memory (in a `reconfigure`): each one's snapshot step, staleness and tokens lost.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub restored: Vec<crate::decisions::RestoredExpert>,
    /// Steps a rollback to the last checkpoint would have run again instead.
    #[serde(skip_serializing_if = "is_zero")]
    pub rollback_avoided_steps: u64,
    /// GPU workers: each one's device memory in use after the move, bytes (flat across moves
    /// when a move leaves nothing behind).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gpu_used_bytes: Vec<u64>,
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

/// What a training job shows its user, as it happens.
#[derive(Debug, Clone)]
pub enum TrainEvent {
    Ready {
        rank: usize,
        pid: u32,
    },
    /// Every worker is ready: training runs.
    Started,
    Step {
        report: StepReport,
        seconds: f64,
        dropped: u64,
        /// Bytes the step's MoE all-to-alls sent between workers, summed over them (None where
        /// not known: a step logged from a survivor's copy).
        moe_wire_bytes: Option<u64>,
        /// What the step's snapshots cost (None: none taken).
        snapshot: Option<lazarus_runtime::SnapshotStepStats>,
    },
    /// A worker is lost (its original rank).
    Lost {
        worker: usize,
        why: String,
    },
    Checkpointed {
        step: u64,
        path: PathBuf,
    },
    /// The held-out loss after `step`.
    Evaluated {
        step: u64,
        evaluation: lazarus_model::eval::Evaluation,
    },
    /// Training went on after a failure, or with workers taken in.
    Reconfigured(ReconfigurationRecord),
    /// The controller weighed a rebalance (applied: a `rebalance` reconfiguration follows).
    Rebalance(crate::decisions::RebalanceDecision),
    /// A node gave notice that it leaves soon: its workers (ids) and why.
    Leaving {
        workers: Vec<usize>,
        reason: String,
    },
    /// A node's workers (their ids) joined the running job and stand by to be taken in.
    WorkersJoined {
        workers: Vec<usize>,
    },
    /// The controller's gRPC service listens here (`lazarus status --controller ADDR`, and
    /// `lazarus agent --controller ADDR` when the job is run by agents); `lazarus status`
    /// proves the key in `status_token` (read-only, derived from the job's secret when agents
    /// run it) and pins the controller's TLS key by it ([`crate::service::status_token`]).
    Serving {
        addr: SocketAddr,
        status_token: String,
    },
    /// Prometheus can scrape the job's metrics here (`GET /metrics`).
    Metrics {
        addr: SocketAddr,
    },
    /// The job's live dashboard, for a browser: its address with the status token in it.
    Dashboard {
        url: String,
    },
    /// An agent attached: its number, the address its workers listen on (as it claims) and where
    /// its connection came from, its workers, and the workers attached so far.
    AgentJoined {
        agent: u64,
        host: String,
        peer: String,
        gpus: usize,
        pid: u32,
        attached: usize,
        world: usize,
    },
}

/// How a training job ended.
#[derive(Debug, Clone, PartialEq)]
pub enum TrainOutcome {
    Completed {
        checkpoint: Option<PathBuf>,
    },
    /// The job could not go on: why, and how each worker ended (original ranks).
    Failed {
        reason: JobStopped,
        workers: Vec<String>,
    },
}

/// Why a job stopped before its end, as its user reads it: the controller's reason, the first
/// failure a worker reported (in its words), and where a new start goes on from.
#[derive(Debug, Clone, PartialEq)]
pub struct JobStopped {
    pub reason: lazarus_decide::StopReason,
    pub first_failure: Option<String>,
    /// The directory of the job's last checkpoint.
    pub resume_from: Option<PathBuf>,
}

impl std::fmt::Display for JobStopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.reason)?;
        if let Some(first) = &self.first_failure {
            write!(f, " (first failure: {first})")?;
        }
        if let Some(dir) = &self.resume_from {
            // Where to go on from: the user's next command, not only a step number.
            write!(
                f,
                "; to go on from it, start the job again on enough workers with {} {} {}",
                lazarus_setting::Setting::CheckpointDir,
                dir.display(),
                lazarus_setting::Setting::Resume
            )?;
        }
        Ok(())
    }
}
