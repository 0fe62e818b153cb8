//! Elementwise reduction kernels on dtype-tagged bytes.
//!
//! Every addition is computed in f32 (f64 for f64 data) and rounded once to
//! the destination dtype: accumulation is never narrower than f32, whatever
//! the wire dtype.

use std::borrow::Cow;

use weft_numerics::{Dtype, Element, bf16, f16, multiversion};

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
            with_typed_mut::<bf16>(dst, |d| match op {
                ReduceOp::Sum | ReduceOp::Avg => add_bf16(d, &s),
                _ => kernel_half(op, d, &s),
            });
        }
    }
}

/// Outputs of at least this many bytes are written with non-temporal
/// stores ([`stream_copy`]): a reduction into a fresh buffer otherwise
/// first reads every destination line it writes (write-allocate), a
/// quarter more memory traffic, and evicts the inputs it still needs.
/// Measured on the development machine (AMD EPYC, one thread): `a + b`
/// into a third 8 MiB buffer took 505 µs with plain stores, 258 µs
/// streamed, the time of the in-place `a += b`. Inside collectives, where
/// two ranks share the memory bus, streaming lost at 2 MiB outputs (the
/// data would have stayed in cache), broke even at 8 MiB, and won from 32
/// MiB on (all-gather 1.3–2×, reduce-scatter about 1.1×): hence 8 MiB.
pub(crate) const STREAM_BYTES: usize = 8 << 20;

/// Bytes per tile of [`reduce_to`]'s streamed path: computed into a
/// buffer that stays in L1, then streamed out.
const TILE: usize = 16 << 10;

/// `out[i] = a[i] ⊕ b[i]`: the same values, bit for bit, as
/// [`reduce_into`] of `b` into a copy of `a`, without the copy. With
/// `stream` (for a result that is not read again soon), outputs of
/// [`STREAM_BYTES`] or more are computed tile by tile and streamed past
/// the cache.
pub(crate) fn reduce_to(
    dtype: Dtype,
    op: ReduceOp,
    out: &mut [u8],
    a: &[u8],
    b: &[u8],
    stream: bool,
) {
    debug_assert!(out.len() == a.len() && a.len() == b.len());
    if !stream || out.len() < STREAM_BYTES || !cfg!(target_arch = "x86_64") {
        return reduce_to_cached(dtype, op, out, a, b);
    }
    if dtype == Dtype::F32 && matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
        // the hot path, fused: loads, adds and streamed stores interleave,
        // so the loads keep the memory busy while the stores drain
        let (a, b) = (typed::<f32>(a), typed::<f32>(b));
        with_typed_mut::<f32>(out, |o| add_to_f32_streamed(o, &a, &b));
        stream_fence();
        return;
    }
    let mut tile = [0u64; TILE / 8];
    // SAFETY: `tile` is TILE initialised bytes, viewed as u8.
    let tb: &mut [u8] = unsafe { std::slice::from_raw_parts_mut(tile.as_mut_ptr().cast(), TILE) };
    for ((o, x), y) in out.chunks_mut(TILE).zip(a.chunks(TILE)).zip(b.chunks(TILE)) {
        let t = &mut tb[..o.len()];
        reduce_to_cached(dtype, op, t, x, y);
        stream_copy(o, t);
    }
    stream_fence();
}

/// Bytes per tile of [`reduce_many`]: its partial sums stay in L1 beside
/// the lines of the terms being read.
const MANY_TILE: usize = 8 << 10;

/// `out[i] = t₀[i] ⊕ t₁[i] ⊕ … ⊕ t_{k−1}[i]`, folded left to right in the
/// order of `terms` (so each addition rounds as one [`reduce_into`] step
/// would), where a `None` term is `out`'s own value on entry. One pass over
/// the data: each term is read once and `out` written once, the partial
/// sums of a tile staying in L1 — what a direct reduce-scatter needs to sum
/// the contributions of all ranks without writing partial sums to memory.
/// With `stream` (for a result that is not read again soon), outputs of
/// [`STREAM_BYTES`] or more are streamed past the cache.
pub(crate) fn reduce_many(
    dtype: Dtype,
    op: ReduceOp,
    out: &mut [u8],
    terms: &[Option<&[u8]>],
    stream: bool,
) {
    assert!(terms.len() >= 2, "reduce_many of {} terms", terms.len());
    debug_assert!(terms.iter().flatten().all(|t| t.len() == out.len()));
    let stream = stream && out.len() >= STREAM_BYTES && cfg!(target_arch = "x86_64");
    let es = dtype.size_bytes();
    let tile_bytes = MANY_TILE / es * es;
    let mut acc = [0u64; MANY_TILE / 8];
    // SAFETY: `acc` is MANY_TILE initialised bytes, viewed as u8.
    let acc: &mut [u8] =
        unsafe { std::slice::from_raw_parts_mut(acc.as_mut_ptr().cast(), MANY_TILE) };
    // the partial sums go straight into `out`'s tile (then in L1) unless
    // it is streamed or one of the terms
    let in_out = !stream && terms.iter().all(Option::is_some);
    for (t, o) in out.chunks_mut(tile_bytes).enumerate() {
        let r = t * tile_bytes..t * tile_bytes + o.len();
        let fold = |a: &mut [u8], own: &[u8]| {
            let term = |i: usize| terms[i].map_or(own, |s| &s[r.clone()]);
            reduce_to_cached(dtype, op, a, term(0), term(1));
            for i in 2..terms.len() {
                reduce_into(dtype, op, a, term(i));
            }
        };
        if in_out {
            fold(o, &[]);
            continue;
        }
        let a = &mut acc[..o.len()];
        fold(a, o);
        if stream {
            stream_copy(o, a);
        } else {
            o.copy_from_slice(a);
        }
    }
    if stream {
        stream_fence();
    }
}

/// Bytes ahead of a streaming loop's position that it prefetches: the
/// hardware prefetcher alone leaves the loads of two streams waiting on
/// memory (with this, on 2 thread ranks at 64–256 MiB, the exact mean of
/// two halves 1.3× faster and the plain reduce-scatter 1.0–1.05×, Intel
/// Xeon, `benches/collectives.rs`; a plain copy's one stream gains
/// nothing).
pub(crate) const AHEAD: usize = 2048;

/// Asks for the `lines` cache lines from `ahead` bytes past `p` (a hint:
/// never faults, whatever the address; nothing off x86-64).
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T, ahead: usize, lines: usize) {
    #[cfg(target_arch = "x86_64")]
    for l in 0..lines {
        // SAFETY: prefetching never faults, whatever the address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                p.cast::<i8>().wrapping_add(ahead + 64 * l),
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, ahead, lines);
}

/// `o = a + b` (f32) with non-temporal stores on x86-64.
fn add_to_f32_streamed(o: &mut [f32], a: &[f32], b: &[f32]) {
    let n = o.len().min(a.len()).min(b.len());
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_add_ps, _mm_loadu_ps, _mm_stream_ps};
        // head until `o` is 16-byte aligned
        let head = o.as_ptr().align_offset(16).min(n);
        add_to_f32(&mut o[..head], &a[..head], &b[..head]);
        let body = (n - head) / 16 * 16;
        let (op, ap, bp) = (
            o[head..].as_mut_ptr(),
            a[head..].as_ptr(),
            b[head..].as_ptr(),
        );
        let mut i = 0;
        while i < body {
            // SAFETY: `i + 16 <= body <= n − head`: in bounds of all three;
            // `op + i` is 16-byte aligned (`head` aligned it, `i` is a
            // multiple of 4 floats); unaligned loads; SSE is part of x86-64.
            unsafe {
                prefetch(ap.add(i), AHEAD, 1);
                prefetch(bp.add(i), AHEAD, 1);
                for k in 0..4 {
                    let x = _mm_loadu_ps(ap.add(i + 4 * k));
                    let y = _mm_loadu_ps(bp.add(i + 4 * k));
                    _mm_stream_ps(op.add(i + 4 * k), _mm_add_ps(x, y));
                }
            }
            i += 16;
        }
        let t = head + body;
        add_to_f32(&mut o[t..n], &a[t..n], &b[t..n]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    add_to_f32(&mut o[..n], &a[..n], &b[..n]);
}

/// Copies `src` into `dst` (the same length) with non-temporal stores
/// where the platform has them (x86-64: SSE2, every such CPU), so that the
/// destination's lines are neither read first nor kept in cache; a plain
/// copy elsewhere. Call [`stream_fence`] before another thread reads
/// `dst`.
pub(crate) fn stream_copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "stream_copy of different lengths");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let n = dst.len();
        let head = dst.as_ptr().align_offset(16).min(n);
        dst[..head].copy_from_slice(&src[..head]);
        let body = (n - head) / 64 * 64;
        let (d, s) = (dst[head..].as_mut_ptr(), src[head..].as_ptr());
        let mut i = 0;
        while i < body {
            // SAFETY: `i + 64 <= body <= n − head`: in bounds of both; `d + i`
            // is 16-byte aligned (`head` aligned it, `i` is a multiple of
            // 64); unaligned loads from `src`; SSE2 is part of x86-64.
            unsafe {
                for k in 0..4 {
                    let v = _mm_loadu_si128(s.add(i + 16 * k).cast::<__m128i>());
                    _mm_stream_si128(d.add(i + 16 * k).cast::<__m128i>(), v);
                }
            }
            i += 64;
        }
        dst[head + body..].copy_from_slice(&src[head + body..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Orders earlier [`stream_copy`] stores before later stores (and so
/// before the release that hands the buffer to another thread).
pub(crate) fn stream_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of x86-64; a fence has no other effect.
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
}

/// [`reduce_to`] with plain stores.
fn reduce_to_cached(dtype: Dtype, op: ReduceOp, out: &mut [u8], a: &[u8], b: &[u8]) {
    fn go<T: Element>(out: &mut [u8], a: &[u8], b: &[u8], f: impl Fn(T, T) -> T) {
        let (a, b) = (typed::<T>(a), typed::<T>(b));
        with_typed_mut::<T>(out, |o| {
            for ((o, &x), &y) in o.iter_mut().zip(a.iter()).zip(b.iter()) {
                *o = f(x, y);
            }
        });
    }
    fn half<H: Element>(op: ReduceOp) -> impl Fn(H, H) -> H {
        move |x: H, y: H| {
            let (x, y) = (x.to_f32(), y.to_f32());
            H::from_f32(match op {
                ReduceOp::Sum | ReduceOp::Avg => x + y,
                ReduceOp::Max => max_nan(x, y),
                ReduceOp::Min => min_nan(x, y),
            })
        }
    }
    fn go_sum<T: Element>(out: &mut [u8], a: &[u8], b: &[u8], f: fn(&mut [T], &[T], &[T])) {
        let (a, b) = (typed::<T>(a), typed::<T>(b));
        with_typed_mut::<T>(out, |o| f(o, &a, &b));
    }
    match (dtype, op) {
        (Dtype::F32, ReduceOp::Sum | ReduceOp::Avg) => go_sum::<f32>(out, a, b, add_to_f32),
        (Dtype::F16, ReduceOp::Sum | ReduceOp::Avg) => go_sum::<f16>(out, a, b, add_to_half),
        (Dtype::BF16, ReduceOp::Sum | ReduceOp::Avg) => go_sum::<bf16>(out, a, b, add_to_bf16),
        (Dtype::F32, ReduceOp::Max) => go::<f32>(out, a, b, max_nan),
        (Dtype::F32, ReduceOp::Min) => go::<f32>(out, a, b, min_nan),
        (Dtype::F64, ReduceOp::Sum | ReduceOp::Avg) => go::<f64>(out, a, b, |x, y| x + y),
        (Dtype::F64, ReduceOp::Max) => {
            go::<f64>(out, a, b, |x, y| if y.is_nan() || y > x { y } else { x });
        }
        (Dtype::F64, ReduceOp::Min) => {
            go::<f64>(out, a, b, |x, y| if y.is_nan() || y < x { y } else { x });
        }
        (Dtype::F16, _) => go::<f16>(out, a, b, half::<f16>(op)),
        (Dtype::BF16, _) => go::<bf16>(out, a, b, half::<bf16>(op)),
    }
}

multiversion! {
    /// `d += s`, elementwise.
    fn add_f32(d: &mut [f32], s: &[f32]) {
        for (a, b) in d.iter_mut().zip(s) {
            *a += *b;
        }
    }
}

multiversion! {
    /// `o = a + b`, elementwise.
    fn add_to_f32(o: &mut [f32], a: &[f32], b: &[f32]) {
        for ((o, x), y) in o.iter_mut().zip(a).zip(b) {
            *o = *x + *y;
        }
    }
}

multiversion! {
    /// `o = a + b` for 16-bit types: widened to f32 (exact), added, rounded
    /// once.
    fn add_to_half<H: Element>(o: &mut [H], a: &[H], b: &[H]) {
        for ((o, x), y) in o.iter_mut().zip(a).zip(b) {
            *o = H::from_f32(x.to_f32() + y.to_f32());
        }
    }
}

/// A bf16 (its bits) as f32: exact.
#[inline(always)]
fn bf16_to_f32(h: bf16) -> f32 {
    f32::from_bits(u32::from(h.to_bits()) << 16)
}

/// f32 to bf16, rounded to nearest even (overflow to ±∞; NaN quieted,
/// sign and top payload bits kept): the bits of `half`'s `bf16::from_f32`,
/// without branches, so that the loops below vectorize.
#[inline(always)]
fn f32_to_bf16(f: f32) -> bf16 {
    let x = f.to_bits();
    let nan = (x & 0x7FFF_FFFF) > 0x7F80_0000;
    let rounded = x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16;
    let quiet = (x >> 16) | 0x40;
    #[allow(clippy::cast_possible_truncation)] // both fit 16 bits
    bf16::from_bits(if nan { quiet } else { rounded } as u16)
}

/// `o = a + b` for bf16, as [`add_to_half`] (widened, added in f32,
/// rounded once) with the branch-free conversions; on CPUs with
/// AVX512-BF16 32 sums at a time are rounded by one `vcvtne2ps2bf16`.
fn add_to_bf16(o: &mut [bf16], a: &[bf16], b: &[bf16]) {
    let n = o.len().min(a.len()).min(b.len());
    let done = bf16_x86::add(o.as_mut_ptr(), a.as_ptr(), b.as_ptr(), n);
    add_to_bf16_mv(&mut o[done..n], &a[done..n], &b[done..n]);
}

multiversion! {
    /// `o = a + b` for bf16, element by element (see [`add_to_bf16`]).
    fn add_to_bf16_mv(o: &mut [bf16], a: &[bf16], b: &[bf16]) {
        for ((o, &x), &y) in o.iter_mut().zip(a).zip(b) {
            *o = f32_to_bf16(bf16_to_f32(x) + bf16_to_f32(y));
        }
    }
}

/// The AVX512-BF16 sums of bf16 slices: `vcvtne2ps2bf16` rounds to
/// nearest even as [`f32_to_bf16`] does, but treats subnormal inputs as
/// zero and leaves NaN payloads to the hardware, so 32 sums in which any
/// is a nonzero subnormal or NaN are rounded by [`f32_to_bf16`] instead:
/// the bits are the portable kernels' on every input.
mod bf16_x86 {
    use weft_numerics::bf16;

    /// Writes `o[i] = a[i] + b[i]` for the first multiple of 32 of `n`
    /// elements when the CPU has AVX512-BF16 and `WEFT_SIMD` does not cap
    /// the level below AVX-512 (else none) and returns how many it wrote.
    /// `o` may be `a` or `b` (the sums of 32 elements are formed before
    /// they are stored).
    #[allow(clippy::not_unsafe_ptr_arg_deref)] // the callers pass slices' pointers and their common length
    pub(super) fn add(o: *mut bf16, a: *const bf16, b: *const bf16, n: usize) -> usize {
        #[cfg(target_arch = "x86_64")]
        if n >= 32
            && weft_numerics::simd::level() == weft_numerics::simd::Level::Avx512
            && std::arch::is_x86_feature_detected!("avx512bf16")
        {
            // SAFETY: the CPU has the features; the three pointers are
            // valid for n elements (the callers' slices).
            return unsafe { add_avx512(o, a, b, n) };
        }
        let _ = (o, a, b, n);
        0
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16")]
    unsafe fn add_avx512(o: *mut bf16, a: *const bf16, b: *const bf16, n: usize) -> usize {
        use std::arch::x86_64::{
            __m256i, __m512, __m512bh, _mm256_loadu_si256, _mm512_add_ps, _mm512_castsi512_ps,
            _mm512_cvtepu16_epi32, _mm512_cvtne2ps_pbh, _mm512_fpclass_ps_mask, _mm512_slli_epi32,
        };
        let widen = |p: *const bf16| -> __m512 {
            // SAFETY: (for the closure's callers) 16 readable elements.
            let h = unsafe { _mm256_loadu_si256(p.cast::<__m256i>()) };
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        };
        // lanes whose sum is a NaN (quiet 0x01, signalling 0x80) or a
        // subnormal (0x20)
        let odd = |s: __m512| _mm512_fpclass_ps_mask::<0xA1>(s);
        let mut i = 0;
        while i + 32 <= n {
            // SAFETY: i + 32 ≤ n elements of each pointer.
            unsafe {
                let s0 = _mm512_add_ps(widen(a.add(i)), widen(b.add(i)));
                let s1 = _mm512_add_ps(widen(a.add(i + 16)), widen(b.add(i + 16)));
                if odd(s0) | odd(s1) == 0 {
                    let r = _mm512_cvtne2ps_pbh(s1, s0);
                    o.add(i).cast::<__m512bh>().write_unaligned(r);
                } else {
                    for k in i..i + 32 {
                        let x = super::bf16_to_f32(*a.add(k)) + super::bf16_to_f32(*b.add(k));
                        *o.add(k) = super::f32_to_bf16(x);
                    }
                }
            }
            i += 32;
        }
        i
    }
}

/// `dst = src` rounded to bf16 (to nearest, ties to even; overflow to
/// ±∞, NaN quieted: the bits of `bf16::from_f32`), in vector registers —
/// the conversion the bf16 wire uses, for callers that pack their own
/// bf16 buffers (FSDP's parameter gathers).
///
/// # Panics
/// If the lengths differ.
pub fn round_to_bf16(dst: &mut [bf16], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "round_to_bf16: lengths differ");
    f32s_to_bf16(dst, src);
}

multiversion! {
    /// `d = bf16(s)`, rounded to nearest even.
    fn f32s_to_bf16(d: &mut [bf16], s: &[f32]) {
        for (o, &x) in d.iter_mut().zip(s) {
            *o = f32_to_bf16(x);
        }
    }
}

/// `d += s` for bf16, as [`add_to_bf16`].
fn add_bf16(d: &mut [bf16], s: &[bf16]) {
    let n = d.len().min(s.len());
    let p = d.as_mut_ptr();
    let done = bf16_x86::add(p, p, s.as_ptr(), n);
    add_bf16_mv(&mut d[done..n], &s[done..n]);
}

multiversion! {
    /// `d += s` for bf16, element by element.
    fn add_bf16_mv(d: &mut [bf16], s: &[bf16]) {
        for (a, &b) in d.iter_mut().zip(s) {
            *a = f32_to_bf16(bf16_to_f32(*a) + bf16_to_f32(b));
        }
    }
}

multiversion! {
    /// `d += s` for 16-bit types, as [`add_to_half`].
    fn add_half<H: Element>(d: &mut [H], s: &[H]) {
        for (a, b) in d.iter_mut().zip(s) {
            *a = H::from_f32(a.to_f32() + b.to_f32());
        }
    }
}

fn kernel_f32(op: ReduceOp, d: &mut [f32], s: &[f32]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => add_f32(d, s),
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
        ReduceOp::Sum | ReduceOp::Avg => add_half(d, s),
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
    match (from, to) {
        // the wire's hot pairs, vectorized
        (Dtype::F32, Dtype::BF16) => {
            let s = typed::<f32>(src);
            with_typed_mut::<bf16>(dst, |d| f32s_to_bf16(d, &s));
            return;
        }
        (Dtype::BF16, Dtype::F32) => {
            let s = typed::<bf16>(src);
            with_typed_mut::<f32>(dst, |d| {
                d.iter_mut()
                    .zip(s.iter())
                    .for_each(|(o, &x)| *o = bf16_to_f32(x));
            });
            return;
        }
        _ => {}
    }
    match from {
        Dtype::F32 => dispatch_to!(f32),
        Dtype::F64 => dispatch_to!(f64),
        Dtype::F16 => dispatch_to!(f16),
        Dtype::BF16 => dispatch_to!(bf16),
    }
}

/// An 8-byte-aligned scratch buffer of `len` bytes, taken from this
/// thread's pool and given back when dropped: a `Vec<u64>` viewed as bytes,
/// so that any element type can be read from it in place. Its contents are
/// whatever an earlier user left (initialised memory, never zeroed again):
/// every user writes it before reading. Ranks of the thread backend are
/// threads, so each rank keeps its own few buffers and a collective called
/// again with the same sizes allocates nothing.
pub(crate) struct Scratch {
    words: Vec<u64>,
    len: usize,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<Vec<u64>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Buffers a thread's pool keeps at most.
const SCRATCH_KEPT: usize = 8;

impl Scratch {
    /// A buffer of `len` bytes: the smallest pooled one that is large
    /// enough, else the largest grown to fit, else a new one.
    pub(crate) fn take(len: usize) -> Self {
        if len == 0 {
            return Self {
                words: Vec::new(),
                len,
            };
        }
        let need = len.div_ceil(8);
        let mut words = SCRATCH.with(|p| {
            let mut p = p.borrow_mut();
            let fit = (0..p.len())
                .filter(|&i| p[i].len() >= need)
                .min_by_key(|&i| p[i].len());
            let pick = fit.or_else(|| (0..p.len()).max_by_key(|&i| p[i].len()));
            pick.map(|i| p.swap_remove(i)).unwrap_or_default()
        });
        if words.len() < need {
            words.resize(need, 0);
        }
        Self { words, len }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the Vec<u64> holds at least `len` initialised bytes; u8 has
        // no alignment requirement.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: as above, shared.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let words = std::mem::take(&mut self.words);
        if words.is_empty() {
            return;
        }
        // `try_with`: a buffer dropped while the thread exits is just freed
        let _ = SCRATCH.try_with(|p| {
            let mut p = p.borrow_mut();
            if p.len() < SCRATCH_KEPT {
                p.push(words);
            } else if let Some(i) = (0..p.len()).min_by_key(|&i| p[i].len())
                && p[i].len() < words.len()
            {
                p[i] = words;
            }
        });
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

    /// The branch-free bf16 kernels give `half`'s conversion's bits: every
    /// bf16 added to a spread of others (exact sums, ties to even both
    /// ways, overflow, infinities, NaN of both signs, subnormals).
    #[test]
    fn bf16_kernels_round_as_half_does() {
        let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let mut others: Vec<bf16> = [
            0x0000u16, 0x8000, 0x0001, 0x8001, 0x3F80, 0xBF80, 0x3F81, 0x4380, 0x7F7F, 0xFF7F,
            0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x0080, 0x807F,
        ]
        .iter()
        .map(|&b| bf16::from_bits(b))
        .collect();
        let mut s = 0x9E37_79B9u32;
        for _ in 0..48 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            #[allow(clippy::cast_possible_truncation)]
            others.push(bf16::from_bits(s as u16));
        }
        for &y in &others {
            let b = vec![y; all.len()];
            let want: Vec<u16> = all
                .iter()
                .map(|&x| bf16::from_f32(x.to_f32() + y.to_f32()).to_bits())
                .collect();
            let mut out = vec![bf16::ZERO; all.len()];
            add_to_bf16(&mut out, &all, &b);
            // NaN is NaN: which operand's payload an f32 add keeps is not
            // specified (Rust's float semantics), so only NaN-ness counts
            let same = |g: u16, w: u16| {
                g == w || (bf16::from_bits(g).is_nan() && bf16::from_bits(w).is_nan())
            };
            let mut d = all.clone();
            add_bf16(&mut d, &b);
            // and the plain conversion, on the same sums
            let sums: Vec<f32> = all.iter().map(|&x| x.to_f32() + y.to_f32()).collect();
            let mut conv = vec![bf16::ZERO; all.len()];
            f32s_to_bf16(&mut conv, &sums);
            for (what, got) in [("+", &out), ("+=", &d), ("from f32", &conv)] {
                if let Some(i) = (0..all.len()).find(|&i| !same(got[i].to_bits(), want[i])) {
                    panic!(
                        "{:#06x} {what} {:#06x}: {:#06x}, half gives {:#06x}",
                        all[i].to_bits(),
                        y.to_bits(),
                        got[i].to_bits(),
                        want[i]
                    );
                }
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
