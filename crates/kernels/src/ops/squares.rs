//! The gradient norm's sums of squares.

use super::alloc;
use crate::{squares_parts, sum_parts, sum_squares_parts, Device, Elem, KernelError};

/// Σ x² of each f32 tensor (address, elements), in f64, one per tensor in a buffer: every block
/// sums a fixed part of one tensor, then one block per tensor adds its parts in order — the same
/// bits on every run, and the whole device busy on the large tensors.
pub fn sum_squares<D: Device>(dev: &D, tensors: &[(u64, usize)]) -> Result<D::Buffer, D::Error> {
    let mut starts = Vec::with_capacity(tensors.len() + 1);
    let mut total = 0usize;
    starts.push(0u32);
    for &(_, n) in tensors {
        total += squares_parts(n);
        starts.push(u32::try_from(total).map_err(|_| KernelError::Size { family: "sum of squares", what: format!("{total} parts") })?);
    }
    let out = alloc(dev, Elem::Float(crate::Dtype::F64), tensors.len())?;
    if tensors.is_empty() {
        return Ok(out);
    }
    let parts = alloc(dev, Elem::Float(crate::Dtype::F64), total)?;
    for (t, &(x, n)) in tensors.iter().enumerate() {
        // SAFETY: x holds n f32; its parts' slots lie in the buffer (starts[t] + parts ≤ total).
        unsafe { dev.launch(&sum_squares_parts(x, n, dev.addr(&parts), starts[t]))? };
    }
    let st = dev.upload_u32(&starts)?;
    // SAFETY: parts holds `total` sums, starts tensors + 1 offsets, out a sum per tensor.
    unsafe { dev.launch(&sum_parts(dev.addr(&parts), dev.addr(&st), dev.addr(&out), tensors.len()))? };
    Ok(out)
}
