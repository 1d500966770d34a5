use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use super::export::shard_ranges;
use super::*;
use crate::config::ModelConfig;

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

/// A Qwen3-MoE (query and key norms, top-3 unnormalised, as Qwen3-30B-A3B's attention: one
/// key/value head for 4 query heads, heads of 6 beside a width of 16, RMSNorm ε 1e-6) goes out
/// under transformers' Qwen3-MoE names and comes back the same model; its fused expert tensors
/// read too.
#[test]
fn a_qwen3_moe_export_reads_back_into_the_same_model() {
    let dir = std::env::temp_dir().join(format!("lazarus-hf-qwen-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = ModelConfig {
        top_k: 3,
        normalize_top_k: false,
        n_heads: 4,
        n_kv_heads: Some(1),
        head_dim: Some(6),
        norm_eps: 1e-6,
        ..tiny().qwen_moe()
    };
    let m = MoeModel::new(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    export(&m, &dir).unwrap();
    let (back_cfg, tensors) = load(&dir).unwrap();
    assert_eq!(back_cfg, ModelConfig { aux_loss_coef: cfg.aux_loss_coef, ..cfg.clone() });
    let dims = |n: &str| tensors[&format!("model.layers.0.self_attn.{n}.weight")].dims().to_vec();
    assert_eq!([dims("q_proj"), dims("k_proj"), dims("v_proj"), dims("o_proj")], [vec![24, 16], vec![6, 16], vec![6, 16], vec![16, 24]]);
    assert_eq!(tensors["model.layers.1.self_attn.k_norm.weight"].dims(), [6]);
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

/// A Qwen2-MoE (q/k/v biases, two routed experts' width of shared expert behind its gate,
/// grouped-query attention) goes out under transformers' Qwen2-MoE names and comes back the same
/// model; a shared expert that is no whole number of routed ones is named.
#[test]
fn a_qwen2_moe_export_reads_back_into_the_same_model() {
    let dir = std::env::temp_dir().join(format!("lazarus-hf-qwen2-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = ModelConfig { top_k: 3, shared_experts: 2, n_heads: 4, n_kv_heads: Some(2), norm_eps: 1e-6, ..tiny().qwen2_moe() };
    let m = MoeModel::new(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    export(&m, &dir).unwrap();
    let (back_cfg, tensors) = load(&dir).unwrap();
    assert_eq!(back_cfg, ModelConfig { aux_loss_coef: cfg.aux_loss_coef, ..cfg.clone() });
    let dims = |n: &str| tensors[&format!("model.layers.1.{n}")].dims().to_vec();
    assert_eq!(
        [
            dims("self_attn.q_proj.bias"),
            dims("self_attn.k_proj.bias"),
            dims("mlp.shared_expert.up_proj.weight"),
            dims("mlp.shared_expert_gate.weight")
        ],
        [vec![16], vec![8], vec![16, 16], vec![1, 16]]
    );
    assert!(!tensors.contains_key("model.layers.0.self_attn.o_proj.bias"));
    let back = MoeModel::new(&back_cfg, 99, DType::F32, &Device::Cpu).unwrap();
    set_weights(&back, &tensors, &dir).unwrap();
    assert_same_weights(&m, &back);
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(dir.join(CONFIG_FILE)).unwrap()).unwrap();
    assert_eq!((v["model_type"].as_str(), v["shared_expert_intermediate_size"].as_u64()), (Some("qwen2_moe"), Some(16)));
    v["shared_expert_intermediate_size"] = json!(12);
    assert!(config_from_json(&v, &dir).unwrap_err().to_string().contains("shared_expert_intermediate_size"));
    std::fs::remove_dir_all(&dir).unwrap();
    // Mixtral and Qwen3-MoE have no q/k/v biases of their own.
    assert!(config_json(&ModelConfig { qkv_bias: true, ..tiny() }).unwrap_err().to_string().contains("qkv_bias"));
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
    let files: std::collections::BTreeSet<&str> = index["weight_map"].as_object().unwrap().values().map(|f| f.as_str().unwrap()).collect();
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
    // What a file leaves out is transformers' default: Mixtral's 8 key/value heads (of 16 here),
    // a head of hidden_size / heads.
    let mut v = good.clone();
    (v["hidden_size"], v["num_attention_heads"]) = (json!(32), json!(16));
    let (kv, head) = (v.as_object_mut().unwrap().remove("num_key_value_heads"), v.as_object_mut().unwrap().remove("head_dim"));
    assert!(kv.is_some() && head.is_some());
    let read = config_from_json(&v, path).unwrap();
    assert_eq!((read.kv_heads(), read.head_width(), read.n_kv_heads, read.head_dim), (8, 2, Some(8), None));
    for (key, value, named) in [
        ("model_type", json!("llama"), "model_type"),
        ("num_key_value_heads", json!(3), "n_kv_heads"),
        ("head_dim", json!(7), "head_dim"),
        ("hidden_act", json!("gelu"), "hidden_act"),
        ("tie_word_embeddings", json!(true), "tie_word_embeddings"),
        ("sliding_window", json!(4), "sliding_window"),
        ("rms_norm_eps", json!(0.5), "norm_eps"),
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
    for (file, named) in [("../model-00001-of-00002.safetensors", "not a file name"), ("model-00001-of-00002.safetensors", "does not")] {
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

/// The `config.json` fields of three published checkpoints (Mixtral-8x7B-v0.1, Qwen3-30B-A3B,
/// Qwen1.5-MoE-A2.7B; their values as published, written out here) read as models of the
/// parameter counts their cards give — 46.7 B, 30.5 B, 14.3 B — which needs their grouped-query
/// attention, Qwen3's heads of 128 and Qwen2-MoE's gated shared expert and q/k/v biases counted.
#[test]
fn the_published_configs_read_as_their_models() {
    let mixtral = json!({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
        "sliding_window": null, "num_experts_per_tok": 2, "num_local_experts": 8, "router_aux_loss_coef": 0.02,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    });
    let qwen3 = json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_scaling": null, "attention_bias": false, "sliding_window": null,
        "use_sliding_window": false, "max_window_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": false
    });
    let qwen15 = json!({
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_act": "silu",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "sliding_window": 32768,
        "use_sliding_window": false, "max_window_layers": 21, "num_experts": 60, "num_experts_per_tok": 4,
        "norm_topk_prob": false, "decoder_sparse_step": 1, "tie_word_embeddings": false
    });
    let path = Path::new("config.json");
    for (v, family, billions, kv, head) in
        [(mixtral, Family::Mixtral, 46.70, 8, 128), (qwen3, Family::Qwen3Moe, 30.53, 4, 128), (qwen15, Family::Qwen2Moe, 14.32, 16, 128)]
    {
        let cfg = config_from_json(&v, path).unwrap();
        assert_eq!(Family::of(&cfg), family);
        assert_eq!((cfg.kv_heads(), cfg.head_width()), (kv, head), "{family:?}");
        let b = cfg.parameter_count() as f64 / 1e9;
        assert!((b - billions).abs() < 0.01, "{family:?}: {b} B parameters, not {billions}");
    }
}

/// DeepSeek-V3's layout: a dense first block, latent attention (queries from their latent), two shared experts,
/// group-limited scaled sigmoid routing and its routing bias read back into the same model; a
/// model trained without the bias writes zeros, which a model without one reads past (and a
/// bias that is not zero it refuses); what DeepSeek-V3's own files say that we do not build is
/// named.
#[test]
fn a_deepseek_v3_export_reads_back_into_the_same_model() {
    use crate::config::{Balance, LatentAttention};
    let dir = std::env::temp_dir().join(format!("lazarus-hf-deepseek-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let la = LatentAttention { kv_rank: 6, q_rank: Some(10), rope_dim: 4 };
    let cfg = ModelConfig {
        latent_attention: Some(la),
        shared_experts: 2,
        expert_groups: 2,
        top_groups: 1,
        routed_scaling: 2.5,
        norm_eps: 1e-6,
        balance: Balance::Bias,
        dense_first: 1,
        dense_d_ff: Some(24),
        ..tiny().deepseek_moe()
    };
    let m = MoeModel::new(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    let bias = m.params().get("blocks.1.moe.gate.bias").unwrap();
    bias.set(&Tensor::new(&[0.1f32, -0.2, 0.3, 0.0], &Device::Cpu).unwrap()).unwrap();
    export(&m, &dir).unwrap();
    let (back_cfg, tensors) = load(&dir).unwrap();
    assert_eq!(back_cfg, ModelConfig { aux_loss_coef: cfg.aux_loss_coef, ..cfg.clone() });
    let dims = |n: &str| tensors[&format!("model.layers.1.{n}")].dims().to_vec();
    assert_eq!(
        [
            dims("self_attn.q_a_proj.weight"),
            dims("self_attn.q_b_proj.weight"),
            dims("self_attn.kv_a_proj_with_mqa.weight"),
            dims("self_attn.kv_b_proj.weight"),
            dims("self_attn.o_proj.weight"),
            dims("mlp.shared_experts.up_proj.weight"),
            dims("mlp.gate.e_score_correction_bias"),
        ],
        [vec![10, 16], vec![2 * (8 + 4), 10], vec![6 + 4, 16], vec![2 * 2 * 8, 6], vec![16, 16], vec![16, 16], vec![4]]
    );
    let back = MoeModel::new(&back_cfg, 99, DType::F32, &Device::Cpu).unwrap();
    set_weights(&back, &tensors, &dir).unwrap();
    assert_same_weights(&m, &back);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(dir.join(CONFIG_FILE)).unwrap()).unwrap();
    assert_eq!(
        (v["model_type"].as_str(), v["rope_interleave"].as_bool(), v["head_dim"].as_u64()),
        (Some("deepseek_v3"), Some(false), Some(4))
    );
    std::fs::remove_dir_all(&dir).unwrap();
    // Trained without the bias: zeros written, read past by a model without one.
    let aux = ModelConfig { balance: Balance::Aux, ..cfg.clone() };
    let m = MoeModel::new(&aux, 3, DType::F32, &Device::Cpu).unwrap();
    export(&m, &dir).unwrap();
    let (_, mut tensors) = load(&dir).unwrap();
    assert_eq!(tensors["model.layers.1.mlp.gate.e_score_correction_bias"].to_vec1::<f32>().unwrap(), [0.0; 4]);
    set_weights(&MoeModel::new(&aux, 99, DType::F32, &Device::Cpu).unwrap(), &tensors, &dir).unwrap();
    tensors.insert("model.layers.1.mlp.gate.e_score_correction_bias".into(), Tensor::new(&[0.5f32, 0.0, 0.0, 0.0], &Device::Cpu).unwrap());
    let e = set_weights(&MoeModel::new(&aux, 99, DType::F32, &Device::Cpu).unwrap(), &tensors, &dir).unwrap_err().to_string();
    assert!(e.contains("routing bias this model would not route by") && e.contains("--balance bias"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
    // DeepSeek-V3's published config (dense first blocks, interleaved rotary parts, a
    // multi-token-prediction layer read past): its 671 B parameters.
    let mut v3 = json!({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "norm_topk_prob": true, "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "num_nextn_predict_layers": 1, "tie_word_embeddings": false, "attention_bias": false
    });
    let path = Path::new("config.json");
    let read = config_from_json(&v3, path).unwrap();
    assert_eq!(
        (read.latent_attention, read.head_width(), read.balance),
        (Some(LatentAttention { kv_rank: 512, q_rank: Some(1536), rope_dim: 64 }), 128, Balance::Bias)
    );
    assert_eq!((read.dense_first, read.dense_d_ff, read.moe_layers()), (3, Some(18432), 58));
    let b = read.parameter_count() as f64 / 1e9;
    assert!((b - 671.0).abs() < 1.0, "{b} B parameters, not 671");
    v3["v_head_dim"] = json!(64);
    assert!(config_from_json(&v3, path).unwrap_err().to_string().contains("v_head_dim"));
}
