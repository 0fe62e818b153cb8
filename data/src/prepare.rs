//! `weft data prepare`: text in, token shards out.
//!
//! Inputs are `.txt` files (one document each), `.jsonl` files (one
//! document per line, its text in a field, `"text"` by default), either
//! gzip-compressed (`.txt.gz`, `.jsonl.gz`), and folders of them, read
//! recursively in path order. Documents are tokenized — with GPT-2's BPE,
//! or a Hugging Face `tokenizer.json` ([`PrepareOptions::tokenizer`]) —
//! in parallel over the cores, in batches reassembled in input order, so
//! the bytes written do not depend on the thread count, and each gets
//! the tokenizer's end-of-text token appended. Ids are stored as `u16`
//! when the tokenizer has at most 65,536 ids, else as `u32`.
//!
//! Output goes to shards of at most [`PrepareOptions::shard_tokens`]
//! tokens (a document never straddles two). Each shard is written under
//! a temporary name and renamed, then recorded in `prepare.partial.json`;
//! `index.json` is written last. A preparation that is interrupted —
//! killed, or stopped by its progress callback — resumes when run again
//! with the same inputs: the recorded shards are verified against their
//! checksums and kept, and tokenizing continues after the last one.

use std::collections::HashSet;
use std::io::{BufRead, Read};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::error::{DataError, Result, io};
use crate::format::{
    BLOCK_TOKENS, FORMAT, INDEX, Index, InputFile, PARTIAL, Settings, ShardEntry, TOKENIZER,
    VERSION, hex, verify_file, write_atomic,
};
use crate::shard::Dtype;
use crate::tokenizer::{GPT2, TokenizerSpec};

/// How to prepare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrepareOptions {
    /// Shard size bound in tokens (default 2^27: 256 MiB of `u16`).
    pub shard_tokens: u64,
    /// The `.jsonl` field holding a document's text (default `"text"`).
    pub text_key: String,
    /// Tokenizer threads; 0 for every core.
    pub threads: usize,
    /// The tokenizer (default GPT-2's BPE).
    pub tokenizer: TokenizerSpec,
}

impl Default for PrepareOptions {
    fn default() -> Self {
        Self {
            shard_tokens: 1 << 27,
            text_key: "text".into(),
            threads: 0,
            tokenizer: TokenizerSpec::Gpt2,
        }
    }
}

/// Where a preparation is, for a progress display.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    /// Documents tokenized so far (this run).
    pub documents: u64,
    /// Tokens written or pending so far (this run).
    pub tokens: u64,
    /// Input bytes read (compressed bytes for `.gz`).
    pub bytes_read: u64,
    /// Input bytes in all.
    pub bytes_total: u64,
    /// Shards finished, resumed ones included.
    pub shards: u64,
    /// Time since this run started.
    pub elapsed: Duration,
}

/// What a preparation did.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PrepareReport {
    /// Documents in the folder.
    pub documents: u64,
    /// Tokens in the folder.
    pub tokens: u64,
    /// Shards in the folder.
    pub shards: u64,
    /// Shards kept from an earlier, interrupted run (verified).
    pub resumed_shards: u64,
    /// Empty input documents left out.
    pub empty_documents: u64,
    /// Input bytes.
    pub input_bytes: u64,
    /// Whether the folder was already complete (nothing was written).
    pub already_prepared: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Txt,
    Jsonl,
}

struct Input {
    path: PathBuf,
    shown: String,
    bytes: u64,
    modified_ns: Option<u64>,
    kind: Kind,
    gz: bool,
}

/// The size and modification time (ns since the epoch, where the system
/// has it) of `path`: what identifies an input's content.
fn identity(path: &Path) -> Result<(u64, Option<u64>)> {
    let meta = std::fs::metadata(path).map_err(io(path))?;
    let ns = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .and_then(|d| u64::try_from(d.as_nanos()).ok());
    Ok((meta.len(), ns))
}

/// The kind of input `path` names, by its name's ending (a name that is
/// not UTF-8 is read like any other).
fn kind_of(path: &Path) -> Option<(Kind, bool)> {
    let name = path.file_name()?.as_encoded_bytes();
    let (stem, gz) = match name.strip_suffix(b".gz") {
        Some(s) => (s, true),
        None => (name, false),
    };
    if stem.ends_with(b".txt") {
        Some((Kind::Txt, gz))
    } else if stem.ends_with(b".jsonl") {
        Some((Kind::Jsonl, gz))
    } else {
        None
    }
}

/// The inputs under `dir`, each real folder and file once (`seen` holds
/// the canonical paths visited: a link loop such as `ln -s . in/loop` or
/// two links to one file add nothing).
fn walk(dir: &Path, out: &mut Vec<PathBuf>, seen: &mut HashSet<PathBuf>) -> Result<()> {
    if !seen.insert(std::fs::canonicalize(dir).map_err(io(dir))?) {
        return Ok(());
    }
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .map(|e| e.map(|e| e.path()).map_err(io(dir)))
        .collect::<Result<_>>()?;
    entries.sort();
    for p in entries {
        let hidden = p
            .file_name()
            .is_some_and(|n| n.as_encoded_bytes().starts_with(b"."));
        if hidden {
            continue;
        }
        if p.is_dir() {
            walk(&p, out, seen)?;
        } else if kind_of(&p).is_some() && seen.insert(std::fs::canonicalize(&p).map_err(io(&p))?) {
            out.push(p);
        }
    }
    Ok(())
}

fn list_inputs(inputs: &[PathBuf]) -> Result<Vec<Input>> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    for arg in inputs {
        let meta = std::fs::metadata(arg).map_err(io(arg))?;
        let files = if meta.is_dir() {
            let mut v = Vec::new();
            walk(arg, &mut v, &mut seen)?;
            v
        } else {
            if kind_of(arg).is_none() {
                return Err(DataError::UnsupportedInput(arg.clone()));
            }
            vec![arg.clone()]
        };
        for path in files {
            let (kind, gz) = kind_of(&path).expect("listed by kind");
            let (bytes, modified_ns) = identity(&path)?;
            out.push(Input {
                shown: path.display().to_string(),
                path,
                bytes,
                modified_ns,
                kind,
                gz,
            });
        }
    }
    if out.is_empty() {
        let names: Vec<String> = inputs.iter().map(|p| p.display().to_string()).collect();
        return Err(DataError::NoInputs(names.join(", ")));
    }
    Ok(out)
}

/// Counts the bytes read through it.
struct Counting<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// The most tokenizer threads per core `--threads` may ask for.
pub const MAX_THREADS_PER_CORE: usize = 4;

/// Calls `each` with every document of `input` (empty ones included).
fn documents(
    input: &Input,
    text_key: &str,
    count: &Arc<AtomicU64>,
    each: &mut dyn FnMut(String) -> Result<ControlFlow<()>>,
) -> Result<ControlFlow<()>> {
    use weft_trace::input::{DOCUMENT_BYTES, Limited, read_line};
    let file = weft_trace::input::open(&input.path).map_err(io(&input.path))?;
    let raw = Counting {
        inner: file,
        count: count.clone(),
    };
    let mut reader: Box<dyn BufRead> = if input.gz {
        Box::new(std::io::BufReader::with_capacity(
            1 << 20,
            flate2::read::MultiGzDecoder::new(std::io::BufReader::new(raw)),
        ))
    } else {
        Box::new(std::io::BufReader::with_capacity(1 << 20, raw))
    };
    match input.kind {
        Kind::Txt => {
            // One document: bounded (a small .txt.gz may inflate to GBs).
            let what = "the text (one document per .txt; split it into several files)";
            let mut bytes = Vec::new();
            Limited::new(reader, DOCUMENT_BYTES, what)
                .read_to_end(&mut bytes)
                .map_err(io(&input.path))?;
            let text = String::from_utf8(bytes).map_err(|e| DataError::NotUtf8 {
                path: input.path.clone(),
                offset: e.utf8_error().valid_up_to(),
            })?;
            each(text)
        }
        Kind::Jsonl => {
            let mut line = Vec::new();
            let mut number = 0u64;
            let mut offset = 0usize;
            loop {
                let n = read_line(&mut reader, &mut line, DOCUMENT_BYTES).map_err(|e| {
                    DataError::BadJsonl {
                        path: input.path.clone(),
                        line: number + 1,
                        what: e.to_string(),
                    }
                })?;
                if n == 0 {
                    return Ok(ControlFlow::Continue(()));
                }
                number += 1;
                let text = std::str::from_utf8(&line).map_err(|e| DataError::NotUtf8 {
                    path: input.path.clone(),
                    offset: offset + e.valid_up_to(),
                })?;
                offset += n;
                if text.trim().is_empty() {
                    continue;
                }
                let bad = |what: String| DataError::BadJsonl {
                    path: input.path.clone(),
                    line: number,
                    what,
                };
                let value: serde_json::Value =
                    serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
                let doc = match value.get(text_key) {
                    Some(serde_json::Value::String(s)) => s.clone(),
                    Some(_) => return Err(bad(format!("field {text_key:?} is not a string"))),
                    None => {
                        return Err(bad(format!(
                            "no field {text_key:?} (choose it with --text-key)"
                        )));
                    }
                };
                if each(doc)?.is_break() {
                    return Ok(ControlFlow::Break(()));
                }
            }
        }
    }
}

/// The shard being filled, and the index of the finished ones.
struct Writer<'a> {
    dir: &'a Path,
    index: Index,
    tokens: Vec<u32>,
    ends: Vec<u64>,
}

impl Writer<'_> {
    fn shard_names(k: usize) -> (String, String) {
        (format!("shard-{k:05}.bin"), format!("shard-{k:05}.idx"))
    }

    /// Appends document `raw` (its tokens, then end-of-text).
    fn add(&mut self, raw: u64, doc: &[u32]) -> Result<()> {
        if doc.is_empty() {
            self.index.empty_documents += 1;
            return Ok(());
        }
        let limit = self.index.settings.shard_tokens;
        let n = doc.len() as u64 + 1;
        if !self.tokens.is_empty() && self.tokens.len() as u64 + n > limit {
            self.flush(raw)?;
        }
        self.tokens.extend_from_slice(doc);
        self.tokens.push(self.index.end_of_text);
        self.ends.push(self.tokens.len() as u64);
        if self.tokens.len() as u64 >= limit {
            self.flush(raw + 1)?;
        }
        Ok(())
    }

    /// Writes the current shard and records it; `next` is the first
    /// input document it does not hold.
    fn flush(&mut self, next: u64) -> Result<()> {
        if self.tokens.is_empty() {
            return Ok(());
        }
        let (bin, idx) = Self::shard_names(self.index.shards.len());
        // Every id is below the vocabulary size, which decided the dtype.
        let bin_bytes: Vec<u8> = match self.index.dtype {
            Dtype::U16 => self
                .tokens
                .iter()
                .flat_map(|&t| (t as u16).to_le_bytes())
                .collect(),
            Dtype::U32 => self.tokens.iter().flat_map(|t| t.to_le_bytes()).collect(),
        };
        let idx_bytes: Vec<u8> = self.ends.iter().flat_map(|e| e.to_le_bytes()).collect();
        let block = BLOCK_TOKENS as usize * self.index.dtype.size();
        let blocks = bin_bytes
            .chunks(block)
            .map(|c| hex(xxhash_rust::xxh3::xxh3_64(c)))
            .collect();
        write_atomic(&self.dir.join(&bin), &bin_bytes)?;
        write_atomic(&self.dir.join(&idx), &idx_bytes)?;
        self.index.shards.push(ShardEntry {
            bin,
            idx,
            tokens: self.tokens.len() as u64,
            documents: self.ends.len() as u64,
            next_input_document: next,
            bin_xxh3: hex(xxhash_rust::xxh3::xxh3_64(&bin_bytes)),
            idx_xxh3: hex(xxhash_rust::xxh3::xxh3_64(&idx_bytes)),
            blocks,
        });
        self.index.tokens += self.tokens.len() as u64;
        self.index.documents += self.ends.len() as u64;
        self.tokens.clear();
        self.ends.clear();
        self.index.write(&self.dir.join(PARTIAL))
    }
}

/// The first way two settings differ, for an error message.
fn first_difference(a: &Settings, b: &Settings) -> String {
    if (&a.tokenizer, &a.tokenizer_xxh3) != (&b.tokenizer, &b.tokenizer_xxh3) {
        let show = |s: &Settings| match &s.tokenizer_xxh3 {
            Some(h) => format!("a tokenizer.json of xxh3 {h}"),
            None => format!("{:?}", s.tokenizer),
        };
        return format!("tokenizer {} vs {}", show(a), show(b));
    }
    if a.end_of_text_token != b.end_of_text_token {
        return format!(
            "end-of-text token {:?} vs {:?}",
            a.end_of_text_token, b.end_of_text_token
        );
    }
    if a.text_key != b.text_key {
        return format!("text key {:?} vs {:?}", a.text_key, b.text_key);
    }
    if a.shard_tokens != b.shard_tokens {
        return format!("shard size {} vs {} tokens", a.shard_tokens, b.shard_tokens);
    }
    for (x, y) in a.inputs.iter().zip(&b.inputs) {
        if x != y {
            let when = |t: Option<u64>| t.map_or("?".into(), |t| t.to_string());
            return format!(
                "input {} ({} bytes, modified at {} ns) vs {} ({} bytes, modified at {} ns)",
                x.path,
                x.bytes,
                when(x.modified_ns),
                y.path,
                y.bytes,
                when(y.modified_ns)
            );
        }
    }
    format!("{} input files vs {}", a.inputs.len(), b.inputs.len())
}

/// Tokenizes `inputs` into a prepared folder `out` (see the module docs),
/// calling `progress` after every batch of documents; a `Break` from it
/// stops the preparation ([`DataError::Interrupted`]) with the finished
/// shards kept for a resume.
///
/// # Errors
/// Unreadable, non-UTF-8 or malformed inputs (naming file and line), no
/// inputs, no text; an `out` that holds something else or a preparation
/// of other inputs ([`DataError::OutputInUse`]: nothing is overwritten).
pub fn prepare(
    inputs: &[PathBuf],
    out: &Path,
    options: &PrepareOptions,
    progress: &mut dyn FnMut(&Progress) -> ControlFlow<()>,
) -> Result<PrepareReport> {
    let started = Instant::now();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    if options.threads > MAX_THREADS_PER_CORE * cores {
        return Err(DataError::Setting {
            name: "--threads",
            what: format!(
                "{} tokenizer threads, more than {MAX_THREADS_PER_CORE} per core of this machine's {cores}",
                options.threads
            ),
        });
    }
    let files = list_inputs(inputs)?;
    let tok = options.tokenizer.load()?;
    let hf = tok.file().is_some();
    let settings = Settings {
        tokenizer: if hf { TOKENIZER } else { GPT2 }.into(),
        tokenizer_xxh3: hf.then(|| tok.id()),
        end_of_text_token: hf.then(|| tok.end_of_text_token().to_owned()),
        text_key: options.text_key.clone(),
        shard_tokens: options.shard_tokens.max(1),
        inputs: files
            .iter()
            .map(|f| InputFile {
                path: f.shown.clone(),
                bytes: f.bytes,
                modified_ns: f.modified_ns,
            })
            .collect(),
    };
    let bytes_total: u64 = files.iter().map(|f| f.bytes).sum();
    let in_use = |what: String| DataError::OutputInUse {
        dir: out.to_owned(),
        what,
    };
    let report = |index: &Index, resumed: u64, already: bool| PrepareReport {
        documents: index.documents,
        tokens: index.tokens,
        shards: index.shards.len() as u64,
        resumed_shards: resumed,
        empty_documents: index.empty_documents,
        input_bytes: bytes_total,
        already_prepared: already,
    };

    // What is there already.
    let mut index = Index {
        format: FORMAT.into(),
        version: VERSION,
        dtype: if tok.vocab_size() <= 1 << 16 {
            Dtype::U16
        } else {
            Dtype::U32
        },
        vocab_size: tok.vocab_size(),
        end_of_text: tok.end_of_text(),
        block_tokens: BLOCK_TOKENS,
        settings: settings.clone(),
        documents: 0,
        tokens: 0,
        empty_documents: 0,
        shards: Vec::new(),
    };
    let mut resume_from = 0u64;
    if out.join(INDEX).exists() {
        let done = Index::read(&out.join(INDEX))?;
        if done.settings != settings {
            return Err(in_use(format!(
                "holds a preparation of other inputs or settings ({}); use another --out or remove it",
                first_difference(&done.settings, &settings)
            )));
        }
        for s in &done.shards {
            verify_file(&out.join(&s.bin), &s.bin_xxh3)?;
            verify_file(&out.join(&s.idx), &s.idx_xxh3)?;
        }
        return Ok(report(&done, done.shards.len() as u64, true));
    } else if out.join(PARTIAL).exists() {
        let partial = Index::read(&out.join(PARTIAL))?;
        if partial.settings != settings {
            return Err(in_use(format!(
                "holds an unfinished preparation of other inputs or settings ({}); use another --out or remove it",
                first_difference(&partial.settings, &settings)
            )));
        }
        // Keep the longest run of shards that verify.
        let mut good = 0;
        for s in &partial.shards {
            let ok = verify_file(&out.join(&s.bin), &s.bin_xxh3).is_ok()
                && verify_file(&out.join(&s.idx), &s.idx_xxh3).is_ok();
            if !ok {
                break;
            }
            good += 1;
        }
        // A damaged shard restarts the preparation (the count of empty
        // documents is recorded for the last shard only).
        if good < partial.shards.len() {
            good = 0;
        }
        index = partial;
        index.shards.truncate(good);
        index.documents = index.shards.iter().map(|s| s.documents).sum();
        index.tokens = index.shards.iter().map(|s| s.tokens).sum();
        resume_from = index.shards.last().map_or(0, |s| s.next_input_document);
        if good == 0 {
            index.empty_documents = 0;
        }
    } else if out.exists() {
        let mut entries = std::fs::read_dir(out).map_err(io(out))?;
        if entries.next().is_some() {
            return Err(in_use(
                "is not empty and holds no weft preparation; refusing to write into it".into(),
            ));
        }
    } else {
        std::fs::create_dir_all(out).map_err(io(out))?;
    }
    let resumed = index.shards.len() as u64;
    if let Some((_, bytes)) = tok.file() {
        write_atomic(&out.join(TOKENIZER), bytes)?;
    }

    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(options.threads)
        .build()
        .map_err(|e| DataError::Tokenizer {
            path: PathBuf::from("--threads"),
            what: e.to_string(),
        })?;
    let mut writer = Writer {
        dir: out,
        index,
        tokens: Vec::new(),
        ends: Vec::new(),
    };
    let count = Arc::new(AtomicU64::new(0));
    let mut shown = Progress {
        bytes_total,
        ..Progress::default()
    };
    let mut batch: Vec<(u64, String)> = Vec::new();
    let mut batch_bytes = 0usize;
    let mut raw = 0u64;
    const BATCH_BYTES: usize = 8 << 20;
    const BATCH_DOCS: usize = 8192;

    let mut run_batch = |batch: &mut Vec<(u64, String)>,
                         writer: &mut Writer<'_>,
                         shown: &mut Progress|
     -> Result<ControlFlow<()>> {
        let tokens: Vec<Vec<u32>> = pool.install(|| {
            batch
                .par_iter()
                .map(|(_, d)| tok.encode(d))
                .collect::<Result<_>>()
        })?;
        for ((r, _), t) in batch.iter().zip(&tokens) {
            writer.add(*r, t)?;
            shown.documents += u64::from(!t.is_empty());
            shown.tokens += if t.is_empty() { 0 } else { t.len() as u64 + 1 };
        }
        batch.clear();
        shown.bytes_read = count.load(Ordering::Relaxed);
        shown.shards = writer.index.shards.len() as u64;
        shown.elapsed = started.elapsed();
        Ok(progress(shown))
    };

    let mut stopped = false;
    'files: for f in &files {
        let flow = documents(f, &options.text_key, &count, &mut |doc| {
            let r = raw;
            raw += 1;
            if r < resume_from {
                return Ok(ControlFlow::Continue(()));
            }
            batch_bytes += doc.len();
            batch.push((r, doc));
            if batch_bytes >= BATCH_BYTES || batch.len() >= BATCH_DOCS {
                batch_bytes = 0;
                return run_batch(&mut batch, &mut writer, &mut shown);
            }
            Ok(ControlFlow::Continue(()))
        })?;
        if flow.is_break() {
            stopped = true;
            break 'files;
        }
        // what was read is what the index records, or nothing is kept
        let now = identity(&f.path)?;
        if now != (f.bytes, f.modified_ns) {
            return Err(DataError::InputChanged {
                path: f.path.clone(),
                then: f.bytes,
                now: now.0,
            });
        }
    }
    if !stopped && run_batch(&mut batch, &mut writer, &mut shown)?.is_break() {
        stopped = true;
    }
    if stopped {
        return Err(DataError::Interrupted(out.to_owned()));
    }
    writer.flush(raw)?;
    let index = writer.index;
    if index.documents == 0 {
        let _ = std::fs::remove_file(out.join(PARTIAL));
        return Err(DataError::Empty);
    }
    index.write(&out.join(INDEX))?;
    let _ = std::fs::remove_file(out.join(PARTIAL));
    // Files of an interrupted run that the index does not name.
    let named: HashSet<&str> = index
        .shards
        .iter()
        .flat_map(|s| [s.bin.as_str(), s.idx.as_str()])
        .collect();
    for e in std::fs::read_dir(out).map_err(io(out))?.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let ours = name.starts_with("shard-") || name.ends_with(".tmp");
        if ours && !named.contains(name.as_ref()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
    Ok(report(&index, resumed, false))
}
