//! The launcher side of `lazarus bench moe-layer`, and its ranks' hidden subcommand: the same
//! launch and the same controller as a training job without recovery (the first loss ends it).

use lazarus_agent::Confinement;
use lazarus_comm::Group;
use lazarus_controller::{run_local_job, TrainEvent};
use lazarus_protocol::ControlError;
use lazarus_protocol::WorkerSpec;

use super::{run_moe_layer_bench, BenchResult, MoeLayerBenchSpec};

/// The hidden subcommand of this binary that runs one rank of the benchmark.
pub const RANK_SUBCOMMAND: &str = "bench-worker";

/// Run `spec` on `world` worker processes confined as `confine` says; rank 0's results.
pub fn run_moe_layer_bench_workers(
    spec: &MoeLayerBenchSpec,
    world: usize,
    confine: Confinement,
    observe: impl FnMut(TrainEvent) -> Result<(), ControlError>,
) -> Result<Vec<BenchResult>, ControlError> {
    let workers = lazarus_controller::Workers::new(world, 1, lazarus_controller::Reach::OneMachine)?;
    let results = run_local_job(RANK_SUBCOMMAND, workers, spec.timeout_s, spec, confine, observe)
        .map_err(|e| ControlError::Launch(format!("bench moe-layer failed: {e}")))?;
    let results = results.ok_or_else(|| ControlError::Launch("bench moe-layer: rank 0 sent no results".into()))?;
    serde_json::from_value(results).map_err(|e| ControlError::Launch(format!("bench moe-layer: rank 0's results unreadable: {e}")))
}

/// The hidden `lazarus bench-worker` subcommand: one rank of `bench moe-layer`; its exit code.
pub fn run_rank() -> i32 {
    lazarus_worker::run_rank(|spec: &WorkerSpec<MoeLayerBenchSpec>, t| {
        let results = run_moe_layer_bench(t, &mut Group::world(spec.world), &spec.job)?;
        Ok(Some(serde_json::to_value(results)?))
    })
}
