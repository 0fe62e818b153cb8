//! A corpus of token data on disk, whatever wrote it, split into training
//! and validation tokens by document.
//!
//! Three formats are read, all memory-mapped:
//!
//! - **weft**: a folder written by [`prepare`](crate::prepare()) (see
//!   [`format`](crate::format)); block checksums are checked as tokens are
//!   read.
//! - **Megatron-LM** indexed datasets (`MMapIndexedDataset`): a `.bin` of
//!   raw token ids and an `.idx` of `MMIDIDX\0\0`, version `u64` 1, a dtype
//!   code `u8` (8 = uint16, 4 = int32), the sequence count `u64`, the
//!   document-index length `u64`, then the sequence lengths (`i32`), their
//!   byte offsets (`i64`) and the document index (`i64`, sequence numbers
//!   where documents start, from 0 to the sequence count). Named by the
//!   common prefix, or by either file. Documents are concatenated as they
//!   are: an end-of-text token between them is there if the tool that
//!   wrote them appended one (`--append-eod`).
//! - **llm.c** token shards: a header of 256 `i32` (magic, version, token
//!   count), then the ids: magic 20240520 version 1, `u16` GPT-2 ids, each
//!   document starting with the end-of-text token (50256); or magic
//!   20240801 version 7, `u32` Llama-3 ids, each document starting with
//!   `<|begin_of_text|>` (128000), a vocabulary of 128,256 ids. A single
//!   file or a folder of them; files whose name contains `_val_` are the
//!   validation split (llm.c's own convention), else it is held out by
//!   document.
//!
//! The size of the id space comes from what wrote the data: a weft
//! folder's index, llm.c's magic, the tokenizer given to
//! [`Corpus::open_for`] — or, for Megatron-LM files without one, GPT-2's
//! for `uint16` ids and none (ids unchecked) for `int32`.
//!
//! No format carries a checksum but weft's: for Megatron-LM and llm.c
//! files only lengths are checked (a truncated file is an error) and ids
//! are checked against the vocabulary as they are read.
//!
//! The validation split is the corpus' last documents, about
//! `val_fraction` of its tokens, cut at a document boundary (as
//! Megatron-LM's `--split` cuts by document): no document is in both.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{DataError, Result, format};
use crate::format::{INDEX, PARTIAL, Prepared};
use crate::shard::{Dtype, Mapped, Segment, Shard, Stream};
use crate::tokenizer::{GPT2, Tokenizer};

/// GPT-2's end-of-text token.
pub const END_OF_TEXT: u32 = 50256;
/// GPT-2's vocabulary size.
pub const GPT2_VOCAB: usize = 50257;
/// Llama-3's vocabulary size (llm.c's Llama-3 shards).
pub const LLAMA3_VOCAB: usize = 128_256;
/// Llama-3's `<|begin_of_text|>`, which starts every document of llm.c's
/// Llama-3 shards.
pub const LLAMA3_BEGIN_OF_TEXT: u32 = 128_000;

/// Which tool wrote a corpus.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `weft data prepare`.
    Weft,
    /// Megatron-LM's `preprocess_data.py` (`.bin` + `.idx`).
    Megatron,
    /// llm.c's `dev/data` scripts (`.bin` shards with a 1 KiB header).
    LlmC,
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Format::Weft => "weft",
            Format::Megatron => "Megatron-LM",
            Format::LlmC => "llm.c",
        })
    }
}

/// Where a path's token data is, if it is token data.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Found {
    Weft(PathBuf),
    /// The prefix (without `.bin` / `.idx`).
    Megatron(PathBuf),
    LlmC(Vec<PathBuf>),
}

const MEGATRON_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
const LLMC_MAGIC: i32 = 20_240_520;
const LLMC_LLAMA3_MAGIC: i32 = 20_240_801;
const LLMC_HEADER: usize = 256 * 4;

fn starts_with(path: &Path, magic: &[u8]) -> bool {
    use std::io::Read;
    let mut head = vec![0u8; magic.len()];
    weft_trace::input::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok()
        && head == magic
}

fn is_llmc(path: &Path) -> bool {
    starts_with(path, &LLMC_MAGIC.to_le_bytes())
        || starts_with(path, &LLMC_LLAMA3_MAGIC.to_le_bytes())
}

fn with_suffix(prefix: &Path, ext: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(ext);
    PathBuf::from(s)
}

fn detect(path: &Path) -> Option<Found> {
    if path.is_dir() {
        if path.join(INDEX).exists() || path.join(PARTIAL).exists() {
            return Some(Found::Weft(path.to_owned()));
        }
        let mut bins: Vec<PathBuf> = std::fs::read_dir(path)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "bin"))
            .collect();
        bins.sort();
        if !bins.is_empty() && bins.iter().all(|b| is_llmc(b)) {
            return Some(Found::LlmC(bins));
        }
        return None;
    }
    let ext = path.extension().and_then(|x| x.to_str());
    if matches!(ext, Some("bin" | "idx")) {
        let prefix = path.with_extension("");
        if starts_with(&with_suffix(&prefix, ".idx"), MEGATRON_MAGIC) {
            return Some(Found::Megatron(prefix));
        }
    }
    if starts_with(&with_suffix(path, ".idx"), MEGATRON_MAGIC) {
        return Some(Found::Megatron(path.to_owned()));
    }
    if path.is_file() && is_llmc(path) {
        return Some(Found::LlmC(vec![path.to_owned()]));
    }
    None
}

/// A corpus of tokens, split by document into training and validation
/// streams.
#[derive(Debug)]
pub struct Corpus {
    /// The path it was opened from.
    pub path: PathBuf,
    /// Who wrote it.
    pub format: Format,
    /// Training tokens.
    pub train: Stream,
    /// Validation tokens.
    pub val: Stream,
    /// Documents, when the format counts them.
    pub documents: Option<u64>,
    /// The prepared folder's index (weft format only).
    pub prepared: Option<Arc<Prepared>>,
    /// Size of the id space the ids are checked against as they are read
    /// (`None`: unknown, unchecked: Megatron-LM `int32` ids opened without
    /// a tokenizer).
    pub vocab_size: Option<usize>,
    /// The token that separates documents (ends them, or for llm.c's
    /// files starts them), when known.
    pub end_of_text: Option<u32>,
    /// What made the ids, when the data records it: `"gpt2"`, or the
    /// xxh3-64 of a `tokenizer.json` ([`Tokenizer::id`]).
    pub tokenizer: Option<String>,
}

/// The `vocab` a shard checks ids against when there is none.
const UNCHECKED: usize = 1 << 32;

impl Corpus {
    /// Whether `path` is token data this crate reads (rather than text to
    /// tokenize).
    pub fn is_token_data(path: &Path) -> bool {
        detect(path).is_some()
    }

    /// Opens token data of any of the three formats, holding out about
    /// `val_fraction` of the tokens (at a document boundary) for
    /// validation.
    ///
    /// # Errors
    /// [`DataError::UnknownFormat`] if `path` is none of them; format and
    /// length errors naming the file; [`DataError::OneDocument`] if there
    /// is nothing to hold out by document.
    pub fn open(path: &Path, val_fraction: f64) -> Result<Self> {
        Self::open_for(path, val_fraction, None)
    }

    /// As [`open`](Self::open), for training with `tokenizer`: a weft
    /// folder must have been prepared with it; Megatron-LM files take its
    /// vocabulary size and end-of-text token; llm.c's Llama-3 shards its
    /// vocabulary size.
    ///
    /// # Errors
    /// As [`open`](Self::open); [`DataError::TokenizerMismatch`] when the
    /// data records another tokenizer.
    pub fn open_for(path: &Path, val_fraction: f64, tokenizer: Option<&Tokenizer>) -> Result<Self> {
        if !path.exists() && !with_suffix(path, ".idx").exists() {
            return Err(DataError::Io {
                path: path.to_owned(),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            });
        }
        match detect(path).ok_or_else(|| DataError::UnknownFormat(path.to_owned()))? {
            Found::Weft(dir) => Self::open_weft(path, &dir, val_fraction, tokenizer),
            Found::Megatron(prefix) => Self::open_megatron(path, &prefix, val_fraction, tokenizer),
            Found::LlmC(files) => Self::open_llmc(path, &files, val_fraction, tokenizer),
        }
    }

    /// A [`DataError::TokenizerMismatch`] if `given` is not what the data
    /// at `path` records (`recorded`, described as `shown`).
    fn check_tokenizer(
        path: &Path,
        recorded: &str,
        shown: &str,
        given: Option<&Tokenizer>,
    ) -> Result<()> {
        match given {
            Some(t) if t.id() != recorded => Err(DataError::TokenizerMismatch {
                path: path.to_owned(),
                what: format!(
                    "the ids were made with {shown}, not with the tokenizer named ({}): train with the tokenizer it was prepared with, or prepare the text again with --tokenizer",
                    t.describe()
                ),
            }),
            _ => Ok(()),
        }
    }

    /// Every checksum and every id of the corpus (reads all of it). Only
    /// weft's format has checksums; the others get the id check.
    ///
    /// # Errors
    /// The first damaged block or file, or id outside the vocabulary.
    pub fn verify(&self) -> Result<()> {
        if let Some(p) = &self.prepared {
            return p.verify();
        }
        for s in self.train.shards().chain(self.val.shards()) {
            s.verify()?;
        }
        Ok(())
    }

    fn target(total: u64, val_fraction: f64) -> u64 {
        total - ((total as f64 * val_fraction).ceil() as u64).min(total)
    }

    fn open_weft(
        path: &Path,
        dir: &Path,
        val_fraction: f64,
        tokenizer: Option<&Tokenizer>,
    ) -> Result<Self> {
        let p = Prepared::open(dir)?;
        let recorded = p.index.tokenizer_id();
        let shown = match &p.index.settings.tokenizer_xxh3 {
            Some(h) => format!("a tokenizer.json of xxh3 {h}"),
            None => recorded.clone(),
        };
        Self::check_tokenizer(path, &recorded, &shown, tokenizer)?;
        let total = p.index.tokens;
        let target = Self::target(total, val_fraction);
        let cut = match p.doc_end_at_or_after(target)? {
            Some(c) => c,
            None => p
                .last_doc_start()?
                .ok_or_else(|| DataError::OneDocument(path.to_owned()))?,
        };
        Ok(Self {
            path: path.to_owned(),
            format: Format::Weft,
            train: Stream::new(p.segments(0, cut)),
            val: Stream::new(p.segments(cut, total)),
            documents: Some(p.index.documents),
            vocab_size: Some(p.index.vocab_size),
            end_of_text: Some(p.index.end_of_text),
            tokenizer: Some(recorded),
            prepared: Some(Arc::new(p)),
        })
    }

    fn open_megatron(
        path: &Path,
        prefix: &Path,
        val_fraction: f64,
        tokenizer: Option<&Tokenizer>,
    ) -> Result<Self> {
        let idx_path = with_suffix(prefix, ".idx");
        let bin_path = with_suffix(prefix, ".bin");
        let map = Mapped::open(&idx_path)?;
        let b = map.bytes();
        let bad = |what: String| format(&idx_path, what);
        let u64_at = |o: usize| -> Result<u64> {
            b.get(o..o + 8)
                .map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
                .ok_or_else(|| bad(format!("truncated at byte {o}")))
        };
        if b.len() < 34 || &b[..9] != MEGATRON_MAGIC {
            return Err(bad("not a Megatron-LM index (no MMIDIDX header)".into()));
        }
        let version = u64_at(9)?;
        if version != 1 {
            return Err(bad(format!(
                "index version {version}; weft reads version 1"
            )));
        }
        let dtype = match b[17] {
            8 => Dtype::U16,
            4 => Dtype::U32,
            c => {
                return Err(bad(format!(
                    "token dtype code {c}; weft reads 8 (uint16) and 4 (int32)"
                )));
            }
        };
        let n = usize::try_from(u64_at(18)?).map_err(|_| bad("sequence count too large".into()))?;
        let nd =
            usize::try_from(u64_at(26)?).map_err(|_| bad("document count too large".into()))?;
        let want = 34usize
            .checked_add(
                n.checked_mul(12)
                    .ok_or_else(|| bad("sequence count too large".into()))?,
            )
            .and_then(|v| v.checked_add(nd.checked_mul(8)?))
            .ok_or_else(|| bad("document count too large".into()))?;
        if b.len() != want {
            return Err(bad(format!(
                "{} bytes, but {n} sequences and {nd} document-index entries need {want}: truncated or not an index",
                b.len()
            )));
        }
        let sizes = &b[34..34 + 4 * n];
        let pointers = &b[34 + 4 * n..34 + 12 * n];
        let doc_idx = &b[34 + 12 * n..];
        // Offsets (tokens) of each sequence; the pointers must agree.
        let mut cum = Vec::with_capacity(n + 1);
        cum.push(0u64);
        for i in 0..n {
            let size = i32::from_le_bytes(sizes[4 * i..4 * i + 4].try_into().expect("4 bytes"));
            let ptr = i64::from_le_bytes(pointers[8 * i..8 * i + 8].try_into().expect("8 bytes"));
            let at = cum[i];
            if size < 0 || ptr < 0 || ptr as u64 != at * dtype.size() as u64 {
                return Err(bad(format!(
                    "sequence {i}: length {size} at byte {ptr}, expected a length ≥ 0 at byte {} (sequences must be contiguous)",
                    at * dtype.size() as u64
                )));
            }
            cum.push(at + size as u64);
        }
        let docs: Vec<u64> = doc_idx
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")) as u64)
            .collect();
        if docs.first() != Some(&0)
            || docs.last() != Some(&(n as u64))
            || docs.windows(2).any(|w| w[0] > w[1])
        {
            return Err(bad(format!(
                "the document index must rise from 0 to the sequence count {n}"
            )));
        }
        let total = cum[n];
        // Without a tokenizer: GPT-2's for uint16 ids, unknown for int32.
        let (vocab_size, end_of_text) = match (tokenizer, dtype) {
            (Some(t), _) => (Some(t.vocab_size()), Some(t.end_of_text())),
            (None, Dtype::U16) => (Some(GPT2_VOCAB), Some(END_OF_TEXT)),
            (None, Dtype::U32) => (None, None),
        };
        let vocab = vocab_size.unwrap_or(UNCHECKED);
        let shard = Arc::new(Shard::open(&bin_path, 0, dtype, total, vocab, None)?);
        // Document ends in tokens, empty documents dropped.
        let mut ends: Vec<u64> = docs[1..].iter().map(|&s| cum[s as usize]).collect();
        ends.dedup();
        ends.retain(|&e| e > 0);
        let target = Self::target(total, val_fraction);
        let k = ends.partition_point(|&e| e < target);
        let cut = match ends.get(k) {
            Some(&e) if e < total => e,
            _ if ends.len() >= 2 => ends[ends.len() - 2],
            _ => return Err(DataError::OneDocument(path.to_owned())),
        };
        let seg = |a, b| Segment {
            shard: shard.clone(),
            start: a,
            end: b,
        };
        Ok(Self {
            path: path.to_owned(),
            format: Format::Megatron,
            train: Stream::new(vec![seg(0, cut)]),
            val: Stream::new(vec![seg(cut, total)]),
            documents: Some(ends.len() as u64),
            prepared: None,
            vocab_size,
            end_of_text,
            tokenizer: None,
        })
    }

    fn open_llmc(
        path: &Path,
        files: &[PathBuf],
        val_fraction: f64,
        tokenizer: Option<&Tokenizer>,
    ) -> Result<Self> {
        let mut train = Vec::new();
        let mut val = Vec::new();
        // (dtype, vocabulary, document separator) of the first file
        let mut kind: Option<(Dtype, usize, u32)> = None;
        for f in files {
            let map = Mapped::open(f)?;
            let head = map.bytes();
            if head.len() < LLMC_HEADER {
                return Err(format(f, "shorter than llm.c's 1024-byte header"));
            }
            let word =
                |i: usize| i32::from_le_bytes(head[4 * i..4 * i + 4].try_into().expect("4 bytes"));
            let this = match (word(0), word(1)) {
                (LLMC_MAGIC, 1) => {
                    Self::check_tokenizer(f, GPT2, "GPT-2's BPE (llm.c's GPT-2 shard)", tokenizer)?;
                    (Dtype::U16, GPT2_VOCAB, END_OF_TEXT)
                }
                (LLMC_LLAMA3_MAGIC, 7) => {
                    let vocab = tokenizer.map_or(LLAMA3_VOCAB, Tokenizer::vocab_size);
                    (Dtype::U32, vocab, LLAMA3_BEGIN_OF_TEXT)
                }
                (m, v) => {
                    return Err(format(
                        f,
                        format!(
                            "llm.c magic {m} version {v}; weft reads magic 20240520 version 1 (GPT-2, uint16) and magic 20240801 version 7 (Llama-3, uint32)"
                        ),
                    ));
                }
            };
            if kind.is_some_and(|k| k != this) {
                return Err(format(
                    f,
                    format!(
                        "an llm.c shard of other ids than {} (GPT-2 and Llama-3 shards do not mix)",
                        files[0].display()
                    ),
                ));
            }
            kind = Some(this);
            let (dtype, vocab, _) = this;
            let tokens = u64::try_from(word(2)).map_err(|_| format(f, "negative token count"))?;
            drop(map);
            let shard = Arc::new(Shard::open(f, LLMC_HEADER, dtype, tokens, vocab, None)?);
            let seg = Segment {
                shard,
                start: 0,
                end: tokens,
            };
            let is_val = f
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.contains("_val_"));
            if is_val {
                val.push(seg);
            } else {
                train.push(seg);
            }
        }
        let (dtype, vocab, separator) = kind.expect("at least one file");
        let corpus = |train, val| Self {
            path: path.to_owned(),
            format: Format::LlmC,
            train: Stream::new(train),
            val: Stream::new(val),
            documents: None,
            prepared: None,
            vocab_size: Some(vocab),
            end_of_text: Some(separator),
            tokenizer: (dtype == Dtype::U16).then(|| GPT2.to_owned()),
        };
        if !val.is_empty() && !train.is_empty() {
            return Ok(corpus(train, val));
        }
        // One stream: cut at the first end-of-text at or after the target
        // (each llm.c document starts with one), else the last before it.
        let all: Vec<Segment> = train.into_iter().chain(val).collect();
        let total: u64 = all.iter().map(|s| s.end).sum();
        let target = Self::target(total, val_fraction);
        let at = |pos: u64| -> u32 {
            let mut base = 0;
            for s in &all {
                if pos < base + s.end {
                    return s.shard.peek(pos - base);
                }
                base += s.end;
            }
            unreachable!("position inside the corpus")
        };
        let cut = (target..total)
            .find(|&p| p > 0 && at(p) == separator)
            .or_else(|| (1..target).rev().find(|&p| at(p) == separator))
            .ok_or_else(|| DataError::OneDocument(path.to_owned()))?;
        let (mut tr, mut va) = (Vec::new(), Vec::new());
        let mut base = 0;
        for s in all {
            let (a, b) = (base, base + s.end);
            if cut > a {
                tr.push(Segment {
                    shard: s.shard.clone(),
                    start: 0,
                    end: cut.min(b) - a,
                });
            }
            if cut < b {
                va.push(Segment {
                    shard: s.shard.clone(),
                    start: cut.max(a) - a,
                    end: s.end,
                });
            }
            base = b;
        }
        Ok(corpus(tr, va))
    }
}
