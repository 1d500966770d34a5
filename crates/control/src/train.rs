//! The launcher side of `lazarus train --workers N`: plan the job, start the workers, supervise
//! them; what to show the user is the caller's (every [`Action`] is handed to it).

use std::time::{Duration, Instant};

use lazarus_model::Trainer;
use lazarus_plan::{plan_model, ClusterShape, ModelPlan, PlanPolicy, ReplicaMap};
use lazarus_runtime::{check_plan, validate_worker_config, DispatchMode};

use crate::error::ControlError;
use crate::launcher::{check_comm_timeout, launch, supervise, Confinement};
use crate::protocol::TrainJob;
use crate::supervisor::{Action, Outcome, Supervisor};

/// Most worker processes of one local job.
pub const MAX_WORKERS: usize = 64;
/// Most steps profiled for the measured-load plan (forward passes before training starts).
pub const MAX_PROFILE_STEPS: usize = 1000;

/// Where the expert placement of a job comes from.
#[derive(Debug, Clone)]
pub enum PlanSource {
    /// DeepSpeed-MoE's static expert parallelism: experts split evenly, one replica each.
    StaticEp,
    /// A plan file (`lazarus plan --json`), one rank per GPU slot of the plan.
    File(ModelPlan),
    /// Planned by the scheduler from the router loads of the first `profile_steps` batches.
    Measured {
        profile_steps: usize,
        /// Replica slots per worker (default: room for two replicas of every expert).
        slots_per_worker: Option<usize>,
        /// The throughput guard (None: the most fault-tolerant placement).
        max_imbalance: Option<f64>,
    },
}

impl PlanSource {
    pub fn dispatch_mode(&self) -> DispatchMode {
        match self {
            PlanSource::StaticEp => DispatchMode::StaticPadded,
            _ => DispatchMode::Balanced,
        }
    }
}

/// The replica map `world` workers train `trainer`'s model with. `trainer` is the launcher's copy
/// of the job (fresh or resumed); profiling reads its next batches without moving its cursor.
pub fn plan_job(trainer: &mut Trainer, world: usize, source: &PlanSource) -> Result<ReplicaMap, ControlError> {
    if world == 0 || world > MAX_WORKERS {
        return Err(ControlError::invalid("--workers", format!("{world} (expected 1 to {MAX_WORKERS})")));
    }
    let cfg = trainer.config.clone();
    validate_worker_config(&cfg, world)?;
    let (layers, experts) = (cfg.model.moe_layers(), cfg.model.n_experts);
    let plan = match source {
        PlanSource::StaticEp => ReplicaMap::static_ep(0, layers, experts, world)?,
        PlanSource::File(plan) => {
            if plan.shape().ranks() != world {
                return Err(ControlError::invalid(
                    "--placement-file",
                    format!(
                        "the plan has {} ranks ({} nodes x {} GPUs), but --workers is {world}",
                        plan.shape().ranks(),
                        plan.shape().nodes,
                        plan.shape().gpus_per_node
                    ),
                ));
            }
            plan.replica_map()
        }
        PlanSource::Measured { profile_steps, slots_per_worker, max_imbalance } => {
            let steps_left = cfg.steps.saturating_sub(trainer.step);
            if *profile_steps == 0 || *profile_steps > MAX_PROFILE_STEPS || *profile_steps as u64 > steps_left.max(1) {
                return Err(ControlError::invalid(
                    "--profile-steps",
                    format!(
                        "{profile_steps} (expected 1 to {}, at most the {steps_left} steps to train; or give --placement-file)",
                        MAX_PROFILE_STEPS
                    ),
                ));
            }
            let slots = slots_per_worker.unwrap_or_else(|| (2 * experts).div_ceil(world).max(1));
            if slots.saturating_mul(world) < experts {
                return Err(ControlError::invalid("--slots-per-worker", format!("{slots} x {world} workers < {experts} experts")));
            }
            let shape = ClusterShape::new(world, 1, slots).map_err(|e| ControlError::invalid("--slots-per-worker", e.to_string()))?;
            let loads = trainer.measure_loads(*profile_steps)?;
            plan_model(&loads, shape, &PlanPolicy::trainer(world, *max_imbalance), None)?.replica_map()
        }
    };
    check_plan(&plan, layers, experts, world, source.dispatch_mode())?;
    Ok(plan)
}

/// Start `world` worker processes on `job` and supervise them to the end; every [`Action`] goes
/// to `observe` as it happens (progress, readiness, failures). Collectives time out after
/// `comm_timeout_s`.
pub fn run_training(
    job: &TrainJob,
    world: usize,
    comm_timeout_s: f64,
    observe: impl FnMut(&Action) -> Result<(), ControlError>,
) -> Result<Outcome, ControlError> {
    let comm_timeout_s = check_comm_timeout(comm_timeout_s)?;
    let mut processes = launch("worker", world, comm_timeout_s, job, Confinement::Shared)?;
    let start_within = Duration::from_secs_f64(comm_timeout_s.max(10.0) + 60.0);
    // Survivors get the collective deadline plus a margin to notice a failure on their own.
    let grace = Duration::from_secs_f64(comm_timeout_s + 5.0);
    let mut supervisor = Supervisor::new(world, Instant::now(), start_within, grace);
    supervise(&mut processes, &mut supervisor, observe)
}
