//! The state transfers of a move, rank by rank. `plan_reconfiguration` (lazarus-plan) maps the
//! surviving *nodes* onto the new plan's nodes and chooses, for every expert a node must newly
//! hold, the node that sends it (spreading the sends). A node of G workers then has one more
//! question: which of its workers sends, and which receives — and an expert already on the node
//! but on another GPU than the new plan's is a copy inside the node. With one worker per node
//! this is exactly `plan_reconfiguration`'s transfers.

use std::collections::BTreeMap;

use lazarus_plan::{ReplicaMap, StateTransfer};
use lazarus_runtime::ExpertTransfer;

use super::NodeId;

/// Every expert rank `r` of `map` must hold and its worker `ranks[r]` does not (by `holds`,
/// what the survivors said they hold) comes from: a worker of the same node holding it, or else
/// a worker holding it on the node `node_transfers` names as its sender to this node, or else
/// any holder — the least busy sender first. None if some expert has no holder at all.
pub(crate) fn rank_transfers(
    ranks: &[NodeId],
    node_of: impl Fn(NodeId) -> u64,
    map: &ReplicaMap,
    holds: &BTreeMap<NodeId, Vec<Vec<usize>>>,
    node_transfers: &[StateTransfer],
) -> Option<Vec<ExpertTransfer>> {
    let holds_it = |w: NodeId, l: usize, e: usize| holds.get(&w).is_some_and(|h| h.get(l).is_some_and(|x| x.contains(&e)));
    let mut sends = vec![0usize; ranks.len()];
    let mut out = Vec::new();
    for (l, layer) in map.layers().iter().enumerate() {
        for (e, row) in layer.iter().enumerate() {
            for (r, &count) in row.iter().enumerate() {
                if count == 0 || holds_it(ranks[r], l, e) {
                    continue;
                }
                let here = node_of(ranks[r]);
                let sender_node = node_transfers.iter().find(|t| t.layer == l && t.expert == e && t.to == here).map(|t| t.from);
                let holders: Vec<usize> = (0..ranks.len()).filter(|&s| s != r && holds_it(ranks[s], l, e)).collect();
                let pick = |want: &dyn Fn(usize) -> bool| holders.iter().copied().filter(|&s| want(s)).min_by_key(|&s| (sends[s], s));
                let from = pick(&|s| node_of(ranks[s]) == here)
                    .or_else(|| sender_node.and_then(|n| pick(&|s| node_of(ranks[s]) == n)))
                    .or_else(|| pick(&|_| true))?;
                sends[from] += 1;
                out.push(ExpertTransfer { layer: l, expert: e, from, to: r });
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(rows: Vec<Vec<u32>>) -> ReplicaMap {
        ReplicaMap::new(1, vec![rows]).unwrap()
    }

    #[test]
    fn an_expert_on_another_gpu_of_the_node_is_copied_inside_it() {
        // Two nodes of two workers (10, 11 | 20, 21). Expert 0 must be on rank 1 (worker 11),
        // which lacks it; worker 10 on the same node and worker 20 both hold it.
        let ranks = [10, 11, 20, 21];
        let node = |w: NodeId| w / 10;
        let holds: BTreeMap<NodeId, Vec<Vec<usize>>> =
            [(10, vec![vec![0]]), (11, vec![vec![1]]), (20, vec![vec![0]]), (21, vec![vec![1]])].into();
        let m = map(vec![vec![1, 1, 1, 0], vec![0, 1, 0, 1]]);
        let t = rank_transfers(&ranks, node, &m, &holds, &[]).unwrap();
        assert_eq!(t, vec![ExpertTransfer { layer: 0, expert: 0, from: 0, to: 1 }]);
    }

    #[test]
    fn across_nodes_the_chosen_sender_node_sends_and_sends_are_spread() {
        // Node 3 (worker 30) needs experts 0 and 1; node 1 holds both on two workers, node 2
        // holds expert 1; the node-level plan says node 2 sends expert 1.
        let ranks = [10, 11, 20, 30];
        let node = |w: NodeId| w / 10;
        let holds: BTreeMap<NodeId, Vec<Vec<usize>>> =
            [(10, vec![vec![0, 1]]), (11, vec![vec![0, 1]]), (20, vec![vec![1]]), (30, vec![vec![]])].into();
        let m = map(vec![vec![1, 1, 0, 1], vec![1, 1, 1, 1]]);
        let node_level = [StateTransfer { layer: 0, expert: 1, from: 2, to: 3, bytes: 1 }];
        let t = rank_transfers(&ranks, node, &m, &holds, &node_level).unwrap();
        assert_eq!(t, vec![ExpertTransfer { layer: 0, expert: 0, from: 0, to: 3 }, ExpertTransfer { layer: 0, expert: 1, from: 2, to: 3 }]);
        // An expert nobody holds: no move.
        let m = map(vec![vec![1, 0, 0, 0], vec![1, 0, 0, 0], vec![0, 0, 0, 1]]);
        assert!(rank_transfers(&ranks, node, &m, &holds, &[]).is_none());
    }
}
