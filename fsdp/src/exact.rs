//! Exact partial sums of gradients and their exchange.
//!
//! Reproducible mode needs the sum of every micro-batch's gradient over the
//! whole global batch to round *once*, from the exact value, whatever the
//! number of ranks and however the micro-batches are spread over them. A
//! partial sum is kept exactly in the compact block encoding of
//! [`weft_collectives::repro`] (integers sharing an exponent per block of
//! 64 elements): adding a micro-batch's gradient encodes it and merges
//! (exact integer addition), and ranks exchange encodings, never rounded
//! values.
//!
//! An [`ExactBuf`] covers a padded unit buffer cut into `n` equal chunks
//! (one per rank's shard), each encoded separately so that chunk `r` can be
//! sent to rank `r`: [`reduce_scatter`] is an all-to-all of the chunks
//! followed by a local merge — about `(n−1)/n` of the encoded size sent per
//! rank, like a ring reduce-scatter. [`all_merge`] merges one chunk's
//! partials across a group (the inter-domain step of hybrid sharding).

use weft_collectives::repro::{self, ExactPartial};
use weft_collectives::{Communicator, CommunicatorExt, Element};

use crate::error::{Result, comm};

/// Exact partial sums of a buffer of `n · chunk` elements, one encoding per chunk.
#[derive(Clone, Debug)]
pub(crate) struct ExactBuf {
    chunk: usize,
    parts: Vec<Vec<u8>>,
}

impl ExactBuf {
    /// The exact encoding of `xs`, cut into `xs.len() / chunk` chunks.
    pub(crate) fn encode<T: Element>(xs: &[T], chunk: usize) -> Self {
        debug_assert!(chunk > 0 && xs.len().is_multiple_of(chunk));
        let parts = xs
            .chunks(chunk)
            .map(|c| {
                let mut out = Vec::new();
                repro::encode(c, &mut out);
                out
            })
            .collect();
        ExactBuf { chunk, parts }
    }

    /// Adds `xs` exactly.
    #[cfg(test)]
    pub(crate) fn add(&mut self, xs: &[f32]) -> Result<()> {
        let other = Self::encode(xs, self.chunk);
        self.merge(&other)
    }

    /// Adds another partial of the same shape exactly.
    pub(crate) fn merge(&mut self, other: &ExactBuf) -> Result<()> {
        let mut out = Vec::new();
        for (a, b) in self.parts.iter_mut().zip(&other.parts) {
            repro::merge(a, b, self.chunk, &mut out).map_err(comm("merging exact partial sums"))?;
            std::mem::swap(a, &mut out);
        }
        Ok(())
    }

    /// Elements covered (all chunks).
    pub(crate) fn len(&self) -> usize {
        self.chunk * self.parts.len()
    }

    /// The bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.parts.iter().map(Vec::capacity).sum()
    }

    /// The correctly rounded values of every chunk, in order.
    pub(crate) fn decode<T: Element>(&self) -> Result<Vec<T>> {
        let mut out = vec![T::ZERO; self.chunk * self.parts.len()];
        for (p, o) in self.parts.iter().zip(out.chunks_mut(self.chunk)) {
            repro::decode(p, o).map_err(comm("decoding an exact partial sum"))?;
        }
        Ok(out)
    }

    /// The exact sum divided by `m`, rounded once to `T`: the bits
    /// [`ExactPartial::mean_to`] gives for `m` contributions with this sum
    /// (the rule of the collectives' `Avg` and of the trainer).
    ///
    /// The exact sum is split greedily into f64 terms (each the correctly
    /// rounded rest), which an [`ExactPartial`] adds exactly, with zero
    /// contributions up to a count of `m`. A sum needing more than `m`
    /// terms (never seen for gradients: it takes values spread over more
    /// than `53·m` binades) falls back to the rounded sum divided by `m`,
    /// which is still the same on every rank and group size.
    pub(crate) fn mean<T: Element>(&self, m: usize) -> Result<Vec<T>> {
        let len = self.len();
        let ctx = "averaging an exact partial";
        let mut rest = self.clone();
        let mut p = ExactPartial::new(len);
        let mut terms = 0usize;
        loop {
            let hi: Vec<f64> = rest.decode()?;
            if terms > 0 && hi.iter().all(|&v| v == 0.0) {
                break;
            }
            p.add(&hi).map_err(comm(ctx))?;
            terms += 1;
            if terms > m || hi.iter().any(|v| !v.is_finite()) {
                break;
            }
            let neg: Vec<f64> = hi.iter().map(|&v| -v).collect();
            rest.merge(&ExactBuf::encode(&neg, self.chunk))?;
        }
        if terms > m {
            let sum: Vec<f64> = self.decode()?;
            #[allow(clippy::cast_precision_loss)]
            let inv = m as f64;
            return Ok(sum.iter().map(|&v| T::from_f64(v / inv)).collect());
        }
        let zeros = vec![0.0f64; len];
        for _ in terms..m {
            p.add(&zeros).map_err(comm(ctx))?;
        }
        let mut out = vec![T::ZERO; len];
        p.mean_to(&mut out).map_err(comm(ctx))?;
        Ok(out)
    }

    /// The single chunk of a one-chunk buffer.
    pub(crate) fn single(chunk: usize, part: Vec<u8>) -> Self {
        ExactBuf {
            chunk,
            parts: vec![part],
        }
    }
}

fn to_words(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            f32::from_bits(u32::from_le_bytes(w))
        })
        .collect()
}

fn from_words(words: &[f32], len: usize) -> Vec<u8> {
    let mut out: Vec<u8> = words
        .iter()
        .flat_map(|w| w.to_bits().to_le_bytes())
        .collect();
    out.truncate(len);
    out
}

fn len_word(x: usize) -> f32 {
    f32::from_bits(u32::try_from(x).unwrap_or(u32::MAX))
}

/// Exchanges byte messages with every rank of `c` (`msgs[j]` goes to rank
/// `j`) and returns the message of each rank to this one, in rank order.
/// Collectives only move bytes here, so the words' values are never
/// computed with.
pub(crate) fn exchange_bytes(
    c: &dyn Communicator,
    msgs: &[Vec<u8>],
    what: &str,
) -> Result<Vec<Vec<u8>>> {
    let n = c.size();
    let lens: Vec<f32> = msgs.iter().map(|m| len_word(m.len())).collect();
    let mut got = vec![0.0f32; n];
    c.all_to_all(&lens, &mut got)
        .map_err(comm(format!("{what}: exchanging lengths")))?;
    let got: Vec<usize> = got.iter().map(|w| w.to_bits() as usize).collect();
    let send: Vec<f32> = msgs.iter().flat_map(|m| to_words(m)).collect();
    let send_counts: Vec<usize> = msgs.iter().map(|m| m.len().div_ceil(4)).collect();
    let recv_counts: Vec<usize> = got.iter().map(|l| l.div_ceil(4)).collect();
    let mut recv = vec![0.0f32; recv_counts.iter().sum()];
    c.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)
        .map_err(comm(format!("{what}: exchanging exact partials")))?;
    let mut out = Vec::with_capacity(n);
    let mut at = 0;
    for (&words, &len) in recv_counts.iter().zip(&got) {
        out.push(from_words(&recv[at..at + words], len));
        at += words;
    }
    Ok(out)
}

/// Exact reduce-scatter: every rank passes its partial of the whole padded
/// buffer (`c.size()` chunks); each gets the exact sum over the group of
/// its own chunk.
pub(crate) fn reduce_scatter(c: &dyn Communicator, x: &ExactBuf, what: &str) -> Result<ExactBuf> {
    debug_assert_eq!(x.parts.len(), c.size());
    let got = if c.size() == 1 {
        vec![x.parts[0].clone()]
    } else {
        exchange_bytes(c, &x.parts, what)?
    };
    merge_all(x.chunk, got)
}

/// Exact all-merge of a one-chunk partial over `c`: every rank gets the
/// exact sum of every rank's partial.
pub(crate) fn all_merge(c: &dyn Communicator, x: &ExactBuf, what: &str) -> Result<ExactBuf> {
    debug_assert_eq!(x.parts.len(), 1);
    if c.size() == 1 {
        return Ok(x.clone());
    }
    let msgs = vec![x.parts[0].clone(); c.size()];
    let got = exchange_bytes(c, &msgs, what)?;
    merge_all(x.chunk, got)
}

fn merge_all(chunk: usize, parts: Vec<Vec<u8>>) -> Result<ExactBuf> {
    let mut it = parts.into_iter();
    let mut acc = ExactBuf::single(chunk, it.next().unwrap_or_default());
    for p in it {
        acc.merge(&ExactBuf::single(chunk, p))?;
    }
    Ok(acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_collectives::LocalCluster;

    fn grads(seed: u32, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let x = (i as u32)
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add(seed * 97);
                ((x % 20_001) as f32 - 10_000.0) * 1e-7 * (1 + (x % 7)) as f32
            })
            .collect()
    }

    #[test]
    fn exact_reduce_scatter_matches_one_rank_for_any_split() {
        let (m, chunk4) = (8, 37);
        let len = 4 * chunk4;
        // one rank, all micro-batches
        let mut whole = ExactBuf::encode(&grads(0, len), len);
        for j in 1..m {
            whole.add(&grads(j, len)).unwrap();
        }
        let want: Vec<f32> = whole.decode().unwrap();
        for n in [2usize, 4] {
            let out = LocalCluster::run(n, |c| {
                let per = m as usize / n;
                let chunk = len / n;
                let r = c.rank();
                let mut acc = ExactBuf::encode(&grads((r * per) as u32, len), chunk);
                for j in 1..per {
                    acc.add(&grads((r * per + j) as u32, len)).unwrap();
                }
                let mine = reduce_scatter(&c, &acc, "test").unwrap();
                mine.decode::<f32>().unwrap()
            })
            .unwrap();
            let got: Vec<f32> = out.concat();
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "n = {n}"
            );
            // and the plain f32 sum in one order is not always the same bits
        }
    }

    #[test]
    fn mean_is_exact_partial_mean_to() {
        // contributions spread over many binades, and ordinary ones
        let rows: Vec<Vec<f32>> = vec![
            vec![1.0, 3.0e-30, -2.5, 1.0e20, 0.1, -0.0],
            vec![1.0e-7, 1.0, 2.5, -1.0e20, 0.2, -0.0],
            vec![3.0e30, 5.0e-41, 1.0e-3, 7.0, 0.3, -0.0],
        ];
        for m in 1..=3usize {
            let mut want = ExactPartial::new(6);
            let mut got = ExactBuf::encode(&rows[0], 6);
            want.add(&rows[0]).unwrap();
            for r in &rows[1..m] {
                want.add(r).unwrap();
                got.add(r).unwrap();
            }
            let mut w = vec![0f32; 6];
            want.mean_to(&mut w).unwrap();
            let g: Vec<f32> = got.mean(m).unwrap();
            // -0.0 sums may come back as +0.0; compare values there
            for (a, b) in g.iter().zip(&w) {
                if *b == 0.0 {
                    assert_eq!(*a, 0.0);
                } else {
                    assert_eq!(a.to_bits(), b.to_bits(), "m = {m}: {g:?} vs {w:?}");
                }
            }
        }
    }

    #[test]
    fn all_merge_sums_every_rank() {
        let out = LocalCluster::run(3, |c| {
            let x = ExactBuf::encode(&[c.rank() as f32 + 0.5, 1e-30], 2);
            all_merge(&c, &x, "test").unwrap().decode::<f32>().unwrap()
        })
        .unwrap();
        for o in out {
            assert_eq!(o, vec![4.5, 3e-30]);
        }
    }
}
