//! Measuring the bias and spread of a reduction path against the exact sum.

use crate::{Element, ExactSum, Strategy};

/// Errors of one strategy over many trials, measured against [`ExactSum`].
///
/// For trial `i` with data `x`, the error is `eᵢ = strategy(x) − exact(x)`
/// (both as `f64`; the exact sum is rounded to `f64` once, an error far below
/// anything measured here), and the relative error is `eᵢ / Σ|x|` — relative
/// to the sum of magnitudes, which is what summation error bounds scale with
/// and stays meaningful when the exact sum cancels to near zero.
///
/// Bias is what compounds: a reduction with zero-mean errors averages out
/// over steps, one whose errors share a sign drifts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DriftReport {
    /// Values per trial.
    pub n: usize,
    /// Number of trials.
    pub trials: usize,
    /// Mean signed error, `mean(eᵢ)`.
    pub bias: f64,
    /// Standard deviation of the error (population, over trials).
    pub spread: f64,
    /// Largest absolute error, `max |eᵢ|`.
    pub worst: f64,
    /// Mean signed relative error, `mean(eᵢ / Σ|x|)`.
    pub rel_bias: f64,
    /// Standard deviation of the relative error.
    pub rel_spread: f64,
    /// Largest absolute relative error.
    pub rel_worst: f64,
    /// Mean of the exact sums, for scale.
    pub mean_exact: f64,
}

impl DriftReport {
    /// `|bias| / (spread / √trials)`: how many standard errors the bias is
    /// away from zero. Above ~4 the strategy is biased on this workload beyond
    /// reasonable doubt; infinite when every trial errs by the same amount.
    pub fn bias_z(&self) -> f64 {
        if self.bias == 0.0 {
            return 0.0;
        }
        let se = self.spread / (self.trials as f64).sqrt();
        if se == 0.0 {
            f64::INFINITY
        } else {
            self.bias.abs() / se
        }
    }
}

/// Runs `trials` trials: each fills a buffer of `n` elements of `T` with
/// `generate`, sums it with `strategy` and with [`ExactSum`], and records the
/// error. The element dtype is `T`; the accumulator dtype is the strategy's.
///
/// ```
/// use weft_numerics::{measure, Dtype, Strategy};
///
/// // Ones summed naively in f16: every trial stalls at 2048.
/// let r = measure(Strategy::Naive(Dtype::F16), |_, buf: &mut [half::f16]| buf.fill(half::f16::ONE), 4096, 3);
/// assert_eq!(r.bias, 2048.0 - 4096.0);
/// assert_eq!(r.spread, 0.0);
/// ```
pub fn measure<T, G>(strategy: Strategy, mut generate: G, n: usize, trials: usize) -> DriftReport
where
    T: Element,
    G: FnMut(usize, &mut [T]),
{
    let mut buf = vec![T::ZERO; n];
    let mut errs = Vec::with_capacity(trials);
    let mut rels = Vec::with_capacity(trials);
    let mut exact_total = 0.0;
    for t in 0..trials {
        generate(t, &mut buf);
        let mut e = ExactSum::new();
        e.add_slice(&buf);
        let exact = e.to_f64();
        let mut a = ExactSum::new();
        for &x in &buf {
            a.add(x.abs());
        }
        let mag = a.to_f64();
        let err = strategy.sum(&buf) - exact;
        errs.push(err);
        rels.push(if mag > 0.0 { err / mag } else { 0.0 });
        exact_total += exact;
    }
    let (bias, spread, worst) = stats(&errs);
    let (rel_bias, rel_spread, rel_worst) = stats(&rels);
    DriftReport {
        n,
        trials,
        bias,
        spread,
        worst,
        rel_bias,
        rel_spread,
        rel_worst,
        mean_exact: if trials > 0 {
            exact_total / trials as f64
        } else {
            0.0
        },
    }
}

fn stats(xs: &[f64]) -> (f64, f64, f64) {
    if xs.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    let worst = xs.iter().fold(0.0f64, |w, x| w.max(x.abs()));
    (mean, var.sqrt(), worst)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Dtype;

    #[test]
    fn exact_has_no_error_and_naive_fp16_is_biased() {
        // Positive values of mixed size: naive f16 loses the small ones.
        let gen_ = |t: usize, buf: &mut [f32]| {
            for (i, x) in buf.iter_mut().enumerate() {
                *x = ((i * 7 + t * 13) % 100) as f32 * 0.01 + 0.001;
            }
        };
        let exact = measure(Strategy::Exact, gen_, 5000, 8);
        assert_eq!((exact.bias, exact.spread, exact.worst), (0.0, 0.0, 0.0));
        let naive = measure(Strategy::Naive(Dtype::F16), gen_, 5000, 8);
        assert!(naive.bias < 0.0, "{naive:?}");
        assert!(naive.bias_z() > 4.0, "{naive:?}");
        assert!(naive.rel_worst > 0.01);
        let kahan = measure(Strategy::Kahan(Dtype::F32), gen_, 5000, 8);
        assert!(kahan.worst < 1e-3, "{kahan:?}");
        assert!((naive.mean_exact - exact.mean_exact).abs() < 1e-9);
    }
}
