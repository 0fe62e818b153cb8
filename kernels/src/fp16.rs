//! fp16 operands for [`Precision::F16`](crate::Precision::F16): values
//! rounded to the nearest IEEE half (ties to even, subnormals kept,
//! overflow to infinity), then multiplied by the f32 GEMM.
//!
//! No CPU of this project's kind multiplies fp16 natively (AVX512-FP16 is
//! a few Intel server parts' only), so the fp16 products are the f32
//! products of rounded copies: the same bits as the f32 kernels run on
//! operands rounded beforehand, which is the arithmetic of fp16 tensor
//! cores with f32 accumulation. The rounding is one pass of
//! `vcvtps2ph`/`vcvtph2ps` (AVX-512, else F16C, else `half`'s scalar
//! conversion) per operand per call.

use std::cell::Cell;

use rayon::prelude::*;
use weft_numerics::f16;

use crate::Real;
use crate::gemm::View;
use crate::held::Held;

/// `x` rounded to the nearest fp16 value (ties to even; subnormals kept;
/// beyond fp16's largest finite value, 65504, infinity), as an `f64`.
/// `half`'s `f16::from_f64` is not used: it rounds through the upper bits
/// only, like its bf16 conversion.
pub(crate) fn round_f64(x: f64) -> f64 {
    // fp16 keeps 11 significant bits; below its normal range (2⁻¹⁴) its
    // spacing is fixed at 2⁻²⁴.
    round_to_format(x, 11, -14, 65504.0)
}

/// `x` rounded to the nearest value (ties to even) of a binary format
/// with `bits` significant bits, smallest normal exponent `min_exp`
/// (fixed spacing below it: subnormals) and largest finite value `max`
/// (beyond which infinity), as an `f64`: the reference the 16-bit
/// products' conversions are checked against.
pub(crate) fn round_to_format(x: f64, bits: i32, min_exp: i32, max: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let e = ((x.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    let ulp = 2f64.powi(e.max(min_exp) - (bits - 1));
    let r = (x / ulp).round_ties_even() * ulp;
    if r.abs() > max {
        r.signum() * f64::INFINITY
    } else {
        r
    }
}

/// `d = s` with every value rounded to the nearest fp16 (and widened back
/// to f32, exactly), over the pool for large buffers.
pub(crate) fn round_f32(d: &mut [f32], s: &[f32]) {
    const CHUNK: usize = 1 << 16;
    assert_eq!(d.len(), s.len(), "round_f32: lengths differ");
    d.par_chunks_mut(CHUNK)
        .zip(s.par_chunks(CHUNK))
        .for_each(|(d, s)| round_chunk(d, s));
}

/// One chunk of [`round_f32`], on the widest conversion the CPU has (and
/// [`weft_numerics::simd::level`] allows).
fn round_chunk(d: &mut [f32], s: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use weft_numerics::simd::{Level, level};
        match level() {
            Level::Avx512 => {
                // SAFETY: the level says the CPU has AVX-512 F.
                unsafe { x86::round_avx512(d, s) };
                return;
            }
            Level::Avx2 if std::arch::is_x86_feature_detected!("f16c") => {
                // SAFETY: the CPU has AVX and F16C (checked).
                unsafe { x86::round_f16c(d, s) };
                return;
            }
            _ => {}
        }
    }
    round_scalar(d, s);
}

/// [`round_chunk`] a value at a time (`half`'s conversion).
fn round_scalar(d: &mut [f32], s: &[f32]) {
    for (d, &x) in d.iter_mut().zip(s) {
        *d = f16::from_f32(x).to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT, _mm256_cvtph_ps, _mm256_cvtps_ph,
        _mm256_loadu_ps, _mm256_storeu_ps, _mm512_cvtph_ps, _mm512_cvtps_ph, _mm512_loadu_ps,
        _mm512_storeu_ps,
    };

    /// Round to nearest even, no exceptions.
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

    /// # Safety
    /// The CPU must have AVX-512 F; `d` and `s` have the same length.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn round_avx512(d: &mut [f32], s: &[f32]) {
        let n = s.len().min(d.len());
        let body = n - n % 16;
        for i in (0..body).step_by(16) {
            // SAFETY: 16 values at `i < body <= n` of both slices.
            unsafe {
                let x = _mm512_loadu_ps(s.as_ptr().add(i));
                let h = _mm512_cvtps_ph::<NEAREST>(x);
                _mm512_storeu_ps(d.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
            }
        }
        super::round_scalar(&mut d[body..n], &s[body..n]);
    }

    /// # Safety
    /// The CPU must have AVX and F16C; `d` and `s` have the same length.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn round_f16c(d: &mut [f32], s: &[f32]) {
        let n = s.len().min(d.len());
        let body = n - n % 8;
        for i in (0..body).step_by(8) {
            // SAFETY: 8 values at `i < body <= n` of both slices.
            unsafe {
                let x = _mm256_loadu_ps(s.as_ptr().add(i));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
                _mm256_storeu_ps(d.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
        super::round_scalar(&mut d[body..n], &s[body..n]);
    }
}

thread_local! {
    /// Rounded copies of f32 operands, kept for the thread's next product
    /// (taken out while in use, so a product the pool runs inside another
    /// on the same thread allocates its own).
    static COPIES: Cell<[Held<f32>; 2]> = const { Cell::new([Held::new(), Held::new()]) };
}

/// The number of elements a view of `rows × cols` spans in its slice.
fn span<T>(v: View<'_, T>, rows: usize, cols: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * v.rs + (cols - 1) * v.cs + 1
    }
}

/// Runs `f` on `a (ar × ac)` and `b (br × bc)` rounded to fp16: copies of
/// the parts of their slices they span, with the same strides (one pass
/// each; f32 copies are reused from call to call on a thread).
pub(crate) fn with_rounded<T: Real, R>(
    a: (View<'_, T>, usize, usize),
    b: (View<'_, T>, usize, usize),
    f: impl FnOnce(View<'_, T>, View<'_, T>) -> R,
) -> R {
    let (la, lb) = (span(a.0, a.1, a.2), span(b.0, b.1, b.2));
    if let (Some(sa), Some(sb)) = (T::as_f32(&a.0.data[..la]), T::as_f32(&b.0.data[..lb])) {
        let [mut ca, mut cb] = COPIES.take();
        let r = {
            let ra = ca.sized(la);
            round_f32(ra, sa);
            let rb = cb.sized(lb);
            round_f32(rb, sb);
            let (ra, rb) = (T::from_f32_slice(ra), T::from_f32_slice(rb));
            let (Some(ra), Some(rb)) = (ra, rb) else {
                unreachable!("f32 buffers are f32");
            };
            f(
                View {
                    data: ra,
                    rs: a.0.rs,
                    cs: a.0.cs,
                },
                View {
                    data: rb,
                    rs: b.0.rs,
                    cs: b.0.cs,
                },
            )
        };
        COPIES.set([ca, cb]);
        return r;
    }
    let round = |v: View<'_, T>, len: usize| -> Vec<T> {
        v.data[..len]
            .iter()
            .map(|x| T::from_f64(round_f64(x.to_f64())))
            .collect()
    };
    let (ra, rb) = (round(a.0, la), round(b.0, lb));
    f(
        View {
            data: &ra,
            rs: a.0.rs,
            cs: a.0.cs,
        },
        View {
            data: &rb,
            rs: b.0.rs,
            cs: b.0.cs,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 values across fp16's whole range and beyond: normals,
    /// subnormals, the ties between neighbours, overflow, specials.
    fn samples() -> Vec<f32> {
        let mut v = vec![
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            65504.0,
            65519.99,
            65520.0,
            -65520.0,
            1e9,
            6.1035156e-5, // smallest normal
            5.9604645e-8, // smallest subnormal
            2.9802322e-8, // half of it: ties to zero (even)
            2.9802326e-8, // just above: rounds up
            1e-10,
            f32::MIN_POSITIVE,
        ];
        // every fp16 value and the midpoints to its neighbours
        for bits in 0u16..0x7c00 {
            let x = f16::from_bits(bits).to_f32();
            let next = f16::from_bits(bits + 1).to_f32();
            let mid = (x + next) / 2.0;
            for y in [x, mid, mid.next_up(), mid.next_down()] {
                v.push(y);
                v.push(-y);
            }
        }
        // and pseudo-random f32 bit patterns
        let mut s = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..100_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            v.push(f32::from_bits((s >> 32) as u32));
        }
        v
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn every_conversion_rounds_to_nearest_even_like_the_f64_reference() {
        let s = samples();
        let mut d = vec![0f32; s.len()];
        round_f32(&mut d, &s);
        let mut scalar = vec![0f32; s.len()];
        round_scalar(&mut scalar, &s);
        for ((&x, &r), &sc) in s.iter().zip(&d).zip(&scalar) {
            let want = round_f64(f64::from(x)) as f32;
            assert!(same(r, want), "{x:e}: vector {r:e}, reference {want:e}");
            assert!(same(sc, want), "{x:e}: half {sc:e}, reference {want:e}");
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("f16c") {
            let mut f = vec![0f32; s.len()];
            // SAFETY: the CPU has F16C (and so AVX), checked above.
            unsafe { x86::round_f16c(&mut f, &s) };
            assert!(f.iter().zip(&d).all(|(&a, &b)| same(a, b)));
        }
    }

    #[test]
    fn the_reference_rounds_at_fp16_s_boundaries() {
        assert_eq!(round_f64(1.0 + 2f64.powi(-11)), 1.0); // tie to even
        assert_eq!(round_f64(1.0 + 3.0 * 2f64.powi(-11)), 1.0 + 2f64.powi(-9));
        assert_eq!(round_f64(65504.0), 65504.0);
        assert_eq!(round_f64(65519.0), 65504.0);
        assert_eq!(round_f64(65520.0), f64::INFINITY);
        assert_eq!(round_f64(2f64.powi(-25)), 0.0); // tie to zero
        assert_eq!(round_f64(1.5 * 2f64.powi(-24)), 2f64.powi(-23)); // tie to even
        assert_eq!(round_f64(-3e-8), -2f64.powi(-24));
    }

    #[test]
    fn rounded_views_keep_their_strides() {
        let a: Vec<f32> = (0..12).map(|i| 1.0 + i as f32 * 1e-4).collect();
        let b: Vec<f64> = (0..6).map(|i| 1.0 + f64::from(i) * 1e-4).collect();
        with_rounded((View::t(&a, 4), 4, 3), (View::rows(&a, 4), 3, 4), |x, y| {
            assert_eq!((x.rs, x.cs, y.rs, y.cs), (1, 4, 4, 1));
            for (r, &o) in x.data.iter().zip(&a) {
                assert_eq!(f64::from(*r), round_f64(f64::from(o)));
            }
        });
        with_rounded(
            (View::rows(&b, 3), 2, 3),
            (View::rows(&b, 2), 3, 2),
            |x, _| {
                assert_eq!(x.data, b.iter().map(|&v| round_f64(v)).collect::<Vec<_>>());
            },
        );
    }
}
