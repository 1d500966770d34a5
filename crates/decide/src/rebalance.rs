//! Periodic rebalancing (paper §4.3: the controller re-plans from the expert loads the workers
//! measured, as popularity drifts) and, beyond the paper, whether a rebalance pays for itself:
//! a pure function of the measured step time, the plans' bottlenecks under the measured loads,
//! the bytes the move would send and the measured cost of moving bytes.
//!
//! The gain is an upper bound: it assumes the whole step scales with the busiest GPU's expert
//! tokens (λ*, [`lazarus_plan::balance`]), where in truth attention and the dense parts do not.
//! A rebalance skipped under this rule could not have paid off within its horizon; one applied
//! may pay off less than predicted.

use std::collections::BTreeMap;

use lazarus_plan::distinct::{distinct_sorted, each_missing};
use lazarus_plan::{replan_model, size_of_move, ModelPlan, NodeState, Placement};
use serde::Serialize;

use super::{Command, Controller, MoveCause, MoveCost, StepRecord};

/// Before any move was measured: 1 GB/s, and 50 ms for the pause and rendezvous (loopback-like;
/// the first measured move replaces both).
pub(super) const DEFAULT_SECONDS_PER_BYTE: f64 = 1e-9;
pub(super) const DEFAULT_MOVE_FIXED_S: f64 = 0.05;

/// Past this many nodes a rebalance's candidate keeps the running plan's node order (plan node
/// q on the node at position q) instead of searching for the node mapping that moves least:
/// that search (a cost matrix over every pair of nodes, then an assignment, O(n³)) took 1.6 s of
/// the controller's loop at 1,024 nodes on a 2-core VM. What it buys there is small: a layer
/// whose allocation holds keeps its placement, and so its nodes, either way; a layer planned
/// afresh places its replicas independently of the others, so no one mapping of nodes suits
/// every layer.
pub(super) const MAPPED_FROM_NODES: usize = 256;

/// The load monitor (paper §4.3): the expert loads and step times measured since the plan was
/// made, the measured cost of a move, and the weighing of a rebalance from them — out, back,
/// or applied and waiting for its move.
#[derive(Debug, Clone)]
pub(crate) struct LoadMonitor {
    /// Σ expert loads per layer since the plan was made.
    pub(crate) loads: Vec<Vec<f64>>,
    /// The loads measured under an earlier plan (the last that measured any): what a plan made
    /// before the running one measured anything is made from.
    pub(crate) earlier: Vec<Vec<f64>>,
    /// Steps done since the plan was made (or the last weighing), and their seconds.
    pub(crate) steps_since_plan: u64,
    pub(crate) step_seconds: f64,
    /// The cost of moving, from the last measured move.
    pub(crate) seconds_per_byte: f64,
    pub(crate) move_fixed_s: f64,
    /// The plan an applied rebalance moves to (the measured-load plan, or only its layers worth
    /// moving), until its move.
    pub(crate) rebalance_to: Option<ModelPlan>,
    /// The epoch of the weighing out (asked for, its verdict not back yet), and the verdict
    /// back, until the rebalance rule acts on it.
    pub(crate) weighing: Option<u64>,
    pub(crate) weighed: Option<Weighed>,
}

impl LoadMonitor {
    pub(crate) fn new(layers: usize, experts: usize) -> Self {
        LoadMonitor {
            loads: vec![vec![0.0; experts]; layers],
            earlier: Vec::new(),
            steps_since_plan: 0,
            step_seconds: 0.0,
            seconds_per_byte: DEFAULT_SECONDS_PER_BYTE,
            move_fixed_s: DEFAULT_MOVE_FIXED_S,
            rebalance_to: None,
            weighing: None,
            weighed: None,
        }
    }

    /// `steps` steps of the current plan took `seconds` and routed `loads` (tokens per expert
    /// per layer; a report of another number of layers adds nothing, a step time that cannot be
    /// true is not counted). Whether the report was of this plan's shape.
    pub(crate) fn record(&mut self, loads: &[Vec<u64>], steps: u64, seconds: f64) -> bool {
        if loads.len() != self.loads.len() {
            return false;
        }
        for (acc, l) in self.loads.iter_mut().zip(loads) {
            if l.len() == acc.len() {
                acc.iter_mut().zip(l).for_each(|(a, &x)| *a += x as f64);
            }
        }
        if seconds.is_finite() && seconds >= 0.0 {
            self.steps_since_plan = self.steps_since_plan.saturating_add(steps);
            self.step_seconds += seconds;
        }
        true
    }

    /// A move was measured: its cost per byte and its fixed part become the next one's estimate
    /// (a move that sent nothing, or whose times cannot be true, teaches nothing).
    pub(crate) fn learn(&mut self, moved: MoveCost) {
        if moved.bytes > 0 && moved.transfer_s.is_finite() && moved.transfer_s > 0.0 {
            self.seconds_per_byte = moved.transfer_s / moved.bytes as f64;
            if moved.rebuild_s.is_finite() && moved.rebuild_s >= 0.0 {
                self.move_fixed_s = moved.rebuild_s;
            }
        }
    }

    /// A new plan runs: nothing measured of it yet (what the plan before it measured is kept).
    pub(crate) fn restart(&mut self) {
        if self.measured() {
            std::mem::swap(&mut self.loads, &mut self.earlier);
            self.loads.resize_with(self.earlier.len(), Vec::new);
            for (l, e) in self.loads.iter_mut().zip(&self.earlier) {
                l.clear();
                l.resize(e.len(), 0.0);
            }
        }
        self.restart_steps();
    }

    /// The loads to plan from: those measured under the running plan, else those measured
    /// under an earlier one — a loss right after a move has measured nothing of its plan yet,
    /// and a plan from even loads then would forget what the job routes (at 1,024 GPUs with
    /// one slot each, a hot expert with a quarter of its replicas: steps 15× longer until the
    /// next rebalance) — else None.
    pub(crate) fn plan_loads(&self) -> Option<&Vec<Vec<f64>>> {
        if self.measured() {
            Some(&self.loads)
        } else {
            Some(&self.earlier).filter(|e| e.iter().flatten().any(|&x| x > 0.0))
        }
    }

    /// The step count and time start again (a weighing was asked for; the loads keep adding up).
    pub(crate) fn restart_steps(&mut self) {
        self.steps_since_plan = 0;
        self.step_seconds = 0.0;
    }

    /// Whether any load was measured since the plan was made.
    pub(crate) fn measured(&self) -> bool {
        self.loads.iter().flatten().any(|&x| x > 0.0)
    }

    /// The mean step time since the plan was made (None before a step was counted).
    pub(crate) fn step_s(&self) -> Option<f64> {
        (self.steps_since_plan > 0).then(|| self.step_seconds / self.steps_since_plan as f64)
    }
}

/// One MoE layer of a candidate plan: its bottleneck now and under the candidate, and what
/// moving it to the candidate would send.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerCase {
    /// Whether the candidate places it otherwise (replicas sent between nodes, or only copied
    /// between the GPUs of a node: those cost no network bytes).
    pub differs: bool,
    /// λ* (the least possible busiest-GPU tokens) under the measured loads: the current plan's
    /// and the candidate's.
    pub bottleneck_before: f64,
    pub bottleneck_after: f64,
    /// Expert states its move would send, and their bytes.
    pub transfers: usize,
    pub bytes: u64,
}

/// What a rebalance would cost, and what it would gain, layer by layer.
#[derive(Debug, Clone, PartialEq)]
pub struct RebalanceCase {
    /// Mean seconds of a step since the plan was made (measured).
    pub step_s: f64,
    /// Steps until the next rebalance is considered: the horizon the gain must repay within.
    pub horizon_steps: u64,
    pub layers: Vec<LayerCase>,
    /// Mean over layers of λ* / mean tokens per GPU (1 is perfect balance): now, and under the
    /// whole candidate.
    pub imbalance_before: f64,
    pub imbalance_after: f64,
    /// Measured cost of moving: seconds per byte sent, and a fixed part (pause, rendezvous).
    pub seconds_per_byte: f64,
    pub fixed_s: f64,
}

/// The controller's decision on one rebalance, as the `--json-log` records it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RebalanceDecision {
    pub event: &'static str,
    /// Steps done when it was weighed.
    pub step: u64,
    pub decision: RebalanceVerdict,
    /// Predicted seconds saved over the horizon by what is applied (an upper bound, see the
    /// module's note), and what that move costs; for a skip, those of the whole candidate.
    pub gain_s: f64,
    pub cost_s: f64,
    /// The same for the whole candidate (equal to the above unless it was shrunk).
    pub full_gain_s: f64,
    pub full_cost_s: f64,
    pub horizon_steps: u64,
    pub step_s: f64,
    pub imbalance_before: f64,
    /// Imbalance under what is applied (for a skip, under the whole candidate).
    pub imbalance_after: f64,
    /// The MoE layers that move (none for a skip).
    pub layers: Vec<usize>,
    pub transfers: usize,
    pub transfer_bytes: u64,
    /// Seconds the weighing took on the controller's loop (set by the shell, which has a clock;
    /// none from the decision core).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weigh_s: Option<f64>,
    /// A skip whose gain could not repay even a move's fixed part: the move was not sized, so
    /// `transfers` and `transfer_bytes` are 0 and the costs that fixed part only.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub not_sized: bool,
}

impl RebalanceDecision {
    /// What the move costs, as people read it: its seconds and transfers, or — not sized — at
    /// least its fixed part.
    pub fn cost_said(&self) -> String {
        if self.not_sized {
            format!("a move of at least {:.2} s (not sized: the gain cannot pay even that)", self.cost_s)
        } else {
            format!("a move of {:.2} s ({} expert moves, {:.1} MB)", self.cost_s, self.transfers, self.transfer_bytes as f64 / 1e6)
        }
    }
}

/// What the controller does with a rebalance it weighed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RebalanceVerdict {
    /// The job pauses and moves every layer the candidate changes.
    Apply,
    /// It moves only the layers that repay their own move.
    Shrink,
    /// It stays where it is.
    Skip,
}

impl RebalanceVerdict {
    pub fn as_str(self) -> &'static str {
        match self {
            RebalanceVerdict::Apply => "apply",
            RebalanceVerdict::Shrink => "shrink",
            RebalanceVerdict::Skip => "skip",
        }
    }
}

displayed_as_str!(RebalanceVerdict);

impl RebalanceCase {
    /// Seconds saved over the horizon if `layers` ran on the candidate's placement instead of
    /// the current one: the step is taken to scale with Σ λ* over layers, so each layer's share
    /// adds up.
    pub fn gain_s(&self, layers: &[usize]) -> f64 {
        let before: f64 = self.layers.iter().map(|l| l.bottleneck_before).sum();
        if before.is_nan() || before <= 0.0 || !self.step_s.is_finite() {
            return 0.0;
        }
        let saved: f64 = layers.iter().filter_map(|&l| self.layers.get(l)).map(|l| l.bottleneck_before - l.bottleneck_after).sum();
        (self.step_s * saved / before).max(0.0) * self.horizon_steps as f64
    }

    /// Seconds moving `layers` costs.
    pub fn cost_s(&self, layers: &[usize]) -> f64 {
        let bytes: u64 = layers.iter().filter_map(|&l| self.layers.get(l)).map(|l| l.bytes).sum();
        self.fixed_s + bytes as f64 * self.seconds_per_byte
    }

    /// The most any set of layers could save: every changed layer that gains, whatever its
    /// bytes. A move whose fixed part this does not exceed cannot repay itself.
    pub fn most_gain_s(&self) -> f64 {
        self.changed().into_iter().map(|l| self.gain_s(&[l])).sum()
    }

    /// Every layer the candidate changes.
    pub fn changed(&self) -> Vec<usize> {
        (0..self.layers.len()).filter(|&l| self.layers[l].differs).collect()
    }

    /// The layers whose own gain repays their own bytes: with gains and byte costs adding up
    /// over layers, the set that saves the most once the fixed cost is paid.
    pub fn worth_moving(&self) -> Vec<usize> {
        self.changed().into_iter().filter(|&l| self.gain_s(&[l]) > self.layers[l].bytes as f64 * self.seconds_per_byte).collect()
    }

    /// Apply the whole candidate, only the layers worth moving, or nothing: whichever saves the
    /// most, if anything.
    pub fn decide(&self, step: u64) -> RebalanceDecision {
        let full = self.changed();
        let worth = self.worth_moving();
        let (full_gain_s, full_cost_s) = (self.gain_s(&full), self.cost_s(&full));
        let net = |layers: &[usize]| self.gain_s(layers) - self.cost_s(layers);
        let decision = if worth.is_empty() || net(&worth) <= 0.0 {
            RebalanceVerdict::Skip
        } else if worth == full {
            RebalanceVerdict::Apply
        } else {
            RebalanceVerdict::Shrink
        };
        let moved = if decision == RebalanceVerdict::Skip { Vec::new() } else { worth };
        let shown = if decision == RebalanceVerdict::Skip { &full } else { &moved };
        RebalanceDecision {
            event: "rebalance",
            step,
            decision,
            gain_s: self.gain_s(shown),
            cost_s: self.cost_s(shown),
            full_gain_s,
            full_cost_s,
            horizon_steps: self.horizon_steps,
            step_s: self.step_s,
            imbalance_before: self.imbalance_before,
            imbalance_after: self.imbalance_after,
            transfers: shown.iter().map(|&l| self.layers[l].transfers).sum(),
            transfer_bytes: shown.iter().map(|&l| self.layers[l].bytes).sum(),
            layers: moved,
            weigh_s: None,
            not_sized: false,
        }
    }
}

/// The load monitor and the rebalance rule of the controller.
impl<S: StepRecord> Controller<S> {
    /// A step finished: the load monitor takes its expert loads (of the current epoch only),
    /// and a move's measured cost becomes the estimate of the next.
    pub(super) fn step_done(&mut self, epoch: u64, step: u64, steps: u64, loads: &[Vec<u64>], seconds: f64, moved: Option<MoveCost>) {
        if epoch == self.epoch && self.monitor.record(loads, steps, seconds) {
            self.last_step = self.last_step.max(step);
        }
        if let Some(m) = moved {
            self.monitor.learn(m);
        }
    }

    /// Every `rebalance_every` steps: ask for a plan from the measured loads to be weighed (not
    /// while workers wait to join: their move re-plans anyway; not while a weighing is out).
    /// The weighing runs beside the decisions (`Command::Weigh`: at a thousand nodes it plans a
    /// model, seconds that would hold every lease's check); its verdict comes back as
    /// `Event::Weighed`.
    pub(super) fn ask_for_a_weighing(&mut self, out: &mut Vec<Command<S>>) {
        let every = self.spec.rebalance_every;
        if !self.may_move_itself()
            || every == 0
            || self.monitor.steps_since_plan < every
            || (!self.members.standby.is_empty() && !self.joiners_ride_along())
            || self.monitor.weighing.is_some()
        {
            return;
        }
        let request = self.weighing_request();
        self.monitor.restart_steps();
        if let Some(request) = request {
            self.monitor.weighing = Some(request.epoch);
            out.push(Command::Weigh(Box::new(request)));
        }
    }

    /// A weighing came back: applied (a pause follows) if the job is still where it was weighed
    /// and may move; else it is dropped and said so — its plan was made for ranks that changed.
    pub(super) fn act_on_a_weighing(&mut self, out: &mut Vec<Command<S>>) {
        let Some(Weighed { epoch, outcome }) = self.monitor.weighed.take() else { return };
        let Some((d, target)) = outcome else { return };
        if epoch != self.epoch || !self.may_move_itself() || (!self.members.standby.is_empty() && !self.joiners_ride_along()) {
            let why = if epoch != self.epoch { "the job moved meanwhile" } else { "the job cannot move now" };
            self.note(format!("epoch {}: the rebalance weighed at step {} is dropped: {why}", self.job_epoch(self.epoch), d.step));
            return;
        }
        let apply = d.decision != RebalanceVerdict::Skip;
        self.note(format!(
            "epoch {}: rebalance at step {}: {} (gain {:.2} s, cost {:.2} s over {} steps)",
            self.job_epoch(self.epoch),
            d.step,
            d.decision,
            d.gain_s,
            d.cost_s,
            d.horizon_steps
        ));
        out.push(Command::Rebalance(d));
        if apply {
            if !self.members.standby.is_empty() {
                self.note(format!(
                    "epoch {}: workers {} waiting to join ride along",
                    self.job_epoch(self.epoch),
                    crate::words::id_list(self.members.standby.keys().copied())
                ));
            }
            self.monitor.rebalance_to = Some(target);
            self.pause(MoveCause::Rebalance, out);
        }
    }

    /// What a weighing reads, taken now (None: no loads measured, or no plan).
    pub(crate) fn weighing_request(&self) -> Option<Weighing> {
        let step_s = self.monitor.step_s().filter(|_| self.monitor.measured())?;
        Some(Weighing {
            epoch: self.epoch,
            step: self.last_step,
            loads: self.monitor.loads.clone(),
            current: self.plan.clone()?,
            position_node: self.node_order(),
            policy: self.spec.policy,
            expert_bytes: self.spec.expert_bytes,
            step_s,
            // The gain counts until the next rebalance is weighed, or the job ends.
            horizon_steps: self.spec.rebalance_every.min(self.spec.total_steps.saturating_sub(self.last_step)),
            seconds_per_byte: self.monitor.seconds_per_byte,
            fixed_s: self.monitor.move_fixed_s,
        })
    }
}

/// A rebalance to weigh, with everything the weighing reads (copied when it was asked for): the
/// plan the measured loads call for on the current nodes, against the current one.
#[derive(Debug, Clone, PartialEq)]
pub struct Weighing {
    /// The epoch it was asked at: its verdict holds only while the job is still there.
    pub epoch: u64,
    /// Steps done when it was asked.
    pub step: u64,
    /// Σ expert loads per layer since the plan was made.
    loads: Vec<Vec<f64>>,
    current: ModelPlan,
    /// The node of each plan position (plan node q runs on `position_node[q]`).
    position_node: Vec<u64>,
    policy: lazarus_plan::PlanPolicy,
    expert_bytes: u64,
    step_s: f64,
    horizon_steps: u64,
    seconds_per_byte: f64,
    fixed_s: f64,
}

/// A weighing's verdict, handed back to the controller: the decision and the plan it moves to
/// (None: nothing to plan).
#[derive(Debug, Clone, PartialEq)]
pub struct Weighed {
    pub epoch: u64,
    pub outcome: Option<(RebalanceDecision, ModelPlan)>,
}

impl Weighing {
    /// What each layer's move would gain and cost, the decision, and the plan it moves to: a
    /// pure function of the request (the shell runs it on a thread of its own).
    pub fn weigh(&self) -> Weighed {
        Weighed { epoch: self.epoch, outcome: self.decide() }
    }

    fn decide(&self) -> Option<(RebalanceDecision, ModelPlan)> {
        self.decide_sizing(false)
    }

    /// [`Weighing::decide`]; `always_size`: size the move even where its gain cannot repay its
    /// fixed part (the oracle the skip without sizing is tested against).
    pub(crate) fn decide_sizing(&self, always_size: bool) -> Option<(RebalanceDecision, ModelPlan)> {
        let current = &self.current;
        let layers = current.layers().len();
        // Past the exact search's size (a policy that keeps survivors) the running plan
        // repaired to the measured loads' allocation, else a plan made afresh.
        let origin: Vec<Option<usize>> = (0..current.shape().nodes).map(Some).collect();
        let (candidate, _) = replan_model(&self.loads, current.shape(), &self.policy, current, &origin).ok()?;
        // Past MAPPED_FROM_NODES, plan node q stays on the node at position q: no search for the
        // mapping that moves least.
        let in_place = current.shape().nodes >= MAPPED_FROM_NODES;
        // λ* of every layer now and under the candidate as planned, layers on every core (a
        // max-flow each: at 1,024 GPUs the bulk of the weighing); a layer the candidate keeps is
        // computed once. Where the nodes go does not change a λ*: if even the whole gain cannot
        // repay a move's fixed part, the move is skipped without being sized (the mapping and
        // the fetches: most of a weighing at a hundred nodes, and most weighings skip).
        let jobs: Vec<usize> = (0..layers).collect();
        let measured = &self.loads;
        let planned = lazarus_plan::parallel::map_in_order(&jobs, |&l| {
            let (now, loads) = (&current.layers()[l], &measured[l]);
            let before = now.load_balance(loads)?;
            let after = if candidate.layers()[l] == *now { before } else { candidate.layers()[l].load_balance(loads)? };
            Ok::<_, lazarus_plan::PlanError>((before, after))
        })
        .ok()?;
        if !in_place && !always_size {
            let not_sized = |l: usize| (candidate.layers()[l] != current.layers()[l], 0, 0);
            let case = self.case(&planned, not_sized);
            if case.most_gain_s() <= self.fixed_s {
                let mut d = case.decide(self.step);
                d.not_sized = true;
                return Some((d, current.clone()));
            }
        }
        // What each node holds now: its plan position's experts (positions on every core).
        let positions: Vec<(usize, u64)> = self.position_node.iter().copied().enumerate().collect();
        let Ok(held) = lazarus_plan::parallel::map_in_order(&positions, |&(q, node)| {
            let experts = current.layers().iter().map(|p| p.nodes().get(q).map(|e| distinct_sorted(e)).unwrap_or_default()).collect();
            Ok::<_, std::convert::Infallible>((node, experts))
        });
        let held: BTreeMap<u64, Vec<Vec<usize>>> = held.into_iter().collect();
        let position_node = &self.position_node;
        let bytes = self.expert_bytes;
        // The candidate with its nodes where the mapping puts them (plan position n on the node
        // now at position n): layers of it and of the current plan then mix without moving more;
        // and what each layer's move would fetch (expert states, bytes).
        let (aligned, fetches): (Vec<Placement>, Vec<(usize, u64)>) = if in_place {
            let count = fetches_in_place(&held, &candidate, position_node)?;
            (candidate.layers().to_vec(), count.into_iter().map(|c| (c, c as u64 * bytes)).collect())
        } else {
            let live: Vec<NodeState> = held.into_iter().map(|(node, experts)| NodeState { node, experts }).collect();
            let size = size_of_move(&live, candidate.layers(), &vec![bytes; layers]).ok()?;
            let plan_index: BTreeMap<u64, usize> = size.plan_to_node.iter().enumerate().map(|(q, &n)| (n, q)).collect();
            // (Mapped where they are, the candidate's layers are it, shared.)
            let kept = position_node.iter().enumerate().all(|(n, node)| plan_index.get(node) == Some(&n));
            let aligned = candidate
                .layers()
                .iter()
                .map(|p| {
                    if kept {
                        return Some(p.clone());
                    }
                    let nodes =
                        position_node.iter().map(|n| plan_index.get(n).map(|&q| p.nodes()[q].clone())).collect::<Option<Vec<_>>>()?;
                    Placement::from_nodes(p.shape(), p.experts(), nodes).ok()
                })
                .collect::<Option<_>>()?;
            let fetches = size.per_layer;
            (aligned, fetches)
        };
        // The aligned candidate's λ* (the same placements, their nodes where the mapping puts
        // them): made again only for a layer that is not the candidate's own, so that a move's
        // figures are those of the placements it moves to.
        let balances = lazarus_plan::parallel::map_in_order(&jobs, |&l| {
            let (before, after) = planned[l];
            let after = if aligned[l] == current.layers()[l] {
                before
            } else if aligned[l] == candidate.layers()[l] {
                after
            } else {
                aligned[l].load_balance(&measured[l])?
            };
            Ok::<_, lazarus_plan::PlanError>((before, after))
        })
        .ok()?;
        let case = self.case(&balances, |l| (aligned[l] != current.layers()[l], fetches[l].0, fetches[l].1));
        let mut d = case.decide(self.step);
        // The plan it moves to: the candidate's layers that move, the current plan's others.
        let mixed: Vec<Placement> =
            (0..layers).map(|l| if d.layers.contains(&l) { aligned[l].clone() } else { current.layers()[l].clone() }).collect();
        let target = ModelPlan::new(current.epoch(), mixed).ok()?;
        if d.decision == RebalanceVerdict::Shrink {
            // Each layer of the target is one weighed above (a moving layer the candidate's).
            let sum: f64 = balances
                .iter()
                .enumerate()
                .map(|(l, (before, after))| if d.layers.contains(&l) { after } else { before }.imbalance())
                .sum();
            d.imbalance_after = sum / layers.max(1) as f64;
        }
        Some((d, target))
    }

    /// The case of a move with these λ* (now, after) per layer, and per layer whether it
    /// changes, its transfers and bytes (`moves`).
    fn case(
        &self,
        balances: &[(lazarus_plan::LoadBalance, lazarus_plan::LoadBalance)],
        moves: impl Fn(usize) -> (bool, usize, u64),
    ) -> RebalanceCase {
        let mut cases = Vec::new();
        let (mut imbalance_before, mut imbalance_after) = (0.0, 0.0);
        for (l, &(before, after)) in balances.iter().enumerate() {
            imbalance_before += before.imbalance();
            imbalance_after += after.imbalance();
            let (differs, transfers, bytes) = moves(l);
            cases.push(LayerCase { differs, bottleneck_before: before.bottleneck, bottleneck_after: after.bottleneck, transfers, bytes });
        }
        let n = balances.len().max(1) as f64;
        RebalanceCase {
            step_s: self.step_s,
            horizon_steps: self.horizon_steps,
            layers: cases,
            imbalance_before: imbalance_before / n,
            imbalance_after: imbalance_after / n,
            seconds_per_byte: self.seconds_per_byte,
            fixed_s: self.fixed_s,
        }
    }
}

impl<S: StepRecord> Controller<S> {
    /// The node of each plan position (the node of ranks q·G … q·G + G − 1).
    pub(super) fn node_order(&self) -> Vec<u64> {
        self.ranks.chunks(self.spec.gpus_per_node.max(1)).map(|ws| self.node(ws[0])).collect()
    }
}

/// Expert states each layer of `candidate` would fetch with plan node q staying on the node at
/// position q (`position_node`): per node, the distinct experts its new slots hold that it does
/// not (`held`, by node). None if a position's node holds nothing on record.
fn fetches_in_place(held: &BTreeMap<u64, Vec<Vec<usize>>>, candidate: &ModelPlan, position_node: &[u64]) -> Option<Vec<usize>> {
    let mut count = vec![0usize; candidate.layers().len()];
    for (q, node) in position_node.iter().enumerate() {
        let has = held.get(node)?;
        for (l, p) in candidate.layers().iter().enumerate() {
            let held = has.get(l).map_or(&[][..], |h| h.as_slice());
            each_missing(held, p.nodes().get(q)?, |_| count[l] += 1);
        }
    }
    Some(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_monitor_adds_loads_of_its_shape_and_true_step_times_only() {
        let mut m = LoadMonitor::new(2, 3);
        assert!(!m.measured() && m.step_s().is_none());
        m.record(&[vec![1, 2, 3], vec![0, 0, 4]], 2, 1.0);
        m.record(&[vec![1, 1, 1], vec![1, 1]], 1, f64::NAN);
        assert_eq!(m.loads, vec![vec![2.0, 3.0, 4.0], vec![0.0, 0.0, 4.0]], "a layer of another shape adds nothing");
        assert_eq!(m.step_s(), Some(0.5), "a step time that cannot be true is not counted");
        m.record(&[vec![1, 1, 1]], 1, 1.0);
        assert_eq!(m.steps_since_plan, 2, "a report of another number of layers adds nothing");
        m.restart_steps();
        assert!(m.measured() && m.step_s().is_none(), "a weighing restarts the steps, not the loads");
        m.restart();
        assert!(!m.measured() && m.loads == vec![vec![0.0; 3]; 2]);
        let measured = vec![vec![2.0, 3.0, 4.0], vec![0.0, 0.0, 4.0]];
        assert_eq!(m.plan_loads(), Some(&measured), "a plan that measured nothing yet is made from the loads before it");
        m.restart();
        assert_eq!(m.plan_loads(), Some(&measured), "and still after a move that measured nothing");
        m.record(&[vec![0, 0, 1], vec![1, 0, 0]], 1, 1.0);
        m.restart();
        assert_eq!(m.plan_loads(), Some(&vec![vec![0.0, 0.0, 1.0], vec![1.0, 0.0, 0.0]]), "the latest measured");
        assert_eq!(LoadMonitor::new(2, 3).plan_loads(), None);
    }

    #[test]
    fn a_measured_move_is_the_next_ones_estimate_unless_it_cannot_be_true() {
        let mut m = LoadMonitor::new(1, 1);
        let cost = |bytes, transfer_s, rebuild_s| MoveCost { bytes, transfer_s, rebuild_s };
        m.learn(cost(0, 1.0, 0.2));
        m.learn(cost(100, f64::INFINITY, 0.2));
        assert_eq!((m.seconds_per_byte, m.move_fixed_s), (DEFAULT_SECONDS_PER_BYTE, DEFAULT_MOVE_FIXED_S));
        m.learn(cost(1000, 2.0, -1.0));
        assert_eq!((m.seconds_per_byte, m.move_fixed_s), (0.002, DEFAULT_MOVE_FIXED_S), "a rebuild time below 0 is not taken");
        m.learn(cost(1000, 1.0, 0.3));
        assert_eq!((m.seconds_per_byte, m.move_fixed_s), (0.001, 0.3));
    }

    /// Counting a candidate's fetches with its nodes where they are gives, layer by layer, the
    /// transfers the move planner schedules for that mapping (its oracle here).
    #[test]
    fn fetches_in_place_are_the_transfers_of_the_mapped_move() {
        use lazarus_plan::{plan_model, plan_reconfiguration_mapped, ClusterShape, PlanPolicy};
        let mut fetched = 0;
        for seed in 0..20u64 {
            let loads = |shift: u64| -> Vec<Vec<f64>> {
                (0..3).map(|l| (0..8).map(|e| 1.0 + ((e as u64 * 7 + l * 3 + shift) % 8) as f64 * 10.0).collect()).collect()
            };
            let shape = ClusterShape::new(5, 2, 2).unwrap();
            let policy = PlanPolicy::trainer(5, None);
            let current = plan_model(&loads(0), shape, &policy, None).unwrap();
            let candidate = plan_model(&loads(seed + 1), shape, &policy, Some(&current)).unwrap();
            // Node ids out of position order, as a job's are after moves.
            let position_node: Vec<u64> = (0..5).map(|q| (q * 3 + seed) % 5 + 100).collect();
            let mut held: BTreeMap<u64, Vec<Vec<usize>>> = BTreeMap::new();
            for (q, &n) in position_node.iter().enumerate() {
                held.insert(n, current.layers().iter().map(|p| p.nodes()[q].clone()).collect());
            }
            let live: Vec<NodeState> = held.iter().map(|(&node, experts)| NodeState { node, experts: experts.clone() }).collect();
            let node_to_plan: Vec<usize> = live.iter().map(|s| position_node.iter().position(|&n| n == s.node).unwrap()).collect();
            let rp = plan_reconfiguration_mapped(&live, candidate.layers(), &[1, 1, 1], &node_to_plan).unwrap();
            let want: Vec<usize> = (0..3).map(|l| rp.transfers.iter().filter(|t| t.layer == l).count()).collect();
            fetched += want.iter().sum::<usize>();
            assert_eq!(fetches_in_place(&held, &candidate, &position_node), Some(want), "seed {seed}");
        }
        assert!(fetched > 0, "some candidate moves something");
    }

    /// Two layers: the first carries the whole imbalance (150 → 100 tokens on its busiest GPU),
    /// the second is balanced already (100 → 99) but its candidate moves as much.
    fn case() -> RebalanceCase {
        let layer =
            |before, after| LayerCase { differs: true, bottleneck_before: before, bottleneck_after: after, transfers: 2, bytes: 2_000_000 };
        RebalanceCase {
            step_s: 0.5,
            horizon_steps: 200,
            layers: vec![layer(150.0, 100.0), layer(100.0, 99.0)],
            imbalance_before: 1.25,
            imbalance_after: 1.0,
            seconds_per_byte: 1e-8,
            fixed_s: 0.2,
        }
    }

    #[test]
    fn a_rebalance_whose_every_layer_repays_its_move_is_applied() {
        let c = RebalanceCase { seconds_per_byte: 1e-9, ..case() };
        // 51 of 250 tokens less on the busiest GPUs: 0.5 × 51/250 s a step over 200 steps.
        assert!((c.gain_s(&[0, 1]) - 200.0 * 0.5 * 51.0 / 250.0).abs() < 1e-9);
        assert!((c.cost_s(&[0, 1]) - 0.204).abs() < 1e-12);
        let d = c.decide(400);
        assert_eq!((d.decision, d.step, d.transfers, d.layers.clone()), (RebalanceVerdict::Apply, 400, 4, vec![0, 1]), "{d:?}");
        assert_eq!((d.gain_s, d.cost_s), (d.full_gain_s, d.full_cost_s));
    }

    #[test]
    fn a_layer_that_does_not_repay_its_own_move_is_left_where_it_is() {
        // Layer 1 saves 0.5 × 1/250 s a step, 0.4 s over 200 steps; its 2 MB at 2 MB/s take 1 s:
        // not worth it, while layer 0 (20 s saved for 1 s) is.
        let c = RebalanceCase { seconds_per_byte: 5e-7, ..case() };
        let d = c.decide(400);
        assert_eq!(
            (d.decision, d.layers.clone(), d.transfers, d.transfer_bytes),
            (RebalanceVerdict::Shrink, vec![0], 2, 2_000_000),
            "{d:?}"
        );
        assert!((d.gain_s - 20.0).abs() < 1e-9 && (d.cost_s - 1.2).abs() < 1e-9, "{d:?}");
        assert!(d.full_gain_s > d.gain_s && d.full_cost_s > d.cost_s);
        assert!(d.gain_s - d.cost_s > d.full_gain_s - d.full_cost_s, "the shrunk move saves more: {d:?}");
    }

    #[test]
    fn a_rebalance_that_does_not_repay_or_moves_nothing_is_skipped() {
        // Slow transfers: 40 MB/s would take 100 s for 4 GB.
        let layer = |before, after| LayerCase {
            differs: true,
            bottleneck_before: before,
            bottleneck_after: after,
            transfers: 2,
            bytes: 2_000_000_000,
        };
        let slow = RebalanceCase { layers: vec![layer(150.0, 100.0), layer(100.0, 99.0)], seconds_per_byte: 2.5e-8, ..case() };
        let d = slow.decide(400);
        assert_eq!((d.decision, d.layers.len()), (RebalanceVerdict::Skip, 0));
        // A skip reports the whole candidate.
        assert_eq!((d.gain_s, d.cost_s, d.transfers), (d.full_gain_s, d.full_cost_s, 4));
        // A candidate no better than the current plan gains nothing.
        let same = RebalanceCase { layers: vec![layer(150.0, 150.0)], ..case() };
        assert_eq!(same.gain_s(&[0]), 0.0);
        assert_eq!(same.decide(400).decision, RebalanceVerdict::Skip);
        let worse = RebalanceCase { layers: vec![layer(150.0, 200.0)], ..case() };
        assert_eq!(worse.gain_s(&[0]), 0.0);
        // Nothing to move: nothing to apply, whatever the figures say.
        let still = RebalanceCase { layers: vec![LayerCase { differs: false, transfers: 0, bytes: 0, ..case().layers[0] }], ..case() };
        assert_eq!(still.decide(400).decision, RebalanceVerdict::Skip);
        // Copies inside nodes only: no bytes, but the pause is paid — moved if the gain repays it.
        let local = RebalanceCase { layers: vec![LayerCase { transfers: 0, bytes: 0, ..case().layers[0] }], ..case() };
        assert_eq!(local.decide(400).decision, RebalanceVerdict::Apply);
        assert_eq!(RebalanceCase { fixed_s: 100.0, ..local }.decide(400).decision, RebalanceVerdict::Skip);
        // No loads measured: no gain.
        let idle = RebalanceCase { layers: vec![LayerCase { bottleneck_before: 0.0, ..case().layers[0] }], ..case() };
        assert_eq!(idle.gain_s(&[0]), 0.0);
        // Layers that each repay their bytes but not, together, the fixed cost: skipped.
        let tiny = RebalanceCase { horizon_steps: 1, fixed_s: 10.0, ..case() };
        assert_eq!(tiny.decide(400).decision, RebalanceVerdict::Skip);
    }
}
