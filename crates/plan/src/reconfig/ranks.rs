//! The transfers of a reconfiguration, rank by rank. [`super::plan_reconfiguration`] maps the
//! live *nodes* onto the new plan's nodes and chooses, for every expert a node must newly hold,
//! the node that sends it (spreading the sends). A node of G GPUs then has one more question:
//! which of its ranks sends, and which receives — and an expert already on the node but on
//! another GPU than the new plan's is a copy inside the node. With one GPU per node these are
//! exactly `plan_reconfiguration`'s transfers.

use serde::{Deserialize, Serialize};

use super::StateTransfer;
use crate::fasthash::FastMap;
use crate::scheduler::ReplicaMap;
use crate::ExpertId;

/// A layer's replicas missing where the map places them, (expert, rank), and the ranks holding
/// each of their experts.
type LayerFetches = (Vec<(ExpertId, usize)>, Vec<Vec<usize>>);

/// One expert state copied from one rank of the new plan to another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankTransfer {
    pub layer: usize,
    pub expert: ExpertId,
    pub from: usize,
    pub to: usize,
}

/// Every expert rank `r` of `map` must hold and does not (`rank_holds[r]`: what the worker that
/// takes rank r holds now, per layer) comes from: a rank of the same node (`rank_node[r]`)
/// holding it, or else a rank holding it on the node `node_transfers` names as its sender to
/// this node, or else any holder — the least busy sender first, ties to the lowest rank. None if
/// some expert has no holder at all (or the inputs do not have one entry per rank of `map`).
pub fn rank_transfers<H: AsRef<[Vec<ExpertId>]> + Sync>(
    rank_node: &[u64],
    rank_holds: &[H],
    map: &ReplicaMap,
    node_transfers: &[StateTransfer],
) -> Option<Vec<RankTransfer>> {
    let ranks = map.ranks();
    if rank_node.len() != ranks || rank_holds.len() != ranks {
        return None;
    }
    let holds = |r: usize, l: usize| rank_holds[r].as_ref().get(l).map_or(&[][..], Vec::as_slice);
    // The node-level plan's sender of each expert a node newly needs (its first line for it).
    let mut sender_node: FastMap<(usize, ExpertId, u64), u64> = FastMap::with_capacity_and_hasher(node_transfers.len(), Default::default());
    for t in node_transfers {
        sender_node.entry((t.layer, t.expert, t.to)).or_insert(t.from);
    }
    // Per layer (on every core when the map is large: the layers are independent until the
    // senders are chosen): the replicas missing where the map places them, by expert then rank
    // (after a loss among a thousand nodes, a few in a million), and the ranks holding each of
    // their experts, in rank order (one pass over what the ranks hold: asking every rank for
    // every missing replica is quadratic).
    let find = |&l: &usize| -> Result<LayerFetches, std::convert::Infallible> {
        let missing: Vec<(ExpertId, usize)> = (0..map.experts())
            .flat_map(|e| map.placed(l, e).iter().filter(move |&&(r, _)| !holds(r, l).contains(&e)).map(move |&(r, _)| (e, r)))
            .collect();
        if missing.is_empty() {
            return Ok((missing, Vec::new()));
        }
        let mut needed = vec![false; map.experts()];
        missing.iter().for_each(|&(e, _)| needed[e] = true);
        let mut holders: Vec<Vec<usize>> = vec![Vec::new(); map.experts()];
        for r in 0..ranks {
            for &e in holds(r, l) {
                if needed.get(e) == Some(&true) && holders[e].last() != Some(&r) {
                    holders[e].push(r);
                }
            }
        }
        Ok((missing, holders))
    };
    let layers: Vec<usize> = (0..map.layer_count()).collect();
    let Ok(found) = crate::parallel::map_in_order_if(ranks * layers.len() >= 1 << 12, &layers, find);
    let mut sends = vec![0usize; ranks];
    // (Tens of thousands of transfers after a rebalance at 1,024 GPUs: grown one by one, the
    // vector's copies were a sixth of this function.)
    let mut out = Vec::with_capacity(found.iter().map(|(missing, _)| missing.len()).sum());
    let node_ranks = NodeRanks::of(rank_node);
    for (l, (missing, holders)) in found.into_iter().enumerate() {
        for (e, r) in missing {
            let sender = sender_node.get(&(l, e, rank_node[r])).copied();
            let from = if holders[e].len() > BY_NODE_FROM {
                choose_sender_indexed(&node_ranks, &holders[e], &sends, r, sender)?
            } else {
                choose_sender(&holders[e], &sends, rank_node, r, sender)?
            };
            sends[from] += 1;
            out.push(RankTransfer { layer: l, expert: e, from, to: r });
        }
    }
    Some(out)
}

/// Holders past this many are looked up node by node rather than scanned.
const BY_NODE_FROM: usize = 32;

/// Each node's ranks, ascending, and each rank's node among them.
///
/// Why: a joining node's every replica asks for the holders of an expert on its own node and on
/// the sender's; a widely replicated expert has hundreds (at 1,024 GPUs, scanning them was a
/// tenth of a simulated day, and grouping each expert's holders by node a third of the ranks'
/// transfer planning). A node's ranks are few, and usually numbered in a row: they are found
/// among the sorted holders by one search for the row, else one search each.
struct NodeRanks {
    /// Node i's ranks, ascending, and whether they are numbered in a row.
    ranks: Vec<(Vec<usize>, bool)>,
    /// Each rank's node i.
    of_rank: Vec<usize>,
    /// Node i of each node id.
    index: FastMap<u64, usize>,
}

impl NodeRanks {
    fn of(rank_node: &[u64]) -> Self {
        let mut index: FastMap<u64, usize> = FastMap::default();
        let mut ranks: Vec<(Vec<usize>, bool)> = Vec::new();
        let of_rank = rank_node
            .iter()
            .enumerate()
            .map(|(r, node)| {
                let next = index.len();
                let i = *index.entry(*node).or_insert(next);
                if i == ranks.len() {
                    ranks.push((Vec::new(), true));
                }
                ranks[i].0.push(r);
                i
            })
            .collect();
        for (list, in_a_row) in &mut ranks {
            *in_a_row = list.last().is_some_and(|&last| last + 1 - list[0] == list.len());
        }
        NodeRanks { ranks, of_rank, index }
    }

    /// The least busy (fewest `sends`, then lowest) of `holders` (ascending) on node i.
    fn least_on(&self, i: usize, holders: &[usize], sends: &[usize]) -> Option<usize> {
        let (ranks, in_a_row) = &self.ranks[i];
        let key = |&s: &usize| (sends[s], s);
        if *in_a_row {
            let (first, last) = (ranks[0], ranks[ranks.len() - 1]);
            let from = holders.partition_point(|&s| s < first);
            let to = from + holders[from..].partition_point(|&s| s <= last);
            return holders[from..to].iter().copied().min_by_key(key);
        }
        ranks.iter().copied().filter(|s| holders.binary_search(s).is_ok()).min_by_key(key)
    }
}

/// [`choose_sender`] for `holders` sorted ascending, with each node's ranks indexed: the same
/// choice.
fn choose_sender_indexed(node_ranks: &NodeRanks, holders: &[usize], sends: &[usize], to: usize, sender_node: Option<u64>) -> Option<usize> {
    node_ranks
        .least_on(node_ranks.of_rank[to], holders, sends)
        .or_else(|| sender_node.and_then(|n| node_ranks.index.get(&n)).and_then(|&i| node_ranks.least_on(i, holders, sends)))
        .or_else(|| holders.iter().copied().min_by_key(|&s| (sends[s], s)))
}

/// The rank that sends rank `to` a state it needs, among its `holders`: one on `to`'s node,
/// else one on the node the node-level plan names as the sender (`sender_node`), else any — of
/// those, the one that has sent least so far (`sends`), ties to the lowest rank.
fn choose_sender(holders: &[usize], sends: &[usize], rank_node: &[u64], to: usize, sender_node: Option<u64>) -> Option<usize> {
    let pick = |want: &dyn Fn(usize) -> bool| holders.iter().copied().filter(|&s| want(s)).min_by_key(|&s| (sends[s], s));
    let here = rank_node[to];
    pick(&|s| rank_node[s] == here).or_else(|| sender_node.and_then(|n| pick(&|s| rank_node[s] == n))).or_else(|| pick(&|_| true))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The plain reading of the rule: for each missing replica, ask every rank whether it holds
    /// the expert and scan the node-level plan for its sender.
    fn oracle(
        rank_node: &[u64],
        rank_holds: &[Vec<Vec<ExpertId>>],
        map: &ReplicaMap,
        node_transfers: &[StateTransfer],
    ) -> Option<Vec<RankTransfer>> {
        let ranks = map.ranks();
        let holds_it = |r: usize, l: usize, e: ExpertId| rank_holds[r].get(l).is_some_and(|x| x.contains(&e));
        let mut sends = vec![0usize; ranks];
        let mut out = Vec::new();
        for l in 0..map.layer_count() {
            for (e, row) in map.dense_layer(l).iter().enumerate() {
                for (r, &count) in row.iter().enumerate() {
                    if count == 0 || holds_it(r, l, e) {
                        continue;
                    }
                    // Every rank asked, the node-level plan scanned; the choice among them is the
                    // rule's own.
                    let here = rank_node[r];
                    let sender_node = node_transfers.iter().find(|t| t.layer == l && t.expert == e && t.to == here).map(|t| t.from);
                    let holders: Vec<usize> = (0..ranks).filter(|&s| s != r && holds_it(s, l, e)).collect();
                    let from = choose_sender(&holders, &sends, rank_node, r, sender_node)?;
                    sends[from] += 1;
                    out.push(RankTransfer { layer: l, expert: e, from, to: r });
                }
            }
        }
        Some(out)
    }

    proptest! {
        /// The indexed version picks exactly the senders of the plain rule, on any holdings
        /// (duplicates and unsorted lists included) and any node-level plan.
        #[test]
        fn rank_transfers_match_the_plain_rule(
            nodes in 1usize..4,
            g in 1usize..3,
            experts in 1usize..5,
            seed in proptest::collection::vec(0u32..3, 2 * 4 * 2 * 5),
            holds in proptest::collection::vec(proptest::collection::vec(0usize..6, 0..4), 2 * 4 * 2),
            senders in proptest::collection::vec((0usize..2, 0usize..5, 0u64..4, 0u64..4), 0..6),
        ) {
            let ranks = nodes * g;
            let layers = 2;
            let rank_node: Vec<u64> = (0..ranks).map(|r| (r / g) as u64).collect();
            let rank_holds: Vec<Vec<Vec<ExpertId>>> = (0..ranks).map(|r| (0..layers).map(|l| holds[(r * layers + l) % holds.len()].clone()).collect()).collect();
            let rows: Vec<Vec<Vec<u32>>> = (0..layers)
                .map(|l| {
                    (0..experts)
                        .map(|e| (0..ranks).map(|r| seed[((l * experts + e) * ranks + r) % seed.len()].max(u32::from(r == e % ranks))).collect())
                        .collect()
                })
                .collect();
            let map = ReplicaMap::new(1, rows).unwrap();
            let plan: Vec<StateTransfer> = senders.iter().map(|&(layer, expert, from, to)| StateTransfer { layer, expert, from, to, bytes: 1 }).collect();
            prop_assert_eq!(rank_transfers(&rank_node, &rank_holds, &map, &plan), oracle(&rank_node, &rank_holds, &map, &plan));
        }
    }

    proptest! {
        /// Holders looked up node by node choose exactly the sender the scan chooses (ranks
        /// of a node contiguous or spread).
        #[test]
        fn the_indexed_choice_is_the_scanned_one(
            holders in proptest::collection::btree_set(0usize..200, 1..120),
            sends in proptest::collection::vec(0usize..4, 200),
            g in 1usize..9,
            spread in any::<bool>(),
            to in 0usize..200,
            sender in proptest::option::of(0u64..30),
        ) {
            let holders: Vec<usize> = holders.into_iter().collect();
            let nodes = 200usize.div_ceil(g) as u64;
            let rank_node: Vec<u64> = (0..200).map(|r| if spread { (r as u64 * 7) % nodes } else { (r / g) as u64 }).collect();
            prop_assert_eq!(
                choose_sender_indexed(&NodeRanks::of(&rank_node), &holders, &sends, to, sender),
                choose_sender(&holders, &sends, &rank_node, to, sender)
            );
        }
    }

    fn map(rows: Vec<Vec<u32>>) -> ReplicaMap {
        ReplicaMap::new(1, vec![rows]).unwrap()
    }

    #[test]
    fn an_expert_on_another_gpu_of_the_node_is_copied_inside_it() {
        // Two nodes of two ranks (nodes 1 | 2). Expert 0 must be on rank 1, which lacks it;
        // rank 0 on the same node and rank 2 both hold it.
        let nodes = [1, 1, 2, 2];
        let holds = vec![vec![vec![0]], vec![vec![1]], vec![vec![0]], vec![vec![1]]];
        let m = map(vec![vec![1, 1, 1, 0], vec![0, 1, 0, 1]]);
        let t = rank_transfers(&nodes, &holds, &m, &[]).unwrap();
        assert_eq!(t, vec![RankTransfer { layer: 0, expert: 0, from: 0, to: 1 }]);
    }

    #[test]
    fn across_nodes_the_chosen_sender_node_sends_and_sends_are_spread() {
        // Node 3 (rank 3) needs experts 0 and 1; node 1 holds both on two ranks, node 2 holds
        // expert 1; the node-level plan says node 2 sends expert 1.
        let nodes = [1, 1, 2, 3];
        let holds = vec![vec![vec![0, 1]], vec![vec![0, 1]], vec![vec![1]], vec![vec![]]];
        let m = map(vec![vec![1, 1, 0, 1], vec![1, 1, 1, 1]]);
        let node_level = [StateTransfer { layer: 0, expert: 1, from: 2, to: 3, bytes: 1 }];
        let t = rank_transfers(&nodes, &holds, &m, &node_level).unwrap();
        assert_eq!(t, vec![RankTransfer { layer: 0, expert: 0, from: 0, to: 3 }, RankTransfer { layer: 0, expert: 1, from: 2, to: 3 }]);
        // An expert nobody holds: no move. Inputs of the wrong length: none either.
        let m = map(vec![vec![1, 0, 0, 0], vec![1, 0, 0, 0], vec![0, 0, 0, 1]]);
        assert!(rank_transfers(&nodes, &holds, &m, &[]).is_none());
        assert!(rank_transfers(&nodes[..3], &holds, &m, &[]).is_none());
    }

    #[test]
    fn with_one_gpu_per_node_the_node_level_senders_are_kept() {
        // Three single-rank nodes 10, 11, 12; expert 0 held by 10 and 11; the node plan says
        // 11 sends it to 12.
        let nodes = [10, 11, 12];
        let holds = vec![vec![vec![0]], vec![vec![0]], vec![vec![]]];
        let m = map(vec![vec![1, 1, 1]]);
        let node_level = [StateTransfer { layer: 0, expert: 0, from: 11, to: 12, bytes: 1 }];
        let t = rank_transfers(&nodes, &holds, &m, &node_level).unwrap();
        assert_eq!(t, vec![RankTransfer { layer: 0, expert: 0, from: 1, to: 2 }]);
    }
}
