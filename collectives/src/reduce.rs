//! Elementwise reduction kernels on dtype-tagged bytes.
//!
//! Every addition is computed in f32 (f64 for f64 data) and rounded once to
//! the destination dtype: accumulation is never narrower than f32, whatever
//! the wire dtype.

use std::borrow::Cow;

use weft_numerics::{Dtype, Element, bf16, f16};

use crate::types::ReduceOp;

/// Views bytes as elements; copies when the bytes are misaligned (never the
/// case for buffers that came from typed slices).
pub(crate) fn typed<T: Element>(b: &[u8]) -> Cow<'_, [T]> {
    let size = size_of::<T>();
    debug_assert_eq!(b.len() % size, 0);
    if (b.as_ptr() as usize).is_multiple_of(align_of::<T>()) {
        // SAFETY: aligned, length a multiple of size_of::<T>(), and every bit
        // pattern is a valid element (sealed plain-old-data types).
        Cow::Borrowed(unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<T>(), b.len() / size) })
    } else {
        let mut v = vec![T::ZERO; b.len() / size];
        // SAFETY: `v` owns exactly `b.len()` bytes; plain old data.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), v.as_mut_ptr().cast::<u8>(), b.len()) };
        Cow::Owned(v)
    }
}

/// Runs `f` on the bytes viewed as mutable elements (copying through an
/// aligned temporary when misaligned).
pub(crate) fn with_typed_mut<T: Element>(b: &mut [u8], f: impl FnOnce(&mut [T])) {
    let size = size_of::<T>();
    if (b.as_mut_ptr() as usize).is_multiple_of(align_of::<T>()) {
        // SAFETY: aligned, exclusive, plain old data.
        let xs =
            unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast::<T>(), b.len() / size) };
        f(xs);
    } else {
        let mut v: Vec<T> = typed::<T>(b).into_owned();
        f(&mut v);
        // SAFETY: `v` holds exactly `b.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr().cast::<u8>(), b.as_mut_ptr(), b.len()) };
    }
}

/// `dst[i] = dst[i] ⊕ src[i]` for `Sum`/`Avg` (the division by n happens in
/// [`finish_avg`]), `Max`, `Min`.
pub(crate) fn reduce_into(dtype: Dtype, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    debug_assert_eq!(dst.len(), src.len());
    match dtype {
        Dtype::F32 => {
            let s = typed::<f32>(src);
            with_typed_mut::<f32>(dst, |d| kernel_f32(op, d, &s));
        }
        Dtype::F64 => {
            let s = typed::<f64>(src);
            with_typed_mut::<f64>(dst, |d| kernel_f64(op, d, &s));
        }
        Dtype::F16 => {
            let s = typed::<f16>(src);
            with_typed_mut::<f16>(dst, |d| kernel_half(op, d, &s));
        }
        Dtype::BF16 => {
            let s = typed::<bf16>(src);
            with_typed_mut::<bf16>(dst, |d| kernel_half(op, d, &s));
        }
    }
}

fn kernel_f32(op: ReduceOp, d: &mut [f32], s: &[f32]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            for (a, b) in d.iter_mut().zip(s) {
                *a += *b;
            }
        }
        ReduceOp::Max => {
            for (a, b) in d.iter_mut().zip(s) {
                *a = max_nan(*a, *b);
            }
        }
        ReduceOp::Min => {
            for (a, b) in d.iter_mut().zip(s) {
                *a = min_nan(*a, *b);
            }
        }
    }
}

fn kernel_f64(op: ReduceOp, d: &mut [f64], s: &[f64]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            for (a, b) in d.iter_mut().zip(s) {
                *a += *b;
            }
        }
        ReduceOp::Max => {
            for (a, b) in d.iter_mut().zip(s) {
                *a = if b.is_nan() || *b > *a { *b } else { *a };
            }
        }
        ReduceOp::Min => {
            for (a, b) in d.iter_mut().zip(s) {
                *a = if b.is_nan() || *b < *a { *b } else { *a };
            }
        }
    }
}

#[inline(always)]
fn max_nan(a: f32, b: f32) -> f32 {
    if b.is_nan() || b > a { b } else { a }
}

#[inline(always)]
fn min_nan(a: f32, b: f32) -> f32 {
    if b.is_nan() || b < a { b } else { a }
}

/// 16-bit types: widen to f32 (exact), combine in f32, round once.
fn kernel_half<H: Element>(op: ReduceOp, d: &mut [H], s: &[H]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            for (a, b) in d.iter_mut().zip(s) {
                *a = H::from_f32(a.to_f32() + b.to_f32());
            }
        }
        ReduceOp::Max => {
            for (a, b) in d.iter_mut().zip(s) {
                *a = H::from_f32(max_nan(a.to_f32(), b.to_f32()));
            }
        }
        ReduceOp::Min => {
            for (a, b) in d.iter_mut().zip(s) {
                *a = H::from_f32(min_nan(a.to_f32(), b.to_f32()));
            }
        }
    }
}

/// Divides every element by `n`, correctly rounded: f64 data in f64, the
/// others in f32 (IEEE division is correctly rounded, and rounding an f32
/// quotient to f16/bf16 is innocuous: 24 ≥ 2·11 + 2).
pub(crate) fn finish_avg(dtype: Dtype, buf: &mut [u8], n: usize) {
    fn go<T: Element>(b: &mut [u8], n: f32) {
        with_typed_mut::<T>(b, |xs| {
            for x in xs {
                *x = T::from_f32(x.to_f32() / n);
            }
        });
    }
    match dtype {
        Dtype::F32 => with_typed_mut::<f32>(buf, |xs| {
            let d = n as f32;
            for x in xs {
                *x /= d;
            }
        }),
        Dtype::F64 => with_typed_mut::<f64>(buf, |xs| {
            let d = n as f64;
            for x in xs {
                *x /= d;
            }
        }),
        Dtype::F16 => go::<f16>(buf, n as f32),
        Dtype::BF16 => go::<bf16>(buf, n as f32),
    }
}

/// Converts elements between dtypes (round to nearest-even; exact when widening).
pub(crate) fn convert(from: Dtype, src: &[u8], to: Dtype, dst: &mut [u8]) {
    fn go<S: Element, D: Element>(src: &[u8], dst: &mut [u8]) {
        let s = typed::<S>(src);
        with_typed_mut::<D>(dst, |d| {
            if S::DTYPE == Dtype::F64 {
                for (o, i) in d.iter_mut().zip(s.iter()) {
                    *o = D::from_f64(i.to_f64());
                }
            } else {
                // Every f32, f16 and bf16 is an f32, so rounding from f32
                // rounds once, as from f64 would, 10-15x faster (the f64
                // route is a software rounding per element).
                for (o, i) in d.iter_mut().zip(s.iter()) {
                    *o = D::from_f32(i.to_f32());
                }
            }
        });
    }
    macro_rules! dispatch_to {
        ($s:ty) => {
            match to {
                Dtype::F32 => go::<$s, f32>(src, dst),
                Dtype::F64 => go::<$s, f64>(src, dst),
                Dtype::F16 => go::<$s, f16>(src, dst),
                Dtype::BF16 => go::<$s, bf16>(src, dst),
            }
        };
    }
    match from {
        Dtype::F32 => dispatch_to!(f32),
        Dtype::F64 => dispatch_to!(f64),
        Dtype::F16 => dispatch_to!(f16),
        Dtype::BF16 => dispatch_to!(bf16),
    }
}

/// Allocates an 8-byte-aligned zeroed byte buffer of `len` bytes: a `Vec<u64>`
/// viewed as bytes, so that any element type can be read from it in place.
pub(crate) struct AlignedBuf {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBuf {
    pub(crate) fn zeroed(len: usize) -> Self {
        Self {
            words: vec![0u64; len.div_ceil(8)],
            len,
        }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the Vec<u64> owns at least `len` initialised bytes; u8 has
        // no alignment requirement.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: as above, shared.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_of<T: Element>(xs: &mut [T]) -> &mut [u8] {
        crate::types::BufMut::new(xs).into_bytes()
    }

    #[test]
    fn bf16_sum_rounds_once_from_f32() {
        let mut a = [bf16::from_f32(256.0)];
        let mut b = [bf16::from_f32(1.0)];
        let bb = bytes_of(&mut b).to_vec();
        reduce_into(Dtype::BF16, ReduceOp::Sum, bytes_of(&mut a), &bb);
        // 257 is not a bf16; nearest-even is 256.
        assert_eq!(a[0].to_f32(), 256.0);
    }

    /// The f32 route of `convert` gives the f64 route's bits (NaN stays NaN).
    #[test]
    fn narrowing_from_f32_rounds_like_from_f64() {
        let mut bits: Vec<u32> = vec![
            0,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0x7f80_0001,
            1,
            0x0080_0000,
            0x477f_f000,
            0x477f_efff,
            0x3f80_8000,
            0x3f81_8000,
            0x3880_0000,
            0x3300_0000,
        ];
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        bits.extend((0..200_000).map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 32) as u32
        }));
        let xs: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let mut src = xs.clone();
        let src_bytes = bytes_of(&mut src).to_vec();
        let mut b = vec![bf16::ZERO; xs.len()];
        convert(Dtype::F32, &src_bytes, Dtype::BF16, bytes_of(&mut b));
        let mut h = vec![f16::ZERO; xs.len()];
        convert(Dtype::F32, &src_bytes, Dtype::F16, bytes_of(&mut h));
        for (i, &x) in xs.iter().enumerate() {
            let (wb, wh) = (
                <bf16 as Element>::from_f64(f64::from(x)),
                <f16 as Element>::from_f64(f64::from(x)),
            );
            if x.is_nan() {
                assert!(b[i].is_nan() && h[i].is_nan(), "{x}");
            } else {
                assert_eq!(
                    b[i].to_bits(),
                    wb.to_bits(),
                    "bf16 of {x:e} ({:#x})",
                    x.to_bits()
                );
                assert_eq!(
                    h[i].to_bits(),
                    wh.to_bits(),
                    "f16 of {x:e} ({:#x})",
                    x.to_bits()
                );
            }
        }
    }

    #[test]
    fn max_propagates_nan() {
        let mut a = [1.0f32, f32::NAN];
        let mut b = [f32::NAN, 2.0];
        let bb = bytes_of(&mut b).to_vec();
        reduce_into(Dtype::F32, ReduceOp::Max, bytes_of(&mut a), &bb);
        assert!(a[0].is_nan() && a[1].is_nan());
    }

    #[test]
    fn misaligned_views_still_reduce() {
        let mut raw = [0u8; 9];
        raw[1..5].copy_from_slice(&1.5f32.to_ne_bytes());
        let src = 2.0f32.to_ne_bytes();
        reduce_into(Dtype::F32, ReduceOp::Sum, &mut raw[1..5], &src);
        assert_eq!(f32::from_ne_bytes(raw[1..5].try_into().unwrap()), 3.5);
    }
}
