//! `lazarus train --workers N`: the flags become a job for the control plane
//! ([`lazarus_controller::control_loop`]), and its actions become the single-process trainer's progress
//! bar, `--json-log` lines and summary, plus what each worker did.

use anyhow::{bail, Context, Result};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use lazarus_controller::control_loop::saved_job::SavedJob;
use lazarus_controller::{plan_job, run_training, AgentsSpec, Hosts, NodeChange, NodeSchedule, PlanSource, Recovery, TrainOutcome};
use lazarus_model::Trainer;
use lazarus_plan::ModelPlan;
use lazarus_protocol::tls::ServerTls;
use lazarus_protocol::{ControlError, Reach, TrainJob, Workers};

use super::args::{check_resumed_config, resume_steps, setup_run, TrainArgs, DEFAULT_COMM_TIMEOUT_S};
use super::job_view::JobView;
use super::replay_sim::{RunFigures, RunShape};
use super::report::{print_banner, Reporter};
use crate::io::{read_text, MAX_JSON_BYTES};

mod controller;
mod take_back;

pub use controller::{run_controller, ControllerArgs};
use take_back::{saved_job_settings, saved_job_to_take_back};

/// Steps profiled for the measured-load plan when `--profile-steps` is not given (fewer when
/// the run is shorter).
const DEFAULT_PROFILE_STEPS: usize = 3;

/// Where the placement comes from, by the flags.
fn plan_source(args: &TrainArgs, steps_left: u64) -> Result<PlanSource> {
    if args.static_ep {
        if args.placement_file.is_some() {
            bail!("--static-ep places experts itself; drop --placement-file");
        }
        return Ok(PlanSource::StaticEp);
    }
    if let Some(path) = &args.placement_file {
        let text = read_text("placement-file", path, MAX_JSON_BYTES)?;
        let plan = ModelPlan::from_json(&text).with_context(|| format!("invalid --placement-file {}", path.display()))?;
        return Ok(PlanSource::File(plan));
    }
    let profile_steps = match args.profile_steps {
        Some(p) => p,
        None => DEFAULT_PROFILE_STEPS.min(steps_left.max(1) as usize),
    };
    let max_imbalance = crate::planning::throughput_guard(args.max_imbalance.unwrap_or(lazarus_plan::DEFAULT_MAX_IMBALANCE))?;
    Ok(PlanSource::Measured { profile_steps, slots_per_worker: args.slots_per_worker, max_imbalance })
}

/// How long the embedded controller of `train --gpus-per-node` waits for its local agents.
const LOCAL_AGENTS_WITHIN: Duration = Duration::from_secs(60);

/// Where the job's metrics are served (`--metrics-listen`), and the bearer token a scrape must
/// carry (`--metrics-token-file`).
fn metrics_endpoint(args: &TrainArgs) -> Result<Option<lazarus_controller::metrics::MetricsEndpoint>> {
    let token = match &args.metrics_token_file {
        None => None,
        Some(_) if args.metrics_listen.is_none() => bail!("--metrics-token-file needs --metrics-listen (where the metrics are served)"),
        Some(path) => {
            let text = crate::io::read_text("metrics-token-file", path, 4096)?;
            let token = text.lines().next().unwrap_or_default().trim().to_string();
            if token.len() < 16 || !token.bytes().all(|b| b.is_ascii_graphic()) {
                bail!(
                    "invalid --metrics-token-file {}: its first line must be a token of 16 or more visible ASCII characters",
                    path.display()
                );
            }
            Some(token)
        }
    };
    Ok(args.metrics_listen.map(|listen| lazarus_controller::metrics::MetricsEndpoint { listen, token }))
}

/// The node schedule `--replay SOURCE` describes for `nodes` local agents, its times multiplied
/// by `--replay-scale`; with the most nodes present at once, the scale and the trace.
fn node_schedule(source: &str, nodes: usize, scale: Option<f64>, notice: bool) -> Result<(NodeSchedule, usize, f64, lazarus_sim::Trace)> {
    use lazarus_sim::{parse_duration_ms, Change, Trace};
    let scale = scale.unwrap_or(1.0);
    if !scale.is_finite() || scale <= 0.0 || scale > 1e6 {
        bail!("invalid --replay-scale: {scale} (expected a factor above 0, at most 1e6)");
    }
    let parts: Vec<&str> = source.split(':').collect();
    let bad = |why: &str| anyhow::anyhow!("invalid --replay: {source:?} ({why})");
    let seed = |i: usize| -> Result<u64> { parts.get(i).map_or(Ok(0), |s| s.parse().map_err(|_| bad("the seed is not an integer"))) };
    let ms = |i: usize| -> Result<u64> { parse_duration_ms(parts.get(i).copied().unwrap_or_default()).map_err(|e| bad(&e.to_string())) };
    let trace = match parts[0] {
        "fail-every" if (2..=3).contains(&parts.len()) => Trace::fail_every(nodes, ms(1)?, nodes / 2, seed(2)?)?,
        "poisson" if (4..=5).contains(&parts.len()) => Trace::poisson(nodes, ms(1)? as f64, ms(2)?, ms(3)?, seed(4)?)?,
        "fail-every" => return Err(bad("expected fail-every:EVERY[:SEED], e.g. fail-every:30s")),
        "poisson" => return Err(bad("expected poisson:MTBF:REPAIR:DURATION[:SEED], e.g. poisson:20s:5s:2m")),
        _ => {
            let text = crate::io::read_text("replay trace", std::path::Path::new(source), crate::io::MAX_JSON_BYTES)?;
            Trace::parse_bamboo(&text, source)?
        }
    };
    let initial: Vec<String> = trace.events.iter().take_while(|e| e.ms == 0 && e.change == Change::Add).map(|e| e.node.clone()).collect();
    if initial.len() != nodes {
        bail!(
            "invalid --replay: the trace starts with {} nodes, but --workers / --gpus-per-node is {nodes} (one local agent a node)",
            initial.len()
        );
    }
    let mut present = initial.len();
    let mut most = present;
    let changes: Vec<NodeChange> = trace.events[initial.len()..]
        .iter()
        .map(|e| {
            present = if e.change == Change::Add { present + 1 } else { present.saturating_sub(1) };
            most = most.max(present);
            NodeChange { at: Duration::from_secs_f64(e.ms as f64 / 1000.0 * scale), node: e.node.clone(), add: e.change == Change::Add }
        })
        .collect();
    if most > lazarus_protocol::MAX_WORKERS_PER_HOST {
        bail!("invalid --replay: {most} nodes at once (at most {} workers on one machine)", lazarus_protocol::MAX_WORKERS_PER_HOST);
    }
    Ok((NodeSchedule { initial, changes, notice }, most, scale, trace))
}

/// The launcher side of `lazarus train --workers N`; `run_dir`: the directory of the run's own it
/// was given.
pub fn run_train_workers(args: &TrainArgs, run_dir: Option<&Path>) -> Result<()> {
    let world = args.workers.unwrap_or(1);
    if args.gpus_per_node.is_none() && (args.replay.is_some() || args.replay_scale.is_some() || args.replay_notice) {
        bail!("--replay needs --gpus-per-node G: nodes come and go as local agents");
    }
    let mut replayed = None;
    let workers = Workers::new(world, args.gpus_per_node.unwrap_or(1), Reach::OneMachine)?;
    let hosts = match args.gpus_per_node {
        None => Hosts::Local { status_listen: None },
        Some(g) => {
            let listen = match args.status_listen.as_deref() {
                Some("off") => bail!("--status-listen off: the local agents attach to the controller there (give an address)"),
                given => given.unwrap_or("127.0.0.1:0"),
            };
            let listen: SocketAddr =
                listen.parse().map_err(|_| anyhow::anyhow!("invalid --status-listen: {listen:?} (expected host:port or off)"))?;
            let secret = lazarus_protocol::fresh_secret().context("drawing the job secret")?;
            let nodes = workers.nodes();
            let (schedule, most_nodes, scale) = match &args.replay {
                Some(source) => {
                    let (s, most, scale, trace) = node_schedule(source, nodes, args.replay_scale, args.replay_notice)?;
                    replayed = Some(RunShape {
                        trace,
                        scale,
                        gpus_per_node: g,
                        slots_per_gpu: 0,
                        most_nodes: most,
                        join_wait_s: lazarus_controller::control_loop::DEFAULT_JOIN_WAIT.as_secs_f64() * scale,
                        rebalance_every: 0,
                        notice: args.replay_notice,
                    });
                    (Some(s), most, scale)
                }
                None => (None, nodes, 1.0),
            };
            Hosts::Agents(Box::new(AgentsSpec {
                listen,
                secret,
                tls: ServerTls::FromSecret(secret),
                local_agents: nodes,
                agent_command_line: crate::agent::local_agent_command_line,
                gpus_per_node: g,
                wait: LOCAL_AGENTS_WITHIN,
                max_workers: most_nodes * g,
                join_wait: lazarus_controller::control_loop::DEFAULT_JOIN_WAIT.mul_f64(scale),
                join_rule: lazarus_controller::decisions::JoinRule::AfterWait,
                schedule,
                state_file: None,
                resume: None,
            }))
        }
    };
    run_job(args, hosts, workers, None, replayed, false, run_dir)
}

/// Most held-out tokens a job's workers take: they travel in the job's spec.
const MAX_WORKER_HELD_OUT_TOKENS: usize = 4 << 20;

/// The held-out data of `--eval-data` for the workers to evaluate on together.
fn held_out_for_workers(args: &TrainArgs, cfg: &lazarus_model::TrainConfig) -> Result<Option<lazarus_protocol::HeldOut>> {
    let held_out = super::held_out(args, cfg)?;
    if let Some(h) = held_out.as_ref().filter(|h| h.tokens.len() > MAX_WORKER_HELD_OUT_TOKENS) {
        bail!(
            "invalid --eval-windows: {} windows of --seq-len {} take {} tokens; with --workers at most {MAX_WORKER_HELD_OUT_TOKENS} (they go to every worker in the job's spec)",
            h.windows,
            cfg.seq_len,
            h.tokens.len()
        );
    }
    Ok(held_out)
}

/// A job of `workers` run where `hosts` says; `agent_command` is how to start an agent of
/// another host (`{addr}`: the controller's address), shown once the controller listens. A
/// replayed trace (`replayed`) is run through the simulator too, calibrated to the run.
/// `resume_job`: the job a lost controller ran, taken back; `run_dir`: the directory of the
/// run's own a new run was given.
fn run_job(
    args: &TrainArgs,
    mut hosts: Hosts,
    mut workers: Workers,
    agent_command: Option<String>,
    mut replayed: Option<RunShape>,
    resume_job: bool,
    run_dir: Option<&Path>,
) -> Result<()> {
    let args = &super::args::settle_resume(args)?;
    let comm_timeout = lazarus_agent::launcher::check_comm_timeout(args.comm_timeout.unwrap_or(DEFAULT_COMM_TIMEOUT_S))?;
    // Every worker of a job on one machine is started here; none of a controller of other
    // hosts' agents.
    let local = if matches!(&hosts, Hosts::Agents(a) if a.local_agents == 0) { 0 } else { workers.world() };
    // The launcher builds the model once to plan, and every worker here builds it whole before
    // it releases the experts it does not hold.
    let (mut trainer, resume) = start_trainer(args, 1 + local as u128, resume_job)?;
    let cfg = trainer.config.clone();
    if let Some(dir) = run_dir.filter(|_| resume.is_none()) {
        super::args::keep_run_files(dir, &cfg)?;
    }
    if let Hosts::Agents(a) = &mut hosts {
        // A controller of other hosts' agents saves what a new one needs to take the job back.
        if a.local_agents == 0 {
            a.state_file = cfg.checkpoint_dir.as_deref().map(SavedJob::path_in);
        }
        if a.max_workers > cfg.batch_size {
            bail!("invalid --max-workers: {} (a batch of {} sequences cannot be split over more workers)", a.max_workers, cfg.batch_size);
        }
    }
    let g = workers.gpus_per_node();
    let mut first_step = trainer.step;
    let plan = match (&mut hosts, resume_job) {
        (Hosts::Agents(a), true) => {
            let (plan, taken) = saved_job_to_take_back(args, &cfg, g)?;
            workers = Workers::new(plan.map.ranks(), g, Reach::Agents)?;
            first_step = taken.last_logged.unwrap_or(taken.saved.state.last_step);
            a.resume = Some(Box::new(taken));
            plan
        }
        _ => {
            if trainer.done() {
                bail!("nothing to do: the run is at step {} of --steps {}", trainer.step, cfg.steps);
            }
            let source = plan_source(args, cfg.steps - trainer.step)?;
            plan_job(&mut trainer, workers, &source)?
        }
    };
    let world = workers.world();
    let how = format!("{world} workers, {}", if args.static_ep { "static expert parallelism" } else { "lazarus dispatch" });
    print_banner(&trainer, &how, args.model.device.as_deref().unwrap_or("cpu"));
    print_placement(&plan.map, world);
    let recovery = recovery(args)?;
    if let Some(r) = replayed.as_mut() {
        r.slots_per_gpu = plan.placement.as_ref().map_or(1, |p| p.shape().slots_per_gpu);
        r.rebalance_every = recovery.as_ref().map_or(0, |r| r.rebalance_every);
    }
    let off = recovery.as_ref().and(lazarus_controller::recovery_off(args.static_ep, plan.placement.as_ref(), workers));
    if let Some(off) = off {
        tracing::info!("recovery: off ({off})");
    }
    let live = recovery.is_some() && off.is_none();
    // The log file is opened (and checked) before any worker starts.
    let reporter = Reporter::new(args, &cfg, first_step)?;
    let snapshots = snapshot_settings(args, live, g)?;
    super::args::check_shard_sequences(args.shard_sequences, cfg.batch_size)?;
    let job = TrainJob {
        encrypt_data: args.encrypt_data,
        config: cfg.clone(),
        plan: plan.map,
        static_ep: args.static_ep,
        deterministic: args.deterministic,
        shard_sequences: args.shard_sequences,
        resume,
        heartbeat_s: 0.0,
        faults: String::new(),
        standby: false,
        snapshots,
        device: args.model.device.clone().unwrap_or_else(|| "cpu".into()),
        held_out: held_out_for_workers(args, &cfg)?,
    };
    // (A job of node agents without live recovery is refused by the controller, first thing.)
    if let Hosts::Local { status_listen } = &mut hosts {
        *status_listen = local_status_listen(args, live)?;
    }
    let remote = matches!(&hosts, Hosts::Agents(a) if a.local_agents == 0);
    // SIGTERM / Ctrl-C from here on: every worker finishes after the same step, with a checkpoint.
    lazarus_protocol::stop_signal::install();
    let figures = RunFigures { loads: vec![vec![0.0; cfg.model.n_experts]; cfg.model.moe_layers()], ..RunFigures::default() };
    let mut view = JobView { reporter, figures, started: None, remote, agent_command, world, gpus_per_node: g, seq_len: cfg.seq_len };
    let http = lazarus_controller::HttpEndpoints { metrics: metrics_endpoint(args)?, dashboard: args.dashboard_listen };
    let mut report_error: Option<anyhow::Error> = None;
    let outcome = run_training(&job, plan.placement.as_ref(), workers, comm_timeout, recovery, &hosts, &http, |event| {
        let shown = view.show(event);
        shown.map_err(|e| {
            let message = format!("{e:#}");
            report_error = Some(e);
            ControlError::Launch(format!("stopped: {message}"))
        })
    });
    if let Some(e) = report_error {
        return Err(e);
    }
    let ran = RanJob { cfg: &cfg, first_step, unigram_entropy: trainer.unigram_entropy(), replayed: replayed.as_ref() };
    ran.finish(outcome, &mut view)
}

/// The trainer the job starts from (its settings, the model to plan with; `copies` processes
/// hold the model here): a job taken back runs its saved settings; `--resume` goes on from the
/// checkpoint (the checkpoint directory resumed from comes back for the workers); else a new
/// run.
fn start_trainer(args: &TrainArgs, copies: u128, resume_job: bool) -> Result<(Trainer, Option<PathBuf>)> {
    if resume_job {
        // The job's settings (the workers hold its state): the saved job's, which flags may
        // repeat but not change.
        return Ok((Trainer::new(saved_job_settings(args, setup_run(args, copies)?)?)?, None));
    }
    if !args.resume {
        return Ok((Trainer::new(setup_run(args, copies)?)?, None));
    }
    let config = setup_run(args, copies)?;
    let Some(dir) = config.checkpoint_dir.clone() else {
        bail!("--resume needs --checkpoint-dir (or checkpoint_dir in --config)");
    };
    let t = Trainer::resume(&dir, resume_steps(args)?).with_context(|| format!("resuming from {}", dir.display()))?;
    check_resumed_config(args, &t.config)?;
    super::args::set_aside_newer(t.config.checkpoint_dir.as_deref().unwrap_or(&dir), t.step)?;
    tracing::info!("resuming from {} at step {}", dir.display(), t.step);
    Ok((t, Some(dir)))
}

/// The in-memory expert snapshots of a job with live recovery (`live`), by
/// `--snapshot-bandwidth` / `--snapshot-ceiling`; None where they are off.
fn snapshot_settings(args: &TrainArgs, live: bool, g: usize) -> Result<Option<lazarus_runtime::SnapshotSettings>> {
    if let Some(c) = args.snapshot_ceiling.filter(|c| !c.is_finite() || *c <= 0.0) {
        bail!("invalid --snapshot-ceiling: {c} (bytes per second, more than 0; --snapshot-bandwidth 0 turns snapshots off)");
    }
    let bandwidth = args.snapshot_bandwidth.or(args.snapshot_ceiling).unwrap_or(DEFAULT_SNAPSHOT_BANDWIDTH);
    if !bandwidth.is_finite() || bandwidth < 0.0 {
        bail!("invalid --snapshot-bandwidth: {bandwidth} (bytes per second, 0 or more; 0: no snapshots)");
    }
    Ok((live && bandwidth > 0.0).then_some(lazarus_runtime::SnapshotSettings {
        gpus_per_node: g,
        bandwidth,
        adaptive: args.snapshot_bandwidth.is_none(),
    }))
}

/// Where a local job with live recovery (`live`) serves its status (`--status-listen`; by
/// default any free port on loopback; `off`: nowhere).
fn local_status_listen(args: &TrainArgs, live: bool) -> Result<Option<SocketAddr>> {
    Ok(match (live, args.status_listen.as_deref()) {
        (_, Some("off")) => None,
        (false, Some(_)) => bail!("--status-listen needs live recovery (the controller serves the status)"),
        (false, None) => None,
        (true, given) => {
            let addr = given.unwrap_or("127.0.0.1:0");
            Some(addr.parse::<SocketAddr>().map_err(|_| anyhow::anyhow!("invalid --status-listen: {addr:?} (expected host:port or off)"))?)
        }
    })
}

/// A job that ran, for its summary.
struct RanJob<'a> {
    cfg: &'a lazarus_model::TrainConfig,
    first_step: u64,
    unigram_entropy: f64,
    replayed: Option<&'a RunShape>,
}

impl RanJob<'_> {
    /// The summary of how the job ended: completed (or stopped by a signal after a step, with
    /// the exit status a process killed by it has), or failed, with why.
    fn finish(&self, outcome: Result<TrainOutcome, ControlError>, view: &mut JobView) -> Result<()> {
        let cfg = self.cfg;
        let outcome = match outcome {
            // Stopped by a signal before any worker trained (while waiting for agents): said,
            // and the exit status a process killed by it has.
            Err(e) if view.reporter.last_step().is_none() && lazarus_protocol::stop_signal::requested().is_some() => {
                let (sig, _) = lazarus_protocol::stop_signal::requested().unwrap_or((libc::SIGTERM, "SIGTERM"));
                view.reporter.pause();
                tracing::warn!("{e}");
                std::process::exit(128 + sig);
            }
            o => o,
        };
        match outcome? {
            TrainOutcome::Completed { checkpoint } => {
                if let Some((sig, name)) = lazarus_protocol::stop_signal::requested() {
                    let step = view.reporter.last_step().unwrap_or(self.first_step);
                    if step < cfg.steps {
                        match &checkpoint {
                            Some(p) => tracing::warn!(
                                "{name}: stopped after step {step}; checkpoint {} written (--resume goes on from it)",
                                p.display()
                            ),
                            None => tracing::warn!("{name}: stopped after step {step}; nothing saved (no --checkpoint-dir)"),
                        }
                        view.reporter.finish(step, self.unigram_entropy, checkpoint.as_deref())?;
                        std::process::exit(128 + sig);
                    }
                }
                if let Some(shape) = self.replayed {
                    view.compare_replay(cfg, shape, cfg.steps - self.first_step)?;
                }
                view.reporter.finish(cfg.steps, self.unigram_entropy, checkpoint.as_deref())
            }
            TrainOutcome::Failed { reason, workers } => {
                if workers.is_empty() {
                    bail!("training stopped: {reason}")
                }
                bail!("training stopped: {reason}; workers {}", workers.join(", "))
            }
        }
    }
}

/// Which experts each worker holds, layer by layer (`e` once, `eXn` for n replicas).
fn print_placement(map: &lazarus_plan::ReplicaMap, world: usize) {
    for l in 0..map.layer_count() {
        let layer = map.dense_layer(l);
        let per_worker: Vec<String> = (0..world)
            .map(|r| {
                let held: Vec<String> = layer
                    .iter()
                    .enumerate()
                    .filter(|(_, row)| row[r] > 0)
                    .map(|(e, row)| if row[r] > 1 { format!("{e}x{}", row[r]) } else { e.to_string() })
                    .collect();
                format!("w{r}[{}]", held.join(","))
            })
            .collect();
        tracing::info!("placement L{l}: {}", per_worker.join(" "));
    }
}

/// The most of the link snapshots get by default: 5 Gb/s, half of a common 10 Gb/s cloud NIC (the
/// other half left to the step's own all-to-all and all-reduce). Below it the default budget
/// paces itself by what each round costs (`lazarus_plan::SnapshotPace`).
pub const DEFAULT_SNAPSHOT_BANDWIDTH: f64 = 625e6;

/// `--recovery`, `--lease` and `--heartbeat`: how failures are found and recovered from.
fn recovery(args: &TrainArgs) -> Result<Option<Recovery>> {
    if !args.recovery.unwrap_or(true) {
        if args.rebalance_every.is_some() {
            bail!("--rebalance-every needs live recovery (the controller moves the job): drop --recovery off");
        }
        if args.snapshot_bandwidth.is_some_and(|b| b > 0.0) {
            bail!("--snapshot-bandwidth needs live recovery (snapshots restore experts in a move): drop --recovery off");
        }
        if args.snapshot_ceiling.is_some() {
            bail!("--snapshot-ceiling needs live recovery (snapshots restore experts in a move): drop --recovery off");
        }
        return Ok(None);
    }
    let mut r = Recovery::from_flags(args.lease, args.heartbeat)?;
    if let Some(k) = args.rebalance_every {
        r.rebalance_every = k;
    }
    Ok(Some(r))
}
