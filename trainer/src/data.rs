//! Training data: the synthetic corpus, text tokenized with GPT-2's BPE on
//! the fly, or prepared token data (`weft data prepare`, Megatron-LM or
//! llm.c files, and blends of them: [`weft_data`]).
//!
//! Every source hands out batches by *position*, not by iterator state:
//! the training batch of optimizer step `s`, micro-batch `k` is a pure
//! function of `(seed, s, k)` — for prepared data, of the sample number
//! `s · train.batch_size + position in the batch`, so it does not depend
//! on how the batch is cut over ranks or micro-batches. A resumed run
//! therefore sees exactly the batches an uninterrupted one would, with
//! nothing to save but the step.

use std::path::{Path, PathBuf};

use rand_core::{Rng, SeedableRng};
use rand_pcg::Pcg64;

use weft_data::{Corpus, Loader, Share};

use crate::config::Config;
use crate::synthetic::{SpecError, SyntheticLanguage};

pub use weft_data::{END_OF_TEXT, GPT2_VOCAB};

/// Token sequences for one micro-batch: `inputs[b·T + t]` is followed by
/// `targets[b·T + t]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// (B, T) input token ids.
    pub inputs: Vec<u32>,
    /// (B, T) next-token targets.
    pub targets: Vec<u32>,
    /// B.
    pub batch: usize,
    /// T.
    pub seq: usize,
}

impl Batch {
    fn from_windows(windows: &[Vec<u32>], seq: usize) -> Self {
        let mut inputs = Vec::with_capacity(windows.len() * seq);
        let mut targets = Vec::with_capacity(windows.len() * seq);
        for w in windows {
            inputs.extend_from_slice(&w[..seq]);
            targets.extend_from_slice(&w[1..=seq]);
        }
        Self {
            inputs,
            targets,
            batch: windows.len(),
            seq,
        }
    }
}

/// Errors reading or preparing data.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// The data path does not exist or cannot be read.
    #[error("cannot read data {path}: {source}")]
    Read {
        /// The path.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A folder holds no `.txt` file.
    #[error("no .txt files in folder {0}")]
    NoTextFiles(PathBuf),
    /// The data has no text in it.
    #[error("data {0} is empty")]
    Empty(PathBuf),
    /// A text file is not UTF-8.
    #[error("{path} is not UTF-8 text (invalid byte at offset {offset})")]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// Byte offset of the first invalid byte.
        offset: usize,
    },
    /// A split has fewer tokens than one training sequence needs.
    #[error(
        "the {split} split of {path} has {tokens} tokens, fewer than model.block_size + 1 = {needed}: \
         use a smaller block size or more data"
    )]
    TooShort {
        /// The data path.
        path: PathBuf,
        /// `train` or `validation`.
        split: &'static str,
        /// Tokens in the split.
        tokens: usize,
        /// Tokens needed.
        needed: usize,
    },
    /// The synthetic corpus settings are invalid.
    #[error(transparent)]
    Synthetic(#[from] SpecError),
    /// The tokenizer could not be built.
    #[error("GPT-2 tokenizer: {0}")]
    Tokenizer(String),
    /// Prepared token data is missing, malformed or damaged.
    #[error(transparent)]
    Tokens(#[from] weft_data::DataError),
}

/// Where batches come from.
#[derive(Debug)]
pub enum Data {
    /// The synthetic language.
    Synthetic(SyntheticData),
    /// Tokenized text.
    Text(TextData),
    /// Prepared token data, or a blend of several.
    Tokens(TokenData),
}

impl Data {
    /// Opens the data source the configuration names.
    ///
    /// # Errors
    /// [`DataError`] for unreadable, empty or too-short data, or invalid
    /// synthetic settings.
    pub fn open(config: &Config) -> Result<Self, DataError> {
        let seq = config.model.block_size;
        if !config.data.blend.is_empty() || Corpus::is_token_data(Path::new(&config.data.source)) {
            TokenData::open(config).map(Data::Tokens)
        } else if config.data.source == "synthetic" {
            let lang = SyntheticLanguage::new(config.data.synthetic.clone())?;
            Ok(Data::Synthetic(SyntheticData {
                lang,
                seq,
                seed: config.train.seed,
            }))
        } else {
            let path = PathBuf::from(&config.data.source);
            TextData::open(&path, seq, config.data.val_fraction, config.train.seed).map(Data::Text)
        }
    }

    /// Size of the token id space.
    pub fn vocab_size(&self) -> usize {
        match self {
            Data::Synthetic(s) => s.lang.vocab_size(),
            Data::Text(_) | Data::Tokens(_) => GPT2_VOCAB,
        }
    }

    /// The training micro-batch of `batch` sequences for optimizer step
    /// `step`, micro-batch `micro`.
    ///
    /// # Errors
    /// Prepared data only: a damaged shard or an id outside the
    /// vocabulary, naming the file (never trained on).
    pub fn train_batch(&self, step: u64, micro: usize, batch: usize) -> Result<Batch, DataError> {
        Ok(match self {
            Data::Synthetic(s) => s.train_batch(step, micro, batch),
            Data::Text(t) => t.train_batch(step, micro, batch),
            Data::Tokens(t) => t.train_batch(step, micro, batch)?,
        })
    }

    /// The first `n` validation sequences (fewer if the validation split
    /// holds fewer), in batches of at most `batch`.
    ///
    /// # Errors
    /// As [`train_batch`](Self::train_batch).
    pub fn val_batches(&self, n: usize, batch: usize) -> Result<Vec<Batch>, DataError> {
        Ok(match self {
            Data::Synthetic(s) => s.val_batches(n, batch),
            Data::Text(t) => t.val_batches(n, batch),
            Data::Tokens(t) => t.val_batches(n, batch)?,
        })
    }

    /// For prepared data, what each dataset gives over the first
    /// `samples` samples (one entry for a single dataset).
    pub fn shares(&self, samples: u64) -> Vec<Share> {
        match self {
            Data::Tokens(t) => t.loader.shares(samples),
            _ => Vec::new(),
        }
    }

    /// The best achievable mean loss (nats per token) on
    /// [`val_batches`](Self::val_batches)`(n, _)`, when known.
    pub fn val_floor(&self, n: usize) -> Option<f64> {
        match self {
            Data::Synthetic(s) => Some(s.val_floor(n)),
            Data::Text(_) | Data::Tokens(_) => None,
        }
    }
}

/// Prepared token data ([`weft_data`]): one corpus, or a blend.
#[derive(Debug)]
pub struct TokenData {
    /// The sequences.
    pub loader: Loader,
    /// Sequences per optimizer step (`train.batch_size`).
    global_batch: u64,
}

impl TokenData {
    /// Opens `data.source` or every corpus of `data.blend`, memory-mapped.
    ///
    /// # Errors
    /// [`DataError::Tokens`] naming the corpus that is missing, malformed,
    /// too short, or not token data.
    pub fn open(config: &Config) -> Result<Self, DataError> {
        let d = &config.data;
        let parts: Vec<(PathBuf, f64)> = if d.blend.is_empty() {
            vec![(PathBuf::from(&d.source), 1.0)]
        } else {
            d.blend
                .iter()
                .map(|b| (PathBuf::from(&b.path), b.weight))
                .collect()
        };
        let corpora = parts
            .into_iter()
            .map(|(p, w)| Corpus::open(&p, d.val_fraction).map(|c| (c, w)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            loader: Loader::new(corpora, config.model.block_size, config.train.seed)?,
            global_batch: config.train.batch_size as u64,
        })
    }

    fn train_batch(&self, step: u64, micro: usize, batch: usize) -> Result<Batch, DataError> {
        let seq = self.loader.seq();
        let mut windows = Vec::with_capacity(batch);
        for b in 0..batch {
            let g = step * self.global_batch + (micro * batch + b) as u64;
            let mut w = Vec::with_capacity(seq + 1);
            self.loader.train_sequence(g, &mut w)?;
            windows.push(w);
        }
        Ok(Batch::from_windows(&windows, seq))
    }

    fn val_batches(&self, n: usize, batch: usize) -> Result<Vec<Batch>, DataError> {
        let all = self.loader.val_sequences(n)?;
        Ok(all
            .chunks(batch.max(1))
            .map(|w| Batch::from_windows(w, self.loader.seq()))
            .collect())
    }
}

/// Mixes a seed, a stream name and indices into an RNG seed (SplitMix64).
fn stream(seed: u64, name: u64, a: u64, b: u64) -> Pcg64 {
    let mut z = seed;
    for v in [name, a, b] {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15).wrapping_add(v);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
    }
    Pcg64::seed_from_u64(z)
}

const TRAIN: u64 = 1;
const VAL: u64 = 2;

/// Batches from the synthetic language: every sequence is a fresh sample.
#[derive(Debug)]
pub struct SyntheticData {
    /// The language.
    pub lang: SyntheticLanguage,
    seq: usize,
    seed: u64,
}

impl SyntheticData {
    fn train_batch(&self, step: u64, micro: usize, batch: usize) -> Batch {
        let windows: Vec<Vec<u32>> = (0..batch)
            .map(|b| {
                let mut rng = stream(self.seed, TRAIN, step, (micro * batch + b) as u64);
                self.lang.sample(self.seq + 1, &mut rng).tokens
            })
            .collect();
        Batch::from_windows(&windows, self.seq)
    }

    fn val_sequence(&self, i: usize) -> crate::synthetic::Sequence {
        self.lang
            .sample(self.seq + 1, &mut stream(self.seed, VAL, i as u64, 0))
    }

    fn val_batches(&self, n: usize, batch: usize) -> Vec<Batch> {
        let all: Vec<Vec<u32>> = (0..n).map(|i| self.val_sequence(i).tokens).collect();
        all.chunks(batch.max(1))
            .map(|w| Batch::from_windows(w, self.seq))
            .collect()
    }

    /// Mean over the targets of the first `n` validation sequences of the
    /// exact entropy of each target given its prefix.
    fn val_floor(&self, n: usize) -> f64 {
        let total: f64 = (0..n)
            .map(|i| self.val_sequence(i).entropy[1..].iter().sum::<f64>())
            .sum();
        total / (n * self.seq) as f64
    }
}

/// Text tokenized with GPT-2's BPE, split into train and validation tokens.
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
}

/// Token ids in memory, or mapped from a token cache file (pages are read
/// when a batch touches them: a rank reads only the sequences it trains
/// on).
enum Tokens {
    Owned(Vec<u16>),
    Mapped(Mapped),
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokens::Owned(v) => write!(f, "Owned({} tokens)", v.len()),
            Tokens::Mapped(m) => write!(f, "Mapped({} tokens)", m.tokens().len()),
        }
    }
}

impl std::ops::Deref for Tokens {
    type Target = [u16];
    fn deref(&self) -> &[u16] {
        match self {
            Tokens::Owned(v) => v,
            Tokens::Mapped(m) => m.tokens(),
        }
    }
}

/// A read-only private mapping of a whole token cache file: a
/// [`CACHE_HEADER`]-byte header (magic, token count, checksum, largest id),
/// then the token ids as little-endian u16.
struct Mapped {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the mapping is read-only and owned by this value; reading it from
// several threads at once is reading immutable memory.
unsafe impl Send for Mapped {}
// SAFETY: as for `Send`.
unsafe impl Sync for Mapped {}

/// First bytes of a token cache file (format version 1).
const CACHE_MAGIC: &[u8; 8] = b"WEFTTOK\x01";
/// Bytes of a token cache file's header: magic, token count (u64),
/// xxh3-64 of the token bytes (u64), largest token id (u32), zero (u32).
const CACHE_HEADER: usize = 32;

/// How far [`Mapped::open`] checks a token cache file.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Check {
    /// Magic and length.
    Shape,
    /// Also the checksum and every id below [`GPT2_VOCAB`]: every byte.
    Full,
}

/// A token cache file's header for `tokens`.
fn cache_header(tokens: &[u16]) -> [u8; CACHE_HEADER] {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let max = tokens.iter().copied().max().unwrap_or(0);
    let mut h = [0u8; CACHE_HEADER];
    h[..8].copy_from_slice(CACHE_MAGIC);
    h[8..16].copy_from_slice(&(tokens.len() as u64).to_le_bytes());
    h[16..24].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(&bytes).to_le_bytes());
    h[24..28].copy_from_slice(&u32::from(max).to_le_bytes());
    h
}

impl Mapped {
    /// Maps `file`, or `None` if it cannot be mapped or fails `check`: a
    /// wrong magic, a length that is not the header's count, or (`Full`) a
    /// checksum that differs or an id outside GPT-2's vocabulary. `None` on
    /// a big-endian machine too.
    ///
    /// Cache files are written to a temporary name and renamed into place,
    /// never changed in place, so the mapped pages stay what they were
    /// when mapped.
    fn open(file: &Path, check: Check) -> Option<Self> {
        use std::os::fd::AsRawFd;
        if cfg!(target_endian = "big") {
            return None;
        }
        let f = std::fs::File::open(file).ok()?;
        let len = usize::try_from(f.metadata().ok()?.len()).ok()?;
        if len <= CACHE_HEADER || len % 2 != 0 {
            return None;
        }
        // SAFETY: a fresh read-only private mapping of an open file of
        // `len` bytes; the result is checked against MAP_FAILED. The
        // descriptor may close afterwards: the mapping keeps the file.
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
            return None;
        }
        let m = Mapped {
            ptr: ptr.cast(),
            len,
        };
        let head = m.bytes().first_chunk::<CACHE_HEADER>()?;
        let count = u64::from_le_bytes(head[8..16].try_into().ok()?);
        if &head[..8] != CACHE_MAGIC || Some(count) != ((len - CACHE_HEADER) as u64).checked_div(2)
        {
            return None;
        }
        if check == Check::Full {
            let sum = u64::from_le_bytes(head[16..24].try_into().ok()?);
            let max = m.tokens().iter().copied().max().unwrap_or(0);
            if xxhash_rust::xxh3::xxh3_64(&m.bytes()[CACHE_HEADER..]) != sum
                || usize::from(max) >= GPT2_VOCAB
            {
                return None;
            }
        }
        Some(m)
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping holds `len` readable bytes for the life of
        // `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn tokens(&self) -> &[u16] {
        // SAFETY: past the header the mapping holds `len − CACHE_HEADER`
        // readable bytes (checked even in `open`) for the life of `self`,
        // at a page-aligned address plus 32 (so aligned for u16); they are
        // little-endian u16 on a little-endian machine (checked in `open`).
        unsafe {
            std::slice::from_raw_parts(
                self.ptr.add(CACHE_HEADER).cast::<u16>(),
                (self.len - CACHE_HEADER) / 2,
            )
        }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `open`, once; no
        // borrow of it outlives `self`.
        unsafe {
            libc::munmap(self.ptr.cast_mut().cast(), self.len);
        }
    }
}

impl TextData {
    /// Reads a `.txt` file or every `.txt` file of a folder (sorted by name,
    /// joined by `<|endoftext|>`), tokenizes it (using the token cache when it
    /// holds this exact text), and holds out the last `val_fraction` of the
    /// tokens for validation.
    ///
    /// # Errors
    /// [`DataError`] if the path is missing, holds no text, is not UTF-8, or
    /// a split is shorter than `seq + 1` tokens.
    pub fn open(path: &Path, seq: usize, val_fraction: f64, seed: u64) -> Result<Self, DataError> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|source| DataError::Read {
                path: p.to_owned(),
                source,
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
            return Err(DataError::Empty(path.to_owned()));
        }
        let (tokens, cache) = tokenize_cached(&docs)?;
        Self::from_tokens(path, tokens, cache, seq, val_fraction, seed)
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
    /// empty, odd length); as [`open`](Self::open) for a split too short.
    pub fn open_cache(
        path: &Path,
        cache: &Path,
        seq: usize,
        val_fraction: f64,
        seed: u64,
    ) -> Result<Self, DataError> {
        let mapped = Mapped::open(cache, Check::Shape).ok_or_else(|| DataError::Read {
            path: cache.to_owned(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "not a token cache file of this weft (missing, or a wrong header or length)",
            ),
        })?;
        Self::from_tokens(
            path,
            Tokens::Mapped(mapped),
            Some(cache.to_owned()),
            seq,
            val_fraction,
            seed,
        )
    }

    fn from_tokens(
        path: &Path,
        tokens: Tokens,
        cache: Option<PathBuf>,
        seq: usize,
        val_fraction: f64,
        seed: u64,
    ) -> Result<Self, DataError> {
        let n_val = ((tokens.len() as f64) * val_fraction).ceil() as usize;
        let split = tokens.len() - n_val.min(tokens.len());
        for (name, len) in [("train", split), ("validation", tokens.len() - split)] {
            if len < seq + 1 {
                return Err(DataError::TooShort {
                    path: path.to_owned(),
                    split: name,
                    tokens: len,
                    needed: seq + 1,
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
        })
    }

    /// The token cache file holding these tokens, when there is one.
    pub fn cache_file(&self) -> Option<&Path> {
        self.cache.as_deref()
    }

    fn train(&self) -> &[u16] {
        &self.tokens[..self.split]
    }

    fn val(&self) -> &[u16] {
        &self.tokens[self.split..]
    }

    /// The data path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tokens in the (train, validation) splits.
    pub fn split_sizes(&self) -> (usize, usize) {
        (self.split, self.tokens.len() - self.split)
    }

    fn train_batch(&self, step: u64, micro: usize, batch: usize) -> Batch {
        let train = self.train();
        let span = (train.len() - self.seq) as u64; // > 0 by construction
        let windows: Vec<Vec<u32>> = (0..batch)
            .map(|b| {
                let mut rng = stream(self.seed, TRAIN, step, (micro * batch + b) as u64);
                let start = (rng.next_u64() % span) as usize;
                train[start..=start + self.seq]
                    .iter()
                    .map(|&t| u32::from(t))
                    .collect()
            })
            .collect();
        Batch::from_windows(&windows, self.seq)
    }

    fn val_batches(&self, n: usize, batch: usize) -> Vec<Batch> {
        let windows: Vec<Vec<u32>> = self
            .val()
            .windows(self.seq + 1)
            .step_by(self.seq)
            .take(n)
            .map(|w| w.iter().map(|&t| u32::from(t)).collect())
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

/// Tokenizes the documents with GPT-2's BPE, joined by `<|endoftext|>`.
/// Results are cached under [`cache_dir`]`/tokens/<xxh3-128 of the
/// text>.tok` (a header with the token count, an xxh3-64 checksum and the
/// largest id, then little-endian u16 token ids), which later opens map
/// instead of tokenizing once the length, checksum and ids check out; a
/// damaged cache file is ignored and rewritten. Returns the tokens and the
/// cache file, if it exists.
fn tokenize_cached(docs: &[String]) -> Result<(Tokens, Option<PathBuf>), DataError> {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(b"weft-gpt2-bpe-v1");
    for d in docs {
        h.update(&(d.len() as u64).to_le_bytes());
        h.update(d.as_bytes());
    }
    let file = cache_dir()
        .join("tokens")
        .join(format!("{:032x}.tok", h.digest128()));
    if let Some(m) = Mapped::open(&file, Check::Full) {
        return Ok((Tokens::Mapped(m), Some(file)));
    }
    let bpe = tiktoken_rs::r50k_base().map_err(|e| DataError::Tokenizer(e.to_string()))?;
    let mut tokens: Vec<u16> = Vec::new();
    for (i, d) in docs.iter().enumerate() {
        if i > 0 {
            tokens.push(END_OF_TEXT as u16);
        }
        // Every GPT-2 token id is below 50257 < 2^16.
        tokens.extend(bpe.encode_ordinary(d).into_iter().map(|t| t as u16));
    }
    // Write atomically; a failure to cache is not an error.
    let mut cached = None;
    if let Some(dir) = file.parent()
        && std::fs::create_dir_all(dir).is_ok()
    {
        let tmp = file.with_extension(format!("tmp{}", std::process::id()));
        let mut bytes = cache_header(&tokens).to_vec();
        bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
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

    fn config(source: &str, block: usize) -> Config {
        let mut c = Config::default();
        c.data.source = source.to_owned();
        c.model.block_size = block;
        c
    }

    #[test]
    fn synthetic_batches_are_pure_functions_of_position() {
        let d = Data::open(&config("synthetic", 32)).unwrap();
        let a = d.train_batch(7, 1, 4).unwrap();
        assert_eq!(a, d.train_batch(7, 1, 4).unwrap());
        assert_ne!(a, d.train_batch(8, 1, 4).unwrap());
        assert_ne!(a, d.train_batch(7, 0, 4).unwrap());
        assert_eq!((a.batch, a.seq, a.inputs.len()), (4, 32, 128));
        // Targets are inputs shifted by one.
        assert_eq!(a.inputs[1..32], a.targets[..31]);
        let floor = d.val_floor(16).unwrap();
        assert!(floor > 0.5 && floor < 2.0, "{floor}");
        let val = d.val_batches(10, 4).unwrap();
        assert_eq!(
            val.iter().map(|b| b.batch).collect::<Vec<_>>(),
            vec![4, 4, 2]
        );
    }

    #[test]
    fn text_is_tokenized_with_gpt2_bpe_and_split() {
        let dir = std::env::temp_dir().join(format!("weft-data-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text = "Hello world. ".repeat(200);
        std::fs::write(dir.join("a.txt"), &text).unwrap();
        std::fs::write(dir.join("b.txt"), &text).unwrap();
        std::fs::write(dir.join("ignored.md"), "not text data").unwrap();
        let t = TextData::open(&dir, 16, 0.1, 1).unwrap();
        let (train, val) = t.split_sizes();
        // "Hello world." = [15496, 995, 13]; a space joins "Hello" → " Hello" = 18435.
        assert_eq!(&t.train()[..4], &[15496, 995, 13, 18435]);
        assert!(t.train().contains(&(END_OF_TEXT as u16)));
        // Each document: 200 × ["Hello"|" Hello", " world", "."] and a final " ".
        assert_eq!(train + val, 2 * 601 + 1);
        assert_eq!(val, ((train + val) as f64 * 0.1).ceil() as usize);
        // Cached: a second open maps the same tokens, and so does opening
        // the cache file alone (the other ranks of a job).
        let again = TextData::open(&dir, 16, 0.1, 1).unwrap();
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
        for damaged in [
            good[..good.len() - 2].to_vec(),
            flipped,
            out_of_range,
            b"not tokens".to_vec(),
        ] {
            std::fs::write(&cache, &damaged).unwrap();
            let reopened = TextData::open(&dir, 16, 0.1, 1).unwrap();
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
        let dir = std::env::temp_dir().join(format!("weft-data-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.txt");
        let e = TextData::open(&missing, 8, 0.1, 0).unwrap_err().to_string();
        assert!(e.contains("missing.txt"), "{e}");
        let empty = dir.join("empty.txt");
        std::fs::write(&empty, "  \n").unwrap();
        let e = TextData::open(&empty, 8, 0.1, 0).unwrap_err().to_string();
        assert!(e.contains("empty"), "{e}");
        let short = dir.join("short.txt");
        std::fs::write(&short, "a few words only, not enough for a block").unwrap();
        let e = TextData::open(&short, 64, 0.1, 0).unwrap_err().to_string();
        assert!(e.contains("block_size") && e.contains("short.txt"), "{e}");
        let binary = dir.join("bin.txt");
        std::fs::write(&binary, [b'o', b'k', 0xff, 0xfe]).unwrap();
        let e = TextData::open(&binary, 8, 0.1, 0).unwrap_err().to_string();
        assert!(e.contains("UTF-8") && e.contains("offset 2"), "{e}");
        let empty_dir = dir.join("nothing");
        std::fs::create_dir_all(&empty_dir).unwrap();
        let e = TextData::open(&empty_dir, 8, 0.1, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no .txt"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
