//! How a unit's parameters travel when they are gathered in bf16 with some
//! tensors kept in f32 ([`UnitSpec::keep_f32`](crate::UnitSpec::keep_f32)).
//!
//! Rank `r`'s chunk of the gathered buffer is its shard in order: one bf16
//! word per element (rounded to nearest-even from the f32 master), two per
//! element kept in f32 (its bits, high half first), then zeros up to the
//! longest rank's chunk, so that every rank sends as many words. An
//! all-gather moves the words as they are; [`Bf16Wire::read`] widens them
//! back, so a kept element arrives with the master's bits and any other
//! with the bits a bf16 product would round it to.

use std::ops::Range;

use weft_collectives::{bf16, round_to_bf16};

use crate::units::Unit;

/// A run of a shard: elements `start..end` of the shard, kept in f32 or
/// not, whose words start at `word` in the rank's chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Run {
    elems: Range<usize>,
    kept: bool,
    word: usize,
}

/// The bf16 wire layout of one unit over `n` ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Bf16Wire {
    shard: usize,
    chunk: usize,
    /// Per rank, its shard as runs covering `0..shard` in order.
    runs: Vec<Vec<Run>>,
}

impl Bf16Wire {
    /// The layout of `unit` sharded over `n` ranks.
    pub(crate) fn new(unit: &Unit, n: usize) -> Self {
        let s = unit.shard_len;
        // the unit's own count of the words (its shard and its kept
        // elements, as many as the rank keeping the most)
        let chunk = unit.bf16_words(n) / n;
        let mut runs = Vec::with_capacity(n);
        for r in 0..n {
            let shard = unit.shard(r);
            let mut out = Vec::new();
            let (mut at, mut word) = (0, 0);
            let mut push = |elems: Range<usize>, kept: bool, word: &mut usize| {
                if !elems.is_empty() {
                    let w = *word;
                    *word += elems.len() * if kept { 2 } else { 1 };
                    out.push(Run {
                        elems,
                        kept,
                        word: w,
                    });
                }
            };
            for k in &unit.keep_f32 {
                let a = k.start.clamp(shard.start, shard.end) - shard.start;
                let b = k.end.clamp(shard.start, shard.end) - shard.start;
                if a == b {
                    continue;
                }
                push(at..a, false, &mut word);
                push(a..b, true, &mut word);
                at = b;
            }
            push(at..s, false, &mut word);
            debug_assert!(word <= chunk, "rank {r}'s words overflow its chunk");
            runs.push(out);
        }
        Self {
            shard: s,
            chunk,
            runs,
        }
    }

    /// Words of one rank's chunk.
    #[cfg(test)]
    pub(crate) fn chunk(&self) -> usize {
        self.chunk
    }

    /// Words of the gathered buffer: every rank's chunk.
    pub(crate) fn len(&self) -> usize {
        self.chunk * self.runs.len()
    }

    /// Writes `xs`, elements `at..at + xs.len()` of rank `r`'s shard, into
    /// their places in rank `r`'s chunk of `packed` (the gathered buffer).
    pub(crate) fn write(&self, r: usize, at: usize, xs: &[f32], packed: &mut [bf16]) {
        let base = r * self.chunk;
        let end = at + xs.len();
        for run in &self.runs[r] {
            let (a, b) = (run.elems.start.max(at), run.elems.end.min(end));
            if a >= b {
                continue;
            }
            let src = &xs[a - at..b - at];
            let w = base + run.word + (a - run.elems.start) * if run.kept { 2 } else { 1 };
            if run.kept {
                for (pair, &x) in packed[w..w + 2 * src.len()].chunks_exact_mut(2).zip(src) {
                    let bits = x.to_bits();
                    pair[0] = bf16::from_bits((bits >> 16) as u16);
                    pair[1] = bf16::from_bits(bits as u16);
                }
            } else {
                round_to_bf16(&mut packed[w..w + src.len()], src);
            }
        }
    }

    /// Writes `xs`, elements `at..at + xs.len()` of the padded unit buffer
    /// (over any ranks' shards), into `packed`.
    pub(crate) fn write_unit(&self, at: usize, xs: &[f32], packed: &mut [bf16]) {
        let end = at + xs.len();
        for r in 0..self.runs.len() {
            let (a, b) = (at.max(r * self.shard), end.min((r + 1) * self.shard));
            if a < b {
                self.write(r, a - r * self.shard, &xs[a - at..b - at], packed);
            }
        }
    }

    /// The padded unit buffer (`shard · n` values) from the gathered
    /// words, into `out` (cleared first; its capacity is reused, and no
    /// value is written twice).
    pub(crate) fn read(&self, packed: &[bf16], out: &mut Vec<f32>) {
        out.clear();
        out.reserve(self.shard * self.runs.len());
        for (r, runs) in self.runs.iter().enumerate() {
            let chunk = &packed[r * self.chunk..(r + 1) * self.chunk];
            // the runs cover the shard in order
            for run in runs {
                let n = run.elems.len();
                if run.kept {
                    out.extend(
                        chunk[run.word..run.word + 2 * n]
                            .chunks_exact(2)
                            .map(|pair| {
                                f32::from_bits(
                                    u32::from(pair[0].to_bits()) << 16
                                        | u32::from(pair[1].to_bits()),
                                )
                            }),
                    );
                } else {
                    // exact: a bf16's bits are the top half of an f32's
                    out.extend(
                        chunk[run.word..run.word + n]
                            .iter()
                            .map(|x| f32::from_bits(u32::from(x.to_bits()) << 16)),
                    );
                }
            }
        }
    }
}
#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // units keeping one range
mod tests {
    use super::*;

    fn unit(len: usize, n: usize, keep: Vec<Range<usize>>) -> Unit {
        Unit {
            name: "u".into(),
            range: 100..100 + len,
            shard_len: len.div_ceil(n),
            keep_gathered: false,
            keep_f32: keep,
        }
    }

    /// Every rank writes its shard; reading the gathered words gives the
    /// kept elements' bits and every other element rounded to bf16 once.
    fn round_trip(len: usize, n: usize, keep: Vec<Range<usize>>) -> Bf16Wire {
        let u = unit(len, n, keep.clone());
        let w = Bf16Wire::new(&u, n);
        assert_eq!(w.len(), u.bf16_words(n));
        let s = u.shard_len;
        #[allow(clippy::cast_precision_loss)]
        let full: Vec<f32> = (0..s * n)
            .map(|i| {
                if i < len {
                    1.0 + i as f32 * 1.001e-3
                } else {
                    0.0
                }
            })
            .collect();
        let mut packed = vec![bf16::from_f32(f32::NAN); w.len()];
        for r in 0..n {
            // zero the padding, as a gather buffer starts
            packed[r * w.chunk()..(r + 1) * w.chunk()].fill(bf16::ZERO);
            w.write(r, 0, &full[r * s..(r + 1) * s], &mut packed);
        }
        let mut out = vec![f32::NAN; 3];
        w.read(&packed, &mut out);
        assert_eq!(out.len(), s * n);
        for (i, (&x, &y)) in full.iter().zip(&out).enumerate() {
            let kept = keep.iter().any(|k| k.contains(&i));
            let want = if kept { x } else { bf16::from_f32(x).to_f32() };
            assert_eq!(y.to_bits(), want.to_bits(), "element {i}");
        }
        // writing the whole unit at once lays out the same words
        let mut again = vec![bf16::ZERO; w.len()];
        w.write_unit(0, &full, &mut again);
        assert_eq!(again, packed);
        w
    }

    #[test]
    fn kept_ranges_cross_shards_and_chunks_are_padded_to_the_longest() {
        // 10 elements over 3 ranks (shards of 4): 1..3 on rank 0, 3..6 over
        // ranks 0 and 1, 9..10 on rank 2
        let w = round_trip(10, 3, vec![1..2, 3..6, 9..10]);
        // rank 0 keeps 1, 3 (2 extra words), rank 1 keeps 4, 5 (2), rank 2
        // keeps 9 (1): chunks of 4 + 2
        assert_eq!(w.chunk(), 6);
        assert_eq!(w.len(), 18);
    }

    #[test]
    fn nothing_kept_is_plain_bf16_and_everything_kept_is_f32_bytes() {
        assert_eq!(round_trip(7, 2, vec![]).len(), 8);
        assert_eq!(round_trip(7, 2, vec![0..7]).len(), 16);
        round_trip(5, 1, vec![2..3]);
    }

    #[test]
    fn a_write_at_an_offset_touches_only_its_elements() {
        let u = unit(8, 2, vec![2..5]);
        let w = Bf16Wire::new(&u, 2);
        let mut packed = vec![bf16::ZERO; w.len()];
        w.write_unit(3, &[7.25, -1.5, 3.0], &mut packed);
        let mut out = Vec::new();
        w.read(&packed, &mut out);
        assert_eq!(out, [0.0, 0.0, 0.0, 7.25, -1.5, 3.0, 0.0, 0.0]);
    }
}
