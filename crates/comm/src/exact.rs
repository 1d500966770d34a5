//! Sums whose bits do not depend on their order: the arithmetic of deterministic training.
//!
//! A float sum depends on the order of its terms (`(a + b) + c` need not be `a + (b + c)`), so
//! the same gradients summed by one worker or by four, or in another order after a failure,
//! differ in their last bits — and those differences grow with every step. Here every term is
//! turned into a fixed-point integer first, [`FRACTION_BITS`] bits below the point, in an
//! `i128`: integer addition is associative and commutative, so a sum of the same terms is the
//! same integer however the terms are grouped, ordered or spread over ranks; it is rounded to
//! f32 once, at the end.
//!
//! What it gives up: a term's bits below 2⁻⁹⁶ (≈ 1.3e-29) are dropped (truncated toward zero, the
//! same way every time), and a term or sum of magnitude 2³⁰ (≈ 1.1e9) or more is refused
//! ([`ExactError`]) rather than wrapped. Gradients live far inside that range.

use std::borrow::Cow;
use std::time::Duration;

use thiserror::Error;

use crate::collectives::ring_all_reduce;
use crate::{all_gather, CommError, Group, Transport, RING_THRESHOLD_BYTES};

/// Bits below the binary point: a term's unit in the last place is 2⁻⁹⁶.
pub const FRACTION_BITS: i32 = 96;

/// A term or a sum at least this large (2³⁰) is out of range: with 96 fraction bits it leaves
/// one bit of an `i128` for the sign and one spare, so that adding two in-range values never
/// wraps before the check.
pub const LIMIT: f64 = (1u64 << 30) as f64;

/// Why a value cannot enter an exact sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum ExactError {
    /// A NaN or an infinity (the training step diverged); the value's bits.
    #[error("value {index} is {}, not a finite number", f32::from_bits(*.bits))]
    NotFinite { index: usize, bits: u32 },
    /// A term of magnitude 2³⁰ or more; the value's bits.
    #[error("value {index} is {}: an exact sum holds magnitudes below 2^30", f32::from_bits(*.bits))]
    TermOutOfRange { index: usize, bits: u32 },
    /// A sum that reached 2³⁰.
    #[error("the sum at {index} reached 2^30 or more")]
    SumOutOfRange { index: usize },
    /// Two sums of different lengths.
    #[error("a sum of {got} values added to one of {expected}")]
    Length { got: usize, expected: usize },
}

/// `x` as a fixed-point integer (exact for |x| ≥ 2⁻⁷³ — an f32's 24 bits all lie above 2⁻⁹⁶ —
/// truncated toward zero below), from its bits: no float arithmetic, no library call.
fn to_fixed(index: usize, x: f32) -> Result<i128, ExactError> {
    let bits = x.to_bits();
    let exponent = ((bits >> 23) & 0xff) as i32;
    if exponent == 0xff {
        return Err(ExactError::NotFinite { index, bits });
    }
    // |x| = m · 2^(exponent − 150) (normal: the implicit bit; subnormal: exponent 1).
    let (m, exponent) = if exponent == 0 { (bits & 0x7f_ffff, 1) } else { ((bits & 0x7f_ffff) | 0x80_0000, exponent) };
    // x · 2^96 = m · 2^(exponent − 54).
    let shift = exponent - 150 + FRACTION_BITS;
    if exponent - 127 >= 30 {
        return Err(ExactError::TermOutOfRange { index, bits });
    }
    let magnitude = if shift >= 0 {
        i128::from(m) << shift
    } else if shift > -32 {
        i128::from(m >> -shift)
    } else {
        0
    };
    Ok(if bits >> 31 == 1 { -magnitude } else { magnitude })
}

/// The f32 nearest to a fixed-point value (through f64: both roundings are the same on every
/// machine, so the result is too).
fn to_f32(v: i128) -> f32 {
    ((v as f64) * 2f64.powi(-FRACTION_BITS)) as f32
}

/// Whether a fixed-point value is in range.
fn in_range(v: i128) -> bool {
    v.unsigned_abs() < 1u128 << (30 + FRACTION_BITS)
}

/// Adds `terms` into `acc` (`offset`: the first element's index, for errors), one part a core
/// for a long vector, each part in one pass. On error every part's additions are taken back
/// (each term's fixed-point value is a pure function of it) and the first error in index order
/// is returned.
fn add_in_parts(acc: &mut [i128], terms: &[f32], offset: usize) -> Result<(), ExactError> {
    const PART_MIN: usize = 1 << 16;
    // (Read once: asking the kernel and the cgroup files on every call costs.)
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |c| c.get()));
    if terms.len() < 2 * PART_MIN || cores == 1 {
        return add_part(offset, acc, terms);
    }
    let part = terms.len().div_ceil(cores).max(PART_MIN);
    let results: Vec<Result<(), ExactError>> = std::thread::scope(|s| {
        let handles: Vec<_> = acc
            .chunks_mut(part)
            .zip(terms.chunks(part))
            .enumerate()
            .map(|(k, (a, t))| s.spawn(move || add_part(offset + k * part, a, t)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    });
    let Some(first) = results.iter().find_map(|r| r.err()) else { return Ok(()) };
    // The parts that went through are taken back too (a failed one took back its own).
    for ((r, a), t) in results.iter().zip(acc.chunks_mut(part)).zip(terms.chunks(part)) {
        if r.is_ok() {
            take_back(a, t);
        }
    }
    Err(first)
}

/// Adds a part (`first`: its first element's index); on error, takes back what it added and
/// says where it failed.
fn add_part(first: usize, acc: &mut [i128], terms: &[f32]) -> Result<(), ExactError> {
    for (i, (a, &x)) in acc.iter_mut().zip(terms).enumerate() {
        let index = first + i;
        let added = to_fixed(index, x).and_then(|t| if in_range(*a + t) { Ok(t) } else { Err(ExactError::SumOutOfRange { index }) });
        match added {
            Ok(t) => *a += t,
            Err(e) => {
                take_back(&mut acc[..i], &terms[..i]);
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Subtracts what adding `terms` (all in range, all added) put into `acc`.
fn take_back(acc: &mut [i128], terms: &[f32]) {
    for (a, &x) in acc.iter_mut().zip(terms) {
        *a -= to_fixed(0, x).unwrap_or(0);
    }
}

/// An element-wise sum of f32 vectors that is the same whatever the order of its terms.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExactSum {
    fixed: Vec<i128>,
}

impl ExactSum {
    /// A sum of `len` zeros.
    pub fn zeros(len: usize) -> Self {
        ExactSum { fixed: vec![0; len] }
    }

    pub fn len(&self) -> usize {
        self.fixed.len()
    }

    pub fn is_empty(&self) -> bool {
        self.fixed.is_empty()
    }

    /// Adds `terms[i]` to element `offset + i`. On error nothing is added. (In place, one
    /// pass, in parts on every core for a long vector — a deterministic step adds each shard's
    /// gradients, millions of values, this way; what a failed call wrote is taken back.)
    pub fn add_f32(&mut self, offset: usize, terms: &[f32]) -> Result<(), ExactError> {
        let end = offset.checked_add(terms.len()).filter(|&e| e <= self.fixed.len());
        let Some(end) = end else {
            return Err(ExactError::Length { got: offset.saturating_add(terms.len()), expected: self.fixed.len() });
        };
        add_in_parts(&mut self.fixed[offset..end], terms, offset)
    }

    /// Adds another sum, element by element. On error nothing is added.
    pub fn add(&mut self, other: &ExactSum) -> Result<(), ExactError> {
        self.add_at(0, other)
    }

    /// Adds `other` to elements `offset..offset + other.len()` (the whole sum: `offset` 0 and
    /// the same length). On error nothing is added.
    pub fn add_at(&mut self, offset: usize, other: &ExactSum) -> Result<(), ExactError> {
        let end = offset.checked_add(other.len()).filter(|&e| e <= self.fixed.len());
        let Some(end) = end else {
            return Err(ExactError::Length { got: offset.saturating_add(other.len()), expected: self.fixed.len() });
        };
        let acc = &mut self.fixed[offset..end];
        // Both in range (below 2^126 in magnitude): their sum cannot wrap.
        if let Some(i) = acc.iter().zip(&other.fixed).position(|(&a, &b)| !in_range(a + b)) {
            return Err(ExactError::SumOutOfRange { index: offset + i });
        }
        acc.iter_mut().zip(&other.fixed).for_each(|(a, &b)| *a += b);
        Ok(())
    }

    /// The sum, each element rounded to f32 once.
    pub fn to_f32(&self) -> Vec<f32> {
        self.fixed.iter().map(|&v| to_f32(v)).collect()
    }

    /// The wire form: 16 little-endian bytes a value.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.fixed.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// A sum from its wire form (a peer's word: checked for length and range).
    pub fn from_bytes(b: &[u8]) -> Result<Self, ExactError> {
        if !b.len().is_multiple_of(16) {
            return Err(ExactError::Length { got: b.len(), expected: b.len().next_multiple_of(16) });
        }
        let fixed: Vec<i128> = b.chunks_exact(16).map(|c| i128::from_le_bytes(c.try_into().expect("16 bytes"))).collect();
        if let Some(i) = fixed.iter().position(|&v| !in_range(v)) {
            return Err(ExactError::SumOutOfRange { index: i });
        }
        Ok(ExactSum { fixed })
    }
}

/// The element-wise sum of every member's `sum`, in place: every member ends with the same
/// bits, and they are those of adding all the terms in any order (see the module's doc).
/// Small sums are gathered whole; large ones go round a ring.
pub fn all_reduce_exact(t: &mut dyn Transport, g: &mut Group, sum: &mut ExactSum, timeout: Duration) -> Result<(), CommError> {
    if g.len() == 1 {
        g.position(t.rank())?;
        return Ok(());
    }
    let len = sum.len();
    if len * 16 <= RING_THRESHOLD_BYTES || len < g.len() {
        let all = all_gather(t, g, &sum.to_bytes(), timeout)?;
        let me = g.position(t.rank())?;
        // (The order of the additions does not matter: this rank's own sum first.)
        let mut total = sum.clone();
        for (i, bytes) in all.iter().enumerate().filter(|&(i, _)| i != me) {
            let peer = g.members()[i];
            let part = ExactSum::from_bytes(bytes).map_err(|e| CommError::Protocol { peer, reason: e.to_string() })?;
            total.add(&part).map_err(|e| CommError::Protocol { peer, reason: format!("all-reduce: {e}") })?;
        }
        *sum = total;
        return Ok(());
    }
    ring_all_reduce(
        t,
        g,
        len,
        timeout,
        sum,
        |s, r| Cow::Owned(s.fixed[r].iter().flat_map(|x| x.to_le_bytes()).collect()),
        |s, r, got, add| {
            let chunk = ExactSum::from_bytes(got).map_err(|e| e.to_string())?;
            if chunk.len() != r.len() {
                return Err(format!("ring chunk of {} values, expected {}", chunk.len(), r.len()));
            }
            if add {
                s.add_at(r.start, &chunk).map_err(|e| e.to_string())
            } else {
                s.fixed[r].copy_from_slice(&chunk.fixed);
                Ok(())
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sum_in_groups(terms: &[Vec<f32>], groups: &[usize]) -> ExactSum {
        // Partial sums over consecutive groups of terms, then the partials added in reverse.
        let len = terms.first().map_or(0, Vec::len);
        let mut partials = Vec::new();
        let mut at = 0usize;
        for &g in groups.iter().chain(std::iter::once(&usize::MAX)) {
            let end = at.saturating_add(g.max(1)).min(terms.len());
            let mut p = ExactSum::zeros(len);
            for t in &terms[at..end] {
                p.add_f32(0, t).unwrap();
            }
            partials.push(p);
            at = end;
            if at == terms.len() {
                break;
            }
        }
        let mut total = ExactSum::zeros(len);
        for p in partials.iter().rev() {
            total.add(p).unwrap();
        }
        total
    }

    proptest! {
        /// The same terms give the same bits whatever their order and grouping (what a float
        /// sum does not).
        #[test]
        fn a_sum_is_the_same_whatever_the_order_and_grouping_of_its_terms(
            terms in prop::collection::vec(prop::collection::vec(-1e6f32..1e6f32, 3), 1..40),
            groups in prop::collection::vec(1usize..6, 0..10),
            seed in any::<u64>(),
        ) {
            let mut shuffled = terms.clone();
            let mut x = seed | 1;
            for i in (1..shuffled.len()).rev() {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                shuffled.swap(i, (x % (i as u64 + 1)) as usize);
            }
            let one_by_one = sum_in_groups(&terms, &[]);
            let grouped = sum_in_groups(&shuffled, &groups);
            prop_assert_eq!(one_by_one.to_f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            grouped.to_f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }

        /// The result is the exact sum rounded: as close as f64 arithmetic gets on terms whose
        /// float sum is exact in f64 (small integers scaled by powers of two).
        #[test]
        fn a_sum_of_values_an_f64_holds_exactly_is_that_value(
            ints in prop::collection::vec(-1000i32..1000, 1..50),
            scale in -20i32..10,
        ) {
            let terms: Vec<f32> = ints.iter().map(|&i| i as f32 * 2f32.powi(scale)).collect();
            let mut s = ExactSum::zeros(1);
            for &t in &terms {
                s.add_f32(0, &[t]).unwrap();
            }
            let want = terms.iter().map(|&t| f64::from(t)).sum::<f64>() as f32;
            prop_assert_eq!(s.to_f32()[0], want);
        }

        /// The conversion from bits is the plain one: x · 2⁹⁶ in f64, truncated toward zero.
        #[test]
        fn a_term_from_its_bits_is_x_times_two_to_the_96_truncated(bits in any::<u32>()) {
            let x = f32::from_bits(bits);
            let plain = (f64::from(x) * 2f64.powi(FRACTION_BITS)) as i128;
            match to_fixed(0, x) {
                Ok(v) => prop_assert_eq!(v, plain),
                Err(_) => prop_assert!(!x.is_finite() || f64::from(x).abs() >= LIMIT),
            }
            if x.is_finite() && f64::from(x).abs() < LIMIT {
                prop_assert!(to_fixed(0, x).is_ok());
            }
        }

        /// The wire form round-trips.
        #[test]
        fn the_wire_form_round_trips(values in prop::collection::vec(-1e8f32..1e8f32, 0..20)) {
            let mut s = ExactSum::zeros(values.len());
            s.add_f32(0, &values).unwrap();
            prop_assert_eq!(ExactSum::from_bytes(&s.to_bytes()).unwrap(), s);
        }
    }

    #[test]
    fn tiny_terms_are_truncated_the_same_way_every_time() {
        let mut s = ExactSum::zeros(2);
        s.add_f32(0, &[1e-35, -1e-35]).unwrap();
        assert_eq!(s.to_f32(), vec![0.0, 0.0]);
        // 2^-80 is kept exactly.
        let mut s = ExactSum::zeros(1);
        s.add_f32(0, &[2f32.powi(-80)]).unwrap();
        assert_eq!(s.to_f32(), vec![2f32.powi(-80)]);
    }

    #[test]
    fn values_out_of_range_are_refused_and_nothing_is_added() {
        let mut s = ExactSum::zeros(3);
        s.add_f32(0, &[1.0, 2.0, 3.0]).unwrap();
        let before = s.clone();
        assert!(matches!(s.add_f32(0, &[1.0, f32::NAN, 0.0]), Err(ExactError::NotFinite { index: 1, .. })));
        assert!(matches!(s.add_f32(0, &[0.0, 0.0, 2e9]), Err(ExactError::TermOutOfRange { index: 2, .. })));
        assert!(matches!(s.add_f32(1, &[1.0, 1.0, 1.0]), Err(ExactError::Length { got: 4, expected: 3 })));
        assert_eq!(s, before);
        // A sum that grows past 2^30 is refused, not wrapped.
        let mut big = ExactSum::zeros(1);
        big.add_f32(0, &[1e9]).unwrap();
        assert!(matches!(big.add_f32(0, &[1e9]), Err(ExactError::SumOutOfRange { index: 0 })));
        // A long vector (added in parts on several cores): a bad value late in it takes back
        // every part.
        let n = 1 << 18;
        let mut long = ExactSum::zeros(n);
        long.add_f32(0, &vec![0.5; n]).unwrap();
        let before = long.clone();
        let mut terms = vec![0.25f32; n];
        terms[n - 3] = f32::INFINITY;
        assert!(matches!(long.add_f32(0, &terms), Err(ExactError::NotFinite { index, .. }) if index == n - 3));
        assert_eq!(long, before);
        let mut huge = ExactSum::zeros(1);
        huge.fixed[0] = i128::MAX;
        assert!(ExactSum::from_bytes(&huge.to_bytes()).is_err());
        assert!(ExactSum::from_bytes(&[0u8; 15]).is_err());
    }
}
