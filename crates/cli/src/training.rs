//! `lazarus train`: the single-process trainer with a progress bar, a summary and a JSON log.

use std::fmt::Write as _;
use std::fs::OpenOptions;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use lazarus_model::{DataSource, StepReport, TokenWidth, TrainConfig, Trainer};
use serde::Serialize;

#[derive(Args, Debug, Default)]
pub struct TrainArgs {
    /// TOML file with any of the settings below (flags override it).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Total optimizer steps.
    #[arg(long)]
    pub(crate) steps: Option<u64>,
    /// Sequences per step (the constant global batch).
    #[arg(long)]
    batch_size: Option<usize>,
    #[arg(long)]
    seq_len: Option<usize>,
    /// Peak learning rate.
    #[arg(long, allow_hyphen_values = true)]
    lr: Option<f64>,
    #[arg(long, allow_hyphen_values = true)]
    min_lr: Option<f64>,
    #[arg(long)]
    warmup_steps: Option<u64>,
    /// Clip the global gradient norm ("off" disables).
    #[arg(long, allow_hyphen_values = true)]
    grad_clip: Option<String>,
    #[arg(long)]
    d_model: Option<usize>,
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long)]
    heads: Option<usize>,
    /// Experts per MoE layer.
    #[arg(long)]
    experts: Option<usize>,
    /// Experts per token (1 or 2).
    #[arg(long)]
    top_k: Option<usize>,
    /// Hidden width of each expert.
    #[arg(long)]
    d_ff: Option<usize>,
    /// An MoE layer every this many blocks (1 = every block).
    #[arg(long)]
    moe_every: Option<usize>,
    #[arg(long, allow_hyphen_values = true)]
    aux_loss_coef: Option<f64>,
    /// Expert capacity as a multiple of the even share ("off" = dropless, the default).
    #[arg(long, allow_hyphen_values = true)]
    capacity_factor: Option<String>,
    /// Seed of the weights and the sampling order.
    #[arg(long)]
    seed: Option<u64>,
    /// "synthetic" (built-in corpus), a UTF-8 text file, or token shards (comma-separated .bin).
    #[arg(long)]
    data: Option<String>,
    /// Format of --data files: text, u16 or u32.
    #[arg(long)]
    data_format: Option<String>,
    /// Size of the synthetic corpus in bytes.
    #[arg(long)]
    synthetic_bytes: Option<usize>,
    /// Replace the router's choices with per-layer loads from this JSON file.
    #[arg(long, value_name = "FILE")]
    routing_trace: Option<PathBuf>,
    /// Directory for checkpoints (written at the end and every --checkpoint-every steps).
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// Continue from the latest checkpoint in --checkpoint-dir.
    #[arg(long)]
    pub(crate) resume: bool,
    /// Append one JSON object per step to this file.
    #[arg(long, value_name = "FILE")]
    json_log: Option<PathBuf>,
    /// No progress bar or per-step lines, only the summary.
    #[arg(long)]
    pub quiet: bool,
    /// Train with this many local worker processes (data + expert parallel over loopback TCP)
    /// instead of one process.
    #[arg(long)]
    pub workers: Option<usize>,
    /// With --workers: expert placement from this file (the JSON of `lazarus plan --json`,
    /// one node per worker); default: planned from loads measured over the first steps.
    #[arg(long, value_name = "FILE")]
    pub placement_file: Option<PathBuf>,
    /// With --workers: expert replica slots per worker for the measured-load plan (default:
    /// enough for two replicas of every expert).
    #[arg(long)]
    pub slots_per_worker: Option<usize>,
    /// With --workers: throughput guard of the measured-load plan — the most fault-tolerant
    /// placement on which no worker needs more than this many times its mean share of tokens;
    /// `inf`: the most fault-tolerant placement, however unbalanced.
    /// (default 1.05)
    #[arg(long)]
    pub max_imbalance: Option<f64>,
    /// With --workers: steps whose router loads plan the placement (forward only, before
    /// training; default 3, or the steps to train when fewer).
    #[arg(long)]
    pub profile_steps: Option<usize>,
    /// With --workers: the static expert-parallel baseline of DeepSpeed-MoE (experts split evenly
    /// over the workers, one replica each, all-to-all buffers padded to the largest load).
    #[arg(long)]
    pub static_ep: bool,
    /// With --workers: deadline of every collective, in seconds (default 30).
    #[arg(long)]
    pub comm_timeout: Option<f64>,
}

/// Default deadline of every collective of `train --workers`, seconds.
pub const DEFAULT_COMM_TIMEOUT_S: f64 = 30.0;

fn off_or<T: std::str::FromStr>(field: &str, value: &str) -> Result<Option<T>> {
    if value == "off" || value == "none" {
        return Ok(None);
    }
    value.parse::<T>().map(Some).map_err(|_| anyhow::anyhow!("invalid --{field}: '{value}' (expected a number or 'off')"))
}

impl TrainArgs {
    /// Whether this run starts worker processes.
    pub fn uses_workers(&self) -> bool {
        self.workers.is_some()
    }

    /// Flags that only mean something with `--workers`, by name, when given.
    fn worker_flags(&self) -> Vec<&'static str> {
        let given: [(&'static str, bool); 7] = [
            ("--placement-file", self.placement_file.is_some()),
            ("--slots-per-worker", self.slots_per_worker.is_some()),
            ("--max-imbalance", self.max_imbalance.is_some()),
            ("--profile-steps", self.profile_steps.is_some()),
            ("--static-ep", self.static_ep),
            ("--comm-timeout", self.comm_timeout.is_some()),
            ("--workers", self.workers.is_some()),
        ];
        given.into_iter().filter(|(_, g)| *g).map(|(f, _)| f).collect()
    }

    /// No flag is silently ignored: refuse the combinations that would ignore one.
    pub fn check_combinations(&self) -> Result<()> {
        if !self.uses_workers() {
            if let Some(f) = self.worker_flags().first() {
                bail!("{f} needs --workers N (it configures multi-worker training)");
            }
        }
        Ok(())
    }
}

/// The settings where `a` differs from `b` (the keys of `a`, dotted), as `key = a (the
/// checkpoint has b)`, leaving out `steps` and `checkpoint_dir` (a resumed run may change those).
fn differences(a: &serde_json::Value, b: &serde_json::Value) -> Vec<String> {
    fn differ(prefix: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
        match (a.as_object(), b.as_object()) {
            (Some(x), Some(y)) => {
                for (k, va) in x {
                    if prefix.is_empty() && (k == "steps" || k == "checkpoint_dir") {
                        continue;
                    }
                    let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    match y.get(k) {
                        Some(vb) => differ(&key, va, vb, out),
                        None => out.push(key),
                    }
                }
            }
            _ if a != b => out.push(format!("{prefix} = {a} (the checkpoint has {b})")),
            _ => {}
        }
    }
    let mut out = Vec::new();
    differ("", a, b, &mut out);
    out
}

/// The total steps of a resumed run: `--steps`, else the `--config` file's `steps` if it sets
/// them, else the checkpoint's.
pub fn resume_steps(args: &TrainArgs) -> Result<Option<u64>> {
    if args.steps.is_some() {
        return Ok(args.steps);
    }
    let Some(path) = &args.config else { return Ok(None) };
    let said: toml::Value =
        toml::from_str(&crate::io::read_text("config", path, 1 << 20)?).with_context(|| format!("invalid --config {}", path.display()))?;
    match said.get("steps") {
        Some(v) => Ok(Some(
            v.as_integer()
                .and_then(|x| u64::try_from(x).ok())
                .ok_or_else(|| anyhow::anyhow!("invalid --config {}: steps = {v}", path.display()))?,
        )),
        None => Ok(None),
    }
}

/// With `--resume`, a `--config` may only say what the checkpoint says (it is read for its
/// `checkpoint_dir`, and `steps` may raise the total): any other setting would be ignored.
pub fn check_resumed_config(args: &TrainArgs, resumed: &TrainConfig) -> Result<()> {
    // Flags may repeat the run's settings, not change them.
    let mut flagged = resumed.clone();
    apply_flags(args, &mut flagged)?;
    let changed = differences(&serde_json::to_value(&flagged)?, &serde_json::to_value(resumed)?);
    if !changed.is_empty() {
        bail!("--resume continues the checkpoint's run with its own settings; the flags would change {}", changed.join(", "));
    }
    let Some(path) = &args.config else { return Ok(()) };
    let text = crate::io::read_text("config", path, 1 << 20)?;
    toml::from_str::<TrainConfig>(&text).with_context(|| format!("invalid --config {}", path.display()))?;
    // Only what the file itself says (its missing keys are defaults, not settings).
    let said: toml::Value = toml::from_str(&text).with_context(|| format!("invalid --config {}", path.display()))?;
    let (a, b) = (serde_json::to_value(&said)?, serde_json::to_value(resumed)?);
    let diffs = differences(&a, &b);
    if !diffs.is_empty() {
        bail!(
            "--resume continues the checkpoint's run with its own settings; --config {} would change {}",
            path.display(),
            diffs.join(", ")
        );
    }
    Ok(())
}

/// Refuse a configuration this machine cannot hold (`copies`: processes that each build the
/// whole model), before anything is allocated.
pub fn check_fits(cfg: &TrainConfig, copies: u128) -> Result<()> {
    let need = cfg.memory_estimate().saturating_mul(copies);
    if let Some(have) = lazarus_control::launcher::physical_memory() {
        if need > have as u128 {
            let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
            bail!(
                "this run needs about {:.1} GiB ({} parameters{}, activations, data) and this machine has {:.1} GiB: lower --experts, --d-model, --d-ff, --layers, --batch-size or --seq-len",
                gib(need),
                cfg.model.parameter_count(),
                if copies > 1 { format!(", in {copies} processes") } else { String::new() },
                gib(have as u128)
            );
        }
    }
    Ok(())
}

/// `--checkpoint-dir`: a directory (created if missing) before training starts, not a file found
/// out at the first save.
fn check_checkpoint_dir(cfg: &TrainConfig) -> Result<()> {
    if cfg.checkpoint_every > 0 && cfg.checkpoint_dir.is_none() {
        bail!("--checkpoint-every needs --checkpoint-dir (or checkpoint_dir in --config)");
    }
    if let Some(dir) = &cfg.checkpoint_dir {
        if dir.exists() && !dir.is_dir() {
            bail!("invalid --checkpoint-dir: {} is not a directory", dir.display());
        }
        std::fs::create_dir_all(dir).with_context(|| format!("--checkpoint-dir: cannot create {}", dir.display()))?;
    }
    Ok(())
}

/// The configuration: defaults, then the TOML file, then flags.
pub fn build_config(args: &TrainArgs) -> Result<TrainConfig> {
    let mut c = match &args.config {
        Some(path) => {
            let text = crate::io::read_text("config", path, 1 << 20)?;
            toml::from_str::<TrainConfig>(&text).with_context(|| format!("invalid --config {}", path.display()))?
        }
        None => TrainConfig::default(),
    };
    apply_flags(args, &mut c)?;
    c.validate()?;
    Ok(c)
}

/// The settings flags on top of `c` (defaults or a `--config` file, or a resumed run's).
fn apply_flags(args: &TrainArgs, c: &mut TrainConfig) -> Result<()> {
    macro_rules! set {
        ($($flag:ident => $($field:ident).+),* $(,)?) => {
            $(if let Some(v) = args.$flag.clone() { c.$($field).+ = v; })*
        };
    }
    set!(steps => steps, batch_size => batch_size, seq_len => seq_len, lr => lr, min_lr => min_lr,
         warmup_steps => warmup_steps, d_model => model.d_model, layers => model.n_layers,
         heads => model.n_heads, experts => model.n_experts, top_k => model.top_k, d_ff => model.d_ff,
         moe_every => model.moe_every, aux_loss_coef => model.aux_loss_coef, seed => seed,
         checkpoint_every => checkpoint_every);
    if let Some(v) = &args.grad_clip {
        c.grad_clip = off_or("grad-clip", v)?;
    }
    if let Some(v) = &args.capacity_factor {
        c.model.capacity_factor = off_or("capacity-factor", v)?;
    }
    if let Some(p) = &args.routing_trace {
        c.routing_trace = Some(p.clone());
    }
    if let Some(p) = &args.checkpoint_dir {
        c.checkpoint_dir = Some(p.clone());
    }
    if let Some(seq) = args.seq_len {
        c.model.max_seq_len = c.model.max_seq_len.max(seq);
    }
    match (args.data.as_deref(), args.data_format.as_deref()) {
        (None, Some(f)) => bail!("--data-format {f} needs --data FILE"),
        (None | Some("synthetic"), fmt) => {
            if fmt.is_some_and(|f| f != "text") {
                bail!("invalid --data-format: {} (the synthetic corpus is text)", fmt.unwrap_or_default());
            }
            if args.data.is_some() && !matches!(c.data, DataSource::Synthetic { .. }) {
                c.data = TrainConfig::default().data;
            }
            if let Some(bytes) = args.synthetic_bytes {
                let DataSource::Synthetic { seed, .. } = c.data else {
                    bail!(
                        "--synthetic-bytes sizes the synthetic corpus, but the data is {} (from --config); drop one of them",
                        c.data.describe()
                    );
                };
                c.data = DataSource::Synthetic { seed, bytes };
            }
        }
        (Some(path), fmt) => {
            let paths: Vec<PathBuf> = path.split(',').map(PathBuf::from).collect();
            c.data = match fmt.unwrap_or("text") {
                "text" if paths.len() == 1 => DataSource::Text { path: paths[0].clone() },
                "text" => bail!("invalid --data: '{path}' (a text source is one file)"),
                "u16" => DataSource::Shards { paths, width: TokenWidth::U16 },
                "u32" => DataSource::Shards { paths, width: TokenWidth::U32 },
                other => bail!("invalid --data-format: '{other}' (expected text, u16 or u32)"),
            };
        }
    }
    if args.synthetic_bytes.is_some() && args.data.as_deref().is_some_and(|d| d != "synthetic") {
        bail!(
            "--synthetic-bytes sizes the synthetic corpus; --data {} reads a file instead: drop one of them",
            args.data.as_deref().unwrap_or_default()
        );
    }
    Ok(())
}

/// The configuration of a run that starts now: flags checked for combinations that would ignore
/// one, the checkpoint directory usable, the whole thing small enough for this machine with
/// `copies` processes holding the model.
pub fn setup_run(args: &TrainArgs, copies: u128) -> Result<TrainConfig> {
    args.check_combinations()?;
    let cfg = build_config(args)?;
    check_checkpoint_dir(&cfg)?;
    if !args.resume {
        check_fits(&cfg, copies)?;
    }
    Ok(cfg)
}

#[derive(Serialize)]
struct LogLine<'a> {
    step: u64,
    loss: f64,
    aux_loss: f64,
    tokens: u64,
    tokens_per_s: f64,
    expert_load: &'a [Vec<u64>],
}

pub fn run_train(args: &TrainArgs) -> Result<()> {
    let mut trainer = if args.resume {
        let config = setup_run(args, 1)?;
        let Some(dir) = config.checkpoint_dir.clone() else {
            bail!("--resume needs --checkpoint-dir (or checkpoint_dir in --config)");
        };
        let t = Trainer::resume(&dir, resume_steps(args)?).with_context(|| format!("resuming from {}", dir.display()))?;
        check_resumed_config(args, &t.config)?;
        tracing::info!("resumed from {} at step {}", dir.display(), t.step);
        t
    } else {
        Trainer::new(setup_run(args, 1)?)?
    };
    let cfg = trainer.config.clone();
    if trainer.done() {
        bail!("nothing to do: the run is at step {} of --steps {}", trainer.step, cfg.steps);
    }
    print_banner(&trainer, "single process");
    let mut reporter = Reporter::new(args, &cfg, trainer.step)?;
    while !trainer.done() {
        let t0 = Instant::now();
        let r = trainer.step()?;
        reporter.step(&r, t0.elapsed().as_secs_f64())?;
        if let Some(dir) = &cfg.checkpoint_dir {
            if cfg.checkpoint_every > 0 && r.step % cfg.checkpoint_every == 0 && r.step != cfg.steps {
                trainer.save_checkpoint(dir)?;
            }
        }
    }
    let saved = match &cfg.checkpoint_dir {
        Some(dir) => Some(trainer.save_checkpoint(dir)?),
        None => None,
    };
    reporter.finish(trainer.step, trainer.unigram_entropy(), saved.as_deref())
}

/// The first line of a run: model size, data and schedule.
pub fn print_banner(trainer: &Trainer, how: &str) {
    let cfg = &trainer.config;
    let params = trainer.model.params().num_elements();
    let expert_params = cfg.model.expert_params() * cfg.model.n_experts * cfg.model.moe_layers();
    tracing::info!(
        "lazarus train ({how}): {:.2}M parameters ({:.2}M in {} experts x {} MoE layers, top-{}), data {}, {} steps of {} x {} tokens",
        params as f64 / 1e6,
        expert_params as f64 / 1e6,
        cfg.model.n_experts,
        cfg.model.moe_layers(),
        cfg.model.top_k,
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
        Ok(Reporter {
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
        })
    }

    /// One finished step that took `seconds`.
    pub fn step(&mut self, r: &StepReport, seconds: f64) -> Result<()> {
        let tps = r.tokens as f64 / seconds.max(1e-9);
        self.tokens += r.tokens;
        self.first_loss.get_or_insert(r.loss);
        self.recent.push(r.loss);
        if self.recent.len() > 20 {
            self.recent.remove(0);
        }
        if let Some((path, w)) = self.log.as_mut() {
            let line = LogLine {
                step: r.step,
                loss: r.loss,
                aux_loss: r.aux_loss,
                tokens: r.tokens,
                tokens_per_s: tps,
                expert_load: &r.expert_load,
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
                tracing::info!("step {:>6}/{}  {msg}", r.step, self.total_steps);
            }
            None => {}
        }
        self.last = Some(r.clone());
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
        if let Some(p) = checkpoint {
            let _ = writeln!(out, "  checkpoint      {}", p.display());
        }
        crate::io::print(&out)
    }
}

#[derive(Args, Debug)]
pub struct BenchTrainArgs {
    /// Model and batch settings, as for `lazarus train` (defaults: the default model, 16 x 128).
    #[command(flatten)]
    train: TrainArgs,
    /// Measured forward+backward passes (after 2 warm-up steps).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    #[arg(long)]
    json: bool,
}

pub fn run_bench_train(args: &BenchTrainArgs) -> Result<()> {
    if args.iters == 0 {
        bail!("invalid --iters: 0 (must be at least 1)");
    }
    let config = build_config(&args.train)?;
    let r = lazarus_model::bench::train_benchmark(&config, 2, args.iters)?;
    if args.json {
        crate::io::println(&serde_json::to_string(&r)?)?;
    } else {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "model            {:.2}M parameters, batch {} x {} tokens, {} iterations",
            r.parameters as f64 / 1e6,
            r.batch_size,
            r.seq_len,
            r.iterations
        );
        let _ = writeln!(out, "forward+backward {:.0} tokens/s ({:.3} s per step)", r.tokens_per_s, r.step_s);
        let _ = writeln!(out, "expert FFNs      {:.3} s per step = {:.0}% of forward+backward", r.expert_ffn_s, 100.0 * r.expert_share);
        let _ = writeln!(out, "achieved         {:.1} GFLOP/s (matmul FLOPs {:.2e} per step)", r.model_gflops, r.flops_per_step);
        let _ = writeln!(out, "plain matmul     {:.1} GFLOP/s on the same shapes", r.matmul_gflops);
        let _ = writeln!(out, "ratio            {:.2} (goal >= 0.5)", r.ratio);
        crate::io::print(&out)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const CONFIG: &str = "steps = 500\nlr = 0.002\nbatch_size = 8\n[model]\nn_experts = 8\ntop_k = 2\ncapacity_factor = 1.25\n[data]\nkind = \"synthetic\"\nseed = 3\nbytes = 100000\n";

    #[test]
    fn the_sample_config_parses() {
        let c: TrainConfig = toml::from_str(CONFIG).unwrap();
        c.validate().unwrap();
        assert_eq!((c.steps, c.model.capacity_factor), (500, Some(1.25)));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        /// A damaged `--config` is an error or a valid configuration, never a panic; what
        /// validates has every size within the model's limits.
        #[test]
        fn damaged_configs_never_panic(edits in proptest::collection::vec((0usize..200, any::<u8>()), 1..6), cut in 0usize..200) {
            let mut text = CONFIG.as_bytes().to_vec();
            for (pos, byte) in edits {
                if pos < text.len() {
                    text[pos] = byte;
                }
            }
            text.truncate(cut.max(1).min(text.len()));
            if let Ok(s) = std::str::from_utf8(&text) {
                if let Ok(c) = toml::from_str::<TrainConfig>(s) {
                    if c.validate().is_ok() {
                        prop_assert!(c.model.parameter_count() < 1u128 << 64);
                    }
                }
            }
        }
    }
}
