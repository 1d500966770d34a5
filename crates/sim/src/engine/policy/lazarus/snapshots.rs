//! The snapshot tier in simulated time (MoEtion §4, PEC §3; the workers' snapshot rounds):
//! after each step, experts whose every replica sits on one node are copied into the memory of
//! the same GPU on the next node, the most tokens at risk first, within the step's byte budget
//! (the snapshot bandwidth times the step time). A survivor that keeps the snapshot of an expert
//! that lost every replica says so when it stops, and the controller restores the expert from
//! it instead of rolling the job back.
//!
//! Steps are not simulated one by one, so the rounds are taken in their steady state, the
//! fluid limit of the workers' greedy choice: with `m` experts' bytes a step and `a_e` tokens a
//! step for at-risk expert `e`, each is copied at a rate `min(1, a_e / θ)` a step, θ such that
//! the rates add up to `m` (every expert every step when the budget holds them all). Each
//! expert's copies fall at fixed steps from its own phase (drawn from its layer and index), so
//! at a failure some experts have a fresh snapshot and some an older one, as in a real run. A
//! snapshot sent after step s arrives after step s + 1 (it travels while that step computes), and
//! a move starts the rounds afresh (the tier keeps no snapshot of an earlier plan: cautious).

use std::collections::HashMap;

use lazarus_decide::{NodeId, SnapshotHeld};
use lazarus_plan::{nodes_holding, ReplicaMap};

/// What the tier has to work with at a failure.
pub(super) struct Rounds<'a> {
    pub map: &'a ReplicaMap,
    /// The worker of each rank.
    pub ranks: &'a [NodeId],
    pub gpus_per_node: usize,
    /// Each expert's share of its layer's tokens.
    pub loads: &'a [Vec<f64>],
    pub tokens_per_step: f64,
    /// Experts' states a step's budget holds (bandwidth × step time / one expert's bytes).
    pub budget_experts: f64,
    /// The step the running plan began at, and the step now.
    pub since_step: u64,
    pub step: u64,
}

impl Rounds<'_> {
    /// The snapshots each worker keeps now, by worker.
    pub(super) fn held(&self) -> HashMap<NodeId, Vec<SnapshotHeld>> {
        let mut held: HashMap<NodeId, Vec<SnapshotHeld>> = HashMap::new();
        let (world, g) = (self.ranks.len(), self.gpus_per_node.max(1));
        if world < 2 * g || self.budget_experts < 1.0 || self.step <= self.since_step {
            return held;
        }
        let node_of: Vec<usize> = (0..world).map(|r| r / g).collect();
        let nodes = nodes_holding(self.map, &node_of);
        // (layer, expert, tokens a step) of every expert at risk.
        let at_risk: Vec<(usize, usize, f64)> = (0..self.map.layer_count())
            .flat_map(|l| (0..self.map.experts()).map(move |e| (l, e)))
            .filter(|&(l, e)| nodes[l][e] < 2)
            .map(|(l, e)| (l, e, self.loads.get(l).and_then(|x| x.get(e)).copied().unwrap_or(0.0) * self.tokens_per_step))
            .filter(|&(_, _, a)| a > 0.0)
            .collect();
        let theta = threshold(at_risk.iter().map(|x| x.2).collect(), self.budget_experts);
        let steps = (self.step - self.since_step) as f64;
        for (l, e, a) in at_risk {
            let period = if theta > a { theta / a } else { 1.0 };
            let Some(taken) = last_round(steps, period, phase(l, e)) else { continue };
            let Some(&(from, _)) = self.map.placed(l, e).first() else { continue };
            let keeper = self.ranks[(from + g) % world];
            let snapshot_step = self.since_step + taken;
            held.entry(keeper).or_default().push(SnapshotHeld {
                layer: l,
                expert: e,
                step: snapshot_step,
                tokens_lost: (a * (self.step - snapshot_step) as f64).round() as u64,
                held_step_tokens: 0,
            });
        }
        held
    }
}

/// θ such that Σ min(1, a / θ) = `m` (0: every expert every step).
fn threshold(mut a: Vec<f64>, m: f64) -> f64 {
    if a.len() as f64 <= m {
        return 0.0;
    }
    a.sort_by(|x, y| y.total_cmp(x));
    let mut rest: f64 = a.iter().sum();
    // The first i experts are copied every step; the rest share what is left.
    for (i, &ai) in a.iter().enumerate() {
        let left = m - i as f64;
        if left <= 0.0 {
            break;
        }
        let theta = rest / left;
        if ai <= theta {
            return theta;
        }
        rest -= ai;
    }
    f64::INFINITY
}

/// The steps into the plan after which the last round whose snapshot has arrived by `steps`
/// was taken (round j after step ⌊(j + phase) · period⌋ + 1, arriving a step later); None
/// before the first has.
fn last_round(steps: f64, period: f64, phase: f64) -> Option<u64> {
    if !period.is_finite() {
        return None;
    }
    // ⌊(j + phase) · period⌋ + 2 ≤ steps  ⟺  j < (steps − 1) / period − phase.
    let j = ((steps - 1.0) / period - phase).ceil() - 1.0;
    (j >= 0.0).then(|| ((j + phase) * period).floor() as u64 + 1)
}

/// An expert's phase in [0, 1), from its layer and index.
fn phase(layer: usize, expert: usize) -> f64 {
    lazarus_plan::rng::SplitMix64::new(((layer as u64) << 32) ^ expert as u64 ^ 0x736e_6170).uniform()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threshold_shares_the_budget_by_tokens_at_risk() {
        assert_eq!(threshold(vec![5.0, 1.0], 2.0), 0.0, "room for both every step");
        // Budget 1 among 3, 1, 1 (sum 5): rates a / 5 add up to 1.
        assert!((threshold(vec![1.0, 3.0, 1.0], 1.0) - 5.0).abs() < 1e-12);
        // Budget 2: the 8 every step, the rest (1 + 1) share one: θ = 2.
        let theta = threshold(vec![8.0, 1.0, 1.0], 2.0);
        assert!((theta - 2.0).abs() < 1e-12, "{theta}");
        let rates: f64 = [8.0f64, 1.0, 1.0].iter().map(|&a| (a / theta).min(1.0)).sum();
        assert!((rates - 2.0).abs() < 1e-12);
    }

    #[test]
    fn a_round_counts_once_its_snapshot_has_arrived() {
        assert_eq!(last_round(2.0, 1.0, 0.0), Some(1), "taken after the plan's first step, arrived after the second");
        assert_eq!(last_round(1.0, 1.0, 0.0), None);
        assert_eq!(last_round(10.0, 4.0, 0.5), Some(7), "rounds after 3, 7, 11; the one of 7 arrived after 8");
        assert_eq!(last_round(3.0, 4.0, 0.5), None, "the first (after 3) arrives after 4");
        assert_eq!(last_round(10.0, f64::INFINITY, 0.5), None, "no budget for it");
    }

    /// Two nodes of one GPU; expert 0 of the layer on both, expert 1 on node 0 only, expert 2 on
    /// node 1 only: those two are kept by the other node, fresh when the budget holds both.
    #[test]
    fn experts_on_one_node_are_kept_by_the_next() {
        let map = ReplicaMap::new(3, vec![vec![vec![1, 1], vec![1, 0], vec![0, 1]]]).unwrap();
        let loads = vec![vec![0.5, 0.25, 0.25]];
        let rounds = Rounds {
            map: &map,
            ranks: &[10, 11],
            gpus_per_node: 1,
            loads: &loads,
            tokens_per_step: 100.0,
            budget_experts: 2.0,
            since_step: 4,
            step: 9,
        };
        let held = rounds.held();
        let of = |w: NodeId| held.get(&w).map(|v| v.iter().map(|x| (x.expert, x.step, x.tokens_lost)).collect::<Vec<_>>());
        assert_eq!(of(11), Some(vec![(1, 8, 25)]), "expert 1 (node 0 only) kept on node 1, one step stale");
        assert_eq!(of(10), Some(vec![(2, 8, 25)]));
        let none = Rounds { budget_experts: 0.5, ..rounds };
        assert!(none.held().is_empty(), "a budget below one expert sends nothing");
        let fresh = Rounds { step: 5, ..rounds };
        assert!(fresh.held().is_empty(), "nothing has arrived a step into the plan");
    }
}
