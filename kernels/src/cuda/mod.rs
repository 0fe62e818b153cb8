//! The CUDA backend (feature `cuda`): the same ops as the CPU kernels, on
//! device buffers, through cudarc.
//!
//! # Overview
//!
//! - [`Gpu`] — one device: its context and stream, the kernels compiled for
//!   it (NVRTC, once per process and architecture) and a cuBLAS handle.
//!   [`Gpu::new`] checks first that the driver, NVRTC and cuBLAS can be
//!   loaded and returns [`Unavailable`](crate::Error::Unavailable) naming what is missing:
//!   cudarc's own initializers *panic* when a library is absent.
//! - [`DeviceParams`] — the parameters (or their gradients, or a moment) in
//!   one device allocation with the host layout's names and ranges, plus an
//!   optional bf16 copy for the products; [`GpuAdamW`] updates it in one
//!   launch.
//! - The ops mirror the CPU ones (same names, arguments, shapes and
//!   `+=` conventions, with `&Gpu` first and device buffers in place of
//!   slices): [`encoder_forward`]/[`encoder_backward`],
//!   [`layernorm_forward`]/[`layernorm_backward`], [`gelu_forward`]/
//!   [`gelu_backward`], [`residual_forward`]/[`residual_backward`],
//!   [`attention_forward`]/[`attention_backward`] (flash-style: tiled, an
//!   online softmax, one saved statistic per row instead of the `(T, T)`
//!   probabilities), [`fused_classifier_forward`]/
//!   [`fused_classifier_backward`], the linear layers
//!   ([`matmul_forward`], [`matmul_forward_wt`] and their backward halves:
//!   cuBLAS in [`Mode::Throughput`](crate::Mode), a fixed-order kernel in
//!   [`Mode::BatchInvariant`](crate::Mode)), [`adamw_update`], and the
//!   step's checks: [`count_nonfinite`], [`exact_sum`],
//!   [`exact_sum_squares`] (the exact gradient norm) and
//!   [`exact_sum_columns`] (the reproducible mode's sum over ranks).
//! - [`Source`] lists the kernel sources (`kernels/cuda/*.cu`, compiled in
//!   with `include_str!`) and [`compile`] compiles one with NVRTC for any
//!   architecture — on a machine with no GPU too, which is how CI checks
//!   every source for `sm_80` and `sm_90`.
//!
//! # Agreement with the CPU kernels
//!
//! The CPU kernels are the reference (llm.c's dev/cuda method): every GPU
//! op is tested against its CPU twin (`kernels/tests/cuda.rs`). Where the
//! GPU runs the same operations in the same order — GELU and its backward,
//! the residual add, the embedding (forward and backward: rows grouped by
//! id on the host and added in row order), AdamW, the classifier's backward
//! given the same statistics, every exact sum — the sources are compiled
//! with `--fmad=false` and port the CPU's `exp` polynomial, and the results
//! are the CPU's bit for bit. Where the order differs (row sums of
//! layernorm and the classifier, attention's tiles, GEMMs) they agree to
//! the f32 rounding of the sums; each test names its bound.
//!
//! Libraries: cudarc is built for CUDA 13.0 (`cuda-13000`) with dynamic
//! loading, so it needs at run time a driver of CUDA 13.0 or newer
//! (R580+), `libnvrtc.so.13` and `libcublas.so.13` (the
//! `nvidia-cuda-nvrtc` and `nvidia-cublas` wheels, or a CUDA 13 toolkit)
//! on the library path; nothing at build time.
//!
//! Without the `cuda` feature only [`device_count`] and [`available`] are
//! here (returning [`NotCompiled`](crate::Error::NotCompiled)); the
//! items named above exist with the feature.
// The overview links to the feature's items.
#![cfg_attr(not(feature = "cuda"), allow(rustdoc::broken_intra_doc_links))]

#[cfg(not(feature = "cuda"))]
use crate::error::Error;
use crate::error::Result;

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod exact;
#[cfg(feature = "cuda")]
mod gemm;
#[cfg(feature = "cuda")]
mod nvrtc;
#[cfg(feature = "cuda")]
mod ops;
#[cfg(feature = "cuda")]
mod params;

#[cfg(feature = "cuda")]
pub use cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice,
};
#[cfg(feature = "cuda")]
pub use device::{Gpu, Libraries, libraries};
#[cfg(feature = "cuda")]
pub use exact::{count_nonfinite, exact_sum, exact_sum_columns, exact_sum_squares};
#[cfg(feature = "cuda")]
pub use gemm::{
    matmul_backward_input, matmul_backward_weight, matmul_backward_wt_input,
    matmul_backward_wt_weight, matmul_forward, matmul_forward_wt,
};
#[cfg(feature = "cuda")]
pub use nvrtc::{Source, Target, compile, nvrtc_version};
#[cfg(feature = "cuda")]
pub use ops::{
    accumulate, adamw_update, attention_backward, attention_forward, bias_backward,
    encoder_backward, encoder_forward, fused_classifier_backward, fused_classifier_forward,
    gelu_backward, gelu_forward, layernorm_backward, layernorm_backward_input,
    layernorm_backward_weight, layernorm_forward, residual_backward, residual_forward,
    round_to_bf16, scale, zero,
};
#[cfg(feature = "cuda")]
pub use params::{DeviceParams, GpuAdamW, TensorSpec};

/// Number of CUDA devices this build can use.
///
/// # Errors
/// Without the `cuda` feature: [`NotCompiled`](crate::Error::NotCompiled). With it:
/// [`Unavailable`](crate::Error::Unavailable) when the driver library cannot be loaded or sees
/// no device (never a panic).
pub fn device_count() -> Result<usize> {
    #[cfg(feature = "cuda")]
    {
        device::device_count()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::NotCompiled {
            what: "CUDA".into(),
            feature: "cuda",
        })
    }
}

/// Checks that everything the GPU ops need can be loaded — the driver,
/// NVRTC and cuBLAS — and that a device is present; returns the number of
/// devices. What [`Gpu::new`] checks before it touches cudarc.
///
/// # Errors
/// [`NotCompiled`](crate::Error::NotCompiled) without the `cuda` feature;
/// [`Unavailable`](crate::Error::Unavailable) naming the first missing library, or "no device".
pub fn available() -> Result<usize> {
    #[cfg(feature = "cuda")]
    {
        device::available()
    }
    #[cfg(not(feature = "cuda"))]
    {
        device_count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(feature = "cuda")]
    use crate::error::Error;

    /// On a machine without a GPU (CI) both entry points return a typed
    /// error naming CUDA and what is missing; with one, they count it.
    #[test]
    fn reports_unavailability_instead_of_panicking() {
        match device_count() {
            Ok(n) => assert!(n > 0),
            Err(e) => {
                assert!(
                    matches!(e, Error::NotCompiled { .. } | Error::Unavailable { .. }),
                    "{e:?}"
                );
                assert!(e.to_string().contains("CUDA"), "{e}");
            }
        }
        match available() {
            Ok(n) => assert!(n > 0),
            Err(e) => assert!(
                matches!(e, Error::NotCompiled { .. } | Error::Unavailable { .. }),
                "{e:?}"
            ),
        }
        #[cfg(not(feature = "cuda"))]
        assert_eq!(
            device_count().unwrap_err().to_string(),
            "CUDA needs weft-kernels built with the `cuda` feature"
        );
    }
}
