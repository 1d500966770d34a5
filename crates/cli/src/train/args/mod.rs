//! The flags of `lazarus train`, the configuration they build (defaults, then a TOML file, then
//! flags), and the checks that no flag is silently ignored and the run fits this machine.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use lazarus_model::data::{TableFiles, TableFormat};
use lazarus_model::{DataSource, TokenWidth, TrainConfig};

mod config;
mod run;
mod run_dir;
#[cfg(test)]
mod tests;

pub use config::*;
pub use run::*;
pub use run_dir::{discard_if_unused, keep_run_files, with_run_dir, RUN_CONFIG, RUN_LOG};

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
    /// Attention heads (a divisor of --d-model, unless --head-dim is given).
    #[arg(long)]
    pub(crate) heads: Option<usize>,
    /// Key and value heads, a divisor of --heads: grouped-query attention, each serving its
    /// group of query heads (Mixtral 8 of 32, Qwen3-MoE 4 of 32). Default: one per query head.
    #[arg(long)]
    pub(crate) kv_heads: Option<usize>,
    /// The width of a head (Qwen3-MoE's 128 beside d_model 2048 and 32 heads). Default:
    /// --d-model / --heads.
    #[arg(long)]
    pub(crate) head_dim: Option<usize>,
    /// DeepSeek's multi-head latent attention: each token's keys and values come out of a latent
    /// this wide (DeepSeek-V3's kv_lora_rank, 512). Default: off (the packed projection).
    #[arg(long, value_name = "N")]
    pub(crate) kv_lora_rank: Option<usize>,
    /// With latent attention: the queries too out of a latent this wide (DeepSeek-V3's
    /// q_lora_rank, 1536). Default: the queries projected directly (DeepSeek-V2-Lite).
    #[arg(long, value_name = "N")]
    pub(crate) q_lora_rank: Option<usize>,
    /// With latent attention: each head's rotary part of its queries and keys (DeepSeek-V3's
    /// qk_rope_head_dim, 64). Default: half the head width.
    #[arg(long, value_name = "N")]
    pub(crate) rope_head_dim: Option<usize>,
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
    /// The router's scores: softmax over the experts (default), or a sigmoid each (DeepSeek-V3;
    /// the chosen scores renormalised with --normalize-top-k true).
    #[arg(long, value_name = "softmax|sigmoid")]
    pub(crate) router: Option<String>,
    /// The routed experts' weights times this (DeepSeek-V3's routed scaling factor; 1 = none).
    #[arg(long)]
    pub(crate) routed_scaling: Option<f64>,
    /// Group-limited routing (DeepSeek-V3's n_group): the experts in this many equal groups, a
    /// token's top-k only from the --top-groups groups whose two best scores sum highest.
    #[arg(long)]
    pub(crate) expert_groups: Option<usize>,
    /// Groups a token's experts may come from (with --expert-groups; DeepSeek-V3's topk_group).
    #[arg(long)]
    pub(crate) top_groups: Option<usize>,
    /// Always-on shared experts beside the routed ones in every MoE block (DeepSeek-MoE).
    #[arg(long)]
    pub(crate) shared_experts: Option<usize>,
    /// The shared experts' output times a sigmoid gate of the token (Qwen2-MoE).
    #[arg(long, value_name = "true|false")]
    pub(crate) shared_expert_gate: Option<bool>,
    /// The blocks' options at once: gpt (LayerNorm, learned positions, GELU, biases: the
    /// default) or mixtral (RMSNorm, rotary positions θ = 10⁶, SwiGLU experts, no biases,
    /// normalised top-k, no shared experts) or qwen-moe (Mixtral's, with an RMSNorm on each
    /// head's queries and keys, as Qwen3-MoE) or qwen2-moe (Mixtral's with q/k/v biases, a gated
    /// shared expert and unnormalised top-k, as Qwen2-MoE) or deepseek-moe (Mixtral's with a
    /// shared expert and a sigmoid router, DeepSeek-MoE's routing); the flags below and above
    /// change single options.
    #[arg(long, value_name = "gpt|mixtral|qwen-moe|qwen2-moe|deepseek-moe")]
    pub(crate) arch: Option<String>,
    /// The blocks' norm.
    #[arg(long, value_name = "layer|rms")]
    pub(crate) norm: Option<String>,
    /// The norms' ε (Qwen3-MoE's 1e-6).
    #[arg(long)]
    pub(crate) norm_eps: Option<f64>,
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
    /// Biases on the queries, keys and values only, not the output projection (Qwen2-MoE).
    #[arg(long, value_name = "true|false")]
    pub(crate) qkv_bias: Option<bool>,
    /// An RMSNorm over each head's queries and keys (Qwen3-MoE, OLMoE).
    #[arg(long, value_name = "true|false")]
    pub(crate) qk_norm: Option<bool>,
    /// Biases on the FFNs (experts, shared experts, dense blocks).
    #[arg(long, value_name = "true|false")]
    pub(crate) ffn_bias: Option<bool>,
    /// Hidden width of each expert.
    #[arg(long)]
    pub(crate) d_ff: Option<usize>,
    /// An MoE layer every this many blocks (1 = every block).
    #[arg(long)]
    pub(crate) moe_every: Option<usize>,
    /// Dense blocks before the first MoE one (DeepSeek-V3's first_k_dense_replace, 3). Default: 0.
    #[arg(long, value_name = "K")]
    pub(crate) dense_first: Option<usize>,
    /// The dense blocks' FFN width (DeepSeek-V3's intermediate_size, 18432). Default: --d-ff.
    #[arg(long, value_name = "N")]
    pub(crate) dense_d_ff: Option<usize>,
    /// Weight of the load-balancing loss (Switch Transformer's auxiliary loss).
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) aux_loss_coef: Option<f64>,
    /// How the experts' loads are kept even: aux (the auxiliary loss, the default), bias
    /// (DeepSeek-V3's loss-free balancing: a routing bias per expert, moved toward the mean
    /// load after each step, no auxiliary loss trained on) or both.
    #[arg(long, value_name = "aux|bias|both")]
    pub(crate) balance: Option<String>,
    /// How far each expert's routing bias moves after a step (γ; with --balance bias or both).
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) bias_update_rate: Option<f64>,
    /// Expert capacity as a multiple of the even share ("off" = dropless, the default).
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) capacity_factor: Option<String>,
    /// Seed of the weights and the sampling order.
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// "synthetic" (built-in corpus), a UTF-8 text file, token shards (comma-separated .bin),
    /// Megatron indexed datasets (comma-separated prefixes of .bin + .idx pairs, streamed), or
    /// Parquet or Arrow files of a Hugging Face dataset (comma-separated, read once into a token
    /// cache).
    #[arg(long)]
    pub(crate) data: Option<String>,
    /// Format of --data files: text, jsonl ({"text": …} a line), u16, u32, megatron, parquet or
    /// arrow (Arrow IPC: `datasets`' cache files and `save_to_disk`'s).
    #[arg(long)]
    pub(crate) data_format: Option<String>,
    /// The Parquet or Arrow column to train on: text (tokenized) or lists of token ids (default:
    /// the first of text, input_ids, tokens the file has).
    #[arg(long, value_name = "NAME")]
    pub(crate) data_column: Option<String>,
    /// Where Parquet and Arrow data's token caches are kept (default: $LAZARUS_DATA_CACHE, else
    /// ~/.cache/lazarus/data).
    #[arg(long, value_name = "DIR")]
    pub(crate) data_cache: Option<PathBuf>,
    /// Blend the Megatron datasets (or Parquet or Arrow files) of --data by these weights, one a dataset (e.g. 0.7,0.3):
    /// each window comes from one of them, in proportion (default: one after another).
    #[arg(long, value_name = "W,W,…")]
    pub(crate) data_weights: Option<String>,
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
    /// Default: a directory of the run's own, runs/DATE-TIME/ (under $LAZARUS_RUNS_DIR if set),
    /// with its settings (config.toml), its JSON log and its tokenizer beside them.
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Keep nothing: no run directory, no checkpoint (a run that only shows its progress).
    #[arg(long, conflicts_with_all = ["checkpoint_dir", "resume", "resume_if_any", "checkpoint_every", "keep_checkpoints"])]
    pub no_save: bool,
    /// Start from the weights of a Hugging Face Mixtral, Qwen3-MoE, Qwen2-MoE or DeepSeek-V3 directory (config.json +
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
    /// Continue from the latest checkpoint in --checkpoint-dir (without it: the newest run under
    /// runs/).
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
    /// Write TensorBoard event files into DIR (`tensorboard --logdir DIR`): loss, eval loss,
    /// tokens/s, learning rate, gradient norm, each expert's share of its layer's tokens, the MoE
    /// bytes between workers and each recovery's time. Default: the run's own directory, when
    /// it has one (`tensorboard --logdir runs` shows every run).
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
    /// No progress bar or per-step lines, only the summary.
    #[arg(long)]
    pub quiet: bool,
    /// Held-out data to evaluate the model on (a text file, JSON lines, token shards or Megatron
    /// datasets; see --eval-data-format): its loss and perplexity over windows taken in order,
    /// in the progress, the --json-log and the summary.
    #[arg(long, value_name = "FILE")]
    pub eval_data: Option<String>,
    /// Format of --eval-data: text, jsonl, u16, u32 or megatron (default: jsonl for a .jsonl
    /// file, text for a .txt file, else --data-format's).
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
    /// Every step's result has the same bits in one process and on any number of workers, and
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
    /// With --workers: serve the job's live dashboard at http://ADDR/dashboard?token=TOKEN
    /// (members, placement and loads, loss and throughput curves, the timeline of failures and
    /// recoveries), for holders of the job's status token: the address is printed with it.
    #[arg(long, value_name = "ADDR")]
    pub dashboard_listen: Option<SocketAddr>,
    /// With --workers: encrypt the workers' connections to each other (TLS 1.3 by rustls,
    /// AES-256-GCM, both ends pinned to a key the job's secret gives). Without it they are
    /// authenticated at the rendezvous and travel in clear.
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

impl TrainArgs {
    /// Whether this run starts worker processes.
    pub fn uses_workers(&self) -> bool {
        self.workers.is_some()
    }

    /// Flags that only mean something with `--workers`, by name, when given.
    pub(super) fn worker_flags(&self) -> Vec<&'static str> {
        let given: [(&'static str, bool); 22] = [
            ("--metrics-listen", self.metrics_listen.is_some()),
            ("--dashboard-listen", self.dashboard_listen.is_some()),
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

/// `--shard-sequences`, checked against the batch it cuts: a divisor of it (whole shards a step),
/// in one process as on workers.
pub(super) fn check_shard_sequences(shard: Option<usize>, batch_size: usize) -> Result<()> {
    if let Some(s) = shard.filter(|&s| s == 0 || !batch_size.is_multiple_of(s)) {
        bail!("invalid --shard-sequences: {s} (a divisor of --batch-size {batch_size}: whole shards a step)");
    }
    Ok(())
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
        ("norm_eps", word(m.norm_eps)),
        ("positions", word(m.positions)),
        ("expert_act", word(m.expert_act)),
        ("attn_bias", m.attn_bias.to_string()),
        ("qkv_bias", m.qkv_bias.to_string()),
        ("shared_expert_gate", m.shared_expert_gate.to_string()),
        ("qk_norm", m.qk_norm.to_string()),
        ("router", word(m.router)),
        ("routed_scaling", word(m.routed_scaling)),
        ("expert_groups", m.expert_groups.to_string()),
        ("top_groups", m.top_groups.to_string()),
        ("ffn_bias", m.ffn_bias.to_string()),
        ("aux_loss_coef", word(m.aux_loss_coef)),
        ("balance", word(m.balance)),
        ("bias_update_rate", word(m.bias_update_rate)),
        ("capacity_factor", word(m.capacity_factor)),
        ("data", "synthetic".into()),
        ("data_format", "parquet or arrow for .parquet or .arrow files, else text".into()),
        ("synthetic_bytes", synthetic),
        ("dtype", word(c.dtype)),
    ]
}
