//! The controller's decisions as a pure function: [`Controller::decide`]`(now, event) ->
//! Vec<Command<S>>`, tested without sockets or clocks (the way torchft's lighthouse computes a
//! quorum). The shell around it (the controller process's loop, with workers it started or
//! node agents over gRPC) carries events in and commands out. The state chart and the
//! invariants the tests hold it to are in `README.md` beside this file.
//!
//! What it keeps (paper §3, §4.3; docs/architecture.md, what a failure does), one room each:
//! * `membership`: the nodes of the job, when each was last heard from, each one's plan
//!   epoch, who waits to join and who leaves on notice; a node whose worker exits, or that
//!   misses its lease, is lost (and a hung one is killed), with the other workers of its node;
//! * `rendezvous`: every plan is an epoch whose ranks listen, connect and say they are ready
//!   before training runs; a report from an older epoch than the node's is stale and ignored;
//! * `rebalance`: the load monitor (the expert loads of every finished step since the plan
//!   was made) and whether a plan from them repays its move;
//! * `recovery`: after a loss or a pause, every survivor says where it stopped; once all
//!   have, the step everyone commits to, the experts restored from snapshots, the survivors'
//!   plan from the one scheduler (`plan_model`) with the transfers of `plan_reconfiguration` —
//!   or, if an expert lost every replica and snapshot, a rollback to the last checkpoint; if
//!   the survivors cannot hold one replica of every expert, the job stops with the reason;
//! * `lifecycle`: the job's start deadline, a stop request (every rank finishes after the same
//!   step), completion (every rank done), and a job without recovery (static expert
//!   parallelism, `--recovery off`, benchmarks), which the first loss ends.

/// `Display` for an enum with an `as_str(self)`: the name it has in records and messages.
macro_rules! displayed_as_str {
    ($t:ty) => {
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

mod joining;
mod lifecycle;
mod membership;
mod messages;
mod rebalance;
mod recovery;
use recovery::StopCause;
mod rendezvous;
mod resume;
#[cfg(test)]
mod tests;
pub mod words;

pub use joining::{join_deferral, JoinCase, JoinRule, REPAID_JOIN_AT_MOST};
pub use membership::MemberState;
pub use messages::{
    Command, Event, MoveCause, MoveCost, MoveDecision, RankTransfer, RestoredExpert, SnapshotHeld, StepRecord, StopReason, StopReport,
};
pub use rebalance::{LayerCase, RebalanceCase, RebalanceDecision, RebalanceVerdict, Weighed, Weighing};
pub use resume::{BadJobState, JobState};

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use lazarus_plan::{ModelPlan, PlanPolicy};

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
    /// Whether joiners are due after `join_wait` or wait longer for a move to ride along.
    pub join_rule: JoinRule,
    /// Every this many steps the controller weighs a new plan from the loads measured since the
    /// last one and applies it at a step boundary if it repays its move (0: never).
    pub rebalance_every: u64,
    /// The step the job ends at: a rebalance must repay its move before then.
    pub total_steps: u64,
    /// What a loss does to the job.
    pub on_loss: OnLoss,
    /// Every rank of the job must be ready this long after it began, or it stops.
    pub start_within: Duration,
}

/// What a loss does to the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnLoss {
    /// The survivors move to a new plan (or roll back) and training goes on (paper §3).
    Recover,
    /// The first loss ends the job: the others get `grace` to say how they stopped (their
    /// collective deadline, so a survivor reports its own error rather than being killed),
    /// then it stops. Static expert parallelism, `--recovery off` and benchmarks run so; so
    /// does a job without a placement to re-plan.
    Stop { grace: Duration },
}

#[derive(Debug, Clone, PartialEq)]
enum Phase<S> {
    /// Waiting for every rank of the epoch to listen, then to be ready.
    Rendezvous {
        addrs: BTreeMap<NodeId, String>,
        ready: BTreeSet<NodeId>,
    },
    Running,
    /// After a loss: waiting for every survivor to say where it stopped.
    Collecting {
        reports: BTreeMap<NodeId, StopReport<S>>,
    },
    /// A job without recovery lost a rank: the others have until `until` to end on their own.
    Ending {
        until: Instant,
        first: StopReason,
    },
    Stopped,
    /// Every rank finished its work.
    Completed,
}

/// The controller of one job.
#[derive(Debug, Clone)]
pub struct Controller<S> {
    spec: JobSpec,
    epoch: u64,
    /// The epoch the job started at (its plans' epochs are unique across runs; what a user is
    /// shown counts from here: epoch 0, 1, …).
    first_epoch: u64,
    /// The placement the ranks run (None: a job without one, static expert parallelism or a
    /// benchmark; it cannot be re-planned, so its first loss ends it).
    plan: Option<ModelPlan>,
    /// The node of each rank of the current plan.
    ranks: Vec<NodeId>,
    /// The rank of each node of `ranks` (set with it, [`Controller::set_ranks`]): an event of a
    /// thousand workers' rendezvous asks it of each (a scan of `ranks` made each quadratic).
    rank_of: HashMap<NodeId, usize>,
    /// The epoch each node was last told to be in.
    node_epoch: BTreeMap<NodeId, u64>,
    phase: Phase<S>,
    checkpoint: Option<u64>,
    last_step: u64,
    recent: VecDeque<String>,
    /// Why the job is collecting where its ranks stopped: `Some` for a move it asked for
    /// (a pause), `None` for a failure.
    planned: Option<MoveCause>,
    /// Moves to a new plan made (a drain's two halves count once).
    reconfigurations: u64,
    /// Of them, those made for another reason than taking joiners in: how often a joiner may
    /// expect a move to ride along (`joining`).
    moves_for_others: u64,
    /// Who is in the job and whether each is alive: leases, joiners, notices (`membership`).
    members: membership::Members,
    /// The load monitor and the rebalance it weighs (`rebalance`).
    monitor: rebalance::LoadMonitor,
    /// The start deadline, a stop asked for, who is done (`lifecycle`).
    life: lifecycle::Life,
    /// A job taken back by a new controller (`resume`).
    takeover: resume::Takeover,
}

impl<S: StepRecord> Controller<S> {
    /// A job starting at `plan`'s epoch on `nodes` (rank i = nodes[i]) under `plan`.
    pub fn new(spec: JobSpec, plan: ModelPlan, nodes: Vec<NodeId>, now: Instant) -> Self {
        let epoch = plan.epoch();
        Self::with_plan(spec, Some(plan), epoch, nodes, now)
    }

    /// The job starts from the checkpoint of `step` (a resumed run): until it writes one of its
    /// own, that is the last checkpoint — what a rollback goes back to and the status shows.
    pub fn with_checkpoint(mut self, step: Option<u64>) -> Self {
        self.checkpoint = step;
        self
    }

    /// A job without a placement (static expert parallelism, a benchmark) starting at `epoch`:
    /// nothing to re-plan, so its first loss ends it whatever `spec.on_loss` says.
    pub fn unplanned(spec: JobSpec, epoch: u64, nodes: Vec<NodeId>, now: Instant) -> Self {
        Self::with_plan(spec, None, epoch, nodes, now)
    }

    fn with_plan(spec: JobSpec, plan: Option<ModelPlan>, epoch: u64, nodes: Vec<NodeId>, now: Instant) -> Self {
        Controller {
            monitor: rebalance::LoadMonitor::new(spec.layers, spec.experts),
            members: membership::Members::new(&nodes, spec.gpus_per_node, now),
            life: lifecycle::Life::new(now),
            takeover: resume::Takeover::default(),
            spec,
            epoch,
            first_epoch: epoch,
            rank_of: rank_index(&nodes),
            ranks: nodes.clone(),
            node_epoch: nodes.iter().map(|&n| (n, epoch)).collect(),
            plan,
            phase: Phase::Rendezvous { addrs: BTreeMap::new(), ready: BTreeSet::new() },
            checkpoint: None,
            last_step: 0,
            recent: VecDeque::new(),
            planned: None,
            reconfigurations: 0,
            moves_for_others: 0,
        }
    }

    /// Take one event; returns what to do, in order. The rules, each in its room, in the order
    /// they apply: what the event says; leases (whatever the event: heartbeats from the healthy
    /// must not hide the one that fell silent); a node lost whole; the survivors told of the
    /// loss; then, on a running job, the moves it asks for itself — a drain first (it cannot
    /// wait), a rebalance, the joiners — then, once every survivor said where it stopped, the
    /// recovery (or, without recovery, the end once the others have ended); and last the
    /// lifecycle: the start deadline, a finish asked for, completion.
    pub fn decide(&mut self, now: Instant, event: Event<S>) -> Vec<Command<S>> {
        let mut out = Vec::new();
        if self.is_over() {
            return out;
        }
        self.extend_leases_after_a_stall(now);
        let was_rendezvous = matches!(self.phase, Phase::Rendezvous { .. });
        self.members.lost_now.clear();
        self.take(now, event, &mut out);
        self.expire_leases(now, &mut out);
        self.lose_whole_nodes(&mut out);
        self.tell_survivors_of_the_loss(was_rendezvous, &mut out);
        self.pause_for_a_drain(&mut out);
        self.act_on_a_weighing(&mut out);
        self.ask_for_a_weighing(&mut out);
        self.pause_for_joiners(now, &mut out);
        self.choose_move(&mut out);
        self.end_after_a_loss(now, &mut out);
        self.stop_if_not_started(now, &mut out);
        self.ask_to_finish(&mut out);
        self.complete_when_every_rank_is_done(&mut out);
        out
    }

    /// `decide`, with any weighing it asks for done at once and its verdict taken at the same
    /// instant: for callers without a loop to weigh beside (the simulator, whose time is not
    /// the clock's; tests). The commands come without the `Weigh`.
    pub fn decide_inline(&mut self, now: Instant, event: Event<S>) -> Vec<Command<S>> {
        let mut out = self.decide(now, event);
        while let Some(i) = out.iter().position(|c| matches!(c, Command::Weigh(_))) {
            let Command::Weigh(request) = out.remove(i) else { unreachable!("found above") };
            out.extend(self.decide(now, Event::Weighed(request.weigh())));
        }
        out
    }

    /// What the event itself says.
    fn take(&mut self, now: Instant, event: Event<S>, out: &mut Vec<Command<S>>) {
        self.note_heard(&event);
        self.heard_again(now, &event);
        match event {
            Event::Heartbeat { node } => self.heartbeat(now, node),
            Event::Tick => {}
            Event::Weighed(w) => {
                self.monitor.weighing = None;
                self.monitor.weighed = Some(w);
            }
            Event::Exited { node, status } => self.exited(node, &status, out),
            Event::Drain { workers, reason } => self.drain(&workers, &reason),
            Event::Joined { workers } => self.joined(now, workers),
            Event::Listening { node, epoch, addr } => self.listening(now, node, epoch, addr, out),
            Event::Ready { node, epoch } => self.ready(now, node, epoch, out),
            Event::StepFailed { node, epoch, report } => self.worker_stopped(now, node, epoch, report, StopCause::Failed),
            Event::Paused { node, epoch, report } => self.worker_stopped(now, node, epoch, report, StopCause::Paused),
            Event::StepDone { epoch, step, steps, loads, seconds, moved } => self.step_done(epoch, step, steps, &loads, seconds, moved),
            Event::Checkpointed { step } => self.checkpoint = Some(step),
            Event::Done { node } => self.done(node),
            Event::StopRequested { why } => self.stop_requested(&why),
        }
    }

    /// Ask every rank to stop after the step in flight and say where it stopped: a move for
    /// `cause` follows once all have (a loss on the way makes it a failure's).
    fn pause(&mut self, cause: MoveCause, out: &mut Vec<Command<S>>) {
        self.phase = Phase::Collecting { reports: BTreeMap::new() };
        self.planned = Some(cause);
        out.push(Command::Pause { epoch: self.epoch, nodes: self.ranks.clone() });
    }

    /// `epoch` as the job counts it: 0 at its start, 1 after the first move, …
    pub fn job_epoch(&self, epoch: u64) -> u64 {
        epoch.saturating_sub(self.first_epoch)
    }

    fn note(&mut self, what: String) {
        if self.recent.len() == RECENT_EVENTS {
            self.recent.pop_front();
        }
        self.recent.push_back(what);
    }

    fn stop(&mut self, reason: StopReason, out: &mut Vec<Command<S>>) {
        self.note(format!("stopped: {reason}"));
        self.phase = Phase::Stopped;
        out.push(Command::Stop { reason });
    }
}

/// What a status report shows of the job (queries only).
impl<S: StepRecord> Controller<S> {
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The placement the ranks run (None: a job without one).
    pub fn plan(&self) -> Option<&ModelPlan> {
        self.plan.as_ref()
    }

    /// Whether a loss is recovered from (live recovery, and a placement to re-plan).
    pub fn recovers(&self) -> bool {
        self.spec.on_loss == OnLoss::Recover && self.plan.is_some()
    }

    /// The node of each rank of the current epoch.
    pub fn ranks(&self) -> &[NodeId] {
        &self.ranks
    }

    pub fn alive(&self) -> &BTreeSet<NodeId> {
        &self.members.alive
    }

    /// Whether the job has stopped (it did not complete).
    pub fn stopped(&self) -> bool {
        self.phase == Phase::Stopped
    }

    /// Whether every rank finished its work.
    pub fn completed(&self) -> bool {
        self.phase == Phase::Completed
    }

    /// Whether the job is over, stopped or completed: no event does anything any more.
    pub fn is_over(&self) -> bool {
        matches!(self.phase, Phase::Stopped | Phase::Completed)
    }

    /// The rank of `node` in the current plan (None: not a rank of it).
    pub(crate) fn rank(&self, node: NodeId) -> Option<usize> {
        self.rank_of.get(&node).copied()
    }

    /// The ranks of a new plan, rank i on `ranks[i]`.
    fn set_ranks(&mut self, ranks: Vec<NodeId>) {
        self.rank_of = rank_index(&ranks);
        self.ranks = ranks;
    }

    /// Whether every rank of the epoch trains.
    pub fn running(&self) -> bool {
        self.phase == Phase::Running
    }

    /// The experts the current plan places on worker `node`, per layer, in order (None: not a
    /// rank of it). Read from the placements (rank q·G + i is GPU i of plan node q), not from
    /// the replica map: at 1,024 GPUs and 58 × 256 experts that map is 60 MB.
    pub fn planned_holdings(&self, node: NodeId) -> Option<Vec<Vec<usize>>> {
        let i = self.rank(node)?;
        let plan = self.plan.as_ref()?;
        let shape = plan.shape();
        let (q, gpu) = (i / shape.gpus_per_node, i % shape.gpus_per_node);
        // A leaving rank (beyond the plan's) is given nothing.
        Some(
            plan.layers()
                .iter()
                .map(|p| {
                    let mut experts = if q < shape.nodes { p.gpu(q, gpu).to_vec() } else { Vec::new() };
                    experts.sort_unstable();
                    experts.dedup();
                    experts
                })
                .collect(),
        )
    }

    /// The node worker `worker` belongs to (`u64::MAX`: a worker never heard of).
    pub fn node(&self, worker: NodeId) -> u64 {
        self.members.node_of.get(&worker).copied().unwrap_or(u64::MAX)
    }

    /// The most recent events, oldest first.
    pub fn recent(&self) -> impl Iterator<Item = &String> {
        self.recent.iter()
    }

    /// The phase of the job: `rendezvous`, `running`, `collecting` (a loss is being recovered
    /// from), `ending` (a job without recovery lost a rank), `stopped` or `completed`.
    pub fn phase_name(&self) -> &'static str {
        match self.phase {
            Phase::Rendezvous { .. } => "rendezvous",
            Phase::Running => "running",
            Phase::Collecting { .. } => "collecting",
            Phase::Ending { .. } => "ending",
            Phase::Stopped => "stopped",
            Phase::Completed => "completed",
        }
    }

    /// Every node the job has had, alive or lost.
    pub fn nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.members.last_seen.keys().copied()
    }

    /// The epoch `node` was last told to be in.
    pub fn node_epoch(&self, node: NodeId) -> Option<u64> {
        self.node_epoch.get(&node).copied()
    }

    /// Moves to a new plan made so far (reconfigurations, rollbacks, joins, rebalances, drains;
    /// a drain's hand-over and its leaving count once, though each starts an epoch).
    pub fn reconfigurations(&self) -> u64 {
        self.reconfigurations
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
        self.members.last_seen.get(&node).copied()
    }

    /// When the next lease runs out, if no heartbeat comes first (a worker that finished its
    /// work holds no lease: it exits).
    pub fn deadline(&self) -> Option<Instant> {
        if self.is_over() {
            return None;
        }
        self.members
            .alive
            .iter()
            .filter(|n| !self.life.done.contains(n))
            .chain(self.members.standby.keys())
            .filter_map(|&n| self.members.last_seen.get(&n).map(|&t| t + self.lease_of(n)))
            .min()
    }

    /// When the shell must call [`Controller::decide`] next (with a `Tick` if nothing else
    /// came): the next lease's end, the joiners' due time, the start deadline, the end of a
    /// grace after a loss — and at least every quarter lease, so that a longer gap between two
    /// decisions means the controller itself was stalled (see `decide`).
    pub fn next_wake(&self, now: Instant) -> Instant {
        let cadence = now + self.spec.lease / 4;
        let join = self.join_due().filter(|_| self.running());
        // The earliest lease as of the last look at them (heartbeats since only push leases
        // later): not every member's again on every event — at 8,192 workers that was most of
        // the controller's time.
        let leases = self.members.leases_checked_until.or_else(|| self.deadline());
        [join, leases, self.lifecycle_deadline()].into_iter().flatten().fold(cadence, Instant::min)
    }
}

/// The rank of each node, `ranks[i]` at i (a node listed twice: its first).
fn rank_index(ranks: &[NodeId]) -> HashMap<NodeId, usize> {
    ranks.iter().enumerate().rev().map(|(i, &n)| (n, i)).collect()
}
