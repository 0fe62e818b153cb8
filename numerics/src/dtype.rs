//! Element types, their conversions and stochastic rounding.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};
use rand_core::Rng;

use crate::Error;

/// The floating-point formats weft computes and communicates in.
///
/// | dtype | bits | significand bits (p) | unit roundoff u = 2^-p | max finite |
/// |---|---|---|---|---|
/// | `F64` | 64 | 53 | 1.1e-16 | 1.8e308 |
/// | `F32` | 32 | 24 | 6.0e-8 | 3.4e38 |
/// | `F16` | 16 | 11 | 4.9e-4 | 65504 |
/// | `BF16` | 16 | 8 | 3.9e-3 | 3.4e38 |
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum Dtype {
    /// IEEE 754 binary64.
    F64,
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16 ("half").
    F16,
    /// bfloat16: binary32's exponent with an 8-bit significand.
    BF16,
}

impl Dtype {
    /// Every dtype, widest first.
    pub const ALL: [Dtype; 4] = [Dtype::F64, Dtype::F32, Dtype::F16, Dtype::BF16];

    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> usize {
        match self {
            Dtype::F64 => 8,
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
        }
    }

    /// Significand precision `p` in bits, counting the implicit leading bit.
    pub const fn precision(self) -> u32 {
        match self {
            Dtype::F64 => 53,
            Dtype::F32 => 24,
            Dtype::F16 => 11,
            Dtype::BF16 => 8,
        }
    }

    /// Unit roundoff `u = 2^-p`: the largest relative error of one
    /// round-to-nearest operation (for results in the normal range).
    pub fn unit_roundoff(self) -> f64 {
        (-f64::from(self.precision())).exp2()
    }

    /// The largest finite value.
    pub fn max_finite(self) -> f64 {
        match self {
            Dtype::F64 => f64::MAX,
            Dtype::F32 => f64::from(f32::MAX),
            Dtype::F16 => f16::MAX.to_f64(),
            Dtype::BF16 => bf16::MAX.to_f64(),
        }
    }

    /// The lower-case name used in configs and tables (`"f32"`, `"bf16"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F64 => "f64",
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::BF16 => "bf16",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = Error;

    /// Parses `f64`, `f32`, `f16`, `bf16` (also `float64`, `float32`,
    /// `float16`/`half`, `bfloat16`), case-insensitively.
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.to_ascii_lowercase().as_str() {
            "f64" | "float64" | "double" => Ok(Dtype::F64),
            "f32" | "float32" | "float" => Ok(Dtype::F32),
            "f16" | "float16" | "half" | "fp16" => Ok(Dtype::F16),
            "bf16" | "bfloat16" => Ok(Dtype::BF16),
            _ => Err(Error::UnknownDtype { name: s.to_owned() }),
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f64 {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A floating-point element type: `f64`, `f32`, [`f16`](struct@half::f16) or [`bf16`].
///
/// Arithmetic in a narrow type is defined as "compute in a wider type, round
/// once to nearest-even": `f16` and `bf16` operations go through `f32`, `f32`
/// operations through `f64` where it matters. Because the wider type has at
/// least `2p + 2` significand bits, the double rounding is innocuous and the
/// result is exactly the correctly rounded operation in the narrow type
/// (Figueroa, "When is double rounding innocuous?", 1995).
///
/// The trait is sealed: weft's reductions rely on the bit layouts of exactly
/// these four types.
pub trait Element:
    Copy + Default + PartialEq + PartialOrd + fmt::Debug + Send + Sync + 'static + sealed::Sealed
{
    /// The runtime tag of this type.
    const DTYPE: Dtype;
    /// Positive zero.
    const ZERO: Self;

    /// Exact widening to `f64` (every value of every element type is an `f64`).
    fn to_f64(self) -> f64;
    /// Conversion to `f32`: exact except for `f64`, which rounds to nearest-even.
    fn to_f32(self) -> f32;
    /// Round-to-nearest-even conversion from `f64`, rounding once (overflow
    /// gives ±infinity).
    fn from_f64(x: f64) -> Self;
    /// Round-to-nearest-even conversion from `f32` (overflow gives ±infinity).
    fn from_f32(x: f32) -> Self;
    /// Correctly rounded `self + other` in this type.
    fn add(self, other: Self) -> Self;
    /// Correctly rounded `self - other` in this type.
    fn sub(self, other: Self) -> Self;
    /// Absolute value.
    fn abs(self) -> Self;
    /// `false` for infinities and NaN.
    fn is_finite(self) -> bool;
}

impl Element for f64 {
    const DTYPE: Dtype = Dtype::F64;
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    #[allow(clippy::cast_possible_truncation)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        x
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f64::from(x)
    }
    #[inline(always)]
    fn add(self, other: Self) -> Self {
        self + other
    }
    #[inline(always)]
    fn sub(self, other: Self) -> Self {
        self - other
    }
    #[inline(always)]
    fn abs(self) -> Self {
        f64::abs(self)
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        f64::is_finite(self)
    }
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    #[allow(clippy::cast_possible_truncation)]
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn add(self, other: Self) -> Self {
        self + other
    }
    #[inline(always)]
    fn sub(self, other: Self) -> Self {
        self - other
    }
    #[inline(always)]
    fn abs(self) -> Self {
        f32::abs(self)
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        f32::is_finite(self)
    }
}

macro_rules! half_element {
    ($t:ty, $dtype:expr, $format:expr) => {
        impl Element for $t {
            const DTYPE: Dtype = $dtype;
            const ZERO: Self = <$t>::ZERO;
            #[inline(always)]
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
            #[inline(always)]
            fn to_f32(self) -> f32 {
                <$t>::to_f32(self)
            }
            #[inline(always)]
            fn from_f64(x: f64) -> Self {
                // Directly from f64's bits: going through f32 (as `half`'s
                // bf16 conversion does) would round twice.
                <$t>::from_bits($format.round_f64(x) as u16)
            }
            #[inline(always)]
            fn from_f32(x: f32) -> Self {
                <$t>::from_f32(x)
            }
            #[inline(always)]
            fn add(self, other: Self) -> Self {
                <$t>::from_f32(<$t>::to_f32(self) + <$t>::to_f32(other))
            }
            #[inline(always)]
            fn sub(self, other: Self) -> Self {
                <$t>::from_f32(<$t>::to_f32(self) - <$t>::to_f32(other))
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::from_bits(self.to_bits() & 0x7fff)
            }
            #[inline(always)]
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }
        }
    };
}

half_element!(f16, Dtype::F16, crate::round::F16);
half_element!(bf16, Dtype::BF16, crate::round::BF16);

/// Converts `src` into `dst` element by element with round-to-nearest-even.
///
/// # Errors
/// [`Error::LengthMismatch`] when the slices differ in length.
pub fn convert<S: Element, D: Element>(src: &[S], dst: &mut [D]) -> Result<(), Error> {
    if src.len() != dst.len() {
        return Err(Error::LengthMismatch {
            op: "convert",
            expected: src.len(),
            got: dst.len(),
        });
    }
    if S::DTYPE == Dtype::F64 {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = D::from_f64(s.to_f64());
        }
    } else {
        // Every f32, f16 and bf16 is an f32: rounding from f32 rounds once,
        // as from f64 would, and is 10-15x faster than the f64 route's
        // software rounding (f32 -> bf16, 16M elements).
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = D::from_f32(s.to_f32());
        }
    }
    Ok(())
}

/// A 16-bit target of stochastic rounding: [`f16`](struct@half::f16) or [`bf16`].
pub trait StochasticTarget: Element {
    /// Bits of the value, sign-magnitude.
    #[doc(hidden)]
    fn bits16(self) -> u16;
    /// The value with these bits.
    #[doc(hidden)]
    fn from_bits16(bits: u16) -> Self;
}

impl StochasticTarget for f16 {
    fn bits16(self) -> u16 {
        self.to_bits()
    }
    fn from_bits16(bits: u16) -> Self {
        f16::from_bits(bits)
    }
}

impl StochasticTarget for bf16 {
    fn bits16(self) -> u16 {
        self.to_bits()
    }
    fn from_bits16(bits: u16) -> Self {
        bf16::from_bits(bits)
    }
}

/// Rounds `x` to `T` (f16 or bf16) stochastically: to the neighbour above
/// `|x|` with probability equal to the distance from the neighbour below,
/// in units of their gap. The expected value of the result is therefore
/// exactly `x` (the rounding is unbiased), which is what keeps long
/// accumulations of small updates in low precision from stalling.
///
/// The probability is realised exactly: it is a dyadic rational of at most
/// 53 bits, compared against a 53-bit uniform draw from `rng` (one
/// `next_u64` per call, so a seeded `rng` makes the rounding reproducible).
///
/// Values exactly representable in `T`, zeros, infinities and NaN are
/// returned as round-to-nearest would (and draw nothing). A finite `x` beyond
/// `T`'s largest finite value rounds to nearest too (so to ±infinity past the
/// overflow threshold): there is no finite neighbour above it to choose.
pub fn stochastic_round<T: StochasticTarget, R: Rng + ?Sized>(x: f32, rng: &mut R) -> T {
    let nearest = T::from_f32(x);
    if !x.is_finite() || !nearest.is_finite() || nearest.to_f32() == x {
        return nearest;
    }
    let ax = f64::from(x.abs());
    // `down` is |x| rounded toward zero; `up` the next value away from zero.
    let nb = nearest.bits16() & 0x7fff;
    let down_bits = if nearest.abs().to_f64() > ax {
        nb - 1
    } else {
        nb
    };
    let down = T::from_bits16(down_bits).to_f64();
    let up_t = T::from_bits16(down_bits + 1);
    if !up_t.is_finite() {
        return nearest;
    }
    let up = up_t.to_f64();
    // Exact: ax, down and up are close dyadic rationals well within f64.
    let frac = (ax - down) / (up - down);
    let draw = (rng.next_u64() >> 11) as f64 * (-53f64).exp2();
    let mag = if draw < frac {
        down_bits + 1
    } else {
        down_bits
    };
    let sign = if x.is_sign_negative() { 0x8000 } else { 0 };
    T::from_bits16(mag | sign)
}

/// [`stochastic_round`] over a slice.
///
/// # Errors
/// [`Error::LengthMismatch`] when the slices differ in length.
pub fn stochastic_round_slice<T: StochasticTarget, R: Rng + ?Sized>(
    src: &[f32],
    dst: &mut [T],
    rng: &mut R,
) -> Result<(), Error> {
    if src.len() != dst.len() {
        return Err(Error::LengthMismatch {
            op: "stochastic_round_slice",
            expected: src.len(),
            got: dst.len(),
        });
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = stochastic_round(s, rng);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_core::SeedableRng;
    use rand_pcg::Pcg64;

    #[test]
    fn parse_and_display_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(d.name().parse::<Dtype>().unwrap(), d);
            assert_eq!(d.to_string(), d.name());
        }
        assert_eq!("BFloat16".parse::<Dtype>().unwrap(), Dtype::BF16);
        let err = "f8".parse::<Dtype>().unwrap_err();
        assert!(err.to_string().contains("f8"), "{err}");
    }

    #[test]
    fn unit_roundoff_matches_machine_epsilon() {
        assert_eq!(Dtype::F32.unit_roundoff(), f64::from(f32::EPSILON) / 2.0);
        assert_eq!(Dtype::F64.unit_roundoff(), f64::EPSILON / 2.0);
        assert_eq!(Dtype::F16.unit_roundoff(), f16::EPSILON.to_f64() / 2.0);
        assert_eq!(Dtype::BF16.unit_roundoff(), bf16::EPSILON.to_f64() / 2.0);
    }

    /// Round-to-nearest-even against its definition: no representable
    /// neighbour is closer, and ties go to the even significand.
    fn check_rne<T: StochasticTarget>(x: f64) {
        let r = T::from_f64(x);
        if !r.is_finite() {
            assert!(x.abs() >= T::DTYPE.max_finite(), "{x} rounded to {r:?}");
            return;
        }
        let b = r.bits16();
        let d = (r.to_f64() - x).abs();
        for nb in [b.wrapping_add(1), b.wrapping_sub(1)] {
            let n = T::from_bits16(nb);
            if n.is_finite() && (n.bits16() & 0x7fff) != 0x7fff {
                let dn = (n.to_f64() - x).abs();
                assert!(d <= dn, "{x}: {r:?} is farther than {n:?}");
                if d == dn && d != 0.0 {
                    assert_eq!(b & 1, 0, "{x}: tie not rounded to even");
                }
            }
        }
    }

    #[test]
    fn round_to_nearest_even_is_correct() {
        let mut rng = Pcg64::seed_from_u64(7);
        for _ in 0..20_000 {
            let bits = rng.next_u64();
            let mag =
                ((bits >> 40) as f64 / (1u64 << 24) as f64) * 2f64.powi((bits % 60) as i32 - 30);
            let x = if bits & 1 == 1 { -mag } else { mag };
            check_rne::<f16>(x);
            check_rne::<bf16>(x);
        }
        // Exact ties.
        assert_eq!(<f16 as Element>::from_f64(2049.0).to_f64(), 2048.0);
        assert_eq!(<f16 as Element>::from_f64(2051.0).to_f64(), 2052.0);
        // One rounding, not two: just above a bf16 tie, below an f32 one.
        let x = -0.422_851_592_302_322_4;
        assert_eq!(<bf16 as Element>::from_f64(x).to_f64(), -0.423_828_125);
        assert_eq!(<bf16 as Element>::from_f64(257.0).to_f64(), 256.0);
        assert_eq!(<bf16 as Element>::from_f64(259.0).to_f64(), 260.0);
    }

    #[test]
    fn convert_rounds_and_checks_lengths() {
        let src = [1.0f32, 2049.0, -0.1];
        let mut dst = [f16::ZERO; 3];
        convert(&src, &mut dst).unwrap();
        assert_eq!(dst[1].to_f32(), 2048.0);
        let mut short = [f16::ZERO; 2];
        assert!(matches!(
            convert(&src, &mut short),
            Err(Error::LengthMismatch {
                expected: 3,
                got: 2,
                ..
            })
        ));
    }

    /// The mean of many stochastic roundings is within 5 standard errors of
    /// the input, and each result is one of the two neighbours.
    fn check_unbiased<T: StochasticTarget>(x: f32, rng: &mut Pcg64) {
        let n = 40_000;
        let nearest = T::from_f32(x).to_f64();
        let mut sum = 0.0;
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for _ in 0..n {
            let r = stochastic_round::<T, _>(x, rng).to_f64();
            sum += r;
            lo = lo.min(r);
            hi = hi.max(r);
        }
        let mean = sum / f64::from(n);
        let gap = hi - lo;
        assert!(
            lo <= f64::from(x) && f64::from(x) <= hi,
            "{x}: range {lo}..{hi}"
        );
        assert!(gap <= (nearest.abs() * T::DTYPE.unit_roundoff() * 4.0).max(1e-7));
        // Bernoulli(p) with p(1-p) <= 1/4: standard error <= gap / (2 sqrt n).
        let se = gap / (2.0 * f64::from(n).sqrt());
        assert!(
            (mean - f64::from(x)).abs() <= 5.0 * se + 1e-300,
            "{x}: mean {mean} differs by {} (se {se})",
            mean - f64::from(x)
        );
    }

    #[test]
    fn stochastic_rounding_is_unbiased() {
        let mut rng = Pcg64::seed_from_u64(42);
        for &x in &[
            1.0001f32, -3.25159, 2049.0, 0.1, 1e-6, 6.0e-8, -70000.5, 1.5e30,
        ] {
            if x.abs() < 65504.0 {
                check_unbiased::<f16>(x, &mut rng);
            }
            check_unbiased::<bf16>(x, &mut rng);
        }
    }

    #[test]
    fn stochastic_rounding_keeps_representable_and_special_values() {
        let mut rng = Pcg64::seed_from_u64(1);
        for x in [0.0f32, -0.0, 1.0, -2048.0, f32::INFINITY, f32::NEG_INFINITY] {
            let r: f16 = stochastic_round(x, &mut rng);
            assert_eq!(r.to_f32().to_bits(), x.to_bits());
        }
        let r: bf16 = stochastic_round(f32::NAN, &mut rng);
        assert!(r.is_nan());
        // Past f16's range: round to nearest (overflow to infinity).
        let r: f16 = stochastic_round(1e6, &mut rng);
        assert!(r.is_infinite());
    }

    #[test]
    fn stochastic_rounding_is_reproducible_with_a_seed() {
        let src: Vec<f32> = (0..1000).map(|i| i as f32 * 0.001 + 0.0003).collect();
        let mut a = vec![bf16::ZERO; src.len()];
        let mut b = vec![bf16::ZERO; src.len()];
        stochastic_round_slice(&src, &mut a, &mut Pcg64::seed_from_u64(9)).unwrap();
        stochastic_round_slice(&src, &mut b, &mut Pcg64::seed_from_u64(9)).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn stochastic_rounding_stops_the_stall() {
        // Adding 1.0 to a bf16 accumulator stalls at 256 under
        // round-to-nearest; with stochastic rounding the sum keeps growing,
        // unbiased.
        let mut rng = Pcg64::seed_from_u64(3);
        let mut acc = bf16::ZERO;
        for _ in 0..4096 {
            acc = stochastic_round(acc.to_f32() + 1.0, &mut rng);
        }
        // The result is a martingale around 4096 with a standard deviation of
        // a few hundred (gaps of 16 near the end): allow 4 of them.
        let v = acc.to_f64();
        assert!((v - 4096.0).abs() < 1500.0, "{v}");
    }
}
