//! Causal multi-head self-attention, softmax(Q·Kᵀ/√dh + causal mask)·V, as one autograd node
//! over the packed projection qkv [B, T, 3d].
//!
//! It reads Q, K and V through strides (no permute/transpose copies) and runs each (batch, head)
//! pair as single-threaded GEMMs, the pairs spread over the cores: candle's composite version
//! spends most of its time on copies, the T×T mask and softmax passes, and thread hand-offs
//! inside many tiny batched matmuls. Backward recomputes the T×T probabilities per pair instead
//! of keeping them.

use super::gemm::gemm_strided;
use super::host::{contiguous_slice, host_f32, host_f64};
use super::parallel::{for_each_parallel, SharedMut};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

/// The autograd node of [`causal_attention`]: input qkv [B, T, 3d], output [B, T, d].
struct CausalAttention {
    heads: usize,
}

macro_rules! attention_impl {
    ($fwd:ident, $bwd:ident, $probs:ident, $t:ty) => {
        /// Causal softmax of scale·Q·Kᵀ for one (batch, head): p (t×t) gets the probabilities,
        /// zero above the diagonal.
        ///
        /// # Safety
        /// `q` and `k` point at t rows of `dh` elements with row stride `rs`.
        unsafe fn $probs(p: &mut [$t], q: *const $t, k: *const $t, t: usize, dh: usize, rs: isize, scale: $t) {
            unsafe {
                gemm_strided(t, t, dh, (p.as_mut_ptr(), t as isize), false, (q, rs, 1), (k, 1, rs), (1.0, scale), gemm::Parallelism::None)
            };
            for (i, row) in p.chunks_mut(t).enumerate() {
                let (live, masked) = row.split_at_mut(i + 1);
                let max = live.iter().cloned().fold(<$t>::NEG_INFINITY, <$t>::max);
                let mut sum = 0.0;
                for v in live.iter_mut() {
                    *v = (*v - max).exp();
                    sum += *v;
                }
                let inv = 1.0 / sum;
                live.iter_mut().for_each(|v| *v *= inv);
                masked.iter_mut().for_each(|v| *v = 0.0);
            }
        }

        /// qkv [b, t, 3d] → y [b, t, d].
        fn $fwd(qkv: &[$t], b: usize, t: usize, d: usize, heads: usize) -> Vec<$t> {
            let dh = d / heads;
            let scale = 1.0 / (dh as $t).sqrt();
            let mut y: Vec<$t> = vec![0.0; b * t * d];
            let out = SharedMut(y.as_mut_ptr());
            let src = qkv.as_ptr() as usize;
            for_each_parallel(b * heads, |job| {
                #[allow(clippy::redundant_locals)] // capture the whole Send wrapper, not its raw pointer field
                let out = out;
                let (bi, hi) = (job / heads, job % heads);
                let q = (src as *const $t).wrapping_add(bi * t * 3 * d + hi * dh);
                let (k, v) = (q.wrapping_add(d), q.wrapping_add(2 * d));
                let mut p: Vec<$t> = vec![0.0; t * t];
                // SAFETY: q, k, v index inside qkv (b·t rows of 3d); the destination is this
                // pair's own t×dh block of y (row stride d), written by no other job.
                unsafe {
                    $probs(&mut p, q, k, t, dh, 3 * d as isize, scale);
                    let dst = out.0.wrapping_add(bi * t * d + hi * dh);
                    gemm_strided(
                        t,
                        dh,
                        t,
                        (dst, d as isize),
                        false,
                        (p.as_ptr(), t as isize, 1),
                        (v, 3 * d as isize, 1),
                        (1.0, 1.0),
                        gemm::Parallelism::None,
                    );
                }
            });
            y
        }

        /// Gradient of qkv [b, t, 3d] from the output gradient g [b, t, d].
        fn $bwd(qkv: &[$t], g: &[$t], b: usize, t: usize, d: usize, heads: usize) -> Vec<$t> {
            let dh = d / heads;
            let scale = 1.0 / (dh as $t).sqrt();
            let mut dqkv: Vec<$t> = vec![0.0; b * t * 3 * d];
            let out = SharedMut(dqkv.as_mut_ptr());
            let (src, gsrc) = (qkv.as_ptr() as usize, g.as_ptr() as usize);
            let rs = 3 * d as isize;
            for_each_parallel(b * heads, |job| {
                #[allow(clippy::redundant_locals)] // capture the whole Send wrapper, not its raw pointer field
                let out = out;
                let (bi, hi) = (job / heads, job % heads);
                let base = bi * t * 3 * d + hi * dh;
                let q = (src as *const $t).wrapping_add(base);
                let (k, v) = (q.wrapping_add(d), q.wrapping_add(2 * d));
                let gy = (gsrc as *const $t).wrapping_add(bi * t * d + hi * dh);
                let (dq, dk, dv) = (out.0.wrapping_add(base), out.0.wrapping_add(base + d), out.0.wrapping_add(base + 2 * d));
                let mut p: Vec<$t> = vec![0.0; t * t];
                let mut dp: Vec<$t> = vec![0.0; t * t];
                // SAFETY: reads stay inside qkv and g; dq, dk, dv are this pair's own t×dh
                // blocks of dqkv (row stride 3d), written by no other job.
                unsafe {
                    $probs(&mut p, q, k, t, dh, rs, scale);
                    // dV = Pᵀ·dY
                    gemm_strided(
                        t,
                        dh,
                        t,
                        (dv, rs),
                        false,
                        (p.as_ptr(), 1, t as isize),
                        (gy, d as isize, 1),
                        (1.0, 1.0),
                        gemm::Parallelism::None,
                    );
                    // dP = dY·Vᵀ
                    gemm_strided(
                        t,
                        t,
                        dh,
                        (dp.as_mut_ptr(), t as isize),
                        false,
                        (gy, d as isize, 1),
                        (v, 1, rs),
                        (1.0, 1.0),
                        gemm::Parallelism::None,
                    );
                }
                // dS = P ⊙ (dP − Σ_j dP·P) · scale (zero where masked, as P is)
                for (pr, dr) in p.chunks(t).zip(dp.chunks_mut(t)) {
                    let dot: $t = pr.iter().zip(dr.iter()).map(|(a, b)| a * b).sum();
                    dr.iter_mut().zip(pr).for_each(|(x, &pv)| *x = pv * (*x - dot) * scale);
                }
                // SAFETY: as above.
                unsafe {
                    // dQ = dS·K, dK = dSᵀ·Q
                    gemm_strided(t, dh, t, (dq, rs), false, (dp.as_ptr(), t as isize, 1), (k, rs, 1), (1.0, 1.0), gemm::Parallelism::None);
                    gemm_strided(t, dh, t, (dk, rs), false, (dp.as_ptr(), 1, t as isize), (q, rs, 1), (1.0, 1.0), gemm::Parallelism::None);
                }
            });
            dqkv
        }
    };
}

attention_impl!(attention_fwd_f32, attention_bwd_f32, attention_probs_f32, f32);
attention_impl!(attention_fwd_f64, attention_bwd_f64, attention_probs_f64, f64);

impl CustomOp1 for CausalAttention {
    fn name(&self) -> &'static str {
        "lazarus-causal-attention"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, t, d3) = layout.shape().dims3()?;
        let d = d3 / 3;
        if d3 % 3 != 0 || d % self.heads != 0 {
            candle_core::bail!("attention: last dimension {d3} is not 3 × a multiple of {} heads", self.heads)
        }
        let out = match storage {
            CpuStorage::F32(v) => CpuStorage::F32(attention_fwd_f32(contiguous_slice(v, layout)?, b, t, d, self.heads)),
            CpuStorage::F64(v) => CpuStorage::F64(attention_fwd_f64(contiguous_slice(v, layout)?, b, t, d, self.heads)),
            _ => candle_core::bail!("attention: only f32 and f64 are supported"),
        };
        Ok((out, Shape::from((b, t, d))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (b, t, d3) = arg.dims3()?;
        let d = d3 / 3;
        let dqkv = match arg.dtype() {
            candle_core::DType::F32 => {
                let v = host_f32;
                Tensor::from_vec(attention_bwd_f32(&v(arg)?, &v(grad)?, b, t, d, self.heads), (b, t, d3), arg.device())?
            }
            _ => {
                let v = host_f64;
                let g = attention_bwd_f64(&v(arg)?, &v(grad)?, b, t, d, self.heads);
                Tensor::from_vec(g, (b, t, d3), arg.device())?.to_dtype(arg.dtype())?
            }
        };
        Ok(Some(dqkv))
    }
}

/// Causal self-attention over the packed projection qkv [B, T, 3d] (Q, K, V side by side, each
/// split into `heads` heads of d/heads) → [B, T, d], differentiable.
pub fn causal_attention(qkv: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    qkv.contiguous()?.apply_op1(CausalAttention { heads })
}

#[cfg(test)]
mod tests {
    use super::super::testing;
    use super::*;
    use candle_core::Device;

    #[test]
    fn fused_attention_matches_composite_with_gradient() {
        let (b, t, d, heads) = (2, 7, 12, 3);
        let dh = d / heads;
        let mut var = testing::vars(21, 1.0);
        let qkv = var(&[b, t, 3 * d]);
        let probe = var(&[b, t, d]);
        let ours = causal_attention(qkv.as_tensor(), heads).unwrap();
        // The composite reference: split heads, scores, additive mask, softmax, weighted sum.
        let x = qkv.as_tensor().reshape((b, t, 3, heads, dh)).unwrap().permute((2, 0, 3, 1, 4)).unwrap().contiguous().unwrap();
        let (q, k, v) = (x.get(0).unwrap(), x.get(1).unwrap(), x.get(2).unwrap());
        let mask: Vec<f64> = (0..t * t).map(|i| if i % t > i / t { -1e9 } else { 0.0 }).collect();
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap();
        let scores = (q.matmul(&k.t().unwrap().contiguous().unwrap()).unwrap() / (dh as f64).sqrt()).unwrap();
        let e = scores.broadcast_add(&mask).unwrap().exp().unwrap();
        let att = e.broadcast_div(&e.sum_keepdim(candle_core::D::Minus1).unwrap()).unwrap();
        let theirs = att.matmul(&v).unwrap().transpose(1, 2).unwrap().contiguous().unwrap().reshape((b, t, d)).unwrap();
        let diff = testing::max_diff;
        assert!(diff(&ours, &theirs) < 1e-12, "forward differs by {}", diff(&ours, &theirs));
        let g1 = (&ours * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (&theirs * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        let (g1, g2) = (g1.get(qkv.as_tensor()).unwrap(), g2.get(qkv.as_tensor()).unwrap());
        assert!(diff(g1, g2) < 1e-10, "gradient differs by {}", diff(g1, g2));
        // f32 agrees with f64.
        let q32 = qkv.as_tensor().to_dtype(candle_core::DType::F32).unwrap();
        let y32 = causal_attention(&q32, heads).unwrap().to_dtype(candle_core::DType::F64).unwrap();
        assert!(diff(&y32, &ours) < 1e-4);
    }
}
