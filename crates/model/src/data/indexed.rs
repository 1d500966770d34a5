//! Megatron-LM's indexed datasets: `PREFIX.bin` (the tokens of every sequence, one after
//! another) and `PREFIX.idx` (what they are), the format Megatron's `preprocess_data.py` writes
//! and most large pre-training corpora are kept in. Read a window at a time with positioned
//! reads: what a run holds does not grow with the file.
//!
//! The index, little-endian:
//!
//! | bytes | what |
//! |---|---|
//! | 9 | magic `MMIDIDX\0\0` |
//! | 8 | version, 1 |
//! | 1 | token type: 1 u8, 3 i16, 4 i32, 5 i64, 8 u16 (6 and 7, floats, are not tokens) |
//! | 8 | S, sequences |
//! | 8 | D, document boundaries (documents + 1) |
//! | 4·S | each sequence's length in tokens (i32) |
//! | 8·S | each sequence's byte offset in `.bin` (i64) |
//! | 8·D | the first sequence of each document, then S (i64) |
//!
//! The sequences are read as one stream of tokens, in order: a training window may span two
//! (the preprocessing ends each document with its end-of-document token). Megatron's builder
//! writes them back to back; an index whose offsets leave gaps or overlap is refused, as is a
//! `.bin` of another size than the index says.

use std::fs::File;
use std::io::{BufReader, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{ModelError, Result};

/// The first bytes of every index.
pub const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
const HEADER_BYTES: u64 = 9 + 8 + 1 + 8 + 8;

/// How the tokens are stored in `.bin`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    U8,
    I16,
    I32,
    I64,
    U16,
}

impl TokenType {
    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => TokenType::U8,
            3 => TokenType::I16,
            4 => TokenType::I32,
            5 => TokenType::I64,
            8 => TokenType::U16,
            _ => return None,
        })
    }

    pub fn code(self) -> u8 {
        match self {
            TokenType::U8 => 1,
            TokenType::I16 => 3,
            TokenType::I32 => 4,
            TokenType::I64 => 5,
            TokenType::U16 => 8,
        }
    }

    /// Bytes a token.
    pub fn size(self) -> usize {
        match self {
            TokenType::U8 => 1,
            TokenType::I16 | TokenType::U16 => 2,
            TokenType::I32 => 4,
            TokenType::I64 => 8,
        }
    }

    fn decode(self, b: &[u8]) -> i64 {
        match self {
            TokenType::U8 => b[0] as i64,
            TokenType::I16 => i16::from_le_bytes([b[0], b[1]]) as i64,
            TokenType::U16 => u16::from_le_bytes([b[0], b[1]]) as i64,
            TokenType::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
            TokenType::I64 => i64::from_le_bytes(b.try_into().expect("8 bytes")),
        }
    }

    fn encode(self, t: u32, out: &mut Vec<u8>) {
        match self {
            TokenType::U8 => out.push(t as u8),
            TokenType::I16 => out.extend_from_slice(&(t as i16).to_le_bytes()),
            TokenType::U16 => out.extend_from_slice(&(t as u16).to_le_bytes()),
            TokenType::I32 => out.extend_from_slice(&(t as i32).to_le_bytes()),
            TokenType::I64 => out.extend_from_slice(&(t as i64).to_le_bytes()),
        }
    }

    /// The largest token id this type holds.
    fn max(self) -> u64 {
        match self {
            TokenType::U8 => u8::MAX as u64,
            TokenType::I16 => i16::MAX as u64,
            TokenType::U16 => u16::MAX as u64,
            TokenType::I32 | TokenType::I64 => i32::MAX as u64,
        }
    }
}

/// One indexed dataset, its index checked: its tokens are the first `tokens × size` bytes of
/// `.bin`, read on demand.
#[derive(Debug)]
pub struct IndexedFile {
    bin: File,
    bin_path: PathBuf,
    token_type: TokenType,
    tokens: u64,
    documents: u64,
}

/// `PREFIX.bin` and `PREFIX.idx`; a prefix given with either extension is taken without it.
pub fn prefix_paths(prefix: &Path) -> (PathBuf, PathBuf) {
    let stem = match prefix.extension().and_then(|e| e.to_str()) {
        Some("bin" | "idx") => prefix.with_extension(""),
        _ => prefix.to_path_buf(),
    };
    let with = |ext: &str| {
        let mut s = stem.clone().into_os_string();
        s.push(ext);
        PathBuf::from(s)
    };
    (with(".bin"), with(".idx"))
}

impl IndexedFile {
    /// Open `PREFIX.bin`/`.idx` and check the index from end to end (one pass, nothing kept but
    /// counts): a malformed index is refused naming the byte where it goes wrong.
    pub fn open(prefix: &Path) -> Result<Self> {
        let (bin_path, idx_path) = prefix_paths(prefix);
        let bad = |at: u64, why: String| ModelError::Data { path: idx_path.clone(), reason: format!("byte {at}: {why}") };
        let idx = File::open(&idx_path).map_err(|e| ModelError::Data { path: idx_path.clone(), reason: format!("cannot open: {e}") })?;
        let idx_len = idx.metadata().map_err(|e| ModelError::Data { path: idx_path.clone(), reason: e.to_string() })?.len();
        let mut r = BufReader::with_capacity(1 << 16, idx);
        let mut at = 0u64;
        let mut take = |n: usize, at: &mut u64| -> Result<[u8; 9]> {
            let mut b = [0u8; 9];
            r.read_exact(&mut b[..n]).map_err(|e| bad(*at, format!("the index ends early ({e})")))?;
            *at += n as u64;
            Ok(b)
        };
        if &take(9, &mut at)? != MAGIC {
            return Err(bad(0, "not a Megatron index (no MMIDIDX magic)".into()));
        }
        let version = u64::from_le_bytes(take(8, &mut at)?[..8].try_into().expect("8"));
        if version != 1 {
            return Err(bad(9, format!("version {version}, only 1 is known")));
        }
        let code = take(1, &mut at)?[0];
        let token_type = TokenType::from_code(code)
            .ok_or_else(|| bad(17, format!("token type {code} (expected 1 u8, 3 i16, 4 i32, 5 i64 or 8 u16)")))?;
        let sequences = u64::from_le_bytes(take(8, &mut at)?[..8].try_into().expect("8"));
        let bounds = u64::from_le_bytes(take(8, &mut at)?[..8].try_into().expect("8"));
        // The size the counts imply, checked before any of them is trusted.
        let want = sequences
            .checked_mul(12)
            .and_then(|s| bounds.checked_mul(8).and_then(|d| s.checked_add(d)))
            .and_then(|x| x.checked_add(HEADER_BYTES));
        if want != Some(idx_len) {
            return Err(bad(
                18,
                format!(
                    "{sequences} sequences and {bounds} document boundaries need {} bytes; the index has {idx_len}",
                    want.map_or("more than 2^64".into(), |w| w.to_string())
                ),
            ));
        }
        let mut tokens = 0u64;
        for i in 0..sequences {
            let len = i32::from_le_bytes(take(4, &mut at)?[..4].try_into().expect("4"));
            if len < 0 {
                return Err(bad(at - 4, format!("sequence {i} has length {len}")));
            }
            tokens = tokens.saturating_add(len as u64);
        }
        // Offsets back to back: each sequence starts where the one before ended.
        let size = token_type.size() as u64;
        let mut expected = 0u64;
        let mut lengths = BufReader::new(File::open(&idx_path).map_err(|e| bad(HEADER_BYTES, e.to_string()))?);
        std::io::copy(&mut (&mut lengths).take(HEADER_BYTES), &mut std::io::sink()).map_err(|e| bad(HEADER_BYTES, e.to_string()))?;
        for i in 0..sequences {
            let pointer = i64::from_le_bytes(take(8, &mut at)?[..8].try_into().expect("8"));
            if pointer < 0 || pointer as u64 != expected {
                return Err(bad(
                    at - 8,
                    format!("sequence {i} starts at byte {pointer} of the data; sequences must lie back to back (expected {expected})"),
                ));
            }
            let mut l = [0u8; 4];
            lengths.read_exact(&mut l).map_err(|e| bad(HEADER_BYTES + 4 * i, e.to_string()))?;
            expected = expected.saturating_add(i32::from_le_bytes(l).max(0) as u64 * size);
        }
        let mut last = 0i64;
        for j in 0..bounds {
            let d = i64::from_le_bytes(take(8, &mut at)?[..8].try_into().expect("8"));
            if d < last || d as u64 > sequences || (j == 0 && d != 0) {
                return Err(bad(at - 8, format!("document boundary {j} is sequence {d} (boundaries rise from 0 to {sequences})")));
            }
            last = d;
        }
        if bounds > 0 && last as u64 != sequences {
            return Err(bad(at - 8, format!("the last document boundary is sequence {last}, not {sequences}")));
        }
        let bin = File::open(&bin_path).map_err(|e| ModelError::Data { path: bin_path.clone(), reason: format!("cannot open: {e}") })?;
        let bin_len = bin.metadata().map_err(|e| ModelError::Data { path: bin_path.clone(), reason: e.to_string() })?.len();
        if tokens.checked_mul(size) != Some(bin_len) {
            return Err(ModelError::Data {
                path: bin_path,
                reason: format!("{bin_len} bytes, but its index lists {tokens} tokens of {size} bytes"),
            });
        }
        Ok(IndexedFile { bin, bin_path, token_type, tokens, documents: bounds.saturating_sub(1) })
    }

    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    pub fn documents(&self) -> u64 {
        self.documents
    }

    pub fn bin_path(&self) -> &Path {
        &self.bin_path
    }

    /// Tokens `start .. start + out.len()` of the stream into `out`, each checked below `vocab`
    /// (a token outside is an error naming its position).
    pub fn read(&self, start: u64, out: &mut [u32], vocab: usize) -> Result<()> {
        let size = self.token_type.size();
        let end = start.checked_add(out.len() as u64).filter(|&e| e <= self.tokens).ok_or_else(|| ModelError::Data {
            path: self.bin_path.clone(),
            reason: format!("tokens {start}..+{} are past its {} tokens", out.len(), self.tokens),
        })?;
        let mut bytes = vec![0u8; out.len() * size];
        self.bin
            .read_exact_at(&mut bytes, start * size as u64)
            .map_err(|e| ModelError::Data { path: self.bin_path.clone(), reason: format!("reading tokens {start}..{end}: {e}") })?;
        for (k, (t, b)) in out.iter_mut().zip(bytes.chunks_exact(size)).enumerate() {
            let v = self.token_type.decode(b);
            if v < 0 || v as u64 >= vocab as u64 {
                return Err(ModelError::Data {
                    path: self.bin_path.clone(),
                    reason: format!(
                        "token {v} at token {} (byte {}) is outside the vocabulary of {vocab}",
                        start + k as u64,
                        (start + k as u64) * size as u64
                    ),
                });
            }
            *t = v as u32;
        }
        Ok(())
    }
}

/// An indexed dataset written a document at a time: the tokens go to `.bin` as they come, each
/// document's length to a scratch file beside it, and [`IndexedWriter::finish`] writes `.idx`
/// from that file — what the writer holds does not grow with the data (a Parquet dataset of
/// millions of rows is converted this way).
pub struct IndexedWriter {
    bin: std::io::BufWriter<File>,
    lengths: std::io::BufWriter<File>,
    bin_path: PathBuf,
    idx_path: PathBuf,
    lengths_path: PathBuf,
    token_type: TokenType,
    documents: u64,
    buf: Vec<u8>,
}

impl IndexedWriter {
    /// A dataset at `prefix` (`.bin`, `.idx`; and `.lengths` while it is written).
    pub fn create(prefix: &Path, token_type: TokenType) -> Result<Self> {
        let (bin_path, idx_path) = prefix_paths(prefix);
        let lengths_path = bin_path.with_extension("lengths");
        let create = |path: &Path| {
            File::create(path)
                .map(std::io::BufWriter::new)
                .map_err(|e| ModelError::Data { path: path.to_path_buf(), reason: format!("cannot create: {e}") })
        };
        Ok(IndexedWriter {
            bin: create(&bin_path)?,
            lengths: create(&lengths_path)?,
            bin_path,
            idx_path,
            lengths_path,
            token_type,
            documents: 0,
            buf: Vec::new(),
        })
    }

    /// `document` as the next sequence (one a document). A token the type cannot hold, or a
    /// document past an index entry's 2^31 tokens, is an error.
    pub fn push(&mut self, document: &[u32]) -> Result<()> {
        let len = i32::try_from(document.len()).map_err(|_| ModelError::Data {
            path: self.bin_path.clone(),
            reason: format!("document {} has {} tokens; an index entry holds at most 2^31", self.documents, document.len()),
        })?;
        self.buf.clear();
        for &t in document {
            if t as u64 > self.token_type.max() {
                return Err(ModelError::Data {
                    path: self.bin_path.clone(),
                    reason: format!("token {t} does not fit a {:?}", self.token_type),
                });
            }
            self.token_type.encode(t, &mut self.buf);
        }
        let io = |path: &Path, e: std::io::Error| ModelError::Data { path: path.to_path_buf(), reason: e.to_string() };
        self.bin.write_all(&self.buf).map_err(|e| io(&self.bin_path, e))?;
        self.lengths.write_all(&len.to_le_bytes()).map_err(|e| io(&self.lengths_path, e))?;
        self.documents += 1;
        Ok(())
    }

    /// `.bin` flushed and `.idx` written (the lengths, each document's offset, the document
    /// boundaries), read back from the scratch file in one pass each; the scratch file removed.
    pub fn finish(self) -> Result<()> {
        let IndexedWriter { bin, lengths, bin_path, idx_path, lengths_path, token_type, documents, .. } = self;
        let io = |path: &Path, e: std::io::Error| ModelError::Data { path: path.to_path_buf(), reason: e.to_string() };
        bin.into_inner().map_err(|e| io(&bin_path, e.into_error()))?.sync_all().map_err(|e| io(&bin_path, e))?;
        lengths.into_inner().map_err(|e| io(&lengths_path, e.into_error()))?;
        let mut idx = std::io::BufWriter::new(File::create(&idx_path).map_err(|e| io(&idx_path, e))?);
        let mut put = |b: &[u8]| idx.write_all(b).map_err(|e| io(&idx_path, e));
        put(MAGIC)?;
        put(&1u64.to_le_bytes())?;
        put(&[token_type.code()])?;
        put(&documents.to_le_bytes())?;
        put(&(documents + 1).to_le_bytes())?;
        let each_length = |f: &mut dyn FnMut(i32) -> Result<()>| -> Result<()> {
            let mut r = BufReader::new(File::open(&lengths_path).map_err(|e| io(&lengths_path, e))?);
            let mut l = [0u8; 4];
            for _ in 0..documents {
                r.read_exact(&mut l).map_err(|e| io(&lengths_path, e))?;
                f(i32::from_le_bytes(l))?;
            }
            Ok(())
        };
        each_length(&mut |len| put(&len.to_le_bytes()))?;
        let mut pointer = 0i64;
        each_length(&mut |len| {
            put(&pointer.to_le_bytes())?;
            pointer += len as i64 * token_type.size() as i64;
            Ok(())
        })?;
        for j in 0..=documents as i64 {
            put(&j.to_le_bytes())?;
        }
        idx.into_inner().map_err(|e| io(&idx_path, e.into_error()))?.sync_all().map_err(|e| io(&idx_path, e))?;
        let _ = std::fs::remove_file(&lengths_path);
        Ok(())
    }
}

/// Write `documents` as an indexed dataset at `prefix` (`.bin` and `.idx`), one sequence a
/// document, as Megatron's builder does. For tests and for converting token files.
pub fn write_indexed(prefix: &Path, documents: &[Vec<u32>], token_type: TokenType) -> Result<()> {
    let mut writer = IndexedWriter::create(prefix, token_type)?;
    documents.iter().try_for_each(|d| writer.push(d))?;
    writer.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lazarus-indexed-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn what_is_written_reads_back_as_one_stream_of_tokens() {
        let d = dir("roundtrip");
        let docs = vec![vec![1, 2, 3], vec![], vec![4, 5], vec![6]];
        for ty in [TokenType::U8, TokenType::I16, TokenType::U16, TokenType::I32, TokenType::I64] {
            let prefix = d.join(format!("{ty:?}"));
            write_indexed(&prefix, &docs, ty).unwrap();
            // Named by its prefix or by either file.
            for name in [prefix.clone(), prefix.with_extension("bin"), prefix.with_extension("idx")] {
                let f = IndexedFile::open(&name).unwrap();
                assert_eq!((f.tokens(), f.documents()), (6, 4));
                let mut out = vec![0; 4];
                f.read(1, &mut out, 7).unwrap();
                assert_eq!(out, [2, 3, 4, 5], "{ty:?}");
                let e = f.read(1, &mut out, 5).unwrap_err().to_string();
                assert!(e.contains("token 5 at token 4") && e.contains("vocabulary of 5"), "{e}");
                assert!(f.read(3, &mut out, 7).unwrap_err().to_string().contains("past its 6 tokens"));
            }
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn the_streaming_writer_writes_what_the_whole_writer_does() {
        let d = dir("writer");
        let docs = vec![vec![1, 2, 3], vec![], vec![40_000, 5], vec![6]];
        write_indexed(&d.join("whole"), &docs, TokenType::U16).unwrap();
        let mut w = IndexedWriter::create(&d.join("streamed"), TokenType::U16).unwrap();
        docs.iter().for_each(|doc| w.push(doc).unwrap());
        w.finish().unwrap();
        for ext in ["bin", "idx"] {
            assert_eq!(std::fs::read(d.join(format!("whole.{ext}"))).unwrap(), std::fs::read(d.join(format!("streamed.{ext}"))).unwrap());
        }
        assert!(!d.join("streamed.lengths").exists(), "the scratch file is removed");
        let mut w = IndexedWriter::create(&d.join("small"), TokenType::U8).unwrap();
        assert!(w.push(&[300]).unwrap_err().to_string().contains("token 300 does not fit a U8"));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_malformed_index_is_refused_naming_the_byte() {
        let d = dir("malformed");
        let prefix = d.join("c");
        write_indexed(&prefix, &[vec![1, 2, 3], vec![4, 5]], TokenType::U16).unwrap();
        let (bin, idx) = prefix_paths(&prefix);
        let good = std::fs::read(&idx).unwrap();
        let open = |bytes: &[u8]| {
            std::fs::write(&idx, bytes).unwrap();
            IndexedFile::open(&prefix).unwrap_err().to_string()
        };
        let mut b = good.clone();
        b[0] = b'X';
        assert!(open(&b).contains("byte 0: not a Megatron index"));
        let mut b = good.clone();
        b[9] = 2;
        assert!(open(&b).contains("byte 9: version 2"));
        let mut b = good.clone();
        b[17] = 7;
        assert!(open(&b).contains("byte 17: token type 7"));
        let mut b = good.clone();
        b[18] = 200;
        assert!(open(&b).contains("byte 18: 200 sequences"), "{}", open(&b));
        assert!(open(&good[..good.len() - 1]).contains("need"));
        // The second sequence's length made negative (bytes 38..42).
        let mut b = good.clone();
        b[38..42].copy_from_slice(&(-1i32).to_le_bytes());
        assert!(open(&b).contains("byte 38: sequence 1 has length -1"), "{}", open(&b));
        // The second sequence's offset leaves a gap (bytes 50..58).
        let mut b = good.clone();
        b[50..58].copy_from_slice(&8i64.to_le_bytes());
        assert!(open(&b).contains("byte 50: sequence 1 starts at byte 8") && open(&b).contains("expected 6"), "{}", open(&b));
        // Document boundaries that fall (bytes 66..74 is the second of three).
        let mut b = good.clone();
        b[66..74].copy_from_slice(&5i64.to_le_bytes());
        assert!(open(&b).contains("byte 66: document boundary 1 is sequence 5"), "{}", open(&b));
        // The data shorter than the index says.
        std::fs::write(&idx, &good).unwrap();
        std::fs::write(&bin, [0u8; 4]).unwrap();
        let e = IndexedFile::open(&prefix).unwrap_err().to_string();
        assert!(e.contains("4 bytes, but its index lists 5 tokens of 2 bytes"), "{e}");
        std::fs::remove_file(&bin).unwrap();
        assert!(IndexedFile::open(&prefix).unwrap_err().to_string().contains("cannot open"));
        let _ = std::fs::remove_dir_all(&d);
    }
}
