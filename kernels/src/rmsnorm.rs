//! Root-mean-square normalisation over the channel dimension (Zhang &
//! Sennrich 2019), the norm of Llama, Qwen, Mistral and DeepSeek.

use rayon::prelude::*;

use crate::Real;
use crate::error::{Result, check};

/// `out = inp · rstd · weight` per row of C channels, with
/// `rstd = 1 / sqrt(mean(inp²) + eps)` (transformers' `LlamaRMSNorm`: no
/// mean subtraction, no bias). Saves `rstd (N)` for the backward.
/// `N = B*T` rows (or `B*T*NH` rows of one head's channels, for QK-norm).
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_forward<T: Real>(
    out: &mut [T],
    rstd: &mut [T],
    inp: &[T],
    weight: &[T],
    n: usize,
    c: usize,
    eps: T,
) -> Result<()> {
    const OP: &str = "rmsnorm_forward";
    check(OP, "out", out, n * c)?;
    check(OP, "rstd", rstd, n)?;
    check(OP, "inp", inp, n * c)?;
    check(OP, "weight", weight, c)?;
    if c == 0 {
        return Ok(());
    }
    out.par_chunks_mut(c)
        .zip(inp.par_chunks(c))
        .zip(rstd.par_iter_mut())
        .with_min_len(16)
        .for_each(|((o, x), r)| rms_row(o, r, x, weight, eps));
    Ok(())
}

crate::simd::multiversion! {
    fn rms_row<T: Real>(o: &mut [T], r: &mut T, x: &[T], w: &[T], eps: T) {
        let cf = T::from_f64(x.len() as f64);
        let mut acc = [T::ZERO; 16];
        let chunks = x.chunks_exact(16);
        let rest = chunks.remainder();
        for ch in chunks {
            for i in 0..16 {
                acc[i] += ch[i] * ch[i];
            }
        }
        let mut ss = crate::real::sum_lanes(&acc);
        for &v in rest {
            ss += v * v;
        }
        let rs = T::ONE / (ss / cf + eps).sqrt();
        for i in 0..x.len() {
            o[i] = x[i] * rs * w[i];
        }
        *r = rs;
    }
}

/// Backward of [`rmsnorm_forward`], accumulating into `dinp` and
/// `dweight`: [`rmsnorm_backward_input`] then
/// [`rmsnorm_backward_weight`], bit for bit.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward<T: Real>(
    dinp: &mut [T],
    dweight: &mut [T],
    dout: &[T],
    inp: &[T],
    weight: &[T],
    rstd: &[T],
    n: usize,
    c: usize,
) -> Result<()> {
    check("rmsnorm_backward", "dweight", dweight, c)?;
    rmsnorm_backward_input(dinp, dout, inp, weight, rstd, n, c)?;
    rmsnorm_backward_weight(dweight, dout, inp, rstd, n, c)
}

/// The input-gradient half of [`rmsnorm_backward`]: with `x̂ = x·rstd` and
/// `ĝ = g·weight`, `dinp += rstd · (ĝ - x̂ · mean(ĝ ⊙ x̂))`.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward_input<T: Real>(
    dinp: &mut [T],
    dout: &[T],
    inp: &[T],
    weight: &[T],
    rstd: &[T],
    n: usize,
    c: usize,
) -> Result<()> {
    const OP: &str = "rmsnorm_backward_input";
    check(OP, "dinp", dinp, n * c)?;
    check(OP, "dout", dout, n * c)?;
    check(OP, "inp", inp, n * c)?;
    check(OP, "weight", weight, c)?;
    check(OP, "rstd", rstd, n)?;
    if c == 0 {
        return Ok(());
    }
    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c).zip(inp.par_chunks(c)))
        .zip(rstd.par_iter())
        .with_min_len(16)
        .for_each(|((di, (g, x)), &r)| rms_back_row(di, g, x, weight, r));
    Ok(())
}

/// The parameter-gradient half of [`rmsnorm_backward`]: accumulates
/// `dweight += Σ_rows g · x · rstd`.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
pub fn rmsnorm_backward_weight<T: Real>(
    dweight: &mut [T],
    dout: &[T],
    inp: &[T],
    rstd: &[T],
    n: usize,
    c: usize,
) -> Result<()> {
    const OP: &str = "rmsnorm_backward_weight";
    check(OP, "dweight", dweight, c)?;
    check(OP, "dout", dout, n * c)?;
    check(OP, "inp", inp, n * c)?;
    check(OP, "rstd", rstd, n)?;
    if c == 0 {
        return Ok(());
    }
    rms_back_params(dweight, dout, inp, rstd);
    Ok(())
}

crate::simd::multiversion! {
    fn rms_back_row<T: Real>(di: &mut [T], g: &[T], x: &[T], w: &[T], r: T) {
        let cf = T::from_f64(x.len() as f64);
        let mut acc = [T::ZERO; 16];
        let mut tail = T::ZERO;
        let n16 = x.len() / 16 * 16;
        for j in (0..n16).step_by(16) {
            for i in 0..16 {
                acc[i] += w[j + i] * g[j + i] * x[j + i] * r;
            }
        }
        for j in n16..x.len() {
            tail += w[j] * g[j] * x[j] * r;
        }
        let m = (crate::real::sum_lanes(&acc) + tail) / cf;
        for i in 0..x.len() {
            di[i] += (w[i] * g[i] - x[i] * r * m) * r;
        }
    }
}

crate::simd::multiversion! {
    fn rms_back_params<T: Real>(dw: &mut [T], dout: &[T], inp: &[T], rstd: &[T]) {
        let c = dw.len();
        for (row, (g, x)) in dout.chunks_exact(c).zip(inp.chunks_exact(c)).enumerate() {
            let r = rstd[row];
            for i in 0..c {
                dw[i] += x[i] * r * g[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_grads, rand_vec};

    #[test]
    fn gradients_match_finite_differences() {
        let (n, c) = (5, 19);
        let inputs = vec![rand_vec(n * c, 1), rand_vec(c, 2)];
        let eps = 1e-6;
        check_grads(
            &inputs,
            n * c,
            |ins, out| {
                let mut r = vec![0.0; n];
                rmsnorm_forward(out, &mut r, &ins[0], &ins[1], n, c, eps).unwrap();
            },
            |ins, dout, grads| {
                let mut r = vec![0.0; n];
                let mut out = vec![0.0; n * c];
                rmsnorm_forward(&mut out, &mut r, &ins[0], &ins[1], n, c, eps).unwrap();
                let [gx, gw] = grads else { unreachable!() };
                rmsnorm_backward(gx, gw, dout, &ins[0], &ins[1], &r, n, c).unwrap();
            },
        );
    }

    /// The definition, in f64: each row divided by its root mean square.
    #[test]
    fn forward_is_the_definition() {
        let (n, c) = (4, 37);
        let x = rand_vec(n * c, 5);
        let w = rand_vec(c, 6);
        let (mut out, mut r) = (vec![0.0; n * c], vec![0.0; n]);
        rmsnorm_forward(&mut out, &mut r, &x, &w, n, c, 1e-5).unwrap();
        for (row, (o, xr)) in out.chunks(c).zip(x.chunks(c)).enumerate() {
            let rms = (xr.iter().map(|v| v * v).sum::<f64>() / c as f64 + 1e-5).sqrt();
            assert!((r[row] - 1.0 / rms).abs() < 1e-14);
            for i in 0..c {
                assert!((o[i] - xr[i] / rms * w[i]).abs() < 1e-14);
            }
        }
    }
}
