//! `lazarus agent`: one per node, for a job whose controller runs elsewhere
//! (`lazarus controller --listen ADDR`). See [`lazarus_agent::agent`].

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use lazarus_agent::agent::{run_agent, AgentEnd, AgentOptions};
use lazarus_protocol::tls::ClientTls;

/// The command line of an agent that `train --workers N --gpus-per-node G` starts on this host
/// for its controller at `controller`: `gpus` GPUs, and no grace for a lost controller (it goes
/// with the process that runs the controller).
pub fn local_agent_command_line(controller: std::net::SocketAddr, gpus: usize) -> Vec<String> {
    ["agent", "--controller", &controller.to_string(), "--gpus", &gpus.to_string(), "--controller-grace", "0"].map(String::from).to_vec()
}

#[derive(Args, Debug, Clone)]
pub struct AgentArgs {
    /// TOML file whose `[agent]` table holds any of the settings below, named as the flags are
    /// (`connect_timeout` for `--connect-timeout`); flags override it. The rest of the file is
    /// not the agent's (a deployment's one file may hold the job's and the controller's).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The controller's address (host:port, as `lazarus controller --listen` printed it).
    #[arg(long, value_name = "ADDR")]
    controller: Option<String>,
    /// Worker slots of this node (one worker process per GPU).
    #[arg(long, value_name = "G")]
    gpus: Option<usize>,
    /// The address this node's workers listen on for their peers (default: the one this host
    /// reaches the controller from).
    #[arg(long, value_name = "IP")]
    host: Option<IpAddr>,
    /// The job's secret (the controller's --secret-file); default: LAZARUS_SECRET.
    #[arg(long, value_name = "FILE")]
    secret_file: Option<PathBuf>,
    /// Seconds to keep trying to reach the controller (default 30).
    #[arg(long, value_name = "SECONDS")]
    connect_timeout: Option<f64>,
    /// Seconds this node's workers wait, paused with their state, for a controller to take the
    /// job back once theirs is lost (`lazarus controller --resume-job`); 0: stop them at once
    /// (default 60).
    #[arg(long, value_name = "SECONDS")]
    controller_grace: Option<f64>,
    #[command(flatten)]
    tls: crate::tls::TlsArgs,
}

pub fn run_agent_cli(args: &AgentArgs) -> Result<()> {
    let Some(controller) = &args.controller else {
        bail!("lazarus agent needs --controller ADDR (or controller in the [agent] table of --config)")
    };
    let Some(gpus) = args.gpus else { bail!("lazarus agent needs --gpus G (or gpus in the [agent] table of --config)") };
    let secret = match (&args.secret_file, std::env::var("LAZARUS_SECRET")) {
        (Some(path), _) => crate::io::secret_from_file(path, false)?,
        (None, Ok(hex)) => lazarus_protocol::parse_secret(hex.trim())
            .ok_or_else(|| anyhow::anyhow!("invalid LAZARUS_SECRET: expected 32 hex digits drawn at random (at least 6 different ones)"))?,
        (None, Err(_)) => bail!("the job's secret is needed: --secret-file FILE or LAZARUS_SECRET (the controller printed how)"),
    };
    let connect = args.connect_timeout.unwrap_or(30.0);
    if !connect.is_finite() || connect <= 0.0 || connect > 86_400.0 {
        bail!("invalid --connect-timeout: {connect} (expected seconds, more than 0 and at most 86400)");
    }
    let grace = args.controller_grace.unwrap_or(lazarus_agent::agent::DEFAULT_CONTROLLER_GRACE.as_secs_f64());
    if !grace.is_finite() || !(0.0..=86_400.0).contains(&grace) {
        bail!("invalid --controller-grace: {grace} (expected seconds from 0 to 86400)");
    }
    let tls = ClientTls::new(Some(lazarus_protocol::tls::pin(secret)), args.tls.files()?)?;
    let opts = AgentOptions {
        controller: controller.clone(),
        gpus,
        host: args.host,
        secret,
        tls,
        connect_within: Duration::from_secs_f64(connect),
        controller_grace: Duration::from_secs_f64(grace),
    };
    let end = run_agent(&opts, |ranks| {
        let ranks: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
        tracing::info!("agent: started workers (ranks {})", ranks.join(", "));
        Ok(())
    })
    .context("agent")?;
    match end {
        AgentEnd::Completed { how } => {
            tracing::info!("agent: {how}");
            Ok(())
        }
        AgentEnd::Drained => {
            tracing::info!("agent: drained — the job moved off this node, its workers handed over their state and left");
            Ok(())
        }
        AgentEnd::Stopped(why) => bail!("agent stopped: {why}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: AgentArgs,
    }

    #[test]
    fn the_deployment_example_configures_an_agent_and_flags_override_it() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/lazarus.toml");
        use clap::{CommandFactory, FromArgMatches};
        let cmd = Cli::command().args_override_self(true);
        let args: Vec<std::ffi::OsString> = ["--config", path.to_str().unwrap(), "--gpus", "8"].iter().map(Into::into).collect();
        let flags = crate::config_flags::table_flags(&cmd, "agent", &args).unwrap();
        let matches = cmd.try_get_matches_from(std::iter::once("agent".into()).chain(flags).chain(args)).unwrap();
        let a = Cli::from_arg_matches(&matches).unwrap().args;
        assert_eq!((a.controller.as_deref(), a.gpus, a.connect_timeout), (Some("10.0.0.1:7070"), Some(8), Some(30.0)));
        assert_eq!(a.secret_file.as_deref(), Some(std::path::Path::new("/etc/lazarus/job.secret")));
    }
}
