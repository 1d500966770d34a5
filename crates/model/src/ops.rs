//! Fused elementwise kernels where candle's composite versions are slow on CPU.
//!
//! GELU (tanh form, evaluated as x·σ(2u)) through candle's autograd costs ~8 tensor passes in backward (two `powf`,
//! `tanh`, several multiplies); here forward and derivative are one pass each, split over the
//! cores for large tensors. Values match candle's `gelu()` to rounding.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

const C: f64 = 0.797_884_560_802_865_4; // sqrt(2/π)
const A: f64 = 0.044_715;

// 0.5·(1 + tanh(u)) = sigmoid(2u): one `exp` instead of libm's much slower `tanh`.
#[inline(always)]
fn gelu_f64(x: f64) -> f64 {
    x / (1.0 + (-2.0 * C * (x + A * x * x * x)).exp())
}

/// d/dx [x·σ(2u)] = σ + x·2σ(1−σ)·u′, u′ = C(1 + 3A x²).
#[inline(always)]
fn gelu_grad_f64(x: f64) -> f64 {
    let s = 1.0 / (1.0 + (-2.0 * C * (x + A * x * x * x)).exp());
    s + x * 2.0 * s * (1.0 - s) * C * (1.0 + 3.0 * A * x * x)
}

#[inline(always)]
fn gelu_f32(x: f32) -> f32 {
    let (c, a) = (C as f32, A as f32);
    x / (1.0 + (-2.0 * c * (x + a * x * x * x)).exp())
}

#[inline(always)]
fn gelu_grad_f32(x: f32) -> f32 {
    let (c, a) = (C as f32, A as f32);
    let s = 1.0 / (1.0 + (-2.0 * c * (x + a * x * x * x)).exp());
    s + x * 2.0 * s * (1.0 - s) * c * (1.0 + 3.0 * a * x * x)
}

/// Apply `f` to every element, on all cores when the tensor is large.
fn map_parallel<T: Copy + Send + Sync + Default>(input: &[T], f: impl Fn(T) -> T + Sync) -> Vec<T> {
    let mut out = vec![T::default(); input.len()];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if input.len() < 1 << 16 || threads == 1 {
        out.iter_mut().zip(input).for_each(|(o, &x)| *o = f(x));
        return out;
    }
    let chunk = input.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (o, i) in out.chunks_mut(chunk).zip(input.chunks(chunk)) {
            let f = &f;
            s.spawn(move || o.iter_mut().zip(i).for_each(|(o, &x)| *o = f(x)));
        }
    });
    out
}

fn apply(storage: &CpuStorage, layout: &Layout, f32_fn: fn(f32) -> f32, f64_fn: fn(f64) -> f64) -> candle_core::Result<(CpuStorage, Shape)> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("gelu: input must be contiguous")
    };
    let out = match storage {
        CpuStorage::F32(v) => CpuStorage::F32(map_parallel(&v[start..end], f32_fn)),
        CpuStorage::F64(v) => CpuStorage::F64(map_parallel(&v[start..end], f64_fn)),
        _ => candle_core::bail!("gelu: only f32 and f64 are supported"),
    };
    Ok((out, layout.shape().clone()))
}

struct Gelu;
struct GeluGrad;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "lazarus-gelu"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        apply(storage, layout, gelu_f32, gelu_f64)
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let d = arg.contiguous()?.apply_op1_no_bwd(&GeluGrad)?;
        Ok(Some(grad.mul(&d)?))
    }
}

impl CustomOp1 for GeluGrad {
    fn name(&self) -> &'static str {
        "lazarus-gelu-grad"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        apply(storage, layout, gelu_grad_f32, gelu_grad_f64)
    }
}

/// GELU (tanh approximation), differentiable.
pub fn gelu(x: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1(Gelu)
}

#[cfg(test)]
mod tests {
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
}
