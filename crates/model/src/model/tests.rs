use super::*;
use crate::rng::SplitMix64;

fn tiny() -> ModelConfig {
    ModelConfig {
        vocab_size: 11,
        d_model: 8,
        n_layers: 2,
        n_heads: 2,
        max_seq_len: 6,
        n_experts: 4,
        top_k: 2,
        d_ff: 8,
        moe_every: 2,
        aux_loss_coef: 0.1,
        capacity_factor: None,
        init_std: 0.3,
        ..ModelConfig::default()
    }
}

/// [`tiny`] with Mixtral's blocks (RMSNorm, rotary positions, SwiGLU experts, no biases),
/// top-3 of 5 with weights left unnormalised, a shared expert, and a dense block.
fn tiny_modern() -> ModelConfig {
    ModelConfig { n_experts: 5, top_k: 3, normalize_top_k: false, shared_experts: 1, rope_theta: 100.0, moe_every: 2, ..tiny().mixtral() }
}

fn batch(cfg: &ModelConfig, b: usize, t: usize, seed: u64) -> (Tensor, Tensor) {
    let mut rng = SplitMix64::new(seed);
    let mut draw = |n| (0..n).map(|_| rng.below(cfg.vocab_size) as u32).collect::<Vec<_>>();
    let x = Tensor::from_vec(draw(b * t), (b, t), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(draw(b * t), (b, t), &Device::Cpu).unwrap();
    (x, y)
}

fn loss(m: &MoeModel, x: &Tensor, y: &Tensor) -> f64 {
    m.forward(x, y, None).unwrap().loss.to_scalar::<f64>().unwrap()
}

/// Central finite differences against autograd on every tensor of a tiny full model (MoE
/// and dense blocks, attention, norms, embeddings, router with the aux loss), in f64.
#[test]
fn gradients_match_finite_differences() {
    finite_differences(&tiny(), &Device::Cpu, 1e-4);
}

/// The same with Mixtral's blocks, unnormalised top-3 and a shared expert: every new kernel
/// (RMSNorm, RoPE, SwiGLU) and the bias-free layers inside the whole model.
#[test]
fn gradients_of_the_modern_blocks_match_finite_differences() {
    finite_differences(&tiny_modern(), &Device::Cpu, 1e-4);
    finite_differences(&ModelConfig { normalize_top_k: true, moe_every: 1, ..tiny_modern() }, &Device::Cpu, 1e-4);
}

/// The same with DeepSeek-MoE's routing: a sigmoid router whose chosen scores are renormalised
/// and scaled, group-limited to the best 2 of 3 groups, a shared expert.
#[test]
fn gradients_through_a_sigmoid_router_with_groups_match_finite_differences() {
    let cfg =
        ModelConfig { n_experts: 6, top_k: 2, expert_groups: 3, top_groups: 2, routed_scaling: 2.5, moe_every: 1, ..tiny().deepseek_moe() };
    assert_eq!((cfg.router, cfg.shared_experts, cfg.normalize_top_k), (crate::config::RouterScore::Sigmoid, 1, true));
    finite_differences(&cfg, &Device::Cpu, 1e-4);
}

/// The same with Qwen3-MoE's query and key norms (each head's, before the rotary positions):
/// their weights get the loss's gradient too.
#[test]
fn gradients_through_the_query_and_key_norms_match_finite_differences() {
    let cfg = ModelConfig { qk_norm: true, ..tiny_modern() };
    assert_eq!(
        ModelConfig {
            n_experts: 5,
            top_k: 3,
            normalize_top_k: false,
            shared_experts: 1,
            rope_theta: 100.0,
            moe_every: 2,
            ..tiny().qwen_moe()
        },
        cfg
    );
    let m = MoeModel::new(&cfg, 1, DType::F64, &Device::Cpu).unwrap();
    assert_eq!(m.params().get("blocks.1.attn.k_norm.w").unwrap().dims(), [4]);
    finite_differences(&cfg, &Device::Cpu, 1e-4);
}

/// The same with grouped-query attention (4 query heads sharing 2 key/value heads) and heads
/// of 6 beside a width of 8 (so the output projection is [24, 8]), with Qwen3-MoE's norms on
/// heads of that width: the shared keys' and values' gradients add up over their query heads.
#[test]
fn gradients_through_grouped_query_attention_match_finite_differences() {
    let cfg = ModelConfig { n_heads: 4, n_kv_heads: Some(2), head_dim: Some(6), qk_norm: true, ..tiny_modern() };
    let m = MoeModel::new(&cfg, 1, DType::F64, &Device::Cpu).unwrap();
    assert_eq!(m.params().get("blocks.0.attn.qkv.w").unwrap().dims(), [8, (4 + 2 * 2) * 6]);
    assert_eq!(m.params().get("blocks.0.attn.out.w").unwrap().dims(), [24, 8]);
    assert_eq!(m.params().get("blocks.0.attn.k_norm.w").unwrap().dims(), [6]);
    finite_differences(&cfg, &Device::Cpu, 1e-4);
}

/// The same with Qwen2-MoE's blocks: biases on the queries, keys and values only, two shared
/// experts' width behind a sigmoid gate of the token (the gate's weight gets the gradient too).
#[test]
fn gradients_through_qwen2_moe_blocks_match_finite_differences() {
    let cfg = ModelConfig { shared_experts: 2, n_kv_heads: Some(1), moe_every: 1, ..tiny().qwen2_moe() };
    let m = MoeModel::new(&cfg, 1, DType::F64, &Device::Cpu).unwrap();
    assert_eq!(m.params().get("blocks.0.moe.shared_gate.w").unwrap().dims(), [8, 1]);
    assert_eq!(m.params().get("blocks.0.attn.qkv.b").unwrap().dims(), [(2 + 2) * 4]);
    assert!(m.params().get("blocks.0.attn.out.b").is_none());
    finite_differences(&cfg, &Device::Cpu, 1e-4);
}

/// Grouped-query attention is multi-head attention whose key and value heads are repeated: a
/// model with 2 key/value heads for 4 query heads gives the same loss as one with 4, whose
/// key and value projections are the first's, each head copied for its two query heads (head
/// j serves query heads 2j and 2j + 1, as transformers' `repeat_kv`).
#[test]
fn grouped_query_attention_is_multi_head_attention_with_repeated_heads() {
    let gqa = ModelConfig { n_heads: 4, n_kv_heads: Some(2), head_dim: Some(4), qk_norm: true, ..tiny_modern() };
    let mha = ModelConfig { n_kv_heads: None, ..gqa.clone() };
    let (g, m) = (MoeModel::new(&gqa, 5, DType::F64, &Device::Cpu).unwrap(), MoeModel::new(&mha, 6, DType::F64, &Device::Cpu).unwrap());
    let hd = 4;
    for (name, var) in m.params().iter() {
        let theirs = g.params().get(name).unwrap();
        let value = if name.ends_with("attn.qkv.w") {
            // Columns: q (4 heads), then k and v (2 heads each) → k and v of 4 heads.
            let part = |from: usize, heads: usize| theirs.narrow(1, from * hd, heads * hd).unwrap();
            let repeat = |t: Tensor| {
                let heads: Vec<Tensor> = (0..4).map(|h| t.narrow(1, (h / 2) * hd, hd).unwrap()).collect();
                Tensor::cat(&heads, 1).unwrap()
            };
            Tensor::cat(&[part(0, 4), repeat(part(4, 2)), repeat(part(6, 2))], 1).unwrap()
        } else {
            theirs.as_tensor().clone()
        };
        var.set(&value).unwrap();
    }
    let (x, y) = batch(&gqa, 2, 5, 4);
    let (a, b) = (loss(&g, &x, &y), loss(&m, &x, &y));
    assert!((a - b).abs() < 1e-12, "grouped {a} vs repeated {b}");
}

/// The same on a GPU (skipped without one), at the looser tolerance first set when GELU's
/// backward there was candle's (6-digit constants); not yet tightened on a GPU.
#[test]
fn gradients_on_a_gpu_match_finite_differences() {
    if let Some(gpu) = crate::ops::on_device_gpu() {
        finite_differences(&tiny(), &gpu, 1e-3);
        finite_differences(&tiny_modern(), &gpu, 1e-3);
        // Grouped-query attention with wide heads and q/k norms; Qwen2-MoE's biases and gate.
        finite_differences(&ModelConfig { n_heads: 4, n_kv_heads: Some(2), head_dim: Some(6), qk_norm: true, ..tiny_modern() }, &gpu, 1e-3);
        finite_differences(&ModelConfig { shared_experts: 2, moe_every: 1, ..tiny().qwen2_moe() }, &gpu, 1e-3);
    }
}

fn finite_differences(cfg: &ModelConfig, device: &Device, rel: f64) {
    let m = MoeModel::new(cfg, 3, DType::F64, device).unwrap();
    let (x, y) = batch(cfg, 2, 5, 9);
    let (x, y) = (x.to_device(device).unwrap(), y.to_device(device).unwrap());
    let out = m.forward(&x, &y, None).unwrap();
    let grads = out.backward().unwrap();
    let mut rng = SplitMix64::new(1);
    let mut checked = 0;
    for (name, var) in m.params().iter() {
        let Some(g) = grads.get(var.as_tensor()) else {
            // Only an expert that received no token may have no gradient.
            assert!(name.contains("experts"), "{name} has no gradient");
            continue;
        };
        let g: Vec<f64> = g.flatten_all().unwrap().to_vec1().unwrap();
        let base: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        for _ in 0..3 {
            let i = rng.below(base.len());
            let h = 1e-5;
            let mut p = base.clone();
            p[i] += h;
            var.set(&Tensor::from_vec(p.clone(), var.shape(), device).unwrap()).unwrap();
            let up = loss(&m, &x, &y);
            p[i] -= 2.0 * h;
            var.set(&Tensor::from_vec(p, var.shape(), device).unwrap()).unwrap();
            let down = loss(&m, &x, &y);
            var.set(&Tensor::from_vec(base.clone(), var.shape(), device).unwrap()).unwrap();
            let numeric = (up - down) / (2.0 * h);
            let tol = 1e-6 + rel * numeric.abs().max(g[i].abs());
            assert!((numeric - g[i]).abs() < tol, "{name}[{i}]: autograd {} vs numeric {numeric}", g[i]);
            checked += 1;
        }
    }
    assert!(checked > 50, "{checked}");
}

/// Half-precision matrix products (mixed precision): the loss close to the f32 model's, every
/// gradient in f32, finite and close to the f32 gradient (relative to the tensor's largest).
/// On the CPU in f16 (candle's CPU matmul has no bf16), in bf16 on a GPU.
#[test]
fn mixed_precision_keeps_f32_gradients_and_the_loss() {
    mixed_precision(&Device::Cpu, DType::F16);
    if let Some(gpu) = crate::ops::on_device_gpu() {
        mixed_precision(&gpu, DType::BF16);
    }
}

fn mixed_precision(device: &Device, half: DType) {
    let cfg = ModelConfig { d_model: 32, d_ff: 48, n_heads: 4, ..tiny() };
    let (x, y) = batch(&cfg, 3, 6, 2);
    let (x, y) = (x.to_device(device).unwrap(), y.to_device(device).unwrap());
    let f32_model = MoeModel::new(&cfg, 7, DType::F32, device).unwrap();
    let mixed = MoeModel::new(&cfg, 7, DType::F32, device).unwrap().with_compute_dtype(half).unwrap();
    assert_eq!(mixed.compute_dtype(), half);
    let (a, b) = (f32_model.forward(&x, &y, None).unwrap(), mixed.forward(&x, &y, None).unwrap());
    assert_eq!(b.loss.dtype(), DType::F32);
    let (la, lb) = (a.loss.to_scalar::<f32>().unwrap(), b.loss.to_scalar::<f32>().unwrap());
    // bf16 keeps 8 bits of mantissa, f16 11.
    let (loss_tol, grad_tol) = if half == DType::BF16 { (0.02, 0.1) } else { (0.01, 0.05) };
    assert!((la - lb).abs() <= loss_tol * la, "f32 {la} vs {half:?} {lb}");
    let (ga, gb) = (a.backward().unwrap(), b.backward().unwrap());
    for ((name, va), vb) in f32_model.params().iter().zip(mixed.params().vars()) {
        let (Some(g1), Some(g2)) = (ga.get(va.as_tensor()), gb.get(vb.as_tensor())) else {
            assert!(name.contains("experts"), "{name} has no gradient");
            continue;
        };
        assert_eq!(g2.dtype(), DType::F32, "{name}");
        let host = |g: &Tensor| g.flatten_all().unwrap().to_device(&Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
        let (g1, g2) = (host(g1), host(g2));
        let scale = g1.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        let worst = g1.iter().zip(&g2).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(g2.iter().all(|v| v.is_finite()) && worst <= grad_tol * scale, "{name}: {worst} of {scale}");
    }
}

/// The embedding over the cores (gathers and an add) against candle's index_select and
/// broadcast add: the same bits forward and in both tables' gradients (repeated tokens, and
/// a sequence shorter than max_seq_len, included).
#[test]
fn the_embedding_over_the_cores_is_candles_bit_for_bit() {
    for dtype in [DType::F32, DType::F64] {
        let cfg = tiny();
        let m = MoeModel::new(&cfg, 9, dtype, &Device::Cpu).unwrap();
        let (b, t) = (3, cfg.max_seq_len - 1);
        let ids: Vec<u32> = (0..b * t).map(|i| ((i * 7) % 5) as u32).collect();
        let tokens = Tensor::from_vec(ids, (b, t), &Device::Cpu).unwrap();
        let ours = m.embed(&tokens).unwrap();
        let pos = m.pos_emb.as_ref().unwrap().as_tensor().narrow(0, 0, t).unwrap();
        let theirs = m
            .tok_emb
            .as_tensor()
            .index_select(&tokens.flatten_all().unwrap(), 0)
            .unwrap()
            .reshape((b, t, cfg.d_model))
            .unwrap()
            .broadcast_add(&pos)
            .unwrap();
        let bits = |x: &Tensor| x.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(bits(&ours), bits(&theirs));
        let probe = Tensor::randn(0f32, 1.0, (b, t, cfg.d_model), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let g_ours = (&ours * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let g_theirs = (&theirs * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        for table in [&m.tok_emb, m.pos_emb.as_ref().unwrap()] {
            assert_eq!(bits(g_ours.get(table.as_tensor()).unwrap()), bits(g_theirs.get(table.as_tensor()).unwrap()), "{dtype:?}");
        }
    }
}

#[test]
fn top2_sends_each_token_to_two_distinct_experts() {
    let cfg = ModelConfig { moe_every: 1, ..tiny() };
    let m = MoeModel::new(&cfg, 5, DType::F32, &Device::Cpu).unwrap();
    let (x, y) = batch(&cfg, 3, 6, 4);
    let out = m.forward(&x, &y, None).unwrap();
    assert_eq!(out.moe.len(), 2);
    for stats in &out.moe {
        assert_eq!(stats.choices.len(), 18 * 2);
        for pair in stats.choices.chunks(2) {
            assert_ne!(pair[0], pair[1]);
        }
        assert_eq!(stats.load.iter().sum::<u64>(), 36);
    }
}

#[test]
fn capacity_factor_drops_overflow_and_trace_routing_forces_loads() {
    let cfg = ModelConfig { capacity_factor: Some(0.5), ..tiny() };
    let m = MoeModel::new(&cfg, 5, DType::F32, &Device::Cpu).unwrap();
    let (x, y) = batch(&cfg, 4, 6, 2);
    let out = m.forward(&x, &y, None).unwrap();
    // capacity = ceil(0.5 · 48 / 4) = 6 per expert, 48 assignments → ≥ 24 dropped.
    assert!(out.moe[0].dropped >= 24, "{:?}", out.moe[0]);
    let m = MoeModel::new(&tiny(), 5, DType::F32, &Device::Cpu).unwrap();
    let forced = vec![vec![1.0, 1.0, 2.0, 4.0]];
    let out = m.forward(&x, &y, Some(&forced)).unwrap();
    assert_eq!(out.moe[0].load, vec![6, 6, 12, 24]);
}

#[test]
fn expert_tensors_are_addressable() {
    let m = MoeModel::new(&ModelConfig { moe_every: 2, n_layers: 4, ..tiny() }, 1, DType::F32, &Device::Cpu).unwrap();
    let names = m.expert_param_names(1, 3);
    assert_eq!(names[0], "blocks.2.moe.experts.3.fc1.w");
    assert!(names.iter().all(|n| m.params().get(n).is_some()));
    let per_expert: usize = names.iter().map(|n| m.params().get(n).unwrap().elem_count()).sum();
    assert_eq!(per_expert, m.config().expert_params());
}

#[test]
fn default_model_is_5_to_20_million_parameters() {
    let m = MoeModel::new(&ModelConfig::default(), 0, DType::F32, &Device::Cpu).unwrap();
    let n = m.params().num_elements();
    assert!((5_000_000..=20_000_000).contains(&n), "{n}");
}

#[test]
fn the_parameter_count_from_the_shape_is_the_models() {
    let small = ModelConfig {
        vocab_size: 300,
        d_model: 12,
        n_layers: 5,
        n_heads: 3,
        max_seq_len: 9,
        n_experts: 3,
        d_ff: 7,
        ..ModelConfig::default()
    };
    let modern = ModelConfig { shared_experts: 2, n_heads: 2, ..small.clone().mixtral() };
    for cfg in [
        ModelConfig::default(),
        small.clone(),
        ModelConfig { moe_every: 2, ..small.clone() },
        ModelConfig { moe_every: 9, ..small.clone() },
        modern.clone(),
        ModelConfig { moe_every: 2, ffn_bias: true, norm: NormKind::Layer, ..modern },
        ModelConfig { shared_experts: 1, attn_bias: false, expert_act: Activation::Swiglu, ..small.clone() },
        ModelConfig { n_heads: 4, n_kv_heads: Some(2), head_dim: Some(6), ..small.clone().qwen_moe() },
        ModelConfig { n_kv_heads: Some(1), head_dim: Some(2), ..small.clone() },
        ModelConfig { shared_experts: 3, ..small.qwen2_moe() },
    ] {
        let m = MoeModel::new(&cfg, 0, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(cfg.parameter_count(), m.params().num_elements() as u128, "{cfg:?}");
    }
}

/// Mixtral's blocks have exactly Mixtral's tensors: no position table, no biases, RMSNorm
/// weights only, SwiGLU experts of [d, 2f] and [f, d]; shared experts are one dense FFN.
#[test]
fn the_modern_blocks_have_the_tensors_they_should() {
    let cfg = ModelConfig { moe_every: 1, ..tiny_modern() };
    let m = MoeModel::new(&cfg, 1, DType::F32, &Device::Cpu).unwrap();
    let names: Vec<&str> = m.params().iter().map(|(n, _)| n).collect();
    assert!(!names.iter().any(|n| n.ends_with(".b") || *n == "pos_emb"), "{names:?}");
    assert_eq!(m.expert_param_names(0, 4), ["blocks.0.moe.experts.4.fc1.w", "blocks.0.moe.experts.4.fc2.w"]);
    let shapes: Vec<Vec<usize>> = m.expert_vars(0, 4).unwrap().iter().map(|v| v.dims().to_vec()).collect();
    assert_eq!(shapes, [vec![8, 16], vec![8, 8]]);
    assert_eq!(shapes, m.expert_shapes());
    assert_eq!(m.params().get("blocks.1.moe.shared.fc1.w").unwrap().dims(), [8, 16]);
    assert_eq!(m.params().get("blocks.1.ln2.w").unwrap().dims(), [8]);
    // An expert given and released keeps the parameter list.
    let ws: Vec<Tensor> = m.expert_vars(0, 1).unwrap().iter().map(|v| v.as_tensor().clone()).collect();
    let mut m = m;
    m.set_expert(0, 1, None).unwrap();
    assert!(!m.expert_resident(0, 1).unwrap());
    assert!(m.set_expert(0, 1, Some(ws[..1].to_vec())).unwrap_err().to_string().contains("expert tensors"));
    m.set_expert(0, 1, Some(ws)).unwrap();
    assert!(m.expert_resident(0, 1).unwrap());
}

/// Un-normalised top-k weights are the router's probabilities; normalised ones sum to 1.
#[test]
fn top_k_weights_are_normalised_only_when_asked() {
    for normalize in [false, true] {
        let cfg = ModelConfig { normalize_top_k: normalize, moe_every: 1, ..tiny_modern() };
        let m = MoeModel::new(&cfg, 2, DType::F64, &Device::Cpu).unwrap();
        let FeedForward::Moe(layer) = &m.blocks[0].ff else { panic!("an MoE block") };
        let probs = Tensor::from_vec(vec![0.1, 0.2, 0.3, 0.15, 0.25], (1, 5), &Device::Cpu).unwrap();
        let w: Vec<f64> = layer.combine_weights(&probs, &[2, 4, 1], 1).unwrap().to_vec1().unwrap();
        let expected = if normalize { vec![0.3 / 0.75, 0.25 / 0.75, 0.2 / 0.75] } else { vec![0.3, 0.25, 0.2] };
        assert!(w.iter().zip(&expected).all(|(a, b)| (a - b).abs() < 1e-12), "{w:?}");
    }
}

#[test]
fn shapes_beyond_any_machine_are_errors_before_allocation() {
    for (cfg, field) in [
        (ModelConfig { n_experts: 100_000_000, ..ModelConfig::default() }, "n_experts"),
        (ModelConfig { d_model: 1 << 20, n_heads: 1, ..ModelConfig::default() }, "d_model"),
        (ModelConfig { vocab_size: usize::MAX, ..ModelConfig::default() }, "vocab_size"),
        (ModelConfig { head_dim: Some(1 << 20), ..ModelConfig::default() }, "head_dim"),
    ] {
        let e = MoeModel::new(&cfg, 0, DType::F32, &Device::Cpu).err().unwrap().to_string();
        assert!(e.contains(field), "{e}");
    }
}

/// The attention's shape is checked where it is given: key/value heads that do not divide the
/// query heads, a head of no width, an odd head under rotary positions, ε out of range.
#[test]
fn attention_shapes_that_cannot_be_are_named() {
    for (cfg, field) in [
        (ModelConfig { n_kv_heads: Some(3), ..ModelConfig::default() }, "n_kv_heads"),
        (ModelConfig { n_kv_heads: Some(0), ..ModelConfig::default() }, "n_kv_heads"),
        (ModelConfig { head_dim: Some(0), ..ModelConfig::default() }, "head_dim"),
        (ModelConfig { head_dim: Some(5), ..ModelConfig::default().mixtral() }, "head_dim"),
        (ModelConfig { d_model: 10, n_heads: 4, ..ModelConfig::default() }, "n_heads"),
        (ModelConfig { norm_eps: 0.0, ..ModelConfig::default() }, "norm_eps"),
        (ModelConfig { norm_eps: f64::NAN, ..ModelConfig::default() }, "norm_eps"),
    ] {
        let e = cfg.validate().err().unwrap().to_string();
        assert!(e.contains(field), "{field}: {e}");
    }
    // Heads of their own width need not divide the model's.
    ModelConfig { d_model: 10, n_heads: 4, head_dim: Some(4), ..ModelConfig::default() }.validate().unwrap();
}

/// The same with DeepSeek's latent attention (keys and values from a latent of 3, queries
/// directly or from a latent of 5, rotary parts of 4 beside heads of 6): every projection and
/// both latents' norms get the loss's gradient, and the parameters are as many as the
/// configuration counts.
#[test]
fn gradients_through_latent_attention_match_finite_differences() {
    use crate::config::LatentAttention;
    for q_rank in [None, Some(5)] {
        let la = LatentAttention { kv_rank: 3, q_rank, rope_dim: 4 };
        let cfg = ModelConfig { head_dim: Some(6), latent_attention: Some(la), moe_every: 1, ..tiny().deepseek_moe() };
        let m = MoeModel::new(&cfg, 1, DType::F64, &Device::Cpu).unwrap();
        assert_eq!(m.params().get("blocks.0.attn.kv_down.w").unwrap().dims(), [8, 3 + 4]);
        assert_eq!(m.params().get("blocks.0.attn.kv_up.w").unwrap().dims(), [3, 2 * 2 * 6]);
        assert_eq!(m.params().get("blocks.0.attn.out.w").unwrap().dims(), [12, 8]);
        assert!(m.params().get("blocks.0.attn.qkv.w").is_none());
        let count: usize = m.params().iter().map(|(_, v)| v.elem_count()).sum();
        assert_eq!(count as u128, cfg.parameter_count(), "q_rank {q_rank:?}");
        finite_differences(&cfg, &Device::Cpu, 1e-4);
    }
}

/// What latent attention is built without is refused by name.
#[test]
fn latent_attention_without_what_it_needs_is_refused() {
    use crate::config::LatentAttention;
    let la = LatentAttention { kv_rank: 3, q_rank: None, rope_dim: 4 };
    let base = ModelConfig { latent_attention: Some(la), ..tiny().deepseek_moe() };
    base.validate().unwrap();
    for (cfg, field) in [
        (ModelConfig { positions: Positions::Learned, ..base.clone() }, "positions"),
        (ModelConfig { n_kv_heads: Some(1), ..base.clone() }, "n_kv_heads"),
        (ModelConfig { qk_norm: true, ..base.clone() }, "qk_norm"),
        (ModelConfig { latent_attention: Some(LatentAttention { rope_dim: 3, ..la }), ..base.clone() }, "latent_attention.rope_dim"),
        (ModelConfig { latent_attention: Some(LatentAttention { kv_rank: 0, ..la }), ..base.clone() }, "latent_attention.kv_rank"),
        (ModelConfig { latent_attention: Some(LatentAttention { q_rank: Some(0), ..la }), ..base.clone() }, "latent_attention.q_rank"),
    ] {
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains(field), "{field}: {e}");
    }
}
