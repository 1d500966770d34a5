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
//!   [x^R] Π_i((1+x)^{L_i} − 1)·(1+x)^{N−ΣL_i} / C(N,R) of DESIGN.md;
//! * a small overlapping component is counted by enumerating its node subsets, or by
//!   inclusion–exclusion over its sets in exact 128-bit integers;
//! * anything larger falls back to Monte Carlo with a 95% Wilson interval, and says so.
//!
//! The combination works with probabilities (never raw binomials), with ln-factorials for the
//! hypergeometric terms, so it stays accurate for N = 10,000 where C(N,R) overflows f64.

use serde::{Deserialize, Serialize};

use crate::error::PlanError;
use crate::nodeset::NodeSet;
use crate::placement::Placement;
use crate::rng::SplitMix64;

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

/// Recovery probability of `placement` for every number of failed nodes k = 0..N−1.
pub fn recovery_curve(placement: &Placement) -> Vec<RecoveryEstimate> {
    let n = placement.shape().nodes;
    let curve = survival_curve(n, &placement.holders());
    (0..n).map(|k| estimate(&curve, n, k)).collect()
}

/// Recovery probability of `placement` with `failed` nodes down (0 ≤ failed ≤ N).
pub fn recovery_probability(placement: &Placement, failed: usize) -> Result<RecoveryEstimate, PlanError> {
    let n = placement.shape().nodes;
    if failed > n {
        return Err(PlanError::invalid(
            "failed",
            failed,
            format!("cannot fail more nodes than the {n} the plan has"),
        ));
    }
    let sets = placement.holders();
    let minimal = minimal_sets(&sets);
    let curve = match exact_components(&minimal) {
        Some(comps) => SurvivalCurve {
            alive: combine(n, &comps, Some(n - failed)),
            exact: true,
            ci95: vec![None; n + 1],
        },
        None => monte_carlo(n, &minimal, Some(n - failed)),
    };
    Ok(estimate(&curve, n, failed))
}

fn estimate(curve: &SurvivalCurve, n: usize, failed: usize) -> RecoveryEstimate {
    let r = n - failed;
    let ci95 = curve.ci95[r];
    RecoveryEstimate {
        failed,
        probability: curve.alive[r],
        method: if ci95.is_some() {
            RecoveryMethod::MonteCarlo
        } else {
            RecoveryMethod::Exact
        },
        ci95,
    }
}

/// The full survival curve of a plan given by its expert holder sets.
pub(crate) fn survival_curve(n: usize, sets: &[NodeSet]) -> SurvivalCurve {
    let minimal = minimal_sets(sets);
    match exact_components(&minimal) {
        Some(comps) => SurvivalCurve {
            alive: combine(n, &comps, None),
            exact: true,
            ci95: vec![None; n + 1],
        },
        None => monte_carlo(n, &minimal, None),
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
        let local = |s: &NodeSet| -> u32 {
            nodes
                .iter()
                .enumerate()
                .filter(|(_, &node)| s.contains(node))
                .fold(0u32, |m, (i, _)| m | (1 << i))
        };
        let masks: Vec<u32> = sets.iter().map(|s| local(s)).collect();
        let mut counts = vec![0u64; u + 1];
        for alive in 0u32..(1u32 << u) {
            if masks.iter().all(|&m| m & alive != 0) {
                counts[alive.count_ones() as usize] += 1;
            }
        }
        let binom = binomial_row_i128(u);
        let hit = (0..=u).map(|a| counts[a] as f64 / binom[a] as f64).collect();
        return Some(Component { size: u, hit });
    }
    if sets.len() <= INCLUSION_EXCLUSION_MAX_SETS && u <= INCLUSION_EXCLUSION_MAX_NODES {
        // fail(a) = Σ_{∅≠T} (−1)^{|T|+1} C(u − |∪T|, a); group the terms by |∪T|.
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
        return Some(Component { size: u, hit });
    }
    None
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
    let free = Component {
        size: n - used,
        hit: vec![1.0; n - used + 1],
    };
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
            let base = ln_c(total, k);
            let mut sum = 0.0;
            for a in k.saturating_sub(m)..=u.min(k) {
                let (pk, q) = (p[k - a], comp.hit[a]);
                if pk == 0.0 || q == 0.0 {
                    continue;
                }
                sum += pk * q * (ln_c(u, a) + ln_c(m, k - a) - base).exp();
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
    let smallest = minimal.iter().map(NodeSet::len).min().unwrap_or(0);
    let mut alive = vec![0.0; n + 1];
    let mut ci95 = vec![None; n + 1];
    let mut rng = SplitMix64::new(0x5eed_1a2a ^ n as u64);
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
    SurvivalCurve {
        alive,
        exact: false,
        ci95,
    }
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
