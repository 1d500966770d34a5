//! The layers on NVIDIA GPUs: Lazarus's own kernels (`lazarus-kernels`) and cuBLAS, as candle
//! autograd nodes. Each layer's forward and backward is an op of `lazarus_kernels::ops`, run here
//! on [`Gpu`] — candle's CUDA device for memory and launches, its cuBLAS handle for the matrix
//! products — and its buffers wrapped as candle tensors. The same ops run on the emulator in the
//! tests (`ops/emulated.rs`), against the CPU kernels.
//!
//! Every tensor of a process lives on candle's one stream of its device (see
//! [`crate::device::parse`]): a kernel launched on that stream is ordered after every op that
//! produced its inputs and before every later one, so the launches read and write device memory
//! by address without further synchronisation, and a buffer dropped after its last launch was
//! issued is freed in stream order.
//!
//! `LAZARUS_GPU_KERNELS=composite` turns the layers back to candle's composite ops (the oracle the
//! GPU tests compare against, and the "before" of the benchmarks).

mod attention;
mod ffn;
mod lt;
mod norm;
mod rows;

pub use attention::{causal_attention, rope, supported as attention_supported};
pub use ffn::{gelu, grouped_expert_ffn_to_sink, linear_to, swiglu};
pub use norm::{cross_entropy, layer_norm_to, rms_norm_to, softmax_last};
pub use rows::{combine_rows_to, embed, gather_rows};

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::{result::gemm_ex, sys as blas};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Shape, Storage, Tensor};
use lazarus_kernels::{Arg, Device, Dtype, Elem, Gemm, KernelError, Launch, MODULE, PTX};

/// Whether the layers run Lazarus's kernels on a GPU: `LAZARUS_GPU_KERNELS` is not `composite`
/// (read once per process) and the calling thread is not inside [`composite`].
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("LAZARUS_GPU_KERNELS").map_or(true, |v| v != "composite")) && !COMPOSITE.with(|c| c.get())
}

thread_local! {
    static COMPOSITE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Run `f` with candle's composite ops in place of the GPU kernels on this thread (a model built
/// inside takes the composite path for good): the oracle of the GPU tests.
pub fn composite<R>(f: impl FnOnce() -> R) -> R {
    let before = COMPOSITE.with(|c| c.replace(true));
    let r = f();
    COMPOSITE.with(|c| c.set(before));
    r
}

/// Whether `t` is a CUDA tensor of a type the kernels take, with the kernels on.
pub fn takes(t: &Tensor) -> bool {
    t.device().is_cuda() && enabled() && matches!(t.dtype(), DType::F32 | DType::F64 | DType::BF16)
}

/// The CPU forward of a GPU op: an error (the public functions route CPU tensors elsewhere).
pub(crate) fn not_on_cpu(name: &str) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
    candle_core::bail!("{name}: a GPU op given CPU tensors")
}

/// The kernels' type of a candle dtype.
pub(crate) fn dtype_of(d: DType) -> candle_core::Result<Dtype> {
    match d {
        DType::F32 => Ok(Dtype::F32),
        DType::F64 => Ok(Dtype::F64),
        DType::BF16 => Ok(Dtype::Bf16),
        other => candle_core::bail!("lazarus gpu kernels: no kernels for {other:?}"),
    }
}

/// A device buffer of one element type.
pub(crate) enum CudaBuf {
    F32(CudaSlice<f32>),
    F64(CudaSlice<f64>),
    Bf16(CudaSlice<half::bf16>),
    U32(CudaSlice<u32>),
    U64(CudaSlice<u64>),
}

/// What went wrong on the GPU, as candle's error (for `?` in candle's ops).
#[derive(Debug)]
pub(crate) struct GpuError(candle_core::Error);

impl From<KernelError> for GpuError {
    fn from(e: KernelError) -> Self {
        GpuError(candle_core::Error::Msg(e.to_string()))
    }
}

impl From<candle_core::Error> for GpuError {
    fn from(e: candle_core::Error) -> Self {
        GpuError(e)
    }
}

impl From<GpuError> for candle_core::Error {
    fn from(e: GpuError) -> Self {
        e.0
    }
}

/// candle's CUDA device (its stream, its memory pool, its cuBLAS handle) as a
/// `lazarus_kernels::Device`.
#[derive(Clone)]
pub(crate) struct Gpu {
    pub dev: CudaDevice,
}

impl Gpu {
    /// The device of a CUDA tensor.
    pub fn of(t: &Tensor) -> candle_core::Result<Gpu> {
        match t.device() {
            candle_core::Device::Cuda(dev) => Ok(Gpu { dev: dev.clone() }),
            _ => candle_core::bail!("lazarus gpu kernels: a tensor not on a GPU"),
        }
    }

    /// The device of a CUDA storage.
    pub fn of_storage(s: &CudaStorage) -> Gpu {
        Gpu { dev: s.device().clone() }
    }

    /// A buffer as a tensor of `shape` (a float buffer; the shape's elements at most its own).
    pub fn tensor(&self, buf: CudaBuf, shape: impl Into<Shape>) -> candle_core::Result<Tensor> {
        let storage = self.storage(buf)?;
        Ok(Tensor::from_storage(Storage::Cuda(storage), shape, candle_core::op::BackpropOp::none(), false))
    }

    /// `n` elements of `elem` (one at least: a zero-sized allocation has no address to pass),
    /// zeroed or not.
    fn buffer(&self, elem: Elem, n: usize, zeroed: bool) -> Result<CudaBuf, GpuError> {
        use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, ValidAsZeroBits};
        fn slice<T: DeviceRepr + ValidAsZeroBits>(dev: &CudaDevice, n: usize, zeroed: bool) -> candle_core::Result<CudaSlice<T>> {
            match zeroed {
                true => dev.alloc_zeros::<T>(n),
                // SAFETY: every op writes its buffers before it reads them (lazarus_kernels::Device).
                false => unsafe { dev.alloc::<T>(n) },
            }
        }
        let (d, n) = (&self.dev, n.max(1));
        Ok(match elem {
            Elem::Float(Dtype::F32) => CudaBuf::F32(slice(d, n, zeroed)?),
            Elem::Float(Dtype::F64) => CudaBuf::F64(slice(d, n, zeroed)?),
            Elem::Float(Dtype::Bf16) => CudaBuf::Bf16(slice(d, n, zeroed)?),
            Elem::U32 => CudaBuf::U32(slice(d, n, zeroed)?),
            Elem::U64 => CudaBuf::U64(slice(d, n, zeroed)?),
        })
    }

    /// A float buffer as candle's storage.
    pub fn storage(&self, buf: CudaBuf) -> candle_core::Result<CudaStorage> {
        let d = self.dev.clone();
        Ok(match buf {
            CudaBuf::F32(s) => CudaStorage::wrap_cuda_slice(s, d),
            CudaBuf::F64(s) => CudaStorage::wrap_cuda_slice(s, d),
            CudaBuf::Bf16(s) => CudaStorage::wrap_cuda_slice(s, d),
            CudaBuf::U32(s) => CudaStorage::wrap_cuda_slice(s, d),
            CudaBuf::U64(_) => candle_core::bail!("lazarus gpu kernels: an address buffer is not a tensor"),
        })
    }
}

/// The device address of a contiguous CUDA storage's first element under `layout`.
pub(crate) fn storage_addr(s: &CudaStorage, layout: &Layout) -> candle_core::Result<u64> {
    let Some((start, _)) = layout.contiguous_offsets() else { candle_core::bail!("lazarus gpu kernels: a contiguous input") };
    let stream = s.device().cuda_stream();
    let (base, size) = match &s.slice {
        CudaStorageSlice::F32(x) => (x.device_ptr(&stream).0, 4),
        CudaStorageSlice::F64(x) => (x.device_ptr(&stream).0, 8),
        CudaStorageSlice::BF16(x) => (x.device_ptr(&stream).0, 2),
        CudaStorageSlice::U32(x) => (x.device_ptr(&stream).0, 4),
        _ => candle_core::bail!("lazarus gpu kernels: no kernels for {:?}", s.dtype()),
    };
    Ok(base + (start * size) as u64)
}

/// The device address of a contiguous CUDA tensor's first element. The tensor must outlive the
/// work issued with it (in stream order: until that work is issued).
pub(crate) fn addr(t: &Tensor) -> candle_core::Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else { candle_core::bail!("lazarus gpu kernels: a tensor not on a GPU") };
    storage_addr(s, layout)
}

impl Device for Gpu {
    type Buffer = CudaBuf;
    type Error = GpuError;

    fn alloc(&self, elem: Elem, n: usize) -> Result<CudaBuf, GpuError> {
        self.buffer(elem, n, false)
    }

    fn zeros(&self, elem: Elem, n: usize) -> Result<CudaBuf, GpuError> {
        self.buffer(elem, n, true)
    }

    fn upload_u32(&self, v: &[u32]) -> Result<CudaBuf, GpuError> {
        Ok(CudaBuf::U32(self.dev.clone_htod(if v.is_empty() { &[0u32][..] } else { v })?))
    }

    fn upload_u64(&self, v: &[u64]) -> Result<CudaBuf, GpuError> {
        Ok(CudaBuf::U64(self.dev.clone_htod(if v.is_empty() { &[0u64][..] } else { v })?))
    }

    fn addr(&self, b: &CudaBuf) -> u64 {
        let stream = self.dev.cuda_stream();
        match b {
            CudaBuf::F32(s) => s.device_ptr(&stream).0,
            CudaBuf::F64(s) => s.device_ptr(&stream).0,
            CudaBuf::Bf16(s) => s.device_ptr(&stream).0,
            CudaBuf::U32(s) => s.device_ptr(&stream).0,
            CudaBuf::U64(s) => s.device_ptr(&stream).0,
        }
    }

    unsafe fn launch(&self, l: &Launch) -> Result<(), GpuError> {
        let func = self.dev.get_or_load_custom_func(&l.kernel, MODULE, PTX)?;
        let mut b = func.builder();
        for a in &l.args {
            match a {
                Arg::Ptr(v) | Arg::U64(v) => b.arg(v),
                Arg::U32(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
                Arg::F64(v) => b.arg(v),
            };
        }
        let cfg = candle_core::cuda_backend::cudarc::driver::LaunchConfig {
            grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
            block_dim: (l.block[0], l.block[1], l.block[2]),
            shared_mem_bytes: l.shared_bytes,
        };
        // SAFETY: the argument list is the kernel's (checked against its parameters by the
        // emulated tests); the addresses are the caller's contract.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }

    /// cuBLAS on row-major matrices: C = op(A)·op(B) is computed as Cᵀ = op(B)ᵀ·op(A)ᵀ, each
    /// row-major matrix read as its transpose in column-major order. f32 and bf16 products go
    /// through cuBLASLt with an algorithm per shape class (`lt`), the rest (and a class cuBLASLt
    /// has no algorithm for) through GemmEx.
    unsafe fn gemm(&self, g: &Gemm) -> Result<(), GpuError> {
        g.check()?;
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        crate::profile::count_gemm();
        if g.ab != Dtype::F64 && lt::enabled() {
            let ordinal = self.dev.cuda_stream().context().ordinal();
            // SAFETY: checked above; the addresses are the caller's contract.
            if unsafe { lt::gemm(&self.dev, ordinal, g)? } {
                return Ok(());
            }
        }
        let cuda_type = |d: Dtype| match d {
            Dtype::F32 => blas::cudaDataType_t::CUDA_R_32F,
            Dtype::F64 => blas::cudaDataType_t::CUDA_R_64F,
            Dtype::Bf16 => blas::cudaDataType_t::CUDA_R_16BF,
        };
        let op = |t: bool| if t { blas::cublasOperation_t::CUBLAS_OP_T } else { blas::cublasOperation_t::CUBLAS_OP_N };
        let (a32, b32) = (g.alpha as f32, g.beta as f32);
        let (alpha, beta, compute) = if g.ab == Dtype::F64 {
            (
                &g.alpha as *const f64 as *const std::ffi::c_void,
                &g.beta as *const f64 as *const std::ffi::c_void,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_64F,
            )
        } else {
            (
                &a32 as *const f32 as *const std::ffi::c_void,
                &b32 as *const f32 as *const std::ffi::c_void,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        };
        let blas_handle = self.dev.cublas_handle();
        self.dev.cuda_stream().context().bind_to_thread().w()?;
        // SAFETY: the sizes and strides were checked to fit 31 bits and the matrices' widths;
        // the addresses are the caller's contract; alpha and beta outlive the call.
        unsafe {
            gemm_ex(
                *blas_handle.handle(),
                op(g.trans_b),
                op(g.trans_a),
                g.n as i32,
                g.m as i32,
                g.k as i32,
                alpha,
                g.b as *const std::ffi::c_void,
                cuda_type(g.ab),
                g.ldb as i32,
                g.a as *const std::ffi::c_void,
                cuda_type(g.ab),
                g.lda as i32,
                beta,
                g.cptr as *mut std::ffi::c_void,
                cuda_type(g.c),
                g.ldc as i32,
                compute,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| GpuError(candle_core::Error::Msg(format!("cuBLAS GemmEx {g:?}: {e:?}"))))?;
        Ok(())
    }
}

/// The AdamW coefficients of one tensor's update, in the kernel's argument order:
/// b1, b2, scale, step_size, inv_bc2_sqrt, eps, keep.
pub type AdamWScalars = lazarus_kernels::AdamWScalars;

/// AdamW's update of the f32 parameter `p` in place, with gradient `g` and moments `m`, `v` (all
/// contiguous, f32, on one GPU, of one size), in one kernel; `copy` (bf16, the same size), when
/// given, gets the new parameter: the working copy a bf16 matrix product reads.
pub fn adamw_update(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, copy: Option<&Tensor>, k: AdamWScalars) -> candle_core::Result<()> {
    let t = adamw_record(p, g, m, v, copy, k)?;
    if t.n == 0 {
        return Ok(());
    }
    let gpu = Gpu::of(p)?;
    // SAFETY: five buffers of n elements each (checked by `adamw_record`), on one device.
    unsafe { gpu.launch(&lazarus_kernels::adamw(t.p, t.g, t.m, t.v, t.copy, t.n, t.k))? };
    Ok(())
}

/// One tensor's update as the kernels take it, its operands checked: one size, f32 (a bf16
/// copy), all on p's GPU.
fn adamw_record(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    copy: Option<&Tensor>,
    k: AdamWScalars,
) -> candle_core::Result<lazarus_kernels::AdamWTensor> {
    let n = p.elem_count();
    if [g, m, v].into_iter().chain(copy).any(|t| t.elem_count() != n) {
        candle_core::bail!("adamw: {n} parameters, gradient {}, moments {} and {}", g.elem_count(), m.elem_count(), v.elem_count());
    }
    if [p, g, m, v].iter().any(|t| t.dtype() != DType::F32) || copy.is_some_and(|c| c.dtype() != DType::BF16) {
        candle_core::bail!("adamw: f32 parameter, gradient and moments (and a bf16 working copy)");
    }
    if [g, m, v].into_iter().chain(copy).any(|t| !t.device().same_device(p.device())) {
        candle_core::bail!("adamw: every tensor of the update on one GPU");
    }
    let copy = match copy {
        Some(c) => addr(c)?,
        None => 0,
    };
    Ok(lazarus_kernels::AdamWTensor { p: addr(p)?, g: addr(g)?, m: addr(m)?, v: addr(v)?, copy, n, k })
}

/// One tensor's AdamW update for [`adamw_update_all`]: as [`adamw_update`]'s arguments.
pub struct AdamWUpdate {
    pub p: Tensor,
    pub g: Tensor,
    pub m: Tensor,
    pub v: Tensor,
    pub copy: Option<Tensor>,
    pub k: AdamWScalars,
}

/// Every update of the list, as [`adamw_update`] would make them one by one, in one launch (a
/// model's hundreds of tensors were as many launches). `LAZARUS_ADAMW=per-tensor` (read once)
/// launches one kernel per tensor instead: the "before" of the benchmarks.
pub fn adamw_update_all(updates: &[AdamWUpdate]) -> candle_core::Result<()> {
    static PER_TENSOR: OnceLock<bool> = OnceLock::new();
    if *PER_TENSOR.get_or_init(|| std::env::var("LAZARUS_ADAMW").is_ok_and(|v| v == "per-tensor")) {
        for u in updates {
            adamw_update(&u.p, &u.g, &u.m, &u.v, u.copy.as_ref(), u.k)?;
        }
        return Ok(());
    }
    let Some(first) = updates.first() else { return Ok(()) };
    let gpu = Gpu::of(&first.p)?;
    let mut list = Vec::with_capacity(updates.len());
    for u in updates {
        if !u.p.device().same_device(first.p.device()) {
            candle_core::bail!("adamw: every tensor of the update on one GPU");
        }
        list.push(adamw_record(&u.p, &u.g, &u.m, &u.v, u.copy.as_ref(), u.k)?);
    }
    // SAFETY: each record's buffers hold n elements of their types on this GPU (checked above);
    // each update is a different parameter with its own moments and copy (the optimizer's list).
    unsafe { lazarus_kernels::ops::adamw_all(&gpu, &list)? };
    Ok(())
}

/// Σ x² of each f32 tensor (contiguous, on one GPU), in f64: every block of the device on a
/// fixed part of a tensor, then one block per tensor adding its parts in order; one copy of the
/// sums to the host.
pub fn sum_squares(tensors: &[&Tensor]) -> candle_core::Result<Vec<f64>> {
    let _p = crate::profile::kernel("sum-squares");
    let Some(first) = tensors.first() else { return Ok(Vec::new()) };
    let gpu = Gpu::of(first)?;
    let mut list = Vec::with_capacity(tensors.len());
    for t in tensors {
        if t.dtype() != DType::F32 {
            candle_core::bail!("sum of squares: an f32 tensor, not {:?}", t.dtype());
        }
        list.push((addr(t)?, t.elem_count()));
    }
    match lazarus_kernels::ops::sum_squares(&gpu, &list)? {
        CudaBuf::F64(out) => {
            let mut sums = gpu.dev.clone_dtoh(&out)?;
            sums.truncate(tensors.len());
            Ok(sums)
        }
        _ => candle_core::bail!("sum of squares: f64 sums"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_switch_reads_the_environment_once() {
        // Whatever the environment, two reads agree.
        assert_eq!(super::enabled(), super::enabled());
    }
}
