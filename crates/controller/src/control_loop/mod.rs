//! The controller process's loop (`lazarus train --workers N`, `lazarus controller`): plan the
//! job, start its workers (or take in node agents), and run the controller's decisions over
//! them; what to show the user is the caller's (every [`TrainEvent`] is handed to it). The
//! loop with recovery is [`drive`]; the agents of `--gpus-per-node` are [`local_agents`].

mod drive;
mod local_agents;
pub mod saved_job;

use lazarus_setting::Setting;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lazarus_model::Trainer;
use lazarus_plan::{plan_model, ClusterShape, ModelPlan, PlanPolicy, ReplicaMap};
use lazarus_runtime::{check_plan, validate_worker_config, DispatchMode};
use serde::Serialize;

use crate::dashboard::{Dashboard, DASHBOARD_PATH};
use crate::decisions::{Controller, JobSpec, JoinRule, OnLoss};
use crate::hub::{AgentHub, Joiner};
use crate::metrics::{JobMetrics, MetricsEndpoint, MetricsServer};
use crate::service::{snapshot, status_key, status_token, GrpcServer, SharedStatus};
use drive::drive;
use lazarus_agent::launcher::{check_comm_timeout, fresh_epoch, launch, Confinement};
use lazarus_protocol::relay::start::encode_job;
use lazarus_protocol::relay::start::slot_to_proto;
use lazarus_protocol::tls::ServerTls;
use lazarus_protocol::{fresh_secret, TrainJob};
use lazarus_protocol::{heartbeat_within, lease_without_recovery};
use lazarus_protocol::{ControlError, Workers};
use local_agents::{replay, start_local_agents};
pub use local_agents::{AgentCommandLine, NodeChange, NodeSchedule};

pub use crate::events::{JobStopped, ReconfigurationRecord, TrainEvent, TrainOutcome};
pub use lazarus_protocol::{Reach, MAX_WORKERS, MAX_WORKERS_PER_HOST};
/// How long workers that join a running job wait to be taken in, by default (the paper's 2
/// minutes, §4.3: arrivals within it share one move).
pub const DEFAULT_JOIN_WAIT: Duration = Duration::from_secs(120);
/// Steps between two rebalances weighed, by default (paper §4.3 re-plans periodically).
pub const DEFAULT_REBALANCE_EVERY: u64 = 200;
/// Most steps profiled for the measured-load plan (forward passes before training starts).
pub const MAX_PROFILE_STEPS: usize = 1000;

/// Where the expert placement of a job comes from.
#[derive(Debug, Clone)]
pub enum PlanSource {
    /// DeepSpeed-MoE's static expert parallelism: experts split evenly, one replica each.
    StaticEp,
    /// A plan file (as `lazarus plan` prints it in JSON), one rank per GPU slot of the plan.
    File(ModelPlan),
    /// Planned by the scheduler from the router loads of the first `profile_steps` batches.
    Measured {
        profile_steps: usize,
        /// Replica slots per worker (default: room for two replicas of every expert).
        slots_per_worker: Option<usize>,
        /// The throughput guard (None: the most fault-tolerant placement).
        max_imbalance: Option<f64>,
    },
}

impl PlanSource {
    pub fn dispatch_mode(&self) -> DispatchMode {
        match self {
            PlanSource::StaticEp => DispatchMode::StaticPadded,
            _ => DispatchMode::Balanced,
        }
    }
}

/// The plan of a job: the replica map its workers run, and the placement it came from (what the
/// controller re-plans from after a failure; none for static expert parallelism).
#[derive(Debug, Clone)]
pub struct JobPlan {
    pub map: ReplicaMap,
    pub placement: Option<ModelPlan>,
}

/// The plan `workers` train `trainer`'s model with. `trainer` is the launcher's copy of the job
/// (fresh or resumed); profiling reads its next batches without moving its cursor.
pub fn plan_job(trainer: &mut Trainer, workers: Workers, source: &PlanSource) -> Result<JobPlan, ControlError> {
    let (world, gpus_per_node, nodes) = (workers.world(), workers.gpus_per_node(), workers.nodes());
    let cfg = trainer.config.clone();
    validate_worker_config(&cfg, world)?;
    let (layers, experts) = (cfg.model.moe_layers(), cfg.model.n_experts);
    let plan = match source {
        PlanSource::StaticEp => JobPlan { map: ReplicaMap::static_ep(0, layers, experts, world)?, placement: None },
        PlanSource::File(plan) => {
            if plan.shape().ranks() != world {
                return Err(ControlError::invalid(
                    Setting::PlacementFile,
                    format!(
                        "the plan has {} ranks ({} nodes x {} GPUs), but {} is {world}",
                        plan.shape().ranks(),
                        plan.shape().nodes,
                        plan.shape().gpus_per_node,
                        Setting::Workers
                    ),
                ));
            }
            JobPlan { map: plan.replica_map(), placement: Some(plan.clone()) }
        }
        PlanSource::Measured { profile_steps, slots_per_worker, max_imbalance } => {
            let steps_left = cfg.steps.saturating_sub(trainer.step);
            if *profile_steps == 0 || *profile_steps > MAX_PROFILE_STEPS || *profile_steps as u64 > steps_left.max(1) {
                return Err(ControlError::invalid(
                    Setting::ProfileSteps,
                    format!(
                        "{profile_steps} (expected 1 to {}, at most the {steps_left} steps to train; or give {})",
                        MAX_PROFILE_STEPS,
                        Setting::PlacementFile
                    ),
                ));
            }
            let slots = slots_per_worker.unwrap_or_else(|| (2 * experts).div_ceil(world).max(1));
            if slots.saturating_mul(world) < experts {
                return Err(ControlError::invalid(Setting::SlotsPerWorker, format!("{slots} x {world} workers < {experts} experts")));
            }
            let shape = ClusterShape::new(nodes, gpus_per_node, slots)
                .map_err(|e| ControlError::invalid(Setting::SlotsPerWorker, e.to_string()))?;
            let loads = trainer.measure_loads(*profile_steps)?;
            let plan = plan_model(&loads, shape, &PlanPolicy::trainer(nodes, *max_imbalance), None)?;
            JobPlan { map: plan.replica_map(), placement: Some(plan) }
        }
    };
    check_plan(&plan.map, layers, experts, world, source.dispatch_mode())?;
    Ok(plan)
}

/// Why a job's controller cannot move it to a new plan when a worker is lost (its first loss
/// ends it), though recovery is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RecoveryOff {
    #[error("static expert parallelism restarts on failures, as DeepSpeed-MoE does ({})", Setting::StaticEp)]
    StaticEp,
    #[error("the job has no placement to re-plan from")]
    NoPlacement,
    /// The controller re-plans whole nodes of G workers: the plan's nodes must be the hosts'.
    #[error("the plan's nodes have {plan} GPUs, the hosts' {hosts} ({})", Setting::GpusPerNode)]
    NodesDiffer { plan: usize, hosts: usize },
    #[error("the plan has {plan} ranks for {workers} workers")]
    RanksDiffer { plan: usize, workers: usize },
}

/// Whether a job of `workers` on `plan` can be recovered live (None), or why not: the one
/// answer the launcher reports and the controller acts on.
pub fn recovery_off(static_ep: bool, plan: Option<&ModelPlan>, workers: Workers) -> Option<RecoveryOff> {
    let p = match plan {
        _ if static_ep => return Some(RecoveryOff::StaticEp),
        None => return Some(RecoveryOff::NoPlacement),
        Some(p) => p,
    };
    if p.shape().gpus_per_node != workers.gpus_per_node() {
        Some(RecoveryOff::NodesDiffer { plan: p.shape().gpus_per_node, hosts: workers.gpus_per_node() })
    } else if p.shape().ranks() != workers.world() {
        Some(RecoveryOff::RanksDiffer { plan: p.shape().ranks(), workers: workers.world() })
    } else {
        None
    }
}

/// How failures are handled: found out by heartbeats within `lease`, then recovered from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Recovery {
    /// A worker not heard from for this long is lost (and killed, if it is only hung).
    pub lease: Duration,
    /// How often workers say they are alive.
    pub heartbeat: Duration,
    /// Weigh a rebalance from the measured loads every this many steps (0: never).
    pub rebalance_every: u64,
}

impl Recovery {
    /// From `--lease` and `--heartbeat` seconds (None: the default), checked: a lease of 0.05 to
    /// 600 s, heartbeats more often than the lease (default: a fifth of it when the default
    /// 200 ms would not be).
    pub fn from_flags(lease_s: Option<f64>, heartbeat_s: Option<f64>) -> Result<Self, ControlError> {
        let mut r = Recovery::default();
        if let Some(l) = lease_s {
            if !l.is_finite() || !(0.05..=600.0).contains(&l) {
                return Err(ControlError::invalid(Setting::Lease, format!("{l} (expected seconds between 0.05 and 600)")));
            }
            r.lease = Duration::from_secs_f64(l);
        }
        if let Some(h) = heartbeat_s {
            if !h.is_finite() || h <= 0.0 || h >= r.lease.as_secs_f64() {
                return Err(ControlError::invalid(
                    Setting::Heartbeat,
                    format!("{h} (expected seconds, more than 0 and less than the lease, {} s)", r.lease.as_secs_f64()),
                ));
            }
            r.heartbeat = Duration::from_secs_f64(h);
        } else if r.heartbeat >= r.lease {
            r.heartbeat = r.lease / 5;
        }
        Ok(r)
    }
}

impl Default for Recovery {
    /// A 1 s lease, heartbeats every 200 ms: a hung worker is found out within a second; a
    /// rebalance weighed every 200 steps.
    fn default() -> Self {
        Recovery { lease: Duration::from_millis(1000), heartbeat: Duration::from_millis(200), rebalance_every: DEFAULT_REBALANCE_EVERY }
    }
}

/// Where a job's workers run.
#[derive(Debug, Clone)]
pub enum Hosts {
    /// Started by this process (the launcher is every worker's agent); the controller's status
    /// is served at `status_listen`, if given.
    Local { status_listen: Option<SocketAddr> },
    /// Started by node agents attached to the controller's gRPC service.
    Agents(Box<AgentsSpec>),
}

/// A job run by node agents (`lazarus agent`), one per node with its workers.
#[derive(Debug, Clone)]
pub struct AgentsSpec {
    /// Where the controller serves agents and `lazarus status`.
    pub listen: SocketAddr,
    /// The job's secret: every agent's hello and every rendezvous hello proves it.
    pub secret: u128,
    /// The certificate the controller serves: the one the secret pins, or the operator's.
    pub tls: ServerTls,
    /// Agents to start on this host, on loopback (the `train --workers N --gpus-per-node G`
    /// case); 0: agents of other hosts attach.
    pub local_agents: usize,
    /// How to start one of those agents.
    pub agent_command_line: local_agents::AgentCommandLine,
    /// Workers of every agent (its node's GPUs): a node is the unit of failure.
    pub gpus_per_node: usize,
    /// How long to wait for agents to bring every worker.
    pub wait: Duration,
    /// Most workers at once: agents that attach to the running job are taken in while there
    /// is room (at least the workers it starts with).
    pub max_workers: usize,
    /// How long workers that join wait to be taken in (arrivals within it share one move).
    pub join_wait: Duration,
    /// Whether they wait only that long, or for a move to ride along ([`JoinRule`]).
    pub join_rule: JoinRule,
    /// With local agents: nodes to kill and start on schedule (a failure trace replayed).
    pub schedule: Option<NodeSchedule>,
    /// Where the controller saves what a new one needs to take the job back, at every epoch
    /// (None: nowhere; [`saved_job`]).
    pub state_file: Option<PathBuf>,
    /// Take back a running job whose controller was lost, instead of starting one.
    pub resume: Option<Box<ResumeJob>>,
}

/// A running job a new controller takes back (`lazarus controller --resume-job`).
#[derive(Debug, Clone)]
pub struct ResumeJob {
    pub saved: saved_job::SavedJob,
    /// The last step the job's log holds (None: the saved state's).
    pub last_logged: Option<u64>,
    /// How long to wait for each member's agent to re-attach before it is lost.
    pub rejoin_within: Duration,
}

/// Start `world` worker processes on `job` (here, or through node agents as `hosts` says) and
/// run them to the end; every [`TrainEvent`] goes to `observe` as it happens. With `recovery`
/// (and a plan the controller can re-plan: one rank per plan node), a lost worker does not end
/// the run: the controller moves the survivors to a new plan (or rolls them back to the last
/// checkpoint) and training goes on. Without it, the same controller ends the run at the first
/// failure (local workers only). Collectives time out after `comm_timeout_s`. With
/// `metrics`, Prometheus can scrape the job's metrics there.
#[allow(clippy::too_many_arguments)]
pub fn run_training(
    job: &TrainJob,
    plan: Option<&ModelPlan>,
    workers: Workers,
    comm_timeout_s: f64,
    recovery: Option<Recovery>,
    hosts: &Hosts,
    http: &HttpEndpoints,
    mut observe: impl FnMut(TrainEvent) -> Result<(), ControlError>,
) -> Result<TrainOutcome, ControlError> {
    let comm_timeout_s = check_comm_timeout(comm_timeout_s)?;
    let (world, g) = (workers.world(), workers.gpus_per_node());
    let recoverable = recovery.filter(|_| recovery_off(job.static_ep, plan, workers).is_none());
    if recoverable.is_none() && matches!(hosts, Hosts::Agents(_)) {
        let why = recovery_off(job.static_ep, plan, workers)
            .map_or(format!("it was turned off ({} off)", Setting::Recovery), |off| off.to_string());
        return Err(ControlError::invalid(Setting::Recovery, format!("node agents run jobs with live recovery only, and here {why}")));
    }
    let lifecycle = Lifecycle::new(comm_timeout_s, recoverable);
    let mut job = job.clone();
    job.heartbeat_s = lifecycle.heartbeat.as_secs_f64();
    let spec = job_spec(&job, plan, world, g, hosts, recoverable, &lifecycle);
    let taking_back = match hosts {
        Hosts::Agents(a) => a.resume.as_deref().cloned(),
        Hosts::Local { .. } => None,
    };
    let (job_id, epoch) = match &taking_back {
        Some(r) => (r.saved.job_id.clone(), r.saved.state.epoch),
        None => {
            let epoch = fresh_epoch();
            (format!("job-{epoch}"), epoch)
        }
    };
    let static_ep = job.static_ep;
    // A resumed run starts from a checkpoint: the last one until the job writes its own.
    let start_checkpoint = job.resume.as_deref().and_then(lazarus_model::checkpoint::latest_step);
    // The controller of the job, its clock (leases, the start deadline) started when its
    // workers are: after the agents attached, for a job run by agents. A job taken back
    // starts collecting where its workers stopped.
    let controller = move |now: Instant| -> Result<Controller, ControlError> {
        let nodes: Vec<u64> = (0..world as u64).collect();
        Ok(match (&taking_back, plan) {
            (Some(r), _) => Controller::resumed(spec.clone(), r.saved.state.clone(), r.last_logged, now, r.rejoin_within)
                .map_err(|e| ControlError::invalid(Setting::ResumeJob, format!("the saved job does not fit this one: {e}")))?,
            // Static expert parallelism runs its own split of the experts, not the plan's.
            (None, Some(p)) if !static_ep => {
                Controller::new(spec.clone(), p.clone().with_epoch(epoch), nodes, now).with_checkpoint(start_checkpoint)
            }
            (None, _) => Controller::unplanned(spec.clone(), epoch, nodes, now).with_checkpoint(start_checkpoint),
        })
    };
    let begun = Instant::now();
    let waiting = controller(begun)?;
    let plan = waiting.plan().map(lazarus_protocol::status_plan::plan_to_proto);
    let shared: SharedStatus = Arc::new(Mutex::new(snapshot(&waiting, begun, &job_id, epoch, plan)));
    let metrics = Arc::new(JobMetrics::new());
    let _metrics_server = match &http.metrics {
        Some(at) => {
            let server = MetricsServer::start(at, metrics.clone(), Some(shared.clone()))?;
            observe(TrainEvent::Metrics { addr: server.addr() })?;
            Some(server)
        }
        None => None,
    };
    // Who may ask about the job: holders of its status key (derived from the job's secret when
    // agents run it; from a secret of the launcher's own for local workers, whose secret is
    // theirs alone).
    let status_access = match hosts {
        Hosts::Agents(a) => StatusAccess { key: status_key(a.secret), tls: a.tls.clone() },
        Hosts::Local { .. } => {
            let own = fresh_secret().map_err(|e| ControlError::io("drawing the status secret from /dev/urandom", e))?;
            StatusAccess { key: status_key(own), tls: ServerTls::FromSecret(own) }
        }
    };
    let dashboard = http.dashboard.map(|_| Arc::new(Dashboard::new(shared.clone(), status_access.key)));
    let _dashboard_server = match (http.dashboard, &dashboard) {
        (Some(listen), Some(d)) => {
            let server = MetricsServer::start_dashboard(listen, d.clone())?;
            let token = status_token(status_access.key, &status_access.tls);
            observe(TrainEvent::Dashboard { url: format!("http://{}{DASHBOARD_PATH}?token={token}", server.addr()) })?;
            Some(server)
        }
        _ => None,
    };
    let mut observe = |event: TrainEvent| {
        metrics.record(&event);
        if let Some(d) = &dashboard {
            d.record(&event);
        }
        observe(event)
    };
    let publish = dashboard.is_some();
    let job_run = JobRun { job: &job, job_id: &job_id, epoch, world, comm_timeout_s, shared, status_access, publish };
    let ended = match hosts {
        Hosts::Local { status_listen } => job_run.on_local_workers(*status_listen, controller, &mut observe),
        Hosts::Agents(a) => job_run.on_agents(a, lifecycle, controller, &mut observe),
    };
    ended.map(|e| e.outcome)
}

/// What the controller plans and decides by, for `job` on `world` workers of `g` per node.
fn job_spec(
    job: &TrainJob,
    plan: Option<&ModelPlan>,
    world: usize,
    g: usize,
    hosts: &Hosts,
    recoverable: Option<Recovery>,
    lifecycle: &Lifecycle,
) -> JobSpec {
    let cfg = &job.config;
    JobSpec {
        layers: cfg.model.moe_layers(),
        experts: cfg.model.n_experts,
        slots_per_node: plan.map_or(0, |p| p.shape().slots_per_node()),
        gpus_per_node: g,
        policy: PlanPolicy::trainer(world / g, Some(lazarus_plan::DEFAULT_MAX_IMBALANCE)),
        expert_bytes: (cfg.model.expert_params() * 12) as u64,
        join_wait: match hosts {
            Hosts::Agents(a) => a.join_wait,
            Hosts::Local { .. } => DEFAULT_JOIN_WAIT,
        },
        join_rule: match hosts {
            Hosts::Agents(a) => a.join_rule,
            Hosts::Local { .. } => JoinRule::AfterWait,
        },
        rebalance_every: recoverable.map_or(0, |r| r.rebalance_every),
        total_steps: cfg.steps,
        ..lifecycle.spec()
    }
}

/// One job to drive, on whichever hosts.
struct JobRun<'a> {
    job: &'a TrainJob,
    job_id: &'a str,
    epoch: u64,
    world: usize,
    comm_timeout_s: f64,
    /// The status served to `lazarus status` (and the dashboard).
    shared: SharedStatus,
    /// The key `lazarus status` and the dashboard's viewers prove, and the TLS its server uses.
    status_access: StatusAccess,
    /// Publish the status even with no status server (the dashboard reads it).
    publish: bool,
}

/// The job's status key and the TLS its status server speaks.
struct StatusAccess {
    key: u128,
    tls: ServerTls,
}

/// Where the job's HTTP servers listen: the metrics Prometheus scrapes, the dashboard.
#[derive(Debug, Clone, Default)]
pub struct HttpEndpoints {
    pub metrics: Option<MetricsEndpoint>,
    pub dashboard: Option<SocketAddr>,
}

type Observe<'o> = &'o mut dyn FnMut(TrainEvent) -> Result<(), ControlError>;

impl JobRun<'_> {
    /// Worker processes started here (this process is every worker's agent); the status
    /// served at `status_listen`, if given, under a secret of its own.
    fn on_local_workers(
        self,
        status_listen: Option<SocketAddr>,
        controller: impl Fn(Instant) -> Result<Controller, ControlError>,
        observe: Observe<'_>,
    ) -> Result<drive::Ended, ControlError> {
        let job = self.job;
        let mut processes = launch("worker", self.world, self.comm_timeout_s, job, Confinement::Shared, self.epoch, job.encrypt_data)?;
        let _server = match status_listen {
            Some(addr) => {
                let StatusAccess { key, tls } = &self.status_access;
                let server = GrpcServer::start(addr, self.shared.clone(), None, *key, tls)?;
                observe(TrainEvent::Serving { addr: server.addr(), status_token: status_token(*key, tls) })?;
                Some(server)
            }
            None => None,
        };
        let shared = (status_listen.is_some() || self.publish).then_some(self.shared);
        drive(&mut processes, controller(Instant::now())?, self.job_id, shared, None, observe)
    }

    /// Worker processes started by node agents attached to the controller's service (or taken
    /// back from them), local agents and their replayed schedule included.
    fn on_agents(
        self,
        a: &AgentsSpec,
        lifecycle: Lifecycle,
        controller: impl Fn(Instant) -> Result<Controller, ControlError>,
        observe: Observe<'_>,
    ) -> Result<drive::Ended, ControlError> {
        let (job, job_id, world, epoch) = (self.job, self.job_id, self.world, self.epoch);
        let g = a.gpus_per_node;
        let (hub, inputs) =
            AgentHub::new(job_id.to_string(), a.secret, world, g, a.max_workers, epoch, lifecycle.lease, lifecycle.heartbeat);
        if let Some(r) = a.resume.as_deref() {
            let members: Vec<usize> = r.saved.state.ranks.iter().map(|&w| w as usize).collect();
            hub.take_back(&members, r.saved.workers(), r.saved.agents);
        }
        let key = self.status_access.key;
        let server = GrpcServer::start(a.listen, self.shared.clone(), Some(hub.clone()), key, &a.tls)?;
        let addr = server.addr();
        observe(TrainEvent::Serving { addr, status_token: status_token(key, &a.tls) })?;
        let agents = if a.local_agents > 0 { Some(Arc::new(Mutex::new(start_local_agents(a, addr)?))) } else { None };
        let launched = a.resume.as_deref().and_then(|r| r.saved.launched_workers).unwrap_or(world);
        let mut save = a.state_file.clone().map(|path| job_saver(path, &hub, job_id, job, g, launched));
        let save = save.as_mut().map(|f| f as &mut dyn FnMut(&Controller, bool));
        // The slots go to the agents without the secret (each agent proved it knows it and
        // adds its own, so it never crosses the network) and without the job, which each
        // agent is sent once for its workers.
        let (encrypt, comm_timeout_s) = (job.encrypt_data, self.comm_timeout_s);
        let slot =
            move |rank: usize, world: usize, epoch: u64, host: &str| slot_to_proto(rank, world, epoch, comm_timeout_s, host, encrypt);
        // A worker that joins later stands by (its spec's rank is its worker id) and is sent
        // its map whole in the move that takes it in.
        let joiner = || -> Result<Joiner, ControlError> {
            let layers = job.config.model.moe_layers().max(1);
            let placeholder = ReplicaMap::static_ep(0, layers, job.config.model.n_experts.max(1), 1)?;
            let standby = TrainJob { standby: true, plan: placeholder, ..job.clone() };
            let job = prost::bytes::Bytes::from(encode_job(&standby)?);
            Ok(Joiner { job, spec: Box::new(move |id: usize, host: &str, epoch: u64| slot(id, id + 1, epoch, host)) })
        };
        if let Some(r) = a.resume.as_deref() {
            let mut fleet = hub.taken_back(inputs, r.saved.workers(), joiner()?);
            return drive(&mut fleet, controller(Instant::now())?, job_id, Some(self.shared), save, observe);
        }
        let attached = hub.wait_for_agents(&inputs, Instant::now() + a.wait, |info, attached, world| {
            observe(TrainEvent::AgentJoined {
                agent: info.agent,
                host: info.host.clone(),
                peer: info.peer.clone(),
                gpus: info.gpus,
                pid: info.pid,
                attached,
                world,
            })
        });
        let run = attached.and_then(|_| {
            let whole = prost::bytes::Bytes::from(encode_job(job)?);
            let mut fleet = hub.start(inputs, whole, |rank, host| slot(rank, world, epoch, host), joiner()?)?;
            // The schedule's clock starts with the workers.
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let replaying = match (&agents, &a.schedule) {
                (Some(agents), Some(schedule)) => Some(replay(agents.clone(), schedule.clone(), stop.clone())),
                _ => None,
            };
            let run = drive(&mut fleet, controller(Instant::now())?, job_id, Some(self.shared), save, observe);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            if let Some(r) = replaying {
                let _ = r.join();
            }
            run
        });
        if let Some(agents) = &agents {
            // Agents end with their part in the job; they are killed if they do not.
            agents.lock().unwrap_or_else(|e| e.into_inner()).reap_within(Duration::from_secs(40));
        }
        run
    }
}

/// What a new controller needs to take the job back, saved at `path` at every epoch (and
/// removed once the job is over); a failure to save is warned of once.
fn job_saver(path: PathBuf, hub: &Arc<AgentHub>, job_id: &str, job: &TrainJob, g: usize, launched: usize) -> impl FnMut(&Controller, bool) {
    let (hub, job_id, config) = (hub.clone(), job_id.to_string(), job.config.clone());
    let mut warned = false;
    move |ctl: &Controller, over: bool| {
        let written = match ctl.job_state() {
            Some(_) if over => std::fs::remove_file(&path).or_else(|e| match e.kind() {
                std::io::ErrorKind::NotFound => Ok(()),
                _ => Err(ControlError::io(format!("removing {}", path.display()), e)),
            }),
            Some(state) => saved_job::SavedJob::new(&job_id, g, hub.next_agent(), state).with_job(config.clone(), launched).write(&path),
            None => Ok(()),
        };
        if let Err(e) = written {
            if !std::mem::replace(&mut warned, true) {
                tracing::warn!(
                    "epoch {}: the controller's state is not saved ({e}): a new controller could not take the job back",
                    ctl.job_epoch(ctl.epoch())
                );
            }
        }
    }
}

/// Start `world` processes of this binary's hidden `subcommand`, each a rank of a job on `spec`
/// ([`lazarus_worker::run_rank`] on their side), confined as `confine` says, and run them
/// to the end as a job without recovery: the controller of a training job, whose first loss ends
/// it. Rank 0's results (None: it sent none). Every event goes to `observe`.
pub fn run_local_job<J: Serialize>(
    subcommand: &str,
    workers: Workers,
    timeout_s: f64,
    spec: &J,
    confine: Confinement,
    observe: impl FnMut(TrainEvent) -> Result<(), ControlError>,
) -> Result<Option<serde_json::Value>, ControlError> {
    let timeout_s = check_comm_timeout(timeout_s)?;
    let world = workers.world();
    let epoch = fresh_epoch();
    let mut processes = launch(subcommand, world, timeout_s, spec, confine, epoch, false)?;
    let ctl = Controller::unplanned(Lifecycle::new(timeout_s, None).spec(), epoch, (0..world as u64).collect(), Instant::now());
    let ended = drive(&mut processes, ctl, &format!("{subcommand}-{epoch}"), None, None, observe)?;
    match ended.outcome {
        TrainOutcome::Completed { .. } => Ok(ended.results),
        TrainOutcome::Failed { reason, workers } => Err(ControlError::Launch(format!("{reason}; workers {}", workers.join(", ")))),
    }
}

/// How a job's life is watched, with recovery or without: its leases and heartbeats, its
/// start deadline, and what a loss does.
#[derive(Debug, Clone, Copy)]
pub struct Lifecycle {
    pub lease: Duration,
    pub heartbeat: Duration,
    pub start_within: Duration,
    pub on_loss: OnLoss,
}

impl Lifecycle {
    /// A job whose collectives time out after `comm_timeout_s`, with live `recovery` or none.
    /// Without recovery a worker's lease is the collective deadline: a hung worker is found out
    /// no later than its peers would notice it, and the others get as long again, with a
    /// margin, to say how they stopped.
    pub fn new(comm_timeout_s: f64, recovery: Option<Recovery>) -> Self {
        let start_within = Duration::from_secs_f64(comm_timeout_s.max(10.0) + 60.0);
        match recovery {
            Some(r) => Lifecycle { lease: r.lease, heartbeat: r.heartbeat, start_within, on_loss: OnLoss::Recover },
            None => {
                let lease = lease_without_recovery(comm_timeout_s);
                let grace = Duration::from_secs_f64(comm_timeout_s + 5.0);
                Lifecycle { lease, heartbeat: heartbeat_within(lease), start_within, on_loss: OnLoss::Stop { grace } }
            }
        }
    }

    /// A job spec with these and nothing else: the caller fills in the job's shape.
    pub fn spec(&self) -> JobSpec {
        JobSpec {
            layers: 0,
            experts: 0,
            slots_per_node: 0,
            gpus_per_node: 1,
            policy: PlanPolicy::trainer(1, None),
            expert_bytes: 0,
            lease: self.lease,
            join_wait: DEFAULT_JOIN_WAIT,
            join_rule: JoinRule::AfterWait,
            rebalance_every: 0,
            total_steps: 0,
            on_loss: self.on_loss,
            start_within: self.start_within,
        }
    }
}
