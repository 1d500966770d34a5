//! Each fused kernel's *composite form*: the same function built from candle's own ops and
//! differentiated by candle's autograd.
//!
//! Two uses, one home. It is the oracle the fused CPU kernels are tested against (at f64, tight
//! tolerances), and it is the path of tensors that live on a GPU: the fused kernels work on host
//! buffers, while each of candle's ops here runs as a device kernel (candle's CUDA backend), so a
//! CUDA model needs no copy through the host. The public functions in `ops` choose: fused on the
//! CPU, composite elsewhere. Inputs are validated by those public functions before either path.
//!
//! Softmaxes subtract the row maximum first (detached: softmax does not depend on it), so f32
//! and bf16 on a device do not overflow where the fused kernels' f64 accumulators would not.

use candle_core::{DType, Tensor, D};

/// SwiGLU of h [n, 2f] = [gate | up]: SiLU(gate) ⊙ up [n, f].
pub fn swiglu(h: &Tensor) -> candle_core::Result<Tensor> {
    let f = h.dim(D::Minus1)? / 2;
    h.narrow(D::Minus1, 0, f)?.silu()? * h.narrow(D::Minus1, f, f)?
}

/// RMSNorm: x / √(mean(x²) + eps) · w.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

/// (cos, sin) of every (position < t, pair i < h/2), row-major [t, h/2], in f64: the angles of
/// [`rope`], which the fused kernel uses too.
pub(super) fn rope_tables(t: usize, head: usize, theta: f64) -> (Vec<f64>, Vec<f64>) {
    let half = head / 2;
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for pos in 0..t {
        for i in 0..half {
            let angle = pos as f64 * theta.powf(-((2 * i) as f64) / head as f64);
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    (cos, sin)
}

/// Rotary positions on the queries and keys of qkv [B, T, 3d] (`heads` heads, the values
/// untouched): per head, dimension i < h/2 and i + h/2 turn by t·θ^(−2i/h) at position t.
pub fn rope(qkv: &Tensor, heads: usize, theta: f64) -> candle_core::Result<Tensor> {
    let (b, t, d3) = qkv.dims3()?;
    let (d, dh) = (d3 / 3, d3 / 3 / heads);
    let half = dh / 2;
    let (cos, sin) = rope_tables(t, dh, theta);
    let table = |v: Vec<f64>| Tensor::from_vec(v, (1, t, 1, half), qkv.device())?.to_dtype(qkv.dtype());
    let (cos, sin) = (table(cos)?, table(sin)?);
    let turn = |x: &Tensor| -> candle_core::Result<Tensor> {
        let x = x.reshape((b, t, heads, dh))?;
        let (x1, x2) = (x.narrow(3, 0, half)?, x.narrow(3, half, half)?);
        let y1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
        let y2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
        Tensor::cat(&[y1, y2], 3)?.reshape((b, t, d))
    };
    let q = turn(&qkv.narrow(2, 0, d)?)?;
    let k = turn(&qkv.narrow(2, d, d)?)?;
    Tensor::cat(&[q, k, qkv.narrow(2, 2 * d, d)?], 2)
}

/// GELU, tanh form: candle's one-kernel `gelu` (its backward is a chain of a dozen ops with
/// 6-digit constants, within f32), for devices without a fused GELU of ours.
pub fn gelu(x: &Tensor) -> candle_core::Result<Tensor> {
    x.gelu()
}

/// Softmax over the last dimension, max-shifted.
pub fn softmax_last(x: &Tensor) -> candle_core::Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// LayerNorm: mean, centre, variance, divide by √(var + eps), scale, shift.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_div(&(var + eps)?.sqrt()?)?.broadcast_mul(w)?.broadcast_add(b)
}

/// x [N, din] · W [din, dout] + b [dout].
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    x.matmul(w)?.broadcast_add(b)
}

/// Causal attention over qkv [B, T, 3d]: split heads, scaled scores, additive causal mask,
/// softmax, weighted sum → [B, T, d].
pub fn causal_attention(qkv: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (b, t, d3) = qkv.dims3()?;
    let d = d3 / 3;
    let dh = d / heads;
    let x = qkv.reshape((b, t, 3, heads, dh))?.permute((2, 0, 3, 1, 4))?.contiguous()?;
    let (q, k, v) = (x.get(0)?, x.get(1)?, x.get(2)?);
    let mask: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
    let mask = Tensor::from_vec(mask, (t, t), qkv.device())?;
    let scores = (q.matmul(&k.t()?.contiguous()?)? / (dh as f64).sqrt())?;
    // The softmax in f32 at least (bf16 scores would lose the small probabilities).
    let wide = if qkv.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let mask = mask.to_dtype(wide)?;
    let att = softmax_last(&scores.to_dtype(wide)?.broadcast_add(&mask)?)?.to_dtype(qkv.dtype())?;
    att.matmul(&v)?.transpose(1, 2)?.contiguous()?.reshape((b, t, d))
}

/// Mean cross-entropy of logits [N, V] against targets [N] (u32, on the logits' device).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let n = logits.dim(0)?;
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    (lse - shifted.gather(&targets.reshape((n, 1))?, 1)?)?.mean_all()
}

/// Rows of src [N, d] in the order of `tokens` (u32 [R], on src's device).
pub fn gather_rows(src: &Tensor, tokens: &Tensor) -> candle_core::Result<Tensor> {
    src.index_select(tokens, 0)
}

/// out [n, d], out[t] = Σ_{r: tokens[r] = t} w[r]·y[r].
pub fn combine_rows(y: &Tensor, w: &Tensor, tokens: &Tensor, n: usize) -> candle_core::Result<Tensor> {
    let d = y.dim(1)?;
    Tensor::zeros((n, d), y.dtype(), y.device())?.index_add(tokens, &y.broadcast_mul(&w.unsqueeze(1)?)?, 0)
}
