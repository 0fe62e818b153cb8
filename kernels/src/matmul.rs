//! Linear layers: `out = inp · weight + bias`, weight in `[in, out]`
//! layout (Hugging Face GPT-2's `Conv1D`).

use crate::error::{Result, check};
use crate::gemm::{View, gemm};
use crate::{Mode, Real};

/// `out (B,T,OC) = inp (B,T,C) · weight (C,OC) + bias (OC)`.
///
/// In [`Mode::BatchInvariant`] each sequence is one GEMM of `T` rows, so a
/// sequence's output does not depend on the batch around it; in
/// [`Mode::Throughput`] the whole batch is one GEMM.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) if a buffer's
/// length does not match `b`, `t`, `c`, `oc`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward<T: Real>(
    out: &mut [T],
    inp: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    b: usize,
    t: usize,
    c: usize,
    oc: usize,
    mode: Mode,
) -> Result<()> {
    const OP: &str = "matmul_forward";
    check(OP, "out", out, b * t * oc)?;
    check(OP, "inp", inp, b * t * c)?;
    check(OP, "weight", weight, c * oc)?;
    if let Some(bias) = bias {
        check(OP, "bias", bias, oc)?;
    }
    let (groups, rows) = match mode {
        Mode::BatchInvariant => (b, t),
        Mode::Throughput => (1, b * t),
    };
    for g in 0..groups {
        let o = &mut out[g * rows * oc..(g + 1) * rows * oc];
        let x = &inp[g * rows * c..(g + 1) * rows * c];
        if let Some(bias) = bias {
            for row in o.chunks_exact_mut(oc) {
                row.copy_from_slice(bias);
            }
        }
        gemm(
            rows,
            oc,
            c,
            o,
            oc,
            bias.is_some(),
            View::rows(x, c),
            View::rows(weight, oc),
            T::ONE,
            true,
        );
    }
    Ok(())
}

/// Backward of [`matmul_forward`], accumulating (`+=`):
/// `dinp += dout · weightᵀ`, `dweight += inpᵀ · dout`, `dbias += Σ dout`.
///
/// `dinp` is computed per sequence in [`Mode::BatchInvariant`], like the
/// forward; `dweight` and `dbias` sum over the batch by nature.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward<T: Real>(
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
) -> Result<()> {
    const OP: &str = "matmul_backward";
    check(OP, "dinp", dinp, b * t * c)?;
    check(OP, "dweight", dweight, c * oc)?;
    check(OP, "dout", dout, b * t * oc)?;
    check(OP, "inp", inp, b * t * c)?;
    check(OP, "weight", weight, c * oc)?;
    if let Some(db) = &dbias {
        check(OP, "dbias", db, oc)?;
    }
    let (groups, rows) = match mode {
        Mode::BatchInvariant => (b, t),
        Mode::Throughput => (1, b * t),
    };
    for g in 0..groups {
        gemm(
            rows,
            c,
            oc,
            &mut dinp[g * rows * c..(g + 1) * rows * c],
            c,
            true,
            View::rows(&dout[g * rows * oc..(g + 1) * rows * oc], oc),
            View::t(weight, oc),
            T::ONE,
            true,
        );
    }
    let n = b * t;
    gemm(
        c,
        oc,
        n,
        dweight,
        oc,
        true,
        View::t(inp, c),
        View::rows(dout, oc),
        T::ONE,
        true,
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
) -> Result<()> {
    const OP: &str = "matmul_forward_wt";
    check(OP, "out", out, b * t * oc)?;
    check(OP, "inp", inp, b * t * c)?;
    check(OP, "weight", weight, c * oc)?;
    if let Some(bias) = bias {
        check(OP, "bias", bias, oc)?;
    }
    let (groups, rows) = match mode {
        Mode::BatchInvariant => (b, t),
        Mode::Throughput => (1, b * t),
    };
    for g in 0..groups {
        let o = &mut out[g * rows * oc..(g + 1) * rows * oc];
        let x = &inp[g * rows * c..(g + 1) * rows * c];
        if let Some(bias) = bias {
            for row in o.chunks_exact_mut(oc) {
                row.copy_from_slice(bias);
            }
        }
        gemm(
            rows,
            oc,
            c,
            o,
            oc,
            bias.is_some(),
            View::rows(x, c),
            View::t(weight, c),
            T::ONE,
            true,
        );
    }
    Ok(())
}

/// Backward of [`matmul_forward_wt`] (`weight (OC,C)`), accumulating:
/// `dinp += dout · weight`, `dweight += doutᵀ · inp`, `dbias += Σ dout`.
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
    let (groups, rows) = match mode {
        Mode::BatchInvariant => (b, t),
        Mode::Throughput => (1, b * t),
    };
    for g in 0..groups {
        gemm(
            rows,
            c,
            oc,
            &mut dinp[g * rows * c..(g + 1) * rows * c],
            c,
            true,
            View::rows(&dout[g * rows * oc..(g + 1) * rows * oc], oc),
            View::rows(weight, c),
            T::ONE,
            true,
        );
    }
    let n = b * t;
    gemm(
        oc,
        c,
        n,
        dweight,
        c,
        true,
        View::t(dout, oc),
        View::rows(inp, c),
        T::ONE,
        true,
    );
    if let Some(db) = dbias {
        bias_backward(db, dout);
    }
    Ok(())
}

crate::simd::multiversion! {
    fn bias_backward<T: Real>(db: &mut [T], dout: &[T]) {
        let oc = db.len();
        for row in dout.chunks_exact(oc) {
            for (d, &g) in db.iter_mut().zip(row) {
                *d += g;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_grads, rand_vec};

    #[test]
    fn forward_matches_naive_f64() {
        let (b, t, c, oc) = (2, 3, 5, 7);
        let x = rand_vec(b * t * c, 1);
        let w = rand_vec(c * oc, 2);
        let bias = rand_vec(oc, 3);
        for mode in [Mode::BatchInvariant, Mode::Throughput] {
            let mut out = vec![0.0; b * t * oc];
            matmul_forward(&mut out, &x, &w, Some(&bias), b, t, c, oc, mode).unwrap();
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
        matmul_forward_wt(&mut out, &x, &w, None, b, t, c, oc, Mode::BatchInvariant).unwrap();
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
                )
                .unwrap();
            },
        );
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
}
