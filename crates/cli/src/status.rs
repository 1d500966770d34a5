//! `lazarus status --controller ADDR [--json]`: what the controller of a running job knows.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::Args;
use lazarus_control::service::query;
use lazarus_control::tls::{ClientTls, Pin};
use lazarus_plan::ModelPlan;

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// The controller's status address (printed by `lazarus train --workers N`).
    #[arg(long, value_name = "HOST:PORT")]
    controller: String,
    /// The job's secret (the controller's --secret-file): the status key is derived from it.
    /// Default: LAZARUS_STATUS_TOKEN (as the controller printed it), else LAZARUS_SECRET.
    #[arg(long, value_name = "FILE")]
    secret_file: Option<std::path::PathBuf>,
    /// Seconds to wait for an answer.
    #[arg(long, default_value_t = 5.0)]
    timeout: f64,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    tls: crate::tls::TlsArgs,
}

/// The key the status request proves and the controller's TLS key to pin (None: its
/// certificate is the operator's): from the secret file, the printed token, or the secret in
/// the environment.
fn status_key(args: &StatusArgs) -> Result<(u128, Option<Pin>)> {
    use lazarus_control::protocol::parse_secret;
    use lazarus_control::service::{parse_status_token, status_key};
    let from_secret = |secret: u128| (status_key(secret), Some(lazarus_control::tls::pin(secret)));
    if let Some(path) = &args.secret_file {
        return Ok(from_secret(crate::train::workers::secret_from_file(path, false)?));
    }
    if let Ok(token) = std::env::var("LAZARUS_STATUS_TOKEN") {
        return parse_status_token(token.trim()).ok_or_else(|| {
            anyhow::anyhow!("invalid LAZARUS_STATUS_TOKEN: expected it as the controller printed it (32 hex digits, a dot, 64 hex digits)")
        });
    }
    if let Ok(hex) = std::env::var("LAZARUS_SECRET") {
        let secret =
            parse_secret(hex.trim()).ok_or_else(|| anyhow::anyhow!("invalid LAZARUS_SECRET: expected 32 hex digits drawn at random"))?;
        return Ok(from_secret(secret));
    }
    bail!("the status is the job's: give --secret-file FILE (the controller's), or LAZARUS_STATUS_TOKEN as the controller printed it")
}

pub fn run_status(args: &StatusArgs) -> Result<()> {
    if !args.timeout.is_finite() || !(0.01..=600.0).contains(&args.timeout) {
        bail!("invalid --timeout: {} (expected seconds between 0.01 and 600)", args.timeout);
    }
    let (key, pin) = status_key(args)?;
    let tls = ClientTls::new(pin, args.tls.files()?)?;
    let s = query(&args.controller, Duration::from_secs_f64(args.timeout), key, &tls)?;
    if args.json {
        let members: Vec<serde_json::Value> = s
            .members
            .iter()
            .map(|m| serde_json::json!({"node": m.node, "alive": m.alive, "state": m.state, "rank": m.rank, "silent_s": m.silent_s, "epoch": m.epoch}))
            .collect();
        let plan: serde_json::Value = serde_json::from_str(&s.plan_json).unwrap_or(serde_json::Value::Null);
        let v = serde_json::json!({
            "job_id": s.job_id, "epoch": s.epoch, "phase": s.phase, "step": s.step, "members": members,
            "plan": plan, "recent": s.recent, "last_checkpoint": s.last_checkpoint, "lease_s": s.lease_s,
            "reconfigurations": s.reconfigurations,
        });
        return crate::io::println(&v.to_string());
    }
    let mut out = String::new();
    let _ = writeln!(out, "job        {} (epoch {}, {} reconfiguration(s))", s.job_id, s.epoch, s.reconfigurations);
    let _ = writeln!(out, "phase      {} at step {}", s.phase, s.step);
    let _ = writeln!(out, "checkpoint {}", s.last_checkpoint.map_or("none yet".to_string(), |c| format!("step {c}")));
    let alive = s.members.iter().filter(|m| m.alive).count();
    let starting = s.members.iter().filter(|m| m.state == "starting").count();
    let starting = if starting > 0 { format!(", {starting} starting") } else { String::new() };
    let _ = writeln!(out, "members    {alive} alive of {}{starting} (lease {} s)", s.members.len(), s.lease_s);
    for m in &s.members {
        let rank = m.rank.map_or("-".to_string(), |r| r.to_string());
        let state = match m.state.as_str() {
            "starting" => "starting: not heard from yet".to_string(),
            "drained" => "drained: left after its node's notice".to_string(),
            "lost" | "" if !m.alive => "lost".to_string(),
            "standby" => format!("standing by to join, heard {:.2} s ago", m.silent_s),
            "leaving" => format!("leaving on notice, heard {:.2} s ago", m.silent_s),
            _ => format!("alive, heard {:.2} s ago", m.silent_s),
        };
        let _ = writeln!(out, "  worker {:>3}  rank {:>3}  epoch {:>3}  {state}", m.node, rank, m.epoch);
    }
    if let Ok(plan) = ModelPlan::from_json(&s.plan_json) {
        for (l, layer) in plan.layers().iter().enumerate() {
            let nodes: Vec<String> = layer.nodes().iter().enumerate().map(|(n, e)| format!("r{n}{e:?}")).collect();
            let _ = writeln!(out, "plan L{l:<3}  {}", nodes.join(" "));
        }
    }
    if !s.recent.is_empty() {
        let _ = writeln!(out, "recent");
        for e in &s.recent {
            let _ = writeln!(out, "  {e}");
        }
    }
    crate::io::print(&out)
}
