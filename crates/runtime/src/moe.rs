//! One MoE layer across ranks.

use std::collections::BTreeMap;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use lazarus_comm::{all_gather, all_reduce_sum_f32, all_to_all_v, bytes_to_f32, f32_to_bytes, Group, Transport};
use lazarus_model::ops::{expert_ffn, softmax_last};
use lazarus_model::routing::top_k;
use lazarus_plan::{DispatchSchedule, RankLayout};

use crate::error::RuntimeError;

/// One physical copy of an expert (f32).
#[derive(Debug, Clone)]
pub struct ExpertWeights {
    pub w1: Var,
    pub b1: Var,
    pub w2: Var,
    pub b2: Var,
}

impl ExpertWeights {
    fn vars(&self) -> [&Var; 4] {
        [&self.w1, &self.b1, &self.w2, &self.b2]
    }
}

/// This rank's part of an MoE layer: the replicated router and the experts placed here.
pub struct DistributedMoe {
    pub gate: Var,
    /// Experts with at least one replica on this rank.
    pub experts: BTreeMap<usize, ExpertWeights>,
    /// R[e][rank] of the current placement.
    pub replicas: Vec<Vec<u32>>,
    pub top_k: usize,
    pub timeout: Duration,
}

/// What the forward pass keeps for backward.
pub struct MoeForward {
    /// The layer output for this rank's tokens [n, d].
    pub output: Tensor,
    /// Tokens routed to each expert from this rank.
    pub local_load: Vec<u64>,
    layout: RankLayout,
    /// Input to the combine segment: expert outputs of this rank's slots [n·k, d].
    slots_in: Var,
    /// Per local expert: (leaf input, output, rows per source rank in arrival order).
    expert_segments: Vec<(usize, Var, Tensor, Vec<usize>)>,
    n: usize,
    d: usize,
}

fn rows_bytes(rows: &[f32]) -> Vec<u8> {
    f32_to_bytes(rows)
}

impl DistributedMoe {
    fn experts_count(&self) -> usize {
        self.replicas.len()
    }

    /// Forward for this rank's tokens `h` [n, d] (a tensor that may carry autograd history).
    pub fn forward(&self, t: &mut dyn Transport, world: &mut Group, h: &Tensor) -> Result<MoeForward, RuntimeError> {
        let (n, d) = h.dims2()?;
        let e_count = self.experts_count();
        let k = self.top_k;
        let ranks = t.world();
        let me = t.rank();
        // Router segment (stays in h's graph).
        let probs = softmax_last(&h.matmul(self.gate.as_tensor())?)?;
        let host: Vec<Vec<f64>> = probs.to_dtype(DType::F64)?.to_vec2()?;
        let choices: Vec<u32> = host.iter().flat_map(|row| top_k(row, k)).map(|c| c as u32).collect();
        let mut local_load = vec![0u64; e_count];
        choices.iter().for_each(|&c| local_load[c as usize] += 1);
        // All-gather T[e][rank].
        let mine: Vec<u8> = local_load.iter().flat_map(|c| c.to_le_bytes()).collect();
        let gathered = all_gather(t, world, &mine, self.timeout)?;
        let mut tokens = vec![vec![0u64; ranks]; e_count];
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
        let schedule = DispatchSchedule::compute(&tokens, &self.replicas)?;
        let layout = RankLayout::new(&schedule, me, &choices)?;
        // Dispatch: rows of h for each slot, in the layout's order.
        let h_host: Vec<f32> = h.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let sends: Vec<Vec<u8>> = layout
            .send
            .iter()
            .map(|slots| {
                let mut rows = Vec::with_capacity(slots.len() * d);
                for &s in slots {
                    let tok = s as usize / k;
                    rows.extend_from_slice(&h_host[tok * d..(tok + 1) * d]);
                }
                rows_bytes(&rows)
            })
            .collect();
        let received = all_to_all_v(t, world, &sends, self.timeout)?;
        // Expert segments: per local expert, its rows from every source in rank order.
        let recv_rows: Vec<Vec<f32>> = received.iter().map(|b| bytes_to_f32(b)).collect::<Result<_, _>>()?;
        let mut offsets = vec![0usize; ranks]; // row cursor into each source buffer
        let mut segments = Vec::new();
        let mut outputs_by_src: Vec<Vec<f32>> = (0..ranks).map(|src| vec![0f32; recv_rows[src].len()]).collect();
        for e in 0..e_count {
            let counts: Vec<usize> = (0..ranks).map(|src| layout.recv[src][e] as usize).collect();
            let total: usize = counts.iter().sum();
            if total == 0 {
                continue;
            }
            let Some(weights) = self.experts.get(&e) else {
                return Err(RuntimeError::Invalid {
                    field: "placement",
                    reason: format!("rank {me} received tokens for expert {e} it does not hold"),
                });
            };
            let mut x = Vec::with_capacity(total * d);
            for src in 0..ranks {
                let (o, c) = (offsets[src], counts[src]);
                x.extend_from_slice(&recv_rows[src][o * d..(o + c) * d]);
            }
            let x = Var::from_tensor(&Tensor::from_vec(x, (total, d), &Device::Cpu)?)?;
            let y = expert_ffn(x.as_tensor(), weights.w1.as_tensor(), weights.b1.as_tensor(), weights.w2.as_tensor(), weights.b2.as_tensor())?;
            let y_host: Vec<f32> = y.flatten_all()?.to_vec1()?;
            let mut row = 0;
            for src in 0..ranks {
                let (o, c) = (offsets[src], counts[src]);
                outputs_by_src[src][o * d..(o + c) * d].copy_from_slice(&y_host[row * d..(row + c) * d]);
                row += c;
                offsets[src] += c;
            }
            segments.push((e, x, y, counts));
        }
        // Return expert outputs to the ranks the tokens came from.
        let back: Vec<Vec<u8>> = outputs_by_src.iter().map(|v| rows_bytes(v)).collect();
        let results = all_to_all_v(t, world, &back, self.timeout)?;
        let mut slots = vec![0f32; n * k * d];
        for (dst, bytes) in results.iter().enumerate() {
            let rows = bytes_to_f32(bytes)?;
            if rows.len() != layout.send[dst].len() * d {
                return Err(RuntimeError::Invalid {
                    field: "expert results",
                    reason: format!("rank {dst} returned {} values, expected {}", rows.len(), layout.send[dst].len() * d),
                });
            }
            for (i, &s) in layout.send[dst].iter().enumerate() {
                let s = s as usize;
                slots[s * d..(s + 1) * d].copy_from_slice(&rows[i * d..(i + 1) * d]);
            }
        }
        // Combine segment: out[t] = Σ_j w[t, j] · y[t·k + j].
        let slots_in = Var::from_tensor(&Tensor::from_vec(slots, (n, k, d), &Device::Cpu)?)?;
        let idx = Tensor::from_vec(choices.clone(), (n, k), &Device::Cpu)?;
        let mut w = probs.gather(&idx, 1)?;
        if k > 1 {
            w = w.broadcast_div(&w.sum_keepdim(1)?)?;
        }
        let output = slots_in.as_tensor().broadcast_mul(&w.unsqueeze(2)?)?.sum(1)?;
        Ok(MoeForward {
            output,
            local_load,
            layout,
            slots_in,
            expert_segments: segments,
            n,
            d,
        })
    }

    /// Backward given d(loss)/d(output) for this rank's tokens. Returns the gradient with
    /// respect to `h` that flows through the experts (the router path's share reaches `h` and
    /// the gate through `router_grads`, the GradStore of `(output·grad).sum()` on this rank).
    /// Expert gradients are summed over each expert's holders and the gate gradient over the
    /// world, so every replica ends with the same full gradient.
    pub fn backward(
        &self,
        t: &mut dyn Transport,
        world: &mut Group,
        fwd: &MoeForward,
        grad_output: &Tensor,
    ) -> Result<MoeGrads, RuntimeError> {
        let (n, d, k) = (fwd.n, fwd.d, self.top_k);
        let ranks = t.world();
        let e_count = self.experts_count();
        // Combine segment backward: gradients for the slots input, the router (gate) and h.
        let seeded = (&fwd.output * grad_output.detach())?.sum_all()?;
        let router = seeded.backward()?;
        let d_slots: Vec<f32> = router
            .get(fwd.slots_in.as_tensor())
            .map(|g| g.flatten_all().and_then(|g| g.to_vec1()))
            .transpose()?
            .unwrap_or_else(|| vec![0.0; n * k * d]);
        // Send slot gradients to where each slot was processed (same layout as dispatch).
        let sends: Vec<Vec<u8>> = fwd
            .layout
            .send
            .iter()
            .map(|slots| {
                let mut rows = Vec::with_capacity(slots.len() * d);
                for &s in slots {
                    let s = s as usize;
                    rows.extend_from_slice(&d_slots[s * d..(s + 1) * d]);
                }
                rows_bytes(&rows)
            })
            .collect();
        let received = all_to_all_v(t, world, &sends, self.timeout)?;
        let recv_rows: Vec<Vec<f32>> = received.iter().map(|b| bytes_to_f32(b)).collect::<Result<_, _>>()?;
        // Expert segments backward, in the same order as forward.
        let mut offsets = vec![0usize; ranks];
        let mut dx_by_src: Vec<Vec<f32>> = recv_rows.iter().map(|r| vec![0f32; r.len()]).collect();
        let mut expert_grads: BTreeMap<usize, [Tensor; 4]> = BTreeMap::new();
        for (e, x, y, counts) in &fwd.expert_segments {
            let total: usize = counts.iter().sum();
            let mut gy = Vec::with_capacity(total * d);
            for src in 0..ranks {
                let (o, c) = (offsets[src], counts[src]);
                gy.extend_from_slice(&recv_rows[src][o * d..(o + c) * d]);
            }
            let gy = Tensor::from_vec(gy, (total, d), &Device::Cpu)?;
            let grads = (y * gy)?.sum_all()?.backward()?;
            let weights = &self.experts[e];
            let get = |v: &Var| -> Result<Tensor, RuntimeError> {
                Ok(grads.get(v.as_tensor()).cloned().map_or_else(|| v.as_tensor().zeros_like(), Ok)?)
            };
            expert_grads.insert(*e, [get(&weights.w1)?, get(&weights.b1)?, get(&weights.w2)?, get(&weights.b2)?]);
            let dx: Vec<f32> = get(x)?.flatten_all()?.to_vec1()?;
            let mut row = 0;
            for src in 0..ranks {
                let (o, c) = (offsets[src], counts[src]);
                dx_by_src[src][o * d..(o + c) * d].copy_from_slice(&dx[row * d..(row + c) * d]);
                row += c;
                offsets[src] += c;
            }
        }
        // Input gradients back to the token's rank, accumulated per token.
        let back: Vec<Vec<u8>> = dx_by_src.iter().map(|v| rows_bytes(v)).collect();
        let results = all_to_all_v(t, world, &back, self.timeout)?;
        let mut dh = vec![0f32; n * d];
        for (dst, bytes) in results.iter().enumerate() {
            let rows = bytes_to_f32(bytes)?;
            for (i, &s) in fwd.layout.send[dst].iter().enumerate() {
                let tok = s as usize / k;
                dh[tok * d..(tok + 1) * d].iter_mut().zip(&rows[i * d..(i + 1) * d]).for_each(|(a, b)| *a += b);
            }
        }
        // Gradient synchronisation: each expert over its holders, the gate over the world.
        let mut synced = BTreeMap::new();
        for e in 0..e_count {
            let holders: Vec<usize> = (0..ranks).filter(|&r| self.replicas[e][r] > 0).collect();
            if !holders.contains(&t.rank()) {
                continue;
            }
            let weights = &self.experts[&e];
            let grads = match expert_grads.remove(&e) {
                Some(g) => g,
                None => {
                    let z = |v: &Var| v.as_tensor().zeros_like();
                    [z(&weights.w1)?, z(&weights.b1)?, z(&weights.w2)?, z(&weights.b2)?]
                }
            };
            let mut flat: Vec<f32> = Vec::new();
            for g in &grads {
                flat.extend(g.flatten_all()?.to_vec1::<f32>()?);
            }
            let mut group = Group::new(holders)?;
            all_reduce_sum_f32(t, &mut group, &mut flat, self.timeout)?;
            let mut at = 0;
            let mut out = Vec::with_capacity(4);
            for (g, v) in grads.iter().zip(weights.vars()) {
                let len = g.elem_count();
                out.push(Tensor::from_vec(flat[at..at + len].to_vec(), v.shape(), &Device::Cpu)?);
                at += len;
            }
            synced.insert(e, out);
        }
        let mut gate: Vec<f32> = match router.get(self.gate.as_tensor()) {
            Some(g) => g.flatten_all()?.to_vec1()?,
            None => vec![0.0; self.gate.elem_count()],
        };
        all_reduce_sum_f32(t, world, &mut gate, self.timeout)?;
        Ok(MoeGrads {
            experts: synced,
            gate: Tensor::from_vec(gate, self.gate.shape(), &Device::Cpu)?,
            h_through_experts: Tensor::from_vec(dh, (n, d), &Device::Cpu)?,
            router,
        })
    }
}

/// Gradients of one distributed MoE layer on one rank.
pub struct MoeGrads {
    /// Local experts: [w1, b1, w2, b2] summed over the expert's holders.
    pub experts: BTreeMap<usize, Vec<Tensor>>,
    /// The gate gradient summed over all ranks.
    pub gate: Tensor,
    /// d loss / d h through the experts (add the router path from `router`).
    pub h_through_experts: Tensor,
    /// The GradStore of the combine/router segment on this rank.
    pub router: candle_core::backprop::GradStore,
}
