//! Exact recovery counts for small clusters (N ≤ 20): the evaluator of the placement search.

use crate::ExpertId;

/// Exact hit counts for small clusters: for every alive count R, how many R-subsets of nodes
/// hold a replica of every expert. Enumerates the 2^N alive sets level by level, most alive
/// first, so a candidate that loses at a high level (few failures) is rejected after looking at
/// a handful of sets.
pub(crate) struct SmallEval {
    n: usize,
    experts: usize,
    /// Alive sets grouped by size.
    levels: Vec<Vec<u32>>,
}

impl SmallEval {
    pub(crate) fn new(n: usize, experts: usize) -> Self {
        debug_assert!(n <= 20);
        let mut levels = vec![Vec::new(); n + 1];
        for alive in 0u32..(1u32 << n) {
            levels[alive.count_ones() as usize].push(alive);
        }
        SmallEval { n, experts, levels }
    }

    pub(crate) fn minimal(&self, nodes: &[Vec<ExpertId>]) -> Vec<u32> {
        let mut masks = vec![0u32; self.experts];
        for (i, node) in nodes.iter().enumerate() {
            for &e in node {
                masks[e] |= 1 << i;
            }
        }
        minimal_masks(masks)
    }

    pub(crate) fn level(&self, minimal: &[u32], r: usize) -> u64 {
        self.levels[r].iter().filter(|&&alive| minimal.iter().all(|&m| m & alive != 0)).count() as u64
    }

    pub(crate) fn counts(&self, nodes: &[Vec<ExpertId>]) -> Vec<u64> {
        let minimal = self.minimal(nodes);
        (0..=self.n).map(|r| self.level(&minimal, r)).collect()
    }

    /// The counts of `nodes` if they beat `current` lexicographically (fewest failures first).
    pub(crate) fn improves(&self, nodes: &[Vec<ExpertId>], current: &[u64]) -> Option<Vec<u64>> {
        let minimal = self.minimal(nodes);
        let mut counts = vec![0u64; self.n + 1];
        let mut better = false;
        for r in (0..=self.n).rev() {
            counts[r] = self.level(&minimal, r);
            if !better {
                if counts[r] < current[r] {
                    return None;
                }
                better = counts[r] > current[r];
            }
        }
        better.then_some(counts)
    }
}

/// Drop duplicate holder sets and supersets: only the minimal sets decide recovery.
pub(crate) fn minimal_masks(mut masks: Vec<u32>) -> Vec<u32> {
    masks.sort_by_key(|m| (m.count_ones(), *m));
    masks.dedup();
    let mut out: Vec<u32> = Vec::with_capacity(masks.len());
    for m in masks {
        if !out.iter().any(|&k| k & !m == 0) {
            out.push(m);
        }
    }
    out
}

pub(crate) fn counts_better(a: &[u64], b: &[u64]) -> bool {
    for r in (0..a.len()).rev() {
        if a[r] != b[r] {
            return a[r] > b[r];
        }
    }
    false
}

pub(crate) fn counts_dominate(a: &[u64], b: &[u64]) -> bool {
    a.iter().zip(b).all(|(x, y)| x >= y)
}
