"""PyTorch reference of the default `lazarus train` model: a peer to measure training throughput against, side by side.

`lazarus bench train` runs this file (embedded in the binary) on the same cores when PyTorch
can be imported. It is the project's copy of the reference peer, kept to the same shape and
steps; `--heads` was added so that a bench with other flags can still be matched.

Same shape as `lazarus train`'s default: byte vocab 256, d_model 256, 4 blocks, 4 heads, an MoE
FFN with 8 experts top-2 (Linear-GELU-Linear, d_ff 512) in every block, batch 16 x 128, AdamW,
Switch aux loss 0.01, dropless routing with a per-expert loop (what a PyTorch user writes).
Prints a JSON line with median tokens/s of full training steps (fwd+bwd+AdamW).

usage: torch_moe.py [--device cpu|cuda] [--threads N] [--steps 30] [--compile]
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
a = ap.parse_args()
if a.threads:
    torch.set_num_threads(a.threads)
dev = torch.device(a.device)
dt = getattr(torch, a.dtype)
torch.manual_seed(0)


class Moe(nn.Module):
    def __init__(s, d, f, E, k=2):
        super().__init__()
        s.gate = nn.Linear(d, E, bias=False)
        s.w1 = nn.Parameter(torch.randn(E, d, f) * 0.02)
        s.b1 = nn.Parameter(torch.zeros(E, f))
        s.w2 = nn.Parameter(torch.randn(E, f, d) * 0.02)
        s.b2 = nn.Parameter(torch.zeros(E, d))
        s.E, s.k = E, k

    def forward(s, h):
        probs = s.gate(h).softmax(-1)
        w, idx = probs.topk(s.k, -1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e in range(s.E):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = F.gelu(h[rows] @ s.w1[e] + s.b1[e], approximate="tanh") @ s.w2[e] + s.b2[e]
            out.index_add_(0, rows, y * w[rows, slot].unsqueeze(1))
        f = torch.bincount(idx.flatten(), minlength=s.E).to(h.dtype) / idx.numel()
        aux = s.E * (probs.mean(0) * f).sum()
        return out, aux


class Block(nn.Module):
    def __init__(s, d, heads, f, E):
        super().__init__()
        s.ln1, s.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        s.qkv, s.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        s.moe, s.h = Moe(d, f, E), heads

    def forward(s, x):
        B, T, D = x.shape
        q, k, v = s.qkv(s.ln1(x)).view(B, T, 3, s.h, D // s.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + s.out(y)
        m, aux = s.moe(s.ln2(x).reshape(B * T, D))
        return x + m.view(B, T, D), aux


class Gpt(nn.Module):
    def __init__(s):
        super().__init__()
        s.tok, s.pos = nn.Embedding(256, a.d), nn.Embedding(a.seq, a.d)
        s.blocks = nn.ModuleList(Block(a.d, a.heads, a.dff, a.experts) for _ in range(a.layers))
        s.ln, s.head = nn.LayerNorm(a.d), nn.Linear(a.d, 256, bias=False)

    def forward(s, x, y):
        h = s.tok(x) + s.pos.weight[: x.shape[1]]
        auxes = []
        for b in s.blocks:
            h, aux = b(h)
            auxes.append(aux)
        ce = F.cross_entropy(s.head(s.ln(h)).view(-1, 256), y.view(-1))
        return ce + 0.01 * torch.stack(auxes).mean()


m = Gpt().to(dev, dt)
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
print(json.dumps({"system": "pytorch", "device": a.device, "threads": torch.get_num_threads(),
                  "compile": a.compile, "params": params, "tokens_per_s": a.batch * a.seq / med,
                  "step_s": med, "final_loss": float(loss.detach())}))
