//! A token once per rank, in all four exchanges of an MoE layer. At top-k a token whose choices
//! land on several experts of one rank would travel there once per choice, and each of its
//! results, output gradients and input gradients once per choice too (a row per (token, choice):
//! every slot-based dispatcher). As DeepEP does across nodes, the holder here combines what it
//! computed for a token before it answers:
//!
//! - dispatch: each distinct token's row once, a u32 index per slot and the slot's combine
//!   weight (f32); the receiver rebuilds the slot-per-row buffer bit for bit;
//! - results: per distinct token, Σ w · y over its slots on the holder (slot order, from zero);
//! - output gradients: each distinct token's gradient once; the holder makes each slot's
//!   w · g (one f32 product: the sender's own bits);
//! - input gradients: per distinct token, Σ dx over its slots, and per slot the combine
//!   weight's gradient ⟨g, y⟩, which only the holder of y can compute.
//!
//! A buffer takes this form only when its dispatch is strictly smaller than the rows in place
//! (a token sent twice, and rows wide enough to pay for index and weight): then every exchange
//! is smaller too, a buffer's length says which form the dispatch has, and at top-1 nothing
//! changes. The sums on the holder change the order of the layer's additions, so
//! `--deterministic` (whose bits may not depend on where an expert is) keeps a row per slot.
//!
//! Every count, index and length a peer sends is checked before anything is sized from it.

use std::collections::HashMap;

use lazarus_comm::bytes_to_f32;

use crate::error::RuntimeError;

/// Whether this process sends a row per slot even where a token could go once:
/// `LAZARUS_DISPATCH=per-slot`, the "before" of the benchmarks (read once). Ranks may differ: a
/// buffer's length says its form.
pub(super) fn per_slot_forced() -> bool {
    static PER_SLOT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PER_SLOT.get_or_init(|| std::env::var("LAZARUS_DISPATCH").is_ok_and(|v| v == "per-slot"))
}

/// The plan for one buffer of token rows bound for one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Distinct {
    /// The distinct tokens, in the order of their first row in the buffer.
    pub(super) tokens: Vec<u32>,
    /// Per row of the buffer: its token's place in `tokens`.
    pub(super) index: Vec<u32>,
}

/// Bytes of a buffer of `rows` rows of `d` f32 values in place.
fn in_place_bytes(rows: usize, d: usize) -> usize {
    4 * rows * d
}

/// Bytes of the dispatch form: the distinct count, an index and a weight per row, the rows.
fn dispatch_bytes(rows: usize, distinct: usize, d: usize) -> usize {
    4 + 8 * rows + 4 * distinct * d
}

impl Distinct {
    /// The plan for a buffer whose row i is token `token_of_row[i]`'s, or None when sending the
    /// rows in place is no larger.
    pub(super) fn plan(token_of_row: &[u32], d: usize) -> Option<Distinct> {
        let mut place: HashMap<u32, u32> = HashMap::with_capacity(token_of_row.len());
        let mut tokens = Vec::new();
        let index: Vec<u32> = token_of_row
            .iter()
            .map(|&tok| {
                *place.entry(tok).or_insert_with(|| {
                    tokens.push(tok);
                    tokens.len() as u32 - 1
                })
            })
            .collect();
        (dispatch_bytes(index.len(), tokens.len(), d) < in_place_bytes(index.len(), d)).then_some(Distinct { tokens, index })
    }

    /// The dispatch form: `weight[i]` is row i's combine weight, `row(token)` the token's d values.
    pub(super) fn encode_dispatch<'a>(&self, weight: &[f32], d: usize, row: impl Fn(u32) -> &'a [f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(dispatch_bytes(self.index.len(), self.tokens.len(), d));
        out.extend_from_slice(&(self.tokens.len() as u32).to_le_bytes());
        self.index.iter().for_each(|i| out.extend_from_slice(&i.to_le_bytes()));
        weight.iter().for_each(|w| out.extend_from_slice(&w.to_le_bytes()));
        self.tokens.iter().for_each(|&tok| row(tok).iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())));
        out
    }
}

/// How a buffer from one rank came in the forward; every later exchange with that rank for
/// the layer follows it.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Arrival {
    /// A row per slot.
    InPlace,
    /// Each distinct token once: row i is distinct row `index[i]`, its combine weight `weight[i]`.
    Distinct { index: Vec<u32>, distinct: usize, weight: Vec<f32> },
}

fn invalid(what: &'static str, src: usize, reason: String) -> RuntimeError {
    RuntimeError::Invalid { field: what, reason: format!("rank {src} {reason}") }
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// The `rows` × d rows of a dispatch buffer from rank `src`, in place, and how they came.
pub(super) fn decode_dispatch(
    bytes: &[u8],
    rows: usize,
    d: usize,
    src: usize,
    what: &'static str,
) -> Result<(Vec<f32>, Arrival), RuntimeError> {
    if bytes.len() == in_place_bytes(rows, d) {
        return Ok((bytes_to_f32(bytes)?, Arrival::InPlace));
    }
    if bytes.len() < 4 {
        return Err(invalid(what, src, format!("sent {} bytes, expected {rows} rows of {d} values", bytes.len())));
    }
    let distinct = le_u32(bytes) as usize;
    if distinct > rows || bytes.len() != dispatch_bytes(rows, distinct, d) {
        return Err(invalid(
            what,
            src,
            format!(
                "sent {} bytes with {distinct} distinct rows: neither {rows} rows of {d} values nor an index over at most that many",
                bytes.len()
            ),
        ));
    }
    let index: Vec<u32> = bytes[4..4 + 4 * rows].chunks_exact(4).map(le_u32).collect();
    if let Some((i, &j)) = index.iter().enumerate().find(|(_, &j)| j as usize >= distinct) {
        return Err(invalid(what, src, format!("indexed distinct row {j} for row {i}, of {distinct}")));
    }
    let weight = bytes_to_f32(&bytes[4 + 4 * rows..4 + 8 * rows])?;
    let values = bytes_to_f32(&bytes[4 + 8 * rows..])?;
    let mut out = Vec::with_capacity(rows * d);
    index.iter().for_each(|&j| out.extend_from_slice(&values[j as usize * d..(j as usize + 1) * d]));
    Ok((out, Arrival::Distinct { index, distinct, weight }))
}

/// Exactly `values` f32 values from rank `src`.
pub(super) fn decode_exact(bytes: &[u8], values: usize, src: usize, what: &'static str) -> Result<Vec<f32>, RuntimeError> {
    if bytes.len() != 4 * values {
        return Err(invalid(what, src, format!("sent {} bytes, expected {values} values", bytes.len())));
    }
    Ok(bytes_to_f32(bytes)?)
}

/// Per distinct row j: Σ over the rows i with index[i] = j of weight[i] · rows[i] (1 without
/// weights), in row order from zero. `rows` holds index.len() rows of d values.
pub(super) fn sum_by_token(index: &[u32], distinct: usize, weight: Option<&[f32]>, rows: &[f32], d: usize) -> Vec<f32> {
    let mut out = vec![0f32; distinct * d];
    for (i, &j) in index.iter().enumerate() {
        let (to, from) = (&mut out[j as usize * d..(j as usize + 1) * d], &rows[i * d..(i + 1) * d]);
        match weight {
            Some(w) => to.iter_mut().zip(from).for_each(|(o, &x)| *o += w[i] * x),
            None => to.iter_mut().zip(from).for_each(|(o, &x)| *o += x),
        }
    }
    out
}

/// Adds distinct row j of `rows` (d values each) into row `tokens[j]` of `sum`, in order: where
/// a token rank takes in what the holders combined.
pub(super) fn add_by_token(sum: &mut [f32], tokens: &[u32], rows: &[f32], d: usize) {
    for (j, &tok) in tokens.iter().enumerate() {
        let to = &mut sum[tok as usize * d..(tok as usize + 1) * d];
        to.iter_mut().zip(&rows[j * d..(j + 1) * d]).for_each(|(o, &x)| *o += x);
    }
}

/// Per row i: weight[i] · distinct[index[i]] (d values each).
pub(super) fn expand_scaled(index: &[u32], weight: &[f32], distinct: &[f32], d: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(index.len() * d);
    for (&j, &w) in index.iter().zip(weight) {
        out.extend(distinct[j as usize * d..(j as usize + 1) * d].iter().map(|&x| x * w));
    }
    out
}

/// Per row i: ⟨distinct[index[i]], rows[i]⟩ over d values.
pub(super) fn dots(index: &[u32], distinct: &[f32], rows: &[f32], d: usize) -> Vec<f32> {
    index
        .iter()
        .enumerate()
        .map(|(i, &j)| distinct[j as usize * d..(j as usize + 1) * d].iter().zip(&rows[i * d..(i + 1) * d]).map(|(a, b)| a * b).sum())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn row_of(tok: u32, d: usize) -> Vec<f32> {
        (0..d).map(|c| tok as f32 * 10.0 + c as f32 * 0.5 - 3.0).collect()
    }

    #[test]
    fn a_buffer_without_repeats_or_with_narrow_rows_stays_in_place() {
        assert_eq!(Distinct::plan(&[3, 1, 2], 8), None, "no token twice");
        assert_eq!(Distinct::plan(&[], 8), None);
        // Two rows of one token at d = 2: 4 + 16 + 8 bytes against 16.
        assert_eq!(Distinct::plan(&[5, 5], 2), None);
        let p = Distinct::plan(&[5, 7, 5, 5, 7], 4).expect("smaller");
        assert_eq!((p.tokens, p.index), (vec![5, 7], vec![0, 1, 0, 0, 1]));
    }

    #[test]
    fn the_holders_sums_are_the_sums_of_the_slots() {
        // Rows 0 and 2 are token A's, row 1 token B's.
        let index = [0, 1, 0];
        let rows = [1.0f32, 2.0, 10.0, 20.0, 100.0, 200.0];
        assert_eq!(sum_by_token(&index, 2, None, &rows, 2), vec![101.0, 202.0, 10.0, 20.0]);
        assert_eq!(sum_by_token(&index, 2, Some(&[0.5, 2.0, 0.25]), &rows, 2), vec![25.5, 51.0, 20.0, 40.0]);
        let g = [1.0f32, -1.0, 3.0, 0.0];
        assert_eq!(expand_scaled(&index, &[2.0, 1.0, -1.0], &g, 2), vec![2.0, -2.0, 3.0, 0.0, -1.0, 1.0]);
        assert_eq!(dots(&index, &g, &rows, 2), vec![-1.0, 30.0, -100.0]);
        // Two holders' sums for tokens 2 and 0 of three, taken in.
        let mut sum = vec![0f32; 6];
        add_by_token(&mut sum, &[2, 0], &[1.0, 2.0, 3.0, 4.0], 2);
        add_by_token(&mut sum, &[2], &[0.5, 0.5], 2);
        assert_eq!(sum, vec![3.0, 4.0, 0.0, 0.0, 1.5, 2.5]);
    }

    proptest! {
        /// The rows a receiver rebuilds are the rows in place, bit for bit, with each row's
        /// weight; the scaled gradients are each w · g computed once, as the sender would.
        #[test]
        fn the_rebuilt_buffer_is_the_buffer_in_place(tokens in prop::collection::vec(0u32..6, 0..40), d in 1usize..9, seed in 0u32..1000) {
            let rows: Vec<Vec<f32>> = (0..6).map(|t| row_of(t, d)).collect();
            let in_place: Vec<f32> = tokens.iter().flat_map(|&t| rows[t as usize].clone()).collect();
            let weight: Vec<f32> = (0..tokens.len()).map(|i| ((i as u32 * 7 + seed) % 13) as f32 / 7.0 - 0.9).collect();
            let bytes = match Distinct::plan(&tokens, d) {
                Some(p) => {
                    prop_assert!(p.tokens.len() < tokens.len());
                    p.encode_dispatch(&weight, d, |t| &rows[t as usize])
                }
                None => lazarus_comm::f32_to_bytes(&in_place),
            };
            prop_assert!(bytes.len() <= 4 * in_place.len());
            let (got, arrival) = decode_dispatch(&bytes, tokens.len(), d, 1, "rows").unwrap();
            prop_assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), in_place.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            if let Arrival::Distinct { index, distinct, weight: w } = arrival {
                prop_assert_eq!(&w, &weight);
                let distinct_rows: Vec<f32> = (0..distinct).flat_map(|j| {
                    let i = index.iter().position(|&x| x as usize == j).unwrap();
                    rows[tokens[i] as usize].clone()
                }).collect();
                let scaled: Vec<f32> = tokens.iter().zip(&weight).flat_map(|(&t, &w)| rows[t as usize].iter().map(move |&x| x * w)).collect();
                let got = expand_scaled(&index, &w, &distinct_rows, d);
                prop_assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), scaled.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn what_a_peer_sends_is_checked() {
        let d = 8;
        let rows: Vec<Vec<f32>> = (0..3).map(|t| row_of(t, d)).collect();
        let p = Distinct::plan(&[0, 1, 0, 1, 2, 0], d).unwrap();
        let good = p.encode_dispatch(&[1.0; 6], d, |t| &rows[t as usize]);
        let err = |bytes: &[u8]| decode_dispatch(bytes, 6, d, 2, "dispatched tokens").unwrap_err().to_string();
        // Short, or a count beyond the rows, or bytes that match no form.
        assert!(err(&good[..3]).contains("rank 2"), "{}", err(&good[..3]));
        let mut too_many = good.clone();
        too_many[..4].copy_from_slice(&7u32.to_le_bytes());
        assert!(err(&too_many).contains("7 distinct"), "{}", err(&too_many));
        assert!(err(&good[..good.len() - 4]).contains("dispatched tokens"));
        // An index past the distinct rows.
        let mut bad_index = good.clone();
        bad_index[4..8].copy_from_slice(&3u32.to_le_bytes());
        assert!(err(&bad_index).contains("distinct row 3 for row 0"), "{}", err(&bad_index));
        // A later exchange of the wrong length.
        let e = decode_exact(&[0u8; 12], 4, 3, "expert results").unwrap_err().to_string();
        assert!(e.contains("rank 3") && e.contains("12 bytes") && e.contains("expert results"), "{e}");
    }
}
