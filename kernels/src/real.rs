//! The element types the kernels run on: `f32` for training, `f64` for
//! gradient checks against finite differences.

use std::fmt::Debug;
use std::iter::Sum;
use std::ops::{Add, AddAssign, Div, DivAssign, Mul, MulAssign, Neg, Sub, SubAssign};

pub(crate) mod sealed {
    /// What only this crate sees of a [`Real`](super::Real): the buffers
    /// as `f32`, for kernels with an `f32`-only fast path (the bf16
    /// products).
    pub trait Sealed: Sized {
        /// `s` as `f32`s, when `Self` is `f32`.
        fn as_f32(s: &[Self]) -> Option<&[f32]>;
        /// `s` as `f32`s, when `Self` is `f32`.
        fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]>;
        /// `s` as `Self`s, when `Self` is `f32`.
        fn from_f32_slice(s: &[f32]) -> Option<&[Self]>;
    }
    impl Sealed for f32 {
        fn as_f32(s: &[f32]) -> Option<&[f32]> {
            Some(s)
        }
        fn as_f32_mut(s: &mut [f32]) -> Option<&mut [f32]> {
            Some(s)
        }
        fn from_f32_slice(s: &[f32]) -> Option<&[f32]> {
            Some(s)
        }
    }
    impl Sealed for f64 {
        fn as_f32(_: &[f64]) -> Option<&[f32]> {
            None
        }
        fn as_f32_mut(_: &mut [f64]) -> Option<&mut [f32]> {
            None
        }
        fn from_f32_slice(_: &[f32]) -> Option<&[f64]> {
            None
        }
    }
}

/// A real floating-point element type: `f32` or `f64` (sealed).
///
/// Every kernel is generic over it. Training runs in `f32`; the `f64`
/// instantiation of the very same code is what the gradient checks compare
/// against central finite differences, which are only meaningful with the
/// extra precision.
pub trait Real:
    sealed::Sealed
    + Copy
    + Send
    + Sync
    + Debug
    + Default
    + PartialOrd
    + 'static
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
    + DivAssign
    + Sum
{
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// Negative infinity.
    const NEG_INFINITY: Self;
    /// Converts from `f64` (rounding to nearest for `f32`).
    fn from_f64(x: f64) -> Self;
    /// Widens to `f64`.
    fn to_f64(self) -> f64;
    /// `e^x`. For `f32` a branch-free polynomial that vectorises (within
    /// 2 ulp of the correctly rounded value for x in [-87, 88]; saturates
    /// outside that range, so `exp(-inf)` is about 1.6e-38, never NaN).
    fn exp(self) -> Self;
    /// Hyperbolic tangent. For `f32` a branch-free vectorisable version
    /// (polynomial near 0, `1 - 2/(e^{2x}+1)` elsewhere).
    fn tanh(self) -> Self;
    /// Square root.
    fn sqrt(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// The larger of two values (the other one if `self` is NaN).
    fn max(self, other: Self) -> Self;
}

impl Real for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f64::NEG_INFINITY;
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        x
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn exp(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn tanh(self) -> Self {
        f64::tanh(self)
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    #[inline(always)]
    fn ln(self) -> Self {
        f64::ln(self)
    }
    #[inline(always)]
    fn max(self, other: Self) -> Self {
        f64::max(self, other)
    }
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f32::NEG_INFINITY;
    #[inline(always)]
    #[allow(clippy::cast_possible_truncation)]
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    #[inline(always)]
    fn exp(self) -> Self {
        exp_f32(self)
    }
    #[inline(always)]
    fn tanh(self) -> Self {
        tanh_f32(self)
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    #[inline(always)]
    fn ln(self) -> Self {
        f32::ln(self)
    }
    #[inline(always)]
    fn max(self, other: Self) -> Self {
        if self > other || other.is_nan() {
            self
        } else {
            other
        }
    }
}

/// `e^x` in `f32` without branches or library calls, so loops over it
/// vectorise: Cody–Waite range reduction `x = n ln2 + r`, a degree-6
/// polynomial for `e^r` (Cephes `expf` coefficients), and `2^n` built from
/// its exponent bits.
#[inline(always)]
#[allow(clippy::cast_possible_wrap, clippy::cast_sign_loss)]
#[allow(clippy::excessive_precision)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let z = x * LOG2E + MAGIC;
    let n = z - MAGIC;
    let ni = z.to_bits() as i32 - MAGIC.to_bits() as i32;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5.000_000_1e-1;
    let y = p * r * r + r + 1.0;
    let scale = f32::from_bits(((ni + 127) << 23) as u32);
    y * scale
}

/// `tanh(x)` in `f32`, branch-free: Cephes `tanhf`'s odd polynomial for
/// `|x| < 0.625`, `1 - 2/(e^{2|x|}+1)` with the sign restored elsewhere.
#[inline(always)]
#[allow(clippy::excessive_precision)]
pub fn tanh_f32(x: f32) -> f32 {
    let ax = x.abs();
    let z = x * x;
    let small =
        ((((-5.704_988_7e-3 * z + 2.063_908_9e-2) * z - 5.373_971_6e-2) * z + 1.333_144_2e-1) * z
            - 3.333_328_2e-1)
            * z
            * x
            + x;
    let e = exp_f32(2.0 * ax.min(44.0));
    let large = (1.0 - 2.0 / (e + 1.0)).copysign(x);
    if ax < 0.625 { small } else { large }
}

/// Sums a slice with 16 independent accumulators (vectorises; also a
/// little more accurate than one running sum). The order depends only on
/// the length, never on where the slice sits in memory.
#[inline(always)]
pub(crate) fn sum_lanes<T: Real>(x: &[T]) -> T {
    let mut acc = [T::ZERO; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..16 {
            acc[i] += c[i];
        }
    }
    let mut s = T::ZERO;
    for &r in rest {
        s += r;
    }
    let mut w = 16;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            acc[i] += acc[i + w];
        }
    }
    acc[0] + s
}

/// Dot product with 16 independent accumulators.
#[inline(always)]
pub(crate) fn dot_lanes<T: Real>(a: &[T], b: &[T]) -> T {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [T::ZERO; 16];
    let ca = a.chunks_exact(16);
    let cb = b.chunks_exact(16);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = T::ZERO;
    for (&x, &y) in ra.iter().zip(rb) {
        s += x * y;
    }
    let mut w = 16;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            acc[i] += acc[i + w];
        }
    }
    acc[0] + s
}

/// Maximum with 16 lanes.
#[inline(always)]
pub(crate) fn max_lanes<T: Real>(x: &[T]) -> T {
    let mut acc = [T::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..16 {
            acc[i] = if c[i] > acc[i] { c[i] } else { acc[i] };
        }
    }
    let mut m = T::NEG_INFINITY;
    for &r in rest {
        m = if r > m { r } else { m };
    }
    for a in acc {
        m = if a > m { a } else { m };
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulp_diff(a: f32, b: f32) -> i64 {
        (i64::from(a.to_bits() as i32) - i64::from(b.to_bits() as i32)).abs()
    }

    #[test]
    fn exp_f32_within_two_ulp_of_f64_exp() {
        let mut worst = 0;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (f64::from(x)).exp() as f32;
            worst = worst.max(ulp_diff(exp_f32(x), want));
            x += 0.0137;
        }
        assert!(worst <= 2, "worst ulp error {worst}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(f32::NEG_INFINITY) < 1e-37);
        assert!(exp_f32(f32::NEG_INFINITY) >= 0.0);
    }

    #[test]
    fn tanh_f32_close_to_f64_tanh() {
        let mut worst = 0.0f64;
        let mut x = -20.0f32;
        while x < 20.0 {
            let want = f64::from(x).tanh();
            let got = f64::from(tanh_f32(x));
            worst = worst.max((got - want).abs() / want.abs().max(1e-30));
            x += 0.00731;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(tanh_f32(0.0), 0.0);
        assert_eq!(tanh_f32(100.0), 1.0);
        assert_eq!(tanh_f32(-100.0), -1.0);
    }

    #[test]
    fn lane_reductions_match_naive() {
        let x: Vec<f64> = (0..37).map(|i| f64::from(i) * 0.5 - 3.0).collect();
        let y: Vec<f64> = (0..37).map(|i| f64::from(i % 5) - 1.0).collect();
        assert_eq!(sum_lanes(&x), x.iter().sum::<f64>());
        assert_eq!(max_lanes(&x), 15.0);
        let d: f64 = x.iter().zip(&y).map(|(a, b)| a * b).sum();
        assert!((dot_lanes(&x, &y) - d).abs() < 1e-12);
    }
}
