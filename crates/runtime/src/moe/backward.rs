//! The backward pass of a distributed MoE layer: slot gradients to the expert holders, each
//! expert's backward, input gradients home, and each expert's gradient summed over its holders
//! in buckets that overlap the experts' backward.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor, Var};
use lazarus_comm::{all_reduce_sum_f32, all_to_all_v, f32_to_bytes, Group, Transport};

use super::distinct::{add_by_token, decode_exact, dots, expand_scaled, sum_by_token, Arrival};
use super::packing::{pack_one, wire, Rows};
use super::{DistributedMoe, ExpertGrads, MoeForward, MoeGrads};
use crate::error::RuntimeError;

impl DistributedMoe {
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
        // The expert path first, then the combine segment's backward for the router (gate) and
        // h, with the combine weights' gradient from the holders that combined.
        let experts = self.expert_backward(t, world, fwd, grad_output)?;
        let mut seeded = (&fwd.output * grad_output.detach())?.sum_all()?;
        if let Some(cg) = &experts.combine_grad {
            seeded = (seeded + (&fwd.weights * cg.to_dtype(fwd.weights.dtype())?)?.sum_all()?)?;
        }
        let router = seeded.backward()?;
        let mut gate: Vec<f32> = match router.get(self.gate.as_tensor()) {
            Some(g) => g.flatten_all()?.to_vec1()?,
            None => vec![0.0; self.gate.elem_count()],
        };
        all_reduce_sum_f32(t, world, &mut gate, self.timeout)?;
        Ok(MoeGrads {
            experts: experts.experts,
            gate: Tensor::from_vec(gate, self.gate.shape(), self.gate.device())?,
            h_through_experts: experts.h_through_experts,
            router,
            wire_bytes: experts.wire_bytes,
        })
    }

    /// The expert path of backward alone, for a caller that runs the router/combine backward
    /// inside its own graph: `grad_output` is d(loss)/d(output) for the n tokens (n·d values,
    /// where the layer ran), the slot gradients are w[t, j] · grad_output[t] (the combine is
    /// linear in the slots), made there too.
    pub fn expert_backward(
        &self,
        t: &mut dyn Transport,
        world: &mut Group,
        fwd: &MoeForward,
        grad_output: &Tensor,
    ) -> Result<ExpertGrads, RuntimeError> {
        let (n, d, k) = (fwd.n, fwd.d, self.top_k);
        if grad_output.elem_count() != n * d {
            return Err(RuntimeError::Invalid {
                field: "grad_output",
                reason: format!("{} values for {n} tokens × {d}", grad_output.elem_count()),
            });
        }
        let g = grad_output.detach().to_dtype(DType::F32)?.reshape((n, 1, d))?;
        let d_slots = g.broadcast_mul(&fwd.combine.reshape((n, k, 1))?)?.reshape((n * k, d))?;
        self.backward_from_slots(t, world, fwd, &d_slots, &g.reshape((n, d))?)
    }

    /// Slot gradients → experts (on their holders) → input gradients back on the token's rank;
    /// expert gradients summed over each expert's holders.
    ///
    /// The experts' backward runs on a helper thread in the order of their all-reduce buckets
    /// while this thread all-reduces each bucket as soon as its gradients are ready, so the
    /// replicas' gradient traffic overlaps the remaining experts' compute instead of following
    /// it (static EP, one replica per expert, has no such traffic to hide).
    ///
    /// `d_slots` [n·k, d] is on the layer's device: the slots other ranks computed go there
    /// through the host, this rank's own never leave it (as in the forward). `g` [n, d] (f32)
    /// is the layer's output gradient, d_slots[t·k + j] = w[t, j] · g[t]: where the dispatch
    /// sent a token once to a rank, its gradient goes once too.
    fn backward_from_slots(
        &self,
        t: &mut dyn Transport,
        world: &mut Group,
        fwd: &MoeForward,
        d_slots: &Tensor,
        g: &Tensor,
    ) -> Result<ExpertGrads, RuntimeError> {
        let me = t.rank();
        // Send slot gradients to where each slot was processed (same buffers as dispatch).
        let sends = self.output_gradients_out(fwd, d_slots, g, me)?;
        let wire_bytes = wire(&sends, me);
        let received = {
            let _p = lazarus_model::profile::kernel("transport");
            all_to_all_v(t, world, &sends, self.timeout)?
        };
        let (recv_rows, g_distinct) = decode_output_gradients(fwd, &received)?;
        let buckets = self.all_reduce_buckets(t.world(), me)?;
        let (gy_dev, first_row) = gather_output_gradients(fwd, d_slots, &recv_rows, me)?;
        if self.mode == super::DispatchMode::Deterministic {
            return self.exact_backward(t, world, fwd, gy_dev.as_ref(), &first_row, wire_bytes);
        }
        let rows = ExpertRows { gy: gy_dev.as_ref(), first_row: &first_row };
        let (synced, dx) = self.overlapped_backward(t, fwd, &buckets, rows)?;
        let (h_through_experts, combine_grad, back_bytes) = self.input_gradients_home(t, world, fwd, dx, &g_distinct)?;
        Ok(ExpertGrads { experts: synced, exact: BTreeMap::new(), h_through_experts, combine_grad, wire_bytes: wire_bytes + back_bytes })
    }

    /// Gradient synchronisation: each expert over its holders. Experts with the same holder
    /// set share all-reduces, in buckets of at most `bucket_bytes` so that one bucket's
    /// all-reduce overlaps the next one's backward (a single bucket would leave the whole
    /// all-reduce exposed: at 1:1 every expert of a worker has the same holders). Shared
    /// buckets run in the order of their holder sets and then of expert ids, the same on
    /// every rank, so overlapping groups cannot wait on each other in a cycle. Experts held
    /// here alone need no all-reduce: last, they overlap the last shared bucket's all-reduce
    /// instead of leaving it exposed. (holders, experts) of each bucket, in order.
    fn all_reduce_buckets(&self, ranks: usize, me: usize) -> Result<Buckets, RuntimeError> {
        let mut by_holders: BTreeMap<Vec<usize>, Vec<usize>> = BTreeMap::new();
        for e in 0..self.experts_count() {
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
        let mut buckets: Buckets = Vec::new();
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
        // (Moving buckets that send nothing keeps the shared ones in the same order on every
        // rank.)
        buckets.sort_by_key(|b| b.0.len() == 1);
        Ok(buckets)
    }

    /// The experts' backward on a helper thread, in the order of `buckets`, while this thread
    /// all-reduces each bucket as soon as its gradients are ready. Each expert's gradients
    /// summed over its holders, and each segment's input gradient (still on the device).
    #[allow(clippy::type_complexity)]
    fn overlapped_backward(
        &self,
        t: &mut dyn Transport,
        fwd: &MoeForward,
        buckets: &[(Vec<usize>, Vec<usize>)],
        rows: ExpertRows<'_>,
    ) -> Result<(BTreeMap<usize, Vec<Tensor>>, Vec<(usize, Tensor)>), RuntimeError> {
        let order: Vec<usize> = buckets.iter().flat_map(|b| b.1.iter().copied()).collect();
        let segment_of: BTreeMap<usize, usize> = fwd.expert_segments.iter().enumerate().map(|(i, s)| (s.0, i)).collect();
        let (tx, rx) = std::sync::mpsc::channel::<Result<(usize, Vec<Tensor>), RuntimeError>>();
        // Set when this thread fails (e.g. a peer is lost): the helper stops after its current
        // expert so the error is reported without computing the rest.
        let stop = std::sync::atomic::AtomicBool::new(false);
        // Each segment's input gradient stays on the device until all are done: one copy home.
        let compute = |tx: std::sync::mpsc::Sender<Result<(usize, Vec<Tensor>), RuntimeError>>| -> Vec<(usize, Tensor)> {
            let mut dx = Vec::with_capacity(fwd.expert_segments.len());
            for &e in &order {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let weights = &self.experts[&e];
                let result = match segment_of.get(&e) {
                    Some(&i) => match rows.gy {
                        Some(gy) => self.expert_segment_backward(&fwd.expert_segments[i], gy, rows.first_row[i]).map(|(g, x)| {
                            dx.push((i, x));
                            g
                        }),
                        None => Err(RuntimeError::Invalid {
                            field: "expert backward",
                            reason: format!("expert {e} has rows but no gradients came"),
                        }),
                    },
                    None => weights.vars().iter().map(|v| Ok(v.as_tensor().zeros_like()?.to_dtype(candle_core::DType::F32)?)).collect(),
                };
                let failed = result.is_err();
                if tx.send(result.map(|g| (e, g))).is_err() || failed {
                    break;
                }
            }
            dx
        };
        let mut synced = BTreeMap::new();
        let dx = std::thread::scope(|scope| -> Result<Vec<(usize, Tensor)>, RuntimeError> {
            let worker = scope.spawn(move || compute(tx));
            let synced_all = self.sync_buckets(t, buckets, &rx, &mut synced);
            if synced_all.is_err() {
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            let dx = worker.join();
            synced_all?;
            dx.map_err(|_| RuntimeError::Invalid { field: "expert backward", reason: "the compute thread panicked".into() })
        })?;
        Ok((synced, dx))
    }

    /// Each bucket's gradients as they arrive from the compute thread (`rx`), summed over its
    /// holders (one host buffer for the bucket's all-reduce, back as one tensor with each
    /// parameter a view into it); an expert held here alone keeps its gradients where they are.
    fn sync_buckets(
        &self,
        t: &mut dyn Transport,
        buckets: &[(Vec<usize>, Vec<usize>)],
        rx: &std::sync::mpsc::Receiver<Result<(usize, Vec<Tensor>), RuntimeError>>,
        synced: &mut BTreeMap<usize, Vec<Tensor>>,
    ) -> Result<(), RuntimeError> {
        let mut arrived: BTreeMap<usize, Vec<Tensor>> = BTreeMap::new();
        for (holders, experts) in buckets {
            while experts.iter().any(|e| !arrived.contains_key(e)) {
                let (e, g) = rx
                    .recv()
                    .map_err(|_| RuntimeError::Invalid { field: "expert backward", reason: "the compute thread stopped early".into() })??;
                arrived.insert(e, g);
            }
            if holders.len() == 1 {
                for e in experts {
                    synced.insert(*e, arrived.remove(e).expect("arrived above"));
                }
                continue;
            }
            let mut parts = Vec::new();
            let mut shapes = Vec::new();
            for e in experts {
                parts.extend(arrived.remove(e).expect("arrived above").into_iter().map(Some));
                shapes.extend(self.experts[e].vars().iter().map(|v| v.dims()));
            }
            let lens: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
            let mut flat = crate::host_copy::to_host(&parts, &lens)?;
            drop(parts);
            {
                let _p = lazarus_model::profile::kernel("transport");
                let mut group = Group::new(holders.clone())?;
                all_reduce_sum_f32(t, &mut group, &mut flat, self.timeout)?;
            }
            let mut views = crate::host_copy::from_host(flat, &shapes, self.gate.device())?.into_iter();
            for e in experts {
                synced.insert(*e, views.by_ref().take(self.experts[e].vars().len()).collect());
            }
        }
        Ok(())
    }

    /// [`DispatchMode::Deterministic`]'s expert backward: each segment (one sender's block)
    /// on its own, its gradients handed back as they are: the caller adds a whole step's
    /// exactly and sums them over the holders once ([`ExpertGrads::exact`]).
    fn exact_backward(
        &self,
        t: &mut dyn Transport,
        world: &mut Group,
        fwd: &MoeForward,
        gy: Option<&Tensor>,
        first_row: &[usize],
        wire_bytes: u64,
    ) -> Result<ExpertGrads, RuntimeError> {
        let mut exact: BTreeMap<usize, Vec<Vec<f32>>> = BTreeMap::new();
        let mut dx = Vec::with_capacity(fwd.expert_segments.len());
        for (i, segment) in fwd.expert_segments.iter().enumerate() {
            let Some(gy) = gy else {
                return Err(RuntimeError::Invalid {
                    field: "expert backward",
                    reason: format!("expert {} has rows but no gradients came", segment.0),
                });
            };
            let (grads, x) = self.expert_segment_backward(segment, gy, first_row[i])?;
            dx.push((i, x));
            let lens: Vec<usize> = grads.iter().map(|g| g.elem_count()).collect();
            let flat = crate::host_copy::to_host(&grads.into_iter().map(Some).collect::<Vec<_>>(), &lens)?;
            exact.entry(segment.0).or_default().push(flat);
        }
        let (h_through_experts, combine_grad, back_bytes) = self.input_gradients_home(t, world, fwd, dx, &[])?;
        Ok(ExpertGrads { experts: BTreeMap::new(), exact, h_through_experts, combine_grad, wire_bytes: wire_bytes + back_bytes })
    }

    /// Each segment's input gradients (`dx`: segment index, its rows' gradients) back to the
    /// ranks the tokens came from, and there summed per token over its top-k slots in slot
    /// order (the same sum whichever ranks computed the slots): d loss / d h through the
    /// experts [n, d], the combine weights' gradient from the holders that combined, and the
    /// bytes this rank sent. The gradients of this rank's own slots stay on the device; the
    /// others cross the host once each way. A rank whose tokens came once gets, per token, the
    /// sum of its slots' gradients here, and per slot ⟨g, y⟩ (`g_distinct`: the output
    /// gradients it sent).
    fn input_gradients_home(
        &self,
        t: &mut dyn Transport,
        world: &mut Group,
        fwd: &MoeForward,
        dx: Vec<(usize, Tensor)>,
        g_distinct: &[Vec<f32>],
    ) -> Result<(Tensor, Option<Tensor>, u64), RuntimeError> {
        let (n, d, k) = (fwd.n, fwd.d, self.top_k);
        let me = t.rank();
        let p = &fwd.packing;
        let remote = &fwd.remote;
        let device = self.gate.device();
        let mut dx_by_src: Vec<Vec<f32>> = remote.recv_len.iter().map(|&l| vec![0f32; l * d]).collect();
        let (order_done, dx): (Vec<usize>, Vec<Tensor>) = dx.into_iter().unzip();
        let dx_dev = match dx.is_empty() {
            true => Tensor::zeros((0, d), DType::F32, device)?,
            false => Tensor::cat(&dx.iter().map(|x| x.reshape(((), d))).collect::<candle_core::Result<Vec<_>>>()?, 0)?,
        };
        // Each row of the self buffer: its row of dx_dev; the rows other ranks wait for, in one
        // copy to the host.
        let mut own = vec![None; p.send_len[me]];
        let (mut row, mut going) = (0u32, Vec::new());
        for &i in &order_done {
            for (src, &(o, c)) in fwd.expert_segments[i].3.iter().enumerate() {
                for r in o..o + c {
                    match src == me {
                        true => own[r] = Some(row),
                        false => going.push(row),
                    }
                    row += 1;
                }
            }
        }
        let going_host: Vec<f32> = if going.is_empty() {
            Vec::new()
        } else {
            let _p = lazarus_model::profile::kernel("to host");
            lazarus_model::ops::gather_rows(&dx_dev, &going)?.flatten_all()?.to_vec1()?
        };
        let mut at = 0;
        for &i in &order_done {
            for (src, &(o, c)) in fwd.expert_segments[i].3.iter().enumerate().filter(|(src, _)| *src != me) {
                dx_by_src[src][o * d..(o + c) * d].copy_from_slice(&going_host[at..at + c * d]);
                at += c * d;
            }
        }
        let back: Vec<Vec<u8>> = dx_by_src
            .iter()
            .enumerate()
            .map(|(src, dx)| match &fwd.arrivals[src] {
                Arrival::InPlace => Ok(f32_to_bytes(dx)),
                Arrival::Distinct { index, distinct, .. } => {
                    let (Some(g), Some(y)) = (g_distinct.get(src), fwd.held_outputs.get(src)) else {
                        return Err(RuntimeError::Invalid {
                            field: "input gradients",
                            reason: format!("rank {src}'s tokens came once but its output gradients or outputs are missing"),
                        });
                    };
                    let mut v = sum_by_token(index, *distinct, None, dx, d);
                    v.extend(dots(index, g, y, d));
                    Ok(f32_to_bytes(&v))
                }
            })
            .collect::<Result<_, RuntimeError>>()?;
        let wire_bytes = wire(&back, me);
        let results = {
            let _p = lazarus_model::profile::kernel("transport");
            all_to_all_v(t, world, &back, self.timeout)?
        };
        let results: Vec<Vec<f32>> = results
            .iter()
            .enumerate()
            .map(|(dst, bytes)| {
                let values = match &remote.distinct[dst] {
                    Some(x) => x.tokens.len() * d + x.index.len(),
                    None => remote.send_len[dst] * d,
                };
                decode_exact(bytes, values, dst, "input gradients")
            })
            .collect::<Result<_, _>>()?;
        // Each slot's gradient in its place (a slot nobody computed: zero), then each token's k
        // slots added in slot order, from zero: the bits of the same sum on the host.
        let mut by_slot: Vec<Option<Result<u32, &[f32]>>> = vec![None; n * k];
        for (dst, rows) in results.iter().enumerate().filter(|(dst, _)| *dst != me && remote.distinct[*dst].is_none()) {
            for (i, &s) in fwd.layout.send[dst].iter().enumerate() {
                let r = p.send_rows[dst][i];
                by_slot[s as usize] = Some(Err(&rows[r * d..(r + 1) * d]));
            }
        }
        for (i, &s) in fwd.layout.send[me].iter().enumerate() {
            by_slot[s as usize] = own[p.send_rows[me][i]].map(Ok);
        }
        let mut slots = Rows::new(dx_dev, d);
        for source in by_slot {
            match source {
                Some(Err(row)) => slots.push_host(row),
                Some(Ok(r)) => slots.push_device(Some(r)),
                None => slots.push_device(None),
            }
        }
        let slots = slots.gather()?.reshape((n, k, d))?;
        let mut dh = Tensor::zeros((n, d), DType::F32, device)?;
        for j in 0..k {
            dh = (dh + slots.narrow(1, j, 1)?.squeeze(1)?)?;
        }
        let (combined, combine_grad) = self.combined_gradients(fwd, &results)?;
        if let Some(combined) = combined {
            dh = (dh + combined)?;
        }
        Ok((dh, combine_grad, wire_bytes))
    }

    /// From the ranks that combined this rank's tokens: their sums of input gradients per token
    /// (added in rank order from zero, [n, d]) and each slot's combine-weight gradient ([n, k],
    /// zero for the other slots), both on the layer's device; None where no rank combined.
    fn combined_gradients(&self, fwd: &MoeForward, results: &[Vec<f32>]) -> Result<(Option<Tensor>, Option<Tensor>), RuntimeError> {
        let (n, d, k) = (fwd.n, fwd.d, self.top_k);
        if fwd.remote.distinct.iter().all(Option::is_none) {
            return Ok((None, None));
        }
        let (mut dh, mut dw) = (vec![0f32; n * d], vec![0f32; n * k]);
        for (dst, (distinct, values)) in fwd.remote.distinct.iter().zip(results).enumerate() {
            let Some(distinct) = distinct else { continue };
            let (sums, weight_grads) = values.split_at(distinct.tokens.len() * d);
            add_by_token(&mut dh, &distinct.tokens, sums, d);
            for (&s, &gw) in fwd.layout.send[dst].iter().zip(weight_grads) {
                dw[s as usize] = gw;
            }
        }
        let device = self.gate.device();
        let _p = lazarus_model::profile::kernel("to device");
        Ok((Some(Tensor::from_vec(dh, (n, d), device)?), Some(Tensor::from_vec(dw, (n, k), device)?)))
    }

    /// The output-gradient buffers to every other rank, in the forward's forms: a slot's
    /// gradient per row, or each distinct token's gradient once (the holder has the weights).
    /// The rows come down from the device in one copy per form.
    fn output_gradients_out(&self, fwd: &MoeForward, d_slots: &Tensor, g: &Tensor, me: usize) -> Result<Vec<Vec<u8>>, RuntimeError> {
        let (d, remote, send) = (fwd.d, &fwd.remote, &fwd.layout.send);
        let others = || (0..send.len()).filter(move |&dst| dst != me);
        let slots: Vec<u32> = others().filter(|&dst| remote.distinct[dst].is_none()).flat_map(|dst| send[dst].iter().copied()).collect();
        let tokens: Vec<u32> = others().filter_map(|dst| remote.distinct[dst].as_ref()).flat_map(|x| x.tokens.iter().copied()).collect();
        let down = |from: &Tensor, rows: &[u32]| -> Result<Vec<f32>, RuntimeError> {
            if rows.is_empty() {
                return Ok(Vec::new());
            }
            let _p = lazarus_model::profile::kernel("to host");
            Ok(lazarus_model::ops::gather_rows(from, rows)?.flatten_all()?.to_vec1()?)
        };
        let (slots_host, tokens_host) = (down(d_slots, &slots)?, down(g, &tokens)?);
        let (mut slot_at, mut token_at) = (0, 0);
        let mut sends = Vec::with_capacity(send.len());
        for dst in 0..send.len() {
            sends.push(match (&remote.distinct[dst], dst == me) {
                (_, true) => Vec::new(),
                (Some(distinct), false) => {
                    let first = token_at;
                    token_at += distinct.tokens.len();
                    f32_to_bytes(&tokens_host[first * d..token_at * d])
                }
                (None, false) => {
                    let first = slot_at;
                    slot_at += send[dst].len();
                    pack_one(&remote.send_rows[dst], remote.send_len[dst], d, |i| &slots_host[(first + i) * d..(first + i + 1) * d])
                }
            });
        }
        Ok(sends)
    }

    /// Parameters of the experts of one bucket, in order.
    fn bucket_len(&self, experts: &[usize]) -> usize {
        experts.iter().map(|e| self.experts[e].vars().iter().map(|v| v.elem_count()).sum::<usize>()).sum()
    }

    /// One expert's backward on its rows (its output gradients the `first_row`.. rows of
    /// `gy_all`): its gradients (one f32 tensor per parameter, on the expert's device) and
    /// d(loss)/d(input) for its rows, there too.
    fn expert_segment_backward(
        &self,
        segment: &(usize, Var, Tensor, Vec<(usize, usize)>),
        gy_all: &Tensor,
        first_row: usize,
    ) -> Result<(Vec<Tensor>, Tensor), RuntimeError> {
        let (e, x, y, blocks) = segment;
        let total: usize = blocks.iter().map(|b| b.1).sum();
        let gy = gy_all.narrow(0, first_row, total)?;
        let grads = (y * gy)?.sum_all()?.backward()?;
        let weights = &self.experts[e];
        let mut out = Vec::with_capacity(weights.vars().len());
        for v in weights.vars() {
            out.push(match grads.get(v.as_tensor()) {
                Some(g) => g.to_dtype(candle_core::DType::F32)?,
                None => v.as_tensor().zeros_like()?.to_dtype(candle_core::DType::F32)?,
            });
        }
        let dx = match grads.get(x.as_tensor()) {
            Some(g) => g.to_dtype(candle_core::DType::F32)?,
            None => x.as_tensor().zeros_like()?.to_dtype(candle_core::DType::F32)?,
        };
        Ok((out, dx))
    }
}

/// Buckets of experts whose gradients are all-reduced together: (holders, experts), in order.
type Buckets = Vec<(Vec<usize>, Vec<usize>)>;

/// Per rank: its slots' output gradients in buffer order, and its distinct tokens' as they came.
type RowsAndDistinct = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// The output gradients of every local expert's rows on the device, and each segment's first
/// row among them.
#[derive(Clone, Copy)]
struct ExpertRows<'a> {
    /// None when no local expert has a row.
    gy: Option<&'a Tensor>,
    first_row: &'a [usize],
}

/// Per rank: its slots' output gradients in buffer order, and where its tokens came once,
/// their gradients as they came (for the combine weights' gradient).
fn decode_output_gradients(fwd: &MoeForward, received: &[Vec<u8>]) -> Result<RowsAndDistinct, RuntimeError> {
    let d = fwd.d;
    let mut recv_rows: Vec<Vec<f32>> = Vec::with_capacity(received.len());
    let mut g_distinct: Vec<Vec<f32>> = Vec::with_capacity(received.len());
    for (src, bytes) in received.iter().enumerate() {
        match &fwd.arrivals[src] {
            Arrival::InPlace => {
                recv_rows.push(decode_exact(bytes, fwd.remote.recv_len[src] * d, src, "output gradients")?);
                g_distinct.push(Vec::new());
            }
            Arrival::Distinct { index, distinct, weight } => {
                let g = decode_exact(bytes, distinct * d, src, "output gradients")?;
                recv_rows.push(expand_scaled(index, weight, &g, d));
                g_distinct.push(g);
            }
        }
    }
    Ok((recv_rows, g_distinct))
}

/// The output gradients of every local expert's rows, in the forward's order: those from other
/// ranks in one copy to the device, this rank's own read where they are (in `d_slots`); each
/// segment's first row among them. (None when no local expert has a row: nothing to upload,
/// and no segment reads it.)
fn gather_output_gradients(
    fwd: &MoeForward,
    d_slots: &Tensor,
    recv_rows: &[Vec<f32>],
    me: usize,
) -> Result<(Option<Tensor>, Vec<usize>), RuntimeError> {
    let d = fwd.d;
    let mut gy_all = Rows::new(d_slots.clone(), d);
    let mut first_row = Vec::with_capacity(fwd.expert_segments.len());
    let mut rows = 0;
    for (_, _, _, blocks) in &fwd.expert_segments {
        first_row.push(rows);
        for (src, &(o, c)) in blocks.iter().enumerate() {
            for r in o..o + c {
                match src == me {
                    true => gy_all.push_device(fwd.local.slot_at[r]),
                    false => gy_all.push_host(&recv_rows[src][r * d..(r + 1) * d]),
                }
            }
            rows += c;
        }
    }
    let gy = match rows {
        0 => None,
        _ => Some(gy_all.gather()?),
    };
    Ok((gy, first_row))
}
