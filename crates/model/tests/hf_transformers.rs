//! Hugging Face interop against transformers itself: a tiny random `MixtralForCausalLM`,
//! `Qwen3MoeForCausalLM`, `Qwen2MoeForCausalLM` and `DeepseekV3ForCausalLM` made by transformers
//! load into Lazarus with the same logits (within
//! 1e-4, f32), train from those weights (`init_from`), export, and the export loads back into
//! transformers — no missing or unexpected tensors, in one file or in shards with an index —
//! with the same logits as the trained Lazarus model.
//!
//! transformers' side is `scripts/hf_transformers.py`, run by `LAZARUS_HF_PYTHON` (default `python3`).
//! Where that Python cannot import torch and transformers the test says so and checks nothing
//! more (CI has neither); the export/import round trip without transformers is tested in
//! `lazarus-model`'s `hf` module and the CLI's tests.

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{Device, Tensor};
use lazarus_model::{DataSource, TrainConfig, Trainer};

fn python() -> String {
    std::env::var("LAZARUS_HF_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/hf_transformers.py")
}

/// Run the script; None (after saying why) when transformers cannot be imported.
fn run(args: &[&str]) -> Option<()> {
    let out = Command::new(python()).arg(script()).args(args).output().expect("python runs");
    if out.status.code() == Some(3) {
        eprintln!("skipped: {} ({})", String::from_utf8_lossy(&out.stderr).trim(), python());
        return None;
    }
    assert!(out.status.success(), "hf_transformers.py {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    Some(())
}

/// transformers' logits of `dir` for `ids`.
fn their_logits(dir: &Path, ids: &[u32], at: &Path) -> Vec<Vec<f64>> {
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    let out = at.join("logits.json");
    run(&["logits", dir.to_str().unwrap(), &list.join(","), out.to_str().unwrap()]).expect("transformers was importable a moment ago");
    serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap()
}

/// Our logits for `ids` (one sequence).
fn our_logits(model: &lazarus_model::MoeModel, ids: &[u32]) -> Vec<Vec<f64>> {
    let t = Tensor::from_vec(ids.to_vec(), (1, ids.len()), &Device::Cpu).unwrap();
    let out = model.forward(&t, &t, None).unwrap();
    out.logits.to_dtype(candle_core::DType::F64).unwrap().to_vec2().unwrap()
}

fn worst(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    assert_eq!((a.len(), a[0].len()), (b.len(), b[0].len()));
    a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

#[test]
fn a_mixtral_from_transformers_loads_trains_exports_and_keeps_its_logits() {
    round_trip("mixtral", (32, 4, 2), (2, 8, 1e-5));
}

#[test]
fn a_qwen3_moe_from_transformers_loads_trains_exports_and_keeps_its_logits() {
    round_trip("qwen3_moe", (32, 8, 4), (1, 16, 1e-6));
}

#[test]
fn a_qwen2_moe_from_transformers_loads_trains_exports_and_keeps_its_logits() {
    round_trip("qwen2_moe", (32, 8, 4), (2, 8, 1e-6));
}

#[test]
fn a_deepseek_v3_from_transformers_loads_trains_exports_and_keeps_its_logits() {
    round_trip("deepseek_v3", (32, 8, 2), (4, 16, 1e-6));
}

/// The same with its rotary parts interleaved, as DeepSeek's own checkpoints have them (read
/// into our order; written as halves).
#[test]
fn a_deepseek_v3_with_interleaved_rotary_parts_keeps_its_logits() {
    round_trip("deepseek_v3_interleaved", (32, 8, 2), (4, 16, 1e-6));
}

/// A model of `family` made by transformers: loaded, trained 5 steps, exported, each time with
/// transformers' logits; `shape` (d_model, experts, top-k) and `attention` (key/value heads, head
/// width, norm ε) as read.
fn round_trip(family: &str, shape: (usize, usize, usize), attention: (usize, usize, f64)) {
    let d = std::env::temp_dir().join(format!("lazarus-hf-transformers-{family}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let theirs = d.join("theirs");
    if run(&["make", theirs.to_str().unwrap(), family]).is_none() {
        return;
    }
    let ids: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 256).collect();
    // Loaded as it is: the same logits.
    let (model, config, _) = lazarus_model::trainer::load_model(&theirs, &Device::Cpu).unwrap();
    assert_eq!((config.model.d_model, config.model.n_experts, config.model.top_k), shape);
    assert_eq!((config.model.kv_heads(), config.model.head_width(), config.model.norm_eps), attention);
    assert_eq!(config.model.qk_norm, family == "qwen3_moe");
    assert_eq!(
        (config.model.qkv_bias, config.model.shared_expert_gate, config.model.shared_experts),
        match family {
            "qwen2_moe" => (true, true, 2),
            "deepseek_v3" | "deepseek_v3_interleaved" => (false, false, 2),
            _ => (false, false, 0),
        }
    );
    if family.starts_with("deepseek_v3") {
        let la = lazarus_model::config::LatentAttention { kv_rank: 16, q_rank: Some(24), rope_dim: 8 };
        assert_eq!(config.model.latent_attention, Some(la));
        assert_eq!((config.model.expert_groups, config.model.top_groups, config.model.routed_scaling), (4, 2, 2.5));
        assert_eq!((config.model.dense_first, config.model.dense_d_ff), (1, Some(48)));
    }
    let before = worst(&our_logits(&model, &ids), &their_logits(&theirs, &ids, &d));
    assert!(before <= 1e-4, "logits differ by {before} before training");
    // Trained from those weights, then exported: transformers reads it with our logits.
    let cfg = TrainConfig {
        model: config.model.clone(),
        steps: 5,
        batch_size: 4,
        seq_len: 32,
        warmup_steps: 1,
        lr: 1e-3,
        data: DataSource::Synthetic { seed: 1, bytes: 20_000 },
        init_from: Some(theirs.clone()),
        ..TrainConfig::default()
    };
    let mut t = Trainer::new(cfg).unwrap();
    let first = our_logits(&t.model, &ids);
    assert!(worst(&first, &our_logits(&model, &ids)) == 0.0, "init_from starts from their weights");
    for _ in 0..5 {
        t.step().unwrap();
    }
    let trained = our_logits(&t.model, &ids);
    assert!(worst(&trained, &first) > 1e-3, "training moved the model");
    let ours = d.join("ours");
    lazarus_model::hf::export(&t.model, &ours).unwrap();
    let after = worst(&trained, &their_logits(&ours, &ids, &d));
    assert!(after <= 1e-4, "logits differ by {after} after training and export");
    // In shards with an index, as transformers writes a large model: the same.
    let sharded = d.join("sharded");
    lazarus_model::hf::export_sharded(&t.model, &sharded, 16 << 10).unwrap();
    assert!(sharded.join(lazarus_model::hf::INDEX_FILE).is_file());
    let from_shards = worst(&trained, &their_logits(&sharded, &ids, &d));
    assert!(from_shards <= 1e-4, "logits differ by {from_shards} from the shards");
    eprintln!("{family}: transformers vs Lazarus logits: {before:.2e} before, {after:.2e} after training and export");
    let _ = std::fs::remove_dir_all(&d);
}
