//! Matrix-product layers: a linear layer, and an MoE layer's experts as grouped products.
//!
//! The experts of a layer run over one buffer of rows grouped by expert (`counts[e]` rows for
//! expert e, in expert order): each projection is one product per expert on its block of rows
//! (no copies of rows or weights), and each elementwise step — the first bias with the activation
//! (GELU, or SwiGLU over a first product twice as wide), the second bias, the activation's
//! derivative — one launch over every row, the row's expert found from the group offsets. Weight
//! gradients land in one buffer per projection ([E, d, f₁], [E, f, d], f₁ the first product's
//! width), bias gradients as grouped column sums ([E, f₁], [E, d]) in a fixed order.

use super::{alloc, WithSaved};
use crate::{Activation, Device, Dtype, Elem, Gemm, KernelError};

/// One expert's weights: W1 [d, f₁] and W2 [f, d] of the rows' type (or its working copy), b1
/// [f₁] and b2 [d] of the accumulator type (f₁ = [`Activation::first_width`] of f). A bias
/// address of 0: the expert has no such bias (nothing is added; its gradient is computed and
/// may be dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertAddrs {
    pub w1: u64,
    pub b1: u64,
    pub w2: u64,
    pub b2: u64,
}

/// What the experts' backward reads of their forward: the pre-activation h = x·W1 + b1 [R, f₁]
/// and the activation of h [R, f].
pub struct GroupedFfnSaved<B> {
    pub pre: B,
    pub act: B,
}

/// The experts' gradients: dx [R, d] of the rows' type; dW1 [E, d, f₁], db1 [E, f₁], dW2 [E, f, d],
/// db2 [E, d] of the accumulator type.
pub struct GroupedFfnGrads<B> {
    pub dx: B,
    pub dw1: B,
    pub db1: B,
    pub dw2: B,
    pub db2: B,
}

/// The two products of a product layer's backward over n rows (n > 0): dW [din, dout] = xᵀ · dy
/// (of `acc`) and dx [n, din] = dy · Wᵀ (of `dt`), with x [n, din], dy [n, dout], W [din, dout].
///
/// # Safety
/// The addresses hold those matrices on `dev`.
#[allow(clippy::too_many_arguments)]
unsafe fn product_grads<D: Device>(
    dev: &D,
    (dt, acc): (Dtype, Dtype),
    (x, dy, w): (u64, u64, u64),
    (dw, dx): (u64, u64),
    n: usize,
    din: usize,
    dout: usize,
) -> Result<(), D::Error> {
    if din == 0 {
        return Ok(()); // dW and dx are empty
    }
    let weight = Gemm { trans_a: true, lda: din, ..Gemm::plain(dt, acc, din, dout, n, x, dy, dw) };
    let input = Gemm { trans_b: true, ldb: dout, ..Gemm::plain(dt, dt, n, din, dout, dy, w, dx) };
    // SAFETY: forwarded from the caller.
    unsafe {
        dev.gemm(&weight)?;
        dev.gemm(&input)
    }
}

/// Row offsets of the groups: counts' prefix sums, from 0.
fn offsets(counts: &[usize]) -> Result<Vec<u32>, KernelError> {
    let mut off = Vec::with_capacity(counts.len() + 1);
    let mut at = 0usize;
    off.push(0);
    for &c in counts {
        at += c;
        off.push(u32::try_from(at).map_err(|_| KernelError::Size { family: "grouped ffn", what: format!("{at} rows") })?);
    }
    Ok(off)
}

fn check_groups(experts: &[ExpertAddrs], counts: &[usize]) -> Result<(), KernelError> {
    if experts.len() != counts.len() || experts.is_empty() {
        return Err(KernelError::Size { family: "grouped ffn", what: format!("{} experts with {} counts", experts.len(), counts.len()) });
    }
    if experts.len() > 65_535 {
        return Err(KernelError::Size { family: "grouped ffn", what: format!("{} experts (at most 65535)", experts.len()) });
    }
    Ok(())
}

/// Every expert's act(x·W1 + b1)·W2 + b2 over its rows of x [R, d] (of `dt`): y [R, d] and what
/// the backward keeps.
#[allow(clippy::too_many_arguments)]
pub fn grouped_ffn_fwd<D: Device>(
    dev: &D,
    dt: Dtype,
    activation: Activation,
    x: u64,
    experts: &[ExpertAddrs],
    counts: &[usize],
    d: usize,
    f: usize,
) -> WithSaved<D, GroupedFfnSaved<D::Buffer>> {
    check_groups(experts, counts)?;
    let off = offsets(counts)?;
    let rows = off[counts.len()] as usize;
    let groups = counts.len();
    let f1 = activation.first_width(f);
    let (es, fs) = (dt.size() as u64, dt.size() as u64);
    let pre = alloc(dev, dt, rows * f1)?;
    let act = alloc(dev, dt, rows * f)?;
    let y = alloc(dev, dt, rows * d)?;
    if rows == 0 {
        return Ok((y, GroupedFfnSaved { pre, act }));
    }
    let seg = dev.upload_u32(&off)?;
    let b1s = dev.upload_u64(&experts.iter().map(|e| e.b1).collect::<Vec<_>>())?;
    let b2s = dev.upload_u64(&experts.iter().map(|e| e.b2).collect::<Vec<_>>())?;
    let (xa, pa, aa, ya) = (x, dev.addr(&pre), dev.addr(&act), dev.addr(&y));
    for (e, w) in experts.iter().enumerate() {
        let (r0, n) = (off[e] as u64, counts[e]);
        if n == 0 {
            continue;
        }
        // SAFETY: rows r0..r0+n of x [R, d] and of pre [R, f₁]; W1 is [d, f₁].
        unsafe { dev.gemm(&Gemm::plain(dt, dt, n, f1, d, xa + r0 * d as u64 * es, w.w1, pa + r0 * f1 as u64 * fs))? };
    }
    let l = crate::bias_activation_fwd(activation, dt, pa, aa, dev.addr(&b1s), dev.addr(&seg), groups, rows, f)?;
    // SAFETY: pre is [R, f₁] and act [R, f]; b1s holds each group's b1 [f₁]; seg the R-row offsets.
    unsafe { dev.launch(&l)? };
    for (e, w) in experts.iter().enumerate() {
        let (r0, n) = (off[e] as u64, counts[e]);
        if n == 0 {
            continue;
        }
        // SAFETY: rows of act [R, f] and y [R, d]; W2 is [f, d].
        unsafe { dev.gemm(&Gemm::plain(dt, dt, n, d, f, aa + r0 * f as u64 * fs, w.w2, ya + r0 * d as u64 * es))? };
    }
    let l = crate::bias_add_rows(dt, ya, dev.addr(&b2s), dev.addr(&seg), groups, rows, d)?;
    // SAFETY: y is [R, d]; b2s holds each group's b2 [d].
    unsafe { dev.launch(&l)? };
    Ok((y, GroupedFfnSaved { pre, act }))
}

/// The experts' backward from dy [R, d] (of `dt`): every gradient, experts without rows getting
/// zeros. The saved buffers are only read.
#[allow(clippy::too_many_arguments)]
pub fn grouped_ffn_bwd<D: Device>(
    dev: &D,
    dt: Dtype,
    activation: Activation,
    x: u64,
    dy: u64,
    experts: &[ExpertAddrs],
    counts: &[usize],
    saved: &GroupedFfnSaved<D::Buffer>,
    d: usize,
    f: usize,
) -> Result<GroupedFfnGrads<D::Buffer>, D::Error> {
    check_groups(experts, counts)?;
    let off = offsets(counts)?;
    let rows = off[counts.len()] as usize;
    let groups = counts.len();
    let f1 = activation.first_width(f);
    let acc = dt.acc();
    let max_rows = counts.iter().copied().max().unwrap_or(0);
    let es = dt.size() as u64;
    let ga = acc.size() as u64;
    let dx = alloc(dev, dt, rows * d)?;
    let dact = alloc(dev, dt, rows * f)?;
    // An expert without rows has zero weight gradients: the buffers start zeroed then (its
    // products are skipped), else every block is written by its product.
    let grads = |n: usize| if counts.contains(&0) { dev.zeros(Elem::Float(acc), n) } else { alloc(dev, acc, n) };
    let dw1 = grads(groups * d * f1)?;
    let dw2 = grads(groups * f * d)?;
    let db1 = alloc(dev, acc, groups * f1)?;
    let db2 = alloc(dev, acc, groups * d)?;
    let seg = dev.upload_u32(&off)?;
    let (pa, aa, daa, dxa) = (dev.addr(&saved.pre), dev.addr(&saved.act), dev.addr(&dact), dev.addr(&dx));
    for (e, w) in experts.iter().enumerate() {
        let (r0, n) = (off[e] as u64, counts[e]);
        if n == 0 {
            continue;
        }
        let dw2e = dev.addr(&dw2) + (e * f * d) as u64 * ga;
        let rows_of = |base: u64, width: usize| base + r0 * width as u64 * es;
        // dW2 = actᵀ · dy and d act = dy · W2ᵀ, on the expert's rows.
        // SAFETY: rows of act [R, f], dy [R, d] and dact [R, f]; W2 [f, d]; dW2's block [f, d].
        unsafe { product_grads(dev, (dt, acc), (rows_of(aa, f), rows_of(dy, d), w.w2), (dw2e, rows_of(daa, f)), n, f, d)? };
    }
    // The pre-activation's gradient dh [R, f₁]: GELU's in place of dact, SwiGLU's a buffer of
    // its own (twice as wide).
    let dh = match activation {
        Activation::Gelu => dact,
        Activation::Swiglu => alloc(dev, dt, rows * f1)?,
    };
    let dha = dev.addr(&dh);
    if rows > 0 {
        let l = match activation {
            Activation::Gelu => crate::gelu_bwd_inplace(dt, pa, dha, rows * f),
            Activation::Swiglu => crate::swiglu_bwd(dt, pa, daa, dha, rows, f)?,
        };
        // SAFETY: pre and dh are [R, f₁], dact [R, f] (the same buffer as dh for GELU).
        unsafe { dev.launch(&l)? };
    }
    let work = alloc(dev, acc, crate::column_sums_workspace(groups, max_rows, f1.max(d)))?;
    let sums = |m: u64, out: &D::Buffer, width: usize| -> Result<(), D::Error> {
        let ls = crate::column_sums(dt, m, dev.addr(&seg), groups, max_rows, dev.addr(&work), dev.addr(out), rows, width)?;
        // SAFETY: m is [R, width] grouped by seg; the workspace holds groups × parts × width; out
        // is [groups, width].
        unsafe { dev.launch_all(&ls) }
    };
    sums(dy, &db2, d)?;
    sums(dha, &db1, f1)?;
    for (e, w) in experts.iter().enumerate() {
        let (r0, n) = (off[e] as u64, counts[e]);
        if n == 0 {
            continue;
        }
        let dw1e = dev.addr(&dw1) + (e * d * f1) as u64 * ga;
        let rows_of = |base: u64, width: usize| base + r0 * width as u64 * es;
        // dW1 = xᵀ · dh and dx = dh · W1ᵀ, on the expert's rows.
        // SAFETY: rows of x [R, d], dh [R, f₁] and dx [R, d]; W1 [d, f₁]; dW1's block [d, f₁].
        unsafe { product_grads(dev, (dt, acc), (rows_of(x, d), rows_of(dha, f1), w.w1), (dw1e, rows_of(dxa, d)), n, d, f1)? };
    }
    Ok(GroupedFfnGrads { dx, dw1, db1, dw2, db2 })
}

/// y [n, dout] (of `y_dt`: x's type, or f32 from bf16) = x [n, din] · W [din, dout] (+ b [dout],
/// of x's accumulator type, when `b` is not 0).
#[allow(clippy::too_many_arguments)]
pub fn linear_fwd<D: Device>(
    dev: &D,
    x_dt: Dtype,
    y_dt: Dtype,
    x: u64,
    w: u64,
    b: u64,
    n: usize,
    din: usize,
    dout: usize,
) -> Result<D::Buffer, D::Error> {
    let y = alloc(dev, y_dt, n * dout)?;
    if n * dout == 0 {
        return Ok(y);
    }
    // SAFETY: x [n, din], W [din, dout], y [n, dout].
    unsafe { dev.gemm(&Gemm::plain(x_dt, y_dt, n, dout, din, x, w, dev.addr(&y)))? };
    if b != 0 {
        let bias = dev.upload_u64(&[b])?;
        let seg = dev.upload_u32(&[0, n as u32])?;
        // SAFETY: y is [n, dout]; b is [dout].
        unsafe { dev.launch(&crate::bias_add_rows(y_dt, dev.addr(&y), dev.addr(&bias), dev.addr(&seg), 1, n, dout)?)? };
    }
    Ok(y)
}

/// A linear layer's gradients: dx [n, din] of x's type, dW [din, dout] and db [dout] of x's
/// accumulator type (db None without a bias).
pub struct LinearGrads<B> {
    pub dx: B,
    pub dw: B,
    pub db: Option<B>,
}

/// The linear layer's backward from dy [n, dout] (of `y_dt`; a f32 gradient of a bf16 product is
/// rounded to bf16 for the products, as autocast does, and summed in f32 for the bias).
#[allow(clippy::too_many_arguments)]
pub fn linear_bwd<D: Device>(
    dev: &D,
    x_dt: Dtype,
    y_dt: Dtype,
    x: u64,
    w: u64,
    dy: u64,
    with_bias: bool,
    n: usize,
    din: usize,
    dout: usize,
) -> Result<LinearGrads<D::Buffer>, D::Error> {
    let acc = x_dt.acc();
    let dx = alloc(dev, x_dt, n * din)?;
    let dw = if n == 0 { dev.zeros(Elem::Float(acc), din * dout)? } else { alloc(dev, acc, din * dout)? };
    let narrow;
    let dyp = if y_dt != x_dt {
        narrow = alloc(dev, Elem::Float(x_dt), n * dout)?;
        if n * dout > 0 {
            // SAFETY: dy and narrow are [n, dout].
            unsafe { dev.launch(&crate::cast(y_dt, x_dt, dy, dev.addr(&narrow), n * dout)?)? };
        }
        dev.addr(&narrow)
    } else {
        dy
    };
    if n > 0 {
        // SAFETY: x [n, din], dy [n, dout], W [din, dout], dW [din, dout], dx [n, din].
        unsafe { product_grads(dev, (x_dt, acc), (x, dyp, w), (dev.addr(&dw), dev.addr(&dx)), n, din, dout)? };
    }
    let db = if with_bias {
        let db = alloc(dev, acc, dout)?;
        let work = alloc(dev, acc, crate::column_sums_workspace(1, n, dout))?;
        let ls = crate::column_sums(y_dt, dy, 0, 1, n, dev.addr(&work), dev.addr(&db), n, dout)?;
        // SAFETY: dy [n, dout]; workspace and db at their documented sizes.
        unsafe { dev.launch_all(&ls)? };
        Some(db)
    } else {
        None
    };
    Ok(LinearGrads { dx, dw, db })
}

/// SwiGLU on its own (a shared expert's or a dense block's, between two linear layers): a [rows,
/// f] from h [rows, 2f] = [gate | up].
pub fn swiglu_fwd<D: Device>(dev: &D, dt: Dtype, h: u64, rows: usize, f: usize) -> Result<D::Buffer, D::Error> {
    let a = alloc(dev, dt, rows * f)?;
    if rows * f > 0 {
        // SAFETY: h is [rows, 2f]; a is allocated [rows, f] above.
        unsafe { dev.launch(&crate::swiglu(dt, h, dev.addr(&a), rows, f)?)? };
    }
    Ok(a)
}

/// [`swiglu_fwd`]'s backward: gh [rows, 2f] from ga [rows, f] and h.
pub fn swiglu_bwd<D: Device>(dev: &D, dt: Dtype, h: u64, ga: u64, rows: usize, f: usize) -> Result<D::Buffer, D::Error> {
    let gh = alloc(dev, dt, rows * 2 * f)?;
    if rows * f > 0 {
        // SAFETY: h is [rows, 2f], ga [rows, f]; gh is allocated [rows, 2f] above.
        unsafe { dev.launch(&crate::swiglu_bwd(dt, h, ga, dev.addr(&gh), rows, f)?)? };
    }
    Ok(gh)
}
