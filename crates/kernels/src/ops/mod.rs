//! The layers' device work, each op's forward or backward as one function over a [`Device`]:
//! the buffers it allocates, the kernels it launches, the matrix products it runs. The GPU glue
//! in `lazarus-model` calls these with candle's CUDA device and wraps the buffers they return as
//! tensors; the tests call them with the emulator and compare with the CPU kernels.
//!
//! Inputs are device addresses of contiguous row-major arrays; host-side inputs (routing, token
//! ids, targets) are validated here before anything reads them on the device.

mod adamw;
mod attention;
mod ffn;
mod norm;
mod rows;
mod squares;

pub use adamw::adamw_all;
pub use attention::{attention_bwd, attention_fwd, rope};
pub use ffn::{
    grouped_ffn_bwd, grouped_ffn_fwd, linear_bwd, linear_fwd, swiglu_bwd, swiglu_fwd, ExpertAddrs, GroupedFfnGrads, GroupedFfnSaved,
    LinearGrads,
};
pub use norm::{
    cross_entropy_bwd, cross_entropy_fwd, layer_norm_bwd, layer_norm_fwd, rms_norm_bwd, rms_norm_fwd, softmax_bwd, softmax_fwd,
    CrossEntropySaved, LayerNormSaved, RmsNormSaved,
};
pub use rows::{combine_rows_bwd, combine_rows_fwd, embed_bwd, embed_fwd, gather_rows_bwd, gather_rows_fwd, WeightSlots};
pub use squares::sum_squares;

use crate::{Device, Elem, KernelError};

/// An op's output buffer with what its backward keeps.
pub type WithSaved<D, S> = Result<(<D as Device>::Buffer, S), <D as Device>::Error>;

/// Check that every id is below `n`, naming the first that is not.
fn check_ids(what: &'static str, ids: &[u32], n: usize) -> Result<(), KernelError> {
    match ids.iter().position(|&i| i as usize >= n) {
        Some(at) => Err(KernelError::Size { family: what, what: format!("id {} at {at} is not below {n}", ids[at]) }),
        None => Ok(()),
    }
}

/// A buffer of `n` elements.
fn alloc<D: Device>(dev: &D, elem: impl Into<Elem>, n: usize) -> Result<D::Buffer, D::Error> {
    dev.alloc(elem.into(), n)
}
