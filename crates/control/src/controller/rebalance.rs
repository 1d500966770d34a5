//! Periodic rebalancing (paper §4.3: the controller re-plans from the expert loads the workers
//! measured, as popularity drifts) and, beyond the paper, whether a rebalance pays for itself:
//! a pure function of the measured step time, the plans' bottlenecks under the measured loads,
//! the bytes the move would send and the measured cost of moving bytes.
//!
//! The gain is an upper bound: it assumes the whole step scales with the busiest GPU's expert
//! tokens (λ*, [`lazarus_plan::balance`]), where in truth attention and the dense parts do not.
//! A rebalance skipped under this rule could not have paid off within its horizon; one applied
//! may pay off less than predicted.

use serde::Serialize;

/// What a rebalance would cost, and what it would gain.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RebalanceCase {
    /// Mean seconds of a step since the plan was made (measured).
    pub step_s: f64,
    /// Steps until the next rebalance is considered: the horizon the gain must repay within.
    pub horizon_steps: u64,
    /// Σ over MoE layers of λ* (the least possible busiest-GPU tokens) of the current plan under
    /// the measured loads, and of the candidate plan.
    pub bottleneck_before: f64,
    pub bottleneck_after: f64,
    /// Σ over layers of λ* / mean tokens per GPU: 1 is perfect balance.
    pub imbalance_before: f64,
    pub imbalance_after: f64,
    /// Expert states the move would send, and their bytes.
    pub transfers: usize,
    pub bytes: u64,
    /// Measured cost of moving: seconds per byte sent, and a fixed part (pause, rendezvous).
    pub seconds_per_byte: f64,
    pub fixed_s: f64,
}

/// The controller's decision on one rebalance, as the `--json-log` records it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RebalanceDecision {
    pub event: &'static str,
    /// Steps done when it was weighed.
    pub step: u64,
    /// `apply` (the job pauses and moves) or `skip`.
    pub decision: &'static str,
    /// Predicted seconds saved over the horizon (an upper bound, see the module's note).
    pub gain_s: f64,
    /// Predicted seconds the move costs.
    pub cost_s: f64,
    pub horizon_steps: u64,
    pub step_s: f64,
    pub imbalance_before: f64,
    pub imbalance_after: f64,
    pub transfers: usize,
    pub transfer_bytes: u64,
}

impl RebalanceCase {
    /// Seconds saved over the horizon if the candidate plan ran instead of the current one.
    pub fn gain_s(&self) -> f64 {
        if self.bottleneck_before.is_nan() || self.bottleneck_before <= 0.0 || !self.step_s.is_finite() {
            return 0.0;
        }
        let ratio = (self.bottleneck_after / self.bottleneck_before).clamp(0.0, f64::MAX);
        (self.step_s * (1.0 - ratio)).max(0.0) * self.horizon_steps as f64
    }

    /// Seconds the move costs.
    pub fn cost_s(&self) -> f64 {
        self.fixed_s + self.bytes as f64 * self.seconds_per_byte
    }

    /// Apply a rebalance only when it moves something and its gain exceeds its cost.
    pub fn decide(&self, step: u64) -> RebalanceDecision {
        let (gain_s, cost_s) = (self.gain_s(), self.cost_s());
        let apply = self.transfers > 0 && gain_s > cost_s;
        RebalanceDecision {
            event: "rebalance",
            step,
            decision: if apply { "apply" } else { "skip" },
            gain_s,
            cost_s,
            horizon_steps: self.horizon_steps,
            step_s: self.step_s,
            imbalance_before: self.imbalance_before,
            imbalance_after: self.imbalance_after,
            transfers: self.transfers,
            transfer_bytes: self.bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case() -> RebalanceCase {
        RebalanceCase {
            step_s: 0.5,
            horizon_steps: 200,
            bottleneck_before: 150.0,
            bottleneck_after: 100.0,
            imbalance_before: 1.5,
            imbalance_after: 1.0,
            transfers: 4,
            bytes: 4_000_000,
            seconds_per_byte: 1e-8,
            fixed_s: 0.2,
        }
    }

    #[test]
    fn a_rebalance_that_repays_its_move_is_applied() {
        let c = case();
        // A third less work on the busiest GPU: 0.5/3 s a step over 200 steps.
        assert!((c.gain_s() - 200.0 * 0.5 / 3.0).abs() < 1e-9);
        assert!((c.cost_s() - 0.24).abs() < 1e-12);
        let d = c.decide(400);
        assert_eq!((d.decision, d.step, d.transfers), ("apply", 400, 4));
    }

    #[test]
    fn a_rebalance_that_does_not_repay_or_moves_nothing_is_skipped() {
        // Slow transfers: 40 MB/s would take 100 s for 4 GB.
        let slow = RebalanceCase { bytes: 4_000_000_000, seconds_per_byte: 2.5e-8, ..case() };
        assert_eq!(slow.decide(400).decision, "skip");
        // A candidate no better than the current plan gains nothing.
        let same = RebalanceCase { bottleneck_after: 150.0, ..case() };
        assert_eq!(same.gain_s(), 0.0);
        assert_eq!(same.decide(400).decision, "skip");
        let worse = RebalanceCase { bottleneck_after: 200.0, ..case() };
        assert_eq!(worse.gain_s(), 0.0);
        // Nothing to move: nothing to apply, whatever the figures say.
        assert_eq!(RebalanceCase { transfers: 0, bytes: 0, ..case() }.decide(400).decision, "skip");
        // No loads measured: no gain.
        assert_eq!(RebalanceCase { bottleneck_before: 0.0, ..case() }.gain_s(), 0.0);
    }
}
