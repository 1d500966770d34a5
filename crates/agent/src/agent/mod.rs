//! `lazarus agent`: one per node. It attaches to the controller (`Control.Attach`, with the
//! job's secret), starts the workers the controller gives it — one per GPU slot — relays their
//! reports up and the controller's messages down, heartbeats, and watches the controller:
//!
//! * its workers never outlive it (each dies with it: `PR_SET_PDEATHSIG`, and its stdin closes);
//! * a worker's exit is reported at once (the controller re-plans without waiting for a lease);
//! * a controller lost — its session ended, or silent for longer than its lease (gone, hung or
//!   cut off) — does not end the job at once: the workers pause after the step in flight (a
//!   rendezvous in progress is called off) and keep their state, and the agent tries to attach
//!   again for `--controller-grace` ([`DEFAULT_CONTROLLER_GRACE`]). A controller that took the
//!   job back (`lazarus controller --resume-job`) admits its claim — its number and its workers —
//!   and hears again what it may have missed: each worker's end, the last records (steps,
//!   checkpoints, evaluations), each worker's last stop, and what came meanwhile. A controller
//!   that did not take the job back (this node was given up) refuses it, and so does the end of
//!   the grace: the workers are stopped cleanly (checkpoints are written atomically, so nothing on
//!   disk is left inconsistent) and the agent exits with the reason;
//! * messages of another job, or stamped with an epoch older than the one a worker was last
//!   given, are dropped;
//! * SIGTERM is a preemption notice (paper §3: a spot node is told before it is taken): the
//!   agent tells the controller its node leaves, the controller moves the job off it — its
//!   workers finish the step in flight and hand over what only they hold — and the workers leave;
//!   the agent exits once they have (or after [`DRAIN_WITHIN`], or at a second SIGTERM).

pub(crate) mod attach;
mod serve;

use lazarus_setting::Setting;
use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::mpsc::{self};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use crate::launcher::{start_processes_reporting, Confinement, Job};
use attach::{Identity, Session, SessionError};
use lazarus_protocol::proto::{self, agent_message, controller_message, AgentMessage, ControllerMessage};
use lazarus_protocol::relay::start;
use lazarus_protocol::tls::ClientTls;
use lazarus_protocol::ControlError;
use lazarus_protocol::{LauncherMessage, WorkerEvent};

/// How an agent is started.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// The controller's `host:port`.
    pub controller: String,
    /// Worker slots (GPUs) of this node.
    pub gpus: usize,
    /// The address this node's workers listen on (None: the one this host reaches the
    /// controller from).
    pub host: Option<IpAddr>,
    pub secret: u128,
    /// How this agent trusts the controller's TLS certificate.
    pub tls: ClientTls,
    /// How long to keep trying to reach the controller.
    pub connect_within: Duration,
    /// How long the workers wait, paused, for a controller to take the job back once this
    /// one is lost (zero: they are stopped at once).
    pub controller_grace: Duration,
}

/// How long an agent waits for a lost controller to come back by default
/// (`--controller-grace`): long enough for a supervisor to restart it, short enough that a
/// job nobody restarts frees its GPUs.
pub const DEFAULT_CONTROLLER_GRACE: Duration = Duration::from_secs(60);

/// How an agent's part in the job ended.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentEnd {
    /// The job completed (or was stopped at a step boundary with its final checkpoint, as the
    /// controller says in `how`); its workers finished.
    Completed { how: String },
    /// Stopped before the end: why (the controller lost, the job stopped, this node given up).
    Stopped(String),
    /// This node gave notice and the job moved off it: its workers handed over their state and
    /// left.
    Drained,
}

/// What the agent waits on: its sessions with the controller, and its workers' reports.
enum Inbound {
    /// A message of session `.0` (a message of an older session is dropped).
    Message(u64, ControllerMessage),
    /// Session `.0` ended: why.
    Ended(u64, String),
    /// A worker's report, or its end (`None`).
    Worker(usize, Option<WorkerEvent>),
    /// SIGTERM: the node leaves soon.
    Terminate,
    /// A session with the controller that took the job back (for orphaning `.0`).
    Reattached(u64, Box<Session>),
    /// The controller that answered did not take this node back (for orphaning `.0`): why.
    NotTakenBack(u64, String),
}

/// How long a node that gave notice waits for the controller to move the job off it.
pub const DRAIN_WITHIN: Duration = Duration::from_secs(60);

/// SIGTERMs received (set by the handler: an atomic store is all it does).
static TERMINATE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

extern "C" fn on_terminate(_: libc::c_int) {
    TERMINATE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Turn SIGTERM into [`Inbound::Terminate`] on `tx` (a watcher thread polls what the handler
/// counted: nothing but an atomic store runs in the handler).
fn watch_terminate(tx: mpsc::Sender<Inbound>) -> Result<(), ControlError> {
    // SAFETY: the handler only does an atomic add, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, on_terminate as *const () as libc::sighandler_t);
    }
    std::thread::Builder::new()
        .name("lazarus-agent-sigterm".into())
        .spawn(move || {
            let mut seen = 0;
            loop {
                std::thread::sleep(Duration::from_millis(20));
                let now = TERMINATE.load(std::sync::atomic::Ordering::Relaxed);
                while seen < now {
                    seen += 1;
                    if tx.send(Inbound::Terminate).is_err() {
                        return;
                    }
                }
            }
        })
        .map(|_| ())
        .map_err(|e| ControlError::io("starting the SIGTERM watch", e))
}

/// Every worker of a node runs `lazarus worker`: the same hidden subcommand the local launcher
/// starts.
const WORKER_SUBCOMMAND: &str = "worker";

/// How long a completed job's workers get to exit after the controller says it is over.
const FINISH_WITHIN: Duration = Duration::from_secs(30);

/// The address of this host that packets to `controller` leave from (no packet is sent).
fn local_address_towards(controller: SocketAddr) -> Result<IpAddr, ControlError> {
    let any: SocketAddr =
        if controller.is_ipv4() { "0.0.0.0:0".parse().expect("an address") } else { "[::]:0".parse().expect("an address") };
    let probe = UdpSocket::bind(any).map_err(|e| ControlError::io("finding this host's address", e))?;
    probe.connect(controller).map_err(|e| ControlError::io(format!("finding a route to the controller at {controller}"), e))?;
    Ok(probe.local_addr().map_err(|e| ControlError::io("finding this host's address", e))?.ip())
}

/// Run one agent until its part in the job ends. `on_start(ranks)` is told the workers' ranks
/// once they are started.
pub fn run_agent(opts: &AgentOptions, mut on_start: impl FnMut(&[u32]) -> Result<(), ControlError>) -> Result<AgentEnd, ControlError> {
    lazarus_protocol::node_gpus(Setting::Gpus, opts.gpus)?;
    let controller: SocketAddr = opts.controller.to_socket_addrs().ok().and_then(|mut a| a.next()).ok_or_else(|| {
        ControlError::invalid(Setting::Controller, format!("{:?} (expected host:port, e.g. 10.0.0.1:7070)", opts.controller))
    })?;
    let host = match opts.host {
        Some(h) => h,
        None => local_address_towards(controller)?,
    };
    // Its workers will listen there: an address this node does not have would fail their first
    // rendezvous — and the job's start with it — so it is refused here, before attaching.
    if let Err(e) = std::net::TcpListener::bind((host, 0)) {
        return Err(ControlError::invalid(Setting::Host, format!("{host}: this node cannot listen on it ({e}), so its workers could not")));
    }
    let me = Identity {
        controller,
        controller_name: opts.controller.clone(),
        gpus: opts.gpus,
        host,
        secret: opts.secret,
        tls: opts.tls.clone(),
    };
    let runtime = lazarus_protocol::rpc::runtime(1, "lazarus-agent")?;
    // Until --connect-timeout: a controller lost while this agent attaches is tried again.
    let first = runtime.block_on(attach::open_retrying(&me, opts.connect_within, Duration::from_millis(100)))?;
    tracing::info!(
        "agent {}: attached to job {} at {controller} with {} workers listening on {host}",
        first.welcome.agent,
        first.job_id,
        opts.gpus
    );
    let (tx, rx) = mpsc::channel::<Inbound>();
    watch_terminate(tx.clone())?;
    let mut node = Node {
        job_id: first.job_id.clone(),
        agent: first.welcome.agent,
        out: first.out.clone(),
        gpus: opts.gpus,
        workers: None,
        reports: tx,
        slot_epoch: vec![0; opts.gpus],
        done: vec![false; opts.gpus],
        exited: vec![false; opts.gpus],
        secret: opts.secret,
        me,
        runtime: runtime.handle().clone(),
        session: Default::default(),
        lease: Duration::from_secs(1),
        grace: opts.controller_grace,
        first_worker: None,
        orphaned: None,
        orphan_round: 0,
        silent_session_open: false,
        refused_meanwhile: None,
        gap: VecDeque::new(),
        recent: VecDeque::new(),
        last_stop: vec![None; opts.gpus],
        standing_by: false,
    };
    node.listen(*Box::new(first))?;
    let end = node.serve(&rx, &mut on_start);
    // The workers go with the agent's part in the job, whatever ended it.
    if let Some(mut job) = node.workers.take() {
        job.kill_all();
        job.reap();
    }
    node.session.close();
    drop(node);
    runtime.shutdown_timeout(Duration::from_millis(200));
    end
}

fn checked_seconds(s: f64, what: &str) -> Result<Duration, ControlError> {
    if !s.is_finite() || !(0.001..=3600.0).contains(&s) {
        return Err(ControlError::Launch(format!("the controller's welcome has a {what} of {s} s")));
    }
    Ok(Duration::from_secs_f64(s))
}

/// The agent's node: its workers and what it relays.
struct Node {
    job_id: String,
    /// This agent's number in the job.
    agent: u64,
    /// The open session's way to the controller.
    out: UnboundedSender<AgentMessage>,
    gpus: usize,
    workers: Option<Job>,
    /// Where the workers' reports go (the agent's one queue).
    reports: mpsc::Sender<Inbound>,
    /// The epoch each worker was last given.
    slot_epoch: Vec<u64>,
    done: Vec<bool>,
    exited: Vec<bool>,
    /// The job's secret, for its workers' specs (the controller sends them without it).
    secret: u128,
    /// What this agent says of itself when it attaches again.
    me: Identity,
    runtime: tokio::runtime::Handle,
    /// The open session's tasks (its reader and heartbeats) and its number.
    session: SessionTasks,
    /// A controller silent for this long is lost (its welcome says).
    lease: Duration,
    /// How long to wait for a controller to take the job back (`--controller-grace`).
    grace: Duration,
    /// The worker of slot 0 (its id in the job), once the workers are started.
    first_worker: Option<u64>,
    /// Since when this node has had no controller, and why.
    orphaned: Option<(Instant, String)>,
    /// The orphaning under way (each has its number): what an attach started for an older
    /// one comes to is dropped.
    orphan_round: u64,
    /// The session with the controller found silent is still open (no end was seen): that
    /// controller may only be stalled, and if it speaks again the job goes on as it was.
    silent_session_open: bool,
    /// The refusal of a controller that answered an attach while the silent session was still
    /// open: it counts once that session ends.
    refused_meanwhile: Option<String>,
    /// What the workers said while there was no controller, in order (heartbeats aside).
    gap: VecDeque<AgentMessage>,
    /// The last records sent (steps, checkpoints, evaluations): a controller that takes the job
    /// back hears them again, in case the lost one never logged them.
    recent: VecDeque<AgentMessage>,
    /// Each worker's last report of where it stopped, until it runs again.
    last_stop: Vec<Option<AgentMessage>>,
    /// The workers were started to join the running job and were not taken in yet (they hold
    /// nothing): a controller that takes the job back does not know them, so this node attaches
    /// again as a newcomer.
    standing_by: bool,
}

/// The tasks of the open session with the controller.
#[derive(Default)]
struct SessionTasks {
    id: u64,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl SessionTasks {
    /// End the session: its reader and heartbeats stop, and with them the stream to the
    /// controller (a controller that is only hung sees this agent gone when it wakes).
    fn close(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }
}

/// Records a re-attaching agent sends again (the newest; enough for the steps around a loss).
const RECENT_RECORDS: usize = 16;
/// Most reports kept while there is no controller (the workers pause within a step or two).
const MOST_GAP_MESSAGES: usize = 4096;

impl Node {
    /// Tell the controller `body` of `epoch`; without a controller, keep it for the next one.
    fn up(&mut self, epoch: u64, body: agent_message::Body) {
        let m = AgentMessage { job_id: self.job_id.clone(), epoch, body: Some(body) };
        if self.orphaned.is_some() {
            if self.gap.len() == MOST_GAP_MESSAGES {
                self.gap.pop_front();
            }
            self.gap.push_back(m);
            return;
        }
        let _ = self.out.send(m);
    }

    /// Take `session` as this agent's session with the controller: read its messages, heartbeat
    /// at its pace.
    fn listen(&mut self, session: Session) -> Result<(), ControlError> {
        let heartbeat = checked_seconds(session.welcome.heartbeat_s, "heartbeat")?;
        self.lease = checked_seconds(session.welcome.lease_s, "lease")?;
        self.session.close();
        self.session.id += 1;
        let id = self.session.id;
        let tx = self.reports.clone();
        let controller = self.me.controller;
        let mut inbound = session.inbound;
        let reader = self.runtime.spawn(async move {
            loop {
                let next = match inbound.message().await {
                    Ok(Some(m)) => Inbound::Message(id, m),
                    Ok(None) => Inbound::Ended(id, format!("the controller at {controller} ended the session")),
                    Err(e) => Inbound::Ended(id, format!("lost the controller at {controller} ({})", e.message())),
                };
                let ended = matches!(next, Inbound::Ended(..));
                if tx.send(next).is_err() || ended {
                    return;
                }
            }
        });
        let beats = session.out.clone();
        let job = self.job_id.clone();
        let heartbeats = self.runtime.spawn(async move {
            let mut every = tokio::time::interval(heartbeat);
            loop {
                every.tick().await;
                let m =
                    AgentMessage { job_id: job.clone(), epoch: 0, body: Some(agent_message::Body::Heartbeat(proto::AgentHeartbeat {})) };
                if beats.send(m).is_err() {
                    return;
                }
            }
        });
        self.session.tasks = vec![reader, heartbeats];
        self.out = session.out;
        Ok(())
    }

    /// Whether this node can wait for a controller to take the job back: a grace, workers that
    /// run the job, and the job not ending for this node anyway.
    fn can_wait_for_a_controller(&self) -> bool {
        // (A node whose workers were not started yet attaches again as a newcomer.)
        let started = self.workers.is_some() && self.first_worker.is_some() && !self.exited.iter().all(|&x| x);
        !self.grace.is_zero() && (started || self.workers.is_none())
    }

    /// The controller is lost (`why`): the workers pause after the step in flight (a rendezvous
    /// in progress is called off) and keep their state; this agent tries to attach again until
    /// the grace is over. `session_open`: the controller fell silent, its session did not end —
    /// the session is kept (with its heartbeats), for a controller that was only stalled comes
    /// back on it ([`Node::heard_again`]).
    fn orphan(&mut self, why: String, session_open: bool) {
        tracing::warn!(
            "agent {}: {why}; its workers pause after the step in flight and wait up to {:.0} s for a controller to take the job back ({})",
            self.agent,
            self.grace.as_secs_f64(),
            Setting::ControllerGrace
        );
        if !session_open {
            self.session.close();
        }
        self.silent_session_open = session_open;
        self.refused_meanwhile = None;
        self.orphan_round += 1;
        if let Some(job) = self.workers.as_mut() {
            for slot in 0..self.gpus {
                let epoch = self.slot_epoch[slot];
                for m in [LauncherMessage::Pause { epoch }, LauncherMessage::Abandon { epoch }] {
                    if let Ok(line) = serde_json::to_string(&m) {
                        let _ = job.write_line(slot, &line);
                    }
                }
            }
        }
        let since = Instant::now();
        self.orphaned = Some((since, why));
        let claim = self.first_worker.map(|first_worker| proto::Rejoin {
            job_id: self.job_id.clone(),
            agent: self.agent,
            first_worker,
            epochs: self.slot_epoch.clone(),
            orphaned_ms: 0,
        });
        self.attach_again(claim, since);
    }

    /// The controller this node found silent spoke again on the same session: it was stalled,
    /// not lost, and takes the node back as it was. What the workers said meanwhile goes to it
    /// (their pause after the step in flight among it: the job moves on from there), and an
    /// attach under way is dropped.
    fn heard_again(&mut self) {
        let away = self.orphaned.take().map_or(0.0, |(since, _)| since.elapsed().as_secs_f64());
        tracing::info!(
            "agent {}: the controller at {} spoke again after {away:.1} s (it was stalled, not lost): this node goes on with it",
            self.agent,
            self.me.controller
        );
        self.orphan_round += 1;
        self.silent_session_open = false;
        self.refused_meanwhile = None;
        for m in self.gap.drain(..) {
            let _ = self.out.send(m);
        }
    }

    /// Try to attach again until the grace (counted from `since`) is over: with `claim`, to
    /// this node's place in the job; without, as a newcomer.
    fn attach_again(&self, claim: Option<proto::Rejoin>, since: Instant) {
        let (me, tx, until, round) = (self.me.clone(), self.reports.clone(), since + self.grace, self.orphan_round);
        self.runtime.spawn(async move {
            let mut backoff = Duration::from_millis(100);
            loop {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return;
                }
                match attach::open(&me, left.min(Duration::from_secs(5)), claim.clone().map(|c| (c, since))).await {
                    Ok(s) => {
                        let _ = tx.send(Inbound::Reattached(round, Box::new(s)));
                        return;
                    }
                    Err(SessionError::Refused(e)) => {
                        let _ = tx.send(Inbound::NotTakenBack(round, e.to_string()));
                        return;
                    }
                    Err(SessionError::Unreachable(_)) => {
                        tokio::time::sleep(backoff.min(left)).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                }
            }
        });
    }

    /// A controller answered this orphaned node and did not take it back (`why`): a node whose
    /// workers stood by attaches again as a newcomer ([`Node::join_afresh`]); any other ends.
    fn not_taken_back(&mut self, why: &str) -> Option<AgentEnd> {
        if self.standing_by && self.first_worker.is_some() {
            self.join_afresh(why);
            return None;
        }
        Some(AgentEnd::Stopped(format!("the controller was lost, and the one that answered did not take this node back: {why}")))
    }

    /// This node was standing by to join when the controller was lost, and the controller that
    /// took the job back does not know it (`why`): its workers, which hold nothing, are stopped,
    /// and the agent attaches again as a newcomer (the grace still counts from the loss).
    fn join_afresh(&mut self, why: &str) {
        tracing::warn!("agent {}: {why}; its workers were standing by: attaching again as a newcomer", self.agent);
        if let Some(mut job) = self.workers.take() {
            job.kill_all();
            job.reap();
        }
        // Reports of the stopped workers still queued are theirs, not the new ones'.
        self.gap.clear();
        self.recent.clear();
        self.last_stop = vec![None; self.gpus];
        self.done = vec![false; self.gpus];
        self.exited = vec![false; self.gpus];
        self.first_worker = None;
        self.standing_by = false;
        let since = self.orphaned.as_ref().map_or_else(Instant::now, |(t, _)| *t);
        self.attach_again(None, since);
    }

    /// A controller took the job back: what it must hear again — the last records, each
    /// worker's last stop, then what the workers said meanwhile.
    fn rejoined(&mut self, session: Session) -> Result<(), ControlError> {
        let away = self.orphaned.take().map_or(0.0, |(since, _)| since.elapsed().as_secs_f64());
        tracing::info!("agent {}: taken back by the controller at {} after {away:.1} s without one", self.agent, self.me.controller);
        // (A newcomer gets a number of its own.)
        self.agent = session.welcome.agent;
        self.listen(session)?;
        // A worker that ended is told first, so that the controller never counts its stop.
        let exits: Vec<AgentMessage> = (0..self.gpus)
            .filter(|&slot| self.exited[slot])
            .map(|slot| {
                let status = self.workers.as_mut().map(|j| j.exit_status(slot)).unwrap_or_default();
                let body = agent_message::Body::Exited(proto::WorkerExited { slot: slot as u32, status });
                AgentMessage { job_id: self.job_id.clone(), epoch: self.slot_epoch[slot], body: Some(body) }
            })
            .collect();
        let stops = (0..self.gpus).filter(|&slot| !self.exited[slot]).filter_map(|slot| self.last_stop[slot].clone());
        let again: Vec<AgentMessage> = exits.into_iter().chain(self.recent.iter().cloned()).chain(stops).collect();
        for m in again.into_iter().chain(self.gap.drain(..)) {
            let _ = self.out.send(m);
        }
        Ok(())
    }

    /// Pass on one report (or the exit) of worker `slot`.
    fn relay(&mut self, slot: usize, event: Option<WorkerEvent>) {
        let Some(job) = self.workers.as_mut() else { return };
        let epoch = self.slot_epoch[slot];
        let body = match &event {
            Some(ev) => {
                if matches!(ev, WorkerEvent::Done { .. }) {
                    self.done[slot] = true;
                }
                if matches!(ev, WorkerEvent::Heartbeat) && self.orphaned.is_some() {
                    // Nobody to hear it; the next controller hears the worker itself.
                    return;
                }
                match lazarus_protocol::relay::reports::to_proto(slot, ev) {
                    Ok(report) => agent_message::Body::Report(report),
                    // Said as the worker's failure: the controller hears of it, typed.
                    Err(e) => agent_message::Body::Report(proto::WorkerReport {
                        slot: slot as u32,
                        event: Some(proto::worker_report::Event::Failed(proto::worker_report::Failed {
                            kind: proto::FailureKind::Error as i32,
                            message: format!("worker {slot} sent what no agent carries: {e}"),
                        })),
                    }),
                }
            }
            None => {
                self.exited[slot] = true;
                agent_message::Body::Exited(proto::WorkerExited { slot: slot as u32, status: job.exit_status(slot) })
            }
        };
        // What a controller that takes the job back must hear again.
        let kept = AgentMessage { job_id: self.job_id.clone(), epoch, body: Some(body.clone()) };
        match &event {
            Some(WorkerEvent::StepFailed { .. } | WorkerEvent::Paused { .. }) => self.last_stop[slot] = Some(kept),
            Some(WorkerEvent::Ready { .. }) => self.last_stop[slot] = None,
            Some(WorkerEvent::Step { .. } | WorkerEvent::Checkpointed { .. } | WorkerEvent::Evaluated { .. })
                if self.orphaned.is_none() =>
            {
                if self.recent.len() == RECENT_RECORDS {
                    self.recent.pop_front();
                }
                self.recent.push_back(kept);
            }
            _ => {}
        }
        self.up(epoch, body);
    }

    /// One message of the controller. Some(Ok): this node's part in the job is over; Some(Err):
    /// the job completed (why), the workers are finishing.
    fn take(
        &mut self,
        m: ControllerMessage,
        on_start: &mut impl FnMut(&[u32]) -> Result<(), ControlError>,
    ) -> Result<Option<Result<AgentEnd, String>>, ControlError> {
        let Some(body) = m.body else { return Ok(None) };
        match body {
            controller_message::Body::Welcome(_)
            | controller_message::Body::Challenge(_)
            | controller_message::Body::Ping(_)
            | controller_message::Body::Piece(_) => {}
            controller_message::Body::Start(s) => {
                if self.workers.is_some() {
                    tracing::warn!("agent: a second start of the workers: dropped");
                    return Ok(None);
                }
                if s.workers.len() != self.gpus {
                    return Err(ControlError::Launch(format!(
                        "the controller sent {} worker slots for {} GPUs",
                        s.workers.len(),
                        self.gpus
                    )));
                }
                let bad_start = |e: lazarus_protocol::relay::BadMessage| ControlError::Launch(format!("the controller's start: {e}"));
                let ranks: Vec<u32> = start::ranks(&s).map_err(bad_start)?;
                // The slots come without the job's secret: this agent adds the one it proved.
                let specs = start::spec_lines(&s, self.secret).map_err(bad_start)?;
                let reports = self.reports.clone();
                self.workers = Some(start_processes_reporting(WORKER_SUBCOMMAND, &specs, Confinement::Shared, reports, Inbound::Worker)?);
                self.slot_epoch = vec![m.epoch; self.gpus];
                self.first_worker = ranks.first().map(|&r| u64::from(r));
                self.standing_by = s.standby;
                on_start(&ranks)?;
            }
            controller_message::Body::Input(i) => {
                // Checked here, for every worker of the node at once, and handed to each as
                // the line of the launcher protocol it reads.
                let line = match worker_line(&i) {
                    Ok(line) => line,
                    Err(e) => {
                        tracing::warn!("agent: a message for workers {:?} that is not one: {e}: dropped", i.slots);
                        return Ok(None);
                    }
                };
                let Some(job) = self.workers.as_mut() else { return Ok(None) };
                for slot in i.slots.iter().map(|&s| s as usize).filter(|&s| s < self.gpus) {
                    if m.epoch < self.slot_epoch[slot] {
                        tracing::debug!(
                            "agent: a stale message for worker {slot} (epoch {} < {}): dropped",
                            m.epoch,
                            self.slot_epoch[slot]
                        );
                        continue;
                    }
                    self.slot_epoch[slot] = m.epoch;
                    // A worker standing by hears nothing until the move that takes it in.
                    self.standing_by = false;
                    // A worker that cannot be written to has exited: its exit is reported.
                    let _ = job.write_line(slot, &line);
                }
            }
            controller_message::Body::Kill(k) => {
                let slot = k.slot as usize;
                if let Some(job) = self.workers.as_mut().filter(|_| slot < self.gpus) {
                    tracing::warn!("agent: worker {slot} killed by the controller: {}", k.reason);
                    job.kill(slot);
                }
            }
            controller_message::Body::Shutdown(s) => {
                if !s.completed {
                    return Ok(Some(Ok(AgentEnd::Stopped(format!("the controller stopped the job: {}", s.reason)))));
                }
                return Ok(Some(Err(s.reason)));
            }
        }
        Ok(None)
    }
}

/// The line a worker reads for a message from the controller: checked
/// (`lazarus_protocol::relay::orders`), then written as the launcher protocol's JSON.
fn worker_line(input: &proto::WorkerInput) -> Result<String, String> {
    let message = lazarus_protocol::relay::orders::decode_input(input).map_err(|e| e.to_string())?;
    serde_json::to_string(&message).map_err(|e| e.to_string())
}
