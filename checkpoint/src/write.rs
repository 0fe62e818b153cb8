//! Saving: per-rank shard files, the manifest, and the atomic commit.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::dtype::Dtype;
use crate::error::{Error, IoContext, Result};
use crate::manifest::{
    self, ChecksumSpec, FORMAT_NAME, FORMAT_VERSION, FileEntry, Layout, MANIFEST_FILE, Manifest,
    ShardEntry, TensorEntry, TrainerState,
};
use crate::region::Region;
use crate::safetensors::{MAX_DIMS, build_header};

/// Name of the pointer file in a checkpoints root.
pub const LATEST_FILE: &str = "latest";

/// Folder name of the checkpoint of `step`: `step-NNNNNNNN`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The step of a folder named `step-NNNNNNNN` (eight or more digits, nothing
/// else), or `None`.
pub fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.len() < 8 || digits.len() > 20 || !digits.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A place in a save where a [`FaultHook`] is consulted.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum FaultPoint<'a> {
    /// About to create the staging folder.
    CreateDir {
        /// The folder.
        path: &'a Path,
    },
    /// About to write `len` bytes at `offset` of a file.
    Write {
        /// The file.
        path: &'a Path,
        /// Where in the file.
        offset: u64,
        /// How many bytes.
        len: u64,
    },
    /// About to fsync a file.
    SyncFile {
        /// The file.
        path: &'a Path,
    },
    /// About to fsync a folder (making renames and creations durable).
    SyncDir {
        /// The folder.
        path: &'a Path,
    },
    /// About to rename.
    Rename {
        /// From.
        from: &'a Path,
        /// To.
        to: &'a Path,
    },
    /// About to delete a folder.
    Remove {
        /// The folder.
        path: &'a Path,
    },
}

/// Fault injection: consulted before every I/O step of a save. Returning an
/// error aborts the save on the spot, with no clean-up, exactly as if the
/// process had been killed there. Tests use it to show that a crash at any
/// point leaves the previous or the new checkpoint complete.
pub trait FaultHook: Send + Sync {
    /// Called before the step `point`.
    ///
    /// # Errors
    /// Any error aborts the save.
    fn before(&self, point: &FaultPoint<'_>) -> io::Result<()>;
}

/// Options of a save.
#[derive(Clone)]
pub struct SaveOptions {
    /// Checksum chunk size (default [`manifest::DEFAULT_CHUNK_BYTES`]).
    pub chunk_bytes: u64,
    /// fsync files and folders (default true). Turning it off is only for
    /// tests on throw-away folders: without it a power cut can lose a
    /// checkpoint that looked committed.
    pub fsync: bool,
    /// Fault-injection hook (default none).
    pub fault: Option<Arc<dyn FaultHook>>,
    /// How many rank files [`save`] writes at once (default: the number of
    /// CPUs, at least 1), as ranks in separate processes would.
    pub threads: usize,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            chunk_bytes: manifest::DEFAULT_CHUNK_BYTES,
            fsync: true,
            fault: None,
            threads: std::thread::available_parallelism().map_or(1, usize::from),
        }
    }
}

impl fmt::Debug for SaveOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SaveOptions")
            .field("chunk_bytes", &self.chunk_bytes)
            .field("fsync", &self.fsync)
            .field("fault", &self.fault.is_some())
            .field("threads", &self.threads)
            .finish()
    }
}

impl SaveOptions {
    fn hook(&self, p: FaultPoint<'_>) -> Result<()> {
        let path = match p {
            FaultPoint::CreateDir { path }
            | FaultPoint::Write { path, .. }
            | FaultPoint::SyncFile { path }
            | FaultPoint::SyncDir { path }
            | FaultPoint::Remove { path } => path,
            FaultPoint::Rename { to, .. } => to,
        };
        match &self.fault {
            Some(h) => h.before(&p).ctx("injected fault before", path),
            None => Ok(()),
        }
    }

    fn sync_file(&self, f: &File, path: &Path) -> Result<()> {
        self.hook(FaultPoint::SyncFile { path })?;
        if self.fsync {
            f.sync_all().ctx("fsync", path)?;
        }
        Ok(())
    }

    fn sync_dir(&self, path: &Path) -> Result<()> {
        self.hook(FaultPoint::SyncDir { path })?;
        if self.fsync {
            File::open(path)
                .and_then(|d| d.sync_all())
                .ctx("fsync folder", path)?;
        }
        Ok(())
    }

    fn write(&self, f: &mut File, path: &Path, offset: u64, buf: &[u8]) -> Result<()> {
        self.hook(FaultPoint::Write {
            path,
            offset,
            len: buf.len() as u64,
        })?;
        f.write_all(buf).ctx("write", path)
    }

    fn rename(&self, from: &Path, to: &Path) -> Result<()> {
        self.hook(FaultPoint::Rename { from, to })?;
        fs::rename(from, to).ctx("rename to", to)
    }
}

/// One piece of a tensor held by a rank, borrowed for writing.
#[derive(Clone, Debug)]
pub struct ShardData<'a> {
    /// The tensor's global name.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// The tensor's global shape.
    pub global_shape: &'a [u64],
    /// Which part of the tensor this is.
    pub region: Region,
    /// The part's bytes, row-major, little-endian.
    pub data: &'a [u8],
}

impl<'a> ShardData<'a> {
    /// The whole tensor (use on exactly one rank for a replicated tensor).
    pub fn full(name: &'a str, dtype: Dtype, shape: &'a [u64], data: &'a [u8]) -> Self {
        ShardData {
            name,
            dtype,
            global_shape: shape,
            region: Region::full(shape),
            data,
        }
    }
}

/// An owned [`ShardData`]: a host copy that outlives the training step
/// (what [`crate::load_shards`] returns).
#[derive(Clone, Debug, PartialEq)]
pub struct OwnedShard {
    /// The tensor's global name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// The tensor's global shape.
    pub global_shape: Vec<u64>,
    /// Which part of the tensor this is.
    pub region: Region,
    /// The part's bytes, row-major, little-endian.
    pub data: Vec<u8>,
}

impl OwnedShard {
    /// Copies a borrowed shard.
    pub fn copy_from(s: &ShardData<'_>) -> Self {
        OwnedShard {
            name: s.name.to_owned(),
            dtype: s.dtype,
            global_shape: s.global_shape.to_vec(),
            region: s.region.clone(),
            data: s.data.to_vec(),
        }
    }

    /// Borrows it back.
    pub fn as_data(&self) -> ShardData<'_> {
        ShardData {
            name: &self.name,
            dtype: self.dtype,
            global_shape: &self.global_shape,
            region: self.region.clone(),
            data: &self.data,
        }
    }
}

/// What a rank wrote, to be gathered by the coordinator for [`commit`]. It is
/// serde-serializable so that ranks in other processes can send it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankReport {
    /// The rank.
    pub rank: u32,
    /// Its file.
    pub file: FileEntry,
    /// Its shards.
    pub shards: Vec<ReportedShard>,
}

/// One shard in a [`RankReport`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportedShard {
    /// Global tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Global shape.
    pub global_shape: Vec<u64>,
    /// Where it is; `None` for an empty piece (reported so that tensors
    /// with zero elements still appear in the manifest).
    pub entry: Option<ShardEntry>,
}

/// Step 1 of a save, on the coordinator: (re)creates the empty staging folder
/// `root/step-NNNNNNNN.tmp/`, deleting a stale one left by a crash.
///
/// # Errors
/// [`Error::Io`] naming the folder.
pub fn prepare(root: &Path, step: u64, opts: &SaveOptions) -> Result<PathBuf> {
    fs::create_dir_all(root).ctx("create folder", root)?;
    let staging = root.join(format!("{}.tmp", step_dir_name(step)));
    if staging.exists() {
        opts.hook(FaultPoint::Remove { path: &staging })?;
        fs::remove_dir_all(&staging).ctx("remove stale staging folder", &staging)?;
    }
    opts.hook(FaultPoint::CreateDir { path: &staging })?;
    fs::create_dir(&staging).ctx("create folder", &staging)?;
    Ok(staging)
}

/// Step 2 of a save, on every rank: writes `staging/rank-NNNNN.safetensors`
/// holding this rank's shards under their global names, computes chunk
/// checksums while writing, and fsyncs the file. Empty shards are skipped;
/// a rank with nothing to save still writes a (header-only) file.
///
/// # Errors
/// [`Error::InvalidShard`] if a shard's region or byte count is wrong or a
/// name repeats; [`Error::Io`] on I/O failure.
pub fn write_rank_file(
    staging: &Path,
    rank: u32,
    shards: &[ShardData<'_>],
    opts: &SaveOptions,
) -> Result<RankReport> {
    let chunk = opts.chunk_bytes;
    if !(manifest::CHUNK_BYTES_RANGE.0..=manifest::CHUNK_BYTES_RANGE.1).contains(&chunk) {
        return Err(Error::InvalidShard {
            tensor: String::new(),
            reason: format!("chunk_bytes {chunk} out of range"),
        });
    }
    let mut kept: Vec<&ShardData<'_>> = Vec::with_capacity(shards.len());
    for s in shards {
        let bad = |reason: String| Error::InvalidShard {
            tensor: s.name.to_owned(),
            reason,
        };
        if s.name.is_empty()
            || s.name.len() > manifest::MAX_NAME_BYTES
            || s.name == "__metadata__"
            || s.name.contains('#')
        {
            return Err(bad("invalid tensor name".into()));
        }
        if s.global_shape.len() > MAX_DIMS {
            return Err(bad(format!("more than {MAX_DIMS} dimensions")));
        }
        if !s.region.within(s.global_shape) {
            return Err(bad(format!(
                "region offsets {:?} shape {:?} is outside global shape {:?}",
                s.region.offsets, s.region.shape, s.global_shape
            )));
        }
        let want = s
            .region
            .volume()
            .and_then(|v| v.checked_mul(s.dtype.size_bytes() as u64))
            .ok_or_else(|| bad("size overflows".into()))?;
        if want != s.data.len() as u64 {
            return Err(bad(format!(
                "region {:?} of {} needs {want} bytes, got {}",
                s.region.shape,
                s.dtype,
                s.data.len()
            )));
        }
        if want > 0 {
            kept.push(s);
        }
    }
    let mut out: Vec<ReportedShard> = shards
        .iter()
        .filter(|s| s.data.is_empty())
        .map(|s| ReportedShard {
            name: s.name.to_owned(),
            dtype: s.dtype,
            global_shape: s.global_shape.to_vec(),
            entry: None,
        })
        .collect();
    // Widest dtypes first keeps every tensor aligned to its element size.
    kept.sort_by(|a, b| {
        b.dtype
            .size_bytes()
            .cmp(&a.dtype.size_bytes())
            .then(a.name.cmp(b.name))
            .then(a.region.offsets.cmp(&b.region.offsets))
    });
    // A rank's second and later pieces of one tensor are `name#1`, …
    let mut seen: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    let keys: Vec<String> = kept
        .iter()
        .map(|s| {
            let k = seen.entry(s.name).or_insert(0);
            *k += 1;
            if *k == 1 {
                s.name.to_owned()
            } else {
                format!("{}#{}", s.name, *k - 1)
            }
        })
        .collect();
    let table: Vec<(&str, Dtype, &[u64], u64)> = kept
        .iter()
        .zip(&keys)
        .map(|(s, key)| {
            (
                key.as_str(),
                s.dtype,
                s.region.shape.as_slice(),
                s.data.len() as u64,
            )
        })
        .collect();
    let metadata = BTreeMap::from([
        ("format".to_owned(), "pt".to_owned()),
        ("weft.rank".to_owned(), rank.to_string()),
    ]);
    let (header, starts) = build_header(&table, &metadata);
    let name = manifest::file_name(rank);
    let path = staging.join(&name);
    let mut f = File::create(&path).ctx("create", &path)?;
    opts.write(&mut f, &path, 0, &header)?;
    for (s, &start) in kept.iter().zip(&starts) {
        let mut crcs = Vec::with_capacity(s.data.len().div_ceil(chunk as usize));
        for (i, piece) in s.data.chunks(chunk as usize).enumerate() {
            crcs.push(crate::checksum::crc32c(piece));
            opts.write(&mut f, &path, start + (i as u64) * chunk, piece)?;
        }
        out.push(ReportedShard {
            name: s.name.to_owned(),
            dtype: s.dtype,
            global_shape: s.global_shape.to_vec(),
            entry: Some(ShardEntry {
                file: name.clone(),
                offsets: s.region.offsets.clone(),
                shape: s.region.shape.clone(),
                byte_offset: start,
                byte_len: s.data.len() as u64,
                crc32c: crcs,
            }),
        });
    }
    opts.sync_file(&f, &path)?;
    let bytes = header.len() as u64 + kept.iter().map(|s| s.data.len() as u64).sum::<u64>();
    Ok(RankReport {
        rank,
        file: FileEntry { name, rank, bytes },
        shards: out,
    })
}

/// A committed checkpoint.
#[derive(Clone, Debug)]
pub struct Committed {
    /// Its folder.
    pub path: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
}

/// Builds the manifest from every rank's report, checking that each
/// tensor's shards agree on dtype and global shape and tile it exactly.
///
/// # Errors
/// [`Error::InvalidShard`] on any inconsistency.
pub fn build_manifest(
    step: u64,
    layout: &Layout,
    reports: &[RankReport],
    state: &TrainerState,
    chunk_bytes: u64,
) -> Result<Manifest> {
    let mut files = Vec::with_capacity(reports.len());
    let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
    let mut ranks = HashSet::new();
    for r in reports {
        if r.rank >= layout.world_size || !ranks.insert(r.rank) {
            return Err(Error::InvalidShard {
                tensor: String::new(),
                reason: format!(
                    "report of rank {} is duplicated or outside world size {}",
                    r.rank, layout.world_size
                ),
            });
        }
        files.push(r.file.clone());
        for s in &r.shards {
            let t = tensors
                .entry(s.name.clone())
                .or_insert_with(|| TensorEntry {
                    dtype: s.dtype,
                    shape: s.global_shape.clone(),
                    shards: Vec::new(),
                });
            if t.dtype != s.dtype || t.shape != s.global_shape {
                return Err(Error::InvalidShard {
                    tensor: s.name.clone(),
                    reason: format!(
                        "rank {} says {} {:?}, another rank said {} {:?}",
                        r.rank, s.dtype, s.global_shape, t.dtype, t.shape
                    ),
                });
            }
            t.shards.extend(s.entry.clone());
        }
    }
    files.sort_by_key(|f| f.rank);
    let mut budget = u64::MAX;
    for (name, t) in &tensors {
        let regions: Vec<Region> = t.shards.iter().map(ShardEntry::region).collect();
        manifest::check_tiling(&t.shape, &regions, &mut budget).map_err(|reason| {
            Error::InvalidShard {
                tensor: name.clone(),
                reason: format!("{reason} (a replicated tensor must be saved by exactly one rank)"),
            }
        })?;
    }
    Ok(Manifest {
        format: FORMAT_NAME.to_owned(),
        version: FORMAT_VERSION,
        step,
        layout: layout.clone(),
        checksum: ChecksumSpec {
            algorithm: "crc32c".to_owned(),
            chunk_bytes,
        },
        files,
        tensors,
        state: state.clone(),
        manifest_crc32c: None,
    })
}

/// Step 3 of a save, on the coordinator once every rank has written: writes
/// and fsyncs `manifest.json` (last, so that a folder with a manifest is
/// complete), fsyncs the staging folder, renames it to
/// `root/step-NNNNNNNN` (replacing an older folder of the same step), fsyncs
/// the root, then points `root/latest` at it with a write-to-temp-and-rename.
///
/// # Errors
/// [`Error::InvalidShard`] if the reports are inconsistent; [`Error::Io`].
pub fn commit(
    root: &Path,
    step: u64,
    layout: &Layout,
    reports: &[RankReport],
    state: &TrainerState,
    opts: &SaveOptions,
) -> Result<Committed> {
    let manifest = build_manifest(step, layout, reports, state, opts.chunk_bytes)?;
    let dir_name = step_dir_name(step);
    let staging = root.join(format!("{dir_name}.tmp"));
    manifest.validate(&staging.join(MANIFEST_FILE))?;
    let json = manifest.to_json();
    let mpath = staging.join(MANIFEST_FILE);
    let mut f = File::create(&mpath).ctx("create", &mpath)?;
    opts.write(&mut f, &mpath, 0, &json)?;
    opts.sync_file(&f, &mpath)?;
    drop(f);
    opts.sync_dir(&staging)?;
    let fin = root.join(&dir_name);
    let replaced = root.join(format!("{dir_name}.replaced"));
    if fin.exists() {
        if replaced.exists() {
            opts.hook(FaultPoint::Remove { path: &replaced })?;
            fs::remove_dir_all(&replaced).ctx("remove", &replaced)?;
        }
        opts.rename(&fin, &replaced)?;
    }
    opts.rename(&staging, &fin)?;
    opts.sync_dir(root)?;
    if replaced.exists() {
        opts.hook(FaultPoint::Remove { path: &replaced })?;
        fs::remove_dir_all(&replaced).ctx("remove", &replaced)?;
    }
    write_latest(root, &dir_name, opts)?;
    Ok(Committed {
        path: fin,
        manifest,
    })
}

/// Atomically points `root/latest` at `dir_name`.
pub(crate) fn write_latest(root: &Path, dir_name: &str, opts: &SaveOptions) -> Result<()> {
    let tmp = root.join(format!("{LATEST_FILE}.tmp"));
    let mut f = File::create(&tmp).ctx("create", &tmp)?;
    opts.write(&mut f, &tmp, 0, format!("{dir_name}\n").as_bytes())?;
    opts.sync_file(&f, &tmp)?;
    drop(f);
    opts.rename(&tmp, &root.join(LATEST_FILE))?;
    opts.sync_dir(root)
}

/// Saves a whole checkpoint from one process: [`prepare`], then
/// [`write_rank_file`] for each rank (`ranks[r]` holds rank `r`'s shards),
/// then [`commit`]. With ranks in other processes, call the three steps
/// yourself and gather the [`RankReport`]s to the coordinator.
///
/// # Errors
/// As the three steps.
pub fn save(
    root: &Path,
    step: u64,
    layout: &Layout,
    ranks: &[Vec<ShardData<'_>>],
    state: &TrainerState,
    opts: &SaveOptions,
) -> Result<Committed> {
    if ranks.len() as u64 != u64::from(layout.world_size) {
        return Err(Error::InvalidShard {
            tensor: String::new(),
            reason: format!(
                "layout has {} ranks but shards were given for {}",
                layout.world_size,
                ranks.len()
            ),
        });
    }
    let staging = prepare(root, step, opts)?;
    let threads = opts.threads.clamp(1, ranks.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<Vec<(usize, Result<RankReport>)>> = std::thread::scope(|sc| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                sc.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let r = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if r >= ranks.len() {
                            return done;
                        }
                        let res = write_rank_file(&staging, r as u32, &ranks[r], opts);
                        let failed = res.is_err();
                        done.push((r, res));
                        if failed {
                            // Stop handing out work, as a crash would.
                            next.store(ranks.len(), std::sync::atomic::Ordering::Relaxed);
                            return done;
                        }
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or_default())
            .collect()
    });
    let mut all: Vec<(usize, Result<RankReport>)> = results.into_iter().flatten().collect();
    all.sort_by_key(|r| r.0);
    let mut reports = Vec::with_capacity(ranks.len());
    for (_, r) in all {
        reports.push(r?);
    }
    if reports.len() != ranks.len() {
        return Err(Error::Background {
            step,
            reason: "a rank writer thread panicked".into(),
        });
    }
    opts.sync_dir(&staging)?;
    commit(root, step, layout, &reports, state, opts)
}

/// A save whose ranks are threads of one process (or processes that send
/// their [`RankReport`]s), all writing into the same staging folder
/// `root/step-NNNNNNNN.tmp/`, committed by a coordinator once every rank
/// has reported. It is [`Sync`]: share it by reference with the rank
/// threads.
///
/// The steps are those of [`save`]: [`SharedSave::begin`] ([`prepare`], on
/// the coordinator, before any rank writes), [`SharedSave::write_rank`]
/// (each rank, concurrently: [`write_rank_file`] and keeps the report) or
/// [`SharedSave::add_report`] (a report from another process), then
/// [`SharedSave::commit`] (merges the reports into the manifest, checks that
/// every tensor is tiled exactly once, and commits atomically). Until the
/// commit nothing is a checkpoint: a crash or a missing rank leaves only
/// the `.tmp` folder, which readers ignore and the next save of the step
/// replaces.
///
/// ```
/// use weft_checkpoint::{Checkpoint, Dtype, Layout, Region, SaveOptions, ShardData,
///     SharedSave, TrainerState};
///
/// let root = std::env::temp_dir().join(format!("weft-ckpt-shared-{}", std::process::id()));
/// // An FSDP flat parameter of 10 f32 over 4 ranks: shards of ceil(10/4) = 3
/// // elements, the last rank holding 1 real element (its padding is not saved).
/// let flat: Vec<u8> = (0..10).flat_map(|i| (i as f32).to_le_bytes()).collect();
/// let shape = [10u64];
/// let save = SharedSave::begin(&root, 7, &Layout::flat("fsdp", 4), &SaveOptions::default())?;
/// std::thread::scope(|sc| {
///     for r in 0..4u64 {
///         let (save, flat) = (&save, &flat);
///         sc.spawn(move || {
///             let (a, b) = ((3 * r).min(10), (3 * r + 3).min(10));
///             let shard = ShardData {
///                 name: "fsdp.h.0",
///                 dtype: Dtype::F32,
///                 global_shape: &shape,
///                 region: Region::new(vec![a], vec![b - a]),
///                 data: &flat[4 * a as usize..4 * b as usize],
///             };
///             save.write_rank(r as u32, &[shard])
///         });
///     }
/// });
/// let committed = save.commit(&TrainerState::default())?;
/// let ck = Checkpoint::open(&committed.path)?;
/// assert_eq!(ck.read_tensor("fsdp.h.0")?, flat);
/// # std::fs::remove_dir_all(&root).ok();
/// # Ok::<(), weft_checkpoint::Error>(())
/// ```
#[derive(Debug)]
pub struct SharedSave {
    root: PathBuf,
    step: u64,
    layout: Layout,
    opts: SaveOptions,
    staging: PathBuf,
    /// Per rank: not started, being written, or written (its report).
    ranks: std::sync::Mutex<Vec<RankSlot>>,
}

#[derive(Debug, Clone)]
enum RankSlot {
    Waiting,
    Writing,
    Done(RankReport),
}

impl SharedSave {
    /// Creates the empty staging folder for `step` (deleting a stale one
    /// left by a crash). Call it on the coordinator before any rank writes.
    ///
    /// # Errors
    /// [`Error::InvalidShard`] for a layout of no ranks; [`Error::Io`].
    pub fn begin(root: &Path, step: u64, layout: &Layout, opts: &SaveOptions) -> Result<Self> {
        if layout.world_size == 0 {
            return Err(Error::InvalidShard {
                tensor: String::new(),
                reason: "a layout of 0 ranks".into(),
            });
        }
        let staging = prepare(root, step, opts)?;
        Ok(SharedSave {
            root: root.to_owned(),
            step,
            layout: layout.clone(),
            opts: opts.clone(),
            staging,
            ranks: std::sync::Mutex::new(vec![RankSlot::Waiting; layout.world_size as usize]),
        })
    }

    /// The staging folder ranks write into (for ranks in other processes:
    /// pass it to [`write_rank_file`]).
    pub fn staging(&self) -> &Path {
        &self.staging
    }

    /// The step being saved.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Ranks that have not reported yet.
    pub fn missing(&self) -> Vec<u32> {
        self.slots()
            .iter()
            .enumerate()
            .filter(|(_, s)| !matches!(s, RankSlot::Done(_)))
            .map(|(r, _)| r as u32)
            .collect()
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<RankSlot>> {
        self.ranks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Marks `rank` as being written, refusing a rank outside the layout or
    /// one already written or being written.
    fn claim(&self, rank: u32) -> Result<()> {
        let mut slots = self.slots();
        let bad = |reason: String| Error::InvalidShard {
            tensor: String::new(),
            reason,
        };
        match slots.get_mut(rank as usize) {
            None => Err(bad(format!(
                "rank {rank} is outside the layout's {} ranks",
                self.layout.world_size
            ))),
            Some(RankSlot::Waiting) => {
                slots[rank as usize] = RankSlot::Writing;
                Ok(())
            }
            Some(_) => Err(bad(format!(
                "rank {rank} saved twice in step {}",
                self.step
            ))),
        }
    }

    fn finish(&self, rank: u32, report: Result<RankReport>) -> Result<()> {
        let mut slots = self.slots();
        match report {
            Ok(r) => {
                slots[rank as usize] = RankSlot::Done(r);
                Ok(())
            }
            Err(e) => {
                slots[rank as usize] = RankSlot::Waiting;
                Err(e)
            }
        }
    }

    /// Rank `rank` writes its file `rank-NNNNN.safetensors` into the
    /// staging folder (fsynced) and records its report. Safe to call from
    /// every rank's thread at once.
    ///
    /// # Errors
    /// [`Error::InvalidShard`] for a rank outside the layout, a rank saved
    /// twice, or a bad shard; [`Error::Io`]. A failed rank may try again.
    pub fn write_rank(&self, rank: u32, shards: &[ShardData<'_>]) -> Result<()> {
        self.claim(rank)?;
        let report = write_rank_file(&self.staging, rank, shards, &self.opts);
        self.finish(rank, report)
    }

    /// Records the report of a rank that wrote its file itself (another
    /// process calling [`write_rank_file`] on [`SharedSave::staging`], and
    /// sending the report, e.g. as JSON).
    ///
    /// # Errors
    /// [`Error::InvalidShard`] for a rank outside the layout, a rank
    /// reported twice, or a report naming another file than the rank's.
    pub fn add_report(&self, report: RankReport) -> Result<()> {
        let rank = report.rank;
        if report.file.name != manifest::file_name(rank) || report.file.rank != rank {
            return Err(Error::InvalidShard {
                tensor: String::new(),
                reason: format!(
                    "report of rank {rank} names file {} of rank {}",
                    report.file.name, report.file.rank
                ),
            });
        }
        self.claim(rank)?;
        self.finish(rank, Ok(report))
    }

    /// Merges every rank's report into the manifest and commits (see
    /// [`commit`]): fsyncs the staging folder, writes the manifest last,
    /// renames the folder into place and moves `latest`.
    ///
    /// # Errors
    /// [`Error::InvalidShard`] naming the ranks that have not reported (the
    /// staging folder stays, and is not a checkpoint), or tensors whose
    /// shards do not tile them exactly once; [`Error::Io`].
    pub fn commit(self, state: &TrainerState) -> Result<Committed> {
        let missing = self.missing();
        if !missing.is_empty() {
            return Err(Error::InvalidShard {
                tensor: String::new(),
                reason: format!(
                    "ranks {missing:?} of {} have not saved step {}; nothing committed",
                    self.layout.world_size, self.step
                ),
            });
        }
        let reports: Vec<RankReport> = self
            .slots()
            .drain(..)
            .filter_map(|s| match s {
                RankSlot::Done(r) => Some(r),
                _ => None,
            })
            .collect();
        self.opts.sync_dir(&self.staging)?;
        commit(
            &self.root,
            self.step,
            &self.layout,
            &reports,
            state,
            &self.opts,
        )
    }
}

/// Puts checkpoint `src` (a `step-NNNNNNNN` folder of another run) under
/// `root` as its own, for a run that branches from it: every byte is
/// verified first, then each file is hard-linked (copied where links
/// cannot be made: another file system) into a staging folder that is
/// renamed into place, so `root` never holds half of it. Checkpoint files
/// are never written after their commit, so the two runs can share them.
/// Returns the new folder.
///
/// # Errors
/// `src` is not a checkpoint that verifies; `root` already has that step;
/// an I/O error.
pub fn link_checkpoint(src: &Path, root: &Path) -> Result<PathBuf> {
    let ckpt = crate::Checkpoint::open(src)?;
    ckpt.verify()?;
    let name = step_dir_name(ckpt.step());
    let dst = root.join(&name);
    if dst.exists() {
        return Err(Error::Io {
            op: "link a checkpoint to",
            path: dst,
            source: io::Error::from(io::ErrorKind::AlreadyExists),
        });
    }
    let staging = root.join(format!("{name}.tmp"));
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(&staging).ctx("create folder", &staging)?;
    for entry in fs::read_dir(src).ctx("list", src)? {
        let entry = entry.ctx("list", src)?;
        let (from, to) = (entry.path(), staging.join(entry.file_name()));
        if fs::hard_link(&from, &to).is_err() {
            fs::copy(&from, &to).ctx("copy to", &to)?;
        }
    }
    fs::rename(&staging, &dst).ctx("rename to", &dst)?;
    Ok(dst)
}
