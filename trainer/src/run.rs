//! The run folder and what every training loop writes there: its name and
//! creation, `metrics.jsonl` (kept up to a resumed checkpoint, then
//! appended to), the health events, the loss-spike detector and
//! `summary.json` — shared by the loop over ranks ([`crate::train`]) and
//! the GPU loop (`crate::gpu`, feature `cuda`), so both write the same
//! files the same way.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use weft_collectives::Communicator;
use weft_kernels::AdamW;
use weft_model::{MicroBatch, StepOutcome};
use weft_trace::MetricsRecord;

use crate::config::{Config, OptimConfig};
use crate::ranks::agree;
use crate::train::{
    EvalReport, HealthEvent, Observer, RunInfo, StepReport, Summary, TrainError, io_err,
    timestamp_name,
};
use weft_data::{Batch, Dataset};

/// The run folder `<run.dir>/<run.name>` (rank 0 picks a timestamp when
/// `run.name` is empty, for every rank): resuming, it must exist; else
/// rank 0 creates it (never over an existing one) with `config.toml`.
/// Collective over `world`.
///
/// # Errors
/// [`TrainError::NothingToResume`], [`TrainError::RunExists`], or the
/// failed write.
pub(crate) fn open_run_dir(
    config: &Config,
    world: &dyn Communicator,
    resume: bool,
) -> Result<PathBuf, TrainError> {
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
    if resume {
        let found = if run_dir.is_dir() {
            Ok(())
        } else {
            Err(TrainError::NothingToResume(run_dir.clone()))
        };
        agree(world, found)?;
    } else {
        let created = (|| {
            if !writer {
                return Ok(());
            }
            if run_dir.exists() {
                return Err(TrainError::RunExists(run_dir.clone()));
            }
            std::fs::create_dir_all(&run_dir).map_err(io_err(&run_dir))?;
            let config_path = run_dir.join("config.toml");
            std::fs::write(&config_path, config.to_toml()).map_err(io_err(&config_path))
        })();
        agree(world, created)?;
    }
    Ok(run_dir)
}

/// The step a resumed run continues from, `restored`'s, reported to
/// `observer`.
///
/// # Errors
/// [`TrainError::AlreadyFinished`] when the checkpoint is at
/// `train.steps` already (the run's files stay as they are).
pub(crate) fn resume_step(
    config: &Config,
    run_dir: &Path,
    restored: &crate::ckpt::Restored,
    observer: &mut dyn Observer,
) -> Result<u64, TrainError> {
    if restored.step >= config.train.steps {
        return Err(TrainError::AlreadyFinished {
            run: run_dir.to_owned(),
            step: restored.step,
        });
    }
    observer.resumed(restored.step, &restored.skipped);
    Ok(restored.step)
}

/// The micro-batches `micros` (of `micro` sequences) of batch `batch`
/// (0-based, the step that reads it in a run without skips); a `spike`
/// fault garbles their targets, and the writer (`run_dir`: world rank 0)
/// records that it fired.
///
/// # Errors
/// The data's.
pub(crate) fn read_batches(
    data: &Dataset,
    batch: u64,
    micros: std::ops::Range<usize>,
    micro: usize,
    run_dir: Option<&Path>,
) -> Result<Vec<Batch>, TrainError> {
    let mut batches: Vec<Batch> = micros
        .map(|m| data.train_batch(batch, m, micro))
        .collect::<Result<_, _>>()?;
    if let Some(f) = crate::supervise::spike_at(batch + 1) {
        if let Some(dir) = run_dir {
            crate::supervise::fired(dir, &f, 0);
        }
        for b in &mut batches {
            crate::supervise::scramble(&mut b.targets, data.vocab_size(), batch);
        }
    }
    Ok(batches)
}

/// The batches' token and target ids as the model's micro-batches.
pub(crate) fn micro_batches(batches: &[Batch]) -> Vec<MicroBatch<'_>> {
    batches
        .iter()
        .map(|b| MicroBatch {
            tokens: &b.inputs,
            targets: &b.targets,
        })
        .collect()
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
        let text = agree(world, std::fs::read_to_string(&path).map_err(io_err(&path)))?;
        let lines = text
            .lines()
            .filter(|l| {
                parse(l)
                    .and_then(|v| v["step"].as_u64())
                    .is_some_and(|s| s <= step)
            })
            .map(str::to_owned)
            .collect();
        Ok(Self { lines })
    }

    /// The validation loss before training, as the run logged it (NaN
    /// when it did not).
    pub(crate) fn initial_eval(&self) -> f64 {
        self.lines
            .iter()
            .filter_map(|l| parse(l))
            .find(|v| v["event"] == "eval" && v["step"] == 0)
            .and_then(|v| v["val_loss"].as_f64())
            .unwrap_or(f64::NAN)
    }

    /// The last `window` finite training losses logged (the spike
    /// detector's window).
    fn recent_losses(&self, window: usize) -> Vec<f64> {
        let mut recent: Vec<f64> = self
            .lines
            .iter()
            .filter_map(|l| parse(l))
            .filter(|v| v.get("event").is_none())
            .filter_map(|v| v["loss"].as_f64())
            .filter(|l| l.is_finite())
            .collect();
        let excess = recent.len().saturating_sub(window);
        recent.drain(..excess);
        recent
    }
}

fn parse(line: &str) -> Option<serde_json::Value> {
    serde_json::from_str(line).ok()
}

/// The run's `metrics.jsonl`: one [`MetricsRecord`] per step, plus event
/// lines for health events and evaluations; written by world rank 0 only
/// (the other ranks' lines go nowhere). Also keeps what the summary
/// reports of them.
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
        })
    }

    /// Appends `line`.
    ///
    /// # Errors
    /// A failed write.
    pub(crate) fn line(&mut self, line: impl std::fmt::Display) -> Result<(), TrainError> {
        writeln!(self.out, "{line}").map_err(io_err(&self.path))
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
        self.line(
            serde_json::json!({ "step": step, "event": "eval", "val_loss": loss, "floor": floor }),
        )
    }

    /// Reports a health event and logs its line.
    ///
    /// # Errors
    /// A failed write.
    pub(crate) fn health(
        &mut self,
        observer: &mut dyn Observer,
        (event, line): (HealthEvent, serde_json::Value),
    ) -> Result<(), TrainError> {
        observer.event(&event);
        self.line(line)
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
        let record = MetricsRecord {
            step,
            loss: out.loss,
            lr,
            grad_norm: out.grad_norm,
            tokens_per_s: tps,
            time_s: since_start.as_secs_f64(),
            loss_scale: loss_scale.map(f64::from),
        };
        self.line(serde_json::to_string(&record).unwrap_or_default())?;
        Ok(StepReport {
            record,
            flops_per_s: flops,
            utilisation: flops / info.peak_flops,
            applied: out.applied,
            max_vio,
        })
    }

    /// The run's summary after `wall` of it: the figures of `info` and
    /// of the steps and evaluations logged; a single device's (no
    /// pipeline, traffic, expert-load or operand-copy figures, which the
    /// loop over ranks adds).
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
            memory: info.memory,
        }
    }

    /// Writes what is buffered.
    ///
    /// # Errors
    /// A failed write.
    pub(crate) fn flush(&mut self) -> Result<(), TrainError> {
        self.out.flush().map_err(io_err(&self.path))
    }
}

/// A step whose update was skipped as non-finite: its event and line.
pub(crate) fn skip_event(step: u64, loss: f64, grad_norm: f64) -> (HealthEvent, serde_json::Value) {
    (
        HealthEvent::Skipped {
            step,
            loss,
            grad_norm,
        },
        serde_json::json!({ "step": step, "event": "skip", "loss": loss, "grad_norm": grad_norm }),
    )
}

/// A loss spike at `step` against the rolling `median`, the step having
/// read `batch` (the step in a run without skips, micro-batches): its
/// event and line.
pub(crate) fn spike_event(
    step: u64,
    loss: f64,
    median: f64,
    batch: (u64, usize),
) -> (HealthEvent, serde_json::Value) {
    (
        HealthEvent::Spike {
            step,
            loss,
            median,
            batch,
        },
        serde_json::json!({ "step": step, "event": "spike", "loss": loss, "median": median,
            "batch": { "step": batch.0, "micro_batches": batch.1 } }),
    )
}

/// The loss-spike detector: a step's loss above `train.spike_factor` ×
/// the median of the last `train.spike_window` finite losses (once ten
/// of them, or the whole window, are in) is a spike.
pub(crate) struct Spikes {
    recent: Vec<f64>,
    window: usize,
    factor: f64,
}

impl Spikes {
    /// The detector of `config`, its window refilled from a resumed run's
    /// `kept` lines.
    pub(crate) fn new(config: &Config, kept: &Kept) -> Self {
        let window = config.train.spike_window.max(1);
        Self {
            recent: kept.recent_losses(window),
            window,
            factor: config.train.spike_factor,
        }
    }

    /// The rolling median when `loss` is a spike; a finite `loss` then
    /// joins the window.
    pub(crate) fn check(&mut self, loss: f64) -> Option<f64> {
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

/// AdamW's hyper-parameters of `[optim]` at learning rate `lr`.
#[allow(clippy::cast_possible_truncation)]
pub(crate) fn adamw(optim: &OptimConfig, lr: f64) -> AdamW {
    AdamW {
        lr: lr as f32,
        beta1: optim.beta1 as f32,
        beta2: optim.beta2 as f32,
        eps: optim.eps as f32,
        weight_decay: optim.weight_decay as f32,
    }
}

/// Training FLOPs per token of a model with parameter layout `layout`
/// ([`RunInfo::flops_per_token`]): 6 per parameter a token is multiplied
/// by — not the position table, and of the routed experts only the k of
/// E a token is sent to — plus `6·L·T·C` for causal attention.
#[allow(clippy::cast_precision_loss)]
pub(crate) fn flops_per_token(config: &Config, layout: &weft_model::ParamLayout) -> f64 {
    let m = &config.model;
    let moe_active = |name: &str| {
        if m.moe.experts > 0 && name.contains(".mlp.experts.") {
            m.moe.top_k as f64 / m.moe.experts as f64
        } else {
            1.0
        }
    };
    let matmul_params: f64 = layout
        .specs()
        .iter()
        .filter(|p| p.name != "transformer.wpe.weight")
        .map(|p| p.numel() as f64 * moe_active(&p.name))
        .sum();
    6.0 * matmul_params + 6.0 * (m.n_layer * m.block_size * m.n_embd) as f64
}

/// Whether step `step` (1-based; `done`: the last) evaluates.
pub(crate) fn eval_due(config: &Config, step: u64, done: bool) -> bool {
    let every = config.train.eval_every;
    done || (every > 0 && step.is_multiple_of(every))
}

/// Whether step `step` (1-based; `done`: the last) saves a checkpoint:
/// every `checkpoint.every` steps and at the end, or on a stop.
pub(crate) fn save_due(config: &Config, step: u64, done: bool, stop: bool) -> bool {
    let every = config.checkpoint.every;
    stop || every > 0 && (done || step.is_multiple_of(every))
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
        let json = serde_json::to_string_pretty(summary).unwrap_or_default();
        std::fs::write(&path, json + "\n").map_err(io_err(&path))?;
    }
    observer.finish(summary);
    Ok(())
}
