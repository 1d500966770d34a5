//! Model configuration.
//!
//! Today's default is the paper's GPT-style MoE (LayerNorm, learned positions, GELU experts with
//! biases, top-2). The options below give the blocks of the MoE models people train now:
//! Mixtral's RMSNorm, rotary positions, SwiGLU experts without biases and normalised top-k
//! routing ([`ModelConfig::mixtral`]), and DeepSeek-/Qwen-MoE's shared experts beside the routed
//! ones.

use serde::{Deserialize, Serialize};

mod attention;

pub use attention::{LatentAttention, MAX_LATENT_RANK};

use crate::error::{ModelError, Result};

/// The normalisation of each block's two inputs and of the final hidden state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum NormKind {
    /// LayerNorm with a weight and a bias (GPT-2).
    #[default]
    Layer,
    /// RMSNorm, x/√(mean(x²) + eps)·w, weight only (Llama, Mixtral).
    Rms,
}

/// How the model knows a token's position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Positions {
    /// A learned table of `max_seq_len` rows added to the token embedding (GPT-2).
    #[default]
    Learned,
    /// Rotary embeddings on the queries and keys (RoFormer; Llama and Mixtral's half-split
    /// pairing: dimension i of a head turns with i + head_dim/2), base [`ModelConfig::rope_theta`].
    Rope,
}

/// The feed-forward of an expert, of a shared expert and of a dense block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// Linear → GELU (tanh form) → Linear.
    #[default]
    Gelu,
    /// SwiGLU (Shazeer 2020): SiLU(x·W_gate) ⊙ (x·W_up), then W_down. The first weight holds
    /// W_gate's `d_ff` columns then W_up's, [d_model, 2·d_ff].
    Swiglu,
}

impl Activation {
    /// Columns of an FFN's first weight for a hidden width `d_ff` (the kernels' rule).
    pub fn first_width(self, d_ff: usize) -> usize {
        lazarus_kernels::Activation::from(self).first_width(d_ff)
    }
}

/// The GPU kernels' name for the activation.
impl From<Activation> for lazarus_kernels::Activation {
    fn from(act: Activation) -> Self {
        match act {
            Activation::Gelu => lazarus_kernels::Activation::Gelu,
            Activation::Swiglu => lazarus_kernels::Activation::Swiglu,
        }
    }
}

/// Shape of the MoE decoder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Token vocabulary (256 for the byte tokenizer).
    pub vocab_size: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    /// Key and value heads (grouped-query attention, Ainslie et al. 2023: Mixtral has 8 for 32
    /// query heads, Qwen3-MoE 4): each serves `n_heads / n_kv_heads` query heads in a row, as
    /// transformers' `repeat_kv` pairs them. None: one per query head.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_kv_heads: Option<usize>,
    /// The width of a head (Qwen3-MoE's 128 with d_model 2048 and 32 heads). None:
    /// `d_model / n_heads`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Longest sequence the position table covers.
    pub max_seq_len: usize,
    /// Experts per MoE layer.
    pub n_experts: usize,
    /// Experts per token, 1 to 8.
    pub top_k: usize,
    /// Whether a token's k > 1 router weights are renormalised to sum to 1 (Mixtral, GShard);
    /// otherwise each is its softmax probability over all experts (Qwen-MoE's default, OLMoE). A
    /// single choice always keeps its probability, so the router learns from the loss.
    pub normalize_top_k: bool,
    /// Hidden width of one expert, and of the dense FFN of non-MoE blocks.
    pub d_ff: usize,
    /// How the router scores the experts: a softmax over them (Mixtral, Qwen) or a sigmoid each
    /// (DeepSeek-V3), whose chosen scores are then renormalised if `normalize_top_k`.
    pub router: RouterScore,
    /// The routed experts' weights times this (DeepSeek-V3's `routed_scaling_factor`, 2.5 there).
    pub routed_scaling: f64,
    /// Group-limited routing (DeepSeek-V3's `n_group`, `topk_group`): the experts in
    /// `expert_groups` equal groups, a token's top-k taken only among the `top_groups` groups
    /// whose two best scores sum highest. 1 and 1: no limit.
    pub expert_groups: usize,
    /// Groups a token's experts may come from (see `expert_groups`).
    pub top_groups: usize,
    /// Always-on experts beside the routed ones in every MoE block (DeepSeek-MoE's shared
    /// experts): every token goes through them, unweighted. They are held as one FFN of hidden
    /// width `shared_experts · d_ff` (the sum of S experts is such an FFN), replicated on every
    /// worker like the dense weights.
    pub shared_experts: usize,
    /// The shared experts' output times a sigmoid gate of the token, σ(x·w) with w [d_model]
    /// (Qwen2-MoE's `shared_expert_gate`): a token may turn them down.
    pub shared_expert_gate: bool,
    /// LayerNorm or RMSNorm.
    pub norm: NormKind,
    /// The norms' ε (GPT-2's LayerNorm and Mixtral's RMSNorm 1e-5, Qwen3-MoE's 1e-6).
    pub norm_eps: f64,
    /// Learned positions or rotary embeddings.
    pub positions: Positions,
    /// The rotary base θ (Llama 10 000, Mixtral 1 000 000); used with `positions = "rope"`.
    pub rope_theta: f64,
    /// The FFN of experts, shared experts and dense blocks.
    pub expert_act: Activation,
    /// Biases on the attention's projections.
    pub attn_bias: bool,
    /// Biases on the queries, keys and values only, not the output projection (Qwen2-MoE's
    /// `qkv_bias`); `attn_bias` puts them on both.
    pub qkv_bias: bool,
    /// An RMSNorm over each head's queries and keys before the rotary positions (Qwen3-MoE,
    /// OLMoE): two weights of the head's width, shared by the heads. It keeps the attention
    /// logits' scale in check as the model grows.
    pub qk_norm: bool,
    /// Biases on the FFNs (experts, shared experts, dense blocks).
    pub ffn_bias: bool,
    /// DeepSeek's multi-head latent attention instead of the packed projection (None: off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latent_attention: Option<LatentAttention>,
    /// An MoE feed-forward in every `moe_every`-th block (1 = every block, 2 = every other,
    /// starting with block 0); the others have a dense FFN.
    pub moe_every: usize,
    /// Dense blocks before the first MoE one (DeepSeek-V3's `first_k_dense_replace`: 3 of 61):
    /// the first layers' tokens are spread too evenly over the experts to be worth routing.
    pub dense_first: usize,
    /// The dense blocks' FFN width (DeepSeek-V3's `intermediate_size`, 18,432 beside experts of
    /// 2,048); None: `d_ff`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dense_d_ff: Option<usize>,
    /// Switch-style load-balancing loss coefficient (in the loss when `balance` is aux or both).
    pub aux_loss_coef: f64,
    /// How the routed experts' loads are kept even: the auxiliary loss, DeepSeek-V3's
    /// loss-free routing bias, or both.
    pub balance: Balance,
    /// γ of the loss-free bias: how far each expert's routing bias moves after a step, up for
    /// an expert below the mean load, down for one above (DeepSeek-V3 uses 0.001).
    pub bias_update_rate: f64,
    /// Tokens an expert may take per step, as a multiple of the even share N·k/E; `None` =
    /// dropless (`"off"` in a TOML file).
    #[serde(deserialize_with = "number_or_off", serialize_with = "off_when_none")]
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
            n_kv_heads: None,
            head_dim: None,
            max_seq_len: 256,
            n_experts: 8,
            top_k: 2,
            normalize_top_k: true,
            router: RouterScore::Softmax,
            routed_scaling: 1.0,
            expert_groups: 1,
            top_groups: 1,
            d_ff: 512,
            shared_experts: 0,
            shared_expert_gate: false,
            norm: NormKind::Layer,
            norm_eps: 1e-5,
            positions: Positions::Learned,
            rope_theta: 10_000.0,
            expert_act: Activation::Gelu,
            attn_bias: true,
            qkv_bias: false,
            qk_norm: false,
            ffn_bias: true,
            latent_attention: None,
            moe_every: 1,
            dense_first: 0,
            dense_d_ff: None,
            aux_loss_coef: 0.01,
            balance: Balance::Aux,
            bias_update_rate: 0.001,
            capacity_factor: None,
            init_std: 0.02,
        }
    }
}

/// How an MoE layer's loads are kept even ([`ModelConfig::balance`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Balance {
    /// Switch Transformer's auxiliary loss, weighted by `aux_loss_coef`, added to the loss.
    #[default]
    Aux,
    /// DeepSeek-V3's auxiliary-loss-free balancing (Wang et al. 2024, "Auxiliary-Loss-Free
    /// Load Balancing Strategy for Mixture-of-Experts"): a bias per expert, added to the router's
    /// scores only to choose the top-k (the weights stay the router's), and moved after each
    /// step by `bias_update_rate` toward the mean load. No gradient interferes with the language
    /// loss; the auxiliary loss is reported but not trained on.
    Bias,
    /// The bias, and the auxiliary loss in the loss.
    Both,
}

impl Balance {
    /// Whether the auxiliary loss is part of what is differentiated.
    pub fn uses_aux(self) -> bool {
        matches!(self, Balance::Aux | Balance::Both)
    }

    /// Whether each MoE layer keeps a routing bias.
    pub fn uses_bias(self) -> bool {
        matches!(self, Balance::Bias | Balance::Both)
    }
}

/// The router's scores ([`ModelConfig::router`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RouterScore {
    /// A softmax over the experts.
    #[default]
    Softmax,
    /// A sigmoid of each expert's logit, independent of the others (DeepSeek-V3).
    Sigmoid,
}

/// The presets `--arch` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// The paper's GPT-style blocks (the default).
    Gpt,
    /// Mixtral's blocks: see [`ModelConfig::mixtral`].
    Mixtral,
    /// Qwen3-MoE's blocks: see [`ModelConfig::qwen_moe`].
    #[serde(rename = "qwen-moe")]
    QwenMoe,
    /// Qwen2-MoE's blocks: see [`ModelConfig::qwen2_moe`].
    #[serde(rename = "qwen2-moe")]
    Qwen2Moe,
    /// DeepSeek-MoE's routing on Mixtral's blocks: see [`ModelConfig::deepseek_moe`].
    #[serde(rename = "deepseek-moe")]
    DeepseekMoe,
}

impl std::str::FromStr for Arch {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "gpt" => Ok(Arch::Gpt),
            "mixtral" => Ok(Arch::Mixtral),
            "qwen-moe" => Ok(Arch::QwenMoe),
            "qwen2-moe" => Ok(Arch::Qwen2Moe),
            "deepseek-moe" => Ok(Arch::DeepseekMoe),
            other => Err(format!("unknown architecture {other:?}: expected gpt, mixtral, qwen-moe, qwen2-moe or deepseek-moe")),
        }
    }
}

/// The widest head (transformers' models use 64 to 256).
pub const MAX_HEAD_DIM: usize = 1 << 12;
/// The widest dense FFN (DeepSeek-V3's is 18,432).
pub const MAX_DENSE_D_FF: usize = 1 << 20;

/// The most experts a token may be routed to (OLMoE and Qwen-MoE route to 8).
pub const MAX_TOP_K: usize = 8;

/// The largest value each dimension may take: far beyond any model this trains on one machine,
/// small enough that the products below cannot overflow, so a typo (`--experts 100000000`) is an
/// error before anything is allocated. What the machine can hold is checked against
/// [`crate::TrainConfig::memory_estimate`].
const LIMITS: [(&str, usize); 9] = [
    ("vocab_size", 1 << 24),
    ("d_model", 1 << 16),
    ("n_layers", 1 << 10),
    ("n_heads", 1 << 10),
    ("max_seq_len", 1 << 20),
    ("n_experts", 1 << 16),
    ("d_ff", 1 << 18),
    ("moe_every", 1 << 10),
    ("shared_experts", 1 << 8),
];

impl ModelConfig {
    /// Mixtral's block options on this shape: RMSNorm, rotary positions (θ = 10⁶), SwiGLU
    /// experts, no biases, normalised top-k, no shared experts, an MoE FFN in every block.
    pub fn mixtral(self) -> Self {
        ModelConfig {
            norm: NormKind::Rms,
            positions: Positions::Rope,
            rope_theta: 1e6,
            expert_act: Activation::Swiglu,
            attn_bias: false,
            qkv_bias: false,
            ffn_bias: false,
            normalize_top_k: true,
            shared_experts: 0,
            shared_expert_gate: false,
            moe_every: 1,
            qk_norm: false,
            router: RouterScore::Softmax,
            ..self
        }
    }

    /// Qwen3-MoE's block options on this shape: Mixtral's, with an RMSNorm on each head's
    /// queries and keys (Qwen3-30B-A3B also renormalises its top-8 weights, `norm_topk_prob`).
    pub fn qwen_moe(self) -> Self {
        ModelConfig { qk_norm: true, ..self.mixtral() }
    }

    /// Qwen2-MoE's (and Qwen1.5-MoE's) block options on this shape: Mixtral's, with biases on
    /// the queries, keys and values, one shared expert behind a sigmoid gate, and top-k weights
    /// left unnormalised (`norm_topk_prob` false, transformers' default).
    pub fn qwen2_moe(self) -> Self {
        ModelConfig { qkv_bias: true, shared_experts: 1, shared_expert_gate: true, normalize_top_k: false, ..self.mixtral() }
    }

    /// DeepSeek-MoE's routing on Mixtral's blocks (multi-head attention, not DeepSeek-V3's
    /// latent attention): one shared expert, a sigmoid router whose chosen scores are
    /// renormalised (DeepSeek-V3). Group-limited routing and the routed scaling factor are
    /// their own options (`expert_groups`, `top_groups`, `routed_scaling`).
    pub fn deepseek_moe(self) -> Self {
        ModelConfig { shared_experts: 1, router: RouterScore::Sigmoid, normalize_top_k: true, ..self.mixtral() }
    }

    /// This shape with the options of `arch`.
    pub fn with_arch(self, arch: Arch) -> Self {
        match arch {
            Arch::Gpt => {
                let d = ModelConfig::default();
                ModelConfig {
                    norm: d.norm,
                    positions: d.positions,
                    rope_theta: d.rope_theta,
                    expert_act: d.expert_act,
                    attn_bias: d.attn_bias,
                    qkv_bias: d.qkv_bias,
                    shared_expert_gate: d.shared_expert_gate,
                    ffn_bias: d.ffn_bias,
                    normalize_top_k: d.normalize_top_k,
                    shared_experts: d.shared_experts,
                    qk_norm: d.qk_norm,
                    router: d.router,
                    ..self
                }
            }
            Arch::Mixtral => self.mixtral(),
            Arch::QwenMoe => self.qwen_moe(),
            Arch::Qwen2Moe => self.qwen2_moe(),
            Arch::DeepseekMoe => self.deepseek_moe(),
        }
    }

    /// The block options in a few words, for the start of a run: "GPT blocks", or the options
    /// that differ from them ("RMSNorm, rotary θ=1000000, SwiGLU, no biases, 1 shared expert").
    pub fn describe_blocks(&self) -> String {
        let mut parts = Vec::new();
        if self.norm == NormKind::Rms {
            parts.push("RMSNorm".to_string());
        }
        if self.positions == Positions::Rope {
            parts.push(format!("rotary θ={}", self.rope_theta));
        }
        if self.expert_act == Activation::Swiglu {
            parts.push("SwiGLU".to_string());
        }
        match (self.attn_bias, self.qkv_bias && !self.attn_bias, self.ffn_bias) {
            (false, false, false) => parts.push("no biases".to_string()),
            (false, true, false) => parts.push("biases on q/k/v only".to_string()),
            (false, false, true) => parts.push("no attention biases".to_string()),
            (false, true, true) => parts.push("attention biases on q/k/v only".to_string()),
            (true, _, false) => parts.push("no FFN biases".to_string()),
            (true, _, true) => {}
        }
        if self.norm_eps != ModelConfig::default().norm_eps {
            parts.push(format!("norm ε {}", self.norm_eps));
        }
        if self.kv_heads() != self.n_heads {
            let kv = self.kv_heads();
            parts.push(format!("{kv} key/value head{}", if kv == 1 { "" } else { "s" }));
        }
        if self.head_dim.is_some_and(|w| w * self.n_heads != self.d_model) {
            parts.push(format!("heads of {}", self.head_width()));
        }
        if self.qk_norm {
            parts.push("q/k norms".to_string());
        }
        if self.dense_first > 0 {
            parts.push(format!("{} dense block{} first", self.dense_first, if self.dense_first == 1 { "" } else { "s" }));
        }
        if let Some(w) = self.dense_d_ff {
            parts.push(format!("dense FFNs of {w}"));
        }
        if let Some(la) = &self.latent_attention {
            let q = la.q_rank.map_or(String::new(), |q| format!(", queries {q}"));
            parts.push(format!("latent attention (keys and values {}{q}, rotary {})", la.kv_rank, la.rope_dim));
        }
        if self.router == RouterScore::Sigmoid {
            parts.push("sigmoid router".to_string());
        }
        if self.expert_groups > 1 {
            parts.push(format!("top-{} of {} expert groups", self.top_groups, self.expert_groups));
        }
        if self.routed_scaling != 1.0 {
            parts.push(format!("routed weights ×{}", self.routed_scaling));
        }
        if !self.normalize_top_k && self.top_k > 1 {
            parts.push("top-k weights unnormalised".to_string());
        }
        if self.shared_experts > 0 {
            let gated = if self.shared_expert_gate { " (gated)" } else { "" };
            parts.push(format!("{} shared expert{}{gated}", self.shared_experts, if self.shared_experts == 1 { "" } else { "s" }));
        }
        if parts.is_empty() {
            return "GPT blocks".to_string();
        }
        parts.join(", ")
    }

    /// Key and value heads: `n_kv_heads`, or one per query head.
    pub fn kv_heads(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// A head's width: `head_dim`, or `d_model / n_heads`.
    pub fn head_width(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.n_heads.max(1))
    }

    /// The attention's inner width, its heads side by side (`d_model` unless `head_dim` says
    /// otherwise): what the output projection takes back to `d_model`.
    pub fn attention_width(&self) -> usize {
        self.n_heads * self.head_width()
    }

    /// The packed projection's width: the queries, then the keys and the values of the
    /// `kv_heads` (3·d_model without grouped-query attention).
    pub fn qkv_width(&self) -> usize {
        (self.n_heads + 2 * self.kv_heads()) * self.head_width()
    }

    /// Rows of the learned position table (none with rotary positions).
    pub fn position_rows(&self) -> usize {
        match self.positions {
            Positions::Learned => self.max_seq_len,
            Positions::Rope => 0,
        }
    }

    pub fn validate(&self) -> Result<()> {
        let values = [
            self.vocab_size,
            self.d_model,
            self.n_layers,
            self.n_heads,
            self.max_seq_len,
            self.n_experts,
            self.d_ff,
            self.moe_every,
            self.shared_experts,
        ];
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
        match self.head_dim {
            None if !self.d_model.is_multiple_of(self.n_heads) => {
                return Err(ModelError::config(
                    "n_heads",
                    self.n_heads,
                    format!("must divide d_model ({}), or head_dim be given", self.d_model),
                ));
            }
            Some(w) if w == 0 || w > MAX_HEAD_DIM => {
                return Err(ModelError::config("head_dim", w, format!("must be 1 to {MAX_HEAD_DIM}")));
            }
            _ => {}
        }
        if let Some(kv) = self.n_kv_heads {
            if kv == 0 || !self.n_heads.is_multiple_of(kv) {
                return Err(ModelError::config("n_kv_heads", kv, format!("must divide n_heads ({})", self.n_heads)));
            }
        }
        if !(1..=MAX_TOP_K).contains(&self.top_k) {
            return Err(ModelError::config("top_k", self.top_k, format!("must be 1 to {MAX_TOP_K}")));
        }
        if self.positions == Positions::Rope {
            if !self.head_width().is_multiple_of(2) {
                let (field, value) = match self.head_dim {
                    Some(w) => ("head_dim", w),
                    None => ("n_heads", self.n_heads),
                };
                return Err(ModelError::config(
                    field,
                    value,
                    format!("rotary positions need an even head width, not {}", self.head_width()),
                ));
            }
            if !self.rope_theta.is_finite() || self.rope_theta <= 1.0 {
                return Err(ModelError::config("rope_theta", self.rope_theta, "must be finite and > 1"));
            }
        }
        if let Some(la) = &self.latent_attention {
            self.validate_latent_attention(la)?;
        }
        if self.dense_first >= self.n_layers.max(1) {
            let why = format!("must leave an MoE block among the {} (0 to {})", self.n_layers, self.n_layers.saturating_sub(1));
            return Err(ModelError::config("dense_first", self.dense_first, why));
        }
        if let Some(w) = self.dense_d_ff.filter(|&w| w == 0 || w > MAX_DENSE_D_FF) {
            return Err(ModelError::config("dense_d_ff", w, format!("must be 1 to {MAX_DENSE_D_FF}")));
        }
        if self.top_k > self.n_experts {
            return Err(ModelError::config("top_k", self.top_k, format!("cannot exceed n_experts ({})", self.n_experts)));
        }
        if self.shared_expert_gate && self.shared_experts == 0 {
            return Err(ModelError::config("shared_expert_gate", true, "gates the shared experts: shared_experts must be at least 1"));
        }
        if !self.norm_eps.is_finite() || self.norm_eps <= 0.0 || self.norm_eps > 1e-2 {
            return Err(ModelError::config("norm_eps", self.norm_eps, "must be finite, > 0 and ≤ 0.01"));
        }
        if !self.aux_loss_coef.is_finite() || self.aux_loss_coef < 0.0 {
            return Err(ModelError::config("aux_loss_coef", self.aux_loss_coef, "must be finite and ≥ 0"));
        }
        if !self.routed_scaling.is_finite() || self.routed_scaling <= 0.0 || self.routed_scaling > 1e3 {
            return Err(ModelError::config("routed_scaling", self.routed_scaling, "must be finite, > 0 and ≤ 1000"));
        }
        if self.expert_groups == 0 || !self.n_experts.is_multiple_of(self.expert_groups) {
            return Err(ModelError::config("expert_groups", self.expert_groups, format!("must divide n_experts ({})", self.n_experts)));
        }
        if self.top_groups == 0 || self.top_groups > self.expert_groups {
            return Err(ModelError::config("top_groups", self.top_groups, format!("must be 1 to expert_groups ({})", self.expert_groups)));
        }
        let reachable = self.top_groups * (self.n_experts / self.expert_groups);
        if self.top_k > reachable {
            return Err(ModelError::config(
                "top_k",
                self.top_k,
                format!("exceeds the {reachable} experts in top_groups ({}) of the expert groups", self.top_groups),
            ));
        }
        if self.expert_groups > 1 && self.n_experts / self.expert_groups < 2 {
            return Err(ModelError::config(
                "expert_groups",
                self.expert_groups,
                "a group's score is its two best experts': groups need two or more",
            ));
        }
        if !self.bias_update_rate.is_finite() || !(0.0..=1.0).contains(&self.bias_update_rate) {
            return Err(ModelError::config("bias_update_rate", self.bias_update_rate, "must be between 0 and 1"));
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

    /// The auxiliary loss's weight in what is differentiated: `aux_loss_coef` where `balance`
    /// trains on it, else 0 (it is still reported).
    pub fn aux_weight(&self) -> f64 {
        if self.balance.uses_aux() {
            self.aux_loss_coef
        } else {
            0.0
        }
    }

    /// How the router scores and picks ([`crate::routing::Router`]).
    pub fn router(&self) -> crate::routing::Router {
        crate::routing::Router {
            score: self.router,
            normalize: self.normalize_top_k,
            scale: self.routed_scaling,
            groups: self.expert_groups,
            top_groups: self.top_groups,
        }
    }

    /// Whether block `i` has an MoE feed-forward.
    pub fn is_moe(&self, block: usize) -> bool {
        block >= self.dense_first && block.is_multiple_of(self.moe_every)
    }

    /// The dense blocks' FFN width (`dense_d_ff`, else `d_ff`).
    pub fn dense_width(&self) -> usize {
        self.dense_d_ff.unwrap_or(self.d_ff)
    }

    /// Number of MoE layers.
    pub fn moe_layers(&self) -> usize {
        (0..self.n_layers).filter(|&b| self.is_moe(b)).count()
    }

    /// Shapes of an expert's tensors, in the order [`crate::MoeModel::expert_param_names`]
    /// lists them: W1 [d, f₁], b1 [f₁] (with biases), W2 [f, d], b2 [d] (with biases), f₁ the
    /// first weight's width ([`Activation::first_width`]).
    pub fn expert_shapes(&self) -> Vec<Vec<usize>> {
        self.ffn_shapes(self.d_ff)
    }

    /// As [`ModelConfig::expert_shapes`] for an FFN of hidden width `f`.
    pub(crate) fn ffn_shapes(&self, f: usize) -> Vec<Vec<usize>> {
        let (d, f1) = (self.d_model, self.expert_act.first_width(f));
        if self.ffn_bias {
            vec![vec![d, f1], vec![f1], vec![f, d], vec![d]]
        } else {
            vec![vec![d, f1], vec![f, d]]
        }
    }

    /// Parameters one expert has.
    pub fn expert_params(&self) -> usize {
        self.expert_shapes().iter().map(|s| s.iter().product::<usize>()).sum()
    }

    /// Every parameter of the model, counted from the shape without building it (within
    /// [`ModelConfig::validate`]'s limits this cannot overflow).
    pub fn parameter_count(&self) -> u128 {
        let (v, d, e) = (self.vocab_size as u128, self.d_model as u128, self.n_experts as u128);
        let ffn = |f: usize| self.ffn_shapes(f).iter().map(|s| s.iter().map(|&x| x as u128).product::<u128>()).sum::<u128>();
        let moe = self.moe_layers() as u128;
        let dense = self.n_layers as u128 - moe;
        let norm = match self.norm {
            NormKind::Layer => 2 * d,
            NormKind::Rms => d,
        };
        let per_block = 2 * norm + self.attention_parameters();
        let shared = if self.shared_experts > 0 { ffn(self.shared_experts * self.d_ff) } else { 0 };
        let shared = shared + if self.shared_expert_gate { d } else { 0 };
        v * d
            + self.position_rows() as u128 * d
            + self.n_layers as u128 * per_block
            + moe * (d * e + e * ffn(self.d_ff) + shared)
            + dense * ffn(self.dense_width())
            + norm
            + d * v
    }
}

/// A setting that is a number or off: a number, `"off"` (TOML has no null) or null (JSON).
/// `capacity_factor = "off"` and `grad_clip = "off"` turn the setting off, as the command line's
/// `off` does.
pub(crate) fn number_or_off<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<f64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Said {
        Number(f64),
        Word(String),
    }
    match Option::<Said>::deserialize(d)? {
        None => Ok(None),
        Some(Said::Number(x)) => Ok(Some(x)),
        Some(Said::Word(w)) if w == "off" => Ok(None),
        Some(Said::Word(w)) => Err(serde::de::Error::custom(format!("'{w}' (expected a number or \"off\")"))),
    }
}

/// A setting that is a number or off as [`number_or_off`] reads it back: off as `"off"`, not
/// left out (TOML has no null, and a setting left out reads as its default, which may be on).
pub(crate) fn off_when_none<S: serde::Serializer>(x: &Option<f64>, s: S) -> std::result::Result<S::Ok, S::Error> {
    match x {
        Some(x) => s.serialize_f64(*x),
        None => s.serialize_str("off"),
    }
}

#[cfg(test)]
mod number_or_off_tests {
    use crate::TrainConfig;

    /// `"off"`, a number (integer or not) and, in JSON, null read; another word is named.
    #[test]
    fn off_or_a_number_reads_from_toml_and_json() {
        let c: TrainConfig = toml::from_str("grad_clip = \"off\"\n[model]\ncapacity_factor = \"off\"\n").unwrap();
        assert_eq!((c.grad_clip, c.model.capacity_factor), (None, None));
        let c: TrainConfig = toml::from_str("grad_clip = 2\n[model]\ncapacity_factor = 1.5\n").unwrap();
        assert_eq!((c.grad_clip, c.model.capacity_factor), (Some(2.0), Some(1.5)));
        let c: TrainConfig = toml::from_str("").unwrap();
        assert_eq!(c.grad_clip, TrainConfig::default().grad_clip);
        let e = toml::from_str::<TrainConfig>("grad_clip = \"none\"\n").unwrap_err().to_string();
        assert!(e.contains("'none' (expected a number or \"off\")"), "{e}");
        let json = serde_json::to_string(&TrainConfig { grad_clip: None, ..TrainConfig::default() }).unwrap();
        assert_eq!(serde_json::from_str::<TrainConfig>(&json).unwrap().grad_clip, None);
    }

    /// Off is written as off: a setting that is off by default's opposite reads back off.
    #[test]
    fn off_settings_read_back_off_from_the_toml_they_are_written_as() {
        let mut c = TrainConfig { grad_clip: None, ..TrainConfig::default() };
        c.model.capacity_factor = None;
        assert!(TrainConfig::default().grad_clip.is_some(), "the test needs a setting on by default");
        let back = TrainConfig::from_toml(&c.to_toml().unwrap()).unwrap();
        assert_eq!((back.grad_clip, back.model.capacity_factor), (None, None));
        assert_eq!(back, c);
    }
}
