//! Repair: the running placement kept where it stands and changed only where it must.
//!
//! Why: a plan made afresh after a loss follows Theorem 1's groups, and one node fewer shifts
//! every group by that node's slots. At 1,023 of 1,024 nodes (58 layers × 256 experts, 32 slots
//! a node) the best mapping of the survivors onto a fresh plan still moves 1.71 M of the 1.90 M
//! replicas' state: nearly the whole model crosses the network to replace one node. Repair
//! keeps each surviving node's replicas in their slots (so on the same GPU), takes away
//! replicas of the experts the new allocation gives fewer, and puts the missing replicas (the
//! lost nodes', and what the allocation adds) into the freed slots and onto new nodes —
//! on a node that does not hold the expert yet when there is one, on its least loaded GPU.
//! What moves is then about what was lost.
//!
//! What it gives up: the layout is no longer Theorem 1's, so its recovery probability is what
//! the survivors' layout gives, not the optimum. The scheduler repairs only past the size at
//! which the optimum is searched exactly ([`super::search::SEARCH_MAX_NODES`]). A rebalance
//! past that size repairs too — each expert brought to the replicas its measured load asks for,
//! everything else where it stands — because planning afresh there moved nearly the whole model
//! (447,613 of 504 k replicas' state at 1,087 nodes of 8 GPUs, one slot each) and took 18 s to
//! plan on a 2-core VM; below it a rebalance plans afresh, restoring the structure when its gain
//! pays for the move.

use super::{ClusterShape, Placement};
use crate::ExpertId;

/// The node lists of a repaired placement on `shape`: node i starts as the previous plan's node
/// `origin[i]` (None: a new node, empty), then every expert e is brought to `replicas[e]`
/// replicas. None when the inputs do not fit together (a different node size, an origin out of
/// range or repeated, an allocation that does not fill the slots).
///
/// Removals take a replica that shares its node with another replica of the expert first
/// (it protects nothing against a node's loss), then the one on the busiest GPU. Additions go,
/// for the experts with the highest load per replica first, to a free slot on a node that does
/// not hold the expert, on the least loaded GPU; only when every free slot's node holds it
/// already, to a node that does.
pub(crate) fn repair_nodes(
    previous: &Placement,
    origin: &[Option<usize>],
    replicas: &[usize],
    shape: ClusterShape,
    loads: &[f64],
) -> Option<Vec<Vec<ExpertId>>> {
    let experts = previous.experts();
    let (s, c) = (shape.slots_per_node(), shape.slots_per_gpu);
    let fits = previous.shape().slots_per_node() == s
        && previous.shape().slots_per_gpu == c
        && origin.len() == shape.nodes
        && replicas.len() == experts
        && loads.len() == experts
        && replicas.iter().sum::<usize>() == shape.total_slots()
        && replicas.iter().all(|&r| r > 0);
    if !fits {
        return None;
    }
    let mut taken = vec![false; previous.shape().nodes];
    for q in origin.iter().flatten() {
        if *q >= taken.len() || std::mem::replace(&mut taken[*q], true) {
            return None;
        }
    }
    let mut slots: Vec<Vec<Option<ExpertId>>> =
        origin.iter().map(|o| o.map_or_else(|| vec![None; s], |q| previous.nodes()[q].iter().map(|&e| Some(e)).collect())).collect();
    let share = |e: ExpertId| loads[e] / replicas[e] as f64;
    let mut gpu_load = vec![0.0f64; shape.ranks()];
    let mut count = vec![0usize; experts];
    for (n, node) in slots.iter().enumerate() {
        for (k, e) in node.iter().enumerate() {
            if let Some(e) = *e {
                gpu_load[n * shape.gpus_per_node + k / c] += share(e);
                count[e] += 1;
            }
        }
    }
    remove_excess(&mut slots, &mut gpu_load, &mut count, replicas, shape, share);
    add_missing(&mut slots, &mut gpu_load, &count, replicas, shape, loads, share)?;
    slots.into_iter().map(|node| node.into_iter().collect::<Option<Vec<_>>>()).collect()
}

/// Take away replicas of every expert held more often than `replicas` asks: of each expert, the
/// replicas beside another of its replicas on the same node first (all but one per node), then
/// those on the busiest GPUs (loads as they were before any removal; ties to the last slot).
fn remove_excess(
    slots: &mut [Vec<Option<ExpertId>>],
    gpu_load: &mut [f64],
    count: &mut [usize],
    replicas: &[usize],
    shape: ClusterShape,
    share: impl Fn(ExpertId) -> f64,
) {
    let c = shape.slots_per_gpu;
    let rank = |n: usize, k: usize| n * shape.gpus_per_node + k / c;
    // Where each expert with too many replicas is, node by node: (node, slot).
    let mut positions: Vec<Vec<(usize, usize)>> = vec![Vec::new(); replicas.len()];
    for (n, node) in slots.iter().enumerate() {
        for (k, e) in node.iter().enumerate() {
            if let Some(e) = *e {
                if count[e] > replicas[e] {
                    positions[e].push((n, k));
                }
            }
        }
    }
    for (e, at) in positions.into_iter().enumerate().filter(|(_, at)| !at.is_empty()) {
        // (doubled on its node, GPU load, node, slot): every copy on a node but its least busy
        // one is doubled.
        let mut keyed: Vec<(bool, f64, usize, usize)> = Vec::with_capacity(at.len());
        for run in at.chunk_by(|a, b| a.0 == b.0) {
            let keep = run.iter().min_by(|a, b| gpu_load[rank(a.0, a.1)].total_cmp(&gpu_load[rank(b.0, b.1)]).then(a.cmp(b)));
            keyed.extend(run.iter().map(|&(n, k)| (Some(&(n, k)) != keep, gpu_load[rank(n, k)], n, k)));
        }
        keyed.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.total_cmp(&a.1)).then((b.2, b.3).cmp(&(a.2, a.3))));
        let excess = count[e] - replicas[e];
        for &(_, _, n, k) in keyed.iter().take(excess) {
            slots[n][k] = None;
            gpu_load[rank(n, k)] -= share(e);
            count[e] -= 1;
        }
    }
}

/// Fill every free slot with a replica of an expert held less often than `replicas` asks: the
/// experts with the highest load per replica first, each replica on the least loaded GPU with a
/// free slot whose node does not hold the expert (one that does only when no other is left).
/// None if the free slots and the missing replicas do not match.
fn add_missing(
    slots: &mut [Vec<Option<ExpertId>>],
    gpu_load: &mut [f64],
    count: &[usize],
    replicas: &[usize],
    shape: ClusterShape,
    loads: &[f64],
    share: impl Fn(ExpertId) -> f64,
) -> Option<()> {
    let g = shape.gpus_per_node;
    let free = &mut free_slots(slots, shape);
    let missing: usize = (0..replicas.len()).map(|e| replicas[e].saturating_sub(count[e])).sum();
    if missing != free.iter().map(Vec::len).sum::<usize>() {
        return None;
    }
    let mut open = open_gpus(free, gpu_load);
    // Which experts each node holds, as bits.
    let words = replicas.len().div_ceil(64);
    let mut has = vec![0u64; slots.len() * words];
    for (n, node) in slots.iter().enumerate() {
        for e in node.iter().flatten() {
            has[n * words + e / 64] |= 1 << (e % 64);
        }
    }
    let mut passed = Vec::new();
    for e in addition_order(count, replicas, loads, &share) {
        for _ in count[e]..replicas[e] {
            let holds = |r: usize| has[(r / g) * words + e / 64] & (1 << (e % 64)) != 0;
            // The least loaded GPU on a node without the expert. The GPUs passed over go back
            // once the expert is placed, not after each replica: their nodes hold it and will
            // until then, and handing them back each time made a hot expert's hundreds of
            // replicas pass over each other's nodes again and again (quadratic: at 1,024 nodes a
            // rebalance's repair took seconds).
            let r = pick_gpu(&mut open, &mut passed, holds)?.1 .0;
            let k = free[r].pop()?;
            let n = r / g;
            slots[n][k] = Some(e);
            has[n * words + e / 64] |= 1 << (e % 64);
            gpu_load[r] += share(e);
            if !free[r].is_empty() {
                open.push(gpu_key(r, gpu_load));
            }
        }
        open.extend(passed.drain(..));
    }
    Some(())
}

/// The least loaded GPU of `open` on a node without the expert (`holds(rank)`: its node has
/// it), the GPUs popped on the way left in `passed`; if every open GPU's node holds it, the least
/// loaded of those passed over. None: no GPU is open.
fn pick_gpu(open: &mut std::collections::BinaryHeap<OpenGpu>, passed: &mut Vec<OpenGpu>, holds: impl Fn(usize) -> bool) -> Option<OpenGpu> {
    while let Some(top) = open.pop() {
        if !holds(top.1 .0) {
            return Some(top);
        }
        passed.push(top);
    }
    passed.sort();
    passed.pop()
}

/// A GPU with a free slot, ordered so that the least loaded comes first from a max-heap (a load
/// is ≥ 0, so its bits order as it does; ties: the lowest rank).
type OpenGpu = (std::cmp::Reverse<u64>, std::cmp::Reverse<usize>);

fn gpu_key(r: usize, gpu_load: &[f64]) -> OpenGpu {
    (std::cmp::Reverse(gpu_load[r].max(0.0).to_bits()), std::cmp::Reverse(r))
}

/// The free slots of each GPU rank (popped from the end: lowest slot first).
fn free_slots(slots: &[Vec<Option<ExpertId>>], shape: ClusterShape) -> Vec<Vec<usize>> {
    let (g, c) = (shape.gpus_per_node, shape.slots_per_gpu);
    let mut free: Vec<Vec<usize>> = vec![Vec::new(); shape.ranks()];
    for (n, node) in slots.iter().enumerate() {
        for (k, x) in node.iter().enumerate().rev() {
            if x.is_none() {
                free[n * g + k / c].push(k);
            }
        }
    }
    free
}

/// The GPUs with a free slot, least loaded first.
fn open_gpus(free: &[Vec<usize>], gpu_load: &[f64]) -> std::collections::BinaryHeap<OpenGpu> {
    (0..free.len()).filter(|&r| !free[r].is_empty()).map(|r| gpu_key(r, gpu_load)).collect()
}

/// The experts short of replicas, the highest load per replica first (then the highest load,
/// then the lowest id).
fn addition_order(count: &[usize], replicas: &[usize], loads: &[f64], share: impl Fn(ExpertId) -> f64) -> Vec<ExpertId> {
    let mut order: Vec<ExpertId> = (0..replicas.len()).filter(|&e| count[e] < replicas[e]).collect();
    order.sort_by(|&a, &b| share(b).total_cmp(&share(a)).then(loads[b].total_cmp(&loads[a])).then(a.cmp(&b)));
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::{place, Strategy};
    use proptest::prelude::*;

    fn counts(nodes: &[Vec<ExpertId>], experts: usize) -> Vec<usize> {
        let mut r = vec![0; experts];
        nodes.iter().flatten().for_each(|&e| r[e] += 1);
        r
    }

    #[test]
    fn a_lost_node_costs_only_its_replicas() {
        // 6 nodes of 2 GPUs × 2 slots, 8 experts; node 2 is lost, the allocation shrinks by 4.
        let shape = ClusterShape::new(6, 2, 2).unwrap();
        let before = [3, 3, 3, 3, 3, 3, 3, 3];
        let p = place(&before, shape, Strategy::Lazarus, None).unwrap();
        let after = [2, 2, 3, 3, 3, 3, 2, 2];
        let origin = [Some(0), Some(1), Some(3), Some(4), Some(5)];
        let shape5 = ClusterShape::new(5, 2, 2).unwrap();
        let nodes = repair_nodes(&p, &origin, &after, shape5, &[1.0; 8]).unwrap();
        assert_eq!(counts(&nodes, 8), after);
        // Every slot that keeps an expert keeps the one it had: what changed is only what had to.
        let kept: usize =
            origin.iter().zip(&nodes).map(|(q, node)| node.iter().zip(&p.nodes()[q.unwrap()]).filter(|(a, b)| a == b).count()).sum();
        let lost_node = &p.nodes()[2];
        let must_change: usize = (0..8).map(|e| after[e].saturating_sub(before[e] - lost_node.iter().filter(|&&x| x == e).count())).sum();
        assert_eq!(20 - kept, must_change, "{nodes:?}");
    }

    #[test]
    fn new_nodes_take_the_added_replicas_and_inputs_that_do_not_fit_are_refused() {
        let shape = ClusterShape::new(3, 1, 2).unwrap();
        let p = place(&[2, 2, 2], shape, Strategy::Lazarus, None).unwrap();
        let shape4 = ClusterShape::new(4, 1, 2).unwrap();
        let origin = [Some(0), Some(1), Some(2), None];
        let nodes = repair_nodes(&p, &origin, &[3, 3, 1, 1], shape4, &[3.0, 3.0, 1.0, 1.0]);
        // Expert 3 is new to the layer's count: a plan over 4 experts is not this placement's.
        assert!(nodes.is_none());
        let nodes = repair_nodes(&p, &origin, &[3, 3, 2], shape4, &[3.0, 3.0, 1.0]).unwrap();
        assert_eq!(counts(&nodes, 3), vec![3, 3, 2]);
        assert_eq!(&nodes[..3], p.nodes(), "the old nodes keep everything");
        assert!(repair_nodes(&p, &[Some(0), Some(0), None, None], &[3, 3, 2], shape4, &[1.0; 3]).is_none());
        assert!(repair_nodes(&p, &[Some(0), Some(9), None, None], &[3, 3, 2], shape4, &[1.0; 3]).is_none());
        assert!(repair_nodes(&p, &origin, &[3, 3, 3], shape4, &[1.0; 3]).is_none());
    }

    /// The additions one replica at a time, every GPU passed over handed back after each: the
    /// first form of `add_missing`, kept as its oracle.
    fn add_missing_one_by_one(
        slots: &mut [Vec<Option<ExpertId>>],
        gpu_load: &mut [f64],
        count: &[usize],
        replicas: &[usize],
        shape: ClusterShape,
        loads: &[f64],
    ) -> Option<()> {
        let share = |e: ExpertId| loads[e] / replicas[e] as f64;
        let g = shape.gpus_per_node;
        let mut free = free_slots(slots, shape);
        let mut open = open_gpus(&free, gpu_load);
        let order = addition_order(count, replicas, loads, share);
        for e in order {
            for _ in count[e]..replicas[e] {
                let mut passed = Vec::new();
                let pick = pick_gpu(&mut open, &mut passed, |r| slots[r / g].contains(&Some(e)))?;
                open.extend(passed.drain(..));
                let r = pick.1 .0;
                let k = free[r].pop()?;
                slots[r / g][k] = Some(e);
                gpu_load[r] += share(e);
                if !free[r].is_empty() {
                    open.push(gpu_key(r, gpu_load));
                }
            }
        }
        Some(())
    }

    proptest! {
        /// Handing the passed-over GPUs back once an expert is placed, not after each replica,
        /// places every replica where handing them back each time does (hot experts with more
        /// replicas than nodes included: the last of them share nodes).
        #[test]
        fn additions_expert_by_expert_match_replica_by_replica(
            n in 1usize..7,
            g in 1usize..4,
            c in 1usize..3,
            experts in 1usize..6,
            cells in proptest::collection::vec((0usize..6, any::<bool>(), 0usize..6), 36),
            weights in proptest::collection::vec(1u32..50, 6),
        ) {
            let shape = ClusterShape::new(n, g, c).unwrap();
            let s = g * c;
            let loads: Vec<f64> = weights[..experts].iter().map(|&w| w as f64).collect();
            // Each slot: kept (its expert) or a hole that a given expert is to fill.
            let mut slots: Vec<Vec<Option<ExpertId>>> = vec![vec![None; s]; n];
            let mut count = vec![0usize; experts];
            let mut replicas = vec![0usize; experts];
            for (i, &(kept, hole, fill)) in cells.iter().take(n * s).enumerate() {
                if hole {
                    replicas[fill % experts] += 1;
                } else {
                    slots[i / s][i % s] = Some(kept % experts);
                    count[kept % experts] += 1;
                    replicas[kept % experts] += 1;
                }
            }
            prop_assume!(replicas.iter().all(|&r| r > 0));
            let share = |e: ExpertId| loads[e] / replicas[e] as f64;
            let mut gpu_load = vec![0.0f64; shape.ranks()];
            for (i, e) in slots.iter().flatten().enumerate() {
                if let Some(e) = *e {
                    gpu_load[(i / s) * g + (i % s) / c] += share(e);
                }
            }
            let (mut a, mut load_a) = (slots.clone(), gpu_load.clone());
            let (mut b, mut load_b) = (slots, gpu_load);
            let got = add_missing(&mut a, &mut load_a, &count, &replicas, shape, &loads, share);
            let want = add_missing_one_by_one(&mut b, &mut load_b, &count, &replicas, shape, &loads);
            prop_assert_eq!(got, want);
            prop_assert_eq!(a, b);
            prop_assert_eq!(load_a, load_b);
        }

        /// Whatever is lost or added, the repaired nodes hold exactly the allocation, every
        /// node is full, and a surviving slot changes only if its expert had too many
        /// replicas (a change no repair could avoid is the only change).
        #[test]
        fn repair_meets_the_allocation_and_keeps_the_rest(
            n in 2usize..8,
            g in 1usize..3,
            c in 1usize..4,
            experts in 1usize..6,
            lost in proptest::collection::vec(any::<bool>(), 8),
            added in 0usize..3,
            weights in proptest::collection::vec(1u32..9, 6),
        ) {
            let shape = ClusterShape::new(n, g, c).unwrap();
            let s = g * c;
            prop_assume!(n * s >= experts);
            let loads: Vec<f64> = weights[..experts].iter().map(|&w| w as f64).collect();
            let before = crate::allocation::allocate(&loads, n * s, 1).unwrap().replicas;
            let p = place(&before, shape, Strategy::Lazarus, None).unwrap();
            let mut origin: Vec<Option<usize>> = (0..n).filter(|&q| !lost[q]).map(Some).collect();
            origin.extend(std::iter::repeat_n(None, added));
            prop_assume!(!origin.is_empty() && origin.len() * s >= experts);
            let shape2 = ClusterShape::new(origin.len(), g, c).unwrap();
            let after = crate::allocation::allocate(&loads, origin.len() * s, 1).unwrap().replicas;
            let nodes = repair_nodes(&p, &origin, &after, shape2, &loads).unwrap();
            prop_assert_eq!(counts(&nodes, experts), after.clone());
            prop_assert!(nodes.iter().all(|node| node.len() == s));
            let kept_counts = counts(&origin.iter().flatten().map(|&q| p.nodes()[q].clone()).collect::<Vec<_>>(), experts);
            for (q, node) in origin.iter().zip(&nodes) {
                if let Some(q) = q {
                    for (old, new) in p.nodes()[*q].iter().zip(node) {
                        prop_assert!(old == new || kept_counts[*old] > after[*old], "expert {} changed though not in excess", old);
                    }
                }
            }
        }
    }
}
