//! [`ExactSum`]: a superaccumulator that adds floating-point values with no
//! rounding at all.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::round::{self, Format};
use crate::simd::multiversion;
use crate::{Dtype, Element, Error};

/// Number of 64-bit limbs of the fixed-point accumulator.
const LIMBS: usize = 36;
/// Weight of bit 0 of limb 0: the accumulator holds `integer × 2^LOW`.
/// `-1088 = -17·64` sits below the smallest f64 subnormal, 2^-1074.
const LOW: i32 = -1088;
/// Elements per chunk of the fast paths: bounds the i64 window sums.
const CHUNK: usize = 4096;
/// Exponent window of the f64 fast path, whose 53-bit significands are split
/// into 27 + 26 bits: 4096 · (2^27 + 2^26) · 2^23 < 2^63.
const W64: u32 = 24;

const NAN: u8 = 1;
const POS_INF: u8 = 2;
const NEG_INF: u8 = 4;
/// Set once any value other than −0.0 has been added.
const NOT_ALL_NEG_ZERO: u8 = 8;

const MAGIC: &[u8; 4] = b"WXS1";

/// An exact, order-independent sum of floating-point values.
///
/// `ExactSum` keeps the running sum as a 2304-bit two's-complement fixed-point
/// number whose least significant bit is worth 2^-1088, below the smallest
/// `f64` subnormal. Every finite `f64`, `f32`, `f16` and `bf16` value is an
/// integer multiple of that bit, so each addition is exact: nothing is ever
/// rounded until [`to_f64`](Self::to_f64) / [`to_f32`](Self::to_f32) round
/// the exact total once, to nearest-even. Two consequences:
///
/// * the result does not depend on the order of the additions, nor on how
///   the values were split among partial accumulators that were then
///   [`merge`](Self::merge)d — bit for bit. This is what makes an all-reduce
///   reproducible for any world size and any algorithm;
/// * the result is the correctly rounded true sum: the best answer any
///   summation can give.
///
/// # Range
/// The accumulator holds magnitudes below 2^1215. Any sum of fewer than
/// 2^191 finite values (each below 2^1024) therefore fits, which no
/// realistic count approaches; there is no overflow check in the hot path.
///
/// # Special values
/// * `−0.0`: the exact sum of values that are all zero is `+0.0`, unless every
///   value added was `−0.0` (and there was at least one), in which case it is
///   `−0.0` — what sequential IEEE addition gives, in any order.
/// * Infinities and NaN are recorded in flags, not in the fixed-point sum:
///   the result is NaN if any NaN was added or both `+∞` and `−∞` were,
///   otherwise `±∞` if that infinity was added.
/// * A finite exact sum beyond the target type's range rounds to `±∞`, as
///   round-to-nearest does.
///
/// # Speed
/// [`add_slice`](Self::add_slice) processes chunks of 4096 values. For f32
/// (and f16/bf16, widened to f32 exactly) it finds the chunk's exponent
/// range, then splits each value exactly as `x = h·2^s + r` with an integer
/// `|h| <= 2^50`, using one float addition of a magic constant per value,
/// and sums the `h` in `i64` SIMD lanes; the wide accumulator is touched
/// once per chunk. A chunk whose exponents span at most 26 binades takes one
/// such split; up to 76 binades (nearly all gradients and activations), two
/// splits in the same pass; wider chunks peel 50 binades per extra pass. f64 values are split into two integer halves and
/// summed per exponent window of 24 binades. See
/// `cargo bench -p weft-numerics` for figures.
///
/// # Serialization
/// [`to_bytes`](Self::to_bytes) writes a compact, versioned little-endian
/// encoding (only the limbs that differ from the sign extension), which
/// [`from_bytes`](Self::from_bytes) validates.
///
/// # Example
/// ```
/// use weft_numerics::ExactSum;
///
/// let xs = [1e16f64, 1.0, -1e16];
/// let mut a = ExactSum::new();
/// a.add_slice(&xs);
/// assert_eq!(a.to_f64(), 1.0); // naive left-to-right summation gives 0.0
///
/// // Partition, sum the parts apart, merge: bitwise the same.
/// let mut left = ExactSum::new();
/// left.add_slice(&xs[..1]);
/// let mut right = ExactSum::new();
/// right.add_slice(&xs[1..]);
/// right.merge(&left);
/// assert_eq!(right, a);
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ExactSum {
    /// Two's-complement integer, little-endian limbs; value = integer · 2^LOW.
    limbs: [u64; LIMBS],
    /// Number of values added (wrapping at 2^64).
    count: u64,
    /// `NAN | POS_INF | NEG_INF | NOT_ALL_NEG_ZERO`.
    flags: u8,
}

impl Default for ExactSum {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for ExactSum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExactSum")
            .field("value", &self.to_f64())
            .field("count", &self.count)
            .field("flags", &self.flags)
            .finish()
    }
}

impl ExactSum {
    /// An empty sum (its value is `+0.0`).
    pub const fn new() -> Self {
        Self {
            limbs: [0; LIMBS],
            count: 0,
            flags: 0,
        }
    }

    /// Number of values added so far, including those of merged sums.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Adds one value, exactly.
    pub fn add<T: Element>(&mut self, x: T) {
        self.add_f64(x.to_f64());
    }

    fn add_f64(&mut self, x: f64) {
        self.count = self.count.wrapping_add(1);
        let b = x.to_bits();
        if b != 0x8000_0000_0000_0000 {
            self.flags |= NOT_ALL_NEG_ZERO;
        }
        let e = ((b >> 52) & 0x7ff) as i32;
        if e == 0x7ff {
            self.flags |= if b & 0x000f_ffff_ffff_ffff != 0 {
                NAN
            } else if x > 0.0 {
                POS_INF
            } else {
                NEG_INF
            };
            return;
        }
        let frac = b & 0x000f_ffff_ffff_ffff;
        let m = if e == 0 { frac } else { frac | (1 << 52) } as i64;
        let v = if x.is_sign_negative() { -m } else { m };
        self.add_int(v, e.max(1) - 1075);
    }

    /// Adds every value of `xs`, exactly. Fast paths for each element type.
    pub fn add_slice<T: Element>(&mut self, xs: &[T]) {
        match T::DTYPE {
            Dtype::F32 => {
                // SAFETY: T::DTYPE == F32 means T is f32 (the trait is
                // sealed); f32 and u32 have the same size and alignment.
                let bits =
                    unsafe { std::slice::from_raw_parts(xs.as_ptr().cast::<u32>(), xs.len()) };
                add_f32_bits(self, bits);
            }
            Dtype::F64 => {
                // SAFETY: T is f64, which has the layout of u64.
                let bits =
                    unsafe { std::slice::from_raw_parts(xs.as_ptr().cast::<u64>(), xs.len()) };
                add_f64_bits(self, bits);
            }
            Dtype::F16 => {
                // SAFETY: T is half::f16.
                let h = unsafe { std::slice::from_raw_parts(xs.as_ptr().cast::<f16>(), xs.len()) };
                self.add_half(h, |src, dst| src.convert_to_f32_slice(dst));
            }
            Dtype::BF16 => {
                // SAFETY: T is half::bf16.
                let h = unsafe { std::slice::from_raw_parts(xs.as_ptr().cast::<bf16>(), xs.len()) };
                self.add_half(h, |src, dst| src.convert_to_f32_slice(dst));
            }
        }
    }

    /// 16-bit values widen to f32 exactly; sum those.
    fn add_half<H: Copy>(&mut self, xs: &[H], widen: impl Fn(&[H], &mut [f32])) {
        let mut buf = [0f32; CHUNK];
        for c in xs.chunks(CHUNK) {
            let b = &mut buf[..c.len()];
            widen(c, b);
            // SAFETY: f32 and u32 have the same size and alignment, and every
            // bit pattern is a valid u32.
            let bits = unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<u32>(), b.len()) };
            add_f32_bits(self, bits);
        }
    }

    /// Adds another partial sum into this one, exactly.
    pub fn merge(&mut self, other: &ExactSum) {
        let mut carry = false;
        for (a, &b) in self.limbs.iter_mut().zip(other.limbs.iter()) {
            let (s1, c1) = a.overflowing_add(b);
            let (s2, c2) = s1.overflowing_add(u64::from(carry));
            *a = s2;
            carry = c1 || c2;
        }
        self.count = self.count.wrapping_add(other.count);
        self.flags |= other.flags;
    }

    /// Adds `v · 2^exp` (with `exp >= LOW`) into the limbs.
    #[inline]
    fn add_int(&mut self, v: i64, exp: i32) {
        if v == 0 {
            return;
        }
        debug_assert!(exp >= LOW);
        let pos = (exp - LOW) as u32;
        let limb = (pos / 64) as usize;
        let wide = i128::from(v) << (pos % 64);
        let lo = wide as u64;
        let hi = (wide >> 64) as u64;
        let (r0, c0) = self.limbs[limb].overflowing_add(lo);
        self.limbs[limb] = r0;
        let (r1, c1) = self.limbs[limb + 1].overflowing_add(hi);
        let (r1, c2) = r1.overflowing_add(u64::from(c0));
        self.limbs[limb + 1] = r1;
        let mut carry = c1 || c2;
        // Sign extension: add 0 (v >= 0) or all-ones (v < 0) plus the carry
        // to the remaining limbs; stop as soon as that changes nothing.
        let negative = v < 0;
        for l in &mut self.limbs[limb + 2..] {
            if negative == carry {
                break;
            }
            if negative {
                // l + 0xFF..FF = l − 1 with a carry out unless l was 0.
                carry = *l != 0;
                *l = l.wrapping_sub(1);
            } else {
                *l = l.wrapping_add(1);
                carry = *l == 0;
            }
        }
    }

    fn is_negative(&self) -> bool {
        self.limbs[LIMBS - 1] >> 63 == 1
    }

    /// The magnitude of the fixed-point integer.
    fn magnitude(&self) -> [u64; LIMBS] {
        let mut m = self.limbs;
        if self.is_negative() {
            let mut carry = true;
            for l in &mut m {
                let (s, c) = (!*l).overflowing_add(u64::from(carry));
                *l = s;
                carry = c;
            }
        }
        m
    }

    /// Rounds the exact sum once, to nearest-even, into format `f`; returns
    /// the bit pattern.
    fn round_bits(&self, f: Format) -> u64 {
        if self.flags & NAN != 0 || self.flags & (POS_INF | NEG_INF) == POS_INF | NEG_INF {
            return f.nan();
        }
        if self.flags & POS_INF != 0 {
            return f.inf();
        }
        if self.flags & NEG_INF != 0 {
            return f.inf() | f.sign_bit();
        }
        let negative = self.is_negative();
        let mag = self.magnitude();
        let Some(top) = highest_bit(&mag) else {
            let all_neg_zero = self.count > 0 && self.flags & NOT_ALL_NEG_ZERO == 0;
            return if all_neg_zero { f.sign_bit() } else { 0 };
        };
        let q = f.ulp_exp(top as i32 + LOW);
        let s = (q - LOW) as usize; // >= 1: every format's ulp is above 2^LOW
        let kept = extract_bits(&mag, s, f.mant_bits + 1);
        let guard = bit(&mag, s - 1);
        let sticky = any_below(&mag, s - 1);
        f.pack(negative, kept, q, guard && (sticky || kept & 1 == 1))
    }

    /// The exact sum, correctly rounded (to nearest-even) to `f64`.
    pub fn to_f64(&self) -> f64 {
        f64::from_bits(self.round_bits(round::F64))
    }

    /// The exact sum, correctly rounded to `f32` — directly from the exact
    /// value, not through `f64` (which would round twice).
    pub fn to_f32(&self) -> f32 {
        f32::from_bits(self.round_bits(round::F32) as u32)
    }

    /// The exact sum, correctly rounded to `T`.
    pub fn round_to<T: Element>(&self) -> T {
        match T::DTYPE {
            Dtype::F64 => T::from_f64(self.to_f64()),
            // Exact conversions: the value is already representable in T.
            Dtype::F32 => T::from_f32(self.to_f32()),
            Dtype::F16 => T::from_f32(f16::from_bits(self.round_bits(round::F16) as u16).to_f32()),
            Dtype::BF16 => {
                T::from_f32(bf16::from_bits(self.round_bits(round::BF16) as u16).to_f32())
            }
        }
    }

    /// Encodes the accumulator as bytes (for sending through collectives or
    /// storing in checkpoints).
    ///
    /// Layout (little-endian): magic `WXS1`, flags `u8`, count `u64`, first
    /// stored limb index `u8`, number of stored limbs `u8`, then those limbs
    /// as `u64`. Limbs outside the stored range equal the sign extension
    /// (all zeros, or all ones for a negative sum, as the top stored limb's
    /// high bit says), so a typical sum takes a few dozen bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let ext = if self.is_negative() { u64::MAX } else { 0 };
        let first = self.limbs.iter().position(|&l| l != 0).unwrap_or(0);
        // Keep the limb that carries the sign: trim only redundant extension limbs.
        let mut end = LIMBS;
        while end > first + 1
            && self.limbs[end - 1] == ext
            && (self.limbs[end - 2] >> 63 == ext >> 63)
        {
            end -= 1;
        }
        let n = if self.limbs.iter().all(|&l| l == 0) {
            0
        } else {
            end - first
        };
        let mut out = Vec::with_capacity(4 + 1 + 8 + 2 + 8 * n);
        out.extend_from_slice(MAGIC);
        out.push(self.flags);
        out.extend_from_slice(&self.count.to_le_bytes());
        out.push(first as u8);
        out.push(n as u8);
        for l in &self.limbs[first..first + n] {
            out.extend_from_slice(&l.to_le_bytes());
        }
        out
    }

    /// Decodes bytes written by [`to_bytes`](Self::to_bytes).
    ///
    /// # Errors
    /// [`Error::Decode`] naming what is wrong: bad magic, truncated input,
    /// trailing bytes, unknown flags or an out-of-range limb window.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, Error> {
        let fail = |reason: String| Error::Decode {
            what: "ExactSum",
            reason,
        };
        if bytes.len() < 15 {
            return Err(fail(format!(
                "{} bytes is shorter than the 15-byte header",
                bytes.len()
            )));
        }
        if &bytes[..4] != MAGIC {
            return Err(fail(format!(
                "magic is {:?}, expected {:?}",
                &bytes[..4],
                MAGIC
            )));
        }
        let flags = bytes[4];
        if flags & !(NAN | POS_INF | NEG_INF | NOT_ALL_NEG_ZERO) != 0 {
            return Err(fail(format!("unknown flag bits {flags:#010b}")));
        }
        let count = le_u64(&bytes[5..13]);
        let first = usize::from(bytes[13]);
        let n = usize::from(bytes[14]);
        if first + n > LIMBS {
            return Err(fail(format!(
                "limbs {first}..{} exceed the {LIMBS} limbs",
                first + n
            )));
        }
        let body = &bytes[15..];
        if body.len() != 8 * n {
            return Err(fail(format!(
                "{} limb bytes, expected {}",
                body.len(),
                8 * n
            )));
        }
        let mut limbs = [0u64; LIMBS];
        for (i, c) in body.chunks_exact(8).enumerate() {
            limbs[first + i] = le_u64(c);
        }
        if n > 0 && limbs[first + n - 1] >> 63 == 1 {
            for l in &mut limbs[first + n..] {
                *l = u64::MAX;
            }
        }
        Ok(Self {
            limbs,
            count,
            flags,
        })
    }
}

/// Little-endian u64 from exactly 8 bytes.
fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    u64::from_le_bytes(a)
}

fn highest_bit(m: &[u64; LIMBS]) -> Option<usize> {
    m.iter()
        .rposition(|&l| l != 0)
        .map(|i| i * 64 + 63 - m[i].leading_zeros() as usize)
}

fn bit(m: &[u64; LIMBS], i: usize) -> bool {
    (m[i / 64] >> (i % 64)) & 1 == 1
}

/// Bits `[s, s + n)` of `m`, `n <= 64`.
fn extract_bits(m: &[u64; LIMBS], s: usize, n: u32) -> u64 {
    let (l, o) = (s / 64, s % 64);
    let mut v = m[l] >> o;
    if o != 0 && l + 1 < LIMBS {
        v |= m[l + 1] << (64 - o);
    }
    if n < 64 { v & ((1 << n) - 1) } else { v }
}

/// Whether any bit below index `i` is set.
fn any_below(m: &[u64; LIMBS], i: usize) -> bool {
    let (l, o) = (i / 64, i % 64);
    m[..l].iter().any(|&x| x != 0) || (o != 0 && m[l] & ((1 << o) - 1) != 0)
}

/// Exponent range of a chunk of f32 bit patterns: (min exponent field over
/// nonzero values, 255 if none; max exponent field; whether any value is not
/// −0.0).
#[inline(always)]
fn scan_f32(c: &[u32]) -> (u32, u32, bool) {
    let (mut emin, mut emax, mut not_neg_zero) = (255u32, 0u32, 0u32);
    for &b in c {
        let e = (b >> 23) & 0xff;
        emax = emax.max(e);
        emin = emin.min(if b & 0x7fff_ffff == 0 { 255 } else { e });
        not_neg_zero |= b ^ 0x8000_0000;
    }
    (emin, emax, not_neg_zero != 0)
}

/// Binades covered by one level of the f32 path: each value is split as
/// `x = h·2^s + r` with `|h| <= 2^50` an integer and `|r| <= 2^(s-1)`.
const LEVEL: i32 = 50;

/// One level of the f32 path: returns `Σ h` for `h = round(x / 2^s)`,
/// exact for `|x| < 2^(s + LEVEL)`. Adding `M = 1.5·2^(52+s)` rounds `x` to a
/// multiple of `2^s` and leaves `t = M + h·2^s` in the binade of `M`, where
/// `t`'s bit pattern is `bits(M) + h`: one float add and one integer add per
/// value, in SIMD lanes, with no data-dependent shifts. The i64 sum wraps
/// harmlessly: the true total, at most 4096·2^50 in magnitude, fits.
#[inline(always)]
fn level_f32(c: &[f32], s: i32) -> i64 {
    let m = 1.5 * f64::from(s + 52).exp2();
    let sum = c.iter().fold(0i64, |acc, &x| {
        acc.wrapping_add((f64::from(x) + m).to_bits() as i64)
    });
    sum.wrapping_sub((m.to_bits() as i64).wrapping_mul(c.len() as i64))
}

/// Two levels in one pass, for chunks whose spread needs two: returns
/// `(Σ h₁, Σ h₂)` for `x = h₁·2^s + h₂·2^(s−LEVEL) + r` where the final
/// remainder `r` is known to be zero.
#[inline(always)]
fn two_levels_f32(c: &[f32], s: i32) -> (i64, i64) {
    let m1 = 1.5 * f64::from(s + 52).exp2();
    let m2 = 1.5 * f64::from(s - LEVEL + 52).exp2();
    let (a, b) = c.iter().fold((0i64, 0i64), |(a, b), &x| {
        let x = f64::from(x);
        let t1 = x + m1;
        let t2 = (x - (t1 - m1)) + m2;
        (
            a.wrapping_add(t1.to_bits() as i64),
            b.wrapping_add(t2.to_bits() as i64),
        )
    });
    let n = c.len() as i64;
    (
        a.wrapping_sub((m1.to_bits() as i64).wrapping_mul(n)),
        b.wrapping_sub((m2.to_bits() as i64).wrapping_mul(n)),
    )
}

/// As [`level_f32`] over f64 values (the remainders of earlier levels),
/// replacing each value by its remainder `r = x − h·2^s` (exact: it is the
/// part of `x` below `2^s`).
#[inline(always)]
fn level_rem(r: &mut [f64], s: i32) -> i64 {
    let m = 1.5 * f64::from(s + 52).exp2();
    let sum = r.iter_mut().fold(0i64, |acc, x| {
        let t = *x + m;
        *x -= t - m;
        acc.wrapping_add(t.to_bits() as i64)
    });
    sum.wrapping_sub((m.to_bits() as i64).wrapping_mul(r.len() as i64))
}

multiversion! {
    fn add_f32_bits(acc: &mut ExactSum, bits: &[u32]) {
        let mut rem = [0f64; CHUNK];
        for c in bits.chunks(CHUNK) {
            let (emin, emax, not_neg_zero) = scan_f32(c);
            if emax == 255 {
                for &b in c {
                    acc.add_f64(f64::from(f32::from_bits(b)));
                }
                continue;
            }
            acc.count = acc.count.wrapping_add(c.len() as u64);
            if not_neg_zero {
                acc.flags |= NOT_ALL_NEG_ZERO;
            }
            if emin == 255 {
                continue; // all zeros
            }
            // Every |x| < 2^(emax' − 126) and every bit of every x is worth
            // at least 2^(emin' − 150), where e' = max(e, 1).
            let mut s = emax.max(1) as i32 - 126 - LEVEL;
            let lowest = emin.max(1) as i32 - 150;
            // SAFETY: u32 and f32 have the same size and alignment, and every
            // bit pattern is a valid f32.
            let xs = unsafe { std::slice::from_raw_parts(c.as_ptr().cast::<f32>(), c.len()) };
            if lowest >= s {
                acc.add_int(level_f32(xs, s), s);
                continue;
            }
            if lowest >= s - LEVEL {
                let (h1, h2) = two_levels_f32(xs, s);
                acc.add_int(h1, s);
                acc.add_int(h2, s - LEVEL);
                continue;
            }
            // Wide exponent spread: peel LEVEL binades at a time, keeping
            // the exact remainders.
            let r = &mut rem[..c.len()];
            for (d, &x) in r.iter_mut().zip(xs) {
                *d = f64::from(x);
            }
            loop {
                acc.add_int(level_rem(r, s), s);
                if lowest >= s {
                    break;
                }
                s -= LEVEL;
            }
        }
    }
}

#[inline(always)]
fn scan_f64(c: &[u64]) -> (u64, u64, bool) {
    let (mut emin, mut emax, mut not_neg_zero) = (0x7ffu64, 0u64, 0u64);
    for &b in c {
        let e = (b >> 52) & 0x7ff;
        emax = emax.max(e);
        emin = emin.min(if b & 0x7fff_ffff_ffff_ffff == 0 {
            0x7ff
        } else {
            e
        });
        not_neg_zero |= b ^ 0x8000_0000_0000_0000;
    }
    (emin, emax, not_neg_zero != 0)
}

/// The exact sum of the f64 values `c` (bit patterns, every exponent in
/// one window) as an integer in units of 2^(`base` − 1075): each
/// significand is split into a low part of 26 bits at exponent `e` and a
/// high part of 27 bits at `e + 26`, shifted into place and added.
#[inline(always)]
fn window_f64(c: &[u64], base: u64) -> i64 {
    c.iter().fold(0i64, |acc, &b| {
        let e = (b >> 52) & 0x7ff;
        let m = (b & 0x000f_ffff_ffff_ffff) | (u64::from(e != 0) << 52);
        let lo = (m & ((1 << 26) - 1)) as i64;
        let hi = (m >> 26) as i64;
        let sh_lo = e.max(1).wrapping_sub(base);
        let sh_hi = sh_lo.wrapping_add(26);
        let v_lo = if sh_lo < u64::from(W64) {
            lo.wrapping_shl(sh_lo as u32)
        } else {
            0
        };
        let v_hi = if sh_hi < u64::from(W64) {
            hi.wrapping_shl(sh_hi as u32)
        } else {
            0
        };
        let s = (b as i64) >> 63;
        acc.wrapping_add(((v_lo + v_hi) ^ s) - s)
    })
}

multiversion! {
    fn add_f64_bits(acc: &mut ExactSum, bits: &[u64]) {
        for c in bits.chunks(CHUNK) {
            let (emin, emax, not_neg_zero) = scan_f64(c);
            if emax == 0x7ff {
                for &b in c {
                    acc.add_f64(f64::from_bits(b));
                }
                continue;
            }
            acc.count = acc.count.wrapping_add(c.len() as u64);
            if not_neg_zero {
                acc.flags |= NOT_ALL_NEG_ZERO;
            }
            if emin == 0x7ff {
                continue;
            }
            let (lo, hi) = (emin.max(1), emax.max(1) + 26);
            let mut base = lo;
            while base <= hi {
                acc.add_int(window_f64(c, base), base as i32 - 1075);
                base += u64::from(W64);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cancellation_is_exact() {
        let mut s = ExactSum::new();
        s.add_slice(&[1e300f64, 1.0, -1e300, 1e-300]);
        assert_eq!(s.to_f64(), 1.0 + 1e-300);
        let mut s = ExactSum::new();
        s.add_slice(&[f64::MAX, f64::MAX, -f64::MAX, -f64::MAX, 5e-324]);
        assert_eq!(s.to_f64(), 5e-324);
    }

    #[test]
    fn overflow_of_the_format_rounds_to_infinity() {
        let mut s = ExactSum::new();
        s.add_slice(&[f64::MAX, f64::MAX]);
        assert_eq!(s.to_f64(), f64::INFINITY);
        assert_eq!(s.to_f32(), f32::INFINITY);
        let mut s = ExactSum::new();
        s.add_slice(&[f32::MAX, f32::MAX / 2.0, -f32::MAX]);
        assert_eq!(s.to_f32(), f32::MAX / 2.0);
    }

    #[test]
    fn specials() {
        let sum = |xs: &[f32]| {
            let mut s = ExactSum::new();
            s.add_slice(xs);
            s.to_f32()
        };
        assert_eq!(sum(&[]).to_bits(), 0f32.to_bits());
        assert_eq!(sum(&[-0.0]).to_bits(), (-0f32).to_bits());
        assert_eq!(sum(&[-0.0, -0.0]).to_bits(), (-0f32).to_bits());
        assert_eq!(sum(&[-0.0, 0.0]).to_bits(), 0f32.to_bits());
        assert_eq!(sum(&[1.0, -1.0]).to_bits(), 0f32.to_bits());
        assert_eq!(sum(&[1.0, f32::INFINITY]), f32::INFINITY);
        assert_eq!(sum(&[1.0, f32::NEG_INFINITY]), f32::NEG_INFINITY);
        assert!(sum(&[f32::INFINITY, f32::NEG_INFINITY]).is_nan());
        assert!(sum(&[1.0, f32::NAN]).is_nan());
    }

    #[test]
    fn f32_rounds_directly_not_through_f64() {
        // 1 + 2^-24 + 2^-60: to f32 directly rounds up (above the tie);
        // through f64 it would first lose 2^-60, land on the tie and round
        // to even (1.0).
        let mut s = ExactSum::new();
        s.add_slice(&[1.0f64, 2f64.powi(-24), 2f64.powi(-60)]);
        assert_eq!(s.to_f32(), 1.0 + f32::EPSILON);
        assert_eq!(s.to_f64() as f32, 1.0);
    }

    #[test]
    fn sixteen_bit_rounding() {
        let mut s = ExactSum::new();
        s.add_slice(&[2048.0f32, 1.0, 2f32.powi(-20)]);
        assert_eq!(s.round_to::<f16>().to_f32(), 2050.0);
        let mut s = ExactSum::new();
        s.add_slice(&[f16::from_f32(1.0); 3000]);
        assert_eq!(s.to_f64(), 3000.0);
        assert_eq!(s.round_to::<bf16>().to_f32(), 3008.0);
    }

    #[test]
    fn bytes_round_trip_and_reject_garbage() {
        for xs in [
            vec![],
            vec![-3.5f64, 1e-310],
            vec![1e300, -1e-300],
            vec![-0.0],
        ] {
            let mut s = ExactSum::new();
            s.add_slice(&xs);
            let b = s.to_bytes();
            assert!(b.len() <= 15 + 8 * 34);
            assert_eq!(ExactSum::from_bytes(&b).unwrap(), s);
        }
        let mut s = ExactSum::new();
        s.add_slice(&[1.0f32, -3.0]);
        let b = s.to_bytes();
        assert!(b.len() <= 15 + 16, "{}", b.len());
        assert!(ExactSum::from_bytes(&b[..b.len() - 1]).is_err());
        let mut bad = b.clone();
        bad[0] = b'X';
        let err = ExactSum::from_bytes(&bad).unwrap_err();
        assert!(err.to_string().contains("magic"), "{err}");
        let mut bad = b;
        bad[14] = 40;
        assert!(ExactSum::from_bytes(&bad).is_err());
    }

    #[test]
    fn fast_paths_agree_with_one_at_a_time() {
        // Wide exponent spread forces the multi-window path.
        let xs: Vec<f32> = (0..10_000)
            .map(|i: i32| {
                let m = 1.0 + (i % 97) as f32 / 97.0;
                let sign = if i % 3 == 0 { -1.0 } else { 1.0 };
                sign * m * 2f32.powi((i * 37) % 250 - 140)
            })
            .collect();
        let mut fast = ExactSum::new();
        fast.add_slice(&xs);
        let mut slow = ExactSum::new();
        for &x in &xs {
            slow.add(x);
        }
        assert_eq!(fast, slow);
        let ys: Vec<f64> = xs
            .iter()
            .map(|&x| f64::from(x) * 2f64.powi(700))
            .chain([1e-320, -5e-324])
            .collect();
        let mut fast = ExactSum::new();
        fast.add_slice(&ys);
        let mut slow = ExactSum::new();
        for &y in &ys {
            slow.add(y);
        }
        assert_eq!(fast, slow);
    }
}
