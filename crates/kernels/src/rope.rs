//! Launches of the rotary-position kernels (`cuda/rope.cuh`): the cos/sin tables of a sequence
//! length, and the turn of the queries and keys of a packed projection.

use crate::{args, size_u32, stride_launch, Arg, Dtype, Heads, KernelError, Launch};

const FAMILY: &str = "rope";

/// The checked sizes of a turn over qkv [rows, 3d] with heads of `head` columns: (t, d, head) as
/// the kernels take them.
fn sizes(t: usize, d: usize, head: usize) -> Result<(u32, u32, u32), KernelError> {
    if head == 0 || !head.is_multiple_of(2) || !d.is_multiple_of(head) || t == 0 {
        return Err(KernelError::Size { family: FAMILY, what: format!("{d} columns in heads of {head} over {t} positions") });
    }
    Ok((size_u32(FAMILY, "positions", t)?, size_u32(FAMILY, "width", 3 * d)? / 3, size_u32(FAMILY, "head", head)?))
}

/// cos and sin of every (position < t, pair < head/2) into two tables of t · head/2 elements of
/// `acc` (f32 or f64: the accumulator type of the rows to turn).
pub fn rope_tables(acc: Dtype, cos: u64, sin: u64, t: usize, head: usize, theta: f64) -> Result<Launch, KernelError> {
    let (t32, _, head32) = sizes(t, head, head)?;
    if acc == Dtype::Bf16 {
        return Err(KernelError::Types { family: FAMILY, what: "bf16 tables (f32 or f64)".into() });
    }
    Ok(stride_launch(
        format!("lazarus_rope_tables_{}", acc.suffix()),
        (t * head / 2) as u64,
        args(&[cos, sin], [Arg::U32(t32), Arg::U32(head32 / 2), Arg::U32(head32), Arg::F64(theta)]),
    ))
}

/// y = qkv [batch·seq, 3·heads·head_dim] with q and k turned by the tables' angles (the
/// opposite ones with `inverse`: the backward), v copied; x and y of `dt`, the tables of its
/// accumulator type.
pub fn rope(dt: Dtype, x: u64, y: u64, cos: u64, sin: u64, h: Heads, inverse: bool) -> Result<Launch, KernelError> {
    let (rows, d) = (h.batch * h.seq, h.heads * h.head_dim);
    let (t32, d32, head32) = sizes(h.seq, d, h.head_dim)?;
    Ok(stride_launch(
        format!("lazarus_rope_{}", dt.suffix()),
        (rows * 3 * d) as u64,
        args(&[x, y, cos, sin], [Arg::U64(rows as u64), Arg::U32(t32), Arg::U32(d32), Arg::U32(head32), Arg::U32(u32::from(inverse))]),
    ))
}
