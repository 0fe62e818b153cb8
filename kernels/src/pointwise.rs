//! Element-wise ops: GELU (tanh approximation), SwiGLU's gate and the
//! residual add.

use rayon::prelude::*;

use crate::Real;
use crate::error::{Result, check};

const CHUNK: usize = 4096;

/// `out = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, the tanh
/// approximation GPT-2 uses (PyTorch's `gelu(approximate="tanh")`,
/// transformers' `gelu_new`).
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) if `out` and `inp`
/// differ in length from `n`.
pub fn gelu_forward<T: Real>(out: &mut [T], inp: &[T], n: usize) -> Result<()> {
    check("gelu_forward", "out", out, n)?;
    check("gelu_forward", "inp", inp, n)?;
    out.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(o, x)| gelu_chunk(o, x));
    Ok(())
}

crate::simd::multiversion! {
    fn gelu_chunk<T: Real>(o: &mut [T], x: &[T]) {
        let s = T::from_f64((2.0 / std::f64::consts::PI).sqrt());
        let k = T::from_f64(0.044715);
        let two = T::from_f64(2.0);
        // 0.5·(1 + tanh(u)) = σ(2u): no cancellation where tanh(u) ≈ -1.
        for (o, &x) in o.iter_mut().zip(x) {
            let u = s * (x + k * x * x * x);
            *o = x / (T::ONE + (-two * u).exp());
        }
    }
}

/// Backward of [`gelu_forward`]: `dinp += gelu'(inp) · dout`.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
pub fn gelu_backward<T: Real>(dinp: &mut [T], inp: &[T], dout: &[T], n: usize) -> Result<()> {
    check("gelu_backward", "dinp", dinp, n)?;
    check("gelu_backward", "inp", inp, n)?;
    check("gelu_backward", "dout", dout, n)?;
    dinp.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK).zip(dout.par_chunks(CHUNK)))
        .for_each(|(d, (x, g))| gelu_back_chunk(d, x, g));
    Ok(())
}

crate::simd::multiversion! {
    fn gelu_back_chunk<T: Real>(d: &mut [T], x: &[T], g: &[T]) {
        let s = T::from_f64((2.0 / std::f64::consts::PI).sqrt());
        let k = T::from_f64(0.044715);
        let k3 = T::from_f64(3.0 * 0.044715);
        let two = T::from_f64(2.0);
        // With σ = σ(2u) = 0.5·(1 + tanh u): sech²u = 4σ(1-σ), so
        // gelu'(x) = σ + 2xσ(1-σ)·u'(x).
        for ((d, &x), &g) in d.iter_mut().zip(x).zip(g) {
            let u = s * (x + k * x * x * x);
            let sig = T::ONE / (T::ONE + (-two * u).exp());
            let grad = sig + two * x * sig * (T::ONE - sig) * s * (T::ONE + k3 * x * x);
            *d += grad * g;
        }
    }
}

/// SwiGLU's gate (Shazeer 2020): `out = silu(gate) ⊙ up`, with
/// `silu(x) = x·σ(x)` (transformers' `LlamaMLP`,
/// `act_fn(gate_proj(x)) * up_proj(x)`). `inp (N, 2H)` holds each row's
/// gate projection then its up projection (one fused matmul's output);
/// `out` is `(N, H)`.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
pub fn swiglu_forward<T: Real>(out: &mut [T], inp: &[T], n: usize, h: usize) -> Result<()> {
    check("swiglu_forward", "out", out, n * h)?;
    check("swiglu_forward", "inp", inp, n * 2 * h)?;
    if h == 0 {
        return Ok(());
    }
    out.par_chunks_mut(h)
        .zip(inp.par_chunks(2 * h))
        .with_min_len(4)
        .for_each(|(o, x)| {
            let (g, u) = x.split_at(h);
            swiglu_row(o, g, u);
        });
    Ok(())
}

crate::simd::multiversion! {
    fn swiglu_row<T: Real>(o: &mut [T], g: &[T], u: &[T]) {
        // torch's silu: x / (1 + exp(-x)).
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = g / (T::ONE + (-g).exp()) * u;
        }
    }
}

/// Backward of [`swiglu_forward`]: `dinp += (dgate, dup)` with
/// `dup = dout ⊙ silu(gate)` and `dgate = dout ⊙ up ⊙ σ(gate)·(1 +
/// gate·(1 - σ(gate)))`.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
pub fn swiglu_backward<T: Real>(
    dinp: &mut [T],
    inp: &[T],
    dout: &[T],
    n: usize,
    h: usize,
) -> Result<()> {
    check("swiglu_backward", "dinp", dinp, n * 2 * h)?;
    check("swiglu_backward", "inp", inp, n * 2 * h)?;
    check("swiglu_backward", "dout", dout, n * h)?;
    if h == 0 {
        return Ok(());
    }
    dinp.par_chunks_mut(2 * h)
        .zip(inp.par_chunks(2 * h).zip(dout.par_chunks(h)))
        .with_min_len(4)
        .for_each(|(d, (x, go))| {
            let (dg, du) = d.split_at_mut(h);
            let (g, u) = x.split_at(h);
            swiglu_back_row(dg, du, g, u, go);
        });
    Ok(())
}

crate::simd::multiversion! {
    fn swiglu_back_row<T: Real>(dg: &mut [T], du: &mut [T], g: &[T], u: &[T], go: &[T]) {
        for i in 0..go.len() {
            let sig = T::ONE / (T::ONE + (-g[i]).exp());
            let silu = g[i] * sig;
            du[i] += go[i] * silu;
            dg[i] += go[i] * u[i] * sig * (T::ONE + g[i] * (T::ONE - sig));
        }
    }
}

/// `out = a + b`.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
pub fn residual_forward<T: Real>(out: &mut [T], a: &[T], b: &[T], n: usize) -> Result<()> {
    check("residual_forward", "out", out, n)?;
    check("residual_forward", "a", a, n)?;
    check("residual_forward", "b", b, n)?;
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(o, (a, b))| add_chunk(o, a, b));
    Ok(())
}

crate::simd::multiversion! {
    fn add_chunk<T: Real>(o: &mut [T], a: &[T], b: &[T]) {
        for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
            *o = a + b;
        }
    }
}

crate::simd::multiversion! {
    fn acc_chunk<T: Real>(d: &mut [T], g: &[T]) {
        for (d, &g) in d.iter_mut().zip(g) {
            *d += g;
        }
    }
}

/// Backward of [`residual_forward`]: `da += dout`, `db += dout`.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
pub fn residual_backward<T: Real>(da: &mut [T], db: &mut [T], dout: &[T], n: usize) -> Result<()> {
    check("residual_backward", "da", da, n)?;
    check("residual_backward", "db", db, n)?;
    check("residual_backward", "dout", dout, n)?;
    accumulate(da, dout);
    accumulate(db, dout);
    Ok(())
}

/// `dst += src`, element-wise and in parallel (lengths must match).
pub(crate) fn accumulate<T: Real>(dst: &mut [T], src: &[T]) {
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| acc_chunk(d, s));
}

/// Elements per task of [`zero`]: 256 KiB of f32, large enough that the
/// pool's scheduling cost is negligible beside the stores.
const ZERO_CHUNK: usize = 1 << 16;

/// Every element to zero, in parallel when there is more than one chunk.
pub(crate) fn zero<T: Real>(buf: &mut [T]) {
    if buf.len() <= ZERO_CHUNK {
        buf.fill(T::ZERO);
    } else {
        buf.par_chunks_mut(ZERO_CHUNK).for_each(|c| c.fill(T::ZERO));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_grads, rand_vec};

    #[test]
    fn gelu_gradient_matches_finite_differences() {
        let n = 50;
        let x: Vec<f64> = rand_vec(n, 3).iter().map(|v| v * 4.0).collect();
        check_grads(
            &[x],
            n,
            |ins, out| gelu_forward(out, &ins[0], n).unwrap(),
            |ins, dout, g| gelu_backward(&mut g[0], &ins[0], dout, n).unwrap(),
        );
    }

    #[test]
    fn gelu_f32_matches_formula_in_f64() {
        let x: Vec<f64> = rand_vec(1000, 5).iter().map(|v| v * 8.0).collect();
        let xf: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        let mut out = vec![0.0f32; 1000];
        gelu_forward(&mut out, &xf, 1000).unwrap();
        for (&o, &v) in out.iter().zip(&xf) {
            let v = f64::from(v);
            let want = 0.5
                * v
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh());
            assert!(
                (f64::from(o) - want).abs() <= 1e-6 * want.abs().max(1e-3),
                "{v}: {o} vs {want}"
            );
        }
    }

    #[test]
    fn swiglu_gradient_matches_finite_differences() {
        let (n, h) = (3, 7);
        let x: Vec<f64> = rand_vec(n * 2 * h, 4).iter().map(|v| v * 5.0).collect();
        check_grads(
            &[x],
            n * h,
            |ins, out| swiglu_forward(out, &ins[0], n, h).unwrap(),
            |ins, dout, g| swiglu_backward(&mut g[0], &ins[0], dout, n, h).unwrap(),
        );
    }

    #[test]
    fn swiglu_is_silu_of_the_gate_times_up() {
        let (n, h) = (2, 5);
        let x = rand_vec(n * 2 * h, 8);
        let mut out = vec![0.0; n * h];
        swiglu_forward(&mut out, &x, n, h).unwrap();
        for r in 0..n {
            for i in 0..h {
                let (g, u) = (x[r * 2 * h + i], x[r * 2 * h + h + i]);
                let want = g / (1.0 + (-g).exp()) * u;
                assert_eq!(out[r * h + i], want);
            }
        }
    }

    #[test]
    fn residual_gradient_matches_finite_differences() {
        let n = 20;
        check_grads(
            &[rand_vec(n, 1), rand_vec(n, 2)],
            n,
            |ins, out| residual_forward(out, &ins[0], &ins[1], n).unwrap(),
            |_, dout, g| {
                let [a, b] = g else { unreachable!() };
                residual_backward(a, b, dout, n).unwrap();
            },
        );
    }
}
