//! Health and rewind: what a step's outcome says about the run — a
//! skipped update, an fp16 overflow, a loss spike, non-finite steps in a
//! row — and when that makes a rewind (`train.rewind`: back to the newest
//! checkpoint, the offending batches left out); the batches a run leaves
//! out ([`Skips`]); and the straggler detector.

use std::path::Path;

use weft_collectives::Communicator;
use weft_model::StepOutcome;
use weft_numerics::DynamicLossScaler;
use weft_trace::{EventKind, MetricsEventKind};

use crate::config::Config;
use crate::ranks::agree;
use crate::run::folder::{Kept, Metrics, io_err, skip_event, spike_event};
use crate::train::{HealthEvent, Observer, TrainError};

/// The batches a run leaves out and the rewinds it made: the config's
/// `train.skip_batches` and, resuming, the run's `skip.json`.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Skips {
    /// Steps (1-based) whose batch, in a run without skips, is left out:
    /// sorted, each once.
    batches: Vec<u64>,
    /// Rewinds made.
    pub(crate) rewinds: u32,
}

impl Skips {
    /// The batches a run in `run_dir` leaves out: `skip_batches` (the
    /// config's), and, resuming, those its `skip.json` records.
    /// Collective over `world`.
    pub(crate) fn for_run(
        world: &dyn Communicator,
        run_dir: &Path,
        resume: bool,
        skip_batches: &[u64],
    ) -> Result<Skips, TrainError> {
        let mut s = if resume {
            agree(world, Skips::read(run_dir))?
        } else {
            Skips::default()
        };
        s.add(skip_batches);
        Ok(s)
    }

    /// The skips recorded in `run_dir/skip.json` (none without one).
    fn read(run_dir: &Path) -> Result<Skips, TrainError> {
        let path = run_dir.join("skip.json");
        match std::fs::read_to_string(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Skips::default()),
            Err(e) => Err(io_err(&path)(e)),
            Ok(text) => serde_json::from_str(&text).map_err(|e| {
                TrainError::Setup(format!("{}: not a skip list: {e}", path.display()))
            }),
        }
    }

    /// Adds `batches`, keeping the list sorted and each batch once.
    pub(crate) fn add(&mut self, batches: &[u64]) {
        self.batches.extend_from_slice(batches);
        self.batches.sort_unstable();
        self.batches.dedup();
    }

    /// The batch (0-based) that optimizer step `step` (0-based) reads: the
    /// batches in order, those left out passed over.
    pub(crate) fn batch_of(&self, step: u64) -> u64 {
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

    /// Writes `run_dir/skip.json` atomically.
    fn write(&self, run_dir: &Path) -> Result<(), TrainError> {
        let path = run_dir.join("skip.json");
        let tmp = run_dir.join("skip.json.tmp");
        let json = serde_json::to_string_pretty(self).map_err(std::io::Error::other);
        json.and_then(|j| std::fs::write(&tmp, j + "\n"))
            .map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io_err(&path))
    }
}

/// A rewind the run must make: why, and the 0-based steps whose batches
/// it leaves out.
pub(crate) struct RewindCause {
    reason: String,
    steps: Vec<u64>,
}

/// The loss-spike detector: a step's loss above `train.spike_factor` ×
/// the median of the last `train.spike_window` finite losses (once ten
/// of them, or the whole window, are in) is a spike.
struct Spikes {
    recent: Vec<f64>,
    window: usize,
    factor: f64,
}

impl Spikes {
    /// The rolling median when `loss` is a spike; a finite `loss` then
    /// joins the window.
    fn check(&mut self, loss: f64) -> Option<f64> {
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

/// The health of one attempt at a run: the spike detector (its window
/// refilled from a resumed run's kept lines), non-finite steps in a row,
/// and the fp16 loss scaler.
pub(crate) struct Health {
    spikes: Spikes,
    nonfinite_run: u64,
    scaler: Option<DynamicLossScaler>,
    rewind: bool,
    nonfinite_limit: u64,
    spike_factor: f64,
}

impl Health {
    /// The health monitor of `config`, its spike window from `kept` and
    /// its loss scaler (fp16) continued from a checkpoint's state.
    ///
    /// # Errors
    /// A loss-scaling configuration the scaler refuses.
    pub(crate) fn new(
        config: &Config,
        kept: &Kept,
        restored_scale: Option<weft_numerics::LossScalerState>,
    ) -> Result<Self, TrainError> {
        let t = &config.train;
        let window = t.spike_window.max(1);
        let scaler = match t.precision {
            weft_kernels::Precision::F16 => {
                let c = t.loss_scale.scaler();
                let s = match restored_scale {
                    Some(state) => DynamicLossScaler::from_state(c, state),
                    None => DynamicLossScaler::new(c),
                };
                Some(s.map_err(|e| {
                    TrainError::Config(crate::config::ConfigError::key(
                        "train.loss_scale",
                        e.to_string(),
                    ))
                })?)
            }
            _ => None,
        };
        Ok(Self {
            spikes: Spikes {
                recent: kept.recent_losses(window),
                window,
                factor: t.spike_factor,
            },
            nonfinite_run: 0,
            scaler,
            rewind: t.rewind,
            nonfinite_limit: t.nonfinite_limit,
            spike_factor: t.spike_factor,
        })
    }

    /// The loss scale of the next step's backward (fp16), if scaling.
    pub(crate) fn loss_scale(&self) -> Option<f32> {
        self.scaler.as_ref().map(DynamicLossScaler::scale)
    }

    /// The loss scaler's state, for a checkpoint.
    pub(crate) fn scaler_state(&self) -> Option<weft_numerics::LossScalerState> {
        self.scaler.as_ref().map(DynamicLossScaler::state)
    }

    /// Takes step `step` (1-based) — which read the 0-based batch
    /// `batch` of `micro_batches`, its backward at `used_scale` — into
    /// account: logs and reports a skipped update (an fp16 overflow when
    /// the scale backing off can help), a loss spike, and returns the
    /// rewind it makes, if any.
    ///
    /// # Errors
    /// A failed write.
    pub(crate) fn check(
        &mut self,
        step: u64,
        out: &StepOutcome,
        (batch, micro_batches): (u64, usize),
        used_scale: Option<f32>,
        metrics: &mut Metrics,
        observer: &mut dyn Observer,
    ) -> Result<Option<RewindCause>, TrainError> {
        let StepOutcome {
            loss,
            grad_norm,
            applied,
        } = *out;
        // fp16: an overflow backs the scale off; it counts towards a
        // rewind only when that cannot help (the loss itself not finite, or
        // the scale at its floor)
        let mut scale_helps = false;
        if let (Some(sc), Some(used)) = (self.scaler.as_mut(), used_scale) {
            sc.update(!applied);
            scale_helps = !applied && loss.is_finite() && used > sc.config().min_scale;
        }
        if !applied {
            let event = match (used_scale, &self.scaler) {
                (Some(used), Some(sc)) if scale_helps => MetricsEventKind::Overflow {
                    loss,
                    loss_scale: f64::from(used),
                    next_loss_scale: f64::from(sc.scale()),
                },
                _ => skip_event(loss, grad_norm),
            };
            metrics.health(observer, step, event)?;
        }
        self.nonfinite_run = match (applied, scale_helps) {
            (true, _) => 0,
            (false, true) => self.nonfinite_run,
            (false, false) => self.nonfinite_run + 1,
        };
        let mut rewind = None;
        if self.rewind && self.nonfinite_run >= self.nonfinite_limit {
            rewind = Some(RewindCause {
                reason: format!("{} non-finite steps in a row", self.nonfinite_run),
                steps: (step - self.nonfinite_run..step).collect(),
            });
        }
        if let Some(median) = self.spikes.check(loss) {
            let event = spike_event(loss, median, batch, micro_batches);
            metrics.health(observer, step, event)?;
            if self.rewind {
                rewind = Some(RewindCause {
                    reason: format!(
                        "loss {loss:.4} > train.spike_factor {} × rolling median {median:.4}",
                        self.spike_factor
                    ),
                    steps: vec![step - 1],
                });
            }
        }
        Ok(rewind)
    }
}

/// Makes the rewind `cause` asked for at step `step` (1-based): the
/// batches of its steps after the checkpoint of `last_saved` (0: none)
/// join `skips`, world rank 0 records them (`skip.json`, an event) and
/// the observer hears of it. Collective over `world`.
///
/// # Errors
/// [`TrainError::TooManyRewinds`] past `train.max_rewinds`; a failed
/// write (on every rank).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rewind(
    world: &dyn Communicator,
    run_dir: &Path,
    config: &Config,
    skips: &mut Skips,
    step: u64,
    cause: RewindCause,
    last_saved: u64,
    observer: &mut dyn Observer,
) -> Result<(), TrainError> {
    // 0-based steps in, 1-based batches out
    let left_out: Vec<u64> = cause
        .steps
        .iter()
        .filter(|&&s| s >= last_saved)
        .map(|&s| skips.batch_of(s) + 1)
        .collect();
    if skips.rewinds >= config.train.max_rewinds {
        return Err(TrainError::TooManyRewinds {
            run: run_dir.to_owned(),
            step,
            reason: cause.reason,
            max: config.train.max_rewinds,
        });
    }
    skips.add(&left_out);
    skips.rewinds += 1;
    let kind = EventKind::Rewind {
        step,
        reason: cause.reason,
        to_step: last_saved,
        skipped_batches: left_out,
        rewinds: skips.rewinds,
    };
    let recorded = if world.rank() == 0 {
        skips.write(run_dir).and_then(|()| {
            let line = weft_supervise::events::stamped(kind.clone());
            weft_supervise::events::append_event(run_dir, &line)
                .map_err(io_err(&run_dir.join("events.jsonl")))
        })
    } else {
        Ok(())
    };
    agree(world, recorded)?;
    observer.event(&HealthEvent::Run(kind));
    Ok(())
}

/// The straggler detector: every `train.straggler_window` steps the ranks
/// share their work time over the window, and a rank whose work exceeds
/// `train.straggler_factor` times the median of the ranks of its pipeline
/// stage in two windows in a row is reported (a `straggler` event: timing,
/// not the computation, so in `events.jsonl`, which a rerun need not
/// reproduce).
pub(crate) struct Stragglers {
    factor: f64,
    window: u64,
    dims: weft_parallel::ParallelDims,
    /// This rank's work over the current window.
    work: f64,
    /// Each rank's windows in a row above the factor.
    slow_windows: Vec<u32>,
}

impl Stragglers {
    /// The detector of `config`'s `[train]` settings over layout `dims`.
    pub(crate) fn new(config: &Config, dims: weft_parallel::ParallelDims) -> Self {
        Self {
            factor: config.train.straggler_factor,
            window: config.train.straggler_window,
            dims,
            work: 0.0,
            slow_windows: vec![0; dims.world_size()],
        }
    }

    /// Adds this rank's work time of a step, and after step `step`
    /// (1-based) that ends a window shares the window's with every rank
    /// and reports the stragglers. Collective over `world` then.
    ///
    /// # Errors
    /// A failed exchange or write.
    pub(crate) fn step(
        &mut self,
        world: &dyn Communicator,
        step: u64,
        work: f64,
        run_dir: &Path,
        observer: &mut dyn Observer,
    ) -> Result<(), TrainError> {
        use weft_collectives::CommunicatorExt;
        self.work += work;
        if self.factor <= 0.0 || !step.is_multiple_of(self.window) {
            return Ok(());
        }
        let mut all = vec![0.0f64; world.size()];
        world.all_gather(&[self.work], &mut all)?;
        self.work = 0.0;
        let dims = self.dims;
        for (rank, ratio) in stragglers(&all, |r| dims.coords_of(r).pp, self.factor)
            .into_iter()
            .enumerate()
        {
            self.slow_windows[rank] = if ratio.is_some() {
                self.slow_windows[rank] + 1
            } else {
                0
            };
            let (Some(ratio), 2) = (ratio, self.slow_windows[rank]) else {
                continue;
            };
            let kind = EventKind::Straggler {
                step,
                rank,
                ratio,
                window_steps: self.window,
            };
            if world.rank() == 0 {
                let line = weft_supervise::events::stamped(kind.clone());
                weft_supervise::events::append_event(run_dir, &line)
                    .map_err(io_err(&run_dir.join("events.jsonl")))?;
            }
            observer.event(&HealthEvent::Run(kind));
        }
        Ok(())
    }
}

/// Each rank's ratio of `work` to the median of the ranks in its group
/// (`group_of`: ranks doing the same work), where it exceeds `factor`; a
/// rank alone in its group is never a straggler.
pub(crate) fn stragglers(
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
            // the lower median: with two ranks, the faster one
            let median = peers[(peers.len() - 1) / 2];
            let ratio = work[r] / median;
            (median > 0.0 && ratio > factor).then_some(ratio)
        })
        .collect()
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
    }

    proptest::proptest! {
        /// The steps read the batches in order, each once, none that is
        /// left out.
        #[test]
        fn steps_read_every_batch_not_left_out_in_order(
            left_out in proptest::collection::vec(1u64..60, 0..12),
        ) {
            let mut skips = Skips::default();
            skips.add(&left_out);
            let read: Vec<u64> = (0..40).map(|s| skips.batch_of(s) + 1).collect();
            let expected: Vec<u64> =
                (1..).filter(|b| !left_out.contains(b)).take(40).collect();
            proptest::prop_assert_eq!(read, expected);
        }
    }
}
