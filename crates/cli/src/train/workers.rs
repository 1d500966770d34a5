//! `lazarus train --workers N`: the flags become a job for the control plane
//! ([`lazarus_control::train`]), and its actions become the single-process trainer's progress
//! bar, `--json-log` lines and summary, plus what each worker did.

use anyhow::{bail, Context, Result};
use lazarus_control::{plan_job, run_training, ControlError, PlanSource, Recovery, TrainEvent, TrainJob, TrainOutcome};
use lazarus_model::Trainer;
use lazarus_plan::ModelPlan;

use super::args::{check_resumed_config, resume_steps, setup_run, TrainArgs, DEFAULT_COMM_TIMEOUT_S};
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

/// The launcher side of `lazarus train --workers N`.
pub fn run_train_workers(args: &TrainArgs) -> Result<()> {
    let world = args.workers.unwrap_or(1);
    let comm_timeout = lazarus_control::launcher::check_comm_timeout(args.comm_timeout.unwrap_or(DEFAULT_COMM_TIMEOUT_S))?;
    if world == 0 || world > lazarus_control::train::MAX_WORKERS {
        bail!("invalid --workers: {world} (expected 1 to {})", lazarus_control::train::MAX_WORKERS);
    }
    // The launcher builds the model once to plan, and every worker builds it whole before it
    // releases the experts it does not hold.
    let copies = 1 + world as u128;
    let (mut trainer, resume) = if args.resume {
        let config = setup_run(args, copies)?;
        let Some(dir) = config.checkpoint_dir.clone() else {
            bail!("--resume needs --checkpoint-dir (or checkpoint_dir in --config)");
        };
        let t = Trainer::resume(&dir, resume_steps(args)?).with_context(|| format!("resuming from {}", dir.display()))?;
        check_resumed_config(args, &t.config)?;
        tracing::info!("resuming from {} at step {}", dir.display(), t.step);
        (t, Some(dir))
    } else {
        (Trainer::new(setup_run(args, copies)?)?, None)
    };
    let cfg = trainer.config.clone();
    if trainer.done() {
        bail!("nothing to do: the run is at step {} of --steps {}", trainer.step, cfg.steps);
    }
    let source = plan_source(args, cfg.steps - trainer.step)?;
    let plan = plan_job(&mut trainer, world, &source)?;
    print_banner(&trainer, &format!("{world} workers, {}", if args.static_ep { "static expert parallelism" } else { "lazarus dispatch" }));
    for (l, layer) in plan.map.layers().iter().enumerate() {
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
    let recovery = recovery(args)?;
    let unrecoverable = args.static_ep || plan.placement.as_ref().is_some_and(|p| p.shape().gpus_per_node > 1);
    if recovery.is_some() && unrecoverable {
        tracing::info!(
            "recovery: off ({})",
            if args.static_ep {
                "static expert parallelism restarts on failures, as DeepSpeed-MoE does"
            } else {
                "plans with several GPUs per node are not re-planned yet"
            }
        );
    }
    // The log file is opened (and checked) before any worker starts.
    let mut reporter = Reporter::new(args, &cfg, trainer.step)?;
    let job = TrainJob { config: cfg.clone(), plan: plan.map, static_ep: args.static_ep, resume, heartbeat_s: 0.0, faults: String::new() };
    let mut report_error: Option<anyhow::Error> = None;
    let status_listen = match (recovery.is_some() && !unrecoverable, args.status_listen.as_deref()) {
        (_, Some("off")) => None,
        (false, Some(_)) => bail!("--status-listen needs live recovery (the controller serves the status)"),
        (false, None) => None,
        (true, given) => {
            let addr = given.unwrap_or("127.0.0.1:0");
            Some(
                addr.parse::<std::net::SocketAddr>()
                    .map_err(|_| anyhow::anyhow!("invalid --status-listen: {addr:?} (expected host:port or off)"))?,
            )
        }
    };
    let outcome = run_training(&job, plan.placement.as_ref(), world, comm_timeout, recovery, status_listen, |event| {
        let shown = match event {
            TrainEvent::Ready { rank, pid } => {
                tracing::info!("worker {rank}: pid {pid} ready");
                Ok(())
            }
            TrainEvent::Started => {
                reporter.restart_clock();
                Ok(())
            }
            TrainEvent::Step { report, seconds, dropped } => {
                if dropped > 0 {
                    reporter.pause();
                    tracing::warn!("warning: {dropped} step reports were dropped while the launcher was not reading (training went on)");
                }
                reporter.step(&report, seconds)
            }
            TrainEvent::Lost { worker, why } => {
                reporter.pause();
                tracing::warn!("worker {worker}: {why}");
                Ok(())
            }
            TrainEvent::Checkpointed { .. } => Ok(()),
            TrainEvent::Serving { addr } => {
                tracing::info!("controller status: lazarus status --controller {addr}");
                Ok(())
            }
            TrainEvent::Reconfigured(r) => {
                reporter.pause();
                let lost: Vec<String> = r.lost.iter().map(|w| w.to_string()).collect();
                tracing::info!(
                    "{}: epoch {}, worker(s) {} lost, {} workers from step {}; detect {:.2} s, plan {:.3} s, rebuild {:.2} s, transfer {:.2} s ({:.1} MB), recovered in {:.2} s",
                    if r.cause == "rollback" { "rolled back" } else { "reconfigured" },
                    r.epoch,
                    lost.join(","),
                    r.workers,
                    r.step,
                    r.detect_s,
                    r.plan_s,
                    r.rebuild_s,
                    r.transfer_s,
                    r.transfer_bytes as f64 / 1e6,
                    r.recovery_s
                );
                if r.cause == "rollback" {
                    reporter.rewind(r.step).and_then(|_| reporter.record(&r))
                } else {
                    reporter.record(&r)
                }
            }
        };
        shown.map_err(|e| {
            let message = format!("{e:#}");
            report_error = Some(e);
            ControlError::Launch(format!("stopped: {message}"))
        })
    });
    if let Some(e) = report_error {
        return Err(e);
    }
    match outcome? {
        TrainOutcome::Completed { checkpoint } => reporter.finish(cfg.steps, trainer.unigram_entropy(), checkpoint.as_deref()),
        TrainOutcome::Failed { reason, workers } => {
            if workers.is_empty() {
                bail!("training stopped: {reason}")
            }
            bail!("training stopped: {reason}; workers {}", workers.join(", "))
        }
    }
}

/// `--recovery`, `--lease` and `--heartbeat`: how failures are found and recovered from.
fn recovery(args: &TrainArgs) -> Result<Option<Recovery>> {
    if !args.recovery.unwrap_or(true) {
        return Ok(None);
    }
    let r = Recovery::from_flags(args.lease, args.heartbeat)?;
    Ok(Some(r))
}
