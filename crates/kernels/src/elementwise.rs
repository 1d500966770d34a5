//! Launches of the elementwise kernels (`cuda/elementwise.cuh`): GELU, SwiGLU, the grouped FFNs'
//! bias epilogues, casts, AdamW and the sums of squares.

use crate::{args, launch, row_launch, size_u32, stride_launch, Arg, Dtype, KernelError, Launch, THREADS};

const FAMILY: &str = "elementwise";

fn map(kernel: &str, dt: Dtype, x: u64, y: u64, n: usize) -> Launch {
    stride_launch(format!("lazarus_{kernel}_{}", dt.suffix()), n as u64, args(&[x, y], [Arg::U64(n as u64)]))
}

/// y = gelu(x) (tanh form), n elements.
pub fn gelu(dt: Dtype, x: u64, y: u64, n: usize) -> Launch {
    map("gelu", dt, x, y, n)
}

/// y = gelu'(x), n elements.
pub fn gelu_grad(dt: Dtype, x: u64, y: u64, n: usize) -> Launch {
    map("gelu_grad", dt, x, y, n)
}

/// g ← g · gelu'(pre), n elements, in place.
pub fn gelu_bwd_inplace(dt: Dtype, pre: u64, g: u64, n: usize) -> Launch {
    map("gelu_bwd_inplace", dt, pre, g, n)
}

fn bias_suffix(dt: Dtype) -> &'static str {
    // The biases are parameters: f32 (f64 for f64 rows); bf16 rows take f32 biases.
    dt.suffix()
}

fn segments_arg(segments: u64, groups: usize) -> Result<u32, KernelError> {
    if groups == 0 || (segments == 0 && groups != 1) {
        return Err(KernelError::Size { family: FAMILY, what: format!("{groups} groups (segments given: {})", segments != 0) });
    }
    size_u32(FAMILY, "groups", groups)
}

/// An expert FFN's activation, between its two products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// GELU (tanh form) of the f hidden units.
    Gelu,
    /// SwiGLU (Mixtral's): the first product gives 2f units [gate | up], the activation
    /// SiLU(gate) ⊙ up gives f.
    Swiglu,
}

impl Activation {
    /// Columns of the first product for f hidden units.
    pub fn first_width(self, f: usize) -> usize {
        match self {
            Activation::Gelu => f,
            Activation::Swiglu => 2 * f,
        }
    }
}

/// f as a kernel argument, where the kernel indexes rows of the first product's width (checked
/// to fit its u32 too).
fn hidden_width(activation: Activation, f: usize) -> Result<u32, KernelError> {
    size_u32(FAMILY, "width", activation.first_width(f))?;
    size_u32(FAMILY, "width", f)
}

/// Over rows of the first product (its [`Activation::first_width`] of f columns) grouped in
/// `groups` segments (`segments`: groups + 1 row offsets on the device, the device array `bias`
/// holding each group's bias address, of the accumulator type of `dt`; 0 for a group without a
/// bias): h ← h + b[group] (kept for the backward) and act [rows, f] = the activation of h.
#[allow(clippy::too_many_arguments)]
pub fn bias_activation_fwd(
    activation: Activation,
    dt: Dtype,
    h: u64,
    act: u64,
    bias: u64,
    segments: u64,
    groups: usize,
    rows: usize,
    f: usize,
) -> Result<Launch, KernelError> {
    let kernel = match activation {
        Activation::Gelu => "bias_gelu_fwd",
        Activation::Swiglu => "bias_swiglu_fwd",
    };
    let f_arg = hidden_width(activation, f)?;
    Ok(row_launch(
        format!("lazarus_{kernel}_{}", bias_suffix(dt)),
        rows,
        f_arg,
        args(&[h, act, bias, segments], [Arg::U32(segments_arg(segments, groups)?), Arg::U64(rows as u64), Arg::U32(f_arg)]),
    ))
}

/// a [rows, f] = SiLU(gate) ⊙ up from h [rows, 2f] = [gate | up].
pub fn swiglu(dt: Dtype, h: u64, a: u64, rows: usize, f: usize) -> Result<Launch, KernelError> {
    Ok(stride_launch(
        format!("lazarus_swiglu_fwd_{}", dt.suffix()),
        (rows * f) as u64,
        args(&[h, a], [Arg::U64(rows as u64), Arg::U32(hidden_width(Activation::Swiglu, f)?)]),
    ))
}

/// SwiGLU's backward: gh [rows, 2f] from ga [rows, f] and the pre-activation h [rows, 2f].
pub fn swiglu_bwd(dt: Dtype, h: u64, ga: u64, gh: u64, rows: usize, f: usize) -> Result<Launch, KernelError> {
    Ok(stride_launch(
        format!("lazarus_swiglu_bwd_{}", dt.suffix()),
        (rows * f) as u64,
        args(&[h, ga, gh], [Arg::U64(rows as u64), Arg::U32(hidden_width(Activation::Swiglu, f)?)]),
    ))
}

/// y ← y + b[group] over rows of d grouped as for [`bias_activation_fwd`] (a group whose bias
/// address is 0 is left as it is).
#[allow(clippy::too_many_arguments)]
pub fn bias_add_rows(dt: Dtype, y: u64, bias: u64, segments: u64, groups: usize, rows: usize, d: usize) -> Result<Launch, KernelError> {
    Ok(row_launch(
        format!("lazarus_bias_add_rows_{}", bias_suffix(dt)),
        rows,
        size_u32(FAMILY, "width", d)?,
        args(
            &[y, bias, segments],
            [Arg::U32(segments_arg(segments, groups)?), Arg::U64(rows as u64), Arg::U32(size_u32(FAMILY, "width", d)?)],
        ),
    ))
}

/// y = x converted, n elements: f32 → bf16 (rounded to nearest even) or bf16 → f32.
pub fn cast(from: Dtype, to: Dtype, x: u64, y: u64, n: usize) -> Result<Launch, KernelError> {
    let name = match (from, to) {
        (Dtype::F32, Dtype::Bf16) => "f32_bf16",
        (Dtype::Bf16, Dtype::F32) => "bf16_f32",
        _ => return Err(KernelError::Types { family: FAMILY, what: format!("a cast from {from:?} to {to:?}") }),
    };
    Ok(stride_launch(format!("lazarus_cast_{name}"), n as u64, args(&[x, y], [Arg::U64(n as u64)])))
}

/// The AdamW coefficients of one tensor's update, in the kernel's argument order:
/// b1, b2, scale, step_size, inv_bc2_sqrt, eps, keep.
pub type AdamWScalars = [f32; 7];

/// AdamW's update of the f32 parameter p in place, with f32 gradient g and moments m, v (n
/// elements each); `copy` (0: none) gets the new parameter rounded to bf16, the working copy a
/// bf16 matrix product reads.
pub fn adamw(p: u64, g: u64, m: u64, v: u64, copy: u64, n: usize, k: AdamWScalars) -> Launch {
    let mut args = args(&[p, g, m, v, copy], [Arg::U64(n as u64)]);
    args.extend(k.iter().map(|&x| Arg::F32(x)));
    launch("lazarus_adamw_f32".into(), [(n as u64).div_ceil(THREADS as u64).clamp(1, 4096) as u32, 1, 1], [THREADS, 1, 1], args)
}

/// u64 words of one tensor's record in [`adamw_list`]'s table.
pub const ADAMW_RECORD: usize = 10;

/// One tensor of [`adamw_list`]: the addresses of [`adamw`]'s operands (f32 p, g, m, v; the bf16
/// copy, 0 for none), its length and its coefficients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWTensor {
    pub p: u64,
    pub g: u64,
    pub m: u64,
    pub v: u64,
    pub copy: u64,
    pub n: usize,
    pub k: AdamWScalars,
}

/// Elements of a tensor each block of [`adamw_list`] takes.
pub const ADAMW_PART: usize = 1 << 16;

/// The table [`adamw_list`] reads (to upload as u64s): each tensor's first part, then the total
/// (tensors + 1 words), then each tensor's record of [`ADAMW_RECORD`] words — its five addresses,
/// its length, its seven coefficients as f32 bits two a word (the last word's upper half 0).
pub fn adamw_table(tensors: &[AdamWTensor]) -> Vec<u64> {
    let mut table = Vec::with_capacity(tensors.len() * (ADAMW_RECORD + 1) + 1);
    let mut at = 0u64;
    for t in tensors {
        table.push(at);
        at += t.n.div_ceil(ADAMW_PART) as u64;
    }
    table.push(at);
    for t in tensors {
        let k: Vec<u64> = t.k.iter().map(|x| x.to_bits() as u64).chain([0]).collect();
        table.extend([t.p, t.g, t.m, t.v, t.copy, t.n as u64]);
        table.extend(k.chunks(2).map(|pair| pair[0] | pair[1] << 32));
    }
    table
}

/// AdamW on every tensor of a list in one launch, each element by [`adamw`]'s formula (the same
/// bits): `table` is [`adamw_table`] of the `tensors` on the device, `parts` its total of parts.
pub fn adamw_list(table: u64, tensors: usize, parts: usize) -> Result<Launch, KernelError> {
    if tensors == 0 {
        return Err(KernelError::Size { family: FAMILY, what: "an AdamW list of no tensors".into() });
    }
    Ok(launch(
        "lazarus_adamw_list_f32".into(),
        [parts.clamp(1, 1 << 16) as u32, 1, 1],
        [THREADS, 1, 1],
        vec![Arg::Ptr(table), Arg::U32(size_u32(FAMILY, "tensors", tensors)?), Arg::U64(ADAMW_PART as u64)],
    ))
}

/// Elements of a tensor each block of a sum of squares takes.
pub const SQUARES_PART: usize = 1 << 16;

/// The parts a sum of squares of `n` elements is cut into (one at least).
pub fn squares_parts(n: usize) -> usize {
    n.div_ceil(SQUARES_PART).max(1)
}

/// Σ x² over each [`SQUARES_PART`] of every f32 tensor of a list, in f64, in one launch: the
/// tensors' addresses and lengths (`tensors` u64 each on the device), `starts` (tensors + 1 u32:
/// the first part of each, then the total, `total`), into parts[0..total].
pub fn sum_squares_parts(addrs: u64, lens: u64, starts: u64, tensors: usize, total: usize, parts: u64) -> Launch {
    launch(
        "lazarus_sum_squares_parts_f32".into(),
        [total.clamp(1, 1 << 16) as u32, 1, 1],
        [THREADS, 1, 1],
        vec![Arg::Ptr(addrs), Arg::Ptr(lens), Arg::Ptr(starts), Arg::U32(tensors as u32), Arg::U64(SQUARES_PART as u64), Arg::Ptr(parts)],
    )
}

/// out[t] = Σ of parts[starts[t]..starts[t + 1]] in order, for t < tensors (starts: tensors + 1
/// u32 on the device; out f64).
pub fn sum_parts(parts: u64, starts: u64, out: u64, tensors: usize) -> Launch {
    launch(
        "lazarus_sum_parts".into(),
        [tensors.clamp(1, 1 << 16) as u32, 1, 1],
        [THREADS, 1, 1],
        args(&[parts, starts, out], [Arg::U32(tensors as u32)]),
    )
}
