//! Recovery: once every survivor said where it stopped (after a loss, or a pause the
//! controller asked for), the job moves to a new epoch in named steps — the step everyone
//! commits to; the experts that come back from snapshots; the survivors' plan; and the move
//! that keeps every expert's state, or else the rollback to the last checkpoint.

use std::collections::BTreeMap;

use lazarus_plan::{
    plan_reconfiguration, plan_reconfiguration_mapped, rank_transfers, replan_model, ClusterShape, ModelPlan, Move, NodeState,
};

use super::{Command, Controller, MoveCause, MoveDecision, NodeId, Phase, RestoredExpert, StepRecord, StopReason, StopReport};

/// The job as recovery sees it: who survives, who comes in and who leaves, and where each
/// stopped.
struct Survivors<S> {
    cause: MoveCause,
    /// Every survivor's report, and an empty one for each joiner.
    reports: BTreeMap<NodeId, StopReport<S>>,
    /// Members alive now (leavers included).
    alive: Vec<NodeId>,
    /// Workers waiting to join: they come in with this move, holding nothing yet.
    joiners: Vec<NodeId>,
    /// Workers of a node leaving on notice: they send what only they hold, then go.
    leavers: Vec<NodeId>,
    /// The nodes of the new plan, each with its workers.
    nodes: BTreeMap<u64, Vec<NodeId>>,
    /// The step every survivor commits to.
    furthest: u64,
}

impl<S: StepRecord> Controller<S> {
    /// A survivor's step failed, or it paused as asked: where it stopped. A report from an epoch
    /// the node was not told to be in is stale and ignored.
    pub(super) fn worker_stopped(&mut self, now: std::time::Instant, node: NodeId, epoch: u64, report: StopReport<S>, how: StopCause) {
        self.members.last_seen.insert(node, now);
        // A job taken back also hears reports of the epoch before the saved one (the old
        // controller was lost after it saved a move, before every worker heard of it).
        let of_its_epoch = self.node_epoch.get(&node) == Some(&epoch) || (self.takeover.resuming && epoch <= self.epoch);
        if !self.members.alive.contains(&node) || !of_its_epoch {
            return;
        }
        if !self.recovers() {
            // Without recovery a rank that stopped is at its end (it is killed with the job).
            return self.lose(node, &format!("stopped at step {}", report.steps_done));
        }
        if !matches!(self.phase, Phase::Collecting { .. }) {
            let verb = match how {
                StopCause::Failed => "stopped",
                StopCause::Paused => "paused",
            };
            self.note(format!("epoch {}: worker {node} {verb} at step {}", self.job_epoch(epoch), report.steps_done));
            self.phase = Phase::Collecting { reports: BTreeMap::new() };
        }
        let report = self.sanitized(report);
        if let Phase::Collecting { reports } = &mut self.phase {
            reports.insert(node, report);
        }
    }

    /// Once every survivor has said where it stopped: the new plan, or a rollback, or a stop.
    pub(super) fn choose_move(&mut self, out: &mut Vec<Command<S>>) {
        let Phase::Collecting { reports } = &mut self.phase else { return };
        // (The count first: one report in, of a thousand workers, is not a reason to look at all.)
        if reports.len() < self.members.alive.len() || self.members.alive.iter().any(|n| !reports.contains_key(n)) {
            return;
        }
        // Every way on from here leaves collecting (a move, a rollback or a stop).
        let reports = std::mem::take(reports);
        // With every node lost, workers waiting to join still carry the job on: from the last
        // checkpoint (a rollback below: no expert survives).
        if self.members.alive.is_empty() && self.members.standby.is_empty() {
            return self.stop(StopReason::EveryNodeLost, out);
        }
        let mut s = match self.survivors(reports, out) {
            Ok(s) => s,
            Err(reason) => return self.stop(reason, out),
        };
        let epoch = self.epoch + 1;
        let g = self.spec.gpus_per_node.max(1);
        let shape = match ClusterShape::new(s.nodes.len(), g, self.spec.slots_per_node / g) {
            Ok(shape) => shape,
            Err(e) => return self.stop(StopReason::CannotPlan(e.to_string()), out),
        };
        let consistent =
            s.reports.values().all(|r| r.steps_done == s.furthest || (r.steps_done + 1 == s.furthest && r.held == Some(s.furthest)));
        let restored = self.restore_from_snapshots(&mut s);
        let (new, order) = match self.survivors_plan(&s, shape) {
            Ok((p, order)) => (p.with_epoch(epoch), order),
            Err(e) => return self.stop(StopReason::CannotPlan(e.to_string()), out),
        };
        if consistent {
            if let Some(restored) = restored {
                if let Some(m) = self.move_with_every_state(&s, &new, order.as_deref(), restored) {
                    self.note_move(&m, s.nodes.len());
                    // A drain's hand-over (it holds after it) and its leaving are one move.
                    self.reconfigurations += u64::from(!m.change.hold);
                    self.moves_for_others += u64::from(!m.change.hold && m.cause != MoveCause::Join);
                    self.adopt(new, m.ranks.clone());
                    out.push(Command::Reconfigure(m));
                    return free_reports(s);
                }
            }
        }
        self.roll_back(&s, new, out);
        free_reports(s);
    }

    /// Who survives, who comes in and who leaves; the step all commit to (and the commit the
    /// log lacks, if a survivor has it); the survivors' nodes, whole. Err: why the job cannot
    /// go on.
    fn survivors(&mut self, mut reports: BTreeMap<NodeId, StopReport<S>>, out: &mut Vec<Command<S>>) -> Result<Survivors<S>, StopReason> {
        let alive: Vec<NodeId> = self.members.alive.iter().copied().collect();
        let cause = self.planned.take().unwrap_or(if self.takeover.taken_back { MoveCause::Controller } else { MoveCause::Failure });
        let joiners: Vec<NodeId> = self.members.standby.keys().copied().collect();
        let furthest = self.commit_step(&reports, out);
        for &w in &joiners {
            reports.insert(
                w,
                StopReport { steps_done: furthest, held: None, holds: vec![Vec::new(); self.spec.layers], last: None, snapshots: vec![] },
            );
        }
        let leavers: Vec<NodeId> = if cause == MoveCause::Drain {
            alive.iter().copied().filter(|w| self.members.draining.contains(w)).collect()
        } else {
            Vec::new()
        };
        let members: Vec<NodeId> = alive.iter().chain(&joiners).copied().filter(|w| !leavers.contains(w)).collect();
        let g = self.spec.gpus_per_node.max(1);
        let slots = members.len() * (self.spec.slots_per_node / g);
        if slots < self.spec.experts {
            // What a user resumes from (with more nodes) once this job stops: the last checkpoint.
            return Err(StopReason::TooFewSlots { workers: members.len(), slots, experts: self.spec.experts, checkpoint: self.checkpoint });
        }
        // The surviving nodes, each with its workers (whole nodes: see `lose_whole_nodes`).
        let mut nodes: BTreeMap<u64, Vec<NodeId>> = BTreeMap::new();
        for &w in &members {
            nodes.entry(self.node(w)).or_default().push(w);
        }
        if nodes.values().any(|ws| ws.len() != g) {
            return Err(StopReason::PartialNode { gpus_per_node: g });
        }
        Ok(Survivors { cause, reports, alive, joiners, leavers, nodes, furthest })
    }

    /// The step every survivor commits to: the furthest any committed, or one further when rank
    /// 0 already logged a step every survivor computed but none committed (their vote failed
    /// after rank 0 got through it: it is done, or it would be run and logged twice). When
    /// survivors committed a step rank 0 never reported (lost after the vote, before its report
    /// got out), one of them has its global report: the log gets it from there.
    fn commit_step(&mut self, reports: &BTreeMap<NodeId, StopReport<S>>, out: &mut Vec<Command<S>>) -> u64 {
        let mut furthest = reports.values().map(|r| r.steps_done).max().unwrap_or(0);
        let next = furthest + 1;
        if self.last_step == next && reports.values().all(|r| r.steps_done == next || r.held == Some(next)) {
            furthest = next;
        }
        if furthest == self.last_step + 1 {
            let copy = reports.values().filter_map(|r| r.last.as_ref()).find(|c| c.step() == furthest && c.is_sound());
            if let Some(c) = copy {
                out.push(Command::LogStep(c.clone()));
                self.last_step = furthest;
            }
        }
        furthest
    }

    /// Every expert with no replica left on a survivor (by what they say they hold) comes back
    /// from the freshest snapshot a survivor keeps (MoEtion §6, PEC §3), held from then on by
    /// that survivor (it sends it from there). None: some expert has neither.
    fn restore_from_snapshots(&self, s: &mut Survivors<S>) -> Option<Vec<RestoredExpert>> {
        let mut restored: Vec<RestoredExpert> = Vec::new();
        // What some survivor holds, by (layer, expert): one pass over the reports.
        let mut held = vec![false; self.spec.layers * self.spec.experts];
        for n in &s.alive {
            for (l, experts) in s.reports[n].holds.iter().enumerate() {
                for &e in experts {
                    held[l * self.spec.experts + e] = true;
                }
            }
        }
        for l in 0..self.spec.layers {
            for e in 0..self.spec.experts {
                if held[l * self.spec.experts + e] {
                    continue;
                }
                let freshest = s
                    .alive
                    .iter()
                    .flat_map(|&n| s.reports[&n].snapshots.iter().filter(|x| x.layer == l && x.expert == e).map(move |x| (n, *x)))
                    .filter(|(_, x)| x.step <= s.furthest)
                    .max_by_key(|(n, x)| (x.step, std::cmp::Reverse(*n)))?;
                let (holder, x) = freshest;
                let held_step_lost = if s.reports[&holder].steps_done < s.furthest { x.held_step_tokens } else { 0 };
                restored.push(RestoredExpert {
                    layer: l,
                    expert: e,
                    from_step: x.step,
                    stale_steps: s.furthest - x.step,
                    tokens_lost: x.tokens_lost.saturating_add(held_step_lost),
                    holder,
                });
            }
        }
        for x in &restored {
            if let Some(r) = s.reports.get_mut(&x.holder) {
                r.holds[x.layer].push(x.expert);
                r.holds[x.layer].sort_unstable();
            }
        }
        Some(restored)
    }

    /// The plan of the new epoch: the second half of a drain keeps the plan its first half moved
    /// the job to; an applied rebalance moves to the plan it weighed (if nothing changed
    /// since); anything else is planned again from the measured loads — on a large cluster by
    /// repairing the running plan (`replan_model`), and then with the nodes in a known order:
    /// the physical node of each plan node, returned beside the plan.
    fn survivors_plan(&mut self, s: &Survivors<S>, shape: ClusterShape) -> Result<(ModelPlan, Option<Vec<u64>>), lazarus_plan::PlanError> {
        // Only a job with a placement recovers (`recovers`): it has one to re-plan from.
        let Some(current) = &self.plan else {
            return Err(lazarus_plan::PlanError::Invalid {
                field: "plan",
                value: "none".into(),
                reason: "a job without a placement cannot be re-planned".into(),
            });
        };
        // (The running plan is read, not copied: at 1,024 nodes a copy is 1.9 M entries.)
        let previous = current;
        let weighed =
            self.monitor.rebalance_to.take().filter(|p| s.cause == MoveCause::Rebalance && s.joiners.is_empty() && p.shape() == shape);
        let nobody_moves = s.leavers.is_empty() && s.joiners.is_empty();
        // A job taken back by a new controller keeps its plan if every member came back.
        if matches!(s.cause, MoveCause::Drain | MoveCause::Controller) && nobody_moves && previous.shape() == shape {
            return Ok((previous.clone(), None));
        }
        if let Some(p) = weighed {
            // Weighed with its nodes where they are (a large cluster): the move keeps them so.
            let kept = p.shape().nodes >= super::rebalance::MAPPED_FROM_NODES;
            return Ok((p, kept.then(|| self.node_order())));
        }
        // The survivors in their places in the running plan, then the nodes that join.
        let g = self.spec.gpus_per_node.max(1);
        let was: Vec<u64> = (0..previous.shape().nodes).filter_map(|q| self.ranks.get(q * g).map(|&w| self.node(w))).collect();
        let was_at: BTreeMap<u64, usize> = was.iter().enumerate().map(|(q, &n)| (n, q)).collect();
        let mut order: Vec<u64> = was.iter().copied().filter(|n| s.nodes.contains_key(n)).collect();
        order.extend(s.nodes.keys().copied().filter(|n| !was_at.contains_key(n)));
        let origin: Vec<Option<usize>> = order.iter().map(|n| was_at.get(n).copied()).collect();
        let (plan, in_order) = replan_model(&self.plan_loads(), shape, &self.spec.policy, previous, &origin)?;
        Ok((plan, in_order.then_some(order)))
    }

    /// The move to `new` that keeps every expert's state: the node mapping and the transfers
    /// (experts only the leavers hold are sent by them). None: some expert's state would be
    /// lost, or the transfers cannot be assigned to ranks.
    fn move_with_every_state(
        &self,
        s: &Survivors<S>,
        new: &ModelPlan,
        order: Option<&[u64]>,
        restored: Vec<RestoredExpert>,
    ) -> Option<MoveDecision> {
        // What each node holds (its workers' experts), nodes on every core.
        let nodes: Vec<(u64, Vec<&[Vec<usize>]>)> =
            s.nodes.iter().map(|(&node, ws)| (node, ws.iter().map(|w| s.reports[w].holds.as_slice()).collect())).collect();
        let (layers, experts) = (self.spec.layers, self.spec.experts);
        let node_state = |(node, holds): &(u64, Vec<&[Vec<usize>]>)| -> Result<NodeState, std::convert::Infallible> {
            Ok(NodeState { node: *node, experts: union_of_holdings(holds, layers, experts) })
        };
        let Ok(live) = lazarus_plan::parallel::map_in_order(&nodes, node_state);
        let bytes = vec![self.spec.expert_bytes; self.spec.layers];
        let rp = match order {
            Some(order) => {
                let at: BTreeMap<u64, usize> = order.iter().enumerate().map(|(q, &n)| (n, q)).collect();
                let node_to_plan: Vec<usize> = live.iter().map(|x| at.get(&x.node).copied()).collect::<Option<_>>()?;
                plan_reconfiguration_mapped(&live, new.layers(), &bytes, &node_to_plan).ok()?
            }
            None => plan_reconfiguration(&live, new.layers(), &bytes).ok()?,
        };
        // Rank q·G + i of the new plan is the i-th worker of the node that takes plan node q;
        // the leaving workers come after, with nothing of the plan.
        let ranks: Vec<NodeId> = rp.plan_to_node.iter().flat_map(|n| s.nodes[n].iter().copied()).chain(s.leavers.clone()).collect();
        let rank_node: Vec<u64> = ranks.iter().map(|&w| self.node(w)).collect();
        let rank_holds: Vec<&[Vec<usize>]> = ranks.iter().map(|w| s.reports[w].holds.as_slice()).collect();
        let map = new.replica_map().with_empty_ranks(s.leavers.len());
        let lost_for_good = rp.lost.iter().any(|&(l, e)| !s.leavers.iter().any(|w| s.reports[w].holds[l].contains(&e)));
        if lost_for_good {
            return None;
        }
        let transfers = rank_transfers(&rank_node, &rank_holds, &map, &rp.transfers)?;
        let joining = (0..ranks.len()).filter(|&r| self.members.standby.contains_key(&ranks[r])).collect();
        let leaving: Vec<usize> = (ranks.len() - s.leavers.len()..ranks.len()).collect();
        lazarus_plan::parallel::drop_elsewhere(live, nodes.len() > FREE_ELSEWHERE_FROM);
        let rollback_avoided = if restored.is_empty() { 0 } else { s.furthest - self.checkpoint.unwrap_or(0) };
        let catch_up = restored.iter().filter(|x| x.tokens_lost > 0).map(|x| (x.layer, x.expert, x.tokens_lost)).collect();
        let change = Move { catch_up, joining, hold: !leaving.is_empty(), leaving, ..Move::new(new.epoch(), map, transfers) };
        Some(MoveDecision { ranks, change, commit_to: s.furthest, cause: s.cause, restored, rollback_avoided })
    }

    fn note_move(&mut self, m: &MoveDecision, nodes: usize) {
        let epoch = self.job_epoch(m.change.epoch);
        self.note(format!(
            "epoch {epoch}: {} to {nodes} nodes at step {}, {} expert transfers",
            m.cause,
            m.commit_to,
            m.change.transfers.len()
        ));
        for x in &m.restored {
            self.note(format!(
                "epoch {epoch}: layer {} expert {} lost every replica: restored from its snapshot of step {} in worker {}'s memory ({} steps stale, {} tokens lost; a rollback would have re-run {} steps)",
                x.layer, x.expert, x.from_step, x.holder, x.stale_steps, x.tokens_lost, m.rollback_avoided
            ));
        }
    }

    /// An expert lost every replica and snapshot (or the survivors disagree on where they
    /// stopped): every survivor reloads the last checkpoint under the new plan, and the steps
    /// after it are undone (the log is cut back to it as well).
    fn roll_back(&mut self, s: &Survivors<S>, new: ModelPlan, out: &mut Vec<Command<S>>) {
        let to_step = self.checkpoint;
        self.last_step = to_step.unwrap_or(0);
        let ranks: Vec<NodeId> = s.nodes.values().flatten().copied().collect();
        let m = MoveDecision {
            ranks: ranks.clone(),
            change: Move::new(new.epoch(), new.replica_map(), Vec::new()),
            commit_to: s.furthest,
            cause: MoveCause::Rollback,
            restored: Vec::new(),
            rollback_avoided: 0,
        };
        self.note(format!(
            "epoch {}: an expert lost every replica; roll back to {}",
            self.job_epoch(m.change.epoch),
            to_step.map_or("the start".into(), |s| format!("step {s}"))
        ));
        self.reconfigurations += 1;
        self.adopt(new, ranks);
        out.push(Command::Rollback { to: m, to_step });
    }

    /// A report's holdings as far as they fit the job (a peer's word is checked: experts out of
    /// range, and layers beyond the job's, are dropped; a missing layer holds nothing).
    fn sanitized(&self, mut report: StopReport<S>) -> StopReport<S> {
        report.holds.resize(self.spec.layers, Vec::new());
        report.snapshots.retain(|x| x.layer < self.spec.layers && x.expert < self.spec.experts);
        for l in &mut report.holds {
            // (Workers report their holdings sorted, each once: checked, not redone.)
            if !l.is_sorted_by(|a, b| a < b) || l.last().is_some_and(|&e| e >= self.spec.experts) {
                l.retain(|&e| e < self.spec.experts);
                l.sort_unstable();
                l.dedup();
            }
        }
        report
    }

    /// Loads to plan from: those measured ([`LoadMonitor::plan_loads`]), or even loads
    /// before any.
    ///
    /// [`LoadMonitor::plan_loads`]: super::rebalance::LoadMonitor::plan_loads
    fn plan_loads(&self) -> Vec<Vec<f64>> {
        match self.monitor.plan_loads() {
            Some(loads) => loads.clone(),
            None => vec![vec![1.0; self.spec.experts]; self.spec.layers],
        }
    }
}

/// The experts a node's workers hold, per layer, sorted and each once: a bit per expert, one
/// allocation per layer (at 1,024 nodes × 58 layers growing and sorting vectors was ~18 ms of a
/// node loss's decision). Experts are below `experts` (reports are sanitized).
fn union_of_holdings(workers: &[&[Vec<usize>]], layers: usize, experts: usize) -> Vec<Vec<usize>> {
    let mut bits = vec![0u64; experts.div_ceil(64)];
    (0..layers)
        .map(|l| {
            bits.fill(0);
            for &e in workers.iter().filter_map(|w| w.get(l)).flatten() {
                if let Some(word) = bits.get_mut(e / 64) {
                    *word |= 1 << (e % 64);
                }
            }
            let mut held = Vec::with_capacity(bits.iter().map(|w| w.count_ones() as usize).sum());
            for (i, &w) in bits.iter().enumerate() {
                let mut w = w;
                while w != 0 {
                    held.push(i * 64 + w.trailing_zeros() as usize);
                    w &= w - 1;
                }
            }
            held
        })
        .collect()
}

/// Past this many nodes (or workers) what a recovery leaves behind is freed on a thread of its
/// own; a smaller job's is freed at once (a thread would cost more than the freeing).
const FREE_ELSEWHERE_FROM: usize = 256;

/// A recovery's reports are freed off the decision's path (see `drop_elsewhere`).
fn free_reports<S>(s: Survivors<S>) {
    let holds: Vec<Vec<Vec<usize>>> = s.reports.into_values().map(|r| r.holds).collect();
    let large = holds.len() > FREE_ELSEWHERE_FROM;
    lazarus_plan::parallel::drop_elsewhere(holds, large);
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    proptest! {
        /// The bitwise union is the plain one: every worker's experts of a layer, sorted, once.
        #[test]
        fn the_union_of_holdings_is_the_sorted_set_of_what_the_workers_hold(
            workers in prop::collection::vec(prop::collection::vec(prop::collection::vec(0usize..130, 0..6), 0..4), 1..5),
        ) {
            let layers = 4;
            let views: Vec<&[Vec<usize>]> = workers.iter().map(Vec::as_slice).collect();
            let got = super::union_of_holdings(&views, layers, 130);
            for (l, held) in got.iter().enumerate() {
                let mut want: Vec<usize> = workers.iter().filter_map(|w| w.get(l)).flatten().copied().collect();
                want.sort_unstable();
                want.dedup();
                prop_assert_eq!(held, &want);
            }
            prop_assert_eq!(got.len(), layers);
        }
    }
}

/// How a survivor came to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StopCause {
    /// Its step (or its move) failed.
    Failed,
    /// It paused after a step, as the controller asked.
    Paused,
}
