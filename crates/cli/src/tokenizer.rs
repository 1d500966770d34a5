//! `lazarus tokenizer --data FILE --vocab-size N --out tokenizer.json`: a byte-level BPE
//! tokenizer learned from text, in the Hugging Face format (`train --tokenizer` takes it, and so
//! do `transformers` and `tokenizers`).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct TokenizerArgs {
    /// Text to learn from: UTF-8 files, comma-separated, or `synthetic` (the built-in corpus,
    /// --synthetic-bytes of it).
    #[arg(long, value_name = "FILE[,FILE…]|synthetic")]
    data: String,
    /// Size of the built-in corpus to learn from, with --data synthetic.
    #[arg(long, default_value_t = 2_000_000)]
    synthetic_bytes: usize,
    /// Tokens in the vocabulary: the 256 bytes and the merges learned (257 to 1048576).
    #[arg(long, default_value_t = 4096)]
    vocab_size: usize,
    /// Where to write the tokenizer.json.
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
}

pub fn run_tokenizer(args: &TokenizerArgs) -> Result<()> {
    if args.out.exists() {
        bail!("--out {} exists: a tokenizer is not written over", args.out.display());
    }
    let scratch;
    let files: Vec<PathBuf> = if args.data == "synthetic" {
        if args.synthetic_bytes == 0 || args.synthetic_bytes > lazarus_model::data::MAX_SYNTHETIC_BYTES {
            bail!("invalid --synthetic-bytes: {} (1 to {})", args.synthetic_bytes, lazarus_model::data::MAX_SYNTHETIC_BYTES);
        }
        scratch = args.out.with_extension("corpus.tmp");
        std::fs::write(&scratch, lazarus_model::data::synthetic_corpus(0, args.synthetic_bytes))
            .with_context(|| format!("writing {}", scratch.display()))?;
        vec![scratch.clone()]
    } else {
        let files: Vec<PathBuf> = args.data.split(',').map(PathBuf::from).collect();
        if let Some(i) = files.iter().position(|p| p.as_os_str().is_empty()) {
            bail!("invalid --data: '{}' (file {} of {} has an empty name)", args.data, i + 1, files.len());
        }
        for f in &files {
            // Bounded and UTF-8, as training reads it.
            crate::io::read_text("data", f, lazarus_model::data::MAX_DATA_BYTES)?;
        }
        files
    };
    let refs: Vec<&std::path::Path> = files.iter().map(PathBuf::as_path).collect();
    let made = lazarus_model::tokenizer::train_bpe(&refs, args.vocab_size, &args.out);
    if args.data == "synthetic" {
        let _ = std::fs::remove_file(&files[0]);
    }
    let vocab = made?;
    crate::io::println(&format!("{}: a byte-level BPE tokenizer of {vocab} tokens", args.out.display()))
}
