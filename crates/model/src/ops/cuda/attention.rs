//! Causal attention on a GPU, flash-style (`lazarus_kernels::ops::attention_*`), and the rotary
//! positions turned on its queries and keys (`ops::rope`), each one candle autograd node over the
//! packed projection.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, DType, Layout, Shape, Tensor};
use lazarus_kernels::{ops, AttentionKernels, Heads};

use super::{addr, dtype_of, storage_addr, CudaBuf, Gpu};

/// The attention kernels of this process: on the tensor cores where they apply, unless
/// `LAZARUS_ATTENTION=simt` (the "before" of the benchmarks; read once).
fn kernels() -> AttentionKernels {
    static K: std::sync::OnceLock<AttentionKernels> = std::sync::OnceLock::new();
    *K.get_or_init(|| match std::env::var("LAZARUS_ATTENTION").as_deref() {
        Ok("simt") => AttentionKernels::Simt,
        _ => AttentionKernels::TensorCores,
    })
}

struct GpuAttention {
    heads: usize,
    /// Each query row's log-sum-exp, from the forward.
    lse: Mutex<Option<CudaBuf>>,
}

custom_op!(GpuAttention: CustomOp1 "lazarus-gpu-attention", cuda, "causal-attention");

impl GpuAttention {
    fn cuda(&self, [(qkv, l)]: [(&CudaStorage, &Layout); 1]) -> candle_core::Result<(CudaStorage, Shape)> {
        let gpu = Gpu::of_storage(qkv);
        let h = packed_heads(l.shape(), self.heads)?;
        let (y, lse) = ops::attention_fwd(&gpu, kernels(), dtype_of(qkv.dtype())?, storage_addr(qkv, l)?, h)?;
        if let Ok(mut s) = self.lse.lock() {
            *s = Some(lse);
        }
        Ok((gpu.storage(y)?, Shape::from((h.batch, h.seq, h.heads * h.head_dim))))
    }

    fn grads(&self, [qkv]: [&Tensor; 1], res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads1> {
        let gpu = Gpu::of(qkv)?;
        let h = packed_heads(qkv.shape(), self.heads)?;
        let (qkv, y, g) = (qkv.contiguous()?, res.contiguous()?, grad.contiguous()?);
        let lse = self.lse.lock().map_err(|_| candle_core::Error::Msg("attention: poisoned".into()))?;
        let Some(lse) = lse.as_ref() else { candle_core::bail!("attention: backward before forward") };
        let lse_addr = lazarus_kernels::Device::addr(&gpu, lse);
        let dqkv = ops::attention_bwd(&gpu, kernels(), dtype_of(qkv.dtype())?, addr(&qkv)?, addr(&y)?, addr(&g)?, lse_addr, h)?;
        Ok(Some(gpu.tensor(dqkv, qkv.shape())?))
    }
}

/// The heads of a packed qkv of `shape` [batch, seq, 3·heads·head_dim] split into `heads`.
fn packed_heads(shape: &Shape, heads: usize) -> candle_core::Result<Heads> {
    let (batch, seq, d3) = shape.dims3()?;
    Ok(Heads { batch, seq, heads, head_dim: d3 / 3 / heads.max(1) })
}

/// Whether the GPU kernel takes `heads` heads of a packed width `d3` (the head width in range).
pub fn supported(d3: usize, heads: usize) -> bool {
    heads > 0 && d3.is_multiple_of(3) && (d3 / 3).is_multiple_of(heads) && lazarus_kernels::attention_supported(d3 / 3 / heads)
}

/// Causal attention over qkv [B, T, 3d] → [B, T, d].
pub fn causal_attention(qkv: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    qkv.contiguous()?.apply_op1(GpuAttention { heads, lse: Mutex::new(None) })
}

/// Rotary positions on the packed projection: q and k turned, v copied.
struct GpuRope {
    heads: usize,
    theta: f64,
}

impl GpuRope {
    fn turn(&self, gpu: &Gpu, dt: DType, x: u64, shape: &Shape, inverse: bool) -> candle_core::Result<CudaBuf> {
        Ok(ops::rope(gpu, dtype_of(dt)?, x, packed_heads(shape, self.heads)?, self.theta, inverse)?)
    }
}

custom_op!(GpuRope: CustomOp1 "lazarus-gpu-rope", cuda, "rope");

impl GpuRope {
    fn cuda(&self, [(qkv, l)]: [(&CudaStorage, &Layout); 1]) -> candle_core::Result<(CudaStorage, Shape)> {
        let gpu = Gpu::of_storage(qkv);
        let y = self.turn(&gpu, qkv.dtype(), storage_addr(qkv, l)?, l.shape(), false)?;
        Ok((gpu.storage(y)?, l.shape().clone()))
    }

    fn grads(&self, [_qkv]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads1> {
        let gpu = Gpu::of(grad)?;
        let g = grad.contiguous()?;
        let dx = self.turn(&gpu, g.dtype(), addr(&g)?, g.shape(), true)?;
        Ok(Some(gpu.tensor(dx, g.shape())?))
    }
}

/// Rotary positions with base `theta` on qkv [B, T, 3d] of `heads` heads of an even width (the
/// caller checks the shape).
pub fn rope(qkv: &Tensor, heads: usize, theta: f64) -> candle_core::Result<Tensor> {
    qkv.contiguous()?.apply_op1(GpuRope { heads, theta })
}
