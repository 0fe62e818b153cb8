//! Saving and restoring the training state with `weft-checkpoint`.
//!
//! A checkpoint holds every parameter under its Hugging Face GPT-2 name
//! (so `weft ckpt export --hf` can turn it into a `transformers` folder),
//! the AdamW moments under `optimizer.exp_avg.<name>` and
//! `optimizer.exp_avg_sq.<name>` (a Muon run's hidden matrices: their
//! momentum under `optimizer.momentum_buffer.<name>`, [`saved_names`]),
//! and in its trainer state the optimizer
//! step and a hash of the configuration. Data batches are pure functions of
//! the step, so the step is the whole data-loader position: a resumed run
//! continues bit for bit.
//!
//! Each rank writes only the parts of the tensors it owns
//! ([`Saver`]: its tensor-, expert- and pipeline-parallel part, its FSDP
//! shards — each element by exactly one rank, as boxes of the whole
//! tensors), in parallel, by default on a thread of its own while the
//! ranks train on (the loop stops only to copy its state); rank 0
//! commits the manifest, which records the layout (the mesh's `pp × edp ×
//! ep × cp × tp`). Loading
//! ([`restore_sharded`]) reads, on every rank, the parts its own layout
//! holds — of a checkpoint saved by any layout. No rank assembles the
//! whole model.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use std::sync::Arc;
use std::time::Instant;

use weft_checkpoint::collective::{self, CollectiveError, OwnedRun, SaveHooks, Saved, Staged};
use weft_checkpoint::{Retention, SaveOptions, TrainerState, VerifyLevel, load_latest};
use weft_collectives::Communicator;
use weft_model::{Gpt, GptConfig, OwnedPart, ReadTensor, TrainModel};
use weft_numerics::LossScalerState;

use weft_trace::EventKind;

use crate::config::Config;
use crate::run::faults::FaultPlan;
use crate::train::{HealthEvent, Observer, TrainError};

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
    /// A checkpoint cannot continue with this run's learning-rate decay.
    #[error("checkpoint {root}: step {step}: {reason}")]
    Branch {
        /// The checkpoints folder.
        root: PathBuf,
        /// The checkpoint's step.
        step: u64,
        /// Why.
        reason: String,
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
/// longer the uninterrupted run of either length.) With `optim.schedule =
/// "wsd"` the decay's keys (`decay_shape`, `decay_fraction`,
/// `decay_steps`, `min_lr_ratio`) are left out too: a checkpoint of the
/// stable phase branches into any decay ([`check_branch`] refuses one
/// taken after its own run's decay began).
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
    if c.optim.schedule == weft_kernels::Schedule::Wsd {
        let o = weft_kernels::OptimConfig::default();
        c.optim.decay_shape = o.decay_shape;
        c.optim.decay_fraction = o.decay_fraction;
        c.optim.decay_steps = o.decay_steps;
        c.optim.min_lr_ratio = o.min_lr_ratio;
    }
    format!(
        "{:016x}",
        xxhash_rust::xxh3::xxh3_64(c.to_toml().as_bytes())
    )
}

/// The names a tensor's parameters and optimizer state are saved under,
/// by the run's optimizer: a tensor AdamW steps has its moments
/// `optimizer.exp_avg.<name>` and `optimizer.exp_avg_sq.<name>`; one
/// Muon steps (`optim.name = "muon"`, [`weft_model::is_muon_tensor`] in
/// `layout`) its momentum `optimizer.momentum_buffer.<name>` (torch's
/// name for it) and nothing else.
fn saved_names(config: &Config, layout: &weft_model::ParamLayout) -> collective::SavedName {
    let muon: HashSet<String> = match config.optim.name {
        weft_kernels::Optimizer::Muon => layout
            .specs()
            .iter()
            .filter(|s| weft_model::is_muon_tensor(s))
            .map(|s| s.name.clone())
            .collect(),
        weft_kernels::Optimizer::AdamW => HashSet::new(),
    };
    Arc::new(move |which, name| match which {
        0 => name.to_owned(),
        1 if muon.contains(name) => format!("optimizer.momentum_buffer.{name}"),
        1 => format!("optimizer.exp_avg.{name}"),
        _ => format!("optimizer.exp_avg_sq.{name}"),
    })
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
    // where this run's decay begins, and which decay: another decay
    // branches only from a checkpoint before it (see `check_branch`)
    if let Some(start) = config.optim.decay_start(config.train.steps) {
        let decay = serde_json::json!({ "start": start, "decay": decay_of(config) });
        state.extra.insert("wsd_decay".into(), decay);
    }
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
    /// The fp16 loss scaler's state.
    pub loss_scale: Option<LossScalerState>,
    /// The model's shape, for `weft ckpt export`.
    pub model: &'a GptConfig,
    /// The mesh's dimensions, slowest first, as the manifest records them.
    pub mesh: Vec<(&'static str, usize)>,
}

/// The run's checkpoints, each rank writing its own parts and rank 0
/// committing ([`collective::Saver`]): in the background while the ranks
/// train on (`checkpoint.background`, the default: the loop stops only to
/// copy its state, one save in flight, a save that would overlap the
/// previous one waiting for it), or with every rank stopped for the whole
/// write. Each committed checkpoint is recorded in `events.jsonl` with
/// the loop's stall, its write time and its bytes, and reported.
pub(crate) struct Saver {
    root: PathBuf,
    saver: collective::Saver,
    /// The host copy's buffers, filled once at the start (so that even
    /// the first save copies into mapped memory) until a save gives its
    /// own back.
    reserved: Vec<OwnedPart>,
    /// The newest checkpoint known to be committed (0: none).
    pub(crate) committed: u64,
}

impl Saver {
    /// The checkpoints of `model`'s run in `run_dir`, the newest
    /// committed one at `committed`; in the background, with the host
    /// copy's buffers in place. Collective over `world`.
    ///
    /// # Errors
    /// The split of the background saver's group; the model's.
    pub(crate) fn new<M: TrainModel + ?Sized>(
        world: &dyn Communicator,
        config: &Config,
        model: &M,
        run_dir: &Path,
        committed: u64,
    ) -> Result<Self, TrainError> {
        let root = run_dir.join("checkpoints");
        let c = &config.checkpoint;
        let saver = collective::Saver::new(world, &root, SaveOptions::default(), c.background);
        let mut reserved = Vec::new();
        if c.background && c.every > 0 {
            model.owned_parts_into(&mut reserved)?;
        }
        Ok(Self {
            saver: saver.map_err(CkptError::from)?,
            root,
            reserved,
            committed,
        })
    }

    /// Saves checkpoint `req.step` of `model` (see [`Saver`]): copies
    /// this rank's parts of it ([`TrainModel::owned_parts`]) and writes
    /// them; a `crash-during-save` fault fires between this rank's write
    /// and the commit, a `corrupt-checkpoint` one after the commit.
    /// Collective over `world`; every rank returns the same outcome.
    ///
    /// # Errors
    /// The save's (or, in the background, the previous save's):
    /// [`CkptError::Checkpoint`] on the rank that saw the failure,
    /// [`CkptError::Collective`] on the others.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn save<M: TrainModel + ?Sized>(
        &mut self,
        world: &dyn Communicator,
        config: &Config,
        model: &M,
        req: SaveRequest<'_>,
        faults: &FaultPlan,
        observer: &mut dyn Observer,
    ) -> Result<(), TrainError> {
        // the previous save ends first: its buffers take this copy
        let previous = self.saver.wait();
        self.report(world.rank(), previous, observer)?;
        let t0 = Instant::now();
        let spent = self.saver.take_runs().into_iter().map(|r| OwnedPart {
            name: r.name,
            global_shape: r.global_shape,
            whole: r.start,
            values: r.values.try_into().unwrap_or_default(),
        });
        let mut parts: Vec<OwnedPart> = spent.collect();
        if parts.is_empty() {
            parts = std::mem::take(&mut self.reserved);
        }
        let opt_step = model.owned_parts_into(&mut parts)?;
        let runs = parts.into_iter().map(|p| OwnedRun {
            name: p.name,
            global_shape: p.global_shape,
            start: p.whole,
            values: p.values.into(),
        });
        let c = &config.checkpoint;
        let staged = Staged {
            step: req.step,
            runs: runs.collect(),
            name: saved_names(config, model.whole_layout()),
            mesh: req.mesh,
            state: trainer_state(config, req.step, opt_step, req.loss_scale, req.model),
            retention: Retention::new(c.keep_last, (c.keep_every > 0).then_some(c.keep_every)),
        };
        let copy_s = t0.elapsed().as_secs_f64();
        let faults = faults.for_save(req.step, world.rank());
        let rot = faults.corrupts();
        let run_dir = self.root.parent().unwrap_or(&self.root).to_owned();
        let dir = run_dir.clone();
        let hooks = SaveHooks {
            after_write: Box::new(move || faults.during(&run_dir)),
            after_commit: Box::new(move |ckpt| faults.after(&dir, ckpt)),
        };
        let saved = self.saver.save(world, staged, copy_s, hooks);
        self.report(world.rank(), saved, observer)?;
        if rot {
            // a drill's rotten checkpoint is there before the next step
            self.wait(world, observer)?;
        }
        Ok(())
    }

    /// Waits for the save in flight, if any, and reports it.
    ///
    /// # Errors
    /// The save's, as [`Saver::save`].
    pub(crate) fn wait(
        &mut self,
        world: &dyn Communicator,
        observer: &mut dyn Observer,
    ) -> Result<(), TrainError> {
        let saved = self.saver.wait();
        self.report(world.rank(), saved, observer)
    }

    /// Records a committed checkpoint (world rank 0 writes its line of
    /// `events.jsonl`) and reports it; names the folder of a failed one.
    fn report(
        &mut self,
        rank: usize,
        saved: Result<Option<Saved>, CollectiveError>,
        observer: &mut dyn Observer,
    ) -> Result<(), TrainError> {
        let saved = saved.map_err(|e| CkptError::from(e).rooted(&self.root))?;
        let Some(s) = saved else {
            return Ok(());
        };
        self.committed = s.step;
        let kind = EventKind::Checkpoint {
            step: s.step,
            background: s.background,
            stall_s: s.stall_s,
            waited_s: s.waited_s,
            write_s: s.write_s,
            bytes: s.bytes,
        };
        if rank == 0 {
            let run_dir = self.root.parent().unwrap_or(&self.root);
            let line = weft_supervise::events::stamped(kind.clone());
            weft_supervise::events::append_event(run_dir, &line)
                .map_err(crate::run::folder::io_err(run_dir))?;
        }
        observer.event(&HealthEvent::Run(kind));
        Ok(())
    }
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
    let names = saved_names(config, model.whole_layout());
    restore_with(world, root, config, &*names, &mut |opt_step, read| {
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
    saved_name: &dyn Fn(usize, &str) -> String,
    load: &mut dyn FnMut(u32, &mut ReadTensor<'_>) -> Result<(), String>,
) -> Result<Restored, CkptError> {
    let picked = collective::pick_latest(world, root, |manifest| {
        check_hash(root, config, manifest)?;
        check_branch(root, config, manifest)
    })
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
        Ok(ckpt.read_f32(&saved_name(which, name), out)?)
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

/// A WSD run's decay: its keys and the run's length.
fn decay_of(config: &Config) -> String {
    let o = &config.optim;
    format!(
        "{} over {} steps (fraction {}) to {} of the peak, of {} steps",
        o.decay_shape, o.decay_steps, o.decay_fraction, o.min_lr_ratio, config.train.steps
    )
}

/// Whether `config` may continue from checkpoint folder `dir` as a branch
/// (the check a resume makes, before a branch's folder is made).
///
/// # Errors
/// [`CkptError::Branch`]; the checkpoint's manifest cannot be read.
pub fn check_branch_from(dir: &Path, config: &Config) -> Result<(), CkptError> {
    let root = dir.parent().unwrap_or(dir);
    let manifest =
        weft_checkpoint::Manifest::read(dir).map_err(|source| CkptError::Checkpoint {
            root: root.to_owned(),
            source,
        })?;
    check_branch(root, config, &manifest)
}

/// Refuses to continue a checkpoint taken inside its WSD run's decay
/// with another decay: the learning rates it trained with would be
/// neither run's. A checkpoint of the stable phase branches into any.
fn check_branch(
    root: &Path,
    config: &Config,
    ckpt: &weft_checkpoint::Manifest,
) -> Result<(), CkptError> {
    let Some(saved) = ckpt.state.extra.get("wsd_decay") else {
        return Ok(());
    };
    let start = saved.get("start").and_then(serde_json::Value::as_u64);
    let decay = saved.get("decay").and_then(serde_json::Value::as_str);
    let (Some(start), Some(decay)) = (start, decay) else {
        return Ok(());
    };
    let step = ckpt.step;
    if step > start && decay != decay_of(config) {
        return Err(CkptError::Branch {
            root: root.to_owned(),
            step,
            reason: format!(
                "it was taken inside its run's decay ({decay}, from step {start}); another decay \
                 ({}) branches from a checkpoint of the stable phase, at step {start} or before",
                decay_of(config)
            ),
        });
    }
    Ok(())
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

/// Loads the parameters of the newest checkpoint under `root` that
/// verifies into `model` (one rank: the sampler's); returns its step.
///
/// # Errors
/// [`CkptError::Missing`] if there is none; [`CkptError::ConfigMismatch`] if
/// it belongs to another configuration; [`CkptError::Tensor`] if a tensor is
/// missing or mis-sized; [`CkptError::Checkpoint`] for I/O or corruption.
pub(crate) fn restore(root: &Path, config: &Config, model: &mut Gpt) -> Result<u64, CkptError> {
    let loaded = load_latest(root, VerifyLevel::Full).map_err(|source| CkptError::Checkpoint {
        root: root.to_owned(),
        source,
    })?;
    let ckpt = loaded
        .ok_or_else(|| CkptError::Missing(root.to_owned()))?
        .checkpoint;
    check_hash(root, config, ckpt.manifest())?;
    for spec in model.layout().specs().to_vec() {
        let out = &mut model.params[spec.range()];
        ckpt.read_f32(&spec.name, out)
            .map_err(|e| CkptError::Tensor {
                root: root.to_owned(),
                name: spec.name.clone(),
                reason: e.to_string(),
            })?;
    }
    Ok(ckpt.step())
}
