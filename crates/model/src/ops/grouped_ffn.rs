//! Every expert of one MoE layer as a single autograd node over rows grouped by expert: each
//! expert's rows run through the [expert FFN kernel](mod@super::expert_ffn), GELU(x·W1 + b1)·W2 + b2
//! as GEMMs on the raw buffers, one expert after the other.
//!
//! One node instead of one per expert plus a gather, a weight multiply and a scatter per expert:
//! the per-expert nodes each zero-filled and accumulated a full [N, d] input gradient in
//! backward. The forward keeps every expert's pre-activation and activation for the backward,
//! which recomputes them only if they are gone.

use super::expert_ffn::{ffn_bwd_f32, ffn_bwd_f64, ffn_fwd_f32, ffn_fwd_f64};
use super::host::{as_slots, contiguous_slice, host_f64, with_f32_slices, with_host_f32, Unfilled};
use super::parallel::run_parallel;
use crate::config::Activation;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, Layout, Shape, Tensor};
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex};

/// Hidden pre-activation h and activation gelu(h) of one forward.
enum Saved {
    F32(Vec<f32>, Vec<f32>),
    F64(Vec<f64>, Vec<f64>),
}

/// All experts of one MoE layer as a single autograd node: x holds every routed row, grouped by
/// expert (`counts[e]` rows for expert e, in expert order), the weights come stacked as
/// W1b [E, d+1, f] and W2b [E, f+1, d] (bias as the last row, as in [`expert_ffn`](fn@super::expert_ffn)). One node
/// instead of one per expert plus a gather, a weight multiply and a scatter per expert: the
/// per-expert nodes each zero-filled and accumulated a full [N, d] input gradient in backward.
struct GroupedExpertFfn {
    counts: Vec<usize>,
    act: Activation,
    saved: Mutex<Option<Vec<Saved>>>,
}

/// `buf` cut into consecutive parts of `sizes[i]` elements.
fn split_parts<T>(mut buf: &mut [T], sizes: impl Iterator<Item = usize>) -> Vec<&mut [T]> {
    let mut parts = Vec::new();
    for n in sizes {
        let (part, rest) = buf.split_at_mut(n);
        parts.push(part);
        buf = rest;
    }
    parts
}

/// Each expert's [W1, b1, W2, b2] inside the stacks W1b [E, d+1, f₁] and W2b [E, f+1, d].
fn stacked_parts<'a, T>(w1s: &'a [T], w2s: &'a [T], d: usize, f1: usize, f: usize) -> Vec<[&'a [T]; 4]> {
    let (s1, s2) = ((d + 1) * f1, (f + 1) * d);
    w1s.chunks(s1.max(1))
        .zip(w2s.chunks(s2.max(1)))
        .map(|(a, b)| {
            let ((w1, b1), (w2, b2)) = (a.split_at(d * f1), b.split_at(f * d));
            [w1, b1, w2, b2]
        })
        .collect()
}

/// As [`stacked_parts`], for the gradient stacks.
fn stacked_parts_mut<'a, T>(g1s: &'a mut [T], g2s: &'a mut [T], d: usize, f1: usize, f: usize) -> Vec<[&'a mut [T]; 4]> {
    let (s1, s2) = ((d + 1) * f1, (f + 1) * d);
    g1s.chunks_mut(s1.max(1))
        .zip(g2s.chunks_mut(s2.max(1)))
        .map(|(a, b)| {
            let ((w1, b1), (w2, b2)) = (a.split_at_mut(d * f1), b.split_at_mut(f * d));
            [w1, b1, w2, b2]
        })
        .collect()
}

macro_rules! grouped_ffn_impl {
    ($gfwd:ident, $gbwd:ident, $fwd:ident, $bwd:ident, $t:ty, $variant:ident) => {
        /// The experts run side by side on the pool (each writes its own rows of y): an expert's
        /// GEMMs alone are too small to keep many cores busy. `weights[e]` = [W1, b1, W2, b2].
        fn $gfwd(x: &[$t], weights: &[[&[$t]; 4]], counts: &[usize], d: usize, f: usize, act: Activation) -> (Vec<$t>, Vec<Saved>) {
            assert_eq!(counts.iter().sum::<usize>() * d, x.len(), "the experts' rows are x's rows");
            assert_eq!(weights.len(), counts.len(), "weights for every expert");
            let mut y = Unfilled::<$t>::new(x.len());
            let starts: Vec<usize> = counts.iter().scan(0, |row, &n| Some(std::mem::replace(row, *row + n))).collect();
            let work: Vec<_> = split_parts(y.slots(), counts.iter().map(|&n| n * d)).into_iter().enumerate().collect();
            let saved = run_parallel(work, |(e, ye)| {
                let (row, n) = (starts[e], counts[e]);
                let (h, a) = $fwd(&x[row * d..(row + n) * d], weights[e], n, d, f, act, ye);
                Saved::$variant(h, a)
            });
            // SAFETY: each expert's forward wrote every slot of its rows, and the rows cover x.
            (unsafe { y.assume_written() }, saved)
        }

        /// As the forward: the experts side by side, each writing its own rows of the input
        /// gradient (returned) and its own weight gradients (`grads[e]`, shaped as `weights[e]`).
        #[allow(clippy::too_many_arguments)]
        fn $gbwd(
            x: &[$t],
            weights: &[[&[$t]; 4]],
            g: &[$t],
            counts: &[usize],
            d: usize,
            f: usize,
            act: Activation,
            saved: Option<Vec<Saved>>,
            grads: Vec<[&mut [MaybeUninit<$t>]; 4]>,
        ) -> Vec<$t> {
            assert_eq!(counts.iter().sum::<usize>() * d, x.len(), "the experts' rows are x's rows");
            assert!(weights.len() == counts.len() && grads.len() == counts.len(), "weights and gradients for every expert");
            let mut kept: Vec<Option<(Vec<$t>, Vec<$t>)>> = match saved.filter(|s| s.len() == counts.len()) {
                Some(s) => s
                    .into_iter()
                    .map(|s| match s {
                        Saved::$variant(h, a) => Some((h, a)),
                        #[allow(unreachable_patterns)]
                        _ => None,
                    })
                    .collect(),
                None => counts.iter().map(|_| None).collect(),
            };
            let mut gx = Unfilled::<$t>::new(x.len());
            let starts: Vec<usize> = counts.iter().scan(0, |row, &n| Some(std::mem::replace(row, *row + n))).collect();
            let work: Vec<_> = split_parts(gx.slots(), counts.iter().map(|&n| n * d))
                .into_iter()
                .zip(grads)
                .zip(kept.iter_mut().map(Option::take))
                .enumerate()
                .collect();
            run_parallel(work, |(e, ((ge, gw), kept))| {
                let (row, n) = (starts[e], counts[e]);
                let rows = row * d..(row + n) * d;
                $bwd(&x[rows.clone()], weights[e], &g[rows], n, d, f, act, kept, ge, gw);
            });
            // SAFETY: each expert's backward wrote every slot of its rows, and the rows cover x.
            unsafe { gx.assume_written() }
        }
    };
}

grouped_ffn_impl!(grouped_fwd_f32, grouped_bwd_f32, ffn_fwd_f32, ffn_bwd_f32, f32, F32);
grouped_ffn_impl!(grouped_fwd_f64, grouped_bwd_f64, ffn_fwd_f64, ffn_bwd_f64, f64, F64);

custom_op!(GroupedExpertFfn: CustomOp3 "lazarus-grouped-expert-ffn", cpu, "grouped-expert-ffn");

impl GroupedExpertFfn {
    fn cpu(&self, [(s1, l1), (s2, l2), (s3, l3)]: [(&CpuStorage, &Layout); 3]) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, d) = l1.shape().dims2()?;
        let (e, d1, f1) = l2.shape().dims3()?;
        let f = l3.shape().dims3()?.1.saturating_sub(1);
        if d1 != d + 1
            || l3.shape().dims3()? != (e, f + 1, d)
            || f1 != self.act.first_width(f)
            || e != self.counts.len()
            || self.counts.iter().sum::<usize>() != rows
        {
            candle_core::bail!(
                "grouped expert ffn: shapes {:?} {:?} {:?} do not match counts {:?}",
                l1.shape(),
                l2.shape(),
                l3.shape(),
                self.counts
            );
        }
        let (out, saved) = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(w1), CpuStorage::F32(w2)) => {
                let w = stacked_parts(contiguous_slice(w1, l2)?, contiguous_slice(w2, l3)?, d, f1, f);
                let (y, saved) = grouped_fwd_f32(contiguous_slice(x, l1)?, &w, &self.counts, d, f, self.act);
                (CpuStorage::F32(y), saved)
            }
            (CpuStorage::F64(x), CpuStorage::F64(w1), CpuStorage::F64(w2)) => {
                let w = stacked_parts(contiguous_slice(w1, l2)?, contiguous_slice(w2, l3)?, d, f1, f);
                let (y, saved) = grouped_fwd_f64(contiguous_slice(x, l1)?, &w, &self.counts, d, f, self.act);
                (CpuStorage::F64(y), saved)
            }
            _ => candle_core::bail!("grouped expert ffn: f32 or f64 inputs of one dtype"),
        };
        if let Ok(mut slot) = self.saved.lock() {
            *slot = Some(saved);
        }
        Ok((out, Shape::from((rows, d))))
    }

    fn grads(&self, [x, w1s, w2s]: [&Tensor; 3], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads3> {
        let (_, d) = x.dims2()?;
        let (f1, f) = (w1s.dim(2)?, w2s.dim(1)? - 1);
        let dev = x.device();
        let saved = self.saved.lock().ok().and_then(|mut s| s.take());
        let (gx, g1, g2) = match x.dtype() {
            candle_core::DType::F32 => {
                let (mut g1, mut g2) = (vec![0f32; w1s.elem_count()], vec![0f32; w2s.elem_count()]);
                // SAFETY: the backward writes only initialized values into the slots.
                let slots = unsafe { (as_slots(&mut g1), as_slots(&mut g2)) };
                let gx = with_host_f32([x, w1s, w2s, grad], |[x, w1, w2, g]| {
                    let w = stacked_parts(w1, w2, d, f1, f);
                    grouped_bwd_f32(x, &w, g, &self.counts, d, f, self.act, saved, stacked_parts_mut(slots.0, slots.1, d, f1, f))
                })?;
                (Tensor::from_vec(gx, x.shape(), dev)?, Tensor::from_vec(g1, w1s.shape(), dev)?, Tensor::from_vec(g2, w2s.shape(), dev)?)
            }
            _ => {
                let v = host_f64;
                let saved = saved.filter(|_| x.dtype() == candle_core::DType::F64);
                let (w1, w2) = (v(w1s)?, v(w2s)?);
                let (mut g1, mut g2) = (vec![0f64; w1.len()], vec![0f64; w2.len()]);
                let w = stacked_parts(&w1, &w2, d, f1, f);
                // SAFETY: the backward writes only initialized values into the slots.
                let slots = unsafe { (as_slots(&mut g1), as_slots(&mut g2)) };
                let gx = grouped_bwd_f64(
                    &v(x)?,
                    &w,
                    &v(grad)?,
                    &self.counts,
                    d,
                    f,
                    self.act,
                    saved,
                    stacked_parts_mut(slots.0, slots.1, d, f1, f),
                );
                (Tensor::from_vec(gx, x.shape(), dev)?, Tensor::from_vec(g1, w1s.shape(), dev)?, Tensor::from_vec(g2, w2s.shape(), dev)?)
            }
        };
        Ok((Some(gx), Some(g1), Some(g2)))
    }
}

/// An FFN's four kernel operands from its parameter list: [W1, b1, W2, b2] as they are, or
/// [W1, W2] (a model without FFN biases) with zero biases beside them. The zeros' gradients are
/// computed by the kernels and dropped (f₁ + d values an expert).
pub fn ffn_weights(tensors: &[&Tensor]) -> candle_core::Result<[Tensor; 4]> {
    match tensors {
        [w1, b1, w2, b2] => Ok([(*w1).clone(), (*b1).clone(), (*w2).clone(), (*b2).clone()]),
        [w1, w2] => {
            let zeros = |len: usize| Tensor::zeros(len, w1.dtype(), w1.device());
            Ok([(*w1).clone(), zeros(w1.dim(1)?)?, (*w2).clone(), zeros(w2.dim(1)?)?])
        }
        other => candle_core::bail!("an FFN has 2 or 4 tensors, not {}", other.len()),
    }
}

/// act(x·W1 + b1)·W2 + b2 for x [n, d], W1 [d, f₁], b1 [f₁], W2 [f, d], b2 [d] (f₁ = f for
/// GELU, 2f for SwiGLU); differentiable in all five: one expert is a group of one.
pub fn expert_ffn(x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor, act: Activation) -> candle_core::Result<Tensor> {
    // On a GPU: two of our linear layers around our activation, every gradient through autograd.
    #[cfg(feature = "cuda")]
    if super::cuda::takes(x) && [w1, b1, w2, b2].iter().all(|w| w.dtype() == x.dtype()) {
        return super::linear(&super::cuda_activation(&super::linear(x, w1, b1)?, act)?, w2, b2);
    }
    grouped_expert_ffn(x, &[[w1, b1, w2, b2]], &[x.dim(0)?], act)
}

/// Every expert of a layer over rows grouped by expert: x [R, d] with `counts[e]` rows for expert
/// e (in expert order, Σ counts = R); `experts[e]` = (W1 [d, f₁], b1 [f₁], W2 [f, d], b2 [d]).
/// Returns [R, d], each row through its own expert; differentiable in x and every weight.
pub fn grouped_expert_ffn(x: &Tensor, experts: &[[&Tensor; 4]], counts: &[usize], act: Activation) -> candle_core::Result<Tensor> {
    if experts.len() != counts.len() {
        candle_core::bail!("grouped expert ffn: {} experts but {} counts", experts.len(), counts.len())
    }
    if !super::fused_here(x) {
        return per_expert_ffn(x, experts, counts, act);
    }
    let (d, f1) = experts.first().map_or(Ok((x.dim(1)?, 0)), |[w1, ..]| w1.dims2())?;
    let f = experts.first().map_or(Ok(0), |[_, _, w2, _]| w2.dim(0))?;
    // One cat per stack (W1, b1, W1, b1, … rows, then a free reshape): a single copy of the
    // weights forward, and a single narrow per tensor backward.
    let mut w1: Vec<Tensor> = Vec::with_capacity(2 * experts.len());
    let mut w2: Vec<Tensor> = Vec::with_capacity(2 * experts.len());
    for [a, b, c, e] in experts {
        w1.extend([(*a).clone(), b.unsqueeze(0)?]);
        w2.extend([(*c).clone(), e.unsqueeze(0)?]);
    }
    let n = experts.len();
    let op = GroupedExpertFfn { counts: counts.to_vec(), act, saved: Mutex::new(None) };
    x.contiguous()?.apply_op3(&Tensor::cat(&w1, 0)?.reshape((n, d + 1, f1))?, &Tensor::cat(&w2, 0)?.reshape((n, f + 1, d))?, op)
}

/// Weight gradients that a node hands over directly instead of through candle's autograd, each
/// beside the weight tensor it belongs to; see [`grouped_expert_ffn_to_sink`]. Clones share one
/// list.
#[derive(Clone, Default)]
pub struct WeightGradSink(Arc<Mutex<Vec<(Tensor, Tensor)>>>);

impl WeightGradSink {
    pub fn new() -> Self {
        Self::default()
    }

    pub(crate) fn push(&self, weight: &Tensor, grad: Tensor) {
        if let Ok(mut list) = self.0.lock() {
            list.push((weight.clone(), grad));
        }
    }

    /// Move every gradient handed over so far into `grads`, adding it to one already there.
    pub fn drain_into(&self, grads: &mut GradStore) -> candle_core::Result<()> {
        let list = match self.0.lock() {
            Ok(mut list) => std::mem::take(&mut *list),
            Err(_) => candle_core::bail!("weight gradient sink: poisoned by a panicked backward"),
        };
        for (weight, grad) in list {
            let sum = match grads.remove(&weight) {
                Some(old) => (old + grad)?,
                None => grad,
            };
            grads.insert(&weight, sum);
        }
        Ok(())
    }
}

/// The grouped experts as a node whose only autograd input is x: the kernel reads each expert's
/// weights straight from their tensors and its backward hands their gradients to a
/// [`WeightGradSink`] instead of returning them.
///
/// Why: candle's backward zero-fills and adds every gradient it passes along an edge, on the
/// calling thread. Through the stacks of [`grouped_expert_ffn`] (cat, reshape, then each expert's
/// leaf) that is three zero-fills and three adds of every expert weight, plus the forward's copy
/// into the stacks: on the default model ~8.4M floats each, a serial tenth of a 2-core step and
/// more on many cores. Here the gradients land once, in their own buffers, written in parallel.
struct GroupedExpertFfnToSink {
    counts: Vec<usize>,
    act: Activation,
    /// Per expert [W1 (d×f₁), b1 (f₁), W2 (f×d), b2 (d)].
    weights: Vec<[Tensor; 4]>,
    saved: Mutex<Option<Vec<Saved>>>,
    sink: WeightGradSink,
}

impl GroupedExpertFfnToSink {
    fn flat_weights(&self) -> Vec<Option<Tensor>> {
        self.weights.iter().flatten().map(|t| Some(t.clone())).collect()
    }

    /// The hidden width f (W2's rows).
    fn f(&self) -> usize {
        self.weights.first().map_or(0, |w| w[2].dims().first().copied().unwrap_or(0))
    }

    /// The weights as f64 copies (the f64 path is the tests' reference precision, not a hot path).
    fn weights_f64(&self) -> candle_core::Result<Vec<Vec<f64>>> {
        self.weights.iter().flatten().map(host_f64).collect()
    }

    /// One gradient buffer per weight tensor, per expert, for the backward to write in full (not
    /// zero-filled: 16 MB a layer on the default model).
    fn grad_buffers<T>(&self) -> Vec<[Unfilled<T>; 4]> {
        self.weights.iter().map(|w| w.each_ref().map(|t| Unfilled::new(t.elem_count()))).collect()
    }

    /// Hand each expert's weight gradients, written by the backward, to the sink, as tensors of
    /// the weights' dtype.
    ///
    /// # Safety
    /// Every slot of every buffer must have been written.
    unsafe fn hand_over<T: candle_core::WithDType>(&self, grads: Vec<[Unfilled<T>; 4]>) -> candle_core::Result<()> {
        for (w, g) in self.weights.iter().zip(grads) {
            for (t, g) in w.iter().zip(g) {
                // SAFETY: forwarded from the caller.
                let g = unsafe { g.assume_written() };
                self.sink.push(t, Tensor::from_vec(g, t.shape(), t.device())?.to_dtype(t.dtype())?);
            }
        }
        Ok(())
    }
}

/// [W1, b1, W2, b2] per expert from a flat list of 4·E slices.
fn by_expert<'a, T>(flat: &[Option<&'a [T]>]) -> Vec<[&'a [T]; 4]> {
    flat.chunks(4).map(|c| std::array::from_fn(|i| c[i].unwrap_or_default())).collect()
}

custom_op!(GroupedExpertFfnToSink: CustomOp1 "lazarus-grouped-expert-ffn-to-sink", cpu, "grouped-expert-ffn-to-sink");

impl GroupedExpertFfnToSink {
    fn cpu(&self, [(storage, layout)]: [(&CpuStorage, &Layout); 1]) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, d) = layout.shape().dims2()?;
        let f = self.f();
        let f1 = self.act.first_width(f);
        let dtype = candle_core::backend::BackendStorage::dtype(storage);
        for [w1, b1, w2, b2] in &self.weights {
            let shapes = [w1.dims(), b1.dims(), w2.dims(), b2.dims()];
            if shapes != [&[d, f1][..], &[f1], &[f, d], &[d]] || [w1, b1, w2, b2].iter().any(|w| w.dtype() != dtype) {
                candle_core::bail!("grouped expert ffn: expert weights {shapes:?} do not fit rows of width {d} and hidden width {f}");
            }
        }
        if self.weights.len() != self.counts.len() || self.counts.iter().sum::<usize>() != rows {
            candle_core::bail!(
                "grouped expert ffn: {} rows and {} experts do not match counts {:?}",
                rows,
                self.weights.len(),
                self.counts
            );
        }
        let (out, saved) = match storage {
            CpuStorage::F32(x) => {
                let x = contiguous_slice(x, layout)?;
                let (y, saved) =
                    with_f32_slices(&self.flat_weights(), |w| grouped_fwd_f32(x, &by_expert(w), &self.counts, d, f, self.act))?;
                (CpuStorage::F32(y), saved)
            }
            CpuStorage::F64(x) => {
                let owned = self.weights_f64()?;
                let flat: Vec<Option<&[f64]>> = owned.iter().map(|v| Some(v.as_slice())).collect();
                let (y, saved) = grouped_fwd_f64(contiguous_slice(x, layout)?, &by_expert(&flat), &self.counts, d, f, self.act);
                (CpuStorage::F64(y), saved)
            }
            _ => candle_core::bail!("grouped expert ffn: only f32 and f64 are supported"),
        };
        if let Ok(mut slot) = self.saved.lock() {
            *slot = Some(saved);
        }
        Ok((out, Shape::from((rows, d))))
    }

    fn grads(&self, [x]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads1> {
        let (_, d) = x.dims2()?;
        let f = self.f();
        let dev = x.device();
        let saved = self.saved.lock().ok().and_then(|mut s| s.take());
        let gx = match x.dtype() {
            candle_core::DType::F32 => {
                let mut gw = self.grad_buffers::<f32>();
                // x, the output gradient and every weight, borrowed from their storage in one go.
                let mut inputs = vec![Some(x.clone()), Some(grad.clone())];
                inputs.extend(self.flat_weights());
                let gx = with_f32_slices(&inputs, |v| {
                    let refs = gw.iter_mut().map(|e| e.each_mut().map(Unfilled::slots)).collect();
                    let (xv, g) = (v[0].unwrap_or_default(), v[1].unwrap_or_default());
                    grouped_bwd_f32(xv, &by_expert(&v[2..]), g, &self.counts, d, f, self.act, saved, refs)
                })?;
                // SAFETY: the grouped backward wrote every expert's gradients in full.
                unsafe { self.hand_over(gw)? };
                Tensor::from_vec(gx, x.shape(), dev)?
            }
            _ => {
                let saved = saved.filter(|_| x.dtype() == candle_core::DType::F64);
                let owned = self.weights_f64()?;
                let flat: Vec<Option<&[f64]>> = owned.iter().map(|v| Some(v.as_slice())).collect();
                let mut gw = self.grad_buffers::<f64>();
                let refs = gw.iter_mut().map(|e| e.each_mut().map(Unfilled::slots)).collect();
                let gx = grouped_bwd_f64(&host_f64(x)?, &by_expert(&flat), &host_f64(grad)?, &self.counts, d, f, self.act, saved, refs);
                // SAFETY: the grouped backward wrote every expert's gradients in full.
                unsafe { self.hand_over(gw)? };
                Tensor::from_vec(gx, x.shape(), dev)?.to_dtype(x.dtype())?
            }
        };
        Ok(Some(gx))
    }
}

/// [`grouped_expert_ffn`] whose backward hands the expert weights' gradients to `sink` (drain it
/// into the [`GradStore`] after `backward()`) instead of through candle's autograd; x's gradient
/// flows as usual. Same values, computed by the same kernel, without the stacks' copies and
/// candle's zero-fills and adds (see `GroupedExpertFfnToSink`). Experts are given as [W1 [d, f₁],
/// b1 [f₁], W2 [f, d], b2 [d]].
pub fn grouped_expert_ffn_to_sink(
    x: &Tensor,
    experts: &[[&Tensor; 4]],
    counts: &[usize],
    act: Activation,
    sink: &WeightGradSink,
) -> candle_core::Result<Tensor> {
    if experts.len() != counts.len() || experts.is_empty() {
        candle_core::bail!("grouped expert ffn: {} experts but {} counts", experts.len(), counts.len())
    }
    #[cfg(feature = "cuda")]
    if super::cuda::takes(x) && experts.iter().flatten().all(|w| w.dtype() == x.dtype()) {
        let params: Vec<&[&Tensor]> = experts.iter().map(|e| e.as_slice()).collect();
        return super::cuda::grouped_expert_ffn_to_sink(x, &params, None, counts, act, sink);
    }
    if !super::fused_here(x) {
        // Off the CPU and our GPU kernels, candle's autograd carries every gradient; the sink
        // stays empty.
        return per_expert_ffn(x, experts, counts, act);
    }
    let mut weights = Vec::with_capacity(experts.len());
    for [w1, b1, w2, b2] in experts {
        weights.push([w1.contiguous()?, b1.contiguous()?, w2.contiguous()?, b2.contiguous()?]);
    }
    let op = GroupedExpertFfnToSink { counts: counts.to_vec(), act, weights, saved: Mutex::new(None), sink: sink.clone() };
    x.contiguous()?.apply_op1(op)
}

/// Every expert over its rows one at a time (x [R, d], `counts[e]` rows for expert e, in expert
/// order), each act(x·W1 + b1)·W2 + b2, concatenated back in row order: where the fused kernels
/// do not run, candle's autograd through our GELU.
fn per_expert_ffn(x: &Tensor, experts: &[[&Tensor; 4]], counts: &[usize], act: Activation) -> candle_core::Result<Tensor> {
    let mut parts = Vec::with_capacity(experts.len());
    let mut row = 0;
    for (w, &n) in experts.iter().zip(counts) {
        if n > 0 {
            let h = super::composite::linear(&x.narrow(0, row, n)?, w[0], w[1])?;
            let a = match act {
                // The fused GELU (one kernel each way on the CPU and on CUDA), not candle's chain.
                Activation::Gelu => super::gelu(&h)?,
                Activation::Swiglu => super::composite::swiglu(&h)?,
            };
            parts.push(super::composite::linear(&a, w[2], w[3])?);
            row += n;
        }
    }
    if parts.is_empty() {
        return x.zeros_like();
    }
    Tensor::cat(&parts, 0)
}

#[cfg(test)]
mod tests {
    use super::super::gelu::gelu;
    use super::super::testing;
    use super::*;
    use candle_core::Var;

    /// With no hidden units the output is b2 on every row: its gradient is the output gradient
    /// summed over the rows, every other gradient zero.
    #[test]
    fn an_expert_without_hidden_units_still_has_its_output_bias_gradient() {
        let (d, rows) = (3, 4);
        let dev = candle_core::Device::Cpu;
        let mut var = testing::vars(5, 1.0);
        let cast = |v: Var| Var::from_tensor(&v.as_tensor().to_dtype(candle_core::DType::F32).unwrap()).unwrap();
        let (x, probe, b2) = (cast(var(&[rows, d])), cast(var(&[rows, d])), cast(var(&[d])));
        let empty = |shape: &[usize]| Var::from_tensor(&Tensor::zeros(shape, candle_core::DType::F32, &dev).unwrap()).unwrap();
        let (w1, b1, w2) = (empty(&[d, 0]), empty(&[0]), empty(&[0, d]));
        let sink = WeightGradSink::new();
        let y = grouped_expert_ffn_to_sink(
            x.as_tensor(),
            &[[w1.as_tensor(), b1.as_tensor(), w2.as_tensor(), b2.as_tensor()]],
            &[rows],
            Activation::Gelu,
            &sink,
        )
        .unwrap();
        let mut grads = (&y * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        sink.drain_into(&mut grads).unwrap();
        let expected = probe.as_tensor().sum(0).unwrap();
        assert!(
            testing::max_diff(
                &grads.get(b2.as_tensor()).unwrap().to_dtype(candle_core::DType::F64).unwrap(),
                &expected.to_dtype(candle_core::DType::F64).unwrap()
            ) < 1e-6
        );
        let gx = grads.get(x.as_tensor()).unwrap().to_dtype(candle_core::DType::F64).unwrap();
        assert_eq!(gx.abs().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap(), 0.0, "x reaches nothing");
    }

    /// The sink version against the autograd one: same output, same input gradient, and every
    /// expert weight's gradient in the sink (zero for an expert without rows), in f64 and f32;
    /// a second forward's gradients add to the first's when both are drained into one store.
    #[test]
    fn the_sink_version_matches_the_autograd_one() {
        let (d, f) = (5, 6);
        let counts = [3usize, 0, 4, 1];
        let rows: usize = counts.iter().sum();
        for (dtype, act) in [
            (candle_core::DType::F64, Activation::Gelu),
            (candle_core::DType::F32, Activation::Gelu),
            (candle_core::DType::F64, Activation::Swiglu),
            (candle_core::DType::F32, Activation::Swiglu),
        ] {
            let f1 = act.first_width(f);
            let mut var = testing::vars(23, 0.5);
            let cast = |v: Var| Var::from_tensor(&v.as_tensor().to_dtype(dtype).unwrap()).unwrap();
            let (x, probe) = (cast(var(&[rows, d])), cast(var(&[rows, d])));
            let weights: Vec<[Var; 4]> =
                counts.iter().map(|_| [cast(var(&[d, f1])), cast(var(&[f1])), cast(var(&[f, d])), cast(var(&[d]))]).collect();
            let refs: Vec<[&Tensor; 4]> = weights.iter().map(|w| w.each_ref().map(|v| v.as_tensor())).collect();
            let theirs = grouped_expert_ffn(x.as_tensor(), &refs, &counts, act).unwrap();
            let sink = WeightGradSink::new();
            let ours = grouped_expert_ffn_to_sink(x.as_tensor(), &refs, &counts, act, &sink).unwrap();
            let tol = if dtype == candle_core::DType::F64 { 1e-12 } else { 1e-5 };
            let diff = |a: &Tensor, b: &Tensor| {
                testing::max_diff(&a.to_dtype(candle_core::DType::F64).unwrap(), &b.to_dtype(candle_core::DType::F64).unwrap())
            };
            assert!(diff(&ours, &theirs) < tol);
            let g_theirs = (&theirs * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
            let mut g_ours = (&ours * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
            assert!(g_ours.get(refs[0][0]).is_none(), "weight gradients come through the sink only");
            sink.drain_into(&mut g_ours).unwrap();
            assert!(diff(g_ours.get(x.as_tensor()).unwrap(), g_theirs.get(x.as_tensor()).unwrap()) < tol);
            for (e, w) in refs.iter().enumerate() {
                for t in w {
                    let ours = g_ours.get(t).unwrap_or_else(|| panic!("no gradient for expert {e}"));
                    match g_theirs.get(t) {
                        Some(theirs) => assert!(diff(ours, theirs) < tol, "expert {e}"),
                        None => assert_eq!(
                            ours.abs().unwrap().sum_all().unwrap().to_dtype(candle_core::DType::F64).unwrap().to_scalar::<f64>().unwrap(),
                            0.0
                        ),
                    }
                }
            }
            // Two forwards, one store: the gradients add up.
            let again = grouped_expert_ffn_to_sink(x.as_tensor(), &refs, &counts, act, &sink).unwrap();
            let mut twice = ((&ours + &again).unwrap() * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
            sink.drain_into(&mut twice).unwrap();
            let doubled = (g_theirs.get(refs[2][0]).unwrap() * 2.0).unwrap();
            assert!(diff(twice.get(refs[2][0]).unwrap(), &doubled) < 2.0 * tol);
        }
        let sink = WeightGradSink::new();
        let x = Tensor::zeros((2, 5), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        let w = [(5, 6), (6, 1), (6, 5), (5, 1)].map(|s| Tensor::zeros(s, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap());
        let err = grouped_expert_ffn_to_sink(&x, &[w.each_ref()], &[2], Activation::Gelu, &sink).unwrap_err().to_string();
        assert!(err.contains("do not fit"), "{err}");
    }

    #[test]
    fn grouped_experts_match_the_composite_per_expert_with_gradients() {
        let (d, f) = (5, 6);
        let counts = [3usize, 0, 4, 1];
        let mut var = testing::vars(17, 0.5);
        let rows: usize = counts.iter().sum();
        let x = var(&[rows, d]);
        let probe = var(&[rows, d]);
        let weights: Vec<[Var; 4]> = counts.iter().map(|_| [var(&[d, f]), var(&[f]), var(&[f, d]), var(&[d])]).collect();
        let refs: Vec<[&Tensor; 4]> =
            weights.iter().map(|w| [w[0].as_tensor(), w[1].as_tensor(), w[2].as_tensor(), w[3].as_tensor()]).collect();
        let ours = grouped_expert_ffn(x.as_tensor(), &refs, &counts, Activation::Gelu).unwrap();
        let mut parts = Vec::new();
        let mut row = 0;
        for (e, &n) in counts.iter().enumerate() {
            if n > 0 {
                let w = &refs[e];
                let h = x.as_tensor().narrow(0, row, n).unwrap().matmul(w[0]).unwrap().broadcast_add(w[1]).unwrap();
                parts.push(gelu(&h).unwrap().matmul(w[2]).unwrap().broadcast_add(w[3]).unwrap());
            }
            row += n;
        }
        let theirs = Tensor::cat(&parts, 0).unwrap();
        let diff = testing::max_diff;
        assert!(diff(&ours, &theirs) < 1e-12);
        let g1 = (&ours * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (&theirs * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(diff(g1.get(x.as_tensor()).unwrap(), g2.get(x.as_tensor()).unwrap()) < 1e-10);
        for (e, w) in weights.iter().enumerate() {
            for v in w {
                match (g1.get(v.as_tensor()), g2.get(v.as_tensor())) {
                    (Some(a), Some(b)) => assert!(diff(a, b) < 1e-10),
                    (Some(a), None) => {
                        assert_eq!(counts[e], 0, "gradient only on our side");
                        assert_eq!(a.abs().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap(), 0.0);
                    }
                    (None, _) => panic!("no gradient for expert {e}"),
                }
            }
        }
    }
}
