//! Parquet files of a Hugging Face dataset, read with the `parquet` crate (no Arrow arrays):
//! snappy and zstd, dictionary and plain encodings, pages v1 and v2, strings and large strings,
//! lists and large lists of int32 or int64.
//!
//! The reader asserts on some of what a damaged file breaks (a column chunk's range past the
//! file, a dictionary-encoded page with no dictionary before it): the chunk's range is checked
//! against the file before the reader sees it, and the reader's panics on a row group are
//! caught and said as an error naming the chunk's bytes.

use std::fs::File;
use std::path::{Path, PathBuf};

use parquet::column::reader::ColumnReader;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::schema::types::ColumnDescPtr;

use super::{caught, check_column, text_document, token_id, ColumnKind, RowError, TableFormat, TableRead, BATCH_ROWS};
use crate::error::{ModelError, Result};
use crate::tokenizer::TextTokenizer;

/// The Parquet source's column in one file: its index among the leaf columns, what it holds.
struct Column {
    index: usize,
    kind: ColumnKind,
    descr: ColumnDescPtr,
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
        let reader = open(path)?;
        let col = column_of(path, &reader, column)?;
        check_column(path, column, col.kind, &mut kinds, tokenizer)?;
        let meta = reader.metadata();
        let file_first_row = read.rows;
        let file_len = std::fs::metadata(path).map_or(0, |m| m.len());
        for rg in 0..meta.num_row_groups() {
            // Checked before the reader sees it: it asserts what a damaged footer may break.
            let (start, len) = chunk_bytes(meta.row_group(rg).column(col.index), file_len)
                .map_err(|why| ModelError::Data { path: path.clone(), reason: format!("row group {rg} (column `{column}`): {why}") })?;
            let at = |e: String| ModelError::Data {
                path: path.clone(),
                reason: format!("row group {rg} (column `{column}`, bytes {start}..{}): {e}", start + len),
            };
            let first_row = read.rows;
            // The reader asserts some of what a damaged page may break (a dictionary-encoded
            // page with no dictionary before it): that too is an error naming the bytes.
            let rows = caught(TableFormat::Parquet, || {
                let reader =
                    reader.get_row_group(rg).and_then(|g| g.get_column_reader(col.index)).map_err(|e| RowError::Reader(e.to_string()))?;
                match col.kind {
                    ColumnKind::Text => text_rows(reader, &col, tokenizer, &mut read, &mut document),
                    ColumnKind::TokenIds => id_rows(reader, &col, &mut read, &mut document),
                }
            })
            .unwrap_or_else(|panic| Err(RowError::Reader(panic)))
            .map_err(|e| match e {
                RowError::Reader(e) => at(e),
                RowError::Row(i, why) => ModelError::Data {
                    path: path.clone(),
                    reason: format!("row {} (row group {rg}): {why}", first_row - file_first_row + i),
                },
                RowError::Out(e) => e,
            })?;
            let expected = meta.row_group(rg).num_rows();
            if rows as i64 != expected {
                return Err(at(format!("{rows} rows read, the footer says {expected}")));
            }
            read.chunks += 1;
        }
        read.files += 1;
    }
    Ok(read)
}

/// Where a column chunk lies in a file of `file_len` bytes, as its footer says: an error when
/// that is not within the file (the reader's own `byte_range` would panic on a negative one).
fn chunk_bytes(chunk: &parquet::file::metadata::ColumnChunkMetaData, file_len: u64) -> std::result::Result<(u64, u64), String> {
    let start = chunk.dictionary_page_offset().unwrap_or(chunk.data_page_offset());
    let len = chunk.compressed_size();
    match (u64::try_from(start), u64::try_from(len)) {
        (Ok(s), Ok(l)) if s.checked_add(l).is_some_and(|end| end <= file_len) => Ok((s, l)),
        _ => Err(format!("its column chunk is at bytes {start}..+{len}, not within the file's {file_len} bytes")),
    }
}

/// Why a row group's rows could not be read: the reader refused its bytes, a row is not a
/// document (its index in the row group), or the document's consumer failed.
/// The rows of a text column: each non-null row's text and a blank line, tokenized.
fn text_rows(
    reader: ColumnReader,
    col: &Column,
    tokenizer: &TextTokenizer,
    read: &mut TableRead,
    document: &mut impl FnMut(&[u32]) -> Result<()>,
) -> std::result::Result<u64, RowError> {
    let ColumnReader::ByteArrayColumnReader(mut reader) = reader else { return Err(RowError::Reader("not a byte-array column".into())) };
    let nullable = col.descr.max_def_level() > 0;
    let (mut defs, mut values) = (Vec::new(), Vec::new());
    let (mut rows, mut text) = (0u64, String::new());
    loop {
        defs.clear();
        values.clear();
        let (records, _, _) =
            reader.read_records(BATCH_ROWS, Some(&mut defs), None, &mut values).map_err(|e| RowError::Reader(e.to_string()))?;
        if records == 0 {
            return Ok(rows);
        }
        let mut next = values.iter();
        for r in 0..records {
            let row = rows + r as u64;
            read.rows += 1;
            if nullable && defs[r] < col.descr.max_def_level() {
                read.null_rows += 1;
                continue;
            }
            let value = next.next().ok_or_else(|| RowError::Reader("fewer values than rows".into()))?;
            let s = std::str::from_utf8(value.data()).map_err(|e| RowError::Row(row, format!("not UTF-8 at byte {}", e.valid_up_to())))?;
            let tokens = text_document(&mut text, s, tokenizer)?;
            read.tokens += tokens.len() as u64;
            document(&tokens).map_err(RowError::Out)?;
        }
        rows += records as u64;
    }
}

/// The rows of a list-of-ids column: each row's ids, checked (no nulls inside, 0 ≤ id < 2^31).
fn id_rows(
    reader: ColumnReader,
    col: &Column,
    read: &mut TableRead,
    document: &mut impl FnMut(&[u32]) -> Result<()>,
) -> std::result::Result<u64, RowError> {
    let max_def = col.descr.max_def_level();
    // A def level one short of the leaf's is a null element when the element may be null.
    let null_element = col.descr.self_type().is_optional().then_some(max_def - 1);
    let (mut defs, mut reps, mut doc) = (Vec::new(), Vec::new(), Vec::<u32>::new());
    let mut rows = 0u64;
    let mut values = IdValues::of(reader)?;
    loop {
        defs.clear();
        reps.clear();
        let records = values.read(&mut defs, &mut reps)?;
        if records == 0 {
            return Ok(rows);
        }
        let mut v = 0usize;
        let mut row = rows;
        doc.clear();
        for (k, (&d, &r)) in defs.iter().zip(&reps).enumerate() {
            if r == 0 && k > 0 {
                finish_row(&mut doc, read, document)?;
                row += 1;
            }
            if d == max_def {
                let id = values.get(v).ok_or_else(|| RowError::Reader("fewer values than levels".into()))?;
                v += 1;
                doc.push(token_id(id.into(), row)?);
            } else if Some(d) == null_element {
                return Err(RowError::Row(row, "a null inside the list of token ids".into()));
            }
        }
        finish_row(&mut doc, read, document)?;
        rows += records as u64;
    }
}

fn finish_row(
    doc: &mut Vec<u32>,
    read: &mut TableRead,
    document: &mut impl FnMut(&[u32]) -> Result<()>,
) -> std::result::Result<(), RowError> {
    read.rows += 1;
    read.tokens += doc.len() as u64;
    document(doc).map_err(RowError::Out)?;
    doc.clear();
    Ok(())
}

/// An int32 or int64 column's reader and the values of its last batch.
enum IdValues {
    I32(parquet::column::reader::ColumnReaderImpl<parquet::data_type::Int32Type>, Vec<i32>),
    I64(parquet::column::reader::ColumnReaderImpl<parquet::data_type::Int64Type>, Vec<i64>),
}

impl IdValues {
    fn of(reader: ColumnReader) -> std::result::Result<Self, RowError> {
        match reader {
            ColumnReader::Int32ColumnReader(r) => Ok(IdValues::I32(r, Vec::new())),
            ColumnReader::Int64ColumnReader(r) => Ok(IdValues::I64(r, Vec::new())),
            _ => Err(RowError::Reader("not an integer column".into())),
        }
    }

    /// The next batch of rows: their levels into `defs`/`reps`, their values kept; the rows read.
    fn read(&mut self, defs: &mut Vec<i16>, reps: &mut Vec<i16>) -> std::result::Result<usize, RowError> {
        let got = match self {
            IdValues::I32(r, v) => {
                v.clear();
                r.read_records(BATCH_ROWS, Some(defs), Some(reps), v)
            }
            IdValues::I64(r, v) => {
                v.clear();
                r.read_records(BATCH_ROWS, Some(defs), Some(reps), v)
            }
        };
        got.map(|(records, _, _)| records).map_err(|e| RowError::Reader(e.to_string()))
    }

    fn get(&self, i: usize) -> Option<i64> {
        match self {
            IdValues::I32(_, v) => v.get(i).map(|&x| x as i64),
            IdValues::I64(_, v) => v.get(i).copied(),
        }
    }
}

fn open(path: &Path) -> Result<SerializedFileReader<File>> {
    let file = File::open(path).map_err(|e| ModelError::Data { path: path.to_path_buf(), reason: format!("cannot open: {e}") })?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    SerializedFileReader::new(file).map_err(|e| ModelError::Data {
        path: path.to_path_buf(),
        reason: format!("not a Parquet file its reader accepts (footer at bytes {}..{len}): {e}", len.saturating_sub(8)),
    })
}

/// `name`'s leaf column in `reader`'s schema and what it holds; an error lists the columns
/// there are when it is missing, and says why when it is not text or a list of integers.
fn column_of(path: &Path, reader: &SerializedFileReader<File>, name: &str) -> Result<Column> {
    let schema = reader.metadata().file_metadata().schema_descr();
    let leaves: Vec<usize> =
        (0..schema.num_columns()).filter(|&i| schema.column(i).path().parts().first().map(String::as_str) == Some(name)).collect();
    let bad = |why: String| ModelError::Data { path: path.to_path_buf(), reason: why };
    let index = match leaves[..] {
        [i] => i,
        [] => return Err(bad(format!("no column `{name}` (it has {})", top_level_names(reader).join(", ")))),
        _ => return Err(bad(format!("column `{name}` is a structure of {} columns, not text or token ids", leaves.len()))),
    };
    let descr = schema.column(index);
    use parquet::basic::Type as Physical;
    let kind = match (descr.physical_type(), descr.max_rep_level()) {
        (Physical::BYTE_ARRAY, 0) => ColumnKind::Text,
        (Physical::INT32 | Physical::INT64, 1) => ColumnKind::TokenIds,
        (t, reps) => {
            return Err(bad(format!(
                "column `{name}` is {t}{}: expected text (a string a row) or token ids (a list of int32 or int64 a row)",
                if reps > 0 { format!(" nested {reps} deep") } else { String::new() }
            )))
        }
    };
    Ok(Column { index, kind, descr })
}

fn top_level_names(reader: &SerializedFileReader<File>) -> Vec<String> {
    let schema = reader.metadata().file_metadata().schema_descr();
    let mut names: Vec<String> = Vec::new();
    for i in 0..schema.num_columns() {
        if let Some(n) = schema.column(i).path().parts().first() {
            if !names.contains(n) {
                names.push(n.clone());
            }
        }
    }
    names
}

/// `column` (None: the default one) of the Parquet file `path`, named, and what it holds: the
/// file's footer read once.
pub(super) fn named_column(path: &Path, column: Option<&str>) -> Result<(String, ColumnKind)> {
    let reader = open(path)?;
    let name = match column {
        Some(c) => c.to_string(),
        None => super::default_column(path, &top_level_names(&reader))?,
    };
    let kind = column_of(path, &reader, &name)?.kind;
    Ok((name, kind))
}

#[cfg(test)]
mod tests {
    use super::super::testing::{self, scratch};
    use super::super::token_cache;
    use super::*;
    use crate::data::DataSource;

    pub(super) fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/parquet").join(name)
    }

    fn documents(path: &Path, column: &str) -> Result<(Vec<Vec<u32>>, TableRead)> {
        testing::documents(TableFormat::Parquet, path, column)
    }

    /// Every fixture pyarrow wrote (`make.py`: snappy and zstd, dictionary and plain, pages v1
    /// and v2, strings and large strings, lists of int32 and large lists of int64, nulls, empty
    /// rows, several row groups) reads as pyarrow read it back (`expected.json`).
    #[test]
    fn files_pyarrow_wrote_read_as_pyarrow_reads_them() {
        let expected: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap();
        for (name, column) in [
            ("text.parquet", "text"),
            ("large_text_zstd.parquet", "content"),
            ("ids_int32.parquet", "input_ids"),
            ("ids_int64.parquet", "tokens"),
        ] {
            let e = &expected[name];
            let rows = e["columns"][column].as_array().unwrap();
            let (docs, read) = documents(&fixture(name), column).unwrap();
            assert_eq!(read.chunks as u64, e["row_groups"].as_u64().unwrap(), "{name}");
            assert_eq!(read.rows, e["rows"].as_u64().unwrap(), "{name}");
            // (A null list is an empty document here.)
            let want = testing::expected_documents(rows, Some(vec![]));
            assert_eq!(read.null_rows, rows.iter().filter(|r| r.is_null()).count() as u64 * u64::from(want.len() < rows.len()), "{name}");
            assert_eq!(docs, want, "{name}");
            assert_eq!(read.tokens, want.iter().map(|d| d.len() as u64).sum::<u64>(), "{name}");
        }
    }

    #[test]
    fn the_default_column_is_text_then_input_ids_then_tokens() {
        assert_eq!(named_column(&fixture("text.parquet"), None).unwrap().0, "text");
        assert_eq!(named_column(&fixture("ids_int32.parquet"), None).unwrap().0, "input_ids");
        assert_eq!(named_column(&fixture("ids_int64.parquet"), None).unwrap().0, "tokens");
        let e = named_column(&fixture("large_text_zstd.parquet"), None).unwrap_err().to_string();
        assert!(e.contains("none of the columns text, input_ids, tokens (it has content)") && e.contains("--data-column"), "{e}");
        assert_eq!(named_column(&fixture("ids_int64.parquet"), None).unwrap().1, ColumnKind::TokenIds);
    }

    /// The cache is made once, read back as the same tokens, found again without reading the
    /// file, and made anew when the file changes; byte-tokenized, a text column gives the
    /// tokens the same documents give as JSON lines.
    #[test]
    fn the_token_cache_is_made_once_and_matches_json_lines() {
        let dir = scratch("parquet-cache");
        let data = dir.join("train.parquet");
        std::fs::copy(fixture("text.parquet"), &data).unwrap();
        let cache = dir.join("cache");
        let (prefix, made) = token_cache(TableFormat::Parquet, std::slice::from_ref(&data), None, &TextTokenizer::Bytes, &cache).unwrap();
        assert_eq!(made.unwrap().rows, 7);
        let (again, made) = token_cache(TableFormat::Parquet, std::slice::from_ref(&data), None, &TextTokenizer::Bytes, &cache).unwrap();
        assert_eq!((again.clone(), made), (prefix.clone(), None), "the second open finds the cache");
        let source =
            DataSource::Parquet(crate::data::TableFiles { cache: Some(cache.clone()), ..crate::data::TableFiles::of(vec![data.clone()]) });
        let tokens = source.load(256).unwrap();
        let expected: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap();
        let jsonl: String = expected["text.parquet"]["columns"]["text"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|t| t.as_str())
            .map(|t| serde_json::json!({ "text": t }).to_string() + "\n")
            .collect();
        std::fs::write(dir.join("train.jsonl"), jsonl).unwrap();
        assert_eq!(tokens, DataSource::JsonLines { path: dir.join("train.jsonl") }.load(256).unwrap());
        // A changed file (another length) is read again, into a cache of its own.
        std::fs::copy(fixture("large_text_zstd.parquet"), &data).unwrap();
        let (other, made) =
            token_cache(TableFormat::Parquet, std::slice::from_ref(&data), Some("content"), &TextTokenizer::Bytes, &cache).unwrap();
        assert!(other != prefix && made.is_some());
        let leftovers: Vec<_> = std::fs::read_dir(&cache)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains("partial"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn what_is_not_a_document_is_refused_naming_the_file_and_row() {
        let e = documents(&fixture("ids_null_element.parquet"), "input_ids").unwrap_err().to_string();
        assert!(e.contains("ids_null_element.parquet") && e.contains("row 1 (row group 0): a null inside the list"), "{e}");
        let e = documents(&fixture("ids_negative.parquet"), "input_ids").unwrap_err().to_string();
        assert!(e.contains("row 1 (row group 0): token id -5 is not in 0..2^31"), "{e}");
        let e = documents(&fixture("text.parquet"), "nope").unwrap_err().to_string();
        assert!(e.contains("no column `nope` (it has id, text)"), "{e}");
        let e = documents(&fixture("text.parquet"), "id").unwrap_err().to_string();
        assert!(e.contains("column `id` is INT64: expected text"), "{e}");
        let e = read_rows(
            &[fixture("ids_int32.parquet")],
            "input_ids",
            &TextTokenizer::Hf(Box::new(tokenizers::Tokenizer::new(tokenizers::models::bpe::BPE::default()))),
            |_| Ok(()),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("token ids already: it takes no tokenizer"), "{e}");
    }

    /// A truncated file, and one whose column chunk's bytes are damaged, are errors naming the
    /// file and where; no cache is left behind.
    #[test]
    fn a_damaged_file_is_named_with_its_bytes_and_leaves_no_cache() {
        let dir = scratch("parquet-damaged");
        let good = std::fs::read(fixture("large_text_zstd.parquet")).unwrap();
        let cut = dir.join("cut.parquet");
        std::fs::write(&cut, &good[..good.len() - 20]).unwrap();
        let e = documents(&cut, "content").unwrap_err().to_string();
        assert!(e.contains("cut.parquet") && e.contains("not a Parquet file") && e.contains("footer at bytes"), "{e}");
        // Scribble over the first row group's column chunk (after its page header).
        let reader = open(&fixture("large_text_zstd.parquet")).unwrap();
        let (start, len) = reader.metadata().row_group(0).column(0).byte_range();
        let mut bad = good.clone();
        for b in &mut bad[start as usize + 16..(start + len) as usize] {
            *b = 0xA5;
        }
        let damaged = dir.join("damaged.parquet");
        std::fs::write(&damaged, &bad).unwrap();
        let e = documents(&damaged, "content").unwrap_err().to_string();
        assert!(
            e.contains("damaged.parquet") && e.contains(&format!("row group 0 (column `content`, bytes {start}..{})", start + len)),
            "{e}"
        );
        let cache = dir.join("cache");
        assert!(token_cache(TableFormat::Parquet, &[damaged], Some("content"), &TextTokenizer::Bytes, &cache).is_err());
        let left: Vec<_> = std::fs::read_dir(&cache).unwrap().filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
        assert!(left.iter().all(|n| n.to_string_lossy().ends_with(".lock")), "nothing but the lock is left: {left:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Bytes damaged anywhere in the files pyarrow wrote (6,000 seeded damages of 1–4 bytes:
    /// footers, page headers, pages) are errors or, where the damage changes nothing that is
    /// read, the rows — never a panic.
    #[test]
    fn damage_anywhere_is_an_error_never_a_panic() {
        let files = [
            ("text.parquet", "text"),
            ("large_text_zstd.parquet", "content"),
            ("ids_int32.parquet", "input_ids"),
            ("ids_int64.parquet", "tokens"),
        ];
        let errors = testing::damages_found(TableFormat::Parquet, &files.map(|(f, c)| (fixture(f), c)));
        assert!(errors > 3000, "most damage is found: {errors} of 6000");
    }
}
