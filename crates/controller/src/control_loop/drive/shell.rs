//! The launcher's side of the bookkeeping the controller does not do: what to show the user,
//! when every worker is done, the record of each reconfiguration, and each move's plan as each
//! worker is sent it (the change from the map it has).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use lazarus_plan::{PlanUpdate, ReplicaMap};

use crate::decisions::{Controller, Event, MoveCause, MoveCost, StopReport};
use crate::events::{JobStopped, ReconfigurationRecord, TrainEvent, TrainOutcome};
use lazarus_decide::StopReason;
use lazarus_protocol::ControlError;
use lazarus_protocol::{MoveStats, WorkerEvent};

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

/// Whether two plan updates are the same one (shared, made once).
fn same_update(a: &PlanUpdate, b: &PlanUpdate) -> bool {
    match (a, b) {
        (PlanUpdate::Whole { map: x }, PlanUpdate::Whole { map: y }) => Arc::ptr_eq(x, y),
        (PlanUpdate::Changed { change: x }, PlanUpdate::Changed { change: y }) => Arc::ptr_eq(x, y),
        _ => false,
    }
}

/// A reconfiguration in progress, for its record.
pub(super) struct Recovering {
    pub(super) started: Instant,
    pub(super) cause: MoveCause,
    pub(super) epoch: u64,
    pub(super) lost: Vec<u64>,
    pub(super) joined: Vec<u64>,
    pub(super) step: u64,
    pub(super) detect_s: f64,
    pub(super) plan_s: f64,
    pub(super) moved: Vec<MoveStats>,
    /// The last move held after it (a drain's first half): its stats count in the next.
    pub(super) keep_moved: bool,
    pub(super) resumed: bool,
    /// Ranks that said they are ready in the move's epoch: a step one of them reports after
    /// that is of the new epoch even before the controller's resume (a worker's reports come
    /// in order; another rank's readiness may lag behind its steps).
    pub(super) ready: BTreeSet<usize>,
    pub(super) workers: usize,
    pub(super) restored: Vec<crate::decisions::RestoredExpert>,
    pub(super) rollback_avoided: u64,
}

/// The launcher's side of the bookkeeping the controller does not do: what to show, and when
/// every worker is done.
pub(super) struct Shell {
    pub(super) started: bool,
    /// Workers that finished, with rank 0's checkpoint.
    pub(super) done: BTreeMap<usize, Option<PathBuf>>,
    pub(super) recovering: Option<Recovering>,
    pub(super) first_error: Option<String>,
    /// The node of each rank of the current epoch.
    pub(super) ranks: Vec<u64>,
    /// The newest checkpoint written, for a stop to name.
    pub(super) last_checkpoint: Option<PathBuf>,
    /// How each worker that did not finish ended, in short (`died`, a failure kind, `lost`).
    pub(super) ends: BTreeMap<usize, String>,
    /// When the first worker stopped other than by finishing (for a job without recovery:
    /// how long the others took to notice).
    pub(super) first_failure: Option<Instant>,
    /// Rank 0's results (a benchmark's).
    pub(super) results: Option<serde_json::Value>,
    /// A stop signal was passed to the controller.
    pub(super) stop_told: bool,
    /// The replica map last sent (by its epoch), with the worker of each of its ranks: a move
    /// is sent to a worker as the change from the map it has.
    pub(super) sent_maps: BTreeMap<u64, (ReplicaMap, Vec<u64>)>,
    /// The epoch of the last plan each worker was sent (its map is that epoch's, whether its
    /// move completed or not: the worker keeps the map it was sent).
    pub(super) sent_at: BTreeMap<u64, u64>,
}

impl Shell {
    /// The plan of move `m` as each of its ranks is sent it: the change from the map the
    /// worker was sent last, else the whole map (a joiner, a job just taken back). Then `m`'s
    /// map is the one each was sent.
    pub(super) fn plan_updates(&mut self, m: &crate::decisions::MoveDecision) -> Vec<PlanUpdate> {
        let new_rank: HashMap<u64, usize> = m.ranks.iter().enumerate().map(|(r, &w)| (w, r)).collect();
        // Each change computed once (per map a worker may have), the whole map copied once.
        let mut changes: BTreeMap<u64, Option<Arc<lazarus_plan::ReplicaMapChange>>> = BTreeMap::new();
        let whole = Arc::new(m.change.plan.clone());
        let updates = m
            .ranks
            .iter()
            .enumerate()
            .map(|(rank, w)| {
                let from = self.sent_at.get(w).filter(|_| !m.change.joining.contains(&rank));
                let change = from.and_then(|&e| {
                    let (map, ranks) = self.sent_maps.get(&e)?;
                    let renumber = || ranks.iter().map(|w| new_rank.get(w).copied()).collect();
                    changes.entry(e).or_insert_with(|| map.change_to(&m.change.plan, renumber()).map(Arc::new)).clone()
                });
                match change {
                    Some(change) => PlanUpdate::Changed { change },
                    None => PlanUpdate::Whole { map: whole.clone() },
                }
            })
            .collect();
        // Every worker of the move has its map now; a worker not in it is gone (or standing by).
        self.sent_at = m.ranks.iter().map(|&w| (w, m.change.epoch)).collect();
        self.sent_maps = BTreeMap::from([(m.change.epoch, (m.change.plan.clone(), m.ranks.clone()))]);
        updates
    }

    /// The plan of move `m` as its workers are sent it ([`Shell::plan_updates`]), with the
    /// workers each goes to: those that have the same map share one message.
    pub(super) fn plan_groups(&mut self, m: &crate::decisions::MoveDecision) -> Vec<(PlanUpdate, Vec<usize>)> {
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
    pub(super) fn ended(&mut self, rank: usize, how: &str) {
        self.ends.entry(rank).or_insert_with(|| how.to_string());
        self.first_failure.get_or_insert_with(Instant::now);
    }

    /// " (N ms after the first failure)" once a worker has failed: how long the others took
    /// to notice.
    pub(super) fn since_first_failure(&self) -> String {
        self.first_failure.map(|t| format!(" ({} ms after the first failure)", t.elapsed().as_millis())).unwrap_or_default()
    }

    /// The job stopped: why (with the first failure a worker reported, and how to go on from
    /// the last checkpoint), and how each worker ended.
    pub(super) fn stopped(&self, ctl: &Controller, reason: StopReason) -> TrainOutcome {
        let reason = JobStopped {
            reason,
            first_failure: self.first_error.clone(),
            resume_from: self.last_checkpoint.as_ref().and_then(|p| p.parent()).map(Path::to_path_buf),
        };
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
    pub(super) fn failure_seen(&mut self) {
        self.failure_seen_at(Instant::now());
    }

    /// A failure that began at `at` (earlier than now, for a node found out by its silence).
    pub(super) fn failure_seen_at(&mut self, at: Instant) {
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

    pub(super) fn begin_move(&mut self, m: &crate::decisions::MoveDecision, plan_s: f64, first_epoch: u64) {
        self.failure_seen();
        if let Some(r) = &mut self.recovering {
            r.cause = m.cause;
            // A move that failed half-way and the one after it: the last one's restores count.
            r.restored = m.restored.clone();
            r.rollback_avoided = m.rollback_avoided;
            r.epoch = m.change.epoch - first_epoch;
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
            r.keep_moved = m.change.hold;
            r.resumed = false;
            r.ready.clear();
        }
        self.ranks = m.ranks.clone();
    }

    /// A worker's report as the controller's event (None: nothing for the controller).
    pub(super) fn translate(
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
                Event::Paused { node, epoch, report: StopReport { steps_done, held: None, holds, last: None, snapshots } }
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
    use crate::decisions::MoveDecision;

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

    fn a_move(epoch: u64, ranks: Vec<u64>, plan: ReplicaMap, joining: Vec<usize>) -> MoveDecision {
        MoveDecision {
            ranks,
            change: lazarus_plan::Move { joining, ..lazarus_plan::Move::new(epoch, plan, Vec::new()) },
            commit_to: 5,
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
