//! The controller's decisions as a pure function: [`Controller::decide`]`(now, event) ->
//! Vec<Command>`, tested without sockets or clocks (the way torchft's lighthouse computes a
//! quorum). The shell around it — the launcher today, agents over the network next — carries
//! events in and commands out.
//!
//! What it keeps (paper §3, §4.3; docs/architecture.md, what a failure does):
//! * **membership**: the nodes of the job (one worker each, for now), when each was last heard
//!   from, and each one's plan epoch; a node whose worker exits, or that misses its lease, is
//!   lost (and a hung one is killed);
//! * **the plan epoch**: every plan and rendezvous is stamped; a report from an older epoch than
//!   the node's is stale and ignored;
//! * **the load monitor**: the expert loads of every finished step since the plan was made;
//! * **recovery**: after a loss, every survivor says where it stopped (steps committed, and the
//!   step it holds if the commit vote failed); once all have, the furthest committed step is the
//!   step everyone commits to, and the survivors move to a new plan from the one scheduler
//!   (`plan_model`) with the state transfers of `plan_reconfiguration` — or, if an expert lost
//!   every replica, everyone rolls back to the last checkpoint; if the survivors cannot hold one
//!   replica of every expert, the job stops with the reason.

mod rebalance;
#[cfg(test)]
mod tests;

pub use rebalance::{LayerCase, RebalanceCase, RebalanceDecision};

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use lazarus_plan::{plan_model, plan_reconfiguration, rank_transfers, ClusterShape, ModelPlan, NodeState, Placement, PlanPolicy};
use lazarus_runtime::ExpertTransfer;
use serde::{Deserialize, Serialize};

use crate::protocol::CommittedStep;

/// A node of the job (today: one worker process).
pub type NodeId = u64;

/// How many recent events the controller remembers (for status reports).
const RECENT_EVENTS: usize = 64;

/// What the controller needs to know of the job to plan it.
#[derive(Debug, Clone)]
pub struct JobSpec {
    pub layers: usize,
    pub experts: usize,
    /// Expert replica slots of one node (G·c).
    pub slots_per_node: usize,
    /// Workers (GPUs) of one node, G: the nodes given to [`Controller::new`] are workers, G
    /// consecutive ones a node. A node is the unit of failure: when one of its workers is lost,
    /// the others are given up with it, and plans place replicas across nodes.
    pub gpus_per_node: usize,
    pub policy: PlanPolicy,
    /// Bytes of one expert's training state (weights and AdamW moments): what a transfer moves.
    pub expert_bytes: u64,
    /// A node not heard from for this long is lost.
    pub lease: Duration,
    /// How long workers that join a running job wait before they are taken in (at a step
    /// boundary), so that several arrivals share one move (paper §4.3: 2 minutes). A recovery
    /// from a failure takes in every worker waiting at once.
    pub join_wait: Duration,
    /// Every this many steps the controller weighs a new plan from the loads measured since the
    /// last one and applies it at a step boundary if it repays its move (0: never).
    pub rebalance_every: u64,
    /// The step the job ends at: a rebalance must repay its move before then.
    pub total_steps: u64,
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

/// Before any move was measured: 1 GB/s, and 50 ms for the pause and rendezvous (loopback-like;
/// the first measured move replaces both).
const DEFAULT_SECONDS_PER_BYTE: f64 = 1e-9;
const DEFAULT_MOVE_FIXED_S: f64 = 0.05;

/// Where a survivor stopped when its step (or its move to a new plan) failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StopReport {
    /// Steps committed.
    pub steps_done: u64,
    /// The step it computed but could not commit (its commit vote failed), if any.
    pub held: Option<u64>,
    /// The experts resident on it, per layer. After a move that failed half-way this is not
    /// what any plan says (its old experts and those it received), so recovery plans from what
    /// the survivors say they hold.
    pub holds: Vec<Vec<usize>>,
    /// The global report of its last committed step, if it has it.
    #[serde(default)]
    pub last: Option<CommittedStep>,
    /// The expert snapshots it keeps for other nodes (the snapshot tier).
    #[serde(default)]
    pub snapshots: Vec<SnapshotHeld>,
}

/// A snapshot a worker keeps (its own type, told the controller as it is).
pub use lazarus_runtime::SnapshotHeld;

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
pub enum Event {
    /// The node is alive (its agent's or worker's heartbeat).
    Heartbeat { node: NodeId },
    /// The node's worker exited.
    Exited { node: NodeId, status: String },
    /// The node is listening for the rendezvous of `epoch` at `addr`.
    Listening { node: NodeId, epoch: u64, addr: String },
    /// The node finished moving to `epoch`'s plan (connected, transfers done): it trains.
    Ready { node: NodeId, epoch: u64 },
    /// The node's step failed at `epoch`; where it stopped.
    StepFailed { node: NodeId, epoch: u64, report: StopReport },
    /// A step finished at `epoch` (rank 0's report) in `seconds`: the load monitor takes its
    /// expert loads. The first step after a move also brings what that move cost.
    StepDone { epoch: u64, step: u64, loads: Vec<Vec<u64>>, seconds: f64, moved: Option<MoveCost> },
    /// A checkpoint of `step` was written.
    Checkpointed { step: u64 },
    /// A new node's workers (their ids never used before) started and wait to be taken in.
    Joined { workers: Vec<NodeId> },
    /// These workers' node leaves soon (a preemption notice): move the job off it first.
    Drain { workers: Vec<NodeId>, reason: String },
    /// Time passed.
    Tick,
}

/// The transfers and renumbering of a move to a new plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Move {
    pub epoch: u64,
    /// The node of each rank of the new world.
    pub ranks: Vec<NodeId>,
    /// Replicas of each expert on each rank.
    pub plan: lazarus_plan::ReplicaMap,
    /// Every survivor commits up to this step (one behind commits its held step; one at it drops
    /// what it holds).
    pub commit_to: u64,
    pub transfers: Vec<ExpertTransfer>,
    /// Ranks of the new world that join the job with it (they take the replicated state from
    /// the others).
    pub joining: Vec<usize>,
    /// Ranks of the new world that only send what they alone hold, then leave (a drained node);
    /// the plan gives them nothing.
    pub leaving: Vec<usize>,
    /// Train nothing after the move: the controller moves the job again at once (without the
    /// leaving ranks).
    pub hold: bool,
    /// Why the job moves.
    pub cause: MoveCause,
    /// Experts restored from snapshots in this move (their live replicas all lost).
    pub restored: Vec<RestoredExpert>,
    /// Steps of every worker a rollback to the last checkpoint would have run again (what
    /// restoring from snapshots saved; 0 when nothing was restored).
    pub rollback_avoided: u64,
}

/// Why the job moves to a new plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MoveCause {
    /// Workers were lost; the survivors go on (and any waiting to join come in).
    Failure,
    /// Workers waiting to join are taken in at a step boundary.
    Join,
    /// A new plan from the measured loads, applied at a step boundary.
    Rebalance,
    /// A node leaves on notice: its experts are handed over before it goes.
    Drain,
}

impl MoveCause {
    /// The cause as a `reconfiguration` record names it.
    pub fn name(self) -> &'static str {
        match self {
            MoveCause::Failure => "reconfigure",
            MoveCause::Join => "join",
            MoveCause::Rebalance => "rebalance",
            MoveCause::Drain => "drain",
        }
    }
}

/// What the shell must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// The node missed its lease: make sure nothing of it runs on (a hung worker is killed).
    Kill { node: NodeId, reason: String },
    /// Survivors move to a new plan without losing state.
    Reconfigure(Move),
    /// An expert lost every replica: every survivor reloads the checkpoint of step `to_step`
    /// (`None`: the job's initial state) under the move's plan, without transfers.
    Rollback { to: Move, to_step: Option<u64> },
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
    Stop { reason: String },
    /// A rebalance was weighed (applied: a `Pause` follows).
    Rebalance(RebalanceDecision),
    /// A committed step the log lacks (rank 0 was lost after its commit vote, before its report
    /// got out), from a survivor's copy: log it, so that every committed step is logged once.
    LogStep(CommittedStep),
}

#[derive(Debug, Clone, PartialEq)]
enum Phase {
    /// Waiting for every rank of the epoch to listen, then to be ready.
    Rendezvous {
        addrs: BTreeMap<NodeId, String>,
        ready: BTreeSet<NodeId>,
    },
    Running,
    /// After a loss: waiting for every survivor to say where it stopped.
    Collecting {
        reports: BTreeMap<NodeId, StopReport>,
    },
    Stopped,
}

/// The controller of one job.
#[derive(Debug, Clone)]
pub struct Controller {
    spec: JobSpec,
    epoch: u64,
    plan: ModelPlan,
    /// The node of each rank of the current plan.
    ranks: Vec<NodeId>,
    alive: BTreeSet<NodeId>,
    last_seen: BTreeMap<NodeId, Instant>,
    /// The epoch each node was last told to be in.
    node_epoch: BTreeMap<NodeId, u64>,
    phase: Phase,
    /// Σ expert loads per layer since the plan was made (the load monitor).
    loads: Vec<Vec<f64>>,
    checkpoint: Option<u64>,
    last_step: u64,
    recent: VecDeque<String>,
    /// When `decide` last ran (a longer gap than half a lease is a stall of the controller).
    last_decision: Option<Instant>,
    /// The node of each worker (its position among the first workers, divided by G).
    node_of: BTreeMap<NodeId, u64>,
    /// Workers that joined and wait to be taken in, with when they joined.
    standby: BTreeMap<NodeId, Instant>,
    /// Why the job is collecting where its ranks stopped: `Some` for a move it asked for
    /// (a pause), `None` for a failure.
    planned: Option<MoveCause>,
    /// Steps done since the plan was made, and their seconds (the measured step time).
    steps_since_plan: u64,
    step_seconds: f64,
    /// The cost of moving, from the last measured move.
    seconds_per_byte: f64,
    move_fixed_s: f64,
    /// Workers whose node leaves on notice, until they are gone.
    draining: BTreeSet<NodeId>,
    /// The plan an applied rebalance moves to (the measured-load plan, or only its layers worth
    /// moving), until its move.
    rebalance_to: Option<ModelPlan>,
}

impl Controller {
    /// A job starting at epoch 0 on `nodes` (rank i = nodes[i]) under `plan`.
    pub fn new(spec: JobSpec, plan: ModelPlan, nodes: Vec<NodeId>, now: Instant) -> Self {
        let g = spec.gpus_per_node.max(1);
        let node_of = nodes.iter().enumerate().map(|(i, &n)| (n, (i / g) as u64)).collect();
        let alive: BTreeSet<NodeId> = nodes.iter().copied().collect();
        Controller {
            loads: vec![vec![0.0; spec.experts]; spec.layers],
            spec,
            epoch: plan.epoch(),
            ranks: nodes.clone(),
            last_seen: nodes.iter().map(|&n| (n, now)).collect(),
            node_epoch: nodes.iter().map(|&n| (n, plan.epoch())).collect(),
            plan,
            alive,
            phase: Phase::Rendezvous { addrs: BTreeMap::new(), ready: BTreeSet::new() },
            checkpoint: None,
            last_step: 0,
            recent: VecDeque::new(),
            last_decision: None,
            node_of,
            standby: BTreeMap::new(),
            planned: None,
            steps_since_plan: 0,
            step_seconds: 0.0,
            seconds_per_byte: DEFAULT_SECONDS_PER_BYTE,
            move_fixed_s: DEFAULT_MOVE_FIXED_S,
            draining: BTreeSet::new(),
            rebalance_to: None,
        }
    }

    /// Whether `worker` has a rank of the current epoch beyond the plan's: a drained worker
    /// that sent what it alone held and now leaves.
    fn is_leaver(&self, worker: NodeId) -> bool {
        self.ranks.iter().position(|&n| n == worker).is_some_and(|i| i >= self.plan.shape().ranks())
    }

    /// What `worker` is to the job: `member`, `standby` (waits to be taken in), `leaving` (its
    /// node gave notice) or `lost`.
    pub fn member_state(&self, worker: NodeId) -> &'static str {
        if self.standby.contains_key(&worker) {
            "standby"
        } else if !self.alive.contains(&worker) {
            "lost"
        } else if self.draining.contains(&worker) {
            "leaving"
        } else {
            "member"
        }
    }

    /// Workers that joined and wait to be taken in.
    pub fn standby(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.standby.keys().copied()
    }

    /// When the workers waiting to join are due to be taken in (None: none wait).
    fn join_due(&self) -> Option<Instant> {
        self.standby.values().min().map(|&t| t + self.spec.join_wait)
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn plan(&self) -> &ModelPlan {
        &self.plan
    }

    /// The node of each rank of the current epoch.
    pub fn ranks(&self) -> &[NodeId] {
        &self.ranks
    }

    pub fn alive(&self) -> &BTreeSet<NodeId> {
        &self.alive
    }

    /// Whether the job has stopped.
    pub fn stopped(&self) -> bool {
        self.phase == Phase::Stopped
    }

    /// Whether every rank of the epoch trains.
    pub fn running(&self) -> bool {
        self.phase == Phase::Running
    }

    /// The experts the current plan places on worker `node`, per layer (None: not a rank of it).
    pub fn planned_holdings(&self, node: NodeId) -> Option<Vec<Vec<usize>>> {
        let i = self.ranks.iter().position(|&n| n == node)?;
        let map = self.plan.replica_map();
        // A leaving rank (beyond the plan's) is given nothing.
        Some(map.layers().iter().map(|l| (0..l.len()).filter(|&e| l[e].get(i).is_some_and(|&x| x > 0)).collect()).collect())
    }

    /// The node worker `worker` belongs to.
    fn node(&self, worker: NodeId) -> u64 {
        self.node_of.get(&worker).copied().unwrap_or(u64::MAX)
    }

    /// The most recent events, oldest first.
    pub fn recent(&self) -> impl Iterator<Item = &String> {
        self.recent.iter()
    }

    /// The phase of the job: `rendezvous`, `running`, `collecting` (a loss is being recovered
    /// from) or `stopped`.
    pub fn phase_name(&self) -> &'static str {
        match self.phase {
            Phase::Rendezvous { .. } => "rendezvous",
            Phase::Running => "running",
            Phase::Collecting { .. } => "collecting",
            Phase::Stopped => "stopped",
        }
    }

    /// Every node the job has had, alive or lost.
    pub fn nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.last_seen.keys().copied()
    }

    /// The epoch `node` was last told to be in.
    pub fn node_epoch(&self, node: NodeId) -> Option<u64> {
        self.node_epoch.get(&node).copied()
    }

    /// The last step a worker reported done.
    pub fn last_step(&self) -> u64 {
        self.last_step
    }

    /// The step of the last checkpoint written, if any.
    pub fn checkpoint(&self) -> Option<u64> {
        self.checkpoint
    }

    pub fn lease(&self) -> Duration {
        self.spec.lease
    }

    /// When `node` was last heard from (for a node lost by its lease: when it fell silent).
    pub fn last_heard(&self, node: NodeId) -> Option<Instant> {
        self.last_seen.get(&node).copied()
    }

    /// When the next lease runs out, if no heartbeat comes first.
    pub fn deadline(&self) -> Option<Instant> {
        if self.stopped() {
            return None;
        }
        self.alive.iter().chain(self.standby.keys()).filter_map(|n| self.last_seen.get(n)).min().map(|&t| t + self.spec.lease)
    }

    /// When the shell must call [`Controller::decide`] next (with a `Tick` if nothing else
    /// came): the next lease's end, and at least every quarter lease — so that a longer gap
    /// between two decisions means the controller itself was stalled (see `decide`).
    pub fn next_wake(&self, now: Instant) -> Instant {
        let cadence = now + self.spec.lease / 4;
        let due = self.join_due().filter(|_| self.running()).map_or(cadence, |j| j.min(cadence));
        self.deadline().map_or(due, |d| d.min(due))
    }

    fn note(&mut self, what: String) {
        if self.recent.len() == RECENT_EVENTS {
            self.recent.pop_front();
        }
        self.recent.push_back(what);
    }

    /// Take one event; returns what to do, in order.
    pub fn decide(&mut self, now: Instant, event: Event) -> Vec<Command> {
        let mut out = Vec::new();
        if self.stopped() {
            return out;
        }
        // A controller that was not running (paused, descheduled, its host asleep) for more
        // than half a lease heard nothing in that time and cannot tell who fell silent: every
        // node's silence is counted from where it stood when the stall began.
        if let Some(prev) = self.last_decision {
            let gap = now.saturating_duration_since(prev);
            if gap > self.spec.lease / 2 {
                self.note(format!("the controller was stalled for {} ms: leases extended by as much", gap.as_millis()));
                for t in self.last_seen.values_mut() {
                    *t += gap;
                }
            }
        }
        self.last_decision = Some(self.last_decision.map_or(now, |p| p.max(now)));
        let was_rendezvous = matches!(self.phase, Phase::Rendezvous { .. });
        let mut alive_before = self.alive.clone();
        match event {
            Event::Heartbeat { node } => {
                if self.alive.contains(&node) || self.standby.contains_key(&node) {
                    self.last_seen.insert(node, now);
                }
            }
            Event::Tick => {}
            Event::Exited { node, status } => {
                if self.alive.contains(&node) && self.is_leaver(node) {
                    // Expected: a drained worker leaves once its move is done (nothing to fence).
                    self.alive.remove(&node);
                    alive_before.remove(&node);
                    self.draining.remove(&node);
                    self.planned = Some(MoveCause::Drain);
                    self.note(format!("epoch {}: worker {node} left (drained)", self.epoch));
                    // The others hold after the move and say so; a rendezvous still finishing
                    // counted this one's Ready already.
                    if self.running() {
                        self.phase = Phase::Collecting { reports: BTreeMap::new() };
                    }
                } else if self.alive.contains(&node) {
                    self.lose(node, &format!("exited ({status})"));
                } else if self.standby.contains_key(&node) {
                    self.give_up_standby(node, &format!("exited ({status})"), &mut out);
                }
            }
            Event::Drain { workers, reason } => {
                // The whole node of each worker named, as far as it is in the job.
                let nodes: BTreeSet<u64> = workers.iter().filter(|w| self.alive.contains(w)).map(|&w| self.node(w)).collect();
                let all: Vec<NodeId> = self.alive.iter().copied().filter(|&w| nodes.contains(&self.node(w))).collect();
                if !all.is_empty() {
                    self.note(format!("epoch {}: workers {all:?} leave on notice ({reason})", self.epoch));
                    self.draining.extend(all);
                }
            }
            Event::Joined { workers } => {
                let fresh: Vec<NodeId> = workers.into_iter().filter(|w| !self.last_seen.contains_key(w)).collect();
                if !fresh.is_empty() {
                    let node = self.node_of.values().max().map_or(0, |&n| n + 1);
                    for &w in &fresh {
                        self.node_of.insert(w, node);
                        self.last_seen.insert(w, now);
                        self.node_epoch.insert(w, self.epoch);
                        self.standby.insert(w, now);
                    }
                    self.note(format!("epoch {}: node {node} joined with workers {fresh:?}; taken in at a step boundary", self.epoch));
                }
            }
            Event::Listening { node, epoch, addr } => {
                self.last_seen.insert(node, now);
                if let Phase::Rendezvous { addrs, .. } = &mut self.phase {
                    if epoch == self.epoch && self.ranks.contains(&node) {
                        addrs.insert(node, addr);
                        if self.ranks.iter().all(|n| addrs.contains_key(n)) {
                            let list = self.ranks.iter().map(|n| addrs[n].clone()).collect();
                            out.push(Command::Addresses { epoch, addrs: list });
                        }
                    }
                }
            }
            Event::Ready { node, epoch } => {
                self.last_seen.insert(node, now);
                if let Phase::Rendezvous { ready, .. } = &mut self.phase {
                    if epoch == self.epoch && self.ranks.contains(&node) {
                        ready.insert(node);
                        if self.ranks.iter().all(|n| ready.contains(n)) {
                            self.phase = Phase::Running;
                            out.push(Command::Resume { epoch });
                        }
                    }
                }
            }
            Event::StepFailed { node, epoch, report } => {
                self.last_seen.insert(node, now);
                let current = self.node_epoch.get(&node).copied();
                if self.alive.contains(&node) && current == Some(epoch) {
                    if !matches!(self.phase, Phase::Collecting { .. }) {
                        self.note(format!("epoch {epoch}: node {node} stopped at step {}", report.steps_done));
                        self.phase = Phase::Collecting { reports: BTreeMap::new() };
                    }
                    let report = self.sanitized(report);
                    if let Phase::Collecting { reports } = &mut self.phase {
                        reports.insert(node, report);
                    }
                }
            }
            Event::StepDone { epoch, step, loads, seconds, moved } => {
                if epoch == self.epoch && loads.len() == self.loads.len() {
                    for (acc, l) in self.loads.iter_mut().zip(&loads) {
                        if l.len() == acc.len() {
                            acc.iter_mut().zip(l).for_each(|(a, &x)| *a += x as f64);
                        }
                    }
                    self.last_step = self.last_step.max(step);
                    if seconds.is_finite() && seconds >= 0.0 {
                        self.steps_since_plan += 1;
                        self.step_seconds += seconds;
                    }
                }
                if let Some(m) = moved.filter(|m| m.bytes > 0 && m.transfer_s.is_finite() && m.transfer_s > 0.0) {
                    self.seconds_per_byte = m.transfer_s / m.bytes as f64;
                    if m.rebuild_s.is_finite() && m.rebuild_s >= 0.0 {
                        self.move_fixed_s = m.rebuild_s;
                    }
                }
            }
            Event::Checkpointed { step } => self.checkpoint = Some(step),
        }
        // Leases are checked whatever the event: a stream of heartbeats from the healthy nodes
        // must not hide the one that fell silent.
        let late: Vec<NodeId> =
            self.alive.iter().copied().filter(|n| self.last_seen.get(n).is_some_and(|&t| now >= t + self.spec.lease)).collect();
        for node in late {
            let reason = format!("no heartbeat for {} ms", self.spec.lease.as_millis());
            out.push(Command::Kill { node, reason: reason.clone() });
            self.lose(node, &reason);
        }
        let late: Vec<NodeId> =
            self.standby.keys().copied().filter(|n| self.last_seen.get(n).is_some_and(|&t| now >= t + self.spec.lease)).collect();
        for node in late {
            if self.standby.contains_key(&node) {
                let reason = format!("no heartbeat for {} ms", self.spec.lease.as_millis());
                out.push(Command::Kill { node, reason: reason.clone() });
                self.give_up_standby(node, &reason, &mut out);
            }
        }
        // A node is the unit of failure: the other workers of a node that lost one are given up
        // with it (and killed), so that plans always have whole nodes.
        if self.spec.gpus_per_node > 1 {
            let lost_now: Vec<NodeId> = alive_before.iter().copied().filter(|n| !self.alive.contains(n)).collect();
            for lost in lost_now {
                let siblings: Vec<NodeId> = self.alive.iter().copied().filter(|&w| self.node(w) == self.node(lost)).collect();
                for w in siblings {
                    let reason = format!("worker {lost} of its node was lost");
                    out.push(Command::Kill { node: w, reason: reason.clone() });
                    self.lose(w, &reason);
                }
            }
        }
        // Ranks of a running epoch lost now are fenced off by the survivors (a rendezvous is
        // called off instead, below).
        let lost_ranks: Vec<usize> =
            (0..self.ranks.len()).filter(|&r| alive_before.contains(&self.ranks[r]) && !self.alive.contains(&self.ranks[r])).collect();
        if !was_rendezvous && !lost_ranks.is_empty() {
            let nodes: Vec<NodeId> = self.ranks.iter().copied().filter(|n| self.alive.contains(n)).collect();
            if !nodes.is_empty() {
                out.push(Command::Fence { epoch: self.epoch, ranks: lost_ranks, nodes });
            }
        }
        if was_rendezvous && matches!(self.phase, Phase::Collecting { .. }) {
            // Survivors may be waiting for addresses that will never come, or connecting to
            // a rank that is gone: call the rendezvous off.
            // (Unless no one is left to tell: every member was lost, and the plan made below
            // is a new epoch's.)
            let nodes: Vec<NodeId> = self.alive.iter().copied().collect();
            if !nodes.is_empty() {
                out.push(Command::Abandon { epoch: self.epoch, nodes });
            }
        }
        // A node that leaves on notice: every rank stops after the step in flight and the job
        // moves off it (before the joiners' wait or a rebalance: it cannot wait).
        if self.running() && self.draining.iter().any(|&w| self.ranks.contains(&w) && !self.is_leaver(w)) {
            self.note(format!("epoch {}: pause to move off workers {:?}", self.epoch, self.draining));
            self.pause(MoveCause::Drain, &mut out);
        }
        // Every `rebalance_every` steps: weigh a plan from the measured loads (not while
        // workers wait to join: their move re-plans anyway).
        let every = self.spec.rebalance_every;
        if self.running() && every > 0 && self.steps_since_plan >= every && self.standby.is_empty() {
            let weighed = self.weigh_rebalance();
            self.steps_since_plan = 0;
            self.step_seconds = 0.0;
            if let Some((d, target)) = weighed {
                let apply = d.decision != "skip";
                self.note(format!(
                    "epoch {}: rebalance at step {}: {} (gain {:.2} s, cost {:.2} s over {} steps)",
                    self.epoch, d.step, d.decision, d.gain_s, d.cost_s, d.horizon_steps
                ));
                out.push(Command::Rebalance(d));
                if apply {
                    self.rebalance_to = Some(target);
                    self.pause(MoveCause::Rebalance, &mut out);
                }
            }
        }
        // Workers waiting to join are taken in at a step boundary once their wait is over.
        if self.running() && self.join_due().is_some_and(|due| now >= due) {
            self.note(format!("epoch {}: pause to take in workers {:?}", self.epoch, self.standby.keys().collect::<Vec<_>>()));
            self.pause(MoveCause::Join, &mut out);
        }
        self.try_recover(&mut out);
        out
    }

    /// Ask every rank to stop after the step in flight and say where it stopped: a move for
    /// `cause` follows once all have (a loss on the way makes it a failure's).
    fn pause(&mut self, cause: MoveCause, out: &mut Vec<Command>) {
        self.phase = Phase::Collecting { reports: BTreeMap::new() };
        self.planned = Some(cause);
        out.push(Command::Pause { epoch: self.epoch, nodes: self.ranks.clone() });
    }

    /// The plan the measured loads call for on the current nodes, against the current one: what
    /// each layer's move would gain and cost, the decision, and the plan it moves to (None: no
    /// loads measured, or nothing to plan).
    fn weigh_rebalance(&self) -> Option<(RebalanceDecision, ModelPlan)> {
        if !self.loads.iter().flatten().any(|&x| x > 0.0) || self.steps_since_plan == 0 {
            return None;
        }
        let candidate = plan_model(&self.loads, self.plan.shape(), &self.spec.policy, Some(&self.plan)).ok()?;
        // What each node holds now (its workers' experts), and the node of each plan position.
        let g = self.spec.gpus_per_node.max(1);
        let mut held: BTreeMap<u64, Vec<Vec<usize>>> = BTreeMap::new();
        for &w in &self.ranks {
            let entry = held.entry(self.node(w)).or_insert_with(|| vec![Vec::new(); self.spec.layers]);
            for (l, experts) in self.planned_holdings(w)?.into_iter().enumerate() {
                entry[l].extend(experts);
            }
        }
        let position_node: Vec<u64> = self.ranks.chunks(g).map(|ws| self.node(ws[0])).collect();
        let live: Vec<NodeState> = held.into_iter().map(|(node, experts)| NodeState { node, experts }).collect();
        let bytes = vec![self.spec.expert_bytes; self.spec.layers];
        let rp = plan_reconfiguration(&live, candidate.layers(), &bytes).ok()?;
        // The candidate with its nodes where the mapping puts them (plan position n on the node
        // now at position n): layers of it and of the current plan then mix without moving more.
        let aligned: Vec<Placement> = candidate
            .layers()
            .iter()
            .map(|p| {
                let nodes = position_node
                    .iter()
                    .map(|n| rp.plan_to_node.iter().position(|m| m == n).map(|q| p.nodes()[q].clone()))
                    .collect::<Option<Vec<_>>>()?;
                Placement::from_nodes(p.shape(), p.experts(), nodes).ok()
            })
            .collect::<Option<_>>()?;
        let mut layers = Vec::new();
        let (mut imbalance_before, mut imbalance_after) = (0.0, 0.0);
        for (l, loads) in self.loads.iter().enumerate() {
            let before = self.plan.layers()[l].load_balance(loads).ok()?;
            let after = aligned[l].load_balance(loads).ok()?;
            imbalance_before += before.imbalance();
            imbalance_after += after.imbalance();
            let moves: Vec<&lazarus_plan::StateTransfer> = rp.transfers.iter().filter(|t| t.layer == l).collect();
            layers.push(LayerCase {
                differs: aligned[l] != self.plan.layers()[l],
                bottleneck_before: before.bottleneck,
                bottleneck_after: after.bottleneck,
                transfers: moves.len(),
                bytes: moves.iter().map(|t| t.bytes).sum(),
            });
        }
        let n = self.spec.layers.max(1) as f64;
        let case = RebalanceCase {
            step_s: self.step_seconds / self.steps_since_plan as f64,
            // The gain counts until the next rebalance is weighed, or the job ends.
            horizon_steps: self.spec.rebalance_every.min(self.spec.total_steps.saturating_sub(self.last_step)),
            layers,
            imbalance_before: imbalance_before / n,
            imbalance_after: imbalance_after / n,
            seconds_per_byte: self.seconds_per_byte,
            fixed_s: self.move_fixed_s,
        };
        let mut d = case.decide(self.last_step);
        // The plan it moves to: the candidate's layers that move, the current plan's others.
        let mixed: Vec<Placement> =
            (0..self.spec.layers).map(|l| if d.layers.contains(&l) { aligned[l].clone() } else { self.plan.layers()[l].clone() }).collect();
        let target = ModelPlan::new(self.plan.epoch(), mixed).ok()?;
        if d.decision == "shrink" {
            let sum: f64 = target.layers().iter().zip(&self.loads).filter_map(|(p, w)| p.load_balance(w).ok()).map(|b| b.imbalance()).sum();
            d.imbalance_after = sum / n;
        }
        Some((d, target))
    }

    /// A worker waiting to join is gone: it and the other workers of its node are given up.
    fn give_up_standby(&mut self, worker: NodeId, why: &str, out: &mut Vec<Command>) {
        let node = self.node(worker);
        self.standby.remove(&worker);
        self.note(format!("epoch {}: worker {worker} waiting to join lost: {why}", self.epoch));
        let siblings: Vec<NodeId> = self.standby.keys().copied().filter(|&w| self.node(w) == node).collect();
        for w in siblings {
            self.standby.remove(&w);
            out.push(Command::Kill { node: w, reason: format!("worker {worker} of its node was lost") });
        }
    }

    /// A report's holdings as far as they fit the job (a peer's word is checked: experts out of
    /// range, and layers beyond the job's, are dropped; a missing layer holds nothing).
    fn sanitized(&self, mut report: StopReport) -> StopReport {
        report.holds.resize(self.spec.layers, Vec::new());
        report.snapshots.retain(|x| x.layer < self.spec.layers && x.expert < self.spec.experts);
        for l in &mut report.holds {
            l.retain(|&e| e < self.spec.experts);
            l.sort_unstable();
            l.dedup();
        }
        report
    }

    /// Node `node` is gone: a collection of where the survivors stopped starts (or goes on).
    fn lose(&mut self, node: NodeId, why: &str) {
        self.alive.remove(&node);
        self.draining.remove(&node);
        self.planned = None;
        self.rebalance_to = None;
        self.note(format!("epoch {}: node {node} lost: {why}", self.epoch));
        if !matches!(self.phase, Phase::Collecting { .. }) {
            self.phase = Phase::Collecting { reports: BTreeMap::new() };
        }
        if let Phase::Collecting { reports } = &mut self.phase {
            reports.remove(&node);
        }
    }

    /// Once every survivor has said where it stopped: the new plan, or a rollback, or a stop.
    fn try_recover(&mut self, out: &mut Vec<Command>) {
        let Phase::Collecting { reports } = &self.phase else { return };
        if self.alive.iter().any(|n| !reports.contains_key(n)) {
            return;
        }
        let mut reports = reports.clone();
        let survivors: Vec<NodeId> = self.alive.iter().copied().collect();
        // With every node lost, workers waiting to join still carry the job on: from the last
        // checkpoint (a rollback below: no expert survives).
        if survivors.is_empty() && self.standby.is_empty() {
            return self.stop("every node is lost".into(), out);
        }
        let cause = self.planned.take().unwrap_or(MoveCause::Failure);
        // Workers waiting to join come in with this move: they hold nothing yet.
        let joiners: Vec<NodeId> = self.standby.keys().copied().collect();
        let mut furthest = reports.values().map(|r| r.steps_done).max().unwrap_or(0);
        // Rank 0 reported (and the log has) a step every survivor computed but none committed:
        // their vote failed after rank 0 got through it, so it is done — committed everywhere
        // now, or it would be run and logged twice.
        let next = furthest + 1;
        if self.last_step == next && reports.values().all(|r| r.steps_done == next || r.held == Some(next)) {
            furthest = next;
        }
        // The other way round: survivors committed a step rank 0 never reported (it was lost
        // after the vote, before its report got out). One of them has its global report.
        if furthest == self.last_step + 1 {
            let copy = reports
                .values()
                .filter_map(|r| r.last.as_ref())
                .find(|c| c.report.step == furthest && c.report.loss.is_finite() && c.seconds.is_finite() && c.seconds >= 0.0);
            if let Some(c) = copy {
                out.push(Command::LogStep(c.clone()));
                self.last_step = furthest;
            }
        }
        for &w in &joiners {
            reports.insert(
                w,
                StopReport { steps_done: furthest, held: None, holds: vec![Vec::new(); self.spec.layers], last: None, snapshots: vec![] },
            );
        }
        // Workers of a node leaving on notice send what only they hold, then go: the plan is
        // for the others.
        let leavers: Vec<NodeId> =
            if cause == MoveCause::Drain { survivors.iter().copied().filter(|w| self.draining.contains(w)).collect() } else { Vec::new() };
        let members: Vec<NodeId> = survivors.iter().chain(&joiners).copied().filter(|w| !leavers.contains(w)).collect();
        let g = self.spec.gpus_per_node.max(1);
        let slots = members.len() * (self.spec.slots_per_node / g);
        if slots < self.spec.experts {
            // What a user resumes from (with more nodes) once this job stops.
            let resume = match self.checkpoint {
                Some(step) => format!("the last checkpoint is of step {step}"),
                None => "no checkpoint was written (--checkpoint-dir, --checkpoint-every)".to_string(),
            };
            let reason = format!(
                "the {} surviving workers have {slots} expert slots, fewer than the {} experts of a layer; {resume}",
                members.len(),
                self.spec.experts
            );
            return self.stop(reason, out);
        }
        let consistent = reports.values().all(|r| r.steps_done == furthest || (r.steps_done + 1 == furthest && r.held == Some(furthest)));
        let epoch = self.epoch + 1;
        // The surviving nodes, each with its workers (whole nodes: see `decide`).
        let mut nodes: BTreeMap<u64, Vec<NodeId>> = BTreeMap::new();
        for &w in &members {
            nodes.entry(self.node(w)).or_default().push(w);
        }
        if nodes.values().any(|ws| ws.len() != g) {
            return self.stop(format!("a node has lost some of its {g} workers but not all (cannot plan partial nodes)"), out);
        }
        let shape = match ClusterShape::new(nodes.len(), g, self.spec.slots_per_node / g) {
            Ok(s) => s,
            Err(e) => return self.stop(format!("cannot plan the survivors: {e}"), out),
        };
        let loads = self.plan_loads();
        // Every expert still has a replica on some survivor (by what they say they hold), or
        // a survivor keeps a snapshot of it: the freshest comes back (MoEtion §6, PEC §3).
        let mut restored: Vec<RestoredExpert> = Vec::new();
        let mut covered = true;
        for l in 0..self.spec.layers {
            for e in 0..self.spec.experts {
                if survivors.iter().any(|n| reports[n].holds[l].contains(&e)) {
                    continue;
                }
                let freshest = survivors
                    .iter()
                    .flat_map(|&n| reports[&n].snapshots.iter().filter(|x| x.layer == l && x.expert == e).map(move |x| (n, *x)))
                    .filter(|(_, x)| x.step <= furthest)
                    .max_by_key(|(n, x)| (x.step, std::cmp::Reverse(*n)));
                match freshest {
                    Some((holder, x)) => restored.push(RestoredExpert {
                        layer: l,
                        expert: e,
                        from_step: x.step,
                        stale_steps: furthest - x.step,
                        tokens_lost: x.tokens_lost.saturating_add(if reports[&holder].steps_done < furthest {
                            x.held_step_tokens
                        } else {
                            0
                        }),
                        holder,
                    }),
                    None => covered = false,
                }
            }
        }
        if !covered {
            restored.clear();
        }
        // A restored expert is held by the worker keeping its snapshot (it sends it from there).
        for x in &restored {
            if let Some(r) = reports.get_mut(&x.holder) {
                r.holds[x.layer].push(x.expert);
                r.holds[x.layer].sort_unstable();
            }
        }
        let survives = consistent && covered;
        let previous = self.plan.clone().with_epoch(self.epoch);
        // The second half of a drain keeps the plan its first half moved the job to.
        let in_place = cause == MoveCause::Drain && leavers.is_empty() && joiners.is_empty() && previous.shape() == shape;
        // An applied rebalance moves to the plan it weighed (shrunk, maybe), if nothing changed since.
        let weighed = self.rebalance_to.take().filter(|p| cause == MoveCause::Rebalance && joiners.is_empty() && p.shape() == shape);
        let planned = match weighed {
            _ if in_place => Ok(previous.clone()),
            Some(p) => Ok(p),
            None => plan_model(&loads, shape, &self.spec.policy, Some(&previous)),
        };
        let new = match planned {
            Ok(p) => p.with_epoch(epoch),
            Err(e) => return self.stop(format!("cannot plan the survivors: {e}"), out),
        };
        if survives {
            let live: Vec<NodeState> = nodes
                .iter()
                .map(|(&node, ws)| {
                    let mut experts = vec![Vec::new(); self.spec.layers];
                    for w in ws {
                        for (l, held) in reports[w].holds.iter().enumerate() {
                            experts[l].extend(held.iter().copied());
                        }
                    }
                    for l in &mut experts {
                        l.sort_unstable();
                        l.dedup();
                    }
                    NodeState { node, experts }
                })
                .collect();
            if let Ok(rp) = plan_reconfiguration(&live, new.layers(), &vec![self.spec.expert_bytes; self.spec.layers]) {
                // Rank q·G + i of the new plan is the i-th worker of the node that takes plan node q;
                // the leaving workers come after, with nothing of the plan.
                let ranks: Vec<NodeId> = rp.plan_to_node.iter().flat_map(|n| nodes[n].iter().copied()).chain(leavers.clone()).collect();
                let rank_node: Vec<u64> = ranks.iter().map(|&w| self.node(w)).collect();
                let rank_holds: Vec<Vec<Vec<usize>>> = ranks.iter().map(|w| reports[w].holds.clone()).collect();
                let map = with_empty_ranks(&new.replica_map(), leavers.len());
                // Experts only the leavers hold are sent by them (rank_transfers takes any holder).
                let lost_for_good = rp.lost.iter().any(|&(l, e)| !leavers.iter().any(|w| reports[w].holds[l].contains(&e)));
                let moved = rank_transfers(&rank_node, &rank_holds, &map, &rp.transfers).map(|ts| {
                    ts.into_iter().map(|t| ExpertTransfer { layer: t.layer, expert: t.expert, from: t.from, to: t.to }).collect::<Vec<_>>()
                });
                if let (false, Some(transfers)) = (lost_for_good, moved) {
                    let joining = (0..ranks.len()).filter(|&r| self.standby.contains_key(&ranks[r])).collect();
                    let leaving: Vec<usize> = (ranks.len() - leavers.len()..ranks.len()).collect();
                    let hold = !leaving.is_empty();
                    let rollback_avoided = if restored.is_empty() { 0 } else { furthest - self.checkpoint.unwrap_or(0) };
                    let m = Move {
                        epoch,
                        ranks,
                        plan: map,
                        commit_to: furthest,
                        transfers,
                        joining,
                        leaving,
                        hold,
                        cause,
                        restored: restored.clone(),
                        rollback_avoided,
                    };
                    self.note(format!(
                        "epoch {epoch}: {} to {} nodes at step {furthest}, {} expert transfers",
                        cause.name(),
                        nodes.len(),
                        m.transfers.len()
                    ));
                    for x in &restored {
                        self.note(format!(
                            "epoch {epoch}: layer {} expert {} lost every replica: restored from its snapshot of step {} in worker {}'s memory ({} steps stale, {} tokens lost; a rollback would have re-run {rollback_avoided} steps)",
                            x.layer, x.expert, x.from_step, x.holder, x.stale_steps, x.tokens_lost
                        ));
                    }
                    self.adopt(new, m.ranks.clone());
                    out.push(Command::Reconfigure(m));
                    return;
                }
            }
        }
        let to_step = self.checkpoint;
        // The steps after it are undone (the log is cut back to it as well).
        self.last_step = to_step.unwrap_or(0);
        let ranks: Vec<NodeId> = nodes.values().flatten().copied().collect();
        let m = Move {
            epoch,
            ranks: ranks.clone(),
            plan: new.replica_map(),
            commit_to: furthest,
            transfers: Vec::new(),
            joining: Vec::new(),
            leaving: Vec::new(),
            hold: false,
            cause: MoveCause::Failure,
            restored: Vec::new(),
            rollback_avoided: 0,
        };
        self.note(format!(
            "epoch {epoch}: an expert lost every replica; roll back to {}",
            to_step.map_or("the start".into(), |s| format!("step {s}"))
        ));
        self.adopt(new, ranks);
        out.push(Command::Rollback { to: m, to_step });
    }

    /// Loads to plan from: those measured since the plan was made, or even loads before any.
    fn plan_loads(&self) -> Vec<Vec<f64>> {
        if self.loads.iter().flatten().any(|&x| x > 0.0) {
            self.loads.clone()
        } else {
            vec![vec![1.0; self.spec.experts]; self.spec.layers]
        }
    }

    /// The new plan is the epoch's: a rendezvous of its ranks follows.
    fn adopt(&mut self, plan: ModelPlan, ranks: Vec<NodeId>) {
        self.epoch = plan.epoch();
        for n in &ranks {
            if self.standby.remove(n).is_some() {
                self.alive.insert(*n);
            }
        }
        for n in &ranks {
            self.node_epoch.insert(*n, self.epoch);
        }
        self.plan = plan;
        self.ranks = ranks;
        self.loads = vec![vec![0.0; self.spec.experts]; self.spec.layers];
        self.steps_since_plan = 0;
        self.step_seconds = 0.0;
        self.phase = Phase::Rendezvous { addrs: BTreeMap::new(), ready: BTreeSet::new() };
    }

    fn stop(&mut self, reason: String, out: &mut Vec<Command>) {
        self.note(format!("stopped: {reason}"));
        self.phase = Phase::Stopped;
        out.push(Command::Stop { reason });
    }
}

/// `map` with `extra` ranks after its own that hold nothing (the leaving ranks of a drain).
fn with_empty_ranks(map: &lazarus_plan::ReplicaMap, extra: usize) -> lazarus_plan::ReplicaMap {
    if extra == 0 {
        return map.clone();
    }
    let layers: Vec<Vec<Vec<u32>>> = map
        .layers()
        .iter()
        .map(|l| l.iter().map(|row| row.iter().copied().chain(std::iter::repeat_n(0, extra)).collect()).collect())
        .collect();
    lazarus_plan::ReplicaMap::new(map.epoch(), layers).expect("the same experts and replicas, more ranks")
}
