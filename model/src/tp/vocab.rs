//! Vocabulary-parallel embedding and cross-entropy.

use std::ops::Range;

use rayon::prelude::*;

use weft_collectives::shard_range;
use weft_kernels::check_tokens;

use super::{TensorParallel, split_err as shape_err};
use crate::error::Result;

fn check_len(what: &'static str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(shape_err(
            what,
            format!("holds {got} floats, expected {want}"),
        ))
    }
}

/// Rank `r`'s share of the vocabulary: token ids
/// [`range`](Self::range)` = shard_range(V, tp, r)` (the first `V mod tp`
/// ranks hold one more), i.e. those rows of `wte` (and of an untied
/// `lm_head`), and those columns of the logits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VocabShard {
    vocab: usize,
    range: Range<usize>,
}

impl VocabShard {
    /// Rank `rank` of `tp` of a `vocab`-token vocabulary.
    ///
    /// # Errors
    /// [`Error::Split`](crate::Error::Split) if `rank >= tp` or `vocab < tp`.
    pub fn new(vocab: usize, tp: usize, rank: usize) -> Result<Self> {
        if tp == 0 || rank >= tp || vocab < tp {
            return Err(shape_err(
                "vocabulary split",
                format!("rank {rank} of tp = {tp} over {vocab} tokens"),
            ));
        }
        Ok(VocabShard {
            vocab,
            range: shard_range(vocab, tp, rank),
        })
    }

    /// The token ids (rows of `wte`, columns of the logits) this rank holds.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Tokens on this rank.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Whether this rank holds no token (never: `vocab >= tp`).
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// The whole vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    fn local(&self, tok: u32) -> Option<usize> {
        let t = tok as usize;
        self.range.contains(&t).then(|| t - self.range.start)
    }

    /// This rank's part of the token embedding: `out (N, C)` row `i` is
    /// `wte_l[tokens[i] − start]` when this rank holds the token, else zero.
    /// Summed over the group (all-reduce, or reduce-scatter with sequence
    /// parallelism) it is the embedding; the sum is exact (one non-zero
    /// term per element).
    ///
    /// # Errors
    /// [`Error::Split`](crate::Error::Split) on a wrong length; a kernel
    /// error for a token outside the whole vocabulary.
    pub fn embed(&self, out: &mut [f32], tokens: &[u32], wte_l: &[f32], c: usize) -> Result<()> {
        check_len(
            "vocab-parallel embedding output",
            out.len(),
            tokens.len() * c,
        )?;
        check_len("vocab-parallel wte shard", wte_l.len(), self.len() * c)?;
        check_tokens("vocab_parallel_embedding", tokens, self.vocab)?;
        for (o, &tok) in out.chunks_exact_mut(c).zip(tokens) {
            match self.local(tok) {
                Some(j) => o.copy_from_slice(&wte_l[j * c..(j + 1) * c]),
                None => o.fill(0.0),
            }
        }
        Ok(())
    }

    /// Backward of [`embed`](Self::embed) given the *whole* output gradient
    /// `dout (N, C)`: accumulates the rows of the tokens this rank holds
    /// into `dwte_l`, in token order (as the unsplit kernel does), and
    /// `dout` row `i` into `dwpe[positions[i]]` (`dwpe[i mod t]` without
    /// `positions`) when `dwpe` is given.
    ///
    /// # Errors
    /// [`Error::Split`](crate::Error::Split) on a wrong length; a kernel
    /// error for a token outside the vocabulary.
    #[allow(clippy::too_many_arguments)]
    pub fn embed_backward(
        &self,
        dwte_l: &mut [f32],
        mut dwpe: Option<&mut [f32]>,
        dout: &[f32],
        tokens: &[u32],
        positions: Option<&[u32]>,
        t: usize,
        c: usize,
    ) -> Result<()> {
        check_len(
            "vocab-parallel embedding gradient",
            dout.len(),
            tokens.len() * c,
        )?;
        check_len("vocab-parallel wte gradient", dwte_l.len(), self.len() * c)?;
        if let Some(p) = &dwpe
            && p.len() < t * c
        {
            return Err(shape_err(
                "wpe gradient",
                format!("{} floats < T·C = {}", p.len(), t * c),
            ));
        }
        check_tokens("vocab_parallel_embedding_backward", tokens, self.vocab)?;
        for (row, (g, &tok)) in dout.chunks_exact(c).zip(tokens).enumerate() {
            if let Some(j) = self.local(tok) {
                for (e, &x) in dwte_l[j * c..(j + 1) * c].iter_mut().zip(g) {
                    *e += x;
                }
            }
            if let Some(p) = dwpe.as_deref_mut() {
                let pos = positions.map_or(row % t, |p| p[row] as usize);
                for (e, &x) in p[pos * c..(pos + 1) * c].iter_mut().zip(g) {
                    *e += x;
                }
            }
        }
        Ok(())
    }

    /// Vocabulary-parallel cross-entropy forward over this rank's logits
    /// `(N, V_l)`: writes `losses[i] = ln Σ_v exp(x_iv) − x_i,target` for
    /// the whole vocabulary, and `stats (2N)` (the row maximum and the sum
    /// of exponentials) for [`cross_entropy_backward`](Self::cross_entropy_backward).
    /// Three reductions of `N` floats (one `Max` all-reduce, one `Sum`
    /// all-reduce of `2N`); the logits are never gathered.
    ///
    /// # Errors
    /// [`Error::Split`](crate::Error::Split) on a wrong length; a kernel
    /// error for a target outside the vocabulary; [`Error::Comm`](crate::Error::Comm).
    pub fn cross_entropy(
        &self,
        tp: &TensorParallel,
        logits: &[f32],
        targets: &[u32],
        losses: &mut [f32],
        stats: &mut [f32],
    ) -> Result<()> {
        let n = targets.len();
        let vl = self.len();
        check_len("vocab-parallel logits", logits.len(), n * vl)?;
        check_len("losses", losses.len(), n)?;
        check_len("cross-entropy statistics", stats.len(), 2 * n)?;
        check_tokens("vocab_parallel_cross_entropy", targets, self.vocab)?;
        let (maxes, sums) = stats.split_at_mut(n);
        maxes
            .par_iter_mut()
            .zip(logits.par_chunks_exact(vl))
            .for_each(|(m, row)| *m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max));
        tp.all_reduce_max(maxes)?;
        // sums[..n]: Σ exp(x - max) over this rank's vocabulary (f64
        // accumulation, rounded once); losses: the target logit where owned.
        let mut both = vec![0.0f32; 2 * n];
        let (se, xt) = both.split_at_mut(n);
        se.par_iter_mut()
            .zip(xt.par_iter_mut())
            .enumerate()
            .for_each(|(i, (se, xt))| {
                let row = &logits[i * vl..(i + 1) * vl];
                let m = maxes[i];
                let s: f64 = row.iter().map(|&x| f64::from((x - m).exp())).sum();
                #[allow(clippy::cast_possible_truncation)]
                {
                    *se = s as f32;
                }
                *xt = self.local(targets[i]).map_or(0.0, |j| row[j]);
            });
        tp.all_reduce(&mut both)?;
        let (se, xt) = both.split_at(n);
        for i in 0..n {
            sums[i] = se[i];
            losses[i] = se[i].ln() - (xt[i] - maxes[i]);
        }
        Ok(())
    }

    /// Backward of [`cross_entropy`](Self::cross_entropy) for the loss
    /// `g · Σ losses`: overwrites `logits (N, V_l)` with
    /// `(softmax − onehot(target)) · g` on this rank's columns. No
    /// communication.
    ///
    /// # Errors
    /// [`Error::Split`](crate::Error::Split) on a wrong length.
    pub fn cross_entropy_backward(
        &self,
        logits: &mut [f32],
        targets: &[u32],
        stats: &[f32],
        g: f32,
    ) -> Result<()> {
        let n = targets.len();
        let vl = self.len();
        check_len("vocab-parallel logits", logits.len(), n * vl)?;
        check_len("cross-entropy statistics", stats.len(), 2 * n)?;
        let (maxes, sums) = stats.split_at(n);
        logits
            .par_chunks_exact_mut(vl)
            .enumerate()
            .for_each(|(i, row)| {
                let (m, inv) = (maxes[i], 1.0 / sums[i]);
                for x in row.iter_mut() {
                    *x = (*x - m).exp() * inv * g;
                }
                if let Some(j) = self.local(targets[i]) {
                    row[j] -= g;
                }
            });
        Ok(())
    }
}
