//! Precision-safe arithmetic: reductions that do not drift.
//!
//! Summing many small values into a large low-precision accumulator stops
//! growing once the accumulator's spacing exceeds twice the addend: adding
//! 1.0 repeatedly in f16 stalls at 2048, because 2048 + 1 is a tie that
//! rounds back to 2048. The error is not noise — every lost addend errs in
//! the same direction — and bias compounds where variance averages out. This
//! crate makes such bias impossible where it is used, and measurable where
//! it is not.
//!
//! # Overview
//! * [`Dtype`] and [`Element`]: `f64`, `f32`, [`half::f16`](struct@half::f16), [`half::bf16`];
//!   round-to-nearest-even [`convert`]sion and unbiased
//!   [`stochastic_round`]ing driven by a caller's seeded RNG.
//! * Summation strategies, each with its documented error bound (see
//!   [`Strategy`]): [`sum_naive`] in any accumulator dtype (to reproduce the
//!   failure), [`sum_kahan`] and [`sum_neumaier`] (compensated),
//!   [`sum_pairwise`] (blocked, SIMD).
//! * [`ExactSum`]: a superaccumulator that adds with no rounding at all,
//!   merges partial sums exactly, and rounds once, correctly, at the end. Its
//!   result is bitwise independent of order and partitioning — the basis of
//!   reproducible all-reduce in `weft-collectives`.
//! * [`DynamicLossScaler`] (the fp16 recipe) and a vectorized
//!   [`count_nonfinite`].
//! * [`measure`]: bias, spread and worst error of a strategy on a workload,
//!   against [`ExactSum`] — how a user checks a reduction path for bias.
//!
//! # Example
//! ```
//! use half::f16;
//! use weft_numerics::{Dtype, ExactSum, Strategy};
//!
//! let ones = vec![f16::ONE; 10_000];
//! assert_eq!(Strategy::Naive(Dtype::F16).sum(&ones), 2048.0); // stalled
//! assert_eq!(Strategy::Naive(Dtype::F32).sum(&ones), 10_000.0); // wide accumulator
//!
//! // Exact, and independent of how the work was split.
//! let xs: Vec<f32> = (0..1000).map(|i| (i as f32).sin() * 1e-3).collect();
//! let mut whole = ExactSum::new();
//! whole.add_slice(&xs);
//! let mut a = ExactSum::new();
//! a.add_slice(&xs[..300]);
//! let mut b = ExactSum::new();
//! b.add_slice(&xs[300..]);
//! b.merge(&a);
//! assert_eq!(b.to_f32().to_bits(), whole.to_f32().to_bits());
//! ```
//!
//! Run `cargo run -p weft-numerics --example drift` for the whole story in a
//! table, and `cargo bench -p weft-numerics` for throughput.
//!
//! # Crate features
//! * `serde`: [`Dtype`] (de)serializes by its lowercase name (`"f32"`,
//!   `"bf16"`, ...), so configuration files can name a dtype.
//!
//! SIMD code paths are chosen at run time ([`simd::level`]).

#![deny(missing_docs)]

mod drift;
mod dtype;
mod exact;
mod round;
mod scaler;
pub mod simd;
mod sum;

pub use drift::{DriftReport, measure};
pub use dtype::{
    Dtype, Element, StochasticTarget, convert, stochastic_round, stochastic_round_slice,
};
pub use exact::ExactSum;
pub use half::{bf16, f16};
pub use scaler::{
    DynamicLossScaler, LossScalerConfig, LossScalerState, StepDecision, count_nonfinite,
};
pub use sum::{Strategy, sum_kahan, sum_naive, sum_neumaier, sum_pairwise};

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Two slices that must have the same length do not.
    #[error("{op}: length mismatch: expected {expected} elements, got {got}")]
    LengthMismatch {
        /// The operation that was called.
        op: &'static str,
        /// The length required.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// A dtype name that is not one of `f64`, `f32`, `f16`, `bf16`.
    #[error("unknown dtype {name:?}: expected one of f64, f32, f16, bf16")]
    UnknownDtype {
        /// The name given.
        name: String,
    },
    /// A setting outside its valid range.
    #[error("invalid {field} = {value}: expected {expected}")]
    InvalidConfig {
        /// The setting.
        field: &'static str,
        /// Its value, as given.
        value: String,
        /// What would have been valid.
        expected: &'static str,
    },
    /// Bytes that do not decode to the expected value.
    #[error("cannot decode {what}: {reason}")]
    Decode {
        /// What was being decoded.
        what: &'static str,
        /// What is wrong with the bytes.
        reason: String,
    },
}
