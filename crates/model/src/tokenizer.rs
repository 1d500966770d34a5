//! Text to tokens: bytes (the default: a vocabulary of 256), or a Hugging Face tokenizer
//! (`tokenizer.json`, read by the `tokenizers` crate) whose vocabulary then sizes the model's.
//! [`train_bpe`] makes a byte-level BPE tokenizer from text, so that a run needs nothing
//! downloaded.

use std::path::Path;

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper, Tokenizer, TokenizerBuilder};

use crate::error::{ModelError, Result};

/// Bytes are tokens: vocabulary 256, nothing to train or ship.
pub struct ByteTokenizer;

impl ByteTokenizer {
    pub const VOCAB: usize = 256;

    pub fn encode(text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    /// Lossy for token sequences that split a UTF-8 character.
    pub fn decode(tokens: &[u32]) -> String {
        let bytes: Vec<u8> = tokens.iter().map(|&t| t.min(255) as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Largest tokenizer file read.
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// How text becomes tokens.
pub enum TextTokenizer {
    Bytes,
    Hf(Box<Tokenizer>),
}

impl TextTokenizer {
    /// The tokenizer at `path` (None: bytes).
    pub fn open(path: Option<&Path>) -> Result<Self> {
        let Some(path) = path else { return Ok(TextTokenizer::Bytes) };
        let bytes = crate::files::read_bounded(path, MAX_TOKENIZER_BYTES)?;
        let t = Tokenizer::from_bytes(&bytes)
            .map_err(|e| ModelError::Data { path: path.to_path_buf(), reason: format!("not a Hugging Face tokenizer.json ({e})") })?;
        Ok(TextTokenizer::Hf(Box::new(t)))
    }

    /// What it is, as bytes: equal for tokenizers that tokenize alike (a token cache is named
    /// by it).
    pub fn identity(&self) -> Vec<u8> {
        match self {
            TextTokenizer::Bytes => b"bytes".to_vec(),
            TextTokenizer::Hf(t) => t.to_string(false).map_or_else(|e| format!("unserialisable: {e}").into_bytes(), String::into_bytes),
        }
    }

    /// Its vocabulary's size (added tokens included).
    pub fn vocab_size(&self) -> usize {
        match self {
            TextTokenizer::Bytes => ByteTokenizer::VOCAB,
            TextTokenizer::Hf(t) => t.get_vocab_size(true),
        }
    }

    /// The token ids of `text`, encoded in pieces of at most [`ENCODE_PIECE_BYTES`] cut where
    /// a run of whitespace begins: the `tokenizers` crate keeps offsets, type ids, masks and the
    /// token strings of every token while it encodes (over a hundred bytes a token), so a 50 MB
    /// document at once takes gigabytes. A byte-level BPE splits words at those places anyway,
    /// so the ids are the same as the whole text's.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            TextTokenizer::Bytes => Ok(ByteTokenizer::encode(text)),
            TextTokenizer::Hf(t) => {
                let mut ids = Vec::with_capacity(text.len() / 3);
                for piece in pieces(text, ENCODE_PIECE_BYTES) {
                    let e = t
                        .encode(piece, false)
                        .map_err(|e| ModelError::Data { path: "tokenizer".into(), reason: format!("cannot encode the text ({e})") })?;
                    ids.extend_from_slice(e.get_ids());
                }
                Ok(ids)
            }
        }
    }

    pub fn decode(&self, tokens: &[u32]) -> Result<String> {
        match self {
            TextTokenizer::Bytes => Ok(ByteTokenizer::decode(tokens)),
            TextTokenizer::Hf(t) => {
                t.decode(tokens, true).map_err(|e| ModelError::Data { path: "tokenizer".into(), reason: format!("cannot decode ({e})") })
            }
        }
    }
}

/// Longest piece of text handed to the `tokenizers` crate at once (to encode or to learn from).
pub const ENCODE_PIECE_BYTES: usize = 1 << 20;

/// `text` in consecutive pieces of at most `max` bytes (at least one character), each cut
/// before a run of whitespace (where a byte-level pre-tokenizer starts a new word), or — in a
/// stretch of `max` bytes without one — at a character boundary.
pub fn pieces(text: &str, max: usize) -> impl Iterator<Item = &str> {
    let max = max.max(4);
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let cut = if rest.len() <= max { rest.len() } else { cut_before_whitespace(rest, max) };
        let (piece, tail) = rest.split_at(cut);
        rest = tail;
        Some(piece)
    })
}

/// Where to cut `text` (longer than `max`): the last start of a whitespace run after byte 0 and
/// at most at `max`, else the last character boundary at most at `max` (at least one character).
fn cut_before_whitespace(text: &str, max: usize) -> usize {
    let bytes = text.as_bytes();
    let ws = |b: u8| b.is_ascii_whitespace();
    if let Some(i) = (1..=max).rev().find(|&i| ws(bytes[i]) && !ws(bytes[i - 1])) {
        return i;
    }
    let mut i = max;
    while !text.is_char_boundary(i) {
        i -= 1;
    }
    if i == 0 {
        text.chars().next().map_or(text.len(), char::len_utf8)
    } else {
        i
    }
}

/// A UTF-8 file's text in pieces of about `max` bytes, read a block at a time and cut before a
/// run of whitespace (as [`pieces`] cuts): never more than a few blocks of it in memory.
struct FilePieces {
    path: std::path::PathBuf,
    file: std::fs::File,
    max: usize,
    /// Read but not handed out: the tail after the last cut.
    carry: Vec<u8>,
    done: bool,
}

impl FilePieces {
    fn open(path: &Path, max: usize) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        Ok(FilePieces { path: path.to_path_buf(), file, max: max.max(4), carry: Vec::new(), done: false })
    }
}

impl Iterator for FilePieces {
    type Item = Result<String>;

    fn next(&mut self) -> Option<Result<String>> {
        use std::io::Read;
        while !self.done && self.carry.len() <= self.max {
            let at = self.carry.len();
            self.carry.resize(at + self.max, 0);
            match self.file.read(&mut self.carry[at..]) {
                Ok(0) => {
                    self.carry.truncate(at);
                    self.done = true;
                }
                Ok(n) => self.carry.truncate(at + n),
                Err(e) => {
                    self.done = true;
                    self.carry.clear();
                    return Some(Err(ModelError::io(&self.path, e)));
                }
            }
        }
        if self.carry.is_empty() {
            return None;
        }
        // A cut at a character boundary: the valid UTF-8 prefix, whole pieces of it.
        let valid = match std::str::from_utf8(&self.carry) {
            Ok(s) => s.len(),
            Err(e) if e.error_len().is_none() && !self.done => e.valid_up_to(),
            Err(e) => {
                self.done = true;
                self.carry.clear();
                let reason = format!("not valid UTF-8 (near byte {} of a piece)", e.valid_up_to());
                return Some(Err(ModelError::Data { path: self.path.clone(), reason }));
            }
        };
        let text = std::str::from_utf8(&self.carry[..valid]).expect("checked above");
        let cut = if text.len() <= self.max { text.len() } else { cut_before_whitespace(text, self.max) };
        let piece = text[..cut].to_string();
        self.carry.drain(..cut);
        Some(Ok(piece))
    }
}

/// A byte-level BPE tokenizer of `vocab` tokens learned from `texts`, written to `out` as a
/// Hugging Face `tokenizer.json`.
pub fn train_bpe(texts: &[&Path], vocab: usize, out: &Path) -> Result<usize> {
    if !(257..=1 << 20).contains(&vocab) {
        return Err(ModelError::config("vocab_size", vocab, "257 to 1048576 (the 256 bytes and merges)"));
    }
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let failed = |e: tokenizers::Error| ModelError::Data { path: out.to_path_buf(), reason: format!("training the tokenizer: {e}") };
    let mut t = TokenizerBuilder::<BPE, NormalizerWrapper, PreTokenizerWrapper, PostProcessorWrapper, DecoderWrapper>::new()
        .with_model(BPE::default())
        .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false).into()))
        .with_decoder(Some(ByteLevel::default().into()))
        .build()
        .map_err(failed)?;
    // Each file read and handed over in pieces, never a whole line at once: a document of
    // 50 MB on one line, handed over whole, takes the trainer gigabytes (it aligns every byte).
    let error: std::sync::Mutex<Option<ModelError>> = std::sync::Mutex::new(None);
    let sequences = texts.iter().flat_map(|path| {
        FilePieces::open(path, ENCODE_PIECE_BYTES).map_or_else(
            |e| {
                *error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                None
            },
            Some,
        )
    });
    let sequences = sequences.flatten().map_while(|piece| match piece {
        Ok(text) => Some(text),
        Err(e) => {
            *error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            None
        }
    });
    t.train(&mut trainer, sequences).map_err(failed)?;
    if let Some(e) = error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    t.save(out, false).map_err(failed)?;
    Ok(t.get_vocab_size(true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trained_tokenizer_round_trips_text_in_fewer_tokens_than_bytes() {
        let dir = std::env::temp_dir().join(format!("lazarus-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let corpus = dir.join("corpus.txt");
        std::fs::write(&corpus, crate::data::synthetic_corpus(0, 50_000)).unwrap();
        let out = dir.join("tokenizer.json");
        let vocab = train_bpe(&[&corpus], 400, &out).unwrap();
        assert!(vocab > 256 && vocab <= 400, "{vocab}");
        let t = TextTokenizer::open(Some(&out)).unwrap();
        assert_eq!(t.vocab_size(), vocab);
        let text = crate::data::synthetic_corpus(1, 2_000);
        let ids = t.encode(&text).unwrap();
        assert!(ids.len() < text.len() && ids.iter().all(|&i| (i as usize) < vocab), "{} ids for {} bytes", ids.len(), text.len());
        assert_eq!(t.decode(&ids).unwrap(), text);
        // Encoded in small pieces, the ids are the whole text's.
        let whole = match &t {
            TextTokenizer::Hf(h) => h.encode(text.as_str(), false).unwrap().get_ids().to_vec(),
            TextTokenizer::Bytes => unreachable!(),
        };
        assert_eq!(ids, whole);
        // Cut before whitespace (no word longer than a piece), the pieces encode as the whole.
        let prose = "the quick brown fox, jumps over  the lazy dog.\n\n  Numbers 12 345; don't stop\t(ok)\n".repeat(20);
        let whole = match &t {
            TextTokenizer::Hf(h) => h.encode(prose.as_str(), false).unwrap().get_ids().to_vec(),
            TextTokenizer::Bytes => unreachable!(),
        };
        let mut pieced = Vec::new();
        for p in pieces(&prose, 37) {
            pieced.extend(t.encode(p).unwrap());
        }
        assert_eq!(pieced, whole, "pieces of 37 bytes cut before whitespace encode as the whole");
        let junk = dir.join("junk.json");
        std::fs::write(&junk, "{}").unwrap();
        assert!(TextTokenizer::open(Some(&junk)).err().unwrap().to_string().contains("not a Hugging Face tokenizer.json"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A file read in blocks gives the same pieces' text as the whole, across multi-byte
    /// characters at block edges; bytes that are not UTF-8 are an error naming the file.
    #[test]
    fn a_file_in_pieces_is_its_text() {
        let dir = std::env::temp_dir().join(format!("lazarus-pieces-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.txt");
        let text = "élan vital über alles\n\tthe quick brown fox ".repeat(50) + &"x".repeat(100);
        std::fs::write(&path, &text).unwrap();
        for max in [4, 7, 16, 1000] {
            let parts: Vec<String> = FilePieces::open(&path, max).unwrap().map(|p| p.unwrap()).collect();
            assert_eq!(parts.concat(), text, "max {max}");
            assert!(parts.iter().all(|p| p.len() <= max + 3), "max {max}");
        }
        std::fs::write(&path, b"good text \xff\xfe bad").unwrap();
        let e = FilePieces::open(&path, 4).unwrap().find_map(|p| p.err()).unwrap().to_string();
        assert!(e.contains("t.txt") && e.contains("UTF-8"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    proptest::proptest! {
        /// The pieces are the text, in order, each at most `max` bytes (or one character), and
        /// every cut but a forced one falls where a run of whitespace begins.
        #[test]
        fn pieces_rebuild_the_text_within_their_bound(text in "[a-z é\n\t]{0,300}", max in 1usize..40) {
            let parts: Vec<&str> = pieces(&text, max).collect();
            proptest::prop_assert_eq!(parts.concat(), text.clone());
            for p in &parts {
                proptest::prop_assert!(!p.is_empty());
                proptest::prop_assert!(p.len() <= max.max(4) || p.chars().count() == 1, "{:?}", p);
            }
        }
    }
}
