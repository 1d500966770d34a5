//! Causal attention, flash-style.

use super::alloc;
use crate::{AttentionKernels, Device, Dtype};

/// y [b, t, heads·dh] and each query row's log-sum-exp (b·heads·t, the accumulator type) from
/// the packed qkv [b, t, 3·heads·dh].
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd<D: Device>(
    dev: &D,
    kernels: AttentionKernels,
    dt: Dtype,
    qkv: u64,
    b: usize,
    t: usize,
    heads: usize,
    dh: usize,
) -> Result<(D::Buffer, D::Buffer), D::Error> {
    let y = alloc(dev, dt, b * t * heads * dh)?;
    let lse = alloc(dev, dt.acc(), b * heads * t)?;
    if b * t * heads * dh > 0 {
        let l = crate::attention_fwd(kernels, dt, qkv, dev.addr(&y), dev.addr(&lse), b, t, heads, dh)?;
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
    b: usize,
    t: usize,
    heads: usize,
    dh: usize,
) -> Result<D::Buffer, D::Error> {
    let dqkv = alloc(dev, dt, 3 * b * t * heads * dh)?;
    if b * t * heads * dh > 0 {
        let dvec = alloc(dev, dt.acc(), b * heads * t)?;
        let ls = crate::attention_bwd(kernels, dt, qkv, y, dy, lse, dev.addr(&dvec), dev.addr(&dqkv), b, t, heads, dh)?;
        // SAFETY: as the forward; dy and y are [b, t, heads·dh]; dvec and dqkv allocated above.
        unsafe { dev.launch_all(&ls)? };
    }
    Ok(dqkv)
}
