//! What `lazarus train --workers N` shows its user as the job runs: one line per event of the
//! controller process's loop, the progress and the `--json-log` records (through the
//! [`Reporter`]), and the figures a replayed trace is compared with.

use anyhow::Result;

use lazarus_controller::decisions::words::id_list;
use lazarus_controller::decisions::{MoveCause, RebalanceVerdict};
use lazarus_controller::TrainEvent;

use lazarus_model::TrainConfig;

use super::replay_sim::{self, RunFigures, RunShape};
use super::report::Reporter;

/// The user's view of one job of `world` workers, `gpus_per_node` a node.
pub(super) struct JobView {
    pub reporter: Reporter,
    /// What a replayed trace is compared with: every step's time and loads, every move.
    pub figures: RunFigures,
    /// When every worker was first ready.
    pub started: Option<std::time::Instant>,
    /// Agents on other hosts bring the workers: the user is told how to start them.
    pub remote: bool,
    pub agent_command: Option<String>,
    pub world: usize,
    pub gpus_per_node: usize,
    /// Tokens per window of a held-out evaluation.
    pub seq_len: usize,
}

impl JobView {
    /// Show one event.
    pub fn show(&mut self, event: TrainEvent) -> Result<()> {
        match event {
            TrainEvent::Ready { rank, pid } => {
                tracing::info!("worker {rank}: pid {pid} ready");
                Ok(())
            }
            TrainEvent::Started => {
                self.reporter.restart_clock();
                self.started.get_or_insert_with(std::time::Instant::now);
                Ok(())
            }
            TrainEvent::Step { report, seconds, dropped, moe_wire_bytes, snapshot } => {
                self.step(&report, seconds, dropped, moe_wire_bytes, snapshot.as_ref())
            }
            TrainEvent::Lost { worker, why } => {
                self.reporter.pause();
                tracing::warn!("worker {worker}: {why}");
                Ok(())
            }
            TrainEvent::Checkpointed { step, path } => {
                self.reporter.checkpointed(step, &path);
                Ok(())
            }
            TrainEvent::Evaluated { step, evaluation } => self.reporter.eval(step, &evaluation, self.seq_len),
            TrainEvent::Metrics { addr } => {
                tracing::info!("metrics for Prometheus: http://{addr}/metrics");
                Ok(())
            }
            TrainEvent::Dashboard { url } => {
                tracing::info!("dashboard: {url}");
                Ok(())
            }
            TrainEvent::Serving { addr, status_token } => {
                self.serving(addr, &status_token);
                Ok(())
            }
            TrainEvent::Rebalance(d) => self.rebalanced(&d),
            TrainEvent::Leaving { workers, reason } => {
                self.reporter.pause();
                tracing::info!(
                    "workers {} leave on notice ({reason}): moving the job off them at the next step boundary",
                    id_list(workers.iter().map(|&w| w as u64))
                );
                Ok(())
            }
            TrainEvent::WorkersJoined { workers } => {
                self.reporter.pause();
                tracing::info!(
                    "workers {} joined: standing by to be taken in at a step boundary",
                    id_list(workers.iter().map(|&w| w as u64))
                );
                Ok(())
            }
            TrainEvent::AgentJoined { agent, host, peer, gpus, pid, attached, world } => {
                tracing::info!(
                    "agent {agent} attached from {peer} (pid {pid}), its workers listening on {host}: {gpus} workers, {attached} of {world}"
                );
                Ok(())
            }
            TrainEvent::Reconfigured(r) => self.moved(&r),
        }
    }

    /// A step done: its figures kept, shown and logged.
    fn step(
        &mut self,
        report: &lazarus_model::StepReport,
        seconds: f64,
        dropped: u64,
        moe_wire_bytes: Option<u64>,
        snapshot: Option<&lazarus_runtime::SnapshotStepStats>,
    ) -> Result<()> {
        self.figures.step_s.push(seconds);
        for (acc, l) in self.figures.loads.iter_mut().zip(&report.expert_load) {
            acc.iter_mut().zip(l).for_each(|(a, &x)| *a += x as f64);
        }
        if dropped > 0 {
            self.reporter.pause();
            tracing::warn!("warning: {dropped} step reports were dropped while the launcher was not reading (training went on)");
        }
        self.reporter.step_with(report, seconds, snapshot, moe_wire_bytes)
    }

    /// Where the controller listens and how to reach it: the agents' command (for a job of
    /// other hosts' agents) and the status command.
    fn serving(&self, addr: std::net::SocketAddr, status_token: &str) {
        // Listening on every address (0.0.0.0): others reach it by this host's name.
        let reach = if addr.ip().is_unspecified() {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            format!("{}:{}", if host.trim().is_empty() { "THIS-HOST" } else { host.trim() }, addr.port())
        } else {
            addr.to_string()
        };
        if self.remote {
            tracing::info!("controller listening on {addr}: waiting for agents to bring {} workers", self.world);
            if let Some(command) = &self.agent_command {
                let command = command.replace("{addr}", &reach).replace("--gpus G", &format!("--gpus {}", self.gpus_per_node));
                tracing::info!("start each node's agent with: {command}");
            }
        }
        tracing::info!("controller status: LAZARUS_STATUS_TOKEN={status_token} lazarus status --controller {reach}");
    }

    /// A rebalance weighed: what was decided and why, shown and logged.
    fn rebalanced(&mut self, d: &lazarus_controller::decisions::RebalanceDecision) -> Result<()> {
        self.reporter.pause();
        let what = match d.decision {
            RebalanceVerdict::Shrink => {
                format!("shrink to layers {:?} (the whole plan would gain {:.2} s for {:.2} s)", d.layers, d.full_gain_s, d.full_cost_s)
            }
            other => other.as_str().to_string(),
        };
        tracing::info!(
            "rebalance at step {}: {what} — imbalance {:.3} → {:.3}; predicted gain {:.2} s over {} steps against {}",
            d.step,
            d.imbalance_before,
            d.imbalance_after,
            d.gain_s,
            d.horizon_steps,
            d.cost_said()
        );
        self.reporter.record(d)
    }

    /// A move done: who went and came, what it cost, every expert restored from a snapshot;
    /// a rollback rewinds the log to its step.
    fn moved(&mut self, r: &lazarus_controller::ReconfigurationRecord) -> Result<()> {
        self.reporter.pause();
        self.reporter.moved(r);
        self.figures.moves.push(r.clone());
        let list = |ws: &[u64]| id_list(ws.iter().copied());
        let who = match (r.lost.is_empty(), r.joined.is_empty()) {
            (false, true) if r.cause == MoveCause::Drain => format!("worker(s) {} left", list(&r.lost)),
            (false, true) => format!("worker(s) {} lost", list(&r.lost)),
            (true, false) => format!("worker(s) {} taken in", list(&r.joined)),
            (false, false) => format!("worker(s) {} lost, {} taken in", list(&r.lost), list(&r.joined)),
            (true, true) => "the same workers".to_string(),
        };
        tracing::info!(
            "{}: epoch {}, {who}, {} workers from step {}; detect {:.2} s, plan {:.3} s, rebuild {:.2} s, transfer {:.2} s ({:.1} MB), recovered in {:.2} s",
            match r.cause {
                MoveCause::Rollback => "rolled back",
                MoveCause::Join => "joined",
                MoveCause::Rebalance => "rebalanced",
                MoveCause::Drain => "drained",
                MoveCause::Controller => "taken back by a new controller",
                MoveCause::Failure => "reconfigured",
            },
            r.epoch,
            r.workers,
            r.step,
            r.detect_s,
            r.plan_s,
            r.rebuild_s,
            r.transfer_s,
            r.transfer_bytes as f64 / 1e6,
            r.recovery_s
        );
        if r.cause == MoveCause::Rollback && !r.joined.is_empty() && r.workers == r.joined.len() {
            tracing::warn!(
                "no member came back: the job goes on from its last checkpoint (step {}) with the {} workers that joined",
                r.step,
                r.workers
            );
        }
        for x in &r.restored {
            tracing::warn!(
                "restored: layer {} expert {} lost every replica; it comes back from its snapshot of step {} in worker {}'s memory ({} steps stale, {} tokens lost); a rollback would have re-run {} steps",
                x.layer,
                x.expert,
                x.from_step,
                x.holder,
                x.stale_steps,
                x.tokens_lost,
                r.rollback_avoided_steps
            );
        }
        if r.cause == MoveCause::Rollback {
            self.reporter.rewind(r.step).and_then(|_| self.reporter.record(r))
        } else {
            self.reporter.record(r)
        }
    }

    /// The replayed trace run through the simulator, calibrated to this run of `steps` steps:
    /// its predicted samples against the measured ones.
    pub fn compare_replay(&mut self, cfg: &TrainConfig, shape: &RunShape, steps: u64) -> Result<()> {
        let Some(t0) = self.started else { return Ok(()) };
        self.figures.wall_s = t0.elapsed().as_secs_f64();
        if let Some(c) = replay_sim::compare(cfg, shape, &self.figures, steps)? {
            tracing::info!(
                "replay against lazarus sim calibrated to this run (step {:.1} ms, detect {:.2} s, rebuild {:.2} s, {:.0} MB/s, rollback {:.2} s): \
                 measured {:.0} samples in {:.1} s ({} reconfigurations, {} rollbacks, {} joins); predicted {:.0} samples ({:+.1}%; {} reconfigurations, {} restarts)",
                c.calibration.step_s * 1e3,
                c.calibration.detect_s,
                c.calibration.rebuild_s,
                c.calibration.bytes_per_s / 1e6,
                c.calibration.rollback_s,
                c.measured_samples,
                c.wall_s,
                c.measured_reconfigurations,
                c.measured_rollbacks,
                c.measured_joins,
                c.predicted_samples,
                (c.ratio - 1.0) * 100.0,
                c.predicted_reconfigurations,
                c.predicted_restarts
            );
            self.reporter.record(&c)?;
        }
        Ok(())
    }
}
