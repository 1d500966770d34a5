//! Hugging Face interop for models with Mixtral's or Qwen3-MoE's blocks ([`Family`]): a
//! directory of `config.json` and `model.safetensors` with transformers' `MixtralForCausalLM` or
//! `Qwen3MoeForCausalLM` parameter names, written from a model ([`export`]) and read into one
//! ([`load`], [`set_weights`]).
//!
//! The tensors differ from ours only in layout: a transformers `Linear` holds its weight as
//! [out, in] where ours is [in, out]; our packed attention projection [d, 3d] is their q, k and v
//! projections side by side; our SwiGLU expert's first weight [d, 2f] is their `w1` (the gate)
//! and `w3` (the up projection) side by side, and `w2` is the down projection (Qwen3-MoE's
//! `gate_proj`, `up_proj`, `down_proj` under `mlp.`, with `q_norm` and `k_norm`). Rotary positions
//! pair dimension i of a head with i + head/2, as their `rotate_half` does, so the weights apply
//! unchanged. A model whose options are not Mixtral's (LayerNorm, learned positions, GELU,
//! biases, shared experts, un-normalised top-k, dense blocks, a capacity factor) has no such
//! directory: [`family_mismatch`] names the first option that differs.
//!
//! Reading accepts the legacy per-expert names (`block_sparse_moe.experts.{e}.w1`) and the fused
//! ones of newer transformers (`mlp.experts.gate_up_proj` [E, 2f, d], `mlp.experts.down_proj`
//! [E, d, f], `mlp.gate.weight`); writing uses the legacy names, which every version reads. A
//! sharded directory (`model.safetensors.index.json` naming the files that hold each tensor)
//! reads as one file would. Reading refuses rather than guesses: a tensor of another shape than
//! the configuration's, a tensor with no place in the model (another architecture's, or a typo
//! in a hand-made file), and a weight that is NaN or infinite are each named.

use lazarus_setting::Setting;
use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use crate::config::{Activation, ModelConfig, NormKind, Positions};
use crate::error::{ModelError, Result};
use crate::model::{MoeModel, NORM_EPS};

/// The configuration file of a Hugging Face model directory.
pub const CONFIG_FILE: &str = "config.json";
/// Its weights in one file (what [`export`] writes).
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// How transformers' `generate` draws from the model: `lazarus generate`'s defaults.
pub const GENERATION_FILE: &str = "generation_config.json";
/// Or the index of a sharded checkpoint: `{"weight_map": {tensor: file, …}}`.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Longest `config.json` read.
const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// Longest index read (a 671 B-parameter model's is under 2 MB).
const MAX_INDEX_BYTES: u64 = 16 << 20;
/// Tensors transformers once saved that are buffers, not weights: read past.
const BUFFERS: [&str; 1] = ["rotary_emb.inv_freq"];

/// The transformers families a model goes to and from: Mixtral, or Qwen3-MoE (Mixtral's blocks
/// with query and key norms, top-k weights renormalised or not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Mixtral,
    Qwen3Moe,
}

impl Family {
    /// The family of a model's options: Qwen3-MoE's when it has query and key norms.
    pub fn of(cfg: &ModelConfig) -> Family {
        if cfg.qk_norm {
            Family::Qwen3Moe
        } else {
            Family::Mixtral
        }
    }

    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Family::Mixtral => "Mixtral",
            Family::Qwen3Moe => "Qwen3-MoE",
        }
    }

    /// transformers' `model_type`.
    fn model_type(self) -> &'static str {
        match self {
            Family::Mixtral => "mixtral",
            Family::Qwen3Moe => "qwen3_moe",
        }
    }

    /// Where an MoE block's router and experts are: `{p}.{moe}.gate.weight` and
    /// `{p}.{moe}.experts.{e}.{gate, up, down}`.
    fn moe_names(self) -> (&'static str, [&'static str; 3]) {
        match self {
            Family::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
            Family::Qwen3Moe => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        }
    }
}

/// The first option of `cfg` that its family ([`Family::of`]) does not have, as (field, what it
/// would need).
pub fn family_mismatch(cfg: &ModelConfig) -> Option<(&'static str, String)> {
    let family = Family::of(cfg);
    let name = family.name();
    let checks: [(bool, &'static str, String); 12] = [
        (cfg.norm == NormKind::Rms, "norm", format!("{name}'s norm is RMSNorm ({} rms)", Setting::Norm)),
        (cfg.positions == Positions::Rope, "positions", format!("{name} has rotary positions ({} rope)", Setting::Positions)),
        (cfg.expert_act == Activation::Swiglu, "expert_act", format!("{name}'s experts are SwiGLU ({} swiglu)", Setting::ExpertAct)),
        (!cfg.attn_bias, "attn_bias", format!("{name}'s attention has no biases ({} false)", Setting::AttnBias)),
        (!cfg.ffn_bias, "ffn_bias", format!("{name}'s experts have no biases ({} false)", Setting::FfnBias)),
        (cfg.shared_experts == 0, "shared_experts", format!("{}: {name} has no shared experts", cfg.shared_experts)),
        (cfg.moe_every == 1, "moe_every", format!("{}: {name} has an MoE layer in every block", cfg.moe_every)),
        (
            family == Family::Qwen3Moe || (cfg.top_k > 1 && cfg.normalize_top_k),
            "top_k",
            format!(
                "top-{}{}: Mixtral routes to k ≥ 2 experts with renormalised weights (Qwen3-MoE, with query and key norms, to any)",
                cfg.top_k,
                if cfg.normalize_top_k { "" } else { " unnormalised" }
            ),
        ),
        (cfg.capacity_factor.is_none(), "capacity_factor", format!("{name} is dropless")),
        (cfg.router == crate::config::RouterScore::Softmax, "router", format!("sigmoid: {name}'s router is a softmax")),
        (cfg.expert_groups == 1, "expert_groups", format!("{}: {name} routes without expert groups", cfg.expert_groups)),
        (cfg.routed_scaling == 1.0, "routed_scaling", format!("{}: {name} does not scale its routed weights", cfg.routed_scaling)),
    ];
    checks.into_iter().find(|(ok, _, _)| !ok).map(|(_, field, why)| (field, why))
}

/// `config.json` of `cfg` as transformers' `MixtralConfig` or `Qwen3MoeConfig` (f32 weights).
pub fn config_json(cfg: &ModelConfig) -> Result<Value> {
    let family = Family::of(cfg);
    if let Some((field, why)) = family_mismatch(cfg) {
        return Err(ModelError::config(field, why, format!("not a {} model: no Hugging Face export", family.name())));
    }
    // (Read in, a model starts the bias at zero: fine-tuning it with loss-free balancing is
    // fine; written out, transformers would route without it.)
    if cfg.balance.uses_bias() {
        return Err(ModelError::config(
            "balance",
            format!("{:?}", cfg.balance).to_lowercase(),
            format!(
                "{}'s router has no routing bias: transformers would choose other experts than this model ({} aux trains without one)",
                family.name(),
                Setting::Balance
            ),
        ));
    }
    let mut v = json!({
        "model_type": family.model_type(),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.d_model / cfg.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": NORM_EPS,
        "rope_theta": cfg.rope_theta,
        "sliding_window": null,
        "num_experts_per_tok": cfg.top_k,
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "output_router_logits": false,
        "tie_word_embeddings": false,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "torch_dtype": "float32",
        "use_cache": true,
    });
    let extra = match family {
        Family::Mixtral => json!({ "architectures": ["MixtralForCausalLM"], "num_local_experts": cfg.n_experts }),
        Family::Qwen3Moe => json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": cfg.n_experts,
            "moe_intermediate_size": cfg.d_ff,
            "norm_topk_prob": cfg.normalize_top_k,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "attention_bias": false,
            "use_sliding_window": false,
        }),
    };
    if let (Some(map), Value::Object(more)) = (v.as_object_mut(), extra) {
        map.extend(more);
    }
    Ok(v)
}

/// How one of our tensors is one or more of theirs.
enum Layout {
    /// The same tensor.
    Same(String),
    /// Transposed ([in, out] here, [out, in] there).
    Transposed(String),
    /// Side by side along our columns, each transposed: ours [in, Σ outs] = [t₁ᵀ | t₂ᵀ | …].
    Columns(Vec<String>),
}

/// Where each of our parameters is among transformers' (legacy names), in our order; an error
/// for a model of no family (whose parameters would not all have a place).
fn layouts(model: &MoeModel) -> Result<Vec<(String, Layout)>> {
    let family = Family::of(model.config());
    if let Some((field, why)) = family_mismatch(model.config()) {
        return Err(ModelError::config(field, why, format!("not a {} model: no Hugging Face layout", family.name())));
    }
    let (moe, [gate, up, down]) = family.moe_names();
    let mut out = Vec::new();
    for (name, _) in model.params().iter() {
        let theirs = match name.split('.').collect::<Vec<_>>().as_slice() {
            ["tok_emb"] => Layout::Same("model.embed_tokens.weight".into()),
            ["ln_f", "w"] => Layout::Same("model.norm.weight".into()),
            ["head", "w"] => Layout::Transposed("lm_head.weight".into()),
            ["blocks", b, rest @ ..] => {
                let p = format!("model.layers.{b}");
                match rest {
                    ["ln1", "w"] => Layout::Same(format!("{p}.input_layernorm.weight")),
                    ["ln2", "w"] => Layout::Same(format!("{p}.post_attention_layernorm.weight")),
                    ["attn", "qkv", "w"] => {
                        Layout::Columns(["q", "k", "v"].iter().map(|x| format!("{p}.self_attn.{x}_proj.weight")).collect())
                    }
                    ["attn", "out", "w"] => Layout::Transposed(format!("{p}.self_attn.o_proj.weight")),
                    ["attn", "q_norm", "w"] => Layout::Same(format!("{p}.self_attn.q_norm.weight")),
                    ["attn", "k_norm", "w"] => Layout::Same(format!("{p}.self_attn.k_norm.weight")),
                    ["moe", "gate", "w"] => Layout::Transposed(format!("{p}.{moe}.gate.weight")),
                    // The loss-free balancing's bias: these families have none (it starts at zero).
                    ["moe", "gate", "bias"] => continue,
                    ["moe", "experts", e, "fc1", "w"] => {
                        Layout::Columns([gate, up].iter().map(|x| format!("{p}.{moe}.experts.{e}.{x}.weight")).collect())
                    }
                    ["moe", "experts", e, "fc2", "w"] => Layout::Transposed(format!("{p}.{moe}.experts.{e}.{down}.weight")),
                    _ => return Err(unmapped(name)),
                }
            }
            _ => return Err(unmapped(name)),
        };
        out.push((name.to_string(), theirs));
    }
    Ok(out)
}

fn unmapped(name: &str) -> ModelError {
    ModelError::config("parameter", name, "has no place in a Hugging Face Mixtral or Qwen3-MoE")
}

/// transformers' largest shard by default ("5GB" in transformers 4; the Hub counts decimal
/// bytes): a model past it is written as shards with an index.
pub const MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Write `model` (every expert held here) as a Hugging Face directory of its family in `dir`,
/// which must not hold a `config.json`, `model.safetensors` or index already; in shards of at
/// most [`MAX_SHARD_BYTES`] ([`export_sharded`]).
pub fn export(model: &MoeModel, dir: &Path) -> Result<()> {
    export_sharded(model, dir, MAX_SHARD_BYTES)
}

/// [`export`] in shards of at most `max_shard_bytes` of tensor data each (a larger tensor alone
/// in its own), as transformers writes them: one `model.safetensors` when the model fits in
/// one, else `model-00001-of-0000N.safetensors`… and `model.safetensors.index.json` naming each
/// tensor's file; beside them `generation_config.json` (`lazarus generate`'s sampling). Each
/// shard is made and written in turn, so memory holds one shard's bytes.
pub fn export_sharded(model: &MoeModel, dir: &Path, max_shard_bytes: u64) -> Result<()> {
    let config = config_json(model.config())?;
    let layouts = layouts(model)?;
    for file in [CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE, GENERATION_FILE] {
        if dir.join(file).exists() {
            return Err(ModelError::io(
                dir.join(file),
                std::io::Error::new(std::io::ErrorKind::AlreadyExists, "already exists: not written over"),
            ));
        }
    }
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for (ours, layout) in layouts {
        let t = model.params().get(&ours).expect("a parameter of the model").as_tensor().to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
        if t.elem_count() == 0 {
            return Err(ModelError::config("expert", ours, "is not held by this process: export a checkpoint, not a worker's model"));
        }
        match layout {
            Layout::Same(n) => tensors.push((n, t)),
            Layout::Transposed(n) => tensors.push((n, t.t()?.contiguous()?)),
            Layout::Columns(names) => {
                let width = t.dim(1)? / names.len();
                for (i, n) in names.into_iter().enumerate() {
                    tensors.push((n, t.narrow(1, i * width, width)?.t()?.contiguous()?));
                }
            }
        }
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let text = serde_json::to_string_pretty(&config).map_err(|e| ModelError::config("config", e, "not serialisable"))?;
    let sizes: Vec<u64> = tensors.iter().map(|(_, t)| (t.elem_count() * DType::F32.size_in_bytes()) as u64).collect();
    let shards = shard_ranges(&sizes, max_shard_bytes);
    let file_of = |i: usize| {
        if shards.len() == 1 {
            WEIGHTS_FILE.to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, shards.len())
        }
    };
    // The weights first, the index and the configuration last: a directory with a config.json
    // is complete. An export that fails (a full disk) takes back what it wrote, so that it can
    // be run again.
    let made_dir = !dir.exists();
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let mut written: Vec<std::path::PathBuf> = Vec::new();
    let result = (|| -> Result<()> {
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        for (i, range) in shards.iter().enumerate() {
            let path = dir.join(file_of(i));
            let part: Vec<(&str, &Tensor)> = tensors[range.clone()].iter().map(|(n, t)| (n.as_str(), t)).collect();
            let bytes = safetensors::serialize(part, Some(meta.clone()))
                .map_err(|e| ModelError::Checkpoint { path: path.clone(), reason: e.to_string() })?;
            write_new(&path, &bytes)?;
            written.push(path);
        }
        if shards.len() > 1 {
            let weight_map: serde_json::Map<String, Value> = shards
                .iter()
                .enumerate()
                .flat_map(|(i, r)| tensors[r.clone()].iter().map(move |(n, _)| (n.clone(), json!(file_of(i)))))
                .collect();
            let parameters: usize = tensors.iter().map(|(_, t)| t.elem_count()).sum();
            let index = json!({
                "metadata": { "total_size": sizes.iter().sum::<u64>(), "total_parameters": parameters },
                "weight_map": weight_map,
            });
            write_new(&dir.join(INDEX_FILE), index.to_string().as_bytes())?;
            written.push(dir.join(INDEX_FILE));
        }
        let sampling = crate::generate::Sampling::default();
        let generation = json!({
            "do_sample": sampling.temperature > 0.0,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "max_new_tokens": sampling.tokens,
        });
        write_new(&dir.join(GENERATION_FILE), generation.to_string().as_bytes())?;
        written.push(dir.join(GENERATION_FILE));
        write_new(&dir.join(CONFIG_FILE), text.as_bytes())
    })();
    if result.is_err() {
        written.iter().for_each(|p| {
            let _ = std::fs::remove_file(p);
        });
        if made_dir {
            let _ = std::fs::remove_dir(dir); // only if empty
        }
    }
    result
}

/// Tensors of `sizes` bytes (in file order) grouped into shards of at most `max` bytes, each
/// tensor in the first shard it fits after the previous one's (huggingface_hub's rule): a
/// tensor larger than `max` has a shard of its own; never an empty shard.
fn shard_ranges(sizes: &[u64], max: u64) -> Vec<std::ops::Range<usize>> {
    let mut shards = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, &s) in sizes.iter().enumerate() {
        if i > start && bytes.saturating_add(s) > max {
            shards.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes = bytes.saturating_add(s);
    }
    shards.push(start..sizes.len());
    shards
}

/// Write `bytes` to a new file at `path` (through a temporary name, synced, then renamed); on
/// failure nothing is left behind.
pub fn write_new(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let written = std::fs::File::create(&tmp).and_then(|mut f| f.write_all(bytes).and_then(|_| f.sync_all()));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(ModelError::io(&tmp, e));
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        ModelError::io(path, e)
    })
}

/// Whether `dir` looks like a Hugging Face model directory (a `config.json` beside a
/// `model.safetensors` or a sharded checkpoint's index).
pub fn is_hf_dir(dir: &Path) -> bool {
    dir.join(CONFIG_FILE).is_file() && (dir.join(WEIGHTS_FILE).is_file() || dir.join(INDEX_FILE).is_file())
}

/// Our configuration of the Mixtral model described by `config.json` at `path`, or an error
/// naming the first field we cannot follow.
pub fn config_from_json(v: &Value, path: &Path) -> Result<ModelConfig> {
    let bad = |field: &str, reason: String| ModelError::Checkpoint { path: path.to_path_buf(), reason: format!("{field}: {reason}") };
    let int = |field: &str| -> Result<usize> {
        v.get(field).and_then(Value::as_u64).map(|x| x as usize).ok_or_else(|| bad(field, "missing or not a whole number".into()))
    };
    let num = |field: &str| v.get(field).and_then(Value::as_f64);
    let family = match v.get("model_type").and_then(Value::as_str) {
        Some("mixtral") => Family::Mixtral,
        Some("qwen3_moe") => Family::Qwen3Moe,
        other => return Err(bad("model_type", format!("{other:?}: only Mixtral and Qwen3-MoE checkpoints are read"))),
    };
    if family == Family::Qwen3Moe {
        qwen3_moe_supported(v).map_err(|(field, reason)| bad(field, reason))?;
    }
    let (d, heads) = (int("hidden_size")?, int("num_attention_heads")?);
    // transformers' MixtralConfig has 8 key/value heads unless it says otherwise.
    let kv = v.get("num_key_value_heads").and_then(Value::as_u64).unwrap_or(8);
    if kv as usize != heads {
        return Err(bad("num_key_value_heads", format!("{kv} of {heads} heads: grouped-query attention is not supported")));
    }
    if let Some(hd) = v.get("head_dim").and_then(Value::as_u64) {
        if heads == 0 || hd as usize * heads != d {
            return Err(bad("head_dim", format!("{hd}: only hidden_size / num_attention_heads is supported")));
        }
    }
    match v.get("hidden_act").and_then(Value::as_str) {
        None | Some("silu") => {}
        Some(other) => return Err(bad("hidden_act", format!("{other:?}: only silu (SwiGLU) is supported"))),
    }
    if v.get("tie_word_embeddings").and_then(Value::as_bool) == Some(true) {
        return Err(bad("tie_word_embeddings", "true: tied embeddings are not supported".into()));
    }
    let max_pos = int("max_position_embeddings")?;
    if let Some(w) = v.get("sliding_window").and_then(Value::as_u64) {
        if (w as usize) < max_pos {
            return Err(bad("sliding_window", format!("{w}: sliding-window attention is not supported")));
        }
    }
    if let Some(eps) = num("rms_norm_eps") {
        if (eps - NORM_EPS).abs() > 1e-12 {
            return Err(bad("rms_norm_eps", format!("{eps}: only {NORM_EPS} is supported")));
        }
    }
    // rope_theta at the top (transformers 4) or in rope_parameters (5), with the default type.
    let rope = v.get("rope_parameters").or_else(|| v.get("rope_scaling")).filter(|r| !r.is_null());
    if let Some(kind) = rope.and_then(|r| r.get("rope_type").or_else(|| r.get("type"))).and_then(Value::as_str) {
        if kind != "default" {
            return Err(bad("rope_parameters", format!("rope_type {kind:?}: only the default rotary positions are supported")));
        }
    }
    let theta = num("rope_theta").or_else(|| rope.and_then(|r| r.get("rope_theta")).and_then(Value::as_f64)).unwrap_or(1e6);
    let cfg = ModelConfig {
        vocab_size: int("vocab_size")?,
        d_model: d,
        n_layers: int("num_hidden_layers")?,
        n_heads: heads,
        max_seq_len: max_pos,
        // (Qwen3-MoE's files say num_experts; transformers 5 writes num_local_experts for both.)
        n_experts: match family {
            Family::Qwen3Moe if v.get("num_experts").is_some() => int("num_experts")?,
            _ => int("num_local_experts")?,
        },
        top_k: int("num_experts_per_tok")?,
        d_ff: int(if family == Family::Qwen3Moe { "moe_intermediate_size" } else { "intermediate_size" })?,
        // transformers' MixtralConfig and Qwen3MoeConfig default when the file does not say.
        aux_loss_coef: num("router_aux_loss_coef").unwrap_or(0.001),
        init_std: num("initializer_range").unwrap_or(0.02),
        rope_theta: theta,
        ..match family {
            Family::Mixtral => ModelConfig::default().mixtral(),
            Family::Qwen3Moe => ModelConfig {
                normalize_top_k: v.get("norm_topk_prob").and_then(Value::as_bool).unwrap_or(false),
                ..ModelConfig::default().qwen_moe()
            },
        }
    };
    cfg.validate().map_err(|e| bad("config", e.to_string()))?;
    if let Some((field, why)) = family_mismatch(&cfg) {
        return Err(bad(field, why));
    }
    Ok(cfg)
}

/// What a Qwen3-MoE `config.json` may say beyond Mixtral's fields: an MoE layer in every block,
/// no attention biases, no sliding window; else (field, why).
fn qwen3_moe_supported(v: &Value) -> std::result::Result<(), (&'static str, String)> {
    if let Some(step) = v.get("decoder_sparse_step").and_then(Value::as_u64).filter(|&s| s != 1) {
        return Err(("decoder_sparse_step", format!("{step}: only an MoE layer in every block is supported")));
    }
    if v.get("mlp_only_layers").and_then(Value::as_array).is_some_and(|l| !l.is_empty()) {
        return Err(("mlp_only_layers", "dense blocks among the MoE ones are not supported".into()));
    }
    if v.get("attention_bias").and_then(Value::as_bool) == Some(true) {
        return Err(("attention_bias", "true: attention biases are not supported".into()));
    }
    if v.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
        return Err(("use_sliding_window", "true: sliding-window attention is not supported".into()));
    }
    Ok(())
}

/// Our configuration of the Mixtral or Qwen3-MoE model in `dir` (its `config.json`).
pub fn read_config(dir: &Path) -> Result<ModelConfig> {
    let config_path = dir.join(CONFIG_FILE);
    let len = std::fs::metadata(&config_path).map_err(|e| ModelError::io(&config_path, e))?.len();
    if len > MAX_CONFIG_BYTES {
        return Err(ModelError::Checkpoint { path: config_path, reason: format!("{len} bytes: not a model configuration") });
    }
    let text = std::fs::read_to_string(&config_path).map_err(|e| ModelError::io(&config_path, e))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| ModelError::Checkpoint { path: config_path.clone(), reason: e.to_string() })?;
    config_from_json(&v, &config_path)
}

/// A Hugging Face Mixtral or Qwen3-MoE directory: our configuration of it and its tensors (f32, on the CPU),
/// from its one weights file or from every shard its index names.
pub fn load(dir: &Path) -> Result<(ModelConfig, HashMap<String, Tensor>)> {
    let cfg = read_config(dir)?;
    let mut tensors = HashMap::new();
    for (file, expected) in weight_files(dir)? {
        let read = candle_core::safetensors::load(&file, &Device::Cpu)
            .map_err(|e| ModelError::Checkpoint { path: file.clone(), reason: e.to_string() })?;
        if let Some(missing) = expected.iter().find(|n| !read.contains_key(*n)) {
            let reason = format!("{INDEX_FILE} says it holds tensor {missing}, but it does not");
            return Err(ModelError::Checkpoint { path: file, reason });
        }
        for (name, t) in read {
            if !expected.is_empty() && !expected.contains(&name) {
                continue; // a shard may hold more than the index names: the index decides
            }
            let t = t.to_dtype(DType::F32)?;
            if tensors.insert(name.clone(), t).is_some() {
                return Err(ModelError::Checkpoint { path: file, reason: format!("tensor {name} is in two of the shards") });
            }
        }
    }
    Ok((cfg, tensors))
}

/// The files holding `dir`'s weights, each with the tensors its index says it holds (empty for
/// a lone `model.safetensors`: all of it). An index's file names must be plain names in `dir`.
fn weight_files(dir: &Path) -> Result<Vec<(std::path::PathBuf, Vec<String>)>> {
    let single = dir.join(WEIGHTS_FILE);
    if single.is_file() {
        return Ok(vec![(single, Vec::new())]);
    }
    let index = dir.join(INDEX_FILE);
    let bad = |reason: String| ModelError::Checkpoint { path: index.clone(), reason };
    let len = std::fs::metadata(&index).map_err(|e| ModelError::io(&index, e))?.len();
    if len > MAX_INDEX_BYTES {
        return Err(bad(format!("{len} bytes: not an index of tensors (at most {MAX_INDEX_BYTES})")));
    }
    let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let Some(map) = v.get("weight_map").and_then(Value::as_object) else {
        return Err(bad("no \"weight_map\" object (tensor name to file)".into()));
    };
    let mut files: std::collections::BTreeMap<String, Vec<String>> = std::collections::BTreeMap::new();
    for (tensor, file) in map {
        let Some(file) = file.as_str() else { return Err(bad(format!("weight_map[{tensor:?}] is {file}, not a file name"))) };
        let plain = Path::new(file).file_name().is_some_and(|n| n == file) && file != "." && file != "..";
        if !plain {
            return Err(bad(format!("weight_map[{tensor:?}] = {file:?}: not a file name in the directory")));
        }
        files.entry(file.to_string()).or_default().push(tensor.clone());
    }
    if files.is_empty() {
        return Err(bad("its weight_map names no tensor".into()));
    }
    Ok(files.into_iter().map(|(f, names)| (dir.join(f), names)).collect())
}

/// Set every parameter of `model` from a Mixtral directory's `tensors` (legacy or fused expert
/// names); `dir` names the directory in errors. Refused, each named: a tensor the model needs
/// that is missing or of another shape, a tensor with no place in the model, and a weight that
/// is not finite.
pub fn set_weights(model: &MoeModel, tensors: &HashMap<String, Tensor>, dir: &Path) -> Result<()> {
    let bad = |reason: String| ModelError::Checkpoint { path: dir.to_path_buf(), reason };
    let layouts = layouts(model)?;
    refuse_non_finite(tensors, dir)?;
    let mut used: std::collections::HashSet<String> = std::collections::HashSet::new();
    // A tensor of transformers' names with the shape `want`, from the legacy name or the fused one.
    let mut fetch = |name: &str, want: &[usize]| -> Result<Tensor> {
        let (t, source) = match tensors.get(name) {
            Some(t) => (t.clone(), name.to_string()),
            None => match fused(tensors, name) {
                Some((source, picked)) => (picked.map_err(|e| bad(format!("tensor {source}: {e}")))?, source),
                None => return Err(bad(format!("missing tensor {name}"))),
            },
        };
        if t.dims() != want {
            let seen = if source == name {
                format!("tensor {name} is {:?}", t.dims())
            } else {
                format!("tensor {source} gives {name} {:?}", t.dims())
            };
            return Err(bad(format!("{seen}; the model of its config.json needs {want:?}")));
        }
        used.insert(source);
        Ok(t)
    };
    for (ours, layout) in layouts {
        let var = model.params().get(&ours).expect("a parameter of the model");
        let dims = var.dims().to_vec();
        let t = match layout {
            Layout::Same(n) => fetch(&n, &dims)?,
            Layout::Transposed(n) => fetch(&n, &[dims[1], dims[0]])?.t()?.contiguous()?,
            Layout::Columns(names) => {
                let want = [dims[1] / names.len(), dims[0]];
                let parts = names.iter().map(|n| Ok(fetch(n, &want)?.t()?)).collect::<Result<Vec<_>>>()?;
                Tensor::cat(&parts, 1)?
            }
        };
        var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
    }
    let mut extra: Vec<&String> = tensors.keys().filter(|n| !used.contains(*n) && !BUFFERS.iter().any(|b| n.ends_with(b))).collect();
    extra.sort();
    if let Some(first) = extra.first() {
        let more = if extra.len() > 1 { format!(" (and {} more)", extra.len() - 1) } else { String::new() };
        return Err(bad(format!(
            "tensor {first}{more} has no place in a Mixtral model of its config.json: another architecture's weights, or a file not made for it"
        )));
    }
    Ok(())
}

/// An error naming the first tensor (by name) holding a NaN or an infinity: such a weight
/// trains to NaN at the first step, long after the cause is hard to see.
fn refuse_non_finite(tensors: &HashMap<String, Tensor>, dir: &Path) -> Result<()> {
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    for name in names {
        let t = tensors[name].to_dtype(DType::F32)?;
        // x − x is 0 for every finite x and NaN for NaN and ±∞: one sum tells.
        let s = t.sub(&t)?.sum_all()?.to_scalar::<f32>()?;
        if !s.is_finite() {
            let flat: Vec<f32> = t.flatten_all()?.to_vec1()?;
            let (at, v) = flat.iter().enumerate().find(|(_, v)| !v.is_finite()).map(|(i, v)| (i, *v)).unwrap_or((0, f32::NAN));
            return Err(ModelError::Checkpoint {
                path: dir.to_path_buf(),
                reason: format!("tensor {name} holds {v} (element {at} of {}): weights must be finite", flat.len()),
            });
        }
    }
    Ok(())
}

/// A legacy per-expert (or router) tensor name read from newer transformers' fused layout:
/// `model.layers.{b}.mlp.experts.gate_up_proj` [E, 2f, d] (gate rows, then up rows) and
/// `…down_proj` [E, d, f], the router at `…mlp.gate.weight` — with the fused tensor's name. None
/// when the name is not one of those or the file does not have the fused tensor either.
fn fused(tensors: &HashMap<String, Tensor>, name: &str) -> Option<(String, Result<Tensor>)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (b, rest) = rest.split_once('.')?;
    let moe = rest.strip_prefix("block_sparse_moe.").or_else(|| rest.strip_prefix("mlp."))?;
    let found = |source: String, pick: &dyn Fn(&Tensor) -> Result<Tensor>| {
        tensors.get(&source).map(|t| {
            let r = pick(t);
            (source, r)
        })
    };
    if moe == "gate.weight" {
        return found(format!("model.layers.{b}.mlp.gate.weight"), &|t: &Tensor| Ok(t.clone()));
    }
    let (e, which) = moe.strip_prefix("experts.")?.split_once('.')?;
    let e: usize = e.parse().ok()?;
    let experts = format!("model.layers.{b}.mlp.experts");
    let pick = |t: &Tensor| -> Result<Tensor> {
        if t.rank() != 3 || e >= t.dim(0)? {
            return Err(ModelError::config("tensor", format!("{:?}", t.dims()), format!("a stack of experts [E, …] with expert {e}")));
        }
        let one = t.get(e)?;
        Ok(match which {
            "w1.weight" | "gate_proj.weight" => one.narrow(0, 0, one.dim(0)? / 2)?,
            "w3.weight" | "up_proj.weight" => one.narrow(0, one.dim(0)? / 2, one.dim(0)? / 2)?,
            _ => one,
        })
    };
    match which {
        "w1.weight" | "w3.weight" | "gate_proj.weight" | "up_proj.weight" => found(format!("{experts}.gate_up_proj"), &pick),
        "w2.weight" | "down_proj.weight" => found(format!("{experts}.down_proj"), &pick),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every parameter of `a` and `b` the same, bit for bit (named when not).
    fn assert_same_weights(a: &MoeModel, b: &MoeModel) {
        for ((name, x), (_, y)) in a.params().iter().zip(b.params().iter()) {
            let (x, y): (Vec<f32>, Vec<f32>) =
                (x.as_tensor().flatten_all().unwrap().to_vec1().unwrap(), y.as_tensor().flatten_all().unwrap().to_vec1().unwrap());
            assert_eq!(x, y, "{name}");
        }
    }

    fn tiny() -> ModelConfig {
        ModelConfig {
            vocab_size: 19,
            d_model: 16,
            n_layers: 2,
            n_heads: 2,
            max_seq_len: 12,
            n_experts: 4,
            top_k: 2,
            d_ff: 8,
            ..ModelConfig::default().mixtral()
        }
    }

    /// Export, then read back into a fresh model: every tensor the same, the configuration
    /// the same; the directory's names are transformers' legacy ones; a second export into the
    /// same directory is refused.
    #[test]
    fn an_export_reads_back_into_the_same_model() {
        let dir = std::env::temp_dir().join(format!("lazarus-hf-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let m = MoeModel::new(&tiny(), 3, DType::F32, &Device::Cpu).unwrap();
        export(&m, &dir).unwrap();
        let (cfg, tensors) = load(&dir).unwrap();
        assert_eq!(cfg, ModelConfig { aux_loss_coef: tiny().aux_loss_coef, ..tiny() });
        assert!(tensors.contains_key("model.layers.1.block_sparse_moe.experts.3.w3.weight"));
        let generation: Value = serde_json::from_str(&std::fs::read_to_string(dir.join(GENERATION_FILE)).unwrap()).unwrap();
        assert_eq!((generation["do_sample"].as_bool(), generation["top_k"].as_u64()), (Some(true), Some(40)));
        assert_eq!(tensors["model.layers.0.self_attn.q_proj.weight"].dims(), [16, 16]);
        assert_eq!(tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight"].dims(), [8, 16]);
        let back = MoeModel::new(&cfg, 99, DType::F32, &Device::Cpu).unwrap();
        set_weights(&back, &tensors, &dir).unwrap();
        assert_same_weights(&m, &back);
        assert!(export(&m, &dir).unwrap_err().to_string().contains("already exists"));
        std::fs::remove_dir_all(&dir).unwrap();
        // A model that is not Mixtral's is refused before anything is written, and its weights
        // cannot be set from a Mixtral's (its dense blocks would have no place).
        let dense = MoeModel::new(&ModelConfig { moe_every: 2, ..tiny() }, 3, DType::F32, &Device::Cpu).unwrap();
        assert!(export(&dense, &dir).unwrap_err().to_string().contains("moe_every"));
        assert!(!dir.exists());
        assert!(set_weights(&dense, &tensors, &dir).unwrap_err().to_string().contains("moe_every"));
        // A Mixtral fine-tuned with loss-free balancing takes every weight; its bias starts at
        // zero (transformers' Mixtral has none), and it is not written back as a Mixtral.
        let biased = MoeModel::new(&ModelConfig { balance: crate::config::Balance::Bias, ..cfg }, 4, DType::F32, &Device::Cpu).unwrap();
        set_weights(&biased, &tensors, &dir).unwrap();
        assert_eq!(biased.route_bias(1).unwrap().unwrap().as_tensor().to_vec1::<f32>().unwrap(), vec![0.0; 4]);
        assert_eq!(biased.gate(1).unwrap().as_tensor().to_vec2::<f32>().unwrap(), m.gate(1).unwrap().as_tensor().to_vec2::<f32>().unwrap());
        assert!(export(&biased, &dir).unwrap_err().to_string().contains("balance"));
    }

    /// A Qwen3-MoE (query and key norms, top-3 unnormalised) goes out under transformers'
    /// Qwen3-MoE names and comes back the same model; its fused expert tensors read too.
    #[test]
    fn a_qwen3_moe_export_reads_back_into_the_same_model() {
        let dir = std::env::temp_dir().join(format!("lazarus-hf-qwen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = ModelConfig { top_k: 3, normalize_top_k: false, ..tiny().qwen_moe() };
        let m = MoeModel::new(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
        export(&m, &dir).unwrap();
        let (back_cfg, tensors) = load(&dir).unwrap();
        assert_eq!(back_cfg, ModelConfig { aux_loss_coef: cfg.aux_loss_coef, ..cfg.clone() });
        assert_eq!(tensors["model.layers.1.self_attn.k_norm.weight"].dims(), [8]);
        assert_eq!(tensors["model.layers.0.mlp.experts.2.up_proj.weight"].dims(), [8, 16]);
        assert!(tensors.keys().all(|n| !n.contains("block_sparse_moe")));
        let back = MoeModel::new(&back_cfg, 99, DType::F32, &Device::Cpu).unwrap();
        set_weights(&back, &tensors, &dir).unwrap();
        assert_same_weights(&m, &back);
        // transformers 5's fused layout: gate and up rows stacked per expert, down per expert.
        let mut fused_map: HashMap<String, Tensor> =
            tensors.iter().filter(|(n, _)| !n.contains(".experts.")).map(|(n, t)| (n.clone(), t.clone())).collect();
        for b in 0..2 {
            let one = |e: usize, w: &str| tensors[&format!("model.layers.{b}.mlp.experts.{e}.{w}.weight")].clone();
            let gate_up: Vec<Tensor> = (0..4).map(|e| Tensor::cat(&[one(e, "gate_proj"), one(e, "up_proj")], 0).unwrap()).collect();
            let down: Vec<Tensor> = (0..4).map(|e| one(e, "down_proj")).collect();
            fused_map.insert(format!("model.layers.{b}.mlp.experts.gate_up_proj"), Tensor::stack(&gate_up, 0).unwrap());
            fused_map.insert(format!("model.layers.{b}.mlp.experts.down_proj"), Tensor::stack(&down, 0).unwrap());
        }
        let fused_back = MoeModel::new(&back_cfg, 7, DType::F32, &Device::Cpu).unwrap();
        set_weights(&fused_back, &fused_map, &dir).unwrap();
        assert_same_weights(&m, &fused_back);
        // A Qwen3-MoE config with what is not supported is named.
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(dir.join(CONFIG_FILE)).unwrap()).unwrap();
        v["decoder_sparse_step"] = json!(2);
        assert!(config_from_json(&v, &dir).unwrap_err().to_string().contains("decoder_sparse_step"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Shards as huggingface_hub cuts them: in order, each up to the limit, a larger tensor
    /// alone.
    #[test]
    fn shards_hold_at_most_the_limit_in_order() {
        assert_eq!(shard_ranges(&[4, 4, 4], 8), vec![0..2, 2..3]);
        assert_eq!(shard_ranges(&[10, 1, 1], 4), vec![0..1, 1..3]);
        assert_eq!(shard_ranges(&[1, 1], 100), vec![0..2]);
        assert_eq!(shard_ranges(&[5, 5], 1), vec![0..1, 1..2]);
    }

    /// Past the shard size the export is shards and an index, which read back as one file
    /// would; the index's total is the tensors' bytes.
    #[test]
    fn a_sharded_export_reads_back_into_the_same_model() {
        let dir = std::env::temp_dir().join(format!("lazarus-hf-export-shards-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let m = MoeModel::new(&tiny(), 3, DType::F32, &Device::Cpu).unwrap();
        export_sharded(&m, &dir, 4096).unwrap();
        assert!(!dir.join(WEIGHTS_FILE).exists());
        let index: Value = serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX_FILE)).unwrap()).unwrap();
        let files: std::collections::BTreeSet<&str> =
            index["weight_map"].as_object().unwrap().values().map(|f| f.as_str().unwrap()).collect();
        let n = files.len();
        assert!(n > 2, "{files:?}");
        assert_eq!(files.iter().next().copied(), Some(format!("model-00001-of-{n:05}.safetensors").as_str()));
        for f in &files {
            let len = std::fs::metadata(dir.join(f)).unwrap().len();
            // A shard's tensors fit the limit unless one alone is larger (the token embedding).
            assert!(len <= 4096 + 1024 || f.contains("00001"), "{f}: {len} bytes");
        }
        assert_eq!(index["metadata"]["total_size"].as_u64().unwrap() as usize, m.params().num_elements() * 4);
        let (cfg, tensors) = load(&dir).unwrap();
        let back = MoeModel::new(&cfg, 99, DType::F32, &Device::Cpu).unwrap();
        set_weights(&back, &tensors, &dir).unwrap();
        assert_same_weights(&m, &back);
        assert!(export(&m, &dir).unwrap_err().to_string().contains("already exists"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The fused expert layout of newer transformers reads as the legacy one.
    #[test]
    fn fused_expert_tensors_read_as_the_legacy_ones() {
        let m = MoeModel::new(&tiny(), 5, DType::F32, &Device::Cpu).unwrap();
        let dir = std::env::temp_dir().join(format!("lazarus-hf-fused-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        export(&m, &dir).unwrap();
        let (_, legacy) = load(&dir).unwrap();
        let mut fused_map: HashMap<String, Tensor> = HashMap::new();
        for (n, t) in &legacy {
            if !n.contains("block_sparse_moe") {
                fused_map.insert(n.clone(), t.clone());
            }
        }
        for b in 0..2 {
            let p = format!("model.layers.{b}.block_sparse_moe");
            let stack = |f: &dyn Fn(usize) -> Tensor| Tensor::stack(&(0..4).map(f).collect::<Vec<_>>(), 0).unwrap();
            let gate_up = stack(&|e| {
                Tensor::cat(&[&legacy[&format!("{p}.experts.{e}.w1.weight")], &legacy[&format!("{p}.experts.{e}.w3.weight")]], 0).unwrap()
            });
            let down = stack(&|e| legacy[&format!("{p}.experts.{e}.w2.weight")].clone());
            fused_map.insert(format!("model.layers.{b}.mlp.experts.gate_up_proj"), gate_up);
            fused_map.insert(format!("model.layers.{b}.mlp.experts.down_proj"), down);
            fused_map.insert(format!("model.layers.{b}.mlp.gate.weight"), legacy[&format!("{p}.gate.weight")].clone());
        }
        let a = MoeModel::new(&tiny(), 7, DType::F32, &Device::Cpu).unwrap();
        set_weights(&a, &legacy, &dir).unwrap();
        let b = MoeModel::new(&tiny(), 8, DType::F32, &Device::Cpu).unwrap();
        set_weights(&b, &fused_map, &dir).unwrap();
        assert_same_weights(&a, &b);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// What is not Mixtral is named: in our configuration on export, in theirs on import.
    #[test]
    fn what_does_not_match_is_named() {
        let cases = [
            (ModelConfig::default(), "norm"),
            (ModelConfig { shared_experts: 1, ..tiny() }, "shared_experts"),
            (ModelConfig { ffn_bias: true, ..tiny() }, "ffn_bias"),
            (ModelConfig { normalize_top_k: false, ..tiny() }, "top_k"),
            (ModelConfig { top_k: 1, ..tiny() }, "top_k"),
            (ModelConfig { balance: crate::config::Balance::Both, ..tiny() }, "balance"),
        ];
        for (cfg, field) in cases {
            let e = config_json(&cfg).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
        let good = config_json(&tiny()).unwrap();
        let path = Path::new("config.json");
        assert_eq!(config_from_json(&good, path).unwrap().d_model, 16);
        for (key, value, named) in [
            ("model_type", json!("llama"), "model_type"),
            ("num_key_value_heads", json!(1), "num_key_value_heads"),
            ("hidden_act", json!("gelu"), "hidden_act"),
            ("tie_word_embeddings", json!(true), "tie_word_embeddings"),
            ("sliding_window", json!(4), "sliding_window"),
            ("rms_norm_eps", json!(1e-6), "rms_norm_eps"),
            ("num_experts_per_tok", json!(1), "top_k"),
            ("hidden_size", json!("wide"), "hidden_size"),
            ("num_local_experts", json!(100_000_000u64), "n_experts"),
        ] {
            let mut v = good.clone();
            v[key] = value;
            let e = config_from_json(&v, path).unwrap_err().to_string();
            assert!(e.contains(named), "{key}: {e}");
        }
    }

    /// A directory with `tensors` (and the configuration of `tiny()`), in one file or in two
    /// shards with an index.
    fn write_dir(name: &str, tensors: &HashMap<String, Tensor>, sharded: bool) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("lazarus-hf-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(CONFIG_FILE), serde_json::to_string(&config_json(&tiny()).unwrap()).unwrap()).unwrap();
        if !sharded {
            candle_core::safetensors::save(tensors, dir.join(WEIGHTS_FILE)).unwrap();
            return dir;
        }
        let mut names: Vec<&String> = tensors.keys().collect();
        names.sort();
        let (a, b) = names.split_at(names.len() / 2);
        let mut map = serde_json::Map::new();
        for (file, part) in [("model-00001-of-00002.safetensors", a), ("model-00002-of-00002.safetensors", b)] {
            let shard: HashMap<String, Tensor> = part.iter().map(|n| ((*n).clone(), tensors[*n].clone())).collect();
            candle_core::safetensors::save(&shard, dir.join(file)).unwrap();
            for n in part {
                map.insert((*n).clone(), json!(file));
            }
        }
        std::fs::write(dir.join(INDEX_FILE), json!({"metadata": {}, "weight_map": map}).to_string()).unwrap();
        dir
    }

    fn exported(seed: u64) -> (MoeModel, HashMap<String, Tensor>) {
        let m = MoeModel::new(&tiny(), seed, DType::F32, &Device::Cpu).unwrap();
        let dir = std::env::temp_dir().join(format!("lazarus-hf-src-{seed}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        export(&m, &dir).unwrap();
        let (_, tensors) = load(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        (m, tensors)
    }

    /// A sharded checkpoint (an index naming two files) reads as the one file would; an index
    /// that points outside the directory, or at a file without the tensor, is refused by name.
    #[test]
    fn a_sharded_directory_reads_as_one_file() {
        let (m, tensors) = exported(11);
        let dir = write_dir("sharded", &tensors, true);
        assert!(is_hf_dir(&dir) && !dir.join(WEIGHTS_FILE).exists());
        let (cfg, back) = load(&dir).unwrap();
        assert_eq!(back.len(), tensors.len());
        let into = MoeModel::new(&cfg, 1, DType::F32, &Device::Cpu).unwrap();
        set_weights(&into, &back, &dir).unwrap();
        assert_same_weights(&m, &into);
        let index: Value = serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX_FILE)).unwrap()).unwrap();
        for (file, named) in [("../model-00001-of-00002.safetensors", "not a file name"), ("model-00001-of-00002.safetensors", "does not")]
        {
            let mut v = index.clone();
            v["weight_map"]["model.norm.weight"] = json!(file);
            std::fs::write(dir.join(INDEX_FILE), v.to_string()).unwrap();
            let e = load(&dir).unwrap_err().to_string();
            assert!(e.contains(named) && (e.contains("model.norm.weight") || e.contains("weight_map")), "{file}: {e}");
        }
        std::fs::write(dir.join(INDEX_FILE), "{\"weight_map\": 7}").unwrap();
        assert!(load(&dir).unwrap_err().to_string().contains("weight_map"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// What a directory must not hold is named, not guessed at: a tensor of the wrong shape
    /// (in the legacy and in the fused layout), a tensor with no place in the model, a NaN or
    /// an infinity. A buffer old transformers saved (`rotary_emb.inv_freq`) is read past.
    #[test]
    fn wrong_shapes_extra_tensors_and_non_finite_weights_are_named() {
        let (_, good) = exported(12);
        let model = MoeModel::new(&tiny(), 2, DType::F32, &Device::Cpu).unwrap();
        let dir = Path::new("hf-dir");
        let with = |name: &str, t: Tensor| {
            let mut m = good.clone();
            m.insert(name.to_string(), t);
            m
        };
        let mut inv_freq = good.clone();
        inv_freq.insert("model.layers.0.self_attn.rotary_emb.inv_freq".into(), Tensor::ones(4, DType::F32, &Device::Cpu).unwrap());
        set_weights(&model, &inv_freq, dir).unwrap();
        let q = "model.layers.0.self_attn.q_proj.weight";
        let mut nan = good[q].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        nan[5] = f32::NAN;
        let mut inf = nan.clone();
        inf[5] = f32::INFINITY;
        let as_q = |v: Vec<f32>| Tensor::from_vec(v, (16, 16), &Device::Cpu).unwrap();
        let cases = [
            (with(q, Tensor::zeros((16, 8), DType::F32, &Device::Cpu).unwrap()), format!("tensor {q} is [16, 8]")),
            (with(q, Tensor::zeros(16, DType::F32, &Device::Cpu).unwrap()), format!("tensor {q} is [16]")),
            (
                with("model.layers.0.mlp.shared_expert.up_proj.weight", Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap()),
                "tensor model.layers.0.mlp.shared_expert.up_proj.weight has no place".into(),
            ),
            (with(q, as_q(nan)), format!("tensor {q} holds NaN (element 5 of 256)")),
            (with(q, as_q(inf)), format!("tensor {q} holds inf (element 5")),
        ];
        for (tensors, want) in cases {
            let e = set_weights(&model, &tensors, dir).unwrap_err().to_string();
            assert!(e.contains(&want) && e.contains("hf-dir"), "want {want}: {e}");
        }
        let mut missing = good.clone();
        missing.remove(q);
        assert!(set_weights(&model, &missing, dir).unwrap_err().to_string().contains(&format!("missing tensor {q}")));
        // The fused layout's stack of the wrong rank, or too few experts, names the fused tensor.
        let mut fused_bad = good.clone();
        for e in 0..4 {
            for w in ["w1", "w3"] {
                fused_bad.remove(&format!("model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"));
            }
        }
        fused_bad.insert("model.layers.0.mlp.experts.gate_up_proj".into(), Tensor::zeros((2, 16, 16), DType::F32, &Device::Cpu).unwrap());
        let e = set_weights(&model, &fused_bad, dir).unwrap_err().to_string();
        assert!(e.contains("tensor model.layers.0.mlp.experts.gate_up_proj") && e.contains("expert 2"), "{e}");
    }
}
