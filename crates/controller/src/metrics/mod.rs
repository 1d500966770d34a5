//! What a running job exposes to Prometheus (`--metrics-listen ADDR`, `GET /metrics`, the text
//! format encoded by the `prometheus-client` crate): its progress (step, loss, tokens/s), its
//! membership and epoch (read at scrape time from the status the controller publishes after each
//! decision), its reconfigurations by cause with a histogram of their recovery times and the
//! bytes they moved, the snapshot tier's bytes sent and at risk, and the seconds since the last
//! checkpoint. The controller's loop feeds [`JobMetrics::record`] every [`TrainEvent`].

use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::Instant;

use prometheus_client::encoding::{text::encode, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::events::TrainEvent;
use crate::service::SharedStatus;

pub(crate) mod server;
pub use server::{MetricsEndpoint, MetricsServer};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Cause {
    cause: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct State {
    state: String,
}

/// The metrics of one job.
pub struct JobMetrics {
    registry: Registry,
    step: Gauge,
    loss: Gauge<f64, AtomicU64>,
    tokens_per_second: Gauge<f64, AtomicU64>,
    epoch: Gauge,
    members: Family<State, Gauge>,
    reconfigurations: Family<Cause, Counter>,
    recovery_seconds: Histogram,
    moved_bytes: Counter,
    moe_wire_bytes: Counter,
    snapshot_bytes: Counter,
    snapshot_at_risk_bytes: Gauge,
    checkpoint_age_seconds: Gauge<f64, AtomicU64>,
    last_checkpoint: Mutex<Option<Instant>>,
    begun: Instant,
}

impl Default for JobMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl JobMetrics {
    pub fn new() -> Self {
        let m = JobMetrics {
            registry: Registry::with_prefix("lazarus"),
            step: Gauge::default(),
            loss: Gauge::default(),
            tokens_per_second: Gauge::default(),
            epoch: Gauge::default(),
            members: Family::default(),
            reconfigurations: Family::default(),
            // 10 ms to about 5 minutes.
            recovery_seconds: Histogram::new([0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0]),
            moved_bytes: Counter::default(),
            moe_wire_bytes: Counter::default(),
            snapshot_bytes: Counter::default(),
            snapshot_at_risk_bytes: Gauge::default(),
            checkpoint_age_seconds: Gauge::default(),
            last_checkpoint: Mutex::new(None),
            begun: Instant::now(),
        };
        m.registered()
    }

    /// Every metric in the registry (they share their values with the fields: a metric is a
    /// handle to its value).
    fn registered(mut self) -> Self {
        let r = &mut self.registry;
        r.register("step", "The last step trained", self.step.clone());
        r.register("loss", "The loss of the last step", self.loss.clone());
        r.register("tokens_per_second", "Tokens trained per second in the last step", self.tokens_per_second.clone());
        r.register("epoch", "The job's epoch (0 at its start, one more per move)", self.epoch.clone());
        r.register("members", "Workers of the job by state", self.members.clone());
        r.register("reconfigurations", "Moves to a new plan, by cause", self.reconfigurations.clone());
        r.register("recovery_seconds", "From the first sign of a failure or move to the next step", self.recovery_seconds.clone());
        r.register("moved_bytes", "Expert state moved by reconfigurations", self.moved_bytes.clone());
        r.register("snapshot_bytes", "Expert snapshots sent into other nodes' memory", self.snapshot_bytes.clone());
        r.register(
            "moe_wire_bytes",
            "Bytes the MoE layers' all-to-alls sent between workers (every worker's)",
            self.moe_wire_bytes.clone(),
        );
        r.register("snapshot_at_risk_bytes", "Bytes of the experts at risk in the last step", self.snapshot_at_risk_bytes.clone());
        r.register(
            "checkpoint_age_seconds",
            "Seconds since the last checkpoint was written (since the job began, before any)",
            self.checkpoint_age_seconds.clone(),
        );
        self
    }

    /// Take in what the job did.
    pub fn record(&self, event: &TrainEvent) {
        match event {
            TrainEvent::Step { report, seconds, snapshot, moe_wire_bytes, .. } => {
                self.step.set(report.step as i64);
                if let Some(bytes) = moe_wire_bytes {
                    self.moe_wire_bytes.inc_by(*bytes);
                }
                self.loss.set(report.loss);
                if *seconds > 0.0 {
                    self.tokens_per_second.set(report.tokens as f64 / seconds);
                }
                if let Some(s) = snapshot {
                    self.snapshot_bytes.inc_by(s.bytes);
                    self.snapshot_at_risk_bytes.set(s.at_risk_bytes as i64);
                }
            }
            TrainEvent::Reconfigured(r) => {
                self.reconfigurations.get_or_create(&Cause { cause: r.cause.as_str().to_string() }).inc();
                self.recovery_seconds.observe(r.recovery_s);
                self.moved_bytes.inc_by(r.transfer_bytes);
            }
            TrainEvent::Checkpointed { .. } => *self.last_checkpoint.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now()),
            _ => {}
        }
    }

    /// The text format, with what the controller's last published status says of the members
    /// and the epoch.
    pub fn encode(&self, status: Option<&SharedStatus>) -> String {
        if let Some(status) = status {
            let s = status.lock().unwrap_or_else(|e| e.into_inner()).clone();
            self.epoch.set(s.epoch as i64);
            self.members.clear();
            for m in &s.members {
                self.members.get_or_create(&State { state: m.state.clone() }).inc();
            }
        }
        let since = self.last_checkpoint.lock().unwrap_or_else(|e| e.into_inner()).unwrap_or(self.begun);
        self.checkpoint_age_seconds.set(since.elapsed().as_secs_f64());
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decisions::MoveCause;
    use crate::events::ReconfigurationRecord;

    #[test]
    fn events_become_metrics_in_the_text_format() {
        let m = JobMetrics::new();
        let report = lazarus_model::StepReport {
            step: 7,
            loss: 2.5,
            aux_loss: 0.0,
            tokens: 1000,
            lr: 1e-3,
            grad_norm: 1.0,
            expert_load: vec![],
            dropped: 0,
        };
        m.record(&TrainEvent::Step { report: report.clone(), seconds: 0.5, dropped: 0, moe_wire_bytes: Some(3000), snapshot: None });
        m.record(&TrainEvent::Step { report, seconds: 0.5, dropped: 0, moe_wire_bytes: Some(1000), snapshot: None });
        let r = ReconfigurationRecord {
            event: "reconfiguration",
            epoch: 1,
            cause: MoveCause::Failure,
            lost: vec![1],
            joined: vec![],
            step: 7,
            detect_s: 0.01,
            plan_s: 0.001,
            transfer_s: 0.01,
            transfer_bytes: 4096,
            rebuild_s: 0.01,
            recovery_s: 0.05,
            workers: 2,
            restored: vec![],
            rollback_avoided_steps: 0,
            gpu_used_bytes: vec![],
        };
        m.record(&TrainEvent::Reconfigured(r));
        let text = m.encode(None);
        for want in [
            "lazarus_step 7",
            "lazarus_loss 2.5",
            "lazarus_tokens_per_second 2000.0",
            "lazarus_reconfigurations_total{cause=\"reconfigure\"} 1",
            "lazarus_recovery_seconds_bucket{le=\"0.1\"} 1",
            "lazarus_moved_bytes_total 4096",
            "lazarus_moe_wire_bytes_total 4000",
            "# EOF",
        ] {
            assert!(text.contains(want), "{want:?} in\n{text}");
        }
    }
}
