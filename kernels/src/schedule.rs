//! Learning-rate schedules: linear warmup, then cosine, linear, constant,
//! or warmup-stable-decay (WSD) — pure functions of the step and the
//! run's length, checked against PyTorch's schedulers by
//! `tests/schedule_torch.rs`.
//!
//! WSD (Hu et al. 2024, "MiniCPM"; Hägele et al. 2024, "Scaling Laws and
//! Compute-Optimal Training Beyond Fixed Training Durations") holds the
//! peak rate after warmup and decays only over the last steps, so the
//! stable phase does not depend on the run's length: a checkpoint taken in
//! it can be continued into a run of another length, or with another
//! decay, whose decay starts after it (see [`LrSchedule::decay_start`]).

use std::f64::consts::PI;

use crate::error::{Error, Result};

/// The shape of the learning rate after warmup, a job's `optim.schedule`
/// (`"cosine"`, `"wsd"`, `"linear"` or `"constant"`); see
/// [`LrSchedule::lr_at`] for the formulas.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum Schedule {
    /// Cosine decay from the peak at the end of warmup to the floor at
    /// the last step (the default, and the only schedule before
    /// `schedule` existed: its values are unchanged bit for bit).
    #[default]
    Cosine,
    /// Warmup-stable-decay: the peak until the last
    /// [`LrSchedule::wsd_decay_steps`] steps, which decay to the floor in
    /// a [`DecayShape`].
    Wsd,
    /// Linear decay from the peak at the end of warmup to the floor at
    /// the last step.
    Linear,
    /// The peak after warmup, to the end (`min_lr_ratio` is not used).
    Constant,
}

impl Schedule {
    /// Every schedule, in the order of the names above.
    pub const ALL: [Schedule; 4] = [
        Schedule::Cosine,
        Schedule::Wsd,
        Schedule::Linear,
        Schedule::Constant,
    ];

    /// The name used in configs: `"cosine"`, `"wsd"`, `"linear"` or
    /// `"constant"`.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::Cosine => "cosine",
            Schedule::Wsd => "wsd",
            Schedule::Linear => "linear",
            Schedule::Constant => "constant",
        }
    }
}

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Schedule {
    type Err = Error;

    /// Parses the names [`Schedule::name`] gives.
    fn from_str(s: &str) -> Result<Self> {
        Schedule::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| Error::InvalidArgument {
                op: "schedule",
                reason: format!("`{s}` is not one of cosine, wsd, linear, constant"),
            })
    }
}

/// How the decay phase of a [`Schedule::Wsd`] run goes from the peak to
/// the floor, a job's `optim.decay_shape` (`"linear"`, `"cosine"` or
/// `"sqrt"`): [`DecayShape::factor`] of the decay's progress `p`, 1 at
/// `p = 0` and 0 at `p = 1`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum DecayShape {
    /// `1 − p` (the default, as in the reference implementations: Hägele
    /// et al.'s `wsd_schedule` and torchtitan's `decay_type`).
    #[default]
    Linear,
    /// `½·(1 + cos(π·p))`.
    Cosine,
    /// `1 − √p`, Hägele et al.'s "(1-sqrt)" cooldown, which they find
    /// reaches a lower final loss than a linear one of the same length.
    Sqrt,
}

impl DecayShape {
    /// Every shape, in the order of the names above.
    pub const ALL: [DecayShape; 3] = [DecayShape::Linear, DecayShape::Cosine, DecayShape::Sqrt];

    /// The name used in configs: `"linear"`, `"cosine"` or `"sqrt"`.
    pub fn name(self) -> &'static str {
        match self {
            DecayShape::Linear => "linear",
            DecayShape::Cosine => "cosine",
            DecayShape::Sqrt => "sqrt",
        }
    }

    /// The fraction of the way from the floor to the peak at progress `p`
    /// through the decay (`p` in `[0, 1]`): 1 at `p = 0`, exactly 0 at
    /// `p = 1`, non-increasing in between, never negative.
    ///
    /// ```
    /// use weft_kernels::DecayShape;
    /// for s in DecayShape::ALL {
    ///     assert_eq!(s.factor(0.0), 1.0);
    ///     assert_eq!(s.factor(1.0), 0.0);
    /// }
    /// assert_eq!(DecayShape::Sqrt.factor(0.25), 0.5);
    /// ```
    #[must_use]
    pub fn factor(self, p: f64) -> f64 {
        match self {
            DecayShape::Linear => 1.0 - p,
            // The cosine schedule's expression, unchanged: callers add
            // `floor + factor · (peak − floor)` in that order.
            DecayShape::Cosine => 0.5 * (1.0 + (PI * p).cos()),
            DecayShape::Sqrt => 1.0 - p.sqrt(),
        }
    }
}

impl std::fmt::Display for DecayShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DecayShape {
    type Err = Error;

    /// Parses the names [`DecayShape::name`] gives.
    fn from_str(s: &str) -> Result<Self> {
        DecayShape::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| Error::InvalidArgument {
                op: "decay_shape",
                reason: format!("`{s}` is not one of linear, cosine, sqrt"),
            })
    }
}

/// A learning-rate schedule, everything but the run's length: the keys of
/// a job's `[optim]` table that shape the rate
/// ([`OptimConfig::lr_schedule`](crate::OptimConfig::lr_schedule) builds
/// it), each field named as its key. The functions of the step take the
/// run's length `total` (its number of optimizer steps) as an argument.
///
/// ```
/// use weft_kernels::{DecayShape, LrSchedule, Schedule};
/// let s = LrSchedule {
///     schedule: Schedule::Wsd,
///     decay_shape: DecayShape::Linear,
///     decay_steps: 20,
///     ..LrSchedule::new(1.0, 0.1, 10)
/// };
/// s.validate()?;
/// s.check_steps(100)?;
/// assert_eq!(s.lr_at(4, 100), 0.5); // warmup: (4 + 1) / 10
/// assert_eq!(s.lr_at(79, 100), 1.0); // stable
/// assert_eq!(s.decay_start(100), Some(80)); // 20 steps of decay
/// assert!(s.lr_at(80, 100) < 1.0); // the first decay step is below the peak
/// assert_eq!(s.lr_at(99, 100), 0.1); // and the last is at the floor
/// # Ok::<(), weft_kernels::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// Peak learning rate (`optim.lr`).
    pub lr: f64,
    /// The floor as a fraction of `lr` (`optim.min_lr_ratio`): the floor
    /// is `lr · min_lr_ratio`, reached at the last step (not used by
    /// [`Schedule::Constant`]).
    pub min_lr_ratio: f64,
    /// Linear warmup steps (`optim.warmup_steps`).
    pub warmup_steps: u64,
    /// What follows warmup (`optim.schedule`).
    pub schedule: Schedule,
    /// The decay's shape, [`Schedule::Wsd`] only (`optim.decay_shape`).
    pub decay_shape: DecayShape,
    /// The decay's length as a fraction of the run, [`Schedule::Wsd`]
    /// only, used when `decay_steps` is 0 (`optim.decay_fraction`); see
    /// [`LrSchedule::wsd_decay_steps`].
    pub decay_fraction: f64,
    /// The decay's length in steps, [`Schedule::Wsd`] only; 0: use
    /// `decay_fraction` (`optim.decay_steps`).
    pub decay_steps: u64,
}

impl LrSchedule {
    /// `decay_fraction`'s default: the last fifth of the run decays, about
    /// the length Hägele et al. find enough to match a cosine schedule's
    /// final loss.
    pub const DEFAULT_DECAY_FRACTION: f64 = 0.2;

    /// Peak `lr`, floor `lr · min_lr_ratio`, `warmup_steps` of warmup,
    /// then [`Schedule::Cosine`]; the decay keys at their defaults.
    #[must_use]
    pub fn new(lr: f64, min_lr_ratio: f64, warmup_steps: u64) -> Self {
        LrSchedule {
            lr,
            min_lr_ratio,
            warmup_steps,
            schedule: Schedule::default(),
            decay_shape: DecayShape::default(),
            decay_fraction: Self::DEFAULT_DECAY_FRACTION,
            decay_steps: 0,
        }
    }

    /// The learning rate of optimizer step `step` (0-based) of a run of
    /// `total` steps. With `peak = lr`, `floor = lr · min_lr_ratio` and
    /// `W = warmup_steps`:
    ///
    /// * every schedule warms up linearly: `step < W` gives
    ///   `peak · (step + 1) / W`, so the first step already moves and
    ///   step `W − 1` reaches the peak (`peak · W / W`, which may round
    ///   one ulp away from `peak`);
    /// * [`Schedule::Cosine`], with `D = total − W − 1` and
    ///   `p = min((step − W) / D, 1)`,
    ///   `floor + ½·(1 + cos(π·p))·(peak − floor)`: the peak at step `W`,
    ///   the floor at the last step `total − 1`;
    /// * [`Schedule::Linear`], with the same `p`, `floor + (1 − p)·(peak −
    ///   floor)`;
    /// * [`Schedule::Constant`] stays at `peak`;
    /// * [`Schedule::Wsd`], with `K` = [`wsd_decay_steps`](Self::wsd_decay_steps)
    ///   and `s = total − K` ([`decay_start`](Self::decay_start)), the
    ///   peak for `W ≤ step < s`, then with `p = min((step − s + 1) / K,
    ///   1)`, `floor + shape(p)·(peak − floor)`, `shape` being
    ///   [`DecayShape::factor`]: the first decay step `s` is already
    ///   below the peak (`p = 1/K`) and the last step is exactly the floor
    ///   (`p = 1`), so `K` counts the steps below the peak, the floor's
    ///   included.
    ///
    /// In PyTorch terms (`tests/schedule_torch.rs` checks each): warmup is
    /// `LinearLR(start_factor=1/W, total_iters=W−1)`; cosine continues
    /// with `CosineAnnealingLR(T_max=D, eta_min=floor)` and linear with
    /// `LinearLR(1, min_lr_ratio, total_iters=D)`, both from milestone
    /// `W`; WSD is `LambdaLR` with Hägele et al.'s `wsd_schedule`
    /// multiplier (warmup from 0, `K` decay steps) evaluated one step
    /// ahead, at `step + 1` — theirs reaches the floor at step `total`,
    /// after the run, ours at its last step — or, for the linear and
    /// cosine shapes, `LinearLR(1, min_lr_ratio, total_iters=K)` or
    /// `CosineAnnealingLR(T_max=K, eta_min=floor)` from milestone `s − 1`.
    ///
    /// Degenerate runs are not errors here (see
    /// [`check_steps`](Self::check_steps)): cosine and linear with
    /// `D = 0` stay at the peak after warmup; steps past the end stay at
    /// the floor (the peak if `D = 0`); WSD with `K = 0` never decays,
    /// and with a decay phase reaching into warmup (`K > total − W`)
    /// warmup steps follow warmup and the later ones the decay as if it
    /// had started at `s`, dropping below the peak at once.
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn lr_at(&self, step: u64, total: u64) -> f64 {
        let peak = self.lr;
        let floor = peak * self.min_lr_ratio;
        let warmup = self.warmup_steps;
        if step < warmup {
            return peak * (step + 1) as f64 / warmup as f64;
        }
        let (shape, p) = match self.schedule {
            Schedule::Constant => return peak,
            Schedule::Cosine | Schedule::Linear => {
                let decay_steps = total.saturating_sub(warmup).saturating_sub(1);
                if decay_steps == 0 {
                    return peak;
                }
                let shape = if self.schedule == Schedule::Cosine {
                    DecayShape::Cosine
                } else {
                    DecayShape::Linear
                };
                (shape, (step - warmup) as f64 / decay_steps as f64)
            }
            Schedule::Wsd => {
                let k = self.wsd_decay_steps(total);
                let start = total.saturating_sub(k);
                if k == 0 || step < start {
                    return peak;
                }
                (self.decay_shape, (step - start + 1) as f64 / k as f64)
            }
        };
        floor + shape.factor(p.min(1.0)) * (peak - floor)
    }

    /// `K`, the number of decay steps of a [`Schedule::Wsd`] run of
    /// `total` steps: `decay_steps` when it is not 0, else
    /// `round(decay_fraction · total)`, rounding halves away from zero
    /// (Rust's `f64::round`; Python's `round`, as torchtitan uses it,
    /// rounds halves to even and differs at exact halves only, Hägele et
    /// al.'s `int()` truncates).
    ///
    /// ```
    /// use weft_kernels::{LrSchedule, Schedule};
    /// let s = LrSchedule { schedule: Schedule::Wsd, ..LrSchedule::new(1.0, 0.0, 0) };
    /// assert_eq!(s.wsd_decay_steps(1000), 200);
    /// assert_eq!(s.wsd_decay_steps(7), 1); // 1.4
    /// assert_eq!(s.wsd_decay_steps(8), 2); // 1.6
    /// assert_eq!(LrSchedule { decay_fraction: 0.5, ..s }.wsd_decay_steps(5), 3); // 2.5
    /// assert_eq!(LrSchedule { decay_steps: 30, ..s }.wsd_decay_steps(1000), 30);
    /// ```
    #[must_use]
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    pub fn wsd_decay_steps(&self, total: u64) -> u64 {
        if self.decay_steps != 0 {
            self.decay_steps
        } else {
            // `as` saturates (and sends NaN to 0); validate() keeps the
            // fraction in (0, 1], so the product is in [0, total].
            (self.decay_fraction * total as f64).round() as u64
        }
    }

    /// The first step of the decay phase of a [`Schedule::Wsd`] run of
    /// `total` steps, `total − K` ([`wsd_decay_steps`](Self::wsd_decay_steps)),
    /// the first step below the peak; `None` for the other schedules.
    ///
    /// Every step before it has the rate `lr · (step + 1) / warmup_steps`
    /// in warmup and `lr` after, bit for bit, whatever `total` and the
    /// decay keys (`decay_steps`, `decay_fraction`, `decay_shape`). So a
    /// checkpoint written after steps `0..c` of a run of `total` steps,
    /// with `c ≤ decay_start(total)`, was trained with exactly the rates
    /// of a run of another length `total'` (another `train.steps`) or
    /// with another decay, as long as `c ≤` that run's
    /// `decay_start(total')` too: resumed under the new settings, it
    /// continues that run as if it had been the run from the start (the
    /// trainer being deterministic otherwise) — one stable phase, several
    /// decays branched from it. A run that fails
    /// [`check_steps`](Self::check_steps) (a decay reaching into warmup)
    /// has no such stable prefix past warmup.
    ///
    /// ```
    /// use weft_kernels::{DecayShape, LrSchedule, Schedule};
    /// let short = LrSchedule { schedule: Schedule::Wsd, ..LrSchedule::new(1e-3, 0.0, 50) };
    /// let long = LrSchedule { decay_shape: DecayShape::Sqrt, decay_steps: 300, ..short };
    /// let c = short.decay_start(1000).unwrap();
    /// assert_eq!(c, 800);
    /// assert!(c <= long.decay_start(5000).unwrap());
    /// for step in 0..c {
    ///     assert_eq!(short.lr_at(step, 1000), long.lr_at(step, 5000));
    /// }
    /// assert_eq!(LrSchedule::new(1e-3, 0.0, 50).decay_start(1000), None);
    /// ```
    #[must_use]
    pub fn decay_start(&self, total: u64) -> Option<u64> {
        (self.schedule == Schedule::Wsd).then(|| total.saturating_sub(self.wsd_decay_steps(total)))
    }

    /// Checks every setting's range, and that the decay keys are set only
    /// with [`Schedule::Wsd`]: `decay_steps` other than 0,
    /// `decay_fraction` other than its default or `decay_shape` other
    /// than linear with another schedule would be ignored, so they are
    /// refused. (With both set, `decay_steps` is the decay's length: a
    /// branch of a run whose decay was a fraction sets its own steps.)
    ///
    /// # Errors
    /// [`Error::Config`] naming the first key out of range (`lr`,
    /// `min_lr_ratio`, `decay_fraction`, `decay_steps`, `decay_shape`).
    pub fn validate(&self) -> Result<()> {
        let bad = |field, reason: String| Err(Error::Config { field, reason });
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(
                "lr",
                format!("must be a finite value > 0 (got {})", self.lr),
            );
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return bad(
                "min_lr_ratio",
                format!("must be in [0, 1] (got {})", self.min_lr_ratio),
            );
        }
        let f = self.decay_fraction;
        if !(f > 0.0 && f <= 1.0) {
            return bad("decay_fraction", format!("must be in (0, 1] (got {f})"));
        }
        if self.schedule != Schedule::Wsd {
            let only_wsd = |field| {
                bad(
                    field,
                    format!(
                        "is only used by schedule = \"wsd\" (schedule is \"{}\"); remove it",
                        self.schedule
                    ),
                )
            };
            if self.decay_steps != 0 {
                return only_wsd("decay_steps");
            }
            if !self.fraction_is_default() {
                return only_wsd("decay_fraction");
            }
            if self.decay_shape != DecayShape::default() {
                return only_wsd("decay_shape");
            }
        }
        Ok(())
    }

    /// Whether `decay_fraction` is [`Self::DEFAULT_DECAY_FRACTION`], bit
    /// for bit (a config cannot tell a key left out from one set to its
    /// default).
    fn fraction_is_default(&self) -> bool {
        self.decay_fraction.to_bits() == Self::DEFAULT_DECAY_FRACTION.to_bits()
    }

    /// Checks the schedule against a run of `total` steps (after
    /// [`validate`](Self::validate), once the run's length is known): a
    /// [`Schedule::Wsd`] run needs at least one decay step, and its decay
    /// phase must not reach into warmup (`K ≤ total − warmup_steps`; the
    /// stable phase may be empty). The other schedules accept any length
    /// (a run shorter than its warmup never reaches the peak).
    ///
    /// ```
    /// use weft_kernels::{LrSchedule, Schedule};
    /// let s = LrSchedule { schedule: Schedule::Wsd, ..LrSchedule::new(1.0, 0.1, 50) };
    /// assert!(s.check_steps(1000).is_ok());
    /// let err = s.check_steps(60).unwrap_err(); // 12 decay steps, 10 after warmup
    /// assert!(err.to_string().starts_with("decay_fraction: "), "{err}");
    /// assert!(s.check_steps(2).is_err()); // 0.4 rounds to no decay step
    /// ```
    ///
    /// # Errors
    /// [`Error::Config`] naming `decay_steps`, or `decay_fraction` when it
    /// set the length.
    pub fn check_steps(&self, total: u64) -> Result<()> {
        if self.schedule != Schedule::Wsd {
            return Ok(());
        }
        let k = self.wsd_decay_steps(total);
        let (field, how) = if self.decay_steps != 0 {
            ("decay_steps", format!("{k}"))
        } else {
            (
                "decay_fraction",
                format!("{} of {total} steps, rounded, is {k}", self.decay_fraction),
            )
        };
        let room = total.saturating_sub(self.warmup_steps);
        let reason = if k == 0 {
            format!("the decay needs at least one step ({how}); raise it or set decay_steps")
        } else if k > room {
            format!(
                "the decay ({how} steps) reaches into the {} warmup steps of a {total}-step run: \
                 at most {room} steps (train.steps − warmup_steps)",
                self.warmup_steps
            )
        } else {
            return Ok(());
        };
        Err(Error::Config { field, reason })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn wsd(shape: DecayShape, decay_steps: u64) -> LrSchedule {
        LrSchedule {
            schedule: Schedule::Wsd,
            decay_shape: shape,
            decay_steps,
            ..LrSchedule::new(1.0, 0.1, 10)
        }
    }

    fn with(schedule: Schedule) -> LrSchedule {
        LrSchedule {
            schedule,
            ..LrSchedule::new(1.0, 0.1, 10)
        }
    }

    /// `lr_at` as it was before schedules (adamw.rs), verbatim.
    #[allow(clippy::cast_precision_loss)]
    fn cosine_before(peak: f64, ratio: f64, warmup: u64, step: u64, total: u64) -> f64 {
        let floor = peak * ratio;
        if step < warmup {
            return peak * (step + 1) as f64 / warmup as f64;
        }
        let decay_steps = total.saturating_sub(warmup).saturating_sub(1);
        if decay_steps == 0 {
            return peak;
        }
        let p = ((step - warmup) as f64 / decay_steps as f64).min(1.0);
        floor + 0.5 * (1.0 + (PI * p).cos()) * (peak - floor)
    }

    #[test]
    fn cosine_is_bit_identical_to_before() {
        for (peak, ratio) in [(3e-3, 0.1), (6e-4, 0.0), (1.0, 0.37), (4e-3, 1.0)] {
            for warmup in [0, 1, 7, 50] {
                for total in [0, 1, 2, 8, 51, 52, 600, 1001] {
                    let s = LrSchedule::new(peak, ratio, warmup);
                    for step in 0..total + 3 {
                        let (a, b) = (
                            s.lr_at(step, total),
                            cosine_before(peak, ratio, warmup, step, total),
                        );
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{peak} {ratio} {warmup} {total} {step}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn warmup_is_the_same_for_all() {
        for schedule in Schedule::ALL {
            let s = with(schedule);
            assert_eq!(s.lr_at(0, 100), 0.1, "{schedule}");
            assert_eq!(s.lr_at(4, 100), 0.5, "{schedule}");
            assert_eq!(s.lr_at(9, 100), 1.0, "{schedule}");
        }
    }

    #[test]
    fn cosine_and_linear_endpoints() {
        // W = 10, total = 111: D = 100 decay intervals, p = (step − 10)/100.
        for (schedule, mid) in [(Schedule::Cosine, 0.55), (Schedule::Linear, 0.55)] {
            let s = with(schedule);
            assert!(
                (s.lr_at(10, 111) - 1.0).abs() < 1e-15,
                "{schedule}: peak at W"
            );
            assert!(
                (s.lr_at(60, 111) - mid).abs() < 1e-15,
                "{schedule}: midpoint"
            );
            assert_eq!(s.lr_at(110, 111), 0.1, "{schedule}: floor at the last step");
            assert_eq!(s.lr_at(500, 111), 0.1, "{schedule}: floor past the end");
        }
        let lin = with(Schedule::Linear);
        assert!((lin.lr_at(35, 111) - (0.1 + 0.75 * 0.9)).abs() < 1e-15);
        let cos = with(Schedule::Cosine);
        let q = 0.1 + 0.5 * (1.0 + (PI * 0.25).cos()) * 0.9;
        assert!((cos.lr_at(35, 111) - q).abs() < 1e-15);
        // A run with no room to decay stays at the peak after warmup.
        assert_eq!(lin.lr_at(10, 11), 1.0);
        assert_eq!(lin.lr_at(20, 5), 1.0);
    }

    #[test]
    fn constant_ignores_the_floor() {
        let s = with(Schedule::Constant);
        for step in 10..200 {
            assert_eq!(s.lr_at(step, 100), 1.0);
        }
        let s = LrSchedule {
            warmup_steps: 0,
            ..s
        };
        assert_eq!(s.lr_at(0, 1), 1.0);
    }

    #[test]
    fn wsd_endpoints() {
        // total 100, W 10, K 20: stable 10..80, decay 80..100.
        let (peak, floor) = (1.0, 0.1);
        for shape in DecayShape::ALL {
            let s = wsd(shape, 20);
            assert_eq!(s.decay_start(100), Some(80));
            assert_eq!(s.lr_at(10, 100), peak, "{shape}");
            assert_eq!(s.lr_at(79, 100), peak, "{shape}: last stable step");
            let first = floor + shape.factor(1.0 / 20.0) * (peak - floor);
            assert_eq!(s.lr_at(80, 100), first, "{shape}: first decay step");
            assert!(first < peak, "{shape}");
            assert_eq!(s.lr_at(99, 100), floor, "{shape}: last step");
            assert_eq!(s.lr_at(150, 100), floor, "{shape}: past the end");
        }
        assert!((wsd(DecayShape::Linear, 20).lr_at(80, 100) - (0.1 + 0.95 * 0.9)).abs() < 1e-15);
        let half = 0.1 + (1.0 - 0.5f64.sqrt()) * 0.9;
        assert!((wsd(DecayShape::Sqrt, 20).lr_at(89, 100) - half).abs() < 1e-15);
        assert!((wsd(DecayShape::Cosine, 20).lr_at(89, 100) - 0.55).abs() < 1e-15);
        // One decay step: the last step alone, at the floor.
        let one = wsd(DecayShape::Sqrt, 1);
        assert_eq!(one.lr_at(98, 100), 1.0);
        assert_eq!(one.lr_at(99, 100), 0.1);
        // The decay right after warmup: step W is already below the peak.
        let all = wsd(DecayShape::Linear, 90);
        assert!(all.check_steps(100).is_ok());
        assert_eq!(all.lr_at(9, 100), 1.0);
        assert!((all.lr_at(10, 100) - (0.1 + (1.0 - 1.0 / 90.0) * 0.9)).abs() < 1e-15);
    }

    #[test]
    fn wsd_with_a_fraction() {
        let s = LrSchedule {
            decay_steps: 0,
            decay_fraction: 0.25,
            ..wsd(DecayShape::Linear, 0)
        };
        // 0.25 · 110 = 27.5 → 28 decay steps.
        assert_eq!(s.wsd_decay_steps(110), 28);
        assert_eq!(s.decay_start(110), Some(82));
        assert_eq!(s.lr_at(81, 110), 1.0);
        assert!(s.lr_at(82, 110) < 1.0);
        assert_eq!(s.lr_at(109, 110), 0.1);
    }

    #[test]
    fn wsd_misconfigured_does_not_panic() {
        // K = 0: never decays.
        let s = LrSchedule {
            decay_fraction: 0.01,
            ..wsd(DecayShape::Linear, 0)
        };
        assert_eq!(s.wsd_decay_steps(40), 0);
        assert!(s.check_steps(40).is_err());
        assert_eq!(s.lr_at(39, 40), 1.0);
        assert_eq!(s.lr_at(45, 40), 1.0);
        // K > total − W: warmup, then the rest of the decay.
        let s = wsd(DecayShape::Linear, 50);
        assert!(s.check_steps(40).is_err());
        assert_eq!(s.lr_at(9, 40), 1.0);
        // decay_start is 0: step 10 is the decay's 11th step.
        assert!((s.lr_at(10, 40) - (0.1 + (1.0 - 11.0 / 50.0) * 0.9)).abs() < 1e-15);
        assert!((s.lr_at(39, 40) - (0.1 + 0.2 * 0.9)).abs() < 1e-15);
        assert_eq!(s.lr_at(0, 0), 0.1);
    }

    fn field_of(r: Result<()>) -> &'static str {
        match r {
            Err(Error::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn settings_out_of_range_name_their_key() {
        let w = wsd(DecayShape::Sqrt, 0);
        for (s, field) in [
            (
                LrSchedule {
                    lr: f64::INFINITY,
                    ..w
                },
                "lr",
            ),
            (
                LrSchedule {
                    min_lr_ratio: -0.1,
                    ..w
                },
                "min_lr_ratio",
            ),
            (
                LrSchedule {
                    decay_fraction: 0.0,
                    ..w
                },
                "decay_fraction",
            ),
            (
                LrSchedule {
                    decay_fraction: 1.5,
                    ..w
                },
                "decay_fraction",
            ),
            (
                LrSchedule {
                    decay_fraction: f64::NAN,
                    ..w
                },
                "decay_fraction",
            ),
            (
                LrSchedule {
                    decay_steps: 10,
                    ..with(Schedule::Cosine)
                },
                "decay_steps",
            ),
            (
                LrSchedule {
                    decay_fraction: 0.3,
                    ..with(Schedule::Linear)
                },
                "decay_fraction",
            ),
            (
                LrSchedule {
                    decay_shape: DecayShape::Sqrt,
                    ..with(Schedule::Constant)
                },
                "decay_shape",
            ),
        ] {
            assert_eq!(field_of(s.validate()), field, "{s:?}");
        }
        let err = LrSchedule {
            decay_steps: 10,
            ..with(Schedule::Cosine)
        }
        .validate()
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "decay_steps: is only used by schedule = \"wsd\" (schedule is \"cosine\"); remove it"
        );
        for s in Schedule::ALL {
            assert!(with(s).validate().is_ok(), "{s}");
        }
        assert!(wsd(DecayShape::Cosine, 10).validate().is_ok());
        assert!(
            LrSchedule {
                decay_fraction: 1.0,
                ..w
            }
            .validate()
            .is_ok()
        );
    }

    #[test]
    fn check_steps_names_the_key_that_set_the_length() {
        let s = wsd(DecayShape::Linear, 91);
        assert_eq!(field_of(s.check_steps(100)), "decay_steps");
        assert!(wsd(DecayShape::Linear, 90).check_steps(100).is_ok());
        let f = LrSchedule {
            decay_fraction: 0.5,
            ..wsd(DecayShape::Linear, 0)
        };
        assert!(f.check_steps(20).is_ok()); // 10 ≤ 20 − 10
        assert_eq!(field_of(f.check_steps(19)), "decay_fraction"); // 10 > 9
        assert_eq!(field_of(f.check_steps(0)), "decay_fraction"); // 0 steps
        for s in [Schedule::Cosine, Schedule::Linear, Schedule::Constant] {
            assert!(with(s).check_steps(0).is_ok());
            assert!(with(s).check_steps(5).is_ok());
        }
    }

    #[test]
    fn names_round_trip() {
        for s in Schedule::ALL {
            assert_eq!(s.name().parse::<Schedule>().unwrap(), s);
        }
        for s in DecayShape::ALL {
            assert_eq!(s.to_string().parse::<DecayShape>().unwrap(), s);
        }
        assert!("1-sqrt".parse::<DecayShape>().is_err());
        assert!("Cosine".parse::<Schedule>().is_err());
    }

    #[cfg(feature = "serde")]
    #[test]
    fn serde_names_are_the_config_names() {
        use serde::Deserialize;
        use serde::de::IntoDeserializer;
        use serde::de::value::{Error as DeError, StrDeserializer};
        for s in Schedule::ALL {
            let d: StrDeserializer<'_, DeError> = s.name().into_deserializer();
            assert_eq!(Schedule::deserialize(d).unwrap(), s);
        }
        for s in DecayShape::ALL {
            let d: StrDeserializer<'_, DeError> = s.name().into_deserializer();
            assert_eq!(DecayShape::deserialize(d).unwrap(), s);
        }
        let d: StrDeserializer<'_, DeError> = "WSD".into_deserializer();
        assert!(Schedule::deserialize(d).is_err());
    }

    /// A valid schedule of one of the `kinds` (indices into
    /// [`Schedule::ALL`]) with a run length it accepts.
    fn valid(kinds: std::ops::Range<usize>) -> impl Strategy<Value = (LrSchedule, u64)> {
        (
            kinds,
            0usize..3,
            1e-5f64..1.0,
            prop_oneof![Just(0.0), Just(1.0), 0.0f64..1.0],
            0u64..60,
            1u64..400,
            prop_oneof![Just(0u64), 1u64..200],
            0.01f64..1.0,
        )
            .prop_filter_map(
                "decay longer than the room after warmup",
                |(kind, shape, lr, ratio, warmup, extra, steps, fraction)| {
                    let schedule = Schedule::ALL[kind];
                    let wsd = schedule == Schedule::Wsd;
                    let s = LrSchedule {
                        schedule,
                        decay_shape: if wsd {
                            DecayShape::ALL[shape]
                        } else {
                            DecayShape::Linear
                        },
                        decay_steps: if wsd { steps } else { 0 },
                        decay_fraction: if wsd && steps == 0 {
                            fraction
                        } else {
                            LrSchedule::DEFAULT_DECAY_FRACTION
                        },
                        ..LrSchedule::new(lr, ratio, warmup)
                    };
                    let total = warmup + extra;
                    (s.validate().is_ok() && s.check_steps(total).is_ok()).then_some((s, total))
                },
            )
    }

    const ANY_KIND: std::ops::Range<usize> = 0..4;
    const WSD_ONLY: std::ops::Range<usize> = 1..2;

    proptest! {
        #[test]
        fn after_warmup_within_bounds_monotone_and_reaching_the_floor((s, total) in valid(ANY_KIND)) {
            let peak = s.lr;
            let floor = peak * s.min_lr_ratio;
            // `floor + f·(peak − floor)` with f ≤ 1 may round one ulp
            // above the peak.
            let top = peak * (1.0 + 4.0 * f64::EPSILON);
            let mut prev = f64::INFINITY;
            for step in s.warmup_steps..total {
                let lr = s.lr_at(step, total);
                prop_assert!(lr >= floor && lr <= top, "step {step}: {lr} not in [{floor}, {peak}]");
                prop_assert!(lr <= prev, "step {step}: {lr} > {prev}");
                prev = lr;
            }
            let last = s.lr_at(total - 1, total);
            match s.schedule {
                Schedule::Constant => prop_assert_eq!(last, peak),
                // D = 0: no room to decay.
                Schedule::Cosine | Schedule::Linear if total < s.warmup_steps + 2 => {
                    prop_assert_eq!(last, peak);
                }
                _ => prop_assert_eq!(last, floor),
            }
            for step in 0..s.warmup_steps.min(total) {
                #[allow(clippy::cast_precision_loss)]
                let want = peak * (step + 1) as f64 / s.warmup_steps as f64;
                prop_assert_eq!(s.lr_at(step, total), want);
            }
        }

        #[test]
        fn wsd_is_stable_then_decays((s, total) in valid(WSD_ONLY)) {
            prop_assert_eq!(s.schedule, Schedule::Wsd);
            let start = s.decay_start(total).unwrap();
            prop_assert!(start >= s.warmup_steps && start < total);
            for step in s.warmup_steps..start {
                prop_assert_eq!(s.lr_at(step, total), s.lr);
            }
            if s.min_lr_ratio < 0.999 {
                prop_assert!(s.lr_at(start, total) < s.lr);
            }
        }

        /// The stable phase does not depend on the run's length or its
        /// decay: a checkpoint before both runs' decays continues either.
        #[test]
        fn the_stable_phase_is_the_same_for_any_decay(
            (s, total) in valid(WSD_ONLY),
            other_total in 1u64..2000,
            other_steps in 0u64..300,
            other_shape in 0usize..3,
        ) {
            let t = LrSchedule {
                decay_steps: other_steps,
                decay_fraction: LrSchedule::DEFAULT_DECAY_FRACTION,
                decay_shape: DecayShape::ALL[other_shape],
                ..s
            };
            let total2 = s.warmup_steps + other_total;
            prop_assume!(t.validate().is_ok() && t.check_steps(total2).is_ok());
            let c = s.decay_start(total).unwrap().min(t.decay_start(total2).unwrap());
            for step in 0..c {
                prop_assert_eq!(s.lr_at(step, total).to_bits(), t.lr_at(step, total2).to_bits());
            }
        }
    }
}
