//! Linear layers: `out = inp · weight + bias`, weight in `[in, out]`
//! layout (Hugging Face GPT-2's `Conv1D`).
//!
//! # Row invariance
//!
//! The forwards give every output row bitwise the same value whatever the
//! number of rows computed with it: one token alone, the same token as row
//! 37 of a sequence, or as one of the few tokens routed to an expert. The
//! GEMM library sums each element in one fixed order — sequentially over
//! `k` with one fused multiply-add per term — *on its main path*, but it
//! takes other paths for some shapes (a matrix–vector kernel for one row
//! or column, dot-product kernels when `rows · n <= 256` and the weight is
//! read column-wise, another kernel for `k <= 2`) and blocks long
//! reductions by a depth that depends on the shape. `gemm_row_invariant`
//! keeps every call on the main path and chunks `k` itself. (This, with
//! attention's own fixed-order tiles, is what lets a key/value-cache
//! decoder reproduce the training forward's logits bit for bit.)

use weft_numerics::bf16;

use crate::error::{Result, check};
use crate::fp16;
use crate::gemm::{View, gemm};
use crate::gemm_bf16;
use crate::{Mode, Precision, Real};

/// The input of a linear layer as its caller stores it: in the buffers'
/// precision, or (a mixed-precision model's saved activations) already
/// rounded to bf16 by [`round_to_bf16_for_products`](crate::round_to_bf16_for_products).
///
/// [`matmul_forward`], [`matmul_backward`] and [`matmul_backward_weight`]
/// take either. In [`Precision::Bf16`] a bf16 input is multiplied as it
/// is, with the bits the same product of the `f32` values it was rounded
/// from gives (the products round every operand that way anyway) — so a
/// model that keeps such an activation in bf16 holds half the bytes and
/// computes the same. In any other precision a bf16 input is widened
/// (exactly) first.
///
/// `&[T]`, `&Vec<T>` and `&[T; N]` convert into [`Wide`](Self::Wide).
#[derive(Clone, Copy, Debug)]
pub enum LinearInput<'a, T> {
    /// Values in the buffers' precision.
    Wide(&'a [T]),
    /// bf16 values.
    Bf16(&'a [bf16]),
}

impl<T> LinearInput<'_, T> {
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            LinearInput::Wide(x) => x.len(),
            LinearInput::Bf16(x) => x.len(),
        }
    }
    /// True if it holds no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<'a, T> From<&'a [T]> for LinearInput<'a, T> {
    fn from(x: &'a [T]) -> Self {
        LinearInput::Wide(x)
    }
}

impl<'a, T> From<&'a mut [T]> for LinearInput<'a, T> {
    fn from(x: &'a mut [T]) -> Self {
        LinearInput::Wide(x)
    }
}

impl<'a, T> From<&'a Vec<T>> for LinearInput<'a, T> {
    fn from(x: &'a Vec<T>) -> Self {
        LinearInput::Wide(x)
    }
}

impl<'a, T, const N: usize> From<&'a [T; N]> for LinearInput<'a, T> {
    fn from(x: &'a [T; N]) -> Self {
        LinearInput::Wide(x)
    }
}

/// `check` for a [`LinearInput`].
fn check_input<T>(op: &'static str, inp: LinearInput<'_, T>, expected: usize) -> Result<()> {
    match inp {
        LinearInput::Wide(x) => check(op, "inp", x, expected),
        LinearInput::Bf16(x) => check(op, "inp", x, expected),
    }
}

/// `out (B,T,OC) = inp (B,T,C) · weight (C,OC) + bias (OC)`.
///
/// Every output row's bits depend on its input row alone (see the module
/// docs on row invariance), so one GEMM over the whole batch is batch
/// invariant: both modes compute the same bits, the same way.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) if a buffer's
/// length does not match `b`, `t`, `c`, `oc`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward<'a, T: Real>(
    out: &mut [T],
    inp: impl Into<LinearInput<'a, T>>,
    weight: &[T],
    bias: Option<&[T]>,
    b: usize,
    t: usize,
    c: usize,
    oc: usize,
    mode: Mode,
    precision: Precision,
) -> Result<()> {
    const OP: &str = "matmul_forward";
    let inp = inp.into();
    check(OP, "out", out, b * t * oc)?;
    check_input(OP, inp, b * t * c)?;
    check(OP, "weight", weight, c * oc)?;
    if let Some(bias) = bias {
        check(OP, "bias", bias, oc)?;
    }
    let _ = mode; // row invariance makes one GEMM over the batch invariant
    forward_rows(
        out,
        inp,
        View::rows(weight, oc),
        bias,
        b * t,
        c,
        oc,
        precision,
    );
    Ok(())
}

/// Output columns of the narrowest call the `gemm` wrapper makes for an
/// output `n` wide (it splits wide outputs into column blocks).
fn narrowest_block(n: usize) -> usize {
    // The column block of `crate::gemm::gemm` (the row-invariance test
    // covers an output wider than it, with a narrow remainder).
    const N_BLOCK: usize = 4096;
    if n > N_BLOCK && !n.is_multiple_of(N_BLOCK) {
        n % N_BLOCK
    } else {
        n.min(N_BLOCK)
    }
}

/// Depth of one GEMM call in [`gemm_row_invariant`]: a longer reduction is
/// summed in chunks of this many terms, so the GEMM library's own blocking
/// of `k` (which depends on the shape) never splits it.
const K_CHUNK: usize = 512;

/// `dst (m×n) = [dst +] scale · a (m×k) · b (k×n)` (as
/// [`gemm`](crate::gemm::gemm)) with every element's bits determined by its
/// row of `a`, its column of `b` and `k` alone — not by `m`, `n`, the
/// layouts or the other rows (see the module docs on row invariance). Zero
/// terms appended to a dot product do not change it either, except for
/// the sign of an exact zero.
///
/// Shapes that the GEMM library would send down another path are padded:
/// too few rows (one, or `m·n <= 256` with `a` read along rows and `b`
/// along columns) with zero rows of `a` and `dst`; one output column or
/// `k <= 2` on zero-padded row-major copies of all three. A reduction
/// deeper than [`K_CHUNK`] runs as calls of at most that depth,
/// accumulating.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_row_invariant<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    dst_rs: usize,
    accumulate: bool,
    a: View<'_, T>,
    b: View<'_, T>,
    scale: T,
    threads: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k > K_CHUNK {
        for k0 in (0..k).step_by(K_CHUNK) {
            gemm_row_invariant(
                m,
                n,
                K_CHUNK.min(k - k0),
                dst,
                dst_rs,
                accumulate || k0 > 0,
                View {
                    data: &a.data[k0 * a.cs..],
                    ..a
                },
                View {
                    data: &b.data[k0 * b.rs..],
                    ..b
                },
                scale,
                threads,
            );
        }
        return;
    }
    // The GEMM library's dot-product kernels take small products whose `a`
    // is read along rows and `b` along columns; the wrapper splits a wide
    // output into column blocks, the narrowest of which decides.
    let nb = narrowest_block(n);
    let m_min = |a_cs: usize| {
        if a_cs == 1 && b.rs == 1 {
            (256 / nb + 1).max(2)
        } else {
            2
        }
    };
    if k < 3 || n < 2 || (b.rs == 1 && nb < 2) {
        // Vector-like `b` or a tiny reduction: zero-padded row-major copies.
        let (mp, np, kp) = (m.max(2), n.max(2), k.max(3));
        let mut ap = vec![T::ZERO; mp * kp];
        for i in 0..m {
            for l in 0..k {
                ap[i * kp + l] = a.data[i * a.rs + l * a.cs];
            }
        }
        let mut bp = vec![T::ZERO; kp * np];
        for l in 0..k {
            for j in 0..n {
                bp[l * np + j] = b.data[l * b.rs + j * b.cs];
            }
        }
        let mut dp = vec![T::ZERO; mp * np];
        if accumulate {
            for i in 0..m {
                dp[i * np..i * np + n].copy_from_slice(&dst[i * dst_rs..i * dst_rs + n]);
            }
        }
        gemm_row_invariant(
            mp,
            np,
            kp,
            &mut dp,
            np,
            accumulate,
            View::rows(&ap, kp),
            View::rows(&bp, np),
            scale,
            threads,
        );
        for i in 0..m {
            dst[i * dst_rs..i * dst_rs + n].copy_from_slice(&dp[i * np..i * np + n]);
        }
        return;
    }
    if m < m_min(a.cs) {
        // Too few rows: pad `a` and `dst` with zero rows (`b` is read as is).
        let mp = m_min(1);
        let mut ap = vec![T::ZERO; mp * k];
        for i in 0..m {
            for l in 0..k {
                ap[i * k + l] = a.data[i * a.rs + l * a.cs];
            }
        }
        let mut dp = vec![T::ZERO; mp * n];
        if accumulate {
            for i in 0..m {
                dp[i * n..(i + 1) * n].copy_from_slice(&dst[i * dst_rs..i * dst_rs + n]);
            }
        }
        gemm(
            mp,
            n,
            k,
            &mut dp,
            n,
            accumulate,
            View::rows(&ap, k),
            b,
            scale,
            threads,
        );
        for i in 0..m {
            dst[i * dst_rs..i * dst_rs + n].copy_from_slice(&dp[i * n..(i + 1) * n]);
        }
        return;
    }
    gemm(m, n, k, dst, dst_rs, accumulate, a, b, scale, threads);
}

/// Backward of [`matmul_forward`], accumulating (`+=`):
/// `dinp += dout · weightᵀ`, `dweight += inpᵀ · dout`, `dbias += Σ dout`.
///
/// The same as [`matmul_backward_input`] then [`matmul_backward_weight`]
/// (bit for bit: a split backward, such as a zero-bubble pipeline's B and
/// W steps, gives the bits of this one).
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward<'a, T: Real>(
    dinp: &mut [T],
    dweight: &mut [T],
    dbias: Option<&mut [T]>,
    dout: &[T],
    inp: impl Into<LinearInput<'a, T>>,
    weight: &[T],
    b: usize,
    t: usize,
    c: usize,
    oc: usize,
    mode: Mode,
    precision: Precision,
) -> Result<()> {
    const OP: &str = "matmul_backward";
    let inp = inp.into();
    check(OP, "dinp", dinp, b * t * c)?;
    check(OP, "dweight", dweight, c * oc)?;
    check(OP, "dout", dout, b * t * oc)?;
    check_input(OP, inp, b * t * c)?;
    check(OP, "weight", weight, c * oc)?;
    if let Some(db) = &dbias {
        check(OP, "dbias", db, oc)?;
    }
    matmul_backward_input(dinp, dout, weight, b, t, c, oc, mode, precision)?;
    matmul_backward_weight(dweight, dbias, dout, inp, b, t, c, oc, precision)
}

/// The input-gradient half of [`matmul_backward`]:
/// `dinp (B,T,C) += dout (B,T,OC) · weightᵀ`, `weight (C,OC)`.
///
/// In [`Mode::BatchInvariant`] it is one GEMM per sequence, in
/// [`Mode::Throughput`] one over the batch.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward_input<T: Real>(
    dinp: &mut [T],
    dout: &[T],
    weight: &[T],
    b: usize,
    t: usize,
    c: usize,
    oc: usize,
    mode: Mode,
    precision: Precision,
) -> Result<()> {
    const OP: &str = "matmul_backward_input";
    check(OP, "dinp", dinp, b * t * c)?;
    check(OP, "dout", dout, b * t * oc)?;
    check(OP, "weight", weight, c * oc)?;
    input_grad(
        dinp,
        dout,
        View::t(weight, oc),
        b,
        t,
        c,
        oc,
        mode,
        precision,
    );
    Ok(())
}

/// `dinp (B,T,C) += dout (B,T,OC) · w` for a `(OC, C)` view `w` of the
/// weight: one GEMM per sequence in [`Mode::BatchInvariant`], one over the
/// batch in [`Mode::Throughput`] — and always one in bf16, whose products
/// are row invariant at every shape. Lengths are checked by the caller.
#[allow(clippy::too_many_arguments)]
fn input_grad<T: Real>(
    dinp: &mut [T],
    dout: &[T],
    w: View<'_, T>,
    b: usize,
    t: usize,
    c: usize,
    oc: usize,
    mode: Mode,
    precision: Precision,
) {
    if precision == Precision::F16 {
        // the f32 products of the rounded operands
        let d = View::rows(dout, oc);
        fp16::with_rounded((d, b * t, oc), (w, oc, c), |d, w| {
            input_grad(dinp, d.data, w, b, t, c, oc, mode, Precision::F32);
        });
        return;
    }
    if precision == Precision::Bf16 {
        product(
            b * t,
            c,
            oc,
            dinp,
            true,
            View::rows(dout, oc),
            w,
            precision,
            false,
        );
        return;
    }
    let (groups, rows) = groups(mode, b, t);
    for g in 0..groups {
        gemm(
            rows,
            c,
            oc,
            &mut dinp[g * rows * c..(g + 1) * rows * c],
            c,
            true,
            View::rows(&dout[g * rows * oc..(g + 1) * rows * oc], oc),
            w,
            T::ONE,
            true,
        );
    }
}

/// The parameter-gradient half of [`matmul_backward`]:
/// `dweight (C,OC) += inpᵀ · dout`, `dbias (OC) += Σ dout`, summed over
/// all `B·T` rows.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward_weight<'a, T: Real>(
    dweight: &mut [T],
    dbias: Option<&mut [T]>,
    dout: &[T],
    inp: impl Into<LinearInput<'a, T>>,
    b: usize,
    t: usize,
    c: usize,
    oc: usize,
    precision: Precision,
) -> Result<()> {
    const OP: &str = "matmul_backward_weight";
    let inp = inp.into();
    check(OP, "dweight", dweight, c * oc)?;
    check(OP, "dout", dout, b * t * oc)?;
    check_input(OP, inp, b * t * c)?;
    if let Some(db) = &dbias {
        check(OP, "dbias", db, oc)?;
    }
    // the left operand inpᵀ: element (i, p) = inp[p·c + i]
    product_of(
        c,
        oc,
        b * t,
        dweight,
        true,
        inp,
        (1, c),
        View::rows(dout, oc),
        precision,
        false,
    );
    if let Some(db) = dbias {
        bias_backward(db, dout);
    }
    Ok(())
}

/// Like [`matmul_forward`] but with the weight in `[out, in]` layout
/// (PyTorch `nn.Linear`, GPT-2's `lm_head` and tied `wte`):
/// `out (B,T,OC) = inp (B,T,C) · weightᵀ`, `weight (OC,C)`.
///
/// Rows are computed as in [`matmul_forward`]: each row's bits depend on
/// that row alone, whatever the mode.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward_wt<T: Real>(
    out: &mut [T],
    inp: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    b: usize,
    t: usize,
    c: usize,
    oc: usize,
    mode: Mode,
    precision: Precision,
) -> Result<()> {
    const OP: &str = "matmul_forward_wt";
    check(OP, "out", out, b * t * oc)?;
    check(OP, "inp", inp, b * t * c)?;
    check(OP, "weight", weight, c * oc)?;
    if let Some(bias) = bias {
        check(OP, "bias", bias, oc)?;
    }
    let _ = mode; // row invariance makes one GEMM over the batch invariant
    forward_rows(
        out,
        LinearInput::Wide(inp),
        View::t(weight, c),
        bias,
        b * t,
        c,
        oc,
        precision,
    );
    Ok(())
}

/// Backward of [`matmul_forward_wt`] (`weight (OC,C)`), accumulating:
/// `dinp += dout · weight`, `dweight += doutᵀ · inp`, `dbias += Σ dout`.
///
/// The same as [`matmul_backward_wt_input`] then
/// [`matmul_backward_wt_weight`], bit for bit.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward_wt<T: Real>(
    dinp: &mut [T],
    dweight: &mut [T],
    dbias: Option<&mut [T]>,
    dout: &[T],
    inp: &[T],
    weight: &[T],
    b: usize,
    t: usize,
    c: usize,
    oc: usize,
    mode: Mode,
    precision: Precision,
) -> Result<()> {
    const OP: &str = "matmul_backward_wt";
    check(OP, "dinp", dinp, b * t * c)?;
    check(OP, "dweight", dweight, c * oc)?;
    check(OP, "dout", dout, b * t * oc)?;
    check(OP, "inp", inp, b * t * c)?;
    check(OP, "weight", weight, c * oc)?;
    if let Some(db) = &dbias {
        check(OP, "dbias", db, oc)?;
    }
    matmul_backward_wt_input(dinp, dout, weight, b, t, c, oc, mode, precision)?;
    matmul_backward_wt_weight(dweight, dbias, dout, inp, b, t, c, oc, precision)
}

/// The input-gradient half of [`matmul_backward_wt`]:
/// `dinp (B,T,C) += dout (B,T,OC) · weight`, `weight (OC,C)`.
///
/// Row invariant in both modes, like [`matmul_forward_wt`]: each row's
/// bits depend on its row of `dout` (and of `dinp`) alone, so a loss
/// computed in chunks of tokens gets the bits of the whole batch.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward_wt_input<T: Real>(
    dinp: &mut [T],
    dout: &[T],
    weight: &[T],
    b: usize,
    t: usize,
    c: usize,
    oc: usize,
    mode: Mode,
    precision: Precision,
) -> Result<()> {
    const OP: &str = "matmul_backward_wt_input";
    check(OP, "dinp", dinp, b * t * c)?;
    check(OP, "dout", dout, b * t * oc)?;
    check(OP, "weight", weight, c * oc)?;
    let _ = mode; // row invariant: one product over the batch is invariant
    product(
        b * t,
        c,
        oc,
        dinp,
        true,
        View::rows(dout, oc),
        View::rows(weight, c),
        precision,
        true,
    );
    Ok(())
}

/// The parameter-gradient half of [`matmul_backward_wt`]:
/// `dweight (OC,C) += doutᵀ · inp`, `dbias (OC) += Σ dout`.
///
/// The reduction over the `B·T` rows runs in blocks of [`WT_SUM_ROWS`]:
/// calling it on the first `k·WT_SUM_ROWS` rows and then on the rest
/// gives `dweight` the bits of one call on all of them.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward_wt_weight<T: Real>(
    dweight: &mut [T],
    dbias: Option<&mut [T]>,
    dout: &[T],
    inp: &[T],
    b: usize,
    t: usize,
    c: usize,
    oc: usize,
    precision: Precision,
) -> Result<()> {
    const OP: &str = "matmul_backward_wt_weight";
    check(OP, "dweight", dweight, c * oc)?;
    check(OP, "dout", dout, b * t * oc)?;
    check(OP, "inp", inp, b * t * c)?;
    if let Some(db) = &dbias {
        check(OP, "dbias", db, oc)?;
    }
    // A tall `dweight` (the vocabulary's rows) is computed in row blocks,
    // so that the block being accumulated stays in cache while the
    // products walk the whole reduction over B·T rows (one call would
    // stream all of `dweight` through memory once per reduction block of
    // the GEMM); the reduction runs as products of `WT_SUM_ROWS` rows each,
    // in order, so that its bits do not depend on how many rows a call has.
    // (The bf16 products block their own work, and round each operand
    // once per call: one call per block of the reduction.)
    if precision == Precision::F16 {
        // the f32 products of the rounded operands (the bias from `dout`
        // as it is, as in every precision)
        let (d, x) = (View::rows(dout, oc), View::rows(inp, c));
        fp16::with_rounded((d, b * t, oc), (x, b * t, c), |d, x| {
            matmul_backward_wt_weight(dweight, None, d.data, x.data, b, t, c, oc, Precision::F32)
        })?;
        if let Some(db) = dbias {
            bias_backward(db, dout);
        }
        return Ok(());
    }
    let n = b * t;
    let slab = match precision {
        Precision::F32 | Precision::F16 => WT_ROW_BLOCK,
        Precision::Bf16 => oc.max(1),
    };
    for r0 in (0..oc).step_by(slab) {
        let rows = slab.min(oc - r0);
        for k0 in (0..n).step_by(WT_SUM_ROWS) {
            product(
                rows,
                c,
                WT_SUM_ROWS.min(n - k0),
                &mut dweight[r0 * c..(r0 + rows) * c],
                true,
                View::t(&dout[k0 * oc + r0..], oc),
                View::rows(&inp[k0 * c..], c),
                precision,
                false,
            );
        }
    }
    if let Some(db) = dbias {
        bias_backward(db, dout);
    }
    Ok(())
}

/// Rows of `dweight` per GEMM call in [`matmul_backward_wt_weight`]
/// (measured best of 512..16384 for GPT-2's vocabulary at C = 256 and 768
/// with `model/benches/step_profile.rs`).
const WT_ROW_BLOCK: usize = 4096;

/// Rows of the reduction over `B·T` that [`matmul_backward_wt_weight`]
/// sums per product: its weight gradient is the sum, in row order, of the
/// products of consecutive blocks of this many rows (the last one
/// shorter). A caller that passes the rows in parts whose lengths are
/// multiples of it (a loss computed in chunks of tokens) gets the bits of
/// one call over all of them, in every precision and on every kernel path.
pub const WT_SUM_ROWS: usize = 1024;

/// `(groups, rows per group)` of an input-gradient GEMM in `mode`.
fn groups(mode: Mode, b: usize, t: usize) -> (usize, usize) {
    match mode {
        Mode::BatchInvariant => (b, t),
        Mode::Throughput => (1, b * t),
    }
}

/// `out (n,oc) = x (n,c) · w (c,oc) [+ bias]` in one row-invariant
/// product over all `n` rows.
#[allow(clippy::too_many_arguments)]
fn forward_rows<T: Real>(
    out: &mut [T],
    x: LinearInput<'_, T>,
    w: View<'_, T>,
    bias: Option<&[T]>,
    n: usize,
    c: usize,
    oc: usize,
    precision: Precision,
) {
    if let Some(bias) = bias {
        // bf16 products on f32 buffers start their sums from the bias
        // (the bits of accumulating into a copy of it, without the copy)
        if precision == Precision::Bf16
            && let (Some(d), Some(wb), Some(bb)) =
                (T::as_f32_mut(out), f32_view(w), T::as_f32(bias))
        {
            match x {
                LinearInput::Wide(data) => {
                    if let Some(data) = T::as_f32(data) {
                        let a = View { data, rs: c, cs: 1 };
                        gemm_bf16::product_with_bias(n, oc, c, d, bb, a, wb);
                        return;
                    }
                }
                LinearInput::Bf16(data) => {
                    let a = View { data, rs: c, cs: 1 };
                    gemm_bf16::product_with_bias(n, oc, c, d, bb, a, wb);
                    return;
                }
            }
        }
        for row in out.chunks_exact_mut(oc) {
            row.copy_from_slice(bias);
        }
    }
    product_of(n, oc, c, out, bias.is_some(), x, (c, 1), w, precision, true);
}

/// [`product`] with a left operand `a` (m×k, element `(i, p)` at
/// `i·strides.0 + p·strides.1`) that may be stored in bf16: multiplied as
/// it is in [`Precision::Bf16`] on `f32` buffers, else widened first.
#[allow(clippy::too_many_arguments)]
fn product_of<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    accumulate: bool,
    a: LinearInput<'_, T>,
    (rs, cs): (usize, usize),
    b: View<'_, T>,
    precision: Precision,
    row_invariant: bool,
) {
    let x = match a {
        LinearInput::Wide(data) => {
            let a = View { data, rs, cs };
            return product(m, n, k, dst, accumulate, a, b, precision, row_invariant);
        }
        LinearInput::Bf16(x) => x,
    };
    if precision == Precision::Bf16
        && m > 0
        && n > 0
        && k > 0
        && let (Some(d), Some(b)) = (T::as_f32_mut(dst), f32_view(b))
    {
        gemm_bf16::product(m, n, k, d, accumulate, View { data: x, rs, cs }, b);
        return;
    }
    let wide: Vec<T> = x
        .iter()
        .map(|v| T::from_f64(f64::from(v.to_f32())))
        .collect();
    let a = View {
        data: &wide,
        rs,
        cs,
    };
    product(m, n, k, dst, accumulate, a, b, precision, row_invariant);
}

/// `v` as a view of `f32`, if its elements are `f32`.
fn f32_view<T: Real>(v: View<'_, T>) -> Option<View<'_, f32>> {
    T::as_f32(v.data).map(|data| View {
        data,
        rs: v.rs,
        cs: v.cs,
    })
}

/// `dst (m×n, row-major, contiguous) = [dst +] a (m×k) · b (k×n)` in
/// `precision`, over the rayon pool. In f32, `row_invariant` chooses
/// [`gemm_row_invariant`] (the forwards) over the plain GEMM; the bf16
/// products are row invariant at every shape.
#[allow(clippy::too_many_arguments)]
fn product<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    accumulate: bool,
    a: View<'_, T>,
    b: View<'_, T>,
    precision: Precision,
    row_invariant: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    match precision {
        Precision::F32 if row_invariant => {
            gemm_row_invariant(m, n, k, dst, n, accumulate, a, b, T::ONE, true);
        }
        Precision::F32 => gemm(m, n, k, dst, n, accumulate, a, b, T::ONE, true),
        Precision::F16 => fp16::with_rounded((a, m, k), (b, k, n), |a, b| {
            product(
                m,
                n,
                k,
                dst,
                accumulate,
                a,
                b,
                Precision::F32,
                row_invariant,
            );
        }),
        Precision::Bf16 if k == 0 => {
            if !accumulate {
                dst.fill(T::ZERO);
            }
        }
        Precision::Bf16 => {
            if let (Some(d), Some(a32), Some(b32)) = (T::as_f32_mut(dst), f32_view(a), f32_view(b))
            {
                gemm_bf16::product(m, n, k, d, accumulate, a32, b32);
                return;
            }
            // f64 buffers: the bf16-rounded operands multiplied in f64.
            let round = |v: View<'_, T>, rows: usize, cols: usize| -> Vec<T> {
                let mut r = Vec::with_capacity(rows * cols);
                for i in 0..rows {
                    r.extend(
                        (0..cols)
                            .map(|j| T::from_f64(round_bf16(v.data[i * v.rs + j * v.cs].to_f64()))),
                    );
                }
                r
            };
            let (ar, br) = (round(a, m, k), round(b, k, n));
            gemm_row_invariant(
                m,
                n,
                k,
                dst,
                n,
                accumulate,
                View::rows(&ar, k),
                View::rows(&br, n),
                T::ONE,
                true,
            );
        }
    }
}

/// `x` rounded to the nearest bf16, ties to even, as an `f64` (`half`'s
/// `bf16::from_f64` decides ties on the upper half of the bits only).
fn round_bf16(x: f64) -> f64 {
    // bf16 keeps 8 significant bits; below f32's normal range its
    // spacing is fixed at 2⁻¹³³.
    fp16::round_to_format(x, 8, -126, f64::from(bf16::MAX.to_f32()))
}

/// `db (OC) += Σ_rows dout (rows, OC)`, split over the rayon pool by
/// column ranges: every element still sums the rows in order, so the bits
/// do not depend on the thread count.
fn bias_backward<T: Real>(db: &mut [T], dout: &[T]) {
    use rayon::prelude::*;
    let oc = db.len();
    if oc == 0 {
        return;
    }
    // Columns per task: a multiple of 16 lanes, about one task per thread
    // for a GPT-2-sized output, none for a small one.
    let cols = (oc / (4 * rayon::current_num_threads()))
        .max(256)
        .next_multiple_of(16);
    db.par_chunks_mut(cols)
        .enumerate()
        .for_each(|(i, d)| bias_backward_cols(d, dout, oc, i * cols));
}

crate::simd::multiversion! {
    fn bias_backward_cols<T: Real>(db: &mut [T], dout: &[T], oc: usize, j0: usize) {
        let w = db.len();
        for row in dout.chunks_exact(oc) {
            for (d, &g) in db.iter_mut().zip(&row[j0..j0 + w]) {
                *d += g;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_grads, rand_vec};

    /// The head's backward split into parts of whole [`WT_SUM_ROWS`]
    /// blocks of tokens (a loss computed in chunks) gives the bits of one
    /// call over all of them: the weight gradient (accumulated into a
    /// nonzero start, with a vocabulary wider than one row block of
    /// `dweight`) and the input gradient, in every precision.
    #[test]
    fn the_heads_backward_splits_at_whole_row_blocks() {
        let (c, oc) = (24, WT_ROW_BLOCK + 37);
        let n = 3 * WT_SUM_ROWS + 29;
        let (x, w, dy) = (
            rand_vec(n * c, 1)
                .iter()
                .map(|&v| v as f32)
                .collect::<Vec<_>>(),
            rand_vec(oc * c, 2)
                .iter()
                .map(|&v| v as f32)
                .collect::<Vec<_>>(),
            rand_vec(n * oc, 3)
                .iter()
                .map(|&v| v as f32 * 1e-2)
                .collect::<Vec<_>>(),
        );
        let differ = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count()
        };
        for precision in [Precision::F32, Precision::Bf16, Precision::F16] {
            let (mut dw, mut dx) = (vec![0.5f32; oc * c], vec![0.25f32; n * c]);
            matmul_backward_wt_weight(&mut dw, None, &dy, &x, 1, n, c, oc, precision).unwrap();
            let m = Mode::Throughput;
            matmul_backward_wt_input(&mut dx, &dy, &w, 1, n, c, oc, m, precision).unwrap();
            for parts in [
                &[WT_SUM_ROWS, n - WT_SUM_ROWS][..],
                &[2 * WT_SUM_ROWS, n - 2 * WT_SUM_ROWS],
                &[WT_SUM_ROWS; 3],
            ] {
                let (mut dw2, mut dx2) = (vec![0.5f32; oc * c], vec![0.25f32; n * c]);
                let mut r0 = 0;
                for (i, &len) in parts.iter().enumerate() {
                    // the last part takes the rows left
                    let len = if i + 1 == parts.len() { n - r0 } else { len };
                    let (d, xi) = (&dy[r0 * oc..(r0 + len) * oc], &x[r0 * c..(r0 + len) * c]);
                    matmul_backward_wt_weight(&mut dw2, None, d, xi, 1, len, c, oc, precision)
                        .unwrap();
                    let dxi = &mut dx2[r0 * c..(r0 + len) * c];
                    matmul_backward_wt_input(dxi, d, &w, 1, len, c, oc, m, precision).unwrap();
                    r0 += len;
                }
                let off = (differ(&dw, &dw2), differ(&dx, &dx2));
                assert_eq!(
                    off,
                    (0, 0),
                    "{precision:?} in parts {parts:?}: values that differ (dweight, dinp)"
                );
            }
        }
    }

    /// A bf16 input stored by `round_to_bf16_for_products` gives, in
    /// bf16, the bits of the same product of the f32 values (forward, the
    /// whole backward and its weight half; small shapes and ones the
    /// packed paths and the blocked transpose take); in f32 it is its
    /// values widened.
    #[test]
    fn bf16_stored_inputs_give_the_products_bits() {
        let f32s = |n: usize, seed: u64| -> Vec<f32> {
            rand_vec(n, seed)
                .iter()
                .enumerate()
                // magnitudes over a few binades, some exact zeros
                .map(|(i, &x)| {
                    if i % 17 == 0 {
                        0.0
                    } else {
                        (x * f64::from(1u32 << (i % 7))) as f32
                    }
                })
                .collect()
        };
        for (b, t, c, oc) in [
            (2, 3, 5, 7),
            (1, 1, 33, 9),
            (4, 64, 96, 80),
            (2, 50, 130, 70),
        ] {
            let n = b * t;
            let (x, w, bias, dy) = (
                f32s(n * c, 1),
                f32s(c * oc, 2),
                f32s(oc, 3),
                f32s(n * oc, 4),
            );
            let mut xb = vec![bf16::ZERO; n * c];
            crate::round_to_bf16_for_products(&mut xb, &x).unwrap();
            let widened: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
            for (precision, reference) in [
                (Precision::Bf16, LinearInput::Wide(&x[..])),
                (Precision::F32, LinearInput::Wide(&widened[..])),
            ] {
                let stored = LinearInput::Bf16(&xb[..]);
                let forward = |inp: LinearInput<'_, f32>| {
                    let mut out = vec![0.0f32; n * oc];
                    let m = Mode::BatchInvariant;
                    matmul_forward(&mut out, inp, &w, Some(&bias), b, t, c, oc, m, precision)
                        .unwrap();
                    out
                };
                let backward = |inp: LinearInput<'_, f32>| {
                    let (mut dx, mut dw, mut db) =
                        (vec![0.5f32; n * c], vec![0.25f32; c * oc], vec![0.0f32; oc]);
                    let m = Mode::Throughput;
                    matmul_backward(
                        &mut dx,
                        &mut dw,
                        Some(&mut db),
                        &dy,
                        inp,
                        &w,
                        b,
                        t,
                        c,
                        oc,
                        m,
                        precision,
                    )
                    .unwrap();
                    let mut dw2 = vec![0.25f32; c * oc];
                    matmul_backward_weight(&mut dw2, None, &dy, inp, b, t, c, oc, precision)
                        .unwrap();
                    (dx, dw, db, dw2)
                };
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&forward(stored)),
                    bits(&forward(reference)),
                    "{precision:?} {b}x{t}x{c}x{oc}"
                );
                let (g1, g2) = (backward(stored), backward(reference));
                for (a, r) in [
                    (&g1.0, &g2.0),
                    (&g1.1, &g2.1),
                    (&g1.2, &g2.2),
                    (&g1.3, &g2.3),
                ] {
                    assert_eq!(bits(a), bits(r), "{precision:?} {b}x{t}x{c}x{oc}");
                }
                assert_eq!(bits(&g1.1), bits(&g1.3));
            }
            // f64 buffers: the bf16 values widened, multiplied in f64
            let x64: Vec<f64> = widened.iter().map(|&v| f64::from(v)).collect();
            let w64: Vec<f64> = w.iter().map(|&v| f64::from(v)).collect();
            let (mut o1, mut o2) = (vec![0.0f64; n * oc], vec![0.0f64; n * oc]);
            let m = Mode::BatchInvariant;
            matmul_forward(
                &mut o1,
                LinearInput::Bf16(&xb),
                &w64,
                None,
                b,
                t,
                c,
                oc,
                m,
                Precision::Bf16,
            )
            .unwrap();
            matmul_forward(&mut o2, &x64, &w64, None, b, t, c, oc, m, Precision::Bf16).unwrap();
            assert_eq!(o1, o2);
        }
        let mut short = vec![bf16::ZERO; 3];
        let e = crate::round_to_bf16_for_products(&mut short, &[1.0; 4]).unwrap_err();
        assert!(e.to_string().contains("round_to_bf16_for_products"), "{e}");
        let mut out = [0.0f32; 2];
        let e = matmul_forward(
            &mut out,
            LinearInput::Bf16(&short),
            &[1.0; 4],
            None,
            1,
            1,
            2,
            2,
            Mode::Throughput,
            Precision::Bf16,
        )
        .unwrap_err();
        assert!(e.to_string().contains("inp"), "{e}");
    }

    #[test]
    fn forward_matches_naive_f64() {
        let (b, t, c, oc) = (2, 3, 5, 7);
        let x = rand_vec(b * t * c, 1);
        let w = rand_vec(c * oc, 2);
        let bias = rand_vec(oc, 3);
        for mode in [Mode::BatchInvariant, Mode::Throughput] {
            let mut out = vec![0.0; b * t * oc];
            matmul_forward(
                &mut out,
                &x,
                &w,
                Some(&bias),
                b,
                t,
                c,
                oc,
                mode,
                Precision::F32,
            )
            .unwrap();
            for r in 0..b * t {
                for o in 0..oc {
                    let want: f64 =
                        bias[o] + (0..c).map(|i| x[r * c + i] * w[i * oc + o]).sum::<f64>();
                    assert!((out[r * oc + o] - want).abs() < 1e-12);
                }
            }
        }
    }

    #[test]
    fn wide_outputs_are_computed_in_column_blocks_exactly() {
        // oc above the 4096-column block of the gemm wrapper.
        let (b, t, c, oc) = (2, 2, 3, 4100);
        let x = rand_vec(b * t * c, 11);
        let w = rand_vec(c * oc, 12);
        let mut out = vec![0.0; b * t * oc];
        matmul_forward_wt(
            &mut out,
            &x,
            &w,
            None,
            b,
            t,
            c,
            oc,
            Mode::BatchInvariant,
            Precision::F32,
        )
        .unwrap();
        for r in 0..b * t {
            for o in 0..oc {
                let want: f64 = (0..c).map(|i| x[r * c + i] * w[o * c + i]).sum();
                assert!((out[r * oc + o] - want).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        let (b, t, c, oc) = (2, 3, 4, 5);
        for with_bias in [true, false] {
            let inputs = vec![rand_vec(b * t * c, 4), rand_vec(c * oc, 5), rand_vec(oc, 6)];
            check_grads(
                &inputs,
                b * t * oc,
                |ins, out| {
                    let bias = with_bias.then_some(&ins[2][..]);
                    matmul_forward(
                        out,
                        &ins[0],
                        &ins[1],
                        bias,
                        b,
                        t,
                        c,
                        oc,
                        Mode::BatchInvariant,
                        Precision::F32,
                    )
                    .unwrap();
                },
                |ins, dout, grads| {
                    let [gx, gw, gb] = grads else { unreachable!() };
                    let db = if with_bias { Some(&mut gb[..]) } else { None };
                    matmul_backward(
                        gx,
                        gw,
                        db,
                        dout,
                        &ins[0],
                        &ins[1],
                        b,
                        t,
                        c,
                        oc,
                        Mode::Throughput,
                        Precision::F32,
                    )
                    .unwrap();
                },
            );
        }
    }

    #[test]
    fn transposed_weight_gradients_match_finite_differences() {
        let (b, t, c, oc) = (2, 2, 3, 4);
        let inputs = vec![rand_vec(b * t * c, 7), rand_vec(c * oc, 8), rand_vec(oc, 9)];
        check_grads(
            &inputs,
            b * t * oc,
            |ins, out| {
                matmul_forward_wt(
                    out,
                    &ins[0],
                    &ins[1],
                    Some(&ins[2]),
                    b,
                    t,
                    c,
                    oc,
                    Mode::Throughput,
                    Precision::F32,
                )
                .unwrap();
            },
            |ins, dout, grads| {
                let [gx, gw, gb] = grads else { unreachable!() };
                matmul_backward_wt(
                    gx,
                    gw,
                    Some(gb),
                    dout,
                    &ins[0],
                    &ins[1],
                    b,
                    t,
                    c,
                    oc,
                    Mode::BatchInvariant,
                    Precision::F32,
                )
                .unwrap();
            },
        );
    }

    /// Row invariance (module docs): a row's output is bitwise the same
    /// alone, in any prefix of a sequence and inside the whole sequence, for
    /// shapes that reach each of the GEMM library's paths when unpadded.
    #[test]
    fn each_row_is_bitwise_the_same_whatever_rows_surround_it() {
        let f32s =
            |n, seed| -> Vec<f32> { rand_vec(n, seed).into_iter().map(|x| x as f32).collect() };
        // (C, OC): main path; one output column; narrow outputs (dot-product
        // kernels when read column-wise); a deep reduction into a narrow
        // output (other k blocking); an output wider than the column block
        // with a narrow remainder; a reduction of 3.
        let shapes = [
            (16, 48),
            (64, 1),
            (16, 8),
            (600, 8),
            (24, 4100),
            (3, 5),
            (96, 384),
        ];
        let rows = 70;
        for (c, oc) in shapes {
            let x = f32s(rows * c, 21);
            let w = f32s(c * oc, 22);
            let bias = f32s(oc, 23);
            for (wt, with_bias) in [(false, true), (true, false), (true, true)] {
                let run = |x: &[f32], t: usize| {
                    let mut out = vec![0.0f32; t * oc];
                    let bias = with_bias.then_some(&bias[..]);
                    let mode = Mode::BatchInvariant;
                    if wt {
                        matmul_forward_wt(&mut out, x, &w, bias, 1, t, c, oc, mode, Precision::F32)
                            .unwrap();
                    } else {
                        matmul_forward(&mut out, x, &w, bias, 1, t, c, oc, mode, Precision::F32)
                            .unwrap();
                    }
                    out
                };
                let full = run(&x, rows);
                for t in [1, 2, 3, 5, 16, 17, 48, 64, 65, 69] {
                    let part = run(&x[..t * c], t);
                    let same = part
                        .iter()
                        .zip(&full)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "C={c} OC={oc} wt={wt}: first {t} rows differ");
                }
                for i in [0, 1, 7, 33, 64, 69] {
                    let one = run(&x[i * c..(i + 1) * c], 1);
                    let same = one
                        .iter()
                        .zip(&full[i * oc..])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "C={c} OC={oc} wt={wt}: row {i} alone differs");
                }
            }
        }
    }

    #[test]
    fn wrong_shape_is_an_error() {
        let mut out = vec![0.0f32; 6];
        let err = matmul_forward(
            &mut out,
            &[0.0; 5],
            &[0.0; 6],
            None,
            1,
            2,
            3,
            3,
            Mode::Throughput,
            Precision::F32,
        )
        .unwrap_err();
        assert_eq!(
            err,
            crate::Error::ShapeMismatch {
                op: "matmul_forward",
                buffer: "inp",
                expected: 6,
                got: 5
            }
        );
    }

    fn f32s(v: &[f64]) -> Vec<f32> {
        v.iter().map(|&x| x as f32).collect()
    }

    fn bf16s(v: &[f32]) -> Vec<bf16> {
        v.iter().map(|&x| bf16::from_f32(x)).collect()
    }

    /// Every bf16 linear-layer kernel on f32 buffers gives the bits of
    /// [`matmul_bf16`](crate::matmul_bf16) on the bf16-rounded buffers in
    /// the same layout (the rounding happens as the GEMM packs).
    #[test]
    fn bf16_kernels_are_the_bf16_gemm_of_the_rounded_buffers() {
        use crate::matmul_bf16;
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (b, t, c, oc) in [(2, 5, 37, 70), (3, 64, 96, 200)] {
            let n = b * t;
            let x = f32s(&rand_vec(n * c, 21));
            let w = f32s(&rand_vec(c * oc, 22));
            let dy = f32s(&rand_vec(n * oc, 23));
            let bias = f32s(&rand_vec(oc, 24));
            let (xb, wb, dyb) = (bf16s(&x), bf16s(&w), bf16s(&dy));
            let (mode, p) = (Mode::BatchInvariant, Precision::Bf16);
            // forward, [in, out] weight, with bias
            let mut got = vec![0f32; n * oc];
            matmul_forward(&mut got, &x, &w, Some(&bias), b, t, c, oc, mode, p).unwrap();
            let mut want: Vec<f32> = (0..n).flat_map(|_| bias.iter().copied()).collect();
            matmul_bf16(&mut want, &xb, false, &wb, false, n, oc, c, true).unwrap();
            assert_eq!(bits(&got), bits(&want), "forward {b}x{t}x{c}x{oc}");
            // forward, [out, in] weight
            matmul_forward_wt(&mut got, &x, &w, None, b, t, c, oc, mode, p).unwrap();
            matmul_bf16(&mut want, &xb, false, &wb, true, n, oc, c, false).unwrap();
            assert_eq!(bits(&got), bits(&want), "forward_wt");
            // input gradients accumulate into what is there
            let base = f32s(&rand_vec(n * c, 25));
            let mut got = base.clone();
            matmul_backward_input(&mut got, &dy, &w, b, t, c, oc, mode, p).unwrap();
            let mut want = base.clone();
            matmul_bf16(&mut want, &dyb, false, &wb, true, n, c, oc, true).unwrap();
            assert_eq!(bits(&got), bits(&want), "backward_input");
            let w_t = &w; // read as (OC, C)
            let mut got = base.clone();
            matmul_backward_wt_input(&mut got, &dy, w_t, b, t, c, oc, mode, p).unwrap();
            let mut want = base.clone();
            matmul_bf16(&mut want, &dyb, false, &wb, false, n, c, oc, true).unwrap();
            assert_eq!(bits(&got), bits(&want), "backward_wt_input");
            // weight gradients
            let wbase = f32s(&rand_vec(c * oc, 26));
            let mut got = wbase.clone();
            matmul_backward_weight(&mut got, None, &dy, &x, b, t, c, oc, p).unwrap();
            let mut want = wbase.clone();
            matmul_bf16(&mut want, &xb, true, &dyb, false, c, oc, n, true).unwrap();
            assert_eq!(bits(&got), bits(&want), "backward_weight");
            let mut got = wbase.clone();
            matmul_backward_wt_weight(&mut got, None, &dy, &x, b, t, c, oc, p).unwrap();
            let mut want = wbase.clone();
            matmul_bf16(&mut want, &dyb, true, &xb, false, oc, c, n, true).unwrap();
            assert_eq!(bits(&got), bits(&want), "backward_wt_weight");
        }
    }

    /// fp16 is, bit for bit, the f32 kernels on operands rounded to fp16
    /// beforehand — in both modes, for f32 and f64 buffers, every linear
    /// kernel, the biases' gradients summed from the gradient as it is.
    #[test]
    fn fp16_is_the_f32_kernels_on_operands_rounded_to_fp16() {
        fn check<T: Real>(scale: f64) {
            let v = |n: usize, seed: u64| -> Vec<T> {
                rand_vec(n, seed)
                    .iter()
                    .map(|&x| T::from_f64(x * scale))
                    .collect()
            };
            let r = |v: &[T]| -> Vec<T> {
                v.iter()
                    .map(|x| T::from_f64(fp16::round_f64(x.to_f64())))
                    .collect()
            };
            let bits = |v: &[T]| v.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<_>>();
            for (b, t, c, oc) in [(2, 5, 37, 70), (3, 16, 96, 300), (1, 1, 600, 5)] {
                let n = b * t;
                let (x, w, dy, bias) = (v(n * c, 41), v(c * oc, 42), v(n * oc, 43), v(oc, 44));
                let (xr, wr, dyr) = (r(&x), r(&w), r(&dy));
                for mode in [Mode::BatchInvariant, Mode::Throughput] {
                    let (h, f) = (Precision::F16, Precision::F32);
                    let mut got = vec![T::ZERO; n * oc];
                    let mut want = got.clone();
                    matmul_forward(&mut got, &x, &w, Some(&bias), b, t, c, oc, mode, h).unwrap();
                    matmul_forward(&mut want, &xr, &wr, Some(&bias), b, t, c, oc, mode, f).unwrap();
                    assert_eq!(bits(&got), bits(&want), "forward {b}x{t}x{c}x{oc}");
                    matmul_forward_wt(&mut got, &x, &w, None, b, t, c, oc, mode, h).unwrap();
                    matmul_forward_wt(&mut want, &xr, &wr, None, b, t, c, oc, mode, f).unwrap();
                    assert_eq!(bits(&got), bits(&want), "forward_wt");
                    // the fused backwards against their halves on rounded
                    // operands ([in, out] then [out, in] weights)
                    type Full<T> = fn(
                        &mut [T],
                        &mut [T],
                        Option<&mut [T]>,
                        &[T],
                        &[T],
                        &[T],
                        usize,
                        usize,
                        usize,
                        usize,
                        Mode,
                        Precision,
                    ) -> Result<()>;
                    type Input<T> = fn(
                        &mut [T],
                        &[T],
                        &[T],
                        usize,
                        usize,
                        usize,
                        usize,
                        Mode,
                        Precision,
                    ) -> Result<()>;
                    type Weight<T> = fn(
                        &mut [T],
                        Option<&mut [T]>,
                        &[T],
                        &[T],
                        usize,
                        usize,
                        usize,
                        usize,
                        Precision,
                    ) -> Result<()>;
                    type Kernels<T> = (&'static str, Full<T>, Input<T>, Weight<T>);
                    let kernels: [Kernels<T>; 2] = [
                        (
                            "backward",
                            |dx, dw, db, dy, x, w, b, t, c, oc, mode, p| {
                                matmul_backward(dx, dw, db, dy, x, w, b, t, c, oc, mode, p)
                            },
                            matmul_backward_input,
                            |dw, db, dy, x, b, t, c, oc, p| {
                                matmul_backward_weight(dw, db, dy, x, b, t, c, oc, p)
                            },
                        ),
                        (
                            "backward_wt",
                            matmul_backward_wt,
                            matmul_backward_wt_input,
                            matmul_backward_wt_weight,
                        ),
                    ];
                    for (name, full, input, weight) in kernels {
                        let (mut dx, mut dw, mut db) = (v(n * c, 45), v(c * oc, 46), v(oc, 47));
                        let (mut dx2, mut dw2, mut db2) = (dx.clone(), dw.clone(), db.clone());
                        full(
                            &mut dx,
                            &mut dw,
                            Some(&mut db),
                            &dy,
                            &x,
                            &w,
                            b,
                            t,
                            c,
                            oc,
                            mode,
                            h,
                        )
                        .unwrap();
                        input(&mut dx2, &dyr, &wr, b, t, c, oc, mode, f).unwrap();
                        weight(&mut dw2, None, &dyr, &xr, b, t, c, oc, f).unwrap();
                        bias_backward(&mut db2, &dy);
                        assert_eq!(bits(&dx), bits(&dx2), "{name}: input");
                        assert_eq!(bits(&dw), bits(&dw2), "{name}: weight");
                        assert_eq!(bits(&db), bits(&db2), "{name}: bias");
                    }
                }
            }
        }
        check::<f32>(1.0);
        check::<f64>(1.0);
        // values near the ends of fp16's range: subnormal operands, and
        // products that overflow to infinity
        check::<f32>(1e-6);
        check::<f32>(3e4);
    }

    /// fp16 operands round to 11 significant bits: a product is off the
    /// f32 one by about 2⁻¹¹ relative, and the rounding is what changes it
    /// (f32 values already on the fp16 grid give the f32 bits).
    #[test]
    fn fp16_products_are_off_f32_by_fp16_rounding() {
        let (b, t, c, oc) = (2, 8, 256, 64);
        let n = b * t;
        let x = f32s(&rand_vec(n * c, 51));
        let w = f32s(&rand_vec(c * oc, 52));
        let mode = Mode::Throughput;
        let (mut y16, mut y32) = (vec![0f32; n * oc], vec![0f32; n * oc]);
        matmul_forward(&mut y16, &x, &w, None, b, t, c, oc, mode, Precision::F16).unwrap();
        matmul_forward(&mut y32, &x, &w, None, b, t, c, oc, mode, Precision::F32).unwrap();
        let scale = y32.iter().map(|v| v.abs()).fold(0f32, f32::max);
        let worst = y16
            .iter()
            .zip(&y32)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst > 0.0 && worst < 4.0 * scale * 2f32.powi(-11),
            "{worst} vs {scale}"
        );
        let (xr, wr): (Vec<f32>, Vec<f32>) = (
            x.iter()
                .map(|&v| fp16::round_f64(f64::from(v)) as f32)
                .collect(),
            w.iter()
                .map(|&v| fp16::round_f64(f64::from(v)) as f32)
                .collect(),
        );
        matmul_forward(&mut y16, &xr, &wr, None, b, t, c, oc, mode, Precision::F16).unwrap();
        matmul_forward(&mut y32, &xr, &wr, None, b, t, c, oc, mode, Precision::F32).unwrap();
        assert_eq!(y16, y32);
    }

    /// bf16 against an f64 reference of the rounded operands: every output
    /// within `(k + 2)·2⁻²⁴·Σ|a·b|` (f32 accumulation of exact products),
    /// and off the f32 product by about bf16's 2⁻⁹ relative rounding.
    #[test]
    fn bf16_forward_and_backward_match_an_f64_reference_of_the_rounded_values() {
        let (b, t, c, oc) = (2, 7, 300, 45);
        let n = b * t;
        // f32-representable values, so that rounding to bf16 from f64 and
        // from f32 agree (f64 → f32 → bf16 could round twice)
        let f = |v: Vec<f64>| -> Vec<f64> { v.iter().map(|&x| f64::from(x as f32)).collect() };
        let x = f(rand_vec(n * c, 31));
        let w = f(rand_vec(c * oc, 32));
        let dy = f(rand_vec(n * oc, 33));
        let r = |v: &[f64]| -> Vec<f64> {
            v.iter()
                .map(|&x| {
                    let want = f64::from(bf16::from_f32(x as f32).to_f32());
                    assert_eq!(round_bf16(x).to_bits(), want.to_bits(), "{x}");
                    want
                })
                .collect()
        };
        let (xr, wr, dyr) = (r(&x), r(&w), r(&dy));
        let (x32, w32, dy32) = (f32s(&x), f32s(&w), f32s(&dy));
        let u = f64::from(f32::EPSILON) / 2.0;
        let mode = Mode::Throughput;
        let mut y = vec![0f32; n * oc];
        matmul_forward(&mut y, &x32, &w32, None, b, t, c, oc, mode, Precision::Bf16).unwrap();
        let mut y64 = vec![0f64; n * oc];
        matmul_forward(&mut y64, &x, &w, None, b, t, c, oc, mode, Precision::Bf16).unwrap();
        let mut dx = vec![0f32; n * c];
        matmul_backward_input(&mut dx, &dy32, &w32, b, t, c, oc, mode, Precision::Bf16).unwrap();
        let mut dw = vec![0f32; c * oc];
        matmul_backward_weight(&mut dw, None, &dy32, &x32, b, t, c, oc, Precision::Bf16).unwrap();
        for i in 0..n {
            for o in 0..oc {
                let terms = (0..c).map(|k| xr[i * c + k] * wr[k * oc + o]);
                let (want, mag): (f64, f64) =
                    terms.fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()));
                let got = f64::from(y[i * oc + o]);
                assert!((got - want).abs() <= (c + 2) as f64 * u * mag, "y[{i},{o}]");
                assert!(
                    (y64[i * oc + o] - want).abs() <= 1e-12 * mag,
                    "f64 y[{i},{o}]"
                );
                // bf16 is not f32: the unrounded product differs by far more
                let exact: f64 = (0..c).map(|k| x[i * c + k] * w[k * oc + o]).sum();
                assert!((got - exact).abs() <= 2f64.powi(-7) * mag);
            }
            for k in 0..c {
                let terms = (0..oc).map(|o| dyr[i * oc + o] * wr[k * oc + o]);
                let (want, mag): (f64, f64) =
                    terms.fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()));
                let got = f64::from(dx[i * c + k]);
                assert!(
                    (got - want).abs() <= (oc + 2) as f64 * u * mag,
                    "dx[{i},{k}]"
                );
            }
        }
        for k in 0..c {
            for o in 0..oc {
                let terms = (0..n).map(|i| xr[i * c + k] * dyr[i * oc + o]);
                let (want, mag): (f64, f64) =
                    terms.fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()));
                let got = f64::from(dw[k * oc + o]);
                assert!(
                    (got - want).abs() <= (n + 2) as f64 * u * mag,
                    "dw[{k},{o}]"
                );
            }
        }
    }

    /// In bf16 a sequence's forward and input gradient have the same bits
    /// alone as inside a batch, in both modes.
    #[test]
    fn bf16_rows_are_batch_invariant() {
        let (b, t, c, oc) = (4, 9, 80, 130);
        let x = f32s(&rand_vec(b * t * c, 41));
        let w = f32s(&rand_vec(c * oc, 42));
        let dy = f32s(&rand_vec(b * t * oc, 43));
        let p = Precision::Bf16;
        for mode in [Mode::BatchInvariant, Mode::Throughput] {
            let mut y = vec![0f32; b * t * oc];
            matmul_forward(&mut y, &x, &w, None, b, t, c, oc, mode, p).unwrap();
            let mut dx = vec![0f32; b * t * c];
            matmul_backward_input(&mut dx, &dy, &w, b, t, c, oc, mode, p).unwrap();
            for s in [0, 2] {
                let xs = &x[s * t * c..(s + 1) * t * c];
                let mut y1 = vec![0f32; t * oc];
                matmul_forward(&mut y1, xs, &w, None, 1, t, c, oc, mode, p).unwrap();
                assert!(
                    y1.iter()
                        .zip(&y[s * t * oc..])
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                );
                let mut dx1 = vec![0f32; t * c];
                let dys = &dy[s * t * oc..(s + 1) * t * oc];
                matmul_backward_input(&mut dx1, dys, &w, 1, t, c, oc, mode, p).unwrap();
                assert!(
                    dx1.iter()
                        .zip(&dx[s * t * c..])
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                );
            }
        }
    }
}
