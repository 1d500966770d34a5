//! Deterministic steps (`--deterministic`): a step's result has the same bits whatever the
//! number of workers and whatever failed, joined, drained or moved on the way.
//!
//! A float sum's bits depend on the order of its terms, and the default step sums over
//! whatever rows a rank holds (one GEMM over its share of the batch), over whichever replica
//! served a token, and over the ranks in their order. Here:
//!
//! * **Shards.** The global batch is cut into shards of one sequence. Each rank runs its shards
//!   one after the other (every rank as many passes as the busiest: a rank with fewer runs a
//!   stand-in of weight zero, which adds nothing), so every product over rows is over one
//!   shard's rows, on any number of workers.
//! * **Experts.** A shard's tokens for an expert go whole to one replica, which computes them as
//!   a block of their own ([`DispatchMode::Deterministic`]); a token's k slot gradients are
//!   added in slot order.
//! * **Exact sums.** Every gradient is summed over shards and over ranks as a fixed-point
//!   integer ([`lazarus_comm::exact`]): integer addition does not care about order or grouping,
//!   so the sum is the same whichever rank computed which shard; it is rounded to f32 once.
//! * **Scalars** (each shard's loss and load-balancing loss, each expert's squared gradient
//!   norm) are written by one rank each into their own slots, so the all-reduce adds zeros to
//!   them, and are added up in shard or expert order; expert loads are integers.
//!
//! What it costs: one pass a sequence instead of one over the rank's share (smaller products,
//! an MoE layer's collectives once a sequence) and the 16-byte exact sums.

use std::collections::BTreeMap;

use candle_core::Tensor;
use lazarus_comm::exact::{all_reduce_exact, ExactSum};
use lazarus_comm::{all_reduce_sum_f32, Group, Transport};

use super::step::{PendingStep, Round};
use super::{batch_share, FaultPoint, ParamKind, Worker};
use crate::error::RuntimeError;
use crate::moe::DispatchMode;

impl Worker {
    /// Whether this worker trains deterministically.
    pub(super) fn deterministic(&self) -> bool {
        self.mode == DispatchMode::Deterministic
    }

    /// Sequences in a shard of a deterministic step (default 1; at least 1, and a divisor of the
    /// batch, or the step says so). Every worker of a job must be given the same: a step's
    /// bits depend on it, not on the workers.
    pub fn set_shard_sequences(&mut self, sequences: usize) {
        self.shard_sequences = sequences.max(1);
    }

    /// [`Worker::compute`] in deterministic mode (see the module's doc).
    pub(super) fn compute_deterministic(
        &mut self,
        t: &mut dyn Transport,
        world: &mut Group,
        started: std::time::Instant,
    ) -> Result<PendingStep, RuntimeError> {
        let cfg = self.trainer.config.clone();
        let (b, tl, per) = (cfg.batch_size, cfg.seq_len, self.shard_sequences);
        if b % per != 0 {
            return Err(RuntimeError::Invalid {
                field: "shard sequences",
                reason: format!("{per} sequences a shard do not divide a batch of {b}"),
            });
        }
        let shards = b / per;
        let batch = self.trainer.sampler.peek_batch(b)?;
        let (lo, hi) = batch_share(shards, self.world, self.rank);
        let passes = shards.div_ceil(self.world.max(1));
        let device = self.trainer.model.device().clone();
        let params = self.trainer.model.params().clone();
        let shared: Vec<usize> = (0..params.len()).filter(|&i| self.kinds[i] == ParamKind::Shared).collect();
        let lens: Vec<usize> = shared.iter().map(|&i| params.vars()[i].elem_count()).collect();
        let layers = self.layers.len();
        let experts = self.layers.first().map_or(0, |l| l.replicas.len());

        let mut dense = ExactSum::zeros(lens.iter().sum());
        let mut expert_sums: BTreeMap<(usize, usize), ExactSum> = BTreeMap::new();
        // Each shard's loss, then each one's load-balancing loss (its rank writes them), then
        // the tokens of each (layer, expert).
        let mut scalars = vec![0f32; 2 * shards + layers * experts];
        let mut wire_bytes = 0u64;
        let weight = 1.0 / shards as f64;
        for pass in 0..passes {
            let shard = lo + pass;
            let real = shard < hi;
            // A rank out of shards runs a stand-in of weight zero (the collectives need it).
            let at = if real { shard } else { lo.min(shards - 1) };
            let rows = at * per * tl..(at + 1) * per * tl;
            let inputs = Tensor::from_vec(batch.inputs[rows.clone()].to_vec(), (per, tl), &device)?;
            let targets = Tensor::from_vec(batch.targets[rows].to_vec(), per * tl, &device)?;
            let w = if real { weight } else { 0.0 };
            let piece = self.forward_backward(t, world, &inputs, &targets, w, w, pass == 0)?;
            wire_bytes += piece.wire_bytes;
            // (A stand-in's rows reach the experts with zero gradients: exact zeros.)
            for (key, blocks) in piece.exact_experts {
                for block in blocks {
                    expert_sums.entry(key).or_insert_with(|| ExactSum::zeros(block.len())).add_f32(0, &block)?;
                }
            }
            if !real {
                continue;
            }
            let parts: Vec<Option<Tensor>> = shared.iter().map(|&i| piece.grads[i].clone()).collect();
            dense.add_f32(0, &crate::host_copy::to_host(&parts, &lens)?)?;
            scalars[shard] = piece.ce_mean as f32;
            scalars[shards + shard] = piece.aux as f32;
            for (l, load) in piece.local_load.iter().enumerate() {
                for (e, &c) in load.iter().enumerate().take(experts) {
                    scalars[2 * shards + l * experts + e] += c as f32;
                }
            }
        }

        let _phase = lazarus_model::profile::phase("gradients");
        self.fault_point(FaultPoint::AllReduce, self.trainer.step + 1);
        all_reduce_exact(t, world, &mut dense, self.timeout)?;
        let flat = dense.to_f32();
        // Every expert held here takes part in its holders' sum, rows or none.
        for (l, layer) in self.layers.iter().enumerate() {
            for (&e, weights) in &layer.experts {
                if layer.replicas.get(e).is_some_and(|r| r.get(self.rank).is_some_and(|&c| c > 0)) {
                    expert_sums.entry((l, e)).or_insert_with(|| ExactSum::zeros(weights.vars().iter().map(|v| v.elem_count()).sum()));
                }
            }
        }
        let expert_grads = self.sum_over_holders(t, expert_sums)?;
        // Each expert's squared gradient norm, from its first holder.
        let mut expert_sq = vec![0f32; layers * experts];
        for (&(l, e), sum) in &expert_grads {
            if self.plan.holders(l, e).first() == Some(&self.rank) {
                expert_sq[l * experts + e] = sum.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>() as f32;
            }
        }
        let sq_at = scalars.len();
        scalars.extend(expert_sq);
        // As in the default step: the pause vote, the step time, the snapshot round's cost
        // (they steer when to pause and how fast to snapshot, not the parameters).
        let extras = scalars.len();
        scalars.extend(self.round_terms(t, wire_bytes));
        if scalars[2 * shards..sq_at].iter().any(|&c| c >= (1u32 << 24) as f32) {
            return Err(RuntimeError::Invalid { field: "expert load", reason: "2^24 tokens or more on one expert in a step".into() });
        }
        {
            let _p = lazarus_model::profile::kernel("transport");
            all_reduce_sum_f32(t, world, &mut scalars, self.timeout)?;
        }
        let loss = scalars[..shards].iter().map(|&x| f64::from(x)).sum::<f64>() / shards as f64;
        let aux_sum = scalars[shards..2 * shards].iter().map(|&x| f64::from(x)).sum::<f64>() / shards as f64;
        let at = 2 * shards;
        let expert_load: Vec<Vec<u64>> =
            (0..layers).map(|l| scalars[at + l * experts..at + (l + 1) * experts].iter().map(|&c| c as u64).collect()).collect();
        let expert_sq: f64 = scalars[sq_at..extras].iter().map(|&x| f64::from(x)).sum();
        let round = Round::of_sums(&scalars[extras..], world.len());

        // The update's gradients: the replicated ones in parameter order, then the experts'.
        let mut summed: Vec<Option<Tensor>> = vec![None; params.len()];
        let shared_sq = self.place_shared(flat, &shared, &lens, &mut summed)?;
        self.place_experts(expert_grads, &params, &device, &mut summed)?;
        drop(_phase);
        Ok(self.pending(started, summed, shared_sq + expert_sq, loss, aux_sum, expert_load, round))
    }

    /// Each expert's summed gradient (its parameters' values one after the other) into
    /// `summed`, at its parameters' places, on `device`.
    fn place_experts(
        &self,
        expert_grads: BTreeMap<(usize, usize), Vec<f32>>,
        params: &lazarus_model::params::ParamStore,
        device: &candle_core::Device,
        summed: &mut [Option<Tensor>],
    ) -> Result<(), RuntimeError> {
        // Each expert's parameters in the order of its tensors (as its gradients come).
        let mut by_expert: BTreeMap<(usize, usize), BTreeMap<usize, usize>> = BTreeMap::new();
        for (i, kind) in self.kinds.iter().enumerate() {
            if let ParamKind::Expert { layer, expert, part } = *kind {
                by_expert.entry((layer, expert)).or_default().insert(part, i);
            }
        }
        for (key, values) in expert_grads {
            let Some(indices) = by_expert.get(&key).map(|parts| parts.values().copied().collect::<Vec<usize>>()) else { continue };
            let shapes: Vec<&[usize]> = indices.iter().map(|&i| params.vars()[i].dims()).collect();
            for (&i, g) in indices.iter().zip(crate::host_copy::from_host(values, &shapes, device)?) {
                summed[i] = Some(g);
            }
        }
        Ok(())
    }

    /// Each local expert's exact gradient summed over its holders (one exact all-reduce per set
    /// of holders, the sets in the same order on every rank): its parameters' values, one after
    /// the other, rounded to f32 once.
    fn sum_over_holders(
        &self,
        t: &mut dyn Transport,
        sums: BTreeMap<(usize, usize), ExactSum>,
    ) -> Result<BTreeMap<(usize, usize), Vec<f32>>, RuntimeError> {
        let mut by_holders: BTreeMap<Vec<usize>, Vec<(usize, usize)>> = BTreeMap::new();
        for &key in sums.keys() {
            by_holders.entry(self.plan.holders(key.0, key.1)).or_default().push(key);
        }
        let mut out = BTreeMap::new();
        for (holders, keys) in by_holders {
            let lens: Vec<usize> = keys.iter().map(|k| sums[k].len()).collect();
            let mut all = ExactSum::zeros(lens.iter().sum());
            let mut at = 0;
            for (k, len) in keys.iter().zip(&lens) {
                all.add_at(at, &sums[k])?;
                at += len;
            }
            if holders.len() > 1 {
                let _p = lazarus_model::profile::kernel("transport");
                all_reduce_exact(t, &mut Group::new(holders)?, &mut all, self.timeout)?;
            }
            let values = all.to_f32();
            let mut at = 0;
            for (k, len) in keys.into_iter().zip(lens) {
                out.insert(k, values[at..at + len].to_vec());
                at += len;
            }
        }
        Ok(out)
    }
}
