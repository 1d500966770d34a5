//! `lazarus bench recovery`: kill a worker of a live job at random steps and phases, and
//! report how long each recovery took (kill → next completed step) with its breakdown.

use std::fmt::Write as _;

use anyhow::{bail, Result};
use clap::Args;
use lazarus_bench::recovery::{run_recovery_bench, RecoveryBenchReport, RecoveryBenchSpec, TARGET_S};
use lazarus_controller::Recovery;

use super::args::{build_config, check_fits, ModelArgs, TrainArgs, DEFAULT_COMM_TIMEOUT_S};

#[derive(Args, Debug)]
pub struct RecoveryBenchArgs {
    /// The model, as for `lazarus train` (default: the default model).
    #[command(flatten)]
    model: ModelArgs,
    /// Worker processes of each run.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Steps of each run (default 12).
    #[arg(long)]
    steps: Option<u64>,
    /// A worker not heard from for this many seconds is lost (default 1).
    #[arg(long, value_name = "SECONDS")]
    lease: Option<f64>,
    /// Seconds between a worker's heartbeats (default 0.2).
    #[arg(long, value_name = "SECONDS")]
    heartbeat: Option<f64>,
    /// Deadline of every collective, in seconds (default 30).
    #[arg(long, value_name = "SECONDS")]
    comm_timeout: Option<f64>,
    /// Only the summary, not each run's progress.
    #[arg(long)]
    quiet: bool,
    /// Workers killed, one per run.
    #[arg(long, default_value_t = 5)]
    kills: usize,
    /// Seed of the kills' steps, phases and victims.
    #[arg(long, default_value_t = 0)]
    kill_seed: u64,
    #[arg(long)]
    json: bool,
}

/// Steps of each run when `--steps` is not given.
const DEFAULT_STEPS: u64 = 12;

pub fn run_recovery_bench_cli(args: &RecoveryBenchArgs) -> Result<()> {
    let mut config = build_config(&TrainArgs::of_model(args.model.clone(), args.steps))?;
    if config.checkpoint_dir.is_some() {
        bail!("--checkpoint-dir does not apply to bench recovery (its runs write no checkpoints)");
    }
    if args.steps.is_none() {
        config.steps = DEFAULT_STEPS;
    }
    let workers = args.workers;
    check_fits(&config, 1 + workers as u128)?;
    let spec = RecoveryBenchSpec {
        workers,
        kills: args.kills,
        steps: config.steps,
        seed: args.kill_seed,
        // Every move in the benchmark is a recovery from a kill: no rebalance.
        recovery: Recovery { rebalance_every: 0, ..Recovery::from_flags(args.lease, args.heartbeat)? },
        comm_timeout_s: lazarus_agent::launcher::check_comm_timeout(args.comm_timeout.unwrap_or(DEFAULT_COMM_TIMEOUT_S))?,
        device: args.model.device.clone().unwrap_or_else(|| "cpu".into()),
    };
    tracing::info!(
        "bench recovery: {} workers, {} kills (one per run of {} steps), lease {} s, heartbeat {} s",
        spec.workers,
        spec.kills,
        spec.steps,
        spec.recovery.lease.as_secs_f64(),
        spec.recovery.heartbeat.as_secs_f64()
    );
    let quiet = args.quiet;
    let report = run_recovery_bench(&config, &spec, |line| {
        if !quiet {
            tracing::info!("{line}");
        }
    })?;
    if args.json {
        crate::io::println(&serde_json::to_string(&report)?)?;
    } else {
        crate::io::print(&summary(&report))?;
    }
    if report.recovered < report.kills.len() {
        bail!("{} of {} runs did not recover", report.kills.len() - report.recovered, report.kills.len());
    }
    Ok(())
}

fn summary(r: &RecoveryBenchReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n{:>3}  {:>6}  {:>10}  {:>4}  {:>9}  {:>8}  {:>8}  {:>9}  {:>10}  {:>8}",
        "run", "worker", "phase", "step", "recovery", "detect", "plan", "rebuild", "transfer", "MB"
    );
    for k in &r.kills {
        let phase = format!("{:?}", k.kill.phase);
        match &k.record {
            Some(x) => {
                let _ = writeln!(
                    out,
                    "{:>3}  {:>6}  {:>10}  {:>4}  {:>8.3}s  {:>7.3}s  {:>7.3}s  {:>8.3}s  {:>9.3}s  {:>8.2}",
                    k.kill.run,
                    k.kill.worker,
                    phase,
                    k.kill.step,
                    x.recovery_s,
                    x.detect_s,
                    x.plan_s,
                    x.rebuild_s,
                    x.transfer_s,
                    x.transfer_bytes as f64 / 1e6
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "{:>3}  {:>6}  {:>10}  {:>4}  failed: {}",
                    k.kill.run,
                    k.kill.worker,
                    phase,
                    k.kill.step,
                    k.error.as_deref().unwrap_or("?")
                );
            }
        }
    }
    let _ = writeln!(out, "\nrecovered        {} of {} kills", r.recovered, r.kills.len());
    let _ = writeln!(
        out,
        "recovery         median {:.3} s, max {:.3} s (kill -> next completed step; target < {TARGET_S} s)",
        r.recovery_s_median, r.recovery_s_max
    );
    let _ = writeln!(out, "step time        median {:.3} s without failures", r.step_s_median);
    out
}
