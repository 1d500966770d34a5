//! The flags of `lazarus train`, the configuration they build (defaults, then a TOML file, then
//! flags), and the checks that no flag is silently ignored and the run fits this machine.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use lazarus_model::{DataSource, TokenWidth, TrainConfig};

/// The model, its data and its optimiser: what every command that builds the model takes
/// (`train`, `controller`, `bench train`, `bench recovery`), defaults first, then a TOML file,
/// then these flags.
#[derive(Args, Debug, Default, Clone)]
pub struct ModelArgs {
    /// TOML file with any of the settings below (flags override it); `lazarus controller`
    /// also reads its `[controller]` table (docs/usage.md, deploy/lazarus.toml).
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// The tables of the `--config` file this command reads besides the training settings
    /// (`controller` for `lazarus controller`); another command's table is refused.
    #[arg(skip)]
    pub(crate) config_tables: &'static [&'static str],
    /// Sequences per step (the constant global batch).
    #[arg(long)]
    pub(crate) batch_size: Option<usize>,
    /// Tokens per sequence (the context a step trains on).
    #[arg(long)]
    pub(crate) seq_len: Option<usize>,
    /// Peak learning rate.
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) lr: Option<f64>,
    /// The learning rate the cosine schedule ends at.
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) min_lr: Option<f64>,
    /// Steps of linear warm-up to the peak learning rate.
    #[arg(long)]
    pub(crate) warmup_steps: Option<u64>,
    /// Clip the global gradient norm ("off" disables).
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) grad_clip: Option<String>,
    /// Width of the model (the residual stream).
    #[arg(long)]
    pub(crate) d_model: Option<usize>,
    /// Transformer blocks.
    #[arg(long)]
    pub(crate) layers: Option<usize>,
    /// Attention heads (a divisor of --d-model).
    #[arg(long)]
    pub(crate) heads: Option<usize>,
    /// Vocabulary size (default 256, the byte tokenizer's, or --tokenizer's; token shards may
    /// need more).
    #[arg(long)]
    pub(crate) vocab_size: Option<usize>,
    /// A Hugging Face tokenizer.json for text data (and held-out text, and prompts); the
    /// vocabulary becomes its size. Default: bytes. `lazarus tokenizer` makes one.
    #[arg(long, value_name = "FILE")]
    pub(crate) tokenizer: Option<PathBuf>,
    /// Experts per MoE layer.
    #[arg(long)]
    pub(crate) experts: Option<usize>,
    /// Experts per token (1 to 8).
    #[arg(long)]
    pub(crate) top_k: Option<usize>,
    /// Whether a token's k > 1 router weights are renormalised to sum to 1 (default true, as
    /// Mixtral; false keeps each softmax probability, as Qwen-MoE and OLMoE).
    #[arg(long, value_name = "true|false")]
    pub(crate) normalize_top_k: Option<bool>,
    /// Always-on shared experts beside the routed ones in every MoE block (DeepSeek-MoE).
    #[arg(long)]
    pub(crate) shared_experts: Option<usize>,
    /// The blocks' options at once: gpt (LayerNorm, learned positions, GELU, biases: the
    /// default) or mixtral (RMSNorm, rotary positions θ = 10⁶, SwiGLU experts, no biases,
    /// normalised top-k, no shared experts); the flags below and above change single options.
    #[arg(long, value_name = "gpt|mixtral")]
    pub(crate) arch: Option<String>,
    /// The blocks' norm.
    #[arg(long, value_name = "layer|rms")]
    pub(crate) norm: Option<String>,
    /// Learned position table, or rotary positions on the queries and keys.
    #[arg(long, value_name = "learned|rope")]
    pub(crate) positions: Option<String>,
    /// The rotary base θ (10000 by default; 1000000 with --arch mixtral).
    #[arg(long)]
    pub(crate) rope_theta: Option<f64>,
    /// The experts' (and shared and dense FFNs') activation.
    #[arg(long, value_name = "gelu|swiglu")]
    pub(crate) expert_act: Option<String>,
    /// Biases on the attention's projections.
    #[arg(long, value_name = "true|false")]
    pub(crate) attn_bias: Option<bool>,
    /// Biases on the FFNs (experts, shared experts, dense blocks).
    #[arg(long, value_name = "true|false")]
    pub(crate) ffn_bias: Option<bool>,
    /// Hidden width of each expert.
    #[arg(long)]
    pub(crate) d_ff: Option<usize>,
    /// An MoE layer every this many blocks (1 = every block).
    #[arg(long)]
    pub(crate) moe_every: Option<usize>,
    /// Weight of the load-balancing loss (Switch Transformer's auxiliary loss).
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) aux_loss_coef: Option<f64>,
    /// Expert capacity as a multiple of the even share ("off" = dropless, the default).
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) capacity_factor: Option<String>,
    /// Seed of the weights and the sampling order.
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// "synthetic" (built-in corpus), a UTF-8 text file, or token shards (comma-separated .bin).
    #[arg(long)]
    pub(crate) data: Option<String>,
    /// Format of --data files: text, jsonl ({"text": …} a line), u16 or u32.
    #[arg(long)]
    pub(crate) data_format: Option<String>,
    /// Size of the synthetic corpus in bytes.
    #[arg(long)]
    pub(crate) synthetic_bytes: Option<usize>,
    /// Replace the router's choices with per-layer loads from this JSON file.
    #[arg(long, value_name = "FILE")]
    pub(crate) routing_trace: Option<PathBuf>,
    /// Where the model trains: cpu (default), or cuda / cuda:N (the N-th NVIDIA GPU; a build
    /// with the `cuda` feature). With --workers, `cuda` puts a node's i-th worker on GPU i mod
    /// the visible GPUs (several workers may share one).
    #[arg(long, value_name = "cpu|cuda[:N]")]
    pub device: Option<String>,
    /// Precision: f32 (default), or bf16 mixed precision (matrix products in bf16; parameters,
    /// AdamW state, norms, softmaxes and the loss in f32). Single-process runs only, so far.
    #[arg(long, value_name = "f32|bf16")]
    pub(crate) dtype: Option<String>,
}

/// `lazarus train`'s flags (and `lazarus controller`'s training flags): the model's, a run's
/// (its length, what it keeps, where it logs) and its worker processes'.
#[derive(Args, Debug, Default, Clone)]
pub struct TrainArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Total optimizer steps.
    #[arg(long)]
    pub(crate) steps: Option<u64>,
    /// Directory for checkpoints (written at the end and every --checkpoint-every steps).
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Start from the weights of a Hugging Face Mixtral directory (config.json +
    /// model.safetensors, as `lazarus export --format hf` writes): the model's shape and options
    /// are its; a model flag that says otherwise is an error naming it.
    #[arg(long, value_name = "DIR", conflicts_with = "resume")]
    pub(crate) init_from: Option<PathBuf>,
    /// With --checkpoint-dir: a checkpoint every this many steps too.
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// Keep the newest N checkpoints in --checkpoint-dir (0: every one; default 3).
    #[arg(long, value_name = "N")]
    keep_checkpoints: Option<usize>,
    /// Continue from the latest checkpoint in --checkpoint-dir.
    #[arg(long)]
    pub(crate) resume: bool,
    /// --resume if --checkpoint-dir holds a run's checkpoints, else start a new run there: for a
    /// job its scheduler starts again (a requeued batch job, a controller pod made again).
    #[arg(long, conflicts_with_all = ["resume", "overwrite_checkpoints"])]
    pub(crate) resume_if_any: bool,
    /// Start a new run in a --checkpoint-dir that holds another run's checkpoints (they are
    /// replaced as the new run saves its own).
    #[arg(long)]
    pub(crate) overwrite_checkpoints: bool,
    /// Append one JSON object per step to this file.
    #[arg(long, value_name = "FILE")]
    pub(super) json_log: Option<PathBuf>,
    /// No progress bar or per-step lines, only the summary.
    #[arg(long)]
    pub quiet: bool,
    /// Held-out data to evaluate the model on (a text file, JSON lines or token shards; see
    /// --eval-data-format): its loss and perplexity over windows taken in order, in the
    /// progress, the --json-log and the summary.
    #[arg(long, value_name = "FILE")]
    pub eval_data: Option<String>,
    /// Format of --eval-data: text, jsonl, u16 or u32 (default: jsonl for a .jsonl file, text
    /// for a .txt file, else --data-format's).
    #[arg(long, value_name = "FORMAT")]
    pub eval_data_format: Option<String>,
    /// With --eval-data: evaluate every this many steps (default: at the end only).
    #[arg(long, value_name = "STEPS")]
    pub eval_every: Option<u64>,
    /// With --eval-data: windows of --seq-len tokens evaluated, from the start (default 64).
    #[arg(long, value_name = "N")]
    pub eval_windows: Option<usize>,
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
    /// With --workers: every step's result has the same bits on any number of workers and
    /// through any failure, join, drain or move (the batch in shards of one sequence, a
    /// shard's tokens whole to one expert replica, every gradient an exact sum); slower.
    #[arg(long)]
    pub deterministic: bool,
    /// With --deterministic: sequences in a shard, a divisor of --batch-size (default 1). The
    /// bits depend on it, not on the workers; larger shards run faster.
    #[arg(long)]
    pub shard_sequences: Option<usize>,
    /// With --workers: deadline of every collective, in seconds (default 30).
    #[arg(long)]
    pub comm_timeout: Option<f64>,
    /// With --workers: recover from lost workers and go on training (default on; off: the
    /// first failure ends the run).
    #[arg(long, value_name = "on|off", value_parser = parse_on_off)]
    pub recovery: Option<bool>,
    /// With --workers: a worker not heard from for this many seconds is lost (and killed if it
    /// only hangs); default 1.
    #[arg(long, value_name = "SECONDS")]
    pub lease: Option<f64>,
    /// With --workers: seconds between a worker's heartbeats (default 0.2, below the lease).
    #[arg(long, value_name = "SECONDS")]
    pub heartbeat: Option<f64>,
    /// With --workers and recovery: every this many steps the controller weighs a new plan
    /// from the expert loads measured since the last one and applies it, at a step boundary,
    /// when its predicted gain repays its move (default 200; 0: never).
    #[arg(long, value_name = "STEPS")]
    pub rebalance_every: Option<u64>,
    /// With --workers and recovery: bytes per second of the link given to snapshots of experts
    /// into another node's memory after each step (the budget of a step is this times the
    /// previous step's seconds); an expert that loses every replica is restored from its
    /// snapshot instead of rolling the job back. Default: paced by what each round costs — the
    /// snapshot threads' CPU kept under 0.5% of the workers', every round on the wire within a
    /// step — from one expert a step up to 625e6 (5 Gb/s); 0: no snapshots.
    #[arg(long, value_name = "BYTES_PER_S")]
    pub snapshot_bandwidth: Option<f64>,
    /// With --workers and recovery: the ceiling of the paced default snapshot budget, in bytes
    /// per second of the link (default 625e6, 5 Gb/s): raise it on a fast network, where a host
    /// with CPU to spare can snapshot more each step.
    #[arg(long, value_name = "BYTES_PER_S", conflicts_with = "snapshot_bandwidth")]
    pub snapshot_ceiling: Option<f64>,
    /// With --gpus-per-node: replay node failures and arrivals on the local agents — a trace in
    /// Bamboo's format (`ms,add|remove,node` lines), or a generator: `fail-every:EVERY[:SEED]`
    /// (one node fails every EVERY until half remain), `poisson:MTBF:REPAIR:DURATION[:SEED]`
    /// (each node fails after an exponential time, comes back REPAIR later). Nodes present at
    /// the start must be --workers / --gpus-per-node.
    #[arg(long, value_name = "FILE|GENERATOR")]
    pub replay: Option<String>,
    /// With --replay: multiply the trace's times by this (e.g. 0.01: an hour in 36 s); the
    /// paper's 2-minute wait before joiners are taken in is scaled alike (default 1).
    #[arg(long, value_name = "FACTOR")]
    pub replay_scale: Option<f64>,
    /// With --replay: a node that goes is given notice (SIGTERM: drained) instead of killed.
    #[arg(long)]
    pub replay_notice: bool,
    /// With --workers and recovery: where the controller answers `lazarus status` (default
    /// 127.0.0.1:0, any free loopback port; "off": nowhere).
    #[arg(long, value_name = "ADDR|off")]
    pub status_listen: Option<String>,
    /// With --workers: serve the job's metrics for Prometheus at http://ADDR/metrics (step,
    /// loss, tokens/s, epoch, members by state, reconfigurations by cause, recovery times,
    /// bytes moved, snapshot bytes, seconds since the last checkpoint).
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,
    /// With --metrics-listen: a scrape must carry `Authorization: Bearer TOKEN`, TOKEN the
    /// file's first line (Prometheus: `authorization: {credentials_file: FILE}`); without it
    /// anyone who reaches ADDR may scrape.
    #[arg(long, value_name = "FILE")]
    pub metrics_token_file: Option<PathBuf>,
    /// With --workers: encrypt the workers' connections to each other (AES-256-GCM, a key per
    /// connection derived from the job's secret). Without it they are authenticated at the
    /// rendezvous and travel in clear.
    #[arg(long)]
    pub encrypt_data: bool,
    /// With --workers: run the workers through N/G node agents (`lazarus agent` processes on
    /// loopback, G workers each) attached to the embedded controller over gRPC; a node of G
    /// workers is the unit of failure and of placement. (`lazarus controller`: the GPUs every
    /// agent brings, default 1.)
    #[arg(long, value_name = "G")]
    pub gpus_per_node: Option<usize>,
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("{other:?} (expected on or off)")),
    }
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
    pub(super) fn worker_flags(&self) -> Vec<&'static str> {
        let given: [(&'static str, bool); 23] = [
            ("--metrics-listen", self.metrics_listen.is_some()),
            ("--metrics-token-file", self.metrics_token_file.is_some()),
            ("--encrypt-data", self.encrypt_data),
            ("--rebalance-every", self.rebalance_every.is_some()),
            ("--snapshot-bandwidth", self.snapshot_bandwidth.is_some()),
            ("--snapshot-ceiling", self.snapshot_ceiling.is_some()),
            ("--replay", self.replay.is_some()),
            ("--replay-scale", self.replay_scale.is_some()),
            ("--replay-notice", self.replay_notice),
            ("--gpus-per-node", self.gpus_per_node.is_some()),
            ("--recovery", self.recovery.is_some()),
            ("--status-listen", self.status_listen.is_some()),
            ("--lease", self.lease.is_some()),
            ("--heartbeat", self.heartbeat.is_some()),
            ("--placement-file", self.placement_file.is_some()),
            ("--slots-per-worker", self.slots_per_worker.is_some()),
            ("--max-imbalance", self.max_imbalance.is_some()),
            ("--profile-steps", self.profile_steps.is_some()),
            ("--static-ep", self.static_ep),
            ("--deterministic", self.deterministic),
            ("--shard-sequences", self.shard_sequences.is_some()),
            ("--comm-timeout", self.comm_timeout.is_some()),
            ("--workers", self.workers.is_some()),
        ];
        given.into_iter().filter(|(_, g)| *g).map(|(f, _)| f).collect()
    }

    /// The flags of a benchmark that builds the model and runs `steps` (None: its own count)
    /// of it, keeping nothing: the model's, and no run's or workers' settings.
    pub(super) fn of_model(model: ModelArgs, steps: Option<u64>) -> Self {
        TrainArgs { model, steps, ..TrainArgs::default() }
    }

    /// No flag is silently ignored: refuse the combinations that would ignore one.
    pub fn check_combinations(&self) -> Result<()> {
        if self.uses_workers() && self.model.dtype.as_deref().is_some_and(|d| d != "f32") {
            bail!(
                "--dtype {} with --workers: the workers compute in f32 so far (bf16 trains single-process runs)",
                self.model.dtype.as_deref().unwrap_or_default()
            );
        }
        if let Some(d) = self.model.device.as_deref() {
            // The value and the build are checked here, before any worker starts; whether the
            // machine has the GPU, when a process opens it (its error names the device).
            lazarus_model::device::check(d)?;
        }
        if !self.uses_workers() {
            if let Some(f) = self.worker_flags().first() {
                bail!("{f} needs --workers N (it configures multi-worker training)");
            }
        }
        if self.replay.is_none() {
            for (flag, given) in [("--replay-scale", self.replay_scale.is_some()), ("--replay-notice", self.replay_notice)] {
                if given {
                    bail!("{flag} needs --replay SOURCE (it sets how the failure trace is replayed)");
                }
            }
        }
        if self.eval_data.is_none() {
            for (flag, given) in [
                ("--eval-every", self.eval_every.is_some()),
                ("--eval-windows", self.eval_windows.is_some()),
                ("--eval-data-format", self.eval_data_format.is_some()),
            ] {
                if given {
                    bail!("{flag} needs --eval-data FILE (the held-out data it evaluates)");
                }
            }
        }
        if self.shard_sequences.is_some() && !self.deterministic {
            bail!("--shard-sequences needs --deterministic (it cuts a deterministic step's batch)");
        }
        if self.deterministic && self.static_ep {
            bail!("--deterministic with --static-ep: static expert parallelism has its own dispatch (give one)");
        }
        if self.eval_every == Some(0) {
            bail!("invalid --eval-every: 0 (a number of steps; leave it out to evaluate at the end only)");
        }
        if let Some(w) = self.eval_windows.filter(|&w| w == 0 || w > lazarus_model::eval::MAX_EVAL_WINDOWS) {
            bail!("invalid --eval-windows: {w} (1 to {})", lazarus_model::eval::MAX_EVAL_WINDOWS);
        }
        Ok(())
    }
}

/// `cmd` with the default of every training setting in its help, for each subcommand that
/// takes the training flags. The flags are options — given or not, so that a `--config` file's
/// value stands where a flag is not given — and clap cannot show what they fall back to; the
/// values are read from the one home of the defaults, `TrainConfig::default()`.
pub fn show_defaults(cmd: clap::Command) -> clap::Command {
    let defaults = training_defaults();
    let mut cmd = cmd;
    for sub in ["train", "controller"] {
        cmd = cmd.mut_subcommand(sub, |c| with_defaults(c, &defaults));
    }
    cmd.mut_subcommand("bench", |b| b.mut_subcommand("train", |c| with_defaults(c, &defaults)))
}

/// `c` with `[default: …]` after the help of each flag of `defaults` it has, unless its help
/// says its default already.
pub fn with_defaults(mut c: clap::Command, defaults: &[(&'static str, String)]) -> clap::Command {
    for (id, value) in defaults {
        let Some(arg) = c.get_arguments().find(|a| a.get_id() == *id) else { continue };
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        if help.to_lowercase().contains("default") {
            continue;
        }
        let help = if help.is_empty() { format!("[default: {value}]") } else { format!("{help} [default: {value}]") };
        c = c.mut_arg(*id, |a| a.help(help));
    }
    c
}

/// Each training setting's flag (by its clap id, the field's name) with its default.
pub fn training_defaults() -> Vec<(&'static str, String)> {
    let c = TrainConfig::default();
    let m = &c.model;
    // Enums as their TOML spelling, `None` as off.
    fn word(v: impl serde::Serialize) -> String {
        match serde_json::to_value(v).unwrap_or_default() {
            serde_json::Value::String(s) => s,
            serde_json::Value::Null => "off".into(),
            other => other.to_string(),
        }
    }
    let synthetic = match c.data {
        DataSource::Synthetic { bytes, .. } => bytes.to_string(),
        _ => "0".into(),
    };
    vec![
        ("steps", c.steps.to_string()),
        ("batch_size", c.batch_size.to_string()),
        ("seq_len", c.seq_len.to_string()),
        ("lr", word(c.lr)),
        ("min_lr", word(c.min_lr)),
        ("warmup_steps", c.warmup_steps.to_string()),
        ("grad_clip", word(c.grad_clip)),
        ("seed", c.seed.to_string()),
        ("checkpoint_every", format!("{} (only at the end)", c.checkpoint_every)),
        ("keep_checkpoints", c.keep_checkpoints.to_string()),
        ("d_model", m.d_model.to_string()),
        ("layers", m.n_layers.to_string()),
        ("heads", m.n_heads.to_string()),
        ("experts", m.n_experts.to_string()),
        ("top_k", m.top_k.to_string()),
        ("d_ff", m.d_ff.to_string()),
        ("moe_every", m.moe_every.to_string()),
        ("shared_experts", m.shared_experts.to_string()),
        ("norm", word(m.norm)),
        ("positions", word(m.positions)),
        ("expert_act", word(m.expert_act)),
        ("attn_bias", m.attn_bias.to_string()),
        ("ffn_bias", m.ffn_bias.to_string()),
        ("aux_loss_coef", word(m.aux_loss_coef)),
        ("capacity_factor", word(m.capacity_factor)),
        ("data", "synthetic".into()),
        ("data_format", "text".into()),
        ("synthetic_bytes", synthetic),
        ("dtype", word(c.dtype)),
    ]
}

/// The settings where `a` differs from `b` (the keys of `a`, dotted), as `key = a (WHOSE has
/// b)`, leaving out `steps` and `checkpoint_dir` (a resumed run may change those).
fn differences(a: &serde_json::Value, b: &serde_json::Value, whose: &str) -> Vec<String> {
    fn differ(prefix: &str, a: &serde_json::Value, b: &serde_json::Value, whose: &str, out: &mut Vec<String>) {
        match (a.as_object(), b.as_object()) {
            (Some(x), Some(y)) => {
                for (k, va) in x {
                    if prefix.is_empty() && (k == "steps" || k == "checkpoint_dir") {
                        continue;
                    }
                    let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    match y.get(k) {
                        Some(vb) => differ(&key, va, vb, whose, out),
                        None => out.push(key),
                    }
                }
            }
            _ if a != b => out.push(format!("{prefix} = {a} ({whose} has {b})")),
            _ => {}
        }
    }
    let mut out = Vec::new();
    differ("", a, b, whose, &mut out);
    out
}

/// The `--config` file's training settings: the file without the tables of commands (a
/// deployment's one file may hold `[agent]` for its agents; `[controller]` is refused where
/// the command is not `lazarus controller`, which reads it itself).
fn config_text(args: &TrainArgs, path: &Path) -> Result<String> {
    let text = crate::io::read_text("config", path, 1 << 20)?;
    let mut table: toml::Table = toml::from_str(&text).with_context(|| format!("invalid --config {}", path.display()))?;
    if table.contains_key("controller") && !args.model.config_tables.contains(&"controller") {
        bail!(
            "invalid --config {}: its [controller] table holds `lazarus controller`'s settings, which this command does not use",
            path.display()
        );
    }
    table.remove("controller");
    table.remove("agent");
    Ok(toml::to_string(&table)?)
}

/// The total steps of a resumed run: `--steps`, else the `--config` file's `steps` if it sets
/// them, else the checkpoint's.
pub fn resume_steps(args: &TrainArgs) -> Result<Option<u64>> {
    if args.steps.is_some() {
        return Ok(args.steps);
    }
    let Some(path) = &args.model.config else { return Ok(None) };
    let said: toml::Value = toml::from_str(&config_text(args, path)?).with_context(|| format!("invalid --config {}", path.display()))?;
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
    check_unchanged(args, resumed, "--resume continues the checkpoint's run", "the checkpoint")
}

/// Refuse flags or a `--config` file that would change the settings of a run taken up again
/// (`how` it is taken up, `whose` settings they are): flags may repeat them, not change them —
/// a change would otherwise be ignored without a word.
pub fn check_unchanged(args: &TrainArgs, resumed: &TrainConfig, how: &str, whose: &str) -> Result<()> {
    let mut flagged = resumed.clone();
    apply_flags(args, &mut flagged)?;
    let changed = differences(&serde_json::to_value(&flagged)?, &serde_json::to_value(resumed)?, whose);
    if !changed.is_empty() {
        bail!("{how} with its own settings; the flags would change {}", changed.join(", "));
    }
    let Some(path) = &args.model.config else { return Ok(()) };
    let text = config_text(args, path)?;
    toml::from_str::<TrainConfig>(&text).with_context(|| format!("invalid --config {}", path.display()))?;
    // Only what the file itself says (its missing keys are defaults, not settings).
    let said: toml::Value = toml::from_str(&text).with_context(|| format!("invalid --config {}", path.display()))?;
    let (a, b) = (serde_json::to_value(&said)?, serde_json::to_value(resumed)?);
    let diffs = differences(&a, &b, whose);
    if !diffs.is_empty() {
        bail!("{how} with its own settings; --config {} would change {}", path.display(), diffs.join(", "));
    }
    Ok(())
}

/// Refuse a configuration this machine cannot hold (`copies`: processes that each build the
/// whole model), before anything is allocated.
pub fn check_fits(cfg: &TrainConfig, copies: u128) -> Result<()> {
    let what = format!(
        "this run ({} parameters{}, activations, data)",
        cfg.model.parameter_count(),
        if copies > 1 { format!(", in {copies} processes") } else { String::new() }
    );
    crate::io::check_memory(
        cfg.memory_estimate().saturating_mul(copies),
        &what,
        "--experts, --d-model, --d-ff, --layers, --batch-size or --seq-len",
    )
}

/// `--checkpoint-dir`: a directory (created if missing) before training starts, not a file found
/// out at the first save.
fn check_checkpoint_dir(cfg: &TrainConfig, resume: bool, overwrite: bool) -> Result<()> {
    if resume && overwrite {
        bail!("--overwrite-checkpoints starts a new run, --resume goes on with the saved one: give one of them");
    }
    if cfg.checkpoint_every > 0 && cfg.checkpoint_dir.is_none() {
        bail!("--checkpoint-every needs --checkpoint-dir (or checkpoint_dir in --config)");
    }
    if let Some(dir) = &cfg.checkpoint_dir {
        if dir.exists() && !dir.is_dir() {
            bail!("invalid --checkpoint-dir: {} is not a directory", dir.display());
        }
        if resume {
            if !dir.is_dir() {
                bail!("--resume: {} does not exist (no checkpoint to continue)", dir.display());
            }
        } else {
            // A checkpoint is no place for another run's: --resume goes on from it.
            if dir.join(lazarus_model::checkpoint::MANIFEST_FILE).exists() {
                bail!(
                    "--checkpoint-dir {} is a checkpoint, not a run's directory: add --resume to go on from it, or give \
                     another directory for a new run",
                    dir.display()
                );
            }
            // A fresh run would replace another run's checkpoints and move `latest` back.
            if let Some(held) = lazarus_model::checkpoint::held_checkpoint(dir).filter(|_| !overwrite) {
                bail!(
                    "--checkpoint-dir {} holds the checkpoints of a run (latest: {held}): add --resume to go on with it, or \
                     --overwrite-checkpoints to start a new run over them",
                    dir.display(),
                );
            }
            std::fs::create_dir_all(dir).with_context(|| format!("--checkpoint-dir: cannot create {}", dir.display()))?;
        }
        // The directory the run writes in (a resumed step's run's).
        lock_checkpoint_dir(&lazarus_model::checkpoint::run_dir_of(dir))?;
    }
    Ok(())
}

/// Hold `DIR/.lock` (flock) for the life of this process: two runs writing one checkpoint
/// directory would replace each other's checkpoints and `latest`.
fn lock_checkpoint_dir(dir: &Path) -> Result<()> {
    use std::io::{Read, Seek, Write};
    use std::os::unix::io::AsRawFd;
    static HELD: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
    let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    let key = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    if held.contains(&key) {
        return Ok(());
    }
    let path = dir.join(".lock");
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("--checkpoint-dir: cannot open {}", path.display()))?;
    // SAFETY: flock on a descriptor this function owns.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let mut owner = String::new();
        let _ = f.read_to_string(&mut owner);
        let owner = owner.trim();
        let who = if owner.is_empty() { "another run".to_string() } else { format!("another run (pid {owner})") };
        bail!("--checkpoint-dir {}: {who} is writing checkpoints there", dir.display());
    }
    let _ = f.set_len(0).and_then(|_| f.rewind()).and_then(|_| write!(f, "{}", std::process::id()));
    // Kept open (and locked) until this process ends; the kernel releases it however it ends.
    std::mem::forget(f);
    held.push(key);
    Ok(())
}

/// The configuration: defaults, then the TOML file, then flags.
pub fn build_config(args: &TrainArgs) -> Result<TrainConfig> {
    // Where a rotary base was said, if anywhere: with learned positions it would do nothing.
    let mut theta_said = args.model.rope_theta.map(|t| format!("--rope-theta {t}"));
    let mut c = match &args.model.config {
        Some(path) => {
            let mut table: toml::Table =
                toml::from_str(&config_text(args, path)?).with_context(|| format!("invalid --config {}", path.display()))?;
            if let Some(t) = table.get("model").and_then(|m| m.get("rope_theta")).filter(|_| theta_said.is_none()) {
                theta_said = Some(format!("rope_theta = {t} in --config {}", path.display()));
            }
            let preset = take_arch(&mut table).with_context(|| format!("invalid --config {}", path.display()))?;
            let mut c = table.try_into::<TrainConfig>().with_context(|| format!("invalid --config {}", path.display()))?;
            if let Some((arch, said)) = preset {
                c.model = with_arch_under(c.model, arch, &said);
            }
            c
        }
        None => TrainConfig::default(),
    };
    apply_flags(args, &mut c)?;
    apply_init_from(args, &mut c)?;
    if let Some(said) = theta_said.filter(|_| c.model.positions != lazarus_model::config::Positions::Rope) {
        bail!("{said}: the model's positions are learned, with no rotary base (--positions rope, or --arch mixtral, uses one)");
    }
    size_vocabulary(args, &mut c)?;
    c.validate()?;
    Ok(c)
}

/// With `--init-from DIR` (or `init_from` in the file) the model is DIR's: each shape and block
/// option taken from it, unless a flag or the file gave another value than the default, which is
/// an error naming it (the training-only settings — aux loss, capacity factor — stay ours).
fn apply_init_from(args: &TrainArgs, c: &mut TrainConfig) -> Result<()> {
    if let Some(dir) = &args.init_from {
        c.init_from = Some(dir.clone());
    }
    let Some(dir) = c.init_from.clone() else { return Ok(()) };
    if !lazarus_model::hf::is_hf_dir(&dir) {
        bail!(
            "invalid --init-from: {} holds no config.json beside a model.safetensors or {} (a Hugging Face model directory)",
            dir.display(),
            lazarus_model::hf::INDEX_FILE
        );
    }
    let theirs = lazarus_model::hf::read_config(&dir).context("--init-from")?;
    let default = lazarus_model::ModelConfig::default();
    let ours = &c.model;
    let m = &args.model;
    // A field is said when its flag is given (or --arch, for the block options) or the file
    // gave it another value than the default.
    let blocks = m.arch.is_some();
    macro_rules! first_said_otherwise {
        ($($field:ident => $flag:literal if $given:expr),*) => {
            [$((($given || ours.$field != default.$field) && ours.$field != theirs.$field).then(|| {
                format!("--{} {:?} (the model in {} has {:?})", $flag, ours.$field, dir.display(), theirs.$field)
            })),*].into_iter().flatten().next()
        };
    }
    let clash = first_said_otherwise!(vocab_size => "vocab-size" if m.vocab_size.is_some(), d_model => "d-model" if m.d_model.is_some(),
        n_layers => "layers" if m.layers.is_some(), n_heads => "heads" if m.heads.is_some(), n_experts => "experts" if m.experts.is_some(),
        top_k => "top-k" if m.top_k.is_some(), d_ff => "d-ff" if m.d_ff.is_some(), moe_every => "moe-every" if m.moe_every.is_some(),
        shared_experts => "shared-experts" if blocks || m.shared_experts.is_some(), norm => "norm" if blocks || m.norm.is_some(),
        positions => "positions" if blocks || m.positions.is_some(), expert_act => "expert-act" if blocks || m.expert_act.is_some(),
        attn_bias => "attn-bias" if blocks || m.attn_bias.is_some(), ffn_bias => "ffn-bias" if blocks || m.ffn_bias.is_some(),
        normalize_top_k => "normalize-top-k" if blocks || m.normalize_top_k.is_some(),
        rope_theta => "rope-theta" if blocks || m.rope_theta.is_some());
    if let Some(clash) = clash {
        bail!("--init-from: the model is the directory's, but {clash}");
    }
    c.model = lazarus_model::ModelConfig { aux_loss_coef: c.model.aux_loss_coef, capacity_factor: c.model.capacity_factor, ..theirs };
    if args.model.seq_len.is_none() {
        c.seq_len = c.seq_len.min(c.model.max_seq_len);
    }
    adopt_model_tokenizer(c, &dir)
}

/// The tokenizer of the model in `dir` (its `tokenizer.json`) for text data when no other was
/// given: the model's token ids are that tokenizer's, and reading its text as bytes would train
/// it on other ids without a word. Without one, text data is refused unless the model's
/// vocabulary is the bytes' own.
fn adopt_model_tokenizer(c: &mut TrainConfig, dir: &Path) -> Result<()> {
    if c.tokenizer.is_some() || matches!(c.data, DataSource::Shards { .. }) {
        return Ok(());
    }
    let theirs = dir.join("tokenizer.json");
    if theirs.is_file() {
        tracing::info!("--init-from: the text is tokenized by the model's own {}", theirs.display());
        c.tokenizer = Some(theirs);
        return Ok(());
    }
    let bytes = lazarus_model::data::ByteTokenizer::VOCAB;
    if c.model.vocab_size != bytes {
        bail!(
            "--init-from: the model in {} has a vocabulary of {} tokens but no tokenizer.json beside it, and {} is text: \
             give --tokenizer FILE (the tokenizer the model was trained with), or token shards (--data-format u16|u32)",
            dir.display(),
            c.model.vocab_size,
            c.data.describe()
        );
    }
    Ok(())
}

/// The `[model]` table's `arch` key, taken out of it, with the keys the table sets itself (they
/// override the preset's).
fn take_arch(table: &mut toml::Table) -> Result<Option<(lazarus_model::config::Arch, Vec<String>)>> {
    let Some(toml::Value::Table(model)) = table.get_mut("model") else { return Ok(None) };
    let Some(arch) = model.remove("arch") else { return Ok(None) };
    let arch = match arch {
        toml::Value::String(a) => {
            choice("arch", &a, "gpt or mixtral").map_err(|_| anyhow::anyhow!("model.arch = '{a}' (expected gpt or mixtral)"))?
        }
        other => bail!("model.arch = {other} (expected \"gpt\" or \"mixtral\")"),
    };
    Ok(Some((arch, model.keys().cloned().collect())))
}

/// `model` with the options of `arch` wherever the file did not set them itself.
fn with_arch_under(model: lazarus_model::ModelConfig, arch: lazarus_model::config::Arch, said: &[String]) -> lazarus_model::ModelConfig {
    let preset = model.clone().with_arch(arch);
    let mut m = model;
    macro_rules! unless_said {
        ($($field:ident),*) => {
            $(if !said.iter().any(|k| k == stringify!($field)) { m.$field = preset.$field.clone(); })*
        };
    }
    unless_said!(norm, positions, rope_theta, expert_act, attn_bias, ffn_bias, normalize_top_k, shared_experts, moe_every);
    m
}

/// With a tokenizer the model's vocabulary is the tokenizer's, unless `--vocab-size` asks for
/// more (never fewer: its tokens would fall outside).
fn size_vocabulary(args: &TrainArgs, c: &mut TrainConfig) -> Result<()> {
    let Some(path) = &c.tokenizer else { return Ok(()) };
    let have = lazarus_model::tokenizer::TextTokenizer::open(Some(path)).context("--tokenizer")?.vocab_size();
    if let Some(dir) = &c.init_from {
        // The vocabulary is the model's: the tokenizer must fit in it.
        if have > c.model.vocab_size {
            bail!(
                "--tokenizer {} has {have} tokens, more than the vocabulary of the model in {} ({})",
                path.display(),
                dir.display(),
                c.model.vocab_size
            );
        }
        return Ok(());
    }
    match args.model.vocab_size {
        None => c.model.vocab_size = have,
        Some(v) if v < have => bail!("invalid --vocab-size: {v} (the tokenizer {} has {have} tokens)", path.display()),
        Some(_) => {}
    }
    Ok(())
}

/// A choice flag's value as the option's type (its TOML spelling), or an error naming the flag,
/// the value and the choices.
fn choice<T: serde::de::DeserializeOwned>(flag: &str, value: &str, choices: &str) -> Result<T> {
    toml::Value::String(value.to_string()).try_into().map_err(|_| anyhow::anyhow!("invalid --{flag}: '{value}' (expected {choices})"))
}

/// The block options flags set, on top of `m`: `--arch` first, then each option's own flag.
fn apply_block_flags(args: &ModelArgs, m: &mut lazarus_model::ModelConfig) -> Result<()> {
    if let Some(a) = &args.arch {
        let arch: lazarus_model::config::Arch = choice("arch", a, "gpt or mixtral")?;
        *m = m.clone().with_arch(arch);
    }
    if let Some(v) = &args.norm {
        m.norm = choice("norm", v, "layer or rms")?;
    }
    if let Some(v) = &args.positions {
        m.positions = choice("positions", v, "learned or rope")?;
    }
    if let Some(v) = &args.expert_act {
        m.expert_act = choice("expert-act", v, "gelu or swiglu")?;
    }
    macro_rules! set {
        ($($flag:ident),*) => {
            $(if let Some(v) = args.$flag { m.$flag = v; })*
        };
    }
    set!(rope_theta, normalize_top_k, shared_experts, attn_bias, ffn_bias);
    Ok(())
}

/// The settings flags on top of `c` (defaults or a `--config` file, or a resumed run's).
fn apply_flags(args: &TrainArgs, c: &mut TrainConfig) -> Result<()> {
    apply_block_flags(&args.model, &mut c.model)?;
    macro_rules! set {
        ($($($flag:ident).+ => $($field:ident).+),* $(,)?) => {
            $(if let Some(v) = args.$($flag).+.clone() { c.$($field).+ = v; })*
        };
    }
    set!(steps => steps, model.batch_size => batch_size, model.seq_len => seq_len, model.lr => lr, model.min_lr => min_lr,
         model.warmup_steps => warmup_steps, model.vocab_size => model.vocab_size, model.d_model => model.d_model, model.layers => model.n_layers,
         model.heads => model.n_heads, model.experts => model.n_experts, model.top_k => model.top_k, model.d_ff => model.d_ff,
         model.moe_every => model.moe_every, model.aux_loss_coef => model.aux_loss_coef, model.seed => seed,
         checkpoint_every => checkpoint_every, keep_checkpoints => keep_checkpoints);
    if let Some(v) = &args.model.grad_clip {
        c.grad_clip = off_or("grad-clip", v)?;
    }
    if let Some(v) = &args.model.capacity_factor {
        c.model.capacity_factor = off_or("capacity-factor", v)?;
    }
    if let Some(p) = &args.model.routing_trace {
        c.routing_trace = Some(p.clone());
    }
    if let Some(p) = &args.model.tokenizer {
        c.tokenizer = Some(p.clone());
    }
    if let Some(d) = &args.model.dtype {
        c.dtype = lazarus_model::Precision::parse(d)?;
    }
    if let Some(p) = &args.checkpoint_dir {
        c.checkpoint_dir = Some(p.clone());
    }
    if let Some(seq) = args.model.seq_len {
        c.model.max_seq_len = c.model.max_seq_len.max(seq);
    }
    match (args.model.data.as_deref(), args.model.data_format.as_deref()) {
        (None, Some(f)) => bail!("--data-format {f} needs --data FILE"),
        (None | Some("synthetic"), fmt) => {
            if fmt.is_some_and(|f| f != "text") {
                bail!("invalid --data-format: {} (the synthetic corpus is text)", fmt.unwrap_or_default());
            }
            if args.model.data.is_some() && !matches!(c.data, DataSource::Synthetic { .. }) {
                c.data = TrainConfig::default().data;
            }
            if let Some(bytes) = args.model.synthetic_bytes {
                let DataSource::Synthetic { seed, .. } = c.data else {
                    bail!(
                        "--synthetic-bytes sizes the synthetic corpus, but the data is {} (from --config); drop one of them",
                        c.data.describe()
                    );
                };
                c.data = DataSource::Synthetic { seed, bytes };
            }
        }
        (Some(path), fmt) => c.data = data_file("data", path, fmt)?,
    }
    if args.model.synthetic_bytes.is_some() && args.model.data.as_deref().is_some_and(|d| d != "synthetic") {
        bail!(
            "--synthetic-bytes sizes the synthetic corpus; --data {} reads a file instead: drop one of them",
            args.model.data.as_deref().unwrap_or_default()
        );
    }
    Ok(())
}

/// The format of `--eval-data`: `--eval-data-format`, else the file's own extension (`.jsonl`,
/// `.txt`), else the training data's `--data-format` — held-out text beside JSON-lines training
/// data is the common case, and forcing it into the training data's format failed.
pub fn eval_data_format(args: &TrainArgs) -> Option<&str> {
    if let Some(f) = args.eval_data_format.as_deref() {
        return Some(f);
    }
    let path = args.eval_data.as_deref()?;
    match Path::new(path).extension().and_then(|e| e.to_str()) {
        Some("jsonl") => Some("jsonl"),
        Some("txt") => Some("text"),
        _ => args.model.data_format.as_deref(),
    }
}

/// The data `--{flag} PATH` names (a text file, or comma-separated token shards) in `format`
/// (`--data-format`: text, u16 or u32; default text).
pub fn data_file(flag: &str, path: &str, format: Option<&str>) -> Result<DataSource> {
    let paths: Vec<PathBuf> = path.split(',').map(PathBuf::from).collect();
    if let Some(i) = paths.iter().position(|p| p.as_os_str().is_empty()) {
        bail!("invalid --{flag}: '{path}' (file {} of {} has an empty name)", i + 1, paths.len());
    }
    Ok(match format.unwrap_or("text") {
        "text" if paths.len() == 1 => DataSource::Text { path: paths[0].clone() },
        "text" => bail!("invalid --{flag}: '{path}' (a text source is one file)"),
        "jsonl" if paths.len() == 1 => DataSource::JsonLines { path: paths[0].clone() },
        "jsonl" => bail!("invalid --{flag}: '{path}' (a JSON-lines source is one file)"),
        "u16" => DataSource::Shards { paths, width: TokenWidth::U16 },
        "u32" => DataSource::Shards { paths, width: TokenWidth::U32 },
        other => bail!("invalid --{flag}-format: '{other}' (expected text, jsonl, u16 or u32)"),
    })
}

/// `args` with `--resume-if-any` settled: `--resume` when the checkpoint directory (the flag's or
/// the `--config` file's) holds a run's checkpoint (its `latest`, or a `step-*` where `latest`
/// is missing), else a new run.
pub fn settle_resume(args: &TrainArgs) -> Result<TrainArgs> {
    let mut a = args.clone();
    if a.resume_if_any {
        let dir = build_config(args)?.checkpoint_dir;
        let Some(dir) = dir else { bail!("--resume-if-any needs --checkpoint-dir (or checkpoint_dir in --config)") };
        let held = lazarus_model::checkpoint::held_checkpoint(&dir);
        a.resume = held.is_some();
        a.resume_if_any = false;
        if let Some(held) = held {
            tracing::info!("--resume-if-any: {} holds a run ({held}): going on with it", dir.display());
        }
    }
    Ok(a)
}

/// The configuration of a run that starts now: flags checked for combinations that would ignore
/// one, the checkpoint directory usable, the whole thing small enough for this machine with
/// `copies` processes holding the model.
pub fn setup_run(args: &TrainArgs, copies: u128) -> Result<TrainConfig> {
    args.check_combinations()?;
    let mut cfg = build_config(args)?;
    if args.keep_checkpoints.is_some() && cfg.checkpoint_dir.is_none() {
        bail!("--keep-checkpoints needs --checkpoint-dir (or checkpoint_dir in --config)");
    }
    check_checkpoint_dir(&cfg, args.resume, args.overwrite_checkpoints)?;
    if !args.resume {
        check_fits(&cfg, copies)?;
        start_run(&mut cfg)?;
    }
    Ok(cfg)
}

/// A fresh run gets its id; its checkpoint directory becomes its own (what an earlier run left
/// there — allowed by --overwrite-checkpoints — is set aside, not deleted, and said where).
fn start_run(cfg: &mut TrainConfig) -> Result<()> {
    let run = lazarus_model::checkpoint::fresh_run_id()?;
    if let Some(dir) = &cfg.checkpoint_dir {
        let aside = lazarus_model::checkpoint::start_run(dir, &run).with_context(|| format!("--checkpoint-dir {}", dir.display()))?;
        if let Some(aside) = aside {
            tracing::warn!("--overwrite-checkpoints: the earlier run's checkpoints are kept in {}", aside.display());
        }
    }
    cfg.run = Some(run);
    Ok(())
}

/// A run resumed from `dir` at `step`: its checkpoints of later steps are set aside before the
/// run writes over them, and the user is told where they are.
pub fn set_aside_newer(dir: &Path, step: u64) -> Result<()> {
    let moved = lazarus_model::checkpoint::set_aside_newer(dir, step).with_context(|| format!("--checkpoint-dir {}", dir.display()))?;
    if let Some(first) = moved.first() {
        tracing::warn!(
            "--resume goes on from step {step}: {} newer checkpoint(s) of this run would be written over; kept in {}",
            moved.len(),
            first.parent().unwrap_or(first).display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// `lazarus train`'s flags alone, as a command.
    #[derive(clap::Parser)]
    struct TrainCli {
        #[command(flatten)]
        train: TrainArgs,
    }

    /// The flags of `lazarus train EXTRA…`.
    fn train_args(extra: &[&str]) -> TrainArgs {
        use clap::Parser;
        let mut argv = vec!["train"];
        argv.extend_from_slice(extra);
        TrainCli::try_parse_from(argv).unwrap().train
    }

    const CONFIG: &str = "steps = 500\nlr = 0.002\nbatch_size = 8\n[model]\nn_experts = 8\ntop_k = 2\ncapacity_factor = 1.25\n[data]\nkind = \"synthetic\"\nseed = 3\nbytes = 100000\n";

    /// `--arch mixtral` and `arch = "mixtral"` set Mixtral's options; the file's own keys and
    /// the single flags win over the preset; bad values name the flag or key.
    #[test]
    fn the_arch_preset_and_the_block_options_come_from_flags_and_the_file() {
        use lazarus_model::config::{Activation, NormKind, Positions};
        let parse = |extra: &[&str]| build_config(&train_args(extra));
        let m = parse(&["--arch", "mixtral"]).unwrap().model;
        assert_eq!(
            (m.norm, m.positions, m.expert_act, m.attn_bias, m.ffn_bias),
            (NormKind::Rms, Positions::Rope, Activation::Swiglu, false, false)
        );
        assert_eq!(m.rope_theta, 1e6);
        let m = parse(&[
            "--arch",
            "mixtral",
            "--norm",
            "layer",
            "--shared-experts",
            "2",
            "--normalize-top-k",
            "false",
            "--top-k",
            "8",
            "--experts",
            "64",
        ])
        .unwrap()
        .model;
        assert_eq!(
            (m.norm, m.shared_experts, m.normalize_top_k, m.top_k, m.expert_act),
            (NormKind::Layer, 2, false, 8, Activation::Swiglu)
        );
        let m = parse(&["--positions", "rope", "--rope-theta", "500", "--ffn-bias", "false"]).unwrap().model;
        assert_eq!((m.positions, m.rope_theta, m.ffn_bias, m.norm), (Positions::Rope, 500.0, false, NormKind::Layer));
        for (flags, named) in [
            (&["--arch", "llama"][..], "--arch: 'llama'"),
            (&["--norm", "batch"], "--norm: 'batch'"),
            (&["--expert-act", "relu"], "--expert-act"),
            (&["--positions", "alibi"], "--positions"),
        ] {
            let e = format!("{:#}", parse(flags).unwrap_err());
            assert!(e.contains(named), "{e}");
        }
        assert!(format!("{:#}", parse(&["--top-k", "9"]).unwrap_err()).contains("top_k"));
        let dir = std::env::temp_dir().join(format!("lazarus-arch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("arch.toml");
        std::fs::write(&file, "[model]\narch = \"mixtral\"\nffn_bias = true\nshared_experts = 1\n").unwrap();
        let f = file.to_str().unwrap();
        let m = parse(&["--config", f]).unwrap().model;
        assert_eq!((m.norm, m.ffn_bias, m.shared_experts, m.attn_bias), (NormKind::Rms, true, 1, false));
        let m = parse(&["--config", f, "--arch", "gpt"]).unwrap().model;
        assert_eq!((m.norm, m.ffn_bias, m.shared_experts), (NormKind::Layer, true, 0), "the flag overrides the file");
        std::fs::write(&file, "[model]\narch = \"llama\"\n").unwrap();
        let e = format!("{:#}", parse(&["--config", f]).unwrap_err());
        assert!(e.contains("model.arch = 'llama'"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Settings that would do nothing are refused by name — a rotary base for learned
    /// positions (flag or file), a replay's scale or notices without a replay, an evaluation
    /// format without evaluation data — and held-out data takes its own format from its name
    /// before the training data's.
    #[test]
    fn settings_that_would_do_nothing_are_refused_and_held_out_data_has_its_own_format() {
        let args = train_args;
        let refused = |extra: &[&str], want: &str| {
            let a = args(extra);
            let e = a.check_combinations().and_then(|_| build_config(&a).map(|_| ())).unwrap_err();
            assert!(format!("{e:#}").contains(want), "{extra:?}: {e:#}");
        };
        refused(&["--rope-theta", "5000"], "--rope-theta 5000: the model's positions are learned");
        refused(&["--replay-scale", "2", "--workers", "2"], "--replay-scale needs --replay SOURCE");
        refused(&["--replay-notice", "--workers", "2"], "--replay-notice needs --replay SOURCE");
        refused(&["--eval-data-format", "text"], "--eval-data-format needs --eval-data FILE");
        assert_eq!(build_config(&args(&["--arch", "mixtral", "--rope-theta", "5000"])).unwrap().model.rope_theta, 5000.0);
        let dir = std::env::temp_dir().join(format!("lazarus-theta-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("theta.toml");
        std::fs::write(&file, "[model]\nrope_theta = 5000.0\n").unwrap();
        refused(&["--config", file.to_str().unwrap()], "rope_theta = 5000.0 in --config");
        std::fs::write(&file, "[model]\narch = \"mixtral\"\nrope_theta = 5000.0\n").unwrap();
        assert_eq!(build_config(&args(&["--config", file.to_str().unwrap()])).unwrap().model.rope_theta, 5000.0);
        std::fs::remove_dir_all(&dir).unwrap();
        for (extra, want) in [
            (&["--data", "a.jsonl", "--data-format", "jsonl", "--eval-data", "held.txt"][..], Some("text")),
            (&["--data", "a.txt", "--eval-data", "held.jsonl"], Some("jsonl")),
            (&["--data", "a.bin", "--data-format", "u16", "--eval-data", "held.bin"], Some("u16")),
            (&["--data", "a.jsonl", "--data-format", "jsonl", "--eval-data", "held.txt", "--eval-data-format", "jsonl"], Some("jsonl")),
            (&["--eval-data", "held"], None),
        ] {
            assert_eq!(eval_data_format(&args(extra)), want, "{extra:?}");
        }
        let e = data_file("eval-data", "held", Some("csv")).unwrap_err().to_string();
        assert!(e.contains("invalid --eval-data-format: 'csv'"), "{e}");
    }

    /// `--help` tells every setting's default: the training settings' from `TrainConfig`, the
    /// others in their own words; a flag without one is one that names a file or turns
    /// something on.
    #[test]
    fn every_training_flag_says_its_default() {
        use clap::CommandFactory;
        let cmd = with_defaults(TrainCli::command(), &training_defaults());
        // Flags whose absence is their default: a file or place not given, a thing not done.
        let none = [
            "config",
            "checkpoint_dir",
            "init_from",
            "json_log",
            "eval_data",
            "eval_data_format",
            "eval_every",
            "eval_windows",
            "workers",
            "replay",
            "replay_scale",
            "metrics_listen",
            "metrics_token_file",
            "routing_trace",
            "tokenizer",
            "placement_file",
            "arch",
            "status_listen",
            "profile_steps",
            "shard_sequences",
            "snapshot_ceiling",
        ];
        let mut missing = Vec::new();
        for a in cmd.get_arguments() {
            let takes_value = a.get_num_args().is_some_and(|n| n.takes_values()) && !matches!(a.get_action(), clap::ArgAction::SetTrue);
            if !takes_value || none.contains(&a.get_id().as_str()) || !a.get_default_values().is_empty() {
                continue;
            }
            let help = a.get_help().map(|h| h.to_string()).unwrap_or_default().to_lowercase();
            if !help.contains("default") {
                missing.push(a.get_id().to_string());
            }
        }
        assert!(missing.is_empty(), "flags whose help does not say their default: {missing:?}");
        let lr = cmd.get_arguments().find(|a| a.get_id() == "lr").unwrap().get_help().unwrap().to_string();
        assert!(lr.ends_with("[default: 0.002]"), "{lr}");
        let norm = cmd.get_arguments().find(|a| a.get_id() == "norm").unwrap().get_help().unwrap().to_string();
        assert!(norm.ends_with("[default: layer]"), "{norm}");
    }

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

        /// The one size check: a run is refused exactly when its estimate (times the processes
        /// holding the model) exceeds the machine, the refusal naming the flags that lower it;
        /// and no size grows without the estimate growing with it.
        #[test]
        fn the_size_check_refuses_exactly_what_exceeds_the_machine(
            d_model in 1usize..6, d_ff in 1usize..6, experts in 1usize..10, layers in 1usize..8,
            batch in 0usize..8, seq in 0usize..6, copies in 1u128..65,
        ) {
            let mut c: TrainConfig = toml::from_str(CONFIG).unwrap();
            (c.model.d_model, c.model.d_ff) = (64 << d_model, 64 << d_ff);
            (c.model.n_experts, c.model.n_layers, c.model.n_heads) = (1 << experts, 1 << layers, 1);
            (c.batch_size, c.seq_len) = (1 << batch, 16 << seq);
            let need = c.memory_estimate().saturating_mul(copies);
            let have = lazarus_control::launcher::memory_available().map(|(b, _)| b);
            match check_fits(&c, copies) {
                Ok(()) => prop_assert!(have.is_none_or(|h| need <= h as u128)),
                Err(e) => {
                    prop_assert!(have.is_some_and(|h| need > h as u128));
                    prop_assert!(e.to_string().contains("GiB") && e.to_string().contains("--d-model"), "{e}");
                }
            }
            let mut bigger = c.clone();
            bigger.model.d_ff *= 2;
            bigger.batch_size *= 2;
            prop_assert!(bigger.memory_estimate() >= c.memory_estimate());
        }
    }
}
