//! The crate's error type.

/// What went wrong in a placement-driven operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A collective failed (timeout, lost peer, mismatch).
    #[error("communication: {0}")]
    Comm(#[from] weft_collectives::Error),
    /// A kernel rejected its arguments (the AdamW update).
    #[error("kernel: {0}")]
    Kernel(#[from] weft_kernels::Error),
    /// The parallel degrees do not fit each other, the world or the model.
    #[error("parallel.{field}: {reason}")]
    Dims {
        /// The degree, as named in a job's `[parallel]` section.
        field: &'static str,
        /// What does not fit, with the numbers.
        reason: String,
    },
    /// A job's global batch does not split over the layout.
    #[error("train.{field}: {reason}")]
    Batch {
        /// The size, as named in a job's `[train]` section (`batch_size`,
        /// `micro_batch_size`).
        field: &'static str,
        /// What does not fit, with the numbers.
        reason: String,
    },
    /// A layout, a placement or a buffer does not fit.
    #[error("{what}: {reason}")]
    Layout {
        /// The tensor or buffer concerned.
        what: String,
        /// What is wrong, with the numbers.
        reason: String,
    },
    /// A peer sent an exact sum or a header that does not decode.
    #[error("from rank {rank}: {reason}")]
    Corrupt {
        /// The sender (rank of the group).
        rank: usize,
        /// What could not be decoded.
        reason: String,
    },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn layout_err(what: impl Into<String>, reason: impl Into<String>) -> Error {
    Error::Layout {
        what: what.into(),
        reason: reason.into(),
    }
}
