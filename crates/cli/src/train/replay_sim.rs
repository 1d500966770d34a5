//! `train --replay`, beyond the paper: the same trace through `lazarus sim`'s Lazarus policy,
//! its cost model calibrated to what this run measured, and the trained samples predicted
//! against those measured over the same wall time. The calibration is a pure function of the
//! run's figures ([`calibrate`], [`scenario`]); the shell only gathers them and prints.
//!
//! What is calibrated, and how: a step takes the run's mean step time on any number of
//! workers (the run keeps its global batch, so every step trains the same samples:
//! `CostModel::global_batch`; the share of the step that follows the expert load is set to 0,
//! as the mean already has the run's imbalance in it); a failure costs the run's mean
//! detection time (`failure_timeout_s`) plus its mean rebuild (recovery less detection and
//! transfers: `group_rebuild_s`) plus its bytes at the run's measured bytes per second; a
//! rollback costs the run's mean rollback (`restart_s`); joiners wait `--join-wait` (the
//! replay's: 120 s × the scale). Checkpoint writes cost nothing extra: rank 0 writes inside its
//! measured steps.

use lazarus_controller::control_loop::ReconfigurationRecord;
use lazarus_controller::decisions::MoveCause;
use lazarus_model::TrainConfig;
use lazarus_sim::{simulate, CostModel, LoadModel, ModelSpec, Notices, Policy, PolicyReport, Scenario, Trace, TraceEvent};
use serde::Serialize;

/// What a replayed run measured.
#[derive(Debug, Clone, Default)]
pub struct RunFigures {
    /// From the first step's start to the last step's end.
    pub wall_s: f64,
    /// Steps trained in that time, and their seconds.
    pub step_s: Vec<f64>,
    pub moves: Vec<ReconfigurationRecord>,
    /// Expert loads summed over the run, per MoE layer.
    pub loads: Vec<Vec<f64>>,
}

/// The costs [`scenario`] gives the simulator, from a run's figures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Calibration {
    pub step_s: f64,
    pub detect_s: f64,
    pub rebuild_s: f64,
    pub bytes_per_s: f64,
    pub rollback_s: f64,
    pub rebalance_s: f64,
}

/// Before anything of a kind was measured: loopback-like figures.
const DEFAULT_DETECT_S: f64 = 0.1;
const DEFAULT_REBUILD_S: f64 = 0.05;
const DEFAULT_BYTES_PER_S: f64 = 1e9;

fn mean(xs: impl Iterator<Item = f64>) -> Option<f64> {
    let (n, sum) = xs.filter(|x| x.is_finite() && *x >= 0.0).fold((0usize, 0.0), |(n, s), x| (n + 1, s + x));
    (n > 0).then(|| sum / n as f64)
}

/// The run's costs: the mean step, and the means of its moves by kind.
pub fn calibrate(f: &RunFigures) -> Option<Calibration> {
    let step_s = mean(f.step_s.iter().copied().filter(|&s| s > 0.0))?;
    let of = |cause: MoveCause| f.moves.iter().filter(move |m| m.cause == cause);
    let detect_s = mean(of(MoveCause::Failure).map(|m| m.detect_s)).unwrap_or(DEFAULT_DETECT_S);
    let rebuild_s = mean(of(MoveCause::Failure).map(|m| (m.recovery_s - m.detect_s - m.transfer_s).max(0.0))).unwrap_or(DEFAULT_REBUILD_S);
    let (bytes, seconds) = f
        .moves
        .iter()
        .filter(|m| m.transfer_bytes > 0 && m.transfer_s > 0.0)
        .fold((0.0, 0.0), |(b, s), m| (b + m.transfer_bytes as f64, s + m.transfer_s));
    let bytes_per_s = if seconds > 0.0 { bytes / seconds } else { DEFAULT_BYTES_PER_S };
    let rollback_s = mean(of(MoveCause::Rollback).map(|m| m.recovery_s)).unwrap_or(detect_s + rebuild_s);
    let rebalance_s = mean(of(MoveCause::Rebalance).map(|m| m.recovery_s)).unwrap_or(rebuild_s);
    Some(Calibration { step_s, detect_s, rebuild_s, bytes_per_s, rollback_s, rebalance_s })
}

/// How the run was set up, as far as the simulator needs it.
#[derive(Debug, Clone)]
pub struct RunShape {
    /// The replayed trace (unscaled) and its scale.
    pub trace: Trace,
    pub scale: f64,
    pub gpus_per_node: usize,
    pub slots_per_gpu: usize,
    pub most_nodes: usize,
    pub join_wait_s: f64,
    /// 0: never.
    pub rebalance_every: u64,
    /// A node that goes was given notice (drained) instead of killed (`--replay-notice`).
    pub notice: bool,
}

/// The simulated job: the scaled trace, this model, the calibrated costs.
pub fn scenario(cfg: &TrainConfig, shape: &RunShape, cal: &Calibration, f: &RunFigures) -> Scenario {
    let trace = Trace {
        events: shape
            .trace
            .events
            .iter()
            .map(|e| TraceEvent { ms: (e.ms as f64 * shape.scale).round() as u64, change: e.change, node: e.node.clone() })
            .collect(),
    };
    let m = &cfg.model;
    let model = ModelSpec {
        name: "this run".into(),
        layers: m.moe_layers(),
        d_model: m.d_model,
        experts: m.n_experts,
        params: m.parameter_count() as f64,
        expert_state_bytes: (m.expert_params() * 12) as f64,
        balanced_step_s: cal.step_s.max(lazarus_sim::cost::MIN_STEP_S),
        expert_fraction: 0.0,
    };
    let never = u64::MAX / 4;
    let cost = CostModel {
        gpus_per_node: shape.gpus_per_node,
        slots_per_gpu: shape.slots_per_gpu,
        global_batch: Some(cfg.batch_size),
        network_gbps: cal.bytes_per_s * 8.0 / 1e9,
        // Checkpoint writes are inside the measured steps; the rollback's reading is in restart_s.
        storage_gbps: 1e6,
        failure_timeout_s: cal.detect_s,
        group_rebuild_s: cal.rebuild_s,
        restart_s: cal.rollback_s,
        rebalance_s: cal.rebalance_s,
        checkpoint_every_lazarus: if cfg.checkpoint_every > 0 { cfg.checkpoint_every } else { never },
        rebalance_every: if shape.rebalance_every > 0 { shape.rebalance_every } else { never },
        scale_up_wait_s: shape.join_wait_s,
        ..CostModel::default()
    };
    let loads = if f.loads.iter().flatten().any(|&x| x > 0.0) { LoadModel::Trace(vec![f.loads.clone()]) } else { LoadModel::default() };
    // A node told to go drains and leaves after its step in flight: in the simulator, every
    // removal told two steps ahead.
    let notices = if shape.notice { Notices { share: 1.0, lead_s: 2.0 * cal.step_s, seed: 0 } } else { Notices::default() };
    Scenario { trace, model, cost, loads, max_nodes: shape.most_nodes.max(1), duration_s: f.wall_s, notices, mix: None, seed: 0 }
}

/// Predicted against measured, as the `--json-log` records it.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayVsSim {
    pub event: &'static str,
    pub wall_s: f64,
    pub measured_samples: f64,
    pub predicted_samples: f64,
    /// predicted / measured.
    pub ratio: f64,
    pub measured_reconfigurations: usize,
    pub measured_rollbacks: usize,
    pub measured_joins: usize,
    /// Nodes drained after a notice (`--replay-notice`), in the run and in the simulation.
    pub measured_drains: usize,
    pub predicted_reconfigurations: u64,
    pub predicted_restarts: u64,
    pub predicted_drains: u64,
    pub calibration: Calibration,
}

/// Run the calibrated simulation of a replayed run that trained `steps` steps in `f.wall_s`.
pub fn compare(cfg: &TrainConfig, shape: &RunShape, f: &RunFigures, steps: u64) -> anyhow::Result<Option<ReplayVsSim>> {
    let Some(cal) = calibrate(f) else { return Ok(None) };
    if !(f.wall_s.is_finite() && f.wall_s > 0.0) {
        return Ok(None);
    }
    let s = scenario(cfg, shape, &cal, f);
    let r: PolicyReport = simulate(&s, Policy::Lazarus)?;
    let measured = (steps * cfg.batch_size as u64) as f64;
    let count = |cause: MoveCause| f.moves.iter().filter(|m| m.cause == cause).count();
    Ok(Some(ReplayVsSim {
        event: "replay_vs_sim",
        wall_s: f.wall_s,
        measured_samples: measured,
        predicted_samples: r.trained_samples,
        ratio: r.trained_samples / measured.max(1.0),
        measured_reconfigurations: count(MoveCause::Failure) + count(MoveCause::Drain),
        measured_rollbacks: count(MoveCause::Rollback),
        measured_joins: count(MoveCause::Join),
        measured_drains: count(MoveCause::Drain),
        predicted_reconfigurations: r.reconfigurations,
        predicted_restarts: r.restarts,
        predicted_drains: r.drains,
        calibration: cal,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use lazarus_sim::Change;

    fn record(cause: MoveCause, detect_s: f64, transfer_s: f64, bytes: u64, recovery_s: f64) -> ReconfigurationRecord {
        ReconfigurationRecord {
            event: "reconfiguration",
            epoch: 1,
            cause,
            lost: vec![],
            joined: vec![],
            step: 10,
            detect_s,
            plan_s: 0.0,
            transfer_s,
            transfer_bytes: bytes,
            rebuild_s: 0.0,
            recovery_s,
            workers: 2,
            restored: vec![],
            rollback_avoided_steps: 0,
            gpu_used_bytes: vec![],
        }
    }

    #[test]
    fn the_calibration_is_the_runs_mean_step_and_mean_moves() {
        let f = RunFigures {
            wall_s: 10.0,
            step_s: vec![0.02, 0.06, 0.01, 0.02, 0.04],
            moves: vec![
                record(MoveCause::Failure, 0.1, 0.01, 1_000_000, 0.3),
                record(MoveCause::Failure, 0.3, 0.03, 3_000_000, 0.5),
                record(MoveCause::Rollback, 0.1, 0.0, 0, 2.0),
                record(MoveCause::Join, 0.0, 0.01, 1_000_000, 0.1),
            ],
            loads: vec![],
        };
        let c = calibrate(&f).unwrap();
        assert!((c.step_s - 0.03).abs() < 1e-12, "{c:?}");
        assert!((c.detect_s - 0.2).abs() < 1e-12 && (c.rebuild_s - 0.18).abs() < 1e-12, "{c:?}");
        assert!((c.bytes_per_s - 5e6 / 0.05).abs() < 1e-3, "{c:?}");
        assert_eq!(c.rollback_s, 2.0);
        assert!(calibrate(&RunFigures::default()).is_none(), "no step, no calibration");
    }

    /// With no failure in the trace the prediction is the run's own arithmetic: the wall time
    /// over the mean step, times the batch.
    #[test]
    fn a_quiet_trace_predicts_the_steps_the_median_allows() {
        let cfg = TrainConfig { batch_size: 12, checkpoint_every: 0, ..TrainConfig::default() };
        let trace = Trace { events: (0..2).map(|i| TraceEvent { ms: 0, change: Change::Add, node: format!("n{i}") }).collect() };
        let shape = RunShape {
            trace,
            scale: 0.01,
            gpus_per_node: 2,
            slots_per_gpu: 2,
            most_nodes: 2,
            join_wait_s: 1.2,
            rebalance_every: 0,
            notice: false,
        };
        let f = RunFigures { wall_s: 10.0, step_s: vec![0.05; 200], moves: vec![], loads: vec![] };
        let c = compare(&cfg, &shape, &f, 200).unwrap().unwrap();
        assert_eq!(c.measured_samples, 2400.0);
        assert!((c.predicted_samples - 2400.0).abs() <= 12.0, "{c:?}");
        assert_eq!((c.predicted_reconfigurations, c.predicted_restarts), (0, 0));
    }
}
