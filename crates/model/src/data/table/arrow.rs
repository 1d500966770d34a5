//! Arrow IPC files of a Hugging Face dataset, read with `arrow-ipc`: the stream format (what
//! `datasets` writes to its cache and with `save_to_disk`, `*.arrow`) and the file format
//! (`ARROW1`, pyarrow's `ipc.new_file`), uncompressed or zstd-compressed; a text column (string,
//! large string, string view, binary read as UTF-8) or a column of token ids (list, large list
//! or fixed-size list of any integer type).
//!
//! Only the named column is decoded (a projection), a record batch at a time. A stream must
//! end with its end-of-stream marker where the file ends: the format reads a stream cut at a
//! message boundary as a shorter stream, so a file a writer left half written would otherwise
//! train on part of the data without a word. The reader's panics on damaged bytes are caught
//! and said as errors naming the record batch.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use arrow_array::cast::AsArray;
use arrow_array::types::{Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type};
use arrow_array::{Array, ArrayRef, ArrowPrimitiveType, OffsetSizeTrait, RecordBatch};
use arrow_ipc::reader::{FileReader, StreamReader};
use arrow_schema::{DataType, SchemaRef};

use super::{caught, check_column, text_document, token_id, ColumnKind, RowError, TableFormat, TableRead};
use crate::error::{ModelError, Result};
use crate::tokenizer::TextTokenizer;

/// A stream's end-of-stream marker: the continuation marker and a zero length.
const END_OF_STREAM: [u8; 8] = [0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0];

/// An Arrow IPC file opened: a stream, or the file format (its footer read).
enum Batches {
    Stream(StreamReader<Counted<BufReader<File>>>),
    File(FileReader<BufReader<File>>),
}

/// A reader that counts the bytes read through it: where a stream's reader stopped.
struct Counted<R> {
    inner: R,
    read: u64,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        Ok(n)
    }
}

impl Batches {
    /// `path` opened, reading only `projection`'s columns (None: all).
    fn open(path: &Path, projection: Option<usize>) -> Result<Self> {
        let bad = |why: String| ModelError::Data { path: path.to_path_buf(), reason: why };
        let mut file = File::open(path).map_err(|e| bad(format!("cannot open: {e}")))?;
        let len = file.metadata().map_or(0, |m| m.len());
        let mut head = Vec::with_capacity(8);
        (&mut file).take(8).read_to_end(&mut head).map_err(|e| bad(format!("cannot read: {e}")))?;
        let head = head.as_slice();
        if head.starts_with(b"PAR1") {
            return Err(bad("a Parquet file, not Arrow: read it with --data-format parquet".into()));
        }
        // The file format's magic; a stream's continuation marker, or (before Arrow 0.15) the
        // length of its first message.
        let is_file = head.starts_with(b"ARROW1");
        let first_length = head.get(..4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        let is_stream = head.starts_with(&END_OF_STREAM[..4]) || first_length.is_some_and(|n| n > 0 && n as u64 + 4 <= len);
        if !(is_file || is_stream) {
            return Err(bad(format!("not an Arrow IPC file or stream (it starts with bytes {head:02x?})")));
        }
        std::io::Seek::rewind(&mut file).map_err(|e| bad(format!("cannot read: {e}")))?;
        let projection = projection.map(|c| vec![c]);
        let opened = caught(TableFormat::Arrow, || {
            if is_file {
                FileReader::try_new_buffered(file, projection).map(Batches::File)
            } else {
                StreamReader::try_new(Counted { inner: BufReader::new(file), read: 0 }, projection).map(Batches::Stream)
            }
        });
        let what = if is_file { "an Arrow IPC file" } else { "an Arrow IPC stream" };
        match opened {
            Ok(Ok(b)) => Ok(b),
            Ok(Err(e)) => Err(bad(format!("not {what} its reader accepts: {e}"))),
            Err(panic) => Err(bad(format!("not {what} its reader accepts: {panic}"))),
        }
    }

    fn schema(&self) -> SchemaRef {
        match self {
            Batches::Stream(s) => s.schema(),
            Batches::File(f) => f.schema(),
        }
    }

    fn next(&mut self) -> Option<std::result::Result<RecordBatch, String>> {
        let next = caught(TableFormat::Arrow, || match self {
            Batches::Stream(s) => s.next(),
            Batches::File(f) => f.next(),
        });
        match next {
            Ok(batch) => batch.map(|b| b.map_err(|e| e.to_string())),
            Err(panic) => Some(Err(panic)),
        }
    }

    /// After the last batch: a stream must have ended with its end-of-stream marker, at the
    /// file's end.
    fn check_end(&self, path: &Path) -> std::result::Result<(), String> {
        let Batches::Stream(s) = self else { return Ok(()) };
        let at = s.get_ref().read;
        let len = std::fs::metadata(path).map_err(|e| format!("cannot read: {e}"))?.len();
        if at < len {
            return Err(format!("{} bytes after the stream's end-of-stream marker (at byte {at})", len - at));
        }
        let mut tail = [0u8; 8];
        let ends = len >= 8 && {
            let mut f = File::open(path).map_err(|e| format!("cannot open: {e}"))?;
            std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(len - 8)).map_err(|e| format!("cannot read: {e}"))?;
            f.read_exact(&mut tail).is_ok()
        };
        // (Streams written before Arrow 0.15 end with a zero length alone.)
        if ends && (tail == END_OF_STREAM || tail[4..] == [0; 4]) {
            return Ok(());
        }
        Err(format!("the stream ends at byte {len} without its end-of-stream marker: the file is cut short (a writer stopped midway?)"))
    }
}

/// `name`'s column in `schema`: its index and what it holds; an error lists the columns there
/// are when it is missing, and says why when it is not text or a list of integers.
fn column_of(path: &Path, schema: &SchemaRef, name: &str) -> Result<(usize, ColumnKind)> {
    let bad = |why: String| ModelError::Data { path: path.to_path_buf(), reason: why };
    let Ok(index) = schema.index_of(name) else {
        return Err(bad(format!("no column `{name}` (it has {})", names(schema).join(", "))));
    };
    let dt = schema.field(index).data_type();
    let kind = match dt {
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View | DataType::Binary | DataType::LargeBinary | DataType::BinaryView => {
            ColumnKind::Text
        }
        DataType::List(f) | DataType::LargeList(f) | DataType::FixedSizeList(f, _) if f.data_type().is_integer() => ColumnKind::TokenIds,
        _ => return Err(bad(format!("column `{name}` is {dt}: expected text (a string a row) or token ids (a list of integers a row)"))),
    };
    Ok((index, kind))
}

fn names(schema: &SchemaRef) -> Vec<String> {
    schema.fields().iter().map(|f| f.name().clone()).collect()
}

/// `column` (None: the default one) of the Arrow file `path`, named, and what it holds.
pub(super) fn named_column(path: &Path, column: Option<&str>) -> Result<(String, ColumnKind)> {
    let schema = Batches::open(path, None)?.schema();
    let name = match column {
        Some(c) => c.to_string(),
        None => super::default_column(path, &names(&schema))?,
    };
    let (_, kind) = column_of(path, &schema, &name)?;
    Ok((name, kind))
}

/// Each row of `column` of the files `paths`, in order, as its tokens, passed to `document`.
pub(super) fn read_rows(
    paths: &[PathBuf],
    column: &str,
    tokenizer: &TextTokenizer,
    mut document: impl FnMut(&[u32]) -> Result<()>,
) -> Result<TableRead> {
    let mut read = TableRead::default();
    let mut kinds = None;
    for path in paths {
        let (index, kind) = column_of(path, &Batches::open(path, None)?.schema(), column)?;
        check_column(path, column, kind, &mut kinds, tokenizer)?;
        let mut batches = Batches::open(path, Some(index))?;
        let bad = |why: String| ModelError::Data { path: path.clone(), reason: why };
        let mut row = 0u64;
        let mut batch_no = 0usize;
        while let Some(batch) = batches.next() {
            let batch = batch.map_err(|e| bad(format!("record batch {batch_no} (column `{column}`): {e}")))?;
            let rows = batch_rows(batch.column(0), kind, row, tokenizer, &mut read, &mut document).map_err(|e| match e {
                RowError::Reader(e) => bad(format!("record batch {batch_no} (column `{column}`): {e}")),
                RowError::Row(r, why) => bad(format!("row {r} (record batch {batch_no}): {why}")),
                RowError::Out(e) => e,
            })?;
            row += rows;
            batch_no += 1;
            read.chunks += 1;
        }
        batches.check_end(path).map_err(bad)?;
        read.files += 1;
    }
    Ok(read)
}

/// The rows of one record batch's column (`first`: the file's row number of its first row),
/// each a document: how many rows there were.
fn batch_rows(
    col: &ArrayRef,
    kind: ColumnKind,
    first: u64,
    tokenizer: &TextTokenizer,
    read: &mut TableRead,
    document: &mut impl FnMut(&[u32]) -> Result<()>,
) -> std::result::Result<u64, RowError> {
    let mut text = String::new();
    for i in 0..col.len() {
        let row = first + i as u64;
        read.rows += 1;
        if col.is_null(i) {
            read.null_rows += 1;
            continue;
        }
        let tokens = match kind {
            ColumnKind::Text => text_document(&mut text, text_row(col, i, row)?, tokenizer)?,
            ColumnKind::TokenIds => id_row(&list_row(col, i)?, row)?,
        };
        read.tokens += tokens.len() as u64;
        document(&tokens).map_err(RowError::Out)?;
    }
    Ok(col.len() as u64)
}

/// Row `i` of a text column, as UTF-8.
fn text_row(col: &ArrayRef, i: usize, row: u64) -> std::result::Result<&str, RowError> {
    if let Some(a) = col.as_string_opt::<i32>() {
        return Ok(a.value(i));
    }
    if let Some(a) = col.as_string_opt::<i64>() {
        return Ok(a.value(i));
    }
    if let Some(a) = col.as_string_view_opt() {
        return Ok(a.value(i));
    }
    let bytes = if let Some(a) = col.as_binary_opt::<i32>() {
        a.value(i)
    } else if let Some(a) = col.as_binary_opt::<i64>() {
        a.value(i)
    } else if let Some(a) = col.as_binary_view_opt() {
        a.value(i)
    } else {
        return Err(RowError::Reader(format!("a {} column is not text", col.data_type())));
    };
    std::str::from_utf8(bytes).map_err(|e| RowError::Row(row, format!("not UTF-8 at byte {}", e.valid_up_to())))
}

/// Row `i` of a list column: its elements.
fn list_row(col: &ArrayRef, i: usize) -> std::result::Result<ArrayRef, RowError> {
    fn of<O: OffsetSizeTrait>(col: &ArrayRef, i: usize) -> Option<ArrayRef> {
        col.as_list_opt::<O>().map(|l| l.value(i))
    }
    of::<i32>(col, i)
        .or_else(|| of::<i64>(col, i))
        .or_else(|| col.as_fixed_size_list_opt().map(|l| l.value(i)))
        .ok_or_else(|| RowError::Reader(format!("a {} column is not a list", col.data_type())))
}

/// A list's integer elements as token ids: no nulls, each in 0..2^31.
fn id_row(values: &ArrayRef, row: u64) -> std::result::Result<Vec<u32>, RowError> {
    let mut doc = Vec::with_capacity(values.len());
    if values.null_count() > 0 {
        return Err(RowError::Row(row, "a null inside the list of token ids".into()));
    }
    fn ids<T: ArrowPrimitiveType>(values: &ArrayRef, row: u64, doc: &mut Vec<u32>) -> Option<std::result::Result<(), RowError>>
    where
        T::Native: Into<i128>,
    {
        let a = values.as_primitive_opt::<T>()?;
        Some(a.values().iter().try_for_each(|&v| token_id(v.into(), row).map(|t| doc.push(t))))
    }
    let d = &mut doc;
    ids::<Int32Type>(values, row, d)
        .or_else(|| ids::<Int64Type>(values, row, d))
        .or_else(|| ids::<UInt16Type>(values, row, d))
        .or_else(|| ids::<UInt32Type>(values, row, d))
        .or_else(|| ids::<UInt64Type>(values, row, d))
        .or_else(|| ids::<Int16Type>(values, row, d))
        .or_else(|| ids::<Int8Type>(values, row, d))
        .or_else(|| ids::<UInt8Type>(values, row, d))
        .unwrap_or_else(|| Err(RowError::Reader(format!("token ids of type {} are not integers", values.data_type()))))?;
    Ok(doc)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{self, scratch};
    use super::super::token_cache;
    use super::*;
    use crate::data::{DataSource, TableFiles};

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/arrow").join(name)
    }

    fn documents(path: &Path, column: &str) -> Result<(Vec<Vec<u32>>, TableRead)> {
        testing::documents(TableFormat::Arrow, path, column)
    }

    /// Every fixture `datasets` and pyarrow wrote (`make.py`: `save_to_disk`'s shard, a `map`'s
    /// cache file, streams of strings and large strings, lists of int32, large lists of int64,
    /// fixed-size lists of uint16, the file format compressed with zstd; nulls, empty rows,
    /// several batches) reads as pyarrow read it back (`expected.json`).
    #[test]
    fn files_datasets_and_pyarrow_wrote_read_as_pyarrow_reads_them() {
        let expected: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap();
        for (name, column) in [
            ("hf_saved_text.arrow", "text"),
            ("hf_map_ids.arrow", "input_ids"),
            ("large_text.arrow", "content"),
            ("ids_int32.arrow", "input_ids"),
            ("ids_int64.arrow", "tokens"),
            ("ids_fixed_u16.arrow", "input_ids"),
            ("text_file_zstd.arrow", "text"),
        ] {
            let e = &expected[name];
            let rows = e["columns"][column].as_array().unwrap();
            let (docs, read) = documents(&fixture(name), column).unwrap();
            assert_eq!(read.chunks as u64, e["batches"].as_u64().unwrap(), "{name}");
            assert_eq!(read.rows, e["rows"].as_u64().unwrap(), "{name}");
            // (A null row is skipped, list or text.)
            let want = testing::expected_documents(rows, None);
            assert_eq!(read.null_rows, rows.iter().filter(|r| r.is_null()).count() as u64, "{name}");
            assert_eq!(docs, want, "{name}");
            assert_eq!(read.tokens, want.iter().map(|d| d.len() as u64).sum::<u64>(), "{name}");
        }
    }

    #[test]
    fn the_default_column_is_text_then_input_ids_then_tokens() {
        assert_eq!(named_column(&fixture("hf_saved_text.arrow"), None).unwrap(), ("text".into(), ColumnKind::Text));
        assert_eq!(named_column(&fixture("hf_map_ids.arrow"), None).unwrap(), ("input_ids".into(), ColumnKind::TokenIds));
        assert_eq!(named_column(&fixture("ids_int64.arrow"), None).unwrap(), ("tokens".into(), ColumnKind::TokenIds));
        let e = named_column(&fixture("large_text.arrow"), None).unwrap_err().to_string();
        assert!(e.contains("none of the columns text, input_ids, tokens (it has content)") && e.contains("--data-column"), "{e}");
    }

    /// The cache of an Arrow file holds the tokens the same rows give from Parquet (the training
    /// fixtures hold the same sentences), is made once and found again, and is not the Parquet
    /// file's cache.
    #[test]
    fn an_arrow_file_caches_the_tokens_its_parquet_twin_gives() {
        let dir = scratch("arrow-cache");
        let cache = dir.join("cache");
        let arrow = DataSource::Arrow(TableFiles { cache: Some(cache.clone()), ..TableFiles::of(vec![fixture("train.arrow")]) });
        let parquet_fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/parquet/train.parquet");
        let parquet = DataSource::Parquet(TableFiles { cache: Some(cache.clone()), ..TableFiles::of(vec![parquet_fixture]) });
        let tokens = arrow.load(256).unwrap();
        assert!(tokens.len() > 40_000);
        assert_eq!(tokens, parquet.load(256).unwrap());
        let (_, made) = token_cache(TableFormat::Arrow, &[fixture("train.arrow")], None, &TextTokenizer::Bytes, &cache).unwrap();
        assert_eq!(made, None, "the second open finds the cache");
        let made: Vec<_> = std::fs::read_dir(&cache)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "idx"))
            .collect();
        assert_eq!(made.len(), 2, "one cache per source: {made:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn what_is_not_a_document_is_refused_naming_the_file_and_row() {
        let e = documents(&fixture("ids_null_element.arrow"), "input_ids").unwrap_err().to_string();
        assert!(e.contains("ids_null_element.arrow") && e.contains("row 1 (record batch 0): a null inside the list"), "{e}");
        let e = documents(&fixture("ids_negative.arrow"), "input_ids").unwrap_err().to_string();
        assert!(e.contains("row 1 (record batch 0): token id -5 is not in 0..2^31"), "{e}");
        let e = documents(&fixture("hf_saved_text.arrow"), "nope").unwrap_err().to_string();
        assert!(e.contains("no column `nope` (it has id, text)"), "{e}");
        let e = documents(&fixture("ids_int32.arrow"), "n").unwrap_err().to_string();
        assert!(e.contains("column `n` is Int32: expected text"), "{e}");
        let parquet = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/parquet/text.parquet");
        let e = documents(&parquet, "text").unwrap_err().to_string();
        assert!(e.contains("a Parquet file, not Arrow: read it with --data-format parquet"), "{e}");
        let tokenizer = TextTokenizer::Hf(Box::new(tokenizers::Tokenizer::new(tokenizers::models::bpe::BPE::default())));
        let e = read_rows(&[fixture("hf_map_ids.arrow")], "input_ids", &tokenizer, |_| Ok(())).unwrap_err().to_string();
        assert!(e.contains("token ids already: it takes no tokenizer"), "{e}");
    }

    /// A stream cut at a message boundary (which the format itself reads as a shorter stream),
    /// cut inside a message, or with bytes after its end is an error naming the file; a file
    /// that is not Arrow says what it starts with.
    #[test]
    fn a_stream_cut_short_or_with_bytes_after_it_is_refused() {
        let dir = scratch("arrow-cut");
        let good = std::fs::read(fixture("large_text.arrow")).unwrap();
        assert!(good.ends_with(&END_OF_STREAM));
        let write = |name: &str, bytes: &[u8]| {
            let p = dir.join(name);
            std::fs::write(&p, bytes).unwrap();
            p
        };
        let e = documents(&write("no-end.arrow", &good[..good.len() - 8]), "content").unwrap_err().to_string();
        assert!(e.contains("no-end.arrow") && e.contains("without its end-of-stream marker: the file is cut short"), "{e}");
        let e = documents(&write("mid.arrow", &good[..good.len() - 30]), "content").unwrap_err().to_string();
        assert!(e.contains("mid.arrow") && e.contains("record batch 3"), "{e}");
        let mut longer = good.clone();
        longer.extend_from_slice(b"trailing");
        let e = documents(&write("after.arrow", &longer), "content").unwrap_err().to_string();
        assert!(e.contains("8 bytes after the stream's end-of-stream marker"), "{e}");
        let e = documents(&write("junk.arrow", b"hello, world"), "content").unwrap_err().to_string();
        assert!(e.contains("not an Arrow IPC file or stream (it starts with bytes"), "{e}");
        let e = documents(&write("empty.arrow", b""), "content").unwrap_err().to_string();
        assert!(e.contains("empty.arrow") && e.contains("not an Arrow IPC"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Bytes damaged anywhere in the files `datasets` and pyarrow wrote (6,000 seeded damages of
    /// 1–4 bytes: schemas, batch headers, buffers, the file format's footer) are errors or, where
    /// the damage changes nothing that is read, the rows — never a panic.
    #[test]
    fn damage_anywhere_is_an_error_never_a_panic() {
        let files = [
            ("hf_saved_text.arrow", "text"),
            ("hf_map_ids.arrow", "input_ids"),
            ("ids_int64.arrow", "tokens"),
            ("text_file_zstd.arrow", "text"),
        ];
        let errors = testing::damages_found(TableFormat::Arrow, &files.map(|(f, c)| (fixture(f), c)));
        assert!(errors > 1500, "much damage is found: {errors} of 6000");
    }
}
