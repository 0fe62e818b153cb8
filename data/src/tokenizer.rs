//! The tokenizers a run's text goes through: GPT-2's byte-level BPE
//! (`r50k_base`, the default, built once per process) or a Hugging Face
//! `tokenizer.json` (Llama-3's, Qwen's, Mistral's, or one trained with
//! the Python `tokenizers` library), shared by everything that tokenizes
//! or decodes: `weft data prepare`, text data, and `weft sample`.
//!
//! A [`Tokenizer`] knows its end-of-text token — the id appended after
//! every document — and the size of its id space (the largest id + 1, so
//! an embedding of that many rows covers every id, added tokens
//! included). A `tokenizer.json` is named by path and identified by the
//! xxh3-64 of its bytes: data prepared with it records that hash, so data
//! prepared with one tokenizer is never trained on or decoded with
//! another.
//!
//! A Hugging Face tokenizer encodes documents as the Python library does
//! with `tokenizer.encode_special_tokens = True` and
//! `tokenizer.encode(text, add_special_tokens=False)`: special tokens
//! spelled out inside a document's text are text, not separators (as
//! GPT-2's `encode_ordinary` treats `<|endoftext|>`), and no
//! post-processor tokens (BOS) are added — the end-of-text token between
//! documents is the only separator.
//!
//! ```
//! use weft_data::tokenizer::{Tokenizer, TokenizerSpec};
//!
//! let gpt2 = TokenizerSpec::Gpt2.load().unwrap();
//! assert_eq!(gpt2.encode("Hello world.").unwrap(), [15496, 995, 13]);
//! assert_eq!((gpt2.end_of_text(), gpt2.vocab_size()), (50256, 50257));
//! assert_eq!(gpt2.decode(&[15496, 995]), "Hello world");
//! ```

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::corpus::{END_OF_TEXT, GPT2_VOCAB};
use crate::error::{DataError, Result};

/// A byte-level BPE tokenizer (tiktoken's), as [`gpt2`] returns it.
pub use tiktoken_rs::CoreBPE;

/// The name of GPT-2's tokenizer wherever one is named (`--tokenizer`,
/// `data.tokenizer`, a prepared folder's index).
pub const GPT2: &str = "gpt2";

/// End-of-text tokens looked for, in this order, in a `tokenizer.json`
/// when none is named: GPT-2's and Qwen's, Llama-3's, Llama-2's and
/// Mistral's, Gemma's.
pub const END_OF_TEXT_CANDIDATES: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];

/// GPT-2's tokenizer, built on first use.
///
/// # Errors
/// [`DataError::Tokenizer`] if it cannot be built (its tables are
/// compiled in, so this does not happen in a working build).
pub fn gpt2() -> Result<&'static CoreBPE> {
    static BPE: OnceLock<std::result::Result<CoreBPE, String>> = OnceLock::new();
    BPE.get_or_init(|| tiktoken_rs::r50k_base().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| DataError::Tokenizer {
            path: PathBuf::from(GPT2),
            what: e.clone(),
        })
}

/// Which tokenizer to use, before it is loaded: what `--tokenizer` and
/// `--eot` (or `data.tokenizer` and `data.eot`) say.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum TokenizerSpec {
    /// GPT-2's byte-level BPE.
    #[default]
    Gpt2,
    /// A Hugging Face `tokenizer.json`.
    File {
        /// The file.
        path: PathBuf,
        /// The end-of-text token's text; `None` picks the first of
        /// [`END_OF_TEXT_CANDIDATES`] in the vocabulary.
        eot: Option<String>,
    },
}

impl TokenizerSpec {
    /// `"gpt2"` (GPT-2's BPE) or the path of a `tokenizer.json`, with an
    /// optional end-of-text token (for a `tokenizer.json` only).
    #[must_use]
    pub fn named(name: &str, eot: Option<&str>) -> Self {
        if name == GPT2 {
            TokenizerSpec::Gpt2
        } else {
            TokenizerSpec::File {
                path: PathBuf::from(name),
                eot: eot.map(str::to_owned),
            }
        }
    }

    /// Loads the tokenizer.
    ///
    /// # Errors
    /// [`DataError::Tokenizer`] naming the file: unreadable, not a
    /// `tokenizer.json` this build reads, or without the end-of-text
    /// token.
    pub fn load(&self) -> Result<Tokenizer> {
        match self {
            TokenizerSpec::Gpt2 => Tokenizer::gpt2(),
            TokenizerSpec::File { path, eot } => Tokenizer::from_file(path, eot.as_deref()),
        }
    }
}

/// A loaded tokenizer: GPT-2's BPE or a Hugging Face `tokenizer.json`.
#[derive(Clone)]
pub struct Tokenizer {
    kind: Kind,
    end_of_text: u32,
    vocab_size: usize,
}

#[derive(Clone)]
enum Kind {
    Gpt2(&'static CoreBPE),
    HuggingFace(Box<HuggingFace>),
}

#[derive(Clone)]
struct HuggingFace {
    /// Set to encode special tokens as text.
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    xxh3: u64,
    bytes: Vec<u8>,
    eot_token: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tokenizer({}, {} ids, end-of-text {})",
            self.describe(),
            self.vocab_size,
            self.end_of_text
        )
    }
}

fn bad(path: &Path, what: impl Into<String>) -> DataError {
    DataError::Tokenizer {
        path: path.to_owned(),
        what: what.into(),
    }
}

impl Tokenizer {
    /// GPT-2's BPE: end-of-text 50256, 50257 ids.
    ///
    /// # Errors
    /// As [`gpt2`].
    pub fn gpt2() -> Result<Self> {
        Ok(Self {
            kind: Kind::Gpt2(gpt2()?),
            end_of_text: END_OF_TEXT,
            vocab_size: GPT2_VOCAB,
        })
    }

    /// A Hugging Face `tokenizer.json`, with `eot` as its end-of-text
    /// token (`None`: the first of [`END_OF_TEXT_CANDIDATES`] it has).
    ///
    /// # Errors
    /// [`DataError::Tokenizer`] naming the file: unreadable, not a
    /// `tokenizer.json` this build reads (models BPE, WordPiece,
    /// WordLevel and Unigram; pre-tokenizer regexes run on the pure-Rust
    /// `fancy-regex`), an empty vocabulary, or no such end-of-text token.
    pub fn from_file(path: &Path, eot: Option<&str>) -> Result<Self> {
        let bytes = weft_trace::input::read(path, weft_trace::input::INDEX_BYTES)
            .map_err(|e| bad(path, format!("cannot read: {e}")))?;
        Self::from_bytes(path, bytes, eot)
    }

    /// As [`from_file`](Self::from_file), from the file's bytes (`path`
    /// names it in errors).
    ///
    /// # Errors
    /// As [`from_file`](Self::from_file).
    pub fn from_bytes(path: &Path, bytes: Vec<u8>, eot: Option<&str>) -> Result<Self> {
        let mut inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| bad(path, format!("not a tokenizer.json weft reads: {e}")))?;
        inner.set_encode_special_tokens(true);
        let vocab = inner.get_vocab(true);
        let Some(&max) = vocab.values().max() else {
            return Err(bad(path, "the vocabulary is empty"));
        };
        let (eot_token, end_of_text) = match eot {
            Some(t) => {
                let id = inner.token_to_id(t).ok_or_else(|| {
                    bad(
                        path,
                        format!("the end-of-text token {t:?} (--eot, data.eot) is not in its vocabulary"),
                    )
                })?;
                (t.to_owned(), id)
            }
            None => END_OF_TEXT_CANDIDATES
                .iter()
                .find_map(|t| inner.token_to_id(t).map(|id| ((*t).to_owned(), id)))
                .ok_or_else(|| {
                    bad(
                        path,
                        format!(
                            "none of the end-of-text tokens {} is in its vocabulary: name the token that ends a document with --eot TOKEN (data.eot)",
                            END_OF_TEXT_CANDIDATES.join(", ")
                        ),
                    )
                })?,
        };
        Ok(Self {
            kind: Kind::HuggingFace(Box::new(HuggingFace {
                inner,
                path: path.to_owned(),
                xxh3: xxhash_rust::xxh3::xxh3_64(&bytes),
                bytes,
                eot_token,
            })),
            end_of_text,
            vocab_size: max as usize + 1,
        })
    }

    /// The id appended after every document.
    #[must_use]
    pub fn end_of_text(&self) -> u32 {
        self.end_of_text
    }

    /// The end-of-text token's text.
    #[must_use]
    pub fn end_of_text_token(&self) -> &str {
        match &self.kind {
            Kind::Gpt2(_) => "<|endoftext|>",
            Kind::HuggingFace(h) => &h.eot_token,
        }
    }

    /// Size of the id space: the largest id + 1.
    #[must_use]
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// `"gpt2"`, or for a `tokenizer.json` the xxh3-64 of its bytes (16
    /// hex digits): what a prepared folder records.
    #[must_use]
    pub fn id(&self) -> String {
        match &self.kind {
            Kind::Gpt2(_) => GPT2.to_owned(),
            Kind::HuggingFace(h) => format!("{:016x}", h.xxh3),
        }
    }

    /// The `tokenizer.json` file and its bytes, for a Hugging Face
    /// tokenizer.
    #[must_use]
    pub fn file(&self) -> Option<(&Path, &[u8])> {
        match &self.kind {
            Kind::Gpt2(_) => None,
            Kind::HuggingFace(h) => Some((&h.path, &h.bytes)),
        }
    }

    /// A name for messages: `gpt2`, or the file with its hash.
    #[must_use]
    pub fn describe(&self) -> String {
        match &self.kind {
            Kind::Gpt2(_) => GPT2.to_owned(),
            Kind::HuggingFace(h) => format!("{} (xxh3 {:016x})", h.path.display(), h.xxh3),
        }
    }

    /// A document's ids, special tokens in the text encoded as text (see
    /// the module docs).
    ///
    /// # Errors
    /// [`DataError::Tokenizer`] if the Hugging Face tokenizer fails on the
    /// text (its model has no unknown token for a character it lacks).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.kind {
            Kind::Gpt2(bpe) => Ok(bpe.encode_ordinary(text)),
            Kind::HuggingFace(h) => h
                .inner
                .encode_fast(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| bad(&h.path, format!("cannot encode: {e}"))),
        }
    }

    /// A prompt's ids: special tokens spelled out in it (`<|endoftext|>`)
    /// are those tokens.
    ///
    /// # Errors
    /// As [`encode`](Self::encode).
    pub fn encode_with_special_tokens(&self, text: &str) -> Result<Vec<u32>> {
        match &self.kind {
            Kind::Gpt2(bpe) => Ok(bpe.encode_with_special_tokens(text)),
            Kind::HuggingFace(h) => {
                let mut t = h.inner.clone();
                t.set_encode_special_tokens(false);
                t.encode_fast(text, false)
                    .map(|e| e.get_ids().to_vec())
                    .map_err(|e| bad(&h.path, format!("cannot encode: {e}")))
            }
        }
    }

    /// `ids` as text, special tokens included; bytes that are not UTF-8
    /// (a character cut between tokens) are replaced.
    #[must_use]
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.kind {
            Kind::Gpt2(bpe) => match bpe.decode_bytes(ids) {
                Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
                Err(e) => format!("<undecodable: {e}>"),
            },
            Kind::HuggingFace(h) => h
                .inner
                .decode(ids, false)
                .unwrap_or_else(|e| format!("<undecodable: {e}>")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_encodes_as_gpt2_does() {
        // "Hello world." = [15496, 995, 13] in GPT-2's vocabulary
        let bpe = gpt2().unwrap();
        assert_eq!(bpe.encode_ordinary("Hello world."), [15496, 995, 13]);
        assert!(std::ptr::eq(bpe, gpt2().unwrap()), "built once");
        let t = TokenizerSpec::named("gpt2", None).load().unwrap();
        assert!(
            !t.encode("<|endoftext|>").unwrap().contains(&50256),
            "as text"
        );
        assert_eq!(
            t.encode_with_special_tokens("<|endoftext|>").unwrap(),
            [50256]
        );
        assert_eq!(t.id(), "gpt2");
    }

    /// A word-level tokenizer.json written by hand.
    fn word_level(vocab: &str) -> Vec<u8> {
        format!(
            r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":null,"pre_tokenizer":{{"type":"Whitespace"}},"post_processor":null,
            "decoder":null,"model":{{"type":"WordLevel","vocab":{{{vocab}}},"unk_token":"[UNK]"}}}}"#
        )
        .into_bytes()
    }

    #[test]
    fn a_tokenizer_json_loads_with_its_end_of_text() {
        let path = Path::new("w.json");
        let json = word_level(r#""[UNK]":0,"hello":1,"world":2,"</s>":7"#);
        let t = Tokenizer::from_bytes(path, json.clone(), None).unwrap();
        assert_eq!(t.encode("hello world mars").unwrap(), [1, 2, 0]);
        assert_eq!((t.end_of_text(), t.vocab_size()), (7, 8));
        assert_eq!(t.end_of_text_token(), "</s>");
        let t = Tokenizer::from_bytes(path, json.clone(), Some("world")).unwrap();
        assert_eq!(t.end_of_text(), 2);
        assert_eq!(t.id().len(), 16);
        let e = Tokenizer::from_bytes(path, json, Some("<nope>"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("w.json") && e.contains("<nope>"), "{e}");
        let e = Tokenizer::from_bytes(path, word_level(r#""a":0"#), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("w.json") && e.contains("--eot"), "{e}");
        let e = Tokenizer::from_bytes(path, b"{}".to_vec(), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("w.json: not a tokenizer.json"), "{e}");
        let e = Tokenizer::from_file(Path::new("/no/such/tokenizer.json"), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("/no/such/tokenizer.json: cannot read"), "{e}");
    }
}
