//! Membership and leases: who is in the job, who waits to join, who leaves on notice, and who
//! is lost. A node (G workers) is the unit of failure: a worker lost takes the other workers of
//! its node with it, so that plans always have whole nodes.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::{Command, Controller, Event, JoinRule, MoveCause, NodeId, Phase, StepRecord};

/// How long a worker may take to say its first word, at most (its lease if longer; never past
/// the start deadline): its spec has to reach it first ([`Controller::lease_of`]).
pub const FIRST_WORD_WITHIN: Duration = Duration::from_secs(30);

/// Who is in the job, who waits to join, who leaves on notice, and when each was last heard:
/// the membership room's state. Its own rules (leases, joins, losses) read and change only
/// this; what a loss does to the job is the controller's.
#[derive(Debug, Clone)]
pub(crate) struct Members {
    pub(crate) alive: BTreeSet<NodeId>,
    pub(crate) last_seen: BTreeMap<NodeId, Instant>,
    /// The node of each worker (its position among the first workers, divided by G).
    pub(crate) node_of: BTreeMap<NodeId, u64>,
    /// Workers that joined and wait to be taken in, with when they joined.
    pub(crate) standby: BTreeMap<NodeId, Instant>,
    /// Workers whose node leaves on notice, until they are gone.
    pub(crate) draining: BTreeSet<NodeId>,
    /// Workers that left after their node's drain (sent what they alone held).
    pub(crate) drained: BTreeSet<NodeId>,
    /// Members lost in the decision being made (told to the survivors at its end).
    pub(crate) lost_now: Vec<NodeId>,
    /// No lease runs out before this (a lower bound: heartbeats only push deadlines later), so
    /// that an event need not look at every member's lease.
    pub(crate) leases_checked_until: Option<Instant>,
    /// Members heard from since the job began (a member not heard from yet is starting).
    pub(crate) heard: BTreeSet<NodeId>,
    /// When `decide` last ran (a longer gap than half a lease is a stall of the controller).
    pub(crate) last_decision: Option<Instant>,
}

impl Members {
    /// The workers of a job's start, all heard of `now`; G consecutive workers are a node.
    pub(crate) fn new(workers: &[NodeId], gpus_per_node: usize, now: Instant) -> Self {
        let g = gpus_per_node.max(1);
        Members {
            alive: workers.iter().copied().collect(),
            last_seen: workers.iter().map(|&w| (w, now)).collect(),
            node_of: workers.iter().enumerate().map(|(i, &w)| (w, (i / g) as u64)).collect(),
            standby: BTreeMap::new(),
            draining: BTreeSet::new(),
            drained: BTreeSet::new(),
            lost_now: Vec::new(),
            leases_checked_until: None,
            heard: BTreeSet::new(),
            last_decision: None,
        }
    }

    /// A member or a worker standing by: someone whose heartbeats count.
    pub(crate) fn is_known(&self, worker: NodeId) -> bool {
        self.alive.contains(&worker) || self.standby.contains_key(&worker)
    }

    /// `worker` was heard `now` (nothing if the job does not know it: a lost worker's last
    /// words do not bring it back).
    pub(crate) fn saw(&mut self, worker: NodeId, now: Instant) {
        if self.is_known(worker) {
            self.last_seen.insert(worker, now);
        }
    }

    /// `decide` runs `now`: the gap since it last ran, if it is longer than `half_lease` (a
    /// stall of the controller, in which it heard nothing), is added to every silence.
    pub(crate) fn stalled_for(&mut self, now: Instant, half_lease: Duration) -> Option<Duration> {
        let gap = self.last_decision.map(|prev| now.saturating_duration_since(prev)).filter(|&gap| gap > half_lease);
        if let Some(gap) = gap {
            self.last_seen.values_mut().for_each(|t| *t += gap);
        }
        self.last_decision = Some(self.last_decision.map_or(now, |p| p.max(now)));
        gap
    }

    /// New workers stand by as one new node, heard `now`; returns them and their node (ids
    /// seen before are left out: a worker joins once).
    pub(crate) fn join(&mut self, workers: Vec<NodeId>, now: Instant) -> Option<(u64, Vec<NodeId>)> {
        let fresh: Vec<NodeId> = workers.into_iter().filter(|w| !self.last_seen.contains_key(w)).collect();
        if fresh.is_empty() {
            return None;
        }
        let node = self.node_of.values().max().map_or(0, |&n| n + 1);
        for &w in &fresh {
            self.node_of.insert(w, node);
            self.last_seen.insert(w, now);
            self.standby.insert(w, now);
        }
        Some((node, fresh))
    }

    /// A member is gone (it exited, missed its lease, or went with its node).
    pub(crate) fn lose(&mut self, worker: NodeId) {
        self.alive.remove(&worker);
        self.lost_now.push(worker);
        self.draining.remove(&worker);
    }

    /// A drained member left, as its node's notice said it would.
    pub(crate) fn leave(&mut self, worker: NodeId) {
        self.alive.remove(&worker);
        self.draining.remove(&worker);
        self.drained.insert(worker);
    }
}

/// What a worker is to the job, as `lazarus status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberState {
    /// Has a rank of the current epoch, and has not been heard from yet (its process or its
    /// agent is still starting).
    Starting,
    /// Has a rank of the current epoch.
    Member,
    /// Joined and waits to be taken in at a step boundary.
    Standby,
    /// Its node gave notice: the job moves off it.
    Leaving,
    /// Left the job after its node's drain: it sent what it alone held.
    Drained,
    /// Exited, missed its lease, or went with another worker of its node.
    Lost,
}

impl MemberState {
    pub fn as_str(self) -> &'static str {
        match self {
            MemberState::Starting => "starting",
            MemberState::Member => "member",
            MemberState::Standby => "standby",
            MemberState::Leaving => "leaving",
            MemberState::Drained => "drained",
            MemberState::Lost => "lost",
        }
    }
}

displayed_as_str!(MemberState);

impl<S: StepRecord> Controller<S> {
    /// What `worker` is to the job.
    pub fn member_state(&self, worker: NodeId) -> MemberState {
        if self.members.standby.contains_key(&worker) {
            MemberState::Standby
        } else if self.members.drained.contains(&worker) {
            MemberState::Drained
        } else if !self.members.alive.contains(&worker) {
            MemberState::Lost
        } else if self.members.draining.contains(&worker) {
            MemberState::Leaving
        } else if !self.members.heard.contains(&worker) {
            MemberState::Starting
        } else {
            MemberState::Member
        }
    }

    /// A worker's own word (not its exit, which others report) means it runs.
    pub(super) fn note_heard(&mut self, event: &Event<S>) {
        let Some(node) = heard_from(event) else { return };
        if self.members.is_known(node) && self.members.heard.insert(node) {
            // Its lease is its own now, no longer the first word's: it may end sooner. (Only
            // the bound comes down: looking at every lease again on each first word made a
            // thousand nodes' start quadratic — 7 s of the controller's time at 8,192 workers.)
            if let Some(&seen) = self.members.last_seen.get(&node) {
                self.lease_may_end_at(seen + self.spec.lease);
            }
        }
    }

    /// Workers that joined and wait to be taken in.
    pub fn standby(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.members.standby.keys().copied()
    }

    /// Whether `worker` has a rank of the current epoch beyond the plan's: a drained worker
    /// that sent what it alone held and now leaves.
    pub(super) fn is_leaver(&self, worker: NodeId) -> bool {
        let Some(plan) = &self.plan else { return false };
        self.rank(worker).is_some_and(|i| i >= plan.shape().ranks())
    }

    /// When the workers waiting to join are due to be taken in (None: none wait); the wait is
    /// weighed as of the earliest arrival.
    pub(super) fn join_due(&self) -> Option<Instant> {
        let first = *self.members.standby.values().min()?;
        Some(first + self.join_wait_for(first, self.members.standby.len()))
    }

    /// How long `joining` workers standing by at `now` wait before the job pauses to take them
    /// in: the join wait, or under [`JoinRule::WhenRepaid`] the wait for a move to ride along
    /// ([`Controller::join_deferral`]) if that is longer.
    pub fn join_wait_for(&self, now: Instant, joining: usize) -> Duration {
        match self.spec.join_rule {
            JoinRule::AfterWait => self.spec.join_wait,
            JoinRule::WhenRepaid { at_most } => self.spec.join_wait.max(self.join_deferral(now, joining, at_most)),
        }
    }

    /// [`crate::join_deferral`] for `joining` workers joining this job's members at `now`: the
    /// last measured move's fixed part, and the moves made for other reasons since the job
    /// began (what the simulator's joins wait under the rule too).
    pub fn join_deferral(&self, now: Instant, joining: usize, at_most: Duration) -> Duration {
        let elapsed = now.saturating_duration_since(self.life.begun).as_secs_f64();
        let case = crate::JoinCase {
            fixed_s: self.monitor.move_fixed_s,
            joining,
            in_job: self.members.alive.len(),
            mean_between_moves_s: (self.moves_for_others > 0).then(|| elapsed / self.moves_for_others as f64),
        };
        crate::join_deferral(case, at_most)
    }

    /// Whether workers standing by ride along a rebalance that repays itself (else a weighing
    /// waits until they are taken in: their move re-plans anyway).
    pub(super) fn joiners_ride_along(&self) -> bool {
        matches!(self.spec.join_rule, JoinRule::WhenRepaid { .. })
    }

    /// A controller that was not running (paused, descheduled, its host asleep) for more than
    /// half a lease heard nothing in that time and cannot tell who fell silent: every node's
    /// silence is counted from where it stood when the stall began.
    pub(super) fn extend_leases_after_a_stall(&mut self, now: Instant) {
        if let Some(gap) = self.members.stalled_for(now, self.spec.lease / 2) {
            self.note(format!("the controller was stalled for {} ms: leases extended by as much", gap.as_millis()));
        }
    }

    pub(super) fn heartbeat(&mut self, now: Instant, node: NodeId) {
        self.members.saw(node, now);
    }

    pub(super) fn exited(&mut self, node: NodeId, status: &str, out: &mut Vec<Command<S>>) {
        if self.life.done.contains(&node) {
            // Expected: a worker that finished its work exits.
        } else if self.members.alive.contains(&node) && self.is_leaver(node) {
            // Expected: a drained worker leaves once its move is done (nothing to fence).
            self.members.leave(node);
            self.planned = Some(MoveCause::Drain);
            self.note(format!("epoch {}: worker {node} left (drained)", self.job_epoch(self.epoch)));
            // The others hold after the move and say so; a rendezvous still finishing counted
            // this one's Ready already.
            if self.running() {
                self.phase = Phase::Collecting { reports: BTreeMap::new() };
            }
        } else if self.members.alive.contains(&node) {
            self.lose(node, &format!("exited ({status})"));
        } else if self.members.standby.contains_key(&node) {
            self.give_up_standby(node, &format!("exited ({status})"), out);
        }
    }

    /// The whole node of each worker named leaves on notice, as far as it is in the job.
    pub(super) fn drain(&mut self, workers: &[NodeId], reason: &str) {
        let nodes: BTreeSet<u64> = workers.iter().filter(|w| self.members.alive.contains(w)).map(|&w| self.node(w)).collect();
        let all: Vec<NodeId> = self.members.alive.iter().copied().filter(|&w| nodes.contains(&self.node(w))).collect();
        if !all.is_empty() {
            self.note(format!(
                "epoch {}: workers {} leave on notice ({reason})",
                self.job_epoch(self.epoch),
                crate::words::id_list(all.iter().copied())
            ));
            self.members.draining.extend(all);
        }
    }

    /// A new node's workers stand by (ids seen before are ignored: a worker joins once).
    pub(super) fn joined(&mut self, now: Instant, workers: Vec<NodeId>) {
        let Some((node, fresh)) = self.members.join(workers, now) else { return };
        // Their leases may end before the earliest one looked at.
        self.lease_may_end_at(now + self.spec.lease);
        for &w in &fresh {
            self.node_epoch.insert(w, self.epoch);
        }
        self.note(format!(
            "epoch {}: node {node} joined with workers {}; taken in at a step boundary",
            self.job_epoch(self.epoch),
            crate::words::id_list(fresh.iter().copied())
        ));
    }

    /// How long `node` may be silent: its lease — or, for a member of the job's start before
    /// its first word, as long as its spec may take to reach it ([`FIRST_WORD_WITHIN`], within
    /// the start deadline): a thousand nodes' starts carry a replica map each, seconds on the
    /// controller's link, and a worker says nothing before it has its spec. (A node that joins
    /// later is sent its spec alone: its lease holds.)
    pub(super) fn lease_of(&self, node: NodeId) -> Duration {
        let lease = self.spec.lease;
        if self.life.started || self.members.heard.contains(&node) || self.members.standby.contains_key(&node) {
            lease
        } else {
            lease.max(FIRST_WORD_WITHIN.min(self.spec.start_within))
        }
    }

    /// Why a node lost by its lease is lost.
    fn silence(&self, node: NodeId) -> String {
        format!("no heartbeat for {} ms", self.lease_of(node).as_millis())
    }

    /// A lease may end at `at` now (a worker's first word, a joiner): the bound below which no
    /// lease ends comes down to it (where there is none, every lease is looked at anyway).
    pub(super) fn lease_may_end_at(&mut self, at: Instant) {
        if let Some(bound) = &mut self.members.leases_checked_until {
            *bound = (*bound).min(at);
        }
    }

    /// Members and workers standing by that missed their lease are killed and lost. Every
    /// lease is looked at only once the earliest could have run out.
    pub(super) fn expire_leases(&mut self, now: Instant, out: &mut Vec<Command<S>>) {
        if self.members.leases_checked_until.is_some_and(|t| now < t) {
            return;
        }
        let late = |n: &NodeId| self.members.last_seen.get(n).is_some_and(|&t| now >= t + self.lease_of(*n));
        // A worker that finished its work exits: it holds no lease any more.
        let members: Vec<NodeId> = self.members.alive.iter().copied().filter(|n| !self.life.done.contains(n)).filter(late).collect();
        let waiting: Vec<NodeId> = self.members.standby.keys().copied().filter(late).collect();
        for node in members {
            let (silent_since, reason) = (self.members.last_seen.get(&node).copied(), self.silence(node));
            out.push(Command::Kill { node, reason: reason.clone(), silent_since });
            self.lose(node, &reason);
        }
        for node in waiting {
            // Gone already if another worker of its node went before it.
            if self.members.standby.contains_key(&node) {
                let (silent_since, reason) = (self.members.last_seen.get(&node).copied(), self.silence(node));
                out.push(Command::Kill { node, reason: reason.clone(), silent_since });
                self.give_up_standby(node, &reason, out);
            }
        }
        self.members.leases_checked_until = self.deadline();
    }

    /// The other workers of a node that lost one are given up with it (and killed).
    pub(super) fn lose_whole_nodes(&mut self, out: &mut Vec<Command<S>>) {
        if self.spec.gpus_per_node <= 1 {
            return;
        }
        for lost in self.members.lost_now.clone() {
            let siblings: Vec<NodeId> = self.members.alive.iter().copied().filter(|&w| self.node(w) == self.node(lost)).collect();
            for w in siblings {
                let reason = format!("worker {lost} of its node was lost");
                out.push(Command::Kill { node: w, reason: reason.clone(), silent_since: None });
                self.lose(w, &reason);
            }
        }
    }

    /// A node that leaves on notice: every rank stops after the step in flight and the job
    /// moves off it (before the joiners' wait or a rebalance: it cannot wait).
    pub(super) fn pause_for_a_drain(&mut self, out: &mut Vec<Command<S>>) {
        if self.may_move_itself() && self.members.draining.iter().any(|&w| self.rank(w).is_some() && !self.is_leaver(w)) {
            self.note(format!(
                "epoch {}: pause to move off workers {}",
                self.job_epoch(self.epoch),
                crate::words::id_list(self.members.draining.iter().copied())
            ));
            self.pause(MoveCause::Drain, out);
        }
    }

    /// Workers waiting to join are taken in at a step boundary once their wait is over.
    pub(super) fn pause_for_joiners(&mut self, now: Instant, out: &mut Vec<Command<S>>) {
        if self.may_move_itself() && self.join_due().is_some_and(|due| now >= due) {
            self.note(format!(
                "epoch {}: pause to take in workers {}",
                self.job_epoch(self.epoch),
                crate::words::id_list(self.members.standby.keys().copied())
            ));
            self.pause(MoveCause::Join, out);
        }
    }

    /// Node `node` is gone: a collection of where the survivors stopped starts (or goes on);
    /// without recovery, the job ends.
    pub(super) fn lose(&mut self, node: NodeId, why: &str) {
        self.members.lose(node);
        self.planned = None;
        self.monitor.rebalance_to = None;
        self.note(format!("epoch {}: worker {node} lost: {why}", self.job_epoch(self.epoch)));
        if !self.recovers() {
            return self.begin_ending(node, why);
        }
        if !matches!(self.phase, Phase::Collecting { .. }) {
            self.phase = Phase::Collecting { reports: BTreeMap::new() };
        }
        if let Phase::Collecting { reports } = &mut self.phase {
            reports.remove(&node);
        }
    }

    /// A worker waiting to join is gone: it and the other workers of its node are given up.
    pub(super) fn give_up_standby(&mut self, worker: NodeId, why: &str, out: &mut Vec<Command<S>>) {
        let node = self.node(worker);
        self.members.standby.remove(&worker);
        self.note(format!("epoch {}: worker {worker} waiting to join lost: {why}", self.job_epoch(self.epoch)));
        let siblings: Vec<NodeId> = self.members.standby.keys().copied().filter(|&w| self.node(w) == node).collect();
        for w in siblings {
            self.members.standby.remove(&w);
            out.push(Command::Kill { node: w, reason: format!("worker {worker} of its node was lost"), silent_since: None });
        }
    }
}

/// The worker an event was heard from, if it says anything of one.
pub(super) fn heard_from<S>(event: &Event<S>) -> Option<NodeId> {
    match event {
        Event::Heartbeat { node }
        | Event::Listening { node, .. }
        | Event::Ready { node, .. }
        | Event::StepFailed { node, .. }
        | Event::Paused { node, .. }
        | Event::Done { node } => Some(*node),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_of_a_start_are_nodes_of_g_consecutive_workers() {
        let now = Instant::now();
        let m = Members::new(&[10, 11, 12, 13, 14], 2, now);
        let nodes: Vec<u64> = [10, 11, 12, 13, 14].iter().map(|w| m.node_of[w]).collect();
        assert_eq!(nodes, vec![0, 0, 1, 1, 2]);
        assert!(m.alive.len() == 5 && m.heard.is_empty() && m.last_seen.values().all(|&t| t == now));
    }

    #[test]
    fn joiners_are_one_new_node_and_join_once() {
        let now = Instant::now();
        let mut m = Members::new(&[0, 1], 1, now);
        let later = now + Duration::from_secs(3);
        assert_eq!(m.join(vec![7, 8, 0], later), Some((2, vec![7, 8])), "a member does not join again");
        assert!(m.standby.contains_key(&7) && !m.alive.contains(&7) && m.last_seen[&8] == later);
        assert_eq!(m.join(vec![7], later), None, "a worker joins once");
        assert_eq!(m.join(vec![9], later).map(|(node, _)| node), Some(3));
    }

    #[test]
    fn a_lost_worker_is_not_brought_back_by_its_last_words() {
        let now = Instant::now();
        let mut m = Members::new(&[0, 1], 1, now);
        m.draining.insert(1);
        m.lose(1);
        assert!(!m.alive.contains(&1) && !m.draining.contains(&1) && m.lost_now == vec![1]);
        m.saw(1, now + Duration::from_secs(5));
        assert_eq!(m.last_seen[&1], now, "a heartbeat after the loss changes nothing");
        m.saw(0, now + Duration::from_secs(5));
        assert_eq!(m.last_seen[&0], now + Duration::from_secs(5));
    }

    #[test]
    fn a_drained_worker_leaves_and_is_not_lost() {
        let mut m = Members::new(&[0, 1], 1, Instant::now());
        m.draining.insert(1);
        m.leave(1);
        assert!(m.drained.contains(&1) && !m.alive.contains(&1) && !m.draining.contains(&1) && m.lost_now.is_empty());
    }

    #[test]
    fn a_stall_longer_than_half_a_lease_moves_every_silence_by_its_length() {
        let t0 = Instant::now();
        let half = Duration::from_secs(2);
        let mut m = Members::new(&[0, 1], 1, t0);
        assert_eq!(m.stalled_for(t0, half), None, "the first decision is no stall");
        assert_eq!(m.stalled_for(t0 + Duration::from_secs(1), half), None, "a short gap is no stall");
        assert_eq!(m.stalled_for(t0 + Duration::from_secs(6), half), Some(Duration::from_secs(5)));
        assert!(m.last_seen.values().all(|&t| t == t0 + Duration::from_secs(5)));
        assert_eq!(m.stalled_for(t0, half), None, "a clock going back is no stall, and last_decision stays");
        assert_eq!(m.last_decision, Some(t0 + Duration::from_secs(6)));
    }
}
