//! LayerNorm, RMSNorm, softmax and cross-entropy on a GPU, as candle autograd nodes.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, DType, Layout, Shape, Tensor};
use lazarus_kernels::ops::{self, CrossEntropySaved, LayerNormSaved, RmsNormSaved};

use super::{addr, dtype_of, storage_addr, CudaBuf, Gpu};

/// LayerNorm whose output may be narrower than its input (f32 in, bf16 out for a bf16 product).
struct GpuLayerNorm {
    eps: f64,
    out: DType,
    saved: Mutex<Option<LayerNormSaved<CudaBuf>>>,
}

custom_op!(GpuLayerNorm: CustomOp3 "lazarus-gpu-layer-norm", cuda, "layer-norm");

impl GpuLayerNorm {
    fn cuda(&self, [(x, xl), (w, wl), (b, bl)]: [(&CudaStorage, &Layout); 3]) -> candle_core::Result<(CudaStorage, Shape)> {
        let gpu = Gpu::of_storage(x);
        let d = xl.shape().dims().last().copied().unwrap_or(1);
        let rows = xl.shape().elem_count() / d.max(1);
        let (x_dt, y_dt) = (dtype_of(x.dtype())?, dtype_of(self.out)?);
        let (y, saved) =
            ops::layer_norm_fwd(&gpu, x_dt, y_dt, storage_addr(x, xl)?, storage_addr(w, wl)?, storage_addr(b, bl)?, rows, d, self.eps)?;
        if let Ok(mut s) = self.saved.lock() {
            *s = Some(saved);
        }
        Ok((gpu.storage(y)?, xl.shape().clone()))
    }

    fn grads(&self, [x, w, _b]: [&Tensor; 3], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads3> {
        let gpu = Gpu::of(x)?;
        let d = x.dims().last().copied().unwrap_or(1);
        let rows = x.elem_count() / d.max(1);
        let (x, w, g) = (x.contiguous()?, w.contiguous()?, grad.contiguous()?);
        let saved = self.saved.lock().map_err(|_| candle_core::Error::Msg("layer norm: poisoned".into()))?;
        let Some(saved) = saved.as_ref() else { candle_core::bail!("layer norm: backward before forward") };
        let (dx, dwdb) =
            ops::layer_norm_bwd(&gpu, dtype_of(x.dtype())?, dtype_of(g.dtype())?, addr(&x)?, addr(&w)?, addr(&g)?, saved, rows, d)?;
        let dx = gpu.tensor(dx, x.shape())?;
        let dwdb = gpu.tensor(dwdb, 2 * d)?;
        Ok((Some(dx), Some(dwdb.narrow(0, 0, d)?), Some(dwdb.narrow(0, d, d)?)))
    }
}

/// LayerNorm of x over its last dimension with weight and bias (of x's type), into `out` (x's
/// type, or bf16 from f32).
pub fn layer_norm_to(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64, out: DType) -> candle_core::Result<Tensor> {
    let op = GpuLayerNorm { eps, out, saved: Mutex::new(None) };
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, op)
}

/// RMSNorm whose output may be narrower than its input (f32 in, bf16 out for a bf16 product).
struct GpuRmsNorm {
    eps: f64,
    out: DType,
    saved: Mutex<Option<RmsNormSaved<CudaBuf>>>,
}

custom_op!(GpuRmsNorm: CustomOp2 "lazarus-gpu-rms-norm", cuda, "rms-norm");

impl GpuRmsNorm {
    fn cuda(&self, [(x, xl), (w, wl)]: [(&CudaStorage, &Layout); 2]) -> candle_core::Result<(CudaStorage, Shape)> {
        let gpu = Gpu::of_storage(x);
        let d = xl.shape().dims().last().copied().unwrap_or(1);
        if wl.shape().elem_count() != d {
            candle_core::bail!("rms norm: weight {:?} does not match input {:?}", wl.shape(), xl.shape());
        }
        let rows = xl.shape().elem_count() / d.max(1);
        let (x_dt, y_dt) = (dtype_of(x.dtype())?, dtype_of(self.out)?);
        let (y, saved) = ops::rms_norm_fwd(&gpu, x_dt, y_dt, storage_addr(x, xl)?, storage_addr(w, wl)?, rows, d, self.eps)?;
        if let Ok(mut s) = self.saved.lock() {
            *s = Some(saved);
        }
        Ok((gpu.storage(y)?, xl.shape().clone()))
    }

    fn grads(&self, [x, w]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads2> {
        let gpu = Gpu::of(x)?;
        let d = x.dims().last().copied().unwrap_or(1);
        let rows = x.elem_count() / d.max(1);
        let (x, w, g) = (x.contiguous()?, w.contiguous()?, grad.contiguous()?);
        let saved = self.saved.lock().map_err(|_| candle_core::Error::Msg("rms norm: poisoned".into()))?;
        let Some(saved) = saved.as_ref() else { candle_core::bail!("rms norm: backward before forward") };
        let (dx, dw) =
            ops::rms_norm_bwd(&gpu, dtype_of(x.dtype())?, dtype_of(g.dtype())?, addr(&x)?, addr(&w)?, addr(&g)?, saved, rows, d)?;
        Ok((Some(gpu.tensor(dx, x.shape())?), Some(gpu.tensor(dw, w.shape())?)))
    }
}

/// RMSNorm of x over its last dimension with a weight (of x's type), into `out` (x's type, or
/// bf16 from f32).
pub fn rms_norm_to(x: &Tensor, w: &Tensor, eps: f64, out: DType) -> candle_core::Result<Tensor> {
    let op = GpuRmsNorm { eps, out, saved: Mutex::new(None) };
    x.contiguous()?.apply_op2(&w.contiguous()?, op)
}

/// Softmax over the last dimension (f32 or f64).
struct GpuSoftmax;

custom_op!(GpuSoftmax: CustomOp1 "lazarus-gpu-softmax", cuda, "softmax");

impl GpuSoftmax {
    fn cuda(&self, [(x, xl)]: [(&CudaStorage, &Layout); 1]) -> candle_core::Result<(CudaStorage, Shape)> {
        let gpu = Gpu::of_storage(x);
        let v = xl.shape().dims().last().copied().unwrap_or(1);
        let rows = xl.shape().elem_count() / v.max(1);
        let y = ops::softmax_fwd(&gpu, dtype_of(x.dtype())?, storage_addr(x, xl)?, rows, v)?;
        Ok((gpu.storage(y)?, xl.shape().clone()))
    }

    fn grads(&self, [_x]: [&Tensor; 1], res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads1> {
        let gpu = Gpu::of(res)?;
        let v = res.dims().last().copied().unwrap_or(1);
        let rows = res.elem_count() / v.max(1);
        let (y, g) = (res.contiguous()?, grad.contiguous()?);
        let dx = ops::softmax_bwd(&gpu, dtype_of(y.dtype())?, addr(&y)?, addr(&g)?, rows, v)?;
        Ok(Some(gpu.tensor(dx, y.shape())?))
    }
}

/// Softmax over the last dimension of an f32 or f64 tensor.
pub fn softmax_last(x: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1(GpuSoftmax)
}

/// The mean cross-entropy of logits [N, V] against the targets.
struct GpuCrossEntropy {
    targets: Vec<u32>,
    saved: Mutex<Option<CrossEntropySaved<CudaBuf>>>,
}

custom_op!(GpuCrossEntropy: CustomOp1 "lazarus-gpu-cross-entropy", cuda, "cross-entropy");

impl GpuCrossEntropy {
    fn cuda(&self, [(x, xl)]: [(&CudaStorage, &Layout); 1]) -> candle_core::Result<(CudaStorage, Shape)> {
        let gpu = Gpu::of_storage(x);
        let (n, v) = xl.shape().dims2()?;
        if n != self.targets.len() {
            candle_core::bail!("cross entropy: {n} rows of logits, {} targets", self.targets.len());
        }
        let (loss, saved) = ops::cross_entropy_fwd(&gpu, dtype_of(x.dtype())?, storage_addr(x, xl)?, &self.targets, v)?;
        if let Ok(mut s) = self.saved.lock() {
            *s = Some(saved);
        }
        Ok((gpu.storage(loss)?, Shape::from(())))
    }

    fn grads(&self, [x]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads1> {
        let gpu = Gpu::of(x)?;
        let (n, v) = x.dims2()?;
        let (x, g) = (x.contiguous()?, grad.to_dtype(x.dtype())?.contiguous()?);
        let saved = self.saved.lock().map_err(|_| candle_core::Error::Msg("cross entropy: poisoned".into()))?;
        let Some(saved) = saved.as_ref() else { candle_core::bail!("cross entropy: backward before forward") };
        let dx = ops::cross_entropy_bwd(&gpu, dtype_of(x.dtype())?, addr(&x)?, saved, addr(&g)?, n, v)?;
        Ok(Some(gpu.tensor(dx, x.shape())?))
    }
}

/// Mean cross-entropy of f32 or f64 logits [N, V] against `targets` (checked below V).
pub fn cross_entropy(logits: &Tensor, targets: &[u32]) -> candle_core::Result<Tensor> {
    logits.contiguous()?.apply_op1(GpuCrossEntropy { targets: targets.to_vec(), saved: Mutex::new(None) })
}
