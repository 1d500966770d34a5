//! Hugging Face interop for models with Mixtral's, Qwen3-MoE's, Qwen2-MoE's or DeepSeek-V3's blocks
//! ([`Family`]): a directory of `config.json` and `model.safetensors` with transformers'
//! `MixtralForCausalLM`, `Qwen3MoeForCausalLM`, … parameter names, written from a model ([`export`]) and read into one
//! ([`load`], [`set_weights`]).
//!
//! The tensors differ from ours only in layout: a transformers `Linear` holds its weight as
//! [out, in] where ours is [in, out]; our packed attention projection [d, (H + 2·H_kv)·head_dim] is their
//! q, k and v projections side by side (grouped-query attention: fewer key/value heads); our SwiGLU expert's first weight [d, 2f] is their `w1` (the gate)
//! and `w3` (the up projection) side by side, and `w2` is the down projection (Qwen3-MoE's
//! `gate_proj`, `up_proj`, `down_proj` under `mlp.`, with `q_norm` and `k_norm`). Rotary positions
//! pair dimension i of a head with i + head/2, as their `rotate_half` does, so the weights apply
//! unchanged (DeepSeek-V3's rotary parts too, written with `rope_interleave` false). Latent
//! attention's projections are theirs transposed (`q_a_proj`, `q_b_proj`, `kv_a_proj_with_mqa`,
//! `kv_b_proj`, the latents' norms), its routing bias their `e_score_correction_bias`. A model whose options are not Mixtral's (LayerNorm, learned positions, GELU,
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

use std::path::Path;

use crate::error::{ModelError, Result};
use crate::model::MoeModel;

mod export;
mod family;
mod read;
#[cfg(test)]
mod tests;

pub use export::{export, export_sharded, MAX_SHARD_BYTES};
pub use family::{config_from_json, config_json, family_mismatch, Family};
pub use read::{load, read_config, set_weights};

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
/// DeepSeek-V3's routing bias, `mlp.gate.{ROUTING_BIAS}` (ours: `moe.gate.bias`, kept with
/// loss-free balancing): a model trained without one writes zeros, which route as none does.
const ROUTING_BIAS: &str = "e_score_correction_bias";

/// How one of our tensors is one or more of theirs.
enum Layout {
    /// The same tensor.
    Same(String),
    /// Transposed ([in, out] here, [out, in] there).
    Transposed(String),
    /// Side by side along our columns, each transposed: ours [in, Σ outs] = [t₁ᵀ | t₂ᵀ | …],
    /// each (name, its width among our columns).
    Columns(Vec<(String, usize)>),
    /// A vector that is theirs end to end: ours [Σ lens] = [v₁ | v₂ | …], each (name, length).
    Pieces(Vec<(String, usize)>),
}

/// Where each of our parameters is among transformers' (legacy names), in our order; an error
/// for a model of no family (whose parameters would not all have a place).
fn layouts(model: &MoeModel) -> Result<Vec<(String, Layout)>> {
    let family = Family::of(model.config());
    if let Some((field, why)) = family_mismatch(model.config()) {
        return Err(ModelError::config(field, why, format!("not a {} model: no Hugging Face layout", family.name())));
    }
    let (moe, [gate, up, down]) = family.moe_names();
    let cfg = model.config();
    let (q, kv) = (cfg.attention_width(), cfg.kv_heads() * cfg.head_width());
    let shared = if family == Family::DeepseekV3 { "shared_experts" } else { "shared_expert" };
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
                    ["attn", "qkv", "w"] => Layout::Columns(
                        [("q", q), ("k", kv), ("v", kv)].iter().map(|&(x, w)| (format!("{p}.self_attn.{x}_proj.weight"), w)).collect(),
                    ),
                    ["attn", "qkv", "b"] => Layout::Pieces(
                        [("q", q), ("k", kv), ("v", kv)].iter().map(|&(x, w)| (format!("{p}.self_attn.{x}_proj.bias"), w)).collect(),
                    ),
                    ["attn", "out", "w"] => Layout::Transposed(format!("{p}.self_attn.o_proj.weight")),
                    // DeepSeek-V3's latent attention.
                    ["attn", "q", "w"] => Layout::Transposed(format!("{p}.self_attn.q_proj.weight")),
                    ["attn", "q_down", "w"] => Layout::Transposed(format!("{p}.self_attn.q_a_proj.weight")),
                    ["attn", "q_down_norm", "w"] => Layout::Same(format!("{p}.self_attn.q_a_layernorm.weight")),
                    ["attn", "q_up", "w"] => Layout::Transposed(format!("{p}.self_attn.q_b_proj.weight")),
                    ["attn", "kv_down", "w"] => Layout::Transposed(format!("{p}.self_attn.kv_a_proj_with_mqa.weight")),
                    ["attn", "kv_down_norm", "w"] => Layout::Same(format!("{p}.self_attn.kv_a_layernorm.weight")),
                    ["attn", "kv_up", "w"] => Layout::Transposed(format!("{p}.self_attn.kv_b_proj.weight")),
                    ["attn", "q_norm", "w"] => Layout::Same(format!("{p}.self_attn.q_norm.weight")),
                    ["attn", "k_norm", "w"] => Layout::Same(format!("{p}.self_attn.k_norm.weight")),
                    ["moe", "gate", "w"] => Layout::Transposed(format!("{p}.{moe}.gate.weight")),
                    // DeepSeek-V3's dense first blocks.
                    ["ffn", "fc1", "w"] => {
                        Layout::Columns([gate, up].iter().map(|x| (format!("{p}.mlp.{x}.weight"), cfg.dense_width())).collect())
                    }
                    ["ffn", "fc2", "w"] => Layout::Transposed(format!("{p}.mlp.{down}.weight")),
                    // The loss-free balancing's bias: DeepSeek-V3's routing bias; the other families
                    // have none (it starts at zero).
                    ["moe", "gate", "bias"] if family == Family::DeepseekV3 => Layout::Same(format!("{p}.{moe}.gate.{ROUTING_BIAS}")),
                    ["moe", "gate", "bias"] => continue,
                    ["moe", "experts", e, "fc1", "w"] => {
                        Layout::Columns([gate, up].iter().map(|x| (format!("{p}.{moe}.experts.{e}.{x}.weight"), cfg.d_ff)).collect())
                    }
                    ["moe", "experts", e, "fc2", "w"] => Layout::Transposed(format!("{p}.{moe}.experts.{e}.{down}.weight")),
                    // Qwen2-MoE's shared expert and its gate; DeepSeek-V3's shared experts.
                    ["moe", "shared", "fc1", "w"] => Layout::Columns(
                        [gate, up].iter().map(|x| (format!("{p}.{moe}.{shared}.{x}.weight"), cfg.shared_experts * cfg.d_ff)).collect(),
                    ),
                    ["moe", "shared", "fc2", "w"] => Layout::Transposed(format!("{p}.{moe}.{shared}.{down}.weight")),
                    ["moe", "shared_gate", "w"] => Layout::Transposed(format!("{p}.{moe}.shared_expert_gate.weight")),
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
    ModelError::config("parameter", name, "has no place in a Hugging Face Mixtral, Qwen3-MoE, Qwen2-MoE or DeepSeek-V3")
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
