//! Sampling from a model: one token at a time from the logits of the last position, over the
//! last `context` tokens (no cache: each token is a forward pass of the window, which is what a
//! look at a small model needs). Temperature 0 takes the most likely token; otherwise the logits
//! are divided by the temperature, cut to the `top_k` most likely (0: all) and drawn from with a
//! seeded generator, so that the same seed gives the same text.

use candle_core::{DType, Tensor};

use crate::error::{ModelError, Result};
use crate::model::MoeModel;
use crate::rng::SplitMix64;

/// How to draw tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// New tokens to draw.
    pub tokens: usize,
    /// 0: the most likely token every time.
    pub temperature: f64,
    /// Draw among this many most likely tokens (0: all).
    pub top_k: usize,
    pub seed: u64,
}

impl Default for Sampling {
    /// `lazarus generate`'s defaults, which an export also writes as the model's
    /// `generation_config.json` (so that transformers' `generate` draws as ours does).
    fn default() -> Self {
        Sampling { tokens: 200, temperature: 0.8, top_k: 40, seed: 0 }
    }
}

/// Most tokens one call draws.
pub const MAX_NEW_TOKENS: usize = 1 << 16;

/// The tokens `model` draws after `prompt`, each from the last `context` tokens before it.
pub fn generate(model: &MoeModel, prompt: &[u32], context: usize, s: &Sampling) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(ModelError::config("prompt", "''", "at least one token to go on from"));
    }
    if !s.temperature.is_finite() || s.temperature < 0.0 {
        return Err(ModelError::config("temperature", s.temperature, "finite and 0 or more"));
    }
    if s.tokens > MAX_NEW_TOKENS {
        return Err(ModelError::config("tokens", s.tokens, format!("at most {MAX_NEW_TOKENS}")));
    }
    let context = context.max(1);
    let device = model.device().clone();
    let mut rng = SplitMix64::new(s.seed);
    let mut all = prompt.to_vec();
    for _ in 0..s.tokens {
        let window = &all[all.len().saturating_sub(context)..];
        let t = window.len();
        let x = Tensor::from_vec(window.to_vec(), (1, t), &device)?;
        let y = Tensor::zeros((1, t), DType::U32, &device)?;
        let out = model.forward(&x, &y, None)?;
        let last: Vec<f32> = out.logits.get(t - 1)?.to_dtype(DType::F32)?.to_vec1()?;
        all.push(draw(&last, s, &mut rng) as u32);
    }
    Ok(all.split_off(prompt.len()))
}

/// One token from `logits` as `s` says.
fn draw(logits: &[f32], s: &Sampling, rng: &mut SplitMix64) -> usize {
    let best = |a: &(usize, f32), b: &(usize, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let mut ranked: Vec<(usize, f32)> = logits.iter().copied().enumerate().collect();
    ranked.sort_by(best);
    if s.temperature == 0.0 {
        return ranked[0].0;
    }
    if s.top_k > 0 {
        ranked.truncate(s.top_k);
    }
    let top = ranked[0].1 as f64;
    let weights: Vec<f64> = ranked.iter().map(|&(_, l)| ((l as f64 - top) / s.temperature).exp()).collect();
    let mut at = rng.uniform() * weights.iter().sum::<f64>();
    for (&(token, _), w) in ranked.iter().zip(&weights) {
        if at < *w {
            return token;
        }
        at -= w;
    }
    ranked[ranked.len() - 1].0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_follow_temperature_top_k_and_the_seed() {
        let logits = [0.0f32, 3.0, 1.0, 2.9];
        let greedy = Sampling { tokens: 1, temperature: 0.0, top_k: 0, seed: 1 };
        assert_eq!(draw(&logits, &greedy, &mut SplitMix64::new(1)), 1);
        // Top-2 at any temperature: only tokens 1 and 3, both seen.
        let hot = Sampling { temperature: 5.0, top_k: 2, ..greedy };
        let mut rng = SplitMix64::new(7);
        let drawn: Vec<usize> = (0..200).map(|_| draw(&logits, &hot, &mut rng)).collect();
        assert!(drawn.iter().all(|&t| t == 1 || t == 3) && drawn.contains(&1) && drawn.contains(&3));
        // The same seed, the same draws.
        let again: Vec<usize> = {
            let mut rng = SplitMix64::new(7);
            (0..200).map(|_| draw(&logits, &hot, &mut rng)).collect()
        };
        assert_eq!(drawn, again);
        // A cold temperature is nearly greedy.
        let cold = Sampling { temperature: 0.01, top_k: 0, ..greedy };
        let mut rng = SplitMix64::new(3);
        assert!((0..100).all(|_| draw(&logits, &cold, &mut rng) == 1));
    }
}
