//! Health and rewind: what a step's outcome says about the run — a
//! skipped update, an fp16 overflow, a loss spike, non-finite steps in a
//! row — and when that makes a rewind (`train.rewind`: back to the newest
//! checkpoint, the offending batches left out, `weft-supervise`'s
//! [`SkipList`]); and the stragglers. The detectors are `weft-supervise`'s
//! ([`weft_supervise::health`]); here they are fed and their findings
//! logged.

use std::path::Path;

use weft_collectives::Communicator;
use weft_model::StepOutcome;
use weft_numerics::DynamicLossScaler;
use weft_supervise::health::{SkipList, SpikeDetector, StragglerDetector};
use weft_trace::{EventKind, MetricsEventKind};

use crate::config::Config;
use crate::ranks::agree;
use crate::run::folder::{Kept, Metrics, io_err, skip_event, spike_event};
use crate::train::{HealthEvent, Observer, TrainError};

/// The batches a run in `run_dir` leaves out: `skip_batches` (the
/// config's), and, resuming, those its `skip.json` records. Collective
/// over `world`.
pub(crate) fn skips_for_run(
    world: &dyn Communicator,
    run_dir: &Path,
    resume: bool,
    skip_batches: &[u64],
) -> Result<SkipList, TrainError> {
    let mut s = if resume {
        let read = SkipList::read(run_dir).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidData => TrainError::Setup(e.to_string()),
            _ => io_err(&run_dir.join(SkipList::FILE))(e),
        });
        agree(world, read)?
    } else {
        SkipList::default()
    };
    s.add(skip_batches);
    Ok(s)
}

/// A rewind the run must make: why, and the 0-based steps whose batches
/// it leaves out.
pub(crate) struct RewindCause {
    reason: String,
    steps: Vec<u64>,
}

/// The health of one attempt at a run: the spike detector (its window
/// refilled from a resumed run's kept lines), non-finite steps in a row,
/// and the fp16 loss scaler.
pub(crate) struct Health {
    spikes: SpikeDetector,
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
            spikes: SpikeDetector::new(window, t.spike_factor, kept.losses()),
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
    skips: &mut SkipList,
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
        skips
            .write(run_dir)
            .map_err(io_err(&run_dir.join(SkipList::FILE)))
            .and_then(|()| {
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
    detector: StragglerDetector,
    factor: f64,
    window: u64,
    dims: weft_parallel::ParallelDims,
    /// This rank's work over the current window.
    work: f64,
}

impl Stragglers {
    /// The detector of `config`'s `[train]` settings over layout `dims`.
    pub(crate) fn new(config: &Config, dims: weft_parallel::ParallelDims) -> Self {
        Self {
            detector: StragglerDetector::new(dims.world_size(), config.train.straggler_factor),
            factor: config.train.straggler_factor,
            window: config.train.straggler_window,
            dims,
            work: 0.0,
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
        for (rank, ratio) in self.detector.window(&all, |r| dims.coords_of(r).pp) {
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
