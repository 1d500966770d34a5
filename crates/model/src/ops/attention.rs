//! Causal multi-head self-attention, softmax(Q·Kᵀ/√dh + causal mask)·V, as one autograd node
//! over the packed projection qkv [B, T, 3d].
//!
//! It reads Q, K and V through strides (no permute/transpose copies) and runs each (batch, head)
//! pair as single-threaded GEMMs, the pairs spread over the cores: candle's composite version
//! spends most of its time on copies, the T×T mask and softmax passes, and thread hand-offs
//! inside many tiny batched matmuls. Backward recomputes the T×T probabilities per pair instead
//! of keeping them.
//!
//! Causality is used, not masked: every product runs over blocks of [`BLOCK`] query rows (or key
//! columns) and reaches only as far as the diagonal, so at T = 128 the score and value products
//! do 10/16 of the full T×T work. The softmax rows run over the live (unmasked) part only, f32 by
//! the vectorized exp of `simd.rs`.

use super::gemm::gemm_strided;
use super::host::{contiguous_slice, host_f64, with_host_f32, Unfilled};
use super::parallel::{for_each_parallel, SharedMut};
use super::simd::{softmax_row_f32, softmax_row_f64};
use candle_core::{CpuStorage, Layout, Shape, Tensor};

/// Query rows (or key columns) per block of the causal products: small enough to skip most of
/// the masked half, large enough to keep the GEMM micro-kernel busy.
const BLOCK: usize = 32;

/// Row blocks of a causal T×T matrix: (first row, rows); block r0 needs columns 0..r0 + rows.
fn causal_blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t).step_by(BLOCK).map(move |r0| (r0, BLOCK.min(t - r0)))
}

/// The autograd node of [`causal_attention`]: input qkv [B, T, 3d], output [B, T, d].
struct CausalAttention {
    heads: usize,
}

macro_rules! attention_impl {
    ($fwd:ident, $bwd:ident, $probs:ident, $softmax_row:ident, $t:ty) => {
        /// Causal softmax of scale·Q·Kᵀ for one (batch, head): p (t×t) gets the probabilities,
        /// zero above the diagonal.
        ///
        /// # Safety
        /// `q` and `k` point at t rows of `dh` elements with row stride `rs`.
        unsafe fn $probs(p: &mut [$t], q: *const $t, k: *const $t, t: usize, dh: usize, rs: isize, scale: $t) {
            for (r0, m) in causal_blocks(t) {
                // SAFETY: rows r0..r0+m of Q, rows 0..r0+m of K, and rows r0..r0+m of p.
                unsafe {
                    gemm_strided(
                        m,
                        r0 + m,
                        dh,
                        (p.as_mut_ptr().add(r0 * t), t as isize),
                        false,
                        (q.wrapping_offset(r0 as isize * rs), rs, 1),
                        (k, 1, rs),
                        (1.0, scale),
                        gemm::Parallelism::None,
                    )
                };
            }
            for (i, row) in p.chunks_mut(t).enumerate() {
                let (live, masked) = row.split_at_mut(i + 1);
                $softmax_row(live);
                masked.iter_mut().for_each(|v| *v = 0.0);
            }
        }

        /// qkv [b, t, 3d] → y [b, t, d].
        fn $fwd(qkv: &[$t], b: usize, t: usize, d: usize, heads: usize) -> Vec<$t> {
            let dh = d / heads;
            let scale = 1.0 / (dh as $t).sqrt();
            // Every (batch, head) block's rows are written by its products (k ≥ 1) when the heads
            // tile d; zero-filled otherwise.
            let mut y = if dh > 0 && dh * heads == d { Unfilled::<$t>::new(b * t * d) } else { Unfilled::zeroed(b * t * d) };
            let out = SharedMut(y.slots().as_mut_ptr().cast::<$t>());
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
                    // Y[r0..] = P[r0.., ..r0+m]·V[..r0+m]: P is zero beyond.
                    for (r0, m) in causal_blocks(t) {
                        gemm_strided(
                            m,
                            dh,
                            r0 + m,
                            (dst.wrapping_add(r0 * d), d as isize),
                            false,
                            (p.as_ptr().add(r0 * t), t as isize, 1),
                            (v, 3 * d as isize, 1),
                            (1.0, 1.0),
                            gemm::Parallelism::None,
                        );
                    }
                }
            });
            // SAFETY: each (batch, head) block written in full by its products, or zeroed above.
            unsafe { y.assume_written() }
        }

        /// Gradient of qkv [b, t, 3d] from the output gradient g [b, t, d].
        fn $bwd(qkv: &[$t], g: &[$t], b: usize, t: usize, d: usize, heads: usize) -> Vec<$t> {
            let dh = d / heads;
            let scale = 1.0 / (dh as $t).sqrt();
            let mut dqkv = if dh > 0 && dh * heads == d { Unfilled::<$t>::new(b * t * 3 * d) } else { Unfilled::zeroed(b * t * 3 * d) };
            let out = SharedMut(dqkv.slots().as_mut_ptr().cast::<$t>());
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
                    for (c0, m) in causal_blocks(t) {
                        // dV[c0..] = P[c0.., c0..c0+m]ᵀ·dY[c0..]: rows above c0 are masked.
                        gemm_strided(
                            m,
                            dh,
                            t - c0,
                            (dv.wrapping_offset(c0 as isize * rs), rs),
                            false,
                            (p.as_ptr().add(c0 * t + c0), 1, t as isize),
                            (gy.wrapping_add(c0 * d), d as isize, 1),
                            (1.0, 1.0),
                            gemm::Parallelism::None,
                        );
                        // dP[c0.., ..c0+m] = dY[c0..]·V[..c0+m]ᵀ (the rest of dP stays zero).
                        gemm_strided(
                            m,
                            c0 + m,
                            dh,
                            (dp.as_mut_ptr().add(c0 * t), t as isize),
                            false,
                            (gy.wrapping_add(c0 * d), d as isize, 1),
                            (v, 1, rs),
                            (1.0, 1.0),
                            gemm::Parallelism::None,
                        );
                    }
                }
                // dS = P ⊙ (dP − Σ_j dP·P) · scale (zero where masked, as P is)
                for (pr, dr) in p.chunks(t).zip(dp.chunks_mut(t)) {
                    let dot: $t = pr.iter().zip(dr.iter()).map(|(a, b)| a * b).sum();
                    dr.iter_mut().zip(pr).for_each(|(x, &pv)| *x = pv * (*x - dot) * scale);
                }
                // SAFETY: as above.
                unsafe {
                    for (r0, m) in causal_blocks(t) {
                        let (dp, rs_t, off) = (dp.as_ptr(), t as isize, r0 as isize * rs);
                        // dQ[r0..] = dS[r0.., ..r0+m]·K[..r0+m]
                        let a = (dp.add(r0 * t), rs_t, 1);
                        gemm_strided(
                            m,
                            dh,
                            r0 + m,
                            (dq.wrapping_offset(off), rs),
                            false,
                            a,
                            (k, rs, 1),
                            (1.0, 1.0),
                            gemm::Parallelism::None,
                        );
                        // dK[r0..] = dS[r0.., r0..r0+m]ᵀ·Q[r0..]
                        let a = (dp.add(r0 * t + r0), 1, rs_t);
                        let b = (q.wrapping_offset(off), rs, 1);
                        gemm_strided(m, dh, t - r0, (dk.wrapping_offset(off), rs), false, a, b, (1.0, 1.0), gemm::Parallelism::None);
                    }
                }
            });
            // SAFETY: dQ, dK and dV of each (batch, head) block are written in full by the products
            // above (every row block, k ≥ 1), or zeroed when the heads do not tile d.
            unsafe { dqkv.assume_written() }
        }
    };
}

attention_impl!(attention_fwd_f32, attention_bwd_f32, attention_probs_f32, softmax_row_f32, f32);
attention_impl!(attention_fwd_f64, attention_bwd_f64, attention_probs_f64, softmax_row_f64, f64);

custom_op!(CausalAttention: CustomOp1 "lazarus-causal-attention", cpu, "causal-attention");

impl CausalAttention {
    fn cpu(&self, [(storage, layout)]: [(&CpuStorage, &Layout); 1]) -> candle_core::Result<(CpuStorage, Shape)> {
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

    fn grads(&self, [arg]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads1> {
        let (b, t, d3) = arg.dims3()?;
        let d = d3 / 3;
        let dqkv = match arg.dtype() {
            candle_core::DType::F32 => {
                let g = with_host_f32([arg, grad], |[x, g]| attention_bwd_f32(x, g, b, t, d, self.heads))?;
                Tensor::from_vec(g, (b, t, d3), arg.device())?
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
    #[cfg(feature = "cuda")]
    if super::cuda::takes(qkv) && super::cuda::attention_supported(qkv.dim(2)?, heads) {
        return super::cuda::causal_attention(qkv, heads);
    }
    if !super::fused_here(qkv) {
        return super::composite::causal_attention(qkv, heads);
    }
    qkv.contiguous()?.apply_op1(CausalAttention { heads })
}

#[cfg(test)]
mod tests {
    use super::super::testing;
    use super::*;

    /// One block (t = 7) and several, the last one partial (t = 70 with blocks of 32).
    #[test]
    fn fused_attention_matches_composite_with_gradient() {
        for t in [7, 70] {
            matches_composite(t);
        }
    }

    fn matches_composite(t: usize) {
        let (b, d, heads) = (2, 12, 3);
        let mut var = testing::vars(21, 1.0);
        let qkv = var(&[b, t, 3 * d]);
        let probe = var(&[b, t, d]);
        let ours = causal_attention(qkv.as_tensor(), heads).unwrap();
        // The composite reference: split heads, scores, additive mask, softmax, weighted sum.
        let theirs = super::super::composite::causal_attention(qkv.as_tensor(), heads).unwrap();
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
