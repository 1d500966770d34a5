//! Where tensors live: `cpu`, or `cuda[:N]` (the N-th NVIDIA GPU through candle's CUDA backend,
//! in a build with the `cuda` feature). The one parser of the `--device` flags.

use candle_core::Device;

use crate::error::{ModelError, Result};

/// Whether this build can run on CUDA devices (the `cuda` cargo feature).
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// Parse `cpu`, `cuda` (= `cuda:0`) or `cuda:N` into a device, opening the GPU. Errors name the
/// flag's value and say why: an unknown name, a build without CUDA, or no such GPU.
pub fn parse(spec: &str) -> Result<Device> {
    let bad = |reason: String| ModelError::config("device", spec, reason);
    let ordinal = match spec {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => 0,
        s => match s.strip_prefix("cuda:") {
            Some(n) => n.parse::<usize>().map_err(|_| bad("the GPU number after cuda: is not a number".into()))?,
            None => return Err(bad("expected cpu, cuda or cuda:N".into())),
        },
    };
    if !CUDA_BUILT {
        return Err(bad("this build has no CUDA support (build with ../shared/gpu/cargo-cuda build --release --features cuda)".into()));
    }
    let device = Device::new_cuda(ordinal).map_err(|e| bad(format!("cannot open GPU {ordinal}: {e}")))?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = &device {
        // Safety: every tensor of this process is used on candle's one stream of the device, so
        // cudarc's per-buffer events (two event records around every kernel) guard nothing; they
        // cost about as much as a small kernel's launch.
        unsafe { d.disable_event_tracking() };
    }
    Ok(device)
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
        }
    }
}
