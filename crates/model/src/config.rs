//! Model configuration.

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// Shape of the GPT-style MoE decoder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Token vocabulary (256 for the byte tokenizer).
    pub vocab_size: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    /// Longest sequence the position table covers.
    pub max_seq_len: usize,
    /// Experts per MoE layer.
    pub n_experts: usize,
    /// Experts per token: 1 or 2 (weights renormalised for 2).
    pub top_k: usize,
    /// Hidden width of one expert (Linear–GELU–Linear), and of the dense FFN of non-MoE blocks.
    pub d_ff: usize,
    /// An MoE feed-forward in every `moe_every`-th block (1 = every block, 2 = every other,
    /// starting with block 0); the others have a dense FFN.
    pub moe_every: usize,
    /// Switch-style load-balancing loss coefficient.
    pub aux_loss_coef: f64,
    /// Tokens an expert may take per step, as a multiple of the even share N·k/E; `None` =
    /// dropless.
    pub capacity_factor: Option<f64>,
    /// Standard deviation of the initial weights.
    pub init_std: f64,
}

impl Default for ModelConfig {
    /// The default model: ~9.6 M parameters, 8 experts, top-2, MoE in every block.
    fn default() -> Self {
        ModelConfig {
            vocab_size: 256,
            d_model: 256,
            n_layers: 4,
            n_heads: 4,
            max_seq_len: 256,
            n_experts: 8,
            top_k: 2,
            d_ff: 512,
            moe_every: 1,
            aux_loss_coef: 0.01,
            capacity_factor: None,
            init_std: 0.02,
        }
    }
}

/// The largest value each dimension may take: far beyond any model this trains on one machine,
/// small enough that the products below cannot overflow, so a typo (`--experts 100000000`) is an
/// error before anything is allocated. What the machine can hold is checked against
/// [`crate::TrainConfig::memory_estimate`].
const LIMITS: [(&str, usize); 8] = [
    ("vocab_size", 1 << 24),
    ("d_model", 1 << 16),
    ("n_layers", 1 << 10),
    ("n_heads", 1 << 10),
    ("max_seq_len", 1 << 20),
    ("n_experts", 1 << 16),
    ("d_ff", 1 << 18),
    ("moe_every", 1 << 10),
];

impl ModelConfig {
    pub fn validate(&self) -> Result<()> {
        let values =
            [self.vocab_size, self.d_model, self.n_layers, self.n_heads, self.max_seq_len, self.n_experts, self.d_ff, self.moe_every];
        for ((field, max), v) in LIMITS.into_iter().zip(values) {
            if v > max {
                return Err(ModelError::config(field, v, format!("must be at most {max}")));
            }
        }
        let positive = [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("max_seq_len", self.max_seq_len),
            ("n_experts", self.n_experts),
            ("d_ff", self.d_ff),
            ("moe_every", self.moe_every),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(ModelError::config(field, v, "must be at least 1"));
            }
        }
        if !self.d_model.is_multiple_of(self.n_heads) {
            return Err(ModelError::config("n_heads", self.n_heads, format!("must divide d_model ({})", self.d_model)));
        }
        if !(1..=2).contains(&self.top_k) {
            return Err(ModelError::config("top_k", self.top_k, "must be 1 or 2"));
        }
        if self.top_k > self.n_experts {
            return Err(ModelError::config("top_k", self.top_k, format!("cannot exceed n_experts ({})", self.n_experts)));
        }
        if !self.aux_loss_coef.is_finite() || self.aux_loss_coef < 0.0 {
            return Err(ModelError::config("aux_loss_coef", self.aux_loss_coef, "must be finite and ≥ 0"));
        }
        if let Some(cf) = self.capacity_factor {
            if !cf.is_finite() || cf <= 0.0 {
                return Err(ModelError::config("capacity_factor", cf, "must be finite and > 0"));
            }
        }
        if !self.init_std.is_finite() || self.init_std <= 0.0 {
            return Err(ModelError::config("init_std", self.init_std, "must be finite and > 0"));
        }
        Ok(())
    }

    /// Whether block `i` has an MoE feed-forward.
    pub fn is_moe(&self, block: usize) -> bool {
        block.is_multiple_of(self.moe_every)
    }

    /// Number of MoE layers.
    pub fn moe_layers(&self) -> usize {
        (0..self.n_layers).filter(|&b| self.is_moe(b)).count()
    }

    /// Parameters one expert has (fc1 + fc2 with biases).
    pub fn expert_params(&self) -> usize {
        2 * self.d_model * self.d_ff + self.d_ff + self.d_model
    }

    /// Every parameter of the model, counted from the shape without building it (within
    /// [`ModelConfig::validate`]'s limits this cannot overflow).
    pub fn parameter_count(&self) -> u128 {
        let (v, d, f, e) = (self.vocab_size as u128, self.d_model as u128, self.d_ff as u128, self.n_experts as u128);
        let ffn = 2 * d * f + f + d;
        let moe = self.moe_layers() as u128;
        let dense = self.n_layers as u128 - moe;
        let per_block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d;
        v * d + self.max_seq_len as u128 * d + self.n_layers as u128 * per_block + moe * (d * e + e * ffn) + dense * ffn + 2 * d + d * v
    }
}
