//! The MoE layer's row movement and the embedding.

use super::{alloc, check_ids};
use crate::{lists_by_key, Device, Dtype, Elem, RowLists};

/// The row lists on the device: (offsets, list).
fn upload_lists<D: Device>(dev: &D, l: &RowLists) -> Result<(D::Buffer, D::Buffer), D::Error> {
    // An empty list still gets a buffer (one element) so that its address is valid.
    let list = if l.list.is_empty() { dev.upload_u32(&[0])? } else { dev.upload_u32(&l.list)? };
    Ok((dev.upload_u32(&l.offsets)?, list))
}

/// out [R, d] = src [n, d] rows `tokens` (R of them, each below n: checked).
pub fn gather_rows_fwd<D: Device>(dev: &D, dt: Dtype, src: u64, tokens: &[u32], n: usize, d: usize) -> Result<D::Buffer, D::Error> {
    check_ids("gather rows", tokens, n)?;
    let out = alloc(dev, dt, tokens.len() * d)?;
    if !tokens.is_empty() && d > 0 {
        let idx = dev.upload_u32(tokens)?;
        // SAFETY: src is [n, d]; every token below n; out is [R, d].
        unsafe { dev.launch(&crate::gather_rows(dt, src, dev.addr(&idx), dev.addr(&out), tokens.len(), d)?)? };
    }
    Ok(out)
}

/// The gather's backward: dsrc [n, d] (of `out_dt`), each row the sum of the gradient rows g [R, d]
/// (of `g_dt`) gathered from it, in row order.
#[allow(clippy::too_many_arguments)]
pub fn gather_rows_bwd<D: Device>(
    dev: &D,
    g_dt: Dtype,
    out_dt: Dtype,
    g: u64,
    tokens: &[u32],
    n: usize,
    d: usize,
) -> Result<D::Buffer, D::Error> {
    let lists = lists_by_key(tokens, n)?;
    let out = alloc(dev, out_dt, n * d)?;
    if n > 0 && d > 0 {
        let (off, list) = upload_lists(dev, &lists)?;
        let l = crate::sum_listed_rows(g_dt, out_dt, g, 0, 0, dev.addr(&off), dev.addr(&list), dev.addr(&out), n, d)?;
        // SAFETY: g is [R, d]; the lists hold rows below R; out is [n, d].
        unsafe { dev.launch(&l)? };
    }
    Ok(out)
}

/// Where each row's combine weight is: w[r] (`None`), or w[slots[r]] for a weight per
/// assignment slot (token · k + j, `Some((slots, weights))`, each slot below `weights` and
/// named by one row at most: checked).
pub type WeightSlots<'a> = Option<(&'a [u32], usize)>;

fn check_slots(slots: WeightSlots, rows: usize) -> Result<(), crate::KernelError> {
    let Some((s, weights)) = slots else { return Ok(()) };
    if s.len() != rows {
        return Err(crate::KernelError::Size { family: "combine rows", what: format!("{} slots for {rows} rows", s.len()) });
    }
    check_ids("combine rows slots", s, weights)?;
    let mut seen = vec![false; weights];
    for (r, &x) in s.iter().enumerate() {
        if std::mem::replace(&mut seen[x as usize], true) {
            return Err(crate::KernelError::Size { family: "combine rows", what: format!("slot {x} named twice (row {r})") });
        }
    }
    Ok(())
}

/// out [n, d] (of `out_dt`): out[t] = Σ over the rows r of token t (in order) of w[s(r)] · y[r];
/// y [R, d] of `y_dt`, w of its accumulator type (per row, or per slot: `slots`), tokens [R] each
/// below n (checked).
#[allow(clippy::too_many_arguments)]
pub fn combine_rows_fwd<D: Device>(
    dev: &D,
    y_dt: Dtype,
    out_dt: Dtype,
    y: u64,
    w: u64,
    slots: WeightSlots,
    tokens: &[u32],
    n: usize,
    d: usize,
) -> Result<D::Buffer, D::Error> {
    let lists = lists_by_key(tokens, n)?;
    check_slots(slots, tokens.len())?;
    let out = alloc(dev, out_dt, n * d)?;
    if n > 0 && d > 0 {
        let (off, list) = upload_lists(dev, &lists)?;
        let sb = match slots {
            Some((s, _)) if !s.is_empty() => Some(dev.upload_u32(s)?),
            _ => None,
        };
        let sa = sb.as_ref().map_or(0, |b| dev.addr(b));
        let l = crate::sum_listed_rows(y_dt, out_dt, y, w, sa, dev.addr(&off), dev.addr(&list), dev.addr(&out), n, d)?;
        // SAFETY: y is [R, d]; w holds a weight for each row (or slot: checked); the lists hold
        // rows below R; out is [n, d].
        unsafe { dev.launch(&l)? };
    }
    Ok(out)
}

/// The combine's backward from g [n, d] (of `g_dt`): (dy [R, d] of `y_dt`, dw of y's
/// accumulator type: [R], or per slot — zero for a slot no row names).
#[allow(clippy::too_many_arguments)]
pub fn combine_rows_bwd<D: Device>(
    dev: &D,
    y_dt: Dtype,
    g_dt: Dtype,
    y: u64,
    w: u64,
    slots: WeightSlots,
    g: u64,
    tokens: &[u32],
    n: usize,
    d: usize,
) -> Result<(D::Buffer, D::Buffer), D::Error> {
    check_ids("combine rows", tokens, n)?;
    check_slots(slots, tokens.len())?;
    let rows = tokens.len();
    let dy = alloc(dev, y_dt, rows * d)?;
    let dw = match slots {
        Some((_, weights)) => dev.zeros(Elem::Float(y_dt.acc()), weights)?,
        None => alloc(dev, Elem::Float(y_dt.acc()), rows)?,
    };
    if rows > 0 {
        let t = dev.upload_u32(tokens)?;
        let sb = match slots {
            Some((s, _)) => Some(dev.upload_u32(s)?),
            None => None,
        };
        let sa = sb.as_ref().map_or(0, |b| dev.addr(b));
        let l = crate::combine_rows_bwd(y_dt, g_dt, y, w, sa, g, dev.addr(&t), dev.addr(&dy), dev.addr(&dw), rows, d)?;
        // SAFETY: y [R, d], w per row or slot (checked), g [n, d], every token below n; dy and dw
        // allocated above.
        unsafe { dev.launch(&l)? };
    }
    Ok((dy, dw))
}

/// The embedding of `ids` (b·t of them, each below `vocab`: checked): out [b·t, d] = tok[id] +
/// pos[position], tok [vocab, d], pos [≥ t, d].
#[allow(clippy::too_many_arguments)]
pub fn embed_fwd<D: Device>(
    dev: &D,
    dt: Dtype,
    tok: u64,
    pos: u64,
    ids: &[u32],
    vocab: usize,
    t: usize,
    d: usize,
) -> Result<D::Buffer, D::Error> {
    check_ids("embedding", ids, vocab)?;
    if t == 0 || !ids.len().is_multiple_of(t) {
        return Err(crate::KernelError::Size { family: "embedding", what: format!("{} ids are not sequences of {t}", ids.len()) }.into());
    }
    let out = alloc(dev, dt, ids.len() * d)?;
    if !ids.is_empty() && d > 0 {
        let idb = dev.upload_u32(ids)?;
        // SAFETY: tok [vocab, d], pos [≥ t, d], every id below vocab; out [b·t, d].
        unsafe { dev.launch(&crate::embed_fwd(dt, tok, pos, dev.addr(&idb), dev.addr(&out), ids.len(), t, d)?)? };
    }
    Ok(out)
}

/// The embedding's backward from g [b·t, d]: (dtok [vocab, d], dpos [t, d]), each row the sum of
/// its rows of g in order.
#[allow(clippy::too_many_arguments)]
pub fn embed_bwd<D: Device>(
    dev: &D,
    dt: Dtype,
    g: u64,
    ids: &[u32],
    vocab: usize,
    t: usize,
    d: usize,
) -> Result<(D::Buffer, D::Buffer), D::Error> {
    if t == 0 || !ids.len().is_multiple_of(t) {
        return Err(crate::KernelError::Size { family: "embedding", what: format!("{} ids are not sequences of {t}", ids.len()) }.into());
    }
    let dtok = gather_rows_bwd(dev, dt, dt, g, ids, vocab, d)?;
    let positions: Vec<u32> = (0..ids.len()).map(|r| (r % t) as u32).collect();
    let dpos = gather_rows_bwd(dev, dt, dt, g, &positions, t, d)?;
    Ok((dtok, dpos))
}
