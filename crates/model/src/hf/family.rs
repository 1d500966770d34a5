//! The transformers families ([`Family`]): which of our options each has, and its `config.json`
//! both ways.

use lazarus_setting::Setting;
use serde_json::{json, Value};
use std::path::Path;

use crate::config::{Activation, ModelConfig, NormKind, Positions};
use crate::error::{ModelError, Result};

/// The transformers families a model goes to and from: Mixtral, Qwen3-MoE (Mixtral's blocks
/// with query and key norms, top-k weights renormalised or not), Qwen2-MoE (Mixtral's blocks
/// with q/k/v biases and a gated shared expert; Qwen1.5-MoE's too), or DeepSeek-V3 (latent
/// attention, shared experts, a sigmoid router with its routing bias, group-limited and scaled;
/// DeepSeek-V2's blocks too where their router is V3's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Mixtral,
    Qwen3Moe,
    Qwen2Moe,
    DeepseekV3,
}

impl Family {
    /// The family of a model's options: Qwen2-MoE's when it gates its shared experts, Qwen3-MoE's
    /// when it has query and key norms, else Mixtral's.
    pub fn of(cfg: &ModelConfig) -> Family {
        if cfg.latent_attention.is_some() {
            Family::DeepseekV3
        } else if cfg.shared_expert_gate {
            Family::Qwen2Moe
        } else if cfg.qk_norm {
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
            Family::Qwen2Moe => "Qwen2-MoE",
            Family::DeepseekV3 => "DeepSeek-V3",
        }
    }

    /// transformers' `model_type`.
    pub(super) fn model_type(self) -> &'static str {
        match self {
            Family::Mixtral => "mixtral",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Qwen2Moe => "qwen2_moe",
            Family::DeepseekV3 => "deepseek_v3",
        }
    }

    /// transformers' key/value heads for a `config.json` that does not say (MixtralConfig's and
    /// Qwen3MoeConfig's defaults; DeepSeek-V3's are its heads).
    fn default_kv_heads(self, heads: usize) -> usize {
        match self {
            Family::Mixtral => 8,
            Family::Qwen3Moe => 4,
            Family::Qwen2Moe => 16,
            Family::DeepseekV3 => heads,
        }
    }

    /// transformers' RMSNorm ε for a `config.json` that does not say.
    fn default_norm_eps(self) -> f64 {
        match self {
            Family::Mixtral => 1e-5,
            Family::Qwen3Moe | Family::Qwen2Moe | Family::DeepseekV3 => 1e-6,
        }
    }

    /// Where an MoE block's router and experts are: `{p}.{moe}.gate.weight` and
    /// `{p}.{moe}.experts.{e}.{gate, up, down}`.
    pub(super) fn moe_names(self) -> (&'static str, [&'static str; 3]) {
        match self {
            Family::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
            Family::Qwen3Moe | Family::Qwen2Moe | Family::DeepseekV3 => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        }
    }
}

/// The first option of `cfg` that its family ([`Family::of`]) does not have, as (field, what it
/// would need).
pub fn family_mismatch(cfg: &ModelConfig) -> Option<(&'static str, String)> {
    let family = Family::of(cfg);
    let name = family.name();
    let qwen2 = family == Family::Qwen2Moe;
    let deepseek = family == Family::DeepseekV3;
    let sigmoid = cfg.router == crate::config::RouterScore::Sigmoid;
    let checks: [(bool, &'static str, String); 17] = [
        (cfg.norm == NormKind::Rms, "norm", format!("{name}'s norm is RMSNorm ({} rms)", Setting::Norm)),
        (cfg.positions == Positions::Rope, "positions", format!("{name} has rotary positions ({} rope)", Setting::Positions)),
        (cfg.expert_act == Activation::Swiglu, "expert_act", format!("{name}'s experts are SwiGLU ({} swiglu)", Setting::ExpertAct)),
        (!cfg.attn_bias, "attn_bias", format!("{name}'s attention has no biases ({} false)", Setting::AttnBias)),
        (!cfg.ffn_bias, "ffn_bias", format!("{name}'s experts have no biases ({} false)", Setting::FfnBias)),
        (
            if deepseek { cfg.shared_experts >= 1 } else { cfg.shared_experts == 0 || qwen2 },
            "shared_experts",
            format!("{}: {name} has {}", cfg.shared_experts, if deepseek { "at least one shared expert" } else { "no shared experts" }),
        ),
        (!cfg.qkv_bias || qwen2, "qkv_bias", format!("{name} has no q/k/v biases ({} false)", Setting::QkvBias)),
        (!(qwen2 && cfg.qk_norm), "qk_norm", format!("{name} has no query and key norms")),
        (cfg.moe_every == 1, "moe_every", format!("{}: {name} has an MoE layer in every block", cfg.moe_every)),
        (cfg.dense_first == 0 || deepseek, "dense_first", format!("{}: {name} has no dense blocks first", cfg.dense_first)),
        (cfg.dense_d_ff.is_none() || deepseek, "dense_d_ff", format!("{name} has no dense FFNs")),
        (
            family != Family::Mixtral || (cfg.top_k > 1 && cfg.normalize_top_k),
            "top_k",
            format!(
                "top-{}{}: Mixtral routes to k ≥ 2 experts with renormalised weights (Qwen3-MoE and Qwen2-MoE to any)",
                cfg.top_k,
                if cfg.normalize_top_k { "" } else { " unnormalised" }
            ),
        ),
        (cfg.capacity_factor.is_none(), "capacity_factor", format!("{name} is dropless")),
        (
            sigmoid == deepseek,
            "router",
            format!(
                "{}: {name}'s router is a {}",
                if sigmoid { "sigmoid" } else { "softmax" },
                if deepseek { "sigmoid" } else { "softmax" }
            ),
        ),
        (cfg.expert_groups == 1 || deepseek, "expert_groups", format!("{}: {name} routes without expert groups", cfg.expert_groups)),
        (
            cfg.expert_groups == 1 || cfg.n_experts / cfg.expert_groups.max(1) >= 2,
            "expert_groups",
            format!("{}: {name} scores a group by its two best experts (at least two a group)", cfg.expert_groups),
        ),
        (
            cfg.routed_scaling == 1.0 || deepseek,
            "routed_scaling",
            format!("{}: {name} does not scale its routed weights", cfg.routed_scaling),
        ),
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
    if cfg.balance.uses_bias() && family != Family::DeepseekV3 {
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
        "num_key_value_heads": cfg.kv_heads(),
        "head_dim": cfg.head_width(),
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
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
        Family::DeepseekV3 => {
            let la = cfg.latent_attention.expect("a DeepSeek-V3 model has latent attention");
            json!({
                "architectures": ["DeepseekV3ForCausalLM"],
                "n_routed_experts": cfg.n_experts,
                "moe_intermediate_size": cfg.d_ff,
                "n_shared_experts": cfg.shared_experts,
                "first_k_dense_replace": cfg.dense_first,
                "intermediate_size": cfg.dense_width(),
                "n_group": cfg.expert_groups,
                "topk_group": cfg.top_groups,
                "routed_scaling_factor": cfg.routed_scaling,
                "norm_topk_prob": cfg.normalize_top_k,
                "kv_lora_rank": la.kv_rank,
                "q_lora_rank": la.q_rank,
                "qk_rope_head_dim": la.rope_dim,
                "qk_nope_head_dim": cfg.head_width(),
                "v_head_dim": cfg.head_width(),
                "head_dim": la.rope_dim,
                // Each head's rotary part rotated as halves (rotate_half), as here.
                "rope_interleave": false,
                "attention_bias": false,
                "num_nextn_predict_layers": 0,
            })
        }
        Family::Qwen2Moe => json!({
            "architectures": ["Qwen2MoeForCausalLM"],
            "num_experts": cfg.n_experts,
            "moe_intermediate_size": cfg.d_ff,
            "shared_expert_intermediate_size": cfg.shared_experts * cfg.d_ff,
            "norm_topk_prob": cfg.normalize_top_k,
            "qkv_bias": cfg.qkv_bias,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": false,
        }),
    };
    if let (Some(map), Value::Object(more)) = (v.as_object_mut(), extra) {
        map.extend(more);
    }
    Ok(v)
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
        Some("qwen2_moe") => Family::Qwen2Moe,
        Some("deepseek_v3") => Family::DeepseekV3,
        other => {
            return Err(bad("model_type", format!("{other:?}: only Mixtral, Qwen3-MoE, Qwen2-MoE and DeepSeek-V3 checkpoints are read")))
        }
    };
    if matches!(family, Family::Qwen3Moe | Family::Qwen2Moe) {
        qwen_moe_supported(v).map_err(|(field, reason)| bad(field, reason))?;
    }
    let deepseek = match family {
        Family::DeepseekV3 => Some(deepseek_supported(v).map_err(|(field, reason)| bad(field, reason))?),
        _ => None,
    };
    // Qwen2-MoE's shared expert: a whole number of routed experts' widths.
    let shared = match family {
        Family::Qwen2Moe => {
            let (width, f) = (int("shared_expert_intermediate_size")?, int("moe_intermediate_size")?);
            if f == 0 || width == 0 || !width.is_multiple_of(f) {
                let why = format!("{width}: only a multiple of moe_intermediate_size ({f}) is supported");
                return Err(bad("shared_expert_intermediate_size", why));
            }
            width / f
        }
        _ => 0,
    };
    let (d, heads) = (int("hidden_size")?, int("num_attention_heads")?);
    // transformers' defaults where the file does not say: MixtralConfig's 8 key/value heads,
    // Qwen3MoeConfig's 4; a head of hidden_size / num_attention_heads.
    let kv = match v.get("num_key_value_heads") {
        Some(_) => int("num_key_value_heads")?,
        None => family.default_kv_heads(heads),
    };
    let head_dim = match (&deepseek, v.get("head_dim").filter(|x| !x.is_null())) {
        // (DeepSeek-V3's head_dim is its rotary part's.)
        (Some((_, width)), _) => Some(*width),
        (None, Some(_)) => Some(int("head_dim")?),
        (None, None) => None,
    };
    match v.get("hidden_act").and_then(Value::as_str) {
        None | Some("silu") => {}
        Some(other) => return Err(bad("hidden_act", format!("{other:?}: only silu (SwiGLU) is supported"))),
    }
    if v.get("tie_word_embeddings").and_then(Value::as_bool) == Some(true) {
        return Err(bad("tie_word_embeddings", "true: tied embeddings are not supported".into()));
    }
    let max_pos = int("max_position_embeddings")?;
    // (The Qwen families' window applies only with use_sliding_window, refused above; their
    // files write 0 or 4096 without it.)
    let window_used = v.get("use_sliding_window").and_then(Value::as_bool) != Some(false);
    if let Some(w) = v.get("sliding_window").and_then(Value::as_u64).filter(|_| window_used) {
        if (w as usize) < max_pos {
            return Err(bad("sliding_window", format!("{w}: sliding-window attention is not supported")));
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
        // (Left out where they are the defaults: the configuration reads as one made here.)
        n_kv_heads: Some(kv).filter(|&kv| kv != heads),
        head_dim: head_dim.filter(|&w| heads == 0 || w * heads != d),
        norm_eps: num("rms_norm_eps").unwrap_or(family.default_norm_eps()),
        max_seq_len: max_pos,
        // (The Qwen families' files say num_experts; transformers 5 writes num_local_experts.)
        n_experts: match family {
            Family::Qwen3Moe | Family::Qwen2Moe if v.get("num_experts").is_some() => int("num_experts")?,
            Family::DeepseekV3 => int("n_routed_experts")?,
            _ => int("num_local_experts")?,
        },
        top_k: int("num_experts_per_tok")?,
        d_ff: int(if family == Family::Mixtral { "intermediate_size" } else { "moe_intermediate_size" })?,
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
            Family::Qwen2Moe => ModelConfig {
                normalize_top_k: v.get("norm_topk_prob").and_then(Value::as_bool).unwrap_or(false),
                qkv_bias: v.get("qkv_bias").and_then(Value::as_bool).unwrap_or(true),
                shared_experts: shared,
                ..ModelConfig::default().qwen2_moe()
            },
            // Trained as DeepSeek-V3 is: loss-free balancing, its routing bias read in.
            Family::DeepseekV3 => ModelConfig {
                latent_attention: deepseek.map(|(la, _)| la),
                dense_first: v.get("first_k_dense_replace").map_or(Ok(0), |_| int("first_k_dense_replace"))?,
                // (Left out where it is the experts' width: the configuration reads as one made here.)
                dense_d_ff: match v.get("intermediate_size") {
                    Some(_) => Some(int("intermediate_size")?).filter(|&w| w != int("moe_intermediate_size").unwrap_or(0)),
                    None => None,
                },
                shared_experts: int("n_shared_experts")?,
                expert_groups: v.get("n_group").map_or(Ok(1), |_| int("n_group"))?,
                top_groups: v.get("topk_group").map_or(Ok(1), |_| int("topk_group"))?,
                routed_scaling: num("routed_scaling_factor").unwrap_or(1.0),
                normalize_top_k: v.get("norm_topk_prob").and_then(Value::as_bool).unwrap_or(true),
                balance: crate::config::Balance::Bias,
                ..ModelConfig::default().deepseek_moe()
            },
        }
    };
    cfg.validate().map_err(|e| bad("config", e.to_string()))?;
    if let Some((field, why)) = family_mismatch(&cfg) {
        return Err(bad(field, why));
    }
    Ok(cfg)
}

/// Whether a `config.json` is DeepSeek-V3's with interleaved rotary parts (`rope_interleave`,
/// true unless it says false): its weights are read into our order ([`super::read`]).
pub(super) fn interleaved_rotary(v: &Value) -> bool {
    v.get("model_type").and_then(Value::as_str) == Some("deepseek_v3") && v.get("rope_interleave").and_then(Value::as_bool) != Some(false)
}

/// A DeepSeek-V3 `config.json`'s latent attention and head width, where it is what we build:
/// keys' and values' head widths equal, no attention biases; else (field, why). (Interleaved
/// rotary parts are read into ours, ours written as halves; multi-token-prediction layers are
/// read past, as transformers does.)
fn deepseek_supported(v: &Value) -> std::result::Result<(crate::config::LatentAttention, usize), (&'static str, String)> {
    let int = |field: &'static str| {
        v.get(field).and_then(Value::as_u64).map(|x| x as usize).ok_or((field, "missing or not a whole number".into()))
    };
    if v.get("attention_bias").and_then(Value::as_bool) == Some(true) {
        return Err(("attention_bias", "true: attention biases are not supported".into()));
    }
    let (keys, values) = (int("qk_nope_head_dim")?, int("v_head_dim")?);
    if keys != values {
        return Err(("v_head_dim", format!("{values}: only values as wide as the keys' position-free part ({keys}) are supported")));
    }
    let q_rank = match v.get("q_lora_rank").filter(|q| !q.is_null()) {
        Some(_) => Some(int("q_lora_rank")?),
        None => None,
    };
    Ok((crate::config::LatentAttention { kv_rank: int("kv_lora_rank")?, q_rank, rope_dim: int("qk_rope_head_dim")? }, keys))
}

/// What a Qwen3-MoE or Qwen2-MoE `config.json` may say beyond Mixtral's fields: an MoE layer in
/// every block, no attention biases (Qwen3's; Qwen2's q/k/v biases are `qkv_bias`), no sliding
/// window; else (field, why).
fn qwen_moe_supported(v: &Value) -> std::result::Result<(), (&'static str, String)> {
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
