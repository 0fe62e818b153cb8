//! Token + position embedding (GPT-2's encoder).

use rayon::prelude::*;

use crate::Real;
use crate::error::{Error, Result, check};

/// Checks every token id is below `vocab_size`.
///
/// # Errors
/// [`Error::TokenOutOfRange`] naming the first bad position.
pub fn check_tokens(op: &'static str, tokens: &[u32], vocab_size: usize) -> Result<()> {
    match tokens.iter().position(|&t| t as usize >= vocab_size) {
        None => Ok(()),
        Some(position) => Err(Error::TokenOutOfRange {
            op,
            position,
            token: tokens[position],
            vocab_size,
        }),
    }
}

/// `out (B,T,C) = wte[tokens] (V,C) + wpe[0..T] (maxT,C)`.
///
/// # Errors
/// [`Error::ShapeMismatch`] on a wrong buffer length, [`Error::TokenOutOfRange`]
/// for an id `>= V`, [`Error::InvalidArgument`] if `T` exceeds the position table.
#[allow(clippy::too_many_arguments)]
pub fn encoder_forward<T: Real>(
    out: &mut [T],
    tokens: &[u32],
    wte: &[T],
    wpe: &[T],
    b: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    const OP: &str = "encoder_forward";
    check(OP, "out", out, b * t * c)?;
    check(OP, "tokens", tokens, b * t)?;
    positions_fit(OP, wpe, t, c)?;
    if c == 0 || !wte.len().is_multiple_of(c) {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!("wte has {} elements, not a multiple of C={c}", wte.len()),
        });
    }
    check_tokens(OP, tokens, wte.len() / c)?;
    out.par_chunks_mut(c)
        .zip(tokens.par_iter())
        .enumerate()
        .with_min_len(64)
        .for_each(|(row, (o, &tok))| {
            let pos = row % t;
            let e = &wte[tok as usize * c..(tok as usize + 1) * c];
            let p = &wpe[pos * c..(pos + 1) * c];
            for i in 0..c {
                o[i] = e[i] + p[i];
            }
        });
    Ok(())
}

fn positions_fit<T>(op: &'static str, wpe: &[T], t: usize, c: usize) -> Result<()> {
    if c == 0 || !wpe.len().is_multiple_of(c) || wpe.len() / c < t {
        return Err(Error::InvalidArgument {
            op,
            reason: format!(
                "position table has {} elements; need at least T*C = {t}*{c}",
                wpe.len()
            ),
        });
    }
    Ok(())
}

/// Backward of [`encoder_forward`]: `dwte[tokens] += dout`,
/// `dwpe[t] += Σ_b dout[b, t]` (rows of repeated tokens add up).
///
/// # Errors
/// As [`encoder_forward`].
#[allow(clippy::too_many_arguments)]
pub fn encoder_backward<T: Real>(
    dwte: &mut [T],
    dwpe: &mut [T],
    dout: &[T],
    tokens: &[u32],
    b: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    const OP: &str = "encoder_backward";
    check(OP, "dout", dout, b * t * c)?;
    check(OP, "tokens", tokens, b * t)?;
    positions_fit(OP, dwpe, t, c)?;
    if !dwte.len().is_multiple_of(c) {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!("dwte has {} elements, not a multiple of C={c}", dwte.len()),
        });
    }
    check_tokens(OP, tokens, dwte.len() / c)?;
    for (row, (g, &tok)) in dout.chunks_exact(c).zip(tokens).enumerate() {
        let pos = row % t;
        let e = &mut dwte[tok as usize * c..(tok as usize + 1) * c];
        for i in 0..c {
            e[i] += g[i];
        }
        let p = &mut dwpe[pos * c..(pos + 1) * c];
        for i in 0..c {
            p[i] += g[i];
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_grads, rand_vec};

    #[test]
    fn gradients_match_finite_differences() {
        let (b, t, c, v, maxt) = (2, 3, 4, 5, 4);
        let tokens = [1u32, 4, 1, 0, 1, 3];
        check_grads(
            &[rand_vec(v * c, 1), rand_vec(maxt * c, 2)],
            b * t * c,
            |ins, out| encoder_forward(out, &tokens, &ins[0], &ins[1], b, t, c).unwrap(),
            |_, dout, g| {
                let [a, p] = g else { unreachable!() };
                encoder_backward(a, p, dout, &tokens, b, t, c).unwrap();
            },
        );
    }

    #[test]
    fn bad_token_and_long_sequence_are_errors() {
        let mut out = vec![0.0f32; 8];
        let err = encoder_forward(&mut out, &[0, 9], &[0.0; 8], &[0.0; 8], 1, 2, 4).unwrap_err();
        assert_eq!(
            err,
            Error::TokenOutOfRange {
                op: "encoder_forward",
                position: 1,
                token: 9,
                vocab_size: 2
            }
        );
        let mut out = vec![0.0f32; 12];
        let err = encoder_forward(&mut out, &[0, 1, 0], &[0.0; 8], &[0.0; 8], 1, 3, 4).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    }
}
