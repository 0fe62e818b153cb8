//! Fused kernels of the reproducible mode: a rank's own contribution is
//! merged straight from its native values into the partial sum it receives
//! (no encoding of its own buffer first), and the last merge rounds block by
//! block into the output (no encoded result is ever written out). Blocks
//! live in L1-sized scratch between the steps of one block.

use weft_numerics::{Dtype, Element, multiversion};

use super::{
    BLOCK, BlockRef, F_NEGZERO, HEADER, WMAX, bitlen64, corrupt, decode_block, encode_f32_fast,
    encode_general, encoded_capacity, get_i64, load_big, magic, magnitude, merge_block, put_header,
    read_block, round_mag, scan_f32,
};
use crate::error::Result;

/// f32 bit patterns of a block of at most [`BLOCK`] values (exact widening
/// for f16 and bf16; only called for those and f32).
#[inline(always)]
fn f32_bits<T: Element>(ys: &[T]) -> [u32; BLOCK] {
    std::array::from_fn(|i| ys.get(i).map_or(0, |y| y.to_f32().to_bits()))
}

/// The f32 bit patterns of a block of at most [`BLOCK`] values: f32
/// values are read where they are (no copy, which the vector loads that
/// follow would read back from a store buffer), others are widened into
/// `buf`.
#[inline(always)]
fn bits_of<'a, T: Element>(ys: &'a [T], buf: &'a mut [u32; BLOCK]) -> &'a [u32] {
    if T::DTYPE == Dtype::F32 {
        // SAFETY: `T` is f32 (`Element` is sealed: DTYPE F32 is f32 only),
        // of the size, alignment and bits of a u32.
        unsafe { std::slice::from_raw_parts(ys.as_ptr().cast::<u32>(), ys.len()) }
    } else {
        *buf = f32_bits(ys);
        &buf[..ys.len()]
    }
}

/// Appends the exact encoding of one block (the f32 fast path when it
/// applies, else the general encoder).
#[inline(always)]
pub(super) fn encode_block<T: Element>(xs: &[T], out: &mut Vec<u8>) {
    if T::DTYPE != Dtype::F64 {
        let mut buf = [0u32; BLOCK];
        if encode_f32_fast(bits_of(xs, &mut buf), out) {
            return;
        }
    }
    encode_general(xs, out);
}

/// How a two-word block `x` and a block of f32 values `y` add in i64
/// lanes: the common exponent `e`, the left shift of `x`'s integers, and
/// the magic constant that converts `y` at exponent `e`.
struct Plan {
    e: i32,
    sa: u32,
    m: f64,
    mb: i64,
    /// Some `y` lie 2^51 or more above 2^e (values spanning more than 27
    /// binades): converted by integer shifts instead of the magic
    /// constant.
    wide: bool,
}

/// `Some` when `x` is a two-word block without flags and every `y` is
/// finite, a multiple of 2^e below 2^(e+62) (below 2^(e+51) the magic
/// conversion is exact, above it integer shifts are used) and `x`'s
/// integers shifted to `e` stay below 2^62 (so the sum fits two words). A −0.0 in `y` is a plain zero here: `x` carries no
/// "only −0.0" flags, so the sum cannot be −0.0.
#[inline(always)]
fn plan(x: &BlockRef<'_>, ybits: &[u32]) -> Option<Plan> {
    if x.flags.is_some() || x.w != 2 {
        return None;
    }
    let (emax, emin, _) = scan_f32(ybits);
    if emax == 0xff {
        return None;
    }
    let (e, wide) = if emin == 0x100 {
        (x.e, false)
    } else {
        let e = x.e.min(emin as i32 - 150);
        // largest |y| < 2^(max(E,1) − 150 + 24): below 2^(e+51) for the
        // magic constant, below 2^(e+62) for the shifts
        let top = emax.max(1) as i32 - 150 + 24;
        if top > e + 62 {
            return None;
        }
        (e, top > e + 51)
    };
    if !(-1000..=900).contains(&e) {
        return None;
    }
    let sa = (x.e - e) as u32;
    if x.bits + sa > 62 {
        return None;
    }
    let (m, mb) = magic(e);
    Some(Plan { e, sa, m, mb, wide })
}

/// Rounds `v·2^e` (|v| < 2^63) once to `T` (narrower than f64; `e` in
/// −1022..=900): |v| is rounded to odd at bit 11 when it is 2^53 or more,
/// which keeps 42 to 53 bits, so the conversion to f64 is exact and the one
/// rounding to `T` correct (Boldo & Melquiond).
#[inline(always)]
pub(super) fn round_lane<T: Element>(v: i64, scale: f64) -> T {
    let a = v.unsigned_abs();
    let odd = (a & !0x7ff) | (u64::from(a & 0x7ff != 0) << 11);
    let a = if a >> 53 != 0 { odd } else { a };
    let f = a as f64 * scale;
    T::from_f64(if v < 0 { -f } else { f })
}

/// Whether a two-word block at exponent `e` rounds by [`round_lane`].
#[inline(always)]
fn lanes_round<T: Element>(e: i32) -> bool {
    T::DTYPE != Dtype::F64 && (-1022..=900).contains(&e)
}

/// `dst[i] = (src[i] << sa) + y[i] / 2^e` for every lane; returns the OR
/// of the results' magnitudes. `src` and `dst` may be the same memory.
///
/// # Safety
/// `src` and `dst` must be valid for `ybits.len()` unaligned i64 reads
/// and writes respectively.
#[inline(always)]
unsafe fn lanes(src: *const i64, dst: *mut i64, ybits: &[u32], p: &Plan) -> u64 {
    if p.wide {
        // SAFETY: the caller's contract.
        return unsafe { lanes_wide(src, dst, ybits, p) };
    }
    let mut acc = 0u64;
    for (i, &b) in ybits.iter().enumerate() {
        let y = (f64::from(f32::from_bits(b)) + p.m).to_bits() as i64 - p.mb;
        // SAFETY: i < ybits.len(), in bounds of both by the contract.
        let s = unsafe {
            let s = (i64::from_le(src.add(i).read_unaligned()) << p.sa) + y;
            dst.add(i).write_unaligned(s.to_le());
            s
        };
        acc |= (s ^ (s >> 63)) as u64;
    }
    acc
}

/// [`lanes`] for values spanning more than the magic constant's 2^51:
/// each `y` becomes its significand shifted left by its exponent above
/// 2^e (below 2^62 by [`plan`]), negated for a negative sign.
///
/// # Safety
/// As [`lanes`].
#[inline(always)]
unsafe fn lanes_wide(src: *const i64, dst: *mut i64, ybits: &[u32], p: &Plan) -> u64 {
    let mut acc = 0u64;
    for (i, &b) in ybits.iter().enumerate() {
        let ex = ((b >> 23) & 0xff) as i32;
        let m = i64::from(b & 0x7f_ffff) | (i64::from(ex != 0) << 23);
        // zeros (m = 0) may sit below 2^e: any shift keeps them 0
        let v = m << ((ex.max(1) - 150 - p.e).max(0) as u32 & 63);
        let y = if b >> 31 != 0 { -v } else { v };
        // SAFETY: i < ybits.len(), in bounds of both by the contract.
        let s = unsafe {
            let s = (i64::from_le(src.add(i).read_unaligned()) << p.sa) + y;
            dst.add(i).write_unaligned(s.to_le());
            s
        };
        acc |= (s ^ (s >> 63)) as u64;
    }
    acc
}

/// Appends the exact encoding of block `x` plus the native values `ys`
/// (the same `bl` elements) to `out`. `tmp` is scratch.
#[inline(always)]
pub(super) fn merge_raw_block<T: Element>(
    x: &BlockRef<'_>,
    ys: &[T],
    out: &mut Vec<u8>,
    tmp: &mut Vec<u8>,
) -> Result<()> {
    let bl = ys.len();
    if T::DTYPE != Dtype::F64 {
        let yb = f32_bits(ys);
        if let Some(p) = plan(x, &yb[..bl]) {
            let start = out.len();
            put_header(out, p.e, 2, false, 0);
            out.reserve(8 * bl);
            let at = out.len();
            let dst = out.spare_capacity_mut()[..8 * bl]
                .as_mut_ptr()
                .cast::<i64>();
            let src = x.data[..8 * bl].as_ptr().cast::<i64>();
            // SAFETY: `x.data` holds 8·bl bytes (w = 2, sliced above) and
            // `dst` 8·bl spare bytes (reserved above).
            let acc = unsafe { lanes(src, dst, &yb[..bl], &p) };
            // SAFETY: the loop wrote the 8·bl bytes after `at`.
            unsafe { out.set_len(at + 8 * bl) };
            let nb = bitlen64(acc) as u16;
            out[start + 6..start + 8].copy_from_slice(&nb.to_le_bytes());
            return Ok(());
        }
    }
    tmp.clear();
    encode_block(ys, tmp);
    let mut q = 0;
    let y = read_block(tmp, &mut q, bl)?;
    merge_block(x, &y, bl, out)
}

/// A divisor applied once, in the final rounding: 1, 2^k or any other
/// count below 2^32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Div(pub(crate) u32);

/// `±a·2^e / d` (a ≠ 0) rounded once to `T`, as an f64 holding a value of
/// `T`, for `T` narrower than f64: the quotient of `a` shifted to 64 bits
/// by a 32-bit `d` has ≥ 32 bits; it is rounded to odd (sticky remainder)
/// and to odd again at 53 bits, which keeps ≥ p + 2 bits, so the one
/// rounding to `T` is correct (Boldo & Melquiond).
#[inline(always)]
fn div_round_narrow<T: Element>(v: i64, e: i32, d: u32) -> f64 {
    div_round_narrow_by::<T>(v, e, Recip::new(d))
}

/// A divisor `d` (2 ≤ d < 2^32) and `⌊(2^64 − 1)/d⌋`, so that the quotient
/// of a u64 by `d` is one multiply-high away (off by at most one, fixed by
/// the remainder).
#[derive(Clone, Copy)]
pub(super) struct Recip {
    d: u64,
    m: u64,
}

impl Recip {
    pub(super) fn new(d: u32) -> Self {
        let d = u64::from(d.max(2));
        Self { d, m: u64::MAX / d }
    }

    /// (⌊a/d⌋, a mod d): a·m/2^64 > a/d − 1, so the estimate is q or q − 1.
    #[inline(always)]
    fn div_rem(self, a: u64) -> (u64, u64) {
        let mut q = ((u128::from(a) * u128::from(self.m)) >> 64) as u64;
        let mut r = a - q * self.d;
        if r >= self.d {
            q += 1;
            r -= self.d;
        }
        (q, r)
    }
}

#[inline(always)]
pub(super) fn div_round_narrow_by<T: Element>(v: i64, e: i32, rc: Recip) -> f64 {
    let a = v.unsigned_abs();
    let lz = a.leading_zeros();
    let a = a << lz;
    let (q, r) = rc.div_rem(a);
    let q = q | u64::from(r != 0);
    let q = if q >> 53 != 0 {
        (q & !0x7ff) | (u64::from(q & 0x7ff != 0) << 11)
    } else {
        q
    };
    let f = q as f64 * f64::from_bits(((e - lz as i32 + 1023) as u64) << 52);
    T::from_f64(if v < 0 { -f } else { f }).to_f64()
}

/// `v·2^e / d` (|v| ≤ 2^53) rounded once to `T` (narrower than f64),
/// where `fd` is `d` as f64 and `scale` is 2^e with e in −900..=900: the
/// f64 quotient, made the quotient rounded to odd at 53 bits by the sign
/// of its exact remainder (an FMA), which keeps ≥ p + 2 bits, so the one
/// rounding to `T` is correct (Boldo & Melquiond). No integer division:
/// the loops over lanes vectorize.
#[inline(always)]
pub(super) fn div_round_lane<T: Element>(v: i64, fd: f64, scale: f64) -> T {
    let fv = v as f64;
    let f = fv / fd;
    // v − f·d exactly: its sign is that of the quotient's rounding error
    let r = (-f).mul_add(fd, fv);
    let b = f.to_bits();
    // inexact with an even last bit: the neighbour towards the quotient
    // (odd) is the rounding to odd; |v/d| ≥ 2^-32, so f is never zero
    let nudge = r != 0.0 && b & 1 == 0;
    let up = (r > 0.0) == (f > 0.0);
    let f = if nudge {
        f64::from_bits(if up { b + 1 } else { b - 1 })
    } else {
        f
    };
    T::from_f64(f * scale)
}

/// `±m·2^e / d` rounded once to `T` for any magnitude (little-endian 32-bit
/// words, at most [`WMAX`]): long division of `m·2^64` by `d`, then the top
/// 64 bits of the quotient and a sticky bit.
fn div_round_big<T: Element>(neg: bool, m: &[u32], e: i32, d: u32) -> f64 {
    let mut num = [0u32; WMAX + 2];
    num[2..2 + m.len()].copy_from_slice(m);
    let mut rem = 0u64;
    for w in num.iter_mut().rev() {
        let cur = (rem << 32) | u64::from(*w);
        *w = (cur / u64::from(d)) as u32;
        rem = cur % u64::from(d);
    }
    let Some(top) = num.iter().rposition(|&w| w != 0) else {
        return if neg { -0.0 } else { 0.0 };
    };
    let l = 32 * top as u32 + (32 - num[top].leading_zeros());
    let s = l.saturating_sub(64);
    let mut hi = 0u64;
    for k in 0..64.min(l) {
        let b = s + k;
        hi |= u64::from((num[(b / 32) as usize] >> (b % 32)) & 1) << k;
    }
    let full = (s / 32) as usize;
    let below = num[..full].iter().any(|&w| w != 0)
        || (!s.is_multiple_of(32) && num[full] & ((1u32 << (s % 32)) - 1) != 0);
    round_mag(neg, hi, e - 64 + s as i32, below || rem != 0, T::DTYPE)
}

/// Rounds block `x` divided by `d` once into `blk`.
#[inline(always)]
pub(super) fn finish_block<T: Element>(x: &BlockRef<'_>, blk: &mut [T], d: Div) {
    let d = d.0;
    if d <= 1 {
        decode_block(x, blk);
        return;
    }
    if d.is_power_of_two() {
        let y = BlockRef {
            e: x.e - d.trailing_zeros() as i32,
            ..*x
        };
        decode_block(&y, blk);
        return;
    }
    if x.flags.is_none() && x.w == 2 && T::DTYPE != Dtype::F64 && (-900..=900).contains(&x.e) {
        let p = x.data[..8 * blk.len()].as_ptr().cast::<i64>();
        if x.bits <= 53 {
            let (fd, scale) = (f64::from(d), f64::from_bits(((x.e + 1023) as u64) << 52));
            for (i, o) in blk.iter_mut().enumerate() {
                // SAFETY: `x.data` holds 8·bl bytes (two words per element).
                let v = i64::from_le(unsafe { p.add(i).read_unaligned() });
                *o = div_round_lane(v, fd, scale);
            }
            return;
        }
        let rc = Recip::new(d);
        for (i, o) in blk.iter_mut().enumerate() {
            // SAFETY: `x.data` holds 8·bl bytes (two words per element).
            let v = i64::from_le(unsafe { p.add(i).read_unaligned() });
            *o = if v == 0 {
                T::ZERO
            } else {
                T::from_f64(div_round_narrow_by::<T>(v, x.e, rc))
            };
        }
        return;
    }
    for (i, o) in blk.iter_mut().enumerate() {
        let f = x.flags.map_or(0, |v| v[i]);
        if f & !F_NEGZERO != 0 || x.w == 0 {
            // NaN, ±∞ and zeros are unchanged by the division
            let mut one = [T::ZERO];
            decode_block(
                &BlockRef {
                    flags: x.flags.map(|v| &v[i..=i]),
                    data: if x.w == 0 {
                        &[]
                    } else {
                        &x.data[4 * x.w * i..4 * x.w * (i + 1)]
                    },
                    ..*x
                },
                &mut one,
            );
            *o = one[0];
            continue;
        }
        let v = if x.w <= 2 {
            let v = get_i64(x.data, i, x.w);
            if v == 0 {
                0.0
            } else if T::DTYPE != Dtype::F64 && (-900..=900).contains(&x.e) {
                div_round_narrow::<T>(v, x.e, d)
            } else {
                let a = v.unsigned_abs();
                div_round_big::<T>(v < 0, &[a as u32, (a >> 32) as u32], x.e, d)
            }
        } else {
            let (neg, m) = magnitude(&load_big(x.data, i, x.w));
            div_round_big::<T>(neg, &m[..x.w], x.e, d)
        };
        *o = if v == 0.0 {
            T::from_f64(super::signed_zero(f))
        } else {
            T::from_f64(v)
        };
    }
}

/// Rounds an encoding of `out.len()` elements divided by `d` into `out`.
pub(super) fn decode_div<T: Element>(bytes: &[u8], out: &mut [T], d: Div) -> Result<()> {
    decode_div_mv(bytes, out, d)
}

multiversion! {
fn decode_div_mv<T: Element>(bytes: &[u8], out: &mut [T], d: Div) -> Result<()> {
    let mut pos = 0;
    for blk in out.chunks_mut(BLOCK) {
        let bl = blk.len();
        let x = read_block(bytes, &mut pos, bl)?;
        finish_block(&x, blk, d);
    }
    trailing(bytes, pos)
}
}

pub(super) fn trailing(bytes: &[u8], pos: usize) -> Result<()> {
    if pos != bytes.len() {
        return Err(corrupt(format!(
            "{} trailing bytes after {pos}",
            bytes.len() - pos
        )));
    }
    Ok(())
}

multiversion! {
/// `out` = the encoding of `a` (an encoding of `ys.len()` elements) plus
/// the native values `ys`.
pub(super) fn merge_raw<T: Element>(a: &[u8], ys: &[T], out: &mut Vec<u8>) -> Result<()> {
    out.clear();
    out.reserve(encoded_capacity(ys.len()).max(a.len() + 64));
    let mut tmp = Vec::new();
    let mut pos = 0;
    for blk in ys.chunks(BLOCK) {
        let x = read_block(a, &mut pos, blk.len())?;
        merge_raw_block(&x, blk, out, &mut tmp)?;
    }
    trailing(a, pos)
}
}

/// Appends the two-word encoding of the block sum `x + y` of f32 bit
/// patterns if every value is finite, neither block holds −0.0 and both
/// together span at most [`FAST_SPREAD`](super::FAST_SPREAD) binades (each
/// converts exactly below 2^51 at the shared exponent, so the sum fits);
/// returns `false` (writing nothing) otherwise.
#[inline(always)]
fn sum2_fast(x: &[u32], y: &[u32], out: &mut Vec<u8>) -> bool {
    let (ax, nx, zx) = scan_f32(x);
    let (ay, ny, zy) = scan_f32(y);
    let (emax, emin) = (ax.max(ay), nx.min(ny));
    if emax == 0xff || emin == 0x100 || zx || zy || (emax.max(1) - emin) as i32 > super::FAST_SPREAD
    {
        return false;
    }
    let e = emax.max(1) as i32 - 150 - super::FAST_SPREAD;
    let (m, mb) = magic(e);
    let bl = x.len();
    let start = out.len();
    put_header(out, e, 2, false, 0);
    out.reserve(8 * bl);
    let at = out.len();
    let dst = out.spare_capacity_mut()[..8 * bl]
        .as_mut_ptr()
        .cast::<i64>();
    let mut acc = 0u64;
    for (i, (&a, &b)) in x.iter().zip(y).enumerate() {
        let s = ((f64::from(f32::from_bits(a)) + m).to_bits() as i64 - mb)
            + ((f64::from(f32::from_bits(b)) + m).to_bits() as i64 - mb);
        acc |= (s ^ (s >> 63)) as u64;
        // SAFETY: `dst` has 8·bl spare bytes reserved above and i < bl.
        unsafe { dst.add(i).write_unaligned(s.to_le()) };
    }
    // SAFETY: the loop wrote the 8·bl bytes after `at`.
    unsafe { out.set_len(at + 8 * bl) };
    out[start + 6..start + 8].copy_from_slice(&(bitlen64(acc) as u16).to_le_bytes());
    true
}

multiversion! {
/// `out` = the encoding of `xs + ys` (native values of the same length).
pub(super) fn sum_raw<T: Element>(xs: &[T], ys: &[T], out: &mut Vec<u8>) -> Result<()> {
    out.clear();
    out.reserve(encoded_capacity(ys.len()));
    let mut tmp = Vec::new();
    let mut enc = Vec::new();
    for (xb, yb) in xs.chunks(BLOCK).zip(ys.chunks(BLOCK)) {
        if T::DTYPE != Dtype::F64 && sum2_fast(&f32_bits(xb)[..xb.len()], &f32_bits(yb)[..yb.len()], out) {
            continue;
        }
        enc.clear();
        encode_block(xb, &mut enc);
        let mut q = 0;
        let x = read_block(&enc, &mut q, xb.len())?;
        merge_raw_block(&x, yb, out, &mut tmp)?;
    }
    Ok(())
}
}

multiversion! {
/// `io` = (`a` + `io`) / `d`, rounded once per element, where `a` is an
/// encoding of `io.len()` elements.
pub(super) fn merge_raw_round<T: Element>(a: &[u8], io: &mut [T], d: Div) -> Result<()> {
    let mut tmp = Vec::new();
    let mut blkenc = Vec::with_capacity(HEADER + 8 * BLOCK);
    let mut pos = 0;
    for blk in io.chunks_mut(BLOCK) {
        let bl = blk.len();
        let x = read_block(a, &mut pos, bl)?;
        let mut ys = [T::ZERO; BLOCK];
        ys[..bl].copy_from_slice(blk);
        if d.0 <= 1 && T::DTYPE != Dtype::F64 {
            let yb = f32_bits(&ys[..bl]);
            if let Some(p) = plan(&x, &yb[..bl]).filter(|p| lanes_round::<T>(p.e)) {
                let mut vals = [0i64; BLOCK];
                // SAFETY: `x.data` holds 8·bl bytes (w = 2) and `vals` BLOCK
                // ≥ bl lanes.
                unsafe { lanes(x.data.as_ptr().cast(), vals.as_mut_ptr(), &yb[..bl], &p) };
                let scale = f64::from_bits(((p.e + 1023) as u64) << 52);
                for (o, &v) in blk.iter_mut().zip(&vals) {
                    *o = round_lane(v, scale);
                }
                continue;
            }
        }
        blkenc.clear();
        merge_raw_block(&x, &ys[..bl], &mut blkenc, &mut tmp)?;
        let mut q = 0;
        let z = read_block(&blkenc, &mut q, bl)?;
        finish_block(&z, blk, d);
    }
    trailing(a, pos)
}
}

/// The factor that [`sum_raw_round`] and [`sum2_round`] scale a two-term
/// f64 sum by when no encoding is needed: 1 without a divisor; 0.5 for a
/// divisor of 2 in f32, f16 and bf16, since halving in f64 is exact there
/// (their values are multiples of 2^-149 at the finest, far above f64's
/// subnormals), so the one rounding to the narrow format stays the only
/// one; `None` otherwise (f64 halved could lose its last bit).
fn halving(dtype: Dtype, d: Div) -> Option<f64> {
    match d.0 {
        0 | 1 => Some(1.0),
        2 if dtype != Dtype::F64 => Some(0.5),
        _ => None,
    }
}

/// `out` = (`xs` + `ys`) / `d`, rounded once per element: the two-rank
/// reduce-scatter of native values straight from both inputs into the
/// output (no copy of the rank's own chunk first). As [`sum_raw_round`],
/// which it falls back to (after that copy) for other divisors. Outputs of
/// [`STREAM_BYTES`](crate::reduce::STREAM_BYTES) or more are computed
/// tile by tile and written past the cache, as the plain reduce-scatter's
/// are.
pub(super) fn sum2_round<T: Element>(xs: &[T], ys: &[T], out: &mut [T], d: Div) -> Result<()> {
    let Some(h) = halving(T::DTYPE, d) else {
        out.copy_from_slice(ys);
        return sum_raw_round(xs, out, d);
    };
    if T::DTYPE == Dtype::F32 && h == 1.0 {
        // f32's own addition is correctly rounded: the same bits, at the
        // plain reduce-scatter's speed (its kernel, streamed when large)
        crate::reduce::reduce_to(
            Dtype::F32,
            crate::types::ReduceOp::Sum,
            crate::types::BufMut::new(out).into_bytes(),
            crate::types::Buf::new(xs).bytes(),
            crate::types::Buf::new(ys).bytes(),
            true,
        );
        return Ok(());
    }
    // tile by tile, streamed out when large (see `Tiles`)
    let mut out = super::fixed::Tiles::new(out);
    let tile = super::fixed::TILE;
    for (i, (x, y)) in xs.chunks(tile).zip(ys.chunks(tile)).enumerate() {
        sum2_scaled(x, y, out.next(i * tile, x.len()), h);
    }
    out.finish();
    Ok(())
}

/// `out[i]` = (`xs[i]` + `ys[i]`) · `h` in f64, rounded once (f32 means
/// through [`halve_sum_f32`]).
fn sum2_scaled<T: Element>(xs: &[T], ys: &[T], out: &mut [T], h: f64) {
    if T::DTYPE == Dtype::F32 && h == 0.5 {
        let (x, y) = (
            crate::reduce::typed::<f32>(crate::types::Buf::new(xs).bytes()),
            crate::reduce::typed::<f32>(crate::types::Buf::new(ys).bytes()),
        );
        crate::reduce::with_typed_mut::<f32>(crate::types::BufMut::new(out).into_bytes(), |o| {
            halve_sum_f32(&x, &y, o);
        });
        return;
    }
    sum2_scaled_f64(xs, ys, out, h);
}

multiversion! {
/// `out[i]` = (`xs[i]` + `ys[i]`) · `h` in f64, rounded once.
fn sum2_scaled_f64<T: Element>(xs: &[T], ys: &[T], out: &mut [T], h: f64) {
    for ((o, x), y) in out.iter_mut().zip(xs).zip(ys) {
        *o = T::from_f64((x.to_f64() + y.to_f64()) * h);
    }
}
}

multiversion! {
/// `out[i]` = (`xs[i]` + `ys[i]`) / 2 rounded once, in f32 where that is
/// the same: halving commutes with rounding while the half is normal, so
/// `fl(fl(x + y) · 0.5)` is `fl((x + y) / 2)` then; a sum below 2^-125,
/// whose half may be subnormal, is exact (f32 values are multiples of
/// 2^-149), so its halving is the one rounding. Groups of 64 with an
/// infinite or NaN sum (an overflow whose half may be finite, or a special
/// input) are redone in f64.
fn halve_sum_f32(xs: &[f32], ys: &[f32], out: &mut [f32]) {
    for ((o, x), y) in out.chunks_mut(64).zip(xs.chunks(64)).zip(ys.chunks(64)) {
        crate::reduce::prefetch(x.as_ptr(), crate::reduce::AHEAD, 4);
        crate::reduce::prefetch(y.as_ptr(), crate::reduce::AHEAD, 4);
        let mut ok = true;
        for ((o, &x), &y) in o.iter_mut().zip(x).zip(y) {
            let s = x + y;
            let r = s * 0.5;
            *o = r;
            ok &= s.is_finite();
        }
        if !ok {
            for ((o, &x), &y) in o.iter_mut().zip(x).zip(y) {
                *o = ((f64::from(x) + f64::from(y)) * 0.5) as f32;
            }
        }
    }
}
}

multiversion! {
/// `io` = (`xs` + `io`) / `d`, rounded once per element. A sum of two
/// values rounded once is the native addition in a format at least
/// 2p + 1 bits wide (f64 for f32, f16 and bf16; f64 itself adds
/// correctly rounded), so without a divisor no encoding is needed.
pub(super) fn sum_raw_round<T: Element>(xs: &[T], io: &mut [T], d: Div) -> Result<()> {
    if let Some(h) = halving(T::DTYPE, d) {
        for (o, x) in io.iter_mut().zip(xs) {
            *o = T::from_f64((x.to_f64() + o.to_f64()) * h);
        }
        return Ok(());
    }
    let mut tmp = Vec::new();
    let mut enc = Vec::with_capacity(HEADER + 8 * BLOCK);
    let mut blkenc = Vec::with_capacity(HEADER + 8 * BLOCK);
    for (blk, xb) in io.chunks_mut(BLOCK).zip(xs.chunks(BLOCK)) {
        let bl = blk.len();
        enc.clear();
        encode_block(xb, &mut enc);
        let mut q = 0;
        let x = read_block(&enc, &mut q, bl)?;
        blkenc.clear();
        merge_raw_block(&x, blk, &mut blkenc, &mut tmp)?;
        let mut q = 0;
        let z = read_block(&blkenc, &mut q, bl)?;
        finish_block(&z, blk, d);
    }
    Ok(())
}
}

multiversion! {
/// Rounds elements `[skip, skip + out.len())` of `a / d` into `out`, where
/// `a` encodes `blen` elements.
pub(super) fn round_range<T: Element>(
    a: &[u8],
    blen: usize,
    skip: usize,
    out: &mut [T],
    d: Div,
) -> Result<()> {
    let mut pa = 0;
    let mut vals = [T::ZERO; BLOCK];
    let end = skip + out.len();
    for start in (0..blen).step_by(BLOCK) {
        let bl = BLOCK.min(blen - start);
        let x = read_block(a, &mut pa, bl)?;
        let lo = skip.max(start);
        let hi = end.min(start + bl);
        if lo >= hi {
            continue;
        }
        if lo == start && hi == start + bl {
            finish_block(&x, &mut out[start - skip..hi - skip], d);
        } else {
            finish_block(&x, &mut vals[..bl], d);
            out[lo - skip..hi - skip].copy_from_slice(&vals[lo - start..hi - start]);
        }
    }
    trailing(a, pa)
}
}

multiversion! {
/// Adds each of the native slices `ys` (all of them the encoding's
/// length) to the encoding `enc` in place, block by block: every source's
/// block is added while the encoded block is in the cache, so the encoding
/// is read and written once whatever the number of sources. Blocks that
/// keep their size are rewritten where they are (the common case: two
/// words, no flags); from the first block that changes size on, the rest
/// is written to `spill`, which then replaces `enc`.
pub(super) fn add_in_place<T: Element>(
    enc: &mut Vec<u8>,
    ys: &[&[T]],
    spill: &mut Vec<u8>,
    offs: &mut Vec<usize>,
) -> Result<()> {
    let len = ys.first().map_or(0, |y| y.len());
    let mut tmp = Vec::new();
    let mut blkenc = Vec::with_capacity(HEADER + 8 * BLOCK);
    let mut chain = Vec::with_capacity(HEADER + 8 * BLOCK);
    let mut chain2 = Vec::new();
    let mut pos = 0;
    offs.clear();
    for (b, s) in (0..len).step_by(BLOCK).enumerate() {
        let bl = BLOCK.min(len - s);
        let p0 = pos;
        offs.push(p0);
        // the lanes and the contributions a few blocks ahead (a 64 MiB
        // partial's add 1.35x faster on 2 thread ranks, Intel Xeon)
        crate::reduce::prefetch(enc.as_ptr().wrapping_add(p0), 2 * crate::reduce::AHEAD, 8);
        for y in ys {
            crate::reduce::prefetch(y.as_ptr().wrapping_add(s), crate::reduce::AHEAD, 4);
        }
        let (done, size) = add_lanes(&mut enc[p0..], ys, s, bl)?;
        pos = p0 + size;
        if done == ys.len() {
            continue;
        }
        // the other sources through the general path, one after another
        let mut at = p0;
        let x = read_block(enc, &mut at, bl)?;
        merge_sources(x, &ys[done..], s, bl, &mut blkenc, &mut chain, &mut tmp)?;
        if blkenc.len() == size {
            enc[p0..pos].copy_from_slice(&blkenc);
            continue;
        }
        // The block changes size: write it and the rest out of place
        // (each block copied out and added to by the lanes where they
        // apply, as above).
        spill.clear();
        spill.reserve(enc.len() + blkenc.len());
        spill.extend_from_slice(&enc[..p0]);
        spill.extend_from_slice(&blkenc);
        for s in (0..len).step_by(BLOCK).skip(b + 1) {
            let bl = BLOCK.min(len - s);
            offs.push(spill.len());
            let p0 = pos;
            read_block(enc, &mut pos, bl)?;
            let size = pos - p0;
            chain.clear();
            chain.extend_from_slice(&enc[p0..pos]);
            let (done, _) = add_lanes(&mut chain, ys, s, bl)?;
            if done == ys.len() {
                spill.extend_from_slice(&chain[..size]);
                continue;
            }
            let mut at = 0;
            let x = read_block(&chain, &mut at, bl)?;
            merge_sources(x, &ys[done..], s, bl, &mut blkenc, &mut chain2, &mut tmp)?;
            spill.extend_from_slice(&blkenc);
        }
        trailing(enc, pos)?;
        offs.push(spill.len());
        std::mem::swap(enc, spill);
        // keep one encoding's worth of memory, not two
        *spill = Vec::new();
        return Ok(());
    }
    offs.push(pos);
    trailing(enc, pos)
}
}

/// Adds block `[s, s + bl)` of the sources `ys`, in order, to the block
/// encoded at the start of `blk`, in place, in i64 lanes while they apply
/// (see [`plan`]); returns how many sources were added (the rest need the
/// general path) and the encoded block's size in bytes (unchanged by the
/// lanes).
#[inline(always)]
fn add_lanes<T: Element>(
    blk: &mut [u8],
    ys: &[&[T]],
    s: usize,
    bl: usize,
) -> Result<(usize, usize)> {
    let mut done = 0;
    loop {
        let mut end = 0;
        let x = read_block(blk, &mut end, bl)?;
        if done == ys.len() || T::DTYPE == Dtype::F64 {
            return Ok((done, end));
        }
        let mut buf = [0u32; BLOCK];
        let yb = bits_of(&ys[done][s..s + bl], &mut buf);
        if x.flags.is_none() && yb.iter().all(|&b| b & 0x7fff_ffff == 0) {
            // zeros (the rows of tokens a micro-batch did not see) change
            // neither the sum nor, without flags, its sign of zero
            done += 1;
            continue;
        }
        let Some(p) = plan(&x, yb) else {
            return Ok((done, end));
        };
        let data = &mut blk[HEADER..HEADER + 8 * bl];
        let ptr = data.as_mut_ptr().cast::<i64>();
        // SAFETY: `data` holds 8·bl bytes (a two-word block of bl
        // elements, checked by `read_block`); reading and writing lane i
        // through the same pointer is allowed.
        let acc = unsafe { lanes(ptr, ptr, yb, &p) };
        blk[..4].copy_from_slice(&p.e.to_le_bytes());
        blk[6..8].copy_from_slice(&(bitlen64(acc) as u16).to_le_bytes());
        done += 1;
    }
}

/// The encoded block `x` plus block `[s, s + bl)` of every source of
/// `ys`, by the general path, into `out` (cleared first); `chain` holds
/// the intermediate sums.
fn merge_sources<T: Element>(
    x: BlockRef<'_>,
    ys: &[&[T]],
    s: usize,
    bl: usize,
    out: &mut Vec<u8>,
    chain: &mut Vec<u8>,
    tmp: &mut Vec<u8>,
) -> Result<()> {
    out.clear();
    let Some((first, rest)) = ys.split_first() else {
        return Err(corrupt("no source to add".into()));
    };
    merge_raw_block(&x, &first[s..s + bl], out, tmp)?;
    for y in rest {
        std::mem::swap(out, chain);
        let mut at = 0;
        let x = read_block(chain, &mut at, bl)?;
        out.clear();
        merge_raw_block(&x, &y[s..s + bl], out, tmp)?;
    }
    Ok(())
}

multiversion! {
/// Appends the exact encoding of `xs` to `out` (cleared first) and the
/// byte offset of every block, then the end, to `offs` (cleared first).
pub(super) fn encode_with_offsets<T: Element>(xs: &[T], out: &mut Vec<u8>, offs: &mut Vec<usize>) {
    out.clear();
    offs.clear();
    out.reserve(encoded_capacity(xs.len()));
    for blk in xs.chunks(BLOCK) {
        offs.push(out.len());
        encode_block(blk, out);
    }
    offs.push(out.len());
}
}

multiversion! {
/// Writes the exact encoding of `xs + ys₀ + ys₁ + …` to `out` (cleared
/// first) and the byte offset of every block, then the end, to `offs`
/// (cleared first): the bytes [`encode_with_offsets`] of `xs` and then
/// [`add_in_place`] of `ys` leave, in one pass — each block is encoded and
/// added to while it is in L1, so the encoding is written once and never
/// read back from memory (a partial's second contribution).
pub(super) fn encode_add<T: Element>(
    xs: &[f32],
    ys: &[&[T]],
    out: &mut Vec<u8>,
    offs: &mut Vec<usize>,
) -> Result<()> {
    out.clear();
    offs.clear();
    out.reserve(encoded_capacity(xs.len()));
    let mut tmp = Vec::new();
    let mut blkenc = Vec::with_capacity(HEADER + 8 * BLOCK);
    let mut chain = Vec::with_capacity(HEADER + 8 * BLOCK);
    for (b, blk) in xs.chunks(BLOCK).enumerate() {
        let (s, bl) = (b * BLOCK, blk.len());
        let p0 = out.len();
        offs.push(p0);
        crate::reduce::prefetch(blk.as_ptr(), crate::reduce::AHEAD, 4);
        for y in ys {
            crate::reduce::prefetch(y.as_ptr().wrapping_add(s), crate::reduce::AHEAD, 4);
        }
        encode_block(blk, out);
        let (done, _) = add_lanes(&mut out[p0..], ys, s, bl)?;
        if done == ys.len() {
            continue;
        }
        // the other sources through the general path, one after another
        let mut at = p0;
        let x = read_block(out, &mut at, bl)?;
        merge_sources(x, &ys[done..], s, bl, &mut blkenc, &mut chain, &mut tmp)?;
        out.truncate(p0);
        out.extend_from_slice(&blkenc);
    }
    offs.push(out.len());
    Ok(())
}
}

/// Decodes a value of one element for tests of [`finish_block`]'s
/// divisions: `v·2^e / d` through the narrow fast path and the big path.
#[cfg(test)]
pub(super) fn div_both<T: Element>(v: i64, e: i32, d: u32) -> (f64, f64) {
    let a = v.unsigned_abs();
    (
        div_round_narrow::<T>(v, e, d),
        div_round_big::<T>(v < 0, &[a as u32, (a >> 32) as u32], e, d),
    )
}
