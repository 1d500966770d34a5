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
    /// The largest shard of weights (5GB, 500MB, 2GiB or bytes): a model past it is written as
    /// model-00001-of-0000N.safetensors… with model.safetensors.index.json, as transformers does.
    #[arg(long, default_value = "5GB", value_name = "SIZE")]
    max_shard_size: String,
    /// The directory written (created; must not hold a config.json, model.safetensors or index).
    #[arg(value_name = "OUT")]
    out: PathBuf,
}

pub fn run_export(args: &ExportArgs) -> Result<()> {
    if args.format != "hf" {
        bail!("invalid --format: '{}' (expected hf)", args.format);
    }
    let max_shard = parse_size(&args.max_shard_size)
        .with_context(|| format!("invalid --max-shard-size: '{}' (expected a size such as 5GB, 500MB or 2GiB)", args.max_shard_size))?;
    let (model, config, step) = lazarus_model::trainer::load_model(&args.checkpoint, &candle_core::Device::Cpu)
        .with_context(|| format!("--checkpoint {}", args.checkpoint.display()))?;
    let shards =
        lazarus_model::hf::export_sharded(&model, &args.out, max_shard).with_context(|| format!("export to {}", args.out.display()))?;
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
        "{} (step {step}): {:.2}M parameters written to {} as a Hugging Face {} model (config.json, {}{note})",
        args.checkpoint.display(),
        model.params().num_elements() as f64 / 1e6,
        args.out.display(),
        lazarus_model::hf::Family::of(model.config()).name(),
        match shards {
            1 => lazarus_model::hf::WEIGHTS_FILE.to_string(),
            n => format!("{n} shards, {}", lazarus_model::hf::INDEX_FILE),
        }
    ))
}

/// A size as transformers' `max_shard_size` takes it: bytes, or a number with KB, MB, GB (powers
/// of 1000) or KiB, MiB, GiB (of 1024); at least 1 byte.
fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let unit_bytes: f64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KIB" => 1024.0,
        "MIB" => 1024.0 * 1024.0,
        "GIB" => 1024.0 * 1024.0 * 1024.0,
        other => bail!("unknown unit '{other}'"),
    };
    let n: f64 = number.parse().with_context(|| format!("'{number}' is not a number"))?;
    let bytes = n * unit_bytes;
    if !(1.0..=1e15).contains(&bytes) {
        bail!("{bytes} bytes is out of range (1 byte to 1 PB)");
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_read_as_transformers_writes_them() {
        assert_eq!(super::parse_size("5GB").unwrap(), 5_000_000_000);
        assert_eq!(super::parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(super::parse_size("500 MB").unwrap(), 500_000_000);
        assert_eq!(super::parse_size("4096").unwrap(), 4096);
        for bad in ["", "0", "5XB", "GB", "-1GB", "1e400"] {
            assert!(super::parse_size(bad).is_err(), "{bad}");
        }
    }
}
