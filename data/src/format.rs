//! The prepared-data format that `weft data prepare` writes.
//!
//! A prepared folder holds:
//!
//! - `index.json` ([`Index`]): the tokenizer, the settings and inputs it
//!   was prepared from, and per shard its token and document counts, the
//!   xxh3-64 of its two files and one xxh3-64 per block of
//!   [`Index::block_tokens`] tokens;
//! - `shard-NNNNN.bin`: the token ids as little-endian `u16`, or `u32`
//!   when the tokenizer has more than 65,536 ids ([`Index::dtype`]; no
//!   header, so the file maps straight to an array, as Megatron-LM's
//!   `.bin` does);
//! - `shard-NNNNN.idx`: each document's end offset in the shard (tokens,
//!   exclusive) as little-endian `u64`;
//! - `tokenizer.json`, when a Hugging Face tokenizer made the ids: a copy
//!   of it (its xxh3-64 is in the index), so the folder can be decoded
//!   (`weft sample`) wherever it is moved.
//!
//! Every document ends with the end-of-text token; documents never cross
//! shards. While a preparation runs, `prepare.partial.json` (the same
//! [`Index`] with the finished shards so far) stands in for `index.json`,
//! which is written last: a folder with an `index.json` is complete.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{DataError, Result, format, io};
use crate::shard::{Blocks, Dtype, Segment, Shard};
use crate::tokenizer::Tokenizer;

/// The `format` field of every index.
pub const FORMAT: &str = "weft-tokens";
/// The format version this crate writes and reads.
pub const VERSION: u32 = 1;
/// The file name of a finished preparation's index.
pub const INDEX: &str = "index.json";
/// The file name of an unfinished preparation's index.
pub const PARTIAL: &str = "prepare.partial.json";
/// The file name of the copy of a Hugging Face tokenizer in a prepared
/// folder.
pub const TOKENIZER: &str = "tokenizer.json";
/// Tokens per checksummed block (2 MiB of `u16`, 4 MiB of `u32`).
pub const BLOCK_TOKENS: u64 = 1 << 20;

/// What a preparation was made from: two preparations with equal settings
/// write identical bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// The tokenizer: `"gpt2"` (GPT-2's byte-level BPE, `r50k_base`), or
    /// [`TOKENIZER`] (a Hugging Face tokenizer, copied into the folder).
    pub tokenizer: String,
    /// xxh3-64 of the `tokenizer.json` (16 hex digits); absent for GPT-2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_xxh3: Option<String>,
    /// The end-of-text token appended after every document (its text);
    /// absent for GPT-2 (`<|endoftext|>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_of_text_token: Option<String>,
    /// The JSON field holding a `.jsonl` document's text.
    pub text_key: String,
    /// A shard closes before a document would take it past this many
    /// tokens (a longer document gets a shard of its own).
    pub shard_tokens: u64,
    /// The input files, in the order their documents were read.
    pub inputs: Vec<InputFile>,
}

/// One input file of a preparation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputFile {
    /// The path as given (a folder argument joined with the file's path
    /// inside it).
    pub path: String,
    /// Its size in bytes (compressed, for `.gz`).
    pub bytes: u64,
    /// Its modification time, nanoseconds since the Unix epoch, when it
    /// was read (with the size, what identifies an input's content: an
    /// input edited in place is prepared again). Absent in indexes of
    /// earlier weft versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modified_ns: Option<u64>,
}

/// One shard of a prepared folder.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    /// The token file, relative to the folder.
    pub bin: String,
    /// The document-ends file, relative to the folder.
    pub idx: String,
    /// Tokens in the shard.
    pub tokens: u64,
    /// Documents in the shard.
    pub documents: u64,
    /// Index (over all input documents, empty ones included) of the first
    /// input document after this shard: where a resumed preparation
    /// continues.
    pub next_input_document: u64,
    /// xxh3-64 of the whole `.bin`, hex.
    pub bin_xxh3: String,
    /// xxh3-64 of the whole `.idx`, hex.
    pub idx_xxh3: String,
    /// xxh3-64 of each block of [`Index::block_tokens`] tokens, hex.
    pub blocks: Vec<String>,
}

/// `index.json` of a prepared folder.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Index {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// How token ids are stored: `u16` while every id fits (vocabularies
    /// of up to 65,536 ids), else `u32`.
    pub dtype: Dtype,
    /// Size of the tokenizer's id space.
    pub vocab_size: usize,
    /// The id appended after every document.
    pub end_of_text: u32,
    /// Tokens per checksummed block.
    pub block_tokens: u64,
    /// What the folder was prepared from.
    pub settings: Settings,
    /// Documents with text (empty input documents are left out).
    pub documents: u64,
    /// Tokens, end-of-text tokens included.
    pub tokens: u64,
    /// Input documents that were empty and left out.
    pub empty_documents: u64,
    /// The shards, in document order.
    pub shards: Vec<ShardEntry>,
}

/// A u64 as 16 hex digits.
pub(crate) fn hex(v: u64) -> String {
    format!("{v:016x}")
}

fn unhex(path: &Path, s: &str) -> Result<u64> {
    u64::from_str_radix(s, 16).map_err(|_| format(path, format!("{s:?} is not a hex checksum")))
}

impl Index {
    /// Reads and checks an index file (`index.json` or the partial one).
    ///
    /// # Errors
    /// An unreadable file, bad JSON, another format or version, or totals
    /// that disagree with the shards.
    pub fn read(path: &Path) -> Result<Self> {
        let text = weft_trace::input::read_to_string(path, weft_trace::input::INDEX_BYTES)
            .map_err(io(path))?;
        let index: Index = serde_json::from_str(&text).map_err(|e| format(path, e.to_string()))?;
        if index.format != FORMAT || index.version != VERSION {
            return Err(format(
                path,
                format!(
                    "format {:?} version {}; this weft reads {FORMAT:?} version {VERSION}",
                    index.format, index.version
                ),
            ));
        }
        // a shard is a file of the folder: a name such as `../outside.bin`
        // or an absolute path is refused, as checkpoint manifests do
        for s in &index.shards {
            for name in [&s.bin, &s.idx] {
                let mut parts = Path::new(name).components();
                let plain = matches!(parts.next(), Some(std::path::Component::Normal(_)))
                    && parts.next().is_none();
                if !plain {
                    return Err(format(
                        path,
                        format!("shard file {name:?} is not a plain file name inside the folder"),
                    ));
                }
            }
        }
        let (docs, toks): (u64, u64) = index
            .shards
            .iter()
            .fold((0, 0), |(d, t), s| (d + s.documents, t + s.tokens));
        if docs != index.documents || toks != index.tokens {
            return Err(format(
                path,
                format!(
                    "the shards hold {docs} documents and {toks} tokens, the totals say {} and {}",
                    index.documents, index.tokens
                ),
            ));
        }
        Ok(index)
    }

    /// What made the ids: `"gpt2"`, or the xxh3-64 of the
    /// `tokenizer.json` ([`Tokenizer::id`] of the same tokenizer).
    #[must_use]
    pub fn tokenizer_id(&self) -> String {
        self.settings
            .tokenizer_xxh3
            .clone()
            .unwrap_or_else(|| self.settings.tokenizer.clone())
    }

    /// Writes the index to `path` atomically (a temporary file renamed
    /// into place).
    pub(crate) fn write(&self, path: &Path) -> Result<()> {
        let mut text = serde_json::to_string_pretty(self).expect("an index serializes");
        text.push('\n');
        write_atomic(path, text.as_bytes())
    }
}

/// Writes `bytes` to `path` through a temporary file renamed into place,
/// so `path` is either absent, or old, or whole.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// A prepared folder, opened: its index and its shards mapped.
#[derive(Debug)]
pub struct Prepared {
    /// The folder.
    pub dir: PathBuf,
    /// Its index.
    pub index: Index,
    pub(crate) shards: Vec<Arc<Shard>>,
}

impl Prepared {
    /// Opens a prepared folder: reads `index.json` and maps every shard,
    /// checking each file's length (a truncated shard is an error here);
    /// the tokens' checksums are checked block by block as they are read.
    ///
    /// # Errors
    /// An unfinished or malformed folder, a missing or truncated file.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join(INDEX);
        if !index_path.exists() && dir.join(PARTIAL).exists() {
            return Err(format(
                dir,
                "an unfinished preparation (prepare.partial.json, no index.json): run `weft data prepare` again to finish it",
            ));
        }
        let index = Index::read(&index_path)?;
        let mut shards = Vec::with_capacity(index.shards.len());
        for s in &index.shards {
            let bin = dir.join(&s.bin);
            let sums = s
                .blocks
                .iter()
                .map(|h| unhex(&index_path, h))
                .collect::<Result<Vec<_>>>()?;
            let shard = Shard::open(
                &bin,
                0,
                index.dtype,
                s.tokens,
                index.vocab_size,
                Some(Blocks::new(index.block_tokens, sums)),
            )?;
            let idx = dir.join(&s.idx);
            let len = std::fs::metadata(&idx).map_err(io(&idx))?.len();
            if len != s.documents * 8 {
                return Err(format(
                    &idx,
                    format!(
                        "{len} bytes, but the index says {} documents of 8 bytes: truncated or replaced",
                        s.documents
                    ),
                ));
            }
            shards.push(Arc::new(shard));
        }
        Ok(Self {
            dir: dir.to_owned(),
            index,
            shards,
        })
    }

    /// The tokenizer that made the ids: GPT-2's, or the folder's copy of
    /// its `tokenizer.json` (checked against the recorded hash).
    ///
    /// # Errors
    /// [`DataError::Tokenizer`] if the copy is missing, unreadable or not
    /// the recorded one.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        let s = &self.index.settings;
        if s.tokenizer_xxh3.is_none() {
            return Tokenizer::gpt2();
        }
        let path = self.dir.join(&s.tokenizer);
        let t = Tokenizer::from_file(&path, s.end_of_text_token.as_deref())?;
        if t.id() != self.index.tokenizer_id() {
            return Err(DataError::Tokenizer {
                path,
                what: format!(
                    "xxh3 {}, but the data was prepared with xxh3 {}: the copy was replaced",
                    t.id(),
                    self.index.tokenizer_id()
                ),
            });
        }
        Ok(t)
    }

    /// Checks every checksum of every file (reads the whole folder).
    ///
    /// # Errors
    /// [`DataError::Corrupt`] naming the first damaged file.
    pub fn verify(&self) -> Result<()> {
        for (s, shard) in self.index.shards.iter().zip(&self.shards) {
            verify_file(&self.dir.join(&s.bin), &s.bin_xxh3)?;
            verify_file(&self.dir.join(&s.idx), &s.idx_xxh3)?;
            shard.verify()?;
        }
        Ok(())
    }

    /// The end offset (exclusive, in folder-wide tokens) of the document
    /// that ends first at or after `target`, or `None` if only the last
    /// document's end is there. Reads a few pages of one `.idx` file.
    pub(crate) fn doc_end_at_or_after(&self, target: u64) -> Result<Option<u64>> {
        let mut base = 0;
        for s in &self.index.shards {
            if base + s.tokens >= target && s.documents > 0 {
                let path = self.dir.join(&s.idx);
                let map = crate::shard::Mapped::open(&path)?;
                let ends: Vec<u64> = map
                    .bytes()
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect();
                if ends.windows(2).any(|w| w[0] >= w[1]) || ends.last() != Some(&s.tokens) {
                    return Err(format(
                        &path,
                        "document ends are not increasing up to the shard's length",
                    ));
                }
                let k = ends.partition_point(|&e| base + e < target);
                let end = base + ends[k.min(ends.len() - 1)];
                return Ok((end < self.index.tokens).then_some(end));
            }
            base += s.tokens;
        }
        Ok(None)
    }

    /// The last document boundary before the end (the start of the last
    /// document), if there are two documents or more.
    pub(crate) fn last_doc_start(&self) -> Result<Option<u64>> {
        if self.index.documents < 2 {
            return Ok(None);
        }
        let last = self.index.shards.iter().rposition(|s| s.documents > 0);
        let Some(k) = last else { return Ok(None) };
        let s = &self.index.shards[k];
        let base: u64 = self.index.shards[..k].iter().map(|s| s.tokens).sum();
        if s.documents == 1 {
            return Ok(Some(base));
        }
        let path = self.dir.join(&s.idx);
        let map = crate::shard::Mapped::open(&path)?;
        let b = &map.bytes()[(s.documents as usize - 2) * 8..(s.documents as usize - 1) * 8];
        Ok(Some(
            base + u64::from_le_bytes(b.try_into().expect("8 bytes")),
        ))
    }

    /// Segments covering folder-wide tokens `start..end`.
    pub(crate) fn segments(&self, start: u64, end: u64) -> Vec<Segment> {
        let mut out = Vec::new();
        let mut base = 0;
        for shard in &self.shards {
            let (s, e) = (base, base + shard.len());
            let (a, b) = (start.max(s), end.min(e));
            if a < b {
                out.push(Segment {
                    shard: shard.clone(),
                    start: a - s,
                    end: b - s,
                });
            }
            base = e;
        }
        out
    }
}

/// Checks a whole file's xxh3-64 against the recorded hex checksum.
pub(crate) fn verify_file(path: &Path, expected: &str) -> Result<()> {
    let want = unhex(path, expected)?;
    let map = crate::shard::Mapped::open(path)?;
    let found = xxhash_rust::xxh3::xxh3_64(map.bytes());
    if found != want {
        return Err(DataError::Corrupt {
            path: path.to_owned(),
            part: "the whole file".into(),
            expected: want,
            found,
        });
    }
    Ok(())
}
