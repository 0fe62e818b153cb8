//! The ranks' side of fault drills: the faults given to this process
//! (`weft train --inject`), each fired once where it belongs — a kill or a
//! hang as its step begins, garbage or non-finite data on its batch, a
//! slowdown from its step on, a crash while saving, a rotten checkpoint
//! after its commit — and recorded in `events.jsonl` as it fires, for a
//! drill to measure detection from.

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use weft_supervise::{Fault, FaultKind};
use weft_trace::EventKind;

/// The faults of a run, shared by every rank of this process; each
/// fires once (a `nan` over its `count` steps, a `slow` from its step
/// on), so a run rewound past a fault does not meet it again.
#[derive(Debug, Default)]
pub struct FaultPlan {
    armed: Mutex<Vec<(Fault, bool)>>,
}

impl FaultPlan {
    /// A plan of `faults`, none fired yet.
    #[must_use]
    pub fn new(faults: &[Fault]) -> Self {
        Self {
            armed: Mutex::new(faults.iter().map(|&f| (f, false)).collect()),
        }
    }

    /// The unfired faults `hit` selects; `fired` marks them.
    fn take(&self, hit: impl Fn(&Fault) -> bool, fired: impl Fn(&Fault) -> bool) -> Vec<Fault> {
        let mut armed = self
            .armed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut out = Vec::new();
        for (f, done) in armed.iter_mut() {
            if !*done && hit(f) {
                *done = fired(f);
                out.push(*f);
            }
        }
        out
    }

    /// Records that `f` fires now on world rank `rank`.
    fn fired(run_dir: &Path, f: &Fault, rank: usize) {
        let _ = weft_supervise::events::append_event(
            run_dir,
            &weft_supervise::events::stamped(EventKind::Fault {
                fault: f.to_string(),
                rank,
            }),
        );
    }

    /// Fires the kills and hangs armed for world rank `rank` at step
    /// `step` (1-based), as the step begins.
    pub fn before_step(&self, run_dir: &Path, step: u64, rank: usize) {
        let hit = |f: &Fault| {
            f.rank == rank && f.step == step && matches!(f.kind, FaultKind::Kill | FaultKind::Hang)
        };
        if let Some(f) = self.take(hit, |_| true).first() {
            Self::fired(run_dir, f, rank);
            if f.kind == FaultKind::Kill {
                die();
            }
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
    }

    /// The `nan` fault whose batches include that of fault-free step
    /// `batch` (1-based): its gradients are to be made non-finite. A data
    /// fault stays armed (every rank reads the batch; a rewind leaves it
    /// out); the writer (`run_dir`) records it as it first fires.
    pub fn nan_at(&self, batch: u64, run_dir: Option<&Path>) -> bool {
        let hit =
            |f: &Fault| f.kind == FaultKind::Nan && (f.step..f.step + f.count).contains(&batch);
        let Some(f) = self.take(hit, |_| false).first().copied() else {
            return false;
        };
        if let Some(dir) = run_dir
            && batch == f.step
        {
            Self::fired(dir, &f, 0);
        }
        true
    }

    /// Garbles `targets` (tokens below `vocab`) when the batch of
    /// fault-free step `batch` (1-based) is a `spike` fault's: the model
    /// is then confidently wrong. The writer (`run_dir`) records it.
    pub fn spike_at(&self, batch: u64, targets: &mut [u32], vocab: usize, run_dir: Option<&Path>) {
        let hit = |f: &Fault| f.kind == FaultKind::Spike && f.step == batch;
        let Some(f) = self.take(hit, |_| false).first().copied() else {
            return;
        };
        if let Some(dir) = run_dir {
            Self::fired(dir, &f, 0);
        }
        let mut x = batch.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        for t in targets {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *t = u32::try_from(x % vocab.max(1) as u64).unwrap_or(0);
        }
    }

    /// How many times slower world rank `rank` computes at step `step`
    /// (1: not slowed).
    pub fn slowdown(&self, step: u64, rank: usize) -> f64 {
        self.take(
            |f| f.kind == FaultKind::Slow && f.rank == rank && step >= f.step,
            |_| false,
        )
        .iter()
        .map(|f| f.factor)
        .product()
    }

    /// The faults of the save of checkpoint `step` on world rank `rank`
    /// (a `crash-during-save` of this rank; a `corrupt-checkpoint`, on
    /// rank 0), taken from the plan to fire where the save runs (on
    /// its own thread, for a background save).
    pub fn for_save(&self, step: u64, rank: usize) -> SaveFaults {
        let hit = |f: &Fault| {
            f.step == step
                && (f.kind == FaultKind::CrashDuringSave && f.rank == rank
                    || f.kind == FaultKind::CorruptCheckpoint && rank == 0)
        };
        let taken = self.take(hit, |_| true);
        let first = |kind| taken.iter().find(|f| f.kind == kind).copied();
        SaveFaults {
            crash: first(FaultKind::CrashDuringSave),
            corrupt: first(FaultKind::CorruptCheckpoint),
            rank,
        }
    }
}

/// The faults of one save ([`FaultPlan::for_save`]).
#[derive(Clone, Copy, Debug)]
pub struct SaveFaults {
    crash: Option<Fault>,
    corrupt: Option<Fault>,
    rank: usize,
}

impl SaveFaults {
    /// Whether the save is to be corrupted once committed (a drill then
    /// waits for its commit, so that the faults after it find it rotten).
    pub fn corrupts(&self) -> bool {
        self.corrupt.is_some()
    }

    /// Kills this process between the rank's write and the commit, if a
    /// `crash-during-save` fault says so.
    pub fn during(&self, run_dir: &Path) {
        if let Some(f) = &self.crash {
            FaultPlan::fired(run_dir, f, self.rank);
            die();
        }
    }

    /// Flips a byte in the middle of the largest file of the committed
    /// checkpoint `dir`, if a `corrupt-checkpoint` fault says so.
    pub fn after(&self, run_dir: &Path, dir: &Path) {
        let Some(f) = &self.corrupt else {
            return;
        };
        FaultPlan::fired(run_dir, f, self.rank);
        let largest = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| Some((e.metadata().ok()?.len(), e.path())))
            .max();
        if let Some((len, path)) = largest
            && let Ok(mut bytes) = std::fs::read(&path)
            && len > 0
        {
            let at = bytes.len() / 2;
            bytes[at] ^= 0x5a;
            let _ = std::fs::write(&path, bytes);
        }
    }
}

/// SIGKILLs this process, as a drill asks.
fn die() {
    // SAFETY: sends SIGKILL to this process.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}
