//! One MoE layer of the single-process model: its router (top-k over the experts, capacity
//! drops, trace-driven loads), its experts run grouped by expert, the weighted combine, the
//! shared experts, and the load-balancing loss.

use super::*;

/// Router plus experts of one MoE layer.
pub struct MoeLayer {
    pub(super) gate: Var,
    /// The loss-free balancing's bias per expert [E] (None without it): added to the router's
    /// probabilities to choose the top-k, moved by [`MoeModel::update_route_biases`], never by a
    /// gradient.
    pub(super) route_bias: Option<Var>,
    pub experts: Vec<Ffn>,
    /// The always-on shared experts, as one FFN (None without).
    pub(super) shared: Option<Ffn>,
    /// Their gate's weight [d, 1] (Qwen2-MoE's `shared_expert_gate`; None: ungated).
    pub(super) shared_gate: Option<Var>,
    pub(super) top_k: usize,
    /// How the router scores and picks ([`crate::routing::Router`]).
    pub(super) router: crate::routing::Router,
    pub(super) act: Activation,
    pub(super) capacity_factor: Option<f64>,
}

/// What one MoE layer did in a step.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeStats {
    /// Tokens routed to each expert (top-k assignments, before any capacity drop).
    pub load: Vec<u64>,
    /// Assignments dropped by the capacity factor.
    pub dropped: u64,
    /// The k experts of each token, token-major (n·k ids).
    pub choices: Vec<u32>,
}

/// Where an MoE layer's tokens go in one step: each token's k experts, the loads, and each
/// expert's assignments in token order (those past a capacity dropped).
pub(super) struct Routing {
    pub(super) choices: Vec<usize>,
    pub(super) load: Vec<u64>,
    pub(super) dropped: u64,
    /// Per expert, the token of each of its assignments, in token order.
    pub(super) tokens: Vec<Vec<u32>>,
    /// Per expert, the slot (token · k + j) of each of its assignments.
    pub(super) slots: Vec<Vec<u32>>,
}

impl Routing {
    /// Rows grouped by expert: (each expert's row count, every row's token, every row's slot),
    /// the experts in order, each one's rows in token order.
    pub(super) fn grouped(&self) -> (Vec<usize>, Vec<u32>, Vec<u32>) {
        (self.tokens.iter().map(Vec::len).collect(), self.tokens.concat(), self.slots.concat())
    }

    /// What the step reports of it.
    pub(super) fn into_stats(self) -> MoeStats {
        MoeStats { load: self.load, dropped: self.dropped, choices: self.choices.into_iter().map(|c| c as u32).collect() }
    }
}

impl MoeLayer {
    /// The shared experts' output `y` [N, d] for tokens h [N, d], times σ(h·w) per token when
    /// the layer gates them (Qwen2-MoE), in the gate weight's type (f32 under bf16 products) and
    /// back to y's.
    pub(super) fn gate_shared(&self, h: &Tensor, y: Tensor) -> Result<Tensor> {
        let Some(w) = &self.shared_gate else { return Ok(y) };
        let gate = crate::ops::sigmoid(&h.to_dtype(w.dtype())?.matmul(w.as_tensor())?)?;
        Ok(y.to_dtype(w.dtype())?.broadcast_mul(&gate)?.to_dtype(y.dtype())?)
    }

    /// The routing of `n` tokens from their router probabilities (host copy, token-major), or
    /// from `forced` loads (trace-driven routing). The same on every device.
    pub(super) fn route(&self, host: &[f64], n: usize, forced: Option<&[f64]>) -> Result<Routing> {
        let e_count = self.experts.len();
        let k = self.top_k;
        let choices: Vec<usize> = match forced {
            Some(loads) => assign_from_loads(loads, n, k)?,
            None => {
                let bias: Option<Vec<f64>> = self.route_bias.as_ref().map(|b| b.as_tensor().to_dtype(DType::F64)?.to_vec1()).transpose()?;
                self.router.choose(host, e_count, k, bias.as_deref())
            }
        };
        let mut load = vec![0u64; e_count];
        choices.iter().for_each(|&c| load[c] += 1);
        let capacity = self.capacity_factor.map(|cf| ((cf * (n * k) as f64 / e_count as f64).ceil() as usize).max(1));
        // Assignments per expert, in token order; beyond capacity they are dropped (the
        // residual connection carries those tokens).
        let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); e_count];
        let mut slots: Vec<Vec<u32>> = vec![Vec::new(); e_count];
        let mut dropped = 0u64;
        for (slot, &e) in choices.iter().enumerate() {
            if capacity.is_some_and(|c| tokens[e].len() >= c) {
                dropped += 1;
                continue;
            }
            tokens[e].push((slot / k) as u32);
            slots[e].push(slot as u32);
        }
        Ok(Routing { choices, load, dropped, tokens, slots })
    }

    /// From the router's logits [n, E]: the probabilities the balance loss reads (in the
    /// logits' graph), the routing, and each (token, choice)'s weight [n·k].
    pub(super) fn route_logits(&self, logits: &Tensor, n: usize, forced: Option<&[f64]>) -> Result<(Tensor, Routing, Tensor)> {
        let (scores, probs) = self.router.scores(logits)?;
        let host: Vec<f64> = scores.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let r = self.route(&host, n, forced)?;
        let w = self.combine_weights(&scores, &r.choices, n)?;
        Ok((probs, r, w))
    }

    /// The router weight of each (token, choice) [n·k], in the router's graph.
    pub(super) fn combine_weights(&self, scores: &Tensor, choices: &[usize], n: usize) -> Result<Tensor> {
        let choices: Vec<u32> = choices.iter().map(|&c| c as u32).collect();
        Ok(crate::routing::combine_weights(scores, &choices, n, self.top_k, &self.router)?.flatten_all()?)
    }

    /// Switch load-balancing loss: E · Σ_e f_e · P_e, f_e the share of assignments (constant),
    /// P_e the mean router probability (differentiable).
    pub(super) fn aux_loss(&self, probs: &Tensor, load: &[u64], n: usize) -> Result<Tensor> {
        let e_count = self.experts.len();
        let f: Vec<f64> = load.iter().map(|&c| c as f64 / (n * self.top_k) as f64).collect();
        let f = Tensor::from_vec(f, e_count, probs.device())?.to_dtype(probs.dtype())?;
        Ok(((probs.mean(0)? * f)?.sum_all()? * e_count as f64)?)
    }

    /// h: [N, d] → ([N, d], aux loss scalar, stats). `forced` replaces the router's choices with
    /// assignments matching the given per-expert loads (trace-driven routing).
    ///
    /// The expert weights' gradients go to `expert_grads` (see [`ForwardOutput::backward`]).
    pub(super) fn forward(
        &self,
        h: &Tensor,
        forced: Option<&[f64]>,
        expert_grads: &WeightGradSink,
        compute: DType,
    ) -> Result<(Tensor, Tensor, MoeStats)> {
        let (n, _d) = h.dims2()?;
        // The router's product in `compute`, its softmax in h's dtype (the residual stream's).
        let logits = h.to_dtype(compute)?.matmul(&self.gate.as_tensor().to_dtype(compute)?)?.to_dtype(h.dtype())?;
        let (probs, r, w) = self.route_logits(&logits, n, forced)?;
        // Every expert in one node over the rows grouped by expert, then weighted and scattered
        // back onto the token rows.
        let (counts, all_tokens, all_slots) = r.grouped();
        let out = if all_tokens.is_empty() {
            h.zeros_like()?
        } else {
            let count = all_tokens.len();
            let s_idx = Tensor::from_vec(all_slots, count, h.device())?;
            let cast: Vec<[Tensor; 4]> = self.experts.iter().map(|x| x.weights_in(compute)).collect::<candle_core::Result<_>>()?;
            let weights: Vec<[&Tensor; 4]> = cast.iter().map(|w| w.each_ref()).collect();
            let rows = crate::ops::gather_rows(h, &all_tokens)?.to_dtype(compute)?;
            let y = crate::ops::grouped_expert_ffn_to_sink(&rows, &weights, &counts, self.act, expert_grads)?.to_dtype(h.dtype())?;
            crate::ops::combine_rows(&y, &w.index_select(&s_idx, 0)?, &all_tokens, n)?
        };
        let out = match &self.shared {
            Some(shared) => crate::ops::residual_add(&out, &self.gate_shared(h, shared.forward(h, compute)?)?)?,
            None => out,
        };
        let aux = self.aux_loss(&probs, &r.load, n)?;
        Ok((out, aux, r.into_stats()))
    }

    /// [`MoeLayer::forward`] with the GPU ops: h comes in the products' type (the norm wrote
    /// it); the router's logits, softmax and loss are f32 (the residual stream's type), the
    /// experts compute on their working copies, and the combine writes the residual stream's type
    /// from the experts' rows. No cast node enters the graph.
    #[cfg(feature = "cuda")]
    pub(super) fn forward_gpu(
        &self,
        model: &MoeModel,
        h: &Tensor,
        forced: Option<&[f64]>,
        expert_grads: &WeightGradSink,
    ) -> Result<(Tensor, Tensor, MoeStats)> {
        let (n, d) = h.dims2()?;
        let stream = model.dtype;
        let logits = crate::ops::cuda_linear(h, &self.gate, None, model.copy_of(&self.gate), stream)?;
        let (probs, r, w) = self.route_logits(&logits, n, forced)?;
        let (counts, all_tokens, all_slots) = r.grouped();
        let out = if all_tokens.is_empty() {
            Tensor::zeros((n, d), stream, h.device())?
        } else {
            // Each expert's parameters, [W1, b1, W2, b2] or [W1, W2] without FFN biases.
            let params: Vec<Vec<Var>> = self.experts.iter().map(Ffn::vars).collect();
            let tensors: Vec<Vec<&Tensor>> = params.iter().map(|p| p.iter().map(|v| v.as_tensor()).collect()).collect();
            let masters: Vec<&[&Tensor]> = tensors.iter().map(Vec::as_slice).collect();
            let copies: Option<Vec<[Tensor; 2]>> =
                params.iter().map(|p| Some([model.copy_of(&p[0])?.clone(), model.copy_of(&p[p.len() / 2])?.clone()])).collect();
            let rows = crate::ops::gather_rows(h, &all_tokens)?;
            let y = crate::ops::cuda::grouped_expert_ffn_to_sink(&rows, &masters, copies.as_deref(), &counts, self.act, expert_grads)?;
            // Each row's weight read through its slot: no index_select, whose backward on a GPU is
            // candle's index_add (one thread over every row).
            crate::ops::cuda::combine_rows_to(&y, &w, Some(&all_slots), &all_tokens, n, stream)?
        };
        let out = match &self.shared {
            Some(shared) => crate::ops::residual_add(&out, &self.gate_shared(h, shared.forward_gpu(model, h, stream)?)?)?,
            None => out,
        };
        let aux = self.aux_loss(&probs, &r.load, n)?;
        Ok((out, aux, r.into_stats()))
    }
}
