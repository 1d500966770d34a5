//! What a training run shows: the banner, the progress bar or plain lines, the `--json-log`
//! lines and the end summary — the same for one process and for N workers.

use std::fmt::Write as _;
use std::fs::OpenOptions;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use lazarus_model::{StepReport, TrainConfig, Trainer};
use serde::Serialize;

use lazarus_controller::decisions::MoveCause;

use super::args::TrainArgs;

#[derive(Serialize)]
struct LogLine<'a> {
    step: u64,
    loss: f64,
    aux_loss: f64,
    tokens: u64,
    tokens_per_s: f64,
    /// Seconds since this run (or resumed run) began, when the step was reported: wall time
    /// per step including whatever runs between steps (snapshots, checkpoints).
    elapsed_s: f64,
    expert_load: &'a [Vec<u64>],
    /// The step's snapshots into other nodes' memory (runs that take them).
    #[serde(skip_serializing_if = "Option::is_none")]
    snapshot: Option<&'a lazarus_runtime::SnapshotStepStats>,
    /// Bytes the step's MoE all-to-alls sent between workers, summed over them (runs on
    /// workers).
    #[serde(skip_serializing_if = "Option::is_none")]
    moe_wire_bytes: Option<u64>,
}

/// The first line of a run: where it trains (`device`: the `--device` of the processes that
/// train, not of the launcher's own copy of the model it plans with), model size, data and
/// schedule.
pub fn print_banner(trainer: &Trainer, how: &str, device: &str) {
    let cfg = &trainer.config;
    let params = trainer.model.params().num_elements();
    let expert_params = cfg.model.expert_params() * cfg.model.n_experts * cfg.model.moe_layers();
    tracing::info!(
        "lazarus train ({how}, {}, {}): {:.2}M parameters ({:.2}M in {} experts x {} MoE layers, top-{}{}; {}), data {}, {} steps of {} x {} tokens",
        device,
        match cfg.dtype {
            lazarus_model::Precision::F32 => "f32",
            lazarus_model::Precision::Bf16 => "bf16 mixed precision",
        },
        params as f64 / 1e6,
        expert_params as f64 / 1e6,
        cfg.model.n_experts,
        cfg.model.moe_layers(),
        cfg.model.top_k,
        match cfg.model.balance {
            lazarus_model::config::Balance::Aux => String::new(),
            lazarus_model::config::Balance::Bias => format!(", loss-free routing bias γ={}", cfg.model.bias_update_rate),
            lazarus_model::config::Balance::Both => format!(", loss-free routing bias γ={} and aux loss", cfg.model.bias_update_rate),
        },
        cfg.model.describe_blocks(),
        cfg.data.describe(),
        cfg.steps,
        cfg.batch_size,
        cfg.seq_len
    );
}

/// Progress bar (or plain lines), `--json-log` and the end summary, fed one step report at a
/// time — the same for one process and for N workers.
pub struct Reporter {
    /// The `--json-log` file and its path (for errors).
    log: Option<(PathBuf, BufWriter<std::fs::File>)>,
    bar: Option<ProgressBar>,
    quiet: bool,
    total_steps: u64,
    every: u64,
    start: Instant,
    first_step: u64,
    tokens: u64,
    recent: Vec<f64>,
    first_loss: Option<f64>,
    last: Option<StepReport>,
    /// Snapshot totals of this run.
    snapshots: Option<SnapshotTotals>,
    /// Steps and bytes of the MoE all-to-alls between workers this run (runs on workers).
    moe_wire: Option<(u64, u64)>,
    /// The last evaluation on held-out data, and its step.
    eval: Option<(u64, lazarus_model::eval::Evaluation)>,
    /// Runs on workers: the job's moves, for the summary (None for one process).
    moves: Option<Vec<Moved>>,
    /// The TensorBoard event file (`--tensorboard`), until a write to it fails.
    tensorboard: Option<lazarus_tensorboard::EventWriter>,
    /// Each expert's tag in that file, per MoE layer (made once, not every step).
    expert_tags: Vec<Vec<String>>,
}

/// One move of a job on workers, as the summary counts it.
#[derive(Debug, Clone, Copy)]
struct Moved {
    cause: MoveCause,
    /// Workers lost in it (not those that left on notice).
    lost: usize,
    /// From the fault's detection (or the move's start) to training again.
    recovery_s: f64,
    /// Experts brought back from snapshots instead of a rollback.
    restored: usize,
}

/// What a run's snapshots cost, summed over its steps.
#[derive(Debug, Default)]
struct SnapshotTotals {
    steps: u64,
    bytes: u64,
    moetion_bytes: u64,
    at_risk_bytes: u64,
    /// CPU seconds of the workers' snapshot frames, and of the workers in all, over the steps.
    cpu: lazarus_plan::RoundCost,
}

/// The last step a `--json-log` records (None: no log, or no step in it). A last line cut off
/// mid-write (the process killed) is removed, so that the lines appended after it stay whole.
pub fn last_logged_step(path: &std::path::Path) -> Result<Option<u64>> {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("--json-log: cannot read {}", path.display())),
    };
    let whole = text.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    if whole < text.len() {
        let f = OpenOptions::new().write(true).open(path).with_context(|| format!("--json-log: cannot open {}", path.display()))?;
        f.set_len(whole as u64).with_context(|| format!("--json-log: cannot cut the partial last line of {}", path.display()))?;
        tracing::warn!("--json-log {}: its last line was cut off ({} bytes): removed", path.display(), text.len() - whole);
    }
    let last = String::from_utf8_lossy(&text[..whole])
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("event").is_none())
        .filter_map(|v| v.get("step").and_then(|s| s.as_u64()))
        .max();
    Ok(last)
}

impl Reporter {
    pub fn new(args: &TrainArgs, cfg: &TrainConfig, first_step: u64) -> Result<Self> {
        let log = match &args.json_log {
            Some(p) => {
                if p.is_dir() {
                    bail!("invalid --json-log: {} is a directory", p.display());
                }
                let file = OpenOptions::new()
                    .create(true)
                    .append(args.resume)
                    .write(true)
                    .truncate(!args.resume)
                    .open(p)
                    .with_context(|| format!("--json-log: cannot open {}", p.display()))?;
                Some((p.clone(), BufWriter::new(file)))
            }
            None => None,
        };
        let bar = if std::io::stderr().is_terminal() && !args.quiet {
            let b = ProgressBar::new(cfg.steps);
            b.set_style(
                ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b.set_position(first_step);
            Some(b)
        } else {
            None
        };
        let mut reporter = Reporter {
            log,
            bar,
            quiet: args.quiet,
            total_steps: cfg.steps,
            every: (cfg.steps / 20).max(1),
            start: Instant::now(),
            first_step,
            tokens: 0,
            recent: Vec::new(),
            first_loss: None,
            last: None,
            snapshots: None,
            moe_wire: None,
            eval: None,
            moves: args.uses_workers().then(Vec::new),
            tensorboard: match &args.tensorboard {
                Some(dir) => Some(tensorboard_file(dir)?),
                None => None,
            },
            expert_tags: (0..cfg.model.moe_layers())
                .map(|l| (0..cfg.model.n_experts).map(|e| format!("expert_load/layer{l}/expert{e}")).collect())
                .collect(),
        };
        // On --resume the steps after the checkpoint run again: their old lines go, so that every
        // step is logged once.
        if args.resume {
            reporter.rewind(first_step)?;
        }
        Ok(reporter)
    }

    /// The last step shown, if any.
    pub fn last_step(&self) -> Option<u64> {
        self.last.as_ref().map(|r| r.step)
    }

    /// One finished step that took `seconds`.
    pub fn step(&mut self, r: &StepReport, seconds: f64) -> Result<()> {
        self.step_with(r, seconds, None, None)
    }

    /// One finished step that took `seconds`, with what its snapshots cost and what its MoE
    /// all-to-alls sent between workers.
    pub fn step_with(
        &mut self,
        r: &StepReport,
        seconds: f64,
        snapshot: Option<&lazarus_runtime::SnapshotStepStats>,
        moe_wire_bytes: Option<u64>,
    ) -> Result<()> {
        if let Some(bytes) = moe_wire_bytes {
            let (steps, total) = self.moe_wire.get_or_insert((0, 0));
            *steps += 1;
            *total += bytes;
        }
        if let Some(s) = snapshot {
            let t = self.snapshots.get_or_insert_with(SnapshotTotals::default);
            t.steps += 1;
            t.bytes += s.bytes;
            t.moetion_bytes += s.moetion_bytes;
            t.at_risk_bytes += s.at_risk_bytes;
            t.cpu.snapshot_cpu_s += s.snapshot_cpu_s;
            t.cpu.process_cpu_s += s.process_cpu_s;
        }
        let tps = r.tokens as f64 / seconds.max(1e-9);
        self.tokens += r.tokens;
        self.first_loss.get_or_insert(r.loss);
        self.recent.push(r.loss);
        if self.recent.len() > 20 {
            self.recent.remove(0);
        }
        self.tensorboard_step(r, tps, moe_wire_bytes);
        if let Some((path, w)) = self.log.as_mut() {
            let line = LogLine {
                step: r.step,
                loss: r.loss,
                aux_loss: r.aux_loss,
                tokens: r.tokens,
                tokens_per_s: tps,
                elapsed_s: self.start.elapsed().as_secs_f64(),
                expert_load: &r.expert_load,
                snapshot,
                moe_wire_bytes,
            };
            serde_json::to_writer(&mut *w, &line)
                .map_err(std::io::Error::from)
                .and_then(|_| w.write_all(b"\n"))
                .and_then(|_| w.flush())
                .with_context(|| format!("--json-log: cannot write to {}", path.display()))?;
        }
        let msg = format!("loss {:.4}  aux {:.3}  lr {:.2e}  {:.0} tok/s", r.loss, r.aux_loss, r.lr, tps);
        match &self.bar {
            Some(b) => {
                b.set_position(r.step);
                b.set_message(msg);
            }
            None if !self.quiet && (r.step.is_multiple_of(self.every) || r.step == self.total_steps) => {
                let elapsed = self.start.elapsed().as_secs_f64();
                tracing::info!(
                    "step {:>6}/{}  {msg}  [{}]",
                    r.step,
                    self.total_steps,
                    timing(elapsed, r.step.saturating_sub(self.first_step), self.total_steps.saturating_sub(r.step))
                );
            }
            None => {}
        }
        self.last = Some(r.clone());
        Ok(())
    }

    /// A step's scalars in the TensorBoard file: the losses, learning rate, gradient norm,
    /// tokens/s, each expert's share of its layer's tokens, the MoE bytes between workers.
    fn tensorboard_step(&mut self, r: &StepReport, tokens_per_s: f64, moe_wire_bytes: Option<u64>) {
        if self.tensorboard.is_none() {
            return;
        }
        let mut scalars: Vec<(&str, f64)> = vec![
            ("train/loss", r.loss),
            ("train/aux_loss", r.aux_loss),
            ("train/learning_rate", r.lr),
            ("train/grad_norm", r.grad_norm),
            ("train/tokens_per_s", tokens_per_s),
        ];
        for (load, tags) in r.expert_load.iter().zip(&self.expert_tags) {
            let total = load.iter().sum::<u64>().max(1) as f64;
            scalars.extend(load.iter().zip(tags).map(|(&n, tag)| (tag.as_str(), n as f64 / total)));
        }
        if let Some(bytes) = moe_wire_bytes {
            scalars.push(("train/moe_wire_bytes", bytes as f64));
        }
        tensorboard_write(&mut self.tensorboard, r.step, &scalars);
    }

    /// One more JSON object in the `--json-log`, beside the step lines (a reconfiguration).
    pub fn record(&mut self, value: &impl Serialize) -> Result<()> {
        if let Some((path, w)) = self.log.as_mut() {
            serde_json::to_writer(&mut *w, value)
                .map_err(std::io::Error::from)
                .and_then(|_| w.write_all(b"\n"))
                .and_then(|_| w.flush())
                .with_context(|| format!("--json-log: cannot write to {}", path.display()))?;
        }
        Ok(())
    }

    /// A checkpoint written after `step`: a line (the progress bar's, or a log line), so a
    /// user reading piped output knows what a crash would keep.
    pub fn checkpointed(&self, step: u64, path: &std::path::Path) {
        let line = format!("checkpoint at step {step}: {}", path.display());
        match &self.bar {
            Some(b) => b.println(line),
            None if !self.quiet => tracing::info!("{line}"),
            None => {}
        }
    }

    /// A move of the job on workers (a recovery, a join, a drain, a rebalance, a rollback),
    /// counted for the summary.
    pub fn moved(&mut self, r: &lazarus_controller::control_loop::ReconfigurationRecord) {
        let lost = if r.cause == MoveCause::Drain { 0 } else { r.lost.len() };
        let m = Moved { cause: r.cause, lost, recovery_s: r.recovery_s, restored: r.restored.len() };
        self.moves.get_or_insert_with(Vec::new).push(m);
        let tag = format!("moves/{}_s", r.cause.as_str());
        tensorboard_write(&mut self.tensorboard, r.step, &[(&tag, r.recovery_s), ("moves/workers_lost", lost as f64)]);
    }

    /// Training went back to the checkpoint of `step` (a rollback): cut the `--json-log` back
    /// to it, so that every step number appears once, with the loss of the history the model
    /// has now. Other lines (reconfigurations) stay.
    pub fn rewind(&mut self, step: u64) -> Result<()> {
        let Some((path, w)) = self.log.as_mut() else { return Ok(()) };
        w.flush().with_context(|| format!("--json-log: cannot write to {}", path.display()))?;
        let text = std::fs::read_to_string(&*path).with_context(|| format!("--json-log: cannot read {}", path.display()))?;
        let kept: String = text
            .lines()
            .filter(|line| {
                let v: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
                // Evaluations belong to the history they measured, as steps do.
                (v.get("event").is_some() && v["event"] != "eval") || v.get("step").and_then(|s| s.as_u64()).is_none_or(|s| s <= step)
            })
            .map(|l| format!("{l}\n"))
            .collect();
        let tmp = path.with_extension("rewind.tmp");
        std::fs::write(&tmp, kept)
            .and_then(|_| std::fs::rename(&tmp, &*path))
            .with_context(|| format!("--json-log: cannot rewrite {}", path.display()))?;
        let file = OpenOptions::new().append(true).open(&*path).with_context(|| format!("--json-log: cannot open {}", path.display()))?;
        *w = BufWriter::new(file);
        self.recent.clear();
        Ok(())
    }

    /// An evaluation on held-out data after `step`: a line, a `--json-log` record (`"event":
    /// "eval"`), and the summary's.
    pub fn eval(&mut self, step: u64, e: &lazarus_model::eval::Evaluation, seq_len: usize) -> Result<()> {
        self.pause();
        tracing::info!(
            "eval at step {step}: loss {:.4}, perplexity {:.2} ({} windows of {seq_len} tokens)",
            e.loss,
            e.perplexity,
            e.windows
        );
        self.record(&serde_json::json!({
            "event": "eval", "step": step, "loss": e.loss, "perplexity": e.perplexity, "windows": e.windows, "tokens": e.tokens,
        }))?;
        self.eval = Some((step, *e));
        tensorboard_write(&mut self.tensorboard, step, &[("eval/loss", e.loss), ("eval/perplexity", e.perplexity)]);
        Ok(())
    }

    /// Measure throughput from now (the workers are ready: start-up is not training).
    pub fn restart_clock(&mut self) {
        self.start = Instant::now();
    }

    /// Stop the bar (before printing anything else).
    pub fn pause(&self) {
        if let Some(b) = &self.bar {
            b.abandon();
        }
    }

    /// The end summary, on stdout.
    pub fn finish(&self, step: u64, unigram_entropy: f64, checkpoint: Option<&std::path::Path>) -> Result<()> {
        if let Some(b) = &self.bar {
            b.finish();
        }
        let wall = self.start.elapsed().as_secs_f64();
        let final_loss = self.recent.iter().sum::<f64>() / self.recent.len().max(1) as f64;
        let mut out = String::new();
        let _ = writeln!(out, "\nsummary");
        let _ = writeln!(out, "  steps           {} (this run {})", step, step - self.first_step);
        let _ = writeln!(out, "  tokens          {} in {wall:.1} s = {:.0} tokens/s", self.tokens, self.tokens as f64 / wall.max(1e-9));
        let _ = writeln!(
            out,
            "  loss            {:.4} -> {:.4} (mean of last {}; unigram entropy of the data {:.4} nats)",
            self.first_loss.unwrap_or(f64::NAN),
            final_loss,
            self.recent.len(),
            unigram_entropy
        );
        if let Some(r) = &self.last {
            for (l, load) in r.expert_load.iter().enumerate() {
                let total: u64 = load.iter().sum();
                let shares: Vec<String> = load.iter().map(|&x| format!("{:.0}%", 100.0 * x as f64 / total.max(1) as f64)).collect();
                let _ = writeln!(out, "  expert load L{l:<2}  {}", shares.join(" "));
            }
            if r.dropped > 0 {
                let _ = writeln!(out, "  dropped         {} assignments in the last step (capacity factor)", r.dropped);
            }
        }
        if let Some((steps, total)) = self.moe_wire {
            let _ = writeln!(
                out,
                "  MoE all-to-all  {:.2} MB/step between workers (every worker's, over {steps} steps)",
                total as f64 / 1e6 / steps.max(1) as f64
            );
        }
        if let Some(t) = &self.snapshots {
            let per_step = |bytes: u64| bytes as f64 / 1e3 / t.steps.max(1) as f64;
            let _ = writeln!(
                out,
                "  snapshots       {:.2} MB into other nodes' memory over {} steps ({:.1} KB/step of {:.1} KB/step at risk; MoEtion's selection: {:.1} KB/step); {:.2}% of the workers' CPU",
                t.bytes as f64 / 1e6,
                t.steps,
                per_step(t.bytes),
                per_step(t.at_risk_bytes),
                per_step(t.moetion_bytes),
                100.0 * t.cpu.cpu_share()
            );
        }
        if let Some((at, e)) = &self.eval {
            let _ = writeln!(
                out,
                "  eval            loss {:.4}, perplexity {:.2} at step {at} ({} windows, {} tokens of held-out data)",
                e.loss, e.perplexity, e.windows, e.tokens
            );
        }
        if let Some(moves) = &self.moves {
            let _ = writeln!(out, "  events          {}", events_line(moves));
        }
        match checkpoint {
            Some(p) => {
                // Paths under the working directory as the user would type them.
                let here = std::env::current_dir().ok();
                let shown = |p: &std::path::Path| here.as_deref().and_then(|h| p.strip_prefix(h).ok()).unwrap_or(p).display().to_string();
                let _ = writeln!(out, "  checkpoint      {}", shown(p));
                let run = shown(&lazarus_model::checkpoint::run_dir_of(p));
                let _ = writeln!(
                    out,
                    "  use it          lazarus generate --checkpoint {run} --prompt TEXT; lazarus eval --checkpoint {run} --data FILE; \
                     lazarus train --resume --checkpoint-dir {run} --steps N"
                );
            }
            None => {
                let _ = writeln!(out, "  checkpoint      none: nothing was saved (--checkpoint-dir DIR keeps the model)");
            }
        }
        crate::io::print(&out)
    }
}

/// `scalars` at `step` in the TensorBoard file `tb`; a failed write is said once and ends the
/// file, not the run.
fn tensorboard_write(tb: &mut Option<lazarus_tensorboard::EventWriter>, step: u64, scalars: &[(&str, f64)]) {
    let Some(w) = tb.as_mut() else { return };
    if let Err(e) = w.scalars(step, unix_s(), scalars) {
        tracing::warn!("--tensorboard: {e}; no more events are written");
        *tb = None;
    }
}

/// A new TensorBoard event file in `dir`, named as TensorBoard's writers name theirs.
fn tensorboard_file(dir: &std::path::Path) -> Result<lazarus_tensorboard::EventWriter> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let name = lazarus_tensorboard::event_file_name(unix_s() as u64, host.trim(), std::process::id());
    lazarus_tensorboard::EventWriter::create(dir, &name, unix_s()).with_context(|| format!("--tensorboard {}", dir.display()))
}

/// Seconds since the Unix epoch: an event's wall time.
fn unix_s() -> f64 {
    lazarus_protocol::when::unix_ms_now() as f64 / 1000.0
}

/// `[12 s, ETA 48 s]` of a plain progress line: the time since the run began, and the time
/// the `left` steps would take at the pace of the `done` ones.
fn timing(elapsed_s: f64, done: u64, left: u64) -> String {
    let eta = if done == 0 { "ETA ?".to_string() } else { format!("ETA {}", seconds(elapsed_s / done as f64 * left as f64)) };
    format!("{}, {eta}", seconds(elapsed_s))
}

/// A duration as people read it: `42 s`, `3 min 05 s`, `2 h 07 min`.
fn seconds(s: f64) -> String {
    let whole = s.max(0.0).round() as u64;
    match whole {
        0..60 => format!("{whole} s"),
        60..3600 => format!("{} min {:02} s", whole / 60, whole % 60),
        _ => format!("{} h {:02} min", whole / 3600, whole % 3600 / 60),
    }
}

/// What happened to a job on workers, in one line: workers lost and the recoveries from it
/// (with their times), rollbacks, experts restored from snapshots, joins, drains, rebalances,
/// controllers that took the job back — or that nothing did.
fn events_line(moves: &[Moved]) -> String {
    if moves.is_empty() {
        return "none: no worker lost, joined or left, no rebalance".into();
    }
    let count = |cause: MoveCause| moves.iter().filter(|m| m.cause == cause).count();
    let plural = |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
    let mut parts = Vec::new();
    let lost: usize = moves.iter().map(|m| m.lost).sum();
    if lost > 0 {
        parts.push(format!("{} lost", plural(lost, "worker", "workers")));
    }
    let recoveries: Vec<f64> = moves.iter().filter(|m| m.cause == MoveCause::Failure).map(|m| m.recovery_s).collect();
    if !recoveries.is_empty() {
        let mean = recoveries.iter().sum::<f64>() / recoveries.len() as f64;
        let longest = recoveries.iter().cloned().fold(0.0, f64::max);
        parts.push(format!(
            "{} without a restart (mean {mean:.2} s, longest {longest:.2} s)",
            plural(recoveries.len(), "recovery", "recoveries")
        ));
    }
    let restored: usize = moves.iter().map(|m| m.restored).sum();
    for (n, one, many) in [
        (count(MoveCause::Rollback), "rollback to a checkpoint", "rollbacks to a checkpoint"),
        (restored, "expert restored from a snapshot", "experts restored from snapshots"),
        (count(MoveCause::Join), "join", "joins"),
        (count(MoveCause::Drain), "drain on notice", "drains on notice"),
        (count(MoveCause::Rebalance), "rebalance", "rebalances"),
        (count(MoveCause::Controller), "controller taking the job back", "controllers taking the job back"),
    ] {
        if n > 0 {
            parts.push(plural(n, one, many));
        }
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_events_line_counts_what_happened() {
        let m = |cause, lost, recovery_s, restored| Moved { cause, lost, recovery_s, restored };
        assert_eq!(events_line(&[]), "none: no worker lost, joined or left, no rebalance");
        let line = events_line(&[
            m(MoveCause::Failure, 1, 0.4, 0),
            m(MoveCause::Failure, 2, 0.8, 1),
            m(MoveCause::Rollback, 1, 3.0, 0),
            m(MoveCause::Join, 0, 0.2, 0),
            m(MoveCause::Drain, 0, 0.1, 0),
        ]);
        assert_eq!(
            line,
            "4 workers lost, 2 recoveries without a restart (mean 0.60 s, longest 0.80 s), 1 rollback to a checkpoint, \
             1 expert restored from a snapshot, 1 join, 1 drain on notice"
        );
        assert_eq!(events_line(&[m(MoveCause::Rebalance, 0, 0.3, 0)]), "1 rebalance");
    }

    #[test]
    fn plain_progress_lines_tell_elapsed_time_and_eta() {
        assert_eq!(timing(12.0, 10, 40), "12 s, ETA 48 s");
        assert_eq!(timing(0.5, 0, 40), "1 s, ETA ?");
        assert_eq!(timing(125.0, 5, 150), "2 min 05 s, ETA 1 h 02 min");
    }
}
