//! Causal attention, flash-style, and the rotary positions turned on its queries and keys.

use super::alloc;
use crate::{AttentionKernels, Device, Dtype, Heads};

/// y [b, t, heads·dh] and each query row's log-sum-exp (b·heads·t, the accumulator type) from
/// the packed qkv [b, t, 3·heads·dh].
pub fn attention_fwd<D: Device>(
    dev: &D,
    kernels: AttentionKernels,
    dt: Dtype,
    qkv: u64,
    h: Heads,
) -> Result<(D::Buffer, D::Buffer), D::Error> {
    let y = alloc(dev, dt, h.elements())?;
    let lse = alloc(dev, dt.acc(), h.rows())?;
    if h.elements() > 0 {
        let l = crate::attention_fwd(kernels, dt, qkv, dev.addr(&y), dev.addr(&lse), h)?;
        // SAFETY: qkv is [b, t, 3·heads·dh]; y and lse are allocated to their sizes above.
        unsafe { dev.launch(&l)? };
    }
    Ok((y, lse))
}

/// dqkv [b, t, 3·heads·dh] from dy (the output's gradient), the forward's y and lse.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd<D: Device>(
    dev: &D,
    kernels: AttentionKernels,
    dt: Dtype,
    qkv: u64,
    y: u64,
    dy: u64,
    lse: u64,
    h: Heads,
) -> Result<D::Buffer, D::Error> {
    let dqkv = alloc(dev, dt, 3 * h.elements())?;
    if h.elements() > 0 {
        let dvec = alloc(dev, dt.acc(), h.rows())?;
        let ls = crate::attention_bwd(kernels, dt, qkv, y, dy, lse, dev.addr(&dvec), dev.addr(&dqkv), h)?;
        // SAFETY: as the forward; dy and y are [b, t, heads·dh]; dvec and dqkv allocated above.
        unsafe { dev.launch_all(&ls)? };
    }
    Ok(dqkv)
}

/// Rotary positions on the packed qkv [b, t, 3·heads·dh] with base `theta`: q and k turned, v
/// copied, into a new buffer. With `inverse` the turn is undone: the backward, applied to the
/// output's gradient.
pub fn rope<D: Device>(dev: &D, dt: Dtype, qkv: u64, h: Heads, theta: f64, inverse: bool) -> Result<D::Buffer, D::Error> {
    let y = alloc(dev, dt, 3 * h.elements())?;
    if h.elements() == 0 {
        return Ok(y);
    }
    let (t, half) = (h.seq, h.head_dim / 2);
    let (cos, sin) = (alloc(dev, dt.acc(), t * half)?, alloc(dev, dt.acc(), t * half)?);
    let tables = crate::rope_tables(dt.acc(), dev.addr(&cos), dev.addr(&sin), t, h.head_dim, theta)?;
    let turn = crate::rope(dt, qkv, dev.addr(&y), dev.addr(&cos), dev.addr(&sin), h, inverse)?;
    // SAFETY: the tables hold t · dh/2 elements each (allocated above); qkv and y are
    // [b·t, 3·heads·dh].
    unsafe { dev.launch_all(&[tables, turn])? };
    Ok(y)
}
