//! `lazarus generate --checkpoint DIR --prompt TEXT`: text sampled from a checkpoint's model
//! ([`lazarus_model::generate`]), tokenized as the model's text data is (its run's tokenizer, or
//! bytes).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use lazarus_model::generate::{generate, Sampling, MAX_NEW_TOKENS};
use lazarus_model::tokenizer::TextTokenizer;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// A run's checkpoint directory (its latest), or one checkpoint's own directory.
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// The text to go on from.
    #[arg(long)]
    prompt: String,
    /// New tokens (bytes) to draw.
    #[arg(long, default_value_t = Sampling::default().tokens)]
    tokens: usize,
    /// 0: the most likely token every time; higher: more varied.
    #[arg(long, default_value_t = Sampling::default().temperature, allow_hyphen_values = true)]
    temperature: f64,
    /// Draw among this many most likely tokens (0: all).
    #[arg(long, default_value_t = Sampling::default().top_k)]
    top_k: usize,
    #[arg(long, default_value_t = Sampling::default().seed)]
    seed: u64,
    /// Where the model runs: cpu (default), or cuda / cuda:N.
    #[arg(long, value_name = "cpu|cuda[:N]")]
    device: Option<String>,
}

pub fn run_generate(args: &GenerateArgs) -> Result<()> {
    if args.prompt.is_empty() {
        bail!("invalid --prompt: '' (the text to go on from)");
    }
    if args.tokens == 0 || args.tokens > MAX_NEW_TOKENS {
        bail!("invalid --tokens: {} (1 to {MAX_NEW_TOKENS})", args.tokens);
    }
    if !args.temperature.is_finite() || args.temperature < 0.0 || args.temperature > 100.0 {
        bail!("invalid --temperature: {} (0 to 100)", args.temperature);
    }
    let device = lazarus_model::device::parse(args.device.as_deref().unwrap_or("cpu"))?;
    let (model, config, _) = lazarus_model::trainer::load_model(&args.checkpoint, &device)
        .with_context(|| format!("--checkpoint {}", args.checkpoint.display()))?;
    let tokenizer = TextTokenizer::open(config.tokenizer.as_deref()).context("the run's tokenizer")?;
    let prompt = tokenizer.encode(&args.prompt)?;
    if let Some(t) = prompt.iter().find(|&&t| t as usize >= config.model.vocab_size) {
        bail!("invalid --prompt: its token {t} is outside the model's vocabulary of {}", config.model.vocab_size);
    }
    let s = Sampling { tokens: args.tokens, temperature: args.temperature, top_k: args.top_k, seed: args.seed };
    let drawn = generate(&model, &prompt, config.seq_len, &s)?;
    crate::io::println(&format!("{}{}", args.prompt, tokenizer.decode(&drawn)?))
}
