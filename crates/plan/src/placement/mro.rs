//! The paper's maximum-rank-overlap plan (Theorem 1) and the round-robin / fill-in-order
//! baselines: node lists built from the ascending replica order.

use super::ascending;
use crate::nodeset::NodeSet;
use crate::ExpertId;

/// Replica k of the ascending replica list goes to node `node_of(k)`.
pub(crate) fn sequential_nodes(replicas: &[usize], n: usize, s: usize, node_of: impl Fn(usize) -> usize) -> Vec<Vec<ExpertId>> {
    let mut nodes = vec![Vec::with_capacity(s); n];
    let list = ascending(replicas).into_iter().flat_map(|e| std::iter::repeat_n(e, replicas[e]));
    for (k, e) in list.enumerate() {
        nodes[node_of(k)].push(e);
    }
    nodes
}

/// Where the group with fewer than G·c experts (if E is not a multiple of G·c) goes in the
/// ascending expert order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GroupLayout {
    /// Theorem 1: consecutive groups of G·c from the least replicated; the remainder is last.
    PartialLast,
    /// The partial group is the `i`-th group.
    PartialAt(usize),
}

pub(crate) fn groups(order: &[ExpertId], s: usize, layout: GroupLayout) -> Vec<&[ExpertId]> {
    let partial = order.len() % s;
    let count = order.len().div_ceil(s);
    let at = match layout {
        GroupLayout::PartialLast => count - 1,
        GroupLayout::PartialAt(i) => i.min(count - 1),
    };
    let mut out = Vec::with_capacity(count);
    let mut start = 0;
    for g in 0..count {
        let len = if partial != 0 && g == at { partial } else { s };
        out.push(&order[start..start + len]);
        start += len;
    }
    out
}

/// Σ_i r_rep_i > N: the node groups of MRO do not fit and the last one is cut short.
pub(crate) fn mro_truncates(replicas: &[usize], n: usize, s: usize) -> bool {
    let order = ascending(replicas);
    let need: usize = groups(&order, s, GroupLayout::PartialLast).iter().map(|g| replicas[g[0]]).sum();
    need > n
}

/// The MRO plan (Theorem 1): group i occupies r_{rep_i} consecutive nodes (the last group only
/// what is left), each holding one replica of every expert of the group; the replicas left over
/// are spread over the vacant slots.
///
/// `group` ≤ s is the group size: Theorem 1 uses s; smaller groups leave s − group slots of
/// every grouped node to the leftover replicas ([`place_balanced`]).
pub(crate) fn mro_nodes(replicas: &[usize], n: usize, s: usize, group: usize, layout: GroupLayout) -> Vec<Vec<ExpertId>> {
    let order = ascending(replicas);
    let mut nodes: Vec<Vec<ExpertId>> = vec![Vec::with_capacity(s); n];
    let mut left = replicas.to_vec();
    let mut holds = vec![NodeSet::empty(n); replicas.len()];
    let mut next = 0;
    for group in groups(&order, group, layout) {
        let span = replicas[group[0]].min(n - next);
        for (i, node) in nodes.iter_mut().enumerate().skip(next).take(span) {
            for &e in group {
                node.push(e);
                holds[e].insert(i);
                left[e] -= 1;
            }
        }
        next += span;
    }
    fill_vacancies(&mut nodes, s, &order, &mut left, &mut holds);
    nodes
}

/// "For the vacant slots, we uniformly place the experts that still have replicas left": walk
/// the nodes round-robin, first over nodes that do not hold the expert yet, then over any node
/// with a free slot. `holds[e]` is kept up to date.
pub(crate) fn fill_vacancies(nodes: &mut [Vec<ExpertId>], s: usize, order: &[ExpertId], left: &mut [usize], holds: &mut [NodeSet]) {
    let n = nodes.len();
    let mut cursor = 0;
    for &e in order {
        for prefer_new in [true, false] {
            loop {
                let mut placed = false;
                let start = cursor;
                for k in 0..n {
                    if left[e] == 0 {
                        break;
                    }
                    let i = (start + k) % n;
                    if nodes[i].len() < s && !(prefer_new && holds[e].contains(i)) {
                        nodes[i].push(e);
                        holds[e].insert(i);
                        left[e] -= 1;
                        placed = true;
                        cursor = (i + 1) % n;
                    }
                }
                // One sweep covers every node that lacks the expert; duplicates may need more.
                if prefer_new || left[e] == 0 || !placed {
                    break;
                }
            }
        }
    }
}
