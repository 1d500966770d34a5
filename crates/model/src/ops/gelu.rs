//! GELU, tanh form: 0.5·x·(1 + tanh(u)) with u = √(2/π)·(x + 0.044715·x³), evaluated as
//! x·σ(2u).
//!
//! Through candle's autograd it costs ~8 tensor passes in backward (two `powf`, `tanh`, several
//! multiplies); here forward and derivative are one pass each, split over the cores for large
//! tensors. Values match candle's `gelu()` to rounding. The slice functions are also the
//! activation inside the expert FFN kernel; in f32 they use the vectorizable `exp` of `simd.rs`.

use super::parallel::map_slices_parallel;
use super::simd::{exp_f32, has_avx2_fma};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

const C: f64 = 0.797_884_560_802_865_4; // sqrt(2/π)
const A: f64 = 0.044_715;

// 0.5·(1 + tanh(u)) = sigmoid(2u): one `exp` instead of libm's much slower `tanh`.
#[inline(always)]
pub(super) fn gelu_f64(x: f64) -> f64 {
    x / (1.0 + (-2.0 * C * (x + A * x * x * x)).exp())
}

/// d/dx [x·σ(2u)] = σ + x·2σ(1−σ)·u′, u′ = C(1 + 3A x²).
#[inline(always)]
pub(super) fn gelu_grad_f64(x: f64) -> f64 {
    let s = 1.0 / (1.0 + (-2.0 * C * (x + A * x * x * x)).exp());
    s + x * 2.0 * s * (1.0 - s) * C * (1.0 + 3.0 * A * x * x)
}

#[inline(always)]
fn gelu_fast(x: f32) -> f32 {
    let (c, a) = (C as f32, A as f32);
    x / (1.0 + exp_f32(-2.0 * c * (x + a * x * x * x)))
}

#[inline(always)]
fn gelu_grad_fast(x: f32) -> f32 {
    let (c, a) = (C as f32, A as f32);
    let s = 1.0 / (1.0 + exp_f32(-2.0 * c * (x + a * x * x * x)));
    s + x * 2.0 * s * (1.0 - s) * c * (1.0 + 3.0 * a * x * x)
}

/// The f32 loops, compiled once for the baseline CPU and once with AVX2 and FMA (eight lanes),
/// the second chosen at run time where the CPU has them.
macro_rules! f32_loops {
    ($name:ident, $avx2:ident, $body:expr) => {
        #[inline(always)]
        fn $name(out: &mut [f32], x: &[f32]) {
            let body: fn(&mut f32, f32) = $body;
            out.iter_mut().zip(x).for_each(|(o, &v)| body(o, v));
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        fn $avx2(out: &mut [f32], x: &[f32]) {
            $name(out, x)
        }
    };
}

f32_loops!(gelu_loop, gelu_loop_avx2, |o, v| *o = gelu_fast(v));
f32_loops!(gelu_grad_mul_loop, gelu_grad_mul_loop_avx2, |o, v| *o *= gelu_grad_fast(v));

/// out[i] = gelu(x[i]) (f32, vectorized).
pub(super) fn gelu_slice_f32(out: &mut [f32], x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { gelu_loop_avx2(out, x) };
    }
    gelu_loop(out, x)
}

/// g[i] *= gelu'(x[i]) (f32, vectorized): the backward through the activation, in place.
pub(super) fn gelu_grad_mul_f32(g: &mut [f32], x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { gelu_grad_mul_loop_avx2(g, x) };
    }
    gelu_grad_mul_loop(g, x)
}

/// out[i] = gelu(x[i]) (f64, libm's exp: the reference precision).
pub(super) fn gelu_slice_f64(out: &mut [f64], x: &[f64]) {
    out.iter_mut().zip(x).for_each(|(o, &v)| *o = gelu_f64(v));
}

/// g[i] *= gelu'(x[i]) (f64).
pub(super) fn gelu_grad_mul_f64(g: &mut [f64], x: &[f64]) {
    g.iter_mut().zip(x).for_each(|(o, &v)| *o *= gelu_grad_f64(v));
}

fn apply(
    storage: &CpuStorage,
    layout: &Layout,
    f32_fn: fn(&mut [f32], &[f32]),
    f64_fn: fn(&mut [f64], &[f64]),
) -> candle_core::Result<(CpuStorage, Shape)> {
    let Some((start, end)) = layout.contiguous_offsets() else { candle_core::bail!("gelu: input must be contiguous") };
    let out = match storage {
        CpuStorage::F32(v) => CpuStorage::F32(map_slices_parallel(&v[start..end], f32_fn)),
        CpuStorage::F64(v) => CpuStorage::F64(map_slices_parallel(&v[start..end], f64_fn)),
        _ => candle_core::bail!("gelu: only f32 and f64 are supported"),
    };
    Ok((out, layout.shape().clone()))
}

/// gelu'(x) itself, for the standalone op's backward: 1·gelu'(x).
fn gelu_grad_values_f32(out: &mut [f32], x: &[f32]) {
    out.fill(1.0);
    gelu_grad_mul_f32(out, x)
}

fn gelu_grad_values_f64(out: &mut [f64], x: &[f64]) {
    out.fill(1.0);
    gelu_grad_mul_f64(out, x)
}

struct Gelu;
struct GeluGrad;

custom_op!(Gelu: CustomOp1 "lazarus-gelu", cpu, "gelu");

impl Gelu {
    fn cpu(&self, [(storage, layout)]: [(&CpuStorage, &Layout); 1]) -> candle_core::Result<(CpuStorage, Shape)> {
        apply(storage, layout, gelu_slice_f32, gelu_slice_f64)
    }

    fn grads(&self, [arg]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads1> {
        let d = arg.contiguous()?.apply_op1_no_bwd(&GeluGrad)?;
        Ok(Some(grad.mul(&d)?))
    }
}

impl CustomOp1 for GeluGrad {
    fn name(&self) -> &'static str {
        "lazarus-gelu-grad"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        apply(storage, layout, gelu_grad_values_f32, gelu_grad_values_f64)
    }
}

/// GELU (tanh approximation), differentiable.
pub fn gelu(x: &Tensor) -> candle_core::Result<Tensor> {
    // One kernel forward and one (plus a multiply) backward on the CPU and on CUDA (ours, see
    // ops/cuda); candle's composite elsewhere.
    #[cfg(feature = "cuda")]
    if super::cuda::takes(x) {
        return super::cuda::gelu(x);
    }
    if !super::fused_here(x) {
        return super::composite::gelu(x);
    }
    x.contiguous()?.apply_op1(Gelu)
}

#[cfg(test)]
mod tests {
    use super::super::testing;
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn matches_candle_gelu_and_its_gradient() {
        let data: Vec<f64> = (0..200_000).map(|i| (i as f64 - 100_000.0) / 20_000.0).collect();
        let x = Var::from_vec(data, 200_000, &Device::Cpu).unwrap();
        let ours = gelu(x.as_tensor()).unwrap();
        let theirs = x.as_tensor().gelu().unwrap();
        let diff = (&ours - &theirs).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap();
        assert!(diff < 1e-12, "{diff}");
        let g1 = ours.sum_all().unwrap().backward().unwrap();
        let g2 = theirs.sum_all().unwrap().backward().unwrap();
        let a = g1.get(x.as_tensor()).unwrap();
        let b = g2.get(x.as_tensor()).unwrap();
        let diff = (a - b).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap();
        assert!(diff < 1e-5, "{diff}");
    }

    /// The vectorized f32 GELU and its derivative (exp without libm) against the f64 reference,
    /// over the range that matters and the extremes, on both code paths (AVX2+FMA where the CPU
    /// has it, and the baseline loop).
    #[test]
    fn fast_f32_gelu_is_f32_accurate() {
        let xs: Vec<f32> = (-20_000..=20_000).map(|i| i as f32 * 1e-3).chain([-1e4, -200.0, -90.0, 90.0, 200.0, 1e4, 0.0, -0.0]).collect();
        let check = |ours: &[f32], grads: &[f32]| {
            for ((&x, &y), &g) in xs.iter().zip(ours).zip(grads) {
                let (want, want_g) = (gelu_f64(x as f64), gelu_grad_f64(x as f64));
                assert!((y as f64 - want).abs() <= 2e-6 * want.abs().max(1e-3), "gelu({x}) = {y}, want {want}");
                // gelu' crosses zero near x = −0.75 as a difference of O(1) terms: there f32 rounding
                // is absolute, ~1e-7, whatever the formula.
                assert!((g as f64 - want_g).abs() <= 2e-6 * want_g.abs().max(0.05), "gelu'({x}) = {g}, want {want_g}");
            }
        };
        let mut y = vec![0f32; xs.len()];
        let mut g = vec![1f32; xs.len()];
        gelu_slice_f32(&mut y, &xs);
        gelu_grad_mul_f32(&mut g, &xs);
        check(&y, &g);
        let mut g = vec![1f32; xs.len()];
        gelu_loop(&mut y, &xs);
        gelu_grad_mul_loop(&mut g, &xs);
        check(&y, &g);
        let (mut y, mut g) = (vec![0f32; 1], vec![1f32; 1]);
        gelu_slice_f32(&mut y, &[f32::NAN]);
        gelu_grad_mul_f32(&mut g, &[f32::NAN]);
        assert!(y[0].is_nan() && g[0].is_nan(), "NaN stays NaN (a diverged step is still caught)");
    }

    /// candle's own `gelu()` backward uses 6-digit constants (hence 1e-5 above); the composite
    /// 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) from candle's elementwise ops, differentiated by
    /// candle's autograd, is exact and checks the gradient tightly, on both sides of the
    /// threshold where the pass is split over the cores.
    #[test]
    fn matches_the_composite_tanh_form_with_gradient() {
        for n in [1_000, 100_000] {
            let mut var = testing::vars(31, 2.0);
            let (x, probe) = (var(&[n]), var(&[n]));
            let xt = x.as_tensor();
            let ours = gelu(xt).unwrap();
            let cube = xt.mul(xt).unwrap().mul(xt).unwrap();
            let u = ((xt + (cube * A).unwrap()).unwrap() * C).unwrap();
            let theirs = ((u.tanh().unwrap() + 1.0).unwrap() * 0.5).unwrap().mul(xt).unwrap();
            let diff = testing::max_diff;
            assert!(diff(&ours, &theirs) < 1e-12, "forward differs by {}", diff(&ours, &theirs));
            let g1 = (&ours * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (&theirs * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
            let (g1, g2) = (g1.get(xt).unwrap(), g2.get(xt).unwrap());
            assert!(diff(g1, g2) < 1e-12, "gradient differs by {}", diff(g1, g2));
        }
    }
}
