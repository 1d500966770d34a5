//! The supervision of a job's worker processes as a pure state machine: every decision is
//! [`Supervisor::on`]`(now, input) -> Vec<Action>`, tested without processes or clocks (the way
//! torchft's lighthouse computes a quorum). The shell around it ([`crate::launcher::supervise`])
//! only moves events in and carries actions out.
//!
//! A job starts (every rank listening → the address list goes out; every rank ready → started),
//! runs (step reports pass through; those that arrive before the last rank is ready are held
//! back until it is), and ends: every rank done → [`Outcome::Completed`]; a rank that fails or
//! dies → the others get `grace` to notice and say how they stopped, then
//! [`Outcome::Failed`] names the first failure and every rank's end. Nothing is decided from
//! strings: failures are [`RankEnd`] values.

#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use lazarus_model::StepReport;
use lazarus_runtime::bench::BenchResult;

use crate::protocol::{FailureKind, WorkerEvent};

/// How one rank ended.
#[derive(Debug, Clone, PartialEq)]
pub enum RankEnd {
    /// Finished its work; rank 0 of a training job names the checkpoint it wrote.
    Finished { checkpoint: Option<PathBuf> },
    /// Stopped and said why.
    Failed { kind: FailureKind, message: String },
    /// Its process ended without a word: killed or crashed (`status` describes the exit).
    Died { status: String },
    /// Still silent when the supervisor gave up waiting (it is killed).
    NoAnswer,
}

impl RankEnd {
    fn is_failure(&self) -> bool {
        !matches!(self, RankEnd::Finished { .. })
    }

    /// Short form for the final report: `finished`, the failure kind, `died`, `no answer`.
    pub fn short(&self) -> String {
        match self {
            RankEnd::Finished { .. } => "finished".into(),
            RankEnd::Failed { kind, .. } => kind.name().into(),
            RankEnd::Died { .. } => "died".into(),
            RankEnd::NoAnswer => "no answer (killed)".into(),
        }
    }

    /// One line about this rank's end.
    pub fn describe(&self, rank: usize) -> String {
        match self {
            RankEnd::Finished { .. } => format!("worker {rank}: finished"),
            RankEnd::Failed { kind, message } => format!("worker {rank}: {kind}: {message}"),
            RankEnd::Died { status } => format!("worker {rank} died ({status})"),
            RankEnd::NoAnswer => format!("worker {rank}: no answer"),
        }
    }
}

/// How the job ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Every rank finished.
    Completed { checkpoint: Option<PathBuf>, bench: Option<Vec<BenchResult>> },
    /// A rank failed: the first failure, and how every rank ended.
    Failed { first: (usize, RankEnd), ranks: Vec<RankEnd> },
    /// Not every rank was ready by the start deadline.
    StartTimeout { ready: usize, world: usize, waited: Duration },
}

/// What the supervisor is told.
#[derive(Debug, Clone)]
pub enum Input {
    /// A rank's report.
    Event(usize, WorkerEvent),
    /// A rank's process ended (its stdout closed); `status` describes the exit.
    Exited(usize, String),
    /// Time passed (at or after [`Supervisor::deadline`]).
    Tick,
}

/// What the shell must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Send every rank the address list.
    SendAddresses(Vec<String>),
    /// Rank `rank` (process `pid`) is connected and built its model.
    Ready { rank: usize, pid: u32 },
    /// Every rank is ready: training runs.
    Started,
    /// A finished step (rank 0's report), `dropped` reports before it lost to a slow reader.
    Step { report: StepReport, seconds: f64, wire_bytes: u64, dropped: u64 },
    /// A rank stopped other than by finishing; `after` is the time since the first failure
    /// (None for the first).
    RankStopped { rank: usize, end: RankEnd, after: Option<Duration> },
    /// The job is over: kill whatever is left, report the outcome.
    Finish(Outcome),
}

#[derive(Debug, Clone, PartialEq)]
enum Rank {
    Starting,
    Listening(String),
    Ready,
    Ended(RankEnd),
}

/// The supervisor of one job of `world` ranks.
#[derive(Debug, Clone)]
pub struct Supervisor {
    ranks: Vec<Rank>,
    started: bool,
    addresses_sent: bool,
    /// Step reports that came before every rank was ready.
    early: Vec<Action>,
    bench: Option<Vec<BenchResult>>,
    begun: Instant,
    start_within: Duration,
    grace: Duration,
    first_failure: Option<(usize, Instant)>,
    finished: bool,
}

impl Supervisor {
    /// `start_within`: every rank must be ready by then; `grace`: after the first failure, how
    /// long the others get to notice on their own (the collective deadline plus a margin).
    pub fn new(world: usize, now: Instant, start_within: Duration, grace: Duration) -> Self {
        Supervisor {
            ranks: vec![Rank::Starting; world],
            started: false,
            addresses_sent: false,
            early: Vec::new(),
            bench: None,
            begun: now,
            start_within,
            grace,
            first_failure: None,
            finished: false,
        }
    }

    /// When the supervisor must be ticked if nothing else happens (None: only events matter).
    pub fn deadline(&self) -> Option<Instant> {
        if self.finished {
            return None;
        }
        match self.first_failure {
            Some((_, at)) => Some(at + self.grace),
            None if !self.started => Some(self.begun + self.start_within),
            None => None,
        }
    }

    /// Whether the job is over (a [`Action::Finish`] was returned).
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    fn ready_count(&self) -> usize {
        self.ranks.iter().filter(|r| matches!(r, Rank::Ready | Rank::Ended(RankEnd::Finished { .. }))).count()
    }

    /// Take one input; returns what to do, in order.
    pub fn on(&mut self, now: Instant, input: Input) -> Vec<Action> {
        if self.finished {
            return Vec::new();
        }
        let mut out = Vec::new();
        match input {
            Input::Event(rank, _) | Input::Exited(rank, _) if rank >= self.ranks.len() => {}
            Input::Event(rank, event) => self.event(now, rank, event, &mut out),
            Input::Exited(rank, status) => {
                // Stdout closed: the process ended. Without a final event it was killed or crashed.
                if !matches!(self.ranks[rank], Rank::Ended(_)) {
                    self.end(now, rank, RankEnd::Died { status }, &mut out);
                }
            }
            Input::Tick => {}
        }
        self.settle(now, &mut out);
        out
    }

    fn event(&mut self, now: Instant, rank: usize, event: WorkerEvent, out: &mut Vec<Action>) {
        match event {
            WorkerEvent::Listening { addr, .. } => {
                if self.ranks[rank] == Rank::Starting {
                    self.ranks[rank] = Rank::Listening(addr);
                }
                if !self.addresses_sent && self.ranks.iter().all(|r| matches!(r, Rank::Listening(_))) {
                    let addrs = self.ranks.iter().map(|r| if let Rank::Listening(a) = r { a.clone() } else { String::new() }).collect();
                    self.addresses_sent = true;
                    out.push(Action::SendAddresses(addrs));
                }
            }
            WorkerEvent::Ready { pid, .. } => {
                if !matches!(self.ranks[rank], Rank::Ended(_)) {
                    self.ranks[rank] = Rank::Ready;
                    out.push(Action::Ready { rank, pid });
                }
                if !self.started && self.ready_count() == self.ranks.len() {
                    self.started = true;
                    out.push(Action::Started);
                    out.append(&mut self.early);
                }
            }
            WorkerEvent::Step { report, seconds, wire_bytes, dropped, .. } => {
                let step = Action::Step { report, seconds, wire_bytes, dropped };
                if self.started {
                    out.push(step);
                } else {
                    self.early.push(step);
                }
            }
            WorkerEvent::Done { checkpoint } => self.end(now, rank, RankEnd::Finished { checkpoint }, out),
            WorkerEvent::BenchResults { results } => {
                self.bench = Some(results);
                self.end(now, rank, RankEnd::Finished { checkpoint: None }, out);
            }
            WorkerEvent::Failed { kind, message } => self.end(now, rank, RankEnd::Failed { kind, message }, out),
            // A job without recovery: a failed step is the worker's end.
            WorkerEvent::StepFailed { kind, message, .. } => self.end(now, rank, RankEnd::Failed { kind, message }, out),
            // Nobody asks a job without recovery to pause; a worker that says so anyway is done
            // with the job.
            WorkerEvent::Paused { .. } | WorkerEvent::Left => {
                self.end(now, rank, RankEnd::Failed { kind: FailureKind::Error, message: "paused, unasked".into() }, out)
            }
            WorkerEvent::Heartbeat | WorkerEvent::Checkpointed { .. } => {}
        }
    }

    fn end(&mut self, now: Instant, rank: usize, end: RankEnd, out: &mut Vec<Action>) {
        if matches!(self.ranks[rank], Rank::Ended(_)) {
            return;
        }
        if end.is_failure() {
            let after = self.first_failure.map(|(_, at)| now.saturating_duration_since(at));
            self.first_failure.get_or_insert((rank, now));
            out.push(Action::RankStopped { rank, end: end.clone(), after });
        }
        self.ranks[rank] = Rank::Ended(end);
    }

    /// Finish if everything has ended or a deadline has passed.
    fn settle(&mut self, now: Instant, out: &mut Vec<Action>) {
        let all_ended = self.ranks.iter().all(|r| matches!(r, Rank::Ended(_)));
        let past = self.deadline().is_some_and(|d| now >= d);
        if !all_ended && !past {
            return;
        }
        let outcome = match self.first_failure {
            Some((first, _)) => {
                let ranks: Vec<RankEnd> =
                    self.ranks.iter().map(|r| if let Rank::Ended(e) = r { e.clone() } else { RankEnd::NoAnswer }).collect();
                Outcome::Failed { first: (first, ranks[first].clone()), ranks }
            }
            None if all_ended => {
                let checkpoint = match &self.ranks[0] {
                    Rank::Ended(RankEnd::Finished { checkpoint }) => checkpoint.clone(),
                    _ => None,
                };
                Outcome::Completed { checkpoint, bench: self.bench.take() }
            }
            None => Outcome::StartTimeout { ready: self.ready_count(), world: self.ranks.len(), waited: now - self.begun },
        };
        self.finished = true;
        out.push(Action::Finish(outcome));
    }
}
