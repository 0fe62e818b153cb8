//! The fixed-lane reproducible ring (3 to [`MAX_RANKS`] ranks; f32, f16
//! and bf16 buffers): partial sums travel as bare i64 lanes at one
//! exponent per block, chosen once, at the first step.
//!
//! The receiver of a ring's first step holds two native blocks. It picks
//! the block exponent `e` from their largest biased f32 exponent `E`:
//! `e = max(E, 1) − 150 − 27 + 6`, so that every value of those two
//! blocks within 21 binades below the largest, and every later value up to
//! 2^6 times larger, is a multiple of 2^e below 2^(e+51) — the range in
//! which one float add of a magic constant converts it to the integer
//! `x / 2^e` exactly. Every later step adds its own values to the lanes in
//! that same way: no realignment, no carry tracking (n ≤ 2048 terms below
//! 2^51 stay below 2^62), no scan — each conversion checks itself (the
//! integer is in range and the float add was exact; −0.0, ±∞ and NaN
//! fail), and a block with any failing value is rewritten in the general,
//! self-describing encoding of [`crate::repro`], which then carries it to
//! the end. The last step rounds each lane once.
//!
//! A message of steps after the first is one code byte per block (0: the
//! block is in the general encoding; else `max(E, 1)`, from which `e`
//! follows), padded to 8 bytes, then the blocks in order: `8·bl` bytes of
//! little-endian i64 lanes for a fixed block, the general encoding
//! otherwise. Results are exact either way, so they are the same bits as
//! every other path of the reproducible mode.

use weft_numerics::{Element, multiversion};

use super::fused::{
    Div, Recip, div_round_lane, div_round_narrow_by, encode_block, finish_block, merge_raw_block,
    round_lane, trailing,
};
use super::{
    BLOCK, BlockRef, HEADER, bitlen64, corrupt, magic, merge_block, read_block, two_words,
};
use crate::error::Result;
use crate::reduce::prefetch;

/// Elements ahead of the current block that the kernels prefetch.
const PREFETCH: usize = 4 * BLOCK;

/// Most ranks the fixed path serves: n values below 2^51 sum below 2^62.
pub(super) const MAX_RANKS: usize = 2048;

/// Most ranks whose contributions [`sum_all_round`] takes at once.
pub(super) const MAX_DIRECT: usize = crate::algo::MAX_DIRECT;

/// `e = code − CODE_BIAS` for a block code `max(E, 1)`: 27 binades below
/// the largest f32 ulp (the magic conversion's 51-bit range minus 24),
/// raised by 6 binades of headroom for larger values on later ranks.
const CODE_BIAS: i32 = 150 + 27 - 6;

/// One pass over a block, jointly over `xs` and the same number of `ys`
/// (pass `xs` twice for one block): the largest and the smallest (minus
/// one, wrapping) of `bits.rotate_left(1)`, the bit pattern with the sign
/// moved to the bottom — its top byte is the biased exponent, +0.0 is 0
/// (and wraps to `u32::MAX`, never the minimum), −0.0 is 1 (and gives a
/// minimum of 0, which no block [`fits`]).
#[inline(always)]
fn scan<T: Element>(xs: &[T], ys: &[T]) -> (u32, u32) {
    let (mut mx, mut mn) = (0u32, u32::MAX);
    for (&x, &y) in xs.iter().zip(ys) {
        let u = x.to_f32().to_bits().rotate_left(1);
        let v = y.to_f32().to_bits().rotate_left(1);
        mx = mx.max(u).max(v);
        mn = mn.min(u.wrapping_sub(1)).min(v.wrapping_sub(1));
    }
    (mx, mn)
}

/// Whether every value of a block scanned as `(mx, mn)` converts exactly
/// at the exponent of block code `c` of the ring: no −0.0, and every
/// nonzero magnitude has a biased exponent `E` with `max(E, 1)` in
/// `c − 21 ..= min(c + 6, 254)` (so it is a multiple of 2^e below
/// 2^(e+51); ±∞ and NaN are above).
#[inline(always)]
fn fits(c: u8, sc: (u32, u32)) -> bool {
    fits_window(i32::from(c), 21, 6, sc)
}

/// Whether every value of a block scanned as `(mx, mn)` is +0.0 or has a
/// biased exponent `E` with `max(E, 1)` in `c − below ..= min(c + above,
/// 254)`.
#[inline(always)]
fn fits_window(c: i32, below: i32, above: i32, (mx, mn): (u32, u32)) -> bool {
    let hi = ((c + above).min(254) as u32 + 1) << 24;
    // subnormals (E = 0) count as E = 1: then any nonzero value is in
    // (rotated, its pattern is at least 2; −0.0's is 1)
    let lo = if c - below <= 1 {
        2
    } else {
        ((c - below) as u32) << 24
    };
    mx < hi && mn >= lo - 1
}

/// `y / 2^e` as an integer, exact for a value that [`fits`] (`m`, `mb`
/// from [`magic`]`(e)`).
#[inline(always)]
fn conv<T: Element>(y: T, m: f64, mb: i64) -> i64 {
    ((f64::from(y.to_f32()) + m).to_bits() as i64).wrapping_sub(mb)
}

/// Reserves the code bytes of `nb` blocks (padded to 8) at the start of
/// `out` (cleared first), and room for two-word blocks after them.
fn start_message(out: &mut Vec<u8>, nb: usize, len: usize) {
    out.clear();
    out.reserve(nb.next_multiple_of(8) + 8 * len + 64);
    out.resize(nb.next_multiple_of(8), 0);
}

/// Appends `bl` i64 lanes written by `f(i)` to `out`.
#[inline(always)]
fn push_lanes(out: &mut Vec<u8>, bl: usize, mut f: impl FnMut(usize) -> i64) {
    out.reserve(8 * bl);
    let at = out.len();
    let dst = out.spare_capacity_mut()[..8 * bl]
        .as_mut_ptr()
        .cast::<i64>();
    for i in 0..bl {
        // SAFETY: `dst` has 8·bl spare bytes (reserved above) and i < bl;
        // unaligned writes are allowed.
        unsafe { dst.add(i).write_unaligned(f(i).to_le()) };
    }
    // SAFETY: the loop wrote the 8·bl bytes after `at`.
    unsafe { out.set_len(at + 8 * bl) };
}

/// The code bytes and the block data of a message for `nb` blocks.
fn split_message(a: &[u8], nb: usize) -> Result<(&[u8], usize)> {
    let head = nb.next_multiple_of(8);
    if a.len() < head {
        return Err(corrupt(format!(
            "fixed-lane message of {} bytes, shorter than its {nb} block codes",
            a.len()
        )));
    }
    Ok((&a[..nb], head))
}

/// The fixed block of `bl` lanes at byte `pos` of `a` as a general
/// [`BlockRef`] (two words, exponent `e`), for merging it with values
/// that do not fit its lanes.
fn as_block(a: &[u8], pos: usize, bl: usize, e: i32) -> BlockRef<'_> {
    let data = &a[pos..pos + 8 * bl];
    let mut acc = 0u64;
    for w in data.chunks_exact(8) {
        let s = i64::from_le_bytes(w.try_into().expect("8 bytes"));
        acc |= (s ^ (s >> 63)) as u64;
    }
    BlockRef {
        e,
        w: 2,
        bits: bitlen64(acc),
        flags: None,
        data,
    }
}

/// Checks that a fixed block of `bl` lanes starts at byte `pos` of `a`;
/// returns a pointer to its lanes.
#[inline(always)]
fn lanes_at(a: &[u8], pos: usize, bl: usize) -> Result<*const i64> {
    if a.len() < pos + 8 * bl {
        return Err(corrupt(format!("truncated fixed block at byte {pos}")));
    }
    Ok(a[pos..pos + 8 * bl].as_ptr().cast::<i64>())
}

/// The exponent of a block code (`None` for a general block).
#[inline(always)]
fn code_exp(c: u8) -> Option<i32> {
    (c != 0).then(|| i32::from(c) - CODE_BIAS)
}

multiversion! {
    /// `out` = the message for `xs + ys` (native values of one chunk).
    pub(super) fn sum_fixed<T: Element>(xs: &[T], ys: &[T], out: &mut Vec<u8>) -> Result<()> {
        let nb = ys.len().div_ceil(BLOCK);
        start_message(out, nb, ys.len());
        let mut tmp = Vec::new();
        let mut enc = Vec::new();
        for (k, (xb, yb)) in xs.chunks(BLOCK).zip(ys.chunks(BLOCK)).enumerate() {
            let bl = xb.len();
            let (xb, yb) = (&xb[..bl], &yb[..bl]);
            prefetch(xb.as_ptr(), PREFETCH * 4, 4);
            prefetch(yb.as_ptr(), PREFETCH * 4, 4);
            let sc = scan(xb, yb);
            let ex = sc.0 >> 24;
            if ex < 255 {
                let c = ex.max(1) as u8;
                if fits(c, sc) {
                    let (m, mb) = magic(i32::from(c) - CODE_BIAS);
                    push_lanes(out, bl, |i| conv(xb[i], m, mb).wrapping_add(conv(yb[i], m, mb)));
                    out[k] = c;
                    continue;
                }
            }
            enc.clear();
            encode_block(xb, &mut enc);
            let mut q = 0;
            let x = read_block(&enc, &mut q, bl)?;
            merge_raw_block(&x, yb, out, &mut tmp)?;
        }
        Ok(())
    }
}

multiversion! {
    /// `out` = the message `a` (of a chunk of `ys.len()` elements) plus
    /// the native values `ys`.
    pub(super) fn merge_fixed<T: Element>(a: &[u8], ys: &[T], out: &mut Vec<u8>) -> Result<()> {
        let nb = ys.len().div_ceil(BLOCK);
        let (codes, mut pos) = split_message(a, nb)?;
        start_message(out, nb, ys.len());
        let mut tmp = Vec::new();
        for (k, yb) in ys.chunks(BLOCK).enumerate() {
            let bl = yb.len();
            if let Some(e) = code_exp(codes[k]) {
                let src = lanes_at(a, pos, bl)?;
                prefetch(src, PREFETCH * 8, 8);
                prefetch(yb.as_ptr(), PREFETCH * 4, 4);
                if fits(codes[k], scan(yb, yb)) {
                    let (m, mb) = magic(e);
                    push_lanes(out, bl, |i| {
                        // SAFETY: `lanes_at` checked that `a` holds bl lanes
                        // from `src`; i < bl; unaligned reads are allowed.
                        let v = i64::from_le(unsafe { src.add(i).read_unaligned() });
                        v.wrapping_add(conv(yb[i], m, mb))
                    });
                    out[k] = codes[k];
                } else {
                    merge_raw_block(&as_block(a, pos, bl, e), yb, out, &mut tmp)?;
                }
                pos += 8 * bl;
            } else {
                let x = read_block(a, &mut pos, bl)?;
                merge_raw_block(&x, yb, out, &mut tmp)?;
            }
        }
        trailing(a, pos)
    }
}

multiversion! {
    /// `io` = (`a` + `io`) / `d`, rounded once per element, where `a` is
    /// the message of the chunk `io` (the last step of the ring of
    /// `ranks`).
    pub(super) fn merge_fixed_round<T: Element>(a: &[u8], io: &mut [T], d: Div, ranks: usize) -> Result<()> {
        // n terms in [−2^51, 2^51) sum to at most 2^53 in magnitude for
        // n ≤ 4: exact in f64, so one conversion rounds once
        let small = ranks <= 4;
        let nb = io.len().div_ceil(BLOCK);
        let (codes, mut pos) = split_message(a, nb)?;
        let mut tmp = Vec::new();
        let mut blkenc = Vec::with_capacity(HEADER + 8 * BLOCK);
        let pow2 = d.0 <= 1 || d.0.is_power_of_two();
        let shift = if d.0 > 1 { d.0.trailing_zeros() as i32 } else { 0 };
        let rc = Recip::new(d.0);
        let fd = f64::from(d.0);
        for (k, blk) in io.chunks_mut(BLOCK).enumerate() {
            let bl = blk.len();
            let general = if let Some(e) = code_exp(codes[k]) {
                let src = lanes_at(a, pos, bl)?;
                prefetch(src, PREFETCH * 8, 8);
                prefetch(blk.as_ptr(), PREFETCH * 4, 4);
                if fits(codes[k], scan(blk, blk)) {
                    let (m, mb) = magic(e);
                    if pow2 {
                        // e − shift ≥ −170 − 11: a normal f64 power of two
                        let scale = f64::from_bits(((e - shift + 1023) as u64) << 52);
                        for (i, o) in blk.iter_mut().enumerate() {
                            // SAFETY: as in `merge_fixed`.
                            let x = i64::from_le(unsafe { src.add(i).read_unaligned() });
                            let v = x.wrapping_add(conv(*o, m, mb));
                            *o = if small {
                                // |v| ≤ 4·2^51: exact in f64, one rounding
                                T::from_f64(v as f64 * scale)
                            } else {
                                round_lane(v, scale)
                            };
                        }
                    } else if small {
                        let scale = f64::from_bits(((e + 1023) as u64) << 52);
                        for (i, o) in blk.iter_mut().enumerate() {
                            // SAFETY: as in `merge_fixed`.
                            let x = i64::from_le(unsafe { src.add(i).read_unaligned() });
                            let v = x.wrapping_add(conv(*o, m, mb));
                            // |v| ≤ 2^53 (above)
                            *o = div_round_lane(v, fd, scale);
                        }
                    } else {
                        for (i, o) in blk.iter_mut().enumerate() {
                            // SAFETY: as in `merge_fixed`.
                            let x = i64::from_le(unsafe { src.add(i).read_unaligned() });
                            let v = x.wrapping_add(conv(*o, m, mb));
                            *o = if v == 0 {
                                T::ZERO
                            } else {
                                T::from_f64(div_round_narrow_by::<T>(v, e, rc))
                            };
                        }
                    }
                    pos += 8 * bl;
                    continue;
                }
                let x = as_block(a, pos, bl, e);
                pos += 8 * bl;
                x
            } else {
                read_block(a, &mut pos, bl)?
            };
            blkenc.clear();
            merge_raw_block(&general, blk, &mut blkenc, &mut tmp)?;
            let mut q = 0;
            let z = read_block(&blkenc, &mut q, bl)?;
            finish_block(&z, blk, d);
        }
        trailing(a, pos)
    }
}

multiversion! {
    /// `io` = (`own` + Σ `peers`) / `d`, rounded once per element, where
    /// `own` is `io`'s own value on entry when `None`: the exact sum of a
    /// chunk's native contributions from every rank at once (at most
    /// [`MAX_DIRECT`]), each block in i64 lanes at the exponent 27 binades
    /// below its largest ulp when every value fits that window (the sum
    /// stays below 2^55), else by the general encoding.
    pub(super) fn sum_all_round<T: Element>(
        own: Option<&[T]>,
        peers: &[&[T]],
        io: &mut [T],
        d: Div,
    ) -> Result<()> {
        let n = peers.len() + 1;
        // n terms in [−2^51, 2^51) sum to at most 2^53 in magnitude for
        // n ≤ 4: exact in f64, so one conversion rounds once
        let small = n <= 4;
        let pow2 = d.0 <= 1 || d.0.is_power_of_two();
        let shift = if d.0 > 1 { d.0.trailing_zeros() as i32 } else { 0 };
        let rc = Recip::new(d.0);
        let fd = f64::from(d.0);
        let mut vals = [0i64; BLOCK];
        let mut sums = [0f64; BLOCK];
        let (mut cur, mut nxt, mut tmp) = (Vec::new(), Vec::new(), Vec::new());
        // f32 contributions, at most 4, summed to a power-of-two divisor
        // in f64 lanes by AVX-512 (one reduction of the scan per block)
        #[cfg(target_arch = "x86_64")]
        let f32_lanes = small
            && pow2
            && T::DTYPE == weft_numerics::Dtype::F32
            && size_of::<T>() == 4
            && weft_numerics::simd::level() == weft_numerics::simd::Level::Avx512
            && std::arch::is_x86_feature_detected!("avx512f");
        for (k, blk) in io.chunks_mut(BLOCK).enumerate() {
            let (start, bl) = (k * BLOCK, blk.len());
            for p in peers.iter().chain(&own) {
                prefetch(p[start..].as_ptr(), PREFETCH * 4, 4);
            }
            #[cfg(target_arch = "x86_64")]
            if f32_lanes && bl == BLOCK {
                // SAFETY: AVX-512F checked (`f32_lanes`); `T` is f32
                // (its dtype and size, checked there), so each contribution's
                // block is `BLOCK` f32 at its pointer, and `blk` is too.
                let done = unsafe {
                    let mut ins = [std::ptr::null::<f32>(); 4];
                    ins[0] = pick(own, blk, start).as_ptr().cast();
                    for (i, p) in peers.iter().enumerate() {
                        ins[i + 1] = p[start..start + bl].as_ptr().cast();
                    }
                    x86::sum_block(&ins[..n], blk.as_mut_ptr().cast(), shift)
                };
                if done {
                    continue;
                }
            }
            let ob = pick(own, blk, start);
            let (mut mx, mut mn) = scan(ob, ob);
            for p in peers {
                let pb = &p[start..start + bl];
                let (a, b) = scan(pb, pb);
                mx = mx.max(a);
                mn = mn.min(b);
            }
            let top = (mx >> 24) as i32;
            if top < 255 && fits_window(top.max(1), 27, 0, (mx, mn)) {
                if small && pow2 {
                    // every value is a multiple of 2^e (below) under
                    // 2^(e+51) in magnitude: sums of up to 4 of them are
                    // multiples of 2^e under 2^(e+53), exact in f64 — the
                    // integer lanes' sums without the conversions — and
                    // the scaling by 2^−shift is exact too (far from
                    // f64's subnormals): one rounding
                    let scale = f64::from_bits(((1023 - shift) as u64) << 52);
                    let sums = &mut sums[..bl];
                    for (v, &y) in sums.iter_mut().zip(pick(own, blk, start)) {
                        *v = f64::from(y.to_f32());
                    }
                    for p in peers {
                        for (v, &y) in sums.iter_mut().zip(&p[start..start + bl]) {
                            *v += f64::from(y.to_f32());
                        }
                    }
                    for (o, &v) in blk.iter_mut().zip(&*sums) {
                        *o = T::from_f64(v * scale);
                    }
                    continue;
                }
                let e = top.max(1) - 150 - 27;
                let (m, mb) = magic(e);
                let vals = &mut vals[..bl];
                for (v, &y) in vals.iter_mut().zip(pick(own, blk, start)) {
                    *v = conv(y, m, mb);
                }
                for p in peers {
                    for (v, &y) in vals.iter_mut().zip(&p[start..start + bl]) {
                        *v = v.wrapping_add(conv(y, m, mb));
                    }
                }
                if pow2 {
                    // e − shift ≥ −176 − 4: a normal f64 power of two
                    let scale = f64::from_bits(((e - shift + 1023) as u64) << 52);
                    for (o, &v) in blk.iter_mut().zip(&*vals) {
                        *o = if small {
                            // |v| ≤ 2^53: exact in f64, one rounding
                            T::from_f64(v as f64 * scale)
                        } else {
                            round_lane(v, scale)
                        };
                    }
                } else if small {
                    let scale = f64::from_bits(((e + 1023) as u64) << 52);
                    for (o, &v) in blk.iter_mut().zip(&*vals) {
                        // |v| ≤ 2^53 (above)
                        *o = div_round_lane(v, fd, scale);
                    }
                } else {
                    for (o, &v) in blk.iter_mut().zip(&*vals) {
                        *o = if v == 0 {
                            T::ZERO
                        } else {
                            T::from_f64(div_round_narrow_by::<T>(v, e, rc))
                        };
                    }
                }
                continue;
            }
            cur.clear();
            encode_block(pick(own, blk, start), &mut cur);
            for p in peers {
                let mut q = 0;
                let x = read_block(&cur, &mut q, bl)?;
                nxt.clear();
                merge_raw_block(&x, &p[start..start + bl], &mut nxt, &mut tmp)?;
                std::mem::swap(&mut cur, &mut nxt);
            }
            let mut q = 0;
            let z = read_block(&cur, &mut q, bl)?;
            finish_block(&z, blk, d);
        }
        Ok(())
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        _mm_cvtsi64_si128, _mm256_loadu_ps, _mm256_mask_storeu_ps, _mm256_storeu_ps,
        _mm512_abs_epi64, _mm512_add_epi64, _mm512_add_pd, _mm512_andnot_si512,
        _mm512_cmpge_epu64_mask, _mm512_cvtepi64_pd, _mm512_cvtepu64_pd, _mm512_cvtpd_ps,
        _mm512_cvtps_pd, _mm512_loadu_si512, _mm512_mask_loadu_epi64, _mm512_mask_mov_epi64,
        _mm512_mask_or_epi64, _mm512_mask_sub_pd, _mm512_max_epu32, _mm512_min_epu32,
        _mm512_movepi64_mask, _mm512_mul_pd, _mm512_reduce_max_epu32, _mm512_reduce_min_epu32,
        _mm512_rol_epi32, _mm512_set1_epi32, _mm512_set1_epi64, _mm512_set1_pd, _mm512_setzero_pd,
        _mm512_setzero_si512, _mm512_sll_epi64, _mm512_sub_epi32, _mm512_test_epi64_mask,
    };

    use super::{BLOCK, fits_window};

    /// `out[i] = Σ (lane_k[i] << shift_k) · scale`, rounded once to f32,
    /// for `len` lanes of little-endian i64 from each piece `(lanes,
    /// shift)`: what [`super::round_lane`] gives lane by lane when `odd`
    /// (sums of 2^53 or more rounded to odd at bit 11 first, then exact in
    /// f64), and `v as f64 · scale` when not (sums below 2^53), eight
    /// lanes at a time summed over every piece in registers.
    ///
    /// # Safety
    /// The CPU must have AVX-512F and -DQ; each piece valid for reads of
    /// `len` i64 and `out` for writes of `len` f32; every sum below 2^63
    /// in magnitude and `scale` a normal power of two whose products stay
    /// normal.
    #[target_feature(enable = "avx512f,avx512dq,avx512vl")]
    pub(super) unsafe fn merge_round(
        pieces: &[(*const i64, u32)],
        len: usize,
        scale: f64,
        odd: bool,
        out: *mut f32,
    ) {
        let sc = _mm512_set1_pd(scale);
        let low = _mm512_set1_epi64(0x7ff);
        let bit11 = _mm512_set1_epi64(0x800);
        let two53 = _mm512_set1_epi64(1 << 53);
        let mut i = 0;
        while i < len {
            let w = (len - i).min(8);
            let m = if w == 8 { 0xff } else { (1u8 << w) - 1 };
            let mut acc = _mm512_setzero_si512();
            for &(p, sh) in pieces {
                // SAFETY: the caller's contract (`w` lanes from `i`).
                let x = unsafe { _mm512_mask_loadu_epi64(_mm512_setzero_si512(), m, p.add(i)) };
                let x = _mm512_sll_epi64(x, _mm_cvtsi64_si128(i64::from(sh)));
                acc = _mm512_add_epi64(acc, x);
            }
            let f = if odd {
                let neg = _mm512_movepi64_mask(acc);
                let a = _mm512_abs_epi64(acc);
                let big = _mm512_cmpge_epu64_mask(a, two53);
                let sticky = _mm512_test_epi64_mask(a, low);
                let hi = _mm512_andnot_si512(low, a);
                let rounded = _mm512_mask_or_epi64(hi, sticky, hi, bit11);
                let a = _mm512_mask_mov_epi64(a, big, rounded);
                let f = _mm512_mul_pd(_mm512_cvtepu64_pd(a), sc);
                _mm512_mask_sub_pd(f, neg, _mm512_setzero_pd(), f)
            } else {
                _mm512_mul_pd(_mm512_cvtepi64_pd(acc), sc)
            };
            // SAFETY: the caller's contract (`w` values from `i`).
            unsafe { _mm256_mask_storeu_ps(out.add(i), m, _mm512_cvtpd_ps(f)) };
            i += w;
        }
    }

    /// `out = Σ ins / 2^shift` for one block of [`BLOCK`] f32 from each of
    /// `ins` (1 to 4 of them; `out` may be the first), rounded once, when
    /// every value fits the f64 window of [`super::sum_all_round`]'s
    /// small path; else `false`, writing nothing. The scan of
    /// [`super::scan`], lane-wise over every contribution, reduced once.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; each of `ins` must be valid for reads of
    /// [`BLOCK`] f32 and `out` for writes of as many.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sum_block(ins: &[*const f32], out: *mut f32, shift: i32) -> bool {
        const { assert!(BLOCK == 64) };
        debug_assert!((1..=4).contains(&ins.len()));
        let one = _mm512_set1_epi32(1);
        let (mut mx, mut mn) = (_mm512_setzero_si512(), _mm512_set1_epi32(-1));
        for &p in ins {
            for q in 0..4 {
                // SAFETY: the caller's contract (16 of the block's 64).
                let x = unsafe { _mm512_loadu_si512(p.add(16 * q).cast()) };
                let u = _mm512_rol_epi32::<1>(x);
                mx = _mm512_max_epu32(mx, u);
                mn = _mm512_min_epu32(mn, _mm512_sub_epi32(u, one));
            }
        }
        let (mx, mn) = (_mm512_reduce_max_epu32(mx), _mm512_reduce_min_epu32(mn));
        let top = (mx >> 24) as i32;
        if top >= 255 || !fits_window(top.max(1), 27, 0, (mx, mn)) {
            return false;
        }
        // exact sums (see `sum_all_round`), scaled exactly, one rounding
        let scale = _mm512_set1_pd(f64::from_bits(((1023 - shift) as u64) << 52));
        for h in 0..BLOCK / 8 {
            // SAFETY: the caller's contract; each 8 of every contribution
            // are read before the same 8 of `out` are written.
            unsafe {
                let mut s = _mm512_cvtps_pd(_mm256_loadu_ps(ins[0].add(8 * h)));
                for &p in &ins[1..] {
                    s = _mm512_add_pd(s, _mm512_cvtps_pd(_mm256_loadu_ps(p.add(8 * h))));
                }
                _mm256_storeu_ps(out.add(8 * h), _mm512_cvtpd_ps(_mm512_mul_pd(s, scale)));
            }
        }
        true
    }
}

/// The own contribution to the block of `io` at `start`: `own`'s, or the
/// block itself when `own` is `None`.
#[inline(always)]
fn pick<'x, T>(own: Option<&'x [T]>, blk: &'x [T], start: usize) -> &'x [T] {
    own.map_or(blk, |o| &o[start..start + blk.len()])
}

/// Elements per tile of [`Tiles`].
pub(super) const TILE: usize = 1024;

/// Hands out consecutive ranges of an output: in place, or — for outputs
/// of [`STREAM_BYTES`](crate::reduce::STREAM_BYTES) or more, which are not
/// read again soon — in an L1-sized tile that is written past the cache
/// when full (no read of the output's lines before they are overwritten,
/// no eviction of the inputs still to be read), as the plain
/// reduce-scatter writes its output.
pub(super) struct Tiles<'o, T> {
    out: &'o mut [T],
    tile: Option<Box<[T; TILE]>>,
    /// the output index of `tile[0]`
    base: usize,
}

impl<'o, T: Element> Tiles<'o, T> {
    pub(super) fn new(out: &'o mut [T]) -> Self {
        let stream =
            size_of_val(out) >= crate::reduce::STREAM_BYTES && cfg!(target_arch = "x86_64");
        Tiles {
            out,
            tile: stream.then(|| Box::new([T::ZERO; TILE])),
            base: 0,
        }
    }

    /// Output elements `[at, at + len)` (`len` ≤ [`TILE`]); every call
    /// continues where the previous one ended.
    #[inline(always)]
    pub(super) fn next(&mut self, at: usize, len: usize) -> &mut [T] {
        if self.tile.is_none() {
            return &mut self.out[at..at + len];
        }
        if at + len > self.base + TILE {
            self.flush(at);
        }
        let b = self.base;
        match &mut self.tile {
            Some(t) => &mut t[at - b..at - b + len],
            None => unreachable!("checked above"),
        }
    }

    /// Streams the tile's elements before output index `upto` out.
    fn flush(&mut self, upto: usize) {
        if let Some(t) = &self.tile {
            let b = self.base;
            crate::reduce::stream_copy(
                crate::types::BufMut::new(&mut self.out[b..upto]).into_bytes(),
                crate::types::Buf::new(&t[..upto - b]).bytes(),
            );
            self.base = upto;
        }
    }

    /// Writes out what the tile still holds (the whole output was handed
    /// out) and orders the streamed stores before later ones.
    pub(super) fn finish(mut self) {
        if self.tile.is_some() {
            self.flush(self.out.len());
            crate::reduce::stream_fence();
        }
    }
}

multiversion! {
    /// Rounds elements `[skip, skip + out.len())` of (Σ `pieces`) / `d`
    /// into `out`, where every piece encodes the same `blen` elements (the
    /// direct reduction of exact partials, and the last step of their
    /// ring). A block that is two words without flags in every piece, and
    /// whose aligned sum stays below 2^62, is read in place, added in i64
    /// lanes and rounded once (two pieces below 2^53 in one pass, the sum
    /// exact in f64); others merge through the general encoding.
    ///
    /// # Panics
    /// With fewer than two pieces.
    pub(super) fn merge_all_round_range<T: Element>(
        pieces: &[&[u8]],
        blen: usize,
        skip: usize,
        out: &mut [T],
        d: Div,
    ) -> Result<()> {
        let n = pieces.len();
        // carries of n terms: ⌈log₂ n⌉ bits
        let carry = i64::from(u32::BITS - (n as u32).saturating_sub(1).leading_zeros());
        let pow2 = d.0 <= 1 || d.0.is_power_of_two();
        let shift = if d.0 > 1 { d.0.trailing_zeros() as i32 } else { 0 };
        let rc = Recip::new(d.0);
        let fd = f64::from(d.0);
        let mut pos = vec![0usize; n];
        // the blocks read in place (at most `MAX_DIRECT` pieces)
        let lanes_dtype = T::DTYPE != weft_numerics::Dtype::F64 && n <= MAX_DIRECT;
        let mut plain = [(0i32, 0u32, std::ptr::null::<i64>()); MAX_DIRECT];
        let mut blocks: Vec<BlockRef<'_>> = Vec::with_capacity(n);
        let (mut cur, mut nxt) = (Vec::new(), Vec::new());
        let mut lanes = [0i64; BLOCK];
        let mut vals = [T::ZERO; BLOCK];
        let end = skip + out.len();
        let mut out = Tiles::new(out);
        // f32 results of pieces of i64 lanes summed by AVX-512 in registers
        #[cfg(target_arch = "x86_64")]
        let merge_lanes = lanes_dtype
            && T::DTYPE == weft_numerics::Dtype::F32
            && size_of::<T>() == 4
            && weft_numerics::simd::level() == weft_numerics::simd::Level::Avx512
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512vl");
        for start in (0..blen).step_by(BLOCK) {
            let bl = BLOCK.min(blen - start);
            let (lo, hi) = (skip.max(start), end.min(start + bl));
            let mut m = 0;
            if lanes_dtype {
                for (p, &q) in pieces.iter().zip(&pos) {
                    // blocks a few ahead of this one, from every peer's
                    // memory at once (with two pieces as well: 2 thread
                    // ranks' 64 MiB all_reduce_exact of encoded partials
                    // 1.12x faster, Intel Xeon)
                    prefetch(p.as_ptr().wrapping_add(q), PREFETCH * 8, 8);
                    match two_words(p, q, bl) {
                        Some(b) => plain[m] = b,
                        None => break,
                    }
                    m += 1;
                }
            }
            if m == n {
                let plain = &plain[..n];
                let e = plain.iter().map(|b| b.0).min().unwrap_or(0);
                let top = plain
                    .iter()
                    .map(|b| i64::from(b.1) + i64::from(b.0) - i64::from(e))
                    .max()
                    .unwrap_or(0)
                    + carry;
                if top <= 62 && (-900..=900).contains(&e) {
                    for q in &mut pos {
                        *q += HEADER + 8 * bl;
                    }
                    if lo >= hi {
                        continue;
                    }
                    let dst = out.next(lo - skip, hi - lo);
                    let scale = f64::from_bits(((e - shift + 1023) as u64) << 52);
                    if n == 2 && pow2 && top <= 53 {
                        let ((ex, _, px), (ey, _, py)) = (plain[0], plain[1]);
                        let (sx, sy) = ((ex - e) as u32, (ey - e) as u32);
                        for (i, o) in dst.iter_mut().enumerate() {
                            let k = lo - start + i;
                            // SAFETY: `two_words` checked that both blocks
                            // hold 8·bl bytes, and k < bl; unaligned reads
                            // are allowed.
                            let v = unsafe {
                                (i64::from_le(px.add(k).read_unaligned()) << sx)
                                    + (i64::from_le(py.add(k).read_unaligned()) << sy)
                            };
                            // |v| < 2^53: exact in f64, one rounding
                            *o = T::from_f64(v as f64 * scale);
                        }
                        continue;
                    }
                    #[cfg(target_arch = "x86_64")]
                    if merge_lanes && pow2 {
                        let mut ptrs = [(std::ptr::null::<i64>(), 0u32); MAX_DIRECT];
                        for (q, &(eb, _, p)) in ptrs.iter_mut().zip(plain) {
                            *q = (p.wrapping_add(lo - start), (eb - e) as u32);
                        }
                        // SAFETY: AVX-512F/DQ checked (`merge_lanes`), `T`
                        // is f32 (its dtype and size, checked there);
                        // `two_words` checked that every block holds 8·bl
                        // bytes and `lo - start .. hi - start` lies in it;
                        // `dst` holds `hi - lo` values; the sums are below
                        // 2^62 (`top`) and `e` is in range, so `scale`
                        // and the products stay normal.
                        unsafe {
                            x86::merge_round(
                                &ptrs[..n],
                                hi - lo,
                                scale,
                                top > 53,
                                dst.as_mut_ptr().cast::<f32>(),
                            );
                        }
                        continue;
                    }
                    let lanes = &mut lanes[..bl];
                    for (k, &(eb, _, p)) in plain.iter().enumerate() {
                        let sh = (eb - e) as u32;
                        for (i, v) in lanes.iter_mut().enumerate() {
                            // SAFETY: `two_words` checked that the block
                            // holds 8·bl bytes, and i < bl; unaligned reads
                            // are allowed.
                            let x = i64::from_le(unsafe { p.add(i).read_unaligned() }) << sh;
                            *v = if k == 0 { x } else { v.wrapping_add(x) };
                        }
                    }
                    let lanes = &lanes[lo - start..hi - start];
                    if !pow2 && top <= 53 {
                        let scale = f64::from_bits(((e + 1023) as u64) << 52);
                        for (o, &v) in dst.iter_mut().zip(lanes) {
                            *o = div_round_lane(v, fd, scale);
                        }
                    } else if !pow2 {
                        for (o, &v) in dst.iter_mut().zip(lanes) {
                            *o = if v == 0 {
                                T::ZERO
                            } else {
                                T::from_f64(div_round_narrow_by::<T>(v, e, rc))
                            };
                        }
                    } else if top <= 53 {
                        for (o, &v) in dst.iter_mut().zip(lanes) {
                            *o = T::from_f64(v as f64 * scale);
                        }
                    } else {
                        for (o, &v) in dst.iter_mut().zip(lanes) {
                            *o = round_lane(v, scale);
                        }
                    }
                    continue;
                }
            }
            // the general path: merge the pieces' blocks one by one
            blocks.clear();
            for (p, q) in pieces.iter().zip(pos.iter_mut()) {
                blocks.push(read_block(p, q, bl)?);
            }
            if lo >= hi {
                continue;
            }
            let dst = out.next(lo - skip, hi - lo);
            cur.clear();
            merge_block(&blocks[0], &blocks[1], bl, &mut cur)?;
            for b in &blocks[2..] {
                let mut q = 0;
                let x = read_block(&cur, &mut q, bl)?;
                nxt.clear();
                merge_block(&x, b, bl, &mut nxt)?;
                std::mem::swap(&mut cur, &mut nxt);
            }
            let mut q = 0;
            let z = read_block(&cur, &mut q, bl)?;
            if lo == start && hi == start + bl {
                finish_block(&z, dst, d);
            } else {
                finish_block(&z, &mut vals[..bl], d);
                dst.copy_from_slice(&vals[lo - start..hi - start]);
            }
        }
        out.finish();
        for (p, &q) in pieces.iter().zip(&pos) {
            trailing(p, q)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_numerics::{ExactSum, bf16, f16};

    /// The vectorizable division of an i64 lane gives the integer
    /// division's bits for every narrow dtype: random lanes, divisors and
    /// exponents, and quotients within a unit of the last place of a tie
    /// of the destination (where a quotient merely rounded to nearest in
    /// f64 would round twice), subnormal results included.
    #[test]
    fn lane_division_rounds_as_the_integer_division() {
        fn check<T: Element>(v: i64, d: u32, e: i32) {
            let got =
                div_round_lane::<T>(v, f64::from(d), f64::from_bits(((e + 1023) as u64) << 52));
            let want = if v == 0 {
                T::ZERO
            } else {
                T::from_f64(div_round_narrow_by::<T>(v, e, Recip::new(d)))
            };
            assert_eq!(
                got.to_f64().to_bits(),
                want.to_f64().to_bits(),
                "{v} * 2^{e} / {d} as {:?}",
                T::DTYPE
            );
        }
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for _ in 0..200_000 {
            let r = next();
            let d = [3u32, 5, 6, 7, 12, 13, 1000, 4_000_037, u32::MAX][(r % 9) as usize];
            let bits = 1 + (next() % 53) as u32;
            let mag = (next() >> (64 - bits)) as i64;
            let v = if r & (1 << 20) != 0 { -mag } else { mag };
            // exponents around the subnormal range of each dtype and beyond
            let e = [-160i32, -140, -60, -30, -10, 0, 20][((r >> 8) % 7) as usize];
            check::<f32>(v, d, e);
            check::<bf16>(v, d, e);
            check::<f16>(v, d, e - 100 + 120);
            // near ties: v/d within a few units of 2^j/d of a tie m·2^j
            // of f32 (m odd, 25 bits), which the f64 quotient's own
            // rounding can land on for divisors from 2^29 (for bf16 and
            // f16 it would take divisors beyond 2^32)
            let d = (next() >> 32) as u32 | (1 << 29);
            for j in [-5i32, -8] {
                let m = (next() >> 39) | (1 << 24) | 1;
                let t = (u128::from(m) * u128::from(d)) >> (-j) as u32;
                for dv in [-2i64, -1, 0, 1, 2] {
                    let v = (t as i64 + dv).min(1 << 53);
                    check::<f32>(v, d, 0);
                    check::<f32>(-v, d, -140);
                    check::<bf16>(v, d, 0);
                    check::<f16>(v, d, -40);
                }
            }
        }
    }

    /// Runs the fixed-lane kernels as the ring does for one chunk: the
    /// first two columns are summed, the middle ones merged, the last one
    /// rounded into (divided by `d`); returns the result and the messages'
    /// share of fixed blocks after each step.
    fn chain<T: Element>(cols: &[Vec<T>], d: u32) -> (Vec<T>, Vec<f64>) {
        let n = cols.len();
        assert!(n >= 3);
        let nb = cols[0].len().div_ceil(BLOCK);
        let share = |m: &[u8]| {
            if nb == 0 {
                1.0
            } else {
                m[..nb].iter().filter(|&&c| c != 0).count() as f64 / nb as f64
            }
        };
        let mut msg = Vec::new();
        sum_fixed(&cols[0], &cols[1], &mut msg).unwrap();
        let mut shares = vec![share(&msg)];
        for c in &cols[2..n - 1] {
            let mut next = Vec::new();
            merge_fixed(&msg, c, &mut next).unwrap();
            msg = next;
            shares.push(share(&msg));
        }
        let mut io = cols[n - 1].clone();
        merge_fixed_round(&msg, &mut io, Div(d), n).unwrap();
        (io, shares)
    }

    /// The exact sum of each element divided by `d`, rounded once: by
    /// `ExactSum` for `d` = 1 or a power of two (scaling the terms is
    /// exact away from underflow, which these tests stay clear of when
    /// `d` > 1), else compared through the general path's own division.
    fn exact<T: Element>(cols: &[Vec<T>], d: u32) -> Vec<T> {
        (0..cols[0].len())
            .map(|i| {
                let mut s = ExactSum::new();
                for c in cols {
                    s.add(c[i].to_f64() / f64::from(d));
                }
                s.round_to::<T>()
            })
            .collect()
    }

    fn bits<T: Element>(xs: &[T]) -> Vec<u64> {
        xs.iter()
            .map(|x| {
                let v = x.to_f64();
                if v.is_nan() { u64::MAX } else { v.to_bits() }
            })
            .collect()
    }

    fn rng(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed | 1;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        }
    }

    /// Columns of f32 whose blocks span `spread` binades below a per-block
    /// base exponent (10..240, subnormals below), the first value of each
    /// block at the base, each column's values scaled by 2^`lift[r]`.
    fn cols(seed: u64, lift: &[i32], len: usize, spread: u32) -> Vec<Vec<f32>> {
        let mut next = rng(seed);
        let bases: Vec<i32> = (0..len.div_ceil(BLOCK))
            .map(|_| (next() % 230) as i32 + 10)
            .collect();
        lift.iter()
            .map(|&l| {
                (0..len)
                    .map(|i| {
                        let u = next();
                        // the first value of a block sits at the top of its range
                        let off = if i % BLOCK == 0 {
                            0
                        } else {
                            (u >> 8) % (u64::from(spread) + 1)
                        };
                        let ex = (bases[i / BLOCK] + l - off as i32).clamp(0, 254) as u32;
                        let frac = (u >> 32) as u32 & 0x7f_ffff;
                        f32::from_bits((u32::from(u.is_multiple_of(2)) << 31) | (ex << 23) | frac)
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn narrow_blocks_stay_fixed_and_exact_for_every_group_size() {
        for n in 3..=9 {
            for len in [0, 1, 63, 64, 65, 64 * 5 + 17] {
                let c = cols(n as u64 * 31 + len as u64, &vec![0; n], len, 15);
                let (got, shares) = chain(&c, 1);
                assert_eq!(bits(&got), bits(&exact(&c, 1)), "n {n} len {len}");
                assert!(
                    shares.iter().all(|&s| s == 1.0),
                    "n {n} len {len}: {shares:?}"
                );
                // the fixed message is the code bytes and 8 bytes a lane
                let mut m = Vec::new();
                sum_fixed(&c[0], &c[1], &mut m).unwrap();
                assert_eq!(m.len(), len.div_ceil(BLOCK).next_multiple_of(8) + 8 * len);
            }
        }
    }

    #[test]
    fn blocks_that_do_not_fit_fall_back_exactly_at_every_step() {
        // (lifts per rank, spread): the first step's blocks too wide; a
        // later rank 2^7 above the first two (beyond the 6 binades of
        // headroom); a later rank 2^22 below; the last rank out of range
        for (k, (lift, spread)) in [
            (vec![0, 0, 0, 0], 22),
            (vec![0, 0, 7, 0], 10),
            (vec![0, 0, 0, 7], 10),
            (vec![0, 0, -22, 0, 0], 0),
            (vec![0, 0, 0, 0, -30], 5),
            (vec![0, 0, 6, 6, 6], 15),
            (vec![-5, 0, 3, -8, 1, 0, 2], 12),
        ]
        .into_iter()
        .enumerate()
        {
            let c = cols(k as u64 + 5, &lift, 64 * 6 + 3, spread);
            let (got, shares) = chain(&c, 1);
            assert_eq!(
                bits(&got),
                bits(&exact(&c, 1)),
                "case {k}: {lift:?} {spread}"
            );
            // cases 2 and 4 fall back in the last step, which sends nothing
            if [0, 1, 3].contains(&k) {
                assert!(shares.iter().any(|&s| s < 1.0), "case {k}: {shares:?}");
            } else {
                assert!(shares.iter().all(|&s| s == 1.0), "case {k}: {shares:?}");
            }
        }
    }

    #[test]
    fn specials_zeros_and_subnormals_fall_back_exactly() {
        let tiny = f32::from_bits(1);
        let specials = [
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -0.0,
            0.0,
            tiny,
            -tiny,
            f32::MIN_POSITIVE,
            f32::MAX,
            -f32::MAX,
        ];
        let mut next = rng(99);
        for n in 3..=6 {
            for step in 0..n {
                for &sp in &specials {
                    let mut c = cols(next(), &vec![0; n], 2 * BLOCK + 5, 8);
                    let at = (next() % (2 * BLOCK as u64 + 5)) as usize;
                    c[step][at] = sp;
                    let (got, _) = chain(&c, 1);
                    assert_eq!(bits(&got), bits(&exact(&c, 1)), "n {n} step {step} {sp:?}");
                }
            }
            // all zeros of both signs; all −0.0 stays −0.0
            let mut c = vec![vec![0.0f32; 70]; n];
            c[0][3] = -0.0;
            for col in &mut c {
                col[5] = -0.0;
                col[69] = tiny;
            }
            let (got, _) = chain(&c, 1);
            assert_eq!(bits(&got), bits(&exact(&c, 1)), "zeros n {n}");
            assert_eq!(got[5].to_bits(), (-0.0f32).to_bits());
            assert_eq!(got[3].to_bits(), 0);
        }
    }

    #[test]
    fn averages_round_once() {
        for n in [3usize, 4, 5, 6, 8] {
            let c = cols(n as u64 + 100, &vec![0; n], 64 * 4 + 9, 14);
            // keep clear of the subnormal range, where dividing each term
            // first would round
            let c: Vec<Vec<f32>> = c
                .into_iter()
                .map(|v| {
                    v.into_iter()
                        .map(|x| if x.abs() < 1e-30 { 1.0 } else { x })
                        .collect()
                })
                .collect();
            let (got, _) = chain(&c, n as u32);
            let want = exact(&c, n as u32);
            if n.is_power_of_two() {
                assert_eq!(bits(&got), bits(&want), "n {n}");
            } else {
                // the general path divides the exact sum with its own,
                // separately tested, division: compare with it
                let mut enc = Vec::new();
                super::super::encode(&c[0], &mut enc);
                for col in &c[1..] {
                    let mut e = Vec::new();
                    super::super::encode(col, &mut e);
                    let mut m = Vec::new();
                    super::super::merge(&enc, &e, col.len(), &mut m).unwrap();
                    enc = m;
                }
                let mut via = vec![0f32; got.len()];
                super::super::fused::decode_div(&enc, &mut via, Div(n as u32)).unwrap();
                assert_eq!(bits(&got), bits(&via), "n {n}");
            }
        }
    }

    #[test]
    fn half_precision_contributions_are_exact() {
        let c = cols(7, &[0, 1, -1, 0, 2], 64 * 3 + 1, 10);
        let b: Vec<Vec<bf16>> = c
            .iter()
            .map(|v| v.iter().map(|&x| bf16::from_f32(x * 1e-30)).collect())
            .collect();
        let (got, shares) = chain(&b, 1);
        assert_eq!(bits(&got), bits(&exact(&b, 1)));
        assert!(shares.iter().all(|&s| s > 0.5), "{shares:?}");
        let h: Vec<Vec<f16>> = c
            .iter()
            .map(|v| {
                v.iter()
                    .map(|&x| f16::from_f32((x * 1e-37).clamp(-6e4, 6e4)))
                    .collect()
            })
            .collect();
        let (got, _) = chain(&h, 1);
        assert_eq!(bits(&got), bits(&exact(&h, 1)));
    }

    /// [`sum_all_round`] of all columns into the last one.
    fn direct<T: Element>(cols: &[Vec<T>], d: u32) -> Vec<T> {
        let (last, peers) = cols.split_last().unwrap();
        let peers: Vec<&[T]> = peers.iter().map(|v| &v[..]).collect();
        let mut io = last.clone();
        sum_all_round(None, &peers, &mut io, Div(d)).unwrap();
        // the own contribution read from its own buffer: the same bits
        let mut out = vec![T::ZERO; last.len()];
        sum_all_round(Some(last), &peers, &mut out, Div(d)).unwrap();
        assert_eq!(bits(&out), bits(&io));
        io
    }

    #[test]
    fn direct_sums_are_exact_in_lanes_and_in_fallbacks() {
        let tiny = f32::from_bits(1);
        let specials = [f32::INFINITY, f32::NAN, -0.0, tiny, f32::MAX, 1e-38];
        let mut next = rng(5);
        for n in 2..=MAX_DIRECT {
            for len in [0, 1, 64, 64 * 3 + 7] {
                // narrow blocks (lanes), then a rank 2^30 above (fallback)
                let mut lift = vec![0; n];
                let c = cols(next(), &lift, len, 26);
                assert_eq!(bits(&direct(&c, 1)), bits(&exact(&c, 1)), "n {n} len {len}");
                lift[n / 2] = 30;
                let mut c = cols(next(), &lift, len, 10);
                assert_eq!(
                    bits(&direct(&c, 1)),
                    bits(&exact(&c, 1)),
                    "n {n} len {len} lifted"
                );
                if len > 0 {
                    for (r, col) in c.iter_mut().enumerate() {
                        col[(r * 13) % len] = specials[r % specials.len()];
                    }
                    assert_eq!(bits(&direct(&c, 1)), bits(&exact(&c, 1)), "n {n} specials");
                }
            }
            // the mean: a power of two is exact on the scaled terms
            if n.is_power_of_two() {
                let c: Vec<Vec<f32>> = cols(next(), &vec![0; n], 200, 20)
                    .into_iter()
                    .map(|v| {
                        v.into_iter()
                            .map(|x| if x.abs() < 1e-30 { 1.0 } else { x })
                            .collect()
                    })
                    .collect();
                assert_eq!(
                    bits(&direct(&c, n as u32)),
                    bits(&exact(&c, n as u32)),
                    "avg n {n}"
                );
            }
        }
        // sums and means in f32's subnormal range (the f64 sums of up to 4
        // narrow blocks round once there too)
        for (n, d) in [(3, 1), (3, 2), (4, 1), (4, 2), (4, 4), (5, 4)] {
            let c: Vec<Vec<f32>> = cols(next(), &vec![0; n], 200, 20)
                .into_iter()
                .map(|v| v.into_iter().map(|x| x * 1e-38).collect())
                .collect();
            assert_eq!(
                bits(&direct(&c, d)),
                bits(&exact(&c, d)),
                "subnormal n {n} d {d}"
            );
        }
        // the same contributions through the ring kernels give the same bits
        let c = cols(77, &[0, 3, -2, 1, 0], 64 * 4 + 1, 12);
        assert_eq!(bits(&direct(&c, 5)), bits(&chain(&c, 5).0));
        let h: Vec<Vec<bf16>> = c
            .iter()
            .map(|v| v.iter().map(|&x| bf16::from_f32(x * 1e-30)).collect())
            .collect();
        assert_eq!(bits(&direct(&h, 1)), bits(&exact(&h, 1)));
    }

    /// The AVX-512 merge of i64 lanes gives, lane by lane, the bits of
    /// summing the shifted lanes in i64 and rounding with `round_lane`
    /// (sums past 2^53: rounded to odd first) or `v as f64 · scale` (below):
    /// random lanes of 1 to 5 pieces with random shifts, sums near ±2^53
    /// and past it with halfway and sticky patterns at bit 11 and at f32's
    /// half-ulp, and tails shorter than eight lanes.
    #[test]
    #[allow(clippy::print_stderr)]
    fn vector_lane_merge_rounds_as_round_lane() {
        #[cfg(target_arch = "x86_64")]
        {
            if !(std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512dq")
                && std::arch::is_x86_feature_detected!("avx512vl"))
            {
                // past the harness's capture, so the test command counts it
                let _ = std::io::Write::write_all(
                    &mut std::io::stderr(),
                    b"SKIPPED: vector_lane_merge_rounds_as_round_lane: no AVX-512F/DQ/VL\n",
                );
                return;
            }
            let mut x = 0x2545_f491_4f6c_dd1du64;
            let mut next = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            for case in 0..400 {
                let n = 1 + case % 5;
                let len = 1 + (next() % 37) as usize;
                // magnitude of the lanes: below 2^53 after the sum, or up
                // to 2^61 with patterns that round at bit 11 and at f32's
                // half ulp of the result
                let bits = 20 + (next() % 40) as u32;
                let mut shifts: Vec<u32> = (0..n).map(|_| (next() % 3) as u32).collect();
                let mut lanes: Vec<Vec<i64>> = (0..n)
                    .map(|_| {
                        (0..len)
                            .map(|_| {
                                let mut v = (next() >> (64 - bits)) as i64;
                                match next() % 4 {
                                    0 => v = (v & !0xfff) | 0x800, // halfway at bit 11
                                    1 => v |= 1,                   // sticky below it
                                    2 => v = (v >> 40) << 40,      // exact in f32
                                    _ => {}
                                }
                                if next() % 2 == 0 { -v } else { v }
                            })
                            .collect()
                    })
                    .collect();
                let e = -((next() % 200) as i32) - 40;
                let scale = f64::from_bits(((e + 1023) as u64) << 52);
                if case % 3 == 0 {
                    // the first piece's lanes (the others zero, no shift):
                    // sums of 54 to 62 bits just above f32's halfway point
                    // by bits that f64 alone would round away (double
                    // rounding would tie to even, down)
                    for l in lanes.iter_mut().skip(1) {
                        l.fill(0);
                    }
                    shifts.fill(0);
                    for v in &mut lanes[0] {
                        let t = 54 + (next() % 9) as u32; // bit length
                        let half = t - 25;
                        let hi = (next() >> (64 - t)) | (1 << (t - 1));
                        let keep = !((1u64 << (half + 2)) - 1); // above the lsb
                        let low = 1 + next() % ((1 << (t - 53)) - 1).max(1);
                        let m = (hi & keep) | (1 << half) | low;
                        *v = if next() % 2 == 0 {
                            -(m as i64)
                        } else {
                            m as i64
                        };
                    }
                }
                let sums: Vec<i64> = (0..len)
                    .map(|i| {
                        lanes
                            .iter()
                            .zip(&shifts)
                            .fold(0i64, |s, (l, &sh)| s.wrapping_add(l[i] << sh))
                    })
                    .collect();
                let top = sums
                    .iter()
                    .map(|v| 64 - v.unsigned_abs().leading_zeros())
                    .max();
                if top.unwrap_or(0) > 62 {
                    continue;
                }
                let odd = top.unwrap_or(0) > 53;
                let ptrs: Vec<(*const i64, u32)> = lanes
                    .iter()
                    .zip(&shifts)
                    .map(|(l, &sh)| (l.as_ptr(), sh))
                    .collect();
                let mut got = vec![f32::NAN; len];
                // SAFETY: AVX-512F/DQ/VL checked; every piece holds `len`
                // lanes, `got` as many; sums below 2^63, scale normal.
                unsafe { x86::merge_round(&ptrs, len, scale, odd, got.as_mut_ptr()) };
                for (i, (&g, &v)) in got.iter().zip(&sums).enumerate() {
                    let want: f32 = if odd {
                        round_lane(v, scale)
                    } else {
                        f32::from_f64(v as f64 * scale)
                    };
                    assert_eq!(g.to_bits(), want.to_bits(), "case {case} lane {i}: sum {v}");
                }
            }
        }
    }

    #[test]
    fn corrupt_messages_are_errors() {
        let c = cols(3, &[0, 0, 0], 100, 5);
        let mut m = Vec::new();
        sum_fixed(&c[0], &c[1], &mut m).unwrap();
        let mut out = Vec::new();
        assert!(merge_fixed(&m[..m.len() - 1], &c[2], &mut out).is_err());
        assert!(merge_fixed(&m[..3], &c[2], &mut out).is_err());
        let mut long = m.clone();
        long.push(0);
        let mut io = c[2].clone();
        assert!(merge_fixed_round(&long, &mut io, Div(1), 3).is_err());
    }
}
