//! Fused CPU kernels, each a candle custom op with its own backward.
//!
//! candle's composite versions of these layers are chains of small ops, each allocating a
//! full-size temporary (and its backward allocating, zero-filling and accumulating more); on CPU
//! that costs more than the arithmetic. Each kernel here does the forward and the backward in a
//! pass or two over host buffers (GEMMs through the `gemm` crate where there are matrix products),
//! spread over the cores by the one helper in `parallel.rs`. Every kernel has an f32 and an f64
//! path (the softmax computes both in f64); other dtypes are an error, and the public functions
//! make their inputs contiguous first.
//!
//! Each file holds one kernel beside its tests. The tests compare the kernel's forward and
//! gradients against a *composite reference* built from candle's own ops, differentiated by
//! candle's autograd — the test oracle — at f64 with tight tolerances; the model's tests
//! check the whole model's gradients against finite differences as well.
//!
//! - [`gelu()`]: GELU (tanh form), elementwise.
//! - [`softmax_last`]: softmax over the last dimension.
//! - [`layer_norm()`]: LayerNorm with weight and bias over the last dimension.
//! - [`rms_norm()`]: RMSNorm with a weight over the last dimension.
//! - [`rope()`]: rotary positions on the queries and keys of a packed QKV projection.
//! - [`linear()`]: x·W + b.
//! - [`causal_attention`]: causal multi-head self-attention over a packed QKV projection.
//! - [`expert_ffn()`]: one expert's GELU or SwiGLU FFN (SwiGLU's elementwise half in
//!   `swiglu.rs`), computed by the grouped node below.
//! - [`cross_entropy()`]: mean cross-entropy of logits against class targets.
//! - [`grouped_expert_ffn`]: every expert of an MoE layer over rows grouped by expert, one node;
//!   [`grouped_expert_ffn_to_sink`] the same, handing the expert weights' gradients to a
//!   [`WeightGradSink`] past candle's autograd (what the model trains with).
//! - [`gather_rows`] / [`combine_rows`]: an MoE layer's token rows into expert order, and the
//!   expert outputs, weighted, back onto their tokens.
//! - [`residual_add`]: a + b on the residual stream, over the cores.

mod attention;
mod composite;
mod cross_entropy;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(test)]
mod emulated;
mod expert_ffn;
mod gelu;
mod gemm;
mod grouped_ffn;
mod host;
mod layer_norm;
mod linear;
mod moe_rows;
#[cfg(test)]
mod on_device;
#[cfg(test)]
pub(crate) use on_device::gpu as on_device_gpu;
#[cfg(test)]
pub(crate) use testing::data as testing_data;
mod parallel;
mod residual;
mod rms_norm;
mod rope;
mod simd;
mod softmax;
mod swiglu;
#[cfg(test)]
mod testing;

/// Whether the fused CPU kernel takes `t`: an f32 or f64 tensor on the CPU. Anything else (a
/// GPU, bf16) goes the composite way.
fn fused_here(t: &candle_core::Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), candle_core::DType::F32 | candle_core::DType::F64)
}

pub use attention::causal_attention;

/// A linear layer by the GPU ops (`cuda::linear_to`): x · w (+ b) into `out`, the product
/// reading `copy` (w's working copy) when given. An error in a build without CUDA, where no model
/// takes the GPU path.
pub(crate) fn cuda_linear(
    x: &candle_core::Tensor,
    w: &candle_core::Var,
    b: Option<&candle_core::Var>,
    copy: Option<&candle_core::Tensor>,
    out: candle_core::DType,
) -> candle_core::Result<candle_core::Tensor> {
    #[cfg(feature = "cuda")]
    {
        cuda::linear_to(x, w.as_tensor(), b.map(|b| b.as_tensor()), copy, out)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, w, b, copy, out);
        candle_core::bail!("this build has no CUDA: no GPU layers")
    }
}
/// An FFN's activation of its first product's rows h by the GPU ops: GELU, or SwiGLU ([.., 2f] →
/// [.., f]). An error in a build without CUDA.
pub(crate) fn cuda_activation(h: &candle_core::Tensor, act: crate::config::Activation) -> candle_core::Result<candle_core::Tensor> {
    #[cfg(feature = "cuda")]
    {
        match act {
            crate::config::Activation::Gelu => cuda::gelu(h),
            crate::config::Activation::Swiglu => cuda::swiglu(h),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (h, act);
        candle_core::bail!("this build has no CUDA: no GPU layers")
    }
}
pub use cross_entropy::cross_entropy;
pub use gelu::gelu;
pub use grouped_ffn::{expert_ffn, ffn_weights, grouped_expert_ffn, grouped_expert_ffn_to_sink, WeightGradSink};
pub use host::{with_f32, with_f32_slices};
pub use layer_norm::{layer_norm, layer_norm_to};
pub use linear::linear;
pub use moe_rows::{combine_rows, gather_rows};
pub use parallel::threads;
pub use residual::residual_add;
pub use rms_norm::{rms_norm, rms_norm_to};
pub use rope::rope;
pub use softmax::softmax_last;
