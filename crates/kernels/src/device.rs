//! What an op needs of a device: memory, kernel launches and matrix products.

use crate::{Dtype, KernelError, Launch};

/// An element type of a buffer: a float the kernels compute with, or an index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    Float(Dtype),
    U32,
    U64,
}

impl Elem {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Elem::Float(d) => d.size(),
            Elem::U32 => 4,
            Elem::U64 => 8,
        }
    }
}

impl From<Dtype> for Elem {
    fn from(d: Dtype) -> Self {
        Elem::Float(d)
    }
}

/// One matrix product, row-major: C = alpha · op(A) · op(B) + beta · C with op(A) m × k and op(B)
/// k × n. A is stored m × k (row stride `lda`), or k × m when `trans_a` (op(A) = Aᵀ); B likewise
/// k × n or n × k; C m × n with row stride `ldc`. A and B of `ab`, C of `c`; products summed in f32
/// (f64 for f64).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemm {
    pub ab: Dtype,
    pub c: Dtype,
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: u64,
    pub lda: usize,
    pub b: u64,
    pub ldb: usize,
    pub cptr: u64,
    pub ldc: usize,
    pub alpha: f64,
    pub beta: f64,
}

impl Gemm {
    /// C [m, n] = A [m, k] · B [k, n] (beta 0), every matrix dense row-major.
    #[allow(clippy::too_many_arguments)]
    pub fn plain(ab: Dtype, c: Dtype, m: usize, n: usize, k: usize, a: u64, b: u64, cptr: u64) -> Gemm {
        Gemm { ab, c, trans_a: false, trans_b: false, m, n, k, a, lda: k, b, ldb: n, cptr, ldc: n, alpha: 1.0, beta: 0.0 }
    }

    /// Whether the element types have a product: (f32, f32), (f64, f64), (bf16, bf16) or (bf16,
    /// f32).
    pub fn check(&self) -> Result<(), KernelError> {
        let ok = matches!(
            (self.ab, self.c),
            (Dtype::F32, Dtype::F32) | (Dtype::F64, Dtype::F64) | (Dtype::Bf16, Dtype::Bf16) | (Dtype::Bf16, Dtype::F32)
        );
        if !ok {
            return Err(KernelError::Types { family: "gemm", what: format!("{:?} operands into {:?}", self.ab, self.c) });
        }
        // Row widths of A and B as stored.
        let cols_a = if self.trans_a { self.m } else { self.k };
        let cols_b = if self.trans_b { self.k } else { self.n };
        if self.lda < cols_a.max(1) || self.ldb < cols_b.max(1) || self.ldc < self.n.max(1) {
            return Err(KernelError::Size {
                family: "gemm",
                what: format!("row strides {} {} {} below the widths {cols_a} {cols_b} {}", self.lda, self.ldb, self.ldc, self.n),
            });
        }
        for (what, v) in [("m", self.m), ("n", self.n), ("k", self.k), ("lda", self.lda), ("ldb", self.ldb), ("ldc", self.ldc)] {
            if v > i32::MAX as usize {
                return Err(KernelError::Size { family: "gemm", what: format!("{what} {v} does not fit 31 bits") });
            }
        }
        Ok(())
    }
}

/// A device the [ops](crate::ops) run on: the GPU (candle's CUDA device and cuBLAS, in
/// `lazarus-model`) or the [emulator](crate::emulator::Emulator). Work is ordered: every launch
/// and product runs after those before it, and a buffer may be dropped as soon as the last work
/// that reads it has been issued (the device keeps it until that work is done).
pub trait Device {
    type Buffer;
    type Error: From<KernelError>;

    /// `n` elements, their values unspecified: every op writes a buffer before it reads it.
    fn alloc(&self, elem: Elem, n: usize) -> Result<Self::Buffer, Self::Error>;

    /// `n` elements, every one zero.
    fn zeros(&self, elem: Elem, n: usize) -> Result<Self::Buffer, Self::Error>;

    /// A buffer holding `v`.
    fn upload_u32(&self, v: &[u32]) -> Result<Self::Buffer, Self::Error>;

    /// A buffer holding `v`.
    fn upload_u64(&self, v: &[u64]) -> Result<Self::Buffer, Self::Error>;

    /// The buffer's device address.
    fn addr(&self, b: &Self::Buffer) -> u64;

    /// Run a kernel.
    ///
    /// # Safety
    /// Every [`crate::Arg::Ptr`] addresses memory of this device holding what the kernel reads
    /// and writes there (the sizes its builder function documents).
    unsafe fn launch(&self, launch: &Launch) -> Result<(), Self::Error>;

    /// Run a matrix product.
    ///
    /// # Safety
    /// `a`, `b` and `cptr` address memory of this device holding the matrices the product reads
    /// and writes (with their strides).
    unsafe fn gemm(&self, g: &Gemm) -> Result<(), Self::Error>;

    /// Run every launch in order.
    ///
    /// # Safety
    /// As [`Device::launch`], for each.
    unsafe fn launch_all(&self, launches: &[Launch]) -> Result<(), Self::Error> {
        for l in launches {
            // SAFETY: forwarded from the caller.
            unsafe { self.launch(l)? };
        }
        Ok(())
    }
}
