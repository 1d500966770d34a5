//! `lazarus export --checkpoint DIR --format hf OUT`: a checkpoint's model as a Hugging Face
//! directory (`config.json` + `model.safetensors` with transformers' `MixtralForCausalLM` or
//! `Qwen3MoeForCausalLM` names), for a model whose options are one of those families'
//! ([`lazarus_model::hf::Family`]); a model that is not is refused,
//! naming the first option that differs. The run's tokenizer, if it had one, is copied beside
//! them.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// A run's checkpoint directory (its latest checkpoint, or the newest intact one), or one
    /// checkpoint's own directory.
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// The format written: hf (Hugging Face transformers: Mixtral, or Qwen3-MoE for a model with
    /// query and key norms).
    #[arg(long, default_value = "hf", value_name = "hf")]
    format: String,
    /// The directory written (created; must not hold a config.json or model.safetensors).
    #[arg(value_name = "OUT")]
    out: PathBuf,
}

pub fn run_export(args: &ExportArgs) -> Result<()> {
    if args.format != "hf" {
        bail!("invalid --format: '{}' (expected hf)", args.format);
    }
    let (model, config, step) = lazarus_model::trainer::load_model(&args.checkpoint, &candle_core::Device::Cpu)
        .with_context(|| format!("--checkpoint {}", args.checkpoint.display()))?;
    lazarus_model::hf::export(&model, &args.out).with_context(|| format!("export to {}", args.out.display()))?;
    let mut note = String::new();
    if let Some(tok) = &config.tokenizer {
        let to = args.out.join("tokenizer.json");
        if !to.exists() {
            // Bounded, regular, and written whole or not at all.
            let bytes = crate::io::read_text("tokenizer", tok, lazarus_model::tokenizer::MAX_TOKENIZER_BYTES)?;
            lazarus_model::hf::write_new(&to, bytes.as_bytes()).with_context(|| format!("copy the run's tokenizer {}", tok.display()))?;
            note = ", tokenizer.json".into();
        }
    }
    crate::io::println(&format!(
        "{} (step {step}): {:.2}M parameters written to {} as a Hugging Face {} model (config.json, model.safetensors{note})",
        args.checkpoint.display(),
        model.params().num_elements() as f64 / 1e6,
        args.out.display(),
        lazarus_model::hf::Family::of(model.config()).name()
    ))
}
