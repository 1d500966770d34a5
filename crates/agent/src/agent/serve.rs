//! The agent's loop once its node is in the job: inputs (the controller's messages, its
//! workers' reports and exits, SIGTERM, a session ending or coming back) in, relayed or acted
//! on, until the job ends for this node — completed, drained, or stopped with a reason.

use lazarus_setting::Setting;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use super::{AgentEnd, Inbound, Node, DRAIN_WITHIN, FINISH_WITHIN};
use lazarus_protocol::proto::{self, agent_message, ControllerMessage};
use lazarus_protocol::ControlError;

/// What the loop does after an input.
enum Next {
    /// Wait for the next input at once.
    Again,
    /// Check the controller's lease, then wait.
    CheckLease,
    /// The job is over for this node.
    End(AgentEnd),
}

/// The loop's own state.
struct Serving {
    last_heard: Instant,
    /// Once the controller says the job completed: until when the workers may take to exit.
    finishing: Option<(Instant, String)>,
    /// Once this node gave notice: until when it waits for the job to move off it.
    draining: Option<Instant>,
    /// The pieces of a long message from the controller, with the session they came on.
    pieces: (u64, lazarus_protocol::pieces::Gathered),
}

impl Node {
    /// Relay until the job ends for this node.
    pub(super) fn serve(
        &mut self,
        rx: &mpsc::Receiver<Inbound>,
        on_start: &mut impl FnMut(&[u32]) -> Result<(), ControlError>,
    ) -> Result<AgentEnd, ControlError> {
        let mut st = Serving { last_heard: Instant::now(), finishing: None, draining: None, pieces: (self.session.id, Default::default()) };
        loop {
            if let Some(end) = self.over(&st) {
                return Ok(end);
            }
            let deadline = match (&st.finishing, st.draining, &self.orphaned) {
                (Some((until, _)), _, _) => *until,
                (None, _, Some((since, _))) => *since + self.grace,
                (None, Some(until), None) => until.min(st.last_heard + self.lease),
                (None, None, None) => st.last_heard + self.lease,
            };
            let next = match rx.recv_timeout(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))) {
                Ok(Inbound::Worker(slot, event)) => {
                    self.relay(slot, event);
                    Next::CheckLease
                }
                Ok(Inbound::Terminate) => self.on_terminate(&mut st),
                Ok(Inbound::Message(id, m)) => self.on_message(&mut st, id, m, on_start)?,
                Ok(Inbound::Ended(id, why)) => self.on_session_ended(&mut st, id, why),
                Ok(Inbound::Reattached(round, session)) => {
                    // (One for an orphaning that is over is dropped, and its session with it.)
                    if self.orphaned.is_some() && round == self.orphan_round {
                        self.session.close();
                        self.silent_session_open = false;
                        self.rejoined(*session)?;
                        st.last_heard = Instant::now();
                    }
                    Next::CheckLease
                }
                Ok(Inbound::NotTakenBack(round, why)) => self.on_not_taken_back(round, why),
                Err(RecvTimeoutError::Timeout) => Next::CheckLease,
                Err(RecvTimeoutError::Disconnected) => Next::End(AgentEnd::Stopped("the session with the controller ended".into())),
            };
            match next {
                Next::Again => continue,
                Next::End(end) => return Ok(end),
                Next::CheckLease => {}
            }
            let silent = st.last_heard.elapsed();
            if st.finishing.is_none() && self.orphaned.is_none() && silent > self.lease {
                let why = format!("the controller was silent for {:.1} s (lease {:.1} s)", silent.as_secs_f64(), self.lease.as_secs_f64());
                if st.draining.is_none() && self.can_wait_for_a_controller() {
                    self.orphan(why, true);
                    continue;
                }
                return Ok(AgentEnd::Stopped(format!("{why}: this node's workers are stopped")));
            }
        }
    }

    /// How the job ends for this node now, if it does: drained (or not within the notice's
    /// time), finished after the controller said so, or orphaned past `--controller-grace`.
    fn over(&self, st: &Serving) -> Option<AgentEnd> {
        if let Some(until) = st.draining {
            if self.workers.is_none() || self.exited.iter().all(|&x| x) {
                return Some(AgentEnd::Drained);
            }
            if Instant::now() >= until {
                return Some(AgentEnd::Stopped(format!(
                    "the job did not move off this node within {} s of its notice: its workers are stopped",
                    DRAIN_WITHIN.as_secs()
                )));
            }
        }
        if let Some((until, reason)) = &st.finishing {
            // (Workers standing by have nothing to finish: they go with the agent's end.)
            if self.workers.is_none() || self.standing_by || self.exited.iter().all(|&x| x) || Instant::now() >= *until {
                return Some(if self.done.iter().all(|&d| d) {
                    AgentEnd::Completed { how: reason.clone() }
                } else if self.standing_by || self.workers.is_none() {
                    // Its workers held nothing of the job: a good end for this node too (a
                    // batch system must not log an error for it).
                    AgentEnd::Completed { how: format!("{reason}; this node stood by to join and was not taken in before the end") }
                } else {
                    AgentEnd::Stopped(format!("the job ended ({reason}) before this node's workers finished"))
                });
            }
        }
        if let Some((since, why)) = &self.orphaned {
            if since.elapsed() >= self.grace {
                return Some(AgentEnd::Stopped(format!(
                    "{why}, and no controller took the job back within {:.0} s ({}): this node's workers are stopped",
                    self.grace.as_secs_f64(),
                    Setting::ControllerGrace
                )));
            }
        }
        None
    }

    /// SIGTERM: a preemption notice — the node asks to be moved off (a second one, or one with
    /// nothing to move, stops at once).
    fn on_terminate(&mut self, st: &mut Serving) -> Next {
        if st.draining.is_some() || self.workers.is_none() || self.orphaned.is_some() {
            return Next::End(AgentEnd::Stopped("SIGTERM".into()));
        }
        tracing::warn!("agent: SIGTERM: this node leaves; asking the controller to move the job off it (a second SIGTERM stops at once)");
        self.up(0, agent_message::Body::Leaving(proto::Leaving { reason: "SIGTERM (a preemption notice)".into() }));
        st.draining = Some(Instant::now() + DRAIN_WITHIN);
        Next::CheckLease
    }

    /// A message of session `id` from the controller: of this session and job, joined from its
    /// pieces, taken.
    fn on_message(
        &mut self,
        st: &mut Serving,
        id: u64,
        m: ControllerMessage,
        on_start: &mut impl FnMut(&[u32]) -> Result<(), ControlError>,
    ) -> Result<Next, ControlError> {
        if id != self.session.id {
            return Ok(Next::Again);
        }
        if m.job_id != self.job_id {
            tracing::warn!("agent: a message of job {:?} (this is {:?}): dropped", m.job_id, self.job_id);
            return Ok(Next::Again);
        }
        if self.orphaned.is_some() {
            self.heard_again();
        }
        st.last_heard = Instant::now();
        // A long message comes in pieces (`lazarus_protocol::pieces`), joined here; a session's own: a new
        // session starts with none.
        if st.pieces.0 != id {
            st.pieces = (id, Default::default());
        }
        let m = match st.pieces.1.take(m, lazarus_protocol::MAX_CONTROL_MESSAGE) {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(Next::Again),
            Err(e) => {
                tracing::warn!("agent: {e}");
                return Ok(Next::Again);
            }
        };
        Ok(match self.take(m, on_start)? {
            Some(Ok(end)) => Next::End(end),
            Some(Err(reason)) => {
                st.finishing = Some((Instant::now() + FINISH_WITHIN, reason));
                Next::CheckLease
            }
            None => Next::CheckLease,
        })
    }

    /// Session `id` ended (`why`): a silent controller's session is gone; a job that finished
    /// lets its workers' last reports go; else the node waits for a controller to take it
    /// back, or stops.
    fn on_session_ended(&mut self, st: &mut Serving, id: u64, why: String) -> Next {
        if id != self.session.id {
            return Next::Again;
        }
        if self.orphaned.is_some() {
            // The silent controller's session ended: it is not coming back on it.
            self.silent_session_open = false;
            return match self.refused_meanwhile.take() {
                Some(refusal) => self.not_taken_back(&refusal).map_or(Next::Again, Next::End),
                None => Next::Again,
            };
        }
        if st.finishing.is_some() || (self.workers.is_some() && self.done.iter().all(|&d| d)) {
            // Let the workers' last reports and exits go the same way as after a shutdown.
            st.finishing.get_or_insert((Instant::now() + FINISH_WITHIN, why));
            return Next::Again;
        }
        if st.draining.is_none() && self.can_wait_for_a_controller() {
            self.orphan(why, false);
            return Next::Again;
        }
        Next::End(AgentEnd::Stopped(why))
    }

    /// The controller that answered did not take this node back (for orphaning `round`).
    fn on_not_taken_back(&mut self, round: u64, why: String) -> Next {
        if self.orphaned.is_none() || round != self.orphan_round {
            return Next::Again;
        }
        if self.silent_session_open {
            // The controller found silent may still speak on its session: the refusal (of that
            // controller, stalled, or of another) counts once it has ended.
            tracing::warn!("agent {}: {why}; waiting for the silent controller's session to speak or end", self.agent);
            self.refused_meanwhile = Some(why);
            return Next::Again;
        }
        self.not_taken_back(&why).map_or(Next::CheckLease, Next::End)
    }
}
