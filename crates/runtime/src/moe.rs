//! One MoE layer across ranks.

use std::collections::BTreeMap;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use lazarus_comm::{all_gather, all_reduce_sum_f32, all_to_all_v, bytes_to_f32, f32_to_bytes, f32_wire, Group, Transport};
use lazarus_model::ops::{expert_ffn, softmax_last};
use lazarus_model::routing::top_k;
use lazarus_plan::{DispatchSchedule, RankLayout};

use crate::error::RuntimeError;

/// One physical copy of an expert (f32).
/// Default largest replica-gradient all-reduce bucket (bytes), as PyTorch DDP's: buckets are
/// what lets the all-reduce overlap the experts' backward; a bucket never splits an expert.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

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

/// How tokens travel to the experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchMode {
    /// Lazarus (Algorithm 1): any replica may serve a token, shares follow the replica counts,
    /// and the all-to-all carries exactly the rows that move (no padding).
    Flexible,
    /// As `Flexible`, but an expert's tokens are shared over its holders so that the ranks'
    /// total loads are even ([`lazarus_plan::DispatchSchedule::compute_balanced`]).
    Balanced,
    /// The static expert-parallel baseline (DeepSpeed-MoE): one replica per expert, and every
    /// buffer padded to `experts on the receiver × C` rows, C the largest number of tokens any
    /// rank routes to one expert (dropless). As in DeepSpeed, whose experts run on the whole
    /// `[ranks · C, d]` capacity buffer they receive, the padding rows are computed too (they
    /// get zero gradients, so results are unchanged).
    StaticPadded,
    /// As `StaticPadded` on the wire, but experts compute only the real rows: a stronger
    /// baseline than DeepSpeed (what a dropless grouped-GEMM implementation would do).
    StaticSkipPadding,
}

impl DispatchMode {
    /// One replica per expert, buffers padded to the largest load.
    pub fn is_static(self) -> bool {
        matches!(self, DispatchMode::StaticPadded | DispatchMode::StaticSkipPadding)
    }
}

/// Row positions inside the all-to-all buffers, shared by the four exchanges of a step.
#[derive(Debug, Clone)]
struct Packing {
    /// Row, in the buffer to `dst`, of each entry of `layout.send[dst]`.
    send_rows: Vec<Vec<usize>>,
    /// Rows in the buffer to each rank (padding included).
    send_len: Vec<usize>,
    /// (first row, rows) of each expert's block in the buffer from each rank.
    recv_blocks: Vec<Vec<(usize, usize)>>,
    recv_len: Vec<usize>,
}

impl Packing {
    fn new(layout: &RankLayout, mode: DispatchMode, replicas: &[Vec<u32>], tokens: &[Vec<u64>], me: usize) -> Result<Self, RuntimeError> {
        let ranks = layout.send.len();
        let experts = replicas.len();
        match mode {
            DispatchMode::Flexible | DispatchMode::Balanced => {
                let send_rows = layout.send.iter().map(|v| (0..v.len()).collect()).collect();
                let send_len = layout.send.iter().map(Vec::len).collect();
                let mut recv_blocks = vec![vec![(0, 0); experts]; ranks];
                let mut recv_len = vec![0; ranks];
                for src in 0..ranks {
                    for e in 0..experts {
                        let c = layout.recv[src][e] as usize;
                        recv_blocks[src][e] = (recv_len[src], c);
                        recv_len[src] += c;
                    }
                }
                Ok(Packing { send_rows, send_len, recv_blocks, recv_len })
            }
            DispatchMode::StaticPadded | DispatchMode::StaticSkipPadding => {
                if let Some(e) = replicas.iter().position(|r| r.iter().sum::<u32>() != 1) {
                    return Err(RuntimeError::Invalid {
                        field: "placement",
                        reason: format!("static expert parallelism needs exactly one replica per expert (expert {e})"),
                    });
                }
                let cap = tokens.iter().flatten().copied().max().unwrap_or(0) as usize;
                let held = |rank: usize| -> Vec<usize> { (0..experts).filter(|&e| replicas[e][rank] > 0).collect() };
                let mut send_rows = Vec::with_capacity(ranks);
                let mut send_len = Vec::with_capacity(ranks);
                for dst in 0..ranks {
                    let theirs = held(dst);
                    let mut seen = vec![0usize; experts];
                    let rows = layout.send_experts[dst]
                        .iter()
                        .map(|&e| {
                            let e = e as usize;
                            let block = theirs.iter().position(|&x| x == e).unwrap_or(0);
                            seen[e] += 1;
                            block * cap + seen[e] - 1
                        })
                        .collect();
                    send_rows.push(rows);
                    send_len.push(theirs.len() * cap);
                }
                let mine = held(me);
                let recv_blocks = (0..ranks)
                    .map(|src| {
                        (0..experts)
                            .map(|e| match mine.iter().position(|&x| x == e) {
                                Some(b) if mode == DispatchMode::StaticPadded => (b * cap, cap),
                                Some(b) => (b * cap, layout.recv[src][e] as usize),
                                None => (0, 0),
                            })
                            .collect()
                    })
                    .collect();
                Ok(Packing { send_rows, send_len, recv_blocks, recv_len: vec![mine.len() * cap; ranks] })
            }
        }
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
    pub mode: DispatchMode,
    /// Largest replica-gradient all-reduce bucket ([`DEFAULT_BUCKET_BYTES`]).
    pub bucket_bytes: usize,
}

/// What the forward pass keeps for backward.
pub struct MoeForward {
    /// The layer output for this rank's tokens [n, d].
    pub output: Tensor,
    /// Tokens routed to each expert from this rank.
    pub local_load: Vec<u64>,
    /// Tokens routed to each expert from all ranks (the load monitor's input).
    pub global_load: Vec<u64>,
    /// This rank's share of the Switch load-balancing loss, E · Σ_e f_e · Σ_{local t} P_e(t) / N
    /// with f_e the global assignment share and N the global token count: summed over the ranks
    /// it is the single-process layer's aux loss. In h's graph.
    pub aux: Tensor,
    /// Normalised combine weight of each of this rank's slots (token-major, n·k).
    combine: Vec<f32>,
    /// Token rows this rank dispatched to other ranks (padding excluded): the payload any
    /// dispatcher must move for this assignment, once per exchange.
    pub rows_sent: u64,
    layout: RankLayout,
    packing: Packing,
    /// Bytes this rank sent to other ranks in the forward all-to-alls.
    pub wire_bytes: u64,
    /// Rows this rank's experts computed (padding included when the mode computes it).
    pub expert_rows: u64,
    /// Input to the combine segment: expert outputs of this rank's slots [n·k, d].
    slots_in: Var,
    /// Per local expert: (expert, leaf input, output, its (first row, rows) block from each rank).
    expert_segments: Vec<ExpertSegment>,
    n: usize,
    d: usize,
}

/// One local expert's forward: (expert, leaf input, output, its (first row, rows) block from
/// each rank).
type ExpertSegment = (usize, Var, Tensor, Vec<(usize, usize)>);

/// Buffers for each destination: `rows(dst, i)` is the row of entry i, placed at
/// `at[dst][i]`; `len[dst]` rows in all (the rest is padding).
fn pack<'a>(at: &[Vec<usize>], len: &[usize], d: usize, rows: impl Fn(usize, usize) -> &'a [f32]) -> Vec<Vec<u8>> {
    let row_bytes = d * 4;
    at.iter()
        .enumerate()
        .map(|(dst, positions)| {
            let mut buf = vec![0u8; len[dst] * row_bytes];
            for (i, &r) in positions.iter().enumerate() {
                buf[r * row_bytes..(r + 1) * row_bytes].copy_from_slice(&f32_wire(rows(dst, i)));
            }
            buf
        })
        .collect()
}

/// Decode buffers and check each holds the expected number of rows.
fn unpack(bytes: &[Vec<u8>], len: &[usize], d: usize, what: &'static str) -> Result<Vec<Vec<f32>>, RuntimeError> {
    bytes
        .iter()
        .enumerate()
        .map(|(r, b)| {
            let v = bytes_to_f32(b)?;
            if v.len() != len[r] * d {
                return Err(RuntimeError::Invalid {
                    field: what,
                    reason: format!("rank {r} sent {} values, expected {}", v.len(), len[r] * d),
                });
            }
            Ok(v)
        })
        .collect()
}

fn wire(bufs: &[Vec<u8>], me: usize) -> u64 {
    bufs.iter().enumerate().filter(|(r, _)| *r != me).map(|(_, b)| b.len() as u64).sum()
}

impl DistributedMoe {
    fn experts_count(&self) -> usize {
        self.replicas.len()
    }

    /// Forward for this rank's tokens `h` [n, d] (a tensor that may carry autograd history).
    pub fn forward(&self, t: &mut dyn Transport, world: &mut Group, h: &Tensor) -> Result<MoeForward, RuntimeError> {
        self.forward_routed(t, world, h, None)
    }

    /// [`DistributedMoe::forward`] with the router's top-k choices replaced by `choices`
    /// (token-major, n·k expert ids; the combine still weights by the router's probabilities):
    /// trace-driven routing, as the paper's ablations use to fix expert loads.
    pub fn forward_routed(
        &self,
        t: &mut dyn Transport,
        world: &mut Group,
        h: &Tensor,
        choices: Option<&[u32]>,
    ) -> Result<MoeForward, RuntimeError> {
        let (n, d) = h.dims2()?;
        let e_count = self.experts_count();
        let k = self.top_k;
        let ranks = t.world();
        let me = t.rank();
        // Router segment (stays in h's graph).
        let probs = softmax_last(&h.matmul(self.gate.as_tensor())?)?;
        let host: Vec<Vec<f64>> = probs.to_dtype(DType::F64)?.to_vec2()?;
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
            None => host.iter().flat_map(|row| top_k(row, k)).map(|c| c as u32).collect(),
        };
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
        let schedule = match self.mode {
            DispatchMode::Balanced => DispatchSchedule::compute_balanced(&tokens, &self.replicas)?,
            _ => DispatchSchedule::compute(&tokens, &self.replicas)?,
        };
        let layout = RankLayout::new(&schedule, me, &choices)?;
        let packing = Packing::new(&layout, self.mode, &self.replicas, &tokens, me)?;
        // Dispatch: the row of h of every slot, at its place in the buffer.
        let h_host: Vec<f32> = h.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let sends = pack(&packing.send_rows, &packing.send_len, d, |dst, i| {
            let tok = layout.send[dst][i] as usize / k;
            &h_host[tok * d..(tok + 1) * d]
        });
        let mut wire_bytes = wire(&sends, me);
        let received = all_to_all_v(t, world, &sends, self.timeout)?;
        let recv_rows = unpack(&received, &packing.recv_len, d, "dispatched tokens")?;
        // Expert segments: per local expert, its block from every source in rank order.
        let mut segments = Vec::new();
        let mut outputs_by_src: Vec<Vec<f32>> = packing.recv_len.iter().map(|&l| vec![0f32; l * d]).collect();
        for e in 0..e_count {
            let blocks: Vec<(usize, usize)> = (0..ranks).map(|src| packing.recv_blocks[src][e]).collect();
            let total: usize = blocks.iter().map(|b| b.1).sum();
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
            for (src, &(o, c)) in blocks.iter().enumerate() {
                x.extend_from_slice(&recv_rows[src][o * d..(o + c) * d]);
            }
            let x = Var::from_tensor(&Tensor::from_vec(x, (total, d), &Device::Cpu)?)?;
            let y =
                expert_ffn(x.as_tensor(), weights.w1.as_tensor(), weights.b1.as_tensor(), weights.w2.as_tensor(), weights.b2.as_tensor())?;
            let y_host: Vec<f32> = y.flatten_all()?.to_vec1()?;
            let mut row = 0;
            for (src, &(o, c)) in blocks.iter().enumerate() {
                outputs_by_src[src][o * d..(o + c) * d].copy_from_slice(&y_host[row * d..(row + c) * d]);
                row += c;
            }
            segments.push((e, x, y, blocks));
        }
        // Return expert outputs to the ranks the tokens came from (same buffers, reversed).
        let back: Vec<Vec<u8>> = outputs_by_src.iter().map(|v| f32_to_bytes(v)).collect();
        wire_bytes += wire(&back, me);
        let results = all_to_all_v(t, world, &back, self.timeout)?;
        let results = unpack(&results, &packing.send_len, d, "expert results")?;
        let mut slots = vec![0f32; n * k * d];
        for (dst, rows) in results.iter().enumerate() {
            for (i, &s) in layout.send[dst].iter().enumerate() {
                let (s, r) = (s as usize, packing.send_rows[dst][i]);
                slots[s * d..(s + 1) * d].copy_from_slice(&rows[r * d..(r + 1) * d]);
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
        let combine: Vec<f32> = w.detach().to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        // Load-balancing loss share (see the field's doc).
        let global_load: Vec<u64> = tokens.iter().map(|per_rank| per_rank.iter().sum()).collect();
        // Cannot overflow: the dispatch schedule above bounds the grand total.
        let assignments: u64 = global_load.iter().sum();
        let global_tokens = (assignments / k as u64).max(1) as f64;
        let f: Vec<f32> = global_load.iter().map(|&c| c as f32 / assignments.max(1) as f32).collect();
        let f = Tensor::from_vec(f, e_count, h.device())?.to_dtype(probs.dtype())?;
        let aux = ((probs.sum(0)? * f)?.sum_all()? * (e_count as f64 / global_tokens))?;
        Ok(MoeForward {
            output,
            local_load,
            global_load,
            aux,
            combine,
            rows_sent: layout.send.iter().enumerate().filter(|(r, _)| *r != me).map(|(_, v)| v.len() as u64).sum(),
            layout,
            packing,
            wire_bytes,
            expert_rows: segments.iter().map(|s| s.3.iter().map(|b| b.1 as u64).sum::<u64>()).sum(),
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
        // Combine segment backward: gradients for the slots input, the router (gate) and h.
        let seeded = (&fwd.output * grad_output.detach())?.sum_all()?;
        let router = seeded.backward()?;
        let d_slots: Vec<f32> = router
            .get(fwd.slots_in.as_tensor())
            .map(|g| g.flatten_all().and_then(|g| g.to_vec1()))
            .transpose()?
            .unwrap_or_else(|| vec![0.0; n * k * d]);
        let experts = self.backward_from_slots(t, world, fwd, &d_slots)?;
        let mut gate: Vec<f32> = match router.get(self.gate.as_tensor()) {
            Some(g) => g.flatten_all()?.to_vec1()?,
            None => vec![0.0; self.gate.elem_count()],
        };
        all_reduce_sum_f32(t, world, &mut gate, self.timeout)?;
        Ok(MoeGrads {
            experts: experts.experts,
            gate: Tensor::from_vec(gate, self.gate.shape(), &Device::Cpu)?,
            h_through_experts: experts.h_through_experts,
            router,
            wire_bytes: experts.wire_bytes,
        })
    }

    /// The expert path of backward alone, for a caller that runs the router/combine backward
    /// inside its own graph: `grad_output` is d(loss)/d(output) [n·d], the slot gradients are
    /// w[t, j] · grad_output[t] (the combine is linear in the slots).
    pub fn expert_backward(
        &self,
        t: &mut dyn Transport,
        world: &mut Group,
        fwd: &MoeForward,
        grad_output: &[f32],
    ) -> Result<ExpertGrads, RuntimeError> {
        let (n, d, k) = (fwd.n, fwd.d, self.top_k);
        if grad_output.len() != n * d {
            return Err(RuntimeError::Invalid {
                field: "grad_output",
                reason: format!("{} values for {n} tokens × {d}", grad_output.len()),
            });
        }
        let mut d_slots = vec![0f32; n * k * d];
        for (slot, out) in d_slots.chunks_mut(d).enumerate() {
            let (w, g) = (fwd.combine[slot], &grad_output[(slot / k) * d..(slot / k + 1) * d]);
            out.iter_mut().zip(g).for_each(|(o, &g)| *o = w * g);
        }
        self.backward_from_slots(t, world, fwd, &d_slots)
    }

    /// Slot gradients → experts (on their holders) → input gradients back on the token's rank;
    /// expert gradients summed over each expert's holders.
    ///
    /// The experts' backward runs on a helper thread in the order of their all-reduce buckets
    /// while this thread all-reduces each bucket as soon as its gradients are ready, so the
    /// replicas' gradient traffic overlaps the remaining experts' compute instead of following
    /// it (static EP, one replica per expert, has no such traffic to hide).
    fn backward_from_slots(
        &self,
        t: &mut dyn Transport,
        world: &mut Group,
        fwd: &MoeForward,
        d_slots: &[f32],
    ) -> Result<ExpertGrads, RuntimeError> {
        let (n, d, k) = (fwd.n, fwd.d, self.top_k);
        let ranks = t.world();
        let e_count = self.experts_count();
        // Send slot gradients to where each slot was processed (same buffers as dispatch).
        let me = t.rank();
        let p = &fwd.packing;
        let sends = pack(&p.send_rows, &p.send_len, d, |dst, i| {
            let s = fwd.layout.send[dst][i] as usize;
            &d_slots[s * d..(s + 1) * d]
        });
        let mut wire_bytes = wire(&sends, me);
        let received = all_to_all_v(t, world, &sends, self.timeout)?;
        let recv_rows = unpack(&received, &p.recv_len, d, "output gradients")?;
        // Gradient synchronisation: each expert over its holders. Experts with the same holder
        // set share all-reduces, in buckets of at most `bucket_bytes` so that one bucket's
        // all-reduce overlaps the next one's backward (a single bucket would leave the whole
        // all-reduce exposed: at 1:1 every expert of a worker has the same holders). Shared
        // buckets run in the order of their holder sets and then of expert ids, the same on
        // every rank, so overlapping groups cannot wait on each other in a cycle.
        let mut by_holders: BTreeMap<Vec<usize>, Vec<usize>> = BTreeMap::new();
        for e in 0..e_count {
            let holders: Vec<usize> = (0..ranks).filter(|&r| self.replicas[e][r] > 0).collect();
            if holders.contains(&me) {
                if !self.experts.contains_key(&e) {
                    return Err(RuntimeError::Invalid {
                        field: "placement",
                        reason: format!("rank {me} holds expert {e} but has no weights for it"),
                    });
                }
                by_holders.entry(holders).or_default().push(e);
            }
        }
        let mut buckets: Vec<(Vec<usize>, Vec<usize>)> = Vec::new();
        for (holders, experts) in by_holders {
            let (mut current, mut bytes): (Vec<usize>, usize) = (Vec::new(), 0);
            for e in experts {
                let size = 4 * self.bucket_len(&[e]);
                if !current.is_empty() && bytes + size > self.bucket_bytes {
                    buckets.push((holders.clone(), std::mem::take(&mut current)));
                    bytes = 0;
                }
                current.push(e);
                bytes += size;
            }
            buckets.push((holders, current));
        }
        // Experts held here alone need no all-reduce: computed last, they overlap the last
        // shared bucket's all-reduce instead of leaving it exposed. (Moving buckets that send
        // nothing keeps the shared ones in the same order on every rank.)
        buckets.sort_by_key(|b| b.0.len() == 1);
        let order: Vec<usize> = buckets.iter().flat_map(|b| b.1.iter().copied()).collect();
        let segment_of: BTreeMap<usize, usize> = fwd.expert_segments.iter().enumerate().map(|(i, s)| (s.0, i)).collect();
        let (tx, rx) = std::sync::mpsc::channel::<Result<(usize, Vec<f32>), RuntimeError>>();
        // Set when this thread fails (e.g. a peer is lost): the helper stops after its current
        // expert so the error is reported without computing the rest.
        let stop = std::sync::atomic::AtomicBool::new(false);
        let compute = |tx: std::sync::mpsc::Sender<Result<(usize, Vec<f32>), RuntimeError>>| -> Vec<Vec<f32>> {
            let mut dx_by_src: Vec<Vec<f32>> = p.recv_len.iter().map(|&l| vec![0f32; l * d]).collect();
            for &e in &order {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let weights = &self.experts[&e];
                let result = match segment_of.get(&e) {
                    Some(&i) => self.expert_segment_backward(&fwd.expert_segments[i], &recv_rows, d, &mut dx_by_src),
                    None => Ok(vec![0f32; weights.vars().iter().map(|v| v.elem_count()).sum()]),
                };
                let failed = result.is_err();
                if tx.send(result.map(|g| (e, g))).is_err() || failed {
                    break;
                }
            }
            dx_by_src
        };
        let mut synced = BTreeMap::new();
        let dx_by_src = std::thread::scope(|scope| -> Result<Vec<Vec<f32>>, RuntimeError> {
            let worker = scope.spawn(move || compute(tx));
            let synced_all = (|| -> Result<(), RuntimeError> {
                let mut arrived: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
                for (holders, experts) in &buckets {
                    while experts.iter().any(|e| !arrived.contains_key(e)) {
                        let (e, g) = rx.recv().map_err(|_| RuntimeError::Invalid {
                            field: "expert backward",
                            reason: "the compute thread stopped early".into(),
                        })??;
                        arrived.insert(e, g);
                    }
                    let mut flat: Vec<f32> = Vec::new();
                    for e in experts {
                        let g = arrived.remove(e).expect("arrived above");
                        if flat.is_empty() {
                            flat = g;
                        } else {
                            flat.extend_from_slice(&g);
                        }
                    }
                    if holders.len() > 1 {
                        let mut group = Group::new(holders.clone())?;
                        all_reduce_sum_f32(t, &mut group, &mut flat, self.timeout)?;
                    }
                    // One tensor for the bucket; each parameter is a view into it (no copy).
                    let all = Tensor::from_vec(flat, self.bucket_len(experts), &Device::Cpu)?;
                    let mut at = 0;
                    for e in experts {
                        let mut out = Vec::with_capacity(4);
                        for v in self.experts[e].vars() {
                            let len = v.elem_count();
                            out.push(all.narrow(0, at, len)?.reshape(v.shape())?);
                            at += len;
                        }
                        synced.insert(*e, out);
                    }
                }
                Ok(())
            })();
            if synced_all.is_err() {
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            let dx = worker.join();
            synced_all?;
            dx.map_err(|_| RuntimeError::Invalid { field: "expert backward", reason: "the compute thread panicked".into() })
        })?;
        // Input gradients back to the token's rank, accumulated per token.
        let back: Vec<Vec<u8>> = dx_by_src.iter().map(|v| f32_to_bytes(v)).collect();
        wire_bytes += wire(&back, me);
        let results = all_to_all_v(t, world, &back, self.timeout)?;
        let results = unpack(&results, &p.send_len, d, "input gradients")?;
        let mut dh = vec![0f32; n * d];
        for (dst, rows) in results.iter().enumerate() {
            for (i, &s) in fwd.layout.send[dst].iter().enumerate() {
                let (tok, r) = (s as usize / k, p.send_rows[dst][i]);
                dh[tok * d..(tok + 1) * d].iter_mut().zip(&rows[r * d..(r + 1) * d]).for_each(|(a, b)| *a += b);
            }
        }
        Ok(ExpertGrads { experts: synced, h_through_experts: Tensor::from_vec(dh, (n, d), &Device::Cpu)?, wire_bytes })
    }

    /// Parameters of the experts of one bucket, in order.
    fn bucket_len(&self, experts: &[usize]) -> usize {
        experts.iter().map(|e| self.experts[e].vars().iter().map(|v| v.elem_count()).sum::<usize>()).sum()
    }

    /// One expert's backward on its rows: its [w1, b1, w2, b2] gradients flattened into one
    /// buffer, and d(loss)/d(input) rows written into `dx_by_src` at the rows they came from.
    fn expert_segment_backward(
        &self,
        segment: &(usize, Var, Tensor, Vec<(usize, usize)>),
        recv_rows: &[Vec<f32>],
        d: usize,
        dx_by_src: &mut [Vec<f32>],
    ) -> Result<Vec<f32>, RuntimeError> {
        let (e, x, y, blocks) = segment;
        let total: usize = blocks.iter().map(|b| b.1).sum();
        let mut gy = Vec::with_capacity(total * d);
        for (src, &(o, c)) in blocks.iter().enumerate() {
            gy.extend_from_slice(&recv_rows[src][o * d..(o + c) * d]);
        }
        let gy = Tensor::from_vec(gy, (total, d), &Device::Cpu)?;
        let grads = (y * gy)?.sum_all()?.backward()?;
        let weights = &self.experts[e];
        let mut flat = Vec::with_capacity(weights.vars().iter().map(|v| v.elem_count()).sum());
        for v in weights.vars() {
            match grads.get(v.as_tensor()) {
                Some(g) => extend_host(&mut flat, g)?,
                None => flat.resize(flat.len() + v.elem_count(), 0.0),
            }
        }
        let dx: Vec<f32> = match grads.get(x.as_tensor()) {
            Some(g) => g.flatten_all()?.to_vec1()?,
            None => vec![0.0; total * d],
        };
        let mut row = 0;
        for (src, &(o, c)) in blocks.iter().enumerate() {
            dx_by_src[src][o * d..(o + c) * d].copy_from_slice(&dx[row * d..(row + c) * d]);
            row += c;
        }
        Ok(flat)
    }
}

/// Append a tensor's f32 elements to `out`, straight from its storage when it is contiguous.
fn extend_host(out: &mut Vec<f32>, t: &Tensor) -> Result<(), RuntimeError> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) = (&*storage, layout.contiguous_offsets()) {
            out.extend_from_slice(&v[a..b]);
            return Ok(());
        }
    }
    out.extend(t.flatten_all()?.to_vec1::<f32>()?);
    Ok(())
}

/// The expert path's gradients on one rank.
pub struct ExpertGrads {
    /// Local experts: [w1, b1, w2, b2] summed over the expert's holders.
    pub experts: BTreeMap<usize, Vec<Tensor>>,
    /// d loss / d h through the experts [n, d].
    pub h_through_experts: Tensor,
    /// Bytes this rank sent to other ranks in the backward all-to-alls.
    pub wire_bytes: u64,
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
    /// Bytes this rank sent to other ranks in the backward all-to-alls (gradient all-reduces
    /// not included).
    pub wire_bytes: u64,
}
