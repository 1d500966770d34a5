//! `lazarus agent`: one per node, for a job whose controller runs elsewhere
//! (`lazarus controller --listen ADDR`). See [`lazarus_control::agent`].

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use lazarus_control::agent::{run_agent, AgentEnd, AgentOptions};

#[derive(Args, Debug)]
pub struct AgentArgs {
    /// The controller's address (host:port, as `lazarus controller --listen` printed it).
    #[arg(long, value_name = "ADDR")]
    controller: String,
    /// Worker slots of this node (one worker process per GPU).
    #[arg(long, value_name = "G")]
    gpus: usize,
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
}

pub fn run_agent_cli(args: &AgentArgs) -> Result<()> {
    let secret = match (&args.secret_file, std::env::var("LAZARUS_SECRET")) {
        (Some(path), _) => crate::train::workers::secret_from_file(path, false)?,
        (None, Ok(hex)) => lazarus_control::protocol::parse_secret(hex.trim())
            .ok_or_else(|| anyhow::anyhow!("invalid LAZARUS_SECRET: expected 32 hex digits drawn at random (at least 6 different ones)"))?,
        (None, Err(_)) => bail!("the job's secret is needed: --secret-file FILE or LAZARUS_SECRET (the controller printed how)"),
    };
    let connect = args.connect_timeout.unwrap_or(30.0);
    if !connect.is_finite() || connect <= 0.0 || connect > 86_400.0 {
        bail!("invalid --connect-timeout: {connect} (expected seconds, more than 0 and at most 86400)");
    }
    let opts = AgentOptions {
        controller: args.controller.clone(),
        gpus: args.gpus,
        host: args.host,
        secret,
        connect_within: Duration::from_secs_f64(connect),
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
