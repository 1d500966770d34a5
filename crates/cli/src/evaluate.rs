//! `lazarus eval --checkpoint DIR --data FILE [--windows N] [--json]`: the mean next-token loss
//! (and perplexity) of a checkpoint over held-out data, in windows of the run's sequence length
//! taken in order from the start — window i is tokens [i·T, (i+1)·T] — so that the same number
//! can be computed elsewhere from the same tokens ([`lazarus_model::eval`]).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// A run's checkpoint directory (its latest checkpoint, or the newest intact one), or one
    /// checkpoint's own directory.
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// The held-out data: a text file, JSON lines, comma-separated token shards, Megatron
    /// dataset prefixes, Parquet or Arrow files, in --data-format.
    #[arg(long, value_name = "FILE")]
    data: String,
    /// Format of --data: text, jsonl, u16, u32, megatron, parquet or arrow (default: parquet
    /// or arrow for .parquet or .arrow files, else text).
    #[arg(long)]
    data_format: Option<String>,
    /// The Parquet or Arrow column to evaluate on (default: the first of text, input_ids,
    /// tokens).
    #[arg(long, value_name = "NAME")]
    data_column: Option<String>,
    /// Windows evaluated, from the start (default: every whole window the data holds, at most
    /// 1048576).
    #[arg(long, value_name = "N")]
    windows: Option<usize>,
    /// Tokens a window (default: the run's sequence length; 128 for a Hugging Face directory,
    /// or its max_position_embeddings if shorter).
    #[arg(long, value_name = "T")]
    seq_len: Option<usize>,
    /// Windows a forward pass (default: the run's batch size).
    #[arg(long, value_name = "N")]
    batch_size: Option<usize>,
    /// Where the model runs: cpu (default), or cuda / cuda:N.
    #[arg(long, value_name = "cpu|cuda[:N]")]
    device: Option<String>,
    #[arg(long)]
    json: bool,
}

pub fn run_eval(args: &EvalArgs) -> Result<()> {
    if let Some(w) = args.windows.filter(|&w| w == 0 || w > lazarus_model::eval::MAX_EVAL_WINDOWS) {
        bail!("invalid --windows: {w} (1 to {})", lazarus_model::eval::MAX_EVAL_WINDOWS);
    }
    if let Some(b) = args.batch_size.filter(|&b| b == 0 || b > 65_536) {
        bail!("invalid --batch-size: {b} (1 to 65536 windows a pass)");
    }
    let device = lazarus_model::device::parse(args.device.as_deref().unwrap_or("cpu"))?;
    let (model, config, step) = lazarus_model::trainer::load_model(&args.checkpoint, &device)
        .with_context(|| format!("--checkpoint {}", args.checkpoint.display()))?;
    let source = crate::train::args::data_file("data", &args.data, args.data_format.as_deref(), args.data_column.as_deref())?;
    let tokenizer = lazarus_model::tokenizer::TextTokenizer::open(config.tokenizer.as_deref()).context("the run's tokenizer")?;
    let tokens = source.load_with(config.model.vocab_size, &tokenizer).context("--data")?;
    let batch = args.batch_size.unwrap_or(config.batch_size);
    let seq_len = args.seq_len.unwrap_or(config.seq_len);
    if seq_len == 0 || seq_len > config.model.max_seq_len {
        bail!("invalid --seq-len: {seq_len} (1 to the model's max_seq_len, {})", config.model.max_seq_len);
    }
    let e = lazarus_model::eval::evaluate(&model, &tokens, seq_len, args.windows, batch)?;
    if args.json {
        let v = serde_json::json!({
            "checkpoint": args.checkpoint, "step": step, "seq_len": seq_len, "windows": e.windows,
            "tokens": e.tokens, "loss": e.loss, "perplexity": e.perplexity,
        });
        return crate::io::println(&v.to_string());
    }
    crate::io::println(&format!(
        "{} (step {step}): loss {:.4}, perplexity {:.2} over {} windows of {} tokens ({} tokens of {})",
        args.checkpoint.display(),
        e.loss,
        e.perplexity,
        e.windows,
        seq_len,
        e.tokens,
        source.describe()
    ))
}
