//! Training data: text files, JSON lines, token shards, Megatron indexed datasets (streamed),
//! Parquet and Arrow files of Hugging Face datasets (through a token cache, streamed), a built-in
//! synthetic corpus, and a deterministic sampler whose cursor resumes exactly.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::files::read_bounded;
use crate::rng::SplitMix64;

pub mod indexed;
pub mod sampler;
pub mod table;

pub use crate::tokenizer::ByteTokenizer;
pub use indexed::{IndexedFile, TokenType};
pub use sampler::{Batch, Cursor, Sampler, TokenStream, ENTROPY_SAMPLE_TOKENS};
pub use table::{TableFiles, TableFormat};

/// Where training tokens come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum DataSource {
    /// The built-in corpus: `bytes` bytes from `seed`.
    Synthetic { seed: u64, bytes: usize },
    /// A UTF-8 text file, byte-tokenized.
    Text { path: PathBuf },
    /// Token shards: little-endian u16 or u32 `.bin` files, concatenated.
    Shards { paths: Vec<PathBuf>, width: TokenWidth },
    /// JSON lines, one document a line (`{"text": "…"}`; other fields are ignored), the
    /// documents' texts byte-tokenized, each followed by a blank line (`\n\n`) so that a window
    /// that spans two of them sees where one ends.
    JsonLines { path: PathBuf },
    /// Megatron indexed datasets (`PREFIX.bin` + `PREFIX.idx`): tokens already, read a window
    /// at a time ([`indexed`]); one after another, or with `weights` (one a prefix) a blend
    /// drawing each window from one of them by weight ([`Sampler::blend`]).
    Megatron {
        prefixes: Vec<PathBuf>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        weights: Option<Vec<f64>>,
    },
    /// Parquet files of a Hugging Face dataset ([`table::parquet`]).
    Parquet(TableFiles),
    /// Arrow IPC files of a Hugging Face dataset ([`table::arrow`]): `datasets`' cache files
    /// and what `save_to_disk` writes.
    Arrow(TableFiles),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenWidth {
    U16,
    U32,
}

impl DataSource {
    /// The training tokens: a Megatron dataset opened and its index checked (read later, a
    /// window at a time), anything else loaded ([`DataSource::load_with`]).
    pub fn open(&self, vocab: usize, tokenizer: &crate::tokenizer::TextTokenizer) -> Result<TokenStream> {
        match self {
            DataSource::Megatron { prefixes, .. } => Ok(TokenStream::indexed(self.open_indexed(prefixes, tokenizer)?, vocab)),
            DataSource::Parquet(t) | DataSource::Arrow(t) => Ok(TokenStream::indexed(vec![self.table_tokens(tokenizer, &t.paths)?], vocab)),
            _ => Ok(TokenStream::Memory(self.load_with(vocab, tokenizer)?)),
        }
    }

    /// A dataset's files (Parquet or Arrow) and their format; None for the other sources.
    pub fn table(&self) -> Option<(TableFormat, &TableFiles)> {
        match self {
            DataSource::Parquet(t) => Some((TableFormat::Parquet, t)),
            DataSource::Arrow(t) => Some((TableFormat::Arrow, t)),
            _ => None,
        }
    }

    /// The token cache of a dataset's files `paths` (all of them, or one of a blend), made first
    /// if it is not there (and said so).
    fn table_tokens(&self, tokenizer: &crate::tokenizer::TextTokenizer, paths: &[PathBuf]) -> Result<IndexedFile> {
        let Some((format, t)) = self.table() else {
            return Err(ModelError::config("data.kind", self.describe(), "not a Parquet or Arrow source"));
        };
        let paths = self.named(paths, (&format!("{} files", format.name()), "file"))?;
        let dir = t.cache.clone().unwrap_or_else(table::default_cache_dir);
        let (prefix, made) = table::token_cache(format, paths, t.column.as_deref(), tokenizer, &dir)?;
        let file = IndexedFile::open(&prefix)?;
        match made {
            Some(r) => tracing::info!(
                "{}: {} read into {} tokens{}, cached at {}",
                self.describe(),
                r.describe(format),
                r.tokens,
                if r.null_rows > 0 { format!(" ({} null rows skipped)", r.null_rows) } else { String::new() },
                prefix.display()
            ),
            None => tracing::info!("{}: {} tokens from the cache at {}", self.describe(), file.tokens(), prefix.display()),
        }
        Ok(file)
    }

    /// The streams a sampler draws from, with their weights: a weighted Megatron source's
    /// datasets each on its own, anything else one stream ([`DataSource::open`]).
    pub fn open_parts(&self, vocab: usize, tokenizer: &crate::tokenizer::TextTokenizer) -> Result<Vec<(TokenStream, f64)>> {
        let (prefixes, weights) = match self {
            DataSource::Megatron { prefixes, weights: Some(weights) } => (prefixes, weights),
            DataSource::Parquet(TableFiles { paths, weights: Some(weights), .. })
            | DataSource::Arrow(TableFiles { paths, weights: Some(weights), .. }) => (paths, weights),
            _ => return Ok(vec![(self.open(vocab, tokenizer)?, 1.0)]),
        };
        if weights.len() != prefixes.len() {
            return Err(ModelError::config(
                "data.weights",
                format!("{weights:?}"),
                format!("one weight a dataset: {} weights for {} datasets", weights.len(), prefixes.len()),
            ));
        }
        if let Some(w) = weights.iter().find(|w| !w.is_finite() || **w <= 0.0) {
            return Err(ModelError::config("data.weights", w, "weights must be finite and > 0"));
        }
        let files = match self {
            // Each Parquet or Arrow file a dataset of its own: a token cache each.
            DataSource::Parquet(_) | DataSource::Arrow(_) => {
                prefixes.iter().map(|p| self.table_tokens(tokenizer, std::slice::from_ref(p))).collect::<Result<_>>()?
            }
            _ => self.open_indexed(prefixes, tokenizer)?,
        };
        Ok(files.into_iter().zip(weights).map(|(f, &w)| (TokenStream::indexed(vec![f], vocab), w)).collect())
    }

    /// Each Megatron dataset of `prefixes`, opened and its index checked.
    fn open_indexed(&self, prefixes: &[PathBuf], tokenizer: &crate::tokenizer::TextTokenizer) -> Result<Vec<IndexedFile>> {
        self.refuse_a_tokenizer(tokenizer)?;
        self.named(prefixes, ("Megatron datasets", "dataset"))?.iter().map(|p| IndexedFile::open(p)).collect()
    }

    /// Whether the source holds token ids already (no tokenizer applies). A Parquet or Arrow
    /// source's first file is opened to see what its column holds (false when it cannot be
    /// read: the error comes when the data is opened).
    pub fn is_tokens(&self) -> bool {
        if let Some((format, t)) = self.table() {
            let kind = t.paths.first().and_then(|p| format.column(p, t.column.as_deref()).ok()).map(|(_, kind)| kind);
            return kind == Some(table::ColumnKind::TokenIds);
        }
        matches!(self, DataSource::Shards { .. } | DataSource::Megatron { .. })
    }

    fn refuse_a_tokenizer(&self, tokenizer: &crate::tokenizer::TextTokenizer) -> Result<()> {
        if matches!(tokenizer, crate::tokenizer::TextTokenizer::Hf(_)) {
            return Err(ModelError::Data {
                path: self.describe().into(),
                reason: format!(
                    "{} are tokens already: they take no tokenizer",
                    if matches!(self, DataSource::Megatron { .. }) { "Megatron datasets" } else { "token shards" }
                ),
            });
        }
        Ok(())
    }

    /// `paths`, refused when there are none or one has an empty name (`(what, one)`: what the
    /// files are, and one of them).
    fn named<'a>(&self, paths: &'a [PathBuf], (what, one): (&str, &str)) -> Result<&'a [PathBuf]> {
        if paths.is_empty() {
            return Err(ModelError::Data { path: PathBuf::new(), reason: format!("no {what} named") });
        }
        if let Some(i) = paths.iter().position(|p| p.as_os_str().is_empty()) {
            return Err(ModelError::Data {
                path: self.describe().into(),
                reason: format!("{one} {} of {} has an empty name", i + 1, paths.len()),
            });
        }
        Ok(paths)
    }

    /// Load all tokens, byte-tokenizing text, checking each is below `vocab`.
    pub fn load(&self, vocab: usize) -> Result<Vec<u32>> {
        self.load_with(vocab, &crate::tokenizer::TextTokenizer::Bytes)
    }

    /// Load all tokens, text through `tokenizer`, checking each is below `vocab`.
    pub fn load_with(&self, vocab: usize, tokenizer: &crate::tokenizer::TextTokenizer) -> Result<Vec<u32>> {
        let tokens = match self {
            DataSource::Synthetic { seed, bytes } => {
                if *bytes > MAX_SYNTHETIC_BYTES {
                    return Err(ModelError::config(
                        "data.bytes",
                        bytes,
                        format!("the synthetic corpus holds at most {MAX_SYNTHETIC_BYTES} bytes"),
                    ));
                }
                tokenizer.encode(&synthetic_corpus(*seed, *bytes))?
            }
            DataSource::Text { path } => {
                let bytes = read_bounded(path, MAX_DATA_BYTES)?;
                let text = String::from_utf8(bytes).map_err(|e| ModelError::Data {
                    path: path.clone(),
                    reason: format!("not valid UTF-8 at byte {}", e.utf8_error().valid_up_to()),
                })?;
                tokenizer.encode(&text)?
            }
            DataSource::JsonLines { path } => tokenizer.encode(&json_lines_text(path)?)?,
            DataSource::Shards { paths, width } => {
                self.refuse_a_tokenizer(tokenizer)?;
                let mut all = Vec::new();
                for p in self.named(paths, ("token shards", "shard"))? {
                    all.extend(read_shard(p, *width)?);
                }
                all
            }
            // Held-out data is read whole (windows in order, a few of them): bounded as a shard.
            DataSource::Megatron { prefixes, .. } => read_whole(&self.open_indexed(prefixes, tokenizer)?, vocab)?,
            // (A blend's files one after another, in one cache.)
            DataSource::Parquet(t) | DataSource::Arrow(t) => read_whole(&[self.table_tokens(tokenizer, &t.paths)?], vocab)?,
        };
        if let Some((i, &t)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            return Err(ModelError::Data {
                path: self.describe().into(),
                reason: format!("token {t} at position {i} is outside the vocabulary of {vocab}"),
            });
        }
        Ok(tokens)
    }

    pub fn describe(&self) -> String {
        match self {
            DataSource::Synthetic { seed, bytes } => format!("synthetic corpus (seed {seed}, {bytes} bytes)"),
            DataSource::Text { path } => path.display().to_string(),
            DataSource::JsonLines { path } => format!("{} (JSON lines)", path.display()),
            DataSource::Shards { paths, .. } => {
                format!("{} token shard(s), first {}", paths.len(), paths.first().map_or("-".into(), |p| p.display().to_string()))
            }
            DataSource::Parquet(t) | DataSource::Arrow(t) => format!(
                "{} {} file(s){}{}, first {}",
                t.paths.len(),
                if matches!(self, DataSource::Parquet(_)) { "Parquet" } else { "Arrow" },
                t.column.as_ref().map_or(String::new(), |c| format!(" (column `{c}`)")),
                if t.weights.is_some() { " blended by weight" } else { "" },
                t.paths.first().map_or("-".into(), |p| p.display().to_string())
            ),
            DataSource::Megatron { prefixes, weights } => format!(
                "{} Megatron dataset(s){}, first {}",
                prefixes.len(),
                if weights.is_some() { " blended by weight" } else { "" },
                prefixes.first().map_or("-".into(), |p| p.display().to_string())
            ),
        }
    }
}

/// Every token of indexed datasets `files`, one after another, each below `vocab` — held-out
/// data (windows in order, a few of them), bounded as a shard.
fn read_whole(files: &[IndexedFile], vocab: usize) -> Result<Vec<u32>> {
    let mut all = Vec::new();
    for f in files {
        if f.tokens().saturating_mul(4) > MAX_DATA_BYTES {
            return Err(ModelError::Data {
                path: f.bin_path().to_path_buf(),
                reason: format!("{} tokens are more than is read whole ({MAX_DATA_BYTES} bytes)", f.tokens()),
            });
        }
        let start = all.len();
        all.resize(start + f.tokens() as usize, 0);
        f.read(0, &mut all[start..], vocab)?;
    }
    Ok(all)
}

/// The texts of a JSON-lines file's documents, each followed by a blank line. A line that is
/// not a JSON object with a `text` string is an error naming the line (blank lines are skipped).
pub fn json_lines_text(path: &Path) -> Result<String> {
    let bytes = read_bounded(path, MAX_DATA_BYTES)?;
    let text = String::from_utf8(bytes).map_err(|e| ModelError::Data {
        path: path.to_path_buf(),
        reason: format!("not valid UTF-8 at byte {}", e.utf8_error().valid_up_to()),
    })?;
    let mut out = String::with_capacity(text.len());
    let mut documents = 0usize;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |why: String| ModelError::Data { path: path.to_path_buf(), reason: format!("line {}: {why}", i + 1) };
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(format!("not JSON ({e})")))?;
        let Some(doc) = v.get("text").and_then(|t| t.as_str()) else {
            return Err(bad("no \"text\" string (expected {\"text\": \"…\"} a line)".into()));
        };
        out.push_str(doc);
        out.push_str("\n\n");
        documents += 1;
    }
    if documents == 0 {
        return Err(ModelError::Data { path: path.to_path_buf(), reason: "no documents (expected {\"text\": \"…\"} a line)".into() });
    }
    Ok(out)
}

/// Largest synthetic corpus (bytes; 4 bytes of tokens each in memory).
pub const MAX_SYNTHETIC_BYTES: usize = 1 << 30;
/// Largest data file read (text or one token shard).
pub const MAX_DATA_BYTES: u64 = 16 << 30;

fn read_shard(path: &Path, width: TokenWidth) -> Result<Vec<u32>> {
    let bytes = read_bounded(path, MAX_DATA_BYTES)?;
    let w = match width {
        TokenWidth::U16 => 2,
        TokenWidth::U32 => 4,
    };
    if bytes.len() % w != 0 {
        return Err(ModelError::Data {
            path: path.to_path_buf(),
            reason: format!("{} bytes is not a multiple of the {w}-byte token width", bytes.len()),
        });
    }
    Ok(match width {
        TokenWidth::U16 => bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32).collect(),
        TokenWidth::U32 => bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
    })
}

/// Shannon entropy (nats per token) of the token frequencies: the loss of a model that knows
/// only how often each token occurs.
pub fn unigram_entropy(tokens: &[u32]) -> f64 {
    let mut counts = std::collections::HashMap::<u32, u64>::new();
    tokens.iter().for_each(|&t| *counts.entry(t).or_default() += 1);
    let n = tokens.len() as f64;
    counts.values().map(|&c| c as f64 / n).map(|p| -p * p.ln()).sum()
}

/// The built-in corpus: documents from five distinct "domains" with different byte statistics
/// and uneven frequencies (35/25/15/15/10%), so that experts specialise and their loads are
/// skewed — the situation Lazarus is built for.
pub fn synthetic_corpus(seed: u64, bytes: usize) -> String {
    const WORDS: [&str; 24] = [
        "the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "tree", "quickly", "slowly", "big", "small", "red", "blue", "and",
        "while", "house", "river", "saw", "found", "old", "new",
    ];
    const KEYS: [&str; 8] = ["port", "host", "name", "retries", "timeout", "mode", "level", "path"];
    const MOTIFS: [&str; 4] = ["GATTACA", "CCGGTT", "TATAAT", "ACGTACGT"];
    let mut rng = SplitMix64::new(seed ^ 0x00c0_ffee);
    let mut out = String::with_capacity(bytes + 64);
    while out.len() < bytes {
        let r = rng.uniform();
        if r < 0.35 {
            // Arithmetic facts, always correct: the model can learn to add.
            for _ in 0..4 {
                let a = rng.below(100);
                let b = rng.below(100);
                out.push_str(&format!("{a}+{b}={};", a + b));
            }
        } else if r < 0.60 {
            // Simple English-like sentences.
            let n = 6 + rng.below(8);
            let words: Vec<&str> = (0..n).map(|_| WORDS[rng.below(WORDS.len())]).collect();
            out.push_str(&words.join(" "));
            out.push('.');
        } else if r < 0.75 {
            // DNA with recurring motifs.
            for _ in 0..6 {
                if rng.below(3) == 0 {
                    out.push_str(MOTIFS[rng.below(MOTIFS.len())]);
                } else {
                    out.push(['A', 'C', 'G', 'T'][rng.below(4)]);
                }
            }
        } else if r < 0.90 {
            // Configuration lines.
            let key = KEYS[rng.below(KEYS.len())];
            match rng.below(3) {
                0 => out.push_str(&format!("{key} = {}", rng.below(65536))),
                1 => out.push_str(&format!("{key} = \"{}\"", WORDS[rng.below(WORDS.len())])),
                _ => out.push_str(&format!("{key} = {}", rng.below(2) == 0)),
            }
        } else {
            // Hex dumps.
            let n = 4 + rng.below(8);
            let words: Vec<String> = (0..n).map(|_| format!("0x{:02x}", rng.below(256))).collect();
            out.push_str(&words.join(" "));
        }
        out.push('\n');
    }
    out.truncate(bytes);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_corpus_is_deterministic_and_mixed() {
        let a = synthetic_corpus(1, 20_000);
        assert_eq!(a, synthetic_corpus(1, 20_000));
        assert_ne!(a, synthetic_corpus(2, 20_000));
        assert_eq!(a.len(), 20_000);
        for needle in ["+", "=", "the", "GAT", " = ", "0x"] {
            assert!(a.contains(needle), "{needle}");
        }
        let h = unigram_entropy(&ByteTokenizer::encode(&a));
        assert!(h > 2.0 && h < 5.0, "{h}");
    }

    #[test]
    fn json_lines_give_each_documents_text_then_a_blank_line_and_name_a_bad_line() {
        let dir = std::env::temp_dir().join(format!("lazarus-jsonl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.jsonl");
        std::fs::write(&good, "{\"text\": \"ab\", \"id\": 1}\n\n{\"text\": \"c\\u00e9\"}\n").unwrap();
        let tokens = DataSource::JsonLines { path: good }.load(256).unwrap();
        assert_eq!(ByteTokenizer::decode(&tokens), "ab\n\ncé\n\n");
        for (text, why) in
            [("{\"text\": 1}\n", "line 1: no \"text\" string"), ("{\"text\": \"a\"}\nnope\n", "line 2: not JSON"), ("\n\n", "no documents")]
        {
            let bad = dir.join("bad.jsonl");
            std::fs::write(&bad, text).unwrap();
            let e = DataSource::JsonLines { path: bad }.load(256).unwrap_err().to_string();
            assert!(e.contains(why), "{text:?}: {e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_shard_list_without_names_is_refused_saying_which() {
        let none = DataSource::Shards { paths: vec![], width: TokenWidth::U16 }.load(256).unwrap_err().to_string();
        assert!(none.contains("no token shards"), "{none}");
        let paths = vec![PathBuf::from("a.bin"), PathBuf::new()];
        let empty = DataSource::Shards { paths, width: TokenWidth::U16 }.load(256).unwrap_err().to_string();
        assert!(empty.contains("shard 2 of 2 has an empty name"), "{empty}");
    }

    #[test]
    fn bad_data_is_reported() {
        let dir = std::env::temp_dir().join(format!("lazarus-data-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let odd = dir.join("odd.bin");
        std::fs::write(&odd, [1u8, 0, 2]).unwrap();
        let err = DataSource::Shards { paths: vec![odd], width: TokenWidth::U16 }.load(256).unwrap_err().to_string();
        assert!(err.contains("odd.bin") && err.contains("multiple"), "{err}");
        let big = dir.join("big.bin");
        std::fs::write(&big, 300u16.to_le_bytes()).unwrap();
        let err = DataSource::Shards { paths: vec![big.clone()], width: TokenWidth::U16 }.load(256).unwrap_err().to_string();
        assert!(err.contains("300") && err.contains("vocabulary"), "{err}");
        assert_eq!(DataSource::Shards { paths: vec![big], width: TokenWidth::U16 }.load(1000).unwrap(), vec![300]);
        let bad = dir.join("bad.txt");
        std::fs::write(&bad, [b'a', 0xff, b'b']).unwrap();
        let err = DataSource::Text { path: bad }.load(256).unwrap_err().to_string();
        assert!(err.contains("UTF-8"), "{err}");
        assert!(Sampler::new(vec![1, 2], 5, 0, Cursor::default()).is_err());
    }
}
