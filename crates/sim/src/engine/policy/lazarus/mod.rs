//! Lazarus (§6.1), run by the controller's own decisions: the simulated job is driven by
//! `lazarus_decide::Controller`, the same pure function `lazarus train --workers` and
//! `lazarus controller` call. Recovery onto the survivors while every expert keeps a replica
//! (a restart from the checkpoint otherwise), joiners taken in at a step boundary, and every
//! `rebalance_every` steps a plan from the measured loads, applied only where it repays its
//! move: the decisions, the plans and the transfers are the controller's.
//!
//! This policy is the controller's shell in simulated time: it turns the trace's changes into
//! the controller's events at simulated instants, answers for the workers (where each stopped,
//! what it holds, that it is ready), reports the steps trained with the loads of their epoch,
//! and charges each move to the engine: the failure time-out and group rebuild of the cost
//! model, and the transfers of the busiest node. The survivors report the expert snapshots
//! they keep ([`snapshots`]: the snapshot tier's rounds in their steady state), so an expert
//! that lost every replica comes back from one when a survivor keeps it; a restart otherwise.
//! What it does not model: a rollback in place (the engine's restart relaunches the job on the
//! usable nodes, as it does for every policy).

mod snapshots;

use std::cell::RefCell;
use std::collections::HashMap;

use lazarus_decide::SnapshotHeld;
use std::time::{Duration, Instant};

use lazarus_decide::{Command, Controller, Event, JobSpec, JoinRule, MoveCost, MoveDecision, NodeId, OnLoss, StepRecord, StopReport};
use lazarus_plan::{plan_model, ClusterShape, ModelPlan, Placement, PlanPolicy};

use super::FailurePolicy;
use crate::cost::{CostModel, Dispatch};
use crate::engine::{Busy, Run, Scenario};
use crate::error::SimError;

/// Leases never run out in simulated time: a node is lost when the trace removes it.
const LEASE: Duration = Duration::from_secs(365 * 86_400);
/// Expert loads are fractions of a layer's tokens; the controller counts tokens.
const TOKENS_PER_STEP: f64 = 1e6;

/// The simulator keeps no step reports: the controller is never handed one to log.
#[derive(Debug, Clone, PartialEq)]
pub(in crate::engine) enum NoRecord {}

impl StepRecord for NoRecord {
    fn step(&self) -> u64 {
        match *self {}
    }

    fn is_sound(&self) -> bool {
        match *self {}
    }
}

/// Lazarus's policy; its configuration is the controller's plan over the nodes in use (plan
/// node i = `used[i]`).
pub(in crate::engine) struct Lazarus {
    /// Simulated time 0.
    t0: Instant,
    /// The controller of the job, from the job's start or its last restart.
    shell: RefCell<Option<Shell>>,
}

/// The controller of one launch of the job, and the workers it knows.
struct Shell {
    ctl: Controller<NoRecord>,
    workers: Workers,
    /// Bytes of one expert's training state.
    expert_bytes: u64,
    /// Steps the load monitor has been told of.
    reported_step: u64,
    /// The step the running plan began at (the snapshot tier's rounds start again with a plan).
    plan_step: u64,
    /// What the last move cost, told with the next steps (as a worker's first report after a
    /// move tells it).
    moved: Option<MoveCost>,
}

/// The worker ids of the simulated nodes: G each, never reused.
struct Workers {
    gpus_per_node: usize,
    of_node: HashMap<String, Vec<NodeId>>,
    node_of: HashMap<NodeId, String>,
    next: NodeId,
}

/// What the controller made of a failure, a join or a rebalance.
enum Outcome {
    /// The job moves to the controller's new plan over `nodes`, its busiest node sending or
    /// receiving `worst_bytes` of expert states, `bytes` in all, restoring `restored` experts
    /// from snapshots.
    Moved { nodes: Vec<String>, worst_bytes: f64, bytes: u64, restored: Restored },
    /// An expert lost every replica, or the survivors cannot hold every expert.
    Restart,
    /// Nothing moves (a rebalance that would not repay its move).
    Stay,
}

/// Experts a move restored from snapshots, and their steps behind the job, summed.
#[derive(Debug, Clone, Copy, Default)]
struct Restored {
    experts: u64,
    stale_steps: u64,
}

impl std::ops::Add for Restored {
    type Output = Restored;
    fn add(self, o: Restored) -> Restored {
        Restored { experts: self.experts + o.experts, stale_steps: self.stale_steps + o.stale_steps }
    }
}

impl Lazarus {
    pub(in crate::engine) fn new() -> Self {
        Lazarus { t0: Instant::now(), shell: RefCell::new(None) }
    }

    fn at(&self, t: f64) -> Instant {
        self.t0 + Duration::from_secs_f64(t.max(0.0))
    }

    /// Lazarus's plan for `n` nodes from the loads of `epoch` at the job's start or after a
    /// restart: the scheduler every other part of Lazarus uses.
    fn plan(run: &Run<'_, Self>, n: usize, epoch: u64) -> Result<ModelPlan, SimError> {
        let c = run.cost();
        let shape = ClusterShape::new(n, c.gpus_per_node, c.slots_per_gpu)?;
        Ok(plan_model(&run.loads(epoch), shape, &policy(c), run.config.as_ref())?)
    }

    /// Run `f` on the job's controller (None: the job has none, it is idle).
    fn with_shell<T>(&self, f: impl FnOnce(&mut Shell) -> T) -> Option<T> {
        self.shell.borrow_mut().as_mut().map(f)
    }

    /// The engine's part of `outcome`: a move is charged `fixed` seconds plus its transfers as
    /// `kind`; a restart is the engine's.
    fn carry_out(&self, run: &mut Run<'_, Self>, outcome: Outcome, kind: Busy, fixed: f64) -> Result<(), SimError> {
        match outcome {
            Outcome::Moved { nodes, worst_bytes, bytes, restored } => {
                let transfer_s = run.cost().transfer_s(worst_bytes);
                let step = run.step;
                if restored.experts > 0 {
                    run.tally.snapshot_restores += 1;
                    run.tally.experts_restored += restored.experts;
                    run.tally.restored_stale_steps += restored.stale_steps;
                }
                // What the controller measures of a move: its transfers and its rendezvous
                // (not the failure time-out before it).
                let rebuild_s = if kind == Busy::Rebalance { run.cost().rebalance_s } else { run.cost().group_rebuild_s };
                let plan = self.with_shell(|sh| {
                    sh.moved = Some(MoveCost { bytes, transfer_s, rebuild_s });
                    sh.reported_step = step;
                    sh.plan_step = step;
                    sh.ctl.plan().cloned()
                });
                let now = run.now;
                let plan = plan.flatten().ok_or_else(|| SimError::Controller { at_s: now, what: "moved a job it does not run".into() })?;
                run.switch(nodes, plan, kind, fixed + transfer_s, transfer_s);
                Ok(())
            }
            Outcome::Restart => {
                *self.shell.borrow_mut() = None;
                run.restart()
            }
            Outcome::Stay => Ok(()),
        }
    }

    /// The expert snapshots each worker keeps now ([`snapshots`]), by worker: none without a
    /// snapshot bandwidth.
    fn snapshots_held(&self, run: &mut Run<'_, Self>) -> Result<HashMap<NodeId, Vec<SnapshotHeld>>, SimError> {
        let c = run.cost();
        if c.snapshot_bandwidth <= 0.0 {
            return Ok(HashMap::new());
        }
        let step_s = run.step_time()?;
        let loads = run.loads(run.epoch());
        let budget_experts = c.snapshot_bandwidth * step_s / run.s.model.expert_state_bytes;
        let (g, step) = (c.gpus_per_node, run.step);
        let held = self.with_shell(|sh| {
            let map = sh.ctl.plan()?.replica_map();
            let rounds = snapshots::Rounds {
                map: &map,
                ranks: sh.ctl.ranks(),
                gpus_per_node: g,
                loads: &loads,
                tokens_per_step: TOKENS_PER_STEP,
                budget_experts,
                since_step: sh.plan_step,
                step,
            };
            Some(rounds.held())
        });
        Ok(held.flatten().unwrap_or_default())
    }

    /// The steps trained since the controller last heard, with the loads of the current epoch.
    fn report_steps(&self, run: &mut Run<'_, Self>) -> Result<Vec<Command<NoRecord>>, SimError> {
        let step_s = run.step_time()?;
        let loads = run.loads(run.epoch());
        let (now, step) = (self.at(run.now), run.step);
        Ok(self.with_shell(|sh| sh.report_steps(now, step, step_s, &loads)).unwrap_or_default())
    }
}

/// The planning policy of the simulated job.
fn policy(c: &CostModel) -> PlanPolicy {
    PlanPolicy::unguarded(c.min_replicas)
}

impl Workers {
    /// Ids for the G workers of `node` (the ones it has, if it has some).
    fn of(&mut self, node: &str) -> Vec<NodeId> {
        if let Some(ws) = self.of_node.get(node) {
            return ws.clone();
        }
        let ws: Vec<NodeId> = (self.next..self.next + self.gpus_per_node as u64).collect();
        self.next += self.gpus_per_node as u64;
        for &w in &ws {
            self.node_of.insert(w, node.to_string());
        }
        self.of_node.insert(node.to_string(), ws.clone());
        ws
    }
}

impl Shell {
    /// A controller for the job starting on `nodes` (in plan order) under `plan`, its
    /// rendezvous done.
    fn start(run: &Run<'_, Lazarus>, nodes: &[String], plan: ModelPlan, now: Instant) -> Shell {
        let (c, m) = (run.cost(), &run.s.model);
        let spec = JobSpec {
            layers: m.layers,
            experts: m.experts,
            slots_per_node: c.gpus_per_node * c.slots_per_gpu,
            gpus_per_node: c.gpus_per_node,
            policy: policy(c),
            expert_bytes: m.expert_state_bytes as u64,
            lease: LEASE,
            // The engine times the joins (its scale-up wait, and the rent-or-buy wait the
            // controller works out: `join_deferral_s`): they are due when told.
            join_wait: Duration::ZERO,
            join_rule: JoinRule::AfterWait,
            rebalance_every: c.rebalance_every,
            total_steps: (run.s.duration_s / m.balanced_step_s).ceil() as u64,
            on_loss: OnLoss::Recover,
            // The simulated rendezvous is done at once.
            start_within: Duration::MAX,
        };
        let mut workers = Workers { gpus_per_node: c.gpus_per_node, of_node: HashMap::new(), node_of: HashMap::new(), next: 0 };
        let ranks: Vec<NodeId> = nodes.iter().flat_map(|n| workers.of(n)).collect();
        let expert_bytes = spec.expert_bytes;
        // Before any move, the controller weighs a rebalance with the cost model's figures for
        // one (as if it had measured one expert's transfer and a rebalance's pause).
        let moved =
            Some(MoveCost { bytes: expert_bytes.max(1), transfer_s: c.transfer_s(expert_bytes.max(1) as f64), rebuild_s: c.rebalance_s });
        let mut sh = Shell {
            ctl: Controller::new(spec, plan, ranks, now),
            workers,
            expert_bytes,
            reported_step: run.step,
            plan_step: run.step,
            moved,
        };
        sh.rendezvous(now);
        sh
    }

    /// Every rank of the epoch listens, then is ready: training runs. What the controller
    /// decided on the way (a pause it had waiting, for a drain or joiners).
    fn rendezvous(&mut self, now: Instant) -> Vec<Command<NoRecord>> {
        let (epoch, ranks) = (self.ctl.epoch(), self.ctl.ranks().to_vec());
        let mut out = Vec::new();
        for (i, &node) in ranks.iter().enumerate() {
            out.extend(self.ctl.decide_inline(now, Event::Listening { node, epoch, addr: format!("rank {i}") }));
        }
        for &node in &ranks {
            out.extend(self.ctl.decide_inline(now, Event::Ready { node, epoch }));
        }
        out
    }

    /// The steps trained since the controller last heard of any (at the job's step `step`).
    fn report_steps(&mut self, now: Instant, step: u64, step_s: f64, loads: &[Vec<f64>]) -> Vec<Command<NoRecord>> {
        let steps = step.saturating_sub(self.reported_step);
        if steps == 0 || !self.ctl.running() {
            return Vec::new();
        }
        self.reported_step = step;
        let scale = TOKENS_PER_STEP * steps as f64;
        let loads = loads.iter().map(|l| l.iter().map(|&x| (x * scale).round() as u64).collect()).collect();
        let event =
            Event::StepDone { epoch: self.ctl.epoch(), step, steps, loads, seconds: step_s * steps as f64, moved: self.moved.take() };
        self.ctl.decide_inline(now, event)
    }

    /// A node's workers start and stand by.
    fn join(&mut self, now: Instant, node: &str) -> Vec<Command<NoRecord>> {
        let workers = self.workers.of(node);
        self.ctl.decide_inline(now, Event::Joined { workers })
    }

    /// `node` gave notice: its workers are drained (the controller pauses the job at this step's
    /// end and moves it off them).
    fn drain(&mut self, now: Instant, node: &str) -> Vec<Command<NoRecord>> {
        let workers = self.workers.of(node);
        self.ctl.decide_inline(now, Event::Drain { workers, reason: "a notice in the trace".into() })
    }

    /// The trace removed `node`: its workers exit (if it comes back, it brings new ones).
    fn remove(&mut self, now: Instant, node: &str) -> Vec<Command<NoRecord>> {
        let workers = self.workers.of_node.remove(node).unwrap_or_default();
        workers
            .into_iter()
            .flat_map(|w| self.ctl.decide_inline(now, Event::Exited { node: w, status: "removed by the trace".into() }))
            .collect()
    }

    /// Every surviving rank says where it stopped (all at `step`, the job's committed step), what
    /// its plan gave it and the snapshots it keeps (`held`); the last report brings the
    /// controller's decision.
    fn say_where_stopped(&mut self, now: Instant, step: u64, held: &mut HashMap<NodeId, Vec<SnapshotHeld>>) -> Vec<Command<NoRecord>> {
        let epoch = self.ctl.epoch();
        let ranks: Vec<NodeId> = self.ctl.ranks().iter().copied().filter(|w| self.ctl.alive().contains(w)).collect();
        // What each rank holds, ranks on every core (at a thousand GPUs, 58 thousand lists).
        let ctl = &self.ctl;
        let Ok(holds) = lazarus_plan::parallel::map_in_order(&ranks, |&n| {
            Ok::<_, std::convert::Infallible>(ctl.planned_holdings(n).unwrap_or_default())
        });
        let mut out = Vec::new();
        for (node, holds) in ranks.into_iter().zip(holds) {
            let snapshots = held.remove(&node).unwrap_or_default();
            let report = StopReport { steps_done: step, held: None, holds, last: None, snapshots };
            out.extend(self.ctl.decide_inline(now, Event::StepFailed { node, epoch, report }));
        }
        out
    }

    /// What the commands of one decision come to. A move's rendezvous is done at once; a move
    /// that holds (a drain's hand-over) or a pause the controller had waiting is followed by the
    /// move after it, and the transfers add up.
    fn outcome(&mut self, now: Instant, out: &[Command<NoRecord>]) -> Outcome {
        self.outcome_within(now, out, 4)
    }

    /// [`Shell::outcome`], following at most `depth` moves after the first.
    fn outcome_within(&mut self, now: Instant, out: &[Command<NoRecord>], depth: usize) -> Outcome {
        let decided = out.iter().rev().find_map(|c| match c {
            Command::Reconfigure(m) => Some(Some(m)),
            Command::Rollback { .. } | Command::Stop { .. } => Some(None),
            _ => None,
        });
        match decided {
            None => Outcome::Stay,
            Some(None) => Outcome::Restart,
            Some(Some(m)) => {
                let (worst_bytes, bytes) = self.transfer_bytes(m);
                let restored = Restored { experts: m.restored.len() as u64, stale_steps: m.restored.iter().map(|x| x.stale_steps).sum() };
                let g = self.workers.gpus_per_node;
                let nodes = m.ranks.chunks(g).map(|ws| self.workers.node_of[&ws[0]].clone()).collect();
                let (hold, leavers): (bool, Vec<NodeId>) = (m.change.hold, m.change.leaving.iter().map(|&r| m.ranks[r]).collect());
                let waiting = self.rendezvous(now);
                let paused = waiting.iter().any(|c| matches!(c, Command::Pause { .. }));
                if (!hold && !paused) || depth == 0 {
                    return Outcome::Moved { nodes, worst_bytes, bytes, restored };
                }
                // A drain's hand-over: the leaving nodes sent what only they held and exit. Then
                // (or on the pause the controller had waiting) every rank says where it stopped
                // and the controller moves the job again.
                let mut again = Vec::new();
                for node in leavers.into_iter().filter(|_| hold) {
                    again.extend(self.ctl.decide_inline(now, Event::Exited { node, status: "drained".into() }));
                }
                again.extend(self.say_where_stopped(now, self.reported_step, &mut HashMap::new()));
                match self.outcome_within(now, &again, depth - 1) {
                    Outcome::Moved { nodes, worst_bytes: w, bytes: b, restored: r } => {
                        Outcome::Moved { nodes, worst_bytes: worst_bytes + w, bytes: bytes + b, restored: restored + r }
                    }
                    other => other,
                }
            }
        }
    }

    /// The bytes of a move's transfers between nodes (copies inside a node cost none): the
    /// busiest node's sent or received, and all of them.
    fn transfer_bytes(&self, m: &MoveDecision) -> (f64, u64) {
        let bytes = self.expert_bytes;
        // Each rank's node, as an index: a move at a thousand GPUs has tens of thousands of
        // transfers (a name looked up and compared for each was 2 ms a move).
        let mut index: HashMap<&String, usize> = HashMap::new();
        let node: Vec<usize> = m
            .ranks
            .iter()
            .map(|w| {
                let n = index.len();
                *index.entry(&self.workers.node_of[w]).or_insert(n)
            })
            .collect();
        let (mut sent, mut received) = (vec![0.0f64; index.len()], vec![0.0f64; index.len()]);
        let mut all = 0u64;
        for t in &m.change.transfers {
            let (from, to) = (node[t.from], node[t.to]);
            if from != to {
                sent[from] += bytes as f64;
                received[to] += bytes as f64;
                all += bytes;
            }
        }
        (sent.iter().chain(&received).copied().fold(0.0, f64::max), all)
    }
}

impl FailurePolicy for Lazarus {
    type Config = ModelPlan;

    /// Any number of nodes with at least one replica slot per expert.
    fn nodes_usable(&self, s: &Scenario, n: usize) -> usize {
        if n * s.cost.gpus_per_node * s.cost.slots_per_gpu >= s.model.experts {
            n
        } else {
            0
        }
    }

    /// A plan for the nodes in use, and a controller of them (the job's start or a restart).
    fn fresh_config(&self, run: &Run<'_, Self>, n: usize) -> Result<ModelPlan, SimError> {
        let plan = Self::plan(run, n, run.plan_epoch())?;
        *self.shell.borrow_mut() = Some(Shell::start(run, &run.used, plan.clone(), self.at(run.now)));
        Ok(plan)
    }

    fn checkpoint_every(&self, cost: &CostModel) -> u64 {
        cost.checkpoint_every_lazarus
    }

    fn rebalance_every(&self, cost: &CostModel) -> Option<u64> {
        Some(cost.rebalance_every)
    }

    /// The controller weighs a plan from the loads measured since the last one; it pauses the
    /// job and moves only if the move repays itself. Under [`JoinRule::WhenRepaid`] the nodes
    /// standing by ride along (and the move rebuilds the groups, as a join's does).
    fn rebalance(&self, run: &mut Run<'_, Self>) -> Result<(), SimError> {
        let mut out = self.report_steps(run)?;
        let paused = out.iter().any(|c| matches!(c, Command::Pause { .. }));
        let ride_along = paused && matches!(run.cost().join_rule, JoinRule::WhenRepaid { .. });
        let joiners: Vec<String> = if ride_along { run.with_joiners(run.used.clone()).split_off(run.used.len()) } else { Vec::new() };
        let (now, step) = (self.at(run.now), run.step);
        let outcome = self.with_shell(|sh| {
            if paused {
                for n in &joiners {
                    out.extend(sh.join(now, n));
                }
                out.extend(sh.say_where_stopped(now, step, &mut HashMap::new()));
            }
            sh.outcome(now, &out)
        });
        let c = run.cost();
        let fixed = if joiners.is_empty() { c.rebalance_s } else { c.rebalance_s.max(c.group_rebuild_s) };
        self.carry_out(run, outcome.unwrap_or(Outcome::Stay), Busy::Rebalance, fixed)
    }

    /// Under [`JoinRule::WhenRepaid`], the controller's own wait for a move to ride along, for
    /// `joining` nodes' workers (the simulated job's join wait is the engine's scale-up wait).
    fn join_deferral_s(&self, run: &Run<'_, Self>, joining: usize, ready_at: f64) -> f64 {
        let JoinRule::WhenRepaid { at_most } = run.cost().join_rule else { return 0.0 };
        let (workers, now) = (joining * run.cost().gpus_per_node, self.at(ready_at));
        self.with_shell(|sh| sh.ctl.join_deferral(now, workers, at_most).as_secs_f64()).unwrap_or(0.0)
    }

    /// The failed nodes' workers exit, usable joiners stand by, the survivors say where they
    /// stopped: the controller moves the job onto them, or it restarts.
    fn on_failure(&self, run: &mut Run<'_, Self>, failed: &[String], survivors: Vec<String>) -> Result<(), SimError> {
        if run.config.is_none() || survivors.is_empty() || self.shell.borrow().is_none() {
            *self.shell.borrow_mut() = None;
            return run.restart();
        }
        let mut out = self.report_steps(run)?;
        let mut held = self.snapshots_held(run)?;
        let joiners: Vec<String> = run.with_joiners(survivors.clone()).split_off(survivors.len());
        let (now, step) = (self.at(run.now), run.step);
        let outcome = self.with_shell(|sh| {
            for n in &joiners {
                out.extend(sh.join(now, n));
            }
            for n in failed {
                out.extend(sh.remove(now, n));
            }
            out.extend(sh.say_where_stopped(now, step, &mut held));
            sh.outcome(now, &out)
        });
        let c = run.cost();
        let fixed = c.group_rebuild_s + run.detect_s;
        match outcome {
            Some(Outcome::Stay) | None => {
                *self.shell.borrow_mut() = None;
                run.restart()
            }
            Some(o) => self.carry_out(run, o, Busy::Reconfig, fixed),
        }
    }

    /// The leaving nodes' workers are drained: the controller pauses the job at this step's end
    /// and moves it off them (onto the rest and any joiners), with no time-out and no step lost.
    fn on_notice(&self, run: &mut Run<'_, Self>, leaving: &[String], staying: Vec<String>) -> Result<(), SimError> {
        if self.shell.borrow().is_none() {
            return run.restart();
        }
        let mut out = self.report_steps(run)?;
        let joiners: Vec<String> = run.with_joiners(staying.clone()).split_off(staying.len());
        let (now, step) = (self.at(run.now), run.step);
        let outcome = self.with_shell(|sh| {
            // The drain first: it pauses at once, and the joiners ride along in its move.
            for n in leaving {
                out.extend(sh.drain(now, n));
            }
            for n in &joiners {
                out.extend(sh.join(now, n));
            }
            if out.iter().any(|c| matches!(c, Command::Pause { .. })) {
                out.extend(sh.say_where_stopped(now, step, &mut HashMap::new()));
            }
            let outcome = sh.outcome(now, &out);
            // The workers of a node the job moved off are gone: if it comes back, it brings new
            // ones. (One still in the job keeps its own, for its exit to be told.)
            if let Outcome::Moved { nodes, .. } = &outcome {
                for n in leaving.iter().filter(|n| !nodes.contains(n)) {
                    sh.workers.of_node.remove(n);
                }
            }
            outcome
        });
        let fixed = run.cost().group_rebuild_s;
        match outcome {
            Some(Outcome::Stay) | None => {
                *self.shell.borrow_mut() = None;
                run.restart()
            }
            Some(o) => self.carry_out(run, o, Busy::Reconfig, fixed),
        }
    }

    /// The joiners stand by; the controller pauses the job at this step boundary and moves it
    /// onto them.
    fn scale_up(&self, run: &mut Run<'_, Self>, nodes: Vec<String>) -> Result<(), SimError> {
        let mut out = self.report_steps(run)?;
        let joiners: Vec<String> = nodes.into_iter().filter(|n| !run.used.contains(n)).collect();
        let (now, step) = (self.at(run.now), run.step);
        let outcome = self.with_shell(|sh| {
            for n in &joiners {
                out.extend(sh.join(now, n));
            }
            if out.iter().any(|c| matches!(c, Command::Pause { .. })) {
                out.extend(sh.say_where_stopped(now, step, &mut HashMap::new()));
            }
            sh.outcome(now, &out)
        });
        let fixed = run.cost().group_rebuild_s;
        match outcome {
            Some(Outcome::Stay) | None => {
                Err(SimError::Controller { at_s: run.now, what: format!("did not take in the waiting nodes {joiners:?}") })
            }
            Some(o) => self.carry_out(run, o, Busy::Reconfig, fixed),
        }
    }

    /// The busiest GPU of each layer over the mean, as the dispatcher spreads tokens
    /// ([`Dispatch`]): at its least, λ* (a max-flow a layer, made once a plan and load epoch),
    /// or by per-replica shares (Algorithm 1: each replica of expert e takes
    /// `load[e] / replicas[e]`).
    fn imbalance(&self, cost: &CostModel, plan: &ModelPlan, loads: &[Vec<f64>]) -> f64 {
        if cost.dispatch == Dispatch::Balanced {
            // Layers on every core (a max-flow each); summed in layer order.
            let jobs: Vec<(&Placement, &Vec<f64>)> = plan.layers().iter().zip(loads).collect();
            let Ok(each) = lazarus_plan::parallel::map_in_order(&jobs, |(p, l)| {
                Ok::<_, std::convert::Infallible>(p.load_balance(l).map_or(1.0, |b| b.imbalance()))
            });
            return each.iter().sum::<f64>() / loads.len().max(1) as f64;
        }
        let g = cost.gpus_per_node;
        let mut imbalance = 0.0;
        for (p, l) in plan.layers().iter().zip(loads) {
            let r = p.replica_counts();
            let mut worst = 0.0f64;
            for node in 0..p.shape().nodes {
                for gpu in 0..g {
                    let load: f64 = p.gpu(node, gpu).iter().map(|&e| l[e] / r[e] as f64).sum();
                    worst = worst.max(load);
                }
            }
            imbalance += worst * p.shape().ranks() as f64;
        }
        imbalance / loads.len().max(1) as f64
    }
}
