//! Which experts to snapshot into another node's memory this step (MoEtion §4, PEC §3).
//!
//! MoEtion ranks the experts of a layer by the tokens they processed since their last snapshot
//! (the tokens a failure would make them lose) and splits a per-step byte budget across layers in
//! proportion to those tokens at risk. Lazarus adds one rule neither paper can: an expert whose
//! replicas sit on two or more distinct live nodes survives any single-node failure already, so
//! it needs no snapshot and its share of the budget goes to the experts that do.
//!
//! A pure function of its inputs: every rank computes the same selection from the same global
//! token counts, so senders and receivers agree without a message.

/// Which experts may be chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotPolicy {
    /// Every expert (MoEtion's selection, for comparison).
    Moetion,
    /// Only experts whose replicas are all on one node (ours).
    Lazarus,
}

/// One step's choice.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SnapshotSelection {
    /// (layer, expert), in the order they are to be sent.
    pub experts: Vec<(usize, usize)>,
    pub bytes: u64,
}

/// Choose experts to snapshot within `budget_bytes`.
///
/// * `since[l][e]`: tokens expert `e` of layer `l` processed since its last snapshot;
/// * `nodes_holding[l][e]`: distinct live nodes that hold a replica of it;
/// * `expert_bytes`: bytes of one expert's state (weights and optimizer moments) in each layer.
///
/// Each layer gets `budget · risk_l / Σ risk` (risk: its eligible experts' tokens since their
/// snapshot), and takes its experts by most tokens at risk while they fit; what the layers leave
/// unspent then goes to the remaining experts of every layer, by most tokens at risk. Experts
/// with nothing at risk are never sent (nothing would be lost). Ties go to the lower index.
pub fn select_snapshots(
    since: &[Vec<u64>],
    nodes_holding: &[Vec<usize>],
    expert_bytes: &[u64],
    budget_bytes: u64,
    policy: SnapshotPolicy,
) -> SnapshotSelection {
    let eligible = |l: usize, e: usize| {
        since[l][e] > 0
            && match policy {
                SnapshotPolicy::Moetion => true,
                SnapshotPolicy::Lazarus => nodes_holding.get(l).and_then(|n| n.get(e)).is_none_or(|&n| n < 2),
            }
    };
    let layers = since.len().min(expert_bytes.len());
    let risk: Vec<u64> = (0..layers).map(|l| (0..since[l].len()).filter(|&e| eligible(l, e)).map(|e| since[l][e]).sum::<u64>()).collect();
    let total: u128 = risk.iter().map(|&r| r as u128).sum();
    let mut out = SnapshotSelection::default();
    if total == 0 || budget_bytes == 0 {
        return out;
    }
    let ranked = |l: usize| {
        let mut es: Vec<usize> = (0..since[l].len()).filter(|&e| eligible(l, e)).collect();
        es.sort_by(|&a, &b| since[l][b].cmp(&since[l][a]).then(a.cmp(&b)));
        es
    };
    let mut taken = vec![Vec::<bool>::new(); layers];
    for l in 0..layers {
        taken[l] = vec![false; since[l].len()];
        let share = (budget_bytes as u128 * risk[l] as u128 / total) as u64;
        let mut spent = 0u64;
        for e in ranked(l) {
            if spent + expert_bytes[l] > share {
                break;
            }
            spent += expert_bytes[l];
            taken[l][e] = true;
            out.experts.push((l, e));
        }
        out.bytes += spent;
    }
    // The rest of the budget: the remaining experts of all layers, most at risk first.
    let mut rest: Vec<(u64, usize, usize)> = (0..layers)
        .flat_map(|l| ranked(l).into_iter().filter(|&e| !taken[l][e]).map(move |e| (since[l][e], l, e)).collect::<Vec<_>>())
        .collect();
    rest.sort_by(|a, b| b.0.cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
    for (_, l, e) in rest {
        if out.bytes + expert_bytes[l] <= budget_bytes {
            out.bytes += expert_bytes[l];
            out.experts.push((l, e));
        }
    }
    out
}

/// Distinct nodes holding each expert of each layer of `map`, ranks on nodes `node_of[rank]`.
pub fn nodes_holding(map: &crate::ReplicaMap, node_of: &[usize]) -> Vec<Vec<usize>> {
    (0..map.layer_count())
        .map(|l| {
            (0..map.experts())
                .map(|e| {
                    let mut nodes: Vec<usize> = map.placed(l, e).iter().filter_map(|&(r, _)| node_of.get(r).copied()).collect();
                    nodes.sort_unstable();
                    nodes.dedup();
                    nodes.len()
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn protected_experts_are_skipped_and_their_budget_goes_to_the_rest() {
        let since = vec![vec![50, 40, 30, 20]];
        let nodes = vec![vec![2, 1, 1, 3]];
        let ours = select_snapshots(&since, &nodes, &[10], 30, SnapshotPolicy::Lazarus);
        assert_eq!(ours.experts, vec![(0, 1), (0, 2)], "expert 0 and 3 live on two nodes or more");
        assert_eq!(ours.bytes, 20);
        let theirs = select_snapshots(&since, &nodes, &[10], 30, SnapshotPolicy::Moetion);
        assert_eq!(theirs.experts, vec![(0, 0), (0, 1), (0, 2)]);
        // A budget for everything: ours sends only what is at risk.
        let all = select_snapshots(&since, &nodes, &[10], 1000, SnapshotPolicy::Lazarus);
        assert_eq!(all.bytes, 20);
        assert_eq!(select_snapshots(&since, &nodes, &[10], 1000, SnapshotPolicy::Moetion).bytes, 40);
    }

    #[test]
    fn the_budget_is_split_by_tokens_at_risk() {
        // Layer 0 has 3x the risk of layer 1: 30 of the 40 bytes, then the remainder by risk.
        let since = vec![vec![30, 30, 30], vec![10, 10, 10]];
        let nodes = vec![vec![1; 3], vec![1; 3]];
        let s = select_snapshots(&since, &nodes, &[10, 10], 40, SnapshotPolicy::Lazarus);
        assert_eq!(s.experts, vec![(0, 0), (0, 1), (0, 2), (1, 0)]);
        // Nothing at risk, nothing sent; no budget, nothing sent.
        assert!(select_snapshots(&[vec![0, 0]], &[vec![1, 1]], &[10], 100, SnapshotPolicy::Moetion).experts.is_empty());
        assert!(select_snapshots(&since, &nodes, &[10, 10], 0, SnapshotPolicy::Moetion).experts.is_empty());
    }

    #[test]
    fn nodes_holding_counts_distinct_nodes() {
        // 4 ranks, 2 per node: expert 0 on ranks 0 and 1 (node 0), expert 1 on ranks 1 and 2.
        let replicas = crate::ReplicaMap::new(0, vec![vec![vec![1, 1, 0, 0], vec![0, 1, 1, 0]]]).unwrap();
        assert_eq!(nodes_holding(&replicas, &[0, 0, 1, 1]), vec![vec![1, 2]]);
    }

    proptest! {
        /// Never over budget, never a protected expert (ours) nor one with nothing at risk, no
        /// expert twice; and an expert left out never has more at risk than one taken in the same
        /// layer (same bytes per expert in a layer).
        #[test]
        fn within_budget_and_most_at_risk_first(
            since in proptest::collection::vec(proptest::collection::vec(0u64..100, 1..6), 1..4),
            seed in 0u64..1000,
            budget in 0u64..200,
        ) {
            let nodes: Vec<Vec<usize>> = since.iter().enumerate().map(|(l, es)| (0..es.len()).map(|e| (seed as usize + l * 7 + e * 3) % 3).collect()).collect();
            let bytes: Vec<u64> = (0..since.len()).map(|l| 5 + 5 * l as u64).collect();
            for policy in [SnapshotPolicy::Lazarus, SnapshotPolicy::Moetion] {
                let s = select_snapshots(&since, &nodes, &bytes, budget, policy);
                prop_assert!(s.bytes <= budget);
                prop_assert_eq!(s.bytes, s.experts.iter().map(|&(l, _)| bytes[l]).sum::<u64>());
                let mut seen = s.experts.clone();
                seen.sort_unstable();
                seen.dedup();
                prop_assert_eq!(seen.len(), s.experts.len());
                for &(l, e) in &s.experts {
                    prop_assert!(since[l][e] > 0);
                    if policy == SnapshotPolicy::Lazarus {
                        prop_assert!(nodes[l][e] < 2);
                    }
                }
                for l in 0..since.len() {
                    let taken: Vec<usize> = s.experts.iter().filter(|x| x.0 == l).map(|x| x.1).collect();
                    let eligible = |e: usize| since[l][e] > 0 && (policy == SnapshotPolicy::Moetion || nodes[l][e] < 2);
                    if let Some(min_taken) = taken.iter().map(|&e| since[l][e]).min() {
                        for e in (0..since[l].len()).filter(|&e| eligible(e) && !taken.contains(&e)) {
                            prop_assert!(since[l][e] <= min_taken);
                        }
                    }
                }
            }
        }
    }
}
