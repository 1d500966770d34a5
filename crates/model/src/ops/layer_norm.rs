//! LayerNorm over the last dimension with weight and bias, (x − mean)/√(var + eps)·w + b, fused:
//! one pass forward, and one pass backward for x, w and b together, instead of candle's mean,
//! subtract, square, mean, sqrt, divide, multiply and add nodes and their backward. Each dtype
//! runs in its own type with the row statistics accumulated in f64; rows are split over the
//! cores, and the weight and bias gradients are summed per part, then over the parts in order.

use super::host::{contiguous_slice, host_f64, with_host_f32, Unfilled};
use super::parallel::{part_len, reduction_part_len, run_parallel, ROWWISE_MIN};
use candle_core::{CpuStorage, Layout, Shape, Tensor};

/// The autograd node of [`layer_norm`]: inputs x, w, b.
struct LayerNorm {
    eps: f64,
}

macro_rules! layer_norm_impl {
    ($fwd:ident, $bwd:ident, $t:ty) => {
        fn $fwd(x: &[$t], w: &[$t], b: &[$t], eps: f64) -> Vec<$t> {
            let width = w.len();
            let mut y = Unfilled::<$t>::new(x.len());
            let part = part_len(x.len() / width, width, ROWWISE_MIN);
            run_parallel(x.chunks(part).zip(y.slots().chunks_mut(part)).collect(), |(xs, ys)| {
                for (row, o) in xs.chunks(width).zip(ys.chunks_mut(width)) {
                    let mean = row.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
                    let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / width as f64;
                    let rstd = 1.0 / (var + eps).sqrt();
                    let (mean, rstd) = (mean as $t, rstd as $t);
                    for j in 0..width {
                        o[j].write((row[j] - mean) * rstd * w[j] + b[j]);
                    }
                }
            });
            // SAFETY: the parts cover every row (whole rows of `width`), each element written.
            unsafe { y.assume_written() }
        }

        /// (dx, dw, db) from g.
        fn $bwd(x: &[$t], w: &[$t], g: &[$t], eps: f64) -> (Vec<$t>, Vec<$t>, Vec<$t>) {
            let width = w.len();
            assert_eq!(g.len(), x.len(), "an output gradient for every input element");
            let mut dx = Unfilled::<$t>::new(x.len());
            let part = reduction_part_len(x.len() / width, width, ROWWISE_MIN);
            let parts = x.chunks(part).zip(g.chunks(part)).zip(dx.slots().chunks_mut(part)).collect();
            let partials: Vec<(Vec<f64>, Vec<f64>)> = run_parallel(parts, |((xs, gs), dxs)| {
                let mut dw = vec![0.0f64; width];
                let mut db = vec![0.0f64; width];
                let mut xhat = vec![0.0f64; width];
                let mut dxhat = vec![0.0f64; width];
                for ((row, gr), d) in xs.chunks(width).zip(gs.chunks(width)).zip(dxs.chunks_mut(width)) {
                    let mean = row.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
                    let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / width as f64;
                    let rstd = 1.0 / (var + eps).sqrt();
                    let (mut m1, mut m2) = (0.0, 0.0);
                    for j in 0..width {
                        let gj = gr[j] as f64;
                        xhat[j] = (row[j] as f64 - mean) * rstd;
                        dxhat[j] = gj * w[j] as f64;
                        dw[j] += gj * xhat[j];
                        db[j] += gj;
                        m1 += dxhat[j];
                        m2 += dxhat[j] * xhat[j];
                    }
                    m1 /= width as f64;
                    m2 /= width as f64;
                    for j in 0..width {
                        d[j].write((rstd * (dxhat[j] - m1 - xhat[j] * m2)) as $t);
                    }
                }
                (dw, db)
            });
            let mut dw = vec![0.0f64; width];
            let mut db = vec![0.0f64; width];
            for (pw, pb) in partials {
                dw.iter_mut().zip(&pw).for_each(|(a, b)| *a += b);
                db.iter_mut().zip(&pb).for_each(|(a, b)| *a += b);
            }
            // SAFETY: the parts cover every row, each element written.
            let dx = unsafe { dx.assume_written() };
            (dx, dw.into_iter().map(|v| v as $t).collect(), db.into_iter().map(|v| v as $t).collect())
        }
    };
}

layer_norm_impl!(layer_norm_fwd_f32, layer_norm_bwd_f32, f32);
layer_norm_impl!(layer_norm_fwd_f64, layer_norm_bwd_f64, f64);

custom_op!(LayerNorm: CustomOp3 "lazarus-layer-norm", cpu, "layer-norm");

impl LayerNorm {
    fn cpu(&self, [(s1, l1), (s2, l2), (s3, l3)]: [(&CpuStorage, &Layout); 3]) -> candle_core::Result<(CpuStorage, Shape)> {
        let width = l1.shape().dims().last().copied().unwrap_or(1);
        if l2.shape().elem_count() != width || l3.shape().elem_count() != width {
            candle_core::bail!("layer norm: weight {:?} / bias {:?} do not match input {:?}", l2.shape(), l3.shape(), l1.shape());
        }
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(b)) => {
                CpuStorage::F32(layer_norm_fwd_f32(contiguous_slice(x, l1)?, contiguous_slice(w, l2)?, contiguous_slice(b, l3)?, self.eps))
            }
            (CpuStorage::F64(x), CpuStorage::F64(w), CpuStorage::F64(b)) => {
                CpuStorage::F64(layer_norm_fwd_f64(contiguous_slice(x, l1)?, contiguous_slice(w, l2)?, contiguous_slice(b, l3)?, self.eps))
            }
            _ => candle_core::bail!("layer norm: f32 or f64 inputs of one dtype"),
        };
        Ok((out, l1.shape().clone()))
    }

    fn grads(&self, [x, w, _b]: [&Tensor; 3], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads3> {
        let dev = x.device();
        let (dx, dw, db) = match x.dtype() {
            candle_core::DType::F32 => {
                let (dx, dw, db) = with_host_f32([x, w, grad], |[x, w, g]| layer_norm_bwd_f32(x, w, g, self.eps))?;
                (Tensor::from_vec(dx, x.shape(), dev)?, Tensor::from_vec(dw, w.shape(), dev)?, Tensor::from_vec(db, w.shape(), dev)?)
            }
            _ => {
                let v = host_f64;
                let (dx, dw, db) = layer_norm_bwd_f64(&v(x)?, &v(w)?, &v(grad)?, self.eps);
                (
                    Tensor::from_vec(dx, x.shape(), dev)?.to_dtype(x.dtype())?,
                    Tensor::from_vec(dw, w.shape(), dev)?.to_dtype(x.dtype())?,
                    Tensor::from_vec(db, w.shape(), dev)?.to_dtype(x.dtype())?,
                )
            }
        };
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// LayerNorm(x)·w + b over the last dimension, differentiable in x, w and b.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    layer_norm_to(x, w, b, eps, x.dtype())
}

/// [`layer_norm`] into `out`: x's dtype, or bf16 from f32 (the input of a bf16 product; on a GPU
/// one kernel writes it, elsewhere a cast follows).
pub fn layer_norm_to(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64, out: candle_core::DType) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if super::cuda::takes(x) && x.dtype() != candle_core::DType::BF16 && w.dtype() == x.dtype() && b.dtype() == x.dtype() {
        return super::cuda::layer_norm_to(x, w, b, eps, out);
    }
    if out != x.dtype() {
        return layer_norm_to(x, w, b, eps, x.dtype())?.to_dtype(out);
    }
    if !super::fused_here(x) {
        return super::composite::layer_norm(x, w, b, eps);
    }
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, LayerNorm { eps })
}

#[cfg(test)]
mod tests {
    use super::super::testing::{assert_same_with_gradients, data};
    use super::*;
    use candle_core::{Device, Var};

    /// The composite reference: mean, centre, variance, divide by √(var + eps), scale, shift.
    fn composite(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Tensor {
        super::super::composite::layer_norm(x, w, b, eps).unwrap()
    }

    /// Ours against the composite at `rows`×`width`, forward and the gradients of x, w and b.
    fn check(rows: usize, width: usize, seed: u64) {
        let x = Var::from_vec(data(rows * width, seed), (rows, width), &Device::Cpu).unwrap();
        let w = Var::from_vec(data(width, seed + 1), width, &Device::Cpu).unwrap();
        let b = Var::from_vec(data(width, seed + 2), width, &Device::Cpu).unwrap();
        let ours = layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
        let theirs = composite(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5);
        assert_same_with_gradients(&[&x, &w, &b], &ours, &theirs, seed + 3, 1e-12, 1e-10);
    }

    /// Small, and large enough (≥ 2^15 elements, an odd row count) for the rows — and the sums
    /// over them — to be split over the cores.
    #[test]
    fn layer_norm_matches_composite_with_gradients() {
        for (rows, width, seed) in [(5, 40, 3), (301, 129, 7)] {
            check(rows, width, seed);
        }
    }
}
