//! Job configuration: TOML files plus `--set key=value` overrides, in the
//! style of torchtitan's job configs.
//!
//! Every key has a default, so `weft train` with no file runs a meaningful
//! job. A file overrides the defaults it names; `--set section.key=value`
//! overrides both (the value is parsed as a TOML value, so strings that are
//! not bare words need quotes: `--set run.name='"my run"'`). Unknown keys
//! and ill-typed values are errors that name the key, the file and line, and
//! the expected type. The sections that configure a library are that
//! library's own types — `[parallel]` is `weft_parallel::ParallelLayout`,
//! `[model]` is `weft_model::ModelOptions` (its `[model.moe]`
//! `weft_moe::MoeOptions`), `train.precision` is
//! `weft_kernels::Precision` — so a choice (`parallel.fsdp`,
//! `parallel.pp_schedule`, `model.moe.gate`, …) is the library's enum, and
//! an unknown value is an error listing the valid ones. [`Config::validate`]
//! runs each library's own checks and names the key at fault
//! ([`ConfigError`]); the field-to-key mapping is in one place,
//! `library_error`.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use weft_data::{DataSpec, DatasetOptions};
use weft_kernels::Precision;
use weft_parallel::{BatchSplit, ModelShape, ParallelLayout};
use weft_trace::input;

/// The whole job configuration.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where the run writes and what it is called.
    pub run: RunConfig,
    /// Model shape.
    pub model: ModelConfig,
    /// Training data.
    pub data: DataSpec,
    /// Steps, batch and evaluation.
    pub train: TrainConfig,
    /// Optimizer and learning-rate schedule.
    pub optim: weft_kernels::OptimConfig,
    /// Periodic checkpoints.
    pub checkpoint: CheckpointConfig,
    /// How the job is split over ranks.
    pub parallel: ParallelLayout,
}

/// `[checkpoint]`: periodic, atomic checkpoints in `<run folder>/checkpoints/`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Save every this many steps, and at the end (0: never; a stop asked
    /// for by a signal saves anyway).
    pub every: u64,
    /// Keep the newest this many checkpoints that verify.
    pub keep_last: usize,
    /// Also keep every checkpoint whose step is a multiple of this (0: none).
    pub keep_every: u64,
    /// Write checkpoints in the background while training goes on (the
    /// loop stops only to copy the state; one save at a time); `false`:
    /// every rank stops for the whole write.
    pub background: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            every: 200,
            keep_last: 2,
            keep_every: 0,
            background: true,
        }
    }
}

/// `[run]`: the run folder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Run name; the folder is `<dir>/<name>`. Empty: a timestamped name.
    pub name: String,
    /// Parent folder of run folders.
    pub dir: PathBuf,
    /// Steps (from the start, or from a resumed checkpoint) whose measured
    /// timeline — pipeline stages, or the sharded runner's compute and
    /// communication tracks — goes to `trace.json`; a trace of every step
    /// would grow without bound on long runs.
    pub trace_steps: u64,
    /// Write a TensorBoard event file (`events.out.tfevents.*`) in the run
    /// folder beside `metrics.jsonl`: its numbers as scalars, health
    /// events, checkpoints and the configuration as texts.
    pub tensorboard: bool,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            dir: PathBuf::from("runs"),
            trace_steps: 20,
            tensorboard: true,
        }
    }
}

/// `[model]`: weft-model's own table ([`weft_model::ModelOptions`]: the
/// shape, `model.arch` and the family's keys, `[model.moe]`).
pub type ModelConfig = weft_model::ModelOptions;

pub use weft_model::Arch;

/// `[train]`: the loop.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Optimizer steps.
    pub steps: u64,
    /// Sequences per optimizer step: the global batch, whatever the
    /// layout.
    pub batch_size: usize,
    /// Sequences per micro-batch (0: micro-batches of at most 512 tokens
    /// whatever the layout, see [`Config::batch_split`]); gradient
    /// accumulation follows.
    pub micro_batch_size: usize,
    /// Seed of initialization and data order.
    pub seed: u64,
    /// Evaluate every this many steps (0: only at the end).
    pub eval_every: u64,
    /// Validation sequences per evaluation.
    pub eval_sequences: usize,
    /// A step whose loss exceeds this factor times the rolling median of
    /// recent losses is logged as a spike.
    pub spike_factor: f64,
    /// Steps in the rolling window of the spike detector.
    pub spike_window: usize,
    /// A rank whose work time (its step outside the time it waits in
    /// the data-parallel collectives) exceeds this factor times the median
    /// of the ranks running the same pipeline stage, over two windows in a
    /// row, is reported as a straggler (0: off).
    pub straggler_factor: f64,
    /// Steps per window of the straggler detector.
    pub straggler_window: u64,
    /// Rewind and skip: on a loss spike, or `nonfinite_limit` non-finite
    /// steps in a row, roll back to the newest checkpoint that verifies
    /// (the start, before the first) and go on with the offending batches
    /// left out; what was skipped is recorded in `<run>/skip.json` and
    /// `<run>/events.jsonl`.
    pub rewind: bool,
    /// Non-finite steps in a row (updates skipped) that make a rewind,
    /// with `rewind`.
    pub nonfinite_limit: u64,
    /// Rewinds allowed in a run; one more is an error.
    pub max_rewinds: u32,
    /// Batches to leave out, by the step (1-based) that reads them in a
    /// run without skips: each later step reads the next batch not left
    /// out. A rewound run's `skip.json` lists its skips; a new run with
    /// them here gives the same bits.
    pub skip_batches: Vec<u64>,
    /// The arithmetic of the linear layers: `"fp32"`, `"bf16"` or
    /// `"fp16"` (mixed precision: the matrix products take 16-bit
    /// operands and accumulate in f32; master weights, gradients, AdamW
    /// moments, layernorm, attention's softmax, the loss and every
    /// reduction stay f32; fp16 trains with dynamic loss scaling,
    /// [`loss_scale`](Self::loss_scale)).
    pub precision: Precision,
    /// Dynamic loss scaling, used with `precision = "fp16"`.
    pub loss_scale: LossScaleConfig,
    /// Activation recomputation: `"none"` (keep every block's
    /// activations), `"selective"` (recompute the MLP's activation),
    /// `"full"` (every block keeps only its output and runs
    /// its forward again in the backward: the least memory, about a third
    /// more compute) or `"every:K"` (blocks 0, K, 2K, … recompute). Bitwise
    /// the same training on every layout (`weft_model::Recompute`).
    pub recompute: weft_model::Recompute,
    /// The loss in chunks of this many tokens (a multiple of 1024), each
    /// chunk's logits freed after its loss and gradient: the head holds
    /// `loss_chunk · V` logits instead of the micro-batch's `B·T·V`, for
    /// one more head forward a step. 0 (the default): the whole
    /// micro-batch. Bitwise the same training.
    pub loss_chunk: usize,
    /// Where the model computes: `"cpu"` (the default), or `"cuda"` /
    /// `"cuda:N"` for GPU `N` (see [`Device::check`]).
    pub device: Device,
}

/// `train.device`: the CPU, or a CUDA GPU by ordinal. Written `"cpu"`,
/// `"cuda"` (GPU 0) or `"cuda:N"`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// The CPU kernels, every layout.
    #[default]
    Cpu,
    /// CUDA GPU `N` (weft built with the `cuda` feature).
    Cuda(usize),
}

impl Device {
    /// The configuration's spelling: `cpu`, `cuda:N`.
    pub fn name(self) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            Device::Cuda(n) => format!("cuda:{n}"),
        }
    }

    /// Parses `cpu`, `cuda`, `cuda:N`.
    ///
    /// # Errors
    /// A message listing the valid forms.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device `{s}`: expected `cpu`, `cuda` or `cuda:N`")),
        }
    }

    /// Whether a run can use this device here. The CPU always can. A CUDA
    /// device needs weft built with the `cuda` feature, the NVIDIA driver,
    /// NVRTC and cuBLAS, and the GPU: what is missing is named (never a
    /// panic). With a usable GPU this is `Ok`, and `weft train` runs its
    /// loop there (`weft_model::cuda::CudaGpt`: one GPU, one rank, a dense
    /// model; [`Config::validate`] refuses what that loop does not do).
    ///
    /// # Errors
    /// A message naming the device and what stops it.
    pub fn check(self) -> Result<(), String> {
        let Device::Cuda(n) = self else {
            return Ok(());
        };
        let name = self.name();
        #[cfg(not(feature = "cuda"))]
        {
            let _ = n;
            Err(format!(
                "`{name}`: this weft was built without CUDA; build it with \
                 `cargo build --release -p weft-trainer --features cuda`"
            ))
        }
        #[cfg(feature = "cuda")]
        {
            match weft_kernels::cuda::available() {
                Err(e) => Err(format!("`{name}`: {e}")),
                Ok(count) if n >= count => Err(format!(
                    "`{name}`: there is no CUDA device {n}; the driver sees {count}"
                )),
                Ok(_) => Ok(()),
            }
        }
    }
}

impl Serialize for Device {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

impl<'de> Deserialize<'de> for Device {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Device::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// `[train.loss_scale]`: dynamic loss scaling for fp16 (the recipe of
/// PyTorch's `GradScaler` and Megatron-LM). Each step's backward is that
/// of the loss times the scale; a step whose gradients overflow is
/// skipped (an `overflow` event) and the scale multiplied by `backoff`;
/// after `growth_interval` finite steps in a row it is multiplied by
/// `growth`. Powers of two keep the unscaling exact.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossScaleConfig {
    /// The first step's scale (2^16).
    pub init: f64,
    /// Multiplied in after this many finite steps in a row (2000).
    pub growth_interval: u32,
    /// The factor of growth (2).
    pub growth: f64,
    /// The factor on an overflow (0.5).
    pub backoff: f64,
    /// The scale never falls below this (1).
    pub min: f64,
    /// The scale never grows above this (2^24).
    pub max: f64,
}

impl Default for LossScaleConfig {
    fn default() -> Self {
        let d = weft_numerics::LossScalerConfig::default();
        Self {
            init: f64::from(d.init_scale),
            growth_interval: d.growth_interval,
            growth: f64::from(d.growth_factor),
            backoff: f64::from(d.backoff_factor),
            min: f64::from(d.min_scale),
            max: f64::from(d.max_scale),
        }
    }
}

impl LossScaleConfig {
    /// The numerics crate's scaler settings.
    #[allow(clippy::cast_possible_truncation)]
    pub fn scaler(&self) -> weft_numerics::LossScalerConfig {
        weft_numerics::LossScalerConfig {
            init_scale: self.init as f32,
            growth_factor: self.growth as f32,
            backoff_factor: self.backoff as f32,
            growth_interval: self.growth_interval,
            min_scale: self.min as f32,
            max_scale: self.max as f32,
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            steps: 2000,
            batch_size: 32,
            micro_batch_size: 0,
            seed: 42,
            eval_every: 100,
            eval_sequences: 64,
            spike_factor: 2.0,
            spike_window: 50,
            straggler_factor: 1.5,
            straggler_window: 20,
            rewind: false,
            nonfinite_limit: 3,
            max_rewinds: 5,
            skip_batches: Vec::new(),
            precision: Precision::F32,
            loss_scale: LossScaleConfig::default(),
            recompute: weft_model::Recompute::None,
            loss_chunk: 0,
            device: Device::Cpu,
        }
    }
}

/// A configuration error, with where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    /// The file, or `--set KEY=VALUE` for an override.
    pub origin: String,
    /// 1-based line and column in the file, when known.
    pub position: Option<(usize, usize)>,
    /// The dotted key, when known.
    pub key: Option<String>,
    /// What is wrong, including the expected type.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.origin)?;
        if let Some((line, col)) = self.position {
            write!(f, ":{line}:{col}")?;
        }
        f.write_str(": ")?;
        if let Some(key) = &self.key {
            write!(f, "key `{key}`: ")?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// Loads the defaults, then `file` (if any), then each `KEY=VALUE`
    /// override, then validates the result.
    ///
    /// # Errors
    /// A [`ConfigError`] for an unreadable file, invalid TOML, an unknown
    /// key, a value of the wrong type, a malformed override, or a value out
    /// of range.
    pub fn load(file: Option<&Path>, overrides: &[String]) -> Result<Self, ConfigError> {
        let mut config = match file {
            None => Config::default(),
            Some(path) => {
                let origin = path.display().to_string();
                let text =
                    input::read_to_string(path, input::CONFIG_BYTES).map_err(|e| ConfigError {
                        origin: origin.clone(),
                        position: None,
                        key: None,
                        message: format!("cannot read: {e}"),
                    })?;
                Self::from_toml(&text, &origin)?
            }
        };
        for o in overrides {
            config = config.with_override(o)?;
        }
        // a Hugging Face folder to start from sets the model's shape
        config.model = config.model.resolve_init_from().map_err(|e| match e {
            weft_model::Error::Config { .. } => library_error(e),
            other => ConfigError::key("model.init_from", other.to_string()),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Parses TOML text (`origin` names it in errors), without validation.
    ///
    /// # Errors
    /// A [`ConfigError`] with the line, column and key of the problem.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let position = e.span().map(|s| line_col(text, s.start));
            ConfigError {
                origin: origin.to_owned(),
                position,
                key: position.and_then(|(line, _)| key_at_line(text, line)),
                message: e.message().trim().to_owned(),
            }
        })
    }

    /// Applies one `section.key=value` override.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the override for a missing `=`, an unknown
    /// key, an unparsable value or a value of the wrong type.
    pub fn with_override(&self, assignment: &str) -> Result<Self, ConfigError> {
        let err = |key: Option<&str>, message: String| ConfigError {
            origin: format!("--set {assignment}"),
            position: None,
            key: key.map(str::to_owned),
            message,
        };
        let Some((key, value)) = assignment.split_once('=') else {
            return Err(err(None, "expected KEY=VALUE, e.g. optim.lr=1e-3".into()));
        };
        let key = key.trim();
        let value = value.trim();
        let mut table = toml::Table::try_from(self).map_err(|e| err(None, e.to_string()))?;
        let parts: Vec<&str> = key.split('.').collect();
        let Some((last, sections)) = parts.split_last() else {
            return Err(err(None, "empty key".into()));
        };
        let mut node = &mut table;
        for (i, part) in sections.iter().enumerate() {
            let path = parts[..=i].join(".");
            if !node.contains_key(*part) {
                return Err(err(
                    Some(key),
                    format!("unknown section `{path}`; known: {}", known(node)),
                ));
            }
            node = match node.get_mut(*part) {
                Some(toml::Value::Table(t)) => t,
                _ => return Err(err(Some(key), format!("`{path}` is not a section"))),
            };
        }
        // a key missing from the table is unknown, or an optional key left
        // unset (`model.tied_embeddings`, `data.tokenizer`): parsing decides
        let unset = (!node.contains_key(*last)).then(|| known(node));
        // A TOML value, or failing that a bare string (`run.name=foo`).
        let parsed = toml::from_str::<toml::Table>(&format!("v = {value}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(value.to_owned()));
        node.insert((*last).to_owned(), parsed);
        toml::Value::Table(table)
            .try_into::<Config>()
            .map_err(|e| match unset {
                Some(known) if e.message().contains("unknown field") => {
                    err(Some(key), format!("unknown key; known keys here: {known}"))
                }
                _ => err(Some(key), e.message().trim().to_owned()),
            })
    }

    /// Checks ranges and relations between settings: each library's own
    /// checks of the sections it owns (the model's shape, the mixture of
    /// experts, the parallel layout and the batch split, the loss scaler,
    /// the synthetic corpus), then the trainer's own settings.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first key out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &str, message: String| Err(ConfigError::key(key, message));
        self.model.validate().map_err(library_error)?;
        let p = &self.parallel;
        for (key, v) in [
            ("parallel.dp", p.dp),
            ("parallel.tp", p.tp),
            ("parallel.pp", p.pp),
            ("parallel.ep", p.ep),
        ] {
            // the ranks this trainer starts (threads of one process, or the
            // processes of one launcher's job)
            if v > MAX_RANKS_PER_AXIS {
                return bad(
                    key,
                    format!("must be at most {MAX_RANKS_PER_AXIS} (got {v})"),
                );
            }
        }
        self.model.moe.validate().map_err(library_error)?;
        if let Err(weft_model::Error::Config { reason, .. }) =
            self.model.check_context_parallel(p.cp)
        {
            return bad("parallel.cp", reason);
        }
        self.parallel
            .check(
                &self.model_shape(),
                self.train.batch_size,
                self.train.micro_batch_size,
            )
            .map_err(library_error)?;
        weft_numerics::DynamicLossScaler::new(self.train.loss_scale.scaler())
            .map_err(|e| self.loss_scale_error(e))?;
        let t = &self.train;
        if let Err(weft_model::Error::Config { reason, .. }) =
            weft_model::GptBlocks::check_loss_chunk(t.loss_chunk)
        {
            return bad("train.loss_chunk", reason);
        }
        if !(1..=1 << 20).contains(&t.eval_sequences) {
            return bad("train.eval_sequences", "must be in 1..=1048576".into());
        }
        if t.spike_factor.is_nan() || t.spike_factor <= 1.0 {
            return bad(
                "train.spike_factor",
                format!("must be > 1 (got {})", t.spike_factor),
            );
        }
        if !(t.straggler_factor == 0.0 || t.straggler_factor > 1.0) {
            return bad(
                "train.straggler_factor",
                format!("must be > 1, or 0 for off (got {})", t.straggler_factor),
            );
        }
        if t.straggler_window == 0 {
            return bad("train.straggler_window", "must be at least 1".into());
        }
        if t.nonfinite_limit == 0 {
            return bad("train.nonfinite_limit", "must be at least 1".into());
        }
        if let Some(b) = t.skip_batches.iter().find(|&&b| b == 0) {
            return bad(
                "train.skip_batches",
                format!("steps count from 1 (got {b})"),
            );
        }
        self.optim.validate().map_err(library_error)?;
        self.optim.check_steps(t.steps).map_err(library_error)?;
        if let Err((key, message)) = self.gpu_support() {
            return bad(key, message);
        }
        let name = &self.run.name;
        if name == "."
            || name == ".."
            || name
                .chars()
                .any(|c| c == '/' || c == '\\' || c.is_control())
        {
            return bad(
                "run.name",
                format!(
                    "is the run folder's name inside run.dir, not a path: no `/`, `\\`, `.`, `..` or control characters (got {name:?})"
                ),
            );
        }
        self.data
            .validate()
            .map_err(|e| ConfigError::key(&format!("data.{}", e.field), e.problem))?;
        Ok(())
    }

    /// How the run's dataset cuts its sequences.
    #[must_use]
    pub fn dataset_options(&self) -> DatasetOptions {
        DatasetOptions {
            seq: self.model.block_size,
            seed: self.train.seed,
            global_batch: self.train.batch_size,
        }
    }

    /// The model dimensions the parallel layout splits.
    #[must_use]
    pub fn model_shape(&self) -> ModelShape {
        ModelShape {
            layers: self.model.n_layer,
            heads: self.model.n_head,
            kv_heads: self.model.gpt_config(1).n_kv_head(),
            experts: self.model.moe.experts,
            seq: self.model.block_size,
        }
    }

    /// How the global batch is cut over the layout
    /// ([`ParallelLayout::batch_split`] of `train.batch_size` and
    /// `train.micro_batch_size`).
    ///
    /// # Errors
    /// A [`ConfigError`] naming `train.batch_size` or
    /// `train.micro_batch_size` when the batch does not split.
    pub fn batch_split(&self) -> Result<BatchSplit, ConfigError> {
        self.parallel
            .batch_split(
                self.train.batch_size,
                self.train.micro_batch_size,
                self.model.block_size,
            )
            .map_err(library_error)
    }

    /// The loss scaler's refusal as the key of `[train.loss_scale]` it
    /// concerns.
    fn loss_scale_error(&self, e: weft_numerics::Error) -> ConfigError {
        let weft_numerics::Error::InvalidConfig {
            field,
            value,
            expected,
        } = e
        else {
            return ConfigError::key("train.loss_scale", e.to_string());
        };
        let key = match field {
            "init_scale" => "init",
            "growth_factor" => "growth",
            "backoff_factor" => "backoff",
            "min_scale" => "min",
            "max_scale" => "max",
            f => f,
        };
        ConfigError::key(
            &format!("train.loss_scale.{key}"),
            format!(
                "= {value} is out of range: expected {} (train.loss_scale.min = {}, max = {})",
                expected
                    .replace("min_scale", "train.loss_scale.min")
                    .replace("max_scale", "train.loss_scale.max"),
                self.train.loss_scale.min,
                self.train.loss_scale.max
            ),
        )
    }

    /// With `train.device = "cuda"`: what the GPU loop does not do yet,
    /// as the key that asks for it and why. The GPU loop trains a dense
    /// model on one GPU as one rank (`weft_model::cuda::CudaGpt`), so
    /// every other layout, mixture-of-experts blocks, document masking,
    /// recomputation, fp16 (no dynamic loss scaling on the device) and rewinding are
    /// refused; `Ok` on the CPU.
    ///
    /// # Errors
    /// The first key set to something the GPU loop does not do, and a
    /// message saying what it does.
    pub fn gpu_support(&self) -> Result<(), (&'static str, String)> {
        let Device::Cuda(_) = self.train.device else {
            return Ok(());
        };
        let device = self.train.device.name();
        let (p, t) = (&self.parallel, &self.train);
        let one_rank = format!("train.device = \"{device}\" trains on one GPU as one rank");
        let degree = |v: usize| {
            (v != 1).then(|| format!("= {v}: {one_rank} (parallel.dp = tp = pp = ep = 1)"))
        };
        let refusals = [
            ("parallel.dp", degree(p.dp)),
            ("parallel.tp", degree(p.tp)),
            ("parallel.pp", degree(p.pp)),
            ("parallel.ep", degree(p.ep)),
            ("parallel.fsdp", p.fsdp.map(|s| format!("= \"{s}\": {one_rank}, holding the whole model (no sharding)"))),
            ("parallel.backend", matches!(p.backend, weft_collectives::Backend::Mpi | weft_collectives::Backend::Nccl)
                .then(|| format!("= \"{}\": {one_rank} in this process (\"auto\" or \"threads\")", p.backend.name()))),
            ("model.moe.experts", (self.model.moe.experts > 0).then(|| format!(
                "= {}: the GPU model (weft_model::cuda::CudaGpt) has GPT-2's dense MLP blocks only; set it to 0",
                self.model.moe.experts))),
            ("data.doc_mask", self.data.doc_mask.then(|| "the GPU model's attention has no document masking yet".into())),
            ("optim.name", (self.optim.name == weft_kernels::Optimizer::Muon).then(|| "= \"muon\": the GPU model trains with AdamW only".into())),
            ("train.recompute", (t.recompute != weft_model::Recompute::None).then(|| format!(
                "= \"{}\": the GPU model keeps every activation (no recomputation yet)", t.recompute))),
            ("train.loss_chunk", (t.loss_chunk != 0).then(|| format!(
                "= {}: the GPU model computes the whole micro-batch's logits (no chunked loss yet)", t.loss_chunk))),
            ("train.precision", (t.precision == Precision::F16).then(|| {
                "= \"fp16\": the GPU loop has no dynamic loss scaling yet; \"bf16\" or \"fp32\" run on the GPU".into()
            })),
            ("train.rewind", t.rewind.then(|| {
                "the GPU loop does not rewind yet (train.skip_batches and the spike and non-finite checks work)".into()
            })),
        ];
        match refusals
            .into_iter()
            .find_map(|(key, why)| why.map(|w| (key, w)))
        {
            Some((key, why)) => Err((key, format!("{why}; use train.device = \"cpu\" for it"))),
            None => Ok(()),
        }
    }

    /// The configuration as TOML, as written to the run folder.
    ///
    /// # Panics
    /// Never for a `Config`: every field serializes.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a Config always serializes")
    }
}

/// The largest degree `weft train` runs on any axis of `[parallel]`.
pub const MAX_RANKS_PER_AXIS: usize = 64;

impl ConfigError {
    /// An error of the resolved configuration at `key`.
    pub fn key(key: &str, message: String) -> Self {
        ConfigError {
            origin: "config".into(),
            position: None,
            key: Some(key.into()),
            message,
        }
    }
}

/// A library's refusal of the section it owns, as the key of the job file
/// it concerns: the one place the libraries' field names map to keys.
pub fn library_error(e: impl Into<LibraryError>) -> ConfigError {
    let (key, message) = match e.into() {
        LibraryError::Model(weft_model::Error::Config { field, reason }) => {
            let field = match field {
                "n_positions" => "block_size",
                "num_key_value_heads" => "n_kv_head",
                "rope" => "rope_theta",
                "sliding_window_pattern" => "global_every",
                f => f,
            };
            (format!("model.{field}"), reason)
        }
        LibraryError::Moe(weft_moe::Error::Config { field, reason }) => {
            (format!("model.moe.{field}"), reason)
        }
        LibraryError::Parallel(weft_parallel::Error::Dims { field, reason }) => {
            (format!("parallel.{field}"), reason)
        }
        LibraryError::Parallel(weft_parallel::Error::Batch { field, reason }) => {
            (format!("train.{field}"), reason)
        }
        LibraryError::Kernels(weft_kernels::Error::Config { field, reason }) => {
            (format!("optim.{field}"), reason)
        }
        LibraryError::Model(e) => ("model".into(), e.to_string()),
        LibraryError::Kernels(e) => ("optim".into(), e.to_string()),
        LibraryError::Moe(e) => ("model.moe".into(), e.to_string()),
        LibraryError::Parallel(e) => ("parallel".into(), e.to_string()),
    };
    ConfigError::key(&key, message)
}

/// The libraries whose checks [`library_error`] maps to keys.
#[derive(Debug, thiserror::Error)]
pub enum LibraryError {
    /// `weft-model`: `[model]`.
    #[error(transparent)]
    Model(#[from] weft_model::Error),
    /// `weft-moe`: `[model.moe]`.
    #[error(transparent)]
    Moe(#[from] weft_moe::Error),
    /// `weft-parallel`: `[parallel]` and the batch split.
    #[error(transparent)]
    Parallel(#[from] weft_parallel::Error),
    /// `weft-kernels`: `[optim]`.
    #[error(transparent)]
    Kernels(#[from] weft_kernels::Error),
}

fn known(t: &toml::Table) -> String {
    let mut keys: Vec<&str> = t.keys().map(String::as_str).collect();
    keys.sort_unstable();
    keys.join(", ")
}

/// 1-based line and column of byte offset `at`.
fn line_col(text: &str, at: usize) -> (usize, usize) {
    let before = &text[..at.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before
        .rfind('\n')
        .map_or(before.len(), |nl| before.len() - nl - 1)
        + 1;
    (line, col)
}

/// The dotted key assigned on `line` (1-based), with its `[section]`.
fn key_at_line(text: &str, line: usize) -> Option<String> {
    let lines: Vec<&str> = text.lines().collect();
    let this = lines.get(line - 1)?.trim();
    let (key, _) = this.split_once('=')?;
    let key = key.trim().trim_matches('"');
    let section = lines[..line - 1].iter().rev().find_map(|l| {
        let l = l.trim();
        (l.starts_with('[') && l.ends_with(']'))
            .then(|| l.trim_matches(|c| c == '[' || c == ']').trim())
    });
    Some(match section {
        Some(s) => format!("{s}.{key}"),
        None => key.to_owned(),
    })
}
