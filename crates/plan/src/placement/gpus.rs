//! A node's replicas over its G GPUs: LPT on expected tokens, then swaps within the node that
//! lower the per-GPU λ* of the balanced dispatcher. Nodes keep their experts, so nothing here
//! changes a recovery probability.

use super::ClusterShape;
use crate::ExpertId;

/// One replica of an expert moves from GPU `from` to GPU `to` in its holder list.
pub(crate) fn move_replica(holders: &mut [usize], from: usize, to: usize) {
    if let Some(i) = holders.iter().position(|&h| h == from) {
        holders[i] = to;
    }
}

/// GPU index of every replica, per expert.
pub(crate) fn gpu_holders(nodes: &[Vec<ExpertId>], shape: ClusterShape, experts: usize) -> Vec<Vec<usize>> {
    let c = shape.slots_per_gpu;
    let mut holders = vec![Vec::new(); experts];
    for (n, node) in nodes.iter().enumerate() {
        for (k, &e) in node.iter().enumerate() {
            holders[e].push(n * shape.gpus_per_node + k / c);
        }
    }
    holders
}

/// (expert, GPU index) of every replica, node by node: what [`gpu_holders`] lists, without a
/// list per expert (λ* is made tens of thousands of times in a simulated day).
pub(crate) fn gpu_pairs(nodes: &[Vec<ExpertId>], shape: ClusterShape) -> Vec<(u32, u32)> {
    let (g, c) = (shape.gpus_per_node, shape.slots_per_gpu);
    let mut pairs = Vec::with_capacity(nodes.iter().map(Vec::len).sum());
    for (n, node) in nodes.iter().enumerate() {
        pairs.extend(node.iter().enumerate().map(|(k, &e)| (e as u32, (n * g + k / c) as u32)));
    }
    pairs
}

/// λ* over GPUs ([`crate::balance`]); inputs already validated.
pub(crate) fn gpu_lambda(nodes: &[Vec<ExpertId>], shape: ClusterShape, loads: &[f64]) -> f64 {
    crate::balance::min_max_load_of_pairs(&gpu_pairs(nodes, shape), loads, shape.ranks()).map_or(f64::INFINITY, |b| b.bottleneck)
}

/// Most candidate swaps evaluated (one max-flow each) per accepted swap and in all: the
/// refinement is a bounded improvement on [`balance_gpus`], never a search without end.
pub(crate) const REFINE_TRIES_PER_MOVE: usize = 64;
pub(crate) const REFINE_TRIES_PER_GPU: usize = 16;

/// Swaps of two replicas between GPUs of one node, taken while they lower the per-GPU λ*
/// ([`crate::balance`]) — a node keeps its experts, so every recovery probability is unchanged.
///
/// Why: [`balance_gpus`] spreads a node's replicas by their per-replica shares t_e/r_e, but the
/// balanced dispatcher sends an expert's tokens wherever there is room, and what limits the
/// busiest GPU is a min cut: experts X whose holder GPUs N(X) cannot absorb t(X) at λ (at 1K GPUs
/// two of four layers met the guard per node but were 1.06–1.09× per GPU). Moving a replica of X
/// off a GPU that keeps another X replica onto a GPU of the same node outside N(X) grows N(X) by
/// one GPU. A swap is taken when it lowers the tokens that overflow at just below the current λ*
/// (one max-flow); when none overflow, λ* itself has dropped and the next round aims lower.
pub(crate) fn refine_gpus(nodes: Vec<Vec<ExpertId>>, shape: ClusterShape, loads: &[f64]) -> Vec<Vec<ExpertId>> {
    if shape.gpus_per_node < 2 || loads.iter().sum::<f64>() <= 0.0 {
        return nodes;
    }
    let lambda_of = |nodes: &[Vec<ExpertId>]| gpu_lambda(nodes, shape, loads);
    let before = lambda_of(&nodes);
    let refined = refine_gpu_swaps(nodes.clone(), shape, loads);
    // Each swap lowers the overflow just below λ*; with near-ties between cuts that can still
    // raise λ* by a hair, so the result is kept only if it is no worse.
    if lambda_of(&refined) <= before {
        refined
    } else {
        nodes
    }
}

/// The swaps of [`refine_gpus`], for G ≥ 2 and some tokens.
pub(crate) fn refine_gpu_swaps(mut nodes: Vec<Vec<ExpertId>>, shape: ClusterShape, loads: &[f64]) -> Vec<Vec<ExpertId>> {
    let (g, c, bins) = (shape.gpus_per_node, shape.slots_per_gpu, shape.ranks());
    let experts = loads.len();
    let mean = loads.iter().sum::<f64>() / bins as f64;
    let lambda_of = |nodes: &[Vec<ExpertId>]| gpu_lambda(nodes, shape, loads);
    let mut lambda = lambda_of(&nodes);
    let mut budget = REFINE_TRIES_PER_GPU * bins;
    while lambda > mean * (1.0 + 1e-9) && budget > 0 {
        // Just below λ* the tight sets overflow by at least λ·1e-6 (one GPU's worth); the
        // tolerance is far below that and far above the flow's rounding.
        let target = lambda * (1.0 - 1e-6);
        let tol = 1e-9 * lambda;
        let holders = gpu_holders(&nodes, shape, experts);
        let cut = crate::balance::overflow(&holders, loads, bins, target);
        if cut.tokens <= tol {
            let next = lambda_of(&nodes);
            if next >= lambda * (1.0 - 1e-9) {
                break;
            }
            lambda = next;
            continue;
        }
        let mut moved = None;
        let mut tries = 0;
        'search: for (ni, node) in nodes.iter().enumerate() {
            let gpu = |k: usize| ni * g + k;
            for a in (0..g).filter(|&a| cut.bins[gpu(a)]) {
                let slots_a = &node[a * c..(a + 1) * c];
                if slots_a.iter().filter(|&&e| cut.experts[e]).count() < 2 {
                    continue;
                }
                // Replicas of X leave GPU a, a twice-held one first (a keeps that expert),
                // then the heaviest; the lightest replicas of GPU b (none of X: b is outside
                // N(X)) take their place.
                let mut from: Vec<usize> = (a * c..(a + 1) * c).filter(|&i| cut.experts[node[i]]).collect();
                let twice = |i: usize| slots_a.iter().filter(|&&e| e == node[i]).count() > 1;
                // Ties broken on the expert, so that dedup sees an expert's replicas together.
                from.sort_by(|&i, &j| {
                    twice(j).cmp(&twice(i)).then(loads[node[j]].total_cmp(&loads[node[i]])).then(node[i].cmp(&node[j])).then(i.cmp(&j))
                });
                from.dedup_by_key(|i| node[*i]);
                for b in (0..g).filter(|&b| !cut.bins[gpu(b)]) {
                    let mut to: Vec<usize> = (b * c..(b + 1) * c).collect();
                    to.sort_by(|&i, &j| loads[node[i]].total_cmp(&loads[node[j]]).then(node[i].cmp(&node[j])).then(i.cmp(&j)));
                    to.dedup_by_key(|i| node[*i]);
                    for &f in &from {
                        for &t in &to {
                            if tries >= REFINE_TRIES_PER_MOVE || budget == 0 {
                                break 'search;
                            }
                            tries += 1;
                            budget -= 1;
                            let mut trial = holders.clone();
                            let (x, y) = (node[f], node[t]);
                            move_replica(&mut trial[x], gpu(a), gpu(b));
                            move_replica(&mut trial[y], gpu(b), gpu(a));
                            if crate::balance::overflow(&trial, loads, bins, target).tokens < cut.tokens - tol {
                                let mut cand = node.clone();
                                cand.swap(f, t);
                                moved = Some((ni, cand));
                                break 'search;
                            }
                        }
                    }
                }
            }
        }
        let Some((ni, mut cand)) = moved else { break };
        for gpu in cand.chunks_mut(c) {
            gpu.sort_unstable();
        }
        nodes[ni] = cand;
    }
    nodes
}

/// Spread each node's replicas over its G GPUs so that expected tokens per GPU are balanced:
/// longest-processing-time first on the per-replica load t_e / r_e, preferring a GPU that
/// already holds the expert on ties (one physical copy then serves both replicas).
pub(crate) fn balance_gpus(
    nodes: Vec<Vec<ExpertId>>,
    replicas: &[usize],
    shape: ClusterShape,
    loads: Option<&[f64]>,
) -> Vec<Vec<ExpertId>> {
    let g = shape.gpus_per_node;
    let c = shape.slots_per_gpu;
    let weight = |e: ExpertId| match loads {
        Some(l) => l[e] / replicas[e] as f64,
        None => 1.0,
    };
    // Scratch reused across nodes: planning runs per layer on every reconfiguration and
    // rebalance, so per-node allocations add up (a simulated day at 1K GPUs is ~40k layer plans).
    let mut nodes = nodes;
    let mut keyed: Vec<(f64, ExpertId)> = Vec::new();
    let mut flat: Vec<ExpertId> = vec![0; g * c];
    let mut fill = vec![0usize; g];
    let mut load = vec![0.0f64; g];
    // The result depends only on the node's list, and MRO gives every node of a group the same
    // list: a node equal to the one before it gets the same GPUs without recomputing.
    let mut prev_in: Vec<ExpertId> = Vec::new();
    for node in nodes.iter_mut() {
        if g == 1 {
            node.sort_unstable();
            continue;
        }
        if !prev_in.is_empty() && *node == prev_in {
            node.copy_from_slice(&flat);
            continue;
        }
        prev_in.clear();
        prev_in.extend_from_slice(node);
        keyed.clear();
        keyed.extend(node.iter().map(|&e| (weight(e), e)));
        // Equal keys are the same expert twice: unstable order is still deterministic.
        keyed.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        fill.iter_mut().for_each(|x| *x = 0);
        load.iter_mut().for_each(|x| *x = 0.0);
        for &(w, e) in &keyed {
            // The least-loaded GPU with a free slot; on ties the first that already holds the
            // expert, else the first. One pass: whether a GPU holds `e` is only looked at when
            // its load ties the best so far.
            let mut pick = usize::MAX;
            let mut best = f64::INFINITY;
            let mut pick_holds = false;
            for k in 0..g {
                if fill[k] == c {
                    continue;
                }
                let l = load[k];
                if l < best || pick == usize::MAX {
                    pick = k;
                    best = l;
                    pick_holds = flat[k * c..k * c + fill[k]].contains(&e);
                } else if l == best && !pick_holds && flat[k * c..k * c + fill[k]].contains(&e) {
                    pick = k;
                    pick_holds = true;
                }
            }
            flat[pick * c + fill[pick]] = e;
            fill[pick] += 1;
            load[pick] += w;
        }
        for gpu in flat.chunks_mut(c) {
            gpu.sort_unstable();
        }
        node.clear();
        node.extend_from_slice(&flat);
    }
    nodes
}
