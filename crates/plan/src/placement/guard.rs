//! The throughput guard: the most fault-tolerant placement within a bound on the busiest
//! node's share of tokens under the balanced dispatcher ([`crate::balance`]).

use super::gpus::{balance_gpus, refine_gpus};
use super::mro::{mro_nodes, sequential_nodes, GroupLayout};
use super::search::{hill_climb, lazarus_nodes, random_nodes, SEARCH_MAX_NODES, SEARCH_MAX_SLOTS};
use super::{holder_sets, validate_loads, validate_replicas, ClusterShape, Placement};
use crate::error::PlanError;
use crate::recovery::{self, SmallEval};
use crate::rng::SplitMix64;
use crate::ExpertId;

/// The default throughput guard of [`place_balanced`]: fault tolerance may cost at most 5% of
/// the experts' compute rate.
pub const DEFAULT_MAX_IMBALANCE: f64 = 1.05;

/// The `lazarus` strategy with a throughput guard, for the balanced dispatcher: the most
/// fault-tolerant placement among those on which no node needs more than `max_imbalance` times
/// its mean share of tokens (λ*, [`crate::balance`]).
///
/// Why: MRO packs the least replicated experts onto as few nodes as possible (Theorem 1). Under
/// skew those are experts at the fault-tolerance floor with almost no tokens, so their nodes
/// idle and the rest of the cluster does their share: with 8 experts on 4 nodes of 4 slots and
/// all tokens on one expert, the optimal placement idles one node of four (1.33× the balanced
/// step). Keeping `h` slots per node back for the leftover (hot) replicas restores the balance
/// at some cost in recovery probability; we take the smallest cost that meets the guard. When
/// the fault-tolerant optimum already meets it, it is returned unchanged; when nothing we try
/// meets it, the most balanced candidate wins.
///
/// The guard is evaluated per node (failure domain); the node's replicas are then spread over
/// its GPUs as in [`place`] and the spread refined for the balanced dispatcher
/// ([`refine_gpus`]), which changes no node's experts and so no recovery probability.
pub fn place_balanced(replicas: &[usize], shape: ClusterShape, loads: &[f64], max_imbalance: f64) -> Result<Placement, PlanError> {
    validate_replicas(replicas, shape)?;
    validate_loads(loads, replicas.len())?;
    if !max_imbalance.is_finite() || max_imbalance < 1.0 {
        return Err(PlanError::invalid("max_imbalance", max_imbalance, "must be a finite ratio ≥ 1 (busiest node's tokens over the mean)"));
    }
    let nodes = guarded_nodes(replicas, shape.nodes, shape.slots_per_node(), loads, max_imbalance);
    let nodes = balance_gpus(nodes, replicas, shape, Some(loads));
    let nodes = refine_gpus(nodes, shape, loads);
    Ok(Placement::made(shape, replicas.len(), nodes))
}

/// λ* / mean over nodes for node lists (see [`crate::balance`]).
pub(crate) fn node_imbalance(nodes: &[Vec<ExpertId>], loads: &[f64]) -> f64 {
    let pairs: Vec<(u32, u32)> = nodes.iter().enumerate().flat_map(|(i, node)| node.iter().map(move |&e| (e as u32, i as u32))).collect();
    // Inputs are validated and every expert is placed, so this cannot fail.
    crate::balance::min_max_load_of_pairs(&pairs, loads, nodes.len()).map_or(f64::INFINITY, |b| b.imbalance())
}

/// Candidates within the guard whose recovery is compared on large clusters ([`guarded_nodes`]).
pub(crate) const GUARD_FINALISTS: usize = 4;

pub(crate) fn guarded_nodes(replicas: &[usize], n: usize, s: usize, loads: &[f64], max_imbalance: f64) -> Vec<Vec<ExpertId>> {
    let limit = max_imbalance * (1.0 + 1e-9);
    let optimum = lazarus_nodes(replicas, n, s);
    if node_imbalance(&optimum, loads) <= limit {
        return optimum;
    }
    let experts = replicas.len();
    // Candidates: the fault-tolerant optimum, then MRO with h = 1 … s−1 slots per node kept for
    // the leftover replicas (groups of s − h experts).
    let mut cands = vec![optimum];
    cands.extend((1..s).map(|h| mro_nodes(replicas, n, s, s - h, GroupLayout::PartialLast)));
    if n <= SEARCH_MAX_NODES && n * s <= SEARCH_MAX_SLOTS {
        let eval = SmallEval::new(n, experts);
        let mut starts = cands.clone();
        starts.push(sequential_nodes(replicas, n, s, |k| k % n));
        let mut rng = SplitMix64::new(0xba1a_2ced ^ (n as u64) << 32 ^ s as u64);
        let restarts = if n * s <= 24 { 4 } else { 2 };
        for _ in 0..restarts {
            starts.push(random_nodes(replicas, s, &mut rng));
        }
        cands = starts.into_iter().map(|start| guarded_local_search(start, n, s, &eval, loads, limit)).collect();
    }
    // The least imbalance (capped at the guard: within it, all are equal) first; among the
    // candidates that reach it, the best recovery, compared point by point on demand. Past
    // the exact-search size the recovery of these overlapping plans needs Monte Carlo, so only
    // the first few that reach it are compared: the fault-tolerant optimum, then MRO with the
    // fewest slots kept back — keeping more back departs further from Theorem 1 (at 128 nodes
    // comparing all 31 took up to 18 s a layer).
    let keys: Vec<f64> = cands.iter().map(|c| node_imbalance(c, loads).max(limit)).collect();
    let least = keys.iter().copied().fold(f64::INFINITY, f64::min);
    let finalists = if n <= SEARCH_MAX_NODES { usize::MAX } else { GUARD_FINALISTS };
    let mut best: Option<(recovery::LazyCurve, Vec<Vec<ExpertId>>)> = None;
    for (c, _) in cands.into_iter().zip(keys).filter(|(_, k)| *k <= least + 1e-12).take(finalists) {
        let mut curve = recovery::LazyCurve::new(n, &holder_sets(&c, experts));
        let replace = match &mut best {
            Some((b, _)) => curve.better(b),
            None => true,
        };
        if replace {
            best = Some((curve, c));
        }
    }
    best.map(|b| b.1).unwrap_or_default()
}

/// [`local_search`] under the guard: while the plan is above `limit`, a swap is taken if it
/// lowers the imbalance; once within it, if it improves recovery and stays within it.
pub(crate) fn guarded_local_search(
    nodes: Vec<Vec<ExpertId>>,
    n: usize,
    s: usize,
    eval: &SmallEval,
    loads: &[f64],
    limit: f64,
) -> Vec<Vec<ExpertId>> {
    let mut counts = eval.counts(&nodes);
    let mut imbalance = node_imbalance(&nodes, loads);
    hill_climb(nodes, n, s, |cand| {
        if imbalance > limit {
            let next = node_imbalance(cand, loads);
            if next < imbalance - 1e-12 {
                imbalance = next;
                counts = eval.counts(cand);
                return true;
            }
        } else if let Some(c) = eval.improves(cand, &counts) {
            let next = node_imbalance(cand, loads);
            if next <= limit {
                imbalance = next;
                counts = c;
                return true;
            }
        }
        false
    })
}
