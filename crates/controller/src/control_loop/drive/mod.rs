//! The controller's loop, for every job (with live recovery or without, training or a
//! benchmark): worker reports in through a [`Fleet`], [`Controller::decide`] on each, its
//! commands out — the start deadline, a stop asked for and completion included. The shell keeps
//! only what to show the user and the record of each reconfiguration.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lazarus_plan::PlanUpdate;

use super::{TrainEvent, TrainOutcome};
use crate::decisions::{Command, Controller, Event, MoveCause, Weighed};
use crate::fleet::{Fleet, FleetEvent};
use crate::service::{snapshot, SharedStatus};
use lazarus_protocol::ControlError;
use lazarus_protocol::{LauncherMessage, MoveOrder, WorkerEvent};

mod shell;

use shell::Shell;

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
    ctl: Controller,
    job_id: &str,
    shared: Option<SharedStatus>,
    save: Option<SaveState<'_>>,
    observe: impl FnMut(TrainEvent) -> Result<(), ControlError>,
) -> Result<Ended, ControlError> {
    let mut driver = Driver::new(fleet, ctl, job_id, shared, save, observe);
    let result = driver.run();
    driver.end(result)
}

/// The loop's state: the controller, the shell's bookkeeping, and what the loop shows and saves.
struct Driver<'a, 's, O> {
    fleet: &'a mut dyn Fleet,
    ctl: Controller,
    shell: Shell,
    observe: O,
    job_id: &'a str,
    shared: Option<SharedStatus>,
    save: Option<SaveState<'s>>,
    /// The job's first epoch (a job taken back counts its epochs from its first controller's
    /// start).
    first_epoch: u64,
    /// A job taken back: its agents send their last records again, which the log may hold.
    replayed_until: Option<u64>,
    /// The epoch whose state was saved last: what a new controller would need is saved before
    /// any worker hears of a new epoch.
    saved_epoch: Option<u64>,
    /// The plan as `lazarus status` shows it (its epoch counted from the job's start), by epoch.
    /// The epoch of the plan in the shared status (made again only when the epoch changes).
    plan_epoch: Option<u64>,
    /// When the status was last published, and what it showed.
    status_at: Option<(Instant, StatusKey)>,
    /// A rebalance being weighed on a thread of its own (at a thousand nodes it plans a model:
    /// seconds the loop must not be held for), and where its verdict comes back.
    weighing: bool,
    weighed_tx: std::sync::mpsc::Sender<Weighed>,
    weighed_rx: std::sync::mpsc::Receiver<Weighed>,
}

/// What, changed, publishes the status at once: epoch, phase, step, members alive.
type StatusKey = (u64, &'static str, u64, usize);

/// The plan as `lazarus status` shows it: its epoch counted from the job's start.
fn shown_plan(ctl: &Controller) -> Option<lazarus_protocol::proto::Plan> {
    ctl.plan().map(|p| lazarus_protocol::status_plan::plan_to_proto(&p.clone().with_epoch(ctl.job_epoch(ctl.epoch()))))
}

impl<'a, 's, O: FnMut(TrainEvent) -> Result<(), ControlError>> Driver<'a, 's, O> {
    fn new(
        fleet: &'a mut dyn Fleet,
        ctl: Controller,
        job_id: &'a str,
        shared: Option<SharedStatus>,
        save: Option<SaveState<'s>>,
        observe: O,
    ) -> Self {
        let shell = Shell {
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
            // The workers start with the plan of the controller's epoch (those of a job taken
            // back may have any of the last few: they are sent the next whole).
            sent_maps: ctl
                .plan()
                .filter(|_| !ctl.resuming())
                .map(|p| (ctl.epoch(), (p.replica_map(), ctl.ranks().to_vec())))
                .into_iter()
                .collect(),
            sent_at: if ctl.resuming() { BTreeMap::new() } else { ctl.ranks().iter().map(|&w| (w, ctl.epoch())).collect() },
        };
        let (weighed_tx, weighed_rx) = std::sync::mpsc::channel::<Weighed>();
        Driver {
            first_epoch: ctl.epoch() - ctl.job_epoch(ctl.epoch()),
            replayed_until: ctl.resuming().then(|| ctl.last_step()),
            saved_epoch: None,
            plan_epoch: None,
            status_at: None,
            weighing: false,
            weighed_tx,
            weighed_rx,
            fleet,
            ctl,
            shell,
            observe,
            job_id,
            shared,
            save,
        }
    }

    /// Events in, decisions out, until a command ends the job.
    fn run(&mut self) -> Result<TrainOutcome, ControlError> {
        loop {
            let Some(event) = self.next_event()? else { continue };
            let decided = Instant::now();
            let commands = self.ctl.decide(decided, event);
            let plan_s = decided.elapsed().as_secs_f64();
            self.save_state();
            self.publish_status(decided);
            for command in commands {
                if let Some(outcome) = self.carry_out(command, decided, plan_s)? {
                    return Ok(outcome);
                }
            }
        }
    }

    /// The next event for the controller: a rebalance's verdict, a stop asked for, a worker's
    /// report or exit, a join or a leave from the fleet, or a tick when its wake-up comes
    /// first. None: a report with nothing for the controller (shown, or a record replayed).
    fn next_event(&mut self) -> Result<Option<Event>, ControlError> {
        let now = Instant::now();
        let mut wait = self.ctl.next_wake(now).saturating_duration_since(now);
        if self.weighing {
            wait = wait.min(WEIGHED_POLL);
        }
        if wait.is_zero() {
            wait = Duration::from_millis(1);
        }
        let verdict = if self.weighing { self.weighed_rx.try_recv().ok() } else { None };
        if let Some(verdict) = verdict {
            self.weighing = false;
            return Ok(Some(Event::Weighed(verdict)));
        }
        // SIGTERM or Ctrl-C: every rank stops after the same step and writes the final
        // checkpoint (a second signal ends the process at once).
        if let Some((_, name)) = lazarus_protocol::stop_signal::requested().filter(|_| !self.shell.stop_told) {
            self.shell.stop_told = true;
            tracing::warn!("{name}: every worker stops after the step in flight and writes the final checkpoint (again to stop at once)");
            return Ok(Some(Event::StopRequested { why: name.to_string() }));
        }
        Ok(Some(match self.fleet.next_event(wait) {
            None => Event::Tick,
            Some(FleetEvent::Joined { workers }) => {
                (self.observe)(TrainEvent::WorkersJoined { workers: workers.clone() })?;
                Event::Joined { workers: workers.into_iter().map(|w| w as u64).collect() }
            }
            Some(FleetEvent::Leaving { workers, reason }) => {
                (self.observe)(TrainEvent::Leaving { workers: workers.clone(), reason: reason.clone() })?;
                Event::Drain { workers: workers.into_iter().map(|w| w as u64).collect(), reason }
            }
            Some(FleetEvent::Exited { rank }) => {
                let status = self.fleet.exit_status(rank);
                let member = self.ctl.alive().contains(&(rank as u64)) || self.ctl.standby().any(|w| w == rank as u64);
                if !self.shell.done.contains_key(&rank) && member {
                    let why = format!("died ({status}){}", self.shell.since_first_failure());
                    self.shell.ended(rank, "died");
                    (self.observe)(TrainEvent::Lost { worker: rank, why })?;
                    self.shell.failure_seen();
                }
                Event::Exited { node: rank as u64, status }
            }
            Some(FleetEvent::Report { rank: _, event })
                if self.replayed_until.is_some() && already_logged(&event, &self.ctl, self.replayed_until) =>
            {
                return Ok(None);
            }
            Some(FleetEvent::Report { rank, event }) => match self.shell.translate(rank, event, &self.ctl, &mut self.observe)? {
                Some(e) => e,
                None => return Ok(None),
            },
        }))
    }

    /// What a new controller would need, saved before any worker hears of a new epoch.
    fn save_state(&mut self) {
        if let Some(save) = self.save.as_mut() {
            if self.saved_epoch != Some(self.ctl.epoch()) && !self.ctl.is_over() {
                self.saved_epoch = Some(self.ctl.epoch());
                save(&self.ctl, false);
            }
        }
    }

    /// The status `lazarus status` is served: at once when the job's epoch, phase, step or
    /// members changed; else every STATUS_EVERY (a snapshot lists every member: at a thousand
    /// nodes, not one per heartbeat).
    fn publish_status(&mut self, decided: Instant) {
        let Some(shared) = &self.shared else { return };
        let ctl = &self.ctl;
        let key = (ctl.epoch(), ctl.phase_name(), ctl.last_step(), ctl.alive().len());
        if self.status_at.as_ref().is_some_and(|(at, k)| *k == key && decided.duration_since(*at) < STATUS_EVERY) {
            return;
        }
        let mut shared = shared.lock().unwrap_or_else(|e| e.into_inner());
        // The plan stays where it is until the epoch changes: at a thousand nodes it is tens of
        // thousands of lists, not to be copied every publication.
        let plan = if self.plan_epoch == Some(ctl.epoch()) { shared.plan.take() } else { shown_plan(ctl) };
        self.plan_epoch = Some(ctl.epoch());
        *shared = snapshot(ctl, decided, self.job_id, self.first_epoch, plan);
        self.status_at = Some((decided, key));
    }

    /// Carry out one of the controller's commands, decided at `decided` in `plan_s` seconds;
    /// the job's outcome if the command ends it.
    fn carry_out(&mut self, command: Command, decided: Instant, plan_s: f64) -> Result<Option<TrainOutcome>, ControlError> {
        let (fleet, ctl, shell) = (&mut *self.fleet, &self.ctl, &mut self.shell);
        match command {
            Command::Kill { node, reason, silent_since } => {
                fleet.kill(node as usize, &reason);
                shell.ended(node as usize, "lost");
                (self.observe)(TrainEvent::Lost { worker: node as usize, why: reason })?;
                // A silent node failed when it was last heard from, a lease ago: the record
                // counts the wait for the lease as detection. A node's other workers go with the
                // failure that took one of them: it began now.
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
                    (self.observe)(TrainEvent::Started)?;
                }
                if let Some(r) = &mut shell.recovering {
                    r.resumed = true;
                }
            }
            Command::Weigh(request) => self.weigh(request)?,
            Command::Rebalance(d) => (self.observe)(TrainEvent::Rebalance(d))?,
            Command::LogStep(c) => {
                (self.observe)(TrainEvent::Step { report: c.report, seconds: c.seconds, dropped: 0, moe_wire_bytes: None, snapshot: None })?
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
                shell.begin_move(&m, plan_s, self.first_epoch);
                send_transfers(fleet, ctl, &m);
                for (plan, nodes) in shell.plan_groups(&m) {
                    let _ = fleet.send_many(&nodes, &LauncherMessage::Reconfigure { commit_to: m.commit_to, to: move_order(&m, plan) });
                }
            }
            Command::Rollback { to: m, to_step } => {
                shell.begin_move(&m, plan_s, self.first_epoch);
                if let Some(r) = &mut shell.recovering {
                    r.step = to_step.unwrap_or(0);
                }
                // (The controller's rollback moves carry no transfers, joiners or leavers:
                // nothing goes ahead of the order unless one ever does.)
                send_transfers(fleet, ctl, &m);
                for (plan, nodes) in shell.plan_groups(&m) {
                    let _ = fleet.send_many(&nodes, &LauncherMessage::Rollback { to_step, to: move_order(&m, plan) });
                }
            }
            Command::Complete => {
                // Rank 0 of the last epoch wrote the final checkpoint.
                let rank0 = ctl.ranks().first().map(|&n| n as usize);
                let checkpoint = rank0.and_then(|r| shell.done.get(&r).cloned()).flatten();
                return Ok(Some(TrainOutcome::Completed { checkpoint }));
            }
            Command::Stop { reason } => return Ok(Some(shell.stopped(ctl, reason.clone()))),
        }
        Ok(None)
    }

    /// Weigh a rebalance on a thread of its own; its verdict comes back to the loop.
    fn weigh(&mut self, request: Box<crate::decisions::Weighing>) -> Result<(), ControlError> {
        self.weighing = true;
        let tx = self.weighed_tx.clone();
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
        Ok(())
    }

    /// The job is over: its state saved as nothing left to take back, the fleet told (every
    /// worker left killed unless it completed), rank 0's results kept.
    fn end(mut self, result: Result<TrainOutcome, ControlError>) -> Result<Ended, ControlError> {
        if let Some(save) = self.save.as_mut() {
            // Nothing left to take back: the job completed, or stopped with its workers.
            save(&self.ctl, true);
        }
        match &result {
            Ok(TrainOutcome::Completed { .. }) => {
                let how = match lazarus_protocol::stop_signal::requested().filter(|_| self.shell.stop_told) {
                    Some((_, name)) => format!(
                        "the controller was asked to stop ({name}): every worker finished after step {} with the final checkpoint",
                        self.ctl.last_step()
                    ),
                    None => "the job completed".to_string(),
                };
                self.fleet.finish(&how);
            }
            Ok(TrainOutcome::Failed { reason, .. }) => {
                let reason = reason.to_string();
                self.fleet.kill_all(&reason);
                self.fleet.finish(&reason);
            }
            Err(e) => {
                self.fleet.kill_all(&e.to_string());
                self.fleet.finish(&e.to_string());
            }
        }
        result.map(|outcome| Ended { outcome, results: self.shell.results.take() })
    }
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

/// The workers (fleet ranks) of controller nodes.
fn workers(nodes: &[u64]) -> Vec<usize> {
    nodes.iter().map(|&n| n as usize).collect()
}

/// Move `m` as its workers that are sent `plan` are told it (each finds its rank in it).
fn move_order(m: &crate::decisions::MoveDecision, plan: PlanUpdate) -> MoveOrder {
    // The transfers are sent apart, each node its own (`send_transfers`).
    MoveOrder { workers: m.ranks.clone(), change: m.change.without_transfers(plan) }
}

/// Each node of a move is sent the transfers its workers send or receive, before the order all
/// nodes share: a rebalance among a thousand nodes moves hundreds of thousands of expert states,
/// which every agent would otherwise be sent whole.
fn send_transfers(fleet: &mut dyn Fleet, ctl: &Controller, m: &crate::decisions::MoveDecision) {
    let node_of_rank: Vec<u64> = m.ranks.iter().map(|&w| ctl.node(w)).collect();
    let mut workers_of: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (&w, &node) in m.ranks.iter().zip(&node_of_rank) {
        workers_of.entry(node).or_default().push(w as usize);
    }
    for (node, transfers) in lazarus_protocol::transfers_by_node(&m.change.transfers, &node_of_rank) {
        let _ = fleet.send_many(&workers_of[&node], &LauncherMessage::Transfers { epoch: m.change.epoch, transfers });
    }
}
