//! The run's TensorBoard event file (`run.tensorboard`, on by default):
//! world rank 0 writes `events.out.tfevents.*` in the run folder, so that
//! `tensorboard --logdir <runs folder>` shows each run beside a team's
//! others. Every scalar is a number of `metrics.jsonl` or
//! `expert_load.jsonl` ([`weft_trace::tensorboard`]'s mapping); health
//! events, rewinds, stragglers and checkpoints are texts, and so is the
//! configuration. A resumed or rewound run rewrites the file from the
//! lines its logs keep, as it rewrites them.

use std::path::Path;

use weft_trace::tensorboard::{self, Entry, RunBoard};
use weft_trace::{EventKind, ExpertLoadRecord, Summary};

use crate::config::Config;
use crate::run::folder::io_err;
use crate::train::{EvalReport, HealthEvent, Observer, RunInfo, StepReport, TrainError};

/// The run's board ([`RunBoard::open`]: the configuration and the logs up
/// to `step`), on world rank 0 (`writer`) with `run.tensorboard`.
///
/// # Errors
/// A failed write, naming the file.
pub(crate) fn open(
    config: &Config,
    run_dir: &Path,
    writer: bool,
    step: u64,
) -> Result<Option<RunBoard>, TrainError> {
    if !(writer && config.run.tensorboard) {
        return Ok(None);
    }
    let board = RunBoard::open(run_dir, &config.to_toml(), step);
    Ok(Some(board.map_err(io_err(run_dir))?))
}

/// An observer that also writes the board: what the run reports, it
/// plots.
pub(crate) struct Tee<'a> {
    /// The run's observer.
    pub inner: &'a mut dyn Observer,
    /// The board, on world rank 0 with `run.tensorboard`.
    pub board: Option<RunBoard>,
}

impl Tee<'_> {
    /// Writes a step's expert-layer records.
    pub(crate) fn experts(&mut self, records: &[ExpertLoadRecord]) {
        if let Some(b) = &mut self.board {
            for r in records {
                b.write(&tensorboard::expert_entries(r));
            }
        }
    }

    /// Flushes the board and reports its first failure.
    ///
    /// # Errors
    /// A failed write of the event file.
    pub(crate) fn check(&mut self) -> Result<(), TrainError> {
        match &mut self.board {
            Some(b) => b.check().map_err(|e| io_err(b.path())(e)),
            None => Ok(()),
        }
    }

    fn text(&mut self, tag: &str, step: u64, text: String) {
        let tag = tag.to_owned();
        if let Some(b) = &mut self.board {
            b.write(&[Entry::Text { tag, step, text }]);
        }
    }
}

impl Observer for Tee<'_> {
    fn start(&mut self, info: &RunInfo) {
        self.inner.start(info);
    }
    fn step(&mut self, report: &StepReport) {
        if let Some(b) = &mut self.board {
            b.write(&tensorboard::record_entries(&report.record));
        }
        self.inner.step(report);
    }
    fn eval(&mut self, report: &EvalReport) {
        if let Some(b) = &mut self.board {
            b.write(&[Entry::Scalar {
                tag: "eval/val_loss".into(),
                step: report.step,
                value: report.loss,
            }]);
        }
        self.inner.eval(report);
    }
    fn event(&mut self, event: &HealthEvent) {
        match event {
            HealthEvent::Step(e) => {
                if let Some(b) = &mut self.board {
                    b.write(&tensorboard::event_entries(e));
                }
            }
            HealthEvent::Run(kind) => {
                let tag = match kind {
                    EventKind::Checkpoint { .. } => "checkpoints",
                    _ => "health",
                };
                let line = serde_json::to_string(kind).unwrap_or_default();
                self.text(tag, kind.step().unwrap_or(0), format!("`{line}`"));
            }
        }
        self.inner.event(event);
    }
    fn resumed(&mut self, step: u64, skipped: &[String]) {
        self.inner.resumed(step, skipped);
    }
    fn finish(&mut self, summary: &Summary) {
        if let (Some(b), Some(p)) = (&mut self.board, &summary.pipeline_bubble) {
            b.write(&[Entry::Scalar {
                tag: "pipeline/bubble".into(),
                step: summary.steps,
                value: p.measured,
            }]);
        }
        self.inner.finish(summary);
    }
}
