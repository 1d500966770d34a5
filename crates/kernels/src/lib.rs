//! Lazarus's CUDA kernels and how each is launched.
//!
//! The kernels are one CUDA source (`cuda/kernels.cu` and the family files it includes). It is
//! compiled twice: to PTX by nvcc for GPUs (the `cuda` feature; [`PTX`]), and always to host code
//! run by a CPU emulation of CUDA's execution model ([`emulator`]): blocks one after the other,
//! every thread a fiber, barriers and warp exchanges as rendezvous of the fibers. So every kernel
//! runs in the ordinary `cargo test` on a machine without a GPU, against its reference, and a
//! missing barrier or a launch that does not fit its kernel fails there rather than on a GPU.
//!
//! What a launch is — kernel name, grid, block, shared memory, the argument list — is built here
//! once, as a [`Launch`] value, by one function per kernel family (`attention`, `norm`, `rope`,
//! `rows`, `elementwise`), from device addresses and sizes. An op — a layer's forward or backward: its
//! buffers, its launches, its matrix products — is built once too ([`ops`]), over a [`Device`]:
//! the emulator here, candle's CUDA device (and cuBLAS) in `lazarus-model`. The two run the same
//! code, so the emulated tests check the buffer sizes, the launch arithmetic and the argument
//! sizes the GPU will get.
//!
//! Design note and the kernels' invariants: `README.md` beside this crate.

mod attention;
mod device;
mod elementwise;
pub mod emulator;
mod norm;
pub mod ops;
mod rope;
mod rows;

pub use attention::{attention_bwd, attention_fwd, attention_supported, AttentionKernels, Heads, ATTENTION_MAX_HEAD_DIM};
pub use device::{Device, Elem, Gemm};
pub use elementwise::{
    adamw, adamw_list, adamw_table, bias_activation_fwd, bias_add_rows, cast, gelu, gelu_bwd_inplace, gelu_grad, squares_parts, sum_parts,
    sum_squares_parts, swiglu, swiglu_bwd, Activation, AdamWScalars, AdamWTensor, ADAMW_PART, ADAMW_RECORD, SQUARES_PART,
};
pub use norm::{
    column_sums, column_sums_workspace, cross_entropy_bwd, cross_entropy_fwd, layer_norm_bwd, layer_norm_bwd_workspace, layer_norm_fwd,
    rms_norm_bwd, rms_norm_bwd_workspace, rms_norm_fwd, softmax_bwd, softmax_fwd,
};
pub use rope::{rope, rope_tables};
pub use rows::{combine_rows_bwd, embed_fwd, gather_rows, lists_by_key, sum_listed_rows, RowLists};

/// The PTX module of every kernel (a `cuda` build), loaded once per device under [`MODULE`].
#[cfg(feature = "cuda")]
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));

/// The name the PTX module is loaded under.
pub const MODULE: &str = "lazarus_kernels";

/// An element type the kernels take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    F64,
    Bf16,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F64 => 8,
            Dtype::Bf16 => 2,
        }
    }

    /// The type sums are carried in: f32 for f32 and bf16, f64 for f64.
    pub fn acc(self) -> Dtype {
        match self {
            Dtype::F64 => Dtype::F64,
            _ => Dtype::F32,
        }
    }

    /// The suffix of its kernels' names.
    pub fn suffix(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F64 => "f64",
            Dtype::Bf16 => "bf16",
        }
    }
}

/// One kernel argument, as the kernel's parameter takes it: a device address (8 bytes) or a
/// scalar.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A device address; 0 is a null pointer.
    Ptr(u64),
    U32(u32),
    U64(u64),
    I32(i32),
    F32(f32),
    F64(f64),
}

impl Arg {
    /// The argument's bytes, little-endian, and how many there are.
    pub fn bytes(&self) -> ([u8; 8], usize) {
        let mut b = [0u8; 8];
        let n = match *self {
            Arg::Ptr(v) | Arg::U64(v) => {
                b.copy_from_slice(&v.to_le_bytes());
                8
            }
            Arg::F64(v) => {
                b.copy_from_slice(&v.to_le_bytes());
                8
            }
            Arg::U32(v) => {
                b[..4].copy_from_slice(&v.to_le_bytes());
                4
            }
            Arg::I32(v) => {
                b[..4].copy_from_slice(&v.to_le_bytes());
                4
            }
            Arg::F32(v) => {
                b[..4].copy_from_slice(&v.to_le_bytes());
                4
            }
        };
        (b, n)
    }
}

/// One kernel launch: which kernel, its grid and block (x, y, z), its dynamic shared memory and
/// its arguments in the kernel's parameter order.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    pub kernel: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
    pub args: Vec<Arg>,
}

/// Why no launch could be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// This combination of element types has no kernel.
    #[error("{family}: no kernel for {what}")]
    Types { family: &'static str, what: String },
    /// A size the kernels cannot take.
    #[error("{family}: {what}")]
    Size { family: &'static str, what: String },
}

/// Threads per block of the grid-stride elementwise kernels.
const THREADS: u32 = 256;

/// Blocks of a grid-stride loop over `n` elements: enough to fill any GPU, at most 65,536 (the
/// loop covers the rest).
fn blocks_for(n: u64) -> u32 {
    n.div_ceil(THREADS as u64).clamp(1, 1 << 16) as u32
}

/// Threads per block of the one-row-per-block kernels for rows of `width` (a multiple of 32).
fn row_threads(width: u32) -> u32 {
    match width {
        0..=64 => 32,
        65..=512 => 128,
        _ => 256,
    }
}

/// Blocks of a one-row-per-block kernel over `rows` rows (the kernel strides past the last).
fn row_blocks(rows: u64) -> u32 {
    rows.clamp(1, 1 << 20) as u32
}

fn launch(kernel: String, grid: [u32; 3], block: [u32; 3], args: Vec<Arg>) -> Launch {
    Launch { kernel, grid, block, shared_bytes: 0, args }
}

/// A launch of one block per row of `rows`, each as wide as a row of `width` wants.
fn row_launch(kernel: String, rows: usize, width: u32, args: Vec<Arg>) -> Launch {
    launch(kernel, [row_blocks(rows as u64), 1, 1], [row_threads(width), 1, 1], args)
}

/// A launch of a grid-stride loop over `n` elements.
fn stride_launch(kernel: String, n: u64, args: Vec<Arg>) -> Launch {
    launch(kernel, [blocks_for(n), 1, 1], [THREADS, 1, 1], args)
}

/// A kernel's arguments as its C signature lists them: device pointers first, then the rest.
fn args<const N: usize>(pointers: &[u64], rest: [Arg; N]) -> Vec<Arg> {
    pointers.iter().map(|&p| Arg::Ptr(p)).chain(rest).collect()
}

/// A u32 size argument, or an error naming it.
fn size_u32(family: &'static str, what: &str, v: usize) -> Result<u32, KernelError> {
    u32::try_from(v).map_err(|_| KernelError::Size { family, what: format!("{what} {v} does not fit 32 bits") })
}

/// An i32 size argument, or an error naming it.
fn size_i32(family: &'static str, what: &str, v: usize) -> Result<i32, KernelError> {
    i32::try_from(v).map_err(|_| KernelError::Size { family, what: format!("{what} {v} does not fit 31 bits") })
}
