//! Comparing runs: curves aligned by step, their per-step difference, the
//! difference of two groups of seeds with a confidence interval, and the
//! verdict a user acts on.
//!
//! `weft compare` (the trainer's command line) and the page's overlay of
//! several runs use these functions, so both show the same figures. Nothing
//! here reads files; the inputs are `(step, value)` series as
//! `metrics.jsonl` gives them and the final figures of each run.
//!
//! The interval pairs the runs by seed where both groups ran the same
//! seeds ([`Paired`]: the mean of the `n` differences with the standard
//! error `s_d/√n` and `n − 1` degrees of freedom): runs of one seed share
//! their initialisation and data order, and pairing takes that shared noise
//! out. Otherwise it is Welch's ([`Welch`]): the difference of the two
//! groups' means, with the standard error `sqrt(s_a²/n_a + s_b²/n_b)` and
//! the Welch–Satterthwaite degrees of freedom. Both at the two-sided
//! quantile of Student's t distribution (computed here from the
//! regularized incomplete beta function; the tests check it against the
//! published table).
//!
//! # Example
//! ```
//! use weft_compare::stats::{Paired, StepDiff, Verdict, Welch, pair_by_seed, verdict};
//!
//! let a = [(1, 3.0), (2, 2.5), (3, 2.25)];
//! let b = [(1, 3.0), (2, 2.5), (3, 2.0)];
//! let d = StepDiff::between(&a, &b);
//! assert_eq!(d.bitwise_span, 2);
//! assert_eq!(d.first_differing, Some(3));
//! assert_eq!(d.max_abs, 0.25);
//!
//! // three seeds each: a clear improvement
//! let (a, b) = ([2.30, 2.31, 2.29], [2.20, 2.21, 2.19]);
//! let w = Welch::new(&a, &b).unwrap();
//! assert!((w.diff + 0.1).abs() < 1e-12);
//! let v = verdict(&d, &a, &b, None, None);
//! assert!(matches!(v, Verdict::Better { n_a: 3, n_b: 3, paired: false, .. }), "{v}");
//!
//! // the same seeds on both sides: paired, a narrower interval
//! let seeded = |x: &[f64]| -> Vec<(Option<u64>, f64)> {
//!     x.iter().enumerate().map(|(s, &v)| (Some(s as u64), v)).collect()
//! };
//! let pairs = pair_by_seed(&seeded(&a), &seeded(&b)).unwrap();
//! let p = Paired::new(&pairs).unwrap();
//! assert!(p.half_width < w.half_width);
//! let v = verdict(&d, &a, &b, Some(&pairs), None);
//! assert!(matches!(v, Verdict::Better { paired: true, .. }), "{v}");
//! ```

use std::collections::BTreeMap;
use std::fmt;

/// A series as the last value logged at each step, in step order: a run
/// that rewound or resumed logs some steps twice, and the later line is
/// the one its model kept.
#[must_use]
pub fn last_per_step(points: impl IntoIterator<Item = (u64, f64)>) -> Vec<(u64, f64)> {
    let map: BTreeMap<u64, f64> = points.into_iter().collect();
    map.into_iter().collect()
}

/// The mean of several series at the steps all of them have (a group of
/// seeds' mean curve). Each series should be [`last_per_step`]'s output.
#[must_use]
pub fn mean_series(series: &[Vec<(u64, f64)>]) -> Vec<(u64, f64)> {
    let Some((first, rest)) = series.split_first() else {
        return Vec::new();
    };
    let maps: Vec<BTreeMap<u64, f64>> = rest.iter().map(|s| s.iter().copied().collect()).collect();
    first
        .iter()
        .filter_map(|&(step, v)| {
            let mut sum = v;
            for m in &maps {
                sum += m.get(&step)?;
            }
            Some((step, sum / series.len() as f64))
        })
        .collect()
}

/// Two series compared at the steps both have.
#[derive(Clone, Debug, PartialEq)]
pub struct StepDiff {
    /// `(step, b − a)` at every step both series have, in step order.
    pub points: Vec<(u64, f64)>,
    /// Largest `|b − a|` (0 when no step is shared; NaN if a value is).
    pub max_abs: f64,
    /// Mean `|b − a|` over the shared steps (0 when none is shared).
    pub mean_abs: f64,
    /// The first shared step whose values are not bit for bit equal.
    pub first_differing: Option<u64>,
    /// Shared steps, from the first, whose values are bit for bit equal.
    pub bitwise_span: u64,
    /// Steps only one of the two series has.
    pub unmatched: usize,
}

impl StepDiff {
    /// Compare `b` with `a`, aligned by step (the first element of each
    /// pair; for an alignment by tokens pass tokens there). Both must be in
    /// increasing step order, as [`last_per_step`] returns them.
    #[must_use]
    pub fn between(a: &[(u64, f64)], b: &[(u64, f64)]) -> Self {
        let (mut i, mut j) = (0, 0);
        let mut points = Vec::new();
        let mut first_differing = None;
        let mut bitwise_span = 0u64;
        let (mut max_abs, mut sum_abs) = (0.0f64, 0.0f64);
        while i < a.len() && j < b.len() {
            let ((sa, va), (sb, vb)) = (a[i], b[j]);
            if sa < sb {
                i += 1;
                continue;
            }
            if sb < sa {
                j += 1;
                continue;
            }
            let d = vb - va;
            if va.to_bits() == vb.to_bits() {
                if first_differing.is_none() {
                    bitwise_span += 1;
                }
            } else if first_differing.is_none() {
                first_differing = Some(sa);
            }
            // NaN wins the maximum: a diverged step must not hide
            max_abs = if d.is_nan() || max_abs.is_nan() {
                f64::NAN
            } else {
                max_abs.max(d.abs())
            };
            sum_abs += d.abs();
            points.push((sa, d));
            i += 1;
            j += 1;
        }
        let unmatched = a.len() + b.len() - 2 * points.len();
        let mean_abs = if points.is_empty() {
            0.0
        } else {
            sum_abs / points.len() as f64
        };
        Self {
            points,
            max_abs,
            mean_abs,
            first_differing,
            bitwise_span,
            unmatched,
        }
    }

    /// Whether the shared steps are all bit for bit equal (and there is at
    /// least one).
    #[must_use]
    pub fn bitwise(&self) -> bool {
        !self.points.is_empty() && self.first_differing.is_none()
    }
}

/// The difference of two groups' means with Welch's 95% confidence
/// interval.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Welch {
    /// Runs in the first group (the baseline).
    pub n_a: usize,
    /// Runs in the second group.
    pub n_b: usize,
    /// Mean of the first group.
    pub mean_a: f64,
    /// Mean of the second group.
    pub mean_b: f64,
    /// `mean_b − mean_a`.
    pub diff: f64,
    /// Standard error of the difference.
    pub std_err: f64,
    /// Welch–Satterthwaite degrees of freedom (infinite when both groups
    /// have no spread).
    pub df: f64,
    /// Half-width of the two-sided 95% interval: the difference is
    /// `diff ± half_width`.
    pub half_width: f64,
}

impl Welch {
    /// The interval for `b`'s mean minus `a`'s; `None` unless both groups
    /// have at least two finite values.
    #[must_use]
    pub fn new(a: &[f64], b: &[f64]) -> Option<Self> {
        Self::with_level(a, b, 0.95)
    }

    /// As [`Welch::new`] at another two-sided confidence level in (0, 1).
    #[must_use]
    pub fn with_level(a: &[f64], b: &[f64], level: f64) -> Option<Self> {
        if a.len() < 2 || b.len() < 2 || !(level > 0.0 && level < 1.0) {
            return None;
        }
        if a.iter().chain(b).any(|x| !x.is_finite()) {
            return None;
        }
        let (ma, va) = mean_var(a);
        let (mb, vb) = mean_var(b);
        let (na, nb) = (a.len() as f64, b.len() as f64);
        let (qa, qb) = (va / na, vb / nb);
        let se2 = qa + qb;
        let df = if se2 == 0.0 {
            f64::INFINITY
        } else {
            se2 * se2 / (qa * qa / (na - 1.0) + qb * qb / (nb - 1.0))
        };
        let std_err = se2.sqrt();
        let t = student_t_quantile(0.5 + level / 2.0, df);
        Some(Self {
            n_a: a.len(),
            n_b: b.len(),
            mean_a: ma,
            mean_b: mb,
            diff: mb - ma,
            std_err,
            df,
            half_width: t * std_err,
        })
    }

    /// Whether 0 lies inside the interval: the groups cannot be told
    /// apart at this level.
    #[must_use]
    pub fn contains_zero(&self) -> bool {
        self.diff.abs() <= self.half_width
    }
}

/// The mean of paired differences with Student's 95% confidence
/// interval: runs of two groups that share a seed (the same
/// initialisation and data order) differ by the change plus less noise
/// than two unrelated runs do, and pairing them takes the shared part out
/// (the interval of `t(n − 1)·s_d/√n` over the `n` differences `b − a`,
/// as R's `t.test(b, a, paired = TRUE)` gives it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Paired {
    /// Pairs.
    pub n: usize,
    /// Mean of the first of each pair (the baseline).
    pub mean_a: f64,
    /// Mean of the second.
    pub mean_b: f64,
    /// Mean of `b − a`: `mean_b − mean_a`.
    pub diff: f64,
    /// Standard error of that mean.
    pub std_err: f64,
    /// Degrees of freedom, `n − 1`.
    pub df: f64,
    /// Half-width of the two-sided 95% interval: the difference is
    /// `diff ± half_width`.
    pub half_width: f64,
}

impl Paired {
    /// The interval for the mean of `b − a` over `pairs` of `(a, b)`;
    /// `None` unless there are at least two pairs, all finite.
    #[must_use]
    pub fn new(pairs: &[(f64, f64)]) -> Option<Self> {
        Self::with_level(pairs, 0.95)
    }

    /// As [`Paired::new`] at another two-sided confidence level in (0, 1).
    #[must_use]
    pub fn with_level(pairs: &[(f64, f64)], level: f64) -> Option<Self> {
        if pairs.len() < 2 || !(level > 0.0 && level < 1.0) {
            return None;
        }
        if pairs.iter().any(|(a, b)| !(a.is_finite() && b.is_finite())) {
            return None;
        }
        let d: Vec<f64> = pairs.iter().map(|(a, b)| b - a).collect();
        let (md, vd) = mean_var(&d);
        let n = pairs.len() as f64;
        let mean = |x: &mut dyn Iterator<Item = f64>| x.sum::<f64>() / n;
        let std_err = (vd / n).sqrt();
        let df = n - 1.0;
        Some(Self {
            n: pairs.len(),
            mean_a: mean(&mut pairs.iter().map(|p| p.0)),
            mean_b: mean(&mut pairs.iter().map(|p| p.1)),
            diff: md,
            std_err,
            df,
            half_width: student_t_quantile(0.5 + level / 2.0, df) * std_err,
        })
    }

    /// Whether 0 lies inside the interval.
    #[must_use]
    pub fn contains_zero(&self) -> bool {
        self.diff.abs() <= self.half_width
    }
}

/// The final figures of two groups paired by seed, `(baseline,
/// candidate)` in the baseline's order: `Some` when every run of both has
/// a seed, no seed comes twice in a group, and both groups ran the same
/// seeds, at least two; `a` and `b` are each run's `(seed, final figure)`.
#[must_use]
pub fn pair_by_seed(a: &[(Option<u64>, f64)], b: &[(Option<u64>, f64)]) -> Option<Vec<(f64, f64)>> {
    if a.len() < 2 || a.len() != b.len() {
        return None;
    }
    let seeds = |g: &[(Option<u64>, f64)]| -> Option<std::collections::BTreeSet<u64>> {
        let set: std::collections::BTreeSet<u64> = g.iter().map(|r| r.0).collect::<Option<_>>()?;
        (set.len() == g.len()).then_some(set)
    };
    if seeds(a)? != seeds(b)? {
        return None;
    }
    a.iter()
        .map(|&(s, x)| b.iter().find(|r| r.0 == s).map(|r| (x, r.1)))
        .collect()
}

/// Mean and unbiased sample variance.
fn mean_var(x: &[f64]) -> (f64, f64) {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let ss = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>();
    (mean, ss / (n - 1.0))
}

/// What a comparison of a candidate with the baseline says, on the final
/// figure compared (lower is better: a loss).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Verdict {
    /// Every shared step and the final figure are bit for bit equal.
    BitwiseIdentical,
    /// Not bitwise, but every shared step and the final figure differ by
    /// at most the tolerance.
    EqualWithin {
        /// The tolerance asked for.
        tol: f64,
        /// The largest difference seen.
        max_abs: f64,
    },
    /// Groups of seeds whose interval holds 0: the difference is inside
    /// the seed noise.
    NotDistinguishable {
        /// Candidate's mean minus the baseline's.
        diff: f64,
        /// Half-width of the 95% interval.
        pm: f64,
        /// Seeds of the baseline.
        n_a: usize,
        /// Seeds of the candidate.
        n_b: usize,
        /// Whether the interval pairs the runs by seed ([`Paired`]) or
        /// is Welch's.
        paired: bool,
    },
    /// The candidate's mean is lower, outside the 95% interval.
    Better {
        /// How much lower (positive).
        by: f64,
        /// Half-width of the 95% interval.
        pm: f64,
        /// Seeds of the baseline.
        n_a: usize,
        /// Seeds of the candidate.
        n_b: usize,
        /// Paired by seed, or Welch's.
        paired: bool,
    },
    /// The candidate's mean is higher, outside the 95% interval.
    Worse {
        /// How much higher (positive).
        by: f64,
        /// Half-width of the 95% interval.
        pm: f64,
        /// Seeds of the baseline.
        n_a: usize,
        /// Seeds of the candidate.
        n_b: usize,
        /// Paired by seed, or Welch's.
        paired: bool,
    },
    /// One run on a side: the runs differ, but the seed noise is unknown.
    Differs {
        /// Candidate minus baseline (lower is better).
        diff: f64,
    },
    /// A final figure is missing or not finite.
    Unknown,
}

impl Verdict {
    /// A short name for JSON: `bitwise_identical`, `equal_within`,
    /// `not_distinguishable`, `better`, `worse`, `differs`, `unknown`.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Self::BitwiseIdentical => "bitwise_identical",
            Self::EqualWithin { .. } => "equal_within",
            Self::NotDistinguishable { .. } => "not_distinguishable",
            Self::Better { .. } => "better",
            Self::Worse { .. } => "worse",
            Self::Differs { .. } => "differs",
            Self::Unknown => "unknown",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let seeds = |a: usize, b: usize, paired: bool| match (a == b, paired) {
            (true, true) => format!("{a} seeds, paired"),
            (true, false) => format!("{a} seeds"),
            _ => format!("{a} and {b} seeds"),
        };
        match *self {
            Self::BitwiseIdentical => write!(f, "bitwise identical"),
            Self::EqualWithin { tol, max_abs } => {
                write!(
                    f,
                    "equal within tolerance {tol:e} (largest difference {max_abs:.3e})"
                )
            }
            Self::NotDistinguishable {
                diff,
                pm,
                n_a,
                n_b,
                paired,
            } => write!(
                f,
                "not distinguishable: {diff:+.4} ± {pm:.4} ({}, 95%) holds 0",
                seeds(n_a, n_b, paired)
            ),
            Self::Better {
                by,
                pm,
                n_a,
                n_b,
                paired,
            } => write!(
                f,
                "better by {by:.4} ± {pm:.4} ({}, 95%)",
                seeds(n_a, n_b, paired)
            ),
            Self::Worse {
                by,
                pm,
                n_a,
                n_b,
                paired,
            } => write!(
                f,
                "worse by {by:.4} ± {pm:.4} ({}, 95%)",
                seeds(n_a, n_b, paired)
            ),
            Self::Differs { diff } => write!(
                f,
                "{} by {:.4} (one run on a side: the seed noise is unknown; compare groups of seeds, `weft train --seeds N`)",
                if diff < 0.0 { "lower" } else { "higher" },
                diff.abs()
            ),
            Self::Unknown => write!(f, "unknown (a final figure is missing or not finite)"),
        }
    }
}

/// The 95% interval a verdict stands on: paired by seed where the groups
/// ran the same seeds ([`pair_by_seed`]), Welch's otherwise.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Interval {
    /// The runs paired by seed.
    Paired(Paired),
    /// Two independent groups.
    Welch(Welch),
}

impl Interval {
    /// [`Paired`] over `pairs` where given, else [`Welch`] over the final
    /// figures `a` and `b`; `None` when that interval has too few runs.
    #[must_use]
    pub fn of(a: &[f64], b: &[f64], pairs: Option<&[(f64, f64)]>) -> Option<Self> {
        match pairs {
            Some(p) => Paired::new(p).map(Self::Paired),
            None => Welch::new(a, b).map(Self::Welch),
        }
    }

    /// The candidate's mean minus the baseline's.
    #[must_use]
    pub fn diff(&self) -> f64 {
        match self {
            Self::Paired(p) => p.diff,
            Self::Welch(w) => w.diff,
        }
    }

    /// The interval's half-width.
    #[must_use]
    pub fn half_width(&self) -> f64 {
        match self {
            Self::Paired(p) => p.half_width,
            Self::Welch(w) => w.half_width,
        }
    }

    /// `"paired"` or `"welch"`.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Paired(_) => "paired",
            Self::Welch(_) => "welch",
        }
    }
}

/// The verdict on a candidate against the baseline: `curves` is the
/// per-step difference of their (mean) curves, `a` and `b` the final
/// figure of each run of the baseline and of the candidate (lower is
/// better), `pairs` those figures paired by seed where the groups ran the
/// same seeds ([`pair_by_seed`]), `tol` the tolerance for "equal within".
///
/// In order: bitwise identical (every shared step and every final figure
/// equal bit for bit, run by run); equal within `tol` (the curves and the
/// means of the finals); with at least two runs on each side, the 95%
/// [`Interval`] (paired by seed, or Welch's) decides between better, worse
/// and not distinguishable; with one run on a side, the runs only differ.
#[must_use]
pub fn verdict(
    curves: &StepDiff,
    a: &[f64],
    b: &[f64],
    pairs: Option<&[(f64, f64)]>,
    tol: Option<f64>,
) -> Verdict {
    if a.is_empty() || b.is_empty() || a.iter().chain(b).any(|x| !x.is_finite()) {
        return Verdict::Unknown;
    }
    let same_finals =
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    if same_finals && (curves.points.is_empty() || curves.bitwise()) {
        return Verdict::BitwiseIdentical;
    }
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    let final_diff = mean(b) - mean(a);
    if let Some(tol) = tol {
        let max_abs = curves.max_abs.max(final_diff.abs());
        if max_abs <= tol {
            return Verdict::EqualWithin { tol, max_abs };
        }
    }
    let Some(i) = Interval::of(a, b, pairs) else {
        return Verdict::Differs { diff: final_diff };
    };
    let (diff, pm, paired) = (i.diff(), i.half_width(), pairs.is_some());
    let (n_a, n_b) = (a.len(), b.len());
    if diff.abs() <= pm {
        Verdict::NotDistinguishable {
            diff,
            pm,
            n_a,
            n_b,
            paired,
        }
    } else if diff < 0.0 {
        Verdict::Better {
            by: -diff,
            pm,
            n_a,
            n_b,
            paired,
        }
    } else {
        Verdict::Worse {
            by: diff,
            pm,
            n_a,
            n_b,
            paired,
        }
    }
}

/// `P(T ≤ t)` for Student's t distribution with `df` degrees of freedom
/// (`df` > 0, fractional allowed; infinite: the standard normal).
#[must_use]
pub fn student_t_cdf(t: f64, df: f64) -> f64 {
    if t.is_nan() || df.is_nan() || df <= 0.0 {
        return f64::NAN;
    }
    if df.is_infinite() {
        return 0.5 * erfc(-t / std::f64::consts::SQRT_2);
    }
    let x = df / (df + t * t);
    let tail = 0.5 * inc_beta(df / 2.0, 0.5, x);
    if t > 0.0 { 1.0 - tail } else { tail }
}

/// The `p`-quantile of Student's t distribution with `df` degrees of
/// freedom: the `t` with [`student_t_cdf`]`(t, df) = p`, found by
/// bisection to 1e-12.
#[must_use]
pub fn student_t_quantile(p: f64, df: f64) -> f64 {
    if !(p > 0.0 && p < 1.0) || df.is_nan() || df <= 0.0 {
        return f64::NAN;
    }
    if p < 0.5 {
        return -student_t_quantile(1.0 - p, df);
    }
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    while student_t_cdf(hi, df) < p {
        hi *= 2.0;
        if hi > 1e12 {
            return f64::INFINITY;
        }
    }
    while hi - lo > 1e-12 * hi.max(1.0) {
        let mid = 0.5 * (lo + hi);
        if student_t_cdf(mid, df) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// `ln Γ(x)` for `x > 0` (Lanczos, g = 7, 9 terms; about 1e-15 relative).
fn ln_gamma(x: f64) -> f64 {
    const G: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // reflection
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = G[0];
    let t = x + 7.5;
    for (i, g) in G.iter().enumerate().skip(1) {
        a += g / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// The regularized incomplete beta function `I_x(a, b)`, by its continued
/// fraction (modified Lentz), using the symmetry `I_x(a,b) = 1 −
/// I_{1−x}(b,a)` where the fraction converges slowly.
fn inc_beta(a: f64, b: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    let ln_front = ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (1.0 - x).ln();
    if x < (a + 1.0) / (a + b + 2.0) {
        ln_front.exp() * beta_fraction(a, b, x) / a
    } else {
        1.0 - ln_front.exp() * beta_fraction(b, a, 1.0 - x) / b
    }
}

fn beta_fraction(a: f64, b: f64, x: f64) -> f64 {
    const TINY: f64 = 1e-300;
    let (qab, qap, qam) = (a + b, a + 1.0, a - 1.0);
    let mut c = 1.0;
    let mut d = 1.0 - qab * x / qap;
    if d.abs() < TINY {
        d = TINY;
    }
    d = 1.0 / d;
    let mut h = d;
    for m in 1..=300 {
        let m = f64::from(m);
        let m2 = 2.0 * m;
        let aa = m * (b - m) * x / ((qam + m2) * (a + m2));
        d = 1.0 + aa * d;
        if d.abs() < TINY {
            d = TINY;
        }
        c = 1.0 + aa / c;
        if c.abs() < TINY {
            c = TINY;
        }
        d = 1.0 / d;
        h *= d * c;
        let aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2));
        d = 1.0 + aa * d;
        if d.abs() < TINY {
            d = TINY;
        }
        c = 1.0 + aa / c;
        if c.abs() < TINY {
            c = TINY;
        }
        d = 1.0 / d;
        let del = d * c;
        h *= del;
        if (del - 1.0).abs() < 1e-15 {
            break;
        }
    }
    h
}

/// The complementary error function (Numerical Recipes' Chebyshev fit,
/// about 1.2e-7 relative; used only for infinite degrees of freedom).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t
        * (-z * z - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87
                                        + t * (-0.822_152_23 + t * 0.170_872_77)))))))))
            .exp();
    if x >= 0.0 { r } else { 2.0 - r }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two-sided 95% critical values, t_{0.975, df}, from the published
    /// table (e.g. NIST/SEMATECH e-Handbook of Statistical Methods,
    /// 1.3.6.7.2, "Critical values of the Student's t distribution").
    const T975: [(f64, f64); 10] = [
        (1.0, 12.706),
        (2.0, 4.303),
        (3.0, 3.182),
        (4.0, 2.776),
        (5.0, 2.571),
        (6.0, 2.447),
        (10.0, 2.228),
        (20.0, 2.086),
        (30.0, 2.042),
        (100.0, 1.984),
    ];

    #[test]
    fn t_quantiles_match_the_published_table() {
        for (df, want) in T975 {
            let got = student_t_quantile(0.975, df);
            assert!((got - want).abs() < 6e-4, "df {df}: {got} vs {want}");
        }
        // one-sided 0.95 and 0.995 columns of the same table
        for (p, df, want) in [(0.95, 3.0, 2.353), (0.95, 10.0, 1.812), (0.995, 5.0, 4.032)] {
            let got = student_t_quantile(p, df);
            assert!((got - want).abs() < 6e-4, "p {p} df {df}: {got} vs {want}");
        }
        assert!((student_t_quantile(0.975, f64::INFINITY) - 1.960).abs() < 6e-4);
        assert!((student_t_quantile(0.025, 4.0) + 2.776).abs() < 6e-4);
        // closed forms: df = 1 is Cauchy, df = 2 has F(t) = 1/2 + t/(2 sqrt(2 + t²))
        for t in [-3.0f64, -0.5, 0.0, 0.7, 4.0] {
            let cauchy = 0.5 + t.atan() / std::f64::consts::PI;
            assert!((student_t_cdf(t, 1.0) - cauchy).abs() < 1e-12, "{t}");
            let two = 0.5 + t / (2.0 * (2.0 + t * t).sqrt());
            assert!((student_t_cdf(t, 2.0) - two).abs() < 1e-12, "{t}");
        }
    }

    #[test]
    fn steps_align_and_the_bitwise_span_ends_at_the_first_difference() {
        let a = [(1, 1.0), (2, 2.0), (3, 3.0), (5, 5.0)];
        let b = [(2, 2.0), (3, 3.5), (4, 4.0), (5, 4.0)];
        let d = StepDiff::between(&a, &b);
        assert_eq!(d.points, vec![(2, 0.0), (3, 0.5), (5, -1.0)]);
        assert_eq!(d.bitwise_span, 1);
        assert_eq!(d.first_differing, Some(3));
        assert_eq!(d.max_abs, 1.0);
        assert_eq!(d.mean_abs, 0.5);
        assert_eq!(d.unmatched, 2);
        assert!(!d.bitwise());
        let same = StepDiff::between(&a, &a);
        assert!(same.bitwise());
        assert_eq!(same.bitwise_span, 4);
        // -0.0 and 0.0 are equal numbers but not equal bits
        let z = StepDiff::between(&[(1, 0.0)], &[(1, -0.0)]);
        assert_eq!(z.first_differing, Some(1));
        // a NaN on one side is the largest difference
        let n = StepDiff::between(&[(1, 1.0), (2, 1.0)], &[(1, f64::NAN), (2, 3.0)]);
        assert!(n.max_abs.is_nan());
    }

    #[test]
    fn repeated_steps_keep_the_last_value_and_groups_average_shared_steps() {
        let s = last_per_step([(1, 1.0), (2, 9.0), (3, 3.0), (2, 2.0)]);
        assert_eq!(s, vec![(1, 1.0), (2, 2.0), (3, 3.0)]);
        let m = mean_series(&[vec![(1, 1.0), (2, 2.0), (3, 3.0)], vec![(1, 3.0), (3, 5.0)]]);
        assert_eq!(m, vec![(1, 2.0), (3, 4.0)]);
        assert!(mean_series(&[]).is_empty());
    }

    #[test]
    fn verdicts_follow_their_order() {
        let a = [(1, 2.0), (2, 1.5)];
        let same = StepDiff::between(&a, &a);
        assert_eq!(
            verdict(&same, &[1.5], &[1.5], None, None),
            Verdict::BitwiseIdentical
        );
        let close = StepDiff::between(&a, &[(1, 2.0), (2, 1.5 + 1e-7)]);
        assert!(matches!(
            verdict(&close, &[1.5], &[1.5 + 1e-7], None, Some(1e-6)),
            Verdict::EqualWithin { .. }
        ));
        assert!(matches!(
            verdict(&close, &[1.5], &[1.5 + 1e-7], None, None),
            Verdict::Differs { diff } if diff > 0.0
        ));
        // groups inside their noise
        let v = verdict(&close, &[1.50, 1.52, 1.48], &[1.51, 1.49, 1.50], None, None);
        assert!(
            matches!(v, Verdict::NotDistinguishable { n_a: 3, n_b: 3, .. }),
            "{v}"
        );
        assert!(v.to_string().starts_with("not distinguishable"), "{v}");
        let v = verdict(&close, &[1.50, 1.51, 1.49], &[1.60, 1.61, 1.59], None, None);
        assert!(matches!(v, Verdict::Worse { .. }), "{v}");
        assert!(v.to_string().starts_with("worse by 0.1000 ± "), "{v}");
        assert_eq!(
            verdict(&close, &[f64::NAN], &[1.0], None, None),
            Verdict::Unknown
        );
    }

    #[test]
    fn welch_matches_scipy_on_the_textbook_example() {
        // Example 1 of Wikipedia's "Welch's t-test" article; the figures are
        // scipy.stats.ttest_ind(b, a, equal_var=False) (SciPy 1.17):
        // t = 2.455356, df = 24.988529, 95% interval (0.349237, 3.984096).
        let a = [
            27.5, 21.0, 19.0, 23.6, 17.0, 17.9, 16.9, 20.1, 21.9, 22.6, 23.1, 19.6, 19.0, 21.7,
            21.4,
        ];
        let b = [
            27.1, 22.0, 20.8, 23.4, 23.4, 23.5, 25.8, 22.0, 24.8, 20.2, 21.9, 22.1, 22.9, 20.5,
            24.4,
        ];
        let w = Welch::new(&a, &b).unwrap();
        assert!((w.diff / w.std_err - 2.455_356).abs() < 1e-5, "{w:?}");
        assert!((w.df - 24.988_529).abs() < 1e-5, "{w:?}");
        assert!((w.diff - w.half_width - 0.349_237).abs() < 1e-5, "{w:?}");
        assert!((w.diff + w.half_width - 3.984_096).abs() < 1e-5, "{w:?}");
        // fractional degrees of freedom, as Welch's are (scipy.stats.t)
        assert!((student_t_quantile(0.975, 7.3) - 2.345_067).abs() < 1e-5);
        assert!((student_t_cdf(1.3, 2.5) - 0.849_757).abs() < 1e-5);
        assert!(Welch::new(&[1.0], &[1.0, 2.0]).is_none());
        assert!(Welch::new(&[1.0, f64::NAN], &[1.0, 2.0]).is_none());
        let flat = Welch::new(&[1.0, 1.0], &[2.0, 2.0]).unwrap();
        assert_eq!((flat.half_width, flat.diff), (0.0, 1.0));
    }

    #[test]
    fn paired_matches_r_on_students_sleep_data() {
        // R's `t.test(extra ~ group, data = sleep, paired = TRUE)` (the
        // example of its documentation, Student 1908's data): mean
        // difference -1.58, t = -4.0621, df = 9, 95% interval
        // (-2.4598858, -0.7001142); here group 1 is the candidate
        let group1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0];
        let group2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4];
        let pairs: Vec<(f64, f64)> = group2.into_iter().zip(group1).collect();
        let p = Paired::new(&pairs).unwrap();
        assert!((p.diff + 1.58).abs() < 1e-12, "{p:?}");
        assert!((p.diff / p.std_err + 4.0621).abs() < 1e-4, "{p:?}");
        assert_eq!(p.df, 9.0);
        assert!((p.diff - p.half_width + 2.459_885_8).abs() < 1e-6, "{p:?}");
        assert!((p.diff + p.half_width + 0.700_114_2).abs() < 1e-6, "{p:?}");
        assert!(Paired::new(&[(1.0, 2.0)]).is_none());
        assert!(Paired::new(&[(1.0, 2.0), (f64::NAN, 1.0)]).is_none());
        // Welch on the same numbers ignores the pairing: far wider
        let w = Welch::new(&group2, &group1).unwrap();
        assert!(w.half_width > 2.0 * p.half_width, "{w:?} {p:?}");
    }

    #[test]
    fn runs_pair_only_when_both_groups_ran_the_same_seeds() {
        let s = |x: &[(u64, f64)]| -> Vec<(Option<u64>, f64)> {
            x.iter().map(|&(s, v)| (Some(s), v)).collect()
        };
        // the candidate's runs in another order: paired by seed
        let got = pair_by_seed(&s(&[(1, 1.0), (2, 2.0)]), &s(&[(2, 2.5), (1, 1.5)]));
        assert_eq!(got, Some(vec![(1.0, 1.5), (2.0, 2.5)]));
        // other seeds, a seed twice, a run without one, one run a side
        assert_eq!(
            pair_by_seed(&s(&[(1, 1.0), (2, 2.0)]), &s(&[(1, 1.0), (3, 2.0)])),
            None
        );
        assert_eq!(
            pair_by_seed(&s(&[(1, 1.0), (1, 2.0)]), &s(&[(1, 1.0), (1, 2.0)])),
            None
        );
        assert_eq!(
            pair_by_seed(
                &[(Some(1), 1.0), (None, 2.0)],
                &[(Some(1), 1.0), (None, 2.0)]
            ),
            None
        );
        assert_eq!(pair_by_seed(&s(&[(1, 1.0)]), &s(&[(1, 1.0)])), None);
        assert_eq!(
            pair_by_seed(&s(&[(1, 1.0), (2, 2.0)]), &s(&[(1, 1.0)])),
            None
        );
    }

    /// Standard normal draws (Box–Muller over a xorshift generator).
    fn normals(mut state: u64) -> impl FnMut() -> f64 {
        let mut uniform = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        move || {
            let (u, v) = (uniform(), uniform());
            (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
        }
    }

    /// Runs of one seed share most of their noise (initialisation and data
    /// order): the paired interval holds the true difference about 95% of
    /// the time, and is far narrower than Welch's, which also holds it
    /// (more often than asked: it counts the shared noise twice).
    #[test]
    fn the_paired_interval_covers_at_its_level_and_is_narrower() {
        let mut normal = normals(0x2545_F491_4F6C_DD1D);
        let (trials, shift) = (4000, -0.01);
        let (mut paired_in, mut welch_in, mut narrower) = (0, 0, 0);
        for _ in 0..trials {
            let pairs: Vec<(f64, f64)> = (0..3)
                .map(|_| {
                    let seed = 0.02 * normal();
                    (
                        2.0 + seed + 0.002 * normal(),
                        2.0 + shift + seed + 0.002 * normal(),
                    )
                })
                .collect();
            let p = Paired::new(&pairs).unwrap();
            let (a, b): (Vec<f64>, Vec<f64>) = pairs.iter().copied().unzip();
            let w = Welch::new(&a, &b).unwrap();
            paired_in += i32::from((p.diff - shift).abs() <= p.half_width);
            welch_in += i32::from((w.diff - shift).abs() <= w.half_width);
            narrower += i32::from(p.half_width < w.half_width);
        }
        let rate = |n: i32| f64::from(n) / f64::from(trials);
        assert!(
            (0.935..=0.965).contains(&rate(paired_in)),
            "paired coverage {}",
            rate(paired_in)
        );
        assert!(rate(welch_in) > 0.99, "Welch's coverage {}", rate(welch_in));
        assert!(
            rate(narrower) > 0.95,
            "paired narrower in {}",
            rate(narrower)
        );
    }

    /// The interval must hold the true difference in about 95% of
    /// repeated experiments: synthetic final losses of 3 seeds each with
    /// a known shift and unequal noise.
    #[test]
    fn the_interval_covers_the_true_difference_95_percent_of_the_time() {
        let mut normal = normals(0x9E37_79B9_7F4A_7C15);
        let (trials, shift) = (4000, -0.03);
        let mut covered = 0;
        for _ in 0..trials {
            let a: Vec<f64> = (0..3).map(|_| 2.0 + 0.02 * normal()).collect();
            let b: Vec<f64> = (0..3).map(|_| 2.0 + shift + 0.01 * normal()).collect();
            let w = Welch::new(&a, &b).unwrap();
            if (w.diff - shift).abs() <= w.half_width {
                covered += 1;
            }
        }
        let rate = f64::from(covered) / f64::from(trials);
        // Welch's interval is close to nominal (slightly conservative at
        // n = 3); 4000 trials have a standard error of 0.0035
        assert!((0.935..=0.975).contains(&rate), "coverage {rate}");
    }
}
