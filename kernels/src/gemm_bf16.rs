//! bf16 × bf16 → f32 matrix products with f32 accumulation: the GEMM of
//! mixed-precision training.
//!
//! [`matmul_bf16`] computes `out (m×n, f32) = [out +] A · B` for bf16
//! operands in either layout (row-major or transposed), which covers the
//! three products of a linear layer: the forward `x · W`, the input
//! gradient `dY · Wᵀ` and the weight gradient `xᵀ · dY`.
//!
//! # Paths
//! - **AVX512-BF16** (`vdpbf16ps`, when the CPU has it and
//!   [`weft_numerics::simd::level`] allows AVX-512): operands are packed
//!   into pairs along `k` (the instruction's layout), and a micro-kernel
//!   keeps an 8 × 32 block of f32 sums in 16 registers, adding two
//!   products per lane per instruction, twice the f32 FMA's rate.
//! - **Portable** elsewhere: the operands widened to f32 (exact) and the
//!   f32 GEMM (its row-invariant form). Its sums are rounded in another
//!   order, so the two paths agree to rounding, not bit for bit.
//!
//! # Numerics
//! Every product of two bf16 values is exact in f32; each is added to an
//! f32 sum, sequentially over `k` (two per pair: `(s + a₁b₁) + a₀b₀`,
//! as the instruction does), rounded to nearest-even. The instruction
//! treats subnormal inputs as zero and flushes subnormal results (values
//! below 1.2e-38, far below any gradient that matters); the portable path
//! keeps them.
//!
//! # Invariance
//! Every output element is one sum over all of `k` in a fixed order, with
//! block boundaries that depend on `k` alone: a row's bits do not depend
//! on how many rows are computed with it (batch invariance, as the f32
//! GEMM's), nor on the number of threads (columns are split, `k` never).

use rayon::prelude::*;
use weft_numerics::bf16;

use crate::error::{Error, Result, check};
use crate::gemm::{View, column_split};
use crate::matmul::gemm_row_invariant;

/// Rows of the micro-kernel's block of sums.
const MR: usize = 8;
/// Columns of the micro-kernel's block of sums (two AVX-512 vectors).
const NR: usize = 32;
/// Pairs of `k` per packed block (1024 values of `k`): a packed panel of
/// the right operand is `NR · 2 · KP` bf16 = 64 KiB, of the left one 32 KiB.
const KP: usize = 512;
/// Rows of the left operand packed at a time.
const MC: usize = 128;

/// `out (m×n) = [out +] op(a) · op(b)` in f32 from bf16 operands.
///
/// `a` holds `op(a)` (m×k): row-major `m × k` when `a_t` is false, else a
/// row-major `k × m` matrix used transposed. `b` holds `op(b)` (k×n):
/// row-major `k × n` when `b_t` is false, else a row-major `n × k` matrix
/// used transposed. `out` is row-major `m × n`; with `accumulate` the
/// product is added to it. The output columns are split over the rayon
/// pool for large products.
///
/// ```
/// use weft_kernels::matmul_bf16;
/// use weft_numerics::bf16;
/// let a: Vec<bf16> = [1.0, 2.0, 3.0, 4.0].iter().map(|&x| bf16::from_f32(x)).collect();
/// let b: Vec<bf16> = [1.0, 0.5, -1.0, 2.0].iter().map(|&x| bf16::from_f32(x)).collect();
/// let mut out = [0f32; 4];
/// matmul_bf16(&mut out, &a, false, &b, false, 2, 2, 2, false)?;
/// assert_eq!(out, [-1.0, 4.5, -1.0, 9.5]);
/// # Ok::<(), weft_kernels::Error>(())
/// ```
///
/// # Errors
/// [`Error::ShapeMismatch`] if a buffer's length is not what `m`, `n`,
/// `k` imply; [`Error::InvalidArgument`] if they overflow.
#[allow(clippy::too_many_arguments)]
pub fn matmul_bf16(
    out: &mut [f32],
    a: &[bf16],
    a_t: bool,
    b: &[bf16],
    b_t: bool,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) -> Result<()> {
    const OP: &str = "matmul_bf16";
    let size = |x: usize, y: usize| {
        x.checked_mul(y).ok_or_else(|| Error::InvalidArgument {
            op: OP,
            reason: format!("{x} × {y} elements overflow"),
        })
    };
    check(OP, "out", out, size(m, n)?)?;
    check(OP, "a", a, size(m, k)?)?;
    check(OP, "b", b, size(k, n)?)?;
    let av = if a_t { View::t(a, m) } else { View::rows(a, k) };
    let bv = if b_t { View::t(b, k) } else { View::rows(b, n) };
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            out.fill(0.0);
        }
        return Ok(());
    }
    if has_dpbf16() {
        packed(m, n, k, out, accumulate, av, bv);
    } else {
        portable(m, n, k, out, accumulate, av, bv);
    }
    Ok(())
}

/// Whether the `vdpbf16ps` path runs: the CPU has AVX512-BF16 and
/// [`weft_numerics::simd::level`] allows AVX-512 (`WEFT_SIMD` can cap it).
pub fn has_dpbf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        weft_numerics::simd::level() == weft_numerics::simd::Level::Avx512
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The portable path: both operands widened to f32, then the f32 GEMM.
fn portable(
    m: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
    accumulate: bool,
    a: View<'_, bf16>,
    b: View<'_, bf16>,
) {
    let wide = |v: View<'_, bf16>, rows: usize, cols: usize| -> Vec<f32> {
        let mut w = Vec::with_capacity(rows * cols);
        for i in 0..rows {
            w.extend((0..cols).map(|j| v.data[i * v.rs + j * v.cs].to_f32()));
        }
        w
    };
    let (aw, bw) = (wide(a, m, k), wide(b, k, n));
    gemm_row_invariant(
        m,
        n,
        k,
        out,
        n,
        accumulate,
        View::rows(&aw, k),
        View::rows(&bw, n),
        1.0f32,
        true,
    );
}

/// The output's base pointer, shared by the pool's tasks (each writes its
/// own disjoint column block).
struct OutPtr(*mut f32);
// SAFETY: only used to hand disjoint column blocks of one exclusively
// borrowed output to pool tasks that end before the borrow does.
unsafe impl Sync for OutPtr {}

/// The packed `vdpbf16ps` path, the columns split over the pool when the
/// product is large.
fn packed(
    m: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
    accumulate: bool,
    a: View<'_, bf16>,
    b: View<'_, bf16>,
) {
    let big = m * n * k >= 64 * 64 * 64;
    let per = if big {
        column_split(n, rayon::current_num_threads()).map(|p| p.next_multiple_of(NR))
    } else {
        None
    };
    let Some(per) = per.filter(|&p| p < n) else {
        // SAFETY: `out` holds m × n elements (checked by the caller) and is
        // borrowed exclusively.
        unsafe { packed_block(m, n, k, out.as_mut_ptr(), n, accumulate, a, b, 0) };
        return;
    };
    let dst = OutPtr(out.as_mut_ptr());
    (0..n.div_ceil(per)).into_par_iter().for_each(|c| {
        let j0 = c * per;
        let dst = &dst;
        // SAFETY: columns `[j0, j0 + nb)` of the m × n output (row stride
        // n) lie inside `out`; the tasks' blocks are disjoint, and `out`
        // stays borrowed until every task has finished.
        unsafe {
            packed_block(
                m,
                per.min(n - j0),
                k,
                dst.0.add(j0),
                n,
                accumulate,
                a,
                b,
                j0,
            );
        }
    });
}

/// Columns `[j0, j0 + n)` of the product into `dst` (its first column;
/// row stride `ldc`).
///
/// # Safety
/// `dst` must be valid for writes of an `m × n` block with row stride
/// `ldc`, not aliased by anything else during the call; the CPU must have
/// AVX512-BF16 (only then is `packed` called).
#[allow(clippy::too_many_arguments)]
unsafe fn packed_block(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    ldc: usize,
    accumulate: bool,
    a: View<'_, bf16>,
    b: View<'_, bf16>,
    j0: usize,
) {
    let pairs = k.div_ceil(2);
    let panels = n.div_ceil(NR);
    let mut bp = vec![0u16; panels * NR * 2 * KP.min(pairs)];
    let mut ap = vec![0u32; MC.div_ceil(MR) * MR * KP.min(pairs)];
    for (kb, p0) in (0..pairs).step_by(KP).enumerate() {
        let kp = KP.min(pairs - p0);
        pack_b(&mut bp, b, k, j0, n, p0, kp);
        let first = kb == 0 && !accumulate;
        for i0 in (0..m).step_by(MC) {
            let mc = MC.min(m - i0);
            pack_a(&mut ap, a, k, i0, mc, p0, kp);
            for pj in 0..panels {
                let nc = NR.min(n - pj * NR);
                let bpanel = &bp[pj * NR * 2 * kp..(pj + 1) * NR * 2 * kp];
                for pi in 0..mc.div_ceil(MR) {
                    let mr = MR.min(mc - pi * MR);
                    let apanel = &ap[pi * MR * kp..(pi + 1) * MR * kp];
                    // SAFETY: rows `i0 + pi·MR ..+ mr` and columns
                    // `pj·NR ..+ nc` lie inside the block the caller
                    // vouched for; the panels hold `kp` pairs each.
                    unsafe {
                        let c = dst.add((i0 + pi * MR) * ldc + pj * NR);
                        x86::kernel(kp, apanel, bpanel, c, ldc, mr, nc, first);
                    }
                }
            }
        }
    }
}

/// Packs pairs `[p0, p0 + kp)` of columns `[j0, j0 + n)` of `op(b)` into
/// panels of [`NR`] columns: panel-major, then pair, then column, then the
/// pair's two values (`k` = 2p, 2p + 1), zero beyond `k` and `n`.
fn pack_b(dst: &mut [u16], b: View<'_, bf16>, k: usize, j0: usize, n: usize, p0: usize, kp: usize) {
    let panels = n.div_ceil(NR);
    for pj in 0..panels {
        let panel = &mut dst[pj * NR * 2 * kp..(pj + 1) * NR * 2 * kp];
        for p in 0..kp {
            let (k0, k1) = (2 * (p0 + p), 2 * (p0 + p) + 1);
            let row = &mut panel[p * NR * 2..(p + 1) * NR * 2];
            for c in 0..NR {
                let j = pj * NR + c;
                let get = |kk: usize| {
                    if kk < k && j < n {
                        b.data[kk * b.rs + (j0 + j) * b.cs].to_bits()
                    } else {
                        0
                    }
                };
                row[2 * c] = get(k0);
                row[2 * c + 1] = get(k1);
            }
        }
    }
}

/// Packs pairs `[p0, p0 + kp)` of rows `[i0, i0 + mc)` of `op(a)` into
/// panels of [`MR`] rows: panel-major, then pair, then row, each entry the
/// pair's two values as one u32 (`k` = 2p in the low half), zero beyond
/// `k` and the rows.
fn pack_a(
    dst: &mut [u32],
    a: View<'_, bf16>,
    k: usize,
    i0: usize,
    mc: usize,
    p0: usize,
    kp: usize,
) {
    for pi in 0..mc.div_ceil(MR) {
        let panel = &mut dst[pi * MR * kp..(pi + 1) * MR * kp];
        for p in 0..kp {
            let (k0, k1) = (2 * (p0 + p), 2 * (p0 + p) + 1);
            for r in 0..MR {
                let i = pi * MR + r;
                let get = |kk: usize| {
                    if kk < k && i < mc {
                        u32::from(a.data[(i0 + i) * a.rs + kk * a.cs].to_bits())
                    } else {
                        0
                    }
                };
                panel[p * MR + r] = get(k0) | (get(k1) << 16);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m512bh, _mm512_dpbf16_ps, _mm512_loadu_ps, _mm512_mask_loadu_ps, _mm512_mask_storeu_ps,
        _mm512_set1_epi32, _mm512_setzero_ps, _mm512_storeu_ps,
    };

    use super::{MR, NR};

    /// The mask of the first `n` (≤ 16) lanes.
    fn lanes(n: usize) -> u16 {
        if n >= 16 { u16::MAX } else { (1u16 << n) - 1 }
    }

    /// `c (mr × nc, row stride ldc) = [c +] Σ_p a_p ⊗ b_p` over `kp` pairs
    /// of one packed panel each (`first`: start from zero, else from `c`).
    ///
    /// # Safety
    /// The CPU must have AVX512-BF16 and AVX-512F; `c` must be valid for
    /// reads and writes of `mr` rows of `nc` values with row stride `ldc`;
    /// `a` must hold `MR · kp` entries and `b` `NR · 2 · kp`.
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn kernel(
        kp: usize,
        a: &[u32],
        b: &[u16],
        c: *mut f32,
        ldc: usize,
        mr: usize,
        nc: usize,
        first: bool,
    ) {
        debug_assert!(a.len() >= MR * kp && b.len() >= NR * 2 * kp);
        let (m0, m1) = (lanes(nc), lanes(nc.saturating_sub(16)));
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        if !first {
            for r in 0..mr {
                // SAFETY: row `r < mr` of `c`, the masked lanes `< nc`.
                unsafe {
                    let row = c.add(r * ldc);
                    acc[r][0] = _mm512_mask_loadu_ps(_mm512_setzero_ps(), m0, row);
                    acc[r][1] = _mm512_mask_loadu_ps(_mm512_setzero_ps(), m1, row.add(16));
                }
            }
        }
        let (ap, bp) = (a.as_ptr(), b.as_ptr());
        for p in 0..kp {
            // SAFETY: pair `p < kp` of each panel: `NR · 2` bf16 of `b` at
            // `p · NR · 2` (two vectors) and `MR` entries of `a` at `p · MR`.
            unsafe {
                let b0: __m512bh = std::mem::transmute(_mm512_loadu_ps(bp.add(p * NR * 2).cast()));
                let b1: __m512bh =
                    std::mem::transmute(_mm512_loadu_ps(bp.add(p * NR * 2 + 32).cast()));
                for r in 0..MR {
                    let x: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(*ap.add(p * MR + r) as i32));
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
                }
            }
        }
        for r in 0..mr {
            // SAFETY: as for the loads above.
            unsafe {
                let row = c.add(r * ldc);
                if nc == NR {
                    _mm512_storeu_ps(row, acc[r][0]);
                    _mm512_storeu_ps(row.add(16), acc[r][1]);
                } else {
                    _mm512_mask_storeu_ps(row, m0, acc[r][0]);
                    _mm512_mask_storeu_ps(row.add(16), m1, acc[r][1]);
                }
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    /// Never called: [`super::has_dpbf16`] is false off x86-64.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn kernel(
        _kp: usize,
        _a: &[u32],
        _b: &[u16],
        _c: *mut f32,
        _ldc: usize,
        _mr: usize,
        _nc: usize,
        _first: bool,
    ) {
        unreachable!("the vdpbf16ps kernel off x86-64");
    }
}

/// The measured `vdpbf16ps` peak of `threads` threads at once, in GFLOP/s
/// (a bf16 pair's two multiplies and two adds count as four), best of
/// `reps` runs, like [`fma_peak_gflops`](crate::fma_peak_gflops) for f32:
/// the denominator of "percent of bf16 peak". `None` without AVX512-BF16.
///
/// ```no_run
/// if let Some(peak) = weft_kernels::bf16_dot_peak_gflops(2, 3) {
///     assert!(peak > 0.0);
/// }
/// ```
#[must_use]
pub fn bf16_dot_peak_gflops(threads: usize, reps: usize) -> Option<f64> {
    if !has_dpbf16() {
        return None;
    }
    let threads = threads.max(1);
    let iters = 10_000_000usize;
    let mut best = 0.0f64;
    for _ in 0..reps.max(1) {
        let start = std::time::Instant::now();
        std::thread::scope(|s| {
            for _ in 0..threads {
                // SAFETY: `has_dpbf16` reported AVX512-BF16.
                s.spawn(|| std::hint::black_box(unsafe { peak::chains(iters) }));
            }
        });
        let secs = start.elapsed().as_secs_f64();
        #[allow(clippy::cast_precision_loss)]
        let flops = (threads * iters * peak::CHAINS * 16 * 4) as f64;
        best = best.max(flops / secs / 1e9);
    }
    Some(best)
}

#[cfg(target_arch = "x86_64")]
mod peak {
    use std::arch::x86_64::{
        __m512bh, _mm512_add_ps, _mm512_dpbf16_ps, _mm512_reduce_add_ps, _mm512_set1_epi32,
        _mm512_setzero_ps,
    };

    /// Independent accumulator chains.
    pub(super) const CHAINS: usize = 16;

    /// `iters` rounds of [`CHAINS`] independent `vdpbf16ps`.
    ///
    /// # Safety
    /// The CPU must have AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn chains(iters: usize) -> f32 {
        // tiny values: the sums stay finite however long the run
        // SAFETY: a vector of 32 bf16 bit patterns; every pattern is valid.
        let x: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi32(0x2000_2000)) };
        let y = x;
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm512_dpbf16_ps(*a, x, y);
            }
        }
        let mut s = _mm512_setzero_ps();
        for a in acc {
            s = _mm512_add_ps(s, a);
        }
        _mm512_reduce_add_ps(s)
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod peak {
    pub(super) const CHAINS: usize = 16;
    pub(super) unsafe fn chains(_iters: usize) -> f32 {
        unreachable!("no vdpbf16ps off x86-64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic bf16 values in about [-2, 2], none subnormal.
    fn values(n: usize, seed: u64) -> Vec<bf16> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0)
            })
            .collect()
    }

    /// `op(x)[i][j]` of a row-major matrix stored plain or transposed.
    fn at(x: &[bf16], t: bool, rows: usize, cols: usize, i: usize, j: usize) -> f64 {
        f64::from(if t { x[j * rows + i] } else { x[i * cols + j] }.to_f32())
    }

    /// Checks one product against an f64 reference of the same bf16
    /// values: |err| ≤ (k + 2) · 2⁻²⁴ · Σ|aᵢbᵢ| per element (the bound of
    /// k sequential f32 additions, plus the accumulated output).
    #[allow(clippy::too_many_arguments)]
    fn check_one(m: usize, n: usize, k: usize, a_t: bool, b_t: bool, acc: bool, seed: u64) {
        let a = values(m * k, seed);
        let b = values(k * n, seed + 1);
        let init: Vec<f32> = values(m * n, seed + 2).iter().map(|x| x.to_f32()).collect();
        let mut out = if acc {
            init.clone()
        } else {
            vec![f32::NAN; m * n]
        };
        matmul_bf16(&mut out, &a, a_t, &b, b_t, m, n, k, acc).unwrap();
        for i in 0..m {
            for j in 0..n {
                let mut exact = if acc { f64::from(init[i * n + j]) } else { 0.0 };
                let mut mag = exact.abs();
                for kk in 0..k {
                    let p = at(&a, a_t, m, k, i, kk) * at(&b, b_t, k, n, kk, j);
                    exact += p;
                    mag += p.abs();
                }
                let err = (f64::from(out[i * n + j]) - exact).abs();
                let bound = (k as f64 + 2.0) * 2f64.powi(-24) * mag;
                assert!(
                    err <= bound,
                    "{m}×{n}×{k} a_t={a_t} b_t={b_t} acc={acc} at ({i},{j}): {} vs {exact} (err {err:e}, bound {bound:e})",
                    out[i * n + j]
                );
            }
        }
    }

    #[test]
    fn every_layout_and_remainder_matches_an_f64_reference() {
        // remainders of MR (8), NR (32) and the pair (odd k), and k past
        // one packed block (KP pairs = 1024 values)
        let shapes = [
            (1, 1, 1),
            (3, 5, 7),
            (8, 32, 2),
            (9, 33, 3),
            (17, 70, 64),
            (130, 40, 31),
            (5, 3, 1100),
            (64, 64, 2049),
        ];
        for (s, &(m, n, k)) in shapes.iter().enumerate() {
            for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
                for acc in [false, true] {
                    check_one(m, n, k, a_t, b_t, acc, s as u64 * 7 + 1);
                }
            }
        }
    }

    #[test]
    fn rows_do_not_depend_on_the_batch_nor_on_threads() {
        let (m, n, k) = (37, 300, 777);
        let a = values(m * k, 3);
        let b = values(k * n, 4);
        let mut all = vec![0f32; m * n];
        matmul_bf16(&mut all, &a, false, &b, false, m, n, k, false).unwrap();
        for i in [0, 8, 36] {
            let mut one = vec![0f32; n];
            matmul_bf16(
                &mut one,
                &a[i * k..(i + 1) * k],
                false,
                &b,
                false,
                1,
                n,
                k,
                false,
            )
            .unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&one), bits(&all[i * n..(i + 1) * n]), "row {i}");
        }
        // one thread gives the bits of the pool
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let mut single = vec![0f32; m * n];
        pool.install(|| matmul_bf16(&mut single, &a, false, &b, false, m, n, k, false))
            .unwrap();
        assert!(
            single
                .iter()
                .zip(&all)
                .all(|(x, y)| x.to_bits() == y.to_bits())
        );
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let a = values(6, 1);
        let mut out = vec![0f32; 4];
        let e = matmul_bf16(&mut out, &a, false, &a, false, 2, 2, 4, false).unwrap_err();
        assert!(
            matches!(e, Error::ShapeMismatch { buffer: "a", .. }),
            "{e:?}"
        );
        let e = matmul_bf16(&mut out, &a, false, &a, false, usize::MAX, 2, 4, false).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    }
}
