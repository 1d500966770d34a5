//! What the runtime's integration tests share (each test file is its own crate and pulls this in).

use lazarus_model::{DataSource, ModelConfig, TrainConfig};

/// A model small enough to train for a few steps in a test: d_model 32 with 4 heads, `layers`
/// MoE blocks of 4 experts (top-2, d_ff 48), 16-token sequences of a synthetic corpus.
pub fn tiny_config(layers: usize, steps: u64, batch: usize, seed: u64, corpus: (u64, usize)) -> TrainConfig {
    TrainConfig {
        model: ModelConfig {
            vocab_size: 256,
            d_model: 32,
            n_layers: layers,
            n_heads: 4,
            max_seq_len: 16,
            n_experts: 4,
            top_k: 2,
            d_ff: 48,
            moe_every: 1,
            aux_loss_coef: 0.01,
            capacity_factor: None,
            init_std: 0.05,
            ..ModelConfig::default()
        },
        steps,
        batch_size: batch,
        seq_len: 16,
        lr: 3e-3,
        min_lr: 3e-4,
        warmup_steps: 4.min(steps / 2),
        seed,
        data: DataSource::Synthetic { seed: corpus.0, bytes: corpus.1 },
        ..TrainConfig::default()
    }
}
