//! Where tensors live: `cpu`, or `cuda[:N]` (the N-th NVIDIA GPU through candle's CUDA backend,
//! in a build with the `cuda` feature). The one parser of the `--device` flags.

use candle_core::Device;

use crate::error::{ModelError, Result};

/// Whether this build can run on CUDA devices (the `cuda` cargo feature).
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// Check a `--device` value without opening anything: `cpu` (None), or the GPU number of `cuda`
/// (0) or `cuda:N` in a build with CUDA. Errors name the value and say why.
pub fn check(spec: &str) -> Result<Option<usize>> {
    let bad = |reason: String| ModelError::config("device", spec, reason);
    let ordinal = match spec {
        "cpu" => return Ok(None),
        "cuda" => 0,
        s => match s.strip_prefix("cuda:") {
            Some(n) => n.parse::<usize>().map_err(|_| bad("the GPU number after cuda: is not a number".into()))?,
            None => return Err(bad("expected cpu, cuda or cuda:N".into())),
        },
    };
    if !CUDA_BUILT {
        return Err(bad("this build has no CUDA support (build with scripts/cargo-cuda build --release --features cuda)".into()));
    }
    Ok(Some(ordinal))
}

/// Parse `cpu`, `cuda` (= `cuda:0`) or `cuda:N` into a device, opening the GPU. Errors name the
/// flag's value and say why: an unknown name, a build without CUDA, or no such GPU.
pub fn parse(spec: &str) -> Result<Device> {
    let bad = |reason: String| ModelError::config("device", spec, reason);
    let Some(ordinal) = check(spec)? else { return Ok(Device::Cpu) };
    let device = Device::new_cuda(ordinal).map_err(|e| bad(format!("cannot open GPU {ordinal}: {e}")))?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = &device {
        // Safety: every tensor of this process is used on candle's one stream of the device, so
        // cudarc's per-buffer events (two event records around every kernel) guard nothing; they
        // cost about as much as a small kernel's launch.
        unsafe { d.disable_event_tracking() };
        keep_pool(d).map_err(|e| bad(format!("cannot set GPU {ordinal}'s memory pool to keep what it holds: {e}")))?;
    }
    Ok(device)
}

/// What the device's memory pool does with memory freed by tensors, from `LAZARUS_GPU_POOL`:
/// `keep` (the default) holds it for the next allocation; `trim` is the driver's default, which
/// hands it back to the driver at every synchronisation.
///
/// Why keep: a training step synchronises several times (the routing counts of every MoE layer,
/// the loss, the gradient norm), and with the driver's default each of those unmaps every freed
/// buffer, so the next step's allocations map the same memory again — host time on every
/// allocation of every step. PyTorch's caching allocator never gives memory back either. The
/// cost: the process holds its high-water mark (`GpuMemory::reserved`) until it exits.
#[cfg(feature = "cuda")]
fn keep_pool(d: &candle_core::CudaDevice) -> std::result::Result<(), String> {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    let keep = match std::env::var("LAZARUS_GPU_POOL").as_deref() {
        Ok("trim") => return Ok(()),
        Ok("keep") | Err(_) => u64::MAX,
        Ok(other) => return Err(format!("LAZARUS_GPU_POOL={other}: expected keep or trim")),
    };
    let ctx = d.cuda_stream().context().clone();
    ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    let mut threshold = keep;
    // Safety: the device's default pool (the one cudarc's stream-ordered allocations use); the
    // release threshold is a 64-bit byte count.
    unsafe {
        let pool = result::device::get_default_mem_pool(ctx.cu_device()).map_err(|e| format!("{e:?}"))?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
        .map_err(|e| format!("{e:?}"))
    }
}

/// The device of a worker from the job's `--device`: `cpu`; `cuda:N` exactly; `cuda` the
/// `local`-th worker of its node on GPU `local mod (visible GPUs)` (CUDA_VISIBLE_DEVICES
/// decides which are visible; several workers may share one GPU).
pub fn for_worker(spec: &str, local: usize) -> Result<Device> {
    if spec != "cuda" {
        return parse(spec);
    }
    let count = visible_gpus().map_err(|reason| ModelError::config("device", spec, reason))?;
    if count == 0 {
        return Err(ModelError::config("device", spec, "no GPU is visible to this process (CUDA_VISIBLE_DEVICES?)"));
    }
    parse(&format!("cuda:{}", local % count))
}

/// GPUs visible to this process (0 in a build without CUDA).
pub fn visible_gpus() -> std::result::Result<usize, String> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::result;
        result::init().map_err(|e| format!("cannot start the CUDA driver: {e:?}"))?;
        result::device::get_count().map(|c| c.max(0) as usize).map_err(|e| format!("cannot count the GPUs: {e:?}"))
    }
    #[cfg(not(feature = "cuda"))]
    {
        Ok(0)
    }
}

/// GPU memory of this process's tensors, from the device's memory pool (every tensor of candle's
/// CUDA backend is allocated from it), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct GpuMemory {
    /// In use by live tensors now.
    pub used: u64,
    /// The most in use at once so far: the peak a run needs.
    pub used_peak: u64,
    /// Held by the pool now (in use, or freed and kept for reuse).
    pub reserved: u64,
}

impl std::fmt::Display for GpuMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        write!(f, "{:.2} GiB at most in use by tensors, {:.2} GiB held by the pool", gib(self.used_peak), gib(self.reserved))
    }
}

/// [`GpuMemory`] of `device` (None on the CPU, or where the driver does not say).
pub fn gpu_memory(device: &Device) -> Option<GpuMemory> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        use candle_core::cuda_backend::cudarc::driver::{result, sys};
        let stream = d.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread().ok()?;
        let attr = |a: sys::CUmemPool_attribute| -> Option<u64> {
            let mut value = 0u64;
            // Safety: the pool is the device's default pool; these attributes are 64-bit counts.
            unsafe {
                let pool = result::device::get_default_mem_pool(ctx.cu_device()).ok()?;
                result::mem_pool::get_attribute(pool, a, &mut value as *mut u64 as *mut std::ffi::c_void).ok()?;
            }
            Some(value)
        };
        return Some(GpuMemory {
            used: attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            used_peak: attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            reserved: attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
        });
    }
    let _ = device;
    None
}

/// How a device is written on the command line (the inverse of [`parse`]).
pub fn name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_flags_parse_or_say_why_not() {
        assert!(parse("cpu").unwrap().is_cpu());
        assert_eq!(name(&parse("cpu").unwrap()), "cpu");
        for (spec, why) in [("gpu", "expected cpu, cuda or cuda:N"), ("cuda:x", "not a number"), ("cuda:-1", "not a number")] {
            let e = parse(spec).unwrap_err().to_string();
            assert!(e.contains("device") && e.contains(spec) && e.contains(why), "{e}");
        }
        if !CUDA_BUILT {
            let e = parse("cuda:0").unwrap_err().to_string();
            assert!(e.contains("no CUDA support"), "{e}");
            let e = for_worker("cuda", 3).unwrap_err().to_string();
            assert!(e.contains("device") && e.contains("no GPU is visible"), "{e}");
        }
        assert!(for_worker("cpu", 5).unwrap().is_cpu());
    }
}
