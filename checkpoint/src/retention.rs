//! Retention: which old checkpoints to delete.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{IoContext, Result};
use crate::read::{Checkpoint, VerifyLevel, list_checkpoints, read_latest_pointer};
use crate::write::{parse_step_dir, step_dir_name};

/// Keep the newest `keep_last` checkpoints that verify and every
/// checkpoint whose step is a multiple of `keep_every`; delete the rest.
/// Only checkpoints that verify count towards `keep_last`, so a damaged one
/// never pushes a valid one out. Whatever the policy, the newest checkpoint
/// that verifies (the one a restart would load) and the one `latest` points
/// at are never deleted, and neither is anything newer than the newest
/// valid one (kept for inspection).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retention {
    /// How many of the newest checkpoints to keep (at least the newest
    /// valid one is kept even when 0).
    pub keep_last: usize,
    /// Also keep steps that are multiples of this (`None`: no such rule).
    pub keep_every: Option<u64>,
    /// How the newest valid checkpoint is found (default
    /// [`VerifyLevel::Full`]: every checksum).
    pub verify: VerifyLevel,
}

impl Retention {
    /// Keep the last `keep_last` and every `keep_every`-th.
    pub fn new(keep_last: usize, keep_every: Option<u64>) -> Self {
        Retention {
            keep_last,
            keep_every,
            verify: VerifyLevel::Full,
        }
    }

    /// Applies the policy to the checkpoints under `root`. Deletion first
    /// renames a folder to `step-N.deleting` (atomically, so a half-deleted
    /// folder never looks like a checkpoint), then removes it. Leftover
    /// `.deleting`/`.replaced` folders and `.tmp` folders of steps older
    /// than the newest valid checkpoint (saves killed long ago) are
    /// removed too. Do not run it while another process is saving into the
    /// same root.
    ///
    /// # Errors
    /// [`crate::Error::Io`] if listing or deleting fails.
    pub fn apply(&self, root: &Path) -> Result<RetentionReport> {
        let all = list_checkpoints(root)?;
        let mut report = RetentionReport::default();
        // The newest `keep_last` checkpoints that verify, newest first (the
        // first is the one a restart would load, kept whatever keep_last):
        // a checkpoint that does not verify never counts, so it cannot
        // push a valid one out.
        let verifies = |dir: &Path| {
            Checkpoint::open(dir)
                .and_then(|c| match self.verify {
                    VerifyLevel::Structure => Ok(()),
                    VerifyLevel::Full => c.verify().map(|_| ()),
                })
                .is_ok()
        };
        let mut newest: Vec<u64> = Vec::new();
        for (step, dir) in all.iter().rev() {
            if newest.len() >= self.keep_last.max(1) {
                break;
            }
            if verifies(dir) {
                newest.push(*step);
            }
        }
        let Some(&anchor) = newest.first() else {
            // Nothing verifies: delete nothing.
            report.kept = all.iter().map(|c| c.0).collect();
            return Ok(report);
        };
        let pointer = read_latest_pointer(root)
            .ok()
            .flatten()
            .and_then(|p| parse_step_dir(&p));
        for (step, dir) in &all {
            let keep = *step >= anchor
                || Some(*step) == pointer
                || newest.contains(step)
                || self
                    .keep_every
                    .is_some_and(|n| n > 0 && step / n * n == *step);
            if keep {
                report.kept.push(*step);
                continue;
            }
            let doomed = root.join(format!("{}.deleting", step_dir_name(*step)));
            fs::rename(dir, &doomed).ctx("rename for deletion", dir)?;
            fs::remove_dir_all(&doomed).ctx("remove", &doomed)?;
            report.deleted.push(*step);
        }
        for ent in fs::read_dir(root).ctx("list", root)? {
            let ent = ent.ctx("list", root)?;
            let name = ent.file_name();
            let Some(name) = name.to_str() else { continue };
            let stale = if let Some(base) = name.strip_suffix(".tmp") {
                parse_step_dir(base).is_some_and(|s| s < anchor)
            } else if let Some(base) = name
                .strip_suffix(".deleting")
                .or_else(|| name.strip_suffix(".replaced"))
            {
                parse_step_dir(base).is_some()
            } else {
                false
            };
            if stale && ent.file_type().ctx("stat", ent.path())?.is_dir() {
                fs::remove_dir_all(ent.path()).ctx("remove", ent.path())?;
                report.removed_stale.push(ent.path());
            }
        }
        Ok(report)
    }
}

/// What [`Retention::apply`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetentionReport {
    /// Steps kept.
    pub kept: Vec<u64>,
    /// Steps deleted.
    pub deleted: Vec<u64>,
    /// Leftover folders of crashed saves or deletions that were removed.
    pub removed_stale: Vec<PathBuf>,
}
