//! The fsdp crate's error type.

/// What went wrong planning or running a sharded training step.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting is invalid or inconsistent with the group or the model.
    #[error("invalid fsdp config: `{field}` {reason}")]
    Config {
        /// The setting, e.g. `dp` or `strategy`.
        field: &'static str,
        /// What is wrong with it, with the numbers.
        reason: String,
    },
    /// A micro-batch does not fit the model or the planned activations.
    #[error("batch: {reason}")]
    Batch {
        /// What is wrong, with the numbers.
        reason: String,
    },
    /// A state buffer handed in (e.g. to restore a checkpoint) has the wrong size.
    #[error("{what}: expected {expected} elements, got {got}")]
    StateShape {
        /// Which buffer.
        what: String,
        /// Elements required.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// A collective failed (peer lost, timeout, mismatch, ...).
    #[error("collective during {during}: {source}")]
    Collective {
        /// What the runner was doing, e.g. `all_gather of unit h.3`.
        during: String,
        /// The communicator's error (boxed: it is large).
        source: Box<weft_collectives::Error>,
    },
    /// The model rejected its arguments.
    #[error(transparent)]
    Model(#[from] weft_model::Error),
    /// A kernel rejected its arguments.
    #[error(transparent)]
    Kernel(#[from] weft_kernels::Error),
    /// Exchanged bytes did not decode (e.g. an exact-sum state).
    #[error(transparent)]
    Numerics(#[from] weft_numerics::Error),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Wraps a collectives error with what the runner was doing.
pub(crate) fn comm(during: impl Into<String>) -> impl FnOnce(weft_collectives::Error) -> Error {
    let during = during.into();
    move |source| Error::Collective {
        during,
        source: Box::new(source),
    }
}
