//! The run folder and what the loop writes there: its name and creation,
//! `metrics.jsonl` (kept up to a resumed checkpoint, then appended to:
//! one [`MetricsRecord`] per step, [`MetricsEvent`]s for evaluations and
//! health), and `summary.json`.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use weft_collectives::Communicator;
use weft_model::StepOutcome;
use weft_supervise::lock::RunLock;
use weft_trace::{BatchPosition, MetricsEvent, MetricsEventKind, MetricsRecord, Summary, input};

use crate::config::Config;
use crate::ranks::agree;
use crate::train::{
    EvalReport, HealthEvent, Observer, RunInfo, StepReport, TrainError, timestamp_name,
};

/// An I/O error of `path` as the run's error.
pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The run folder `<run.dir>/<run.name>` (rank 0 picks a timestamp when
/// `run.name` is empty, for every rank), locked by rank 0 for the run
/// (the lock is returned: one writer per run folder): resuming, it must
/// exist; else rank 0 creates it (never over an existing one, even when
/// another run creates it at the same moment) with `config.toml`.
/// Collective over `world`.
///
/// # Errors
/// [`TrainError::NothingToResume`], [`TrainError::RunExists`],
/// [`TrainError::RunInUse`], or the failed write.
pub(crate) fn open_run_dir(
    config: &Config,
    world: &dyn Communicator,
    resume: bool,
) -> Result<(PathBuf, Option<RunLock>), TrainError> {
    let writer = world.rank() == 0;
    let name = if config.run.name.is_empty() {
        let mine = if writer {
            timestamp_name()
        } else {
            String::new()
        };
        let all = crate::ranks::all_gather_bytes(world, crate::ranks::tags::NAME, mine.as_bytes())?;
        String::from_utf8_lossy(&all[0]).into_owned()
    } else {
        config.run.name.clone()
    };
    let run_dir = config.run.dir.join(name);
    let opened = (|| {
        if resume && !run_dir.is_dir() {
            return Err(TrainError::NothingToResume(run_dir.clone()));
        }
        if !writer {
            return Ok(None);
        }
        if !resume {
            if let Some(parent) = run_dir.parent() {
                std::fs::create_dir_all(parent).map_err(io_err(parent))?;
            }
            // create_dir, not create_dir_all: of two runs that start
            // with one name, one creates the folder and the other is told
            std::fs::create_dir(&run_dir).map_err(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => TrainError::RunExists(run_dir.clone()),
                _ => io_err(&run_dir)(e),
            })?;
        }
        let lock = RunLock::acquire(&run_dir)?;
        if !resume {
            let config_path = run_dir.join("config.toml");
            std::fs::write(&config_path, config.to_toml()).map_err(io_err(&config_path))?;
        }
        Ok(Some(lock))
    })();
    let lock = agree(world, opened)?;
    Ok((run_dir, lock))
}

/// One line of `metrics.jsonl`, read back.
enum Line {
    Step(MetricsRecord),
    Event(MetricsEvent),
}

fn parse(line: &str) -> Option<Line> {
    if let Ok(e) = serde_json::from_str::<MetricsEvent>(line) {
        return Some(Line::Event(e));
    }
    serde_json::from_str(line).ok().map(Line::Step)
}

impl Line {
    fn step(&self) -> u64 {
        match self {
            Line::Step(r) => r.step,
            Line::Event(e) => e.step,
        }
    }
}

/// The lines of a resumed run's `metrics.jsonl` up to its checkpoint
/// (none for a new run).
#[derive(Debug, Default)]
pub(crate) struct Kept {
    lines: Vec<String>,
}

impl Kept {
    /// The lines of `run_dir/metrics.jsonl` of steps up to `step`, on
    /// every rank. Collective over `world`.
    ///
    /// # Errors
    /// The file cannot be read.
    pub(crate) fn read(
        world: &dyn Communicator,
        run_dir: &Path,
        step: u64,
    ) -> Result<Self, TrainError> {
        let path = run_dir.join("metrics.jsonl");
        let text = input::read_to_string(&path, input::LOG_BYTES).map_err(io_err(&path));
        let text = agree(world, text)?;
        let lines = text
            .lines()
            .filter(|l| parse(l).is_some_and(|p| p.step() <= step))
            .map(str::to_owned)
            .collect();
        Ok(Self { lines })
    }

    /// The validation loss before training, as the run logged it (NaN
    /// when it did not).
    pub(crate) fn initial_eval(&self) -> f64 {
        self.lines
            .iter()
            .find_map(|l| match parse(l) {
                Some(Line::Event(MetricsEvent {
                    step: 0,
                    kind: MetricsEventKind::Eval { val_loss, .. },
                })) => Some(val_loss),
                _ => None,
            })
            .unwrap_or(f64::NAN)
    }

    /// The training losses logged, in order (the spike detector keeps
    /// its window's worth of the finite ones).
    pub(crate) fn losses(&self) -> Vec<f64> {
        self.lines
            .iter()
            .filter_map(|l| match parse(l) {
                Some(Line::Step(r)) => Some(r.loss),
                _ => None,
            })
            .collect()
    }
}

/// The run's `metrics.jsonl`, written by world rank 0 only (the other
/// ranks' lines go nowhere), and what the summary reports of it.
pub(crate) struct Metrics {
    out: BufWriter<Box<dyn Write>>,
    path: PathBuf,
    floor: Option<f64>,
    /// Tokens/s and model FLOP/s summed over the steps logged.
    sums: (f64, f64),
    /// Steps logged, and those whose update was skipped.
    steps: u64,
    skipped: u64,
    /// The last step's loss; the first and the last validation loss.
    last_loss: f64,
    evals: (f64, f64),
    /// The last step's MaxVio (mixture of experts).
    last_max_vio: Option<f64>,
}

impl Metrics {
    /// Rewrites `run_dir/metrics.jsonl` with the `kept` lines (atomically)
    /// and opens it for appending, on world rank 0; `floor` is the data's
    /// loss floor, logged with every evaluation. Collective over `world`.
    ///
    /// # Errors
    /// A failed write.
    pub(crate) fn open(
        world: &dyn Communicator,
        run_dir: &Path,
        kept: &Kept,
        floor: Option<f64>,
    ) -> Result<Self, TrainError> {
        let path = run_dir.join("metrics.jsonl");
        let opened = (|| -> Result<BufWriter<Box<dyn Write>>, TrainError> {
            if world.rank() != 0 {
                return Ok(BufWriter::new(Box::new(std::io::sink())));
            }
            let tmp = run_dir.join("metrics.jsonl.tmp");
            let text: String = kept.lines.iter().map(|l| format!("{l}\n")).collect();
            std::fs::write(&tmp, text).map_err(io_err(&tmp))?;
            std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
            let file = std::fs::OpenOptions::new().append(true).open(&path);
            Ok(BufWriter::new(Box::new(file.map_err(io_err(&path))?)))
        })();
        let initial = kept.initial_eval();
        Ok(Self {
            out: agree(world, opened)?,
            path,
            floor,
            sums: (0.0, 0.0),
            steps: 0,
            skipped: 0,
            last_loss: f64::NAN,
            evals: (initial, initial),
            last_max_vio: None,
        })
    }

    /// Appends one line.
    fn line(&mut self, value: &impl serde::Serialize) -> Result<(), TrainError> {
        let text = serde_json::to_string(value).map_err(std::io::Error::other);
        let written = text.and_then(|t| writeln!(self.out, "{t}"));
        written.map_err(io_err(&self.path))
    }

    /// Reports and logs the validation loss after `step` steps.
    ///
    /// # Errors
    /// A failed write.
    pub(crate) fn eval(
        &mut self,
        observer: &mut dyn Observer,
        step: u64,
        loss: f64,
    ) -> Result<(), TrainError> {
        let floor = self.floor;
        if step == 0 {
            self.evals.0 = loss;
        }
        self.evals.1 = loss;
        observer.eval(&EvalReport { step, loss, floor });
        self.line(&MetricsEvent {
            step,
            kind: MetricsEventKind::Eval {
                val_loss: loss,
                floor,
            },
        })
    }

    /// Reports a health event of step `step` and logs its line.
    ///
    /// # Errors
    /// A failed write.
    pub(crate) fn health(
        &mut self,
        observer: &mut dyn Observer,
        step: u64,
        kind: MetricsEventKind,
    ) -> Result<(), TrainError> {
        let event = MetricsEvent { step, kind };
        self.line(&event)?;
        observer.event(&HealthEvent::Step(event));
        Ok(())
    }

    /// Logs step `step` (1-based) at learning rate `lr` with its outcome
    /// `out` and fp16 loss scale, its throughput taken from `times` (the
    /// step's, and the run's so far) and `info`'s tokens per step and
    /// FLOPs per token; returns the observer's report of it.
    ///
    /// # Errors
    /// A failed write.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn step(
        &mut self,
        info: &RunInfo,
        step: u64,
        lr: f64,
        out: &StepOutcome,
        loss_scale: Option<f32>,
        (took, since_start): (Duration, Duration),
        max_vio: Option<f64>,
    ) -> Result<StepReport, TrainError> {
        #[allow(clippy::cast_precision_loss)]
        let tps = info.tokens_per_step as f64 / took.as_secs_f64();
        let flops = tps * info.flops_per_token;
        self.sums.0 += tps;
        self.sums.1 += flops;
        self.steps += 1;
        self.skipped += u64::from(!out.applied);
        self.last_loss = out.loss;
        self.last_max_vio = max_vio;
        let record = MetricsRecord {
            step,
            loss: out.loss,
            lr,
            grad_norm: out.grad_norm,
            tokens_per_s: tps,
            time_s: since_start.as_secs_f64(),
            loss_scale: loss_scale.map(f64::from),
            mfu: Some(flops / info.peak_flops).filter(|u| u.is_finite()),
            max_vio,
            rss_bytes: rss_bytes(),
        };
        self.line(&record)?;
        // a step's line is in the file once the step is over
        self.flush()?;
        Ok(StepReport {
            record,
            flops_per_s: flops,
            utilisation: flops / info.peak_flops,
            applied: out.applied,
            max_vio,
        })
    }

    /// The run's summary after `wall` of it, from `info` and the steps and
    /// evaluations logged (the figures only some runs have — pipeline,
    /// traffic, experts, operand copies — are the caller's to add).
    pub(crate) fn summary(&self, info: &RunInfo, wall: Duration) -> Summary {
        #[allow(clippy::cast_precision_loss)]
        let n = self.steps.max(1) as f64;
        let (tokens_per_s, flops_per_s) = (self.sums.0 / n, self.sums.1 / n);
        Summary {
            run_dir: info.run_dir.clone(),
            steps: info.steps,
            skipped_steps: self.skipped,
            final_train_loss: self.last_loss,
            final_eval_loss: self.evals.1,
            initial_eval_loss: self.evals.0,
            floor: self.floor,
            tokens_per_s,
            flops_per_s,
            utilisation: flops_per_s / info.peak_flops,
            wall_s: wall.as_secs_f64(),
            final_max_vio: None,
            pipeline_bubble: None,
            traffic_per_step: None,
            operand_copy_bytes: 0,
            memory: info.memory.into(),
        }
    }

    /// The last step's MaxVio (mixture-of-experts runs).
    pub(crate) fn last_max_vio(&self) -> Option<f64> {
        self.last_max_vio
    }

    /// Writes what is buffered.
    ///
    /// # Errors
    /// A failed write.
    pub(crate) fn flush(&mut self) -> Result<(), TrainError> {
        self.out.flush().map_err(io_err(&self.path))
    }
}

/// This process's resident memory in bytes (Linux: `/proc/self/statm`).
fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf reads a constant of the system.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

/// A step whose update was skipped as non-finite.
pub(crate) fn skip_event(loss: f64, grad_norm: f64) -> MetricsEventKind {
    MetricsEventKind::Skip { loss, grad_norm }
}

/// A loss spike against the rolling `median`, the step having read batch
/// `batch` (the 0-based step in a run without skips) of `micro_batches`.
pub(crate) fn spike_event(
    loss: f64,
    median: f64,
    batch: u64,
    micro_batches: usize,
) -> MetricsEventKind {
    MetricsEventKind::Spike {
        loss,
        median,
        batch: BatchPosition {
            step: batch,
            micro_batches,
        },
    }
}

/// Writes `summary.json` (world rank 0: `writer`) and reports the end.
///
/// # Errors
/// A failed write.
pub(crate) fn finish(
    writer: bool,
    summary: &Summary,
    observer: &mut dyn Observer,
) -> Result<(), TrainError> {
    if writer {
        let path = summary.run_dir.join("summary.json");
        let json = serde_json::to_string_pretty(summary).map_err(std::io::Error::other);
        json.and_then(|j| std::fs::write(&path, j + "\n"))
            .map_err(io_err(&path))?;
    }
    observer.finish(summary);
    Ok(())
}
