//! The plan of a whole model at one epoch, and the runtime's view of it.

use serde::{Deserialize, Serialize};

use crate::error::PlanError;
use crate::nodeset::NodeSet;
use crate::placement::{ClusterShape, Placement};
use crate::recovery::{self, RecoveryEstimate};
use crate::ExpertId;

/// Where every replica of every MoE layer lives, at one plan epoch. All layers share the
/// cluster shape and the number of experts. Plans, messages and transports carry the epoch;
/// anything stamped with an older one is stale (docs/architecture.md).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelPlan {
    epoch: u64,
    layers: Vec<Placement>,
}

impl ModelPlan {
    /// At least one layer; every layer on the same cluster shape with the same experts.
    pub fn new(epoch: u64, layers: Vec<Placement>) -> Result<Self, PlanError> {
        let Some(first) = layers.first() else {
            return Err(PlanError::invalid("layers", "[]", "a plan needs at least one MoE layer"));
        };
        let (shape, experts) = (first.shape(), first.experts());
        for (l, p) in layers.iter().enumerate() {
            if p.shape() != shape {
                return Err(PlanError::invalid(
                    "layers",
                    format!(
                        "layer {l} on {} nodes x {} GPUs x {} slots",
                        p.shape().nodes,
                        p.shape().gpus_per_node,
                        p.shape().slots_per_gpu
                    ),
                    format!("layer 0 is on {} nodes x {} GPUs x {} slots", shape.nodes, shape.gpus_per_node, shape.slots_per_gpu),
                ));
            }
            if p.experts() != experts {
                return Err(PlanError::invalid(
                    "layers",
                    format!("layer {l} with {} experts", p.experts()),
                    format!("layer 0 has {experts}"),
                ));
            }
        }
        Ok(ModelPlan { epoch, layers })
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The same plan stamped with another epoch.
    pub fn with_epoch(mut self, epoch: u64) -> Self {
        self.epoch = epoch;
        self
    }

    pub fn shape(&self) -> ClusterShape {
        self.layers[0].shape()
    }

    /// Experts per layer.
    pub fn experts(&self) -> usize {
        self.layers[0].experts()
    }

    pub fn layers(&self) -> &[Placement] {
        &self.layers
    }

    /// Every (layer, expert)'s holder node set, layer by layer: the model recovers from a
    /// failure exactly when each of these keeps a live node.
    pub fn holder_sets(&self) -> Vec<NodeSet> {
        self.layers.iter().flat_map(Placement::holders).collect()
    }

    /// The (layer, expert) pairs that keep no replica when the plan nodes `failed` are gone.
    pub fn lost_experts(&self, failed: &[usize]) -> Vec<(usize, ExpertId)> {
        let mut lost = Vec::new();
        for (l, p) in self.layers.iter().enumerate() {
            for (e, holders) in p.holders().iter().enumerate() {
                if holders.iter().all(|n| failed.contains(&n)) {
                    lost.push((l, e));
                }
            }
        }
        lost
    }

    /// Whether every expert of every layer keeps a replica on a node outside `failed` (plan node
    /// indices): the condition for reconfiguring instead of rolling back.
    pub fn survives(&self, failed: &[usize]) -> bool {
        self.layers.iter().all(|p| p.holders().iter().all(|h| h.iter().any(|n| !failed.contains(&n))))
    }

    /// Probability that the whole model recovers (every expert of every layer keeps a replica)
    /// for every number of failed nodes k = 0..N−1, failures uniformly at random.
    pub fn recovery_curve(&self) -> Vec<RecoveryEstimate> {
        recovery::curve_of_sets(self.shape().nodes, &self.holder_sets())
    }

    /// The runtime's view: replicas of each expert on each worker rank (node·G + gpu).
    pub fn replica_map(&self) -> ReplicaMap {
        let shape = self.shape();
        let (g, c) = (shape.gpus_per_node, shape.slots_per_gpu);
        let layer = |p: &Placement| -> Result<Vec<Vec<(usize, u32)>>, std::convert::Infallible> {
            let mut held: Vec<Vec<(usize, u32)>> = p.replica_counts().into_iter().map(Vec::with_capacity).collect();
            // Slots GPU-major within a node, nodes in order: ranks come in ascending order.
            for (n, node) in p.nodes().iter().enumerate() {
                for (k, &e) in node.iter().enumerate() {
                    let rank = n * g + k / c;
                    match held[e].last_mut() {
                        Some((r, count)) if *r == rank => *count += 1,
                        _ => held[e].push((rank, 1)),
                    }
                }
            }
            Ok(held)
        };
        // Layers on every core when the map is large (at a thousand nodes, 1.9 M replicas).
        let layers = if shape.total_slots() * self.layers.len() < 1 << 16 {
            self.layers.iter().map(layer).collect::<Result<_, _>>()
        } else {
            crate::parallel::map_in_order(&self.layers, layer)
        };
        let Ok(layers) = layers;
        ReplicaMap { epoch: self.epoch, ranks: shape.ranks(), experts: self.experts(), layers }
    }
}

/// How many replicas of each expert each worker rank holds, for every MoE layer — Algorithm
/// 1's R matrix, what the runtime needs of a plan — kept sparse: for each expert of each layer,
/// the ranks holding it with their replica counts. (Dense, R is layers × experts × ranks: at
/// 8,192 ranks, 58 layers and 256 experts 486 MB for 1.9 M replicas.) Built from a
/// [`ModelPlan`] or for the static expert-parallel baseline, validated on construction and
/// when deserialized (it travels to worker processes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawReplicaMap")]
pub struct ReplicaMap {
    epoch: u64,
    ranks: usize,
    experts: usize,
    /// `layers[l][e]`: (rank, replicas) of every rank holding expert e of layer l, ranks
    /// ascending, replicas > 0.
    layers: Vec<Vec<Vec<(usize, u32)>>>,
}

#[derive(Deserialize)]
struct RawReplicaMap {
    epoch: u64,
    ranks: usize,
    layers: Vec<Vec<Vec<(usize, u32)>>>,
}

impl TryFrom<RawReplicaMap> for ReplicaMap {
    type Error = PlanError;
    fn try_from(raw: RawReplicaMap) -> Result<Self, PlanError> {
        ReplicaMap::from_holders(raw.epoch, raw.ranks, raw.layers)
    }
}

impl ReplicaMap {
    /// From the dense R: `layers[l][e][rank]`: at least one layer, one expert and one rank; the
    /// same experts and ranks in every layer; every expert held somewhere.
    pub fn new(epoch: u64, layers: Vec<Vec<Vec<u32>>>) -> Result<Self, PlanError> {
        let bad = |value: String, reason: String| PlanError::Invalid { field: "replica map", value, reason };
        let ranks = layers.first().and_then(|l| l.first()).map_or(0, Vec::len);
        for (l, layer) in layers.iter().enumerate() {
            for (e, row) in layer.iter().enumerate() {
                if row.len() != ranks {
                    return Err(bad(format!("layer {l} expert {e} over {} ranks", row.len()), format!("the plan has {ranks} ranks")));
                }
            }
        }
        let sparse = layers
            .into_iter()
            .map(|layer| layer.into_iter().map(|row| row.into_iter().enumerate().filter(|&(_, n)| n > 0).collect()).collect())
            .collect();
        Self::from_holders(epoch, ranks, sparse)
    }

    /// From the holders of each expert: `layers[l][e]` lists (rank, replicas) with ranks
    /// ascending and below `ranks`, replicas > 0; at least one layer, expert and rank; the same
    /// experts in every layer; every expert held somewhere.
    pub fn from_holders(epoch: u64, ranks: usize, layers: Vec<Vec<Vec<(usize, u32)>>>) -> Result<Self, PlanError> {
        let bad = |value: String, reason: String| PlanError::Invalid { field: "replica map", value, reason };
        let experts = layers.first().map_or(0, Vec::len);
        if experts == 0 || ranks == 0 {
            return Err(bad(
                format!("{} layers x {experts} experts x {ranks} ranks", layers.len()),
                "needs at least one layer, expert and rank".into(),
            ));
        }
        for (l, layer) in layers.iter().enumerate() {
            if layer.len() != experts {
                return Err(bad(format!("layer {l} with {} experts", layer.len()), format!("layer 0 has {experts}")));
            }
            for (e, held) in layer.iter().enumerate() {
                if held.is_empty() {
                    return Err(bad(format!("layer {l} expert {e}"), "has no replica on any rank".into()));
                }
                if let Some(&(r, n)) = held.iter().find(|&&(r, n)| r >= ranks || n == 0) {
                    return Err(bad(
                        format!("layer {l} expert {e}: {n} on rank {r}"),
                        format!("ranks are below {ranks}, replicas above 0"),
                    ));
                }
                if held.windows(2).any(|w| w[0].0 >= w[1].0) {
                    return Err(bad(format!("layer {l} expert {e}"), "its ranks must be listed once each, ascending".into()));
                }
            }
        }
        Ok(ReplicaMap { epoch, ranks, experts, layers })
    }

    /// DeepSpeed-MoE's static expert parallelism: each layer's experts split into `ranks`
    /// contiguous, equal-as-possible blocks, one replica each.
    pub fn static_ep(epoch: u64, layers: usize, experts: usize, ranks: usize) -> Result<Self, PlanError> {
        if ranks == 0 || experts == 0 || layers == 0 {
            return Err(PlanError::invalid(
                "static expert parallelism",
                format!("{layers} layers x {experts} experts over {ranks} ranks"),
                "needs at least one of each",
            ));
        }
        let layer: Vec<Vec<(usize, u32)>> = (0..experts).map(|e| vec![(e * ranks / experts, 1)]).collect();
        ReplicaMap::from_holders(epoch, ranks, vec![layer; layers])
    }

    /// The same placement stamped with another epoch.
    pub fn with_epoch(mut self, epoch: u64) -> Self {
        self.epoch = epoch;
        self
    }

    /// The same placement over `extra` more ranks after its own, which hold nothing (the
    /// leaving ranks of a drain).
    pub fn with_empty_ranks(mut self, extra: usize) -> Self {
        self.ranks += extra;
        self
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    pub fn experts(&self) -> usize {
        self.experts
    }

    /// MoE layers.
    pub fn layer_count(&self) -> usize {
        self.layers.len()
    }

    /// (rank, replicas) of every rank holding expert `e` of layer `l`, ranks ascending.
    pub fn placed(&self, l: usize, e: ExpertId) -> &[(usize, u32)] {
        &self.layers[l][e]
    }

    /// `[e][rank]` of layer `l`, dense (what the dispatcher of Algorithm 1 works on).
    pub fn dense_layer(&self, l: usize) -> Vec<Vec<u32>> {
        self.layers[l]
            .iter()
            .map(|held| {
                let mut row = vec![0u32; self.ranks];
                for &(r, n) in held {
                    row[r] = n;
                }
                row
            })
            .collect()
    }

    /// Replicas of expert `e` of layer `l` on `rank`.
    pub fn replicas_on(&self, l: usize, e: ExpertId, rank: usize) -> u32 {
        let held = &self.layers[l][e];
        held.binary_search_by_key(&rank, |&(r, _)| r).map_or(0, |i| held[i].1)
    }

    /// Ranks holding at least one replica of expert `e` of layer `l`, ascending.
    pub fn holders(&self, l: usize, e: ExpertId) -> Vec<usize> {
        self.layers[l][e].iter().map(|&(r, _)| r).collect()
    }

    /// Every expert of every layer has exactly one replica (what static expert parallelism
    /// needs).
    pub fn one_replica_each(&self) -> bool {
        self.layers.iter().flatten().all(|held| held.len() == 1 && held[0].1 == 1)
    }
}
