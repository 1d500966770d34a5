//! SwiGLU's elementwise half (Shazeer 2020, "GLU Variants Improve Transformer"), the activation
//! of Mixtral's experts: for a hidden row h = [gate | up] of 2f values, a = SiLU(gate) ⊙ up, with
//! SiLU(x) = x·σ(x).
//!
//! These are slice functions for the [expert FFN kernel](mod@super::expert_ffn), which runs the
//! GEMMs around them; they split the rows over the cores. The backward, from the gradient ga of a
//! (n×f), writes gh (n×2f): d gate = ga ⊙ up ⊙ SiLU′(gate), d up = ga ⊙ SiLU(gate), with
//! SiLU′(x) = σ(x)·(1 + x·(1 − σ(x))).

use super::host::Unfilled;
use super::parallel::{part_len, run_parallel, ELEMENTWISE_MIN};
use super::simd::{exp_f32, has_avx2_fma};
use std::mem::MaybeUninit;

#[inline(always)]
fn sigmoid_f64(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

#[inline(always)]
fn sigmoid_f32(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

/// Output slots of a row, each written once.
type Slots<'a, T> = &'a mut [MaybeUninit<T>];

/// One row forward: a = SiLU(gate) ⊙ up.
#[inline(always)]
fn row_fwd_f32(a: Slots<f32>, gate: &[f32], up: &[f32]) {
    for ((a, &g), &u) in a.iter_mut().zip(gate).zip(up) {
        a.write(g * sigmoid_f32(g) * u);
    }
}

/// One row backward: (d gate, d up) from ga.
#[inline(always)]
fn row_bwd_f32(g_gate: Slots<f32>, g_up: Slots<f32>, ga: &[f32], gate: &[f32], up: &[f32]) {
    for j in 0..ga.len() {
        let (x, s) = (gate[j], sigmoid_f32(gate[j]));
        g_up[j].write(ga[j] * x * s);
        g_gate[j].write(ga[j] * up[j] * (s * (1.0 + x * (1.0 - s))));
    }
}

/// The row loops compiled with AVX2 and FMA (eight lanes), chosen at run time where the CPU has
/// them, as GELU's are.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn row_fwd_f32_avx2(a: Slots<f32>, gate: &[f32], up: &[f32]) {
    row_fwd_f32(a, gate, up)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn row_bwd_f32_avx2(g_gate: Slots<f32>, g_up: Slots<f32>, ga: &[f32], gate: &[f32], up: &[f32]) {
    row_bwd_f32(g_gate, g_up, ga, gate, up)
}

fn fwd_row_f32(a: Slots<f32>, gate: &[f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { row_fwd_f32_avx2(a, gate, up) };
    }
    row_fwd_f32(a, gate, up)
}

fn bwd_row_f32(g_gate: Slots<f32>, g_up: Slots<f32>, ga: &[f32], gate: &[f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { row_bwd_f32_avx2(g_gate, g_up, ga, gate, up) };
    }
    row_bwd_f32(g_gate, g_up, ga, gate, up)
}

/// f64 rows (libm's exp: the reference precision).
fn fwd_row_f64(a: Slots<f64>, gate: &[f64], up: &[f64]) {
    for ((a, &g), &u) in a.iter_mut().zip(gate).zip(up) {
        a.write(g * sigmoid_f64(g) * u);
    }
}

fn bwd_row_f64(g_gate: Slots<f64>, g_up: Slots<f64>, ga: &[f64], gate: &[f64], up: &[f64]) {
    for j in 0..ga.len() {
        let (x, s) = (gate[j], sigmoid_f64(gate[j]));
        g_up[j].write(ga[j] * x * s);
        g_gate[j].write(ga[j] * up[j] * (s * (1.0 + x * (1.0 - s))));
    }
}

macro_rules! swiglu_impl {
    ($fwd:ident, $bwd:ident, $t:ty, $fwd_row:ident, $bwd_row:ident) => {
        /// a (n×f) from h (n×2f), each row [gate | up].
        pub(super) fn $fwd(h: &[$t], f: usize) -> Vec<$t> {
            let rows = h.len() / (2 * f).max(1);
            let mut a = Unfilled::<$t>::new(rows * f);
            let part = part_len(rows, f, ELEMENTWISE_MIN) / f.max(1);
            let work: Vec<_> = a.slots().chunks_mut((part * f).max(1)).zip(h.chunks((2 * part * f).max(1))).collect();
            run_parallel(work, |(a, h)| {
                for (a, h) in a.chunks_exact_mut(f.max(1)).zip(h.chunks_exact((2 * f).max(1))) {
                    let (gate, up) = h.split_at(f);
                    $fwd_row(a, gate, up);
                }
            });
            // SAFETY: every row of every part was written in full.
            unsafe { a.assume_written() }
        }

        /// gh (n×2f) from ga (n×f) and h (n×2f).
        pub(super) fn $bwd(ga: &[$t], h: &[$t], f: usize) -> Vec<$t> {
            let rows = h.len() / (2 * f).max(1);
            assert_eq!(ga.len(), rows * f, "a gradient for every activation");
            let mut gh = Unfilled::<$t>::new(rows * 2 * f);
            let part = part_len(rows, f, ELEMENTWISE_MIN) / f.max(1);
            let chunk = (2 * part * f).max(1);
            let work: Vec<_> = gh.slots().chunks_mut(chunk).zip(h.chunks(chunk)).zip(ga.chunks((part * f).max(1))).collect();
            run_parallel(work, |((gh, h), ga)| {
                for ((gh, h), ga) in gh.chunks_exact_mut((2 * f).max(1)).zip(h.chunks_exact((2 * f).max(1))).zip(ga.chunks_exact(f.max(1)))
                {
                    let (gate, up) = h.split_at(f);
                    let (g_gate, g_up) = gh.split_at_mut(f);
                    $bwd_row(g_gate, g_up, ga, gate, up);
                }
            });
            // SAFETY: every row of every part was written in full.
            unsafe { gh.assume_written() }
        }
    };
}

swiglu_impl!(swiglu_fwd_f32, swiglu_bwd_f32, f32, fwd_row_f32, bwd_row_f32);
swiglu_impl!(swiglu_fwd_f64, swiglu_bwd_f64, f64, fwd_row_f64, bwd_row_f64);

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
