//! What a simulated run reports: where the wall time went, the curves for plots, and the
//! counts of each kind of event.

use serde::Serialize;

use super::policy::{FailurePolicy, Policy};
use super::Run;

/// Where the wall time went. The fields add up to the simulated duration.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Breakdown {
    /// Steps that count (not rolled back).
    pub compute_s: f64,
    pub checkpoint_s: f64,
    /// Relaunch and checkpoint loading.
    pub restart_s: f64,
    /// Steps later rolled back by a restart, and steps a failure interrupted.
    pub lost_work_s: f64,
    /// Finding out failures: a time-out, or a process's exit seen (before a reconfiguration or
    /// a restart).
    pub detect_s: f64,
    /// Group rebuilds of reconfigurations and scale-ups.
    pub reconfig_s: f64,
    /// Expert states sent in reconfigurations and scale-ups (and their rebalances' part in
    /// `rebalance_s`).
    pub transfer_s: f64,
    pub rebalance_s: f64,
    /// No usable configuration (too few nodes).
    pub idle_s: f64,
}

impl Breakdown {
    pub fn total(&self) -> f64 {
        self.compute_s
            + self.checkpoint_s
            + self.restart_s
            + self.lost_work_s
            + self.detect_s
            + self.reconfig_s
            + self.transfer_s
            + self.rebalance_s
            + self.idle_s
    }

    /// The effective training time ratio: the time spent on steps that count over the wall time
    /// (what the field now judges resilient training by: MoEvement, ByteRobust). 0 for no time.
    pub fn ettr(&self) -> f64 {
        let total = self.total();
        if total > 0.0 {
            self.compute_s / total
        } else {
            0.0
        }
    }
}

/// One point of the throughput / progress curves.
#[derive(Debug, Clone, Serialize)]
pub struct SeriesPoint {
    pub t_s: f64,
    pub samples_per_s: f64,
    pub cumulative_samples: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PolicyReport {
    pub policy: Policy,
    pub trained_samples: f64,
    pub avg_samples_per_s: f64,
    /// Effective training time ratio ([`Breakdown::ettr`]).
    pub ettr: f64,
    pub steps: u64,
    pub restarts: u64,
    pub reconfigurations: u64,
    pub rebalances: u64,
    /// Drains after a notice.
    pub drains: u64,
    pub checkpoints: u64,
    pub breakdown: Breakdown,
    /// Binned curves for plots.
    pub series: Vec<SeriesPoint>,
    /// Times (s) at which nodes in use failed.
    pub failures_s: Vec<f64>,
    /// Of those failures, the ones every failed node of which was found out by its process's
    /// exit (with a failure mix; the others by a time-out).
    pub failures_seen_by_exit: u64,
    /// Lazarus's snapshot tier: moves that restored experts from snapshots instead of a
    /// rollback, the experts restored, and their steps behind the job, summed.
    pub snapshot_restores: u64,
    pub experts_restored: u64,
    pub restored_stale_steps: u64,
    /// (time s, nodes in use) at every configuration change (0 = none usable).
    pub nodes_in_use: Vec<(f64, usize)>,
}

/// What a run counts and records as it goes, for its report.
#[derive(Debug, Default)]
pub(super) struct Tally {
    /// Where the wall time went so far.
    pub time: Breakdown,
    pub restarts: u64,
    pub reconfigurations: u64,
    pub rebalances: u64,
    pub checkpoints: u64,
    /// Nodes in use drained after a notice (each drain once, whatever it cost).
    pub drains: u64,
    /// (t0, t1, samples completed) of every training stretch, for the curves.
    pub stretches: Vec<(f64, f64, f64)>,
    /// (t, samples rolled back).
    pub rollbacks: Vec<(f64, f64)>,
    /// Times at which nodes in use failed.
    pub failures: Vec<f64>,
    pub seen_by_exit: u64,
    pub snapshot_restores: u64,
    pub experts_restored: u64,
    pub restored_stale_steps: u64,
    /// (t, nodes in use) at every configuration change.
    pub nodes_in_use: Vec<(f64, usize)>,
}

impl<P: FailurePolicy> Run<'_, P> {
    pub(super) fn report(&self) -> PolicyReport {
        let t = &self.tally;
        let d = self.s.duration_s;
        let bins = 300usize;
        let width = d / bins as f64;
        let mut gross = vec![0.0f64; bins];
        for &(t0, t1, gained) in &t.stretches {
            if t1 <= t0 || gained == 0.0 {
                continue;
            }
            let rate = gained / (t1 - t0);
            let (b0, b1) = ((t0 / width) as usize, ((t1 / width).ceil() as usize).min(bins));
            for (b, g) in gross.iter_mut().enumerate().take(b1).skip(b0) {
                let (lo, hi) = (b as f64 * width, (b + 1) as f64 * width);
                let overlap = t1.min(hi) - t0.max(lo);
                if overlap > 0.0 {
                    *g += rate * overlap;
                }
            }
        }
        let mut series = Vec::with_capacity(bins);
        let (mut cum, mut rb) = (0.0, 0usize);
        for (b, g) in gross.iter().enumerate() {
            let t = (b + 1) as f64 * width;
            cum += g;
            while rb < self.tally.rollbacks.len() && self.tally.rollbacks[rb].0 <= t {
                cum -= self.tally.rollbacks[rb].1;
                rb += 1;
            }
            series.push(SeriesPoint { t_s: t, samples_per_s: g / width, cumulative_samples: cum.max(0.0) });
        }
        PolicyReport {
            policy: self.policy,
            trained_samples: self.samples,
            avg_samples_per_s: self.samples / d,
            ettr: t.time.ettr(),
            steps: self.step,
            restarts: t.restarts,
            reconfigurations: t.reconfigurations,
            rebalances: t.rebalances,
            drains: t.drains,
            checkpoints: t.checkpoints,
            breakdown: t.time.clone(),
            series,
            failures_s: t.failures.clone(),
            failures_seen_by_exit: t.seen_by_exit,
            snapshot_restores: t.snapshot_restores,
            experts_restored: t.experts_restored,
            restored_stale_steps: t.restored_stale_steps,
            nodes_in_use: t.nodes_in_use.clone(),
        }
    }
}
