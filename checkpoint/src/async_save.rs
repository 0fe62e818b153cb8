//! Saving in the background while training goes on.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::manifest::{Layout, TrainerState};
use crate::retention::{Retention, RetentionReport};
use crate::write::{Committed, OwnedShard, SaveOptions, ShardData, save};

/// Host copies of everything one save needs: taking one is a memory copy,
/// after which the training state may change freely.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// Step.
    pub step: u64,
    /// Layout saving it.
    pub layout: Layout,
    /// `ranks[r]`: rank `r`'s shards.
    pub ranks: Vec<Vec<OwnedShard>>,
    /// Trainer state.
    pub state: TrainerState,
}

impl Snapshot {
    /// Copies borrowed shards into host buffers.
    pub fn capture(
        step: u64,
        layout: &Layout,
        ranks: &[Vec<ShardData<'_>>],
        state: &TrainerState,
    ) -> Self {
        Snapshot {
            step,
            layout: layout.clone(),
            ranks: ranks
                .iter()
                .map(|r| r.iter().map(OwnedShard::copy_from).collect())
                .collect(),
            state: state.clone(),
        }
    }

    /// Bytes of tensor data held.
    pub fn bytes(&self) -> usize {
        self.ranks.iter().flatten().map(|s| s.data.len()).sum()
    }
}

/// The result of one background save.
#[derive(Clone, Debug)]
pub struct SaveOutcome {
    /// The committed checkpoint.
    pub committed: Committed,
    /// What retention did afterwards, if a policy is set.
    pub retention: Option<RetentionReport>,
    /// Seconds spent writing and committing.
    pub write_seconds: f64,
}

/// The background task: its result and the buffers to reuse.
type Writer = tokio::task::JoinHandle<(Result<SaveOutcome>, Snapshot)>;

/// Writes [`Snapshot`]s on a background tokio runtime, one at a time: a new
/// save first waits for the previous one (the trainer's step stalls only
/// then), and hands back its result. Dropping the saver waits for the save
/// in flight.
#[derive(Debug)]
pub struct AsyncSaver {
    rt: tokio::runtime::Runtime,
    root: PathBuf,
    opts: SaveOptions,
    retention: Option<Retention>,
    pending: Option<(u64, Writer)>,
    /// Host buffers of the last finished save, reused by the next capture.
    pool: Vec<Vec<u8>>,
}

impl AsyncSaver {
    /// A saver writing checkpoints under `root`.
    ///
    /// # Errors
    /// [`Error::Background`] if the runtime cannot start.
    pub fn new(root: &Path, opts: SaveOptions) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .max_blocking_threads(1)
            .thread_name("weft-ckpt-save")
            .build()
            .map_err(|e| Error::Background {
                step: 0,
                reason: format!("cannot start the runtime: {e}"),
            })?;
        Ok(AsyncSaver {
            rt,
            root: root.to_owned(),
            opts,
            retention: None,
            pending: None,
            pool: Vec::new(),
        })
    }

    /// Applies `policy` after every successful save.
    pub fn with_retention(mut self, policy: Retention) -> Self {
        self.retention = Some(policy);
        self
    }

    /// The step being written, if any.
    pub fn in_flight(&self) -> Option<u64> {
        self.pending.as_ref().map(|p| p.0)
    }

    /// Whether the save in flight (if any) has finished.
    pub fn is_idle(&self) -> bool {
        self.pending.as_ref().is_none_or(|p| p.1.is_finished())
    }

    /// Starts writing `snapshot` in the background, after waiting for the
    /// previous save; returns the previous save's result (`None` if there
    /// was none). A failed previous save does not stop this one.
    pub fn save(&mut self, snapshot: Snapshot) -> Option<Result<SaveOutcome>> {
        let prev = self.wait();
        let root = self.root.clone();
        let opts = self.opts.clone();
        let retention = self.retention.clone();
        let step = snapshot.step;
        let handle = self.rt.spawn_blocking(move || {
            let t0 = Instant::now();
            let run = |snapshot: &Snapshot| {
                let ranks: Vec<Vec<ShardData<'_>>> = snapshot
                    .ranks
                    .iter()
                    .map(|r| r.iter().map(OwnedShard::as_data).collect())
                    .collect();
                let committed = save(
                    &root,
                    snapshot.step,
                    &snapshot.layout,
                    &ranks,
                    &snapshot.state,
                    &opts,
                )?;
                let write_seconds = t0.elapsed().as_secs_f64();
                let retention = retention.map(|r| r.apply(&root)).transpose()?;
                Ok(SaveOutcome {
                    committed,
                    retention,
                    write_seconds,
                })
            };
            (run(&snapshot), snapshot)
        });
        self.pending = Some((step, handle));
        prev
    }

    /// Waits for the save in flight; returns its result (`None` if idle).
    pub fn wait(&mut self) -> Option<Result<SaveOutcome>> {
        let (step, handle) = self.pending.take()?;
        Some(match self.rt.block_on(handle) {
            Ok((r, snapshot)) => {
                self.pool = snapshot
                    .ranks
                    .into_iter()
                    .flatten()
                    .map(|s| s.data)
                    .collect();
                self.pool.reverse();
                r
            }
            Err(e) => Err(Error::Background {
                step,
                reason: format!("the writer task died: {e}"),
            }),
        })
    }

    /// Waits for the previous save, copies `ranks` into host buffers (reusing
    /// the previous save's buffers, so that after the first save the copy
    /// runs at memory speed without page faults) and starts writing them in
    /// the background. Returns the previous save's result, as
    /// [`AsyncSaver::save`]. This is the call to make from a training loop:
    /// it returns as soon as the copy is done.
    pub fn save_from(
        &mut self,
        step: u64,
        layout: &Layout,
        ranks: &[Vec<ShardData<'_>>],
        state: &TrainerState,
    ) -> Option<Result<SaveOutcome>> {
        let prev = self.wait();
        let src = ranks;
        let mut pool = std::mem::take(&mut self.pool);
        let mut ranks: Vec<Vec<OwnedShard>> = ranks
            .iter()
            .map(|r| {
                r.iter()
                    .map(|s| {
                        let mut data = pool.pop().unwrap_or_default();
                        data.resize(s.data.len(), 0);
                        OwnedShard {
                            name: s.name.to_owned(),
                            dtype: s.dtype,
                            global_shape: s.global_shape.to_vec(),
                            region: s.region.clone(),
                            data,
                        }
                    })
                    .collect()
            })
            .collect();
        // The copy itself, on as many threads as the writer may use.
        let mut pairs: Vec<(&mut [u8], &[u8])> = ranks
            .iter_mut()
            .flatten()
            .zip(src.iter().flatten())
            .map(|(d, s)| (d.data.as_mut_slice(), s.data))
            .collect();
        let threads = self.opts.threads.clamp(1, pairs.len().max(1));
        let per = pairs.len().div_ceil(threads).max(1);
        std::thread::scope(|sc| {
            for group in pairs.chunks_mut(per) {
                sc.spawn(move || {
                    for (d, s) in group.iter_mut() {
                        d.copy_from_slice(s);
                    }
                });
            }
        });
        let snapshot = Snapshot {
            step,
            layout: layout.clone(),
            ranks,
            state: state.clone(),
        };
        let none = self.save(snapshot);
        debug_assert!(none.is_none());
        prev
    }
}

impl Drop for AsyncSaver {
    fn drop(&mut self) {
        let _ = self.wait();
    }
}
