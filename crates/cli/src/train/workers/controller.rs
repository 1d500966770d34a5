//! `lazarus controller`: its flags (and the `[controller]` table of `--config`), the job's
//! secret file, and the controller of a job whose workers node agents of other hosts run.

use anyhow::{bail, Context, Result};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use lazarus_controller::control_loop::saved_job::SavedJob;
use lazarus_controller::{AgentsSpec, Hosts};
use lazarus_protocol::tls::ServerTls;

use super::super::args::TrainArgs;
use super::run_job;

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

/// The job's secret from `path` (32 hex digits), or a fresh one written there (mode 0600).
pub fn secret_from_file(path: &Path, create: bool) -> Result<u128> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {
            let secret = lazarus_protocol::fresh_secret().context("drawing the job secret")?;
            let mut options = std::fs::OpenOptions::new();
            options.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
            let mut f = options.open(path).with_context(|| format!("creating --secret-file {}", path.display()))?;
            use std::io::Write;
            writeln!(f, "{}", lazarus_protocol::secret_hex(secret)).with_context(|| format!("writing {}", path.display()))?;
            Ok(secret)
        }
        _ => {
            // A regular file of a line (a FIFO or /dev/zero is refused, not read without end).
            let text = crate::io::read_text("secret-file", path, 4096)?;
            lazarus_protocol::parse_secret(text.trim()).ok_or_else(|| {
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
            let s = lazarus_protocol::fresh_secret().context("drawing the job secret")?;
            (s, format!("LAZARUS_SECRET={} lazarus agent --controller {{addr}} --gpus G", lazarus_protocol::secret_hex(s)))
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
    let most = lazarus_protocol::MAX_WORKERS;
    if max_workers < world || max_workers > most || !max_workers.is_multiple_of(g) {
        bail!("invalid --max-workers: {max_workers} (expected from --workers {world} to {most}, a multiple of --gpus-per-node {g})");
    }
    let join_wait = args.join_wait.unwrap_or(lazarus_controller::control_loop::DEFAULT_JOIN_WAIT.as_secs_f64());
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
    let saved_job = super::super::args::build_config(&train).ok().and_then(|c| c.checkpoint_dir).map(|d| SavedJob::path_in(&d));
    let held = saved_job.filter(|p| p.exists());
    let resume_job = args.resume_job || (train.resume_if_any && held.is_some());
    if resume_job && !args.resume_job {
        tracing::info!("--resume-if-any: the checkpoint directory holds a running job's state: taking it back (--resume-job)");
    }
    if let Some(path) = held.filter(|_| !resume_job && !train.resume && !train.overwrite_checkpoints) {
        // A new job here would write its state over the lost one's: the job could not be taken back.
        let whose = match SavedJob::read(&path) {
            Ok(s) => format!("job {} (saved {})", s.job_id, lazarus_protocol::when::utc_text(s.saved_unix_ms)),
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
