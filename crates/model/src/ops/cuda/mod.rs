//! Lazarus's own CUDA kernels (`kernels.cu`, compiled to PTX by build.rs in a `cuda` build) and
//! their launchers. Each replaces a chain of candle ops whose launches, not arithmetic, were the
//! cost on a GPU: AdamW's update (a dozen elementwise ops per tensor in candle) and the gradient
//! norm's sums of squares.
//!
//! The launchers read the tensors' device buffers through candle's storage and write some of them
//! in place (AdamW's parameter and moments). That is sound here because every tensor of a process
//! lives on candle's one stream of its device (see [`crate::device::parse`]): a kernel launched
//! on that stream is ordered after every op that produced its inputs and before every later one.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Storage, Tensor};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));
const MODULE: &str = "lazarus_kernels";

/// Call `f` with the f32 device buffer of each contiguous f32 CUDA tensor, and its device.
fn with_buffers<R>(
    tensors: &[&Tensor],
    f: impl FnOnce(
        &candle_core::cuda_backend::CudaDevice,
        &[candle_core::cuda_backend::cudarc::driver::CudaView<'_, f32>],
    ) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let mut views = Vec::with_capacity(tensors.len());
    let mut device = None;
    for (storage, layout) in &guards {
        let Storage::Cuda(cs) = &**storage else { candle_core::bail!("lazarus cuda kernel: a tensor not on a GPU") };
        if cs.dtype() != DType::F32 {
            candle_core::bail!("lazarus cuda kernel: an f32 tensor, not {:?}", cs.dtype());
        }
        let Some((a, b)) = layout.contiguous_offsets() else { candle_core::bail!("lazarus cuda kernel: a contiguous tensor") };
        views.push(cs.as_cuda_slice::<f32>()?.slice(a..b));
        device.get_or_insert_with(|| cs.device().clone());
    }
    let Some(device) = device else { candle_core::bail!("lazarus cuda kernel: no tensors") };
    f(&device, &views)
}

/// The AdamW coefficients of one tensor's update, in the kernel's argument order:
/// b1, b2, scale, step_size, inv_bc2_sqrt, eps, keep.
pub type AdamWScalars = [f32; 7];

/// AdamW's update of the f32 parameter `p` in place, with gradient `g` and moments `m`, `v`
/// (all contiguous, f32, on one GPU, of one size), in one kernel.
pub fn adamw_update(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, k: AdamWScalars) -> candle_core::Result<()> {
    let n = p.elem_count();
    if [g, m, v].iter().any(|t| t.elem_count() != n) {
        candle_core::bail!("adamw: {n} parameters, gradient {}, moments {} and {}", g.elem_count(), m.elem_count(), v.elem_count());
    }
    if n == 0 {
        return Ok(());
    }
    with_buffers(&[p, g, m, v], |dev, b| {
        let func = dev.get_or_load_custom_func("lazarus_adamw_f32", MODULE, PTX)?;
        let mut args = func.builder();
        for view in b {
            args.arg(view);
        }
        let n = n as u64;
        args.arg(&n);
        for x in &k {
            args.arg(x);
        }
        let blocks = n.div_ceil(256).min(4096) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // Safety: the argument list matches the kernel's signature; the kernel stays within n.
        unsafe { args.launch(cfg) }.w()?;
        Ok(())
    })
}

/// Σ x² of each f32 tensor (contiguous, on one GPU), in f64: one launch per tensor, one copy of
/// the sums to the host.
pub fn sum_squares(tensors: &[&Tensor]) -> candle_core::Result<Vec<f64>> {
    if tensors.is_empty() {
        return Ok(Vec::new());
    }
    with_buffers(tensors, |dev, b| {
        let func = dev.get_or_load_custom_func("lazarus_sum_squares_f32", MODULE, PTX)?;
        let out = dev.alloc_zeros::<f64>(b.len())?;
        for (slot, view) in b.iter().enumerate() {
            let mut args = func.builder();
            let (n, slot) = (view.len() as u64, slot as u32);
            args.arg(view);
            args.arg(&n);
            args.arg(&out);
            args.arg(&slot);
            let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
            // Safety: as above; slot < out.len().
            unsafe { args.launch(cfg) }.w()?;
        }
        dev.clone_dtoh(&out)
    })
}

/// An elementwise kernel `{kernel}_float` / `{kernel}_double` (x → y, n elements) over a
/// contiguous f32 or f64 storage: the `cuda_fwd` of the fused elementwise ops.
pub fn map_elementwise(
    storage: &candle_core::CudaStorage,
    layout: &candle_core::Layout,
    kernel: &str,
) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
    use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
    fn run<T: candle_core::cuda_backend::CudaDType + DeviceRepr>(
        storage: &candle_core::CudaStorage,
        a: usize,
        b: usize,
        name: &str,
    ) -> candle_core::Result<candle_core::CudaStorage> {
        let dev = storage.device().clone();
        let x = storage.as_cuda_slice::<T>()?.slice(a..b);
        let n = (b - a) as u64;
        // Safety: every element is written by the kernel before it is read.
        let y = unsafe { dev.alloc::<T>(b - a) }?;
        if n > 0 {
            let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
            let mut args = func.builder();
            args.arg(&x);
            args.arg(&y);
            args.arg(&n);
            let blocks = n.div_ceil(256).min(8192) as u32;
            let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // Safety: (x, y, n) is the kernel's signature; it stays within n.
            unsafe { args.launch(cfg) }.w()?;
        }
        Ok(candle_core::CudaStorage::wrap_cuda_slice(y, dev))
    }
    let Some((a, b)) = layout.contiguous_offsets() else { candle_core::bail!("{kernel}: input must be contiguous") };
    let out = match storage.dtype() {
        DType::F32 => run::<f32>(storage, a, b, &format!("{kernel}_float"))?,
        DType::F64 => run::<f64>(storage, a, b, &format!("{kernel}_double"))?,
        other => candle_core::bail!("{kernel}: only f32 and f64 are supported, not {other:?}"),
    };
    Ok((out, layout.shape().clone()))
}
