//! The model crate's error type.

use std::path::PathBuf;

/// What went wrong building, running, loading or saving a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A kernel rejected its arguments.
    #[error(transparent)]
    Kernel(#[from] weft_kernels::Error),
    /// Loading a tensor of a saved state failed.
    #[error("loading `{tensor}`: {source}")]
    Load {
        /// The tensor.
        tensor: String,
        /// Why.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A configuration value is invalid.
    #[error("invalid config: `{field}` {reason}")]
    Config {
        /// The field, e.g. `n_head`.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A model folder or file is malformed.
    #[error("{path}: {reason}")]
    Format {
        /// The offending file.
        path: PathBuf,
        /// What was expected and found, with a hint.
        reason: String,
    },
    /// A tensor the configuration requires is absent from the weights file.
    #[error(
        "{path}: missing tensor `{tensor}` (looked for it with and without the `transformer.` prefix)"
    )]
    MissingTensor {
        /// The weights file.
        path: PathBuf,
        /// The Hugging Face name.
        tensor: String,
    },
    /// A tensor has the wrong shape for the configuration.
    #[error("{path}: tensor `{tensor}` has shape {got:?}, expected {expected:?} from config.json")]
    TensorShape {
        /// The weights file.
        path: PathBuf,
        /// The tensor's name as stored.
        tensor: String,
        /// Shape implied by the configuration.
        expected: Vec<usize>,
        /// Shape found.
        got: Vec<usize>,
    },
    /// A tensor holds a dtype weft cannot read (or a tensor weft does not
    /// know, which suggests a config/weights mismatch).
    #[error("{path}: tensor `{tensor}`: {reason}")]
    Tensor {
        /// The weights file.
        path: PathBuf,
        /// The tensor's name as stored.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// A layout, placement or placement-driven operation failed (the
    /// optimizer over a layout, gathering or sharding a model).
    #[error(transparent)]
    Parallel(#[from] weft_parallel::Error),
    /// Fully sharded data parallelism failed (a collective, a hook out of
    /// order).
    #[error("fsdp: {0}")]
    Fsdp(#[from] weft_fsdp::Error),
    /// A pipeline schedule is invalid or does not fit.
    #[error("pipeline schedule: {0}")]
    Schedule(#[from] weft_pipeline::Error),
    /// The pipeline executor failed (names the stage, step and action).
    #[error("pipeline: {0}")]
    Pipeline(#[from] weft_pipeline::ExecError),
    /// A collective failed (timeout, lost peer, mismatch).
    #[error("communication: {0}")]
    Comm(#[from] weft_collectives::Error),
    /// A degree, a shape or a buffer does not split over the
    /// tensor-parallel group.
    #[error("tensor parallelism: {what}: {reason}")]
    Split {
        /// What was checked, e.g. `n_head` or `sequence parallelism`.
        what: &'static str,
        /// What is wrong, with the numbers.
        reason: String,
    },
    /// A batch does not fit the model or the planned activations.
    #[error("batch: {reason}")]
    Batch {
        /// What is wrong, with the numbers.
        reason: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}
