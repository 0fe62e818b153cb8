//! A run's optimizer as a job's `[optim]` table sets it
//! ([`OptimConfig`]), and the hyper-parameters of one step
//! ([`OptimStep`]).

use crate::adamw::AdamW;
use crate::error::{Error, Result};
use crate::muon::{Muon, MuonScale};
use crate::schedule::{DecayShape, LrSchedule, Schedule};

/// Which optimizer a run uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum Optimizer {
    /// AdamW for every tensor.
    #[default]
    AdamW,
    /// Muon ([`Muon`]: momentum, Newton–Schulz orthogonalisation, the
    /// shape-scaled step) for the 2-D matrices of the transformer blocks
    /// (attention and MLP projections, each expert's matrices one by
    /// one); AdamW for the embeddings, the head, norms, biases and
    /// routers — the split of Jordan et al. and of Moonlight.
    Muon,
}

/// The hyper-parameters of one optimizer step: AdamW's, and Muon's for
/// a run with `name = "muon"` ([`OptimConfig::step_at`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimStep {
    /// AdamW's (every tensor Muon does not take).
    pub adamw: AdamW,
    /// Muon's, for the hidden matrices; `None`: AdamW takes them too.
    pub muon: Option<Muon>,
}

impl From<AdamW> for OptimStep {
    /// AdamW for every tensor.
    fn from(adamw: AdamW) -> Self {
        OptimStep { adamw, muon: None }
    }
}

impl From<&AdamW> for OptimStep {
    /// AdamW for every tensor.
    fn from(adamw: &AdamW) -> Self {
        OptimStep::from(*adamw)
    }
}

impl From<&OptimStep> for OptimStep {
    fn from(step: &OptimStep) -> Self {
        *step
    }
}

/// The optimizer of a run, as a job's `[optim]` table sets it: AdamW
/// for every tensor (the default), or Muon for the hidden matrices and
/// AdamW for the rest (`name = "muon"`, keys `muon_*`); the peak
/// learning rate with linear warmup then a [`Schedule`] (cosine decay to
/// a floor by default; linear, constant, or warmup-stable-decay), the
/// other hyper-parameters, and the global gradient-norm clip. With the
/// `serde` feature it (de)serializes key for key, defaults filled in,
/// unknown keys refused. The keys that shape the learning rate are those
/// of [`LrSchedule`] ([`lr_schedule`](Self::lr_schedule)).
///
/// ```
/// use weft_kernels::{OptimConfig, DecayShape, Schedule};
/// let o = OptimConfig { lr: 1.0, min_lr_ratio: 0.1, warmup_steps: 10, ..Default::default() };
/// assert_eq!(o.lr_at(4, 110), 0.5);
/// assert_eq!(o.lr_at(9, 110), 1.0);
/// assert!((o.lr_at(109, 110) - 0.1).abs() < 1e-12);
/// assert_eq!(o.at(0.5).lr, 0.5);
/// assert!(OptimConfig { beta2: 1.0, ..Default::default() }.validate().is_err());
///
/// // Warmup-stable-decay: the last 20 of 110 steps decay as 1 − √p.
/// let w = OptimConfig { schedule: Schedule::Wsd, decay_shape: DecayShape::Sqrt, decay_steps: 20, ..o };
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
pub struct OptimConfig {
    /// `"adamw"` (the default): AdamW for every tensor; `"muon"`: Muon
    /// for the 2-D hidden matrices (see [`Optimizer::Muon`]), AdamW with
    /// the keys below for the rest.
    pub name: Optimizer,
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
    /// Muon's peak learning rate (before its shape scale), following the
    /// same warmup and schedule as `lr` (unset: `lr`; with the default
    /// `muon_scale` the update has AdamW's RMS, so AdamW's rate carries
    /// over).
    pub muon_lr: Option<f64>,
    /// Muon's decoupled weight decay, times its learning rate (unset:
    /// `weight_decay`).
    pub muon_weight_decay: Option<f64>,
    /// Muon's momentum μ (0.95).
    pub muon_momentum: f64,
    /// Nesterov momentum (true).
    pub muon_nesterov: bool,
    /// Newton–Schulz iterations (5).
    pub muon_ns_steps: usize,
    /// The learning rate's shape scale: `"match_rms_adamw"` (the default;
    /// Moonlight's `0.2·sqrt(max(A, B))`) or `"original"`
    /// (`sqrt(max(1, A/B))`).
    pub muon_scale: MuonScale,
}

impl Default for OptimConfig {
    /// AdamW with a small model's settings: peak 4e-3, a floor of a
    /// tenth, 50 warmup steps, cosine decay, decay 0.1, betas (0.9,
    /// 0.95), ε 1e-8, clip at norm 1 (the `"wsd"` keys: a linear decay
    /// over the last fifth; the `muon_*` keys: torch's Muon defaults with
    /// the AdamW-RMS scale).
    fn default() -> Self {
        let muon = Muon::default();
        Self {
            name: Optimizer::AdamW,
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
            muon_lr: None,
            muon_weight_decay: None,
            muon_momentum: muon.momentum,
            muon_nesterov: muon.nesterov,
            muon_ns_steps: muon.ns_steps,
            muon_scale: muon.scale,
        }
    }
}

impl OptimConfig {
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
        self.check_muon()
    }

    /// The `muon_*` keys: in range with `name = "muon"`, left at their
    /// defaults otherwise.
    fn check_muon(&self) -> Result<()> {
        if self.name == Optimizer::AdamW {
            let d = OptimConfig::default();
            let set = [
                ("muon_lr", self.muon_lr != d.muon_lr),
                (
                    "muon_weight_decay",
                    self.muon_weight_decay != d.muon_weight_decay,
                ),
                ("muon_momentum", self.muon_momentum != d.muon_momentum),
                ("muon_nesterov", self.muon_nesterov != d.muon_nesterov),
                ("muon_ns_steps", self.muon_ns_steps != d.muon_ns_steps),
                ("muon_scale", self.muon_scale != d.muon_scale),
            ];
            if let Some((field, _)) = set.into_iter().find(|(_, s)| *s) {
                return Err(Error::Config {
                    field,
                    reason: "is a Muon setting: set name = \"muon\" to use it".into(),
                });
            }
            return Ok(());
        }
        let muon_field = |field: &'static str| match field {
            "lr" => "muon_lr",
            "momentum" => "muon_momentum",
            "weight_decay" => "muon_weight_decay",
            "ns_steps" => "muon_ns_steps",
            f => f,
        };
        self.muon_at(self.muon_lr.unwrap_or(self.lr))
            .validate()
            .map_err(|e| match e {
                Error::Config { field, reason } => Error::Config {
                    field: muon_field(field),
                    reason,
                },
                e => e,
            })
    }

    /// The hyper-parameters of optimizer step `step` (0-based) of `total`:
    /// AdamW's at [`lr_at`](Self::lr_at), and with `name = "muon"`
    /// Muon's: its peak `muon_lr` times the same schedule's factor.
    #[must_use]
    pub fn step_at(&self, step: u64, total: u64) -> OptimStep {
        let lr = self.lr_at(step, total);
        let muon = (self.name == Optimizer::Muon).then(|| {
            let peak = self.muon_lr.unwrap_or(self.lr);
            let factor = if self.lr > 0.0 { lr / self.lr } else { 0.0 };
            self.muon_at(peak * factor)
        });
        OptimStep {
            adamw: self.at(lr),
            muon,
        }
    }

    /// Muon's hyper-parameters at learning rate `lr`.
    fn muon_at(&self, lr: f64) -> Muon {
        Muon {
            lr,
            momentum: self.muon_momentum,
            nesterov: self.muon_nesterov,
            weight_decay: self.muon_weight_decay.unwrap_or(self.weight_decay),
            ns_steps: self.muon_ns_steps,
            scale: self.muon_scale,
            ..Muon::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_is_linear_and_decay_monotone() {
        let o = OptimConfig {
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
        let o = OptimConfig {
            lr: 1.0,
            warmup_steps: 0,
            ..Default::default()
        };
        assert_eq!(o.lr_at(0, 1), 1.0);
        let o = OptimConfig {
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
                OptimConfig {
                    lr: 0.0,
                    ..Default::default()
                },
                "lr",
            ),
            (
                OptimConfig {
                    min_lr_ratio: 1.5,
                    ..Default::default()
                },
                "min_lr_ratio",
            ),
            (
                OptimConfig {
                    beta1: -0.1,
                    ..Default::default()
                },
                "beta1",
            ),
            (
                OptimConfig {
                    eps: 0.0,
                    ..Default::default()
                },
                "eps",
            ),
            (
                OptimConfig {
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
        assert!(OptimConfig::default().validate().is_ok());
    }

    #[test]
    fn schedule_keys_reach_the_schedule() {
        let o = OptimConfig {
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
        let bad = OptimConfig {
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
        assert_eq!(OptimConfig::default().decay_start(1000), None);
    }

    #[cfg(feature = "serde")]
    #[test]
    fn optim_table_keys() {
        use serde::Deserialize;
        use serde::de::value::{Error as DeError, MapDeserializer};
        let table = |kv: Vec<(&'static str, &'static str)>| {
            OptimConfig::deserialize(MapDeserializer::<_, DeError>::new(kv.into_iter()))
        };
        let o = table(vec![("schedule", "wsd"), ("decay_shape", "sqrt")]).unwrap();
        assert_eq!(o.schedule, Schedule::Wsd);
        assert_eq!(o.decay_shape, DecayShape::Sqrt);
        assert_eq!(
            OptimConfig {
                schedule: Schedule::Cosine,
                decay_shape: DecayShape::Linear,
                ..o
            },
            OptimConfig::default()
        );
        assert!(table(vec![("schedule", "step")]).is_err());
        assert!(table(vec![("decay", "sqrt")]).is_err());
    }

    #[test]
    fn muon_keys_need_muon_and_follow_the_schedule() {
        let bad = OptimConfig {
            muon_lr: Some(0.02),
            ..Default::default()
        };
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("muon_lr") && e.contains("name"), "{e}");
        assert_eq!(OptimConfig::default().step_at(3, 100).muon, None);
        let o = OptimConfig {
            name: Optimizer::Muon,
            lr: 1e-3,
            muon_lr: Some(0.02),
            warmup_steps: 10,
            ..Default::default()
        };
        o.validate().unwrap();
        let s = o.step_at(4, 100);
        let m = s.muon.unwrap();
        assert!((m.lr - 0.02 * 0.5).abs() < 1e-15, "{}", m.lr);
        assert!((f64::from(s.adamw.lr) - 5e-4).abs() < 1e-9);
        assert_eq!(m.weight_decay, o.weight_decay);
        let e = OptimConfig {
            muon_momentum: 1.0,
            ..o.clone()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("muon_momentum"), "{e}");
    }
}
