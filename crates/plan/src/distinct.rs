//! The distinct experts of a node's slots, ascending — the set a move compares what a node
//! holds with what it is given.
//!
//! Why not sort and deduplicate: a node's slots are a few dozen expert ids below a few
//! thousand, and a weighing at 128 nodes of 58 layers makes this set for every (node, layer)
//! pair, twice (what it holds, what it is given), hundreds of times a simulated day. Marking
//! bits in a small stack bitset and reading them back in order gives the same ascending list
//! in one pass each, without a sort (it was a sixth of a weighing's time).

use crate::ExpertId;

/// Ids below this are marked in a stack bitset; a list with a larger id is sorted instead.
const BITSET_IDS: usize = 4096;

/// The distinct values of `v`, ascending, appended to `out`.
pub fn extend_distinct_sorted(out: &mut Vec<ExpertId>, v: &[ExpertId]) {
    let Some(&max) = v.iter().max() else { return };
    if max >= BITSET_IDS {
        let start = out.len();
        out.extend_from_slice(v);
        out[start..].sort_unstable();
        let mut kept = start;
        for i in start..out.len() {
            if kept == start || out[i] != out[kept - 1] {
                out[kept] = out[i];
                kept += 1;
            }
        }
        out.truncate(kept);
        return;
    }
    let mut words = [0u64; BITSET_IDS / 64];
    for &x in v {
        words[x / 64] |= 1 << (x % 64);
    }
    for (w, &bits) in words[..=max / 64].iter().enumerate() {
        let mut b = bits;
        while b != 0 {
            out.push(w * 64 + b.trailing_zeros() as usize);
            b &= b - 1;
        }
    }
}

/// The distinct values of `v`, ascending.
pub fn distinct_sorted(v: &[ExpertId]) -> Vec<ExpertId> {
    let mut out = Vec::with_capacity(v.len());
    extend_distinct_sorted(&mut out, v);
    out
}

/// The values of `wanted` not in `held`, each once, in `wanted`'s order of first appearance,
/// each passed to `missing`.
pub fn each_missing(held: &[ExpertId], wanted: &[ExpertId], mut missing: impl FnMut(ExpertId)) {
    let max = held.iter().chain(wanted).copied().max().unwrap_or(0);
    if max >= BITSET_IDS {
        let held = distinct_sorted(held);
        let mut seen: Vec<ExpertId> = Vec::new();
        for &e in wanted {
            if held.binary_search(&e).is_err() && !seen.contains(&e) {
                seen.push(e);
                missing(e);
            }
        }
        return;
    }
    // A bit per id held or already reported.
    let mut words = [0u64; BITSET_IDS / 64];
    for &x in held {
        words[x / 64] |= 1 << (x % 64);
    }
    for &e in wanted {
        let (w, bit) = (e / 64, 1u64 << (e % 64));
        if words[w] & bit == 0 {
            words[w] |= bit;
            missing(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The oracle: sort, then drop repeats.
    fn sorted_dedup(v: &[usize]) -> Vec<usize> {
        let mut v = v.to_vec();
        v.sort_unstable();
        v.dedup();
        v
    }

    proptest! {
        #[test]
        fn distinct_sorted_is_sort_and_dedup(v in prop::collection::vec(prop_oneof![0usize..300, 0usize..10_000], 0..80)) {
            prop_assert_eq!(distinct_sorted(&v), sorted_dedup(&v));
            let mut out = vec![7, 3];
            extend_distinct_sorted(&mut out, &v);
            prop_assert_eq!(&out[..2], &[7, 3]);
            prop_assert_eq!(&out[2..], &sorted_dedup(&v)[..]);
        }

        #[test]
        fn each_missing_is_each_first_appearance_not_held(
            held in prop::collection::vec(prop_oneof![0usize..300, 0usize..10_000], 0..40),
            wanted in prop::collection::vec(prop_oneof![0usize..300, 0usize..10_000], 0..80),
        ) {
            let mut expected = Vec::new();
            for &e in &wanted {
                if !held.contains(&e) && !expected.contains(&e) {
                    expected.push(e);
                }
            }
            let mut got = Vec::new();
            each_missing(&held, &wanted, |e| got.push(e));
            prop_assert_eq!(got, expected);
        }
    }
}
