//! The attention's part of [`ModelConfig`]: DeepSeek's latent attention, what it is built
//! without, and the attention's parameters.

use serde::{Deserialize, Serialize};

use super::{ModelConfig, Positions, MAX_HEAD_DIM};
use crate::error::{ModelError, Result};

/// The widest latent of latent attention (DeepSeek-V3's are 512 and 1,536).
pub const MAX_LATENT_RANK: usize = 1 << 14;

/// DeepSeek's multi-head latent attention (DeepSeek-V2 §2.1.2–2.1.3, kept by V3): each token's
/// keys and values come out of one low-rank latent (`kv_rank` wide, RMS-normed) and, the
/// queries too when `q_rank` is given; the rotary positions go on a part of their own
/// (`rope_dim` wide a head, the key's part one for all heads), since a rotation would not commute
/// with the latent's up-projection. A head's keys are its `head_dim` wide position-free part and
/// the shared rotary part; its values are `head_dim` wide. Why: the latent is what a decoder
/// caches — at V3's size 576 numbers a token and layer instead of 32,768.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatentAttention {
    /// The keys' and values' latent width (`kv_lora_rank`).
    pub kv_rank: usize,
    /// The queries' latent width (`q_lora_rank`); None: the queries are projected directly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub q_rank: Option<usize>,
    /// Each head's rotary part of its queries and keys (`qk_rope_head_dim`, even).
    pub rope_dim: usize,
}

impl ModelConfig {
    /// Latent attention's widths, and what it is built without.
    pub(super) fn validate_latent_attention(&self, la: &LatentAttention) -> Result<()> {
        let without = [
            (self.positions == Positions::Rope, "positions", "learned", "latent attention needs rotary positions (rope)"),
            (
                self.kv_heads() == self.n_heads,
                "n_kv_heads",
                "fewer than the heads",
                "latent attention shares a latent, not key/value heads",
            ),
            (!self.qk_norm, "qk_norm", "true", "latent attention norms its latents, not its heads"),
            (!self.attn_bias && !self.qkv_bias, "attn_bias", "true", "latent attention has no biases (attn_bias and qkv_bias false)"),
        ];
        if let Some((_, field, value, why)) = without.into_iter().find(|(ok, ..)| !ok) {
            return Err(ModelError::config(field, value, why));
        }
        if la.kv_rank == 0 || la.kv_rank > MAX_LATENT_RANK {
            return Err(ModelError::config("latent_attention.kv_rank", la.kv_rank, format!("must be 1 to {MAX_LATENT_RANK}")));
        }
        if let Some(q) = la.q_rank.filter(|&q| q == 0 || q > MAX_LATENT_RANK) {
            return Err(ModelError::config("latent_attention.q_rank", q, format!("must be 1 to {MAX_LATENT_RANK}")));
        }
        if la.rope_dim == 0 || !la.rope_dim.is_multiple_of(2) || la.rope_dim > MAX_HEAD_DIM {
            return Err(ModelError::config("latent_attention.rope_dim", la.rope_dim, format!("must be even, 2 to {MAX_HEAD_DIM}")));
        }
        Ok(())
    }

    /// The attention's parameters in one block (without its norm).
    pub(super) fn attention_parameters(&self) -> u128 {
        let (d, inner) = (self.d_model as u128, self.attention_width() as u128);
        let Some(la) = &self.latent_attention else {
            let packed = self.qkv_width() as u128;
            let bias = match (self.attn_bias, self.qkv_bias) {
                (true, _) => packed + d,
                (false, true) => packed,
                (false, false) => 0,
            };
            let qk_norm = if self.qk_norm { 2 * self.head_width() as u128 } else { 0 };
            return d * packed + inner * d + bias + qk_norm;
        };
        let (h, hd, r, kv) = (self.n_heads as u128, self.head_width() as u128, la.rope_dim as u128, la.kv_rank as u128);
        let queries = match la.q_rank {
            Some(q) => d * q as u128 + q as u128 + q as u128 * h * (hd + r),
            None => d * h * (hd + r),
        };
        queries + d * (kv + r) + kv + kv * h * 2 * hd + inner * d
    }
}
