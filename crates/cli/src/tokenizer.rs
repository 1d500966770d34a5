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
    /// Format of --data files: text, or jsonl ({"text": …} a line: the documents' texts are
    /// learned from, not the JSON around them). Default: jsonl for .jsonl files, else text.
    #[arg(long, value_name = "text|jsonl")]
    data_format: Option<String>,
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
    // Texts written out for the learner (the synthetic corpus, JSON lines' documents), removed
    // at the end whatever happens.
    let mut scratch = Scratch(Vec::new());
    let files: Vec<PathBuf> = if args.data == "synthetic" {
        if args.data_format.as_deref().is_some_and(|f| f != "text") {
            bail!("invalid --data-format: '{}' (the synthetic corpus is text)", args.data_format.as_deref().unwrap_or_default());
        }
        if args.synthetic_bytes == 0 || args.synthetic_bytes > lazarus_model::data::MAX_SYNTHETIC_BYTES {
            bail!("invalid --synthetic-bytes: {} (1 to {})", args.synthetic_bytes, lazarus_model::data::MAX_SYNTHETIC_BYTES);
        }
        vec![scratch.write(&args.out, lazarus_model::data::synthetic_corpus(0, args.synthetic_bytes))?]
    } else {
        let files: Vec<PathBuf> = args.data.split(',').map(PathBuf::from).collect();
        if let Some(i) = files.iter().position(|p| p.as_os_str().is_empty()) {
            bail!("invalid --data: '{}' (file {} of {} has an empty name)", args.data, i + 1, files.len());
        }
        let mut texts = Vec::new();
        for f in files {
            texts.push(match file_format(args.data_format.as_deref(), &f)? {
                Format::Text => {
                    // Bounded and UTF-8, as training reads it.
                    let text = crate::io::read_text("data", &f, lazarus_model::data::MAX_DATA_BYTES)?;
                    if looks_like_json_lines(&text) {
                        tracing::warn!(
                            "--data {}: its lines look like JSON documents; read as text, the tokenizer learns their quotes and \
                             escapes (--data-format jsonl learns from their texts)",
                            f.display()
                        );
                    }
                    f
                }
                Format::JsonLines => scratch.write(&args.out, lazarus_model::data::json_lines_text(&f)?)?,
            });
        }
        texts
    };
    let refs: Vec<&std::path::Path> = files.iter().map(PathBuf::as_path).collect();
    let vocab = lazarus_model::tokenizer::train_bpe(&refs, args.vocab_size, &args.out)?;
    crate::io::println(&format!("{}: a byte-level BPE tokenizer of {vocab} tokens", args.out.display()))
}

enum Format {
    Text,
    JsonLines,
}

/// The format of `--data` file `f`: `--data-format`'s, else jsonl for a `.jsonl` name, else text.
fn file_format(said: Option<&str>, f: &std::path::Path) -> Result<Format> {
    Ok(match said {
        Some("text") => Format::Text,
        Some("jsonl") => Format::JsonLines,
        Some(other) => bail!("invalid --data-format: '{other}' (expected text or jsonl: token shards are tokens already)"),
        None if f.extension().is_some_and(|e| e == "jsonl") => Format::JsonLines,
        None => Format::Text,
    })
}

/// Whether the first non-blank line of `text` is a JSON object with a `"text"` string.
fn looks_like_json_lines(text: &str) -> bool {
    let Some(first) = text.lines().find(|l| !l.trim().is_empty()) else { return false };
    serde_json::from_str::<serde_json::Value>(first).is_ok_and(|v| v.get("text").is_some_and(|t| t.is_string()))
}

/// Files written beside `--out` for the learner to read, removed when dropped.
struct Scratch(Vec<PathBuf>);

impl Scratch {
    fn write(&mut self, out: &std::path::Path, text: String) -> Result<PathBuf> {
        let path = out.with_extension(format!("corpus-{}.tmp", self.0.len()));
        self.0.push(path.clone());
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}
