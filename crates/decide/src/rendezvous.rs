//! The rendezvous of an epoch: every rank of the plan listens, gets every rank's address,
//! connects and says it is ready; then training runs. A loss is told to the survivors: a
//! running epoch fences the lost ranks off, a rendezvous in progress is called off.

use std::collections::BTreeMap;
use std::time::Instant;

use super::{Command, Controller, NodeId, Phase, StepRecord};

impl<S: StepRecord> Controller<S> {
    pub(super) fn listening(&mut self, now: Instant, node: NodeId, epoch: u64, addr: String, out: &mut Vec<Command<S>>) {
        self.members.last_seen.insert(node, now);
        let Phase::Rendezvous { addrs, .. } = &mut self.phase else { return };
        if epoch != self.epoch || !self.rank_of.contains_key(&node) {
            return;
        }
        addrs.insert(node, addr);
        if addrs.len() >= self.ranks.len() && self.ranks.iter().all(|n| addrs.contains_key(n)) {
            let list = self.ranks.iter().map(|n| addrs[n].clone()).collect();
            out.push(Command::Addresses { epoch, addrs: list });
        }
    }

    pub(super) fn ready(&mut self, now: Instant, node: NodeId, epoch: u64, out: &mut Vec<Command<S>>) {
        self.members.last_seen.insert(node, now);
        let Phase::Rendezvous { ready, .. } = &mut self.phase else { return };
        if epoch != self.epoch || !self.rank_of.contains_key(&node) {
            return;
        }
        ready.insert(node);
        if ready.len() >= self.ranks.len() && self.ranks.iter().all(|n| ready.contains(n)) {
            self.phase = Phase::Running;
            self.life.started = true;
            self.takeover.taken_back = false;
            out.push(Command::Resume { epoch });
        }
    }

    /// Ranks of a running epoch lost by this event are fenced off by the survivors, so that a
    /// step waiting on a rank that is silent but connected fails now; a rendezvous that lost a
    /// rank is called off (survivors may be waiting for addresses that will never come, or
    /// connecting to a rank that is gone) — unless no one is left to tell.
    pub(super) fn tell_survivors_of_the_loss(&mut self, was_rendezvous: bool, out: &mut Vec<Command<S>>) {
        // (Asked after every event: one of a thousand workers' rendezvous, which loses nobody,
        // must not look at every rank.)
        let called_off = was_rendezvous && matches!(self.phase, Phase::Collecting { .. } | Phase::Ending { .. });
        if !was_rendezvous && !self.members.lost_now.is_empty() {
            let lost: std::collections::BTreeSet<NodeId> = self.members.lost_now.iter().copied().collect();
            let lost_ranks: Vec<usize> = (0..self.ranks.len()).filter(|&r| lost.contains(&self.ranks[r])).collect();
            let nodes: Vec<NodeId> = self.ranks.iter().copied().filter(|n| self.members.alive.contains(n)).collect();
            if !lost_ranks.is_empty() && !nodes.is_empty() {
                out.push(Command::Fence { epoch: self.epoch, ranks: lost_ranks, nodes });
            }
        }
        if called_off {
            let nodes: Vec<NodeId> = self.members.alive.iter().copied().collect();
            if !nodes.is_empty() {
                out.push(Command::Abandon { epoch: self.epoch, nodes });
            }
        }
    }

    /// The new plan is the epoch's: a rendezvous of its ranks follows.
    pub(super) fn adopt(&mut self, plan: lazarus_plan::ModelPlan, ranks: Vec<NodeId>) {
        self.epoch = plan.epoch();
        self.takeover.resuming = false;
        for n in &ranks {
            if self.members.standby.remove(n).is_some() {
                self.members.alive.insert(*n);
            }
        }
        for n in &ranks {
            self.node_epoch.insert(*n, self.epoch);
        }
        self.plan = Some(plan);
        self.set_ranks(ranks);
        self.monitor.restart();
        self.phase = Phase::Rendezvous { addrs: BTreeMap::new(), ready: std::collections::BTreeSet::new() };
    }
}
