//! The controller's side of its node agents (docs/architecture.md): agents attach
//! over gRPC (`Control.Attach`, a stream each way), proving they know the job's secret; once the
//! job's workers are all spoken for, each agent is sent the specs of its workers, and from then
//! on the hub relays — workers' reports in, the controller's messages out — as a [`Fleet`] the
//! controller's loop drives exactly like the processes it starts itself.
//!
//! What arrives is checked before the loop sees it: the job id of every message, the slot of
//! every report, the report itself (the worker protocol's JSON), and its epoch — a report from an
//! older epoch than the one the controller last gave that worker is stale and dropped
//! ([`stale`]). An agent whose stream ends, or that sends another job's messages, is gone, and
//! every worker of it with it.

mod fleet;
#[cfg(test)]
mod tests;

pub(crate) use fleet::Joiner;
pub use fleet::RemoteFleet;

use lazarus_setting::Setting;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;
use tonic::Status;

use lazarus_comm::auth;
use lazarus_decide::words::id_list;
use lazarus_protocol::handshake::{hello_context, welcome_context};
use lazarus_protocol::proto::{self, agent_message, controller_message, AgentHello, AgentMessage, ControllerMessage};
use lazarus_protocol::ControlError;
use lazarus_protocol::WorkerEvent;

/// How long an agent has to say hello once connected.
const HELLO_WITHIN: Duration = Duration::from_secs(10);

/// How long the start waits, once every worker is attached, for the last arrivals to be told
/// of (they are queued a moment after they are counted).
const TELL_ARRIVALS_WITHIN: Duration = Duration::from_secs(1);

/// The stream of a controller's messages to one agent.
pub type AgentStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<ControllerMessage, Status>> + Send>>;

/// Whether a report stamped with `stamped` is stale for a worker the controller has since moved
/// to `current`: step reports and the rendezvous of an older epoch are; heartbeats, exits,
/// checkpoints and the end of a worker are news whatever their epoch.
pub fn stale(stamped: u64, current: u64, event: &WorkerEvent) -> bool {
    stamped < current
        && matches!(
            event,
            WorkerEvent::Step { .. }
                | WorkerEvent::Listening { .. }
                | WorkerEvent::Ready { .. }
                | WorkerEvent::StepFailed { .. }
                | WorkerEvent::Paused { .. }
        )
}

/// What the hub hands the controller's loop.
#[derive(Debug)]
pub(crate) enum HubInput {
    Joined {
        agent: u64,
    },
    Report {
        agent: u64,
        slot: usize,
        event: WorkerEvent,
    },
    Exited {
        agent: u64,
        slot: usize,
        status: String,
    },
    Gone {
        agent: u64,
        why: String,
    },
    /// The agent's node leaves soon (a preemption notice).
    Leaving {
        agent: u64,
        reason: String,
    },
    /// An agent of the job taken back re-attached with its workers (ids from `first`).
    Rejoined {
        agent: u64,
        first: usize,
    },
}

/// One attached agent.
struct Link {
    gpus: usize,
    /// The address its workers listen on, as it claims.
    host: String,
    /// Where its connection came from (what it does not choose), once known.
    peer: Option<std::net::SocketAddr>,
    pid: u32,
    tx: UnboundedSender<Result<ControllerMessage, Status>>,
    last_heard: Instant,
    /// Its first worker's rank, once the job started.
    first_rank: Option<usize>,
    gone: Option<String>,
    /// Messages it sent after it was given up (refused).
    refused: u64,
}

impl Link {
    /// An agent just admitted, heard now: its `gpus` workers, from `first_rank` if it re-attached.
    fn admitted(
        hello: &AgentHello,
        gpus: usize,
        tx: UnboundedSender<Result<ControllerMessage, Status>>,
        first_rank: Option<usize>,
    ) -> Self {
        Link {
            gpus,
            host: hello.host.clone(),
            peer: None,
            pid: hello.pid,
            tx,
            last_heard: Instant::now(),
            first_rank,
            gone: None,
            refused: 0,
        }
    }
}

#[derive(Default)]
struct HubState {
    agents: BTreeMap<u64, Link>,
    next_agent: u64,
    started: bool,
    /// The epoch the controller last gave each rank (reports stamped older are stale).
    rank_epoch: Vec<u64>,
    /// The newest epoch of the job.
    epoch: u64,
    /// The job is over: every agent was told so.
    over: bool,
    /// This controller took a running job back: the workers that may still re-attach (their
    /// agents claim them), each once.
    taking_back: bool,
    rejoinable: std::collections::BTreeSet<usize>,
    /// The longest an agent that came back had been without a controller.
    longest_orphaned_ms: u64,
}

/// A description of an attached agent, for the user.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentInfo {
    pub agent: u64,
    pub gpus: usize,
    /// The address its workers listen on, as it claims.
    pub host: String,
    /// Where its connection came from ("an unknown address" where the server could not say).
    pub peer: String,
    pub pid: u32,
}

/// The controller's registry of agents and the relay between them and its loop.
pub struct AgentHub {
    job_id: String,
    secret: u128,
    world: usize,
    /// Workers every agent must bring (the job's GPUs per node).
    gpus_per_node: usize,
    /// Most workers of the job at once: agents that attach once it has started are taken in
    /// (elastic scale-up) while there is room.
    max_workers: usize,
    lease: Duration,
    heartbeat: Duration,
    state: Mutex<HubState>,
    inputs: Mutex<Sender<HubInput>>,
}

impl AgentHub {
    /// A hub for job `job_id` of `world` workers, `gpus_per_node` to an agent, at `epoch`;
    /// agents must know `secret`. The receiver is the controller loop's end.
    #[allow(clippy::too_many_arguments)] // the job's identity, size and timing, each its own
    pub(crate) fn new(
        job_id: String,
        secret: u128,
        world: usize,
        gpus_per_node: usize,
        max_workers: usize,
        epoch: u64,
        lease: Duration,
        heartbeat: Duration,
    ) -> (Arc<Self>, Receiver<HubInput>) {
        let (tx, rx) = mpsc::channel();
        let state = HubState { rank_epoch: vec![epoch; world], epoch, ..HubState::default() };
        let max_workers = max_workers.max(world);
        let hub = AgentHub {
            job_id,
            secret,
            world,
            gpus_per_node,
            max_workers,
            lease,
            heartbeat,
            state: Mutex::new(state),
            inputs: Mutex::new(tx),
        };
        (Arc::new(hub), rx)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, HubState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn input(&self, x: HubInput) {
        let _ = self.inputs.lock().unwrap_or_else(|e| e.into_inner()).send(x);
    }

    fn message(&self, epoch: u64, body: controller_message::Body) -> ControllerMessage {
        ControllerMessage { job_id: self.job_id.clone(), epoch, body: Some(body) }
    }

    /// Take an agent's hello, the answer to `challenge`: its proof of the job's secret, its
    /// size, room for it. Returns its number.
    fn admit(&self, hello: &AgentHello, challenge: &[u8], tx: UnboundedSender<Result<ControllerMessage, Status>>) -> Result<u64, Status> {
        if hello.nonce.len() != auth::NONCE || !auth::verify(self.secret, &hello_context(hello), challenge, &hello.nonce, &hello.proof) {
            return Err(Status::permission_denied(format!(
                "wrong job secret: the hello does not prove it (give the controller's with {} or LAZARUS_SECRET)",
                Setting::SecretFile
            )));
        }
        let gpus = hello.gpus as usize;
        lazarus_protocol::node_gpus(Setting::Gpus, gpus).map_err(|e| Status::invalid_argument(e.to_string()))?;
        if gpus != self.gpus_per_node {
            return Err(Status::invalid_argument(format!(
                "gpus: {gpus} (this job's nodes have {} each: lazarus controller {})",
                self.gpus_per_node,
                Setting::GpusPerNode
            )));
        }
        if hello.host.parse::<IpAddr>().is_err() {
            return Err(Status::invalid_argument(format!("host: {:?} is not an IP address", hello.host)));
        }
        if let Some(claim) = &hello.rejoin {
            return self.readmit(claim, hello, tx);
        }
        let mut st = self.state();
        // Before the start the job takes the workers it starts with; after it, up to its most
        // (--max-workers): an agent that comes later joins the running job.
        let room = if st.started { self.max_workers } else { self.world };
        let taken: usize = st.agents.values().filter(|a| a.gone.is_none()).map(|a| a.gpus).sum();
        if taken + gpus > room {
            let more = if st.started { format!(" (lazarus controller {} raises that)", Setting::MaxWorkers) } else { String::new() };
            return Err(Status::resource_exhausted(format!(
                "the job has room for {} more workers{more}, this agent brings {gpus}",
                room.saturating_sub(taken)
            )));
        }
        let agent = st.next_agent;
        st.next_agent += 1;
        st.agents.insert(agent, Link::admitted(hello, gpus, tx, None));
        Ok(agent)
    }

    /// Take back an agent whose controller was lost (its hello proved the secret): it claims
    /// its number and its workers, which must be members of the job this controller took back,
    /// not claimed yet. Returns its number.
    fn readmit(
        &self,
        claim: &proto::Rejoin,
        hello: &AgentHello,
        tx: UnboundedSender<Result<ControllerMessage, Status>>,
    ) -> Result<u64, Status> {
        if claim.job_id != self.job_id {
            return Err(Status::failed_precondition(format!(
                "rejoin: job {:?} is not the one this controller runs ({:?})",
                claim.job_id, self.job_id
            )));
        }
        let gpus = hello.gpus as usize;
        let first = usize::try_from(claim.first_worker).unwrap_or(usize::MAX);
        if claim.epochs.len() != gpus {
            return Err(Status::invalid_argument(format!("rejoin: {} epochs for {gpus} workers", claim.epochs.len())));
        }
        let mut st = self.state();
        let workers = first..first.saturating_add(gpus);
        if !st.taking_back {
            return Err(Status::failed_precondition(format!(
                "rejoin: this controller did not take job {:?} back (start it with {} to take over a running job)",
                self.job_id,
                Setting::ResumeJob
            )));
        }
        if workers.clone().any(|w| !st.rejoinable.contains(&w)) {
            return Err(Status::failed_precondition(format!(
                "rejoin: workers {} are not members of job {:?} waiting to be taken back (lost before the controller was, standing by, or claimed already)",
                id_list(workers.clone().map(|w| w as u64)),
                self.job_id
            )));
        }
        if st.agents.contains_key(&claim.agent) {
            return Err(Status::failed_precondition(format!("rejoin: agent {} is attached already", claim.agent)));
        }
        for w in workers {
            st.rejoinable.remove(&w);
            if st.rank_epoch.len() <= w {
                let epoch = st.epoch;
                st.rank_epoch.resize(w + 1, epoch);
            }
        }
        for (slot, &e) in claim.epochs.iter().enumerate() {
            st.rank_epoch[first + slot] = e;
        }
        st.next_agent = st.next_agent.max(claim.agent + 1);
        st.longest_orphaned_ms = st.longest_orphaned_ms.max(claim.orphaned_ms);
        st.agents.insert(claim.agent, Link::admitted(hello, gpus, tx, Some(first)));
        tracing::info!(
            "agent {} at {} re-attached with workers {} after {:.1} s without a controller",
            claim.agent,
            hello.host,
            id_list((first..first + gpus).map(|w| w as u64)),
            claim.orphaned_ms as f64 / 1e3
        );
        Ok(claim.agent)
    }

    /// The agent's session after its hello: relay what it says until its stream ends.
    async fn relay(self: Arc<Self>, agent: u64, mut inbound: tonic::Streaming<AgentMessage>) {
        let why = loop {
            let msg = match inbound.message().await {
                Ok(Some(m)) => m,
                Ok(None) => break "its stream ended".to_string(),
                Err(e) => break format!("its stream failed: {}", e.message()),
            };
            if msg.job_id != self.job_id {
                break format!("it sent a message of job {:?} (this is {:?})", msg.job_id, self.job_id);
            }
            if let Some(x) = self.take(agent, msg) {
                self.input(x);
            }
        };
        self.drop_agent(agent, &why);
    }

    /// One message of an attached agent, checked: what the loop must hear of it, if anything.
    fn take(&self, agent: u64, msg: AgentMessage) -> Option<HubInput> {
        let mut st = self.state();
        let (started, over) = (st.started, st.over);
        let link = st.agents.get_mut(&agent)?;
        if let Some(why) = &link.gone {
            // Given up (lost by its lease, say, behind a partition that has since healed): its
            // workers are no longer the job's, whatever epoch their reports carry.
            // (Once the job is over, an agent's last words — its workers' ends — are expected.)
            if link.refused == 0 && !over {
                tracing::warn!("agent {agent}: heard from after it was given up ({why}): its messages are refused");
            }
            link.refused += 1;
            return None;
        }
        link.last_heard = Instant::now();
        let (gpus, first) = (link.gpus, link.first_rank);
        let slot_rank = |slot: u32| -> Option<usize> {
            let slot = slot as usize;
            (started && slot < gpus).then(|| first.map(|f| f + slot)).flatten()
        };
        match msg.body? {
            agent_message::Body::Hello(_) | agent_message::Body::Heartbeat(_) => None,
            agent_message::Body::Report(r) => {
                let slot = r.slot as usize;
                let rank = slot_rank(r.slot)?;
                let event = match lazarus_protocol::relay::reports::from_proto(r) {
                    Ok(ev) => ev,
                    Err(e) => {
                        tracing::warn!("agent {agent}: a report of worker {rank} that is not one ({e}): dropped");
                        return None;
                    }
                };
                if stale(msg.epoch, st.rank_epoch[rank], &event) {
                    tracing::debug!("agent {agent}: a stale report of worker {rank} (epoch {}): dropped", msg.epoch);
                    return None;
                }
                Some(HubInput::Report { agent, slot, event })
            }
            agent_message::Body::Leaving(l) => {
                if !started {
                    return None;
                }
                let reason: String = l.reason.chars().take(200).collect();
                Some(HubInput::Leaving { agent, reason })
            }
            agent_message::Body::Exited(x) => {
                slot_rank(x.slot)?;
                Some(HubInput::Exited { agent, slot: x.slot as usize, status: x.status })
            }
        }
    }

    /// The agent is gone (its stream ended, or the controller gave it up).
    fn drop_agent(&self, agent: u64, why: &str) {
        let mut st = self.state();
        if let Some(link) = st.agents.get_mut(&agent) {
            if link.gone.is_none() {
                link.gone = Some(why.to_string());
                let _ = link.tx.send(Err(Status::aborted(format!("agent {agent} given up: {why}"))));
                drop(st);
                self.input(HubInput::Gone { agent, why: why.to_string() });
            }
        }
    }

    /// Send `body` to `agent`, stamped with `epoch`.
    fn send_to(&self, agent: u64, epoch: u64, body: controller_message::Body) {
        let st = self.state();
        if let Some(link) = st.agents.get(&agent).filter(|l| l.gone.is_none()) {
            // A long message in pieces, one after the other under the lock (`lazarus_protocol::pieces`).
            let (pieces, body) = lazarus_protocol::pieces::in_pieces(body);
            for data in pieces {
                let _ = link.tx.send(Ok(self.message(epoch, controller_message::Body::Piece(proto::Piece { data }))));
            }
            let _ = link.tx.send(Ok(self.message(epoch, body)));
        }
    }

    /// Pings to `agent` every heartbeat while it is attached (its watch on the controller).
    async fn ping(self: Arc<Self>, agent: u64) {
        let mut every = tokio::time::interval(self.heartbeat);
        loop {
            every.tick().await;
            let st = self.state();
            let Some(link) = st.agents.get(&agent).filter(|l| l.gone.is_none()) else { return };
            if link.tx.send(Ok(self.message(st.epoch, controller_message::Body::Ping(proto::Ping {})))).is_err() {
                return;
            }
        }
    }

    /// The gRPC `Attach` call: hello, welcome, then the relay (on tasks of the server's runtime).
    pub(crate) async fn attach(
        self: Arc<Self>,
        peer: Option<std::net::SocketAddr>,
        inbound: tonic::Streaming<AgentMessage>,
    ) -> Result<AgentStream, Status> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let challenge = auth::nonce().map_err(|e| Status::internal(format!("drawing a nonce: {e}")))?;
        // The session opens with the challenge; the hello that answers it is awaited beside the
        // stream (the agent reads the challenge first).
        let _ = tx.send(Ok(
            self.message(self.state().epoch, controller_message::Body::Challenge(proto::Challenge { nonce: challenge.to_vec() }))
        ));
        tokio::spawn(self.clone().open(peer, inbound, challenge, tx));
        Ok(Box::pin(tokio_stream::wrappers::UnboundedReceiverStream::new(rx)))
    }

    /// The rest of an agent's session: its hello (the answer to `challenge`) within
    /// [`HELLO_WITHIN`], then the welcome and the relay — or its refusal, with the reason.
    async fn open(
        self: Arc<Self>,
        peer: Option<std::net::SocketAddr>,
        mut inbound: tonic::Streaming<AgentMessage>,
        challenge: [u8; auth::NONCE],
        tx: UnboundedSender<Result<ControllerMessage, Status>>,
    ) {
        let from = peer.map_or("an unknown address".to_string(), |p| p.to_string());
        let hello = match tokio::time::timeout(HELLO_WITHIN, inbound.message()).await {
            Err(_) => Err(Status::deadline_exceeded(format!("no hello within {} s", HELLO_WITHIN.as_secs()))),
            Ok(Err(e)) => Err(e),
            Ok(Ok(first)) => match first.and_then(|m| m.body) {
                Some(agent_message::Body::Hello(h)) => Ok(h),
                _ => Err(Status::invalid_argument("an agent's first message must be its hello")),
            },
        };
        let admitted = hello.and_then(|h| self.admit(&h, &challenge, tx.clone()).map(|agent| (agent, h)));
        let (agent, hello) = match admitted {
            Ok(a) => a,
            Err(status) => {
                tracing::warn!("refused an agent from {from}: {}", status.message());
                let _ = tx.send(Err(status));
                return;
            }
        };
        if let Some(link) = self.state().agents.get_mut(&agent) {
            link.peer = peer;
        }
        let proof = auth::prove(self.secret, &welcome_context(agent), &hello.nonce, &challenge).to_vec();
        let welcome = proto::Welcome { agent, lease_s: self.lease.as_secs_f64(), heartbeat_s: self.heartbeat.as_secs_f64(), proof };
        let epoch = self.state().epoch;
        let _ = tx.send(Ok(self.message(epoch, controller_message::Body::Welcome(welcome))));
        tokio::spawn(self.clone().ping(agent));
        match hello.rejoin {
            Some(r) => self.input(HubInput::Rejoined { agent, first: r.first_worker as usize }),
            None => self.input(HubInput::Joined { agent }),
        }
        self.relay(agent, inbound).await;
    }

    /// The agents attached and not gone, in order of arrival.
    pub fn agents(&self) -> Vec<AgentInfo> {
        self.state()
            .agents
            .iter()
            .filter(|(_, l)| l.gone.is_none())
            .map(|(&agent, l)| AgentInfo {
                agent,
                gpus: l.gpus,
                host: l.host.clone(),
                peer: l.peer.map_or_else(|| "an unknown address".to_string(), |p| p.to_string()),
                pid: l.pid,
            })
            .collect()
    }

    /// Workers the attached agents bring.
    fn attached_workers(&self) -> usize {
        self.state().agents.values().filter(|l| l.gone.is_none()).map(|l| l.gpus).sum()
    }

    /// Wait until agents bring every worker of the job (those silent for a lease are given up),
    /// telling `on_join` of each as it comes, at most until `deadline`.
    pub(crate) fn wait_for_agents(
        &self,
        inputs: &Receiver<HubInput>,
        deadline: Instant,
        mut on_join: impl FnMut(&AgentInfo, usize, usize) -> Result<(), ControlError>,
    ) -> Result<(), ControlError> {
        let mut shown = 0;
        // What the hub said while the job waits: an arrival is told of, a departure said.
        let mut heard = |got: Result<HubInput, RecvTimeoutError>, shown: &mut usize| -> Result<(), ControlError> {
            match got {
                Ok(HubInput::Joined { agent }) => match self.agents().into_iter().find(|a| a.agent == agent) {
                    Some(info) => {
                        *shown += info.gpus;
                        on_join(&info, *shown, self.world)
                    }
                    None => Ok(()),
                },
                Ok(HubInput::Gone { agent, why }) => {
                    tracing::warn!("agent {agent} left before the job started: {why}");
                    *shown = self.attached_workers();
                    Ok(())
                }
                Ok(_) | Err(RecvTimeoutError::Timeout) => Ok(()),
                Err(RecvTimeoutError::Disconnected) => Err(ControlError::Launch("the agent hub stopped".into())),
            }
        };
        // Since when every worker is attached: an agent is counted when it is admitted, a moment
        // before its arrival is queued here, so the last arrivals are waited for (briefly) to be
        // told of.
        let mut complete_since: Option<Instant> = None;
        loop {
            let attached = self.attached_workers();
            if attached == self.world {
                let since = *complete_since.get_or_insert_with(Instant::now);
                let left = TELL_ARRIVALS_WITHIN.saturating_sub(since.elapsed());
                if shown >= attached || left.is_zero() {
                    return Ok(());
                }
                heard(inputs.recv_timeout(left), &mut shown)?;
                continue;
            }
            complete_since = None;
            // A stop signal ends the wait: nothing has started, nothing is lost.
            if let Some((_, name)) = lazarus_protocol::stop_signal::requested() {
                return Err(ControlError::Launch(format!(
                    "{name} while waiting for agents ({attached} of the job's {} workers attached): stopped before the job started, nothing trained",
                    self.world
                )));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(ControlError::Launch(format!(
                    "agents brought {attached} of the job's {} workers in time (attached: {})",
                    self.world,
                    self.agents().iter().map(|a| format!("agent {} at {} with {}", a.agent, a.host, a.gpus)).collect::<Vec<_>>().join(", ")
                )));
            }
            let silent: Vec<u64> = self
                .state()
                .agents
                .iter()
                .filter(|(_, l)| l.gone.is_none() && now.duration_since(l.last_heard) > self.lease)
                .map(|(&a, _)| a)
                .collect();
            for a in silent {
                self.drop_agent(a, &format!("silent for over {} ms before the job started", self.lease.as_millis()));
            }
            heard(inputs.recv_timeout((deadline - now).min(self.heartbeat)), &mut shown)?;
        }
    }

    /// Number the attached agents' workers (in order of arrival) and send each agent the slots
    /// of its workers: `spec(rank, host)` is worker `rank`'s slot, listening on `host`; `job` is
    /// the job every worker runs (its JSON compressed: [`lazarus_protocol::deflate_message`]),
    /// sent once to each agent.
    pub(crate) fn start(
        self: &Arc<Self>,
        inputs: Receiver<HubInput>,
        job: prost::bytes::Bytes,
        spec: impl Fn(usize, &str) -> proto::WorkerSlot,
        joiner: Joiner,
    ) -> Result<RemoteFleet, ControlError> {
        let mut owners = Vec::with_capacity(self.world);
        let mut sends = Vec::new();
        {
            let mut st = self.state();
            st.started = true;
            let epoch = st.epoch;
            let mut next = 0;
            for (&agent, link) in st.agents.iter_mut().filter(|(_, l)| l.gone.is_none()) {
                link.first_rank = Some(next);
                let workers: Vec<proto::WorkerSlot> = (next..next + link.gpus).map(|r| spec(r, &link.host)).collect();
                for slot in 0..link.gpus {
                    owners.push((agent, slot));
                }
                next += link.gpus;
                sends.push((agent, epoch, workers));
            }
            if next != self.world {
                return Err(ControlError::Launch(format!("agents bring {next} workers, the job has {}", self.world)));
            }
        }
        for (agent, epoch, workers) in sends {
            self.send_to(agent, epoch, controller_message::Body::Start(proto::StartWorkers { workers, job: job.clone(), standby: false }));
        }
        Ok(RemoteFleet::new(self.clone(), inputs, owners, joiner))
    }

    /// This controller takes a running job back: `members` (worker ids) may re-attach with
    /// their agents; `workers` ids were given out so far (joiners are numbered after them);
    /// agent numbers go on from `agents`. Called before the service listens, so that no claim
    /// comes before it.
    pub(crate) fn take_back(&self, members: &[usize], workers: usize, agents: u64) {
        let mut st = self.state();
        st.started = true;
        st.taking_back = true;
        st.rejoinable = members.iter().copied().collect();
        st.next_agent = st.next_agent.max(agents);
        let epoch = st.epoch;
        let len = workers.max(st.rank_epoch.len());
        st.rank_epoch.resize(len, epoch);
    }

    /// The workers of the job taken back ([`AgentHub::take_back`]), `workers` ids so far, as the
    /// controller's loop drives them; those not re-attached yet have no agent.
    pub(crate) fn taken_back(self: &Arc<Self>, inputs: Receiver<HubInput>, workers: usize, joiner: Joiner) -> RemoteFleet {
        RemoteFleet::new(self.clone(), inputs, vec![(u64::MAX, 0); workers], joiner)
    }

    /// The agent numbers given out so far (the next one's).
    pub(crate) fn next_agent(&self) -> u64 {
        self.state().next_agent
    }

    /// Number the workers of `agent`, which attached after the start, from `first` on; returns
    /// its workers and host (None: it is gone, or has its ranks already).
    fn assign(&self, agent: u64, first: usize) -> Option<(usize, String)> {
        let mut st = self.state();
        let epoch = st.epoch;
        let link = st.agents.get_mut(&agent).filter(|l| l.gone.is_none() && l.first_rank.is_none())?;
        link.first_rank = Some(first);
        let (gpus, host) = (link.gpus, link.host.clone());
        if st.rank_epoch.len() < first + gpus {
            st.rank_epoch.resize(first + gpus, epoch);
        }
        Some((gpus, host))
    }

    /// The job's newest epoch.
    fn epoch(&self) -> u64 {
        self.state().epoch
    }

    /// Give up every agent (the job is over): `completed` lets their workers finish.
    fn shutdown(&self, reason: &str, completed: bool) {
        self.state().over = true;
        let agents: Vec<u64> = self.state().agents.keys().copied().collect();
        let epoch = self.state().epoch;
        for a in agents {
            self.send_to(a, epoch, controller_message::Body::Shutdown(proto::Shutdown { reason: reason.into(), completed }));
            let mut st = self.state();
            if let Some(link) = st.agents.get_mut(&a) {
                link.gone.get_or_insert_with(|| reason.to_string());
            }
        }
    }
}
