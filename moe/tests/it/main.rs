//! weft-moe integration tests (one binary).
#![allow(clippy::needless_range_loop)]

mod audit;
mod balance;
mod block;
mod ep;
mod router;

/// SplitMix64 for test data.
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-s, s).
    pub fn sym(&mut self, s: f64) -> f64 {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * s
    }
    /// `n` values uniform in [-s, s).
    pub fn vec(&mut self, n: usize, s: f64) -> Vec<f64> {
        (0..n).map(|_| self.sym(s)).collect()
    }
}
