//! The AdamW update (Loshchilov & Hutter, "Decoupled Weight Decay
//! Regularization", Algorithm 2), in the form `torch.optim.AdamW` computes.

use rayon::prelude::*;

use crate::Real;
use crate::error::{Error, Result, check};
use crate::schedule::{DecayShape, LrSchedule, Schedule};

/// AdamW hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay, e.g. 0.9.
    pub beta1: f32,
    /// Second-moment decay, e.g. 0.95 or 0.999.
    pub beta2: f32,
    /// Added to the denominator, e.g. 1e-8.
    pub eps: f32,
    /// Decoupled weight decay, applied only where the decay mask says so.
    pub weight_decay: f32,
}

impl Default for AdamW {
    /// PyTorch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, decay 0.01.
    fn default() -> Self {
        AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// AdamW over a run, as a job's `[optim]` table sets it: the peak
/// learning rate with linear warmup then a [`Schedule`] (cosine decay to
/// a floor by default; linear, constant, or warmup-stable-decay), the
/// other hyper-parameters, and the global gradient-norm clip. With the
/// `serde` feature it (de)serializes key for key, defaults filled in,
/// unknown keys refused. The keys that shape the learning rate are those
/// of [`LrSchedule`] ([`lr_schedule`](Self::lr_schedule)).
///
/// ```
/// use weft_kernels::{AdamWConfig, DecayShape, Schedule};
/// let o = AdamWConfig { lr: 1.0, min_lr_ratio: 0.1, warmup_steps: 10, ..Default::default() };
/// assert_eq!(o.lr_at(4, 110), 0.5);
/// assert_eq!(o.lr_at(9, 110), 1.0);
/// assert!((o.lr_at(109, 110) - 0.1).abs() < 1e-12);
/// assert_eq!(o.at(0.5).lr, 0.5);
/// assert!(AdamWConfig { beta2: 1.0, ..Default::default() }.validate().is_err());
///
/// // Warmup-stable-decay: the last 20 of 110 steps decay as 1 − √p.
/// let w = AdamWConfig { schedule: Schedule::Wsd, decay_shape: DecayShape::Sqrt, decay_steps: 20, ..o };
/// w.validate()?;
/// w.check_steps(110)?;
/// assert_eq!(w.decay_start(110), Some(90));
/// assert_eq!(w.lr_at(89, 110), 1.0);
/// assert_eq!(w.lr_at(109, 110), 0.1);
/// # Ok::<(), weft_kernels::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(deny_unknown_fields, default)
)]
pub struct AdamWConfig {
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate as a fraction of `lr`.
    pub min_lr_ratio: f64,
    /// Linear warmup steps.
    pub warmup_steps: u64,
    /// What follows warmup: `"cosine"` (the default), `"wsd"`,
    /// `"linear"` or `"constant"`; see [`LrSchedule::lr_at`].
    pub schedule: Schedule,
    /// The shape of a `"wsd"` decay: `"linear"` (the default), `"cosine"`
    /// or `"sqrt"` (1 − √p). Linear is the default of the published
    /// implementations (Hägele et al.'s `wsd_schedule`, torchtitan), so a
    /// recipe ported from them means the same here; Hägele et al. find
    /// `"sqrt"` reaches a lower final loss at the same decay length.
    /// Refused with the other schedules unless left at its default.
    pub decay_shape: DecayShape,
    /// The length of a `"wsd"` decay as a fraction of the run, in
    /// (0, 1], used when `decay_steps` is 0: `round(decay_fraction ·
    /// train.steps)` steps (default 0.2). Refused with the other
    /// schedules unless left at its default.
    pub decay_fraction: f64,
    /// The length of a `"wsd"` decay in steps (0, the default: use
    /// `decay_fraction`). At most `train.steps − warmup_steps`
    /// ([`check_steps`](Self::check_steps)). Refused with the other
    /// schedules.
    pub decay_steps: u64,
    /// Decoupled weight decay (not applied to biases and layernorms).
    pub weight_decay: f64,
    /// Adam β₁.
    pub beta1: f64,
    /// Adam β₂.
    pub beta2: f64,
    /// Adam ε.
    pub eps: f64,
    /// Global gradient-norm clip (0: off).
    pub grad_clip: f64,
}

impl Default for AdamWConfig {
    /// A small model's: peak 4e-3, a floor of a tenth, 50 warmup steps,
    /// cosine decay, decay 0.1, betas (0.9, 0.95), ε 1e-8, clip at norm
    /// 1 (the `"wsd"` keys: a linear decay over the last fifth).
    fn default() -> Self {
        Self {
            lr: 4e-3,
            min_lr_ratio: 0.1,
            warmup_steps: 50,
            schedule: Schedule::Cosine,
            decay_shape: DecayShape::Linear,
            decay_fraction: LrSchedule::DEFAULT_DECAY_FRACTION,
            decay_steps: 0,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
        }
    }
}

impl AdamWConfig {
    /// The keys that shape the learning rate.
    #[must_use]
    pub fn lr_schedule(&self) -> LrSchedule {
        LrSchedule {
            lr: self.lr,
            min_lr_ratio: self.min_lr_ratio,
            warmup_steps: self.warmup_steps,
            schedule: self.schedule,
            decay_shape: self.decay_shape,
            decay_fraction: self.decay_fraction,
            decay_steps: self.decay_steps,
        }
    }

    /// The learning rate of optimizer step `step` (0-based) of `total`
    /// ([`LrSchedule::lr_at`] has the formulas). Every schedule warms up
    /// as `lr · (step + 1) / warmup_steps`; the default, cosine, then
    /// decays from `lr` at the end of warmup to `lr · min_lr_ratio` at
    /// the last step as `min + ½·(1 + cos(π·p))·(lr − min)`, `p` going
    /// from 0 to 1.
    #[must_use]
    pub fn lr_at(&self, step: u64, total: u64) -> f64 {
        self.lr_schedule().lr_at(step, total)
    }

    /// The first decay step of a `"wsd"` run of `total` steps (`None`
    /// for the other schedules): the learning rate of every step before
    /// it depends only on `lr` and `warmup_steps`, so a checkpoint taken
    /// before it can be continued with another `train.steps` or decay
    /// ([`LrSchedule::decay_start`] states the condition).
    #[must_use]
    pub fn decay_start(&self, total: u64) -> Option<u64> {
        self.lr_schedule().decay_start(total)
    }

    /// Checks the schedule against a run of `total` steps, once its
    /// length is known: a `"wsd"` decay must have at least one step and
    /// fit after warmup ([`LrSchedule::check_steps`]).
    ///
    /// # Errors
    /// [`Error::Config`] naming `decay_steps` or `decay_fraction`.
    pub fn check_steps(&self, total: u64) -> Result<()> {
        self.lr_schedule().check_steps(total)
    }

    /// The update's hyper-parameters at learning rate `lr`.
    #[must_use]
    #[allow(clippy::cast_possible_truncation)]
    pub fn at(&self, lr: f64) -> AdamW {
        AdamW {
            lr: lr as f32,
            beta1: self.beta1 as f32,
            beta2: self.beta2 as f32,
            eps: self.eps as f32,
            weight_decay: self.weight_decay as f32,
        }
    }

    /// Checks every setting's range, and that the decay keys are set
    /// only with `schedule = "wsd"` ([`LrSchedule::validate`]); the run's
    /// length is checked by [`check_steps`](Self::check_steps).
    ///
    /// # Errors
    /// [`Error::Config`] naming the first setting out of range.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, reason: String| Err(Error::Config { field, reason });
        self.lr_schedule().validate()?;
        for (field, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(field, format!("must be in [0, 1) (got {b})"));
            }
        }
        for (field, v, min_exclusive) in [
            ("eps", self.eps, true),
            ("weight_decay", self.weight_decay, false),
            ("grad_clip", self.grad_clip, false),
        ] {
            let ok = v.is_finite() && if min_exclusive { v > 0.0 } else { v >= 0.0 };
            if !ok {
                let bound = if min_exclusive { "> 0" } else { ">= 0" };
                return bad(field, format!("must be a finite value {bound} (got {v})"));
            }
        }
        Ok(())
    }
}

const CHUNK: usize = 8192;

/// One AdamW step on a parameter tensor (or any contiguous run of them).
/// `step` counts from 1; `decay` is this tensor's entry of the decay mask
/// (GPT-2 practice: matrices decay, biases and layernorm gains do not).
///
/// ```text
/// p ← p·(1 − lr·wd·decay)
/// m ← β1·m + (1−β1)·g ;  v ← β2·v + (1−β2)·g²
/// p ← p − (lr / (1−β1^step)) · m / (sqrt(v)/sqrt(1−β2^step) + eps)
/// ```
///
/// # Errors
/// [`Error::ShapeMismatch`] if the four buffers differ in length,
/// [`Error::InvalidArgument`] if `step` is 0.
pub fn adamw_update(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    hp: &AdamW,
    step: u32,
    decay: bool,
) -> Result<()> {
    const OP: &str = "adamw_update";
    let n = params.len();
    check(OP, "grads", grads, n)?;
    check(OP, "m", m, n)?;
    check(OP, "v", v, n)?;
    let k = Consts::new(OP, hp, step, decay)?;
    params
        .par_chunks_mut(CHUNK)
        .zip(grads.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
        .for_each(|((p, g), (m, v))| adamw_chunk(p, g, m, v, k));
    Ok(())
}

/// The per-step constants of the update, derived once (the CUDA kernel is
/// fed the same values, so both compute the same bits).
#[derive(Clone, Copy)]
pub(crate) struct Consts {
    pub(crate) keep: f32,
    pub(crate) b1: f32,
    pub(crate) b2: f32,
    pub(crate) step_size: f32,
    pub(crate) bc2_sqrt: f32,
    pub(crate) eps: f32,
}

impl Consts {
    /// `keep = 1 − lr·wd` (or 1 without decay), `step_size = lr / (1 −
    /// β1^step)` and `bc2_sqrt = sqrt(1 − β2^step)`, the bias corrections
    /// in f64 then rounded to f32.
    pub(crate) fn new(op: &'static str, hp: &AdamW, step: u32, decay: bool) -> Result<Self> {
        if step == 0 {
            return Err(Error::InvalidArgument {
                op,
                reason: "step counts from 1".into(),
            });
        }
        let bc1 = 1.0 - f64::from(hp.beta1).powi(step.min(i32::MAX as u32) as i32);
        let bc2 = 1.0 - f64::from(hp.beta2).powi(step.min(i32::MAX as u32) as i32);
        Ok(Consts {
            keep: if decay {
                1.0 - hp.lr * hp.weight_decay
            } else {
                1.0
            },
            b1: hp.beta1,
            b2: hp.beta2,
            step_size: f32::from_f64(f64::from(hp.lr) / bc1),
            bc2_sqrt: f32::from_f64(bc2.sqrt()),
            eps: hp.eps,
        })
    }
}

crate::simd::multiversion! {
    fn adamw_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: Consts) {
        for i in 0..p.len() {
            let gi = g[i];
            let mi = k.b1 * m[i] + (1.0 - k.b1) * gi;
            let vi = k.b2 * v[i] + (1.0 - k.b2) * gi * gi;
            m[i] = mi;
            v[i] = vi;
            let denom = vi.sqrt() / k.bc2_sqrt + k.eps;
            p[i] = p[i] * k.keep - k.step_size * mi / denom;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_is_linear_and_decay_monotone() {
        let o = AdamWConfig {
            lr: 3e-3,
            min_lr_ratio: 0.1,
            warmup_steps: 50,
            ..Default::default()
        };
        for s in 0..50u64 {
            assert!((o.lr_at(s, 600) - 3e-3 * (s + 1) as f64 / 50.0).abs() < 1e-15);
        }
        let mut prev = f64::INFINITY;
        for s in 50..600 {
            let lr = o.lr_at(s, 600);
            assert!(lr <= prev && lr >= 3e-4 - 1e-15, "step {s}: {lr}");
            prev = lr;
        }
        // Halfway through the decay, the cosine is at its midpoint.
        let mid = 50 + 549 / 2;
        let expect = 3e-4
            + 0.5 * (1.0 + (std::f64::consts::PI * ((mid - 50) as f64 / 549.0)).cos()) * 2.7e-3;
        assert!((o.lr_at(mid, 600) - expect).abs() < 1e-15);
        assert!((o.lr_at(599, 600) - 3e-4).abs() < 1e-15);
    }

    #[test]
    fn degenerate_schedules() {
        let o = AdamWConfig {
            lr: 1.0,
            warmup_steps: 0,
            ..Default::default()
        };
        assert_eq!(o.lr_at(0, 1), 1.0);
        let o = AdamWConfig {
            lr: 1.0,
            warmup_steps: 10,
            ..Default::default()
        };
        assert_eq!(
            o.lr_at(20, 5),
            1.0,
            "past the end of a run shorter than warmup"
        );
    }

    #[test]
    fn settings_out_of_range_name_their_field() {
        for (o, field) in [
            (
                AdamWConfig {
                    lr: 0.0,
                    ..Default::default()
                },
                "lr",
            ),
            (
                AdamWConfig {
                    min_lr_ratio: 1.5,
                    ..Default::default()
                },
                "min_lr_ratio",
            ),
            (
                AdamWConfig {
                    beta1: -0.1,
                    ..Default::default()
                },
                "beta1",
            ),
            (
                AdamWConfig {
                    eps: 0.0,
                    ..Default::default()
                },
                "eps",
            ),
            (
                AdamWConfig {
                    grad_clip: f64::NAN,
                    ..Default::default()
                },
                "grad_clip",
            ),
        ] {
            assert!(
                matches!(o.validate(), Err(Error::Config { field: f, .. }) if f == field),
                "{field}"
            );
        }
        assert!(AdamWConfig::default().validate().is_ok());
    }

    #[test]
    fn schedule_keys_reach_the_schedule() {
        let o = AdamWConfig {
            lr: 2.0,
            min_lr_ratio: 0.25,
            warmup_steps: 5,
            schedule: Schedule::Wsd,
            decay_shape: DecayShape::Cosine,
            decay_fraction: 0.5,
            ..Default::default()
        };
        assert!(o.validate().is_ok());
        assert_eq!(o.decay_start(40), Some(20));
        for step in 0..45 {
            assert_eq!(o.lr_at(step, 40), o.lr_schedule().lr_at(step, 40));
        }
        assert_eq!(o.lr_at(39, 40), 0.5);
        assert!(o.check_steps(9).is_err());
        // Decay keys with another schedule are refused, by name.
        let bad = AdamWConfig {
            decay_steps: 100,
            ..Default::default()
        };
        assert!(matches!(
            bad.validate(),
            Err(Error::Config {
                field: "decay_steps",
                ..
            })
        ));
        assert_eq!(AdamWConfig::default().decay_start(1000), None);
    }

    #[cfg(feature = "serde")]
    #[test]
    fn optim_table_keys() {
        use serde::Deserialize;
        use serde::de::value::{Error as DeError, MapDeserializer};
        let table = |kv: Vec<(&'static str, &'static str)>| {
            AdamWConfig::deserialize(MapDeserializer::<_, DeError>::new(kv.into_iter()))
        };
        let o = table(vec![("schedule", "wsd"), ("decay_shape", "sqrt")]).unwrap();
        assert_eq!(o.schedule, Schedule::Wsd);
        assert_eq!(o.decay_shape, DecayShape::Sqrt);
        assert_eq!(
            AdamWConfig {
                schedule: Schedule::Cosine,
                decay_shape: DecayShape::Linear,
                ..o
            },
            AdamWConfig::default()
        );
        assert!(table(vec![("schedule", "step")]).is_err());
        assert!(table(vec![("decay", "sqrt")]).is_err());
    }

    /// Algorithm 2 of the paper (with η = 1 schedule multiplier and the
    /// decay scaled by lr as PyTorch does), evaluated in f64.
    fn reference(p: &mut [f64], g: &[Vec<f64>], hp: &AdamW, decay: bool) {
        let (b1, b2, lr, eps) = (
            f64::from(hp.beta1),
            f64::from(hp.beta2),
            f64::from(hp.lr),
            f64::from(hp.eps),
        );
        let wd = if decay {
            f64::from(hp.weight_decay)
        } else {
            0.0
        };
        let mut m = vec![0.0; p.len()];
        let mut v = vec![0.0; p.len()];
        for (t, gt) in g.iter().enumerate() {
            let t = t as i32 + 1;
            for i in 0..p.len() {
                m[i] = b1 * m[i] + (1.0 - b1) * gt[i];
                v[i] = b2 * v[i] + (1.0 - b2) * gt[i] * gt[i];
                let mh = m[i] / (1.0 - b1.powi(t));
                let vh = v[i] / (1.0 - b2.powi(t));
                p[i] -= lr * (mh / (vh.sqrt() + eps) + wd * p[i]);
            }
        }
    }

    #[test]
    fn matches_the_paper_over_ten_steps() {
        let n = 10_000;
        let hp = AdamW {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let p0 = crate::testutil::rand_vec(n, 1);
        let grads: Vec<Vec<f64>> = (0..10)
            .map(|s| crate::testutil::rand_vec(n, 10 + s))
            .collect();
        for decay in [true, false] {
            let mut want = p0.clone();
            reference(&mut want, &grads, &hp, decay);
            let mut p: Vec<f32> = p0.iter().map(|&x| x as f32).collect();
            let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
            for (s, g) in grads.iter().enumerate() {
                let g: Vec<f32> = g.iter().map(|&x| x as f32).collect();
                adamw_update(&mut p, &g, &mut m, &mut v, &hp, s as u32 + 1, decay).unwrap();
            }
            let worst = p
                .iter()
                .zip(&want)
                .map(|(&a, b)| (f64::from(a) - b).abs())
                .fold(0.0, f64::max);
            assert!(worst < 2e-6, "decay={decay}: max abs diff {worst}");
        }
    }

    #[test]
    fn bad_arguments_are_errors() {
        let hp = AdamW::default();
        let (mut p, mut m, mut v) = (vec![0.0f32; 3], vec![0.0f32; 3], vec![0.0f32; 3]);
        assert!(matches!(
            adamw_update(&mut p, &[0.0; 2], &mut m, &mut v, &hp, 1, true),
            Err(Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            adamw_update(&mut p, &[0.0; 3], &mut m, &mut v, &hp, 0, true),
            Err(Error::InvalidArgument { .. })
        ));
    }
}
