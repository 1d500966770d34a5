//! Launches of the flash-style causal attention: the pair-of-lanes kernels (`cuda/attention.cuh`,
//! every type, heads up to 128 columns) and the tensor-core ones (`cuda/attention_mma.cuh`, bf16
//! heads of 64 columns).

use crate::{launch, size_i32, Arg, Dtype, KernelError, Launch};

const FAMILY: &str = "attention";

/// The widest head the kernels take: each row's columns are held in registers by a pair of lanes.
pub const ATTENTION_MAX_HEAD_DIM: usize = 128;

/// Rows of queries (forward, dQ) or keys (dK, dV) per block, and its threads (two per row).
const ROWS: usize = 64;
const THREADS: u32 = 128;

/// Which kernels run the attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernels {
    /// A pair of lanes per row, dot products on the CUDA cores: every type and head width.
    Simt,
    /// Each warp's products on the tensor cores (mma.m16n8k16) where they apply: bf16, heads of
    /// 64 columns, 16-byte aligned buffers; elsewhere the SIMT kernels.
    TensorCores,
}

/// The shape of a packed qkv [batch, seq, 3·heads·head_dim] and of its attention's output
/// [batch, seq, heads·head_dim].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    /// Sequences.
    pub batch: usize,
    /// Tokens of each.
    pub seq: usize,
    pub heads: usize,
    /// Columns of each head.
    pub head_dim: usize,
}

impl Heads {
    /// Elements of the output (and of each of q, k and v).
    pub fn elements(&self) -> usize {
        self.batch * self.seq * self.heads * self.head_dim
    }

    /// (sequence, head) pairs: one log-sum-exp row of `seq` each.
    pub fn rows(&self) -> usize {
        self.batch * self.heads * self.seq
    }
}

/// Whether the tensor-core kernels take this problem: bf16 heads of 64 columns, every buffer
/// 16-byte aligned (their vector loads).
fn tensor_cores_take(kernels: AttentionKernels, dt: Dtype, dh: usize, buffers: &[u64]) -> bool {
    kernels == AttentionKernels::TensorCores && dt == Dtype::Bf16 && dh == 64 && buffers.iter().all(|p| p % 16 == 0)
}

/// Columns each lane of a row's pair holds: the smallest instance that covers the head.
fn half_for(dh: usize) -> Option<usize> {
    match dh {
        1..=32 => Some(16),
        33..=64 => Some(32),
        65..=128 => Some(64),
        _ => None,
    }
}

/// Whether the kernels take heads of `dh` columns.
pub fn attention_supported(dh: usize) -> bool {
    half_for(dh).is_some()
}

fn checked(h: Heads) -> Result<(usize, [Arg; 4]), KernelError> {
    let Heads { batch: b, seq: t, heads, head_dim: dh } = h;
    let half = half_for(dh)
        .ok_or_else(|| KernelError::Size { family: FAMILY, what: format!("heads of {dh} columns (1 to {ATTENTION_MAX_HEAD_DIM})") })?;
    if b * heads > 65_535 {
        return Err(KernelError::Size { family: FAMILY, what: format!("{b} sequences × {heads} heads (at most 65535)") });
    }
    let scale = 1.0 / (dh as f64).sqrt();
    Ok((
        half,
        [
            Arg::I32(size_i32(FAMILY, "sequence length", t)?),
            Arg::I32(size_i32(FAMILY, "heads", heads)?),
            Arg::I32(dh as i32),
            Arg::F64(scale),
        ],
    ))
}

/// y [b, t, heads·dh] = causal softmax(Q·Kᵀ/√dh)·V from the packed qkv [b, t, 3·heads·dh]; `lse`
/// gets each (sequence, head, query)'s log-sum-exp (b·heads·t of the accumulator type).
pub fn attention_fwd(kernels: AttentionKernels, dt: Dtype, qkv: u64, y: u64, lse: u64, h: Heads) -> Result<Launch, KernelError> {
    let (half, [t_, h_, dh_, scale]) = checked(h)?;
    let Heads { batch: b, seq: t, heads, head_dim: dh } = h;
    let name = match tensor_cores_take(kernels, dt, dh, &[qkv, y]) {
        true => "lazarus_attn_mma_fwd_bf16_64".to_string(),
        false => format!("lazarus_attn_fwd_{}_{half}", dt.suffix()),
    };
    Ok(launch(
        name,
        [t.div_ceil(ROWS).max(1) as u32, (b * heads).max(1) as u32, 1],
        [THREADS, 1, 1],
        vec![Arg::Ptr(qkv), Arg::Ptr(y), Arg::Ptr(lse), t_, h_, dh_, scale],
    ))
}

/// dqkv [b, t, 3·heads·dh] from the output gradient dy, the forward's output y and its `lse`,
/// through `dvec` (b·heads·t of the accumulator type: Σ dy·y per row). Every element of dqkv is
/// written.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd(
    kernels: AttentionKernels,
    dt: Dtype,
    qkv: u64,
    y: u64,
    dy: u64,
    lse: u64,
    dvec: u64,
    dqkv: u64,
    h: Heads,
) -> Result<Vec<Launch>, KernelError> {
    let (half, [t_, h_, dh_, scale]) = checked(h)?;
    let Heads { batch: b, seq: t, heads, head_dim: dh } = h;
    let rows = h.rows() as u64;
    let grid = [t.div_ceil(ROWS).max(1) as u32, (b * heads).max(1) as u32, 1];
    let s = dt.suffix();
    let (dq, dkv) = match tensor_cores_take(kernels, dt, dh, &[qkv, y, dy, dqkv]) {
        true => ("lazarus_attn_mma_bwd_dq_bf16_64".to_string(), "lazarus_attn_mma_bwd_dkv_bf16_64".to_string()),
        false => (format!("lazarus_attn_bwd_dq_{s}_{half}"), format!("lazarus_attn_bwd_dkv_{s}_{half}")),
    };
    Ok(vec![
        launch(
            format!("lazarus_attn_bwd_dot_{s}"),
            [rows.div_ceil(8).clamp(1, 1 << 16) as u32, 1, 1],
            [256, 1, 1],
            vec![Arg::Ptr(y), Arg::Ptr(dy), Arg::Ptr(dvec), Arg::I32(size_i32(FAMILY, "sequences", b)?), t_, h_, dh_],
        ),
        launch(
            dq,
            grid,
            [THREADS, 1, 1],
            vec![Arg::Ptr(qkv), Arg::Ptr(dy), Arg::Ptr(lse), Arg::Ptr(dvec), Arg::Ptr(dqkv), t_, h_, dh_, scale],
        ),
        launch(
            dkv,
            grid,
            [THREADS, 1, 1],
            vec![Arg::Ptr(qkv), Arg::Ptr(dy), Arg::Ptr(lse), Arg::Ptr(dvec), Arg::Ptr(dqkv), t_, h_, dh_, scale],
        ),
    ])
}
