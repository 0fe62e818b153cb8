//! Causal multi-head self-attention.
//!
//! Shapes (llm.c's legend): `qkv (B,T,3C)` holds the query, key and value
//! projections side by side (`[q | k | v]`, as GPT-2's `c_attn` produces
//! them), head `h` owning channels `h*HS..(h+1)*HS` of each, `HS = C/NH`.
//! The forward saves the attention probabilities `att (B,NH,T,T)` (zero
//! above the diagonal) for the backward.
//!
//! Each (batch, head) pair is a handful of GEMMs over row blocks of 64, so
//! the work above the diagonal is mostly skipped, and nothing about one
//! sequence's arithmetic depends on the batch it is in.

use rayon::prelude::*;

use crate::Real;
use crate::error::{Error, Result, check};
use crate::gemm::{View, gemm};
use crate::matmul::gemm_row_invariant;
use crate::softmax::softmax_in_place;

const BLOCK: usize = 64;

fn dims(op: &'static str, c: usize, nh: usize) -> Result<usize> {
    if nh == 0 || !c.is_multiple_of(nh) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("channels C={c} not divisible by heads NH={nh}"),
        });
    }
    Ok(c / nh)
}

fn blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t)
        .step_by(BLOCK)
        .map(move |i0| (i0, (i0 + BLOCK).min(t)))
}

/// Runs `f(batch_index, items)` for every batch element, in parallel over
/// the batch when there are enough sequences to occupy the pool (GEMMs
/// single-threaded), else one after another with multi-threaded GEMMs.
fn for_each_batch<I: Send>(items: Vec<I>, f: impl Fn(I, bool) + Sync) {
    if items.len() >= rayon::current_num_threads() {
        items.into_par_iter().for_each(|it| f(it, false));
    } else {
        items.into_iter().for_each(|it| f(it, true));
    }
}

/// Forward: `out (B,T,C)`, `att (B,NH,T,T)` from `qkv (B,T,3C)`, with
/// scores scaled by `1/sqrt(HS)` and a causal mask.
///
/// # Errors
/// [`Error::ShapeMismatch`] on a wrong buffer length,
/// [`Error::InvalidArgument`] if `NH` does not divide `C`.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward<T: Real>(
    out: &mut [T],
    att: &mut [T],
    qkv: &[T],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) -> Result<()> {
    const OP: &str = "attention_forward";
    let hs = dims(OP, c, nh)?;
    check(OP, "out", out, b * t * c)?;
    check(OP, "att", att, b * nh * t * t)?;
    check(OP, "qkv", qkv, b * t * 3 * c)?;
    if b * t * c == 0 {
        return Ok(());
    }
    #[allow(clippy::cast_precision_loss)]
    let scale = T::from_f64(1.0 / (hs as f64).sqrt());
    let items: Vec<_> = out
        .chunks_mut(t * c)
        .zip(att.chunks_mut(nh * t * t))
        .zip(qkv.chunks(t * 3 * c))
        .collect();
    for_each_batch(items, |((o, a), x), threads| {
        for h in 0..nh {
            let p = &mut a[h * t * t..(h + 1) * t * t];
            for (i0, i1) in blocks(t) {
                let q = View {
                    data: &x[i0 * 3 * c + h * hs..],
                    rs: 3 * c,
                    cs: 1,
                };
                let kt = View {
                    data: &x[c + h * hs..],
                    rs: 1,
                    cs: 3 * c,
                };
                gemm_row_invariant(
                    i1 - i0,
                    i1,
                    hs,
                    &mut p[i0 * t..],
                    t,
                    false,
                    q,
                    kt,
                    scale,
                    threads,
                );
                for i in i0..i1 {
                    let row = &mut p[i * t..(i + 1) * t];
                    softmax_in_place(&mut row[..=i]);
                    row[i + 1..].fill(T::ZERO);
                }
                let v = View {
                    data: &x[2 * c + h * hs..],
                    rs: 3 * c,
                    cs: 1,
                };
                gemm_row_invariant(
                    i1 - i0,
                    hs,
                    i1,
                    &mut o[i0 * c + h * hs..],
                    c,
                    false,
                    View::rows(&p[i0 * t..], t),
                    v,
                    T::ONE,
                    threads,
                );
            }
        }
    });
    Ok(())
}

/// One position of [`attention_forward`] from a key/value cache, for
/// incremental decoding: the output `out (C)` and probabilities
/// `att (NH, pos+1)` of the query `q (C)` at position `pos` over the keys
/// and values `kv (pos+1, 2C)` (rows `[k | v]`, head `h` owning channels
/// `h*HS..(h+1)*HS` of each) of positions `0..=pos`.
///
/// The result is bitwise equal to row `pos` of [`attention_forward`] over
/// any sequence with the same queries, keys and values up to `pos`: both
/// compute each score and each output element with the same row-invariant
/// GEMM (see the `matmul` module's docs on row invariance), summing over
/// keys in position order; the forward's block of 64 query rows and the
/// zero probabilities of later keys change no bit.
///
/// # Errors
/// [`Error::ShapeMismatch`] on a wrong buffer length,
/// [`Error::InvalidArgument`] if `NH` does not divide `C`.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode<T: Real>(
    out: &mut [T],
    att: &mut [T],
    q: &[T],
    kv: &[T],
    pos: usize,
    c: usize,
    nh: usize,
) -> Result<()> {
    const OP: &str = "attention_decode";
    let hs = dims(OP, c, nh)?;
    let n = pos + 1;
    check(OP, "out", out, c)?;
    check(OP, "att", att, nh * n)?;
    check(OP, "q", q, c)?;
    check(OP, "kv", kv, n * 2 * c)?;
    if c == 0 {
        return Ok(());
    }
    #[allow(clippy::cast_precision_loss)]
    let scale = T::from_f64(1.0 / (hs as f64).sqrt());
    for h in 0..nh {
        let row = &mut att[h * n..(h + 1) * n];
        gemm_row_invariant(
            1,
            n,
            hs,
            row,
            n,
            false,
            View::rows(&q[h * hs..], c),
            View {
                data: &kv[h * hs..],
                rs: 1,
                cs: 2 * c,
            },
            scale,
            true,
        );
        softmax_in_place(row);
        gemm_row_invariant(
            1,
            hs,
            n,
            &mut out[h * hs..],
            c,
            false,
            View::rows(row, n),
            View {
                data: &kv[c + h * hs..],
                rs: 2 * c,
                cs: 1,
            },
            T::ONE,
            true,
        );
    }
    Ok(())
}

/// Backward of [`attention_forward`], accumulating into `dqkv (B,T,3C)`.
/// `scratch (B,NH,T,T)` is overwritten (it holds the score gradients).
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
    nh: usize,
) -> Result<()> {
    const OP: &str = "attention_backward";
    let hs = dims(OP, c, nh)?;
    check(OP, "dqkv", dqkv, b * t * 3 * c)?;
    check(OP, "scratch", scratch, b * nh * t * t)?;
    check(OP, "dout", dout, b * t * c)?;
    check(OP, "qkv", qkv, b * t * 3 * c)?;
    check(OP, "att", att, b * nh * t * t)?;
    if b * t * c == 0 {
        return Ok(());
    }
    #[allow(clippy::cast_precision_loss)]
    let scale = T::from_f64(1.0 / (hs as f64).sqrt());
    let items: Vec<_> = dqkv
        .chunks_mut(t * 3 * c)
        .zip(scratch.chunks_mut(nh * t * t))
        .zip(
            dout.chunks(t * c)
                .zip(qkv.chunks(t * 3 * c))
                .zip(att.chunks(nh * t * t)),
        )
        .collect();
    for_each_batch(items, |((dx, s), ((go, x), a)), threads| {
        for h in 0..nh {
            let p = &a[h * t * t..(h + 1) * t * t];
            let d = &mut s[h * t * t..(h + 1) * t * t];
            for (i0, i1) in blocks(t) {
                // dP = dO · Vᵀ, then dS = P ⊙ (dP - rowsum(dP ⊙ P)) · scale.
                let g = View {
                    data: &go[i0 * c + h * hs..],
                    rs: c,
                    cs: 1,
                };
                let vt = View {
                    data: &x[2 * c + h * hs..],
                    rs: 1,
                    cs: 3 * c,
                };
                gemm(
                    i1 - i0,
                    i1,
                    hs,
                    &mut d[i0 * t..],
                    t,
                    false,
                    g,
                    vt,
                    T::ONE,
                    threads,
                );
                for i in i0..i1 {
                    let dr = &mut d[i * t..(i + 1) * t];
                    let pr = &p[i * t..=i * t + i];
                    ds_row(&mut dr[..=i], pr, scale);
                    dr[i + 1..].fill(T::ZERO);
                }
            }
            for (i0, i1) in blocks(t) {
                // dQ[i] += Σ_{j ≤ i} dS[i, j] K[j]
                let k = View {
                    data: &x[c + h * hs..],
                    rs: 3 * c,
                    cs: 1,
                };
                gemm(
                    i1 - i0,
                    hs,
                    i1,
                    &mut dx[i0 * 3 * c + h * hs..],
                    3 * c,
                    true,
                    View::rows(&d[i0 * t..], t),
                    k,
                    T::ONE,
                    threads,
                );
                // dK[j] += Σ_{i ≥ j} dS[i, j] Q[i];  dV[j] += Σ_{i ≥ j} P[i, j] dO[i]
                let (j0, j1) = (i0, i1);
                let dst = View {
                    data: &d[j0 * t + j0..],
                    rs: 1,
                    cs: t,
                };
                let q = View {
                    data: &x[j0 * 3 * c + h * hs..],
                    rs: 3 * c,
                    cs: 1,
                };
                gemm(
                    j1 - j0,
                    hs,
                    t - j0,
                    &mut dx[j0 * 3 * c + c + h * hs..],
                    3 * c,
                    true,
                    dst,
                    q,
                    T::ONE,
                    threads,
                );
                let pt = View {
                    data: &p[j0 * t + j0..],
                    rs: 1,
                    cs: t,
                };
                let g = View {
                    data: &go[j0 * c + h * hs..],
                    rs: c,
                    cs: 1,
                };
                gemm(
                    j1 - j0,
                    hs,
                    t - j0,
                    &mut dx[j0 * 3 * c + 2 * c + h * hs..],
                    3 * c,
                    true,
                    pt,
                    g,
                    T::ONE,
                    threads,
                );
            }
        }
    });
    Ok(())
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

    /// Straightforward f64 attention, written from the formula.
    fn naive(qkv: &[f64], b: usize, t: usize, c: usize, nh: usize) -> Vec<f64> {
        let hs = c / nh;
        let mut out = vec![0.0; b * t * c];
        for bb in 0..b {
            for h in 0..nh {
                for i in 0..t {
                    let q = |d: usize| qkv[(bb * t + i) * 3 * c + h * hs + d];
                    let s: Vec<f64> = (0..=i)
                        .map(|j| {
                            (0..hs)
                                .map(|d| q(d) * qkv[(bb * t + j) * 3 * c + c + h * hs + d])
                                .sum::<f64>()
                                / (hs as f64).sqrt()
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                    for d in 0..hs {
                        out[(bb * t + i) * c + h * hs + d] = (0..=i)
                            .map(|j| {
                                (s[j] - m).exp() / z
                                    * qkv[(bb * t + j) * 3 * c + 2 * c + h * hs + d]
                            })
                            .sum();
                    }
                }
            }
        }
        out
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
            attention_forward(&mut out, &mut att, &qkv, b, t, c, nh).unwrap();
            let want = naive(&qkv, b, t, c, nh);
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
                    attention_forward(out, &mut att, &ins[0], b, t, c, nh).unwrap();
                },
                |ins, dout, g| {
                    let mut att = vec![0.0; b * nh * t * t];
                    let mut out = vec![0.0; b * t * c];
                    attention_forward(&mut out, &mut att, &ins[0], b, t, c, nh).unwrap();
                    let mut scratch = vec![0.0; b * nh * t * t];
                    attention_backward(&mut g[0], &mut scratch, dout, &ins[0], &att, b, t, c, nh)
                        .unwrap();
                },
            );
        }
    }

    /// The decode step gives bitwise the last row of the forward over the
    /// prefix, and the same row of the forward over the whole sequence, at
    /// every position across several 64-row blocks (and past 512 keys, where
    /// sums are chunked), for several head sizes.
    #[test]
    fn decode_matches_the_forwards_last_row_bitwise() {
        for (c, nh, t) in [
            (32, 4, 140),
            (24, 1, 70),
            (12, 3, 20),
            (128, 2, 131),
            (8, 2, 530),
        ] {
            let qkv: Vec<f32> = rand_vec(t * 3 * c, 31)
                .into_iter()
                .map(|x| (x * 3.0) as f32)
                .collect();
            let mut kv = vec![0.0f32; t * 2 * c];
            for i in 0..t {
                kv[i * 2 * c..(i + 1) * 2 * c]
                    .copy_from_slice(&qkv[i * 3 * c + c..(i + 1) * 3 * c]);
            }
            let mut full = vec![0.0f32; t * c];
            let mut full_att = vec![0.0f32; nh * t * t];
            attention_forward(&mut full, &mut full_att, &qkv, 1, t, c, nh).unwrap();
            let checked =
                (0..t).filter(|&p| t < 200 || p < 70 || (505..520).contains(&p) || p + 1 == t);
            for pos in checked {
                let n = pos + 1;
                let mut out = vec![0.0f32; n * c];
                let mut att = vec![0.0f32; nh * n * n];
                attention_forward(&mut out, &mut att, &qkv[..n * 3 * c], 1, n, c, nh).unwrap();
                let mut o1 = vec![0.0f32; c];
                let mut a1 = vec![0.0f32; nh * n];
                let q = &qkv[pos * 3 * c..pos * 3 * c + c];
                attention_decode(&mut o1, &mut a1, q, &kv[..n * 2 * c], pos, c, nh).unwrap();
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&o1),
                    bits(&out[pos * c..]),
                    "C={c} NH={nh} pos={pos}: out"
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

    #[test]
    fn heads_must_divide_channels() {
        let err =
            attention_forward(&mut [0.0f32; 5], &mut [0.0; 2], &[0.0; 15], 1, 1, 5, 2).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    }
}
