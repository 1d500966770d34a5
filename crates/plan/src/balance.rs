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
    if let Some(&b) = holders.iter().flatten().find(|&&b| b >= bins) {
        return Err(PlanError::invalid("placement", format!("bin {b}"), format!("only {bins} bins")));
    }
    min_max_load_of_pairs(&pairs_of(holders), loads, bins)
}

/// Every (expert, bin) of `holders`, expert by expert.
fn pairs_of(holders: &[Vec<usize>]) -> Vec<(u32, u32)> {
    holders.iter().enumerate().flat_map(|(e, h)| h.iter().map(move |&b| (e as u32, b as u32))).collect()
}

/// [`min_max_load`] for replicas given as (expert, bin) pairs, every bin below `bins` and every
/// expert below `loads.len()` (a placement's slots, without a list per expert).
pub(crate) fn min_max_load_of_pairs(pairs: &[(u32, u32)], loads: &[f64], bins: usize) -> Result<LoadBalance, PlanError> {
    min_max_load_on(&Bipartite::of_pairs(pairs, loads.len(), bins), loads)
}

/// [`min_max_load`] on a graph already made (a placement keeps its own, [`crate::Placement`]);
/// `loads` has one entry per expert of it.
pub(crate) fn min_max_load_on(graph: &Bipartite, loads: &[f64]) -> Result<LoadBalance, PlanError> {
    if graph.bins == 0 {
        return Err(PlanError::invalid("bins", 0, "at least one bin is needed"));
    }
    crate::placement::validate_loads(loads, graph.experts)?;
    if let Some(e) = (0..loads.len()).find(|&e| loads[e] > 0.0 && graph.degree(e) == 0) {
        return Err(PlanError::invalid("placement", format!("expert {e}"), "an expert with tokens has no replica"));
    }
    let bins = graph.bins;
    let mut net = FlowNet::new(graph, loads);
    let total: f64 = loads.iter().sum();
    let mean = total / bins as f64;
    if total <= 0.0 {
        return Ok(LoadBalance { bottleneck: 0.0, mean });
    }
    // Dinkelbach on the ratio: start at a lower bound; while the flow cannot place every token, the
    // min cut's expert side X is a set with t(X)/|N(X)| > λ, and that ratio is the next λ. Each
    // step strictly raises λ and there are finitely many cuts, so it ends (in practice in 1–3).
    // No λ below one expert's tokens over its own bins (Hall's condition for X = {e}) is
    // feasible: starting there often needs one flow, not two or three. Raising λ only adds room,
    // so each step goes on from the flow the last one left.
    let mut lambda = (0..loads.len()).map(|e| loads[e] / graph.degree(e).max(1) as f64).fold(mean, f64::max);
    net.start(lambda);
    for _ in 0..=loads.len() {
        let cut = net.max_flow();
        if net.placed >= total * (1.0 - 1e-9) || cut.bins == 0 {
            break;
        }
        let next = cut.load / cut.bins as f64;
        if next <= lambda * (1.0 + 1e-12) {
            break;
        }
        net.raise(next - lambda);
        lambda = next;
    }
    Ok(LoadBalance { bottleneck: lambda, mean })
}

/// What stands between a placement and a lower λ: the tokens that cannot be placed when every
/// bin takes at most `lambda`, and the min cut's bins and experts (the union of the sets X with
/// t(X) > λ·|N(X)|; empty when nothing overflows). Inputs as for [`min_max_load`], already
/// validated by the caller.
pub(crate) fn overflow(holders: &[Vec<usize>], loads: &[f64], bins: usize, lambda: f64) -> Overflow {
    let graph = Bipartite::of_pairs(&pairs_of(holders), loads.len(), bins);
    let mut net = FlowNet::new(&graph, loads);
    net.start(lambda);
    net.max_flow();
    Overflow {
        tokens: (loads.iter().sum::<f64>() - net.placed).max(0.0),
        bins: net.bin_level.iter().map(|&l| l != UNREACHED).collect(),
        experts: net.expert_level.iter().map(|&l| l != UNREACHED).collect(),
    }
}

/// See [`overflow`].
pub(crate) struct Overflow {
    pub tokens: f64,
    pub bins: Vec<bool>,
    pub experts: Vec<bool>,
}

/// The min cut's source side after a max flow: its experts' tokens and how many bins it has.
struct Cut {
    load: f64,
    bins: usize,
}

const EPS: f64 = 1e-12;
const UNREACHED: u32 = u32::MAX;

/// The experts and the bins holding them: the graph of every flow below, made once for a
/// placement (a placement keeps it, and every λ* of it under new loads starts from it).
///
/// Why kept apart from the flow: in a simulated day at a thousand bins a placement's λ* is made
/// under many load epochs, and building this graph was as much work as the flow itself.
#[derive(Debug)]
pub(crate) struct Bipartite {
    experts: usize,
    bins: usize,
    /// Expert e's distinct bins: edges `edge_start[e]..edge_start[e + 1]`, edge k to bin
    /// `edge_bin[k]`, in the order the pairs gave them.
    edge_start: Vec<u32>,
    edge_bin: Vec<u32>,
    /// Bin b's edges: `bin_edges[bin_start[b]..bin_start[b + 1]]`, each from expert `edge_expert[k]`.
    bin_start: Vec<u32>,
    bin_edges: Vec<u32>,
    edge_expert: Vec<u32>,
    /// The experts by ascending degree (ties by id): the first flow's order ([`FlowNet::start`]).
    by_degree: Vec<u32>,
}

impl Bipartite {
    /// The graph of `pairs` (expert, bin), each expert's bins in the order given, a bin repeated
    /// for an expert kept once; every expert below `experts`, every bin below `bins`.
    pub(crate) fn of_pairs(pairs: &[(u32, u32)], experts: usize, bins: usize) -> Self {
        // Each expert's bins, by a counting sort on the expert.
        let mut edge_start = vec![0u32; experts + 1];
        for &(e, _) in pairs {
            edge_start[e as usize + 1] += 1;
        }
        for e in 0..experts {
            edge_start[e + 1] += edge_start[e];
        }
        let mut fill = edge_start.clone();
        let mut sorted = vec![0u32; pairs.len()];
        for &(e, b) in pairs {
            sorted[fill[e as usize] as usize] = b;
            fill[e as usize] += 1;
        }
        // A bin repeated in an expert's list is one edge: `last[b]` is the last expert seen on b.
        let mut last = vec![u32::MAX; bins];
        let mut count = vec![0u32; bins + 1];
        let mut edge_bin = Vec::with_capacity(pairs.len());
        let mut edge_expert = Vec::with_capacity(pairs.len());
        for e in 0..experts {
            let (from, to) = (edge_start[e] as usize, edge_start[e + 1] as usize);
            edge_start[e] = edge_bin.len() as u32;
            for &b in &sorted[from..to] {
                if last[b as usize] != e as u32 {
                    last[b as usize] = e as u32;
                    edge_bin.push(b);
                    edge_expert.push(e as u32);
                    count[b as usize + 1] += 1;
                }
            }
        }
        edge_start[experts] = edge_bin.len() as u32;
        // Each bin's edges, by a counting sort on the bin.
        for b in 0..bins {
            count[b + 1] += count[b];
        }
        let mut fill = count.clone();
        let mut bin_edges = vec![0u32; edge_bin.len()];
        for (k, &b) in edge_bin.iter().enumerate() {
            bin_edges[fill[b as usize] as usize] = k as u32;
            fill[b as usize] += 1;
        }
        let mut by_degree: Vec<u32> = (0..experts as u32).collect();
        by_degree.sort_by_key(|&e| (edge_start[e as usize + 1] - edge_start[e as usize], e));
        Bipartite { experts, bins, edge_start, edge_bin, bin_start: count, bin_edges, edge_expert, by_degree }
    }

    /// How many distinct bins hold expert `e`.
    fn degree(&self, e: usize) -> usize {
        (self.edge_start[e + 1] - self.edge_start[e]) as usize
    }

    fn edges(&self, e: usize) -> std::ops::Range<usize> {
        self.edge_start[e] as usize..self.edge_start[e + 1] as usize
    }
}

/// A flow on a [`Bipartite`] graph, source → expert (t_e) → bin (unbounded) → sink (λ), kept as
/// what it is: a flow on each expert–bin edge, each expert's tokens not yet placed (the source
/// edge's residual) and each bin's room (the sink edge's). Max flow by Dinic's phases, with the
/// source and sink implicit: a phase's search starts from every expert with tokens left and ends
/// at the first level with room.
///
/// Why not a general flow network: at a thousand bins a λ* is made tens of thousands of times
/// in a simulated day (every plan and load epoch, every weighing), and the general form's
/// per-edge pairs, its copies of every capacity and its whole-graph searches were most of the
/// simulator's time.
struct FlowNet<'a> {
    g: &'a Bipartite,
    loads: &'a [f64],
    flow: Vec<f64>,
    /// Tokens of each expert not yet placed; room left on each bin under λ.
    left: Vec<f64>,
    room: Vec<f64>,
    /// Tokens placed in all.
    placed: f64,
    /// The last search's levels (experts even, bins odd; [`UNREACHED`] if not reached): after a
    /// max flow, what the experts with tokens left still reach — the min cut's source side.
    expert_level: Vec<u32>,
    bin_level: Vec<u32>,
    /// Each vertex's next edge to try in a phase (Dinic's current-arc pointers).
    expert_next: Vec<u32>,
    bin_next: Vec<u32>,
    /// The level of the bins with room a phase's search reached first.
    sink_level: u32,
    /// The search's queue, kept from phase to phase.
    queue: Vec<u32>,
}

impl<'a> FlowNet<'a> {
    /// No flow yet on `g` with these loads (one per expert of it).
    fn new(g: &'a Bipartite, loads: &'a [f64]) -> Self {
        FlowNet {
            g,
            loads,
            flow: vec![0.0; g.edge_bin.len()],
            left: loads.to_vec(),
            room: vec![0.0; g.bins],
            placed: 0.0,
            expert_level: vec![UNREACHED; g.experts],
            bin_level: vec![UNREACHED; g.bins],
            expert_next: vec![0; g.experts],
            bin_next: vec![0; g.bins],
            sink_level: UNREACHED,
            queue: Vec::with_capacity(g.experts + g.bins),
        }
    }

    /// Every bin's room set to `lambda`, and a first flow: each expert's tokens to its bins'
    /// room in turn. One pass over the edges that leaves Dinic's phases (which find the max flow
    /// from any flow) only what this could not place — at a thousand bins most of the tokens,
    /// in a fraction of the time.
    fn start(&mut self, lambda: f64) {
        self.room.iter_mut().for_each(|r| *r = lambda);
        // The most constrained experts first: an expert on two bins takes them before a hot one
        // on sixty fills them, which leaves the phases a third less to reroute (the max flow and
        // its cut are the same whatever the order).
        let g = self.g;
        for &e in &g.by_degree {
            let e = e as usize;
            for k in g.edges(e) {
                if self.left[e] <= EPS {
                    break;
                }
                let b = g.edge_bin[k] as usize;
                let push = self.left[e].min(self.room[b]);
                if push > EPS {
                    self.flow[k] += push;
                    self.left[e] -= push;
                    self.room[b] -= push;
                    self.placed += push;
                }
            }
        }
    }

    /// λ raised by `by`: every bin gains that much room; the flow stays as it is.
    fn raise(&mut self, by: f64) {
        self.room.iter_mut().for_each(|r| *r += by);
    }

    /// The max flow from the current one; then the min cut's source side (the experts with
    /// tokens left and what they reach), its tokens and bins.
    fn max_flow(&mut self) -> Cut {
        while self.search() {
            self.expert_next.iter_mut().for_each(|i| *i = 0);
            self.bin_next.iter_mut().for_each(|i| *i = 0);
            for e in 0..self.loads.len() {
                if self.expert_level[e] == 0 && self.left[e] > EPS {
                    let got = self.push_expert(e, self.left[e]);
                    self.left[e] -= got;
                    self.placed += got;
                }
            }
        }
        let load = (0..self.loads.len()).filter(|&e| self.expert_level[e] != UNREACHED).map(|e| self.loads[e]).sum();
        Cut { load, bins: self.bin_level.iter().filter(|&&l| l != UNREACHED).count() }
    }

    /// A phase's breadth-first search in the residual graph, from every expert with tokens left
    /// (level 0) over expert → bin edges (unbounded) and bin → expert edges that carry flow (to
    /// send it elsewhere), to the first level holding a bin with room. False when no bin with
    /// room is reached: the flow is a max flow and the levels mark the min cut's source side.
    fn search(&mut self) -> bool {
        self.expert_level.iter_mut().for_each(|l| *l = UNREACHED);
        self.bin_level.iter_mut().for_each(|l| *l = UNREACHED);
        self.sink_level = UNREACHED;
        // Experts and bins in order of level; a bin is stored as `experts + b`.
        let experts = self.loads.len();
        let mut queue = std::mem::take(&mut self.queue);
        queue.clear();
        queue.extend((0..experts as u32).filter(|&e| self.left[e as usize] > EPS));
        queue.iter().for_each(|&e| self.expert_level[e as usize] = 0);
        let mut head = 0;
        while head < queue.len() {
            let v = queue[head] as usize;
            head += 1;
            if v < experts {
                let next = self.expert_level[v] + 1;
                for k in self.g.edges(v) {
                    let b = self.g.edge_bin[k] as usize;
                    if self.bin_level[b] == UNREACHED {
                        self.bin_level[b] = next;
                        if self.room[b] > EPS {
                            self.sink_level = self.sink_level.min(next);
                        } else if self.sink_level == UNREACHED {
                            queue.push((experts + b) as u32);
                        }
                    }
                }
            } else if self.sink_level == UNREACHED {
                let b = v - experts;
                let next = self.bin_level[b] + 1;
                for &k in &self.g.bin_edges[self.g.bin_start[b] as usize..self.g.bin_start[b + 1] as usize] {
                    let e = self.g.edge_expert[k as usize] as usize;
                    if self.flow[k as usize] > EPS && self.expert_level[e] == UNREACHED {
                        self.expert_level[e] = next;
                        queue.push(e as u32);
                    }
                }
            }
        }
        self.queue = queue;
        self.sink_level != UNREACHED
    }

    /// Push up to `limit` of expert `e`'s tokens along level-increasing edges (Dinic's blocking
    /// flow); an edge is passed over once what lies behind it took less than it was offered.
    fn push_expert(&mut self, e: usize, limit: f64) -> f64 {
        let mut pushed = 0.0;
        let level = self.expert_level[e] + 1;
        let first = self.g.edge_start[e];
        while first + self.expert_next[e] < self.g.edge_start[e + 1] {
            let k = (first + self.expert_next[e]) as usize;
            let b = self.g.edge_bin[k] as usize;
            if self.bin_level[b] == level {
                let got = self.push_bin(b, limit - pushed);
                if got > EPS {
                    self.flow[k] += got;
                    pushed += got;
                    if limit - pushed <= EPS {
                        return pushed;
                    }
                }
            }
            self.expert_next[e] += 1;
        }
        pushed
    }

    /// Take up to `limit` into bin `b`: into its room if it is at the search's last level, else
    /// by sending on flow that reaches it from experts one level further.
    fn push_bin(&mut self, b: usize, limit: f64) -> f64 {
        let level = self.bin_level[b];
        if level == self.sink_level {
            let take = limit.min(self.room[b]);
            if take <= EPS {
                return 0.0;
            }
            self.room[b] -= take;
            return take;
        }
        let mut pushed = 0.0;
        let first = self.g.bin_start[b];
        while first + self.bin_next[b] < self.g.bin_start[b + 1] {
            let k = self.g.bin_edges[(first + self.bin_next[b]) as usize] as usize;
            let e = self.g.edge_expert[k] as usize;
            if self.expert_level[e] == level + 1 && self.flow[k] > EPS {
                let got = self.push_expert(e, (limit - pushed).min(self.flow[k]));
                if got > EPS {
                    self.flow[k] -= got;
                    pushed += got;
                    if limit - pushed <= EPS {
                        return pushed;
                    }
                }
            }
            self.bin_next[b] += 1;
        }
        pushed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use proptest::prelude::{any, prop_assert, prop_assert_eq, proptest, ProptestConfig};

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

        /// The tokens left over at a given λ are the largest t(X) − λ·|N(X)| over expert sets
        /// (max-flow min-cut), and the experts and bins of the cut are such a set and its bins.
        #[test]
        fn overflow_is_the_worst_sets_excess(bins in 1usize..6, experts in 1usize..8, seed in any::<u64>(), share in 0.2f64..1.5) {
            let mut rng = SplitMix64::new(seed);
            let holders: Vec<Vec<usize>> = (0..experts)
                .map(|_| (0..1 + rng.below(3)).map(|_| rng.below(bins)).collect())
                .collect();
            let loads: Vec<f64> = (0..experts).map(|_| if rng.below(4) == 0 { 0.0 } else { rng.below(1000) as f64 }).collect();
            let lambda = share * loads.iter().sum::<f64>() / bins as f64;
            let excess = |x: u32| {
                let mut nb = 0u64;
                let mut t = 0.0;
                for (i, h) in holders.iter().enumerate().filter(|(i, _)| x & (1 << i) != 0) {
                    t += loads[i];
                    h.iter().for_each(|&b| nb |= 1 << b);
                }
                (t - lambda * nb.count_ones() as f64, nb)
            };
            let want = (0u32..(1 << experts)).map(|x| excess(x).0).fold(0.0, f64::max);
            let got = overflow(&holders, &loads, bins, lambda);
            prop_assert!((got.tokens - want).abs() <= 1e-6 * lambda.max(1.0), "{} vs {}", got.tokens, want);
            let x: u32 = (0..experts).filter(|&e| got.experts[e]).map(|e| 1 << e).sum();
            let (cut_excess, cut_bins) = excess(x);
            prop_assert!((cut_excess.max(0.0) - want).abs() <= 1e-6 * lambda.max(1.0), "the cut's excess {} vs {}", cut_excess, want);
            for b in 0..bins {
                prop_assert_eq!(got.bins[b], cut_bins & (1 << b) != 0, "bin {} of the cut", b);
            }
        }
    }
}
