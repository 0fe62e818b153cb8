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

    /// Allocates (and touches, on several threads) the host buffers that
    /// saving `ranks` will need, so that even the first
    /// [`AsyncSaver::save_from`] copies into memory that is already mapped
    /// instead of taking a page fault every 4 KiB inside the training
    /// step. Call it once at start-up with the shards the loop will save
    /// (their contents are not read). Waits for a save in flight first and
    /// returns its result, as [`AsyncSaver::wait`].
    pub fn reserve(&mut self, ranks: &[Vec<ShardData<'_>>]) -> Option<Result<SaveOutcome>> {
        let prev = self.wait();
        let mut pool = std::mem::take(&mut self.pool);
        let mut bufs: Vec<Vec<u8>> = ranks
            .iter()
            .flatten()
            .map(|s| match pool.pop() {
                // A buffer of a previous save is already mapped.
                Some(mut b) if b.len() == s.data.len() => {
                    b.truncate(s.data.len());
                    b
                }
                // Zeroed by the allocator without touching the pages.
                _ => vec![0u8; s.data.len()],
            })
            .collect();
        let parts: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        parallel_fill(parts, self.opts.threads);
        bufs.reverse();
        self.pool = bufs;
        prev
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
        let pairs: Vec<(&mut [u8], &[u8])> = ranks
            .iter_mut()
            .flatten()
            .zip(src.iter().flatten())
            .map(|(d, s)| (d.data.as_mut_slice(), s.data))
            .collect();
        parallel_copy(pairs, self.opts.threads);
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

/// Copies below this many bytes per thread stay on one thread.
const COPY_MIN_BYTES: usize = 4 << 20;

/// Copies each source into its destination (of equal lengths) on up to
/// `threads` threads, cutting the work into contiguous parts of equal bytes
/// regardless of tensor boundaries (one large embedding does not leave the
/// other threads idle).
fn parallel_copy(pairs: Vec<(&mut [u8], &[u8])>, threads: usize) {
    let total: usize = pairs.iter().map(|p| p.1.len()).sum();
    let threads = threads.clamp(1, total.div_ceil(COPY_MIN_BYTES).max(1));
    if threads == 1 {
        for (d, s) in pairs {
            d.copy_from_slice(s);
        }
        return;
    }
    let per = total.div_ceil(threads);
    let mut groups: Vec<Vec<(&mut [u8], &[u8])>> = vec![Vec::new()];
    let mut room = per;
    for (mut d, mut s) in pairs {
        while !s.is_empty() {
            if room == 0 {
                groups.push(Vec::new());
                room = per;
            }
            let n = room.min(s.len());
            let (d0, d1) = std::mem::take(&mut d).split_at_mut(n);
            let (s0, s1) = s.split_at(n);
            if let Some(g) = groups.last_mut() {
                g.push((d0, s0));
            }
            d = d1;
            s = s1;
            room -= n;
        }
    }
    std::thread::scope(|sc| {
        let mut groups = groups.into_iter();
        let mine = groups.next();
        for group in groups {
            sc.spawn(move || {
                for (d, s) in group {
                    d.copy_from_slice(s);
                }
            });
        }
        for (d, s) in mine.into_iter().flatten() {
            d.copy_from_slice(s);
        }
    });
}

/// Writes every byte of `bufs` (touching their pages) on up to `threads`
/// threads, in contiguous parts of equal bytes.
fn parallel_fill(bufs: Vec<&mut [u8]>, threads: usize) {
    let total: usize = bufs.iter().map(|b| b.len()).sum();
    let threads = threads.clamp(1, total.div_ceil(COPY_MIN_BYTES).max(1));
    let per = total.div_ceil(threads).max(1);
    let mut groups: Vec<Vec<&mut [u8]>> = vec![Vec::new()];
    let mut room = per;
    for mut b in bufs {
        while !b.is_empty() {
            if room == 0 {
                groups.push(Vec::new());
                room = per;
            }
            let n = room.min(b.len());
            let (b0, b1) = std::mem::take(&mut b).split_at_mut(n);
            if let Some(g) = groups.last_mut() {
                g.push(b0);
            }
            b = b1;
            room -= n;
        }
    }
    std::thread::scope(|sc| {
        for group in groups {
            sc.spawn(move || {
                for b in group {
                    b.fill(0);
                }
            });
        }
    });
}

impl Drop for AsyncSaver {
    fn drop(&mut self) {
        let _ = self.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::parallel_copy;

    #[test]
    fn parallel_copy_copies_every_byte_at_every_thread_count() {
        let sizes = [0usize, 1, 5 << 20, 3, 9 << 20, 1 << 20, 7];
        let srcs: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|k| (k * 31 + i * 7) as u8).collect())
            .collect();
        for threads in [1, 2, 3, 8] {
            let mut dsts: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0xEE; n]).collect();
            let pairs = dsts
                .iter_mut()
                .zip(&srcs)
                .map(|(d, s)| (d.as_mut_slice(), s.as_slice()))
                .collect();
            parallel_copy(pairs, threads);
            assert!(dsts == srcs, "{threads} threads");
            let parts = dsts.iter_mut().map(Vec::as_mut_slice).collect();
            super::parallel_fill(parts, threads);
            assert!(dsts.iter().flatten().all(|&b| b == 0), "{threads} threads");
        }
    }
}
