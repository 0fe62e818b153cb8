//! Reproducible reductions: a compact, exact, mergeable encoding of
//! elementwise partial sums.
//!
//! # Why not `ExactSum` per element
//! [`weft_numerics::ExactSum`] is exact and order-independent, but it is a
//! 2304-bit accumulator: sending one per element would multiply the traffic
//! of an f32 all-reduce by ~75. Yet gradients in a small block of
//! neighbouring elements span a modest range of exponents, so their exact
//! sums fit in a few dozen bits once aligned to a shared exponent.
//!
//! # The encoding
//! A chunk of `len` elements is cut into blocks of [`BLOCK`] elements. Each
//! block is
//!
//! | bytes | field |
//! |---|---|
//! | 4 | `e: i32`, the weight of bit 0: element value = integer · 2^e |
//! | 1 | `w: u8`, 32-bit words per element (0: every element is zero) |
//! | 1 | `special: u8`, 1 if a flag byte per element follows |
//! | 2 | `bits: u16`, the largest magnitude bit length in the block |
//! | blen | (if `special`) per-element flags: NaN, +∞, −∞, "only −0.0 so far", "no contribution yet" |
//! | blen·4w | the integers, two's complement, little-endian 32-bit words |
//!
//! Encoding a value `±m·2^q` (m odd) sets `e` to the smallest `q` of the
//! block and `w` to the fewest words that hold every aligned integer. Two
//! encodings merge by aligning both blocks to the smaller exponent, widening
//! `w` as far as the aligned sum needs (one bit of carry per merge), and
//! adding integers: *exact* integer addition, so merging is associative and
//! commutative and the final value does not depend on how contributions
//! were grouped. Infinities and NaN are kept in the flags, as `ExactSum`
//! does. The width is unbounded in principle (up to 72 words = 2304 bits,
//! enough for any sum of f64 values), so there is no fallback that rounds:
//! an element whose block spans a wide exponent range simply costs more
//! words. Rounding to the buffer's dtype happens once, on the exact value,
//! to nearest-even — the same bits for any world size, algorithm or order.
//!
//! Typical f32 gradients need 2 words (8 bytes) per element, bf16 ones 1–2,
//! so partial sums travel at about 2× the native size; the final all-gather
//! moves native elements.
//!
//! # The reproducible ring
//! The reduce-scatter phase of [`Algorithm::Ring`] takes one of three
//! routes; the all-gather that follows moves native elements. None of them encodes a rank's whole buffer up front.
//!
//! - **Two ranks**: one step. Each rank receives the peer's native chunk
//!   and rounds the two-term sum at once: the sum of two values computed in
//!   f64 and rounded to f32, f16 or bf16 is the correctly rounded exact sum
//!   (53 ≥ 2p + 1). Same cost as the plain ring.
//! - **3 to 16 ranks in one [`Topology`](crate::Topology) domain, f32 / f16
//!   / bf16: direct.** Every rank sends chunk k of its buffer straight to
//!   rank k — (n−1)/n of the buffer, exactly the bytes the ring sends, in
//!   one step instead of n − 1 — and receives the n − 1 chunks of its own
//!   range through *nested* exchanges (each incoming message's sink runs
//!   the next receive), so that all n contributions are readable at once
//!   (on the thread backend: in the senders' own memory, no copy). Each
//!   block of [`BLOCK`] elements is then summed in one pass: scan the n
//!   blocks for the largest and smallest exponents; if every value lies
//!   within 27 binades below the largest ulp (and none is ±∞, NaN or
//!   −0.0), convert each to the integer `x / 2^e` with the magic constant
//!   below, add the n integers in i64 lanes in registers (below 2^55 for
//!   16 ranks) and round once; otherwise sum that block through the
//!   general encoding. No partial sum is ever written to memory, so the
//!   pass costs about what the plain ring's n − 1 reduction steps do.
//!   Within one domain the link pattern does not matter; across domains
//!   the ring's neighbour-only pattern does, hence:
//! - **Otherwise (several domains, more than 16 ranks, or f64): the
//!   ring.** Step 0 sends native values; its receiver picks one exponent
//!   per block from the two native blocks it holds (27 binades below their
//!   largest ulp, raised by 6 binades of headroom for larger values on
//!   later ranks) and writes the two-term sums as bare i64 lanes behind one
//!   code byte per block; every later step converts its own values at that
//!   exponent and adds them to the lanes (no realignment, no carry
//!   tracking: n ≤ 2048 terms below 2^51 stay below 2^62), and the last
//!   step rounds each lane into the output. A block whose values do not
//!   fit (checked per block by one scan of the rank's own values) switches
//!   to the general, self-describing encoding for the rest of the ring.
//!   f64 buffers, and groups beyond 2048 ranks, use the general encoding
//!   throughout (step 0 adds native values into it; later steps merge
//!   their native values straight into the received encoding).
//!
//! Recursive doubling and the hierarchical algorithm encode whole chunks
//! and merge encodings. Every route computes the exact sum, so all give the
//! same bits. `Avg` divides the *exact* sum by the group size and rounds
//! once (a power of two is an exponent shift; other divisors a
//! multiply-high reciprocal with a sticky remainder).
//!
//! The measured cost against the plain ring is in the crate documentation
//! ("What the collectives cost").
//!
//! # Exact partials
//! [`ExactPartial`] holds this encoding for a whole gradient and adds
//! micro-batches into it in place; the collectives
//! [`all_reduce_exact`](crate::CommunicatorExt::all_reduce_exact) and
//! [`reduce_scatter_exact`](crate::CommunicatorExt::reduce_scatter_exact)
//! reduce such partials across ranks, so that a global batch split over any
//! number of ranks in any proportion gives the bits of one rank. Like the
//! reproducible ring, they reduce directly for 3 to 16 ranks in one domain
//! (each rank sends the encoded blocks covering chunk k to rank k, which
//! sums all n pieces block by block — in i64 lanes when every piece's
//! block is two words without flags — and rounds once), and by a ring of
//! merges otherwise. A partial holding one f32 contribution keeps it as
//! values until a second arrives; when every rank's does (learnt from the
//! 16 bytes of counts per rank that `Avg` gathers anyway, or gathered for
//! f32 results from 16 Ki elements on), the exact reductions run the
//! reproducible reduce-scatter above on those values: the same bits, from
//! half the bytes.
//!
//! # Speed
//! An f32 block whose values span at most 27 binades (gradients almost
//! always do) is encoded without per-element shifts: with the block
//! exponent `e`, adding `M = 1.5·2^(52+e)` to a value `x` (as f64) gives a
//! float whose bit pattern minus `bits(M)` is `x / 2^e` exactly, as in
//! `weft_numerics::ExactSum`'s f32 path. Merging two such blocks shifts and
//! adds i64 lanes; decoding a block whose integers stay below 2^52 converts
//! them to f64 exactly, scales by 2^e and rounds once; larger two-word
//! integers are first rounded to odd at bit 11 (exact in f64, ≥ 42 bits, so
//! the one rounding to f32/f16/bf16 stays correct). Merging native f32
//! values into a two-word block converts them at the block's exponent with
//! the same magic constant, in place for [`ExactPartial::add`]. The direct
//! and fixed-lane routes of the ring (above) use the same conversion with
//! the exponent fixed per block, so their inner loops are a float add, an
//! integer subtract and an integer add per value. These loops are
//! compiled for baseline, AVX2 and AVX-512 and picked at run time
//! (`WEFT_SIMD` caps the level). Other blocks take the general path, which
//! is exact for any input. `examples/repro_profile.rs` times the phases
//! and, with `ring|repro LEN RANKS REPS`, runs only plain or reproducible
//! all-reduces for `perf stat`.

use weft_numerics::{Dtype, Element, bf16, f16, multiversion};

use crate::algo::{abort_on, all_gather_chunks, gather_nested};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::types::{
    Algorithm, Buf, BufMut, Incoming, OpCtx, OpKind, Outgoing, ReduceOp, shard_range,
};

/// Elements per block of the exact encoding.
pub const BLOCK: usize = 64;
/// Largest width in 32-bit words.
const WMAX: usize = 72;
const HEADER: usize = 8;

const F_NAN: u8 = 1;
const F_PINF: u8 = 2;
const F_NINF: u8 = 4;
const F_NEGZERO: u8 = 8;
/// No contribution at all (with [`F_NEGZERO`], the identity of merging):
/// rounds to +0.0, and any contribution clears it.
const F_EMPTY: u8 = 16;

/// The zero an element with flags `f` and value zero rounds to: −0.0 only
/// if every contribution was −0.0 and there was at least one.
#[inline]
fn signed_zero(f: u8) -> f64 {
    if f & (F_NEGZERO | F_EMPTY) == F_NEGZERO {
        -0.0
    } else {
        0.0
    }
}

type Big = [u32; WMAX];

/// Decomposes a finite nonzero f64 into (negative, odd m, q): |x| = m·2^q.
#[inline]
fn split_f64(x: f64) -> (bool, u64, i32, u8) {
    let b = x.to_bits();
    let neg = b >> 63 == 1;
    let ex = ((b >> 52) & 0x7ff) as i32;
    let frac = b & ((1u64 << 52) - 1);
    if ex == 0x7ff {
        let f = if frac != 0 {
            F_NAN
        } else if neg {
            F_NINF
        } else {
            F_PINF
        };
        return (neg, 0, 0, f);
    }
    let m = if ex == 0 { frac } else { frac | (1 << 52) };
    if m == 0 {
        return (neg, 0, 0, if neg { F_NEGZERO } else { 0 });
    }
    let tz = m.trailing_zeros();
    (neg, m >> tz, ex.max(1) - 1075 + tz as i32, 0)
}

fn bitlen64(x: u64) -> u32 {
    64 - x.leading_zeros()
}

fn words_for(mag_bits: u32) -> usize {
    // one extra bit for the sign
    (mag_bits as usize + 1).div_ceil(32)
}

fn put_header(out: &mut Vec<u8>, e: i32, w: usize, special: bool, bits: u32) {
    out.extend_from_slice(&e.to_le_bytes());
    out.push(w as u8);
    out.push(u8::from(special));
    out.extend_from_slice(&(bits as u16).to_le_bytes());
}

/// Binades below a block's largest f32 ulp that the f32 fast path keeps:
/// aligned integers then stay below 2^(24 + 27) = 2^51, the range of the
/// magic-constant conversion, and leave 12 bits of headroom in two words
/// for carries (4096 merges before a block widens to three words).
const FAST_SPREAD: i32 = 27;

mod fixed;
mod fused;
mod partial;

pub use partial::ExactPartial;
pub(crate) use partial::{reduce_scatter_add_exact, reduce_scatter_exact};

/// Appends `(a[i] << sa) + (b[i] << sb)` for the first `n` little-endian
/// i64 words of `a` and `b`; returns the OR of the results' magnitudes
/// (as `s ^ (s >> 63)`), whose bit length bounds them.
///
/// # Panics
/// If `a` or `b` holds fewer than `n` words.
#[inline(always)]
fn merge_words(a: &[u8], b: &[u8], sa: u32, sb: u32, n: usize, out: &mut Vec<u8>) -> u64 {
    let (a, b) = (&a[..8 * n], &b[..8 * n]);
    out.reserve(8 * n);
    let at = out.len();
    let dst = out.spare_capacity_mut()[..8 * n].as_mut_ptr().cast::<i64>();
    let pa = a.as_ptr().cast::<i64>();
    let pb = b.as_ptr().cast::<i64>();
    let mut acc = 0u64;
    for i in 0..n {
        // SAFETY: `a` and `b` hold 8·n bytes (sliced above) and `dst` 8·n
        // spare bytes (reserved above), so word i is in bounds of each;
        // unaligned access is allowed.
        let s = unsafe {
            let s = (i64::from_le(pa.add(i).read_unaligned()) << sa)
                + (i64::from_le(pb.add(i).read_unaligned()) << sb);
            dst.add(i).write_unaligned(s.to_le());
            s
        };
        acc |= (s ^ (s >> 63)) as u64;
    }
    // SAFETY: the 8·n bytes after `at` were written by the loop.
    unsafe { out.set_len(at + 8 * n) };
    acc
}

/// One pass over a block of f32 bit patterns: the largest biased
/// exponent, the smallest biased exponent of a nonzero value (subnormals
/// count as 1; `0x100` if every value is zero) and whether a −0.0 occurs.
#[inline(always)]
fn scan_f32(bits: &[u32]) -> (u32, u32, bool) {
    let mut emax = 0u32;
    let mut emin = 0x100u32;
    let mut negzero = false;
    for &b in bits {
        let ex = (b >> 23) & 0xff;
        emax = emax.max(ex);
        emin = emin.min(if b & 0x7fff_ffff != 0 {
            ex.max(1)
        } else {
            0x100
        });
        negzero |= b == 0x8000_0000;
    }
    (emax, emin, negzero)
}

/// The magic constant `1.5·2^(52+e)` (built from bits; 52 + e must be a
/// normal f64 exponent) and its bit pattern: for an f32 value `x` that is
/// a multiple of 2^e below 2^(e+51) in magnitude, `bits(x + M) − bits(M)`
/// is `x / 2^e` exactly.
#[inline(always)]
fn magic(e: i32) -> (f64, i64) {
    let m = f64::from_bits(((1023 + 52 + e) as u64) << 52 | 1 << 51);
    (m, m.to_bits() as i64)
}

/// Encodes one block of f32 bit patterns with `w = 2` and `e` = (largest
/// ulp exponent − [`FAST_SPREAD`]) if every value is finite, not −0.0 and
/// exact at that `e`; returns `false` (writing nothing) otherwise.
///
/// Each value becomes `round(x / 2^e)` by one float add of the magic
/// constant `1.5·2^(52+e)` (exact here, as every value is a multiple of
/// 2^e below 2^(e+51)) and one integer subtraction: no data-dependent
/// shifts, so the loop runs in SIMD lanes.
#[inline(always)]
fn encode_f32_fast(bits: &[u32], out: &mut Vec<u8>) -> bool {
    let (emax, emin, negzero) = scan_f32(bits);
    if emax == 0xff || emin == 0x100 || negzero || (emax.max(1) - emin) as i32 > FAST_SPREAD {
        return false;
    }
    // element value = m · 2^(max(E,1) − 150); block exponent e:
    let e = emax.max(1) as i32 - 150 - FAST_SPREAD;
    let (m, m_bits) = magic(e);
    let start = out.len();
    put_header(out, e, 2, false, 0);
    let n = bits.len();
    out.reserve(8 * n);
    let at = out.len();
    let dst = out.spare_capacity_mut()[..8 * n].as_mut_ptr().cast::<i64>();
    let mut acc = 0u64;
    for (i, &b) in bits.iter().enumerate() {
        let t = f64::from(f32::from_bits(b)) + m;
        let h = t.to_bits() as i64 - m_bits;
        acc |= (h ^ (h >> 63)) as u64;
        // SAFETY: `dst` has 8·n spare bytes reserved above and i < n;
        // unaligned writes are allowed.
        unsafe { dst.add(i).write_unaligned(h.to_le()) };
    }
    // SAFETY: the 8·n bytes after `at` were written by the loop.
    unsafe { out.set_len(at + 8 * n) };
    let nb = bitlen64(acc) as u16;
    out[start + 6..start + 8].copy_from_slice(&nb.to_le_bytes());
    true
}

multiversion! {
    /// The f32 encoder: the fast path per block, else the general one.
    fn encode_f32(xs: &[f32], out: &mut Vec<u8>) {
        for blk in xs.chunks(BLOCK) {
            let bits: [u32; BLOCK] = std::array::from_fn(|i| blk.get(i).map_or(0, |x| x.to_bits()));
            if !encode_f32_fast(&bits[..blk.len()], out) {
                encode_general(blk, out);
            }
        }
    }
}

/// Appends the exact encoding of `xs` to `out`.
pub fn encode<T: Element>(xs: &[T], out: &mut Vec<u8>) {
    if T::DTYPE == Dtype::F32 {
        // SAFETY: T is f32 (the trait is sealed), the same type.
        let f = unsafe { std::slice::from_raw_parts(xs.as_ptr().cast::<f32>(), xs.len()) };
        encode_f32(f, out);
        return;
    }
    encode_general(xs, out);
}

fn encode_general<T: Element>(xs: &[T], out: &mut Vec<u8>) {
    let mut neg = [false; BLOCK];
    let mut ms = [0u64; BLOCK];
    let mut qs = [0i32; BLOCK];
    let mut fl = [0u8; BLOCK];
    for blk in xs.chunks(BLOCK) {
        let bl = blk.len();
        let mut e = i32::MAX;
        let mut special = false;
        for (i, x) in blk.iter().enumerate() {
            let (n, m, q, f) = split_f64(x.to_f64());
            neg[i] = n;
            ms[i] = m;
            qs[i] = q;
            fl[i] = f;
            special |= f != 0;
            if m != 0 {
                e = e.min(q);
            }
        }
        if e == i32::MAX {
            put_header(out, 0, 0, special, 0);
            if special {
                out.extend_from_slice(&fl[..bl]);
            }
            continue;
        }
        let mut bits = 0u32;
        for i in 0..bl {
            if ms[i] != 0 {
                bits = bits.max(bitlen64(ms[i]) + (qs[i] - e) as u32);
            }
        }
        let w = words_for(bits);
        put_header(out, e, w, special, bits);
        if special {
            out.extend_from_slice(&fl[..bl]);
        }
        if w <= 2 {
            let start = out.len();
            out.resize(start + 4 * w * bl, 0);
            let dst = &mut out[start..];
            for i in 0..bl {
                let v = if ms[i] == 0 {
                    0
                } else {
                    (ms[i] << (qs[i] - e)) as i64
                };
                let v = if neg[i] { -v } else { v };
                dst[4 * w * i..4 * w * (i + 1)].copy_from_slice(&v.to_le_bytes()[..4 * w]);
            }
        } else {
            for i in 0..bl {
                let mut big = [0u32; WMAX];
                if ms[i] != 0 {
                    shl_add_u64(&mut big, ms[i], (qs[i] - e) as u32);
                    if neg[i] {
                        negate(&mut big);
                    }
                }
                for wd in &big[..w] {
                    out.extend_from_slice(&wd.to_le_bytes());
                }
            }
        }
    }
}

#[inline]
fn put_words_i64(out: &mut Vec<u8>, v: i64, w: usize) {
    let b = v.to_le_bytes();
    out.extend_from_slice(&b[..4 * w]);
}

#[inline]
fn get_i64(data: &[u8], i: usize, w: usize) -> i64 {
    match w {
        1 => i64::from(i32::from_le_bytes(
            data[4 * i..4 * i + 4].try_into().expect("4 bytes"),
        )),
        2 => i64::from_le_bytes(data[8 * i..8 * i + 8].try_into().expect("8 bytes")),
        _ => 0,
    }
}

fn shl_add_u64(big: &mut Big, m: u64, shift: u32) {
    let word = (shift / 32) as usize;
    let bit = shift % 32;
    let wide = u128::from(m) << bit;
    for k in 0..4 {
        if word + k < WMAX {
            big[word + k] = (wide >> (32 * k)) as u32;
        }
    }
}

fn negate(big: &mut Big) {
    let mut carry = 1u64;
    for w in big.iter_mut() {
        let s = u64::from(!*w) + carry;
        *w = s as u32;
        carry = s >> 32;
    }
}

fn load_big(data: &[u8], i: usize, w: usize) -> Big {
    let mut big = [0u32; WMAX];
    let base = 4 * w * i;
    for (k, wd) in big.iter_mut().enumerate().take(w) {
        *wd = u32::from_le_bytes(
            data[base + 4 * k..base + 4 * k + 4]
                .try_into()
                .expect("4 bytes"),
        );
    }
    if w > 0 && big[w - 1] >> 31 == 1 {
        for wd in &mut big[w..] {
            *wd = u32::MAX;
        }
    }
    big
}

fn shl_big(big: &Big, shift: u32) -> Big {
    let word = (shift / 32) as usize;
    let bit = shift % 32;
    let mut out = [0u32; WMAX];
    for k in (word..WMAX).rev() {
        let lo = big[k - word];
        let below = if bit > 0 && k > word {
            big[k - word - 1] >> (32 - bit)
        } else {
            0
        };
        out[k] = (lo << bit) | below;
    }
    // sign-extend into the vacated... (left shift keeps the sign if it fits)
    out
}

fn add_big(a: &mut Big, b: &Big) {
    let mut carry = 0u64;
    for (x, y) in a.iter_mut().zip(b) {
        let s = u64::from(*x) + u64::from(*y) + carry;
        *x = s as u32;
        carry = s >> 32;
    }
}

/// (negative, magnitude) of a two's-complement big integer.
fn magnitude(big: &Big) -> (bool, Big) {
    let neg = big[WMAX - 1] >> 31 == 1;
    let mut m = *big;
    if neg {
        negate(&mut m);
    }
    (neg, m)
}

fn big_bitlen(m: &Big) -> u32 {
    match m.iter().rposition(|&w| w != 0) {
        Some(k) => 32 * k as u32 + (32 - m[k].leading_zeros()),
        None => 0,
    }
}

struct BlockRef<'a> {
    e: i32,
    w: usize,
    bits: u32,
    flags: Option<&'a [u8]>,
    data: &'a [u8],
}

#[cold]
#[inline(never)]
fn corrupt(reason: String) -> Error {
    Error::Decode {
        op: OpKind::AllReduce,
        reason,
    }
}

#[inline(always)]
fn read_block<'a>(bytes: &'a [u8], pos: &mut usize, bl: usize) -> Result<BlockRef<'a>> {
    let p = *pos;
    if bytes.len() < p + HEADER {
        return Err(corrupt(format!("truncated block header at byte {p}")));
    }
    let e = i32::from_le_bytes(bytes[p..p + 4].try_into().expect("4 bytes"));
    let w = usize::from(bytes[p + 4]);
    let special = bytes[p + 5];
    let bits = u32::from(u16::from_le_bytes(
        bytes[p + 6..p + 8].try_into().expect("2 bytes"),
    ));
    if w > WMAX || special > 1 || (w > 0 && words_for(bits) > w) {
        return Err(corrupt(format!(
            "bad block header at byte {p}: w {w}, special {special}, bits {bits}"
        )));
    }
    let mut q = p + HEADER;
    let flags = if special == 1 {
        if bytes.len() < q + bl {
            return Err(corrupt(format!("truncated flags at byte {q}")));
        }
        q += bl;
        Some(&bytes[q - bl..q])
    } else {
        None
    };
    let dl = 4 * w * bl;
    if bytes.len() < q + dl {
        return Err(corrupt(format!("truncated block data at byte {q}")));
    }
    *pos = q + dl;
    Ok(BlockRef {
        e,
        w,
        bits,
        flags,
        data: &bytes[q..q + dl],
    })
}

/// Merges two encodings of `len` elements into `out` (cleared first).
///
/// # Panics
/// Never: the `expect`s convert slices of exactly 8 bytes (from
/// `chunks_exact(8)`) into arrays.
///
/// # Errors
/// [`Error::Decode`] if either input is not a valid encoding of `len` elements.
pub fn merge(a: &[u8], b: &[u8], len: usize, out: &mut Vec<u8>) -> Result<()> {
    merge_mv(a, b, len, out)
}

multiversion! {
fn merge_mv(a: &[u8], b: &[u8], len: usize, out: &mut Vec<u8>) -> Result<()> {
    out.clear();
    out.reserve(a.len().max(b.len()) + 64);
    let (mut pa, mut pb) = (0, 0);
    for start in (0..len).step_by(BLOCK) {
        let bl = BLOCK.min(len - start);
        if let (Some(x), Some(y)) = (two_words(a, pa, bl), two_words(b, pb, bl)) {
            // two plain two-word blocks (the usual case), read in place:
            // what `merge_block` writes for them when the sum needs two
            // words too
            let e = x.0.min(y.0);
            let (sx, sy) = (i64::from(x.0) - i64::from(e), i64::from(y.0) - i64::from(e));
            let need = (i64::from(x.1) + sx).max(i64::from(y.1) + sy) + 1;
            if (32..=63).contains(&need) {
                let at = out.len();
                put_header(out, e, 2, false, 0);
                let (da, db) = (pa + HEADER, pb + HEADER);
                let acc = merge_words(
                    &a[da..da + 8 * bl],
                    &b[db..db + 8 * bl],
                    sx as u32,
                    sy as u32,
                    bl,
                    out,
                );
                let bits = bitlen64(acc) as u16;
                out[at + 6..at + 8].copy_from_slice(&bits.to_le_bytes());
                pa = da + 8 * bl;
                pb = db + 8 * bl;
                continue;
            }
        }
        let x = read_block(a, &mut pa, bl)?;
        let y = read_block(b, &mut pb, bl)?;
        merge_block(&x, &y, bl, out)?;
    }
    if pa != a.len() || pb != b.len() {
        return Err(corrupt(format!(
            "trailing bytes: {} and {} of {} and {}",
            a.len() - pa,
            b.len() - pb,
            a.len(),
            b.len()
        )));
    }
    Ok(())
}
}

/// The exponent, bit length and data of the block at byte `p` of `bytes`
/// if it is two words per element without flags and all there.
#[inline(always)]
pub(super) fn two_words(bytes: &[u8], p: usize, bl: usize) -> Option<(i32, u32, *const i64)> {
    let h = bytes.get(p..p + HEADER + 8 * bl)?;
    if h[4] != 2 || h[5] != 0 {
        return None;
    }
    let e = i32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    let bits = u32::from(u16::from_le_bytes([h[6], h[7]]));
    Some((e, bits, h[HEADER..].as_ptr().cast::<i64>()))
}

/// Appends the exact sum of two blocks of `bl` elements to `out`.
#[inline(always)]
fn merge_block(x: &BlockRef<'_>, y: &BlockRef<'_>, bl: usize, out: &mut Vec<u8>) -> Result<()> {
    let mut vals = [0i64; BLOCK];
    // Flags: NaN/∞ accumulate, "only −0.0" needs both.
    let mut flags = [0u8; BLOCK];
    let mut special = false;
    if x.flags.is_some() || y.flags.is_some() {
        for (i, f) in flags.iter_mut().enumerate().take(bl) {
            let fa = x.flags.map_or(0, |v| v[i]);
            let fb = y.flags.map_or(0, |v| v[i]);
            // A nonzero contribution never carries F_NEGZERO, so the
            // flag survives only if both sides saw nothing but −0.0; and
            // "no contribution" only if neither side had one.
            let neg0 = fa & fb & (F_NEGZERO | F_EMPTY);
            *f = ((fa | fb) & (F_NAN | F_PINF | F_NINF)) | neg0;
            special |= *f != 0;
        }
    }
    if x.w == 0 || y.w == 0 {
        let z = if x.w == 0 { &y } else { &x };
        put_header(out, z.e, z.w, special, z.bits);
        if special {
            out.extend_from_slice(&flags[..bl]);
        }
        out.extend_from_slice(z.data);
        return Ok(());
    }
    let e = x.e.min(y.e);
    let sa = (x.e - e) as u32;
    let sb = (y.e - e) as u32;
    let need = (x.bits + sa).max(y.bits + sb) + 1;
    let w = words_for(need);
    if w > WMAX {
        return Err(corrupt(format!(
            "merged block needs {w} words (more than {WMAX})"
        )));
    }
    if x.w == 2 && y.w == 2 && w == 2 {
        // The common case: two words in and out: shift and add i64 lanes.
        let start = out.len();
        put_header(out, e, 2, special, 0);
        if special {
            out.extend_from_slice(&flags[..bl]);
        }
        let bits = bitlen64(merge_words(x.data, y.data, sa, sb, bl, out));
        out[start + 6..start + 8].copy_from_slice(&(bits as u16).to_le_bytes());
        return Ok(());
    }
    if w <= 2 {
        let mut acc = 0u64;
        for (i, v) in vals.iter_mut().enumerate().take(bl) {
            let s = (get_i64(x.data, i, x.w) << sa) + (get_i64(y.data, i, y.w) << sb);
            acc |= (s ^ (s >> 63)) as u64;
            *v = s;
        }
        let bits = bitlen64(acc);
        if bits == 0 {
            put_header(out, 0, 0, special, 0);
            if special {
                out.extend_from_slice(&flags[..bl]);
            }
            return Ok(());
        }
        let w = words_for(bits);
        put_header(out, e, w, special, bits);
        if special {
            out.extend_from_slice(&flags[..bl]);
        }
        for &v in &vals[..bl] {
            put_words_i64(out, v, w);
        }
    } else {
        let mut sums: Vec<Big> = Vec::with_capacity(bl);
        let mut bits = 0;
        for i in 0..bl {
            let mut s = shl_big(&load_big(x.data, i, x.w), sa);
            add_big(&mut s, &shl_big(&load_big(y.data, i, y.w), sb));
            bits = bits.max(big_bitlen(&magnitude(&s).1));
            sums.push(s);
        }
        let w = if bits == 0 { 0 } else { words_for(bits) };
        put_header(out, if w == 0 { 0 } else { e }, w, special, bits);
        if special {
            out.extend_from_slice(&flags[..bl]);
        }
        for s in &sums {
            for wd in &s[..w] {
                out.extend_from_slice(&wd.to_le_bytes());
            }
        }
    }
    Ok(())
}

/// Target format parameters: precision p (with the implicit bit), lowest
/// ulp exponent, largest exponent.
fn fmt_of(d: Dtype) -> (u32, i32, i32) {
    match d {
        Dtype::F64 => (53, -1074, 1023),
        Dtype::F32 => (24, -149, 127),
        Dtype::F16 => (11, -24, 15),
        Dtype::BF16 => (8, -133, 127),
    }
}

/// Rounds ±(mag·2^e + sticky·tiny) to nearest-even in dtype `d`, as an f64
/// holding a value representable in `d` (or ±∞).
fn round_mag(neg: bool, mag: u64, e: i32, sticky: bool, d: Dtype) -> f64 {
    let (p, emin, emax) = fmt_of(d);
    let sign = if neg { -1.0 } else { 1.0 };
    if mag == 0 {
        return 0.0 * sign;
    }
    let l = bitlen64(mag) as i32;
    let top = e + l - 1;
    let q = (top - (p as i32 - 1)).max(emin);
    let shift = q - e;
    let (mut kept, mut q) = if shift <= 0 {
        (mag << (-shift) as u32, q)
    } else {
        let kept = if shift >= 64 { 0 } else { mag >> shift };
        let rbit = if shift > 64 {
            false
        } else {
            (mag >> (shift - 1)) & 1 == 1
        };
        let below = if shift > 64 {
            mag != 0
        } else {
            mag & ((1u64 << (shift - 1)) - 1) != 0
        };
        let up = rbit && (below || sticky || kept & 1 == 1);
        (kept + u64::from(up), q)
    };
    if kept == 1u64 << p {
        kept >>= 1;
        q += 1;
    }
    if kept == 0 {
        return 0.0 * sign;
    }
    if q + bitlen64(kept) as i32 - 1 > emax {
        return f64::INFINITY * sign;
    }
    sign * ldexp_exact(kept, q)
}

/// `v · 2^e` rounded once to dtype `d`, as an f64. For targets narrower than
/// f64 the integer is first rounded *to odd* at 53 bits (truncate, set the
/// last bit if anything was cut), which makes the second rounding to
/// p ≤ 51 bits correct (Boldo & Melquiond, "When double rounding is odd").
#[inline]
fn fast_round(v: i64, e: i32, d: Dtype) -> f64 {
    let mag = v.unsigned_abs();
    if d == Dtype::F64 || !(-900..=900).contains(&e) {
        return round_mag(v < 0, mag, e, false, d);
    }
    let l = bitlen64(mag) as i32;
    let (m, k) = if l > 53 {
        let shift = (l - 53) as u32;
        let t = mag >> shift;
        let odd = u64::from(mag & ((1u64 << shift) - 1) != 0);
        (t | odd, e + shift as i32)
    } else {
        (mag, e)
    };
    // exact: m < 2^53 and 2^k is a normal f64 for |k| ≤ 960
    let x = (m as f64) * f64::from_bits(((k + 1023) as u64) << 52);
    let x = if v < 0 { -x } else { x };
    match d {
        Dtype::F32 => f64::from(x as f32),
        Dtype::F16 => <f16 as Element>::from_f64(x).to_f64(),
        Dtype::BF16 => <bf16 as Element>::from_f64(x).to_f64(),
        Dtype::F64 => x,
    }
}

/// `kept · 2^q` for kept < 2^53 and a result representable in f64, built from bits.
fn ldexp_exact(kept: u64, q: i32) -> f64 {
    let l = bitlen64(kept) as i32;
    let top = q + l - 1;
    if top >= -1022 {
        let frac = (kept << (53 - l)) & ((1u64 << 52) - 1);
        f64::from_bits((((top + 1023) as u64) << 52) | frac)
    } else {
        f64::from_bits(kept << (q + 1074))
    }
}

/// Rounds an encoding of `out.len()` elements to `T`, once, to nearest-even.
///
/// # Errors
/// [`Error::Decode`] if `bytes` is not a valid encoding of that many elements.
pub fn decode<T: Element>(bytes: &[u8], out: &mut [T]) -> Result<()> {
    decode_mv(bytes, out)
}

multiversion! {
fn decode_mv<T: Element>(bytes: &[u8], out: &mut [T]) -> Result<()> {
    let len = out.len();
    let mut pos = 0;
    for blk in out.chunks_mut(BLOCK) {
        let bl = blk.len();
        let x = read_block(bytes, &mut pos, bl)?;
        decode_block(&x, blk);
    }
    if pos != bytes.len() {
        return Err(corrupt(format!(
            "{} trailing bytes after {len} elements",
            bytes.len() - pos
        )));
    }
    Ok(())
}
}

/// Rounds one block to `T`, once, to nearest-even.
#[inline(always)]
fn decode_block<T: Element>(x: &BlockRef<'_>, blk: &mut [T]) {
    let bl = blk.len();
    if x.flags.is_none()
        && x.w == 2
        && x.bits > 52
        && T::DTYPE != Dtype::F64
        && (-1022..=900).contains(&x.e)
    {
        // |v| < 2^63: round |v| to odd at bit 11 when it is 2^53 or more
        // (keep bits 11.., set bit 11 if anything below was nonzero); the
        // result has at most 53 significant bits and at least 42, so it
        // converts to f64 exactly, and one rounding to T (p ≤ 24 ≤ 42 − 2)
        // is then correct (Boldo & Melquiond, "When double rounding is odd").
        let scale = f64::from_bits(((x.e + 1023) as u64) << 52);
        let d = &x.data[..8 * bl];
        let p = d.as_ptr().cast::<i64>();
        for (i, o) in blk.iter_mut().enumerate() {
            // SAFETY: `d` holds 8·bl bytes and i < bl; unaligned reads are
            // allowed.
            let v = i64::from_le(unsafe { p.add(i).read_unaligned() });
            let a = v.unsigned_abs();
            let odd = (a & !0x7ff) | (u64::from(a & 0x7ff != 0) << 11);
            let a = if a >> 53 != 0 { odd } else { a };
            let f = a as f64 * scale;
            *o = T::from_f64(if v < 0 { -f } else { f });
        }
        return;
    }
    if x.flags.is_none() && x.w <= 2 && x.bits <= 52 && (-1022..=900).contains(&x.e) {
        // Every |v| ≤ 2^52: v → f64 exactly, times 2^e exactly (a
        // normal f64), then one rounding to T.
        let scale = f64::from_bits(((x.e + 1023) as u64) << 52);
        if x.w == 2 {
            let d = &x.data[..8 * bl];
            let p = d.as_ptr().cast::<i64>();
            for (i, o) in blk.iter_mut().enumerate() {
                // SAFETY: `d` holds 8·bl bytes and i < bl; unaligned
                // reads are allowed.
                let v = i64::from_le(unsafe { p.add(i).read_unaligned() });
                *o = T::from_f64(v as f64 * scale);
            }
        } else {
            for (i, o) in blk.iter_mut().enumerate() {
                *o = T::from_f64(get_i64(x.data, i, x.w) as f64 * scale);
            }
        }
        return;
    }
    for (i, o) in blk.iter_mut().enumerate() {
        let f = x.flags.map_or(0, |v| v[i]);
        if f & F_NAN != 0 || f & (F_PINF | F_NINF) == F_PINF | F_NINF {
            *o = T::from_f64(f64::NAN);
            continue;
        }
        if f & F_PINF != 0 {
            *o = T::from_f64(f64::INFINITY);
            continue;
        }
        if f & F_NINF != 0 {
            *o = T::from_f64(f64::NEG_INFINITY);
            continue;
        }
        let v = match x.w {
            0 => 0.0,
            1 | 2 => fast_round(get_i64(x.data, i, x.w), x.e, T::DTYPE),
            w => {
                let (neg, m) = magnitude(&load_big(x.data, i, w));
                let l = big_bitlen(&m);
                if l <= 64 {
                    let v = u64::from(m[0]) | (u64::from(m[1]) << 32);
                    round_mag(neg, v, x.e, false, T::DTYPE)
                } else {
                    // top 64 bits and a sticky bit for the rest
                    let s = l - 64;
                    let hi = shr_take64(&m, s);
                    let sticky = any_below(&m, s);
                    round_mag(neg, hi, x.e + s as i32, sticky, T::DTYPE)
                }
            }
        };
        *o = if v == 0.0 {
            T::from_f64(signed_zero(f))
        } else {
            T::from_f64(v)
        };
    }
}

fn shr_take64(m: &Big, s: u32) -> u64 {
    let mut v = 0u64;
    for k in 0..64 {
        let b = s + k;
        let bit = (m[(b / 32) as usize] >> (b % 32)) & 1;
        v |= u64::from(bit) << k;
    }
    v
}

fn any_below(m: &Big, s: u32) -> bool {
    let full = (s / 32) as usize;
    m[..full].iter().any(|&w| w != 0)
        || (!s.is_multiple_of(32) && m[full] & ((1u32 << (s % 32)) - 1) != 0)
}

fn encode_buf(dtype: Dtype, bytes: &[u8], out: &mut Vec<u8>) {
    fn go<T: Element>(b: &[u8], out: &mut Vec<u8>) {
        let xs = crate::reduce::typed::<T>(b);
        encode(&xs, out);
    }
    match dtype {
        Dtype::F32 => go::<f32>(bytes, out),
        Dtype::F64 => go::<f64>(bytes, out),
        Dtype::F16 => go::<f16>(bytes, out),
        Dtype::BF16 => go::<bf16>(bytes, out),
    }
}

fn decode_buf(dtype: Dtype, enc: &[u8], out: &mut [u8], d: fused::Div) -> Result<()> {
    fn go<T: Element>(enc: &[u8], out: &mut [u8], d: fused::Div) -> Result<()> {
        let mut r = Ok(());
        crate::reduce::with_typed_mut::<T>(out, |xs| r = fused::decode_div(enc, xs, d));
        r
    }
    match dtype {
        Dtype::F32 => go::<f32>(enc, out, d),
        Dtype::F64 => go::<f64>(enc, out, d),
        Dtype::F16 => go::<f16>(enc, out, d),
        Dtype::BF16 => go::<bf16>(enc, out, d),
    }
}

/// The divisor of the final rounding: the group size for `Avg` (the
/// exact sum divided by n, rounded once), else 1.
fn avg_div(op: ReduceOp, n: usize) -> fused::Div {
    fused::Div(if op == ReduceOp::Avg { n as u32 } else { 1 })
}

/// A rank's own contributions (outside the chunk it reduces into, unless
/// `covers_io`).
struct Own<'a, T> {
    head: &'a [T],
    tail: &'a [T],
    tail_start: usize,
    /// `head` and `tail` hold the rank's own chunk too, and the output
    /// does not (only with two ranks or on the direct route, see
    /// [`ring_rs_raw`])
    covers_io: bool,
}

impl<'a, T> Own<'a, T> {
    fn get(&self, r: std::ops::Range<usize>) -> &'a [T] {
        if r.is_empty() {
            &[]
        } else if r.end <= self.head.len() {
            &self.head[r]
        } else {
            &self.tail[r.start - self.tail_start..r.end - self.tail_start]
        }
    }
}

/// Reproducible ring reduce-scatter of native contributions: afterwards
/// `io` (chunk `rank`) holds the exact sum of chunk `rank` over the group
/// divided by `d` (n for `Avg`, see [`avg_div`]), rounded once. On entry `io` holds this
/// rank's own contribution to chunk `rank` — except with two ranks or on
/// the direct route when `own` holds it too ([`Own::covers_io`]): the one
/// step then sums all inputs straight into `io`, with no copy of the own
/// chunk first.
///
/// The first step sends native values (the receiver adds two native
/// chunks: exactly, or, on the last step, as one native addition in f64,
/// which is correctly rounded); later steps send the exact encoding of the
/// partial sum, which the receiver merges with its own native chunk
/// directly; the last step rounds block by block into `io`.
fn ring_rs_raw<T: Element, C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag0: u32,
    own: &Own<'_, T>,
    len: usize,
    io: &mut [T],
    d: fused::Div,
) -> Result<()> {
    let n = c.size();
    let me = c.rank();
    if n == 1 {
        return Ok(());
    }
    let own_in_io = !own.covers_io;
    let es = T::DTYPE.size_bytes();
    let right = (me + 1) % n;
    let left = (me + n - 1) % n;
    // Direct (see `direct_rs`) when every rank is in one domain, for 3 to
    // 16 ranks and f32, f16 and bf16.
    if direct_route(c, T::DTYPE) {
        return direct_rs(c, ctx, tag0, own, len, io, d);
    }
    // The fixed-lane path (see `fixed`): from 3 ranks on (with 2, the one
    // step adds natives) for f32, f16 and bf16.
    let fixed = (3..=fixed::MAX_RANKS).contains(&n) && T::DTYPE != Dtype::F64;
    let chunk = encoded_capacity(len.div_ceil(n));
    let mut trav = take_buf(chunk);
    let mut next = take_buf(chunk);
    let mut result = Ok(());
    for s in 0..n - 1 {
        let send_c = (me + 2 * n - s - 1) % n;
        let recv_c = (me + 2 * n - s - 2) % n;
        let last = s == n - 2;
        let rr = shard_range(len, n, recv_c);
        let want = rr.len() * es;
        let mine: &[T] = if last && own_in_io { &[] } else { own.get(rr) };
        let data: &[u8] = if s == 0 {
            Buf::new(own.get(shard_range(len, n, send_c))).bytes()
        } else {
            &trav
        };
        let io = &mut *io;
        let nx = &mut next;
        let mut sink = |src: &[u8]| -> Result<()> {
            if fixed {
                return match (s == 0, last) {
                    (true, _) => fixed::sum_fixed(&crate::reduce::typed::<T>(src), mine, nx),
                    (false, true) => fixed::merge_fixed_round(src, io, d, n),
                    (false, false) => fixed::merge_fixed(src, mine, nx),
                };
            }
            match (s == 0, last) {
                (true, true) if own_in_io => {
                    fused::sum_raw_round(&crate::reduce::typed::<T>(src), io, d)
                }
                (true, true) => fused::sum2_round(&crate::reduce::typed::<T>(src), mine, io, d),
                (true, false) => fused::sum_raw(&crate::reduce::typed::<T>(src), mine, nx),
                (false, true) => fused::merge_raw_round(src, io, d),
                (false, false) => fused::merge_raw(src, mine, nx),
            }
        };
        result = c.exchange(
            ctx,
            tag0 + s as u32,
            &[Outgoing { to: right, data }],
            &mut [Incoming {
                from: left,
                len: (s == 0).then_some(want),
                sink: &mut sink,
            }],
        );
        if result.is_err() {
            break;
        }
        std::mem::swap(&mut trav, &mut next);
    }
    give_back(trav);
    give_back(next);
    result
}

/// Whether [`ring_rs_raw`] takes the direct route ([`direct_rs`]): 3 to
/// 16 ranks in one domain ([`crate::algo::direct`]), f32, f16 or bf16.
fn direct_route<C: Communicator + ?Sized>(c: &C, dtype: Dtype) -> bool {
    let all: Vec<usize> = (0..c.size()).collect();
    dtype != Dtype::F64 && crate::algo::direct(c, &all)
}

/// Reproducible direct reduce-scatter of native contributions: every rank
/// sends chunk k of its buffer straight to rank k — (n−1)/n of the buffer,
/// the bytes the ring sends, in one step instead of n − 1 — and holds the
/// n − 1 chunks it receives at once (nested exchanges, so that every
/// sender's memory stays readable), then sums each block of all n
/// contributions exactly in registers and rounds it into `io`
/// ([`fixed::sum_all_round`]): one pass over the data, no partial sums in
/// memory.
fn direct_rs<T: Element, C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag0: u32,
    own: &Own<'_, T>,
    len: usize,
    io: &mut [T],
    d: fused::Div,
) -> Result<()> {
    let n = c.size();
    let me = c.rank();
    let es = T::DTYPE.size_bytes();
    let sends: Vec<Outgoing<'_>> = (0..n)
        .filter(|&k| k != me)
        .map(|k| Outgoing {
            to: k,
            data: Buf::new(own.get(shard_range(len, n, k))).bytes(),
        })
        .collect();
    let want = shard_range(len, n, me).len() * es;
    let from: Vec<(usize, Option<usize>)> = (1..n).map(|s| ((me + s) % n, Some(want))).collect();
    let own_chunk = own.covers_io.then(|| own.get(shard_range(len, n, me)));
    let mut f = |views: &[&[u8]]| -> Result<()> {
        let typed: Vec<std::borrow::Cow<'_, [T]>> =
            views.iter().map(|v| crate::reduce::typed::<T>(v)).collect();
        let peers: Vec<&[T]> = typed.iter().map(|v| &v[..]).collect();
        fixed::sum_all_round(own_chunk, &peers, io, d)
    };
    gather_nested(c, ctx, tag0, &sends, &from, &[], &mut f).map_err(|e| abort_on(c, e))
}

/// Exact ring reduce-scatter over encoded chunks: afterwards `enc[me]` holds
/// the exact sum of chunk `me`.
fn exact_ring_rs<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag0: u32,
    members: &[usize],
    me: usize,
    enc: &mut [Vec<u8>],
    lens: &[usize],
) -> Result<()> {
    let m = members.len();
    let right = members[(me + 1) % m];
    let left = members[(me + m - 1) % m];
    let mut scratch = take_buf(enc.iter().map(Vec::len).max().unwrap_or(0) * 2);
    for s in 0..m.saturating_sub(1) {
        let send_c = (me + 2 * m - s - 1) % m;
        let recv_c = (me + 2 * m - s - 2) % m;
        let mine = std::mem::take(&mut enc[recv_c]);
        let rlen = lens[recv_c];
        let mut sink = |src: &[u8]| merge(&mine, src, rlen, &mut scratch);
        c.exchange(
            ctx,
            tag0 + s as u32,
            &[Outgoing {
                to: right,
                data: &enc[send_c],
            }],
            &mut [Incoming {
                from: left,
                len: None,
                sink: &mut sink,
            }],
        )?;
        enc[recv_c] = std::mem::replace(&mut scratch, mine);
    }
    give_back(scratch);
    Ok(())
}

/// Exact recursive-doubling all-reduce of one encoded chunk.
fn exact_rd_all_reduce<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag0: u32,
    members: &[usize],
    me: usize,
    enc: &mut Vec<u8>,
    len: usize,
) -> Result<()> {
    let m = members.len();
    if m <= 1 {
        return Ok(());
    }
    // as much as the encoding holds, not its capacity: a request by
    // capacity fed each call's grown buffers into the next call's
    let mut scratch = take_buf(enc.len());
    let result = exact_rd_rounds(c, ctx, tag0, members, me, enc, len, &mut scratch);
    give_back(scratch);
    result
}

/// The rounds of [`exact_rd_all_reduce`], merging through `scratch`.
#[allow(clippy::too_many_arguments)]
fn exact_rd_rounds<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    tag0: u32,
    members: &[usize],
    me: usize,
    enc: &mut Vec<u8>,
    len: usize,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let m = members.len();
    let p = 1usize << (usize::BITS - 1 - m.leading_zeros());
    let rem = m - p;
    let mut exchange_merge =
        |tag: u32, to: Option<usize>, from: Option<usize>, enc: &mut Vec<u8>| -> Result<()> {
            let sends: Vec<Outgoing<'_>> = to
                .map(|t| Outgoing { to: t, data: enc })
                .into_iter()
                .collect();
            match from {
                Some(f) => {
                    let mut sink = |src: &[u8]| merge(enc, src, len, scratch);
                    c.exchange(
                        ctx,
                        tag,
                        &sends,
                        &mut [Incoming {
                            from: f,
                            len: None,
                            sink: &mut sink,
                        }],
                    )?;
                    std::mem::swap(enc, scratch);
                    Ok(())
                }
                None => c.exchange(ctx, tag, &sends, &mut []),
            }
        };
    let v = if me < 2 * rem {
        if me.is_multiple_of(2) {
            exchange_merge(tag0, Some(members[me + 1]), None, enc)?;
            None
        } else {
            exchange_merge(tag0, None, Some(members[me - 1]), enc)?;
            Some(me / 2)
        }
    } else {
        Some(me - rem)
    };
    if let Some(v) = v {
        let mut mask = 1;
        let mut step = 1;
        while mask < p {
            let pv = v ^ mask;
            let partner = members[if pv < rem { pv * 2 + 1 } else { pv + rem }];
            exchange_merge(tag0 + step, Some(partner), Some(partner), enc)?;
            mask <<= 1;
            step += 1;
        }
    }
    if me < 2 * rem {
        let tag = tag0 + 64;
        if me.is_multiple_of(2) {
            let got = &mut *scratch;
            got.clear();
            let mut sink = |src: &[u8]| {
                got.extend_from_slice(src);
                Ok(())
            };
            c.exchange(
                ctx,
                tag,
                &[],
                &mut [Incoming {
                    from: members[me + 1],
                    len: None,
                    sink: &mut sink,
                }],
            )?;
            std::mem::swap(enc, scratch);
        } else {
            c.exchange(
                ctx,
                tag,
                &[Outgoing {
                    to: members[me - 1],
                    data: enc,
                }],
                &mut [],
            )?;
        }
    }
    Ok(())
}

thread_local! {
    /// Byte buffers reused across calls on this thread (each local rank is
    /// a thread), so that encodings do not page-fault fresh memory per call.
    static POOL: std::cell::RefCell<Vec<Vec<u8>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A cleared pooled buffer of at least `cap` bytes: the smallest that is
/// large enough, else the largest (grown), so that small requests do not
/// take the buffers that large ones need.
fn take_buf(cap: usize) -> Vec<u8> {
    let mut v = POOL.with(|p| {
        let mut p = p.borrow_mut();
        let fit = (0..p.len())
            .filter(|&i| p[i].capacity() >= cap)
            .min_by_key(|&i| p[i].capacity());
        let pick = fit.or_else(|| (0..p.len()).max_by_key(|&i| p[i].capacity()));
        match pick {
            Some(i) => p.swap_remove(i),
            None => Vec::new(),
        }
    });
    v.clear();
    // exactly: `reserve` may double a pooled buffer's capacity
    v.reserve_exact(cap);
    v
}

fn give_back(v: Vec<u8>) {
    POOL.with(|p| {
        let mut p = p.borrow_mut();
        if p.len() < 8 {
            p.push(v);
        }
    });
}

/// Bytes of a two-word encoding of `len` elements (headers included), so
/// typical encodings never reallocate while being written.
fn encoded_capacity(len: usize) -> usize {
    len * 8 + len.div_ceil(BLOCK) * HEADER + 64
}

fn encode_chunks(dtype: Dtype, bytes: &[u8], m: usize) -> (Vec<Vec<u8>>, Vec<usize>) {
    let es = dtype.size_bytes();
    let len = bytes.len() / es;
    let mut enc = Vec::with_capacity(m);
    let mut lens = Vec::with_capacity(m);
    for i in 0..m {
        let r = shard_range(len, m, i);
        let mut v = take_buf(encoded_capacity(r.len()));
        encode_buf(dtype, &bytes[r.start * es..r.end * es], &mut v);
        enc.push(v);
        lens.push(r.len());
    }
    (enc, lens)
}

/// Reproducible all-reduce (sum or avg).
pub(crate) fn all_reduce<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    mut buf: BufMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    let dtype = buf.dtype();
    let es = dtype.size_bytes();
    let n = c.size();
    let me = c.rank();
    let len = buf.len();
    let bytes = buf.bytes();
    let all: Vec<usize> = (0..n).collect();
    match ctx.sig.algorithm.unwrap_or(Algorithm::Ring) {
        Algorithm::RecursiveDoubling => {
            let mut enc = take_buf(encoded_capacity(len));
            encode_buf(dtype, bytes, &mut enc);
            let r = exact_rd_all_reduce(c, ctx, 0, &all, me, &mut enc, len)
                .and_then(|()| decode_buf(dtype, &enc, bytes, avg_div(op, n)));
            give_back(enc);
            r?;
        }
        Algorithm::Hierarchical => {
            let l = crate::algo::hier_layout(c).ok_or_else(|| Error::InvalidArgument {
                op: ctx.sig.op,
                arg: "algorithm",
                reason: "no hierarchical layout".into(),
            })?;
            let k = l.local.len();
            let (mut enc, lens) = encode_chunks(dtype, bytes, k);
            exact_ring_rs(c, ctx, 0, &l.local, l.local_index, &mut enc, &lens)?;
            let li = l.local_index;
            exact_rd_all_reduce(
                c,
                ctx,
                1 << 20,
                &l.cross,
                l.cross_index,
                &mut enc[li],
                lens[li],
            )?;
            let r = shard_range(len, k, li);
            let part = &mut bytes[r.start * es..r.end * es];
            let decoded = decode_buf(dtype, &enc[li], part, avg_div(op, n));
            enc.into_iter().for_each(give_back);
            decoded?;
            all_gather_chunks(c, ctx, 2 << 20, &l.local, li, bytes, es)?;
        }
        _ => {
            let r = shard_range(len, n, me);
            fn go<T: Element, C: Communicator + ?Sized>(
                c: &C,
                ctx: &OpCtx,
                bytes: &mut [u8],
                r: std::ops::Range<usize>,
                op: ReduceOp,
            ) -> Result<()> {
                let mut res = Ok(());
                crate::reduce::with_typed_mut::<T>(bytes, |xs| {
                    let len = xs.len();
                    let (head, rest) = xs.split_at_mut(r.start);
                    let (mine, tail) = rest.split_at_mut(r.len());
                    let own = Own {
                        head,
                        tail,
                        tail_start: r.end,
                        covers_io: false,
                    };
                    res = ring_rs_raw(c, ctx, 0, &own, len, mine, avg_div(op, c.size()));
                });
                res
            }
            match dtype {
                Dtype::F32 => go::<f32, C>(c, ctx, bytes, r, op)?,
                Dtype::F64 => go::<f64, C>(c, ctx, bytes, r, op)?,
                Dtype::F16 => go::<f16, C>(c, ctx, bytes, r, op)?,
                Dtype::BF16 => go::<bf16, C>(c, ctx, bytes, r, op)?,
            }
            all_gather_chunks(c, ctx, 1 << 20, &all, me, bytes, es)?;
        }
    }
    Ok(())
}

/// Reproducible reduce-scatter (sum or avg).
pub(crate) fn reduce_scatter<C: Communicator + ?Sized>(
    c: &C,
    ctx: &OpCtx,
    input: Buf<'_>,
    mut output: BufMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    let dtype = input.dtype();
    let n = c.size();
    let me = c.rank();
    let len = input.len();
    let all: Vec<usize> = (0..n).collect();
    let out = output.bytes();
    match ctx.sig.algorithm.unwrap_or(Algorithm::Ring) {
        Algorithm::RecursiveDoubling => {
            let mut whole = take_buf(encoded_capacity(len));
            encode_buf(dtype, input.bytes(), &mut whole);
            let mut tmp = crate::reduce::Scratch::take(input.bytes().len());
            let r = exact_rd_all_reduce(c, ctx, 0, &all, me, &mut whole, len)
                .and_then(|()| decode_buf(dtype, &whole, tmp.bytes_mut(), avg_div(op, n)));
            give_back(whole);
            r?;
            let es = dtype.size_bytes();
            let r = shard_range(len, n, me);
            out.copy_from_slice(&tmp.bytes()[r.start * es..r.end * es]);
        }
        _ => {
            // two ranks, and the direct route, sum all inputs straight
            // into `out`; the ring starts from a copy of the own chunk there
            let own_in_io = n != 2 && !direct_route(c, dtype);
            if own_in_io {
                let es = dtype.size_bytes();
                let r = shard_range(len, n, me);
                out.copy_from_slice(&input.bytes()[r.start * es..r.end * es]);
            }
            fn go<T: Element, C: Communicator + ?Sized>(
                c: &C,
                ctx: &OpCtx,
                input: &[u8],
                out: &mut [u8],
                own_in_io: bool,
                op: ReduceOp,
            ) -> Result<()> {
                let xs = crate::reduce::typed::<T>(input);
                let own = Own {
                    head: &xs,
                    tail: &[],
                    tail_start: xs.len(),
                    covers_io: !own_in_io,
                };
                let mut res = Ok(());
                crate::reduce::with_typed_mut::<T>(out, |mine| {
                    res = ring_rs_raw(c, ctx, 0, &own, xs.len(), mine, avg_div(op, c.size()));
                });
                res
            }
            match dtype {
                Dtype::F32 => go::<f32, C>(c, ctx, input.bytes(), out, own_in_io, op)?,
                Dtype::F64 => go::<f64, C>(c, ctx, input.bytes(), out, own_in_io, op)?,
                Dtype::F16 => go::<f16, C>(c, ctx, input.bytes(), out, own_in_io, op)?,
                Dtype::BF16 => go::<bf16, C>(c, ctx, input.bytes(), out, own_in_io, op)?,
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_numerics::ExactSum;

    /// `merge` reads plain two-word blocks in place; its output is the
    /// bytes of merging block by block through `merge_block`, for blocks
    /// of near and far exponents (one word, two words, wider results).
    #[test]
    fn merging_in_place_writes_what_merge_block_writes() {
        let len = 40 * BLOCK + 17;
        let col = |seed: u32, scale: f32| -> Vec<f32> {
            (0..len)
                .map(|i| {
                    let b = (i / BLOCK) as i32;
                    let x = ((i as f32 + seed as f32) * 0.37).sin();
                    x * scale * 2f32.powi((b * 7 + seed as i32) % 40 - 20)
                })
                .collect()
        };
        for (sa, sb, scale) in [
            (0u32, 1u32, 1.0f32),
            (5, 5, 4.0),
            (3, 17, 3e4),
            (2, 9, 1e-9),
        ] {
            let (mut a, mut b, mut got, mut want) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            encode(&col(sa, 1.0), &mut a);
            encode(&col(sb, scale), &mut b);
            merge(&a, &b, len, &mut got).unwrap();
            let (mut pa, mut pb) = (0, 0);
            for start in (0..len).step_by(BLOCK) {
                let bl = BLOCK.min(len - start);
                let x = read_block(&a, &mut pa, bl).unwrap();
                let y = read_block(&b, &mut pb, bl).unwrap();
                merge_block(&x, &y, bl, &mut want).unwrap();
            }
            assert_eq!(got, want, "seeds {sa} {sb}");
        }
    }

    fn exact_of<T: Element>(cols: &[Vec<T>]) -> Vec<T> {
        let len = cols[0].len();
        (0..len)
            .map(|i| {
                let mut s = ExactSum::new();
                for c in cols {
                    s.add(c[i]);
                }
                s.round_to::<T>()
            })
            .collect()
    }

    fn merged<T: Element>(cols: &[Vec<T>]) -> Vec<T> {
        let len = cols[0].len();
        let mut acc = Vec::new();
        encode(&cols[0], &mut acc);
        for c in &cols[1..] {
            let mut e = Vec::new();
            encode(c, &mut e);
            let mut out = Vec::new();
            merge(&acc, &e, len, &mut out).unwrap();
            acc = out;
        }
        let mut res = vec![T::ZERO; len];
        decode(&acc, &mut res).unwrap();
        res
    }

    fn same_bits<T: Element>(a: &[T], b: &[T]) -> bool {
        a.iter().zip(b).all(|(x, y)| {
            let (x, y) = (x.to_f64(), y.to_f64());
            (x.is_nan() && y.is_nan()) || x.to_bits() == y.to_bits()
        })
    }

    /// Asserts the same bits, naming the first element that differs.
    fn assert_same(got: &[f32], want: &[f32], what: &str) {
        assert!(
            same_bits(got, want),
            "{what}: {:?}",
            got.iter()
                .zip(want)
                .find(|(a, b)| a.to_bits() != b.to_bits())
        );
    }

    #[test]
    fn wide_spreads_stay_exact() {
        let cols = vec![
            vec![1e30f32, 1.0, -0.0, f32::MIN_POSITIVE / 8.0, 3.0],
            vec![-1e30f32, 1e-30, -0.0, 1e20, f32::INFINITY],
            vec![7.0f32, -1.0, -0.0, -1e20, 1.0],
        ];
        let got = merged(&cols);
        assert!(same_bits(&got, &exact_of(&cols)), "{got:?}");
        assert_eq!(got[2].to_bits(), (-0.0f32).to_bits());
        let cols64 = vec![vec![1e300f64, 1e-300, 5e-324], vec![1e300, -1e-300, 5e-324]];
        assert!(same_bits(&merged(&cols64), &exact_of(&cols64)));
    }

    #[test]
    fn f32_gradients_take_about_two_words() {
        let xs: Vec<f32> = (0..4096)
            .map(|i| ((i as f32) * 0.37).sin() * 1e-3)
            .collect();
        let mut e = Vec::new();
        encode(&xs, &mut e);
        let ratio = e.len() as f64 / (4.0 * xs.len() as f64);
        assert!(ratio < 2.2, "ratio {ratio}");
    }

    #[test]
    fn rounding_matches_exact_sum_on_halfway_cases() {
        // 1 + 2^-24 is exactly halfway between two f32s: ties to even.
        let cols = vec![
            vec![1.0f32, 1.0],
            vec![2f32.powi(-24), 2f32.powi(-24) * 3.0],
        ];
        assert!(same_bits(&merged(&cols), &exact_of(&cols)));
        let h = vec![
            vec![bf16::from_f32(256.0)],
            vec![bf16::from_f32(1.0)],
            vec![bf16::from_f32(1.0)],
        ];
        assert!(same_bits(&merged(&h), &exact_of(&h)));
    }

    /// f32 columns whose blocks of 64 each span at most `spread` binades
    /// below a base exponent drawn from the whole f32 range (subnormals and
    /// near-overflow included), with both signs and some zeros.
    fn blocky(seed: u64, k: usize, len: usize, spread: u32) -> Vec<Vec<f32>> {
        let mut s = seed | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let bases: Vec<u32> = (0..len.div_ceil(BLOCK))
            .map(|_| (next() % 254) as u32 + 1)
            .collect();
        (0..k)
            .map(|_| {
                (0..len)
                    .map(|i| {
                        let u = next();
                        if u % 23 == 0 {
                            return 0.0;
                        }
                        let base = bases[i / BLOCK];
                        let ex = base.saturating_sub((u >> 8) as u32 % (spread + 1));
                        let frac = (u >> 32) as u32 & 0x7f_ffff;
                        f32::from_bits((u32::from(u % 2 == 0) << 31) | (ex << 23) | frac)
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn partials_take_wide_spreads_in_lanes_and_stay_exact() {
        // spreads past the magic constant's 27 binades (integer shifts up
        // to 38, the general path beyond), subnormals and zeros included,
        // added one by one and all at once
        for (seed, spread) in (1..48u64).zip([27u32, 28, 33, 38, 39, 45].into_iter().cycle()) {
            let k = 2 + (seed as usize % 7);
            let len = 5 * BLOCK + 9;
            let cols = blocky(seed, k, len, spread);
            let want = exact_of(&cols);
            let mut one = ExactPartial::new(len);
            for c in &cols {
                one.add(c).unwrap();
            }
            let mut many = ExactPartial::new(len);
            many.add(&cols[0]).unwrap();
            let rest: Vec<&[f32]> = cols[1..].iter().map(|c| &c[..]).collect();
            many.add_many(&rest).unwrap();
            for p in [&one, &many] {
                let mut got = vec![0f32; len];
                p.round_to(&mut got).unwrap();
                assert_same(&got, &want, &format!("seed {seed} spread {spread}"));
            }
        }
    }

    #[test]
    fn fast_paths_match_exact_sum_at_every_exponent_and_spread() {
        for (seed, spread) in (1..40u64).zip([0u32, 5, 26, 27, 28, 40].into_iter().cycle()) {
            let k = 2 + (seed as usize % 7);
            let cols = blocky(seed, k, 5 * BLOCK + 9, spread);
            let got = merged(&cols);
            let want = exact_of(&cols);
            assert_same(&got, &want, &format!("seed {seed} spread {spread}"));
        }
    }

    #[test]
    fn narrow_f32_blocks_take_the_two_word_fast_path() {
        let cols = blocky(3, 1, 4 * BLOCK, FAST_SPREAD as u32);
        let mut e = Vec::new();
        encode(&cols[0], &mut e);
        assert_eq!(e.len(), 4 * (HEADER + 8 * BLOCK));
    }

    #[test]
    fn thousands_of_merges_widen_blocks_and_stay_exact() {
        // 5000 contributions at the top of the fast path's range carry
        // past its 12 bits of headroom: blocks widen to three words.
        let one = blocky(11, 1, BLOCK + 3, FAST_SPREAD as u32).remove(0);
        let one: Vec<f32> = one.iter().map(|x| x.abs().min(1e30)).collect();
        let cols = vec![one; 5000];
        let got = merged(&cols);
        assert!(same_bits(&got, &exact_of(&cols)));
    }

    /// The f32 nearest to v/d (ties to even) by exact i128 comparison of
    /// the residuals of the neighbours of an approximation.
    fn div_ref(v: i64, d: u32) -> f32 {
        let approx = (v as f64 / f64::from(d)) as f32;
        let resid = |c: f32| -> i128 {
            // |c·d − v| scaled by 2^k so that c·2^k is an integer
            let b = c.to_bits();
            let ex = ((b >> 23) & 0xff) as i32;
            let mant = i128::from(if ex == 0 {
                b & 0x7f_ffff
            } else {
                (b & 0x7f_ffff) | 0x80_0000
            });
            let q = ex.max(1) - 150;
            let mant = if c < 0.0 { -mant } else { mant };
            if q >= 0 {
                (mant * i128::from(d) * (1i128 << q) - i128::from(v)).abs()
            } else {
                (mant * i128::from(d) - (i128::from(v) << -q)).abs()
            }
        };
        let up = f32::from_bits(approx.to_bits() + 1);
        let down = f32::from_bits(approx.to_bits() - 1);
        let mut best = down;
        for c in [approx, up] {
            let (rb, rc) = (resid(best), resid(c));
            if rc < rb || (rc == rb && c.to_bits().is_multiple_of(2)) {
                best = c;
            }
        }
        best
    }

    #[test]
    fn exact_division_rounds_once() {
        let mut s = 0x1234_5678_9abc_def1u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let ds = [3u32, 5, 7, 1000, 2047, 2049, 65_537, 1 << 20 | 1, u32::MAX];
        for k in 0..20_000 {
            let d = ds[k % ds.len()];
            let bits = 33 + (next() % 30) as u32;
            let mut v = (next() >> (64 - bits)) as i64;
            if k % 3 == 0 {
                // a quotient on or next to an f32 tie: v = d·(tie + small)
                let tie = ((next() >> 40) | 1 << 24) | 1;
                v = (i64::try_from(tie).unwrap() << 6) * i64::from(d) + (k as i64 % 3) - 1;
            }
            if v <= 0 || v >= 1 << 62 {
                continue;
            }
            let v = if k % 2 == 0 { v } else { -v };
            let (narrow, big) = fused::div_both::<f32>(v, 0, d);
            let want = div_ref(v, d);
            assert_eq!(narrow as f32, want, "narrow {v} / {d}");
            assert_eq!(big as f32, want, "big {v} / {d}");
            let (nb, bb) = fused::div_both::<bf16>(v, -40, d);
            assert_eq!(nb.to_bits(), bb.to_bits(), "bf16 {v} / {d}");
        }
    }

    #[test]
    fn corrupt_bytes_are_errors() {
        let mut e = Vec::new();
        encode(&[1.0f32, 2.0], &mut e);
        let mut out = [0f32; 2];
        assert!(decode(&e[..e.len() - 1], &mut out).is_err());
        assert!(decode(&e, &mut [0f32; 3]).is_err());
        let mut m = Vec::new();
        assert!(merge(&e, &e[..5], 2, &mut m).is_err());
    }
}
