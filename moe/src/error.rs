//! The crate's error type.

/// What went wrong routing tokens or running a mixture-of-experts block.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A buffer's length does not match the dimensions passed with it.
    #[error("{op}: `{buffer}` has {got} elements, expected {expected}")]
    ShapeMismatch {
        /// The operation, e.g. `route`.
        op: &'static str,
        /// The argument, e.g. `logits`.
        buffer: &'static str,
        /// Elements implied by the dimensions.
        expected: usize,
        /// Elements passed.
        got: usize,
    },
    /// A configuration value is invalid.
    #[error("invalid moe config: `{field}` {reason}")]
    Config {
        /// The field, e.g. `top_k`.
        field: &'static str,
        /// What is wrong, with the numbers.
        reason: String,
    },
    /// The operation does not support this router (e.g. the expert block
    /// with expert-choice routing, whose tokens get a variable number of
    /// experts).
    #[error("{op}: router `{router}` is not supported: {reason}")]
    Unsupported {
        /// The operation.
        op: &'static str,
        /// The router's name.
        router: String,
        /// Why.
        reason: String,
    },
    /// A kernel rejected its arguments.
    #[error(transparent)]
    Kernel(#[from] weft_kernels::Error),
    /// A collective failed during expert-parallel dispatch or combine.
    #[error("expert parallelism: {0}")]
    Comm(#[from] weft_collectives::Error),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Checks that `buf` holds `expected` elements.
pub(crate) fn check<T>(
    op: &'static str,
    buffer: &'static str,
    buf: &[T],
    expected: usize,
) -> Result<()> {
    if buf.len() == expected {
        Ok(())
    } else {
        Err(Error::ShapeMismatch {
            op,
            buffer,
            expected,
            got: buf.len(),
        })
    }
}
