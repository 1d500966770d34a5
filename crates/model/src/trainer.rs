//! The single-process trainer: sampler → forward → backward → clip → AdamW, with checkpoints
//! that resume bit-exactly.

use lazarus_setting::Setting;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{self, Manifest};
use crate::config::ModelConfig;
use crate::data::{Cursor, DataSource, Sampler};
use crate::error::{ModelError, Result};
use crate::model::MoeModel;
use crate::optim::{clip_scale, grad_norm, AdamW, AdamWConfig, LrSchedule, TensorState};

/// The precision a run trains in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 throughout.
    #[default]
    F32,
    /// Mixed precision: matrix products in bf16; parameters, gradients, AdamW state, norms,
    /// softmaxes, the residual stream and the loss in f32 (what PyTorch's autocast does).
    Bf16,
}

impl Precision {
    /// The dtype of the matrix products.
    pub fn compute_dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }

    /// `f32` or `bf16`, as the `--dtype` flag writes it.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            other => Err(ModelError::config("dtype", other, "expected f32 or bf16")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
    }
}

/// Everything a training run is configured by (also the TOML `--config` file's shape).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    pub model: ModelConfig,
    pub optimizer: AdamWConfig,
    /// Total optimizer steps.
    pub steps: u64,
    /// Sequences per step (the constant global batch).
    pub batch_size: usize,
    pub seq_len: usize,
    /// Peak learning rate.
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    /// Clip the global gradient norm to this (None = no clipping: `"off"` in a TOML file).
    #[serde(deserialize_with = "crate::config::number_or_off", serialize_with = "crate::config::off_when_none")]
    pub grad_clip: Option<f64>,
    /// Seed of the weights and of the sampling order.
    pub seed: u64,
    pub data: DataSource,
    /// JSON per-layer expert loads replacing the router's choices (see [`RoutingTrace`]).
    pub routing_trace: Option<PathBuf>,
    pub checkpoint_dir: Option<PathBuf>,
    /// Save every this many steps (0 = only at the end, when a directory is set).
    pub checkpoint_every: u64,
    /// Checkpoints kept in the directory: the newest this many (0 = every one).
    pub keep_checkpoints: usize,
    /// f32, or bf16 mixed precision (checkpoints are f32 either way).
    pub dtype: Precision,
    /// The run's id: drawn when a run starts, kept by every checkpoint of it and by a resume,
    /// so that a checkpoint directory never mixes two runs ([`checkpoint::start_run`]).
    pub run: Option<String>,
    /// A Hugging Face `tokenizer.json` through which text data (and prompts, and held-out
    /// text) becomes tokens; None: bytes. The model's vocabulary must hold its tokens.
    pub tokenizer: Option<PathBuf>,
    /// A Hugging Face Mixtral, Qwen3-MoE, Qwen2-MoE or DeepSeek-V3 directory whose weights a fresh run starts from
    /// (continued pre-training or fine-tuning, [`crate::hf`]); the model's options must be its.
    /// A resumed run takes its weights from its checkpoint instead.
    pub init_from: Option<PathBuf>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            model: ModelConfig::default(),
            optimizer: AdamWConfig::default(),
            steps: 300,
            batch_size: 16,
            seq_len: 128,
            lr: 2e-3,
            min_lr: 2e-4,
            warmup_steps: 20,
            grad_clip: Some(1.0),
            seed: 0,
            data: DataSource::Synthetic { seed: 0, bytes: 2_000_000 },
            routing_trace: None,
            checkpoint_dir: None,
            checkpoint_every: 0,
            keep_checkpoints: 3,
            dtype: Precision::F32,
            run: None,
            tokenizer: None,
            init_from: None,
        }
    }
}

impl TrainConfig {
    /// These settings in the shape of a `--config` file: what [`TrainConfig::from_toml`] reads
    /// back as they are (a setting that is off is written `"off"`, not left out).
    pub fn to_toml(&self) -> Result<String> {
        let table = toml::Table::try_from(self).map_err(|e| ModelError::config("settings", "TOML", e.to_string()))?;
        toml::to_string(&table).map_err(|e| ModelError::config("settings", "TOML", e.to_string()))
    }

    /// Settings from a `--config` file's text; an unknown key or a value of the wrong kind is
    /// refused naming the key. Not validated ([`TrainConfig::validate`]).
    pub fn from_toml(text: &str) -> Result<Self> {
        toml::from_str(text).map_err(|e| ModelError::config("settings", "TOML", e.to_string()))
    }

    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        if self.steps == 0 {
            return Err(ModelError::config("steps", 0, "must be at least 1"));
        }
        if self.batch_size == 0 || self.batch_size > 1 << 20 {
            return Err(ModelError::config("batch_size", self.batch_size, "must be between 1 and 1048576"));
        }
        if self.seq_len == 0 || self.seq_len > self.model.max_seq_len {
            return Err(ModelError::config(
                "seq_len",
                self.seq_len,
                format!("must be between 1 and the model's max_seq_len ({})", self.model.max_seq_len),
            ));
        }
        if !self.lr.is_finite() || self.lr <= 0.0 {
            return Err(ModelError::config("lr", self.lr, "must be finite and > 0"));
        }
        if !self.min_lr.is_finite() || self.min_lr < 0.0 || self.min_lr > self.lr {
            return Err(ModelError::config("min_lr", self.min_lr, format!("must be between 0 and lr ({})", self.lr)));
        }
        if let Some(c) = self.grad_clip {
            if !c.is_finite() || c <= 0.0 {
                return Err(ModelError::config("grad_clip", c, "must be finite and > 0"));
            }
        }
        let o = &self.optimizer;
        for (field, v) in [("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(ModelError::config(field, v, "must be in [0, 1)"));
            }
        }
        if !o.eps.is_finite() || o.eps <= 0.0 {
            return Err(ModelError::config("optimizer.eps", o.eps, "must be finite and > 0"));
        }
        if !o.weight_decay.is_finite() || o.weight_decay < 0.0 {
            return Err(ModelError::config("optimizer.weight_decay", o.weight_decay, "must be finite and ≥ 0"));
        }
        if let DataSource::Synthetic { bytes, .. } = self.data {
            if bytes > crate::data::MAX_SYNTHETIC_BYTES {
                return Err(ModelError::config(
                    "data.bytes",
                    bytes,
                    format!("the synthetic corpus holds at most {} bytes", crate::data::MAX_SYNTHETIC_BYTES),
                ));
            }
        }
        if self.tokenizer.is_none()
            && self.model.vocab_size < 256
            && (matches!(self.data, DataSource::Synthetic { .. } | DataSource::Text { .. } | DataSource::JsonLines { .. })
                || self.data.table().is_some() && !self.data.is_tokens())
        {
            return Err(ModelError::config(
                "model.vocab_size",
                self.model.vocab_size,
                "byte-tokenized data needs a vocabulary of at least 256",
            ));
        }
        Ok(())
    }

    /// About how many bytes one process training this configuration needs: parameters with
    /// their gradients and AdamW moments (f32), the activations a step keeps for backward, and
    /// the tokens of the data. An estimate to refuse what cannot fit before allocating it, not
    /// an accounting.
    pub fn memory_estimate(&self) -> u128 {
        let m = &self.model;
        let params = m.parameter_count() * 4 * 4;
        let tokens = (self.batch_size * self.seq_len) as u128;
        let (d, v) = (m.d_model as u128, m.vocab_size as u128);
        // Each token's rows through its k experts and the shared ones, or through a dense block's
        // FFN (DeepSeek-V3's is 9 experts wide): pre-activation, activation and output.
        let ffn = |width: usize, rows: usize| (rows * (m.expert_act.first_width(width) + 2 * width)) as u128;
        let dense = if m.moe_layers() < m.n_layers { ffn(m.dense_width(), 1) } else { 0 };
        let per_block = 12 * d + ffn(m.d_ff, m.top_k + m.shared_experts).max(dense);
        let activations = tokens * (m.n_layers as u128 * per_block + 3 * v) * 4;
        let data = match &self.data {
            DataSource::Synthetic { bytes, .. } => *bytes as u128 * 5,
            DataSource::Text { path } | DataSource::JsonLines { path } => std::fs::metadata(path).map_or(0, |x| x.len() as u128 * 5),
            DataSource::Shards { paths, .. } => paths.iter().map(|p| std::fs::metadata(p).map_or(0, |x| x.len() as u128 * 2)).sum(),
            // Read a window at a time; only the first tokens' frequencies are counted at once.
            DataSource::Megatron { .. } | DataSource::Parquet(_) | DataSource::Arrow(_) => crate::data::ENTROPY_SAMPLE_TOKENS as u128 * 4,
        };
        params + activations + data
    }

    fn schedule(&self) -> LrSchedule {
        LrSchedule { peak: self.lr, min: self.min_lr, warmup: self.warmup_steps, total: self.steps }
    }
}

/// Per-layer expert loads that replace the router's choices, as the paper did for reproducible
/// experiments. File: a JSON array of per-MoE-layer load arrays (used every step), or an array
/// of those (step s uses entry s mod len).
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingTrace {
    steps: Vec<Vec<Vec<f64>>>,
}

impl RoutingTrace {
    pub fn load(path: &Path, moe_layers: usize, experts: usize) -> Result<Self> {
        let bad = |reason: String| ModelError::Data { path: path.to_path_buf(), reason };
        let bytes = crate::files::read_bounded(path, 64 << 20)?;
        let text = String::from_utf8(bytes).map_err(|e| bad(format!("not UTF-8 text (byte {})", e.utf8_error().valid_up_to())))?;
        let steps = lazarus_plan::parse_load_trace(&text, moe_layers, experts).map_err(|e| bad(e.to_string()))?;
        Ok(RoutingTrace { steps })
    }

    pub fn at(&self, step: u64) -> &[Vec<f64>] {
        &self.steps[(step % self.steps.len() as u64) as usize]
    }
}

/// What one step did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    /// Steps completed, this one included.
    pub step: u64,
    /// Cross-entropy (nats per token).
    pub loss: f64,
    pub aux_loss: f64,
    pub tokens: u64,
    pub lr: f64,
    pub grad_norm: f64,
    /// Tokens routed to each expert, per MoE layer.
    pub expert_load: Vec<Vec<u64>>,
    pub dropped: u64,
}

/// State saved in the manifest besides tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct TrainerState {
    config: TrainConfig,
    cursor: Cursor,
}

pub struct Trainer {
    pub config: TrainConfig,
    pub model: MoeModel,
    pub optimizer: AdamW,
    pub sampler: Sampler,
    /// Steps completed.
    pub step: u64,
    trace: Option<RoutingTrace>,
    unigram_entropy: f64,
}

impl Trainer {
    /// A fresh run on the CPU.
    pub fn new(config: TrainConfig) -> Result<Self> {
        Self::new_on(config, &Device::Cpu)
    }

    /// A fresh run with the model and optimizer state on `device` (see [`crate::device::parse`]).
    pub fn new_on(config: TrainConfig, device: &Device) -> Result<Self> {
        Self::build(config, Start::Fresh, device)
    }

    fn build(config: TrainConfig, start: Start, device: &Device) -> Result<Self> {
        let cursor = match start {
            Start::Fresh => Cursor::default(),
            Start::Resumed(c) => c,
        };
        config.validate()?;
        if config.dtype == Precision::Bf16 && device.is_cpu() {
            return Err(ModelError::config(
                "dtype",
                "bf16",
                format!("needs a GPU ({} cuda): candle's CPU matrix product has no bf16", Setting::Device),
            ));
        }
        let tokenizer = crate::tokenizer::TextTokenizer::open(config.tokenizer.as_deref())?;
        let parts = config.data.open_parts(config.model.vocab_size, &tokenizer)?;
        let unigram_entropy = crate::data::sampler::unigram_entropy(&parts)?;
        let sampler = Sampler::blend(parts, config.seq_len, config.seed, cursor)?;
        let mut model = MoeModel::new(&config.model, config.seed, DType::F32, device)?.with_compute_dtype(config.dtype.compute_dtype())?;
        if let (Some(dir), Start::Fresh) = (&config.init_from, start) {
            init_from_hf(&mut model, dir)?;
        }
        let optimizer = AdamW::new(config.optimizer.clone(), model.params())?;
        let trace = match &config.routing_trace {
            Some(p) => Some(RoutingTrace::load(p, config.model.moe_layers(), config.model.n_experts)?),
            None => None,
        };
        Ok(Trainer { config, model, optimizer, sampler, step: 0, trace, unigram_entropy })
    }

    /// Entropy of the training data's token frequencies (nats): the loss to beat.
    pub fn unigram_entropy(&self) -> f64 {
        self.unigram_entropy
    }

    pub fn done(&self) -> bool {
        self.step >= self.config.steps
    }

    pub fn step(&mut self) -> Result<StepReport> {
        let (b, t) = (self.config.batch_size, self.config.seq_len);
        let (inputs, targets) = {
            let _profile = crate::profile::phase("batch");
            let batch = self.sampler.next_batch(b)?;
            let device = self.model.device().clone();
            (Tensor::from_vec(batch.inputs, (b, t), &device)?, Tensor::from_vec(batch.targets, (b, t), &device)?)
        };
        let forced = self.trace.as_ref().map(|tr| tr.at(self.step));
        let out = {
            let _profile = crate::profile::phase("forward");
            self.model.forward(&inputs, &targets, forced)?
        };
        let grads = {
            let _profile = crate::profile::phase("backward");
            out.backward()?
        };
        let norm = {
            let _profile = crate::profile::phase("grad-norm");
            grad_norm(self.model.params(), &grads)?
        };
        // A diverged step is never applied (nor, then, saved).
        let loss = out.loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        for (what, value) in [("loss", loss), ("gradient norm", norm)] {
            if !value.is_finite() {
                return Err(ModelError::Diverged { step: self.step + 1, what, value });
            }
        }
        let lr = self.config.schedule().at(self.step);
        {
            let _profile = crate::profile::phase("adamw");
            let scale = clip_scale(norm, self.config.grad_clip);
            self.optimizer.step_with_copies(self.model.params(), &grads, lr, scale, self.model.working_copies())?;
        }
        // The loss-free balancing's bias follows the loads this step routed (not a trace's).
        if forced.is_none() {
            let loads: Vec<Vec<u64>> = out.moe.iter().map(|m| m.load.clone()).collect();
            self.model.update_route_biases(&loads)?;
        }
        self.step += 1;
        let scalar = |x: &Tensor| -> Result<f64> { Ok(x.to_dtype(DType::F64)?.to_scalar::<f64>()?) };
        let report = StepReport {
            step: self.step,
            loss: scalar(&out.ce_loss)?,
            aux_loss: scalar(&out.aux_loss)?,
            tokens: (b * t) as u64,
            lr,
            grad_norm: norm,
            expert_load: out.moe.iter().map(|m| m.load.clone()).collect(),
            dropped: out.moe.iter().map(|m| m.dropped).sum(),
        };
        // The step's graph and gradients go here, not unseen at the return: their buffers are
        // freed in this phase.
        let _profile = crate::profile::phase("release");
        drop(grads);
        drop(out);
        Ok(report)
    }

    /// Tokens the router sends to each expert of each MoE layer over the next `steps` global
    /// batches (forward only; the data cursor does not move): the loads a plan is made from
    /// before training starts.
    pub fn measure_loads(&mut self, steps: usize) -> Result<Vec<Vec<f64>>> {
        /// Sequences of one profiling forward.
        const PROFILE_SEQUENCES: usize = 256;
        let (b, t) = (self.config.batch_size, self.config.seq_len);
        let mut loads = vec![vec![0.0; self.config.model.n_experts]; self.config.model.moe_layers()];
        let batches = self.sampler.peek_batch(b * steps)?;
        let device = self.model.device().clone();
        // A few sequences at a time: each token's route is its own, and the forward of a whole
        // batch of a thousand nodes' job (17,408 sequences) held gigabytes of activations.
        for k in 0..steps {
            for first in (0..b).step_by(PROFILE_SEQUENCES) {
                let n = PROFILE_SEQUENCES.min(b - first);
                let window = (k * b + first) * t..(k * b + first + n) * t;
                let x = Tensor::from_vec(batches.inputs[window.clone()].to_vec(), (n, t), &device)?;
                let y = Tensor::from_vec(batches.targets[window].to_vec(), (n, t), &device)?;
                let out = self.model.forward(&x, &y, None)?;
                for (acc, stats) in loads.iter_mut().zip(&out.moe) {
                    acc.iter_mut().zip(&stats.load).for_each(|(a, &c)| *a += c as f64);
                }
            }
        }
        Ok(loads)
    }

    /// Write a checkpoint to `dir` (see [`checkpoint::save`]).
    pub fn save_checkpoint(&self, dir: &Path) -> Result<PathBuf> {
        let params = self.model.params();
        let weights: Vec<(String, Tensor)> = params.iter().map(|(n, v)| (n.to_string(), v.as_tensor().clone())).collect();
        let mut moments = Vec::with_capacity(2 * params.len());
        for (i, name) in params.names().iter().enumerate() {
            let s = self.optimizer.state(i)?;
            moments.push((format!("m/{name}"), s.m));
            moments.push((format!("v/{name}"), s.v));
        }
        let extra = serde_json::to_value(TrainerState { config: self.config.clone(), cursor: self.sampler.cursor() })
            .map_err(|e| ModelError::Checkpoint { path: dir.to_path_buf(), reason: e.to_string() })?;
        let manifest = Manifest {
            format_version: checkpoint::FORMAT_VERSION,
            step: self.step,
            params: params.names().to_vec(),
            optimizer_steps: self.optimizer.steps(),
            extra,
            files: Default::default(),
            run: self.config.run.clone(),
        };
        checkpoint::save(dir, &manifest, &weights, &moments, self.config.keep_checkpoints)
    }

    /// Continue a run from the checkpoint in `dir` (or `dir/latest`, or the newest intact one
    /// if that one is damaged: [`checkpoint::load_intact`], which says why). `steps`, when given,
    /// replaces the total step count; everything else comes from the checkpoint. It goes on
    /// writing checkpoints in the run's directory ([`checkpoint::run_dir_of`]).
    pub fn resume(dir: &Path, steps: Option<u64>) -> Result<Self> {
        Self::resume_on(dir, steps, &Device::Cpu)
    }

    /// [`Trainer::resume`] onto `device`: a checkpoint is the same f32 safetensors whichever
    /// device wrote it or reads it.
    pub fn resume_on(dir: &Path, steps: Option<u64>, device: &Device) -> Result<Self> {
        let (ck, state, passed) = open_checkpoint(dir)?;
        if passed {
            tracing::warn!("resuming from the newest intact checkpoint, {}", ck.path.display());
        }
        let mut config = state.config;
        if let Some(s) = steps {
            config.steps = s;
        }
        config.checkpoint_dir = Some(checkpoint::run_dir_of(dir));
        let mut trainer = Self::build(config, Start::Resumed(state.cursor), device)?;
        set_weights(&trainer.model, &ck)?;
        let params = trainer.model.params().clone();
        for (i, (name, var)) in params.iter().enumerate() {
            let (m, v) = (format!("m/{name}"), format!("v/{name}"));
            let state = TensorState {
                m: saved_tensor(&ck, &ck.optimizer, &m, var)?,
                v: saved_tensor(&ck, &ck.optimizer, &v, var)?,
                step: ck.manifest.optimizer_steps[i],
            };
            trainer.optimizer.set_state(i, state)?;
        }
        trainer.step = ck.manifest.step;
        trainer.model.refresh_working_copies()?;
        Ok(trainer)
    }
}

/// The checkpoint in `dir` (or `dir/latest`, or the newest intact one: [`checkpoint::load_intact`],
/// each one passed over said why) with the run's state its manifest keeps; whether any was
/// passed over.
fn open_checkpoint(dir: &Path) -> Result<(checkpoint::CheckpointData, TrainerState, bool)> {
    let (ck, passed) = checkpoint::load_intact(dir, &Device::Cpu)?;
    for why in &passed {
        tracing::warn!("checkpoint passed over: {why}");
    }
    let state: TrainerState = serde_json::from_value(ck.manifest.extra.clone())
        .map_err(|e| ModelError::Checkpoint { path: ck.path.clone(), reason: format!("manifest state: {e}") })?;
    Ok((ck, state, !passed.is_empty()))
}

/// The tensor `key` of `map` (one of `ck`'s) as `var` holds it — its dtype and device — after
/// checking its shape.
fn saved_tensor(
    ck: &checkpoint::CheckpointData,
    map: &std::collections::HashMap<String, Tensor>,
    key: &str,
    var: &candle_core::Var,
) -> Result<Tensor> {
    let bad = |reason: String| ModelError::Checkpoint { path: ck.path.clone(), reason };
    let t = map.get(key).ok_or_else(|| bad(format!("missing tensor {key}")))?;
    if t.shape() != var.shape() {
        return Err(bad(format!("{key} has shape {:?}, expected {:?}", t.shape(), var.shape())));
    }
    Ok(t.to_dtype(var.dtype())?.to_device(var.device())?)
}

/// `model`'s weights from `ck`, whose parameters must be the model's, by name.
fn set_weights(model: &MoeModel, ck: &checkpoint::CheckpointData) -> Result<()> {
    let params = model.params();
    if ck.manifest.params != params.names() {
        return Err(ModelError::Checkpoint {
            path: ck.path.clone(),
            reason: "parameter names differ from the model this configuration builds".into(),
        });
    }
    for (name, var) in params.iter() {
        var.set(&saved_tensor(ck, &ck.weights, name, var)?)?;
    }
    Ok(())
}

/// How a trainer starts: a new run (weights from the seed, or `init_from`), or a resumed one at
/// its data cursor (weights from its checkpoint).
#[derive(Clone, Copy)]
enum Start {
    Fresh,
    Resumed(Cursor),
}

/// `model`'s weights from the Hugging Face Mixtral, Qwen3-MoE, Qwen2-MoE or DeepSeek-V3 directory `dir`, whose configuration must be
/// the model's (the first option that differs is named).
fn init_from_hf(model: &mut MoeModel, dir: &Path) -> Result<()> {
    let (cfg, tensors) = crate::hf::load(dir)?;
    let ours = model.config();
    let pairs: [(&'static str, String, String); 12] = [
        ("vocab_size", ours.vocab_size.to_string(), cfg.vocab_size.to_string()),
        ("d_model", ours.d_model.to_string(), cfg.d_model.to_string()),
        ("n_layers", ours.n_layers.to_string(), cfg.n_layers.to_string()),
        ("n_heads", ours.n_heads.to_string(), cfg.n_heads.to_string()),
        ("n_kv_heads", ours.kv_heads().to_string(), cfg.kv_heads().to_string()),
        ("head_dim", ours.head_width().to_string(), cfg.head_width().to_string()),
        ("norm_eps", ours.norm_eps.to_string(), cfg.norm_eps.to_string()),
        ("n_experts", ours.n_experts.to_string(), cfg.n_experts.to_string()),
        ("top_k", ours.top_k.to_string(), cfg.top_k.to_string()),
        ("d_ff", ours.d_ff.to_string(), cfg.d_ff.to_string()),
        ("rope_theta", ours.rope_theta.to_string(), cfg.rope_theta.to_string()),
        ("blocks", ours.describe_blocks(), cfg.describe_blocks()),
    ];
    if let Some((field, a, b)) = pairs.into_iter().find(|(_, a, b)| a != b) {
        return Err(ModelError::config(field, a, format!("the model in {} has {b}", dir.display())));
    }
    if ours.moe_every != cfg.moe_every {
        return Err(ModelError::config("moe_every", ours.moe_every, format!("the model in {} has {}", dir.display(), cfg.moe_every)));
    }
    crate::hf::set_weights(model, &tensors, dir)?;
    model.refresh_working_copies()
}

/// The model of the checkpoint in `dir` (or `dir/latest`, or the newest intact one) on
/// `device`, with the run's configuration and the step it was saved at — the weights alone,
/// without the optimizer's state or the run's data: what evaluation needs. On a CPU the model
/// computes in f32 whatever the run's precision was. A Hugging Face Mixtral, Qwen3-MoE, Qwen2-MoE or DeepSeek-V3 directory
/// ([`crate::hf`]) loads too, as step 0 of a run with its model and the default settings.
pub fn load_model(dir: &Path, device: &Device) -> Result<(MoeModel, TrainConfig, u64)> {
    if crate::hf::is_hf_dir(dir) {
        let (cfg, tensors) = crate::hf::load(dir)?;
        let model = MoeModel::new(&cfg, 0, DType::F32, device)?;
        crate::hf::set_weights(&model, &tensors, dir)?;
        // Its tokenizer, when the directory has one beside the model.
        let tokenizer = Some(dir.join("tokenizer.json")).filter(|p| p.is_file());
        let seq_len = cfg.max_seq_len.min(TrainConfig::default().seq_len);
        let config = TrainConfig { seq_len, model: cfg, tokenizer, ..TrainConfig::default() };
        return Ok((model, config, 0));
    }
    let (ck, state, _) = open_checkpoint(dir)?;
    let config = state.config;
    config.model.validate()?;
    let compute = if device.is_cpu() { DType::F32 } else { config.dtype.compute_dtype() };
    let mut model = MoeModel::new(&config.model, config.seed, DType::F32, device)?.with_compute_dtype(compute)?;
    set_weights(&model, &ck)?;
    model.refresh_working_copies()?;
    Ok((model, config, ck.manifest.step))
}
