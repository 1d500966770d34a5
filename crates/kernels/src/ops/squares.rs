//! The gradient norm's sums of squares.

use super::alloc;
use crate::{squares_parts, sum_parts, sum_squares_parts, Device, Elem, KernelError};

/// Σ x² of each f32 tensor (address, elements), in f64, one per tensor in a buffer: every block
/// sums a fixed part of one tensor (one launch for the whole list), then one block per tensor adds
/// its parts in order — the same bits on every run, and the whole device busy on the large tensors.
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
    let tensors_u32 = u32::try_from(tensors.len())
        .map_err(|_| KernelError::Size { family: "sum of squares", what: format!("{} tensors", tensors.len()) })?;
    let addrs = dev.upload_u64(&tensors.iter().map(|&(x, _)| x).collect::<Vec<_>>())?;
    let lens = dev.upload_u64(&tensors.iter().map(|&(_, n)| n as u64).collect::<Vec<_>>())?;
    let st = dev.upload_u32(&starts)?;
    let l = sum_squares_parts(dev.addr(&addrs), dev.addr(&lens), dev.addr(&st), tensors_u32 as usize, total, dev.addr(&parts));
    // SAFETY: each address holds its length of f32; starts has tensors + 1 entries ending at
    // total, the number of parts' slots.
    unsafe { dev.launch(&l)? };
    // SAFETY: parts holds `total` sums, starts tensors + 1 offsets, out a sum per tensor.
    unsafe { dev.launch(&sum_parts(dev.addr(&parts), dev.addr(&st), dev.addr(&out), tensors.len()))? };
    Ok(out)
}
