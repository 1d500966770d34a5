//! Probability that a plan recovers — every expert keeps at least one replica on a live node —
//! when k of its N nodes fail, all k-subsets equally likely (the paper's Assumption 1).
//!
//! Only the node sets S_e of the experts matter, and only the minimal ones (an expert whose set
//! contains another expert's set survives whenever that one does). Minimal sets that share no
//! node with each other form independent *components*; for each we count, for every a, how many
//! a-subsets of its nodes hit all of its sets, and then combine components exactly with
//! hypergeometric weights:
//!
//! * a component that is one set of L nodes hits with probability 1 as soon as a ≥ 1 — so an
//!   MRO-shaped plan (disjoint group segments) gets the closed form
//!   [x^R] Π_i((1+x)^{L_i} − 1)·(1+x)^{N−ΣL_i} / C(N,R);
//! * a small overlapping component is counted by enumerating its node subsets, or by
//!   inclusion–exclusion over its sets in exact 128-bit integers;
//! * anything larger falls back to Monte Carlo with a 95% Wilson interval, and says so.
//!
//! The combination works with probabilities (never raw binomials), with ln-factorials for the
//! hypergeometric terms, so it stays accurate for N = 10,000 where C(N,R) overflows f64.

use serde::{Deserialize, Serialize};

use crate::error::PlanError;
use crate::nodeset::NodeSet;
use crate::rng::SplitMix64;

mod small;
pub(crate) use small::{counts_better, counts_dominate, SmallEval};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecoveryMethod {
    Exact,
    MonteCarlo,
}

impl RecoveryMethod {
    pub fn name(self) -> &'static str {
        match self {
            RecoveryMethod::Exact => "exact",
            RecoveryMethod::MonteCarlo => "monte-carlo",
        }
    }
}

/// Recovery probability with `failed` of the plan's nodes down.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecoveryEstimate {
    pub failed: usize,
    pub probability: f64,
    pub method: RecoveryMethod,
    /// 95% confidence interval, for Monte Carlo estimates only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ci95: Option<[f64; 2]>,
}

/// Samples per alive count when a plan is too irregular for exact evaluation.
pub const MONTE_CARLO_SAMPLES: usize = 20_000;
/// Largest overlapping component counted by enumerating its 2^u node subsets.
const ENUMERATE_MAX_NODES: usize = 20;
/// Largest component counted by inclusion–exclusion over its sets (exact in i128 up to 100 nodes).
const INCLUSION_EXCLUSION_MAX_SETS: usize = 16;
const INCLUSION_EXCLUSION_MAX_NODES: usize = 100;

/// P(recover | R nodes alive) for R = 0..=N.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SurvivalCurve {
    pub alive: Vec<f64>,
    pub exact: bool,
    /// Half-open 95% intervals where estimated by Monte Carlo (`None` where exact).
    pub ci95: Vec<Option<[f64; 2]>>,
}

/// Recovery probability of a plan of `n` nodes whose experts are held by the node sets `sets`,
/// for every number of failed nodes k = 0..N−1. (A whole model's sets — every layer's experts
/// together — give the probability that the model recovers.)
pub fn curve_of_sets(n: usize, sets: &[NodeSet]) -> Vec<RecoveryEstimate> {
    let curve = survival_curve(n, sets);
    (0..n).map(|k| estimate(&curve, n, k)).collect()
}

/// Recovery probability of a plan of `n` nodes with holder sets `sets` and `failed` nodes down
/// (0 ≤ failed ≤ N).
pub fn probability_of_sets(n: usize, sets: &[NodeSet], failed: usize) -> Result<RecoveryEstimate, PlanError> {
    if failed > n {
        return Err(PlanError::invalid("failed", failed, format!("cannot fail more nodes than the {n} the plan has")));
    }
    let minimal = minimal_sets(sets);
    let mut curve = match exact_components(&minimal) {
        Some(comps) => SurvivalCurve { alive: combine(n, &comps, Some(n - failed)), exact: true, ci95: vec![None; n + 1] },
        None => monte_carlo(n, &minimal, Some(n - failed)),
    };
    settle_certain(&mut curve, n, &minimal);
    Ok(estimate(&curve, n, failed))
}

fn estimate(curve: &SurvivalCurve, n: usize, failed: usize) -> RecoveryEstimate {
    let r = n - failed;
    let ci95 = curve.ci95[r];
    RecoveryEstimate {
        failed,
        probability: curve.alive[r],
        method: if ci95.is_some() { RecoveryMethod::MonteCarlo } else { RecoveryMethod::Exact },
        ci95,
    }
}

/// The full survival curve of a plan given by its expert holder sets.
pub(crate) fn survival_curve(n: usize, sets: &[NodeSet]) -> SurvivalCurve {
    let minimal = minimal_sets(sets);
    let mut curve = match exact_components(&minimal) {
        Some(comps) => SurvivalCurve { alive: combine(n, &comps, None), exact: true, ci95: vec![None; n + 1] },
        None => monte_carlo(n, &minimal, None),
    };
    settle_certain(&mut curve, n, &minimal);
    curve
}

/// A survival curve evaluated point by point, on demand: comparing two plans from the most
/// alive nodes down ([`LazyCurve::better`]) usually settles at the first uncertain point, so a
/// plan that needs Monte Carlo costs one point instead of N (at 128 nodes, the difference
/// between milliseconds and most of a second per candidate of the throughput guard).
pub(crate) struct LazyCurve {
    n: usize,
    minimal: Vec<NodeSet>,
    smallest: usize,
    exact: Option<Vec<f64>>,
    cache: Vec<Option<f64>>,
}

impl LazyCurve {
    pub(crate) fn new(n: usize, sets: &[NodeSet]) -> Self {
        let minimal = minimal_sets(sets);
        let smallest = minimal.iter().map(NodeSet::len).min().unwrap_or(n + 1);
        let exact = exact_components(&minimal).map(|comps| combine(n, &comps, None));
        LazyCurve { n, minimal, smallest, exact, cache: vec![None; n + 1] }
    }

    /// P(every expert survives | r nodes alive), with the certain values of [`settle_certain`].
    pub(crate) fn at(&mut self, r: usize) -> f64 {
        if r + self.smallest > self.n {
            return 1.0;
        }
        if r == 0 {
            return 0.0;
        }
        if let Some(exact) = &self.exact {
            return exact[r];
        }
        if let Some(p) = self.cache[r] {
            return p;
        }
        let p = monte_carlo(self.n, &self.minimal, Some(r)).alive[r];
        self.cache[r] = Some(p);
        p
    }

    /// Whether `self` beats `other` lexicographically from the most alive nodes down (the order
    /// of the placement search's `better`).
    pub(crate) fn better(&mut self, other: &mut LazyCurve) -> bool {
        for r in (0..=self.n.min(other.n)).rev() {
            let (a, b) = (self.at(r), other.at(r));
            if a > b + 1e-12 {
                return true;
            }
            if a < b - 1e-12 {
                return false;
            }
        }
        false
    }
}

/// Values known without computing: with more alive nodes than the smallest holder set can
/// miss, recovery is certain; with none alive it is impossible. Set them exactly so that
/// floating-point sums do not report 0.9999999999999998.
fn settle_certain(curve: &mut SurvivalCurve, n: usize, minimal: &[NodeSet]) {
    let smallest = minimal.iter().map(NodeSet::len).min().unwrap_or(n + 1);
    for r in 0..=n {
        if r + smallest > n {
            curve.alive[r] = 1.0;
            curve.ci95[r] = None;
        } else if r == 0 {
            curve.alive[r] = 0.0;
            curve.ci95[r] = None;
        }
    }
}

/// Distinct holder sets with every superset of another set removed.
pub(crate) fn minimal_sets(sets: &[NodeSet]) -> Vec<NodeSet> {
    let mut sorted: Vec<&NodeSet> = sets.iter().collect();
    sorted.sort_by_key(|s| s.len());
    let mut out: Vec<NodeSet> = Vec::new();
    for s in sorted {
        if !out.iter().any(|k| k.is_subset(s)) {
            out.push(s.clone());
        }
    }
    out
}

/// One independent component: `hit[a]` = P(a uniformly random nodes of its `size` nodes hit
/// every set of the component).
#[derive(Debug, Clone)]
struct Component {
    size: usize,
    hit: Vec<f64>,
}

/// Split the minimal sets into components of mutually overlapping sets and count each exactly;
/// `None` when some component is too large to count exactly.
fn exact_components(minimal: &[NodeSet]) -> Option<Vec<Component>> {
    let f = minimal.len();
    let mut parent: Vec<usize> = (0..f).collect();
    fn root(p: &mut [usize], mut i: usize) -> usize {
        while p[i] != i {
            p[i] = p[p[i]];
            i = p[i];
        }
        i
    }
    for i in 0..f {
        for j in (i + 1)..f {
            if minimal[i].intersects(&minimal[j]) {
                let (a, b) = (root(&mut parent, i), root(&mut parent, j));
                parent[a] = b;
            }
        }
    }
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); f];
    for i in 0..f {
        let r = root(&mut parent, i);
        members[r].push(i);
    }
    members
        .into_iter()
        .filter(|m| !m.is_empty())
        .map(|m| {
            let sets: Vec<&NodeSet> = m.iter().map(|&i| &minimal[i]).collect();
            count_component(&sets)
        })
        .collect()
}

fn count_component(sets: &[&NodeSet]) -> Option<Component> {
    let mut union = sets[0].clone();
    sets.iter().for_each(|s| union.union_with(s));
    let nodes: Vec<usize> = union.iter().collect();
    let u = nodes.len();
    if sets.len() == 1 {
        let mut hit = vec![1.0; u + 1];
        hit[0] = 0.0;
        return Some(Component { size: u, hit });
    }
    if u <= ENUMERATE_MAX_NODES {
        return Some(enumerate_component(sets, &nodes));
    }
    if sets.len() <= INCLUSION_EXCLUSION_MAX_SETS && u <= INCLUSION_EXCLUSION_MAX_NODES {
        return Some(inclusion_exclusion_component(sets, &union, u));
    }
    None
}

/// Count, for each a, the a-subsets of the component's nodes that hit every set (u ≤ 20).
fn enumerate_component(sets: &[&NodeSet], nodes: &[usize]) -> Component {
    let u = nodes.len();
    let local =
        |s: &NodeSet| -> u32 { nodes.iter().enumerate().filter(|(_, &node)| s.contains(node)).fold(0u32, |m, (i, _)| m | (1 << i)) };
    let masks: Vec<u32> = sets.iter().map(|s| local(s)).collect();
    let mut counts = vec![0u64; u + 1];
    for alive in 0u32..(1u32 << u) {
        if masks.iter().all(|&m| m & alive != 0) {
            counts[alive.count_ones() as usize] += 1;
        }
    }
    let binom = binomial_row_i128(u);
    let hit = (0..=u).map(|a| counts[a] as f64 / binom[a] as f64).collect();
    Component { size: u, hit }
}

/// fail(a) = Σ_{∅≠T} (−1)^{|T|+1} C(u − |∪T|, a), terms grouped by |∪T|, in exact integers.
fn inclusion_exclusion_component(sets: &[&NodeSet], union: &NodeSet, u: usize) -> Component {
    let f = sets.len();
    let mut coef = vec![0i128; u + 1];
    let mut unions: Vec<NodeSet> = Vec::with_capacity(1 << f);
    let mut none = union.clone();
    none.clear();
    unions.push(none);
    for t in 1usize..(1 << f) {
        let low = t.trailing_zeros() as usize;
        let mut un = unions[t & (t - 1)].clone();
        un.union_with(sets[low]);
        let sign = if t.count_ones() % 2 == 1 { 1 } else { -1 };
        coef[un.len()] += sign;
        unions.push(un);
    }
    let table: Vec<Vec<i128>> = (0..=u).map(binomial_row_i128).collect();
    let hit = (0..=u)
        .map(|a| {
            let fail: i128 = (0..=u).filter(|&w| u - w >= a).map(|w| coef[w] * table[u - w][a]).sum();
            1.0 - fail as f64 / table[u][a] as f64
        })
        .collect();
    Component { size: u, hit }
}

fn binomial_row_i128(n: usize) -> Vec<i128> {
    let mut row = vec![1i128; n + 1];
    for k in 1..n {
        row[k] = row[k - 1] * (n - k + 1) as i128 / k as i128;
    }
    row
}

/// ln(k!) for k = 0..=n.
fn ln_factorials(n: usize) -> Vec<f64> {
    let mut lf = vec![0.0f64; n + 1];
    for k in 2..=n {
        lf[k] = lf[k - 1] + (k as f64).ln();
    }
    lf
}

/// Combine independent components (and the nodes outside all of them) into P(recover | R alive).
/// With `only = Some(R)` only the states that can still reach R alive nodes are computed.
fn combine(n: usize, comps: &[Component], only: Option<usize>) -> Vec<f64> {
    let lf = ln_factorials(n);
    let ln_c = |a: usize, b: usize| lf[a] - lf[b] - lf[a - b];
    let used: usize = comps.iter().map(|c| c.size).sum();
    let free = Component { size: n - used, hit: vec![1.0; n - used + 1] };
    // p[k] = P(a uniformly random k-subset of the first m processed nodes hits every
    // processed component).
    let mut p = vec![1.0f64];
    let mut m = 0usize;
    for comp in comps.iter().chain(std::iter::once(&free)) {
        let u = comp.size;
        let total = m + u;
        let (lo, hi) = match only {
            Some(r) => (r.saturating_sub(n - total), r.min(total)),
            None => (0, total),
        };
        let mut next = vec![0.0f64; total + 1];
        for (k, slot) in next.iter_mut().enumerate().take(hi + 1).skip(lo) {
            // Hypergeometric weights h(a) = C(u,a)·C(m,k−a)/C(m+u,k): one exp at the mode (the
            // largest term, so it never underflows), then the ratio recurrence both ways.
            let a_lo = k.saturating_sub(m);
            let a_hi = u.min(k);
            let mode = (((k + 1) * (u + 1)) / (total + 2)).clamp(a_lo, a_hi);
            let h_mode = (ln_c(u, mode) + ln_c(m, k - mode) - ln_c(total, k)).exp();
            let term = |a: usize, h: f64| p[k - a] * comp.hit[a] * h;
            let mut sum = term(mode, h_mode);
            let mut h = h_mode;
            for a in mode..a_hi {
                h *= ((u - a) * (k - a)) as f64 / ((a + 1) * (m + a + 1 - k)) as f64;
                sum += term(a + 1, h);
            }
            h = h_mode;
            for a in (a_lo + 1..=mode).rev() {
                h *= (a * (m + a - k)) as f64 / ((u - a + 1) * (k - a + 1)) as f64;
                sum += term(a - 1, h);
            }
            *slot = sum.min(1.0);
        }
        p = next;
        m = total;
    }
    p
}

/// Monte Carlo estimate with a Wilson 95% interval; values that are certain (no alive node, or
/// more alive nodes than any expert can miss) are exact.
fn monte_carlo(n: usize, minimal: &[NodeSet], only: Option<usize>) -> SurvivalCurve {
    monte_carlo_seeded(n, minimal, only, 0x5eed_1a2a ^ n as u64)
}

fn monte_carlo_seeded(n: usize, minimal: &[NodeSet], only: Option<usize>, seed: u64) -> SurvivalCurve {
    match only {
        None => monte_carlo_thresholds(n, minimal, seed),
        Some(_) => monte_carlo_points(n, minimal, only, seed),
    }
}

/// The whole curve from one set of samples: a sample is a random order of the nodes, r alive
/// nodes are its first r, and every expert survives exactly when r reaches the sample's
/// threshold — the latest, over the holder sets, of each set's earliest node in the order. One
/// pass over the sets per sample gives every r at once (the per-r sampler below costs that for
/// each r), and the estimates are monotone in r as the true curve is. Each r's estimate is still
/// a fraction of `MONTE_CARLO_SAMPLES` independent samples, with the same Wilson interval.
fn monte_carlo_thresholds(n: usize, minimal: &[NodeSet], seed: u64) -> SurvivalCurve {
    let smallest = minimal.iter().map(NodeSet::len).min().unwrap_or(0);
    let members: Vec<Vec<u32>> = minimal.iter().map(|s| s.iter().map(|i| i as u32).collect()).collect();
    let mut rng = SplitMix64::new(seed);
    let mut order: Vec<usize> = (0..n).collect();
    let mut position = vec![0u32; n];
    // at_threshold[t]: samples whose experts all survive from t alive nodes on.
    let mut at_threshold = vec![0usize; n + 1];
    for _ in 0..MONTE_CARLO_SAMPLES {
        for i in 0..n {
            let j = i + rng.below(n - i);
            order.swap(i, j);
            position[order[i]] = i as u32;
        }
        let threshold =
            members.iter().map(|m| m.iter().map(|&v| position[v as usize]).min().map_or(n, |p| p as usize + 1)).max().unwrap_or(0);
        at_threshold[threshold.min(n)] += 1;
    }
    let mut alive = vec![0.0; n + 1];
    let mut ci95 = vec![None; n + 1];
    let mut ok = 0usize;
    for r in 0..=n {
        ok += at_threshold[r];
        if r == 0 {
            alive[r] = if minimal.is_empty() { 1.0 } else { 0.0 };
        } else if r + smallest > n {
            // Any r alive nodes meet every set of ≥ smallest nodes.
            alive[r] = 1.0;
        } else {
            let (p, lo, hi) = wilson(ok, MONTE_CARLO_SAMPLES);
            alive[r] = p;
            ci95[r] = Some([lo, hi]);
        }
    }
    SurvivalCurve { alive, exact: false, ci95 }
}

/// One r (or each r in turn) sampled on its own: r nodes drawn, every holder set checked.
fn monte_carlo_points(n: usize, minimal: &[NodeSet], only: Option<usize>, seed: u64) -> SurvivalCurve {
    let smallest = minimal.iter().map(NodeSet::len).min().unwrap_or(0);
    let mut alive = vec![0.0; n + 1];
    let mut ci95 = vec![None; n + 1];
    let mut rng = SplitMix64::new(seed);
    let mut order: Vec<usize> = (0..n).collect();
    let mut set = NodeSet::empty(n);
    for r in 0..=n {
        if only.is_some_and(|o| o != r) {
            continue;
        }
        if r == 0 {
            alive[r] = if minimal.is_empty() { 1.0 } else { 0.0 };
            continue;
        }
        if r + smallest > n {
            // Any r alive nodes meet every set of ≥ smallest nodes.
            alive[r] = 1.0;
            continue;
        }
        let mut ok = 0usize;
        for _ in 0..MONTE_CARLO_SAMPLES {
            set.clear();
            for i in 0..r {
                let j = i + rng.below(n - i);
                order.swap(i, j);
                set.insert(order[i]);
            }
            if minimal.iter().all(|s| s.intersects(&set)) {
                ok += 1;
            }
        }
        let (p, lo, hi) = wilson(ok, MONTE_CARLO_SAMPLES);
        alive[r] = p;
        ci95[r] = Some([lo, hi]);
    }
    SurvivalCurve { alive, exact: false, ci95 }
}

fn wilson(successes: usize, trials: usize) -> (f64, f64, f64) {
    let z = 1.959_963_984_540_054_f64;
    let nt = trials as f64;
    let p = successes as f64 / nt;
    let denom = 1.0 + z * z / nt;
    let centre = (p + z * z / (2.0 * nt)) / denom;
    let half = z * (p * (1.0 - p) / nt + z * z / (4.0 * nt * nt)).sqrt() / denom;
    (p, (centre - half).max(0.0), (centre + half).min(1.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::{place, recovery_curve, recovery_probability, ClusterShape, Placement, Strategy};
    use proptest::prelude::*;

    fn set(n: usize, nodes: &[usize]) -> NodeSet {
        let mut s = NodeSet::empty(n);
        nodes.iter().for_each(|&i| s.insert(i));
        s
    }

    /// Brute force over all alive subsets (N ≤ 16).
    fn brute(n: usize, sets: &[NodeSet]) -> Vec<f64> {
        let mut hit = vec![0u64; n + 1];
        let mut all = vec![0u64; n + 1];
        for alive in 0u32..(1 << n) {
            let k = alive.count_ones() as usize;
            all[k] += 1;
            if sets.iter().all(|s| s.iter().any(|i| alive & (1 << i) != 0)) {
                hit[k] += 1;
            }
        }
        hit.iter().zip(&all).map(|(h, a)| *h as f64 / *a as f64).collect()
    }

    /// 1 − C(N−L, R)/C(N, R) as a stable product.
    fn miss(n: usize, l: usize, r: usize) -> f64 {
        if l > n - r {
            return 0.0;
        }
        (0..l).map(|i| (n - r - i) as f64 / (n - i) as f64).product()
    }

    #[test]
    fn paper_figure_4_mro_recovers_seven_in_ten() {
        let shape = ClusterShape::new(5, 1, 4).unwrap();
        let p = place(&[2, 5, 6, 7], shape, Strategy::Mro, None).unwrap();
        let e = recovery_probability(&p, 3).unwrap();
        assert!((e.probability - 0.7).abs() < 1e-12, "{e:?}");
        assert_eq!(e.method, RecoveryMethod::Exact);
    }

    #[test]
    fn failing_every_node_or_more_than_all() {
        let shape = ClusterShape::new(5, 1, 4).unwrap();
        let p = place(&[2, 5, 6, 7], shape, Strategy::Mro, None).unwrap();
        assert_eq!(recovery_probability(&p, 5).unwrap().probability, 0.0);
        let err = recovery_probability(&p, 6).unwrap_err().to_string();
        assert!(err.contains("failed") && err.contains('6'), "{err}");
        let curve = recovery_curve(&p);
        assert_eq!(curve.len(), 5);
        assert_eq!(curve[0].probability, 1.0);
    }

    #[test]
    fn closed_form_is_stable_at_ten_thousand_nodes() {
        let n = 10_000;
        // Two disjoint segments of 3 and 5 nodes: P = 1 − q3 − q5 + q8.
        let sets = [set(n, &[0, 1, 2]), set(n, &[10, 11, 12, 13, 14]), set(n, &(0..20).collect::<Vec<_>>())];
        for r in [1, 2, 7, 100, 5_000, 9_990, 9_999] {
            let comps = exact_components(&minimal_sets(&sets)).unwrap();
            let got = combine(n, &comps, Some(r))[r];
            let want = 1.0 - miss(n, 3, r) - miss(n, 5, r) + miss(n, 8, r);
            assert!((got - want).abs() <= 1e-9 * want.max(1e-300) + 1e-15, "r={r}: {got} vs {want}");
            let full = combine(n, &comps, None)[r];
            assert!((full - got).abs() < 1e-12);
        }
    }

    #[test]
    fn inclusion_exclusion_agrees_with_enumeration() {
        let n = 18;
        let sets = [set(n, &[0, 1, 2, 3]), set(n, &[3, 4, 5, 6, 7]), set(n, &[7, 8, 0, 9]), set(n, &[9, 10, 11, 12, 2])];
        let refs: Vec<&NodeSet> = sets.iter().collect();
        let mut union = sets[0].clone();
        sets.iter().for_each(|s| union.union_with(s));
        let nodes: Vec<usize> = union.iter().collect();
        let a = enumerate_component(&refs, &nodes);
        let b = inclusion_exclusion_component(&refs, &union, nodes.len());
        for (x, y) in a.hit.iter().zip(&b.hit) {
            assert!((x - y).abs() < 1e-12, "{:?} vs {:?}", a.hit, b.hit);
        }
    }

    #[test]
    fn lazy_curves_agree_with_full_ones_point_by_point_and_in_order() {
        let mut rng = SplitMix64::new(3);
        for _ in 0..30 {
            let n = 4 + rng.below(7);
            let sets: Vec<NodeSet> =
                (0..1 + rng.below(6)).map(|_| set(n, &(0..1 + rng.below(3)).map(|_| rng.below(n)).collect::<Vec<_>>())).collect();
            let full = survival_curve(n, &sets);
            let mut lazy = LazyCurve::new(n, &sets);
            for r in (0..=n).rev() {
                assert!((lazy.at(r) - full.alive[r]).abs() < 1e-12, "n={n} r={r}: {} vs {}", lazy.at(r), full.alive[r]);
            }
        }
        // On one n, `better` orders plans as comparing the full curves from the top would.
        let n = 8;
        let plans: Vec<Vec<NodeSet>> =
            (0..12).map(|_| (0..4).map(|_| set(n, &(0..1 + rng.below(3)).map(|_| rng.below(n)).collect::<Vec<_>>())).collect()).collect();
        for a in &plans {
            for b in &plans {
                let (fa, fb) = (survival_curve(n, a).alive, survival_curve(n, b).alive);
                let want = (0..=n).rev().find(|&r| (fa[r] - fb[r]).abs() > 1e-12).is_some_and(|r| fa[r] > fb[r]);
                assert_eq!(LazyCurve::new(n, a).better(&mut LazyCurve::new(n, b)), want, "{fa:?} vs {fb:?}");
            }
        }
        // A plan that needs Monte Carlo is sampled only at the points asked for.
        let big = 40;
        let sets: Vec<NodeSet> = (0..30).map(|i| set(big, &[i % big, (i * 7 + 3) % big, (i * 13 + 5) % big])).collect();
        let mut lazy = LazyCurve::new(big, &sets);
        assert!(lazy.exact.is_none(), "30 overlapping triples on 40 nodes: too large to count exactly");
        let p = lazy.at(big - 4);
        assert!((0.0..=1.0).contains(&p));
        assert_eq!(lazy.cache.iter().filter(|c| c.is_some()).count(), 1);
    }

    #[test]
    fn monte_carlo_intervals_cover_the_exact_value() {
        let n = 14;
        let sets: Vec<NodeSet> = (0..7).map(|i| set(n, &[2 * i, (2 * i + 3) % n, (2 * i + 5) % n])).collect();
        let exact = brute(n, &sets);
        let mc = monte_carlo(n, &minimal_sets(&sets), None);
        let mut misses = 0;
        for seed in 0..200u64 {
            let m = monte_carlo_seeded(n, &minimal_sets(&sets), Some(11), seed);
            let [lo, hi] = m.ci95[11].unwrap();
            if !(lo <= exact[11] && exact[11] <= hi) {
                misses += 1;
            }
        }
        // 95% intervals: about 10 of 200 miss; a biased sampler would miss far more often.
        assert!(misses <= 25, "coverage too low: {misses}/200 intervals miss the exact value");
        for r in 0..=n {
            match mc.ci95[r] {
                Some([lo, hi]) => {
                    let slack = hi - lo;
                    assert!(lo - slack <= exact[r] && exact[r] <= hi + slack, "r={r}: {} far from [{lo}, {hi}]", exact[r]);
                }
                None => assert_eq!(mc.alive[r], exact[r]),
            }
        }
    }

    /// The whole-curve sampler (one order of the nodes per sample, every r from its threshold):
    /// its 95% intervals cover the exact value about 95% of the time at every r, and its
    /// estimates never fall as more nodes stay alive.
    #[test]
    fn whole_curve_samples_cover_the_exact_curve_and_are_monotone() {
        let n = 14;
        let sets: Vec<NodeSet> = (0..7).map(|i| set(n, &[2 * i, (2 * i + 3) % n, (2 * i + 5) % n])).collect();
        let exact = brute(n, &sets);
        let (mut misses, mut trials) = (0, 0);
        for seed in 0..60u64 {
            let m = monte_carlo_seeded(n, &minimal_sets(&sets), None, seed);
            assert!(m.alive.windows(2).all(|w| w[0] <= w[1]), "seed {seed}: not monotone {:?}", m.alive);
            for r in 0..=n {
                match m.ci95[r] {
                    Some([lo, hi]) => {
                        trials += 1;
                        misses += usize::from(!(lo <= exact[r] && exact[r] <= hi));
                    }
                    None => assert_eq!(m.alive[r], exact[r], "r={r}"),
                }
            }
        }
        assert!(trials > 300 && misses * 100 <= trials * 10, "coverage too low: {misses}/{trials} intervals miss");
    }

    #[test]
    fn large_irregular_plans_say_monte_carlo() {
        // A ring: expert e on nodes e−1 and e. One component of 40 nodes and 40 sets, too large
        // to count exactly.
        let shape = ClusterShape::new(40, 1, 2).unwrap();
        let nodes = (0..40).map(|i| vec![i, (i + 1) % 40]).collect();
        let p = Placement::from_nodes(shape, 40, nodes).unwrap();
        let e = recovery_probability(&p, 10).unwrap();
        assert_eq!(e.method, RecoveryMethod::MonteCarlo);
        let [lo, hi] = e.ci95.unwrap();
        assert!(lo <= e.probability && e.probability <= hi && hi - lo < 0.05);
        // One failure never loses an expert with two replicas on two nodes: exact 1.
        let one = recovery_probability(&p, 1).unwrap();
        assert_eq!((one.probability, one.method), (1.0, RecoveryMethod::Exact));
    }

    proptest! {
        /// MRO plans reduce to disjoint segments: the closed form, checked against enumeration.
        #[test]
        fn mro_closed_form_matches_enumeration(n in 2usize..13, s in 1usize..5, seed in any::<u64>()) {
            let mut rng = SplitMix64::new(seed);
            let experts = 1 + rng.below(n * s);
            let mut r = vec![1usize; experts];
            for _ in experts..n * s { r[rng.below(experts)] += 1; }
            let shape = ClusterShape::new(n, 1, s).unwrap();
            let p = place(&r, shape, Strategy::Mro, None).unwrap();
            let minimal = minimal_sets(&p.holders());
            let truncated = crate::placement::mro_truncates(&r, n, s);
            let disjoint = minimal.iter().enumerate().all(|(i, a)| minimal[i + 1..].iter().all(|b| !a.intersects(b)));
            prop_assert!(disjoint || truncated, "untruncated MRO must be segment-shaped: r={:?}", r);
            let want = brute(n, &p.holders());
            let got = survival_curve(n, &p.holders());
            for k in 0..=n {
                prop_assert!((got.alive[k] - want[k]).abs() < 1e-12);
            }
        }

        #[test]
        fn evaluator_matches_brute_force(n in 2usize..10, s in 1usize..4, seed in any::<u64>()) {
            let experts = (n * s).min(2 + (seed % 7) as usize);
            let mut rng = SplitMix64::new(seed);
            // Random placement with every expert present.
            let mut list: Vec<usize> = (0..experts).collect();
            while list.len() < n * s { list.push(rng.below(experts)); }
            for i in (1..list.len()).rev() { list.swap(i, rng.below(i + 1)); }
            let nodes: Vec<Vec<usize>> = list.chunks(s).map(|c| c.to_vec()).collect();
            let shape = ClusterShape::new(n, 1, s).unwrap();
            let p = Placement::from_nodes(shape, experts, nodes).unwrap();
            let want = brute(n, &p.holders());
            let got = survival_curve(n, &p.holders());
            prop_assert!(got.exact);
            for r in 0..=n {
                prop_assert!((got.alive[r] - want[r]).abs() < 1e-12, "r={} {} vs {}", r, got.alive[r], want[r]);
            }
            for k in 0..n {
                let e = recovery_probability(&p, k).unwrap();
                prop_assert!((e.probability - want[n - k]).abs() < 1e-12);
            }
        }
    }
}
