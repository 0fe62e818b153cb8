//! Dynamic loss scaling for fp16 training, and finiteness checks.

use crate::{Element, Error};

/// Settings of a [`DynamicLossScaler`]. The defaults are the usual fp16
/// recipe (PyTorch's `GradScaler`, Megatron-LM): start at 2^16, double after
/// 2000 consecutive finite steps, halve on an overflow.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScalerConfig {
    /// Scale of the first step. Must be finite and positive.
    pub init_scale: f32,
    /// Factor applied after `growth_interval` finite steps in a row. Must be > 1.
    pub growth_factor: f32,
    /// Factor applied when a step overflows. Must be in (0, 1).
    pub backoff_factor: f32,
    /// Consecutive finite steps before the scale grows. Must be ≥ 1.
    pub growth_interval: u32,
    /// The scale never falls below this (finite, positive, ≤ `max_scale`).
    pub min_scale: f32,
    /// The scale never grows above this (finite, ≥ `min_scale`).
    pub max_scale: f32,
}

impl Default for LossScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            min_scale: 1.0,
            max_scale: 2f32.powi(24),
        }
    }
}

/// What the training step should do with the gradients it just checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepDecision {
    /// Gradients are finite: unscale them and apply the optimizer step.
    Apply,
    /// Gradients overflowed: skip the optimizer step; the scale was reduced.
    Skip,
}

/// The scaler's state, for checkpoints: restoring it continues the run
/// exactly.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScalerState {
    /// Current scale.
    pub scale: f32,
    /// Consecutive finite steps since the last change of scale.
    pub good_steps: u32,
    /// Total steps skipped because of overflow.
    pub skipped_steps: u64,
}

/// Dynamic loss scaling: multiply the loss by a large factor so fp16
/// gradients stay above the subnormal range, watch for overflow, and adapt.
///
/// Each step: compute gradients of `loss * scale()`, check them with
/// [`update_from_grads`](Self::update_from_grads) (or count non-finite values
/// yourself across ranks and call [`update`](Self::update)), then on
/// [`StepDecision::Apply`] multiply the gradients by
/// [`inv_scale`](Self::inv_scale) (the scale of the step that produced them)
/// and step the optimizer; on [`StepDecision::Skip`] do nothing.
///
/// ```
/// use weft_numerics::{DynamicLossScaler, LossScalerConfig, StepDecision};
///
/// let mut s = DynamicLossScaler::new(LossScalerConfig { growth_interval: 2, ..Default::default() })?;
/// assert_eq!(s.scale(), 65536.0);
/// let grads = [1.0f32, f32::INFINITY];
/// assert_eq!(s.update_from_grads(&grads), StepDecision::Skip);
/// assert_eq!(s.scale(), 32768.0);
/// s.update(false);
/// s.update(false);
/// assert_eq!(s.scale(), 65536.0);
/// # Ok::<(), weft_numerics::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct DynamicLossScaler {
    config: LossScalerConfig,
    state: LossScalerState,
    inv_scale_of_last_step: f32,
}

impl DynamicLossScaler {
    /// A scaler with the given settings.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the first setting out of its range.
    pub fn new(config: LossScalerConfig) -> Result<Self, Error> {
        let bad = |field: &'static str, value: f64, expected: &'static str| {
            Err(Error::InvalidConfig {
                field,
                value: value.to_string(),
                expected,
            })
        };
        let c = &config;
        if !(c.min_scale.is_finite() && c.min_scale > 0.0) {
            return bad("min_scale", f64::from(c.min_scale), "a finite value > 0");
        }
        if !(c.max_scale.is_finite() && c.max_scale >= c.min_scale) {
            return bad(
                "max_scale",
                f64::from(c.max_scale),
                "a finite value >= min_scale",
            );
        }
        if !(c.init_scale >= c.min_scale && c.init_scale <= c.max_scale) {
            return bad(
                "init_scale",
                f64::from(c.init_scale),
                "a value in [min_scale, max_scale]",
            );
        }
        if !(c.growth_factor > 1.0 && c.growth_factor.is_finite()) {
            return bad(
                "growth_factor",
                f64::from(c.growth_factor),
                "a finite value > 1",
            );
        }
        if !(c.backoff_factor > 0.0 && c.backoff_factor < 1.0) {
            return bad(
                "backoff_factor",
                f64::from(c.backoff_factor),
                "a value in (0, 1)",
            );
        }
        if c.growth_interval == 0 {
            return bad("growth_interval", 0.0, "an integer >= 1");
        }
        Ok(Self {
            state: LossScalerState {
                scale: config.init_scale,
                good_steps: 0,
                skipped_steps: 0,
            },
            inv_scale_of_last_step: 1.0 / config.init_scale,
            config,
        })
    }

    /// Restores a scaler from a checkpointed state.
    ///
    /// # Errors
    /// As [`new`](Self::new), and [`Error::InvalidConfig`] if the state's
    /// scale is outside `[min_scale, max_scale]`.
    pub fn from_state(config: LossScalerConfig, state: LossScalerState) -> Result<Self, Error> {
        let mut s = Self::new(config)?;
        if !(state.scale >= config.min_scale && state.scale <= config.max_scale) {
            return Err(Error::InvalidConfig {
                field: "state.scale",
                value: state.scale.to_string(),
                expected: "a value in [min_scale, max_scale]",
            });
        }
        s.state = state;
        s.inv_scale_of_last_step = 1.0 / state.scale;
        Ok(s)
    }

    /// The factor to multiply the loss by this step.
    pub fn scale(&self) -> f32 {
        self.state.scale
    }

    /// `1 / scale` of the step most recently checked (or of the next step,
    /// before any check): multiply that step's gradients by it.
    pub fn inv_scale(&self) -> f32 {
        self.inv_scale_of_last_step
    }

    /// The state to checkpoint.
    pub fn state(&self) -> LossScalerState {
        self.state
    }

    /// The settings.
    pub fn config(&self) -> &LossScalerConfig {
        &self.config
    }

    /// Records the outcome of a step whose gradients were (`true`) or were
    /// not (`false`) found to contain an infinity or NaN, and adapts the
    /// scale. In data-parallel training, `found_nonfinite` must be the same on
    /// every rank (reduce the counts first).
    pub fn update(&mut self, found_nonfinite: bool) -> StepDecision {
        let c = &self.config;
        let s = &mut self.state;
        self.inv_scale_of_last_step = 1.0 / s.scale;
        if found_nonfinite {
            s.scale = (s.scale * c.backoff_factor).max(c.min_scale);
            s.good_steps = 0;
            s.skipped_steps += 1;
            StepDecision::Skip
        } else {
            s.good_steps += 1;
            if s.good_steps >= c.growth_interval {
                s.scale = (s.scale * c.growth_factor).min(c.max_scale);
                s.good_steps = 0;
            }
            StepDecision::Apply
        }
    }

    /// Checks `grads` with [`count_nonfinite`] and calls
    /// [`update`](Self::update).
    pub fn update_from_grads<T: Element>(&mut self, grads: &[T]) -> StepDecision {
        self.update(count_nonfinite(grads) > 0)
    }
}

/// Number of infinities and NaNs in `xs`, by exponent bits (vectorized).
pub fn count_nonfinite<T: Element>(xs: &[T]) -> usize {
    use crate::Dtype;
    let (ptr, n) = (xs.as_ptr(), xs.len());
    match T::DTYPE {
        Dtype::F64 => {
            // SAFETY: T is f64 (the Element trait is sealed), which has the
            // layout of u64.
            let bits = unsafe { std::slice::from_raw_parts(ptr.cast::<u64>(), n) };
            count_u64(bits, 0x7ff0_0000_0000_0000)
        }
        Dtype::F32 => {
            // SAFETY: T is f32, which has the layout of u32.
            let bits = unsafe { std::slice::from_raw_parts(ptr.cast::<u32>(), n) };
            count_u32(bits, 0x7f80_0000)
        }
        Dtype::F16 => {
            // SAFETY: T is half::f16, a repr(transparent) u16.
            let bits = unsafe { std::slice::from_raw_parts(ptr.cast::<u16>(), n) };
            count_u16(bits, 0x7c00)
        }
        Dtype::BF16 => {
            // SAFETY: T is half::bf16, a repr(transparent) u16.
            let bits = unsafe { std::slice::from_raw_parts(ptr.cast::<u16>(), n) };
            count_u16(bits, 0x7f80)
        }
    }
}

macro_rules! count_exp_all_ones {
    ($name:ident, $u:ty) => {
        crate::simd::multiversion! {
            /// Number of elements whose exponent field (`mask`) is all ones.
            fn $name(bits: &[$u], mask: $u) -> usize {
                // Sum in a narrow counter per block so the compare results
                // stay in wide SIMD lanes; blocks keep it from overflowing.
                bits.chunks(1 << 15)
                    .map(|c| c.iter().map(|&b| u32::from((b & mask) == mask)).sum::<u32>() as usize)
                    .sum()
            }
        }
    };
}

count_exp_all_ones!(count_u64, u64);
count_exp_all_ones!(count_u32, u32);
count_exp_all_ones!(count_u16, u16);

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn counts_nonfinite_in_every_dtype() {
        let xs = [
            1.0f32,
            f32::NAN,
            f32::INFINITY,
            -f32::INFINITY,
            f32::MAX,
            0.0,
            -0.0,
            1e-45,
        ];
        assert_eq!(count_nonfinite(&xs), 3);
        let d: Vec<f64> = xs.iter().map(|&x| f64::from(x)).collect();
        assert_eq!(count_nonfinite(&d), 3);
        let h: Vec<f16> = xs.iter().map(|&x| f16::from_f32(x)).collect();
        assert_eq!(count_nonfinite(&h), 4); // f32::MAX overflows f16
        let b: Vec<bf16> = xs.iter().map(|&x| bf16::from_f32(x)).collect();
        assert_eq!(count_nonfinite(&b), 4); // f32::MAX rounds up past bf16's max
        assert_eq!(count_nonfinite::<f32>(&[]), 0);
    }

    #[test]
    fn grows_backs_off_and_clamps() {
        let mut s = DynamicLossScaler::new(LossScalerConfig {
            growth_interval: 3,
            max_scale: 2f32.powi(17),
            ..Default::default()
        })
        .unwrap();
        for _ in 0..3 {
            assert_eq!(s.update(false), StepDecision::Apply);
        }
        assert_eq!(s.scale(), 131072.0);
        for _ in 0..3 {
            s.update(false);
        }
        assert_eq!(s.scale(), 131072.0, "clamped at max_scale");
        assert_eq!(s.update(true), StepDecision::Skip);
        assert_eq!(s.scale(), 65536.0);
        assert_eq!(
            s.inv_scale(),
            1.0 / 131072.0,
            "inverse of the scale that step used"
        );
        // An overflow resets the run of good steps.
        s.update(false);
        s.update(false);
        s.update(true);
        assert_eq!(s.scale(), 32768.0);
        assert_eq!(s.state().skipped_steps, 2);
        for _ in 0..40 {
            s.update(true);
        }
        assert_eq!(s.scale(), 1.0, "clamped at min_scale");
    }

    #[test]
    fn state_round_trips() {
        let c = LossScalerConfig::default();
        let mut a = DynamicLossScaler::new(c).unwrap();
        a.update(true);
        a.update(false);
        let mut b = DynamicLossScaler::from_state(c, a.state()).unwrap();
        for i in 0..5000 {
            let overflow = i % 1777 == 0;
            assert_eq!(a.update(overflow), b.update(overflow));
        }
        assert_eq!(a.state(), b.state());
    }

    #[test]
    fn rejects_bad_settings() {
        let cases = [
            (
                LossScalerConfig {
                    init_scale: f32::NAN,
                    ..Default::default()
                },
                "init_scale",
            ),
            (
                LossScalerConfig {
                    growth_factor: 1.0,
                    ..Default::default()
                },
                "growth_factor",
            ),
            (
                LossScalerConfig {
                    backoff_factor: 1.5,
                    ..Default::default()
                },
                "backoff_factor",
            ),
            (
                LossScalerConfig {
                    growth_interval: 0,
                    ..Default::default()
                },
                "growth_interval",
            ),
            (
                LossScalerConfig {
                    min_scale: 0.0,
                    ..Default::default()
                },
                "min_scale",
            ),
            (
                LossScalerConfig {
                    max_scale: 0.5,
                    ..Default::default()
                },
                "max_scale",
            ),
        ];
        for (c, field) in cases {
            let err = DynamicLossScaler::new(c).unwrap_err();
            assert!(err.to_string().contains(field), "{err}");
        }
    }
}
