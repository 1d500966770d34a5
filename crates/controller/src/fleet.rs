//! The workers of a job as the controller's loop sees them, wherever they run: started by this
//! process ([`lazarus_agent::launcher::Job`]) or by node agents over the network
//! ([`crate::hub::RemoteFleet`]). The loop ([`crate::control_loop`]) only moves reports in and
//! messages out through this; every decision stays in [`crate::decisions`].

use std::time::Duration;

use lazarus_agent::launcher::Job;
use lazarus_protocol::ControlError;
use lazarus_protocol::{LauncherMessage, WorkerEvent};

/// What the fleet tells the controller's loop.
#[derive(Debug, Clone)]
pub enum FleetEvent {
    /// A report of worker `rank`.
    Report { rank: usize, event: WorkerEvent },
    /// Worker `rank` exited (how: [`Fleet::exit_status`]); told once.
    Exited { rank: usize },
    /// A node's workers (their ids new) joined the running job: started, standing by.
    Joined { workers: Vec<usize> },
    /// A node's workers leave soon (a preemption notice), and why.
    Leaving { workers: Vec<usize>, reason: String },
}

impl From<(usize, Option<WorkerEvent>)> for FleetEvent {
    /// A worker's report, or (`None`) its exit.
    fn from((rank, event): (usize, Option<WorkerEvent>)) -> Self {
        match event {
            Some(event) => FleetEvent::Report { rank, event },
            None => FleetEvent::Exited { rank },
        }
    }
}

/// The worker processes of one job, by their original rank.
pub trait Fleet {
    /// The next thing that happened to the fleet, waiting at most `wait`.
    fn next_event(&mut self, wait: Duration) -> Option<FleetEvent>;
    /// How worker `rank` ended (after its [`FleetEvent::Exited`]).
    fn exit_status(&mut self, rank: usize) -> String;
    /// Tell worker `rank` something. A worker that cannot be told has died: its exit follows.
    fn send(&mut self, rank: usize, message: &LauncherMessage) -> Result<(), ControlError>;
    /// Tell every worker of `ranks` the same thing (a fleet across hosts sends it once to a
    /// host). Workers that cannot be told have died: their exits follow.
    fn send_many(&mut self, ranks: &[usize], message: &LauncherMessage) -> Result<(), ControlError> {
        let mut first_error = Ok(());
        for &rank in ranks {
            if let Err(e) = self.send(rank, message) {
                first_error = first_error.and(Err(e));
            }
        }
        first_error
    }
    /// Make sure nothing of worker `rank` runs on (a hung one is killed).
    fn kill(&mut self, rank: usize, reason: &str);
    /// The job failed or was stopped: kill every worker still running.
    fn kill_all(&mut self, reason: &str);
    /// The job is over (completed, or after `kill_all`; `how`, for the agents to say): wait
    /// for every worker to end.
    fn finish(&mut self, how: &str);
    /// For a job taken back by a new controller: how long the longest-waiting agent that came
    /// back had been without a controller when it re-attached (None: not known).
    fn without_a_controller(&self) -> Option<Duration> {
        None
    }
}

impl Fleet for Job {
    fn next_event(&mut self, wait: Duration) -> Option<FleetEvent> {
        Job::next_event(self, wait).map(FleetEvent::from)
    }

    fn exit_status(&mut self, rank: usize) -> String {
        Job::exit_status(self, rank)
    }

    fn send(&mut self, rank: usize, message: &LauncherMessage) -> Result<(), ControlError> {
        self.send_many(&[rank], message)
    }

    fn send_many(&mut self, ranks: &[usize], message: &LauncherMessage) -> Result<(), ControlError> {
        let line = serde_json::to_string(message)?;
        let mut first_error = Ok(());
        for &rank in ranks {
            if let Err(e) = self.write_line(rank, &line) {
                first_error = first_error.and(Err(e));
            }
        }
        first_error
    }

    fn kill(&mut self, rank: usize, _reason: &str) {
        Job::kill(self, rank)
    }

    fn kill_all(&mut self, _reason: &str) {
        Job::kill_all(self)
    }

    fn finish(&mut self, _how: &str) {
        self.reap()
    }
}
