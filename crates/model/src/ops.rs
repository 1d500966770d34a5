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

fn apply(
    storage: &CpuStorage,
    layout: &Layout,
    f32_fn: fn(f32) -> f32,
    f64_fn: fn(f64) -> f64,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let Some((start, end)) = layout.contiguous_offsets() else { candle_core::bail!("gelu: input must be contiguous") };
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

/// A tensor's elements, flattened, as f32 (for fused kernels' backward on f32 tensors).
fn host_f32(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

/// A tensor's elements, flattened, as f64 (any float dtype).
fn host_f64(t: &Tensor) -> candle_core::Result<Vec<f64>> {
    t.flatten_all()?.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()
}

fn storage_f64(storage: &CpuStorage, layout: &Layout) -> candle_core::Result<Vec<f64>> {
    let Some((start, end)) = layout.contiguous_offsets() else { candle_core::bail!("fused op: input must be contiguous") };
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
        let s = host_f64(res)?;
        let g = host_f64(grad)?;
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
/// backward for x, w and b together, in the tensor's own dtype (statistics accumulated in f64),
/// rows split over the cores.
struct LayerNorm {
    eps: f64,
}

/// Split `rows` rows of `width` into one contiguous part per core (one part when small).
fn row_parts(rows: usize, width: usize) -> usize {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if rows * width < 1 << 15 || threads == 1 {
        rows.max(1)
    } else {
        rows.div_ceil(threads).max(1)
    }
}

macro_rules! layer_norm_impl {
    ($fwd:ident, $bwd:ident, $t:ty) => {
        fn $fwd(x: &[$t], w: &[$t], b: &[$t], eps: f64) -> Vec<$t> {
            let width = w.len();
            let mut y: Vec<$t> = vec![0.0; x.len()];
            let part = row_parts(x.len() / width, width) * width;
            std::thread::scope(|s| {
                for (xs, ys) in x.chunks(part).zip(y.chunks_mut(part)) {
                    s.spawn(move || {
                        for (row, o) in xs.chunks(width).zip(ys.chunks_mut(width)) {
                            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
                            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / width as f64;
                            let rstd = 1.0 / (var + eps).sqrt();
                            let (mean, rstd) = (mean as $t, rstd as $t);
                            for j in 0..width {
                                o[j] = (row[j] - mean) * rstd * w[j] + b[j];
                            }
                        }
                    });
                }
            });
            y
        }

        /// (dx, dw, db) from g.
        fn $bwd(x: &[$t], w: &[$t], g: &[$t], eps: f64) -> (Vec<$t>, Vec<$t>, Vec<$t>) {
            let width = w.len();
            let mut dx: Vec<$t> = vec![0.0; x.len()];
            let part = row_parts(x.len() / width, width) * width;
            let partials: Vec<(Vec<f64>, Vec<f64>)> = std::thread::scope(|s| {
                let handles: Vec<_> = x
                    .chunks(part)
                    .zip(g.chunks(part))
                    .zip(dx.chunks_mut(part))
                    .map(|((xs, gs), dxs)| {
                        s.spawn(move || {
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
                                    d[j] = (rstd * (dxhat[j] - m1 - xhat[j] * m2)) as $t;
                                }
                            }
                            (dw, db)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
            });
            let mut dw = vec![0.0f64; width];
            let mut db = vec![0.0f64; width];
            for (pw, pb) in partials {
                dw.iter_mut().zip(&pw).for_each(|(a, b)| *a += b);
                db.iter_mut().zip(&pb).for_each(|(a, b)| *a += b);
            }
            (dx, dw.into_iter().map(|v| v as $t).collect(), db.into_iter().map(|v| v as $t).collect())
        }
    };
}

layer_norm_impl!(layer_norm_fwd_f32, layer_norm_bwd_f32, f32);
layer_norm_impl!(layer_norm_fwd_f64, layer_norm_bwd_f64, f64);

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

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dev = x.device();
        let (dx, dw, db) = match x.dtype() {
            candle_core::DType::F32 => {
                let v = host_f32;
                let (dx, dw, db) = layer_norm_bwd_f32(&v(x)?, &v(w)?, &v(grad)?, self.eps);
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
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, LayerNorm { eps })
}

/// Shared helpers of this file's tests.
#[cfg(test)]
mod testing {
    use candle_core::{Device, Tensor, Var};

    /// Seeded f64 variables of any shape with entries ~ N(0, scale²).
    pub fn vars(seed: u64, scale: f64) -> impl FnMut(&[usize]) -> Var {
        let mut r = crate::rng::SplitMix64::new(seed);
        move |shape: &[usize]| {
            let n: usize = shape.iter().product();
            Var::from_vec((0..n).map(|_| r.normal() * scale).collect::<Vec<f64>>(), shape, &Device::Cpu).unwrap()
        }
    }

    /// Largest absolute elementwise difference.
    pub fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
    }
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

// One expert's FFN, y = GELU(x·W1 + b1)·W2 + b2, as GEMMs on the raw buffers plus one fused
// elementwise pass, instead of a dozen candle nodes that each allocate, zero-fill and accumulate
// activation-sized gradients. Weights come packed with their bias as the last row:
// W1b = [W1; b1] (d+1 × f), W2b = [W2; b2] (f+1 × d). The forward keeps its pre-activation and
// activation (n×f each) for the backward, which recomputes them only if they are gone. The
// autograd node is `GroupedExpertFfn` (one expert is a group of one).

/// Hidden pre-activation h and activation gelu(h) of one forward.
enum Saved {
    F32(Vec<f32>, Vec<f32>),
    F64(Vec<f64>, Vec<f64>),
}

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
    // SAFETY: forwarded from the caller.
    unsafe { gemm_strided(m, n, k, (dst, n as isize), accumulate, a, b, (one, one), gemm::Parallelism::Rayon(0)) }
}

/// dst (m×n, row stride given, column stride 1) = alpha·dst + beta·A·B when accumulating, else
/// beta·A·B; A and B given as in [`gemm_rm`].
///
/// # Safety
/// As for [`gemm_rm`].
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_strided<T: 'static + Copy>(
    m: usize,
    n: usize,
    k: usize,
    dst: (*mut T, isize),
    accumulate: bool,
    a: (*const T, isize, isize),
    b: (*const T, isize, isize),
    (alpha, beta): (T, T),
    parallelism: gemm::Parallelism,
) {
    unsafe {
        gemm::gemm(m, n, k, dst.0, 1, dst.1, accumulate, a.0, a.2, a.1, b.0, b.2, b.1, alpha, beta, false, false, false, parallelism)
    };
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
            let a: Vec<$t> = map_parallel(&h, $gelu);
            let mut y: Vec<$t> = Vec::with_capacity(n * d);
            for _ in 0..n {
                y.extend_from_slice(&w2b[f * d..(f + 1) * d]);
            }
            // SAFETY: a is n×f, w2b holds f×d then the bias row, y is n×d.
            unsafe { gemm_rm(n, d, f, y.as_mut_ptr(), true, (a.as_ptr(), f as isize, 1), (w2b.as_ptr(), d as isize, 1), 1.0) };
            (h, a, y)
        }

        /// Gradients (x, W1b, W2b) from the output gradient g (n×d).
        /// `saved` is (h, a) from the forward when still at hand.
        #[allow(clippy::too_many_arguments)]
        fn $bwd(
            x: &[$t],
            w1b: &[$t],
            w2b: &[$t],
            g: &[$t],
            n: usize,
            d: usize,
            f: usize,
            saved: Option<(Vec<$t>, Vec<$t>)>,
        ) -> (Vec<$t>, Vec<$t>, Vec<$t>) {
            let (h, a) = match saved {
                Some((h, a)) if h.len() == n * f && a.len() == n * f => (h, a),
                _ => {
                    let (h, a, _) = $fwd(x, w1b, w2b, n, d, f);
                    (h, a)
                }
            };
            // dW2b = [aᵀ·g ; Σ_rows g]
            let mut gw2b: Vec<$t> = vec![0.0; (f + 1) * d];
            // SAFETY: aᵀ is f×n (row stride 1, column stride f), g is n×d, dst is the first f×d.
            unsafe { gemm_rm(f, d, n, gw2b.as_mut_ptr(), false, (a.as_ptr(), 1, f as isize), (g.as_ptr(), d as isize, 1), 1.0) };
            add_row_sums(&mut gw2b[f * d..], g);
            // gh = (g·W2ᵀ) ⊙ gelu'(h)
            let mut gh: Vec<$t> = vec![0.0; n * f];
            // SAFETY: g is n×d, W2ᵀ is d×f (row stride 1, column stride d) over w2b's first f rows.
            unsafe { gemm_rm(n, f, d, gh.as_mut_ptr(), false, (g.as_ptr(), d as isize, 1), (w2b.as_ptr(), 1, d as isize), 1.0) };
            let dgelu = map_parallel(&h, $gelu_grad);
            gh.iter_mut().zip(&dgelu).for_each(|(v, &dv)| *v *= dv);
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
    let Some((start, end)) = l.contiguous_offsets() else { candle_core::bail!("expert ffn: inputs must be contiguous") };
    Ok(&v[start..end])
}

/// GELU(x·W1 + b1)·W2 + b2 for x [n, d], W1 [d, f], b1 [f], W2 [f, d], b2 [d]; differentiable in
/// all five.
pub fn expert_ffn(x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor) -> candle_core::Result<Tensor> {
    grouped_expert_ffn(x, &[[w1, b1, w2, b2]], &[x.dim(0)?])
}

#[cfg(test)]
mod ffn_tests {
    use super::*;

    #[test]
    fn fused_expert_ffn_matches_composite_with_gradients() {
        let mut var = testing::vars(9, 0.5);
        let (x, w1, b1, w2, b2) = (var(&[7, 5]), var(&[5, 6]), var(&[6]), var(&[6, 5]), var(&[5]));
        let probe = var(&[7, 5]);
        let ours = expert_ffn(x.as_tensor(), w1.as_tensor(), b1.as_tensor(), w2.as_tensor(), b2.as_tensor()).unwrap();
        let h = x.as_tensor().matmul(w1.as_tensor()).unwrap().broadcast_add(b1.as_tensor()).unwrap();
        let theirs = gelu(&h).unwrap().matmul(w2.as_tensor()).unwrap().broadcast_add(b2.as_tensor()).unwrap();
        let diff = testing::max_diff;
        assert!(diff(&ours, &theirs) < 1e-12);
        let g1 = (&ours * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (&theirs * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&x, &w1, &b1, &w2, &b2] {
            assert!(diff(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap()) < 1e-10);
        }
    }
}

/// Causal multi-head self-attention, softmax(Q·Kᵀ/√dh + causal mask)·V, as one autograd node.
/// It reads Q, K and V straight out of the packed projection [B, T, 3d] through strides (no
/// permute/transpose copies) and runs each (batch, head) pair as single-threaded GEMMs, the pairs
/// spread over the cores: candle's composite version spends most of its time on copies, the
/// T×T mask and softmax passes, and thread hand-offs inside many tiny batched matmuls. Backward
/// recomputes the T×T probabilities per pair instead of keeping them.
struct CausalAttention {
    heads: usize,
}

/// A raw pointer that may cross into the scoped worker threads: each (batch, head) pair writes
/// a disjoint set of elements.
#[derive(Clone, Copy)]
struct SharedMut<T>(*mut T);
// SAFETY: only used for disjoint writes, see the call sites.
unsafe impl<T> Send for SharedMut<T> {}
unsafe impl<T> Sync for SharedMut<T> {}

/// Run `job(i)` for i in 0..count over the available cores, `i` interleaved across threads.
fn for_each_parallel(count: usize, job: impl Fn(usize) + Sync) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(count.max(1));
    if threads <= 1 {
        (0..count).for_each(job);
        return;
    }
    std::thread::scope(|s| {
        for start in 0..threads {
            let job = &job;
            s.spawn(move || (start..count).step_by(threads).for_each(job));
        }
    });
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
mod attention_tests {
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

/// x·W + b as one autograd node: the bias is written as the GEMM's initial value, and backward
/// is two GEMMs plus one row sum, instead of candle's matmul and broadcast-add nodes whose
/// backward reduces the [N, dout] gradient over a strided axis and zero-fills extra buffers.
struct LinearOp;

macro_rules! linear_impl {
    ($fwd:ident, $bwd:ident, $t:ty) => {
        fn $fwd(x: &[$t], w: &[$t], b: &[$t], n: usize, din: usize, dout: usize) -> Vec<$t> {
            let mut y: Vec<$t> = Vec::with_capacity(n * dout);
            for _ in 0..n {
                y.extend_from_slice(b);
            }
            // SAFETY: x is n×din, w is din×dout, y is n×dout; no aliasing.
            unsafe { gemm_rm(n, dout, din, y.as_mut_ptr(), true, (x.as_ptr(), din as isize, 1), (w.as_ptr(), dout as isize, 1), 1.0) };
            y
        }

        /// (dx, dW, db) from g (n×dout).
        fn $bwd(x: &[$t], w: &[$t], g: &[$t], n: usize, din: usize, dout: usize) -> (Vec<$t>, Vec<$t>, Vec<$t>) {
            let mut gx: Vec<$t> = vec![0.0; n * din];
            // SAFETY: g is n×dout, Wᵀ is dout×din (row stride 1, column stride dout).
            unsafe { gemm_rm(n, din, dout, gx.as_mut_ptr(), false, (g.as_ptr(), dout as isize, 1), (w.as_ptr(), 1, dout as isize), 1.0) };
            let mut gw: Vec<$t> = vec![0.0; din * dout];
            // SAFETY: xᵀ is din×n (row stride 1, column stride din), g is n×dout.
            unsafe { gemm_rm(din, dout, n, gw.as_mut_ptr(), false, (x.as_ptr(), 1, din as isize), (g.as_ptr(), dout as isize, 1), 1.0) };
            let mut gb: Vec<$t> = vec![0.0; dout];
            add_row_sums(&mut gb, g);
            (gx, gw, gb)
        }
    };
}

linear_impl!(linear_fwd_f32, linear_bwd_f32, f32);
linear_impl!(linear_fwd_f64, linear_bwd_f64, f64);

impl candle_core::CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "lazarus-linear"
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
        let (n, din) = l1.shape().dims2()?;
        let (din2, dout) = l2.shape().dims2()?;
        if din2 != din || l3.shape().dims1()? != dout {
            candle_core::bail!("linear: shapes {:?} {:?} {:?} do not match", l1.shape(), l2.shape(), l3.shape());
        }
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(b)) => {
                CpuStorage::F32(linear_fwd_f32(contiguous_slice(x, l1)?, contiguous_slice(w, l2)?, contiguous_slice(b, l3)?, n, din, dout))
            }
            (CpuStorage::F64(x), CpuStorage::F64(w), CpuStorage::F64(b)) => {
                CpuStorage::F64(linear_fwd_f64(contiguous_slice(x, l1)?, contiguous_slice(w, l2)?, contiguous_slice(b, l3)?, n, din, dout))
            }
            _ => candle_core::bail!("linear: f32 or f64 inputs of one dtype"),
        };
        Ok((out, Shape::from((n, dout))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, din) = x.dims2()?;
        let dout = w.dim(1)?;
        let dev = x.device();
        let (gx, gw, gb) = match x.dtype() {
            candle_core::DType::F32 => {
                let v = host_f32;
                let (gx, gw, gb) = linear_bwd_f32(&v(x)?, &v(w)?, &v(grad)?, n, din, dout);
                (Tensor::from_vec(gx, (n, din), dev)?, Tensor::from_vec(gw, (din, dout), dev)?, Tensor::from_vec(gb, dout, dev)?)
            }
            _ => {
                let v = host_f64;
                let (gx, gw, gb) = linear_bwd_f64(&v(x)?, &v(w)?, &v(grad)?, n, din, dout);
                (Tensor::from_vec(gx, (n, din), dev)?, Tensor::from_vec(gw, (din, dout), dev)?, Tensor::from_vec(gb, dout, dev)?)
            }
        };
        Ok((Some(gx), Some(gw), Some(gb)))
    }
}

/// x [N, din] · W [din, dout] + b [dout], differentiable in all three.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, LinearOp)
}

#[cfg(test)]
mod linear_tests {
    use super::*;

    #[test]
    fn fused_linear_matches_composite_with_gradients() {
        let mut var = testing::vars(5, 1.0);
        let (x, w, b, probe) = (var(&[9, 4]), var(&[4, 6]), var(&[6]), var(&[9, 6]));
        let ours = linear(x.as_tensor(), w.as_tensor(), b.as_tensor()).unwrap();
        let theirs = x.as_tensor().matmul(w.as_tensor()).unwrap().broadcast_add(b.as_tensor()).unwrap();
        let diff = testing::max_diff;
        assert!(diff(&ours, &theirs) < 1e-12);
        let g1 = (&ours * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (&theirs * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&x, &w, &b] {
            assert!(diff(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap()) < 1e-10);
        }
    }
}

/// All experts of one MoE layer as a single autograd node: x holds every routed row, grouped by
/// expert (`counts[e]` rows for expert e, in expert order), the weights come stacked as
/// W1b [E, d+1, f] and W2b [E, f+1, d] (bias as the last row, as in [`expert_ffn`]). One node
/// instead of one per expert plus a gather, a weight multiply and a scatter per expert: the
/// per-expert nodes each zero-filled and accumulated a full [N, d] input gradient in backward.
struct GroupedExpertFfn {
    counts: Vec<usize>,
    saved: std::sync::Mutex<Option<Vec<Saved>>>,
}

macro_rules! grouped_ffn_impl {
    ($gfwd:ident, $gbwd:ident, $fwd:ident, $bwd:ident, $t:ty, $variant:ident) => {
        fn $gfwd(x: &[$t], w1s: &[$t], w2s: &[$t], counts: &[usize], d: usize, f: usize) -> (Vec<$t>, Vec<Saved>) {
            let (s1, s2) = ((d + 1) * f, (f + 1) * d);
            let mut y: Vec<$t> = Vec::with_capacity(x.len());
            let mut saved = Vec::with_capacity(counts.len());
            let mut row = 0;
            for (e, &n) in counts.iter().enumerate() {
                let (h, a, ye) = $fwd(&x[row * d..(row + n) * d], &w1s[e * s1..(e + 1) * s1], &w2s[e * s2..(e + 1) * s2], n, d, f);
                y.extend_from_slice(&ye);
                saved.push(Saved::$variant(h, a));
                row += n;
            }
            (y, saved)
        }

        #[allow(clippy::too_many_arguments)]
        fn $gbwd(
            x: &[$t],
            w1s: &[$t],
            w2s: &[$t],
            g: &[$t],
            counts: &[usize],
            d: usize,
            f: usize,
            saved: Option<Vec<Saved>>,
        ) -> (Vec<$t>, Vec<$t>, Vec<$t>) {
            let (s1, s2) = ((d + 1) * f, (f + 1) * d);
            let mut saved = saved.filter(|s| s.len() == counts.len()).map(|s| s.into_iter());
            let mut gx: Vec<$t> = Vec::with_capacity(x.len());
            let mut gw1: Vec<$t> = Vec::with_capacity(w1s.len());
            let mut gw2: Vec<$t> = Vec::with_capacity(w2s.len());
            let mut row = 0;
            for (e, &n) in counts.iter().enumerate() {
                let kept = match saved.as_mut().and_then(|s| s.next()) {
                    Some(Saved::$variant(h, a)) => Some((h, a)),
                    _ => None,
                };
                if n == 0 {
                    gw1.resize(gw1.len() + s1, 0.0);
                    gw2.resize(gw2.len() + s2, 0.0);
                    continue;
                }
                let (ge, g1, g2) = $bwd(
                    &x[row * d..(row + n) * d],
                    &w1s[e * s1..(e + 1) * s1],
                    &w2s[e * s2..(e + 1) * s2],
                    &g[row * d..(row + n) * d],
                    n,
                    d,
                    f,
                    kept,
                );
                gx.extend_from_slice(&ge);
                gw1.extend_from_slice(&g1);
                gw2.extend_from_slice(&g2);
                row += n;
            }
            (gx, gw1, gw2)
        }
    };
}

grouped_ffn_impl!(grouped_fwd_f32, grouped_bwd_f32, ffn_fwd_f32, ffn_bwd_f32, f32, F32);
grouped_ffn_impl!(grouped_fwd_f64, grouped_bwd_f64, ffn_fwd_f64, ffn_bwd_f64, f64, F64);

impl candle_core::CustomOp3 for GroupedExpertFfn {
    fn name(&self) -> &'static str {
        "lazarus-grouped-expert-ffn"
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
        let (rows, d) = l1.shape().dims2()?;
        let (e, d1, f) = l2.shape().dims3()?;
        if d1 != d + 1 || l3.shape().dims3()? != (e, f + 1, d) || e != self.counts.len() || self.counts.iter().sum::<usize>() != rows {
            candle_core::bail!(
                "grouped expert ffn: shapes {:?} {:?} {:?} do not match counts {:?}",
                l1.shape(),
                l2.shape(),
                l3.shape(),
                self.counts
            );
        }
        let (out, saved) = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(w1), CpuStorage::F32(w2)) => {
                let (y, saved) =
                    grouped_fwd_f32(contiguous_slice(x, l1)?, contiguous_slice(w1, l2)?, contiguous_slice(w2, l3)?, &self.counts, d, f);
                (CpuStorage::F32(y), saved)
            }
            (CpuStorage::F64(x), CpuStorage::F64(w1), CpuStorage::F64(w2)) => {
                let (y, saved) =
                    grouped_fwd_f64(contiguous_slice(x, l1)?, contiguous_slice(w1, l2)?, contiguous_slice(w2, l3)?, &self.counts, d, f);
                (CpuStorage::F64(y), saved)
            }
            _ => candle_core::bail!("grouped expert ffn: f32 or f64 inputs of one dtype"),
        };
        if let Ok(mut slot) = self.saved.lock() {
            *slot = Some(saved);
        }
        Ok((out, Shape::from((rows, d))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w1s: &Tensor,
        w2s: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (_, d) = x.dims2()?;
        let f = w1s.dim(2)?;
        let dev = x.device();
        let saved = self.saved.lock().ok().and_then(|mut s| s.take());
        let (gx, g1, g2) = match x.dtype() {
            candle_core::DType::F32 => {
                let v = host_f32;
                let (gx, g1, g2) = grouped_bwd_f32(&v(x)?, &v(w1s)?, &v(w2s)?, &v(grad)?, &self.counts, d, f, saved);
                (Tensor::from_vec(gx, x.shape(), dev)?, Tensor::from_vec(g1, w1s.shape(), dev)?, Tensor::from_vec(g2, w2s.shape(), dev)?)
            }
            _ => {
                let v = host_f64;
                let saved = saved.filter(|_| x.dtype() == candle_core::DType::F64);
                let (gx, g1, g2) = grouped_bwd_f64(&v(x)?, &v(w1s)?, &v(w2s)?, &v(grad)?, &self.counts, d, f, saved);
                (Tensor::from_vec(gx, x.shape(), dev)?, Tensor::from_vec(g1, w1s.shape(), dev)?, Tensor::from_vec(g2, w2s.shape(), dev)?)
            }
        };
        Ok((Some(gx), Some(g1), Some(g2)))
    }
}

/// Every expert of a layer over rows grouped by expert: x [R, d] with `counts[e]` rows for expert
/// e (in expert order, Σ counts = R); `experts[e]` = (W1 [d, f], b1 [f], W2 [f, d], b2 [d]).
/// Returns [R, d], each row through its own expert; differentiable in x and every weight.
pub fn grouped_expert_ffn(x: &Tensor, experts: &[[&Tensor; 4]], counts: &[usize]) -> candle_core::Result<Tensor> {
    if experts.len() != counts.len() {
        candle_core::bail!("grouped expert ffn: {} experts but {} counts", experts.len(), counts.len())
    }
    let mut w1: Vec<Tensor> = Vec::with_capacity(experts.len());
    let mut w2: Vec<Tensor> = Vec::with_capacity(experts.len());
    for [a, b, c, d] in experts {
        w1.push(Tensor::cat(&[*a, &b.unsqueeze(0)?], 0)?.unsqueeze(0)?);
        w2.push(Tensor::cat(&[*c, &d.unsqueeze(0)?], 0)?.unsqueeze(0)?);
    }
    let op = GroupedExpertFfn { counts: counts.to_vec(), saved: std::sync::Mutex::new(None) };
    x.contiguous()?.apply_op3(&Tensor::cat(&w1, 0)?, &Tensor::cat(&w2, 0)?, op)
}

#[cfg(test)]
mod grouped_tests {
    use super::*;
    use candle_core::Var;

    #[test]
    fn grouped_experts_match_the_composite_per_expert_with_gradients() {
        let (d, f) = (5, 6);
        let counts = [3usize, 0, 4, 1];
        let mut var = testing::vars(17, 0.5);
        let rows: usize = counts.iter().sum();
        let x = var(&[rows, d]);
        let probe = var(&[rows, d]);
        let weights: Vec<[Var; 4]> = counts.iter().map(|_| [var(&[d, f]), var(&[f]), var(&[f, d]), var(&[d])]).collect();
        let refs: Vec<[&Tensor; 4]> =
            weights.iter().map(|w| [w[0].as_tensor(), w[1].as_tensor(), w[2].as_tensor(), w[3].as_tensor()]).collect();
        let ours = grouped_expert_ffn(x.as_tensor(), &refs, &counts).unwrap();
        let mut parts = Vec::new();
        let mut row = 0;
        for (e, &n) in counts.iter().enumerate() {
            if n > 0 {
                let w = &refs[e];
                let h = x.as_tensor().narrow(0, row, n).unwrap().matmul(w[0]).unwrap().broadcast_add(w[1]).unwrap();
                parts.push(gelu(&h).unwrap().matmul(w[2]).unwrap().broadcast_add(w[3]).unwrap());
            }
            row += n;
        }
        let theirs = Tensor::cat(&parts, 0).unwrap();
        let diff = testing::max_diff;
        assert!(diff(&ours, &theirs) < 1e-12);
        let g1 = (&ours * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (&theirs * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(diff(g1.get(x.as_tensor()).unwrap(), g2.get(x.as_tensor()).unwrap()) < 1e-10);
        for (e, w) in weights.iter().enumerate() {
            for v in w {
                match (g1.get(v.as_tensor()), g2.get(v.as_tensor())) {
                    (Some(a), Some(b)) => assert!(diff(a, b) < 1e-10),
                    (Some(a), None) => {
                        assert_eq!(counts[e], 0, "gradient only on our side");
                        assert_eq!(a.abs().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap(), 0.0);
                    }
                    (None, _) => panic!("no gradient for expert {e}"),
                }
            }
        }
    }
}
