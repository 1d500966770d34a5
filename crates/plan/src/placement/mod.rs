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
//!
//! Files: this one holds the types ([`ClusterShape`], [`Strategy`], [`Placement`]) and [`place`];
//! `mro` the paper's groups and the round-robin baselines, `search` the `lazarus` strategy's
//! exact local search, `guard` the throughput guard ([`place_balanced`]), `gpus` the spread of a
//! node's replicas over its GPUs, `repair` a running placement changed only where nodes were
//! lost or added. Recovery is computed by [`crate::recovery`] from holder sets;
//! the arrow runs one way, placement → recovery.

mod gpus;
mod guard;
mod mro;
mod repair;
mod search;
#[cfg(test)]
mod tests;

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Serialize};

use crate::error::PlanError;
use crate::nodeset::NodeSet;
use crate::recovery::{self, RecoveryEstimate};
use crate::ExpertId;

pub(crate) use gpus::balance_gpus;
pub use guard::{place_balanced, DEFAULT_MAX_IMBALANCE};
#[cfg(test)]
pub(crate) use mro::mro_truncates;
use mro::sequential_nodes;
use mro::{mro_nodes, GroupLayout};
pub(crate) use repair::repair_nodes;
use search::lazarus_nodes;
pub(crate) use search::SEARCH_MAX_NODES;

/// Largest cluster the planning core takes: every plan, recovery curve and reconfiguration is
/// then computed in bounded time and memory (N up to 10^4 nodes).
pub const MAX_NODES: usize = 10_000;
/// Largest number of replica slots N·G·c (4 Mi: 10^4 nodes of 8 GPUs with 52 slots each).
pub const MAX_SLOTS: usize = 1 << 22;

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
        if nodes > MAX_NODES {
            return Err(PlanError::invalid("nodes", nodes, format!("at most {MAX_NODES} nodes are supported")));
        }
        if nodes.checked_mul(gpus_per_node).and_then(|x| x.checked_mul(slots_per_gpu)).is_none_or(|x| x > MAX_SLOTS) {
            return Err(PlanError::invalid(
                "slots",
                format!("{nodes} nodes x {gpus_per_node} GPUs x {slots_per_gpu} slots"),
                format!("at most {MAX_SLOTS} replica slots in all are supported"),
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
    /// Shared by the placement's clones: a placement never changes once made, and at a thousand
    /// nodes a model's plan is a quarter of a million slots in seven thousand lists, copied by
    /// every weighing and move that keeps a layer as it is.
    nodes: Arc<Vec<Vec<ExpertId>>>,
    /// The experts–GPUs graph of λ* ([`Placement::load_balance`]) and the replica counts, made
    /// on first use.
    #[serde(skip)]
    derived: Derived,
}

/// What a placement's slots give, made on first use and shared by the placement's clones: a
/// placement's slots never change once made. Its experts–GPUs graph
/// ([`crate::balance::Bipartite`]): its λ* is asked under every load epoch it runs through (in
/// a simulated day at a thousand GPUs, making the graph each time was as much work as the
/// flow); its replica counts, asked by every re-plan of every layer (a pass over every slot
/// each time was 3% of that day). Not part of what a placement is: any two are equal here, and
/// it is not written.
#[derive(Clone, Default)]
struct Derived(Arc<DerivedCells>);

#[derive(Default)]
struct DerivedCells {
    graph: OnceLock<crate::balance::Bipartite>,
    counts: OnceLock<Vec<usize>>,
}

impl PartialEq for Derived {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Derived {}

impl fmt::Debug for Derived {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.graph.get().is_some() { "made" } else { "not made" })
    }
}

impl Placement {
    /// Validate a plan given as per-node expert lists (e.g. read from a file).
    pub fn from_nodes(shape: ClusterShape, experts: usize, nodes: Vec<Vec<ExpertId>>) -> Result<Self, PlanError> {
        if nodes.len() != shape.nodes {
            return Err(PlanError::Length { field: "placement", got: nodes.len(), expected: shape.nodes });
        }
        // Sizes first: `experts` comes from the caller (or a file), the entries are what is there.
        if let Some((n, node)) = nodes.iter().enumerate().find(|(_, node)| node.len() != shape.slots_per_node()) {
            return Err(PlanError::invalid(
                "placement",
                format!("node {n} with {} entries", node.len()),
                format!("every node must list exactly gpus-per-node x slots = {} entries", shape.slots_per_node()),
            ));
        }
        if experts > shape.total_slots() {
            return Err(PlanError::CannotHost { experts, slots: shape.total_slots() });
        }
        let mut seen = vec![false; experts];
        for (n, node) in nodes.iter().enumerate() {
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
        Ok(Placement::made(shape, experts, nodes))
    }

    /// A placement of slots already checked (by [`Placement::from_nodes`] or made by a planner).
    pub(crate) fn made(shape: ClusterShape, experts: usize, nodes: Vec<Vec<ExpertId>>) -> Self {
        Placement { shape, experts, nodes: Arc::new(nodes), derived: Derived::default() }
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
        validate_loads(loads, self.experts)?;
        let graph = self.derived.0.graph.get_or_init(|| {
            crate::balance::Bipartite::of_pairs(&gpus::gpu_pairs(&self.nodes, self.shape), self.experts, self.shape.ranks())
        });
        crate::balance::min_max_load_on(graph, loads)
    }

    /// The GPUs' tokens when each expert's tokens are split evenly over its replicas: one
    /// dispatch among those the balanced dispatcher chooses from, so its busiest GPU is an
    /// upper bound on λ* ([`Placement::load_balance`]), found without a max-flow.
    pub fn even_split_balance(&self, loads: &[f64]) -> Result<crate::balance::LoadBalance, PlanError> {
        validate_loads(loads, self.experts)?;
        let counts = self.replica_counts();
        let c = self.shape.slots_per_gpu;
        let mut gpu = vec![0.0f64; self.shape.ranks()];
        for (n, node) in self.nodes.iter().enumerate() {
            for (k, &e) in node.iter().enumerate() {
                gpu[n * self.shape.gpus_per_node + k / c] += loads[e] / counts[e] as f64;
            }
        }
        let bottleneck = gpu.iter().copied().fold(0.0, f64::max);
        Ok(crate::balance::LoadBalance { bottleneck, mean: loads.iter().sum::<f64>() / gpu.len() as f64 })
    }

    /// r_e: replicas of each expert.
    pub fn replica_counts(&self) -> Vec<usize> {
        let counts = self.derived.0.counts.get_or_init(|| {
            let mut r = vec![0; self.experts];
            self.nodes.iter().flatten().for_each(|&e| r[e] += 1);
            r
        });
        counts.clone()
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

    /// Recovery probability for every number of failed nodes k = 0..N−1.
    pub fn recovery_curve(&self) -> Vec<RecoveryEstimate> {
        recovery::curve_of_sets(self.shape.nodes, &self.holders())
    }

    /// S_e: the set of nodes holding at least one replica of each expert.
    pub fn holders(&self) -> Vec<NodeSet> {
        holder_sets(&self.nodes, self.experts)
    }
}

/// Recovery probability of `placement` for every number of failed nodes k = 0..N−1.
pub fn recovery_curve(placement: &Placement) -> Vec<RecoveryEstimate> {
    placement.recovery_curve()
}

/// Recovery probability of `placement` with `failed` nodes down (0 ≤ failed ≤ N).
pub fn recovery_probability(placement: &Placement, failed: usize) -> Result<RecoveryEstimate, PlanError> {
    recovery::probability_of_sets(placement.shape().nodes, &placement.holders(), failed)
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
    Ok(Placement::made(shape, replicas.len(), nodes))
}

pub(crate) fn validate_loads(loads: &[f64], experts: usize) -> Result<(), PlanError> {
    if loads.len() != experts {
        return Err(PlanError::Length { field: "loads", got: loads.len(), expected: experts });
    }
    if let Some((e, x)) = loads.iter().enumerate().find(|(_, x)| !x.is_finite() || **x < 0.0) {
        return Err(PlanError::invalid("loads", format!("{x} (expert {e})"), "loads must be finite and ≥ 0"));
    }
    Ok(())
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
pub(crate) fn ascending(replicas: &[usize]) -> Vec<ExpertId> {
    let mut order: Vec<ExpertId> = (0..replicas.len()).collect();
    order.sort_by_key(|&e| (replicas[e], e));
    order
}
