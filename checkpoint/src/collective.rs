//! A checkpoint of a job of many ranks, saved and picked for loading by
//! every rank together over a `weft-collectives` communicator, as
//! PyTorch's distributed checkpoint does over a process group.
//!
//! [`save`]: rank 0 prepares the staging folder and names it to every
//! rank; every rank writes its own file of the tensors it owns — runs of
//! the whole tensors' flat values ([`FlatRun`], merged into boxes by
//! [`boxes_of_runs`]), in parallel; rank 0 gathers the ranks' reports and
//! commits the manifest — the mesh layout and the trainer state — then
//! applies a [`Retention`]. Every rank returns the same outcome: the rank
//! that saw a failure names it, the others report [`CollectiveError::Peer`].
//!
//! [`pick_latest`]: rank 0 finds the newest checkpoint that verifies
//! (every byte), lets the caller accept or refuse it (a configuration
//! hash, say), sets aside the newer ones that did not verify
//! ([`set_aside`]) and tells every rank which step; each rank then reads
//! the parts its own layout holds, whatever layout saved them
//! ([`Checkpoint::read_tensor`], [`Checkpoint::read_region`]).
//!
//! ```
//! use weft_checkpoint::collective::{SaveSpec, pick_latest, save};
//! use weft_checkpoint::{CollectiveError, FlatRun, Retention, SaveOptions, TrainerState};
//! use weft_collectives::{Communicator, LocalCluster};
//!
//! let root = tempfile::tempdir()?;
//! let root = root.path();
//! // two ranks, each owning half of a 4-element tensor
//! let out = LocalCluster::run(2, |world| {
//!     let mine = [1.0f32 + world.rank() as f32; 2];
//!     let runs = [FlatRun {
//!         name: "w",
//!         global_shape: &[4],
//!         start: 2 * world.rank(),
//!         values: vec![&mine],
//!     }];
//!     let spec = SaveSpec {
//!         step: 10,
//!         runs: &runs,
//!         name: &|_, n| n.to_owned(),
//!         mesh: &[("dp", 2)],
//!         state: &TrainerState::default(),
//!         retention: Retention::new(2, None),
//!     };
//!     save(&world, root, &spec, &SaveOptions::default(), &mut || {})?;
//!     let picked = pick_latest::<CollectiveError>(&world, root, |_| Ok(()))?;
//!     Ok::<_, CollectiveError>(picked.checkpoint.read_tensor("w")?)
//! });
//! for bytes in out? {
//!     assert_eq!(bytes?.len(), 16); // 4 floats, half from each rank
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use weft_collectives::{Communicator, CommunicatorExt};

use crate::{
    Checkpoint, Dtype, Error, FlatRun, Layout, Manifest, MeshDim, RankReport, Retention,
    SaveOptions, ShardData, TrainerState, VerifyLevel, boxes_of_runs, load_latest,
};

/// The point-to-point tag of a collective save's exchanges.
const TAG: u64 = 0x5746_434b; // "WFCK"

/// Why a collective save or pick failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    /// This rank's checkpoint operation failed.
    #[error(transparent)]
    Checkpoint(#[from] Error),
    /// Another rank's part failed (that rank reports why).
    #[error("checkpoint of step {step}: another rank failed")]
    Peer {
        /// The step (0 when picking for a load).
        step: u64,
    },
    /// A collective between the ranks failed.
    #[error("checkpoint: communication: {0}")]
    Comm(#[from] weft_collectives::Error),
    /// There is no checkpoint to load.
    #[error("no checkpoint to resume from in {}", .0.display())]
    Missing(PathBuf),
}

/// What a rank saves in a collective [`save`].
pub struct SaveSpec<'a> {
    /// The step the checkpoint is taken after.
    pub step: u64,
    /// This rank's parts of the tensors: runs of whole tensors' flat
    /// values, each element saved by exactly one rank; a run may carry
    /// several value slices over the same elements (parameters and
    /// optimizer moments, say).
    pub runs: &'a [FlatRun<'a>],
    /// The name a run's `k`-th value slice of tensor `name` is saved
    /// under (an empty slice is not saved).
    pub name: &'a dyn Fn(usize, &str) -> String,
    /// The mesh's dimensions, slowest first, as the manifest records them.
    pub mesh: &'a [(&'a str, usize)],
    /// The trainer state (rank 0's is committed).
    pub state: &'a TrainerState,
    /// Which checkpoints to keep once this one is committed.
    pub retention: Retention,
}

/// Saves checkpoint `spec.step` under `root` (see the [module docs](self)).
/// `after_write` runs on each rank between its write and the commit (a
/// fault drill's crash point). Collective over `world`; every rank
/// returns the same outcome.
///
/// # Errors
/// [`CollectiveError::Checkpoint`] on the rank whose preparation, write,
/// commit or retention failed, [`CollectiveError::Peer`] on the others; a
/// collective error.
pub fn save(
    world: &dyn Communicator,
    root: &Path,
    spec: &SaveSpec<'_>,
    opts: &SaveOptions,
    after_write: &mut dyn FnMut(),
) -> Result<(), CollectiveError> {
    let staging = staging_dir(world, root, spec.step, opts)?;
    let report = write_rank(&staging, world.rank(), spec, opts);
    after_write();
    commit(world, root, spec, report, opts)
}

/// The staging folder of checkpoint `step`, which rank 0 prepares and
/// names to every rank.
fn staging_dir(
    world: &dyn Communicator,
    root: &Path,
    step: u64,
    opts: &SaveOptions,
) -> Result<PathBuf, CollectiveError> {
    let prepared = (world.rank() == 0).then(|| crate::prepare(root, step, opts));
    let mine = match &prepared {
        Some(Ok(path)) => path.to_string_lossy().into_owned().into_bytes(),
        _ => Vec::new(),
    };
    let all = weft_collectives::all_gather_bytes(world, TAG, &mine)?;
    match prepared {
        Some(Err(e)) => Err(e.into()),
        _ if all[0].is_empty() => Err(CollectiveError::Peer { step }),
        _ => Ok(PathBuf::from(String::from_utf8_lossy(&all[0]).into_owned())),
    }
}

/// Writes this rank's file: each run's boxes, boxes stacked along their
/// first dimension merged (a strided tensor-parallel shard's rows become
/// one box per Q, K, V), little-endian f32.
fn write_rank(
    staging: &Path,
    rank: usize,
    spec: &SaveSpec<'_>,
    opts: &SaveOptions,
) -> crate::Result<RankReport> {
    let boxes = boxes_of_runs(spec.runs);
    let mut tensors = Vec::new();
    for b in &boxes {
        for (which, values) in b.values.iter().enumerate() {
            if values.is_empty() {
                continue; // (a tensor without this array: Muon's matrices' second moment)
            }
            tensors.push((
                (spec.name)(which, &b.name),
                b.global_shape.clone(),
                b.region.clone(),
                le_bytes(values),
            ));
        }
    }
    let shards: Vec<ShardData<'_>> = tensors
        .iter()
        .map(|(name, shape, region, data)| ShardData {
            name,
            dtype: Dtype::F32,
            global_shape: shape,
            region: region.clone(),
            data,
        })
        .collect();
    let rank = u32::try_from(rank).unwrap_or(u32::MAX);
    crate::write_rank_file(staging, rank, &shards, opts)
}

/// The little-endian bytes of `values`: a view of them on a little-endian
/// machine (no copy: a save's writer then does one pass less over its
/// rank's data), else a converted copy.
fn le_bytes(values: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: f32 has no padding and every byte of it is a valid u8;
        // the slice covers exactly the same memory for the same lifetime,
        // and u8's alignment (1) divides f32's.
        let bytes = unsafe {
            std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), size_of_val(values))
        };
        std::borrow::Cow::Borrowed(bytes)
    }
    #[cfg(not(target_endian = "little"))]
    {
        std::borrow::Cow::Owned(values.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// Rank 0's verdict on a collective step, sent to every rank.
fn agree(world: &dyn Communicator, ok: bool) -> Result<bool, weft_collectives::Error> {
    let mut v = [if ok { 1.0f64 } else { 0.0 }];
    world.broadcast(&mut v, 0)?;
    Ok(v[0] == 1.0)
}

/// Gathers every rank's `report` on rank 0, which commits the checkpoint
/// when every rank wrote its file and applies the retention; every rank
/// learns the outcome.
fn commit(
    world: &dyn Communicator,
    root: &Path,
    spec: &SaveSpec<'_>,
    report: crate::Result<RankReport>,
    opts: &SaveOptions,
) -> Result<(), CollectiveError> {
    let step = spec.step;
    let json = match &report {
        Ok(r) => serde_json::to_vec(r).unwrap_or_default(),
        Err(_) => Vec::new(),
    };
    let Some(all) = weft_collectives::gather_bytes(world, TAG + 4, &json)? else {
        let ok = agree(world, true)?;
        report?;
        return if ok {
            Ok(())
        } else {
            Err(CollectiveError::Peer { step })
        };
    };
    let reports: Vec<Option<RankReport>> =
        all.iter().map(|b| serde_json::from_slice(b).ok()).collect();
    let outcome = match (report, reports.iter().all(Option::is_some)) {
        (Err(e), _) => Err(e.into()),
        (Ok(_), false) => Err(CollectiveError::Peer { step }),
        (Ok(_), true) => {
            let reports: Vec<RankReport> = reports.into_iter().flatten().collect();
            let size = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
            let layout = Layout {
                world_size: size(world.size()),
                mesh: spec
                    .mesh
                    .iter()
                    .map(|&(name, n)| MeshDim {
                        name: name.to_owned(),
                        size: size(n),
                    })
                    .collect(),
            };
            crate::commit(root, step, &layout, &reports, spec.state, opts)
                .and_then(|_| spec.retention.apply(root))
                .map(|_| ())
                .map_err(CollectiveError::from)
        }
    };
    agree(world, outcome.is_ok())?;
    outcome
}

/// The checkpoint [`pick_latest`] chose, open on this rank.
#[derive(Debug)]
pub struct Picked {
    /// The checkpoint.
    pub checkpoint: Checkpoint,
    /// On rank 0: newer checkpoints that did not verify, each with why and
    /// where it was moved aside (kept as evidence).
    pub skipped: Vec<String>,
}

/// Picks the newest checkpoint under `root` that verifies and that
/// `accept` takes, on rank 0 (which reads every byte), and opens it on
/// every rank (see the [module docs](self)). Collective over `world`.
///
/// # Errors
/// On rank 0: [`CollectiveError::Missing`] when there is none, `accept`'s
/// error, a read error; on the others [`CollectiveError::Peer`] then; a
/// collective error.
pub fn pick_latest<E: From<CollectiveError>>(
    world: &dyn Communicator,
    root: &Path,
    accept: impl FnOnce(&Manifest) -> Result<(), E>,
) -> Result<Picked, E> {
    let picked = if world.rank() == 0 {
        load_latest(root, VerifyLevel::Full)
            .map_err(|e| E::from(e.into()))
            .and_then(|l| l.ok_or_else(|| CollectiveError::Missing(root.to_owned()).into()))
            .and_then(|l| accept(l.checkpoint.manifest()).map(|()| l))
    } else {
        Err(CollectiveError::Peer { step: 0 }.into())
    };
    #[allow(clippy::cast_precision_loss)]
    let mut step = [picked.as_ref().map_or(-1.0, |l| l.checkpoint.step() as f64)];
    world
        .broadcast(&mut step, 0)
        .map_err(|e| E::from(e.into()))?;
    if step[0] < 0.0 {
        return Err(match picked {
            Err(e) if world.rank() == 0 => e,
            _ => CollectiveError::Peer { step: 0 }.into(),
        });
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let step = step[0] as u64;
    Ok(match picked {
        Ok(l) => Picked {
            checkpoint: l.checkpoint,
            skipped: l
                .skipped
                .iter()
                .map(|(p, e)| match set_aside(p) {
                    Ok(to) => format!("{}: {e}; moved to {}", p.display(), to.display()),
                    Err(m) => format!("{}: {e}; could not move it aside: {m}", p.display()),
                })
                .collect(),
        },
        Err(_) => Picked {
            checkpoint: Checkpoint::open(&root.join(crate::step_dir_name(step)))
                .map_err(|e| E::from(e.into()))?,
            skipped: Vec::new(),
        },
    })
}

/// Renames a checkpoint folder that did not verify to `<name>.corrupt`
/// (or `.corrupt-2`, … if taken): out of the way of the saves to come,
/// which would replace a folder of the same step, and no checkpoint any
/// more to loading and retention.
///
/// # Errors
/// Not a folder name, the rename failed, or a thousand copies are
/// already set aside.
pub fn set_aside(dir: &Path) -> Result<PathBuf, String> {
    let name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| "not a step folder".to_owned())?;
    for i in 1..1000 {
        let to = dir.with_file_name(if i == 1 {
            format!("{name}.corrupt")
        } else {
            format!("{name}.corrupt-{i}")
        });
        if to.exists() {
            continue;
        }
        return std::fs::rename(dir, &to)
            .map(|()| to)
            .map_err(|e| e.to_string());
    }
    Err("too many earlier copies set aside".into())
}

/// How a background save ended.
#[derive(Debug)]
pub struct Finished {
    /// The step saved.
    pub step: u64,
    /// The save's outcome, the same on every rank.
    pub result: Result<(), CollectiveError>,
    /// Seconds from its start to its end (writing, committing, retention).
    pub seconds: f64,
    /// Seconds the caller waited for it, when a new save or
    /// [`Background::wait`] had to (0 when it had ended already).
    pub waited: f64,
}

/// A save running on its thread.
struct InFlight {
    step: u64,
    handle: std::thread::JoinHandle<(Result<(), CollectiveError>, f64)>,
}

/// Collective saves that run on a thread of their own while the ranks
/// train on, one at a time, over a communicator group of their own (split
/// from the job's, so that their messages never meet the training step's).
///
/// The training loop copies its state (the only part of a save it waits
/// for) and hands the copy to [`Background::start`] in a closure that
/// saves it, typically with [`save`] over the group it is given. A save
/// started while the previous one still runs first waits for it (the
/// wait is reported in [`Finished::waited`]); [`Background::wait`]
/// waits for the save in flight, and dropping the saver does too, so a
/// run never ends with a save half done. The outcome of a save is
/// collective like [`save`]'s: every rank learns the same one, when it
/// next starts one or waits.
///
/// ```
/// use weft_checkpoint::collective::{Background, SaveSpec, save};
/// use weft_checkpoint::{CollectiveError, FlatRun, Retention, SaveOptions, TrainerState};
/// use weft_collectives::{Communicator, LocalCluster};
///
/// let root = tempfile::tempdir()?;
/// let root = root.path().to_owned();
/// let out = LocalCluster::run(2, |world| {
///     let mut saver = Background::new(&world)?;
///     for step in [10u64, 20] {
///         // the copy of this rank's state the save owns
///         let mine = vec![step as f32 + world.rank() as f32; 2];
///         let (root, rank) = (root.clone(), world.rank());
///         let previous = saver.start(step, move |group| {
///             let runs = [FlatRun { name: "w", global_shape: &[4], start: 2 * rank, values: vec![&mine] }];
///             let spec = SaveSpec {
///                 step, runs: &runs, name: &|_, n| n.to_owned(), mesh: &[("dp", 2)],
///                 state: &TrainerState::default(), retention: Retention::new(2, None),
///             };
///             save(group, &root, &spec, &SaveOptions::default(), &mut || {})
///         })?;
///         // ... the training step goes on here ...
///         if let Some(done) = previous {
///             done.result?; // step 10's outcome, learned when step 20 starts
///         }
///     }
///     let last = saver.wait().expect("a save in flight");
///     assert_eq!(last.step, 20);
///     last.result
/// });
/// for r in out? {
///     r?;
/// }
/// assert!(root.join("step-00000020").is_dir());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Background {
    group: Arc<dyn Communicator>,
    pending: Option<InFlight>,
}

impl std::fmt::Debug for Background {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Background")
            .field("in_flight", &self.in_flight())
            .finish_non_exhaustive()
    }
}

impl Background {
    /// A saver over a group split from `world` (collective over `world`:
    /// every rank creates its saver at the same point).
    ///
    /// # Errors
    /// The split's collective error.
    pub fn new(world: &dyn Communicator) -> Result<Self, CollectiveError> {
        let key = u32::try_from(world.rank()).unwrap_or(u32::MAX);
        Ok(Background {
            group: Arc::from(world.split(0, key)?),
            pending: None,
        })
    }

    /// The step being saved, if a save has not been waited for.
    #[must_use]
    pub fn in_flight(&self) -> Option<u64> {
        self.pending.as_ref().map(|p| p.step)
    }

    /// Starts saving checkpoint `step` with `save`, run on a thread of its
    /// own over the saver's group, after waiting for the previous save;
    /// returns that one's outcome (`None` if there was none).
    ///
    /// # Errors
    /// [`CollectiveError::Checkpoint`] if the thread cannot start.
    pub fn start<F>(&mut self, step: u64, save: F) -> Result<Option<Finished>, CollectiveError>
    where
        F: FnOnce(&dyn Communicator) -> Result<(), CollectiveError> + Send + 'static,
    {
        let previous = self.wait();
        let group = Arc::clone(&self.group);
        let handle = std::thread::Builder::new()
            .name(format!("weft-save-{step}"))
            .spawn(move || {
                let t0 = std::time::Instant::now();
                let r = save(&*group);
                (r, t0.elapsed().as_secs_f64())
            })
            .map_err(|e| Error::Background {
                step,
                reason: format!("cannot start its thread: {e}"),
            })?;
        self.pending = Some(InFlight { step, handle });
        Ok(previous)
    }

    /// Waits for the save in flight; returns its outcome (`None` if there
    /// is none).
    pub fn wait(&mut self) -> Option<Finished> {
        let InFlight { step, handle } = self.pending.take()?;
        let t0 = std::time::Instant::now();
        let done = handle.is_finished();
        let (result, seconds) = handle.join().unwrap_or_else(|p| {
            let reason = p
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "its thread panicked".into());
            (Err(Error::Background { step, reason }.into()), 0.0)
        });
        Some(Finished {
            step,
            result,
            seconds,
            waited: if done {
                0.0
            } else {
                t0.elapsed().as_secs_f64()
            },
        })
    }
}

impl Drop for Background {
    /// Waits for the save in flight: a run never leaves one half done.
    fn drop(&mut self) {
        let _ = self.wait();
    }
}

/// A [`FlatRun`] that owns its values: a rank's copy of its part of a
/// tensor, which outlives the training step.
#[derive(Clone, Debug, PartialEq)]
pub struct OwnedRun {
    /// The tensor.
    pub name: String,
    /// The whole tensor's shape.
    pub global_shape: Vec<usize>,
    /// The run's first element, in the whole tensor's flat order.
    pub start: usize,
    /// The run's values, one array per kind (the same length, or empty
    /// where the tensor has no such array).
    pub values: Vec<Vec<f32>>,
}

/// The name a run's `k`-th value array of tensor `name` is saved under
/// ([`Staged::name`]).
pub type SavedName = Arc<dyn Fn(usize, &str) -> String + Send + Sync>;

/// A rank's checkpoint, copied out of the training state and ready to
/// write (by [`Saver`], or [`Staged::write`] over any group).
#[derive(Clone)]
pub struct Staged {
    /// The step it is taken after.
    pub step: u64,
    /// This rank's parts of the tensors.
    pub runs: Vec<OwnedRun>,
    /// The name a run's `k`-th value array of tensor `name` is saved
    /// under (an empty array is not saved).
    pub name: SavedName,
    /// The mesh's dimensions, slowest first, as the manifest records them.
    pub mesh: Vec<(&'static str, usize)>,
    /// The trainer state (rank 0's is committed).
    pub state: TrainerState,
    /// Which checkpoints to keep once it is committed.
    pub retention: Retention,
}

impl std::fmt::Debug for Staged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staged")
            .field("step", &self.step)
            .field("runs", &self.runs.len())
            .field("mesh", &self.mesh)
            .finish_non_exhaustive()
    }
}

impl Staged {
    /// Bytes of its values (`f32`).
    #[must_use]
    pub fn bytes(&self) -> u64 {
        let values = self.runs.iter().flat_map(|r| &r.values);
        values.map(|v| 4 * v.len() as u64).sum()
    }

    /// Writes it as checkpoint `self.step` under `root`, collectively over
    /// `group` ([`save`]); `after_write` runs between this rank's write and
    /// the commit.
    ///
    /// # Errors
    /// As [`save`].
    pub fn write(
        &self,
        group: &dyn Communicator,
        root: &Path,
        opts: &SaveOptions,
        after_write: &mut dyn FnMut(),
    ) -> Result<(), CollectiveError> {
        let runs: Vec<FlatRun<'_>> = self
            .runs
            .iter()
            .map(|r| FlatRun {
                name: &r.name,
                global_shape: &r.global_shape,
                start: r.start,
                values: r.values.iter().map(Vec::as_slice).collect(),
            })
            .collect();
        let spec = SaveSpec {
            step: self.step,
            runs: &runs,
            name: &*self.name,
            mesh: &self.mesh,
            state: &self.state,
            retention: self.retention.clone(),
        };
        save(group, root, &spec, opts, after_write)
    }
}

/// What a committed checkpoint cost the training loop.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Saved {
    /// Its step.
    pub step: u64,
    /// Whether it was written in the background.
    pub background: bool,
    /// Seconds the loop stood still for it: the copy, the wait for its
    /// end when the next save (or the end) came first, and for a
    /// synchronous save the write.
    pub stall_s: f64,
    /// Of those, seconds waiting for it to end.
    pub waited_s: f64,
    /// Seconds from the start of its write to its commit and retention.
    pub write_s: f64,
    /// Bytes of this rank's copy.
    pub bytes: u64,
}

/// What runs on the writing thread around a save: `after_write` between
/// this rank's write and the commit, `after_commit` with the committed
/// folder (fault drills' hooks).
pub struct SaveHooks {
    /// Between this rank's write and the commit.
    pub after_write: Box<dyn FnMut() + Send>,
    /// After a successful commit, with the checkpoint's folder.
    pub after_commit: Box<dyn FnOnce(&Path) + Send>,
}

impl Default for SaveHooks {
    fn default() -> Self {
        Self {
            after_write: Box::new(|| {}),
            after_commit: Box::new(|_| {}),
        }
    }
}

/// A training loop's checkpoints under one root: written in the
/// background ([`Background`]: the loop waits only for its copy, one save
/// in flight) or with every rank stopped for the whole write, and
/// reported ([`Saved`]) once committed — for a background save when the
/// next save starts or [`Saver::wait`] is called, the same on every rank.
#[derive(Debug)]
pub struct Saver {
    root: PathBuf,
    opts: SaveOptions,
    background: Option<Background>,
    /// The save in flight: its step, the copy's seconds, its bytes.
    started: Option<(u64, f64, u64)>,
    /// The runs of the last save written, for the next copy to reuse.
    spent: Arc<std::sync::Mutex<Vec<OwnedRun>>>,
}

impl Saver {
    /// Checkpoints under `root`, in the background or not. Collective over
    /// `world` (the background's group is split from it).
    ///
    /// # Errors
    /// The split's.
    pub fn new(
        world: &dyn Communicator,
        root: &Path,
        opts: SaveOptions,
        background: bool,
    ) -> Result<Self, CollectiveError> {
        Ok(Saver {
            root: root.to_owned(),
            opts,
            background: if background {
                Some(Background::new(world)?)
            } else {
                None
            },
            started: None,
            spent: Arc::default(),
        })
    }

    /// The runs of the last save written (empty while a save is in
    /// flight, or before the first): their buffers, for the next copy to
    /// reuse — memory already mapped, so the copy costs no page faults.
    pub fn take_runs(&mut self) -> Vec<OwnedRun> {
        if self.started.is_some() {
            return Vec::new();
        }
        let mut spent = self
            .spent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        std::mem::take(&mut *spent)
    }

    /// Saves `staged`, which the loop took `copy_s` seconds to copy:
    /// starts writing it in the background (after waiting for the
    /// previous save, whose report it returns), or writes it now over
    /// `world` and returns its report. Collective over `world`.
    ///
    /// # Errors
    /// The save's (in the background, the previous save's), as [`save`].
    pub fn save(
        &mut self,
        world: &dyn Communicator,
        staged: Staged,
        copy_s: f64,
        mut hooks: SaveHooks,
    ) -> Result<Option<Saved>, CollectiveError> {
        let (step, bytes) = (staged.step, staged.bytes());
        let (root, opts) = (self.root.clone(), self.opts.clone());
        let spent = Arc::clone(&self.spent);
        let write = move |group: &dyn Communicator| {
            let written = staged.write(group, &root, &opts, &mut *hooks.after_write);
            *spent
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = staged.runs;
            written?;
            (hooks.after_commit)(&root.join(crate::step_dir_name(step)));
            Ok(())
        };
        let Some(bg) = &mut self.background else {
            let t0 = std::time::Instant::now();
            write(world)?;
            let write_s = t0.elapsed().as_secs_f64();
            return Ok(Some(Saved {
                step,
                background: false,
                stall_s: copy_s + write_s,
                waited_s: 0.0,
                write_s,
                bytes,
            }));
        };
        let previous = bg.start(step, write)?;
        let earlier = self.started.replace((step, copy_s, bytes));
        Self::report(previous, earlier)
    }

    /// Waits for the save in flight and returns its report (`None` if
    /// there is none).
    ///
    /// # Errors
    /// The save's.
    pub fn wait(&mut self) -> Result<Option<Saved>, CollectiveError> {
        let done = self.background.as_mut().and_then(Background::wait);
        Self::report(done, self.started.take())
    }

    /// The report of the background save `started` (step, copy seconds,
    /// bytes) that ended as `done`.
    fn report(
        done: Option<Finished>,
        started: Option<(u64, f64, u64)>,
    ) -> Result<Option<Saved>, CollectiveError> {
        let (Some(done), Some((step, copy_s, bytes))) = (done, started) else {
            return Ok(None);
        };
        done.result?;
        Ok(Some(Saved {
            step,
            background: true,
            stall_s: copy_s + done.waited,
            waited_s: done.waited,
            write_s: done.seconds,
            bytes,
        }))
    }
}
