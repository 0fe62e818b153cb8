//! Causal multi-head, grouped-query and multi-query self-attention.
//!
//! Shapes (llm.c's legend): `qkv (B,T,C+2·Ckv)` holds the query, key and
//! value projections side by side (`[q | k | v]`, as GPT-2's `c_attn`
//! produces them), query head `h` owning channels `h*HS..(h+1)*HS` of `q`,
//! `HS = C/NH`. With [`Heads`] `{ q: NH, kv: NKV }` the keys and values
//! have `NKV` heads of `HS` channels (`Ckv = NKV·HS`), and query head `h`
//! reads key/value head `h / (NH/NKV)` (grouped-query attention,
//! transformers' `repeat_kv`); multi-head attention is `NKV = NH`
//! (`Ckv = C`, the `(B,T,3C)` of GPT-2). The forward saves the attention
//! probabilities `att (B,NH,T,T)` (zero above the diagonal) for the
//! backward.
//!
//! # How it runs
//!
//! Every product (`QKᵀ`, `PV`; `dO·Vᵀ`, `dS·K`, `Qᵀ·dS`, `dOᵀ·P`) is a
//! sequence of register tiles — up to 6 rows by 64 columns, 24 AVX-512
//! accumulators — over the causal part only: a block of 64 query rows
//! meets only the keys at or before its last row. Forward and backward run
//! per (sequence, head) in parallel, block of query rows after block, each
//! block's rows of the `(T,T)` matrices in cache from one product to the
//! next: `QKᵀ`, the softmax and `PV` in the forward; `dO·Vᵀ`, the score
//! gradients `dS`, `dQ += dS·K` and the block's share of `dKᵀ += Qᵀ·dS`
//! and `dVᵀ += dOᵀ·P` in the backward. The last two go to per-head
//! accumulators, added to `dK`, `dV` at the end, because they read rows of
//! `dS` and `P` (contiguous along the keys; a column of a `(T,T)` matrix
//! would walk a single cache set). The operand a tile reads as vectors
//! must be contiguous along the tile's columns, so the keys (values for
//! `dO·Vᵀ`) are transposed once per head with 16×16 in-register
//! transposes. The transposed keys and the two accumulators live in a
//! per-thread buffer that grows once to the longest sequence (`3·HS·T`
//! elements); nothing else is allocated, and no GEMM library is involved.
//!
//! # Summation order
//!
//! Each element of each product is one running sum over its reduction index
//! in increasing order (`acc = a·b + acc`, fused on AVX-512 for `f32`,
//! separate multiply and add otherwise), started from zero, then scaled
//! (scores by `1/sqrt(HS)`) or added to the gradient buffer. Nothing else
//! enters it: not the batch, the head count, the tile it sits in or the
//! thread that runs it; zero probabilities above the diagonal leave the
//! sums they enter unchanged. So one sequence gives the same bits alone or
//! anywhere in a batch, and [`attention_decode`], which runs the very same
//! tile code on one query row, reproduces the forward's row bit for bit.
//! (The AVX-512 kernel and the portable one differ in the last bits, as any
//! two machines with and without FMA would; the choice is made once per
//! process by [`weft_numerics::simd::level`], so a trainer and a decoder in
//! the same process always agree.)

use rayon::prelude::*;

use crate::Real;
use crate::error::{Error, Result, check};
use crate::softmax::softmax_in_place;

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

    /// Replaces `x` by its softmax: the maximum, `e^(x - max)` (the
    /// polynomial of [`crate::real::exp_f32`], with fused multiply-adds),
    /// their sum over 16 lanes and a reciprocal; the last partial vector
    /// masked.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::cast_possible_truncation, clippy::excessive_precision)]
    pub(super) fn softmax(x: &mut [f32]) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let lanes = |i: usize| -> __mmask16 {
            if i + 16 <= n {
                0xffff
            } else {
                (1u16 << (n - i)) - 1
            }
        };
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        for i in (0..n).step_by(16) {
            let k = lanes(i);
            // SAFETY: the unmasked lanes are `x[i..]`, in bounds.
            let v = unsafe { _mm512_maskz_loadu_ps(k, p.add(i)) };
            m = _mm512_mask_max_ps(m, k, m, v);
        }
        let m = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        let mut s = _mm512_setzero_ps();
        for i in (0..n).step_by(16) {
            let k = lanes(i);
            // SAFETY: as above.
            let v = unsafe { _mm512_maskz_loadu_ps(k, p.add(i)) };
            let e = exp(_mm512_sub_ps(v, m));
            s = _mm512_mask_add_ps(s, k, s, e);
            // SAFETY: as above; `x` is ours.
            unsafe { _mm512_mask_storeu_ps(p.add(i), k, e) };
        }
        let inv = _mm512_set1_ps(1.0 / _mm512_reduce_add_ps(s));
        for i in (0..n).step_by(16) {
            let k = lanes(i);
            // SAFETY: as above.
            unsafe {
                let v = _mm512_maskz_loadu_ps(k, p.add(i));
                _mm512_mask_storeu_ps(p.add(i), k, _mm512_mul_ps(v, inv));
            }
        }
    }

    /// [`super::score_grad_row`] for `f32` (`d` and `p` of one length).
    #[target_feature(enable = "avx512f")]
    pub(super) fn score_grad_row(d: &mut [f32], p: &[f32], scale: f32) {
        let n = d.len().min(p.len());
        let (dp, pp) = (d.as_mut_ptr(), p.as_ptr());
        let lanes = |i: usize| -> __mmask16 {
            if i + 16 <= n {
                0xffff
            } else {
                (1u16 << (n - i)) - 1
            }
        };
        let mut acc = _mm512_setzero_ps();
        for i in (0..n).step_by(16) {
            let k = lanes(i);
            // SAFETY: the unmasked lanes are `d[i..]`, `p[i..]`, in bounds.
            let (x, y) = unsafe {
                (
                    _mm512_maskz_loadu_ps(k, dp.add(i)),
                    _mm512_maskz_loadu_ps(k, pp.add(i)),
                )
            };
            acc = _mm512_fmadd_ps(x, y, acc);
        }
        let dot = _mm512_set1_ps(_mm512_reduce_add_ps(acc));
        let scale = _mm512_set1_ps(scale);
        for i in (0..n).step_by(16) {
            let k = lanes(i);
            // SAFETY: as above; `d` is ours.
            unsafe {
                let (x, y) = (
                    _mm512_maskz_loadu_ps(k, dp.add(i)),
                    _mm512_maskz_loadu_ps(k, pp.add(i)),
                );
                let g = _mm512_mul_ps(_mm512_mul_ps(y, _mm512_sub_ps(x, dot)), scale);
                _mm512_mask_storeu_ps(dp.add(i), k, g);
            }
        }
    }

    /// `e^x` per lane (see [`softmax`]).
    #[target_feature(enable = "avx512f")]
    #[inline]
    #[allow(clippy::excessive_precision)]
    fn exp(x: __m512) -> __m512 {
        let c = _mm512_set1_ps;
        let x = _mm512_min_ps(_mm512_max_ps(x, c(-87.0)), c(88.0));
        let magic = c(12_582_912.0);
        let z = _mm512_fmadd_ps(x, c(std::f32::consts::LOG2_E), magic);
        let n = _mm512_sub_ps(z, magic);
        let ni = _mm512_sub_epi32(_mm512_castps_si512(z), _mm512_castps_si512(magic));
        let r = _mm512_fnmadd_ps(n, c(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, c(-2.121_944_4e-4), r);
        let mut q = c(1.987_569_1e-4);
        q = _mm512_fmadd_ps(q, r, c(1.398_199_9e-3));
        q = _mm512_fmadd_ps(q, r, c(8.333_452e-3));
        q = _mm512_fmadd_ps(q, r, c(4.166_579_6e-2));
        q = _mm512_fmadd_ps(q, r, c(1.666_666_5e-1));
        q = _mm512_fmadd_ps(q, r, c(5.000_000_1e-1));
        let y = _mm512_add_ps(_mm512_fmadd_ps(q, _mm512_mul_ps(r, r), r), c(1.0));
        let scale = _mm512_slli_epi32::<23>(_mm512_add_epi32(ni, _mm512_set1_epi32(127)));
        _mm512_mul_ps(y, _mm512_castsi512_ps(scale))
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

/// Replaces a row of scores by its softmax.
fn softmax_row<T: Real>(x: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    if fast::<T>() {
        // SAFETY: `T` is `f32`.
        let x = unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<f32>(), x.len()) };
        // SAFETY: the CPU has AVX-512 F (`fast`).
        unsafe { avx512::softmax(x) };
        return;
    }
    softmax_in_place(x);
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

/// Forward: `out (B,T,C)`, `att (B,NH,T,T)` from `qkv (B,T,C+2·Ckv)`
/// (see the module docs for the heads), with scores scaled by
/// `1/sqrt(HS)` and a causal mask.
///
/// `docs`, when given, is each row's document start `(B,T)`
/// ([`doc_starts`]): row `i` then attends only to keys
/// `docs[i]..=i` (document masking; its probabilities before the start are
/// zero). A document's rows then have the same bits as the same document
/// alone at the start of a sequence (the masked keys add exact zeros to
/// sums that start from zero), and [`attention_backward`] needs no mask:
/// zero probabilities give zero score gradients. The cost is that of the
/// plain causal forward (the masked scores are computed, then dropped).
///
/// # Errors
/// [`Error::ShapeMismatch`] on a wrong buffer length,
/// [`Error::InvalidArgument`] if `NH` does not divide `C`, `NKV` does
/// not divide `NH`, or a row's start lies after the row.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward<T: Real>(
    out: &mut [T],
    att: &mut [T],
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
    check(OP, "att", att, b * nh * t * t)?;
    check(OP, "qkv", qkv, b * t * w)?;
    if let Some(d) = docs {
        check(OP, "docs", d, b * t)?;
        if let Some(r) = (0..b * t).find(|&r| d[r] as usize > r % t) {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "row {} of sequence {} starts its document at {}, after itself",
                    r % t,
                    r / t,
                    d[r]
                ),
            });
        }
    }
    if b * t * c == 0 {
        return Ok(());
    }
    #[allow(clippy::cast_precision_loss)]
    let scale = T::from_f64(1.0 / (hs as f64).sqrt());
    let nblocks = t.div_ceil(BLOCK);
    let out = Shared(out.as_mut_ptr());
    att.par_chunks_mut(t * t).enumerate().for_each(|(bh, p)| {
        let (bb, h) = (bh / nh, bh % nh);
        let kh = h / g;
        let x = &qkv[bb * t * w..(bb + 1) * t * w];
        let pp = p.as_mut_ptr();
        with_pack(2 * nblocks * hs * NR, |buf: &mut [T]| {
            let (kt, vc) = buf.split_at_mut(nblocks * hs * NR);
            for blk in 0..nblocks {
                let (i0, i1) = (blk * BLOCK, (blk * BLOCK + BLOCK).min(t));
                let keys = &x[i0 * w + c + kh * hs..];
                pack_block(&mut kt[blk * hs * NR..], keys, w, i1 - i0, hs);
                for j in i0..i1 {
                    let v0 = j * w + c + ckv + kh * hs;
                    let src = &x[v0..v0 + hs];
                    vc[j * hs..(j + 1) * hs].copy_from_slice(src);
                }
                for kb in 0..=blk {
                    let k0 = kb * NR;
                    let ia = i0.max(k0);
                    // SAFETY: rows `ia..i1` of the queries and of `p` are
                    // in bounds; `p` is ours.
                    unsafe {
                        dots(
                            &kt[kb * hs * NR..],
                            k0,
                            NR.min(i1 - k0),
                            hs,
                            (ia, i1),
                            (x[ia * w + h * hs..].as_ptr(), w),
                            (pp.wrapping_add(ia * t + k0), t),
                            scale,
                        );
                    }
                }
                for i in i0..i1 {
                    // SAFETY: row `i` of `p`, ours (no tile is running).
                    let row = unsafe { std::slice::from_raw_parts_mut(pp.add(i * t), t) };
                    let s = docs.map_or(0, |d| d[bb * t + i] as usize);
                    softmax_row(&mut row[s..=i]);
                    row[..s].fill(T::ZERO);
                    row[i + 1..].fill(T::ZERO);
                }
                let v = vc.as_ptr();
                for r0 in (i0..i1).step_by(MR) {
                    let m = MR.min(i1 - r0);
                    // SAFETY: rows `r0..r0+m` of `p` hold `r0+m ≤ T`
                    // terms; the values' rows `0..r0+m` are in `x`;
                    // `out`'s rows `r0..r0+m` of sequence `bb`, channels of
                    // head `h`, are this item's alone.
                    unsafe {
                        weighted(
                            m,
                            r0 + m,
                            (pp.wrapping_add(r0 * t), t, 1),
                            (v, hs),
                            hs,
                            (out.get().add((bb * t + r0) * c + h * hs), c),
                            Fin::Store(T::ONE),
                        );
                    }
                }
            }
        });
    });
    Ok(())
}

/// One position of [`attention_forward`] from a key/value cache, for
/// incremental decoding: the output `out (C)` and probabilities
/// `att (NH, pos+1)` of the query `q (C)` at position `pos` over the keys
/// and values `kv (pos+1, 2·Ckv)` (rows `[k | v]`, key/value head `k`
/// owning channels `k*HS..(k+1)*HS` of each) of positions `start..=pos`:
/// `start` is the position's first visible key (its document start under
/// document masking, the window's first key under sliding-window
/// attention), else 0.
///
/// The result is bitwise equal to row `pos` of [`attention_forward`] over
/// any sequence with the same queries, keys and values up to `pos` (and the
/// same start): both
/// run the same tile code (see the module docs on summation order), each
/// score one running sum over the channels, each output element one over
/// the keys in position order; the forward's zero probabilities of later
/// keys change no bit.
///
/// # Errors
/// [`Error::ShapeMismatch`] on a wrong buffer length,
/// [`Error::InvalidArgument`] if `NH` does not divide `C` or `NKV` `NH`.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode<T: Real>(
    out: &mut [T],
    att: &mut [T],
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
    check(OP, "att", att, nh * n)?;
    check(OP, "q", q, c)?;
    check(OP, "kv", kv, n * 2 * ckv)?;
    if c == 0 {
        return Ok(());
    }
    #[allow(clippy::cast_precision_loss)]
    let scale = T::from_f64(1.0 / (hs as f64).sqrt());
    let nblocks = n.div_ceil(NR);
    with_pack(nblocks * hs * NR, |kt: &mut [T]| {
        for h in 0..nh {
            let row = &mut att[h * n..(h + 1) * n];
            for kb in 0..nblocks {
                let k0 = kb * NR;
                let kw = NR.min(n - k0);
                let tile = &mut kt[kb * hs * NR..];
                pack_block(tile, &kv[k0 * 2 * ckv + h / g * hs..], 2 * ckv, kw, hs);
                // SAFETY: one query row of `hs` channels; `row` holds the
                // keys `k0..k0+kw`.
                unsafe {
                    dots(
                        tile,
                        k0,
                        kw,
                        hs,
                        (pos, n),
                        (q[h * hs..].as_ptr(), c),
                        (row[k0..].as_mut_ptr(), n),
                        scale,
                    );
                }
            }
            softmax_row(&mut row[start..]);
            row[..start].fill(T::ZERO);
            // SAFETY: `row` holds `n` terms, `kv` `n` value rows; `out`'s
            // channels of head `h` are in bounds.
            unsafe {
                weighted(
                    1,
                    n,
                    (row.as_ptr(), n, 1),
                    (kv[ckv + h / g * hs..].as_ptr(), 2 * ckv),
                    hs,
                    (out[h * hs..].as_mut_ptr(), c),
                    Fin::Store(T::ONE),
                );
            }
        }
    });
    Ok(())
}

/// Floats of [`attention_backward`]'s `scratch` for `b` sequences of `t`
/// tokens: one block of query rows' score gradients (`min(64, T)` rows of
/// `T`) per work item (sequence, key/value head) — not the `B·NH·T²` of
/// every score gradient, which the backward never holds at once.
pub fn attention_backward_scratch_len(b: usize, t: usize, heads: impl Into<Heads>) -> usize {
    b * heads.into().kv * BLOCK.min(t) * t
}

/// Backward of [`attention_forward`], accumulating into
/// `dqkv (B,T,C+2·Ckv)`. `scratch` (at least
/// [`attention_backward_scratch_len`] floats) is overwritten with
/// unspecified values: each work item, (sequence, key/value head), takes
/// the score gradients of one block of query rows at a time in its part
/// of it. The query heads of a group add their key and value gradients
/// into one accumulator, in head order, before it is added to `dqkv`.
///
/// # Errors
/// As [`attention_forward`].
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Real>(
    dqkv: &mut [T],
    scratch: &mut [T],
    dout: &[T],
    qkv: &[T],
    att: &[T],
    b: usize,
    t: usize,
    c: usize,
    heads: impl Into<Heads>,
) -> Result<()> {
    const OP: &str = "attention_backward";
    let heads = heads.into();
    let (hs, ckv) = dims(OP, c, heads)?;
    let (nh, nkv, g, w) = (heads.q, heads.kv, heads.group(), c + 2 * ckv);
    check(OP, "dqkv", dqkv, b * t * w)?;
    // (a longer scratch, such as the `B·NH·T²` of earlier versions, is
    // used in part)
    let rows = BLOCK.min(t);
    let need = b * nkv * rows * t;
    if scratch.len() < need {
        return Err(Error::ShapeMismatch {
            op: OP,
            buffer: "scratch",
            expected: need,
            got: scratch.len(),
        });
    }
    check(OP, "dout", dout, b * t * c)?;
    check(OP, "qkv", qkv, b * t * w)?;
    check(OP, "att", att, b * nh * t * t)?;
    if b * t * c == 0 {
        return Ok(());
    }
    #[allow(clippy::cast_precision_loss)]
    let scale = T::from_f64(1.0 / (hs as f64).sqrt());
    let nblocks = t.div_ceil(BLOCK);
    let dx = Shared(dqkv.as_mut_ptr());
    // Per (sequence, query head), by blocks of query rows i: dP = dO·Vᵀ, then
    // dS = P ⊙ (dP - rowsum(dP ⊙ P)) · scale, then dQ[i] += Σ_j dS[i,j] K[j]
    // and, while the block's rows of dS and P are in cache,
    // dKᵀ[:, j] += Σ_i Q[i] dS[i, j] and dVᵀ[:, j] += Σ_i dO[i] P[i, j] into
    // accumulators of the key/value head (rows of dS and P are contiguous
    // in j; their columns would walk a single cache set), added to dK, dV
    // after the group's last query head.
    let tp = nblocks * NR;
    scratch[..need]
        .par_chunks_mut(rows * t)
        .enumerate()
        .for_each(|(bk, d)| {
            let (bb, kh) = (bk / nkv, bk % nkv);
            let x = &qkv[bb * t * w..(bb + 1) * t * w];
            let go = &dout[bb * t * c..(bb + 1) * t * c];
            with_pack(4 * hs * tp + 2 * BLOCK * hs, |buf: &mut [T]| {
                let (vt, rest) = buf.split_at_mut(hs * tp);
                let (dkt, rest) = rest.split_at_mut(hs * tp);
                let (dvt, rest) = rest.split_at_mut(hs * tp);
                let (kc, rest) = rest.split_at_mut(hs * tp);
                let (qc, gc) = rest.split_at_mut(BLOCK * hs);
                dkt.fill(T::ZERO);
                dvt.fill(T::ZERO);
                // `d` holds the score gradients of the block of query rows
                // being computed (row `i` of the block at `(i - i0)·T`)
                for hh in 0..g {
                    let h = kh * g + hh;
                    let bh = bb * nh + h;
                    let p = &att[bh * t * t..(bh + 1) * t * t];
                    let dp = d.as_mut_ptr();
                    for blk in 0..nblocks {
                        let (i0, i1) = (blk * BLOCK, (blk * BLOCK + BLOCK).min(t));
                        let values = &x[i0 * w + c + ckv + kh * hs..];
                        pack_block(&mut vt[blk * hs * NR..], values, w, i1 - i0, hs);
                        // This block's rows of K (all of them so far, for dQ),
                        // Q and dO, head `h`, contiguous.
                        for i in i0..i1 {
                            let (r, rk) = (i * w + h * hs, i * w + c + kh * hs);
                            kc[i * hs..(i + 1) * hs].copy_from_slice(&x[rk..rk + hs]);
                            qc[(i - i0) * hs..(i - i0 + 1) * hs].copy_from_slice(&x[r..r + hs]);
                            let g = &go[i * c + h * hs..i * c + h * hs + hs];
                            gc[(i - i0) * hs..(i - i0 + 1) * hs].copy_from_slice(g);
                        }
                        for kb in 0..=blk {
                            let k0 = kb * NR;
                            let ia = i0.max(k0);
                            // SAFETY: rows `ia..i1` of `dout` and the block's
                            // rows of `d` are in bounds; `d` is ours.
                            unsafe {
                                dots(
                                    &vt[kb * hs * NR..],
                                    k0,
                                    NR.min(i1 - k0),
                                    hs,
                                    (ia, i1),
                                    (go[ia * c + h * hs..].as_ptr(), c),
                                    (dp.wrapping_add((ia - i0) * t + k0), t),
                                    T::ONE,
                                );
                            }
                        }
                        for i in i0..i1 {
                            // SAFETY: row `i` of `d`, ours (no tile is running).
                            let dr =
                                unsafe { std::slice::from_raw_parts_mut(dp.add((i - i0) * t), t) };
                            score_grad_row(&mut dr[..=i], &p[i * t..=i * t + i], scale);
                            // The tiles of this block read up to column `i1`.
                            dr[i + 1..i1].fill(T::ZERO);
                        }
                        let k = kc.as_ptr();
                        for r0 in (i0..i1).step_by(MR) {
                            let m = MR.min(i1 - r0);
                            // SAFETY: rows `r0..r0+m` of `d` hold `r0+m ≤ T`
                            // terms, the keys' rows `0..r0+m` are in `x`; dQ's rows
                            // `r0..r0+m` of sequence `bb`, channels of head `h`,
                            // are this item's alone.
                            unsafe {
                                weighted(
                                    m,
                                    r0 + m,
                                    (dp.wrapping_add((r0 - i0) * t), t, 1),
                                    (k, hs),
                                    hs,
                                    (dx.get().add((bb * t + r0) * w + h * hs), w),
                                    Fin::Add,
                                );
                            }
                        }
                        for kb in 0..=blk {
                            let k0 = kb * NR;
                            let kw = NR.min(i1 - k0);
                            for d0 in (0..hs).step_by(MR) {
                                let m = MR.min(hs - d0);
                                // the block's rows: of `d` from its start, of
                                // `p` from row `i0`
                                let tiles = [
                                    (qc[d0..].as_ptr(), hs, dp.cast_const(), &mut *dkt),
                                    (gc[d0..].as_ptr(), hs, p[i0 * t..].as_ptr(), &mut *dvt),
                                ];
                                for (a, acs, b, out) in tiles {
                                    let tile = Tile {
                                        m,
                                        w: kw,
                                        k: i1 - i0,
                                        a,
                                        ars: 1,
                                        acs,
                                        b: b.wrapping_add(k0),
                                        ldb: t,
                                        c: out[d0 * tp + k0..].as_mut_ptr(),
                                        ldc: tp,
                                        fin: Fin::Add,
                                    };
                                    // SAFETY: channels `d0..d0+m` of the block's
                                    // rows of the queries / output gradients,
                                    // columns `k0..k0+kw` of those rows of `d` /
                                    // `p`, and rows `d0..d0+m`, columns
                                    // `k0..k0+kw` of the accumulator (`hs`×`tp`,
                                    // ours) are in bounds.
                                    unsafe { run_tile(&tile) };
                                }
                            }
                        }
                    }
                }
                let row = bb * t * w + c + kh * hs;
                // SAFETY: rows `0..T` of sequence `bb` of dK and dV,
                // channels of key/value head `kh`, are this item's alone.
                unsafe {
                    transpose_add(dx.get().add(row), w, dkt, tp, t, hs);
                    transpose_add(dx.get().add(row + ckv), w, dvt, tp, t, hs);
                }
            });
        });
    Ok(())
}

/// `d = p ⊙ (d - Σ d ⊙ p) · scale`: a row of score gradients from the
/// probability gradients `d` and the probabilities `p`.
fn score_grad_row<T: Real>(d: &mut [T], p: &[T], scale: T) {
    #[cfg(target_arch = "x86_64")]
    if fast::<T>() && d.len() == p.len() {
        // SAFETY: `T` is `f32`.
        let (d, p, scale) = unsafe {
            (
                std::slice::from_raw_parts_mut(d.as_mut_ptr().cast::<f32>(), d.len()),
                std::slice::from_raw_parts(p.as_ptr().cast::<f32>(), p.len()),
                *std::ptr::from_ref(&scale).cast::<f32>(),
            )
        };
        // SAFETY: the CPU has AVX-512 F (`fast`).
        unsafe { avx512::score_grad_row(d, p, scale) };
        return;
    }
    ds_row(d, p, scale);
}

crate::simd::multiversion! {
    fn ds_row<T: Real>(d: &mut [T], p: &[T], scale: T) {
        let dot = crate::real::dot_lanes(d, p);
        for (d, &p) in d.iter_mut().zip(p) {
            *d = p * (*d - dot) * scale;
        }
    }
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
                let mut att = vec![0.0; b * nh * t * t];
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
                    let mut att = vec![0.0; b * nh * t * t];
                    attention_forward(out, &mut att, &ins[0], Some(&starts), b, t, c, heads)
                        .unwrap();
                },
                |ins, dout, g| {
                    let mut att = vec![0.0; b * nh * t * t];
                    let mut out = vec![0.0; b * t * c];
                    attention_forward(&mut out, &mut att, &ins[0], Some(&starts), b, t, c, heads)
                        .unwrap();
                    let mut scratch = vec![0.0; b * nh * t * t];
                    attention_backward(
                        &mut g[0],
                        &mut scratch,
                        dout,
                        &ins[0],
                        &att,
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
            let mut att = vec![0.0f32; b * nh * t * t];
            attention_forward(&mut out, &mut att, x, None, b, t, c, heads).unwrap();
            let mut dx = vec![0.0f32; b * t * width];
            let mut s = vec![0.0f32; b * nh * t * t];
            attention_backward(&mut dx, &mut s, &dout, x, &att, b, t, c, heads).unwrap();
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
            let mut att = vec![0.0; b * nh * t * t];
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
                let mut a1 = vec![0.0; nh * (pos + 1)];
                let start = starts[pos] as usize;
                attention_decode(
                    &mut o1,
                    &mut a1,
                    &x[pos * w..pos * w + c],
                    &kv,
                    pos,
                    start,
                    c,
                    heads,
                )
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
            let mut att = vec![0.0; b * nh * t * t];
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
                    let mut att = vec![0.0; b * nh * t * t];
                    attention_forward(out, &mut att, &ins[0], None, b, t, c, nh).unwrap();
                },
                |ins, dout, g| {
                    let mut att = vec![0.0; b * nh * t * t];
                    let mut out = vec![0.0; b * t * c];
                    attention_forward(&mut out, &mut att, &ins[0], None, b, t, c, nh).unwrap();
                    let mut scratch = vec![0.0; b * nh * t * t];
                    attention_backward(&mut g[0], &mut scratch, dout, &ins[0], &att, b, t, c, nh)
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
                let mut att = vec![0.0; b * nh * t * t];
                attention_forward(&mut out, &mut att, &qkv, None, b, t, c, nh).unwrap();
                let mut g = vec![0.0; b * t * 3 * c];
                let mut s = vec![0.0; b * nh * t * t];
                attention_backward(&mut g, &mut s, &dout, &qkv, &att, b, t, c, nh).unwrap();
                (out, g)
            };
            let run32 = || {
                let f = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<_>>();
                let (qkv, dout) = (f(&qkv), f(&dout));
                let mut out = vec![0.0f32; b * t * c];
                let mut att = vec![0.0f32; b * nh * t * t];
                attention_forward(&mut out, &mut att, &qkv, None, b, t, c, nh).unwrap();
                let mut g = vec![0.0f32; b * t * 3 * c];
                let mut s = vec![0.0f32; b * nh * t * t];
                attention_backward(&mut g, &mut s, &dout, &qkv, &att, b, t, c, nh).unwrap();
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

    /// A sequence's output and probabilities have the same bits alone and
    /// anywhere in a batch (rows across several blocks, a full head tile).
    #[test]
    fn sequence_alone_or_in_a_batch_same_bits() {
        let (b, t, c, nh) = (3, 150, 128, 2);
        let qkv: Vec<f32> = rand_vec(b * t * 3 * c, 43)
            .iter()
            .map(|&x| (x * 2.0) as f32)
            .collect();
        let mut out = vec![0.0f32; b * t * c];
        let mut att = vec![0.0f32; b * nh * t * t];
        attention_forward(&mut out, &mut att, &qkv, None, b, t, c, nh).unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for s in 0..b {
            let mut o1 = vec![0.0f32; t * c];
            let mut a1 = vec![0.0f32; nh * t * t];
            let x = &qkv[s * t * 3 * c..(s + 1) * t * 3 * c];
            attention_forward(&mut o1, &mut a1, x, None, 1, t, c, nh).unwrap();
            assert_eq!(bits(&o1), bits(&out[s * t * c..(s + 1) * t * c]), "seq {s}");
            let a = &att[s * nh * t * t..(s + 1) * nh * t * t];
            assert_eq!(bits(&a1), bits(a), "seq {s} att");
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
            let mut full_att = vec![0.0f32; nh * t * t];
            attention_forward(&mut full, &mut full_att, &qkv, None, 1, t, c, heads).unwrap();
            let checked =
                (0..t).filter(|&p| t < 200 || p < 70 || (505..520).contains(&p) || p + 1 == t);
            for pos in checked {
                let n = pos + 1;
                let mut out = vec![0.0f32; n * c];
                let mut att = vec![0.0f32; nh * n * n];
                attention_forward(&mut out, &mut att, &qkv[..n * w], None, 1, n, c, heads).unwrap();
                let mut o1 = vec![0.0f32; c];
                let mut a1 = vec![0.0f32; nh * n];
                let q = &qkv[pos * w..pos * w + c];
                attention_decode(&mut o1, &mut a1, q, &kv[..n * 2 * ckv], pos, 0, c, heads)
                    .unwrap();
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&o1),
                    bits(&out[pos * c..]),
                    "C={c} NH={nh} NKV={nkv} pos={pos}: out"
                );
                for h in 0..nh {
                    let row = &att[h * n * n + pos * n..h * n * n + (pos + 1) * n];
                    assert_eq!(bits(&a1[h * n..(h + 1) * n]), bits(row), "pos={pos} h={h}");
                }
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
        let mut att = vec![0.0; b * nh * t * t];
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
                let mut att = vec![0.0; b * nh * t * t];
                attention_forward(out, &mut att, &ins[0], Some(&starts), b, t, c, nh).unwrap();
            },
            |ins, dout, g| {
                let mut att = vec![0.0; b * nh * t * t];
                let mut out = vec![0.0; b * t * c];
                attention_forward(&mut out, &mut att, &ins[0], Some(&starts), b, t, c, nh).unwrap();
                let mut scratch = vec![0.0; b * nh * t * t];
                attention_backward(&mut g[0], &mut scratch, dout, &ins[0], &att, b, t, c, nh)
                    .unwrap();
            },
        );
    }

    /// Every document of a packed sequence gets the bits it gets alone, and
    /// the decoder reproduces each masked row from the cache.
    #[test]
    fn a_packed_document_attends_as_it_does_alone_bitwise() {
        let (b, t, c, nh) = (2, 150, 128, 2);
        let ends: [&[usize]; 2] = [&[10, 63, 64, 130], &[]];
        let (_, starts) = with_boundaries(b, t, &ends);
        let qkv: Vec<f32> = rand_vec(b * t * 3 * c, 44)
            .iter()
            .map(|&x| (x * 2.0) as f32)
            .collect();
        let mut out = vec![0.0f32; b * t * c];
        let mut att = vec![0.0f32; b * nh * t * t];
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
                let mut o1 = vec![0.0f32; n * c];
                let mut a1 = vec![0.0f32; nh * n * n];
                attention_forward(&mut o1, &mut a1, x, None, 1, n, c, nh).unwrap();
                let packed = &out[(bb * t + s) * c..(bb * t + s + n) * c];
                assert_eq!(bits(&o1), bits(packed), "sequence {bb}, document at {s}");
                for h in 0..nh {
                    for i in 0..n {
                        let row = &att[((bb * nh + h) * t + s + i) * t..][..t];
                        assert!(
                            row[..s].iter().all(|&p| p == 0.0),
                            "row {i} sees before {s}"
                        );
                        let alone = &a1[(h * n + i) * n..][..n];
                        assert_eq!(
                            bits(&row[s..s + n]),
                            bits(alone),
                            "seq {bb} doc {s} row {i}"
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
            let mut a1 = vec![0.0f32; nh * (pos + 1)];
            let q = &x[pos * 3 * c..pos * 3 * c + c];
            let start = starts[pos] as usize;
            attention_decode(&mut o1, &mut a1, q, &kv, pos, start, c, nh).unwrap();
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
        let (mut out, mut att) = ([0.0f32; 6], [0.0f32; 9]);
        let err =
            attention_forward(&mut out, &mut att, &qkv, Some(&[0, 2, 0]), 1, t, c, 1).unwrap_err();
        assert!(err.to_string().contains("row 1 of sequence 0"), "{err}");
        let err = attention_decode(
            &mut [0.0f32; 2],
            &mut [0.0; 2],
            &[0.0; 2],
            &[0.0; 8],
            1,
            2,
            c,
            1,
        )
        .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    }

    #[test]
    fn heads_must_divide_channels() {
        let err = attention_forward(
            &mut [0.0f32; 5],
            &mut [0.0; 2],
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
