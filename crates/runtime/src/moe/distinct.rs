//! Each distinct token row once per destination rank. At top-k a token whose choices land on
//! several experts of one rank would travel once per choice (every slot-based dispatcher sends a
//! row per (token, choice)); DeepEP sends it once per rank instead. This codec does the same for
//! the two exchanges that carry a token's own row towards the expert holders:
//!
//! - the dispatch: each distinct token's row once, then the buffer's rows are rebuilt from an
//!   index (one u32 per slot);
//! - the output gradients of the backward: a slot's gradient is its combine weight times the
//!   token's output gradient (the combine is linear in the slots), so each distinct token's
//!   gradient goes once with one f32 weight per slot, and the receiver multiplies — one f32
//!   product, the same bits as the sender's own `g · w`.
//!
//! A buffer is sent this way only when it is strictly smaller than the rows in place (a token
//! sent twice and rows wide enough to pay for the index), so a buffer's length says which form
//! it has, and at top-1 nothing changes on the wire. The receiver rebuilds exactly the buffer
//! the slot-per-row form would have carried: everything after the wire is unchanged.
//!
//! Every length and index a peer sends is checked before anything is allocated from it.

use std::collections::HashMap;

use lazarus_comm::bytes_to_f32;

use crate::error::RuntimeError;

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

/// Bytes of the dispatch form: the distinct count, the index, the distinct rows.
fn dispatch_bytes(rows: usize, distinct: usize, d: usize) -> usize {
    4 + 4 * rows + 4 * distinct * d
}

/// Bytes of the output-gradient form: a weight per row, the distinct rows.
fn gradient_bytes(rows: usize, distinct: usize, d: usize) -> usize {
    4 * rows + 4 * distinct * d
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
        // The gradient form is smaller whenever the dispatch form is (it lacks the count).
        (dispatch_bytes(index.len(), tokens.len(), d) < in_place_bytes(index.len(), d)).then_some(Distinct { tokens, index })
    }

    /// The dispatch form: `row(token)` is the token's row of d values.
    pub(super) fn encode_rows<'a>(&self, d: usize, row: impl Fn(u32) -> &'a [f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(dispatch_bytes(self.index.len(), self.tokens.len(), d));
        out.extend_from_slice(&(self.tokens.len() as u32).to_le_bytes());
        self.index.iter().for_each(|i| out.extend_from_slice(&i.to_le_bytes()));
        self.tokens.iter().for_each(|&tok| row(tok).iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())));
        out
    }

    /// The output-gradient form: `weight[i]` scales row i's token gradient, `row(j)` is the
    /// j-th distinct token's gradient (d values).
    pub(super) fn encode_scaled<'a>(&self, weight: &[f32], d: usize, row: impl Fn(usize) -> &'a [f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(gradient_bytes(self.index.len(), self.tokens.len(), d));
        weight.iter().for_each(|w| out.extend_from_slice(&w.to_le_bytes()));
        (0..self.tokens.len()).for_each(|j| row(j).iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())));
        out
    }
}

/// How a buffer from one rank came in the forward: the backward's output gradients for the
/// same rows come the same way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Arrival {
    /// A row per slot.
    InPlace,
    /// Each distinct token once: row i is distinct row `index[i]`.
    Distinct { index: Vec<u32>, distinct: usize },
}

fn invalid(what: &'static str, src: usize, reason: String) -> RuntimeError {
    RuntimeError::Invalid { field: what, reason: format!("rank {src} {reason}") }
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// The `rows` × d rows of a dispatch buffer from rank `src`, in place, and how they came.
pub(super) fn decode_rows(
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
        return Err(invalid(what, src, format!("sent {} bytes, expected {} rows of {d} values", bytes.len(), rows)));
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
    let values = bytes_to_f32(&bytes[4 + 4 * rows..])?;
    let mut out = Vec::with_capacity(rows * d);
    index.iter().for_each(|&j| out.extend_from_slice(&values[j as usize * d..(j as usize + 1) * d]));
    Ok((out, Arrival::Distinct { index, distinct }))
}

/// The `rows` × d output gradients from rank `src` for the rows that came as `arrival`: in
/// place, or each distinct token's gradient times each row's weight.
pub(super) fn decode_scaled(
    bytes: &[u8],
    arrival: &Arrival,
    rows: usize,
    d: usize,
    src: usize,
    what: &'static str,
) -> Result<Vec<f32>, RuntimeError> {
    let expected = match arrival {
        Arrival::InPlace => in_place_bytes(rows, d),
        Arrival::Distinct { index, distinct } if index.len() == rows => gradient_bytes(rows, *distinct, d),
        Arrival::Distinct { index, .. } => {
            return Err(invalid(what, src, format!("sent {} rows in the forward, {rows} expected now", index.len())));
        }
    };
    if bytes.len() != expected {
        return Err(invalid(what, src, format!("sent {} bytes, expected {expected}", bytes.len())));
    }
    let Arrival::Distinct { index, .. } = arrival else {
        return Ok(bytes_to_f32(bytes)?);
    };
    let values = bytes_to_f32(bytes)?;
    let (weight, distinct_rows) = values.split_at(rows);
    let mut out = Vec::with_capacity(rows * d);
    for (&w, &j) in weight.iter().zip(index) {
        out.extend(distinct_rows[j as usize * d..(j as usize + 1) * d].iter().map(|&x| x * w));
    }
    Ok(out)
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
        // Two rows of one token at d = 1: 4 + 8 + 4 bytes against 8.
        assert_eq!(Distinct::plan(&[5, 5], 1), None);
        let p = Distinct::plan(&[5, 7, 5, 5, 7], 4).expect("smaller");
        assert_eq!((p.tokens, p.index), (vec![5, 7], vec![0, 1, 0, 0, 1]));
    }

    proptest! {
        /// The rows a receiver rebuilds are the rows in place, bit for bit, and so are the
        /// scaled gradients (each w · g computed once, as the sender would).
        #[test]
        fn the_rebuilt_buffer_is_the_buffer_in_place(tokens in prop::collection::vec(0u32..6, 0..40), d in 1usize..9, seed in 0u32..1000) {
            let rows: Vec<Vec<f32>> = (0..6).map(|t| row_of(t, d)).collect();
            let in_place: Vec<f32> = tokens.iter().flat_map(|&t| rows[t as usize].clone()).collect();
            let weight: Vec<f32> = (0..tokens.len()).map(|i| ((i as u32 * 7 + seed) % 13) as f32 / 7.0 - 0.9).collect();
            let scaled: Vec<f32> = tokens.iter().zip(&weight).flat_map(|(&t, &w)| rows[t as usize].iter().map(move |&x| x * w)).collect();
            let (bytes, grads) = match Distinct::plan(&tokens, d) {
                Some(p) => {
                    prop_assert!(p.tokens.len() < tokens.len());
                    let g = p.encode_scaled(&weight, d, |j| &rows[p.tokens[j] as usize]);
                    (p.encode_rows(d, |t| &rows[t as usize]), g)
                }
                None => (lazarus_comm::f32_to_bytes(&in_place), lazarus_comm::f32_to_bytes(&scaled)),
            };
            prop_assert!(bytes.len() <= 4 * in_place.len());
            let (got, arrival) = decode_rows(&bytes, tokens.len(), d, 1, "rows").unwrap();
            prop_assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), in_place.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            let got = decode_scaled(&grads, &arrival, tokens.len(), d, 1, "grads").unwrap();
            prop_assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), scaled.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn what_a_peer_sends_is_checked() {
        let d = 4;
        let rows: Vec<Vec<f32>> = (0..3).map(|t| row_of(t, d)).collect();
        let p = Distinct::plan(&[0, 1, 0, 1, 2, 0], d).unwrap();
        let good = p.encode_rows(d, |t| &rows[t as usize]);
        let err = |bytes: &[u8]| decode_rows(bytes, 6, d, 2, "dispatched tokens").unwrap_err().to_string();
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
        // Gradients of the wrong length, or for a different number of rows.
        let (_, arrival) = decode_rows(&good, 6, d, 2, "dispatched tokens").unwrap();
        let grads = p.encode_scaled(&[1.0; 6], d, |j| &rows[p.tokens[j] as usize]);
        assert!(decode_scaled(&grads[..grads.len() - 4], &arrival, 6, d, 2, "output gradients")
            .unwrap_err()
            .to_string()
            .contains("expected"));
        assert!(decode_scaled(&grads, &arrival, 5, d, 2, "output gradients").unwrap_err().to_string().contains("6 rows"));
        assert!(decode_scaled(&grads, &Arrival::InPlace, 6, d, 2, "output gradients").is_err());
    }
}
