//! LayerNorm, RMSNorm, softmax and cross-entropy.

use super::{alloc, check_ids, WithSaved};
use crate::{Device, Dtype, Elem};

/// What the LayerNorm's backward reads of its forward: each row's mean and 1/std (x's
/// accumulator type).
pub struct LayerNormSaved<B> {
    pub mean: B,
    pub rstd: B,
}

/// y (of `y_dt`) = LayerNorm(x) · w + b over rows of d; x, w, b of `x_dt`.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_fwd<D: Device>(
    dev: &D,
    x_dt: Dtype,
    y_dt: Dtype,
    x: u64,
    w: u64,
    b: u64,
    rows: usize,
    d: usize,
    eps: f64,
) -> WithSaved<D, LayerNormSaved<D::Buffer>> {
    let y = alloc(dev, y_dt, rows * d)?;
    let mean = alloc(dev, x_dt.acc(), rows)?;
    let rstd = alloc(dev, x_dt.acc(), rows)?;
    if rows > 0 && d > 0 {
        let l = crate::layer_norm_fwd(x_dt, y_dt, x, w, b, dev.addr(&y), dev.addr(&mean), dev.addr(&rstd), rows, d, eps)?;
        // SAFETY: x is [rows, d], w and b [d]; the outputs are allocated to their sizes above.
        unsafe { dev.launch(&l)? };
    }
    Ok((y, LayerNormSaved { mean, rstd }))
}

/// (dx [rows, d] of `x_dt`, dw ‖ db [2d] of `x_dt`) from g [rows, d] of `y_dt`.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_bwd<D: Device>(
    dev: &D,
    x_dt: Dtype,
    y_dt: Dtype,
    x: u64,
    w: u64,
    g: u64,
    saved: &LayerNormSaved<D::Buffer>,
    rows: usize,
    d: usize,
) -> Result<(D::Buffer, D::Buffer), D::Error> {
    let dx = alloc(dev, x_dt, rows * d)?;
    let dwdb = alloc(dev, x_dt, 2 * d)?;
    if d == 0 {
        return Ok((dx, dwdb));
    }
    let work = alloc(dev, x_dt.acc(), crate::layer_norm_bwd_workspace(rows, d))?;
    let ls = crate::layer_norm_bwd(
        x_dt,
        y_dt,
        x,
        w,
        g,
        dev.addr(&saved.mean),
        dev.addr(&saved.rstd),
        dev.addr(&dx),
        dev.addr(&work),
        dev.addr(&dwdb),
        rows,
        d,
    )?;
    // SAFETY: as the forward, with the workspace at its documented size.
    unsafe { dev.launch_all(&ls)? };
    Ok((dx, dwdb))
}

/// What RMSNorm's backward reads of its forward: each row's 1/rms (x's accumulator type).
pub struct RmsNormSaved<B> {
    pub rstd: B,
}

/// y (of `y_dt`) = RMSNorm(x) · w over rows of d; x and w of `x_dt`.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_fwd<D: Device>(
    dev: &D,
    x_dt: Dtype,
    y_dt: Dtype,
    x: u64,
    w: u64,
    rows: usize,
    d: usize,
    eps: f64,
) -> WithSaved<D, RmsNormSaved<D::Buffer>> {
    let y = alloc(dev, y_dt, rows * d)?;
    let rstd = alloc(dev, x_dt.acc(), rows)?;
    if rows > 0 && d > 0 {
        let l = crate::rms_norm_fwd(x_dt, y_dt, x, w, dev.addr(&y), dev.addr(&rstd), rows, d, eps)?;
        // SAFETY: x is [rows, d], w [d]; the outputs are allocated to their sizes above.
        unsafe { dev.launch(&l)? };
    }
    Ok((y, RmsNormSaved { rstd }))
}

/// (dx [rows, d] of `x_dt`, dw [d] of `x_dt`) from g [rows, d] of `y_dt`.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_bwd<D: Device>(
    dev: &D,
    x_dt: Dtype,
    y_dt: Dtype,
    x: u64,
    w: u64,
    g: u64,
    saved: &RmsNormSaved<D::Buffer>,
    rows: usize,
    d: usize,
) -> Result<(D::Buffer, D::Buffer), D::Error> {
    let dx = alloc(dev, x_dt, rows * d)?;
    let dw = alloc(dev, x_dt, d)?;
    if d == 0 {
        return Ok((dx, dw));
    }
    let work = alloc(dev, x_dt.acc(), crate::rms_norm_bwd_workspace(rows, d))?;
    let ls = crate::rms_norm_bwd(x_dt, y_dt, x, w, g, dev.addr(&saved.rstd), dev.addr(&dx), dev.addr(&work), dev.addr(&dw), rows, d)?;
    // SAFETY: as the forward, with the workspace at its documented size.
    unsafe { dev.launch_all(&ls)? };
    Ok((dx, dw))
}

/// softmax(x) over rows of v.
pub fn softmax_fwd<D: Device>(dev: &D, dt: Dtype, x: u64, rows: usize, v: usize) -> Result<D::Buffer, D::Error> {
    let y = alloc(dev, dt, rows * v)?;
    if rows > 0 && v > 0 {
        // SAFETY: x and y are [rows, v].
        unsafe { dev.launch(&crate::softmax_fwd(dt, x, dev.addr(&y), rows, v)?)? };
    }
    Ok(y)
}

/// dx = y ⊙ (g − Σ g·y) over rows of v.
pub fn softmax_bwd<D: Device>(dev: &D, dt: Dtype, y: u64, g: u64, rows: usize, v: usize) -> Result<D::Buffer, D::Error> {
    let dx = alloc(dev, dt, rows * v)?;
    if rows > 0 && v > 0 {
        // SAFETY: y, g and dx are [rows, v].
        unsafe { dev.launch(&crate::softmax_bwd(dt, y, g, dev.addr(&dx), rows, v)?)? };
    }
    Ok(dx)
}

/// What the cross-entropy's backward reads of its forward: the targets on the device and each
/// row's log-sum-exp.
pub struct CrossEntropySaved<B> {
    pub targets: B,
    pub lse: B,
}

/// The mean cross-entropy (one element of `dt`) of logits [rows, v] against `targets` (each below
/// v: checked).
pub fn cross_entropy_fwd<D: Device>(dev: &D, dt: Dtype, x: u64, targets: &[u32], v: usize) -> WithSaved<D, CrossEntropySaved<D::Buffer>> {
    if v == 0 {
        return Err(crate::KernelError::Size { family: "cross entropy", what: "no classes".into() }.into());
    }
    check_ids("cross entropy targets", targets, v)?;
    let rows = targets.len();
    let t = dev.upload_u32(targets)?;
    let row_loss = alloc(dev, dt, rows.max(1))?;
    let lse = alloc(dev, dt, rows.max(1))?;
    let loss = alloc(dev, dt, 1)?;
    let ls = crate::cross_entropy_fwd(dt, x, dev.addr(&t), dev.addr(&row_loss), dev.addr(&lse), dev.addr(&loss), rows, v)?;
    // SAFETY: x is [rows, v]; every target is below v (checked above).
    unsafe { dev.launch_all(&ls)? };
    Ok((loss, CrossEntropySaved { targets: t, lse }))
}

/// d loss / d logits [rows, v] for the loss's gradient g (one element of `dt` on the device).
pub fn cross_entropy_bwd<D: Device>(
    dev: &D,
    dt: Dtype,
    x: u64,
    saved: &CrossEntropySaved<D::Buffer>,
    g: u64,
    rows: usize,
    v: usize,
) -> Result<D::Buffer, D::Error> {
    let dx = alloc(dev, Elem::Float(dt), rows * v)?;
    if rows > 0 && v > 0 {
        let l = crate::cross_entropy_bwd(dt, x, dev.addr(&saved.targets), dev.addr(&saved.lse), g, dev.addr(&dx), rows, v)?;
        // SAFETY: as the forward; dx is [rows, v].
        unsafe { dev.launch(&l)? };
    }
    Ok(dx)
}
