//! A block's attention: the packed projection of multi-head and grouped-query attention
//! ([`Attention`]: GPT-2's, Mixtral's, Qwen's), or DeepSeek's multi-head latent attention
//! ([`Latent`]). Both end in the same fused causal attention ([`crate::ops::causal_attention`]).

use candle_core::{DType, Tensor, Var};

use super::Linear;
use crate::config::{LatentAttention, ModelConfig};
use crate::error::Result;
use crate::params::{Init, ParamStore};

/// A block's attention, as its model has it.
pub(super) enum AttentionLayer {
    Packed(Attention),
    Latent(Latent),
}

impl AttentionLayer {
    /// Block `p`'s attention parameters, drawn from `init`.
    pub(super) fn new(ps: &mut ParamStore, init: &mut Init, p: &str, cfg: &ModelConfig) -> Result<Self> {
        let std = cfg.init_std;
        let out_std = std / (2.0 * cfg.n_layers as f64).sqrt();
        let (d, inner, hd) = (cfg.d_model, cfg.attention_width(), cfg.head_width());
        let rope = (cfg.positions == crate::config::Positions::Rope).then_some(cfg.rope_theta);
        // (The weights drawn in the order a seed has always drawn them: the projection in, then out.)
        let out =
            |ps: &mut ParamStore, init: &mut Init| Linear::new(ps, init, &format!("{p}.attn.out"), (inner, d), out_std, cfg.attn_bias);
        if let Some(la) = &cfg.latent_attention {
            return Ok(AttentionLayer::Latent(Latent::new(ps, init, p, cfg, la, out)?));
        }
        let qkv = Linear::new(ps, init, &format!("{p}.attn.qkv"), (d, cfg.qkv_width()), std, cfg.attn_bias || cfg.qkv_bias)?;
        let out = out(ps, init)?;
        let qk_norm = match cfg.qk_norm {
            true => Some((
                ps.add(format!("{p}.attn.q_norm.w"), init.constant(&[hd], 1.0)?)?,
                ps.add(format!("{p}.attn.k_norm.w"), init.constant(&[hd], 1.0)?)?,
            )),
            false => None,
        };
        Ok(AttentionLayer::Packed(Attention {
            qkv,
            out,
            qk_norm,
            heads: cfg.n_heads,
            kv_heads: cfg.kv_heads(),
            head_dim: hd,
            rope,
            norm_eps: cfg.norm_eps,
        }))
    }

    /// x: [B, T, d] → [B, T, d], causal; the products in `compute`, the result in x's dtype.
    pub(super) fn forward(&self, x: &Tensor, compute: DType) -> Result<Tensor> {
        match self {
            AttentionLayer::Packed(a) => a.forward(x, compute),
            AttentionLayer::Latent(a) => a.forward(x, compute),
        }
    }
}

pub(super) struct Attention {
    /// The packed projection [d, (heads + 2·kv_heads)·head_dim]: the queries, keys and values
    /// side by side.
    pub(super) qkv: Linear,
    /// [heads·head_dim, d].
    pub(super) out: Linear,
    /// The RMSNorm weights [head width] of the queries and of the keys (`qk_norm`).
    qk_norm: Option<(Var, Var)>,
    heads: usize,
    /// Key and value heads, each serving `heads / kv_heads` query heads in a row.
    kv_heads: usize,
    head_dim: usize,
    /// The rotary base θ with rotary positions.
    rope: Option<f64>,
    /// The q/k norms' ε (the model's norms').
    norm_eps: f64,
}

impl Attention {
    /// The widths of the queries (heads·head_dim) and of the keys, as of the values.
    pub(super) fn widths(&self) -> (usize, usize) {
        (self.heads * self.head_dim, self.kv_heads * self.head_dim)
    }

    /// The packed projection qkv [B, T, (heads + 2·kv_heads)·head_dim] → [B, T, heads·head_dim]:
    /// the queries' and keys' norms if the model has them, each key and value head shared by its
    /// group of query heads, rotary positions on q and k if the model has them, then causal
    /// attention (fused kernels, see [`crate::ops::rope`] and [`crate::ops::causal_attention`]).
    pub(super) fn attend(&self, qkv: &Tensor) -> Result<Tensor> {
        let normed;
        let qkv = match &self.qk_norm {
            Some((q, k)) => {
                normed = self.norm_queries_and_keys(qkv, q, k)?;
                &normed
            }
            None => qkv,
        };
        let shared;
        let qkv = match self.kv_heads < self.heads {
            true => {
                shared = self.share_keys_and_values(qkv)?;
                &shared
            }
            false => qkv,
        };
        Ok(match self.rope {
            Some(theta) => crate::ops::causal_attention(&crate::ops::rope(qkv, self.heads, theta)?, self.heads)?,
            None => crate::ops::causal_attention(qkv, self.heads)?,
        })
    }

    /// qkv with each head's queries and keys RMS-normed by `q` and `k` [head width] (Qwen3-MoE's
    /// q_norm and k_norm, before the rotary positions), in the weights' type (f32 under bf16
    /// products) and back to qkv's; the values as they are.
    fn norm_queries_and_keys(&self, qkv: &Tensor, q: &Var, k: &Var) -> Result<Tensor> {
        let (b, t, _) = qkv.dims3()?;
        let ((qw, kvw), hd) = (self.widths(), self.head_dim);
        let norm = |from: usize, width: usize, w: &Var| -> Result<Tensor> {
            let x = qkv.narrow(2, from, width)?.reshape((b, t, width / hd, hd))?.to_dtype(w.dtype())?;
            Ok(crate::ops::rms_norm_to(&x, w.as_tensor(), self.norm_eps, qkv.dtype())?.reshape((b, t, width))?)
        };
        Ok(Tensor::cat(&[norm(0, qw, q)?, norm(qw, kvw, k)?, qkv.narrow(2, qw + kvw, kvw)?], 2)?)
    }

    /// Grouped-query attention's packed qkv as the fused kernels' [B, T, 3·heads·head_dim]: key
    /// and value head j repeated for query heads j·g … j·g + g − 1 (g = heads / kv_heads, as
    /// transformers' `repeat_kv`). The copies' gradients add up on the shared head (candle's
    /// broadcast).
    fn share_keys_and_values(&self, qkv: &Tensor) -> Result<Tensor> {
        let (b, t, _) = qkv.dims3()?;
        let ((qw, kvw), hd) = (self.widths(), self.head_dim);
        let g = self.heads / self.kv_heads;
        let repeat = |from: usize| -> Result<Tensor> {
            let x = qkv.narrow(2, from, kvw)?.reshape((b, t, self.kv_heads, 1, hd))?;
            Ok(x.broadcast_as((b, t, self.kv_heads, g, hd))?.contiguous()?.reshape((b, t, qw))?)
        };
        Ok(Tensor::cat(&[qkv.narrow(2, 0, qw)?, repeat(qw)?, repeat(qw + kvw)?], 2)?)
    }

    /// x: [B, T, d] → [B, T, d], causal; the products in `compute` (the softmax in f32 at
    /// least), the result in x's dtype.
    pub(super) fn forward(&self, x: &Tensor, compute: DType) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let (qw, kvw) = self.widths();
        let qkv = self.qkv.forward(&x.reshape((b * t, d))?.to_dtype(compute)?, compute)?.reshape((b, t, qw + 2 * kvw))?;
        let y = self.attend(&qkv)?.reshape((b * t, qw))?;
        Ok(self.out.forward(&y, compute)?.to_dtype(x.dtype())?.reshape((b, t, d))?)
    }
}

/// How latent attention's queries are made: projected directly (DeepSeek-V2-Lite), or through
/// a latent of their own (DeepSeek-V2, V3).
enum Queries {
    Direct(Linear),
    Latent { down: Linear, norm: Var, up: Linear },
}

/// DeepSeek's multi-head latent attention ([`LatentAttention`]), as transformers'
/// `DeepseekV3Attention` computes it: queries [heads, head_dim + rope_dim]; the latent
/// `kv_down(x)` = [kv_rank | rope_dim], its first part RMS-normed and taken up to each head's
/// position-free keys and its values (`kv_up`), its second part the keys' rotary part, rotated
/// and shared by every head; attention over head_dim + rope_dim wide heads (scaled by its root),
/// the values padded with zeros to that width and the padding dropped after.
pub(super) struct Latent {
    queries: Queries,
    /// [d, kv_rank + rope_dim].
    kv_down: Linear,
    kv_norm: Var,
    /// [kv_rank, heads·2·head_dim]: each head's keys, then its values.
    kv_up: Linear,
    /// [heads·head_dim, d].
    out: Linear,
    heads: usize,
    head_dim: usize,
    rope_dim: usize,
    kv_rank: usize,
    theta: f64,
    norm_eps: f64,
}

impl Latent {
    fn new(
        ps: &mut ParamStore,
        init: &mut Init,
        p: &str,
        cfg: &ModelConfig,
        la: &LatentAttention,
        out: impl FnOnce(&mut ParamStore, &mut Init) -> Result<Linear>,
    ) -> Result<Self> {
        let (std, d, h, hd, r) = (cfg.init_std, cfg.d_model, cfg.n_heads, cfg.head_width(), la.rope_dim);
        let queries = match la.q_rank {
            None => Queries::Direct(Linear::new(ps, init, &format!("{p}.attn.q"), (d, h * (hd + r)), std, false)?),
            Some(q) => Queries::Latent {
                down: Linear::new(ps, init, &format!("{p}.attn.q_down"), (d, q), std, false)?,
                norm: ps.add(format!("{p}.attn.q_down_norm.w"), init.constant(&[q], 1.0)?)?,
                up: Linear::new(ps, init, &format!("{p}.attn.q_up"), (q, h * (hd + r)), std, false)?,
            },
        };
        Ok(Latent {
            queries,
            kv_down: Linear::new(ps, init, &format!("{p}.attn.kv_down"), (d, la.kv_rank + r), std, false)?,
            kv_norm: ps.add(format!("{p}.attn.kv_down_norm.w"), init.constant(&[la.kv_rank], 1.0)?)?,
            kv_up: Linear::new(ps, init, &format!("{p}.attn.kv_up"), (la.kv_rank, h * 2 * hd), std, false)?,
            out: out(ps, init)?,
            heads: h,
            head_dim: hd,
            rope_dim: r,
            kv_rank: la.kv_rank,
            theta: cfg.rope_theta,
            norm_eps: cfg.norm_eps,
        })
    }

    /// RMSNorm of a latent `x` [N, width] by `w`, in the weights' type and back to `out`.
    fn norm(&self, x: &Tensor, w: &Var, out: DType) -> Result<Tensor> {
        Ok(crate::ops::rms_norm_to(&x.to_dtype(w.dtype())?, w.as_tensor(), self.norm_eps, out)?)
    }

    /// x: [B, T, d] → [B, T, d], causal; the products in `compute`, the result in x's dtype.
    pub(super) fn forward(&self, x: &Tensor, compute: DType) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let (h, hd, r) = (self.heads, self.head_dim, self.rope_dim);
        let rows = x.reshape((b * t, d))?.to_dtype(compute)?;
        let q = match &self.queries {
            Queries::Direct(q) => q.forward(&rows, compute)?,
            Queries::Latent { down, norm, up } => up.forward(&self.norm(&down.forward(&rows, compute)?, norm, compute)?, compute)?,
        };
        let q = q.reshape((b, t, h, hd + r))?;
        let kv = self.kv_down.forward(&rows, compute)?;
        let kv_up = self.kv_up.forward(&self.norm(&kv.narrow(1, 0, self.kv_rank)?, &self.kv_norm, compute)?, compute)?;
        let kv_up = kv_up.reshape((b, t, h, 2 * hd))?;
        // The rotary parts, the key's repeated for every head, rotated by the fused kernel as a
        // packed [queries | keys | (unused)].
        let k_rot =
            kv.narrow(1, self.kv_rank, r)?.reshape((b, t, 1, r))?.broadcast_as((b, t, h, r))?.contiguous()?.reshape((b, t, h * r))?;
        let q_rot = q.narrow(3, hd, r)?.contiguous()?.reshape((b, t, h * r))?;
        let turned = crate::ops::rope(&Tensor::cat(&[&q_rot, &k_rot, &k_rot], 2)?, h, self.theta)?;
        let rotated = |at: usize| turned.narrow(2, at, h * r)?.reshape((b, t, h, r));
        let (q_rot, k_rot) = (rotated(0)?, rotated(h * r)?);
        let width = h * (hd + r);
        let queries = Tensor::cat(&[&q.narrow(3, 0, hd)?, &q_rot], 3)?.reshape((b, t, width))?;
        let keys = Tensor::cat(&[&kv_up.narrow(3, 0, hd)?, &k_rot], 3)?.reshape((b, t, width))?;
        let padding = Tensor::zeros((b, t, h, r), kv_up.dtype(), kv_up.device())?;
        let values = Tensor::cat(&[&kv_up.narrow(3, hd, hd)?, &padding], 3)?.reshape((b, t, width))?;
        let y = crate::ops::causal_attention(&Tensor::cat(&[&queries, &keys, &values], 2)?, h)?;
        let y = y.reshape((b, t, h, hd + r))?.narrow(3, 0, hd)?.contiguous()?.reshape((b * t, h * hd))?;
        Ok(self.out.forward(&y, compute)?.to_dtype(x.dtype())?.reshape((b, t, d))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    fn latent_cfg(q_rank: Option<usize>) -> ModelConfig {
        ModelConfig {
            vocab_size: 11,
            d_model: 8,
            n_layers: 1,
            n_heads: 2,
            head_dim: Some(6),
            max_seq_len: 5,
            n_experts: 2,
            top_k: 1,
            d_ff: 8,
            rope_theta: 100.0,
            init_std: 0.3,
            latent_attention: Some(LatentAttention { kv_rank: 3, q_rank, rope_dim: 4 }),
            ..ModelConfig::default().deepseek_moe()
        }
    }

    /// Latent attention written out plainly, as transformers' `DeepseekV3Attention` (eager, no
    /// interleaved rotary) computes it: products, RMSNorms, rotations from their formula, a
    /// masked softmax over head_dim + rope_dim wide heads.
    fn oracle(a: &Latent, x: &Tensor) -> Tensor {
        let (b, t, d) = x.dims3().unwrap();
        let (h, hd, r) = (a.heads, a.head_dim, a.rope_dim);
        let rows = x.reshape((b * t, d)).unwrap();
        let mm = |x: &Tensor, l: &Linear| x.matmul(l.w.as_tensor()).unwrap();
        let rms = |y: &Tensor, g: &Var| {
            let ms = y.sqr().unwrap().mean_keepdim(1).unwrap();
            y.broadcast_div(&(ms + a.norm_eps).unwrap().sqrt().unwrap()).unwrap().broadcast_mul(g.as_tensor()).unwrap()
        };
        let q = match &a.queries {
            Queries::Direct(q) => mm(&rows, q),
            Queries::Latent { down, norm, up } => mm(&rms(&mm(&rows, down), norm), up),
        };
        let q = q.reshape((b, t, h, hd + r)).unwrap();
        let kv = mm(&rows, &a.kv_down);
        let up = mm(&rms(&kv.narrow(1, 0, a.kv_rank).unwrap(), &a.kv_norm), &a.kv_up).reshape((b, t, h, 2 * hd)).unwrap();
        // Rotation of the last dimension's halves by position · θ^(−2i/r).
        let half = r / 2;
        let angles: Vec<f64> = (0..t).flat_map(|p| (0..half).map(move |i| p as f64 * a.theta.powf(-2.0 * i as f64 / r as f64))).collect();
        let table =
            |f: fn(f64) -> f64| Tensor::from_vec(angles.iter().map(|&x| f(x)).collect::<Vec<_>>(), (1, t, 1, half), &Device::Cpu).unwrap();
        let (cos, sin) = (table(f64::cos), table(f64::sin));
        let turn = |x: &Tensor| {
            let (x1, x2) = (x.narrow(3, 0, half).unwrap(), x.narrow(3, half, half).unwrap());
            let y1 = (x1.broadcast_mul(&cos).unwrap() - x2.broadcast_mul(&sin).unwrap()).unwrap();
            let y2 = (x2.broadcast_mul(&cos).unwrap() + x1.broadcast_mul(&sin).unwrap()).unwrap();
            Tensor::cat(&[y1, y2], 3).unwrap()
        };
        let k_rot = turn(&kv.narrow(1, a.kv_rank, r).unwrap().reshape((b, t, 1, r)).unwrap()).broadcast_as((b, t, h, r)).unwrap();
        let queries = Tensor::cat(&[q.narrow(3, 0, hd).unwrap(), turn(&q.narrow(3, hd, r).unwrap())], 3).unwrap();
        let keys = Tensor::cat(&[up.narrow(3, 0, hd).unwrap(), k_rot], 3).unwrap();
        let values = up.narrow(3, hd, hd).unwrap();
        // [B, H, T, ·]
        let heads = |x: Tensor| x.transpose(1, 2).unwrap().contiguous().unwrap();
        let (queries, keys, values) = (heads(queries), heads(keys), heads(values));
        let scores = (queries.matmul(&keys.t().unwrap()).unwrap() / ((hd + r) as f64).sqrt()).unwrap();
        let mask: Vec<f64> = (0..t).flat_map(|i| (0..t).map(move |j| if j > i { f64::NEG_INFINITY } else { 0.0 })).collect();
        let scores = scores.broadcast_add(&Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap()).unwrap();
        let p = candle_nn_softmax(&scores);
        let y = p.matmul(&values).unwrap().transpose(1, 2).unwrap().contiguous().unwrap().reshape((b * t, h * hd)).unwrap();
        mm(&y, &a.out).reshape((b, t, d)).unwrap()
    }

    fn candle_nn_softmax(x: &Tensor) -> Tensor {
        let e = x.broadcast_sub(&x.max_keepdim(D::Minus1).unwrap()).unwrap().exp().unwrap();
        e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap()
    }

    /// The fused form (one packed rotation, zero-padded values in the fused causal attention)
    /// is latent attention as written out, with and without the queries' latent.
    #[test]
    fn latent_attention_is_the_attention_it_stands_for() {
        for q_rank in [None, Some(5)] {
            let cfg = latent_cfg(q_rank);
            cfg.validate().unwrap();
            let mut ps = ParamStore::default();
            let mut init = Init::new(3, DType::F64, Device::Cpu);
            let AttentionLayer::Latent(a) = AttentionLayer::new(&mut ps, &mut init, "blocks.0", &cfg).unwrap() else { panic!("packed") };
            // Norm weights off one, so that they count.
            for (_, v) in ps.iter() {
                if v.rank() == 1 {
                    v.set(&(v.as_tensor() * 1.3).unwrap()).unwrap();
                }
            }
            let x = init.normal(&[2, 5, 8], 1.0).unwrap();
            let (fused, plain) = (a.forward(&x, DType::F64).unwrap(), oracle(&a, &x));
            let diff = (fused - plain).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap();
            assert!(diff < 1e-12, "q_rank {q_rank:?}: {diff}");
        }
    }
}
