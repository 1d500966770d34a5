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
    #[arg(long, default_value_t = lazarus_plan::DEFAULT_MAX_IMBALANCE)]
    pub max_imbalance: f64,
    /// With --workers: steps whose router loads plan the placement (forward only, before
    /// training; default 3, or the steps to train when fewer).
    #[arg(long)]
    pub profile_steps: Option<usize>,
    /// With --workers: the static expert-parallel baseline of DeepSpeed-MoE (experts split evenly
    /// over the workers, one replica each, all-to-all buffers padded to the largest load).
    #[arg(long)]
    pub static_ep: bool,
    /// With --workers: deadline of every collective, in seconds.
    #[arg(long, default_value_t = 30.0)]
    pub comm_timeout: f64,
}

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
}

/// The configuration: defaults, then the TOML file, then flags.
pub fn build_config(args: &TrainArgs) -> Result<TrainConfig> {
    let mut c = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("--config: cannot read {}", path.display()))?;
            toml::from_str::<TrainConfig>(&text).with_context(|| format!("--config {}", path.display()))?
        }
        None => TrainConfig::default(),
    };
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
        (None | Some("synthetic"), fmt) => {
            if fmt.is_some_and(|f| f != "text") && args.data.is_some() {
                bail!("invalid --data-format: {} (the synthetic corpus is text)", fmt.unwrap_or_default());
            }
            if let Some(bytes) = args.synthetic_bytes {
                let seed = match c.data {
                    DataSource::Synthetic { seed, .. } => seed,
                    _ => 0,
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
    c.validate()?;
    Ok(c)
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
        let config = build_config(args)?;
        let Some(dir) = config.checkpoint_dir.clone() else {
            bail!("--resume needs --checkpoint-dir (or checkpoint_dir in --config)");
        };
        let t = Trainer::resume(&dir, args.steps).with_context(|| format!("resuming from {}", dir.display()))?;
        tracing::info!("resumed from {} at step {}", dir.display(), t.step);
        t
    } else {
        Trainer::new(build_config(args)?)?
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
