//! Text tokenized when a run starts — with GPT-2's BPE or the run's
//! `tokenizer.json` (`data.tokenizer`) — cached: the token cache file is
//! written once per text and tokenizer (keyed by their hash) and
//! memory-mapped by later runs and by the other ranks of a job, which then
//! read only the pages of the sequences they train on.

use std::path::{Path, PathBuf};

use rand_core::Rng;

use crate::dataset::{Batch, TRAIN, stream};
use crate::error::{DataError, Result};
use crate::tokenizer::Tokenizer;

/// Text tokenized, split into train and validation tokens.
#[derive(Debug)]
pub struct TextData {
    path: PathBuf,
    /// Every token: the training split, then the validation split.
    tokens: Tokens,
    /// Tokens of the training split.
    split: usize,
    seq: usize,
    seed: u64,
    /// The token cache file the tokens are (or were written to), if any.
    cache: Option<PathBuf>,
    /// Size of the tokenizer's id space.
    vocab_size: usize,
    /// The tokenizer's end-of-text id, which joins the documents.
    end_of_text: u32,
}

/// Token ids in memory, or mapped from a token cache file (pages are read
/// when a batch touches them: a rank reads only the sequences it trains
/// on).
enum Tokens {
    Owned(Vec<u32>),
    Mapped(Mapped),
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokens::Owned(v) => write!(f, "Owned({} tokens)", v.len()),
            Tokens::Mapped(m) => write!(f, "Mapped({} tokens)", m.len()),
        }
    }
}

impl Tokens {
    fn len(&self) -> usize {
        match self {
            Tokens::Owned(v) => v.len(),
            Tokens::Mapped(m) => m.len(),
        }
    }

    /// Tokens `a..b`.
    fn slice(&self, a: usize, b: usize) -> Vec<u32> {
        match self {
            Tokens::Owned(v) => v[a..b].to_vec(),
            Tokens::Mapped(m) => match m.ids() {
                Ids::U16(t) => t[a..b].iter().map(|&t| u32::from(t)).collect(),
                Ids::U32(t) => t[a..b].to_vec(),
            },
        }
    }
}

/// A whole token cache file, mapped: a [`CACHE_HEADER`]-byte header, then
/// the token ids as little-endian `u16` (vocabularies of up to 65,536
/// ids) or `u32`.
struct Mapped(crate::shard::Mapped);

/// A cache file's ids, as stored.
enum Ids<'a> {
    U16(&'a [u16]),
    U32(&'a [u32]),
}

/// First bytes of a token cache file (format version 2).
const CACHE_MAGIC: &[u8; 8] = b"WEFTTOK\x02";
/// Bytes of a token cache file's header: magic, token count (u64),
/// xxh3-64 of the token bytes (u64), largest token id (u32), the
/// tokenizer's vocabulary size (u32) and end-of-text id (u32), bytes per
/// id (u32: 2 or 4).
const CACHE_HEADER: usize = 40;

/// How far [`Mapped::open`] checks a token cache file.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Check {
    /// Magic and length.
    Shape,
    /// Also the checksum, every id below the vocabulary size, and the
    /// tokenizer's (vocabulary size, end-of-text): every byte.
    Full(usize, u32),
}

fn u32_at(h: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(h[at..at + 4].try_into().expect("4 bytes"))
}

/// A token cache file's bytes for `tokens` of a tokenizer with `vocab`
/// ids and end-of-text `eot`.
fn cache_bytes(tokens: &[u32], vocab: usize, eot: u32) -> Vec<u8> {
    let wide = vocab > 1 << 16;
    let ids: Vec<u8> = if wide {
        tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
    } else {
        // every id is below the vocabulary size, so fits in 16 bits
        tokens
            .iter()
            .flat_map(|&t| (t as u16).to_le_bytes())
            .collect()
    };
    let max = tokens.iter().copied().max().unwrap_or(0);
    let mut h = vec![0u8; CACHE_HEADER];
    h[..8].copy_from_slice(CACHE_MAGIC);
    h[8..16].copy_from_slice(&(tokens.len() as u64).to_le_bytes());
    h[16..24].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(&ids).to_le_bytes());
    h[24..28].copy_from_slice(&max.to_le_bytes());
    h[28..32].copy_from_slice(&u32::try_from(vocab).unwrap_or(u32::MAX).to_le_bytes());
    h[32..36].copy_from_slice(&eot.to_le_bytes());
    h[36..40].copy_from_slice(&(if wide { 4u32 } else { 2 }).to_le_bytes());
    h.extend(ids);
    h
}

impl Mapped {
    /// Maps `file`, or `None` if it cannot be mapped or fails `check`: a
    /// wrong magic, a length that is not the header's count, or (`Full`) a
    /// checksum that differs, an id outside the vocabulary or another
    /// tokenizer's sizes. `None` on a big-endian machine too.
    ///
    /// Cache files are written to a temporary name and renamed into place,
    /// never changed in place, so the mapped pages stay what they were
    /// when mapped.
    fn open(file: &Path, check: Check) -> Option<Self> {
        if cfg!(target_endian = "big") {
            return None;
        }
        let m = Mapped(crate::shard::Mapped::open(file).ok()?);
        let len = m.bytes().len();
        if len <= CACHE_HEADER {
            return None;
        }
        let head = m.bytes().first_chunk::<CACHE_HEADER>()?;
        let count = u64::from_le_bytes(head[8..16].try_into().ok()?);
        let width = u32_at(head, 36) as usize;
        if &head[..8] != CACHE_MAGIC
            || !matches!(width, 2 | 4)
            || !(len - CACHE_HEADER).is_multiple_of(width)
            || Some(count) != ((len - CACHE_HEADER) as u64).checked_div(width as u64)
        {
            return None;
        }
        if let Check::Full(vocab, eot) = check {
            let sum = u64::from_le_bytes(head[16..24].try_into().ok()?);
            let max = match m.ids() {
                Ids::U16(t) => t.iter().copied().max().map(u32::from),
                Ids::U32(t) => t.iter().copied().max(),
            };
            if xxhash_rust::xxh3::xxh3_64(&m.bytes()[CACHE_HEADER..]) != sum
                || max.unwrap_or(0) as usize >= vocab
                || (m.vocab_size(), m.end_of_text()) != (vocab, eot)
            {
                return None;
            }
        }
        Some(m)
    }

    fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }

    fn vocab_size(&self) -> usize {
        u32_at(self.bytes(), 28) as usize
    }

    fn end_of_text(&self) -> u32 {
        u32_at(self.bytes(), 32)
    }

    fn len(&self) -> usize {
        (self.bytes().len() - CACHE_HEADER) / u32_at(self.bytes(), 36) as usize
    }

    fn ids(&self) -> Ids<'_> {
        let tokens = &self.bytes()[CACHE_HEADER..];
        // SAFETY: a mapping starts on a page boundary, so past the
        // 40-byte header the bytes are aligned for u16 and u32; `open`
        // checked that their length is a multiple of the width the
        // header names, little-endian ids on a little-endian machine;
        // they live as long as `self`.
        unsafe {
            if u32_at(self.bytes(), 36) == 4 {
                Ids::U32(std::slice::from_raw_parts(
                    tokens.as_ptr().cast::<u32>(),
                    tokens.len() / 4,
                ))
            } else {
                Ids::U16(std::slice::from_raw_parts(
                    tokens.as_ptr().cast::<u16>(),
                    tokens.len() / 2,
                ))
            }
        }
    }
}

impl TextData {
    /// Reads a `.txt` file or every `.txt` file of a folder (sorted by name,
    /// joined by the tokenizer's end-of-text token), tokenizes it with
    /// `tokenizer` (using the token cache when it holds this exact text
    /// and tokenizer), and holds out the last `val_fraction` of the
    /// tokens for validation.
    ///
    /// # Errors
    /// [`DataError`] if the path is missing, holds no text, is not UTF-8, or
    /// a split is shorter than `seq + 1` tokens.
    pub fn open(
        path: &Path,
        tokenizer: &Tokenizer,
        seq: usize,
        val_fraction: f64,
        seed: u64,
    ) -> Result<Self> {
        let read = |p: &Path| {
            weft_trace::input::read(p, weft_trace::input::CORPUS_BYTES).map_err(|source| {
                DataError::Read {
                    path: p.to_owned(),
                    source,
                }
            })
        };
        let meta = std::fs::metadata(path).map_err(|source| DataError::Read {
            path: path.to_owned(),
            source,
        })?;
        let files: Vec<PathBuf> = if meta.is_dir() {
            let mut v: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|source| DataError::Read {
                    path: path.to_owned(),
                    source,
                })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "txt"))
                .collect();
            v.sort();
            if v.is_empty() {
                return Err(DataError::NoTextFiles(path.to_owned()));
            }
            v
        } else {
            vec![path.to_owned()]
        };
        let mut docs = Vec::with_capacity(files.len());
        for f in &files {
            let bytes = read(f)?;
            let text = String::from_utf8(bytes).map_err(|e| DataError::NotUtf8 {
                path: f.clone(),
                offset: e.utf8_error().valid_up_to(),
            })?;
            docs.push(text);
        }
        if docs.iter().all(|d| d.trim().is_empty()) {
            return Err(DataError::EmptyText(path.to_owned()));
        }
        let (tokens, cache) = tokenize_cached(&docs, tokenizer)?;
        let ids = (tokenizer.vocab_size(), tokenizer.end_of_text());
        Self::from_tokens(path, tokens, cache, seq, val_fraction, seed, ids)
    }

    /// The data of `path` from its token cache file `cache` (as
    /// [`cache_file`](Self::cache_file) names it after [`open`](Self::open)),
    /// memory-mapped, without reading or tokenizing the text: how the other
    /// ranks of a job open the data one rank has prepared (and verified:
    /// here only the header and the length are checked, so a rank reads
    /// only the pages of the sequences it trains on).
    ///
    /// # Errors
    /// [`DataError::Read`] if the cache file cannot be mapped (missing,
    /// empty, a length that is not the header's); as [`open`](Self::open) for a split too short.
    pub fn open_cache(
        path: &Path,
        cache: &Path,
        seq: usize,
        val_fraction: f64,
        seed: u64,
    ) -> Result<Self> {
        let mapped = Mapped::open(cache, Check::Shape).ok_or_else(|| DataError::Read {
            path: cache.to_owned(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "not a token cache file of this weft (missing, or a wrong header or length)",
            ),
        })?;
        let ids = (mapped.vocab_size(), mapped.end_of_text());
        Self::from_tokens(
            path,
            Tokens::Mapped(mapped),
            Some(cache.to_owned()),
            seq,
            val_fraction,
            seed,
            ids,
        )
    }

    fn from_tokens(
        path: &Path,
        tokens: Tokens,
        cache: Option<PathBuf>,
        seq: usize,
        val_fraction: f64,
        seed: u64,
        (vocab_size, end_of_text): (usize, u32),
    ) -> Result<Self> {
        let n_val = ((tokens.len() as f64) * val_fraction).ceil() as usize;
        let split = tokens.len() - n_val.min(tokens.len());
        for (name, len) in [("train", split), ("validation", tokens.len() - split)] {
            if len < seq + 1 {
                return Err(DataError::TooShort {
                    path: path.to_owned(),
                    split: name,
                    tokens: len as u64,
                    needed: seq as u64 + 1,
                });
            }
        }
        Ok(Self {
            path: path.to_owned(),
            tokens,
            split,
            seq,
            seed,
            cache,
            vocab_size,
            end_of_text,
        })
    }

    /// The token cache file holding these tokens, when there is one.
    pub fn cache_file(&self) -> Option<&Path> {
        self.cache.as_deref()
    }

    /// Size of the tokenizer's id space.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The end-of-text id that joins the documents.
    pub fn end_of_text(&self) -> u32 {
        self.end_of_text
    }

    #[cfg(test)]
    fn train(&self) -> Vec<u32> {
        self.tokens.slice(0, self.split)
    }

    #[cfg(test)]
    fn val(&self) -> Vec<u32> {
        self.tokens.slice(self.split, self.tokens.len())
    }

    /// The data path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tokens in the (train, validation) splits.
    pub fn split_sizes(&self) -> (usize, usize) {
        (self.split, self.tokens.len() - self.split)
    }

    pub(crate) fn train_batch(&self, step: u64, micro: usize, batch: usize) -> Batch {
        let span = (self.split - self.seq) as u64; // > 0 by construction
        let windows: Vec<Vec<u32>> = (0..batch)
            .map(|b| {
                let mut rng = stream(self.seed, TRAIN, step, (micro * batch + b) as u64);
                let start = (rng.next_u64() % span) as usize;
                self.tokens.slice(start, start + self.seq + 1)
            })
            .collect();
        Batch::from_windows(&windows, self.seq)
    }

    pub(crate) fn val_batches(&self, n: usize, batch: usize) -> Vec<Batch> {
        let (len, seq) = (self.tokens.len(), self.seq);
        let windows: Vec<Vec<u32>> = (self.split..)
            .step_by(seq)
            .take_while(|&s| s + seq < len)
            .take(n)
            .map(|s| self.tokens.slice(s, s + seq + 1))
            .collect();
        windows
            .chunks(batch.max(1))
            .map(|w| Batch::from_windows(w, self.seq))
            .collect()
    }
}

/// Where tokenized text is cached: `$WEFT_CACHE`, else
/// `$XDG_CACHE_HOME/weft`, else `~/.cache/weft`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("WEFT_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("weft");
    }
    std::env::var_os("HOME").map_or_else(
        || std::env::temp_dir().join("weft"),
        |h| PathBuf::from(h).join(".cache/weft"),
    )
}

/// Tokenizes the documents with `tok`, joined by its end-of-text token.
/// Results are cached under [`cache_dir`]`/tokens/<xxh3-128 of the
/// tokenizer and the text>.tok` (a header with the token count, an xxh3-64
/// checksum, the largest id and the tokenizer's sizes, then little-endian
/// `u16` ids, or `u32` for vocabularies over 65,536), which later opens map
/// instead of tokenizing once the length, checksum and ids check out; a
/// damaged cache file is ignored and rewritten. Returns the tokens and the
/// cache file, if it exists.
fn tokenize_cached(docs: &[String], tok: &Tokenizer) -> Result<(Tokens, Option<PathBuf>)> {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(b"weft-tokens-v2");
    for part in [tok.id(), tok.end_of_text().to_string()] {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    for d in docs {
        h.update(&(d.len() as u64).to_le_bytes());
        h.update(d.as_bytes());
    }
    let file = cache_dir()
        .join("tokens")
        .join(format!("{:032x}.tok", h.digest128()));
    if let Some(m) = Mapped::open(&file, Check::Full(tok.vocab_size(), tok.end_of_text())) {
        return Ok((Tokens::Mapped(m), Some(file)));
    }
    let mut tokens: Vec<u32> = Vec::new();
    for (i, d) in docs.iter().enumerate() {
        if i > 0 {
            tokens.push(tok.end_of_text());
        }
        tokens.extend(tok.encode(d)?);
    }
    // Write atomically; a failure to cache is not an error.
    let mut cached = None;
    if let Some(dir) = file.parent()
        && std::fs::create_dir_all(dir).is_ok()
    {
        let tmp = file.with_extension(format!("tmp{}", std::process::id()));
        let bytes = cache_bytes(&tokens, tok.vocab_size(), tok.end_of_text());
        if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, &file).is_ok() {
            cached = Some(file);
        } else {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok((Tokens::Owned(tokens), cached))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_tokenized_with_gpt2_bpe_and_split() {
        let gpt2 = Tokenizer::gpt2().unwrap();
        let dir = std::env::temp_dir().join(format!("weft-data-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text = "Hello world. ".repeat(200);
        std::fs::write(dir.join("a.txt"), &text).unwrap();
        std::fs::write(dir.join("b.txt"), &text).unwrap();
        std::fs::write(dir.join("ignored.md"), "not text data").unwrap();
        let t = TextData::open(&dir, &gpt2, 16, 0.1, 1).unwrap();
        let (train, val) = t.split_sizes();
        // "Hello world." = [15496, 995, 13]; a space joins "Hello" → " Hello" = 18435.
        assert_eq!(&t.train()[..4], &[15496, 995, 13, 18435]);
        assert!(t.train().contains(&crate::END_OF_TEXT));
        // Each document: 200 × ["Hello"|" Hello", " world", "."] and a final " ".
        assert_eq!(train + val, 2 * 601 + 1);
        assert_eq!(val, ((train + val) as f64 * 0.1).ceil() as usize);
        // Cached: a second open maps the same tokens, and so does opening
        // the cache file alone (the other ranks of a job).
        let again = TextData::open(&dir, &gpt2, 16, 0.1, 1).unwrap();
        assert!(matches!(again.tokens, Tokens::Mapped(_)));
        assert_eq!(again.train(), t.train());
        let cache = again.cache_file().unwrap().to_owned();
        let other = TextData::open_cache(&dir, &cache, 16, 0.1, 1).unwrap();
        assert_eq!((other.train(), other.val()), (t.train(), t.val()));
        assert_eq!(other.train_batch(5, 1, 3), t.train_batch(5, 1, 3));
        let e = TextData::open_cache(&dir, &dir.join("none.tok"), 16, 0.1, 1).unwrap_err();
        assert!(e.to_string().contains("none.tok"), "{e}");
        // A damaged cache is ignored and rewritten: cut short, one id
        // changed, an id out of the vocabulary, or garbage.
        let good = std::fs::read(&cache).unwrap();
        let mut flipped = good.clone();
        flipped[CACHE_HEADER + 10] ^= 1;
        let mut out_of_range = good.clone();
        out_of_range[CACHE_HEADER..CACHE_HEADER + 2].copy_from_slice(&u16::MAX.to_le_bytes());
        let mut other_tokenizer = good.clone();
        other_tokenizer[32] ^= 1;
        for damaged in [
            good[..good.len() - 2].to_vec(),
            flipped,
            out_of_range,
            other_tokenizer,
            b"not tokens".to_vec(),
        ] {
            std::fs::write(&cache, &damaged).unwrap();
            let reopened = TextData::open(&dir, &gpt2, 16, 0.1, 1).unwrap();
            assert!(matches!(reopened.tokens, Tokens::Owned(_)), "re-tokenized");
            assert_eq!(reopened.train(), t.train());
            assert_eq!(std::fs::read(&cache).unwrap(), good, "and rewritten");
        }
        let b = t.train_batch(3, 0, 2);
        assert_eq!(b.inputs.len(), 32);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_text_inputs_are_clear_errors() {
        let gpt2 = Tokenizer::gpt2().unwrap();
        let dir = std::env::temp_dir().join(format!("weft-data-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.txt");
        let e = TextData::open(&missing, &gpt2, 8, 0.1, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing.txt"), "{e}");
        let empty = dir.join("empty.txt");
        std::fs::write(&empty, "  \n").unwrap();
        let e = TextData::open(&empty, &gpt2, 8, 0.1, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("empty"), "{e}");
        let short = dir.join("short.txt");
        std::fs::write(&short, "a few words only, not enough for a block").unwrap();
        let e = TextData::open(&short, &gpt2, 64, 0.1, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("block size") && e.contains("short.txt"), "{e}");
        let binary = dir.join("bin.txt");
        std::fs::write(&binary, [b'o', b'k', 0xff, 0xfe]).unwrap();
        let e = TextData::open(&binary, &gpt2, 8, 0.1, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("UTF-8") && e.contains("offset 2"), "{e}");
        let empty_dir = dir.join("nothing");
        std::fs::create_dir_all(&empty_dir).unwrap();
        let e = TextData::open(&empty_dir, &gpt2, 8, 0.1, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no .txt"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
