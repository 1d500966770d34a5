//! Synthetic node agents, for measuring a controller at the size of a real cluster on one
//! machine (`lazarus bench controller`): each speaks the real `Control.Attach` protocol — TLS
//! pinned by the job's secret, the challenge, the hello, heartbeats, its workers' reports — but
//! its workers are fakes that answer the controller's messages as workers do and train nothing.
//!
//! What stands in for the workers' data plane is one [`Plane`] for the whole job: the step
//! count, whether training runs, and which ranks of the current epoch are ready. Rank 0's fake
//! reports a step every `step_every` while every rank is ready; a node loss is made by ending
//! one agent's session (as a SIGKILLed agent's connection ends) while every other worker reports
//! the step it was in as failed — what their peers' connections would have told them — with the
//! experts it holds, taken from the replica map each fake keeps up to date from the moves.
//!
//! Everything the fakes see is timed ([`Mark`]), so that a benchmark can say when the
//! controller's commands reached the agents, not only when the controller decided.

use lazarus_setting::Setting;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use lazarus_model::StepReport;
use lazarus_plan::{PlanUpdate, ReplicaMap};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::agent::attach::{self, Identity, Session};
use lazarus_protocol::proto::{self, agent_message, controller_message, AgentMessage, ControllerMessage};
use lazarus_protocol::tls::ClientTls;
use lazarus_protocol::ControlError;
use lazarus_protocol::{FailureKind, LauncherMessage, MoveStats, WorkerEvent};

/// How the synthetic agents reach their controller and pace their job.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub controller: SocketAddr,
    pub secret: u128,
    /// Workers (GPU slots) of each agent.
    pub gpus: usize,
    /// How often rank 0 reports a step while every rank is ready.
    pub step_every: Duration,
    /// Tokens each replica is routed per step: the fakes report each expert's load as its
    /// replicas in the job's first map times this (the loads the plan was made for), so that
    /// the controller's load monitor sees the job it planned.
    pub tokens_per_replica: u64,
}

/// What the fakes saw, with when.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mark {
    /// Agent `agent` was sent its workers.
    Started { agent: usize },
    /// Agent `agent` got the move (or rollback) to `epoch` for its workers.
    Ordered { agent: usize, epoch: u64 },
    /// Agent `agent` was asked to pause its workers at `epoch`.
    Paused { agent: usize, epoch: u64 },
    /// Every rank of `epoch` is ready: training goes on.
    AllReady { epoch: u64 },
    /// Rank 0 reported step `step`.
    Step { step: u64 },
}

/// Messages the synthetic agents exchanged with the controller.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Agent heartbeats sent.
    pub agent_heartbeats: u64,
    /// Worker heartbeats relayed.
    pub worker_heartbeats: u64,
    /// Other reports of workers (steps, rendezvous, stops).
    pub reports: u64,
    /// Messages from the controller, and their encoded bytes.
    pub received: u64,
    pub received_bytes: u64,
}

/// The job's data plane, as the fakes share it.
#[derive(Debug, Default)]
struct Plane {
    epoch: u64,
    /// The worker (id) of each rank of `epoch`.
    workers: Vec<u64>,
    ready: usize,
    training: bool,
    steps_done: u64,
    /// When every rank became ready, or the last step was reported: the next step is due a
    /// step's time later.
    since: Option<Instant>,
}

/// A replica map the fakes were given, with what each rank holds of it (`holds[rank][layer]`).
struct Placed {
    map: ReplicaMap,
    holds: Vec<Vec<Vec<usize>>>,
    /// Each expert's replicas times the tokens of a replica: the loads the fakes report.
    loads: Vec<Vec<u64>>,
    /// The same loads moved between experts (expert e takes expert E − 1 − e's): what they
    /// report once the popularity drifts ([`SyntheticFleet::drift`]).
    drifted: Vec<Vec<u64>>,
}

impl Placed {
    fn new(map: ReplicaMap, tokens_per_replica: u64) -> Self {
        let mut holds = vec![vec![Vec::new(); map.layer_count()]; map.ranks()];
        let mut loads = vec![vec![0; map.experts()]; map.layer_count()];
        for l in 0..map.layer_count() {
            for e in 0..map.experts() {
                for &(rank, count) in map.placed(l, e) {
                    holds[rank][l].push(e);
                    loads[l][e] += u64::from(count) * tokens_per_replica;
                }
            }
        }
        let drifted = loads.iter().map(|l| l.iter().rev().copied().collect()).collect();
        Placed { map, holds, loads, drifted }
    }
}

struct Shared {
    opts: LoadOptions,
    plane: Mutex<Plane>,
    /// The map of each epoch the fakes moved to (resolved once for all of them).
    maps: Mutex<BTreeMap<u64, Arc<Placed>>>,
    /// The job's first map (parsed once from the first agent's start).
    first: OnceLock<Result<Arc<Placed>, String>>,
    /// The agent each worker id belongs to.
    agent_of: Mutex<HashMap<u64, usize>>,
    marks: Mutex<Vec<(Instant, Mark)>>,
    agent_heartbeats: AtomicU64,
    worker_heartbeats: AtomicU64,
    reports: AtomicU64,
    received: AtomicU64,
    received_bytes: AtomicU64,
    /// Why an agent stopped other than by being told to (the first few).
    trouble: Mutex<Vec<String>>,
    /// The last long line read, with its message.
    last_line: Mutex<Option<(prost::bytes::Bytes, Arc<LauncherMessage>)>>,
    /// Whether the loads reported have drifted ([`SyntheticFleet::drift`]).
    drifted: std::sync::atomic::AtomicBool,
}

impl Shared {
    fn mark(&self, m: Mark) {
        self.mark_at(Instant::now(), m);
    }

    fn mark_at(&self, at: Instant, m: Mark) {
        self.marks.lock().unwrap_or_else(|e| e.into_inner()).push((at, m));
    }

    fn plane(&self) -> std::sync::MutexGuard<'_, Plane> {
        self.plane.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn trouble(&self, why: String) {
        let mut t = self.trouble.lock().unwrap_or_else(|e| e.into_inner());
        if t.len() < 8 {
            t.push(why);
        }
    }

    /// The message of a line to workers. A long line (a move's order) comes to every agent
    /// alike: it is read once for all of them (a thousand fakes parsing megabytes each would
    /// starve their own heartbeats on a small machine), compared byte for byte.
    fn read_line(&self, i: &proto::WorkerInput) -> Result<Arc<LauncherMessage>, String> {
        let long = i.message.len() > 4096;
        if long {
            let last = self.last_line.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(message) = last.as_ref().filter(|(b, _)| *b == i.message).map(|(_, m)| m.clone()) {
                return Ok(message);
            }
        }
        let message = Arc::new(lazarus_protocol::relay::orders::decode_input(i).map_err(|e| e.to_string())?);
        if long {
            *self.last_line.lock().unwrap_or_else(|e| e.into_inner()) = Some((i.message.clone(), message.clone()));
        }
        Ok(message)
    }

    /// The placed map of `epoch`, resolving `update` against the map of `from` the first time.
    fn place(&self, epoch: u64, update: &PlanUpdate, from: Option<u64>) -> Result<Arc<Placed>, String> {
        let mut maps = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = maps.get(&epoch) {
            return Ok(p.clone());
        }
        let base = from.and_then(|e| maps.get(&e)).map(|p| &p.map);
        let map = update.clone().resolve(base).map_err(|e| format!("the plan of epoch {epoch}: {e}"))?;
        let placed = Arc::new(Placed::new(map, self.opts.tokens_per_replica));
        maps.insert(epoch, placed.clone());
        Ok(placed)
    }
}

/// What the orchestrator tells one synthetic agent.
enum Order {
    /// End the session now (the node is lost).
    Die,
    /// Every worker reports the step it was in as failed (a peer was lost).
    Fail,
    /// Rank 0 (a worker of this agent) reports step `.0`.
    Step(u64),
}

/// One fake worker of a synthetic agent.
struct Slot {
    id: u64,
    /// Its rank in the epoch it was last moved to (None: standing by).
    rank: Option<usize>,
    /// The epoch it was last given (its reports are stamped with it).
    epoch: u64,
    /// The epoch of the map it holds.
    map_epoch: Option<u64>,
    moved: bool,
    alive: bool,
}

/// The synthetic agents of one controller, on a runtime of their own.
pub struct SyntheticFleet {
    runtime: tokio::runtime::Runtime,
    shared: Arc<Shared>,
    agents: Vec<UnboundedSender<Order>>,
}

impl SyntheticFleet {
    /// A fleet with no agent yet, and the stepper of rank 0.
    pub fn new(opts: LoadOptions, threads: usize) -> Result<Self, ControlError> {
        lazarus_protocol::node_gpus(Setting::Gpus, opts.gpus)?;
        let runtime = lazarus_protocol::rpc::runtime(threads.max(1), "lazarus-loadgen")?;
        let shared = Arc::new(Shared {
            opts,
            plane: Mutex::default(),
            maps: Mutex::default(),
            first: OnceLock::new(),
            agent_of: Mutex::default(),
            marks: Mutex::default(),
            agent_heartbeats: AtomicU64::new(0),
            worker_heartbeats: AtomicU64::new(0),
            reports: AtomicU64::new(0),
            received: AtomicU64::new(0),
            received_bytes: AtomicU64::new(0),
            trouble: Mutex::default(),
            last_line: Mutex::default(),
            drifted: std::sync::atomic::AtomicBool::new(false),
        });
        let fleet = SyntheticFleet { runtime, shared, agents: Vec::new() };
        Ok(fleet)
    }

    /// Attach `n` more agents (each in its own session, as a node's agent does).
    pub fn attach(&mut self, n: usize) {
        for _ in 0..n {
            let index = self.agents.len();
            let (tx, rx) = unbounded_channel();
            self.agents.push(tx);
            let shared = self.shared.clone();
            self.runtime.spawn(async move {
                if let Err(why) = run_agent(index, shared.clone(), rx).await {
                    shared.trouble(format!("agent {index}: {why}"));
                }
            });
        }
    }

    /// From now on the steps report drifted loads: the experts' popularity moves (each layer's
    /// loads reversed over its experts), as a rebalance is for.
    pub fn drift(&self) {
        self.shared.drifted.store(true, Relaxed);
    }

    /// Rank 0 reports a step every `step_every` while every rank of the epoch is ready.
    pub fn start_stepping(&self) {
        let (shared, agents) = (self.shared.clone(), self.agents.clone());
        let agents = Arc::new(Mutex::new(agents));
        self.runtime.spawn(async move {
            let every = shared.opts.step_every;
            let mut tick = tokio::time::interval((every / 20).clamp(Duration::from_millis(1), Duration::from_millis(5)));
            loop {
                tick.tick().await;
                let (step, rank0) = {
                    let mut p = shared.plane();
                    let now = Instant::now();
                    if !p.training || p.workers.is_empty() || p.since.is_some_and(|t| now < t + every) {
                        continue;
                    }
                    p.steps_done += 1;
                    p.since = Some(now);
                    (p.steps_done, p.workers[0])
                };
                let agent = shared.agent_of.lock().unwrap_or_else(|e| e.into_inner()).get(&rank0).copied();
                if let Some(tx) = agent.and_then(|a| agents.lock().unwrap_or_else(|e| e.into_inner()).get(a).cloned()) {
                    let _ = tx.send(Order::Step(step));
                }
            }
        });
    }

    /// Workers of each agent.
    pub fn gpus(&self) -> usize {
        self.shared.opts.gpus
    }

    /// Lose agent `index`'s node: its session ends, and every other worker reports its step
    /// failed. Training stops with the step in flight (its peers lost).
    pub fn lose_node(&self, index: usize) {
        self.shared.plane().training = false;
        if let Some(tx) = self.agents.get(index) {
            let _ = tx.send(Order::Die);
        }
        for (i, tx) in self.agents.iter().enumerate() {
            if i != index {
                let _ = tx.send(Order::Fail);
            }
        }
    }

    /// Wait until `done` holds of the plane (epoch, ranks ready, training, steps), at most
    /// `within`; whether it did.
    pub fn wait_until(&self, within: Duration, done: impl Fn(&PlaneView) -> bool) -> bool {
        let until = Instant::now() + within;
        loop {
            if done(&self.plane()) {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// The data plane now.
    pub fn plane(&self) -> PlaneView {
        let p = self.shared.plane();
        PlaneView { epoch: p.epoch, world: p.workers.len(), ready: p.ready, training: p.training, steps_done: p.steps_done }
    }

    /// Everything the fakes saw since `since`.
    pub fn marks_since(&self, since: Instant) -> Vec<(Instant, Mark)> {
        self.shared.marks.lock().unwrap_or_else(|e| e.into_inner()).iter().filter(|(t, _)| *t >= since).copied().collect()
    }

    /// The messages exchanged so far.
    pub fn traffic(&self) -> Traffic {
        let s = &self.shared;
        Traffic {
            agent_heartbeats: s.agent_heartbeats.load(Relaxed),
            worker_heartbeats: s.worker_heartbeats.load(Relaxed),
            reports: s.reports.load(Relaxed),
            received: s.received.load(Relaxed),
            received_bytes: s.received_bytes.load(Relaxed),
        }
    }

    /// Why agents stopped on their own (the first few), if any did.
    pub fn trouble(&self) -> Vec<String> {
        self.shared.trouble.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Drop for SyntheticFleet {
    fn drop(&mut self) {
        for tx in &self.agents {
            let _ = tx.send(Order::Die);
        }
    }
}

/// The data plane as the orchestrator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaneView {
    pub epoch: u64,
    pub world: usize,
    pub ready: usize,
    pub training: bool,
    pub steps_done: u64,
}

/// One synthetic agent: attach, then answer the controller and the orchestrator until told to
/// die or the session ends.
async fn run_agent(index: usize, shared: Arc<Shared>, mut orders: UnboundedReceiver<Order>) -> Result<(), String> {
    let me = Identity {
        controller: shared.opts.controller,
        controller_name: shared.opts.controller.to_string(),
        gpus: shared.opts.gpus,
        host: IpAddr::from([127, 0, 0, 1]),
        secret: shared.opts.secret,
        tls: ClientTls::Pinned(lazarus_protocol::tls::pin(shared.opts.secret)),
    };
    // Like a real agent: an attach cut is tried again (a thousand fakes attach at once from one
    // address, beyond the controller's 32 handshakes under way per address), the fakes' tries
    // spread so that those cut together do not come back together.
    let pause = Duration::from_millis(50 + (index as u64 * 37) % 200);
    let Session { out, mut inbound, job_id, welcome } =
        attach::open_retrying(&me, Duration::from_secs(120), pause).await.map_err(|e| e.to_string())?;
    let heartbeat = Duration::from_secs_f64(welcome.heartbeat_s.clamp(0.01, 60.0));
    let mut agent = FakeAgent { index, shared: shared.clone(), out, job_id, slots: Vec::new() };
    let mut beat = tokio::time::interval(heartbeat);
    let mut pieces = lazarus_protocol::pieces::Gathered::default();
    loop {
        tokio::select! {
            m = inbound.message() => match m {
                Ok(Some(m)) => {
                    agent.count(&m);
                    match pieces.take(m, lazarus_protocol::MAX_CONTROL_MESSAGE) {
                        Ok(Some(m)) => {
                            if !agent.take(m) {
                                return Ok(());
                            }
                        }
                        Ok(None) => {}
                        Err(e) => agent.shared.trouble(format!("agent {index}: {e}")),
                    }
                }
                Ok(None) => return Err("the controller ended the session".into()),
                Err(e) => return Err(format!("the session failed: {}", e.message())),
            },
            o = orders.recv() => match o {
                None | Some(Order::Die) => return Ok(()),
                Some(Order::Fail) => agent.fail_all(),
                Some(Order::Step(step)) => agent.step(step),
            },
            _ = beat.tick() => agent.heartbeat(),
        }
    }
}

struct FakeAgent {
    index: usize,
    shared: Arc<Shared>,
    out: UnboundedSender<AgentMessage>,
    job_id: String,
    slots: Vec<Slot>,
}

impl FakeAgent {
    fn up(&self, epoch: u64, body: agent_message::Body) {
        let _ = self.out.send(AgentMessage { job_id: self.job_id.clone(), epoch, body: Some(body) });
    }

    fn report(&self, slot: usize, event: &WorkerEvent) {
        self.shared.reports.fetch_add(1, Relaxed);
        self.up(self.slots[slot].epoch, agent_message::Body::Report(fake_report(slot, event)));
    }

    fn heartbeat(&self) {
        self.up(0, agent_message::Body::Heartbeat(proto::AgentHeartbeat {}));
        self.shared.agent_heartbeats.fetch_add(1, Relaxed);
        for (i, s) in self.slots.iter().enumerate().filter(|(_, s)| s.alive) {
            self.up(s.epoch, agent_message::Body::Report(fake_report(i, &WorkerEvent::Heartbeat)));
            self.shared.worker_heartbeats.fetch_add(1, Relaxed);
        }
    }

    /// What worker `slot` holds now, per layer.
    fn holds(&self, slot: usize) -> Vec<Vec<usize>> {
        let s = &self.slots[slot];
        let maps = self.shared.maps.lock().unwrap_or_else(|e| e.into_inner());
        match (s.rank, s.map_epoch.and_then(|e| maps.get(&e))) {
            (Some(rank), Some(p)) => p.holds.get(rank).cloned().unwrap_or_default(),
            _ => Vec::new(),
        }
    }

    fn fail_all(&self) {
        let steps_done = self.shared.plane().steps_done;
        for i in 0..self.slots.len() {
            let s = &self.slots[i];
            if !s.alive || s.rank.is_none() {
                continue;
            }
            let event = WorkerEvent::StepFailed {
                epoch: s.epoch,
                steps_done,
                held: None,
                holds: self.holds(i),
                kind: FailureKind::PeerLost,
                message: "a peer's connection dropped (synthetic)".into(),
                last: None,
                snapshots: Vec::new(),
            };
            self.report(i, &event);
        }
    }

    /// Rank 0's report of `step` (the slot of this agent that is rank 0).
    fn step(&self, step: u64) {
        let Some(slot) = self.slots.iter().position(|s| s.rank == Some(0) && s.alive) else { return };
        let Some(Ok(first)) = self.shared.first.get() else { return };
        let loads = if self.shared.drifted.load(Relaxed) { &first.drifted } else { &first.loads };
        let tokens = loads.first().map_or(0, |l| l.iter().sum());
        let report =
            StepReport { step, loss: 3.0, aux_loss: 1.0, tokens, lr: 1e-3, grad_norm: 1.0, expert_load: loads.clone(), dropped: 0 };
        let event =
            WorkerEvent::Step { report, seconds: self.shared.opts.step_every.as_secs_f64(), wire_bytes: 0, dropped: 0, snapshot: None };
        self.report(slot, &event);
        self.shared.mark(Mark::Step { step });
    }

    /// A message of the controller came (a piece or whole): counted as received.
    fn count(&self, m: &ControllerMessage) {
        use prost::Message as _;
        self.shared.received.fetch_add(1, Relaxed);
        self.shared.received_bytes.fetch_add(m.encoded_len() as u64, Relaxed);
    }

    /// One message of the controller (its pieces joined); false: the session is over.
    fn take(&mut self, m: ControllerMessage) -> bool {
        // When it came, before it is read: the controller's part of the time.
        let received = Instant::now();
        let Some(body) = m.body else { return true };
        match body {
            controller_message::Body::Start(s) => self.start(&s),
            controller_message::Body::Input(i) => {
                let message = match self.shared.read_line(&i) {
                    Ok(message) => message,
                    Err(e) => {
                        self.shared.trouble(format!("agent {}: a line that is not a message: {e}", self.index));
                        return true;
                    }
                };
                self.input(&i.slots, &message, received);
            }
            controller_message::Body::Kill(k) => {
                if let Some(s) = self.slots.get_mut(k.slot as usize) {
                    s.alive = false;
                    self.up(m.epoch, agent_message::Body::Exited(proto::WorkerExited { slot: k.slot, status: "killed".into() }));
                }
            }
            controller_message::Body::Shutdown(_) => return false,
            controller_message::Body::Welcome(_)
            | controller_message::Body::Challenge(_)
            | controller_message::Body::Ping(_)
            | controller_message::Body::Piece(_) => {}
        }
        true
    }

    fn start(&mut self, s: &proto::StartWorkers) {
        let standby = s.standby;
        let first = if standby {
            None
        } else {
            match self.shared.first.get_or_init(|| first_map(&s.job, self.shared.opts.tokens_per_replica)) {
                Ok(f) => Some(f.clone()),
                Err(e) => {
                    self.shared.trouble(format!("agent {}: {e}", self.index));
                    return;
                }
            }
        };
        let mut epoch = None;
        for w in &s.workers {
            let Ok(rank) = usize::try_from(w.rank) else {
                self.shared.trouble(format!("agent {}: a slot's rank beyond this machine's words: {}", self.index, w.rank));
                return;
            };
            let id = w.rank;
            epoch = Some(w.epoch);
            self.shared.agent_of.lock().unwrap_or_else(|e| e.into_inner()).insert(id, self.index);
            self.slots.push(Slot {
                id,
                rank: (!standby).then_some(rank),
                epoch: w.epoch,
                map_epoch: first.as_ref().map(|_| w.epoch),
                moved: false,
                alive: true,
            });
        }
        if let (Some(placed), Some(epoch)) = (&first, epoch) {
            self.shared.maps.lock().unwrap_or_else(|e| e.into_inner()).entry(epoch).or_insert_with(|| placed.clone());
            let mut p = self.shared.plane();
            if p.workers.is_empty() {
                p.epoch = epoch;
                p.workers = (0..placed.map.ranks() as u64).collect();
            }
        }
        self.shared.mark(Mark::Started { agent: self.index });
        if !standby {
            for i in 0..self.slots.len() {
                let event = WorkerEvent::Listening { addr: format!("127.0.0.1:{}", 20000 + i), epoch: self.slots[i].epoch };
                self.report(i, &event);
            }
        }
    }

    fn input(&mut self, slots: &[u32], message: &LauncherMessage, received: Instant) {
        let slots: Vec<usize> = slots.iter().map(|&s| s as usize).filter(|&s| s < self.slots.len()).collect();
        match message {
            LauncherMessage::Addrs { epoch, .. } => {
                for &i in &slots {
                    if self.slots[i].epoch != *epoch || !self.slots[i].alive {
                        continue;
                    }
                    let moved = self.slots[i].moved.then(MoveStats::default);
                    self.report(i, &WorkerEvent::Ready { pid: std::process::id(), epoch: *epoch, moved });
                    let all = {
                        let mut p = self.shared.plane();
                        if p.epoch == *epoch {
                            p.ready += 1;
                            if p.ready == p.workers.len() && !p.training {
                                p.training = true;
                                p.since = Some(Instant::now());
                                true
                            } else {
                                false
                            }
                        } else {
                            false
                        }
                    };
                    if all {
                        self.shared.mark(Mark::AllReady { epoch: *epoch });
                    }
                }
            }
            LauncherMessage::Reconfigure { to, .. } | LauncherMessage::Rollback { to, .. } => {
                self.shared.mark_at(received, Mark::Ordered { agent: self.index, epoch: to.change.epoch });
                {
                    let mut p = self.shared.plane();
                    if p.epoch < to.change.epoch {
                        *p = Plane {
                            epoch: to.change.epoch,
                            workers: to.workers.clone(),
                            ready: 0,
                            training: false,
                            steps_done: p.steps_done,
                            since: None,
                        };
                    }
                }
                for &i in &slots {
                    let Some(rank) = to.workers.iter().position(|&w| w == self.slots[i].id) else { continue };
                    if let Err(e) = self.shared.place(to.change.epoch, &to.change.plan, self.slots[i].map_epoch) {
                        self.shared.trouble(format!("agent {}: {e}", self.index));
                        continue;
                    }
                    let s = &mut self.slots[i];
                    (s.rank, s.epoch, s.map_epoch, s.moved) = (Some(rank), to.change.epoch, Some(to.change.epoch), true);
                    let event = WorkerEvent::Listening { addr: format!("127.0.0.1:{}", 20000 + i), epoch: to.change.epoch };
                    self.report(i, &event);
                }
            }
            LauncherMessage::Pause { epoch } => {
                self.shared.mark_at(received, Mark::Paused { agent: self.index, epoch: *epoch });
                let steps_done = {
                    let mut p = self.shared.plane();
                    p.training = false;
                    p.steps_done
                };
                for &i in &slots {
                    let holds = self.holds(i);
                    let event = WorkerEvent::Paused { epoch: self.slots[i].epoch, steps_done, holds, snapshots: Vec::new() };
                    self.report(i, &event);
                }
            }
            LauncherMessage::Finish { .. } => {
                for &i in &slots {
                    self.report(i, &WorkerEvent::Done { checkpoint: None });
                }
            }
            LauncherMessage::Abandon { .. } => {
                let steps_done = self.shared.plane().steps_done;
                for &i in &slots {
                    let event = WorkerEvent::StepFailed {
                        epoch: self.slots[i].epoch,
                        steps_done,
                        held: None,
                        holds: self.holds(i),
                        kind: FailureKind::Comm,
                        message: "the rendezvous was abandoned".into(),
                        last: None,
                        snapshots: Vec::new(),
                    };
                    self.report(i, &event);
                }
            }
            // Fakes move no state: a node's part of a move's transfers is only read.
            LauncherMessage::Fence { .. } | LauncherMessage::Transfers { .. } => {}
        }
    }
}

/// What a fake sends for its worker's event (a fake's workers train: they have no benchmark
/// results, the one event agents do not carry).
fn fake_report(slot: usize, event: &WorkerEvent) -> proto::WorkerReport {
    lazarus_protocol::relay::reports::to_proto(slot, event).unwrap_or_default()
}

/// The job's first map, from the job every first agent is sent.
fn first_map(job: &[u8], tokens_per_replica: u64) -> Result<Arc<Placed>, String> {
    let job = lazarus_protocol::relay::start::decode_job(job).map_err(|e| e.to_string())?;
    Ok(Arc::new(Placed::new(job.plan, tokens_per_replica)))
}
