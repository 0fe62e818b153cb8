//! Saving and restoring the training state with `weft-checkpoint`.
//!
//! A checkpoint holds every parameter under its Hugging Face GPT-2 name
//! (so `weft ckpt export --hf` can turn it into a `transformers` folder),
//! the AdamW moments under `optimizer.exp_avg.<name>` and
//! `optimizer.exp_avg_sq.<name>`, and in its trainer state the optimizer
//! step and a hash of the configuration. Data batches are pure functions of
//! the step, so the step is the whole data-loader position: a resumed run
//! continues bit for bit.
//!
//! Each rank writes only the parts of the tensors it owns
//! ([`save_sharded`]: its tensor-, expert- and pipeline-parallel part, its
//! FSDP shards — each element by exactly one rank, as boxes of the whole
//! tensors), in parallel; rank 0 commits the manifest, which records the
//! layout (the mesh's `pp × edp × ep × tp`). Loading
//! ([`restore_sharded`]) reads, on every rank, the parts its own layout
//! holds — of a checkpoint saved by any layout. No rank assembles the
//! whole model.

use std::path::{Path, PathBuf};

use weft_checkpoint::collective::{self, CollectiveError, SaveSpec};
use weft_checkpoint::{
    FlatRun, Region, Retention, SaveOptions, TrainerState, VerifyLevel, load_latest,
};
use weft_collectives::Communicator;
use weft_model::{AdamWState, Gpt, GptConfig, OwnedPart, ReadTensor, TrainModel};
use weft_numerics::LossScalerState;

use crate::config::Config;
use crate::run::faults::FaultPlan;

/// Checkpoint errors, with the checkpoint folder they concern.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CkptError {
    /// The checkpoint library failed.
    #[error("checkpoint {root}: {source}")]
    Checkpoint {
        /// The checkpoints folder.
        root: PathBuf,
        /// The underlying error.
        source: weft_checkpoint::Error,
    },
    /// The collective save or load failed on another rank (which reports
    /// why), or between the ranks.
    #[error(transparent)]
    Collective(CollectiveError),
    /// Resuming found no checkpoint.
    #[error("no checkpoint to resume from in {0}")]
    Missing(PathBuf),
    /// The checkpoint was written by a run with a different configuration.
    #[error(
        "checkpoint {root} was saved by a run with another configuration (hash {saved}, this run {current}); \
         resume with the run's own config.toml"
    )]
    ConfigMismatch {
        /// The checkpoints folder.
        root: PathBuf,
        /// Hash stored in the checkpoint.
        saved: String,
        /// Hash of this run's configuration.
        current: String,
    },
    /// A tensor is missing or has the wrong size.
    #[error("checkpoint {root}: tensor {name}: {reason}")]
    Tensor {
        /// The checkpoints folder.
        root: PathBuf,
        /// The tensor.
        name: String,
        /// What is wrong.
        reason: String,
    },
}

impl From<CollectiveError> for CkptError {
    fn from(e: CollectiveError) -> Self {
        match e {
            CollectiveError::Missing(root) => Self::Missing(root),
            other => Self::Collective(other),
        }
    }
}

impl CkptError {
    /// The error, a checkpoint library's failure naming `root`.
    fn rooted(self, root: &Path) -> Self {
        match self {
            Self::Collective(CollectiveError::Checkpoint(source)) => Self::Checkpoint {
                root: root.to_owned(),
                source,
            },
            other => other,
        }
    }
}

/// A hash of the configuration that defines the run's computation, as 16
/// hex digits: everything except `[run]`, `[checkpoint]`, the layout in
/// `[parallel]` (but not `parallel.reproducible`), and the settings
/// that only decide how long to go on and what to watch (`train.steps`,
/// `train.eval_every`, `train.eval_sequences`, `train.spike_*`,
/// `train.straggler_*`, the rewind settings, `train.skip_batches`, which only changes the batches
/// of steps to come, `train.micro_batch_size` and `train.device`,
/// which like the layout only change rounding, and `train.recompute` and
/// `train.loss_chunk`, which change nothing), so a run can be resumed to
/// train longer, past a batch to leave out, on the other device or with
/// another recomputation or loss chunk. (Changing `train.steps` changes the
/// learning-rate schedule from the resume point on: the run is then no
/// longer the uninterrupted run of either length.)
pub(crate) fn config_hash(config: &Config) -> String {
    let mut c = config.clone();
    c.run = Default::default();
    c.checkpoint = Default::default();
    // The layout over ranks does not define the computation (with
    // reproducible reductions not even its rounding): a run may resume on
    // another layout.
    c.parallel = weft_parallel::ParallelLayout {
        reproducible: config.parallel.reproducible,
        ..Default::default()
    };
    let d = crate::config::TrainConfig::default();
    c.train.steps = d.steps;
    c.train.eval_every = d.eval_every;
    c.train.eval_sequences = d.eval_sequences;
    c.train.spike_factor = d.spike_factor;
    c.train.spike_window = d.spike_window;
    c.train.rewind = d.rewind;
    c.train.straggler_factor = d.straggler_factor;
    c.train.straggler_window = d.straggler_window;
    c.train.nonfinite_limit = d.nonfinite_limit;
    c.train.max_rewinds = d.max_rewinds;
    c.train.skip_batches = d.skip_batches;
    // like the layout, the micro-batch size changes only the rounding of
    // the global batch's gradient (a shrunk job keeps the batch by
    // accumulating more micro-batches)
    c.train.micro_batch_size = d.micro_batch_size;
    // the GPU runs the same model, data and optimizer to rounding: a
    // checkpoint of either device continues on the other
    c.train.device = d.device;
    // recomputation and the loss's chunks change no bit: a run may resume
    // with other ones
    c.train.recompute = d.recompute;
    c.train.loss_chunk = d.loss_chunk;
    format!(
        "{:016x}",
        xxhash_rust::xxh3::xxh3_64(c.to_toml().as_bytes())
    )
}

/// The names a tensor's parameters and AdamW moments are saved under.
fn saved_name(which: usize, name: &str) -> String {
    match which {
        0 => name.to_owned(),
        1 => format!("optimizer.exp_avg.{name}"),
        _ => format!("optimizer.exp_avg_sq.{name}"),
    }
}

/// The trainer state a checkpoint of `step` records.
fn trainer_state(
    config: &Config,
    step: u64,
    opt_step: u32,
    loss_scale: Option<LossScalerState>,
    model: &GptConfig,
) -> TrainerState {
    let mut state = TrainerState {
        optimizer_step: step,
        config_hash: Some(config_hash(config)),
        ..Default::default()
    };
    state.data_position = Some(serde_json::json!({ "step": step }));
    state
        .extra
        .insert("adamw_t".into(), serde_json::json!(opt_step));
    if let Some(ls) = loss_scale {
        state.extra.insert(
            "loss_scale".into(),
            serde_json::json!({
                "scale": ls.scale, "good_steps": ls.good_steps, "skipped_steps": ls.skipped_steps,
            }),
        );
    }
    state.extra.insert(
        "model".into(),
        serde_json::json!({
            "n_layer": model.n_layer, "n_head": model.n_head, "n_embd": model.n_embd,
            "vocab_size": model.vocab_size, "block_size": model.block_size,
            "layer_norm_epsilon": model.layer_norm_epsilon, "options": config.model,
        }),
    );
    let p = &config.parallel;
    state.extra.insert(
        "parallel".into(),
        serde_json::json!({
            "dp": p.dp, "tp": p.tp, "pp": p.pp, "ep": p.ep, "fsdp": p.fsdp.map_or("none", weft_parallel::Strategy::name),
            "sequence_parallel": p.sequence_parallel, "pp_schedule": p.pp_schedule.name(),
        }),
    );
    state
}

/// What a checkpoint of the training state holds beyond the run's
/// configuration.
pub(crate) struct SaveRequest<'a> {
    /// The step it is taken after.
    pub step: u64,
    /// This rank's parts of the tensors (its [`TrainModel::owned_parts`]).
    pub parts: &'a [OwnedPart],
    /// The optimizer's step count.
    pub opt_step: u32,
    /// The fp16 loss scaler's state.
    pub loss_scale: Option<LossScalerState>,
    /// The model's shape, for `weft ckpt export`.
    pub model: &'a GptConfig,
    /// The mesh's dimensions, slowest first, as the manifest records them.
    pub mesh: &'a [(&'static str, usize)],
}

/// Saves checkpoint `req.step` under `root`: rank 0 prepares the staging
/// folder, every rank writes its own file of `req.parts` into it, rank 0
/// commits the manifest — the layout of the mesh, the trainer state — and
/// applies the retention of `[checkpoint]`. A `crash-during-save` fault
/// of `faults` fires between a rank's write and the commit. Collective
/// over `world`; every rank returns the same outcome.
///
/// # Errors
/// [`CkptError::Checkpoint`] if preparing, a rank's write, the commit or
/// the retention failed (naming the failure on the rank that saw it; the
/// others report [`CkptError::Collective`]); a collective error.
pub(crate) fn save_sharded(
    world: &dyn Communicator,
    root: &Path,
    config: &Config,
    req: &SaveRequest<'_>,
    faults: &FaultPlan,
) -> Result<(), CkptError> {
    let runs: Vec<FlatRun<'_>> = req
        .parts
        .iter()
        .map(|p| FlatRun {
            name: &p.name,
            global_shape: &p.global_shape,
            start: p.whole,
            values: p.values.iter().map(Vec::as_slice).collect(),
        })
        .collect();
    let c = &config.checkpoint;
    let spec = SaveSpec {
        step: req.step,
        runs: &runs,
        name: &saved_name,
        mesh: req.mesh,
        state: &trainer_state(config, req.step, req.opt_step, req.loss_scale, req.model),
        retention: Retention::new(c.keep_last, (c.keep_every > 0).then_some(c.keep_every)),
    };
    let run_dir = root.parent().unwrap_or(root);
    collective::save(world, root, &spec, &SaveOptions::default(), &mut || {
        faults.during_save(run_dir, req.step, world.rank());
    })
    .map_err(|e| CkptError::from(e).rooted(root))
}

/// Loads, on every rank, its part of the newest checkpoint under `root`
/// that verifies (rank 0 verifies every byte and tells the others which)
/// into `model`, whatever layout saved it; returns the step. Collective
/// over `world`.
///
/// # Errors
/// As [`restore`]; [`CkptError::Collective`] on the ranks that did not see the
/// failure; a collective error.
pub(crate) fn restore_sharded<M: TrainModel + ?Sized>(
    world: &dyn Communicator,
    root: &Path,
    config: &Config,
    model: &mut M,
) -> Result<Restored, CkptError> {
    restore_with(world, root, config, &mut |opt_step, read| {
        model.load_with(opt_step, read).map_err(|e| e.to_string())
    })
}

/// As [`restore_sharded`], into whatever `load` fills: it gets the
/// checkpoint's optimizer step and a reader of whole tensors (`which` 0
/// for the parameters, 1 and 2 for the AdamW moments), and says what
/// went wrong, if anything. Collective over `world`.
///
/// # Errors
/// As [`restore_sharded`]; [`CkptError::Tensor`] with `load`'s message.
fn restore_with(
    world: &dyn Communicator,
    root: &Path,
    config: &Config,
    load: &mut dyn FnMut(u32, &mut ReadTensor<'_>) -> Result<(), String>,
) -> Result<Restored, CkptError> {
    let picked =
        collective::pick_latest(world, root, |manifest| check_hash(root, config, manifest))
            .map_err(|e: CkptError| e.rooted(root))?;
    let (ckpt, skipped) = (picked.checkpoint, picked.skipped);
    let step = ckpt.step();
    let opt_step = ckpt
        .manifest()
        .state
        .extra
        .get("adamw_t")
        .and_then(serde_json::Value::as_u64)
        .map_or(0, |t| u32::try_from(t).unwrap_or(u32::MAX));
    let mut read = |which: usize,
                    name: &str,
                    out: &mut [f32]|
     -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let bytes = ckpt.read_tensor(&saved_name(which, name))?;
        if bytes.len() != 4 * out.len() {
            return Err(format!("{} bytes, expected {}", bytes.len(), 4 * out.len()).into());
        }
        for (d, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        Ok(())
    };
    load(opt_step, &mut read).map_err(|reason| CkptError::Tensor {
        root: root.to_owned(),
        name: "model".into(),
        reason,
    })?;
    let loss_scale = loss_scale_of(&ckpt.manifest().state);
    Ok(Restored {
        step,
        skipped,
        loss_scale,
    })
}

/// Refuses a checkpoint saved by another configuration.
fn check_hash(
    root: &Path,
    config: &Config,
    manifest: &weft_checkpoint::Manifest,
) -> Result<(), CkptError> {
    let current = config_hash(config);
    match &manifest.state.config_hash {
        Some(saved) if *saved != current => Err(CkptError::ConfigMismatch {
            root: root.to_owned(),
            saved: saved.clone(),
            current,
        }),
        _ => Ok(()),
    }
}

/// What [`restore`] found.
#[derive(Debug)]
pub struct Restored {
    /// Optimizer steps already taken.
    pub step: u64,
    /// Newer checkpoints that did not verify and were skipped, with why and
    /// where each was moved aside (`step-NNNNNNNN.corrupt`, kept as
    /// evidence).
    pub skipped: Vec<String>,
    /// The dynamic loss scaler's state at the checkpoint (fp16 runs).
    pub loss_scale: Option<LossScalerState>,
}

/// The loss scaler's state a checkpoint's trainer state records, if any.
fn loss_scale_of(state: &TrainerState) -> Option<LossScalerState> {
    let v = state.extra.get("loss_scale")?;
    #[allow(clippy::cast_possible_truncation)]
    Some(LossScalerState {
        scale: v.get("scale")?.as_f64()? as f32,
        good_steps: u32::try_from(v.get("good_steps")?.as_u64()?).ok()?,
        skipped_steps: v.get("skipped_steps")?.as_u64()?,
    })
}

/// Loads the newest checkpoint under `root` that verifies into `model` and
/// `opt`.
///
/// # Errors
/// [`CkptError::Missing`] if there is none; [`CkptError::ConfigMismatch`] if
/// it belongs to another configuration; [`CkptError::Tensor`] if a tensor is
/// missing or mis-sized; [`CkptError::Checkpoint`] for I/O or corruption.
pub(crate) fn restore(
    root: &Path,
    config: &Config,
    model: &mut Gpt,
    opt: &mut AdamWState,
) -> Result<Restored, CkptError> {
    let err = |source| CkptError::Checkpoint {
        root: root.to_owned(),
        source,
    };
    let loaded = load_latest(root, VerifyLevel::Full)
        .map_err(err)?
        .ok_or_else(|| CkptError::Missing(root.to_owned()))?;
    let ckpt = &loaded.checkpoint;
    let state = &ckpt.manifest().state;
    check_hash(root, config, ckpt.manifest())?;
    let specs = model.layout().specs().to_vec();
    for spec in &specs {
        let r = spec.range();
        let shape: Vec<u64> = spec.shape.iter().map(|&d| d as u64).collect();
        for (prefix, buf) in [
            ("", &mut model.params),
            ("optimizer.exp_avg.", &mut opt.m),
            ("optimizer.exp_avg_sq.", &mut opt.v),
        ] {
            let name = format!("{prefix}{}", spec.name);
            let bytes = ckpt
                .read_region(&name, &Region::full(&shape))
                .map_err(|e| CkptError::Tensor {
                    root: root.to_owned(),
                    name: name.clone(),
                    reason: e.to_string(),
                })?;
            if bytes.len() != 4 * r.len() {
                return Err(CkptError::Tensor {
                    root: root.to_owned(),
                    name,
                    reason: format!("{} bytes, expected {}", bytes.len(), 4 * r.len()),
                });
            }
            for (d, c) in buf[r.clone()].iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }
    opt.step = state
        .extra
        .get("adamw_t")
        .and_then(serde_json::Value::as_u64)
        .map_or(0, |t| t as u32);
    Ok(Restored {
        step: ckpt.step(),
        skipped: loaded
            .skipped
            .iter()
            .map(|(p, e)| format!("{}: {e}", p.display()))
            .collect(),
        loss_scale: loss_scale_of(state),
    })
}
