//! Text to tokens: bytes (the default: a vocabulary of 256), or a Hugging Face tokenizer
//! (`tokenizer.json`, read by the `tokenizers` crate) whose vocabulary then sizes the model's.
//! [`train_bpe`] makes a byte-level BPE tokenizer from text, so that a run needs nothing
//! downloaded.

use std::path::Path;

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper, Tokenizer, TokenizerBuilder};

use crate::data::ByteTokenizer;
use crate::error::{ModelError, Result};

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
        let bytes = crate::data::read_bounded(path, MAX_TOKENIZER_BYTES)?;
        let t = Tokenizer::from_bytes(&bytes)
            .map_err(|e| ModelError::Data { path: path.to_path_buf(), reason: format!("not a Hugging Face tokenizer.json ({e})") })?;
        Ok(TextTokenizer::Hf(Box::new(t)))
    }

    /// Its vocabulary's size (added tokens included).
    pub fn vocab_size(&self) -> usize {
        match self {
            TextTokenizer::Bytes => ByteTokenizer::VOCAB,
            TextTokenizer::Hf(t) => t.get_vocab_size(true),
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            TextTokenizer::Bytes => Ok(ByteTokenizer::encode(text)),
            TextTokenizer::Hf(t) => Ok(t
                .encode(text, false)
                .map_err(|e| ModelError::Data { path: "tokenizer".into(), reason: format!("cannot encode the text ({e})") })?
                .get_ids()
                .to_vec()),
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
    let files: Vec<String> = texts.iter().map(|p| p.display().to_string()).collect();
    t.train_from_files(&mut trainer, files).map_err(failed)?;
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
        let junk = dir.join("junk.json");
        std::fs::write(&junk, "{}").unwrap();
        assert!(TextTokenizer::open(Some(&junk)).err().unwrap().to_string().contains("not a Hugging Face tokenizer.json"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
