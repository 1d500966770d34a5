//! Softmax over the last dimension: s = exp(x − max) / Σ exp(x − max) per row in one pass, and
//! backward dx = s ⊙ (g − Σ g·s) in one pass, rows split over the cores, instead of candle's
//! exp, sum and broadcast-divide nodes. Unlike the other kernels it has no per-dtype path: f32
//! inputs are computed in f64 and rounded back.

use super::host::{host_f64, storage_f64, storage_like, tensor_like};
use super::parallel::rows_parallel;

/// Softmax rows go over the cores from this many elements: an `exp` each (the router's
/// probabilities, [tokens, experts], are small but were a serial millisecond a step on 16 cores).
const SOFTMAX_PARALLEL_MIN: usize = 1 << 11;
use candle_core::{CpuStorage, Layout, Shape, Tensor};

/// Softmax over the last dimension in one pass per row; backward
/// dx = s ⊙ (g − Σ g·s) in one pass.
struct SoftmaxLast;

custom_op!(SoftmaxLast: CustomOp1 "lazarus-softmax-last", cpu, "softmax-last");

impl SoftmaxLast {
    fn cpu(&self, [(storage, layout)]: [(&CpuStorage, &Layout); 1]) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = storage_f64(storage, layout)?;
        let width = layout.shape().dims().last().copied().unwrap_or(1);
        let out = rows_parallel(&x, width, SOFTMAX_PARALLEL_MIN, |input, out| {
            for (row, o) in input.chunks(width).zip(out.chunks_mut(width)) {
                let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let mut sum = 0.0;
                for (o, &v) in o.iter_mut().zip(row) {
                    *o = (v - max).exp();
                    sum += *o;
                }
                o.iter_mut().for_each(|o| *o /= sum);
            }
        });
        Ok((storage_like(storage, out), layout.shape().clone()))
    }

    fn grads(&self, [_arg]: [&Tensor; 1], res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads1> {
        let width = res.dims().last().copied().unwrap_or(1);
        let s = host_f64(res)?;
        let g = host_f64(grad)?;
        let mut packed = Vec::with_capacity(2 * s.len());
        for (sr, gr) in s.chunks(width).zip(g.chunks(width)) {
            packed.extend_from_slice(sr);
            packed.extend_from_slice(gr);
        }
        let dx = rows_parallel(&packed, 2 * width, SOFTMAX_PARALLEL_MIN, |input, out| {
            for (row, o) in input.chunks(2 * width).zip(out.chunks_mut(2 * width)) {
                let (s, g) = row.split_at(width);
                let dot: f64 = s.iter().zip(g).map(|(a, b)| a * b).sum();
                for j in 0..width {
                    o[j] = s[j] * (g[j] - dot);
                }
            }
        });
        let dx: Vec<f64> = dx.chunks(2 * width).flat_map(|r| r[..width].to_vec()).collect();
        Ok(Some(tensor_like(res, dx, res.shape())?))
    }
}

/// Softmax over the last dimension, differentiable.
pub fn softmax_last(x: &Tensor) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if super::cuda::takes(x) && x.dtype() != candle_core::DType::BF16 {
        return super::cuda::softmax_last(x);
    }
    if !super::fused_here(x) {
        return super::composite::softmax_last(x);
    }
    x.contiguous()?.apply_op1(SoftmaxLast)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{assert_same_with_gradients, data};
    use super::*;
    use candle_core::{Device, Var};

    /// The composite reference (max shift, exp, sum over the last dimension, broadcast divide).
    fn composite(x: &Tensor) -> Tensor {
        super::super::composite::softmax_last(x).unwrap()
    }

    /// Ours against the composite on `rows` rows of `width`, values and gradient (of a
    /// product with a probe), from data of `seed`.
    fn matches_composite(rows: usize, width: usize, seed: u64) {
        let x = Var::from_vec(data(rows * width, seed), (rows, width), &Device::Cpu).unwrap();
        let ours = softmax_last(x.as_tensor()).unwrap();
        let theirs = composite(x.as_tensor());
        assert_same_with_gradients(&[&x], &ours, &theirs, seed + 1, 1e-12, 1e-12);
    }

    /// Small, and large enough (≥ 2^15 elements, an odd row count) for the rows — and the sums
    /// over them — to be split over the cores.
    #[test]
    fn softmax_matches_composite_with_gradient() {
        for (rows, width, seed) in [(6, 70, 1), (301, 129, 3)] {
            matches_composite(rows, width, seed);
        }
    }
}
