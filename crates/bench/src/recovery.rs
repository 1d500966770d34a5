//! `lazarus bench recovery`: how long live recovery takes, kill → next completed step.
//!
//! Each run trains a fresh job on `workers` worker processes and kills one worker once, at a
//! step and in a phase drawn from the seed: in the forward pass, just before the gradient
//! all-reduce, at the commit vote (the fault-injection hook: the worker sends itself SIGKILL
//! there) or from outside (this process sends SIGKILL, or SIGSTOP to hang it, when the step
//! before is reported, so it lands somewhere in the next step). The report has each recovery with its breakdown, their
//! median and the step time without failures — the paper's 18–34 s (§6.2), 10–20 s of it
//! NCCL time-outs, is what this measures against.

use lazarus_model::{TrainConfig, Trainer};
use lazarus_setting::Setting;
use serde::Serialize;
use std::collections::BTreeMap;

use lazarus_controller::control_loop::{
    plan_job, run_training, Hosts, PlanSource, ReconfigurationRecord, Recovery, TrainEvent, TrainOutcome,
};
use lazarus_controller::ControlError;
use lazarus_protocol::TrainJob;

/// Most kills one benchmark makes (one run each).
pub const MAX_KILLS: usize = 100;
/// Most steps of one run.
pub const MAX_STEPS: u64 = 10_000;
/// The target: kill → next completed step.
pub const TARGET_S: f64 = 2.0;

/// What to measure.
#[derive(Debug, Clone)]
pub struct RecoveryBenchSpec {
    pub workers: usize,
    pub kills: usize,
    /// Steps of each run (the kill falls in 3..=steps-2).
    pub steps: u64,
    pub seed: u64,
    pub recovery: Recovery,
    pub comm_timeout_s: f64,
    /// Where the workers train (`cpu`, `cuda`, `cuda:N`: see [`TrainJob::device`]).
    pub device: String,
}

/// Where in a step a worker dies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KillPhase {
    Forward,
    AllReduce,
    Vote,
    /// SIGKILL from this process, as the step before is reported.
    Outside,
    /// SIGSTOP from this process, as the step before is reported: found by its silence
    /// (the lease), then killed.
    Hang,
}

impl KillPhase {
    const ALL: [KillPhase; 5] = [KillPhase::Forward, KillPhase::AllReduce, KillPhase::Vote, KillPhase::Outside, KillPhase::Hang];

    /// The signal this process sends (None: the worker kills itself at the phase).
    fn signal(self) -> Option<i32> {
        match self {
            KillPhase::Outside => Some(libc::SIGKILL),
            KillPhase::Hang => Some(libc::SIGSTOP),
            _ => None,
        }
    }

    /// The phase's name in `LAZARUS_FAULT` (None: killed from outside).
    fn hook(self) -> Option<&'static str> {
        match self {
            KillPhase::Forward => Some("forward"),
            KillPhase::AllReduce => Some("all_reduce"),
            KillPhase::Vote => Some("vote"),
            KillPhase::Outside | KillPhase::Hang => None,
        }
    }
}

/// One planned kill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Kill {
    pub run: usize,
    pub worker: usize,
    pub phase: KillPhase,
    /// The step it falls in.
    pub step: u64,
}

/// splitmix64: a small, well-mixed generator, so the kills of a seed are the same everywhere.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The kills of `spec`, one per run, drawn from its seed; the phases go round so that every
/// phase is measured once `kills` ≥ 5.
pub fn draw_kills(spec: &RecoveryBenchSpec) -> Vec<Kill> {
    let mut state = spec.seed;
    let phases = KillPhase::ALL.len();
    let first = (splitmix(&mut state) % phases as u64) as usize;
    (0..spec.kills)
        .map(|run| {
            let worker = (splitmix(&mut state) % spec.workers as u64) as usize;
            let span = spec.steps.saturating_sub(4).max(1);
            let step = 3 + splitmix(&mut state) % span;
            Kill { run, worker, phase: KillPhase::ALL[(first + run) % phases], step }
        })
        .collect()
}

/// One kill and what recovering from it took.
#[derive(Debug, Clone, Serialize)]
pub struct KillResult {
    pub kill: Kill,
    /// The reconfiguration's record (None: the run did not recover).
    pub record: Option<ReconfigurationRecord>,
    /// Why the run did not complete, if it did not.
    pub error: Option<String>,
}

/// The benchmark's report (`--json`).
#[derive(Debug, Clone, Serialize)]
pub struct RecoveryBenchReport {
    pub workers: usize,
    pub steps_per_run: u64,
    pub seed: u64,
    pub lease_s: f64,
    pub heartbeat_s: f64,
    pub kills: Vec<KillResult>,
    /// Kills the job recovered from and completed after.
    pub recovered: usize,
    pub recovery_s_median: f64,
    pub recovery_s_max: f64,
    /// Median step without a failure in it (the kill's step and the one after excluded, and
    /// each run's first step).
    pub step_s_median: f64,
    pub target_s: f64,
    pub meets_target: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Check the spec's numbers.
pub fn check_spec(spec: &RecoveryBenchSpec) -> Result<(), ControlError> {
    if spec.workers < 2 || spec.workers > lazarus_protocol::MAX_WORKERS_PER_HOST {
        return Err(ControlError::invalid(
            Setting::Workers,
            format!("{} (expected 2 to {})", spec.workers, lazarus_protocol::MAX_WORKERS_PER_HOST),
        ));
    }
    if spec.kills == 0 || spec.kills > MAX_KILLS {
        return Err(ControlError::invalid(Setting::Kills, format!("{} (expected 1 to {MAX_KILLS})", spec.kills)));
    }
    if spec.steps < 6 || spec.steps > MAX_STEPS {
        return Err(ControlError::invalid(Setting::Steps, format!("{} (expected 6 to {MAX_STEPS})", spec.steps)));
    }
    Ok(())
}

/// Run every kill of `spec` on `config`'s model (its steps, checkpoints and resume are the
/// benchmark's); `progress` hears one line per run.
pub fn run_recovery_bench(
    config: &TrainConfig,
    spec: &RecoveryBenchSpec,
    mut progress: impl FnMut(&str),
) -> Result<RecoveryBenchReport, ControlError> {
    check_spec(spec)?;
    let workers = lazarus_controller::Workers::new(spec.workers, 1, lazarus_controller::Reach::OneMachine)?;
    let mut cfg = config.clone();
    cfg.steps = spec.steps;
    cfg.checkpoint_dir = None;
    cfg.checkpoint_every = 0;
    let mut results = Vec::new();
    let mut step_s = Vec::new();
    for kill in draw_kills(spec) {
        let mut trainer = Trainer::new(cfg.clone())?;
        let source =
            PlanSource::Measured { profile_steps: 2, slots_per_worker: None, max_imbalance: Some(lazarus_plan::DEFAULT_MAX_IMBALANCE) };
        let plan = plan_job(&mut trainer, workers, &source)?;
        let faults = kill.phase.hook().map(|p| format!("{}:{p}:{}", kill.worker, kill.step)).unwrap_or_default();
        let job = TrainJob {
            encrypt_data: false,
            held_out: None,
            config: cfg.clone(),
            plan: plan.map,
            static_ep: false,
            deterministic: false,
            shard_sequences: None,
            resume: None,
            heartbeat_s: 0.0,
            faults,
            standby: false,
            snapshots: None,
            device: spec.device.clone(),
        };
        let mut pids: BTreeMap<usize, u32> = BTreeMap::new();
        let mut record = None;
        let outcome = run_training(
            &job,
            plan.placement.as_ref(),
            workers,
            spec.comm_timeout_s,
            Some(spec.recovery),
            &Hosts::Local { status_listen: None },
            &lazarus_controller::HttpEndpoints::default(),
            |event| {
                match event {
                    TrainEvent::Ready { rank, pid } => {
                        pids.insert(rank, pid);
                    }
                    TrainEvent::Step { report, seconds, .. } => {
                        if let (Some(sig), true) = (kill.phase.signal(), report.step + 1 == kill.step) {
                            if let Some(&pid) = pids.get(&kill.worker) {
                                // SAFETY: a signal to a worker process this job started.
                                unsafe {
                                    libc::kill(pid as i32, sig);
                                }
                            }
                        }
                        if report.step > 1 && report.step != kill.step && report.step != kill.step + 1 {
                            step_s.push(seconds);
                        }
                    }
                    TrainEvent::Reconfigured(r) => record = Some(r),
                    _ => {}
                }
                Ok(())
            },
        );
        let error = match outcome {
            Ok(TrainOutcome::Completed { .. }) => None,
            Ok(TrainOutcome::Failed { reason, .. }) => Some(reason.to_string()),
            Err(e) => Some(e.to_string()),
        };
        let line = match (&record, &error) {
            (Some(r), None) => format!(
                "run {}: worker {} killed ({:?}) in step {}: recovered in {:.3} s (detect {:.3}, plan {:.3}, rebuild {:.3}, transfer {:.3} s, {:.1} MB)",
                kill.run,
                kill.worker,
                kill.phase,
                kill.step,
                r.recovery_s,
                r.detect_s,
                r.plan_s,
                r.rebuild_s,
                r.transfer_s,
                r.transfer_bytes as f64 / 1e6
            ),
            (_, Some(e)) => format!("run {}: worker {} killed ({:?}) in step {}: the run failed: {e}", kill.run, kill.worker, kill.phase, kill.step),
            (None, None) => format!("run {}: worker {} killed ({:?}) in step {}: no recovery was recorded", kill.run, kill.worker, kill.phase, kill.step),
        };
        progress(&line);
        results.push(KillResult { kill, record: if error.is_none() { record } else { None }, error });
    }
    let times: Vec<f64> = results.iter().filter_map(|k| k.record.as_ref().map(|r| r.recovery_s)).collect();
    let recovered = times.len();
    let recovery_s_median = median(times.clone());
    let recovery_s_max = times.iter().copied().fold(f64::NAN, f64::max);
    Ok(RecoveryBenchReport {
        workers: spec.workers,
        steps_per_run: spec.steps,
        seed: spec.seed,
        lease_s: spec.recovery.lease.as_secs_f64(),
        heartbeat_s: spec.recovery.heartbeat.as_secs_f64(),
        recovered,
        meets_target: recovered == results.len() && recovery_s_median < TARGET_S,
        kills: results,
        recovery_s_median,
        recovery_s_max,
        step_s_median: median(step_s),
        target_s: TARGET_S,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn spec(kills: usize, seed: u64) -> RecoveryBenchSpec {
        RecoveryBenchSpec { workers: 4, kills, steps: 12, seed, recovery: Recovery::default(), comm_timeout_s: 30.0, device: "cpu".into() }
    }

    #[test]
    fn kills_are_drawn_from_the_seed_within_the_run_and_cover_every_phase() {
        let a = draw_kills(&spec(10, 7));
        assert_eq!(a, draw_kills(&spec(10, 7)), "the same seed, the same kills");
        assert_ne!(a, draw_kills(&spec(10, 8)));
        for k in &a {
            assert!(k.worker < 4 && (3..=10).contains(&k.step), "{k:?}");
        }
        for phase in KillPhase::ALL {
            assert!(a.iter().any(|k| k.phase == phase), "{phase:?} never drawn");
        }
    }

    #[test]
    fn bad_specs_name_the_flag() {
        for (s, flag) in [
            (RecoveryBenchSpec { workers: 1, ..spec(5, 0) }, Setting::Workers),
            (RecoveryBenchSpec { kills: 0, ..spec(5, 0) }, Setting::Kills),
            (RecoveryBenchSpec { steps: 5, ..spec(5, 0) }, Setting::Steps),
            (RecoveryBenchSpec { steps: u64::MAX, ..spec(5, 0) }, Setting::Steps),
        ] {
            let e = check_spec(&s).unwrap_err().to_string();
            assert!(e.contains(&flag.to_string()), "{e}");
        }
        assert!(Recovery::from_flags(Some(0.0), Some(0.1)).is_err());
        assert!(Recovery::from_flags(Some(1.0), Some(1.0)).is_err());
        assert!(Recovery::from_flags(Some(1.0), Some(f64::NAN)).is_err());
        assert_eq!(Recovery::from_flags(Some(0.1), None).unwrap().heartbeat, Duration::from_millis(20));
        assert!(Recovery::from_flags(Some(1.0), Some(0.2)).is_ok());
    }

    #[test]
    fn medians() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(vec![]).is_nan());
    }
}
