//! `lazarus status --controller ADDR [--json]`: what the controller of a running job knows.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::Args;
use lazarus_controller::decisions::words::id_list;
use lazarus_controller::service::query;
use lazarus_protocol::status_plan::plan_from_proto;
use lazarus_protocol::tls::{ClientTls, Pin};

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
    use lazarus_controller::service::{parse_status_token, status_key};
    use lazarus_protocol::parse_secret;
    let from_secret = |secret: u128| (status_key(secret), Some(lazarus_protocol::tls::pin(secret)));
    if let Some(path) = &args.secret_file {
        return Ok(from_secret(crate::io::secret_from_file(path, false)?));
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
    // The controller's plan, checked as a plan file is; one that is not is left out, said.
    let plan = s.plan.as_ref().and_then(|p| {
        plan_from_proto(p).map_err(|e| eprintln!("warning: the controller's status holds a plan that is not one ({e}): left out")).ok()
    });
    if args.json {
        let members: Vec<serde_json::Value> = s
            .members
            .iter()
            .map(|m| serde_json::json!({"node": m.node, "alive": m.alive, "state": m.state, "rank": m.rank, "silent_s": m.silent_s, "epoch": m.epoch}))
            .collect();
        let plan = match &plan {
            Some(p) => serde_json::to_value(p.to_file())?,
            None => serde_json::Value::Null,
        };
        let v = serde_json::json!({
            "job_id": s.job_id, "epoch": s.epoch, "phase": s.phase, "step": s.step, "members": members,
            "plan": plan, "recent": s.recent, "last_checkpoint": s.last_checkpoint, "lease_s": s.lease_s,
            "reconfigurations": s.reconfigurations,
        });
        return crate::io::println(&v.to_string());
    }
    let mut out = String::new();
    let moves = if s.reconfigurations == 1 { "1 move".to_string() } else { format!("{} moves", s.reconfigurations) };
    let _ = writeln!(out, "job        {} (epoch {}: {moves} since it started)", s.job_id, s.epoch);
    let _ = writeln!(out, "phase      {} at step {}", s.phase, s.step);
    let _ = writeln!(
        out,
        "checkpoint {}",
        s.last_checkpoint
            .map_or("none written yet (a failure that needs one would go back to the start)".to_string(), |c| format!("step {c}"))
    );
    let _ = writeln!(out, "workers    {} (lease {} s)", member_counts(&s.members), s.lease_s);
    for m in &s.members {
        let rank = m.rank.map_or("-".to_string(), |r| r.to_string());
        let _ = writeln!(out, "  worker {:>3}  rank {:>3}  epoch {:>3}  {}", m.node, rank, m.epoch, member_state(m));
    }
    if let Some(plan) = plan {
        let _ = writeln!(out, "plan       the experts each rank holds, layer by layer");
        for (l, layer) in plan.layers().iter().enumerate() {
            let ranks: Vec<String> = layer
                .nodes()
                .iter()
                .enumerate()
                .map(|(r, experts)| format!("rank {r}: {}", id_list(experts.iter().map(|&e| e as u64))))
                .collect();
            let _ = writeln!(out, "  L{l:<3}  {}", ranks.join("  ·  "));
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

/// What a member is doing, as its line says it.
fn member_state(m: &lazarus_protocol::proto::Member) -> String {
    match m.state.as_str() {
        "starting" => "starting: not heard from yet".to_string(),
        "drained" => "left after its node's notice".to_string(),
        "lost" => "lost".to_string(),
        "standby" => format!("standing by to join, heard {:.2} s ago", m.silent_s),
        "leaving" => format!("leaving on notice, heard {:.2} s ago", m.silent_s),
        _ if !m.alive => "lost".to_string(),
        _ => format!("training, heard {:.2} s ago", m.silent_s),
    }
}

/// The members by what they do: `4 training, 2 standing by to join, 1 lost` — a worker
/// standing by is not counted among the lost.
fn member_counts(members: &[lazarus_protocol::proto::Member]) -> String {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for m in members {
        let what = match m.state.as_str() {
            "starting" => "starting",
            "drained" => "left on notice",
            "standby" => "standing by to join",
            "leaving" => "leaving on notice",
            "lost" => "lost",
            _ if !m.alive => "lost",
            _ => "training",
        };
        match counts.iter_mut().find(|(w, _)| *w == what) {
            Some((_, n)) => *n += 1,
            None => counts.push((what, 1)),
        }
    }
    let order = ["training", "starting", "standing by to join", "leaving on notice", "left on notice", "lost"];
    counts.sort_by_key(|(w, _)| order.iter().position(|o| o == w));
    if counts.is_empty() {
        return "none".into();
    }
    counts.iter().map(|(w, n)| format!("{n} {w}")).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(node: u64, state: &str, alive: bool) -> lazarus_protocol::proto::Member {
        lazarus_protocol::proto::Member { node, alive, rank: None, silent_s: 0.5, epoch: 0, state: state.into() }
    }

    /// Standbys and leavers are counted as what they are, not as dead; a member not alive
    /// whatever its state says is lost.
    #[test]
    fn members_are_counted_by_what_they_do() {
        let ms = [
            member(0, "member", true),
            member(1, "member", true),
            member(4, "standby", false),
            member(5, "standby", false),
            member(2, "member", false),
            member(3, "lost", false),
        ];
        assert_eq!(member_counts(&ms), "2 training, 2 standing by to join, 2 lost");
        assert_eq!(member_state(&ms[2]), "standing by to join, heard 0.50 s ago");
        assert_eq!(member_state(&ms[4]), "lost");
        assert_eq!(member_counts(&[]), "none");
    }
}
