//! Reading a Hugging Face directory into a model: its `config.json`, its tensors from one file
//! or every shard its index names (legacy or fused expert names), strictly.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use super::{config_from_json, layouts, Layout, BUFFERS, CONFIG_FILE, INDEX_FILE, MAX_CONFIG_BYTES, MAX_INDEX_BYTES, WEIGHTS_FILE};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::model::MoeModel;

/// Our configuration of the Mixtral, Qwen3-MoE, Qwen2-MoE or DeepSeek-V3 model in `dir` (its `config.json`).
pub fn read_config(dir: &Path) -> Result<ModelConfig> {
    config_from_json(&read_json(dir)?, &dir.join(CONFIG_FILE))
}

/// `dir`'s `config.json`, bounded.
fn read_json(dir: &Path) -> Result<Value> {
    let config_path = dir.join(CONFIG_FILE);
    let len = std::fs::metadata(&config_path).map_err(|e| ModelError::io(&config_path, e))?.len();
    if len > MAX_CONFIG_BYTES {
        return Err(ModelError::Checkpoint { path: config_path, reason: format!("{len} bytes: not a model configuration") });
    }
    let text = std::fs::read_to_string(&config_path).map_err(|e| ModelError::io(&config_path, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::Checkpoint { path: config_path.clone(), reason: e.to_string() })
}

/// A Hugging Face Mixtral, Qwen3-MoE, Qwen2-MoE or DeepSeek-V3 directory: our configuration of it and its tensors (f32, on the CPU),
/// from its one weights file or from every shard its index names.
pub fn load(dir: &Path) -> Result<(ModelConfig, HashMap<String, Tensor>)> {
    let json = read_json(dir)?;
    let cfg = config_from_json(&json, &dir.join(CONFIG_FILE))?;
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
    if super::family::interleaved_rotary(&json) {
        deinterleave_rotary(&mut tensors, &cfg)?;
    }
    // DeepSeek-V3's multi-token-prediction layers follow the model's: read past (as transformers
    // does), not trained.
    let predict = json.get("num_nextn_predict_layers").and_then(Value::as_u64).unwrap_or(0) as usize;
    if predict > 0 {
        let past = |name: &str| {
            name.strip_prefix("model.layers.")
                .and_then(|r| r.split('.').next())
                .and_then(|b| b.parse::<usize>().ok())
                .is_some_and(|b| (cfg.n_layers..cfg.n_layers + predict).contains(&b))
        };
        tensors.retain(|name, _| !past(name));
    }
    Ok((cfg, tensors))
}

/// DeepSeek-V3's rotary parts as we rotate them: its checkpoints (`rope_interleave`, its
/// default) pair a rotary part's dimensions 2i and 2i + 1, which transformers takes apart into
/// the halves [0, 2, 4, … | 1, 3, 5, …] before rotating them as halves. The same order of the
/// rows that make the queries' and the key's rotary parts gives the same rotation here; the
/// attention scores are their dot products, unchanged by ordering both alike.
fn deinterleave_rotary(tensors: &mut HashMap<String, Tensor>, cfg: &ModelConfig) -> Result<()> {
    let Some(la) = cfg.latent_attention else { return Ok(()) };
    let (h, hd, r, kv) = (cfg.n_heads, cfg.head_width(), la.rope_dim, la.kv_rank);
    let halves: Vec<usize> = (0..r / 2).map(|i| 2 * i).chain((0..r / 2).map(|i| 2 * i + 1)).collect();
    // Rows `first + halves[j]` for each part starting at `first`, every other row in place.
    let reorder = |t: &Tensor, parts: &[usize]| -> Result<Tensor> {
        let mut rows: Vec<u32> = (0..t.dim(0)? as u32).collect();
        for &first in parts {
            for (j, &from) in halves.iter().enumerate() {
                rows[first + j] = (first + from) as u32;
            }
        }
        Ok(t.index_select(&Tensor::from_vec(rows.clone(), rows.len(), t.device())?, 0)?)
    };
    for b in 0..cfg.n_layers {
        let p = format!("model.layers.{b}.self_attn");
        let queries = (0..h).map(|head| head * (hd + r) + hd).collect::<Vec<_>>();
        for (name, parts) in [
            (format!("{p}.q_b_proj.weight"), queries.clone()),
            (format!("{p}.q_proj.weight"), queries),
            (format!("{p}.kv_a_proj_with_mqa.weight"), vec![kv]),
        ] {
            if let Some(t) = tensors.get(&name) {
                if t.rank() == 2 && parts.iter().all(|&f| f + r <= t.dims()[0]) {
                    let t = reorder(t, &parts)?;
                    tensors.insert(name, t);
                }
            }
        }
    }
    Ok(())
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
                let parts = names.iter().map(|(n, width)| Ok(fetch(n, &[*width, dims[0]])?.t()?)).collect::<Result<Vec<_>>>()?;
                Tensor::cat(&parts, 1)?
            }
            Layout::Pieces(names) => {
                let parts = names.iter().map(|(n, len)| fetch(n, &[*len])).collect::<Result<Vec<_>>>()?;
                Tensor::cat(&parts, 0)?
            }
        };
        var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
    }
    // A routing bias of zeros where the model keeps none routes as none: read past it.
    let zero_bias = |n: &str, t: &Tensor| {
        n.ends_with(super::ROUTING_BIAS)
            && t.abs()
                .and_then(|a| a.max_all())
                .and_then(|m| m.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>())
                .is_ok_and(|m| m == 0.0)
    };
    let mut extra: Vec<&String> = tensors
        .iter()
        .filter(|(n, t)| !used.contains(*n) && !BUFFERS.iter().any(|b| n.ends_with(b)) && !zero_bias(n, t))
        .map(|(n, _)| n)
        .collect();
    extra.sort();
    if let Some(first) = extra.iter().find(|n| n.ends_with(super::ROUTING_BIAS)) {
        return Err(bad(format!(
            "tensor {first} is a routing bias this model would not route by (it keeps none): train with --balance bias or both to keep it"
        )));
    }
    if let Some(first) = extra.first() {
        let more = if extra.len() > 1 { format!(" (and {} more)", extra.len() - 1) } else { String::new() };
        return Err(bad(format!(
            "tensor {first}{more} has no place in a {} model of its config.json: another architecture's weights, or a file not made for it",
            super::Family::of(model.config()).name()
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
