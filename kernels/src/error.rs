//! The kernels' error type.

/// What went wrong in a kernel call. Kernels check every buffer length
/// against the dimensions they were given before touching memory, so a
/// wrong shape is reported here instead of panicking or reading garbage.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A buffer's length does not match the dimensions passed with it.
    #[error("{op}: buffer `{buffer}` has {got} elements, expected {expected}")]
    ShapeMismatch {
        /// The kernel, e.g. `matmul_forward`.
        op: &'static str,
        /// The argument name, e.g. `weight`.
        buffer: &'static str,
        /// Elements implied by the dimensions.
        expected: usize,
        /// Elements actually passed.
        got: usize,
    },
    /// A token id is not below the vocabulary size.
    #[error(
        "{op}: token id {token} at flat position {position} is out of range for vocabulary size {vocab_size}"
    )]
    TokenOutOfRange {
        /// The kernel.
        op: &'static str,
        /// Index into the (B*T) token array.
        position: usize,
        /// The offending id.
        token: u32,
        /// The vocabulary size it must be below.
        vocab_size: usize,
    },
    /// A dimension or hyper-parameter is invalid (e.g. channels not
    /// divisible by heads, a sequence longer than the position table).
    #[error("{op}: {reason}")]
    InvalidArgument {
        /// The kernel.
        op: &'static str,
        /// What was wrong, with the values involved.
        reason: String,
    },
    /// A setting out of its range.
    #[error("{field}: {reason}")]
    Config {
        /// The setting (`lr`, `beta1`, ...).
        field: &'static str,
        /// Why, with the value.
        reason: String,
    },
    /// The requested device needs a feature this build was compiled without.
    #[error("{what} needs weft-kernels built with the `{feature}` feature")]
    NotCompiled {
        /// What was asked for, e.g. "CUDA device 0".
        what: String,
        /// The cargo feature that provides it.
        feature: &'static str,
    },
    /// The device exists in this build but is not usable here.
    #[error("{what} is not available: {reason}")]
    Unavailable {
        /// What was asked for.
        what: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// A call into CUDA (the driver, cuBLAS) failed on a device that is
    /// present.
    #[error("{op}: CUDA error: {message}")]
    Cuda {
        /// The kernel or call, e.g. `layernorm_forward`.
        op: &'static str,
        /// The library's error, as it reports it.
        message: String,
    },
    /// NVRTC rejected a kernel source (a bug in the source, or a compiler
    /// too old for the target).
    #[error("NVRTC could not compile {file} for {arch}: {log}")]
    Compile {
        /// The kernel source, e.g. `attention.cu`.
        file: String,
        /// The target, e.g. `sm_90`.
        arch: String,
        /// The compiler's log.
        log: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Checks that `buf` holds exactly `expected` elements.
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
