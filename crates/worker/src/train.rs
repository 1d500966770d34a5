//! A training worker's life: train; on a pause or a failure, say where it stopped and wait for
//! the controller's move; carry the move out (a rollback rebuilt from its checkpoint, the
//! rendezvous, the experts moved); train again — until the job is done or the node drained.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lazarus_comm::{Group, TcpTransport};
use lazarus_plan::PlanUpdate;
use lazarus_runtime::{DispatchMode, FaultHook, FaultPoint, Reconfiguration, Worker, WorkerOptions};

use super::{
    bind_ip, failure_kind, fault_hook, join_unless, listen_hold, recoverable, rendezvous, start_heartbeats, EventSink, Inbox, Net,
};
use lazarus_protocol::{parse_secret, CommittedStep, ControlError, LauncherMessage, MoveStats, TrainJob, WorkerEvent, WorkerSpec};

/// How a run of steps ended without an error.
enum Ended {
    /// The job is done (rank 0: its final checkpoint).
    Done(Option<PathBuf>),
    /// Every rank stopped after the same step, as the controller asked.
    Paused,
    /// A worker that joins: it has not trained yet.
    StandingBy,
    /// Drained: what only this node held went to the others in the move.
    Left,
}

/// How the last run of steps (or move) ended: a failure is one the controller may recover.
type Outcome = Result<Ended, ControlError>;

/// A training worker's life; its last report: `Done` (with rank 0's final checkpoint), or `Left`
/// (its node was drained). Train; on a pause or a failure, say where this worker stopped and
/// wait for the controller's move; carry it out; train again.
pub(super) fn train_worker(sink: &Arc<EventSink>) -> Result<WorkerEvent, ControlError> {
    // Heartbeats from the moment the spec is read: building the model can take seconds.
    let (spec, inbox, t): (WorkerSpec<TrainJob>, _, _) = join_unless(
        sink,
        |spec: &WorkerSpec<TrainJob>| {
            let h = spec.job.heartbeat_s;
            if h > 0.0 && h.is_finite() {
                start_heartbeats(sink, Duration::from_secs_f64(h.max(0.01)));
            }
        },
        |spec| spec.job.standby,
    )?;
    let mut w = TrainingWorker::new(spec, inbox, t, sink)?;
    let mut outcome = match w.t.is_some() {
        true => {
            w.sink.send(WorkerEvent::Ready { pid: std::process::id(), epoch: w.epoch, moved: None });
            w.train()
        }
        false => Ok(Ended::StandingBy),
    };
    loop {
        let joining = match outcome {
            Ok(Ended::Done(saved)) => {
                w.shutdown();
                return Ok(WorkerEvent::Done { checkpoint: saved });
            }
            Ok(Ended::Left) => return Ok(WorkerEvent::Left),
            Ok(Ended::Paused) => {
                w.paused()?;
                false
            }
            Ok(Ended::StandingBy) => true,
            Err(failure) => {
                if !recoverable(&failure) || w.job.static_ep {
                    return Err(failure);
                }
                w.failed(failure)?;
                false
            }
        };
        let (to, rollback) = w.next_move(joining)?;
        outcome = w.carry_out(to, rollback)?;
    }
}

/// A training worker process's state across its moves.
struct TrainingWorker<'a> {
    sink: &'a EventSink,
    inbox: Inbox,
    /// The job as the spec gave it (its settings stay; its plan is the start's).
    job: TrainJob,
    cfg: lazarus_model::TrainConfig,
    /// This worker's id in the job (its first rank; a joiner's is its spec's): what finds its
    /// rank in each move.
    me: u64,
    timeout: Duration,
    secret: u128,
    bind: IpAddr,
    encrypt: bool,
    mode: DispatchMode,
    device: candle_core::Device,
    fault: Option<FaultHook>,
    worker: Worker,
    /// The map of the last plan this worker was sent (a move comes as the change from it,
    /// whether the move before completed here or not). A worker standing by has none.
    last_map: Option<lazarus_plan::ReplicaMap>,
    /// The current epoch's transport (None: standing by, not yet in a move).
    t: Option<TcpTransport>,
    epoch: u64,
    group: Group,
    profiler: Option<crate::step_profile::StepProfiler>,
}

impl<'a> TrainingWorker<'a> {
    fn new(spec: WorkerSpec<TrainJob>, inbox: Inbox, t: Option<TcpTransport>, sink: &'a EventSink) -> Result<Self, ControlError> {
        let secret = parse_secret(&spec.secret).unwrap_or_default();
        let bind = bind_ip(spec.bind.as_deref())?;
        let fault = fault_hook(spec.rank, &spec.job.faults)?;
        let job = spec.job;
        let mode = match (job.static_ep, job.deterministic) {
            (true, _) => DispatchMode::StaticPadded,
            (false, true) => DispatchMode::Deterministic,
            (false, false) => DispatchMode::Balanced,
        };
        // This process's GPU (or the CPU): its index among the workers its launcher started
        // picks it.
        let local = std::env::var(lazarus_protocol::LOCAL_WORKER_ENV).ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(spec.rank);
        let device = lazarus_model::device::for_worker(&job.device, local)
            .map_err(|e| ControlError::invalid(lazarus_protocol::Setting::Device, e.to_string()))?;
        let timeout = Duration::from_secs_f64(spec.timeout_s);
        let worker = if job.standby {
            Worker::standby(job.config.clone(), mode, timeout, device.clone())?
        } else {
            let options = WorkerOptions { plan: job.plan.clone(), mode, timeout, device: device.clone() };
            Worker::new(job.config.clone(), options, spec.rank, spec.world, job.resume.as_deref())?
        };
        let mut w = TrainingWorker {
            sink,
            inbox,
            cfg: job.config.clone(),
            me: spec.rank as u64,
            timeout,
            secret,
            bind,
            encrypt: spec.encrypt,
            mode,
            profiler: crate::step_profile::StepProfiler::from_env(&device),
            device,
            fault,
            worker,
            last_map: (!job.standby).then(|| job.plan.clone()),
            t,
            epoch: spec.epoch,
            group: Group::world(spec.world),
            job,
        };
        w.fit_worker();
        Ok(w)
    }

    /// The job's settings on a worker just built (at the start, or rebuilt for a rollback).
    fn fit_worker(&mut self) {
        self.worker.set_snapshots(self.job.snapshots);
        self.worker.set_shard_sequences(self.job.shard_sequences.unwrap_or(1));
        self.worker.set_fault_hook(self.fault.clone());
        self.worker.set_pause_signal(Some(self.inbox.pause.clone()));
    }

    /// Steps on the current transport until the run is done or paused.
    fn train(&mut self) -> Outcome {
        let Some(t) = self.t.as_mut() else { return Ok(Ended::StandingBy) };
        let run = RunSettings { cfg: &self.cfg, held_out: self.job.held_out.as_ref(), sink: self.sink, finish: &self.inbox.finish };
        train_until_done(&mut self.worker, t, &mut self.group, &run, &mut self.profiler).map_err(ControlError::from)
    }

    /// A goodbye to the peers (not a failure).
    fn shutdown(&mut self) {
        if let Some(t) = self.t.as_mut() {
            t.shutdown();
        }
    }

    /// Every rank stopped after this step: a goodbye to the peers, and where this worker is.
    fn paused(&mut self) -> Result<(), ControlError> {
        self.shutdown();
        self.sink.send(WorkerEvent::Paused {
            epoch: self.epoch,
            steps_done: self.worker.steps_done(),
            holds: self.worker.resident_experts()?,
            snapshots: self.worker.held_snapshots(),
        });
        Ok(())
    }

    /// Say where this worker stopped, with what it holds, for the controller's decision.
    fn failed(&mut self, failure: ControlError) -> Result<(), ControlError> {
        let worker = &mut self.worker;
        if let Some(t) = self.t.as_mut() {
            worker.keep_arrived_snapshots(t);
        }
        self.sink.send(WorkerEvent::StepFailed {
            epoch: self.epoch,
            steps_done: worker.steps_done(),
            held: worker.held_step(),
            holds: worker.resident_experts()?,
            kind: failure_kind(&failure),
            message: failure.to_string(),
            last: worker.last_committed().map(|(report, seconds)| CommittedStep { report: report.clone(), seconds: *seconds }),
            snapshots: worker.held_snapshots(),
        });
        if let Some(t) = self.t.as_mut() {
            t.abort_connections();
        }
        Ok(())
    }

    /// Wait for the controller's next move (this node's transfers of it come just before the
    /// order); a move of survivors commits or drops the held step to the move's step first.
    /// The move, and for a rollback the step it goes back to (None: the job's start).
    fn next_move(&mut self, joining: bool) -> Result<(Reconfiguration<PlanUpdate>, Option<Option<u64>>), ControlError> {
        let mut ahead = lazarus_protocol::TransfersAhead::default();
        loop {
            match self.inbox.next(Duration::from_secs(3600))? {
                LauncherMessage::Transfers { epoch, transfers } => ahead.add(epoch, transfers),
                LauncherMessage::Reconfigure { commit_to, to } => {
                    let to = ahead.complete(to).for_worker(self.me).map_err(|e| ControlError::bad_message("reconfiguration", e))?;
                    if to.change.joining.contains(&to.rank) {
                        // It takes the job's state in the move; nothing of its own to commit.
                        return Ok((to, None));
                    }
                    if joining {
                        return Err(ControlError::bad_message(
                            "reconfiguration",
                            "a worker standing by is not among the joiners of the move",
                        ));
                    }
                    self.commit_to(commit_to)?;
                    return Ok((to, None));
                }
                LauncherMessage::Rollback { to_step, to } => {
                    return Ok((
                        ahead.complete(to).for_worker(self.me).map_err(|e| ControlError::bad_message("rollback", e))?,
                        Some(to_step),
                    ))
                }
                // A rendezvous given up, or one called off: nothing to do while waiting.
                LauncherMessage::Addrs { .. }
                | LauncherMessage::Abandon { .. }
                | LauncherMessage::Fence { .. }
                | LauncherMessage::Pause { .. }
                | LauncherMessage::Finish { .. } => continue,
            }
        }
    }

    /// Commit the held step, or drop it, so that this worker is at step `commit_to`.
    fn commit_to(&mut self, commit_to: u64) -> Result<(), ControlError> {
        if self.worker.steps_done() < commit_to {
            self.worker.commit_held()?;
        } else {
            self.worker.drop_held();
        }
        if self.worker.steps_done() != commit_to {
            return Err(ControlError::bad_message(
                "reconfiguration",
                format!("commit to step {commit_to}, this worker is at {}", self.worker.steps_done()),
            ));
        }
        Ok(())
    }

    /// Carry out move `to` (a rollback to `rollback`'s step if given): the new epoch's plan,
    /// a worker rebuilt from the checkpoint for a rollback, the rendezvous, the experts moved;
    /// then train on (or hold, or leave). A failure in the rendezvous or the move is the
    /// outcome (the controller recovers it); one that makes the move meaningless ends the
    /// worker.
    fn carry_out(&mut self, to: Reconfiguration<PlanUpdate>, rollback: Option<Option<u64>>) -> Result<Outcome, ControlError> {
        // The plan as it came (whole, or changed from the one this worker has).
        let to =
            to.map_plan(|p| p.resolve(self.last_map.as_ref())).map_err(|e| ControlError::bad_message("reconfiguration", e.to_string()))?;
        self.last_map = Some(to.change.plan.clone());
        // From here on this worker is in the new epoch, whether the move completes or not.
        self.epoch = to.change.epoch;
        let started = Instant::now();
        if let Some(to_step) = rollback {
            // The checkpoint of exactly that step (not whatever is newest), or the job's start.
            let from = match (to_step, &self.cfg.checkpoint_dir) {
                (Some(s), Some(dir)) => Some(dir.join(format!("step-{s:08}"))),
                _ => self.job.resume.clone(),
            };
            let options =
                WorkerOptions { plan: to.change.plan.clone(), mode: self.mode, timeout: self.timeout, device: self.device.clone() };
            self.worker = Worker::new(self.cfg.clone(), options, to.rank, to.world, from.as_deref())?;
            self.fit_worker();
        }
        if let Some(f) = &self.fault {
            f(FaultPoint::Rendezvous, self.worker.steps_done());
        }
        let net = Net { timeout: self.timeout, secret: self.secret, bind: self.bind, encrypt: self.encrypt, hold: listen_hold() };
        let fresh = match rendezvous(self.sink, &self.inbox, to.rank, to.world, to.change.epoch, net) {
            Ok(fresh) => fresh,
            Err(e) => return Ok(Err(e)),
        };
        let t = self.t.insert(fresh);
        self.group = Group::world(to.world);
        let rebuilt = Instant::now();
        let moved = match rollback {
            None => match self.worker.reconfigure(&to, t, &mut self.group) {
                Ok(m) => m,
                Err(e) => return Ok(Err(e.into())),
            },
            Some(_) => Default::default(),
        };
        let stats = MoveStats {
            rebuild_s: (rebuilt - started).as_secs_f64(),
            transfer_s: rebuilt.elapsed().as_secs_f64(),
            bytes_received: moved.bytes_received,
            gpu_used_bytes: lazarus_model::device::gpu_memory(self.worker.trainer.model.device()).map(|m| m.used),
        };
        self.sink.send(WorkerEvent::Ready { pid: std::process::id(), epoch: self.epoch, moved: Some(stats) });
        if to.change.leaving.contains(&to.rank) {
            // Drained: what only this node held went to the others in the move.
            t.shutdown();
            return Ok(Ok(Ended::Left));
        }
        Ok(if to.change.hold { Ok(Ended::Paused) } else { self.train() })
    }
}

/// What a worker's training loop goes by, for the whole job.
struct RunSettings<'a> {
    cfg: &'a lazarus_model::TrainConfig,
    held_out: Option<&'a lazarus_protocol::HeldOut>,
    sink: &'a EventSink,
    /// Set when the job is asked to stop (every rank finishes after the same step).
    finish: &'a AtomicBool,
}

/// Steps until the run is done, reporting each (rank 0) and writing checkpoints as configured;
/// the final checkpoint too (its path on rank 0) — or until every rank stops after the same
/// step because the controller asked for a pause.
fn train_until_done(
    worker: &mut Worker,
    t: &mut TcpTransport,
    group: &mut Group,
    run: &RunSettings,
    profiler: &mut Option<crate::step_profile::StepProfiler>,
) -> Result<Ended, lazarus_runtime::RuntimeError> {
    let RunSettings { cfg, held_out, sink, finish } = run;
    while !worker.done() {
        let t0 = Instant::now();
        if let Some(p) = profiler.as_ref() {
            p.start();
        }
        let r = {
            let _step = lazarus_model::profile::phase("step");
            worker.step(t, group)?
        };
        let seconds = t0.elapsed().as_secs_f64();
        if let Some(p) = profiler.as_mut() {
            p.finish(worker.rank(), r.report.step, seconds);
        }
        // After the commit: this step's snapshots go out (the last step's come in). A failure
        // here leaves the step committed everywhere; the controller logs it from a survivor.
        // None after the last step or before a pause: every rank ends its transport there, and
        // a snapshot would be sent to a peer already gone (the final checkpoint, or the move,
        // keeps the state instead).
        let snapshot = if worker.snapshots_on() && !worker.done() && !r.pause { Some(worker.snapshot_round(t, &r)?) } else { None };
        if worker.rank() == 0 {
            sink.step(r.report.clone(), seconds, r.wire_bytes, snapshot);
        }
        if let Some(dir) = &cfg.checkpoint_dir {
            if cfg.checkpoint_every > 0 && r.report.step.is_multiple_of(cfg.checkpoint_every) && !worker.done() {
                if let Some(path) = worker.save_checkpoint(t, group, dir)? {
                    sink.send(WorkerEvent::Checkpointed { step: r.report.step, path });
                }
            }
        }
        // Every rank evaluates after the same steps (the held-out loss goes to the launcher
        // from rank 0). A failure here leaves the step committed; its evaluation is lost.
        if let Some(h) = held_out.filter(|h| h.due(r.report.step, worker.done())) {
            let evaluation = worker.evaluate(t, group, &h.tokens, Some(h.windows))?;
            if worker.rank() == 0 {
                sink.send(WorkerEvent::Evaluated { step: r.report.step, evaluation });
            }
        }
        if r.pause && !worker.done() {
            if finish.load(Ordering::Relaxed) {
                // Asked to stop: every rank paused after this step, so all write it together.
                break;
            }
            return Ok(Ended::Paused);
        }
    }
    match &cfg.checkpoint_dir {
        Some(dir) => {
            let saved = worker.save_checkpoint(t, group, dir)?;
            if let Some(path) = &saved {
                sink.send(WorkerEvent::Checkpointed { step: worker.steps_done(), path: path.clone() });
            }
            Ok(Ended::Done(saved))
        }
        None => Ok(Ended::Done(None)),
    }
}
