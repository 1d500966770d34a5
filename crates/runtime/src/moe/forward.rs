//! The forward pass of a distributed MoE layer.

use candle_core::{DType, Tensor, Var};
use lazarus_comm::{all_gather, all_to_all_v, f32_to_bytes, Group, Transport};
use lazarus_model::profile;
use lazarus_plan::{DispatchSchedule, RankLayout};

use super::distinct::{add_by_token, decode_dispatch, decode_exact, sum_by_token, Arrival};
use super::packing::{pack_one, wire, Local, Packing, Remote, Rows, Source};

use super::{DispatchMode, DistributedMoe, ExpertSegment, MoeForward};
use crate::error::RuntimeError;

/// (first row, rows) of an expert's block in the buffer from each rank.
type Blocks = Vec<(usize, usize)>;

impl DistributedMoe {
    pub(super) fn experts_count(&self) -> usize {
        self.replicas.len()
    }

    /// The sums per token that holders combined ([`super::distinct`]), added in rank order
    /// from zero, as one [n, d] tensor on the layer's device; None where no holder did.
    fn combined_elsewhere(&self, remote: &Remote, results: &[Vec<f32>], n: usize, d: usize) -> Result<Option<Tensor>, RuntimeError> {
        if remote.distinct.iter().all(Option::is_none) {
            return Ok(None);
        }
        let mut sum = vec![0f32; n * d];
        for (distinct, rows) in remote.distinct.iter().zip(results) {
            if let Some(distinct) = distinct {
                add_by_token(&mut sum, &distinct.tokens, rows, d);
            }
        }
        let _p = profile::kernel("to device");
        Ok(Some(Tensor::from_vec(sum, (n, d), self.gate.device())?))
    }

    /// Forward for this rank's tokens `h` [n, d] (a tensor that may carry autograd history).
    pub fn forward(&self, t: &mut dyn Transport, world: &mut Group, h: &Tensor) -> Result<MoeForward, RuntimeError> {
        self.forward_routed(t, world, h, None)
    }

    /// [`DistributedMoe::forward`] with the router's top-k choices replaced by `choices`
    /// (token-major, n·k expert ids; the combine still weights by the router's probabilities):
    /// trace-driven routing, as the paper's ablations use to fix expert loads.
    ///
    /// The steps: route; share the token counts T[e][rank]; schedule and lay out the slots
    /// (§4.3, padding-free); dispatch the rows bound for other ranks; run the experts held
    /// here; send their outputs back (or, where a token came once, Σ w · y); put every slot's
    /// output in its place and combine; the load-balancing loss's share.
    pub fn forward_routed(
        &self,
        t: &mut dyn Transport,
        world: &mut Group,
        h: &Tensor,
        choices: Option<&[u32]>,
    ) -> Result<MoeForward, RuntimeError> {
        let (n, d) = h.dims2()?;
        let (k, me) = (self.top_k, t.rank());
        let Routing { scores, probs, choices, local_load } = self.route(h, choices)?;
        let tokens = {
            let _p = profile::kernel("transport");
            self.gather_token_counts(t, world, &local_load)?
        };
        let schedule = match self.mode {
            DispatchMode::Balanced => DispatchSchedule::compute_balanced(&tokens, &self.replicas)?,
            DispatchMode::Deterministic => DispatchSchedule::compute_whole(&tokens, &self.replicas)?,
            _ => DispatchSchedule::compute(&tokens, &self.replicas)?,
        };
        let layout = RankLayout::new(&schedule, me, &choices)?;
        let packing = Packing::new(&layout, self.mode, &self.replicas, &tokens, me)?;
        // The slots this rank computes itself never leave the device: the experts read their
        // rows from h there, and their outputs stay there for the combine (`Local`).
        let local = Local::new(&layout, &packing, me, k)?;
        let mut remote = packing.without(me);
        if self.mode.sums_on_holders() && !super::distinct::per_slot_forced() {
            remote.send_distinct(&layout, k, d);
        }
        // The combine weights w[t, j] (in h's graph), and on the host where a holder combines.
        let w = lazarus_model::routing::combine_weights(&scores, &choices, n, k, &self.router)?;
        let combine = w.detach().to_dtype(DType::F32)?.reshape((n, k))?;
        // Dispatch.
        let sends = self.pack_dispatch(h, &layout, &remote, &combine, d)?;
        let mut wire_bytes = wire(&sends, me);
        let received = {
            let _p = profile::kernel("transport");
            all_to_all_v(t, world, &sends, self.timeout)?
        };
        let (recv_rows, arrivals): (Vec<Vec<f32>>, Vec<Arrival>) = received
            .iter()
            .enumerate()
            .map(|(src, bytes)| decode_dispatch(bytes, remote.recv_len[src], d, src, "dispatched tokens"))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .unzip();
        let ran = self.run_experts(h, &packing, &local, &remote, &recv_rows, me)?;
        // Return expert outputs to the ranks the tokens came from (same buffers, reversed), or
        // where a token came once, Σ w · y over its slots here.
        let back: Vec<Vec<u8>> = ran
            .outputs_by_src
            .iter()
            .zip(&arrivals)
            .map(|(y, arrival)| match arrival {
                Arrival::InPlace => f32_to_bytes(y),
                Arrival::Distinct { index, distinct, weight } => f32_to_bytes(&sum_by_token(index, *distinct, Some(weight), y, d)),
            })
            .collect();
        wire_bytes += wire(&back, me);
        let results = {
            let _p = profile::kernel("transport");
            all_to_all_v(t, world, &back, self.timeout)?
        };
        // The outputs of the slots whose holder combined them, for the combine weights' gradient
        // in the backward (⟨g, y⟩ is made where y is).
        let held_outputs: Vec<Vec<f32>> = ran
            .outputs_by_src
            .into_iter()
            .zip(&arrivals)
            .map(|(y, arrival)| match arrival {
                Arrival::InPlace => Vec::new(),
                Arrival::Distinct { .. } => y,
            })
            .collect();
        let results: Vec<Vec<f32>> = results
            .iter()
            .enumerate()
            .map(|(dst, bytes)| {
                let rows = remote.distinct[dst].as_ref().map_or(remote.send_len[dst], |x| x.tokens.len());
                decode_exact(bytes, rows * d, dst, "expert results")
            })
            .collect::<Result<_, _>>()?;
        // Where a holder combined, its sums per token, added here in rank order from zero.
        let combined = self.combined_elsewhere(&remote, &results, n, d)?;
        let outputs = ran.outputs.map_or_else(|| Tensor::zeros((0, d), DType::F32, h.device()), Ok)?;
        let slots = SlotSources { layout: &layout, packing: &packing, remote: &remote, me, d };
        let slots_in = slots.gather(outputs, &results, &ran.own_output, n * k)?;
        // Combine segment: out[t] = Σ_j w[t, j] · y[t·k + j].
        let combine_scope = profile::kernel("combine");
        // (The slots are constants of h's graph: their gradient w · g is made explicitly.)
        let mut output = slots_in.reshape((n, k, d))?.broadcast_mul(&w.unsqueeze(2)?)?.sum(1)?;
        if let Some(combined) = combined {
            let combined = combined.to_dtype(output.dtype())?;
            output = (output + combined)?;
        }
        let (global_load, aux) = self.aux_loss(&probs, &tokens, &local_load, h.device())?;
        drop(combine_scope);
        let segments = ran.segments;
        Ok(MoeForward {
            output,
            local_load,
            global_load,
            aux,
            combine,
            weights: w,
            rows_sent: layout.send.iter().enumerate().filter(|(r, _)| *r != me).map(|(_, v)| v.len() as u64).sum(),
            layout,
            packing,
            remote,
            local,
            arrivals,
            held_outputs,
            wire_bytes,
            expert_rows: segments.iter().map(|s| s.3.iter().map(|b| b.1 as u64).sum::<u64>()).sum(),
            expert_segments: segments,
            n,
            d,
        })
    }

    /// The router's probabilities (in h's graph) and top-k choices — or `choices` given, checked
    /// — with the tokens this rank routes to each expert.
    fn route(&self, h: &Tensor, choices: Option<&[u32]>) -> Result<Routing, RuntimeError> {
        let _router = profile::kernel("router");
        let (n, k, e_count) = (h.dims2()?.0, self.top_k, self.experts_count());
        let (scores, probs) = self.router.scores(&h.matmul(self.gate.as_tensor())?)?;
        let host: Vec<Vec<f64>> = scores.to_dtype(DType::F64)?.to_vec2()?;
        let choices: Vec<u32> = match choices {
            Some(c) => {
                if c.len() != n * k || c.iter().any(|&e| e as usize >= e_count) {
                    return Err(RuntimeError::Invalid {
                        field: "choices",
                        reason: format!("{} choices for {n} tokens × top-{k} over {e_count} experts (or an id out of range)", c.len()),
                    });
                }
                c.to_vec()
            }
            None => {
                let bias: Option<Vec<f64>> = self.route_bias.as_ref().map(|b| b.as_tensor().to_dtype(DType::F64)?.to_vec1()).transpose()?;
                let flat: Vec<f64> = host.concat();
                let mut c: Vec<u32> = self.router.choose(&flat, e_count, k, bias.as_deref()).into_iter().map(|c| c as u32).collect();
                super::catch_up::boost_choices(&host, &mut c, k, &self.catching_up, super::catch_up::CATCH_UP_FRACTION);
                c
            }
        };
        let mut local_load = vec![0u64; e_count];
        choices.iter().for_each(|&c| local_load[c as usize] += 1);
        Ok(Routing { scores, probs, choices, local_load })
    }

    /// T[e][rank]: every rank's tokens for each expert (an all-gather of `local_load`).
    fn gather_token_counts(&self, t: &mut dyn Transport, world: &mut Group, local_load: &[u64]) -> Result<Vec<Vec<u64>>, RuntimeError> {
        let e_count = local_load.len();
        let mine: Vec<u8> = local_load.iter().flat_map(|c| c.to_le_bytes()).collect();
        let gathered = all_gather(t, world, &mine, self.timeout)?;
        let mut tokens = vec![vec![0u64; t.world()]; e_count];
        for (rank, bytes) in gathered.iter().enumerate() {
            if bytes.len() != 8 * e_count {
                return Err(RuntimeError::Invalid {
                    field: "token counts",
                    reason: format!("rank {rank} sent {} bytes, expected {}", bytes.len(), 8 * e_count),
                });
            }
            for (e, c) in bytes.chunks_exact(8).enumerate() {
                tokens[e][rank] = u64::from_le_bytes(c.try_into().expect("8 bytes"));
            }
        }
        Ok(tokens)
    }

    /// The dispatch buffer to each rank: the row of h of every slot bound there, at its place
    /// in the buffer — or, where the holder combines, each distinct token once with its
    /// weights. Empty for this rank (its slots stay on the device).
    fn pack_dispatch(
        &self,
        h: &Tensor,
        layout: &RankLayout,
        remote: &Remote,
        combine: &Tensor,
        d: usize,
    ) -> Result<Vec<Vec<u8>>, RuntimeError> {
        let _pack = profile::kernel("to host");
        let k = self.top_k;
        let w_host: Vec<f32> = if remote.distinct.iter().any(Option::is_some) { combine.flatten_all()?.to_vec1()? } else { Vec::new() };
        let h_host: Vec<f32> =
            if remote.send_len.iter().any(|&l| l > 0) { h.to_dtype(DType::F32)?.flatten_all()?.to_vec1()? } else { Vec::new() };
        let token_row = |tok: usize| &h_host[tok * d..(tok + 1) * d];
        Ok((0..remote.send_len.len())
            .map(|dst| match &remote.distinct[dst] {
                Some(distinct) => {
                    let weight: Vec<f32> = layout.send[dst].iter().map(|&s| w_host[s as usize]).collect();
                    distinct.encode_dispatch(&weight, d, |tok| token_row(tok as usize))
                }
                None => pack_one(&remote.send_rows[dst], remote.send_len[dst], d, |i| token_row(layout.send[dst][i] as usize / k)),
            })
            .collect())
    }

    /// Run every expert held here on its rows — from every source in rank order: other ranks'
    /// in one copy to the device, this rank's own gathered from h where it is — and split the
    /// outputs: other ranks' in one copy to the host, this rank's kept on the device.
    fn run_experts(
        &self,
        h: &Tensor,
        packing: &Packing,
        local: &Local,
        remote: &Remote,
        recv_rows: &[Vec<f32>],
        me: usize,
    ) -> Result<ExpertsRun, RuntimeError> {
        let _experts = profile::kernel("experts");
        let d = h.dims2()?.1;
        let ranks = recv_rows.len();
        // (expert, its (first row, rows) block from each rank), in expert order.
        let mut held: Vec<(usize, Blocks)> = Vec::new();
        let mut rows_in = Rows::new(h.detach(), d);
        for e in 0..self.experts_count() {
            let blocks: Blocks = (0..ranks).map(|src| packing.recv_blocks[src][e]).collect();
            if blocks.iter().all(|b| b.1 == 0) {
                continue;
            }
            if !self.experts.contains_key(&e) {
                return Err(RuntimeError::Invalid {
                    field: "placement",
                    reason: format!("rank {me} received tokens for expert {e} it does not hold"),
                });
            }
            for (src, &(o, c)) in blocks.iter().enumerate() {
                for r in o..o + c {
                    match src == me {
                        true => rows_in.push_device(local.token_at[r]),
                        false => rows_in.push_host(&recv_rows[src][r * d..(r + 1) * d]),
                    }
                }
            }
            held.push((e, blocks));
        }
        let mut ran = ExpertsRun {
            segments: Vec::with_capacity(held.len()),
            outputs_by_src: remote.recv_len.iter().map(|&l| vec![0f32; l * d]).collect(),
            own_output: vec![None; local.token_at.len()],
            outputs: None,
        };
        if held.is_empty() {
            return Ok(ran);
        }
        let x_dev = rows_in.gather()?;
        let (mut at, mut ys) = (0, Vec::with_capacity(held.len()));
        for (e, blocks) in held {
            for blocks in self.segments_of(blocks) {
                let total: usize = blocks.iter().map(|b| b.1).sum();
                let x = Var::from_tensor(&x_dev.narrow(0, at, total)?)?;
                at += total;
                let y = self.experts[&e].forward(x.as_tensor())?;
                ys.push(y.detach());
                ran.segments.push((e, x, y, blocks));
            }
        }
        let y_dev = Tensor::cat(&ys, 0)?;
        // The outputs other ranks wait for, in one copy to the host; this rank's own stay.
        let (mut row, mut going) = (0, Vec::new());
        for (_, _, _, blocks) in &ran.segments {
            for (src, &(o, c)) in blocks.iter().enumerate() {
                for r in o..o + c {
                    match src == me {
                        true => ran.own_output[r] = Some(row as u32),
                        false => going.push(row as u32),
                    }
                    row += 1;
                }
            }
        }
        let y_host: Vec<f32> = if going.is_empty() {
            Vec::new()
        } else {
            let _p = profile::kernel("to host");
            lazarus_model::ops::gather_rows(&y_dev, &going)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?
        };
        let mut at = 0;
        for (_, _, _, blocks) in &ran.segments {
            for (src, &(o, c)) in blocks.iter().enumerate().filter(|(src, _)| *src != me) {
                ran.outputs_by_src[src][o * d..(o + c) * d].copy_from_slice(&y_host[at * d..(at + c) * d]);
                at += c;
            }
        }
        ran.outputs = Some(y_dev);
        Ok(ran)
    }

    /// The segments an expert's blocks are computed in: all at once, or — deterministic — each
    /// sender's block on its own (see `DispatchMode`), as segments of one block each, in the
    /// same row order.
    fn segments_of(&self, blocks: Blocks) -> Vec<Blocks> {
        if self.mode != DispatchMode::Deterministic {
            return vec![blocks];
        }
        (0..blocks.len())
            .filter(|&src| blocks[src].1 > 0)
            .map(|src| blocks.iter().enumerate().map(|(s, &(o, c))| if s == src { (o, c) } else { (o, 0) }).collect())
            .collect()
    }

    /// Each expert's tokens from all ranks, and this rank's share of the Switch load-balancing
    /// loss (in the graph of `probs`); deterministic, the share of this rank's own tokens.
    fn aux_loss(
        &self,
        probs: &Tensor,
        tokens: &[Vec<u64>],
        local_load: &[u64],
        device: &candle_core::Device,
    ) -> Result<(Vec<u64>, Tensor), RuntimeError> {
        let global_load: Vec<u64> = tokens.iter().map(|per_rank| per_rank.iter().sum()).collect();
        let shares = if self.mode == DispatchMode::Deterministic { local_load } else { &global_load };
        // Cannot overflow: the dispatch schedule bounds the grand total.
        let assignments: u64 = shares.iter().sum();
        let global_tokens = (assignments / self.top_k as u64).max(1) as f64;
        let e_count = shares.len();
        let f: Vec<f32> = shares.iter().map(|&c| c as f32 / assignments.max(1) as f32).collect();
        let f = Tensor::from_vec(f, e_count, device)?.to_dtype(probs.dtype())?;
        let aux = ((probs.sum(0)? * f)?.sum_all()? * (e_count as f64 / global_tokens))?;
        Ok((global_load, aux))
    }
}

/// The router's decision for this rank's tokens.
struct Routing {
    /// The router's scores [n, E], in h's graph ([`lazarus_model::routing::Router::scores`]).
    scores: Tensor,
    /// The probabilities the balance loss reads (the softmax, or sigmoid scores over their sum).
    probs: Tensor,
    /// Token-major, n·k expert ids.
    choices: Vec<u32>,
    /// This rank's tokens for each expert.
    local_load: Vec<u64>,
}

/// What this rank's experts made of the rows sent to them.
struct ExpertsRun {
    segments: Vec<ExpertSegment>,
    /// Per source rank: the outputs of its rows here (buffer order, host); this rank's empty.
    outputs_by_src: Vec<Vec<f32>>,
    /// Each row of this rank's own buffer: its row among the outputs on the device.
    own_output: Vec<Option<u32>>,
    /// Every output row on the device (None: this rank computed nothing).
    outputs: Option<Tensor>,
}

/// Where each of this rank's slots finds its output.
struct SlotSources<'a> {
    layout: &'a RankLayout,
    packing: &'a Packing,
    remote: &'a Remote,
    me: usize,
    d: usize,
}

impl SlotSources<'_> {
    /// Every slot's output in its place [slots, d]: from the results other ranks sent (one copy
    /// to the device), or from this rank's own `outputs` on the device; a slot nobody computed
    /// (or whose holder combined it) is zero.
    fn gather(&self, outputs: Tensor, results: &[Vec<f32>], own_output: &[Option<u32>], slots: usize) -> Result<Tensor, RuntimeError> {
        let SlotSources { layout, packing, remote, me, d } = *self;
        let mut by_slot: Vec<Option<Source>> = vec![None; slots];
        for (dst, rows) in results.iter().enumerate().filter(|(dst, _)| *dst != me && remote.distinct[*dst].is_none()) {
            for (i, &s) in layout.send[dst].iter().enumerate() {
                let r = packing.send_rows[dst][i];
                by_slot[s as usize] = Some(Source::Host(&rows[r * d..(r + 1) * d]));
            }
        }
        for (i, &s) in layout.send[me].iter().enumerate() {
            by_slot[s as usize] = own_output[packing.send_rows[me][i]].map(Source::Device);
        }
        let mut rows = Rows::new(outputs, d);
        for source in by_slot {
            match source {
                Some(Source::Host(row)) => rows.push_host(row),
                Some(Source::Device(r)) => rows.push_device(Some(r)),
                None => rows.push_device(None),
            }
        }
        let _combine = profile::kernel("combine");
        rows.gather()
    }
}
