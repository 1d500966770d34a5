//! The job's live dashboard (`--dashboard-listen ADDR`): one page, served on the same hyper
//! stack as `/metrics` (`metrics/server.rs`), that a browser keeps up to date from a stream of
//! server-sent events — the members by node and state, the epoch and step, each expert's
//! replicas on each GPU beside its measured load, the loss, held-out loss, tokens/s and MoE
//! bytes over steps, and the timeline of what happened (losses, recoveries with their time,
//! joins, drains, rebalances, rollbacks, snapshot restores, checkpoints). Read-only, for
//! holders of the job's status token only; everything it needs is in the binary (`page.html`).
//!
//! [`History`] is what the page is drawn from, kept as the job's events come: a pure value,
//! recorded in the same place the metrics are, and turned into the page's JSON by
//! [`History::state`] with the controller's last published status.

mod serve;

pub use serve::{Dashboard, DASHBOARD_PATH};

use std::collections::VecDeque;

use serde_json::{json, Value};

use crate::events::TrainEvent;
use lazarus_protocol::proto::StatusReply;

/// The most points of a curve kept (a longer run keeps every other one, then every fourth…).
const MOST_POINTS: usize = 2048;
/// The most timeline entries kept (the newest).
const MOST_EVENTS: usize = 500;
/// The most GPUs and experts a layer's placement is drawn with; above, neighbouring GPUs (or
/// experts) are drawn as one column (row): a thousand nodes of eight fit on no screen, and a
/// page's state stays a few hundred kilobytes for the largest models.
const MOST_COLUMNS: usize = 128;
const MOST_ROWS: usize = 64;

/// Each layer of `placement` (the replicas of each expert on each GPU) as the page draws it:
/// neighbouring GPUs summed into at most [`MOST_COLUMNS`] columns, experts into at most
/// [`MOST_ROWS`] rows.
pub fn drawn_placement(placement: &[Vec<Vec<u32>>]) -> Value {
    let layers: Vec<Value> = placement
        .iter()
        .enumerate()
        .map(|(l, experts)| {
            let ranks = experts.first().map_or(0, Vec::len);
            let (gpus, per_row) = (ranks.div_ceil(MOST_COLUMNS).max(1), experts.len().div_ceil(MOST_ROWS).max(1));
            let replicas: Vec<Vec<u32>> = experts
                .chunks(per_row)
                .map(|rows| {
                    (0..ranks.div_ceil(gpus))
                        .map(|c| rows.iter().map(|row| row[c * gpus..(c * gpus + gpus).min(ranks)].iter().sum::<u32>()).sum())
                        .collect()
                })
                .collect();
            json!({"layer": l, "gpus_per_column": gpus, "experts_per_row": per_row, "replicas": replicas})
        })
        .collect();
    Value::Array(layers)
}

/// One curve over steps, thinned evenly as it grows so that it keeps at most [`MOST_POINTS`].
#[derive(Debug, Default, Clone)]
struct Curve {
    points: Vec<(u64, f64)>,
    /// Keep one point of every `stride` offered.
    stride: u64,
    offered: u64,
}

impl Curve {
    fn push(&mut self, step: u64, value: f64) {
        if !value.is_finite() {
            return;
        }
        self.stride = self.stride.max(1);
        // A rollback goes back in steps: the curve is cut back to where training is again.
        while self.points.last().is_some_and(|p| p.0 >= step) {
            self.points.pop();
        }
        if self.offered.is_multiple_of(self.stride) {
            self.points.push((step, value));
        }
        self.offered += 1;
        if self.points.len() > MOST_POINTS {
            self.points = self.points.iter().step_by(2).copied().collect();
            self.stride *= 2;
        }
    }

    fn json(&self) -> Value {
        Value::Array(self.points.iter().map(|&(s, v)| json!([s, v])).collect())
    }
}

/// What the page is drawn from, as the job's events come.
#[derive(Debug, Default)]
pub struct History {
    loss: Curve,
    eval_loss: Curve,
    tokens_per_s: Curve,
    moe_wire_mb: Curve,
    /// Each expert's tokens in the last step, per MoE layer.
    last_loads: Vec<Vec<u64>>,
    timeline: VecDeque<Value>,
    /// Bumped by every change: the stream sends the page again when it moves.
    version: u64,
}

impl History {
    /// Take in one of the job's events, at `unix_ms`.
    pub fn record(&mut self, event: &TrainEvent, unix_ms: u64) {
        let said = |kind: &str, step: Option<u64>, text: String, cost_s: Option<f64>| json!({"at_ms": unix_ms, "kind": kind, "step": step, "text": text, "cost_s": cost_s});
        let entry = match event {
            TrainEvent::Step { report, seconds, moe_wire_bytes, .. } => {
                self.loss.push(report.step, report.loss);
                if *seconds > 0.0 {
                    self.tokens_per_s.push(report.step, report.tokens as f64 / seconds);
                }
                if let Some(b) = moe_wire_bytes {
                    self.moe_wire_mb.push(report.step, *b as f64 / 1e6);
                }
                self.last_loads.clone_from(&report.expert_load);
                None
            }
            TrainEvent::Started => Some(said("started", None, "every worker ready: training".into(), None)),
            TrainEvent::Lost { worker, why } => Some(said("lost", None, format!("worker {worker} lost: {why}"), None)),
            TrainEvent::Reconfigured(r) => {
                let lost = if r.lost.is_empty() { String::new() } else { format!(", lost {:?}", r.lost) };
                let joined = if r.joined.is_empty() { String::new() } else { format!(", joined {:?}", r.joined) };
                let restored =
                    if r.restored.is_empty() { String::new() } else { format!(", {} experts restored from snapshots", r.restored.len()) };
                let text = format!(
                    "{} to epoch {} at step {}{lost}{joined}{restored}: {} workers; {:.3} s (detect {:.3}, plan {:.3}, transfer {:.3} of {:.2} MB, rebuild {:.3})",
                    r.cause.as_str(),
                    r.epoch,
                    r.step,
                    r.workers,
                    r.recovery_s,
                    r.detect_s,
                    r.plan_s,
                    r.transfer_s,
                    r.transfer_bytes as f64 / 1e6,
                    r.rebuild_s
                );
                Some(said(r.cause.as_str(), Some(r.step), text, Some(r.recovery_s)))
            }
            TrainEvent::Checkpointed { step, path } => {
                Some(said("checkpoint", Some(*step), format!("checkpoint {}", path.display()), None))
            }
            TrainEvent::Evaluated { step, evaluation } => {
                self.eval_loss.push(*step, evaluation.loss);
                Some(said(
                    "eval",
                    Some(*step),
                    format!("held-out loss {:.4}, perplexity {:.2}", evaluation.loss, evaluation.perplexity),
                    None,
                ))
            }
            TrainEvent::Rebalance(d) => {
                let text = format!(
                    "rebalance weighed at step {}: {} (imbalance {:.2} → {:.2}; gain {:.3} s over {} steps against {})",
                    d.step,
                    d.decision,
                    d.imbalance_before,
                    d.imbalance_after,
                    d.gain_s,
                    d.horizon_steps,
                    d.cost_said()
                );
                Some(said("weighed", Some(d.step), text, None))
            }
            TrainEvent::Leaving { workers, reason } => Some(said("notice", None, format!("workers {workers:?} leave: {reason}"), None)),
            TrainEvent::WorkersJoined { workers } => Some(said("joined", None, format!("workers {workers:?} joined, standing by"), None)),
            TrainEvent::AgentJoined { agent, host, gpus, .. } => {
                Some(said("agent", None, format!("agent {agent} attached from {host} with {gpus} GPUs"), None))
            }
            TrainEvent::Ready { .. } | TrainEvent::Serving { .. } | TrainEvent::Metrics { .. } | TrainEvent::Dashboard { .. } => None,
        };
        if let Some(e) = entry {
            self.timeline.push_back(e);
            if self.timeline.len() > MOST_EVENTS {
                self.timeline.pop_front();
            }
        }
        self.version += 1;
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// The page's JSON: this history with the controller's last published `status`, and the
    /// placement its plan gives as [`drawn_placement`] draws it (None: the page keeps the one
    /// it has — a stream sends it when the plan changes, not every time).
    pub fn state(&self, status: &StatusReply, placement: Option<Value>) -> Value {
        let members: Vec<Value> = status
            .members
            .iter()
            .map(|m| json!({"node": m.node, "rank": m.rank, "state": m.state, "alive": m.alive, "silent_s": m.silent_s, "epoch": m.epoch}))
            .collect();
        json!({
            "job_id": status.job_id,
            "epoch": status.epoch,
            "phase": status.phase,
            "step": status.step,
            "last_checkpoint": status.last_checkpoint,
            "members": members,
            "placement": placement,
            "loads": self.last_loads,
            "loss": self.loss.json(),
            "eval_loss": self.eval_loss.json(),
            "tokens_per_s": self.tokens_per_s.json(),
            "moe_wire_mb": self.moe_wire_mb.json(),
            "timeline": self.timeline.iter().rev().cloned().collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lazarus_model::StepReport;

    fn step(n: u64, loss: f64) -> TrainEvent {
        let report =
            StepReport { step: n, loss, aux_loss: 0.0, tokens: 100, lr: 1e-3, grad_norm: 1.0, expert_load: vec![vec![3, 1]], dropped: 0 };
        TrainEvent::Step { report, seconds: 0.5, dropped: 0, moe_wire_bytes: Some(2_000_000), snapshot: None }
    }

    #[test]
    fn curves_keep_a_bounded_even_sample_and_go_back_with_a_rollback() {
        let mut c = Curve::default();
        for s in 1..=10_000 {
            c.push(s, s as f64);
        }
        assert!(c.points.len() <= MOST_POINTS && c.points.len() > MOST_POINTS / 2, "{}", c.points.len());
        let gaps: Vec<u64> = c.points.windows(2).map(|w| w[1].0 - w[0].0).collect();
        assert!(gaps.iter().all(|&g| g == gaps[0]), "evenly spaced");
        c.push(5, 1.0);
        assert!(c.points.last() == Some(&(5, 1.0)) && c.points.iter().all(|p| p.0 <= 5), "cut back to the rollback's step");
        c.push(6, f64::NAN);
        assert_eq!(c.points.last(), Some(&(5, 1.0)), "a NaN is not drawn");
    }

    #[test]
    fn the_state_has_the_members_the_placement_the_curves_and_the_timeline_newest_first() {
        let mut h = History::default();
        h.record(&TrainEvent::Started, 1);
        h.record(&step(1, 5.0), 2);
        h.record(&step(2, 4.0), 3);
        h.record(&TrainEvent::Lost { worker: 1, why: "killed by signal 9".into() }, 4);
        assert_eq!(h.version(), 4);
        let status = StatusReply {
            job_id: "job-7".into(),
            epoch: 1,
            step: 2,
            members: vec![lazarus_protocol::proto::Member {
                node: 0,
                alive: true,
                rank: Some(0),
                state: "member".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        // One layer, 2 experts over 200 GPUs: drawn as 100 columns of 2.
        let placement = vec![vec![vec![1u32; 200], vec![0u32; 200]]];
        let s = h.state(&status, Some(drawn_placement(&placement)));
        assert_eq!(s["job_id"], "job-7");
        assert_eq!(s["members"][0]["state"], "member");
        assert_eq!(s["loss"], json!([[1, 5.0], [2, 4.0]]));
        assert_eq!(s["moe_wire_mb"], json!([[1, 2.0], [2, 2.0]]));
        assert_eq!(s["tokens_per_s"][0], json!([1, 200.0]));
        assert_eq!(s["placement"][0]["gpus_per_column"], 2);
        assert_eq!(s["placement"][0]["replicas"][0].as_array().unwrap().len(), 100);
        assert_eq!(s["placement"][0]["replicas"][0][0], 2);
        assert_eq!(s["loads"], json!([[3, 1]]));
        assert!(h.state(&status, None)["placement"].is_null(), "kept by the page");
        // 200 experts over 1,000 GPUs: 50 rows of 4 experts, 125 columns of 8 GPUs; every
        // replica counted once.
        let big = vec![(0..200).map(|e| (0..1000).map(|g| u32::from((e + g) % 7 == 0)).collect()).collect::<Vec<Vec<u32>>>()];
        let drawn = drawn_placement(&big);
        let rows = drawn[0]["replicas"].as_array().unwrap();
        assert_eq!((rows.len(), rows[0].as_array().unwrap().len(), drawn[0]["gpus_per_column"].as_u64()), (50, 125, Some(8)));
        let total: u64 = rows.iter().flat_map(|r| r.as_array().unwrap().iter().map(|v| v.as_u64().unwrap())).sum();
        assert_eq!(total, big[0].iter().flatten().map(|&v| u64::from(v)).sum::<u64>());
        assert_eq!(s["timeline"][0]["kind"], "lost", "newest first");
        assert_eq!(s["timeline"][1]["kind"], "started");
    }
}
