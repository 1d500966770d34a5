//! The files of a Hugging Face dataset — Parquet ([`parquet`]) or Arrow IPC ([`arrow`], what
//! `datasets` keeps in its cache and writes with `save_to_disk`): a text column tokenized as it
//! is read, or a column of token ids (lists of integers, what `datasets.map(tokenize)` writes).
//!
//! Both are columnar and chunked (Parquet's compressed row groups, Arrow's record batches): a
//! window cannot be read from them without decoding and tokenizing everything before it in its
//! chunk, and the sampler draws windows in a shuffled order. So a source is read once, a chunk
//! and a batch of rows at a time, straight into a token cache — a Megatron indexed dataset
//! ([`super::indexed`]) written by [`IndexedWriter`], one document a row — and runs read their
//! windows from the cache with positioned reads. Neither step holds more than a chunk of rows
//! (memory does not grow with the file), and a resume or a recovery reads the same cache, so the
//! sampler's cursor continues exactly. The cache is named by a digest of what makes it: the
//! format, each file's path, size and modification time, the column, the tokenizer; a changed
//! file is read again. It is written under a temporary name and renamed, so that processes
//! converting at once (the workers of one job) or a conversion killed midway never leave a cache
//! that is half written.
//!
//! Text rows are tokenized as JSON-lines documents are: each row's text followed by a blank
//! line (`\n\n`), so that a window spanning two rows sees where one ends. Null rows are skipped.
//! Token-id rows are taken as they are (their end-of-document tokens are the tokenizer's). A
//! null inside a list, a negative id or one past 2^31, text that is not UTF-8, or a file the
//! reader refuses is an error naming the file, the chunk, the row and — where the reader
//! refuses — the bytes.

use std::fs::File;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::indexed::{IndexedFile, IndexedWriter, TokenType};
use crate::error::{ModelError, Result};
use crate::tokenizer::TextTokenizer;

pub mod arrow;
pub mod parquet;

/// Rows handed on at once.
const BATCH_ROWS: usize = 1024;
/// The columns looked for, in order, when none is named.
const DEFAULT_COLUMNS: [&str; 3] = ["text", "input_ids", "tokens"];
/// Changes when the cache's content for the same inputs would change.
const CACHE_VERSION: &str = "lazarus-table-tokens-1";

/// How a dataset's files are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TableFormat {
    Parquet,
    /// Arrow IPC, a stream (`datasets`' `.arrow` files) or the file format (`ARROW1`).
    Arrow,
}

impl TableFormat {
    /// The format a file's name says (`.parquet`, `.arrow`, in any case), if any.
    pub fn of_name(path: &Path) -> Option<Self> {
        let ext = path.extension()?.to_str()?;
        [TableFormat::Parquet, TableFormat::Arrow].into_iter().find(|f| ext.eq_ignore_ascii_case(f.name()))
    }

    /// The format's name, as `--data-format` takes it.
    pub fn name(self) -> &'static str {
        match self {
            TableFormat::Parquet => "parquet",
            TableFormat::Arrow => "arrow",
        }
    }

    /// What the format reads a file in: row groups, record batches.
    fn chunks(self) -> &'static str {
        match self {
            TableFormat::Parquet => "row groups",
            TableFormat::Arrow => "record batches",
        }
    }

    /// `column` (None: the default one) of `path`, named, and what it holds.
    pub fn column(self, path: &Path, column: Option<&str>) -> Result<(String, ColumnKind)> {
        match self {
            TableFormat::Parquet => parquet::named_column(path, column),
            TableFormat::Arrow => arrow::named_column(path, column),
        }
    }

    /// Each row of `column` of the files `paths`, in order, as its tokens, passed to `document`.
    pub fn read_rows(
        self,
        paths: &[PathBuf],
        column: &str,
        tokenizer: &TextTokenizer,
        document: impl FnMut(&[u32]) -> Result<()>,
    ) -> Result<TableRead> {
        match self {
            TableFormat::Parquet => parquet::read_rows(paths, column, tokenizer, document),
            TableFormat::Arrow => arrow::read_rows(paths, column, tokenizer, document),
        }
    }
}

/// A dataset's files, one after another: `column` (None: the first of `text`, `input_ids`,
/// `tokens` there is) — text tokenized, or lists of token ids — read once into a token cache
/// under `cache` (None: [`default_cache_dir`]), then a window at a time from it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableFiles {
    pub paths: Vec<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub column: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<PathBuf>,
    /// As a Megatron source's: one a file, each file a dataset of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<Vec<f64>>,
}

impl TableFiles {
    /// `paths` with the default column and cache, unblended.
    pub fn of(paths: Vec<PathBuf>) -> Self {
        TableFiles { paths, column: None, cache: None, weights: None }
    }
}

/// What a column holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnKind {
    /// Strings (or binary read as UTF-8), one document a row.
    Text,
    /// Lists of integer token ids, one document a row.
    TokenIds,
}

/// What a conversion read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableRead {
    pub files: usize,
    /// Row groups (Parquet) or record batches (Arrow).
    pub chunks: usize,
    pub rows: u64,
    /// Null rows, skipped.
    pub null_rows: u64,
    pub tokens: u64,
}

impl TableRead {
    /// "R rows of C row groups", as the format counts them.
    pub fn describe(&self, format: TableFormat) -> String {
        format!("{} rows of {} {}", self.rows, self.chunks, format.chunks())
    }
}

/// A row-reading step's failure: the reader's (said with where it read), a row's (said with the
/// row), or the cache writer's (as it is).
enum RowError {
    Reader(String),
    Row(u64, String),
    Out(ModelError),
}

/// The token cache of `paths`' `column` (None: the first of `text`, `input_ids`, `tokens` the
/// first file has) under `cache_dir`, made if it is not there yet: the prefix of a Megatron
/// indexed dataset, and whether it was made now (with what was read).
pub fn token_cache(
    format: TableFormat,
    paths: &[PathBuf],
    column: Option<&str>,
    tokenizer: &TextTokenizer,
    cache_dir: &Path,
) -> Result<(PathBuf, Option<TableRead>)> {
    let first =
        paths.first().ok_or_else(|| ModelError::Data { path: PathBuf::new(), reason: format!("no {} files named", format.name()) })?;
    let (column, kind) = format.column(first, column)?;
    let prefix = cache_dir.join(format!("{}-{}", file_stem(first), cache_key(format, paths, &column, tokenizer)?));
    if IndexedFile::open(&prefix).is_ok() {
        return Ok((prefix, None));
    }
    std::fs::create_dir_all(cache_dir)
        .map_err(|e| ModelError::Data { path: cache_dir.to_path_buf(), reason: format!("cannot create the token cache's folder: {e}") })?;
    // One process makes it (a job's workers open the data at once); the others wait for it and
    // find it made. A maker killed midway lets go of the lock with its life.
    let _lock = CacheLock::take(&PathBuf::from(format!("{}.lock", prefix.display())))?;
    if IndexedFile::open(&prefix).is_ok() {
        return Ok((prefix, None));
    }
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let scratch = PathBuf::from(format!("{}.partial-{}-{nanos}", prefix.display(), std::process::id()));
    // Text tokens fit u16 under a vocabulary of 65,536 (the byte tokenizer's 256 among them).
    let token_type = if kind == ColumnKind::Text && tokenizer.vocab_size() <= 1 << 16 { TokenType::U16 } else { TokenType::I32 };
    let mut writer = IndexedWriter::create(&scratch, token_type)?;
    let read = format.read_rows(paths, &column, tokenizer, |doc| writer.push(doc));
    let done = read.and_then(|read| writer.finish().map(|()| read));
    let (scratch_bin, scratch_idx) = super::indexed::prefix_paths(&scratch);
    let read = match done {
        Ok(read) => read,
        Err(e) => {
            for p in [&scratch_bin, &scratch_idx, &scratch_bin.with_extension("lengths")] {
                let _ = std::fs::remove_file(p);
            }
            return Err(e);
        }
    };
    // The data first, then the index that makes it a dataset: a cache is found only whole.
    let (bin, idx) = super::indexed::prefix_paths(&prefix);
    let rename = |from: &Path, to: &Path| {
        std::fs::rename(from, to)
            .map_err(|e| ModelError::Data { path: to.to_path_buf(), reason: format!("cannot move the token cache in place: {e}") })
    };
    rename(&scratch_bin, &bin)?;
    rename(&scratch_idx, &idx)?;
    Ok((prefix, Some(read)))
}

/// An exclusive `flock` on a file beside the cache, held until dropped (the file with it).
struct CacheLock(#[allow(dead_code)] File);

impl CacheLock {
    fn take(path: &Path) -> Result<Self> {
        use std::os::fd::AsRawFd;
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| ModelError::Data { path: path.to_path_buf(), reason: format!("cannot open the token cache's lock: {e}") })?;
        // SAFETY: flock on a descriptor this process owns; it blocks until the lock is ours.
        while unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(ModelError::Data { path: path.to_path_buf(), reason: format!("cannot lock the token cache: {e}") });
            }
        }
        Ok(CacheLock(f))
    }
}

/// The checks every format makes of a file's column against the first file's, and of the
/// tokenizer against the column.
fn check_column(path: &Path, column: &str, kind: ColumnKind, first: &mut Option<ColumnKind>, tokenizer: &TextTokenizer) -> Result<()> {
    if *first.get_or_insert(kind) != kind {
        return Err(ModelError::Data {
            path: path.to_path_buf(),
            reason: format!("column `{column}` holds {kind:?}, not {:?} as in the first file", first.unwrap()),
        });
    }
    if kind == ColumnKind::TokenIds && matches!(tokenizer, TextTokenizer::Hf(_)) {
        return Err(ModelError::Data {
            path: path.to_path_buf(),
            reason: format!("column `{column}` holds token ids already: it takes no tokenizer"),
        });
    }
    Ok(())
}

/// A text row as its document's tokens: the text and a blank line, tokenized.
fn text_document(text: &mut String, row: &str, tokenizer: &TextTokenizer) -> std::result::Result<Vec<u32>, RowError> {
    text.clear();
    text.push_str(row);
    text.push_str("\n\n");
    tokenizer.encode(text).map_err(RowError::Out)
}

/// A token id as the cache keeps it: in 0..2^31.
fn token_id(id: i128, row: u64) -> std::result::Result<u32, RowError> {
    u32::try_from(id).ok().filter(|&t| t <= i32::MAX as u32).ok_or_else(|| RowError::Row(row, format!("token id {id} is not in 0..2^31")))
}

/// The first of [`DEFAULT_COLUMNS`] among `names` (the columns of `path`).
fn default_column(path: &Path, names: &[String]) -> Result<String> {
    DEFAULT_COLUMNS.iter().find(|c| names.iter().any(|n| n == *c)).map(|c| c.to_string()).ok_or_else(|| ModelError::Data {
        path: path.to_path_buf(),
        reason: format!("none of the columns {} (it has {}): name one with --data-column", DEFAULT_COLUMNS.join(", "), names.join(", ")),
    })
}

/// `read` run with a panic caught as the error it should have been: the Parquet and Arrow
/// readers assert on some of what damaged bytes break (a buffer or a column chunk past the end
/// of what holds it). Caught quietly: the process's panic hook says nothing of a panic on this
/// thread while `read` runs (a user would see a crash report before the clean error), and
/// everything of any other.
fn caught<T>(format: TableFormat, read: impl FnOnce() -> T) -> std::result::Result<T, String> {
    use std::cell::Cell;
    thread_local! {
        static QUIET: Cell<bool> = const { Cell::new(false) };
    }
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                previous(info);
            }
        }));
    });
    let was = QUIET.with(|q| q.replace(true));
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(read));
    QUIET.with(|q| q.set(was));
    out.map_err(|panic| {
        let what = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
        format!("the {} reader failed on damaged data ({})", format.name(), what.unwrap_or_default())
    })
}

fn file_stem(path: &Path) -> String {
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("data");
    stem.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).take(40).collect()
}

/// A digest of what the cache's tokens are made of (16 hex digits).
fn cache_key(format: TableFormat, paths: &[PathBuf], column: &str, tokenizer: &TextTokenizer) -> Result<String> {
    let mut h = Sha256::new();
    let mut put = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    put(CACHE_VERSION.as_bytes());
    put(format.name().as_bytes());
    put(column.as_bytes());
    put(&tokenizer.identity());
    for p in paths {
        let meta = std::fs::metadata(p).map_err(|e| ModelError::Data { path: p.clone(), reason: format!("cannot read: {e}") })?;
        let canonical = std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
        put(canonical.to_string_lossy().as_bytes());
        put(&meta.len().to_le_bytes());
        let mtime = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
        put(&mtime.to_le_bytes());
    }
    Ok(h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect())
}

/// The folder token caches go to: `LAZARUS_DATA_CACHE`, else `$XDG_CACHE_HOME/lazarus/data`,
/// else `~/.cache/lazarus/data`, else the temporary folder's `lazarus-data`.
pub fn default_cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("LAZARUS_DATA_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("lazarus/data");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(h).join(".cache/lazarus/data");
    }
    std::env::temp_dir().join("lazarus-data")
}

/// What the Parquet and Arrow readers' tests share.
#[cfg(test)]
pub(super) mod testing {
    use super::*;

    /// A fresh folder for a test.
    pub fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lazarus-table-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Each document `format` reads from `column` of `path` (byte-tokenized), and what it read.
    pub fn documents(format: TableFormat, path: &Path, column: &str) -> Result<(Vec<Vec<u32>>, TableRead)> {
        let mut docs = Vec::new();
        let read = format.read_rows(&[path.to_path_buf()], column, &TextTokenizer::Bytes, |d| {
            docs.push(d.to_vec());
            Ok(())
        })?;
        Ok((docs, read))
    }

    /// The documents a column of `rows` (as pyarrow read them back: strings or lists of ids,
    /// nulls among them) should give: each text and a blank line, byte-tokenized; each list as
    /// it is (None: a null row, skipped, or an empty document).
    pub fn expected_documents(rows: &[serde_json::Value], null_list: Option<Vec<u32>>) -> Vec<Vec<u32>> {
        match rows.iter().find(|r| !r.is_null()) {
            Some(serde_json::Value::String(_)) => {
                rows.iter().filter_map(|r| r.as_str()).map(|t| crate::data::ByteTokenizer::encode(&format!("{t}\n\n"))).collect()
            }
            _ => rows
                .iter()
                .filter_map(|r| match r.as_array() {
                    Some(ids) => Some(ids.iter().map(|i| i.as_u64().unwrap() as u32).collect()),
                    None => null_list.clone(),
                })
                .collect(),
        }
    }

    /// `format`'s files `fixtures` (file, column) damaged 1,500 ways each (1–4 bytes, seeded):
    /// never a panic; how many damages were errors.
    pub fn damages_found(format: TableFormat, fixtures: &[(PathBuf, &str)]) -> usize {
        let dir = scratch(&format!("fuzz-{}", format.name()));
        let mut rng = crate::rng::SplitMix64::new(99);
        let mut errors = 0;
        for (file, column) in fixtures {
            let good = std::fs::read(file).unwrap();
            let name = file.file_name().unwrap().to_string_lossy();
            for i in 0..1500 {
                let mut bad = good.clone();
                for _ in 0..1 + rng.below(4) {
                    let at = rng.below(bad.len());
                    bad[at] = rng.below(256) as u8;
                }
                let path = dir.join(format!("{i}-{name}"));
                std::fs::write(&path, &bad).unwrap();
                let read = std::panic::catch_unwind(|| documents(format, &path, column).map(|_| ()));
                assert!(read.is_ok(), "{name}: damage {i} made the reader panic");
                errors += usize::from(read.is_ok_and(|r| r.is_err()));
                let _ = std::fs::remove_file(&path);
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::DataSource;

    /// A configuration names a dataset's files by `kind` as before the formats shared their
    /// fields (checkpoints keep it), and reads back what it writes.
    #[test]
    fn a_dataset_s_files_read_from_toml_by_kind() {
        let arrow: DataSource = toml::from_str("kind = \"arrow\"\npaths = [\"a.arrow\"]\ncolumn = \"input_ids\"\n").unwrap();
        assert_eq!(arrow, DataSource::Arrow(TableFiles { column: Some("input_ids".into()), ..TableFiles::of(vec!["a.arrow".into()]) }));
        let parquet: DataSource =
            toml::from_str("kind = \"parquet\"\npaths = [\"a.parquet\", \"b.parquet\"]\nweights = [3.0, 1.0]\n").unwrap();
        assert_eq!(parquet.table().map(|(f, t)| (f, t.weights.clone())), Some((TableFormat::Parquet, Some(vec![3.0, 1.0]))));
        for source in [arrow, parquet] {
            assert_eq!(toml::from_str::<DataSource>(&toml::to_string(&source).unwrap()).unwrap(), source);
            assert_eq!(serde_json::from_str::<DataSource>(&serde_json::to_string(&source).unwrap()).unwrap(), source);
        }
        assert_eq!(TableFormat::of_name(Path::new("x/data-00000-of-00001.arrow")), Some(TableFormat::Arrow));
    }
}
