//! The `lazarus` strategy: MRO where it is optimal, else the best MRO-style grouping, improved
//! on small clusters by local search with exact evaluation ([`SmallEval`]).

use super::holder_sets;
use super::mro::{mro_nodes, mro_truncates, sequential_nodes, GroupLayout};
use crate::recovery::{self, counts_better, counts_dominate, SmallEval, SurvivalCurve};
use crate::rng::SplitMix64;
use crate::ExpertId;

/// Lexicographic comparison of survival curves: fewer failures first (they are the likely
/// ones), i.e. compare P(recover | N−1 alive), then N−2, …
pub(crate) fn better(a: &[f64], b: &[f64]) -> bool {
    for r in (0..a.len()).rev() {
        if a[r] > b[r] + 1e-12 {
            return true;
        }
        if a[r] < b[r] - 1e-12 {
            return false;
        }
    }
    false
}

pub(crate) fn dominates(a: &[f64], b: &[f64]) -> bool {
    a.iter().zip(b).all(|(x, y)| *x >= *y - 1e-12)
}

/// Clusters up to this many nodes (and node-slots) get the local-search improvement: exact
/// evaluation enumerates all 2^N alive sets, which is cheap up to here.
pub(crate) const SEARCH_MAX_NODES: usize = 12;
pub(crate) const SEARCH_MAX_SLOTS: usize = 128;

pub(crate) fn lazarus_nodes(replicas: &[usize], n: usize, s: usize) -> Vec<Vec<ExpertId>> {
    let mro = mro_nodes(replicas, n, s, s, GroupLayout::PartialLast);
    if !mro_truncates(replicas, n, s) {
        return mro;
    }
    let experts = replicas.len();
    let curve = |nodes: &Vec<Vec<ExpertId>>| -> SurvivalCurve { recovery::survival_curve(n, &holder_sets(nodes, experts)) };
    let mro_curve = curve(&mro);
    let mut best = (mro.clone(), mro_curve.clone());
    // Every placement of the partial group is an MRO-style candidate with a closed form.
    let count = experts.div_ceil(s);
    for at in 0..count {
        let cand = mro_nodes(replicas, n, s, s, GroupLayout::PartialAt(at));
        let c = curve(&cand);
        if c.exact && dominates(&c.alive, &mro_curve.alive) && better(&c.alive, &best.1.alive) {
            best = (cand, c);
        }
    }
    if n <= SEARCH_MAX_NODES && n * s <= SEARCH_MAX_SLOTS {
        let mut starts = vec![best.0.clone(), mro.clone()];
        starts.push(sequential_nodes(replicas, n, s, |k| k % n));
        let mut rng = SplitMix64::new(0x1a2a_7a05 ^ (n as u64) << 32 ^ s as u64);
        // Random restarts are what makes tiny instances reliably optimal; on larger ones each
        // costs more and helps less.
        let restarts = if n * s <= 24 { 4 } else { 2 };
        for _ in 0..restarts {
            starts.push(random_nodes(replicas, s, &mut rng));
        }
        let eval = SmallEval::new(n, experts);
        let mro_counts = eval.counts(&mro);
        let mut best_counts = eval.counts(&best.0);
        for start in starts {
            let (cand, counts) = local_search(start, n, s, &eval);
            if counts_dominate(&counts, &mro_counts) && counts_better(&counts, &best_counts) {
                best_counts = counts;
                best.0 = cand;
            }
        }
    }
    best.0
}

pub(crate) fn random_nodes(replicas: &[usize], s: usize, rng: &mut SplitMix64) -> Vec<Vec<ExpertId>> {
    let mut list: Vec<ExpertId> = (0..replicas.len()).flat_map(|e| std::iter::repeat_n(e, replicas[e])).collect();
    for i in (1..list.len()).rev() {
        list.swap(i, rng.below(i + 1));
    }
    list.chunks(s).map(|c| c.to_vec()).collect()
}

/// Hill climbing with exact evaluation (see [`hill_climb`]); returns the plan and its counts.
pub(crate) fn local_search(nodes: Vec<Vec<ExpertId>>, n: usize, s: usize, eval: &SmallEval) -> (Vec<Vec<ExpertId>>, Vec<u64>) {
    let mut counts = eval.counts(&nodes);
    let nodes = hill_climb(nodes, n, s, |cand| match eval.improves(cand, &counts) {
        Some(c) => {
            counts = c;
            true
        }
        None => false,
    });
    (nodes, counts)
}

/// First-improvement hill climbing over swaps of two replicas of different experts on different
/// nodes: `improves` is asked about each swapped plan (and keeps its own notion of the current
/// best); the first swap it accepts is kept and the scan restarts. Deterministic.
pub(crate) fn hill_climb(
    mut nodes: Vec<Vec<ExpertId>>,
    n: usize,
    s: usize,
    mut improves: impl FnMut(&[Vec<ExpertId>]) -> bool,
) -> Vec<Vec<ExpertId>> {
    let mut improved = true;
    while improved {
        improved = false;
        'scan: for a in 0..n {
            for b in (a + 1)..n {
                for i in 0..s {
                    for j in 0..s {
                        let (x, y) = (nodes[a][i], nodes[b][j]);
                        if x == y || nodes[a][..i].contains(&x) || nodes[b][..j].contains(&y) {
                            continue;
                        }
                        nodes[a][i] = y;
                        nodes[b][j] = x;
                        if improves(&nodes) {
                            improved = true;
                            break 'scan;
                        }
                        nodes[a][i] = x;
                        nodes[b][j] = y;
                    }
                }
            }
        }
    }
    nodes
}
