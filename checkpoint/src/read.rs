//! Loading: opening, verifying and reading (parts of) checkpoints.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use crate::dtype::Dtype;
use crate::error::{Error, IoContext, Result};
use crate::manifest::{FileEntry, Layout, Manifest, ShardEntry, TrainerState};
use crate::region::{Region, for_each_run};
use crate::safetensors::{SafetensorsHeader, header_len, parse_header};
use crate::write::{LATEST_FILE, parse_step_dir};

/// Bytes read per I/O call when a read does not land on whole chunks.
const WINDOW_BYTES: u64 = 8 * 1024 * 1024;
/// Reads of at least two pieces of this size are pipelined (read ‖ verify).
const PIPELINE_PIECE_BYTES: u64 = 4 * 1024 * 1024;

fn read_at(file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
    }
    #[cfg(not(unix))]
    {
        use std::io::{Seek, SeekFrom};
        let mut f = file;
        f.seek(SeekFrom::Start(offset))?;
        f.read_exact(buf)
    }
}

/// An opened checkpoint folder whose manifest is valid and whose shard files
/// exist, have the recorded sizes, and have headers agreeing with the
/// manifest. Tensor bytes are checked against their checksums as they are
/// read.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
}

/// What [`Checkpoint::verify`] checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    /// Shard files checked.
    pub files: usize,
    /// Tensors checked.
    pub tensors: usize,
    /// Shards checked.
    pub shards: usize,
    /// Bytes read and checksummed.
    pub bytes: u64,
}

impl Checkpoint {
    /// Opens `dir`: reads and validates `manifest.json`, then checks each
    /// shard file's size and safetensors header against it. Does not read
    /// tensor data (see [`Checkpoint::verify`]).
    ///
    /// # Errors
    /// [`Error::Manifest`], [`Error::Truncated`], [`Error::Header`],
    /// [`Error::Mismatch`] or [`Error::Io`], each naming the file.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let manifest = Manifest::read(dir)?;
        let mut by_file: BTreeMap<&str, Vec<(&str, Dtype, &ShardEntry)>> = BTreeMap::new();
        for (name, t) in &manifest.tensors {
            for s in &t.shards {
                by_file.entry(&s.file).or_default().push((name, t.dtype, s));
            }
        }
        for fe in &manifest.files {
            let path = dir.join(&fe.name);
            let expected = by_file.remove(fe.name.as_str()).unwrap_or_default();
            let header = read_file_header(&path, fe, &expected)?;
            if header.entries.len() != expected.len() {
                return Err(Error::Mismatch {
                    path,
                    tensor: String::new(),
                    reason: format!(
                        "header lists {} tensors, manifest {}",
                        header.entries.len(),
                        expected.len()
                    ),
                });
            }
            for (name, dtype, s) in expected {
                let mismatch = |reason: String| Error::Mismatch {
                    path: path.clone(),
                    tensor: name.to_owned(),
                    reason,
                };
                let Some(h) = header.get(name) else {
                    return Err(mismatch("not in the file's header".into()));
                };
                if h.dtype != dtype || h.shape != s.shape || h.start != s.byte_offset {
                    return Err(mismatch(format!(
                        "header says {} {:?} at byte {}, manifest {} {:?} at byte {}",
                        h.dtype, h.shape, h.start, dtype, s.shape, s.byte_offset
                    )));
                }
            }
        }
        Ok(Checkpoint {
            dir: dir.to_owned(),
            manifest,
        })
    }

    /// The checkpoint folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The step it was saved at.
    pub fn step(&self) -> u64 {
        self.manifest.step
    }

    /// The trainer's extra state.
    pub fn state(&self) -> &TrainerState {
        &self.manifest.state
    }

    /// Reads every shard and checks every checksum.
    ///
    /// # Errors
    /// [`Error::Checksum`] naming the file, tensor and byte range of the
    /// first corrupt chunk; [`Error::Truncated`] or [`Error::Io`].
    pub fn verify(&self) -> Result<VerifyReport> {
        let mut rep = VerifyReport {
            files: self.manifest.files.len(),
            tensors: self.manifest.tensors.len(),
            shards: 0,
            bytes: 0,
        };
        for (name, t) in &self.manifest.tensors {
            for s in &t.shards {
                let path = self.dir.join(&s.file);
                let file = File::open(&path).ctx("open", &path)?;
                let mut r =
                    ShardReader::new(&file, &path, name, s, self.manifest.checksum.chunk_bytes);
                let mut pos = 0;
                while pos < s.byte_len {
                    r.load_window(pos)?;
                    pos = r.win_start + r.win.len() as u64;
                }
                rep.shards += 1;
                rep.bytes += s.byte_len;
            }
        }
        Ok(rep)
    }

    /// The whole tensor `name`, row-major bytes.
    ///
    /// # Errors
    /// As [`Checkpoint::read_region`].
    pub fn read_tensor(&self, name: &str) -> Result<Vec<u8>> {
        let t = self.tensor(name)?;
        self.read_region(name, &Region::full(&t.shape))
    }

    /// The part `region` of tensor `name`, row-major bytes. Reads only the
    /// byte ranges it needs from the shards that overlap `region`, and
    /// verifies the checksum of every chunk it reads.
    ///
    /// # Errors
    /// [`Error::UnknownTensor`], [`Error::RegionOutOfBounds`],
    /// [`Error::Checksum`], [`Error::Truncated`], [`Error::Io`].
    pub fn read_region(&self, name: &str, region: &Region) -> Result<Vec<u8>> {
        let n = self.region_bytes(name, region)?;
        let mut out = vec![0u8; n];
        self.read_region_into(name, region, &mut out)?;
        Ok(out)
    }

    /// Bytes that [`Checkpoint::read_region`] of `region` returns.
    ///
    /// # Errors
    /// [`Error::UnknownTensor`], [`Error::RegionOutOfBounds`].
    pub fn region_bytes(&self, name: &str, region: &Region) -> Result<usize> {
        let t = self.tensor(name)?;
        region
            .within(&t.shape)
            .then(|| region.volume())
            .flatten()
            .and_then(|v| v.checked_mul(t.dtype.size_bytes() as u64))
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| Error::RegionOutOfBounds {
                tensor: name.to_owned(),
                offsets: region.offsets.clone(),
                shape: region.shape.clone(),
                global: t.shape.clone(),
            })
    }

    /// As [`Checkpoint::read_region`], into a caller's buffer (e.g. the
    /// parameter memory being restored) of exactly
    /// [`Checkpoint::region_bytes`] bytes.
    ///
    /// # Errors
    /// As [`Checkpoint::read_region`], and [`Error::RegionOutOfBounds`] if
    /// `out` has the wrong length.
    pub fn read_region_into(&self, name: &str, region: &Region, out: &mut [u8]) -> Result<()> {
        let n = self.region_bytes(name, region)?;
        let t = self.tensor(name)?;
        if out.len() != n {
            return Err(Error::RegionOutOfBounds {
                tensor: format!("{name} (output buffer of {} bytes, need {n})", out.len()),
                offsets: region.offsets.clone(),
                shape: region.shape.clone(),
                global: t.shape.clone(),
            });
        }
        if n == 0 {
            return Ok(());
        }
        let es = t.dtype.size_bytes() as u64;
        for s in &t.shards {
            let sr = s.region();
            let Some(inter) = sr.intersect(region) else {
                continue;
            };
            let path = self.dir.join(&s.file);
            let file = File::open(&path).ctx("open", &path)?;
            let mut r = ShardReader::new(&file, &path, name, s, self.manifest.checksum.chunk_bytes);
            for_each_run(&sr, region, &inter, |run| {
                let d = (run.dst * es) as usize;
                let len = (run.len * es) as usize;
                r.copy(run.src * es, &mut out[d..d + len])
            })?;
        }
        Ok(())
    }

    fn tensor(&self, name: &str) -> Result<&crate::manifest::TensorEntry> {
        self.manifest
            .tensors
            .get(name)
            .ok_or_else(|| Error::UnknownTensor {
                path: self.dir.clone(),
                tensor: name.to_owned(),
            })
    }

    /// A summary: step, layout, tensors and sizes.
    pub fn info(&self) -> Info {
        Info {
            dir: self.dir.clone(),
            step: self.manifest.step,
            layout: self.manifest.layout.clone(),
            files: self.manifest.files.clone(),
            tensors: self
                .manifest
                .tensors
                .iter()
                .map(|(n, t)| TensorInfo {
                    name: n.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    shards: t.shards.len(),
                    bytes: t.shards.iter().map(|s| s.byte_len).sum(),
                })
                .collect(),
            state: self.manifest.state.clone(),
        }
    }
}

fn read_file_header(
    path: &Path,
    fe: &FileEntry,
    shards: &[(&str, Dtype, &ShardEntry)],
) -> Result<SafetensorsHeader> {
    let mut f = File::open(path).ctx("open", path)?;
    let len = f.metadata().ctx("stat", path)?.len();
    if len < fe.bytes {
        return Err(Error::Truncated {
            path: path.to_owned(),
            tensors: shards
                .iter()
                .filter(|s| s.2.byte_offset + s.2.byte_len > len)
                .take(8)
                .map(|s| s.0.to_owned())
                .collect(),
            expected: fe.bytes,
            actual: len,
        });
    }
    if len > fe.bytes {
        return Err(Error::Mismatch {
            path: path.to_owned(),
            tensor: String::new(),
            reason: format!("file has {len} bytes, manifest records {}", fe.bytes),
        });
    }
    let mut prefix = [0u8; 8];
    let got = (&mut f).take(8).read(&mut prefix).ctx("read", path)?;
    let n = header_len(&prefix[..got], len, path)?;
    let mut buf = vec![0u8; 8 + n as usize];
    read_at(&f, 0, &mut buf).ctx("read header of", path)?;
    parse_header(&buf, len, path)
}

/// Reads byte ranges of one shard, verifying every chunk it touches.
struct ShardReader<'a> {
    file: &'a File,
    path: &'a Path,
    tensor: &'a str,
    entry: &'a ShardEntry,
    chunk: u64,
    win_start: u64,
    win: Vec<u8>,
}

impl<'a> ShardReader<'a> {
    fn new(
        file: &'a File,
        path: &'a Path,
        tensor: &'a str,
        entry: &'a ShardEntry,
        chunk: u64,
    ) -> Self {
        ShardReader {
            file,
            path,
            tensor,
            entry,
            chunk,
            win_start: 0,
            win: Vec::new(),
        }
    }

    /// Reads shard bytes `start..start+buf.len()` (chunk-aligned start,
    /// ending on a chunk boundary or at the shard's end) and verifies them.
    fn read_verified(&self, start: u64, buf: &mut [u8]) -> Result<()> {
        let piece = ((PIPELINE_PIECE_BYTES / self.chunk).max(1) * self.chunk) as usize;
        if buf.len() < 2 * piece {
            self.read_raw(start, buf)?;
            return self.verify(start, buf);
        }
        // Large reads: one thread reads piece k+1 while this one checksums
        // piece k, so verification hides behind I/O.
        std::thread::scope(|sc| {
            let (tx, rx) = std::sync::mpsc::sync_channel::<(u64, &mut [u8])>(2);
            let reader = sc.spawn(move || -> Result<()> {
                let mut off = start;
                for p in buf.chunks_mut(piece) {
                    self.read_raw(off, p)?;
                    let n = p.len() as u64;
                    if tx.send((off, p)).is_err() {
                        break; // the verifier stopped on an error
                    }
                    off += n;
                }
                Ok(())
            });
            let mut verified = Ok(());
            for (off, p) in rx {
                verified = self.verify(off, p);
                if verified.is_err() {
                    break;
                }
            }
            let read = reader
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            verified.and(read)
        })
    }

    fn read_raw(&self, start: u64, buf: &mut [u8]) -> Result<()> {
        read_at(self.file, self.entry.byte_offset + start, buf).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                let actual = self.file.metadata().map(|m| m.len()).unwrap_or(0);
                Error::Truncated {
                    path: self.path.to_owned(),
                    tensors: vec![self.tensor.to_owned()],
                    expected: self.entry.byte_offset + start + buf.len() as u64,
                    actual,
                }
            } else {
                Error::Io {
                    op: "read",
                    path: self.path.to_owned(),
                    source: e,
                }
            }
        })
    }

    /// Checks `buf`, the shard's bytes from `start` (chunk-aligned).
    fn verify(&self, start: u64, buf: &[u8]) -> Result<()> {
        let first = start / self.chunk;
        for (i, piece) in buf.chunks(self.chunk as usize).enumerate() {
            let k = first as usize + i;
            let actual = crc32c::crc32c(piece);
            let expected = self.entry.crc32c[k];
            if actual != expected {
                let s = self.entry.byte_offset + k as u64 * self.chunk;
                return Err(Error::Checksum {
                    path: self.path.to_owned(),
                    tensor: self.tensor.to_owned(),
                    chunk: k,
                    start: s,
                    end: s + piece.len() as u64,
                    expected,
                    actual,
                });
            }
        }
        Ok(())
    }

    fn load_window(&mut self, pos: u64) -> Result<()> {
        let start = pos / self.chunk * self.chunk;
        let span = (WINDOW_BYTES / self.chunk).max(1) * self.chunk;
        let len = span.min(self.entry.byte_len - start) as usize;
        let mut win = std::mem::take(&mut self.win);
        win.resize(len, 0);
        self.win_start = start;
        let res = self.read_verified(start, &mut win);
        self.win = win;
        if res.is_err() {
            self.win.clear();
        }
        res
    }

    /// Copies shard bytes `src..src+dst.len()` into `dst`.
    fn copy(&mut self, mut src: u64, mut dst: &mut [u8]) -> Result<()> {
        while !dst.is_empty() {
            let in_window = src >= self.win_start && src < self.win_start + self.win.len() as u64;
            let remaining = dst.len() as u64;
            if !in_window && src / self.chunk * self.chunk == src {
                let n = if src + remaining == self.entry.byte_len {
                    remaining
                } else {
                    remaining / self.chunk * self.chunk
                };
                if n > 0 {
                    let (head, tail) = std::mem::take(&mut dst).split_at_mut(n as usize);
                    self.read_verified(src, head)?;
                    src += n;
                    dst = tail;
                    continue;
                }
            }
            if !in_window {
                self.load_window(src)?;
            }
            let off = (src - self.win_start) as usize;
            let n = dst.len().min(self.win.len() - off);
            let (head, tail) = std::mem::take(&mut dst).split_at_mut(n);
            head.copy_from_slice(&self.win[off..off + n]);
            src += n as u64;
            dst = tail;
        }
        Ok(())
    }
}

/// One tensor in an [`Info`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Global name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Global shape.
    pub shape: Vec<u64>,
    /// Number of shards.
    pub shards: usize,
    /// Stored bytes.
    pub bytes: u64,
}

/// A checkpoint summary (what `weft ckpt info` prints; `Display` renders it
/// as a table).
#[derive(Debug, Clone, PartialEq)]
pub struct Info {
    /// The folder.
    pub dir: PathBuf,
    /// Step.
    pub step: u64,
    /// Layout that saved it.
    pub layout: Layout,
    /// Shard files.
    pub files: Vec<FileEntry>,
    /// Tensors.
    pub tensors: Vec<TensorInfo>,
    /// Trainer state.
    pub state: TrainerState,
}

impl Info {
    /// Total stored tensor bytes.
    pub fn data_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.bytes).sum()
    }
}

impl fmt::Display for Info {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "checkpoint {}", self.dir.display())?;
        writeln!(f, "step            {}", self.step)?;
        writeln!(f, "layout          {}", self.layout)?;
        writeln!(f, "optimizer step  {}", self.state.optimizer_step)?;
        if let Some(h) = &self.state.config_hash {
            writeln!(f, "config hash     {h}")?;
        }
        let file_bytes: u64 = self.files.iter().map(|x| x.bytes).sum();
        writeln!(
            f,
            "files           {} ({} bytes; tensor data {} bytes)",
            self.files.len(),
            file_bytes,
            self.data_bytes()
        )?;
        writeln!(f, "tensors         {}", self.tensors.len())?;
        let w = self
            .tensors
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(4)
            .max(4);
        writeln!(
            f,
            "  {:w$}  {:5}  {:>6}  {:>14}  shape",
            "name", "dtype", "shards", "bytes"
        )?;
        for t in &self.tensors {
            writeln!(
                f,
                "  {:w$}  {:5}  {:>6}  {:>14}  {:?}",
                t.name,
                t.dtype.to_string(),
                t.shards,
                t.bytes,
                t.shape
            )?;
        }
        Ok(())
    }
}

/// Every complete checkpoint folder (`step-NNNNNNNN`, not `.tmp`) under
/// `root`, oldest first. A missing root has none.
///
/// # Errors
/// [`Error::Io`] if `root` cannot be listed.
pub fn list_checkpoints(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let rd = match fs::read_dir(root) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).ctx("list", root),
    };
    let mut out = Vec::new();
    for ent in rd {
        let ent = ent.ctx("list", root)?;
        let Some(step) = ent.file_name().to_str().and_then(parse_step_dir) else {
            continue;
        };
        if ent.file_type().ctx("stat", ent.path())?.is_dir() {
            out.push((step, ent.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// What `root/latest` points at (a folder name), if it exists.
///
/// # Errors
/// [`Error::BadName`] if it holds anything but a `step-NNNNNNNN` name.
pub fn read_latest_pointer(root: &Path) -> Result<Option<String>> {
    let path = root.join(LATEST_FILE);
    let f = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).ctx("open", &path),
    };
    let mut s = String::new();
    f.take(64)
        .read_to_string(&mut s)
        .map_err(|_| Error::BadName {
            path: path.clone(),
            reason: "not UTF-8".into(),
        })?;
    let name = s.trim_end_matches('\n');
    if parse_step_dir(name).is_none() {
        return Err(Error::BadName {
            path,
            reason: format!("expected a step-NNNNNNNN folder name, found {name:?}"),
        });
    }
    Ok(Some(name.to_owned()))
}

/// How much [`load_latest`] checks before accepting a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyLevel {
    /// Manifest, file sizes and headers ([`Checkpoint::open`]); tensor
    /// checksums are still checked as tensors are read.
    Structure,
    /// Also every checksum ([`Checkpoint::verify`]) before accepting.
    Full,
}

/// The result of [`load_latest`].
#[derive(Debug)]
pub struct Loaded {
    /// The newest checkpoint that verified.
    pub checkpoint: Checkpoint,
    /// Newer checkpoints that did not verify, and why: the caller should
    /// tell the user it fell back.
    pub skipped: Vec<(PathBuf, Error)>,
    /// What `latest` pointed at, if anything (informational: a crash
    /// between committing a folder and updating the pointer leaves it one
    /// behind).
    pub pointer: Option<String>,
}

/// Opens the newest checkpoint under `root` that verifies, falling back to
/// older ones and recording why newer ones were skipped. `Ok(None)` when
/// there is no checkpoint folder at all (a fresh run).
///
/// # Errors
/// [`Error::NoValidCheckpoint`] listing every failure when none verifies.
pub fn load_latest(root: &Path, level: VerifyLevel) -> Result<Option<Loaded>> {
    let all = list_checkpoints(root)?;
    if all.is_empty() {
        return Ok(None);
    }
    let pointer = read_latest_pointer(root).ok().flatten();
    let mut skipped = Vec::new();
    for (_, dir) in all.into_iter().rev() {
        let res = Checkpoint::open(&dir).and_then(|c| match level {
            VerifyLevel::Structure => Ok(c),
            VerifyLevel::Full => c.verify().map(|_| c),
        });
        match res {
            Ok(checkpoint) => {
                return Ok(Some(Loaded {
                    checkpoint,
                    skipped,
                    pointer,
                }));
            }
            Err(e) => skipped.push((dir, e)),
        }
    }
    Err(Error::NoValidCheckpoint {
        root: root.to_owned(),
        failures: skipped
            .into_iter()
            .map(|(p, e)| (p, e.to_string()))
            .collect(),
    })
}
