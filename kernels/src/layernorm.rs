//! Layer normalisation over the channel dimension.

use rayon::prelude::*;

use crate::Real;
use crate::error::{Result, check};

/// `out = (inp - mean) * rstd * weight + bias` per row of C channels, with
/// `rstd = 1 / sqrt(var + eps)` (population variance, as PyTorch). Saves
/// `mean (N)` and `rstd (N)` for the backward. `N = B*T` rows.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward<T: Real>(
    out: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
    inp: &[T],
    weight: &[T],
    bias: &[T],
    n: usize,
    c: usize,
    eps: T,
) -> Result<()> {
    const OP: &str = "layernorm_forward";
    check(OP, "out", out, n * c)?;
    check(OP, "mean", mean, n)?;
    check(OP, "rstd", rstd, n)?;
    check(OP, "inp", inp, n * c)?;
    check(OP, "weight", weight, c)?;
    check(OP, "bias", bias, c)?;
    if c == 0 {
        return Ok(());
    }
    out.par_chunks_mut(c)
        .zip(inp.par_chunks(c))
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        .with_min_len(16)
        .for_each(|((o, x), (m, r))| ln_row(o, m, r, x, weight, bias, eps));
    Ok(())
}

crate::simd::multiversion! {
    fn ln_row<T: Real>(o: &mut [T], m: &mut T, r: &mut T, x: &[T], w: &[T], b: &[T], eps: T) {
        let cf = T::from_f64(x.len() as f64);
        let mu = crate::real::sum_lanes(x) / cf;
        let mut acc = [T::ZERO; 16];
        let chunks = x.chunks_exact(16);
        let rest = chunks.remainder();
        for ch in chunks {
            for i in 0..16 {
                let d = ch[i] - mu;
                acc[i] += d * d;
            }
        }
        let mut var = crate::real::sum_lanes(&acc);
        for &v in rest {
            var += (v - mu) * (v - mu);
        }
        let rs = T::ONE / (var / cf + eps).sqrt();
        for i in 0..x.len() {
            o[i] = (x[i] - mu) * rs * w[i] + b[i];
        }
        *m = mu;
        *r = rs;
    }
}

/// Backward of [`layernorm_forward`], accumulating into `dinp`, `dweight`
/// and `dbias`: [`layernorm_backward_input`] then
/// [`layernorm_backward_weight`], bit for bit.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<T: Real>(
    dinp: &mut [T],
    dweight: &mut [T],
    dbias: &mut [T],
    dout: &[T],
    inp: &[T],
    weight: &[T],
    mean: &[T],
    rstd: &[T],
    n: usize,
    c: usize,
) -> Result<()> {
    const OP: &str = "layernorm_backward";
    check(OP, "dweight", dweight, c)?;
    check(OP, "dbias", dbias, c)?;
    layernorm_backward_input(dinp, dout, inp, weight, mean, rstd, n, c)?;
    layernorm_backward_weight(dweight, dbias, dout, inp, mean, rstd, n, c)
}

/// The input-gradient half of [`layernorm_backward`]: accumulates `dinp`
/// only.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_input<T: Real>(
    dinp: &mut [T],
    dout: &[T],
    inp: &[T],
    weight: &[T],
    mean: &[T],
    rstd: &[T],
    n: usize,
    c: usize,
) -> Result<()> {
    const OP: &str = "layernorm_backward_input";
    check(OP, "dinp", dinp, n * c)?;
    check(OP, "dout", dout, n * c)?;
    check(OP, "inp", inp, n * c)?;
    check(OP, "weight", weight, c)?;
    check(OP, "mean", mean, n)?;
    check(OP, "rstd", rstd, n)?;
    if c == 0 {
        return Ok(());
    }
    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c).zip(inp.par_chunks(c)))
        .zip(mean.par_iter().zip(rstd.par_iter()))
        .with_min_len(16)
        .for_each(|((di, (g, x)), (&m, &r))| ln_back_row(di, g, x, weight, m, r));
    Ok(())
}

/// The parameter-gradient half of [`layernorm_backward`]: accumulates
/// `dweight` and `dbias`, summed over the `n` rows.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_weight<T: Real>(
    dweight: &mut [T],
    dbias: &mut [T],
    dout: &[T],
    inp: &[T],
    mean: &[T],
    rstd: &[T],
    n: usize,
    c: usize,
) -> Result<()> {
    const OP: &str = "layernorm_backward_weight";
    check(OP, "dweight", dweight, c)?;
    check(OP, "dbias", dbias, c)?;
    check(OP, "dout", dout, n * c)?;
    check(OP, "inp", inp, n * c)?;
    check(OP, "mean", mean, n)?;
    check(OP, "rstd", rstd, n)?;
    if c == 0 {
        return Ok(());
    }
    ln_back_params(dweight, dbias, dout, inp, mean, rstd);
    Ok(())
}

crate::simd::multiversion! {
    fn ln_back_row<T: Real>(di: &mut [T], g: &[T], x: &[T], w: &[T], m: T, r: T) {
        let cf = T::from_f64(x.len() as f64);
        // dnorm = w * g; need mean(dnorm) and mean(dnorm * norm).
        let mut a = T::ZERO;
        let mut bsum = T::ZERO;
        let mut acc_a = [T::ZERO; 16];
        let mut acc_b = [T::ZERO; 16];
        let n16 = x.len() / 16 * 16;
        for j in (0..n16).step_by(16) {
            for i in 0..16 {
                let dn = w[j + i] * g[j + i];
                acc_a[i] += dn;
                acc_b[i] += dn * (x[j + i] - m) * r;
            }
        }
        for j in n16..x.len() {
            let dn = w[j] * g[j];
            a += dn;
            bsum += dn * (x[j] - m) * r;
        }
        let a = (crate::real::sum_lanes(&acc_a) + a) / cf;
        let bm = (crate::real::sum_lanes(&acc_b) + bsum) / cf;
        for i in 0..x.len() {
            let norm = (x[i] - m) * r;
            di[i] += (w[i] * g[i] - a - norm * bm) * r;
        }
    }
}

crate::simd::multiversion! {
    fn ln_back_params<T: Real>(dw: &mut [T], db: &mut [T], dout: &[T], inp: &[T], mean: &[T], rstd: &[T]) {
        let c = dw.len();
        for (row, (g, x)) in dout.chunks_exact(c).zip(inp.chunks_exact(c)).enumerate() {
            let (m, r) = (mean[row], rstd[row]);
            for i in 0..c {
                dw[i] += (x[i] - m) * r * g[i];
                db[i] += g[i];
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
        let inputs = vec![rand_vec(n * c, 1), rand_vec(c, 2), rand_vec(c, 3)];
        let eps = 1e-5;
        check_grads(
            &inputs,
            n * c,
            |ins, out| {
                let (mut m, mut r) = (vec![0.0; n], vec![0.0; n]);
                layernorm_forward(out, &mut m, &mut r, &ins[0], &ins[1], &ins[2], n, c, eps)
                    .unwrap();
            },
            |ins, dout, grads| {
                let (mut m, mut r) = (vec![0.0; n], vec![0.0; n]);
                let mut out = vec![0.0; n * c];
                layernorm_forward(
                    &mut out, &mut m, &mut r, &ins[0], &ins[1], &ins[2], n, c, eps,
                )
                .unwrap();
                let [gx, gw, gb] = grads else { unreachable!() };
                layernorm_backward(gx, gw, gb, dout, &ins[0], &ins[1], &m, &r, n, c).unwrap();
            },
        );
    }

    #[test]
    fn forward_normalises() {
        let (n, c) = (3, 40);
        let x: Vec<f32> = rand_vec(n * c, 7)
            .iter()
            .map(|&v| v as f32 * 3.0 + 1.0)
            .collect();
        let (mut out, mut m, mut r) = (vec![0.0f32; n * c], vec![0.0f32; n], vec![0.0f32; n]);
        layernorm_forward(
            &mut out, &mut m, &mut r, &x, &[1.0; 40], &[0.0; 40], n, c, 1e-5,
        )
        .unwrap();
        for row in out.chunks(c) {
            let mu: f32 = row.iter().sum::<f32>() / 40.0;
            let var: f32 = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / 40.0;
            assert!(mu.abs() < 1e-6 && (var - 1.0).abs() < 1e-4);
        }
    }
}
