#!/usr/bin/env python3
"""Hugging Face transformers' side of Lazarus's interop test (crates/model/tests/hf_transformers.rs).

  hf_transformers.py make OUT [FAMILY]  a tiny random MixtralForCausalLM (FAMILY mixtral, the default: 2
                                        key/value heads for 4 query heads, as Mixtral's 8 for 32) or
                                        Qwen3MoeForCausalLM (qwen3_moe: top-4 of 8 experts, weights not
                                        renormalised, query and key norms with random weights, one
                                        key/value head, heads of 16 beside a width of 32, RMSNorm ε 1e-6,
                                        as Qwen3-30B-A3B's 4 of 32 heads of 128 beside 2048), saved as
                                        OUT/{config.json,model.safetensors}; or Qwen2MoeForCausalLM
                                        (qwen2_moe: q/k/v biases, a shared expert twice a routed one's
                                        width behind its sigmoid gate, 2 key/value heads, biases random);
                                        or DeepseekV3ForCausalLM (deepseek_v3: latent attention with
                                        queries from a latent of 24, keys and values from one of 16,
                                        rotary parts of 8 beside heads of 16; top-2 of 8 experts in 4
                                        groups, 2 of them kept, scaled by 2.5, two shared experts; a
                                        random routing bias; the first block dense, 48 wide); deepseek_v3_interleaved:
                                        the same with its rotary parts interleaved, as DeepSeek's own checkpoints
  hf_transformers.py logits DIR IDS OUT  DIR's logits for the token ids IDS (comma-separated, one sequence), in f32,
                                    written to OUT as JSON [[V floats] per position]; fails if DIR's tensors do
                                    not match the model transformers builds from its config.json (missing,
                                    unexpected or mismatched tensors)

Needs torch and transformers; exits with status 3 and says so when they cannot be imported.
"""
import json
import os
import sys

try:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        GenerationConfig,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )
except ImportError as e:  # the test skips, saying why
    print(f"transformers or torch cannot be imported: {e}", file=sys.stderr)
    sys.exit(3)


# The shape both tiny models share.
SHAPE = dict(
    vocab_size=256,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    rope_theta=10000.0,
    initializer_range=0.2,
    tie_word_embeddings=False,
)


def make(out):
    torch.manual_seed(0)
    config = MixtralConfig(
        **SHAPE,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        intermediate_size=24,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
    )
    model = MixtralForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)


# What both Qwen families' tiny models share: top-4 of 8 small experts, weights not
# renormalised, an MoE layer in every block, no sliding window, their RMSNorm ε.
QWEN = dict(
    intermediate_size=48,
    moe_intermediate_size=16,
    rms_norm_eps=1e-6,
    num_experts=8,
    num_experts_per_tok=4,
    norm_topk_prob=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    use_sliding_window=False,
)


def make_qwen3_moe(out):
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**SHAPE, **QWEN, num_key_value_heads=1, head_dim=16)
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    # The norms start at one: random weights so that a misplaced one shows.
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm, layer.input_layernorm):
                norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(out, safe_serialization=True)


def make_qwen2_moe(out):
    torch.manual_seed(0)
    config = Qwen2MoeConfig(**SHAPE, **QWEN, num_key_value_heads=2, shared_expert_intermediate_size=32, qkv_bias=True)
    model = Qwen2MoeForCausalLM(config).to(torch.float32).eval()
    # Biases start at zero: random ones so that a misplaced one shows.
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.uniform_(-0.5, 0.5)
    model.save_pretrained(out, safe_serialization=True)


def make_deepseek_v3(out, interleaved=False):
    torch.manual_seed(0)
    config = DeepseekV3Config(
        **SHAPE,
        num_key_value_heads=4,
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        n_shared_experts=2,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        rope_interleave=interleaved,
        rms_norm_eps=1e-6,
        num_nextn_predict_layers=0,
    )
    model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    # The norms start at one and the routing bias at zero: random ones so that a misplaced one
    # shows (the bias changes which experts are chosen, not their weights).
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_a_layernorm, layer.self_attn.kv_a_layernorm, layer.input_layernorm):
                norm.weight.uniform_(0.5, 1.5)
            if hasattr(layer.mlp, "gate"):  # an MoE block
                layer.mlp.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    model.save_pretrained(out, safe_serialization=True)


MAKERS = {
    "mixtral": make,
    "qwen3_moe": make_qwen3_moe,
    "qwen2_moe": make_qwen2_moe,
    "deepseek_v3": make_deepseek_v3,
    "deepseek_v3_interleaved": lambda out: make_deepseek_v3(out, interleaved=True),
}


def logits(directory, ids, out):
    model, info = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        print(f"{directory} does not load cleanly: {bad}", file=sys.stderr)
        sys.exit(1)
    model.eval()
    # A generation config beside the model must be one transformers takes.
    if os.path.exists(os.path.join(directory, "generation_config.json")):
        GenerationConfig.from_pretrained(directory).validate(strict=True)
    tokens = torch.tensor([[int(x) for x in ids.split(",")]])
    with torch.no_grad():
        result = model(input_ids=tokens).logits[0].to(torch.float64).tolist()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if len(sys.argv) in (3, 4) and sys.argv[1] == "make":
        family = sys.argv[3] if len(sys.argv) == 4 else "mixtral"
        if family not in MAKERS:
            print(f"unknown family {family!r}: expected one of {', '.join(MAKERS)}", file=sys.stderr)
            sys.exit(2)
        MAKERS[family](sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[1] == "logits":
        logits(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
