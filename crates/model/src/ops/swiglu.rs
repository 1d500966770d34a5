//! SwiGLU's elementwise half (Shazeer 2020, "GLU Variants Improve Transformer"), the activation
//! of Mixtral's experts: for a hidden row h = [gate | up] of 2f values, a = SiLU(gate) ⊙ up, with
//! SiLU(x) = x·σ(x).
//!
//! These are slice functions for the [expert FFN kernel](mod@super::expert_ffn), which runs the
//! GEMMs around them; they split the rows over the cores. The backward, from the gradient ga of a
//! (n×f), writes gh (n×2f): d gate = ga ⊙ up ⊙ SiLU′(gate), d up = ga ⊙ SiLU(gate), with
//! SiLU′(x) = σ(x)·(1 + x·(1 − σ(x))).

use super::parallel::{part_len, run_parallel, ELEMENTWISE_MIN};
use super::simd::exp_f32;

#[inline(always)]
fn sigmoid_f64(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

#[inline(always)]
fn sigmoid_f32(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

macro_rules! swiglu_impl {
    ($fwd:ident, $bwd:ident, $t:ty, $sigmoid:ident) => {
        /// a (n×f) from h (n×2f), each row [gate | up].
        pub(super) fn $fwd(h: &[$t], f: usize) -> Vec<$t> {
            let rows = h.len() / (2 * f).max(1);
            let mut a = vec![0 as $t; rows * f];
            let part = part_len(rows, f, ELEMENTWISE_MIN) / f.max(1);
            let work: Vec<_> = a.chunks_mut((part * f).max(1)).zip(h.chunks((2 * part * f).max(1))).collect();
            run_parallel(work, |(a, h)| {
                for (a, h) in a.chunks_exact_mut(f.max(1)).zip(h.chunks_exact((2 * f).max(1))) {
                    let (gate, up) = h.split_at(f);
                    for ((a, &g), &u) in a.iter_mut().zip(gate).zip(up) {
                        *a = g * $sigmoid(g) * u;
                    }
                }
            });
            a
        }

        /// gh (n×2f) from ga (n×f) and h (n×2f).
        pub(super) fn $bwd(ga: &[$t], h: &[$t], f: usize) -> Vec<$t> {
            let rows = h.len() / (2 * f).max(1);
            assert_eq!(ga.len(), rows * f, "a gradient for every activation");
            let mut gh = vec![0 as $t; rows * 2 * f];
            let part = part_len(rows, f, ELEMENTWISE_MIN) / f.max(1);
            let chunk = (2 * part * f).max(1);
            let work: Vec<_> = gh.chunks_mut(chunk).zip(h.chunks(chunk)).zip(ga.chunks((part * f).max(1))).collect();
            run_parallel(work, |((gh, h), ga)| {
                for ((gh, h), ga) in gh.chunks_exact_mut((2 * f).max(1)).zip(h.chunks_exact((2 * f).max(1))).zip(ga.chunks_exact(f.max(1)))
                {
                    let (gate, up) = h.split_at(f);
                    let (g_gate, g_up) = gh.split_at_mut(f);
                    for j in 0..f {
                        let (x, s) = (gate[j], $sigmoid(gate[j]));
                        let silu = x * s;
                        g_up[j] = ga[j] * silu;
                        g_gate[j] = ga[j] * up[j] * (s * (1.0 + x * (1.0 - s)));
                    }
                }
            });
            gh
        }
    };
}

swiglu_impl!(swiglu_fwd_f32, swiglu_bwd_f32, f32, sigmoid_f32);
swiglu_impl!(swiglu_fwd_f64, swiglu_bwd_f64, f64, sigmoid_f64);

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor, Var};

    /// The slices against candle's silu and product, values and both halves' gradients, over
    /// enough rows to be split over the cores.
    #[test]
    fn swiglu_slices_match_candles_silu_with_gradients() {
        let (rows, f) = (700, 50);
        let h = super::super::testing::data(rows * 2 * f, 4);
        let ga = super::super::testing::data(rows * f, 5);
        let hv = Var::from_vec(h.clone(), (rows, 2 * f), &Device::Cpu).unwrap();
        let theirs = (hv.as_tensor().narrow(1, 0, f).unwrap().silu().unwrap() * hv.as_tensor().narrow(1, f, f).unwrap()).unwrap();
        let ours = Tensor::from_vec(swiglu_fwd_f64(&h, f), (rows, f), &Device::Cpu).unwrap();
        assert!(super::super::testing::max_diff(&ours, &theirs) < 1e-14);
        let probe = Tensor::from_vec(ga.clone(), (rows, f), &Device::Cpu).unwrap();
        let g = (theirs * probe).unwrap().sum_all().unwrap().backward().unwrap();
        let gh = Tensor::from_vec(swiglu_bwd_f64(&ga, &h, f), (rows, 2 * f), &Device::Cpu).unwrap();
        assert!(super::super::testing::max_diff(&gh, g.get(hv.as_tensor()).unwrap()) < 1e-13);
        let h32: Vec<f32> = h.iter().map(|&v| v as f32).collect();
        let ga32: Vec<f32> = ga.iter().map(|&v| v as f32).collect();
        let close = |a: &[f32], b: &[f64]| a.iter().zip(b).all(|(&x, &y)| (x as f64 - y).abs() <= 1e-5 * (1.0 + y.abs()));
        assert!(close(&swiglu_fwd_f32(&h32, f), &swiglu_fwd_f64(&h, f)));
        assert!(close(&swiglu_bwd_f32(&ga32, &h32, f), &swiglu_bwd_f64(&ga, &h, f)));
    }
}
