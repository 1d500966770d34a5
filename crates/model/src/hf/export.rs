//! Writing a model as a Hugging Face directory: its tensors under transformers' names, in one
//! file or in shards with an index, its `config.json` and `generation_config.json`.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use super::{config_json, layouts, write_new, Family, Layout, CONFIG_FILE, GENERATION_FILE, INDEX_FILE, ROUTING_BIAS, WEIGHTS_FILE};
use crate::error::{ModelError, Result};
use crate::model::MoeModel;

/// transformers' largest shard by default ("5GB" in transformers 4; the Hub counts decimal
/// bytes): a model past it is written as shards with an index.
pub const MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Write `model` (every expert held here) as a Hugging Face directory of its family in `dir`,
/// which must not hold a `config.json`, `model.safetensors` or index already; in shards of at
/// most [`MAX_SHARD_BYTES`] ([`export_sharded`]).
pub fn export(model: &MoeModel, dir: &Path) -> Result<()> {
    export_sharded(model, dir, MAX_SHARD_BYTES).map(|_| ())
}

/// [`export`] in shards of at most `max_shard_bytes` of tensor data each (a larger tensor alone
/// in its own), as transformers writes them: one `model.safetensors` when the model fits in
/// one, else `model-00001-of-0000N.safetensors`… and `model.safetensors.index.json` naming each
/// tensor's file; beside them `generation_config.json` (`lazarus generate`'s sampling). Each
/// shard is made and written in turn, so memory holds one shard's bytes. Returns how many
/// weight files it wrote.
pub fn export_sharded(model: &MoeModel, dir: &Path, max_shard_bytes: u64) -> Result<usize> {
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
                let mut from = 0;
                for (n, width) in names {
                    tensors.push((n, t.narrow(1, from, width)?.t()?.contiguous()?));
                    from += width;
                }
            }
            Layout::Pieces(names) => {
                let mut from = 0;
                for (n, len) in names {
                    tensors.push((n, t.narrow(0, from, len)?.contiguous()?));
                    from += len;
                }
            }
        }
    }
    // DeepSeek-V3 routes by its bias: zeros where this model keeps none (it routes as none).
    if Family::of(model.config()) == Family::DeepseekV3 && !model.config().balance.uses_bias() {
        for b in model.moe_block_indices() {
            tensors.push((
                format!("model.layers.{b}.mlp.gate.{ROUTING_BIAS}"),
                Tensor::zeros(model.config().n_experts, DType::F32, &Device::Cpu)?,
            ));
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
    result.map(|_| shards.len())
}

/// Tensors of `sizes` bytes (in file order) grouped into shards of at most `max` bytes, each
/// tensor in the first shard it fits after the previous one's (huggingface_hub's rule): a
/// tensor larger than `max` has a shard of its own; never an empty shard.
pub(super) fn shard_ranges(sizes: &[u64], max: u64) -> Vec<std::ops::Range<usize>> {
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
