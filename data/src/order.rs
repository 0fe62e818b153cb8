//! The order of sequences: pure functions of (seed, sample number), with
//! no state to save, so every layout and every restart sees the same
//! sequences in the same places.
//!
//! - [`Permutation`]: a seeded bijection of `0..n` (a Feistel network on
//!   the next even power of two, cycle-walked back into `0..n`), computed
//!   per element in O(1) time and memory, so an epoch of a billion
//!   sequences is shuffled without materializing it.
//! - [`Interleave`]: which dataset of a blend the sample number `g` comes
//!   from, and its number within that dataset. Dataset `d` of weights
//!   `w` takes sample `g` when `⌊(g+1)·p + φ⌋ > ⌊g·p + φ⌋` (`p` its share of
//!   what the datasets before it left, `φ` a seeded phase), recursively
//!   over the rest: after `S` samples each dataset has had its share to
//!   within one sample per level, and its count is a closed form — the
//!   realized proportions are computed, not estimated.

/// SplitMix64's finalizer: a bijective mix of 64 bits.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Mixes several words into one seed.
pub(crate) fn seed_of(words: &[u64]) -> u64 {
    words
        .iter()
        .fold(0x5745_4654_4441_5441, |z, &w| mix(z ^ mix(w)))
}

/// A seeded pseudo-random bijection of `0..n`.
#[derive(Clone, Debug)]
pub struct Permutation {
    n: u64,
    half: u32,
    keys: [u64; 6],
}

impl Permutation {
    /// The permutation of `0..n` for `seed`.
    pub fn new(n: u64, seed: u64) -> Self {
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let half = bits.div_ceil(2).max(1);
        let mut keys = [0; 6];
        for (i, k) in keys.iter_mut().enumerate() {
            *k = seed_of(&[seed, i as u64]);
        }
        Self { n, half, keys }
    }

    /// The size of the domain.
    pub fn len(&self) -> u64 {
        self.n
    }

    /// Whether the domain is empty.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    fn feistel(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half) - 1;
        let (mut l, mut r) = (x >> self.half, x & mask);
        for &k in &self.keys {
            let f = mix(r ^ k) & mask;
            (l, r) = (r, l ^ f);
        }
        (l << self.half) | r
    }

    /// Where `i` goes.
    ///
    /// # Panics
    /// If `i` is not below `n`.
    pub fn apply(&self, i: u64) -> u64 {
        assert!(i < self.n, "index {i} outside 0..{}", self.n);
        let mut y = self.feistel(i);
        while y >= self.n {
            y = self.feistel(y);
        }
        y
    }
}

/// The sample-to-dataset map of a blend.
#[derive(Clone, Debug)]
pub struct Interleave {
    /// Share of each level: dataset `d`'s weight over the weights of
    /// datasets `d..`.
    shares: Vec<f64>,
    phases: Vec<f64>,
}

impl Interleave {
    /// The interleave of datasets with positive `weights` for `seed`.
    ///
    /// # Panics
    /// If `weights` is empty or holds a weight that is not finite and
    /// positive (callers check, with an error naming the field).
    pub fn new(weights: &[f64], seed: u64) -> Self {
        assert!(!weights.is_empty() && weights.iter().all(|w| w.is_finite() && *w > 0.0));
        let mut shares = Vec::with_capacity(weights.len());
        for d in 0..weights.len() {
            let rest: f64 = weights[d..].iter().sum();
            shares.push(if d + 1 == weights.len() {
                1.0
            } else {
                weights[d] / rest
            });
        }
        let phases = (0..weights.len())
            .map(|d| (seed_of(&[seed, 0xb1e4d, d as u64]) >> 11) as f64 / (1u64 << 53) as f64)
            .collect();
        Self { shares, phases }
    }

    fn before(&self, d: usize, g: u64) -> u64 {
        // Samples of level d among its first g.
        let (p, o) = (self.shares[d], self.phases[d]);
        ((g as f64) * p + o).floor() as u64 - o.floor() as u64
    }

    /// Sample `g` of the blend: its dataset and its number within it.
    pub fn locate(&self, g: u64) -> (usize, u64) {
        let mut g = g;
        for d in 0..self.shares.len() {
            let (here, next) = (self.before(d, g), self.before(d, g + 1));
            if next > here || d + 1 == self.shares.len() {
                return (d, if d + 1 == self.shares.len() { g } else { here });
            }
            g -= here;
        }
        unreachable!("the last level takes every sample")
    }

    /// How many of the first `samples` samples each dataset gives.
    pub fn counts(&self, samples: u64) -> Vec<u64> {
        let mut left = samples;
        let mut out = Vec::with_capacity(self.shares.len());
        for d in 0..self.shares.len() {
            let c = if d + 1 == self.shares.len() {
                left
            } else {
                self.before(d, left)
            };
            out.push(c);
            left -= c;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn permutations_are_bijections(n in 1u64..3000, seed in any::<u64>()) {
            let p = Permutation::new(n, seed);
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let j = p.apply(i) as usize;
                prop_assert!(!seen[j]);
                seen[j] = true;
            }
        }

        #[test]
        fn interleave_counts_match_locate(
            weights in proptest::collection::vec(0.05f64..5.0, 1..5),
            seed in any::<u64>(),
            samples in 0u64..2000,
        ) {
            let il = Interleave::new(&weights, seed);
            let mut counts = vec![0u64; weights.len()];
            for g in 0..samples {
                let (d, j) = il.locate(g);
                // Each dataset's samples are numbered 0, 1, 2, ... in order.
                prop_assert_eq!(j, counts[d]);
                counts[d] += 1;
            }
            prop_assert_eq!(&counts, &il.counts(samples));
            // Each within a few samples of its share.
            let total: f64 = weights.iter().sum();
            for (d, &c) in counts.iter().enumerate() {
                let want = samples as f64 * weights[d] / total;
                prop_assert!((c as f64 - want).abs() <= weights.len() as f64 + 1.0, "{c} vs {want}");
            }
        }
    }

    #[test]
    fn permutations_differ_by_seed_and_look_shuffled() {
        let (a, b) = (Permutation::new(1000, 1), Permutation::new(1000, 2));
        let va: Vec<u64> = (0..1000).map(|i| a.apply(i)).collect();
        let vb: Vec<u64> = (0..1000).map(|i| b.apply(i)).collect();
        assert_ne!(va, vb);
        // Few fixed points and no long identity runs.
        assert!(
            va.iter()
                .enumerate()
                .filter(|&(i, &v)| i as u64 == v)
                .count()
                < 10
        );
        // Spearman-like check: successive elements are not close together.
        let close = va.windows(2).filter(|w| w[0].abs_diff(w[1]) < 10).count();
        assert!(close < 50, "{close}");
        assert_eq!(Permutation::new(1, 9).apply(0), 0);
    }
}
