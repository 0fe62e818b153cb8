//! The fsdp crate's error type.

/// What went wrong sharding parameters or running the hooks.
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
    /// A hook was called out of order (a forward hook outside a
    /// micro-batch, parameters read before their gather, …).
    #[error("fsdp hooks out of order: {reason}")]
    Order {
        /// What was called when, with the unit.
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
        /// What FSDP was doing, e.g. `all_gather of unit h.3`.
        during: String,
        /// The communicator's error (boxed: it is large).
        source: Box<weft_collectives::Error>,
    },
    /// The optimizer or the norm over the layout failed.
    #[error(transparent)]
    Parallel(#[from] weft_parallel::Error),
    /// A kernel rejected its arguments.
    #[error(transparent)]
    Kernel(#[from] weft_kernels::Error),
    /// Exchanged bytes did not decode (e.g. an exact-sum state).
    #[error(transparent)]
    Numerics(#[from] weft_numerics::Error),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Wraps a collectives error with what FSDP was doing.
pub(crate) fn comm(during: impl Into<String>) -> impl FnOnce(weft_collectives::Error) -> Error {
    let during = during.into();
    move |source| Error::Collective {
        during,
        source: Box::new(source),
    }
}
