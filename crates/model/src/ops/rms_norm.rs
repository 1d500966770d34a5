//! RMSNorm over the last dimension with a weight, x/√(mean(x²) + eps)·w (Zhang & Sennrich 2019;
//! Llama's and Mixtral's norm), fused: one pass forward, one pass backward for x and w together,
//! instead of candle's square, mean, add, sqrt, divide and multiply nodes and their backward. As
//! [`super::layer_norm`]: each dtype in its own type with the row statistic accumulated in f64,
//! rows split over the cores, the weight gradient summed per part, then over the parts in order.
//!
//! Backward, with r = 1/√(mean(x²) + eps), x̂ = x·r and ĝ = g ⊙ w: dx = r·(ĝ − x̂·mean(ĝ ⊙ x̂)),
//! dw = Σ_rows g ⊙ x̂.

use super::host::{contiguous_slice, host_f64, with_host_f32, Unfilled};
use super::parallel::{part_len, reduction_part_len, run_parallel, ROWWISE_MIN};
use candle_core::{CpuStorage, Layout, Shape, Tensor};

/// The autograd node of [`rms_norm`]: inputs x, w.
struct RmsNorm {
    eps: f64,
}

macro_rules! rms_norm_impl {
    ($fwd:ident, $bwd:ident, $t:ty) => {
        fn $fwd(x: &[$t], w: &[$t], eps: f64) -> Vec<$t> {
            let width = w.len();
            let mut y = Unfilled::<$t>::new(x.len());
            let part = part_len(x.len() / width, width, ROWWISE_MIN);
            run_parallel(x.chunks(part).zip(y.slots().chunks_mut(part)).collect(), |(xs, ys)| {
                for (row, o) in xs.chunks(width).zip(ys.chunks_mut(width)) {
                    let ms = row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / width as f64;
                    let r = (1.0 / (ms + eps).sqrt()) as $t;
                    for j in 0..width {
                        o[j].write(row[j] * r * w[j]);
                    }
                }
            });
            // SAFETY: the parts cover every row (whole rows of `width`), each element written.
            unsafe { y.assume_written() }
        }

        /// (dx, dw) from g.
        fn $bwd(x: &[$t], w: &[$t], g: &[$t], eps: f64) -> (Vec<$t>, Vec<$t>) {
            let width = w.len();
            assert_eq!(g.len(), x.len(), "an output gradient for every input element");
            let mut dx = Unfilled::<$t>::new(x.len());
            let part = reduction_part_len(x.len() / width, width, ROWWISE_MIN);
            let parts = x.chunks(part).zip(g.chunks(part)).zip(dx.slots().chunks_mut(part)).collect();
            let partials: Vec<Vec<f64>> = run_parallel(parts, |((xs, gs), dxs)| {
                let mut dw = vec![0.0f64; width];
                for ((row, gr), d) in xs.chunks(width).zip(gs.chunks(width)).zip(dxs.chunks_mut(width)) {
                    let ms = row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / width as f64;
                    let r = 1.0 / (ms + eps).sqrt();
                    let mut m = 0.0;
                    for j in 0..width {
                        let (xhat, gj) = (row[j] as f64 * r, gr[j] as f64);
                        dw[j] += gj * xhat;
                        m += gj * w[j] as f64 * xhat;
                    }
                    m /= width as f64;
                    for j in 0..width {
                        let xhat = row[j] as f64 * r;
                        d[j].write((r * (gr[j] as f64 * w[j] as f64 - xhat * m)) as $t);
                    }
                }
                dw
            });
            let mut dw = vec![0.0f64; width];
            for pw in partials {
                dw.iter_mut().zip(&pw).for_each(|(a, b)| *a += b);
            }
            // SAFETY: the parts cover every row, each element written.
            let dx = unsafe { dx.assume_written() };
            (dx, dw.into_iter().map(|v| v as $t).collect())
        }
    };
}

rms_norm_impl!(rms_norm_fwd_f32, rms_norm_bwd_f32, f32);
rms_norm_impl!(rms_norm_fwd_f64, rms_norm_bwd_f64, f64);

custom_op!(RmsNorm: CustomOp2 "lazarus-rms-norm", cpu, "rms-norm");

impl RmsNorm {
    fn cpu(&self, [(s1, l1), (s2, l2)]: [(&CpuStorage, &Layout); 2]) -> candle_core::Result<(CpuStorage, Shape)> {
        let width = l1.shape().dims().last().copied().unwrap_or(1);
        if l2.shape().elem_count() != width || width == 0 {
            candle_core::bail!("rms norm: weight {:?} does not match input {:?}", l2.shape(), l1.shape());
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(w)) => {
                CpuStorage::F32(rms_norm_fwd_f32(contiguous_slice(x, l1)?, contiguous_slice(w, l2)?, self.eps))
            }
            (CpuStorage::F64(x), CpuStorage::F64(w)) => {
                CpuStorage::F64(rms_norm_fwd_f64(contiguous_slice(x, l1)?, contiguous_slice(w, l2)?, self.eps))
            }
            _ => candle_core::bail!("rms norm: f32 or f64 inputs of one dtype"),
        };
        Ok((out, l1.shape().clone()))
    }

    fn grads(&self, [x, w]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads2> {
        let dev = x.device();
        let (dx, dw) = match x.dtype() {
            candle_core::DType::F32 => {
                let (dx, dw) = with_host_f32([x, w, grad], |[x, w, g]| rms_norm_bwd_f32(x, w, g, self.eps))?;
                (Tensor::from_vec(dx, x.shape(), dev)?, Tensor::from_vec(dw, w.shape(), dev)?)
            }
            _ => {
                let v = host_f64;
                let (dx, dw) = rms_norm_bwd_f64(&v(x)?, &v(w)?, &v(grad)?, self.eps);
                (Tensor::from_vec(dx, x.shape(), dev)?.to_dtype(x.dtype())?, Tensor::from_vec(dw, w.shape(), dev)?.to_dtype(x.dtype())?)
            }
        };
        Ok((Some(dx), Some(dw)))
    }
}

/// RMSNorm(x)·w over the last dimension, differentiable in x and w.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    rms_norm_to(x, w, eps, x.dtype())
}

/// [`rms_norm`] into `out`: x's dtype, or bf16 from f32 (the input of a bf16 product; on a GPU
/// one kernel writes it, elsewhere a cast follows).
pub fn rms_norm_to(x: &Tensor, w: &Tensor, eps: f64, out: candle_core::DType) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if super::cuda::takes(x) && x.dtype() != candle_core::DType::BF16 && w.dtype() == x.dtype() {
        return super::cuda::rms_norm_to(x, w, eps, out);
    }
    if out != x.dtype() {
        return rms_norm_to(x, w, eps, x.dtype())?.to_dtype(out);
    }
    if !super::fused_here(x) || w.dtype() != x.dtype() {
        return super::composite::rms_norm(x, w, eps);
    }
    x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps })
}

#[cfg(test)]
mod tests {
    use super::super::testing::{assert_same_with_gradients, data, max_diff};
    use super::*;
    use candle_core::{Device, Var};

    /// Ours against the composite at `rows`×`width`, forward and the gradients of x and w.
    fn check(rows: usize, width: usize, seed: u64) {
        let x = Var::from_vec(data(rows * width, seed), (rows, width), &Device::Cpu).unwrap();
        let w = Var::from_vec(data(width, seed + 1), width, &Device::Cpu).unwrap();
        let ours = rms_norm(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
        let theirs = super::super::composite::rms_norm(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
        assert_same_with_gradients(&[&x, &w], &ours, &theirs, seed + 3, 1e-12, 1e-10);
        // f32 against the f64 result.
        let x32 = x.as_tensor().to_dtype(candle_core::DType::F32).unwrap();
        let w32 = w.as_tensor().to_dtype(candle_core::DType::F32).unwrap();
        let y32 = rms_norm(&x32, &w32, 1e-5).unwrap().to_dtype(candle_core::DType::F64).unwrap();
        assert!(max_diff(&y32, &theirs) < 1e-5);
    }

    /// Small, and large enough (≥ 2^15 elements, an odd row count) for the rows — and the sums
    /// over them — to be split over the cores.
    #[test]
    fn rms_norm_matches_composite_with_gradients() {
        for (rows, width, seed) in [(5, 40, 3), (301, 129, 7)] {
            check(rows, width, seed);
        }
    }
}
