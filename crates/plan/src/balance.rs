//! How evenly the balanced dispatcher *can* spread a layer's tokens over a placement.
//!
//! With a token free to go to any replica of its expert (`DispatchSchedule::compute_balanced`),
//! the least possible load of the busiest bin (GPU or node) is a fractional flow problem:
//! experts supply `t_e` tokens, each may send them to any bin that holds it, every bin takes at
//! most λ. By max-flow/min-cut (Hall's condition), the smallest feasible λ is
//!
//! λ* = max over expert sets X of t(X) / |N(X)|,   N(X) = bins holding some expert of X.
//!
//! A bin that holds only cold experts cannot take its share however tokens are dispatched, so
//! λ* exceeds the mean t/B exactly when the placement itself makes some bins idle. MRO does this
//! on purpose (it packs the least replicated experts together, §4.1), which is what the
//! throughput guard in [`crate::placement::place_balanced`] trades against.

use crate::PlanError;

/// The busiest bin's tokens at best, against the mean.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadBalance {
    /// λ*: the smallest possible maximum tokens on one bin.
    pub bottleneck: f64,
    /// Σ t_e / bins: what every bin would get if all were equally useful.
    pub mean: f64,
}

impl LoadBalance {
    /// λ* / mean (≥ 1; 1 when there are no tokens). A step's expert compute takes this many
    /// times as long as on a perfectly balanced plan.
    pub fn imbalance(&self) -> f64 {
        if self.mean > 0.0 {
            (self.bottleneck / self.mean).max(1.0)
        } else {
            1.0
        }
    }
}

/// λ* for `bins` bins where `holders[e]` lists the bins holding expert `e` (repeats allowed,
/// they change nothing: one bin's capacity is shared by all its replicas).
pub fn min_max_load(holders: &[Vec<usize>], loads: &[f64], bins: usize) -> Result<LoadBalance, PlanError> {
    if holders.len() != loads.len() {
        return Err(PlanError::Length { field: "loads", got: loads.len(), expected: holders.len() });
    }
    if bins == 0 {
        return Err(PlanError::invalid("bins", 0, "at least one bin is needed"));
    }
    if let Some((e, x)) = loads.iter().enumerate().find(|(_, x)| !x.is_finite() || **x < 0.0) {
        return Err(PlanError::invalid("loads", format!("{x} (expert {e})"), "loads must be finite and ≥ 0"));
    }
    if let Some((e, _)) = holders.iter().enumerate().find(|(e, h)| loads[*e] > 0.0 && h.is_empty()) {
        return Err(PlanError::invalid("placement", format!("expert {e}"), "an expert with tokens has no replica"));
    }
    if let Some(&b) = holders.iter().flatten().find(|&&b| b >= bins) {
        return Err(PlanError::invalid("placement", format!("bin {b}"), format!("only {bins} bins")));
    }
    let total: f64 = loads.iter().sum();
    let mean = total / bins as f64;
    if total <= 0.0 {
        return Ok(LoadBalance { bottleneck: 0.0, mean });
    }
    let mut net = FlowNet::new(holders, loads, bins);
    // Dinkelbach on the ratio: start at a lower bound; while the flow cannot place every token, the
    // min cut's expert side X is a set with t(X)/|N(X)| > λ, and that ratio is the next λ. Each
    // step strictly raises λ and there are finitely many cuts, so it ends (in practice in 1–3).
    // No λ below one expert's tokens over its own bins (Hall's condition for X = {e}) is
    // feasible: starting there often needs one flow, not two or three.
    let mut lambda =
        (0..holders.len()).map(|e| loads[e] / (net.bin_edge_start[e + 1] - net.bin_edge_start[e]).max(1) as f64).fold(mean, f64::max);
    for _ in 0..=holders.len() {
        let (flow, cut_load, cut_bins) = net.max_flow(lambda);
        if flow >= total * (1.0 - 1e-9) || cut_bins == 0 {
            break;
        }
        let next = cut_load / cut_bins as f64;
        if next <= lambda * (1.0 + 1e-12) {
            break;
        }
        lambda = next;
    }
    Ok(LoadBalance { bottleneck: lambda, mean })
}

/// What stands between a placement and a lower λ: the tokens that cannot be placed when every
/// bin takes at most `lambda`, and the min cut's bins and experts (the union of the sets X with
/// t(X) > λ·|N(X)|; empty when nothing overflows). Inputs as for [`min_max_load`], already
/// validated by the caller.
pub(crate) fn overflow(holders: &[Vec<usize>], loads: &[f64], bins: usize, lambda: f64) -> Overflow {
    let mut net = FlowNet::new(holders, loads, bins);
    let (flow, _, _) = net.max_flow(lambda);
    let experts = holders.len();
    Overflow {
        tokens: (loads.iter().sum::<f64>() - flow).max(0.0),
        bins: (0..bins).map(|b| net.reached[1 + experts + b]).collect(),
        experts: (0..experts).map(|e| net.reached[1 + e]).collect(),
    }
}

/// See [`overflow`].
pub(crate) struct Overflow {
    pub tokens: f64,
    pub bins: Vec<bool>,
    pub experts: Vec<bool>,
}

/// Source → expert (t_e) → bin (unbounded) → sink (λ), Dinic's algorithm on f64 capacities.
/// Edges in pairs (forward `2k`, reverse `2k + 1`); each vertex's edges in one flat list (built
/// once per network: at a thousand bins a list per vertex was most of a weighing's allocations).
struct FlowNet {
    /// Vertex ids: 0 source, 1..=E experts, E+1..=E+B bins, E+B+1 sink. Vertex a's edges are
    /// `adj[adj_start[a]..adj_start[a + 1]]`, in the order they were made.
    adj_start: Vec<usize>,
    adj: Vec<usize>,
    to: Vec<usize>,
    cap: Vec<f64>,
    base: Vec<f64>,
    /// The bin → sink edges, whose capacity is λ.
    sink_edges: Vec<usize>,
    /// The source → expert edges, and each expert's edges to its bins
    /// (`bin_edges[bin_edge_start[e]..bin_edge_start[e + 1]]`).
    source_edges: Vec<usize>,
    bin_edge_start: Vec<usize>,
    bin_edges: Vec<usize>,
    experts: usize,
    bins: usize,
    loads: Vec<f64>,
    /// After [`FlowNet::max_flow`]: the vertices the source still reaches (the min cut's side).
    reached: Vec<bool>,
}

const EPS: f64 = 1e-12;

impl FlowNet {
    fn new(holders: &[Vec<usize>], loads: &[f64], bins: usize) -> Self {
        let experts = holders.len();
        let v = experts + bins + 2;
        let edges = experts + holders.iter().map(Vec::len).sum::<usize>() + bins;
        let mut net = FlowNet {
            adj_start: Vec::new(),
            adj: Vec::new(),
            to: Vec::with_capacity(2 * edges),
            cap: Vec::with_capacity(2 * edges),
            base: Vec::with_capacity(2 * edges),
            sink_edges: Vec::with_capacity(bins),
            source_edges: Vec::with_capacity(experts),
            bin_edge_start: Vec::with_capacity(experts + 1),
            bin_edges: Vec::with_capacity(edges),
            experts,
            bins,
            loads: loads.to_vec(),
            reached: Vec::new(),
        };
        // Each edge's tail, in the order the edges are made.
        let mut from = Vec::with_capacity(2 * edges);
        let mut seen = Vec::new();
        for (e, h) in holders.iter().enumerate() {
            net.source_edges.push(net.to.len());
            net.edge(&mut from, 0, 1 + e, loads[e]);
            seen.clear();
            seen.extend_from_slice(h);
            seen.sort_unstable();
            seen.dedup();
            net.bin_edge_start.push(net.bin_edges.len());
            for &b in &seen {
                net.bin_edges.push(net.to.len());
                net.edge(&mut from, 1 + e, 1 + experts + b, f64::INFINITY);
            }
        }
        net.bin_edge_start.push(net.bin_edges.len());
        for b in 0..bins {
            net.sink_edges.push(net.to.len());
            net.edge(&mut from, 1 + experts + b, v - 1, 0.0);
        }
        // The flat adjacency: a stable counting sort of the edges by tail.
        let mut start = vec![0usize; v + 1];
        for &a in &from {
            start[a + 1] += 1;
        }
        for a in 0..v {
            start[a + 1] += start[a];
        }
        let mut next = start.clone();
        net.adj = vec![0; from.len()];
        for (id, &a) in from.iter().enumerate() {
            net.adj[next[a]] = id;
            next[a] += 1;
        }
        net.adj_start = start;
        net
    }

    /// An edge a → b of capacity c and its reverse; `from` takes their tails.
    fn edge(&mut self, from: &mut Vec<usize>, a: usize, b: usize, c: f64) {
        for (tail, head, cap) in [(a, b, c), (b, a, 0.0)] {
            from.push(tail);
            self.to.push(head);
            self.cap.push(cap);
            self.base.push(cap);
        }
    }

    /// Max flow with every bin capped at `lambda`; also the min cut's source side: the tokens of
    /// its experts and how many bins it has.
    fn max_flow(&mut self, lambda: f64) -> (f64, f64, usize) {
        let sink = self.experts + self.bins + 1;
        self.cap.copy_from_slice(&self.base);
        for &id in &self.sink_edges {
            self.cap[id] = lambda;
        }
        let mut flow = self.greedy_flow();
        let v = self.adj_start.len() - 1;
        let mut level = vec![usize::MAX; v];
        let mut it = vec![0usize; v];
        loop {
            level.iter_mut().for_each(|l| *l = usize::MAX);
            level[0] = 0;
            let mut queue = std::collections::VecDeque::from([0usize]);
            while let Some(a) = queue.pop_front() {
                for &id in &self.adj[self.adj_start[a]..self.adj_start[a + 1]] {
                    let b = self.to[id];
                    if self.cap[id] > EPS && level[b] == usize::MAX {
                        level[b] = level[a] + 1;
                        queue.push_back(b);
                    }
                }
            }
            if level[sink] == usize::MAX {
                break;
            }
            it.iter_mut().for_each(|i| *i = 0);
            loop {
                let pushed = self.augment(0, sink, f64::INFINITY, &level, &mut it);
                if pushed <= EPS {
                    break;
                }
                flow += pushed;
            }
        }
        // `level` now marks what the source still reaches: the min cut's source side.
        self.reached = level.iter().map(|&l| l != usize::MAX).collect();
        let cut_load: f64 = (0..self.experts).filter(|&e| level[1 + e] != usize::MAX).map(|e| self.loads[e]).sum();
        let cut_bins = (0..self.bins).filter(|&b| level[1 + self.experts + b] != usize::MAX).count();
        (flow, cut_load, cut_bins)
    }

    /// A first flow, each expert's tokens to its bins' free room in turn: one pass over the
    /// edges that leaves Dinic's phases (which find the max flow from any flow) only what this
    /// could not place — at a thousand bins most of the tokens, in a fraction of the time.
    fn greedy_flow(&mut self) -> f64 {
        let mut flow = 0.0;
        for e in 0..self.experts {
            let source = self.source_edges[e];
            for k in self.bin_edge_start[e]..self.bin_edge_start[e + 1] {
                let id = self.bin_edges[k];
                let left = self.cap[source];
                if left <= EPS {
                    break;
                }
                let sink_edge = self.sink_edges[self.to[id] - 1 - self.experts];
                let push = left.min(self.cap[sink_edge]);
                if push <= EPS {
                    continue;
                }
                for edge in [source, id, sink_edge] {
                    self.cap[edge] -= push;
                    self.cap[edge ^ 1] += push;
                }
                flow += push;
            }
        }
        flow
    }

    /// Push up to `limit` from `a` towards the sink along level-increasing edges, through as many
    /// edges as it takes (one call per blocking-flow round from the source, not one per path: the
    /// source's edges to 256 experts would otherwise each start their own descent). An edge is
    /// passed over once it is saturated or what lies behind it took less than it was offered.
    fn augment(&mut self, a: usize, sink: usize, limit: f64, level: &[usize], it: &mut [usize]) -> f64 {
        if a == sink {
            return limit;
        }
        let mut pushed = 0.0;
        let (first, end) = (self.adj_start[a], self.adj_start[a + 1]);
        while first + it[a] < end {
            let id = self.adj[first + it[a]];
            let b = self.to[id];
            if self.cap[id] > EPS && level[b] == level[a] + 1 {
                let got = self.augment(b, sink, (limit - pushed).min(self.cap[id]), level, it);
                if got > EPS {
                    self.cap[id] -= got;
                    self.cap[id ^ 1] += got;
                    pushed += got;
                    if limit - pushed <= EPS {
                        return pushed;
                    }
                }
            }
            it[a] += 1;
        }
        pushed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use proptest::prelude::{any, prop_assert, proptest, ProptestConfig};

    /// The Hall formula evaluated over every expert subset: the oracle for small instances.
    fn brute(holders: &[Vec<usize>], loads: &[f64], bins: usize) -> f64 {
        let e = holders.len();
        let mut best = loads.iter().sum::<f64>() / bins as f64;
        for x in 1u32..(1 << e) {
            let mut nb = 0u64;
            let mut t = 0.0;
            for (i, h) in holders.iter().enumerate() {
                if x & (1 << i) != 0 {
                    t += loads[i];
                    h.iter().for_each(|&b| nb |= 1 << b);
                }
            }
            best = best.max(t / nb.count_ones() as f64);
        }
        best
    }

    #[test]
    fn the_bench_shape_at_8_to_1_leaves_a_worker_idle() {
        // All tokens on expert 0; workers 0 holds only cold experts, worker 1 one hot replica:
        // the three hot holders split the tokens, λ* = T/3 = 1.33× the mean.
        let holders = vec![vec![1, 2, 2, 2, 2, 3, 3, 3, 3], vec![0], vec![0], vec![0], vec![0], vec![1], vec![1], vec![1]];
        let loads = [4096.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        let b = min_max_load(&holders, &loads, 4).unwrap();
        assert!((b.imbalance() - 4.0 / 3.0).abs() < 1e-9, "{b:?}");
        // One hot replica on every worker: perfectly balanced.
        let holders = vec![vec![0, 1, 2, 2, 3, 3, 3, 3, 3], vec![0], vec![0], vec![0], vec![1], vec![1], vec![1], vec![2]];
        assert!((min_max_load(&holders, &loads, 4).unwrap().imbalance() - 1.0).abs() < 1e-9);
    }

    #[test]
    fn bad_inputs_are_named() {
        assert!(min_max_load(&[vec![0]], &[1.0, 2.0], 1).unwrap_err().to_string().contains("loads"));
        assert!(min_max_load(&[vec![0]], &[f64::NAN], 1).unwrap_err().to_string().contains("expert 0"));
        assert!(min_max_load(&[vec![3]], &[1.0], 2).unwrap_err().to_string().contains("bin 3"));
        assert!(min_max_load(&[vec![]], &[1.0], 2).unwrap_err().to_string().contains("expert 0"));
        assert!(min_max_load(&[vec![0]], &[1.0], 0).unwrap_err().to_string().contains("bins"));
        assert_eq!(min_max_load(&[vec![0]], &[0.0], 2).unwrap().imbalance(), 1.0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn matches_halls_formula(bins in 1usize..6, experts in 1usize..8, seed in any::<u64>()) {
            let mut rng = SplitMix64::new(seed);
            let holders: Vec<Vec<usize>> = (0..experts)
                .map(|_| (0..1 + rng.below(3)).map(|_| rng.below(bins)).collect())
                .collect();
            let loads: Vec<f64> = (0..experts).map(|_| if rng.below(4) == 0 { 0.0 } else { rng.below(1000) as f64 }).collect();
            let got = min_max_load(&holders, &loads, bins).unwrap().bottleneck;
            let want = brute(&holders, &loads, bins);
            prop_assert!((got - want).abs() <= 1e-6 * want.max(1.0), "{:?} {:?}: {} vs {}", holders, loads, got, want);
        }
    }
}
