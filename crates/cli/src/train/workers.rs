//! `lazarus train --workers N`: the flags become a job for the control plane
//! ([`lazarus_control::control_loop`]), and its actions become the single-process trainer's progress
//! bar, `--json-log` lines and summary, plus what each worker did.

use anyhow::{bail, Context, Result};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use lazarus_control::control_loop::saved_job::SavedJob;
use lazarus_control::control_loop::ResumeJob;
use lazarus_control::tls::ServerTls;
use lazarus_control::{
    plan_job, run_training, AgentsSpec, ControlError, Hosts, JobPlan, NodeChange, NodeSchedule, PlanSource, Recovery, TrainJob,
    TrainOutcome,
};
use lazarus_model::Trainer;
use lazarus_plan::ModelPlan;

use super::args::{check_resumed_config, resume_steps, setup_run, TrainArgs, DEFAULT_COMM_TIMEOUT_S};
use super::job_view::JobView;
use super::replay_sim::{RunFigures, RunShape};
use super::report::{print_banner, Reporter};
use crate::io::{read_text, MAX_JSON_BYTES};

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

/// `lazarus controller`: the controller of a job whose workers node agents of other hosts run.
/// Every setting may also come from the `[controller]` table of `--config` (flags override it).
#[derive(clap::Args, Debug, Clone)]
pub struct ControllerArgs {
    /// Where agents attach and `lazarus status` asks (host:port; port 0: any free port).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// The job's secret, 32 hex digits: read from this file, or written to it (mode 0600) when
    /// it does not exist. Agents take the same file (or LAZARUS_SECRET). Default: a fresh
    /// secret, printed with the command that starts an agent.
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// Seconds to wait for agents to bring every worker (default 600).
    #[arg(long, value_name = "SECONDS")]
    pub wait_agents: Option<f64>,
    /// Most workers at once (default: --workers). Agents that attach to the running job are
    /// taken in while there is room: a node that comes back, or more capacity.
    #[arg(long, value_name = "N")]
    pub max_workers: Option<usize>,
    /// Seconds a node that joins the running job waits to be taken in, so that several
    /// arrivals share one move (default 120, as in the paper; a failure takes it in at once).
    #[arg(long, value_name = "SECONDS")]
    pub join_wait: Option<f64>,
    /// Take back the running job a lost controller saved in --checkpoint-dir
    /// (controller-state.json): start this with the same flags, --listen and secret; the agents,
    /// waiting with their workers paused (lazarus agent --controller-grace), re-attach, and
    /// training goes on from the step it stopped at.
    #[arg(long)]
    pub resume_job: bool,
    #[command(flatten)]
    pub tls: crate::tls::TlsArgs,
    #[command(flatten)]
    pub train: TrainArgs,
}

/// The `[controller]` table of a `--config` file: the controller's own settings and the job's
/// workers, as its flags name them (`max_workers` for `--max-workers`, …).
#[derive(serde::Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct ControllerTable {
    listen: Option<String>,
    secret_file: Option<PathBuf>,
    wait_agents: Option<f64>,
    max_workers: Option<usize>,
    join_wait: Option<f64>,
    workers: Option<usize>,
    gpus_per_node: Option<usize>,
    lease: Option<f64>,
    heartbeat: Option<f64>,
    comm_timeout: Option<f64>,
    rebalance_every: Option<u64>,
    metrics_listen: Option<SocketAddr>,
    metrics_token_file: Option<PathBuf>,
    device: Option<String>,
    encrypt_data: Option<bool>,
    json_log: Option<PathBuf>,
    quiet: Option<bool>,
    resume: Option<bool>,
    resume_if_any: Option<bool>,
    overwrite_checkpoints: Option<bool>,
    placement_file: Option<PathBuf>,
    slots_per_worker: Option<usize>,
    max_imbalance: Option<f64>,
    profile_steps: Option<usize>,
    static_ep: Option<bool>,
    deterministic: Option<bool>,
    shard_sequences: Option<usize>,
    recovery: Option<bool>,
    snapshot_bandwidth: Option<f64>,
    snapshot_ceiling: Option<f64>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_ca: Option<PathBuf>,
    resume_job: Option<bool>,
}

/// `args` with what its `--config` file's `[controller]` table says where no flag did.
fn with_config_table(args: &ControllerArgs) -> Result<ControllerArgs> {
    let mut a = args.clone();
    a.train.model.config_tables = &["controller"];
    let Some(path) = &args.train.model.config else { return Ok(a) };
    let Some(t) = crate::io::config_table::<ControllerTable>(path, "controller")? else { return Ok(a) };
    fn or<T>(flag: &mut Option<T>, file: Option<T>) {
        if flag.is_none() {
            *flag = file;
        }
    }
    or(&mut a.listen, t.listen);
    or(&mut a.secret_file, t.secret_file);
    or(&mut a.wait_agents, t.wait_agents);
    or(&mut a.max_workers, t.max_workers);
    or(&mut a.join_wait, t.join_wait);
    or(&mut a.train.workers, t.workers);
    or(&mut a.train.gpus_per_node, t.gpus_per_node);
    or(&mut a.train.lease, t.lease);
    or(&mut a.train.heartbeat, t.heartbeat);
    or(&mut a.train.comm_timeout, t.comm_timeout);
    or(&mut a.train.rebalance_every, t.rebalance_every);
    or(&mut a.train.metrics_listen, t.metrics_listen);
    or(&mut a.train.metrics_token_file, t.metrics_token_file);
    or(&mut a.train.model.device, t.device);
    or(&mut a.train.json_log, t.json_log);
    or(&mut a.train.placement_file, t.placement_file);
    or(&mut a.train.slots_per_worker, t.slots_per_worker);
    or(&mut a.train.max_imbalance, t.max_imbalance);
    or(&mut a.train.profile_steps, t.profile_steps);
    or(&mut a.train.recovery, t.recovery);
    or(&mut a.train.shard_sequences, t.shard_sequences);
    // A switch given on the command line stays on; the file can turn it on too.
    for (flag, file) in [
        (&mut a.train.encrypt_data, t.encrypt_data),
        (&mut a.train.quiet, t.quiet),
        (&mut a.train.resume, t.resume),
        (&mut a.train.resume_if_any, t.resume_if_any),
        (&mut a.train.overwrite_checkpoints, t.overwrite_checkpoints),
        (&mut a.train.static_ep, t.static_ep),
        (&mut a.train.deterministic, t.deterministic),
    ] {
        *flag |= file.unwrap_or(false);
    }
    // The paced default's ceiling and a fixed budget are one setting: a flag replaces the file's.
    if a.train.snapshot_bandwidth.is_none() && a.train.snapshot_ceiling.is_none() {
        (a.train.snapshot_bandwidth, a.train.snapshot_ceiling) = (t.snapshot_bandwidth, t.snapshot_ceiling);
    }
    a.tls.or(t.tls_cert, t.tls_key, t.tls_ca);
    a.resume_job |= t.resume_job.unwrap_or(false);
    let one_of = |pairs: [(&str, bool); 2]| match pairs {
        [(x, true), (y, true)] => bail!("invalid --config {}: {x} and {y} together (give one)", path.display()),
        _ => Ok(()),
    };
    one_of([("resume", a.train.resume), ("resume_if_any", a.train.resume_if_any)])?;
    one_of([("resume_if_any", a.train.resume_if_any), ("overwrite_checkpoints", a.train.overwrite_checkpoints)])?;
    one_of([("snapshot_bandwidth", a.train.snapshot_bandwidth.is_some()), ("snapshot_ceiling", a.train.snapshot_ceiling.is_some())])?;
    Ok(a)
}

/// Most seconds `lazarus controller --wait-agents` may wait.
const MAX_WAIT_AGENTS_S: f64 = 86_400.0;

/// How long the embedded controller of `train --gpus-per-node` waits for its local agents.
const LOCAL_AGENTS_WITHIN: Duration = Duration::from_secs(60);

/// The job's secret from `path` (32 hex digits), or a fresh one written there (mode 0600).
/// Where the job's metrics are served (`--metrics-listen`), and the bearer token a scrape must
/// carry (`--metrics-token-file`).
fn metrics_endpoint(args: &TrainArgs) -> Result<Option<lazarus_control::metrics::MetricsEndpoint>> {
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
    Ok(args.metrics_listen.map(|listen| lazarus_control::metrics::MetricsEndpoint { listen, token }))
}

pub fn secret_from_file(path: &Path, create: bool) -> Result<u128> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {
            let secret = lazarus_control::protocol::fresh_secret().context("drawing the job secret")?;
            let mut options = std::fs::OpenOptions::new();
            options.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
            let mut f = options.open(path).with_context(|| format!("creating --secret-file {}", path.display()))?;
            use std::io::Write;
            writeln!(f, "{}", lazarus_control::protocol::secret_hex(secret)).with_context(|| format!("writing {}", path.display()))?;
            Ok(secret)
        }
        _ => {
            // A regular file of a line (a FIFO or /dev/zero is refused, not read without end).
            let text = crate::io::read_text("secret-file", path, 4096)?;
            lazarus_control::protocol::parse_secret(text.trim()).ok_or_else(|| {
                anyhow::anyhow!(
                    "invalid --secret-file {}: expected 32 hex digits drawn at random (at least 6 different ones)",
                    path.display()
                )
            })
        }
    }
}

/// `lazarus controller --listen ADDR --workers N …`.
pub fn run_controller(args: &ControllerArgs) -> Result<()> {
    let args = &with_config_table(args)?;
    let Some(listen) = &args.listen else {
        bail!("lazarus controller needs --listen ADDR (or listen in the [controller] table of --config)")
    };
    if args.train.workers.is_none() {
        bail!(
            "lazarus controller needs --workers N (the job's workers, over all agents; or workers in the [controller] table of --config)"
        );
    }
    if args.train.replay.is_some() || args.train.replay_scale.is_some() || args.train.replay_notice {
        bail!("--replay kills and starts local agents: use lazarus train --workers N --gpus-per-node G --replay …");
    }
    if args.train.status_listen.is_some() {
        bail!("--status-listen: the controller answers lazarus status at --listen");
    }
    let listen: SocketAddr =
        listen.parse().map_err(|_| anyhow::anyhow!("invalid --listen: {listen:?} (expected host:port, e.g. 0.0.0.0:7070)"))?;
    let wait = args.wait_agents.unwrap_or(600.0);
    if !wait.is_finite() || wait <= 0.0 || wait > MAX_WAIT_AGENTS_S {
        bail!("invalid --wait-agents: {wait} (expected seconds, more than 0 and at most {MAX_WAIT_AGENTS_S})");
    }
    let (secret, agent_command) = match &args.secret_file {
        Some(path) => {
            (secret_from_file(path, true)?, format!("lazarus agent --controller {{addr}} --gpus G --secret-file {}", path.display()))
        }
        None => {
            let s = lazarus_control::protocol::fresh_secret().context("drawing the job secret")?;
            (s, format!("LAZARUS_SECRET={} lazarus agent --controller {{addr}} --gpus G", lazarus_control::protocol::secret_hex(s)))
        }
    };
    // An operator's certificate: agents check it against their CA (and bring their own
    // certificate where the controller asks for one).
    let agent_command = match (&args.tls.tls_cert, &args.tls.tls_ca) {
        (None, _) => agent_command,
        (Some(_), None) => format!("{agent_command} --tls-ca CA.pem"),
        (Some(_), Some(_)) => format!("{agent_command} --tls-ca CA.pem --tls-cert AGENT.pem --tls-key AGENT-KEY.pem"),
    };
    let world = args.train.workers.unwrap_or(1);
    let g = args.train.gpus_per_node.unwrap_or(1);
    if g == 0 || !world.is_multiple_of(g) {
        bail!("invalid --gpus-per-node: {g} (expected a divisor of --workers {world}; every agent brings that many)");
    }
    let wait = Duration::from_secs_f64(wait);
    let max_workers = args.max_workers.unwrap_or(world);
    let most = lazarus_control::protocol::MAX_WORKERS;
    if max_workers < world || max_workers > most || !max_workers.is_multiple_of(g) {
        bail!("invalid --max-workers: {max_workers} (expected from --workers {world} to {most}, a multiple of --gpus-per-node {g})");
    }
    let join_wait = args.join_wait.unwrap_or(lazarus_control::control_loop::DEFAULT_JOIN_WAIT.as_secs_f64());
    if !join_wait.is_finite() || !(0.0..=MAX_WAIT_AGENTS_S).contains(&join_wait) {
        bail!("invalid --join-wait: {join_wait} (expected seconds from 0 to {MAX_WAIT_AGENTS_S})");
    }
    let join_wait = Duration::from_secs_f64(join_wait);
    let tls = ServerTls::new(secret, args.tls.files()?)?;
    let hosts = Hosts::Agents(Box::new(AgentsSpec {
        listen,
        secret,
        tls,
        local_agents: 0,
        gpus_per_node: g,
        wait,
        max_workers,
        join_wait,
        schedule: None,
        state_file: None,
        resume: None,
    }));
    let mut train = args.train.clone();
    // Started again by a supervisor (`--resume-if-any`): a job its predecessor was running when
    // it was lost is taken back; otherwise the latest checkpoint, if any, as for `train`.
    let saved_job = super::args::build_config(&train).ok().and_then(|c| c.checkpoint_dir).map(|d| SavedJob::path_in(&d));
    let held = saved_job.filter(|p| p.exists());
    let resume_job = args.resume_job || (train.resume_if_any && held.is_some());
    if resume_job && !args.resume_job {
        tracing::info!("--resume-if-any: the checkpoint directory holds a running job's state: taking it back (--resume-job)");
    }
    if let Some(path) = held.filter(|_| !resume_job && !train.resume && !train.overwrite_checkpoints) {
        // A new job here would write its state over the lost one's: the job could not be taken back.
        let whose = match SavedJob::read(&path) {
            Ok(s) => format!("job {} (saved {})", s.job_id, lazarus_control::when::utc_text(s.saved_unix_ms)),
            Err(_) => "a job".into(),
        };
        bail!(
            "{} holds the state of {whose}, whose controller was lost while it ran: --resume-job takes it back; \
             --overwrite-checkpoints starts a new job there instead",
            path.display()
        );
    }
    if resume_job {
        // The job's settings are the saved run's: its log goes on, its checkpoints stay.
        if train.overwrite_checkpoints {
            bail!("--resume-job takes a running job back: drop --overwrite-checkpoints");
        }
        (train.resume, train.resume_if_any) = (true, false);
    }
    run_job(&train, hosts, Some(agent_command), None, resume_job)
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
    if most > lazarus_control::protocol::MAX_WORKERS_PER_HOST {
        bail!(
            "invalid --replay: {most} nodes at once (at most {} workers on one machine)",
            lazarus_control::protocol::MAX_WORKERS_PER_HOST
        );
    }
    Ok((NodeSchedule { initial, changes, notice }, most, scale, trace))
}

/// The launcher side of `lazarus train --workers N`.
pub fn run_train_workers(args: &TrainArgs) -> Result<()> {
    let world = args.workers.unwrap_or(1);
    if args.gpus_per_node.is_none() && (args.replay.is_some() || args.replay_scale.is_some() || args.replay_notice) {
        bail!("--replay needs --gpus-per-node G: nodes come and go as local agents");
    }
    let mut replayed = None;
    let hosts = match args.gpus_per_node {
        None => Hosts::Local { status_listen: None },
        Some(g) => {
            if g == 0 || !world.is_multiple_of(g) {
                bail!("invalid --gpus-per-node: {g} (expected a divisor of --workers {world})");
            }
            let listen = match args.status_listen.as_deref() {
                Some("off") => bail!("--status-listen off: the local agents attach to the controller there (give an address)"),
                given => given.unwrap_or("127.0.0.1:0"),
            };
            let listen: SocketAddr =
                listen.parse().map_err(|_| anyhow::anyhow!("invalid --status-listen: {listen:?} (expected host:port or off)"))?;
            let secret = lazarus_control::protocol::fresh_secret().context("drawing the job secret")?;
            let nodes = world / g;
            let (schedule, most_nodes, scale) = match &args.replay {
                Some(source) => {
                    let (s, most, scale, trace) = node_schedule(source, nodes, args.replay_scale, args.replay_notice)?;
                    replayed = Some(RunShape {
                        trace,
                        scale,
                        gpus_per_node: g,
                        slots_per_gpu: 0,
                        most_nodes: most,
                        join_wait_s: lazarus_control::control_loop::DEFAULT_JOIN_WAIT.as_secs_f64() * scale,
                        rebalance_every: 0,
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
                gpus_per_node: g,
                wait: LOCAL_AGENTS_WITHIN,
                max_workers: most_nodes * g,
                join_wait: lazarus_control::control_loop::DEFAULT_JOIN_WAIT.mul_f64(scale),
                schedule,
                state_file: None,
                resume: None,
            }))
        }
    };
    run_job(args, hosts, None, replayed, false)
}

/// Most held-out tokens a job's workers take: they travel in the job's spec.
const MAX_WORKER_HELD_OUT_TOKENS: usize = 4 << 20;

/// The held-out data of `--eval-data` for the workers to evaluate on together.
fn held_out_for_workers(args: &TrainArgs, cfg: &lazarus_model::TrainConfig) -> Result<Option<lazarus_control::protocol::HeldOut>> {
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

/// A job of `--workers N` run where `hosts` says; `agent_command` is how to start an agent of
/// another host (`{addr}`: the controller's address), shown once the controller listens. A
/// replayed trace (`replayed`) is run through the simulator too, calibrated to the run.
fn run_job(
    args: &TrainArgs,
    mut hosts: Hosts,
    agent_command: Option<String>,
    mut replayed: Option<RunShape>,
    resume_job: bool,
) -> Result<()> {
    let args = &super::args::settle_resume(args)?;
    let mut world = args.workers.unwrap_or(1);
    let comm_timeout = lazarus_control::launcher::check_comm_timeout(args.comm_timeout.unwrap_or(DEFAULT_COMM_TIMEOUT_S))?;
    // Workers this machine starts: every one of a local job, none of a controller of other
    // hosts' agents.
    let local = match &hosts {
        Hosts::Local { .. } => world,
        Hosts::Agents(a) => a.local_agents * a.gpus_per_node,
    };
    let most = if local > 0 { lazarus_control::protocol::MAX_WORKERS_PER_HOST } else { lazarus_control::protocol::MAX_WORKERS };
    if world == 0 || world > most {
        let on = if local > 0 { " on one machine" } else { "" };
        bail!("invalid --workers: {world} (expected 1 to {most}{on})");
    }
    // The launcher builds the model once to plan, and every worker here builds it whole before
    // it releases the experts it does not hold.
    let copies = 1 + local as u128;
    let (mut trainer, resume) = if resume_job {
        // The job's settings (the workers hold its state): the saved job's, which flags may
        // repeat but not change.
        (Trainer::new(saved_job_settings(args, setup_run(args, copies)?)?)?, None)
    } else if args.resume {
        let config = setup_run(args, copies)?;
        let Some(dir) = config.checkpoint_dir.clone() else {
            bail!("--resume needs --checkpoint-dir (or checkpoint_dir in --config)");
        };
        let t = Trainer::resume(&dir, resume_steps(args)?).with_context(|| format!("resuming from {}", dir.display()))?;
        check_resumed_config(args, &t.config)?;
        super::args::set_aside_newer(t.config.checkpoint_dir.as_deref().unwrap_or(&dir), t.step)?;
        tracing::info!("resuming from {} at step {}", dir.display(), t.step);
        (t, Some(dir))
    } else {
        (Trainer::new(setup_run(args, copies)?)?, None)
    };
    let cfg = trainer.config.clone();
    if let Hosts::Agents(a) = &mut hosts {
        // A controller of other hosts' agents saves what a new one needs to take the job back.
        if a.local_agents == 0 {
            a.state_file = cfg.checkpoint_dir.as_deref().map(SavedJob::path_in);
        }
        if a.max_workers > cfg.batch_size {
            bail!("invalid --max-workers: {} (a batch of {} sequences cannot be split over more workers)", a.max_workers, cfg.batch_size);
        }
    }
    let g = match &hosts {
        Hosts::Agents(a) => a.gpus_per_node,
        Hosts::Local { .. } => 1,
    };
    let mut first_step = trainer.step;
    let plan = match (&mut hosts, resume_job) {
        (Hosts::Agents(a), true) => {
            let (plan, taken) = saved_job_to_take_back(args, &cfg, g)?;
            world = plan.map.ranks();
            first_step = taken.last_logged.unwrap_or(taken.saved.state.last_step);
            a.resume = Some(Box::new(taken));
            plan
        }
        _ => {
            if trainer.done() {
                bail!("nothing to do: the run is at step {} of --steps {}", trainer.step, cfg.steps);
            }
            let source = plan_source(args, cfg.steps - trainer.step)?;
            plan_job(&mut trainer, world, g, &source)?
        }
    };
    let how = format!("{world} workers, {}", if args.static_ep { "static expert parallelism" } else { "lazarus dispatch" });
    print_banner(&trainer, &how, args.model.device.as_deref().unwrap_or("cpu"));
    print_placement(&plan.map, world);
    let recovery = recovery(args)?;
    if let Some(r) = replayed.as_mut() {
        r.slots_per_gpu = plan.placement.as_ref().map_or(1, |p| p.shape().slots_per_gpu);
        r.rebalance_every = recovery.as_ref().map_or(0, |r| r.rebalance_every);
    }
    let figures = RunFigures { loads: vec![vec![0.0; cfg.model.n_experts]; cfg.model.moe_layers()], ..RunFigures::default() };
    let unrecoverable = args.static_ep || plan.placement.as_ref().is_some_and(|p| p.shape().gpus_per_node != g);
    if recovery.is_some() && unrecoverable {
        tracing::info!(
            "recovery: off ({})",
            if args.static_ep {
                "static expert parallelism restarts on failures, as DeepSpeed-MoE does"
            } else {
                "the plan's GPUs per node are not the hosts' (--gpus-per-node)"
            }
        );
    }
    // The log file is opened (and checked) before any worker starts.
    let reporter = Reporter::new(args, &cfg, first_step)?;
    if let Some(c) = args.snapshot_ceiling.filter(|c| !c.is_finite() || *c <= 0.0) {
        bail!("invalid --snapshot-ceiling: {c} (bytes per second, more than 0; --snapshot-bandwidth 0 turns snapshots off)");
    }
    let bandwidth = args.snapshot_bandwidth.or(args.snapshot_ceiling).unwrap_or(DEFAULT_SNAPSHOT_BANDWIDTH);
    if !bandwidth.is_finite() || bandwidth < 0.0 {
        bail!("invalid --snapshot-bandwidth: {bandwidth} (bytes per second, 0 or more; 0: no snapshots)");
    }
    let snapshots = (recovery.is_some() && !unrecoverable && bandwidth > 0.0).then_some(lazarus_runtime::SnapshotSettings {
        gpus_per_node: g,
        bandwidth,
        adaptive: args.snapshot_bandwidth.is_none(),
    });
    if let Some(s) = args.shard_sequences.filter(|&s| s == 0 || cfg.batch_size % s != 0) {
        bail!("invalid --shard-sequences: {s} (a divisor of --batch-size {}: whole shards a step)", cfg.batch_size);
    }
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
    let mut report_error: Option<anyhow::Error> = None;
    if let Hosts::Local { status_listen } = &mut hosts {
        *status_listen = match (recovery.is_some() && !unrecoverable, args.status_listen.as_deref()) {
            (_, Some("off")) => None,
            (false, Some(_)) => bail!("--status-listen needs live recovery (the controller serves the status)"),
            (false, None) => None,
            (true, given) => {
                let addr = given.unwrap_or("127.0.0.1:0");
                Some(
                    addr.parse::<SocketAddr>()
                        .map_err(|_| anyhow::anyhow!("invalid --status-listen: {addr:?} (expected host:port or off)"))?,
                )
            }
        };
    } else if recovery.is_none() || unrecoverable {
        bail!("node agents run jobs with live recovery only: drop --recovery off / --static-ep, or a plan with several GPUs per node");
    }
    let remote = matches!(&hosts, Hosts::Agents(a) if a.local_agents == 0);
    // SIGTERM / Ctrl-C from here on: every worker finishes after the same step, with a checkpoint.
    lazarus_control::stop_signal::install();
    let mut view = JobView { reporter, figures, started: None, remote, agent_command, world, gpus_per_node: g, seq_len: cfg.seq_len };
    let metrics_at = metrics_endpoint(args)?;
    let outcome = run_training(&job, plan.placement.as_ref(), world, comm_timeout, recovery, &hosts, metrics_at.as_ref(), |event| {
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
    let outcome = match outcome {
        // Stopped by a signal before any worker trained (while waiting for agents): said, and
        // the exit status a process killed by it has.
        Err(e) if view.reporter.last_step().is_none() && lazarus_control::stop_signal::requested().is_some() => {
            let (sig, _) = lazarus_control::stop_signal::requested().unwrap_or((libc::SIGTERM, "SIGTERM"));
            view.reporter.pause();
            tracing::warn!("{e}");
            std::process::exit(128 + sig);
        }
        o => o,
    };
    match outcome? {
        TrainOutcome::Completed { checkpoint } => {
            if let Some((sig, name)) = lazarus_control::stop_signal::requested() {
                let step = view.reporter.last_step().unwrap_or(first_step);
                if step < cfg.steps {
                    match &checkpoint {
                        Some(p) => tracing::warn!(
                            "{name}: stopped after step {step}; checkpoint {} written (--resume goes on from it)",
                            p.display()
                        ),
                        None => tracing::warn!("{name}: stopped after step {step}; nothing saved (no --checkpoint-dir)"),
                    }
                    view.reporter.finish(step, trainer.unigram_entropy(), checkpoint.as_deref())?;
                    std::process::exit(128 + sig);
                }
            }
            if let Some(shape) = &replayed {
                view.compare_replay(&cfg, shape, cfg.steps - first_step)?;
            }
            view.reporter.finish(cfg.steps, trainer.unigram_entropy(), checkpoint.as_deref())
        }
        TrainOutcome::Failed { reason, workers } => {
            if workers.is_empty() {
                bail!("training stopped: {reason}")
            }
            bail!("training stopped: {reason}; workers {}", workers.join(", "))
        }
    }
}

/// The running job a lost controller saved in `cfg`'s checkpoint directory, for this one to take
/// back: its plan, and how far its `--json-log` got (a record cut in half by the kill is dropped:
/// the agents send it again).
fn saved_job_to_take_back(args: &TrainArgs, cfg: &lazarus_model::TrainConfig, g: usize) -> Result<(JobPlan, ResumeJob)> {
    let Some(dir) = &cfg.checkpoint_dir else { bail!("--resume-job needs --checkpoint-dir: the lost controller saved the job there") };
    let mut saved = SavedJob::read(&SavedJob::path_in(dir))?;
    if saved.gpus_per_node != g {
        bail!("invalid --gpus-per-node: {g} (the saved job {} has nodes of {})", saved.job_id, saved.gpus_per_node);
    }
    let placement = ModelPlan::from_json(&saved.state.plan).context("--resume-job: the saved plan")?;
    let last_logged = match &args.json_log {
        Some(path) => super::report::last_logged_step(path)?,
        None => None,
    };
    // The state is saved at each move; checkpoints written since are on disk. A rollback, if it
    // comes to one, goes back to the newest of them whose step the log holds: one the log
    // lacks (the controller was lost before the step's record) is heard of again from the
    // agents, with that step — taking it from the disk would count the step as logged, and its
    // record, replayed, would be dropped.
    let on_disk = lazarus_model::checkpoint::latest_step(dir);
    saved.state.checkpoint = checkpoint_to_take_back(saved.state.checkpoint, on_disk, last_logged);
    let recovery = recovery(args)?.unwrap_or_default();
    // Agents try again every 2 s at most: a member not back after several tries (or leases) is lost.
    let rejoin_within = (recovery.lease * 5).max(Duration::from_secs(10));
    tracing::info!(
        "taking back job {} at epoch {} (saved {}): {} workers, last step logged {}; waiting up to {:.0} s for their agents",
        saved.job_id,
        saved.state.epoch - saved.state.first_epoch,
        lazarus_control::when::utc_text(saved.saved_unix_ms),
        saved.state.ranks.len(),
        last_logged.unwrap_or(saved.state.last_step),
        rejoin_within.as_secs_f64()
    );
    Ok((JobPlan { map: placement.replica_map(), placement: Some(placement) }, ResumeJob { saved, last_logged, rejoin_within }))
}

/// The settings of the job saved in `flagged`'s checkpoint directory, to take it back as it
/// ran: a flag (or `--config`) that would change one — `--lr`, `--steps`, the `--workers` it was
/// started with — is refused by name, as is another job's state (its settings differ). A state
/// file of an earlier version, without them, leaves the flags' settings in force.
fn saved_job_settings(args: &TrainArgs, flagged: lazarus_model::TrainConfig) -> Result<lazarus_model::TrainConfig> {
    let Some(dir) = flagged.checkpoint_dir.clone() else {
        bail!("--resume-job needs --checkpoint-dir: the lost controller saved the job there")
    };
    let saved = SavedJob::read(&SavedJob::path_in(&dir))?;
    let how = format!("--resume-job takes job {} back", saved.job_id);
    if let (Some(w), Some(l)) = (args.workers, saved.launched_workers) {
        if w != l {
            bail!(
                "{how} with its own settings; --workers {w} would change the workers it was started with ({l}; it has {} now)",
                saved.state.ranks.len()
            );
        }
    }
    let Some(config) = saved.config else {
        tracing::warn!("--resume-job: job {} was saved without its settings (an earlier version): the flags' are used", saved.job_id);
        return Ok(flagged);
    };
    super::args::check_unchanged(args, &config, &how, "the job")?;
    if let Some(steps) = super::args::resume_steps(args)?.filter(|&s| s != config.steps) {
        bail!("{how} with its own settings; --steps {steps} would change steps (the job has {})", config.steps);
    }
    Ok(lazarus_model::TrainConfig { checkpoint_dir: Some(dir), ..config })
}

/// The checkpoint a job taken back rolls back to, if it comes to that: the saved one, or a newer
/// one on disk whose step the log holds (one it does not hold is heard of again from the agents).
fn checkpoint_to_take_back(saved: Option<u64>, on_disk: Option<u64>, last_logged: Option<u64>) -> Option<u64> {
    let newer = on_disk.filter(|&s| last_logged.is_some_and(|l| s <= l) && saved.is_none_or(|c| s > c));
    newer.or(saved)
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ControllerArgs,
    }

    fn parse(argv: &[&str]) -> ControllerArgs {
        Cli::try_parse_from(std::iter::once("controller").chain(argv.iter().copied())).unwrap().args
    }

    /// Every flag of `lazarus controller` has its name in the file: the model's at the top (the
    /// training settings), the run's and the workers' and the controller's own in `[controller]`.
    #[test]
    fn every_controller_flag_has_a_place_in_the_config_file() {
        use clap::CommandFactory;
        #[derive(Parser)]
        struct Model {
            #[command(flatten)]
            args: crate::train::args::ModelArgs,
        }
        let longs = |c: clap::Command| c.get_arguments().filter_map(|a| a.get_long().map(String::from)).collect::<Vec<_>>();
        let model = longs(Model::command());
        // Refused by the controller (its local agents' replays, its status at --listen; the
        // evaluation during training, single-process so far), the file itself, and the
        // training settings at the file's top.
        let elsewhere = [
            "replay",
            "replay-scale",
            "replay-notice",
            "status-listen",
            "eval-data",
            "eval-data-format",
            "eval-every",
            "eval-windows",
            "config",
            "steps",
            "checkpoint-dir",
            "checkpoint-every",
            "keep-checkpoints",
            "init-from",
        ];
        let mut checked = 0;
        for flag in longs(Cli::command()) {
            if model.contains(&flag) || elsewhere.contains(&flag.as_str()) {
                continue;
            }
            let key = flag.replace('-', "_");
            let e = toml::from_str::<ControllerTable>(&format!("{key} = 0")).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(!e.contains("unknown field"), "--{flag} has no `{key}` in [controller]: {e}");
            checked += 1;
        }
        assert!(checked >= 25, "{checked} flags");
        // Settings that exclude each other are refused from the file as from the flags.
        let d = std::env::temp_dir().join(format!("lazarus-config-both-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let path = d.join("c.toml");
        std::fs::write(&path, "[controller]\nresume = true\nresume_if_any = true\n").unwrap();
        let e = format!("{:#}", with_config_table(&parse(&["--config", path.to_str().unwrap()])).unwrap_err());
        assert!(e.contains("resume and resume_if_any together"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    fn deploy_file() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/lazarus.toml")
    }

    #[test]
    fn the_deployment_example_configures_the_controller_and_its_job_and_flags_override_it() {
        let path = deploy_file();
        let a = with_config_table(&parse(&["--config", path.to_str().unwrap(), "--max-workers", "32"])).unwrap();
        assert_eq!(a.listen.as_deref(), Some("0.0.0.0:7070"));
        assert_eq!((a.train.workers, a.train.gpus_per_node, a.max_workers), (Some(16), Some(4), Some(32)), "the flag wins");
        assert_eq!((a.join_wait, a.wait_agents, a.train.lease, a.train.heartbeat), (Some(120.0), Some(600.0), Some(1.0), Some(0.2)));
        assert_eq!(a.secret_file.as_deref(), Some(std::path::Path::new("/etc/lazarus/job.secret")));
        // The training settings of the same file.
        let cfg = crate::train::args::build_config(&a.train).unwrap();
        assert_eq!((cfg.steps, cfg.model.n_experts, cfg.checkpoint_every), (2000, 16, 100));
    }

    #[test]
    fn a_controller_table_with_an_unknown_setting_is_refused_naming_it() {
        let d = std::env::temp_dir().join(format!("lazarus-controller-table-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let path = d.join("c.toml");
        std::fs::write(&path, "[controller]\nlisten = \"127.0.0.1:0\"\nmax_worker = 3\n").unwrap();
        let e = format!("{:#}", with_config_table(&parse(&["--config", path.to_str().unwrap()])).unwrap_err());
        assert!(e.contains("[controller]") && e.contains("max_worker"), "{e}");
        // `lazarus train` has no use for the table: refused, not ignored.
        let mut train = TrainArgs::default();
        train.model.config = Some(path.clone());
        let e = format!("{:#}", crate::train::args::build_config(&train).unwrap_err());
        assert!(e.contains("[controller] table") && e.contains("does not use"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}

#[cfg(test)]
mod take_back_tests {
    use super::checkpoint_to_take_back as pick;

    #[test]
    fn a_checkpoint_on_disk_is_taken_only_if_the_log_holds_its_step() {
        // Written after the state was saved, its step logged: taken.
        assert_eq!(pick(Some(10), Some(20), Some(24)), Some(20));
        assert_eq!(pick(None, Some(20), Some(20)), Some(20));
        // Its step not logged (the controller was lost first): the saved one stands.
        assert_eq!(pick(Some(10), Some(50), Some(49)), Some(10));
        assert_eq!(pick(None, Some(50), None), None);
        // Older than the saved one, or none on disk: the saved one.
        assert_eq!(pick(Some(30), Some(20), Some(40)), Some(30));
        assert_eq!(pick(Some(30), None, Some(40)), Some(30));
    }
}
