//! The job's life around its epochs: it must start by a deadline; a stop asked for (SIGTERM,
//! Ctrl-C) makes every rank finish after the same step with the final checkpoint; it completes
//! when every rank has finished its work; and a job without recovery ends at its first loss,
//! once the others have said how they stopped or their grace is over.

use std::collections::BTreeSet;
use std::time::Instant;

use super::{Command, Controller, NodeId, OnLoss, Phase, StepRecord, StopReason};

/// The lifecycle room's state: when the job began, whether it ever ran, who finished its work,
/// and a stop asked for.
#[derive(Debug, Clone)]
pub(crate) struct Life {
    /// When the job began (its start deadline counts from here), and whether every rank of an
    /// epoch has been ready once.
    pub(crate) begun: Instant,
    pub(crate) started: bool,
    /// Workers that finished their work (rank 0's final checkpoint written).
    pub(crate) done: BTreeSet<NodeId>,
    /// A stop was asked for: every rank finishes after the same step, at each epoch that runs
    /// (`finish_asked`: the epoch last asked).
    pub(crate) finish_requested: bool,
    pub(crate) finish_asked: Option<u64>,
}

impl Life {
    pub(crate) fn new(now: Instant) -> Self {
        Life { begun: now, started: false, done: BTreeSet::new(), finish_requested: false, finish_asked: None }
    }

    /// Whether the ranks of `epoch` must still be asked to finish (once per epoch, after a stop
    /// was asked for); asking is noted.
    pub(crate) fn ask_to_finish(&mut self, epoch: u64) -> bool {
        let due = self.finish_requested && self.finish_asked != Some(epoch);
        if due {
            self.finish_asked = Some(epoch);
        }
        due
    }
}

impl<S: StepRecord> Controller<S> {
    /// A member finished its work (a worker's own word: a finished worker's exit is expected).
    pub(super) fn done(&mut self, node: NodeId) {
        if self.members.alive.contains(&node) && self.life.done.insert(node) {
            self.note(format!("epoch {}: worker {node} finished", self.job_epoch(self.epoch)));
        }
    }

    /// A stop is asked for: noted once; the ranks are asked at each epoch that runs.
    pub(super) fn stop_requested(&mut self, why: &str) {
        if !self.life.finish_requested {
            self.life.finish_requested = true;
            self.note(format!("epoch {}: {why}: every rank finishes after the same step", self.job_epoch(self.epoch)));
        }
    }

    /// Whether the job may pause itself for a move it wants (a drain, a rebalance, joiners):
    /// only a job that recovers (it can move), and not once a stop was asked for (it ends at
    /// the next step boundary anyway).
    pub(super) fn may_move_itself(&self) -> bool {
        self.running() && self.recovers() && !self.life.finish_requested && !self.at_its_end()
    }

    /// The job trained its last step, or a rank finished: a pause now would wait for ranks
    /// that are writing the final checkpoint or gone (a joiner arriving then is not taken in).
    fn at_its_end(&self) -> bool {
        !self.life.done.is_empty() || self.last_step >= self.spec.total_steps
    }

    /// The first loss of a job without recovery: it ends, after the others' grace.
    pub(super) fn begin_ending(&mut self, node: NodeId, why: &str) {
        if matches!(self.phase, Phase::Ending { .. }) {
            return;
        }
        let grace = match self.spec.on_loss {
            OnLoss::Stop { grace } => grace,
            OnLoss::Recover => std::time::Duration::ZERO,
        };
        let now = self.members.last_decision.unwrap_or(self.life.begun);
        let first = StopReason::Lost { worker: node, why: why.to_string() };
        self.phase = Phase::Ending { until: now.checked_add(grace).unwrap_or(now), first };
    }

    /// A job without recovery that lost a rank stops once every rank has ended (finished or
    /// lost) or the grace is over (the shell kills what is left).
    pub(super) fn end_after_a_loss(&mut self, now: Instant, out: &mut Vec<Command<S>>) {
        let Phase::Ending { until, first } = &self.phase else { return };
        let everyone_ended = self.ranks.iter().all(|n| self.life.done.contains(n) || !self.members.alive.contains(n));
        if everyone_ended || now >= *until {
            let reason = first.clone();
            self.stop(reason, out);
        }
    }

    /// A job whose ranks were never all ready by the start deadline stops.
    pub(super) fn stop_if_not_started(&mut self, now: Instant, out: &mut Vec<Command<S>>) {
        if !self.life.started && !self.is_over() && self.start_deadline().is_some_and(|d| now >= d) {
            let ready = match &self.phase {
                Phase::Rendezvous { ready, .. } => ready.len(),
                _ => 0,
            };
            let reason = StopReason::NotStarted { within_s: self.spec.start_within.as_secs(), ready, ranks: self.ranks.len() };
            self.stop(reason, out);
        }
    }

    /// After a stop was asked for, the ranks of each epoch that runs are asked to finish (a
    /// move in flight asks them again at its new epoch).
    pub(super) fn ask_to_finish(&mut self, out: &mut Vec<Command<S>>) {
        if self.running() && self.life.ask_to_finish(self.epoch) {
            out.push(Command::Finish { epoch: self.epoch, nodes: self.ranks.clone() });
        }
    }

    /// Every rank of the running epoch finished: the job is complete — also when a pause the
    /// job asked for crossed its last step (the ranks finished instead of pausing).
    pub(super) fn complete_when_every_rank_is_done(&mut self, out: &mut Vec<Command<S>>) {
        let pausing = matches!(self.phase, Phase::Collecting { .. }) && self.planned.is_some();
        if (self.running() || pausing) && self.ranks.iter().all(|n| self.life.done.contains(n)) {
            self.note(format!("epoch {}: every worker finished", self.job_epoch(self.epoch)));
            self.phase = Phase::Completed;
            out.push(Command::Complete);
        }
    }

    /// When the lifecycle needs a decision even if nothing happens: the start deadline, the
    /// end of the grace after a loss.
    pub(super) fn lifecycle_deadline(&self) -> Option<Instant> {
        match &self.phase {
            _ if self.is_over() => None,
            Phase::Ending { until, .. } => Some(*until),
            _ if !self.life.started => self.start_deadline(),
            _ => None,
        }
    }

    /// When every rank must have been ready (None: never, for a deadline past the clock's end).
    fn start_deadline(&self) -> Option<Instant> {
        self.life.begun.checked_add(self.spec.start_within)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_asks_the_ranks_of_each_epoch_once() {
        let mut life = Life::new(Instant::now());
        assert!(!life.ask_to_finish(5), "nothing to ask before a stop is asked for");
        life.finish_requested = true;
        assert!(life.ask_to_finish(5));
        assert!(!life.ask_to_finish(5), "asked once per epoch");
        assert!(life.ask_to_finish(6), "a move's new epoch is asked again");
    }
}
