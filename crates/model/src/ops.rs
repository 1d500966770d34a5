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

/// Run `f(rows_in, rows_out)` over row blocks of length `width`, on all cores when large.
fn rows_parallel(input: &[f64], width: usize, f: impl Fn(&[f64], &mut [f64]) + Sync) -> Vec<f64> {
    let mut out = vec![0.0; input.len()];
    let rows = input.len() / width.max(1);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if input.len() < 1 << 15 || threads == 1 || rows < 2 {
        f(input, &mut out);
        return out;
    }
    let chunk = rows.div_ceil(threads) * width;
    std::thread::scope(|s| {
        for (o, i) in out.chunks_mut(chunk).zip(input.chunks(chunk)) {
            let f = &f;
            s.spawn(move || f(i, o));
        }
    });
    out
}

fn host(t: &Tensor) -> candle_core::Result<Vec<f64>> {
    t.flatten_all()?.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()
}

fn storage_f64(storage: &CpuStorage, layout: &Layout) -> candle_core::Result<Vec<f64>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("fused op: input must be contiguous")
    };
    Ok(match storage {
        CpuStorage::F32(v) => v[start..end].iter().map(|&x| x as f64).collect(),
        CpuStorage::F64(v) => v[start..end].to_vec(),
        _ => candle_core::bail!("fused op: only f32 and f64 are supported"),
    })
}

fn storage_like(storage: &CpuStorage, data: Vec<f64>) -> CpuStorage {
    match storage {
        CpuStorage::F32(_) => CpuStorage::F32(data.into_iter().map(|x| x as f32).collect()),
        _ => CpuStorage::F64(data),
    }
}

fn tensor_like(like: &Tensor, data: Vec<f64>, shape: &Shape) -> candle_core::Result<Tensor> {
    Tensor::from_vec(data, shape, like.device())?.to_dtype(like.dtype())
}

/// Softmax over the last dimension in one pass per row; backward
/// dx = s ⊙ (g − Σ g·s) in one pass.
struct SoftmaxLast;

impl CustomOp1 for SoftmaxLast {
    fn name(&self) -> &'static str {
        "lazarus-softmax-last"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = storage_f64(storage, layout)?;
        let width = layout.shape().dims().last().copied().unwrap_or(1);
        let out = rows_parallel(&x, width, |input, out| {
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

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let width = res.dims().last().copied().unwrap_or(1);
        let s = host(res)?;
        let g = host(grad)?;
        let mut packed = Vec::with_capacity(2 * s.len());
        for (sr, gr) in s.chunks(width).zip(g.chunks(width)) {
            packed.extend_from_slice(sr);
            packed.extend_from_slice(gr);
        }
        let dx = rows_parallel(&packed, 2 * width, |input, out| {
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
    x.contiguous()?.apply_op1(SoftmaxLast)
}

/// LayerNorm over the last dimension with weight and bias, fused: one pass forward, one pass
/// backward for x, w and b together.
struct LayerNorm {
    eps: f64,
}

impl candle_core::CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "lazarus-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = storage_f64(s1, l1)?;
        let w = storage_f64(s2, l2)?;
        let b = storage_f64(s3, l3)?;
        let width = w.len();
        let eps = self.eps;
        let out = rows_parallel(&x, width, |input, out| {
            for (row, o) in input.chunks(width).zip(out.chunks_mut(width)) {
                let mean = row.iter().sum::<f64>() / width as f64;
                let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / width as f64;
                let rstd = 1.0 / (var + eps).sqrt();
                for j in 0..width {
                    o[j] = (row[j] - mean) * rstd * w[j] + b[j];
                }
            }
        });
        Ok((storage_like(s1, out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let width = w.elem_count();
        let xs = host(x)?;
        let ws = host(w)?;
        let gs = host(grad)?;
        let mut dx = vec![0.0; xs.len()];
        let mut dw = vec![0.0; width];
        let mut db = vec![0.0; width];
        let mut xhat = vec![0.0; width];
        let mut dxhat = vec![0.0; width];
        for ((row, g), d) in xs.chunks(width).zip(gs.chunks(width)).zip(dx.chunks_mut(width)) {
            let mean = row.iter().sum::<f64>() / width as f64;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / width as f64;
            let rstd = 1.0 / (var + self.eps).sqrt();
            let (mut m1, mut m2) = (0.0, 0.0);
            for j in 0..width {
                xhat[j] = (row[j] - mean) * rstd;
                dxhat[j] = g[j] * ws[j];
                dw[j] += g[j] * xhat[j];
                db[j] += g[j];
                m1 += dxhat[j];
                m2 += dxhat[j] * xhat[j];
            }
            m1 /= width as f64;
            m2 /= width as f64;
            for j in 0..width {
                d[j] = rstd * (dxhat[j] - m1 - xhat[j] * m2);
            }
        }
        Ok((
            Some(tensor_like(x, dx, x.shape())?),
            Some(tensor_like(w, dw, w.shape())?),
            Some(tensor_like(w, db, w.shape())?),
        ))
    }
}

/// LayerNorm(x)·w + b over the last dimension, differentiable in x, w and b.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op3(w, b, LayerNorm { eps })
}

#[cfg(test)]
mod fused_tests {
    use super::*;
    use candle_core::{Device, Var, D};

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
    }

    fn data(n: usize, seed: u64) -> Vec<f64> {
        let mut r = crate::rng::SplitMix64::new(seed);
        (0..n).map(|_| r.normal()).collect()
    }

    #[test]
    fn softmax_matches_composite_with_gradient() {
        let x = Var::from_vec(data(6 * 70, 1), (6, 70), &Device::Cpu).unwrap();
        let probe = Tensor::from_vec(data(6 * 70, 2), (6, 70), &Device::Cpu).unwrap();
        let ours = softmax_last(x.as_tensor()).unwrap();
        let e = x.as_tensor().exp().unwrap();
        let theirs = e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap();
        assert!(max_diff(&ours, &theirs) < 1e-12);
        let g1 = (&ours * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (&theirs * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(max_diff(g1.get(x.as_tensor()).unwrap(), g2.get(x.as_tensor()).unwrap()) < 1e-12);
    }

    #[test]
    fn layer_norm_matches_composite_with_gradients() {
        let x = Var::from_vec(data(5 * 40, 3), (5, 40), &Device::Cpu).unwrap();
        let w = Var::from_vec(data(40, 4), 40, &Device::Cpu).unwrap();
        let b = Var::from_vec(data(40, 5), 40, &Device::Cpu).unwrap();
        let probe = Tensor::from_vec(data(5 * 40, 6), (5, 40), &Device::Cpu).unwrap();
        let ours = layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
        let xt = x.as_tensor();
        let mean = xt.mean_keepdim(D::Minus1).unwrap();
        let xc = xt.broadcast_sub(&mean).unwrap();
        let var = xc.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        let theirs = xc
            .broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
            .unwrap()
            .broadcast_mul(w.as_tensor())
            .unwrap()
            .broadcast_add(b.as_tensor())
            .unwrap();
        assert!(max_diff(&ours, &theirs) < 1e-12);
        let g1 = (&ours * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (&theirs * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&x, &w, &b] {
            assert!(max_diff(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap()) < 1e-10);
        }
    }
}

/// One expert's FFN, y = GELU(x·W1 + b1)·W2 + b2, as a single autograd node: forward and
/// backward are row-major GEMMs on the raw buffers plus one fused elementwise pass, instead of a
/// dozen candle nodes that each allocate, zero-fill and accumulate activation-sized gradients.
/// Weights come packed with their bias as the last row: W1b = [W1; b1] (d+1 × f),
/// W2b = [W2; b2] (f+1 × d). The hidden activations are recomputed in backward (one extra GEMM)
/// rather than kept.
struct ExpertFfn;

/// dst (m×n, row-major) = [dst +] A·B, with A (m×k) and B (k×n) given as (pointer, row stride,
/// column stride) so transposed views cost nothing.
///
/// # Safety
/// The pointers must cover the described matrices, and `dst` must not alias `a` or `b`.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_rm<T: 'static + Copy>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    accumulate: bool,
    a: (*const T, isize, isize),
    b: (*const T, isize, isize),
    one: T,
) {
    gemm::gemm(
        m, n, k, dst, 1, n as isize, accumulate, a.0, a.2, a.1, b.0, b.2, b.1, one, one, false, false, false,
        gemm::Parallelism::Rayon(0),
    );
}

/// `acc[j] += Σ_rows m[row][j]` for a row-major matrix with `acc.len()` columns (a bias gradient).
fn add_row_sums<T: Copy + std::ops::AddAssign>(acc: &mut [T], m: &[T]) {
    for row in m.chunks(acc.len()) {
        acc.iter_mut().zip(row).for_each(|(a, &v)| *a += v);
    }
}

macro_rules! expert_ffn_impl {
    ($fwd:ident, $bwd:ident, $t:ty, $gelu:ident, $gelu_grad:ident) => {
        /// Returns (h pre-activation, a = gelu(h), y).
        fn $fwd(x: &[$t], w1b: &[$t], w2b: &[$t], n: usize, d: usize, f: usize) -> (Vec<$t>, Vec<$t>, Vec<$t>) {
            let mut h: Vec<$t> = Vec::with_capacity(n * f);
            for _ in 0..n {
                h.extend_from_slice(&w1b[d * f..(d + 1) * f]);
            }
            // SAFETY: x is n×d, w1b holds d×f then the bias row, h is n×f; no aliasing.
            unsafe { gemm_rm(n, f, d, h.as_mut_ptr(), true, (x.as_ptr(), d as isize, 1), (w1b.as_ptr(), f as isize, 1), 1.0) };
            let a: Vec<$t> = h.iter().map(|&v| $gelu(v)).collect();
            let mut y: Vec<$t> = Vec::with_capacity(n * d);
            for _ in 0..n {
                y.extend_from_slice(&w2b[f * d..(f + 1) * d]);
            }
            // SAFETY: a is n×f, w2b holds f×d then the bias row, y is n×d.
            unsafe { gemm_rm(n, d, f, y.as_mut_ptr(), true, (a.as_ptr(), f as isize, 1), (w2b.as_ptr(), d as isize, 1), 1.0) };
            (h, a, y)
        }

        /// Gradients (x, W1b, W2b) from the output gradient g (n×d).
        fn $bwd(x: &[$t], w1b: &[$t], w2b: &[$t], g: &[$t], n: usize, d: usize, f: usize) -> (Vec<$t>, Vec<$t>, Vec<$t>) {
            let (h, a, _) = $fwd(x, w1b, w2b, n, d, f);
            // dW2b = [aᵀ·g ; Σ_rows g]
            let mut gw2b: Vec<$t> = vec![0.0; (f + 1) * d];
            // SAFETY: aᵀ is f×n (row stride 1, column stride f), g is n×d, dst is the first f×d.
            unsafe { gemm_rm(f, d, n, gw2b.as_mut_ptr(), false, (a.as_ptr(), 1, f as isize), (g.as_ptr(), d as isize, 1), 1.0) };
            add_row_sums(&mut gw2b[f * d..], g);
            // gh = (g·W2ᵀ) ⊙ gelu'(h)
            let mut gh: Vec<$t> = vec![0.0; n * f];
            // SAFETY: g is n×d, W2ᵀ is d×f (row stride 1, column stride d) over w2b's first f rows.
            unsafe { gemm_rm(n, f, d, gh.as_mut_ptr(), false, (g.as_ptr(), d as isize, 1), (w2b.as_ptr(), 1, d as isize), 1.0) };
            gh.iter_mut().zip(&h).for_each(|(v, &hv)| *v *= $gelu_grad(hv));
            // dW1b = [xᵀ·gh ; Σ_rows gh]
            let mut gw1b: Vec<$t> = vec![0.0; (d + 1) * f];
            // SAFETY: xᵀ is d×n, gh is n×f, dst is the first d×f.
            unsafe { gemm_rm(d, f, n, gw1b.as_mut_ptr(), false, (x.as_ptr(), 1, d as isize), (gh.as_ptr(), f as isize, 1), 1.0) };
            add_row_sums(&mut gw1b[d * f..], &gh);
            // dx = gh·W1ᵀ
            let mut gx: Vec<$t> = vec![0.0; n * d];
            // SAFETY: gh is n×f, W1ᵀ is f×d over w1b's first d rows.
            unsafe { gemm_rm(n, d, f, gx.as_mut_ptr(), false, (gh.as_ptr(), f as isize, 1), (w1b.as_ptr(), 1, f as isize), 1.0) };
            (gx, gw1b, gw2b)
        }
    };
}

expert_ffn_impl!(ffn_fwd_f32, ffn_bwd_f32, f32, gelu_f32, gelu_grad_f32);
expert_ffn_impl!(ffn_fwd_f64, ffn_bwd_f64, f64, gelu_f64, gelu_grad_f64);

fn contiguous_slice<'a, T>(v: &'a [T], l: &Layout) -> candle_core::Result<&'a [T]> {
    let Some((start, end)) = l.contiguous_offsets() else {
        candle_core::bail!("expert ffn: inputs must be contiguous")
    };
    Ok(&v[start..end])
}

impl candle_core::CustomOp3 for ExpertFfn {
    fn name(&self) -> &'static str {
        "lazarus-expert-ffn"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, d) = l1.shape().dims2()?;
        let (d1, f) = l2.shape().dims2()?;
        if d1 != d + 1 || l3.shape().dims2()? != (f + 1, d) {
            candle_core::bail!("expert ffn: shapes {:?} {:?} {:?} do not match", l1.shape(), l2.shape(), l3.shape());
        }
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(w1), CpuStorage::F32(w2)) => CpuStorage::F32(
                ffn_fwd_f32(contiguous_slice(x, l1)?, contiguous_slice(w1, l2)?, contiguous_slice(w2, l3)?, n, d, f).2,
            ),
            (CpuStorage::F64(x), CpuStorage::F64(w1), CpuStorage::F64(w2)) => CpuStorage::F64(
                ffn_fwd_f64(contiguous_slice(x, l1)?, contiguous_slice(w1, l2)?, contiguous_slice(w2, l3)?, n, d, f).2,
            ),
            _ => candle_core::bail!("expert ffn: f32 or f64 inputs of one dtype"),
        };
        Ok((out, Shape::from((n, d))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w1b: &Tensor,
        w2b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, d) = x.dims2()?;
        let f = w1b.dim(1)?;
        let dev = x.device();
        let (gx, g1, g2) = match x.dtype() {
            candle_core::DType::F32 => {
                let v = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
                let (gx, g1, g2) = ffn_bwd_f32(&v(x)?, &v(w1b)?, &v(w2b)?, &v(grad)?, n, d, f);
                (Tensor::from_vec(gx, (n, d), dev)?, Tensor::from_vec(g1, (d + 1, f), dev)?, Tensor::from_vec(g2, (f + 1, d), dev)?)
            }
            _ => {
                let v = |t: &Tensor| t.flatten_all().and_then(|t| t.to_dtype(candle_core::DType::F64)).and_then(|t| t.to_vec1::<f64>());
                let (gx, g1, g2) = ffn_bwd_f64(&v(x)?, &v(w1b)?, &v(w2b)?, &v(grad)?, n, d, f);
                (Tensor::from_vec(gx, (n, d), dev)?, Tensor::from_vec(g1, (d + 1, f), dev)?, Tensor::from_vec(g2, (f + 1, d), dev)?)
            }
        };
        Ok((Some(gx), Some(g1), Some(g2)))
    }
}

/// GELU(x·W1 + b1)·W2 + b2 for x [n, d], W1 [d, f], b1 [f], W2 [f, d], b2 [d]; differentiable in
/// all five.
pub fn expert_ffn(x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor) -> candle_core::Result<Tensor> {
    let w1b = Tensor::cat(&[w1, &b1.unsqueeze(0)?], 0)?;
    let w2b = Tensor::cat(&[w2, &b2.unsqueeze(0)?], 0)?;
    x.contiguous()?.apply_op3(&w1b, &w2b, ExpertFfn)
}

#[cfg(test)]
mod ffn_tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn fused_expert_ffn_matches_composite_with_gradients() {
        let mut r = crate::rng::SplitMix64::new(9);
        let mut var = |shape: &[usize]| {
            let n: usize = shape.iter().product();
            Var::from_vec((0..n).map(|_| r.normal() * 0.5).collect::<Vec<f64>>(), shape, &Device::Cpu).unwrap()
        };
        let (x, w1, b1, w2, b2) = (var(&[7, 5]), var(&[5, 6]), var(&[6]), var(&[6, 5]), var(&[5]));
        let probe = var(&[7, 5]);
        let ours = expert_ffn(x.as_tensor(), w1.as_tensor(), b1.as_tensor(), w2.as_tensor(), b2.as_tensor()).unwrap();
        let h = x.as_tensor().matmul(w1.as_tensor()).unwrap().broadcast_add(b1.as_tensor()).unwrap();
        let theirs = gelu(&h).unwrap().matmul(w2.as_tensor()).unwrap().broadcast_add(b2.as_tensor()).unwrap();
        let diff = |a: &Tensor, b: &Tensor| (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap();
        assert!(diff(&ours, &theirs) < 1e-12);
        let g1 = (&ours * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (&theirs * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&x, &w1, &b1, &w2, &b2] {
            assert!(diff(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap()) < 1e-10);
        }
    }
}
