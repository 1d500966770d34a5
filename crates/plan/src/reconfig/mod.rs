//! Reconfiguration after a failure, a join or a rebalance (paper §4.3).
//!
//! A new plan names abstract plan nodes 0..N'. Which live physical node becomes which plan node
//! decides how much expert state (weights and optimizer moments) must move: a node only fetches
//! the experts it is newly assigned. The paper maps nodes greedily; we solve the assignment
//! exactly (Hungarian algorithm, O(N³), fine to ~1,000 nodes) and fall back to the greedy above
//! that. Each missing (layer, expert, node) is then fetched from a live old holder, choosing the
//! holder that has been asked for the fewest bytes so far, most constrained fetches first, so
//! the transfer time is spread over all holders.

mod assignment;
mod lists;
mod moves;
mod ranks;

pub use moves::Move;
pub use ranks::{rank_transfers, RankTransfer};

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;

use serde::{Deserialize, Serialize};

use crate::distinct::{distinct_sorted, each_missing, extend_distinct_sorted};
use crate::error::PlanError;
use crate::placement::Placement;
use crate::ExpertId;
use assignment::{greedy_assignment, min_cost_assignment};
use lists::Lists;

/// What one live physical node holds before the change: for each layer, the experts it has a
/// replica of. A node that just joined holds nothing (empty `experts`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeState {
    pub node: u64,
    pub experts: Vec<Vec<ExpertId>>,
}

/// One expert state copied between nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateTransfer {
    pub layer: usize,
    pub expert: ExpertId,
    pub from: u64,
    pub to: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReconfigurationPlan {
    /// `plan_to_node[q]` = the physical node that takes plan node q.
    pub plan_to_node: Vec<u64>,
    pub transfers: Vec<StateTransfer>,
    /// (layer, expert) pairs with no live holder: these need a snapshot or a checkpoint.
    pub lost: Vec<(usize, ExpertId)>,
    /// Bytes each holder sends.
    pub bytes_per_sender: BTreeMap<u64, u64>,
}

impl ReconfigurationPlan {
    pub fn total_bytes(&self) -> u64 {
        self.transfers.iter().map(|t| t.bytes).sum()
    }
}

/// Above this many nodes the O(N³) exact assignment gives way to the paper's greedy mapping.
const EXACT_MAPPING_MAX_NODES: usize = 1024;

/// Map `live` nodes onto the nodes of the new per-layer plans and schedule the state transfers.
/// `expert_bytes[layer]` is the size of one expert's state in that layer.
pub fn plan_reconfiguration(live: &[NodeState], new_layers: &[Placement], expert_bytes: &[u64]) -> Result<ReconfigurationPlan, PlanError> {
    plan_move(live, new_layers, expert_bytes, None)
}

/// [`plan_reconfiguration`] with the mapping given: `live[p]` becomes plan node
/// `node_to_plan[p]` (a plan repaired in place of the running one names its nodes so:
/// [`crate::replan_model`]). Only the transfers are scheduled, in the same way.
pub fn plan_reconfiguration_mapped(
    live: &[NodeState],
    new_layers: &[Placement],
    expert_bytes: &[u64],
    node_to_plan: &[usize],
) -> Result<ReconfigurationPlan, PlanError> {
    let mut seen = vec![false; live.len()];
    if node_to_plan.len() != live.len() {
        return Err(PlanError::Length { field: "node mapping", got: node_to_plan.len(), expected: live.len() });
    }
    for &q in node_to_plan {
        if q >= live.len() || std::mem::replace(&mut seen[q], true) {
            return Err(PlanError::invalid("node mapping", q, "plan nodes must be named once each"));
        }
    }
    plan_move(live, new_layers, expert_bytes, Some(node_to_plan))
}

/// What a move onto `new_layers` would fetch, without choosing who sends: the mapping of
/// [`plan_reconfiguration`] (`plan_to_node[q]` takes plan node q) and, per layer, the expert
/// states fetched and their bytes (the transfers it would plan, counted). A rebalance is
/// weighed on this; the senders are chosen only for the move made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoveSize {
    pub plan_to_node: Vec<u64>,
    pub per_layer: Vec<(usize, u64)>,
}

/// [`MoveSize`] of the move [`plan_reconfiguration`] would plan.
pub fn size_of_move(live: &[NodeState], new_layers: &[Placement], expert_bytes: &[u64]) -> Result<MoveSize, PlanError> {
    let f = fetches(live, new_layers, expert_bytes, None)?;
    let mut per_layer = vec![(0usize, 0u64); new_layers.len()];
    for &(l, e, _) in &f.missing {
        if !f.holders[l].get(e).is_empty() {
            per_layer[l].0 += 1;
            per_layer[l].1 += expert_bytes[l];
        }
    }
    Ok(MoveSize { plan_to_node: f.plan_to_node, per_layer })
}

fn plan_move(
    live: &[NodeState],
    new_layers: &[Placement],
    expert_bytes: &[u64],
    mapped: Option<&[usize]>,
) -> Result<ReconfigurationPlan, PlanError> {
    let Fetches { plan_to_node, missing, holders } = fetches(live, new_layers, expert_bytes, mapped)?;
    let (transfers, lost, bytes_per_sender) = assign_senders(missing, &holders, live, expert_bytes);
    Ok(ReconfigurationPlan { plan_to_node, transfers, lost, bytes_per_sender })
}

/// A move's fetches before any sender is chosen: the mapping, every (layer, expert, live node)
/// missing where it goes, and the live holders of (at least) each missing expert, per layer.
struct Fetches {
    plan_to_node: Vec<u64>,
    missing: Vec<(usize, ExpertId, usize)>,
    holders: Vec<Lists>,
}

/// [`Fetches`] of a move onto `new_layers`, with the mapping given (`mapped`) or the one that
/// fetches least.
fn fetches(live: &[NodeState], new_layers: &[Placement], expert_bytes: &[u64], mapped: Option<&[usize]>) -> Result<Fetches, PlanError> {
    check_move_inputs(live, new_layers, expert_bytes)?;
    let (layers, n) = (new_layers.len(), live.len());
    // Past a few thousand (node, layer) lists, each list-making pass below runs on every core
    // (at 128 nodes of 58 layers each was a serial part of every weighing and move).
    let large = n * layers >= 1 << 12;
    let each = |count: usize| -> Vec<usize> { (0..count).collect() };
    // held[p][layer]: sets of experts, as sorted lists (at a thousand nodes of 58 layers, tree
    // sets took most of a move's planning); a list given sorted is used as it is.
    let nodes: Vec<&NodeState> = live.iter().collect();
    let Ok(held) = crate::parallel::map_in_order_if(large, &nodes, |&s| {
        Ok::<_, Infallible>((0..layers).map(|l| s.experts.get(l).map_or(Cow::Borrowed(&[][..]), |v| sorted(v))).collect::<Vec<_>>())
    });
    // holders[layer].get(e): the live nodes holding e, in order — of every expert (`needed`:
    // None) or of those needed.
    let holders_of = |needed: Option<&[Vec<bool>]>| -> Vec<Lists> {
        let Ok(lists) = crate::parallel::map_in_order_if(large, &each(layers), |&l| {
            let experts = new_layers[l].experts();
            let mut pairs = Vec::new();
            for (p, held) in held.iter().enumerate() {
                pairs.extend(held[l].iter().filter(|&&e| e < experts && needed.is_none_or(|x| x[l][e])).map(|&e| (e, p)));
            }
            Ok::<_, Infallible>(Lists::grouped(experts, &pairs))
        });
        lists
    };
    let (node_to_plan, all_holders) = match mapped {
        Some(m) => (m.to_vec(), None),
        None => {
            // What plan node q wants of layer l: list q·layers + l, its distinct experts.
            let Ok(wants) = crate::parallel::map_in_order_if(large, &each(n), |&q| {
                let mut wants = Lists::default();
                new_layers.iter().for_each(|p| wants.push_with(|items| extend_distinct_sorted(items, &p.nodes()[q])));
                Ok::<_, Infallible>(wants)
            });
            let mut wanted = Lists::default();
            wants.iter().for_each(|lists| wanted.append(lists));
            let holders = holders_of(None);
            let cost = missing_bytes(&wanted, &holders, expert_bytes);
            let mapping = if n <= EXACT_MAPPING_MAX_NODES { min_cost_assignment(&cost) } else { greedy_assignment(&cost) };
            (mapping, Some(holders))
        }
    };
    let mut plan_to_node = vec![0u64; n];
    for (p, &q) in node_to_plan.iter().enumerate() {
        plan_to_node[q] = live[p].node;
    }

    // Every fetch, then its candidate holders (after a loss among a thousand nodes, a few in a
    // million replicas are fetched: only their experts' holders are listed).
    // (Nodes on every core when there are many: each is one pass over its new slots.)
    let missing_on = |(p, &q): (usize, &usize)| -> Vec<(usize, ExpertId, usize)> {
        let mut missing = Vec::new();
        for l in 0..layers {
            each_missing(&held[p][l], &new_layers[l].nodes()[q], |e| missing.push((l, e, p)));
        }
        missing
    };
    let jobs: Vec<(usize, &usize)> = node_to_plan.iter().enumerate().collect();
    let Ok(parts) = crate::parallel::map_in_order_if(large, &jobs, |&j| Ok::<_, Infallible>(missing_on(j)));
    let missing: Vec<(usize, ExpertId, usize)> = parts.into_iter().flatten().collect();
    let holders = all_holders.unwrap_or_else(|| {
        let mut needed: Vec<Vec<bool>> = new_layers.iter().map(|p| vec![false; p.experts()]).collect();
        missing.iter().for_each(|&(l, e, _)| needed[l][e] = true);
        holders_of(Some(&needed))
    });
    Ok(Fetches { plan_to_node, missing, holders })
}

/// The inputs of a move, checked: a plan of as many nodes as are live for every layer, an
/// expert size per layer, each live node once, with its experts for every layer (or none).
fn check_move_inputs(live: &[NodeState], new_layers: &[Placement], expert_bytes: &[u64]) -> Result<(), PlanError> {
    let layers = new_layers.len();
    if expert_bytes.len() != layers {
        return Err(PlanError::Length { field: "expert_bytes", got: expert_bytes.len(), expected: layers });
    }
    let n = live.len();
    for p in new_layers {
        if p.shape().nodes != n {
            return Err(PlanError::Length { field: "plan nodes", got: p.shape().nodes, expected: n });
        }
    }
    let mut ids = BTreeSet::new();
    for s in live {
        if !ids.insert(s.node) {
            return Err(PlanError::invalid("node", s.node, "listed twice among live nodes"));
        }
        if !s.experts.is_empty() && s.experts.len() != layers {
            return Err(PlanError::Length { field: "node experts (layers)", got: s.experts.len(), expected: layers });
        }
    }
    Ok(())
}

/// A sender for every fetch (layer, expert, to live node) among its `holders`: the fetches
/// with the fewest candidate holders first, the biggest experts first among them, each from
/// the candidate that has sent the least so far. The transfers, the experts nobody holds, and
/// the bytes each sender sends.
#[allow(clippy::type_complexity)]
fn assign_senders(
    missing: Vec<(usize, ExpertId, usize)>,
    holders: &[Lists],
    live: &[NodeState],
    expert_bytes: &[u64],
) -> (Vec<StateTransfer>, Vec<(usize, ExpertId)>, BTreeMap<u64, u64>) {
    let n = live.len();
    struct Fetch<'h> {
        layer: usize,
        expert: ExpertId,
        to: usize,
        holders: &'h [usize],
    }
    let mut fetches = Vec::new();
    let mut lost = BTreeSet::new();
    for (l, e, p) in missing {
        let holders = holders[l].get(e);
        if holders.is_empty() {
            lost.insert((l, e));
        } else {
            fetches.push(Fetch { layer: l, expert: e, to: p, holders });
        }
    }
    // (Each (layer, expert, node) is fetched once: the keys are distinct, so the unstable sort's
    // order is the stable one's, without its buffer.)
    fetches.sort_unstable_by_key(|f| (f.holders.len(), std::cmp::Reverse(expert_bytes[f.layer]), f.layer, f.expert, f.to));
    let mut sent = vec![0u64; n];
    let mut transfers = Vec::with_capacity(fetches.len());
    for f in fetches {
        let from = *f.holders.iter().min_by_key(|&&h| (sent[h], h)).expect("non-empty holders");
        sent[from] += expert_bytes[f.layer];
        transfers.push(StateTransfer {
            layer: f.layer,
            expert: f.expert,
            from: live[from].node,
            to: live[f.to].node,
            bytes: expert_bytes[f.layer],
        });
    }
    transfers.sort_unstable_by_key(|t| (t.layer, t.expert, t.to));
    let bytes_per_sender = (0..n).filter(|&h| sent[h] > 0).map(|h| (live[h].node, sent[h])).collect();
    (transfers, lost.into_iter().collect(), bytes_per_sender)
}

/// cost[p][q]: the bytes live node p must receive to become plan node q — what q wants (its
/// distinct experts, per layer) that p does not hold. Counted as everything q wants, less what
/// each holder of each wanted expert already has: one pass over the holders instead of a set
/// difference per (p, q) pair (128 nodes × 58 layers: 3.8 M steps instead of 950 k differences).
/// Each plan node's column is made as one contiguous row (it stays in the first-level cache
/// while every holder of every wanted expert is taken off it), plan nodes on every core.
fn missing_bytes(wanted: &Lists, holders: &[Lists], expert_bytes: &[u64]) -> Vec<Vec<i64>> {
    let layers = expert_bytes.len();
    let n = wanted.len() / layers.max(1);
    let plan_nodes: Vec<usize> = (0..n).collect();
    let column = |&q: &usize| -> Result<Vec<i64>, std::convert::Infallible> {
        let wants = |l: usize| wanted.get(q * layers + l);
        let all: i64 = (0..layers).map(|l| (wants(l).len() as u64 * expert_bytes[l]) as i64).sum();
        let mut column = vec![all; n];
        for l in 0..layers {
            let b = expert_bytes[l] as i64;
            for &e in wants(l) {
                for &p in holders[l].get(e) {
                    column[p] -= b;
                }
            }
        }
        Ok(column)
    };
    let Ok(columns) = crate::parallel::map_in_order_if(n >= 64, &plan_nodes, column);
    (0..n).map(|p| columns.iter().map(|c| c[p]).collect()).collect()
}

/// `v` as a set: itself when sorted without repeats, else a sorted copy without them.
fn sorted(v: &[ExpertId]) -> Cow<'_, [ExpertId]> {
    if v.windows(2).all(|w| w[0] < w[1]) {
        return Cow::Borrowed(v);
    }
    Cow::Owned(distinct_sorted(v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::{place, ClusterShape, Strategy};
    use crate::rng::SplitMix64;
    use proptest::prelude::*;

    proptest! {
        /// The holder-indexed cost matrix is the set differences' (the plain reading).
        #[test]
        fn missing_bytes_are_the_set_differences(
            held in proptest::collection::vec(proptest::collection::vec(proptest::collection::btree_set(0usize..6, 0..4), 2), 1..5),
            wanted_lists in proptest::collection::vec(proptest::collection::vec(proptest::collection::btree_set(0usize..6, 0..4), 2), 1..5),
            bytes in proptest::collection::vec(1u64..100, 2),
        ) {
            let n = held.len().min(wanted_lists.len());
            let (held, wanted) = (&held[..n], &wanted_lists[..n]);
            let holders: Vec<Lists> = (0..2)
                .map(|l| {
                    let h: Vec<Vec<usize>> = (0..6).map(|e| (0..n).filter(|&p| held[p][l].contains(&e)).collect()).collect();
                    Lists::of(h.iter().map(Vec::as_slice))
                })
                .collect();
            let plain: Vec<Vec<i64>> = (0..n)
                .map(|p| (0..n).map(|q| (0..2).map(|l| (wanted[q][l].difference(&held[p][l]).count() as u64 * bytes[l]) as i64).sum()).collect())
                .collect();
            let wanted: Vec<Vec<ExpertId>> = wanted.iter().flat_map(|w| w.iter().map(|x| x.iter().copied().collect())).collect();
            let wanted = Lists::of(wanted.iter().map(Vec::as_slice));
            prop_assert_eq!(missing_bytes(&wanted, &holders, &bytes), plain);
        }
    }

    #[test]
    fn surviving_nodes_keep_their_experts_after_one_failure() {
        // 5 nodes, one layer; node 7 (old plan node 2) dies. The survivors are mapped so that
        // only the experts the new plan adds must move, and every transfer is from a holder.
        let shape = ClusterShape::new(5, 1, 4).unwrap();
        let old = place(&[2, 5, 6, 7], shape, Strategy::Lazarus, None).unwrap();
        let ids = [5u64, 6, 7, 8, 9];
        let live: Vec<NodeState> =
            (0..5).filter(|&i| i != 2).map(|i| NodeState { node: ids[i], experts: vec![old.nodes()[i].clone()] }).collect();
        let new_shape = ClusterShape::new(4, 1, 4).unwrap();
        let new = place(&[2, 4, 5, 5], new_shape, Strategy::Lazarus, None).unwrap();
        let plan = plan_reconfiguration(&live, std::slice::from_ref(&new), &[1000]).unwrap();
        let mut mapped = plan.plan_to_node.clone();
        mapped.sort();
        assert_eq!(mapped, vec![5, 6, 8, 9]);
        assert!(plan.lost.is_empty());
        for t in &plan.transfers {
            let from = live.iter().find(|s| s.node == t.from).unwrap();
            let to = live.iter().find(|s| s.node == t.to).unwrap();
            assert!(from.experts[0].contains(&t.expert));
            assert!(!to.experts[0].contains(&t.expert));
        }
        // After the transfers every node holds what its plan node needs.
        for (q, &node) in plan.plan_to_node.iter().enumerate() {
            let state = live.iter().find(|s| s.node == node).unwrap();
            for e in &new.nodes()[q] {
                let fetched = plan.transfers.iter().any(|t| t.to == node && t.expert == *e);
                assert!(state.experts[0].contains(e) || fetched);
            }
        }
    }

    #[test]
    fn identical_plan_moves_nothing() {
        let shape = ClusterShape::new(4, 1, 3).unwrap();
        let p = place(&[2, 3, 3, 4], shape, Strategy::Lazarus, None).unwrap();
        // Physical nodes listed in reverse so the identity mapping has to be found.
        let live: Vec<NodeState> = (0..4).rev().map(|i| NodeState { node: 100 + i as u64, experts: vec![p.nodes()[i].clone()] }).collect();
        let plan = plan_reconfiguration(&live, std::slice::from_ref(&p), &[1]).unwrap();
        assert!(plan.transfers.is_empty(), "{plan:?}");
        for (q, &node) in plan.plan_to_node.iter().enumerate() {
            let mut have = p.nodes()[(node - 100) as usize].clone();
            let mut want = p.nodes()[q].clone();
            have.sort();
            want.sort();
            assert_eq!(have, want);
        }
    }

    #[test]
    fn lost_experts_are_reported_and_bad_input_rejected() {
        let shape = ClusterShape::new(2, 1, 2).unwrap();
        let p = place(&[2, 2], shape, Strategy::Compact, None).unwrap();
        // Only a fresh node and a node that held expert 1 are alive: expert 0 is lost.
        let live = vec![NodeState { node: 1, experts: vec![vec![1, 1]] }, NodeState { node: 2, experts: vec![] }];
        let plan = plan_reconfiguration(&live, std::slice::from_ref(&p), &[10]).unwrap();
        assert_eq!(plan.lost, vec![(0, 0)]);
        let dup = vec![live[0].clone(), live[0].clone()];
        assert!(plan_reconfiguration(&dup, std::slice::from_ref(&p), &[10]).unwrap_err().to_string().contains("twice"));
        assert!(plan_reconfiguration(&live, std::slice::from_ref(&p), &[]).is_err());
        assert!(plan_reconfiguration(&live[..1], std::slice::from_ref(&p), &[10]).is_err());
    }

    #[test]
    fn fetches_are_spread_over_holders() {
        // Four survivors each hold expert 0; four fresh nodes each need it: one each.
        let shape = ClusterShape::new(8, 1, 1).unwrap();
        let p = Placement::from_nodes(shape, 1, vec![vec![0]; 8]).unwrap();
        let live: Vec<NodeState> = (0..8).map(|i| NodeState { node: i, experts: if i < 4 { vec![vec![0]] } else { vec![] } }).collect();
        let plan = plan_reconfiguration(&live, std::slice::from_ref(&p), &[64]).unwrap();
        assert_eq!(plan.transfers.len(), 4);
        assert_eq!(plan.bytes_per_sender.values().copied().collect::<Vec<_>>(), vec![64; 4]);
        assert_eq!(plan.total_bytes(), 256);
    }

    proptest! {
        /// The size a rebalance is weighed on is the move's own: the same mapping, and per layer
        /// the transfers it plans and their bytes (nodes holding anything, fresh ones, losses).
        #[test]
        fn a_moves_size_counts_its_planned_transfers(n in 1usize..6, layers in 1usize..4, seed in any::<u64>()) {
            let mut rng = SplitMix64::new(seed);
            let shape = ClusterShape::new(n, 1 + rng.below(2), 1 + rng.below(3)).unwrap();
            let experts = 1 + rng.below(shape.total_slots());
            let new: Vec<Placement> = (0..layers)
                .map(|_| {
                    let mut replicas = vec![1; experts];
                    (experts..shape.total_slots()).for_each(|_| replicas[rng.below(experts)] += 1);
                    place(&replicas, shape, Strategy::Spread, None).unwrap()
                })
                .collect();
            let live: Vec<NodeState> = (0..n)
                .map(|i| NodeState {
                    node: 10 + i as u64,
                    experts: if rng.below(4) == 0 { vec![] } else { (0..layers).map(|_| (0..rng.below(4)).map(|_| rng.below(experts + 1)).collect()).collect() },
                })
                .collect();
            let bytes: Vec<u64> = (0..layers).map(|_| 1 + rng.below(100) as u64).collect();
            let plan = plan_reconfiguration(&live, &new, &bytes).unwrap();
            let size = size_of_move(&live, &new, &bytes).unwrap();
            prop_assert_eq!(&size.plan_to_node, &plan.plan_to_node);
            for l in 0..layers {
                let planned: Vec<&StateTransfer> = plan.transfers.iter().filter(|t| t.layer == l).collect();
                prop_assert_eq!(size.per_layer[l], (planned.len(), planned.iter().map(|t| t.bytes).sum::<u64>()), "layer {}", l);
            }
        }

    }
}
