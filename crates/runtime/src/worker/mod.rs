//! One training worker: a rank of a data- and expert-parallel job (paper §4.2).
//!
//! Every worker builds the model from the same seed and reads the same global batch; it computes
//! on its deterministic share of the batch's sequences. A step is a chain of segments
//! (docs/architecture.md, a training step): one per transformer block, cut at the block's input, plus the
//! head. An MoE block's experts run through [`DistributedMoe`] (dispatch over the padding-free
//! all-to-all, experts on their holders, combine). Backward walks the segments in reverse; in an
//! MoE block the expert path's input gradient arrives over the network first, then one backward
//! of the segment takes the gradient from the block's output, the expert path and the
//! load-balancing loss together. Non-expert gradients are summed over all ranks, each expert's
//! over its holders, and every rank applies the same AdamW update, so replicas stay identical.
//!
//! Losses are scaled by (local tokens / global tokens), so the sum over ranks is exactly the
//! single-process loss of the whole batch and the summed gradients are its gradients.
//!
//! Files: this one builds a worker and moves expert states in and out of it; `step` computes and
//! commits a step (a step that fails is dropped whole); `eval` takes a held-out loss over the
//! ranks; `reconfigure` moves the worker to a new
//! plan among the survivors of a failure; `checkpoint` writes a checkpoint.

mod checkpoint;
mod deterministic;
mod eval;
mod reconfigure;
mod snapshots;
mod step;

pub use reconfigure::{Reconfiguration, ReconfigureReport};
pub use snapshots::{SnapshotHeld, SnapshotSettings, SnapshotStepStats};
pub use step::PendingStep;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use candle_core::{DType, Tensor};
use lazarus_model::optim::TensorState;
use lazarus_model::{StepReport, TrainConfig, Trainer};
use lazarus_plan::ReplicaMap;

use crate::error::RuntimeError;
use crate::expert_state::{ExpertState, EXPERT_TENSORS};
use crate::moe::{DispatchMode, DistributedMoe, ExpertWeights, DEFAULT_BUCKET_BYTES};
use crate::shared_state::SharedState;
use crate::tensor_wire::{put_values, TensorTrainState};
use lazarus_model::ops::with_f32;

/// What a worker needs beyond the training configuration.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Replicas of every expert on every rank, per MoE layer (from a [`lazarus_plan::ModelPlan`]
    /// or static expert parallelism).
    pub plan: ReplicaMap,
    pub mode: DispatchMode,
    /// Deadline of every collective.
    pub timeout: Duration,
    /// Where the worker's model, optimizer state and experts live (`cpu`, or its GPU: see
    /// `lazarus_model::device::for_worker`).
    pub device: candle_core::Device,
}

/// Places in a step or a move where a fault-injection hook is called, so that a test can make
/// a worker die in exactly that phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    /// After the first MoE layer's forward (its all-to-alls done, the rest of the step not).
    Forward,
    /// Just before the gradient all-reduce.
    AllReduce,
    /// Between computing a step and its commit vote.
    Vote,
    /// In a reconfiguration, after this rank's sends and before its receives.
    Transfer,
    /// Before the rendezvous of a move to a new plan (called by the process around the worker).
    Rendezvous,
    /// After a step's commit, before this rank sends that step's snapshots (with the step just
    /// committed): its peers keep only older ones.
    Snapshot,
}

/// Called at every [`FaultPoint`] with the step being computed (for a transfer: the steps
/// committed).
pub type FaultHook = std::sync::Arc<dyn Fn(FaultPoint, u64) + Send + Sync>;

/// Where a parameter lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ParamKind {
    /// Replicated on every rank; gradient summed over all ranks.
    Shared,
    /// Tensor `part` (W1, b1, W2, b2) of expert `expert` of MoE layer `layer`.
    Expert { layer: usize, expert: usize, part: usize },
}

/// One step's outcome on a worker.
#[derive(Debug, Clone)]
pub struct WorkerStepReport {
    /// Same fields as the single-process trainer's report; losses and loads are global.
    pub report: StepReport,
    /// Bytes the MoE layers' all-to-alls sent in this step, summed over every rank (the same on
    /// every rank).
    pub wire_bytes: u64,
    /// Some rank was asked to pause (the same on every rank): stop after this step, between
    /// steps, and wait for the controller's move.
    pub pause: bool,
    /// The previous step's seconds (compute to commit), averaged over the ranks: the same on
    /// every rank, so the snapshot budget drawn from it is too (0 on an epoch's first step).
    pub mean_step_s: f64,
    /// What the last snapshot round cost, summed over the ranks (the same on every rank): what
    /// the adaptive snapshot budget paces itself by.
    pub snapshot_cost: lazarus_plan::RoundCost,
}

/// Sequences [lo, hi) of a global batch of `batch` sequences that rank `rank` of `world` takes:
/// an even split, the first `batch % world` ranks taking one more.
pub fn batch_share(batch: usize, world: usize, rank: usize) -> (usize, usize) {
    let (base, extra) = (batch / world, batch % world);
    let lo = rank * base + rank.min(extra);
    (lo, lo + base + usize::from(rank < extra))
}

/// Check a plan against the model and the world: one layer per MoE layer, the model's experts,
/// one rank per worker; static expert parallelism needs exactly one replica per expert.
pub fn check_plan(plan: &ReplicaMap, moe_layers: usize, experts: usize, world: usize, mode: DispatchMode) -> Result<(), RuntimeError> {
    let bad = |reason: String| RuntimeError::Invalid { field: "placement", reason };
    if plan.layer_count() != moe_layers {
        return Err(bad(format!("{} layers given, the model has {moe_layers} MoE layers", plan.layer_count())));
    }
    if plan.experts() != experts {
        return Err(bad(format!("{} experts per layer, the model has {experts}", plan.experts())));
    }
    if plan.ranks() != world {
        return Err(bad(format!("the plan is for {} ranks, the job has {world} workers", plan.ranks())));
    }
    if mode.is_static() && !plan.one_replica_each() {
        return Err(bad("static expert parallelism needs exactly 1 replica of every expert".into()));
    }
    Ok(())
}

/// What multi-worker training cannot run: fewer sequences than workers, a capacity factor (the
/// distributed step is dropless), trace-driven routing.
pub fn validate_worker_config(config: &TrainConfig, world: usize) -> Result<(), RuntimeError> {
    if world == 0 {
        return Err(RuntimeError::Invalid { field: "workers", reason: "0 (need at least 1)".into() });
    }
    if config.batch_size < world {
        return Err(RuntimeError::Invalid {
            field: "batch_size",
            reason: format!("{} sequences cannot be split over {world} workers", config.batch_size),
        });
    }
    if config.dtype != lazarus_model::Precision::F32 {
        return Err(RuntimeError::Invalid {
            field: "dtype",
            reason: format!("{}: multi-worker training computes in f32 so far (bf16 trains single-process runs)", config.dtype.name()),
        });
    }
    if let Some(cf) = config.model.capacity_factor {
        return Err(RuntimeError::Invalid {
            field: "model.capacity_factor",
            reason: format!("{cf}: multi-worker training is dropless; leave it unset"),
        });
    }
    if config.routing_trace.is_some() {
        return Err(RuntimeError::Invalid { field: "routing_trace", reason: "trace-driven routing is single-process only".into() });
    }
    Ok(())
}

pub struct Worker {
    /// The model, optimizer, sampler and step count (the same object the single-process trainer
    /// uses, so checkpoints are interchangeable).
    pub trainer: Trainer,
    rank: usize,
    world: usize,
    layers: Vec<DistributedMoe>,
    kinds: Vec<ParamKind>,
    plan: ReplicaMap,
    mode: DispatchMode,
    /// Sequences in a shard of a deterministic step ([`Worker::set_shard_sequences`]).
    shard_sequences: usize,
    timeout: Duration,
    /// A step computed everywhere whose commit vote failed (see [`Worker::step`]).
    held: Option<PendingStep>,
    /// The global report of the last step it committed, and the seconds from its compute to
    /// its commit: every rank has the all-reduced loss, so a survivor can give the controller
    /// the report of a step that rank 0 committed but never got out.
    last_committed: Option<(StepReport, f64)>,
    fault: Option<FaultHook>,
    /// The epoch at which the controller asked the job to pause at a step boundary (a join, a
    /// rebalance): see [`Worker::set_pause_signal`].
    pause: Option<PauseSignal>,
    /// Snapshots of experts this worker sends to and keeps for other nodes.
    snapshots: snapshots::SnapshotTier,
    /// Restored experts still catching up: (layer, expert) → extra tokens still to route to it.
    catch_up: BTreeMap<(usize, usize), u64>,
}

/// Set (by another thread) to the epoch at which the controller asks every rank to stop after
/// the current step; `u64::MAX`: no request.
pub type PauseSignal = std::sync::Arc<std::sync::atomic::AtomicU64>;

/// A pause signal with no request.
pub fn pause_signal() -> PauseSignal {
    std::sync::Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX))
}

/// This rank's part of every MoE layer under `plan`: the router and the experts placed here.
fn build_layers(
    trainer: &Trainer,
    plan: &ReplicaMap,
    rank: usize,
    mode: DispatchMode,
    timeout: Duration,
) -> Result<Vec<DistributedMoe>, RuntimeError> {
    let model = &trainer.model;
    let mc = model.config();
    let mut layers = Vec::with_capacity(mc.moe_layers());
    for l in 0..plan.layer_count() {
        let replicas = plan.dense_layer(l);
        let mut experts = BTreeMap::new();
        for (e, row) in replicas.iter().enumerate() {
            if row[rank] > 0 {
                experts.insert(e, ExpertWeights::new(model.expert_vars(l, e)?, model.expert_act())?);
            }
        }
        layers.push(DistributedMoe {
            gate: model.gate(l)?.clone(),
            route_bias: model.route_bias(l)?.cloned(),
            experts,
            replicas,
            top_k: mc.top_k,
            router: mc.router(),
            timeout,
            mode,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            catching_up: Vec::new(),
        });
    }
    Ok(layers)
}

impl Worker {
    /// A worker for rank `rank` of `world`, fresh (`resume` None) or from a checkpoint directory.
    pub fn new(
        config: TrainConfig,
        options: WorkerOptions,
        rank: usize,
        world: usize,
        resume: Option<&Path>,
    ) -> Result<Self, RuntimeError> {
        if rank >= world {
            return Err(RuntimeError::Invalid { field: "rank", reason: format!("rank {rank} of a world of {world}") });
        }
        validate_worker_config(&config, world)?;
        let trainer = match resume {
            Some(dir) => Trainer::resume_on(dir, Some(config.steps), &options.device)?,
            None => Trainer::new_on(config, &options.device)?,
        };
        Self::with_trainer(trainer, options, rank, world)
    }

    /// A worker for rank `rank` of `world` around a trainer already built or resumed (on
    /// `options.device`): the single-process trainer's deterministic step is a world of one.
    pub fn with_trainer(trainer: Trainer, options: WorkerOptions, rank: usize, world: usize) -> Result<Self, RuntimeError> {
        if rank >= world {
            return Err(RuntimeError::Invalid { field: "rank", reason: format!("rank {rank} of a world of {world}") });
        }
        validate_worker_config(&trainer.config, world)?;
        let mc = trainer.model.config().clone();
        check_plan(&options.plan, mc.moe_layers(), mc.n_experts, world, options.mode)?;
        let model = &trainer.model;
        let mut kinds = vec![ParamKind::Shared; model.params().len()];
        for l in 0..mc.moe_layers() {
            for e in 0..mc.n_experts {
                for (part, name) in model.expert_param_names(l, e).iter().enumerate() {
                    let i = model
                        .params()
                        .position(name)
                        .ok_or_else(|| RuntimeError::Invalid { field: "model", reason: format!("no tensor {name}") })?;
                    kinds[i] = ParamKind::Expert { layer: l, expert: e, part };
                }
            }
        }
        let layers = build_layers(&trainer, &options.plan, rank, options.mode, options.timeout)?;
        let mut worker = Worker {
            trainer,
            rank,
            world,
            layers,
            kinds,
            plan: options.plan,
            mode: options.mode,
            shard_sequences: 1,
            timeout: options.timeout,
            held: None,
            last_committed: None,
            fault: None,
            pause: None,
            snapshots: Default::default(),
            catch_up: BTreeMap::new(),
        };
        worker.release_remote_experts()?;
        Ok(worker)
    }

    /// A worker waiting to join a running job: the model built (for its shapes), holding no
    /// expert and nothing of the job's progress yet. A move that names it among its joiners
    /// ([`Reconfiguration::joining`]) gives it the replicated state and its experts.
    pub fn standby(config: TrainConfig, mode: DispatchMode, timeout: Duration, device: candle_core::Device) -> Result<Self, RuntimeError> {
        let mc = config.model.clone();
        let solo = ReplicaMap::new(0, vec![vec![vec![1]; mc.n_experts]; mc.moe_layers()])?;
        let mut worker = Worker::new(config, WorkerOptions { plan: solo, mode, timeout, device }, 0, 1, None)?;
        for l in 0..mc.moe_layers() {
            for e in 0..mc.n_experts {
                worker.trainer.model.set_expert(l, e, None)?;
                for name in worker.trainer.model.expert_param_names(l, e) {
                    let i = worker.position(&name)?;
                    worker.trainer.optimizer.release(i);
                }
            }
        }
        for layer in &mut worker.layers {
            layer.experts.clear();
        }
        Ok(worker)
    }

    /// Let `signal` ask this worker to pause: a step computed at the transport epoch it holds
    /// carries the request in its gradient all-reduce, so every rank learns of it in the same
    /// step and all stop after committing that step ([`WorkerStepReport::pause`]).
    pub fn set_pause_signal(&mut self, signal: Option<PauseSignal>) {
        self.pause = signal;
    }

    /// Whether a pause is asked for at `epoch`.
    fn pause_asked(&self, epoch: u64) -> bool {
        self.pause.as_ref().is_some_and(|p| p.load(std::sync::atomic::Ordering::Relaxed) == epoch)
    }

    /// The replicated training state: every non-expert tensor with its optimizer state, the
    /// step counter and the data cursor.
    pub fn export_shared(&self) -> Result<SharedState, RuntimeError> {
        let model = &self.trainer.model;
        let mut tensors = Vec::new();
        for i in 0..model.params().len() {
            if self.kinds[i] == ParamKind::Shared {
                tensors.push(self.tensor_state(i)?);
            }
        }
        Ok(SharedState { step: self.trainer.step, cursor: self.trainer.sampler.cursor().windows, tensors })
    }

    /// The shapes of the replicated tensors, in parameter order (what [`SharedState::decode`]
    /// checks a peer's bytes against).
    pub fn shared_shapes(&self) -> Vec<Vec<usize>> {
        let vars = self.trainer.model.params().vars();
        (0..vars.len()).filter(|&i| self.kinds[i] == ParamKind::Shared).map(|i| vars[i].dims().to_vec()).collect()
    }

    /// Take in a peer's replicated state (a worker joining a running job).
    pub fn install_shared(&mut self, state: &SharedState) -> Result<(), RuntimeError> {
        let shared: Vec<usize> = (0..self.kinds.len()).filter(|&i| self.kinds[i] == ParamKind::Shared).collect();
        if shared.len() != state.tensors.len() {
            return Err(RuntimeError::Invalid {
                field: "shared state",
                reason: format!("{} tensors, the model has {}", state.tensors.len(), shared.len()),
            });
        }
        let device = self.trainer.model.device().clone();
        let vars = self.trainer.model.params().vars().to_vec();
        for (&i, t) in shared.iter().zip(&state.tensors) {
            if vars[i].dims() != t.shape.as_slice() {
                return Err(RuntimeError::Invalid {
                    field: "shared state",
                    reason: format!("tensor {i}: shape {:?}, expected {:?}", t.shape, vars[i].dims()),
                });
            }
            vars[i].set(&Tensor::from_slice(&t.weight, t.shape.as_slice(), &device)?)?;
            let m = Tensor::from_slice(&t.m, t.shape.as_slice(), &device)?;
            let v = Tensor::from_slice(&t.v, t.shape.as_slice(), &device)?;
            self.trainer.optimizer.set_state(i, TensorState { m, v, step: t.step })?;
        }
        self.trainer.step = state.step;
        self.trainer.sampler.seek(lazarus_model::data::Cursor { windows: state.cursor });
        self.held = None;
        Ok(())
    }

    /// Free the weights and optimizer moments of every expert not placed on this rank: a
    /// worker keeps one physical copy of the experts it holds and nothing of the others.
    fn release_remote_experts(&mut self) -> Result<(), RuntimeError> {
        for l in 0..self.plan.layer_count() {
            for e in 0..self.plan.experts() {
                if self.plan.replicas_on(l, e, self.rank) > 0 || !self.trainer.model.expert_resident(l, e)? {
                    continue;
                }
                self.trainer.model.set_expert(l, e, None)?;
                for name in self.trainer.model.expert_param_names(l, e) {
                    let i = self.position(&name)?;
                    self.trainer.optimizer.release(i);
                }
            }
        }
        Ok(())
    }

    /// Call `hook` at every [`FaultPoint`] (fault injection for tests).
    pub fn set_fault_hook(&mut self, hook: Option<FaultHook>) {
        self.fault = hook;
    }

    pub(crate) fn fault_point(&self, point: FaultPoint, step: u64) {
        if let Some(f) = &self.fault {
            f(point, step);
        }
    }

    /// The experts resident on this worker, per MoE layer: those its plan places here, and
    /// after a reconfiguration that failed before its switch, also those it had received.
    pub fn resident_experts(&self) -> Result<Vec<Vec<usize>>, RuntimeError> {
        let mc = self.trainer.model.config();
        let mut out = Vec::with_capacity(mc.moe_layers());
        for l in 0..mc.moe_layers() {
            let mut here = Vec::new();
            for e in 0..mc.n_experts {
                if self.trainer.model.expert_resident(l, e)? {
                    here.push(e);
                }
            }
            out.push(here);
        }
        Ok(out)
    }

    /// Scalars of expert weights (and, as many again twice, optimizer moments) this worker
    /// keeps in memory.
    pub fn resident_expert_elements(&self) -> usize {
        self.kinds
            .iter()
            .zip(self.trainer.model.params().vars())
            .filter(|(k, _)| matches!(k, ParamKind::Expert { .. }))
            .map(|(_, v)| v.elem_count())
            .sum()
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The plan this worker runs.
    pub fn plan(&self) -> &ReplicaMap {
        &self.plan
    }

    /// Steps completed (committed).
    pub fn steps_done(&self) -> u64 {
        self.trainer.step
    }

    /// The global report of the last step this worker committed, with its seconds (compute to
    /// commit); None before its first commit or after a rollback or move that changed its step.
    pub fn last_committed(&self) -> Option<&(StepReport, f64)> {
        self.last_committed.as_ref().filter(|(r, _)| r.step == self.trainer.step)
    }

    /// The full training state of expert `expert` of MoE layer `layer` (weights and AdamW
    /// moments and steps), which this worker must hold.
    pub fn export_expert(&self, layer: usize, expert: usize) -> Result<ExpertState, RuntimeError> {
        let mut tensors = Vec::with_capacity(EXPERT_TENSORS);
        for index in self.expert_positions(layer, expert)? {
            tensors.push(self.tensor_state(index)?);
        }
        Ok(ExpertState { layer, expert, tensors })
    }

    /// The wire form of [`Self::export_expert`]'s state, written straight from the tensors.
    pub fn encode_expert(&self, layer: usize, expert: usize) -> Result<Vec<u8>, RuntimeError> {
        let (len, encode) = self.expert_encoder(layer, expert)?;
        let mut out = Vec::with_capacity(len);
        encode(&mut out).map_err(|reason| RuntimeError::Invalid { field: "expert state", reason })?;
        Ok(out)
    }

    /// What writes [`Self::encode_expert`]'s bytes — one copy of the values, straight from the
    /// weights and the optimizer's moments — and their length, to run later on another thread
    /// (a snapshot's copy on the transport's copy thread). It holds the tensors and moments it
    /// reads: memory stays valid whatever the worker does meanwhile; the values are those of
    /// this step as long as the optimizer's next update waits for it (the snapshot tier's fence).
    pub(crate) fn expert_encoder(&self, layer: usize, expert: usize) -> Result<(usize, lazarus_comm::Encode), RuntimeError> {
        let positions = self.expert_positions(layer, expert)?;
        let vars = self.trainer.model.params().vars();
        let mut moments = Vec::with_capacity(EXPERT_TENSORS);
        for &i in &positions {
            moments.push(self.trainer.optimizer.moments_anywhere(i)?);
        }
        let shapes: Vec<Vec<usize>> = positions.iter().map(|&i| vars[i].dims().to_vec()).collect();
        let steps: Vec<u64> = moments.iter().map(|m| m.1).collect();
        let weights: Vec<Tensor> = positions.iter().map(|&i| vars[i].as_tensor().clone()).collect();
        let len = ExpertState::encoded_len(&shapes);
        let encode = move |out: &mut Vec<u8>| -> Result<(), String> {
            let mut buf = ExpertState::wire_header_in(std::mem::take(out), layer, expert, &shapes, &steps);
            for (w, (moments, _)) in weights.iter().zip(&moments) {
                with_f32(w, |w| put_values(&mut buf, w)).map_err(|e| format!("layer {layer} expert {expert}: {e}"))?;
                moments.read(|x| put_values(&mut buf, x)).map_err(|e| format!("layer {layer} expert {expert}: {e}"))?;
            }
            *out = buf;
            Ok(())
        };
        Ok((len, Box::new(encode)))
    }

    /// Where expert (`layer`, `expert`)'s tensors sit among the parameters, checking that this
    /// worker holds it.
    fn expert_positions(&self, layer: usize, expert: usize) -> Result<Vec<usize>, RuntimeError> {
        let model = &self.trainer.model;
        if !model.expert_resident(layer, expert)? {
            return Err(RuntimeError::Invalid {
                field: "expert",
                reason: format!("layer {layer} expert {expert} is not held by rank {}", self.rank),
            });
        }
        let names = model.expert_param_names(layer, expert);
        names.iter().map(|n| self.position(n)).collect()
    }

    /// Take in an expert's full training state (weights and optimizer state), replacing what
    /// this worker had of it.
    pub fn install_expert(&mut self, state: &ExpertState) -> Result<(), RuntimeError> {
        let (l, e) = (state.layer, state.expert);
        let device = self.trainer.model.device().clone();
        let shapes = self.trainer.model.expert_shapes();
        if state.tensors.len() != shapes.len() {
            return Err(RuntimeError::Invalid {
                field: "expert state",
                reason: format!("layer {l} expert {e}: {} tensors, the model's experts have {}", state.tensors.len(), shapes.len()),
            });
        }
        let mut weights = Vec::with_capacity(shapes.len());
        for (t, shape) in state.tensors.iter().zip(&shapes) {
            if &t.shape != shape {
                return Err(RuntimeError::Invalid {
                    field: "expert state",
                    reason: format!("layer {l} expert {e}: shape {:?}, expected {shape:?}", t.shape),
                });
            }
            weights.push(Tensor::from_slice(&t.weight, shape.as_slice(), &device)?);
        }
        self.trainer.model.set_expert(l, e, Some(weights))?;
        for (name, t) in self.trainer.model.expert_param_names(l, e).iter().zip(&state.tensors) {
            let i = self.position(name)?;
            let m = Tensor::from_slice(&t.m, t.shape.as_slice(), &device)?;
            let v = Tensor::from_slice(&t.v, t.shape.as_slice(), &device)?;
            self.trainer.optimizer.set_state(i, TensorState { m, v, step: t.step })?;
        }
        // The layer computes with the model's tensors: point it at the new ones if it runs them.
        if self.plan.replicas_on(l, e, self.rank) > 0 {
            let vars = self.trainer.model.expert_vars(l, e)?;
            self.layers[l].experts.insert(e, ExpertWeights::new(vars, self.trainer.model.expert_act())?);
        }
        Ok(())
    }

    pub fn done(&self) -> bool {
        self.trainer.done()
    }

    /// The parameter at `index` with its AdamW state, on the host (what travels in an
    /// [`ExpertState`] or a [`SharedState`]).
    fn tensor_state(&self, index: usize) -> Result<TensorTrainState, RuntimeError> {
        let var = &self.trainer.model.params().vars()[index];
        let s = self.trainer.optimizer.state(index)?;
        let host = |t: &Tensor| -> Result<Vec<f32>, RuntimeError> { Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?) };
        Ok(TensorTrainState { shape: var.dims().to_vec(), weight: host(var.as_tensor())?, m: host(&s.m)?, v: host(&s.v)?, step: s.step })
    }

    fn position(&self, name: &str) -> Result<usize, RuntimeError> {
        self.trainer
            .model
            .params()
            .position(name)
            .ok_or_else(|| RuntimeError::Invalid { field: "model", reason: format!("no tensor {name}") })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_shares_cover_the_batch_once() {
        for batch in 1..20 {
            for world in 1..=batch {
                let mut next = 0;
                for r in 0..world {
                    let (lo, hi) = batch_share(batch, world, r);
                    assert_eq!(lo, next);
                    assert!(hi - lo >= batch / world && hi - lo <= batch.div_ceil(world));
                    next = hi;
                }
                assert_eq!(next, batch);
            }
        }
    }

    #[test]
    fn plans_that_do_not_fit_the_model_or_the_mode_name_the_problem() {
        let p = ReplicaMap::static_ep(0, 1, 4, 2).unwrap();
        assert!(check_plan(&p, 2, 4, 2, DispatchMode::Flexible).unwrap_err().to_string().contains("MoE layers"));
        assert!(check_plan(&p, 1, 5, 2, DispatchMode::Flexible).unwrap_err().to_string().contains("experts"));
        assert!(check_plan(&p, 1, 4, 3, DispatchMode::Flexible).unwrap_err().to_string().contains("3 workers"));
        check_plan(&p, 1, 4, 2, DispatchMode::StaticPadded).unwrap();
        let twice = ReplicaMap::new(0, vec![vec![vec![1, 1], vec![1, 0], vec![0, 1], vec![0, 1]]]).unwrap();
        assert!(check_plan(&twice, 1, 4, 2, DispatchMode::StaticPadded).unwrap_err().to_string().contains("exactly 1"));
        check_plan(&twice, 1, 4, 2, DispatchMode::Flexible).unwrap();
    }
}
