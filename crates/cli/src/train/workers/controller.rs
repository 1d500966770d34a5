//! `lazarus controller`: its flags (and the `[controller]` table of `--config`), the job's
//! secret file, and the controller of a job whose workers node agents of other hosts run.

use anyhow::{bail, Context, Result};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use lazarus_controller::control_loop::saved_job::SavedJob;
use lazarus_controller::{AgentsSpec, Hosts, Reach, Workers};
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
    /// When a node that joins is taken in: `wait`, after --join-wait; `repaid`, where moves come
    /// often enough that waiting for one costs less than a move of its own (the measured pause
    /// and rendezvous), with the next move the job makes anyway (a failure's, a drain's, a
    /// rebalance that repays itself) — at most until its idling has cost that much, 30 minutes.
    #[arg(long, value_enum, default_value_t = crate::join_rule::JoinChoice::Wait)]
    pub join_rule: crate::join_rule::JoinChoice,
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

/// `args` (the `[controller]` table of `--config` already among them: `config_flags`), with the
/// training settings told that the file's `[controller]` table is this command's.
fn with_config_table(args: &ControllerArgs) -> Result<ControllerArgs> {
    let mut a = args.clone();
    a.train.model.config_tables = &["controller"];
    Ok(a)
}

/// Most seconds `lazarus controller --wait-agents` may wait.
const MAX_WAIT_AGENTS_S: f64 = 86_400.0;

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
        Some(path) => (
            crate::io::secret_from_file(path, true)?,
            format!("lazarus agent --controller {{addr}} --gpus G --secret-file {}", path.display()),
        ),
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
    let workers = Workers::new(args.train.workers.unwrap_or(1), args.train.gpus_per_node.unwrap_or(1), Reach::Agents)?;
    let wait = Duration::from_secs_f64(wait);
    let max_workers = workers.most_workers(args.max_workers)?;
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
        agent_command_line: crate::agent::local_agent_command_line,
        gpus_per_node: workers.gpus_per_node(),
        wait,
        max_workers,
        join_wait,
        join_rule: args.join_rule.rule(),
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
    run_job(&train, hosts, workers, Some(agent_command), None, resume_job, None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use lazarus_controller::decisions::JoinRule;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ControllerArgs,
    }

    /// The arguments of `lazarus controller ARGV` as main parses them: the `[controller]` table
    /// of `--config` first, the command line's own over it.
    fn try_parse(argv: &[&str]) -> Result<ControllerArgs, String> {
        use clap::{CommandFactory, FromArgMatches};
        let cmd = Cli::command().args_override_self(true);
        let args: Vec<std::ffi::OsString> = argv.iter().map(std::ffi::OsString::from).collect();
        let flags = crate::config_flags::table_flags(&cmd, "controller", &args).map_err(|e| format!("{e:#}"))?;
        let all = std::iter::once("controller".into()).chain(flags).chain(args);
        let matches = cmd.try_get_matches_from(all).map_err(|e| e.to_string())?;
        Ok(Cli::from_arg_matches(&matches).map_err(|e| e.to_string())?.args)
    }

    fn parse(argv: &[&str]) -> ControllerArgs {
        try_parse(argv).unwrap()
    }

    /// A file of `text` in a fresh directory, and the directory.
    fn config_file(name: &str, text: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        let d = std::env::temp_dir().join(format!("lazarus-config-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let path = d.join("c.toml");
        std::fs::write(&path, text).unwrap();
        (path, d)
    }

    /// Switches, options and settings that exclude each other, from the file as from flags.
    #[test]
    fn a_controller_table_is_the_controllers_flags() {
        let (path, d) = config_file(
            "flags",
            "[controller]\nlisten = \"127.0.0.1:0\"\nworkers = 4\nlease = 2.5\nencrypt_data = true\ndeterministic = false\nrecovery = false\nsnapshot_bandwidth = 1e6\n",
        );
        let p = path.to_str().unwrap();
        let a = parse(&["--config", p]);
        assert_eq!((a.listen.as_deref(), a.train.workers, a.train.lease), (Some("127.0.0.1:0"), Some(4), Some(2.5)));
        assert!(a.train.encrypt_data && !a.train.deterministic && a.train.recovery == Some(false));
        assert_eq!(a.train.snapshot_bandwidth, Some(1e6));
        // A switch the file leaves off stays as the command line says; a flag given wins.
        let a = parse(&["--config", p, "--deterministic", "--workers", "8", "--snapshot-ceiling", "5e5"]);
        assert!(a.train.deterministic);
        assert_eq!(a.train.workers, Some(8));
        // The paced default's ceiling and a fixed budget are one setting: the flag replaces the file's.
        assert_eq!((a.train.snapshot_bandwidth, a.train.snapshot_ceiling), (None, Some(5e5)));
        // Settings that exclude each other are refused from the file as from the flags.
        let (both, _) = config_file("both", "[controller]\nresume = true\nresume_if_any = true\n");
        let e = try_parse(&["--config", both.to_str().unwrap()]).unwrap_err();
        assert!(e.contains("--resume") && e.contains("cannot be used with"), "{e}");
        // A switch given a word, an option given a table: refused naming the key.
        let (bad, _) = config_file("bad", "[controller]\nencrypt_data = \"yes\"\n");
        let e = try_parse(&["--config", bad.to_str().unwrap()]).unwrap_err();
        assert!(e.contains("[controller] encrypt_data") && e.contains("true or false"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
        let _ = std::fs::remove_dir_all(both.parent().unwrap());
        let _ = std::fs::remove_dir_all(bad.parent().unwrap());
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
        assert_eq!(a.join_rule.rule(), JoinRule::AfterWait, "the paper's rule unless asked");
        assert_eq!(a.secret_file.as_deref(), Some(std::path::Path::new("/etc/lazarus/job.secret")));
        // The training settings of the same file.
        let cfg = crate::train::args::build_config(&a.train).unwrap();
        assert_eq!((cfg.steps, cfg.model.n_experts, cfg.checkpoint_every), (2000, 16, 100));
    }

    #[test]
    fn joiners_ride_along_moves_when_asked() {
        let a = parse(&["--join-rule", "repaid"]);
        assert_eq!(a.join_rule.rule(), JoinRule::WhenRepaid { at_most: lazarus_controller::decisions::REPAID_JOIN_AT_MOST });
        let (path, d) = config_file("join-rule", "[controller]\njoin_rule = \"repaid\"\n");
        let a = with_config_table(&parse(&["--config", path.to_str().unwrap()])).unwrap();
        assert_eq!(a.join_rule, crate::join_rule::JoinChoice::Repaid);
        let _ = std::fs::remove_dir_all(&d);
        let e = try_parse(&["--join-rule", "later"]).unwrap_err();
        assert!(e.contains("--join-rule") && e.contains("later") && e.contains("repaid"), "{e}");
    }

    #[test]
    fn a_controller_table_with_an_unknown_setting_is_refused_naming_it() {
        let d = std::env::temp_dir().join(format!("lazarus-controller-table-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let path = d.join("c.toml");
        std::fs::write(&path, "[controller]\nlisten = \"127.0.0.1:0\"\nmax_worker = 3\n").unwrap();
        let e = try_parse(&["--config", path.to_str().unwrap()]).unwrap_err();
        assert!(e.contains("[controller] has no setting `max_worker`"), "{e}");
        // `lazarus train` has no use for the table: refused, not ignored.
        let mut train = TrainArgs::default();
        train.model.config = Some(path.clone());
        let e = format!("{:#}", crate::train::args::build_config(&train).unwrap_err());
        assert!(e.contains("[controller] table") && e.contains("does not use"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
