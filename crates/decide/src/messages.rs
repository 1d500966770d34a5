//! What the controller is told ([`Event`]), what it tells its shell to do ([`Command`]), and the
//! plain values those carry: where a survivor stopped, a move to a new plan and why it moves.

use lazarus_setting::Setting;
use serde::{Deserialize, Serialize};

use super::{NodeId, RebalanceDecision, Weighed, Weighing};

/// What a survivor keeps of its last committed step, for the log: the controller reads only
/// which step it is and whether it is fit to log (the workers' own report type in the
/// controller process; the simulator has none).
pub trait StepRecord: Clone + PartialEq + std::fmt::Debug {
    fn step(&self) -> u64;
    /// Whether its figures are sound (finite loss, non-negative seconds): a peer's word.
    fn is_sound(&self) -> bool;
}

/// What a finished move cost, measured: the controller's estimate of what the next will.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoveCost {
    pub bytes: u64,
    /// The slowest worker's transfers.
    pub transfer_s: f64,
    /// The slowest rendezvous.
    pub rebuild_s: f64,
}

/// Where a survivor stopped when its step (or its move to a new plan) failed.
#[derive(Debug, Clone, PartialEq)]
pub struct StopReport<S> {
    /// Steps committed.
    pub steps_done: u64,
    /// The step it computed but could not commit (its commit vote failed), if any.
    pub held: Option<u64>,
    /// The experts resident on it, per layer. After a move that failed half-way this is not
    /// what any plan says (its old experts and those it received), so recovery plans from what
    /// the survivors say they hold.
    pub holds: Vec<Vec<usize>>,
    /// The global report of its last committed step, if it has it.
    pub last: Option<S>,
    /// The expert snapshots it keeps for other nodes (the snapshot tier).
    pub snapshots: Vec<SnapshotHeld>,
}

pub use lazarus_plan::{RankTransfer, SnapshotHeld};

/// An expert that lost every live replica and comes back from a snapshot in a move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoredExpert {
    pub layer: usize,
    pub expert: usize,
    /// The step of the snapshot, and how many committed steps it is behind the job.
    pub from_step: u64,
    pub stale_steps: u64,
    /// Tokens the expert processed after its snapshot (their updates are lost).
    pub tokens_lost: u64,
    /// The worker whose memory it comes from.
    pub holder: NodeId,
}

/// What the controller is told.
#[derive(Debug, Clone, PartialEq)]
pub enum Event<S> {
    /// The node is alive (its agent's or worker's heartbeat).
    Heartbeat { node: NodeId },
    /// The node's worker exited.
    Exited { node: NodeId, status: String },
    /// The node is listening for the rendezvous of `epoch` at `addr`.
    Listening { node: NodeId, epoch: u64, addr: String },
    /// The node finished moving to `epoch`'s plan (connected, transfers done): it trains.
    Ready { node: NodeId, epoch: u64 },
    /// The node's step failed at `epoch`; where it stopped.
    StepFailed { node: NodeId, epoch: u64, report: StopReport<S> },
    /// The node stopped after a step at `epoch` because the controller asked it to (the pause
    /// before a planned move: a join, a rebalance, a drain, a stop), not a failure; where.
    Paused { node: NodeId, epoch: u64, report: StopReport<S> },
    /// `steps` steps finished at `epoch`, the last being `step`, in `seconds` (a worker's
    /// report: one step; the simulator: a stretch at once): the load monitor takes their
    /// expert loads, summed. The first report after a move also brings what that move cost.
    StepDone { epoch: u64, step: u64, steps: u64, loads: Vec<Vec<u64>>, seconds: f64, moved: Option<MoveCost> },
    /// A checkpoint of `step` was written.
    Checkpointed { step: u64 },
    /// A new node's workers (their ids never used before) started and wait to be taken in.
    Joined { workers: Vec<NodeId> },
    /// These workers' node leaves soon (a preemption notice): move the job off it first.
    Drain { workers: Vec<NodeId>, reason: String },
    /// The node finished its work (the last step trained, its part of the final checkpoint
    /// written, a benchmark's results sent).
    Done { node: NodeId },
    /// The job is asked to stop (SIGTERM, Ctrl-C): every rank finishes after the same step and
    /// writes the final checkpoint.
    StopRequested { why: String },
    /// A rebalance asked for (`Command::Weigh`) was weighed beside the decisions: its verdict.
    Weighed(Weighed),
    /// Time passed.
    Tick,
}

/// A move to a new plan as the controller decides it: the move itself
/// ([`lazarus_plan::Move`], the one shape it keeps down to each worker), the node worker of each
/// rank, and what the controller keeps of it (where survivors commit, why, what snapshots
/// restored).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoveDecision {
    /// The worker of each rank of the new world.
    pub ranks: Vec<NodeId>,
    #[serde(flatten)]
    pub change: lazarus_plan::Move,
    /// Every survivor commits up to this step (one behind commits its held step; one at it drops
    /// what it holds).
    pub commit_to: u64,
    /// Why the job moves.
    pub cause: MoveCause,
    /// Experts restored from snapshots in this move (their live replicas all lost); the move's
    /// `catch_up` lists those that lost tokens.
    pub restored: Vec<RestoredExpert>,
    /// Steps of every worker a rollback to the last checkpoint would have run again (what
    /// restoring from snapshots saved; 0 when nothing was restored).
    pub rollback_avoided: u64,
}

/// Why the job moves to a new plan; a `reconfiguration` record's `cause` (its JSON names are
/// the records' since the first release: a failure's move is `reconfigure`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MoveCause {
    /// Workers were lost; the survivors go on with every expert's state (and any waiting to
    /// join come in).
    #[serde(rename = "reconfigure")]
    Failure,
    /// Workers were lost with every replica and snapshot of some expert: every survivor
    /// reloads the last checkpoint (or the initial state) under the new plan.
    Rollback,
    /// Workers waiting to join are taken in at a step boundary.
    Join,
    /// A new plan from the measured loads, applied at a step boundary.
    Rebalance,
    /// A node leaves on notice: its experts are handed over before it goes.
    Drain,
    /// The job's controller was lost and a new one took the job back (members it did not
    /// hear from again are lost on the way).
    Controller,
}

impl MoveCause {
    /// The cause as a `reconfiguration` record names it.
    pub fn as_str(self) -> &'static str {
        match self {
            MoveCause::Failure => "reconfigure",
            MoveCause::Rollback => "rollback",
            MoveCause::Join => "join",
            MoveCause::Rebalance => "rebalance",
            MoveCause::Drain => "drain",
            MoveCause::Controller => "controller",
        }
    }
}

displayed_as_str!(MoveCause);

/// What the shell must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Command<S> {
    /// Make sure nothing of the node runs on (a hung worker is killed): it missed its lease
    /// (`silent_since`: when it was last heard from, the failure's start as far as anyone can
    /// tell), or another worker of its node was lost (None: it failed with that one).
    Kill { node: NodeId, reason: String, silent_since: Option<std::time::Instant> },
    /// Survivors move to a new plan without losing state.
    Reconfigure(MoveDecision),
    /// An expert lost every replica: every survivor reloads the checkpoint of step `to_step`
    /// (`None`: the job's initial state) under the move's plan, without transfers.
    Rollback { to: MoveDecision, to_step: Option<u64> },
    /// Send the rendezvous addresses of `epoch`, in rank order, to its ranks.
    Addresses { epoch: u64, addrs: Vec<String> },
    /// A rank of `epoch` was lost during its rendezvous or move: tell the survivors (`nodes`)
    /// to give it up and say where they stopped.
    Abandon { epoch: u64, nodes: Vec<NodeId> },
    /// Ranks of `epoch` were lost: tell the survivors (`nodes`) to cut their connections to
    /// them, so that a step waiting on a rank that is silent but connected (hung, or cut off by
    /// a partition) fails now instead of at its deadline.
    Fence { epoch: u64, ranks: Vec<usize>, nodes: Vec<NodeId> },
    /// Every rank of `epoch` is ready: training runs.
    Resume { epoch: u64 },
    /// Ask the ranks of `epoch` (`nodes`) to stop after the current step and say where they
    /// stopped: a planned move (workers joining) follows.
    Pause { epoch: u64, nodes: Vec<NodeId> },
    /// The job cannot go on.
    Stop { reason: StopReason },
    /// Ask the ranks of `epoch` (`nodes`) to finish after the current step, with the final
    /// checkpoint (a stop was asked for; asked again at each new epoch).
    Finish { epoch: u64, nodes: Vec<NodeId> },
    /// Every rank finished its work: the job is complete.
    Complete,
    /// Weigh this rebalance beside the decisions (a pure function of the request, seconds at a
    /// thousand nodes) and hand its verdict back as `Event::Weighed`.
    Weigh(Box<Weighing>),
    /// A rebalance was weighed (applied: a `Pause` follows).
    Rebalance(RebalanceDecision),
    /// A committed step the log lacks (rank 0 was lost after its commit vote, before its report
    /// got out), from a survivor's copy: log it, so that every committed step is logged once.
    LogStep(S),
}

/// Why the controller stopped a job (what its `Stop` says, and the user reads).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// Every node is lost, and no worker waits to join.
    EveryNodeLost,
    /// The survivors have fewer expert slots than a layer has experts; `checkpoint`: the last
    /// one, what the job resumes from with more nodes.
    TooFewSlots { workers: usize, slots: usize, experts: usize, checkpoint: Option<u64> },
    /// A node lost some of its workers but not all: plans have whole nodes.
    PartialNode { gpus_per_node: usize },
    /// The survivors' plan could not be made.
    CannotPlan(String),
    /// A job without live recovery lost a worker: its first loss, as it was seen.
    Lost { worker: NodeId, why: String },
    /// The workers were not all ready by the start deadline.
    NotStarted { within_s: u64, ready: usize, ranks: usize },
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopReason::EveryNodeLost => f.write_str("every node is lost"),
            StopReason::TooFewSlots { workers, slots, experts, checkpoint } => {
                write!(f, "the {workers} surviving workers have {slots} expert slots, fewer than the {experts} experts of a layer; ")?;
                match checkpoint {
                    Some(step) => write!(f, "the last checkpoint is of step {step}"),
                    None => write!(f, "no checkpoint was written ({}, {})", Setting::CheckpointDir, Setting::CheckpointEvery),
                }
            }
            StopReason::PartialNode { gpus_per_node } => {
                write!(f, "a node has lost some of its {gpus_per_node} workers but not all (cannot plan partial nodes)")
            }
            StopReason::CannotPlan(e) => write!(f, "cannot plan the survivors: {e}"),
            StopReason::Lost { worker, why } => write!(f, "worker {worker} lost: {why}"),
            StopReason::NotStarted { within_s, ready, ranks } => {
                write!(f, "the workers did not all start within {within_s} s: {ready} of {ranks} ready")
            }
        }
    }
}
