//! Causal multi-head, grouped-query and multi-query self-attention.
//!
//! Shapes (llm.c's legend): `qkv (B,T,C+2·Ckv)` holds the query, key and
//! value projections side by side (`[q | k | v]`, as GPT-2's `c_attn`
//! produces them), query head `h` owning channels `h*HS..(h+1)*HS` of `q`,
//! `HS = C/NH`. With [`Heads`] `{ q: NH, kv: NKV }` the keys and values
//! have `NKV` heads of `HS` channels (`Ckv = NKV·HS`), and query head `h`
//! reads key/value head `h / (NH/NKV)` (grouped-query attention,
//! transformers' `repeat_kv`); multi-head attention is `NKV = NH`
//! (`Ckv = C`, the `(B,T,3C)` of GPT-2). The forward keeps each row's
//! log-sum-exp of its scores, `lse (B,NH,T)`, for the backward, never the
//! `(T,T)` probabilities: the backward computes them again a block at a
//! time (flash attention's way, on the CPU).
//!
//! # How it runs
//!
//! The keys are cut into *leaves* of 64 positions, the query rows into
//! blocks of 64. For a block of query rows and a leaf at or before it, the
//! forward computes the scores `QKᵀ`, each row's maximum `m` over the
//! keys it sees in the leaf, `e^(s - m)`, their sum `l` and
//! `Σ e^(s - m)·v`: the leaf's *partial*. Partials merge (online softmax:
//! the larger maximum, both sums rescaled to it) in a fixed tree, and the
//! output is `Σ / l`, `lse = m + ln l`. The backward walks the same blocks
//! and leaves: `P = e^(s - lse)`, `dP = dO·Vᵀ`,
//! `dS = P ⊙ (dP - rowsum(dO ⊙ O))` scaled; each leaf's `dQ = dS·K` merges
//! (adds) over the key leaves in the tree, and each leaf's `dKᵀ = Qᵀ·dS`
//! and `dVᵀ = dOᵀ·P` over the query blocks in the tree, the query heads
//! of a group adding into one key/value partial in head order. Forward
//! and backward run per (sequence, head) and per (sequence, key/value
//! head) in parallel.
//!
//! Every product is a sequence of register tiles — up to 6 rows by 64
//! columns, 24 AVX-512 accumulators. The operand a tile reads as vectors
//! must be contiguous along the tile's columns, so the keys (values for
//! `dO·Vᵀ`) are transposed once per head with 16×16 in-register
//! transposes into a per-thread buffer that grows once to the longest
//! sequence; no GEMM library is involved.
//!
//! # Summation order
//!
//! Each element of a leaf's products is one running sum over its reduction
//! index in increasing order (`acc = a·b + acc`, fused on AVX-512 for
//! `f32`, separate multiply and add otherwise), started from zero, then
//! scaled; a leaf's maximum and sum of exponentials run over the row's
//! visible keys of the leaf in 16 lanes. Partials merge in one tree over
//! the leaves (key leaves for the output and `dQ`, query blocks for `dK`
//! and `dV`): a node is a run of leaves whose length is a power of two and
//! whose first leaf is a multiple of it, its two halves merge left with
//! right, and leaves that see nothing (after a row, or before its start)
//! are empty partials that change nothing. Nothing else enters a result:
//! not the batch, the head count, the sequence's length past the row, the
//! tile or the thread. So one sequence gives the same bits alone or
//! anywhere in a batch; [`attention_decode`] reproduces the forward's row
//! bit for bit; and a run of leaves that is a node (`2^k` leaves from a
//! multiple of `2^k`, such as a context-parallel rank's slice of a
//! sequence) can be computed on its own, anywhere, and merged later into
//! the same bits. (The AVX-512 kernel and the portable one differ in the
//! last bits, as any two machines with and without FMA would; the choice
//! is made once per process by [`weft_numerics::simd::level`], so a
//! trainer and a decoder in the same process always agree.)

use rayon::prelude::*;

use crate::Real;
use crate::error::{Error, Result, check};

/// Rows (queries, or keys in the dK/dV pass) of one parallel work item.
const BLOCK: usize = 64;
// The forward packs the keys of row block `blk` as key block `blk`.
const _: () = assert!(BLOCK == NR);
/// Rows of a register tile.
const MR: usize = 6;
/// Widest register tile (four 16-lane vectors), and the keys of a packed
/// transposed tile.
const NR: usize = 64;

/// Attention heads: `q` query heads sharing `kv` key/value heads.
/// `kv` divides `q`: multi-head attention when they are equal (what a
/// plain head count converts to), grouped-query when `kv` is smaller,
/// multi-query at `kv = 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    /// Query heads, NH.
    pub q: usize,
    /// Key/value heads, NKV.
    pub kv: usize,
}

impl Heads {
    /// Query heads per key/value head.
    pub fn group(self) -> usize {
        self.q / self.kv.max(1)
    }
}

impl From<usize> for Heads {
    /// Multi-head attention: `nh` query heads, each with its own keys and values.
    fn from(nh: usize) -> Self {
        Heads { q: nh, kv: nh }
    }
}

/// `HS`, and the key/value width `Ckv`, checking `NH | C` and `NKV | NH`.
fn dims(op: &'static str, c: usize, heads: Heads) -> Result<(usize, usize)> {
    let nh = heads.q;
    if nh == 0 || !c.is_multiple_of(nh) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("channels C={c} not divisible by heads NH={nh}"),
        });
    }
    if heads.kv == 0 || !nh.is_multiple_of(heads.kv) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!(
                "key/value heads NKV={} must be at least 1 and divide NH={nh}",
                heads.kv
            ),
        });
    }
    Ok((c / nh, c / nh * heads.kv))
}

/// What a tile does with its sums.
#[derive(Clone, Copy)]
enum Fin<T> {
    /// `c = scale · acc`.
    Store(T),
    /// `c += acc`.
    Add,
}

/// `c[r, j] (m×w) = fin(init + Σ_{l<k} a(r, l) · b[l, j])`, with
/// `a(r, l) = a[r·ars + l·acs]`, `b[l, j] = b[l·ldb + j]` and
/// `c[r, j] = c[r·ldc + j]`; `1 ≤ m ≤ MR`, `1 ≤ w ≤ NR`. The sum runs over
/// `l` in order, one running sum per element (see the module docs).
#[derive(Clone, Copy)]
struct Tile<T> {
    m: usize,
    w: usize,
    k: usize,
    a: *const T,
    ars: usize,
    acs: usize,
    b: *const T,
    ldb: usize,
    c: *mut T,
    ldc: usize,
    fin: Fin<T>,
}

/// Runs one tile with the best kernel for `T` on this CPU.
///
/// # Safety
/// Every `a(r, l)` and `b[l, j]` the tile reads (`r < m`, `l < k`,
/// `j < w`) must be readable, every `c[r, j]` writable, and no other
/// thread may access those `c` elements meanwhile.
unsafe fn run_tile<T: Real>(t: &Tile<T>) {
    #[cfg(target_arch = "x86_64")]
    if fast::<T>() {
        // SAFETY: `T` is `f32`, so `Tile<T>` is `Tile<f32>`.
        let t32 = unsafe { &*std::ptr::from_ref(t).cast::<Tile<f32>>() };
        // SAFETY: the CPU supports AVX-512 F (`level()`); the pointers'
        // validity is this function's contract.
        unsafe { avx512::tile(t32) };
        return;
    }
    // SAFETY: this function's contract.
    unsafe { tile_generic(t) }
}

/// The portable kernel: the same sums as [`avx512::tile`], with separate
/// multiplies and adds.
///
/// # Safety
/// As [`run_tile`].
unsafe fn tile_generic<T: Real>(t: &Tile<T>) {
    let (m, w) = (t.m.min(MR), t.w.min(NR));
    let mut acc = [[T::ZERO; NR]; MR];
    for l in 0..t.k {
        // SAFETY: row `l` of `b`, `w` elements, is in the tile.
        let b = unsafe { std::slice::from_raw_parts(t.b.add(l * t.ldb), w) };
        for (r, acc) in acc.iter_mut().enumerate().take(m) {
            // SAFETY: `a(r, l)` is in the tile.
            let a = unsafe { *t.a.add(r * t.ars + l * t.acs) };
            for (x, &y) in acc[..w].iter_mut().zip(b) {
                *x += a * y;
            }
        }
    }
    for (r, acc) in acc.iter().enumerate().take(m) {
        for (j, &x) in acc.iter().enumerate().take(w) {
            // SAFETY: `c[r, j]` is in the tile, ours alone.
            let c = unsafe { &mut *t.c.add(r * t.ldc + j) };
            match t.fin {
                Fin::Store(s) => *c = x * s,
                Fin::Add => *c += x,
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    #[allow(clippy::wildcard_imports)]
    use std::arch::x86_64::*;

    use super::{Fin, Tile};

    /// [`super::run_tile`] for `f32` on AVX-512: one fused multiply-add per
    /// term and element, partial vectors masked.
    ///
    /// # Safety
    /// As [`super::run_tile`], on a CPU with AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile(t: &Tile<f32>) {
        let nv = t.w.div_ceil(16);
        let tail = t.w + 16 - 16 * nv.max(1);
        let last: __mmask16 = if tail >= 16 {
            0xffff
        } else {
            (1u16 << tail) - 1
        };
        macro_rules! go {
            ($($m:literal)*) => {
                match (t.m, nv) {
                    $(
                        // SAFETY: the caller's contract; `m` and `nv` match.
                        ($m, 1) => unsafe { body::<$m, 1>(t, last) },
                        // SAFETY: as above.
                        ($m, 2) => unsafe { body::<$m, 2>(t, last) },
                        // SAFETY: as above.
                        ($m, 3) => unsafe { body::<$m, 3>(t, last) },
                        // SAFETY: as above.
                        ($m, 4) => unsafe { body::<$m, 4>(t, last) },
                    )*
                    // SAFETY: as above (shapes the tile code never makes).
                    _ => unsafe { super::tile_generic(t) },
                }
            };
        }
        go!(1 2 3 4 5 6);
    }

    /// `dst[e·ldd + k] = src[k·lds + e]` for `k, e < 16` (`+=` with `ADD`).
    ///
    /// # Safety
    /// Both 16×16 blocks must be in bounds; AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose16<const ADD: bool>(
        dst: *mut f32,
        ldd: usize,
        src: *const f32,
        lds: usize,
    ) {
        let mut r = [_mm512_setzero_ps(); 16];
        for (k, r) in r.iter_mut().enumerate() {
            // SAFETY: row `k` of the source block.
            *r = unsafe { _mm512_loadu_ps(src.add(k * lds)) };
        }
        // Per 128-bit lane L: pairs of rows interleaved...
        let mut t = [_mm512_setzero_ps(); 16];
        for a in 0..8 {
            t[2 * a] = _mm512_unpacklo_ps(r[2 * a], r[2 * a + 1]);
            t[2 * a + 1] = _mm512_unpackhi_ps(r[2 * a], r[2 * a + 1]);
        }
        // ...then x[4b + e] holds, in lane L, column 4L+e of rows 4b..4b+4.
        let mut x = [_mm512_setzero_ps(); 16];
        let pd = _mm512_castps_pd;
        for b in 0..4 {
            let (lo0, hi0, lo1, hi1) = (t[4 * b], t[4 * b + 1], t[4 * b + 2], t[4 * b + 3]);
            x[4 * b] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(lo0), pd(lo1)));
            x[4 * b + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(lo0), pd(lo1)));
            x[4 * b + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(hi0), pd(hi1)));
            x[4 * b + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(hi0), pd(hi1)));
        }
        // A 4×4 transpose of 128-bit lanes gives column 4L+e.
        for e in 0..4 {
            let (x0, x1, x2, x3) = (x[e], x[4 + e], x[8 + e], x[12 + e]);
            let y0 = _mm512_shuffle_f32x4::<0x44>(x0, x1);
            let y1 = _mm512_shuffle_f32x4::<0xEE>(x0, x1);
            let y2 = _mm512_shuffle_f32x4::<0x44>(x2, x3);
            let y3 = _mm512_shuffle_f32x4::<0xEE>(x2, x3);
            let cols = [
                _mm512_shuffle_f32x4::<0x88>(y0, y2),
                _mm512_shuffle_f32x4::<0xDD>(y0, y2),
                _mm512_shuffle_f32x4::<0x88>(y1, y3),
                _mm512_shuffle_f32x4::<0xDD>(y1, y3),
            ];
            for (l, col) in cols.into_iter().enumerate() {
                // SAFETY: row `4L+e` of the destination block.
                unsafe {
                    let to = dst.add((4 * l + e) * ldd);
                    let col = if ADD {
                        _mm512_add_ps(col, _mm512_loadu_ps(to))
                    } else {
                        col
                    };
                    _mm512_storeu_ps(to, col);
                }
            }
        }
    }

    /// One `M`×`16·NV` tile; `last` masks the last vector's lanes.
    ///
    /// # Safety
    /// As [`tile`], with `t.m == M` and `t.w` in `16·(NV-1)+1..=16·NV`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn body<const M: usize, const NV: usize>(t: &Tile<f32>, last: __mmask16) {
        let mask = |v: usize| if v + 1 == NV { last } else { 0xffff };
        let mut acc = [[_mm512_setzero_ps(); NV]; M];
        let (mut a, mut b) = (t.a, t.b);
        for _ in 0..t.k {
            let mut bv = [_mm512_setzero_ps(); NV];
            for (v, x) in bv.iter_mut().enumerate() {
                // SAFETY: the unmasked lanes are `b[l, j]`, `j < w`.
                *x = unsafe { _mm512_maskz_loadu_ps(mask(v), b.add(16 * v)) };
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: `a(r, l)` is in the tile.
                let av = _mm512_set1_ps(unsafe { *a.add(r * t.ars) });
                for (x, &y) in acc.iter_mut().zip(&bv) {
                    *x = _mm512_fmadd_ps(av, y, *x);
                }
            }
            a = a.wrapping_add(t.acs);
            b = b.wrapping_add(t.ldb);
        }
        for (r, acc) in acc.iter().enumerate() {
            for (v, &x) in acc.iter().enumerate() {
                let c = t.c.wrapping_add(r * t.ldc + 16 * v);
                let y = match t.fin {
                    Fin::Store(s) => _mm512_mul_ps(x, _mm512_set1_ps(s)),
                    // SAFETY: the unmasked lanes are `c[r, j]`, `j < w`.
                    Fin::Add => _mm512_add_ps(x, unsafe { _mm512_maskz_loadu_ps(mask(v), c) }),
                };
                // SAFETY: as above, and ours alone.
                unsafe { _mm512_mask_storeu_ps(c, mask(v), y) };
            }
        }
    }
}

/// `kt[d·NR + j] = keys[j·ldk + d]` for `j < kw`, `d < hs`: a block of
/// `kw ≤ NR` keys (or values), transposed into `hs` rows of [`NR`].
fn pack_block<T: Real>(kt: &mut [T], keys: &[T], ldk: usize, kw: usize, hs: usize) {
    transpose(kt, NR, keys, ldk, kw, hs);
}

/// `dst[d·ldd + j] = src[j·lds + d]` for `j < n`, `d < w`.
fn transpose<T: Real>(kt: &mut [T], ldd: usize, keys: &[T], ldk: usize, kw: usize, hs: usize) {
    // Keys and channels done by the AVX-512 16×16 blocks.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let (mut j16, mut d16) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if fast::<T>() && kw > 0 {
        (j16, d16) = (kw / 16 * 16, hs / 16 * 16);
        assert!(kt.len() >= (hs - 1) * ldd + kw && keys.len() >= (kw - 1) * ldk + hs);
        for j in (0..j16).step_by(16) {
            for d in (0..d16).step_by(16) {
                // SAFETY: `T` is `f32`; keys `j..j+16`, channels `d..d+16`
                // are in `keys`, rows `d..d+16`, columns `j..j+16` in `kt`
                // (asserted above); the CPU has AVX-512 F (`fast`).
                unsafe {
                    avx512::transpose16::<false>(
                        kt.as_mut_ptr().cast::<f32>().add(d * ldd + j),
                        ldd,
                        keys.as_ptr().cast::<f32>().add(j * ldk + d),
                        ldk,
                    );
                }
            }
        }
    }
    for j in 0..kw {
        let row = &keys[j * ldk..j * ldk + hs];
        let d_from = if j < j16 { d16 } else { 0 };
        for (d, &x) in row.iter().enumerate().skip(d_from) {
            kt[d * ldd + j] = x;
        }
    }
}

/// `dst[j·ldd + d] += src[d·lds + j]` for `j < n`, `d < w`, in 16×16
/// blocks (both sides' lines stay in cache).
///
/// # Safety
/// `dst` must be writable at those elements, ours alone.
unsafe fn transpose_add<T: Real>(
    dst: *mut T,
    ldd: usize,
    src: &[T],
    lds: usize,
    n: usize,
    w: usize,
) {
    for j0 in (0..n).step_by(16) {
        for d0 in (0..w).step_by(16) {
            #[cfg(target_arch = "x86_64")]
            if fast::<T>() && j0 + 16 <= n && d0 + 16 <= w {
                assert!(src.len() >= (d0 + 15) * lds + j0 + 16);
                // SAFETY: `T` is `f32`; the source block is in `src`
                // (asserted), the destination block in the caller's range;
                // the CPU has AVX-512 F (`fast`).
                unsafe {
                    avx512::transpose16::<true>(
                        dst.cast::<f32>().add(j0 * ldd + d0),
                        ldd,
                        src.as_ptr().cast::<f32>().add(d0 * lds + j0),
                        lds,
                    );
                }
                continue;
            }
            for j in j0..(j0 + 16).min(n) {
                for d in d0..(d0 + 16).min(w) {
                    // SAFETY: the caller's contract.
                    unsafe { *dst.add(j * ldd + d) += src[d * lds + j] };
                }
            }
        }
    }
}

/// Scores (or `dO·Vᵀ`) of the query rows `ia..ib` against the block of
/// keys `k0..k0+kw` packed in `kt` ([`pack_block`]):
/// `c[i, j] = scale · Σ_d a_i[d] · key_j[d]` over `hs` channels, each row
/// tile only as wide as the keys at or before its last row (`k0 < ib`).
/// `a` and `c` point at row `ia` (strides `ars`, `ldc`), `c` at column `k0`.
///
/// # Safety
/// `a` must be readable for rows `ia..ib` of `hs` channels, `c` writable
/// for rows `ia..ib` of `kw` columns, ours alone.
#[allow(clippy::too_many_arguments)]
unsafe fn dots<T: Real>(
    kt: &[T],
    k0: usize,
    kw: usize,
    hs: usize,
    (ia, ib): (usize, usize),
    (a, ars): (*const T, usize),
    (c, ldc): (*mut T, usize),
    scale: T,
) {
    assert!(kt.len() >= hs * NR);
    for r0 in (ia..ib).step_by(MR) {
        let m = MR.min(ib - r0);
        let tile = Tile {
            m,
            w: kw.min(r0 + m - k0),
            k: hs,
            a: a.wrapping_add((r0 - ia) * ars),
            ars,
            acs: 1,
            b: kt.as_ptr(),
            ldb: NR,
            c: c.wrapping_add((r0 - ia) * ldc),
            ldc,
            fin: Fin::Store(scale),
        };
        // SAFETY: rows `r0..r0+m` of `a` and of `c` (at most `kw` columns)
        // are in the caller's ranges; `kt` holds `hs` rows of `NR`.
        unsafe { run_tile(&tile) };
    }
}

/// `c[r, :hs] = fin(Σ_{l<k} a(r, l) · b[l, :hs])` for `m ≤ MR` rows, in
/// column chunks of [`NR`] (columns are independent sums).
///
/// # Safety
/// As [`run_tile`] for an `m`×`hs` tile.
#[allow(clippy::too_many_arguments)]
unsafe fn weighted<T: Real>(
    m: usize,
    k: usize,
    (a, ars, acs): (*const T, usize, usize),
    (b, ldb): (*const T, usize),
    hs: usize,
    (c, ldc): (*mut T, usize),
    fin: Fin<T>,
) {
    for w0 in (0..hs).step_by(NR) {
        let tile = Tile {
            m,
            w: NR.min(hs - w0),
            k,
            a,
            ars,
            acs,
            b: b.wrapping_add(w0),
            ldb,
            c: c.wrapping_add(w0),
            ldc,
            fin,
        };
        // SAFETY: the caller's contract, columns `w0..w0+w` of it.
        unsafe { run_tile(&tile) };
    }
}

/// Whether `T` is `f32` and the CPU has AVX-512 (the fast kernels).
fn fast<T: Real>() -> bool {
    cfg!(target_arch = "x86_64")
        && std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>()
        && weft_numerics::simd::level() == weft_numerics::simd::Level::Avx512
}

thread_local! {
    /// Each thread's buffer for the transposed keys (or values) of the
    /// head it works on; it grows to the longest sequence seen, once.
    static PACK: std::cell::RefCell<Vec<f64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on a buffer of `len` elements (contents unspecified): this
/// thread's [`PACK`] buffer, or a fresh one should it be in use.
fn with_pack<T: Real, R>(len: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
    let words = (len * size_of::<T>()).div_ceil(size_of::<f64>());
    PACK.with(|cell| {
        let mut own = Vec::new();
        let mut guard = cell.try_borrow_mut().ok();
        let v = guard.as_deref_mut().unwrap_or(&mut own);
        if v.len() < words {
            v.resize(words, 0.0);
        }
        // SAFETY: `T` is `f32` or `f64` (sealed): no stricter alignment than
        // `f64`, every bit pattern valid; `words` words hold `len` of them.
        let buf = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<T>(), len) };
        f(buf)
    })
}

/// A pointer shared by the parallel work items, each of which touches
/// only its own elements.
#[derive(Clone, Copy)]
struct Shared<T>(*mut T);
// SAFETY: the items write disjoint elements (argued at each use).
unsafe impl<T: Send> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for Shared<T> {}
impl<T> Shared<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

/// Each row's document start, for document masking: `starts (B,T)` from
/// `tokens (B,T)`, where a document ends with (and includes) the token
/// `boundary` (GPT-2's end-of-text). Row `i` of a sequence starts one past
/// the last boundary token before it, or at 0. Its distance from the start,
/// `i - starts[i]`, is its position within its document
/// ([`encoder_forward`](crate::encoder_forward)'s `positions`).
///
/// # Errors
/// [`Error::ShapeMismatch`] if `out` and `tokens` are not both `B·T` long.
pub fn doc_starts(
    out: &mut [u32],
    tokens: &[u32],
    boundary: u32,
    b: usize,
    t: usize,
) -> Result<()> {
    const OP: &str = "doc_starts";
    check(OP, "out", out, b * t)?;
    check(OP, "tokens", tokens, b * t)?;
    if t == 0 {
        return Ok(());
    }
    for (o, tok) in out.chunks_exact_mut(t).zip(tokens.chunks_exact(t)) {
        let mut start = 0u32;
        for (i, (o, &x)) in o.iter_mut().zip(tok).enumerate() {
            *o = start;
            if x == boundary {
                start = u32::try_from(i + 1).unwrap_or(u32::MAX);
            }
        }
    }
    Ok(())
}

/// Each row's first visible key under sliding-window attention
/// (Mistral's, Gemma's local layers): row `i` sees the `window` keys
/// `i+1-window..=i` (all of `0..=i` while `i < window`), and, with
/// `docs` ([`doc_starts`]), none before its document's start. The result
/// goes to [`attention_forward`]'s `docs` argument (the per-row starts the
/// kernel masks by); for decoding, position `pos`'s start is the same
/// `max(doc start, pos+1-window)`.
///
/// # Errors
/// [`Error::ShapeMismatch`] on a wrong buffer length,
/// [`Error::InvalidArgument`] on a window of 0.
pub fn window_starts(
    out: &mut [u32],
    docs: Option<&[u32]>,
    window: usize,
    b: usize,
    t: usize,
) -> Result<()> {
    const OP: &str = "window_starts";
    check(OP, "out", out, b * t)?;
    if let Some(d) = docs {
        check(OP, "docs", d, b * t)?;
    }
    if window == 0 {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: "the window must hold at least one key".into(),
        });
    }
    for (r, o) in out.iter_mut().enumerate() {
        let first = (r % t + 1).saturating_sub(window);
        let doc = docs.map_or(0, |d| d[r] as usize);
        *o = u32::try_from(first.max(doc)).unwrap_or(u32::MAX);
    }
    Ok(())
}

/// A run of leaves `lo..hi` that is a node of the merge tree: its length
/// a power of two, `lo` a multiple of it (see the module docs).
fn is_node(lo: usize, hi: usize) -> bool {
    hi > lo && (hi - lo).is_power_of_two() && lo.is_multiple_of(hi - lo)
}

/// Two partial results in tree order; `None` is the empty partial (a run
/// of leaves nothing in which is visible), which changes nothing.
fn join<P>(a: Option<P>, b: Option<P>, merge: &mut impl FnMut(P, P) -> P) -> Option<P> {
    match (a, b) {
        (Some(a), Some(b)) => Some(merge(a, b)),
        (a, None) => a,
        (None, b) => b,
    }
}

/// Partial results over runs of leaves, merged in the fixed tree as they
/// arrive in order (leaves one by one, or whole nodes computed
/// elsewhere): two neighbours that are the halves of a node merge at
/// once; [`finish`](Self::finish) merges what is left from the right,
/// which is the tree's order when every later leaf is empty.
struct Tree<P> {
    stack: Vec<(usize, usize, Option<P>)>,
}

impl<P> Tree<P> {
    fn new() -> Self {
        Tree { stack: Vec::new() }
    }

    /// Adds node `lo..hi`, which starts where the last one ended.
    fn push(&mut self, lo: usize, hi: usize, p: Option<P>, merge: &mut impl FnMut(P, P) -> P) {
        debug_assert!(is_node(lo, hi));
        debug_assert!(self.stack.last().is_none_or(|&(_, e, _)| e == lo));
        self.stack.push((lo, hi, p));
        while let [.., (a0, a1, _), (b0, b1, _)] = self.stack[..] {
            if a1 != b0 || a1 - a0 != b1 - b0 || !is_node(a0, b1) {
                break;
            }
            let (_, _, pb) = self.stack.pop().expect("two entries");
            let (_, _, pa) = self.stack.pop().expect("two entries");
            self.stack.push((a0, b1, join(pa, pb, merge)));
        }
    }

    /// The merge of every pushed leaf (every later one empty).
    fn finish(mut self, merge: &mut impl FnMut(P, P) -> P) -> Option<P> {
        let mut acc = None;
        while let Some((_, _, p)) = self.stack.pop() {
            acc = join(p, acc, merge);
        }
        acc
    }
}

/// A buffer of `len` elements from `pool` (contents unspecified).
fn take<T: Real>(pool: &mut Vec<Vec<T>>, len: usize) -> Vec<T> {
    let mut v = pool.pop().unwrap_or_default();
    v.resize(len, T::ZERO);
    v
}

/// `a += b` elementwise (`b` back to the pool): the merge of gradient
/// partials.
fn add_into<T: Real>(mut a: Vec<T>, b: Vec<T>, pool: &mut Vec<Vec<T>>) -> Vec<T> {
    add_slices(&mut a, &b);
    pool.push(b);
    a
}

crate::simd::multiversion! {
    fn add_slices<T: Real>(a: &mut [T], b: &[T]) {
        for (x, &y) in a.iter_mut().zip(b) {
            *x += y;
        }
    }
}

crate::simd::multiversion! {
    /// `x ← e^(x - max x)`; returns `(max x, Σ e^(x - max x))` (16 lanes).
    fn exp_sum<T: Real>(x: &mut [T]) -> (T, T) {
        let m = crate::real::max_lanes(x);
        for v in x.iter_mut() {
            *v = (*v - m).exp();
        }
        (m, crate::real::sum_lanes(x))
    }
}

crate::simd::multiversion! {
    /// The score gradients of one row's visible keys: `p ← e^(s - lse)`
    /// (the probabilities) and `d ← p · (d - delta) · scale`, `d` holding
    /// `dO·Vᵀ`.
    fn probs_and_grads<T: Real>(p: &mut [T], d: &mut [T], lse: T, delta: T, scale: T) {
        for (p, d) in p.iter_mut().zip(d.iter_mut()) {
            *p = (*p - lse).exp();
            *d = *p * (*d - delta) * scale;
        }
    }
}

/// The keys row `i` sees among `k0..k0+kw`: `lo..hi`, empty when none.
fn visible(start: usize, i: usize, k0: usize, kw: usize) -> (usize, usize) {
    (start.max(k0), (i + 1).min(k0 + kw))
}

/// A forward partial of [`BLOCK`] rows: each row's maximum score
/// `m[BLOCK]` (−∞: nothing seen yet), its sum of `e^(s - m)` `l[BLOCK]`,
/// and `Σ e^(s - m)·v` `o[BLOCK·HS]`, side by side.
fn softmax_len(hs: usize) -> usize {
    BLOCK * (2 + hs)
}

/// Merges forward partials `b` into `a` (`b` earlier or later in tree
/// order as the caller passes them: `a` holds the left run): for each of
/// the first `rows` rows, the larger maximum and both sums rescaled to it.
/// A row empty on one side takes the other side's values unchanged.
fn merge_softmax<T: Real>(
    mut a: Vec<T>,
    b: Vec<T>,
    rows: usize,
    hs: usize,
    pool: &mut Vec<Vec<T>>,
) -> Vec<T> {
    let (am, rest) = a.split_at_mut(BLOCK);
    let (al, ao) = rest.split_at_mut(BLOCK);
    let (bm, rest) = b.split_at(BLOCK);
    let (bl, bo) = rest.split_at(BLOCK);
    for r in 0..rows {
        let (ma, mb) = (am[r], bm[r]);
        let (oa, ob) = (&mut ao[r * hs..(r + 1) * hs], &bo[r * hs..(r + 1) * hs]);
        if mb == T::NEG_INFINITY {
            continue;
        }
        if ma == T::NEG_INFINITY {
            (am[r], al[r]) = (mb, bl[r]);
            oa.copy_from_slice(ob);
            continue;
        }
        let m = if mb > ma { mb } else { ma };
        let (x, y) = ((ma - m).exp(), (mb - m).exp());
        am[r] = m;
        al[r] = al[r] * x + bl[r] * y;
        rescale_add(oa, x, ob, y);
    }
    pool.push(b);
    a
}

crate::simd::multiversion! {
    /// `a ← a·x + b·y`.
    fn rescale_add<T: Real>(a: &mut [T], x: T, b: &[T], y: T) {
        for (a, &b) in a.iter_mut().zip(b) {
            *a = *a * x + b * y;
        }
    }
}

/// The forward partial of query rows `i0..i1` over the leaf of keys
/// `k0..k0+kw` (packed in `kt`; their values are rows `k0..` of `vals`,
/// stride `ldv`), or `None` when no row sees any of them. `s` is a
/// [`BLOCK`]`×`[`NR`] scratch.
#[allow(clippy::too_many_arguments)]
fn forward_leaf<T: Real>(
    kt: &[T],
    (k0, kw): (usize, usize),
    (i0, i1): (usize, usize),
    (q, ldq): (*const T, usize),
    (vals, ldv): (*const T, usize),
    starts: &dyn Fn(usize) -> usize,
    (hs, scale): (usize, T),
    s: &mut [T],
    pool: &mut Vec<Vec<T>>,
) -> Option<Vec<T>> {
    if (i0..i1).all(|i| {
        let (lo, hi) = visible(starts(i), i, k0, kw);
        lo >= hi
    }) {
        return None;
    }
    // SAFETY: the caller's rows `i0..i1` of `q`; `s` holds `BLOCK` rows of
    // `NR`, ours.
    unsafe {
        dots(
            kt,
            k0,
            kw,
            hs,
            (i0, i1),
            (q, ldq),
            (s.as_mut_ptr(), NR),
            scale,
        );
    }
    let mut p = take(pool, softmax_len(hs));
    for i in i0..i1 {
        let r = i - i0;
        let row = &mut s[r * NR..r * NR + kw];
        let (lo, hi) = visible(starts(i), i, k0, kw);
        if lo >= hi {
            row.fill(T::ZERO);
            (p[r], p[BLOCK + r]) = (T::NEG_INFINITY, T::ZERO);
            continue;
        }
        let (m, l) = exp_sum(&mut row[lo - k0..hi - k0]);
        row[..lo - k0].fill(T::ZERO);
        row[hi - k0..].fill(T::ZERO);
        (p[r], p[BLOCK + r]) = (m, l);
    }
    let o = p[2 * BLOCK..].as_mut_ptr();
    for r0 in (i0..i1).step_by(MR) {
        let m = MR.min(i1 - r0);
        // SAFETY: rows `r0-i0..` of `s` hold `kw` probabilities, the
        // values' rows `k0..k0+kw` are the caller's; the partial's rows
        // are ours. The keys after the tile's last row weigh zero: their
        // terms would add exact zeros, so they are left out.
        unsafe {
            weighted(
                m,
                kw.min(r0 + m - k0),
                (s[(r0 - i0) * NR..].as_ptr(), NR, 1),
                (vals, ldv),
                hs,
                (o.add((r0 - i0) * hs), hs),
                Fin::Store(T::ONE),
            );
        }
    }
    Some(p)
}

/// Forward: `out (B,T,C)` and each row's log-sum-exp of its scores
/// `lse (B,NH,T)` (what the backward needs of the softmax) from
/// `qkv (B,T,C+2·Ckv)` (see the module docs for the heads and the
/// order of the sums), with scores scaled by `1/sqrt(HS)` and a causal
/// mask.
///
/// `docs`, when given, is each row's first visible key `(B,T)`
/// ([`doc_starts`], [`window_starts`]): row `i` then attends only to keys
/// `docs[i]..=i` (document masking, sliding windows). A document's rows
/// then have the same bits as the same document alone at the start of a
/// sequence when it starts on a block of 64 (the leaves are the same).
///
/// # Errors
/// [`Error::ShapeMismatch`] on a wrong buffer length,
/// [`Error::InvalidArgument`] if `NH` does not divide `C`, `NKV` does
/// not divide `NH`, or a row's start lies after the row.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward<T: Real>(
    out: &mut [T],
    lse: &mut [T],
    qkv: &[T],
    docs: Option<&[u32]>,
    b: usize,
    t: usize,
    c: usize,
    heads: impl Into<Heads>,
) -> Result<()> {
    const OP: &str = "attention_forward";
    let heads = heads.into();
    let (hs, ckv) = dims(OP, c, heads)?;
    let (nh, g, w) = (heads.q, heads.group(), c + 2 * ckv);
    check(OP, "out", out, b * t * c)?;
    check(OP, "lse", lse, b * nh * t)?;
    check(OP, "qkv", qkv, b * t * w)?;
    check_starts(OP, docs, b, t)?;
    if b * t * c == 0 {
        return Ok(());
    }
    #[allow(clippy::cast_precision_loss)]
    let scale = T::from_f64(1.0 / (hs as f64).sqrt());
    let out = Shared(out.as_mut_ptr());
    lse.par_chunks_mut(t).enumerate().for_each(|(bh, lse)| {
        let (bb, h) = (bh / nh, bh % nh);
        let kh = h / g;
        let x = &qkv[bb * t * w..(bb + 1) * t * w];
        let rows = |col| Rows {
            data: x,
            ld: w,
            col,
            first: 0,
            len: t,
        };
        let starts = |i: usize| docs.map_or(0, |d| d[bb * t + i] as usize);
        forward_head(
            (rows(h * hs), rows(c + kh * hs), rows(c + ckv + kh * hs)),
            &starts,
            (hs, scale),
            // (every row sees itself: a block's partial is never empty)
            &mut |i0, i1, p, pool| {
                let Some(p) = p else { return };
                for (i, lse) in lse.iter_mut().enumerate().take(i1).skip(i0) {
                    // SAFETY: row `i` of sequence `bb`, channels of head
                    // `h`, are this item's alone.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(out.get().add((bb * t + i) * c + h * hs), hs)
                    };
                    *lse = finalize(&p, i - i0, hs, dst);
                }
                pool.push(p);
            },
        );
    });
    Ok(())
}

/// One sequence's rows of an operand, by position in the sequence: head
/// channel `d` of row `i` (`first ≤ i < first + len`) at
/// `data[(i - first)·ld + col + d]`.
#[derive(Clone, Copy)]
struct Rows<'a, T> {
    data: &'a [T],
    ld: usize,
    col: usize,
    first: usize,
    len: usize,
}

impl<'a, T> Rows<'a, T> {
    /// Rows `0..len` of a sequence.
    fn whole(data: &'a [T], ld: usize, col: usize, len: usize) -> Self {
        Rows {
            data,
            ld,
            col,
            first: 0,
            len,
        }
    }
    /// Sequence `bb`'s rows at `span` of a batch `(B, span.len, ld)`.
    fn of_sequence(data: &'a [T], bb: usize, ld: usize, col: usize, span: Span) -> Self {
        Rows {
            data: &data[bb * span.len * ld..(bb + 1) * span.len * ld],
            ld,
            col,
            first: span.first,
            len: span.len,
        }
    }
    fn end(&self) -> usize {
        self.first + self.len
    }
    /// From row `i`, channel 0 of the head, on.
    fn at(&self, i: usize) -> &'a [T] {
        &self.data[(i - self.first) * self.ld + self.col..]
    }
    /// The same rows, `d` channels further.
    fn shift(self, d: usize) -> Self {
        Rows {
            col: self.col + d,
            ..self
        }
    }
}

/// The key leaves of `k`: `first..end` in leaf numbers.
fn leaves<T>(k: &Rows<'_, T>) -> (usize, usize) {
    (k.first / BLOCK, k.end().div_ceil(BLOCK))
}

/// The forward partials of one sequence and query head: each block of up
/// to 64 query rows of `q` (from `q.first`) against the leaves of keys `k`
/// (values `v`; `k.first` a multiple of 64), merged in the tree over those
/// leaves; `emit(i0, i1, partial, pool)` for each block (`None`: no row
/// sees any key).
#[allow(clippy::type_complexity)]
fn forward_head<T: Real>(
    (q, k, v): (Rows<'_, T>, Rows<'_, T>, Rows<'_, T>),
    starts: &dyn Fn(usize) -> usize,
    (hs, scale): (usize, T),
    emit: &mut dyn FnMut(usize, usize, Option<Vec<T>>, &mut Vec<Vec<T>>),
) {
    let (l0, l1) = leaves(&k);
    with_pack(
        (l1 - l0) * hs * NR + k.len * hs + BLOCK * NR,
        |buf: &mut [T]| {
            let (kt, rest) = buf.split_at_mut((l1 - l0) * hs * NR);
            let (vc, s) = rest.split_at_mut(k.len * hs);
            for kb in l0..l1 {
                let k0 = kb * BLOCK;
                pack_block(
                    &mut kt[(kb - l0) * hs * NR..],
                    k.at(k0),
                    k.ld,
                    NR.min(k.end() - k0),
                    hs,
                );
            }
            for j in k.first..k.end() {
                vc[(j - k.first) * hs..(j - k.first + 1) * hs].copy_from_slice(&v.at(j)[..hs]);
            }
            let mut pool = Vec::new();
            for i0 in (q.first..q.end()).step_by(BLOCK) {
                let i1 = (i0 + BLOCK).min(q.end());
                let rows = i1 - i0;
                let mut tree = Tree::new();
                for kb in l0..l1.min(i1.div_ceil(BLOCK)) {
                    let k0 = kb * BLOCK;
                    let leaf = forward_leaf(
                        &kt[(kb - l0) * hs * NR..],
                        (k0, NR.min(k.end() - k0)),
                        (i0, i1),
                        (q.at(i0).as_ptr(), q.ld),
                        (vc[(k0 - k.first) * hs..].as_ptr(), hs),
                        starts,
                        (hs, scale),
                        s,
                        &mut pool,
                    );
                    tree.push(kb, kb + 1, leaf, &mut |a, b| {
                        merge_softmax(a, b, rows, hs, &mut pool)
                    });
                }
                let p = tree.finish(&mut |a, b| merge_softmax(a, b, rows, hs, &mut pool));
                emit(i0, i1, p, &mut pool);
            }
        },
    );
}

/// Row `r` of a forward partial: `out = Σ / l`, and the log-sum-exp
/// `m + ln l`.
fn finalize<T: Real>(p: &[T], r: usize, hs: usize, out: &mut [T]) -> T {
    let (m, l) = (p[r], p[BLOCK + r]);
    for (d, &o) in out[..hs].iter_mut().zip(&p[2 * BLOCK + r * hs..]) {
        *d = o / l;
    }
    m + l.ln()
}

/// What [`backward_group`] reads of one sequence and key/value head: the
/// group's query rows `q`, their output gradients `dout` and outputs `out`
/// (query head `hh` of the group `hh·HS` channels on from each view's
/// column), their log-sum-exps `lse(hh, i)`, the keys `k` and values `v`.
struct GroupIn<'a, T> {
    q: Rows<'a, T>,
    dout: Rows<'a, T>,
    out: Rows<'a, T>,
    lse: &'a dyn Fn(usize, usize) -> T,
    k: Rows<'a, T>,
    v: Rows<'a, T>,
    starts: &'a dyn Fn(usize) -> usize,
}

/// The backward of one sequence and key/value head: by blocks of query
/// rows (`q.first` a multiple of 64), and in each by query head and key
/// leaf, `s = q·kᵀ·scale`, `p = e^(s - lse)`, `dp = dO·vᵀ`,
/// `ds = p·(dp - Σ dO·O)·scale`; each leaf's `dQ = ds·k` merges into the
/// block's tree over the key leaves, given to `emit_dq(hh, i0, i1, dq)`
/// (rows × HS); each leaf's `dKᵀ = Σ q ds` and `dVᵀ = Σ dO p`, summed over
/// the group's heads in order, merge into the key leaf's tree over the
/// query blocks, given to `emit_dkv(k0, kw, partial)` at the end
/// (`HS`×`NR` of `dKᵀ`, then of `dVᵀ`).
#[allow(clippy::too_many_lines, clippy::type_complexity)]
fn backward_group<T: Real>(
    x: &GroupIn<'_, T>,
    (g, hs, scale): (usize, usize, T),
    emit_dq: &mut dyn FnMut(usize, usize, usize, &[T]),
    emit_dkv: &mut dyn FnMut(usize, usize, &[T]),
) {
    let GroupIn {
        q, dout, out, k, v, ..
    } = *x;
    let (l0, l1) = leaves(&k);
    let nl = l1 - l0;
    let len = 2 * nl * hs * NR + k.len * hs + 2 * BLOCK * hs + 2 * BLOCK * NR + BLOCK;
    with_pack(len, |buf: &mut [T]| {
        let (kt, rest) = buf.split_at_mut(nl * hs * NR);
        let (vt, rest) = rest.split_at_mut(nl * hs * NR);
        let (kc, rest) = rest.split_at_mut(k.len * hs);
        let (qc, rest) = rest.split_at_mut(BLOCK * hs);
        let (gc, rest) = rest.split_at_mut(BLOCK * hs);
        let (sp, rest) = rest.split_at_mut(BLOCK * NR);
        let (sd, delta) = rest.split_at_mut(BLOCK * NR);
        for kb in l0..l1 {
            let (k0, at) = (kb * BLOCK, (kb - l0) * hs * NR);
            let kw = NR.min(k.end() - k0);
            pack_block(&mut kt[at..], k.at(k0), k.ld, kw, hs);
            pack_block(&mut vt[at..], v.at(k0), v.ld, kw, hs);
        }
        for j in k.first..k.end() {
            kc[(j - k.first) * hs..(j - k.first + 1) * hs].copy_from_slice(&k.at(j)[..hs]);
        }
        let mut pool: Vec<Vec<T>> = Vec::new();
        let mut kv_trees: Vec<Tree<Vec<T>>> = (l0..l1).map(|_| Tree::new()).collect();
        for i0 in (q.first..q.end()).step_by(BLOCK) {
            let (i1, blk) = ((i0 + BLOCK).min(q.end()), i0 / BLOCK);
            let rows = i1 - i0;
            let seen = l1.min(i1.div_ceil(BLOCK)).max(l0);
            let mut kv_leaves: Vec<Option<Vec<T>>> = (l0..seen).map(|_| None).collect();
            for hh in 0..g {
                let (qh, gh, oh) = (q.shift(hh * hs), dout.shift(hh * hs), out.shift(hh * hs));
                for i in i0..i1 {
                    let r = i - i0;
                    qc[r * hs..(r + 1) * hs].copy_from_slice(&qh.at(i)[..hs]);
                    gc[r * hs..(r + 1) * hs].copy_from_slice(&gh.at(i)[..hs]);
                    delta[r] = crate::real::dot_lanes(&gh.at(i)[..hs], &oh.at(i)[..hs]);
                }
                let mut dq_tree = Tree::new();
                for kb in l0..seen {
                    let (k0, at) = (kb * BLOCK, (kb - l0) * hs * NR);
                    let kw = NR.min(k.end() - k0);
                    if (i0..i1).all(|i| {
                        let (lo, hi) = visible((x.starts)(i), i, k0, kw);
                        lo >= hi
                    }) {
                        dq_tree.push(kb, kb + 1, None, &mut |a, b| add_into(a, b, &mut pool));
                        continue;
                    }
                    // SAFETY: `qc`, `gc` hold the block's rows; `sp`, `sd`
                    // `BLOCK` rows of `NR`, ours.
                    unsafe {
                        let (sp, sd) = (sp.as_mut_ptr(), sd.as_mut_ptr());
                        dots(
                            &kt[at..],
                            k0,
                            kw,
                            hs,
                            (i0, i1),
                            (qc.as_ptr(), hs),
                            (sp, NR),
                            scale,
                        );
                        dots(
                            &vt[at..],
                            k0,
                            kw,
                            hs,
                            (i0, i1),
                            (gc.as_ptr(), hs),
                            (sd, NR),
                            T::ONE,
                        );
                    }
                    for i in i0..i1 {
                        let r = i - i0;
                        let (lo, hi) = visible((x.starts)(i), i, k0, kw);
                        let (p, d) = (&mut sp[r * NR..r * NR + kw], &mut sd[r * NR..r * NR + kw]);
                        if lo >= hi {
                            p.fill(T::ZERO);
                            d.fill(T::ZERO);
                            continue;
                        }
                        let (a, z) = (lo - k0, hi - k0);
                        let l = (x.lse)(hh, i);
                        probs_and_grads(&mut p[a..z], &mut d[a..z], l, delta[r], scale);
                        for v in [&mut *p, &mut *d] {
                            v[..a].fill(T::ZERO);
                            v[z..].fill(T::ZERO);
                        }
                    }
                    let mut dq = take(&mut pool, BLOCK * hs);
                    for r0 in (0..rows).step_by(MR) {
                        let m = MR.min(rows - r0);
                        // SAFETY: rows `r0..` of `sd` hold `kw` score
                        // gradients, `kc` the keys `k0..k0+kw`; `dq` is
                        // ours. (Keys after the tile's last row: zeros,
                        // left out.)
                        unsafe {
                            weighted(
                                m,
                                kw.min(i0 + r0 + m - k0),
                                (sd[r0 * NR..].as_ptr(), NR, 1),
                                (kc[(k0 - k.first) * hs..].as_ptr(), hs),
                                hs,
                                (dq[r0 * hs..].as_mut_ptr(), hs),
                                Fin::Store(T::ONE),
                            );
                        }
                    }
                    dq_tree.push(kb, kb + 1, Some(dq), &mut |a, b| add_into(a, b, &mut pool));
                    let slot = &mut kv_leaves[kb - l0];
                    let fin = if slot.is_some() {
                        Fin::Add
                    } else {
                        Fin::Store(T::ONE)
                    };
                    let leaf = slot.get_or_insert_with(|| take(&mut pool, 2 * hs * NR));
                    let (dkt, dvt) = leaf.split_at_mut(hs * NR);
                    for d0 in (0..hs).step_by(MR) {
                        let tiles = [
                            (qc[d0..].as_ptr(), sd.as_ptr(), &mut *dkt),
                            (gc[d0..].as_ptr(), sp.as_ptr(), &mut *dvt),
                        ];
                        for (a, bm, acc) in tiles {
                            let tile = Tile {
                                m: MR.min(hs - d0),
                                w: kw,
                                k: rows,
                                a,
                                ars: 1,
                                acs: hs,
                                b: bm,
                                ldb: NR,
                                c: acc[d0 * NR..].as_mut_ptr(),
                                ldc: NR,
                                fin,
                            };
                            // SAFETY: channels `d0..` of the block's rows of
                            // `qc` / `gc`, columns `..kw` of its rows of `sd`
                            // / `sp`, and rows `d0..` of the leaf (`HS`×`NR`,
                            // ours).
                            unsafe { run_tile(&tile) };
                        }
                    }
                }
                if let Some(dq) = dq_tree.finish(&mut |a, b| add_into(a, b, &mut pool)) {
                    emit_dq(hh, i0, i1, &dq);
                    pool.push(dq);
                }
            }
            for (j, tree) in kv_trees.iter_mut().enumerate() {
                let leaf = kv_leaves.get_mut(j).and_then(Option::take);
                tree.push(blk, blk + 1, leaf, &mut |a, b| add_into(a, b, &mut pool));
            }
        }
        for (j, tree) in kv_trees.into_iter().enumerate() {
            let k0 = (l0 + j) * BLOCK;
            if let Some(p) = tree.finish(&mut |a, b| add_into(a, b, &mut pool)) {
                emit_dkv(k0, NR.min(k.end() - k0), &p);
            }
        }
    });
}

/// Checks rows' starts `(B,T)`: none after its row.
fn check_starts(op: &'static str, docs: Option<&[u32]>, b: usize, t: usize) -> Result<()> {
    let Some(d) = docs else { return Ok(()) };
    check(op, "docs", d, b * t)?;
    if let Some(r) = (0..b * t).find(|&r| d[r] as usize > r % t) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!(
                "row {} of sequence {} starts its document at {}, after itself",
                r % t,
                r / t,
                d[r]
            ),
        });
    }
    Ok(())
}

/// One position of [`attention_forward`] from a key/value cache, for
/// incremental decoding: the output `out (C)` of the query `q (C)` at
/// position `pos` over the keys and values `kv (pos+1, 2·Ckv)` (rows
/// `[k | v]`, key/value head `k` owning channels `k*HS..(k+1)*HS` of
/// each) of positions `start..=pos`: `start` is the position's first
/// visible key (its document start under document masking, the window's
/// first key under sliding-window attention), else 0.
///
/// The result is bitwise equal to row `pos` of [`attention_forward`] over
/// any sequence with the same queries, keys and values up to `pos` (and the
/// same start): both run the same leaves through the same tree (see the
/// module docs), and the forward's zero probabilities of later keys in
/// the row's last leaf change no bit.
///
/// # Errors
/// [`Error::ShapeMismatch`] on a wrong buffer length,
/// [`Error::InvalidArgument`] if `NH` does not divide `C` or `NKV` `NH`.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode<T: Real>(
    out: &mut [T],
    q: &[T],
    kv: &[T],
    pos: usize,
    start: usize,
    c: usize,
    heads: impl Into<Heads>,
) -> Result<()> {
    const OP: &str = "attention_decode";
    let heads = heads.into();
    let (hs, ckv) = dims(OP, c, heads)?;
    let (nh, g) = (heads.q, heads.group());
    let n = pos + 1;
    if start > pos {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!("document start {start} after the position {pos}"),
        });
    }
    check(OP, "out", out, c)?;
    check(OP, "q", q, c)?;
    check(OP, "kv", kv, n * 2 * ckv)?;
    if c == 0 {
        return Ok(());
    }
    #[allow(clippy::cast_precision_loss)]
    let scale = T::from_f64(1.0 / (hs as f64).sqrt());
    for h in 0..nh {
        let kh = h / g;
        let cache = |col| Rows {
            data: kv,
            ld: 2 * ckv,
            col,
            first: 0,
            len: n,
        };
        let q = Rows {
            data: q,
            ld: c,
            col: h * hs,
            first: pos,
            len: 1,
        };
        let o = &mut out[h * hs..];
        forward_head(
            (q, cache(kh * hs), cache(ckv + kh * hs)),
            &|_| start,
            (hs, scale),
            // (the position sees itself: its partial is never empty)
            &mut |_, _, p, pool| {
                if let Some(p) = p {
                    finalize(&p, 0, hs, o);
                    pool.push(p);
                }
            },
        );
    }
    Ok(())
}

/// Backward of [`attention_forward`], accumulating into
/// `dqkv (B,T,C+2·Ckv)` from the output gradient `dout (B,T,C)`, the
/// forward's inputs `qkv` and `docs` and its results `out` and `lse`.
/// The probabilities are computed again, a leaf at a time
/// (`e^(s - lse)`), and never held whole. The query gradients are
/// merged over the key leaves, and the key and value gradients over the
/// query blocks, in the tree of the module docs; the query heads of a
/// group add into one key/value leaf in head order.
///
/// # Errors
/// As [`attention_forward`].
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Real>(
    dqkv: &mut [T],
    dout: &[T],
    qkv: &[T],
    out: &[T],
    lse: &[T],
    docs: Option<&[u32]>,
    b: usize,
    t: usize,
    c: usize,
    heads: impl Into<Heads>,
) -> Result<()> {
    const OP: &str = "attention_backward";
    let heads = heads.into();
    let (hs, ckv) = dims(OP, c, heads)?;
    let (nh, nkv, w) = (heads.q, heads.kv, c + 2 * ckv);
    check(OP, "dqkv", dqkv, b * t * w)?;
    check(OP, "dout", dout, b * t * c)?;
    check(OP, "qkv", qkv, b * t * w)?;
    check(OP, "out", out, b * t * c)?;
    check(OP, "lse", lse, b * nh * t)?;
    check_starts(OP, docs, b, t)?;
    if b * t * c == 0 {
        return Ok(());
    }
    #[allow(clippy::cast_precision_loss)]
    let scale = T::from_f64(1.0 / (hs as f64).sqrt());
    let g = heads.group();
    let dx = Shared(dqkv.as_mut_ptr());
    (0..b * nkv).into_par_iter().for_each(|bk| {
        let (bb, kh) = (bk / nkv, bk % nkv);
        let seq = |data, ld, col| Rows::whole(data, ld, col, t);
        let x = &qkv[bb * t * w..(bb + 1) * t * w];
        let lse = |hh: usize, i: usize| lse[(bb * nh + kh * g + hh) * t + i];
        let starts = |i: usize| docs.map_or(0, |d| d[bb * t + i] as usize);
        let input = GroupIn {
            q: seq(x, w, kh * g * hs),
            dout: seq(&dout[bb * t * c..(bb + 1) * t * c], c, kh * g * hs),
            out: seq(&out[bb * t * c..(bb + 1) * t * c], c, kh * g * hs),
            lse: &lse,
            k: seq(x, w, c + kh * hs),
            v: seq(x, w, c + ckv + kh * hs),
            starts: &starts,
        };
        // Item `bk` writes only sequence `bb`'s rows of the query heads of
        // key/value head `kh` and that head's key and value channels.
        backward_group(
            &input,
            (g, hs, scale),
            &mut |hh, i0, i1, dq| {
                for i in i0..i1 {
                    // SAFETY: row `i` of sequence `bb`, channels of query
                    // head `kh·g + hh`: this item's alone.
                    let dst = unsafe {
                        let at = (bb * t + i) * w + (kh * g + hh) * hs;
                        std::slice::from_raw_parts_mut(dx.get().add(at), hs)
                    };
                    add_slices(dst, &dq[(i - i0) * hs..(i - i0 + 1) * hs]);
                }
            },
            &mut |k0, kw, p| {
                let row = (bb * t + k0) * w + c + kh * hs;
                // SAFETY: rows `k0..k0+kw` of sequence `bb` of dK and dV,
                // channels of key/value head `kh`, are this item's alone.
                unsafe {
                    transpose_add(dx.get().add(row), w, &p[..hs * NR], NR, kw, hs);
                    transpose_add(dx.get().add(row + ckv), w, &p[hs * NR..], NR, kw, hs);
                }
            },
        );
    });
    Ok(())
}

/// Positions `first..first + len` of a sequence: where a context-parallel
/// rank's chunk of query rows, or of keys, sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// The first position.
    pub first: usize,
    /// How many.
    pub len: usize,
}

impl Span {
    /// One past the last position.
    pub fn end(self) -> usize {
        self.first + self.len
    }
    /// Its key leaves, `first/64..end/64`, when they are a node of the
    /// merge tree: `len` a multiple of 64, the leaves a power of two and
    /// `first` a multiple of their span (see the module docs).
    fn node(self, op: &'static str) -> Result<(usize, usize)> {
        let (lo, hi) = (self.first / BLOCK, self.end() / BLOCK);
        if !self.first.is_multiple_of(BLOCK) || !self.len.is_multiple_of(BLOCK) || !is_node(lo, hi)
        {
            return Err(Error::InvalidArgument {
                op,
                reason: format!(
                    "positions {}..{} are not a node of the merge tree (2^k blocks of {BLOCK} from a multiple of 2^k blocks)",
                    self.first,
                    self.end()
                ),
            });
        }
        Ok((lo, hi))
    }
}

/// Floats of one chunk's forward partial ([`attention_partial`]): `HS + 2`
/// per sequence, query head and query row.
pub fn attention_partial_len(b: usize, rows: usize, c: usize, heads: impl Into<Heads>) -> usize {
    let heads = heads.into();
    b * heads.q * rows * (c / heads.q.max(1) + 2)
}

/// Checks spans of parts: consecutive from position 0, each a node.
fn check_parts<P>(op: &'static str, parts: &[(P, Span)]) -> Result<Vec<(usize, usize)>> {
    let mut at = 0;
    parts
        .iter()
        .map(|&(_, s)| {
            if s.first != at {
                return Err(Error::InvalidArgument {
                    op,
                    reason: format!("a part at position {} after position {at}: parts must follow each other from 0", s.first),
                });
            }
            at = s.end();
            s.node(op)
        })
        .collect()
}

/// Context parallelism's forward over one chunk of keys: the partial
/// result `part (B, NH, Tq, HS+2)` (each row's maximum score, sum of
/// `e^(s - max)` and `Σ e^(s - max)·v`; `-∞, 0, 0…` where the row sees
/// none of the keys) of the query rows at `q_at` against the keys and
/// values at `k_at` (a node of the merge tree: a context-parallel chunk of
/// `2^k·64` positions from a multiple of it).
///
/// `q (B, Tq, ldq)` holds head `h`'s queries at channels `h·HS..`; `kv
/// (B, Tk, ldkv)` key/value head `k`'s keys at `col + k·HS..` and its values
/// `Ckv` channels further (`(qkv, C+2·Ckv)` and `(qkv, C+2·Ckv, C)` for a
/// rank's own chunk, `(kv, 2·Ckv, 0)` for keys and values received);
/// `starts (B, Tq)` each row's first visible key, by position. The
/// partials of a row's key chunks, merged by [`attention_merge`] in
/// position order, give bit for bit what [`attention_forward`] gives over
/// the whole sequence.
///
/// # Errors
/// As [`attention_forward`]; [`Error::InvalidArgument`] if `k_at` is not
/// a node or `q_at` does not start on a block of 64.
#[allow(clippy::too_many_arguments)]
pub fn attention_partial<T: Real>(
    part: &mut [T],
    (q, ldq): (&[T], usize),
    q_at: Span,
    (kv, ldkv, col): (&[T], usize, usize),
    k_at: Span,
    starts: Option<&[u32]>,
    b: usize,
    c: usize,
    heads: impl Into<Heads>,
) -> Result<()> {
    const OP: &str = "attention_partial";
    let heads = heads.into();
    let (hs, ckv) = dims(OP, c, heads)?;
    let (nh, g, tq) = (heads.q, heads.group(), q_at.len);
    k_at.node(OP)?;
    check_rows(OP, q_at)?;
    check(OP, "part", part, b * nh * tq * (hs + 2))?;
    check_operands(
        OP,
        (q, ldq, q_at),
        (kv, ldkv, col, k_at),
        starts,
        (b, c, ckv),
    )?;
    if part.is_empty() {
        return Ok(());
    }
    #[allow(clippy::cast_precision_loss)]
    let scale = T::from_f64(1.0 / (hs as f64).sqrt());
    part.par_chunks_mut(tq * (hs + 2))
        .enumerate()
        .for_each(|(bh, part)| {
            let (bb, h) = (bh / nh, bh % nh);
            let kh = h / g;
            let at = |data, ld, col, span| Rows::of_sequence(data, bb, ld, col, span);
            let qr = at(q, ldq, h * hs, q_at);
            let (k, v) = (
                at(kv, ldkv, col + kh * hs, k_at),
                at(kv, ldkv, col + ckv + kh * hs, k_at),
            );
            let starts = |i: usize| starts.map_or(0, |s| s[bb * tq + i - q_at.first] as usize);
            forward_head((qr, k, v), &starts, (hs, scale), &mut |i0, i1, p, pool| {
                for i in i0..i1 {
                    let (r, row) = (i - i0, &mut part[(i - q_at.first) * (hs + 2)..][..hs + 2]);
                    match &p {
                        Some(p) => {
                            (row[0], row[1]) = (p[r], p[BLOCK + r]);
                            row[2..].copy_from_slice(&p[2 * BLOCK + r * hs..][..hs]);
                        }
                        None => {
                            row.fill(T::ZERO);
                            row[0] = T::NEG_INFINITY;
                        }
                    }
                }
                pool.extend(p);
            });
        });
    Ok(())
}

/// Checks a chunk's queries `(B, Tq, ldq)`, keys and values
/// `(B, Tk, ldkv)` from column `col`, and its rows' starts.
#[allow(clippy::type_complexity)]
fn check_operands<T>(
    op: &'static str,
    (q, ldq, q_at): (&[T], usize, Span),
    (kv, ldkv, col, k_at): (&[T], usize, usize, Span),
    starts: Option<&[u32]>,
    (b, c, ckv): (usize, usize, usize),
) -> Result<()> {
    check(op, "q", q, b * q_at.len * ldq)?;
    check(op, "kv", kv, b * k_at.len * ldkv)?;
    if ldq < c || ldkv < col + 2 * ckv {
        return Err(Error::InvalidArgument {
            op,
            reason: format!(
                "rows of {ldq} and {ldkv} floats cannot hold {c} query and 2·{ckv} key/value channels"
            ),
        });
    }
    check_starts_at(op, starts, b, q_at)
}

/// Checks that query rows start on a block of 64.
fn check_rows(op: &'static str, q_at: Span) -> Result<()> {
    if !q_at.first.is_multiple_of(BLOCK) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!(
                "query rows from position {}, not a multiple of {BLOCK}",
                q_at.first
            ),
        });
    }
    Ok(())
}

/// Checks rows' starts `(B,Tq)` of the rows at `q_at`: none after its row.
fn check_starts_at(op: &'static str, starts: Option<&[u32]>, b: usize, q_at: Span) -> Result<()> {
    let Some(s) = starts else { return Ok(()) };
    check(op, "starts", s, b * q_at.len)?;
    if let Some(r) = (0..b * q_at.len).find(|&r| s[r] as usize > q_at.first + r % q_at.len) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!(
                "the row at position {} starts at {}, after itself",
                q_at.first + r % q_at.len,
                s[r]
            ),
        });
    }
    Ok(())
}

/// The output `out (B,Tq,C)` and log-sum-exps `lse (B,NH,Tq)` of `tq` query
/// rows from their [`attention_partial`]s over key chunks that follow each
/// other from position 0 (`None`: a chunk none of the rows sees; chunks
/// past the rows may be left out), merged in the tree order of
/// [`attention_forward`], whose rows they reproduce bit for bit.
///
/// # Errors
/// [`Error::ShapeMismatch`] on a wrong buffer length;
/// [`Error::InvalidArgument`] on parts that are not nodes following each
/// other from 0, or on heads that do not divide `C`.
pub fn attention_merge<T: Real>(
    out: &mut [T],
    lse: &mut [T],
    parts: &[(Option<&[T]>, Span)],
    (b, tq): (usize, usize),
    c: usize,
    heads: impl Into<Heads>,
) -> Result<()> {
    const OP: &str = "attention_merge";
    let heads = heads.into();
    let (hs, _) = dims(OP, c, heads)?;
    let nh = heads.q;
    check(OP, "out", out, b * tq * c)?;
    check(OP, "lse", lse, b * nh * tq)?;
    let nodes = check_parts(OP, parts)?;
    for (p, _) in parts {
        if let Some(p) = p {
            check(OP, "part", p, b * nh * tq * (hs + 2))?;
        }
    }
    let out = Shared(out.as_mut_ptr());
    lse.par_chunks_mut(tq.max(1))
        .enumerate()
        .for_each(|(bh, lse)| {
            let (bb, h) = (bh / nh, bh % nh);
            let mut pool: Vec<Vec<T>> = Vec::new();
            for r0 in (0..tq).step_by(BLOCK) {
                let rows = BLOCK.min(tq - r0);
                let mut tree = Tree::new();
                for ((p, _), &(lo, hi)) in parts.iter().zip(&nodes) {
                    let block = p.map(|p| {
                        let mut v = take(&mut pool, softmax_len(hs));
                        for r in 0..rows {
                            let row = &p[(bh * tq + r0 + r) * (hs + 2)..][..hs + 2];
                            (v[r], v[BLOCK + r]) = (row[0], row[1]);
                            v[2 * BLOCK + r * hs..][..hs].copy_from_slice(&row[2..]);
                        }
                        v
                    });
                    tree.push(lo, hi, block, &mut |a, b| {
                        merge_softmax(a, b, rows, hs, &mut pool)
                    });
                }
                let Some(p) = tree.finish(&mut |a, b| merge_softmax(a, b, rows, hs, &mut pool))
                else {
                    continue;
                };
                for r in 0..rows {
                    // SAFETY: row `r0 + r` of sequence `bb`, channels of head
                    // `h`: this item's alone.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(
                            out.get().add((bb * tq + r0 + r) * c + h * hs),
                            hs,
                        )
                    };
                    lse[r0 + r] = finalize(&p, r, hs, dst);
                }
                pool.push(p);
            }
        });
    Ok(())
}

/// Context parallelism's backward over one chunk of keys: the query
/// gradients `dq (B,Tq,C)` of the rows at `q_at` from the keys at `k_at`,
/// and the key and value gradients `dkv (B,Tk,2·Ckv)` (`[dK | dV]`) of the
/// keys at `k_at` from those rows, both overwritten; from the rows' output
/// gradients `dout (B,Tq,C)`, queries, outputs `out (B,Tq,C)` and
/// log-sum-exps `lse (B,NH,Tq)` of the forward (the arguments otherwise
/// as [`attention_partial`]). The query gradients of a row's key chunks,
/// and the key and value gradients of a key chunk's query chunks, each
/// merged by [`attention_grad_merge`] in position order, add to
/// `dqkv` what [`attention_backward`] adds.
///
/// # Errors
/// As [`attention_partial`]; [`Error::InvalidArgument`] also if `q_at`
/// is not a node.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_partial<T: Real>(
    (dq, dkv): (&mut [T], &mut [T]),
    (dout, out, lse): (&[T], &[T], &[T]),
    (q, ldq): (&[T], usize),
    q_at: Span,
    (kv, ldkv, col): (&[T], usize, usize),
    k_at: Span,
    starts: Option<&[u32]>,
    b: usize,
    c: usize,
    heads: impl Into<Heads>,
) -> Result<()> {
    const OP: &str = "attention_backward_partial";
    let heads = heads.into();
    let (hs, ckv) = dims(OP, c, heads)?;
    let (nh, nkv, g, tq, tk) = (heads.q, heads.kv, heads.group(), q_at.len, k_at.len);
    q_at.node(OP)?;
    k_at.node(OP)?;
    check(OP, "dq", dq, b * tq * c)?;
    check(OP, "dkv", dkv, b * tk * 2 * ckv)?;
    check(OP, "dout", dout, b * tq * c)?;
    check(OP, "out", out, b * tq * c)?;
    check(OP, "lse", lse, b * nh * tq)?;
    check_operands(
        OP,
        (q, ldq, q_at),
        (kv, ldkv, col, k_at),
        starts,
        (b, c, ckv),
    )?;
    dq.fill(T::ZERO);
    dkv.fill(T::ZERO);
    if b * c == 0 {
        return Ok(());
    }
    #[allow(clippy::cast_precision_loss)]
    let scale = T::from_f64(1.0 / (hs as f64).sqrt());
    let (dqs, dkvs) = (Shared(dq.as_mut_ptr()), Shared(dkv.as_mut_ptr()));
    (0..b * nkv).into_par_iter().for_each(|bk| {
        let (bb, kh) = (bk / nkv, bk % nkv);
        let at = |data, ld, col, span| Rows::of_sequence(data, bb, ld, col, span);
        let lse = |hh: usize, i: usize| lse[(bb * nh + kh * g + hh) * tq + i - q_at.first];
        let starts = |i: usize| starts.map_or(0, |s| s[bb * tq + i - q_at.first] as usize);
        let input = GroupIn {
            q: at(q, ldq, kh * g * hs, q_at),
            dout: at(dout, c, kh * g * hs, q_at),
            out: at(out, c, kh * g * hs, q_at),
            lse: &lse,
            k: at(kv, ldkv, col + kh * hs, k_at),
            v: at(kv, ldkv, col + ckv + kh * hs, k_at),
            starts: &starts,
        };
        backward_group(
            &input,
            (g, hs, scale),
            &mut |hh, i0, i1, grad| {
                for i in i0..i1 {
                    let at = (bb * tq + i - q_at.first) * c + (kh * g + hh) * hs;
                    // SAFETY: row `i` of sequence `bb`, channels of query
                    // head `kh·g + hh`: this item's alone.
                    let dst = unsafe { std::slice::from_raw_parts_mut(dqs.get().add(at), hs) };
                    dst.copy_from_slice(&grad[(i - i0) * hs..(i - i0 + 1) * hs]);
                }
            },
            &mut |k0, kw, p| {
                let row = (bb * tk + k0 - k_at.first) * 2 * ckv + kh * hs;
                // SAFETY: rows `k0..k0+kw` of sequence `bb` of dK and dV
                // (zeros until now), channels of key/value head `kh`: this
                // item's alone.
                unsafe {
                    transpose_add(dkvs.get().add(row), 2 * ckv, &p[..hs * NR], NR, kw, hs);
                    transpose_add(
                        dkvs.get().add(row + ckv),
                        2 * ckv,
                        &p[hs * NR..],
                        NR,
                        kw,
                        hs,
                    );
                }
            },
        );
    });
    Ok(())
}

/// Adds to `dst` the gradient parts of chunks that follow each other from
/// position 0 (`None`: a chunk that gave nothing), merged in the tree
/// order of [`attention_backward`]: a row's query gradients over the key
/// chunks, or a key chunk's key and value gradients over the query
/// chunks ([`attention_backward_partial`]).
///
/// # Errors
/// [`Error::ShapeMismatch`] if a part is not as long as `dst`;
/// [`Error::InvalidArgument`] on parts that are not nodes following each
/// other from 0.
pub fn attention_grad_merge<T: Real>(dst: &mut [T], parts: &[(Option<&[T]>, Span)]) -> Result<()> {
    const OP: &str = "attention_grad_merge";
    let nodes = check_parts(OP, parts)?;
    for (p, _) in parts {
        if let Some(p) = p {
            check(OP, "part", p, dst.len())?;
        }
    }
    let mut pool = Vec::new();
    let mut tree = Tree::new();
    for ((p, _), &(lo, hi)) in parts.iter().zip(&nodes) {
        tree.push(lo, hi, p.map(<[T]>::to_vec), &mut |a, b| {
            add_into(a, b, &mut pool)
        });
    }
    if let Some(total) = tree.finish(&mut |a, b| add_into(a, b, &mut pool)) {
        add_slices(dst, &total);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_grads, rand_vec};

    /// Straightforward f64 attention, written from the formula; row `i`
    /// sees keys `starts[i]..=i` (all of `0..=i` without starts); query
    /// head `h` reads key/value head `h / (nh/nkv)` (transformers'
    /// `repeat_kv`).
    fn naive_gqa(
        qkv: &[f64],
        starts: Option<&[u32]>,
        b: usize,
        t: usize,
        c: usize,
        (nh, nkv): (usize, usize),
    ) -> Vec<f64> {
        let hs = c / nh;
        let (ckv, g) = (nkv * hs, nh / nkv);
        let w = c + 2 * ckv;
        let mut out = vec![0.0; b * t * c];
        for bb in 0..b {
            for h in 0..nh {
                let kh = h / g;
                for i in 0..t {
                    let q = |d: usize| qkv[(bb * t + i) * w + h * hs + d];
                    let first = starts.map_or(0, |s| s[bb * t + i] as usize);
                    let s: Vec<f64> = (0..=i)
                        .map(|j| {
                            if j < first {
                                return f64::NEG_INFINITY;
                            }
                            (0..hs)
                                .map(|d| q(d) * qkv[(bb * t + j) * w + c + kh * hs + d])
                                .sum::<f64>()
                                / (hs as f64).sqrt()
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                    for d in 0..hs {
                        out[(bb * t + i) * c + h * hs + d] = (0..=i)
                            .map(|j| {
                                (s[j] - m).exp() / z * qkv[(bb * t + j) * w + c + ckv + kh * hs + d]
                            })
                            .sum();
                    }
                }
            }
        }
        out
    }

    fn naive(
        qkv: &[f64],
        starts: Option<&[u32]>,
        b: usize,
        t: usize,
        c: usize,
        nh: usize,
    ) -> Vec<f64> {
        naive_gqa(qkv, starts, b, t, c, (nh, nh))
    }

    /// Grouped-query and multi-query shapes: the formula, the gradients
    /// (finite differences) and decoding, with document starts.
    #[test]
    fn grouped_query_attention_matches_the_formula_and_its_gradients() {
        for (b, t, c, nh, nkv) in [(2, 9, 12, 4, 2), (1, 70, 8, 4, 1), (2, 6, 12, 6, 3)] {
            let heads = Heads { q: nh, kv: nkv };
            let w = c + 2 * c / nh * nkv;
            let (_, starts) = with_boundaries(b, t, &[&[2][..], &[4]][..b]);
            let qkv: Vec<f64> = rand_vec(b * t * w, 17).iter().map(|x| x * 2.0).collect();
            for docs in [None, Some(&starts[..])] {
                let mut out = vec![0.0; b * t * c];
                let mut att = vec![0.0; b * nh * t];
                attention_forward(&mut out, &mut att, &qkv, docs, b, t, c, heads).unwrap();
                let want = naive_gqa(&qkv, docs, b, t, c, (nh, nkv));
                let worst = out
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f64::max);
                assert!(worst < 1e-12, "NH={nh} NKV={nkv}: max diff {worst}");
            }
            if t > 10 {
                continue; // finite differences over every input: keep them small
            }
            check_grads(
                std::slice::from_ref(&qkv),
                b * t * c,
                |ins, out| {
                    let mut att = vec![0.0; b * nh * t];
                    attention_forward(out, &mut att, &ins[0], Some(&starts), b, t, c, heads)
                        .unwrap();
                },
                |ins, dout, g| {
                    let mut att = vec![0.0; b * nh * t];
                    let mut out = vec![0.0; b * t * c];
                    attention_forward(&mut out, &mut att, &ins[0], Some(&starts), b, t, c, heads)
                        .unwrap();
                    attention_backward(
                        &mut g[0],
                        dout,
                        &ins[0],
                        &out,
                        &att,
                        Some(&starts),
                        b,
                        t,
                        c,
                        heads,
                    )
                    .unwrap();
                },
            );
        }
    }

    /// Grouped-query attention is multi-head attention over keys and values
    /// repeated per group (transformers' `repeat_kv`): the same output bits,
    /// the same query gradients, and key/value gradients that are the
    /// group's sums.
    #[test]
    fn grouped_query_attention_is_multi_head_over_repeated_keys() {
        let (b, t, c, nh, nkv) = (2, 70, 32, 4, 2);
        let (hs, g) = (c / nh, nh / nkv);
        let ckv = nkv * hs;
        let w = c + 2 * ckv;
        let qkv: Vec<f32> = rand_vec(b * t * w, 5).iter().map(|&x| x as f32).collect();
        let dout: Vec<f32> = rand_vec(b * t * c, 6).iter().map(|&x| x as f32).collect();
        let mut rep = vec![0.0f32; b * t * 3 * c];
        for r in 0..b * t {
            let (src, dst) = (
                &qkv[r * w..(r + 1) * w],
                &mut rep[r * 3 * c..(r + 1) * 3 * c],
            );
            dst[..c].copy_from_slice(&src[..c]);
            for h in 0..nh {
                let kh = h / g;
                dst[c + h * hs..c + (h + 1) * hs].copy_from_slice(&src[c + kh * hs..][..hs]);
                dst[2 * c + h * hs..2 * c + (h + 1) * hs]
                    .copy_from_slice(&src[c + ckv + kh * hs..][..hs]);
            }
        }
        let run = |x: &[f32], heads: Heads, width: usize| {
            let mut out = vec![0.0f32; b * t * c];
            let mut att = vec![0.0f32; b * nh * t];
            attention_forward(&mut out, &mut att, x, None, b, t, c, heads).unwrap();
            let mut dx = vec![0.0f32; b * t * width];
            attention_backward(&mut dx, &dout, x, &out, &att, None, b, t, c, heads).unwrap();
            (out, dx)
        };
        let (o_g, d_g) = run(&qkv, Heads { q: nh, kv: nkv }, w);
        let (o_m, d_m) = run(&rep, nh.into(), 3 * c);
        assert_eq!(o_g, o_m);
        for r in 0..b * t {
            let (dg, dm) = (&d_g[r * w..(r + 1) * w], &d_m[r * 3 * c..(r + 1) * 3 * c]);
            assert_eq!(dg[..c], dm[..c], "row {r}: query gradients");
            for kh in 0..nkv {
                for d in 0..hs {
                    for (base_g, base_m) in [(c, c), (c + ckv, 2 * c)] {
                        let sum: f32 = (0..g).map(|j| dm[base_m + (kh * g + j) * hs + d]).sum();
                        let got = dg[base_g + kh * hs + d];
                        assert!(
                            (got - sum).abs() <= 1e-5 * sum.abs().max(1.0),
                            "{got} vs {sum}"
                        );
                    }
                }
            }
        }
    }

    /// Sliding-window attention is the formula over each row's last
    /// `window` keys (within its document), and decoding with the window's
    /// start gives the forward's rows bitwise.
    #[test]
    fn sliding_window_attention_matches_the_formula() {
        let (b, t, c, nh, nkv) = (2, 70, 8, 2, 1);
        let w = c + 2 * c / nh * nkv;
        let heads = Heads { q: nh, kv: nkv };
        let (_, docs) = with_boundaries(b, t, &[&[30], &[]]);
        let qkv: Vec<f64> = rand_vec(b * t * w, 23).iter().map(|x| x * 2.0).collect();
        for window in [1, 5, 64, 100] {
            let mut starts = vec![0u32; b * t];
            window_starts(&mut starts, Some(&docs), window, b, t).unwrap();
            for (r, &s) in starts.iter().enumerate() {
                let i = r % t;
                assert!(s as usize <= i && i - (s as usize) < window, "row {r}");
                assert!(s >= docs[r]);
            }
            let mut out = vec![0.0; b * t * c];
            let mut att = vec![0.0; b * nh * t];
            attention_forward(&mut out, &mut att, &qkv, Some(&starts), b, t, c, heads).unwrap();
            let want = naive_gqa(&qkv, Some(&starts), b, t, c, (nh, nkv));
            let worst = out
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(worst < 1e-12, "window {window}: max diff {worst}");
            let ckv = c / nh * nkv;
            for pos in [0, 4, 29, 31, 69] {
                let x = &qkv[..t * w];
                let kv: Vec<f64> = (0..=pos)
                    .flat_map(|j| x[j * w + c..(j + 1) * w].to_vec())
                    .collect();
                let mut o1 = vec![0.0; c];
                let start = starts[pos] as usize;
                attention_decode(&mut o1, &x[pos * w..pos * w + c], &kv, pos, start, c, heads)
                    .unwrap();
                assert_eq!(o1, out[pos * c..(pos + 1) * c], "window {window} pos {pos}");
                assert_eq!(kv.len(), (pos + 1) * 2 * ckv);
            }
        }
        assert!(window_starts(&mut [0; 4], None, 0, 1, 4).is_err());
    }

    #[test]
    fn forward_matches_naive_formula() {
        // T = 70 crosses a 64-row block boundary.
        for (b, t, c, nh) in [(2, 5, 8, 2), (1, 70, 6, 3)] {
            let qkv: Vec<f64> = rand_vec(b * t * 3 * c, 11)
                .iter()
                .map(|x| x * 2.0)
                .collect();
            let mut out = vec![0.0; b * t * c];
            let mut att = vec![0.0; b * nh * t];
            attention_forward(&mut out, &mut att, &qkv, None, b, t, c, nh).unwrap();
            let want = naive(&qkv, None, b, t, c, nh);
            let worst = out
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(worst < 1e-12, "max diff {worst}");
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        for (b, t, c, nh) in [(2, 4, 6, 2), (1, 66, 2, 1)] {
            let qkv = rand_vec(b * t * 3 * c, 12);
            check_grads(
                &[qkv],
                b * t * c,
                |ins, out| {
                    let mut att = vec![0.0; b * nh * t];
                    attention_forward(out, &mut att, &ins[0], None, b, t, c, nh).unwrap();
                },
                |ins, dout, g| {
                    let mut att = vec![0.0; b * nh * t];
                    let mut out = vec![0.0; b * t * c];
                    attention_forward(&mut out, &mut att, &ins[0], None, b, t, c, nh).unwrap();
                    attention_backward(&mut g[0], dout, &ins[0], &out, &att, None, b, t, c, nh)
                        .unwrap();
                },
            );
        }
    }

    /// The `f32` path (the AVX-512 kernel where the CPU has it) agrees with
    /// the `f64` one (the portable kernel) to `f32` rounding, forward and
    /// backward: head sizes of a full tile (64), more than one channel
    /// chunk (80) and a masked partial vector (7); rows across blocks.
    #[test]
    fn f32_agrees_with_f64() {
        for (b, t, c, nh) in [(2, 150, 128, 2), (1, 70, 160, 2), (2, 67, 21, 3)] {
            let qkv = rand_vec(b * t * 3 * c, 41);
            let dout = rand_vec(b * t * c, 42);
            let run64 = || {
                let mut out = vec![0.0; b * t * c];
                let mut att = vec![0.0; b * nh * t];
                attention_forward(&mut out, &mut att, &qkv, None, b, t, c, nh).unwrap();
                let mut g = vec![0.0; b * t * 3 * c];
                attention_backward(&mut g, &dout, &qkv, &out, &att, None, b, t, c, nh).unwrap();
                (out, g)
            };
            let run32 = || {
                let f = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<_>>();
                let (qkv, dout) = (f(&qkv), f(&dout));
                let mut out = vec![0.0f32; b * t * c];
                let mut att = vec![0.0f32; b * nh * t];
                attention_forward(&mut out, &mut att, &qkv, None, b, t, c, nh).unwrap();
                let mut g = vec![0.0f32; b * t * 3 * c];
                attention_backward(&mut g, &dout, &qkv, &out, &att, None, b, t, c, nh).unwrap();
                (out, g)
            };
            let ((o64, g64), (o32, g32)) = (run64(), run32());
            for (name, want, got) in [("out", &o64, &o32), ("dqkv", &g64, &g32)] {
                let big = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
                let worst = want
                    .iter()
                    .zip(got)
                    .map(|(a, &b)| (a - f64::from(b)).abs())
                    .fold(0.0, f64::max);
                assert!(
                    worst <= 1e-5 * big,
                    "B={b} T={t} C={c} NH={nh} {name}: {worst} vs max {big}"
                );
            }
        }
    }

    /// A sequence's output and log-sum-exps have the same bits alone and
    /// anywhere in a batch (rows across several blocks, a full head tile).
    #[test]
    fn sequence_alone_or_in_a_batch_same_bits() {
        let (b, t, c, nh) = (3, 150, 128, 2);
        let qkv: Vec<f32> = rand_vec(b * t * 3 * c, 43)
            .iter()
            .map(|&x| (x * 2.0) as f32)
            .collect();
        let mut out = vec![0.0f32; b * t * c];
        let mut att = vec![0.0f32; b * nh * t];
        attention_forward(&mut out, &mut att, &qkv, None, b, t, c, nh).unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for s in 0..b {
            let mut o1 = vec![0.0f32; t * c];
            let mut a1 = vec![0.0f32; nh * t];
            let x = &qkv[s * t * 3 * c..(s + 1) * t * 3 * c];
            attention_forward(&mut o1, &mut a1, x, None, 1, t, c, nh).unwrap();
            assert_eq!(bits(&o1), bits(&out[s * t * c..(s + 1) * t * c]), "seq {s}");
            let a = &att[s * nh * t..(s + 1) * nh * t];
            assert_eq!(bits(&a1), bits(a), "seq {s} lse");
        }
    }

    /// The packed transposed tile equals the transpose, whatever the block
    /// (the AVX-512 16×16 path and the scalar edges).
    #[test]
    fn pack_block_transposes() {
        for (kw, hs, ldk) in [(64, 64, 200), (37, 40, 45), (16, 16, 16), (5, 3, 3)] {
            let keys: Vec<f32> = (0..kw * ldk).map(|i| i as f32).collect();
            let mut t = vec![-1.0f32; hs * (kw + 3)];
            transpose(&mut t, kw + 3, &keys, ldk, kw, hs);
            for j in 0..kw {
                for d in 0..hs {
                    assert_eq!(t[d * (kw + 3) + j], keys[j * ldk + d]);
                }
            }
            let keys: Vec<f32> = (0..kw * ldk).map(|i| i as f32).collect();
            let mut kt = vec![-1.0f32; hs * NR];
            pack_block(&mut kt, &keys, ldk, kw, hs);
            for j in 0..kw {
                for d in 0..hs {
                    assert_eq!(
                        kt[d * NR + j],
                        keys[j * ldk + d],
                        "kw={kw} hs={hs} j={j} d={d}"
                    );
                }
            }
        }
    }

    /// The decode step gives bitwise the last row of the forward over the
    /// prefix, and the same row of the forward over the whole sequence, at
    /// every position across several 64-row blocks (and past 512 keys, where
    /// sums are chunked), for several head sizes.
    #[test]
    fn decode_matches_the_forwards_last_row_bitwise() {
        for (c, nh, nkv, t) in [
            (32, 4, 4, 140),
            (24, 1, 1, 70),
            (12, 3, 3, 20),
            (128, 2, 2, 131),
            (8, 2, 2, 530),
            (160, 2, 2, 70),
            (32, 4, 2, 90),
            (24, 6, 1, 20),
        ] {
            let heads = Heads { q: nh, kv: nkv };
            let ckv = c / nh * nkv;
            let w = c + 2 * ckv;
            let qkv: Vec<f32> = rand_vec(t * w, 31)
                .into_iter()
                .map(|x| (x * 3.0) as f32)
                .collect();
            let mut kv = vec![0.0f32; t * 2 * ckv];
            for i in 0..t {
                kv[i * 2 * ckv..(i + 1) * 2 * ckv].copy_from_slice(&qkv[i * w + c..(i + 1) * w]);
            }
            let mut full = vec![0.0f32; t * c];
            let mut full_att = vec![0.0f32; nh * t];
            attention_forward(&mut full, &mut full_att, &qkv, None, 1, t, c, heads).unwrap();
            let checked =
                (0..t).filter(|&p| t < 200 || p < 70 || (505..520).contains(&p) || p + 1 == t);
            for pos in checked {
                let n = pos + 1;
                let mut out = vec![0.0f32; n * c];
                let mut att = vec![0.0f32; nh * n];
                attention_forward(&mut out, &mut att, &qkv[..n * w], None, 1, n, c, heads).unwrap();
                let mut o1 = vec![0.0f32; c];
                let q = &qkv[pos * w..pos * w + c];
                attention_decode(&mut o1, q, &kv[..n * 2 * ckv], pos, 0, c, heads).unwrap();
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&o1),
                    bits(&out[pos * c..]),
                    "C={c} NH={nh} NKV={nkv} pos={pos}: out"
                );
                assert_eq!(
                    bits(&o1),
                    bits(&full[pos * c..(pos + 1) * c]),
                    "pos={pos}: full"
                );
            }
        }
    }

    /// Tokens with end-of-text (`9`) at the given rows of each sequence.
    fn with_boundaries(b: usize, t: usize, ends: &[&[usize]]) -> (Vec<u32>, Vec<u32>) {
        let mut tokens = vec![1u32; b * t];
        for (bb, e) in ends.iter().enumerate() {
            for &i in *e {
                tokens[bb * t + i] = 9;
            }
        }
        let mut starts = vec![0u32; b * t];
        doc_starts(&mut starts, &tokens, 9, b, t).unwrap();
        (tokens, starts)
    }

    #[test]
    fn doc_starts_follow_the_boundaries() {
        let (_, starts) = with_boundaries(2, 6, &[&[1, 2], &[5]]);
        assert_eq!(starts, [0, 0, 2, 3, 3, 3, 0, 0, 0, 0, 0, 0]);
        let err = doc_starts(&mut [0; 3], &[0; 4], 9, 2, 2).unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    }

    /// Document masking against the formula (forward) and finite
    /// differences (the backward, which takes no mask).
    #[test]
    fn doc_masked_attention_matches_the_formula_and_its_gradients() {
        let (b, t, c, nh) = (2, 70, 6, 3);
        let (_, starts) = with_boundaries(b, t, &[&[0, 3, 40, 64], &[68]]);
        let qkv: Vec<f64> = rand_vec(b * t * 3 * c, 13)
            .iter()
            .map(|x| x * 2.0)
            .collect();
        let mut out = vec![0.0; b * t * c];
        let mut att = vec![0.0; b * nh * t];
        attention_forward(&mut out, &mut att, &qkv, Some(&starts), b, t, c, nh).unwrap();
        let want = naive(&qkv, Some(&starts), b, t, c, nh);
        let worst = out
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(worst < 1e-12, "max diff {worst}");
        let (b, t, c, nh) = (2, 9, 4, 2);
        let (_, starts) = with_boundaries(b, t, &[&[2, 5], &[0]]);
        check_grads(
            &[rand_vec(b * t * 3 * c, 14)],
            b * t * c,
            |ins, out| {
                let mut att = vec![0.0; b * nh * t];
                attention_forward(out, &mut att, &ins[0], Some(&starts), b, t, c, nh).unwrap();
            },
            |ins, dout, g| {
                let mut att = vec![0.0; b * nh * t];
                let mut out = vec![0.0; b * t * c];
                attention_forward(&mut out, &mut att, &ins[0], Some(&starts), b, t, c, nh).unwrap();
                attention_backward(
                    &mut g[0],
                    dout,
                    &ins[0],
                    &out,
                    &att,
                    Some(&starts),
                    b,
                    t,
                    c,
                    nh,
                )
                .unwrap();
            },
        );
    }

    /// Every document of a packed sequence that starts on a leaf (a
    /// multiple of 64) gets the bits it gets alone, one that starts inside
    /// a leaf the same values to rounding (its keys fall into other
    /// leaves); the decoder reproduces each masked row from the cache.
    #[test]
    fn a_packed_document_attends_as_it_does_alone() {
        let (b, t, c, nh) = (2, 150, 128, 2);
        let ends: [&[usize]; 2] = [&[10, 63, 64, 130], &[]];
        let (_, starts) = with_boundaries(b, t, &ends);
        let qkv: Vec<f32> = rand_vec(b * t * 3 * c, 44)
            .iter()
            .map(|&x| (x * 2.0) as f32)
            .collect();
        let mut out = vec![0.0f32; b * t * c];
        let mut att = vec![0.0f32; b * nh * t];
        attention_forward(&mut out, &mut att, &qkv, Some(&starts), b, t, c, nh).unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (bb, e) in ends.iter().enumerate() {
            let cuts: Vec<usize> = std::iter::once(0)
                .chain(e.iter().map(|&i| i + 1))
                .chain(std::iter::once(t))
                .collect();
            for w in cuts.windows(2).filter(|w| w[0] < w[1]) {
                let (s, n) = (w[0], w[1] - w[0]);
                let x = &qkv[(bb * t + s) * 3 * c..(bb * t + s + n) * 3 * c];
                let (mut o1, mut a1) = (vec![0.0f32; n * c], vec![0.0f32; nh * n]);
                attention_forward(&mut o1, &mut a1, x, None, 1, n, c, nh).unwrap();
                let packed = &out[(bb * t + s) * c..(bb * t + s + n) * c];
                let lse: Vec<f32> = (0..nh)
                    .flat_map(|h| att[(bb * nh + h) * t + s..][..n].to_vec())
                    .collect();
                if s % 64 == 0 {
                    assert_eq!(bits(&o1), bits(packed), "sequence {bb}, document at {s}");
                    assert_eq!(bits(&a1), bits(&lse), "sequence {bb}, document at {s}");
                } else {
                    for (x, y) in o1.iter().chain(&a1).zip(packed.iter().chain(&lse)) {
                        assert!(
                            (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                            "{x} vs {y} (at {s})"
                        );
                    }
                }
            }
        }
        // The decoder, one masked position at a time.
        for pos in [0, 10, 11, 40, 64, 65, 100, 131, 149] {
            let x = &qkv[..t * 3 * c];
            let kv: Vec<f32> = (0..=pos)
                .flat_map(|i| x[i * 3 * c + c..(i + 1) * 3 * c].iter().copied())
                .collect();
            let mut o1 = vec![0.0f32; c];
            let q = &x[pos * 3 * c..pos * 3 * c + c];
            let start = starts[pos] as usize;
            attention_decode(&mut o1, q, &kv, pos, start, c, nh).unwrap();
            assert_eq!(
                bits(&o1),
                bits(&out[pos * c..(pos + 1) * c]),
                "decode pos {pos}"
            );
        }
    }

    #[test]
    fn a_document_start_after_its_row_is_an_error() {
        let (t, c) = (3, 2);
        let qkv = [0.0f32; 3 * 3 * 2];
        let (mut out, mut att) = ([0.0f32; 6], [0.0f32; 3]);
        let err =
            attention_forward(&mut out, &mut att, &qkv, Some(&[0, 2, 0]), 1, t, c, 1).unwrap_err();
        assert!(err.to_string().contains("row 1 of sequence 0"), "{err}");
        let err = attention_decode(&mut [0.0f32; 2], &[0.0; 2], &[0.0; 8], 1, 2, c, 1).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    }

    /// The merge tree: a node computed on its own (a chunk of `2^k` leaves
    /// from a multiple of `2^k`, as a context-parallel rank holds) and
    /// pushed whole gives the bits of its leaves pushed one by one, with
    /// an order-sensitive merge (f32 sums of mixed magnitudes) and empty
    /// leaves anywhere; trailing empty leaves change nothing.
    #[test]
    fn a_node_computed_apart_merges_into_the_same_bits() {
        let leaves: Vec<Option<f32>> = rand_vec(32, 7)
            .iter()
            .enumerate()
            .map(|(i, &x)| (i % 7 != 3).then(|| (x as f32) * 10f32.powi((i % 9) as i32 - 4)))
            .collect();
        let mut add = |a: f32, b: f32| a + b;
        let whole = |n: usize, add: &mut dyn FnMut(f32, f32) -> f32| {
            let mut tree = Tree::new();
            for (i, &x) in leaves[..n].iter().enumerate() {
                tree.push(i, i + 1, x, &mut |a, b| add(a, b));
            }
            tree.finish(&mut |a, b| add(a, b))
        };
        let all = whole(32, &mut add).unwrap();
        let naive: f32 = leaves.iter().flatten().sum();
        assert_ne!(
            all.to_bits(),
            naive.to_bits(),
            "the test's merge is order-sensitive"
        );
        for chunk in [1, 2, 4, 8, 16, 32] {
            let mut tree = Tree::new();
            for lo in (0..32).step_by(chunk) {
                let mut part = Tree::new();
                for (i, &x) in leaves.iter().enumerate().skip(lo).take(chunk) {
                    part.push(i, i + 1, x, &mut add);
                }
                tree.push(lo, lo + chunk, part.finish(&mut add), &mut add);
            }
            assert_eq!(
                tree.finish(&mut add).unwrap().to_bits(),
                all.to_bits(),
                "chunks of {chunk}"
            );
        }
        // a prefix: the leaves after it empty
        for n in [1, 5, 17, 31] {
            let mut padded = Tree::new();
            for (i, &x) in leaves.iter().enumerate() {
                padded.push(i, i + 1, if i < n { x } else { None }, &mut add);
            }
            let (a, b) = (whole(n, &mut add), padded.finish(&mut add));
            assert_eq!(a.map(f32::to_bits), b.map(f32::to_bits), "prefix {n}");
        }
        assert!(is_node(4, 8) && is_node(0, 1) && !is_node(2, 6) && !is_node(0, 3));
    }

    /// Context parallelism's ring, simulated: `cp` ranks each hold query
    /// chunks `r` and `2·cp-1-r` of every sequence (the causal load
    /// balance), meet the key chunks in ring order (their own first), keep
    /// a partial per key chunk and merge in position order; then the
    /// backward's partials, the query gradients merged over key chunks and
    /// the key and value gradients over query chunks at their owner. Every
    /// output, log-sum-exp and gradient is bitwise the one-rank kernel's:
    /// grouped-query heads, document starts, a sliding window.
    #[test]
    fn context_parallel_chunks_merge_into_the_one_rank_bits() {
        #[allow(clippy::type_complexity)]
        let cases: [(usize, usize, usize, Heads, Option<usize>, &[usize]); 4] = [
            (2, 256, 32, Heads { q: 4, kv: 2 }, None, &[]),
            (4, 512, 64, Heads { q: 4, kv: 1 }, None, &[40, 200, 301]),
            (2, 512, 32, Heads { q: 2, kv: 2 }, Some(150), &[]),
            (4, 1024, 16, Heads { q: 2, kv: 1 }, Some(100), &[700]),
        ];
        for (cp, t, c, heads, window, ends) in cases {
            let b = 2;
            let (hs, nh) = (c / heads.q, heads.q);
            let ckv = hs * heads.kv;
            let w = c + 2 * ckv;
            let qkv: Vec<f32> = rand_vec(b * t * w, 61)
                .iter()
                .map(|&x| (x * 2.0) as f32)
                .collect();
            let dout: Vec<f32> = rand_vec(b * t * c, 62).iter().map(|&x| x as f32).collect();
            let (_, docs) = with_boundaries(b, t, &[ends, &[]]);
            let mut starts = docs.clone();
            if let Some(win) = window {
                window_starts(&mut starts, Some(&docs), win, b, t).unwrap();
            }
            let mask = (window.is_some() || !ends.is_empty()).then_some(&starts[..]);
            let (mut out, mut lse) = (vec![0.0f32; b * t * c], vec![0.0f32; b * nh * t]);
            attention_forward(&mut out, &mut lse, &qkv, mask, b, t, c, heads).unwrap();
            let mut dqkv = vec![0.0f32; b * t * w];
            attention_backward(&mut dqkv, &dout, &qkv, &out, &lse, mask, b, t, c, heads).unwrap();
            // chunk `k`'s rows of a (B, T, width) buffer, and of lse
            let s = t / (2 * cp);
            let span = |k: usize| Span {
                first: k * s,
                len: s,
            };
            let rows = |x: &[f32], width: usize, k: usize| -> Vec<f32> {
                (0..b)
                    .flat_map(|bb| {
                        x[(bb * t + k * s) * width..(bb * t + (k + 1) * s) * width].to_vec()
                    })
                    .collect()
            };
            let lse_of = |x: &[f32], k: usize| -> Vec<f32> {
                (0..b * nh)
                    .flat_map(|bh| x[bh * t + k * s..bh * t + (k + 1) * s].to_vec())
                    .collect()
            };
            let starts_of = |k: usize| {
                mask.map(|m| {
                    rows(
                        m.iter().map(|&v| v as f32).collect::<Vec<_>>().as_slice(),
                        1,
                        k,
                    )
                    .iter()
                    .map(|&v| v as u32)
                    .collect::<Vec<u32>>()
                })
            };
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let n = 2 * cp;
            let x: Vec<Vec<f32>> = (0..n).map(|k| rows(&qkv, w, k)).collect();
            let (mut dq_parts, mut dkv_parts) = (vec![vec![None; n]; n], vec![vec![None; n]; n]);
            for r in 0..cp {
                for qc in [r, n - 1 - r] {
                    let st = starts_of(qc);
                    // the key chunks in ring order: this rank's, then its
                    // neighbours' going back around the ring
                    let mut parts: Vec<Option<Vec<f32>>> = vec![None; n];
                    for step in 0..cp {
                        let from = (r + cp - step) % cp;
                        for kc in [from, n - 1 - from] {
                            if kc > qc {
                                continue;
                            }
                            let mut p = vec![0.0f32; attention_partial_len(b, s, c, heads)];
                            attention_partial(
                                &mut p,
                                (&x[qc], w),
                                span(qc),
                                (&x[kc], w, c),
                                span(kc),
                                st.as_deref(),
                                b,
                                c,
                                heads,
                            )
                            .unwrap();
                            parts[kc] = Some(p);
                        }
                    }
                    let merged: Vec<(Option<&[f32]>, Span)> =
                        (0..=qc).map(|k| (parts[k].as_deref(), span(k))).collect();
                    let (mut o, mut l) = (vec![0.0f32; b * s * c], vec![0.0f32; b * nh * s]);
                    attention_merge(&mut o, &mut l, &merged, (b, s), c, heads).unwrap();
                    let what = format!("cp={cp} T={t} chunk {qc}");
                    assert_eq!(bits(&o), bits(&rows(&out, c, qc)), "{what}: out");
                    assert_eq!(bits(&l), bits(&lse_of(&lse, qc)), "{what}: lse");
                    for kc in 0..=qc {
                        let (mut dq, mut dkv) =
                            (vec![0.0f32; b * s * c], vec![0.0f32; b * s * 2 * ckv]);
                        attention_backward_partial(
                            (&mut dq, &mut dkv),
                            (&rows(&dout, c, qc), &o, &l),
                            (&x[qc], w),
                            span(qc),
                            (&x[kc], w, c),
                            span(kc),
                            st.as_deref(),
                            b,
                            c,
                            heads,
                        )
                        .unwrap();
                        dq_parts[qc][kc] = Some(dq);
                        dkv_parts[kc][qc] = Some(dkv);
                    }
                }
            }
            for k in 0..n {
                let what = format!("cp={cp} T={t} chunk {k}");
                let mut dq = vec![0.0f32; b * s * c];
                let parts: Vec<(Option<&[f32]>, Span)> = (0..=k)
                    .map(|j| (dq_parts[k][j].as_deref(), span(j)))
                    .collect();
                attention_grad_merge(&mut dq, &parts).unwrap();
                let mut dkv = vec![0.0f32; b * s * 2 * ckv];
                let parts: Vec<(Option<&[f32]>, Span)> = (0..n)
                    .map(|j| (dkv_parts[k][j].as_deref(), span(j)))
                    .collect();
                attention_grad_merge(&mut dkv, &parts).unwrap();
                let want = rows(&dqkv, w, k);
                for row in 0..b * s {
                    assert_eq!(
                        bits(&dq[row * c..(row + 1) * c]),
                        bits(&want[row * w..row * w + c]),
                        "{what} row {row}: dq"
                    );
                    assert_eq!(
                        bits(&dkv[row * 2 * ckv..(row + 1) * 2 * ckv]),
                        bits(&want[row * w + c..(row + 1) * w]),
                        "{what} row {row}: dk, dv"
                    );
                }
            }
        }
        // a chunk that is not a node of the tree is refused
        let err = attention_partial(
            &mut [0.0f32; 0],
            (&[], 8),
            Span { first: 0, len: 0 },
            (&[], 24, 8),
            Span {
                first: 64,
                len: 192,
            },
            None,
            0,
            8,
            1,
        )
        .unwrap_err();
        assert!(err.to_string().contains("not a node"), "{err}");
    }

    #[test]
    fn heads_must_divide_channels() {
        let err = attention_forward(
            &mut [0.0f32; 5],
            &mut [0.0; 1],
            &[0.0; 15],
            None,
            1,
            1,
            5,
            2,
        )
        .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        let heads = Heads { q: 4, kv: 3 };
        let err = attention_forward(
            &mut [0.0f32; 8],
            &mut [0.0; 4],
            &[0.0; 20],
            None,
            1,
            1,
            8,
            heads,
        )
        .unwrap_err();
        assert!(err.to_string().contains("NKV=3"), "{err}");
    }
}
