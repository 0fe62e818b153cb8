//! Saving and restoring the training state with `weft-checkpoint`.
//!
//! A checkpoint holds every parameter under its Hugging Face GPT-2 name
//! (so `weft ckpt export --hf` can turn it into a `transformers` folder),
//! the AdamW moments under `optimizer.exp_avg.<name>` and
//! `optimizer.exp_avg_sq.<name>`, and in its trainer state the optimizer
//! step and a hash of the configuration. Data batches are pure functions of
//! the step, so the step is the whole data-loader position: a resumed run
//! continues bit for bit.

use std::path::{Path, PathBuf};

use weft_checkpoint::{
    AsyncSaver, Dtype, Layout, Region, Retention, SaveOptions, ShardData, TrainerState,
    VerifyLevel, load_latest,
};
use weft_model::{AdamWState, Gpt};

use crate::config::Config;

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

/// A hash of the configuration that defines the run's computation, as 16
/// hex digits: everything except `[run]`, `[checkpoint]`, the layout in
/// `[parallel]` (but not `parallel.reproducible`), and the settings
/// that only decide how long to go on and what to watch (`train.steps`,
/// `train.eval_every`, `train.eval_sequences`, `train.spike_*`), so a run
/// can be resumed to train longer. (Changing `train.steps` changes the
/// learning-rate schedule from the resume point on: the run is then no
/// longer the uninterrupted run of either length.)
pub fn config_hash(config: &Config) -> String {
    let mut c = config.clone();
    c.run = Default::default();
    c.checkpoint = Default::default();
    // The layout over ranks does not define the computation (with
    // reproducible reductions not even its rounding): a run may resume on
    // another layout.
    c.parallel = crate::config::ParallelConfig {
        reproducible: config.parallel.reproducible,
        ..Default::default()
    };
    let d = crate::config::TrainConfig::default();
    c.train.steps = d.steps;
    c.train.eval_every = d.eval_every;
    c.train.eval_sequences = d.eval_sequences;
    c.train.spike_factor = d.spike_factor;
    c.train.spike_window = d.spike_window;
    format!(
        "{:016x}",
        xxhash_rust::xxh3::xxh3_64(c.to_toml().as_bytes())
    )
}

/// Every tensor of a checkpoint: the parameters under their HF names and
/// the AdamW moments, with shapes and little-endian bytes.
fn tensors(model: &Gpt, opt: &AdamWState) -> (Vec<String>, Vec<Vec<u64>>, Vec<Vec<u8>>) {
    let specs = model.layout().specs();
    let mut names = Vec::with_capacity(3 * specs.len());
    let mut shapes = Vec::with_capacity(3 * specs.len());
    let mut bytes = Vec::with_capacity(3 * specs.len());
    for spec in specs {
        let r = spec.range();
        let shape: Vec<u64> = spec.shape.iter().map(|&d| d as u64).collect();
        for (prefix, buf) in [
            ("", &model.params),
            ("optimizer.exp_avg.", &opt.m),
            ("optimizer.exp_avg_sq.", &opt.v),
        ] {
            names.push(format!("{prefix}{}", spec.name));
            shapes.push(shape.clone());
            bytes.push(le_bytes(&buf[r.clone()]));
        }
    }
    (names, shapes, bytes)
}

/// The whole-tensor shards of [`tensors`]' output.
fn shard_data<'a>(
    names: &'a [String],
    shapes: &'a [Vec<u64>],
    bytes: &'a [Vec<u8>],
) -> Vec<ShardData<'a>> {
    names
        .iter()
        .zip(shapes)
        .zip(bytes)
        .map(|((name, shape), data)| ShardData {
            name,
            dtype: Dtype::F32,
            global_shape: shape,
            region: Region::full(shape),
            data,
        })
        .collect()
}

fn le_bytes(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Saves checkpoints in the background, one at a time.
pub struct Saver {
    root: PathBuf,
    inner: AsyncSaver,
    hash: String,
}

impl Saver {
    /// A saver writing under `root` with the configured retention.
    ///
    /// # Errors
    /// [`CkptError::Checkpoint`] if the background writer cannot start.
    pub fn new(root: &Path, config: &Config) -> Result<Self, CkptError> {
        let err = |source| CkptError::Checkpoint {
            root: root.to_owned(),
            source,
        };
        let every = (config.checkpoint.keep_every > 0).then_some(config.checkpoint.keep_every);
        let inner = AsyncSaver::new(root, SaveOptions::default())
            .map_err(err)?
            .with_retention(Retention::new(config.checkpoint.keep_last, every));
        Ok(Self {
            root: root.to_owned(),
            inner,
            hash: config_hash(config),
        })
    }

    /// Copies the state after `step` optimizer steps and starts writing it;
    /// waits first for the previous save, whose failure is returned here.
    ///
    /// # Errors
    /// [`CkptError::Checkpoint`] if the previous save failed or this one
    /// could not start.
    pub fn save(&mut self, step: u64, model: &Gpt, opt: &AdamWState) -> Result<(), CkptError> {
        let (names, shapes, bytes) = tensors(model, opt);
        let shards = shard_data(&names, &shapes, &bytes);
        let mut state = TrainerState {
            optimizer_step: step,
            config_hash: Some(self.hash.clone()),
            ..Default::default()
        };
        state.data_position = Some(serde_json::json!({ "step": step }));
        state
            .extra
            .insert("adamw_t".into(), serde_json::json!(opt.step));
        let c = model.config();
        state.extra.insert(
            "model".into(),
            serde_json::json!({
                "n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd,
                "vocab_size": c.vocab_size, "block_size": c.block_size,
                "layer_norm_epsilon": c.layer_norm_epsilon,
            }),
        );
        let previous = self
            .inner
            .save_from(step, &Layout::flat("dp", 1), &[shards], &state);
        match previous {
            Some(Err(source)) => Err(CkptError::Checkpoint {
                root: self.root.clone(),
                source,
            }),
            _ => Ok(()),
        }
    }

    /// Maps the host buffers that saving `model` and `opt` will copy into,
    /// once at start-up, so that even the first save's copy inside the
    /// training step does not take a page fault every 4 KiB (measured on
    /// GPT-2 small: the first save's stall falls from about 45% of a step
    /// to a few percent).
    ///
    /// # Errors
    /// [`CkptError::Checkpoint`] if a save in flight failed.
    pub fn reserve(&mut self, model: &Gpt, opt: &AdamWState) -> Result<(), CkptError> {
        let (names, shapes, bytes) = tensors(model, opt);
        let shards = shard_data(&names, &shapes, &bytes);
        match self.inner.reserve(&[shards]) {
            Some(Err(source)) => Err(CkptError::Checkpoint {
                root: self.root.clone(),
                source,
            }),
            _ => Ok(()),
        }
    }

    /// Waits for the save in flight.
    ///
    /// # Errors
    /// [`CkptError::Checkpoint`] if it failed.
    pub fn finish(&mut self) -> Result<(), CkptError> {
        match self.inner.wait() {
            Some(Err(source)) => Err(CkptError::Checkpoint {
                root: self.root.clone(),
                source,
            }),
            _ => Ok(()),
        }
    }
}

/// What [`restore`] found.
#[derive(Debug)]
pub struct Restored {
    /// Optimizer steps already taken.
    pub step: u64,
    /// Newer checkpoints that did not verify and were skipped, with why.
    pub skipped: Vec<String>,
}

/// Loads the newest checkpoint under `root` that verifies into `model` and
/// `opt`.
///
/// # Errors
/// [`CkptError::Missing`] if there is none; [`CkptError::ConfigMismatch`] if
/// it belongs to another configuration; [`CkptError::Tensor`] if a tensor is
/// missing or mis-sized; [`CkptError::Checkpoint`] for I/O or corruption.
pub fn restore(
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
    let current = config_hash(config);
    if let Some(saved) = &state.config_hash
        && *saved != current
    {
        return Err(CkptError::ConfigMismatch {
            root: root.to_owned(),
            saved: saved.clone(),
            current,
        });
    }
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
    })
}
