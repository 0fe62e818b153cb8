//! One memory-mapped token file, and streams of token ranges over several.
//!
//! A [`Shard`] maps its file read-only and decodes only the tokens a
//! sequence asks for, so a rank's page cache holds the pages of the
//! sequences it trains on and no others. Shards prepared by weft carry a
//! checksum per block of tokens: a block is checked the first time any of
//! its tokens is read, so damage is found before a damaged token reaches
//! a batch, at the cost of hashing each touched block once (xxh3, well
//! above 10 GB/s).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{DataError, Result, format, io};

/// A read-only private mapping of a whole file, and the open file (to
/// check its length before a read: see [`Mapped::check_length`]).
pub(crate) struct Mapped {
    ptr: *const u8,
    len: usize,
    file: std::fs::File,
}

// SAFETY: the mapping is read-only and owned by this value; reading it
// from several threads at once is reading immutable memory.
unsafe impl Send for Mapped {}
// SAFETY: as for `Send`.
unsafe impl Sync for Mapped {}

impl Mapped {
    /// Maps `path` whole (an empty file maps to no bytes).
    pub(crate) fn open(path: &Path) -> Result<Self> {
        use std::os::fd::AsRawFd;
        let f = weft_trace::input::open(path).map_err(io(path))?;
        let len = f.metadata().map_err(io(path))?.len();
        let len =
            usize::try_from(len).map_err(|_| format(path, "larger than the address space"))?;
        if len == 0 {
            return Ok(Self {
                ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(),
                len: 0,
                file: f,
            });
        }
        // SAFETY: a fresh read-only private mapping of an open file of
        // `len` bytes, checked against MAP_FAILED.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                f.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(DataError::Io {
                path: path.to_owned(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
            file: f,
        })
    }

    /// Checks that the file still holds the first `end` bytes of the
    /// mapping. Reading a page of a mapping past the end of its file kills
    /// the process with SIGBUS, so a file truncated after it was mapped
    /// (data rewritten while a run reads it) is found here, before the
    /// read, and named. A truncation in the microseconds between this
    /// check and the read cannot be caught without a signal handler.
    pub(crate) fn check_length(&self, path: &Path, end: usize) -> Result<()> {
        let now = self.file.metadata().map_err(io(path))?.len();
        if now < end as u64 {
            return Err(format(
                path,
                format!(
                    "the file shrank to {now} bytes after it was opened ({} then): it was truncated or rewritten while being read; prepare it again, and do not rewrite data a run is reading",
                    self.len
                ),
            ));
        }
        Ok(())
    }

    /// The mapped bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping holds `len` readable bytes for the life of
        // `self` (or `len` is 0 and the pointer is dangling but aligned).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: unmaps exactly the mapping made in `open`, once; no
            // borrow of it outlives `self`.
            unsafe {
                libc::munmap(self.ptr.cast_mut().cast(), self.len);
            }
        }
    }
}

/// How token ids are stored: little-endian unsigned integers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 2 bytes per token (vocabularies up to 65,536: GPT-2's).
    U16,
    /// 4 bytes per token.
    U32,
}

impl Dtype {
    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            Dtype::U16 => 2,
            Dtype::U32 => 4,
        }
    }
}

/// Per-block checksums of a shard, each checked on first use.
pub(crate) struct Blocks {
    /// Tokens per block (the last block may be shorter).
    pub(crate) tokens: u64,
    /// xxh3-64 of each block's bytes.
    pub(crate) sums: Vec<u64>,
    checked: Vec<AtomicBool>,
}

impl Blocks {
    pub(crate) fn new(tokens: u64, sums: Vec<u64>) -> Self {
        let checked = sums.iter().map(|_| AtomicBool::new(false)).collect();
        Self {
            tokens,
            sums,
            checked,
        }
    }
}

/// One token file, mapped.
pub struct Shard {
    path: PathBuf,
    map: Mapped,
    /// Byte offset of token 0 (a header's length).
    base: usize,
    dtype: Dtype,
    tokens: u64,
    vocab: usize,
    blocks: Option<Blocks>,
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Shard({}, {} tokens)", self.path.display(), self.tokens)
    }
}

impl Shard {
    /// Maps `path`, whose tokens start at byte `base` and number `tokens`:
    /// the file must be exactly `base + tokens · dtype.size()` bytes long
    /// (a truncated or padded file is an error here, not a short read
    /// later). Ids are checked against `vocab` as they are read.
    pub(crate) fn open(
        path: &Path,
        base: usize,
        dtype: Dtype,
        tokens: u64,
        vocab: usize,
        blocks: Option<Blocks>,
    ) -> Result<Self> {
        if cfg!(target_endian = "big") {
            return Err(format(
                path,
                "token files are read on little-endian machines only",
            ));
        }
        let map = Mapped::open(path)?;
        let want = (base as u64).saturating_add(tokens.saturating_mul(dtype.size() as u64));
        if map.len as u64 != want {
            return Err(format(
                path,
                format!(
                    "{} bytes, but its index says {tokens} tokens of {} bytes after a {base}-byte header = {want} bytes: the file is truncated or is not the one the index describes",
                    map.len,
                    dtype.size()
                ),
            ));
        }
        if let Some(b) = &blocks {
            let need = tokens.div_ceil(b.tokens.max(1));
            if b.tokens == 0 || b.sums.len() as u64 != need {
                return Err(format(
                    path,
                    format!(
                        "{} block checksums for {tokens} tokens in blocks of {} (expected {need})",
                        b.sums.len(),
                        b.tokens
                    ),
                ));
            }
        }
        Ok(Self {
            path: path.to_owned(),
            map,
            base,
            dtype,
            tokens,
            vocab,
            blocks,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tokens in the file.
    pub fn len(&self) -> u64 {
        self.tokens
    }

    /// Whether the file holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// The bytes of tokens `start..end`, once the file is checked to
    /// still hold them ([`Mapped::check_length`]).
    fn token_bytes(&self, start: u64, end: u64) -> Result<&[u8]> {
        let s = self.dtype.size();
        self.map
            .check_length(&self.path, self.base + end as usize * s)?;
        Ok(self.raw_bytes(start, end))
    }

    /// The bytes of tokens `start..end`, unchecked.
    fn raw_bytes(&self, start: u64, end: u64) -> &[u8] {
        let s = self.dtype.size();
        &self.map.bytes()[self.base + start as usize * s..self.base + end as usize * s]
    }

    /// Checks the blocks that cover tokens `start..end` (each once per
    /// process).
    fn check_blocks(&self, start: u64, end: u64) -> Result<()> {
        let Some(b) = &self.blocks else {
            return Ok(());
        };
        if start >= end {
            return Ok(());
        }
        for i in (start / b.tokens)..=((end - 1) / b.tokens) {
            let i = i as usize;
            if b.checked[i].load(Ordering::Acquire) {
                continue;
            }
            let (s, e) = (
                i as u64 * b.tokens,
                ((i as u64 + 1) * b.tokens).min(self.tokens),
            );
            let found = xxhash_rust::xxh3::xxh3_64(self.token_bytes(s, e)?);
            if found != b.sums[i] {
                return Err(DataError::Corrupt {
                    path: self.path.clone(),
                    part: format!("tokens {s}..{e}"),
                    expected: b.sums[i],
                    found,
                });
            }
            b.checked[i].store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Checks every block: the whole file is read.
    ///
    /// # Errors
    /// A damaged block or an id outside the vocabulary.
    pub fn verify(&self) -> Result<()> {
        self.check_blocks(0, self.tokens)?;
        let mut buf = Vec::new();
        let step = 1 << 20;
        let mut s = 0;
        while s < self.tokens {
            let e = (s + step).min(self.tokens);
            buf.clear();
            self.read(s, e, &mut buf)?;
            s = e;
        }
        Ok(())
    }

    /// Appends tokens `start..end` to `out`, after checking their blocks
    /// and that every id is inside the vocabulary.
    pub(crate) fn read(&self, start: u64, end: u64, out: &mut Vec<u32>) -> Result<()> {
        debug_assert!(start <= end && end <= self.tokens);
        self.check_blocks(start, end)?;
        let first = out.len();
        let bytes = self.token_bytes(start, end)?;
        match self.dtype {
            Dtype::U16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))),
            ),
            Dtype::U32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
        }
        if let Some(k) = out[first..].iter().position(|&t| t as usize >= self.vocab) {
            return Err(DataError::TokenOutOfRange {
                path: self.path.clone(),
                offset: start + k as u64,
                id: out[first + k],
                vocab: self.vocab,
            });
        }
        Ok(())
    }

    /// The token at `i` (unchecked against blocks: for finding document
    /// boundaries when a corpus is opened, never for training; the length
    /// was checked by [`open`](Self::open) just before).
    pub(crate) fn peek(&self, i: u64) -> u32 {
        let b = self.raw_bytes(i, i + 1);
        match self.dtype {
            Dtype::U16 => u32::from(u16::from_le_bytes([b[0], b[1]])),
            Dtype::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        }
    }
}

/// Tokens `start..end` of one shard.
#[derive(Clone, Debug)]
pub(crate) struct Segment {
    pub(crate) shard: Arc<Shard>,
    pub(crate) start: u64,
    pub(crate) end: u64,
}

/// An ordered concatenation of token ranges of shards: one split of a
/// corpus.
#[derive(Clone, Debug, Default)]
pub struct Stream {
    segments: Vec<Segment>,
    /// Stream offset of each segment's first token.
    starts: Vec<u64>,
    len: u64,
}

impl Stream {
    pub(crate) fn new(segments: Vec<Segment>) -> Self {
        let mut starts = Vec::with_capacity(segments.len());
        let mut len = 0;
        let segments: Vec<Segment> = segments.into_iter().filter(|s| s.end > s.start).collect();
        for s in &segments {
            starts.push(len);
            len += s.end - s.start;
        }
        Self {
            segments,
            starts,
            len,
        }
    }

    /// Tokens in the stream.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the stream is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends tokens `pos..pos + n` of the stream to `out`.
    pub(crate) fn read(&self, pos: u64, n: u64, out: &mut Vec<u32>) -> Result<()> {
        debug_assert!(pos + n <= self.len);
        let mut k = self.starts.partition_point(|&s| s <= pos).saturating_sub(1);
        let (mut pos, mut left) = (pos, n);
        while left > 0 {
            let seg = &self.segments[k];
            let off = pos - self.starts[k];
            let take = (seg.end - seg.start - off).min(left);
            seg.shard
                .read(seg.start + off, seg.start + off + take, out)?;
            pos += take;
            left -= take;
            k += 1;
        }
        Ok(())
    }

    /// The distinct shards under the stream.
    pub(crate) fn shards(&self) -> impl Iterator<Item = &Arc<Shard>> {
        let mut last: Option<*const Shard> = None;
        self.segments.iter().filter_map(move |s| {
            let p = Arc::as_ptr(&s.shard);
            (last.replace(p) != Some(p)).then_some(&s.shard)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard truncated after it was mapped (data rewritten during a
    /// run) is an error naming the file, never a SIGBUS death.
    #[test]
    fn a_shard_truncated_after_mapping_is_an_error_not_a_signal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.bin");
        let tokens: Vec<u8> = (0..1u16 << 14).flat_map(u16::to_le_bytes).collect();
        std::fs::write(&path, &tokens).unwrap();
        let shard = Shard::open(&path, 0, Dtype::U16, 1 << 14, 1 << 16, None).unwrap();
        let mut out = Vec::new();
        shard.read(0, 1 << 14, &mut out).unwrap();
        assert_eq!(out.len(), 1 << 14);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(100)
            .unwrap();
        let err = shard.read(8000, 9000, &mut out).unwrap_err().to_string();
        assert!(
            err.contains("shard.bin: the file shrank to 100 bytes"),
            "{err}"
        );
        // what is still in the file reads
        shard.read(0, 50, &mut out).unwrap();
    }
}
