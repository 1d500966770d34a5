//! Launches of the row kernels (`cuda/rows.cuh`): gathers, sums of listed rows, the combine's
//! backward and the embedding; and the row lists those sums read.

use crate::{args, launch, row_launch, size_u32, Arg, Dtype, KernelError, Launch, THREADS};

const FAMILY: &str = "rows";

/// Rows grouped by a key (CSR): the rows of key k are `list[offsets[k]..offsets[k + 1]]`, in
/// increasing order. What a sum of listed rows reads: the rows each destination row adds up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowLists {
    /// keys + 1 offsets into `list`, from 0 to `list.len()`.
    pub offsets: Vec<u32>,
    /// Every row, grouped by its key.
    pub list: Vec<u32>,
}

/// Row r has key `keys[r]` (< `n`): the rows of each key, in increasing row order. Errors name a
/// key out of range or a row count past 32 bits.
pub fn lists_by_key(keys: &[u32], n: usize) -> Result<RowLists, KernelError> {
    size_u32(FAMILY, "rows", keys.len())?;
    let mut counts = vec![0u32; n + 1];
    for (r, &k) in keys.iter().enumerate() {
        match counts.get_mut(k as usize + 1) {
            Some(c) if (k as usize) < n => *c += 1,
            _ => return Err(KernelError::Size { family: FAMILY, what: format!("row {r} has key {k} of {n}") }),
        }
    }
    for k in 0..n {
        counts[k + 1] += counts[k];
    }
    let offsets = counts.clone();
    let mut next = counts;
    let mut list = vec![0u32; keys.len()];
    for (r, &k) in keys.iter().enumerate() {
        list[next[k as usize] as usize] = r as u32;
        next[k as usize] += 1;
    }
    Ok(RowLists { offsets, list })
}

/// out[r, :] = src[idx[r], :] for r < rows; src and out of `dt`, d columns, idx u32 [rows].
pub fn gather_rows(dt: Dtype, src: u64, idx: u64, out: u64, rows: usize, d: usize) -> Result<Launch, KernelError> {
    let d32 = size_u32(FAMILY, "width", d)?;
    Ok(row_launch(
        format!("lazarus_gather_rows_{}", dt.suffix()),
        rows,
        d32,
        args(&[src, idx, out], [Arg::U64(rows as u64), Arg::U32(d32)]),
    ))
}

/// out[r, :] = tok[ids[r], :] + pos[r mod t, :] for r < rows (tok [V, d], pos [≥ t, d], ids u32).
#[allow(clippy::too_many_arguments)]
pub fn embed_fwd(dt: Dtype, tok: u64, pos: u64, ids: u64, out: u64, rows: usize, t: usize, d: usize) -> Result<Launch, KernelError> {
    Ok(row_launch(
        format!("lazarus_embed_fwd_{}", dt.suffix()),
        rows,
        size_u32(FAMILY, "width", d)?,
        args(
            &[tok, pos, ids, out],
            [Arg::U64(rows as u64), Arg::U32(size_u32(FAMILY, "sequence length", t)?), Arg::U32(size_u32(FAMILY, "width", d)?)],
        ),
    ))
}

/// out[k, :] = Σ over the rows r of key k (in order) of w[s(r)] · src[r, :], for k < n (w = 0:
/// no weights; s(r) = wslot[r], or r when wslot is 0). src of `input`, out of `output`: (f32,
/// f32), (f64, f64), (bf16, bf16) or (bf16, f32); w in `input.acc()`. `offsets` (n + 1) and
/// `list` as [`RowLists`], on the device.
#[allow(clippy::too_many_arguments)]
pub fn sum_listed_rows(
    input: Dtype,
    output: Dtype,
    src: u64,
    w: u64,
    wslot: u64,
    offsets: u64,
    list: u64,
    out: u64,
    n: usize,
    d: usize,
) -> Result<Launch, KernelError> {
    let suffix = match (input, output) {
        (Dtype::F32, Dtype::F32) => "f32",
        (Dtype::F64, Dtype::F64) => "f64",
        (Dtype::Bf16, Dtype::Bf16) => "bf16",
        (Dtype::Bf16, Dtype::F32) => "bf16_f32",
        _ => return Err(KernelError::Types { family: FAMILY, what: format!("a sum of {input:?} rows into {output:?}") }),
    };
    Ok(row_launch(
        format!("lazarus_sum_listed_rows_{suffix}"),
        n,
        size_u32(FAMILY, "width", d)?,
        args(&[src, w, wslot, offsets, list, out], [Arg::U64(n as u64), Arg::U32(size_u32(FAMILY, "width", d)?)]),
    ))
}

/// The combine's backward: dy[r, :] = w[s] · g[tokens[r], :], dw[s] = Σ_c y[r, c] ·
/// g[tokens[r], c] for r < rows, s = wslot[r] (r when wslot is 0). y and dy of `y_dt`, g of
/// `g_dt`, w and dw of the accumulator type: (f32, f32), (f64, f64) or (bf16, f32).
#[allow(clippy::too_many_arguments)]
pub fn combine_rows_bwd(
    y_dt: Dtype,
    g_dt: Dtype,
    y: u64,
    w: u64,
    wslot: u64,
    g: u64,
    tokens: u64,
    dy: u64,
    dw: u64,
    rows: usize,
    d: usize,
) -> Result<Launch, KernelError> {
    let suffix = match (y_dt, g_dt) {
        (Dtype::F32, Dtype::F32) => "f32",
        (Dtype::F64, Dtype::F64) => "f64",
        (Dtype::Bf16, Dtype::F32) => "bf16_f32",
        _ => return Err(KernelError::Types { family: FAMILY, what: format!("rows of {y_dt:?} with gradients of {g_dt:?}") }),
    };
    // One warp per row, 8 warps a block.
    let blocks = (rows as u64).div_ceil(8).clamp(1, 1 << 16) as u32;
    Ok(launch(
        format!("lazarus_combine_rows_bwd_{suffix}"),
        [blocks, 1, 1],
        [THREADS, 1, 1],
        args(&[y, w, wslot, g, tokens, dy, dw], [Arg::U64(rows as u64), Arg::U32(size_u32(FAMILY, "width", d)?)]),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rows_are_listed_by_key_in_order() {
        let l = lists_by_key(&[2, 0, 2, 1, 0], 4).unwrap();
        assert_eq!(l.offsets, vec![0, 2, 3, 5, 5]);
        assert_eq!(l.list, vec![1, 4, 3, 0, 2]);
        let e = lists_by_key(&[0, 4], 4).unwrap_err().to_string();
        assert!(e.contains("row 1 has key 4 of 4"), "{e}");
    }

    proptest! {
        /// Every row appears once, under its own key, the keys' rows in increasing order.
        #[test]
        fn lists_cover_every_row_once(keys in proptest::collection::vec(0u32..7, 0..60)) {
            let l = lists_by_key(&keys, 7).unwrap();
            prop_assert_eq!(l.offsets.len(), 8);
            prop_assert_eq!(*l.offsets.last().unwrap() as usize, keys.len());
            for k in 0..7 {
                let rows = &l.list[l.offsets[k] as usize..l.offsets[k + 1] as usize];
                prop_assert!(rows.windows(2).all(|w| w[0] < w[1]));
                prop_assert!(rows.iter().all(|&r| keys[r as usize] == k as u32));
            }
        }
    }
}
