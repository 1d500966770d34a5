//! `lazarus agent`: one per node. It attaches to the controller (`Control.Attach`, with the
//! job's secret), starts the workers the controller gives it — one per GPU slot — relays their
//! reports up and the controller's messages down, heartbeats, and watches the controller:
//!
//! * its workers never outlive it (each dies with it: `PR_SET_PDEATHSIG`, and its stdin closes);
//! * a worker's exit is reported at once (the controller re-plans without waiting for a lease);
//! * a controller silent for longer than its lease — gone, hung or cut off — stops this node's
//!   workers cleanly (they abandon the step in flight; checkpoints are written atomically, so
//!   nothing on disk is left inconsistent) and the agent exits with the reason;
//! * messages of another job, or stamped with an epoch older than the one a worker was last
//!   given, are dropped;
//! * SIGTERM is a preemption notice (paper §3: a spot node is told before it is taken): the
//!   agent tells the controller its node leaves, the controller moves the job off it — its
//!   workers finish the step in flight and hand over what only they hold — and the workers leave;
//!   the agent exits once they have (or after [`DRAIN_WITHIN`], or at a second SIGTERM).

use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use crate::error::ControlError;
use crate::launcher::{start_processes_reporting, Confinement, Job};
use crate::proto::{self, agent_message, controller_message, AgentMessage, ControllerMessage};
use crate::protocol::MAX_WORKERS;
use crate::protocol::{secret_hex, WorkerEvent};
use crate::tls::ClientTls;
use lazarus_comm::auth;

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
}

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

/// A worker's spec line (the worker protocol's JSON) with the job's secret filled in.
fn with_secret(spec: &str, secret: u128) -> Result<String, ControlError> {
    let mut v: serde_json::Value = serde_json::from_str(spec)?;
    match v.as_object_mut() {
        Some(o) => {
            o.insert("secret".into(), serde_json::Value::String(secret_hex(secret)));
        }
        None => return Err(ControlError::Launch(format!("a worker spec that is not a JSON object: {spec:.80}"))),
    }
    Ok(serde_json::to_string(&v)?)
}

/// What the agent waits on: its session with the controller, and its workers' reports.
enum Inbound {
    Message(ControllerMessage),
    Ended(String),
    /// A worker's report, or its end (`None`).
    Worker(usize, Option<WorkerEvent>),
    /// SIGTERM: the node leaves soon.
    Terminate,
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
    if opts.gpus == 0 || opts.gpus > MAX_WORKERS {
        return Err(ControlError::invalid("--gpus", format!("{} (expected 1 to {MAX_WORKERS})", opts.gpus)));
    }
    let controller: SocketAddr =
        opts.controller.to_socket_addrs().ok().and_then(|mut a| a.next()).ok_or_else(|| {
            ControlError::invalid("--controller", format!("{:?} (expected host:port, e.g. 10.0.0.1:7070)", opts.controller))
        })?;
    let host = match opts.host {
        Some(h) => h,
        None => local_address_towards(controller)?,
    };
    let runtime = crate::service::runtime(1, "lazarus-agent")?;
    let (out, out_rx) = tokio::sync::mpsc::unbounded_channel::<AgentMessage>();
    let connect_within = opts.connect_within;
    let refused = Arc::new(AtomicBool::new(false));
    let endpoint = opts.tls.endpoint(&opts.controller, refused.clone())?.connect_timeout(Duration::from_secs(2)).tcp_nodelay(true);
    let mut inbound = runtime.block_on(async move {
        let deadline = tokio::time::Instant::now() + connect_within;
        let channel = loop {
            // The TLS handshake too is bounded: a port that accepts and never answers is
            // given up at the deadline (--connect-timeout).
            let e = match tokio::time::timeout_at(deadline, endpoint.connect()).await {
                Ok(Ok(c)) => break c,
                Ok(Err(e)) => crate::service::error_chain(&e),
                Err(_) => return Err(ControlError::Launch(format!(
                    "the controller at {controller} did not answer within {} s (--connect-timeout): is it a Lazarus controller?",
                    connect_within.as_secs_f64()
                ))),
            };
            if refused.load(Ordering::Relaxed) {
                return Err(ControlError::Launch(format!(
                    "the server at {controller} is not this job's controller: it does not hold the key the job's secret gives (another job's, or a different --secret-file; a controller serving an operator's certificate needs --tls-ca)"
                )));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(ControlError::Launch(format!(
                    "cannot reach the controller at {controller} within {} s: {e}",
                    connect_within.as_secs_f64()
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let mut client = proto::control_client::ControlClient::new(channel);
        let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(out_rx);
        // A port that takes the connection but never speaks gRPC is given up at the deadline.
        let reply = tokio::time::timeout_at(deadline, client.attach(stream))
            .await
            .map_err(|_| {
                ControlError::Launch(format!(
                    "the controller at {controller} did not answer within {} s (--connect-timeout): is it a Lazarus controller?",
                    connect_within.as_secs_f64()
                ))
            })?
            .map_err(|e| ControlError::Launch(format!("the controller at {controller} refused this agent: {}", e.message())))?;
        Ok::<_, ControlError>(reply.into_inner())
    })?;
    let answer_within = connect_within.max(Duration::from_secs(1));
    // The controller's messages, read on the runtime and handed to the agent's loop.
    let (tx, rx) = mpsc::channel::<Inbound>();
    let tx_workers = tx.clone();
    watch_terminate(tx.clone())?;
    runtime.spawn(async move {
        loop {
            let next = match inbound.message().await {
                Ok(Some(m)) => Inbound::Message(m),
                Ok(None) => Inbound::Ended(format!("the controller at {controller} ended the session")),
                Err(e) => Inbound::Ended(format!("lost the controller at {controller} ({})", e.message())),
            };
            let ended = matches!(next, Inbound::Ended(_));
            if tx.send(next).is_err() || ended {
                return;
            }
        }
    });
    // The controller's challenge, this agent's hello that answers it, and the welcome that
    // proves the controller knows the secret too: the secret itself never crosses the network.
    let refused = |why: String| ControlError::Launch(format!("the controller at {controller} refused this agent: {why}"));
    let silent = |what: &str| {
        ControlError::Launch(format!(
            "no {what} from the controller at {controller} within {} s (--connect-timeout)",
            answer_within.as_secs_f64()
        ))
    };
    let challenge = match rx.recv_timeout(answer_within) {
        Ok(Inbound::Message(ControllerMessage { body: Some(controller_message::Body::Challenge(c)), .. })) => c.nonce,
        Ok(Inbound::Ended(why)) => return Err(refused(why)),
        _ => return Err(silent("challenge")),
    };
    let nonce = auth::nonce().map_err(|e| ControlError::io("drawing a nonce from /dev/urandom", e))?;
    let mut hello = proto::AgentHello {
        proof: Vec::new(),
        nonce: nonce.to_vec(),
        gpus: opts.gpus as u32,
        host: host.to_string(),
        pid: std::process::id(),
    };
    hello.proof = auth::prove(opts.secret, &crate::hub::hello_context(&hello), &challenge, &nonce).to_vec();
    let _ = out.send(AgentMessage { job_id: String::new(), epoch: 0, body: Some(agent_message::Body::Hello(hello)) });
    let welcome = match rx.recv_timeout(answer_within) {
        Ok(Inbound::Message(ControllerMessage { job_id, body: Some(controller_message::Body::Welcome(w)), .. })) => (job_id, w),
        Ok(Inbound::Ended(why)) => return Err(refused(why)),
        _ => return Err(silent("welcome")),
    };
    if !auth::verify(opts.secret, &crate::hub::welcome_context(welcome.1.agent), &nonce, &challenge, &welcome.1.proof) {
        return Err(ControlError::Launch(format!(
            "the controller at {controller} did not prove it knows the job's secret: not this job's controller"
        )));
    }
    let (job_id, w) = welcome;
    let lease = checked_seconds(w.lease_s, "lease")?;
    let heartbeat = checked_seconds(w.heartbeat_s, "heartbeat")?;
    tracing::info!("agent {}: attached to job {job_id} at {controller} with {} workers listening on {host}", w.agent, opts.gpus);
    let beats = out.clone();
    let beat_job = job_id.clone();
    runtime.spawn(async move {
        let mut every = tokio::time::interval(heartbeat);
        loop {
            every.tick().await;
            let m =
                AgentMessage { job_id: beat_job.clone(), epoch: 0, body: Some(agent_message::Body::Heartbeat(proto::AgentHeartbeat {})) };
            if beats.send(m).is_err() {
                return;
            }
        }
    });
    let mut node = Node {
        job_id,
        out,
        gpus: opts.gpus,
        workers: None,
        reports: tx_workers,
        slot_epoch: vec![0; opts.gpus],
        done: vec![false; opts.gpus],
        exited: vec![false; opts.gpus],
        secret: opts.secret,
    };
    let end = node.serve(&rx, lease, &mut on_start);
    // The workers go with the agent's part in the job, whatever ended it.
    if let Some(mut job) = node.workers.take() {
        job.kill_all();
        job.reap();
    }
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
}

impl Node {
    fn up(&self, epoch: u64, body: agent_message::Body) {
        let _ = self.out.send(AgentMessage { job_id: self.job_id.clone(), epoch, body: Some(body) });
    }

    /// Relay until the job ends for this node.
    fn serve(
        &mut self,
        rx: &mpsc::Receiver<Inbound>,
        lease: Duration,
        on_start: &mut impl FnMut(&[u32]) -> Result<(), ControlError>,
    ) -> Result<AgentEnd, ControlError> {
        let mut last_heard = Instant::now();
        // Once the controller says the job completed: until when the workers may take to exit.
        let mut finishing: Option<(Instant, String)> = None;
        // Once this node gave notice: until when it waits for the job to move off it.
        let mut draining: Option<Instant> = None;
        loop {
            if let Some(until) = draining {
                if self.workers.is_none() || self.exited.iter().all(|&x| x) {
                    return Ok(AgentEnd::Drained);
                }
                if Instant::now() >= until {
                    return Ok(AgentEnd::Stopped(format!(
                        "the job did not move off this node within {} s of its notice: its workers are stopped",
                        DRAIN_WITHIN.as_secs()
                    )));
                }
            }
            if let Some((until, reason)) = &finishing {
                if self.workers.is_none() || self.exited.iter().all(|&x| x) || Instant::now() >= *until {
                    return Ok(if self.done.iter().all(|&d| d) {
                        AgentEnd::Completed { how: reason.clone() }
                    } else {
                        AgentEnd::Stopped(format!("the job ended ({reason}) before this node's workers finished"))
                    });
                }
            }
            let deadline = match (&finishing, draining) {
                (Some((until, _)), _) => *until,
                (None, Some(until)) => until.min(last_heard + lease),
                (None, None) => last_heard + lease,
            };
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))) {
                Ok(Inbound::Worker(slot, event)) => self.relay(slot, event),
                Ok(Inbound::Terminate) => {
                    if draining.is_some() || self.workers.is_none() {
                        return Ok(AgentEnd::Stopped("SIGTERM".into()));
                    }
                    tracing::warn!(
                        "agent: SIGTERM: this node leaves; asking the controller to move the job off it (a second SIGTERM stops at once)"
                    );
                    self.up(0, agent_message::Body::Leaving(proto::Leaving { reason: "SIGTERM (a preemption notice)".into() }));
                    draining = Some(Instant::now() + DRAIN_WITHIN);
                }
                Ok(Inbound::Message(m)) => {
                    if m.job_id != self.job_id {
                        tracing::warn!("agent: a message of job {:?} (this is {:?}): dropped", m.job_id, self.job_id);
                        continue;
                    }
                    last_heard = Instant::now();
                    match self.take(m, on_start)? {
                        Some(Ok(end)) => return Ok(end),
                        Some(Err(reason)) => finishing = Some((Instant::now() + FINISH_WITHIN, reason)),
                        None => {}
                    }
                }
                Ok(Inbound::Ended(why)) => {
                    if finishing.is_some() || (self.workers.is_some() && self.done.iter().all(|&d| d)) {
                        // Let the workers' last reports and exits go the same way as after a shutdown.
                        finishing.get_or_insert((Instant::now() + FINISH_WITHIN, why));
                        continue;
                    }
                    return Ok(AgentEnd::Stopped(why));
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return Ok(AgentEnd::Stopped("the session with the controller ended".into())),
            }
            let silent = last_heard.elapsed();
            if finishing.is_none() && silent > lease {
                return Ok(AgentEnd::Stopped(format!(
                    "the controller was silent for {:.1} s (lease {:.1} s): this node's workers are stopped",
                    silent.as_secs_f64(),
                    lease.as_secs_f64()
                )));
            }
        }
    }

    /// Pass on one report (or the exit) of worker `slot`.
    fn relay(&mut self, slot: usize, event: Option<WorkerEvent>) {
        let Some(job) = self.workers.as_mut() else { return };
        let body = match event {
            Some(ev) => {
                if matches!(ev, WorkerEvent::Done { .. }) {
                    self.done[slot] = true;
                }
                match serde_json::to_string(&ev) {
                    Ok(json) => agent_message::Body::Report(proto::WorkerReport { slot: slot as u32, json }),
                    Err(e) => return tracing::warn!("agent: worker {slot}: {e}"),
                }
            }
            None => {
                self.exited[slot] = true;
                agent_message::Body::Exited(proto::WorkerExited { slot: slot as u32, status: job.exit_status(slot) })
            }
        };
        self.up(self.slot_epoch[slot], body);
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
            controller_message::Body::Welcome(_) | controller_message::Body::Challenge(_) | controller_message::Body::Ping(_) => {}
            controller_message::Body::Start(s) => {
                if self.workers.is_some() {
                    tracing::warn!("agent: a second start of the workers: dropped");
                    return Ok(None);
                }
                if s.specs.len() != self.gpus {
                    return Err(ControlError::Launch(format!(
                        "the controller sent {} worker specs for {} slots",
                        s.specs.len(),
                        self.gpus
                    )));
                }
                let ranks: Vec<u32> = s
                    .specs
                    .iter()
                    .map(|spec| {
                        serde_json::from_str::<serde_json::Value>(spec).ok().and_then(|v| v["rank"].as_u64()).unwrap_or(u64::MAX) as u32
                    })
                    .collect();
                // The specs come without the job's secret: this agent adds the one it proved.
                let specs = s.specs.iter().map(|spec| with_secret(spec, self.secret)).collect::<Result<Vec<_>, _>>()?;
                let reports = self.reports.clone();
                self.workers = Some(start_processes_reporting(WORKER_SUBCOMMAND, &specs, Confinement::Shared, reports, Inbound::Worker)?);
                self.slot_epoch = vec![m.epoch; self.gpus];
                on_start(&ranks)?;
            }
            controller_message::Body::Input(i) => {
                let slot = i.slot as usize;
                let Some(job) = self.workers.as_mut().filter(|_| slot < self.gpus) else { return Ok(None) };
                if m.epoch < self.slot_epoch[slot] {
                    tracing::debug!("agent: a stale message for worker {slot} (epoch {} < {}): dropped", m.epoch, self.slot_epoch[slot]);
                    return Ok(None);
                }
                self.slot_epoch[slot] = m.epoch;
                // A worker that cannot be written to has exited: its exit is reported.
                let _ = job.write_line(slot, &i.line);
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
