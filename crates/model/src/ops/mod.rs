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
//!
//! Each op, here and on the GPU (`cuda/`), gets candle's custom-op trait from [`custom_op!`]:
//! the op writes its forward (`cpu` or `cuda`) and its backward (`grads`) with the inputs as
//! arrays, and the macro fills in the rest of the trait the same way for all of them.

/// candle's custom-op trait (`CustomOp1`, `2` or `3`) for one of our ops, from its own methods
/// with the inputs as arrays: its forward on the device it runs on —
/// `cpu(&self, [(&CpuStorage, &Layout); N])` or `cuda(&self, [(&CudaStorage, &Layout); N])`
/// (a GPU op's CPU forward is an error: its public function sends CPU tensors elsewhere) — and
/// its backward, `grads(&self, [&Tensor; N], result, grad)` giving [`Grads1`], `2` or `3`;
/// each timed under the op's profile name (`.fwd`, `.bwd`: [`crate::profile`]).
macro_rules! custom_op {
    ($op:ty: CustomOp1 $name:literal, $dev:ident, $profile:literal) => {
        custom_op!(@impl $op, CustomOp1, $name, $dev, $profile, [a al], crate::ops::Grads1);
    };
    ($op:ty: CustomOp2 $name:literal, $dev:ident, $profile:literal) => {
        custom_op!(@impl $op, CustomOp2, $name, $dev, $profile, [a al, b bl], crate::ops::Grads2);
    };
    ($op:ty: CustomOp3 $name:literal, $dev:ident, $profile:literal) => {
        custom_op!(@impl $op, CustomOp3, $name, $dev, $profile, [a al, b bl, c cl], crate::ops::Grads3);
    };
    (@impl $op:ty, $trait:ident, $name:literal, $dev:ident, $profile:literal, [$($s:ident $l:ident),+], $grads:ty) => {
        impl candle_core::$trait for $op {
            fn name(&self) -> &'static str {
                $name
            }

            custom_op!(@forward $dev, $name, $profile, $($s $l),+);

            fn bwd(&self, $($s: &candle_core::Tensor,)+ res: &candle_core::Tensor, grad: &candle_core::Tensor) -> candle_core::Result<$grads> {
                let _profile = crate::profile::kernel(concat!($profile, ".bwd"));
                self.grads([$($s),+], res, grad)
            }
        }
    };
    (@forward cpu, $name:literal, $profile:literal, $($s:ident $l:ident),+) => {
        fn cpu_fwd(&self, $($s: &candle_core::CpuStorage, $l: &candle_core::Layout),+) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            let _profile = crate::profile::kernel(concat!($profile, ".fwd"));
            self.cpu([$(($s, $l)),+])
        }
    };
    (@forward cuda, $name:literal, $profile:literal, $($s:ident $l:ident),+) => {
        fn cpu_fwd(&self, $($s: &candle_core::CpuStorage, $l: &candle_core::Layout),+) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            let _ = ($($s, $l),+);
            crate::ops::cuda::not_on_cpu($name)
        }

        fn cuda_fwd(&self, $($s: &candle_core::CudaStorage, $l: &candle_core::Layout),+) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
            let _profile = crate::profile::kernel(concat!($profile, ".fwd"));
            self.cuda([$(($s, $l)),+])
        }
    };
}

/// The gradient of a one-input op's input (None: it has none).
pub(crate) type Grads1 = Option<candle_core::Tensor>;
/// The gradients of a two-input op's inputs.
pub(crate) type Grads2 = (Option<candle_core::Tensor>, Option<candle_core::Tensor>);
/// The gradients of a three-input op's inputs.
pub(crate) type Grads3 = (Option<candle_core::Tensor>, Option<candle_core::Tensor>, Option<candle_core::Tensor>);

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

/// σ(x) = 1 / (1 + e^−x), elementwise, from candle's ops (differentiable): a sigmoid router's
/// scores, and the gate of Qwen2-MoE's shared expert.
pub(crate) fn sigmoid(x: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}
