//! bf16 × bf16 → f32 matrix products with f32 accumulation: the GEMM of
//! mixed-precision training.
//!
//! [`matmul_bf16`] computes `out (m×n, f32) = [out +] A · B` for bf16
//! operands in either layout (row-major or transposed), which covers the
//! three products of a linear layer: the forward `x · W`, the input
//! gradient `dY · Wᵀ` and the weight gradient `xᵀ · dY`. The linear-layer
//! kernels in [`Precision::Bf16`](crate::Precision::Bf16) run the same
//! product on f32 buffers: each f32 is rounded to bf16
//! (`vcvtneps2bf16`) as it is packed, so no rounded copy is made and each
//! value is read once (on AMX a left operand stored transposed, as the
//! weight gradients' `xᵀ`, is transposed 16 × 16 values at a time as it
//! is packed).
//!
//! # Paths ([`bf16_path`])
//! - **AMX** (`tdpbf16ps`, Intel Sapphire Rapids and later, when the CPU
//!   has AMX-BF16 and Linux grants the process the tile-data state —
//!   requested once with `arch_prctl(ARCH_REQ_XCOMP_PERM)`): stable Rust
//!   reaches the tile instructions through inline assembly. Four 16 × 16
//!   f32 tiles of sums per 32 × 32 block, each instruction adding a 16 ×
//!   32 by 32 × 16 bf16 product; `k` in blocks of up to 2048 values, the
//!   left operand packed 1.5 MiB and the right one 512 KiB at a time (in
//!   L2), every packed buffer on 64-byte boundaries: a tile row that
//!   straddles two cache lines loads at less than half the rate. A left
//!   operand of up to 16 MiB is packed whole once, its rows over the
//!   pool, and read by every thread; a bias starts the tiles (loaded with
//!   a row stride of zero). Against packing all of `k` and every column
//!   on unaligned buffers per thread: a GPT-2 small layer's twelve
//!   products 1.36× faster, the head's three 1.53×; on bf16 buffers 1.27×
//!   faster than PyTorch's oneDNN bf16 GEMM over all of them
//!   (`benches/bf16_gemm.rs`, `model/reference/bench_torch_gemm.py`;
//!   Intel Xeon with AMX, 2 threads).
//! - **AVX512-BF16** (`vdpbf16ps`): operands packed into pairs along `k`
//!   (the instruction's layout), a micro-kernel keeping an 8 × 32 block of
//!   f32 sums in 16 registers, two products per lane per instruction
//!   (inline assembly: each row's pair broadcast by the instruction's own
//!   load, `{1to16}`; the next block of sums prefetched). Blocked as
//!   GotoBLAS: 1024 values of `k` at a time, 512 columns of the
//!   right operand packed at a time (the vocabulary's products are
//!   computed block by block of columns), 128 rows of the left one (or
//!   all of them once, when they are few and the columns many); the packed
//!   blocks are kept per thread for the next product. Threads split the
//!   columns, or the rows where that packs fewer values (a weight
//!   gradient whose left operand is the larger, as the vocabulary's
//!   `dYᵀ · x`: 8–10% faster than each thread packing all of `dYᵀ`). A
//!   forward with a bias starts its sums from the bias in registers: the
//!   bits of accumulating into rows copied from it, without the copy
//!   (GPT-2 small's bf16 step 1–2% faster).
//! - **Portable** elsewhere: the operands widened to f32 (exact) and the
//!   f32 GEMM (its row-invariant form).
//!
//! [`weft_numerics::simd::level`] below AVX-512 (`WEFT_SIMD`) selects the
//! portable path; `WEFT_AMX=0` leaves AMX out.
//!
//! # Numerics
//! Every product of two bf16 values is exact in f32 and accumulated in
//! f32. `vdpbf16ps` adds them sequentially over `k`, two per pair
//! (`(s + a₁b₁) + a₀b₀`); AMX in its own fixed order within each 32-value
//! step (measured: within an f32 rounding of that order, not bit for bit);
//! the portable path in the f32 GEMM's. The paths therefore agree to
//! rounding, not bit for bit, and one machine always takes the same path.
//! Both instruction paths treat subnormal inputs as zero and flush
//! subnormal results (values below 1.2e-38, far below any gradient that
//! matters); the portable path keeps them.
//!
//! # Invariance
//! Every output element is one sum over all of `k` in a fixed order, with
//! block boundaries that depend on `k` alone: a row's bits do not depend
//! on how many rows are computed with it (batch invariance, as the f32
//! GEMM's), nor on the number of threads (columns are split, `k` never).

use std::sync::OnceLock;

use rayon::prelude::*;
use weft_numerics::bf16;

use crate::error::{Error, Result, check};
use crate::gemm::{View, column_split};
use crate::held::Held;
use crate::matmul::gemm_row_invariant;

/// Rows of the `vdpbf16ps` micro-kernel's block of sums.
const MR: usize = 8;
/// Columns of a packed panel of the right operand, and of both
/// micro-kernels' blocks of sums (two AVX-512 vectors, two AMX tiles).
const NR: usize = 32;
/// Pairs of `k` per packed block (1024 values of `k`): a packed panel of
/// the right operand is `NR · 2 · KP` bf16 = 64 KiB (in L2), which the
/// micro-kernel reads once per [`MR`] rows. Measured with
/// `benches/bf16_gemm.rs` over GPT-2 small's products: 128 and 192 pairs
/// (panels that stay in a 32 KiB L1) are 5–8% slower, the blocks of sums
/// going back to the output more often; 256–512 alike.
const KP: usize = 512;
/// Rows of the left operand packed at a time (256 KiB of pairs, in L2).
const MC: usize = 128;
/// Columns of the right operand packed at a time (1 MiB of pairs): a wide
/// product (the vocabulary's) is computed a block of columns
/// at a time, so that its packed right operand is not streamed from
/// memory once per block of rows.
const NC: usize = 512;
/// Columns of the right operand packed at a time when the rows are split
/// over the pool (each thread then packs all of the right operand, at
/// most 2 MiB of pairs per block of `k`): every column at once up to this
/// many, so that a thread packs its rows of the left operand once per
/// block of `k` rather than once per block of [`NC`] columns.
const NC_ROWS: usize = 1024;
/// The most a thread packs of the left operand at once: a product with
/// several blocks of [`NC`] columns packs all its rows once (per block of
/// `k`) when they fit, rather than once per block of columns.
/// (Tests take both ways at small sizes.)
const WHOLE_A_BYTES: usize = if cfg!(test) { 4 << 10 } else { 4 << 20 };
/// Rows of the AMX block of sums (two tiles of 16).
const MA: usize = 32;
/// Pairs of `k` per AMX step (one tile: 16 rows of 64 bytes).
const PA: usize = 16;
/// Pairs of `k` per block of the AMX path at most (`k` is cut into
/// near-equal blocks of whole tiles; between blocks the sums go back to
/// the output). Measured with `benches/bf16_gemm.rs` over GPT-2 small's
/// products (Intel Xeon with AMX, 2 threads): 1024 pairs 0.89× the time
/// of 384 (the head's products 0.88×), 192–256 1.1×, 2048 1.06×.
/// (Tests take several blocks of `k`, rows and columns at small sizes.)
const KPA: usize = if cfg!(test) { 32 } else { 1024 };
/// Bytes of the left operand the AMX path packs at a time (bf16 rows of
/// a block of `k`, in L2 while the right operand's blocks pass; 768 KiB
/// measured 1.2× the time, 3 MiB alike).
const A_BYTES: usize = if cfg!(test) { 16 << 10 } else { 1536 << 10 };
/// The most bytes of the left operand the AMX path packs whole, once, its
/// rows over the pool, for every thread to read (a larger one, as the
/// head's logits gradient, is packed by each thread a block at a time).
const SHARED_A_BYTES: usize = if cfg!(test) { 64 << 10 } else { 16 << 20 };
/// Bytes of the right operand the AMX path packs at a time (in L2 while
/// every 32-row strip of the left block passes over it; 256 KiB measured
/// 1.08× the time, 1 MiB alike).
const B_BYTES: usize = if cfg!(test) { 8 << 10 } else { 512 << 10 };

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
    product(m, n, k, out, accumulate, av, bv);
    Ok(())
}

/// How this machine computes bf16 products (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bf16Path {
    /// AMX tiles (`tdpbf16ps`).
    Amx,
    /// AVX512-BF16 (`vdpbf16ps`).
    Avx512Bf16,
    /// Widened to f32, the f32 GEMM.
    Portable,
}

impl Bf16Path {
    /// A short name for reports: `"amx"`, `"avx512-bf16"`, `"portable"`.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Path::Amx => "amx",
            Bf16Path::Avx512Bf16 => "avx512-bf16",
            Bf16Path::Portable => "portable",
        }
    }
}

/// The path bf16 products take on this machine, decided once: AMX where
/// the CPU has AMX-BF16, the OS grants the tile state and `WEFT_AMX` is not
/// `0`; else `vdpbf16ps` where it has AVX512-BF16; else portable — AVX-512
/// paths only where [`weft_numerics::simd::level`] allows AVX-512.
pub fn bf16_path() -> Bf16Path {
    static PATH: OnceLock<Bf16Path> = OnceLock::new();
    *PATH.get_or_init(|| {
        let paths = available_paths();
        let amx_off = std::env::var("WEFT_AMX").is_ok_and(|v| v.trim() == "0");
        paths
            .into_iter()
            .find(|&p| !(amx_off && p == Bf16Path::Amx))
            .unwrap_or(Bf16Path::Portable)
    })
}

/// Every path this machine can run, fastest first (the portable one
/// always last).
pub(crate) fn available_paths() -> Vec<Bf16Path> {
    let mut out = Vec::new();
    #[cfg(target_arch = "x86_64")]
    if weft_numerics::simd::level() == weft_numerics::simd::Level::Avx512
        && std::arch::is_x86_feature_detected!("avx512bf16")
    {
        if amx::usable() {
            out.push(Bf16Path::Amx);
        }
        out.push(Bf16Path::Avx512Bf16);
    }
    out.push(Bf16Path::Portable);
    out
}

/// An element the bf16 products read: a bf16 as it is, an f32 rounded
/// to the nearest bf16 (ties to even).
pub(crate) trait Operand: Copy + Send + Sync + Default {
    /// The bf16 this element is multiplied as on the portable path.
    fn bf16_bits(self) -> u16;
    /// The bf16 this element is multiplied as on the packed paths: as
    /// `vcvtneps2bf16` rounds it (a subnormal f32 as a zero of its sign),
    /// so that the packing's scalar edges give the bits of its vector
    /// body.
    fn packed_bits(self) -> u16 {
        self.bf16_bits()
    }
    /// `d = s` as bf16 (rounded, or copied).
    fn row_to_bf16(d: &mut [bf16], s: &[Self]);
}

impl Operand for bf16 {
    fn bf16_bits(self) -> u16 {
        self.to_bits()
    }
    fn row_to_bf16(d: &mut [bf16], s: &[bf16]) {
        d.copy_from_slice(s);
    }
}

impl Operand for f32 {
    fn bf16_bits(self) -> u16 {
        bf16::from_f32(self).to_bits()
    }
    fn packed_bits(self) -> u16 {
        as_instruction_rounds(self).to_bits()
    }
    fn row_to_bf16(d: &mut [bf16], s: &[f32]) {
        round_row(d, s);
    }
}

/// `dst = src` rounded to the nearest bf16 (ties to even) exactly as the
/// bf16 products round an f32 operand on this machine's [`bf16_path`], so
/// that a product of the stored `dst` gives the bits of the same product
/// of `src` in [`Precision::Bf16`](crate::Precision::Bf16). A model stores
/// an activation that only products read this way: half the bytes, the
/// same results. Large buffers are split over the rayon pool.
///
/// # Errors
/// [`Error::ShapeMismatch`] if the lengths differ.
pub fn round_to_bf16_for_products(dst: &mut [bf16], src: &[f32]) -> Result<()> {
    check("round_to_bf16_for_products", "dst", dst, src.len())?;
    const CHUNK: usize = 1 << 16;
    let portable = bf16_path() == Bf16Path::Portable;
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| {
            if portable {
                // what the portable path multiplies (`Operand::bf16_bits`)
                for (d, &x) in d.iter_mut().zip(s) {
                    *d = bf16::from_f32(x);
                }
            } else {
                round_row(d, s);
            }
        });
    Ok(())
}

/// `x` rounded to bf16 as `vcvtneps2bf16` rounds it: to nearest, ties to
/// even, a subnormal input as a zero of its sign.
fn as_instruction_rounds(x: f32) -> bf16 {
    if x.is_subnormal() {
        bf16::from_bits(((x.to_bits() >> 16) as u16) & 0x8000)
    } else {
        bf16::from_f32(x)
    }
}

/// `d = s` rounded to bf16: `vcvtneps2bf16` where the CPU has it.
fn round_row(d: &mut [bf16], s: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if weft_numerics::simd::level() == weft_numerics::simd::Level::Avx512
        && std::arch::is_x86_feature_detected!("avx512bf16")
    {
        // SAFETY: the CPU has AVX512-BF16 (checked just above).
        unsafe { x86::round(d, s) };
        return;
    }
    for (d, &x) in d.iter_mut().zip(s) {
        *d = bf16::from_f32(x);
    }
}

/// `v` (rows × cols, strided both ways: the packings read only views
/// along rows or columns) as a row-major bf16 copy in `dst`, rounded as
/// the packings round: blocks of 64 rows over the pool, each in 16 × 16
/// tiles.
fn row_major_copy<'a, A: Operand>(
    dst: &'a mut Held<bf16>,
    v: View<'_, A>,
    rows: usize,
    cols: usize,
) -> View<'a, bf16> {
    const T: usize = 16;
    const R: usize = 64;
    let out = dst.sized(rows * cols);
    out.par_chunks_mut(R * cols)
        .enumerate()
        .for_each(|(ib, out)| {
            let r0 = ib * R;
            let nr = out.len() / cols;
            let mut tile = [A::default(); T * T];
            for j0 in (0..cols).step_by(T) {
                let nj = T.min(cols - j0);
                for i0 in (0..nr).step_by(T) {
                    let ni = T.min(nr - i0);
                    // tile[i][j] = v(r0 + i0 + i, j0 + j), read along i
                    for j in 0..nj {
                        let base = (j0 + j) * v.cs + (r0 + i0) * v.rs;
                        for i in 0..ni {
                            tile[i * T + j] = v.data[base + i * v.rs];
                        }
                    }
                    for i in 0..ni {
                        let at = (i0 + i) * cols + j0;
                        A::row_to_bf16(&mut out[at..at + nj], &tile[i * T..i * T + nj]);
                    }
                }
            }
        });
    View::rows(dst.get(rows * cols), cols)
}

thread_local! {
    /// The packed operands of the AMX path (right, left) and the right
    /// one of the `vdpbf16ps` path, kept for the thread's next block
    /// (taken out while in use).
    static PACKED: std::cell::Cell<[Held<u16>; 2]> = const { std::cell::Cell::new([Held::new(), Held::new()]) };
    /// The AMX path's left operand packed whole ([`SHARED_A_BYTES`]),
    /// kept for the calling thread's next product.
    static SHARED_A: std::cell::Cell<Held<u16>> = const { std::cell::Cell::new(Held::new()) };
    /// The `vdpbf16ps` path's packed left operand (pairs as u32), kept
    /// likewise; its right one is the first of [`PACKED`].
    static PACKED_A: std::cell::Cell<Held<u32>> = const { std::cell::Cell::new(Held::new()) };
    /// Row-major bf16 copies of operands strided both ways
    /// ([`row_major_copy`]), kept for the thread's next product (taken out
    /// while in use, so a product the pool runs inside another on the same
    /// thread just allocates its own).
    static ROUNDED: std::cell::Cell<[Held<bf16>; 2]> = const { std::cell::Cell::new([Held::new(), Held::new()]) };
}

/// `out (m×n, row-major) = [out +] op(a) · op(b)` with every element of
/// `a` and `b` taken as its bf16 ([`Operand`]), accumulated in f32, on
/// [`bf16_path`]. Shapes are the caller's to check; `m`, `n`, `k` > 0.
#[allow(clippy::too_many_arguments)]
pub(crate) fn product<A: Operand, B: Operand>(
    m: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
    accumulate: bool,
    a: View<'_, A>,
    b: View<'_, B>,
) {
    product_on(bf16_path(), m, n, k, out, accumulate, a, b);
}

/// [`product`] on `path` (one of [`available_paths`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn product_on<A: Operand, B: Operand>(
    path: Bf16Path,
    m: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
    accumulate: bool,
    a: View<'_, A>,
    b: View<'_, B>,
) {
    if path == Bf16Path::Portable {
        portable(m, n, k, out, accumulate, a, b);
        return;
    }
    packable(path, m, n, k, out, accumulate, None, a, b);
}

/// `out (m×n) = bias + op(a) · op(b)`, `bias` (n values) added to every
/// row: the bits of copying `bias` into every row of `out` and then
/// accumulating the product into it ([`product`] with `accumulate`), which
/// is what the portable path does. On `vdpbf16ps` the block of sums starts
/// from `bias` in registers instead, on AMX in tiles loaded from it with
/// a row stride of zero (no copy, no read of `out`).
pub(crate) fn product_with_bias<A: Operand, B: Operand>(
    m: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
    bias: &[f32],
    a: View<'_, A>,
    b: View<'_, B>,
) {
    assert!(
        bias.len() == n && out.len() >= m * n,
        "product_with_bias: shapes"
    );
    let path = bf16_path();
    if path != Bf16Path::Portable && m > 0 && n > 0 && k > 0 {
        packable(path, m, n, k, out, false, Some(bias), a, b);
        return;
    }
    for row in out[..m * n].chunks_exact_mut(n) {
        row.copy_from_slice(bias);
    }
    if k > 0 {
        product(m, n, k, out, true, a, b);
    }
}

/// The packed paths (AMX or `vdpbf16ps`; `m`, `n`, `k` > 0): either
/// operand packed as it is stored, along rows or columns, f32 rounded as
/// it is packed; one strided both ways from a row-major bf16 copy (kept
/// in [`ROUNDED`]). Without `accumulate` the sums start from `bias` or
/// zero.
#[allow(clippy::too_many_arguments)]
fn packable<A: Operand, B: Operand>(
    path: Bf16Path,
    m: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
    accumulate: bool,
    bias: Option<&[f32]>,
    a: View<'_, A>,
    b: View<'_, B>,
) {
    let [mut ab, mut bb] = ROUNDED.take();
    let along = |rs: usize, cs: usize| rs == 1 || cs == 1;
    let run = Run {
        path,
        m,
        n,
        k,
        accumulate,
        bias,
    };
    match (along(a.rs, a.cs), along(b.rs, b.cs)) {
        (true, true) => run.on(out, a, b),
        (true, false) => run.on(out, a, row_major_copy(&mut bb, b, k, n)),
        (false, true) => run.on(out, row_major_copy(&mut ab, a, m, k), b),
        (false, false) => {
            let a = row_major_copy(&mut ab, a, m, k);
            run.on(out, a, row_major_copy(&mut bb, b, k, n));
        }
    }
    ROUNDED.set([ab, bb]);
}

/// A product of [`packable`]: the path, the shape and where its sums
/// start.
struct Run<'a> {
    path: Bf16Path,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
    bias: Option<&'a [f32]>,
}

impl Run<'_> {
    /// The product once both operands run along rows or columns.
    fn on<A: Operand, B: Operand>(&self, out: &mut [f32], a: View<'_, A>, b: View<'_, B>) {
        let Run {
            path,
            m,
            n,
            k,
            accumulate,
            bias,
        } = *self;
        if path != Bf16Path::Amx {
            packed(m, n, k, out, a, |a, rows, nb, dst, j0, nc| {
                // SAFETY: `packed` vouches for `dst`; the CPU has AVX512-BF16
                // (the caller's path).
                unsafe { packed_block(rows, nb, k, dst, n, accumulate, bias, a, b, j0, nc) }
            });
            return;
        }
        // the left operand packed once, its rows over the pool, where it
        // is small enough: each thread that takes a block of columns would
        // otherwise pack all of it
        let w = 2 * k.div_ceil(2).next_multiple_of(PA);
        let mp = m.next_multiple_of(MA);
        if mp * w * 2 <= SHARED_A_BYTES {
            let mut held = SHARED_A.take();
            let ap = held.lines(mp * w);
            ap.par_chunks_mut(MA * w)
                .enumerate()
                .for_each(|(blk, rows)| {
                    let i0 = blk * MA;
                    pack_rows(rows, a, k, i0, MA.min(m - i0), MA, 0, w / 2);
                });
            packed(
                m,
                n,
                k,
                out,
                View::rows(&*ap, w),
                |pa, rows, nb, dst, j0, _| {
                    // SAFETY: `packed` vouches for `dst`; the CPU has AMX (the
                    // caller's path); `pa` holds this block's rows of `a`
                    // packed whole (`w` values each, zero-padded to whole
                    // tiles of rows), and `b` runs along rows or columns.
                    unsafe {
                        amx_block(
                            rows,
                            nb,
                            k,
                            dst,
                            n,
                            accumulate,
                            bias,
                            a,
                            Some(pa.data),
                            b,
                            j0,
                        );
                    }
                },
            );
            SHARED_A.set(held);
            return;
        }
        packed(m, n, k, out, a, |a, rows, nb, dst, j0, _| {
            // SAFETY: `packed` vouches for `dst`; the CPU has AMX (the
            // caller's path); `a` and `b` run along rows or
            // columns (the caller's match).
            unsafe { amx_block(rows, nb, k, dst, n, accumulate, bias, a, None, b, j0) }
        });
    }
}

/// The portable path: both operands widened to f32, then the f32 GEMM.
fn portable<A: Operand, B: Operand>(
    m: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
    accumulate: bool,
    a: View<'_, A>,
    b: View<'_, B>,
) {
    fn wide<T: Operand>(v: View<'_, T>, rows: usize, cols: usize) -> Vec<f32> {
        let mut w = Vec::with_capacity(rows * cols);
        for i in 0..rows {
            w.extend(
                (0..cols)
                    .map(|j| bf16::from_bits(v.data[i * v.rs + j * v.cs].bf16_bits()).to_f32()),
            );
        }
        w
    }
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

/// The packed paths (AMX or `vdpbf16ps`), the output split over the pool
/// when the product is large: `block(a, rows, nb, dst, j0, nc)` computes
/// `rows` rows of the output from `a` (its first row at the block's) and
/// columns `[j0, j0 + nb)` into `dst`, an m × nb block with row stride
/// `n` inside `out`, packing the right operand `nc` columns at a time.
///
/// Each thread takes a block of columns (and packs all of the left
/// operand) or a block of rows (and packs all of the right one),
/// whichever packs fewer values: rows when the output is too narrow to
/// split its columns, or when the left operand is much the larger (a
/// weight gradient `dYᵀ · x` over the vocabulary or a wide layer's
/// inputs). Each row's bits depend on its own row of `a` alone and each
/// column's on its own column of `b`, so the split changes none.
fn packed<A: Copy + Sync>(
    m: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
    a: View<'_, A>,
    block: impl Fn(View<'_, A>, usize, usize, *mut f32, usize, usize) + Sync,
) {
    let big = m * n * k >= 64 * 64 * 64;
    let threads = rayon::current_num_threads();
    let per = if big {
        column_split(n, threads)
            .map(|p| p.next_multiple_of(NR))
            .filter(|&p| p < n)
    } else {
        None
    };
    let row_split = big && threads > 1 && m >= 2 * MC;
    let rows = m.div_ceil(threads).next_multiple_of(MC);
    // values each thread packs per block of `k`: all the rows and its
    // columns, or its rows (once, all columns at once) and all the columns
    let by_rows = row_split
        && match per {
            None => true,
            Some(p) => n <= NC_ROWS && 5 * (rows + n) < 4 * (m + p),
        };
    if by_rows {
        let dst = OutPtr(out.as_mut_ptr());
        (0..m.div_ceil(rows)).into_par_iter().for_each(|r| {
            let i0 = r * rows;
            let dst = &dst;
            let a = View {
                data: &a.data[i0 * a.rs..],
                ..a
            };
            // Rows `[i0, i0 + mr)` of the m × n output lie inside
            // `out`; the tasks' rows are disjoint, and `out` stays
            // borrowed until every task has finished.
            block(
                a,
                rows.min(m - i0),
                n,
                dst.0.wrapping_add(i0 * n),
                0,
                n.min(NC_ROWS),
            );
        });
        return;
    }
    let Some(per) = per else {
        // `out` holds m × n elements (checked by the caller) and is
        // borrowed exclusively.
        block(a, m, n, out.as_mut_ptr(), 0, NC);
        return;
    };
    let dst = OutPtr(out.as_mut_ptr());
    (0..n.div_ceil(per)).into_par_iter().for_each(|c| {
        let j0 = c * per;
        let dst = &dst;
        // Columns `[j0, j0 + nb)` of the m × n output (row stride n) lie
        // inside `out`; the tasks' blocks are disjoint, and `out` stays
        // borrowed until every task has finished.
        block(a, m, per.min(n - j0), dst.0.wrapping_add(j0), j0, NC);
    });
}

/// Columns `[j0, j0 + n)` of the product into `dst` (its first column;
/// row stride `ldc`), on `vdpbf16ps`, the right operand packed `nc_max`
/// columns at a time; without `accumulate`, the sums start from `bias`
/// (all the product's columns: `bias[j0..]` is this block's) or zero.
///
/// # Safety
/// `dst` must be valid for writes of an `m × n` block with row stride
/// `ldc`, not aliased by anything else during the call; the CPU must have
/// AVX512-BF16 (only then is `packed` called).
#[allow(clippy::too_many_arguments)]
unsafe fn packed_block<A: Operand, B: Operand>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    ldc: usize,
    accumulate: bool,
    bias: Option<&[f32]>,
    a: View<'_, A>,
    b: View<'_, B>,
    j0: usize,
    nc_max: usize,
) {
    let pairs = k.div_ceil(2);
    let kp_max = KP.min(pairs);
    // the left operand's rows packed once for every block of columns
    // when they are several and it is small enough; else a block of
    // rows at a time, for each block of columns
    let whole = n > nc_max && m.next_multiple_of(MR) * kp_max * 4 <= WHOLE_A_BYTES;
    let [mut bpk, apk] = PACKED.take();
    let mut apk32 = PACKED_A.take();
    let bp = bpk.lines(nc_max.min(n).next_multiple_of(NR) * 2 * kp_max);
    let ap = apk32.lines(if whole { m } else { MC.min(m) }.next_multiple_of(MR) * kp_max);
    for (kb, p0) in (0..pairs).step_by(KP).enumerate() {
        let kp = KP.min(pairs - p0);
        let init = match (kb == 0 && !accumulate, bias) {
            (false, _) => Init::Load,
            (true, None) => Init::Zero,
            (true, Some(bias)) => Init::Bias(bias[j0..].as_ptr()),
        };
        if whole {
            pack_a(ap, a, k, 0, m, p0, kp);
        }
        for jc in (0..n).step_by(nc_max) {
            let ncb = nc_max.min(n - jc);
            let panels = ncb.div_ceil(NR);
            pack_b(bp, b, k, j0 + jc, ncb, p0, kp);
            for i0 in (0..m).step_by(MC) {
                let mc = MC.min(m - i0);
                let ablock = if whole {
                    &ap[i0 * kp..]
                } else {
                    pack_a(ap, a, k, i0, mc, p0, kp);
                    &ap[..]
                };
                let row_panels = mc.div_ceil(MR);
                for pj in 0..panels {
                    let nc = NR.min(ncb - pj * NR);
                    let bpanel = &bp[pj * NR * 2 * kp..(pj + 1) * NR * 2 * kp];
                    for pi in 0..row_panels {
                        let mr = MR.min(mc - pi * MR);
                        let apanel = &ablock[pi * MR * kp..(pi + 1) * MR * kp];
                        // the next call's block of sums, fetched while this
                        // one computes (a hint: it may lie past the end)
                        let next = if pi + 1 < row_panels {
                            (i0 + (pi + 1) * MR) * ldc + jc + pj * NR
                        } else {
                            i0 * ldc + jc + (pj + 1) * NR
                        };
                        // SAFETY: rows `i0 + pi·MR ..+ mr` and columns
                        // `jc + pj·NR ..+ nc` lie inside the block the
                        // caller vouched for; the panels hold `kp` pairs.
                        unsafe {
                            let c = dst.add((i0 + pi * MR) * ldc + jc + pj * NR);
                            let next = dst.wrapping_add(next);
                            let init = match init {
                                Init::Bias(p) => Init::Bias(p.add(jc + pj * NR)),
                                other => other,
                            };
                            x86::kernel(kp, apanel, bpanel, c, ldc, mr, nc, init, next);
                        }
                    }
                }
            }
        }
    }
    PACKED.set([bpk, apk]);
    PACKED_A.set(apk32);
}

/// Columns `[j0, j0 + n)` of the product into `dst` (its first column;
/// row stride `ldc`), on AMX, blocked for the caches: `k` in near-equal
/// blocks of at most [`KPA`] pairs (boundaries set by `k` alone), and
/// within each a block of up to [`A_BYTES`] of the left operand packed as
/// bf16 rows (the left tiles' layout; f32 rounded as it is packed) and,
/// in turn, blocks of up to [`B_BYTES`] of the right one packed as for
/// `vdpbf16ps` (panels of [`NR`] columns, pairs along `k`: the tiles'
/// VNNI layout), zero-padded to whole tiles. Each 32 × 32 block of sums
/// is four tiles, loaded from the output between blocks of `k` (exact:
/// f32 in, f32 out, the same order of additions as one pass).
///
/// # Safety
/// As [`packed_block`], and the CPU must have AMX-BF16 with the tile
/// state granted ([`amx::usable`]); `a` and `b` must each run along rows
/// or columns.
#[allow(clippy::too_many_arguments)]
unsafe fn amx_block<A: Operand, B: Operand>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    ldc: usize,
    accumulate: bool,
    bias: Option<&[f32]>,
    a: View<'_, A>,
    pre: Option<&[u16]>,
    b: View<'_, B>,
    j0: usize,
) {
    let pairs = k.div_ceil(2).next_multiple_of(PA);
    let kpb = pairs.div_ceil(pairs.div_ceil(KPA)).next_multiple_of(PA);
    let mcb = (A_BYTES / (4 * kpb) / MA).max(1) * MA;
    let ncb = (B_BYTES / (4 * kpb) / NR).max(1) * NR;
    let [mut bpk, mut apk] = PACKED.take();
    let bp = bpk.lines(ncb.min(n.next_multiple_of(NR)) * 2 * kpb);
    let ap = if pre.is_some() {
        &mut []
    } else {
        apk.lines(mcb.min(m.next_multiple_of(MA)) * 2 * kpb)
    };
    /// An edge block of sums, in whole cache lines.
    #[repr(C, align(64))]
    struct Sums([f32; MA * NR]);
    let mut sums = Sums([0f32; MA * NR]);
    let sums = &mut sums.0;
    // SAFETY: the caller vouched for AMX; the configuration describes the
    // eight 16 × 64-byte tiles the kernel uses.
    unsafe { amx::configure() };
    for p0 in (0..pairs).step_by(kpb) {
        let kp = kpb.min(pairs - p0);
        let first = !accumulate && p0 == 0;
        let init = |col: usize| match (first, bias) {
            (false, _) => amx::Init::Load,
            (true, None) => amx::Init::Zero,
            (true, Some(bias)) => amx::Init::Bias(bias[j0 + col..].as_ptr()),
        };
        for i0 in (0..m).step_by(mcb) {
            let mc = mcb.min(m - i0);
            // rows of the block's `k` (`ra` values apart) from the
            // caller's packed rows, or packed here
            let (ablock, ra) = match pre {
                Some(pre) => (&pre[i0 * 2 * pairs + 2 * p0..], 2 * pairs),
                None => {
                    pack_rows(ap, a, k, i0, mc, mc.next_multiple_of(MA), p0, kp);
                    (&ap[..], 2 * kp)
                }
            };
            let sa = ra * 2;
            for jc in (0..n).step_by(ncb) {
                let nb = ncb.min(n - jc);
                pack_b(bp, b, k, j0 + jc, nb, p0, kp);
                for r0 in (0..mc).step_by(MA) {
                    let mr = MA.min(mc - r0);
                    let aq = ablock[r0 * ra..].as_ptr();
                    for pj in 0..nb.div_ceil(NR) {
                        let nc = NR.min(nb - pj * NR);
                        let bq = bp[pj * NR * 2 * kp..].as_ptr();
                        let c = dst.wrapping_add((i0 + r0) * ldc + jc + pj * NR);
                        if mr == MA && nc == NR {
                            // SAFETY: a whole 32 × 32 block of the caller's
                            // output; `MA` packed rows of `2·kp` values from
                            // `aq` and `kp` pairs of `NR` from `bq`; the
                            // tiles are configured.
                            // (a bias holds the product's every column:
                            // `NR` from this block's first)
                            unsafe { amx::kernel(kp, aq, sa, bq, c, ldc * 4, init(jc + pj * NR)) };
                            continue;
                        }
                        // an edge block: through `sums` (zero beyond the output)
                        sums.fill(0.0);
                        for r in 0..mr {
                            let row = &mut sums[r * NR..r * NR + nc];
                            match (first, bias) {
                                (true, None) => {}
                                (true, Some(bias)) => {
                                    let at = j0 + jc + pj * NR;
                                    row.copy_from_slice(&bias[at..at + nc]);
                                }
                                // SAFETY: row `r` of the block, its `nc`
                                // columns inside the caller's output.
                                (false, _) => row.copy_from_slice(unsafe {
                                    std::slice::from_raw_parts(c.add(r * ldc), nc)
                                }),
                            }
                        }
                        // SAFETY: `sums` is a whole block; as above.
                        unsafe {
                            amx::kernel(kp, aq, sa, bq, sums.as_mut_ptr(), NR * 4, amx::Init::Load);
                        }
                        for r in 0..mr {
                            // SAFETY: as for the loads above.
                            let row = unsafe { std::slice::from_raw_parts_mut(c.add(r * ldc), nc) };
                            row.copy_from_slice(&sums[r * NR..r * NR + nc]);
                        }
                    }
                }
            }
        }
    }
    PACKED.set([bpk, apk]);
    // SAFETY: the tiles were configured above.
    unsafe { amx::release() };
}

/// Packs pairs `[p0, p0 + kp)` of columns `[j0, j0 + n)` of `op(b)` into
/// panels of [`NR`] columns: panel-major, then pair, then column, then the
/// pair's two values (`k` = 2p, 2p + 1), zero beyond `k` and `n`.
fn pack_b<B: Operand>(
    dst: &mut [u16],
    b: View<'_, B>,
    k: usize,
    j0: usize,
    n: usize,
    p0: usize,
    kp: usize,
) {
    let panels = n.div_ceil(NR);
    let bits = |kk: usize, j: usize| b.data[kk * b.rs + (j0 + j) * b.cs].packed_bits();
    for pj in 0..panels {
        let panel = &mut dst[pj * NR * 2 * kp..(pj + 1) * NR * 2 * kp];
        let nc = NR.min(n - pj * NR);
        // pairs wholly inside `k`, then the rest (zero beyond `k`)
        let full = (k / 2).saturating_sub(p0).min(kp);
        if b.cs == 1 {
            // rows of `op(b)` contiguous along j: interleave two rows
            let src = 2 * p0 * b.rs + j0 + pj * NR;
            let mut done = 0;
            #[cfg(target_arch = "x86_64")]
            if nc == NR && full > 0 && simd() {
                done = full;
                assert!(
                    src + (2 * full - 1) * b.rs + NR <= b.data.len()
                        && full * NR * 2 <= panel.len()
                );
                // SAFETY: the vector instructions checked (`simd`); rows 2p and 2p + 1 of the
                // block hold `NR` values from `src` for p < full, and the
                // panel `full` rows of `NR` pairs (asserted).
                unsafe {
                    x86::interleave_run(panel.as_mut_ptr(), b.data.as_ptr().add(src), b.rs, full);
                };
            }
            for p in done..full {
                let k0 = 2 * (p0 + p);
                let r0 = &b.data[k0 * b.rs + j0 + pj * NR..][..nc];
                let r1 = &b.data[(k0 + 1) * b.rs + j0 + pj * NR..][..nc];
                let row = &mut panel[p * NR * 2..(p + 1) * NR * 2];
                for (c, (x, y)) in r0.iter().zip(r1).enumerate() {
                    row[2 * c] = x.packed_bits();
                    row[2 * c + 1] = y.packed_bits();
                }
                row[2 * nc..].fill(0);
            }
        } else {
            // columns contiguous along k (b.rs == 1 for a transposed view):
            // each column's pairs are adjacent values, a u32 each, and the
            // panel is their transpose: 8 × 8 blocks of them at a time
            for p in 0..full {
                panel[p * NR * 2 + 2 * nc..(p + 1) * NR * 2].fill(0);
            }
            let (ct, pt) = if simd() {
                (nc - nc % 8, full - full % 8)
            } else {
                (0, 0)
            };
            for cb in (0..ct).step_by(8) {
                let src = (j0 + pj * NR + cb) * b.cs + 2 * p0;
                assert!(
                    pt == 0
                        || (src + 7 * b.cs + 2 * pt <= b.data.len()
                            && (pt - 8) * NR * 2 + 2 * cb + 7 * NR * 2 + 16 <= panel.len())
                );
                // SAFETY: the vector instructions checked (`simd`); columns `cb ..+ 8` of the panel
                // read 16 values per block of 8 pairs from `src` (pairs
                // `[0, pt)`, inside `k`, so inside each column), and the
                // panel's rows of those pairs take 16 values each at
                // column `cb` (asserted).
                unsafe {
                    x86::transpose8_run(
                        b.data.as_ptr().add(src),
                        b.cs,
                        16,
                        panel.as_mut_ptr().add(2 * cb),
                        NR * 2,
                        8 * NR * 2,
                        pt / 8,
                    );
                }
            }
            let mut scalar = |cs: std::ops::Range<usize>, ps: std::ops::Range<usize>| {
                for c in cs {
                    for p in ps.clone() {
                        let k0 = 2 * (p0 + p);
                        let at = p * NR * 2 + 2 * c;
                        panel[at] = bits(k0, pj * NR + c);
                        panel[at + 1] = bits(k0 + 1, pj * NR + c);
                    }
                }
            };
            scalar(0..ct, pt..full);
            scalar(ct..nc, 0..full);
        }
        for p in full..kp {
            let (k0, k1) = (2 * (p0 + p), 2 * (p0 + p) + 1);
            let row = &mut panel[p * NR * 2..(p + 1) * NR * 2];
            for c in 0..NR {
                let j = pj * NR + c;
                let get = |kk: usize| if kk < k && j < n { bits(kk, j) } else { 0 };
                row[2 * c] = get(k0);
                row[2 * c + 1] = get(k1);
            }
        }
    }
}

/// Packs pairs `[p0, p0 + kp)` of rows `[i0, i0 + mc)` of `op(a)` into
/// panels of [`MR`] rows: panel-major, then pair, then row, each entry the
/// pair's two values as one u32 (`k` = 2p in the low half), zero beyond
/// `k` and the rows. Whole panels of pairs inside `k` are moved by vector
/// instructions: rows of `op(a)` along `k` (a row-major `a`) in 8 × 8
/// transposes of their u32 pairs, columns (a transposed `a`) two at a time,
/// interleaved, for every panel of the block at once.
fn pack_a<A: Operand>(
    dst: &mut [u32],
    a: View<'_, A>,
    k: usize,
    i0: usize,
    mc: usize,
    p0: usize,
    kp: usize,
) {
    let full = (k / 2).saturating_sub(p0).min(kp);
    let get = |i: usize, kk: usize| {
        if kk < k && i < mc {
            u32::from(a.data[(i0 + i) * a.rs + kk * a.cs].packed_bits())
        } else {
            0
        }
    };
    // a transposed `a` (columns of `op(a)` contiguous along i): each
    // pair of every whole panel from two runs of values along i, all the
    // whole panels at once for each pair, so that each cache line of the
    // runs is read once
    let whole = mc / MR;
    let columns = a.rs == 1 && a.cs != 1 && simd();
    if columns && full > 0 && whole > 0 {
        let first = i0 + 2 * p0 * a.cs;
        assert!(
            first + (2 * full - 1) * a.cs + whole * MR <= a.data.len()
                && whole * MR * kp <= dst.len(),
            "pack_a: columns out of bounds"
        );
        // SAFETY: the vector instructions checked (`columns`); the runs
        // and the panels asserted above.
        unsafe {
            x86::interleave_panels(
                dst.as_mut_ptr(),
                a.data.as_ptr().add(first),
                a.cs,
                full,
                whole,
                kp,
            );
        }
    }
    for pi in 0..mc.div_ceil(MR) {
        let panel = &mut dst[pi * MR * kp..(pi + 1) * MR * kp];
        // pairs `[0, done)` packed by the vector paths
        let mut done = 0;
        if (pi + 1) * MR <= mc {
            let first = (i0 + pi * MR) * a.rs + 2 * p0 * a.cs;
            if a.cs == 1 && simd() {
                done = full - full % 8;
                assert!(
                    done == 0 || first + (MR - 1) * a.rs + 2 * done <= a.data.len(),
                    "pack_a: rows out of bounds"
                );
                // SAFETY: the vector instructions checked (`simd`); row r
                // of the panel reads 16 values per block of 8 pairs from
                // `first + r·rs`, pairs inside `k` (asserted above), and
                // each block of 8 pairs of the panel takes `MR` u32 per
                // pair.
                unsafe {
                    x86::transpose8_run(
                        a.data.as_ptr().add(first),
                        a.rs,
                        16,
                        panel.as_mut_ptr().cast(),
                        2 * MR,
                        16 * MR,
                        done / 8,
                    );
                }
            } else if columns {
                done = full;
            }
        }
        for p in done..kp {
            let k0 = 2 * (p0 + p);
            for r in 0..MR {
                let i = pi * MR + r;
                panel[p * MR + r] = get(i, k0) | (get(i, k0 + 1) << 16);
            }
        }
    }
}

/// Whether the packing's vector paths run: the CPU has AVX512-BF16 with
/// AVX512-BW and -VL (every CPU with the first has the others).
fn simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Packs values `[2·p0, 2·(p0 + kp))` of rows `[i0, i0 + mc)` of `op(a)`
/// (a view along rows, `a.cs == 1`, or along columns, `a.rs == 1`) as
/// `mcp` rows of `2·kp` bf16 (the AMX left tiles' layout; f32 rounded as
/// the instructions round), zero beyond `k` and `mc`. A view along
/// columns (a weight gradient's `xᵀ`, a head's `dYᵀ`) is transposed 16 ×
/// 16 values at a time as it is read, along its stored rows.
#[allow(clippy::too_many_arguments)]
fn pack_rows<A: Operand>(
    dst: &mut [u16],
    a: View<'_, A>,
    k: usize,
    i0: usize,
    mc: usize,
    mcp: usize,
    p0: usize,
    kp: usize,
) {
    let w = 2 * kp;
    let k0 = 2 * p0;
    let live = k.saturating_sub(k0).min(w);
    if a.cs == 1 {
        for (i, row) in dst[..mcp * w].chunks_exact_mut(w).enumerate() {
            if i >= mc {
                row.fill(0);
                continue;
            }
            let (head, tail) = row.split_at_mut(live);
            tail.fill(0);
            let base = (i0 + i) * a.rs + k0;
            // SAFETY: bf16 is a transparent u16; `head` is borrowed
            // exclusively for the call.
            let head =
                unsafe { std::slice::from_raw_parts_mut(head.as_mut_ptr().cast::<bf16>(), live) };
            A::row_to_bf16(head, &a.data[base..base + live]);
        }
        return;
    }
    assert_eq!(a.rs, 1, "pack_rows: a view along rows or columns");
    let cs = a.cs;
    for (i, row) in dst[..mcp * w].chunks_exact_mut(w).enumerate() {
        row[if i >= mc { 0 } else { live }..].fill(0);
    }
    // whole 16 × 16 blocks by the vector transpose, along the stored rows
    let (ie, ce) = if simd() {
        (mc - mc % 16, live - live % 16)
    } else {
        (0, 0)
    };
    #[cfg(target_arch = "x86_64")]
    for cb in (0..ce).step_by(16) {
        for ib in (0..ie).step_by(16) {
            let src = (i0 + ib) + (k0 + cb) * cs;
            let at = ib * w + cb;
            assert!(src + 15 * cs + 16 <= a.data.len() && at + 15 * w + 16 <= dst.len());
            // SAFETY: the vector instructions checked (`simd`); values k0 +
            // cb ..+ 16 of `op(a)` hold 16 rows from `src + c·cs`, and the
            // packed rows ib ..+ 16 take 16 values each from `at + r·w`
            // (asserted).
            unsafe { x86::transpose16(a.data.as_ptr().add(src), cs, dst.as_mut_ptr().add(at), w) };
        }
    }
    // the edges a value at a time
    let mut by_value = |rows: std::ops::Range<usize>, cols: std::ops::Range<usize>| {
        for c in cols {
            for i in rows.clone() {
                dst[i * w + c] = a.data[(i0 + i) + (k0 + c) * cs].packed_bits();
            }
        }
    };
    by_value(0..mc, ce..live);
    by_value(ie..mc, 0..ce);
}

/// Where the micro-kernel's block of sums starts.
#[derive(Clone, Copy, Debug)]
enum Init {
    /// From zero.
    Zero,
    /// From the output block (accumulating).
    Load,
    /// From the bias values of the block's columns, in every row.
    Bias(*const f32),
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m128bh, __m128i, __m256, __m256bh, __m256i, __m512i, _MM_HINT_ET0, _mm_loadu_si128,
        _mm_prefetch, _mm_storeu_si128, _mm_unpackhi_epi16, _mm_unpacklo_epi16,
        _mm256_castps_si256, _mm256_castsi256_ps, _mm256_cvtneps_pbh, _mm256_loadu_ps,
        _mm256_loadu_si256, _mm256_permute2f128_ps, _mm256_permute2x128_si256, _mm256_shuffle_ps,
        _mm256_storeu_si256, _mm256_unpackhi_epi16, _mm256_unpackhi_epi32, _mm256_unpackhi_epi64,
        _mm256_unpackhi_ps, _mm256_unpacklo_epi16, _mm256_unpacklo_epi32, _mm256_unpacklo_epi64,
        _mm256_unpacklo_ps, _mm512_cvtepu16_epi32, _mm512_cvtneps_pbh, _mm512_loadu_ps,
        _mm512_mask_loadu_ps, _mm512_mask_storeu_ps, _mm512_or_si512, _mm512_setzero_ps,
        _mm512_slli_epi32, _mm512_storeu_ps, _mm512_storeu_si512,
    };

    use weft_numerics::bf16;

    use super::{Init, MR, NR};

    /// 16 consecutive values from `p` as bf16 bits: bf16 as they are, f32
    /// rounded by `vcvtneps2bf16`.
    ///
    /// # Safety
    /// Inlined only into the packing functions below (their target
    /// features); `p` valid for reads of 16 values.
    #[inline(always)]
    unsafe fn load16<T>(p: *const T) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe {
            if size_of::<T>() == 4 {
                std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(
                    p.cast(),
                )))
            } else {
                _mm256_loadu_si256(p.cast())
            }
        }
    }

    /// 8 consecutive values from `p` as bf16 bits, as [`load16`].
    ///
    /// # Safety
    /// As [`load16`], for 8 values.
    #[inline(always)]
    unsafe fn load8<T>(p: *const T) -> __m128i {
        // SAFETY: the caller's contract.
        unsafe {
            if size_of::<T>() == 4 {
                std::mem::transmute::<__m128bh, __m128i>(_mm256_cvtneps_pbh(_mm256_loadu_ps(
                    p.cast(),
                )))
            } else {
                _mm_loadu_si128(p.cast())
            }
        }
    }

    /// Row p < `pairs` of a packed right panel, `(r0[0], r1[0], r0[1],
    /// r1[1], …)` at `panel + p·2·NR`, from rows `r0 = src + 2p·rs` and
    /// `r1 = r0 + rs` of [`NR`] values each (`T` bf16, or f32 rounded).
    ///
    /// # Safety
    /// The CPU must have the features of [`super::simd`]; those rows must
    /// be valid for reads of `NR` values and `panel` for writes of
    /// `pairs · 2 · NR`.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn interleave_run<T>(
        panel: *mut u16,
        src: *const T,
        rs: usize,
        pairs: usize,
    ) {
        for p in 0..pairs {
            for h in 0..NR / 16 {
                // SAFETY: the caller's contract: 16 values at `16h` of
                // each row, 32 of the panel's row p at `32h`.
                unsafe {
                    let r0 = src.add(2 * p * rs + 16 * h);
                    let lo = _mm512_cvtepu16_epi32(load16(r0));
                    let hi = _mm512_cvtepu16_epi32(load16(r0.add(rs)));
                    let pairs = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi));
                    _mm512_storeu_si512(panel.add(2 * NR * p + 32 * h).cast::<__m512i>(), pairs);
                }
            }
        }
    }

    /// `dst[q·ds ..+ 16] = column q` of the 8 × 8 block of u32 (pairs of
    /// bf16) whose row `r` is the 16 values at `src + r·ss` as bf16: a
    /// transpose of pairs.
    ///
    /// # Safety
    /// The CPU must have the features of [`super::simd`]; `src + r·ss` must
    /// be valid for reads of 16 values and `dst + q·ds` for writes of 16,
    /// for r, q < 8.
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn transpose8<T>(src: *const T, ss: usize, dst: *mut u16, ds: usize) {
        // SAFETY: the caller's contract.
        let row = |r: usize| unsafe { _mm256_castsi256_ps(load16(src.add(r * ss))) };
        let r: [__m256; 8] = std::array::from_fn(row);
        let t = [
            _mm256_unpacklo_ps(r[0], r[1]),
            _mm256_unpackhi_ps(r[0], r[1]),
            _mm256_unpacklo_ps(r[2], r[3]),
            _mm256_unpackhi_ps(r[2], r[3]),
            _mm256_unpacklo_ps(r[4], r[5]),
            _mm256_unpackhi_ps(r[4], r[5]),
            _mm256_unpacklo_ps(r[6], r[7]),
            _mm256_unpackhi_ps(r[6], r[7]),
        ];
        let u = [
            _mm256_shuffle_ps::<0x44>(t[0], t[2]),
            _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
            _mm256_shuffle_ps::<0x44>(t[1], t[3]),
            _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
            _mm256_shuffle_ps::<0x44>(t[4], t[6]),
            _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
            _mm256_shuffle_ps::<0x44>(t[5], t[7]),
            _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
        ];
        for q in 0..4 {
            let lo = _mm256_permute2f128_ps::<0x20>(u[q], u[q + 4]);
            let hi = _mm256_permute2f128_ps::<0x31>(u[q], u[q + 4]);
            // SAFETY: the caller's contract (rows q and q + 4 of `dst`).
            unsafe {
                _mm256_storeu_si256(dst.add(q * ds).cast(), _mm256_castps_si256(lo));
                _mm256_storeu_si256(dst.add((q + 4) * ds).cast(), _mm256_castps_si256(hi));
            }
        }
    }

    /// `dst[i·ds ..+ 16] = column i` of the 16 × 16 block whose row `j`
    /// is the 16 values at `src + j·ss` as bf16: a transpose of 16-bit
    /// values, in four rounds of interleaves (16-, 32-, 64-bit, then the
    /// 128-bit halves).
    ///
    /// # Safety
    /// The CPU must have the features of [`super::simd`]; `src + j·ss`
    /// must be valid for reads of 16 values and `dst + i·ds` for writes
    /// of 16, for i, j < 16.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn transpose16<T>(src: *const T, ss: usize, dst: *mut u16, ds: usize) {
        // SAFETY: the caller's contract.
        let r: [__m256i; 16] = std::array::from_fn(|j| unsafe { load16(src.add(j * ss)) });
        // rows 2k, 2k + 1 interleaved: values 0–3 | 8–11, then 4–7 | 12–15
        let a: [__m256i; 16] = std::array::from_fn(|x| {
            let (k, hi) = (x / 2, x % 2 == 1);
            if hi {
                _mm256_unpackhi_epi16(r[2 * k], r[2 * k + 1])
            } else {
                _mm256_unpacklo_epi16(r[2 * k], r[2 * k + 1])
            }
        });
        // rows 4g ..+ 4 of value pairs (0, 1 | 8, 9), (2, 3 | 10, 11),
        // (4, 5 | 12, 13), (6, 7 | 14, 15)
        let b: [__m256i; 16] = std::array::from_fn(|x| {
            let (g, t) = (x / 4, x % 4);
            let (p, q) = (a[4 * g + t / 2], a[4 * g + 2 + t / 2]);
            if t % 2 == 1 {
                _mm256_unpackhi_epi32(p, q)
            } else {
                _mm256_unpacklo_epi32(p, q)
            }
        });
        // rows 8h ..+ 8 of value e (low half) and e + 8 (high half) at 8h + e
        let c: [__m256i; 16] = std::array::from_fn(|x| {
            let (h, e) = (x / 8, x % 8);
            let (p, q) = (b[8 * h + e / 2], b[8 * h + 4 + e / 2]);
            if e % 2 == 1 {
                _mm256_unpackhi_epi64(p, q)
            } else {
                _mm256_unpacklo_epi64(p, q)
            }
        });
        for e in 0..8 {
            let lo = _mm256_permute2x128_si256::<0x20>(c[e], c[8 + e]);
            let hi = _mm256_permute2x128_si256::<0x31>(c[e], c[8 + e]);
            // SAFETY: the caller's contract (rows e and e + 8 of `dst`).
            unsafe {
                _mm256_storeu_si256(dst.add(e * ds).cast(), lo);
                _mm256_storeu_si256(dst.add((e + 8) * ds).cast(), hi);
            }
        }
    }

    /// [`transpose8`] of `tiles` blocks, the t-th from `src + t·src_step`
    /// into `dst + t·dst_step`.
    ///
    /// # Safety
    /// As [`transpose8`] for every block.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn transpose8_run<T>(
        src: *const T,
        ss: usize,
        src_step: usize,
        dst: *mut u16,
        ds: usize,
        dst_step: usize,
        tiles: usize,
    ) {
        for t in 0..tiles {
            // SAFETY: the caller's contract.
            unsafe { transpose8(src.add(t * src_step), ss, dst.add(t * dst_step), ds) };
        }
    }

    /// Pairs `[0, pairs)` of `panels` whole left panels of [`MR`] rows
    /// (panel q at `dst + q·MR·kp`, pair p's `MR` u32 at `p·MR`) from a
    /// transposed operand: pair p of rows `q·MR ..+ MR` is
    /// `src[2p·cs + i] | src[(2p + 1)·cs + i] << 16` (as bf16).
    ///
    /// # Safety
    /// The CPU must have the features of [`super::simd`]; `src` must be
    /// valid for reads of `panels · MR` values at `2p·cs` and `(2p + 1)·cs`
    /// for p < `pairs`, `dst` for writes of `panels · MR · kp` u32.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn interleave_panels<T>(
        dst: *mut u32,
        src: *const T,
        cs: usize,
        pairs: usize,
        panels: usize,
        kp: usize,
    ) {
        for p in 0..pairs {
            let at = 2 * p * cs;
            for q in 0..panels {
                // SAFETY: the caller's contract.
                unsafe {
                    let x = load8(src.add(at + q * MR));
                    let y = load8(src.add(at + cs + q * MR));
                    let d = dst.add(q * MR * kp + p * MR);
                    _mm_storeu_si128(d.cast(), _mm_unpacklo_epi16(x, y));
                    _mm_storeu_si128(d.add(4).cast(), _mm_unpackhi_epi16(x, y));
                }
            }
        }
    }

    /// `d = s` rounded to bf16 (ties to even, subnormal inputs as zero),
    /// sixteen at a time.
    ///
    /// # Safety
    /// The CPU must have AVX512-BF16 and AVX-512F.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn round(d: &mut [bf16], s: &[f32]) {
        let n = d.len().min(s.len());
        let whole = n - n % 16;
        for i in (0..whole).step_by(16) {
            // SAFETY: elements `i ..+ 16` of both slices exist (`i + 16 <=
            // whole <= n`); bf16 is a transparent u16.
            unsafe {
                let v = _mm512_cvtneps_pbh(_mm512_loadu_ps(s.as_ptr().add(i)));
                _mm256_storeu_si256(
                    d.as_mut_ptr().add(i).cast::<__m256i>(),
                    std::mem::transmute::<__m256bh, __m256i>(v),
                );
            }
        }
        for i in whole..n {
            d[i] = super::as_instruction_rounds(s[i]);
        }
    }

    /// The mask of the first `n` (≤ 16) lanes.
    fn lanes(n: usize) -> u16 {
        if n >= 16 { u16::MAX } else { (1u16 << n) - 1 }
    }

    /// `c (mr × nc, row stride ldc) = [c +] Σ_p a_p ⊗ b_p` over `kp` pairs
    /// of one packed panel each (`first`: start from zero, else from `c`).
    /// `next`, the next call's block of sums (same stride), is prefetched:
    /// a block of a large output is otherwise a cache miss per row at the
    /// start and the end of every call (a hint; any address will do).
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
        init: Init,
        next: *const f32,
    ) {
        debug_assert!(a.len() >= MR * kp && b.len() >= NR * 2 * kp);
        for r in 0..MR {
            let row = next.wrapping_add(r * ldc).cast::<i8>();
            // a prefetch reads nothing and never faults, whatever the
            // address
            _mm_prefetch::<_MM_HINT_ET0>(row);
            _mm_prefetch::<_MM_HINT_ET0>(row.wrapping_add(64));
        }
        let (m0, m1) = (lanes(nc), lanes(nc.saturating_sub(16)));
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        match init {
            Init::Zero => {}
            Init::Load => {
                for r in 0..mr {
                    // SAFETY: row `r < mr` of `c`, the masked lanes `< nc`.
                    unsafe {
                        let row = c.add(r * ldc);
                        acc[r][0] = _mm512_mask_loadu_ps(_mm512_setzero_ps(), m0, row);
                        acc[r][1] = _mm512_mask_loadu_ps(_mm512_setzero_ps(), m1, row.add(16));
                    }
                }
            }
            Init::Bias(p) => {
                // SAFETY: the caller's `nc` values of the bias, the masked
                // lanes `< nc`.
                let v = unsafe {
                    [
                        _mm512_mask_loadu_ps(_mm512_setzero_ps(), m0, p),
                        _mm512_mask_loadu_ps(_mm512_setzero_ps(), m1, p.add(16)),
                    ]
                };
                acc = [v; MR];
            }
        }
        // the assembly below is written for this block's shape
        const { assert!(MR == 8 && NR == 32) };
        if kp > 0 {
            let [
                [mut c00, mut c01],
                [mut c10, mut c11],
                [mut c20, mut c21],
                [mut c30, mut c31],
                [mut c40, mut c41],
                [mut c50, mut c51],
                [mut c60, mut c61],
                [mut c70, mut c71],
            ] = acc;
            // Pair p of the panels: two vectors of `b` and each row's u32
            // of `a` broadcast by the product's own load (`{1to16}`), not
            // by an instruction of its own. `b · a` is `a · b`: each lane
            // sums the same two exact products in the same order.
            //
            // SAFETY: the CPU has AVX512-BF16 (this function's features);
            // the loop reads `kp` pairs: `MR` u32 of `a` and `NR · 2` bf16
            // of `b` per pair, inside the panels (asserted in debug,
            // vouched for by the caller).
            unsafe {
                std::arch::asm!(
                    "2:",
                    "vmovups {b0}, zmmword ptr [{bp}]",
                    "vmovups {b1}, zmmword ptr [{bp} + 64]",
                    "vdpbf16ps {c00}, {b0}, dword ptr [{ap}]{{1to16}}",
                    "vdpbf16ps {c01}, {b1}, dword ptr [{ap}]{{1to16}}",
                    "vdpbf16ps {c10}, {b0}, dword ptr [{ap} + 4]{{1to16}}",
                    "vdpbf16ps {c11}, {b1}, dword ptr [{ap} + 4]{{1to16}}",
                    "vdpbf16ps {c20}, {b0}, dword ptr [{ap} + 8]{{1to16}}",
                    "vdpbf16ps {c21}, {b1}, dword ptr [{ap} + 8]{{1to16}}",
                    "vdpbf16ps {c30}, {b0}, dword ptr [{ap} + 12]{{1to16}}",
                    "vdpbf16ps {c31}, {b1}, dword ptr [{ap} + 12]{{1to16}}",
                    "vdpbf16ps {c40}, {b0}, dword ptr [{ap} + 16]{{1to16}}",
                    "vdpbf16ps {c41}, {b1}, dword ptr [{ap} + 16]{{1to16}}",
                    "vdpbf16ps {c50}, {b0}, dword ptr [{ap} + 20]{{1to16}}",
                    "vdpbf16ps {c51}, {b1}, dword ptr [{ap} + 20]{{1to16}}",
                    "vdpbf16ps {c60}, {b0}, dword ptr [{ap} + 24]{{1to16}}",
                    "vdpbf16ps {c61}, {b1}, dword ptr [{ap} + 24]{{1to16}}",
                    "vdpbf16ps {c70}, {b0}, dword ptr [{ap} + 28]{{1to16}}",
                    "vdpbf16ps {c71}, {b1}, dword ptr [{ap} + 28]{{1to16}}",
                    "add {ap}, 32",
                    "add {bp}, 128",
                    "dec {n}",
                    "jnz 2b",
                    ap = inout(reg) a.as_ptr() => _,
                    bp = inout(reg) b.as_ptr() => _,
                    n = inout(reg) kp => _,
                    b0 = out(zmm_reg) _,
                    b1 = out(zmm_reg) _,
                    c00 = inout(zmm_reg) c00,
                    c01 = inout(zmm_reg) c01,
                    c10 = inout(zmm_reg) c10,
                    c11 = inout(zmm_reg) c11,
                    c20 = inout(zmm_reg) c20,
                    c21 = inout(zmm_reg) c21,
                    c30 = inout(zmm_reg) c30,
                    c31 = inout(zmm_reg) c31,
                    c40 = inout(zmm_reg) c40,
                    c41 = inout(zmm_reg) c41,
                    c50 = inout(zmm_reg) c50,
                    c51 = inout(zmm_reg) c51,
                    c60 = inout(zmm_reg) c60,
                    c61 = inout(zmm_reg) c61,
                    c70 = inout(zmm_reg) c70,
                    c71 = inout(zmm_reg) c71,
                    options(nostack, readonly),
                );
            }
            acc = [
                [c00, c01],
                [c10, c11],
                [c20, c21],
                [c30, c31],
                [c40, c41],
                [c50, c51],
                [c60, c61],
                [c70, c71],
            ];
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
    use super::Init;

    /// Never called off x86-64 ([`super::simd`] is false there).
    pub(super) unsafe fn interleave_run<T>(
        _panel: *mut u16,
        _src: *const T,
        _rs: usize,
        _pairs: usize,
    ) {
        unreachable!("AVX-512 off x86-64");
    }
    /// Never called off x86-64.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn transpose8_run<T>(
        _src: *const T,
        _ss: usize,
        _src_step: usize,
        _dst: *mut u16,
        _ds: usize,
        _dst_step: usize,
        _tiles: usize,
    ) {
        unreachable!("AVX-512 off x86-64");
    }
    /// Never called off x86-64.
    pub(super) unsafe fn interleave_panels<T>(
        _dst: *mut u32,
        _src: *const T,
        _cs: usize,
        _pairs: usize,
        _panels: usize,
        _kp: usize,
    ) {
        unreachable!("AVX-512 off x86-64");
    }
    /// Never called: AVX512-BF16 is x86-64's.
    pub(super) unsafe fn round(_d: &mut [weft_numerics::bf16], _s: &[f32]) {
        unreachable!("vcvtneps2bf16 off x86-64");
    }

    /// Never called: [`super::bf16_path`] is portable off x86-64.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn kernel(
        _kp: usize,
        _a: &[u32],
        _b: &[u16],
        _c: *mut f32,
        _ldc: usize,
        _mr: usize,
        _nc: usize,
        _init: Init,
        _next: *const f32,
    ) {
        unreachable!("the vdpbf16ps kernel off x86-64");
    }
}

/// AMX through inline assembly (the tile intrinsics are not stable Rust).
#[cfg(target_arch = "x86_64")]
mod amx {
    use std::arch::asm;
    use std::sync::OnceLock;

    use super::{NR, PA};

    /// Whether the CPU has AMX-TILE and AMX-BF16 and Linux granted this
    /// process the tile-data state (requested here, once).
    pub(super) fn usable() -> bool {
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| {
            // CPUID leaf 7 exists on every x86-64 CPU with AVX-512.
            let id = std::arch::x86_64::__cpuid_count(7, 0);
            let cpu = (id.edx >> 22) & 1 == 1 && (id.edx >> 24) & 1 == 1;
            cpu && request_tile_data()
        })
    }

    /// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, then
    /// `ARCH_GET_XCOMP_PERM` to see it granted.
    #[cfg(target_os = "linux")]
    fn request_tile_data() -> bool {
        const ARCH_PRCTL: i64 = 158;
        const GET_PERM: i64 = 0x1022;
        const REQ_PERM: i64 = 0x1023;
        const XTILEDATA: i64 = 18;
        let req: i64;
        // SAFETY: a plain system call; it reads no memory.
        unsafe {
            asm!("syscall", inlateout("rax") ARCH_PRCTL => req, in("rdi") REQ_PERM,
                 in("rsi") XTILEDATA, lateout("rcx") _, lateout("r11") _, options(nostack));
        }
        if req != 0 {
            return false;
        }
        let mut perm = 0u64;
        let got: i64;
        // SAFETY: the kernel writes one u64 to `perm`, which outlives the call.
        unsafe {
            asm!("syscall", inlateout("rax") ARCH_PRCTL => got, in("rdi") GET_PERM,
                 in("rsi") &raw mut perm, lateout("rcx") _, lateout("r11") _, options(nostack));
        }
        got == 0 && (perm >> XTILEDATA) & 1 == 1
    }

    #[cfg(not(target_os = "linux"))]
    fn request_tile_data() -> bool {
        false
    }

    /// The tile configuration: palette 1, tiles 0–7 of 16 rows × 64 bytes.
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    /// Loads the tile configuration on this thread.
    ///
    /// # Safety
    /// [`usable`] must be true.
    pub(super) unsafe fn configure() {
        let mut c = Config([0; 64]);
        c.0[0] = 1;
        for t in 0..8 {
            c.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
            c.0[48 + t] = 16;
        }
        // SAFETY: a valid palette-1 configuration, 64 bytes.
        unsafe { asm!("ldtilecfg [{0}]", in(reg) c.0.as_ptr(), options(nostack, readonly)) };
    }

    /// Releases the tile state on this thread.
    ///
    /// # Safety
    /// After [`configure`] on this thread.
    pub(super) unsafe fn release() {
        // SAFETY: the tiles are configured.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// Where a block of sums starts.
    #[derive(Clone, Copy, Debug)]
    pub(super) enum Init {
        /// From zero.
        Zero,
        /// From the output block (accumulating).
        Load,
        /// From [`NR`] bias values, in every row (tiles loaded with a row
        /// stride of zero).
        Bias(*const f32),
    }

    /// `c (MA × NR f32, rows `ldc` bytes apart) = [c | bias | 0] + a · b`
    /// over `kp` pairs, as `init` says: `a` points at `MA` rows of `2·kp`
    /// bf16, `sa` bytes apart, `b` at `kp` rows of `NR` pairs.
    ///
    /// # Safety
    /// After [`configure`] on this thread; `kp` a multiple of [`PA`]; `a`
    /// and `b` valid for those reads; `c` valid for reads and writes of
    /// `MA` rows of `NR` f32, `ldc` bytes apart; a bias valid for reads of
    /// `NR` values.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn kernel(
        kp: usize,
        a: *const u16,
        sa: usize,
        b: *const u16,
        c: *mut f32,
        ldc: usize,
        init: Init,
    ) {
        debug_assert!(kp.is_multiple_of(PA));
        let cs = ldc;
        // SAFETY: the four 16 × 16 quarters of `c` (the caller vouched),
        // or the bias's two halves.
        unsafe {
            let (c1, c2) = (c.add(16), c.byte_add(16 * cs));
            let c3 = c2.add(16);
            if let Init::Bias(p) = init {
                asm!(
                    "tileloadd tmm0, [{p} + {zero}*1]",
                    "tileloadd tmm1, [{p1} + {zero}*1]",
                    "tileloadd tmm2, [{p} + {zero}*1]",
                    "tileloadd tmm3, [{p1} + {zero}*1]",
                    p = in(reg) p, p1 = in(reg) p.add(16), zero = in(reg) 0usize,
                    options(nostack, readonly)
                );
            } else if let Init::Zero = init {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack, nomem)
                );
            } else {
                asm!(
                    "tileloadd tmm0, [{c} + {cs}*1]",
                    "tileloadd tmm1, [{c1} + {cs}*1]",
                    "tileloadd tmm2, [{c2} + {cs}*1]",
                    "tileloadd tmm3, [{c3} + {cs}*1]",
                    c = in(reg) c, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3,
                    cs = in(reg) cs, options(nostack, readonly)
                );
            }
        }
        let sb = NR * 2 * 2; // bytes per pair of b
        for q in 0..kp / PA {
            // SAFETY: rows 0–15 and 16–31 of `a`, values `32q ..+ 32`;
            // pairs `16q ..+ 16` of `b`, columns 0–15 and 16–31 — inside
            // what the caller vouched for.
            unsafe {
                let a0 = a.add(q * 2 * PA);
                let a1 = a0.byte_add(16 * sa);
                let b0 = b.add(q * PA * NR * 2);
                let b1 = b0.add(32);
                asm!(
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tileloadd tmm6, [{b0} + {sb}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{b1} + {sb}*1]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tileloadd tmm5, [{a1} + {sa}*1]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a0, a1 = in(reg) a1, b0 = in(reg) b0, b1 = in(reg) b1,
                    sa = in(reg) sa, sb = in(reg) sb, options(nostack, readonly)
                );
            }
        }
        // SAFETY: as for the loads.
        unsafe {
            let (c1, c2) = (c.add(16), c.byte_add(16 * cs));
            let c3 = c2.add(16);
            asm!(
                "tilestored [{c} + {cs}*1], tmm0",
                "tilestored [{c1} + {cs}*1], tmm1",
                "tilestored [{c2} + {cs}*1], tmm2",
                "tilestored [{c3} + {cs}*1], tmm3",
                c = in(reg) c, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3,
                cs = in(reg) cs, options(nostack)
            );
        }
    }

    /// `iters` rounds of four independent `tdpbf16ps` on resident tiles
    /// (zeros: the rate does not depend on the values).
    ///
    /// # Safety
    /// After [`configure`] on this thread.
    pub(super) unsafe fn peak(iters: usize) {
        // SAFETY: configured tiles, no memory operands.
        unsafe {
            asm!(
                "tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3",
                "tilezero tmm4", "tilezero tmm5", "tilezero tmm6", "tilezero tmm7",
                "2:",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) iters.max(1) => _, options(nostack, nomem)
            );
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod amx {
    /// As on x86-64.
    #[derive(Clone, Copy, Debug)]
    pub(super) enum Init {
        Zero,
        Load,
        Bias(*const f32),
    }
    /// AMX is x86-64's.
    pub(super) fn usable() -> bool {
        false
    }
    pub(super) unsafe fn configure() {}
    pub(super) unsafe fn release() {}
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn kernel(
        _kp: usize,
        _a: *const u16,
        _sa: usize,
        _b: *const u16,
        _c: *mut f32,
        _ldc: usize,
        _init: Init,
    ) {
        unreachable!("AMX off x86-64");
    }
    pub(super) unsafe fn peak(_iters: usize) {}
}

/// The measured bf16 peak of [`bf16_path`]'s instruction, `threads`
/// threads at once, in GFLOP/s (a multiply and an add count as two), best
/// of `reps` runs, like [`fma_peak_gflops`](crate::fma_peak_gflops) for
/// f32: the denominator of "percent of bf16 peak". On AMX, chains of
/// `tdpbf16ps` on resident tiles; on AVX512-BF16, of `vdpbf16ps`; `None`
/// on the portable path.
///
/// ```no_run
/// if let Some(peak) = weft_kernels::bf16_dot_peak_gflops(2, 3) {
///     assert!(peak > 0.0);
/// }
/// ```
#[must_use]
pub fn bf16_dot_peak_gflops(threads: usize, reps: usize) -> Option<f64> {
    let path = bf16_path();
    if path == Bf16Path::Portable {
        return None;
    }
    let threads = threads.max(1);
    let (iters, flops_per_iter) = match path {
        // four 16 × 16 tiles, 32 products deep
        Bf16Path::Amx => (200_000usize, 4 * 16 * 16 * 32 * 2),
        _ => (10_000_000, peak::CHAINS * 16 * 4),
    };
    let mut best = 0.0f64;
    for _ in 0..reps.max(1) {
        let start = std::time::Instant::now();
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    // SAFETY: `bf16_path` found the instruction usable.
                    unsafe {
                        if path == Bf16Path::Amx {
                            amx::configure();
                            amx::peak(iters);
                            amx::release();
                        } else {
                            std::hint::black_box(peak::chains(iters));
                        }
                    }
                });
            }
        });
        let secs = start.elapsed().as_secs_f64();
        #[allow(clippy::cast_precision_loss)]
        let flops = (threads * iters * flops_per_iter) as f64;
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

    /// `matmul_bf16` on `path`.
    #[allow(clippy::too_many_arguments)]
    fn on(
        path: Bf16Path,
        out: &mut [f32],
        a: &[bf16],
        a_t: bool,
        b: &[bf16],
        b_t: bool,
        m: usize,
        n: usize,
        k: usize,
        acc: bool,
    ) {
        let av = if a_t { View::t(a, m) } else { View::rows(a, k) };
        let bv = if b_t { View::t(b, k) } else { View::rows(b, n) };
        product_on(path, m, n, k, out, acc, av, bv);
    }

    /// Checks one product against an f64 reference of the same bf16
    /// values: |err| ≤ (k + 2) · 2⁻²⁴ · Σ|aᵢbᵢ| per element (the bound of
    /// k sequential f32 additions, plus the accumulated output).
    #[allow(clippy::too_many_arguments)]
    fn check_one(
        path: Bf16Path,
        m: usize,
        n: usize,
        k: usize,
        a_t: bool,
        b_t: bool,
        acc: bool,
        seed: u64,
    ) {
        let a = values(m * k, seed);
        let b = values(k * n, seed + 1);
        let init: Vec<f32> = values(m * n, seed + 2).iter().map(|x| x.to_f32()).collect();
        let mut out = if acc {
            init.clone()
        } else {
            vec![f32::NAN; m * n]
        };
        on(path, &mut out, &a, a_t, &b, b_t, m, n, k, acc);
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
                    "{path:?} {m}×{n}×{k} a_t={a_t} b_t={b_t} acc={acc} at ({i},{j}): {} vs {exact} (err {err:e}, bound {bound:e})",
                    out[i * n + j]
                );
            }
        }
    }

    /// Prints (past the harness's capture) each bf16 path this machine
    /// cannot test, its CPU (or OS) lacking what the path needs, as a line
    /// `UNTESTED: ...`, which the test command lists. (A path `WEFT_SIMD`
    /// caps is not listed: the uncapped run tests it.)
    fn untested_paths() {
        #[cfg(target_arch = "x86_64")]
        let dot = std::arch::is_x86_feature_detected!("avx512bf16");
        #[cfg(not(target_arch = "x86_64"))]
        let dot = false;
        for (path, has, needs) in [
            (
                Bf16Path::Amx,
                amx::usable(),
                "AMX-BF16 with the OS's tile state",
            ),
            (Bf16Path::Avx512Bf16, dot, "AVX512-BF16"),
        ] {
            if !has {
                let line = format!(
                    "UNTESTED: the {} bf16 GEMM path: this machine lacks {needs}\n",
                    path.name()
                );
                let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            }
        }
    }

    #[test]
    fn every_layout_and_remainder_matches_an_f64_reference() {
        // remainders of MR (8), NR (32) and the pair (odd k), k past one
        // packed block (KP pairs = 1024 values), columns past two (NC =
        // 512) with the rows packed once and per block of columns, and
        // panels moved by the vector paths (8 pairs, 8 rows or
        // columns) beside edges that are not
        let shapes = [
            (1, 1, 1),
            (3, 5, 7),
            (8, 32, 2),
            (9, 33, 3),
            (17, 70, 64),
            (130, 40, 31),
            (5, 3, 1100),
            (64, 64, 2049),
            (9, 1100, 40),
            (70, 600, 100),
        ];
        untested_paths();
        for path in available_paths() {
            for (s, &(m, n, k)) in shapes.iter().enumerate() {
                for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
                    for acc in [false, true] {
                        check_one(path, m, n, k, a_t, b_t, acc, s as u64 * 7 + 1);
                    }
                }
            }
        }
    }

    /// Sums started from a bias give the bits of accumulating into copies
    /// of it, on this machine's path: remainders of the block (rows,
    /// columns, odd `k`), past one packed block of `k` and of columns,
    /// split over the pool by columns and by rows, either operand
    /// transposed.
    #[test]
    fn bias_started_sums_equal_accumulating_into_the_bias() {
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let shapes = [
            (1, 1, 1),
            (9, 33, 3),
            (17, 70, 64),
            (5, 3, 1100),
            (70, 600, 100),
            (150, 300, 777),
            (9, 1100, 40),
            (1500, 600, 70),
        ];
        for (s, &(m, n, k)) in shapes.iter().enumerate() {
            for (a_t, b_t) in [(false, false), (true, false), (false, true)] {
                let seed = s as u64 * 5;
                let a = values(m * k, seed + 1);
                let b = values(k * n, seed + 2);
                let bias: Vec<f32> = values(n, seed + 3).iter().map(|x| x.to_f32()).collect();
                let av = if a_t {
                    View::t(&a, m)
                } else {
                    View::rows(&a, k)
                };
                let bv = if b_t {
                    View::t(&b, k)
                } else {
                    View::rows(&b, n)
                };
                let mut want = vec![0f32; m * n];
                for row in want.chunks_exact_mut(n) {
                    row.copy_from_slice(&bias);
                }
                product(m, n, k, &mut want, true, av, bv);
                let mut got = vec![f32::NAN; m * n];
                product_with_bias(m, n, k, &mut got, &bias, av, bv);
                assert_eq!(bits(&got), bits(&want), "{m}×{n}×{k} a_t={a_t} b_t={b_t}");
            }
        }
    }

    #[test]
    fn rows_do_not_depend_on_the_batch_nor_on_threads() {
        // rows past one packed block (MC = 128) and past AMX's 32; a
        // narrow output whose rows, not columns, are split over the pool;
        // a tall one whose rows are split because its left operand is
        // the larger, its right packed past NC columns at once
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (path, (m, n, k)) in available_paths().into_iter().flat_map(|p| {
            [
                (p, (150, 300, 777)),
                (p, (600, 48, 300)),
                (p, (1500, 600, 70)),
            ]
        }) {
            let a = values(m * k, 3);
            let b = values(k * n, 4);
            let mut all = vec![0f32; m * n];
            on(path, &mut all, &a, false, &b, false, m, n, k, false);
            for i in [0, 8, 36, 131, 149, m - 1] {
                let mut one = vec![0f32; n];
                on(
                    path,
                    &mut one,
                    &a[i * k..(i + 1) * k],
                    false,
                    &b,
                    false,
                    1,
                    n,
                    k,
                    false,
                );
                assert_eq!(
                    bits(&one),
                    bits(&all[i * n..(i + 1) * n]),
                    "{path:?} row {i}"
                );
            }
            // one thread gives the bits of the pool
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            let mut single = vec![0f32; m * n];
            pool.install(|| on(path, &mut single, &a, false, &b, false, m, n, k, false));
            assert_eq!(bits(&single), bits(&all), "{path:?} threads");
        }
    }

    /// f32 operands rounded as they are packed (or in one pass, on AMX)
    /// give the bits of bf16 operands rounded element by element, on every
    /// path, in every layout: vector body and scalar edges alike, columns
    /// past one block, and subnormal values (which the instruction paths
    /// take as zero either way) among them.
    #[test]
    fn f32_operands_are_rounded_to_nearest_even() {
        for (s, (m, n, k)) in [(40, 70, 90), (9, 1100, 40), (70, 600, 100)]
            .into_iter()
            .enumerate()
        {
            f32_operands_round_at(m, n, k, s as u64);
        }
    }

    fn f32_operands_round_at(m: usize, n: usize, k: usize, seed: u64) {
        // every 97th value subnormal, well inside the range (a value that
        // rounds up to the smallest normal bf16 is not one the two
        // roundings agree on)
        let sub = |i: usize, x: f32| if i % 97 == 5 { x * 1e-39 } else { x };
        let a: Vec<f32> = values(m * k, 5 + seed)
            .iter()
            .enumerate()
            .map(|(i, x)| sub(i, x.to_f32() * 1.003))
            .collect();
        let b: Vec<f32> = values(k * n, 6 + seed)
            .iter()
            .enumerate()
            .map(|(i, x)| sub(i + 11, x.to_f32() * 0.997))
            .collect();
        let ab: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
        let bb: Vec<bf16> = b.iter().map(|&x| bf16::from_f32(x)).collect();
        for path in available_paths() {
            for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
                let (af, a16) = if a_t {
                    (View::t(&a, m), View::t(&ab, m))
                } else {
                    (View::rows(&a, k), View::rows(&ab, k))
                };
                let (bf, b16) = if b_t {
                    (View::t(&b, k), View::t(&bb, k))
                } else {
                    (View::rows(&b, n), View::rows(&bb, n))
                };
                let mut got = vec![0f32; m * n];
                product_on(path, m, n, k, &mut got, false, af, bf);
                let mut want = vec![0f32; m * n];
                product_on(path, m, n, k, &mut want, false, a16, b16);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{path:?} a_t={a_t} b_t={b_t}"
                );
            }
        }
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
