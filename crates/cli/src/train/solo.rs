//! The single process's step: the trainer's own, or with `--deterministic` the workers'
//! deterministic step on a world of one.
//!
//! A deterministic step's bits depend on its shard size, not on the number of workers
//! (`lazarus_runtime::worker::deterministic`). Run in this process as rank 0 of 1 — every expert
//! held here, the collectives over a [`LocalTransport`] that only loops back — it is the same
//! code and so the same bits as any number of worker processes: a model trained with its
//! experts replicated over 4 workers and the same job in one process write the same checkpoint
//! and export the same Hugging Face files, byte for byte.

use std::time::Duration;

use anyhow::{bail, Result};
use lazarus_comm::{Group, LocalTransport};
use lazarus_model::{StepReport, Trainer};
use lazarus_runtime::{DispatchMode, Worker, WorkerOptions};

/// How the single process steps.
pub(super) enum SoloStep {
    /// The trainer's step over the whole batch at once (the default).
    Plain(Box<Trainer>),
    /// The deterministic step of a world of one (`--deterministic`).
    Deterministic(Box<DeterministicSolo>),
}

/// Rank 0 of a world of one, with every expert.
pub(super) struct DeterministicSolo {
    worker: Worker,
    transport: LocalTransport,
    group: Group,
}

/// Deadline of a collective over the loopback transport (it never waits: a receive with
/// nothing sent fails at once).
const LOCAL_TIMEOUT: Duration = Duration::from_secs(30);

impl SoloStep {
    /// `trainer` stepping plainly, or deterministically in shards of `shard_sequences`
    /// sequences (`Some`: `--deterministic`).
    pub(super) fn new(trainer: Trainer, shard_sequences: Option<usize>) -> Result<Self> {
        let Some(sequences) = shard_sequences else { return Ok(SoloStep::Plain(Box::new(trainer))) };
        check_deterministic(&trainer.config, sequences)?;
        let mc = trainer.model.config();
        let plan = lazarus_plan::ReplicaMap::static_ep(0, mc.moe_layers(), mc.n_experts, 1)?;
        let device = trainer.model.device().clone();
        let options = WorkerOptions { plan, mode: DispatchMode::Deterministic, timeout: LOCAL_TIMEOUT, device };
        let mut worker = Worker::with_trainer(trainer, options, 0, 1)?;
        worker.set_shard_sequences(sequences);
        Ok(SoloStep::Deterministic(Box::new(DeterministicSolo { worker, transport: LocalTransport::new(0), group: Group::world(1) })))
    }

    /// The model, optimizer, data cursor and step count.
    pub(super) fn trainer(&self) -> &Trainer {
        match self {
            SoloStep::Plain(t) => t,
            SoloStep::Deterministic(d) => &d.worker.trainer,
        }
    }

    /// One training step over the global batch.
    pub(super) fn step(&mut self) -> Result<StepReport> {
        match self {
            SoloStep::Plain(t) => Ok(t.step()?),
            SoloStep::Deterministic(d) => Ok(d.worker.step(&mut d.transport, &mut d.group)?.report),
        }
    }
}

/// What a deterministic step cannot run, named by its flag: it computes in f32, drops no token
/// and routes by the router, in whole shards of the batch.
fn check_deterministic(cfg: &lazarus_model::TrainConfig, sequences: usize) -> Result<()> {
    if cfg.dtype != lazarus_model::Precision::F32 {
        bail!("--deterministic with --dtype {}: deterministic steps compute in f32", cfg.dtype.name());
    }
    if let Some(cf) = cfg.model.capacity_factor {
        bail!("--deterministic with --capacity-factor {cf}: deterministic steps are dropless (leave it unset)");
    }
    if cfg.routing_trace.is_some() {
        bail!("--deterministic with --routing-trace: deterministic steps route by the router");
    }
    super::args::check_shard_sequences(Some(sequences), cfg.batch_size)
}
