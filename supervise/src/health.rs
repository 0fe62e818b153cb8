//! The rank side of a run's health: the detectors a training loop feeds
//! every step, and the list of batches a run leaves out after a rewind.
//!
//! * [`SpikeDetector`]: a step's loss above a factor times the median of
//!   the recent finite losses is a spike.
//! * [`StragglerDetector`]: ranks doing the same work (a pipeline stage's
//!   replicas) compared window by window; a rank slower than a factor
//!   times its group's median in two windows in a row is reported.
//! * [`SkipList`]: the batches a run leaves out (`skip.json` in the run
//!   folder) and the step → batch map that passes over them, so that a
//!   rewound run reads the batches in order without the offending ones.
//!
//! ```
//! use weft_supervise::health::{SkipList, SpikeDetector};
//!
//! let mut spikes = SpikeDetector::new(20, 3.0, vec![2.0; 10]);
//! assert_eq!(spikes.check(2.1), None);
//! assert_eq!(spikes.check(9.0), Some(2.0)); // above 3 × the median 2.0
//!
//! let mut skips = SkipList::default();
//! skips.add(&[3]); // the third batch is left out
//! let read: Vec<u64> = (0..4).map(|step| skips.batch_of(step) + 1).collect();
//! assert_eq!(read, [1, 2, 4, 5]);
//! ```

use std::io;
use std::path::Path;

/// The loss-spike detector: a step's loss above `factor` × the median of
/// the last `window` finite losses (once ten of them, or the whole
/// window, are in) is a spike.
#[derive(Clone, Debug, PartialEq)]
pub struct SpikeDetector {
    recent: Vec<f64>,
    window: usize,
    factor: f64,
}

impl SpikeDetector {
    /// A detector over windows of `window` losses (at least 1), with the
    /// window's losses so far, oldest first (a resumed run's last ones).
    #[must_use]
    pub fn new(window: usize, factor: f64, mut recent: Vec<f64>) -> Self {
        let window = window.max(1);
        recent.retain(|l| l.is_finite());
        let drop = recent.len().saturating_sub(window);
        recent.drain(..drop);
        Self {
            recent,
            window,
            factor,
        }
    }

    /// The rolling median when `loss` is a spike; a finite `loss` then
    /// joins the window.
    pub fn check(&mut self, loss: f64) -> Option<f64> {
        if !loss.is_finite() {
            return None;
        }
        let mut spike = None;
        if self.recent.len() >= self.window.min(10) {
            let mut sorted = self.recent.clone();
            sorted.sort_by(f64::total_cmp);
            let median = sorted[sorted.len() / 2];
            if loss > self.factor * median {
                spike = Some(median);
            }
        }
        self.recent.push(loss);
        if self.recent.len() > self.window {
            self.recent.remove(0);
        }
        spike
    }
}

/// The straggler detector: fed every rank's work time over a window, it
/// reports a rank whose work exceeds `factor` times the median of its
/// group's in two windows in a row (once, on the second).
#[derive(Clone, Debug, PartialEq)]
pub struct StragglerDetector {
    factor: f64,
    slow_windows: Vec<u32>,
}

impl StragglerDetector {
    /// A detector over `ranks` ranks; `factor` ≤ 0 reports none.
    #[must_use]
    pub fn new(ranks: usize, factor: f64) -> Self {
        Self {
            factor,
            slow_windows: vec![0; ranks],
        }
    }

    /// Takes a window's work time of every rank (`work[r]`, rank order)
    /// with `group_of` (ranks doing the same work share a group), and
    /// returns the ranks reported now, with their ratio to their group's
    /// median.
    pub fn window(&mut self, work: &[f64], group_of: impl Fn(usize) -> usize) -> Vec<(usize, f64)> {
        if self.factor <= 0.0 {
            return Vec::new();
        }
        self.slow_windows.resize(work.len(), 0);
        let mut out = Vec::new();
        for (rank, ratio) in stragglers(work, group_of, self.factor)
            .into_iter()
            .enumerate()
        {
            self.slow_windows[rank] = if ratio.is_some() {
                self.slow_windows[rank] + 1
            } else {
                0
            };
            if let (Some(ratio), 2) = (ratio, self.slow_windows[rank]) {
                out.push((rank, ratio));
            }
        }
        out
    }
}

/// Each rank's ratio of `work` to the median of the ranks in its group
/// (`group_of`: ranks doing the same work), where it exceeds `factor`; a
/// rank alone in its group is never a straggler. The median of an even
/// group is its lower one: with two ranks, the faster.
#[must_use]
pub fn stragglers(
    work: &[f64],
    group_of: impl Fn(usize) -> usize,
    factor: f64,
) -> Vec<Option<f64>> {
    (0..work.len())
        .map(|r| {
            let mut peers: Vec<f64> = (0..work.len())
                .filter(|&q| group_of(q) == group_of(r))
                .map(|q| work[q])
                .collect();
            if peers.len() < 2 {
                return None;
            }
            peers.sort_by(f64::total_cmp);
            let median = peers[(peers.len() - 1) / 2];
            let ratio = work[r] / median;
            (median > 0.0 && ratio > factor).then_some(ratio)
        })
        .collect()
}

/// The batches a run leaves out and the rewinds it made, as the run
/// folder's `skip.json` holds them.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SkipList {
    /// Batches (1-based: the step that reads each in a run without skips)
    /// left out: sorted, each once.
    batches: Vec<u64>,
    /// Rewinds made.
    pub rewinds: u32,
}

impl SkipList {
    /// The file name in a run folder.
    pub const FILE: &'static str = "skip.json";

    /// The list `run_dir/skip.json` records (empty without one).
    ///
    /// # Errors
    /// The file cannot be read, or is not a skip list
    /// ([`io::ErrorKind::InvalidData`], naming the file).
    pub fn read(run_dir: &Path) -> io::Result<Self> {
        let path = run_dir.join(Self::FILE);
        match weft_trace::input::read_to_string(&path, weft_trace::input::CONFIG_BYTES) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(e),
            Ok(text) => serde_json::from_str(&text).map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}: not a skip list: {e}", path.display()),
                )
            }),
        }
    }

    /// Writes `run_dir/skip.json` atomically (a temporary file renamed).
    ///
    /// # Errors
    /// The write or the rename failed.
    pub fn write(&self, run_dir: &Path) -> io::Result<()> {
        let tmp = run_dir.join("skip.json.tmp");
        let json = serde_json::to_string_pretty(self).map_err(io::Error::other)?;
        std::fs::write(&tmp, json + "\n")?;
        std::fs::rename(&tmp, run_dir.join(Self::FILE))
    }

    /// Adds `batches` (1-based), keeping the list sorted and each batch
    /// once.
    pub fn add(&mut self, batches: &[u64]) {
        self.batches.extend_from_slice(batches);
        self.batches.sort_unstable();
        self.batches.dedup();
    }

    /// The batches left out (1-based), in order.
    #[must_use]
    pub fn batches(&self) -> &[u64] {
        &self.batches
    }

    /// The batch (0-based) that optimizer step `step` (0-based) reads: the
    /// batches in order, those left out passed over.
    #[must_use]
    pub fn batch_of(&self, step: u64) -> u64 {
        let mut b = step;
        for &s in &self.batches {
            if s - 1 <= b {
                b += 1;
            } else {
                break;
            }
        }
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_straggler_is_the_rank_slower_than_its_stage_peers() {
        // two stages of three replicas; rank 4 twice as slow as its peers
        let work = [1.0, 1.1, 0.9, 2.0, 4.0, 2.1];
        let got = stragglers(&work, |r| r / 3, 1.5);
        assert_eq!(got.iter().filter(|r| r.is_some()).count(), 1);
        assert!((got[4].unwrap() - 4.0 / 2.1).abs() < 1e-12);
        // two ranks: the slower one against the faster
        assert_eq!(stragglers(&[1.0, 3.0], |_| 0, 1.5), [None, Some(3.0)]);
        // alone in its stage: never
        assert_eq!(stragglers(&[1.0, 3.0], |r| r, 1.5), [None, None]);
        // reported on the second slow window in a row, once
        let mut d = StragglerDetector::new(2, 1.5);
        assert!(d.window(&[1.0, 3.0], |_| 0).is_empty());
        assert_eq!(d.window(&[1.0, 3.0], |_| 0), [(1, 3.0)]);
        assert!(d.window(&[1.0, 3.0], |_| 0).is_empty());
        assert!(
            StragglerDetector::new(2, 0.0)
                .window(&[1.0, 9.0], |_| 0)
                .is_empty()
        );
    }

    #[test]
    fn a_spike_is_above_the_factor_times_the_rolling_median() {
        let mut d = SpikeDetector::new(4, 2.0, vec![f64::NAN, 9.0, 1.0, 1.0, 1.0, 1.0]);
        // the window keeps the last 4 finite losses: all 1.0
        assert_eq!(d.check(2.5), Some(1.0));
        assert_eq!(d.check(f64::INFINITY), None);
        // fewer than min(window, 10) losses: no verdict yet
        let mut young = SpikeDetector::new(50, 2.0, vec![1.0; 9]);
        assert_eq!(young.check(100.0), None);
        assert_eq!(young.check(100.0), Some(1.0));
    }

    #[test]
    fn a_skip_list_round_trips_through_its_file() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(SkipList::read(dir.path()).unwrap(), SkipList::default());
        let mut s = SkipList::default();
        s.add(&[7, 3, 7]);
        s.rewinds = 2;
        s.write(dir.path()).unwrap();
        let back = SkipList::read(dir.path()).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.batches(), [3, 7]);
        std::fs::write(dir.path().join(SkipList::FILE), "[1, 2").unwrap();
        let e = SkipList::read(dir.path()).unwrap_err();
        assert!(e.to_string().contains("not a skip list"), "{e}");
    }

    proptest::proptest! {
        /// The steps read the batches in order, each once, none that is
        /// left out.
        #[test]
        fn steps_read_every_batch_not_left_out_in_order(
            left_out in proptest::collection::vec(1u64..60, 0..12),
        ) {
            let mut skips = SkipList::default();
            skips.add(&left_out);
            let read: Vec<u64> = (0..40).map(|s| skips.batch_of(s) + 1).collect();
            let expected: Vec<u64> =
                (1..).filter(|b| !left_out.contains(b)).take(40).collect();
            proptest::prop_assert_eq!(read, expected);
        }
    }
}
