//! The crate's one error type.

use std::path::PathBuf;

/// Errors preparing or reading token data. Every variant names the file
/// (and where it helps, the line, block or offset) that was wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// A file or folder cannot be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// An input file has a kind `weft data prepare` does not read.
    #[error(
        "{0}: not a text input (expected .txt or .jsonl, optionally gzip-compressed as .txt.gz / .jsonl.gz)"
    )]
    UnsupportedInput(PathBuf),
    /// The inputs hold no text files at all.
    #[error("no .txt or .jsonl files in {0}")]
    NoInputs(String),
    /// A text input is not UTF-8.
    #[error("{path}: not UTF-8 text (invalid byte at offset {offset})")]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// Byte offset of the first invalid byte (of the decompressed text).
        offset: usize,
    },
    /// A line of a `.jsonl` input is not a JSON object with the text field.
    #[error("{path}:{line}: {what}")]
    BadJsonl {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// What is wrong with it.
        what: String,
    },
    /// The inputs hold no text to tokenize.
    #[error("the inputs hold no text (every document is empty)")]
    Empty,
    /// The output folder holds something else, or another preparation.
    #[error("{dir}: {what}")]
    OutputInUse {
        /// The output folder.
        dir: PathBuf,
        /// Why it cannot be written.
        what: String,
    },
    /// A token file or index is malformed: wrong magic, version or
    /// length, or fields that contradict each other.
    #[error("{path}: {what}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// A shard's bytes do not match the checksum its index recorded: the
    /// file was damaged after it was prepared. It is never trained on.
    #[error(
        "{path}: checksum mismatch in {part} (recorded {expected:016x}, found {found:016x}); the file is damaged: prepare it again"
    )]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Which part: `tokens A..B` (a block) or `the whole file`.
        part: String,
        /// The recorded checksum.
        expected: u64,
        /// The checksum of the bytes on disk.
        found: u64,
    },
    /// A token id is outside the vocabulary the model trains on.
    #[error("{path}: token {offset} is id {id}, outside the vocabulary of {vocab} ids")]
    TokenOutOfRange {
        /// The shard.
        path: PathBuf,
        /// Token offset in the shard.
        offset: u64,
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A split is shorter than one training sequence.
    #[error(
        "the {split} split of {path} has {tokens} tokens, fewer than one sequence of {needed} (block size + 1): use a smaller block size or more data"
    )]
    TooShort {
        /// The data.
        path: PathBuf,
        /// `train` or `validation`.
        split: &'static str,
        /// Tokens in the split.
        tokens: u64,
        /// Tokens needed.
        needed: u64,
    },
    /// A validation split by document needs at least two documents.
    #[error(
        "{0}: one document only; a validation split is held out by document, so the data needs at least two"
    )]
    OneDocument(PathBuf),
    /// The path is none of the formats this crate reads.
    #[error(
        "{0}: not token data weft reads (a folder of `weft data prepare`, a Megatron-LM .bin/.idx pair or prefix, or llm.c .bin shards)"
    )]
    UnknownFormat(PathBuf),
    /// A blend is ill-formed.
    #[error("data.blend: {0}")]
    Blend(String),
    /// A tokenizer could not be loaded or used: its file (`gpt2` for
    /// GPT-2's) and what went wrong.
    #[error("{path}: {what}")]
    Tokenizer {
        /// The `tokenizer.json` (or `gpt2`).
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// Token data was made with another tokenizer than the one named, or
    /// than the other data of a blend.
    #[error("{path}: {what}")]
    TokenizerMismatch {
        /// The data.
        path: PathBuf,
        /// Which tokenizers differ, and how.
        what: String,
    },
    /// Preparation was stopped by its caller; finished shards are kept and
    /// a later run with the same inputs resumes after them.
    #[error("preparation of {0} interrupted; run it again to resume")]
    Interrupted(PathBuf),
    /// A run's data (text, or a token cache file) cannot be read.
    #[error("cannot read data {path}: {source}")]
    Read {
        /// The path.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A folder of text data holds no `.txt` file.
    #[error("no .txt files in folder {0}")]
    NoTextFiles(PathBuf),
    /// Text data holds no text.
    #[error("data {0} is empty")]
    EmptyText(PathBuf),
    /// An option out of the range this machine can use.
    #[error("{name}: {what}")]
    Setting {
        /// The option (`--threads`).
        name: &'static str,
        /// What is wrong, with the bound.
        what: String,
    },
    /// An input changed while it was being prepared: the tokens written
    /// may not be the file's content now.
    #[error(
        "{path}: changed while it was being prepared ({then} bytes when listed, {now} now, or a new modification time); prepare it again once nothing writes it"
    )]
    InputChanged {
        /// The input.
        path: PathBuf,
        /// Its size when the inputs were listed.
        then: u64,
        /// Its size after it was read.
        now: u64,
    },
    /// The synthetic corpus' settings are unusable.
    #[error(transparent)]
    Synthetic(#[from] crate::synthetic::SpecError),
}

/// Shorthand for results of this crate.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// An [`DataError::Io`] for `path`.
pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> DataError {
    let path = path.into();
    move |source| DataError::Io { path, source }
}

/// A [`DataError::Format`] for `path`.
pub(crate) fn format(path: impl Into<PathBuf>, what: impl Into<String>) -> DataError {
    DataError::Format {
        path: path.into(),
        what: what.into(),
    }
}
