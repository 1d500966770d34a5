#!/usr/bin/env python3
"""Hugging Face transformers' side of Lazarus's interop test (crates/model/tests/hf_transformers.rs).

  hf_mixtral.py make OUT            a tiny random MixtralForCausalLM, saved as OUT/{config.json,model.safetensors}
  hf_mixtral.py logits DIR IDS OUT  DIR's logits for the token ids IDS (comma-separated, one sequence), in f32,
                                    written to OUT as JSON [[V floats] per position]; fails if DIR's tensors do
                                    not match the model transformers builds from its config.json (missing,
                                    unexpected or mismatched tensors)

Needs torch and transformers; exits with status 3 and says so when they cannot be imported.
"""
import json
import sys

try:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
except ImportError as e:  # the test skips, saying why
    print(f"transformers or torch cannot be imported: {e}", file=sys.stderr)
    sys.exit(3)


def make(out):
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        tie_word_embeddings=False,
        sliding_window=None,
    )
    model = MixtralForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)


def logits(directory, ids, out):
    model, info = MixtralForCausalLM.from_pretrained(directory, torch_dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        print(f"{directory} does not load cleanly: {bad}", file=sys.stderr)
        sys.exit(1)
    model.eval()
    tokens = torch.tensor([[int(x) for x in ids.split(",")]])
    with torch.no_grad():
        result = model(input_ids=tokens).logits[0].to(torch.float64).tolist()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[1] == "logits":
        logits(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
