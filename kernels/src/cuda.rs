//! The CUDA backend's place. This build has no GPU kernels yet (they come
//! in a later issue); with or without the `cuda` feature every entry point
//! here returns a typed error, so callers can match on availability today.

use crate::error::{Error, Result};

/// Number of CUDA devices this build can use.
///
/// # Errors
/// Without the `cuda` feature: [`Error::NotCompiled`]. With it (no kernels
/// yet): [`Error::Unavailable`].
pub fn device_count() -> Result<usize> {
    #[cfg(feature = "cuda")]
    {
        Err(Error::Unavailable {
            what: "CUDA".into(),
            reason: "weft-kernels has no GPU kernels yet; the CPU kernels are used".into(),
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::NotCompiled {
            what: "CUDA".into(),
            feature: "cuda",
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn reports_unavailability_instead_of_panicking() {
        let err = super::device_count().unwrap_err();
        assert!(err.to_string().contains("CUDA"), "{err}");
    }
}
