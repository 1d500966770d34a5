//! The workers of a job as the controller's loop sees them, wherever they run: started by this
//! process ([`crate::launcher::Job`]) or by node agents over the network
//! ([`crate::hub::RemoteFleet`]). The loop ([`crate::train`]) only moves reports in and
//! messages out through this; every decision stays in [`crate::controller`].

use std::time::Duration;

use crate::error::ControlError;
use crate::launcher::Job;
use crate::protocol::{LauncherMessage, WorkerEvent};

/// The worker processes of one job, by their original rank.
pub trait Fleet {
    /// The next report of any worker, waiting at most `wait`: `(rank, None)` when it exited.
    fn next_event(&mut self, wait: Duration) -> Option<(usize, Option<WorkerEvent>)>;
    /// How worker `rank` ended (after its `(rank, None)`).
    fn exit_status(&mut self, rank: usize) -> String;
    /// Tell worker `rank` something. A worker that cannot be told has died: its exit follows.
    fn send(&mut self, rank: usize, message: &LauncherMessage) -> Result<(), ControlError>;
    /// Make sure nothing of worker `rank` runs on (a hung one is killed).
    fn kill(&mut self, rank: usize, reason: &str);
    /// The job failed or was stopped: kill every worker still running.
    fn kill_all(&mut self, reason: &str);
    /// The job is over (completed, or after `kill_all`): wait for every worker to end.
    fn finish(&mut self);
    /// Workers of a node that joined the running job (their ids new), started and standing
    /// by, if any came since the last call.
    fn joined(&mut self) -> Option<Vec<usize>> {
        None
    }
    /// Workers whose node gave notice that it leaves soon, with the reason, if any did since
    /// the last call.
    fn leaving(&mut self) -> Option<(Vec<usize>, String)> {
        None
    }
}

impl Fleet for Job {
    fn next_event(&mut self, wait: Duration) -> Option<(usize, Option<WorkerEvent>)> {
        Job::next_event(self, wait)
    }

    fn exit_status(&mut self, rank: usize) -> String {
        Job::exit_status(self, rank)
    }

    fn send(&mut self, rank: usize, message: &LauncherMessage) -> Result<(), ControlError> {
        let line = serde_json::to_string(message)?;
        self.write_line(rank, &line)
    }

    fn kill(&mut self, rank: usize, _reason: &str) {
        Job::kill(self, rank)
    }

    fn kill_all(&mut self, _reason: &str) {
        Job::kill_all(self)
    }

    fn finish(&mut self) {
        self.reap()
    }
}
