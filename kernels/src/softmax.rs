//! Softmax, cross-entropy, and the fused softmax + cross-entropy over the
//! vocabulary that the language-model head uses.

use rayon::prelude::*;

use crate::Real;
use crate::embedding::check_tokens;
use crate::error::{Result, check};
use crate::real::{max_lanes, sum_lanes};

/// `probs[i] = softmax(logits[i])` for each of `n` rows of `v` entries.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
pub fn softmax_forward<T: Real>(probs: &mut [T], logits: &[T], n: usize, v: usize) -> Result<()> {
    check("softmax_forward", "probs", probs, n * v)?;
    check("softmax_forward", "logits", logits, n * v)?;
    if v == 0 {
        return Ok(());
    }
    probs
        .par_chunks_mut(v)
        .zip(logits.par_chunks(v))
        .for_each(|(p, x)| {
            p.copy_from_slice(x);
            softmax_in_place(p);
        });
    Ok(())
}

crate::simd::multiversion! {
    /// Replaces a row by its softmax; returns `(max, Σ exp(x - max))`.
    pub(crate) fn softmax_in_place<T: Real>(x: &mut [T]) -> (T, T) {
        let m = max_lanes(x);
        for v in x.iter_mut() {
            *v = (*v - m).exp();
        }
        let s = sum_lanes(x);
        let inv = T::ONE / s;
        for v in x.iter_mut() {
            *v *= inv;
        }
        (m, s)
    }
}

/// Backward of [`softmax_forward`]:
/// `dlogits += probs ⊙ (dprobs - Σ dprobs ⊙ probs)` per row.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer length.
pub fn softmax_backward<T: Real>(
    dlogits: &mut [T],
    dprobs: &[T],
    probs: &[T],
    n: usize,
    v: usize,
) -> Result<()> {
    check("softmax_backward", "dlogits", dlogits, n * v)?;
    check("softmax_backward", "dprobs", dprobs, n * v)?;
    check("softmax_backward", "probs", probs, n * v)?;
    if v == 0 {
        return Ok(());
    }
    dlogits
        .par_chunks_mut(v)
        .zip(dprobs.par_chunks(v).zip(probs.par_chunks(v)))
        .for_each(|(d, (g, p))| softmax_back_row(d, g, p));
    Ok(())
}

crate::simd::multiversion! {
    pub(crate) fn softmax_back_row<T: Real>(d: &mut [T], g: &[T], p: &[T]) {
        let dot = crate::real::dot_lanes(g, p);
        for i in 0..d.len() {
            d[i] += p[i] * (g[i] - dot);
        }
    }
}

/// `losses[i] = -ln probs[i, targets[i]]`.
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer
/// length, [`Error::TokenOutOfRange`](crate::Error::TokenOutOfRange) for a target `>= v`.
pub fn crossentropy_forward<T: Real>(
    losses: &mut [T],
    probs: &[T],
    targets: &[u32],
    n: usize,
    v: usize,
) -> Result<()> {
    check("crossentropy_forward", "losses", losses, n)?;
    check("crossentropy_forward", "probs", probs, n * v)?;
    check("crossentropy_forward", "targets", targets, n)?;
    check_tokens("crossentropy_forward", targets, v)?;
    for i in 0..n {
        losses[i] = -probs[i * v + targets[i] as usize].ln();
    }
    Ok(())
}

/// Backward of softmax followed by cross-entropy, with respect to the
/// logits: `dlogits += (probs - onehot(target)) · dlosses`.
///
/// # Errors
/// As [`crossentropy_forward`].
pub fn crossentropy_softmax_backward<T: Real>(
    dlogits: &mut [T],
    dlosses: &[T],
    probs: &[T],
    targets: &[u32],
    n: usize,
    v: usize,
) -> Result<()> {
    const OP: &str = "crossentropy_softmax_backward";
    check(OP, "dlogits", dlogits, n * v)?;
    check(OP, "dlosses", dlosses, n)?;
    check(OP, "probs", probs, n * v)?;
    check(OP, "targets", targets, n)?;
    check_tokens(OP, targets, v)?;
    if v == 0 {
        return Ok(());
    }
    dlogits
        .par_chunks_mut(v)
        .zip(probs.par_chunks(v))
        .enumerate()
        .for_each(|(i, (d, p))| {
            let g = dlosses[i];
            for (d, &p) in d.iter_mut().zip(p) {
                *d += p * g;
            }
            d[targets[i] as usize] -= g;
        });
    Ok(())
}

/// Fused softmax + cross-entropy over the vocabulary, the language-model
/// head's loss. Writes `losses[i] = logsumexp(logits[i]) - logits[i, t_i]`
/// and, when `dloss` is `Some(g)`, overwrites `logits` in place with the
/// gradient of `g · Σ losses`: `(softmax(logits[i]) - onehot(t_i)) · g`
/// (so a (B·T, V) logits buffer is reused for its gradient; pass
/// `g = 1/(B·T)` for a mean loss). With `None` the logits are left intact.
///
/// `v` is the row stride; only the first `v_real` entries of each row take
/// part (the rest, padding of the vocabulary, get gradient 0).
///
/// # Errors
/// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) on a wrong buffer
/// length, [`Error::TokenOutOfRange`](crate::Error::TokenOutOfRange) for a
/// target `>= v_real`.
pub fn fused_classifier<T: Real>(
    logits: &mut [T],
    losses: &mut [T],
    targets: &[u32],
    dloss: Option<T>,
    n: usize,
    v: usize,
    v_real: usize,
) -> Result<()> {
    const OP: &str = "fused_classifier";
    check(OP, "logits", logits, n * v)?;
    check(OP, "losses", losses, n)?;
    check(OP, "targets", targets, n)?;
    if v_real > v || v_real == 0 {
        return Err(crate::Error::InvalidArgument {
            op: OP,
            reason: format!("v_real = {v_real} must be in 1..={v}"),
        });
    }
    check_tokens(OP, targets, v_real)?;
    logits
        .par_chunks_mut(v)
        .zip(losses.par_iter_mut().zip(targets.par_iter()))
        .for_each(|(row, (loss, &tgt))| classifier_row(row, loss, tgt as usize, dloss, v_real));
    Ok(())
}

crate::simd::multiversion! {
    fn classifier_row<T: Real>(row: &mut [T], loss: &mut T, tgt: usize, dloss: Option<T>, v_real: usize) {
        let (x, pad) = row.split_at_mut(v_real);
        let xt = x[tgt];
        match dloss {
            Some(g) => {
                let (m, s) = softmax_in_place(x);
                *loss = s.ln() - (xt - m);
                for v in x.iter_mut() {
                    *v *= g;
                }
                x[tgt] -= g;
                pad.fill(T::ZERO);
            }
            None => {
                let m = max_lanes(x);
                let mut acc = [T::ZERO; 16];
                let chunks = x.chunks_exact(16);
                let rest = chunks.remainder();
                for c in chunks {
                    for i in 0..16 {
                        acc[i] += (c[i] - m).exp();
                    }
                }
                let mut s = T::ZERO;
                for &r in rest {
                    s += (r - m).exp();
                }
                let s = sum_lanes(&acc) + s;
                *loss = s.ln() - (xt - m);
            }
        }
    }
}

/// The forward of [`fused_classifier`] (with `dloss = None`: `losses`
/// written, `logits` left intact) that also saves each row's maximum and
/// sum of exponentials in `stats (n, 2)`, so that
/// [`fused_classifier_backward`] needs one pass over the logits instead of
/// three. `losses` get the same bits as from [`fused_classifier`].
///
/// # Errors
/// As [`fused_classifier`]; also a wrong `stats` length.
pub fn fused_classifier_forward<T: Real>(
    logits: &[T],
    losses: &mut [T],
    stats: &mut [T],
    targets: &[u32],
    n: usize,
    v: usize,
    v_real: usize,
) -> Result<()> {
    const OP: &str = "fused_classifier_forward";
    check(OP, "logits", logits, n * v)?;
    check(OP, "losses", losses, n)?;
    check(OP, "stats", stats, 2 * n)?;
    check(OP, "targets", targets, n)?;
    check_v_real(OP, v, v_real)?;
    check_tokens(OP, targets, v_real)?;
    logits
        .par_chunks(v)
        .zip(losses.par_iter_mut().zip(stats.par_chunks_mut(2)))
        .zip(targets.par_iter())
        .for_each(|((row, (loss, st)), &tgt)| {
            let (m, s) = row_max_expsum(&row[..v_real]);
            *loss = s.ln() - (row[tgt as usize] - m);
            st[0] = m;
            st[1] = s;
        });
    Ok(())
}

/// The backward of [`fused_classifier_forward`]: overwrites `logits` (the
/// very logits the forward saw) with the gradient of `dloss · Σ losses`,
/// `(softmax(logits[i]) - onehot(t_i)) · dloss`, from the saved `stats`,
/// in one pass. Bit for bit what [`fused_classifier`] with `Some(dloss)`
/// writes.
///
/// # Errors
/// As [`fused_classifier_forward`].
pub fn fused_classifier_backward<T: Real>(
    logits: &mut [T],
    stats: &[T],
    targets: &[u32],
    dloss: T,
    n: usize,
    v: usize,
    v_real: usize,
) -> Result<()> {
    const OP: &str = "fused_classifier_backward";
    check(OP, "logits", logits, n * v)?;
    check(OP, "stats", stats, 2 * n)?;
    check(OP, "targets", targets, n)?;
    check_v_real(OP, v, v_real)?;
    check_tokens(OP, targets, v_real)?;
    logits
        .par_chunks_mut(v)
        .zip(stats.par_chunks(2).zip(targets.par_iter()))
        .for_each(|(row, (st, &tgt))| {
            classifier_back_row(row, st[0], st[1], tgt as usize, dloss, v_real);
        });
    Ok(())
}

fn check_v_real(op: &'static str, v: usize, v_real: usize) -> Result<()> {
    if v_real > v || v_real == 0 {
        return Err(crate::Error::InvalidArgument {
            op,
            reason: format!("v_real = {v_real} must be in 1..={v}"),
        });
    }
    Ok(())
}

crate::simd::multiversion! {
    /// `(max, Σ exp(x - max))`, summed in the order of [`sum_lanes`] (so
    /// the sum has the bits `softmax_in_place` computes).
    fn row_max_expsum<T: Real>(x: &[T]) -> (T, T) {
        let m = max_lanes(x);
        let mut acc = [T::ZERO; 16];
        let chunks = x.chunks_exact(16);
        let rest = chunks.remainder();
        for c in chunks {
            for i in 0..16 {
                acc[i] += (c[i] - m).exp();
            }
        }
        let mut s = T::ZERO;
        for &r in rest {
            s += (r - m).exp();
        }
        (m, sum_lanes(&acc) + s)
    }
}

crate::simd::multiversion! {
    fn classifier_back_row<T: Real>(row: &mut [T], m: T, s: T, tgt: usize, g: T, v_real: usize) {
        let (x, pad) = row.split_at_mut(v_real);
        let inv = T::ONE / s;
        // The operations of `softmax_in_place` then the scaling by `g`, in
        // one pass: exp, times 1/s, times g, each rounded as there.
        for v in x.iter_mut() {
            let p = (*v - m).exp() * inv;
            *v = p * g;
        }
        x[tgt] -= g;
        pad.fill(T::ZERO);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_grads, rand_vec};

    #[test]
    fn softmax_gradient_matches_finite_differences() {
        let (n, v) = (3, 21);
        check_grads(
            &[rand_vec(n * v, 1).iter().map(|x| x * 5.0).collect()],
            n * v,
            |ins, out| softmax_forward(out, &ins[0], n, v).unwrap(),
            |ins, dout, g| {
                let mut p = vec![0.0; n * v];
                softmax_forward(&mut p, &ins[0], n, v).unwrap();
                softmax_backward(&mut g[0], dout, &p, n, v).unwrap();
            },
        );
    }

    #[test]
    fn crossentropy_gradient_matches_finite_differences() {
        let (n, v) = (4, 17);
        let targets = [0u32, 16, 5, 5];
        check_grads(
            &[rand_vec(n * v, 2).iter().map(|x| x * 5.0).collect()],
            n,
            |ins, out| {
                let mut p = vec![0.0; n * v];
                softmax_forward(&mut p, &ins[0], n, v).unwrap();
                crossentropy_forward(out, &p, &targets, n, v).unwrap();
            },
            |ins, dout, g| {
                let mut p = vec![0.0; n * v];
                softmax_forward(&mut p, &ins[0], n, v).unwrap();
                crossentropy_softmax_backward(&mut g[0], dout, &p, &targets, n, v).unwrap();
            },
        );
    }

    #[test]
    fn fused_classifier_matches_finite_differences_and_unfused() {
        let (n, v, v_real) = (4, 24, 19);
        let targets = [3u32, 18, 0, 3];
        let g = 0.25;
        let x: Vec<f64> = rand_vec(n * v, 3).iter().map(|x| x * 6.0).collect();
        // loss = g * Σ losses; gradient w.r.t. logits, FD on every entry.
        let total = |x: &[f64]| {
            let mut l = x.to_vec();
            let mut losses = vec![0.0; n];
            fused_classifier(&mut l, &mut losses, &targets, None, n, v, v_real).unwrap();
            assert_eq!(l, x, "logits must be untouched without dloss");
            g * losses.iter().sum::<f64>()
        };
        let mut grad = x.clone();
        let mut losses = vec![0.0; n];
        fused_classifier(&mut grad, &mut losses, &targets, Some(g), n, v, v_real).unwrap();
        let h = 1e-5;
        for j in 0..x.len() {
            let mut xp = x.clone();
            xp[j] += h;
            let mut xm = x.clone();
            xm[j] -= h;
            let fd = (total(&xp) - total(&xm)) / (2.0 * h);
            assert!((fd - grad[j]).abs() < 1e-8, "{j}: {fd} vs {}", grad[j]);
        }
        // Unfused path agrees on the loss.
        for i in 0..n {
            let mut p = vec![0.0; v_real];
            softmax_forward(&mut p, &x[i * v..i * v + v_real], 1, v_real).unwrap();
            let mut l = [0.0];
            crossentropy_forward(&mut l, &p, &targets[i..=i], 1, v_real).unwrap();
            assert!((l[0] - losses[i]).abs() < 1e-12);
        }
    }

    #[test]
    fn bad_target_is_an_error() {
        let mut logits = vec![0.0f32; 8];
        let mut losses = vec![0.0f32; 2];
        let err =
            fused_classifier(&mut logits, &mut losses, &[1, 4], Some(0.5), 2, 4, 4).unwrap_err();
        assert!(
            matches!(
                err,
                crate::Error::TokenOutOfRange {
                    position: 1,
                    token: 4,
                    ..
                }
            ),
            "{err}"
        );
    }

    /// The split classifier (forward saving row statistics, one-pass
    /// backward) gives bit for bit the losses and gradient of the fused
    /// one, with padding columns and a row length that is not a multiple
    /// of the 16 lanes.
    #[test]
    fn split_classifier_is_bitwise_the_fused_one() {
        let (n, v, v_real) = (5, 103, 97);
        let targets = [0u32, 96, 50, 7, 7];
        let x: Vec<f32> = rand_vec(n * v, 9)
            .iter()
            .map(|&x| (x * 8.0) as f32)
            .collect();
        let g = 1.0f32 / 3.0;
        let (mut fused, mut l_fused) = (x.clone(), vec![0.0f32; n]);
        fused_classifier(&mut fused, &mut l_fused, &targets, Some(g), n, v, v_real).unwrap();
        let (mut split, mut l_split, mut stats) = (x.clone(), vec![0.0f32; n], vec![0.0f32; 2 * n]);
        fused_classifier_forward(&split, &mut l_split, &mut stats, &targets, n, v, v_real).unwrap();
        let mut l_none = vec![0.0f32; n];
        let mut untouched = x.clone();
        fused_classifier(&mut untouched, &mut l_none, &targets, None, n, v, v_real).unwrap();
        let bits = |a: &[f32]| a.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&l_split), bits(&l_fused));
        assert_eq!(bits(&l_split), bits(&l_none));
        fused_classifier_backward(&mut split, &stats, &targets, g, n, v, v_real).unwrap();
        assert_eq!(bits(&split), bits(&fused));
        let err = fused_classifier_backward(&mut split, &stats[1..], &targets, g, n, v, v_real)
            .unwrap_err();
        assert!(
            matches!(
                err,
                crate::Error::ShapeMismatch {
                    buffer: "stats",
                    ..
                }
            ),
            "{err}"
        );
    }
}
