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

/// `out (B,T,C) = wte[tokens] (V,C) + wpe[positions] (maxT,C)`, where
/// `positions (B,T)` gives each row's position; `None` is row `i` of each
/// sequence at position `i` (`wpe[0..T]`). Document masking passes each
/// row's distance from its document's start
/// ([`doc_starts`](crate::doc_starts)), so that every document is
/// positioned as if it were alone.
///
/// # Errors
/// [`Error::ShapeMismatch`] on a wrong buffer length, [`Error::TokenOutOfRange`]
/// for an id `>= V`, [`Error::InvalidArgument`] if `T` (or a given
/// position) exceeds the position table.
#[allow(clippy::too_many_arguments)]
pub fn encoder_forward<T: Real>(
    out: &mut [T],
    tokens: &[u32],
    positions: Option<&[u32]>,
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
    check_positions(OP, positions, wpe.len() / c, b * t)?;
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
            let pos = positions.map_or(row % t, |p| p[row] as usize);
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

fn check_positions(
    op: &'static str,
    positions: Option<&[u32]>,
    max_t: usize,
    rows: usize,
) -> Result<()> {
    let Some(p) = positions else { return Ok(()) };
    check(op, "positions", p, rows)?;
    match p.iter().position(|&x| x as usize >= max_t) {
        None => Ok(()),
        Some(row) => Err(Error::InvalidArgument {
            op,
            reason: format!(
                "position {} of row {row} is outside the position table of {max_t}",
                p[row]
            ),
        }),
    }
}

/// Backward of [`encoder_forward`]: `dwte[tokens] += dout`,
/// `dwpe[positions] += dout` (rows of repeated tokens or positions add up,
/// in row order).
///
/// # Errors
/// As [`encoder_forward`].
#[allow(clippy::too_many_arguments)]
pub fn encoder_backward<T: Real>(
    dwte: &mut [T],
    dwpe: &mut [T],
    dout: &[T],
    tokens: &[u32],
    positions: Option<&[u32]>,
    b: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    const OP: &str = "encoder_backward";
    check(OP, "dout", dout, b * t * c)?;
    check(OP, "tokens", tokens, b * t)?;
    positions_fit(OP, dwpe, t, c)?;
    check_positions(OP, positions, dwpe.len() / c, b * t)?;
    if !dwte.len().is_multiple_of(c) {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!("dwte has {} elements, not a multiple of C={c}", dwte.len()),
        });
    }
    check_tokens(OP, tokens, dwte.len() / c)?;
    for (row, (g, &tok)) in dout.chunks_exact(c).zip(tokens).enumerate() {
        let pos = positions.map_or(row % t, |p| p[row] as usize);
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
            |ins, out| encoder_forward(out, &tokens, None, &ins[0], &ins[1], b, t, c).unwrap(),
            |_, dout, g| {
                let [a, p] = g else { unreachable!() };
                encoder_backward(a, p, dout, &tokens, None, b, t, c).unwrap();
            },
        );
        // Positions given per row (two documents in the first sequence).
        let pos = [0u32, 1, 0, 0, 1, 2];
        check_grads(
            &[rand_vec(v * c, 3), rand_vec(maxt * c, 4)],
            b * t * c,
            |ins, out| {
                encoder_forward(out, &tokens, Some(&pos), &ins[0], &ins[1], b, t, c).unwrap();
            },
            |_, dout, g| {
                let [a, p] = g else { unreachable!() };
                encoder_backward(a, p, dout, &tokens, Some(&pos), b, t, c).unwrap();
            },
        );
    }

    #[test]
    fn given_positions_pick_their_rows() {
        let (c, wte, wpe) = (
            2,
            [1.0f64, 2.0, 3.0, 4.0],
            [10.0, 20.0, 30.0, 40.0, 50.0, 60.0],
        );
        let mut out = [0.0; 6];
        encoder_forward(&mut out, &[1, 0, 1], Some(&[0, 2, 0]), &wte, &wpe, 1, 3, c).unwrap();
        assert_eq!(out, [13.0, 24.0, 51.0, 62.0, 13.0, 24.0]);
        let err = encoder_forward(&mut out, &[1, 0, 1], Some(&[0, 3, 0]), &wte, &wpe, 1, 3, c)
            .unwrap_err();
        assert!(err.to_string().contains("position 3 of row 1"), "{err}");
    }

    #[test]
    fn bad_token_and_long_sequence_are_errors() {
        let mut out = vec![0.0f32; 8];
        let err =
            encoder_forward(&mut out, &[0, 9], None, &[0.0; 8], &[0.0; 8], 1, 2, 4).unwrap_err();
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
        let err =
            encoder_forward(&mut out, &[0, 1, 0], None, &[0.0; 8], &[0.0; 8], 1, 3, 4).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    }
}
