//! The launcher side of `lazarus bench moe-layer`: the same launch and supervision as training.

use std::time::{Duration, Instant};

use lazarus_runtime::bench::{BenchResult, MoeLayerBenchSpec};

use crate::error::ControlError;
use crate::launcher::{check_comm_timeout, fresh_epoch, launch, supervise, Confinement};
use crate::supervisor::{Action, Outcome, Supervisor};

/// Run `spec` on `world` worker processes confined as `confine` says; rank 0's results.
pub fn run_moe_layer_bench(
    spec: &MoeLayerBenchSpec,
    world: usize,
    confine: Confinement,
    observe: impl FnMut(&Action) -> Result<(), ControlError>,
) -> Result<Vec<BenchResult>, ControlError> {
    check_comm_timeout(spec.timeout_s)?;
    let mut processes = launch("bench-worker", world, spec.timeout_s, spec, confine, fresh_epoch())?;
    let start_within = Duration::from_secs_f64(spec.timeout_s.max(10.0) + 60.0);
    let grace = Duration::from_secs_f64(spec.timeout_s + 5.0);
    let mut supervisor = Supervisor::new(world, Instant::now(), start_within, grace);
    match supervise(&mut processes, &mut supervisor, observe)? {
        Outcome::Completed { bench: Some(results), .. } => Ok(results),
        Outcome::Completed { bench: None, .. } => Err(ControlError::Launch("bench moe-layer: rank 0 sent no results".into())),
        Outcome::Failed { first: (rank, end), .. } => Err(ControlError::Launch(format!("bench moe-layer failed: {}", end.describe(rank)))),
        Outcome::StartTimeout { ready, world, waited } => {
            Err(ControlError::Launch(format!("bench moe-layer: {ready} of {world} workers ready after {} s", waited.as_secs())))
        }
    }
}
