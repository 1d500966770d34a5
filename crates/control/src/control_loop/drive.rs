//! The controller's loop, for every job (with live recovery or without, training or a
//! benchmark): worker reports in through a [`Fleet`], [`Controller::decide`] on each, its
//! commands out — the start deadline, a stop asked for and completion included. The shell keeps
//! only what to show the user and the record of each reconfiguration.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lazarus_plan::{PlanUpdate, ReplicaMap};

use super::{ReconfigurationRecord, TrainEvent, TrainOutcome};
use crate::controller::{Command, Controller, Event, MoveCause, MoveCost, StopReport, Weighed};
use crate::error::ControlError;
use crate::fleet::{Fleet, FleetEvent};
use crate::protocol::{LauncherMessage, MoveOrder, MoveStats, WorkerEvent};
use crate::service::{snapshot, SharedStatus};

/// While a rebalance is weighed beside the loop, the loop looks for its verdict this often.
const WEIGHED_POLL: Duration = Duration::from_millis(20);

/// The status served to `lazarus status` is refreshed at least this often.
const STATUS_EVERY: Duration = Duration::from_millis(250);

/// How a job driven to its end ended: the outcome, and rank 0's results if its work has some
/// (a benchmark's).
pub(crate) struct Ended {
    pub outcome: TrainOutcome,
    pub results: Option<serde_json::Value>,
}

/// Saves what a new controller needs to take the job back (`true`: the job is over, completed
/// or stopped with its workers: nothing is left to take back).
pub(crate) type SaveState<'a> = &'a mut dyn FnMut(&Controller, bool);

/// The controller's loop: reports from `fleet` in, the controller's decisions out, until the
/// job completes or stops; `shared` (if served) gets the status after each decision. On
/// anything but completion every worker left is killed.
pub(crate) fn drive(
    fleet: &mut dyn Fleet,
    mut ctl: Controller,
    job_id: &str,
    shared: Option<SharedStatus>,
    mut save: Option<SaveState<'_>>,
    mut observe: impl FnMut(TrainEvent) -> Result<(), ControlError>,
) -> Result<Ended, ControlError> {
    // (A job taken back counts its epochs from its first controller's start.)
    let first_epoch = ctl.epoch() - ctl.job_epoch(ctl.epoch());
    // A job taken back: its agents send their last records again, which the log may hold.
    let replayed_until = ctl.resuming().then(|| ctl.last_step());
    // What a new controller would need, saved before any worker hears of a new epoch.
    let mut saved_epoch = None;
    // The plan as `lazarus status` shows it: its epoch counted from the job's start.
    let shown_plan = |ctl: &Controller| ctl.plan().map(|p| p.clone().with_epoch(ctl.job_epoch(ctl.epoch())).to_json()).unwrap_or_default();
    let mut plan_json = (ctl.epoch(), shown_plan(&ctl));
    let mut status_at = None;
    let mut shell = Shell {
        started: false,
        done: BTreeMap::new(),
        recovering: None,
        first_error: None,
        ranks: ctl.ranks().to_vec(),
        last_checkpoint: None,
        ends: BTreeMap::new(),
        first_failure: None,
        results: None,
        stop_told: false,
        // The workers start with the plan of the controller's epoch (those of a job taken back
        // may have any of the last few: they are sent the next whole).
        sent_maps: ctl
            .plan()
            .filter(|_| !ctl.resuming())
            .map(|p| (ctl.epoch(), (p.replica_map(), ctl.ranks().to_vec())))
            .into_iter()
            .collect(),
        sent_at: if ctl.resuming() { BTreeMap::new() } else { ctl.ranks().iter().map(|&w| (w, ctl.epoch())).collect() },
    };
    // A rebalance being weighed on a thread of its own (at a thousand nodes it plans a model:
    // seconds the loop must not be held for), and where its verdict comes back.
    let (weighed_tx, weighed_rx) = std::sync::mpsc::channel::<Weighed>();
    let mut weighing = false;
    let result: Result<TrainOutcome, ControlError> = (|| loop {
        let now = Instant::now();
        let mut wait = ctl.next_wake(now).saturating_duration_since(now);
        if weighing {
            wait = wait.min(WEIGHED_POLL);
        }
        if wait.is_zero() {
            wait = Duration::from_millis(1);
        }
        let verdict = if weighing { weighed_rx.try_recv().ok() } else { None };
        let event = match (verdict, crate::stop_signal::requested()) {
            (Some(verdict), _) => {
                weighing = false;
                Event::Weighed(verdict)
            }
            // SIGTERM or Ctrl-C: every rank stops after the same step and writes the final
            // checkpoint (a second signal ends the process at once).
            (None, Some((_, name))) if !shell.stop_told => {
                shell.stop_told = true;
                tracing::warn!(
                    "{name}: every worker stops after the step in flight and writes the final checkpoint (again to stop at once)"
                );
                Event::StopRequested { why: name.to_string() }
            }
            _ => match fleet.next_event(wait) {
                None => Event::Tick,
                Some(FleetEvent::Joined { workers }) => {
                    observe(TrainEvent::WorkersJoined { workers: workers.clone() })?;
                    Event::Joined { workers: workers.into_iter().map(|w| w as u64).collect() }
                }
                Some(FleetEvent::Leaving { workers, reason }) => {
                    observe(TrainEvent::Leaving { workers: workers.clone(), reason: reason.clone() })?;
                    Event::Drain { workers: workers.into_iter().map(|w| w as u64).collect(), reason }
                }
                Some(FleetEvent::Exited { rank }) => {
                    let status = fleet.exit_status(rank);
                    let member = ctl.alive().contains(&(rank as u64)) || ctl.standby().any(|w| w == rank as u64);
                    if !shell.done.contains_key(&rank) && member {
                        let why = format!("died ({status}){}", shell.since_first_failure());
                        shell.ended(rank, "died");
                        observe(TrainEvent::Lost { worker: rank, why })?;
                        shell.failure_seen();
                    }
                    Event::Exited { node: rank as u64, status }
                }
                Some(FleetEvent::Report { rank: _, event }) if replayed_until.is_some() && already_logged(&event, &ctl, replayed_until) => {
                    continue;
                }
                Some(FleetEvent::Report { rank, event }) => match shell.translate(rank, event, &ctl, &mut observe)? {
                    Some(e) => e,
                    None => continue,
                },
            },
        };
        let decided = Instant::now();
        let commands = ctl.decide(decided, event);
        let plan_s = decided.elapsed().as_secs_f64();
        if let Some(save) = save.as_mut() {
            if saved_epoch != Some(ctl.epoch()) && !ctl.is_over() {
                saved_epoch = Some(ctl.epoch());
                save(&ctl, false);
            }
        }
        if let Some(shared) = &shared {
            // At once when the job's epoch, phase, step or members changed; else every
            // STATUS_EVERY (a snapshot lists every member: at a thousand nodes, not one per
            // heartbeat).
            let key = (ctl.epoch(), ctl.phase_name(), ctl.last_step(), ctl.alive().len());
            if status_at.as_ref().is_none_or(|(at, k)| *k != key || decided.duration_since(*at) >= STATUS_EVERY) {
                if plan_json.0 != ctl.epoch() {
                    plan_json = (ctl.epoch(), shown_plan(&ctl));
                }
                *shared.lock().unwrap_or_else(|e| e.into_inner()) = snapshot(&ctl, decided, job_id, first_epoch, &plan_json.1);
                status_at = Some((decided, key));
            }
        }
        for command in commands {
            match command {
                Command::Kill { node, reason, silent_since } => {
                    fleet.kill(node as usize, &reason);
                    shell.ended(node as usize, "lost");
                    observe(TrainEvent::Lost { worker: node as usize, why: reason })?;
                    // A silent node failed when it was last heard from, a lease ago: the
                    // record counts the wait for the lease as detection. A node's other
                    // workers go with the failure that took one of them: it began now.
                    shell.failure_seen_at(silent_since.unwrap_or(decided));
                }
                Command::Fence { epoch, ranks, nodes } => {
                    let _ = fleet.send_many(&workers(&nodes), &LauncherMessage::Fence { epoch, ranks });
                }
                Command::Abandon { epoch, nodes } => {
                    let _ = fleet.send_many(&workers(&nodes), &LauncherMessage::Abandon { epoch });
                }
                Command::Addresses { epoch, addrs } => {
                    let _ = fleet.send_many(&workers(ctl.ranks()), &LauncherMessage::Addrs { epoch, addrs });
                }
                Command::Resume { .. } => {
                    if !shell.started {
                        shell.started = true;
                        observe(TrainEvent::Started)?;
                    }
                    if let Some(r) = &mut shell.recovering {
                        r.resumed = true;
                    }
                }
                Command::Weigh(request) => {
                    weighing = true;
                    let tx = weighed_tx.clone();
                    std::thread::Builder::new()
                        .name("weigh".into())
                        .spawn(move || {
                            let started = Instant::now();
                            let mut verdict = request.weigh();
                            if let Some((d, _)) = &mut verdict.outcome {
                                d.weigh_s = Some(started.elapsed().as_secs_f64());
                            }
                            // The loop may have ended meanwhile: nobody to tell.
                            let _ = tx.send(verdict);
                        })
                        .map_err(|e| ControlError::Launch(format!("cannot start the thread that weighs a rebalance: {e}")))?;
                }
                Command::Rebalance(d) => observe(TrainEvent::Rebalance(d))?,
                Command::LogStep(c) => {
                    observe(TrainEvent::Step { report: c.report, seconds: c.seconds, dropped: 0, moe_wire_bytes: None, snapshot: None })?
                }
                Command::Pause { epoch, nodes } => {
                    // The clock of the move's record starts at the request.
                    shell.failure_seen();
                    let _ = fleet.send_many(&workers(&nodes), &LauncherMessage::Pause { epoch });
                }
                Command::Finish { epoch, nodes } => {
                    let _ = fleet.send_many(&workers(&nodes), &LauncherMessage::Finish { epoch });
                }
                Command::Reconfigure(m) => {
                    if let Some(away) = fleet.without_a_controller().filter(|_| m.cause == MoveCause::Controller) {
                        // The record of a job taken back counts from the loss of its controller.
                        shell.failure_seen_at(decided.checked_sub(away).unwrap_or(decided));
                    }
                    shell.begin_move(&m, plan_s, first_epoch);
                    send_transfers(fleet, &ctl, &m);
                    for (plan, nodes) in shell.plan_groups(&m) {
                        let _ = fleet.send_many(&nodes, &LauncherMessage::Reconfigure { commit_to: m.commit_to, to: move_order(&m, plan) });
                    }
                }
                Command::Rollback { to: m, to_step } => {
                    shell.begin_move(&m, plan_s, first_epoch);
                    if let Some(r) = &mut shell.recovering {
                        r.step = to_step.unwrap_or(0);
                    }
                    // (The controller's rollback moves carry no transfers, joiners or leavers:
                    // nothing goes ahead of the order unless one ever does.)
                    send_transfers(fleet, &ctl, &m);
                    for (plan, nodes) in shell.plan_groups(&m) {
                        let _ = fleet.send_many(&nodes, &LauncherMessage::Rollback { to_step, to: move_order(&m, plan) });
                    }
                }
                Command::Complete => {
                    // Rank 0 of the last epoch wrote the final checkpoint.
                    let rank0 = ctl.ranks().first().map(|&n| n as usize);
                    let checkpoint = rank0.and_then(|r| shell.done.get(&r).cloned()).flatten();
                    return Ok(TrainOutcome::Completed { checkpoint });
                }
                Command::Stop { reason } => return Ok(shell.stopped(&ctl, reason)),
            }
        }
    })();
    if let Some(save) = save.as_mut() {
        // Nothing left to take back: the job completed, or stopped with its workers.
        save(&ctl, true);
    }
    match &result {
        Ok(TrainOutcome::Completed { .. }) => {
            let how = match crate::stop_signal::requested().filter(|_| shell.stop_told) {
                Some((_, name)) => format!(
                    "the controller was asked to stop ({name}): every worker finished after step {} with the final checkpoint",
                    ctl.last_step()
                ),
                None => "the job completed".to_string(),
            };
            fleet.finish(&how);
        }
        Ok(TrainOutcome::Failed { reason, .. }) => {
            fleet.kill_all(reason);
            fleet.finish(reason);
        }
        Err(e) => {
            fleet.kill_all(&e.to_string());
            fleet.finish(&e.to_string());
        }
    }
    result.map(|outcome| Ended { outcome, results: shell.results.take() })
}

/// Whether a record a re-attached agent sent again is one the log has: a step up to the last
/// logged, a checkpoint up to the last known, an evaluation of a step logged before the
/// controller was lost (`replayed_until`).
fn already_logged(event: &WorkerEvent, ctl: &Controller, replayed_until: Option<u64>) -> bool {
    match event {
        WorkerEvent::Step { report, .. } => report.step <= ctl.last_step(),
        WorkerEvent::Checkpointed { step, .. } => ctl.checkpoint().is_some_and(|c| *step <= c),
        WorkerEvent::Evaluated { step, .. } => replayed_until.is_some_and(|r| *step <= r),
        _ => false,
    }
}

/// How each worker ended, consecutive workers that ended alike in one entry (`8-15: lost`): a
/// thousand nodes' stop says what happened in a few lines, not eight thousand.
fn runs_of(ends: impl Iterator<Item = (usize, String)>) -> Vec<String> {
    let mut runs: Vec<(usize, usize, String)> = Vec::new();
    for (w, how) in ends {
        match runs.last_mut() {
            Some((_, last, h)) if *last + 1 == w && *h == how => *last = w,
            _ => runs.push((w, w, how)),
        }
    }
    runs.into_iter().map(|(a, b, how)| if a == b { format!("{a}: {how}") } else { format!("{a}-{b}: {how}") }).collect()
}

/// The workers (fleet ranks) of controller nodes.
fn workers(nodes: &[u64]) -> Vec<usize> {
    nodes.iter().map(|&n| n as usize).collect()
}

/// Move `m` as its workers that are sent `plan` are told it (each finds its rank in it).
fn move_order(m: &crate::controller::Move, plan: PlanUpdate) -> MoveOrder {
    MoveOrder {
        epoch: m.epoch,
        workers: m.ranks.clone(),
        plan,
        // Sent apart, each node its own (`send_transfers`).
        transfers: Vec::new(),
        joining: m.joining.clone(),
        leaving: m.leaving.clone(),
        hold: m.hold,
        catch_up: m.restored.iter().filter(|x| x.tokens_lost > 0).map(|x| (x.layer, x.expert, x.tokens_lost)).collect(),
    }
}

/// Each node of a move is sent the transfers its workers send or receive, before the order all
/// nodes share: a rebalance among a thousand nodes moves hundreds of thousands of expert states,
/// which every agent would otherwise be sent whole.
fn send_transfers(fleet: &mut dyn Fleet, ctl: &Controller, m: &crate::controller::Move) {
    let node_of_rank: Vec<u64> = m.ranks.iter().map(|&w| ctl.node(w)).collect();
    let mut workers_of: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (&w, &node) in m.ranks.iter().zip(&node_of_rank) {
        workers_of.entry(node).or_default().push(w as usize);
    }
    for (node, transfers) in crate::protocol::transfers_by_node(&m.transfers, &node_of_rank) {
        let _ = fleet.send_many(&workers_of[&node], &LauncherMessage::Transfers { epoch: m.epoch, transfers });
    }
}

/// Whether two plan updates are the same one (shared, made once).
fn same_update(a: &PlanUpdate, b: &PlanUpdate) -> bool {
    match (a, b) {
        (PlanUpdate::Whole { map: x }, PlanUpdate::Whole { map: y }) => Arc::ptr_eq(x, y),
        (PlanUpdate::Changed { change: x }, PlanUpdate::Changed { change: y }) => Arc::ptr_eq(x, y),
        _ => false,
    }
}

/// A reconfiguration in progress, for its record.
struct Recovering {
    started: Instant,
    cause: MoveCause,
    epoch: u64,
    lost: Vec<u64>,
    joined: Vec<u64>,
    step: u64,
    detect_s: f64,
    plan_s: f64,
    moved: Vec<MoveStats>,
    /// The last move held after it (a drain's first half): its stats count in the next.
    keep_moved: bool,
    resumed: bool,
    /// Ranks that said they are ready in the move's epoch: a step one of them reports after
    /// that is of the new epoch even before the controller's resume (a worker's reports come
    /// in order; another rank's readiness may lag behind its steps).
    ready: BTreeSet<usize>,
    workers: usize,
    restored: Vec<crate::controller::RestoredExpert>,
    rollback_avoided: u64,
}

/// The launcher's side of the bookkeeping the controller does not do: what to show, and when
/// every worker is done.
struct Shell {
    started: bool,
    /// Workers that finished, with rank 0's checkpoint.
    done: BTreeMap<usize, Option<PathBuf>>,
    recovering: Option<Recovering>,
    first_error: Option<String>,
    /// The node of each rank of the current epoch.
    ranks: Vec<u64>,
    /// The newest checkpoint written, for a stop to name.
    last_checkpoint: Option<PathBuf>,
    /// How each worker that did not finish ended, in short (`died`, a failure kind, `lost`).
    ends: BTreeMap<usize, String>,
    /// When the first worker stopped other than by finishing (for a job without recovery:
    /// how long the others took to notice).
    first_failure: Option<Instant>,
    /// Rank 0's results (a benchmark's).
    results: Option<serde_json::Value>,
    /// A stop signal was passed to the controller.
    stop_told: bool,
    /// The replica map last sent (by its epoch), with the worker of each of its ranks: a move
    /// is sent to a worker as the change from the map it has.
    sent_maps: BTreeMap<u64, (ReplicaMap, Vec<u64>)>,
    /// The epoch of the last plan each worker was sent (its map is that epoch's, whether its
    /// move completed or not: the worker keeps the map it was sent).
    sent_at: BTreeMap<u64, u64>,
}

impl Shell {
    /// The plan of move `m` as each of its ranks is sent it: the change from the map the
    /// worker was sent last, else the whole map (a joiner, a job just taken back). Then `m`'s
    /// map is the one each was sent.
    fn plan_updates(&mut self, m: &crate::controller::Move) -> Vec<PlanUpdate> {
        let new_rank: HashMap<u64, usize> = m.ranks.iter().enumerate().map(|(r, &w)| (w, r)).collect();
        // Each change computed once (per map a worker may have), the whole map copied once.
        let mut changes: BTreeMap<u64, Option<Arc<lazarus_plan::ReplicaMapChange>>> = BTreeMap::new();
        let whole = Arc::new(m.plan.clone());
        let updates = m
            .ranks
            .iter()
            .enumerate()
            .map(|(rank, w)| {
                let from = self.sent_at.get(w).filter(|_| !m.joining.contains(&rank));
                let change = from.and_then(|&e| {
                    let (map, ranks) = self.sent_maps.get(&e)?;
                    let renumber = || ranks.iter().map(|w| new_rank.get(w).copied()).collect();
                    changes.entry(e).or_insert_with(|| map.change_to(&m.plan, renumber()).map(Arc::new)).clone()
                });
                match change {
                    Some(change) => PlanUpdate::Changed { change },
                    None => PlanUpdate::Whole { map: whole.clone() },
                }
            })
            .collect();
        // Every worker of the move has its map now; a worker not in it is gone (or standing by).
        self.sent_at = m.ranks.iter().map(|&w| (w, m.epoch)).collect();
        self.sent_maps = BTreeMap::from([(m.epoch, (m.plan.clone(), m.ranks.clone()))]);
        updates
    }

    /// The plan of move `m` as its workers are sent it ([`Shell::plan_updates`]), with the
    /// workers each goes to: those that have the same map share one message.
    fn plan_groups(&mut self, m: &crate::controller::Move) -> Vec<(PlanUpdate, Vec<usize>)> {
        let mut groups: Vec<(PlanUpdate, Vec<usize>)> = Vec::new();
        for (&node, update) in m.ranks.iter().zip(self.plan_updates(m)) {
            match groups.iter_mut().find(|(u, _)| same_update(u, &update)) {
                Some((_, nodes)) => nodes.push(node as usize),
                None => groups.push((update, vec![node as usize])),
            }
        }
        groups
    }

    /// Worker `rank` ended other than by finishing (the first word about it stands).
    fn ended(&mut self, rank: usize, how: &str) {
        self.ends.entry(rank).or_insert_with(|| how.to_string());
        self.first_failure.get_or_insert_with(Instant::now);
    }

    /// " (N ms after the first failure)" once a worker has failed: how long the others took
    /// to notice.
    fn since_first_failure(&self) -> String {
        self.first_failure.map(|t| format!(" ({} ms after the first failure)", t.elapsed().as_millis())).unwrap_or_default()
    }

    /// The job stopped: why (with the first failure a worker reported, and how to go on from
    /// the last checkpoint), and how each worker ended.
    fn stopped(&self, ctl: &Controller, reason: String) -> TrainOutcome {
        let mut reason = match &self.first_error {
            Some(first) => format!("{reason} (first failure: {first})"),
            None => reason,
        };
        // Where to go on from: the user's next command, not only a step number.
        if let Some(dir) = self.last_checkpoint.as_ref().and_then(|p| p.parent()) {
            reason.push_str(&format!(
                "; to go on from it, start the job again on enough workers with --checkpoint-dir {} --resume",
                dir.display()
            ));
        }
        let ends = ctl.nodes().map(|n| {
            let w = n as usize;
            let how = match self.ends.get(&w) {
                _ if self.done.contains_key(&w) => "finished",
                Some(how) => how.as_str(),
                None if ctl.alive().contains(&n) => "alive (killed)",
                None => "lost",
            };
            (w, how.to_string())
        });
        TrainOutcome::Failed { reason, workers: runs_of(ends) }
    }

    /// The first sign of a failure starts the clock of its record.
    fn failure_seen(&mut self) {
        self.failure_seen_at(Instant::now());
    }

    /// A failure that began at `at` (earlier than now, for a node found out by its silence).
    fn failure_seen_at(&mut self, at: Instant) {
        if let Some(r) = &mut self.recovering {
            r.started = r.started.min(at);
        } else {
            self.recovering = Some(Recovering {
                started: at,
                cause: MoveCause::Failure,
                epoch: 0,
                lost: Vec::new(),
                joined: Vec::new(),
                step: 0,
                detect_s: 0.0,
                plan_s: 0.0,
                moved: Vec::new(),
                keep_moved: false,
                resumed: false,
                ready: BTreeSet::new(),
                workers: 0,
                restored: Vec::new(),
                rollback_avoided: 0,
            });
        }
    }

    fn begin_move(&mut self, m: &crate::controller::Move, plan_s: f64, first_epoch: u64) {
        self.failure_seen();
        if let Some(r) = &mut self.recovering {
            r.cause = m.cause;
            // A move that failed half-way and the one after it: the last one's restores count.
            r.restored = m.restored.clone();
            r.rollback_avoided = m.rollback_avoided;
            r.epoch = m.epoch - first_epoch;
            r.step = m.commit_to;
            r.detect_s = r.started.elapsed().as_secs_f64() - plan_s;
            r.plan_s = plan_s;
            r.workers = m.ranks.len();
            // A move that failed half-way and the one after it are one recovery: its record
            // names every worker lost on the way.
            for n in self.ranks.iter().copied().filter(|n| !m.ranks.contains(n)) {
                if !r.lost.contains(&n) {
                    r.lost.push(n);
                }
            }
            r.lost.sort_unstable();
            for n in m.ranks.iter().copied().filter(|n| !self.ranks.contains(n)) {
                if !r.joined.contains(&n) {
                    r.joined.push(n);
                }
            }
            r.joined.sort_unstable();
            // A move that failed half-way tells nothing; the first half of a drain (a move that
            // holds after it) is part of this one's cost.
            if !r.keep_moved {
                r.moved.clear();
            }
            r.keep_moved = m.hold;
            r.resumed = false;
            r.ready.clear();
        }
        self.ranks = m.ranks.clone();
    }

    /// A worker's report as the controller's event (None: nothing for the controller).
    fn translate(
        &mut self,
        rank: usize,
        ev: WorkerEvent,
        ctl: &Controller,
        observe: &mut impl FnMut(TrainEvent) -> Result<(), ControlError>,
    ) -> Result<Option<Event>, ControlError> {
        let node = rank as u64;
        Ok(Some(match ev {
            WorkerEvent::Listening { addr, epoch } => Event::Listening { node, epoch, addr },
            WorkerEvent::Ready { pid, epoch, moved } => {
                if moved.is_none() {
                    observe(TrainEvent::Ready { rank, pid })?;
                }
                if let Some(r) = &mut self.recovering {
                    if epoch == ctl.epoch() {
                        r.ready.insert(rank);
                    }
                    if let Some(m) = moved {
                        r.moved.push(m);
                    }
                }
                Event::Ready { node, epoch }
            }
            WorkerEvent::Heartbeat => Event::Heartbeat { node },
            WorkerEvent::Step { report, seconds, wire_bytes, dropped, snapshot } => {
                let mut moved = None;
                // The move's record, with the rewind of a rollback, before the first step of
                // its epoch (steps logged before it are the old epoch's, and a rollback cuts
                // them): at the controller's resume, or at a step from a rank that said it was
                // ready in the new epoch — the other ranks' readiness can arrive after it (a
                // rollback onto newcomers alone lost 7 steps' records so in a soak).
                if let Some(r) = self.recovering.take_if(|r| r.resumed || r.ready.contains(&rank)) {
                    let max = |f: fn(&MoveStats) -> f64| r.moved.iter().map(f).fold(0.0, f64::max);
                    observe(TrainEvent::Reconfigured(ReconfigurationRecord {
                        event: "reconfiguration",
                        epoch: r.epoch,
                        cause: r.cause,
                        lost: r.lost.clone(),
                        joined: r.joined.clone(),
                        step: r.step,
                        detect_s: r.detect_s,
                        plan_s: r.plan_s,
                        transfer_s: max(|m| m.transfer_s),
                        transfer_bytes: r.moved.iter().map(|m| m.bytes_received).sum(),
                        rebuild_s: max(|m| m.rebuild_s),
                        recovery_s: r.started.elapsed().as_secs_f64(),
                        workers: r.workers,
                        restored: r.restored.clone(),
                        rollback_avoided_steps: r.rollback_avoided,
                        gpu_used_bytes: r.moved.iter().filter_map(|m| m.gpu_used_bytes).collect(),
                    }))?;
                    moved = Some(MoveCost {
                        bytes: r.moved.iter().map(|m| m.bytes_received).sum(),
                        transfer_s: max(|m| m.transfer_s),
                        rebuild_s: max(|m| m.rebuild_s),
                    });
                }
                let event =
                    Event::StepDone { epoch: ctl.epoch(), step: report.step, steps: 1, loads: report.expert_load.clone(), seconds, moved };
                observe(TrainEvent::Step { report, seconds, dropped, moe_wire_bytes: Some(wire_bytes), snapshot })?;
                event
            }
            WorkerEvent::Left => {
                observe(TrainEvent::Lost { worker: rank, why: "left the job (its node was drained)".into() })?;
                Event::Exited { node, status: "left the job (its node was drained)".into() }
            }
            WorkerEvent::Paused { epoch, steps_done, holds, snapshots } => {
                Event::StepFailed { node, epoch, report: StopReport { steps_done, held: None, holds, last: None, snapshots } }
            }
            WorkerEvent::StepFailed { epoch, steps_done, held, holds, message, last, snapshots, kind } => {
                if !ctl.recovers() {
                    // Without recovery a stopped worker is at its end: say how, and when.
                    let why = format!("stopped: {kind}: {message}{}", self.since_first_failure());
                    self.ended(rank, kind.name());
                    observe(TrainEvent::Lost { worker: rank, why })?;
                }
                self.failure_seen();
                self.first_error.get_or_insert(format!("worker {rank}: {message}"));
                Event::StepFailed { node, epoch, report: StopReport { steps_done, held, holds, last, snapshots } }
            }
            WorkerEvent::Evaluated { step, evaluation } => {
                observe(TrainEvent::Evaluated { step, evaluation })?;
                return Ok(None);
            }
            WorkerEvent::Checkpointed { step, path } => {
                self.last_checkpoint = Some(path.clone());
                observe(TrainEvent::Checkpointed { step, path })?;
                Event::Checkpointed { step }
            }
            WorkerEvent::Done { checkpoint } => {
                self.done.insert(rank, checkpoint);
                Event::Done { node }
            }
            WorkerEvent::Results { results } => {
                self.results = Some(results);
                self.done.insert(rank, None);
                Event::Done { node }
            }
            WorkerEvent::Failed { kind, message } => {
                self.first_error.get_or_insert(format!("worker {rank}: {kind}: {message}"));
                let why = format!("stopped: {kind}: {message}{}", self.since_first_failure());
                self.ended(rank, kind.name());
                observe(TrainEvent::Lost { worker: rank, why })?;
                self.failure_seen();
                Event::Exited { node, status: format!("{kind}: {message}") }
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::Move;

    fn shell(map: ReplicaMap, ranks: Vec<u64>) -> Shell {
        Shell {
            started: true,
            done: BTreeMap::new(),
            recovering: None,
            first_error: None,
            ranks: ranks.clone(),
            last_checkpoint: None,
            ends: BTreeMap::new(),
            first_failure: None,
            results: None,
            stop_told: false,
            sent_at: ranks.iter().map(|&w| (w, map.epoch())).collect(),
            sent_maps: BTreeMap::from([(map.epoch(), (map, ranks))]),
        }
    }

    fn a_move(epoch: u64, ranks: Vec<u64>, plan: ReplicaMap, joining: Vec<usize>) -> Move {
        Move {
            epoch,
            ranks,
            plan,
            commit_to: 5,
            transfers: Vec::new(),
            joining,
            leaving: Vec::new(),
            hold: false,
            cause: MoveCause::Failure,
            restored: Vec::new(),
            rollback_avoided: 0,
        }
    }

    #[test]
    fn how_workers_ended_is_said_in_runs() {
        let ends = [(0, "lost"), (1, "lost"), (2, "died"), (3, "lost"), (5, "lost"), (6, "lost")].map(|(w, h)| (w, h.to_string()));
        assert_eq!(runs_of(ends.into_iter()), vec!["0-1: lost", "2: died", "3: lost", "5-6: lost"]);
        assert!(runs_of(std::iter::empty()).is_empty());
    }

    /// A worker that has the last map is sent the change from it (which rebuilds the new map
    /// there); a joiner, and a worker never sent a map, the whole map. A second move changes
    /// from the first's map.
    #[test]
    fn moves_go_to_workers_as_changes_from_the_map_they_have() {
        // Workers 7, 8, 9 at ranks 0, 1, 2; 8 is lost and 4 joins at rank 2.
        let old = ReplicaMap::new(3, vec![vec![vec![1, 0, 1], vec![0, 1, 1], vec![0, 1, 0]]]).unwrap();
        let new = ReplicaMap::new(4, vec![vec![vec![1, 1, 0], vec![0, 1, 1], vec![1, 0, 1]]]).unwrap();
        let mut s = shell(old.clone(), vec![7, 8, 9]);
        let m = a_move(4, vec![7, 9, 4], new.clone(), vec![2]);
        let updates = s.plan_updates(&m);
        for (rank, u) in updates.iter().enumerate() {
            match (rank, u) {
                (0 | 1, PlanUpdate::Changed { change }) => assert_eq!(old.changed_by(change).unwrap(), new),
                (2, PlanUpdate::Whole { map }) => assert_eq!(**map, new),
                _ => panic!("rank {rank}: {u:?}"),
            }
        }
        let next = ReplicaMap::new(5, vec![vec![vec![1, 0, 1], vec![1, 1, 0], vec![0, 1, 1]]]).unwrap();
        let updates = s.plan_updates(&a_move(5, vec![4, 7, 9], next.clone(), Vec::new()));
        for u in updates {
            let PlanUpdate::Changed { change } = u else { panic!("{u:?}") };
            assert_eq!(new.changed_by(&change).unwrap(), next);
        }
        // A worker the shell never sent a map: whole.
        let mut fresh = shell(old.clone(), vec![7, 8, 9]);
        fresh.sent_at.clear();
        assert!(fresh.plan_updates(&m).iter().all(|u| matches!(u, PlanUpdate::Whole { .. })));
        // Those that have the same map are sent one message: the survivors the change, the
        // joiner the whole map.
        let mut s = shell(old.clone(), vec![7, 8, 9]);
        let groups: Vec<(bool, Vec<usize>)> =
            s.plan_groups(&m).into_iter().map(|(u, nodes)| (matches!(u, PlanUpdate::Whole { .. }), nodes)).collect();
        assert_eq!(groups, vec![(false, vec![7, 9]), (true, vec![4])]);
    }
}
