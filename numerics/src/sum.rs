//! Summation strategies and their error bounds.
//!
//! Let `u` be the unit roundoff of the accumulator dtype
//! ([`Dtype::unit_roundoff`]), `n` the number of values, `S = Σ xᵢ` the
//! exact sum and `A = Σ |xᵢ|`. Values are first rounded into the accumulator
//! dtype if it is narrower than the element type (as hardware would); the
//! bounds below are for the sum of the rounded values.
//!
//! | strategy | error bound | notes |
//! |---|---|---|
//! | [`sum_naive`] | `(n − 1)·u·A` | one running sum; once the sum's spacing exceeds twice the addends they are lost entirely (f16 stalls at 2048 adding ones) |
//! | [`sum_pairwise`] | `(12 + ⌈log₂(n/256)⌉)·u·A` | 32 interleaved running sums over blocks of 256 (7 additions each), a 5-level tree over the lanes, a balanced tree over the blocks; also the fast one |
//! | [`sum_kahan`] | `2u·A + O(n·u²)·A` | Kahan's compensation, fed back every step; error essentially independent of `n` |
//! | [`sum_neumaier`] | `u·|S| + O(n·u²)·A` | Kahan–Babuška–Neumaier: the compensation is kept apart, so large addends do not wipe it out |
//! | [`ExactSum`] | `u·|S|`, only the final rounding (half an ulp) | order-independent, bitwise reproducible |
//!
//! (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
//! §4.2–4.3; Neumaier, 1974.)

use half::{bf16, f16};

use crate::simd::multiversion;
use crate::{Dtype, Element, ExactSum};

/// Interleaved running sums of the pairwise base case.
const LANES: usize = 32;
/// Base-case block of the pairwise recursion.
const BLOCK: usize = 256;

/// Left-to-right summation with one running sum in accumulator type `A`.
///
/// This is what an unguarded reduction does, and it is biased: when the
/// running sum is large, small addends are rounded away, always toward the
/// running sum's magnitude.
///
/// ```
/// use half::f16;
/// use weft_numerics::sum_naive;
/// let ones = vec![f16::from_f32(1.0); 10_000];
/// assert_eq!(sum_naive::<f16, f16>(&ones).to_f32(), 2048.0);
/// ```
pub fn sum_naive<T: Element, A: Element>(xs: &[T]) -> A {
    xs.iter()
        .fold(A::ZERO, |s, &x| s.add(A::from_f64(x.to_f64())))
}

/// Kahan's compensated summation in accumulator type `A`: each step
/// computes the low-order bits the addition lost and feeds them back into
/// the next addend. Because the correction re-enters the running sum at every
/// step, it keeps a low-precision accumulator growing where a naive one
/// stalls. It assumes the running sum dominates the addends: an addend much
/// larger than the sum can wipe out the correction (see [`sum_neumaier`]).
/// Sequential, so slower than [`sum_pairwise`].
///
/// ```
/// use half::f16;
/// use weft_numerics::sum_kahan;
/// let ones = vec![f16::from_f32(1.0); 10_000];
/// assert_eq!(sum_kahan::<f16, f16>(&ones).to_f32(), 10_000.0);
/// ```
pub fn sum_kahan<T: Element, A: Element>(xs: &[T]) -> A {
    let (mut s, mut c) = (A::ZERO, A::ZERO);
    for &x in xs {
        let y = A::from_f64(x.to_f64()).sub(c);
        let t = s.add(y);
        c = t.sub(s).sub(y);
        s = t;
    }
    s
}

/// Kahan–Babuška–Neumaier compensated summation in accumulator type `A`:
/// a second accumulator collects the bits each addition loses, whichever
/// operand was larger, and is added once at the end. Unlike [`sum_kahan`] it
/// survives addends larger than the running sum (`[1, 1e100, 1, -1e100]`
/// sums to 2), but its compensation accumulates in `A` too, so in a very
/// narrow type it can stall like a naive sum (10,000 ones in f16 give 4096).
///
/// ```
/// use weft_numerics::sum_neumaier;
/// assert_eq!(sum_neumaier::<f64, f64>(&[1.0, 1e100, 1.0, -1e100]), 2.0);
/// ```
pub fn sum_neumaier<T: Element, A: Element>(xs: &[T]) -> A {
    let (mut s, mut c) = (A::ZERO, A::ZERO);
    for &x in xs {
        let x = A::from_f64(x.to_f64());
        let t = s.add(x);
        let lost = if s.abs() >= x.abs() {
            s.sub(t).add(x)
        } else {
            x.sub(t).add(s)
        };
        c = c.add(lost);
        s = t;
    }
    s.add(c)
}

/// Blocked pairwise summation in accumulator type `A`: the slice is halved
/// recursively down to blocks of 256 values, each summed by 32 interleaved
/// running sums (which vectorize), and the partial sums are combined by a
/// balanced binary tree. The error grows with `log n` instead of `n`.
///
/// ```
/// use weft_numerics::sum_pairwise;
/// let xs: Vec<f32> = (0..1_000_000).map(|_| 0.1).collect();
/// let s: f32 = sum_pairwise::<f32, f32>(&xs);
/// assert!((f64::from(s) - 100_000.0).abs() < 0.1);
/// ```
pub fn sum_pairwise<T: Element, A: Element>(xs: &[T]) -> A {
    // The f32 → f32 case is the one reductions use: give it the SIMD build.
    if T::DTYPE == Dtype::F32 && A::DTYPE == Dtype::F32 {
        // SAFETY: both types are f32 (the Element trait is sealed).
        let xs = unsafe { std::slice::from_raw_parts(xs.as_ptr().cast::<f32>(), xs.len()) };
        let s = pairwise_f32(xs);
        return A::from_f32(s);
    }
    pairwise::<T, A>(xs)
}

multiversion! {
    fn pairwise_f32(xs: &[f32]) -> f32 {
        pairwise::<f32, f32>(xs)
    }
}

#[inline(always)]
fn pairwise<T: Element, A: Element>(xs: &[T]) -> A {
    if xs.len() <= BLOCK {
        let mut acc = [A::ZERO; LANES];
        let mut chunks = xs.chunks_exact(LANES);
        for c in &mut chunks {
            for (a, &x) in acc.iter_mut().zip(c) {
                *a = a.add(A::from_f64(x.to_f64()));
            }
        }
        for (a, &x) in acc.iter_mut().zip(chunks.remainder()) {
            *a = a.add(A::from_f64(x.to_f64()));
        }
        let mut width = LANES;
        while width > 1 {
            width /= 2;
            for i in 0..width {
                acc[i] = acc[i].add(acc[i + width]);
            }
        }
        acc[0]
    } else {
        // Split on a block boundary so the tree is the same for any length.
        let half = xs.len().div_ceil(2 * BLOCK) * BLOCK;
        let (l, r) = xs.split_at(half);
        pairwise::<T, A>(l).add(pairwise::<T, A>(r))
    }
}

/// A summation strategy: the algorithm and the dtype it accumulates in.
///
/// Error bounds, with `u` the unit roundoff of the accumulator dtype
/// ([`Dtype::unit_roundoff`]), `n` values, exact sum `S` and `A = Σ|xᵢ|`
/// (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
/// §4.2–4.3; Neumaier 1974). Values are first rounded into the accumulator
/// dtype if it is narrower than the element type, as hardware would; the
/// bounds are for the sum of the rounded values.
///
/// | strategy | error bound | notes |
/// |---|---|---|
/// | [`Naive`](Strategy::Naive) | `(n − 1)·u·A` | one running sum; once its spacing exceeds twice the addends they are lost entirely (f16 stalls at 2048 adding ones) — biased |
/// | [`Pairwise`](Strategy::Pairwise) | `(12 + ⌈log₂(n/256)⌉)·u·A` | 32 interleaved sums over blocks of 256, trees above; the fast one |
/// | [`Kahan`](Strategy::Kahan) | `2u·A + O(n·u²)·A` | compensation fed back every step |
/// | [`Neumaier`](Strategy::Neumaier) | `u·|S| + O(n·u²)·A` | compensation kept apart; survives addends larger than the sum |
/// | [`Exact`](Strategy::Exact) | `u·|S|` (the final rounding only) | order-independent, bitwise reproducible |
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// [`sum_naive`] accumulating in the given dtype.
    Naive(Dtype),
    /// [`sum_kahan`] accumulating in the given dtype.
    Kahan(Dtype),
    /// [`sum_neumaier`] accumulating in the given dtype.
    Neumaier(Dtype),
    /// [`sum_pairwise`] accumulating in the given dtype.
    Pairwise(Dtype),
    /// [`ExactSum`], rounded once at the end.
    Exact,
}

impl Strategy {
    /// Sums `xs` with this strategy; the result (a value of the accumulator
    /// dtype) is returned widened exactly to `f64`. [`Strategy::Exact`]
    /// returns the exact sum rounded to `f64`.
    pub fn sum<T: Element>(self, xs: &[T]) -> f64 {
        fn by_acc<T: Element>(acc: Dtype, f: Summer<'_, T>) -> f64 {
            match acc {
                Dtype::F64 => f.run::<f64>(),
                Dtype::F32 => f.run::<f32>(),
                Dtype::F16 => f.run::<f16>(),
                Dtype::BF16 => f.run::<bf16>(),
            }
        }
        match self {
            Strategy::Naive(a) => by_acc(
                a,
                Summer {
                    xs,
                    kind: Kind::Naive,
                },
            ),
            Strategy::Kahan(a) => by_acc(
                a,
                Summer {
                    xs,
                    kind: Kind::Kahan,
                },
            ),
            Strategy::Neumaier(a) => by_acc(
                a,
                Summer {
                    xs,
                    kind: Kind::Neumaier,
                },
            ),
            Strategy::Pairwise(a) => by_acc(
                a,
                Summer {
                    xs,
                    kind: Kind::Pairwise,
                },
            ),
            Strategy::Exact => {
                let mut e = ExactSum::new();
                e.add_slice(xs);
                e.to_f64()
            }
        }
    }

    /// A short name for tables, e.g. `naive/f16` or `exact`.
    pub fn name(self) -> String {
        match self {
            Strategy::Naive(a) => format!("naive/{a}"),
            Strategy::Kahan(a) => format!("kahan/{a}"),
            Strategy::Neumaier(a) => format!("neumaier/{a}"),
            Strategy::Pairwise(a) => format!("pairwise/{a}"),
            Strategy::Exact => "exact".to_owned(),
        }
    }
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Naive,
    Kahan,
    Neumaier,
    Pairwise,
}

struct Summer<'a, T> {
    xs: &'a [T],
    kind: Kind,
}

impl<T: Element> Summer<'_, T> {
    fn run<A: Element>(self) -> f64 {
        let a: A = match self.kind {
            Kind::Naive => sum_naive(self.xs),
            Kind::Kahan => sum_kahan(self.xs),
            Kind::Neumaier => sum_neumaier(self.xs),
            Kind::Pairwise => sum_pairwise(self.xs),
        };
        a.to_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ones<T: Element>(n: usize) -> Vec<T> {
        vec![T::from_f32(1.0); n]
    }

    #[test]
    fn the_fp16_stall() {
        // 2048 + 1 = 2049 is a tie between 2048 and 2050 in f16; ties go to
        // even, 2048: the sum stops growing.
        assert_eq!(
            Strategy::Naive(Dtype::F16).sum(&ones::<f16>(10_000)),
            2048.0
        );
        // bf16 has 8 significand bits: it stalls at 256.
        assert_eq!(
            Strategy::Naive(Dtype::BF16).sum(&ones::<bf16>(10_000)),
            256.0
        );
        // f32 stalls at 2^24.
        let n: usize = (1 << 24) + 1000;
        assert_eq!(sum_naive::<f32, f32>(&ones::<f32>(n)), 16_777_216.0);
        // Widening the accumulator fixes it...
        assert_eq!(
            Strategy::Naive(Dtype::F32).sum(&ones::<f16>(10_000)),
            10_000.0
        );
        // ...and so does compensation fed back every step, even in f16
        // (10,000 is representable)...
        assert_eq!(
            Strategy::Kahan(Dtype::F16).sum(&ones::<f16>(10_000)),
            10_000.0
        );
        // ...but not a compensation that itself accumulates in f16: it
        // stalls at 2048 beside the sum's 2048.
        assert_eq!(
            Strategy::Neumaier(Dtype::F16).sum(&ones::<f16>(10_000)),
            4096.0
        );
        assert_eq!(
            Strategy::Pairwise(Dtype::F16).sum(&ones::<f16>(10_000)),
            10_000.0
        );
        assert_eq!(Strategy::Exact.sum(&ones::<f16>(10_000)), 10_000.0);
    }

    #[test]
    fn catastrophic_cancellation() {
        let xs = [1e16f64, 1.0, -1e16];
        assert_eq!(Strategy::Naive(Dtype::F64).sum(&xs), 0.0);
        assert_eq!(Strategy::Neumaier(Dtype::F64).sum(&xs), 1.0);
        assert_eq!(Strategy::Exact.sum(&xs), 1.0);
        // Neumaier's variant survives an addend larger than the running sum;
        // plain Kahan loses the correction.
        let xs = [1.0f64, 1e100, 1.0, -1e100];
        assert_eq!(Strategy::Neumaier(Dtype::F64).sum(&xs), 2.0);
        assert_eq!(Strategy::Kahan(Dtype::F64).sum(&xs), 0.0);
        assert_eq!(Strategy::Exact.sum(&xs), 2.0);
        assert_eq!(Strategy::Naive(Dtype::F64).sum(&xs), 0.0);
    }

    #[test]
    fn pairwise_is_the_same_tree_for_every_lane_path() {
        // The f32 SIMD build and the generic build follow the same tree:
        // compare against the generic path through f32 → f32 with f64
        // elements widened exactly.
        let xs: Vec<f32> = (0..100_003)
            .map(|i| ((i * 7919) % 1000) as f32 * 0.001 - 0.3)
            .collect();
        let fast: f32 = sum_pairwise::<f32, f32>(&xs);
        let generic: f32 = pairwise::<f32, f32>(&xs);
        assert_eq!(fast.to_bits(), generic.to_bits());
    }

    #[test]
    fn error_bounds_hold() {
        // Uniform positive data: the worst case for naive summation's bias.
        let n: usize = 1 << 20;
        let xs: Vec<f32> = (0..n)
            .map(|i| 0.5 + ((i * 7919) % 10_007) as f32 / 10_007.0)
            .collect();
        let mut e = ExactSum::new();
        e.add_slice(&xs);
        let exact = e.to_f64();
        let a: f64 = exact; // all positive: A = S
        let u = Dtype::F32.unit_roundoff();
        let naive = Strategy::Naive(Dtype::F32).sum(&xs);
        let pair = Strategy::Pairwise(Dtype::F32).sum(&xs);
        let kahan = Strategy::Kahan(Dtype::F32).sum(&xs);
        let neumaier = Strategy::Neumaier(Dtype::F32).sum(&xs);
        assert!((naive - exact).abs() <= (n - 1) as f64 * u * a);
        let levels = (n as f64 / BLOCK as f64).log2().ceil() + 12.0;
        assert!((pair - exact).abs() <= levels * u * a);
        assert!((kahan - exact).abs() <= 2.0 * u * a + (n as f64) * u * u * a);
        assert!((neumaier - exact).abs() <= u * exact.abs() + (n as f64) * u * u * a);
        // And they order as expected on this data.
        assert!((kahan - exact).abs() <= (pair - exact).abs());
        assert!((pair - exact).abs() < (naive - exact).abs());
    }
}
