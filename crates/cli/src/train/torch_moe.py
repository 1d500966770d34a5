"""PyTorch reference of the default `lazarus train` model: a peer to measure training throughput against, side by side.

`lazarus bench train` runs this file (embedded in the binary) on the same cores when PyTorch
can be imported. It is the project's copy of the reference peer, kept to the same shape and
steps; `--heads` was added so that a bench with other flags can still be matched.

Same shape as `lazarus train`'s default: byte vocab 256, d_model 256, 4 blocks, 4 heads, an MoE
FFN with 8 experts top-2 (Linear-GELU-Linear, d_ff 512) in every block, batch 16 x 128, AdamW,
Switch aux loss 0.01, dropless routing with a per-expert loop (what a PyTorch user writes).
The block options follow Lazarus's: --norm rms (RMSNorm, weight only), --rope THETA (rotary
positions, Llama's half-split pairs, no position table), --act swiglu (SiLU(x W_gate) * (x W_up),
then W_down), --no-bias (no attention or FFN biases), --top-k K with --no-normalize, --shared S
(S always-on experts as one FFN of width S * dff); --arch mixtral is Lazarus's preset.
--hf trains transformers' own MixtralForCausalLM of the same shape instead (--arch mixtral's
options; needs transformers), its router aux loss at the same 0.01.
Prints a JSON line with median tokens/s of full training steps (fwd+bwd+AdamW).

usage: torch_moe.py [--device cpu|cuda] [--threads N] [--steps 30] [--compile] [block options]
"""
import argparse, json, math, time
import torch
import torch.nn as nn
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cpu")
ap.add_argument("--threads", type=int, default=0)
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--seq", type=int, default=128)
ap.add_argument("--d", type=int, default=256)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--heads", type=int, default=4)
ap.add_argument("--experts", type=int, default=8)
ap.add_argument("--dff", type=int, default=512)
ap.add_argument("--dtype", default="float32")
ap.add_argument("--compile", action="store_true")
ap.add_argument("--norm", default="layer", choices=["layer", "rms"])
ap.add_argument("--rope", type=float, default=0.0)
ap.add_argument("--act", default="gelu", choices=["gelu", "swiglu"])
ap.add_argument("--no-bias", action="store_true")
ap.add_argument("--top-k", type=int, default=2)
ap.add_argument("--no-normalize", action="store_true")
ap.add_argument("--shared", type=int, default=0)
ap.add_argument("--arch", default="gpt", choices=["gpt", "mixtral"])
ap.add_argument("--hf", action="store_true")
a = ap.parse_args()
if a.arch == "mixtral":
    a.norm, a.rope, a.act, a.no_bias = "rms", a.rope or 1e6, "swiglu", True
bias = not a.no_bias
if a.threads:
    torch.set_num_threads(a.threads)
dev = torch.device(a.device)
dt = getattr(torch, a.dtype)
torch.manual_seed(0)


def act(h):
    if a.act == "swiglu":
        gate, up = h.chunk(2, -1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh")


class Ffn(nn.Module):
    """One FFN as a PyTorch user writes it: two Linear layers around the activation."""

    def __init__(s, d, f):
        super().__init__()
        s.fc1 = nn.Linear(d, f * (2 if a.act == "swiglu" else 1), bias=bias)
        s.fc2 = nn.Linear(f, d, bias=bias)

    def forward(s, h):
        return s.fc2(act(s.fc1(h)))


class Moe(nn.Module):
    def __init__(s, d, f, E, k):
        super().__init__()
        f1 = f * (2 if a.act == "swiglu" else 1)
        s.gate = nn.Linear(d, E, bias=False)
        s.w1 = nn.Parameter(torch.randn(E, d, f1) * 0.02)
        s.b1 = nn.Parameter(torch.zeros(E, f1)) if bias else None
        s.w2 = nn.Parameter(torch.randn(E, f, d) * 0.02)
        s.b2 = nn.Parameter(torch.zeros(E, d)) if bias else None
        s.shared = Ffn(d, a.shared * f) if a.shared else None
        s.E, s.k = E, k

    def forward(s, h):
        probs = s.gate(h).softmax(-1)
        w, idx = probs.topk(s.k, -1)
        if s.k > 1 and not a.no_normalize:
            w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e in range(s.E):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            x1 = h[rows] @ s.w1[e]
            if bias:
                x1 = x1 + s.b1[e]
            y = act(x1) @ s.w2[e]
            if bias:
                y = y + s.b2[e]
            out.index_add_(0, rows, y * w[rows, slot].unsqueeze(1))
        if s.shared is not None:
            out = out + s.shared(h)
        f = torch.bincount(idx.flatten(), minlength=s.E).to(h.dtype) / idx.numel()
        aux = s.E * (probs.mean(0) * f).sum()
        return out, aux


class RmsNorm(nn.Module):
    def __init__(s, d):
        super().__init__()
        s.w = nn.Parameter(torch.ones(d))

    def forward(s, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * s.w


def norm(d):
    return RmsNorm(d) if a.norm == "rms" else nn.LayerNorm(d)


def rope(x):
    """Rotary positions on x [B, heads, T, dh]: dimension i turns with i + dh/2."""
    T, dh = x.shape[2], x.shape[3]
    inv = a.rope ** (-torch.arange(0, dh, 2, dtype=torch.float32, device=x.device) / dh)
    ang = torch.arange(T, dtype=torch.float32, device=x.device)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Block(nn.Module):
    def __init__(s, d, heads, f, E):
        super().__init__()
        s.ln1, s.ln2 = norm(d), norm(d)
        s.qkv, s.out = nn.Linear(d, 3 * d, bias=bias), nn.Linear(d, d, bias=bias)
        s.moe, s.h = Moe(d, f, E, a.top_k), heads

    def forward(s, x):
        B, T, D = x.shape
        q, k, v = s.qkv(s.ln1(x)).view(B, T, 3, s.h, D // s.h).permute(2, 0, 3, 1, 4)
        if a.rope:
            q, k = rope(q), rope(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + s.out(y)
        m, aux = s.moe(s.ln2(x).reshape(B * T, D))
        return x + m.view(B, T, D), aux


class Gpt(nn.Module):
    def __init__(s):
        super().__init__()
        s.tok = nn.Embedding(256, a.d)
        s.pos = None if a.rope else nn.Embedding(a.seq, a.d)
        s.blocks = nn.ModuleList(Block(a.d, a.heads, a.dff, a.experts) for _ in range(a.layers))
        s.ln, s.head = norm(a.d), nn.Linear(a.d, 256, bias=False)

    def forward(s, x, y):
        h = s.tok(x) if s.pos is None else s.tok(x) + s.pos.weight[: x.shape[1]]
        auxes = []
        for b in s.blocks:
            h, aux = b(h)
            auxes.append(aux)
        ce = F.cross_entropy(s.head(s.ln(h)).view(-1, 256), y.view(-1))
        return ce + 0.01 * torch.stack(auxes).mean()


class HfMixtral(nn.Module):
    """transformers' MixtralForCausalLM of the same shape, with our loss: cross-entropy of the
    logits against the next tokens plus 0.01 x its load-balancing loss."""

    def __init__(s):
        super().__init__()
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(vocab_size=256, hidden_size=a.d, intermediate_size=a.dff, num_hidden_layers=a.layers,
                            num_attention_heads=a.heads, num_key_value_heads=a.heads, num_local_experts=a.experts,
                            num_experts_per_tok=a.top_k, max_position_embeddings=a.seq, rope_theta=a.rope or 1e6,
                            rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                            output_router_logits=True, router_aux_loss_coef=0.01)
        s.m = MixtralForCausalLM(cfg)

    def forward(s, x, y):
        out = s.m(input_ids=x, output_router_logits=True, use_cache=False)
        ce = F.cross_entropy(out.logits.view(-1, 256), y.view(-1))
        return ce + 0.01 * out.aux_loss


m = (HfMixtral() if a.hf else Gpt()).to(dev, dt)
params = sum(p.numel() for p in m.parameters())
opt = torch.optim.AdamW(m.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
step_fn = m
if a.compile:
    step_fn = torch.compile(m)
g = torch.Generator().manual_seed(1)
# skewed byte stream so routing is uneven, like the synthetic corpus
data = torch.multinomial(torch.softmax(torch.randn(256, generator=g) * 2, 0), 2_000_000, True, generator=g)
times = []
for i in range(a.steps):
    off = torch.randint(0, len(data) - a.seq - 1, (a.batch,), generator=g)
    x = torch.stack([data[o:o + a.seq] for o in off]).to(dev)
    y = torch.stack([data[o + 1:o + a.seq + 1] for o in off]).to(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = step_fn(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
steady = sorted(times[max(3, a.steps // 4):])
med = steady[len(steady) // 2]
print(json.dumps({"system": "transformers-mixtral" if a.hf else "pytorch", "device": a.device, "threads": torch.get_num_threads(),
                  "compile": a.compile, "params": params, "tokens_per_s": a.batch * a.seq / med,
                  "step_s": med, "final_loss": float(loss.detach())}))
