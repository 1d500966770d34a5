//! A training step in two halves: [`Worker::compute`] runs every collective of the step and
//! returns a [`PendingStep`]; [`Worker::commit`] applies it. Nothing that outlives a step —
//! parameters, optimizer state, data cursor, step counter — changes before the commit, so a step
//! that fails anywhere (a peer lost mid-dispatch, mid-backward, mid-all-reduce) is dropped and
//! re-run on the same global batch with the same result (docs/architecture.md: no partial step).
//!
//! Between the halves [`Worker::step`] takes a commit vote (a barrier over every rank): a rank
//! commits only once every rank has finished computing. A failure during the vote can leave some
//! survivors committed and others not; those hold their complete pending step
//! ([`Worker::held_step`]), and since every rank that reached the vote holds the same summed
//! gradients, committing it later ([`Worker::commit_held`]) gives the same state — the
//! controller resolves the step by the furthest survivor.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor, Var};
use lazarus_comm::{all_reduce_sum_f32, barrier, Group, Transport};
use lazarus_model::model::cross_entropy;
use lazarus_model::optim::clip_scale;
use lazarus_model::StepReport;

use super::{batch_share, FaultPoint, ParamKind, Worker, WorkerStepReport};
use crate::error::RuntimeError;
use crate::moe::MoeForward;

/// A step computed on every rank but not applied: the global loss and loads, and the gradients
/// summed over the ranks that share each tensor.
#[derive(Debug, Clone)]
pub struct PendingStep {
    /// The step counter this step was computed at (it completes step `at + 1`).
    at: u64,
    /// Summed gradients in parameter order (None: no update for that tensor), on the worker's
    /// device.
    grads: Vec<Option<Tensor>>,
    lr: f64,
    grad_scale: f64,
    /// Windows of the global batch: the data cursor moves past them on commit.
    batch: usize,
    report: WorkerStepReport,
    /// When its compute began (the step's seconds, on commit).
    started: std::time::Instant,
}

/// One piece of a step's batch, forward and backward ([`Worker::forward_backward`]).
pub(super) struct MicroBatch {
    /// The replicated parameters' gradients over this piece (None: no gradient), weighted.
    pub grads: Vec<Option<Tensor>>,
    /// Local experts' gradients summed over their holders, by (layer, expert) (default modes).
    pub expert_grads: BTreeMap<(usize, usize), Vec<Tensor>>,
    /// Local experts' gradients over the rows computed here, not yet over their holders
    /// ([`crate::moe::DispatchMode::Deterministic`]).
    pub exact_experts: BTreeMap<(usize, usize), Vec<Vec<f32>>>,
    /// The piece's cross-entropy (unweighted: its mean over its tokens).
    pub ce_mean: f64,
    /// The MoE layers' load-balancing losses, summed over the layers (unweighted).
    pub aux: f64,
    pub wire_bytes: u64,
    /// Tokens routed to each expert from this rank / from all ranks, per MoE layer.
    pub local_load: Vec<Vec<u64>>,
    pub global_load: Vec<Vec<u64>>,
}

/// [`Worker::round_terms`] as summed over the ranks.
pub(super) struct Round {
    pub pause: bool,
    pub mean_step_s: f64,
    /// Bytes the step's MoE all-to-alls sent, summed over the ranks.
    pub wire_bytes: u64,
    pub snapshot_cost: lazarus_plan::RoundCost,
}

/// A byte count as two f32 terms of a sum over the ranks: its 64 KiB units and the bytes below.
/// Every partial sum is an integer below 2^24, so the sum is exact in any order while the ranks'
/// total stays under 2^40 bytes and there are at most 256 ranks.
fn bytes_terms(bytes: u64) -> [f32; 2] {
    [(bytes >> 16) as f32, (bytes & 0xffff) as f32]
}

/// The byte count whose [`bytes_terms`] summed to `units` and `rest`.
fn bytes_of_sums(units: f32, rest: f32) -> u64 {
    ((units as u64) << 16) + rest as u64
}

impl Round {
    /// From the sums of every rank's round terms (`world` ranks).
    pub(super) fn of_sums(sums: &[f32], world: usize) -> Self {
        let terms = lazarus_plan::RoundCost::TERMS;
        Round {
            pause: sums[0] > 0.5,
            mean_step_s: f64::from(sums[1]) / world.max(1) as f64,
            wire_bytes: bytes_of_sums(sums[2], sums[3]),
            snapshot_cost: lazarus_plan::RoundCost::from_sums(
                sums[4..4 + terms].try_into().expect("the cost's terms follow the vote, the time and the bytes"),
            ),
        }
    }
}

impl PendingStep {
    /// Tokens per (layer, expert) over the global batch of this step.
    pub(crate) fn expert_load(&self) -> &[Vec<u64>] {
        &self.report.report.expert_load
    }

    /// The step this would complete.
    pub fn step(&self) -> u64 {
        self.at + 1
    }
}

impl Worker {
    /// Compute the next step over the global batch — forward, backward, every gradient
    /// collective — without changing anything that outlives the step. Every rank must call it
    /// together; on error nothing has changed and the step can be re-run on a new transport.
    pub fn compute(&mut self, t: &mut dyn Transport, world: &mut Group) -> Result<PendingStep, RuntimeError> {
        let started = std::time::Instant::now();
        for (l, layer) in self.layers.iter_mut().enumerate() {
            layer.catching_up = self.catch_up.keys().filter(|k| k.0 == l).map(|k| k.1).collect();
        }
        if self.deterministic() {
            return self.compute_deterministic(t, world, started);
        }
        let cfg = self.trainer.config.clone();
        let (b, tl) = (cfg.batch_size, cfg.seq_len);
        let batch = self.trainer.sampler.peek_batch(b)?;
        let (lo, hi) = batch_share(b, self.world, self.rank);
        let rows = hi - lo;
        let model = &self.trainer.model;
        let device = model.device().clone();
        let inputs = Tensor::from_vec(batch.inputs[lo * tl..hi * tl].to_vec(), (rows, tl), &device)?;
        let targets = Tensor::from_vec(batch.targets[lo * tl..hi * tl].to_vec(), rows * tl, &device)?;
        let local_share = (rows * tl) as f64 / (b * tl) as f64;
        let pass = self.forward_backward(t, world, &inputs, &targets, local_share, 1.0, true)?;
        let params = model.params().clone();
        let MicroBatch { mut grads, expert_grads, ce_mean, aux: aux_local, wire_bytes, global_load, .. } = pass;
        let ce_value = ce_mean * local_share;
        // Sum the replicated parameters' gradients (and the loss terms) over all ranks: one
        // host buffer (one copy off a GPU), the loss terms after them.
        let _phase = lazarus_model::profile::phase("gradients");
        let shared: Vec<usize> = (0..params.len()).filter(|&i| self.kinds[i] == ParamKind::Shared).collect();
        let lens: Vec<usize> = shared.iter().map(|&i| params.vars()[i].elem_count()).collect();
        let parts: Vec<Option<Tensor>> = shared.iter().map(|&i| grads[i].take()).collect();
        let mut flat = crate::host_copy::to_host(&parts, &lens)?;
        drop(parts);
        // Each expert's squared gradient norm once over the job: every holder adds 1/holders.
        // All in one pass (on a GPU one launch and one small copy, not one of each per expert).
        let mut expert_sq = 0.0f64;
        let holders: Vec<f64> =
            expert_grads.iter().flat_map(|((l, e), gs)| std::iter::repeat_n(self.plan.holders(*l, *e).len() as f64, gs.len())).collect();
        let every: Vec<Tensor> = expert_grads.values().flatten().cloned().collect();
        for (sq, holders) in lazarus_model::optim::sum_squares(&every)?.into_iter().zip(holders) {
            expert_sq += sq / holders;
        }
        let extras = flat.len();
        flat.extend([ce_value as f32, aux_local as f32, expert_sq as f32]);
        flat.extend(self.round_terms(t, wire_bytes));
        self.fault_point(FaultPoint::AllReduce, self.trainer.step + 1);
        {
            let _p = lazarus_model::profile::kernel("transport");
            all_reduce_sum_f32(t, world, &mut flat, self.timeout)?;
        }
        let (loss, aux_sum, expert_sq) = (flat[extras] as f64, flat[extras + 1] as f64, flat[extras + 2] as f64);
        let round = Round::of_sums(&flat[extras + 3..], world.len());
        flat.truncate(extras);

        let mut summed: Vec<Option<Tensor>> = vec![None; params.len()];
        let shared_sq = self.place_shared(flat, &shared, &lens, &mut summed)?;
        for (i, kind) in self.kinds.iter().enumerate() {
            if let ParamKind::Expert { layer, expert, part } = *kind {
                if let Some(gs) = expert_grads.get(&(layer, expert)) {
                    summed[i] = Some(gs[part].clone());
                }
            }
        }
        drop(_phase);
        Ok(self.pending(started, summed, shared_sq + expert_sq, loss, aux_sum, global_load, round))
    }

    /// What every step sums over the ranks after its own terms: a vote of the ranks asked to
    /// pause (so that every rank learns in this step that one was, and all stop after it), this
    /// rank's last step time (for the snapshot budget, summed into a mean), and what the last
    /// snapshot round cost this rank (lazarus_plan::RoundCost: whether its frames are not all
    /// written yet, and the CPU they took against the process's since the last step).
    /// `wire_bytes`: what this rank's MoE all-to-alls sent in the step ([`bytes_terms`]).
    pub(super) fn round_terms(&mut self, t: &mut dyn Transport, wire_bytes: u64) -> Vec<f32> {
        let pause_vote = f32::from(u8::from(self.pause_asked(t.epoch())));
        let last_s = self.last_committed.as_ref().map_or(0.0, |(_, s)| *s);
        let mut terms = vec![pause_vote, last_s as f32];
        terms.extend(bytes_terms(wire_bytes));
        terms.extend(self.snapshots.round_cost_here(t));
        terms
    }

    /// The replicated parameters' summed gradients (`flat`, in parameter order) in their places
    /// of `summed`, on the worker's device; their squared norm, per tensor and then added in
    /// parameter order (as the single process's norm).
    pub(super) fn place_shared(
        &self,
        flat: Vec<f32>,
        shared: &[usize],
        lens: &[usize],
        summed: &mut [Option<Tensor>],
    ) -> Result<f64, RuntimeError> {
        let mut shared_sq = 0.0f64;
        let mut at = 0;
        for len in lens {
            shared_sq += flat[at..at + len].iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>();
            at += len;
        }
        let params = self.trainer.model.params();
        let shapes: Vec<&[usize]> = shared.iter().map(|&i| params.vars()[i].dims()).collect();
        for (i, g) in shared.iter().zip(crate::host_copy::from_host(flat, &shapes, self.trainer.model.device())?) {
            summed[*i] = Some(g);
        }
        Ok(shared_sq)
    }

    /// The step computed, not applied: the update's gradients, clipped by their norm (from its
    /// square `sq`), at the schedule's learning rate, and the step's report.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn pending(
        &self,
        started: std::time::Instant,
        grads: Vec<Option<Tensor>>,
        sq: f64,
        loss: f64,
        aux_sum: f64,
        expert_load: Vec<Vec<u64>>,
        round: Round,
    ) -> PendingStep {
        let cfg = &self.trainer.config;
        let (at, norm) = (self.trainer.step, sq.sqrt());
        let lr = lazarus_model::LrSchedule { peak: cfg.lr, min: cfg.min_lr, warmup: cfg.warmup_steps, total: cfg.steps }.at(at);
        let report = StepReport {
            step: at + 1,
            loss,
            aux_loss: aux_sum / self.layers.len().max(1) as f64,
            tokens: (cfg.batch_size * cfg.seq_len) as u64,
            lr,
            grad_norm: norm,
            expert_load,
            dropped: 0,
        };
        let Round { pause, mean_step_s, wire_bytes, snapshot_cost } = round;
        PendingStep {
            at,
            grads,
            lr,
            grad_scale: clip_scale(norm, cfg.grad_clip),
            batch: cfg.batch_size,
            report: WorkerStepReport { report, wire_bytes, pause, mean_step_s, snapshot_cost },
            started,
        }
    }

    /// Forward and backward of one piece of the batch (`inputs` [rows, T], `targets` [rows·T]):
    /// the loss seeded with `ce_weight` (its share of the step's mean) and each MoE layer's
    /// load-balancing loss with `aux_weight`. Every MoE layer's collectives run inside, so
    /// every rank must call it together. `first`: the step's first piece (its fault point).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_backward(
        &self,
        t: &mut dyn Transport,
        world: &mut Group,
        inputs: &Tensor,
        targets: &Tensor,
        ce_weight: f64,
        aux_weight: f64,
        first: bool,
    ) -> Result<MicroBatch, RuntimeError> {
        let forward_phase = lazarus_model::profile::phase("forward");
        let model = &self.trainer.model;
        let (rows, tl) = inputs.dims2()?;
        let d = model.config().d_model;
        // Forward, one segment per block; each later segment starts at a fresh leaf.
        struct Segment {
            input: Option<Var>,
            output: Tensor,
            h: Tensor,
            moe: Option<(usize, MoeForward)>,
        }
        let mut segments: Vec<Segment> = Vec::with_capacity(model.config().n_layers);
        let mut x = model.embed(inputs)?;
        let mut input: Option<Var> = None;
        let mut wire_bytes = 0u64;
        let mut moe_index = 0;
        for block in 0..model.config().n_layers {
            let (x_mid, h) = model.block_attention(block, &x)?;
            let (y, moe) = self.block_ffn(t, world, block, &mut moe_index, &h)?;
            if let Some((l, f)) = &moe {
                if *l == 0 && first {
                    self.fault_point(FaultPoint::Forward, self.trainer.step + 1);
                }
                wire_bytes += f.wire_bytes;
            }
            let output = lazarus_model::ops::residual_add(&x_mid, &y.reshape((rows, tl, d))?)?;
            let leaf = Var::from_tensor(&output.detach())?;
            segments.push(Segment { input: input.take(), output, h, moe });
            x = leaf.as_tensor().clone();
            input = Some(leaf);
        }
        let logits = model.logits(&x)?;
        let ce = cross_entropy(&logits, targets)?;
        let ce_local = (&ce * ce_weight)?;

        drop(forward_phase);
        // Backward: the head, then the blocks in reverse.
        let _backward_phase = lazarus_model::profile::phase("backward");
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
        let Some(last) = input.as_ref() else {
            return Err(RuntimeError::Invalid { field: "model", reason: "has no blocks".into() });
        };
        let mut g = leaf_grad(&store, last)?;
        let moe_layers = self.layers.len().max(1) as f64;
        let aux_coef = model.config().aux_weight() / moe_layers * aux_weight;
        let mut aux = 0.0f64;
        let mut expert_grads: BTreeMap<(usize, usize), Vec<Tensor>> = BTreeMap::new();
        let mut exact_experts: BTreeMap<(usize, usize), Vec<Vec<f32>>> = BTreeMap::new();
        let mut local_load = vec![Vec::new(); self.layers.len()];
        let mut global_load = vec![Vec::new(); self.layers.len()];
        for seg in segments.iter().rev() {
            let mut seed = (&seg.output * &g)?.sum_all()?;
            if let Some((l, f)) = &seg.moe {
                let eg = self.layers[*l].expert_backward(t, world, f, &g)?;
                wire_bytes += eg.wire_bytes;
                seed = (seed + (&seg.h * &eg.h_through_experts)?.sum_all()?)?;
                seed = (seed + (&f.aux * aux_coef)?)?;
                if let Some(cg) = &eg.combine_grad {
                    seed = (seed + (&f.weights * cg.to_dtype(f.weights.dtype())?)?.sum_all()?)?;
                }
                aux += f.aux.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                for (e, gs) in eg.experts {
                    expert_grads.insert((*l, e), gs);
                }
                for (e, blocks) in eg.exact {
                    exact_experts.insert((*l, e), blocks);
                }
                local_load[*l] = f.local_load.clone();
                global_load[*l] = f.global_load.clone();
            }
            let store = seed.backward()?;
            take_shared(&store, &mut grads);
            if let Some(v) = &seg.input {
                g = leaf_grad(&store, v)?;
            }
        }
        let ce = ce.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        Ok(MicroBatch { grads, expert_grads, exact_experts, ce_mean: ce, aux, wire_bytes, local_load, global_load })
    }

    /// The feed-forward part of `block` for its normed input `h`: the dense FFN, or the MoE
    /// layer `*moe_index` over the ranks (then counted) with the shared experts beside it —
    /// dense weights, in the block's graph like the attention's. The MoE layer's forward comes
    /// back too, for the backward.
    pub(super) fn block_ffn(
        &self,
        t: &mut dyn Transport,
        world: &mut Group,
        block: usize,
        moe_index: &mut usize,
        h: &Tensor,
    ) -> Result<(Tensor, Option<(usize, MoeForward)>), RuntimeError> {
        let model = &self.trainer.model;
        if let Some(y) = model.block_dense_ffn(block, h)? {
            return Ok((y, None));
        }
        let l = *moe_index;
        let f = self.layers[l].forward(t, world, h)?;
        *moe_index += 1;
        let y = match model.block_shared_ffn(block, h)? {
            Some(shared) => lazarus_model::ops::residual_add(&f.output, &shared)?,
            None => f.output.clone(),
        };
        Ok((y, Some((l, f))))
    }

    /// Apply a computed step: AdamW on every tensor with a gradient, the data cursor past the
    /// batch, the step counter up by one. Local: no collective.
    pub fn commit(&mut self, pending: PendingStep) -> Result<WorkerStepReport, RuntimeError> {
        if pending.at != self.trainer.step {
            return Err(RuntimeError::Invalid {
                field: "pending step",
                reason: format!("computed at step {}, the worker is at step {}", pending.at, self.trainer.step),
            });
        }
        // The update changes expert weights in place: the last step's snapshot copies first.
        // Should they not finish, the step stays held, as after a failed vote.
        if let Err(e) = self.settle_snapshot_copies() {
            self.held = Some(pending);
            return Err(e);
        }
        let params = self.trainer.model.params().clone();
        let _phase = lazarus_model::profile::phase("update");
        self.trainer.optimizer.step_tensors(&params, &pending.grads, pending.lr, pending.grad_scale, &[])?;
        drop(_phase);
        // The loss-free balancing's bias follows the step's global loads: the same on every rank
        // and as in one process over the same batch.
        self.trainer.model.update_route_biases(&pending.report.report.expert_load)?;
        self.trainer.sampler.advance(pending.batch);
        self.trainer.step += 1;
        // Counted here, not in the snapshot round: a held step committed after a failure
        // (`commit_held`) has no snapshot round, and its tokens are lost all the same.
        self.snapshots.count_committed(self.trainer.step, &pending.report.report.expert_load);
        // A catching-up expert's global load is about (1 + f) of what the router alone gives
        // it: f/(1 + f) of it is the catch-up (the same figure on every rank).
        let f = crate::moe::catch_up::CATCH_UP_FRACTION;
        let load = &pending.report.report.expert_load;
        self.catch_up.retain(|&(l, e), left| {
            let got = load.get(l).and_then(|x| x.get(e)).copied().unwrap_or(0) as f64;
            *left = left.saturating_sub(((got * f / (1.0 + f)).round() as u64).max(1));
            *left > 0
        });
        self.held = None;
        self.last_committed = Some((pending.report.report.clone(), pending.started.elapsed().as_secs_f64()));
        Ok(pending.report)
    }

    /// One training step over the global batch: compute, the commit vote, commit. Every rank
    /// must call it together. On error nothing has changed; if the error came in the vote, the
    /// computed step is held ([`Worker::held_step`]) for the controller to commit or drop.
    pub fn step(&mut self, t: &mut dyn Transport, world: &mut Group) -> Result<WorkerStepReport, RuntimeError> {
        self.held = None;
        let pending = self.compute(t, world)?;
        // Every rank has the same all-reduced loss and norm, so all refuse the same step: none
        // is applied and the job stops (a checkpoint is never written from it).
        let r = &pending.report.report;
        for (what, value) in [("loss", r.loss), ("gradient norm", r.grad_norm)] {
            if !value.is_finite() {
                return Err(lazarus_model::ModelError::Diverged { step: r.step, what, value }.into());
            }
        }
        self.fault_point(FaultPoint::Vote, pending.step());
        let vote = {
            let _p = lazarus_model::profile::phase("vote");
            barrier(t, world, self.timeout)
        };
        if let Err(e) = vote {
            self.held = Some(pending);
            return Err(e.into());
        }
        self.commit(pending)
    }

    /// The step a computed-but-uncommitted step would complete, if one is held after a failed
    /// commit vote.
    pub fn held_step(&self) -> Option<u64> {
        self.held.as_ref().map(PendingStep::step)
    }

    /// Commit the held step (some rank is known to have committed it).
    pub fn commit_held(&mut self) -> Result<Option<WorkerStepReport>, RuntimeError> {
        match self.held.take() {
            Some(p) => self.commit(p).map(Some),
            None => Ok(None),
        }
    }

    /// Forget the held step (no rank committed it; it will be re-run).
    pub fn drop_held(&mut self) {
        self.held = None;
    }
}

#[cfg(test)]
mod tests {
    use super::{bytes_of_sums, bytes_terms};

    /// 256 ranks' byte counts summed as f32 terms in two orders: the exact total either way.
    #[test]
    fn byte_counts_sum_exactly_over_the_ranks() {
        let counts: Vec<u64> = (0..256u64).map(|r| (r.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) % (1 << 32)).collect();
        let total: u64 = counts.iter().sum();
        assert!(total < 1 << 40);
        for order in [counts.clone(), counts.iter().rev().copied().collect()] {
            let mut sums = [0f32; 2];
            for c in order {
                let [u, r] = bytes_terms(c);
                sums[0] += u;
                sums[1] += r;
            }
            assert_eq!(bytes_of_sums(sums[0], sums[1]), total);
        }
        assert_eq!(bytes_of_sums(bytes_terms(0)[0], bytes_terms(0)[1]), 0);
    }
}
