//! Launches of the row-statistics kernels (`cuda/norm.cuh`): LayerNorm, RMSNorm, softmax, cross-entropy,
//! and the column sums that reduce a parameter's gradient over rows in a fixed order.

use crate::{args, launch, row_launch, size_u32, stride_launch, Arg, Dtype, KernelError, Launch, THREADS};

const FAMILY: &str = "norm";

/// Row parts of a column sum over `rows` rows: at most 64 parts of at least 64 rows each.
fn parts_for(rows: usize) -> usize {
    rows.div_ceil(64).clamp(1, 64)
}

/// The suffix of the LayerNorm and RMSNorm kernels for input `x` (and weights, of the same type) and output
/// `y`: (f32, f32), (f64, f64), or (f32, bf16) for a bf16 matrix product next.
fn norm_suffix(x: Dtype, y: Dtype) -> Result<&'static str, KernelError> {
    match (x, y) {
        (Dtype::F32, Dtype::F32) => Ok("f32"),
        (Dtype::F64, Dtype::F64) => Ok("f64"),
        (Dtype::F32, Dtype::Bf16) => Ok("f32_bf16"),
        _ => Err(KernelError::Types { family: FAMILY, what: format!("a norm from {x:?} to {y:?}") }),
    }
}

/// y = (x − mean) · rstd · w + b over rows of d; mean and rstd of each row (x's accumulator type,
/// `rows` each) kept for the backward.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_fwd(
    x_dt: Dtype,
    y_dt: Dtype,
    x: u64,
    w: u64,
    b: u64,
    y: u64,
    mean: u64,
    rstd: u64,
    rows: usize,
    d: usize,
    eps: f64,
) -> Result<Launch, KernelError> {
    let suffix = norm_suffix(x_dt, y_dt)?;
    let d32 = size_u32(FAMILY, "width", d)?;
    Ok(row_launch(
        format!("lazarus_layer_norm_fwd_{suffix}"),
        rows,
        d32,
        args(&[x, w, b, y, mean, rstd], [Arg::U64(rows as u64), Arg::U32(d32), Arg::F64(eps)]),
    ))
}

/// Elements (x's accumulator type) of the workspace [`layer_norm_bwd`] needs.
pub fn layer_norm_bwd_workspace(rows: usize, d: usize) -> usize {
    2 * parts_for(rows) * d
}

/// The LayerNorm's backward from g (the output's gradient, of `y_dt`): dx (x's type) and the
/// weight's and bias's gradients into `dwdb` (2·d elements of x's type: dw, then db), through
/// `workspace` ([`layer_norm_bwd_workspace`] elements).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_bwd(
    x_dt: Dtype,
    y_dt: Dtype,
    x: u64,
    w: u64,
    g: u64,
    mean: u64,
    rstd: u64,
    dx: u64,
    workspace: u64,
    dwdb: u64,
    rows: usize,
    d: usize,
) -> Result<Vec<Launch>, KernelError> {
    let suffix = norm_suffix(x_dt, y_dt)?;
    let d32 = size_u32(FAMILY, "width", d)?;
    let [partials, totals] =
        weight_sums(format!("lazarus_gamma_beta_partials_{suffix}"), vec![x, g, mean, rstd], x_dt, workspace, dwdb, 2, rows, d32)?;
    Ok(vec![
        row_launch(
            format!("lazarus_layer_norm_bwd_{suffix}"),
            rows,
            d32,
            vec![Arg::Ptr(x), Arg::Ptr(w), Arg::Ptr(g), Arg::Ptr(mean), Arg::Ptr(rstd), Arg::Ptr(dx), Arg::U64(rows as u64), Arg::U32(d32)],
        ),
        partials,
        totals,
    ])
}

/// A norm's parameter gradients summed over rows in a fixed order: `partials` (its inputs, then
/// the workspace, rows, width and part) sums each column over a part of the rows into `sums`
/// per-column sums of each part, then the parts are added in order into `out` (x's type).
#[allow(clippy::too_many_arguments)]
fn weight_sums(
    partials: String,
    inputs: Vec<u64>,
    x_dt: Dtype,
    workspace: u64,
    out: u64,
    sums: u32,
    rows: usize,
    d32: u32,
) -> Result<[Launch; 2], KernelError> {
    let parts = parts_for(rows);
    let part = rows.div_ceil(parts).max(1);
    let mut partial_args: Vec<Arg> = inputs.into_iter().map(Arg::Ptr).collect();
    partial_args.extend([Arg::Ptr(workspace), Arg::U64(rows as u64), Arg::U32(d32), Arg::U32(size_u32(FAMILY, "part", part)?)]);
    Ok([
        launch(partials, [d32.div_ceil(32).max(1), parts as u32, 1], [32, 8, 1], partial_args),
        stride_launch(
            format!("lazarus_column_totals_{}", x_dt.suffix()),
            sums as u64 * d32 as u64,
            args(&[workspace, out], [Arg::U32(sums), Arg::U32(parts as u32), Arg::U32(d32)]),
        ),
    ])
}

/// y = x · rstd · w over rows of d (RMSNorm, rstd = 1/√(mean(x²) + eps)); rstd of each row (x's
/// accumulator type, `rows` of them) kept for the backward. Types as [`layer_norm_fwd`].
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_fwd(
    x_dt: Dtype,
    y_dt: Dtype,
    x: u64,
    w: u64,
    y: u64,
    rstd: u64,
    rows: usize,
    d: usize,
    eps: f64,
) -> Result<Launch, KernelError> {
    let suffix = norm_suffix(x_dt, y_dt)?;
    let d32 = size_u32(FAMILY, "width", d)?;
    Ok(row_launch(
        format!("lazarus_rms_norm_fwd_{suffix}"),
        rows,
        d32,
        args(&[x, w, y, rstd], [Arg::U64(rows as u64), Arg::U32(d32), Arg::F64(eps)]),
    ))
}

/// Elements (x's accumulator type) of the workspace [`rms_norm_bwd`] needs.
pub fn rms_norm_bwd_workspace(rows: usize, d: usize) -> usize {
    parts_for(rows) * d
}

/// RMSNorm's backward from g (the output's gradient, of `y_dt`): dx (x's type) and the weight's
/// gradient into `dw` (d elements of x's type), through `workspace` ([`rms_norm_bwd_workspace`]
/// elements).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_bwd(
    x_dt: Dtype,
    y_dt: Dtype,
    x: u64,
    w: u64,
    g: u64,
    rstd: u64,
    dx: u64,
    workspace: u64,
    dw: u64,
    rows: usize,
    d: usize,
) -> Result<Vec<Launch>, KernelError> {
    let suffix = norm_suffix(x_dt, y_dt)?;
    let d32 = size_u32(FAMILY, "width", d)?;
    let [partials, totals] =
        weight_sums(format!("lazarus_rms_weight_partials_{suffix}"), vec![x, g, rstd], x_dt, workspace, dw, 1, rows, d32)?;
    Ok(vec![
        row_launch(
            format!("lazarus_rms_norm_bwd_{suffix}"),
            rows,
            d32,
            vec![Arg::Ptr(x), Arg::Ptr(w), Arg::Ptr(g), Arg::Ptr(rstd), Arg::Ptr(dx), Arg::U64(rows as u64), Arg::U32(d32)],
        ),
        partials,
        totals,
    ])
}

/// Elements (the accumulator type) of the workspace of [`column_sums`] over `groups` segments the
/// longest of which has `max_rows` rows.
pub fn column_sums_workspace(groups: usize, max_rows: usize, d: usize) -> usize {
    groups * parts_for(max_rows) * d
}

/// out[k, c] = Σ over the rows of segment k of m[r, c], for k < groups (`segments`: groups + 1
/// row offsets on the device; 0 with groups = 1: every one of `rows` rows), in a fixed order. m of
/// `dt`; out of its accumulator type.
#[allow(clippy::too_many_arguments)]
pub fn column_sums(
    dt: Dtype,
    m: u64,
    segments: u64,
    groups: usize,
    max_rows: usize,
    workspace: u64,
    out: u64,
    rows: usize,
    d: usize,
) -> Result<Vec<Launch>, KernelError> {
    if segments == 0 && groups != 1 {
        return Err(KernelError::Size { family: FAMILY, what: format!("{groups} groups without segments") });
    }
    let d32 = size_u32(FAMILY, "width", d)?;
    let parts = parts_for(max_rows);
    let part = max_rows.div_ceil(parts).max(1);
    let groups32 = size_u32(FAMILY, "groups", groups)?;
    if groups32 > 65_535 {
        return Err(KernelError::Size { family: FAMILY, what: format!("{groups} groups (at most 65535)") });
    }
    Ok(vec![
        launch(
            format!("lazarus_column_partials_{}", dt.suffix()),
            [d32.div_ceil(32).max(1), parts as u32, groups32.max(1)],
            [32, 8, 1],
            vec![
                Arg::Ptr(m),
                Arg::Ptr(segments),
                Arg::Ptr(workspace),
                Arg::U64(rows as u64),
                Arg::U32(d32),
                Arg::U32(size_u32(FAMILY, "part", part)?),
            ],
        ),
        stride_launch(
            format!("lazarus_column_totals_{}", dt.acc().suffix()),
            (groups * d) as u64,
            vec![Arg::Ptr(workspace), Arg::Ptr(out), Arg::U32(groups32), Arg::U32(parts as u32), Arg::U32(d32)],
        ),
    ])
}

fn float_suffix(family: &'static str, dt: Dtype) -> Result<&'static str, KernelError> {
    match dt {
        Dtype::F32 | Dtype::F64 => Ok(dt.suffix()),
        Dtype::Bf16 => Err(KernelError::Types { family, what: "bf16 (f32 or f64 only)".into() }),
    }
}

/// y = softmax(x) over rows of v (f32 or f64).
pub fn softmax_fwd(dt: Dtype, x: u64, y: u64, rows: usize, v: usize) -> Result<Launch, KernelError> {
    let v32 = size_u32(FAMILY, "width", v)?;
    Ok(row_launch(
        format!("lazarus_softmax_fwd_{}", float_suffix(FAMILY, dt)?),
        rows,
        v32,
        args(&[x, y], [Arg::U64(rows as u64), Arg::U32(v32)]),
    ))
}

/// dx = y ⊙ (g − Σ g·y) over rows of v.
pub fn softmax_bwd(dt: Dtype, y: u64, g: u64, dx: u64, rows: usize, v: usize) -> Result<Launch, KernelError> {
    let v32 = size_u32(FAMILY, "width", v)?;
    Ok(row_launch(
        format!("lazarus_softmax_bwd_{}", float_suffix(FAMILY, dt)?),
        rows,
        v32,
        args(&[y, g, dx], [Arg::U64(rows as u64), Arg::U32(v32)]),
    ))
}

/// The mean cross-entropy of logits [rows, v] against u32 targets into `loss` (one element), each
/// row's loss into `row_loss` and its log-sum-exp into `lse` (rows each, the logits' type).
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_fwd(
    dt: Dtype,
    x: u64,
    targets: u64,
    row_loss: u64,
    lse: u64,
    loss: u64,
    rows: usize,
    v: usize,
) -> Result<Vec<Launch>, KernelError> {
    let suffix = float_suffix(FAMILY, dt)?;
    let v32 = size_u32(FAMILY, "classes", v)?;
    Ok(vec![
        row_launch(
            format!("lazarus_cross_entropy_fwd_{suffix}"),
            rows,
            v32,
            vec![Arg::Ptr(x), Arg::Ptr(targets), Arg::Ptr(row_loss), Arg::Ptr(lse), Arg::U64(rows as u64), Arg::U32(v32)],
        ),
        launch(
            format!("lazarus_mean_{suffix}"),
            [1, 1, 1],
            [THREADS, 1, 1],
            vec![Arg::Ptr(row_loss), Arg::Ptr(loss), Arg::U64(rows as u64)],
        ),
    ])
}

/// dx = (softmax(x) − one-hot(target)) · g[0] / rows, g the loss's gradient (one element on the
/// device).
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_bwd(dt: Dtype, x: u64, targets: u64, lse: u64, g: u64, dx: u64, rows: usize, v: usize) -> Result<Launch, KernelError> {
    Ok(stride_launch(
        format!("lazarus_cross_entropy_bwd_{}", float_suffix(FAMILY, dt)?),
        (rows * v) as u64,
        args(&[x, targets, lse, g, dx], [Arg::U64(rows as u64), Arg::U32(size_u32(FAMILY, "classes", v)?)]),
    ))
}
