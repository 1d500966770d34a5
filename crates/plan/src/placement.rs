//! Fault-tolerant replica placement (paper §4.1, Theorem 1) and the baselines.
//!
//! Failures are at node level, so a plan is computed for N nodes of G·c slots each and then each
//! node's replicas are spread over its GPUs ([`Placement::gpu`]). A node may hold several replicas
//! of one expert: that GPU then processes that many shares of the expert's tokens.
//!
//! Strategies:
//! * `mro` — the paper's maximum-rank-overlap plan, exactly as Theorem 1 describes it.
//! * `spread` — round-robin: replica k of the ascending replica list goes to node k mod N.
//! * `compact` — fill node after node: every expert on as few nodes as possible.
//! * `lazarus` — ours. MRO is optimal whenever its node groups fit (Σ_i r_rep_i ≤ N), and there
//!   it is returned unchanged. When the last group must be truncated MRO can lose (e.g. replicas
//!   [2,3,3,4], N=4, c=3: 2/3 vs an optimum of 5/6 with two nodes alive), so we evaluate every
//!   MRO-style grouping exactly and, on clusters small enough for exact evaluation to be cheap,
//!   improve the best one by local search over replica swaps. The result never does worse than
//!   MRO for any number of failures.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::PlanError;
use crate::nodeset::NodeSet;
use crate::recovery::{self, SurvivalCurve};
use crate::rng::SplitMix64;
use crate::ExpertId;

/// N nodes × G GPUs per node × c replica slots per GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterShape {
    pub nodes: usize,
    pub gpus_per_node: usize,
    pub slots_per_gpu: usize,
}

impl ClusterShape {
    pub fn new(nodes: usize, gpus_per_node: usize, slots_per_gpu: usize) -> Result<Self, PlanError> {
        if nodes == 0 {
            return Err(PlanError::invalid("nodes", nodes, "at least one node is needed"));
        }
        if gpus_per_node == 0 {
            return Err(PlanError::invalid("gpus-per-node", gpus_per_node, "at least one GPU per node is needed"));
        }
        if slots_per_gpu == 0 {
            return Err(PlanError::invalid("slots", slots_per_gpu, "each GPU needs at least one replica slot"));
        }
        if nodes.checked_mul(gpus_per_node).and_then(|x| x.checked_mul(slots_per_gpu)).is_none_or(|x| x > 1 << 32) {
            return Err(PlanError::invalid(
                "nodes",
                nodes,
                format!("nodes x gpus-per-node ({gpus_per_node}) x slots ({slots_per_gpu}) is too large"),
            ));
        }
        Ok(ClusterShape { nodes, gpus_per_node, slots_per_gpu })
    }

    /// G·c: replicas one node holds.
    pub fn slots_per_node(&self) -> usize {
        self.gpus_per_node * self.slots_per_gpu
    }

    /// N·G·c: replicas the whole cluster holds.
    pub fn total_slots(&self) -> usize {
        self.nodes * self.slots_per_node()
    }

    /// N·G: worker ranks, rank = node·G + gpu.
    pub fn ranks(&self) -> usize {
        self.nodes * self.gpus_per_node
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    #[default]
    Lazarus,
    Mro,
    Spread,
    Compact,
}

impl Strategy {
    pub const ALL: [Strategy; 4] = [Strategy::Lazarus, Strategy::Mro, Strategy::Spread, Strategy::Compact];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Lazarus => "lazarus",
            Strategy::Mro => "mro",
            Strategy::Spread => "spread",
            Strategy::Compact => "compact",
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Strategy {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Strategy::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| PlanError::invalid("strategy", s, "expected one of lazarus, mro, spread, compact"))
    }
}

/// Where every replica of one layer lives. `nodes[n]` lists the G·c expert ids on node n, GPU
/// by GPU: entries `[g·c, (g+1)·c)` are GPU g's slots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    shape: ClusterShape,
    experts: usize,
    nodes: Vec<Vec<ExpertId>>,
}

impl Placement {
    /// Validate a plan given as per-node expert lists (e.g. read from a file).
    pub fn from_nodes(shape: ClusterShape, experts: usize, nodes: Vec<Vec<ExpertId>>) -> Result<Self, PlanError> {
        if nodes.len() != shape.nodes {
            return Err(PlanError::Length { field: "placement", got: nodes.len(), expected: shape.nodes });
        }
        let mut seen = vec![false; experts];
        for (n, node) in nodes.iter().enumerate() {
            if node.len() != shape.slots_per_node() {
                return Err(PlanError::invalid(
                    "placement",
                    format!("node {n} with {} entries", node.len()),
                    format!("every node must list exactly gpus-per-node x slots = {} entries", shape.slots_per_node()),
                ));
            }
            for &e in node {
                if e >= experts {
                    return Err(PlanError::invalid(
                        "placement",
                        format!("expert {e} on node {n}"),
                        format!("expert ids must be below {experts}"),
                    ));
                }
                seen[e] = true;
            }
        }
        if let Some(e) = seen.iter().position(|&s| !s) {
            return Err(PlanError::invalid("placement", format!("expert {e}"), "has no replica on any node"));
        }
        Ok(Placement { shape, experts, nodes })
    }

    pub fn shape(&self) -> ClusterShape {
        self.shape
    }

    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Per-node expert lists, GPU-major within a node.
    pub fn nodes(&self) -> &[Vec<ExpertId>] {
        &self.nodes
    }

    /// The c expert ids in GPU `gpu` of node `node`.
    pub fn gpu(&self, node: usize, gpu: usize) -> &[ExpertId] {
        let c = self.shape.slots_per_gpu;
        &self.nodes[node][gpu * c..(gpu + 1) * c]
    }

    /// λ* per GPU under the balanced dispatcher for these loads ([`crate::balance`]): how much
    /// longer than perfectly balanced the experts' step takes on this plan.
    pub fn load_balance(&self, loads: &[f64]) -> Result<crate::balance::LoadBalance, PlanError> {
        crate::balance::min_max_load(&gpu_holders(&self.nodes, self.shape, self.experts), loads, self.shape.ranks())
    }

    /// r_e: replicas of each expert.
    pub fn replica_counts(&self) -> Vec<usize> {
        let mut r = vec![0; self.experts];
        self.nodes.iter().flatten().for_each(|&e| r[e] += 1);
        r
    }

    /// R[e][rank]: replicas of expert e on worker rank (node·G + gpu) — Algorithm 1's input.
    pub fn rank_replicas(&self) -> Vec<Vec<u32>> {
        let g = self.shape.gpus_per_node;
        let mut r = vec![vec![0u32; self.shape.ranks()]; self.experts];
        for n in 0..self.shape.nodes {
            for gpu in 0..g {
                for &e in self.gpu(n, gpu) {
                    r[e][n * g + gpu] += 1;
                }
            }
        }
        r
    }

    /// S_e: the set of nodes holding at least one replica of each expert.
    pub fn holders(&self) -> Vec<NodeSet> {
        holder_sets(&self.nodes, self.experts)
    }
}

pub(crate) fn holder_sets(nodes: &[Vec<ExpertId>], experts: usize) -> Vec<NodeSet> {
    let mut sets = vec![NodeSet::empty(nodes.len()); experts];
    for (n, node) in nodes.iter().enumerate() {
        for &e in node {
            sets[e].insert(n);
        }
    }
    sets
}

/// Place `replicas[e]` replicas of each expert on the cluster with the given strategy.
///
/// `loads` (tokens per expert, optional) only steers how a node's replicas are spread over its
/// GPUs: each replica is expected to receive `t_e / r_e` tokens and GPUs are balanced on that.
pub fn place(replicas: &[usize], shape: ClusterShape, strategy: Strategy, loads: Option<&[f64]>) -> Result<Placement, PlanError> {
    validate_replicas(replicas, shape)?;
    if let Some(l) = loads {
        validate_loads(l, replicas.len())?;
    }
    let s = shape.slots_per_node();
    let n = shape.nodes;
    let nodes = match strategy {
        Strategy::Mro => mro_nodes(replicas, n, s, s, GroupLayout::PartialLast),
        Strategy::Spread => sequential_nodes(replicas, n, s, |k| k % n),
        Strategy::Compact => sequential_nodes(replicas, n, s, |k| k / s),
        Strategy::Lazarus => lazarus_nodes(replicas, n, s),
    };
    let nodes = balance_gpus(nodes, replicas, shape, loads);
    Ok(Placement { shape, experts: replicas.len(), nodes })
}

fn validate_loads(loads: &[f64], experts: usize) -> Result<(), PlanError> {
    if loads.len() != experts {
        return Err(PlanError::Length { field: "loads", got: loads.len(), expected: experts });
    }
    if let Some((e, x)) = loads.iter().enumerate().find(|(_, x)| !x.is_finite() || **x < 0.0) {
        return Err(PlanError::invalid("loads", format!("{x} (expert {e})"), "loads must be finite and ≥ 0"));
    }
    Ok(())
}

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
    Ok(Placement { shape, experts: replicas.len(), nodes })
}

/// λ* / mean over nodes for node lists (see [`crate::balance`]).
fn node_imbalance(nodes: &[Vec<ExpertId>], loads: &[f64]) -> f64 {
    let mut holders = vec![Vec::new(); loads.len()];
    for (i, node) in nodes.iter().enumerate() {
        for &e in node {
            holders[e].push(i);
        }
    }
    // Inputs are validated and every expert is placed, so this cannot fail.
    crate::balance::min_max_load(&holders, loads, nodes.len()).map_or(f64::INFINITY, |b| b.imbalance())
}

/// Candidates within the guard whose recovery is compared on large clusters ([`guarded_nodes`]).
const GUARD_FINALISTS: usize = 4;

fn guarded_nodes(replicas: &[usize], n: usize, s: usize, loads: &[f64], max_imbalance: f64) -> Vec<Vec<ExpertId>> {
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
fn guarded_local_search(nodes: Vec<Vec<ExpertId>>, n: usize, s: usize, eval: &SmallEval, loads: &[f64], limit: f64) -> Vec<Vec<ExpertId>> {
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

pub(crate) fn validate_replicas(replicas: &[usize], shape: ClusterShape) -> Result<(), PlanError> {
    if replicas.is_empty() {
        return Err(PlanError::invalid("replicas", "[]", "at least one expert is needed"));
    }
    if let Some(e) = replicas.iter().position(|&r| r == 0) {
        return Err(PlanError::invalid("replicas", format!("0 (expert {e})"), "every expert needs at least one replica"));
    }
    let sum: usize = replicas.iter().sum();
    if sum != shape.total_slots() {
        return Err(PlanError::SlotMismatch { sum, slots: shape.total_slots() });
    }
    Ok(())
}

/// Experts in ascending replica order, ties by id (the order Theorem 1 assumes).
fn ascending(replicas: &[usize]) -> Vec<ExpertId> {
    let mut order: Vec<ExpertId> = (0..replicas.len()).collect();
    order.sort_by_key(|&e| (replicas[e], e));
    order
}

/// Replica k of the ascending replica list goes to node `node_of(k)`.
fn sequential_nodes(replicas: &[usize], n: usize, s: usize, node_of: impl Fn(usize) -> usize) -> Vec<Vec<ExpertId>> {
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
enum GroupLayout {
    /// Theorem 1: consecutive groups of G·c from the least replicated; the remainder is last.
    PartialLast,
    /// The partial group is the `i`-th group.
    PartialAt(usize),
}

fn groups(order: &[ExpertId], s: usize, layout: GroupLayout) -> Vec<&[ExpertId]> {
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
fn mro_nodes(replicas: &[usize], n: usize, s: usize, group: usize, layout: GroupLayout) -> Vec<Vec<ExpertId>> {
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
fn fill_vacancies(nodes: &mut [Vec<ExpertId>], s: usize, order: &[ExpertId], left: &mut [usize], holds: &mut [NodeSet]) {
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

/// Lexicographic comparison of survival curves: fewer failures first (they are the likely
/// ones), i.e. compare P(recover | N−1 alive), then N−2, …
fn better(a: &[f64], b: &[f64]) -> bool {
    for r in (0..a.len()).rev() {
        if a[r] > b[r] + 1e-12 {
            return true;
        }
        if a[r] < b[r] - 1e-12 {
            return false;
        }
    }
    false
}

fn dominates(a: &[f64], b: &[f64]) -> bool {
    a.iter().zip(b).all(|(x, y)| *x >= *y - 1e-12)
}

/// Clusters up to this many nodes (and node-slots) get the local-search improvement: exact
/// evaluation enumerates all 2^N alive sets, which is cheap up to here.
const SEARCH_MAX_NODES: usize = 12;
const SEARCH_MAX_SLOTS: usize = 128;

fn lazarus_nodes(replicas: &[usize], n: usize, s: usize) -> Vec<Vec<ExpertId>> {
    let mro = mro_nodes(replicas, n, s, s, GroupLayout::PartialLast);
    if !mro_truncates(replicas, n, s) {
        return mro;
    }
    let experts = replicas.len();
    let curve = |nodes: &Vec<Vec<ExpertId>>| -> SurvivalCurve { recovery::survival_curve(n, &holder_sets(nodes, experts)) };
    let mro_curve = curve(&mro);
    let mut best = (mro.clone(), mro_curve.clone());
    // Every placement of the partial group is an MRO-style candidate with a closed form.
    let count = experts.div_ceil(s);
    for at in 0..count {
        let cand = mro_nodes(replicas, n, s, s, GroupLayout::PartialAt(at));
        let c = curve(&cand);
        if c.exact && dominates(&c.alive, &mro_curve.alive) && better(&c.alive, &best.1.alive) {
            best = (cand, c);
        }
    }
    if n <= SEARCH_MAX_NODES && n * s <= SEARCH_MAX_SLOTS {
        let mut starts = vec![best.0.clone(), mro.clone()];
        starts.push(sequential_nodes(replicas, n, s, |k| k % n));
        let mut rng = SplitMix64::new(0x1a2a_7a05 ^ (n as u64) << 32 ^ s as u64);
        // Random restarts are what makes tiny instances reliably optimal; on larger ones each
        // costs more and helps less.
        let restarts = if n * s <= 24 { 4 } else { 2 };
        for _ in 0..restarts {
            starts.push(random_nodes(replicas, s, &mut rng));
        }
        let eval = SmallEval::new(n, experts);
        let mro_counts = eval.counts(&mro);
        let mut best_counts = eval.counts(&best.0);
        for start in starts {
            let (cand, counts) = local_search(start, n, s, &eval);
            if counts_dominate(&counts, &mro_counts) && counts_better(&counts, &best_counts) {
                best_counts = counts;
                best.0 = cand;
            }
        }
    }
    best.0
}

fn random_nodes(replicas: &[usize], s: usize, rng: &mut SplitMix64) -> Vec<Vec<ExpertId>> {
    let mut list: Vec<ExpertId> = (0..replicas.len()).flat_map(|e| std::iter::repeat_n(e, replicas[e])).collect();
    for i in (1..list.len()).rev() {
        list.swap(i, rng.below(i + 1));
    }
    list.chunks(s).map(|c| c.to_vec()).collect()
}

/// Exact hit counts for small clusters: for every alive count R, how many R-subsets of nodes
/// hold a replica of every expert. Enumerates the 2^N alive sets level by level, most alive
/// first, so a candidate that loses at a high level (few failures) is rejected after looking at
/// a handful of sets.
struct SmallEval {
    n: usize,
    experts: usize,
    /// Alive sets grouped by size.
    levels: Vec<Vec<u32>>,
}

impl SmallEval {
    fn new(n: usize, experts: usize) -> Self {
        debug_assert!(n <= 20);
        let mut levels = vec![Vec::new(); n + 1];
        for alive in 0u32..(1u32 << n) {
            levels[alive.count_ones() as usize].push(alive);
        }
        SmallEval { n, experts, levels }
    }

    fn minimal(&self, nodes: &[Vec<ExpertId>]) -> Vec<u32> {
        let mut masks = vec![0u32; self.experts];
        for (i, node) in nodes.iter().enumerate() {
            for &e in node {
                masks[e] |= 1 << i;
            }
        }
        minimal_masks(masks)
    }

    fn level(&self, minimal: &[u32], r: usize) -> u64 {
        self.levels[r].iter().filter(|&&alive| minimal.iter().all(|&m| m & alive != 0)).count() as u64
    }

    fn counts(&self, nodes: &[Vec<ExpertId>]) -> Vec<u64> {
        let minimal = self.minimal(nodes);
        (0..=self.n).map(|r| self.level(&minimal, r)).collect()
    }

    /// The counts of `nodes` if they beat `current` lexicographically (fewest failures first).
    fn improves(&self, nodes: &[Vec<ExpertId>], current: &[u64]) -> Option<Vec<u64>> {
        let minimal = self.minimal(nodes);
        let mut counts = vec![0u64; self.n + 1];
        let mut better = false;
        for r in (0..=self.n).rev() {
            counts[r] = self.level(&minimal, r);
            if !better {
                if counts[r] < current[r] {
                    return None;
                }
                better = counts[r] > current[r];
            }
        }
        better.then_some(counts)
    }
}

/// Drop duplicate holder sets and supersets: only the minimal sets decide recovery.
fn minimal_masks(mut masks: Vec<u32>) -> Vec<u32> {
    masks.sort_by_key(|m| (m.count_ones(), *m));
    masks.dedup();
    let mut out: Vec<u32> = Vec::with_capacity(masks.len());
    for m in masks {
        if !out.iter().any(|&k| k & !m == 0) {
            out.push(m);
        }
    }
    out
}

fn counts_better(a: &[u64], b: &[u64]) -> bool {
    for r in (0..a.len()).rev() {
        if a[r] != b[r] {
            return a[r] > b[r];
        }
    }
    false
}

fn counts_dominate(a: &[u64], b: &[u64]) -> bool {
    a.iter().zip(b).all(|(x, y)| x >= y)
}

/// Hill climbing with exact evaluation (see [`hill_climb`]); returns the plan and its counts.
fn local_search(nodes: Vec<Vec<ExpertId>>, n: usize, s: usize, eval: &SmallEval) -> (Vec<Vec<ExpertId>>, Vec<u64>) {
    let mut counts = eval.counts(&nodes);
    let nodes = hill_climb(nodes, n, s, |cand| match eval.improves(cand, &counts) {
        Some(c) => {
            counts = c;
            true
        }
        None => false,
    });
    (nodes, counts)
}

/// First-improvement hill climbing over swaps of two replicas of different experts on different
/// nodes: `improves` is asked about each swapped plan (and keeps its own notion of the current
/// best); the first swap it accepts is kept and the scan restarts. Deterministic.
fn hill_climb(mut nodes: Vec<Vec<ExpertId>>, n: usize, s: usize, mut improves: impl FnMut(&[Vec<ExpertId>]) -> bool) -> Vec<Vec<ExpertId>> {
    let mut improved = true;
    while improved {
        improved = false;
        'scan: for a in 0..n {
            for b in (a + 1)..n {
                for i in 0..s {
                    for j in 0..s {
                        let (x, y) = (nodes[a][i], nodes[b][j]);
                        if x == y || nodes[a][..i].contains(&x) || nodes[b][..j].contains(&y) {
                            continue;
                        }
                        nodes[a][i] = y;
                        nodes[b][j] = x;
                        if improves(&nodes) {
                            improved = true;
                            break 'scan;
                        }
                        nodes[a][i] = x;
                        nodes[b][j] = y;
                    }
                }
            }
        }
    }
    nodes
}

/// One replica of an expert moves from GPU `from` to GPU `to` in its holder list.
fn move_replica(holders: &mut [usize], from: usize, to: usize) {
    if let Some(i) = holders.iter().position(|&h| h == from) {
        holders[i] = to;
    }
}

/// GPU index of every replica, per expert.
fn gpu_holders(nodes: &[Vec<ExpertId>], shape: ClusterShape, experts: usize) -> Vec<Vec<usize>> {
    let c = shape.slots_per_gpu;
    let mut holders = vec![Vec::new(); experts];
    for (n, node) in nodes.iter().enumerate() {
        for (k, &e) in node.iter().enumerate() {
            holders[e].push(n * shape.gpus_per_node + k / c);
        }
    }
    holders
}

/// λ* over GPUs ([`crate::balance`]); inputs already validated.
fn gpu_lambda(nodes: &[Vec<ExpertId>], shape: ClusterShape, loads: &[f64]) -> f64 {
    crate::balance::min_max_load(&gpu_holders(nodes, shape, loads.len()), loads, shape.ranks()).map_or(f64::INFINITY, |b| b.bottleneck)
}

/// Most candidate swaps evaluated (one max-flow each) per accepted swap and in all: the
/// refinement is a bounded improvement on [`balance_gpus`], never a search without end.
const REFINE_TRIES_PER_MOVE: usize = 64;
const REFINE_TRIES_PER_GPU: usize = 16;

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
fn refine_gpus(nodes: Vec<Vec<ExpertId>>, shape: ClusterShape, loads: &[f64]) -> Vec<Vec<ExpertId>> {
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
fn refine_gpu_swaps(mut nodes: Vec<Vec<ExpertId>>, shape: ClusterShape, loads: &[f64]) -> Vec<Vec<ExpertId>> {
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
        let cut = crate::balance::overflow(&gpu_holders(&nodes, shape, experts), loads, bins, target);
        if cut.tokens <= tol {
            let next = lambda_of(&nodes);
            if next >= lambda * (1.0 - 1e-9) {
                break;
            }
            lambda = next;
            continue;
        }
        let holders = gpu_holders(&nodes, shape, experts);
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
fn balance_gpus(nodes: Vec<Vec<ExpertId>>, replicas: &[usize], shape: ClusterShape, loads: Option<&[f64]>) -> Vec<Vec<ExpertId>> {
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

#[cfg(test)]
mod tests {
    use super::Strategy;
    use super::*;
    use crate::recovery::recovery_curve;
    use proptest::prelude::{any, prop_assert, prop_assert_eq, proptest, ProptestConfig};

    fn random_replicas(rng: &mut SplitMix64, experts: usize, total: usize) -> Vec<usize> {
        let mut r = vec![1usize; experts];
        for _ in experts..total {
            // Skewed: later experts are more likely to get extra replicas.
            let e = rng.below(experts).max(rng.below(experts));
            r[e] += 1;
        }
        r
    }

    #[test]
    fn mro_builds_the_theorem_1_groups() {
        // Figure 4: 4 experts, 5 nodes x 4 slots, replicas [2,5,6,7]; E ≤ c so one group on the
        // first 2 nodes, leftovers spread.
        let shape = ClusterShape::new(5, 1, 4).unwrap();
        let p = place(&[2, 5, 6, 7], shape, Strategy::Mro, None).unwrap();
        assert_eq!(p.nodes()[0], vec![0, 1, 2, 3]);
        assert_eq!(p.nodes()[1], vec![0, 1, 2, 3]);
        assert!(p.nodes()[2..].iter().all(|n| !n.contains(&0)));
    }

    #[test]
    fn non_finite_or_negative_loads_are_an_error() {
        let shape = ClusterShape::new(1, 2, 2).unwrap();
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            let e = place(&[2, 2], shape, Strategy::Compact, Some(&[1.0, bad])).unwrap_err().to_string();
            assert!(e.contains("expert 1"), "{e}");
        }
    }

    #[test]
    fn strategy_names_round_trip_and_unknown_is_an_error() {
        for s in Strategy::ALL {
            assert_eq!(s.name().parse::<Strategy>().unwrap(), s);
        }
        let err = "best".parse::<Strategy>().unwrap_err().to_string();
        assert!(err.contains("strategy") && err.contains("best"), "{err}");
    }

    #[test]
    fn bad_shapes_and_replicas_are_rejected() {
        assert!(ClusterShape::new(0, 1, 1).unwrap_err().to_string().contains("nodes"));
        assert!(ClusterShape::new(1, 1, 0).unwrap_err().to_string().contains("slots"));
        let shape = ClusterShape::new(2, 1, 2).unwrap();
        assert_eq!(place(&[1, 2], shape, Strategy::Lazarus, None).unwrap_err(), PlanError::SlotMismatch { sum: 3, slots: 4 });
        assert!(place(&[0, 4], shape, Strategy::Mro, None).unwrap_err().to_string().contains("expert 0"));
        assert!(Placement::from_nodes(shape, 2, vec![vec![0, 0], vec![0, 0]]).unwrap_err().to_string().contains("expert 1"));
        assert!(Placement::from_nodes(shape, 2, vec![vec![0, 1], vec![0]]).is_err());
        assert!(Placement::from_nodes(shape, 2, vec![vec![0, 1], vec![0, 7]]).is_err());
    }

    #[test]
    fn gpus_are_balanced_on_expected_tokens() {
        // One node, 2 GPUs x 2 slots; expert 0 is hot.
        let shape = ClusterShape::new(1, 2, 2).unwrap();
        let loads = [100.0, 10.0, 10.0, 10.0];
        let p = place(&[1, 1, 1, 1], shape, Strategy::Compact, Some(&loads)).unwrap();
        let gpu_load = |g: usize| p.gpu(0, g).iter().map(|&e| loads[e]).sum::<f64>();
        // Two slots per GPU: the best split is {hot, cold} vs {cold, cold}.
        assert_eq!((gpu_load(0) - gpu_load(1)).abs(), 90.0);
        assert!(p.gpu(0, 0).contains(&0) != p.gpu(0, 1).contains(&0));
        let r = p.rank_replicas();
        assert_eq!(r.len(), 4);
        assert_eq!(r.iter().map(|v| v.iter().sum::<u32>()).sum::<u32>(), 4);
    }

    /// Each node's experts, sorted: what failures see of a placement.
    fn node_multisets(nodes: &[Vec<ExpertId>]) -> Vec<Vec<ExpertId>> {
        nodes
            .iter()
            .map(|n| {
                let mut n = n.clone();
                n.sort_unstable();
                n
            })
            .collect()
    }

    #[test]
    fn the_guard_gives_every_worker_a_hot_replica_at_8_to_1() {
        // The bench's shape: 4 workers x 4 slots, every token on expert 0.
        let shape = ClusterShape::new(4, 1, 4).unwrap();
        let loads = [8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        let r = [9, 1, 1, 1, 1, 1, 1, 1];
        let plain = place(&r, shape, Strategy::Lazarus, Some(&loads)).unwrap();
        assert!((plain.load_balance(&loads).unwrap().imbalance() - 4.0 / 3.0).abs() < 1e-9);
        let ours = place_balanced(&r, shape, &loads, DEFAULT_MAX_IMBALANCE).unwrap();
        assert!(ours.nodes().iter().all(|n| n.contains(&0)), "{:?}", ours.nodes());
        assert!((ours.load_balance(&loads).unwrap().imbalance() - 1.0).abs() < 1e-9);
        // The price: one survivable single failure of four instead of two.
        let p1 = |p: &Placement| recovery_curve(p)[1].probability;
        assert!((p1(&plain) - 0.5).abs() < 1e-12 && (p1(&ours) - 0.25).abs() < 1e-12);
        // A loose guard keeps the fault-tolerant optimum.
        assert_eq!(place_balanced(&r, shape, &loads, 1.5).unwrap(), plain);
        for bad in [0.99, f64::NAN, f64::INFINITY] {
            let e = place_balanced(&r, shape, &loads, bad).unwrap_err().to_string();
            assert!(e.contains("max_imbalance"), "{e}");
        }
        assert!(place_balanced(&r, shape, &loads[..3], 1.05).unwrap_err().to_string().contains("loads"));
    }

    /// Every way to split one node's slots over its GPUs (as sorted GPU lists; repeats kept).
    fn arrangements(node: &[ExpertId], g: usize, c: usize) -> Vec<Vec<ExpertId>> {
        let mut out: Vec<Vec<ExpertId>> = Vec::new();
        let mut perm: Vec<ExpertId> = node.to_vec();
        perm.sort_unstable();
        // Heap's algorithm over slot orders; canonical form: each GPU sorted, GPUs sorted.
        let k = perm.len();
        let mut stack = vec![0usize; k];
        let mut push = |p: &[ExpertId]| {
            let mut gpus: Vec<Vec<ExpertId>> = p
                .chunks(c)
                .map(|x| {
                    let mut x = x.to_vec();
                    x.sort_unstable();
                    x
                })
                .collect();
            gpus.sort();
            let flat: Vec<ExpertId> = gpus.concat();
            if !out.contains(&flat) {
                out.push(flat);
            }
        };
        push(&perm);
        let mut i = 0;
        while i < k {
            if stack[i] < i {
                if i % 2 == 0 {
                    perm.swap(0, i)
                } else {
                    perm.swap(stack[i], i)
                }
                push(&perm);
                stack[i] += 1;
                i = 0;
            } else {
                stack[i] = 0;
                i += 1;
            }
        }
        assert!(out.iter().all(|x| x.len() == g * c));
        out
    }

    #[test]
    fn refined_gpus_against_every_arrangement_of_small_nodes() {
        // Oracle: every within-node arrangement of the guarded plan's nodes, the least per-GPU λ*.
        let (mut cases, mut lpt_best, mut refined_best, mut improved) = (0, 0, 0, 0);
        let mut rng = SplitMix64::new(11);
        for (n, g, c) in [(2, 2, 2), (3, 2, 2), (2, 2, 3), (2, 3, 2), (3, 3, 2)] {
            let shape = ClusterShape::new(n, g, c).unwrap();
            for _ in 0..40 {
                let experts = 2 + rng.below(shape.total_slots() - 1);
                let loads: Vec<f64> =
                    (0..experts).map(|_| if rng.below(3) == 0 { 0.0 } else { (1 + rng.below(100) * (1 + rng.below(8))) as f64 }).collect();
                let Ok(alloc) = crate::allocate(&loads, shape.total_slots(), 1) else { continue };
                let r = alloc.replicas;
                let nodes = guarded_nodes(&r, n, shape.slots_per_node(), &loads, DEFAULT_MAX_IMBALANCE);
                let lpt = balance_gpus(nodes.clone(), &r, shape, Some(&loads));
                let refined = place_balanced(&r, shape, &loads, DEFAULT_MAX_IMBALANCE).unwrap().nodes().to_vec();
                let lambda = |nodes: &[Vec<ExpertId>]| gpu_lambda(nodes, shape, &loads);
                let per_node: Vec<Vec<Vec<ExpertId>>> = nodes.iter().map(|x| arrangements(x, g, c)).collect();
                let mut best = f64::INFINITY;
                let mut pick = vec![0usize; n];
                loop {
                    let cand: Vec<Vec<ExpertId>> = (0..n).map(|i| per_node[i][pick[i]].clone()).collect();
                    best = best.min(lambda(&cand));
                    let mut i = 0;
                    while i < n && pick[i] + 1 == per_node[i].len() {
                        pick[i] = 0;
                        i += 1;
                    }
                    if i == n {
                        break;
                    }
                    pick[i] += 1;
                }
                let (l, f) = (lambda(&lpt), lambda(&refined));
                assert!(f <= l * (1.0 + 1e-9) && f >= best * (1.0 - 1e-9), "{l} {f} {best}");
                cases += 1;
                lpt_best += (l <= best * (1.0 + 1e-9)) as usize;
                refined_best += (f <= best * (1.0 + 1e-9)) as usize;
                improved += (f < l * (1.0 - 1e-9)) as usize;
            }
        }
        // Measured: 200 instances, LPT optimal in 165, refined in 199, better than LPT in 35.
        eprintln!("{cases} instances: LPT optimal in {lpt_best}, refined optimal in {refined_best}, refined better than LPT in {improved}");
        assert!(cases >= 150, "{cases}");
        assert!(refined_best * 100 >= cases * 97, "refined optimal in only {refined_best} of {cases}");
        assert!(
            improved * 10 >= cases,
            "LPT was already optimal almost everywhere ({improved} of {cases} improved): the oracle has no teeth"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn the_guard_never_unbalances_and_keeps_what_already_meets_it(
            n in 1usize..40, g in 1usize..3, c in 1usize..6, seed in any::<u64>(),
        ) {
            let shape = ClusterShape::new(n, g, c).unwrap();
            let mut rng = SplitMix64::new(seed);
            let experts = 1 + rng.below(shape.total_slots().min(64));
            // Skewed loads with some cold experts, allocated by Eq. 1 with floor 1.
            let loads: Vec<f64> = (0..experts).map(|_| if rng.below(3) == 0 { 0.0 } else { (rng.below(1000) * rng.below(8)) as f64 }).collect();
            let r = crate::allocate(&loads, shape.total_slots(), 1).unwrap().replicas;
            let plain = place(&r, shape, Strategy::Lazarus, Some(&loads)).unwrap();
            let ours = place_balanced(&r, shape, &loads, DEFAULT_MAX_IMBALANCE).unwrap();
            prop_assert_eq!(ours.replica_counts(), r.clone());
            prop_assert!(Placement::from_nodes(shape, experts, ours.nodes().to_vec()).is_ok());
            let (a, b) = (node_imbalance(ours.nodes(), &loads), node_imbalance(plain.nodes(), &loads));
            prop_assert!(a <= b + 1e-9, "guarded {} > plain {}", a, b);
            if b <= DEFAULT_MAX_IMBALANCE {
                // The same nodes; within them the GPUs may be refined for the flow.
                prop_assert_eq!(node_multisets(ours.nodes()), node_multisets(plain.nodes()));
            }
        }

        #[test]
        fn refining_the_gpus_keeps_every_node_and_never_unbalances_a_gpu(
            n in 1usize..24, g in 2usize..5, c in 1usize..4, seed in any::<u64>(),
        ) {
            let shape = ClusterShape::new(n, g, c).unwrap();
            let mut rng = SplitMix64::new(seed);
            let experts = 1 + rng.below(shape.total_slots().min(48));
            let loads: Vec<f64> = (0..experts).map(|_| if rng.below(3) == 0 { 0.0 } else { (rng.below(1000) * (1 + rng.below(8))) as f64 }).collect();
            let r = crate::allocate(&loads, shape.total_slots(), 1).unwrap().replicas;
            let spread = balance_gpus(lazarus_nodes(&r, n, shape.slots_per_node()), &r, shape, Some(&loads));
            let refined = refine_gpus(spread.clone(), shape, &loads);
            prop_assert_eq!(node_multisets(&refined), node_multisets(&spread));
            let lambda = |nodes: &[Vec<ExpertId>]| gpu_lambda(nodes, shape, &loads);
            let (before, after) = (lambda(&spread), lambda(&refined));
            prop_assert!(after <= before * (1.0 + 1e-9), "refined {} > spread {}", after, before);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn every_strategy_fills_every_slot(
            n in 1usize..12, g in 1usize..4, c in 1usize..4, seed in any::<u64>(),
        ) {
            let shape = ClusterShape::new(n, g, c).unwrap();
            let mut rng = SplitMix64::new(seed);
            let experts = 1 + rng.below(shape.total_slots());
            let r = random_replicas(&mut rng, experts, shape.total_slots());
            let loads: Vec<f64> = (0..experts).map(|_| rng.below(1000) as f64).collect();
            for strategy in Strategy::ALL {
                let p = place(&r, shape, strategy, Some(&loads)).unwrap();
                prop_assert_eq!(p.nodes().len(), n);
                prop_assert!(p.nodes().iter().all(|node| node.len() == g * c));
                prop_assert_eq!(p.replica_counts(), r.clone());
                // Valid by the same checks a user-supplied plan goes through.
                prop_assert!(Placement::from_nodes(shape, experts, p.nodes().to_vec()).is_ok());
                // Each GPU's expected tokens within one replica's weight of every other GPU's
                // on the same node (LPT guarantee).
                let w = |e: usize| loads[e] / r[e] as f64;
                for node in 0..n {
                    let per: Vec<f64> = (0..g).map(|k| p.gpu(node, k).iter().map(|&e| w(e)).sum()).collect();
                    let maxw = p.nodes()[node].iter().map(|&e| w(e)).fold(0.0, f64::max);
                    let spread = per.iter().cloned().fold(f64::MIN, f64::max) - per.iter().cloned().fold(f64::MAX, f64::min);
                    prop_assert!(spread <= maxw + 1e-9, "node {}: {:?}", node, per);
                    // Each node's GPUs are what balancing that node alone gives (the balancer
                    // reuses the previous node's result for an equal list).
                    let mut alone = p.nodes()[node].clone();
                    alone.reverse();
                    let alone = balance_gpus(vec![alone], &r, ClusterShape::new(1, g, c).unwrap(), Some(&loads));
                    prop_assert_eq!(&alone[0], &p.nodes()[node]);
                }
            }
        }

        #[test]
        fn lazarus_never_below_mro(n in 2usize..16, s in 2usize..7, seed in any::<u64>()) {
            let shape = ClusterShape::new(n, 1, s).unwrap();
            let mut rng = SplitMix64::new(seed);
            let experts = 2 + rng.below(n * s - 1);
            let r = random_replicas(&mut rng, experts, n * s);
            let ours = recovery_curve(&place(&r, shape, Strategy::Lazarus, None).unwrap());
            let mro = recovery_curve(&place(&r, shape, Strategy::Mro, None).unwrap());
            for (a, b) in ours.iter().zip(&mro) {
                if a.method == crate::RecoveryMethod::Exact && b.method == crate::RecoveryMethod::Exact {
                    prop_assert!(a.probability >= b.probability - 1e-12, "r={:?} k={}: {} < {}", r, a.failed, a.probability, b.probability);
                }
            }
        }
    }
}
