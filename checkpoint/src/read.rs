//! Loading: opening, verifying and reading (parts of) checkpoints.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::checksum::Crc32c;
use crate::dtype::Dtype;
use crate::error::{Error, IoContext, Result};
use crate::manifest::{FileEntry, Layout, Manifest, ShardEntry, TensorEntry, TrainerState};
use crate::region::{Region, Run, for_each_run};
use crate::safetensors::{SafetensorsHeader, header_len, parse_header};
use crate::write::{LATEST_FILE, parse_step_dir};

/// Bytes read per `pread` within a checksum chunk: small enough that each
/// piece is still in the core's cache when it is checksummed right after.
const PIECE_BYTES: usize = 256 * 1024;
/// Reads smaller than this many bytes per thread stay on one thread.
const PARALLEL_MIN_BYTES: u64 = 1024 * 1024;
/// Default reading threads: the CPUs, at most this many.
const MAX_DEFAULT_THREADS: usize = 8;

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

/// `posix_fadvise(WILLNEED)`: start reading `len` bytes at `offset` into the
/// page cache in the background. Advice only: failures are ignored.
#[cfg(target_os = "linux")]
fn will_need(file: &File, offset: u64, len: u64) {
    use std::os::unix::io::AsRawFd;
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return;
    };
    // SAFETY: a plain syscall on a descriptor that `file` keeps open; no
    // memory is passed.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), offset, len, libc::POSIX_FADV_WILLNEED);
    }
}

#[cfg(not(target_os = "linux"))]
fn will_need(_file: &File, _offset: u64, _len: u64) {}

/// An opened checkpoint folder whose manifest is valid and whose shard files
/// exist, have the recorded sizes, and have headers agreeing with the
/// manifest. Tensor bytes are checked against their checksums as they are
/// read.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
    threads: usize,
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
        // a checkpoint's step is the same in its folder's name and inside
        if let Some(named) = dir
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(parse_step_dir)
            && named != manifest.step
        {
            return Err(Error::Manifest {
                path: dir.join(crate::manifest::MANIFEST_FILE),
                field: "step".into(),
                reason: format!(
                    "the folder is step {named} but its manifest says step {}",
                    manifest.step
                ),
            });
        }
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
                // a rank's second and later pieces of a tensor are `name#k`:
                // the piece at the manifest's offset, else the plain name
                let piece = header.entries.iter().find(|h| {
                    h.start == s.byte_offset
                        && (h.name == name
                            || h.name
                                .strip_prefix(name)
                                .is_some_and(|k| k.starts_with('#')))
                });
                let Some(h) = piece.or_else(|| header.get(name)) else {
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
            threads: std::thread::available_parallelism()
                .map_or(1, usize::from)
                .min(MAX_DEFAULT_THREADS),
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

    /// Threads [`Checkpoint::read_many`], [`Checkpoint::read_region_into`]
    /// and [`Checkpoint::verify`] use (default: the number of CPUs, at most
    /// 8).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Sets the number of reading threads (at least 1). Each thread reads a
    /// contiguous part of the work with its own file handles, so that the
    /// kernel sees sequential streams.
    #[must_use]
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
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
        let chunk = self.manifest.checksum.chunk_bytes;
        let mut work = Vec::new();
        for (name, t) in &self.manifest.tensors {
            for s in &t.shards {
                let src = self.source(name, s);
                for k in 0..s.byte_len.div_ceil(chunk) {
                    let lo = k * chunk;
                    let hi = (lo + chunk).min(s.byte_len);
                    work.push(Work::Chunk {
                        src: src.clone(),
                        k,
                        lo,
                        hi,
                        dst: None,
                    });
                }
                rep.shards += 1;
                rep.bytes += s.byte_len;
            }
        }
        self.run(work)?;
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

    /// The whole `f32` tensor `name` into `out`, which must hold exactly
    /// its elements.
    ///
    /// # Errors
    /// As [`Checkpoint::read_region`]; [`Error::InvalidShard`] for a
    /// tensor of another dtype or size.
    pub fn read_f32(&self, name: &str, out: &mut [f32]) -> Result<()> {
        let t = self.tensor(name)?;
        let elements = t.shape.iter().product::<u64>();
        if t.dtype != Dtype::F32 || elements != out.len() as u64 {
            return Err(Error::InvalidShard {
                tensor: name.to_owned(),
                reason: format!(
                    "{} of {elements} elements, expected f32 of {}",
                    t.dtype,
                    out.len()
                ),
            });
        }
        let bytes = self.read_tensor(name)?;
        for (d, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        Ok(())
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
        self.read_many(&mut [ReadRequest {
            name,
            region: region.clone(),
            out,
        }])
    }

    /// Reads many regions at once, each into its caller's buffer (of
    /// exactly [`Checkpoint::region_bytes`] bytes): what a rank restoring
    /// all its parameters calls. The work is cut into checksum chunks and
    /// shared among [`Checkpoint::threads`] threads; each chunk is read in
    /// pieces of 256 KiB straight into the destination and checksummed
    /// right after each piece is read, while it is still in cache. Regions
    /// that are not contiguous in their shards (column slices) are read
    /// through a verified window and copied.
    ///
    /// # Errors
    /// As [`Checkpoint::read_region_into`]; with several errors, the one a
    /// sequential read in request order would have met first.
    pub fn read_many(&self, requests: &mut [ReadRequest<'_>]) -> Result<()> {
        let mut work = Vec::new();
        for req in requests.iter_mut() {
            self.plan(req.name, &req.region, &mut *req.out, &mut work)?;
        }
        self.run(work)
    }

    /// Appends the work of reading `region` of `name` into `out`.
    fn plan<'c, 'o>(
        &'c self,
        name: &'c str,
        region: &Region,
        out: &'o mut [u8],
        work: &mut Vec<Work<'c, 'o>>,
    ) -> Result<()> {
        let n = self.region_bytes(name, region)?;
        let (name, t) =
            self.manifest
                .tensors
                .get_key_value(name)
                .ok_or_else(|| Error::UnknownTensor {
                    path: self.dir.clone(),
                    tensor: name.to_owned(),
                })?;
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
        // Each overlapping shard's part as one run (src, dst, len) in bytes,
        // or None when some shard's part is strided.
        let mut runs: Vec<(&ShardEntry, Run)> = Vec::new();
        let mut contiguous = true;
        for s in &t.shards {
            let sr = s.region();
            let Some(inter) = sr.intersect(region) else {
                continue;
            };
            let mut first = None;
            let single = for_each_run(&sr, region, &inter, |run| {
                if first.is_some() {
                    return Err(());
                }
                first = Some(run);
                Ok(())
            });
            match (single, first) {
                (Ok(()), Some(r)) => runs.push((
                    s,
                    Run {
                        src: r.src * es,
                        dst: r.dst * es,
                        len: r.len * es,
                    },
                )),
                _ => {
                    contiguous = false;
                    break;
                }
            }
        }
        if !contiguous {
            work.push(Work::Strided {
                name,
                tensor: t,
                region: region.clone(),
                out,
            });
            return Ok(());
        }
        runs.sort_by_key(|r| r.1.dst);
        let chunk = self.manifest.checksum.chunk_bytes;
        let mut rest = out;
        let mut at = 0u64;
        for (s, run) in runs {
            // Shards tile the tensor, so runs are disjoint and cover `out`.
            let skip = (run.dst - at) as usize;
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(skip);
            let (mut piece, tail) = tail.split_at_mut(run.len as usize);
            rest = tail;
            at = run.dst + run.len;
            let src = self.source(name, s);
            let end = run.src + run.len;
            let mut lo = run.src;
            while lo < end {
                let k = lo / chunk;
                let hi = ((k + 1) * chunk).min(end);
                let (d, tail) = std::mem::take(&mut piece).split_at_mut((hi - lo) as usize);
                piece = tail;
                work.push(Work::Chunk {
                    src: src.clone(),
                    k,
                    lo,
                    hi,
                    dst: Some(d),
                });
                lo = hi;
            }
        }
        Ok(())
    }

    fn source<'c>(&'c self, tensor: &'c str, entry: &'c ShardEntry) -> Source<'c> {
        Source {
            file: &entry.file,
            tensor,
            entry,
            chunk: self.manifest.checksum.chunk_bytes,
        }
    }

    /// Does `work` on up to [`Checkpoint::threads`] threads, each taking a
    /// contiguous run of items of about equal bytes (so each reads its
    /// files sequentially, with its own handles).
    fn run(&self, work: Vec<Work<'_, '_>>) -> Result<()> {
        let total: u64 = work.iter().map(Work::bytes).sum();
        let threads = (self.threads as u64)
            .min(work.len() as u64)
            .min(total.div_ceil(PARALLEL_MIN_BYTES))
            .max(1);
        if threads == 1 {
            let mut w = Worker::new(&self.dir, self.manifest.checksum.chunk_bytes);
            let mut items = work.into_iter().peekable();
            while let Some(item) = items.next() {
                w.prefetch(items.peek());
                w.run(item)?;
            }
            return Ok(());
        }
        // Contiguous groups of about total/threads bytes each.
        let mut groups: Vec<Vec<(usize, Work<'_, '_>)>> = vec![Vec::new()];
        let mut acc = 0u64;
        let mut g = 0u64;
        for (i, item) in work.into_iter().enumerate() {
            let b = item.bytes();
            if acc >= total * (g + 1) / threads && g + 1 < threads {
                g += 1;
                groups.push(Vec::new());
            }
            acc += b;
            if let Some(v) = groups.last_mut() {
                v.push((i, item));
            }
        }
        // The first failing item (in order) wins, as in a sequential read:
        // a thread stops only once a failure precedes its next item.
        let first_bad = AtomicUsize::new(usize::MAX);
        let errors: Mutex<Vec<(usize, Error)>> = Mutex::new(Vec::new());
        std::thread::scope(|sc| {
            for group in groups {
                let (first_bad, errors, dir) = (&first_bad, &errors, &self.dir);
                let chunk = self.manifest.checksum.chunk_bytes;
                sc.spawn(move || {
                    let mut w = Worker::new(dir, chunk);
                    let mut items = group.into_iter().peekable();
                    while let Some((i, item)) = items.next() {
                        if i > first_bad.load(Ordering::Relaxed) {
                            return;
                        }
                        w.prefetch(items.peek().map(|n| &n.1));
                        if let Err(e) = w.run(item) {
                            first_bad.fetch_min(i, Ordering::Relaxed);
                            errors
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .push((i, e));
                            return;
                        }
                    }
                });
            }
        });
        let errors = errors.into_inner().unwrap_or_else(PoisonError::into_inner);
        match errors.into_iter().min_by_key(|e| e.0) {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    fn tensor(&self, name: &str) -> Result<&TensorEntry> {
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

/// One request of [`Checkpoint::read_many`]: the part `region` of tensor
/// `name`, into `out` ([`Checkpoint::region_bytes`] bytes, row-major).
#[derive(Debug)]
pub struct ReadRequest<'a> {
    /// The tensor's global name.
    pub name: &'a str,
    /// Which part of it.
    pub region: Region,
    /// Where its bytes go.
    pub out: &'a mut [u8],
}

/// One shard as a source of bytes.
#[derive(Clone)]
struct Source<'c> {
    file: &'c str,
    tensor: &'c str,
    entry: &'c ShardEntry,
    chunk: u64,
}

/// A unit of reading work.
enum Work<'c, 'o> {
    /// Shard bytes `lo..hi`, all inside checksum chunk `k`, into `dst`
    /// (`None`: only verify chunk `k`).
    Chunk {
        src: Source<'c>,
        k: u64,
        lo: u64,
        hi: u64,
        dst: Option<&'o mut [u8]>,
    },
    /// A region that is strided in some shard: read through a window.
    Strided {
        name: &'c str,
        tensor: &'c TensorEntry,
        region: Region,
        out: &'o mut [u8],
    },
}

impl Work<'_, '_> {
    fn bytes(&self) -> u64 {
        match self {
            Work::Chunk { lo, hi, .. } => hi - lo,
            Work::Strided { out, .. } => out.len() as u64,
        }
    }
}

/// One reading thread: its own file handles and scratch buffer.
struct Worker<'d> {
    dir: &'d Path,
    chunk: u64,
    files: BTreeMap<String, (PathBuf, File)>,
    scratch: Vec<u8>,
}

impl<'d> Worker<'d> {
    fn new(dir: &'d Path, chunk: u64) -> Self {
        Worker {
            dir,
            chunk,
            files: BTreeMap::new(),
            scratch: Vec::new(),
        }
    }

    fn file(&mut self, name: &str) -> Result<(&Path, &File)> {
        if !self.files.contains_key(name) {
            let path = self.dir.join(name);
            let f = File::open(&path).ctx("open", &path)?;
            self.files.insert(name.to_owned(), (path, f));
        }
        let (p, f) = &self.files[name];
        Ok((p, f))
    }

    /// Asks the kernel to start reading `next`'s chunk from the disk now,
    /// so that it arrives while this thread checksums the current one (a
    /// no-op for data already in the page cache, and off Linux).
    fn prefetch(&mut self, next: Option<&Work<'_, '_>>) {
        let Some(Work::Chunk { src, k, .. }) = next else {
            return;
        };
        let start = k * src.chunk;
        let len = src.chunk.min(src.entry.byte_len - start);
        if let Ok((_, file)) = self.file(src.file) {
            will_need(file, src.entry.byte_offset + start, len);
        }
    }

    fn run(&mut self, item: Work<'_, '_>) -> Result<()> {
        match item {
            Work::Chunk {
                src,
                k,
                lo,
                hi,
                dst,
            } => {
                let cs = k * src.chunk;
                let ce = (cs + src.chunk).min(src.entry.byte_len);
                let mut scratch = std::mem::take(&mut self.scratch);
                let (path, file) = self.file(src.file)?;
                let reader = ShardReader::new(file, path, src.tensor, src.entry, src.chunk);
                let res = match dst {
                    Some(d) if lo == cs && hi == ce => reader.read_chunk(k, Dest::Into(d)),
                    Some(d) => reader
                        .read_chunk(k, Dest::Scratch(&mut scratch, true))
                        .map(|()| {
                            d.copy_from_slice(&scratch[(lo - cs) as usize..(hi - cs) as usize]);
                        }),
                    None => reader.read_chunk(k, Dest::Scratch(&mut scratch, false)),
                };
                self.scratch = scratch;
                res
            }
            Work::Strided {
                name,
                tensor,
                region,
                out,
            } => {
                let mut scratch = std::mem::take(&mut self.scratch);
                let res = self.strided(name, tensor, &region, out, &mut scratch);
                self.scratch = scratch;
                res
            }
        }
    }

    /// Reads `region` of `t` into `out` run by run, through a one-chunk
    /// window in `scratch` (chunks wholly inside a run go straight to
    /// `out`).
    fn strided(
        &mut self,
        name: &str,
        t: &TensorEntry,
        region: &Region,
        out: &mut [u8],
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        let es = t.dtype.size_bytes() as u64;
        for s in &t.shards {
            let sr = s.region();
            let Some(inter) = sr.intersect(region) else {
                continue;
            };
            let chunk = self.chunk;
            let (path, file) = self.file(&s.file)?;
            let reader = ShardReader::new(file, path, name, s, chunk);
            let mut cached: Option<u64> = None;
            for_each_run(&sr, region, &inter, |run| {
                let (mut src, end) = (run.src * es, (run.src + run.len) * es);
                let mut d = (run.dst * es) as usize;
                while src < end {
                    let k = src / chunk;
                    let cs = k * chunk;
                    let ce = (cs + chunk).min(s.byte_len);
                    let hi = ce.min(end);
                    let n = (hi - src) as usize;
                    if cached != Some(k) {
                        if src == cs && hi == ce {
                            reader.read_chunk(k, Dest::Into(&mut out[d..d + n]))?;
                            src = hi;
                            d += n;
                            continue;
                        }
                        cached = None;
                        reader.read_chunk(k, Dest::Scratch(scratch, true))?;
                        cached = Some(k);
                    }
                    let off = (src - cs) as usize;
                    out[d..d + n].copy_from_slice(&scratch[off..off + n]);
                    src = hi;
                    d += n;
                }
                Ok(())
            })?;
        }
        Ok(())
    }
}

/// Where [`ShardReader::read_chunk`] puts a chunk.
enum Dest<'b> {
    /// Exactly the chunk's bytes.
    Into(&'b mut [u8]),
    /// A scratch buffer: the whole chunk (`true`), or only a piece at a
    /// time (`false`, when only the checksum matters).
    Scratch(&'b mut Vec<u8>, bool),
}

/// Reads and verifies the chunks of one shard.
struct ShardReader<'a> {
    file: &'a File,
    path: &'a Path,
    tensor: &'a str,
    entry: &'a ShardEntry,
    chunk: u64,
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
        }
    }

    /// Reads checksum chunk `k` into `dest` in pieces of [`PIECE_BYTES`],
    /// checksumming each piece right after reading it, and checks the
    /// chunk's checksum.
    fn read_chunk(&self, k: u64, dest: Dest<'_>) -> Result<()> {
        let start = k * self.chunk;
        let len = (self.chunk.min(self.entry.byte_len - start)) as usize;
        let mut crc = Crc32c::new();
        match dest {
            Dest::Into(buf) => {
                debug_assert_eq!(buf.len(), len);
                let mut off = start;
                for piece in buf.chunks_mut(PIECE_BYTES) {
                    self.read_raw(off, piece)?;
                    crc.update(piece);
                    off += piece.len() as u64;
                }
            }
            Dest::Scratch(buf, whole) => {
                let mut off = start;
                let end = start + len as u64;
                buf.resize(if whole { len } else { len.min(PIECE_BYTES) }, 0);
                let mut at = 0;
                while off < end {
                    let n = ((end - off) as usize).min(PIECE_BYTES);
                    let piece = &mut buf[at..at + n];
                    self.read_raw(off, piece)?;
                    crc.update(piece);
                    off += n as u64;
                    if whole {
                        at += n;
                    }
                }
            }
        }
        self.check(k, len as u64, crc.value())
    }

    fn check(&self, k: u64, len: u64, actual: u32) -> Result<()> {
        let expected = self.entry.crc32c[k as usize];
        if actual == expected {
            return Ok(());
        }
        let s = self.entry.byte_offset + k * self.chunk;
        Err(Error::Checksum {
            path: self.path.to_owned(),
            tensor: self.tensor.to_owned(),
            chunk: k as usize,
            start: s,
            end: s + len,
            expected,
            actual,
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
