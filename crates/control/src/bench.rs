//! The launcher side of `lazarus bench moe-layer`: the same launch and the same controller as a
//! training job without recovery (the first loss ends it).

use std::time::Instant;

use lazarus_runtime::bench::{BenchResult, MoeLayerBenchSpec};

use crate::control_loop::{drive, Lifecycle, TrainEvent, TrainOutcome};
use crate::controller::{Controller, JobSpec};
use crate::error::ControlError;
use crate::launcher::{check_comm_timeout, fresh_epoch, launch, Confinement};

/// Run `spec` on `world` worker processes confined as `confine` says; rank 0's results.
pub fn run_moe_layer_bench(
    spec: &MoeLayerBenchSpec,
    world: usize,
    confine: Confinement,
    observe: impl FnMut(TrainEvent) -> Result<(), ControlError>,
) -> Result<Vec<BenchResult>, ControlError> {
    check_comm_timeout(spec.timeout_s)?;
    let epoch = fresh_epoch();
    let mut processes = launch("bench-worker", world, spec.timeout_s, spec, confine, epoch)?;
    let lifecycle = Lifecycle::new(spec.timeout_s, None);
    let job = JobSpec { layers: 1, experts: spec.experts, ..lifecycle.spec() };
    let ctl = Controller::unplanned(job, epoch, (0..world as u64).collect(), Instant::now());
    let ended = drive(&mut processes, ctl, &format!("bench-{epoch}"), None, observe)?;
    match (ended.outcome, ended.bench) {
        (TrainOutcome::Completed { .. }, Some(results)) => Ok(results),
        (TrainOutcome::Completed { .. }, None) => Err(ControlError::Launch("bench moe-layer: rank 0 sent no results".into())),
        (TrainOutcome::Failed { reason, workers }, _) => {
            Err(ControlError::Launch(format!("bench moe-layer failed: {reason}; workers {}", workers.join(", "))))
        }
    }
}
