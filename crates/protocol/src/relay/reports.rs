//! A worker's report as node agents carry it to the controller: the agent reads the worker's
//! line ([`WorkerEvent`], the launcher protocol on its pipe), and sends it on typed, as the
//! protobuf `WorkerReport`; the controller decodes protobuf only. What comes in is checked here
//! once — a report with no event, a failure of no known kind, a count beyond this machine's
//! words — and refused naming the field.

use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

use lazarus_model::eval::Evaluation;
use lazarus_model::StepReport;
use lazarus_plan::SnapshotHeld;
use lazarus_runtime::SnapshotStepStats;

use crate::messages::{CommittedStep, FailureKind, MoveStats, WorkerEvent};
use crate::proto::{self, worker_report as wr};

use super::{bad, ids, word, BadMessage};

/// What an agent sends for worker `slot`'s `event`. Refused: a benchmark's results, which stay
/// on the machine that ran it (a training job's workers, the only ones agents start, have none).
pub fn to_proto(slot: usize, event: &WorkerEvent) -> Result<proto::WorkerReport, BadMessage> {
    let event = match event {
        WorkerEvent::Listening { addr, epoch } => wr::Event::Listening(wr::Listening { addr: addr.clone(), epoch: *epoch }),
        WorkerEvent::Ready { pid, epoch, moved } => wr::Event::Ready(wr::Ready { pid: *pid, epoch: *epoch, moved: moved.map(move_stats) }),
        WorkerEvent::Heartbeat => wr::Event::Heartbeat(wr::Heartbeat {}),
        WorkerEvent::StepFailed { epoch, steps_done, held, holds, kind, message, last, snapshots } => wr::Event::StepFailed(wr::Stopped {
            epoch: *epoch,
            steps_done: *steps_done,
            held: *held,
            holds: holds.iter().map(|l| ids(l)).collect(),
            snapshots: snapshots.iter().map(snapshot_held).collect(),
            kind: failure_kind(*kind) as i32,
            message: message.clone(),
            last: last.as_ref().map(committed_step),
        }),
        WorkerEvent::Left => wr::Event::Left(wr::Left {}),
        WorkerEvent::Paused { epoch, steps_done, holds, snapshots } => wr::Event::Paused(wr::Stopped {
            epoch: *epoch,
            steps_done: *steps_done,
            holds: holds.iter().map(|l| ids(l)).collect(),
            snapshots: snapshots.iter().map(snapshot_held).collect(),
            ..Default::default()
        }),
        WorkerEvent::Evaluated { step, evaluation } => {
            wr::Event::Evaluated(wr::Evaluated { step: *step, evaluation: Some(evaluation_of(evaluation)) })
        }
        WorkerEvent::Checkpointed { step, path } => {
            wr::Event::Checkpointed(wr::Checkpointed { step: *step, path: path.as_os_str().as_bytes().to_vec() })
        }
        WorkerEvent::Step { report, seconds, wire_bytes, dropped, snapshot } => wr::Event::Step(wr::Step {
            report: Some(step_report(report)),
            seconds: *seconds,
            wire_bytes: *wire_bytes,
            dropped: *dropped,
            snapshot: snapshot.as_ref().map(snapshot_stats),
        }),
        WorkerEvent::Done { checkpoint } => {
            wr::Event::Done(wr::Done { checkpoint: checkpoint.as_ref().map(|p| p.as_os_str().as_bytes().to_vec()) })
        }
        WorkerEvent::Results { .. } => return Err(bad("results", "a benchmark's results are not carried by node agents")),
        WorkerEvent::Failed { kind, message } => {
            wr::Event::Failed(wr::Failed { kind: failure_kind(*kind) as i32, message: message.clone() })
        }
    };
    Ok(proto::WorkerReport { slot: slot as u32, event: Some(event) })
}

/// The worker's event a report from an agent carries, checked.
pub fn from_proto(report: proto::WorkerReport) -> Result<WorkerEvent, BadMessage> {
    Ok(match report.event.ok_or_else(|| bad("event", "missing"))? {
        wr::Event::Listening(l) => WorkerEvent::Listening { addr: l.addr, epoch: l.epoch },
        wr::Event::Ready(r) => WorkerEvent::Ready { pid: r.pid, epoch: r.epoch, moved: r.moved.map(move_stats_of) },
        wr::Event::Heartbeat(_) => WorkerEvent::Heartbeat,
        wr::Event::StepFailed(s) => WorkerEvent::StepFailed {
            epoch: s.epoch,
            steps_done: s.steps_done,
            held: s.held,
            holds: holds_of(&s.holds)?,
            kind: failure_kind_of(s.kind)?,
            message: s.message,
            last: s.last.map(committed_step_of).transpose()?,
            snapshots: s.snapshots.iter().map(snapshot_held_of).collect::<Result<_, _>>()?,
        },
        wr::Event::Left(_) => WorkerEvent::Left,
        wr::Event::Paused(s) => WorkerEvent::Paused {
            epoch: s.epoch,
            steps_done: s.steps_done,
            holds: holds_of(&s.holds)?,
            snapshots: s.snapshots.iter().map(snapshot_held_of).collect::<Result<_, _>>()?,
        },
        wr::Event::Evaluated(e) => WorkerEvent::Evaluated {
            step: e.step,
            evaluation: e.evaluation.map(evaluation_from).transpose()?.ok_or_else(|| bad("evaluation", "missing"))?,
        },
        wr::Event::Checkpointed(c) => WorkerEvent::Checkpointed { step: c.step, path: path_of(c.path) },
        wr::Event::Step(s) => WorkerEvent::Step {
            report: step_report_of(s.report.ok_or_else(|| bad("report", "missing"))?)?,
            seconds: s.seconds,
            wire_bytes: s.wire_bytes,
            dropped: s.dropped,
            snapshot: s.snapshot.map(snapshot_stats_of).transpose()?,
        },
        wr::Event::Done(d) => WorkerEvent::Done { checkpoint: d.checkpoint.map(path_of) },
        wr::Event::Failed(f) => WorkerEvent::Failed { kind: failure_kind_of(f.kind)?, message: f.message },
    })
}

fn path_of(bytes: Vec<u8>) -> PathBuf {
    PathBuf::from(std::ffi::OsString::from_vec(bytes))
}

fn holds_of(layers: &[proto::Ids]) -> Result<Vec<Vec<usize>>, BadMessage> {
    layers.iter().map(|l| l.ids.iter().map(|&e| word("holds", e)).collect()).collect()
}

fn failure_kind(kind: FailureKind) -> proto::FailureKind {
    match kind {
        FailureKind::PeerLost => proto::FailureKind::PeerLost,
        FailureKind::Timeout => proto::FailureKind::Timeout,
        FailureKind::Comm => proto::FailureKind::Comm,
        FailureKind::Config => proto::FailureKind::Config,
        FailureKind::Error => proto::FailureKind::Error,
    }
}

fn failure_kind_of(kind: i32) -> Result<FailureKind, BadMessage> {
    match proto::FailureKind::try_from(kind) {
        Ok(proto::FailureKind::PeerLost) => Ok(FailureKind::PeerLost),
        Ok(proto::FailureKind::Timeout) => Ok(FailureKind::Timeout),
        Ok(proto::FailureKind::Comm) => Ok(FailureKind::Comm),
        Ok(proto::FailureKind::Config) => Ok(FailureKind::Config),
        Ok(proto::FailureKind::Error) => Ok(FailureKind::Error),
        Ok(proto::FailureKind::Unspecified) | Err(_) => Err(bad("kind", format!("{kind} is no failure kind"))),
    }
}

fn move_stats(m: MoveStats) -> proto::MoveStats {
    proto::MoveStats {
        rebuild_s: m.rebuild_s,
        transfer_s: m.transfer_s,
        bytes_received: m.bytes_received,
        gpu_used_bytes: m.gpu_used_bytes,
    }
}

fn move_stats_of(m: proto::MoveStats) -> MoveStats {
    MoveStats { rebuild_s: m.rebuild_s, transfer_s: m.transfer_s, bytes_received: m.bytes_received, gpu_used_bytes: m.gpu_used_bytes }
}

fn snapshot_held(s: &SnapshotHeld) -> proto::SnapshotHeld {
    proto::SnapshotHeld {
        layer: s.layer as u64,
        expert: s.expert as u64,
        step: s.step,
        tokens_lost: s.tokens_lost,
        held_step_tokens: s.held_step_tokens,
    }
}

fn snapshot_held_of(s: &proto::SnapshotHeld) -> Result<SnapshotHeld, BadMessage> {
    Ok(SnapshotHeld {
        layer: word("snapshots.layer", s.layer)?,
        expert: word("snapshots.expert", s.expert)?,
        step: s.step,
        tokens_lost: s.tokens_lost,
        held_step_tokens: s.held_step_tokens,
    })
}

fn step_report(r: &StepReport) -> proto::StepReport {
    proto::StepReport {
        step: r.step,
        loss: r.loss,
        aux_loss: r.aux_loss,
        tokens: r.tokens,
        lr: r.lr,
        grad_norm: r.grad_norm,
        expert_load: r.expert_load.iter().map(|l| proto::Ids { ids: l.clone() }).collect(),
        dropped: r.dropped,
    }
}

fn step_report_of(r: proto::StepReport) -> Result<StepReport, BadMessage> {
    Ok(StepReport {
        step: r.step,
        loss: r.loss,
        aux_loss: r.aux_loss,
        tokens: r.tokens,
        lr: r.lr,
        grad_norm: r.grad_norm,
        expert_load: r.expert_load.into_iter().map(|l| l.ids).collect(),
        dropped: r.dropped,
    })
}

fn committed_step(c: &CommittedStep) -> proto::CommittedStep {
    proto::CommittedStep { report: Some(step_report(&c.report)), seconds: c.seconds }
}

fn committed_step_of(c: proto::CommittedStep) -> Result<CommittedStep, BadMessage> {
    Ok(CommittedStep { report: step_report_of(c.report.ok_or_else(|| bad("last.report", "missing"))?)?, seconds: c.seconds })
}

fn evaluation_of(e: &Evaluation) -> proto::Evaluation {
    proto::Evaluation { windows: e.windows as u64, tokens: e.tokens, loss: e.loss, perplexity: e.perplexity }
}

fn evaluation_from(e: proto::Evaluation) -> Result<Evaluation, BadMessage> {
    Ok(Evaluation { windows: word("evaluation.windows", e.windows)?, tokens: e.tokens, loss: e.loss, perplexity: e.perplexity })
}

fn snapshot_stats(s: &SnapshotStepStats) -> proto::SnapshotStepStats {
    proto::SnapshotStepStats {
        budget_bytes: s.budget_bytes,
        cap_bytes: s.cap_bytes,
        late_ranks: s.late_ranks as u64,
        cpu_share: s.cpu_share,
        snapshot_cpu_s: s.snapshot_cpu_s,
        process_cpu_s: s.process_cpu_s,
        experts: s.experts as u64,
        bytes: s.bytes,
        moetion_bytes: s.moetion_bytes,
        at_risk_bytes: s.at_risk_bytes,
        all_bytes: s.all_bytes,
    }
}

fn snapshot_stats_of(s: proto::SnapshotStepStats) -> Result<SnapshotStepStats, BadMessage> {
    Ok(SnapshotStepStats {
        budget_bytes: s.budget_bytes,
        cap_bytes: s.cap_bytes,
        late_ranks: word("snapshot.late_ranks", s.late_ranks)?,
        cpu_share: s.cpu_share,
        snapshot_cpu_s: s.snapshot_cpu_s,
        process_cpu_s: s.process_cpu_s,
        experts: word("snapshot.experts", s.experts)?,
        bytes: s.bytes,
        moetion_bytes: s.moetion_bytes,
        at_risk_bytes: s.at_risk_bytes,
        all_bytes: s.all_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(step: u64) -> StepReport {
        StepReport {
            step,
            loss: 2.5,
            aux_loss: 0.01,
            tokens: 4096,
            lr: 3e-4,
            grad_norm: 0.7,
            expert_load: vec![vec![1, 2, 3], vec![4, 5, 6]],
            dropped: 1,
        }
    }

    /// One event of every kind, with every field set to something other than its default.
    fn every_event() -> Vec<WorkerEvent> {
        let snapshots = vec![SnapshotHeld { layer: 1, expert: 3, step: 40, tokens_lost: 900, held_step_tokens: 12 }];
        let stats = SnapshotStepStats {
            budget_bytes: 1,
            cap_bytes: 2,
            late_ranks: 3,
            cpu_share: 0.25,
            snapshot_cpu_s: 0.5,
            process_cpu_s: 2.0,
            experts: 4,
            bytes: 5,
            moetion_bytes: 6,
            at_risk_bytes: 7,
            all_bytes: 8,
        };
        vec![
            WorkerEvent::Listening { addr: "10.0.0.7:4100".into(), epoch: 3 },
            WorkerEvent::Ready {
                pid: 77,
                epoch: 4,
                moved: Some(MoveStats { rebuild_s: 0.1, transfer_s: 0.2, bytes_received: 3, gpu_used_bytes: Some(9) }),
            },
            WorkerEvent::Ready { pid: 78, epoch: 4, moved: None },
            WorkerEvent::Heartbeat,
            WorkerEvent::StepFailed {
                epoch: 5,
                steps_done: 41,
                held: Some(42),
                holds: vec![vec![0, 2], vec![], vec![7]],
                kind: FailureKind::PeerLost,
                message: "rank 2 lost".into(),
                last: Some(CommittedStep { report: report(41), seconds: 0.3 }),
                snapshots: snapshots.clone(),
            },
            WorkerEvent::Left,
            WorkerEvent::Paused { epoch: 6, steps_done: 50, holds: vec![vec![1]], snapshots },
            WorkerEvent::Evaluated { step: 50, evaluation: Evaluation { windows: 8, tokens: 1024, loss: 2.1, perplexity: 8.2 } },
            WorkerEvent::Checkpointed { step: 50, path: PathBuf::from("/runs/a/ck/step-50") },
            WorkerEvent::Step { report: report(51), seconds: 0.31, wire_bytes: 1 << 20, dropped: 2, snapshot: Some(stats) },
            WorkerEvent::Step { report: report(52), seconds: 0.31, wire_bytes: 0, dropped: 0, snapshot: None },
            WorkerEvent::Done { checkpoint: Some(PathBuf::from(std::ffi::OsString::from_vec(b"/ck/\xff".to_vec()))) },
            WorkerEvent::Done { checkpoint: None },
            WorkerEvent::Failed { kind: FailureKind::Config, message: "no such file".into() },
        ]
    }

    #[test]
    fn every_report_comes_back_as_it_was_sent() {
        for event in every_event() {
            let sent = to_proto(3, &event).unwrap();
            assert_eq!(sent.slot, 3);
            let bytes = prost::Message::encode_to_vec(&sent);
            let got = from_proto(prost::Message::decode(&bytes[..]).unwrap()).unwrap();
            // WorkerEvent has no PartialEq (its results are JSON): compare what they show.
            assert_eq!(format!("{got:?}"), format!("{event:?}"));
        }
        let results = WorkerEvent::Results { results: serde_json::json!({"tokens_per_s": 1234.5}) };
        assert_eq!(to_proto(3, &results).unwrap_err().field, "results", "a benchmark's results stay on its machine");
    }

    #[test]
    fn a_report_that_is_not_one_is_refused_naming_its_field() {
        let refused = |r: proto::WorkerReport| from_proto(r).unwrap_err().field;
        assert_eq!(refused(proto::WorkerReport { slot: 0, event: None }), "event");
        let failed = |kind: i32| wr::Event::Failed(wr::Failed { kind, message: String::new() });
        assert_eq!(refused(proto::WorkerReport { slot: 0, event: Some(failed(0)) }), "kind");
        assert_eq!(refused(proto::WorkerReport { slot: 0, event: Some(failed(99)) }), "kind");
        let step = wr::Event::Step(wr::Step { report: None, ..Default::default() });
        assert_eq!(refused(proto::WorkerReport { slot: 0, event: Some(step) }), "report");
        let evaluated = wr::Event::Evaluated(wr::Evaluated { step: 1, evaluation: None });
        assert_eq!(refused(proto::WorkerReport { slot: 0, event: Some(evaluated) }), "evaluation");
    }
}
