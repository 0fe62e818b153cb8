//! `weft compare`: runs side by side, so that each change (a precision, a
//! router, a kernel, a layout) is validated alone against a baseline
//! before it is stacked with others.
//!
//! Each argument is a run folder (`metrics.jsonl`, `config.toml`,
//! `summary.json`, ...) or a *group*: a folder whose sub-folders are runs
//! of the same job with different seeds, as `weft train --seeds N` writes
//! them (`<run.dir>/<run.name>/seed-<S>/`). The first argument is the
//! baseline; every other one is compared with it:
//!
//! * the configuration keys that differ (`run.*` and the keys that vary
//!   within a group, such as `train.seed`, left out);
//! * the training-loss curves (a group's mean over its seeds) aligned by
//!   step — or by tokens when the runs' tokens per step differ — and their
//!   per-step difference: largest and mean `|Δ|`, the first step that
//!   differs, the span of bitwise-equal steps;
//! * final validation loss (each group's mean and spread), its gap to the
//!   data's loss floor where the run knows it, final training loss,
//!   throughput, memory per rank, pipeline bubble, MaxVio, health events;
//! * a verdict on the final validation loss
//!   ([`verdict`]): bitwise identical, equal within
//!   `--tolerance`, better or worse by `X ± Y` (a 95% interval, with two
//!   or more seeds on each side: paired by seed where both sides ran the
//!   same seeds, Welch's otherwise or with [`Options::unpaired`]) or not
//!   distinguishable from the seed noise.
//!
//! Output: a table ([`Report`]'s `Display`), JSON ([`Report::to_json`]) and
//! SVG plots ([`write_plots`]).
//!
//! # Example
//! ```no_run
//! use weft_compare::{Options, Report, load_group};
//!
//! let a = load_group("runs/fp32".as_ref())?;
//! let b = load_group("runs/bf16".as_ref())?;
//! let report = Report::new(&[a, b], &Options::default());
//! println!("{report}");
//! # Ok::<(), weft_compare::CompareError>(())
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};

use weft_trace::{MetricsEventKind, Summary};

use crate::chart::{LineChart, Series};
use crate::load;
use crate::stats::{
    Interval, StepDiff, Verdict, last_per_step, mean_series, pair_by_seed, verdict,
};

/// Why a run folder could not be compared.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CompareError {
    /// The path is neither a run folder nor a folder of runs.
    #[error(
        "{path}: not a run folder (no metrics.jsonl) and no sub-folder of it is one (a group of seeds, as `weft train --seeds N` writes)"
    )]
    NotARun {
        /// The path given.
        path: PathBuf,
    },
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A file of the run is malformed (names the file and, for line
    /// formats, the line).
    #[error("{0}")]
    Malformed(String),
    /// Fewer than two runs, or a bad option.
    #[error("{0}")]
    Usage(String),
}

/// One run folder, read.
#[derive(Clone, Debug)]
pub struct RunData {
    /// The folder.
    pub dir: PathBuf,
    /// `config.toml` flattened to `dotted.key → value` (TOML text of the
    /// value); empty if the run has none.
    pub config: BTreeMap<String, String>,
    /// Sequences × tokens per step (`train.batch_size · model.block_size`),
    /// if the config gives them.
    pub tokens_per_step: Option<u64>,
    /// `train.seed`, if the config gives it.
    pub seed: Option<u64>,
    /// Training loss per step (the last line of a repeated step).
    pub loss: Vec<(u64, f64)>,
    /// Validation loss per evaluation (`eval` events).
    pub val_loss: Vec<(u64, f64)>,
    /// The data's loss floor, where known.
    pub floor: Option<f64>,
    /// Mean tokens per second over the run (the summary's, else the mean
    /// of the step records').
    pub tokens_per_s: Option<f64>,
    /// Wall-clock seconds (summary).
    pub wall_s: Option<f64>,
    /// Bytes of one rank by category (summary; runs written before the
    /// summary held it have none).
    pub memory: Option<weft_trace::MemoryBytes>,
    /// Measured pipeline bubble fraction (summary).
    pub bubble: Option<f64>,
    /// MaxVio of the last step (mixture of experts).
    pub max_vio: Option<f64>,
    /// Health events by kind (`skip`, `spike`, `overflow`, restarts ...;
    /// evaluations are not counted).
    pub events: BTreeMap<String, usize>,
    /// Whether `summary.json` is there (the run finished).
    pub finished: bool,
    /// What was skipped while reading (a torn last line, a missing file).
    pub warnings: Vec<String>,
}

/// A baseline or candidate: one run, or several seeds of one job.
#[derive(Clone, Debug)]
pub struct Group {
    /// The name shown (the folder's name).
    pub name: String,
    /// The path given.
    pub dir: PathBuf,
    /// Its runs (one, or one per seed), in folder-name order.
    pub runs: Vec<RunData>,
}

/// Read a run folder, or a folder of runs (a group of seeds).
///
/// # Errors
/// [`CompareError::NotARun`] when neither; [`CompareError::Malformed`]
/// naming the file and line of a bad record; [`CompareError::Io`].
pub fn load_group(path: &Path) -> Result<Group, CompareError> {
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    if path.join("metrics.jsonl").is_file() {
        return Ok(Group {
            name,
            dir: path.to_owned(),
            runs: vec![load_run(path)?],
        });
    }
    let entries = std::fs::read_dir(path).map_err(|_| CompareError::NotARun {
        path: path.to_owned(),
    })?;
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.join("metrics.jsonl").is_file())
        .collect();
    if dirs.is_empty() {
        return Err(CompareError::NotARun {
            path: path.to_owned(),
        });
    }
    dirs.sort();
    let runs = dirs.iter().map(|d| load_run(d)).collect::<Result<_, _>>()?;
    Ok(Group {
        name,
        dir: path.to_owned(),
        runs,
    })
}

/// A run folder's file (`None` when absent), through the bounded reader
/// every weft tool uses: a link to `/dev/zero` or a FIFO is refused.
fn read(path: &Path) -> Result<Option<String>, CompareError> {
    match weft_trace::input::read_to_string(path, weft_trace::input::LOG_BYTES) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(CompareError::Io {
            path: path.to_owned(),
            source,
        }),
    }
}

fn malformed(dir: &Path, e: &crate::LoadError) -> CompareError {
    CompareError::Malformed(format!("{}: {e}", dir.display()))
}

/// Read one run folder.
///
/// # Errors
/// As [`load_group`].
pub fn load_run(dir: &Path) -> Result<RunData, CompareError> {
    let mut warnings = Vec::new();
    let mut warn = |w: Vec<crate::Warning>| {
        for w in w {
            warnings.push(format!(
                "{}/{}:{}: {}",
                dir.display(),
                w.file,
                w.line,
                w.message
            ));
        }
    };
    let text = read(&dir.join("metrics.jsonl"))?.ok_or_else(|| CompareError::NotARun {
        path: dir.to_owned(),
    })?;
    let (log, w) = load::parse_metrics("metrics.jsonl", &text).map_err(|e| malformed(dir, &e))?;
    warn(w);
    let loss = last_per_step(log.records.iter().map(|r| (r.step, r.loss)));
    let mut events: BTreeMap<String, usize> = BTreeMap::new();
    let mut val = Vec::new();
    let mut floor = None;
    for e in &log.events {
        match &e.kind {
            MetricsEventKind::Eval { val_loss, floor: f } => {
                if val_loss.is_finite() {
                    val.push((e.step, *val_loss));
                }
                floor = floor.or(f.filter(|f| f.is_finite()));
            }
            other => *events.entry(other.name().to_owned()).or_default() += 1,
        }
    }
    if let Some(text) = read(&dir.join("events.jsonl"))? {
        let (evs, w) = load::parse_events("events.jsonl", &text).map_err(|e| malformed(dir, &e))?;
        warn(w);
        // the events with a place on the step axis (not an attempt's
        // start, nor the end), checkpoints aside: a run's routine
        let health = |e: &&weft_trace::RunEvent| {
            e.kind.step().is_some() && !matches!(e.kind, weft_trace::EventKind::Checkpoint { .. })
        };
        for e in evs.iter().filter(health) {
            *events.entry(e.kind.name().to_owned()).or_default() += 1;
        }
    }
    let mut config = BTreeMap::new();
    match read(&dir.join("config.toml"))? {
        Some(text) => {
            let table: toml::Table = toml::from_str(&text).map_err(|e| {
                let line = e.span().map_or(1, |s| {
                    text[..s.start.min(text.len())].matches('\n').count() + 1
                });
                CompareError::Malformed(format!(
                    "{}: config.toml, line {line}: {}",
                    dir.display(),
                    e.message()
                ))
            })?;
            flatten_toml("", &toml::Value::Table(table), &mut config);
        }
        None => warnings.push(format!(
            "{}: no config.toml (no configuration differences, steps not converted to tokens)",
            dir.display()
        )),
    }
    let int = |k: &str| config.get(k).and_then(|v| v.parse::<u64>().ok());
    let tokens_per_step = int("train.batch_size")
        .zip(int("model.block_size"))
        .map(|(b, t)| b * t);
    let seed = int("train.seed");
    let summary: Option<Summary> = match read(&dir.join("summary.json"))? {
        Some(text) => Some(serde_json::from_str(&text).map_err(|e| {
            CompareError::Malformed(format!(
                "{}: summary.json, line {}: {e}",
                dir.display(),
                e.line()
            ))
        })?),
        None => {
            warnings.push(format!(
                "{}: no summary.json (the run has not finished): figures from metrics.jsonl only",
                dir.display()
            ));
            None
        }
    };
    let records = &log.records;
    #[allow(clippy::cast_precision_loss)]
    let mean_tps = (!records.is_empty())
        .then(|| records.iter().map(|r| r.tokens_per_s).sum::<f64>() / records.len() as f64);
    if val.is_empty()
        && let Some(v) = summary
            .as_ref()
            .map(|s| s.final_eval_loss)
            .filter(|v| v.is_finite())
    {
        val.push((loss.last().map_or(0, |l| l.0), v));
    }
    let s = summary.as_ref();
    Ok(RunData {
        dir: dir.to_owned(),
        config,
        tokens_per_step,
        seed,
        loss,
        val_loss: last_per_step(val),
        floor: floor.or_else(|| s.and_then(|s| s.floor)),
        tokens_per_s: s
            .map(|s| s.tokens_per_s)
            .filter(|t| t.is_finite())
            .or(mean_tps),
        wall_s: s.map(|s| s.wall_s),
        memory: s.map(|s| s.memory).filter(|m| m.total() > 0),
        bubble: s
            .and_then(|s| s.pipeline_bubble.as_ref())
            .map(|b| b.measured),
        max_vio: s.and_then(|s| s.final_max_vio),
        events,
        finished: s.is_some(),
        warnings,
    })
}

fn flatten_toml(prefix: &str, v: &toml::Value, out: &mut BTreeMap<String, String>) {
    match v {
        toml::Value::Table(t) => {
            for (k, x) in t {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten_toml(&key, x, out);
            }
        }
        other => {
            let text = match other {
                toml::Value::String(s) => format!("{s:?}"),
                x => x.to_string(),
            };
            out.insert(prefix.to_owned(), text);
        }
    }
}

/// What the comparison decides on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Metric {
    /// The last validation loss of each run (the default).
    #[default]
    ValLoss,
    /// The mean training loss over the last tenth of the steps.
    TrainLoss,
}

impl std::str::FromStr for Metric {
    type Err = CompareError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "val" | "val_loss" => Ok(Self::ValLoss),
            "train" | "train_loss" => Ok(Self::TrainLoss),
            other => Err(CompareError::Usage(format!(
                "--metric {other:?}: expected val_loss or train_loss"
            ))),
        }
    }
}

/// Options of a comparison.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// "Equal within tolerance": the largest per-step and final difference
    /// allowed (none: only bitwise identity counts as equal).
    pub tolerance: Option<f64>,
    /// The figure the verdict is on.
    pub metric: Metric,
    /// Welch's interval even where both groups ran the same seeds
    /// (default: such groups are paired by seed, see
    /// [`crate::stats::Paired`]).
    pub unpaired: bool,
}

impl RunData {
    /// The final figure of `metric`, if the run has it.
    #[must_use]
    pub fn final_value(&self, metric: Metric) -> Option<f64> {
        match metric {
            Metric::ValLoss => self.val_loss.last().map(|v| v.1),
            Metric::TrainLoss => {
                let n = self.loss.len().div_ceil(10).max(1);
                let tail = &self.loss[self.loss.len().saturating_sub(n)..];
                (!tail.is_empty())
                    .then(|| tail.iter().map(|v| v.1).sum::<f64>() / tail.len() as f64)
            }
        }
    }
}

/// Mean and sample standard deviation (0 for one value).
fn spread(x: &[f64]) -> Option<(f64, f64)> {
    if x.is_empty() {
        return None;
    }
    let n = x.len() as f64;
    let m = x.iter().sum::<f64>() / n;
    let sd = if x.len() > 1 {
        (x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (n - 1.0)).sqrt()
    } else {
        0.0
    };
    Some((m, sd))
}

/// One group's figures.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GroupFigures {
    /// Name shown.
    pub name: String,
    /// The path given.
    pub dir: PathBuf,
    /// Runs in the group.
    pub runs: usize,
    /// Their seeds (`train.seed`).
    pub seeds: Vec<u64>,
    /// Steps of the (shortest) run.
    pub steps: u64,
    /// Tokens per step, if every run agrees.
    pub tokens_per_step: Option<u64>,
    /// Each run's final figure of the compared metric.
    pub finals: Vec<f64>,
    /// The seed of each of `finals`' runs, where known.
    #[serde(skip)]
    pub final_seeds: Vec<Option<u64>>,
    /// Their mean.
    pub final_mean: Option<f64>,
    /// Their sample standard deviation (0 for one run).
    pub final_sd: Option<f64>,
    /// Mean final training loss (last step).
    pub final_train_loss: Option<f64>,
    /// The loss floor, if known.
    pub floor: Option<f64>,
    /// `final_mean − floor`.
    pub gap_to_floor: Option<f64>,
    /// Mean tokens per second.
    pub tokens_per_s: Option<f64>,
    /// Mean wall-clock seconds.
    pub wall_s: Option<f64>,
    /// Bytes per rank (first run; all categories together).
    pub memory_bytes: Option<u64>,
    /// Mean measured pipeline bubble.
    pub bubble: Option<f64>,
    /// Mean final MaxVio.
    pub max_vio: Option<f64>,
    /// Health events by kind, summed over the runs.
    pub events: BTreeMap<String, usize>,
}

/// A candidate against the baseline.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Against {
    /// `key → [baseline value, candidate value]` for every key that
    /// differs (`None`: absent).
    pub config: BTreeMap<String, [Option<String>; 2]>,
    /// `step` or `tokens`.
    pub aligned_by: &'static str,
    /// Shared points of the mean training-loss curves.
    pub shared: usize,
    /// Largest `|Δ|` of the training loss (candidate − baseline).
    pub max_abs: f64,
    /// Mean `|Δ|`.
    pub mean_abs: f64,
    /// First step (or token count) that differs.
    pub first_differing: Option<u64>,
    /// Steps, from the first, that are bit for bit equal.
    pub bitwise_span: u64,
    /// Shared evaluations of the mean validation-loss curves (aligned as
    /// the training loss is).
    pub val_shared: usize,
    /// Largest `|Δ|` of the validation loss over them.
    pub val_max_abs: f64,
    /// Difference of the final figure's means (candidate − baseline).
    pub final_diff: Option<f64>,
    /// Half-width of the 95% interval (two or more runs a side).
    pub final_pm: Option<f64>,
    /// The interval's kind: `paired` (by seed) or `welch`.
    pub interval: Option<&'static str>,
    /// Throughput ratio (candidate / baseline).
    pub speed: Option<f64>,
    /// The verdict's kind (`bitwise_identical`, `better`, ...).
    pub verdict: &'static str,
    /// The verdict in words.
    pub verdict_text: String,
    /// The per-step difference, `(step or tokens, candidate − baseline)`.
    #[serde(skip)]
    pub points: Vec<(u64, f64)>,
}

/// A whole comparison: the baseline first.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Report {
    /// What was compared (`val_loss` or `train_loss`).
    pub metric: &'static str,
    /// The tolerance asked for.
    pub tolerance: Option<f64>,
    /// Every group's figures, the baseline first.
    pub groups: Vec<GroupFigures>,
    /// Every candidate against the baseline (`groups[1..]`).
    pub against: Vec<Against>,
    /// What was skipped while reading.
    pub warnings: Vec<String>,
    /// Mean training-loss curves, `(step, loss)`, one per group.
    #[serde(skip)]
    pub curves: Vec<Vec<(u64, f64)>>,
    /// Mean validation curves, one per group.
    #[serde(skip)]
    pub val_curves: Vec<Vec<(u64, f64)>>,
}

fn mean_of(x: impl Iterator<Item = f64>) -> Option<f64> {
    let v: Vec<f64> = x.collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

fn figures(g: &Group, metric: Metric) -> GroupFigures {
    let (final_seeds, finals): (Vec<Option<u64>>, Vec<f64>) = g
        .runs
        .iter()
        .filter_map(|r| r.final_value(metric).map(|v| (r.seed, v)))
        .unzip();
    let (final_mean, final_sd) = spread(&finals).unzip();
    let floor = g.runs.iter().find_map(|r| r.floor);
    let tps: BTreeSet<Option<u64>> = g.runs.iter().map(|r| r.tokens_per_step).collect();
    let mut events = BTreeMap::new();
    for r in &g.runs {
        for (k, n) in &r.events {
            *events.entry(k.clone()).or_default() += n;
        }
    }
    GroupFigures {
        name: g.name.clone(),
        dir: g.dir.clone(),
        runs: g.runs.len(),
        seeds: g.runs.iter().filter_map(|r| r.seed).collect(),
        steps: g
            .runs
            .iter()
            .map(|r| r.loss.last().map_or(0, |l| l.0))
            .min()
            .unwrap_or(0),
        tokens_per_step: if tps.len() == 1 {
            tps.into_iter().next().flatten()
        } else {
            None
        },
        final_mean,
        final_sd,
        final_train_loss: mean_of(g.runs.iter().filter_map(|r| r.loss.last().map(|l| l.1))),
        floor,
        gap_to_floor: final_mean.zip(floor).map(|(m, f)| m - f),
        tokens_per_s: mean_of(g.runs.iter().filter_map(|r| r.tokens_per_s)),
        wall_s: mean_of(g.runs.iter().filter_map(|r| r.wall_s)),
        memory_bytes: g.runs[0].memory.map(|m| m.total()),
        bubble: mean_of(g.runs.iter().filter_map(|r| r.bubble)),
        max_vio: mean_of(g.runs.iter().filter_map(|r| r.max_vio)),
        events,
        finals,
        final_seeds,
    }
}

/// Configuration keys that vary within a group (seeds) or never matter.
fn ignored_keys(g: &Group) -> BTreeSet<String> {
    let mut keys: BTreeSet<String> = BTreeSet::new();
    for r in &g.runs[1..] {
        for (k, v) in &r.config {
            if g.runs[0].config.get(k) != Some(v) {
                keys.insert(k.clone());
            }
        }
    }
    keys
}

fn config_diff(a: &Group, b: &Group) -> BTreeMap<String, [Option<String>; 2]> {
    let mut skip = ignored_keys(a);
    skip.extend(ignored_keys(b));
    let (ca, cb) = (&a.runs[0].config, &b.runs[0].config);
    ca.keys()
        .chain(cb.keys())
        .filter(|k| !k.starts_with("run.") && !skip.contains(*k))
        .filter(|k| ca.get(*k) != cb.get(*k))
        .map(|k| (k.clone(), [ca.get(k).cloned(), cb.get(k).cloned()]))
        .collect()
}

/// A group's mean training-loss (or validation-loss) curve, by step or by
/// tokens.
fn curve(g: &Group, by_tokens: bool, val: bool) -> Vec<(u64, f64)> {
    let series: Vec<Vec<(u64, f64)>> = g
        .runs
        .iter()
        .map(|r| {
            let k = if by_tokens {
                r.tokens_per_step.unwrap_or(1)
            } else {
                1
            };
            let points = if val { &r.val_loss } else { &r.loss };
            points.iter().map(|&(s, v)| (s * k, v)).collect()
        })
        .collect();
    mean_series(&series)
}

impl Report {
    /// Compare `groups[1..]` with `groups[0]`. Give it at least one group.
    #[must_use]
    pub fn new(groups: &[Group], opts: &Options) -> Self {
        let figs: Vec<GroupFigures> = groups.iter().map(|g| figures(g, opts.metric)).collect();
        let mut against = Vec::new();
        let curves: Vec<Vec<(u64, f64)>> = groups.iter().map(|g| curve(g, false, false)).collect();
        let val_curves: Vec<Vec<(u64, f64)>> =
            groups.iter().map(|g| curve(g, false, true)).collect();
        if let Some((base, rest)) = groups.split_first() {
            for (g, f) in rest.iter().zip(&figs[1..]) {
                // steps hold different amounts of data: align by tokens
                let by_tokens = figs[0].tokens_per_step.is_some()
                    && f.tokens_per_step.is_some()
                    && figs[0].tokens_per_step != f.tokens_per_step;
                let d =
                    StepDiff::between(&curve(base, by_tokens, false), &curve(g, by_tokens, false));
                let dv =
                    StepDiff::between(&curve(base, by_tokens, true), &curve(g, by_tokens, true));
                let seeded = |g: &GroupFigures| -> Vec<(Option<u64>, f64)> {
                    g.final_seeds
                        .iter()
                        .copied()
                        .zip(g.finals.iter().copied())
                        .collect()
                };
                let pairs = (!opts.unpaired)
                    .then(|| pair_by_seed(&seeded(&figs[0]), &seeded(f)))
                    .flatten();
                let (a, b) = (&figs[0].finals, &f.finals);
                let v: Verdict = verdict(&d, a, b, pairs.as_deref(), opts.tolerance);
                let interval = Interval::of(a, b, pairs.as_deref());
                against.push(Against {
                    config: config_diff(base, g),
                    aligned_by: if by_tokens { "tokens" } else { "step" },
                    shared: d.points.len(),
                    max_abs: d.max_abs,
                    mean_abs: d.mean_abs,
                    first_differing: d.first_differing,
                    bitwise_span: d.bitwise_span,
                    val_shared: dv.points.len(),
                    val_max_abs: dv.max_abs,
                    final_diff: f.final_mean.zip(figs[0].final_mean).map(|(b, a)| b - a),
                    final_pm: interval.map(|i| i.half_width()),
                    interval: interval.map(|i| i.kind()),
                    speed: f.tokens_per_s.zip(figs[0].tokens_per_s).map(|(b, a)| b / a),
                    verdict: v.kind(),
                    verdict_text: v.to_string(),
                    points: d.points,
                });
            }
        }
        Self {
            metric: match opts.metric {
                Metric::ValLoss => "val_loss",
                Metric::TrainLoss => "train_loss",
            },
            tolerance: opts.tolerance,
            groups: figs,
            against,
            warnings: groups
                .iter()
                .flat_map(|g| g.runs.iter().flat_map(|r| r.warnings.clone()))
                .collect(),
            curves,
            val_curves,
        }
    }

    /// The report as pretty JSON.
    #[must_use]
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

fn opt(x: Option<f64>, f: impl Fn(f64) -> String) -> String {
    x.map_or_else(|| "-".to_owned(), f)
}

fn mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let letter = |i: usize| char::from_u32(u32::from(b'A') + i as u32 % 26).unwrap_or('?');
        let mut rows: Vec<(String, Vec<String>)> = Vec::new();
        let mut row = |name: &str, cells: Vec<String>| rows.push((name.to_owned(), cells));
        let g = &self.groups;
        row(
            "run",
            g.iter()
                .enumerate()
                .map(|(i, x)| format!("{}: {}", letter(i), x.name))
                .collect(),
        );
        row(
            "runs (seeds)",
            g.iter()
                .map(|x| {
                    let seeds: Vec<String> = x.seeds.iter().map(u64::to_string).collect();
                    format!("{} ({})", x.runs, seeds.join(", "))
                })
                .collect(),
        );
        row("steps", g.iter().map(|x| x.steps.to_string()).collect());
        row(
            "tokens/step",
            g.iter()
                .map(|x| x.tokens_per_step.map_or("-".into(), |t| t.to_string()))
                .collect(),
        );
        let what = if self.metric == "val_loss" {
            "final val loss"
        } else {
            "final train loss (last 10%)"
        };
        row(
            what,
            g.iter()
                .map(|x| match (x.final_mean, x.final_sd) {
                    (Some(m), Some(sd)) if x.finals.len() > 1 => format!("{m:.4} (sd {sd:.4})"),
                    (Some(m), _) => format!("{m:.4}"),
                    _ => "-".into(),
                })
                .collect(),
        );
        row(
            "gap to floor",
            g.iter()
                .map(|x| opt(x.gap_to_floor, |v| format!("{v:.4}")))
                .collect(),
        );
        row(
            "last train loss",
            g.iter()
                .map(|x| opt(x.final_train_loss, |v| format!("{v:.4}")))
                .collect(),
        );
        row(
            "tokens/s",
            g.iter()
                .enumerate()
                .map(|(i, x)| {
                    let base = opt(x.tokens_per_s, |v| format!("{v:.0}"));
                    match (i, self.against.get(i.wrapping_sub(1)).and_then(|a| a.speed)) {
                        (1.., Some(s)) => format!("{base} ({s:.2}×)"),
                        _ => base,
                    }
                })
                .collect(),
        );
        row(
            "wall s",
            g.iter()
                .map(|x| opt(x.wall_s, |v| format!("{v:.1}")))
                .collect(),
        );
        row(
            "memory/rank",
            g.iter()
                .map(|x| x.memory_bytes.map_or("-".into(), mb))
                .collect(),
        );
        row(
            "pipeline bubble",
            g.iter()
                .map(|x| opt(x.bubble, |v| format!("{:.1}%", 100.0 * v)))
                .collect(),
        );
        row(
            "MaxVio (final)",
            g.iter()
                .map(|x| opt(x.max_vio, |v| format!("{v:.3}")))
                .collect(),
        );
        row(
            "health events",
            g.iter()
                .map(|x| {
                    if x.events.is_empty() {
                        "none".into()
                    } else {
                        x.events
                            .iter()
                            .map(|(k, n)| format!("{k} ×{n}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    }
                })
                .collect(),
        );
        let cand = |h: &dyn Fn(&Against) -> String| -> Vec<String> {
            std::iter::once("-".to_owned())
                .chain(self.against.iter().map(h))
                .collect()
        };
        row(
            "loss Δ: aligned by",
            cand(&|a| format!("{} ({} shared)", a.aligned_by, a.shared)),
        );
        row("  max |Δ|", cand(&|a| format!("{:.3e}", a.max_abs)));
        row("  mean |Δ|", cand(&|a| format!("{:.3e}", a.mean_abs)));
        row(
            "  first differing",
            cand(&|a| {
                a.first_differing
                    .map_or("none".into(), |s| format!("{} {s}", a.aligned_by))
            }),
        );
        row(
            "  bitwise-equal span",
            cand(&|a| format!("{}", a.bitwise_span)),
        );
        row(
            "val loss Δ: max |Δ|",
            cand(&|a| format!("{:.3e} ({} evals)", a.val_max_abs, a.val_shared)),
        );
        row(
            "final Δ",
            cand(&|a| match (a.final_diff, a.final_pm.zip(a.interval)) {
                (Some(d), Some((pm, kind))) => format!("{d:+.4} ± {pm:.4} ({kind})"),
                (Some(d), None) => format!("{d:+.4}"),
                _ => "-".into(),
            }),
        );
        let width = rows.iter().map(|r| r.0.chars().count()).max().unwrap_or(0);
        let cols: Vec<usize> = (0..g.len())
            .map(|c| {
                rows.iter()
                    .map(|r| r.1.get(c).map_or(0, |s| s.chars().count()))
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        for (name, cells) in &rows {
            let mut line = format!("{name:<width$}");
            for (c, cell) in cells.iter().enumerate() {
                let _ = write!(line, "  {cell:<w$}", w = cols[c]);
            }
            writeln!(f, "{}", line.trim_end())?;
        }
        for (i, a) in self.against.iter().enumerate() {
            writeln!(f)?;
            writeln!(f, "{} vs {}: {}", letter(i + 1), letter(0), a.verdict_text)?;
            if a.config.is_empty() {
                writeln!(f, "  config: no difference")?;
            }
            for (k, [x, y]) in &a.config {
                writeln!(
                    f,
                    "  config: {k} = {} (A: {})",
                    y.as_deref().unwrap_or("(absent)"),
                    x.as_deref().unwrap_or("(absent)")
                )?;
            }
        }
        for w in &self.warnings {
            writeln!(f, "note: {w}")?;
        }
        Ok(())
    }
}

/// Write `loss.svg` (each group's mean training-loss curve),
/// `loss_diff.svg` (each candidate's per-step difference from the
/// baseline) and, when runs evaluated, `val_loss.svg` into `dir`; returns
/// the files written.
///
/// # Errors
/// [`CompareError::Io`] when the folder or a file cannot be written.
pub fn write_plots(report: &Report, dir: &Path) -> Result<Vec<PathBuf>, CompareError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| CompareError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let names: Vec<String> = report.groups.iter().map(|g| g.name.clone()).collect();
    let mut written = Vec::new();
    let mut plot =
        |file: &str, title: &str, x: &str, y: &str, series: Vec<(String, Vec<(u64, f64)>)>| {
            let path = dir.join(file);
            let series: Vec<Series> = series
                .into_iter()
                .map(|(name, pts)| {
                    #[allow(clippy::cast_precision_loss)]
                    let pts = pts.into_iter().map(|(x, y)| (x as f64, y)).collect();
                    Series::new(name, pts)
                })
                .collect();
            let svg = LineChart::new(title, x, y).svg(&series);
            std::fs::write(&path, svg).map_err(io(&path))?;
            written.push(path);
            Ok::<(), CompareError>(())
        };
    plot(
        "loss.svg",
        "training loss (mean over seeds)",
        "step",
        "loss",
        names
            .iter()
            .cloned()
            .zip(report.curves.iter().cloned())
            .collect(),
    )?;
    let diffs = report
        .against
        .iter()
        .zip(&names[1..])
        .map(|(a, n)| (format!("{n} − {}", names[0]), a.points.clone()))
        .collect();
    let by = report.against.first().map_or("step", |a| a.aligned_by);
    plot(
        "loss_diff.svg",
        "training loss difference from the baseline",
        by,
        "Δ loss",
        diffs,
    )?;
    if report.val_curves.iter().any(|c| !c.is_empty()) {
        plot(
            "val_loss.svg",
            "validation loss (mean over seeds)",
            "step",
            "loss",
            names
                .into_iter()
                .zip(report.val_curves.iter().cloned())
                .collect(),
        )?;
    }
    Ok(written)
}
