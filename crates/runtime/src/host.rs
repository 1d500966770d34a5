//! Host views of tensors: a CPU tensor's f32 values lent straight from its storage, so a
//! gradient or an expert's state reaches the wire with one copy instead of two.

use candle_core::Tensor;

use crate::error::RuntimeError;

/// Call `f` with `t`'s f32 values in row-major order: borrowed from its storage when it is a
/// contiguous f32 CPU tensor, copied out otherwise.
pub(crate) fn with_host_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R, RuntimeError> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) = (&*storage, layout.contiguous_offsets()) {
            return Ok(f(&v[a..b]));
        }
    }
    let v = t.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&v))
}
