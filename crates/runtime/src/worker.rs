//! One training worker: a rank of a data- and expert-parallel job (paper §4.2).
//!
//! Every worker builds the model from the same seed and reads the same global batch; it computes
//! on its deterministic share of the batch's sequences. A step is a chain of segments (DESIGN.md,
//! "Runtime step mechanics"): one per transformer block, cut at the block's input, plus the
//! head. An MoE block's experts run through [`DistributedMoe`] (dispatch over the padding-free
//! all-to-all, experts on their holders, combine). Backward walks the segments in reverse; in an
//! MoE block the expert path's input gradient arrives over the network first, then one backward
//! of the segment takes the gradient from the block's output, the expert path and the
//! load-balancing loss together. Non-expert gradients are summed over all ranks, each expert's
//! over its holders, and every rank applies the same AdamW update, so replicas stay identical.
//!
//! Losses are scaled by (local tokens / global tokens), so the sum over ranks is exactly the
//! single-process loss of the whole batch and the summed gradients are its gradients.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_core::{DType, Tensor, Var};
use lazarus_comm::{all_reduce_sum_f32, bytes_to_f32, f32_to_bytes, recv_named, send_named, Group, Transport};
use lazarus_model::model::cross_entropy;
use lazarus_model::optim::{clip_scale, TensorState};
use lazarus_model::{StepReport, TrainConfig, Trainer};
use lazarus_plan::ReplicaMap;

use crate::error::RuntimeError;
use crate::moe::{DispatchMode, DistributedMoe, ExpertWeights, MoeForward, DEFAULT_BUCKET_BYTES};

/// Tag space for checkpoint gathering (clear of the collectives' tags).
const CHECKPOINT_TAG: u64 = 0x4c5a_0000_0000_0000;

/// What a worker needs beyond the training configuration.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Replicas of every expert on every rank, per MoE layer (from a [`lazarus_plan::ModelPlan`]
    /// or static expert parallelism).
    pub plan: ReplicaMap,
    pub mode: DispatchMode,
    /// Deadline of every collective.
    pub timeout: Duration,
}

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
    /// Bytes this rank sent in the dispatch/combine all-to-alls of this step.
    pub wire_bytes: u64,
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
    if plan.layers().len() != moe_layers {
        return Err(bad(format!("{} layers given, the model has {moe_layers} MoE layers", plan.layers().len())));
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
    timeout: Duration,
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
            Some(dir) => Trainer::resume(dir, Some(config.steps))?,
            None => Trainer::new(config)?,
        };
        let mc = trainer.model.config().clone();
        check_plan(&options.plan, mc.moe_layers(), mc.n_experts, world, options.mode)?;
        let model = &trainer.model;
        let mut kinds = vec![ParamKind::Shared; model.params().len()];
        let mut layers = Vec::with_capacity(mc.moe_layers());
        for (l, replicas) in options.plan.layers().iter().enumerate() {
            let mut experts = BTreeMap::new();
            for (e, row) in replicas.iter().enumerate() {
                for (part, name) in model.expert_param_names(l, e).iter().enumerate() {
                    let i = model
                        .params()
                        .position(name)
                        .ok_or_else(|| RuntimeError::Invalid { field: "model", reason: format!("no tensor {name}") })?;
                    kinds[i] = ParamKind::Expert { layer: l, expert: e, part };
                }
                if row[rank] > 0 {
                    let [w1, b1, w2, b2] = model.expert_vars(l, e)?;
                    experts.insert(e, ExpertWeights { w1, b1, w2, b2 });
                }
            }
            layers.push(DistributedMoe {
                gate: model.gate(l)?.clone(),
                experts,
                replicas: replicas.clone(),
                top_k: mc.top_k,
                timeout: options.timeout,
                mode: options.mode,
                bucket_bytes: DEFAULT_BUCKET_BYTES,
            });
        }
        let mut worker = Worker { trainer, rank, world, layers, kinds, plan: options.plan, timeout: options.timeout };
        worker.release_remote_experts()?;
        Ok(worker)
    }

    /// Free the weights and optimizer moments of every expert not placed on this rank: a
    /// worker keeps one physical copy of the experts it holds and nothing of the others.
    fn release_remote_experts(&mut self) -> Result<(), RuntimeError> {
        for l in 0..self.plan.layers().len() {
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

    pub fn done(&self) -> bool {
        self.trainer.done()
    }

    /// One training step over the global batch; every rank must call it together.
    pub fn step(&mut self, t: &mut dyn Transport, world: &mut Group) -> Result<WorkerStepReport, RuntimeError> {
        let cfg = self.trainer.config.clone();
        let (b, tl) = (cfg.batch_size, cfg.seq_len);
        let batch = self.trainer.sampler.next_batch(b);
        let (lo, hi) = batch_share(b, self.world, self.rank);
        let rows = hi - lo;
        let model = &self.trainer.model;
        let device = model.device().clone();
        let d = model.config().d_model;
        let inputs = Tensor::from_vec(batch.inputs[lo * tl..hi * tl].to_vec(), (rows, tl), &device)?;
        let targets = Tensor::from_vec(batch.targets[lo * tl..hi * tl].to_vec(), rows * tl, &device)?;
        let local_share = (rows * tl) as f64 / (b * tl) as f64;

        // Forward, one segment per block; each later segment starts at a fresh leaf.
        struct Segment {
            input: Option<Var>,
            output: Tensor,
            h: Tensor,
            moe: Option<(usize, MoeForward)>,
        }
        let mut segments: Vec<Segment> = Vec::with_capacity(model.config().n_layers);
        let mut x = model.embed(&inputs)?;
        let mut input: Option<Var> = None;
        let mut wire_bytes = 0u64;
        let mut moe_index = 0;
        for block in 0..model.config().n_layers {
            let (x_mid, h) = model.block_attention(block, &x)?;
            let (y, moe) = match model.block_dense_ffn(block, &h)? {
                Some(y) => (y, None),
                None => {
                    let f = self.layers[moe_index].forward(t, world, &h)?;
                    wire_bytes += f.wire_bytes;
                    moe_index += 1;
                    (f.output.clone(), Some((moe_index - 1, f)))
                }
            };
            let output = (x_mid + y.reshape((rows, tl, d))?)?;
            let leaf = Var::from_tensor(&output.detach())?;
            segments.push(Segment { input: input.take(), output, h, moe });
            x = leaf.as_tensor().clone();
            input = Some(leaf);
        }
        let logits = model.logits(&x)?;
        let ce_local = (cross_entropy(&logits, &targets)? * local_share)?;

        // Backward: the head, then the blocks in reverse.
        let params = model.params().clone();
        let mut grads: Vec<Option<Tensor>> = vec![None; params.len()];
        let take_shared = |store: &candle_core::backprop::GradStore, grads: &mut Vec<Option<Tensor>>| {
            for (i, var) in params.vars().iter().enumerate() {
                if self.kinds[i] == ParamKind::Shared {
                    if let Some(g) = store.get(var.as_tensor()) {
                        grads[i] = Some(g.clone());
                    }
                }
            }
        };
        let store = ce_local.backward()?;
        take_shared(&store, &mut grads);
        let leaf_grad = |store: &candle_core::backprop::GradStore, v: &Var| -> Result<Tensor, RuntimeError> {
            Ok(store.get(v.as_tensor()).cloned().map_or_else(|| v.as_tensor().zeros_like(), Ok)?)
        };
        let mut g = leaf_grad(&store, input.as_ref().expect("at least one block"))?;
        let moe_layers = self.layers.len().max(1) as f64;
        let aux_coef = model.config().aux_loss_coef / moe_layers;
        let mut aux_local = 0.0f64;
        let mut expert_grads: BTreeMap<(usize, usize), Vec<Tensor>> = BTreeMap::new();
        for seg in segments.iter().rev() {
            let mut seed = (&seg.output * &g)?.sum_all()?;
            if let Some((l, f)) = &seg.moe {
                let g_host: Vec<f32> = g.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
                let eg = self.layers[*l].expert_backward(t, world, f, &g_host)?;
                wire_bytes += eg.wire_bytes;
                seed = (seed + (&seg.h * &eg.h_through_experts)?.sum_all()?)?;
                seed = (seed + (&f.aux * aux_coef)?)?;
                aux_local += f.aux.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                for (e, gs) in eg.experts {
                    expert_grads.insert((*l, e), gs);
                }
            }
            let store = seed.backward()?;
            take_shared(&store, &mut grads);
            if let Some(v) = &seg.input {
                g = leaf_grad(&store, v)?;
            }
        }

        // Sum the replicated parameters' gradients (and the loss terms) over all ranks.
        let mut flat: Vec<f32> = Vec::new();
        let mut spans: Vec<(usize, usize)> = Vec::new();
        for (i, var) in params.vars().iter().enumerate() {
            if self.kinds[i] != ParamKind::Shared {
                continue;
            }
            let start = flat.len();
            match &grads[i] {
                Some(g) => flat.extend(g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?),
                None => flat.resize(start + var.elem_count(), 0.0),
            }
            spans.push((i, start));
        }
        // Each expert's squared gradient norm once over the job: every holder adds 1/holders.
        let mut expert_sq = 0.0f64;
        for ((l, e), gs) in &expert_grads {
            let holders = self.plan.holders(*l, *e).len() as f64;
            for g in gs {
                let v: Vec<f32> = g.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
                expert_sq += v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>() / holders;
            }
        }
        let ce_value = ce_local.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let extras = flat.len();
        flat.extend([ce_value as f32, aux_local as f32, expert_sq as f32]);
        all_reduce_sum_f32(t, world, &mut flat, self.timeout)?;
        let (loss, aux_sum, expert_sq) = (flat[extras] as f64, flat[extras + 1] as f64, flat[extras + 2] as f64);
        flat.truncate(extras);

        let mut host: Vec<Option<Vec<f32>>> = vec![None; params.len()];
        let mut shared_sq = 0.0f64;
        for (i, start) in spans {
            let v = flat[start..start + params.vars()[i].elem_count()].to_vec();
            shared_sq += v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
            host[i] = Some(v);
        }
        for (i, kind) in self.kinds.iter().enumerate() {
            if let ParamKind::Expert { layer, expert, part } = *kind {
                if let Some(gs) = expert_grads.get(&(layer, expert)) {
                    host[i] = Some(gs[part].flatten_all()?.to_dtype(DType::F32)?.to_vec1()?);
                }
            }
        }
        let norm = (shared_sq + expert_sq).sqrt();
        let lr =
            lazarus_model::LrSchedule { peak: cfg.lr, min: cfg.min_lr, warmup: cfg.warmup_steps, total: cfg.steps }.at(self.trainer.step);
        self.trainer.optimizer.step_host(&params, &host, lr, clip_scale(norm, cfg.grad_clip))?;
        self.trainer.step += 1;
        let expert_load = segments.iter().filter_map(|s| s.moe.as_ref().map(|(_, f)| f.global_load.clone())).collect();
        Ok(WorkerStepReport {
            report: StepReport {
                step: self.trainer.step,
                loss,
                aux_loss: aux_sum / moe_layers,
                tokens: (b * tl) as u64,
                lr,
                grad_norm: norm,
                expert_load,
                dropped: 0,
            },
            wire_bytes,
        })
    }

    /// Write a checkpoint in the single-process format (so either trainer can resume it): the
    /// first holder of every expert sends its weights and optimizer state to rank 0, which
    /// writes. Every rank must call it together. Returns the path on rank 0.
    pub fn save_checkpoint(&mut self, t: &mut dyn Transport, world: &mut Group, dir: &Path) -> Result<Option<PathBuf>, RuntimeError> {
        let experts = self.plan.experts();
        for l in 0..self.plan.layers().len() {
            for e in 0..experts {
                let Some(&first) = self.plan.holders(l, e).first() else { continue };
                if first == 0 {
                    continue;
                }
                let tag = CHECKPOINT_TAG | ((l as u64) << 20) | e as u64;
                let names = self.trainer.model.expert_param_names(l, e);
                if self.rank == first {
                    let mut buf: Vec<f32> = Vec::new();
                    let mut steps = Vec::new();
                    for name in &names {
                        let i = self.position(name)?;
                        buf.extend(self.trainer.model.params().vars()[i].as_tensor().flatten_all()?.to_vec1::<f32>()?);
                        let s = self.trainer.optimizer.state(i)?;
                        buf.extend(s.m.flatten_all()?.to_vec1::<f32>()?);
                        buf.extend(s.v.flatten_all()?.to_vec1::<f32>()?);
                        steps.push(s.step);
                    }
                    let header = steps.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
                    send_named(t, 0, tag, &header, &f32_to_bytes(&buf), self.timeout)?;
                } else if self.rank == 0 {
                    let (header, bytes) = recv_named(t, first, tag, self.timeout)?;
                    let buf = bytes_to_f32(&bytes)?;
                    let steps: Vec<u64> = header.split(',').map(str::parse).collect::<Result<_, _>>().map_err(|_| {
                        RuntimeError::Invalid { field: "checkpoint", reason: format!("rank {first} sent a bad step list {header:?}") }
                    })?;
                    // Rank 0 does not hold this expert: take it in for the write (released again
                    // below).
                    let shapes = self.trainer.model.expert_shapes();
                    let need: usize = shapes.iter().map(|s| 3 * s.iter().product::<usize>()).sum();
                    if buf.len() != need || steps.len() != names.len() {
                        return Err(RuntimeError::Invalid {
                            field: "checkpoint",
                            reason: format!(
                                "rank {first} sent {} values and {} steps for layer {l} expert {e}, expected {need} and {}",
                                buf.len(),
                                steps.len(),
                                names.len()
                            ),
                        });
                    }
                    let device = self.trainer.model.device().clone();
                    let mut at = 0;
                    let mut weights = Vec::with_capacity(4);
                    let mut states = Vec::with_capacity(4);
                    for (k, shape) in shapes.iter().enumerate() {
                        let n: usize = shape.iter().product();
                        let part = |o: usize| Tensor::from_vec(buf[at + o * n..at + (o + 1) * n].to_vec(), shape.as_slice(), &device);
                        weights.push(part(0)?);
                        states.push(TensorState { m: part(1)?, v: part(2)?, step: steps[k] });
                        at += 3 * n;
                    }
                    let weights: [Tensor; 4] =
                        weights.try_into().map_err(|_| RuntimeError::Invalid { field: "checkpoint", reason: "4 tensors".into() })?;
                    self.trainer.model.set_expert(l, e, Some(weights))?;
                    for (name, state) in names.iter().zip(states) {
                        let i = self.position(name)?;
                        self.trainer.optimizer.set_state(i, state)?;
                    }
                }
            }
        }
        let path = if self.rank == 0 {
            let path = self.trainer.save_checkpoint(dir)?;
            self.release_remote_experts()?;
            Some(path)
        } else {
            None
        };
        lazarus_comm::barrier(t, world, self.timeout)?;
        Ok(path)
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
