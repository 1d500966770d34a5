//! Evaluation: the mean next-token loss of a model over a token stream, in windows taken in
//! order — window i holds tokens [i·T, (i+1)·T] (T inputs, each followed by its target), the
//! stream's first `windows` of them — so that anyone can compute the same number elsewhere from
//! the same tokens. Forward only: nothing in the model changes.

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::model::MoeModel;

/// Most windows one evaluation takes.
pub const MAX_EVAL_WINDOWS: usize = 1 << 20;

/// What an evaluation found.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    /// Windows evaluated (of T tokens each).
    pub windows: usize,
    /// Tokens whose next token was predicted.
    pub tokens: u64,
    /// Mean next-token cross-entropy (nats).
    pub loss: f64,
    /// exp(loss).
    pub perplexity: f64,
}

/// How many windows of `seq_len` a stream of `len` tokens holds (each needs one token more:
/// the last target).
pub fn windows_in(len: usize, seq_len: usize) -> usize {
    len.saturating_sub(1) / seq_len.max(1)
}

/// The loss of `model` over the first `windows` windows of `tokens` (None: every whole one),
/// `batch` windows a forward pass.
pub fn evaluate(model: &MoeModel, tokens: &[u32], seq_len: usize, windows: Option<usize>, batch: usize) -> Result<Evaluation> {
    let n = windows_to_take(tokens.len(), seq_len, windows)?;
    let batch = batch.clamp(1, n);
    let device = model.device().clone();
    let mut sum = 0.0;
    for first in (0..n).step_by(batch) {
        let b = batch.min(n - first);
        let (x, y) = window_rows(tokens, seq_len, first, b);
        let out = model.forward(&Tensor::from_vec(x, (b, seq_len), &device)?, &Tensor::from_vec(y, (b, seq_len), &device)?, None)?;
        // The pass's mean, weighted by its windows (every window has T tokens).
        sum += out.ce_loss.to_dtype(DType::F64)?.to_scalar::<f64>()? * b as f64;
    }
    Ok(Evaluation::of_sum(sum, n, seq_len))
}

/// How many windows an evaluation takes of a stream of `len` tokens: `windows` of them (None:
/// every whole one), at most the stream's and [`MAX_EVAL_WINDOWS`]; an error when none.
pub fn windows_to_take(len: usize, seq_len: usize, windows: Option<usize>) -> Result<usize> {
    let have = windows_in(len, seq_len);
    if have == 0 || seq_len == 0 {
        return Err(ModelError::Data {
            path: "evaluation data".into(),
            reason: format!("{len} tokens: not one window of {seq_len} tokens and its last target"),
        });
    }
    let n = windows.unwrap_or(have).min(have).min(MAX_EVAL_WINDOWS);
    if n == 0 {
        return Err(ModelError::config("eval windows", 0, "at least one window"));
    }
    Ok(n)
}

/// Windows `first`..`first + count` of `tokens` (each `seq_len` long; the caller checked they
/// are there): their inputs and their targets, one window after another.
pub fn window_rows(tokens: &[u32], seq_len: usize, first: usize, count: usize) -> (Vec<u32>, Vec<u32>) {
    let (mut x, mut y) = (Vec::with_capacity(count * seq_len), Vec::with_capacity(count * seq_len));
    for w in first..first + count {
        x.extend_from_slice(&tokens[w * seq_len..(w + 1) * seq_len]);
        y.extend_from_slice(&tokens[w * seq_len + 1..(w + 1) * seq_len + 1]);
    }
    (x, y)
}

impl Evaluation {
    /// The evaluation of `windows` windows of `seq_len` tokens whose per-window mean losses add
    /// up to `sum`.
    pub fn of_sum(sum: f64, windows: usize, seq_len: usize) -> Self {
        let loss = sum / windows.max(1) as f64;
        Evaluation { windows, tokens: (windows * seq_len) as u64, loss, perplexity: loss.exp() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use candle_core::Device;

    fn tiny() -> MoeModel {
        let c = ModelConfig { d_model: 16, n_layers: 2, n_heads: 2, n_experts: 4, d_ff: 16, max_seq_len: 16, ..ModelConfig::default() };
        MoeModel::new(&c, 3, DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn the_loss_is_the_mean_over_windows_taken_in_order_whatever_the_batching() {
        let model = tiny();
        let tokens: Vec<u32> = (0..200u32).map(|i| (i * 7 + 3) % 256).collect();
        let one = evaluate(&model, &tokens, 8, Some(10), 1).unwrap();
        let batched = evaluate(&model, &tokens, 8, Some(10), 4).unwrap();
        assert_eq!((one.windows, one.tokens), (10, 80));
        assert!((one.loss - batched.loss).abs() < 1e-5, "{one:?} vs {batched:?}");
        assert!((one.perplexity - one.loss.exp()).abs() < 1e-9);
        // Window by window by hand: the mean of each window's own loss.
        let each: f64 = (0..10).map(|w| evaluate(&model, &tokens[w * 8..], 8, Some(1), 1).unwrap().loss).sum::<f64>() / 10.0;
        assert!((each - one.loss).abs() < 1e-5, "{each} vs {}", one.loss);
        // At most what the stream holds: 199 / 8 = 24 whole windows.
        assert_eq!(evaluate(&model, &tokens, 8, None, 8).unwrap().windows, 24);
        assert_eq!(evaluate(&model, &tokens, 8, Some(1000), 8).unwrap().windows, 24);
        assert!(evaluate(&model, &tokens[..8], 8, None, 1).unwrap_err().to_string().contains("not one window"));
    }
}
